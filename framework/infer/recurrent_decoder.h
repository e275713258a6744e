// Decoding from the recurrent state: a model reads a sequence piece by piece, each piece starting
// where the previous one stopped, and keeps per layer only what the next token needs:
//   - the family's state (S, or HLA's tuple, or log-linear's Fenwick blocks): the final_state of the
//     previous piece, handed to the next as its initial_state (O(1) per token in the sequence length);
//   - the short convolutions' last K-1 inputs (q, k, v before the convolution, concatenated);
//   - softmax attention: the keys and values so far (a KV cache; the last window-1 with a window).
// A piece runs through the same MixerLayer code as training, through the layer's two hooks
// (MixerLayerContext): `halo` hands the convolutions the cached inputs and records the new ones,
// `run_mixer` runs the family from the cached state (or attends over the KV cache). Whole chunks at
// a chunk-aligned position run in the chunkwise form (the kernel form on CUDA where the family has
// one); the rest, and every single-token step, in the naive form, which for one token is the
// recurrence's one-token update. The logits equal those of a full forward over the same tokens up to
// rounding (tests/framework/infer/recurrent_decoder_test.cpp checks every mixer kind in fp64).
//
// Log-linear layers with levels = 0 read as many level weights as `max_length` tokens need, so the
// logits equal those of a full forward over max_length tokens.
#pragma once

#include "framework/model/model.h"

#include <cstdint>
#include <vector>

namespace carry {

class RecurrentDecoder {
 public:
  // `max_length`: the most tokens this decoder will read (prompt + generated); feeding more throws.
  RecurrentDecoder(const Model& model, int64_t max_length);

  // Reads tokens [B, n] (the batch size is fixed by the first call) and returns the logits [B, n, V]
  // after each of them. Call under at::NoGradGuard (the caches are not differentiable).
  Tensor feed(const Tensor& tokens);

  int64_t position() const { return position_; }  // tokens read so far
  int64_t max_length() const { return max_length_; }

 private:
  struct LayerCache {
    State state;      // the family's state (empty before the first token: zeros)
    Tensor conv_tail;  // [B, K-1, C]: the last K-1 inputs of the convolutions
    Tensor keys, values;  // softmax attention: [B, n, H, dk], [B, n, H, dv]
    Tensor ffn_tail;   // [B, 1, d]: the channel mix's last input (its token shift, feed_forward "rwkv7_channel_mix")
  };
  // One piece [B, n] at position_, all layers, in `form` for the families.
  Tensor run_piece(const Tensor& tokens, Form form);

  const Model* model_;
  int64_t max_length_;
  int64_t position_ = 0;
  int64_t alignment_ = 1;
  std::vector<LayerCache> caches_;
  Tensor embedding_, head_;
};

}  // namespace carry
