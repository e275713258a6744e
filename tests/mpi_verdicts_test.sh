#!/usr/bin/env bash
# The MPI test harness on a test that fails on one rank (tests/mpi_verdicts_test_mpi.cpp, disabled in the
# normal suite; CTest runs this, about 20 s): each case under mpirun -np 4 must exit non-zero within 30 s
# (a communicator timeout is 60 s), print the failing rank's message and the harness's line naming the
# test and the rank, and run no test after it. Usage: mpi_verdicts_test.sh MPIEXEC BUILD_DIR
set -u
mpiexec=$1
tests=$2/bin/carry_mpi_tests
tmp=$(mktemp -d /tmp/carry_mpi_verdicts.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
failed=0

check() {  # name test want...
  local name=$1 test=$2
  shift 2
  local start=$SECONDS
  "$mpiexec" -np 4 --oversubscribe "$tests" --gtest_also_run_disabled_tests \
    --gtest_filter="MpiVerdicts.DISABLED_$test:MpiVerdicts.DISABLED_TheTestAfterTheFailure" >"$tmp/out" 2>&1
  local rc=$? took=$((SECONDS - start)) bad=""
  [ $rc != 0 ] || bad="exit 0"
  [ $took -lt 30 ] || bad="$bad; took $took s"
  for want in "$@"; do grep -qF -- "$want" "$tmp/out" || bad="$bad; no '$want'"; done
  ! grep -qF "the test after the failure ran" "$tmp/out" || bad="$bad; the next test ran"
  if [ -n "$bad" ]; then
    echo "FAIL $name: ${bad#; }"; sed 's/^/    /' "$tmp/out"; failed=1
  else
    echo "ok   $name: exit $rc after $took s: $(grep -m1 -F -- "${@: -1}" "$tmp/out")"
  fi
}

check "one rank fails, the others wait in a barrier" FailureOnOneRankLeavesTheOthersWaiting \
  "deliberate failure on rank 3 only, before the barrier" \
  "[ STOPPING ] MpiVerdicts.DISABLED_FailureOnOneRankLeavesTheOthersWaiting: rank 3 of 4 failed"
check "one rank fails, every rank finishes" FailureOnOneRankWhileAllFinish \
  "deliberate failure on rank 1 only, every rank finishing the test" \
  "[  FAILED  ] MpiVerdicts.DISABLED_FailureOnOneRankWhileAllFinish failed on rank(s) 1 of 4:"
exit $failed
