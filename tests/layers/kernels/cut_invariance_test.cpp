// The kernel forms are cut-invariant with serial states (MixerOptions::serial_states): a sequence run
// whole and the same sequence cut at a chunk boundary, the second piece starting from the first's
// final state (what the ordered scan does across ranks), give the same bits: outputs, final state and
// the gradients of every input and of the initial state. bf16 and fp32 inputs, fp32 gates and states,
// realistic gates, a nonzero initial state, cuts at every chunk boundary of a 4-chunk sequence.
// Skips itself without a GPU (and on builds without CUDA).
#include "layers/core/device.h"
#include "tests/helpers/mixer_testing.h"

#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>

namespace carry::testing {
namespace {

struct Family {
  const char* mixer;
  const char* gate;  // "gk", "g" or ""
  bool beta;         // the delta rule's step size
};

MixerInputs cut_inputs(const Family& f, int64_t B, int64_t T, int64_t H, int64_t dk, int64_t dv, at::ScalarType dt,
                       uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto o = at::TensorOptions().dtype(at::kFloat);
  MixerInputs in;
  in.q = at::randn({B, T, H, dk}, gen, o);
  in.k = at::randn({B, T, H, dk}, gen, o);
  in.k = in.k / in.k.norm(2, -1, true);
  in.v = at::randn({B, T, H, dv}, gen, o);
  auto decay = [&](at::IntArrayRef shape) {  // −g = e^u, u uniform in [log 1e-5, log 0.3]
    return -at::exp(at::rand(shape, gen, o) * (std::log(0.3) - std::log(1e-5)) + std::log(1e-5));
  };
  if (std::string(f.gate) == "gk") in.gk = decay({B, T, H, dk});
  if (std::string(f.gate) == "g") in.g = decay({B, T, H});
  if (f.beta) in.beta = at::sigmoid(at::randn({B, T, H}, gen, o));
  for (const auto& n : MixerInputs::names()) {
    Tensor& t = in.get(n);
    if (!t.defined()) continue;
    t = t.to(at::kCUDA);
    if (!MixerInputs::is_gate(n)) t = t.to(dt);
  }
  return in;
}

// o, final state, then the gradients of the inputs (names order) and of S0 for a fixed functional,
// with the sequence cut at `cut` (0: whole).
std::vector<Tensor> run_cut(const Mixer& m, const MixerInputs& in, const Tensor& s0, int64_t cut,
                            const MixerOptions& opt) {
  MixerInputs leaf;
  std::vector<Tensor> leaves;
  for (const auto& n : MixerInputs::names())
    if (in.get(n).defined()) leaves.push_back(leaf.get(n) = in.get(n).detach().requires_grad_(true));
  Tensor s0_leaf = s0.detach().requires_grad_(true);
  leaves.push_back(s0_leaf);
  MixerOutput out;
  if (cut == 0) {
    out = m.forward(leaf, {s0_leaf}, opt);
  } else {
    const int64_t T = in.q.size(1);
    MixerInputs a, b;
    for (const auto& n : MixerInputs::names())
      if (leaf.get(n).defined()) {
        a.get(n) = leaf.get(n).narrow(1, 0, cut);
        b.get(n) = leaf.get(n).narrow(1, cut, T - cut);
      }
    MixerOptions second = opt;
    second.offset = opt.offset + cut;
    auto first = m.forward(a, {s0_leaf}, opt);
    out = m.forward(b, first.final_state, second);
    out.o = at::cat({first.o, out.o}, 1);
  }
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  Tensor wo = at::randn(out.o.sizes(), gen, at::kFloat).to(out.o.device());
  Tensor ws = at::randn(out.final_state[0].sizes(), gen, at::kFloat).to(out.o.device());
  Tensor loss = (out.o.to(at::kFloat) * wo).sum() + (out.final_state[0].to(at::kFloat) * ws).sum();
  auto grads = torch::autograd::grad({loss}, leaves);
  std::vector<Tensor> r{out.o.detach(), out.final_state[0].detach()};
  for (auto& g : grads) r.push_back(g);
  return r;
}

TEST(KernelCuts, SerialStatesGiveTheBitsOfTheWhole) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  const Family families[] = {{"gated_deltanet", "g", true},
                             {"deltanet", "", true},
                             {"gla", "gk", false},
                             {"scalar_decay", "g", false},
                             {"linear_attn", "", false}};
  const int64_t B = 2, T = 256, dk = 64, dv = 128;
  // H = 16 (B = 2): the delta rule's bf16 walks in 32-column tiles (wide_state_tiles, launch.h).
  for (const int64_t H : {2, 16})
  for (const Family& f : families) {
    if (H == 16 && !f.beta) continue;  // the delta rule only
    const Mixer& m = get_mixer(f.mixer);
    for (auto dt : {at::kBFloat16, at::kFloat}) {
      auto in = cut_inputs(f, B, T, H, dk, dv, dt, 3);
      auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
      Tensor s0 = (at::randn({B, H, dk, dv}, gen, at::kFloat) * 0.1).to(at::kCUDA);
      MixerOptions opt;
      opt.form = Form::kernel;
      opt.serial_states = true;
      opt.offset = 64;
      auto whole = run_cut(m, in, s0, 0, opt);
      std::vector<std::string> names{"o", "final_state"};
      for (const auto& n : MixerInputs::names())
        if (in.get(n).defined()) names.push_back("d" + n);
      names.push_back("d_initial_state");
      for (int64_t cut : {64, 128, 192}) {
        auto piece = run_cut(m, in, s0, cut, opt);
        ASSERT_EQ(piece.size(), whole.size());
        double worst = 0;
        size_t unequal = 0;
        std::string which;
        for (size_t i = 0; i < whole.size(); ++i) {
          ASSERT_TRUE(whole[i].defined() && piece[i].defined()) << f.mixer << " entry " << i;
          if (!at::equal(whole[i], piece[i])) {
            ++unequal;
            auto diff = (whole[i].to(at::kDouble) - piece[i].to(at::kDouble)).abs();
            worst = std::max(worst, diff.max().item<double>());
            // Where: the entry's name and the token of its largest difference (dim 1 of [B,T,...]).
            auto at_max = diff.flatten().argmax().item<int64_t>();
            int64_t t = diff.dim() >= 2 ? (at_max / (diff.numel() / diff.size(0) / diff.size(1))) % diff.size(1) : -1;
            which += " " + names[i] + (i >= 2 && i + 1 < whole.size() ? "@t=" + std::to_string(t) : "");
          }
        }
        std::cout << "[ errors   ] " << f.mixer << " H=" << H << " " << c10::toString(dt) << " cut at " << cut << ": "
                  << unequal << " of " << whole.size() << " tensors differ" << which << ", max |diff| " << worst
                  << "\n";
        EXPECT_EQ(unequal, 0u) << f.mixer << " H=" << H << " " << c10::toString(dt) << " cut at " << cut;
      }
    }
  }
#endif
}

}  // namespace
}  // namespace carry::testing
