// Public face of ckpt/: checkpoint layout, durable (atomic) saves, optional background writes,
// manifest verification with fallback, and loading. Layout and guarantees: docs/checkpoints.md.
#pragma once
#include <atomic>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "trainer/ckpt/safetensors.h"
#include "trainer/config/config.h"

namespace trainer {

constexpr int kCheckpointFormatVersion = 1;

// Everything besides tensors that a bit-exact resume needs (state.json).
struct CheckpointState {
  int64_t step = 0;             // optimizer steps completed; training resumes at this step index
  int64_t updates_applied = 0;  // AdamW step count and LR schedule position (skipped steps excluded)
  int64_t consumed_samples = 0; // data position: global samples consumed (step * global_batch_size)
  // Validation position: samples the evaluations so far read (Megatron's consumed_valid_samples);
  // -1 when state.json has none (written before it was recorded).
  int64_t consumed_valid_samples = -1;
  std::vector<double> spike_losses, spike_grad_norms;  // spike-guard window
  std::string cpu_rng_state;    // LibTorch default CPU generator state, hex
  int64_t world_size = 1;
  std::string config_hash;      // CRC32C of the resolved config.yml, hex
};

using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;

// A host-side snapshot: tensors are CPU copies owned by the snapshot (safe to write in the
// background while training continues).
struct CheckpointContents {
  NamedTensors model;      // HF names: parameters and buffers, fp32
  NamedTensors optimizer;  // "exp_avg.<name>" and "exp_avg_sq.<name>" per parameter
  CheckpointState state;
  std::string config_yaml;
  // Sharded checkpoints (shard_count > 1: sharded data parallelism over several ranks): this
  // rank's tensors only, written as its own files, shard `shard_rank` of `shard_count`.
  int64_t shard_rank = 0, shard_count = 1;
};

// Deletes what interrupted saves left under `checkpoints_dir` (.tmp-<step>/ directories and
// .latest.tmp: a kill or second signal mid-save) and returns their names; a re-saved step's old
// checkpoint (.replaced-<step>/) is moved back to <step>/ where the kill left none there. Only while no save can
// be running: the caller holds the run directory's lock, before its first step.
std::vector<std::string> checkpoint_remove_unfinished(const std::string& checkpoints_dir);

// Writes checkpoints under <run_dir>/checkpoints/<step>/ (docs/checkpoints.md).
class Checkpointer {
 public:
  explicit Checkpointer(const Config& config);
  ~Checkpointer();  // waits for a background save (errors are logged)

  // Waits for the previous save, then writes `contents` (in the background when `async`).
  // A synchronous failure throws trainer::Error (exit code 1); previous checkpoints are intact.
  void save(CheckpointContents contents, bool async);
  // Waits for a background save. Returns its error message, or "" if it succeeded (or none ran).
  std::string wait();

  // Sharded saves: every rank saves its shard, and the checkpoint becomes visible only when rank 0
  // commits it after all ranks' writes ended (the trainer agrees on that with a collective).
  int64_t uncommitted_step() const { return uncommitted_.first; }  // -1: none
  bool writing() const { return writing_; }  // a background write has not ended yet
  // Forgets the uncommitted save; the writer (rank 0) first lists every rank's files in the
  // manifest (with the model index) and moves the directory into place. Throws trainer::Error
  // (exit code 1) if that fails.
  void commit_shards(bool writer);
  // Forgets the uncommitted save after a rank failed to write its shard; the writer (rank 0)
  // deletes its temporary directory (every rank's writes have ended).
  void abandon_shards(bool writer);

 private:
  void remove_unfinished_save(int64_t step) const;  // checkpoints/.tmp-<step>/, best effort

