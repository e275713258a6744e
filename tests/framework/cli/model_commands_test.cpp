// Tests of the commands that use a trained model, run in-process on a checkpoint written here:
// `carry export` (the folder, the refusal of a model that does not map, usage errors), `carry import`
// (the printed model config loads as a preset), `carry generate` (byte-level text and ids; the same
// seed writes the same tokens and logits) and `carry eval` (the summary JSON against the evaluator,
// valid JSON for a model path with a quote, a backslash and a tab; the curve table, the plot, the first
// batch's logits against a forward). Exit codes: 0, 1 for what the files say, 2 for the command line.
#include "framework/cli/eval_command.h"
#include "framework/cli/export_command.h"
#include "framework/cli/generate_command.h"
#include "framework/data/tokenizer.h"
#include "framework/eval/evaluator.h"
#include "framework/io/checkpoint.h"
#include "framework/io/model_source.h"
#include "framework/io/safetensors.h"
#include "framework/data/token_file.h"
#include "tests/helpers/one_thread.h"
#include "tests/helpers/temp_dir.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>

#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace carry {
namespace {

const char* kRun = R"(
name: "model_commands_test"
seed: 2
model { vocab_size: 257 d_model: 16 n_layers: 2 n_heads: 2 init_std: 0.3
        mixers: ["gated_deltanet", "softmax_attn"] mixer_options { chunk_size: 8 conv_size: 4 } }
data { token_files { paths: "unused.tok" } seq_len: 16 batch_size: 2 }
)";

int run(int (*command)(int, char**), std::vector<std::string> args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return command(static_cast<int>(argv.size()), argv.data());
}

int eval(std::vector<std::string> args) {
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return run_eval_command(static_cast<int>(argv.size()), argv.data(), /*finalize_mpi=*/false);
}

std::string read(const std::string& path) {
  std::ifstream f(path);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

// A checkpoint of `run` with the model of seed 3.
std::string checkpoint(const std::string& dir, const std::string& run_text, const std::vector<std::string>& overrides = {}) {
  RunConfig run = run_config_from_text(run_text, "model_commands_test.textproto", overrides);
  Model model = build_model(run.model(), 3);
  CheckpointData d;
  d.step = 12;
  d.config_text = config_to_text(run);
  for (auto& [name, p] : model.parameters()) d.model.emplace_back(name, p.detach());
  save_checkpoint(dir, d, 0);
  return dir;
}

TEST(ModelCommands, ExportAndImport) {
  auto dir = testing::make_temp_dir("carry_cmd_export");
  std::string ck = checkpoint(dir + "/gdn", kRun, {"model.mixers=gated_deltanet"});
  EXPECT_EQ(run(run_export_command, {"export", ck, "--format", "fla", "--out", dir + "/fla"}), 0);
  EXPECT_TRUE(testing::exists(dir + "/fla/config.json"));
  EXPECT_EQ(run(run_export_command, {"export", ck, "--format=hf", "--out=" + dir + "/hf", "--dtype", "bf16"}), 0);
  EXPECT_EQ(run(run_export_command, {"export", ck, "--format", "fla"}), 2);        // no --out
  EXPECT_EQ(run(run_export_command, {"export", ck, "--format", "onnx", "--out", dir + "/x"}), 2);
  std::string hybrid = checkpoint(dir + "/hybrid", kRun);
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(run(run_export_command, {"export", hybrid, "--format", "fla", "--out", dir + "/no"}), 1);
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("rotary position embeddings"), std::string::npos) << err;

  EXPECT_EQ(run(run_import_command, {"import", dir + "/fla", "--model-out", dir + "/model.textproto"}), 0);
  ModelConfig preset = load_model_config(dir + "/model.textproto");
  EXPECT_EQ(config_to_text(preset), config_to_text(load_model_source(ck).model));
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(run(run_import_command, {"import", ck}), 1);  // a checkpoint is not a folder to import
  err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("no config.json"), std::string::npos) << err;
  testing::remove_tree(dir);
}

// A checkpoint whose stored config names a model preset (here a file with a secret first line) is
// refused by eval and generate, naming the field, without reading or echoing that file.
TEST(ModelCommands, ACheckpointsStoredConfigNamesNoFileToRead) {
  auto dir = testing::make_temp_dir("carry_cmd_preset");
  {
    std::ofstream secret(dir + "/secret.txt");
    secret << "SECRET-FIRST-LINE: model { d_model: 16 }\n";
  }
  RunConfig config = run_config_from_text(kRun, "model_commands_test.textproto");
  Model model = build_model(config.model(), 3);
  CheckpointData d;
  d.step = 4;
  d.config_text = "model_preset: \"" + dir + "/secret.txt\"\n" + config_to_text(config);
  for (auto& [name, p] : model.parameters()) d.model.emplace_back(name, p.detach());
  save_checkpoint(dir + "/ck", d, 0);
  for (auto command : {"eval", "generate"}) {
    ::testing::internal::CaptureStderr();
    ::testing::internal::CaptureStdout();
    int rc = std::string(command) == "eval"
                 ? eval({"eval", dir + "/ck", "--batch-size", "1"})
                 : run(run_generate_command, {"generate", dir + "/ck", "--prompt", "Hi", "--max-new-tokens", "2"});
    std::string err = ::testing::internal::GetCapturedStderr() + ::testing::internal::GetCapturedStdout();
    EXPECT_EQ(rc, 1) << command << ": " << err;
    EXPECT_NE(err.find("manifest.textproto: model_preset: a checkpoint stores its resolved config, which names no "
                       "preset file, but this one names '" + dir + "/secret.txt'"), std::string::npos) << command << ": " << err;
    EXPECT_EQ(err.find("SECRET-FIRST-LINE"), std::string::npos) << command << ": " << err;
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << command << ": " << err;
  }
  testing::remove_tree(dir);
}

