// `carry launch` (see launch_command.h): the arguments (CommandArgs), loading the configs, writing the
// hostfile (POSIX calls, not std::filesystem: libtorch exports conflicting symbols), and running mpirun
// as a child in its own session: a stop signal to carry launch (SIGTERM, SIGINT, SIGHUP, SIGUSR1)
// becomes SIGUSR1 to mpirun, which forwards it to every rank (SIGTERM or SIGINT to mpirun itself kills
// the ranks a second later, with nothing saved); carry launch exits with mpirun's status (75 after a
// stop with a checkpoint).
#include "framework/cli/launch_command.h"
#include "layers/core/knobs.h"

#include "framework/cli/command_args.h"
#include "framework/cli/error_text.h"
#include "framework/config/config.h"
#include "framework/io/output_file.h"
#include "framework/launch/launch_plan.h"

#include <csignal>
#include <cstdlib>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

namespace carry {

namespace {

const char* kUsage =
    "usage: carry launch --cluster CLUSTER.textproto RUN.textproto [--set field.path=value ...]\n"
    "                    [--hostfile PATH] [--carry PATH] [--dry-run]\n"
    "       carry launch --slurm --cluster CLUSTER.textproto RUN.textproto [--set ...] [--output JOB.sbatch] [--carry PATH]\n"
    "  Starts `carry train RUN` on the cluster's hosts with mpirun, one rank a GPU (dp*sp ranks of the\n"
    "  resolved run config, filled host by host so that an sp group stays on one host). Writes the\n"
    "  hostfile (default runs/launch/<run name>.hostfile), prints the mpirun command line and runs it;\n"
    "  SIGTERM, SIGINT, SIGHUP or SIGUSR1 to carry launch stops the run with a checkpoint (exit 75).\n"
    "  --set       overrides a run config field (repeatable; also passed on to carry train)\n"
    "  --hostfile  where to write the hostfile\n"
    "  --carry     the carry binary the ranks run (default: this one)\n"
    "  --dry-run   print the hostfile and the command line; write and run nothing\n"
    "  --slurm     write an sbatch script instead (default runs/launch/<run name>.sbatch; --output PATH)\n"
    "              that runs the ranks with srun, no MPI (the cluster's hosts: how many nodes and GPUs a\n"
    "              node; its slurm { } block: partition, account, time_limit, ...); submit it with sbatch\n";

// The path of the running executable (/proc/self/exe), or "carry" when it cannot be read.
std::string self_executable() {
  std::vector<char> buf(4096);
  ssize_t n = ::readlink("/proc/self/exe", buf.data(), buf.size() - 1);
  if (n <= 0) return "carry";
  return std::string(buf.data(), static_cast<size_t>(n));
}

// mkdir -p of the directory part of `path`; throws ConfigError naming the directory on failure.
void make_parent_dirs(const std::string& path) {
  auto slash = path.find_last_of('/');
  if (slash == std::string::npos || slash == 0) return;
  std::string dir = path.substr(0, slash);
  for (size_t i = 1; i <= dir.size(); ++i) {
    if (i < dir.size() && dir[i] != '/') continue;
    std::string part = dir.substr(0, i);
    if (::mkdir(part.c_str(), 0755) != 0 && errno != EEXIST)
      throw ConfigError("cannot create directory " + part + " for " + path + ": " + std::strerror(errno));
  }
}

// Written through no link and into no FIFO (write_whole_file); `what` names the file in messages.
void write_file(const std::string& path, const std::string& text, const std::string& what) {
  make_parent_dirs(path);
  write_whole_file(path, text, what);
}

volatile std::sig_atomic_t g_stop_requests = 0;
volatile std::sig_atomic_t g_mpirun_pid = 0;

extern "C" void forward_stop(int) {
  g_stop_requests = g_stop_requests + 1;
  if (g_mpirun_pid > 0) ::kill(static_cast<pid_t>(g_mpirun_pid), SIGUSR1);
}

// Runs argv (mpirun) in its own session and waits for it, turning each stop signal into SIGUSR1 to it.
// Returns its exit status (128 + n when a signal ended it), or 127 when it cannot be started.
int run_forwarding_stops(const std::vector<std::string>& argv) {
  std::vector<char*> exec_argv;
  for (auto& a : argv) exec_argv.push_back(const_cast<char*>(a.c_str()));
  exec_argv.push_back(nullptr);
  const int kStops[] = {SIGTERM, SIGINT, SIGHUP, SIGUSR1};
  struct sigaction sa {};
  sa.sa_handler = forward_stop;
  sigemptyset(&sa.sa_mask);
  for (int s : kStops) ::sigaction(s, &sa, nullptr);
  // The stop signals wait (blocked) until the handler knows mpirun's pid: one signal, one SIGUSR1.
  sigset_t stops, previous;
  sigemptyset(&stops);
  for (int s : kStops) sigaddset(&stops, s);
  ::sigprocmask(SIG_BLOCK, &stops, &previous);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::sigprocmask(SIG_SETMASK, &previous, nullptr);
    std::fprintf(stderr, "carry launch: cannot start %s: %s\n", exec_argv[0], std::strerror(errno));
    return 127;
  }
  if (pid == 0) {
    for (int s : kStops) std::signal(s, SIG_DFL);
    ::sigprocmask(SIG_SETMASK, &previous, nullptr);
    ::setsid();  // a Ctrl-C at the terminal reaches carry launch only
    ::prctl(PR_SET_PDEATHSIG, SIGTERM);  // carry launch killed outright: mpirun ends the ranks
    if (::getppid() != parent) ::_exit(1);
    ::execvp(exec_argv[0], exec_argv.data());
    std::fprintf(stderr, "carry launch: cannot run %s: %s\n", exec_argv[0], std::strerror(errno));
    ::_exit(127);
  }
  g_mpirun_pid = pid;
  ::sigprocmask(SIG_SETMASK, &previous, nullptr);
  int said = 0, status = 0;
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, 0);
    if (g_stop_requests > said) {
      std::fprintf(stderr, said == 0 ? "carry launch: stop requested: every rank finishes its step and writes a "
                                       "checkpoint (exit 75; a second signal ends at once)\n"
                                     : "carry launch: second stop signal: ending at once\n");
      said = g_stop_requests;
    }
    if (r == pid) break;
    if (r < 0 && errno != EINTR) {
      std::fprintf(stderr, "carry launch: cannot wait for %s: %s\n", exec_argv[0], std::strerror(errno));
      return 1;
    }
  }
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  if (rc == 75) std::fprintf(stderr, "carry launch: stopped with a checkpoint (exit 75); the same command resumes\n");
  else if (rc > 128) std::fprintf(stderr, "carry launch: mpirun ended on signal %d\n", rc - 128);
  else if (rc != 0) std::fprintf(stderr, "carry launch: a rank failed (mpirun exit %d); its message is above\n", rc);
  return rc;
}

