// Tokenizers (see tokenizer.h): the byte tokenizer, carry's byte-level BPE (loaded from tokenizer.json
// or a tiktoken rank file) and the SentencePiece wrapper.
#include "framework/data/tokenizer.h"
#include "framework/printable.h"
#include "layers/core/knobs.h"

#include "framework/data/pretokenize.h"
#include "framework/data/regex_split.h"
#include "framework/data/sentencepiece_json.h"
#include "framework/io/json.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <dlfcn.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <array>
#include <fstream>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <unordered_map>

namespace carry {

namespace {

std::runtime_error error(const std::string& path, const std::string& what) { return std::runtime_error(path + ": " + what); }

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw error(path, "cannot open");
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

// ---- the byte tokenizer ----

class ByteTokenizer final : public Tokenizer {
 public:
  std::string description() const override { return "byte-level (one token a byte)"; }
  int64_t vocab_size() const override { return 257; }
  uint32_t end_of_document() const override { return 256; }
  void encode(std::string_view text, std::vector<uint32_t>* out) const override {
    for (unsigned char c : text) out->push_back(c);
  }
  std::string decode(const std::vector<uint32_t>& ids) const override {
    std::string s;
    for (auto id : ids) s += id < 256 ? std::string(1, static_cast<char>(id)) : "<EOD>";
    return s;
  }
};

// ---- byte-level BPE ----

// GPT-2's map from bytes to printable characters: the printable Latin-1 bytes (! .. ~, ¡ .. ¬, ® .. ÿ)
// stand for themselves, the other 68 bytes in order for U+0100, U+0101, ...
const std::array<char32_t, 256>& byte_to_char() {
  static const std::array<char32_t, 256> map = [] {
    std::array<char32_t, 256> m{};
    char32_t next = 256;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      m[b] = printable ? static_cast<char32_t>(b) : next++;
    }
    return m;
  }();
  return map;
}

// A vocabulary entry written in GPT-2's characters -> its bytes; false if some character is not one of them.
bool chars_to_bytes(const std::string& utf8, std::string* bytes) {
  static const std::vector<int> inverse = [] {
    std::vector<int> inv(512, -1);
    for (int b = 0; b < 256; ++b) inv[byte_to_char()[b]] = b;
    return inv;
  }();
  bytes->clear();
  for (size_t i = 0; i < utf8.size();) {
    const auto b = static_cast<unsigned char>(utf8[i]);
    char32_t c;
    int len;
    if (b < 0x80) c = b, len = 1;
    else if ((b >> 5) == 6 && i + 1 < utf8.size()) c = ((b & 0x1F) << 6) | (utf8[i + 1] & 0x3F), len = 2;
    else return false;
    if (c >= inverse.size() || inverse[c] < 0) return false;
    bytes->push_back(static_cast<char>(inverse[c]));
    i += static_cast<size_t>(len);
  }
  return true;
}

class ByteBpe final : public Tokenizer {
 public:
  std::string description_text;
  std::vector<std::string> token_bytes;                 // id -> bytes ("" for ids without bytes)
  std::unordered_map<std::string, uint32_t> id_of;      // bytes -> id
  struct Merge {
    uint32_t rank, id;
  };
  std::unordered_map<uint64_t, Merge> merges;           // (left id, right id) -> rank, merged id
  std::array<uint32_t, 256> byte_id{};
  SplitPattern pattern = SplitPattern::gpt2;
  // A Split regex other than the two hand-written ones, run by Oniguruma (regex_split.h); null: `pattern`.
  std::shared_ptr<const RegexSplitter> regex;
  Normalization norm = Normalization::none;  // the tokenizer.json's normalizer (NFC, NFKC), by utf8proc
  bool ignore_merges = false;  // a piece that is a whole token is that token (Llama 3's tokenizer.json)
  int64_t vocab = 0;
  uint32_t eod = 0;

  static uint64_t key(uint32_t a, uint32_t b) { return (static_cast<uint64_t>(a) << 32) | b; }

  std::string description() const override { return description_text; }
  int64_t vocab_size() const override { return vocab; }
  uint32_t end_of_document() const override { return eod; }

