// SentencePiece ModelProto → tokenizer.json (sentencepiece_json.h says what each part becomes).
#include "framework/data/sentencepiece_json.h"

#include "framework/io/json.h"

#include <algorithm>
#include <cctype>
#include <cstring>
#include <stdexcept>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace carry {
namespace {

// ModelProto's field numbers (sentencepiece_model.proto).
enum PieceType { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };
enum ModelType { kUnigram = 1, kBpe = 2, kWord = 3, kChar = 4 };

struct Piece {
  std::string text;
  float score = 0;
  int type = kNormal;
};

struct Model {
  std::vector<Piece> pieces;
  int model_type = kUnigram;
  bool byte_fallback = false, whitespace_as_suffix = false;
  int64_t unk_id = 0, eos_id = 2;
  std::string unk_piece = "<unk>";
  std::string charsmap;
  bool add_dummy_prefix = true, remove_extra_whitespaces = true, escape_whitespaces = true;
};

// Protobuf's wire format: one message's fields in order.
class Wire {
 public:
  Wire(std::string_view bytes, const std::string& path) : s_(bytes), path_(path) {}
  bool done() const { return pos_ >= s_.size(); }
  // The next field: its number and wire type; the value is read by one of the calls below.
  std::pair<uint64_t, int> tag() {
    uint64_t t = varint();
    return {t >> 3, static_cast<int>(t & 7)};
  }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (pos_ >= s_.size()) fail("a number runs past the end of the file");
      const uint8_t b = static_cast<uint8_t>(s_[pos_++]);
      v |= uint64_t(b & 0x7f) << shift;
      if (!(b & 0x80)) return v;
    }
    fail("a number longer than ten bytes");
  }
  std::string_view bytes() {
    const uint64_t n = varint();
    if (n > s_.size() - pos_) fail("a field of " + std::to_string(n) + " bytes runs past the end of the file");
    std::string_view v = s_.substr(pos_, n);
    pos_ += n;
    return v;
  }
  float fixed32_float() {
    if (s_.size() - pos_ < 4) fail("a float runs past the end of the file");
    uint32_t u = 0;
    for (int i = 0; i < 4; ++i) u |= uint32_t(static_cast<uint8_t>(s_[pos_ + i])) << (8 * i);
    pos_ += 4;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  void skip(int wire_type) {
    switch (wire_type) {
      case 0: varint(); return;
      case 1: advance(8); return;
      case 2: bytes(); return;
      case 5: advance(4); return;
      default: fail("wire type " + std::to_string(wire_type) + ", which a SentencePiece model does not use");
    }
  }
  [[noreturn]] void fail(const std::string& what) const {
    throw std::runtime_error(path_ + ": not a SentencePiece model file (" + what + " at byte " + std::to_string(pos_) +
                             ")");
  }

 private:
  void advance(size_t n) {
    if (s_.size() - pos_ < n) fail("a field runs past the end of the file");
    pos_ += n;
  }
  std::string_view s_;
  const std::string& path_;
  size_t pos_ = 0;
};

Model parse_model(const std::string& bytes, const std::string& path) {
  Model m;
  Wire w(bytes, path);
  auto expect = [&](int got, int want, const char* field) {
    if (got != want) w.fail(std::string("field ") + field + " with wire type " + std::to_string(got));
  };
  while (!w.done()) {
    auto [field, type] = w.tag();
    if (field == 1) {  // pieces
      expect(type, 2, "pieces");
      Wire p(w.bytes(), path);
      Piece piece;
      while (!p.done()) {
        auto [f, t] = p.tag();
        if (f == 1) expect(t, 2, "piece"), piece.text = std::string(p.bytes());
        else if (f == 2) expect(t, 5, "score"), piece.score = p.fixed32_float();
        else if (f == 3) expect(t, 0, "type"), piece.type = static_cast<int>(p.varint());
        else p.skip(t);
      }
      m.pieces.push_back(std::move(piece));
    } else if (field == 2) {  // trainer_spec
      expect(type, 2, "trainer_spec");
      Wire t(w.bytes(), path);
      while (!t.done()) {
        auto [f, wt] = t.tag();
        auto int32 = [&] { return static_cast<int64_t>(static_cast<int32_t>(static_cast<uint32_t>(t.varint()))); };
        if (f == 3) m.model_type = static_cast<int>(t.varint());
        else if (f == 24) m.whitespace_as_suffix = t.varint() != 0;
        else if (f == 35) m.byte_fallback = t.varint() != 0;
        else if (f == 40) m.unk_id = int32();
        else if (f == 42) m.eos_id = int32();
        else if (f == 45) expect(wt, 2, "unk_piece"), m.unk_piece = std::string(t.bytes());
        else t.skip(wt);
      }
    } else if (field == 3) {  // normalizer_spec
      expect(type, 2, "normalizer_spec");
      Wire n(w.bytes(), path);
      while (!n.done()) {
        auto [f, wt] = n.tag();
        if (f == 2) expect(wt, 2, "precompiled_charsmap"), m.charsmap = std::string(n.bytes());
        else if (f == 3) m.add_dummy_prefix = n.varint() != 0;
        else if (f == 4) m.remove_extra_whitespaces = n.varint() != 0;
        else if (f == 5) m.escape_whitespaces = n.varint() != 0;
        else n.skip(wt);
      }
    } else {
      w.skip(type);
    }
  }
  if (m.pieces.empty()) w.fail("no pieces");
  return m;
}

