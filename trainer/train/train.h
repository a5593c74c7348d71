// Public face of train/: the Trainer (one method per phase) and the step it runs.
// The normative math is DESIGN section 5; the derivation is in step.cpp and docs/training.md.
#pragma once
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "trainer/ckpt/ckpt.h"
#include "trainer/config/config.h"
#include "trainer/data/data.h"
#include "trainer/dist/dist.h"
#include "trainer/metrics/metrics.h"
#include "trainer/model/model.h"
#include "trainer/train/device.h"
#include "trainer/train/memory_plan.h"
#include "trainer/train/schedule.h"
#include "trainer/train/sharding.h"

namespace trainer {

class RunDirLock;  // run_dir.h

// Everything one optimizer step produced, still on the device (nothing read back yet),
// plus the host-side facts the step already knew without a sync.
struct StepOutput {
  int64_t step = 0;
  // 0-dim device tensors (float64 unless noted); the terms of the J that was differentiated.
  torch::Tensor lm_loss, z_loss, moe_lb_loss, mtp_loss, loss;
  torch::Tensor moe_router_z_loss;  // the router z-loss part of moe_lb_loss
  torch::Tensor mtp_loss_raw;       // mtp_loss before mtp_loss_scaling_factor
  torch::Tensor expert_counts;      // (MoE layers, E) fp32: tokens per expert, summed over micro-batches and ranks
  torch::Tensor moe_router_probs_std;  // fp64: router score std, mean over MoE layers, micro-batches, ranks
  torch::Tensor moe_router_bias_mean;  // fp64: the expert bias after the update, mean over experts and
                                       // MoE layers; undefined without routed_bias
  // What Megatron-LM logs (docs/metrics.md), fp64: the token-weighted CE mean over the global batch
  // in both modes; LB and router z-loss divided by their coefficients, and each MTP depth's loss
  // (unscaled), as plain means over micro-batches and ranks.
  torch::Tensor megatron_lm_loss, megatron_load_balancing_loss, megatron_z_loss;
  torch::Tensor megatron_mtp_depth_losses;  // (mtp_num_layers) fp64; undefined without MTP
  torch::Tensor raw_grad_norm;  // fp64 norm of the normalized gradient, before clipping
  torch::Tensor grad_norm;      // after clipping
  torch::Tensor num_zeros;      // int64: gradient elements exactly 0.0 after normalization (undefined
                                // when log_num_zeros_in_grad is off)
  torch::Tensor param_norm;     // fp64 norm of the parameters after the update
  double total_weights = 0;           // W: unmasked target tokens in the step (host-known)
  double learning_rate = 0;            // the rate this step's update used
  double megatron_learning_rate = 0;   // the next update's: what Megatron's log line shows
  bool step_skipped = false;          // spike guard or W == 0
  double step_time_seconds = 0;
  double data_wait_seconds = 0;       // time this step waited for its micro-batches
  std::vector<int64_t> sample_indices;  // global samples of the step (this rank's), for error messages
  int64_t collectives = 0;            // collectives this step needed (0 with one process)
  double collective_bytes = 0;        // bytes this rank sent in them (Communicator::bytes_sent)
  double grad_sync_seconds = 0;       // host time spent in those all-reduces
  bool stop_requested = false;        // some rank received SIGTERM/SIGINT before this step
  bool failure_reported = false;      // some rank failed in work of its own before this step (failure_vote_)
  int64_t host_reads = 0;             // device values read by the host inside the step (syncs on a GPU)
  int64_t host_allocations = -1;      // LibTorch CPU allocations in the step (-1: not counted, device.h)
  int64_t grad_sized_allocations = -1;  // of them, exactly the flat gradient buffer's size
};

// One micro-batch's terms of J (DESIGN section 5), differentiable, before any normalization.
struct MicroBatchLosses {
  double weights = 0;           // w_i: unmasked target tokens (host-known)
  torch::Tensor ce;             // sum over unmasked targets of CE + z-loss term
  torch::Tensor z;              // the z-loss part of ce (detached)
  torch::Tensor lb;             // MoE aux term at per-token scale: weighted LB + router z (0 if dense)
  torch::Tensor router_z;       // the router z-loss part of lb
  torch::Tensor mtp;            // mtp_loss_scaling_factor * mtp_raw (0 without MTP)
  torch::Tensor mtp_raw;        // mean over depths of each depth's per-token CE
  torch::Tensor mtp_depths;     // (mtp_num_layers) each depth's per-token CE (detached); undefined without MTP
  torch::Tensor lb_unweighted;  // mean over MoE layers of LB, not multiplied by its weight (detached)
  torch::Tensor router_z_unweighted;  // mean over MoE layers of the router z-loss, unweighted (detached)
  torch::Tensor expert_counts;  // (MoE layers, E) fp32 tokens per expert; undefined if dense
  torch::Tensor router_probs_std;  // mean over MoE layers of MoeLayerStats::probs_std (detached)
};

// Reductions over a contiguous 1-D fp32 buffer of any size (the flat gradient or parameters) that
// agree with float64 to ~1e-8 relative, without a buffer-sized temporary: fp32 rows of 1024
// combined in fp64 (step.cpp). Both return 0-dim tensors on the buffer's device.
torch::Tensor flat_buffer_norm(const torch::Tensor& flat);         // fp64 L2 norm
torch::Tensor flat_buffer_count_zeros(const torch::Tensor& flat);  // int64 count of elements == 0

// The same over an arena under expert parallelism: each rank of `expert_group` holds its own
// experts in `expert_segments` ((offset, numel) runs), the rest (dense) is the same on every rank.
// ||g||^2 = (the dense runs' sum of squares, from this rank's copy) + (the expert runs' summed
// over the group). The dense part is summed run by run, not as the total minus the experts: one
// rank's Inf expert gradient would make its dense part Inf - Inf = NaN, its norm NaN where the
// other ranks see Inf, and the ranks would then disagree on the NaN/Inf abort and the clipping.
torch::Tensor flat_buffer_norm_expert_parallel(const torch::Tensor& flat,
                                               const std::vector<std::pair<int64_t, int64_t>>& expert_segments,
                                               Communicator& expert_group);
torch::Tensor flat_buffer_count_zeros_expert_parallel(const torch::Tensor& flat,
                                                      const std::vector<std::pair<int64_t, int64_t>>& expert_segments,
                                                      Communicator& expert_group);

// Runs the model on one micro-batch and computes its loss terms.
MicroBatchLosses micro_batch_losses(Transformer& model, const MicroBatch& batch, const Config& config,
                                    const torch::Device& device);

// The memory plan's context for `world_size` ranks (`local_world_size` of them on this machine)
// running this build: the attention core it runs (SDPA on LibTorch >= 2.0, else the block-causal
// kernel) and whether SDPA reads k and v unrepeated. The dry run and the Trainer's check share it.
MemoryPlanContext memory_plan_context(const Config& config, int64_t world_size, int64_t local_world_size, bool cuda);

// SIGTERM/SIGINT handling for a training run (docs/checkpoints.md), installed before the Trainer
// is built: until train() reaches its loop a signal exits 0 at once with a line on stderr (there
// is nothing to save yet); from then on the first one stops the run after the step with a save,
// and a second exits 1 at once. Exports keep the default disposition (killed by the signal).
void stop_signals_install();

class Trainer {
 public:
  explicit Trainer(Config config);
  ~Trainer();