  void encode(std::string_view raw, std::vector<uint32_t>* out) const override {
    std::string normalized;
    std::string_view text = raw;
    if (norm != Normalization::none) text = normalized = normalize_text(raw, norm);
    std::vector<std::string_view> pieces;
    if (regex) regex->split(text, &pieces);
    else pretokenize(text, pattern, &pieces);
    std::unordered_map<std::string_view, std::vector<uint32_t>> cache;  // pieces point into `text`
    std::vector<uint32_t> ids, next;
    for (auto piece : pieces) {
      if (auto it = cache.find(piece); it != cache.end()) {
        out->insert(out->end(), it->second.begin(), it->second.end());
        continue;
      }
      merge(piece, &ids, &next);
      out->insert(out->end(), ids.begin(), ids.end());
      if (piece.size() <= 256) cache.emplace(piece, ids);
    }
  }

  void merge(std::string_view piece, std::vector<uint32_t>* ids, std::vector<uint32_t>* next) const {
    ids->clear();
    if (ignore_merges) {
      if (auto it = id_of.find(std::string(piece)); it != id_of.end()) {
        ids->push_back(it->second);
        return;
      }
    }
    for (unsigned char c : piece) ids->push_back(byte_id[c]);
    while (ids->size() >= 2) {
      uint32_t best_rank = std::numeric_limits<uint32_t>::max(), merged = 0;
      size_t best = ids->size();
      for (size_t k = 0; k + 1 < ids->size(); ++k) {
        auto it = merges.find(key((*ids)[k], (*ids)[k + 1]));
        if (it != merges.end() && it->second.rank < best_rank) best_rank = it->second.rank, merged = it->second.id, best = k;
      }
      if (best == ids->size()) break;
      const uint32_t a = (*ids)[best], b = (*ids)[best + 1];
      next->clear();
      for (size_t k = 0; k < ids->size();) {
        if (k + 1 < ids->size() && (*ids)[k] == a && (*ids)[k + 1] == b) {
          next->push_back(merged);
          k += 2;
        } else {
          next->push_back((*ids)[k++]);
        }
      }
      ids->swap(*next);
    }
  }

  std::string decode(const std::vector<uint32_t>& ids) const override {
    std::string s;
    for (auto id : ids) s += id < token_bytes.size() ? token_bytes[id] : "";
    return s;
  }

