// Training checkpoints: one directory per step, dir/step_<8-digit step>/ holding model.safetensors,
// optimizer.safetensors and manifest.textproto (a CheckpointManifest: step, tokens_seen, data_cursor,
// rng_seed, the resolved config, the run id, every tensor's file, name, dtype, shape, byte count and
// checksum of its bytes, free-form string entries, and a checksum of the manifest itself). The
// checksums are XXH64 (framework/io/xxh64.h, format_version 3, named in checksum_algorithm); the
// FNV-1a 64 checksums of format_version 1 and 2 checkpoints are still verified.
// model.safetensors also carries, in its safetensors metadata, format = "pt", carry_file =
// "checkpoint model", carry_version, carry_commit, step, tokens_seen and config (the resolved run config as
// textproto). The design decision: a checkpoint becomes visible only by one rename. It is written under
// dir/.tmp_step_<step>_<pid>/, every file and the directory fsynced, then renamed to step_<step>;
// then dir/latest (the step directory's name) is replaced by temp+rename. A crash at any moment
// leaves the previous checkpoints intact, and a loader never trusts a directory it has not validated
// (manifest parsed and its checksum right, every tensor present with its dtype, shape and checksum).
// `latest` names the run to continue, not the step: the loader takes the newest valid checkpoint of
// the run `latest` belongs to (a crash between the rename and the update of `latest` leaves `latest`
// one checkpoint behind). A run prunes only checkpoints with its own run id. One writer per
// directory: rank 0, holding CheckpointDirLock; POSIX calls only.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace carry {

struct CheckpointData {
  int64_t step = 0;            // optimizer steps completed
  int64_t tokens_seen = 0;
  int64_t data_cursor = 0;     // next batch index (batches are a pure function of (seed, step, dp rank))
  uint64_t rng_seed = 0;       // RNG state of the run (seed + step suffice for our counter-based RNG)
  std::string config_text;     // resolved config as textproto
  std::vector<std::pair<std::string, at::Tensor>> model;      // named parameters (fp32 master)
  std::vector<std::pair<std::string, at::Tensor>> optimizer;  // named optimizer state (e.g. "exp_avg.<param>")
  std::map<std::string, std::string> extra;                  // anything else (metrics), string values
  std::string run_id;          // the run that wrote it (see new_run_id); "" in format_version 1
  int format_version = 0;      // set by the loaders: 3 now, 2 (FNV-1a 64), 1 (no manifest checksum)
  // Set by the loaders: the version and git commit of the carry that wrote it (save_checkpoint writes
  // this build's, framework/version.h); "" in checkpoints written before the manifest held them.
  std::string carry_version, carry_commit;
};

// A fresh run id: 16 hex digits from the clock, the pid and std::random_device.
std::string new_run_id();

// Writes dir/step_<8-digit step>/ (dir is created if missing) through dir/.tmp_step_<8 digits>_<pid>/,
// fsyncing the files and the directories, then points dir/latest at it and deletes the oldest step_*
// directories of the same run (data.run_id equal to their manifest's) beyond keep_last (0 = keep
// all; the one just written is never deleted; checkpoints of other runs and ones whose manifest
// cannot be read are never deleted). A checkpoint of the same step already there is replaced when it
// has the same run id; another run's, or one whose manifest cannot be read, is renamed
// step_<step>.kept.<its run id, or "damaged"> (said on stderr) and kept. Tensors may be on any device and non-contiguous; names must
// be unique within model and within optimizer. Leftover temporary directories of dead writers are
// removed. Throws c10::Error naming the path on any failure (the previous checkpoints stay intact).
void save_checkpoint(const std::string& dir, const CheckpointData& data, int keep_last);
// For tests: called with the number of files save_checkpoint has written so far (1: model, 2: + optimizer,
// 3: + manifest, before the rename), so a test can end the process mid-write. None by default; an empty
// function removes it.
void set_checkpoint_write_hook(std::function<void(int files_written)> hook);

// What a look for the checkpoint to resume found.
struct CheckpointSearch {
  bool dir_exists = false;
  std::vector<int64_t> steps;            // the step_* directories in dir, ascending
  std::optional<CheckpointData> loaded;  // the newest valid checkpoint of the run to continue
  // One line per thing a user should know: a checkpoint skipped and why (corrupt, partial, another
  // run's), an interrupted write, a stale `latest`, a checkpoint without manifest checksum.
  std::vector<std::string> notes;
};

// The checkpoint to resume in dir: the newest valid step_* directory of the run that `latest` names
// (its manifest's run_id), newer than `latest` too; without a readable `latest`, the newest valid one.
// Checkpoints of other runs are not used. Invalid ones (missing file, bad manifest, a checksum
// mismatch, a truncated safetensors file) are skipped. Tensors come back on the CPU in the order
// they were saved. Throws only for a directory it cannot list.
CheckpointSearch find_latest_checkpoint(const std::string& dir);

// find_latest_checkpoint's checkpoint, its notes written to stderr ("carry: ..."); std::nullopt when
// none is valid (or dir does not exist).
std::optional<CheckpointData> load_latest_checkpoint(const std::string& dir);

// Loads one checkpoint directory; throws c10::Error naming the path and the problem if invalid.
CheckpointData load_checkpoint(const std::string& step_dir);

// "step_00000042": the directory name of a step's checkpoint (more digits past 99,999,999).
std::string checkpoint_dir_name(int64_t step);

// The steps of the step_* directories in dir (complete or not; not validated), ascending.
std::vector<int64_t> list_checkpoint_steps(const std::string& dir);

// FNV-1a 64 of a byte range (the checksum of format_version 1 and 2 manifests).
uint64_t fnv1a64(const void* data, size_t size);

// An exclusive lock on a checkpoint directory for one run: flock() on dir/.lock (the directory is
// created if missing), held until destruction, released by the kernel if the process dies. The file
// holds the holder's pid, host and start time for the message another run gets: a second run on the
// same directory throws, naming the directory and the holder, instead of interleaving checkpoints.
class CheckpointDirLock {
 public:
  explicit CheckpointDirLock(const std::string& dir);
  ~CheckpointDirLock();
  CheckpointDirLock(const CheckpointDirLock&) = delete;
  CheckpointDirLock& operator=(const CheckpointDirLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace carry
