// safetensors reader and writer (see safetensors.h). The header JSON is parsed with protobuf's JSON
// utilities into a google.protobuf.Struct and then checked field by field; the byte buffer must be
// covered exactly by the tensors' data_offsets (no gap, no overlap, nothing past the end), as the
// reference reader requires. Numbers in a Struct are doubles, so offsets and sizes above 2^53 are
// refused as absurd (the header itself is limited to 100 MB).
#include "framework/io/safetensors.h"

#include "framework/io/json.h"
#include "framework/io/output_file.h"
#include "framework/printable.h"

#include <google/protobuf/struct.pb.h>
#include <google/protobuf/util/json_util.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <memory>
#include <sstream>
#include <vector>

#include <fcntl.h>
#include <unistd.h>

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "safetensors stores little-endian data; carry reads and writes it as in memory");

namespace carry {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100'000'000;  // the reference reader's limit
constexpr double kMaxExactInteger = 9007199254740992.0;  // 2^53
// safetensors headers are two levels deep ({"name": {"shape": [...]}}, plus "__metadata__"); protobuf's
// JSON parser takes time quadratic in the nesting depth (21 s at 30,000 levels), so deeper headers
// are refused by a linear scan before parsing.
constexpr int kMaxHeaderDepth = 8;

struct DtypeInfo {
  const char* name;
  at::ScalarType type;
  uint64_t size;
  int order;  // the reference's Dtype enum order: the writer puts higher orders first
};

const std::vector<DtypeInfo>& dtypes() {
  static const std::vector<DtypeInfo> table = {
      {"F64", at::kDouble, 8, 12}, {"F32", at::kFloat, 4, 11}, {"F16", at::kHalf, 2, 7},
      {"BF16", at::kBFloat16, 2, 8}, {"I64", at::kLong, 8, 13}, {"I32", at::kInt, 4, 9},
      {"I16", at::kShort, 2, 5},   {"I8", at::kChar, 1, 2},    {"U8", at::kByte, 1, 1},
      {"BOOL", at::kBool, 1, 0},
  };
  return table;
}

std::string dtype_list() {
  std::string s;
  for (auto& d : dtypes()) s += (s.empty() ? "" : ", ") + std::string(d.name);
  return s;
}

const DtypeInfo* dtype_by_name(const std::string& name) {
  for (auto& d : dtypes())
    if (name == d.name) return &d;
  return nullptr;
}

const DtypeInfo* dtype_by_type(at::ScalarType type) {
  for (auto& d : dtypes())
    if (type == d.type) return &d;
  return nullptr;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  s << "]";
  return s.str();
}

// Byte offset of the first invalid UTF-8 sequence, or npos.
size_t invalid_utf8_at(const std::string& s) {
  size_t i = 0, n = s.size();
  while (i < n) {
    auto c = static_cast<unsigned char>(s[i]);
    size_t len = c < 0x80 ? 1 : (c >> 5) == 0x6 ? 2 : (c >> 4) == 0xE ? 3 : (c >> 3) == 0x1E ? 4 : 0;
    if (len == 0 || i + len > n) return i;
    uint32_t cp = len == 1 ? c : c & (0x7F >> len);
    for (size_t k = 1; k < len; ++k) {
      auto b = static_cast<unsigned char>(s[i + k]);
      if ((b >> 6) != 0x2) return i;
      cp = (cp << 6) | (b & 0x3F);
    }
    // Overlong forms, surrogates and code points past U+10FFFF are not UTF-8.
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
        (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF)
      return i;
    i += len;
  }
  return std::string::npos;
}

// "Unexpected token." plus where: protobuf's message is "<what>\n<context>\n<spaces>^", the context
// being a stretch of the input around the error; we locate it in the header to give a byte offset.
std::string describe_json_error(const std::string& header, const std::string& message) {
  std::vector<std::string> lines;
  std::stringstream in(message);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  if (lines.size() < 3 || lines[2].empty() || lines[2].back() != '^') return message;
  const std::string& context = lines[1];
  size_t column = lines[2].size() - 1, where = std::string::npos, found = 0;
  if (context.empty()) {
    where = header.size();
    found = 1;
  } else {
    for (size_t p = header.find(context); p != std::string::npos; p = header.find(context, p + 1)) {
      where = p + column;
      ++found;
    }
  }
  std::string what = lines[0];
  while (!what.empty() && (what.back() == '.' || what.back() == ' ')) what.pop_back();
  std::string near;  // the context, control characters escaped (a NUL would end the message)
  for (char ch : context) {
    if (static_cast<unsigned char>(ch) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", static_cast<unsigned>(ch));
      near += buf;
    } else {
      near += ch;
    }
  }
  std::ostringstream s;
  s << what;
  if (context.empty()) s << " (at the end of the header)";
  else if (found == 1) s << " (at header byte " << where << ", file byte " << where + 8 << ")";
  if (!context.empty()) s << ", near '" << near << "'";
  return s.str();
}

const char* kind_of(const google::protobuf::Value& v) {
  switch (v.kind_case()) {
    case google::protobuf::Value::kNullValue: return "null";
    case google::protobuf::Value::kNumberValue: return "a number";
    case google::protobuf::Value::kStringValue: return "a string";
    case google::protobuf::Value::kBoolValue: return "a boolean";
    case google::protobuf::Value::kStructValue: return "an object";
    case google::protobuf::Value::kListValue: return "a list";
    default: return "nothing";
  }
}

// A list of non-negative integers (JSON numbers), each at most 2^53.
std::vector<int64_t> integer_list(const google::protobuf::Value& v, const std::string& what) {
  TORCH_CHECK(v.kind_case() == google::protobuf::Value::kListValue, what,
              " must be a list of non-negative integers, found ", kind_of(v));
  std::vector<int64_t> out;
  for (int i = 0; i < v.list_value().values_size(); ++i) {
    const auto& x = v.list_value().values(i);
    TORCH_CHECK(x.kind_case() == google::protobuf::Value::kNumberValue, what, "[", i,
                "] must be a non-negative integer, found ", kind_of(x));
    double d = x.number_value();
    TORCH_CHECK(d >= 0 && d <= kMaxExactInteger && d == std::floor(d),
                what, "[", i, "] must be a non-negative integer (at most 2^53), found ", d);
    out.push_back(static_cast<int64_t>(d));
  }
  return out;
}

// Scans the JSON text for the deepest nesting of objects and lists outside strings. Returns the byte
// offset where the nesting first exceeds `limit` (and its depth in *depth), or npos.
size_t too_deep_at(const std::string& header, int limit, int* depth) {
  int d = 0;
  bool in_string = false;
  for (size_t i = 0; i < header.size(); ++i) {
    char c = header[i];
    if (in_string) {
      if (c == '\\') ++i;  // skip the escaped character
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++d > limit) {
        *depth = d;
        return i;
      }
    } else if (c == '}' || c == ']') {
      --d;
    }
  }
  return std::string::npos;
}

