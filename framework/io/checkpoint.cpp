// Checkpoint directories (see checkpoint.h): written under a temporary name with every file and
// directory fsynced, made visible by one rename, then `latest` replaced by temp+rename and the run's
// own old steps pruned; read back only after the manifest's checksum, every tensor's dtype, shape and
// checksum agree (XXH64; FNV-1a 64 in format_version 1 and 2 manifests). POSIX calls only (no std::filesystem: see tests/helpers/temp_dir.h).
#include "framework/io/checkpoint.h"

#include "framework/config/carry.pb.h"
#include "framework/io/output_file.h"
#include "framework/io/xxh64.h"
#include "framework/io/safetensors.h"
#include "framework/printable.h"
#include "framework/version.h"

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/tokenizer.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/text_format.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <iostream>
#include <random>
#include <set>

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

namespace carry {
namespace {

constexpr int kFormatVersion = 3;      // written: XXH64 checksums
constexpr int kOldestFormatVersion = 1;  // read: 2 (FNV-1a 64 checksums), 1 (no run_id, no manifest checksum)
const char* const kModelFile = "model.safetensors";
const char* const kOptimizerFile = "optimizer.safetensors";
const char* const kManifestFile = "manifest.textproto";
const char* const kLatestFile = "latest";
const char* const kTmpPrefix = ".tmp_step_";
const char* const kDeletingPrefix = ".deleting_step_";
const char* const kLockFile = ".lock";
// The most a control file may hold; a larger one is refused before it is read. A manifest lists every
// tensor (about 200 bytes each) and the resolved config; `latest` holds one directory name.
constexpr int64_t kMaxManifestBytes = int64_t{64} << 20;
constexpr int64_t kMaxLatestBytes = 4096;

std::string path_join(const std::string& dir, const std::string& name) {
  return dir.empty() || dir.back() == '/' ? dir + name : dir + "/" + name;
}

std::string errno_text() { return std::strerror(errno); }

bool is_dir(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool exists(const std::string& path) {
  struct stat st;
  return ::lstat(path.c_str(), &st) == 0;
}

// mkdir -p.
void make_dirs(const std::string& path) {
  for (size_t i = 1; i <= path.size(); ++i) {
    if (i != path.size() && path[i] != '/') continue;
    std::string prefix = path.substr(0, i);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST)
      TORCH_CHECK(false, "checkpoint: cannot create directory ", prefix, ": ", errno_text());
  }
  TORCH_CHECK(is_dir(path), "checkpoint: ", path, " exists and is not a directory");
}

void fsync_dir(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY);
  TORCH_CHECK(fd >= 0, "checkpoint: cannot open directory ", path, " to fsync it: ", errno_text());
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  TORCH_CHECK(rc == 0, "checkpoint: cannot fsync directory ", path, ": ", std::strerror(err));
}

std::vector<std::string> dir_entries(const std::string& path) {
  std::vector<std::string> names;
  DIR* d = ::opendir(path.c_str());
  if (!d) return names;
  while (struct dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name != "." && name != "..") names.push_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  return names;
}

// rm -r (does not follow symbolic links). Returns false if something could not be removed.
bool remove_tree(const std::string& path) {
  struct stat st;
  if (::lstat(path.c_str(), &st) != 0) return errno == ENOENT;
  if (!S_ISDIR(st.st_mode)) return ::unlink(path.c_str()) == 0;
  bool ok = true;
  for (const auto& name : dir_entries(path)) ok = remove_tree(path_join(path, name)) && ok;
  return ::rmdir(path.c_str()) == 0 && ok;
}

// Writes a whole small file and fsyncs it (not atomic by itself: callers write to a temporary name).
void write_file(const std::string& path, const std::string& text) {
  int fd = open_for_writing(path, O_WRONLY | O_CREAT | O_TRUNC, "checkpoint");
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      int err = errno;
      ::close(fd);
      TORCH_CHECK(false, "checkpoint: cannot write ", path, ": ", std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  TORCH_CHECK(rc == 0, "checkpoint: cannot fsync ", path, ": ", std::strerror(err));
}

// The step of "step_<digits>" (at least 8 digits), or -1.
int64_t parse_step_name(const std::string& name) {
  const std::string prefix = "step_";
  if (name.compare(0, prefix.size(), prefix) != 0) return -1;
  std::string digits = name.substr(prefix.size());
  if (digits.size() < 8 || digits.size() > 18) return -1;
  for (char c : digits)
    if (c < '0' || c > '9') return -1;
  int64_t step = std::stoll(digits);
  return checkpoint_dir_name(step) == name ? step : -1;
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string shape_string(at::IntArrayRef shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

// The test hook (set_checkpoint_write_hook): told how many files a save has written.
std::function<void(int)>& write_hook() {
  static std::function<void(int)> hook;
  return hook;
}

void maybe_die_for_test(int files_written) {
  if (write_hook()) write_hook()(files_written);
}

// A pid from a temporary directory's name ".tmp_step_<digits>_<pid>" (or .deleting_...), or -1.
long pid_of_temp_name(const std::string& name) {
  size_t us = name.rfind('_');
  if (us == std::string::npos || us + 1 >= name.size()) return -1;
  std::string digits = name.substr(us + 1);
  for (char c : digits)
    if (c < '0' || c > '9') return -1;
  return digits.size() > 9 ? -1 : std::stol(digits);
}

bool starts_with(const std::string& s, const char* prefix) {
  return s.compare(0, std::strlen(prefix), prefix) == 0;
}

// Leftovers of writers that are no longer running (a crash mid-write or mid-delete).
void remove_dead_temporaries(const std::string& dir) {
  for (const auto& name : dir_entries(dir)) {
    if (!starts_with(name, kTmpPrefix) && !starts_with(name, kDeletingPrefix)) continue;
    long pid = pid_of_temp_name(name);
    bool alive = pid > 0 && pid != ::getpid() && (::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM);
    if (!alive) remove_tree(path_join(dir, name));
  }
}

using Named = std::vector<std::pair<std::string, at::Tensor>>;

struct Prepared {
  std::map<std::string, at::Tensor> tensors;  // CPU, contiguous
};

// CPU contiguous copies (one device-to-host copy), their manifest entries appended in order.
Prepared prepare(const Named& named, const char* file, config::CheckpointManifest& manifest) {
  Prepared out;
  for (const auto& [name, t] : named) {
    TORCH_CHECK(t.defined(), "save_checkpoint: ", file, " tensor '", name, "' is undefined");
    at::Tensor cpu = t.detach().to(at::kCPU).resolve_conj().resolve_neg().contiguous();
    TORCH_CHECK(out.tensors.emplace(name, cpu).second, "save_checkpoint: tensor name '", name,
                "' appears twice in ", file);
    auto* e = manifest.add_tensors();
    e->set_file(file);
    e->set_name(name);
    e->set_dtype(c10::toString(cpu.scalar_type()));
    for (int64_t s : cpu.sizes()) e->add_shape(s);
    int64_t bytes = static_cast<int64_t>(cpu.nbytes());
    e->set_num_bytes(bytes);
    e->set_checksum(hex64(xxh64(cpu.data_ptr(), static_cast<size_t>(bytes))));
  }
  return out;
}

void write_latest(const std::string& dir, const std::string& step_name) {
  std::string tmp = path_join(dir, ".latest.tmp." + std::to_string(::getpid()));
  write_file(tmp, step_name + "\n");
  if (std::rename(tmp.c_str(), path_join(dir, kLatestFile).c_str()) != 0) {
    std::string err = errno_text();
    ::unlink(tmp.c_str());
    TORCH_CHECK(false, "checkpoint: cannot rename ", tmp, " to ", path_join(dir, kLatestFile), ": ", err);
  }
  fsync_dir(dir);
}

// Removes a step directory: renamed first (one atomic step makes it invisible), then deleted.
void delete_step_dir(const std::string& dir, const std::string& name) {
  std::string doomed = path_join(dir, kDeletingPrefix + name.substr(5) + "_" + std::to_string(::getpid()));
  remove_tree(doomed);
  if (std::rename(path_join(dir, name).c_str(), doomed.c_str()) != 0) {
    std::cerr << "carry: checkpoint: cannot remove old checkpoint " << path_join(dir, name) << ": "
              << errno_text() << "\n";
    return;
  }
  if (!remove_tree(doomed))
    std::cerr << "carry: checkpoint: could not delete all of " << doomed << "\n";
}

// A checksum of the manifests: its name there, its name in messages, the hash.
struct Checksum {
  const char* name;
  const char* title;
  uint64_t (*hash)(const void*, size_t);
};
uint64_t xxh64_seed0(const void* data, size_t size) { return xxh64(data, size, 0); }
const Checksum kXxh64{"xxh64", "XXH64", xxh64_seed0};
const Checksum kFnv1a64{"fnv1a64", "FNV-1a 64", fnv1a64};

// The algorithm of a manifest's checksums: format_version 3 names it, 1 and 2 use FNV-1a 64.
const Checksum& checksum_of(const config::CheckpointManifest& manifest, const std::string& manifest_path) {
  if (manifest.format_version() < 3) return kFnv1a64;
  TORCH_CHECK(manifest.has_checksum_algorithm(), "checkpoint ", manifest_path,
              ": bad manifest: checksum_algorithm is missing (format_version 3 names it)");
  for (const Checksum* c : {&kXxh64, &kFnv1a64})
    if (manifest.checksum_algorithm() == c->name) return *c;
  TORCH_CHECK(false, "checkpoint ", manifest_path, ": checksum_algorithm '",
              printable(manifest.checksum_algorithm().substr(0, 100), /*keep_newlines=*/false),
              "' is not one this build reads (xxh64, fnv1a64)");
}

// A tensor entry's checksum as the manifest states it.
const std::string& stated_checksum(const config::CheckpointManifest& manifest,
                                   const config::CheckpointManifest::Tensor& e) {
  return manifest.format_version() >= 3 ? e.checksum() : e.fnv1a64();
}

// `algo` of the manifest's deterministic binary serialization with its own checksum field cleared
// (manifest_checksum in format_version 3, manifest_fnv1a64 before).
std::string manifest_checksum(config::CheckpointManifest manifest, const Checksum& algo) {
  if (manifest.format_version() >= 3) manifest.clear_manifest_checksum();
  else manifest.clear_manifest_fnv1a64();
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream raw(&bytes);
    google::protobuf::io::CodedOutputStream out(&raw);
    out.SetSerializationDeterministic(true);
    TORCH_INTERNAL_ASSERT(manifest.SerializeToCodedStream(&out), "checkpoint: cannot serialize a manifest");
  }
  return hex64(algo.hash(bytes.data(), bytes.size()));
}

// The base name of a path ("step_00000042" of "dir/step_00000042/").
std::string base_name(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path.substr(path.rfind('/') == std::string::npos ? 0 : path.rfind('/') + 1);
}

// A step directory's manifest, parsed and checked (format version, step against the directory name,
// its checksum); throws c10::Error naming the path and the problem.
config::CheckpointManifest read_manifest(const std::string& step_dir) {
  TORCH_CHECK(is_dir(step_dir), "checkpoint ", step_dir, ": not a directory");
  const std::string manifest_path = path_join(step_dir, kManifestFile);
  std::string why;
  std::optional<std::string> text = read_small_file(manifest_path, kMaxManifestBytes, &why);
  TORCH_CHECK(text, "checkpoint ", step_dir, ": cannot read ", kManifestFile, ": ", why,
              " (an incomplete or damaged checkpoint)");

  // The parser's errors (line:column) are collected for the message.
  struct Collector : google::protobuf::io::ErrorCollector {
    std::string errors;
    void AddError(int line, google::protobuf::io::ColumnNumber column,
                  const std::string& message) override {
      errors += (errors.empty() ? "" : "; ") + std::to_string(line + 1) + ":" +
                std::to_string(column + 1) + ": " + message;
    }
  } collector;
  google::protobuf::TextFormat::Parser parser;
  parser.RecordErrorsTo(&collector);
  config::CheckpointManifest manifest;
  TORCH_CHECK(parser.ParseFromString(*text, &manifest), "checkpoint ", manifest_path,
              ": bad manifest: ", printable(collector.errors, /*keep_newlines=*/false));
  TORCH_CHECK(manifest.has_format_version() && manifest.has_step(), "checkpoint ", manifest_path,
              ": bad manifest: format_version and step are required");
  TORCH_CHECK(manifest.format_version() >= kOldestFormatVersion && manifest.format_version() <= kFormatVersion,
              "checkpoint ", manifest_path, ": manifest format_version ", manifest.format_version(),
              ", this build reads ", kOldestFormatVersion, " to ", kFormatVersion);
  if (manifest.format_version() >= 2) {
    const Checksum& algo = checksum_of(manifest, manifest_path);
    const bool v3 = manifest.format_version() >= 3;
    const char* field = v3 ? "manifest_checksum" : "manifest_fnv1a64";
    TORCH_CHECK(v3 ? manifest.has_manifest_checksum() : manifest.has_manifest_fnv1a64(), "checkpoint ",
                manifest_path, ": bad manifest: ", field, " (its checksum) is missing");
    const std::string& stated = v3 ? manifest.manifest_checksum() : manifest.manifest_fnv1a64();
    std::string sum = manifest_checksum(manifest, algo);
    TORCH_CHECK(sum == stated, "checkpoint ", manifest_path, ": the manifest's checksum (", algo.title,
                " of its fields) is ", sum, " but it says ", printable(stated.substr(0, 100), false),
                " (the manifest was changed or is corrupt)");
  }
  const std::string base = base_name(step_dir);
  int64_t dir_step = parse_step_name(base);
  TORCH_CHECK(dir_step < 0 || dir_step == manifest.step(), "checkpoint ", manifest_path,
              ": manifest step ", manifest.step(), " does not match the directory name ", base);
  return manifest;
}

// The run id of a step directory's manifest, or nullopt if the manifest is not valid.
std::optional<std::string> run_id_of(const std::string& step_dir) {
  try {
    return read_manifest(step_dir).run_id();
  } catch (const c10::Error&) {
    return std::nullopt;
  }
}

}  // namespace

std::string new_run_id() {
  std::random_device rd;
  uint64_t x = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  x ^= static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count());
  x ^= static_cast<uint64_t>(::getpid()) << 17;
  return hex64(fnv1a64(&x, sizeof x));
}

uint64_t fnv1a64(const void* data, size_t size) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = 0xcbf29ce484222325ULL;
  for (size_t i = 0; i < size; ++i) {
    h ^= p[i];
    h *= 0x100000001b3ULL;
  }
  return h;
}