  // The whole run: resume, steps, deferred metric readback, logging, NaN/Inf aborts (exit 4),
  // checkpoints, and a clean stop on SIGTERM/SIGINT (save, exit 0).
  void train();

  // Restores the starting state: the newest valid checkpoint in run_dir, else
  // load_full_state_path, else load_parameters_path (weights only), else fresh. Returns the
  // step index to start at. Throws trainer::Error (exit 2) on a model/checkpoint mismatch, and,
  // for training, on a resume whose global batch would move the data position (an export only
  // reads the weights).
  enum class StartingFor { kTraining, kExport };
  int64_t load_initial_state(StartingFor use);
  // Whether a run starting at start_step has training steps left (skip_train: never).
  bool trains_from(int64_t start_step) const { return !config_.skip_train && start_step < config_.steps; }
  // The newest valid checkpoint in run_dir, the same on every rank (exit 3 when ranks differ).
  std::optional<std::string> agree_on_latest_checkpoint();
  // Runs `work` on rank 0 alone (what reads a checkpoint's every file to check its checksums:
  // R ranks each reading it all multiplies terabytes of reads at scale) and `others_work` (a
  // cheap check: that the files are there) on the others, which then wait for rank 0 as long as
  // it lives (it can outlast collective_timeout_seconds); every rank stops with the error of a
  // rank that failed.
  void on_rank0_alone(const std::string& what, const std::function<void()>& work,
                      const std::function<void()>& others_work = {});
  // Whether load_initial_state restored a checkpoint (this run's or load_full_state_path's).
  bool restored_checkpoint() const { return restored_consumed_samples_ >= 0; }
  // Host-side copy of everything a bit-exact resume needs, after `completed_steps` steps; every
  // rank calls it (a collective with ZeRO-1, sharded levels or expert parallelism). With sharded
  // levels over several ranks each rank keeps its own shard (sharded_checkpoints()); at the other
  // levels rank 0 keeps everything and the others nothing.
  CheckpointContents snapshot(int64_t completed_steps);
  // Each rank writes its own checkpoint files (optim_grads / optim_grads_params over R > 1).
  bool sharded_checkpoints() const { return sharded_state_ && comm_->world_size() > 1; }
  // Writes the model weights alone (checkpoint names, fp32) to a safetensors file, the bytes of a
  // checkpoint's model.safetensors. Every rank calls it (a collective with optim_grads_params or
  // expert parallelism); rank 0 writes, streaming one unit at a time (export_unit), to a temporary
  // name renamed when complete. Error(kExitFailure) on a failed write.
  void export_model(const std::string& path);
  // Writes a Hugging Face model directory of the current weights (HfDirectoryWriter: config.json,
  // sharded safetensors in `dtype`, fp32 or bf16), streamed as export_model. Throws config_error
  // when the model has no HF architecture.
  void export_hf(const std::string& dir, int64_t max_shard_bytes, torch::ScalarType dtype);
  // The model's fp32 logits for one sequence (positions 0.., one document):
  // {"logits": (L, V)} and, with MTP, {"mtp_logits.k": (L, V)} for each depth k. Every rank calls it
  // with the same tokens under expert parallelism.
  // with_gradients: also "loss" (1) = mean over i < L-1 of the cross-entropy of logits[i] against
  // tokens[i+1] (main head only), and "grad.<checkpoint name>" = its gradient for every tensor,
  // for checking against an independent reference (tests/ling2_reference.py).
  NamedTensors logits_for(const std::vector<int64_t>& tokens, bool with_gradients = false);
  // Forward-only evaluation on `eval_steps` global batches of the validation or the test split
  // from global batch `first_batch`: {eval/lm_loss (token mean), eval/z_loss, eval/perplexity,
  // eval/total_weights} ("test/..." for the test split), and for the validation split
  // eval/consumed_samples (its position after this evaluation) and eval/group (first_batch /
  // eval_steps). nullopt when a SIGTERM/SIGINT on any rank stopped it between two of its steps
  // (all ranks return nullopt at the same step; logs at most one progress line a minute on rank 0).
  // announce: the progress lines of Megatron's verbose evaluation (the ones after training), in
  // its log format.
  std::optional<MetricValues> evaluate(DataSplit split, int64_t first_batch, bool announce = false);
  // Builds the validation split's loader (and its index), and the test split's unless it is
  // empty, once, sized for the evaluations of steps [start_step, steps); train() calls it at the
  // start when eval_interval > 0, so an empty or unreadable validation split stops the run before
  // step 0.
  void eval_data_open(int64_t start_step = 0);

