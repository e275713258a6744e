// JSON text (RFC 8259) for every JSON file carry writes: the metrics JSONL, `carry eval --json`, the
// safetensors header and an FLA folder's config.json; and the reader of JSONL corpora' lines
// (json_string_member: one pass over the line that checks the grammar and decodes one string member).
//
// JsonWriter appends values to a string in the order they are given; the caller opens and closes
// objects and arrays and names each member with key() (a misuse, such as a value where a key is due,
// throws std::logic_error: it is a bug of carry, not of its input). Strings are escaped as serde_json
// and Python's json (ensure_ascii=False) do: '"', '\' and the control characters U+0000..U+001F (as
// \b \f \n \r \t or \u00XX); valid UTF-8 passes through unchanged, and each invalid UTF-8 sequence
// (its maximal subpart, as Unicode recommends and Python's errors="replace" does) becomes \ufffd, so
// the text is always valid UTF-8. Numbers: integers exactly; a double as the shortest decimal that
// reads back as the same double (so two runs' files compare bit for bit), an integral one without a
// fraction (except -0.0, whose sign "-0" would lose in Python); JSON has no NaN or infinity, so a non-finite double is written as null (readers take null
// as "no value").
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace carry {

// `s` as a quoted JSON string.
std::string json_quote(std::string_view s);
// A double as the shortest decimal of 9 to 17 significant digits that reads back as it ("null" when
// not finite).
std::string json_number(double x);

// Reads the JSON string literal that starts at text[*pos] (its opening quote), decoding every escape
// (\uXXXX surrogate pairs into one UTF-8 character); on success *pos is just past the closing quote.
// Returns false, leaving *pos, on anything that is not a complete string literal.
bool json_parse_string(std::string_view text, size_t* pos, std::string* out);

// The string member `name` of the JSON object that is the whole of `text` (whitespace around it
// allowed), the line of a JSONL corpus: one pass that checks the whole text against RFC 8259's grammar
// (nesting at most 512 levels) and decodes only that member (as json_parse_string; the last one when a
// name repeats, as Python's json does).
struct JsonMember {
  enum class Kind { string, missing, not_string, invalid } kind = Kind::missing;
  std::string what;  // not_string: the value's JSON type ("a number"); invalid: what is wrong
  size_t column = 0;  // invalid: the 1-based byte column where it was found
};
JsonMember json_string_member(std::string_view text, std::string_view name, std::string* out);

class JsonWriter {
 public:
  // indent 0: one line with no spaces ({"a":1,"b":[2,3]}); n > 0: a member or element a line, n spaces
  // a level, "key": value.
  explicit JsonWriter(int indent = 0) : indent_(indent) {}

  JsonWriter& begin_object();
  JsonWriter& end_object();
  JsonWriter& begin_array();
  JsonWriter& end_array();
  // The next member's name (inside an object only).
  JsonWriter& key(std::string_view name);

  JsonWriter& value(std::string_view s);
  JsonWriter& value(const char* s) { return value(std::string_view(s)); }
  JsonWriter& value(const std::string& s) { return value(std::string_view(s)); }
  JsonWriter& value(double x);
  JsonWriter& value(int64_t x);
  JsonWriter& value(int x) { return value(static_cast<int64_t>(x)); }
  JsonWriter& value(uint64_t x);
  JsonWriter& value(bool b);
  JsonWriter& null();
  // A double that a reader types as a floating-point number (Python's json: a float): as value(double),
  // with ".0" after an integral one (2.0, not 2). Not finite: null.
  JsonWriter& float_value(double x);
  // A double with exactly `decimals` digits after the point (%.*f; e.g. unix times to the millisecond).
  // Not finite: null.
  JsonWriter& fixed_value(double x, int decimals);

  // key(name) then value(v).
  template <class T>
  JsonWriter& member(std::string_view name, const T& v) {
    key(name);
    return value(v);
  }

  // The text so far; complete once every object and array is closed (done()).
  const std::string& str() const { return out_; }
  bool done() const { return stack_.empty() && !out_.empty(); }

 private:
  void before_value();
  void raw_value(std::string_view text);
  void newline();
  struct Level {
    bool object = false;
    bool empty = true;
    bool key_given = false;
  };
  int indent_;
  std::string out_;
  std::vector<Level> stack_;
};

}  // namespace carry
