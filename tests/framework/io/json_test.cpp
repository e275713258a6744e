// The JSON writer (framework/io/json.h): string escaping of quotes, backslashes, every control
// character and non-ASCII text against hand-written expectations, invalid UTF-8 replaced by U+FFFD
// (one a maximal subpart, as Python's errors="replace" decodes); numbers that read back as the same
// double, non-finite ones as null; nesting and misuse; and the output read back by two independent
// parsers: protobuf's JSON parser, and Python's json module (skipped without python3), which must
// decode to the very strings and doubles that were written. json_parse_string against the same cases.
#include "framework/io/json.h"

#include "tests/helpers/temp_dir.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace carry {
namespace {

TEST(Json, QuotesBackslashesAndControlCharactersAreEscaped) {
  EXPECT_EQ(json_quote(""), "\"\"");
  EXPECT_EQ(json_quote("plain text"), "\"plain text\"");
  EXPECT_EQ(json_quote("a \"quoted\" path"), "\"a \\\"quoted\\\" path\"");
  EXPECT_EQ(json_quote("C:\\dir\\"), "\"C:\\\\dir\\\\\"");
  EXPECT_EQ(json_quote("/slash/"), "\"/slash/\"");  // '/' needs no escape
  EXPECT_EQ(json_quote("\b\f\n\r\t"), "\"\\b\\f\\n\\r\\t\"");
  EXPECT_EQ(json_quote(std::string("nul\0end", 7)), "\"nul\\u0000end\"");
  EXPECT_EQ(json_quote("\x01\x1f\x7f"), "\"\\u0001\\u001f\x7f\"");  // DEL is not a control character to JSON
  // Every control character is escaped; nothing else below 0x80 is.
  for (int c = 0; c < 0x80; ++c) {
    const std::string q = json_quote(std::string(1, static_cast<char>(c)));
    if (c < 0x20 || c == '"' || c == '\\') EXPECT_EQ(q[1], '\\') << c;
    else EXPECT_EQ(q, std::string("\"") + static_cast<char>(c) + "\"") << c;
  }
}

TEST(Json, Utf8PassesThroughAndInvalidBytesBecomeReplacementCharacters) {
  EXPECT_EQ(json_quote("d\xc3\xa9j\xc3\xa0 \xe2\x82\xac \xf0\x9f\x98\x80"), "\"d\xc3\xa9j\xc3\xa0 \xe2\x82\xac \xf0\x9f\x98\x80\"");
  EXPECT_EQ(json_quote("\xef\xbf\xbf\xf4\x8f\xbf\xbf"), "\"\xef\xbf\xbf\xf4\x8f\xbf\xbf\"");  // U+FFFF, U+10FFFF
  EXPECT_EQ(json_quote("a\xff" "b"), "\"a\\ufffdb\"");           // never valid
  EXPECT_EQ(json_quote("\x80\xbf"), "\"\\ufffd\\ufffd\"");          // lone continuation bytes
  EXPECT_EQ(json_quote("\xe2\x82"), "\"\\ufffd\"");                 // a cut-off sequence: one maximal subpart
  EXPECT_EQ(json_quote("\xe2\x82" "x"), "\"\\ufffdx\"");
  EXPECT_EQ(json_quote("\xc0\xaf"), "\"\\ufffd\\ufffd\"");          // overlong '/'
  EXPECT_EQ(json_quote("\xe0\x80\xaf"), "\"\\ufffd\\ufffd\\ufffd\"");  // overlong, 3 bytes
  EXPECT_EQ(json_quote("\xed\xa0\x80"), "\"\\ufffd\\ufffd\\ufffd\"");  // a surrogate, U+D800
  EXPECT_EQ(json_quote("\xf4\x90\x80\x80"), "\"\\ufffd\\ufffd\\ufffd\\ufffd\"");  // past U+10FFFF
  EXPECT_EQ(json_quote("\xf0\x9f\x98"), "\"\\ufffd\"");
}

TEST(Json, NumbersReadBackAsTheSameDouble) {
  EXPECT_EQ(json_number(0.0), "0");
  EXPECT_EQ(json_number(-0.0), "-0.0");
  EXPECT_EQ(json_number(3.0), "3");
  EXPECT_EQ(json_number(1000.0), "1000");
  EXPECT_EQ(json_number(0.1), "0.1");
  EXPECT_EQ(json_number(0.30000000000000004), "0.30000000000000004");
  EXPECT_EQ(json_number(1e-300), "1e-300");
  EXPECT_EQ(json_number(std::numeric_limits<double>::quiet_NaN()), "null");
  EXPECT_EQ(json_number(std::numeric_limits<double>::infinity()), "null");
  EXPECT_EQ(json_number(-std::numeric_limits<double>::infinity()), "null");
  const double cases[] = {M_PI, -M_E, 1.0 / 3.0, 6.02214076e23, 5e-324, std::numeric_limits<double>::max(),
                          std::numeric_limits<double>::min(), 2.5533263185844586e-3, 123456789012345678.0};
  for (double x : cases) {
    const std::string s = json_number(x);
    EXPECT_EQ(std::strtod(s.c_str(), nullptr), x) << s;
    EXPECT_EQ(s.find_first_not_of("0123456789.e+-"), std::string::npos) << s;
  }
}

TEST(Json, WriterNestsObjectsAndArrays) {
  JsonWriter j;
  j.begin_object().member("s", "x\"y").member("i", int64_t{-7}).member("u", uint64_t{18446744073709551615u});
  j.member("d", 0.5).member("t", true).member("f", false).key("n").null();
  j.key("a").begin_array().value(1).value("two").begin_object().end_object().begin_array().end_array().end_array();
  j.key("fl").float_value(2.0).key("fx").fixed_value(1795881432.93912, 3).key("nan").float_value(std::nan(""));
  j.end_object();
  EXPECT_TRUE(j.done());
  EXPECT_EQ(j.str(), "{\"s\":\"x\\\"y\",\"i\":-7,\"u\":18446744073709551615,\"d\":0.5,\"t\":true,\"f\":false,\"n\":null,"
                     "\"a\":[1,\"two\",{},[]],\"fl\":2.0,\"fx\":1795881432.939,\"nan\":null}");

  JsonWriter p(2);
  p.begin_object().member("a", 1).key("b").begin_array().value(2).value(3).end_array().key("e").begin_object().end_object();
  p.end_object();
  EXPECT_EQ(p.str(), "{\n  \"a\": 1,\n  \"b\": [\n    2,\n    3\n  ],\n  \"e\": {}\n}");
}

TEST(Json, WriterMisuseThrows) {
  EXPECT_THROW(JsonWriter().begin_object().value(1), std::logic_error);  // a value without a key
  EXPECT_THROW(JsonWriter().key("k"), std::logic_error);                 // a key outside an object
  EXPECT_THROW(JsonWriter().begin_array().key("k"), std::logic_error);
  EXPECT_THROW(JsonWriter().begin_object().key("a").key("b"), std::logic_error);
  EXPECT_THROW(JsonWriter().begin_object().key("a").end_object(), std::logic_error);
  EXPECT_THROW(JsonWriter().begin_object().end_array(), std::logic_error);
  EXPECT_THROW(JsonWriter().value(1).value(2), std::logic_error);  // two top-level values
  JsonWriter open;
  open.begin_array().value(1);
  EXPECT_FALSE(open.done());
}

// Strings of every kind: what json_quote writes and what a reader must decode it to.
struct StringCase {
  std::string written, decoded;
};
std::vector<StringCase> string_cases() {
  std::vector<StringCase> c = {
      {"", ""},
      {"model/\"q\"\\path", "model/\"q\"\\path"},
      {std::string("\0\x01\b\f\n\r\t\x1f\x7f", 9), std::string("\0\x01\b\f\n\r\t\x1f\x7f", 9)},
      {"d\xc3\xa9j\xc3\xa0 \xe2\x82\xac \xf0\x9f\x98\x80", "d\xc3\xa9j\xc3\xa0 \xe2\x82\xac \xf0\x9f\x98\x80"},
      {"a\xff" "b\xe2\x82", "a\xef\xbf\xbd" "b\xef\xbf\xbd"},
      {"\xed\xa0\x80!", "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd!"},
  };
  std::string all;
  for (int b = 1; b < 0x80; ++b) all += static_cast<char>(b);
  c.push_back({all, all});
  return c;
}

TEST(Json, ParseStringDecodesWhatTheWriterWrites) {
  for (const auto& c : string_cases()) {
    const std::string text = json_quote(c.written) + ",";
    size_t pos = 0;
    std::string out;
    ASSERT_TRUE(json_parse_string(text, &pos, &out)) << text;
    EXPECT_EQ(out, c.decoded) << text;
    EXPECT_EQ(pos, text.size() - 1);
  }
  size_t pos = 0;
  std::string out;
  EXPECT_TRUE(json_parse_string("\"\\u00e9\\ud83d\\ude00\\/\"", &pos, &out));
  EXPECT_EQ(out, "\xc3\xa9\xf0\x9f\x98\x80/");
  for (const char* bad : {"", "x", "\"open", "\"bad \\x escape\"", "\"\\u12\"", "\"raw\nnewline\"", "\"ends in \\"}) {
    pos = 0;
    EXPECT_FALSE(json_parse_string(bad, &pos, &out)) << bad;
    EXPECT_EQ(pos, 0u);
  }
}

TEST(Json, StringMemberChecksTheLineAndDecodesTheMember) {
  std::string out;
  // Every string case the writer makes, as the member of an object among other values of every type.
  for (const auto& c : string_cases()) {
    const std::string line = "{\"id\": 7, \"meta\": {\"a\": [1, -2.5e+3, true, false, null, {}, []], \"text\": \"no\"}, "
                             "\"text\": " + json_quote(c.written) + "}\r";
    JsonMember m = json_string_member(line, "text", &out);
    ASSERT_EQ(m.kind, JsonMember::Kind::string) << line << " " << m.what;
    EXPECT_EQ(out, c.decoded) << line;
  }
  // The last of a repeated name; another name; missing; not a string.
  EXPECT_EQ(json_string_member(R"({"text": "a", "text": "b"})", "text", &out).kind, JsonMember::Kind::string);
  EXPECT_EQ(out, "b");
  EXPECT_EQ(json_string_member(R"( {"body":"x\u00e9"} )", "body", &out).kind, JsonMember::Kind::string);
  EXPECT_EQ(out, "x\xc3\xa9");
  EXPECT_EQ(json_string_member(R"({"content": "x"})", "text", &out).kind, JsonMember::Kind::missing);
  JsonMember n = json_string_member(R"({"text": 12.5})", "text", &out);
  EXPECT_EQ(n.kind, JsonMember::Kind::not_string);
  EXPECT_EQ(n.what, "a number");
  EXPECT_EQ(json_string_member(R"({"text": null})", "text", &out).what, "null");
  EXPECT_EQ(json_string_member(R"({"text": ["a"]})", "text", &out).what, "an array");
  // Invalid lines: what was expected, at which column.
  struct Bad {
    const char* line;
    const char* what;
    size_t column;
  };
  for (const Bad& b : std::vector<Bad>{
           {R"({"text": "a")", "expected ',' or '}' in an object (found the end of the line)", 13},
           {R"(["text"])", "expected a JSON object '{' (found '[')", 1},
           {R"({"text": "a"} x)", "expected the end of the line after the object (found 'x')", 15},
           {R"({text: "a"})", "expected a member name in quotes (found 't')", 2},
           {R"({"text" "a"})", "expected ':' after a member name (found '\"')", 9},
           {R"({"text": "a\qb"})", "an unknown escape \\q", 12},
           {R"({"a": 01, "text": "x"})", "expected ',' or '}' in an object (found '1')", 8},
           {R"({"a": 1., "text": "x"})", "expected a digit after the decimal point", 9},
           {R"({"a": tru, "text": "x"})", "expected a JSON value (found 't')", 7},
           {"{\"text\": \"tab\there\"}", "a control character inside a string (it must be escaped)", 14},
           {R"({"text": "\u12"})", "a \\u escape without 4 hex digits", 11},
           {"{\"text\": \"x\xff\"", "expected ',' or '}' in an object (found the end of the line)", 14},
           {"", "expected a JSON object '{' (found the end of the line)", 1},
       }) {
    JsonMember m = json_string_member(b.line, "text", &out);
    EXPECT_EQ(m.kind, JsonMember::Kind::invalid) << b.line;
    EXPECT_EQ(m.what, b.what) << b.line;
    EXPECT_EQ(m.column, b.column) << b.line;
  }
  std::string deep(600, '[');
  EXPECT_EQ(json_string_member("{\"a\": " + deep, "text", &out).what, "nesting deeper than 512 levels");
}

// The document both parsers read: an array of every string case, then numbers.
std::vector<double> number_cases() {
  return {0.0, -0.0, 1.0, 0.1, -2.5e-7, M_PI, 1.0 / 3.0, 6.02214076e23, 5e-324, std::numeric_limits<double>::max(),
          0.30000000000000004, 2.5533263185844586e-3};
}

std::string document() {
  JsonWriter j;
  j.begin_object().key("strings").begin_array();
  for (const auto& c : string_cases()) j.value(c.written);
  j.end_array().key("numbers").begin_array();
  for (double x : number_cases()) j.value(x);
  j.end_array().key("missing").begin_array().value(std::nan("")).value(-HUGE_VAL).end_array().end_object();
  return j.str();
}

TEST(Json, ProtobufsJsonParserReadsTheWritersOutput) {
  google::protobuf::Value v;
  auto status = google::protobuf::util::JsonStringToMessage(document(), &v);
  ASSERT_TRUE(status.ok()) << status.message() << "\n" << document();
  const auto& root = v.struct_value().fields();
  const auto& strings = root.at("strings").list_value();
  const auto cases = string_cases();
  ASSERT_EQ(strings.values_size(), static_cast<int>(cases.size()));
  for (size_t i = 0; i < cases.size(); ++i) EXPECT_EQ(strings.values(static_cast<int>(i)).string_value(), cases[i].decoded) << i;
  const auto& numbers = root.at("numbers").list_value();
  const auto want = number_cases();
  ASSERT_EQ(numbers.values_size(), static_cast<int>(want.size()));
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(numbers.values(static_cast<int>(i)).number_value(), want[i]) << i;
  for (const auto& m : root.at("missing").list_value().values()) EXPECT_TRUE(m.has_null_value());
}

std::string hex(const std::string& bytes) {
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned char c : bytes) out += digits[c >> 4], out += digits[c & 15];
  return out;
}

