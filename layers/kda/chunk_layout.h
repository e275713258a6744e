// The layout helpers KDA's and RWKV-7's kernel forms share (layers/kda/kernel_form.cpp,
// layers/rwkv7/kernel_form.cpp): their work dtype and the chunked views they compute in.
#pragma once

#include "layers/layout.h"

namespace carry::chunk_layout {

// The dtype the pieces and walks run in: the inputs' promoted to at least fp32.
inline at::ScalarType work_dtype(const Tensor& x) { return at::promote_types(x.scalar_type(), at::kFloat); }
// [B,T,H,·] (or [B,T,H]) -> [B,H,N,C,·] in dtype dt.
inline Tensor chunked(const Tensor& x, int64_t C, at::ScalarType dt) { return split_chunks(to_bhtd(x).to(dt), C); }
// [B,H,N,C,·] -> [B,T,H,·] in dtype dt.
inline Tensor unchunked(const Tensor& x, at::ScalarType dt) { return from_bhtd(merge_chunks(x)).to(dt); }
inline Tensor t_(const Tensor& x) { return x.transpose(-1, -2); }

}  // namespace carry::chunk_layout