  // One optimizer step = forward_backward + optimizer_update. Returns device-side metrics.
  StepOutput train_step(int64_t step);
  // train_step where any device->host synchronization throws (debug_cuda_sync_check; CUDA only).
  StepOutput train_step_without_syncs(int64_t step);

  // Phases, public for tests:
  // K micro-batches of `step`, gradients accumulated in the flat buffer and normalized,
  // grad norm / zero count / NaN checks computed (but not clipped, not applied).
  StepOutput forward_backward(int64_t step);
  // Spike guard, clipping and AdamW on the flat buffers; fills step_skipped and learning_rate.
  void optimizer_update(StepOutput& out);
  // Reads a step's metrics to the host (the one sync per step), named as in docs/metrics.md.
  MetricValues read_metrics(const StepOutput& out) const;

  const Config& config() const { return config_; }
  Transformer& model() { return model_; }
  torch::Tensor flat_params() const { return flat_params_; }  // (P) fp32, every parameter is a view
  torch::Tensor flat_grads() const { return flat_grads_; }    // (P) fp32, every .grad is a view
  // optim_grads / optim_grads_params: the sharded model state (flat_grads() is then undefined, and
  // so is flat_params() with optim_grads_params); null at the other levels.
  const ShardedModelState* sharded_state() const { return sharded_state_.get(); }
  const DataLoader& data() const { return data_; }
  const Communicator& communicator() const { return *comm_; }
  int64_t updates_applied() const { return updates_applied_; }

