// The sequence-parallel state scan over the ranks of an sp communicator, forward and backward, for
// any mixer with a state summary (see state_scan.h for the math). The local work of each rank is
// the family's chunkwise form on its slice with autograd; this file adds only what crosses ranks:
// states and summaries going right in the forward, state gradients and transposed transports going
// left in the backward. The backward is a custom autograd node holding the rank's local graph.
#include "parallel/state_scan.h"

#include "layers/layout.h"
#include "layers/blocks/recompute.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>

#include <algorithm>
#include <optional>
#include <sstream>

namespace carry::parallel {

using torch::autograd::variable_list;

namespace {

const std::vector<std::string>& kInputNames = MixerInputs::names();

// Message tags: distinct per direction, scan round and head group, so that groups never mix and a
// mismatch shows in error messages.
constexpr int kTagTreeForward = 100;   // + round
constexpr int kTagTreeBackward = 200;  // + round
constexpr int kTagOrdered = 1000;      // + 2·group (forward), + 2·group + 1 (backward)
constexpr int kMaxHeadGroups = 8192;   // keeps the ordered tags below MPI's least tag bound 32767
int ordered_tag(int group, bool backward) { return kTagOrdered + 2 * group + (backward ? 1 : 0); }

std::string bracketed(const std::vector<int64_t>& v) { return "[" + join(v) + "]"; }

std::vector<Tensor> detached(const std::vector<Tensor>& ts) {
  std::vector<Tensor> out;
  for (auto& t : ts) out.push_back(t.defined() ? t.detach() : t);
  return out;
}

Summary detached(const Summary& s) { return {detached(s.transport), detached(s.state)}; }

// ---- layout agreement: every rank learns every rank's slice layout and check() verdict ----

// Per rank: [check ok, T, wants grad, head_groups, then per input name: defined, dtype, dim, sizes
// without T (dims 0, 2, 3; a constant without T, decay_rate: dims 0, 1)].
constexpr int64_t kFieldsPerInput = 6;
constexpr int64_t kHeadFields = 4;

std::string describe_layout(const int64_t* rec) {
  std::ostringstream s;
  bool first = true;
  for (size_t i = 0; i < kInputNames.size(); ++i) {
    const int64_t* f = rec + kHeadFields + i * kFieldsPerInput;
    if (!f[0]) continue;
    s << (first ? "" : ", ") << "'" << kInputNames[i] << "' [" << f[3];
    if (MixerInputs::per_token(kInputNames[i])) {
      s << ", *";
      for (int d = 2; d < f[2]; ++d) s << ", " << f[2 + d];
    } else {
      for (int d = 1; d < f[2]; ++d) s << ", " << f[3 + d];
    }
    s << "] " << static_cast<at::ScalarType>(f[1]);
    first = false;
  }
  return s.str();
}

struct Agreement {
  int64_t T = 0;            // every rank's slice length
  bool wants_grad = false;  // some rank differentiates (the backward is collective)
};

// Throws the same message on every rank for layout errors.
Agreement agree_layout(const Mixer& m, Communicator& sp, const MixerInputs& in, const State& init,
                       const MixerOptions& opt, int head_groups, const std::string& what) {
  const int P = sp.size(), r = sp.rank();
  const int64_t C = opt.chunk_size;
  TORCH_CHECK(C > 0, what, ": chunk_size must be positive, got ", C);
  const int n_inputs = static_cast<int>(kInputNames.size());
  std::vector<int64_t> rec(kHeadFields + n_inputs * kFieldsPerInput, 0);
  int64_t T = -1;
  bool wants_grad = false;
  if (at::GradMode::is_enabled())
    for (auto& t : init) wants_grad = wants_grad || (t.defined() && t.requires_grad());
  for (int i = 0; i < n_inputs; ++i) {
    const Tensor& t = in.get(kInputNames[i]);
    int64_t* f = rec.data() + kHeadFields + i * kFieldsPerInput;
    if (!t.defined()) continue;
    wants_grad = wants_grad || (at::GradMode::is_enabled() && t.requires_grad());
    f[0] = 1;
    f[1] = static_cast<int64_t>(t.scalar_type());
    f[2] = t.dim();
    if (!MixerInputs::per_token(kInputNames[i])) {  // no T: every size is compared
      for (int d = 0; d < std::min<int64_t>(t.dim(), 3); ++d) f[3 + d] = t.size(d);
      continue;
    }
    for (int d = 0; d < std::min<int64_t>(t.dim(), 4); ++d)
      if (d != 1) f[3 + (d == 0 ? 0 : d - 1)] = t.size(d);
    if (T < 0 && t.dim() >= 2) T = t.size(1);
  }
  rec[1] = T;
  rec[2] = wants_grad;
  rec[3] = head_groups;
  std::string local_error;
  if (T > 0 && T % C == 0) {
    MixerOptions lopt = opt;
    lopt.offset = opt.offset + r * T;
    try {
      m.check(in, lopt, /*chunked=*/true);
      if (!init.empty()) {  // rank 0: the initial state must be laid out like a state
        State zero = m.zero_state(in, lopt);
        bool same = zero.size() == init.size();
        for (size_t i = 0; same && i < init.size(); ++i) same = init[i].sizes() == zero[i].sizes();
        if (!same) {
          std::ostringstream msg;
          msg << "initial_state must have " << zero.size() << " entries shaped";
          for (auto& t : zero) msg << " " << t.sizes();
          msg << "; got " << init.size() << " entries shaped";
          for (auto& t : init) msg << " " << t.sizes();
          TORCH_CHECK(false, msg.str());
        }
      }
    } catch (const c10::Error& e) {
      local_error = e.what_without_backtrace();
    }
  }
  rec[0] = local_error.empty();
  std::vector<Tensor> all;
  {
    CommContext ctx(what + ": agreeing on the slice layout");
    all = sp.all_gather(at::tensor(rec, at::kLong));
  }
  std::vector<std::vector<int64_t>> recs;
  for (auto& t : all) {
    auto c = t.contiguous();
    recs.emplace_back(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
  }
  // 1. Lengths: equal, whole chunks.
  std::vector<int64_t> lengths;
  bool ok = true;
  for (auto& x : recs) {
    lengths.push_back(x[1]);
    ok = ok && x[1] > 0 && x[1] == recs[0][1] && x[1] % C == 0;
  }
  int64_t total = 0;
  for (auto l : lengths) total += std::max<int64_t>(l, 0);
  TORCH_CHECK(
      ok, what, ": every rank's slice must have the same length, a multiple of chunk_size=", C,
      " (the sequence length T must be a multiple of sp·chunk_size = ", P, "·", C, " = ", P * C,
      "); got slice lengths ", bracketed(lengths), " over sp=", P, " ranks (T=", total, ")");
  // 2. Shapes (except T) and dtypes: equal.
  for (int i = 1; i < P; ++i) {
    bool same =
        std::equal(recs[i].begin() + kHeadFields, recs[i].end(), recs[0].begin() + kHeadFields);
    TORCH_CHECK(
        same, what, ": the ranks' slices differ in inputs, shapes or dtypes: sp rank 0 has ",
        describe_layout(recs[0].data()), "; sp rank ", i, " has ", describe_layout(recs[i].data()));
  }
  // 3. The same head_groups.
  std::vector<int64_t> groups;
  for (auto& x : recs) groups.push_back(x[3]);
  TORCH_CHECK(std::all_of(groups.begin(), groups.end(), [&](int64_t g) { return g == groups[0]; }),
              what, ": every rank must ask for the same head_groups; got ", bracketed(groups),
              " (sp ranks 0..", P - 1, ")");
  // 4. Every rank's check() passed.
  std::vector<int64_t> refused;
  for (int i = 0; i < P; ++i)
    if (!recs[i][0]) refused.push_back(i);
  if (!refused.empty()) {
    if (!local_error.empty())
      TORCH_CHECK(false, what, ": sp rank ", r, " refused its slice: ", local_error);
    TORCH_CHECK(false, what, ": sp rank(s) ", bracketed(refused),
                " refused their slices (their error says why); this rank's slice was accepted");
  }
  Agreement a;
  a.T = recs[0][1];
  for (auto& x : recs) a.wants_grad = a.wants_grad || x[2];
  return a;
}

// The caller agreed the layout once (parallel::make_slice_context): this rank's own view, no message.
Agreement local_layout(const Mixer& m, const MixerInputs& in, const State& init, const MixerOptions& opt,
                       int r) {
  Agreement a;
  for (const auto& n : kInputNames) {
    const Tensor& t = in.get(n);
    if (!t.defined()) continue;
    if (a.T == 0 && t.dim() >= 2 && MixerInputs::per_token(n)) a.T = t.size(1);
    a.wants_grad = a.wants_grad || (at::GradMode::is_enabled() && t.requires_grad());
  }
  if (at::GradMode::is_enabled())
    for (auto& t : init) a.wants_grad = a.wants_grad || (t.defined() && t.requires_grad());
  MixerOptions lopt = opt;
  lopt.offset = opt.offset + r * a.T;
  m.check(in, lopt, /*chunked=*/true);
  return a;
}

// ---- summaries and states as messages ----

// A summary as one list: transport..., (undefined), state....
std::vector<Tensor> flatten(const Summary& s) {
  std::vector<Tensor> out = s.transport;
  out.emplace_back();
  for (auto& t : s.state) {
    TORCH_INTERNAL_ASSERT(t.defined(), "a summary's state has an undefined entry");
    out.push_back(t);
  }
  for (auto& t : s.transport)
    TORCH_INTERNAL_ASSERT(t.defined(), "a transport has an undefined entry");
  return out;
}

// Splits at undefined entries.
std::vector<std::vector<Tensor>> split_at_undefined(const std::vector<Tensor>& ts) {
  std::vector<std::vector<Tensor>> parts(1);
  for (auto& t : ts) {
    if (t.defined())
      parts.back().push_back(t);
    else
      parts.emplace_back();
  }
  return parts;
}

Summary unflatten_summary(const std::vector<Tensor>& ts) {
  auto parts = split_at_undefined(ts);
  TORCH_INTERNAL_ASSERT(parts.size() == 2, "malformed summary message");
  return {parts[0], parts[1]};
}

// The backward scan's element: the map x ↦ c + Mᵀx (M a forward summary over a range of ranks, c
// the gradient at the range's incoming state).
struct Adjoint {
  Summary M;
  State c;
};

std::vector<Tensor> flatten(const Adjoint& a) {
  auto out = flatten(a.M);
  out.emplace_back();
  for (auto& t : a.c) out.push_back(t);
  return out;
}

Adjoint unflatten_adjoint(const std::vector<Tensor>& ts) {
  auto parts = split_at_undefined(ts);
  TORCH_INTERNAL_ASSERT(parts.size() == 3, "malformed adjoint message");
  return {{parts[0], parts[1]}, parts[2]};
}

// The scan's summary algebra. Without packed documents it is the family's own. With them (the tree
// and allgather scans), a range of ranks in which a document starts maps every incoming state to the
// same state, its state from the last start on: such a summary carries, as its transport's last
// entry, a flag per sequence [B] in the state's dtype (1: a document starts in the range). `apply`
// then gives the state part for flagged sequences and `compose` keeps the later range's state where
// that range is flagged, so the prefixes, S_in and the state gradients (the vector-Jacobian products
// of `apply`, zero through a flagged sequence) all reset at document starts.
struct Algebra {
  const Mixer* m = nullptr;
  bool resets = false;

  // (the family's summary, the flags or undefined)
  std::pair<Summary, Tensor> split(const Summary& M) const {
    if (!resets) return {M, Tensor()};
    TORCH_INTERNAL_ASSERT(!M.transport.empty(), "a summary with document resets lacks its flags");
    Summary f{std::vector<Tensor>(M.transport.begin(), M.transport.end() - 1), M.state};
    return {f, M.transport.back()};
  }
  // Per sequence (dim 0): `flagged` where flag is 1, else `other`.
  static Tensor rows(const Tensor& flag, const Tensor& flagged, const Tensor& other) {
    std::vector<int64_t> shape(other.dim(), 1);
    shape[0] = flag.size(0);
    return at::where(flag.view(shape) > 0, flagged, other);
  }
  Summary compose(const Summary& first, const Summary& second) const {
    if (!resets) return m->compose(first, second);
    auto [a, fa] = split(first);
    auto [b, fb] = split(second);
    Summary out = m->compose(a, b);
    for (size_t i = 0; i < out.state.size(); ++i) out.state[i] = rows(fb, b.state[i], out.state[i]);
    out.transport.push_back(at::maximum(fa, fb));
    return out;
  }
  State apply(const Summary& M, const State& S) const {
    if (!resets) return m->apply(M, S);
    auto [f, flag] = split(M);
    State y = m->apply(f, S);
    for (size_t i = 0; i < y.size(); ++i)
      if (y[i].defined()) y[i] = rows(flag, f.state[i].to(y[i].scalar_type()), y[i]);
    return y;
  }
  // This rank's summary: with document starts, each sequence's state from its last start on (its
  // flag set) where one lies in the slice, the family's summary elsewhere.
  Summary summarize(const MixerInputs& in, const MixerOptions& opt, const State& zero) const {
    if (!resets) return m->summarize(in, opt);
    MixerOptions plain = opt;
    plain.document_starts = Tensor();
    plain.document_offsets.clear();
    Summary M = m->summarize(in, plain);
    State since_start = m->forward(in, zero, opt).final_state;  // resets at every start
    TORCH_INTERNAL_ASSERT(since_start.size() == M.state.size() && !M.state.empty());
    Tensor flag = opt.document_starts.any(1).to(M.state[0].options());
    for (size_t i = 0; i < M.state.size(); ++i)
      M.state[i] = rows(flag, since_start[i].to(M.state[i].scalar_type()), M.state[i]);
    M.transport.push_back(flag);
    return M;
  }
};

State zeros_like_state(const State& s) {
  State z;
  for (auto& t : s) z.push_back(at::zeros_like(t));
  return z;
}

// Elementwise a + b; undefined entries count as zero.
State add(const State& a, const State& b) {
  if (a.empty()) return b;
  if (b.empty()) return a;
  TORCH_INTERNAL_ASSERT(a.size() == b.size());
  State out;
  for (size_t i = 0; i < a.size(); ++i)
    out.push_back(!a[i].defined() ? b[i] : !b[i].defined() ? a[i] : a[i] + b[i]);
  return out;
}

// Aᵀ·c for the transport of `M`: the vector-Jacobian product of S ↦ apply(M, S) with cotangent `c`.
// `like` gives the layout of the state M acts on (it equals the layout of the gradient there).
State apply_transposed(const Algebra& m, const Summary& M, const State& c, const State& like) {
  at::AutoGradMode grad_on(true);
  State S;
  for (auto& t : like) S.push_back(at::zeros_like(t).requires_grad_(true));
  State y = m.apply(detached(M), S);
  TORCH_INTERNAL_ASSERT(y.size() == c.size(), m.m->name(), ": apply returned ", y.size(),
                        " state entries, the gradient has ", c.size());
  variable_list outs, cots;
  for (size_t i = 0; i < y.size(); ++i)
    if (y[i].defined() && y[i].requires_grad() && c[i].defined()) {
      outs.push_back(y[i]);
      cots.push_back(c[i]);
    }
  if (outs.empty()) return zeros_like_state(like);
  auto g = torch::autograd::grad(outs, S, cots, /*retain_graph=*/false, /*create_graph=*/false,
                                 /*allow_unused=*/true);
  for (size_t i = 0; i < g.size(); ++i)
    if (!g[i].defined()) g[i] = at::zeros_like(like[i]);
  return g;
}

// a then b (a covers the ranks just left of b's): x ↦ c_a + M_aᵀ(c_b + M_bᵀx).
Adjoint combine(const Algebra& m, const Adjoint& a, const Adjoint& b, bool need_transport) {
  Adjoint out;
  out.c = add(a.c, apply_transposed(m, a.M, b.c, a.c));
  if (need_transport) out.M = m.compose(a.M, b.M);
  return out;
}

// ---- the autograd node ----

// One head group's local graph (all heads when the heads are not grouped).
struct HeadGroup {
  std::vector<Tensor> leaves;  // the group's heads of the defined inputs (kInputNames order)
  State s_in;                  // leaves requiring grad
  Tensor o;                    // local graph outputs
  State s_out;
  // Ordered chain, rank > 0: set once the kernel form's backward sent d S_in to the previous rank from
  // MixerOptions::on_initial_state_grad (right after its reverse state walk); the backward sends it
  // itself otherwise.
  std::shared_ptr<bool> grad_sent;
};

struct ScanContext {
  const Mixer* mixer = nullptr;
  Algebra algebra;  // the summaries' algebra (document resets in the tree and allgather scans)
  Communicator* sp = nullptr;
  ScanMode mode = ScanMode::ordered;
  MixerOptions opt;  // this rank's (offset of the slice)
  std::string what;
  int r = 0, P = 1;
  int64_t heads_per_group = 0;         // heads of each group (inputs: dim 2, states: dim 1)
  std::vector<HeadGroup> groups;       // ordered: G groups in order; tree / allgather: one
  std::vector<bool> input_wants_grad;  // per defined input, kInputNames order
  // Per defined input, the dimension its head groups' gradients are concatenated along (the input's
  // head_dim), or -1 for an input shared by all heads (Mamba-1's q, k), whose gradients are summed.
  std::vector<int64_t> input_head_dim;
  size_t n_init = 0;                   // initial-state entries among the node's inputs (rank 0)
  Summary summary;  // tree / allgather: this rank's summary (rank 0: initial state folded)
  std::vector<Summary> all_summaries;  // allgather: every rank's
};

// Gradients of a local graph with cotangents (d_o, d_s_out) for `inputs`; zeros for unused ones.
variable_list local_vjp(const HeadGroup& c, const Tensor& d_o, const State& d_s_out,
                        const variable_list& inputs, bool retain) {
  variable_list outs, cots;
  if (d_o.defined() && c.o.requires_grad()) {
    outs.push_back(c.o);
    cots.push_back(d_o);
  }
  for (size_t i = 0; i < c.s_out.size(); ++i)
    if (i < d_s_out.size() && d_s_out[i].defined() && c.s_out[i].requires_grad()) {
      outs.push_back(c.s_out[i]);
      cots.push_back(d_s_out[i]);
    }
  variable_list wanted;
  std::vector<size_t> where;
  for (size_t i = 0; i < inputs.size(); ++i)
    if (inputs[i].requires_grad()) {
      wanted.push_back(inputs[i]);
      where.push_back(i);
    }
  variable_list res(inputs.size());
  if (!outs.empty() && !wanted.empty()) {
    auto g = torch::autograd::grad(outs, wanted, cots, retain, /*create_graph=*/false,
                                   /*allow_unused=*/true);
    for (size_t j = 0; j < g.size(); ++j) res[where[j]] = g[j];
  }
  for (size_t i = 0; i < inputs.size(); ++i)
    if (!res[i].defined()) res[i] = at::zeros_like(inputs[i]);
  return res;
}

// Λ_{r+1} by the mirrored Hillis-Steele scan: round d sends this rank's inclusive adjoint (covering
// ranks r..r+d-1) to r-d and receives r+d's; E accumulates ranks r+1.. .
State reverse_tree_scan(const ScanContext& c, const State& g) {
  const Algebra& m = c.algebra;
  Adjoint X{c.summary, g};
  std::optional<Adjoint> E;
  auto dev = at::TensorOptions().device(g.empty() ? at::Device(at::kCPU) : g[0].device());
  int round = 0;
  for (int d = 1; d < c.P; d *= 2, ++round) {
    int dst = c.r - d >= 0 ? c.r - d : -1, src = c.r + d < c.P ? c.r + d : -1;
    std::vector<Tensor> got;
    {
      CommContext ctx(c.what + ": tree scan backward, round " + std::to_string(round));
      got = exchange_packed(*c.sp, dst >= 0 ? flatten(X) : std::vector<Tensor>{}, dst, src, dev,
                            kTagTreeBackward + round);
    }
    if (src < 0) continue;
    Adjoint Y = unflatten_adjoint(got);
    bool more = c.r + 2 * d < c.P;  // a later round will receive again
    E = E ? combine(m, *E, Y, more) : Y;
    if (c.r - 2 * d >= 0) X = combine(m, X, Y, true);  // a later round will send X
  }
  return E ? E->c : State{};
}

// Λ_{r+1} from every rank's (summary, g): fold from the right.
State reverse_allgather(const ScanContext& c, const State& g) {
  const Algebra& m = c.algebra;
  auto dev = at::TensorOptions().device(g.empty() ? at::Device(at::kCPU) : g[0].device());
  std::vector<std::vector<Tensor>> all;
  {
    CommContext ctx(c.what + ": allgather backward");
    all = all_gather_packed(*c.sp, g, dev);
  }
  State lambda;
  for (int j = c.P - 1; j > c.r; --j) {
    const State& gj = all[j];
    lambda = lambda.empty() ? gj : add(gj, apply_transposed(m, c.all_summaries[j], lambda, gj));
  }
  return lambda;
}

// Heads [g·n, (g+1)·n) of every entry along `dim`; undefined entries stay undefined.
std::vector<Tensor> heads_of(const std::vector<Tensor>& ts, int64_t dim, int g, int64_t n) {
  std::vector<Tensor> out;
  for (auto& t : ts) out.push_back(t.defined() ? t.narrow(dim, g * n, n) : t);
  return out;
}

// Heads [g·n, (g+1)·n) of H: inputs shared by all heads stay whole (MixerInputs::head_range).
MixerInputs heads_of(const MixerInputs& in, int g, int64_t n, int64_t H) { return in.head_range(g * n, n, H); }

// Entry i of every list, concatenated along `dim` (a single list is returned as it is).
std::vector<Tensor> cat_entries(const std::vector<std::vector<Tensor>>& lists, int64_t dim) {
  if (lists.size() == 1) return lists[0];
  std::vector<Tensor> out;
  for (size_t i = 0; i < lists[0].size(); ++i) {
    std::vector<Tensor> parts;
    for (auto& l : lists) parts.push_back(l[i]);
    out.push_back(at::cat(parts, dim));
  }
  return out;
}

class ScanBackward final : public torch::autograd::Node {
 public:
  explicit ScanBackward(std::shared_ptr<ScanContext> ctx) : ctx_(std::move(ctx)) {}
  std::string name() const override { return "carry::parallel::ScanBackward"; }
  void release_variables() override { ctx_.reset(); }

  // grads: d(o), then d(final state entries). Returns the gradients of the node's inputs: the
  // defined mixer inputs, then (rank 0) the initial-state entries.
  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(ctx_,
                "sequence-parallel scan: backward called twice (the local graph is freed after "
                "the first; retain_graph is not supported)");
    at::NoGradGuard no_grad;  // what we build here is not differentiated again
    auto c = std::move(ctx_);
    const int r = c->r, P = c->P, G = static_cast<int>(c->groups.size());
    const int64_t n = c->heads_per_group;
    Tensor d_o = grads.at(0);
    State direct(grads.begin() + 1, grads.end());

    // Per head group: the gradients of its leaves (inputs, then S_in).
    std::vector<variable_list> in_grads;
    std::vector<State> d_s_in;
    for (int gi = 0; gi < G; ++gi) {
      HeadGroup& hg = c->groups[gi];
      Tensor d_o_g = G > 1 && d_o.defined() ? d_o.narrow(2, gi * n, n) : d_o;
      State direct_g = G > 1 ? heads_of(direct, 1, gi, n) : direct;
      // Λ_{r+1}: the gradient at the state leaving this rank, from the ranks after it.
      State lambda_next;
      std::optional<variable_list> done;  // the last rank's gradients, when one vjp gave them all
      if (c->mode == ScanMode::ordered) {
        if (r < P - 1) {
          CommContext ctx(c->what + ": ordered backward, state gradient of head group " +
                          std::to_string(gi) + " from the next rank");
          lambda_next =
              recv_tensors(*c->sp, zeros_like_state(hg.s_out), r + 1, ordered_tag(gi, true));
        }
      } else {
        TORCH_INTERNAL_ASSERT(G == 1, "only the ordered scan groups heads");
        // g_r: the gradient at S_in of this rank's own outputs and direct final-state gradient. No rank
        // reads rank 0's (there is none before it: zeros go in its place). The last rank's Λ_{r+1} is
        // zero, so the one vjp with (d_o, direct) gives its g_r and every other gradient at once; the
        // ranks between take g_r first (a second pass through the local backward).
        State g;
        if (r == 0) {
          g = zeros_like_state(hg.s_in);
        } else if (r == P - 1) {
          variable_list all = hg.leaves;
          all.insert(all.end(), hg.s_in.begin(), hg.s_in.end());
          done = local_vjp(hg, d_o_g, direct_g, all, /*retain=*/false);
          g.assign(done->end() - hg.s_in.size(), done->end());
        } else {
          g = local_vjp(hg, d_o_g, direct_g, hg.s_in, /*retain=*/true);
        }
        lambda_next =
            c->mode == ScanMode::tree ? reverse_tree_scan(*c, g) : reverse_allgather(*c, g);
      }
      State d_s_out = add(direct_g, lambda_next);

      variable_list inputs = hg.leaves;
      inputs.insert(inputs.end(), hg.s_in.begin(), hg.s_in.end());
      auto g = done ? std::move(*done) : local_vjp(hg, d_o_g, d_s_out, inputs, /*retain=*/false);
      State d_s_in_g(g.end() - hg.s_in.size(), g.end());
      if (c->mode == ScanMode::ordered && r > 0) {
        if (!(hg.grad_sent && *hg.grad_sent)) {
          CommContext ctx(c->what + ": ordered backward, state gradient of head group " +
                          std::to_string(gi) + " to the previous rank");
          send_tensors(*c->sp, d_s_in_g, r - 1, ordered_tag(gi, true));
        }
      }
      g.resize(hg.leaves.size());
      in_grads.push_back(std::move(g));
      d_s_in.push_back(std::move(d_s_in_g));
      hg = HeadGroup{};  // frees the group's graph
    }
    variable_list out;
    for (size_t i = 0; i < c->input_wants_grad.size(); ++i) {
      if (!c->input_wants_grad[i]) {
        out.emplace_back();
        continue;
      }
      std::vector<Tensor> parts;
      for (auto& g : in_grads) parts.push_back(g[i]);
      const int64_t dim = c->input_head_dim[i];
      Tensor sum;  // a shared input: the groups' gradients summed in group order
      if (G > 1 && dim < 0)
        for (auto& p : parts) sum = sum.defined() ? sum + p : p;
      out.push_back(G == 1 ? parts[0] : dim < 0 ? sum : at::cat(parts, dim));
    }
    if (c->n_init > 0) {
      State d_init = cat_entries(d_s_in, 1);
      for (size_t i = 0; i < c->n_init; ++i) out.push_back(d_init[i]);
    }
    return out;
  }

 private:
  std::shared_ptr<ScanContext> ctx_;
};

}  // namespace

ScanMode parse_scan_mode(const std::string& name) {
  if (name == "ordered") return ScanMode::ordered;
  if (name == "tree") return ScanMode::tree;
  if (name == "allgather") return ScanMode::allgather;
  TORCH_CHECK(false, "unknown sequence-parallel scan mode '", name,
              "'; modes are ordered, tree, allgather");
}

std::string scan_mode_name(ScanMode mode) {
  switch (mode) {
    case ScanMode::ordered:
      return "ordered";
    case ScanMode::tree:
      return "tree";
    case ScanMode::allgather:
      return "allgather";
  }
  return "?";
}

MixerInputs sp_slice(const MixerInputs& whole, int sp_rank, int sp_size, int64_t chunk_size) {
  TORCH_CHECK(sp_size >= 1 && sp_rank >= 0 && sp_rank < sp_size, "sp_slice: rank ", sp_rank,
              " is not in 0..", sp_size - 1);
  TORCH_CHECK(chunk_size > 0, "sp_slice: chunk_size must be positive, got ", chunk_size);
  int64_t T = -1;
  for (const auto& n : kInputNames)
    if (whole.get(n).defined() && whole.get(n).dim() >= 2 && MixerInputs::per_token(n)) {
      T = whole.get(n).size(1);
      break;
    }
  TORCH_CHECK(T > 0, "sp_slice: no input with a sequence dimension");
  TORCH_CHECK(T % (sp_size * chunk_size) == 0, "sequence parallelism: the sequence length T=", T,
              " must be a multiple of sp·chunk_size = ", sp_size, "·", chunk_size, " = ",
              sp_size * chunk_size, " (every rank gets T/sp tokens, a whole number of chunks)");
  int64_t len = T / sp_size;
  return whole.slice(sp_rank * len, len);
}

int default_head_groups(int64_t heads) {
  for (int g = 4; g > 1; --g)
    if (heads % g == 0) return g;
  return 1;
}

namespace {

// One rank's forward of sp_mixer_forward, once its layout is agreed: the inputs, the options of its
// slice, the head groups and the scan's context (kept for the backward). The scan modes below run on it.
struct ForwardRun {
  const Mixer& mixer;
  Communicator& sp;
  const MixerInputs& in;
  MixerOptions lopt;          // the slice's options (offset r·T)
  std::string what;           // the scan's name, for messages and communication contexts
  int r = 0, P = 1;
  bool wants_grad = false;    // some rank differentiates
  int G = 1;                  // head groups (ordered only)
  int64_t n_heads = 0;        // heads a group
  State zero;                 // the zero state, fp32 at least
  State init;                 // rank 0's initial state (empty elsewhere or when none)
  State init_det;             // detached, or the zero state
  MixerInputs det;            // the inputs, detached
  std::shared_ptr<ScanContext> c;