std::string base64(std::string_view in) {
  static const char* abc = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve((in.size() + 2) / 3 * 4);
  for (size_t i = 0; i < in.size(); i += 3) {
    uint32_t v = uint32_t(uint8_t(in[i])) << 16;
    if (i + 1 < in.size()) v |= uint32_t(uint8_t(in[i + 1])) << 8;
    if (i + 2 < in.size()) v |= uint32_t(uint8_t(in[i + 2]));
    out += abc[(v >> 18) & 63];
    out += abc[(v >> 12) & 63];
    out += i + 1 < in.size() ? abc[(v >> 6) & 63] : '=';
    out += i + 2 < in.size() ? abc[v & 63] : '=';
  }
  return out;
}

// `s` matched literally by an Oniguruma regex: ASCII punctuation and spaces escaped.
std::string regex_literal(const std::string& s) {
  std::string out;
  for (char c : s) {
    const unsigned char u = static_cast<unsigned char>(c);
    if (u < 0x80 && !std::isalnum(u) && c != '_') out += '\\';
    out += c;
  }
  return out;
}

// The lengths in bytes of the UTF-8 characters' starts in `s` (1 ... size-1): the split points of a piece.
std::vector<size_t> char_boundaries(const std::string& s) {
  std::vector<size_t> cuts;
  for (size_t i = 1; i < s.size(); ++i)
    if ((static_cast<unsigned char>(s[i]) & 0xC0) != 0x80) cuts.push_back(i);
  return cuts;
}

void replace_normalizer(JsonWriter& j, const char* kind, const std::string& pattern, const std::string& content) {
  j.begin_object().member("type", "Replace");
  j.key("pattern").begin_object().member(kind, pattern).end_object();
  j.member("content", content).end_object();
}

}  // namespace