int usage_error(const std::string& message) {
  std::fprintf(stderr, "carry launch: %s\n%s", message.c_str(), kUsage);
  return 2;
}

}  // namespace

int run_launch_command(int argc, char** argv) {
  std::string cluster_path, run_path, hostfile, carry_binary, sbatch_output;
  std::vector<std::string> overrides;
  bool dry_run = false, slurm = false;
  CommandArgs args(argc, argv);
  if (args.help()) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  try {
    for (std::string a; args.next(a);) {
      if (a == "--set") overrides.push_back(args.value(a));
      else if (a == "--cluster") cluster_path = args.value(a);
      else if (a == "--hostfile") hostfile = args.value(a);
      else if (a == "--carry") carry_binary = args.value(a);
      else if (a == "--dry-run") dry_run = true;
      else if (a == "--slurm") slurm = true;
      else if (a == "--output") sbatch_output = args.value(a);
      else if (a.rfind("-", 0) == 0) throw UsageError("unknown flag '" + a + "'");
      else if (run_path.empty()) run_path = a;
      else throw UsageError("one run config expected, got '" + run_path + "' and '" + a + "'");
    }
  } catch (const UsageError& e) {
    return usage_error(e.what());
  }
  if (cluster_path.empty()) return usage_error("--cluster CLUSTER.textproto is needed");
  if (run_path.empty()) return usage_error("a run config RUN.textproto is needed");
  if (!sbatch_output.empty() && !slurm) return usage_error("--output names the sbatch script of --slurm");
  if (slurm && (dry_run || !hostfile.empty())) return usage_error("--slurm writes a script and runs nothing; --dry-run and --hostfile are for mpirun");

  LaunchPlan plan;
  LaunchOptions options;
  options.cluster_path = cluster_path;
  options.hostfile_path = hostfile.empty() ? default_hostfile_path(run_path) : hostfile;
  options.carry_binary = carry_binary.empty() ? self_executable() : carry_binary;
  options.allow_run_as_root = ::geteuid() == 0;
  options.forward_ld_library_path = knob_value("LD_LIBRARY_PATH") != nullptr;
  if (slurm) {
    options.sbatch_path = sbatch_output.empty() ? default_sbatch_path(run_path) : sbatch_output;
    try {
      ClusterConfig cluster = load_cluster_config(cluster_path);
      RunConfig run = load_run_config(run_path, overrides);
      std::vector<std::string> notes;
      const std::string script = make_sbatch_script(cluster, run, run_path, overrides, options, &notes);
      for (auto& note : notes) std::fprintf(stderr, "carry launch: %s\n", note.c_str());
      write_file(options.sbatch_path, script, "the sbatch script");
      ::chmod(options.sbatch_path.c_str(), 0755);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "carry launch: %s\n", error_text(e).c_str());
      return 1;
    }
    std::printf("carry launch: wrote %s; submit it with: sbatch %s\n", options.sbatch_path.c_str(),
                shell_quote(options.sbatch_path).c_str());
    return 0;
  }
  try {
    ClusterConfig cluster = load_cluster_config(cluster_path);
    RunConfig run = load_run_config(run_path, overrides);
    plan = make_launch_plan(cluster, run, run_path, overrides, options);
    for (auto& note : plan.notes) std::fprintf(stderr, "carry launch: %s\n", note.c_str());
    if (dry_run) {
      std::printf("hostfile %s:\n%s%s\n", options.hostfile_path.c_str(), plan.hostfile.c_str(),
                  shell_join(plan.argv).c_str());
      return 0;
    }
    write_file(options.hostfile_path, plan.hostfile, "the hostfile");
  } catch (const std::exception& e) {
    std::fprintf(stderr, "carry launch: %s\n", error_text(e).c_str());
    return 1;
  }
  std::printf("%s\n", shell_join(plan.argv).c_str());
  std::fflush(stdout);
  std::fflush(stderr);
  return run_forwarding_stops(plan.argv);
}

}  // namespace carry
