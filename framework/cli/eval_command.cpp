// `carry eval` (eval_command.h): flags, MPI and the process groups, the model from its source, the
// evaluator, the printed summary and curve, and the optional files (curve table, plot, JSON,
// first-batch logits).
#include "framework/cli/eval_command.h"
#include "layers/core/knobs.h"

#include "framework/cli/command_args.h"
#include "framework/cli/tokenize_command.h"
#include "framework/eval/evaluator.h"
#include "framework/io/json.h"
#include "framework/io/model_source.h"
#include "framework/io/output_file.h"
#include "framework/io/safetensors.h"
#include "layers/core/device.h"
#include "parallel/process_group.h"

#include <c10/util/Exception.h>
#include <mpi.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace carry {
namespace {

const char* kUsage =
    "usage: carry eval MODEL [--data FILE ...] [--seq-len T] [--batch-size B] [--max-sequences N]\n"
    "                  [--batches N] [--sp P] [--scan-mode ordered|tree|allgather] [--precision fp32|bf16]\n"
    "                  [--cpu] [--tokenizer auto|byte|other] [--set field.path=value ...]\n"
    "                  [--curve FILE.tsv] [--plot FILE.svg] [--curve-buckets N] [--json FILE]\n"
    "                  [--dump-logits FILE.safetensors]\n"
    "  Scores a trained model on held-out sequences: loss, perplexity, bits per token, bits per byte (byte-level\n"
    "  data), next-token accuracy, and the loss against the position in the sequence.\n"
    "  MODEL: a carry checkpoint (a run's checkpoint.dir or one step_* directory) or an FLA / Hugging Face\n"
    "  folder (config.json + model.safetensors).\n"
    "  Data: --data token files (carry .tok or llm.c .bin; repeatable, read as one stream), cut into\n"
    "  windows of T+1 tokens at stride T, every window once (or the first --max-sequences). Without --data:\n"
    "  the checkpoint's run config's data: its token_files.eval_paths, or its MQAR / needle task (eval\n"
    "  split, --batches batches of B sequences per dp rank; default data.eval_batches), with accuracy and\n"
    "  the share of sequences answered entirely right. --set changes the stored run config first (e.g.\n"
    "  --set data.mqar.num_kv_pairs=8 or --set seed=3). T and B default to the run's data.seq_len and\n"
    "  data.batch_size (B: 1 for an FLA folder).\n"
    "  Ranks: start with mpirun -np dp*sp; --sp P ranks share each sequence (rank r holds tokens\n"
    "  [r*T/P, (r+1)*T/P), the recurrent state passed between them in --scan-mode), dp = ranks / P.\n"
    "  One GPU a rank when there are GPUs (--cpu: the CPU). Every rank reads MODEL and the data itself.\n"
    "  --tokenizer: auto = byte-level when the vocabulary is 257 (carry tokenize's), which reports bits\n"
    "  per byte (bits over the scored targets that are bytes, < 256).\n"
    "  Outputs: the summary line and the loss curve in --curve-buckets (default 24) log-spaced ranges of\n"
    "  positions on stdout; --curve writes the curve as a table (0 buckets: every position), --plot as an\n"
    "  SVG plot, --json the summary; --dump-logits the first batch's tokens and logits (fp32; sp = 1).\n";

struct EvalArgs {
  std::string model;
  std::vector<std::string> data, overrides;
  int64_t seq_len = 0, batch_size = 0, max_sequences = 0, batches = 0, sp = 1, buckets = 24;
  std::string scan_mode = "ordered", precision = "fp32", tokenizer = "auto";
  std::string curve, plot, json, dump_logits;
  bool cpu = false;
};

EvalArgs parse(int argc, char** argv) {
  CommandArgs args(argc, argv);
  EvalArgs a;
  std::string f;
  while (args.next(f)) {
    if (f == "--data") {
      std::string v = args.value(f);
      std::stringstream ss(v);
      for (std::string p; std::getline(ss, p, ',');)
        if (!p.empty()) a.data.push_back(p);
    } else if (f == "--seq-len") a.seq_len = args.integer(f, 1);
    else if (f == "--batch-size") a.batch_size = args.integer(f, 1);
    else if (f == "--max-sequences") a.max_sequences = args.integer(f, 1);
    else if (f == "--batches") a.batches = args.integer(f, 1);
    else if (f == "--sp") a.sp = args.integer(f, 1);
    else if (f == "--curve-buckets") a.buckets = args.integer(f, 0);
    else if (f == "--scan-mode") a.scan_mode = args.value(f);
    else if (f == "--precision") a.precision = args.value(f);
    else if (f == "--tokenizer") a.tokenizer = args.value(f);
    else if (f == "--set") a.overrides.push_back(args.value(f));
    else if (f == "--curve") a.curve = args.value(f);
    else if (f == "--plot") a.plot = args.value(f);
    else if (f == "--json") a.json = args.value(f);
    else if (f == "--dump-logits") a.dump_logits = args.value(f);
    else if (f == "--cpu") a.cpu = true;
    else if (f.rfind("-", 0) == 0) throw UsageError("unknown flag '" + f + "'");
    else if (a.model.empty()) a.model = f;
    else throw UsageError("one MODEL expected, got '" + a.model + "' and '" + f + "'");
  }
  if (a.model.empty()) throw UsageError("MODEL (a carry checkpoint or an FLA folder) is required");
  if (a.precision != "fp32" && a.precision != "bf16") throw UsageError("--precision must be fp32 or bf16, got '" + a.precision + "'");
  if (a.tokenizer != "auto" && a.tokenizer != "byte" && a.tokenizer != "other")
    throw UsageError("--tokenizer must be auto, byte or other, got '" + a.tokenizer + "'");
  if (a.scan_mode != "ordered" && a.scan_mode != "tree" && a.scan_mode != "allgather")
    throw UsageError("--scan-mode must be ordered, tree or allgather, got '" + a.scan_mode + "'");
  if (!a.dump_logits.empty() && a.sp != 1) throw UsageError("--dump-logits needs --sp 1 (one rank holds the whole sequence)");
  return a;
}

std::string message_of(const std::exception& e) {
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

std::string fmt(const char* f, double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, x);
  return buf;
}

// Whether any rank failed; the lowest failing rank prints its message.
bool any_failed(const std::string& error, int rank, int size) {
  const int bad = error.empty() ? size : rank;
  const int first = parallel::world_min(bad);
  if (first < size && rank == first) std::fprintf(stderr, "carry eval%s: %s\n",
                                                  size > 1 ? (" (rank " + std::to_string(rank) + ")").c_str() : "",
                                                  error.c_str());
  return first < size;
}

}  // namespace

