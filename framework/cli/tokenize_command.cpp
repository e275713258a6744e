// `carry tokenize` (see tokenize_command.h): a reader cuts the input files into pieces (a whole file for
// SentencePiece, whose whitespace handling needs the document; pieces of about 4 MiB cut after a line
// break that a printable ASCII character follows, where neither pre-tokenizer pattern ever joins two
// pieces, for the byte and BPE tokenizers, so memory stays bounded whatever the file size), worker
// threads encode them, and the writer appends them to one TokenFileWriter in input order, an
// end-of-document token before each file's first piece. The output appears (by rename) only once complete.
// With --jsonl each line is a document (a JSON object whose --field string is its text): the reader cuts
// pieces after any line break, a worker parses its piece's lines and encodes each document after an
// end-of-document token, and a line that is not JSON or lacks the field becomes the piece's error,
// which the writer raises when it reaches that piece, so the first bad line in input order is the one
// reported ("FILE:LINE: ...").
#include "framework/cli/tokenize_command.h"

#include "framework/cli/command_args.h"
#include "framework/cli/error_text.h"
#include "framework/data/token_file.h"
#include "framework/data/tokenizer.h"
#include "framework/io/json.h"
#include "framework/io/output_file.h"

#include <pthread.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace carry {

namespace {

const char* kUsage =
    "usage: carry tokenize --input FILE [FILE...] --output OUT.tok [--tokenizer SPEC] [--eod-id N] [--threads N]\n"
    "       carry tokenize --jsonl FILE.jsonl [FILE...] [--field text] --output OUT.tok [--tokenizer SPEC] ...\n"
    "       carry tokenize --train-sentencepiece PREFIX --vocab-size N --input FILE [FILE...] [--model-type unigram|bpe]\n"
    "                      [--spm-option NAME=VALUE ...]\n"
    "  Turns text files into one token file. Each file is a document; the end-of-document token goes before\n"
    "  each one. Files are tokenized in parallel (--threads, default: every core) and written in the order given.\n"
    "  --jsonl: each line of each file is a document, a JSON object whose string member --field (default\n"
    "  \"text\") is its text; blank lines are skipped; a line that is not JSON or lacks the field stops the\n"
    "  command naming the file and line (Parquet: convert with tools/parquet_to_jsonl.py).\n"
    "  Tokenizers (--tokenizer SPEC):\n"
    "    byte                    one token a byte, end of document 256, vocabulary 257 (the default)\n"
    "    sentencepiece:M.model   a SentencePiece model (libsentencepiece); end of document: its </s>\n"
    "    bpe:tokenizer.json      a byte-level BPE tokenizer.json (GPT-2, NeoX, Llama 3, Qwen2 style: any Split\n"
    "                            regex, NFC or NFKC);\n"
    "                            end of document: <|endoftext|> or <|end_of_text|>\n"
    "    tiktoken:FILE[:PATTERN] a tiktoken rank file, PATTERN gpt2 or cl100k (default); needs --eod-id\n"
    "  --eod-id N replaces the tokenizer's end-of-document id. Tokens are stored in 2 bytes when every id\n"
    "  fits (vocabulary <= 65536), else 4. Large files are cut into pieces of about --piece-bytes (4 MiB)\n"
    "  after a line break, where no pre-tokenizer joins tokens (SentencePiece: whole files).\n"
    "  --train-sentencepiece trains a SentencePiece model on the input files (PREFIX.model, PREFIX.vocab;\n"
    "  --model-type unigram by default). --spm-option passes one more of spm_train's options (repeatable), e.g.\n"
    "  byte_fallback=true, user_defined_symbols=<a>,<b>, normalization_rule_name=identity, add_dummy_prefix=false.\n";

struct TokenizeArgs {
  std::vector<std::string> inputs;
  std::string output, tokenizer = "byte", train_prefix, model_type = "unigram", field = "text";
  std::vector<std::string> spm_options;  // --spm-option NAME=VALUE, passed to spm_train as --NAME=VALUE
  bool jsonl = false;  // the inputs are JSONL files (--jsonl), a document a line
  int64_t eod_id = -1, vocab_size = 0;
  int64_t piece_bytes = int64_t{4} << 20;  // --piece-bytes: the size pieces of a file are cut at
  int threads = 0;
};

TokenizeArgs parse(CommandArgs& args) {
  TokenizeArgs a;
  for (std::string f; args.next(f);) {
    if (f == "--input") {
      for (auto& file : args.values()) a.inputs.push_back(file);
      if (a.inputs.empty()) throw UsageError("--input needs at least one file");
    } else if (f == "--jsonl") {
      a.jsonl = true;
      for (auto& file : args.values()) a.inputs.push_back(file);
      if (a.inputs.empty()) throw UsageError("--jsonl needs at least one file");
    } else if (f == "--field") {
      a.field = args.value(f);
      if (a.field.empty()) throw UsageError("--field needs a member name");
    } else if (f == "--output") {
      a.output = args.value(f);
    } else if (f == "--tokenizer") {
      a.tokenizer = args.value(f);
    } else if (f == "--eod-id") {
      a.eod_id = args.integer(f, 0);
      if (a.eod_id > int64_t{0xFFFFFFFE})
        throw UsageError("--eod-id must be below 4294967295 (token ids are 32-bit), got " + std::to_string(a.eod_id));
    } else if (f == "--threads") {
      a.threads = static_cast<int>(std::min<int64_t>(args.integer(f, 1), 1024));
    } else if (f == "--piece-bytes") {
      a.piece_bytes = args.integer(f, 1);
    } else if (f == "--train-sentencepiece") {
      a.train_prefix = args.value(f);
    } else if (f == "--vocab-size") {
      a.vocab_size = args.integer(f, 1);
    } else if (f == "--model-type") {
      a.model_type = args.value(f);
      if (a.model_type != "unigram" && a.model_type != "bpe" && a.model_type != "char" && a.model_type != "word")
        throw UsageError("--model-type must be unigram, bpe, char or word, got '" + a.model_type + "'");
    } else if (f == "--spm-option") {
      const std::string o = args.value(f);
      const size_t eq = o.find('=');
      const bool name_ok = eq != std::string::npos && eq > 0 &&
                           o.find_first_not_of("abcdefghijklmnopqrstuvwxyz_0123456789") == eq;
      if (!name_ok || o.find_first_of(" \t\n") != std::string::npos)
        throw UsageError("--spm-option: expected NAME=VALUE (an spm_train option without its dashes, a value without "
                         "spaces), got '" + o + "'");
      a.spm_options.push_back(o);
    } else if (f.rfind("-", 0) == 0) {
      throw UsageError("unknown flag '" + f + "'");
    } else {
      throw UsageError("unknown argument '" + f + "' (input files follow --input)");
    }
  }
  if (a.inputs.empty()) throw std::invalid_argument("no --input files");
  if (a.jsonl && args.has("--input")) throw UsageError("give the files after --input (one document a file) or --jsonl (one a line), not both");
  if (args.has("--field") && !a.jsonl) throw UsageError("--field names the text member of --jsonl lines; no --jsonl files given");
  if (!a.train_prefix.empty()) {
    if (a.jsonl) throw UsageError("--train-sentencepiece reads plain text files (--input), not --jsonl");
    if (a.vocab_size <= 0) throw std::invalid_argument("--train-sentencepiece needs --vocab-size");
    return a;
  }
  if (!a.spm_options.empty()) throw UsageError("--spm-option is an option of --train-sentencepiece");
  if (a.output.empty()) throw std::invalid_argument("no --output file");
  return a;
}

std::string megabytes(double bytes) {
  char buf[32];
  if (bytes < 1e6) std::snprintf(buf, sizeof buf, "%.1f kB", bytes / 1e3);
  else if (bytes < 1e9) std::snprintf(buf, sizeof buf, "%.1f MB", bytes / 1e6);
  else std::snprintf(buf, sizeof buf, "%.2f GB", bytes / 1e9);
  return buf;
}

// A cut point in [0, n): after a line break followed by printable ASCII; 0 if none.
size_t safe_cut(const std::string& text) {
  for (size_t p = text.size(); p-- > 1;) {
    const auto c = static_cast<unsigned char>(text[p]);
    if (text[p - 1] == '\n' && c >= 0x21 && c <= 0x7E) return p;
  }
  return 0;
}

// Every input is a readable regular file (a directory or a FIFO is named before any work starts).
void check_inputs(const std::vector<std::string>& inputs) {
  for (const auto& f : inputs) {
    struct stat st;
    if (::stat(f.c_str(), &st) != 0) throw std::runtime_error("--input " + f + ": cannot open: " + std::strerror(errno));
    if (!S_ISREG(st.st_mode))
      throw std::runtime_error("--input " + f + ": is " + file_kind(st.st_mode) + "; expected a text file");
  }
}

struct Piece {
  bool document_start = false;
  std::string text;
  std::vector<uint32_t> ids;
  bool done = false;
  // --jsonl: whole lines of one file from line `first_line` (1-based); ids hold an end-of-document
  // token and the text of each document; `error` the first bad line's message.
  bool jsonl = false;
  size_t file = 0;
  int64_t first_line = 0, documents = 0;
  std::string error;
};

// Encodes the JSONL lines of `p` (see Piece).
void encode_jsonl(Piece* p, const std::string& path, const std::string& field, const Tokenizer& tokenizer) {
  const std::string_view text(p->text);
  std::string doc;
  int64_t line = p->first_line;
  for (size_t start = 0; start < text.size(); ++line) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view l = text.substr(start, end - start);
    start = end + 1;
    if (l.find_first_not_of(" \t\r") == std::string_view::npos) continue;  // a blank line
    const JsonMember m = json_string_member(l, field, &doc);
    std::string why;
    switch (m.kind) {
      case JsonMember::Kind::string: break;
      case JsonMember::Kind::invalid: why = "not a JSON object: " + m.what + " at column " + std::to_string(m.column); break;
      case JsonMember::Kind::missing: why = "the object has no \"" + field + "\" member (--field names the text member)"; break;
      case JsonMember::Kind::not_string: why = "\"" + field + "\" is " + m.what + ", expected a string"; break;
    }
    if (!why.empty()) {
      p->error = path + ":" + std::to_string(line) + ": " + why;
      return;
    }
    p->ids.push_back(tokenizer.end_of_document());
    tokenizer.encode(doc, &p->ids);
    ++p->documents;
  }
}