  // After token_bytes/id_of are filled: the ids of the 256 single bytes must all exist.
  void find_byte_ids(const std::string& path) {
    for (int b = 0; b < 256; ++b) {
      auto it = id_of.find(std::string(1, static_cast<char>(b)));
      if (it == id_of.end())
        throw error(path, "the vocabulary has no token for the byte " + std::to_string(b) +
                              ": not a byte-level BPE (every byte must be a token)");
      byte_id[b] = it->second;
    }
  }
};

const google::protobuf::Value* field(const google::protobuf::Value& v, const std::string& name) {
  if (v.kind_case() != google::protobuf::Value::kStructValue) return nullptr;
  auto& f = v.struct_value().fields();
  auto it = f.find(name);
  return it == f.end() || it->second.kind_case() == google::protobuf::Value::kNullValue ? nullptr : &it->second;
}

std::string string_field(const google::protobuf::Value& v, const std::string& name) {
  auto* f = field(v, name);
  return f && f->kind_case() == google::protobuf::Value::kStringValue ? f->string_value() : "";
}

// The pre-tokenizer of a tokenizer.json: ByteLevel with its regex, or Split(regex) + ByteLevel.
SplitPattern pattern_of(const google::protobuf::Value& pre, const std::string& path, std::string* general) {
  const std::string type = string_field(pre, "type");
  auto unsupported = [&](const std::string& why) {
    return error(path, "pre_tokenizer: " + why +
                           "; supported: ByteLevel (GPT-2's regex), or Sequence[Split(a regex, Isolated), "
                           "ByteLevel(use_regex: false)]");
  };
  if (type == "ByteLevel") {
    auto* add_prefix = field(pre, "add_prefix_space");
    if (add_prefix && add_prefix->bool_value()) throw unsupported("ByteLevel with add_prefix_space: true");
    auto* use_regex = field(pre, "use_regex");
    if (use_regex && !use_regex->bool_value()) throw unsupported("ByteLevel without its regex and no Split before it");
    return SplitPattern::gpt2;
  }
  if (type == "Sequence") {
    auto* list = field(pre, "pretokenizers");
    if (!list || list->kind_case() != google::protobuf::Value::kListValue) throw unsupported("a Sequence without pretokenizers");
    const auto& items = list->list_value().values();
    if (items.size() == 1) return pattern_of(items[0], path, general);
    if (items.size() != 2 || string_field(items[0], "type") != "Split" || string_field(items[1], "type") != "ByteLevel")
      throw unsupported("a Sequence of other pre-tokenizers");
    auto* use_regex = field(items[1], "use_regex");
    if (use_regex && use_regex->bool_value()) throw unsupported("Split followed by ByteLevel with its own regex");
    auto* pat = field(items[0], "pattern");
    const std::string regex = pat ? string_field(*pat, "Regex") : "";
    const std::string behavior = string_field(items[0], "behavior");
    if (behavior != "Isolated") throw unsupported("Split with behavior '" + behavior + "' (expected Isolated)");
    for (auto p : {SplitPattern::gpt2, SplitPattern::cl100k})
      if (regex == split_pattern_regex(p)) return p;
    if (regex.empty()) throw unsupported("Split without a pattern Regex");
    if (auto* invert = field(items[0], "invert"); invert && invert->bool_value()) throw unsupported("Split with invert: true");
    if (!regex_split_available())
      throw unsupported("Split with the regex " + regex + " (other regexes need Oniguruma and utf8proc: install "
                        "libonig-dev and libutf8proc-dev and rebuild, as launcher/setup does)");
    *general = regex;
    return SplitPattern::gpt2;
  }
  throw unsupported("type '" + type + "'");
}

std::unique_ptr<Tokenizer> load_tokenizer_json(const std::string& path, int64_t eod_override) {
  google::protobuf::Value root;
  const std::string text = read_file(path);
  auto status = google::protobuf::util::JsonStringToMessage(text, &root);
  if (!status.ok()) throw error(path, "not valid JSON: " + std::string(status.message()));
  auto* model = field(root, "model");
  if (!model) throw error(path, "no \"model\" object: not a Hugging Face tokenizer.json");
  const std::string type = string_field(*model, "type");
  if (type != "BPE")
    throw error(path, "model.type is '" + type + "'; carry reads byte-level BPE models (type BPE) from tokenizer.json "
                      "(a SentencePiece model: use sentencepiece:FILE.model)");
  Normalization norm = Normalization::none;
  if (auto* n = field(root, "normalizer")) {
    const google::protobuf::Value* one = n;
    if (string_field(*n, "type") == "Sequence") {  // a Sequence of one normalizer reads as that one
      auto* list = field(*n, "normalizers");
      const bool single = list && list->kind_case() == google::protobuf::Value::kListValue &&
                          list->list_value().values_size() == 1;
      one = single ? &list->list_value().values(0) : nullptr;
    }
    const std::string type = one ? string_field(*one, "type") : "Sequence";
    if (type == "NFC") norm = Normalization::nfc;
    else if (type == "NFKC") norm = Normalization::nfkc;
    else
      throw error(path, "has a normalizer (" + type + "), which carry does not apply; supported: none, NFC, NFKC");
    if (!regex_split_available())
      throw error(path, "has a normalizer (" + type + "), which needs utf8proc: install libonig-dev and "
                        "libutf8proc-dev and rebuild, as launcher/setup does");
  }
  auto* pre = field(root, "pre_tokenizer");
  if (!pre) throw error(path, "no pre_tokenizer: not a byte-level BPE");
  auto bpe = std::make_unique<ByteBpe>();
  bpe->norm = norm;
  std::string general;
  bpe->pattern = pattern_of(*pre, path, &general);
  if (!general.empty()) {
    try {
      bpe->regex = std::make_shared<const RegexSplitter>(general);
    } catch (const std::runtime_error& e) {
      throw error(path, std::string("pre_tokenizer: ") + e.what());
    }
  }
  if (auto* im = field(*model, "ignore_merges")) bpe->ignore_merges = im->bool_value();

  // Added tokens (special tokens): literal strings, not in GPT-2's characters.
  std::unordered_map<std::string, int64_t> added;
  if (auto* list = field(root, "added_tokens"); list && list->kind_case() == google::protobuf::Value::kListValue)
    for (auto& t : list->list_value().values())
      if (auto* id = field(t, "id")) added[string_field(t, "content")] = static_cast<int64_t>(id->number_value());

  auto* vocab = field(*model, "vocab");
  if (!vocab || vocab->kind_case() != google::protobuf::Value::kStructValue) throw error(path, "model.vocab is not an object");
  int64_t max_id = -1;
  std::string bytes;
  for (auto& [token, id_value] : vocab->struct_value().fields()) {
    const double idd = id_value.number_value();
    if (!(idd >= 0 && idd < 1 << 30) || idd != static_cast<double>(static_cast<int64_t>(idd)))
      throw error(path, "model.vocab: the id of '" + token + "' is not a valid id");
    const auto id = static_cast<int64_t>(idd);
    max_id = std::max(max_id, id);
    if (!chars_to_bytes(token, &bytes)) {
      if (added.count(token)) continue;  // a special token listed in the vocabulary too
      throw error(path, "model.vocab: '" + token + "' is not written in GPT-2's byte characters: not a byte-level BPE");
    }
    if (bpe->token_bytes.size() <= static_cast<size_t>(id)) bpe->token_bytes.resize(id + 1);
    bpe->token_bytes[id] = bytes;
    bpe->id_of[bytes] = static_cast<uint32_t>(id);
  }
  for (auto& [content, id] : added) max_id = std::max(max_id, id);
  bpe->vocab = max_id + 1;
  bpe->find_byte_ids(path);

  auto* merges = field(*model, "merges");
  if (!merges || merges->kind_case() != google::protobuf::Value::kListValue) throw error(path, "model.merges is not a list");
  uint32_t rank = 0;
  std::string left, right, lb, rb;
  for (auto& m : merges->list_value().values()) {
    if (m.kind_case() == google::protobuf::Value::kStringValue) {  // "a b"
      const auto& s = m.string_value();
      auto space = s.find(' ');
      if (space == std::string::npos) throw error(path, "model.merges[" + std::to_string(rank) + "]: '" + s + "' is not \"left right\"");
      left = s.substr(0, space), right = s.substr(space + 1);
    } else if (m.kind_case() == google::protobuf::Value::kListValue && m.list_value().values_size() == 2) {  // ["a", "b"]
      left = m.list_value().values(0).string_value(), right = m.list_value().values(1).string_value();
    } else {
      throw error(path, "model.merges[" + std::to_string(rank) + "] is neither \"left right\" nor [left, right]");
    }
    if (!chars_to_bytes(left, &lb) || !chars_to_bytes(right, &rb))
      throw error(path, "model.merges[" + std::to_string(rank) + "]: not in GPT-2's byte characters");
    auto l = bpe->id_of.find(lb), r = bpe->id_of.find(rb), t = bpe->id_of.find(lb + rb);
    if (l == bpe->id_of.end() || r == bpe->id_of.end() || t == bpe->id_of.end())
      throw error(path, "model.merges[" + std::to_string(rank) + "] ('" + left + "' + '" + right +
                            "'): a part or the merged token is not in the vocabulary");
    bpe->merges.emplace(ByteBpe::key(l->second, r->second), ByteBpe::Merge{rank, t->second});
    ++rank;
  }

  if (eod_override >= 0) {
    bpe->eod = static_cast<uint32_t>(eod_override);
    bpe->vocab = std::max<int64_t>(bpe->vocab, eod_override + 1);  // an id past the merges' tokens
  } else {
    bool found = false;
    for (const char* name : {"<|endoftext|>", "<|end_of_text|>", "</s>"})
      if (auto it = added.find(name); it != added.end()) {
        bpe->eod = static_cast<uint32_t>(it->second), found = true;
        break;
      }
    if (!found)
      throw error(path, "no end-of-document token among the added tokens (looked for <|endoftext|>, <|end_of_text|>, "
                        "</s>); give its id with --eod-id");
  }
  bpe->description_text = "byte-level BPE " + path + " (" + std::to_string(rank) + " merges, " +
                          (bpe->regex ? "its own regex" : bpe->pattern == SplitPattern::gpt2 ? "GPT-2" : "cl100k/Llama 3") +
                          " pre-tokenizer" + (norm == Normalization::nfc ? ", NFC" : norm == Normalization::nfkc ? ", NFKC" : "") +
                          ")";
  return bpe;
}

int base64_value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

bool base64_decode(const std::string& s, std::string* out) {
  out->clear();
  uint32_t acc = 0;
  int bits = 0;
  for (char c : s) {
    if (c == '=') break;
    int v = base64_value(c);
    if (v < 0) return false;
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out->push_back(static_cast<char>((acc >> bits) & 0xFF));
    }
  }
  return true;
}

