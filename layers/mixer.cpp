// The mixer registry, the input-bundle helpers and the default input validation of the contract.
#include "layers/mixer.h"
#include "layers/core/knobs.h"

#include "layers/core/fused_switch.h"
#include "layers/layout.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <numeric>

namespace carry {

namespace {
std::map<std::string, std::unique_ptr<Mixer>>& registry() {
  static std::map<std::string, std::unique_ptr<Mixer>> r;
  return r;
}
}  // namespace

bool register_mixer(std::unique_ptr<Mixer> mixer) {
  auto name = mixer->name();
  TORCH_INTERNAL_ASSERT(!registry().count(name), "mixer registered twice: ", name);
  registry()[name] = std::move(mixer);
  return true;
}

const Mixer& get_mixer(const std::string& name) {
  auto it = registry().find(name);
  if (it == registry().end()) {
    std::string known;
    for (auto& [n, m] : registry()) known += (known.empty() ? "" : ", ") + n;
    TORCH_CHECK(false, "unknown mixer family '", name, "'; known families: ", known);
  }
  return *it->second;
}

std::vector<std::string> mixer_names() {
  std::vector<std::string> names;
  for (auto& [n, m] : registry()) names.push_back(n);
  return names;
}

const std::vector<std::string>& MixerInputs::names() {
  static const std::vector<std::string> n{"q", "k", "v", "g", "gk", "beta", "l", "a", "b", "decay_rate"};
  return n;
}

const Tensor& MixerInputs::get(const std::string& name) const {
  return const_cast<MixerInputs*>(this)->get(name);
}

Tensor& MixerInputs::get(const std::string& name) {
  if (name == "q") return q;
  if (name == "k") return k;
  if (name == "v") return v;
  if (name == "g") return g;
  if (name == "gk") return gk;
  if (name == "beta") return beta;
  if (name == "l") return l;
  if (name == "a") return a;
  if (name == "b") return b;
  if (name == "decay_rate") return decay_rate;
  TORCH_CHECK(false, "unknown mixer input '", name, "'; inputs are q, k, v, g, gk, beta, l, a, b, decay_rate");
}

MixerInputs MixerInputs::slice(int64_t start, int64_t len) const {
  MixerInputs out;
  // Rows a token: q's T is the tokens; a tensor of n times as many rows has n a token.
  const int64_t tokens = q.defined() && q.dim() >= 2 ? q.size(1) : 0;
  for (const auto& n : MixerInputs::names()) {
    const Tensor& t = get(n);
    if (!t.defined()) continue;
    if (!per_token(n)) {
      out.get(n) = t;
      continue;
    }
    const int64_t rows = t.dim() >= 2 && tokens > 0 && t.size(1) > tokens && t.size(1) % tokens == 0
                             ? t.size(1) / tokens
                             : 1;
    out.get(n) = t.narrow(1, rows * start, rows * len);
  }
  return out;
}

MixerInputs MixerInputs::sequences(int64_t start, int64_t len) const {
  MixerInputs out;
  for (const auto& n : MixerInputs::names())
    if (get(n).defined()) out.get(n) = per_token(n) ? get(n).narrow(0, start, len) : get(n);
  return out;
}

int64_t MixerInputs::num_heads() const {
  int64_t H = 0;
  for (const auto& n : MixerInputs::names()) {
    const Tensor& t = get(n);
    if (t.defined() && t.dim() > head_dim(n)) H = std::max(H, t.size(head_dim(n)));
  }
  return H;
}

MixerInputs MixerInputs::head_range(int64_t start, int64_t len, int64_t heads) const {
  MixerInputs out;
  for (const auto& n : MixerInputs::names()) {
    const Tensor& t = get(n);
    if (!t.defined()) continue;
    const int64_t d = head_dim(n);
    out.get(n) = heads > 1 && t.size(d) == 1 ? t : t.narrow(d, start, len);
  }
  return out;
}

double MixerOptions::scale_for(int64_t dk) const {
  return scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(dk));
}

