# Sourced by the tests of the ncu CSV readers (ncu_breakdown_test.sh, ncu_kernel_sum_test.sh): a scratch
# directory removed on exit, fail NAME MESSAGE, and the lines of a made-up `ncu --csv` run.
# ncu_csv_test NAME: sets root and dir, and fail() to print "NAME: FAILED: ..." and exit 1.
ncu_csv_test() {
  test_name=$1
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  dir=$(mktemp -d "/tmp/carry_${test_name}_XXXXXX")
  trap 'rm -rf "$dir"' EXIT
}
fail() { echo "$test_name: FAILED: $*" >&2; exit 1; }
# ncu's preamble and header line.
ncu_header() {
  echo '==PROF== Connected to process 1'
  echo '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'
}
# ncu_metric ID KERNEL METRIC UNIT VALUE: one metric row of one kernel launch.
ncu_metric() {
  echo "\"$1\",\"1\",\"carry\",\"host\",\"$2\",\"1\",\"7\",\"(128, 1, 1)\",\"(1, 1, 1)\",\"0\",\"9.0\",\"Command line profiler metrics\",\"$3\",\"$4\",\"$5\""
}
