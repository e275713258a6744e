// A fuzz test of every reader of user files: run configs (also through --set overrides), model
// presets and cluster configs, safetensors files, token files and checkpoints (manifest, tensors and
// `latest`). Each input is a valid file changed by 1 to 4 random mutations (bit flips, bytes that
// matter to the format, insertions, deletions, duplications, truncation, numbers replaced by huge,
// negative or non-finite ones) from a fixed seed, so a failure is reproducible. Each reader must
// accept the input or throw its documented error type with a message that is one clear text (no C++
// backtrace, no raw control bytes); a crash fails the test, and a case taking more than 10 s aborts
// it (a hang), naming the reader and the case. About 7 s on one idle CPU core.
#include "framework/config/config.h"
#include "framework/data/token_file.h"
#include "framework/io/checkpoint.h"
#include "framework/io/safetensors.h"
#include "framework/model/model.h"
#include "tests/helpers/temp_dir.h"
#include "tests/paths.h"

#include <gtest/gtest.h>
#include <google/protobuf/descriptor.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <dirent.h>
#include <fstream>
#include <functional>
#include <iterator>
#include <random>
#include <thread>

namespace carry::testing {
namespace {

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

// Random changes to a byte string.
class Mutator {
 public:
  explicit Mutator(uint64_t seed) : rng_(seed) {}

  std::string mutate(std::string s) {
    const int n = 1 + static_cast<int>(below(4));
    for (int i = 0; i < n; ++i) s = once(std::move(s));
    return s;
  }
  uint64_t below(uint64_t n) { return n == 0 ? 0 : rng_() % n; }

 private:
  std::string once(std::string s) {
    static const std::vector<std::string> numbers = {
        "0", "-1", "1e308", "-1e308", "nan", "inf", "-inf", "99999999999999999999", "9223372036854775807",
        "-9223372036854775808", "18446744073709551615", "4294967296", "65537", "1e-320", "0x7fffffff", "1.5"};
    static const std::string special = std::string("{}[]\":,\n\\#-.0123456789eE tx") + '\0' + "\xff\x80";
    const size_t len = s.size();
    switch (below(9)) {
      case 0:  // flip a bit
        if (len) s[below(len)] ^= static_cast<char>(1 << below(8));
        break;
      case 1:  // a byte that matters to some format
        if (len) s[below(len)] = special[below(special.size())];
        break;
      case 2: {  // insert random bytes
        std::string bytes;
        for (uint64_t i = 0, k = 1 + below(8); i < k; ++i) bytes += static_cast<char>(below(256));
        s.insert(below(len + 1), bytes);
        break;
      }
      case 3:  // delete a range
        if (len) {
          size_t at = below(len);
          s.erase(at, 1 + below(std::min<size_t>(len - at, 64)));
        }
        break;
      case 4:  // duplicate a range
        if (len) {
          size_t at = below(len), n = 1 + below(std::min<size_t>(len - at, 256));
          s.insert(below(len + 1), s.substr(at, n));
        }
        break;
      case 5:  // truncate
        s.resize(below(len + 1));
        break;
      case 6: {  // replace a number with an extreme one
        std::vector<size_t> starts;
        for (size_t i = 0; i < len; ++i)
          if (std::isdigit(static_cast<unsigned char>(s[i])) && (i == 0 || !std::isalnum(static_cast<unsigned char>(s[i - 1]))))
            starts.push_back(i);
        if (starts.empty()) break;
        size_t at = starts[below(starts.size())], end = at;
        while (end < len && (std::isalnum(static_cast<unsigned char>(s[end])) || s[end] == '.' || s[end] == '-')) ++end;
        s.replace(at, end - at, numbers[below(numbers.size())]);
        break;
      }
      case 7: {  // repeat an opening bracket many times (nesting)
        size_t at = below(len + 1);
        s.insert(at, std::string(1 + below(2000), below(2) ? '{' : '['));
        break;
      }
      default:  // swap two bytes
        if (len > 1) std::swap(s[below(len)], s[below(len)]);
        break;
    }
    return s;
  }
  std::mt19937_64 rng_;
};

// A case that takes longer than this is a hang: the watchdog aborts the process, naming it.
constexpr double kCaseLimitS = 10;

class Watchdog {
 public:
  Watchdog() : thread_([this] { watch(); }) {}
  ~Watchdog() {
    done_ = true;
    thread_.join();
  }
  // A new case; `input`: the file that holds its input, if there is one (left in place on a hang).
  void start(const char* reader, int index, const char* input = "") {
    reader_ = reader, index_ = index, input_ = input;
    started_ = now();
  }