struct Entry {
  std::string name;
  const DtypeInfo* dtype;
  std::vector<int64_t> shape;
  uint64_t begin, end;
};

Entry parse_entry(const std::string& path, const std::string& name, const google::protobuf::Value& v) {
  std::string what = path + ": tensor '" + name + "'";
  TORCH_CHECK(v.kind_case() == google::protobuf::Value::kStructValue, what,
              ": header entry must be an object {\"dtype\", \"shape\", \"data_offsets\"}, found ",
              kind_of(v));
  const auto& fields = v.struct_value().fields();
  for (const char* key : {"dtype", "shape", "data_offsets"})
    TORCH_CHECK(fields.count(key), what, ": header entry has no \"", key,
                "\" (expected \"dtype\", \"shape\" and \"data_offsets\")");
  Entry e;
  e.name = name;
  const auto& dt = fields.at("dtype");
  TORCH_CHECK(dt.kind_case() == google::protobuf::Value::kStringValue, what,
              ": \"dtype\" must be a string (one of ", dtype_list(), "), found ", kind_of(dt));
  e.dtype = dtype_by_name(dt.string_value());
  TORCH_CHECK(e.dtype, what, ": unknown dtype \"", dt.string_value(), "\" (expected one of ",
              dtype_list(), ")");
  e.shape = integer_list(fields.at("shape"), what + ": \"shape\"");
  auto offsets = integer_list(fields.at("data_offsets"), what + ": \"data_offsets\"");
  TORCH_CHECK(offsets.size() == 2, what, ": \"data_offsets\" must be [begin, end], found ",
              offsets.size(), " numbers");
  e.begin = offsets[0];
  e.end = offsets[1];
  TORCH_CHECK(e.begin <= e.end, what, ": \"data_offsets\" [", e.begin, ", ", e.end,
              "] end before begin");
  // numel · size, refusing overflow (every factor is below 2^53, so one check per step suffices).
  uint64_t bytes = e.dtype->size;
  for (int64_t d : e.shape) {
    TORCH_CHECK(d == 0 || bytes <= static_cast<uint64_t>(kMaxExactInteger) / static_cast<uint64_t>(d),
                what, ": shape ", shape_string(e.shape), " is too large");
    bytes *= static_cast<uint64_t>(d);
  }
  TORCH_CHECK(e.end - e.begin == bytes, what, ": dtype ", e.dtype->name, " and shape ",
              shape_string(e.shape), " need ", bytes, " bytes but data_offsets [", e.begin, ", ",
              e.end, "] hold ", e.end - e.begin);
  return e;
}