  std::string checkpoints_dir_;
  int64_t keep_;
  int64_t pause_at_step_ = -1;  // debug_pause_checkpoint_save_step
  int64_t block_shard_rank_ = -1;  // debug_block_checkpoint_shard_rank
  std::thread worker_;
  std::exception_ptr worker_error_;
  std::atomic<bool> writing_{false};
  std::pair<int64_t, int64_t> uncommitted_{-1, 0};  // (step, shard count)
};

// "model-00002-of-00004.safetensors" for (stem "model", index 1, count 4, suffix ".safetensors").
std::string checkpoint_shard_file_name(const std::string& stem, int64_t index, int64_t count, const std::string& suffix);

// CRC32C of the text as 8 hex digits.
std::string checkpoint_hash_text(const std::string& text);

// CRC32C of a checkpoint directory's manifest.json (which lists every file's): tells two copies
// of a checkpoint under one path apart.
std::string checkpoint_manifest_hash(const std::string& checkpoint_dir);

// The newest checkpoint under `checkpoints_dir` whose manifest verifies; a corrupted or
// incomplete newer one is reported with a warning and skipped. nullopt if there is none.
std::optional<std::string> checkpoint_find_latest(const std::string& checkpoints_dir);

// Verifies the manifest of one checkpoint directory (format_version, then the size and CRC32C of
// every file it must list, or with `weights_only` only of the model's files: what
// load_parameters_path reads, skipping the optimizer state that is twice their size; without
// `checksums` the sizes alone, reading no file through); returns "" or the reason it is invalid.
// Throws config_error for a manifest of another format_version: not damage, and no reason to
// fall back to an older one.
std::string checkpoint_verify(const std::string& checkpoint_dir, bool weights_only = false, bool checksums = true);

// The steps of the checkpoint directories under `checkpoints_dir` (complete or not), newest
// first; none when it does not exist.
std::vector<int64_t> checkpoint_list_steps(const std::string& checkpoints_dir);

// Checks that `path` (load_full_state_path) is one usable checkpoint directory: config_error for
// no directory, a run, checkpoints or Hugging Face directory (naming the checkpoint probably
// meant), Error(kExitData) for one that does not verify.
void checkpoint_check_full_state_path(const std::string& path);

// Before the first step: config_error when a save could not commit (`checkpoints_dir` is not a
// directory, or checkpoints/latest is not a file) rather than failing the first save after the steps.
void checkpoint_check_saves_possible(const std::string& checkpoints_dir);

// Loads a checkpoint directory that checkpoint_verify accepted (it reads every file once more;
// the caller verifies, so that a resume reads each file twice, not three times).
CheckpointContents checkpoint_load(const std::string& checkpoint_dir);

// state.json and config.yml of a verified checkpoint directory.
std::pair<CheckpointState, std::string> checkpoint_load_state(const std::string& checkpoint_dir);

// One tensor at a time from a verified checkpoint directory of either layout (one writer or
// sharded): only the files' headers are read up front, so a rank can restore its parts without
// ever holding the whole state. Tensors come back as fp32 CPU tensors.
class CheckpointReader {
 public:
  explicit CheckpointReader(const std::string& checkpoint_dir);
  // Weights only, as load_parameters_path names them: one safetensors file, or a directory's
  // model.safetensors or the files its model.safetensors.index.json lists (no manifest needed).
  static CheckpointReader weights(const std::string& path);
  // A Hugging Face model directory (config.json's `architecture`) as checkpoint names, one tensor
  // at a time (hf_checkpoint.cpp): BailingMoeV2's tensors renamed and its fused query_key_value
  // read as q, k and v rows; a tied model's stored lm_head left out (a warning if it differs from
  // the embedding). config_error naming the directory and the tensor for a fused tensor of the
  // wrong shape and, when read, for a nonzero expert bias the config would ignore (routed_bias
  // false), as hf_tensors_to_checkpoint.
  static CheckpointReader hugging_face(const std::string& dir, const Config& config, const std::string& architecture);
  bool contains(const std::string& name) const { return find(name) != nullptr; }
  std::vector<int64_t> shape(const std::string& name) const;  // empty if absent
  torch::Tensor read(const std::string& name) const;          // config_error (exit 2) if absent or unreadable
  const std::vector<std::string>& model_names() const { return model_names_; }  // weights and buffers
  // Every tensor read from here on passes `check` (name, name in the files, tensor), which may throw.
  using ReadCheck = std::function<void(const std::string&, const std::string&, const torch::Tensor&)>;
  void check_reads(ReadCheck check) { check_read_ = std::move(check); }