 private:
  static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  void watch() {
    while (!done_) {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      if (now() - started_ > kCaseLimitS) {
        std::fprintf(stderr, "fuzz: %s case %d has run for more than %.0f s: a hang (input: %s)\n", reader_.load(),
                     index_.load(), kCaseLimitS, *input_.load() ? input_.load() : "see the test");
        std::abort();
      }
    }
  }
  std::atomic<bool> done_{false};
  std::atomic<const char*> reader_{""};
  std::atomic<int> index_{0};
  std::atomic<const char*> input_{""};
  std::atomic<double> started_{now()};
  std::thread thread_;
};

// The verdict on one reader over its cases.
struct Tally {
  int accepted = 0, refused = 0;
  std::vector<std::string> bad;  // unexpected exception types or unclear messages
};

// A message a user can read: not empty, no backtrace, no control bytes but newlines and tabs.
std::string unclear(const std::string& m) {
  if (m.empty()) return "an empty message";
  if (m.find("frame #") != std::string::npos || m.find("Exception raised from") != std::string::npos)
    return "a C++ backtrace";
  for (unsigned char c : m)
    if ((c < 0x20 && c != '\n' && c != '\t') || c == 0x7f) return "a raw control byte";
  return "";
}

// Runs `read` on the input; E is the documented error type.
template <class E>
void judge(Tally& t, const std::string& what, const std::function<void()>& read) {
  try {
    read();
    ++t.accepted;
  } catch (const E& e) {
    std::string m;
    if constexpr (std::is_same_v<E, c10::Error>) m = e.what_without_backtrace();
    else m = e.what();
    std::string why = unclear(m);
    if (why.empty()) ++t.refused;
    else t.bad.push_back(what + ": " + why + ": " + m.substr(0, 300));
  } catch (const std::exception& e) {
    t.bad.push_back(what + ": an undocumented exception type: " + std::string(e.what()).substr(0, 300));
  }
}

void report(const char* reader, const Tally& t, int cases) {
  std::printf("[ fuzz     ] %-22s %5d cases: %5d accepted, %5d refused with a clear error, %zu bad\n", reader, cases,
              t.accepted, t.refused, t.bad.size());
  for (size_t i = 0; i < t.bad.size() && i < 5; ++i) ADD_FAILURE() << reader << ": " << t.bad[i];
  EXPECT_TRUE(t.bad.empty());
  EXPECT_GT(t.refused, 0) << reader << ": no mutation was refused: the fuzzing did not reach the reader";
}

std::vector<std::string> files_in(const std::string& dir) {
  std::vector<std::string> out;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (struct dirent* e = ::readdir(d)) {
      std::string n = e->d_name;
      if (n.size() > 10 && n.substr(n.size() - 10) == ".textproto") out.push_back(dir + "/" + n);
    }
    ::closedir(d);
  }
  std::sort(out.begin(), out.end());
  return out;
}

class ReadersFuzz : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = make_temp_dir("carry_fuzz"); }
  void TearDown() override { remove_tree(dir_); }
  std::string dir_;
  Watchdog watchdog_;
};

TEST_F(ReadersFuzz, RunConfigs) {
  const std::string configs = std::string(CARRY_SOURCE_DIR) + "/configs";
  std::vector<std::string> seeds = files_in(configs + "/runs");
  seeds.push_back(configs + "/demo_mqar.textproto");
  Mutator mutator(16);
  Tally t;
  const int cases = 10000;
  for (int i = 0; i < cases; ++i) {
    watchdog_.start("run config", i);
    const std::string& seed = seeds[mutator.below(seeds.size())];
    std::string text = mutator.mutate(read_bytes(seed));
    judge<ConfigError>(t, "case " + std::to_string(i) + " (" + seed + ")", [&] {
      // Named after the seed so that model_preset resolves as it would for the file.
      RunConfig cfg = run_config_from_text(text, seed);
      // What validation accepts must be buildable: the model's shapes (meta device, nothing allocated).
      build_model(cfg.model(), cfg.seed(), at::TensorOptions().device(at::kMeta));
    });
  }
  report("run config", t, cases);
}

