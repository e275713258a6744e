#!/usr/bin/env bash
# launcher/wandb (tools/wandb_offline.py): a carry run's metrics and config become a W&B offline run whose
# file, read back independently (wandb_offline_read.py), holds every step's values, the config's fields,
# carry's version and the CARRY_* variables; a broken metrics line is refused with its line number.
# Exit 77 (skipped) when wandb can be neither imported nor installed (no network).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
py=$root/.venv/bin/python3
if ! { [ -x "$py" ] && "$py" -c 'import wandb' 2>/dev/null; }; then
  [ -x "$py" ] || python3 -m venv "$root/.venv" || { echo "SKIP: no .venv"; exit 77; }
  "$py" -m pip install -q --disable-pip-version-check wandb >/dev/null 2>&1 || { echo "SKIP: wandb cannot be installed"; exit 77; }
fi
run=$tmp/run; mkdir -p "$run/checkpoints"
cat >"$run/metrics.jsonl" <<'M'
{"event":"start","step":0,"time":1795881427.469}
{"step":1,"time":1795881428.1,"elapsed_s":0.5,"loss":3.5510,"grad_norm":1.115,"lr":0.0006,"tokens_per_s":14428.5,"tokens_seen":4096}
{"event":"resume","step":1,"time":1795881429.0}
{"step":10,"time":1795881432.939,"loss":3.1117284297943115,"grad_norm":1.1638346421065202,"lr":0.0025533263185844586,"tokens_per_s":7724.852460001166,"tokens_seen":40960}
{"step":20,"time":1795881438.2,"loss":null,"grad_norm":0.948,"lr":0.0003295,"tokens_per_s":16149.0,"tokens_seen":81920}
{"step":20,"time":1795881438.206,"eval_loss":2.809177815914154,"eval_accuracy":0.22802734375}
M
cat >"$run/checkpoints/config.textproto" <<'C'
name: "wandb_test"  # a comment
seed: 7
data { seq_len: 64 batch_size: 8 mqar { num_kv_pairs: 4 } }
optimizer { lr: 0.003 warmup_steps: 5 }
precision: FP32
C
CARRY_WANDB_TEST=xyz "$root/launcher/wandb" "$run" --project carry-test --name t1 >"$tmp/out.txt" 2>&1 \
  || { cat "$tmp/out.txt"; echo "FAIL: launcher/wandb failed"; exit 1; }
grep -q "3 steps of" "$tmp/out.txt" || { cat "$tmp/out.txt"; echo "FAIL: expected '3 steps of' in its line"; exit 1; }
files=("$run"/wandb/offline-run-*/run-*.wandb)
[ ${#files[@]} -eq 1 ] && [ -f "${files[0]}" ] || { echo "FAIL: expected one offline run file, found: ${files[*]}"; exit 1; }
"$py" "$root/tests/tools/wandb_offline_read.py" "${files[0]}" >"$tmp/read.json"
"$py" - "$tmp/read.json" <<'P'
import json, sys
d = json.load(open(sys.argv[1]))
h, c = d["history"], d["config"]
def check(ok, what):
    if not ok:
        sys.exit("FAIL: " + what + "\n" + json.dumps(d, indent=1)[:3000])
check([r["_step"] for r in h] == [1, 10, 20], "history steps 1, 10, 20")
check(h[0]["train/loss"] == 3.551 and h[1]["train/loss"] == 3.1117284297943115, "the losses, bit for bit")
check(h[1]["train/grad_norm"] == 1.1638346421065202 and h[2]["train/lr"] == 0.0003295, "grad norm and lr")
check("train/loss" not in h[2], "a null loss is left out, not written as a number")
check(h[2]["eval/loss"] == 2.809177815914154 and h[2]["eval/accuracy"] == 0.22802734375, "the eval at step 20")
check(c.get("name") == "wandb_test" and c.get("seed") == 7 and c.get("data.seq_len") == 64, "config fields")
check(c.get("data.mqar.num_kv_pairs") == 4 and c.get("optimizer.lr") == 0.003 and c.get("precision") == "FP32",
      "nested config fields")
check(c.get("env.CARRY_WANDB_TEST") == "xyz", "the CARRY_* variables")
check(str(c.get("carry.version", "")).strip() not in ("", "unknown"), "carry's version")
print("wandb offline run: 3 steps and the config read back")
P
# A broken line: one message with the file and line.
printf '{"step":1,"loss":1.0}\n{"step":2,"loss":\n' >"$tmp/bad.jsonl"
if "$root/launcher/wandb" "$tmp/bad.jsonl" --dir "$tmp" >"$tmp/bad.txt" 2>&1; then
  echo "FAIL: a broken metrics line was accepted"; exit 1
fi
grep -q "bad.jsonl:2: not a JSON record" "$tmp/bad.txt" || { cat "$tmp/bad.txt"; echo "FAIL: expected the line number"; exit 1; }
echo "PASS"
