// The delta rule's kernel form (layers/kernels/delta_rule/) against its chunkwise form in fp32 on the
// same (upcast) inputs, DeltaNet and Gated DeltaNet: outputs, final state and the gradients of q, k,
// v, g, beta and the initial state for a random functional of (o, final state). Gates with half-lives
// from about 2 to 7·10^4 tokens, beta in (0, 1), L2-normalized keys, a nonzero initial state.
// Relative max error ≤ 1e-4 for fp32 inputs, ≤ 1e-2 for bf16. Outputs are poisoned (NaN) before each
// kernel run so that unwritten elements show. Skips itself without a GPU (and on builds without CUDA).
#include "layers/core/device.h"
#include "tests/helpers/mixer_testing.h"

#ifdef CARRY_WITH_CUDA
#include "layers/kernels/delta_rule/api.h"
#endif

#include <gtest/gtest.h>
#include <utility>
#include <vector>
#include <torch/csrc/autograd/autograd.h>

namespace carry::testing {
namespace {

struct Case {
  int64_t B, T, H, dk, dv;
};

// Inputs in fp32 on the GPU, FLA's conventions, realistic gates.
MixerInputs gdn_inputs(const Case& c, bool gated, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  auto f = at::TensorOptions().dtype(at::kFloat);
  MixerInputs in;
  in.q = at::randn({c.B, c.T, c.H, c.dk}, gen, f);
  in.k = at::randn({c.B, c.T, c.H, c.dk}, gen, f);
  in.k = in.k / in.k.norm(2, -1, true);
  in.v = at::randn({c.B, c.T, c.H, c.dv}, gen, f);
  in.beta = at::sigmoid(at::randn({c.B, c.T, c.H}, gen, f));
  if (gated) {  // −g = e^u, u uniform in [log 1e-5, log 0.3]: decays 0.74 ... 0.99999
    auto u = at::rand({c.B, c.T, c.H}, gen, f) * (std::log(0.3) - std::log(1e-5)) + std::log(1e-5);
    in.g = -at::exp(u);
  }
  for (const auto& n : MixerInputs::names())
    if (in.get(n).defined()) in.get(n) = in.get(n).to(at::kCUDA);
  return in;
}

// o, S, then d(q, k, v, [g], beta, S0), in fp32.
std::vector<Tensor> run(const Mixer& m, Form form, const MixerInputs& in, const Tensor& s0) {
  MixerOptions opt;
  auto r = run_with_grads(m, form, in, {s0}, opt, /*seed=*/5);
  r.outputs.insert(r.outputs.end(), r.grads.begin(), r.grads.end());
  for (auto& t : r.outputs) t = t.to(at::kFloat);
  return r.outputs;
}

// Every output of `got` finite and within `bound` of `ref` (relative max error), labelled by `what`;
// prints the errors as one "[ errors   ]" line.
void expect_close(const std::vector<Tensor>& got, const std::vector<Tensor>& ref, bool gated, double bound,
                  const std::string& what) {
  static const char* names[] = {"o", "final_state", "dq", "dk", "dv", "dg", "dbeta", "dinitial_state"};
  ASSERT_EQ(got.size(), ref.size()) << what;
  std::string line;
  for (size_t i = 0; i < ref.size(); ++i) {
    const size_t label = gated || i < 5 ? i : i + 1;  // DeltaNet has no dg
    const double e = rel_err(got[i], ref[i]);
    EXPECT_TRUE(at::isfinite(got[i]).all().item<bool>()) << what << ": " << names[label] << " has NaN (unwritten?)";
    EXPECT_LE(e, bound) << what << ": " << names[label];
    line += std::string(" ") + names[label] + " " + std::to_string(e);
  }
  std::cout << "[ errors   ] " << what << ":" << line << "\n";
}

TEST(DeltaRuleKernel, MatchesChunkwise) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  carry::kernels::delta_rule::gdn_set_poison(true);
  for (bool gated : {true, false}) {
    const Mixer& m = get_mixer(gated ? "gated_deltanet" : "deltanet");
    // dk = 128: the warpgroup walks (32-column tiles); dk = 64: the mma.sync walks, at H=16, dv=128 in
    // 32-column tiles (wide_state_tiles, on any GPU of fewer than 256 SMs), the other shapes in 16.
    for (const Case& c : {Case{1, 256, 2, 64, 64}, Case{1, 128, 16, 64, 128}, Case{2, 192, 1, 128, 256},
                          Case{1, 128, 3, 128, 128}, Case{1, 128, 16, 128, 128}}) {
      auto in = gdn_inputs(c, gated, 17 + c.T);
      auto s0 = at::randn({c.B, c.H, c.dk, c.dv}, at::kFloat).to(at::kCUDA) * 0.5;
      for (auto dt : {at::kFloat, at::kBFloat16}) {
        const MixerInputs low = inputs_as(in, dt);
        const MixerInputs up = inputs_as(low, at::kFloat);  // the reference sees the same values, upcast
        ASSERT_TRUE(m.kernel_supports(low, MixerOptions{}));
        ASSERT_EQ(m.resolve_form(low, MixerOptions{}), Form::kernel);
        auto ref = run(m, Form::chunkwise, up, s0);
        auto ker = run(m, Form::kernel, low, s0);
        expect_close(ker, ref, gated, dt == at::kFloat ? 1e-4 : 1e-2,
                     m.name() + " " + c10::toString(dt) + " B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) +
                         " H=" + std::to_string(c.H) + " dk=" + std::to_string(c.dk) + " dv=" + std::to_string(c.dv));
      }
    }
  }
  carry::kernels::delta_rule::gdn_set_poison(false);
#endif
}

// The segmented bf16 walk at dk = 128 (the chunks in P segments walked at once, each from its exact
// incoming state through the segments' maps; launch.h, plan_segments) against the chunkwise form in fp32
// (≤ 1e-2, every output and gradient, NaN-poisoned outputs) and against the one walk (≤ 1e-2), P = 2, 3
// (not a power of two) and 4, segments of 4 to 8 chunks, with dv = 64, 128, 256 and B = 2 (forced:
// the backward walks the segments too); the automatic choice at H=1, dv=128, 256 chunks (two segments
// forward, the backward one walk); and MixerOptions::serial_states walks once whatever segments are asked
// for: the one walk's bits.
TEST(DeltaRuleKernel, SegmentedWalkMatchesChunkwise) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  carry::kernels::delta_rule::gdn_set_poison(true);
  for (bool gated : {true, false}) {
    const Mixer& m = get_mixer(gated ? "gated_deltanet" : "deltanet");
    for (const Case& c : {Case{1, 1024, 2, 128, 128}, Case{2, 768, 1, 128, 256}, Case{1, 1536, 3, 128, 64},
                          Case{1, 16384, 1, 128, 128}}) {
      auto in = gdn_inputs(c, gated, 131 + c.dv);
      auto s0 = at::randn({c.B, c.H, c.dk, c.dv}, at::kFloat).to(at::kCUDA) * 0.5;
      const MixerInputs low = inputs_as(in, at::kBFloat16);
      const MixerInputs up = inputs_as(low, at::kFloat);
      auto ref = run(m, Form::chunkwise, up, s0);
      carry::kernels::delta_rule::gdn_set_segments(1);
      auto whole = run(m, Form::kernel, low, s0);
      const int64_t N = c.T / 64;
      for (int P : c.T == 16384 ? std::vector<int>{0} : std::vector<int>{2, 3, 4}) {
        if (P > 0 && N % P != 0) continue;
        carry::kernels::delta_rule::gdn_set_segments(P);
        auto seg = run(m, Form::kernel, low, s0);
        const std::string what = m.name() + " B=" + std::to_string(c.B) + " T=" + std::to_string(c.T) + " H=" +
                                 std::to_string(c.H) + " dv=" + std::to_string(c.dv) + " segments " + std::to_string(P);
        expect_close(seg, ref, gated, 1e-2, what);
        expect_close(seg, whole, gated, 1e-2, what + " against one walk");
        MixerOptions serial;
        serial.serial_states = true;
        auto r = run_with_grads(m, Form::kernel, low, {s0}, serial, /*seed=*/5);
        r.outputs.insert(r.outputs.end(), r.grads.begin(), r.grads.end());
        ASSERT_EQ(r.outputs.size(), whole.size());
        for (size_t i = 0; i < whole.size(); ++i)
          EXPECT_TRUE(at::equal(r.outputs[i].to(at::kFloat), whole[i]))
              << m.name() << " serial_states with " << P << " segments asked: output " << i << " is not one walk's";
      }
    }
  }
  carry::kernels::delta_rule::gdn_set_segments(0);
  carry::kernels::delta_rule::gdn_set_poison(false);
#endif
}

