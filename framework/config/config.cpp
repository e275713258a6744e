// Config loading (see config.h): textproto parsing with file:line:column errors and a caret under the
// column, model presets overlaid field by field, `--set` overrides through protobuf reflection,
// declared defaults filled in, and validation whose errors name the field path and, where the field
// was written in a file, its location. Protobuf's text tokenizer counts columns in bytes with tabs
// advancing to the next multiple of 8; errors here give 1-based character columns.
#include "framework/config/config.h"

#include "framework/printable.h"
#include "layers/layout.h"
#include "layers/layer_kind.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/reflection.h>
#include <google/protobuf/text_format.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <sstream>

#include <sys/stat.h>

namespace carry {

namespace pb = google::protobuf;
using pb::FieldDescriptor;
using pb::Message;
using pb::TextFormat;

namespace {

// ---------------------------------------------------------------------------------------------
// Text and locations

// The largest config file read (a device such as /dev/zero given as a config would never end).
constexpr size_t kMaxConfigBytes = size_t{16} << 20;

// A config must be text: no NUL or other control bytes (but tab, CR, LF), valid UTF-8.
void check_is_text(const std::string& name, const std::string& text) {
  int line = 1;
  size_t line_start = 0;
  for (size_t i = 0; i < text.size();) {
    auto c = static_cast<unsigned char>(text[i]);
    size_t n = utf8_length(text, i);
    bool bad = n == 0 || (c < 0x20 && c != '\t' && c != '\n' && c != '\r') || c == 0x7F;
    if (bad) {
      std::string prefix = text.substr(line_start, i - line_start);
      int column = 1;
      for (size_t k = 0; k < prefix.size(); k += std::max<size_t>(1, utf8_length(prefix, k))) ++column;
      throw ConfigError(name + ":" + std::to_string(line) + ":" + std::to_string(column) + ": not a text file: byte " +
                        hex_escape(c) + (n == 0 ? " is not UTF-8" : " is a control character") +
                        "; a config is a textproto file (text), e.g. configs/demo_mqar.textproto");
    }
    if (c == '\n') ++line, line_start = i + 1;
    i += n;
  }
}

std::string read_text_file(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0)
    throw ConfigError("cannot read config file '" + path + "': " + std::strerror(errno));
  if (S_ISDIR(st.st_mode))
    throw ConfigError("cannot read config file '" + path + "': it is a directory; expected a .textproto file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError("cannot read config file '" + path + "': " + std::strerror(errno));
  std::string text;
  char buf[65536];
  while (in.read(buf, sizeof buf) || in.gcount() > 0) {
    text.append(buf, static_cast<size_t>(in.gcount()));
    if (text.size() > kMaxConfigBytes)
      throw ConfigError("config file '" + path + "' is larger than " + std::to_string(kMaxConfigBytes >> 20) +
                        " MiB; a config is a short textproto file");
  }
  if (in.bad()) throw ConfigError("cannot read config file '" + path + "': " + std::strerror(errno));
  return text;
}

std::string directory_of(const std::string& path) {
  auto slash = path.find_last_of('/');
  return slash == std::string::npos ? std::string() : path.substr(0, slash + 1);
}

std::string line_of(const std::string& text, int line) {
  size_t begin = 0;
  for (int l = 0; l < line; ++l) {
    begin = text.find('\n', begin);
    if (begin == std::string::npos) return "";
    ++begin;
  }
  auto end = text.find('\n', begin);
  auto s = text.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
  if (!s.empty() && s.back() == '\r') s.pop_back();
  return s;
}

// Protobuf's column (bytes, tabs to multiples of 8) -> byte offset in the line.
size_t byte_offset(const std::string& line, int column) {
  int col = 0;
  size_t i = 0;
  for (; i < line.size() && col < column; ++i) col = line[i] == '\t' ? col + 8 - col % 8 : col + 1;
  return i;
}

// Characters (UTF-8 code points) before a byte offset.
size_t chars_before(const std::string& line, size_t offset) {
  size_t n = 0;
  for (size_t i = 0; i < offset && i < line.size(); ++i) n += (static_cast<unsigned char>(line[i]) & 0xC0) != 0x80;
  return n;
}

struct Location {
  int line = -1;      // 1-based; -1 = unknown
  int column = -1;    // 1-based characters
};

Location to_location(const std::string& text, int line0, int column0) {
  if (line0 < 0) return {};
  auto l = line_of(text, line0);
  return {line0 + 1, static_cast<int>(chars_before(l, byte_offset(l, column0))) + 1};
}

// "file:line:column: message" and the line with a caret under the column. Protobuf reports an
// unknown field or enum value at the token after it; `token`, when found before that column on the
// line, moves the caret back onto the offending name.
std::string format_parse_error(const std::string& source, const std::string& text, int line0,
                               int column0, const std::string& message, const std::string& token) {
  auto l = line_of(text, line0);
  auto offset = byte_offset(l, column0);
  if (!token.empty()) {
    auto at = l.rfind(token, offset);
    if (at != std::string::npos) offset = at;
  }
  Location loc{line0 + 1, static_cast<int>(chars_before(l, offset)) + 1};
  // The caret goes under the column as shown: tabs as one space, unprintable bytes as \xNN.
  std::string shown, before;
  for (char c : l) shown += c == '\t' ? ' ' : c;
  before = printable(shown.substr(0, std::min(offset, shown.size())), false);
  shown = printable(shown, false);
  std::ostringstream os;
  os << source << ":" << loc.line << ":" << loc.column << ": " << message << "\n    " << shown << "\n    "
     << std::string(chars_before(before, before.size()), ' ') << "^";
  return os.str();
}


std::vector<std::string> field_names(const pb::Descriptor* d) {
  std::vector<std::string> names;
  for (int i = 0; i < d->field_count(); ++i) names.push_back(d->field(i)->name());
  return names;
}

std::vector<std::string> enum_names(const pb::EnumDescriptor* e) {
  std::vector<std::string> names;
  for (int i = 0; i < e->value_count(); ++i) names.push_back(e->value(i)->name());
  return names;
}

const std::regex& no_field_re() {
  static const std::regex re("Message type \"([^\"]+)\" has no field named \"([^\"]+)\"");
  return re;
}
const std::regex& bad_enum_re() {
  static const std::regex re("Unknown enumeration value of \"([^\"]*)\" for field \"([^\"]+)\"");
  return re;
}

// The field name or enum value a protobuf parse error is about ("" for other errors).
std::string offending_token(const std::string& message) {
  static const std::regex twice("Non-repeated field \"([^\"]+)\" is specified multiple times");
  std::smatch m;
  if (std::regex_search(message, m, no_field_re())) return m[2].str();
  if (std::regex_search(message, m, bad_enum_re())) return m[1].str();
  if (std::regex_search(message, m, twice)) return m[1].str();
  return "";
}

// Protobuf's messages for an unknown field or enum value, completed with what is valid there.
std::string explain(const std::string& message) {
  const auto& no_field = no_field_re();
  const auto& bad_enum = bad_enum_re();
  std::smatch m;
  if (message == "Expected identifier, got: ") return "unexpected end of file (a '}' is missing?)";
  if (std::regex_search(message, m, no_field)) {
    if (auto* d = pb::DescriptorPool::generated_pool()->FindMessageTypeByName(m[1]))
      return "unknown field \"" + m[2].str() + "\" in " + d->name() + " (valid fields: " +
             join(field_names(d), ", ") + ")";
  }
  if (std::regex_search(message, m, bad_enum)) {
    // The field is named without its message; list the values of every enum field so named.
    std::set<std::string> values;
    for (auto* file : {config::RunConfig::descriptor()->file(), config::ClusterConfig::descriptor()->file()})
      for (int t = 0; t < file->message_type_count(); ++t) {
        auto* d = file->message_type(t);
        for (int i = 0; i < d->field_count(); ++i)
          if (d->field(i)->name() == m[2].str() && d->field(i)->enum_type())
            for (auto& n : enum_names(d->field(i)->enum_type())) values.insert(n);
      }
    if (!values.empty())
      return message + " (valid values: " + join(std::vector<std::string>(values.begin(), values.end())) + ")";
  }
  return message;
}

class CollectErrors : public pb::io::ErrorCollector {
 public:
  struct Item {
    int line, column;
    std::string message;
  };
  std::vector<Item> errors;
  void AddError(int line, pb::io::ColumnNumber column, const std::string& message) override {
    errors.push_back({line, column, message});
  }
};

// A parsed file: its text and where each field was written.
struct Source {
  std::string name;
  std::string text;
  std::unique_ptr<TextFormat::ParseInfoTree> tree = std::make_unique<TextFormat::ParseInfoTree>();
};

// Protobuf's column (bytes, tabs to multiples of 8) of a byte offset in the line.
int column_of(const std::string& line, size_t offset) {
  int col = 0;
  for (size_t i = 0; i < offset && i < line.size(); ++i) col = line[i] == '\t' ? col + 8 - col % 8 : col + 1;
  return col;
}

// Where the text of a line ends: before a trailing # comment (outside quotes) and white space.
size_t content_end(const std::string& line) {
  char quote = 0;
  size_t end = line.size();
  for (size_t i = 0; i < line.size(); ++i) {
    char c = line[i];
    if (quote) {
      if (c == '\\') ++i;
      else if (c == quote) quote = 0;
    } else if (c == '"' || c == '\'') {
      quote = c;
    } else if (c == '#') {
      end = i;
      break;
    }
  }
  while (end > 0 && (line[end - 1] == ' ' || line[end - 1] == '\t' || line[end - 1] == '\r')) --end;
  return end;
}

// Protobuf reports a missing value or bracket at the token after it; when that token opens a line
// (e.g. "lr:" ends one line and the next starts "warmup_steps: 2"), the error is moved to the end
// of the previous line with text, where the value is missing, and says where the token was.
void place_at_line_end(const std::string& text, CollectErrors::Item& e) {
  if (e.line <= 0 || e.message.compare(0, 8, "Expected") != 0) return;
  std::string l = line_of(text, e.line);
  size_t at = byte_offset(l, e.column);
  if (l.find_first_not_of(" \t") != at) return;
  for (int prev = e.line - 1; prev >= 0; --prev) {
    std::string p = line_of(text, prev);
    size_t end = content_end(p);
    if (end == 0) continue;  // blank or only a comment
    e.message += " (on line " + std::to_string(e.line + 1) + ")";
    e.line = prev;
    e.column = column_of(p, end);
    return;
  }
}

void parse_into(Source& source, Message& message) {
  check_is_text(source.name, source.text);
  CollectErrors errors;
  TextFormat::Parser parser;
  parser.RecordErrorsTo(&errors);
  parser.WriteLocationsTo(source.tree.get());
  bool ok = parser.ParseFromString(source.text, &message);
  if (ok && errors.errors.empty()) return;
  std::vector<std::string> lines;
  for (auto& e : errors.errors) {
    place_at_line_end(source.text, e);
    lines.push_back(format_parse_error(source.name, source.text, e.line, e.column, explain(e.message),
                                       offending_token(e.message)));
  }
  if (lines.empty()) lines.push_back(source.name + ": could not parse the file as " + message.GetTypeName());
  throw ConfigError(join(lines, "\n"));
}

// ---------------------------------------------------------------------------------------------
// Field paths: "model.mixer_options[1].window"

struct Segment {
  std::string name;
  int index = -1;          // -1: no [i]; an index past INT_MAX is held as INT_MAX (out of any list's range)
  std::string index_text;  // the index as written ("" without [i])
};

std::vector<Segment> parse_path(const std::string& path) {
  static const std::regex seg_re("([A-Za-z_][A-Za-z0-9_]*)(\\[([0-9]+)\\])?");
  std::vector<Segment> out;
  std::stringstream ss(path);
  for (std::string part; std::getline(ss, part, '.');) {
    std::smatch m;
    if (!std::regex_match(part, m, seg_re))
      throw ConfigError("'" + path + "' is not a field path (expected names joined by dots, with [i] "
                        "for an element of a list, e.g. model.mixer_options[0].window)");
    Segment s{m[1].str(), -1, ""};
    if (m[3].matched) {
      // Digits only (the regex); saturate instead of overflowing, so a huge index is reported as out
      // of range with the digits as written.
      s.index_text = m[3].str();
      int64_t x = 0;
      for (char c : s.index_text) x = std::min<int64_t>(x * 10 + (c - '0'), INT_MAX);
      s.index = static_cast<int>(x);
    }
    out.push_back(s);
  }
  if (out.empty() || path.back() == '.') throw ConfigError("'" + path + "' is not a field path");
  return out;
}

// Where the field at `path` was written in `source`, if it was.
Location locate(const Source& source, const pb::Descriptor* root, const std::vector<Segment>& path) {
  const TextFormat::ParseInfoTree* tree = source.tree.get();
  const pb::Descriptor* d = root;
  for (size_t i = 0; i < path.size() && tree && d; ++i) {
    auto* f = d->FindFieldByName(path[i].name);
    if (!f) return {};
    int index = f->is_repeated() ? std::max(path[i].index, 0) : -1;
    if (i + 1 == path.size() || !f->message_type()) {
      auto loc = tree->GetLocation(f, index);
      return to_location(source.text, loc.line, loc.column);
    }
    tree = tree->GetTreeForNested(f, index);
    d = f->message_type();
  }
  return {};
}

// ---------------------------------------------------------------------------------------------
// Reflection helpers

void copy_field(const Message& from, Message& to, const FieldDescriptor* f) {
  auto* rf = from.GetReflection();
  auto* rt = to.GetReflection();
  if (f->is_repeated()) {
    rt->ClearField(&to, f);
    for (int i = 0; i < rf->FieldSize(from, f); ++i) {
      switch (f->cpp_type()) {
        case FieldDescriptor::CPPTYPE_INT32: rt->AddInt32(&to, f, rf->GetRepeatedInt32(from, f, i)); break;
        case FieldDescriptor::CPPTYPE_INT64: rt->AddInt64(&to, f, rf->GetRepeatedInt64(from, f, i)); break;
        case FieldDescriptor::CPPTYPE_UINT32: rt->AddUInt32(&to, f, rf->GetRepeatedUInt32(from, f, i)); break;
        case FieldDescriptor::CPPTYPE_UINT64: rt->AddUInt64(&to, f, rf->GetRepeatedUInt64(from, f, i)); break;
        case FieldDescriptor::CPPTYPE_DOUBLE: rt->AddDouble(&to, f, rf->GetRepeatedDouble(from, f, i)); break;
        case FieldDescriptor::CPPTYPE_FLOAT: rt->AddFloat(&to, f, rf->GetRepeatedFloat(from, f, i)); break;
        case FieldDescriptor::CPPTYPE_BOOL: rt->AddBool(&to, f, rf->GetRepeatedBool(from, f, i)); break;
        case FieldDescriptor::CPPTYPE_ENUM: rt->AddEnum(&to, f, rf->GetRepeatedEnum(from, f, i)); break;
        case FieldDescriptor::CPPTYPE_STRING: rt->AddString(&to, f, rf->GetRepeatedString(from, f, i)); break;
        case FieldDescriptor::CPPTYPE_MESSAGE:
          rt->AddMessage(&to, f)->CopyFrom(rf->GetRepeatedMessage(from, f, i));
          break;
      }
    }
    return;
  }
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32: rt->SetInt32(&to, f, rf->GetInt32(from, f)); break;
    case FieldDescriptor::CPPTYPE_INT64: rt->SetInt64(&to, f, rf->GetInt64(from, f)); break;
    case FieldDescriptor::CPPTYPE_UINT32: rt->SetUInt32(&to, f, rf->GetUInt32(from, f)); break;
    case FieldDescriptor::CPPTYPE_UINT64: rt->SetUInt64(&to, f, rf->GetUInt64(from, f)); break;
    case FieldDescriptor::CPPTYPE_DOUBLE: rt->SetDouble(&to, f, rf->GetDouble(from, f)); break;
    case FieldDescriptor::CPPTYPE_FLOAT: rt->SetFloat(&to, f, rf->GetFloat(from, f)); break;
    case FieldDescriptor::CPPTYPE_BOOL: rt->SetBool(&to, f, rf->GetBool(from, f)); break;
    case FieldDescriptor::CPPTYPE_ENUM: rt->SetEnum(&to, f, rf->GetEnum(from, f)); break;
    case FieldDescriptor::CPPTYPE_STRING: rt->SetString(&to, f, rf->GetString(from, f)); break;
    case FieldDescriptor::CPPTYPE_MESSAGE: rt->MutableMessage(&to, f)->CopyFrom(rf->GetMessage(from, f)); break;
  }
}

// Every field set in `top` replaces the one in `base`; sub-messages recursively; lists whole.
void overlay(Message& base, const Message& top) {
  std::vector<const FieldDescriptor*> fields;
  top.GetReflection()->ListFields(top, &fields);
  for (auto* f : fields) {
    if (!f->is_repeated() && f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE)
      overlay(*base.GetReflection()->MutableMessage(&base, f), top.GetReflection()->GetMessage(top, f));
    else
      copy_field(top, base, f);
  }
}

// Sets every unset singular field that declares a default, recursing into singular sub-messages
// (creating them) except unselected oneof members. Lists are left as written.
void fill_defaults(Message& m) {
  auto* d = m.GetDescriptor();
  auto* r = m.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    auto* f = d->field(i);
    if (f->is_repeated()) {
      // Entries of a repeated message are filled too (data.token_files.sources), except mixer_options,
      // whose unset fields mean "inherit" (carry.proto).
      if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE && f->message_type() != config::MixerOptions::descriptor())
        for (int j = 0; j < r->FieldSize(m, f); ++j) fill_defaults(*r->MutableRepeatedMessage(&m, f, j));
      continue;
    }
    if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      if (f->real_containing_oneof() && !r->HasField(m, f)) continue;
      fill_defaults(*r->MutableMessage(&m, f));
      continue;
    }
    if (r->HasField(m, f) || !f->has_default_value()) continue;
    switch (f->cpp_type()) {
      case FieldDescriptor::CPPTYPE_INT32: r->SetInt32(&m, f, f->default_value_int32()); break;
      case FieldDescriptor::CPPTYPE_INT64: r->SetInt64(&m, f, f->default_value_int64()); break;
      case FieldDescriptor::CPPTYPE_UINT32: r->SetUInt32(&m, f, f->default_value_uint32()); break;
      case FieldDescriptor::CPPTYPE_UINT64: r->SetUInt64(&m, f, f->default_value_uint64()); break;
      case FieldDescriptor::CPPTYPE_DOUBLE: r->SetDouble(&m, f, f->default_value_double()); break;
      case FieldDescriptor::CPPTYPE_FLOAT: r->SetFloat(&m, f, f->default_value_float()); break;
      case FieldDescriptor::CPPTYPE_BOOL: r->SetBool(&m, f, f->default_value_bool()); break;
      case FieldDescriptor::CPPTYPE_ENUM: r->SetEnum(&m, f, f->default_value_enum()); break;
      case FieldDescriptor::CPPTYPE_STRING: r->SetString(&m, f, f->default_value_string()); break;
      case FieldDescriptor::CPPTYPE_MESSAGE: break;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Overrides

std::string trim(const std::string& s) {
  auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  auto e = s.find_last_not_of(" \t");
  return s.substr(b, e - b + 1);
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

const char* type_words(const FieldDescriptor* f) {
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
    case FieldDescriptor::CPPTYPE_INT64: return "an integer";
    case FieldDescriptor::CPPTYPE_UINT32:
    case FieldDescriptor::CPPTYPE_UINT64: return "a non-negative integer";
    case FieldDescriptor::CPPTYPE_DOUBLE:
    case FieldDescriptor::CPPTYPE_FLOAT: return "a number";
    case FieldDescriptor::CPPTYPE_BOOL: return "true or false";
    case FieldDescriptor::CPPTYPE_ENUM: return "an enum value";
    case FieldDescriptor::CPPTYPE_STRING: return "a string";
    case FieldDescriptor::CPPTYPE_MESSAGE: return "a message";
  }
  return "a value";
}

// A scalar parsed by the field's type; the value lives in whichever member the type uses.
struct Scalar {
  int64_t i = 0;
  uint64_t u = 0;
  double d = 0;
  bool b = false;
  int e = 0;
  std::string s;
};

Scalar parse_scalar(const FieldDescriptor* f, const std::string& raw, const std::string& what) {
  std::string v = trim(raw);
  Scalar out;
  auto bad = [&](const std::string& extra = "") {
    return ConfigError(what + ": " + f->name() + " expects " + type_words(f) + ", got '" + v + "'" + extra);
  };
  errno = 0;
  char* end = nullptr;
  switch (f->cpp_type()) {
    case FieldDescriptor::CPPTYPE_INT32:
    case FieldDescriptor::CPPTYPE_INT64: {
      long long x = std::strtoll(v.c_str(), &end, 10);
      if (v.empty() || *end || errno) throw bad();
      if (f->cpp_type() == FieldDescriptor::CPPTYPE_INT32 && (x < INT_MIN || x > INT_MAX))
        throw bad(" (out of the 32-bit range)");
      out.i = x;
      break;
    }
    case FieldDescriptor::CPPTYPE_UINT32:
    case FieldDescriptor::CPPTYPE_UINT64: {
      unsigned long long x = std::strtoull(v.c_str(), &end, 10);
      if (v.empty() || v[0] == '-' || *end || errno) throw bad();
      if (f->cpp_type() == FieldDescriptor::CPPTYPE_UINT32 && x > UINT_MAX) throw bad(" (out of the 32-bit range)");
      out.u = x;
      break;
    }
    case FieldDescriptor::CPPTYPE_DOUBLE:
    case FieldDescriptor::CPPTYPE_FLOAT:
      out.d = std::strtod(v.c_str(), &end);
      if (v.empty() || *end || errno == ERANGE) throw bad();
      break;
    case FieldDescriptor::CPPTYPE_BOOL: {
      auto l = lower(v);
      if (l == "true" || l == "1") out.b = true;
      else if (l == "false" || l == "0") out.b = false;
      else throw bad();
      break;
    }
    case FieldDescriptor::CPPTYPE_ENUM: {
      auto* e = f->enum_type();
      const pb::EnumValueDescriptor* found = nullptr;
      for (int i = 0; i < e->value_count(); ++i)
        if (lower(e->value(i)->name()) == lower(v)) found = e->value(i);
      if (!found) throw bad(" (valid values: " + join(enum_names(e), ", ") + ")");
      out.e = found->number();
      break;
    }
    case FieldDescriptor::CPPTYPE_STRING:
      out.s = v;
      if (out.s.size() >= 2 && (out.s[0] == '"' || out.s[0] == '\'') && out.s.back() == out.s[0])
        out.s = out.s.substr(1, out.s.size() - 2);
      break;
    case FieldDescriptor::CPPTYPE_MESSAGE: break;
  }
  return out;
}

void set_scalar(Message& m, const FieldDescriptor* f, int index, const Scalar& v) {
  auto* r = m.GetReflection();
  bool add = f->is_repeated() && index == r->FieldSize(m, f);
  switch (f->cpp_type()) {
#define CARRY_SET(TYPE, FIELD, CAST)                                   \
  if (!f->is_repeated()) r->Set##TYPE(&m, f, CAST(v.FIELD));           \
  else if (add) r->Add##TYPE(&m, f, CAST(v.FIELD));                    \
  else r->SetRepeated##TYPE(&m, f, index, CAST(v.FIELD));              \
  break;
    case FieldDescriptor::CPPTYPE_INT32: CARRY_SET(Int32, i, static_cast<int32_t>)
    case FieldDescriptor::CPPTYPE_INT64: CARRY_SET(Int64, i, static_cast<int64_t>)
    case FieldDescriptor::CPPTYPE_UINT32: CARRY_SET(UInt32, u, static_cast<uint32_t>)
    case FieldDescriptor::CPPTYPE_UINT64: CARRY_SET(UInt64, u, static_cast<uint64_t>)
    case FieldDescriptor::CPPTYPE_DOUBLE: CARRY_SET(Double, d, static_cast<double>)
    case FieldDescriptor::CPPTYPE_FLOAT: CARRY_SET(Float, d, static_cast<float>)
    case FieldDescriptor::CPPTYPE_BOOL: CARRY_SET(Bool, b, static_cast<bool>)
    case FieldDescriptor::CPPTYPE_ENUM: CARRY_SET(EnumValue, e, static_cast<int>)
    case FieldDescriptor::CPPTYPE_STRING: CARRY_SET(String, s, std::string)
#undef CARRY_SET
    case FieldDescriptor::CPPTYPE_MESSAGE: break;
  }
}

void parse_message_value(const std::string& raw, Message& out, const std::string& what) {
  std::string v = trim(raw);
  if (v.size() >= 2 && v.front() == '{' && v.back() == '}') v = v.substr(1, v.size() - 2);
  CollectErrors errors;
  TextFormat::Parser parser;
  parser.RecordErrorsTo(&errors);
  out.Clear();
  if (!parser.ParseFromString(v, &out) || !errors.errors.empty()) {
    std::string msg = errors.errors.empty() ? "cannot parse" : explain(errors.errors[0].message);
    throw ConfigError(what + ": the value is not a valid " + out.GetDescriptor()->name() + ": " + msg);
  }
}

std::string level_name(const std::vector<Segment>& path, size_t depth) {
  if (depth == 0) return "the top level";
  std::string s;
  for (size_t i = 0; i < depth; ++i) {
    s += (i ? "." : "") + path[i].name;
    if (path[i].index >= 0) s += "[" + path[i].index_text + "]";
  }
  return s;
}

bool starts_with(const std::string& s, const std::string& prefix) {
  return s.compare(0, prefix.size(), prefix) == 0;
}

std::string override_path(const std::string& assignment) {
  auto eq = assignment.find('=');
  return trim(eq == std::string::npos ? assignment : assignment.substr(0, eq));
}

// ---------------------------------------------------------------------------------------------
// Validation

struct FieldError {
  std::string path;
  std::string message;
};

class Errors {
 public:
  template <class... Args>
  void add(const std::string& path, const Args&... args) {
    std::ostringstream os;
    (os << ... << args);
    list.push_back({path, os.str()});
  }
  std::vector<FieldError> list;
};

// Upper bounds that keep every product the validation and the trainer form within int64 (and refuse
// values no run could use): a chunk of at most 2^16 tokens, at most 2^20 ranks, 2^40 tokens a sequence.
constexpr int64_t kMaxChunkSize = int64_t{1} << 16;
constexpr int64_t kMaxRanks = int64_t{1} << 20;
constexpr int64_t kMaxSeqLen = int64_t{1} << 40;
// Model shapes: every weight's element count stays far inside int64 (vocab x d_model <= 2^52), token
// ids fit the 32 bits of a token file, and a model can be listed before it is allocated (layers).
constexpr int64_t kMaxVocab = int64_t{1} << 32;
constexpr int64_t kMaxWidth = int64_t{1} << 20;   // d_model, head_dim_k, head_dim_v
constexpr int64_t kMaxHeads = int64_t{1} << 16;
constexpr int64_t kMaxLayers = 4096;
constexpr double kMaxMlpRatio = 1024;
constexpr int64_t kMaxConvSize = 4096;
// The most level weights any registered kind accepts (log-linear attention's Fenwick levels).
int64_t max_levels() {
  int64_t most = 0;
  for (const auto& k : layer_kind_names()) most = std::max(most, layer_kind(k).max_levels);
  return most;
}

// *out = a*b; false when that overflows int64.
bool mul_ok(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }

// Every float and double field of `m` (recursively, repeated ones element by element) must be finite:
// inf or nan in a hyperparameter would train to NaN parameters. `skip` names a top-level field
// checked elsewhere.
void check_finite(const Message& m, const std::string& prefix, Errors& e, const FieldDescriptor* skip = nullptr) {
  auto* r = m.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  r->ListFields(m, &fields);
  for (auto* f : fields) {
    if (f == skip) continue;
    std::string path = prefix + f->name();
    int n = f->is_repeated() ? r->FieldSize(m, f) : 1;
    for (int i = 0; i < n; ++i) {
      std::string at = f->is_repeated() ? path + "[" + std::to_string(i) + "]" : path;
      double v = 0;
      switch (f->cpp_type()) {
        case FieldDescriptor::CPPTYPE_DOUBLE:
          v = f->is_repeated() ? r->GetRepeatedDouble(m, f, i) : r->GetDouble(m, f);
          break;
        case FieldDescriptor::CPPTYPE_FLOAT:
          v = f->is_repeated() ? r->GetRepeatedFloat(m, f, i) : r->GetFloat(m, f);
          break;
        case FieldDescriptor::CPPTYPE_MESSAGE:
          if (!f->is_map())
            check_finite(f->is_repeated() ? r->GetRepeatedMessage(m, f, i) : r->GetMessage(m, f), at + ".", e);
          continue;
        default:
          continue;
      }
      if (!std::isfinite(v)) e.add(at, "must be a finite number, got ", v);
    }
  }
}

// The kinds whose registry entry (layers/layer_kind.h) sets `flag`.
std::set<std::string> kinds_where(bool LayerKind::*flag) {
  std::set<std::string> out;
  for (auto& n : layer_kind_names())
    if (layer_kind(n).*flag) out.insert(n);
  return out;
}

bool is_known_kind(const std::string& kind) { return find_layer_kind(kind) != nullptr; }


std::vector<std::string> distinct_kinds(const ModelConfig& model) {
  std::vector<std::string> kinds;
  for (auto& k : model.mixers())
    if (std::find(kinds.begin(), kinds.end(), k) == kinds.end()) kinds.push_back(k);
  return kinds;
}

void check_model(const ModelConfig& m, const std::string& p, Errors& e) {
  auto in_range = [&](const char* name, int64_t v, int64_t max) {
    if (v <= 0 || v > max) e.add(p + name, "must lie in [1, ", max, "], got ", v);
  };
  in_range("vocab_size", m.vocab_size(), kMaxVocab);
  in_range("d_model", m.d_model(), kMaxWidth);
  in_range("n_layers", m.n_layers(), kMaxLayers);
  in_range("n_heads", m.n_heads(), kMaxHeads);
  if (m.has_head_dim_k()) in_range("head_dim_k", m.head_dim_k(), kMaxWidth);
  if (m.has_head_dim_v()) in_range("head_dim_v", m.head_dim_v(), kMaxWidth);
  if ((!m.has_head_dim_k() || !m.has_head_dim_v()) && m.n_heads() > 0 && m.d_model() > 0 &&
      m.d_model() % m.n_heads() != 0)
    e.add(p + "n_heads", "must divide d_model (", m.d_model(), "), got ", m.n_heads(),
          " (or set head_dim_k and head_dim_v)");
  check_finite(m, p, e);  // non-finite values are reported there, once
  if (std::isfinite(m.mlp_ratio()) && !(m.mlp_ratio() > 0 && m.mlp_ratio() <= kMaxMlpRatio))
    e.add(p + "mlp_ratio", "must lie in (0, ", kMaxMlpRatio, "], got ", m.mlp_ratio());
  if (std::isfinite(m.norm_eps()) && !(m.norm_eps() > 0))
    e.add(p + "norm_eps", "must be positive, got ", m.norm_eps());
  if (std::isfinite(m.init_std()) && !(m.init_std() > 0))
    e.add(p + "init_std", "must be positive, got ", m.init_std());
  if (m.mixers().empty())
    e.add(p + "mixers", "at least one mixer kind is needed (e.g. mixers: \"gla\"); known kinds: ",
          join(known_mixer_kinds(), ", "));
  for (int i = 0; i < m.mixers_size(); ++i)
    if (!is_known_kind(m.mixers(i)))
      e.add(p + "mixers[" + std::to_string(i) + "]", "unknown mixer kind '", m.mixers(i), "'; known kinds: ",
            join(known_mixer_kinds(), ", "));
  auto kinds = distinct_kinds(m);
  std::map<std::string, int> seen;  // kind ("" = general) -> entry index
  for (int i = 0; i < m.mixer_options_size(); ++i) {
    auto& o = m.mixer_options(i);
    std::string q = p + "mixer_options[" + std::to_string(i) + "]";
    std::string kind = o.kind();
    if (o.has_kind() && std::find(kinds.begin(), kinds.end(), kind) == kinds.end())
      e.add(q + ".kind", "'", kind, "' is not one of the model's mixers (", join(kinds, ", "), ")");
    if (seen.count(kind))
      e.add(q + (o.has_kind() ? ".kind" : ""), "a second entry for ",
            o.has_kind() ? "'" + kind + "'" : std::string("all layers (no kind)"), " (the first is mixer_options[",
            seen[kind], "])");
    else
      seen[kind] = i;
    std::vector<std::string> applies = o.has_kind() ? std::vector<std::string>{kind} : kinds;
    auto only_for = [&](bool set, const char* name, const std::set<std::string>& ok) {
      if (!set) return;
      for (auto& k : applies)
        if (!ok.count(k)) {
          e.add(q + "." + name, "only ", join(std::vector<std::string>(ok.begin(), ok.end())), " use", ok.size() == 1 ? "s" : "",
                " '", name, "', but this entry applies to ", k, " layers",
                o.has_kind() ? "" : " (give the entry a kind)");
          return;
        }
    };
    if (o.has_chunk_size() && (o.chunk_size() <= 0 || o.chunk_size() > kMaxChunkSize))
      e.add(q + ".chunk_size", "must lie in [1, ", kMaxChunkSize, "], got ", o.chunk_size());
    if (o.has_window() && (o.window() < 0 || o.window() > kMaxSeqLen))
      e.add(q + ".window", "must lie in [0, ", kMaxSeqLen, "] (0 = full causal), got ", o.window());
    if (o.has_conv_size() && (o.conv_size() < 0 || o.conv_size() > kMaxConvSize))
      e.add(q + ".conv_size", "must lie in [0, ", kMaxConvSize, "] (0 = none), got ", o.conv_size());
    if (o.has_levels() && (o.levels() < 0 || o.levels() > max_levels()))
      e.add(q + ".levels", "must lie in [0, ", max_levels(), "] (0 = as needed), got ", o.levels());
    only_for(o.has_window(), "window", kinds_where(&LayerKind::window));
    only_for(o.has_levels(), "levels", kinds_where(&LayerKind::levels));
    only_for(o.has_normalize(), "normalize", kinds_where(&LayerKind::normalize));
  }
  for (auto& k : kinds) {
    if (!is_known_kind(k) || !layer_kind(k).power_of_two_chunk) continue;
    auto C = layer_mixer(m, std::find(m.mixers().begin(), m.mixers().end(), k) - m.mixers().begin()).options.chunk_size();
    if (C > 0 && (C & (C - 1)) != 0)
      e.add(p + "mixer_options", k, " needs a power-of-two chunk_size, got ", C);
  }
}

std::string path_of_option(const ModelConfig& m, const std::string& kind, const std::string& field) {
  auto* f = config::MixerOptions::descriptor()->FindFieldByName(field);
  int found = -1;
  for (int i = 0; i < m.mixer_options_size(); ++i) {
    auto& o = m.mixer_options(i);
    if ((!o.has_kind() || o.kind() == kind) && o.GetReflection()->HasField(o, f) &&
        (found < 0 || o.has_kind()))
      found = i;
  }
  return found < 0 ? "model.mixer_options" : "model.mixer_options[" + std::to_string(found) + "]." + field;
}

void check_run(const RunConfig& c, Errors& e) {
  static const std::regex name_re("[A-Za-z0-9._-]+");
  if (!std::regex_match(c.name(), name_re))
    e.add("name", "must be non-empty and use only letters, digits, '.', '_' and '-' (it names directories), got '",
          c.name(), "'");
  auto& m = c.model();
  check_model(m, "model.", e);
  check_finite(c, "", e, RunConfig::descriptor()->FindFieldByName("model"));  // the model: in check_model

  auto& d = c.data();
  auto& par = c.parallel();
  int64_t T = d.seq_len(), sp = par.sp();
  if (T <= 0 || T > kMaxSeqLen) e.add("data.seq_len", "must lie in [1, 2^40 = ", kMaxSeqLen, "], got ", T);
  if (d.batch_size() <= 0 || d.batch_size() > kMaxSeqLen)
    e.add("data.batch_size", "must lie in [1, 2^40 = ", kMaxSeqLen, "], got ", d.batch_size());
  const bool T_ok = T > 0 && T <= kMaxSeqLen;  // then sums and small products of values <= T fit
  if (d.eval_batches() < 0) e.add("data.eval_batches", "must be >= 0, got ", d.eval_batches());
  switch (d.source_case()) {
    case DataConfig::SOURCE_NOT_SET:
      e.add("data", "no data source: set one of token_files { paths: ... }, mqar { ... }, needle { ... }");
      break;
    case DataConfig::kTokenFiles: {
      auto& t = d.token_files();
      if (t.paths().empty() && t.sources().empty())
        e.add("data.token_files.paths", "at least one token file is needed (or data.token_files.sources)");
      if (!t.paths().empty() && !t.sources().empty())
        e.add("data.token_files", "give either paths (one source) or sources (a blend), not both");
      for (int i = 0; i < t.paths_size(); ++i)
        if (t.paths(i).empty()) e.add("data.token_files.paths[" + std::to_string(i) + "]", "is empty");
      for (int s = 0; s < t.sources_size(); ++s) {
        const std::string at = "data.token_files.sources[" + std::to_string(s) + "]";
        auto& src = t.sources(s);
        if (src.paths().empty()) e.add(at + ".paths", "at least one token file is needed");
        for (int i = 0; i < src.paths_size(); ++i)
          if (src.paths(i).empty()) e.add(at + ".paths[" + std::to_string(i) + "]", "is empty");
        if (std::isfinite(src.weight()) && !(src.weight() > 0))
          e.add(at + ".weight", "must be positive, got ", src.weight());
      }
      for (int i = 0; i < t.eval_paths_size(); ++i)
        if (t.eval_paths(i).empty()) e.add("data.token_files.eval_paths[" + std::to_string(i) + "]", "is empty");
      if (c.logging().eval_every_steps() > 0 && t.eval_paths().empty())
        e.add("logging.eval_every_steps", "evaluation needs data.token_files.eval_paths");
      if (t.eod_token() < -1 || (m.vocab_size() > 0 && t.eod_token() >= m.vocab_size()))
        e.add("data.token_files.eod_token", "must be -1 (no document resets) or an id below model.vocab_size (",
              m.vocab_size(), "), got ", t.eod_token());
      if (t.eod_token() >= 0 && c.parallel().sp() > 1 && c.parallel().scan_mode() != config::ParallelConfig::ORDERED)
        for (const auto& k : m.mixers())
          if (is_known_kind(k) && layer_kind(k).levels) {
            e.add("data.token_files.eod_token", "document resets in the log-linear layer '", k, "' under sequence "
                  "parallelism need parallel.scan_mode: ORDERED (its summaries hold the slice's positions, which "
                  "do not reset at a document start); got sp = ", c.parallel().sp(), " with ",
                  config::ParallelConfig::ScanMode_Name(c.parallel().scan_mode()));
            break;
          }
      break;
    }
    case DataConfig::kMqar: {
      auto& q = d.mqar();
      int64_t V = q.vocab_size(), N = q.num_kv_pairs(), Q = q.num_queries();
      if (N <= 0) e.add("data.mqar.num_kv_pairs", "must be positive, got ", N);
      else if (T_ok && N > T) e.add("data.mqar.num_kv_pairs", "must not exceed data.seq_len (", T, "), got ", N);
      if (Q <= 0) e.add("data.mqar.num_queries", "must be positive, got ", Q);
      else if (T_ok && Q > T) e.add("data.mqar.num_queries", "must not exceed data.seq_len (", T, "), got ", Q);
      if (V < 3) e.add("data.mqar.vocab_size", "must be at least 3 (pad, one key, one value), got ", V);
      else if ((V - 1) / 2 < N)
        e.add("data.mqar.vocab_size", V, " gives ", (V - 1) / 2, " key tokens, fewer than num_kv_pairs (", N, ")");
      if (V > m.vocab_size())
        e.add("data.mqar.vocab_size", V, " exceeds model.vocab_size (", m.vocab_size(), ")");
      if (N > 0 && Q > 0 && T_ok && N <= T && Q <= T && 2 * (N + Q) > T)
        e.add("data.mqar", "2*(num_kv_pairs + num_queries) = ", 2 * (N + Q), " tokens do not fit in data.seq_len (",
              T, ")");
      break;
    }
    case DataConfig::kNeedle: {
      auto& n = d.needle();
      int64_t V = n.vocab_size(), L = n.value_len(), D = n.num_distractors();
      if (L <= 0) e.add("data.needle.value_len", "must be positive, got ", L);
      else if (T_ok && L > T) e.add("data.needle.value_len", "must not exceed data.seq_len (", T, "), got ", L);
      if (D < 0) e.add("data.needle.num_distractors", "must be >= 0, got ", D);
      else if (T_ok && D > T) e.add("data.needle.num_distractors", "must not exceed data.seq_len (", T, "), got ", D);
      if (V < 7) e.add("data.needle.vocab_size", "must be at least 7, got ", V);
      else if (D >= 0 && D <= kMaxSeqLen && (V - 3) / 4 < D + 1)
        e.add("data.needle.vocab_size", V, " gives ", (V - 3) / 4, " key tokens, fewer than the ", D + 1,
              " needles (1 + num_distractors)");
      if (V > m.vocab_size())
        e.add("data.needle.vocab_size", V, " exceeds model.vocab_size (", m.vocab_size(), ")");
      int64_t needle_tokens = 0;
      if (L > 0 && D >= 0 && T_ok && L <= T && D <= T && mul_ok(D + 2, L + 2, &needle_tokens) &&
          needle_tokens > T)
        e.add("data.needle", "the needles and the query take (num_distractors + 2)*(value_len + 2) = ",
              needle_tokens, " tokens, more than data.seq_len (", T, ")");
      break;
    }
  }

  if (par.dp() < 1) e.add("parallel.dp", "must be >= 1, got ", par.dp());
  if (sp < 1) e.add("parallel.sp", "must be >= 1, got ", sp);
  if (par.has_serial_states() && par.serial_states() && sp > 1 && par.scan_mode() != config::ParallelConfig::ORDERED)
    e.add("parallel.serial_states", "true at sp > 1 needs parallel.scan_mode: ORDERED (the tree and allgather "
          "scans summarize slices with the ATen forms); got sp = ", sp, " with ",
          config::ParallelConfig::ScanMode_Name(par.scan_mode()));
  if (par.recompute_keep_last() < 0)
    e.add("parallel.recompute_keep_last", "expected 0 or more layers that keep their activations under "
          "parallel.recompute; got " + std::to_string(par.recompute_keep_last()));
  if (par.has_recompute_overlap() && par.recompute_overlap() && !par.recompute())
    e.add("parallel.recompute_overlap", "true needs parallel.recompute: true (it overlaps the recomputation with the "
          "backward); got recompute: false");
  if (par.recompute_keeps_mixer() && !par.recompute())
    e.add("parallel.recompute_keeps_mixer", "true needs parallel.recompute: true (it chooses what the recomputation "
          "keeps); got recompute: false");
  const bool ordered = par.scan_mode() == config::ParallelConfig::ORDERED;
  // Segments a rank holds when parallel.segments is sp times a power of two; else 0.
  const int64_t rank_segments = sp >= 1 && par.segments() > 0 && par.segments() % sp == 0 &&
                                        ((par.segments() / sp) & (par.segments() / sp - 1)) == 0
                                    ? par.segments() / sp
                                    : 0;
  if (par.segments() < 0) e.add("parallel.segments", "must be >= 0 (0: sp), got ", par.segments());
  else if (par.segments() > 0 && !ordered)
    e.add("parallel.segments", "needs parallel.scan_mode: ORDERED (segments make the ordered chain reproducible "
          "across layouts); got ", config::ParallelConfig::ScanMode_Name(par.scan_mode()));
  else if (par.segments() > 0 && sp >= 1 && rank_segments == 0)
    e.add("parallel.segments", "must be sp times a power of two (each rank holds a power of two of them), got ",
          par.segments(), " with sp = ", sp);
  if (par.deferred_head_gradient_mib() < 0 || par.deferred_head_gradient_mib() > (int64_t{1} << 20))
    e.add("parallel.deferred_head_gradient_mib", "expected 0 (off) to 1048576 MiB of logit gradients a rank after "
          "the first holds for its head's gradient; got " + std::to_string(par.deferred_head_gradient_mib()));
  if (par.loss_chunk_tokens() < 0)
    e.add("parallel.loss_chunk_tokens", "must be >= 0 (0: the default for the form that runs), got ", par.loss_chunk_tokens());
  int64_t ranks = 0;
  bool ranks_ok = false;
  if (par.dp() >= 1 && sp >= 1) {
    bool fits = mul_ok(par.dp(), sp, &ranks);
    ranks_ok = fits && ranks <= kMaxRanks;
    if (!ranks_ok)
      e.add("parallel", "dp*sp must be at most 2^20 = ", kMaxRanks, " ranks, got dp = ", par.dp(), ", sp = ", sp,
            fits ? " (dp*sp = " + std::to_string(ranks) + ")" : std::string(" (dp*sp overflows int64)"));
  }
  const bool sp_ok = sp >= 1 && sp <= kMaxRanks;
  int64_t step_tokens = 0;  // tokens a step over all dp replicas: the trainer counts them in int64
  const int64_t accum = c.optimizer().grad_accum_steps();
  const bool accum_ok = accum >= 1 && accum <= kMaxSeqLen;
  if (!accum_ok) e.add("optimizer.grad_accum_steps", "must lie in [1, 2^40 = ", kMaxSeqLen, "], got ", accum);
  if (T_ok && d.batch_size() > 0 && d.batch_size() <= kMaxSeqLen && ranks_ok && accum_ok &&
      (!mul_ok(T, d.batch_size(), &step_tokens) || !mul_ok(step_tokens, par.dp(), &step_tokens) ||
       !mul_ok(step_tokens, accum, &step_tokens)))
    e.add("data.batch_size", "data.seq_len*data.batch_size*parallel.dp*optimizer.grad_accum_steps (tokens a step) "
          "must fit in int64, got ", T, "*", d.batch_size(), "*", par.dp(), "*", accum);
  // The pieces the sequence is cut into: sp slices, or the ordered segments.
  const bool segmented = ordered && rank_segments > 0 && sp_ok && par.segments() <= kMaxRanks;
  const int64_t pieces = segmented ? par.segments() : sp;
  const char* pieces_name = segmented ? "parallel.segments" : "sp";
  if (T_ok && sp_ok) {
    int64_t per_rank = T / pieces;
    for (auto& k : distinct_kinds(m)) {
      if (!is_known_kind(k)) continue;
      int64_t layer = std::find(m.mixers().begin(), m.mixers().end(), k) - m.mixers().begin();
      auto o = layer_mixer(m, layer).options;
      if (layer_kind(k).window) {
        if (o.window() == 0 && pieces > 1)
          e.add(segmented ? "parallel.segments" : "parallel.sp", "softmax_attn layers with window 0 (full causal "
                "attention) cannot be ", segmented ? "cut into segments" : "sequence-parallel", " (", pieces_name,
                " = ", pieces, "); give them a window: mixer_options { kind: \"softmax_attn\" window: ... }");
        if (o.window() > 0 && pieces > 1 && o.window() > per_rank)
          e.add(path_of_option(m, k, "window"), "window ", o.window(), " exceeds the ", per_rank, " tokens each of the ",
                pieces, segmented ? " segments holds (the halo comes from the previous segment only)"
                                  : " sp ranks holds (the halo comes from the previous rank only)");
      } else if (o.chunk_size() > 0 && o.chunk_size() <= kMaxChunkSize && T % (o.chunk_size() * pieces) != 0) {
        e.add("data.seq_len", "must be a multiple of chunk_size*", segmented ? "segments" : "sp", " = ",
              o.chunk_size(), "*", pieces, " = ", o.chunk_size() * pieces, " (", k, " layers), got ", T);
      }
      if (o.conv_size() > 1 && pieces > 1 && o.conv_size() - 1 > per_rank)
        e.add(path_of_option(m, k, "conv_size"), "conv_size ", o.conv_size(), " needs a halo of ", o.conv_size() - 1,
              " tokens, more than the ", per_rank, segmented ? " each segment holds" : " each sp rank holds");
      if (layer_kind(k).levels && o.levels() > 0 && o.levels() < layer_kind(k).levels_needed(T))
        e.add(path_of_option(m, k, "levels"), k, " over data.seq_len = ", T, " needs levels >= ",
              layer_kind(k).levels_needed(T), " (or 0 for as many as needed), got ", o.levels());
    }
  }

  auto& o = c.optimizer();
  // (Non-finite values were reported by check_finite; these checks are for finite ones.)
  auto finite_and = [](double v, bool ok) { return !std::isfinite(v) || ok; };
  if (!finite_and(o.lr(), o.lr() > 0)) e.add("optimizer.lr", "must be positive, got ", o.lr());
  if (!finite_and(o.beta1(), o.beta1() >= 0 && o.beta1() < 1))
    e.add("optimizer.beta1", "must lie in [0, 1), got ", o.beta1());
  if (!finite_and(o.beta2(), o.beta2() >= 0 && o.beta2() < 1))
    e.add("optimizer.beta2", "must lie in [0, 1), got ", o.beta2());
  if (!finite_and(o.eps(), o.eps() > 0)) e.add("optimizer.eps", "must be positive, got ", o.eps());
  if (!finite_and(o.weight_decay(), o.weight_decay() >= 0))
    e.add("optimizer.weight_decay", "must be >= 0, got ", o.weight_decay());
  if (!finite_and(o.grad_clip(), o.grad_clip() >= 0))
    e.add("optimizer.grad_clip", "must be >= 0 (0 = no clipping), got ", o.grad_clip());
  if (o.total_steps() <= 0) e.add("optimizer.total_steps", "must be positive, got ", o.total_steps());
  if (o.warmup_steps() < 0) e.add("optimizer.warmup_steps", "must be >= 0, got ", o.warmup_steps());
  else if (o.total_steps() > 0 && o.warmup_steps() > o.total_steps())
    e.add("optimizer.warmup_steps", "must not exceed total_steps (", o.total_steps(), "), got ", o.warmup_steps());
  if (!finite_and(o.min_lr_ratio(), o.min_lr_ratio() >= 0 && o.min_lr_ratio() <= 1))
    e.add("optimizer.min_lr_ratio", "must lie in [0, 1], got ", o.min_lr_ratio());

  auto& k = c.checkpoint();
  if (k.every_steps() < 0) e.add("checkpoint.every_steps", "must be >= 0 (0 = only at the end), got ", k.every_steps());
  if (k.keep_last() < 0) e.add("checkpoint.keep_last", "must be >= 0 (0 = keep all), got ", k.keep_last());
  if (k.every_steps() > 0 && k.dir().empty())
    e.add("checkpoint.dir", "is needed when checkpoint.every_steps > 0 (", k.every_steps(), ")");
  if (k.resume() == config::CheckpointConfig::REQUIRED && k.dir().empty())
    e.add("checkpoint.resume", "REQUIRED needs a checkpoint.dir to resume from");

  auto& l = c.logging();
  if (l.every_steps() < 1) e.add("logging.every_steps", "must be >= 1, got ", l.every_steps());
  if (l.eval_every_steps() < 0) e.add("logging.eval_every_steps", "must be >= 0 (0 = never), got ", l.eval_every_steps());
}

void check_cluster(const ClusterConfig& c, Errors& e) {
  static const std::regex env_re("[A-Za-z_][A-Za-z0-9_]*");
  if (c.hosts().empty()) e.add("hosts", "at least one host is needed: hosts { name: \"node0\" gpus: 8 }");
  std::map<std::string, int> seen;
  for (int i = 0; i < c.hosts_size(); ++i) {
    auto& h = c.hosts(i);
    std::string q = "hosts[" + std::to_string(i) + "]";
    if (h.name().empty()) e.add(q + ".name", "is empty");
    else if (seen.count(h.name())) e.add(q + ".name", "'", h.name(), "' is listed twice (also hosts[", seen[h.name()], "])");
    else seen[h.name()] = i;
    if (h.gpus() < 1) e.add(q + ".gpus", "must be >= 1, got ", h.gpus());
  }
  if (c.network_interface().find_first_of(" \t") != std::string::npos)
    e.add("network_interface", "must be one interface name, got '", c.network_interface(), "'");
  for (auto& kv : c.env())
    if (!std::regex_match(kv.first, env_re)) e.add("env", "'", kv.first, "' is not an environment variable name");
}

std::vector<std::string> to_strings(const std::vector<FieldError>& errors) {
  std::vector<std::string> out;
  for (auto& err : errors) out.push_back(err.path + ": " + err.message);
  return out;
}

// The sources a resolved run config came from, to point errors at where a field was written.
struct Provenance {
  Source* run = nullptr;
  Source* preset = nullptr;
  std::vector<std::string> overrides;  // assignments, in order
};

std::string describe(const FieldError& err, const Provenance& prov, const pb::Descriptor* root) {
  std::string path = err.path;
  for (auto it = prov.overrides.rbegin(); it != prov.overrides.rend(); ++it) {
    auto op = override_path(*it);
    auto is_prefix = [](const std::string& a, const std::string& b) {  // a is b or a parent of b
      return starts_with(b, a) && (b.size() == a.size() || b[a.size()] == '.' || b[a.size()] == '[');
    };
    if (is_prefix(op, path) || is_prefix(path, op))
      return prov.run->name + ": " + path + ": " + err.message + " (set by --set " + *it + ")";
  }
  std::vector<Segment> segs;
  try {
    segs = parse_path(path);
  } catch (const ConfigError&) {
  }
  auto at = [&](const Source& s, const Location& loc) {
    return s.name + ":" + std::to_string(loc.line) + ":" + std::to_string(loc.column) + ": " + path + ": " +
           err.message;
  };
  if (!segs.empty()) {
    auto loc = locate(*prov.run, root, segs);
    if (loc.line > 0) return at(*prov.run, loc);
    if (prov.preset && segs[0].name == "model" && segs.size() > 1) {
      loc = locate(*prov.preset, ModelConfig::descriptor(), {segs.begin() + 1, segs.end()});
      if (loc.line > 0) return at(*prov.preset, loc);
    }
  }
  return prov.run->name + ": " + path + ": " + err.message;
}

void throw_if_errors(const std::vector<FieldError>& errors, const Provenance& prov, const pb::Descriptor* root) {
  if (errors.empty()) return;
  std::vector<std::string> lines;
  for (auto& err : errors) lines.push_back(describe(err, prov, root));
  throw ConfigError(join(lines, "\n"));
}

std::string resolve_relative(const std::string& base_file, const std::string& path) {
  if (path.empty() || path[0] == '/') return path;
  return directory_of(base_file) + path;
}

RunConfig resolve_run(Source& run_source, const std::vector<std::string>& overrides) {
  RunConfig raw;
  parse_into(run_source, raw);
  Provenance prov;
  prov.run = &run_source;
  prov.overrides = overrides;

  std::vector<std::string> late;
  for (auto& o : overrides) {
    if (override_path(o) == "model_preset") apply_override(raw, o);
    else late.push_back(o);
  }

  RunConfig config;
  Source preset_source;
  if (!raw.model_preset().empty()) {
    preset_source.name = resolve_relative(run_source.name, raw.model_preset());
    try {
      preset_source.text = read_text_file(preset_source.name);
    } catch (const ConfigError& err) {
      throw_if_errors({{"model_preset", err.what()}}, prov, RunConfig::descriptor());
    }
    ModelConfig preset;
    parse_into(preset_source, preset);
    prov.preset = &preset_source;
    config = raw;
    *config.mutable_model() = preset;
    overlay(*config.mutable_model(), raw.model());
    config.clear_model_preset();
  } else {
    config = raw;
  }
  for (auto& o : late) apply_override(config, o);
  fill_defaults(config);

  Errors errors;
  check_run(config, errors);
  throw_if_errors(errors.list, prov, RunConfig::descriptor());
  return config;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Public API

RunConfig load_run_config(const std::string& path, const std::vector<std::string>& overrides) {
  Source source;
  source.name = path;
  source.text = read_text_file(path);
  return resolve_run(source, overrides);
}

RunConfig run_config_from_text(const std::string& text, const std::string& source_name,
                               const std::vector<std::string>& overrides) {
  Source source;
  source.name = source_name;
  source.text = text;
  return resolve_run(source, overrides);
}

ModelConfig load_model_config(const std::string& path) {
  Source source;
  source.name = path;
  source.text = read_text_file(path);
  ModelConfig model;
  parse_into(source, model);
  fill_defaults(model);
  Errors errors;
  check_model(model, "", errors);
  Provenance prov;
  prov.run = &source;
  throw_if_errors(errors.list, prov, ModelConfig::descriptor());
  return model;
}

ClusterConfig load_cluster_config(const std::string& path) {
  Source source;
  source.name = path;
  source.text = read_text_file(path);
  ClusterConfig cluster;
  parse_into(source, cluster);
  fill_defaults(cluster);
  Errors errors;
  check_cluster(cluster, errors);
  Provenance prov;
  prov.run = &source;
  throw_if_errors(errors.list, prov, ClusterConfig::descriptor());
  return cluster;
}

void apply_override(Message& root, const std::string& assignment) {
  const std::string what = "--set " + printable(assignment, false);
  for (size_t i = 0; i < assignment.size();) {
    const auto c = static_cast<unsigned char>(assignment[i]);
    const size_t n = utf8_length(assignment, i);
    if (n == 0 || (c < 0x20 && c != '\t') || c == 0x7F)
      throw ConfigError(what + ": not text: byte " + hex_escape(c) + (n == 0 ? " is not UTF-8" : " is a control character"));
    i += n;
  }
  auto eq = assignment.find('=');
  if (eq == std::string::npos || trim(assignment.substr(0, eq)).empty())
    throw ConfigError(what + ": expected field.path=value, e.g. optimizer.lr=1e-3");
  std::string value = assignment.substr(eq + 1);
  std::vector<Segment> path;
  try {
    path = parse_path(trim(assignment.substr(0, eq)));
  } catch (const ConfigError& err) {
    throw ConfigError(what + ": " + err.what());
  }
  Message* msg = &root;
  for (size_t i = 0; i < path.size(); ++i) {
    auto* d = msg->GetDescriptor();
    auto* r = msg->GetReflection();
    auto& seg = path[i];
    auto* f = d->FindFieldByName(seg.name);
    if (!f)
      throw ConfigError(what + ": unknown field '" + seg.name + "' in " + level_name(path, i) + " (" + d->name() +
                        "; valid fields: " + join(field_names(d), ", ") + ")");
    if (seg.index >= 0 && !f->is_repeated())
      throw ConfigError(what + ": " + (i ? level_name(path, i) + "." : "") + seg.name + " is not a list; drop the [" +
                        seg.index_text + "]");
    if (f->is_map()) throw ConfigError(what + ": " + seg.name + " is a map; --set cannot change maps");
    int size = f->is_repeated() ? r->FieldSize(*msg, f) : 0;
    if (seg.index > size) {
      std::string field = (i ? level_name(path, i) + "." : "") + seg.name, n = std::to_string(size);
      throw ConfigError(what + ": index " + seg.index_text + " of " + field + " is out of range: expected " +
                        (size == 0 ? "0" : "0 to " + n) + " (" + field + " has " + n +
                        (size == 1 ? " element" : " elements") + "; [" + n + "] appends one)");
    }
    bool last = i + 1 == path.size();
    if (!last) {
      if (f->cpp_type() != FieldDescriptor::CPPTYPE_MESSAGE)
        throw ConfigError(what + ": " + level_name(path, i + 1) + " is " + type_words(f) +
                          ", not a message: it has no field '" + path[i + 1].name + "'");
      if (f->is_repeated()) {
        if (seg.index < 0)
          throw ConfigError(what + ": " + level_name(path, i + 1) + " is a list; pick an element with " + seg.name +
                            "[i]");
        msg = seg.index == size ? r->AddMessage(msg, f) : r->MutableRepeatedMessage(msg, f, seg.index);
      } else {
        msg = r->MutableMessage(msg, f);
      }
      continue;
    }
    // The field to set.
    if (trim(value).empty()) {
      if (seg.index >= 0) throw ConfigError(what + ": an empty value clears a whole field, not one element");
      r->ClearField(msg, f);
      return;
    }
    if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      if (f->is_repeated() && seg.index < 0)
        throw ConfigError(what + ": " + seg.name + " is a list of messages; set one element with " + seg.name +
                          "[i]=..., or clear the list with " + seg.name + "=");
      std::unique_ptr<Message> parsed(
          pb::MessageFactory::generated_factory()->GetPrototype(f->message_type())->New());
      parse_message_value(value, *parsed, what);
      Message* target = !f->is_repeated() ? r->MutableMessage(msg, f)
                        : seg.index == size ? r->AddMessage(msg, f)
                                            : r->MutableRepeatedMessage(msg, f, seg.index);
      target->CopyFrom(*parsed);
      return;
    }
    if (f->is_repeated() && seg.index < 0) {
      std::string list = trim(value);
      if (list.size() >= 2 && list.front() == '[' && list.back() == ']') list = list.substr(1, list.size() - 2);
      std::vector<Scalar> items;
      std::stringstream ss(list);
      for (std::string item; std::getline(ss, item, ',');) items.push_back(parse_scalar(f, item, what));
      r->ClearField(msg, f);
      for (auto& item : items) set_scalar(*msg, f, r->FieldSize(*msg, f), item);
      return;
    }
    set_scalar(*msg, f, seg.index, parse_scalar(f, value, what));
  }
}

std::vector<std::string> run_config_errors(const RunConfig& config) {
  RunConfig filled = config;
  fill_defaults(filled);
  Errors e;
  check_run(filled, e);
  return to_strings(e.list);
}

std::vector<std::string> model_config_errors(const ModelConfig& model) {
  Errors e;
  check_model(model, "model.", e);
  return to_strings(e.list);
}

std::vector<std::string> cluster_config_errors(const ClusterConfig& cluster) {
  Errors e;
  check_cluster(cluster, e);
  return to_strings(e.list);
}

void validate_layout(const RunConfig& config, int64_t world_size) {
  int64_t dp = config.parallel().dp(), sp = config.parallel().sp();
  if (world_size < 1) throw ConfigError("the launch has " + std::to_string(world_size) + " ranks");
  int64_t ranks = 0;
  if (__builtin_mul_overflow(dp, sp, &ranks))
    throw ConfigError("parallel: dp*sp overflows int64 (dp = " + std::to_string(dp) + ", sp = " + std::to_string(sp) +
                      "); the launch has " + std::to_string(world_size) + " ranks");
  if (ranks != world_size)
    throw ConfigError("parallel: dp*sp = " + std::to_string(ranks) + " but the launch has " +
                      std::to_string(world_size) + " ranks (dp = " + std::to_string(dp) + ", sp = " +
                      std::to_string(sp) + ")");
}

std::string config_to_text(const Message& message) {
  TextFormat::Printer printer;
  printer.SetUseShortRepeatedPrimitives(true);
  std::string out;
  printer.PrintToString(message, &out);
  return out;
}

RunConfig parse_stored_run_config(const std::string& text, const std::string& source_name) {
  Source source;
  source.name = source_name;
  source.text = text;
  RunConfig config;
  parse_into(source, config);
  fill_defaults(config);
  return config;
}

namespace {

std::string one_line(const Message& m) {
  TextFormat::Printer printer;
  printer.SetSingleLineMode(true);
  printer.SetUseShortRepeatedPrimitives(true);
  std::string out;
  printer.PrintToString(m, &out);
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return "{" + out + "}";
}

// A field's value as text: a scalar as textproto prints it, a message on one line, a list as [...].
std::string field_text(const Message& m, const FieldDescriptor* f) {
  auto* r = m.GetReflection();
  auto element = [&](int index) {
    if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE)
      return one_line(index < 0 ? r->GetMessage(m, f) : r->GetRepeatedMessage(m, f, index));
    std::string out;
    TextFormat::PrintFieldValueToString(m, f, index, &out);
    return out;
  };
  if (!f->is_repeated()) return r->HasField(m, f) ? element(-1) : "(unset)";
  std::vector<std::string> items;
  for (int i = 0; i < r->FieldSize(m, f); ++i) items.push_back(element(i));
  return "[" + join(items, ", ") + "]";
}

void collect_changes(const Message& a, const Message& b, const std::string& prefix, std::vector<ConfigChange>& out) {
  auto* d = a.GetDescriptor();
  auto* ra = a.GetReflection();
  auto* rb = b.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    auto* f = d->field(i);
    const std::string path = prefix + f->name();
    if (!f->is_repeated() && f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE && ra->HasField(a, f) &&
        rb->HasField(b, f)) {
      collect_changes(ra->GetMessage(a, f), rb->GetMessage(b, f), path + ".", out);
      continue;
    }
    std::string x = field_text(a, f), y = field_text(b, f);
    if (x != y) out.push_back({path, x, y});
  }
}

}  // namespace

