// Argument reading shared by the commands that use a trained model (eval, generate, export, import):
// flags with one value ("--out DIR" or "--out=DIR"), switches, one positional argument; every mistake
// is a UsageError whose message names the flag and what it needs (the command prints it with its
// usage and exits 2).
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

namespace carry {

class UsageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class CommandArgs {
 public:
  // argv[0] is the command's name.
  CommandArgs(int argc, char** argv) : args_(argv + 1, argv + argc) {}

  bool help() const {
    for (const auto& a : args_)
      if (a == "--help" || a == "-h") return true;
    return false;
  }
  // Walks the arguments: next() gives the flag or positional argument (false at the end).
  bool next(std::string& arg) {
    if (i_ >= args_.size()) return false;
    arg = args_[i_++];
    pending_.clear();
    auto eq = arg.find('=');
    if (arg.rfind("--", 0) == 0 && eq != std::string::npos) {
      pending_ = arg.substr(eq + 1);
      has_pending_ = true;
      arg = arg.substr(0, eq);
    } else {
      has_pending_ = false;
    }
    return true;
  }
  // The value of the flag just read.
  std::string value(const std::string& flag) {
    if (has_pending_) {
      has_pending_ = false;
      return pending_;
    }
    if (i_ >= args_.size()) throw UsageError(flag + " needs a value");
    return args_[i_++];
  }
  int64_t integer(const std::string& flag, int64_t min) {
    std::string v = value(flag);
    char* end = nullptr;
    errno = 0;
    long long x = std::strtoll(v.c_str(), &end, 10);
    if (v.empty() || *end || errno || x < min)
      throw UsageError(flag + " needs an integer >= " + std::to_string(min) + ", got '" + v + "'");
    return x;
  }
  double number(const std::string& flag) {
    std::string v = value(flag);
    char* end = nullptr;
    double x = std::strtod(v.c_str(), &end);
    if (v.empty() || *end || !(x == x) || x - x != 0) throw UsageError(flag + " needs a finite number, got '" + v + "'");
    return x;
  }

 private:
  std::vector<std::string> args_;
  size_t i_ = 0;
  std::string pending_;
  bool has_pending_ = false;
};

}  // namespace carry