int train(const TokenizeArgs& args) {
  check_inputs(args.inputs);
  for (const char* suffix : {".model", ".vocab"})
    check_no_link_or_special_file(args.train_prefix + suffix, "--train-sentencepiece");
  std::string inputs, extra;
  for (auto& f : args.inputs) inputs += (inputs.empty() ? "" : ",") + f;
  for (auto& o : args.spm_options) extra += " --" + o;
  const auto t0 = std::chrono::steady_clock::now();
  std::fprintf(stderr, "carry tokenize: training a SentencePiece %s model of %lld pieces on %zu file%s...\n",
               args.model_type.c_str(), static_cast<long long>(args.vocab_size), args.inputs.size(),
               args.inputs.size() == 1 ? "" : "s");
  train_sentencepiece("--input=" + inputs + " --model_prefix=" + args.train_prefix +
                      " --vocab_size=" + std::to_string(args.vocab_size) + " --model_type=" + args.model_type +
                      " --input_sentence_size=2000000 --shuffle_input_sentence=true --minloglevel=2" + extra);
  std::printf("carry tokenize: wrote %s.model and %s.vocab (%.1f s); use --tokenizer sentencepiece:%s.model\n",
              args.train_prefix.c_str(), args.train_prefix.c_str(),
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(), args.train_prefix.c_str());
  return 0;
}

}  // namespace