// The bf16 state walks cut into pieces (the chunk-local kernels of finished pieces on a second
// stream) give the bits of one walk: outputs, final state and every gradient, with a nonzero initial
// state and final-state gradient; 7 chunks in pieces of 3 (three pieces, the last shorter) and of 1,
// 40 chunks in five ramped pieces (4, 8, 16, 8, 4 chunks: carry::kernels::primitives::piece_cuts, as the automatic
// pieces are cut); the warpgroup walks (dk = 128) and the mma.sync walks (dk = 64) in 16- and (H=16)
// 32-column tiles.
TEST(DeltaRuleKernel, PiecesGiveTheBitsOfOneWalk) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  carry::kernels::delta_rule::gdn_set_segments(1);  // one walk: the pieces are what is tested
  carry::kernels::delta_rule::gdn_set_poison(true);
  for (bool gated : {true, false}) {
    const Mixer& m = get_mixer(gated ? "gated_deltanet" : "deltanet");
    for (const Case& c : {Case{1, 448, 2, 128, 256}, Case{2, 448, 1, 64, 128}, Case{1, 448, 16, 64, 128},
                          Case{1, 448, 16, 128, 128}, Case{1, 2560, 2, 128, 256}}) {
      auto in = gdn_inputs(c, gated, 91 + c.dv);
      const MixerInputs low = inputs_as(in, at::kBFloat16);
      auto s0 = at::randn({c.B, c.H, c.dk, c.dv}, at::kFloat).to(at::kCUDA) * 0.5;
      carry::kernels::delta_rule::gdn_set_pieces(1);
      auto whole = run(m, Form::kernel, low, s0);
      const bool ramped = c.T == 2560;
      for (int pieces : ramped ? std::vector<int>{5} : std::vector<int>{3, 7}) {
        carry::kernels::delta_rule::gdn_set_pieces(pieces, ramped);
        auto cut = run(m, Form::kernel, low, s0);
        ASSERT_EQ(whole.size(), cut.size());
        for (size_t i = 0; i < whole.size(); ++i)
          EXPECT_TRUE(at::equal(whole[i], cut[i]))
              << m.name() << " H=" << c.H << " dk=" << c.dk << " dv=" << c.dv << " pieces " << pieces
              << (ramped ? " ramped" : "") << ": output " << i
              << " differs, max |diff| " << (whole[i] - cut[i]).abs().max().item<double>();
      }
    }
  }
  carry::kernels::delta_rule::gdn_set_pieces(0);
  carry::kernels::delta_rule::gdn_set_poison(false);
  carry::kernels::delta_rule::gdn_set_segments(0);
