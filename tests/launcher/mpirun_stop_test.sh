#!/usr/bin/env bash
# Stop signals under mpirun -np 2 with a model whose step outlasts a second (mpirun's default
# odls_base_sigkill_timeout), the case where a stop signal to a plain mpirun loses the work (CTest runs
# this; about 40 s on 2 CPU cores):
#   1. SIGTERM to `carry launch`: exit 75, a checkpoint at the stop, no warning about mpirun;
#   2. SIGHUP to `launcher/train` (a closed terminal): it resumes, then exit 75 and a newer checkpoint;
#   3. SIGUSR1 to a plain mpirun: exit 75 and a newer checkpoint; rank 0 warned at start that a
#      SIGTERM would kill the ranks (odls_base_sigkill_timeout 1, the default);
#   4. SIGTERM to a plain mpirun given --mca odls_base_sigkill_timeout 4: the ranks get the signal 4 s
#      later and write a newer checkpoint before the kill (mpirun's own exit status is 1).
# Every run's steps must outlast one second (from the metrics' elapsed_s), or the test proves nothing.
# Usage: mpirun_stop_test.sh SOURCE_DIR BUILD_DIR
set -u
root=$1 build=$2
carry=$build/bin/carry
tmp=$(mktemp -d /tmp/carry_mpirun_stop.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "FAIL: $*" >&2; echo "--- logs:" >&2; tail -n 30 "$tmp"/run*.log >&2 2>/dev/null; exit 1; }
if [ "$(id -u)" = 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi

cat >"$tmp/run.textproto" <<CONFIG
name: "mpirun_stop_test"
seed: 5
model { vocab_size: 256 d_model: 256 n_layers: 2 n_heads: 4 mixers: "gla" mixer_options { chunk_size: 64 } }
data { mqar { num_kv_pairs: 8 num_queries: 8 vocab_size: 256 } seq_len: 2048 batch_size: 4 eval_batches: 1 }
optimizer { lr: 1e-3 warmup_steps: 1 total_steps: 1000000 }
parallel { dp: 2 sp: 1 }
checkpoint { dir: "$tmp/ck" every_steps: 1000000 }
logging { every_steps: 1 metrics_file: "$tmp/metrics.jsonl" }
CONFIG
cat >"$tmp/cluster.textproto" <<CLUSTER
hosts { name: "localhost" gpus: 2 }
mpirun_args: ["--oversubscribe"]
CLUSTER

lines() { if [ -f "$tmp/metrics.jsonl" ]; then wc -l <"$tmp/metrics.jsonl"; else echo 0; fi; }
latest_step() { sed -n 's/^step_0*\([0-9][0-9]*\)$/\1/p' "$tmp/ck/latest" 2>/dev/null; }
elapsed_of() { sed -n 's/^{"step":'"$1"',"time":[^,]*,"elapsed_s":\([^,]*\),"loss".*/\1/p' "$tmp/metrics.jsonl" | tail -n1; }
set -m
# stop SIGNAL LOG EXPECTED_RC COMMAND...: starts COMMAND as its own job, waits until it has logged a
# step, sends SIGNAL to it and checks the exit status, the newer checkpoint and the step time.
stop() {
  local sig=$1 log=$2 want=$3 before after pid rc step prev
  shift 3
  before=$(lines)
  prev=$(latest_step)
  "$@" >"$tmp/$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 1200); do
    after=$(lines)
    [ "$after" -ge $((before + 1)) ] && break
    kill -0 "$pid" 2>/dev/null || fail "$log: ended before training a step"
    sleep 0.1
  done
  [ "$after" -ge $((before + 1)) ] || { kill -USR1 "$pid"; sleep 20; kill -KILL "$pid"; fail "$log: no step logged within 120 s"; }
  kill -"$sig" "$pid"
  wait "$pid"
  rc=$?
  [ "$rc" = "$want" ] || fail "$log: SIG$sig gave exit status $rc, expected $want"
  step=$(latest_step)
  [ -n "$step" ] && [ "$step" -gt "${prev:-0}" ] || fail "$log: SIG$sig: no new checkpoint (latest: '$step', before: '${prev:-none}')"
  [ -f "$tmp/ck/step_$(printf %08d "$step")/manifest.textproto" ] || fail "$log: latest names a missing step"
  grep -q "stopped at step $step/1000000 on a stop signal" "$tmp/$log" || fail "$log: no 'stopped at step $step' line"
  # The step the signal cut outlasted a second: mpirun's default would have killed it.
  awk -v a="$(elapsed_of $((step - 1)))" -v b="$(elapsed_of "$step")" 'BEGIN { exit !(a != "" && b - a > 1.0) }' \
    || fail "$log: step $step took $(elapsed_of "$step") - $(elapsed_of $((step - 1))) s, not over 1 s: make the model larger"
  echo "$log: SIG$sig -> exit $rc, checkpoint of step $step"
}

stop TERM run1.log 75 "$carry" launch --cluster "$tmp/cluster.textproto" --hostfile "$tmp/hostfile" "$tmp/run.textproto"
grep -q "carry launch: stopped with a checkpoint (exit 75)" "$tmp/run1.log" || fail "carry launch does not say it stopped"
grep -q "warning: mpirun runs with odls_base_sigkill_timeout" "$tmp/run1.log" && fail "carry launch's ranks warn about mpirun"

stop HUP run2.log 75 env CARRY_SKIP_SETUP=1 CARRY_BUILD_DIR="$build" "$root/launcher/train" "$tmp/run.textproto"
grep -q "resumed from $tmp/ck at step" "$tmp/run2.log" || fail "run 2 did not resume"
grep -q "warning: mpirun runs with odls_base_sigkill_timeout" "$tmp/run2.log" && fail "launcher/train's ranks warn about mpirun"

stop USR1 run3.log 75 mpirun --quiet --oversubscribe -np 2 "$carry" train "$tmp/run.textproto"
[ "$(grep -c "carry train: warning: mpirun runs with odls_base_sigkill_timeout 1 (the default)" "$tmp/run3.log")" = 1 ] \
  || fail "a plain mpirun without odls_base_sigkill_timeout: rank 0 did not warn once"

stop TERM run4.log 1 mpirun --quiet --oversubscribe -np 2 --mca odls_base_sigkill_timeout 4 "$carry" train "$tmp/run.textproto"
echo "mpirun -np 2: carry launch SIGTERM, launcher/train SIGHUP, mpirun SIGUSR1 -> exit 75; mpirun SIGTERM with odls_base_sigkill_timeout 4 -> a checkpoint"