namespace {

// Removes the output's temporary file when a stop signal (SIGTERM, SIGINT, SIGHUP) ends the command,
// then ends it as the signal would; the previous handlers come back at the end of its scope.
char g_temp_to_remove[4096] = {};

extern "C" void remove_temp_and_die(int signo) {
  if (g_temp_to_remove[0]) ::unlink(g_temp_to_remove);
  std::signal(signo, SIG_DFL);
  std::raise(signo);
}

class RemoveOnStop {
 public:
  explicit RemoveOnStop(const std::string& path) {
    std::snprintf(g_temp_to_remove, sizeof g_temp_to_remove, "%s", path.c_str());
    struct sigaction sa {};
    sa.sa_handler = remove_temp_and_die;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < 3; ++i) ::sigaction(kSignals[i], &sa, &previous_[i]);
  }
  ~RemoveOnStop() {
    for (size_t i = 0; i < 3; ++i) ::sigaction(kSignals[i], &previous_[i], nullptr);
    g_temp_to_remove[0] = 0;
  }
  RemoveOnStop(const RemoveOnStop&) = delete;
  RemoveOnStop& operator=(const RemoveOnStop&) = delete;

 private:
  static constexpr int kSignals[3] = {SIGTERM, SIGINT, SIGHUP};
  struct sigaction previous_[3] {};
};

