// Test helpers for mixers: the shared checking utilities of framework/cli/mixer_check.h under the test
// namespace, plus GoogleTest-side helpers.
#pragma once

#include "framework/cli/mixer_check.h"

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

// Expects `f` to throw a c10::Error whose message contains `needle`.
template <class F>
void expect_error(F f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected an error mentioning '" << needle << "'";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find(needle), std::string::npos)
        << "message was: " << e.what_without_backtrace();
  }
}

}  // namespace carry::testing