void Mixer::check(const MixerInputs& in, const MixerOptions& opt, bool chunked) const {
  auto names = input_names();
  for (auto& n : names)
    TORCH_CHECK(in.get(n).defined(), name(), ": input '", n, "' is required (the family reads ",
                c10::Join(", ", names), ")");
  const Tensor& q = in.get(names[0]);
  TORCH_CHECK(q.dim() == 4, name(), ": '", names[0], "' must be [B, T, H, D], got shape ",
              shape_str(q.sizes()));
  int64_t B = q.size(0), T = q.size(1), H = q.size(2), dk = q.size(3);
  // Where the first input has one head shared by all (Mamba-1's q), H is the first per-head input's.
  std::string heads_from = names[0];
  if (broadcasts_heads(names[0]))
    for (auto& n : names)
      if (MixerInputs::per_token(n) && !broadcasts_heads(n) && in.get(n).dim() >= 3) {
        heads_from = n;
        H = in.get(n).size(2);
        break;
      }
  const std::string heads_note =
      heads_from == names[0] ? "" : " (H = " + std::to_string(H) + ", the heads of '" + heads_from + "')";
  for (auto& n : optional_input_names())
    if (in.get(n).defined()) names.push_back(n);
  const bool rate_gated = in.decay_rate.defined() &&
                          std::find(names.begin(), names.end(), "decay_rate") != names.end();
  for (auto& n : names) {
    const Tensor& t = in.get(n);
    const std::string label = name() + ": '" + n + "'" + (n == heads_from ? "" : heads_note);
    const int64_t Hn = broadcasts_heads(n) ? 1 : H;
    if (n == "q" || n == "k" || n == "gk" || n == "a" || n == "b") check_tensor(t, label, {B, T, Hn, dk});
    else if (n == "v") check_tensor(t, label, {B, T, Hn, -1});
    else if (n == "g" || n == "beta") check_tensor(t, label, {B, T, Hn});
    else if (n == "l") check_tensor(t, label, {B, T, Hn, -1});
    else if (n == "decay_rate")
      check_tensor(t, name() + ": 'decay_rate' (a rate for each head of '" + heads_from + "' and key dimension)",
                   {H, dk});
    // Gates may stay fp32 next to reduced-precision q, k, v (what the kernel forms read under autocast).
    const bool fp32_gate = MixerInputs::is_gate(n) && t.scalar_type() == at::kFloat;
    TORCH_CHECK(t.scalar_type() == q.scalar_type() || fp32_gate, name(), ": '", n, "' has dtype ",
                t.scalar_type(), " but '", names[0], "' has ", q.scalar_type(),
                "; all inputs must share one dtype (the gates g, gk, beta and decay_rate may be fp32)");
    if (!opt.check_values) continue;
    if (n == "g" && rate_gated) {
      // g scales decay_rate (gk = g ⊙ decay_rate): a step size, not a log decay.
      check_finite(t, name() + ": 'g'");
      TORCH_CHECK((t >= 0).all().item<bool>(), name(), ": 'g' is the step that scales decay_rate "
                  "(gk = g ⊙ decay_rate) and must be >= 0 everywhere; min is ", t.min().item<double>());
    } else if (n == "g" || n == "gk" || n == "decay_rate") {
      check_log_gate(t, name() + ": '" + n + "'");
    } else {
      check_finite(t, name() + ": '" + n + "'");
    }
  }
  if (chunked) {
    TORCH_CHECK(opt.chunk_size > 0, name(), ": chunk_size must be positive, got ", opt.chunk_size);
    TORCH_CHECK(T % opt.chunk_size == 0, name(), ": sequence length T=", T,
                " must be a multiple of chunk_size=", opt.chunk_size, " in the chunkwise form");
  }
}

const char* form_name(Form form) {
  switch (form) {
    case Form::automatic: return "automatic";
    case Form::naive: return "naive";
    case Form::chunkwise: return "chunkwise";
    case Form::kernel: return "kernel";
  }
  return "?";
}

bool check_values_requested() {
  static const bool on = [] {
    const char* v = knob_value("CARRY_CHECK_VALUES");
    return v && std::string(v) != "0" && std::string(v) != "";
  }();
  return on;
}