std::string checkpoint_dir_name(int64_t step) {
  TORCH_CHECK(step >= 0, "checkpoint: step must be >= 0, got ", step);
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%08lld", static_cast<long long>(step));
  return buf;
}

std::vector<int64_t> list_checkpoint_steps(const std::string& dir) {
  std::vector<int64_t> steps;
  for (const auto& name : dir_entries(dir)) {
    int64_t step = parse_step_name(name);
    if (step >= 0 && is_dir(path_join(dir, name))) steps.push_back(step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

void set_checkpoint_write_hook(std::function<void(int files_written)> hook) { write_hook() = std::move(hook); }

void save_checkpoint(const std::string& dir, const CheckpointData& data, int keep_last) {
  TORCH_CHECK(!dir.empty(), "save_checkpoint: the checkpoint directory is empty");
  TORCH_CHECK(data.step >= 0, "save_checkpoint: step must be >= 0, got ", data.step);
  TORCH_CHECK(keep_last >= 0, "save_checkpoint: keep_last must be >= 0 (0 = keep all), got ", keep_last);
  make_dirs(dir);
  remove_dead_temporaries(dir);

  const std::string name = checkpoint_dir_name(data.step);
  const std::string final_dir = path_join(dir, name);
  const std::string tmp_dir =
      path_join(dir, kTmpPrefix + name.substr(5) + "_" + std::to_string(::getpid()));

  config::CheckpointManifest manifest;
  manifest.set_format_version(kFormatVersion);
  manifest.set_step(data.step);
  manifest.set_tokens_seen(data.tokens_seen);
  manifest.set_data_cursor(data.data_cursor);
  manifest.set_rng_seed(data.rng_seed);
  manifest.set_config_text(data.config_text);
  manifest.set_run_id(data.run_id);
  manifest.set_carry_version(version());
  manifest.set_carry_commit(git_commit());
  for (const auto& [k, v] : data.extra) (*manifest.mutable_extra())[k] = v;
  Prepared model = prepare(data.model, kModelFile, manifest);
  Prepared optimizer = prepare(data.optimizer, kOptimizerFile, manifest);
  manifest.set_checksum_algorithm(kXxh64.name);
  manifest.set_manifest_checksum(manifest_checksum(manifest, kXxh64));

  remove_tree(tmp_dir);
  TORCH_CHECK(::mkdir(tmp_dir.c_str(), 0755) == 0, "save_checkpoint: cannot create ", tmp_dir, ": ",
              errno_text());
  try {
    int files = 0;
    // The model file says what it is on its own (a reader with Python's safetensors sees the step and
    // the config without the manifest).
    std::map<std::string, std::string> metadata = {
        {"format", "pt"},           {"carry_file", "checkpoint model"},
        {"carry_version", version()}, {"carry_commit", git_commit()}, {"step", std::to_string(data.step)},
        {"tokens_seen", std::to_string(data.tokens_seen)}, {"config", data.config_text}};
    save_safetensors(path_join(tmp_dir, kModelFile), model.tensors, metadata);
    maybe_die_for_test(++files);
    save_safetensors(path_join(tmp_dir, kOptimizerFile), optimizer.tensors);
    maybe_die_for_test(++files);
    std::string text;
    TORCH_INTERNAL_ASSERT(google::protobuf::TextFormat::PrintToString(manifest, &text));
    write_file(path_join(tmp_dir, kManifestFile), text);
    maybe_die_for_test(++files);
    fsync_dir(tmp_dir);

    // A checkpoint of this step already there is moved aside first (rename() does not replace a
    // non-empty directory): deleted when this run wrote it (resumed from an earlier step), kept under
    // another name when another run wrote it or its manifest cannot be read.
    if (exists(final_dir)) {
      std::optional<std::string> owner = run_id_of(final_dir);
      if (owner && *owner == data.run_id) {
        delete_step_dir(dir, name);
      } else {
        const std::string base = final_dir + ".kept." + (owner ? (owner->empty() ? "norunid" : *owner) : "damaged");
        std::string kept = base;
        for (int i = 2; exists(kept); ++i) kept = base + "." + std::to_string(i);
        TORCH_CHECK(std::rename(final_dir.c_str(), kept.c_str()) == 0, "save_checkpoint: cannot move ", final_dir,
                    " aside to ", kept, ": ", errno_text());
        std::cerr << "carry: checkpoint: " << final_dir << " was "
                  << (owner ? "written by another run (run id '" + *owner + "')" : std::string("damaged"))
                  << "; it is kept as " << kept << " and this run's checkpoint of step " << data.step
                  << " takes its name\n";
      }
    }
    TORCH_CHECK(std::rename(tmp_dir.c_str(), final_dir.c_str()) == 0, "save_checkpoint: cannot rename ",
                tmp_dir, " to ", final_dir, ": ", errno_text());
    fsync_dir(dir);
  } catch (...) {
    remove_tree(tmp_dir);
    throw;
  }
  write_latest(dir, name);

  if (keep_last > 0) {
    // This run's other checkpoints (valid manifests with its run id); those of other runs and those
    // whose manifest cannot be read are never deleted.
    std::vector<int64_t> steps;
    for (int64_t step : list_checkpoint_steps(dir)) {
      if (step == data.step) continue;
      std::optional<std::string> id = run_id_of(path_join(dir, checkpoint_dir_name(step)));
      if (id && *id == data.run_id) steps.push_back(step);
    }
    // The one just written counts as one of keep_last; the oldest others go.
    int64_t excess = static_cast<int64_t>(steps.size()) + 1 - keep_last;
    for (int64_t i = 0; i < excess; ++i) delete_step_dir(dir, checkpoint_dir_name(steps[i]));
    if (excess > 0) fsync_dir(dir);
  }
}

CheckpointData load_checkpoint(const std::string& step_dir) {
  const config::CheckpointManifest manifest = read_manifest(step_dir);
  const std::string manifest_path = path_join(step_dir, kManifestFile);
  const Checksum& algo = checksum_of(manifest, manifest_path);

  std::map<std::string, std::map<std::string, at::Tensor>> files;
  for (const char* file : {kModelFile, kOptimizerFile}) {
    std::string path = path_join(step_dir, file);
    TORCH_CHECK(exists(path), "checkpoint ", step_dir, ": ", file, " is missing");
    try {
      files[file] = load_safetensors(path);
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "checkpoint ", step_dir, ": ", e.what_without_backtrace());
    }
  }

  CheckpointData out;
  out.step = manifest.step();
  out.tokens_seen = manifest.tokens_seen();
  out.data_cursor = manifest.data_cursor();
  out.rng_seed = manifest.rng_seed();
  out.config_text = manifest.config_text();
  out.run_id = manifest.run_id();
  out.format_version = manifest.format_version();
  out.carry_version = manifest.carry_version();
  out.carry_commit = manifest.carry_commit();
  for (const auto& [k, v] : manifest.extra()) out.extra[k] = v;

  std::map<std::string, size_t> listed;  // tensors per file in the manifest
  std::set<std::pair<std::string, std::string>> seen;
  for (const auto& e : manifest.tensors()) {
    auto fit = files.find(e.file());
    TORCH_CHECK(fit != files.end(), "checkpoint ", manifest_path, ": tensor '", e.name(),
                "' names an unknown file '", e.file(), "'");
    TORCH_CHECK(seen.emplace(e.file(), e.name()).second, "checkpoint ", manifest_path, ": tensor '",
                e.name(), "' of ", e.file(), " is listed twice");
    const std::string where = path_join(step_dir, e.file()) + ": tensor '" + e.name() + "'";
    auto tit = fit->second.find(e.name());
    TORCH_CHECK(tit != fit->second.end(), "checkpoint ", where,
                " is listed in the manifest but missing from the file");
    const at::Tensor& t = tit->second;
    std::vector<int64_t> shape(e.shape().begin(), e.shape().end());
    TORCH_CHECK(c10::toString(t.scalar_type()) == e.dtype(), "checkpoint ", where, ": dtype ",
                t.scalar_type(), " but the manifest says ", e.dtype());
    TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), "checkpoint ", where, ": shape ",
                shape_string(t.sizes()), " but the manifest says ", shape_string(shape));
    TORCH_CHECK(static_cast<int64_t>(t.nbytes()) == e.num_bytes(), "checkpoint ", where, ": ",
                t.nbytes(), " bytes but the manifest says ", e.num_bytes());
    std::string sum = hex64(algo.hash(t.data_ptr(), t.nbytes()));
    const std::string& stated = stated_checksum(manifest, e);
    TORCH_CHECK(sum == stated, "checkpoint ", where, ": checksum (", algo.title, ") of its bytes is ", sum,
                " but the manifest says ", printable(stated.substr(0, 100), false), " (the file is corrupt)");
    ++listed[e.file()];
    (e.file() == kModelFile ? out.model : out.optimizer).emplace_back(e.name(), t);
  }
  for (const auto& [file, tensors] : files)
    for (const auto& [name, t] : tensors)
      TORCH_CHECK(seen.count({file, name}), "checkpoint ", path_join(step_dir, file), ": tensor '", name,
                  "' is not listed in the manifest");
  return out;
}

