#!/usr/bin/env bash
# Stop signals under mpirun -np 2 with a model whose step outlasts a second (mpirun's default
# odls_base_sigkill_timeout), the case where a stop signal to a plain mpirun loses the work (CTest runs
# this; about 90 s on 2 CPU cores):
#   1. SIGTERM to `carry launch`: exit 75, a checkpoint at the stop, no warning about mpirun; then
#      SIGINT (a Ctrl-C) to `carry launch`: it resumes, then exit 75 and a newer checkpoint;
#   2. SIGHUP to `launcher/train` (a closed terminal): it resumes, then exit 75 and a newer checkpoint;
#   3. SIGTERM to a plain mpirun given --mca odls_base_sigkill_timeout N, N twice the measured
#      step time plus 2 s: the ranks get the signal N s later and write a newer checkpoint before the
#      kill (mpirun's own exit status is 1); rank 0 warned at start when N is below 30.
# The first run's stopped step must outlast one second (from the metrics' elapsed_s), or the test
# proves nothing.
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
data { mqar { num_kv_pairs: 8 num_queries: 8 vocab_size: 256 } seq_len: 1024 batch_size: 2 eval_batches: 1 }
optimizer { lr: 1e-3 warmup_steps: 1 total_steps: 1000000 }
parallel { dp: 2 sp: 1 }
checkpoint { dir: "$tmp/ck" every_steps: 1000000 }
logging { every_steps: 1 metrics_file: "$tmp/metrics.jsonl" }
CONFIG
cat >"$tmp/cluster.textproto" <<CLUSTER
hosts { name: "localhost" gpus: 2 }
mpirun_args: ["--oversubscribe"]
CLUSTER

latest_step() { sed -n 's/^step_0*\([0-9][0-9]*\)$/\1/p' "$tmp/ck/latest" 2>/dev/null; }
elapsed_of() { sed -n 's/^{"step":'"$1"',"time":[^,]*,"elapsed_s":\([^,]*\),"loss".*/\1/p' "$tmp/metrics.jsonl" | tail -n1; }
set -m
# stop SIGNAL LOG EXPECTED_RC COMMAND...: starts COMMAND as its own job, waits until it has logged a
# step, sends SIGNAL to it and checks the exit status and the newer checkpoint.
stop() {
  local sig=$1 log=$2 want=$3 pid rc step prev
  shift 3
  prev=$(latest_step)
  "$@" >"$tmp/$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 1200); do
    grep -q '^step  *[0-9]' "$tmp/$log" && break
    kill -0 "$pid" 2>/dev/null || fail "$log: ended before training a step"
    sleep 0.1
  done
  grep -q '^step  *[0-9]' "$tmp/$log" || { kill -USR1 "$pid"; sleep 30; kill -KILL "$pid"; fail "$log: no step logged within 120 s"; }
  kill -"$sig" "$pid"
  wait "$pid"
  rc=$?
  [ "$rc" = "$want" ] || fail "$log: SIG$sig gave exit status $rc, expected $want"
  step=$(latest_step)
  [ -n "$step" ] && [ "$step" -gt "${prev:-0}" ] || fail "$log: SIG$sig: no new checkpoint (latest: '$step', before: '${prev:-none}')"
  [ -f "$tmp/ck/step_$(printf %08d "$step")/manifest.textproto" ] || fail "$log: latest names a missing step"
  grep -q "stopped at step $step/1000000 on a stop signal" "$tmp/$log" || fail "$log: no 'stopped at step $step' line"
  echo "$log: SIG$sig -> exit $rc, checkpoint of step $step"
}

stop TERM run1.log 75 "$carry" launch --cluster "$tmp/cluster.textproto" --hostfile "$tmp/hostfile" "$tmp/run.textproto"
grep -q "carry launch: stopped with a checkpoint (exit 75)" "$tmp/run1.log" || fail "carry launch does not say it stopped"
grep -q "warning: mpirun runs with odls_base_sigkill_timeout" "$tmp/run1.log" && fail "carry launch's ranks warn about mpirun"
# The stopped step outlasted a second: mpirun's default would have killed the ranks in it.
first=$(latest_step)
awk -v a="$(elapsed_of $((first - 1)))" -v b="$(elapsed_of "$first")" 'BEGIN { exit !(a != "" && b - a > 1.0) }' \
  || fail "step $first took from $(elapsed_of $((first - 1))) to $(elapsed_of "$first") s elapsed, not over 1 s: make the model larger"
timeout_s=$(awk -v a="$(elapsed_of $((first - 1)))" -v b="$(elapsed_of "$first")" 'BEGIN { printf "%d", 2 * (b - a) + 2.999 }')

stop INT run1b.log 75 "$carry" launch --cluster "$tmp/cluster.textproto" --hostfile "$tmp/hostfile" "$tmp/run.textproto"
grep -q "resumed from $tmp/ck at step $first" "$tmp/run1b.log" || fail "run 1b did not resume at step $first"
first=$(latest_step)

stop HUP run2.log 75 env CARRY_SKIP_SETUP=1 CARRY_BUILD_DIR="$build" "$root/launcher/train" "$tmp/run.textproto"
grep -q "resumed from $tmp/ck at step $first" "$tmp/run2.log" || fail "run 2 did not resume at step $first"
grep -q "warning: mpirun runs with odls_base_sigkill_timeout" "$tmp/run2.log" && fail "launcher/train's ranks warn about mpirun"

stop TERM run3.log 1 mpirun --quiet --oversubscribe -np 2 --mca odls_base_sigkill_timeout "$timeout_s" "$carry" train "$tmp/run.textproto"
warned=$(grep -c "carry train: warning: mpirun runs with odls_base_sigkill_timeout $timeout_s: a SIGTERM or SIGINT" "$tmp/run3.log")
if [ "$timeout_s" -lt 30 ]; then
  [ "$warned" = 1 ] || fail "a plain mpirun with odls_base_sigkill_timeout $timeout_s: rank 0 did not warn once"
else
  [ "$warned" = 0 ] || fail "a plain mpirun with odls_base_sigkill_timeout $timeout_s: rank 0 warned"
fi
echo "mpirun -np 2: carry launch SIGTERM and SIGINT, launcher/train SIGHUP -> exit 75; a plain mpirun given odls_base_sigkill_timeout $timeout_s, SIGTERM -> a checkpoint"
