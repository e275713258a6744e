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

namespace carry {

// Tokens per chunk when none is given (a multiple of 64, at least 64). fused_logit_bytes = 0: the ATen
// form, which holds an fp32 log-softmax and gradient beside the logits: about 64 MiB of fp32 logits a
// chunk. > 0: the fused CUDA kernel (one logits buffer, the gradient written over it) with logits of
// that many bytes: about 256 MiB of logits a chunk (4160 tokens at V = 32000 in bf16: fewer, larger
// matrix products, and the head's fp32 weight-gradient sum read and written fewer times).
int64_t default_loss_chunk_tokens(int64_t vocab_size, int64_t fused_logit_bytes = 0);

struct LinearCrossEntropy {
  at::Tensor loss;          // Σ_t w_t·ce_t, 0-dim, fp32 at least; differentiable in hidden and weight
  at::Tensor token_losses;  // ce_t with the shape of targets, fp32 at least, no gradient; 0 where ignored
  at::Tensor predictions;   // argmax over the vocabulary of the logits, int64, shape of targets (if asked)
};

// hidden [..., d] (floating), weight [V, d], targets [...] int64 (the leading dims of hidden; < 0:
// ignored), token_weights [...] (bool or floating; undefined: all ones). chunk_tokens <= 0 picks
// default_loss_chunk_tokens(V, ...) for the form that runs. The gradients are computed (and kept) only when grad mode is on and
// hidden or weight requires one.
LinearCrossEntropy linear_cross_entropy(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                        const at::Tensor& token_weights = {}, int64_t chunk_tokens = 0,
                                        bool predictions = false);

}  // namespace carry