 private:
  struct Location {
    std::string path;
    std::shared_ptr<const SafetensorsFile> header;
    SafetensorsTensor tensor;
  };
  // A name read from another stored tensor: its name in the files and the rows it takes (-1: all).
  struct Alias {
    std::string stored;
    int64_t row_begin = 0, rows = -1;
  };
  CheckpointReader() = default;
  void add_file(const std::string& path, bool model);  // reads its header
  const Location* find(const std::string& name) const;       // by model name (through aliases_)
  const Location* find_stored(const std::string& stored) const;  // by the name in the files
  std::map<std::string, Location> tensors_;  // model and optimizer ("exp_avg.<name>") tensors, as stored
  std::vector<std::string> model_names_;
  std::map<std::string, Alias> aliases_;  // hugging_face: every model name, else empty
  // The files read from, kept open: one open per file, not per tensor (a MoE model has thousands
  // of tensors, and an open is a round trip on a network filesystem). At most kOpenFilesKept are kept.
  static constexpr size_t kOpenFilesKept = 16;
  mutable std::map<std::string, std::shared_ptr<std::ifstream>> open_files_;
  std::istream& open_file(const std::string& path) const;
  ReadCheck check_read_;  // check_reads
};

// Reads the tensors of one safetensors file as fp32 CPU tensors (F32, BF16, F16, F64 accepted).
NamedTensors checkpoint_read_tensors(const std::string& path);

// Exit 3 naming `name` and `source` when a floating-point tensor read from a weights file holds
// NaN or Inf: such a weight would surface only as a NaN loss at step 0, naming no tensor.
void checkpoint_check_finite(const std::string& name, const torch::Tensor& tensor, const std::string& source);

// Initial weights (load_parameters_path) as each tensor is read: finite, and a nonzero expert
// bias (checkpoint name `name`) refused when routed_bias is false, which would ignore it
// (config_error naming `stored`, the tensor's name in the files). hf_checkpoint.cpp.
void checkpoint_check_initial_weight(const Config& config, const std::string& name, const std::string& stored,
                                     const torch::Tensor& tensor, const std::string& source);

// Writes tensors (contiguous fp32 or bf16, CPU) to a safetensors file (fsynced); returns its CRC32C.
uint32_t checkpoint_write_tensors(const std::string& path, const NamedTensors& tensors);

// ---- Hugging Face checkpoints (hf_checkpoint.cpp; docs/checkpoints.md) --------------------------
// The architecture and config.json come from config/hf_config.h. Checkpoint tensors are named as
// Llama, Qwen3, Qwen3Moe and DeepseekV3 already (Qwen3Moe has no router bias); BailingMoeV2
// (Ling 2.0) renames them and fuses q, k, v into one tensor.

// Checkpoint tensors (CheckpointContents::model) -> the architecture's names and layout. A tied
// output head is not written (the Hugging Face code ties it to the embedding).
NamedTensors hf_tensors_from_checkpoint(const Config& config, const NamedTensors& model);
// The inverse, for tensors named as `architecture` (hf_config_architecture of their directory).
// Throws config_error (exit 2) naming `source` and the tensor when a fused tensor has the wrong
// shape, or when an expert bias the config would ignore (routed_bias false) is nonzero.
NamedTensors hf_tensors_to_checkpoint(const Config& config, const NamedTensors& hf, const std::string& architecture,
                                      const std::string& source);

// Every tensor of a Hugging Face model directory as fp32: the shards listed by
// model.safetensors.index.json, else model.safetensors (CheckpointReader::weights, read whole).
// Throws config_error naming the file.
NamedTensors hf_read_directory(const std::string& dir);
// The safetensors files of such a directory (model.safetensors, or those its index lists), each
// with the names the index puts there (none for a single file); config_error if one is missing.
std::map<std::string, std::set<std::string>> hf_directory_files(const std::string& dir);

// Writes a Hugging Face model directory whose tensors arrive in order, a few at a time:
// config.json, then the tensors of `plan` (names and shapes in file order; meta tensors will do)
// converted to `dtype` (fp32 or bf16) in files of at most max_shard_bytes (a larger tensor gets a
// file of its own): model.safetensors when one file holds them all, else
// model-0000i-of-0000n.safetensors and model.safetensors.index.json. Built in a temporary
// sibling that finish() renames, so `dir` is complete or absent (a writer destroyed unfinished
// removes its temporary). Refuses (config_error) an existing non-empty `dir`; I/O failures and
// tensors out of plan order are Error(kExitFailure) naming `dir`.
class HfDirectoryWriter {
 public:
  HfDirectoryWriter(const std::string& dir, const std::string& config_json, const NamedTensors& plan,
                    int64_t max_shard_bytes, torch::ScalarType dtype);
  ~HfDirectoryWriter();
  void append(const NamedTensors& tensors);  // the plan's next tensors (any dtype and device)
  void finish();

 private:
  struct File {
    std::string name;
    std::vector<SafetensorsEntry> entries;  // data pointers unused
  };
  [[noreturn]] void fail(const std::string& why);
  std::string dir_;
  std::filesystem::path target_, partial_;
  torch::ScalarType dtype_;
  std::vector<File> files_;
  size_t file_ = 0;                                 // the file being written
  std::unique_ptr<SafetensorsStreamWriter> writer_;  // open on files_[file_]
  bool closed_ = false;  // finished (renamed into place) or failed (removed): no temporary left, no more writes
};

// The whole directory at once (HfDirectoryWriter with the tensors as their own plan).
void hf_write_directory(const std::string& dir, const std::string& config_json, const NamedTensors& tensors,
                        int64_t max_shard_bytes, torch::ScalarType dtype);

}  // namespace trainer
