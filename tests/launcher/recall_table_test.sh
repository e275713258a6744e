#!/bin/bash
# launcher/recall_table on the CPU with a one-layer model file: two steps of training, then the table's one row:
# its columns (the parameters the training printed, the steps, a rate, a loss, one accuracy in [0, 1] for each
# pair count and each length), the eval JSON behind each accuracy (at the length asked, without the training's
# pair-count mixture); a bad option is one line naming it (exit 2).
set -u
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:?usage: recall_table_test.sh BUILD_DIR}
tmp=$(mktemp -d /tmp/carry_recall_XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
cat >"$tmp/tiny.textproto" <<'M'
vocab_size: 64
d_model: 32
n_layers: 1
n_heads: 1
mixers: "gated_deltanet"
mixer_options { chunk_size: 16 conv_size: 4 }
M
cat >"$tmp/run.textproto" <<'R'
name: "recall_table_test"
seed: 1
model_preset: "tiny.textproto"
data {
  mqar { num_kv_pairs: 8 min_kv_pairs: 2 num_queries: 8 vocab_size: 64 }
  seq_len: 64
  batch_size: 4
  eval_batches: 1
}
optimizer { lr: 3e-3 warmup_steps: 1 total_steps: 2 }
checkpoint { every_steps: 0 keep_last: 1 }
logging { every_steps: 1 eval_every_steps: 0 }
precision: FP32
R
out=$(CARRY_BUILD_DIR=$build OUT=$tmp/out OMP_NUM_THREADS=1 "$root/launcher/recall_table" --run "$tmp/run.textproto" \
      --steps 2 --pairs "4 8" --far-pairs 4 --lengths "128 256" "$tmp/tiny.textproto" 2>&1) || fail "exit $?: $out"
echo "$out"
row=$(grep '^| tiny |' <<<"$out") || fail "no row for the model"
dir=$tmp/out/recall_table/tiny
python3 - "$row" "$dir" <<'PY' || exit 1
import json, re, sys
row, d = sys.argv[1], sys.argv[2]
cells = [c.strip() for c in row.strip().strip('|').split('|')]
assert len(cells) == 9, cells
params = int(re.search(r'^parameters: (\d+),', open(f'{d}/train.log').read(), re.M).group(1))
assert cells[1] == f'{params:,}', (cells[1], params)
assert cells[2] == '2', cells[2]
assert float(cells[3].replace(',', '')) > 0 and float(cells[4]) > 0, cells[3:5]
for cell, name, seq_len in zip(cells[5:], ['eval_4', 'eval_8', 'eval_far_128', 'eval_far_256'], [64, 64, 128, 256]):
    j = json.load(open(f'{d}/{name}.json'))
    assert abs(float(cell) - j['accuracy']) < 1e-4 and 0 <= j['accuracy'] <= 1, (cell, j)
    log = open(f'{d}/{name}.log').read()
    assert f'{seq_len} tokens a sequence' in log, (name, log)
PY
err=$("$root/launcher/recall_table" --steps x 2>&1); rc=$?
[ $rc -eq 2 ] && [ "$(wc -l <<<"$err")" -eq 1 ] && [[ $err == *--steps* ]] || fail "bad --steps: exit $rc: $err"
err=$("$root/launcher/recall_table" no_such_preset 2>&1); rc=$?
[ $rc -eq 2 ] && [[ $err == *no_such_preset* ]] || fail "unknown preset: exit $rc: $err"
echo OK