std::vector<ConfigChange> config_changes(const Message& before, const Message& after) {
  if (before.GetDescriptor() != after.GetDescriptor())
    throw ConfigError("config_changes: a " + before.GetTypeName() + " against a " + after.GetTypeName());
  std::vector<ConfigChange> out;
  collect_changes(before, after, "", out);
  return out;
}

const std::vector<std::string>& known_mixer_kinds() { return layer_kind_names(); }

LayerMixer layer_mixer(const ModelConfig& model, int64_t layer) {
  if (model.mixers().empty()) throw ConfigError("model.mixers: no mixer kinds");
  if (layer < 0) throw ConfigError("layer_mixer: negative layer " + std::to_string(layer));
  LayerMixer out;
  out.kind = model.mixers(static_cast<int>(layer % model.mixers_size()));
  for (auto& o : model.mixer_options())
    if (!o.has_kind()) out.options.MergeFrom(o);
  for (auto& o : model.mixer_options())
    if (o.has_kind() && o.kind() == out.kind) out.options.MergeFrom(o);
  out.options.set_kind(out.kind);
  fill_defaults(out.options);
  return out;
}

bool recompute_overlap_applies(const RunConfig& config, bool if_recomputed) {
  const auto& par = config.parallel();
  const bool on = par.has_recompute_overlap() ? par.recompute_overlap() : par.sp() == 1;
  return (if_recomputed || par.recompute()) && on && !par.recompute_keeps_mixer();
}

int64_t head_dim_k(const ModelConfig& model) {
  return model.has_head_dim_k() ? model.head_dim_k() : model.d_model() / std::max<int64_t>(model.n_heads(), 1);
}

int64_t head_dim_v(const ModelConfig& model) {
  return model.has_head_dim_v() ? model.head_dim_v() : model.d_model() / std::max<int64_t>(model.n_heads(), 1);
}

int64_t mlp_hidden_size(const ModelConfig& model) {
  auto h = static_cast<int64_t>(std::ceil(model.mlp_ratio() * static_cast<double>(model.d_model()) - 1e-9));
  return (h + 63) / 64 * 64;
}

}  // namespace carry