TEST_F(ReadersFuzz, OverridesModelPresetsAndClusterConfigs) {
  const std::string configs = std::string(CARRY_SOURCE_DIR) + "/configs";
  const std::string demo = read_bytes(configs + "/demo_mqar.textproto");
  Mutator mutator(17);
  // --set: random field paths of the schema (with and without indices) and random values.
  std::vector<std::string> paths;
  std::function<void(const google::protobuf::Descriptor*, const std::string&, int)> walk =
      [&](const google::protobuf::Descriptor* d, const std::string& prefix, int depth) {
        for (int i = 0; i < d->field_count(); ++i) {
          auto* f = d->field(i);
          std::string p = prefix + f->name();
          paths.push_back(p);
          if (f->is_repeated()) paths.push_back(p + "[" + std::to_string(mutator.below(3)) + "]");
          if (f->message_type() && depth < 3) walk(f->message_type(), (f->is_repeated() ? p + "[0]" : p) + ".", depth + 1);
        }
      };
  walk(RunConfig::descriptor(), "", 0);
  const std::vector<std::string> values = {"", "0", "-1", "1", "7", "1e308", "nan", "-inf", "99999999999999999999",
                                           "true", "gla", "gla,softmax_attn", "TREE", "{num_kv_pairs: 8}",
                                           "{", "\"x\"", "[1,2]", "65537", "4294967297", "-9223372036854775808"};
  Tally overrides;
  const int override_cases = 3000;
  for (int i = 0; i < override_cases; ++i) {
    watchdog_.start("--set", i);
    std::vector<std::string> set;
    for (uint64_t k = 0, n = 1 + mutator.below(3); k < n; ++k) {
      std::string value = values[mutator.below(values.size())];
      if (mutator.below(4) == 0) value = mutator.mutate(value);
      set.push_back(paths[mutator.below(paths.size())] + "=" + value);
    }
    std::string shown;
    for (auto& a : set) shown += " --set '" + a + "'";
    judge<ConfigError>(overrides, "case " + std::to_string(i) + ":" + shown, [&] {
      RunConfig cfg = run_config_from_text(demo, configs + "/demo_mqar.textproto", set);
      build_model(cfg.model(), cfg.seed(), at::TensorOptions().device(at::kMeta));
    });
  }
  report("--set overrides", overrides, override_cases);

  auto fuzz_files = [&](const char* reader, const std::vector<std::string>& seeds, int cases,
                        const std::function<void(const std::string&)>& load) {
    Tally t;
    const std::string path = dir_ + "/fuzz.textproto";
    for (int i = 0; i < cases; ++i) {
      watchdog_.start(reader, i, path.c_str());
      write_bytes(path, mutator.mutate(read_bytes(seeds[mutator.below(seeds.size())])));
      judge<ConfigError>(t, "case " + std::to_string(i), [&] { load(path); });
    }
    report(reader, t, cases);
  };
  fuzz_files("model preset", files_in(configs + "/models"), 2000, [](const std::string& p) {
    ModelConfig m = load_model_config(p);
    build_model(m, 0, at::TensorOptions().device(at::kMeta));
  });
  fuzz_files("cluster config", files_in(configs + "/clusters"), 1000, [](const std::string& p) { load_cluster_config(p); });
}

TEST_F(ReadersFuzz, SafetensorsFiles) {
  const std::string seed_a = dir_ + "/a.safetensors", seed_b = dir_ + "/b.safetensors";
  save_safetensors(seed_a, {{"q", at::randn({2, 3, 4})}, {"v", at::arange(6, at::kLong).view({2, 3})},
                            {"b", at::ones({5}, at::kBool)}, {"h", at::randn({4}).to(at::kBFloat16)}},
                   {{"family", "gla"}, {"note", "x"}});
  save_safetensors(seed_b, {{"initial_state.S", at::randn({1, 2, 4, 3}, at::kDouble)}, {"empty", at::zeros({0, 3})}});
  const std::vector<std::string> seeds = {read_bytes(seed_a), read_bytes(seed_b)};
  Mutator mutator(18);
  Tally t;
  const std::string path = dir_ + "/fuzz.safetensors";
  const int cases = 5000;
  for (int i = 0; i < cases; ++i) {
    watchdog_.start("safetensors", i);
    write_bytes(path, mutator.mutate(seeds[mutator.below(seeds.size())]));
    judge<c10::Error>(t, "case " + std::to_string(i), [&] {
      std::map<std::string, std::string> metadata;
      for (auto& [name, tensor] : load_safetensors(path, &metadata)) tensor.sum();  // every byte is there
    });
  }
  report("safetensors", t, cases);
}

