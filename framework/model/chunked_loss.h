// The language-model head and its cross entropy over chunks of tokens, never holding the [N, vocab]
// logits. Chunk by chunk: the chunk's logits h·Wᵀ (in the autocast dtype under autocast: a bf16
// matmul with fp32 accumulation, as at::linear does; else in the inputs' dtype), their log-softmax in
// fp32 at least, the per-token loss ce_t = −log p_t[y_t], and in the same pass the gradients of the
// weighted sum L = Σ_t w_t·ce_t:
//   dL/dh_t = w_t·(p_t − onehot(y_t))·W,   dL/dW = Σ_t w_t·(p_t − onehot(y_t))ᵀ·h_t,
// which the forward keeps (dh [N,d] in the hidden's dtype, dW accumulated over the chunks in the
// weight's dtype, fp32 at least) and the backward only scales by the incoming gradient of L. So the
// per-token weights w_t (the loss mask) are an input of the function, and any normalisation (1/count)
// is the upstream gradient: the backward is exact for any upstream gradient of L. The per-token losses
// come out too, without a gradient (for the loss sums and for evaluation).
//
// Targets < 0 are ignored: their loss is 0 and they contribute no gradient whatever their weight.
// Chunks run in a fixed order and every reduction has a fixed order: the same inputs give the same bits.
// A tied head (W is the token embedding) needs nothing special: the function's gradient of W is added
// by autograd to the embedding lookup's.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace carry {

// Tokens per chunk when none is given (a multiple of 64, at least 64). fused_logit_bytes = 0: the ATen
// form, which holds an fp32 log-softmax and gradient beside the logits: about 64 MiB of fp32 logits a
// chunk. > 0: the fused CUDA kernel (one logits buffer, the gradient written over it) with logits of
// that many bytes: about 256 MiB of logits a chunk (4160 tokens at V = 32000 in bf16: fewer, larger
// matrix products, and the head's fp32 weight-gradient sum read and written fewer times).
int64_t default_loss_chunk_tokens(int64_t vocab_size, int64_t fused_logit_bytes = 0);

// The head weight's gradient of the loss's last chunks, left for late in the backward
// (linear_cross_entropy's defer_bytes). The forward keeps those chunks' logit gradients instead of
// multiplying them into the weight's gradient, and the loss's backward gives the weight no gradient: it
// keeps its incoming gradient here. The anchor (anchor_deferred_head_gradient), an identity node put on
// a tensor the hidden states depend on and computed before them (the model's embedding output, whose
// backward comes last), then adds those chunks in their order to the forward's sum, scales it as the
// loss's backward would have, and returns it as the weight's gradient. The same operations in the same
// order, and autograd adds the weight's contributions in the same order too (the head's first, then a
// tied embedding's), so the same bits as without deferral. Why: under the ordered sequence-parallel scan
// the ranks after the first end their forward, start their backward and send the state gradients the
// rank before them waits for that much earlier (README.md, "Two GPUs").
class DeferredHeadGradient {
 public:
  int64_t chunks() const { return static_cast<int64_t>(dlogits_.size()); }
  int64_t bytes() const;

 private:
  friend struct DeferredHeadAccess;
  bool anchored_ = false;             // an anchor will take the gradient (else linear_cross_entropy defers nothing)
  at::ScalarType weight_dtype_ = at::kFloat;
  at::Tensor sum_;                    // the forward's fp32 sum over the other chunks
  std::vector<at::Tensor> dlogits_;   // per deferred chunk [n, V], in the chunks' order
  std::vector<at::Tensor> hidden_;    // per deferred chunk [n, d], the matmul dtype
  bool fp32_accumulate_ = false;      // the chunks go into the sum as the forward's would (addmm_out)
  at::Tensor incoming_;               // the loss's backward's gradient of .loss (undefined: none arrived)
};

// x unchanged, through an autograd node whose backward gives `weight` the deferred chunks' gradient
// (undefined when nothing was deferred or no gradient reached the loss) and frees them. x must require a
// gradient (else x is returned as is, and nothing will be deferred), and the hidden states given to
// linear_cross_entropy with `deferred` must depend on it.
at::Tensor anchor_deferred_head_gradient(const at::Tensor& x, const at::Tensor& weight,
                                         const std::shared_ptr<DeferredHeadGradient>& deferred);

struct LinearCrossEntropy {
  at::Tensor loss;          // Σ_t w_t·ce_t, 0-dim, fp32 at least; differentiable in hidden and weight
  at::Tensor token_losses;  // ce_t with the shape of targets, fp32 at least, no gradient; 0 where ignored
  at::Tensor predictions;   // argmax over the vocabulary of the logits, int64, shape of targets (if asked)
  // Set when defer_bytes left some chunks' weight gradient to the anchor (what and how much).
  std::shared_ptr<DeferredHeadGradient> deferred;
};

// hidden [..., d] (floating), weight [V, d], targets [...] int64 (the leading dims of hidden; < 0:
// ignored), token_weights [...] (bool or floating; undefined: all ones). chunk_tokens <= 0 picks
// default_loss_chunk_tokens(V, ...) for the form that runs. The gradients are computed (and kept) only when grad mode is on and
// hidden or weight requires one.
// defer_bytes > 0 with `deferred` anchored (anchor_deferred_head_gradient) and gradients, the weight
// requiring one: the weight's gradient of the last chunks whose logit gradients take at most that many
// bytes together comes from the anchor's backward; those logit gradients stay allocated until then.
LinearCrossEntropy linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                        const at::Tensor& token_weights = {}, int64_t chunk_tokens = 0,
                                        bool predictions = false, int64_t defer_bytes = 0,
                                        const std::shared_ptr<DeferredHeadGradient>& deferred = nullptr);

}  // namespace carry
