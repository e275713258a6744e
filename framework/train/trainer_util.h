// Small helpers shared by the trainer's files (trainer.cpp, trainer_step.cpp, trainer_checkpoint.cpp,
// trainer_run.cpp): clocks, memory and number formatting, the stop signals' flag. Internal to
// framework/train.
#pragma once

#include "framework/config/config.h"
#include "parallel/state_scan.h"

#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <string>
#include <unistd.h>

namespace carry::trainer_util {

inline double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Resident set size of this process in MiB (Linux /proc/self/statm), 0 if unreadable.
inline double rss_mib() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return 0;
  long pages_total = 0, pages_resident = 0;
  int got = std::fscanf(f, "%ld %ld", &pages_total, &pages_resident);
  std::fclose(f);
  if (got != 2) return 0;
  return static_cast<double>(pages_resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / (1024.0 * 1024.0);
}

inline parallel::ScanMode scan_mode_of(config::ParallelConfig::ScanMode m) {
  switch (m) {
    case config::ParallelConfig::TREE: return parallel::ScanMode::tree;
    case config::ParallelConfig::ALLGATHER: return parallel::ScanMode::allgather;
    default: return parallel::ScanMode::ordered;
  }
}

inline std::string gib(double bytes) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

// A value for a message: NaN without a sign, else as printed by %g.
inline std::string number_text(double x) {
  if (std::isnan(x)) return "NaN";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

// Seconds since the Unix epoch (the metrics' timestamps).
inline double wall_clock_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// "45s", "12m05s", "3h07m", "2d04h".
inline std::string duration_text(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const long long s = std::llround(seconds);
  char buf[32];
  if (s < 60) std::snprintf(buf, sizeof buf, "%llds", s);
  else if (s < 3600) std::snprintf(buf, sizeof buf, "%lldm%02llds", s / 60, s % 60);
  else if (s < 86400) std::snprintf(buf, sizeof buf, "%lldh%02lldm", s / 3600, s % 3600 / 60);
  else std::snprintf(buf, sizeof buf, "%lldd%02lldh", s / 86400, s % 86400 / 3600);
  return buf;
}

// The stop signal received while Trainer::run's handlers are installed (SIGTERM, SIGINT, SIGHUP, SIGUSR1), or 0.
int stop_signal();

}  // namespace carry::trainer_util
