// Log-linear attention (Guo et al. 2025, "Log-Linear Attention") over Mamba-2 and over Gated DeltaNet:
// the families "loglinear_mamba2" (inputs q, k, v, g, l) and "loglinear_gdn" (q, k, v, g, beta, l),
// registered in log_linear.cpp. Levels are over absolute positions (MixerOptions::offset + local
// index); the Fenwick bookkeeping is in fenwick.h.
//
// State at a boundary p: L-1 tensors S_j [B,H,dk,dv] (L = l.size(3)), one per bit j of p (fenwick.h);
// a state reached from the zero state has S_j = 0 for every bit j not set in p.
// Summary of a slice [p, q): transport = {A, p, q}, with A the base model's transport over the slice
// (Mamba-2: Π exp(g) [B,H]; Gated DeltaNet: A_{q-1}⋯A_p [B,H,dk,dk]) and p, q int64 tensors [1] on the
// inputs' device; state = the slice's own contribution to each entry of the state at q. compose
// refuses summaries that are not adjacent.
#pragma once

#include "layers/mixer.h"

#include <utility>

namespace carry {

// The boundaries [p, q) of a log-linear summary (reads its transport's position tensors).
std::pair<int64_t, int64_t> log_linear_summary_span(const Summary& summary);

}  // namespace carry