CheckpointSearch find_latest_checkpoint(const std::string& dir) {
  CheckpointSearch out;
  out.dir_exists = is_dir(dir);
  if (!out.dir_exists) return out;
  for (const auto& name : dir_entries(dir))
    if (starts_with(name, kTmpPrefix))
      out.notes.push_back("checkpoint " + path_join(dir, name) + ": an interrupted write (temporary directory); ignored");
  out.steps = list_checkpoint_steps(dir);

  // The run to continue: the one `latest` names (when its manifest is valid).
  std::string latest_name;
  std::optional<std::string> run;
  const std::string latest_path = path_join(dir, kLatestFile);
  std::string latest_why;
  std::optional<std::string> latest = read_small_file(latest_path, kMaxLatestBytes, &latest_why);
  if (!latest && exists(latest_path))
    out.notes.push_back("checkpoint " + latest_path + ": cannot read it: " + latest_why +
                        "; taking the newest valid checkpoint");
  if (latest) {
    latest_name = *latest;
    while (!latest_name.empty() && (latest_name.back() == '\n' || latest_name.back() == ' ' || latest_name.back() == '\r'))
      latest_name.pop_back();
    if (parse_step_name(latest_name) < 0) {
      out.notes.push_back("checkpoint " + latest_path + ": does not name a step directory (holds '" +
                          printable(latest_name.substr(0, 200), /*keep_newlines=*/false) + "'); taking the newest valid checkpoint");
      latest_name.clear();
    } else if (!(run = run_id_of(path_join(dir, latest_name)))) {
      out.notes.push_back("checkpoint " + latest_path + ": names " + path_join(dir, latest_name) +
                          ", which is missing or has no valid manifest; taking the newest valid checkpoint");
    }
  }
  bool skipped = false;
  for (auto it = out.steps.rbegin(); it != out.steps.rend(); ++it) {
    const std::string name = checkpoint_dir_name(*it), path = path_join(dir, name);
    try {
      CheckpointData data = load_checkpoint(path);
      if (run && data.run_id != *run) {
        out.notes.push_back("checkpoint " + path + ": valid, but written by another run (run id '" + data.run_id +
                            "'; `latest` names " + latest_name + " of run '" + *run + "'); not used");
        continue;
      }
      if (!latest_name.empty() && name != latest_name && parse_step_name(latest_name) < *it)
        out.notes.push_back("checkpoint: `latest` names " + latest_name + " but " + name +
                            " is newer and valid (a write that ended before `latest` was updated); using " + path);
      else if (skipped)
        out.notes.push_back("checkpoint: using " + path + " instead");
      if (data.format_version < 2)
        out.notes.push_back("checkpoint " + path + ": written in format_version " + std::to_string(data.format_version) +
                            " (no manifest checksum; the tensors' checksums were checked)");
      out.loaded = std::move(data);
      return out;
    } catch (const c10::Error& e) {
      out.notes.push_back(std::string(e.what_without_backtrace()) + "; skipped");
      skipped = true;
    }
  }
  if (!out.steps.empty())
    out.notes.push_back("checkpoint: no valid checkpoint" + (run ? " of run '" + *run + "'" : std::string()) + " in " + dir);
  return out;
}