Form parse_form(const std::string& name) {
  for (Form f : {Form::automatic, Form::naive, Form::chunkwise, Form::kernel})
    if (name == form_name(f)) return f;
  TORCH_CHECK(false, "unknown mixer form '", name, "'; forms are automatic, naive, chunkwise, kernel");
}

Form Mixer::resolve_form(const MixerInputs& in, const MixerOptions& opt) const {
  if (opt.form != Form::automatic) return opt.form;
  return has_kernel() && in.q.defined() && in.q.is_cuda() && fused_ops_enabled() && kernel_supports(in, opt)
             ? Form::kernel
             : Form::chunkwise;
}

MixerOutput Mixer::forward(const MixerInputs& in, const State& initial_state,
                           const MixerOptions& opt) const {
  auto run = [&](const MixerOptions& o) {
    if (o.document_starts.defined()) return forward_documents(*this, in, initial_state, o);
    switch (resolve_form(in, o)) {
      case Form::naive: return naive(in, initial_state, o);
      case Form::kernel: return kernel(in, initial_state, o);
      default: return chunkwise(in, initial_state, o);
    }
  };
  if (opt.document_starts.defined()) {
    // Documents run several forward calls, none of whose final state or initial-state gradient is the
    // slice's alone: the final state goes to the hook at the end, the gradient the caller's way.
    MixerOptions inner = opt;
    inner.on_final_state = nullptr;
    inner.on_initial_state_grad = nullptr;
    MixerOutput out = run(inner);
    if (opt.on_final_state) opt.on_final_state(out.final_state);
    return out;
  }
  if (!opt.on_final_state) return run(opt);
  // Exactly once: the form may call it early (the kernel forms, after their state walk), else at the end.
  bool called = false;
  MixerOptions inner = opt;
  inner.on_final_state = [&](const State& s) {
    if (called) return;
    called = true;
    opt.on_final_state(s);
  };
  MixerOutput out = run(inner);
  if (!called) opt.on_final_state(out.final_state);
  return out;
}

MixerOutput Mixer::kernel(const MixerInputs& in, const State&, const MixerOptions&) const {
  TORCH_CHECK(false, name(), " has no kernel form in this build", in.q.defined() && !in.q.is_cuda()
              ? " (and the kernel form runs on CUDA tensors only)" : "", "; use the chunkwise form");
}

Summary Mixer::summarize(const MixerInputs&, const MixerOptions&) const {
  TORCH_CHECK(false, name(), " has no recurrent state, so no state summary");
}
Summary Mixer::compose(const Summary&, const Summary&) const {
  TORCH_CHECK(false, name(), " has no recurrent state, so no state summary");
}
State Mixer::apply(const Summary&, const State&) const {
  TORCH_CHECK(false, name(), " has no recurrent state, so no state summary");
}
Tensor Mixer::state_output(const MixerInputs&, const State&, const MixerOptions&) const {
  TORCH_CHECK(false, name(), " has no closed form of the incoming state's share of the output (has_state_output)");
}
std::vector<Tensor> Mixer::transport(const MixerInputs&, const MixerOptions&) const {
  TORCH_CHECK(false, name(), " has no transport computed from the inputs alone (has_state_output)");
}
Mixer::StateReadout Mixer::state_readout(const MixerInputs& in, const MixerOptions& opt) const {
  return {transport(in, opt), [this, in, opt](const State& s_in) { return state_output(in, s_in, opt); }};
}

