// Sequence parallelism over MPI ranks (CTest runs this binary under mpirun -np 1, 2 and 4; the main
// below is the one of every *_test_mpi.cpp suite: the ranks agree on every test's verdict, and a
// test that fails on any rank stops the job, tests/helpers/mpi_verdicts.h). For every registered
// family with a state summary, plus a dense-transport family defined here (so that transposes and
// the order of compose are exercised before such families are registered), and for every scan
// mode: the outputs, the final state and the gradients of every input and of the initial state,
// gathered over the sp group, equal one serial chunkwise run (ordered: bit for bit; tree/allgather:
// 1e-12 in fp64, 1e-5 in fp32), also on a dp × sp grid; ordered pipelined over G = 1, 2 and H head
// groups is bit for bit the serial run too; forms that behave as the kernel forms do (bf16 in and
// out, fp32 states, the hooks called from inside) against their serial run in every mode. Also: the
// communicators' operations, the same clear error on every rank for bad layouts and head groups,
// and a timeout that names the operation instead of hanging.
#include "layers/blocks/precision.h"
#include "layers/mixer_grads.h"
#include "parallel/process_group.h"
#include "parallel/state_scan.h"
#include "tests/helpers/mixer_testing.h"
#include "tests/helpers/mpi_verdicts.h"

#include <gtest/gtest.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/cuda.h>

#include <ATen/Parallel.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <functional>
#include <limits>
#include <map>
#include <thread>

namespace carry::parallel {
namespace {

using carry::testing::random_inputs;
using carry::testing::random_state;
using carry::testing::rel_err;
using carry::testing::Shape;

// ---- a family with a dense transport, for these tests only (not registered) ----

// Gated delta rule with a position-dependent key scale, so that a summary depends on the slice's
// offset: k'_t = (1 + 0.05·((offset+t) mod 7))·k_t,
//   S_t = γ_t (I − β_t k'_t k'_tᵀ) S_{t−1} + β_t k'_t v_tᵀ,  z_t = γ_t z_{t−1} + k'_t,
//   o_t = s·S_tᵀ q_t + s·(q_t·z_t).
// State (S [B,H,dk,dv], z [B,H,dk]); transport (A [B,H,dk,dk] = Π γ_t(I − β_t k'k'ᵀ), a [B,H] = Π
// γ_t). Token recurrence inside each chunk, chunks in order: the chunkwise exactness rules hold
// trivially.
class DenseDeltaForTests final : public Mixer {
 public:
  std::string name() const override { return "test_dense_delta"; }
  std::vector<std::string> input_names() const override { return {"q", "k", "v", "g", "beta"}; }
  std::vector<std::string> state_names() const override { return {"S", "z"}; }
  State zero_state(const MixerInputs& in, const MixerOptions&) const override {
    int64_t B = in.q.size(0), H = in.q.size(2), dk = in.q.size(3), dv = in.v.size(3);
    return {at::zeros({B, H, dk, dv}, in.q.options()), at::zeros({B, H, dk}, in.q.options())};
  }
  MixerOutput naive(const MixerInputs& in, const State& init,
                    const MixerOptions& opt) const override {
    check(in, opt, false);
    return run(in, init, opt, in.q.size(1), nullptr);
  }
  MixerOutput chunkwise(const MixerInputs& in, const State& init,
                        const MixerOptions& opt) const override {
    check(in, opt, true);
    return run(in, init, opt, opt.chunk_size, nullptr);
  }
  Summary summarize(const MixerInputs& in, const MixerOptions& opt) const override {
    check(in, opt, true);
    std::vector<Tensor> transport;
    auto out = run(in, {}, opt, opt.chunk_size, &transport);
    return {transport, out.final_state};
  }
  Summary compose(const Summary& a, const Summary& b) const override {
    return {{at::matmul(b.transport[0], a.transport[0]), b.transport[1] * a.transport[1]},
            {at::matmul(b.transport[0], a.state[0]) + b.state[0],
             b.transport[1].unsqueeze(-1) * a.state[1] + b.state[1]}};
  }
  State apply(const Summary& s, const State& x) const override {
    return {at::matmul(s.transport[0], x[0]) + s.state[0],
            s.transport[1].unsqueeze(-1) * x[1] + s.state[1]};
  }

 private:
  MixerOutput run(const MixerInputs& in, const State& init, const MixerOptions& opt, int64_t chunk,
                  std::vector<Tensor>* transport) const {
    int64_t B = in.q.size(0), T = in.q.size(1), H = in.q.size(2), dk = in.q.size(3);
    State z0 = zero_state(in, opt);
    Tensor S = init.empty() ? z0[0] : init[0], z = init.empty() ? z0[1] : init[1];
    Tensor A, a;
    if (transport) {
      A = at::eye(dk, in.q.options()).expand({B, H, dk, dk});
      a = at::ones({B, H}, in.q.options());
    }
    double scale = opt.scale_for(dk);
    std::vector<Tensor> outs;
    for (int64_t c0 = 0; c0 < T; c0 += chunk) {
      for (int64_t t = c0; t < c0 + chunk; ++t) {
        double f = 1 + 0.05 * ((opt.offset + t) % 7);
        auto q = in.q.select(1, t) * scale, k = in.k.select(1, t) * f, v = in.v.select(1, t);
        auto gamma = at::exp(in.g.select(1, t)), beta = in.beta.select(1, t);
        auto kS = at::matmul(k.unsqueeze(-2), S);  // [B,H,1,dv]
        S = gamma.unsqueeze(-1).unsqueeze(-1) * (S - (beta.unsqueeze(-1) * k).unsqueeze(-1) * kS) +
            (beta.unsqueeze(-1) * k).unsqueeze(-1) * v.unsqueeze(-2);
        z = gamma.unsqueeze(-1) * z + k;
        outs.push_back(at::matmul(q.unsqueeze(-2), S).squeeze(-2) + (q * z).sum(-1, true));
        if (transport) {
          auto kk = k.unsqueeze(-1) * k.unsqueeze(-2);
          A = gamma.unsqueeze(-1).unsqueeze(-1) *
              (A - beta.unsqueeze(-1).unsqueeze(-1) * at::matmul(kk, A));
          a = gamma * a;
        }
      }
    }
    if (transport) *transport = {A, a};
    return {at::stack(outs, 1), {S, z}};
  }
};

const Mixer& dense_delta_for_tests() {
  static DenseDeltaForTests m;
  return m;
}

// test_dense_delta with its state's heads moved to dim 2 (S [B,dk,H,dv]): only zero_state is
// consulted before the scan refuses to cut its heads into groups.
class HeadsNotAtDim1ForTests final : public Mixer {
 public:
  std::string name() const override { return "test_heads_not_at_dim1"; }
  std::vector<std::string> input_names() const override { return base().input_names(); }
  std::vector<std::string> state_names() const override { return base().state_names(); }
  State zero_state(const MixerInputs& in, const MixerOptions& opt) const override {
    State z = base().zero_state(in, opt);
    return {z[0].transpose(1, 2).contiguous(), z[1]};
  }
  MixerOutput naive(const MixerInputs& in, const State& s, const MixerOptions& o) const override {
    return base().naive(in, s, o);
  }
  MixerOutput chunkwise(const MixerInputs& in, const State& s,
                        const MixerOptions& o) const override {
    return base().chunkwise(in, s, o);
  }

