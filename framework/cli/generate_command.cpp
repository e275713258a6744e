// `carry generate` (generate_command.h): flags, the prompt (text through the byte tokenizer, or ids),
// the model from its source, the generation loop streaming tokens to stdout, and the timing line.
#include "framework/cli/generate_command.h"

#include "framework/data/tokenizer.h"

#include "framework/cli/command_args.h"
#include "framework/cli/tokenize_command.h"
#include "framework/infer/generate.h"
#include "framework/io/model_source.h"
#include "framework/io/output_file.h"
#include "framework/io/safetensors.h"
#include "framework/printable.h"
#include "layers/core/device.h"
#include "layers/blocks/precision.h"

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <sys/stat.h>

namespace carry {
namespace {

// The most tokens one generate call draws (2^31): the prompt plus them stays far from int64's end.
constexpr int64_t kMaxNewTokens = int64_t{1} << 31;

const char* kUsage =
    "usage: carry generate MODEL (--prompt TEXT | --prompt-file FILE | --prompt-ids ID,ID,...)\n"
    "                      [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]\n"
    "                      [--tokenizer auto|byte|ids|SPEC] [--stop-token ID|none] [--precision fp32|bf16] [--cpu]\n"
    "                      [--dump-logits FILE.safetensors]\n"
    "  Samples a continuation: the prompt is read at once (the chunkwise form for its whole chunks), then\n"
    "  each new token is one step of the recurrence from the layers' states (softmax attention layers keep\n"
    "  a KV cache). MODEL: a carry checkpoint or an FLA / Hugging Face folder.\n"
    "  --tokenizer: byte = carry tokenize's byte-level tokenizer (text in and out; the end-of-document\n"
    "  token 256 stops); ids = token ids in and out; auto (default) = byte when the vocabulary is 257;\n"
    "  SPEC = a tokenizer as carry tokenize takes it (bpe:tokenizer.json, sentencepiece:m.model,\n"
    "  tiktoken:FILE): text in and out, its end-of-document token stops.\n"
    "  --prompt / --prompt-file need a text tokenizer. --temperature 0 is greedy (default 1); --top-k 0\n"
    "  and --top-p 1 switch those filters off (defaults); the same --seed (default 0) gives the same tokens.\n"
    "  --max-new-tokens default 64. --stop-token: stop after drawing it (default: 256 with the byte\n"
    "  tokenizer, none otherwise). --dump-logits writes the prompt, the new tokens and each draw's logits.\n";

struct GenerateArgs {
  std::string model, prompt_text, prompt_file, prompt_ids, tokenizer = "auto", precision = "fp32", dump_logits;
  std::string stop = "default";
  GenerationOptions gen;
  bool cpu = false;
};

GenerateArgs parse(int argc, char** argv) {
  CommandArgs args(argc, argv);
  GenerateArgs a;
  int prompts = 0;
  std::string f;
  while (args.next(f)) {
    if (f == "--prompt") a.prompt_text = args.value(f), ++prompts;
    else if (f == "--prompt-file") a.prompt_file = args.value(f), ++prompts;
    else if (f == "--prompt-ids") a.prompt_ids = args.value(f), ++prompts;
    else if (f == "--max-new-tokens") {
      a.gen.max_new_tokens = args.integer(f, 0);
      if (a.gen.max_new_tokens > kMaxNewTokens)
        throw UsageError("--max-new-tokens must be at most " + std::to_string(kMaxNewTokens) + ", got " +
                         std::to_string(a.gen.max_new_tokens));
    }
    else if (f == "--temperature") a.gen.sampling.temperature = args.number(f);
    else if (f == "--top-k") a.gen.sampling.top_k = args.integer(f, 0);
    else if (f == "--top-p") a.gen.sampling.top_p = args.number(f);
    else if (f == "--seed") a.gen.sampling.seed = static_cast<uint64_t>(args.integer(f, 0));
    else if (f == "--tokenizer") a.tokenizer = args.value(f);
    else if (f == "--stop-token") a.stop = args.value(f);
    else if (f == "--precision") a.precision = args.value(f);
    else if (f == "--dump-logits") a.dump_logits = args.value(f);
    else if (f == "--cpu") a.cpu = true;
    else if (f.rfind("-", 0) == 0) throw UsageError("unknown flag '" + f + "'");
    else if (a.model.empty()) a.model = f;
    else throw UsageError("one MODEL expected, got '" + a.model + "' and '" + f + "'");
  }
  if (a.model.empty()) throw UsageError("MODEL (a carry checkpoint or an FLA folder) is required");
  if (prompts != 1) throw UsageError("give exactly one of --prompt, --prompt-file, --prompt-ids");
  if (a.gen.sampling.temperature < 0) throw UsageError("--temperature must be >= 0");
  if (!(a.gen.sampling.top_p > 0 && a.gen.sampling.top_p <= 1)) throw UsageError("--top-p must lie in (0, 1]");
  if (a.tokenizer != "auto" && a.tokenizer != "byte" && a.tokenizer != "ids" && a.tokenizer.find(':') == std::string::npos)
    throw UsageError("--tokenizer must be auto, byte, ids or a tokenizer spec (bpe:FILE, sentencepiece:FILE, "
                     "tiktoken:FILE), got '" + a.tokenizer + "'");
  if (a.precision != "fp32" && a.precision != "bf16") throw UsageError("--precision must be fp32 or bf16, got '" + a.precision + "'");
  return a;
}

// The ids of a comma-separated list given to `flag` (--prompt-ids, --stop-token); an id past 32 bits
// (token ids are 32-bit) or one that does not parse is named with the flag.
std::vector<int64_t> parse_ids(const std::string& text, const std::string& flag) {
  std::vector<int64_t> ids;
  std::stringstream ss(text);
  for (std::string p; std::getline(ss, p, ',');) {
    char* end = nullptr;
    errno = 0;
    long long x = std::strtoll(p.c_str(), &end, 10);
    if (p.empty() || *end || x < 0 || errno == ERANGE || x > 0xFFFFFFFFLL)
      throw UsageError(flag + ": '" + printable(p.substr(0, 40), false) + "' is not a token id (ids are integers in [0, " +
                       "4294967295]" + (flag == "--prompt-ids" ? ", comma-separated)" : ", or 'none')"));
    ids.push_back(x);
  }
  if (ids.empty()) throw UsageError(flag + " needs at least one id");
  return ids;
}

std::string message_of(const std::exception& e) {
  if (auto* c = dynamic_cast<const c10::Error*>(&e)) return c->what_without_backtrace();
  return e.what();
}

}  // namespace

int run_generate_command(int argc, char** argv) {
  GenerateArgs a;
  try {
    CommandArgs probe(argc, argv);
    if (probe.help()) {
      std::fputs(kUsage, stdout);
      return 0;
    }
    a = parse(argc, argv);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "carry generate: %s\n%s", e.what(), kUsage);
    return 2;
  }
  try {
    ModelSource source = load_model_source(a.model);
    const int64_t V = source.model.vocab_size();
    // A text tokenizer from a spec: its ids must lie in the vocabulary.
    std::unique_ptr<Tokenizer> text_tok;
    if (a.tokenizer.find(':') != std::string::npos) {
      try {
        text_tok = load_tokenizer(a.tokenizer);
      } catch (const std::runtime_error& e) {
        throw ConfigError(std::string("--tokenizer: ") + e.what());
      }
      if (text_tok->vocab_size() > V)
        throw ConfigError("--tokenizer " + a.tokenizer + ": its " + std::to_string(text_tok->vocab_size()) +
                          " tokens do not fit the vocabulary of " + std::to_string(V) + " of " + source.describe());
    }
    const bool byte_level = a.tokenizer == "byte" || (a.tokenizer == "auto" && V == kByteVocabSize);
    if (a.tokenizer == "byte" && V < 256)
      throw ConfigError("--tokenizer byte needs a vocabulary of at least 256 tokens; " + source.describe() + " has " + std::to_string(V));
    std::vector<int64_t> prompt;
    if (!a.prompt_ids.empty()) {
      prompt = parse_ids(a.prompt_ids, "--prompt-ids");
    } else {
      if (!byte_level && !text_tok)
        throw UsageError("--prompt and --prompt-file need a text tokenizer (vocabulary 257, --tokenizer byte or "
                         "--tokenizer SPEC); this model's vocabulary is " + std::to_string(V) + ": give --prompt-ids");
      std::string text = a.prompt_text;
      if (!a.prompt_file.empty()) {
        struct stat st;
        if (::stat(a.prompt_file.c_str(), &st) != 0)
          throw ConfigError("--prompt-file " + a.prompt_file + ": cannot open: " + std::strerror(errno));
        if (!S_ISREG(st.st_mode))
          throw ConfigError("--prompt-file " + a.prompt_file + ": is " + file_kind(st.st_mode) + "; expected a text file");
        std::ifstream f(a.prompt_file, std::ios::binary);
        if (!f) throw ConfigError("--prompt-file " + a.prompt_file + ": cannot read it: " + std::strerror(errno));
        std::ostringstream s;
        s << f.rdbuf();
        text = s.str();
      }
      if (text.empty())
        throw UsageError(a.prompt_file.empty() ? std::string("--prompt is empty") : "--prompt-file " + a.prompt_file + " is empty");
      if (text_tok) {
        std::vector<uint32_t> ids;
        text_tok->encode(text, &ids);
        if (ids.empty()) throw UsageError("the prompt encodes to no tokens");
        for (uint32_t t : ids) prompt.push_back(t);
      } else {
        for (unsigned char c : text) prompt.push_back(c);
      }
    }
    for (int64_t t : prompt)
      if (t >= V) throw ConfigError("prompt token " + std::to_string(t) + " is outside the vocabulary of " + std::to_string(V));
    if (a.stop == "default")
      a.gen.stop_token = text_tok ? static_cast<int64_t>(text_tok->end_of_document())
                                  : byte_level ? static_cast<int64_t>(kByteEndOfDocument) : -1;
    else if (a.stop == "none") a.gen.stop_token = -1;
    else a.gen.stop_token = parse_ids(a.stop, "--stop-token").at(0);

    const bool gpu = !a.cpu && cuda_device_count() > 0;
    at::Device device = gpu ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
    Model model = build_model_from_source(source, at::TensorOptions().dtype(at::kFloat).device(device));
    std::fprintf(stderr, "model: %s; %s\n", source.describe().c_str(), model.summary().c_str());
    a.gen.keep_logits = !a.dump_logits.empty();
    // A text tokenizer's output: the decoded new tokens, printed as far as they decode the same whatever
    // follows (the text of all new tokens so far, less what was printed; a token that ends inside a
    // character waits for the next).
    std::vector<uint32_t> drawn;
    std::string printed;
    a.gen.on_token = [&](int64_t token, int64_t) {
      if (text_tok) {
        if (token == a.gen.stop_token) return;
        drawn.push_back(static_cast<uint32_t>(token));
        std::string text = text_tok->decode(drawn);
        size_t end = text.size();
        while (end > printed.size() && (static_cast<unsigned char>(text[end - 1]) & 0xC0) == 0x80) --end;
        if (end > printed.size() && static_cast<unsigned char>(text[end - 1]) >= 0xC0) --end;  // a lead byte waiting
        if (end > printed.size() && text.compare(0, printed.size(), printed) == 0) {
          std::fwrite(text.data() + printed.size(), 1, end - printed.size(), stdout);
          printed = text.substr(0, end);
        }
        std::fflush(stdout);
        return;
      }
      if (!byte_level) std::printf("%lld ", static_cast<long long>(token));
      else if (token < 256) std::fputc(static_cast<int>(token), stdout);
      std::fflush(stdout);
    };
    Generation g;
    {
      AutocastScope autocast(device.type(), at::kBFloat16, a.precision == "bf16");
      g = generate(model, prompt, a.gen);
    }
    if (text_tok) {  // what the last tokens left undecoded
      std::string text = text_tok->decode(drawn);
      if (text.size() > printed.size() && text.compare(0, printed.size(), printed) == 0)
        std::fwrite(text.data() + printed.size(), 1, text.size() - printed.size(), stdout);
    }
    std::printf("\n");
    const int64_t n = static_cast<int64_t>(g.tokens.size());
    std::fprintf(stderr, "generate: prompt %lld tokens (read in %.1f ms), %lld new tokens in %.1f ms (%.1f tokens/s, one "
                 "recurrent step each)%s\n", static_cast<long long>(g.prompt_length), 1e3 * g.prefill_seconds,
                 static_cast<long long>(n), 1e3 * g.decode_seconds, g.decode_seconds > 0 ? n / g.decode_seconds : 0.0,
                 n > 0 && g.tokens.back() == a.gen.stop_token ? "; stopped at the stop token" : "");
    if (!a.dump_logits.empty()) {
      save_safetensors(a.dump_logits,
                       {{"prompt", at::tensor(prompt, at::kLong)},
                        {"tokens", at::tensor(g.tokens.empty() ? std::vector<int64_t>{} : g.tokens, at::kLong)},
                        {"logits", g.logits.contiguous()}},
                       {{"source", source.describe()}, {"seed", std::to_string(a.gen.sampling.seed)}});
      std::fprintf(stderr, "wrote %s\n", a.dump_logits.c_str());
    }
    return 0;
  } catch (const UsageError& e) {
    std::fprintf(stderr, "carry generate: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "carry generate: %s\n", message_of(e).c_str());
    return 1;
  }
}

}  // namespace carry
