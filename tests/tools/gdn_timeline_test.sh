#!/usr/bin/env bash
# tools/gdn_timeline.py on a made-up CARRY_GDN_TIMELINE log: the last forward and backward schedules
# are summarized (kinds' counts, first start, last end, summed spans; launches in start order); a log
# without timeline lines is refused with one clear line.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dir=$(mktemp -d /tmp/carry_gdn_timeline_test_XXXXXX)
trap 'rm -rf "$dir"' EXIT
# two forward schedules (the first must be ignored) and one backward, with other output between
cat >"$dir/log" <<'LOG'
family T fwd ms
[timeline] fwd begin
[timeline] fwd prep 0 0.0000 9.0000
[timeline] fwd begin
[timeline] fwd prep 0 0.0200 0.1900
[timeline] fwd prep 1 0.1950 0.4800
[timeline] fwd walk 0 0.1980 0.5200
[timeline] fwd out 0 0.5240 0.7000
[timeline] fwd walk 1 0.5220 0.8300
gated_deltanet 131072 4.9
[timeline] bwd begin
[timeline] bwd walk 0 0.1000 0.5000
[timeline] bwd chunks 0 0.5000 1.2500
LOG
out=$(python3 "$root/tools/gdn_timeline.py" "$dir/log")
echo "$out"
fail() { echo "gdn_timeline_test: FAILED: $*" >&2; exit 1; }
grep -q "== fwd: 2 schedules, the last ends at 0.830 ms" <<<"$out" || fail "the forward's end"
grep -q "prep    n=  2  first start 0.020  last end 0.480  sum of spans 0.455" <<<"$out" || fail "the preparation's line"
grep -q "walk    n=  2  first start 0.198  last end 0.830  sum of spans 0.630" <<<"$out" || fail "the walk's line"
grep -q "== bwd: 1 schedules, the last ends at 1.250 ms" <<<"$out" || fail "the backward's end"
grep -q "chunks    0    0.500    1.250 (0.750)" <<<"$out" || fail "a launch line"
# launches in start order: walk 1 (0.522) before out 0 (0.524)
order=$(grep -E "^    (walk|out) " <<<"$out" | awk '{print $1 $2}' | tr '\n' ' ')
[ "$order" = "walk0 walk1 out0 walk0 " ] || fail "start order: $order"
grep -q "9.000" <<<"$out" && fail "the first forward schedule was not ignored"
echo "no timeline here" >"$dir/empty"
if msg=$(python3 "$root/tools/gdn_timeline.py" "$dir/empty" 2>&1); then fail "a log without timeline lines was accepted"; fi
grep -q "no \[timeline\] lines in" <<<"$msg" || fail "the empty log's message: $msg"
echo "gdn_timeline_test: passed"