 private:
  void check_memory_plan();  // exit 2 before allocating when the plan exceeds this rank's memory
  void log_attention_kernel() const;      // which fused kernel serves the GQA layers
  void log_mla_attention_kernel() const;  // and the MLA layers
  void build_flat_buffers(ModelInitializer* deferred_init);  // non-null: draw the weights unit by unit (optim_grads_params)
  bool spike_guard_rejects(double loss, double grad_norm);
  void restore(const CheckpointContents& contents, bool full_state, const std::string& source);
  // Sharded levels: the weights, and with full_state the moments and counters, of a verified
  // checkpoint directory (either layout) or of a weights file (CheckpointReader::weights), read one
  // tensor (one layer's stacked experts) at a time, each rank keeping its parts, so no rank holds
  // the whole state. Mismatches are listed as by restore (exit 2).
  void restore_streamed(const CheckpointReader& reader, bool full_state, const std::string& source);
  // The counters, spike-guard window and RNG of a checkpoint; warns about changed config keys.
  void restore_state(const CheckpointState& state, const std::string& config_yaml, const std::string& source);
  // load_parameters_path as a Hugging Face directory: config.json checked against the config
  // (exit 2 on the first shape mismatch, a warning for each other difference), tensors renamed;
  // the sharded levels read it one tensor at a time (CheckpointReader::hugging_face).
  void load_hf_parameters(const std::string& dir);
  // Views of `flat`, which holds the arena's elements from `begin` on: one per parameter that lies
  // wholly inside it, named and shaped as named_parameters().
  NamedTensors arena_views(const torch::Tensor& flat, int64_t begin = 0) const;
  // Sharded checkpoints: the arena range [first, second) whose parameters `rank` saves. Ranges
  // cut between parameters (never between a layer's stacked expert tensors), about P / R each.
  std::pair<int64_t, int64_t> checkpoint_range(int64_t rank) const;
  // Sharded checkpoints: once every rank's writes of the uncommitted save have ended (waiting for
  // them with `block`, else only if they already have), rank 0 commits it. A collective. A rank's
  // failed write (named by rank) or a failed commit throws exit 1 when `fatal`, else is logged.
  void checkpoint_commit(bool block, bool fatal);
  // Applies the step's expert-bias update (routed_bias; `apply`: the step was not skipped) and
  // sets out.moe_router_bias_mean.
  void update_expert_bias(StepOutput& out, bool apply);
  bool sharded() const { return !sharded_state_ && shard_end_ - shard_begin_ < flat_params_.numel(); }  // ZeRO-1
  // The ranks ZeRO-1 shards the AdamW state over: all, or with expert parallelism the expert
  // replica group (the ranks whose arenas are equal: same dense weights, same experts).
  Communicator& zero1_group() const { return expert_replicas_ ? *expert_replicas_ : *comm_; }
  // The gradient buffer a step accumulates, normalizes and clips: the flat arena, or the shard.
  torch::Tensor step_grads() const { return sharded_state_ ? sharded_state_->grad_shard : flat_grads_; }
  // Expert parallelism (docs/distributed.md): the subgroups, and the MoE layers wired to them.
  void build_expert_parallel();
  // Sums the flat gradient over the ranks that hold each part: dense parameters over all R, the
  // stacked expert parameters over their R/N replicas. Bucketed, in arena order.
  void reduce_gradients();
  // fp64 L2 norm / int64 zero count of an arena-shaped buffer over the whole model: with expert
  // parallelism the expert parts held by the other ranks of the group are added (a collective).
  torch::Tensor arena_norm(const torch::Tensor& flat);
  torch::Tensor arena_count_zeros(const torch::Tensor& flat);
  // `views` (arena_views of a host or device buffer) with, under expert parallelism, each stacked
  // expert tensor replaced by the whole layer's (E, ...), gathered from the expert-parallel group
  // (a collective; meta views are only reshaped).
  NamedTensors with_all_experts(NamedTensors views, const std::string& what);
  // Exports, one unit of model_units() at a time: the unit's weights named for a checkpoint (every
  // expert) on rank 0, nothing elsewhere (a collective with optim_grads_params or expert
  // parallelism); with `meta` rank 0's names and shapes only, no collective. export_buffers: the
  // model's buffers (fp32) on rank 0. export_plan: all of it as meta tensors, in file order.
  NamedTensors export_unit(const ShardUnit& unit, size_t index, bool meta);  // unit = model_units(model_, EP)[index]
  NamedTensors export_buffers(bool meta) const;
  NamedTensors export_plan();
  // Runs every unit's export_unit, then export_buffers, calling `write` on rank 0 with each
  // non-empty result until one throws (kept in `failure`; the collectives still run to the end).
  void export_stream(const std::function<void(const NamedTensors&)>& write, std::exception_ptr& failure);
  // The reverse, for a restore: targets named as named_parameters() whose stacked expert tensors
  // are whole-layer host tensors; keep_local_experts then copies this rank's experts into `flat`.
  NamedTensors restore_targets(const torch::Tensor& flat) const;
  void keep_local_experts(const NamedTensors& targets, const torch::Tensor& flat) const;
  bool snapshot_is_collective() const {
    return sharded() || expert_group_ != nullptr || (sharded_state_ && !comm_->is_local());
  }
  int64_t collectives_so_far() const;  // over the world group and the expert-parallel subgroups
  double bytes_sent_so_far() const;
  // ZeRO-1: `padded` (R * shard_chunk_) holds this rank's chunk; afterwards every rank's chunk,
  // on every rank (bucketed in-place all-gathers, exact).
  void all_gather_chunks(torch::Tensor& padded, const std::string& what);

