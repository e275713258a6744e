// The mixer contract (README.md, Design §2): every token-mixer family implements, per head, on one slice of
// T tokens, three forms side by side -- `naive` (the definition: token recurrence or materialized
// masked T×T mixing), `chunkwise` (ATen ops, an explicit initial state, autograd for free) and, on
// GPU, `kernel` (fused CUDA kernels with a hand-written backward, in the family's folder) -- plus the
// state-summary algebra: the effect of a slice on the recurrent state is an affine map
// S_out = A·S_in + B (`summarize`, the states-only pass: no outputs), maps compose associatively
// (`compose`), and a map acts on a state (`apply`). Every caller runs a family through one dispatch,
// `Mixer::forward`, which takes the kernel form on CUDA tensors when the family has one and the
// chunkwise form otherwise (MixerOptions::form forces one). `parallel/` scans whatever implements
// this; it never sees a family.
//
// The per-call path checks shapes only: value checks (finite inputs, gate and beta ranges) read the
// tensors back to the host, so they run only when MixerOptions::check_values is set (the command line,
// the tests, and training with CARRY_CHECK_VALUES=1).
//
// Conventions (flash-linear-attention's): inputs are [B, T, H, D]; gates are log values (g: [B,T,H],
// gk: [B,T,H,dk]); beta: [B,T,H]; level weights l: [B,T,H,L]; outputs o: [B,T,H,dv]; states are
// [B, H, dk, dv]-like tensors in fp32 (fp64 in fp64 runs). A State is a tuple of tensors whose meaning
// the family names in `state_names()`; an empty State means "zero initial state".
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace carry {

using at::Tensor;

// Inputs by flash-linear-attention's names; a family uses the subset listed in `input_names()`.
struct MixerInputs {
  Tensor q, k, v;  // [B,T,H,dk], [B,T,H,dk], [B,T,H,dv]
  Tensor g;        // scalar log decay per token and head        [B,T,H]
  Tensor gk;       // log decay per key dimension (GLA, S6 dt·A) [B,T,H,dk]
  Tensor beta;     // delta-rule write strength                  [B,T,H]
  Tensor l;        // log-linear per-level weights λ             [B,T,H,L]
  Tensor a, b;     // the low-rank part of a diagonal-plus-rank-one transition (RWKV-7) [B,T,H,dk]
  // A per-head constant, no T dimension: gk = g ⊙ decay_rate per head and key dimension (Mamba-1's A,
  // with g = Δ) [H,dk]. A parameter-like tensor, the same on every rank of a sequence: never cut along
  // T or the batch, never given a halo; its gradient over a sequence split between ranks is the sum of
  // the ranks'.
  Tensor decay_rate;
  // Gated DeltaProduct reads n_h keys, values and betas a token, interleaved along T: k, v, beta then
  // have T·n_h rows (token t's sub-step j at row t·n_h + j), q and g T rows. Mamba-1's q and k have one
  // head, shared by all of v's (Mixer::broadcasts_heads).

  // Every input name, in this order: q, k, v, g, gk, beta, l, a, b, decay_rate.
  static const std::vector<std::string>& names();
  // The gates (g, gk, beta, decay_rate): they may stay fp32 beside reduced-precision q, k, v.
  static bool is_gate(const std::string& name) {
    return name == "g" || name == "gk" || name == "beta" || name == "decay_rate";
  }
  // Whether the input has a token dimension [B, T, ...] (all but decay_rate).
  static bool per_token(const std::string& name) { return name != "decay_rate"; }
  // The dimension of the input's heads: 2 for the per-token inputs [B,T,H,...], 0 for decay_rate [H,dk].
  static int64_t head_dim(const std::string& name) { return per_token(name) ? 2 : 0; }
  const Tensor& get(const std::string& name) const;
  Tensor& get(const std::string& name);
  // The slice of tokens [start, start+len) of every defined per-token tensor: rows [start, start+len)
  // along T, or [n·start, n·(start+len)) of a tensor with n rows a token (n times q's rows: Gated
  // DeltaProduct's sub-steps). decay_rate passes through unchanged.
  MixerInputs slice(int64_t start, int64_t len) const;
  // Sequences [start, start+len) of every defined per-token tensor (dim 0); decay_rate unchanged.
  MixerInputs sequences(int64_t start, int64_t len) const;
  // The number of heads: the largest head dimension among the defined inputs (a head-broadcast input
  // has one).
  int64_t num_heads() const;
  // Heads [start, start+len) of every defined input along its head_dim, of `heads` in all; an input
  // with one head while heads > 1 (shared by all heads: Mamba-1's q and k) stays whole.
  MixerInputs head_range(int64_t start, int64_t len, int64_t heads) const;
};

// The forms of a family. `automatic`: the kernel form on CUDA tensors when the family has one (and
// the fused-ops switch does not ask for the ATen forms, layers/core/fused_switch.h), else the chunkwise
// form.
enum class Form { automatic, naive, chunkwise, kernel };
const char* form_name(Form form);
// Training's debug option: CARRY_CHECK_VALUES=1 in the environment (read once) checks every mixer
// call's values, at the cost of a device-to-host read per call.
bool check_values_requested();
Form parse_form(const std::string& name);  // "automatic" | "naive" | "chunkwise" | "kernel"

// Hyperparameters. A value <= 0 for `scale` means the default 1/sqrt(dk).
using State = std::vector<Tensor>;

struct MixerOptions {
  double scale = 0;
  bool normalize = false;    // linear attention / HLA: divide by the normalizer
  double eps = 1e-6;         // normalizer epsilon
  int64_t window = 0;        // sliding-window attention: keys t-window < s <= t; 0 = full causal
  // Softmax attention's sparse patterns beside a window (layers/softmax_attn/softmax_attn.h): the first
  // `global_tokens` tokens of each document (Longformer), and the document positions ≡ stride−1 mod stride
  // (the Sparse Transformer's summary columns). 0 = none.
  int64_t global_tokens = 0;
  int64_t stride = 0;
  int64_t chunk_size = 64;   // chunkwise form
  int64_t offset = 0;        // absolute position of the slice's first token (log-linear levels)
  int64_t num_householder = 2;  // Gated DeltaProduct: delta-rule (Householder) sub-steps a token, n_h
  Form form = Form::automatic;  // which form Mixer::forward runs
  bool check_values = false;    // also check values (finite, gate ranges): a device-to-host read
  // The kernel forms carry the state chunk after chunk, with no in-GPU segment scan: every chunk then
  // runs the same operations wherever the sequence is cut, so a sequence split over ranks by the
  // ordered scan gives the bits of the whole. The ordered scan mode sets it, on one rank too.
  bool serial_states = false;
  // Packed documents (FLA's cu_seqlens), honoured by Mixer::forward: a document starts at every
  // position p where document_starts[b, p] is true ([B, T] bool, on the CPU); the state is reset to
  // zero before token p and no token reaches another document. Undefined: one document.
  Tensor document_starts;
  // Per sequence, the position of this slice's first token within its document (where log-linear
  // levels count from); empty: `offset` for every sequence.
  std::vector<int64_t> document_offsets;
  // Called by Mixer::forward exactly once with the final state, as soon as it exists: the kernel forms
  // call it after their state walk is enqueued and before their output kernel (what it enqueues, e.g.
  // the ordered scan's send to the next rank, then runs beside the output); every other form, and any
  // run with document starts, when the form returns. The tensors are the returned final_state's.
  std::function<void(const State&)> on_final_state;
  // Called at most once in the backward of this forward with the gradient of the initial state, as
  // soon as it exists: the kernel forms of one-state families call it right after their reverse state
  // walk is enqueued, before their chunk-gradient kernels (what it enqueues, e.g. the ordered scan's
  // send to the previous rank, then runs beside them). Other forms, and runs with document starts, do
  // not call it: the caller keeps a flag and otherwise uses the gradient autograd returns (the same
  // values).
  std::function<void(const State&)> on_initial_state_grad;

  double scale_for(int64_t dk) const;
};

// The affine map of a slice: S_out = transport(S_in) + state. `state` is the slice's final state from
// the zero initial state; `transport` holds A in the family's cheapest exact form (scalar, diagonal,
// dense, structured), with entries the family documents. Both are family-defined tuples.
struct Summary {
  std::vector<Tensor> transport;
  State state;
};

struct MixerOutput {
  Tensor o;           // [B,T,H,dv]
  State final_state;  // same tuple layout as the initial state
};

class Mixer {
 public:
  virtual ~Mixer() = default;
  virtual std::string name() const = 0;
  // Inputs the family reads, in MixerInputs names, e.g. {"q","k","v","gk"}.
  virtual std::vector<std::string> input_names() const = 0;
  // Inputs the family reads when given and does without otherwise (e.g. HLA's gate g: none = no decay).
  virtual std::vector<std::string> optional_input_names() const { return {}; }
  // Rows along T that input `name` has a token: 1, but for Gated DeltaProduct's sub-step inputs (k, v,
  // beta: opt.num_householder).
  virtual int64_t rows_per_token(const std::string& /*name*/, const MixerOptions& /*opt*/) const { return 1; }
  // Whether input `name` has one head shared by every head of v (Mamba-1's q = C and k = B: [B,T,1,dk]).
  virtual bool broadcasts_heads(const std::string& /*name*/) const { return false; }
  // Names of the State tuple's entries, e.g. {"S"} or {"S","C","m","G","h"}; empty if stateless.
  virtual std::vector<std::string> state_names() const = 0;
  // The zero initial state for these inputs (shapes and dtype follow the inputs).
  virtual State zero_state(const MixerInputs& in, const MixerOptions& opt) const = 0;

  // Validates shapes, dtypes, gates and options; throws c10::Error with a message that names the
  // tensor, what was expected and what was found. Every form calls it first.
  virtual void check(const MixerInputs& in, const MixerOptions& opt, bool chunked) const;

  virtual MixerOutput naive(const MixerInputs& in, const State& initial_state,
                            const MixerOptions& opt) const = 0;
  virtual MixerOutput chunkwise(const MixerInputs& in, const State& initial_state,
                                const MixerOptions& opt) const = 0;
  // The kernel form (CUDA tensors only). Families without one keep the defaults; a family with one
  // says which inputs and options its kernels take (shapes, dtypes, chunk size): automatic dispatch
  // runs the chunkwise form for the others.
  virtual bool has_kernel() const { return false; }
  virtual bool kernel_supports(const MixerInputs& in, const MixerOptions& opt) const { return has_kernel(); }
  virtual MixerOutput kernel(const MixerInputs& in, const State& initial_state,
                             const MixerOptions& opt) const;

  // The one dispatch every caller uses: the form opt.form names, `automatic` resolved by
  // resolve_form. Differentiable in every input and the initial state. With opt.document_starts,
  // every family runs document by document (forward_documents below).
  MixerOutput forward(const MixerInputs& in, const State& initial_state, const MixerOptions& opt) const;
  Form resolve_form(const MixerInputs& in, const MixerOptions& opt) const;

  // State-summary algebra. Families without a recurrent state (softmax attention) return false.
  virtual bool has_summary() const { return true; }
  // Whether a summary can restart at a packed document's start (what the tree and allgather scans do
  // with document starts). False where a summary holds the slice's absolute positions (log-linear).
  virtual bool summary_resets_at_documents() const { return true; }
  virtual Summary summarize(const MixerInputs& in, const MixerOptions& opt) const;
  // first then second: (A2∘A1, A2·B1 + B2).
  virtual Summary compose(const Summary& first, const Summary& second) const;
  virtual State apply(const Summary& summary, const State& state) const;

  // The one-pass tree and allgather scans (parallel/state_scan.h), for families whose output is
  // linear in the incoming state with a cheap exact form of that dependence: `state_output` is what
  // S_in adds to the output, forward(in, S_in).o = forward(in, zeros).o + state_output(in, S_in), and
  // `transport` is the summary's transport computed from the inputs alone, so that the final state is
  // apply({transport, final state from zeros}, S_in). Both differentiable in the inputs and S_in.
  // has_state_output false (the default): the scan summarizes the slice, then runs it again from S_in.
  virtual bool has_state_output(const MixerInputs& in, const MixerOptions& opt) const { return false; }
  // The summary of a slice whose final state is `s`, for the two ranks of the tree and allgather scans
  // whose transport no rank reads: rank 0 (always the first of a composition, whose transport drops
  // out of every composed state; its summary is `s` from its own run from the initial state) and the
  // last rank (read by no rank). Those two then skip the summarizing passes (and the one-pass share):
  // rank 0 runs once from the initial state, the last rank once from its S_in. A family gives its zero
  // transport where it has one (then the summary is the constant map to `s`), else any of the right
  // shapes (linear attention's identity). nullopt (the default): every rank summarizes.
  virtual std::optional<Summary> fixed_summary(const MixerInputs& in, const State& s) const { return std::nullopt; }
  virtual Tensor state_output(const MixerInputs& in, const State& s_in, const MixerOptions& opt) const;
  virtual std::vector<Tensor> transport(const MixerInputs& in, const MixerOptions& opt) const;
  // Both of the above from one look at the inputs: the transport, and S_in ↦ S_in's share of the
  // output. The default calls transport() and state_output(); a family whose two come from one pass
  // (the delta rule's run from the identity) overrides it, so the one-pass scan runs that pass once.
  struct StateReadout {
    std::vector<Tensor> transport;
    std::function<Tensor(const State&)> share;
  };
  virtual StateReadout state_readout(const MixerInputs& in, const MixerOptions& opt) const;
};

// scale·(q_t ⊙ e^{c_t})·S per batch and head, the decay class's state_output: q [B,T,H,dk]; g the log
// decay of each token, [B,T,H] (a scalar decay) or [B,T,H,dk] (a decay per key dimension), undefined
// for none, and c_t = Σ_{u ≤ t} g_u from the slice's start; S [B,H,dk,dv]. Returns [B,T,H,dv] in the
// wider of q's and S's dtypes.
Tensor decayed_state_readout(const Tensor& q, const Tensor& g, const Tensor& S, double scale);

// x·S per batch and head: x [B,T,H,dk] (rows read against an incoming state), S [B,H,dk,dv] → [B,T,H,dv]
// in the wider of the two dtypes, differentiable in both. The one-pass scans' share of S_in. Where the
// kernels run in bf16 (x bf16 on CUDA, or `low`), the operands are rounded to bf16 and multiplied on
// tensor cores, accumulated and returned in fp32, as the kernels read their own states (an fp32 product
// ran on the SIMT cores: 28.6 ms a step of a 125M model's sp = 4 tree on an H200); S's gradient sums T
// in pieces of at most 4096 tokens, added after.
Tensor state_product(const Tensor& x, const Tensor& S, bool low = false);

// Packed documents for every family, generically: per sequence, each piece between document starts
// runs on its own, from the zero state when it starts a document (the first piece, when the slice does
// not start with a document, from the initial state); a piece's whole chunks run in the form that
// opt.form / the dispatch picks, its last partial chunk in the naive form from the state the chunks
// left (softmax attention, which has no recurrent state, runs a piece with a partial chunk in the naive
// form whole, and a piece of whole chunks at any offset in the dispatched form; its initial state, the
// keys before the slice that its sparse patterns read, goes to the first piece only, when that piece
// continues a document; a stateful piece at an offset that is not a multiple of the chunk size, which
// log-linear's chunkwise form cannot start at, runs in the naive form whole). The final state is the
// last piece's. Exact: every form is.
MixerOutput forward_documents(const Mixer& mixer, const MixerInputs& in, const State& initial_state,
                              const MixerOptions& opt);

// Registry. Families register themselves at static-initialization time with CARRY_REGISTER_MIXER
// (layers is an OBJECT library, so every registration is linked).
const Mixer& get_mixer(const std::string& name);
std::vector<std::string> mixer_names();
bool register_mixer(std::unique_ptr<Mixer> mixer);

#define CARRY_CONCAT_INNER(a, b) a##b
#define CARRY_CONCAT(a, b) CARRY_CONCAT_INNER(a, b)
#define CARRY_REGISTER_MIXER(Type)                      \
  static const bool CARRY_CONCAT(carry_registered_, __LINE__) = \
      ::carry::register_mixer(std::make_unique<Type>())

}  // namespace carry
