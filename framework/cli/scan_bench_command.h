// `carry scan-bench`: sequence parallelism measured. Under mpirun with P ranks (one GPU a rank, NCCL;
// or CPU ranks, MPI), for each family and scan mode: the P-rank forward of one long sequence against
// the 1-rank (serial) chunkwise run of the same sequence (max relative error, and whether ordered is
// bitwise equal), and the time of the whole sequence-parallel forward against the local chunkwise
// forward of one slice, so the cost of the scan is visible. Rank 0 prints one row per family and mode.
#pragma once

namespace carry {
int run_scan_bench_command(int argc, char** argv);  // argv[0] is "scan-bench"
}  // namespace carry
