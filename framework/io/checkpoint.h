// Training checkpoints: one directory per step, dir/step_<8-digit step>/ holding model.safetensors,
// optimizer.safetensors and manifest.textproto (a CheckpointManifest: step, tokens_seen, data_cursor,
// rng_seed, the resolved config, every tensor's file, name, dtype, shape, byte count and FNV-1a 64
// checksum of its bytes, and free-form string entries). model.safetensors also carries, in its
// safetensors metadata, format = "pt", carry_file = "checkpoint model", carry_version, step,
// tokens_seen and config (the resolved run config as textproto). The design decision: a checkpoint becomes
// visible only by one rename. It is written under dir/.tmp_step_<step>_<pid>/, every file and the
// directory fsynced, then renamed to step_<step>; then dir/latest (the step directory's name) is
// replaced by temp+rename. A crash at any moment leaves the previous checkpoints intact, and a
// loader never trusts a directory it has not validated (manifest parsed, every tensor present with
// its dtype, shape and checksum). One writer per directory (rank 0); POSIX calls only.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
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
};

// Writes dir/step_<8-digit step>/ (dir is created if missing) through dir/.tmp_step_<8 digits>_<pid>/,
// fsyncing the files and the directories, then points dir/latest at it and deletes the oldest step_*
// directories beyond keep_last (0 = keep all; the one just written is never deleted). A checkpoint of
// the same step already there is replaced. Tensors may be on any device and non-contiguous; names must
// be unique within model and within optimizer. Leftover temporary directories of dead writers are
// removed. Throws c10::Error naming the path on any failure (the previous checkpoints stay intact).
// Test hook: with CARRY_CHECKPOINT_TEST_DIE_AFTER=n in the environment, the process SIGKILLs itself
// after writing n files of the checkpoint (1: model, 2: + optimizer, 3: + manifest, before the rename).
void save_checkpoint(const std::string& dir, const CheckpointData& data, int keep_last);

// The newest complete, valid checkpoint in dir: the one `latest` names first, then step_* directories
// newest first. A corrupt or partial one (missing file, bad manifest, checksum mismatch, truncated
// safetensors) is reported on stderr with its path and what is wrong, and skipped; leftover temporary
// directories of interrupted writes are reported and ignored. std::nullopt when none is valid (or dir
// does not exist). Tensors come back on the CPU in the order they were saved.
std::optional<CheckpointData> load_latest_checkpoint(const std::string& dir);

// Loads one checkpoint directory; throws c10::Error naming the path and the problem if invalid.
CheckpointData load_checkpoint(const std::string& step_dir);

// "step_00000042": the directory name of a step's checkpoint (more digits past 99,999,999).
std::string checkpoint_dir_name(int64_t step);

// The steps of the step_* directories in dir (complete or not; not validated), ascending.
std::vector<int64_t> list_checkpoint_steps(const std::string& dir);

// FNV-1a 64 of a byte range (the manifest's per-tensor checksum).
uint64_t fnv1a64(const void* data, size_t size);

}  // namespace carry
