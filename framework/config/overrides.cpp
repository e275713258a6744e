// `--set` overrides (see apply_override in config.h): a field path walked through protobuf reflection,
// the value parsed by the field's type (a scalar, a comma-separated list, or textproto for a message),
// and errors that name the assignment and list what is valid at that level.
#include "framework/config/overrides.h"

#include "framework/config/config.h"
#include "framework/config/text_format.h"
#include "framework/printable.h"
#include "layers/layout.h"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>
#include <google/protobuf/reflection.h>
#include <google/protobuf/text_format.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstdlib>
#include <memory>
#include <regex>
#include <sstream>

namespace carry {

namespace pb = google::protobuf;
using pb::FieldDescriptor;
using pb::Message;
using pb::TextFormat;

using config_internal::CollectErrors;
using config_internal::enum_names;
using config_internal::explain;
using config_internal::field_names;
using config_internal::parse_path;
using config_internal::Segment;

namespace {

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

}  // namespace

namespace config_internal {

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

std::string override_path(const std::string& assignment) {
  auto eq = assignment.find('=');
  return trim(eq == std::string::npos ? assignment : assignment.substr(0, eq));
}

}  // namespace config_internal

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

}  // namespace carry