 private:
  static const Mixer& base() { return dense_delta_for_tests(); }
};

std::vector<std::string> family_names() {
  std::vector<std::string> names;
  for (auto& n : mixer_names())
    if (get_mixer(n).has_summary()) names.push_back(n);
  names.push_back(dense_delta_for_tests().name());
  return names;
}

const Mixer& family(const std::string& name) {
  return name == dense_delta_for_tests().name() ? dense_delta_for_tests() : get_mixer(name);
}

// ---- helpers: process groups, agreement between ranks ----

const std::vector<std::string>& kInputNames = MixerInputs::names();

std::map<std::pair<int, int>, ProcessGroups>& group_cache() {
  static std::map<std::pair<int, int>, ProcessGroups> cache;
  return cache;
}

std::map<std::pair<int, int>, ProcessGroups>& nccl_group_cache() {
  static std::map<std::pair<int, int>, ProcessGroups> cache;
  return cache;
}

// Collective on the world (every rank asks for the same layouts in the same order).
ProcessGroups& groups(int dp, int sp) {
  auto key = std::make_pair(dp, sp);
  auto& cache = group_cache();
  if (!cache.count(key)) {
    CommOptions opt;
    opt.on_timeout = CommOptions::OnTimeout::throw_error;
    cache[key] = make_process_groups({dp, sp}, Backend::mpi, opt);
  }
  return cache.at(key);
}

// NCCL groups (one GPU a rank, device = local rank).
ProcessGroups& nccl_groups(int dp, int sp) {
  auto key = std::make_pair(dp, sp);
  auto& cache = nccl_group_cache();
  if (!cache.count(key)) {
    CommOptions opt;
    opt.on_timeout = CommOptions::OnTimeout::throw_error;
    cache[key] = make_process_groups({dp, sp}, Backend::nccl, opt);
  }
  return cache.at(key);
}

// The same answer on every rank: NCCL built in and a CUDA device for each rank of this host.
bool gpus_for_every_rank() {
  bool ok = nccl_available() &&
            torch::cuda::device_count() >= static_cast<size_t>(world_info().local_size);
  double any_missing = 0, mine = ok ? 0 : 1;
  MPI_Allreduce(&mine, &any_missing, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return any_missing == 0;
}

MixerInputs to_device(const MixerInputs& in, at::Device device) {
  MixerInputs out;
  for (const auto& n : kInputNames)
    if (in.get(n).defined()) out.get(n) = in.get(n).to(device);
  return out;
}

int world_size() { return world_info().size; }
int world_rank() { return world_info().rank; }

double max_over_world(double x) {
  double y = 0;
  MPI_Allreduce(&x, &y, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return y;
}

bool all_ranks(bool ok) { return max_over_world(ok ? 0 : 1) == 0; }

// The error message of `f`, or "" if it did not throw a c10::Error.
std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

// The message of a CommError thrown by `f`, or "".
std::string error_of_comm(const std::function<void()>& f) {
  try {
    f();
  } catch (const CommError& e) {
    return e.what();
  }
  return "";
}

// Every rank threw, with `needle` in the message, and (when `same`) the very same message
// everywhere.
void expect_same_error_everywhere(const std::string& msg, const std::string& needle,
                                  bool same = true) {
  bool ok = !msg.empty() && msg.find(needle) != std::string::npos;
  EXPECT_TRUE(ok) << "rank " << world_rank() << ": expected an error mentioning '" << needle
                  << "', got: '" << msg << "'";
  EXPECT_TRUE(all_ranks(ok)) << "some rank did not get the expected error";
  if (same) {
    int64_t h = static_cast<int64_t>(std::hash<std::string>{}(msg) >> 1), lo = 0, hi = 0;
    MPI_Allreduce(&h, &lo, 1, MPI_INT64_T, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(&h, &hi, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
    EXPECT_EQ(lo, hi) << "the ranks' messages differ; rank " << world_rank() << " has: " << msg;
  }
  if (world_rank() == 0 && ok)
    std::cout << "[ message  ] " << msg.substr(0, msg.find('\n')) << "\n";
}

// ---- the scan against the serial run ----

struct Weights {
  Tensor o;                       // [B,T,H,dv]
  State final_state;              // on the sequence's final state
  std::vector<State> boundaries;  // on the state after slice r (r < P-1); empty: not in the loss
};

Weights random_weights(const Mixer& m, const MixerInputs& in, const MixerOptions& opt, int P,
                       bool boundaries, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  Weights w;
  auto zero = m.zero_state(in, opt);
  // o is [B, T, H, dv] a token (v may have several rows a token: Gated DeltaProduct's sub-steps).
  w.o = at::randn({in.q.size(0), in.q.size(1), in.q.size(2), in.v.size(3)}, gen, in.v.options());
  for (auto& t : zero) w.final_state.push_back(at::randn(t.sizes(), gen, t.options()));
  if (boundaries)
    for (int r = 0; r + 1 < P; ++r) {
      State b;
      for (auto& t : zero) b.push_back(at::randn(t.sizes(), gen, t.options()));
      w.boundaries.push_back(b);
    }
  return w;
}

struct ScanRun {
  std::vector<Tensor> outputs;  // o, then the final state entries
  std::vector<Tensor> grads;    // inputs in MixerLeaves::all() order, then the initial state entries
  // parallel_run: per gradient, whether it sums terms from several ranks or head groups (an input
  // without T, decay_rate, or one head shared by all): the order of that sum depends on the cut, so
  // such a gradient equals the serial one to rounding, not bit for bit.
  std::vector<bool> summed_over_cut;
};

Tensor weighted(const State& s, const State& w) {
  Tensor l = at::zeros({}, s[0].options());
  for (size_t i = 0; i < s.size(); ++i) l = l + (s[i] * w[i]).sum();
  return l;
}

// One process, the whole sequence: a single chunkwise call, or (with boundary weights) P pieces
// with the state passed along, so that the loss can see the states at the boundaries.
ScanRun serial_run(const Mixer& m, const MixerInputs& in, const State& init,
                   const MixerOptions& opt, const Weights& w, int P) {
  MixerLeaves leaves = make_mixer_leaves(in, init);
  ScanRun run;
  Tensor loss;
  if (w.boundaries.empty()) {
    auto out = m.chunkwise(leaves.in, leaves.state, opt);
    loss = (out.o * w.o).sum() + weighted(out.final_state, w.final_state);
    run.outputs.push_back(out.o.detach());
    for (auto& t : out.final_state) run.outputs.push_back(t.detach());
  } else {
    int64_t len = in.q.size(1) / P;
    State cur = leaves.state;
    std::vector<Tensor> os;
    loss = at::zeros({}, in.q.options());
    for (int r = 0; r < P; ++r) {
      MixerOptions po = opt;
      po.offset = opt.offset + r * len;
      auto out = m.chunkwise(leaves.in.slice(r * len, len), cur, po);
      os.push_back(out.o);
      cur = out.final_state;
      if (r + 1 < P) loss = loss + weighted(cur, w.boundaries[r]);
    }
    Tensor o = at::cat(os, 1);
    loss = loss + (o * w.o).sum() + weighted(cur, w.final_state);
    run.outputs.push_back(o.detach());
    for (auto& t : cur) run.outputs.push_back(t.detach());
  }
  run.grads = leaf_grads({loss}, leaves.all());
  return run;
}

// The sp group, each rank its slice; results gathered on every rank of the group. `per_rank`, when
// given, adapts the options to rank r's slice of `len` tokens (packed documents).
ScanRun parallel_run(const Mixer& m, Communicator& sp, const MixerInputs& whole, const State& init,
                     const MixerOptions& opt, const Weights& w, ScanMode mode, int head_groups = 0,
                     const std::function<void(MixerOptions&, int r, int64_t len)>& per_rank = {}) {
  const int r = sp.rank(), P = sp.size();
  MixerInputs local = sp_slice(whole, r, P, opt.chunk_size);
  int64_t len = local.q.size(1);
  MixerLeaves leaves = make_mixer_leaves(local, r == 0 ? init : State{});
  MixerOptions ropt = opt;
  if (per_rank) per_rank(ropt, r, len);
  auto out = sp_mixer_forward(m, sp, leaves.in, leaves.state, ropt, mode, head_groups);
  Tensor loss = (out.o * w.o.narrow(1, r * len, len)).sum();
  if (r == P - 1)
    loss = loss + weighted(out.final_state, w.final_state);
  else if (!w.boundaries.empty())
    loss = loss + weighted(out.final_state, w.boundaries[r]);
  auto xs = leaves.all();
  auto gs = leaf_grads({loss}, xs);

  // Every rank's outputs in the same dtypes (o, then the final state's entries), before anything is
  // gathered: a gather moves each rank's bytes, so pieces in different dtypes would not line up (over
  // NCCL they leave the communicator out of step). Where they differ the test fails, and the outputs
  // are gathered in fp64.
  std::vector<int64_t> mine{static_cast<int64_t>(out.o.scalar_type())};
  for (auto& t : out.final_state) mine.push_back(static_cast<int64_t>(t.scalar_type()));
  std::vector<Tensor> theirs = sp.all_gather(at::tensor(mine, at::kLong));
  bool same_dtypes = true;
  std::string dtypes;
  for (int i = 0; i < P; ++i) {
    same_dtypes = same_dtypes && at::equal(theirs[i], theirs[0]);
    dtypes += (i ? "; " : "") + std::string("sp rank ") + std::to_string(i) + ":";
    auto c = theirs[i].contiguous();
    for (int64_t j = 0; j < c.numel(); ++j)
      dtypes += " " + std::string(c10::toString(static_cast<at::ScalarType>(c[j].item<int64_t>())));
  }
  EXPECT_TRUE(same_dtypes) << m.name() << " " << scan_mode_name(mode) << " sp=" << P
                           << ": the ranks' outputs (o, final state) differ in dtype: " << dtypes;
  auto common = [&](const Tensor& t) { return same_dtypes ? t : t.to(at::kDouble); };
  auto gather_T = [&](const Tensor& t) { return at::cat(sp.all_gather(t.contiguous()), 1); };
  ScanRun run;
  run.outputs.push_back(gather_T(common(out.o.detach())));
  for (auto& t0 : out.final_state) {
    Tensor t = common(t0);
    Tensor x = r == P - 1 ? t.detach().clone() : at::zeros_like(t);
    sp.broadcast(x, P - 1);
    run.outputs.push_back(x);
  }
  size_t n_in = xs.size() - leaves.state.size();
  const int64_t H = local.num_heads();
  std::vector<std::string> in_names;
  for (const auto& n : kInputNames)
    if (local.get(n).defined()) in_names.push_back(n);
  for (size_t i = 0; i < n_in; ++i) {
    const std::string& n = in_names[i];
    if (!MixerInputs::per_token(n)) {  // every rank's: the gradient is the ranks' sum, in rank order
      Tensor sum;
      for (auto& t : sp.all_gather(gs[i].contiguous())) sum = sum.defined() ? sum + t : t;
      run.grads.push_back(sum);
    } else {
      run.grads.push_back(gather_T(gs[i]));
    }
    run.summed_over_cut.push_back(!MixerInputs::per_token(n) ||
                                  (H > 1 && local.get(n).size(MixerInputs::head_dim(n)) == 1));
  }
  run.summed_over_cut.resize(n_in + init.size(), false);
  // The initial state's gradient, from rank 0.
  for (size_t i = 0; i < init.size(); ++i) {
    Tensor x = r == 0 ? gs[n_in + i].detach().clone() : at::zeros_like(init[i]);
    sp.broadcast(x, 0);
    run.grads.push_back(x);
  }
  return run;
}

// The largest rel_err over paired lists, a NaN anywhere counting as an infinite error (a NaN compares
// false, so a plain maximum would pass over it).
double max_err(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  double e = carry::testing::max_rel_err(a, b);
  for (size_t i = 0; i < a.size() && i < b.size(); ++i)
    if (std::isnan(carry::testing::rel_err(a[i], b[i]))) return std::numeric_limits<double>::infinity();
  return e;
}

bool bitwise_equal(const std::vector<Tensor>& a, const std::vector<Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].scalar_type() != b[i].scalar_type() || !at::equal(a[i], b[i])) return false;
  return true;
}

// The parallel run's outputs and gradients bit for bit the serial run's, but for the gradients summed
// over the cut (ScanRun::summed_over_cut), which must be equal to rounding: 1e-12 relative in fp64,
// 1e-5 in fp32, 1e-2 in bf16.
bool bitwise_equal_runs(const ScanRun& par, const ScanRun& ser) {
  if (!bitwise_equal(par.outputs, ser.outputs) || par.grads.size() != ser.grads.size()) return false;
  for (size_t i = 0; i < par.grads.size(); ++i) {
    const Tensor &a = par.grads[i], &b = ser.grads[i];
    if (a.scalar_type() != b.scalar_type()) return false;
    if (i >= par.summed_over_cut.size() || !par.summed_over_cut[i]) {
      if (!at::equal(a, b)) return false;
      continue;
    }
    const double tol = a.scalar_type() == at::kDouble ? 1e-12 : a.scalar_type() == at::kFloat ? 1e-5 : 1e-2;
    if (!(carry::testing::rel_err(a, b) <= tol)) return false;
  }
  return true;
}

// Every mode, fp64 and fp32, with and without a loss on the boundary states (and normalized): the
// sp groups of `g` against serial runs on each group's sp rank 0, on `device`.
void check_scan_against_serial(const Mixer& m, ProcessGroups& g, at::Device device,
                               const std::string& where) {
  const int sp_size = g.layout.sp;
  for (ScanMode mode : {ScanMode::ordered, ScanMode::tree, ScanMode::allgather}) {
    for (auto dtype : {at::kDouble, at::kFloat}) {
      for (int variant = 0; variant < (dtype == at::kDouble ? 4 : 2); ++variant) {
        bool boundaries = variant & 1, normalize = variant & 2;
        const int64_t C = 16;
        Shape s;
        s.T = 128;
        s.offset = 3 * 64;
        MixerOptions opt;
        opt.chunk_size = C;
        opt.offset = s.offset;
        opt.normalize = normalize;
        uint64_t seed = 1000 * g.dp_rank + 10 * variant + (dtype == at::kFloat);
        auto in_cpu = random_inputs(m, s, dtype, seed);
        auto in = to_device(in_cpu, device);
        State init;
        for (auto& t : random_state(m, in_cpu, opt, seed + 1)) init.push_back(t.to(device));
        auto w = random_weights(m, in_cpu, opt, sp_size, boundaries, seed + 2);
        w.o = w.o.to(device);
        for (auto& t : w.final_state) t = t.to(device);
        for (auto& b : w.boundaries)
          for (auto& t : b) t = t.to(device);

        ScanRun par = parallel_run(m, *g.sp, in, init, opt, w, mode);
        double e_out = 0, e_grad = 0, not_bitwise = 0, zero_grad = 0;
        if (g.sp_rank == 0) {
          ScanRun ser = serial_run(m, in, init, opt, w, sp_size);
          e_out = max_err(par.outputs, ser.outputs);
          e_grad = max_err(par.grads, ser.grads);
          not_bitwise =
              !bitwise_equal_runs(par, ser);
          for (auto& t : par.grads) zero_grad += t.abs().max().item<double>() == 0;
        }
        e_out = max_over_world(e_out);
        e_grad = max_over_world(e_grad);
        not_bitwise = max_over_world(not_bitwise);
        zero_grad = max_over_world(zero_grad);
        std::string tag =
            m.name() + " " + scan_mode_name(mode) + " " + (dtype == at::kDouble ? "fp64" : "fp32") +
            " dp=" + std::to_string(g.layout.dp) + " sp=" + std::to_string(sp_size) + where +
            (boundaries ? " +boundary-loss" : "") + (normalize ? " normalized" : "");
        if (world_rank() == 0)
          std::cout << "[ errors   ] " << tag << ": forward " << e_out << " gradients " << e_grad
                    << (not_bitwise ? "" : " (bitwise equal)") << "\n";
        double tol = dtype == at::kDouble ? 1e-12 : 1e-5;
        EXPECT_LE(e_out, tol) << tag;
        EXPECT_LE(e_grad, tol) << tag;
        EXPECT_EQ(zero_grad, 0) << tag << ": a gradient is all zeros";
        if (mode == ScanMode::ordered) EXPECT_EQ(not_bitwise, 0) << tag << ": not bit-identical";
      }
    }
  }
}

class SequenceParallel : public ::testing::TestWithParam<std::string> {};

TEST_P(SequenceParallel, ScanEqualsSerialWithGradients) {
  const Mixer& m = family(GetParam());
  const int W = world_size();
  std::vector<std::pair<int, int>> layouts{{1, W}};
  if (W >= 4 && W % 2 == 0) layouts.push_back({2, W / 2});
  for (auto [dp, sp_size] : layouts)
    check_scan_against_serial(m, groups(dp, sp_size), at::kCPU, "");
}

// The same over NCCL, one GPU a rank (skips unless every rank has its own GPU and NCCL is built
// in).
TEST_P(SequenceParallel, ScanOverNcclOnGpus) {
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs NCCL and one CUDA device a rank";
  const Mixer& m = family(GetParam());
  ProcessGroups& g = nccl_groups(1, world_size());
  check_scan_against_serial(m, g, at::Device(at::kCUDA, world_info().local_rank), " nccl/cuda");
}

// The kernel forms on `dev` over the groups `g`: bf16 q, k, v with dk = dv = 128 and chunks of 64, where
// every rank runs linear attention's and the scalar decay's fused kernels (no per-chunk states), GLA's
// decay-class kernels, the delta rule's (DeltaNet, Gated DeltaNet) and HLA's passes of the decay class's
// kernels (hla2, ahla, with a decay), each scan mode against the serial
// chunkwise run in fp32 on the same (upcast) inputs: the outputs, the final state and every gradient, the
// initial state's included, within 1e-2 (the bf16 products' rounding, as the one-GPU kernel tests bound).
// At 3 ranks and more the ranks between the ends of tree and allgather run the one-pass form (the slice
// from the zero state, then S_in's share added) where the family has it.
void check_kernel_forms(ProcessGroups& g, at::Device dev, const std::string& where) {
  const int P = g.layout.sp;
  for (const char* name :
       {"linear_attn", "scalar_decay", "gla", "deltanet", "gated_deltanet", "gated_deltaproduct", "hla2", "ahla"}) {
    const Mixer& m = get_mixer(name);
    Shape s;
    s.B = 1, s.T = 256 * P, s.H = 2, s.dk = 128, s.dv = 128;
    MixerOptions opt;
    opt.chunk_size = 64;
    MixerInputs in_cpu = random_inputs(m, s, at::kFloat, 77);
    if (m.optional_input_names() == std::vector<std::string>{"g"})  // HLA: with its decay
      in_cpu.g = at::log_sigmoid(at::randn({s.B, s.T, s.H}, at::make_generator<at::CPUGeneratorImpl>(76)) + 4);
    MixerInputs up = to_device(in_cpu, dev), low = up;
    for (const char* n : {"q", "k", "v"}) low.get(n) = up.get(n).to(at::kBFloat16), up.get(n) = low.get(n).to(at::kFloat);
    State init;
    for (auto& t : random_state(m, in_cpu, opt, 78)) init.push_back(t.to(dev));
    auto w = random_weights(m, in_cpu, opt, P, /*boundaries=*/false, 79);
    w.o = w.o.to(dev);
    for (auto& t : w.final_state) t = t.to(dev);
    ASSERT_TRUE(m.has_kernel() && m.kernel_supports(sp_slice(low, g.sp_rank, P, opt.chunk_size), opt))
        << name << ": the kernel form does not take a rank's slice, so this test would not run it";
    for (ScanMode mode : {ScanMode::ordered, ScanMode::tree, ScanMode::allgather}) {
      ScanRun par = parallel_run(m, *g.sp, low, init, opt, w, mode);
      double e_out = 0, e_grad = 0;
      if (g.sp_rank == 0) {
        ScanRun ser = serial_run(m, up, init, opt, w, P);
        e_out = max_err(par.outputs, ser.outputs);
        e_grad = max_err(par.grads, ser.grads);
        if (e_grad > 1e-2)  // which gradient, and on which rank's tokens
          for (size_t i = 0; i < par.grads.size() && i < ser.grads.size(); ++i) {
            std::cout << "[ errors   ]   " << name << " " << scan_mode_name(mode) << " gradient " << i << ": "
                      << carry::testing::rel_err(par.grads[i], ser.grads[i]);
            if (par.grads[i].dim() > 1 && par.grads[i].size(1) == s.T)
              for (int j = 0; j < P; ++j)
                std::cout << (j ? ", " : " (by rank: ")
                          << carry::testing::rel_err(par.grads[i].narrow(1, j * (s.T / P), s.T / P),
                                                     ser.grads[i].narrow(1, j * (s.T / P), s.T / P))
                          << (j == P - 1 ? ")" : "");
            std::cout << "\n";
          }
      }
      e_out = max_over_world(e_out);
      e_grad = max_over_world(e_grad);
      const std::string tag =
          std::string(name) + " " + scan_mode_name(mode) + " bf16 kernels sp=" + std::to_string(P) + where;
      if (world_rank() == 0)
        std::cout << "[ errors   ] " << tag << ": forward " << e_out << " gradients " << e_grad << "\n";
      EXPECT_LE(e_out, 1e-2) << tag;
      EXPECT_LE(e_grad, 1e-2) << tag;
    }
  }
}

// Over NCCL, one GPU a rank.
TEST(KernelForms, ScanOverNcclMatchesSerial) {
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs NCCL and one CUDA device a rank";
  check_kernel_forms(nccl_groups(1, world_size()), at::Device(at::kCUDA, world_info().local_rank), " nccl");
}

// Over MPI with the ranks sharing the host's GPUs (rank r on device r mod the device count): the same
// kernels and scans on a machine with fewer GPUs than ranks (NCCL takes one GPU a rank).
TEST(KernelForms, ScanOverMpiOnSharedGpusMatchesSerial) {
  double none = torch::cuda::device_count() == 0 ? 1 : 0, any_none = 0;
  MPI_Allreduce(&none, &any_none, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  if (any_none > 0) GTEST_SKIP() << "needs a CUDA device on every rank";
  const auto device = static_cast<c10::DeviceIndex>(world_info().local_rank % torch::cuda::device_count());
  check_kernel_forms(groups(1, world_size()), at::Device(at::kCUDA, device), " mpi/shared gpu");
}

// ordered pipelined over G head groups (H = 4 heads; G = 1, 2, 4): outputs, final state and every
// gradient bit for bit those of one serial chunkwise run over all heads.
TEST_P(SequenceParallel, OrderedHeadGroupsBitwiseEqualSerial) {
  const Mixer& m = family(GetParam());
  ProcessGroups& g = groups(1, world_size());
  const int P = g.layout.sp;
  struct Variant {
    at::ScalarType dtype;
    bool boundaries, normalize;
  };
  for (int G : {1, 2, 4}) {
    for (auto v : {Variant{at::kDouble, false, false}, Variant{at::kDouble, true, true},
                   Variant{at::kFloat, true, false}}) {
      Shape s;
      s.T = 128;
      s.H = 4;
      s.offset = 64;
      MixerOptions opt;
      opt.chunk_size = 16;
      opt.offset = s.offset;
      opt.normalize = v.normalize;
      uint64_t seed = 77 + G + 10 * v.boundaries;
      auto in = random_inputs(m, s, v.dtype, seed);
      State init = random_state(m, in, opt, seed + 1);
      auto w = random_weights(m, in, opt, P, v.boundaries, seed + 2);
      ScanRun par = parallel_run(m, *g.sp, in, init, opt, w, ScanMode::ordered, G);
      double e_out = 0, e_grad = 0, not_bitwise = 0, zero_grad = 0;
      if (g.sp_rank == 0) {
        ScanRun ser = serial_run(m, in, init, opt, w, P);
        e_out = max_err(par.outputs, ser.outputs);
        e_grad = max_err(par.grads, ser.grads);
        not_bitwise =
            !bitwise_equal_runs(par, ser);
        for (auto& t : par.grads) zero_grad += t.abs().max().item<double>() == 0;
      }
      e_out = max_over_world(e_out);
      e_grad = max_over_world(e_grad);
      not_bitwise = max_over_world(not_bitwise);
      zero_grad = max_over_world(zero_grad);
      std::string tag = m.name() + " ordered head_groups=" + std::to_string(G) + " of H=4 " +
                        (v.dtype == at::kDouble ? "fp64" : "fp32") + " sp=" + std::to_string(P) +
                        (v.boundaries ? " +boundary-loss" : "") +
                        (v.normalize ? " normalized" : "");
      if (world_rank() == 0)
        std::cout << "[ errors   ] " << tag << ": forward " << e_out << " gradients " << e_grad
                  << (not_bitwise ? "" : " (bitwise equal)") << "\n";
      EXPECT_EQ(not_bitwise, 0) << tag << ": not bit-identical";
      EXPECT_EQ(zero_grad, 0) << tag << ": a gradient is all zeros";
    }
  }
}

// A family that calls MixerOptions' hooks the way the kernel forms do, on the CPU: on_final_state
// from inside its forward, on_initial_state_grad from inside its backward (an identity on the initial
// state whose backward hands the gradient to the hook before passing it on). Everything else is the
// wrapped family's. Counts the backward hook's calls.
struct HookHolder : torch::CustomClassHolder {
  explicit HookHolder(std::function<void(const State&)> f) : fn(std::move(f)) {}
  std::function<void(const State&)> fn;
};

struct GradToHook : public torch::autograd::Function<GradToHook> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x,
                        const std::function<void(const State&)>& f) {
    ctx->saved_data["f"] = at::IValue::make_capsule(c10::make_intrusive<HookHolder>(f));
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list g) {
    c10::static_intrusive_pointer_cast<HookHolder>(ctx->saved_data["f"].toCapsule())->fn({g[0]});
    return {g[0], Tensor()};
  }
};

class EarlyHooksForTests final : public Mixer {
 public:
  explicit EarlyHooksForTests(const Mixer& inner) : inner_(inner) {}
  std::string name() const override { return inner_.name(); }
  std::vector<std::string> input_names() const override { return inner_.input_names(); }
  int64_t rows_per_token(const std::string& n, const MixerOptions& opt) const override {
    return inner_.rows_per_token(n, opt);
  }
  bool broadcasts_heads(const std::string& n) const override { return inner_.broadcasts_heads(n); }
  std::vector<std::string> state_names() const override { return inner_.state_names(); }
  State zero_state(const MixerInputs& in, const MixerOptions& opt) const override { return inner_.zero_state(in, opt); }
  void check(const MixerInputs& in, const MixerOptions& opt, bool chunked) const override { inner_.check(in, opt, chunked); }
  MixerOutput naive(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    return inner_.naive(in, init, opt);
  }
  MixerOutput chunkwise(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    MixerOptions plain = opt;
    plain.on_final_state = nullptr;
    plain.on_initial_state_grad = nullptr;
    State s = init;
    if (opt.on_initial_state_grad && s.size() == 1 && s[0].requires_grad()) {
      auto f = opt.on_initial_state_grad;
      std::atomic<int>* n = &grad_calls;
      s[0] = GradToHook::apply(s[0], [f, n](const State& d) {
        ++*n;
        f(d);
      });
    }
    MixerOutput out = inner_.chunkwise(in, s, plain);
    if (opt.on_final_state) opt.on_final_state(out.final_state);  // before returning, as a kernel form does
    return out;
  }
  Summary summarize(const MixerInputs& in, const MixerOptions& opt) const override { return inner_.summarize(in, opt); }
  Summary compose(const Summary& a, const Summary& b) const override { return inner_.compose(a, b); }
  State apply(const Summary& s, const State& x) const override { return inner_.apply(s, x); }
  mutable std::atomic<int> grad_calls{0};

 private:
  const Mixer& inner_;
};

// The ordered chain with a form that sends from its hooks (as the kernel forms do on GPUs): S_out to
// the next rank from inside the forward, d S_in to the previous one from inside the backward, so
// ScanBackward must not send it again. Two runs in a row (a stray second message would be taken as
// the next run's state gradient) with 1 and 2 head groups: outputs and every gradient bit for bit the
// serial run's, and the backward hook called once a head group on every rank but the first.
TEST(OrderedChain, HooksSendOnceAndTheBitsStay) {
  ProcessGroups& g = groups(1, world_size());
  const int P = g.layout.sp;
  for (const char* name : {"scalar_decay", "gated_deltanet"}) {
    EarlyHooksForTests m(family(name));
    for (int G : {1, 2}) {
      Shape s;
      s.T = 128;
      s.H = 4;
      MixerOptions opt;
      opt.chunk_size = 16;
      auto in = random_inputs(m, s, at::kDouble, 301 + G);
      State init = random_state(m, in, opt, 302 + G);
      auto w = random_weights(m, in, opt, P, true, 303 + G);
      m.grad_calls = 0;
      double not_bitwise = 0;
      for (int run = 0; run < 2; ++run) {
        ScanRun par = parallel_run(m, *g.sp, in, init, opt, w, ScanMode::ordered, G);
        if (g.sp_rank == 0) {
          ScanRun ser = serial_run(family(name), in, init, opt, w, P);
          not_bitwise += !bitwise_equal_runs(par, ser);
        }
      }
      not_bitwise = max_over_world(not_bitwise);
      const int expected = g.sp_rank == 0 ? 0 : 2 * G;
      const double wrong_calls = max_over_world(m.grad_calls.load() == expected ? 0 : 1);
      std::string tag = std::string(name) + " head_groups=" + std::to_string(G) + " sp=" + std::to_string(P);
      if (world_rank() == 0) std::cout << "[ hooks    ] " << tag << (not_bitwise ? ": NOT bitwise" : ": bitwise equal") << "\n";
      EXPECT_EQ(not_bitwise, 0) << tag << ": not bit-identical to the serial run";
      EXPECT_EQ(wrong_calls, 0) << tag << ": rank " << g.sp_rank << " called the backward hook " << m.grad_calls.load()
                                << " times, expected " << expected;
    }
  }
}

// A family that behaves on the CPU as the kernel forms do on GPUs, around a registered family: q, k, v
// in bf16 (the gates in fp32), the states in fp32, the work in fp32 on the inputs cast up, o returned
// in bf16 (the kernels' output dtype) and the final state in fp32; on_final_state called from inside the
// forward and, in one-state families, on_initial_state_grad from inside the backward. Everything the
// scan asks of a family besides (summaries, transports, the one-pass readout, the end ranks' fixed
// summaries) is the wrapped family's on the inputs cast up, so the tree and allgather scans take the
// same paths as with the kernel forms: the one pass between the end ranks where the family has it.
class KernelLikeForTests final : public Mixer {
 public:
  explicit KernelLikeForTests(const Mixer& inner) : inner_(inner) {}
  std::string name() const override { return inner_.name(); }
  std::vector<std::string> input_names() const override { return inner_.input_names(); }
  std::vector<std::string> optional_input_names() const override { return inner_.optional_input_names(); }
  int64_t rows_per_token(const std::string& n, const MixerOptions& opt) const override {
    return inner_.rows_per_token(n, opt);
  }
  bool broadcasts_heads(const std::string& n) const override { return inner_.broadcasts_heads(n); }
  std::vector<std::string> state_names() const override { return inner_.state_names(); }
  State zero_state(const MixerInputs& in, const MixerOptions& opt) const override {
    return inner_.zero_state(full_precision(in), opt);
  }
  void check(const MixerInputs& in, const MixerOptions& opt, bool chunked) const override {
    inner_.check(full_precision(in), opt, chunked);
  }
  MixerOutput naive(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    MixerOutput out = inner_.naive(full_precision(in), init, opt);
    out.o = out.o.to(in.q.scalar_type());
    return out;
  }
  MixerOutput chunkwise(const MixerInputs& in, const State& init, const MixerOptions& opt) const override {
    MixerOptions plain = opt;
    plain.on_final_state = nullptr;
    plain.on_initial_state_grad = nullptr;
    State s = init;
    if (opt.on_initial_state_grad && s.size() == 1 && s[0].requires_grad())
      s[0] = GradToHook::apply(s[0], opt.on_initial_state_grad);
    MixerOutput out = inner_.chunkwise(full_precision(in), s, plain);
    out.o = out.o.to(in.q.scalar_type());
    if (opt.on_final_state) opt.on_final_state(out.final_state);  // before returning, as a kernel form does
    return out;
  }
  bool summary_resets_at_documents() const override { return inner_.summary_resets_at_documents(); }
  Summary summarize(const MixerInputs& in, const MixerOptions& opt) const override {
    return inner_.summarize(full_precision(in), opt);
  }
  Summary compose(const Summary& a, const Summary& b) const override { return inner_.compose(a, b); }
  State apply(const Summary& s, const State& x) const override { return inner_.apply(s, x); }
  bool has_state_output(const MixerInputs& in, const MixerOptions& opt) const override {
    return inner_.has_state_output(full_precision(in), opt);
  }
  std::optional<Summary> fixed_summary(const MixerInputs& in, const State& s) const override {
    return inner_.fixed_summary(full_precision(in), s);
  }
  Tensor state_output(const MixerInputs& in, const State& s_in, const MixerOptions& opt) const override {
    return inner_.state_output(full_precision(in), s_in, opt);
  }
  std::vector<Tensor> transport(const MixerInputs& in, const MixerOptions& opt) const override {
    return inner_.transport(full_precision(in), opt);
  }
  StateReadout state_readout(const MixerInputs& in, const MixerOptions& opt) const override {
    return inner_.state_readout(full_precision(in), opt);
  }

 private:
  const Mixer& inner_;
};

// The scan with forms that behave as the kernel forms do (KernelLikeForTests; on GPUs
// KernelForms.ScanOverNcclMatchesSerial runs the kernels themselves): bf16 q, k, v, an initial state,
// with and without a loss on the boundary states, every mode against the same form's serial run on the
// whole sequence. Every rank's o must come in the serial run's dtype (bf16) and its final state in
// fp32 (parallel_run checks that the ranks agree before it gathers); the outputs and every gradient
// within 1e-2 (the rounding of o and of the input gradients to bf16), bit for bit in the ordered chain.
// At 3 ranks and more, the ranks between the ends run the one-pass form of the families that have it.
TEST_P(SequenceParallel, KernelLikeFormsMatchSerial) {
  KernelLikeForTests m(family(GetParam()));
  ProcessGroups& g = groups(1, world_size());
  const int P = g.layout.sp;
  for (ScanMode mode : {ScanMode::ordered, ScanMode::tree, ScanMode::allgather}) {
    for (bool boundaries : {false, true}) {
      Shape s;
      s.T = 128;
      s.offset = 64;
      MixerOptions opt;
      opt.chunk_size = 16;
      opt.offset = s.offset;
      const uint64_t seed = 401 + 10 * boundaries;
      MixerInputs in = random_inputs(m, s, at::kFloat, seed);
      for (const char* n : {"q", "k", "v"})
        if (in.get(n).defined()) in.get(n) = in.get(n).to(at::kBFloat16);
      State init = random_state(m, full_precision(in), opt, seed + 1);
      auto w = random_weights(m, full_precision(in), opt, P, boundaries, seed + 2);
      ScanRun par = parallel_run(m, *g.sp, in, init, opt, w, mode);
      double e_out = 0, e_grad = 0, not_bitwise = 0, wrong_dtype = 0;
      if (g.sp_rank == 0) {
        ScanRun ser = serial_run(m, in, init, opt, w, P);
        for (size_t i = 0; i < par.outputs.size(); ++i)
          wrong_dtype += par.outputs[i].scalar_type() != ser.outputs[i].scalar_type();
        e_out = max_err(par.outputs, ser.outputs);
        e_grad = max_err(par.grads, ser.grads);
        not_bitwise = !bitwise_equal_runs(par, ser);
      }
      e_out = max_over_world(e_out);
      e_grad = max_over_world(e_grad);
      not_bitwise = max_over_world(not_bitwise);
      wrong_dtype = max_over_world(wrong_dtype);
      const std::string tag = m.name() + " " + scan_mode_name(mode) + " kernel-like bf16 sp=" + std::to_string(P) +
                              (boundaries ? " +boundary-loss" : "");
      if (world_rank() == 0)
        std::cout << "[ errors   ] " << tag << ": forward " << e_out << " gradients " << e_grad
                  << (not_bitwise ? "" : " (bitwise equal)") << "\n";
      EXPECT_EQ(wrong_dtype, 0) << tag << ": the outputs' dtypes are not the serial run's (o bf16, states fp32)";
      EXPECT_LE(e_out, 1e-2) << tag;
      EXPECT_LE(e_grad, 1e-2) << tag;
      if (mode == ScanMode::ordered) EXPECT_EQ(not_bitwise, 0) << tag << ": not bit-identical";
    }
  }
}

// Packed documents in every mode (fp64, B = 2, T = 128, chunk 16): sequence 0 has starts at 40 and
// at 64 (a rank boundary at 2 and 4 ranks), sequence 1 only at 100, so at 4 ranks its first slices
// carry a state through (their transport) and its last resets. The outputs, final state and the
// gradients of every input and of the initial state equal one process running the whole sequence
// with the same starts (Mixer::forward's documents path). Log-linear families take documents only in
// the ordered scan (their summaries hold positions): the tree and allgather scans refuse them.
TEST_P(SequenceParallel, DocumentStartsResetInEveryMode) {
  const Mixer& m = family(GetParam());
  ProcessGroups& g = groups(1, world_size());
  Communicator& sp = *g.sp;
  const int P = g.layout.sp, r = sp.rank();
  const bool log_linear = m.name().rfind("loglinear", 0) == 0;
  Shape s;
  s.T = 128;
  s.offset = 0;
  MixerOptions opt;
  opt.chunk_size = 16;
  auto in = random_inputs(m, s, at::kDouble, 91);
  State init = random_state(m, in, opt, 92);
  auto w = random_weights(m, in, opt, P, /*boundaries=*/false, 93);
  Tensor starts = at::zeros({s.B, s.T}, at::kBool);
  starts[0][40] = true;
  starts[0][64] = true;
  starts[1][100] = true;
  // Rank r's slice of the starts, and per sequence the tokens of its first document before the slice.
  auto documents = [&](MixerOptions& o, int rank, int64_t len) {
    o.document_starts = starts.narrow(1, rank * len, len).contiguous();
    for (int64_t b = 0; b < s.B; ++b) {
      int64_t begin = 0;
      for (int64_t p = 0; p <= rank * len; ++p)
        if (starts[b][p].item<bool>()) begin = p;
      o.document_offsets.push_back(rank * len - begin);
    }
  };
  for (ScanMode mode : {ScanMode::ordered, ScanMode::tree, ScanMode::allgather}) {
    if (log_linear && mode != ScanMode::ordered) {
      expect_same_error_everywhere(error_of([&] { parallel_run(m, sp, in, init, opt, w, mode, 1, documents); }),
                                   "need the ordered scan (its summaries hold the slice's positions");
      continue;
    }
    ScanRun par = parallel_run(m, sp, in, init, opt, w, mode, 1, documents);
    double e_out = 0, e_grad = 0;
    if (r == 0) {
      MixerLeaves whole = make_mixer_leaves(in, init);
      MixerOptions o = opt;
      o.document_starts = starts;
      auto ser_out = m.forward(whole.in, whole.state, o);
      Tensor ser_loss = (ser_out.o * w.o).sum() + weighted(ser_out.final_state, w.final_state);
      std::vector<Tensor> outs{ser_out.o.detach()};
      for (auto& t : ser_out.final_state) outs.push_back(t.detach());
      e_out = max_err(par.outputs, outs);
      e_grad = max_err(par.grads, leaf_grads({ser_loss}, whole.all()));
    }
    e_out = max_over_world(e_out);
    e_grad = max_over_world(e_grad);
    std::string tag = m.name() + " documents " + scan_mode_name(mode) + " fp64 sp=" + std::to_string(P);
    if (world_rank() == 0) std::cout << "[ errors   ] " << tag << ": forward " << e_out << " gradients " << e_grad << "\n";
    EXPECT_LE(e_out, 1e-12) << tag;
    EXPECT_LE(e_grad, 1e-12) << tag;
  }
}

INSTANTIATE_TEST_SUITE_P(AllFamilies, SequenceParallel, ::testing::ValuesIn(family_names()),
                         [](const auto& info) { return info.param; });

// ---- communicators ----

void check_communicator(Communicator& c, at::Device dev) {
  const int r = c.rank(), P = c.size();
  auto opt = at::TensorOptions().dtype(at::kDouble).device(dev);
  // A ring with send_recv (no deadlock whatever P), and a shift with an end.
  Tensor mine = at::full({3, 5}, r, opt), got = at::empty({3, 5}, opt);
  c.send_recv(mine, (r + 1) % P, got, (r + P - 1) % P, 7);
  EXPECT_TRUE(at::equal(got, at::full({3, 5}, (r + P - 1) % P, opt)));
  // all_gather, all_reduce_sum (fp64 and bf16 through fp32), broadcast, barrier.
  auto all = c.all_gather(at::full({2}, r, opt));
  ASSERT_EQ(static_cast<int>(all.size()), P);
  for (int i = 0; i < P; ++i) EXPECT_TRUE(at::equal(all[i], at::full({2}, i, opt)));
  Tensor sum = at::full({4}, r + 1, opt);
  c.all_reduce_sum(sum);
  EXPECT_TRUE(at::equal(sum, at::full({4}, P * (P + 1) / 2, opt)));
  Tensor half = at::full({4}, r + 1, at::TensorOptions().dtype(at::kBFloat16).device(dev));
  c.all_reduce_sum(half);
  EXPECT_TRUE(at::equal(
      half, at::full({4}, P * (P + 1) / 2, at::TensorOptions().dtype(at::kBFloat16).device(dev))));
  Tensor b = r == P - 1 ? at::arange(6, opt) : at::zeros({6}, opt);
  c.broadcast(b, P - 1);
  EXPECT_TRUE(at::equal(b, at::arange(6, opt)));
  c.barrier();
  // reduce_scatter_sum and all_gather_pieces on a buffer of P pieces of 5 (fp32 and fp64): element e of
  // rank q holds (q + 1)·(e + 1); after the first this rank's piece holds the sums, after the second every
  // piece holds its rank's values (here the sums on every rank).
  for (auto dt : {at::kFloat, at::kDouble}) {
    auto o = opt.dtype(dt);
    Tensor flat = at::arange(1, 5 * P + 1, o) * (r + 1);
    c.reduce_scatter_sum(flat);
    const Tensor want = at::arange(1, 5 * P + 1, o) * (P * (P + 1) / 2);
    EXPECT_TRUE(at::equal(flat.narrow(0, 5 * r, 5), want.narrow(0, 5 * r, 5))) << "rank " << r << " " << dt;
    c.all_gather_pieces(flat);
    EXPECT_TRUE(at::equal(flat, want)) << "rank " << r << " " << dt;
  }
  if (P > 1) {
    Tensor uneven = at::zeros({5 * P + 1}, opt);
    EXPECT_THROW(c.reduce_scatter_sum(uneven), c10::Error);
  }
  // Lists: mixed dtypes, an undefined entry, a scalar; with a known layout and self-described.
  std::vector<Tensor> list{at::full({2, 3}, r, opt), Tensor(),
                           at::full({}, r, at::TensorOptions().dtype(at::kLong).device(dev)),
                           at::full({5}, r, opt.dtype(at::kFloat))};
  if (P > 1) {
    if (r == 0) send_tensors(c, list, 1, 3);
    if (r == 1) {
      auto x = recv_tensors(c, list, 0, 3);
      EXPECT_TRUE(at::equal(x[0], at::zeros({2, 3}, opt)) && !x[1].defined() &&
                  x[2].item<int64_t>() == 0 &&
                  at::equal(x[3], at::zeros({5}, opt.dtype(at::kFloat))));
    }
  }
  // Self-described lists whose layout differs between ranks.
  std::vector<Tensor> var{at::full({r + 1}, r, opt), Tensor(),
                          at::full({2, r + 1}, r, opt.dtype(at::kFloat))};
  auto got_list = exchange_packed(c, var, (r + 1) % P, (r + P - 1) % P, opt, 4);
  int prev = (r + P - 1) % P;
  ASSERT_EQ(got_list.size(), 3u);
  EXPECT_TRUE(at::equal(got_list[0], at::full({prev + 1}, prev, opt)));
  EXPECT_FALSE(got_list[1].defined());
  EXPECT_TRUE(at::equal(got_list[2], at::full({2, prev + 1}, prev, opt.dtype(at::kFloat))));
  auto lists = all_gather_packed(c, var, opt);
  ASSERT_EQ(static_cast<int>(lists.size()), P);
  for (int i = 0; i < P; ++i) {
    EXPECT_TRUE(at::equal(lists[i][0], at::full({i + 1}, i, opt)));
    EXPECT_FALSE(lists[i][1].defined());
    EXPECT_TRUE(at::equal(lists[i][2], at::full({2, i + 1}, i, opt.dtype(at::kFloat))));
  }
  // Payloads of odd byte lengths (ending in bytes): the next rank's int64 must still be readable.
  std::vector<Tensor> odd{at::full({2}, r, opt.dtype(at::kLong)), at::full({2 * r + 3}, r, opt.dtype(at::kByte))};
  auto odd_lists = all_gather_packed(c, odd, opt);
  for (int i = 0; i < P; ++i) {
    EXPECT_TRUE(at::equal(odd_lists[i][0], at::full({2}, i, opt.dtype(at::kLong))));
    EXPECT_TRUE(at::equal(odd_lists[i][1], at::full({2 * i + 3}, i, opt.dtype(at::kByte))));
  }
}

TEST(Communicator, PointToPointAndCollectives) {
  check_communicator(*groups(1, world_size()).world, at::kCPU);
}

TEST(Communicator, NcclOnGpus) {
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs NCCL and one CUDA device a rank";
  check_communicator(*nccl_groups(1, world_size()).world,
                     at::Device(at::kCUDA, world_info().local_rank));
}

// The ordered chain's message pattern arrives in order and intact: 12 "layers" of states down the chain
// (rank r receives from r−1, then sends to r+1) and 12 of gradients back up, on two tags, with a
// halo-like exchange (a send_recv with both sides) between the layers, every value naming its layer,
// rank and tag. Run on the CPU (MPI) and, with a GPU a rank, over NCCL. With wait timing on, NCCL also
// counts every operation it enqueued and the host time spent on them (take_host_calls); MPI counts none.
void check_chain(Communicator& c, at::Device dev) {
  const int r = c.rank(), P = c.size();
  c.set_wait_timing(true);
  c.take_host_calls();
  long enqueued = 0;  // this rank's operations with a peer (a send_recv with both sides is one)
  const int fwd = 10000, bwd = 10001;
  auto opt = at::TensorOptions().dtype(at::kFloat).device(dev);
  auto value = [&](int layer, int rank, int tag) { return at::full({1000}, layer * 100 + rank * 10 + (tag - fwd), opt); };
  for (int layer = 0; layer < 12; ++layer) {
    if (r > 0) {
      Tensor got = at::empty({1000}, opt);
      CommContext ctx("chain test: forward state of layer " + std::to_string(layer));
      c.recv(got, r - 1, fwd);
      EXPECT_TRUE(at::equal(got, value(layer, r - 1, fwd))) << "rank " << r << " layer " << layer << " forward";
    }
    if (r + 1 < P) c.send(value(layer, r, fwd), r + 1, fwd);
    Tensor halo = at::empty({8}, opt);
    c.send_recv(at::full({8}, r, opt), r + 1 < P ? r + 1 : -1, halo, r > 0 ? r - 1 : -1, 7101);
    if (r > 0) EXPECT_TRUE(at::equal(halo, at::full({8}, r - 1, opt))) << "rank " << r << " halo " << layer;
    enqueued += (r > 0) + (r + 1 < P) + (P > 1);
  }
  for (int layer = 11; layer >= 0; --layer) {
    if (r + 1 < P) {
      Tensor got = at::empty({1000}, opt);
      CommContext ctx("chain test: backward gradient of layer " + std::to_string(layer));
      c.recv(got, r + 1, bwd);
      EXPECT_TRUE(at::equal(got, value(layer, r + 1, bwd))) << "rank " << r << " layer " << layer << " backward";
    }
    if (r > 0) c.send(value(layer, r, bwd), r - 1, bwd);
    enqueued += (r + 1 < P) + (r > 0);
  }
  c.synchronize();
  const Communicator::HostCalls h = c.take_host_calls();
  c.set_wait_timing(false);
  if (c.backend() == "nccl") {
    EXPECT_EQ(h.count, enqueued) << "rank " << r;
    EXPECT_GT(h.seconds, 0.0) << "rank " << r;
  } else {
    EXPECT_EQ(h.count, 0) << "rank " << r;
  }
  // The waits one by one (logging.comm_timing ORDER): NCCL lists the chain's receives in the order they
  // were enqueued, under their kinds (the layer as '#'), and their sum is the waits' total.
  const auto sequence = c.take_wait_sequence();
  const double waited = c.take_waited_seconds();
  c.take_waits_by_kind();
  if (c.backend() != "nccl") {
    EXPECT_TRUE(sequence.empty()) << "rank " << r;
    return;
  }
  std::vector<std::string> chain;
  double sum = 0;
  for (auto& [kind, seconds] : sequence) {
    sum += seconds;
    EXPECT_GE(seconds, 0.0) << kind;
    if (kind.rfind("chain test: ", 0) == 0) chain.push_back(kind);
  }
  std::vector<std::string> expected(r > 0 ? 12 : 0, "chain test: forward state of layer #");
  expected.resize(expected.size() + (r + 1 < P ? 12 : 0), "chain test: backward gradient of layer #");
  EXPECT_EQ(chain, expected) << "rank " << r;
  EXPECT_NEAR(sum, waited, 1e-6 + 1e-6 * waited) << "rank " << r;
  EXPECT_TRUE(c.take_wait_sequence().empty()) << "taken once";
}

TEST(Communicator, ChainMessagesArriveInOrder) {
  check_chain(*groups(1, world_size()).world, at::kCPU);
  if (gpus_for_every_rank())
    check_chain(*nccl_groups(1, world_size()).world, at::Device(at::kCUDA, world_info().local_rank));
}

// CommOptions::copy_engine_neighbours: messages between neighbours go by the copy engines through a
// ring in the receiver's memory. 240 messages of 1 KiB to 2 MiB each way (about 8 laps of the 32 MiB
// ring, so the sender waits for the receiver to free it), the receiver held back by GPU work now and
// then, both directions in one call, and messages too large for the ring (by NCCL) in between: every
// byte arrives in order, and the links carried all the small ones.
TEST(Communicator, CopyEngineLinksCarryNeighbourMessagesInOrder) {
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs NCCL and one CUDA device a rank";
  CommOptions opt;
  opt.name = "links test";
  opt.copy_engine_neighbours = true;
  auto comm = make_nccl_communicator(MPI_COMM_WORLD, world_info().local_rank, opt);
  const int r = comm->rank(), P = comm->size();
  const at::Device dev(at::kCUDA, world_info().local_rank);
  auto opts = at::TensorOptions().dtype(at::kFloat).device(dev);
  auto message = [&](int i, int from, int64_t n) { return at::arange(n, opts).mul_(1e-3).add_(i + 1000 * from); };
  comm->set_wait_timing(true);
  comm->take_host_calls();
  long linked = 0;
  Tensor slow = at::randn({2048, 2048}, opts);
  for (int i = 0; i < 240; ++i) {
    const int64_t n = (i * 7919 % 2048 + 1) * 256;  // 1 KiB .. 2 MiB of floats
    if (r > 0 && i % 40 == 0)
      for (int j = 0; j < 8; ++j) slow = at::matmul(slow, slow).tanh_();  // the receiver falls behind
    Tensor got = at::empty({n}, opts), back = at::empty({n}, opts);
    // Right, then left in one call: rank r sends to r + 1 and hears from r - 1, then the other way.
    comm->send_recv(message(i, r, n), r + 1 < P ? r + 1 : -1, got, r > 0 ? r - 1 : -1, 11);
    comm->send_recv(message(i, r, n), r > 0 ? r - 1 : -1, back, r + 1 < P ? r + 1 : -1, 12);
    linked += (r + 1 < P) * 2 + (r > 0) * 2;
    if (r > 0) ASSERT_TRUE(at::equal(got, message(i, r - 1, n))) << "rank " << r << " message " << i << " from the left";
    if (r + 1 < P) ASSERT_TRUE(at::equal(back, message(i, r + 1, n))) << "rank " << r << " message " << i << " from the right";
    if (i % 60 == 59) {  // 12 MiB: past the links' limit, by NCCL between the links' messages
      const int64_t big = int64_t{3} << 20;
      Tensor big_got = at::empty({big}, opts);
      comm->send_recv(message(i, r, big), r + 1 < P ? r + 1 : -1, big_got, r > 0 ? r - 1 : -1, 13);
      if (r > 0) ASSERT_TRUE(at::equal(big_got, message(i, r - 1, big))) << "rank " << r << " large message " << i;
    }
  }
  comm->synchronize();
  const Communicator::HostCalls h = comm->take_host_calls();
  EXPECT_EQ(h.by_copy_engines, linked) << "rank " << r;
  EXPECT_GT(h.count, h.by_copy_engines) << "rank " << r << ": the large messages went by NCCL";
  EXPECT_TRUE(at::isfinite(slow).all().item<bool>());
  MPI_Barrier(MPI_COMM_WORLD);
}

// NCCL calls return before the GPU has finished them; a receive that no rank sends times out (found by
// the watchdog thread once enqueued, or while NCCL connects to the silent peer) and throws, naming the
// operation and the context it was started in; every rank then goes on.
TEST(Communicator, NcclWatchdogReportsAReceiveNobodySends) {
  if (!gpus_for_every_rank()) GTEST_SKIP() << "needs NCCL and one CUDA device a rank";
  CommOptions opt;
  opt.timeout_s = 3;
  opt.on_timeout = CommOptions::OnTimeout::throw_error;
  opt.name = "watchdog test";
  auto comm = make_nccl_communicator(MPI_COMM_WORLD, world_info().local_rank, opt);
  if (comm->rank() == 1) {
    Tensor t = at::empty({16}, at::TensorOptions().dtype(at::kFloat).device(at::kCUDA, world_info().local_rank));
    try {
      {
        // Returns once enqueued; or, when NCCL must first connect to the silent peer, times out here.
        CommContext ctx("waiting for a message rank 0 never sends");
        comm->recv(t, 0, 5);
      }
      comm->synchronize();
      ADD_FAILURE() << "a receive nobody sends completed";
    } catch (const CommError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("timeout after 3"), std::string::npos) << msg;
      EXPECT_NE(msg.find("recv of 64 bytes"), std::string::npos) << msg;
      EXPECT_NE(msg.find("while: waiting for a message rank 0 never sends"), std::string::npos) << msg;
    }
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

// logging.comm_timing's waits by kind: the scan's messages under their family, numbers as '#'.
TEST(Communicator, MessageKindDropsTheLayoutAndNumbers) {
  EXPECT_EQ(message_kind("sequence-parallel ordered scan of gated_deltanet over sp=2 ranks: ordered forward, state "
                         "of head group 10 from the previous rank"),
            "gated_deltanet: ordered forward, state of head group # from the previous rank");
  EXPECT_EQ(message_kind("halo exchange forward: last tokens to the next rank"),
            "halo exchange forward: last tokens to the next rank");
  EXPECT_EQ(message_kind("tree sum over segments: round of distance 4"), "tree sum over segments: round of distance #");
}

TEST(ProcessGroups, GridOfConsecutiveSpGroups) {
  const int W = world_size();
  EXPECT_EQ(world_info().local_size, W);  // one host in these tests
  EXPECT_EQ(world_info().local_rank, world_rank());
  for (int sp = 1; sp <= W; ++sp) {
    if (W % sp) continue;
    ProcessGroups& g = groups(W / sp, sp);
    EXPECT_EQ(g.sp_rank, world_rank() % sp);
    EXPECT_EQ(g.dp_rank, world_rank() / sp);
    // Sums of world ranks over each group: sp groups are consecutive ranks, dp groups stride sp.
    Tensor x = at::full({1}, world_rank(), at::kLong);
    g.sp->all_reduce_sum(x);
    int64_t first = g.dp_rank * sp;
    EXPECT_EQ(x.item<int64_t>(), sp * first + sp * (sp - 1) / 2);
    Tensor y = at::full({1}, world_rank(), at::kLong);
    g.dp->all_reduce_sum(y);
    int64_t dp = W / sp;
    EXPECT_EQ(y.item<int64_t>(), dp * g.sp_rank + sp * dp * (dp - 1) / 2);
  }
}

// ---- the same clear error on every rank ----

TEST(InvalidLayouts, SameErrorOnEveryRank) {
  const int W = world_size();
  // dp·sp != world size.
  int dp = W == 6 ? 2 : 3;
  expect_same_error_everywhere(error_of([&] {
                                 make_process_groups({dp, 2});
                               }),
                               "dp=" + std::to_string(dp) + " × sp=2");
  expect_same_error_everywhere(error_of([&] { make_process_groups({0, W}); }), "at least 1");

  ProcessGroups& g = groups(1, W);
  const Mixer& m = dense_delta_for_tests();
  const int r = g.sp_rank, P = W;
  const int64_t C = 16;
  MixerOptions opt;
  opt.chunk_size = C;
  Shape s;
  s.T = 2 * P * C + 8;  // not a multiple of P·C
  auto in = random_inputs(m, s, at::kDouble, 5);
  expect_same_error_everywhere(error_of([&] { sp_slice(in, r, P, C); }),
                               "multiple of sp·chunk_size = " + std::to_string(P) + "·16");
  // Each rank's slice not a whole number of chunks.
  auto odd = in.slice(0, C + 8);
  expect_same_error_everywhere(
      error_of([&] { sp_mixer_forward(m, *g.sp, odd, {}, opt, ScanMode::tree); }),
      "every rank's slice must have the same length, a multiple of chunk_size=16");
  if (P > 1) {
    // Lengths that differ between ranks.
    auto uneven = in.slice(0, r == 1 ? 2 * C : C);
    expect_same_error_everywhere(
        error_of([&] { sp_mixer_forward(m, *g.sp, uneven, {}, opt, ScanMode::ordered); }),
        "got slice lengths [16, 32");
    // Heads that differ between ranks.
    Shape s2 = s;
    s2.T = C;
    s2.H = r == P - 1 ? 3 : 2;
    auto heads = random_inputs(m, s2, at::kDouble, 6);
    expect_same_error_everywhere(
        error_of([&] { sp_mixer_forward(m, *g.sp, heads, {}, opt, ScanMode::allgather); }),
        "differ in inputs, shapes or dtypes");
    // A NaN on the last rank (values checked): that rank says why, the others name it.
    opt.check_values = true;
    auto nan = in.slice(0, C);
    if (r == P - 1) {
      nan.k = nan.k.clone();
      nan.k.view(-1)[3] = std::nan("");
    }
    std::string msg =
        error_of([&] { sp_mixer_forward(m, *g.sp, nan, {}, opt, ScanMode::ordered); });
    expect_same_error_everywhere(
        msg, r == P - 1 ? "NaN" : "sp rank(s) [" + std::to_string(P - 1) + "] refused",
        /*same=*/false);
  }
}

TEST(InvalidHeadGroups, SameErrorOnEveryRank) {
  const int W = world_size();
  ProcessGroups& g = groups(1, W);
  const Mixer& m = dense_delta_for_tests();
  const int r = g.sp_rank;
  MixerOptions opt;
  opt.chunk_size = 16;
  Shape s;
  s.T = 16 * W;
  s.H = 4;
  auto whole = random_inputs(m, s, at::kDouble, 8);
  auto in = sp_slice(whole, r, W, opt.chunk_size);
  // Not a divisor of the heads, in every mode.
  for (ScanMode mode : {ScanMode::ordered, ScanMode::tree, ScanMode::allgather})
    expect_same_error_everywhere(
        error_of([&] { sp_mixer_forward(m, *g.sp, in, {}, opt, mode, 3); }),
        "head_groups=3 must divide the number of heads H=4");
  expect_same_error_everywhere(
      error_of([&] { sp_mixer_forward(m, *g.sp, in, {}, opt, ScanMode::ordered, -1); }),
      "head_groups must be in 0..");
  // A state without its heads at dim 1 cannot be cut into head groups (but runs with one group).
  HeadsNotAtDim1ForTests heads_last;
  expect_same_error_everywhere(
      error_of([&] { sp_mixer_forward(heads_last, *g.sp, in, {}, opt, ScanMode::ordered, 2); }),
      "head_groups=2 needs every state entry to hold the heads at dim 1, but entry 0 ('S') has "
      "shape [2, 8, 4, 6]");
  if (W > 1) {
    // Ranks asking for different groupings.
    expect_same_error_everywhere(error_of([&] {
                                   sp_mixer_forward(m, *g.sp, in, {}, opt, ScanMode::ordered,
                                                    r == W - 1 ? 2 : 4);
                                 }),
                                 "every rank must ask for the same head_groups; got [4, ");
  }
  // The default: the largest divisor of H up to 4.
  EXPECT_EQ(default_head_groups(1), 1);
  EXPECT_EQ(default_head_groups(6), 3);
  EXPECT_EQ(default_head_groups(7), 1);
  EXPECT_EQ(default_head_groups(16), 4);
}

// ---- timeouts: an error naming the operation, not a hang ----

TEST(Timeouts, MissingPeerGivesAnErrorNamingTheOperation) {
  const int W = world_size();
  if (W < 2) GTEST_SKIP() << "needs two ranks";
  const int r = world_rank();
  auto& world = *groups(1, W).world;  // generous timeout, used to line the ranks up again
  CommOptions quick;
  quick.timeout_s = 1;
  quick.on_timeout = CommOptions::OnTimeout::throw_error;
  quick.name = "timeout-test";

  // 1. The last rank skips a receive: its sender gives up after 1 s, naming the send and the peer.
  {
    auto c = make_mpi_communicator(MPI_COMM_WORLD, quick);
    Tensor big = at::ones({1 << 14}, at::kDouble);  // 128 KiB
    std::string msg;
    auto start = std::chrono::steady_clock::now();
    if (r == W - 2) {
      try {
        c->send(big, W - 1, 9);
      } catch (const CommError& e) {
        msg = e.what();
      }
      double waited =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      EXPECT_GE(waited, 0.9);
      EXPECT_LT(waited, 30);
      EXPECT_NE(msg.find("timeout after 1 s in send of 131072 bytes (tag 9) to rank " +
                         std::to_string(W - 1)),
                std::string::npos)
          << msg;
      EXPECT_NE(msg.find("on rank " + std::to_string(W - 2) + " of communicator 'timeout-test'"),
                std::string::npos)
          << msg;
      // The communicator refuses further work rather than mixing up messages.
      std::string again;
      try {
        c->barrier();
      } catch (const CommError& e) {
        again = e.what();
      }
      EXPECT_NE(again.find("unusable after an earlier failure"), std::string::npos) << again;
      if (r == 0) std::cout << "[ message  ] " << msg.substr(0, msg.find('\n')) << "\n";
    }
    world.barrier();
    // The late receive drains the abandoned send (an MPI that cancelled it leaves nothing to
    // drain).
    if (r == W - 1) error_of_comm([&] { c->recv(big, W - 2, 9); });
    world.barrier();
  }

  // 2. The last rank never joins a tree scan: every other rank stops in the layout agreement with
  // an error that names the collective and what the scan was doing.
  {
    auto c = make_mpi_communicator(MPI_COMM_WORLD, quick);
    const Mixer& m = dense_delta_for_tests();
    MixerOptions opt;
    opt.chunk_size = 16;
    Shape s;
    s.T = 32;
    auto in = random_inputs(m, s, at::kDouble, 3);
    std::string msg;
    if (r != W - 1) {
      try {
        sp_mixer_forward(m, *c, in, {}, opt, ScanMode::tree);
      } catch (const CommError& e) {
        msg = e.what();
      }
      EXPECT_NE(msg.find("timeout after 1 s in all_gather"), std::string::npos) << msg;
      EXPECT_NE(msg.find("on rank " + std::to_string(r) + " of communicator 'timeout-test'"),
                std::string::npos)
          << msg;
      EXPECT_NE(msg.find("while: sequence-parallel tree scan of test_dense_delta over sp=" +
                         std::to_string(W) + " ranks: agreeing on the slice layout"),
                std::string::npos)
          << msg;
      if (r == 0) std::cout << "[ message  ] " << msg << "\n";
    }
    world.barrier();
    // The late contribution completes the collective the others abandoned (agree_layout's record: 4
    // fields, then 6 an input name).
    const int64_t record = 4 + 6 * static_cast<int64_t>(MixerInputs::names().size());
    if (r == W - 1) error_of_comm([&] { c->all_gather(at::zeros({record}, at::kLong)); });
    world.barrier();
  }
}

// Prints only failures, prefixed with the rank (ranks other than 0).
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& r) override {
    if (r.failed())
      std::cerr << "[rank " << rank_ << "] " << (r.file_name() ? r.file_name() : "") << ":"
                << r.line_number() << ": " << r.summary() << "\n";
  }

 private:
  int rank_;
};

}  // namespace
}  // namespace carry::parallel

int main(int argc, char** argv) {
  using namespace carry::parallel;
  // A broken test must not hang CTest for the default 300 s.
  setenv("CARRY_COMM_TIMEOUT_S", "60", /*overwrite=*/0);
  init_mpi(&argc, &argv);
  at::set_num_threads(1);
  ::testing::InitGoogleTest(&argc, argv);
  int rank = world_info().rank;
  auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (rank != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new FailurePrinter(rank));
  }
  // A test that fails on any rank stops the job with that rank's message (tests/helpers/mpi_verdicts.h).
  listeners.Append(new carry::testing::RanksAgreeOnEveryTest());
  int rc = RUN_ALL_TESTS(), worst = 0;
  MPI_Allreduce(&rc, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && worst != rc)
    std::cout << "some rank other than 0 failed (see its [rank r] lines)\n";
  group_cache().clear();
  nccl_group_cache().clear();
  finalize_mpi();
  return worst;
}
