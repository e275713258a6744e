// Runs a test's ATen work on one CPU thread while alive, then restores the thread count. For tests
// of many small operations (per-document pieces, tiny models): on a loaded 2-core machine OpenMP's
// waiting threads made them 10 to 40 times slower (0.6 s became 26 s). Results do not depend on it.
#pragma once

#include <ATen/Parallel.h>

namespace carry::testing {

class OneCpuThread {
 public:
  OneCpuThread() : before_(at::get_num_threads()) { at::set_num_threads(1); }
  ~OneCpuThread() { at::set_num_threads(before_); }
  OneCpuThread(const OneCpuThread&) = delete;
  OneCpuThread& operator=(const OneCpuThread&) = delete;

 private:
  int before_;
};

}  // namespace carry::testing
