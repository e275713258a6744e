// `carry mixer --sp-mode` under mpirun (CTest runs carry_mpi_tests with 1, 2 and 4 ranks; its main
// is in tests/parallel/state_scan_test_mpi.cpp). For every family with a state summary and every
// scan mode, the file the sequence-parallel command writes on rank 0 holds the same tensors as the
// serial command's file (run in-process on rank 0): o, final_state.*, d<input> for every input and
// dinitial_state.*, bit for bit for ordered and within 1e-12 (fp64, max-norm relative) for tree and
// allgather; other ranks print nothing. Errors (T not a multiple of P·chunk_size, usage errors, a
// file missing on one rank, a write failing on rank 0) give every rank the same message and exit
// code, printed once by rank 0, without hanging. Every rank agrees on each verdict.
#include "framework/cli/mixer_command.h"
#include "framework/io/safetensors.h"
#include "parallel/process_group.h"
#include "tests/helpers/temp_dir.h"
#include "tests/helpers/mixer_testing.h"

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>

namespace carry::testing {
namespace {

int world_rank() { return parallel::world_info().rank; }
int world_size() { return parallel::world_info().size; }

bool all_ranks(bool ok) {
  int mine = ok ? 0 : 1, any = 0;
  MPI_Allreduce(&mine, &any, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return any == 0;
}

double max_over_ranks(double x) {
  double y = 0;
  MPI_Allreduce(&x, &y, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return y;
}

// Whether every rank holds the same string.
bool same_on_every_rank(const std::string& s) {
  int64_t h = static_cast<int64_t>(std::hash<std::string>{}(s) >> 1), lo = 0, hi = 0;
  MPI_Allreduce(&h, &lo, 1, MPI_INT64_T, MPI_MIN, MPI_COMM_WORLD);
  MPI_Allreduce(&h, &hi, 1, MPI_INT64_T, MPI_MAX, MPI_COMM_WORLD);
  return lo == hi;
}

// A directory every rank names the same: made by rank 0, its path broadcast; rank 0 removes it at
// exit.
const std::string& shared_dir() {
  struct Dir {
    std::string path;
    bool owner = false;
    Dir() {
      char buf[512] = {0};
      owner = world_rank() == 0;
      if (owner) std::snprintf(buf, sizeof buf, "%s", make_temp_dir("carry_mixer_sp").c_str());
      MPI_Bcast(buf, sizeof buf, MPI_CHAR, 0, MPI_COMM_WORLD);
      path = buf;
    }
    ~Dir() {
      if (owner) remove_tree(path);
    }
  };
  static Dir dir;
  return dir.path;
}

std::string shared_path(const std::string& name) { return shared_dir() + "/" + name; }

struct CommandRun {
  int rc = -1;
  std::string error;   // the error line the command reports (on every rank under --sp-mode)
  std::string printed;  // what this rank printed (stdout and stderr)
};

// `carry mixer <args>` in-process, MPI left initialized.
CommandRun run_command(const std::vector<std::string>& args) {
  std::vector<std::string> all = {"mixer"};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  CommandRun r;
  MixerCommandOptions opt;
  opt.finalize_mpi = false;
  opt.error = &r.error;
  ::testing::internal::CaptureStdout();
  ::testing::internal::CaptureStderr();
  r.rc = run_mixer_command(static_cast<int>(all.size()), argv.data(), opt);
  r.printed = ::testing::internal::GetCapturedStderr();
  r.printed += ::testing::internal::GetCapturedStdout();
  return r;
}

const std::vector<std::string>& kInputs = MixerInputs::names();
const char* const kModes[] = {"ordered", "tree", "allgather"};

std::vector<std::string> families_with_summary() {
  std::vector<std::string> names;
  for (auto& n : mixer_names())
    if (get_mixer(n).has_summary()) names.push_back(n);
  return names;
}

struct Config {
  bool with_state, with_do, with_dfinal, normalize;
};

// Writes the family's input file on rank 0 (every rank then sees it: barrier).
void write_input(const Mixer& m, const Config& c, const Shape& s, const MixerOptions& opt,
                 uint64_t seed, const std::string& path) {
  if (world_rank() == 0) {
    auto in = random_inputs(m, s, at::kDouble, seed);
    std::map<std::string, Tensor> file;
    for (auto n : kInputs)
      if (in.get(n).defined()) file[n] = in.get(n);
    auto zero = m.zero_state(in, opt);
    auto names = state_entry_names(m, zero.size());
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed + 1);
    if (c.with_state) {
      State init = random_state(m, in, opt, seed + 2);
      for (size_t i = 0; i < init.size(); ++i) file["initial_state." + names[i]] = init[i];
    }
    if (c.with_do) {
      auto o = m.chunkwise(in, {}, opt).o;  // for its shape
      file["do"] = at::randn(o.sizes(), gen, o.options());
    }
    if (c.with_dfinal)
      for (size_t i = 0; i < zero.size(); ++i)
        file["dfinal_state." + names[i]] = at::randn(zero[i].sizes(), gen, zero[i].options());
    save_safetensors(path, file);
  }
  MPI_Barrier(MPI_COMM_WORLD);
}

TEST(MixerCommandSp, WritesTheSerialFileForEveryFamilyAndMode) {
  const int P = world_size(), rank = world_rank();
  const std::vector<Config> configs = {
      {true, true, true, true},     // initial state, do and dfinal_state, --normalize
      {false, false, true, false},  // gradients from dfinal_state alone (no do), zero state
      {true, false, false, false},  // forward only
  };
  Shape s;
  s.B = 2, s.T = 128, s.H = 2, s.dk = 8, s.dv = 6, s.offset = 64;
  const int64_t C = 16;  // P·C divides T for P = 1, 2, 4
  for (auto& family : families_with_summary()) {
    const Mixer& m = get_mixer(family);
    double worst_out = 0, worst_grad = 0;  // tree/allgather against serial, rank 0
    bool ordered_bitwise = true;
    for (size_t ci = 0; ci < configs.size(); ++ci) {
      const Config& c = configs[ci];
      SCOPED_TRACE(family + " config " + std::to_string(ci));
      MixerOptions opt;
      opt.chunk_size = C;
      opt.offset = s.offset;
      opt.normalize = c.normalize;
      std::string stem = family + "_" + std::to_string(ci);
      std::string input = shared_path(stem + "_in.safetensors");
      write_input(m, c, s, opt, 1000 + 10 * ci, input);
      std::vector<std::string> args = {"--family", family, "--input", input, "--chunk-size",
                                       std::to_string(C), "--offset", std::to_string(s.offset)};
      if (c.normalize) args.push_back("--normalize");

      // The serial command, on rank 0 only (no MPI involved).
      std::map<std::string, Tensor> serial;
      bool ok = true;
      if (rank == 0) {
        auto a = args;
        a.insert(a.end(), {"--output", shared_path(stem + "_serial.safetensors")});
        CommandRun r = run_command(a);
        EXPECT_EQ(r.rc, 0) << r.printed;
        ok = ok && r.rc == 0;
        if (r.rc == 0) serial = load_safetensors(shared_path(stem + "_serial.safetensors"));
        // With do every input's gradient is nonzero, so that equality proves something.
        if (c.with_do)
          for (auto n : kInputs)
            if (serial.count(std::string("d") + n)) {
              bool nonzero = serial.at(std::string("d") + n).abs().max().item<double>() > 0;
              EXPECT_TRUE(nonzero) << "d" << n << " is all zeros";
              ok = ok && nonzero;
            }
      }
      EXPECT_TRUE(all_ranks(ok)) << "the serial command failed on rank 0";

      for (auto mode : kModes) {
        SCOPED_TRACE(std::string("--sp-mode ") + mode);
        std::string output = shared_path(stem + "_" + mode + ".safetensors");
        auto a = args;
        a.insert(a.end(), {"--output", output, "--sp-mode", mode});
        CommandRun r = run_command(a);
        bool mine = r.rc == 0 && r.printed.empty();
        EXPECT_EQ(r.rc, 0) << "rank " << rank << ": " << r.error;
        EXPECT_EQ(r.printed, "") << "rank " << rank << " printed something";
        if (rank == 0 && r.rc == 0 && !serial.empty()) {
          std::map<std::string, std::string> meta;
          auto got = load_safetensors(output, &meta);
          EXPECT_EQ(meta["sp_mode"], mode);
          EXPECT_EQ(meta["sp_ranks"], std::to_string(P));
          EXPECT_EQ(meta["form"], "chunkwise");
          EXPECT_EQ(got.size(), serial.size()) << "the two files hold different tensors";
          mine = mine && got.size() == serial.size();
          for (auto& [name, want] : serial) {
            bool has = got.count(name) > 0;
            EXPECT_TRUE(has) << "the sp command did not write " << name;
            if (!has) {
              mine = false;
              continue;
            }
            const Tensor& t = got.at(name);
            bool same_layout = t.scalar_type() == want.scalar_type() && t.sizes() == want.sizes();
            EXPECT_TRUE(same_layout) << name << ": " << t.sizes() << " vs " << want.sizes();
            if (!same_layout) {
              mine = false;
              continue;
            }
            // The gradient of an input without T (decay_rate) is the ranks' sum, whose rounding
            // depends on the cut: equal to rounding in every mode.
            const bool summed = name[0] == 'd' &&
                                std::find(kInputs.begin(), kInputs.end(), name.substr(1)) != kInputs.end() &&
                                !MixerInputs::per_token(name.substr(1));
            if (std::string(mode) == "ordered" && !summed) {
              bool eq = at::equal(t, want);
              EXPECT_TRUE(eq) << name << " differs from the serial run's (ordered must be bitwise)"
                              << "; rel err " << rel_err(t, want);
              mine = mine && eq;
              ordered_bitwise = ordered_bitwise && eq;
            } else {
              double e = rel_err(t, want);
              EXPECT_LE(e, 1e-12) << name;
              mine = mine && e <= 1e-12;
              double& worst = name[0] == 'd' ? worst_grad : worst_out;
              worst = std::max(worst, e);
            }
          }
        }
        EXPECT_TRUE(all_ranks(mine)) << "some rank failed (see its lines)";
      }
    }
    worst_out = max_over_ranks(worst_out);
    worst_grad = max_over_ranks(worst_grad);
    if (rank == 0)
      std::cout << "[ errors   ] carry mixer --sp-mode " << family << " np=" << P
                << ": ordered bitwise " << (ordered_bitwise ? "yes" : "NO")
                << "; tree/allgather vs serial: outputs " << worst_out << " gradients "
                << worst_grad << "\n";
  }
}

// Expects rc and an error line containing every part, the same on every rank, printed by rank 0
// alone (one line), and no output file.
void expect_agreed_error(const CommandRun& r, int rc, const std::vector<std::string>& parts,
                         const std::string& output) {
  const int rank = world_rank();
  bool ok = r.rc == rc && r.error.rfind("carry mixer: ", 0) == 0;
  EXPECT_EQ(r.rc, rc) << "rank " << rank << ": " << r.error;
  for (auto& p : parts) {
    bool has = r.error.find(p) != std::string::npos;
    EXPECT_TRUE(has) << "rank " << rank << ": missing '" << p << "' in: " << r.error;
    ok = ok && has;
  }
  bool same = same_on_every_rank(r.error + "#" + std::to_string(r.rc));
  EXPECT_TRUE(same) << "the ranks' errors differ; rank " << rank << " has: " << r.error;
  std::string want_printed = rank == 0 ? r.error + "\n" : "";
  EXPECT_EQ(r.printed, want_printed) << "rank " << rank;
  ok = ok && same && r.printed == want_printed;
  if (rank == 0) {
    bool written = exists(output);
    EXPECT_FALSE(written) << "an output was written despite the error";
    ok = ok && !written;
    std::cout << "[ message  ] " << r.error << "\n";
  }
  EXPECT_TRUE(all_ranks(ok)) << "some rank did not get the expected error (see its lines)";
}

TEST(MixerCommandSp, ErrorsAreTheSameOnEveryRankAndNothingHangs) {
  const int P = world_size(), rank = world_rank();
  const Mixer& m = get_mixer("gla");
  Shape s;
  s.B = 1, s.T = 64, s.H = 1, s.dk = 4, s.dv = 3;
  MixerOptions opt;
  opt.chunk_size = 16;
  // T = 64 is a multiple of P·16 for P = 1, 2, 4 but not of P·48.
  std::string input = shared_path("err_in.safetensors"), output = shared_path("err_out.safetensors");
  write_input(m, {true, true, true, false}, s, opt, 77, input);
  std::vector<std::string> base = {"--family", "gla", "--input", input, "--output", output};
  auto with = [&](std::vector<std::string> extra) {  // chunk size 16 unless given
    auto a = base;
    a.insert(a.end(), extra.begin(), extra.end());
    if (std::find(a.begin(), a.end(), "--chunk-size") == a.end()) a.insert(a.end(), {"--chunk-size", "16"});
    return a;
  };
  {
    SCOPED_TRACE("T not a multiple of P·chunk_size");
    std::string need = "the sequence length T=64 must be a multiple of sp·chunk_size = " +
                       std::to_string(P) + "·48 = " + std::to_string(P * 48);
    expect_agreed_error(run_command(with({"--sp-mode", "tree", "--chunk-size", "48"})), 2,
                        {input, need}, output);
  }
  {
    SCOPED_TRACE("naive form");
    expect_agreed_error(run_command(with({"--sp-mode", "ordered", "--form", "naive"})), 2,
                        {"--form naive cannot be used with --sp-mode", "see carry mixer --help"},
                        output);
  }
  {
    SCOPED_TRACE("bad mode");
    expect_agreed_error(run_command(with({"--sp-mode=fast"})), 2,
                        {"--sp-mode must be ordered, tree or allgather, got 'fast'"}, output);
  }
  {
    SCOPED_TRACE("family without a state");
    expect_agreed_error(run_command({"--family", "softmax_attn", "--input", input, "--output", output,
                                     "--sp-mode", "allgather", "--chunk-size", "16"}),
                        2, {"--sp-mode: softmax_attn has no recurrent state", "gla"}, output);
  }
  {
    SCOPED_TRACE("the input missing on the last rank only");
    auto a = with({"--sp-mode", "ordered"});
    if (rank == P - 1) a[3] = input + ".missing";
    std::vector<std::string> parts = {input + ".missing: cannot open"};
    if (P > 1) parts.push_back("rank " + std::to_string(P - 1) + ": ");
    expect_agreed_error(run_command(a), 1, parts, output);
  }
  {
    SCOPED_TRACE("the write failing on rank 0");
    std::string bad = shared_path("no_such_dir/out.safetensors");
    auto a = with({"--sp-mode", "tree"});
    a[5] = bad;
    std::vector<std::string> parts = {bad};
    if (P > 1) parts.push_back("rank 0: ");
    expect_agreed_error(run_command(a), 1, parts, bad);
  }
  {
    SCOPED_TRACE("do of the wrong shape");
    std::string bad_in = shared_path("err_do.safetensors");
    if (rank == 0) {
      auto file = load_safetensors(input);
      file["do"] = file.at("do").narrow(1, 0, 16);
      save_safetensors(bad_in, file);
    }
    MPI_Barrier(MPI_COMM_WORLD);
    auto a = with({"--sp-mode", "allgather"});
    a[3] = bad_in;
    expect_agreed_error(run_command(a), 1,
                        {"'do' must have the shape of o [1, 64, 1, 3], found [1, 16, 1, 3]"}, output);
  }
}

TEST(MixerCommandSp, HelpIsPrintedByRankZeroOnly) {
  CommandRun r = run_command({"--sp-mode", "tree", "--help"});
  bool ok = r.rc == 0 && (world_rank() == 0 ? r.printed.find("--sp-mode M") != std::string::npos
                                            : r.printed.empty());
  EXPECT_TRUE(ok) << "rank " << world_rank() << " printed: " << r.printed;
  EXPECT_TRUE(all_ranks(ok));
}

}  // namespace
}  // namespace carry::testing