SentencePieceJson sentencepiece_tokenizer_json(const std::string& model_bytes, const std::string& path) {
  const Model m = parse_model(model_bytes, path);
  const int64_t n = static_cast<int64_t>(m.pieces.size());
  if (m.model_type != kUnigram && m.model_type != kBpe)
    throw std::runtime_error(path + ": a SentencePiece " + std::string(m.model_type == kWord ? "word" : "char") +
                             " model; only unigram and BPE models are written as tokenizer.json");
  if (m.whitespace_as_suffix)
    throw std::runtime_error(path + ": the model treats whitespace as a suffix (treat_whitespace_as_suffix), which "
                             "Hugging Face's Metaspace does not express; only prefix models are written as tokenizer.json");
  const std::string meta = "\xE2\x96\x81";  // U+2581, SentencePiece's escaped space

  SentencePieceJson out;
  out.eos_id = m.eos_id >= 0 && m.eos_id < n ? m.eos_id : -1;
  if (out.eos_id >= 0) out.eos_piece = m.pieces[out.eos_id].text;
  std::vector<std::string> user_defined;
  for (const Piece& p : m.pieces)
    if (p.type == kUserDefined) user_defined.push_back(p.text);

  JsonWriter j(2);
  j.begin_object();
  j.member("version", "1.0");
  j.key("truncation").null();
  j.key("padding").null();
  j.key("added_tokens").begin_array();
  for (int64_t i = 0; i < n; ++i) {
    const Piece& p = m.pieces[i];
    if (p.type != kControl && p.type != kUnknown) continue;
    j.begin_object().member("id", i).member("content", p.text);
    j.member("single_word", false).member("lstrip", false).member("rstrip", false);
    j.member("normalized", false).member("special", true).end_object();
  }
  j.end_array();

  j.key("normalizer").begin_object().member("type", "Sequence").key("normalizers").begin_array();
  if (!m.charsmap.empty()) j.begin_object().member("type", "Precompiled").member("precompiled_charsmap", base64(m.charsmap)).end_object();
  if (m.remove_extra_whitespaces) {
    replace_normalizer(j, "Regex", "\\A +| +\\z", "");
    replace_normalizer(j, "Regex", " {2,}", " ");
  }
  if (m.escape_whitespaces) replace_normalizer(j, "String", " ", meta);
  if (m.add_dummy_prefix) replace_normalizer(j, "Regex", "\\A" + meta, meta + meta);
  j.end_array().end_object();

  if (m.add_dummy_prefix || !user_defined.empty()) {
    j.key("pre_tokenizer").begin_object().member("type", "Sequence").key("pretokenizers").begin_array();
    if (m.add_dummy_prefix) {
      j.begin_object().member("type", "Metaspace").member("replacement", meta);
      j.member("prepend_scheme", "always").member("split", false).end_object();
    }
    if (!user_defined.empty()) {
      std::vector<std::string> sorted = user_defined;
      std::stable_sort(sorted.begin(), sorted.end(), [](const std::string& a, const std::string& b) {
        return a.size() > b.size();
      });
      std::string pattern;
      for (const auto& s : sorted) pattern += (pattern.empty() ? "" : "|") + regex_literal(s);
      j.begin_object().member("type", "Split");
      j.key("pattern").begin_object().member("Regex", pattern).end_object();
      j.member("behavior", "Isolated").member("invert", false).end_object();
    }
    j.end_array().end_object();
  } else {
    j.key("pre_tokenizer").null();
  }
  j.key("post_processor").null();

  j.key("decoder").begin_object().member("type", "Sequence").key("decoders").begin_array();
  replace_normalizer(j, "String", meta, " ");
  if (m.byte_fallback) j.begin_object().member("type", "ByteFallback").end_object();
  if (m.add_dummy_prefix) {
    j.begin_object().member("type", "Fuse").end_object();
    j.begin_object().member("type", "Strip").member("content", " ").member("start", int64_t{1});
    j.member("stop", int64_t{0}).end_object();
  } else if (m.byte_fallback) {
    j.begin_object().member("type", "Fuse").end_object();
  }
  j.end_array().end_object();

  j.key("model").begin_object();
  if (m.model_type == kUnigram) {
    j.member("type", "Unigram");
    if (m.unk_id >= 0 && m.unk_id < n) j.member("unk_id", m.unk_id);
    else j.key("unk_id").null();
    j.key("vocab").begin_array();
    for (const Piece& p : m.pieces) j.begin_array().value(p.text).float_value(p.score).end_array();
    j.end_array();
    j.member("byte_fallback", m.byte_fallback);
  } else {
    j.member("type", "BPE");
    j.key("dropout").null();
    j.member("unk_token", m.unk_piece);
    j.key("continuing_subword_prefix").null();
    j.key("end_of_word_suffix").null();
    j.member("fuse_unk", true).member("byte_fallback", m.byte_fallback).member("ignore_merges", !user_defined.empty());
    j.key("vocab").begin_object();
    for (int64_t i = 0; i < n; ++i) j.member(m.pieces[i].text, i);
    j.end_object();
    // Every normal piece two normal pieces make, best score first (ties: the lower id, then the split).
    std::unordered_map<std::string, int64_t> normal;
    for (int64_t i = 0; i < n; ++i)
      if (m.pieces[i].type == kNormal) normal.emplace(m.pieces[i].text, i);
    std::vector<std::tuple<float, int64_t, std::string, std::string>> merges;
    for (int64_t i = 0; i < n; ++i) {
      const Piece& p = m.pieces[i];
      if (p.type != kNormal) continue;
      for (size_t cut : char_boundaries(p.text)) {
        std::string left = p.text.substr(0, cut), right = p.text.substr(cut);
        if (normal.count(left) && normal.count(right)) merges.emplace_back(-p.score, i, std::move(left), std::move(right));
      }
    }
    std::sort(merges.begin(), merges.end());
    j.key("merges").begin_array();
    for (const auto& [score, id, left, right] : merges) j.begin_array().value(left).value(right).end_array();
    j.end_array();
  }
  j.end_object();
  j.end_object();
  out.tokenizer_json = j.str() + "\n";
  return out;
}

}  // namespace carry