  // Leaves that stand for a head group's inputs in its local graph (kept in the group for the backward).
  MixerInputs leaves_of(const MixerInputs& in_g, HeadGroup& hg) const {
    MixerInputs leaf_in;
    for (const auto& n : kInputNames) {
      const Tensor& t = in_g.get(n);
      if (!t.defined()) continue;
      leaf_in.get(n) = t.detach().requires_grad_(t.requires_grad());
      hg.leaves.push_back(leaf_in.get(n));
    }
    return leaf_in;
  }

  // The local forward of one head group with its S_in: with autograd on leaves that stand for the
  // group's inputs and S_in when some rank differentiates.
  // on_final_state, on_initial_state_grad: MixerOptions' hooks for this run (the ordered chain's sends).
  MixerOutput local_forward(int gi, const State& s_in, std::function<void(const State&)> on_final_state = {},
                            std::function<void(const State&)> on_initial_state_grad = {}) const {
    const MixerInputs in_g = G > 1 ? heads_of(in, gi, n_heads, G * n_heads) : in;
    MixerOptions gopt = lopt;
    gopt.on_final_state = std::move(on_final_state);
    gopt.on_initial_state_grad = std::move(on_initial_state_grad);
    if (!wants_grad) {
      at::NoGradGuard no_grad;
      return mixer.forward(in_g, s_in, gopt);
    }
    at::AutoGradMode grad_on(true);
    HeadGroup& hg = c->groups[gi];
    MixerInputs leaf_in = leaves_of(in_g, hg);
    for (auto& t : s_in) hg.s_in.push_back(t.detach().requires_grad_(true));
    MixerOutput out = mixer.forward(leaf_in, hg.s_in, gopt);
    hg.o = out.o;
    hg.s_out = out.final_state;
    return out;
  }
};

// ORDERED: per head group, S_in from r−1 (rank 0: the initial state), the local forward, S_out to r+1.
std::vector<MixerOutput> ordered_forward(ForwardRun& f) {
  const int r = f.r, P = f.P, G = f.G;
  const std::string& what = f.what;
  std::vector<MixerOutput> outs;
  for (int gi = 0; gi < G; ++gi) {
    State s_in;
    if (r > 0) {
      at::NoGradGuard no_grad;
      CommContext ctx(what + ": ordered forward, state of head group " + std::to_string(gi) +
                      " from the previous rank");
      // A recomputation takes the state its forward received (layers/blocks/recompute.h).
      s_in = received_once([&] {
        return recv_tensors(f.sp, G > 1 ? heads_of(f.zero, 1, gi, f.n_heads) : f.zero, r - 1, ordered_tag(gi, false));
      });
    } else {
      s_in = G > 1 ? heads_of(f.init_det, 1, gi, f.n_heads) : f.init_det;
    }
    // S_out to r+1 as soon as the family has it (Mixer::forward calls on_final_state exactly once: a
    // kernel form right after its state walk, so the send runs beside the output kernel; every other
    // form when it returns). The values are the returned final state's.
    std::function<void(const State&)> send_on;
    if (r < P - 1) {
      send_on = [&, gi](const State& s_out) {
        CommContext ctx(what + ": ordered forward, state of head group " + std::to_string(gi) +
                        " to the next rank");
        received_once([&] {
          send_tensors(f.sp, detached(s_out), r + 1, ordered_tag(gi, false));
          return std::vector<Tensor>{};
        });
      };
    }
    // d S_in back to r−1 in the backward, from the kernel form right after its reverse state walk
    // (ScanBackward sends it itself when the form did not). It runs after sp_mixer_forward returned:
    // it holds what it needs by value.
    std::function<void(const State&)> send_back;
    if (r > 0 && f.wants_grad) {
      auto sent = std::make_shared<bool>(false);
      f.c->groups[gi].grad_sent = sent;
      Communicator* comm = &f.sp;
      send_back = [sent, comm, gi, r, w = what](const State& d_s_in) {
        if (*sent) return;
        CommContext ctx(w + ": ordered backward, state gradient of head group " + std::to_string(gi) +
                        " to the previous rank");
        send_tensors(*comm, d_s_in, r - 1, ordered_tag(gi, true));
        *sent = true;
      };
    }
    outs.push_back(f.local_forward(gi, s_in, send_on, send_back));
  }
  return outs;
}

// TREE: the composition of ranks 0..r−1's summaries by an exclusive Hillis-Steele scan (X covers ranks
// max(0, r−d+1)..r before round d); none on rank 0.
std::optional<Summary> tree_prefix(ForwardRun& f, const Summary& mine, const at::TensorOptions& dev) {
  const Algebra& alg = f.c->algebra;
  const int r = f.r, P = f.P;
  std::optional<Summary> prefix;
  Summary X = mine;
  int round = 0;
  for (int d = 1; d < P; d *= 2, ++round) {
    int dst = r + d < P ? r + d : -1, src = r - d >= 0 ? r - d : -1;
    std::vector<Tensor> got;
    {
      CommContext ctx(f.what + ": tree scan forward, round " + std::to_string(round));
      got = received_once([&] {
        return exchange_packed(f.sp, dst >= 0 ? flatten(X) : std::vector<Tensor>{}, dst, src, dev,
                               kTagTreeForward + round);
      });
    }
    if (src < 0) continue;
    Summary Y = unflatten_summary(got);  // ranks max(0, r-2d+1)..r-d
    prefix = prefix ? alg.compose(Y, *prefix) : Y;
    if (r + 2 * d < P) X = alg.compose(Y, X);  // a later round sends X
  }
  return prefix;
}

// ALLGATHER: every rank's summary gathered (kept in the context for the backward), ranks 0..r−1's
// composed in order; none on rank 0.
std::optional<Summary> allgather_prefix(ForwardRun& f, const Summary& mine, const at::TensorOptions& dev) {
  const Algebra& alg = f.c->algebra;
  std::vector<std::vector<Tensor>> all;
  {
    CommContext ctx(f.what + ": allgather forward");
    // One list: every rank's summary flattened, with the count of tensors a rank first.
    std::vector<Tensor> packed = received_once([&] {
      std::vector<Tensor> flat;
      for (auto& a : all_gather_packed(f.sp, flatten(mine), dev)) {
        flat.push_back(at::tensor({static_cast<int64_t>(a.size())}, at::kLong));
        flat.insert(flat.end(), a.begin(), a.end());
      }
      return flat;
    });
    for (size_t i = 0; i < packed.size();) {
      const int64_t n = packed[i].item<int64_t>();
      all.emplace_back(packed.begin() + i + 1, packed.begin() + i + 1 + n);
      i += 1 + n;
    }
  }
  std::optional<Summary> prefix;
  for (auto& a : all) f.c->all_summaries.push_back(unflatten_summary(a));
  for (int j = 0; j < f.r; ++j)
    prefix = prefix ? alg.compose(*prefix, f.c->all_summaries[j]) : f.c->all_summaries[j];
  return prefix;
}

// TREE and ALLGATHER: this rank's summary, the prefix of the ranks before it (tree_prefix or
// allgather_prefix), and the local run from the S_in it gives.
MixerOutput summary_scan_forward(ForwardRun& f, ScanMode mode) {
  const Mixer& mixer = f.mixer;
  const int r = f.r, P = f.P;
  ScanContext& c = *f.c;
  // With a fixed summary (Mixer::fixed_summary) the two end ranks skip summarizing: rank 0's summary,
  // its initial state folded in, is its own run's final state under a transport no rank reads (rank 0
  // is the first of every composition), so that run comes first and is its output; the last rank's
  // summary is read by no rank (its transport would only act on the zero gradient after the
  // sequence's end, its state on nothing), so it sends a placeholder of the right shapes and runs once
  // from its S_in after the scan.
  const std::optional<Summary> placeholder = P > 1 && (r == 0 || r == P - 1) && !c.algebra.resets
                                                 ? mixer.fixed_summary(f.det, f.zero)
                                                 : std::nullopt;
  const bool end_rank = placeholder.has_value();
  // Otherwise one pass (families with Mixer::state_output, no document resets): the slice runs from
  // the zero state, which gives the summary's state, beside whatever else the readout needs (the
  // delta rule's run from the identity); after the scan, S_in's share of the output and of the final
  // state (apply with the transport) is added. Otherwise the slice is summarized, then run again
  // from its S_in.
  const bool one_pass = !end_rank && !c.algebra.resets && mixer.has_state_output(f.in, f.lopt);
  std::optional<MixerOutput> early;  // rank 0's local forward, run before the scan
  std::optional<MixerOutput> from_zero;
  std::optional<Mixer::StateReadout> readout;  // one pass: the slice's transport and S_in's share
  MixerInputs src = f.det;                     // one pass: the inputs both parts read (with autograd, their leaves)
  if (one_pass) {
    at::AutoGradMode grad_mode(f.wants_grad);
    if (f.wants_grad) src = f.leaves_of(f.in, c.groups[0]);
    from_zero = mixer.forward(src, f.zero, f.lopt);
    readout = mixer.state_readout(src, f.lopt);
  }
  // S_in, outside autograd (its gradient is routed by our backward).
  State s_in;
  {
    at::NoGradGuard no_grad;
    const Algebra& alg = c.algebra;
    Summary mine;
    if (one_pass) {
      mine = Summary{detached(readout->transport), detached(from_zero->final_state)};
    } else if (end_rank && r == 0) {
      early = f.local_forward(0, f.init_det);  // with autograd where wanted (local_forward's own mode)
      mine = *mixer.fixed_summary(f.det, detached(early->final_state));
    } else if (end_rank) {
      mine = *placeholder;
    } else {
      mine = alg.summarize(f.det, f.lopt, f.zero);
    }
    if (r == 0 && !f.init.empty() && !early) mine.state = alg.apply(mine, f.init_det);  // fold S_init in
    mine = detached(mine);
    auto dev = at::TensorOptions().device(f.zero.empty() ? at::Device(at::kCPU) : f.zero[0].device());
    const std::optional<Summary> prefix = mode == ScanMode::tree ? tree_prefix(f, mine, dev)   // ranks 0..r-1
                                                                 : allgather_prefix(f, mine, dev);
    // S_in of rank r is the state part of the prefix (the zero state before rank 0, S_init
    // folded).
    s_in = r == 0 ? f.init_det : detached(prefix->state);
    c.summary = mine;
  }
  if (early) return *early;
  if (!one_pass) return f.local_forward(0, s_in);
  // S_in's share added to the run from zero; with autograd S_in is a leaf of the local graph.
  at::AutoGradMode grad_mode(f.wants_grad);
  HeadGroup& hg = c.groups[0];
  if (f.wants_grad) {
    for (auto& t : s_in) hg.s_in.push_back(t.detach().requires_grad_(true));
    s_in = hg.s_in;
  }
  MixerOutput out = *from_zero;
  // The sum in the wider of the two dtypes (a kernel form's bf16 output, S_in's fp32 share), rounded
  // once to the run's own output dtype: o has on every rank the dtype the local forward gives (the end
  // ranks', the ordered chain's, the serial run's), so the ranks' outputs are pieces of one tensor: a
  // gather of them moves equal byte counts from every rank (over NCCL, unequal counts leave the
  // communicator out of step with the ranks).
  Tensor share = readout->share(s_in);
  const auto dt = at::promote_types(out.o.scalar_type(), share.scalar_type());
  out.o = (out.o.to(dt) + share.to(dt)).to(out.o.scalar_type());
  out.final_state = mixer.apply(Summary{readout->transport, out.final_state}, s_in);
  if (f.wants_grad) hg.o = out.o, hg.s_out = out.final_state;
  return out;
}

}  // namespace

MixerOutput sp_mixer_forward(const Mixer& mixer, Communicator& sp, const MixerInputs& in,
                             const State& initial_state, const MixerOptions& opt, ScanMode mode,
                             int head_groups, bool layout_agreed) {
  const int r = sp.rank(), P = sp.size();
  // Rank-independent, so that layout errors read the same on every rank.
  std::string what = "sequence-parallel " + scan_mode_name(mode) + " scan of " + mixer.name() +
                     " over sp=" + std::to_string(P) + " ranks";
  TORCH_CHECK(mixer.has_summary(), what,
              ": the family has no recurrent state to pass between ranks");
  // Packed documents: the ordered chain runs each slice with its document starts (a start resets the
  // state; the state sent on is the last document's); the tree and allgather scans reset their
  // summaries at a start (Algebra). Log-linear summaries hold the slice's positions, which a document
  // start would have to move: there only the ordered chain.
  TORCH_CHECK(!opt.document_starts.defined() || mode == ScanMode::ordered || mixer.summary_resets_at_documents(),
              what, ": packed documents (document starts) in ", mixer.name(), " need the ordered scan (its "
              "summaries hold the slice's positions, which do not reset at a document start)");
  TORCH_CHECK(head_groups >= 0 && head_groups <= kMaxHeadGroups, what,
              ": head_groups must be in 0..", kMaxHeadGroups, " (0 = the default), got ",
              head_groups);
  State init = r == 0 ? initial_state : State{};
  for (auto& t : init) TORCH_CHECK(t.defined(), what, ": initial_state has an undefined entry");
  const Agreement agreed = layout_agreed ? local_layout(mixer, in, init, opt, r)
                                         : agree_layout(mixer, sp, in, init, opt, head_groups, what);
  const int64_t T = agreed.T;
  const bool wants_grad = agreed.wants_grad;
  MixerOptions lopt = opt;
  lopt.offset = opt.offset + r * T;

  std::vector<Tensor> xs;
  for (const auto& n : kInputNames)
    if (in.get(n).defined()) xs.push_back(in.get(n));

  // States are carried and sent in fp32 at least: a kernel form reads q, k, v in bf16 but keeps its
  // states in fp32 (MixerLayer::forward under autocast).
  State zero = mixer.zero_state(in, lopt);
  for (auto& t : zero)
    if (t.defined() && at::isReducedFloatingType(t.scalar_type())) t = t.to(at::kFloat);

  // Head groups. From here on every check depends only on the agreed layout and head_groups, so it
  // fails alike on every rank.
  const int64_t H = in.num_heads();
  TORCH_CHECK(H > 0, what, ": no input has a head dimension (dim 2 of [B, T, H, ...])");
  TORCH_CHECK(head_groups == 0 || H % head_groups == 0, what, ": head_groups=", head_groups,
              " must divide the number of heads H=", H);
  int G = head_groups == 0 ? default_head_groups(H) : head_groups;
  if (mode != ScanMode::ordered) G = 1;  // only the ordered chain is pipelined
  const int64_t n_heads = H / G;
  if (G > 1) {
    // Every state entry must hold the heads at dim 1, whole: the zero state of the group's heads
    // is the zero state of all heads narrowed on dim 1.
    State part = mixer.zero_state(heads_of(in, 0, n_heads, H), lopt);
    auto names = mixer.state_names();
    TORCH_CHECK(part.size() == zero.size(), what, ": head_groups=", G, ": the family's state has ",
                zero.size(), " entries for all heads but ", part.size(), " for a group of heads");
    for (size_t i = 0; i < zero.size(); ++i) {
      auto expect = zero[i].sizes().vec();
      bool ok = zero[i].dim() >= 2 && zero[i].size(1) == H;
      if (ok) expect[1] = n_heads;
      ok = ok && part[i].sizes().vec() == expect;
      TORCH_CHECK(ok, what, ": head_groups=", G, " needs every state entry to hold the heads at ",
                  "dim 1, but entry ", i, (i < names.size() ? " ('" + names[i] + "')" : ""),
                  " has shape ", zero[i].sizes(), " for H=", H, " heads and ", part[i].sizes(),
                  " for ", n_heads, "; use head_groups=1 for this family");
    }
  }

  auto c = std::make_shared<ScanContext>();
  c->mixer = &mixer;
  c->algebra = Algebra{&mixer, opt.document_starts.defined() && mode != ScanMode::ordered};
  c->sp = &sp;
  c->mode = mode;
  c->opt = lopt;
  c->what = what;
  c->r = r;
  c->P = P;
  c->heads_per_group = n_heads;
  c->groups.resize(G);
  for (auto& x : xs) c->input_wants_grad.push_back(x.requires_grad());
  for (const auto& n : kInputNames)
    if (in.get(n).defined()) {
      const int64_t d = MixerInputs::head_dim(n);
      c->input_head_dim.push_back(H > 1 && in.get(n).size(d) == 1 ? -1 : d);
    }

  MixerInputs det;
  for (const auto& n : kInputNames)
    if (in.get(n).defined()) det.get(n) = in.get(n).detach();
  State init_det = init.empty() ? zero : detached(init);

  ForwardRun f{mixer, sp, in, lopt, what, r, P, wants_grad, G, n_heads, zero, init, init_det, det, c};
  std::vector<MixerOutput> outs;
  if (mode == ScanMode::ordered) outs = ordered_forward(f);
  else outs.push_back(summary_scan_forward(f, mode));

  // This rank's outputs: the groups' heads side by side.
  MixerOutput out;
  if (G == 1) {
    out = outs[0];
  } else {
    std::vector<Tensor> os;
    std::vector<State> finals;
    for (auto& o : outs) {
      os.push_back(o.o);
      finals.push_back(o.final_state);
    }
    at::NoGradGuard no_grad;  // the node below carries the gradient
    out.o = at::cat(os, 2);
    out.final_state = cat_entries(finals, 1);
  }
  if (!wants_grad) return out;

  // Attach the node: outputs are detached aliases of the local graphs' outputs.
  c->n_init = init.size();
  variable_list node_inputs = xs;
  node_inputs.insert(node_inputs.end(), init.begin(), init.end());
  auto node = std::shared_ptr<ScanBackward>(new ScanBackward(c), torch::autograd::deleteNode);
  node->set_next_edges(torch::autograd::collect_next_edges(node_inputs));
  MixerOutput res;
  res.o = out.o.detach();
  torch::autograd::set_history(res.o, node);
  for (auto& t : out.final_state) {
    res.final_state.push_back(t.detach());
    torch::autograd::set_history(res.final_state.back(), node);
  }
  return res;
}

}  // namespace carry::parallel
