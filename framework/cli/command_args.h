// The argument reader of every `carry` subcommand. A flag's value comes as the next argument
// ("--out DIR") or after '=' ("--out=DIR"); the next argument is taken whatever it looks like, so
// "--window -3" reads -3 (and "--flag=--x" gives a value that starts with "--"). Flags may repeat
// (the command decides: "--set a=1 --set b=2" collects both), a flag may take several arguments up
// to the next "--" flag (values()), and a switch given "=value" is refused. Every mistake is a
// UsageError whose one-line message names the flag and what it needs; the command prints it (most
// with their usage) and exits 2 (`carry env` exits 1).
//
//   CommandArgs args(argc, argv);
//   if (args.help()) { ...print the usage, return 0... }
//   for (std::string f; args.next(f);) {
//     if (f == "--out") out = args.value(f);
//     else if (f == "--steps") steps = args.integer(f, 1);
//     else if (f == "--cpu") cpu = true;  // a switch: "--cpu=x" is refused by the next next()
//     else if (f.rfind("-", 0) == 0) throw UsageError("unknown flag '" + f + "'");
//     else positional = f;
//   }
#pragma once

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace carry {

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// "a,b,c" -> {"a", "b", "c"} (empty items kept: "a,,b" has three; "" has none).
inline std::vector<std::string> split_list(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string x; std::getline(ss, x, ',');) out.push_back(x);
  return out;
}

class CommandArgs {
 public:
  // argv[0] is the command's name.
  CommandArgs(int argc, char** argv) : args_(argv + 1, argv + argc) {}

  // Whether any argument is --help or -h.
  bool help() const { return has("--help") || has("-h"); }
  // Whether any argument is `flag` or `flag=...` (looked at before the walk, e.g. to choose how to
  // report errors).
  bool has(const std::string& flag) const {
    for (const auto& a : args_)
      if (a == flag || a.rfind(flag + "=", 0) == 0) return true;
    return false;
  }

  // Walks the arguments: next() gives the flag ("--name" of "--name=value") or the positional
  // argument, false at the end. A value given with '=' that the command did not read (a switch)
  // is a UsageError here.
  bool next(std::string& arg) {
    if (has_pending_) throw UsageError(flag_ + " takes no value, got '" + flag_ + "=" + pending_ + "'");
    if (i_ >= args_.size()) return false;
    arg = args_[i_++];
    auto eq = arg.find('=');
    if (arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      pending_ = arg.substr(eq + 1);
      has_pending_ = true;
      arg = arg.substr(0, eq);
    }
    flag_ = arg;
    return true;
  }
  // The value of the flag just read: after its '=', else the next argument.
  std::string value(const std::string& flag) {
    if (has_pending_) {
      has_pending_ = false;
      return pending_;
    }
    if (i_ >= args_.size()) throw UsageError(flag + " needs a value");
    return args_[i_++];
  }
  // The values of a flag that takes several: the one after '=' (if any), then every following
  // argument up to the next one that starts with "--". May be empty.
  std::vector<std::string> values() {
    std::vector<std::string> out;
    if (has_pending_) {
      has_pending_ = false;
      out.push_back(pending_);
    }
    while (i_ < args_.size() && args_[i_].rfind("--", 0) != 0) out.push_back(args_[i_++]);
    return out;
  }
  // A comma-separated list (split_list of the value).
  std::vector<std::string> list(const std::string& flag) { return split_list(value(flag)); }

  // An integer >= min.
  int64_t integer(const std::string& flag, int64_t min) {
    std::string v = value(flag);
    int64_t x = 0;
    if (!to_integer(v, min, x))
      throw UsageError(flag + " needs an integer >= " + std::to_string(min) + ", got '" + v + "'");
    return x;
  }
  // A comma-separated list of integers >= min.
  std::vector<int64_t> integers(const std::string& flag, int64_t min) {
    std::string v = value(flag);
    std::vector<int64_t> out;
    for (const auto& item : split_list(v)) {
      int64_t x = 0;
      if (!to_integer(item, min, x))
        throw UsageError(flag + " needs a comma-separated list of integers >= " + std::to_string(min) + ", got '" +
                         v + "'");
      out.push_back(x);
    }
    return out;
  }
  // A finite number.
  double number(const std::string& flag) {
    std::string v = value(flag);
    double x = 0;
    if (!to_number(v, x)) throw UsageError(flag + " needs a finite number, got '" + v + "'");
    return x;
  }
  // A finite number > 0.
  double positive_number(const std::string& flag) {
    std::string v = value(flag);
    double x = 0;
    if (!to_number(v, x) || !(x > 0)) throw UsageError(flag + " needs a positive number, got '" + v + "'");
    return x;
  }

 private:
  static bool to_integer(const std::string& v, int64_t min, int64_t& x) {
    char* end = nullptr;
    errno = 0;
    long long r = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end || errno || r < min) return false;
    x = r;
    return true;
  }
  static bool to_number(const std::string& v, double& x) {
    char* end = nullptr;
    errno = 0;
    x = std::strtod(v.c_str(), &end);
    return !v.empty() && !*end && errno != ERANGE && std::isfinite(x);
  }

  std::vector<std::string> args_;
  size_t i_ = 0;
  std::string flag_;     // the last argument next() gave
  std::string pending_;  // its value after '=', while has_pending_
  bool has_pending_ = false;
};

}  // namespace carry
