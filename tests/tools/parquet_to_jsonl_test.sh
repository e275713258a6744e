#!/bin/bash
# tools/parquet_to_jsonl.py: where pyarrow is installed, a Parquet file of two row groups (with a null row,
# UTF-8 and a newline in the text) becomes the JSONL lines carry tokenize --jsonl reads, in row order; a
# missing column is one line naming the file (exit 1). Without pyarrow: the install message (exit 3), and
# the test reports itself skipped (exit 77).
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
# The project's .venv (launcher/python_env installs pyarrow there) when it exists, else python3.
py=${CARRY_PYTHON:-$root/.venv/bin/python3}
[ -x "$py" ] || py=python3
dir=$(mktemp -d /tmp/carry_parquet_XXXXXX)
trap 'rm -rf "$dir"' EXIT
if ! "$py" -c 'import pyarrow' 2>/dev/null; then
  out=$("$py" "$root/tools/parquet_to_jsonl.py" x.parquet --output "$dir/x.jsonl" 2>&1); rc=$?
  [ $rc -eq 3 ] || { echo "FAIL: without pyarrow the exit is $rc, expected 3: $out"; exit 1; }
  case "$out" in *'pip install pyarrow'*) ;; *) echo "FAIL: no install hint: $out"; exit 1 ;; esac
  echo "SKIP: pyarrow is not installed for $py (the install message is right)"
  exit 77
fi
"$py" - "$dir/in.parquet" <<'PY' || exit 1
import sys
import pyarrow as pa, pyarrow.parquet as pq
t = pa.table({'text': ['first', None, 'h\u00e9llo\nw\u00f6rld \u2713', 'last'], 'id': [1, 2, 3, 4]})
pq.write_table(t, sys.argv[1], row_group_size=2)
PY
"$py" "$root/tools/parquet_to_jsonl.py" "$dir/in.parquet" --output "$dir/out.jsonl" 2>"$dir/err" || { cat "$dir/err"; exit 1; }
expected=$(printf '%s\n' '{"text": "first"}' '{"text": "héllo\nwörld ✓"}' '{"text": "last"}')
[ "$(cat "$dir/out.jsonl")" = "$expected" ] || { echo "FAIL: got"; cat "$dir/out.jsonl"; exit 1; }
grep -q 'wrote 3 documents to .* (1 null rows skipped)' "$dir/err" || { echo "FAIL: summary"; cat "$dir/err"; exit 1; }
out=$("$py" "$root/tools/parquet_to_jsonl.py" "$dir/in.parquet" --column body --output "$dir/b.jsonl" 2>&1); rc=$?
[ $rc -eq 1 ] || { echo "FAIL: missing column exit $rc"; exit 1; }
[ "$out" = "parquet_to_jsonl: $dir/in.parquet: no column \"body\" (columns: text, id); name the text column with --column" ] ||
  { echo "FAIL: $out"; exit 1; }
[ ! -e "$dir/b.jsonl" ] || { echo "FAIL: output left behind"; exit 1; }
echo "OK"
