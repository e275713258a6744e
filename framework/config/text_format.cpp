// Reading a config as textproto with located errors (see text_format.h).
#include "framework/config/text_format.h"

#include "framework/config/config.h"
#include "framework/printable.h"
#include "layers/layout.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include <sys/stat.h>

namespace carry::config_internal {

namespace pb = google::protobuf;
using pb::Message;
using pb::TextFormat;

namespace {

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

}  // namespace

std::string read_text_file(const std::string& path) {
  const std::string shown = printable(path, false);  // a path from a damaged file may hold any byte
  struct stat st;
  if (::stat(path.c_str(), &st) != 0)
    throw ConfigError("cannot read config file '" + shown + "': " + std::strerror(errno));
  if (S_ISDIR(st.st_mode))
    throw ConfigError("cannot read config file '" + shown + "': it is a directory; expected a .textproto file");
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError("cannot read config file '" + shown + "': " + std::strerror(errno));
  std::string text;
  char buf[65536];
  while (in.read(buf, sizeof buf) || in.gcount() > 0) {
    text.append(buf, static_cast<size_t>(in.gcount()));
    if (text.size() > kMaxConfigBytes)
      throw ConfigError("config file '" + shown + "' is larger than " + std::to_string(kMaxConfigBytes >> 20) +
                        " MiB; a config is a short textproto file");
  }
  if (in.bad()) throw ConfigError("cannot read config file '" + shown + "': " + std::strerror(errno));
  return text;
}

Location to_location(const std::string& text, int line0, int column0) {
  if (line0 < 0) return {};
  auto l = line_of(text, line0);
  return {line0 + 1, static_cast<int>(chars_before(l, byte_offset(l, column0))) + 1};
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

}  // namespace carry::config_internal
