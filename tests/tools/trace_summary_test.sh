#!/usr/bin/env bash
# tools/trace_summary on a made-up two-rank trace: each rank's window, stream busy times, the main
# stream's gaps (the longest first, with the kernels around them), the kernels by kind; a directory
# without traces is refused clearly.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dir=$(mktemp -d /tmp/carry_trace_summary_test_XXXXXX)
trap 'rm -rf "$dir"' EXIT
# rank 0, one step: stream 7 runs a GEMM 0..100 us, a carry kernel 150..250 (a 50 us gap), an add
# 250..260; stream 24 an NCCL kernel 100..300.
cat >"$dir/trace_rank0.json" <<'JSON'
{"traceEvents": [
 {"ph": "X", "cat": "kernel", "name": "nvjet_sm90_tst_256x128", "ts": 1000, "dur": 100, "args": {"stream": 7}},
 {"ph": "X", "cat": "kernel", "name": "void carry::kernels::delta_rule::fwd_state_mma_kernel<128>(float*)", "ts": 1150, "dur": 100, "args": {"stream": 7}},
 {"ph": "X", "cat": "kernel", "name": "void at::native::vectorized_elementwise_kernel<add>", "ts": 1250, "dur": 10, "args": {"stream": 7}},
 {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv(x)", "ts": 1100, "dur": 200, "args": {"stream": 24}},
 {"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 1000, "dur": 5, "args": {}}
]}
JSON
cat >"$dir/trace_rank1.json" <<'JSON'
{"traceEvents": [{"ph": "X", "cat": "cpu_op", "name": "aten::add", "ts": 1000, "dur": 5, "args": {}}]}
JSON
out=$("$root/tools/trace_summary" "$dir" --steps 1)
echo "$out"
fail() { echo "trace_summary_test: FAILED: $*" >&2; exit 1; }
grep -q "trace_rank0.json: window 0.30 ms a step, some stream busy 0.30 ms, all idle 0.00 ms" <<<"$out" || fail "rank 0's window"
grep -q "stream 7: 3 events, busy 0.21 ms" <<<"$out" || fail "stream 7's busy time"
grep -q "stream 24: 1 events, busy 0.20 ms" <<<"$out" || fail "stream 24's busy time"
grep -q "stream 7: 1 gaps >= 20 us a step, 0.05 ms a step" <<<"$out" || fail "stream 7's gaps"
grep -q "0.05 ms at     0.10 ms  after nvjet_sm90_tst_256x128  before void carry::kernels::delta_rule::fwd_state_mm" <<<"$out" || fail "the gap's kernels"
grep -q "by kind (ms a step): nccl 0.20, gemm 0.10, carry 0.10, other 0.01" <<<"$out" || fail "kernels by kind"
grep -q "trace_rank1.json: no GPU events" <<<"$out" || fail "rank 1 without GPU events"
# --idle: a rank where no stream runs for 1 ms while the host waits in cudaStreamSynchronize; the gaps by
# size and the longest with the host's calls during it.
mkdir "$dir/idle"
cat >"$dir/idle/trace_rank0.json" <<'JSON'
{"traceEvents": [
 {"ph": "X", "cat": "kernel", "name": "k1(int)", "ts": 0, "dur": 100, "args": {"stream": 7}},
 {"ph": "X", "cat": "kernel", "name": "k2", "ts": 103, "dur": 47, "args": {"stream": 7}},
 {"ph": "X", "cat": "kernel", "name": "k3", "ts": 1150, "dur": 50, "args": {"stream": 9}},
 {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 160, "dur": 900, "args": {}},
 {"ph": "X", "cat": "cpu_op", "name": "aten::item", "ts": 2000, "dur": 10, "args": {}}
]}
JSON
idle=$("$root/tools/trace_summary" "$dir/idle" --steps 1 --idle 2)
echo "$idle"
grep -q "all-idle gaps a step by size: 0-5 us: 1 gaps, 0.00 ms; 5-20 us: 0 gaps, 0.00 ms; 20-100 us: 0 gaps, 0.00 ms; 100-1000 us: 0 gaps, 0.00 ms; >= 1000 us: 1 gaps, 1.00 ms" <<<"$idle" || fail "the idle gaps by size"
grep -q "idle  1.000 ms at     0.15 ms  after k2  before k3" <<<"$idle" || fail "the longest idle gap"
grep -q "host: cudaStreamSynchronize 0.90 ms" <<<"$idle" || fail "the host's call during the gap"
grep -q "host: nothing traced" <<<"$idle" || fail "the 3 us gap without host events"
mkdir "$dir/empty"
if msg=$("$root/tools/trace_summary" "$dir/empty" 2>&1); then fail "an empty directory was accepted"; fi
grep -q "no trace_rank<r>.json in" <<<"$msg" || fail "the empty directory's message: $msg"
echo "trace_summary_test: passed"
