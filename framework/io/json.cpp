// The JSON writer (see json.h): string escaping with UTF-8 validation, round-trip numbers, and the
// object/array nesting checks.
#include "framework/io/json.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>

namespace carry {

namespace {

// The length of the valid UTF-8 sequence at s[i], or 0 when it is invalid; *bad_len is then the length
// of its maximal subpart (the bytes that began a well-formed sequence before it broke off; at least 1).
size_t utf8_sequence(std::string_view s, size_t i, size_t* bad_len) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  const unsigned char c = b(i);
  size_t n;
  unsigned char lo = 0x80, hi = 0xBF;  // the allowed range of the second byte
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) n = 2;
  else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    if (c == 0xE0) lo = 0xA0;  // no overlong forms
    if (c == 0xED) hi = 0x9F;  // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    if (c == 0xF0) lo = 0x90;  // no overlong forms
    if (c == 0xF4) hi = 0x8F;  // nothing past U+10FFFF
  } else {
    *bad_len = 1;  // a continuation byte, C0, C1 or F5..FF
    return 0;
  }
  for (size_t k = 1; k < n; ++k) {
    const bool ok = i + k < s.size() && (k == 1 ? b(i + k) >= lo && b(i + k) <= hi : b(i + k) >= 0x80 && b(i + k) <= 0xBF);
    if (!ok) {
      *bad_len = k;
      return 0;
    }
  }
  return n;
}

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

bool hex4(std::string_view text, size_t at, uint32_t* v) {
  if (at + 4 > text.size()) return false;
  *v = 0;
  for (size_t k = 0; k < 4; ++k) {
    const char c = text[at + k];
    int d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
    else return false;
    *v = *v * 16 + static_cast<uint32_t>(d);
  }
  return true;
}

}  // namespace

std::string json_quote(std::string_view s) {
  static const char* hex = "0123456789abcdef";
  std::string out;
  out.reserve(s.size() + 2);
  out += '"';
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x80) {
      size_t bad = 0;
      const size_t n = utf8_sequence(s, i, &bad);
      if (n == 0) {
        out += "\\ufffd";
        i += bad;
      } else {
        out.append(s.data() + i, n);
        i += n;
      }
      continue;
    }
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) {
          out += "\\u00";
          out += hex[c >> 4];
          out += hex[c & 0xF];
        } else {
          out += static_cast<char>(c);
        }
    }
    ++i;
  }
  out += '"';
  return out;
}

std::string json_number(double x) {
  if (!std::isfinite(x)) return "null";
  if (x == 0 && std::signbit(x)) return "-0.0";  // "-0" reads back as the integer 0 in Python
  // From 9 digits: %g then writes integers of up to 9 digits without an exponent (1000, not 1e+03).
  char buf[40];
  for (int digits = 9; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  return buf;
}

bool json_parse_string(std::string_view text, size_t* pos, std::string* out) {
  size_t i = *pos;
  if (i >= text.size() || text[i] != '"') return false;
  ++i;
  std::string s;
  while (true) {
    if (i >= text.size()) return false;
    const char c = text[i];
    if (c == '"') break;
    if (static_cast<unsigned char>(c) < 0x20) return false;  // control characters must be escaped
    if (c != '\\') {
      size_t k = i + 1;  // the run of plain characters, appended at once
      while (k < text.size() && text[k] != '"' && text[k] != '\\' && static_cast<unsigned char>(text[k]) >= 0x20) ++k;
      s.append(text.data() + i, k - i);
      i = k;
      continue;
    }
    if (++i >= text.size()) return false;
    switch (text[i]) {
      case '"': s += '"'; break;
      case '\\': s += '\\'; break;
      case '/': s += '/'; break;
      case 'b': s += '\b'; break;
      case 'f': s += '\f'; break;
      case 'n': s += '\n'; break;
      case 'r': s += '\r'; break;
      case 't': s += '\t'; break;
      case 'u': {
        uint32_t cp;
        if (!hex4(text, i + 1, &cp)) return false;
        i += 4;
        if (cp >= 0xD800 && cp <= 0xDBFF) {
          uint32_t low;
          if (i + 2 < text.size() && text[i + 1] == '\\' && text[i + 2] == 'u' && hex4(text, i + 3, &low) &&
              low >= 0xDC00 && low <= 0xDFFF) {
            cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
            i += 6;
          } else {
            cp = 0xFFFD;  // a lone high surrogate
          }
        } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
          cp = 0xFFFD;  // a lone low surrogate
        }
        append_utf8(s, cp);
        break;
      }
      default: return false;
    }
    ++i;
  }
  *pos = i + 1;
  *out = std::move(s);
  return true;
}

// ---- reading one member ----

namespace {

// A validating scanner over one JSON text; fails with what it expected at the first wrong byte.
struct JsonScanner {
  std::string_view t;
  size_t i = 0;
  std::string error;
  size_t error_at = 0;

