#!/usr/bin/env bash
# tools/ncu_kernel_sum.py (and its reader, tools/ncu_csv.py) on a made-up ncu CSV: launches of one
# kernel (any argument list) add up, time units and byte units convert, --per divides, the longest kernel
# comes first, and bad input gets one clear message: exit status 2 for usage, 1 for a file without ncu
# rows or with a unit the reader does not know.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/ncu_csv.sh"
ncu_csv_test ncu_kernel_sum_test
row() { ncu_metric "$@"; }
{
  ncu_header
  row 0 'void walk_kernel<1, 0>(const bf16 *, int)' gpu__time_duration.sum ns '1,000,000'
  row 0 'void walk_kernel<1, 0>(const bf16 *, int)' dram__bytes_read.sum Gbyte '1.5'
  row 0 'void walk_kernel<1, 0>(const bf16 *, int)' dram__bytes_write.sum Mbyte '500'
  row 1 'void walk_kernel<1, 0>(const bf16 *, long)' gpu__time_duration.sum us '1,000'
  row 2 'void out_kernel<128>(float *)' gpu__time_duration.sum msecond '0.5'
} >"$dir/k.csv"
out=$(python3 "$root/tools/ncu_kernel_sum.py" "$dir/k.csv")
echo "$out"
first=$(sed -n 3p <<<"$out")
grep -qF "| void walk_kernel<1, 0> | 2 | 2.000 | 1.000 | 2.00 | 1.00 |" <<<"$first" || fail "walk_kernel: 2 launches, 2 ms, 2 GB, first: $first"
grep -qF "| void out_kernel<128> | 1 | 0.500 | 0.500 |  |  |" <<<"$out" || fail "out_kernel: no DRAM rows"
grep -qF "| total (serialized) | 3 | 2.500 |" <<<"$out" || fail "total"
out=$(python3 "$root/tools/ncu_kernel_sum.py" "$dir/k.csv" --per 2)
grep -qF "| void walk_kernel<1, 0> | 2 | 1.000 | 1.000 | 1.00 | 1.00 |" <<<"$out" || fail "--per 2: $out"
echo "not a csv" >"$dir/bad.csv"
if msg=$(python3 "$root/tools/ncu_kernel_sum.py" "$dir/bad.csv" 2>&1); then fail "a file without ncu rows was accepted"; fi
grep -q "no ncu CSV rows in" <<<"$msg" || fail "message for a file without ncu rows: $msg"
{ ncu_header; row 0 'void k<1>(int)' gpu__time_duration.sum furlong '5'; } >"$dir/unit.csv"
if msg=$(python3 "$root/tools/ncu_kernel_sum.py" "$dir/unit.csv" 2>&1); then fail "an unknown unit was accepted"; fi
grep -q "CSV row 2: unknown time unit 'furlong' for gpu__time_duration.sum" <<<"$msg" || fail "unknown unit message: $msg"
set +e
python3 "$root/tools/ncu_kernel_sum.py" "$dir/k.csv" --per 0 >/dev/null 2>"$dir/err"; rc=$?
set -e
[ $rc = 2 ] || fail "--per 0: exit $rc, expected 2"
grep -q -- "--per expects a positive number, got '0'" "$dir/err" || fail "--per 0 message: $(cat "$dir/err")"
echo "ncu_kernel_sum_test: passed"