std::optional<CheckpointData> load_latest_checkpoint(const std::string& dir) {
  CheckpointSearch found = find_latest_checkpoint(dir);
  for (const auto& note : found.notes) std::cerr << "carry: " << note << "\n";
  return std::move(found.loaded);
}

CheckpointDirLock::CheckpointDirLock(const std::string& dir) {
  TORCH_CHECK(!dir.empty(), "checkpoint: the checkpoint directory is empty");
  make_dirs(dir);
  const std::string path = path_join(dir, kLockFile);
  fd_ = open_for_writing(path, O_RDWR | O_CREAT, "checkpoint.dir " + dir + ": the lock file");
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    int err = errno;
    char holder[512] = {};
    ssize_t n = ::pread(fd_, holder, sizeof holder - 1, 0);
    std::string who = n > 0 ? std::string(holder, static_cast<size_t>(n)) : std::string();
    while (!who.empty() && (who.back() == '\n' || who.back() == ' ')) who.pop_back();
    ::close(fd_);
    fd_ = -1;
    TORCH_CHECK(err != EWOULDBLOCK, "checkpoint.dir ", dir, " is in use by another run (",
                who.empty() ? "its holder is unknown" : who, "): two runs must not share a checkpoint "
                "directory; give this run another checkpoint.dir, or wait for the other to end");
    TORCH_CHECK(false, "checkpoint.dir ", dir, ": cannot lock ", path, ": ", std::strerror(err));
  }
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  std::time_t now = std::time(nullptr);
  char when[64] = {};
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", std::localtime(&now));
  std::string who = "pid " + std::to_string(::getpid()) + " on host " + host + ", since " + when + "\n";
  if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, who.data(), who.size(), 0) < 0) {
    // Best effort: the lock holds without the text; only another run's message loses the holder.
  }
}

CheckpointDirLock::~CheckpointDirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock; the file stays (removing it would race a new holder)
}

}  // namespace carry