Tensor decayed_state_readout(const Tensor& q, const Tensor& g, const Tensor& S, double scale) {
  const auto dt = at::promote_types(q.scalar_type(), S.scalar_type());
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), dk = q.size(3), dv = S.size(3);
  Tensor qs = q.to(dt) * scale;
  if (g.defined()) {
    // c_t = Σ_{u ≤ t} g_u. On CUDA the sum runs along the innermost dimension: ATen's scan along an
    // outer dimension of [B, T, H, dk] walks T with a few hundred threads (11 ms at T = 32768, H = 4,
    // dk = 96 on an H200, against a pass over memory this way).
    Tensor c = g.is_cuda() ? g.movedim(1, -1).contiguous().cumsum(-1).movedim(-1, 1) : g.cumsum(1);
    qs = qs * (c.dim() == 3 ? c.unsqueeze(-1) : c).to(dt).exp();
  }
  // Where the kernels run in bf16, the product does too (state_product: fp32 accumulation and result).
  if (q.is_cuda() && q.scalar_type() == at::kBFloat16) return state_product(qs, S, /*low=*/true);
  // The product in pieces of L tokens, S broadcast over them: S's gradient, Σ_t qs_tᵀ·dO_t, is then
  // B·H·(T/L) products of L terms summed after, instead of B·H products of T terms each (one GEMM a
  // head with a 96×192 result and K = 32768 kept an H200 busy 1.2 ms).
  const int64_t L = std::gcd(T, int64_t{256}), n = T / L;
  Tensor x = qs.reshape({B, n, L, H, dk}).permute({0, 3, 1, 2, 4});              // [B,H,n,L,dk]
  Tensor y = at::matmul(x, S.to(dt).unsqueeze(2));                                 // [B,H,n,L,dv]
  return y.permute({0, 2, 3, 1, 4}).reshape({B, T, H, dv});
}

namespace {

// state_product's bf16 form: y = x·S with bf16 operands, fp32 accumulation and result.
struct Bf16StateProduct : public torch::autograd::Function<Bf16StateProduct> {
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& S) {
    const int64_t B = x.size(0), T = x.size(1), H = x.size(2), dk = x.size(3), dv = S.size(3);
    Tensor xb = x.to(at::kBFloat16).permute({0, 2, 1, 3}).contiguous().view({B * H, T, dk});
    Tensor sb = S.to(at::kBFloat16).contiguous().view({B * H, dk, dv});
    ctx->save_for_backward({xb, sb});
    ctx->saved_data["x_dtype"] = static_cast<int64_t>(x.scalar_type());
    ctx->saved_data["s_dtype"] = static_cast<int64_t>(S.scalar_type());
    ctx->saved_data["B"] = B;
    return at::bmm(xb, sb, at::kFloat).view({B, H, T, dv}).permute({0, 2, 1, 3}).contiguous();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor &xb = saved[0], &sb = saved[1];
    const int64_t B = ctx->saved_data["B"].toInt(), BH = xb.size(0), T = xb.size(1), dk = xb.size(2),
                  dv = sb.size(2), H = BH / B;
    Tensor gb = grads[0].to(at::kBFloat16).permute({0, 2, 1, 3}).contiguous().view({BH, T, dv});
    Tensor dx = at::bmm(gb, sb.transpose(1, 2), at::kFloat).view({B, H, T, dk}).permute({0, 2, 1, 3});
    const int64_t L = std::gcd(T, int64_t{4096}), n = T / L;
    Tensor dS = at::bmm(xb.view({BH * n, L, dk}).transpose(1, 2), gb.view({BH * n, L, dv}), at::kFloat)
                    .view({B, H, n, dk, dv})
                    .sum(2);
    return {dx.to(static_cast<at::ScalarType>(ctx->saved_data["x_dtype"].toInt())),
            dS.to(static_cast<at::ScalarType>(ctx->saved_data["s_dtype"].toInt()))};
  }
};

}  // namespace

Tensor state_product(const Tensor& x, const Tensor& S, bool low) {
  TORCH_CHECK(x.dim() == 4 && S.dim() == 4 && S.size(0) == x.size(0) && S.size(1) == x.size(2) &&
                  S.size(2) == x.size(3),
              "state_product: x [B,T,H,dk] and S [B,H,dk,dv] expected, got ", shape_str(x.sizes()), " and ",
              shape_str(S.sizes()));
  if (x.is_cuda() && (low || x.scalar_type() == at::kBFloat16) && S.scalar_type() != at::kDouble)
    return Bf16StateProduct::apply(x, S);
  const auto dt = at::promote_types(x.scalar_type(), S.scalar_type());
  return at::matmul(x.to(dt).transpose(1, 2), S.to(dt)).transpose(1, 2);  // [B,H,T,dv] → [B,T,H,dv]
}

