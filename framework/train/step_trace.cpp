// StepTrace: Kineto on for a range of steps (see step_trace.h).
#include "framework/train/step_trace.h"
#include "layers/core/knobs.h"

#include <torch/csrc/autograd/profiler_kineto.h>

#include <cstdlib>
#include <cstdio>
#include <filesystem>
#include <set>
#include <string>

#include <c10/util/Exception.h>

#ifdef CARRY_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace carry {

namespace {

namespace prof = torch::profiler::impl;

// On a GPU the kernels alone unless CARRY_TRACE_CPU=1: recording every ATen call slows the host enough
// to leave the GPU idle (125M, sp = 1: 14.7% of a traced step against 5.4%), which hides the gaps a
// trace is for.
std::set<prof::ActivityType> activities(bool cuda) {
  const char* cpu = knob_value("CARRY_TRACE_CPU");
  if (cuda && !(cpu && std::string(cpu) == "1")) return {prof::ActivityType::CUDA};
  std::set<prof::ActivityType> a{prof::ActivityType::CPU};
  if (cuda) a.insert(prof::ActivityType::CUDA);
  return a;
}

}  // namespace

StepTrace::StepTrace(int rank, bool cuda) : rank_(rank), cuda_(cuda) {
  const char* dir = knob_value("CARRY_TRACE");
  if (!dir || !*dir) return;
  dir_ = dir;
  if (const char* steps = knob_value("CARRY_TRACE_STEPS"); steps && *steps) {
    const std::string s = steps;
    long long a = 0, b = 0;
    char tail = 0;
    int n = std::sscanf(s.c_str(), "%lld:%lld%c", &a, &b, &tail);
    if (n == 1 && s.find(':') == std::string::npos) {  // "A": step A alone
      n = std::sscanf(s.c_str(), "%lld%c", &a, &tail) == 1 ? 2 : 0;
      b = a;
    }
    TORCH_CHECK(n == 2 && a >= 1 && b >= a, "CARRY_TRACE_STEPS: expected 'A:B' with 1 <= A <= B (the first and last ",
                "steps to trace, 1-based) or 'A' (one step), found '", s, "'");
    first_ = a, last_ = b;
  }
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  TORCH_CHECK(!ec, "CARRY_TRACE: cannot create the trace directory '", dir_, "': ", ec.message());
}

StepTrace::~StepTrace() {
  if (on_) {
    try {
      torch::autograd::profiler::disableProfiler();
    } catch (...) {
    }
  }
}

std::string StepTrace::describe() const {
  return "steps " + std::to_string(first_) + ".." + std::to_string(last_) + " to " + dir_ + "/trace_rank<r>.json";
}

void StepTrace::before_step(int64_t step) {
  if (!enabled() || on_ || step != first_) return;
  prof::ProfilerConfig config(prof::ProfilerState::KINETO);
  torch::autograd::profiler::prepareProfiler(config, activities(cuda_));
  torch::autograd::profiler::enableProfiler(config, activities(cuda_));
  on_ = true;
}

void StepTrace::after_step(int64_t step) {
  if (!on_ || step < last_) return;
#ifdef CARRY_WITH_CUDA
  if (cuda_) c10::cuda::device_synchronize();  // the traced steps' kernels end inside the trace
#endif
  auto result = torch::autograd::profiler::disableProfiler();
  on_ = false;
  const std::string path = dir_ + "/trace_rank" + std::to_string(rank_) + ".json";
  result->save(path);
}

}  // namespace carry