  bool fail(const std::string& what) {
    if (error.empty()) error = what, error_at = i;
    return false;
  }
  void space() {
    while (i < t.size() && (t[i] == ' ' || t[i] == '\t' || t[i] == '\n' || t[i] == '\r')) ++i;
  }
  std::string found() const {
    if (i >= t.size()) return "the end of the line";
    const auto c = static_cast<unsigned char>(t[i]);
    if (c >= 0x20 && c < 0x7F) return std::string("'") + t[i] + "'";
    char buf[16];
    std::snprintf(buf, sizeof buf, "byte 0x%02x", c);
    return buf;
  }
  // A string literal, skipped (its escapes and control characters checked).
  bool skip_string() {
    size_t k = i + 1;
    while (true) {
      while (k < t.size() && t[k] != '"' && t[k] != '\\' && static_cast<unsigned char>(t[k]) >= 0x20) ++k;
      if (k >= t.size()) {
        i = k;
        return fail("an unterminated string");
      }
      if (t[k] == '"') break;
      if (t[k] != '\\') {
        i = k;
        return fail("a control character inside a string (it must be escaped)");
      }
      if (k + 1 >= t.size()) {
        i = k;
        return fail("an unterminated string");
      }
      const char e = t[k + 1];
      if (e == 'u') {
        uint32_t v;
        if (!hex4(t, k + 2, &v)) {
          i = k;
          return fail("a \\u escape without 4 hex digits");
        }
        k += 6;
      } else if (e == '"' || e == '\\' || e == '/' || e == 'b' || e == 'f' || e == 'n' || e == 'r' || e == 't') {
        k += 2;
      } else {
        i = k;
        return fail(std::string("an unknown escape \\") + e);
      }
    }
    i = k + 1;
    return true;
  }
  bool string_value(std::string* out) {
    size_t at = i;
    if (!skip_string()) return false;
    size_t p = at;
    if (!json_parse_string(t, &p, out)) return fail("expected a string");
    return true;
  }
  bool number() {
    const size_t start = i;
    if (i < t.size() && t[i] == '-') ++i;
    auto digits = [&] {
      const size_t d = i;
      while (i < t.size() && t[i] >= '0' && t[i] <= '9') ++i;
      return i - d;
    };
    if (i < t.size() && t[i] == '0') ++i;
    else if (digits() == 0) return fail("expected a digit");
    if (i < t.size() && t[i] == '.') {
      ++i;
      if (digits() == 0) return fail("expected a digit after the decimal point");
    }
    if (i < t.size() && (t[i] == 'e' || t[i] == 'E')) {
      ++i;
      if (i < t.size() && (t[i] == '+' || t[i] == '-')) ++i;
      if (digits() == 0) return fail("expected a digit in the exponent");
    }
    return i > start;
  }
  bool literal(std::string_view word) {
    if (t.substr(i, word.size()) != word) return fail("expected a JSON value (found " + found() + ")");
    i += word.size();
    return true;
  }
  // Any value; `type` gets its JSON type.
  bool value(int depth, const char** type) {
    if (depth > 512) return fail("nesting deeper than 512 levels");
    space();
    if (i >= t.size()) return fail("expected a value (found the end of the line)");
    switch (t[i]) {
      case '{': *type = "an object"; return object(depth + 1, {}, nullptr, nullptr);
      case '[': {
        *type = "an array";
        ++i;
        space();
        if (i < t.size() && t[i] == ']') return ++i, true;
        while (true) {
          const char* inner;
          if (!value(depth + 1, &inner)) return false;
          space();
          if (i < t.size() && t[i] == ',') {
            ++i;
            continue;
          }
          if (i < t.size() && t[i] == ']') return ++i, true;
          return fail("expected ',' or ']' in an array (found " + found() + ")");
        }
      }
      case '"': *type = "a string"; return skip_string();
      case 't': *type = "a boolean"; return literal("true");
      case 'f': *type = "a boolean"; return literal("false");
      case 'n': *type = "null"; return literal("null");
      default:
        *type = "a number";
        if (t[i] == '-' || (t[i] >= '0' && t[i] <= '9')) return number();
        return fail("expected a JSON value (found " + found() + ")");
    }
  }
  // An object at t[i] == '{'; the member `name`, when given, decoded into *out (kind into *member).
  bool object(int depth, std::string_view name, std::string* out, JsonMember* member) {
    ++i;
    space();
    if (i < t.size() && t[i] == '}') return ++i, true;
    std::string key;
    while (true) {
      space();
      if (i >= t.size() || t[i] != '"') return fail("expected a member name in quotes (found " + found() + ")");
      if (!string_value(&key)) return false;
      space();
      if (i >= t.size() || t[i] != ':') return fail("expected ':' after a member name (found " + found() + ")");
      ++i;
      space();
      if (member && key == name) {
        if (i < t.size() && t[i] == '"') {
          if (!string_value(out)) return false;
          member->kind = JsonMember::Kind::string;
          member->what.clear();
        } else {
          const char* type = "";
          if (!value(depth, &type)) return false;
          member->kind = JsonMember::Kind::not_string;
          member->what = type;
        }
      } else {
        const char* type;
        if (!value(depth, &type)) return false;
      }
      space();
      if (i < t.size() && t[i] == ',') {
        ++i;
        continue;
      }
      if (i < t.size() && t[i] == '}') return ++i, true;
      return fail("expected ',' or '}' in an object (found " + found() + ")");
    }
  }
};

}  // namespace

