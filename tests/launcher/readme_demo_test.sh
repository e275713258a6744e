#!/usr/bin/env bash
# The README's sample of the main job is what the main job prints: runs `launcher/train
# configs/demo_mqar.textproto` (2 ranks, 600 steps, about 2 minutes on 2 CPU cores) into a fresh
# directory and checks that every line between README.md's `<!-- demo-output:begin -->` and
# `<!-- demo-output:end -->` markers appears in its output, in order (readme_demo_compare.py says how
# lines match).
# Usage: readme_demo_test.sh SOURCE_DIR BUILD_DIR
set -u
root=$1 build=$2
tmp=$(mktemp -d /tmp/carry_readme_demo.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "readme_demo_test: FAILED: $*" >&2; exit 1; }

sample=$(sed -n '/<!-- demo-output:begin -->/,/<!-- demo-output:end -->/p' "$root/README.md" | grep -v '^<!--' | grep -v '^```')
[ -n "$sample" ] || fail "README.md has no demo-output block (the markers <!-- demo-output:begin --> and <!-- demo-output:end -->)"

# The README's command as it stands, from a fresh directory (the config's runs/demo_mqar/ paths land there).
mkdir -p "$tmp/run/configs" && cp "$root/configs/demo_mqar.textproto" "$tmp/run/configs/" && cd "$tmp/run" \
  || fail "no temporary directory"
CARRY_SKIP_SETUP=1 CARRY_BUILD_DIR="$build" "$root/launcher/train" configs/demo_mqar.textproto >"$tmp/out.log" 2>&1 \
  || { cat "$tmp/out.log" >&2; fail "the demo exited non-zero"; }
[ -f runs/demo_mqar/checkpoints/config.textproto ] || fail "the resolved config was not written beside the checkpoints"

# Compared line by line, in order: the text with every number taken out must be the same, integers
# (steps, parameter counts, positions) equal, and fractional figures (losses, gradient norms, learning
# rates, accuracies) within 0.01 or 2%: the CPU math is pinned, but another CPU model may still round
# the later steps' digits otherwise. Times, rates and memory (tok/s, rss, elapsed, eta) are left out.
printf '%s\n' "$sample" >"$tmp/sample.txt"
python3 "$root/tests/launcher/readme_demo_compare.py" "$tmp/sample.txt" "$tmp/out.log" \
  || { echo "--- the demo printed:" >&2; cat "$tmp/out.log" >&2; fail "README.md's sample differs from the demo's output (above)"; }
echo "readme_demo_test: the README's $(wc -l <<<"$sample") sample lines match the demo's output"
