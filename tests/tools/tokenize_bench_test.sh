#!/usr/bin/env bash
# tools/tokenize_bench.py on a 3 MB corpus: it builds the corpus and a GPT-2-style tokenizer, checks that carry
# and Hugging Face's tokenizers give the same ids, and prints the timing table with both rows.
# usage: tests/tools/tokenize_bench_test.sh CARRY. Exit 77 (skipped) without .venv's tokenizers.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
carry=${1:?usage: tokenize_bench_test.sh CARRY}
py=$root/.venv/bin/python3
{ [ -x "$py" ] && "$py" -c 'import tokenizers' 2>/dev/null; } || { echo "SKIP: no tokenizers in .venv"; exit 77; }
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
"$py" "$root/tools/tokenize_bench.py" --carry "$carry" --bytes 3e6 --threads 2 --work "$tmp" >"$tmp/out.txt" 2>&1 \
  || { cat "$tmp/out.txt"; exit 1; }
for want in "ids agree on the first" "carry tokenize --jsonl" "tokenizers encode_batch" "carry / tokenizers:"; do
  grep -q -- "$want" "$tmp/out.txt" || { echo "missing '$want' in:"; cat "$tmp/out.txt"; exit 1; }
done
echo "tokenize_bench: ok"
