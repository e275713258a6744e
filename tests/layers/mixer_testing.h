// Test helpers for mixers: the shared checking utilities of framework/mixer_check.h under the test
// namespace, plus GoogleTest-side helpers.
#pragma once

#include "framework/mixer_check.h"

#include <gtest/gtest.h>

namespace carry::testing {

using carry::Form;
using carry::max_rel_err;
using carry::num_levels;
using carry::random_inputs;
using carry::random_state;
using carry::rel_err;
using carry::run_with_grads;
using carry::Shape;
using Result = carry::FormResult;

}  // namespace carry::testing