std::unique_ptr<Tokenizer> load_tiktoken(const std::string& path, SplitPattern pattern, int64_t eod) {
  std::ifstream in(path);
  if (!in) throw error(path, "cannot open");
  auto bpe = std::make_unique<ByteBpe>();
  bpe->pattern = pattern;
  std::string line, bytes;
  int64_t line_no = 0, max_id = -1;
  while (std::getline(in, line)) {
    ++line_no;
    if (line.empty()) continue;
    std::istringstream fields(line);
    std::string b64;
    int64_t rank = -1;
    if (!(fields >> b64 >> rank) || rank < 0 || !base64_decode(b64, &bytes) || bytes.empty())
      throw error(path + ":" + std::to_string(line_no), "expected \"<base64 bytes> <rank>\", got '" + printable(line.substr(0, 80), false) + "'");
    if (bpe->token_bytes.size() <= static_cast<size_t>(rank)) bpe->token_bytes.resize(rank + 1);
    bpe->token_bytes[rank] = bytes;
    bpe->id_of[bytes] = static_cast<uint32_t>(rank);
    max_id = std::max(max_id, rank);
  }
  bpe->find_byte_ids(path);
  // Merges implied by the ranks: a pair whose concatenation is a token merges into it, at that token's rank.
  for (size_t id = 0; id < bpe->token_bytes.size(); ++id) {
    const std::string& t = bpe->token_bytes[id];
    for (size_t k = 1; k < t.size(); ++k) {
      auto l = bpe->id_of.find(t.substr(0, k)), r = bpe->id_of.find(t.substr(k));
      if (l != bpe->id_of.end() && r != bpe->id_of.end())
        bpe->merges.emplace(ByteBpe::key(l->second, r->second), ByteBpe::Merge{static_cast<uint32_t>(id), static_cast<uint32_t>(id)});
    }
  }
  if (eod < 0)
    throw error(path, "a tiktoken file lists no special tokens: give the end-of-document id with --eod-id (e.g. 100257 "
                      "for cl100k_base, 128001 for Llama 3)");
  bpe->eod = static_cast<uint32_t>(eod);
  bpe->vocab = std::max(max_id, eod) + 1;
  bpe->description_text = "tiktoken " + path + " (" + std::to_string(bpe->id_of.size()) + " tokens, " +
                          (pattern == SplitPattern::gpt2 ? "GPT-2" : "cl100k/Llama 3") + " pre-tokenizer)";
  return bpe;
}

