// `carry tokenize` (see tokenize_command.h): streams each input through a 1 MiB buffer into a
// TokenFileWriter, so inputs of any size use constant memory; the output appears (by rename) only
// once complete.
#include "framework/cli/tokenize_command.h"

#include "framework/cli/error_text.h"
#include "framework/data/token_file.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

namespace carry {

namespace {

const char* kUsage =
    "usage: carry tokenize --input FILE [FILE...] --output OUT.tok\n"
    "  Turns text files into one token file with the byte-level tokenizer: token = byte value (0..255),\n"
    "  and the end-of-document token 256 between consecutive files (vocabulary 257, 2 bytes a token).\n";

struct TokenizeArgs {
  std::vector<std::string> inputs;
  std::string output;
};

TokenizeArgs parse(int argc, char** argv) {
  TokenizeArgs a;
  for (int i = 1; i < argc; ++i) {
    std::string f = argv[i];
    if (f == "--input") {
      while (i + 1 < argc && std::strncmp(argv[i + 1], "--", 2) != 0) a.inputs.push_back(argv[++i]);
      if (a.inputs.empty()) throw std::invalid_argument("--input needs at least one file");
    } else if (f == "--output") {
      if (i + 1 >= argc) throw std::invalid_argument("--output needs a file name");
      a.output = argv[++i];
    } else {
      throw std::invalid_argument("unknown argument '" + f + "'");
    }
  }
  if (a.inputs.empty()) throw std::invalid_argument("no --input files");
  if (a.output.empty()) throw std::invalid_argument("no --output file");
  return a;
}

}  // namespace

int run_tokenize_command(int argc, char** argv) {
  for (int i = 1; i < argc; ++i)
    if (!std::strcmp(argv[i], "--help") || !std::strcmp(argv[i], "-h")) {
      std::fputs(kUsage, stdout);
      return 0;
    }
  TokenizeArgs args;
  try {
    args = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "carry tokenize: %s\n%s", e.what(), kUsage);
    return 2;
  }
  try {
    TokenFileWriter writer(args.output, 2);
    std::vector<unsigned char> bytes(1 << 20);
    std::vector<uint32_t> tokens(bytes.size());
    for (size_t f = 0; f < args.inputs.size(); ++f) {
      if (f > 0) writer.append(kByteEndOfDocument);
      auto& path = args.inputs[f];
      std::FILE* in = std::fopen(path.c_str(), "rb");
      if (!in) throw std::runtime_error(path + ": cannot open: " + std::strerror(errno));
      size_t n;
      while ((n = std::fread(bytes.data(), 1, bytes.size(), in)) > 0) {
        for (size_t i = 0; i < n; ++i) tokens[i] = bytes[i];
        writer.append(tokens.data(), n);
      }
      bool failed = std::ferror(in);
      std::fclose(in);
      if (failed) throw std::runtime_error(path + ": read error");
    }
    writer.commit();
    std::printf("carry tokenize: wrote %s: %lld tokens from %zu file%s (byte-level, vocabulary %lld)\n",
                args.output.c_str(), static_cast<long long>(writer.count()), args.inputs.size(),
                args.inputs.size() == 1 ? "" : "s", static_cast<long long>(kByteVocabSize));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "carry tokenize: %s\n", error_text(e).c_str());
    return 1;
  }
}

}  // namespace carry
