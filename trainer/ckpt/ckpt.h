// Public face of ckpt/: checkpoint layout, durable (atomic) saves, optional background writes,
// manifest verification with fallback, and loading. Layout and guarantees: docs/checkpoints.md.
#pragma once
#include <exception>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include "trainer/config/config.h"

namespace trainer {

constexpr int kCheckpointFormatVersion = 1;

// Everything besides tensors that a bit-exact resume needs (state.json).
struct CheckpointState {
  int64_t step = 0;             // optimizer steps completed; training resumes at this step index
  int64_t updates_applied = 0;  // AdamW step count and LR schedule position (skipped steps excluded)
  int64_t consumed_samples = 0; // data position: global samples consumed (step * global_batch_size)
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
};

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

 private:
  std::string checkpoints_dir_;
  int64_t keep_;
  int64_t pause_at_step_ = -1;  // debug_pause_checkpoint_save_step
  std::thread worker_;
  std::exception_ptr worker_error_;
};

// CRC32C of the text as 8 hex digits.
std::string checkpoint_hash_text(const std::string& text);

// The newest checkpoint under `checkpoints_dir` whose manifest verifies; a corrupted or
// incomplete newer one is reported with a warning and skipped. nullopt if there is none.
std::optional<std::string> checkpoint_find_latest(const std::string& checkpoints_dir);

// Verifies the manifest of one checkpoint directory; returns "" or the reason it is invalid.
std::string checkpoint_verify(const std::string& checkpoint_dir);

// Loads a verified checkpoint directory (throws trainer::Error exit 2 if it does not verify).
CheckpointContents checkpoint_load(const std::string& checkpoint_dir);

// Reads the tensors of one safetensors file as fp32 CPU tensors (F32, BF16, F16, F64 accepted).
NamedTensors checkpoint_read_tensors(const std::string& path);

// Writes tensors to a safetensors file (fsynced); returns the file's CRC32C.
uint32_t checkpoint_write_tensors(const std::string& path, const NamedTensors& tensors);

}  // namespace trainer