// ---- SentencePiece, through libcarry_sentencepiece.so (framework/data/sentencepiece_shim.cpp) ----

struct SentencePieceLibrary {
  void* handle = nullptr;
  std::string error;  // why it could not be opened
  void* (*load)(const char*, char*, size_t) = nullptr;
  void (*free)(void*) = nullptr;
  int64_t (*piece_size)(void*) = nullptr;
  int64_t (*eos_id)(void*) = nullptr;
  int (*encode)(void*, const char*, size_t, void (*)(void*, const int*, size_t), void*, char*, size_t) = nullptr;
  int (*decode)(void*, const int*, size_t, void (*)(void*, const char*, size_t), void*) = nullptr;
  int (*train)(const char*, char*, size_t) = nullptr;
};

// The library beside the running program (or CARRY_SENTENCEPIECE_LIB), opened once.
const SentencePieceLibrary& sentencepiece_library() {
  static const SentencePieceLibrary lib = [] {
    SentencePieceLibrary l;
    std::string path;
    if (const char* env = knob_value("CARRY_SENTENCEPIECE_LIB")) {
      path = env;
    } else {
      char exe[4096];
      ssize_t n = ::readlink("/proc/self/exe", exe, sizeof exe - 1);
      std::string dir = n > 0 ? std::string(exe, static_cast<size_t>(n)) : std::string(".");
      dir = dir.substr(0, dir.rfind('/'));
      path = dir + "/libcarry_sentencepiece.so";
    }
    // A link-map namespace of its own: libsentencepiece's protobuf and the system's never meet
    // (RTLD_DEEPBIND is not enough: it binds the library to libstdc++'s own std::cerr instead of the
    // program's copy, and its first log line crashes).
    l.handle = ::dlmopen(LM_ID_NEWLM, path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!l.handle) {
      const char* why = ::dlerror();
      l.error = "cannot open " + path + " (" + (why ? why : "?") +
                "): this build of carry has no SentencePiece; install libsentencepiece-dev (launcher/setup does on "
                "Debian) and build again";
      return l;
    }
    auto sym = [&](const char* name) {
      void* p = ::dlsym(l.handle, name);
      if (!p && l.error.empty()) l.error = path + ": no symbol " + name;
      return p;
    };
    l.load = reinterpret_cast<decltype(l.load)>(sym("carry_spm_load"));
    l.free = reinterpret_cast<decltype(l.free)>(sym("carry_spm_free"));
    l.piece_size = reinterpret_cast<decltype(l.piece_size)>(sym("carry_spm_piece_size"));
    l.eos_id = reinterpret_cast<decltype(l.eos_id)>(sym("carry_spm_eos_id"));
    l.encode = reinterpret_cast<decltype(l.encode)>(sym("carry_spm_encode"));
    l.decode = reinterpret_cast<decltype(l.decode)>(sym("carry_spm_decode"));
    l.train = reinterpret_cast<decltype(l.train)>(sym("carry_spm_train"));
    return l;
  }();
  if (!lib.error.empty()) throw std::runtime_error(lib.error);
  return lib;
}