struct FileCloser {
  void operator()(FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<FILE, FileCloser>;

// The reader; load_safetensors makes its messages printable.
std::map<std::string, at::Tensor> read_safetensors(const std::string& path,
                                                   std::map<std::string, std::string>* metadata) {
  std::string why;
  const int fd = open_for_reading(path, &why);  // a FIFO in its place is refused, never waited on
  TORCH_CHECK(fd >= 0, path, ": cannot open: ", why);
  File f(::fdopen(fd, "rb"));
  if (!f) ::close(fd);
  TORCH_CHECK(f, path, ": cannot open: ", std::strerror(errno));
  TORCH_CHECK(fseeko(f.get(), 0, SEEK_END) == 0, path, ": cannot seek: ", std::strerror(errno));
  off_t file_size = ftello(f.get());
  TORCH_CHECK(file_size >= 0, path, ": cannot tell its size: ", std::strerror(errno));
  std::rewind(f.get());
  auto size = static_cast<uint64_t>(file_size);
  TORCH_CHECK(size >= 8, path, ": not a safetensors file: ", size,
              " bytes, shorter than the 8-byte header length that starts the format");

  unsigned char len_bytes[8];
  TORCH_CHECK(std::fread(len_bytes, 1, 8, f.get()) == 8, path, ": cannot read the header length");
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];
  TORCH_CHECK(n <= kMaxHeaderBytes, path, ": header length ", n,
              " bytes is absurd (the format allows at most ", kMaxHeaderBytes,
              " bytes); not a safetensors file or a corrupt one");
  TORCH_CHECK(n <= size - 8, path, ": header length ", n, " bytes runs past the end of the file (",
              size, " bytes, so at most ", size - 8, "); the file is truncated or corrupt");

  std::string header(n, '\0');
  TORCH_CHECK(std::fread(header.data(), 1, n, f.get()) == n, path, ": cannot read the ", n,
              "-byte header");
  size_t bad = invalid_utf8_at(header);
  TORCH_CHECK(bad == std::string::npos, path, ": header is not valid UTF-8 (at header byte ", bad,
              ")");
  size_t first = header.find_first_not_of(" \t\r\n");
  TORCH_CHECK(first != std::string::npos && header[first] == '{', path,
              ": header must be a JSON object starting with '{', found ",
              first == std::string::npos ? std::string("only spaces")
                                         : "'" + std::string(1, header[first]) + "'");

  int depth = 0;
  size_t deep = too_deep_at(header, kMaxHeaderDepth, &depth);
  TORCH_CHECK(deep == std::string::npos, path, ": header nests objects and lists more than ",
              kMaxHeaderDepth, " levels deep (level ", depth, " at header byte ", deep,
              "); safetensors headers are 2 levels deep: not a safetensors file or a corrupt one");

  google::protobuf::Struct root;
  auto status = google::protobuf::util::JsonStringToMessage(header, &root);
  TORCH_CHECK(status.ok(), path, ": header is not valid JSON: ",
              describe_json_error(header, std::string(status.message())));

  std::vector<Entry> entries;
  if (metadata) metadata->clear();
  for (const auto& [name, value] : root.fields()) {
    if (name == "__metadata__") {
      TORCH_CHECK(value.kind_case() == google::protobuf::Value::kStructValue, path,
                  ": \"__metadata__\" must be an object of strings, found ", kind_of(value));
      for (const auto& [key, v] : value.struct_value().fields()) {
        TORCH_CHECK(v.kind_case() == google::protobuf::Value::kStringValue, path,
                    ": \"__metadata__\" entry \"", key, "\" must be a string, found ", kind_of(v));
        if (metadata) (*metadata)[key] = v.string_value();
      }
      continue;
    }
    entries.push_back(parse_entry(path, name, value));
  }

  // The buffer must be covered exactly: sorted by offsets, each tensor starts where the last ended.
  uint64_t buffer = size - 8 - n;
  for (const auto& e : entries)
    TORCH_CHECK(e.end <= buffer, path, ": tensor '", e.name, "': data_offsets [", e.begin, ", ", e.end,
                "] run past the end of the byte buffer (", buffer, " bytes after the header)");
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t covered = 0;
  for (size_t i = 0; i < entries.size(); ++i) {
    const auto& e = entries[i];
    TORCH_CHECK(e.begin >= covered, path, ": tensor '", e.name, "': data_offsets [", e.begin, ", ",
                e.end, "] overlap tensor '", entries[i - 1].name, "' [", entries[i - 1].begin, ", ",
                entries[i - 1].end, "]");
    TORCH_CHECK(e.begin == covered, path, ": bytes [", covered, ", ", e.begin,
                ") of the byte buffer belong to no tensor (tensor '", e.name, "' starts at ",
                e.begin, ")");
    covered = e.end;
  }
  TORCH_CHECK(covered == buffer, path, ": the byte buffer has ", buffer,
              " bytes but the tensors cover only ", covered, "; bytes [", covered, ", ", buffer,
              ") belong to no tensor");

  std::map<std::string, at::Tensor> out;
  for (const auto& e : entries) {
    auto t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype->type));
    uint64_t bytes = e.end - e.begin;
    TORCH_CHECK(bytes == 0 || std::fread(t.data_ptr(), 1, bytes, f.get()) == bytes, path,
                ": cannot read the data of tensor '", e.name, "' (", bytes, " bytes at file offset ",
                8 + n + e.begin, ")");
    if (e.dtype->type == at::kBool) {
      TORCH_CHECK(!at::gt(t.view(at::kByte), 1).any().item<bool>(), path, ": tensor '", e.name,
                  "' is BOOL but has bytes other than 0 and 1");
    }
    out[e.name] = t;
  }
  return out;
}
}  // namespace

