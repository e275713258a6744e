// KDA's kernel form: every chunk's pieces at once, the state walked chunk after chunk by a kernel, and a
// hand-written backward (one autograd op). kda.h states the chunk; here the walk keeps the state's two
// products apart instead of forming the dense transport (a [dk,dk] matrix a chunk):
//   V_new = U − W·S_in,   S_out = Diag(e^{G_C})·S_in + K_outᵀ·V_new,   o = Q_s·S_in + QA·V_new,
// with U = M·V, W = M·K_in, M = T·diag(β), Q_s = scale·e^{G} ⊙ Q and K_out = e^{G_C − G} ⊙ K (kda.h's
// names). The walk costs 2·C·dk·dv multiply-adds a chunk (the dense transport's product dk²·dv more).
//
// Backward, per chunk, from the gradient dS_out of the state leaving it (the reverse walk, in order from
// the last chunk):
//   dV_new = QAᵀ·dO + K_out·dS_out,   dS_in = Diag(e^{G_C})·dS_out + Q_sᵀ·dO − Wᵀ·dV_new;
// then every chunk at once: dQA = dO·V_newᵀ, dQ_s = dO·S_inᵀ, dK_out = V_new·dS_outᵀ, dW = −dV_new·S_inᵀ,
// dM = dV_new·Vᵀ + dW·K_inᵀ, dV = Mᵀ·dV_new, dK_in = Mᵀ·dW, dT = dM·diag(β), dL = −Tᵀ·dT·Tᵀ (strictly
// lower), dKA = diag(β)·dL, the pairs' gradients through decayed_pairs, and dgk the within-chunk suffix sum
// of dG (dG_C gaining e^{G_C} ⊙ rowsum(dS_out ⊙ S_in) and the K_out terms).
//
// The walks run on CUDA as layers/kernels/kda's kernels (fp32 states, any GPU), elsewhere as ATen loops
// (the same operations, for tests of the algorithm on the CPU); the chunk pieces are batched ATen products
// in fp32 (fp64 for fp64 inputs). The walk visits every chunk in order whatever MixerOptions::serial_states
// says, so a sequence cut at a chunk boundary gives the bits of the whole when both parts run with the same
// number of chunks (the ordered scan with parallel.segments).
#pragma once

#include "layers/mixer.h"

namespace carry {

// Whether the kernel form takes these inputs: CUDA, bf16 or fp32, dk ∈ {64, 128}, dv a multiple of 16 up to
// 256, chunk_size 64.
bool kda_kernel_supports(const MixerInputs& in, const MixerOptions& opt);

// o [B,T,H,dv] in the inputs' dtype and {S} [B,H,dk,dv] in fp32 (fp64 for fp64 inputs); differentiable in
// q, k, v, gk, beta and the initial state (undefined: zeros). Any device: the walks are kernels on CUDA.
MixerOutput kda_kernel_form(const MixerInputs& in, const Tensor& initial_state, const MixerOptions& opt);

// The walks alone (tests), chunked layouts [B,H,N,C,·], one floating dtype. Forward: from S0 [B,H,dk,dv],
// the state entering every chunk [B,H,N,dk,dv], V_new [B,H,N,C,dv] and the final state.
struct KdaWalk {
  Tensor states, v_new, final_state;
};
KdaWalk kda_walk(const Tensor& w, const Tensor& u, const Tensor& k_out, const Tensor& decay, const Tensor& s0);
// Reverse: from the final state's gradient, the gradient of the state leaving every chunk [B,H,N,dk,dv],
// the full dV_new [B,H,N,C,dv] and the initial state's gradient. dv_pre = QAᵀ·dO.
struct KdaReverseWalk {
  Tensor out_grads, v_new_grads, initial_grad;
};
KdaReverseWalk kda_reverse_walk(const Tensor& q_s, const Tensor& d_o, const Tensor& w, const Tensor& k_out,
                                const Tensor& decay, const Tensor& dv_pre, const Tensor& d_final);

}  // namespace carry