// SentencePiece's status text without the library's source location and condition ("Internal:
// ./src/x.cc(1101) [cond] what" -> "what"), printable; `fallback` when nothing else is left.
std::string sentencepiece_reason(const std::string& raw, const std::string& fallback) {
  std::string s = raw;
  const auto colon = s.find(": ");
  if (colon != std::string::npos && colon < 24) s = s.substr(colon + 2);  // the status code's name
  const auto cc = s.find(".cc(");
  if (cc != std::string::npos) {
    const auto close = s.find(')', cc);
    s = close == std::string::npos ? std::string() : s.substr(close + 1);
  }
  while (!s.empty() && s.front() == ' ') s.erase(0, 1);
  if (!s.empty() && s.front() == '[') {
    const auto end = s.find("] ");
    s = end == std::string::npos ? std::string() : s.substr(end + 2);
  }
  while (!s.empty() && (s.back() == ' ' || s.back() == '\n')) s.pop_back();
  return s.empty() ? fallback : printable(s.substr(0, 300), false);
}

class SentencePieceTokenizer final : public Tokenizer {
 public:
  SentencePieceTokenizer(const std::string& path, int64_t eod) : lib_(sentencepiece_library()), path_(path) {
    char message[1024] = "";
    model_ = lib_.load(path.c_str(), message, sizeof message);
    if (!model_) {
      struct stat st;
      const bool there = ::stat(path.c_str(), &st) == 0;
      throw error(path, std::string("cannot load the SentencePiece model: ") +
                            (there ? sentencepiece_reason(message, "not a SentencePiece model file (a serialized "
                                                                   "ModelProto, as spm_train writes)")
                                   : std::strerror(errno)));
    }
    pieces_ = lib_.piece_size(model_);
    if (eod >= 0) {
      eod_ = static_cast<uint32_t>(eod);
    } else if (lib_.eos_id(model_) >= 0) {
      eod_ = static_cast<uint32_t>(lib_.eos_id(model_));
    } else {
      lib_.free(model_);
      throw error(path, "the SentencePiece model has no end-of-sentence piece (eos_id is -1); give the "
                        "end-of-document id with --eod-id");
    }
  }
  ~SentencePieceTokenizer() override { lib_.free(model_); }
  std::string description() const override { return "SentencePiece " + path_; }
  int64_t vocab_size() const override { return std::max<int64_t>(pieces_, int64_t{eod_} + 1); }
  uint32_t end_of_document() const override { return eod_; }
  void encode(std::string_view text, std::vector<uint32_t>* out) const override {
    char message[1024] = "";
    auto sink = [](void* ctx, const int* ids, size_t n) {
      auto* v = static_cast<std::vector<uint32_t>*>(ctx);
      for (size_t i = 0; i < n; ++i) v->push_back(static_cast<uint32_t>(ids[i]));
    };
    if (lib_.encode(model_, text.data(), text.size(), sink, out, message, sizeof message) != 0)
      throw error(path_, std::string("SentencePiece could not encode a document: ") + message);
  }
  std::string decode(const std::vector<uint32_t>& ids) const override {
    std::vector<int> v(ids.begin(), ids.end());
    std::string s;
    auto sink = [](void* ctx, const char* text, size_t n) { static_cast<std::string*>(ctx)->assign(text, n); };
    lib_.decode(model_, v.data(), v.size(), sink, &s);
    return s;
  }

