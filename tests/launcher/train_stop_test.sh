#!/usr/bin/env bash
# launcher/train under a stop signal, as a scheduler or a Ctrl-C sends it (CTest runs this; about 15 s
# on 2 CPU cores): a tiny MQAR run on 2 ranks (dp = 2) gets SIGTERM once it has logged 2 steps; it must
# write a checkpoint and exit 75. The same command then resumes at that step, gets SIGINT, and must
# again exit 75 with a newer checkpoint. Usage: train_stop_test.sh SOURCE_DIR BUILD_DIR
set -u
root=$1 build=$2
tmp=$(mktemp -d /tmp/carry_train_stop.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; echo "--- log:" >&2; cat "$tmp"/run*.log >&2 2>/dev/null; exit 1; }

cat >"$tmp/run.textproto" <<CONFIG
name: "train_stop_test"
seed: 3
model { vocab_size: 32 d_model: 16 n_layers: 1 n_heads: 2 mixers: "gla" mixer_options { chunk_size: 8 } }
data { mqar { num_kv_pairs: 2 num_queries: 2 vocab_size: 32 } seq_len: 16 batch_size: 2 eval_batches: 1 }
optimizer { lr: 1e-2 warmup_steps: 1 total_steps: 1000000 }
parallel { dp: 2 sp: 1 }
checkpoint { dir: "$tmp/ck" }
logging { every_steps: 1 metrics_file: "$tmp/metrics.jsonl" }
CONFIG

# Starts launcher/train in the background as its own job (job control on: a background job of a
# script would otherwise ignore SIGINT), waits until the metrics file has grown by 2 lines, sends
# the signal and waits for the exit status.
lines() { if [ -f "$tmp/metrics.jsonl" ]; then wc -l <"$tmp/metrics.jsonl"; else echo 0; fi; }
latest_step() { sed -n 's/^step_0*\([0-9][0-9]*\)$/\1/p' "$tmp/ck/latest"; }
set -m
stop_with() {  # signal log
  local before after pid rc
  before=$(lines)
  CARRY_SKIP_SETUP=1 CARRY_BUILD_DIR="$build" "$root/launcher/train" "$tmp/run.textproto" >"$tmp/$2" 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do
    after=$(lines)
    [ "$after" -ge $((before + 2)) ] && break
    kill -0 "$pid" 2>/dev/null || fail "launcher/train ended before training 2 steps"
    sleep 0.1
  done
  [ "$after" -ge $((before + 2)) ] || { kill -TERM "$pid"; sleep 2; kill -TERM "$pid"; fail "no 2 steps logged within 60 s"; }
  kill -"$1" "$pid"
  wait "$pid"
  rc=$?
  [ "$rc" = 75 ] || fail "SIG$1: launcher/train exited $rc, expected 75"
}

stop_with TERM run1.log
first=$(latest_step)
[ -n "$first" ] && [ "$first" -ge 2 ] || fail "after SIGTERM: no checkpoint (latest: $(cat "$tmp/ck/latest" 2>&1))"
[ -f "$tmp/ck/step_$(printf %08d "$first")/manifest.textproto" ] || fail "latest names a missing step"
grep -q "stopped at step $first/1000000 on a stop signal" "$tmp/run1.log" || fail "run 1 does not say where it stopped"
grep -q "train: stopped with a checkpoint (exit 75)" "$tmp/run1.log" || fail "launcher/train does not say it stopped"

stop_with INT run2.log
grep -q "resumed from $tmp/ck at step $first" "$tmp/run2.log" || fail "run 2 did not resume at step $first"
second=$(latest_step)
[ -n "$second" ] && [ "$second" -gt "$first" ] || fail "after SIGINT: latest is step '$second', not past $first"
# Each logged step once: the resumed run dropped nothing and repeated nothing.
steps=$(sed -n 's/^{"step":\([0-9]*\),"time":[^,]*,"elapsed_s":[^,]*,"loss".*/\1/p' "$tmp/metrics.jsonl" | tr '\n' ' ')
[ "$steps" = "$(seq -s ' ' 1 "$second") " ] || fail "metrics steps are '$steps', expected 1 to $second once each"
echo "launcher/train: SIGTERM -> checkpoint of step $first, exit 75; resumed, SIGINT -> step $second, exit 75"