// Python's json module decodes the file; it prints each string's UTF-8 bytes and each number's IEEE
// bytes (little-endian) in hex, which must be what was written.
TEST(Json, PythonsJsonModuleReadsTheWritersOutput) {
  if (std::system("python3 -c 'import json, struct' >/dev/null 2>&1") != 0) GTEST_SKIP() << "no python3";
  const std::string dir = testing::make_temp_dir("carry_json");
  const std::string path = dir + "/doc.json";
  std::ofstream(path, std::ios::binary) << document();
  const std::string cmd =
      "python3 -c 'import json, struct, sys\n"
      "d = json.load(open(sys.argv[1], encoding=\"utf-8\"))\n"
      "for s in d[\"strings\"]: print(\"s\", s.encode(\"utf-8\").hex())\n"
      "for x in d[\"numbers\"]: print(\"n\", struct.pack(\"<d\", x).hex())\n"
      "print(\"m\", d[\"missing\"])' " + path;
  std::FILE* p = ::popen(cmd.c_str(), "r");
  ASSERT_NE(p, nullptr);
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  ASSERT_EQ(::pclose(p), 0) << out;
  std::string want;
  for (const auto& c : string_cases()) want += "s " + hex(c.decoded) + "\n";
  for (double x : number_cases()) {
    std::string bytes(sizeof x, '\0');
    std::memcpy(bytes.data(), &x, sizeof x);  // little-endian on every machine carry runs on
    want += "n " + hex(bytes) + "\n";
  }
  want += "m [None, None]\n";
  EXPECT_EQ(out, want);
  testing::remove_tree(dir);
}

}  // namespace
}  // namespace carry