 private:
  const SentencePieceLibrary& lib_;
  std::string path_;
  void* model_ = nullptr;
  int64_t pieces_ = 0;
  uint32_t eod_ = 0;
};

}  // namespace

bool sentencepiece_available() {
  try {
    sentencepiece_library();
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

void train_sentencepiece(const std::string& flags) {
  const auto& lib = sentencepiece_library();
  char message[1024] = "";
  if (lib.train(flags.c_str(), message, sizeof message) != 0)
    throw std::runtime_error(std::string("SentencePiece training failed: ") +
                             sentencepiece_reason(message, "the library gave no reason") +
                             (std::strstr(message, "Vocabulary size") ? " (give a smaller --vocab-size, or more text)" : ""));
}

namespace {

std::string utf8_of(char32_t c) {
  std::string s;
  if (c < 0x80) s += static_cast<char>(c);
  else s += static_cast<char>(0xC0 | (c >> 6)), s += static_cast<char>(0x80 | (c & 0x3F));  // below U+0800 here
  return s;
}

}  // namespace

HfTokenizer hf_tokenizer(const std::string& spec) {
  HfTokenizer h;
  if (spec == "byte") {
    JsonWriter j(2);
    j.begin_object();
    j.member("version", "1.0");
    j.key("truncation").null();
    j.key("padding").null();
    j.key("added_tokens").begin_array().begin_object();
    j.member("id", int64_t{256});
    j.member("content", "<|endoftext|>");
    j.member("single_word", false).member("lstrip", false).member("rstrip", false);
    j.member("normalized", false).member("special", true);
    j.end_object().end_array();
    j.key("normalizer").null();
    auto byte_level = [&](const char* key) {
      j.key(key).begin_object();
      j.member("type", "ByteLevel").member("add_prefix_space", false).member("trim_offsets", true);
      j.member("use_regex", true);
      j.end_object();
    };
    byte_level("pre_tokenizer");
    j.key("post_processor").null();
    byte_level("decoder");
    j.key("model").begin_object();
    j.member("type", "BPE");
    j.key("dropout").null();
    j.key("unk_token").null();
    j.key("continuing_subword_prefix").null();
    j.key("end_of_word_suffix").null();
    j.member("fuse_unk", false).member("byte_fallback", false).member("ignore_merges", false);
    j.key("vocab").begin_object();
    for (int b = 0; b < 256; ++b) j.member(utf8_of(byte_to_char()[b]), int64_t{b});
    j.end_object();
    j.key("merges").begin_array().end_array();
    j.end_object();
    j.end_object();
    h.tokenizer_json = j.str() + "\n";
    h.eos_token = "<|endoftext|>";
    h.eos_id = 256;
    return h;
  }
  if (spec.rfind("bpe:", 0) == 0) {
    const std::string path = spec.substr(4);
    auto tok = load_tokenizer(spec);
    h.tokenizer_json = read_file(path);
    h.eos_id = tok->end_of_document();
    google::protobuf::Value root;
    if (!google::protobuf::util::JsonStringToMessage(h.tokenizer_json, &root).ok()) throw error(path, "not valid JSON");
    if (auto* list = field(root, "added_tokens"); list && list->kind_case() == google::protobuf::Value::kListValue)
      for (auto& t : list->list_value().values())
        if (auto* id = field(t, "id"); id && static_cast<int64_t>(id->number_value()) == h.eos_id)
          h.eos_token = string_field(t, "content");
    if (h.eos_token.empty())
      throw error(path, "the end-of-document id " + std::to_string(h.eos_id) + " is not one of its added tokens");
    return h;
  }
  if (spec.rfind("sentencepiece:", 0) == 0) {
    const std::string path = spec.substr(14);
    h.sentencepiece_model = read_file(path);
    SentencePieceJson sp = sentencepiece_tokenizer_json(h.sentencepiece_model, path);
    if (sp.eos_id < 0)
      throw error(path, "the SentencePiece model has no end-of-sentence piece (eos_id is -1), which the export "
                        "names as the end of document");
    h.tokenizer_json = std::move(sp.tokenizer_json);
    h.eos_token = sp.eos_piece;
    h.eos_id = sp.eos_id;
    return h;
  }
  throw std::runtime_error("tokenizer '" + spec + "': only byte, bpe:FILE and sentencepiece:FILE tokenizers are written "
                           "as Hugging Face tokenizer.json files (a tiktoken file is not)");
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& spec, int64_t end_of_document) {
  auto colon = spec.find(':');
  const std::string kind = spec.substr(0, colon), rest = colon == std::string::npos ? "" : spec.substr(colon + 1);
  if (kind == "byte" && rest.empty()) {
    if (end_of_document >= 0 && end_of_document != 256)
      throw std::runtime_error("the byte tokenizer's end-of-document id is 256");
    return std::make_unique<ByteTokenizer>();
  }
  if (rest.empty())
    throw std::runtime_error("unknown tokenizer '" + spec + "'; expected byte, sentencepiece:MODEL, bpe:TOKENIZER.json or "
                             "tiktoken:FILE[:gpt2|cl100k]");
  if (kind == "sentencepiece") return std::make_unique<SentencePieceTokenizer>(rest, end_of_document);
  if (kind == "bpe") return load_tokenizer_json(rest, end_of_document);
  if (kind == "tiktoken") {
    auto c2 = rest.rfind(':');
    SplitPattern pattern = SplitPattern::cl100k;
    std::string file = rest;
    if (c2 != std::string::npos) {
      try {
        pattern = split_pattern_by_name(rest.substr(c2 + 1));
        file = rest.substr(0, c2);
      } catch (const std::invalid_argument&) {
        // a colon inside the file name
      }
    }
    return load_tiktoken(file, pattern, end_of_document);
  }
  throw std::runtime_error("unknown tokenizer kind '" + kind + "' in '" + spec +
                           "'; expected byte, sentencepiece:MODEL, bpe:TOKENIZER.json or tiktoken:FILE[:gpt2|cl100k]");
}

}  // namespace carry