int run_eval_command(int argc, char** argv, bool finalize_mpi) {
  EvalArgs a;
  try {
    CommandArgs probe(argc, argv);
    if (probe.help()) {
      std::fputs(kUsage, stdout);
      return 0;
    }
    a = parse(argc, argv);
  } catch (const UsageError& e) {
    const char* rank = knob_value("OMPI_COMM_WORLD_RANK");
    if (!rank || std::string(rank) == "0") std::fprintf(stderr, "carry eval: %s\n%s", e.what(), kUsage);
    return 2;
  }
  parallel::init_mpi();
  const auto& world = parallel::world_info();
  const bool rank0 = world.rank == 0;
  int rc = 0;
  {
    // Setup on every rank: the layout, the model, the data spec.
    std::string error;
    ModelSource source;
    EvalSpec spec;
    std::shared_ptr<parallel::ProcessGroups> groups;
    Model model;
    bool byte_level = false;
    const bool gpu = !a.cpu && cuda_device_count() > 0 && parallel::nccl_available();
    try {
      if (world.size % a.sp != 0)
        throw ConfigError("--sp " + std::to_string(a.sp) + " does not divide the " + std::to_string(world.size) +
                          " ranks (start mpirun -np dp*sp)");
      source = load_model_source(a.model);
      spec.batch_size = a.batch_size > 0 ? a.batch_size : 1;
      spec.max_sequences = a.max_sequences;
      spec.batches = a.batches;
      spec.bf16 = a.precision == "bf16";
      spec.scan_mode = parallel::parse_scan_mode(a.scan_mode);
      spec.token_files = a.data;
      spec.seq_len = a.seq_len;
      if (!source.run_config_text.empty()) {
        RunConfig run = stored_run_config_from_text(source.run_config_text, source.path + "/manifest.textproto", a.overrides);
        spec.data = run.data();
        spec.seed = run.seed();
        if (spec.seq_len == 0) spec.seq_len = run.data().seq_len();
        if (a.batch_size == 0) spec.batch_size = run.data().batch_size();
        if (spec.token_files.empty() && run.data().has_token_files()) {
          for (const auto& p : run.data().token_files().eval_paths()) spec.token_files.push_back(p);
          if (spec.token_files.empty())
            throw ConfigError(source.describe() + ": the run trained on token files but names no eval_paths; give --data");
        }
      } else {
        if (!a.overrides.empty()) throw ConfigError("--set changes a carry checkpoint's run config; " + source.describe() + " has none");
        if (spec.token_files.empty()) throw ConfigError(source.describe() + " has no run config to take data from: give --data");
        if (spec.seq_len == 0) throw ConfigError(source.describe() + " has no run config to take data.seq_len from: give --seq-len");
      }
      byte_level = a.tokenizer == "byte" || (a.tokenizer == "auto" && source.model.vocab_size() == kByteVocabSize);
      const int dp = world.size / static_cast<int>(a.sp);
      if (world.size > 1) {
        groups = std::make_shared<parallel::ProcessGroups>(parallel::make_process_groups(
            {dp, static_cast<int>(a.sp)}, gpu ? parallel::Backend::nccl : parallel::Backend::mpi));
      }
      at::Device device = gpu ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(world.local_rank % cuda_device_count()))
                              : at::Device(at::kCPU);
      model = build_model_from_source(source, at::TensorOptions().dtype(at::kFloat).device(device));
    } catch (const std::exception& e) {
      error = message_of(e);
    }
    if (any_failed(error, world.rank, world.size)) {
      groups.reset();
      if (finalize_mpi) parallel::finalize_mpi();
      return 1;
    }
    try {
      if (rank0) {
        std::printf("model: %s; %s\n", source.describe().c_str(), model.summary().c_str());
        std::string data = spec.token_files.empty()
                               ? std::string(spec.data.has_mqar() ? "MQAR" : "needle") + " task (eval split, seed " +
                                     std::to_string(spec.seed) + ")"
                               : std::to_string(spec.token_files.size()) + " token file(s)" +
                                     (byte_level ? " (byte-level)" : "");
        std::printf("data: %s, %lld tokens a sequence, batch %lld; ranks dp %d x sp %lld (%s), scan %s, %s\n",
                    data.c_str(), static_cast<long long>(spec.seq_len), static_cast<long long>(spec.batch_size),
                    world.size / static_cast<int>(a.sp), static_cast<long long>(a.sp),
                    gpu ? "nccl, cuda" : (world.size > 1 ? "mpi, cpu" : "cpu"), a.scan_mode.c_str(),
                    a.precision.c_str());
        std::fflush(stdout);
      }
      spec.progress = stderr;
      if (!a.dump_logits.empty())
        spec.first_batch = [&](const Tensor& tokens, const Tensor& logits) {
          save_safetensors(a.dump_logits, {{"tokens", tokens.contiguous()}, {"logits", logits.to(at::kFloat).contiguous()}},
                           {{"source", source.describe()}, {"precision", a.precision}});
        };
      EvalResult r = evaluate_model(model, spec, groups.get());
      if (rank0) {
        std::string line = "eval: " + std::to_string(r.sequences) + " sequences, " + std::to_string(r.positions) +
                           " scored targets | loss " + fmt("%.4f", r.loss()) + " | perplexity " +
                           fmt("%.4f", r.perplexity()) + " | bits/token " + fmt("%.4f", r.bits_per_token());
        if (byte_level) line += " | bits/byte " + fmt("%.4f", r.bits_per_byte()) + " (" + std::to_string(r.byte_targets) + " bytes)";
        line += " | accuracy " + fmt("%.4f", r.accuracy());
        if (r.task) line += " | sequences all right " + fmt("%.4f", r.sequences ? double(r.sequences_all_right) / r.sequences : 0);
        line += " | " + fmt("%.1f", r.seconds) + " s";
        std::printf("%s\n", line.c_str());
        auto rows = loss_curve(r, a.buckets);
        auto shown = a.buckets > 0 ? rows : loss_curve(r, 24);
        std::printf("loss by position (tokens read before the prediction = position + 1):\n");
        std::printf("%12s %12s %12s %10s %10s\n", "first", "last", "targets", "loss", "accuracy");
        for (const auto& row : shown)
          std::printf("%12lld %12lld %12.0f %10.4f %10.4f\n", static_cast<long long>(row.first),
                      static_cast<long long>(row.last), row.tokens, row.loss, row.accuracy);
        if (!a.curve.empty()) write_curve_tsv(a.curve, rows), std::printf("wrote %s\n", a.curve.c_str());
        if (!a.plot.empty())
          write_curve_svg(a.plot, rows, "loss by position: " + source.describe()), std::printf("wrote %s\n", a.plot.c_str());
        if (!a.json.empty()) {
          JsonWriter j(2);
          j.begin_object().member("model", source.path).member("step", source.step).member("seq_len", spec.seq_len);
          j.member("sequences", r.sequences).member("positions", r.positions).member("loss", r.loss());
          j.member("perplexity", r.perplexity()).member("bits_per_token", r.bits_per_token());
          if (byte_level) j.member("bits_per_byte", r.bits_per_byte());
          j.member("accuracy", r.accuracy());
          if (r.task) j.member("sequence_accuracy", r.sequences ? double(r.sequences_all_right) / r.sequences : 0.0);
          j.member("dp", static_cast<int64_t>(world.size / a.sp)).member("sp", static_cast<int64_t>(a.sp));
          j.key("seconds").fixed_value(r.seconds, 3);
          j.end_object();
          write_whole_file(a.json, j.str() + "\n", "--json", /*sync=*/false, /*allow_char_device=*/true);
          std::printf("wrote %s\n", a.json.c_str());
        }
        if (!a.dump_logits.empty()) std::printf("wrote %s\n", a.dump_logits.c_str());
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "carry eval%s: %s\n", world.size > 1 ? (" (rank " + std::to_string(world.rank) + ")").c_str() : "",
                   message_of(e).c_str());
      std::fflush(stderr);
      if (world.size > 1) parallel::abort_world(1);
      rc = 1;
    }
  }
  if (finalize_mpi) parallel::finalize_mpi();
  return rc;
}

}  // namespace carry