TEST_F(ReadersFuzz, TokenFiles) {
  std::vector<uint32_t> small(300), wide(200);
  for (size_t i = 0; i < small.size(); ++i) small[i] = static_cast<uint32_t>(i * 37 % 1000);
  for (size_t i = 0; i < wide.size(); ++i) wide[i] = static_cast<uint32_t>(i * 100003 % 200000);
  write_token_file(dir_ + "/a.tok", small);
  write_token_file(dir_ + "/b.tok", wide);
  // An llm.c GPT-2 .bin: 256 int32 header (magic, version 1, count), uint16 tokens.
  std::string llmc(1024, '\0');
  int32_t header[3] = {20240520, 1, 100};
  std::memcpy(&llmc[0], header, sizeof header);
  for (int i = 0; i < 100; ++i) llmc.append({static_cast<char>(i), 0});
  const std::vector<std::string> seeds = {read_bytes(dir_ + "/a.tok"), read_bytes(dir_ + "/b.tok"), llmc};
  Mutator mutator(19);
  Tally t;
  const std::string path = dir_ + "/fuzz.tok";
  const int cases = 5000;
  for (int i = 0; i < cases; ++i) {
    watchdog_.start("token file", i);
    write_bytes(path, mutator.mutate(seeds[mutator.below(seeds.size())]));
    judge<std::runtime_error>(t, "case " + std::to_string(i), [&] {
      TokenFile f(path);
      std::vector<int64_t> all(static_cast<size_t>(f.size()));
      f.read(0, f.size(), all.data());
      f.find_token_at_least(1000);
    });
  }
  report("token file", t, cases);
}

TEST_F(ReadersFuzz, Checkpoints) {
  const std::string ck = dir_ + "/ck";
  CheckpointData d;
  d.step = 12;
  d.tokens_seen = 4096;
  d.data_cursor = 12;
  d.rng_seed = 7;
  d.config_text = read_bytes(std::string(CARRY_SOURCE_DIR) + "/configs/demo_mqar.textproto");
  d.run_id = "0123456789abcdef";
  d.model = {{"embedding", at::randn({8, 4})}, {"norm.weight", at::ones({4})}};
  d.optimizer = {{"exp_avg.embedding", at::zeros({8, 4})}, {"exp_avg_sq.embedding", at::zeros({8, 4})}};
  d.extra = {{"layout", "dp=1 x sp=1"}, {"metrics_bytes", "120"}};
  save_checkpoint(ck, d, 0);
  const std::string step_dir = ck + "/" + checkpoint_dir_name(12);
  const std::vector<std::string> files = {"manifest.textproto", "manifest.textproto", "model.safetensors",
                                          "optimizer.safetensors"};
  std::map<std::string, std::string> originals;
  for (auto& f : files) originals[f] = read_bytes(step_dir + "/" + f);
  const std::string latest = read_bytes(ck + "/latest");
  Mutator mutator(20);
  Tally t;
  const int cases = 1500;
  for (int i = 0; i < cases; ++i) {
    watchdog_.start("checkpoint", i);
    for (auto& [f, bytes] : originals) write_bytes(step_dir + "/" + f, bytes);
    const std::string& f = files[mutator.below(files.size())];
    write_bytes(step_dir + "/" + f, mutator.mutate(originals[f]));
    write_bytes(ck + "/latest", mutator.below(4) == 0 ? mutator.mutate(latest) : latest);
    judge<c10::Error>(t, "case " + std::to_string(i) + " (" + f + ")", [&] {
      // The search reports and skips what is wrong; the single load throws it.
      ::testing::internal::CaptureStderr();
      auto found = find_latest_checkpoint(ck);
      ::testing::internal::GetCapturedStderr();
      for (auto& note : found.notes)
        if (!unclear(note).empty()) throw std::logic_error("unclear note: " + note);
      load_checkpoint(step_dir);
    });
  }
  report("checkpoint", t, cases);
}

}  // namespace
}  // namespace carry::testing