// Each bad generate flag is one line naming that flag and what it takes (exit 2), or the file and what it is.
TEST(ModelCommands, GenerateFlagsNameThemselves) {
  auto dir = testing::make_temp_dir("carry_cmd_generate_flags");
  std::string ck = checkpoint(dir + "/ck", kRun);
  auto error_of = [&](std::vector<std::string> args, int want) {
    args.insert(args.begin(), {"generate", ck});
    ::testing::internal::CaptureStderr();
    ::testing::internal::CaptureStdout();
    int rc = run(run_generate_command, args);
    std::string err = ::testing::internal::GetCapturedStderr();
    ::testing::internal::GetCapturedStdout();
    EXPECT_EQ(rc, want) << err;
    return err.substr(0, err.find('\n'));
  };
  EXPECT_EQ(error_of({"--prompt", "a", "--max-new-tokens", "9223372036854775807"}, 2),
            "carry generate: --max-new-tokens must be at most 2147483648, got 9223372036854775807");
  EXPECT_EQ(error_of({"--prompt-ids", "99999999999999999999999"}, 2),
            "carry generate: --prompt-ids: '99999999999999999999999' is not a token id (ids are integers in [0, "
            "4294967295], comma-separated)");
  EXPECT_EQ(error_of({"--prompt", "a", "--stop-token", "abc"}, 2),
            "carry generate: --stop-token: 'abc' is not a token id (ids are integers in [0, 4294967295], or 'none')");
  EXPECT_EQ(error_of({"--prompt-file", dir}, 1),
            "carry generate: --prompt-file " + dir + ": is a directory; expected a text file");
  { std::ofstream empty(dir + "/empty.txt"); }
  EXPECT_EQ(error_of({"--prompt-file", dir + "/empty.txt"}, 2), "carry generate: --prompt-file " + dir + "/empty.txt is empty");
  testing::remove_tree(dir);
}

TEST(ModelCommands, GenerateIsReproducible) {
  testing::OneThread one_thread;
  auto dir = testing::make_temp_dir("carry_cmd_generate");
  std::string ck = checkpoint(dir + "/ck", kRun);
  std::vector<std::string> args = {"generate", ck, "--prompt", "Hello", "--max-new-tokens", "9", "--seed", "5",
                                   "--stop-token", "none", "--top-k", "40", "--top-p", "0.95", "--dump-logits"};
  ::testing::internal::CaptureStdout();
  EXPECT_EQ(run(run_generate_command, [&] { auto a = args; a.push_back(dir + "/a.safetensors"); return a; }()), 0);
  EXPECT_EQ(run(run_generate_command, [&] { auto a = args; a.push_back(dir + "/b.safetensors"); return a; }()), 0);
  ::testing::internal::GetCapturedStdout();
  auto a = load_safetensors(dir + "/a.safetensors"), b = load_safetensors(dir + "/b.safetensors");
  EXPECT_EQ(a["prompt"].numel(), 5);
  EXPECT_EQ(a["tokens"].numel(), 9);
  EXPECT_EQ(a["logits"].sizes(), (std::vector<int64_t>{9, 257}));
  EXPECT_TRUE(at::equal(a["tokens"], b["tokens"]));
  EXPECT_TRUE(at::equal(a["logits"], b["logits"]));
  ::testing::internal::CaptureStdout();
  EXPECT_EQ(run(run_generate_command, {"generate", ck, "--prompt-ids", "72,105", "--max-new-tokens", "3", "--tokenizer",
                                       "ids", "--temperature", "0"}), 0);
  std::string ids = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(std::count(ids.begin(), ids.end(), ' '), 3) << ids;
  EXPECT_EQ(run(run_generate_command, {"generate", ck}), 2);  // no prompt
  EXPECT_EQ(run(run_generate_command, {"generate", ck, "--prompt-ids", "1,x"}), 2);
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(run(run_generate_command, {"generate", ck, "--prompt-ids", "300"}), 1);
  EXPECT_NE(::testing::internal::GetCapturedStderr().find("outside the vocabulary of 257"), std::string::npos);
  testing::remove_tree(dir);
}