#endif
}

// Two warpgroups a walk block (each its own 32 columns, the chunk's shared tiles loaded once for both)
// run each column's operations of one warpgroup a block: the same bits of every output,
// final state and gradient, in one walk and in pieces, dv = 64, 128 and 256.
TEST(DeltaRuleKernel, TwoWarpgroupsGiveTheBitsOfOne) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  carry::kernels::delta_rule::gdn_set_segments(1);  // one walk: the pieces are what is tested
  carry::kernels::delta_rule::gdn_set_poison(true);
  for (bool gated : {true, false}) {
    const Mixer& m = get_mixer(gated ? "gated_deltanet" : "deltanet");
    for (const Case& c : {Case{1, 448, 3, 128, 64}, Case{2, 320, 2, 128, 256}, Case{1, 448, 16, 128, 128}}) {
      auto in = gdn_inputs(c, gated, 53 + c.dv);
      const MixerInputs low = inputs_as(in, at::kBFloat16);
      auto s0 = at::randn({c.B, c.H, c.dk, c.dv}, at::kFloat).to(at::kCUDA) * 0.5;
      for (int pieces : {1, 3}) {
        carry::kernels::delta_rule::gdn_set_pieces(pieces);
        carry::kernels::delta_rule::gdn_set_walk_warpgroups(1);
        auto one = run(m, Form::kernel, low, s0);
        carry::kernels::delta_rule::gdn_set_walk_warpgroups(2);
        auto two = run(m, Form::kernel, low, s0);
        ASSERT_EQ(one.size(), two.size());
        for (size_t i = 0; i < one.size(); ++i)
          EXPECT_TRUE(at::equal(one[i], two[i]))
              << m.name() << " dv=" << c.dv << " H=" << c.H << " pieces " << pieces << ": output " << i
              << " differs, max |diff| " << (one[i] - two[i]).abs().max().item<double>();
      }
    }
  }
  carry::kernels::delta_rule::gdn_set_pieces(0);
  carry::kernels::delta_rule::gdn_set_walk_warpgroups(0);
  carry::kernels::delta_rule::gdn_set_poison(false);
  carry::kernels::delta_rule::gdn_set_segments(0);
#endif
}