// Blocks SIGTERM, SIGINT and SIGHUP in this thread for its lifetime (a signal that comes meanwhile is
// delivered when it ends).
class BlockStops {
 public:
  BlockStops() {
    sigset_t stops;
    sigemptyset(&stops);
    for (int s : {SIGTERM, SIGINT, SIGHUP}) sigaddset(&stops, s);
    ::pthread_sigmask(SIG_BLOCK, &stops, &previous_);
  }
  ~BlockStops() { ::pthread_sigmask(SIG_SETMASK, &previous_, nullptr); }
  BlockStops(const BlockStops&) = delete;
  BlockStops& operator=(const BlockStops&) = delete;

 private:
  sigset_t previous_;
};

}  // namespace

int run_tokenize_command(int argc, char** argv) {
  CommandArgs command_args(argc, argv);
  if (command_args.help()) {
    std::fputs(kUsage, stdout);
    return 0;
  }
  TokenizeArgs args;
  try {
    args = parse(command_args);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "carry tokenize: %s\n%s", e.what(), kUsage);
    return 2;
  }
  try {
    if (!args.train_prefix.empty()) return train(args);
    check_inputs(args.inputs);
    auto tokenizer = load_tokenizer(args.tokenizer, args.eod_id);
    const bool whole_files = !args.jsonl && args.tokenizer.rfind("sentencepiece:", 0) == 0;
    const int threads = args.threads > 0 ? args.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    const uint32_t eod = tokenizer->end_of_document();
    const int width = std::max<int64_t>(tokenizer->vocab_size(), int64_t{eod} + 1) <= 65536 ? 2 : 4;
    // The temporary file and the handler that removes it on a stop signal come into being together:
    // a signal in between waits (blocked) until the handler is in place.
    std::optional<TokenFileWriter> output;
    std::optional<RemoveOnStop> remove_on_stop;
    {
      BlockStops block;
      output.emplace(args.output, width);
      remove_on_stop.emplace(output->temp_path());
    }
    TokenFileWriter& writer = *output;

    // The pipeline: pieces in input order; the reader adds, the workers encode, this thread writes.
    std::mutex mu;
    std::condition_variable changed;
    std::deque<Piece> window;       // pieces not yet written, in order
    size_t first_index = 0;         // index of window.front()
    size_t next_to_encode = 0;      // index of the next piece a worker takes
    bool reading_done = false, failed = false;
    std::exception_ptr failure;
    const size_t max_window = static_cast<size_t>(2 * threads + 2);
    const size_t kPieceBytes = static_cast<size_t>(args.piece_bytes);
    std::atomic<double> bytes_read{0};

    auto fail = [&](std::exception_ptr e) {
      std::lock_guard<std::mutex> lock(mu);
      if (!failed) failed = true, failure = e;
      changed.notify_all();
    };
    auto push = [&](Piece p) {  // blocks while the window is full
      std::unique_lock<std::mutex> lock(mu);
      changed.wait(lock, [&] { return failed || window.size() < max_window; });
      if (failed) return false;
      window.push_back(std::move(p));
      changed.notify_all();
      return true;
    };
    std::thread reader([&] {
      try {
        std::vector<char> block(std::min<size_t>(kPieceBytes, size_t{1} << 20));
        for (size_t file = 0; file < args.inputs.size(); ++file) {
          const auto& path = args.inputs[file];
          std::FILE* in = std::fopen(path.c_str(), "rb");
          if (!in) throw std::runtime_error(path + ": cannot open: " + std::strerror(errno));
          std::string pending;
          bool first = true, ok = true;
          int64_t line = 1;  // --jsonl: the line pending starts at
          auto jsonl_piece = [&](size_t cut) {
            Piece p;
            p.jsonl = true;
            p.file = file;
            p.first_line = line;
            p.text = pending.substr(0, cut);
            line += std::count(p.text.begin(), p.text.end(), '\n');
            pending.erase(0, cut);
            return push(std::move(p));
          };
          size_t n;
          while (ok && (n = std::fread(block.data(), 1, block.size(), in)) > 0) {
            pending.append(block.data(), n);
            bytes_read = bytes_read + static_cast<double>(n);
            if (whole_files || pending.size() < kPieceBytes) continue;
            if (args.jsonl) {  // after the last line break: any line break ends a document
              const size_t nl = pending.rfind('\n');
              if (nl != std::string::npos) ok = jsonl_piece(nl + 1);
              continue;
            }
            const size_t cut = tokenizer->vocab_size() == 257 && args.tokenizer == "byte" ? pending.size() : safe_cut(pending);
            if (cut == 0) continue;  // no safe place yet: read on
            Piece p;
            p.document_start = first;
            p.text = pending.substr(0, cut);
            pending.erase(0, cut);
            first = false;
            ok = push(std::move(p));
          }
          const bool read_error = std::ferror(in);
          std::fclose(in);
          if (read_error) throw std::runtime_error(path + ": read error");
          if (!ok) return;
          if (args.jsonl) {
            if (!pending.empty() && !jsonl_piece(pending.size())) return;
            continue;
          }
          Piece p;
          p.document_start = first;
          p.text = std::move(pending);
          if (!push(std::move(p))) return;
        }
        std::lock_guard<std::mutex> lock(mu);
        reading_done = true;
        changed.notify_all();
      } catch (...) {
        fail(std::current_exception());
      }
    });
    std::vector<std::thread> workers;
    for (int t = 0; t < threads; ++t)
      workers.emplace_back([&] {
        try {
          while (true) {
            Piece* p = nullptr;
            {
              std::unique_lock<std::mutex> lock(mu);
              changed.wait(lock, [&] {
                return failed || next_to_encode < first_index + window.size() || reading_done;
              });
              if (failed) return;
              if (next_to_encode >= first_index + window.size()) {
                if (reading_done) return;
                continue;
              }
              p = &window[next_to_encode - first_index];  // deque: stable while elements are only added at the back
              ++next_to_encode;
            }
            std::vector<uint32_t> ids;
            if (p->jsonl) {
              Piece q;  // encoded outside the lock; only this worker touches p's text meanwhile
              q.first_line = p->first_line;
              q.text = std::move(p->text);
              encode_jsonl(&q, args.inputs[p->file], args.field, *tokenizer);
              ids = std::move(q.ids);
              std::lock_guard<std::mutex> lock(mu);
              p->documents = q.documents;
              p->error = std::move(q.error);
            } else {
              tokenizer->encode(p->text, &ids);
            }
            std::lock_guard<std::mutex> lock(mu);
            p->ids = std::move(ids);
            p->text.clear();
            p->text.shrink_to_fit();
            p->done = true;
            changed.notify_all();
          }
        } catch (...) {
          fail(std::current_exception());
        }
      });
    // Write in order, with a progress line every 5 s. A failed write (a full disk) stops the reader and
    // the workers before it is reported: they are joined, never left running.
    const auto t0 = std::chrono::steady_clock::now();
    int64_t documents = 0;
    try {
      auto last = t0;
      while (true) {
        Piece p;
        {
          std::unique_lock<std::mutex> lock(mu);
          changed.wait_for(lock, std::chrono::milliseconds(500), [&] {
            return failed || (!window.empty() && window.front().done) || (reading_done && window.empty());
          });
          if (failed) break;
          if (window.empty() && reading_done) break;
          if (window.empty() || !window.front().done) {
            lock.unlock();
            auto now = std::chrono::steady_clock::now();
            if (now - last > std::chrono::seconds(5)) {
              last = now;
              const double s = std::chrono::duration<double>(now - t0).count();
              std::fprintf(stderr, "carry tokenize: %s read, %lld tokens written, %.0f s\n", megabytes(bytes_read).c_str(),
                           static_cast<long long>(writer.count()), s);
            }
            continue;
          }
          p = std::move(window.front());
          window.pop_front();
          ++first_index;
          changed.notify_all();
        }
        if (!p.error.empty()) throw std::runtime_error(p.error);
        documents += p.documents;
        if (p.document_start) {
          writer.append(eod);
          ++documents;
        }
        if (!p.ids.empty()) writer.append(p.ids.data(), p.ids.size());
      }
    } catch (...) {
      fail(std::current_exception());
    }
    reader.join();
    for (auto& w : workers) w.join();
    if (failure) std::rethrow_exception(failure);
    writer.commit();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("carry tokenize: wrote %s: %lld tokens, %lld document%s from %zu file%s, %s (%.1f s, %.1f MB/s, %d thread%s)\n"
                "  tokenizer: %s; vocabulary %lld (model.vocab_size must be at least this), end of document %u\n",
                args.output.c_str(), static_cast<long long>(writer.count()), static_cast<long long>(documents),
                documents == 1 ? "" : "s", args.inputs.size(), args.inputs.size() == 1 ? "" : "s",
                megabytes(bytes_read).c_str(), s, s > 0 ? bytes_read / 1e6 / s : 0.0, threads, threads == 1 ? "" : "s",
                tokenizer->description().c_str(), static_cast<long long>(tokenizer->vocab_size()), eod);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "carry tokenize: %s\n", error_text(e).c_str());
    return 1;
  }
}

}  // namespace carry