std::map<std::string, at::Tensor> load_safetensors(const std::string& path,
                                                   std::map<std::string, std::string>* metadata) {
  // The messages quote the header (names, dtypes, JSON near an error): a damaged file's bytes are
  // shown as \xNN, never written raw to the terminal.
  try {
    return read_safetensors(path, metadata);
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, printable(e.what_without_backtrace()));
  }
}

void save_safetensors(const std::string& path, const std::map<std::string, at::Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  struct Item {
    std::string name;
    at::Tensor data;  // CPU, contiguous
    const DtypeInfo* dtype;
  };
  std::vector<Item> items;
  for (const auto& [name, t] : tensors) {
    TORCH_CHECK(name != "__metadata__", path, ": '__metadata__' cannot name a tensor");
    TORCH_CHECK(invalid_utf8_at(name) == std::string::npos, path, ": tensor name '", name,
                "' is not valid UTF-8");
    TORCH_CHECK(t.defined(), path, ": tensor '", name, "' is undefined");
    const DtypeInfo* d = dtype_by_type(t.scalar_type());
    TORCH_CHECK(d, path, ": tensor '", name, "' has dtype ", t.scalar_type(),
                ", which safetensors files here do not hold (", dtype_list(), ")");
    items.push_back({name, t.detach().to(at::kCPU).resolve_neg().contiguous(), d});
  }
  for (const auto& [key, value] : metadata)
    TORCH_CHECK(invalid_utf8_at(key) == std::string::npos &&
                    invalid_utf8_at(value) == std::string::npos,
                path, ": metadata entry '", printable(key), "' is not valid UTF-8");
  for (const auto& it : items)
    TORCH_CHECK(invalid_utf8_at(it.name) == std::string::npos, path, ": tensor name '", printable(it.name),
                "' is not valid UTF-8");
  // The reference writer's order: descending dtype (largest alignment first), then name.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.dtype->order != b.dtype->order ? a.dtype->order > b.dtype->order : a.name < b.name;
  });

  // As the reference writer (serde_json) writes it: one line, no spaces.
  JsonWriter json;
  json.begin_object();
  if (!metadata.empty()) {
    json.key("__metadata__").begin_object();
    for (const auto& [key, value] : metadata) json.member(key, value);
    json.end_object();
  }
  uint64_t offset = 0;
  for (const auto& it : items) {
    const uint64_t bytes = it.data.numel() * it.dtype->size;
    json.key(it.name).begin_object().member("dtype", it.dtype->name).key("shape").begin_array();
    for (int64_t k = 0; k < it.data.dim(); ++k) json.value(it.data.size(k));
    json.end_array().key("data_offsets").begin_array().value(offset).value(offset + bytes).end_array().end_object();
    offset += bytes;
  }
  json.end_object();
  std::string header = json.str();
  header.append((8 - header.size() % 8) % 8, ' ');

  std::string tmp = path + ".tmp." + std::to_string(::getpid());
  auto fail = [&](const std::string& what) {
    std::string err = std::strerror(errno);
    std::remove(tmp.c_str());
    TORCH_CHECK(false, path, ": ", what, ": ", err);
  };
  {
    const int fd = open_for_writing(tmp, O_WRONLY | O_CREAT | O_TRUNC, path + ": cannot create the temporary file");
    File f(::fdopen(fd, "wb"));
    if (!f) {
      ::close(fd);
      fail("cannot create the temporary file " + tmp);
    }
    unsigned char len_bytes[8];
    uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) len_bytes[i] = static_cast<unsigned char>(n >> (8 * i));
    bool ok = std::fwrite(len_bytes, 1, 8, f.get()) == 8 &&
              std::fwrite(header.data(), 1, header.size(), f.get()) == header.size();
    for (size_t i = 0; ok && i < items.size(); ++i) {
      size_t bytes = items[i].data.numel() * items[i].dtype->size;
      ok = bytes == 0 || std::fwrite(items[i].data.data_ptr(), 1, bytes, f.get()) == bytes;
    }
    if (!ok || std::fflush(f.get()) != 0 || ::fsync(::fileno(f.get())) != 0)
      fail("cannot write " + tmp);
    if (std::fclose(f.release()) != 0) fail("cannot close " + tmp);
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) fail("cannot rename " + tmp + " to it");
}

}  // namespace carry