JsonMember json_string_member(std::string_view text, std::string_view name, std::string* out) {
  JsonScanner s{text};
  JsonMember m;
  s.space();
  bool ok;
  if (s.i < text.size() && text[s.i] == '{') {
    ok = s.object(1, name, out, &m);
    if (ok) {
      s.space();
      if (s.i < text.size()) ok = s.fail("expected the end of the line after the object (found " + s.found() + ")");
    }
  } else {
    ok = s.fail("expected a JSON object '{' (found " + s.found() + ")");
  }
  if (!ok) {
    m.kind = JsonMember::Kind::invalid;
    m.what = s.error;
    m.column = s.error_at + 1;
  }
  return m;
}

// ---- JsonWriter ----

void JsonWriter::newline() {
  out_ += '\n';
  out_.append(stack_.size() * static_cast<size_t>(indent_), ' ');
}

void JsonWriter::before_value() {
  if (stack_.empty()) {
    if (!out_.empty()) throw std::logic_error("JsonWriter: a second value at the top level");
    return;
  }
  Level& top = stack_.back();
  if (top.object) {
    if (!top.key_given) throw std::logic_error("JsonWriter: a value in an object without a key");
    top.key_given = false;
    return;
  }
  if (!top.empty) out_ += ',';
  top.empty = false;
  if (indent_ > 0) newline();
}

void JsonWriter::raw_value(std::string_view text) {
  before_value();
  out_.append(text);
}

JsonWriter& JsonWriter::key(std::string_view name) {
  if (stack_.empty() || !stack_.back().object) throw std::logic_error("JsonWriter: a key outside an object");
  Level& top = stack_.back();
  if (top.key_given) throw std::logic_error("JsonWriter: two keys in a row");
  if (!top.empty) out_ += ',';
  top.empty = false;
  if (indent_ > 0) newline();
  out_ += json_quote(name);
  out_ += indent_ > 0 ? ": " : ":";
  top.key_given = true;
  return *this;
}

JsonWriter& JsonWriter::begin_object() {
  raw_value("{");
  stack_.push_back({true, true, false});
  return *this;
}

JsonWriter& JsonWriter::begin_array() {
  raw_value("[");
  stack_.push_back({false, true, false});
  return *this;
}

JsonWriter& JsonWriter::end_object() {
  if (stack_.empty() || !stack_.back().object) throw std::logic_error("JsonWriter: end_object without an object");
  if (stack_.back().key_given) throw std::logic_error("JsonWriter: end_object after a key without a value");
  const bool empty = stack_.back().empty;
  stack_.pop_back();
  if (indent_ > 0 && !empty) newline();
  out_ += '}';
  return *this;
}

JsonWriter& JsonWriter::end_array() {
  if (stack_.empty() || stack_.back().object) throw std::logic_error("JsonWriter: end_array without an array");
  const bool empty = stack_.back().empty;
  stack_.pop_back();
  if (indent_ > 0 && !empty) newline();
  out_ += ']';
  return *this;
}

JsonWriter& JsonWriter::value(std::string_view s) {
  raw_value(json_quote(s));
  return *this;
}

JsonWriter& JsonWriter::value(double x) {
  raw_value(json_number(x));
  return *this;
}

JsonWriter& JsonWriter::value(int64_t x) {
  raw_value(std::to_string(x));
  return *this;
}

JsonWriter& JsonWriter::value(uint64_t x) {
  raw_value(std::to_string(x));
  return *this;
}

JsonWriter& JsonWriter::value(bool b) {
  raw_value(b ? "true" : "false");
  return *this;
}

JsonWriter& JsonWriter::null() {
  raw_value("null");
  return *this;
}

JsonWriter& JsonWriter::float_value(double x) {
  std::string s = json_number(x);
  if (std::isfinite(x) && s.find_first_of(".eE") == std::string::npos) s += ".0";
  raw_value(s);
  return *this;
}

JsonWriter& JsonWriter::fixed_value(double x, int decimals) {
  if (!std::isfinite(x)) return null();
  char buf[400];  // the largest double has 309 digits before the point
  std::snprintf(buf, sizeof buf, "%.*f", decimals < 0 ? 0 : decimals > 17 ? 17 : decimals, x);
  raw_value(buf);
  return *this;
}

}  // namespace carry
