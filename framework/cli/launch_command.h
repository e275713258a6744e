// `carry launch --cluster CLUSTER.textproto RUN.textproto [--set a.b=v ...] [--hostfile PATH]
// [--carry PATH] [--dry-run]`: loads both configs, places dp*sp ranks on the cluster's hosts
// (framework/launch/launch_plan.h), writes the hostfile, prints the mpirun command line and runs it (exec).
// --dry-run prints the hostfile and the command line and writes and runs nothing.
#pragma once

namespace carry {
int run_launch_command(int argc, char** argv);  // argv[0] = "launch"
}  // namespace carry
