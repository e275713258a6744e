#!/usr/bin/env bash
# tools/ncu_step_breakdown.py on a made-up ncu CSV: each kernel lands in its part (the products on
# either side of a cross-entropy kernel count as the head + loss, other products as projections, also
# beside ATen's reduce_kernel, whose name contains "ce_kernel"),
# the milliseconds add up, and a file that is not ncu's CSV gets one clear message.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/ncu_csv.sh"
ncu_csv_test ncu_breakdown_test
row() { ncu_metric "$1" "$2" gpu__time_duration.sum nsecond "$3"; }
{
  ncu_header
  row 0 'nvjet_sm90_tst_256x128 (projection)' '2,000,000'
  row 1 'void at::native::reduce_kernel<512, 1, ReduceOp<float>>' '100,000'
  row 1 'void carry::kernels::delta_rule::fwd_state_mma_kernel<128, 256, 16, 4>' '3,000,000'
  row 2 'void carry::kernels::blocks::norm_fwd_kernel<4, 1, 0>' '500,000'
  row 3 'nvjet_sm90_tst_256x128 (logits)' '1,000,000'
  row 4 'void carry::kernels::blocks::ce_kernel<__nv_bfloat16, 8>' '250,000'
  row 5 'nvjet_sm90_tst_96x128_splitK (dh)' '1,000,000'
  row 6 'void cublasLt::splitKreduce_kernel<32, 16>' '50,000'
  row 7 'nvjet_sm90_tss_128x256_badd (dW)' '2,000,000'
  row 8 'void carry::kernels::blocks::conv_bwd_kernel<bf16, bf16>' '700,000'
  row 9 'void native::vectorized_elementwise_kernel<4, FillFunctor<float>>' '100,000'
  row 10 'void native::multi_tensor_apply_kernel<FusedAdamMathFunctor>' '400,000'
} >"$dir/step.csv"
out=$(python3 "$root/tools/ncu_step_breakdown.py" "$dir/step.csv")
echo "$out"
grep -qF "| head + loss | 4.3 |" <<<"$out" || fail "head + loss should be 1 + 0.25 + 1 + 0.05 + 2 = 4.3 ms"
grep -qF "| mixer kernels | 3.0 |" <<<"$out" || fail "mixer kernels"
grep -qF "| projections and MLP matrix products | 2.0 |" <<<"$out" || fail "projections"
grep -qF "| norms (with residual adds) and SwiGLU | 0.5 |" <<<"$out" || fail "norms"
grep -qF "| short convolutions and L2 norm | 0.7 |" <<<"$out" || fail "convolutions"
grep -qF "| AdamW and gradient norm | 0.4 |" <<<"$out" || fail "optimizer"
grep -qF "| remaining ATen kernels | 0.2 |" <<<"$out" || fail "the rest (ATen's reduce_kernel is not the loss kernel)"
grep -qF "| total (kernels, serialized) | 11.1 |" <<<"$out" || fail "total"
echo "not a csv" >"$dir/bad.csv"
if msg=$(python3 "$root/tools/ncu_step_breakdown.py" "$dir/bad.csv" 2>&1); then fail "a file without ncu rows was accepted"; fi
grep -q "no ncu CSV rows in" <<<"$msg" || fail "message for a file without ncu rows: $msg"
echo "ncu_breakdown_test: OK"
