// One intra-op ATen thread for the lifetime of a guard. Tests of tiny models run thousands of tiny ops
// (a decoding step, a training step of a 16-wide model), which a second thread only slows down: with
// ctest running two test processes at once on a 2-core machine, spinning threads made such tests 10x
// slower. Results do not depend on the thread count (layers/core/cpu_determinism.h).
#pragma once

#include <ATen/Parallel.h>

namespace carry::testing {

class OneThread {
 public:
  OneThread() : before_(at::get_num_threads()) { at::set_num_threads(1); }
  ~OneThread() { at::set_num_threads(before_); }
  OneThread(const OneThread&) = delete;
  OneThread& operator=(const OneThread&) = delete;

 private:
  int before_;
};
using OneCpuThread = OneThread;

}  // namespace carry::testing