// ---- packed documents ----

MixerOutput forward_documents(const Mixer& mixer, const MixerInputs& in, const State& initial_state,
                              const MixerOptions& opt) {
  const Tensor& q = in.q.defined() ? in.q : in.get(mixer.input_names().at(0));
  TORCH_CHECK(q.defined() && q.dim() >= 2, mixer.name(), ": packed documents need inputs [B, T, ...]");
  const int64_t B = q.size(0), T = q.size(1);
  const Tensor& starts = opt.document_starts;
  TORCH_CHECK(starts.dim() == 2 && starts.size(0) == B && starts.size(1) == T && starts.scalar_type() == at::kBool &&
                  starts.device().is_cpu(),
              mixer.name(), ": document_starts must be a CPU bool tensor [B, T] = [", B, ", ", T, "], got ",
              starts.scalar_type(), " ", shape_str(starts.sizes()), " on ", starts.device());
  TORCH_CHECK(opt.document_offsets.empty() || static_cast<int64_t>(opt.document_offsets.size()) == B, mixer.name(),
              ": document_offsets must hold one offset a sequence (", B, "), got ", opt.document_offsets.size());
  const auto flags = starts.contiguous();
  const bool* f = flags.data_ptr<bool>();
  const bool stateful = mixer.has_summary();
  MixerOptions base = opt;
  base.document_starts = Tensor();
  base.document_offsets.clear();
  const int64_t C = std::max<int64_t>(1, opt.chunk_size);
  State zero = stateful ? mixer.zero_state(in, base) : State{};
  auto batch = [](const State& s, int64_t b) {
    State out;
    for (auto& t : s) out.push_back(t.narrow(0, b, 1));
    return out;
  };
  std::vector<Tensor> outputs;
  std::vector<State> finals;
  for (int64_t b = 0; b < B; ++b) {
    const MixerInputs in_b = in.sequences(b, 1);
    std::vector<int64_t> cuts{0};
    for (int64_t p = 1; p < T; ++p)
      if (f[b * T + p]) cuts.push_back(p);
    cuts.push_back(T);
    State s = f[b * T] || initial_state.empty() ? (stateful ? batch(zero, b) : State{}) : batch(initial_state, b);
    std::vector<Tensor> pieces;
    for (size_t k = 0; k + 1 < cuts.size(); ++k) {
      const int64_t a = cuts[k], len = cuts[k + 1] - a;
      if (k > 0) s = stateful ? batch(zero, b) : State{};  // a document starts here
      MixerOptions o = base;
      const bool continues = k == 0 && !f[b * T];
      o.offset = continues ? (opt.document_offsets.empty() ? opt.offset : opt.document_offsets[b]) : 0;
      const MixerInputs piece = in_b.slice(a, len);
      const int64_t whole = o.offset % C == 0 ? len / C * C : 0;
      if (!stateful) {
        MixerOutput r = len % C == 0 ? mixer.forward(piece, s, o) : mixer.naive(piece, s, o);
        pieces.push_back(r.o);
        continue;
      }
      if (whole > 0) {
        MixerOutput r = mixer.forward(piece.slice(0, whole), s, o);
        pieces.push_back(r.o);
        s = r.final_state;
      }
      if (whole < len) {
        MixerOptions tail = o;
        tail.offset = o.offset + whole;
        MixerOutput r = mixer.naive(piece.slice(whole, len - whole), s, tail);
        pieces.push_back(r.o);
        s = r.final_state;
      }
    }
    outputs.push_back(pieces.size() == 1 ? pieces[0] : at::cat(pieces, 1));
    finals.push_back(s);
  }
  MixerOutput out;
  out.o = B == 1 ? outputs[0] : at::cat(outputs, 0);
  if (stateful)
    for (size_t i = 0; i < finals[0].size(); ++i) {
      std::vector<Tensor> parts;
      for (auto& st : finals) parts.push_back(st[i]);
      out.final_state.push_back(B == 1 ? parts[0] : at::cat(parts, 0));
    }
  return out;
}

}  // namespace carry