  // Initialized in this order: the device comes before the communicator (NCCL needs it).
  Config config_;
  DistEnv dist_;
  torch::Device device_;
  std::unique_ptr<Communicator> comm_;
  // Expert parallelism (expert_parallelism N > 1): the N consecutive ranks that share one copy of
  // every MoE layer's experts (E/N each), and the R/N ranks that hold the same experts as this one
  // (their expert gradients are summed there). Null without expert parallelism.
  std::unique_ptr<Communicator> expert_group_, expert_replicas_;
  int64_t expert_rank_ = 0;  // this rank's position in its expert-parallel group
  std::vector<std::pair<int64_t, int64_t>> expert_segments_;  // (offset, numel) of the stacked expert tensors in the arena
  std::vector<std::pair<int64_t, int64_t>> no_decay_runs_;  // (offset, numel) in the AdamW moments of adamw_mask's parameters, in order
  Transformer model_{nullptr};
  std::unique_ptr<ShardedModelState> sharded_state_;  // data_parallel_sharding optim_grads | optim_grads_params
  // HSDP (data_parallel_shard_degree D < R): the D consecutive ranks the model state is sharded
  // over, and the R/D ranks holding the same shard (its gradient is summed there). Null otherwise.
  std::unique_ptr<Communicator> shard_group_, shard_replicas_;
  // HSDP with expert parallelism: the ranks of this sharding group that hold the same experts (the
  // expert units shard over them). Null otherwise.
  std::unique_ptr<Communicator> expert_shard_group_;
  DataLoader data_;
  ModelSize size_;
  double peak_tflops_ = 0;      // for perf/mfu; 0 = unknown
  torch::Tensor flat_params_padded_;  // (R * shard_chunk_) fp32: the parameter arena, zero-padded (ZeRO-1)
  torch::Tensor flat_params_;   // (P) fp32: its first P elements, which every parameter views
  torch::Tensor flat_grads_;    // (P) fp32
  // AdamW state for this rank's shard [shard_begin_, shard_end_) of the flat buffer: all of it
  // without ZeRO-1, a 1/R slice with data_parallel_sharding=optim (the chunk clipped to P).
  int64_t shard_begin_ = 0, shard_end_ = 0;
  int64_t shard_chunk_ = 0;     // ceil(P / R) with ZeRO-1, else P
  torch::Tensor adam_m_;        // (shard) fp32, first moment
  torch::Tensor adam_v_;        // (shard) fp32, second moment
  torch::Tensor adam_step_;     // (1) fp32 on the device: t, for the fused CUDA AdamW kernel
  int64_t updates_applied_ = 0;
  bool stop_vote_ = false;  // this rank's SIGTERM/SIGINT, agreed on in the step's stats all-reduce
  bool failure_vote_ = false;  // this rank holds a failure of its own (train()), announced the same way
  std::deque<double> spike_losses_, spike_grad_norms_;  // last skip_step_interval finite steps' loss, clipped grad norm
  int64_t restored_consumed_samples_ = -1;  // of the checkpoint restore_state read; -1: none
  int64_t restored_steps_ = 0;              // its run's `steps` where the config differs, else 0
  std::string initial_state_source_;        // "run_dir D" or "load_full_state_path P": where the start step came from
  std::unique_ptr<RunDirLock> run_dir_lock_;  // rank 0, for the duration of train(): one trainer per run_dir
  std::unique_ptr<MetricsLogger> logger_;
  std::unique_ptr<Checkpointer> checkpointer_;
  std::string checkpoint_write_error_;  // this rank's failed shard write, until checkpoint_commit decides
  std::unique_ptr<DataPrefetcher> prefetcher_;  // in-order micro-batches during train()
  std::unique_ptr<DataLoader> eval_data_;       // validation split, built on first use
  std::unique_ptr<DataLoader> test_data_;       // test split (eval_steps global batches); null if empty
  // Validation samples the evaluations so far read (Megatron's consumed_valid_samples; in
  // state.json): the next evaluation starts there.
  int64_t eval_consumed_samples_ = 0;
};

}  // namespace trainer
