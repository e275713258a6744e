#!/usr/bin/env bash
# launcher/plot on two made-up runs (one of them with a step written twice, as a resume left it before
# run_log.cpp dropped such records): --print reads each step once; the four PNGs are written and are
# PNG files.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dir=$(mktemp -d /tmp/carry_plot_test_XXXXXX)
trap 'rm -rf "$dir"' EXIT
mkdir -p "$dir/a" "$dir/b"
cat >"$dir/a/metrics.jsonl" <<'JSON'
{"event":"start","step":0,"time":1700000000.000}
{"step":1,"time":1700000001.000,"elapsed_s":1,"loss":5.5,"grad_norm":1,"lr":0.0001,"tokens_per_s":1000,"rss_mib":100,"tokens_seen":512}
{"step":2,"time":1700000002.000,"elapsed_s":2,"loss":5.0,"grad_norm":1,"lr":0.0002,"tokens_per_s":1100,"rss_mib":100,"tokens_seen":1024}
{"step":2,"time":1700000003.000,"eval_loss":4.9,"eval_perplexity":134.3,"eval_accuracy":0.1}
{"event":"resume","step":1,"time":1700000010.000}
{"step":2,"time":1700000011.000,"elapsed_s":3,"loss":4.5,"grad_norm":1,"lr":0.0002,"tokens_per_s":1200,"rss_mib":100,"tokens_seen":1024}
{"step":3,"time":1700000012.000,"elapsed_s":4,"loss":4.0,"grad_norm":1,"lr":0.0003,"tokens_per_s":1300,"rss_mib":100,"tokens_seen":1536}
JSON
cat >"$dir/b/metrics.jsonl" <<'JSON'
{"step":1,"time":1700000001.000,"elapsed_s":1,"loss":6.0,"grad_norm":1,"lr":0.0001,"tokens_per_s":900,"rss_mib":100,"tokens_seen":512}
{"step":2,"time":1700000002.000,"elapsed_s":2,"loss":5.8,"grad_norm":1,"lr":0.0002,"tokens_per_s":950,"rss_mib":100,"tokens_seen":1024}
{"step":2,"time":1700000002
JSON
out=$("$root/launcher/plot" "$dir/a" "$dir/b/metrics.jsonl" --print --out "$dir/png" --x tokens)
echo "$out"
fail() { echo "plot_test: FAILED: $*" >&2; exit 1; }
grep -q "run a (.*): 3 step records (steps 1..3), 1 evals, 2 start/resume markers" <<<"$out" || fail "run a's records"
grep -q "last step 3: loss 4.0000" <<<"$out" || fail "run a's last step"
grep -q "run b (.*): 2 step records (steps 1..2), 0 evals, 0 start/resume markers, 1 unreadable lines" <<<"$out" || fail "run b's records"
for f in loss lr tokens_per_s overview; do
  [ -s "$dir/png/$f.png" ] || fail "$f.png missing"
  [ "$(head -c 8 "$dir/png/$f.png" | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] || fail "$f.png is not a PNG"
done
"$root/launcher/plot" "$dir/nothing" 2>/dev/null && fail "a missing run was accepted"
echo "plot_test: ok"