// A tokenizer spec gives text in and out: the byte tokenizer as a bpe: tokenizer.json (hf_tokenizer) prints what
// --tokenizer byte prints for the same prompt and seed; a tokenizer larger than the vocabulary is refused.
TEST(ModelCommands, GenerateReadsATokenizerSpec) {
  testing::OneThread one_thread;
  auto dir = testing::make_temp_dir("carry_cmd_generate_spec");
  std::string ck = checkpoint(dir + "/ck", kRun);
  { std::ofstream(dir + "/byte.json") << hf_tokenizer("byte").tokenizer_json; }
  auto text_of = [&](const std::string& tokenizer) {
    ::testing::internal::CaptureStdout();
    EXPECT_EQ(run(run_generate_command, {"generate", ck, "--prompt", "Héllo", "--max-new-tokens", "12", "--seed", "3",
                                         "--tokenizer", tokenizer}), 0);
    return ::testing::internal::GetCapturedStdout();
  };
  const std::string bytes = text_of("byte"), spec = text_of("bpe:" + dir + "/byte.json");
  EXPECT_EQ(spec, bytes);
  EXPECT_FALSE(spec.empty());
  ::testing::internal::CaptureStderr();
  std::string ck2 = checkpoint(dir + "/ck2", kRun, {"model.vocab_size=200"});
  EXPECT_EQ(run(run_generate_command, {"generate", ck2, "--prompt", "Hi", "--tokenizer", "bpe:" + dir + "/byte.json"}), 1);
  EXPECT_NE(::testing::internal::GetCapturedStderr().find("its 257 tokens do not fit the vocabulary of 200"),
            std::string::npos);
  testing::remove_tree(dir);
}

TEST(ModelCommands, EvalWritesTheSummaryCurvePlotAndLogits) {
  testing::OneThread one_thread;
  auto dir = testing::make_temp_dir("carry_cmd_eval");
  // A path with a quote, a backslash and a tab: the summary JSON stays valid and names it exactly.
  std::string ck = checkpoint(dir + "/ck \"q\" \\\t", kRun);
  std::vector<uint32_t> tokens;
  for (int i = 0; i < 16 * 3 + 1; ++i) tokens.push_back(static_cast<uint32_t>((i * 37) % 257));
  write_token_file(dir + "/d.tok", tokens);
  ::testing::internal::CaptureStdout();
  int rc = eval({"eval", ck, "--data", dir + "/d.tok", "--batch-size", "2", "--json", dir + "/e.json", "--curve",
                 dir + "/c.tsv", "--plot", dir + "/c.svg", "--dump-logits", dir + "/l.safetensors"});
  std::string out = ::testing::internal::GetCapturedStdout();
  ASSERT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("bits/byte"), std::string::npos) << out;  // vocabulary 257: byte-level
  ModelSource source = load_model_source(ck);
  Model model = build_model_from_source(source);
  EvalSpec spec;
  spec.token_files = {dir + "/d.tok"};
  spec.seq_len = 16;
  spec.batch_size = 2;
  EvalResult r = evaluate_model(model, spec, nullptr);
  std::string json = read(dir + "/e.json");
  google::protobuf::Value summary;
  ASSERT_TRUE(google::protobuf::util::JsonStringToMessage(json, &summary).ok()) << json;
  const auto& fields = summary.struct_value().fields();
  EXPECT_EQ(fields.at("model").string_value(), source.path) << json;
  EXPECT_EQ(fields.at("step").number_value(), 12) << json;
  EXPECT_EQ(fields.at("loss").number_value(), r.loss()) << json;  // the same double
  EXPECT_EQ(fields.at("sequences").number_value(), 3) << json;
  EXPECT_EQ(fields.at("bits_per_byte").number_value(), r.bits_per_byte()) << json;
  EXPECT_NE(read(dir + "/c.tsv").find("first_position"), std::string::npos);
  EXPECT_NE(read(dir + "/c.svg").find("<svg"), std::string::npos);
  auto dumped = load_safetensors(dir + "/l.safetensors");
  at::NoGradGuard no_grad;
  auto logits = model.forward(dumped["tokens"]);
  EXPECT_EQ(dumped["logits"].sizes(), (std::vector<int64_t>{2, 16, 257}));
  EXPECT_LT((dumped["logits"] - logits).abs().max().item<double>(), 1e-5);
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(eval({"eval", dir + "/missing"}), 1);
  EXPECT_NE(::testing::internal::GetCapturedStderr().find("it does not exist"), std::string::npos);
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(eval({"eval", ck}), 1);  // the run trained on token files and names no eval_paths
  EXPECT_NE(::testing::internal::GetCapturedStderr().find("give --data"), std::string::npos);
  EXPECT_EQ(eval({"eval", ck, "--sp", "0"}), 2);
  testing::remove_tree(dir);
}

}  // namespace
}  // namespace carry