// DeltaNet's warpgroup walks take no gate (GATE = false in walk_wg.cuh: no gate read, no unit factors
// e^0 applied, the V_new tile as the update's operand): they give the bits of Gated DeltaNet's with a
// zero log decay, in every output, the final state and every gradient but dg (bf16, an initial state,
// one walk and three pieces, one and two warpgroups a block and the automatic choice).
TEST(DeltaRuleKernel, UngatedWalksGiveTheBitsOfAZeroGate) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  carry::kernels::delta_rule::gdn_set_segments(1);  // one walk: the pieces are what is tested
  carry::kernels::delta_rule::gdn_set_poison(true);
  const Mixer& dn = get_mixer("deltanet");
  const Mixer& gdn = get_mixer("gated_deltanet");
  for (int warpgroups : {0, 1, 2}) {
    carry::kernels::delta_rule::gdn_set_walk_warpgroups(warpgroups);
    for (const Case& c : {Case{1, 448, 3, 128, 64}, Case{2, 320, 2, 128, 256}, Case{1, 448, 16, 128, 128}}) {
      const MixerInputs plain = inputs_as(gdn_inputs(c, false, 29 + c.dv), at::kBFloat16);
      MixerInputs zero = plain;
      zero.g = at::zeros({c.B, c.T, c.H}, plain.q.options());
      auto s0 = at::randn({c.B, c.H, c.dk, c.dv}, at::kFloat).to(at::kCUDA) * 0.5;
      for (int pieces : {1, 3}) {
        carry::kernels::delta_rule::gdn_set_pieces(pieces);
        auto u = run(dn, Form::kernel, plain, s0);   // o, S, dq, dk, dv, dbeta, dS0
        auto z = run(gdn, Form::kernel, zero, s0);  // o, S, dq, dk, dv, dg, dbeta, dS0
        ASSERT_EQ(u.size() + 1, z.size());
        z.erase(z.begin() + 5);
        const char* names[] = {"o", "final_state", "dq", "dk", "dv", "dbeta", "dinitial_state"};
        for (size_t i = 0; i < u.size(); ++i)
          EXPECT_TRUE(at::equal(u[i], z[i]))
              << "warpgroups " << warpgroups << " dv=" << c.dv << " H=" << c.H << " pieces " << pieces << ": " << names[i]
              << " differs, max |diff| " << (u[i] - z[i]).abs().max().item<double>();
      }
    }
  }
  carry::kernels::delta_rule::gdn_set_pieces(0);
  carry::kernels::delta_rule::gdn_set_walk_warpgroups(0);
  carry::kernels::delta_rule::gdn_set_poison(false);
  carry::kernels::delta_rule::gdn_set_segments(0);
#endif
}

// MixerOptions::on_final_state in the kernel form: called once, from inside the forward right after the
// state walk is enqueued (the ordered scan's send then runs beside the output kernel). A clone taken in
// the hook, on the stream at that point, must already hold the returned final state's bits: the hook
// runs after the walk, not before it. One walk, three pieces and seven segments (bf16; fp32 walks once),
// bf16 and fp32.
TEST(DeltaRuleKernel, FinalStateHookSeesTheFinishedState) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: GPU tests skipped";
#ifndef CARRY_WITH_CUDA
  GTEST_SKIP() << "built without CUDA";
#else
  for (bool gated : {true, false}) {
    const Mixer& m = get_mixer(gated ? "gated_deltanet" : "deltanet");
    const Case c{1, 448, 2, 128, 128};
    auto in = gdn_inputs(c, gated, 77);
    auto s0 = at::randn({c.B, c.H, c.dk, c.dv}, at::kFloat).to(at::kCUDA) * 0.5;
    for (auto dt : {at::kBFloat16, at::kFloat})
      for (auto [pieces, segments] : {std::pair{1, 1}, std::pair{3, 1}, std::pair{1, 7}}) {
        carry::kernels::delta_rule::gdn_set_pieces(pieces);
        carry::kernels::delta_rule::gdn_set_segments(segments);
        const MixerInputs low = inputs_as(in, dt);
        MixerOptions opt;
        opt.form = Form::kernel;
        check_state_hooks(m, low, {s0}, opt, /*grad_hook_calls=*/1,
                          m.name() + " " + c10::toString(dt) + " pieces " + std::to_string(pieces) + " segments " +
                              std::to_string(segments));
      }
  }
  carry::kernels::delta_rule::gdn_set_pieces(0);
  carry::kernels::delta_rule::gdn_set_segments(0);
#endif
}

}  // namespace
}  // namespace carry::testing
