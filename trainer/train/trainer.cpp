// Trainer: construction, the training loop (deferred metric readback, evaluation, checkpoints,
// stop signals) and metric readout. The step is in step.cpp, the optimizer phase in
// optimizer.cpp, resume and export in resume.cpp.
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <sstream>

#include <spdlog/spdlog.h>

#include "trainer/metrics/perf_counters.h"
#include "trainer/model/model_size.h"
#include "trainer/train/memory_plan.h"
#include "trainer/train/run_dir.h"
#include "trainer/train/train.h"
#include "trainer/util/error.h"
#include "trainer/util/torch_compat.h"

namespace trainer {
namespace {

// The ranks meet once per data index file through the rendezvous store (DataIndexSync): rank 0
// publishes the file, the others wait for it as long as a collective may take; and they vote on
// the index memory check and on the file names with an all-reduce.
DataIndexSync data_index_sync(Communicator& comm, double timeout_seconds) {
  if (comm.world_size() == 1) return {};
  DataIndexSync sync;
  sync.vote = [&comm](bool mine, const std::string& what) { return ranks_reporting(mine, comm, what); };
  sync.announce = [&comm, timeout_seconds](const std::string& slot, const DataIndexSync::Announcement& mine) {
    try {
      const std::string value = comm.broadcast_string("data index " + slot, (mine.cached ? "1" : "0") + mine.file);
      return DataIndexSync::Announcement{value.substr(1), value.rfind('1', 0) == 0};
    } catch (const Error& e) {
      throw Error(e.exit_code(), std::string(e.what()) + ": rank 0 did not announce the data index of " + slot + " within " +
                                     std::to_string(static_cast<int64_t>(timeout_seconds)) +
                                     " s (it failed: see its log; or building the index takes longer: raise "
                                     "collective_timeout_seconds)");
    }
  };
  return sync;
}

// Every rank must train the same config. Rank 0's run name (which may carry a timestamp) is
// adopted; any other difference is an error naming the first differing key.
const Config& agree_on_config(Config& c, const DistEnv& env, Communicator& comm) {
  // Checked before anything else, also for one process: a config resolved for R ranks has R in
  // its global batch, and would silently skip samples when run by fewer.
  if (env.world_size != c.data_parallel_size)
    throw config_error("the config was resolved for " + std::to_string(c.data_parallel_size) + " ranks, but " +
                       env.launcher + " started " + std::to_string(env.world_size));
  // The whole config at the top of the log (MaxText's log_config, Megatron's arguments block):
  // a job log alone says what ran, also when the run dies before config.yml is written.
  const auto log_resolved = [&c, &env]() -> const Config& {
    if (c.log_config && env.rank == 0) spdlog::info("resolved config (--print-config prints it, <run_dir>/config.yml keeps it):\n{}", config_to_yaml(c));
    return c;
  };
  if (comm.world_size() == 1) return log_resolved();
  c.run_name = comm.broadcast_string("run_name", c.run_name);
  c.metrics_file = comm.broadcast_string("metrics_file", c.metrics_file);
  c.run_dir = comm.broadcast_string("run_dir", c.run_dir);
  const std::string mine = config_to_yaml(c), theirs = comm.broadcast_string("config", mine);
  // Every rank learns whether any differs, so all exit 2 together (rank 0 would otherwise see a
  // dead peer and exit 5, racing the differing rank's exit 2).
  const int64_t differing = ranks_reporting(mine != theirs, comm, "the config agreement");
  if (mine != theirs) {
    std::istringstream a(mine), b(theirs);
    for (std::string x, y; std::getline(a, x) && std::getline(b, y);)
      if (x != y)
        throw config_error("rank " + std::to_string(env.rank) + " has a different config than rank 0: '" + x +
                           "' here, '" + y + "' on rank 0");
  }
  if (differing > 0)
    throw config_error("rank " + std::to_string(env.rank) + ": " + std::to_string(differing) +
                       " rank(s) have a different config than rank 0 (their messages name the key)");
  if (env.rank > 0) {
    if (!c.log_all_ranks) spdlog::set_level(spdlog::level::warn);  // only rank 0 reports progress
    spdlog::set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%l] [rank " + std::to_string(env.rank) + "] %v");
  }
  return log_resolved();  // rank 0's (every rank's is the same by now)
}

// "0-7, 16-23": sample indices as ranges, for error messages.
std::string index_ranges(const std::vector<int64_t>& indices) {
  std::string out;
  for (size_t i = 0; i < indices.size();) {
    size_t j = i;
    while (j + 1 < indices.size() && indices[j + 1] == indices[j] + 1) ++j;
    out += (out.empty() ? "" : ", ") + std::to_string(indices[i]);
    if (j > i) out += "-" + std::to_string(indices[j]);
    i = j + 1;
  }
  return out;
}

// SIGTERM/SIGINT (stop_signals_install). Until the ranks can agree, the first signal ends the
// process at once (nothing to save). Once several ranks are connected, a rank that exited alone
// would leave the others failing their next collective (exit 5, blaming a dead peer): the signal
// is held, and the ranks stop together, exit 0, at the vote before the first step. In the loop,
// each step's all-reduce carries the vote and the run saves and stops after that step.
enum StopMode : int { kStopExitAtOnce, kStopBeforeFirstStep, kStopAfterStep };
std::atomic<int> g_stop_mode{kStopExitAtOnce};
std::atomic<int> g_stop_signal{0};          // the first held signal
std::atomic<int64_t> g_stop_signal_ns{0};   // when it came (CLOCK_MONOTONIC); 0 while being recorded
static_assert(std::atomic<int>::is_always_lock_free && std::atomic<int64_t>::is_always_lock_free,
              "the stop-signal handler needs lock-free atomics");
// One request may arrive as several signals: timeout(1) signals the process and then its process
// group; Ctrl-C reaches torchrun (or mpirun) and its ranks, and the launcher then sends them
// SIGTERM. Each used to count as a second request: exit 1 without saving. A stop signal within
// this window of the first is the same request; a later one means: now.
constexpr int64_t kStopRepeatWindowNs = 2'000'000'000;

// Only async-signal-safe calls here: write(2) of fixed text, clock_gettime and _exit.
void stop_signal_say(const char* text) {
  size_t n = 0;
  while (text[n] != '\0') ++n;
  while (n > 0) {
    const ssize_t written = ::write(STDERR_FILENO, text, n);
    if (written <= 0) return;
    text += written;
    n -= static_cast<size_t>(written);
  }
}
int64_t stop_signal_clock_ns() {
  timespec now{};
  clock_gettime(CLOCK_MONOTONIC, &now);
  return static_cast<int64_t>(now.tv_sec) * 1000000000 + now.tv_nsec;
}
extern "C" void on_stop_signal(int signo) {
  const int saved_errno = errno;  // the interrupted code may be about to read it
  const bool term = signo == SIGTERM;
  const int mode = g_stop_mode.load();
  if (mode == kStopExitAtOnce) {
    stop_signal_say(term ? "trainer: received SIGTERM before the first step: exiting (nothing to save)\n"
                         : "trainer: received SIGINT before the first step: exiting (nothing to save)\n");
    ::_exit(kExitOk);
  }
  const int64_t now = stop_signal_clock_ns();
  int first = 0;
  if (g_stop_signal.compare_exchange_strong(first, signo)) {
    g_stop_signal_ns = now;
    if (mode == kStopBeforeFirstStep)
      stop_signal_say(term ? "trainer: received SIGTERM during start-up: the ranks stop together before the first "
                             "step (nothing to save; another signal more than 2 s later exits at once)\n"
                           : "trainer: received SIGINT during start-up: the ranks stop together before the first "
                             "step (nothing to save; another signal more than 2 s later exits at once)\n");
    errno = saved_errno;
    return;
  }
  // Another thread may still be recording the first (ns 0): the two came together.
  const int64_t first_ns = g_stop_signal_ns.load();
  if (first_ns == 0 || now - first_ns < kStopRepeatWindowNs) {
    errno = saved_errno;
    return;
  }
  stop_signal_say(term ? "trainer: received SIGTERM, a second stop signal: exiting at once without saving (exit 1)\n"
                       : "trainer: received SIGINT, a second stop signal: exiting at once without saving (exit 1)\n");
  ::_exit(kExitFailure);
}

// For log lines: this rank's held signal, or 0 when another rank's vote stopped it.
const char* stop_signal_name(int signo) {
  return signo == SIGTERM ? "SIGTERM" : signo == SIGINT ? "SIGINT" : "a stop signal on another rank";
}

// The world communicator, and from here on a start-up signal is held when there are other ranks.
std::unique_ptr<Communicator> stop_signals_hold_with(std::unique_ptr<Communicator> comm) {
  if (comm->world_size() > 1) g_stop_mode = kStopBeforeFirstStep;
  return comm;
}
}  // namespace

Trainer::Trainer(Config config)
    : config_(std::move(config)),
      dist_(dist_env_resolve()),
      device_(device_select(config_, dist_.local_rank)),
      comm_(stop_signals_hold_with(dist_init(dist_, {config_.collective_timeout_seconds, config_.dist_backend, device_}))),
      data_(agree_on_config(config_, dist_, *comm_), dist_.rank,
            data_index_sync(*comm_, config_.collective_timeout_seconds), dist_.local_world_size),
      size_(model_size(config_)) {
  perf_startup_mark("device, rendezvous, data");
  if (config_.keep_freed_host_memory) host_memory_keep_freed();
  if (config_.host_huge_pages) host_memory_huge_pages();
  if (config_.num_threads > 0) torch::set_num_threads(static_cast<int>(config_.num_threads));
  compat::cpu_bf16_gemm_via_fp32_set(compat::cpu_bf16_gemm_mode_of(config_.cpu_bf16_gemm));
  // Nothing in a step draws from the global generator today; seeding it anyway makes its state
  // (saved in checkpoints) a function of the config, so future random ops resume bit-exactly.
  torch::manual_seed(static_cast<uint64_t>(config_.init_weights_seed));
  config_check_layout(config_, comm_->world_size());
  expert_rank_ = comm_->rank() % config_.expert_parallelism;
  check_memory_plan();
  // optim_grads_params draws the weights unit by unit as it shards them: no rank ever holds the
  // whole model. Every level moves the parameters to the device as it copies them into its flat
  // buffers, one tensor at a time; to() then moves the buffers.
  const bool draw_per_unit = config_.data_parallel_sharding == "optim_grads_params";
  model_ = model_build(config_, expert_rank_, /*draw=*/!draw_per_unit);
  ModelInitializer initializer(config_, expert_rank_);
  perf_startup_mark("model init");
  build_expert_parallel();  // before the flat buffers: the sharded levels shard the experts over its replica group
  build_flat_buffers(draw_per_unit ? &initializer : nullptr);
  model_->to(device_);
  perf_startup_mark("to device + flat buffers");
  if (device_.is_cpu()) host_allocations_watch(static_cast<size_t>(step_grads().numel()) * sizeof(float));
  const std::string name = device_name(device_);
  peak_tflops_ = config_.peak_tflops_per_device > 0 ? config_.peak_tflops_per_device
                                                    : device_known_peak_tflops(name, config_.dtype);
  if (peak_tflops_ > 0)
    spdlog::info("device {}: perf/mfu against {:.1f} TFLOP/s ({} {})", name, peak_tflops_, config_.dtype,
                 config_.peak_tflops_per_device > 0 ? "from peak_tflops_per_device" : "datasheet dense peak");
  else
    spdlog::info("device {}: perf/mfu is not reported: its peak TFLOP/s is unknown (set peak_tflops_per_device)", name);
  log_attention_kernel();
  if (device_.is_cpu() && config_.dtype == "bfloat16" && compat::cpu_bf16_gemm_via_fp32())
    spdlog::info("dtype=bfloat16 on this CPU: bf16 GEMMs run as fp32 GEMMs of the bf16 operands, rounded to bf16 "
                 "(cpu_bf16_gemm={}; docs/training.md)", config_.cpu_bf16_gemm);
  else if (device_.is_cpu() && config_.dtype == "bfloat16" && !compat::cpu_bf16_gemm_native_accumulates_in_fp32())
    spdlog::warn("dtype=bfloat16 with cpu_bf16_gemm=native on this CPU: LibTorch " TORCH_VERSION " sums bf16 products "
                 "in bf16 here (no AVX-512: about 1% relative error at inner size 64, 10% at 8192; docs/training.md)");
}

// Which kernel scaled_dot_product_attention picks for this model's plain causal rows (no packed
// documents), asked of LibTorch with empty tensors of one sequence: a run on a GPU shows whether
// flash or cuDNN attention serve it, and whether grouped kv heads are read unrepeated.
void Trainer::log_attention_kernel() const {
  const Config& c = config_;
  if (c.attention_type == "mla") log_mla_attention_kernel();
  if (c.attention_type != "global" || c.inhomogeneous_layer_cycle_interval > 0) return;  // GQA layers only
  const int64_t Hq = c.base_num_query_heads, Hkv = c.base_num_kv_heads, L = c.max_target_length, hd = c.head_dim;
  if (!compat::kFusedCausalAttention) {  // 1.13: the model's own kernel (model_detail::block_causal_attention)
    spdlog::info("attention: block-causal kernel, query blocks of {} positions{}", kAttentionBlock,
                 Hq == Hkv ? "" : fmt::format(" ({} kv heads read unrepeated by {} query heads)", Hkv, Hq));
    return;
  }
  const auto options = torch::TensorOptions().device(device_).dtype(c.dtype == "bfloat16" ? torch::kBFloat16 : torch::kFloat32);
  const bool native = compat::native_gqa_attention(device_);
  const auto q = torch::empty({1, Hq, L, hd}, options), kv = torch::empty({1, Hkv, L, hd}, options);
  spdlog::info("attention: {} kernel for plain causal rows{}", compat::attention_kernel_name(q, kv, kv, {}, native),
               Hq == Hkv  ? ""
               : native   ? fmt::format(" ({} kv heads read unrepeated by {} query heads)", Hkv, Hq)
                          : fmt::format(" ({} kv heads repeated to {} query heads)", Hkv, Hq));
}

// The same for MLA layers, whose value heads may be narrower than their query/key heads: the
// kernel, and whether v is zero-padded to reach it (compat::attention_pads_value).
void Trainer::log_mla_attention_kernel() const {
  const Config& c = config_;
  const int64_t H = c.base_num_query_heads, L = c.max_target_length, qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
  const std::string dims = fmt::format("q/k head dim {}, v {}", qk, c.v_head_dim);
  if (!compat::kFusedCausalAttention) {
    spdlog::info("MLA attention: block-causal kernel, query blocks of {} positions ({})", kAttentionBlock, dims);
    return;
  }
  const auto options = torch::TensorOptions().device(device_).dtype(c.dtype == "bfloat16" ? torch::kBFloat16 : torch::kFloat32);
  const auto q = torch::empty({1, H, L, qk}, options), v = torch::empty({1, H, L, c.v_head_dim}, options);
  const bool pad = compat::attention_pads_value(q, q, v, {});
  const auto kernel = compat::attention_kernel_name(q, q, pad ? q : v, {}, false);  // q: the padded v's shape
  spdlog::info("MLA attention: {} kernel for plain causal rows ({}{})", kernel, dims,
               pad ? fmt::format(", v zero-padded to {}: {} takes equal head dims", qk, kernel) : "");
}

Trainer::~Trainer() = default;

// Groups of N consecutive ranks share one copy of every MoE layer's experts (rank r holds the
// experts of position r % N); ranks r % N, r % N + N, ... hold the same experts. Every rank makes
// its two subgroups in the same order (expert-parallel group, then replicas), so the rendezvous
// of each subgroup finds all its members.
void Trainer::build_expert_parallel() {
  const int64_t N = config_.expert_parallelism, R = comm_->world_size(), rank = comm_->rank();
  if (N == 1) return;
  std::vector<int64_t> group, replicas;
  for (int64_t r = rank / N * N; r < rank / N * N + N; ++r) group.push_back(r);
  for (int64_t r = rank % N; r < R; r += N) replicas.push_back(r);
  expert_group_ = comm_->split(group, "expert-parallel group");
  expert_replicas_ = comm_->split(replicas, "expert replica group");
  int64_t index = 0;
  for (size_t i = 0; i < model_->model->layers->size(); ++i) {
    auto layer = model_->model->layers[i]->as<DecoderLayerImpl>();
    if (!layer->moe) continue;
    const bool kill = config_.debug_kill_rank_in_expert_dispatch == rank && index == 0;
    layer->moe->expert_parallel_set(expert_group_.get(),
                                    "MoE layer " + std::to_string(index) + " (model.layers." + std::to_string(i) + ".mlp)", kill);
    ++index;
  }
  spdlog::info("expert parallelism: {} ranks per group, {} of {} experts per MoE layer on each (experts {}-{} here)", N,
               config_.num_experts / N, config_.num_experts, expert_rank_ * (config_.num_experts / N),
               (expert_rank_ + 1) * (config_.num_experts / N) - 1);
}

int64_t Trainer::collectives_so_far() const {
  int64_t n = comm_->collectives();
  if (&comm_->host_group() != comm_.get()) n += comm_->host_group().collectives();
  for (const auto* group : {&expert_group_, &expert_replicas_, &shard_group_, &shard_replicas_, &expert_shard_group_})
    if (*group) n += (*group)->collectives();
  return n;
}

double Trainer::bytes_sent_so_far() const {
  double bytes = comm_->bytes_sent();
  if (&comm_->host_group() != comm_.get()) bytes += comm_->host_group().bytes_sent();
  for (const auto* group : {&expert_group_, &expert_replicas_, &shard_group_, &shard_replicas_, &expert_shard_group_})
    if (*group) bytes += (*group)->bytes_sent();
  return bytes;
}

MemoryPlanContext memory_plan_context(const Config& config, int64_t world_size, int64_t local_world_size, bool cuda) {
  const bool fp32_sums = !cuda && compat::cpu_bf16_gemm_via_fp32_in(compat::cpu_bf16_gemm_mode_of(config.cpu_bf16_gemm));
  // A GPU plan from a build without CUDA (--dry-run hardware=gpu on a CPU machine) is planned for
  // the build that would run it: a CUDA LibTorch >= 2.5 (SDPA reading grouped heads natively).
  if (cuda && !at::hasCUDA())
    return {world_size, local_world_size, cuda, AttentionCore::sdpa, true, false,
            "planned for a CUDA build of LibTorch >= 2.5 (this build has no CUDA)"};
  return {world_size, local_world_size, cuda,
          compat::kFusedCausalAttention ? AttentionCore::sdpa : AttentionCore::block_causal,
          compat::native_gqa_attention(torch::Device(cuda ? torch::kCUDA : torch::kCPU)), fp32_sums, ""};
}

// Before the first parameter is allocated: the plan (memory_plan.h) against what this rank can
// have: free device memory on a GPU; on the CPU the host's available memory (MemAvailable, cgroup,
// rlimits) shared by the ranks on this machine. Every rank learns whether all fit, so all exit 2
// together instead of some dying in an allocation and the others timing out.
void Trainer::check_memory_plan() {
  const Config& c = config_;
  const MemoryPlanContext context = memory_plan_context(config_, comm_->world_size(), dist_.local_world_size, device_.is_cuda());
  const MemoryPlan plan = memory_plan(c, context);
  double available = 0, resident = 0;
  std::string source;
  if (device_.is_cuda()) {
    available = device_free_memory_bytes(device_);
    source = "free memory of " + device_name(device_) + " " + device_.str();
  } else {
    const HostMemory host = host_memory_available(dist_.local_world_size);
    available = host.available_bytes;
    // Built before this check, the data index arrays are resident but not the plan's runtime part.
    resident = std::max(0.0, host.resident_bytes - data_.data_loader_index_bytes());
    source = host.source;
  }
  const double needed = plan.total_bytes - resident;  // the runtime part (LibTorch, the binary) is resident
  const bool fits = needed <= available;
  spdlog::info("memory plan: {} per rank ({} of it still to allocate), {} available ({}){}",
               memory_bytes_text(plan.total_bytes), memory_bytes_text(needed), memory_bytes_text(available), source,
               fits ? "" : c.allow_memory_overcommit ? "; does NOT fit, going on (allow_memory_overcommit)" : "");
  if (c.allow_memory_overcommit) return;
  const int64_t ranks_failing = ranks_reporting(!fits, *comm_, "the memory plan check");
  if (fits && ranks_failing > 0)
    throw config_error("the memory plan does not fit on " + std::to_string(ranks_failing) +
                       " other rank(s) (their message has the plan); allow_memory_overcommit=true skips this check");
  if (fits) return;
  std::string message = "the memory plan does not fit on rank " + std::to_string(dist_.rank) + ": it needs " +
                        memory_bytes_text(needed) + " more, and " + memory_bytes_text(available) + " is available (" +
                        source + ").\nmemory plan per rank:\n" + memory_plan_format(plan);
  const auto suggestions = memory_plan_suggestions(c, context, available, resident);
  if (suggestions.empty())
    message += "nothing the plan knows of fits (smaller per_device_batch_size, ZeRO-1 or -3, remat_policy=full, "
               "num_vocab_tiling, bf16, synchronous saves); the "
               "weights, gradients and optimizer state alone need " + memory_bytes_text(plan.model_state_bytes) +
               ": use a machine with more memory, more ranks, or a smaller model.\n";
  for (size_t i = 0; i < suggestions.size(); ++i) message += (i == 0 ? "would fit: " : "       or: ") + suggestions[i] + "\n";
  message += "allow_memory_overcommit=true skips this check.";
  throw config_error(message);
}

// debug_cuda_sync_check: the step under CUDA's sync debug mode "error", off again however it
// ends. LibTorch's error names the operation; the message adds the step and what to look for.
StepOutput Trainer::train_step_without_syncs(int64_t step) {
  struct SyncErrors {
    explicit SyncErrors(const torch::Device& device) : device(device) { device_sync_errors_set(device, true); }
    ~SyncErrors() { device_sync_errors_set(device, false); }
    torch::Device device;
  } sync_errors(device_);
  try {
    return train_step(step);
  } catch (const c10::Error& e) {
    const std::string what = e.what_without_backtrace();
    throw Error(kExitFailure, "step " + std::to_string(step) + ": debug_cuda_sync_check: the step made the host wait " +
                                  "for the device: " + what.substr(0, what.find('\n')));
  }
}

StepOutput Trainer::train_step(int64_t step) {
  const int64_t reads_before = perf_host_reads();
  const HostAllocationCounts allocations_before = host_allocations();
  StepOutput out = forward_backward(step);
  optimizer_update(out);
  out.host_reads = perf_host_reads() - reads_before;
  const HostAllocationCounts allocations_after = host_allocations();
  if (allocations_after.available) {
    out.host_allocations = allocations_after.allocations - allocations_before.allocations;
    out.grad_sized_allocations = allocations_after.watched - allocations_before.watched;
  }
  return out;
}

MetricValues Trainer::read_metrics(const StepOutput& out) const {
  // Tensors not yet computed (grad_norm and param_norm before optimizer_update) read as NaN.
  const auto f64 = [&](const torch::Tensor& t) {
    return t.defined() ? t.to(torch::kFloat64)
                       : torch::full({}, std::numeric_limits<double>::quiet_NaN(), out.loss.options());
  };
  // One device->host copy for all device scalars of the step.
  std::vector<torch::Tensor> scalars = {f64(out.loss), f64(out.lm_loss), f64(out.moe_lb_loss),
                                        f64(out.mtp_loss), f64(out.z_loss), f64(out.grad_norm),
                                        f64(out.raw_grad_norm), f64(out.param_norm), f64(out.num_zeros),
                                        f64(out.mtp_loss_raw), f64(out.moe_router_z_loss),
                                        f64(out.megatron_lm_loss), f64(out.megatron_load_balancing_loss),
                                        f64(out.megatron_z_loss)};
  const int64_t depths = out.megatron_mtp_depth_losses.defined() ? out.megatron_mtp_depth_losses.numel() : 0;
  for (int64_t k = 0; k < depths; ++k) scalars.push_back(out.megatron_mtp_depth_losses[k].to(torch::kFloat64));
  const bool moe = out.expert_counts.defined();
  if (moe) {  // imbalance: max over experts / mean over experts, averaged over MoE layers
    const auto load = out.expert_counts.to(torch::kFloat64);
    scalars.push_back((std::get<0>(load.max(1)) / load.mean(1).clamp_min(1e-12)).mean());
    scalars.push_back(out.moe_router_probs_std.to(torch::kFloat64));
    if (out.moe_router_bias_mean.defined()) scalars.push_back(out.moe_router_bias_mean.to(torch::kFloat64));
  }
  const auto host = torch::stack(scalars).cpu();
  perf_note_host_read();
  const double* v = host.data_ptr<double>();
  const double loss = v[0], raw_grad_norm = v[6];
  const double tokens = static_cast<double>(config_.per_device_batch_size *
                                            config_.gradient_accumulation_steps * config_.max_target_length);
  const double seconds = out.step_time_seconds;
  MetricValues values = {
      {"learning/loss", loss},
      {"learning/lm_loss", v[1]},
      {"learning/moe_lb_loss", v[2]},
      {"learning/mtp_loss", v[3]},
      {"learning/mtp_loss_raw", v[9]},
      {"moe/router_z_loss", v[10]},
      {"learning/z_loss", v[4]},
      {"learning/total_weights", out.total_weights},
      {"learning/grad_norm", v[5]},
      {"learning/raw_grad_norm", raw_grad_norm},
      {"learning/param_norm", v[7]},
      {"learning/is_nan", (std::isnan(loss) || std::isnan(raw_grad_norm)) ? 1.0 : 0.0},
      {"learning/is_inf", (std::isinf(loss) || std::isinf(raw_grad_norm)) ? 1.0 : 0.0},
      {"learning/current_learning_rate", out.learning_rate},
      {"optim/step_skipped", out.step_skipped ? 1.0 : 0.0},
      {"perf/step_time_seconds", seconds},
      {"perf/data_wait_seconds", out.data_wait_seconds},
      {"perf/collectives_per_step", static_cast<double>(out.collectives)},
      {"perf/collective_bytes_per_step", out.collective_bytes},
      {"perf/host_reads_in_step", static_cast<double>(out.host_reads)},
      {"perf/grad_sync_seconds", out.grad_sync_seconds},
      {"perf/per_device_tokens_per_sec", seconds > 0 ? tokens / seconds : 0.0},
      {"perf/per_device_tflops_per_sec", seconds > 0 ? size_.flops_per_step_per_device / seconds / 1e12 : 0.0},
      // MaxText's per-step constants and its perplexity (exp of learning/lm_loss, z-loss part included).
      {"perf/per_device_tokens", tokens},
      {"perf/per_device_tflops", size_.flops_per_step_per_device / 1e12},
      {"learning/perplexity", std::exp(v[1])},
  };
  if (out.num_zeros.defined()) values.emplace_back("learning/num_zeros", v[8]);
  values.emplace_back("megatron/lm_loss", v[11]);
  values.emplace_back("megatron/learning_rate", out.megatron_learning_rate);
  if (moe) {
    // Megatron's router records no balancing loss when its coefficient is 0: it logs 0 then (the
    // statistic itself stays in moe/expert_load_max_over_mean).
    values.emplace_back("megatron/load_balancing_loss", config_.load_balance_loss_weight > 0 ? v[12] : 0.0);
    values.emplace_back("megatron/z_loss", v[13]);
  }
  for (int64_t k = 0; k < depths; ++k)
    values.emplace_back("megatron/mtp_" + std::to_string(k + 1) + "_loss", v[14 + k]);
  if (moe) {
    values.emplace_back("moe/expert_load_max_over_mean", v[14 + depths]);
    values.emplace_back("moe/router_probs_std", v[15 + depths]);
    if (out.moe_router_bias_mean.defined()) values.emplace_back("moe/router_bias_mean", v[16 + depths]);
  }
  if (out.host_allocations >= 0) {  // CPU with LibTorch 1.13 (device.h)
    values.emplace_back("perf/host_allocations_in_step", static_cast<double>(out.host_allocations));
    values.emplace_back("perf/grad_sized_allocations_in_step", static_cast<double>(out.grad_sized_allocations));
  }
  // MFU only against a known peak (peak_tflops_per_device, or a known GPU's); otherwise it is
  // left out, not guessed.
  if (peak_tflops_ > 0 && seconds > 0)
    values.emplace_back("perf/mfu", size_.flops_per_step_per_device / seconds / 1e12 / peak_tflops_);
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  values.emplace_back("memory/peak_rss_bytes", static_cast<double>(usage.ru_maxrss) * 1024.0);
  if (device_.is_cuda()) {
    const auto peaks = device_memory_peaks(device_);
    values.emplace_back("memory/cuda_peak_allocated_bytes", peaks.allocated_bytes);
    values.emplace_back("memory/cuda_peak_reserved_bytes", peaks.reserved_bytes);
  }
  return values;
}

void Trainer::eval_data_open(int64_t start_step) {
  if (eval_data_) return;
  const Config& c = config_;
  const int64_t per_evaluation = c.eval_steps * c.global_batch_size;
  // Megatron sizes the validation split for this run's (steps / eval_interval + 1) evaluations and
  // a resume continues at the checkpoint's position (consumed_valid_samples). With eval_interval or
  // eval_steps changed since, the evaluations left can read past that size: the index is built
  // for them (Megatron's sampler would stop at its end).
  // Megatron's --skip-train sizes it for the one evaluation.
  const bool trains = trains_from(start_step);
  const int64_t formula = c.skip_train ? per_evaluation : config_eval_samples(c, c.steps);
  const int64_t interval = std::max<int64_t>(c.eval_interval, 1);
  const int64_t evaluations_left = (trains ? c.steps / interval - start_step / interval : 0) + 1;  // and the one after training
  // The evaluations start at the next whole global batch (take_validation_batches in train()): a
  // checkpoint of a run with another global batch can leave consumed_valid_samples between two.
  const int64_t first_batch = eval_consumed_samples_ / c.global_batch_size +
                              (eval_consumed_samples_ % c.global_batch_size != 0);
  int64_t first_sample = 0, needed = 0;
  if (__builtin_mul_overflow(first_batch, c.global_batch_size, &first_sample) ||
      __builtin_mul_overflow(evaluations_left, per_evaluation, &needed) ||
      __builtin_add_overflow(needed, first_sample, &needed))
    throw Error(kExitData, "the checkpoint's consumed_valid_samples (" + std::to_string(eval_consumed_samples_) +
                               ") and this run's evaluations left do not fit in 64 bits");
  const int64_t samples = std::max(formula, needed);
  const auto source_of = [&](DataSplit split, int64_t num_samples) -> std::shared_ptr<SampleSource> {
    if (c.dataset_type == "synthetic") {
      Config shifted = c;  // disjoint from the training samples and from each other
      shifted.data_shuffle_seed = c.data_shuffle_seed + static_cast<int64_t>(split);
      return std::make_shared<SyntheticDataset>(shifted);
    }
    return megatron_source(c, split, num_samples, dist_.rank, data_index_sync(*comm_, c.collective_timeout_seconds),
                           dist_.local_world_size);
  };
  eval_data_ = std::make_unique<DataLoader>(c, dist_.rank, source_of(DataSplit::kValid, samples));
  if (samples > formula && !eval_data_->data_loader_same_samples_as_built_for(formula))
    spdlog::warn("the validation index is built for {} samples (the checkpoint's evaluations read {}, the {} left read {} "
                 "more), past the {} of this config's (steps / eval_interval + 1) x eval_steps x global_batch_size, and it "
                 "spans other epochs: its samples differ from those Megatron's index for this config holds (docs/metrics.md)",
                 samples, eval_consumed_samples_, evaluations_left, evaluations_left * per_evaluation, formula);
  // As for training (load_initial_state): another steps can mean other validation epochs.
  const int64_t samples_before = config_eval_samples(c, restored_steps_);
  if (trains && restored_steps_ > 0 && restored_steps_ != c.steps &&
      !eval_data_->data_loader_same_samples_as_built_for(samples_before))
    spdlog::warn("steps changed from {} to {}, and the validation index built for {} samples spans other epochs than "
                 "the checkpoint's run had ({} samples): the evaluation losses from here on are over other samples "
                 "than that run's (docs/data.md)",
                 restored_steps_, c.steps, samples, samples_before);
  // Megatron evaluates the test split once after training (eval_iters global batches from its
  // start), unless `split` leaves it empty ("99,1,0" turns it off).
  // Its files are the ones just opened; a test split that cannot be built (too few tokens, an
  // index past host memory) costs only that evaluation. All ranks agree, as they enter its
  // collectives together.
  std::string skipped;
  try {
    skipped = c.dataset_type == "synthetic" ? "" : megatron_split_empty(c, DataSplit::kTest);
    if (skipped.empty()) test_data_ = std::make_unique<DataLoader>(c, dist_.rank, source_of(DataSplit::kTest, per_evaluation));
  } catch (const Error& e) {
    skipped = e.what();
  }
  if (ranks_reporting(!skipped.empty(), *comm_, "the test split's opening") > 0) {
    test_data_.reset();
    if (dist_.rank == 0 || !skipped.empty())
      spdlog::info("no evaluation on the test split after training: {}",
                   skipped.empty() ? "another rank could not build it (its message says why)" : skipped);
  }
}

std::optional<MetricValues> Trainer::evaluate(DataSplit split, int64_t first_batch, bool announce) {
  const Config& c = config_;
  eval_data_open();
  TORCH_CHECK(split != DataSplit::kTrain, "evaluate: the validation or the test split");
  if (split == DataSplit::kTest && !test_data_) throw Error(kExitFailure, "evaluate: the test split is empty");
  const DataLoader& loader = split == DataSplit::kTest ? *test_data_ : *eval_data_;
  const std::string prefix = split == DataSplit::kTest ? "test/" : "eval/";
  torch::NoGradGuard no_grad;
  if (sharded_state_) sharded_state_->params_ensure();  // the decoder layers gather as they run
  // The same quantity as learning/lm_loss in per-token mode: the token-weighted mean of CE plus
  // the z-loss term (the loss term being optimized); eval/z_loss is that z part, and perplexity
  // is of the cross-entropy alone.
  double ce = 0, z = 0, weights = 0;
  using Clock = std::chrono::steady_clock;
  const auto begin = Clock::now();
  auto last_progress = begin;
  for (int64_t s = 0; s < c.eval_steps; ++s) {
    // A SIGTERM (a scheduler's notice before the kill) must not wait out a long evaluation: the
    // ranks agree before each evaluation step (their forwards may hold collectives, so all stop
    // at the same one), drop the evaluation, and the loop saves and stops as after a step.
    // One element per evaluation step is nothing beside the forwards, which read the host anyway.
    if (ranks_reporting(g_stop_signal.load() != 0, comm_->host_group(),
                        "the stop vote of evaluation step " + std::to_string(s)) > 0) {
      spdlog::warn("evaluation dropped after {} of its {} steps ({:.1f} s): a stop signal arrived", s,
                   c.eval_steps, std::chrono::duration<double>(Clock::now() - begin).count());
      return std::nullopt;
    }
    if (dist_.rank == 0 && Clock::now() - last_progress > std::chrono::seconds(60)) {
      last_progress = Clock::now();
      const double elapsed = std::chrono::duration<double>(last_progress - begin).count();
      spdlog::info("evaluating: {} of {} steps in {:.0f} s, about {:.0f} s to go", s, c.eval_steps, elapsed,
                   elapsed / static_cast<double>(s) * static_cast<double>(c.eval_steps - s));
    }
    if (announce && logger_) logger_->log_eval_progress(s, c.eval_steps, c.eval_steps * c.global_batch_size);
    for (int64_t micro = 0; micro < c.gradient_accumulation_steps; ++micro) {
      const auto batch = loader.data_loader_next(first_batch + s, micro);
      const auto m = micro_batch_losses(model_, batch, c, device_);
      const auto host = torch::stack({m.ce.to(torch::kFloat64), m.z.to(torch::kFloat64)}).cpu();
      perf_note_host_read();
      ce += host[0].item<double>();
      z += host[1].item<double>();
      weights += m.weights;
    }
  }
  auto sums = torch::tensor({ce, z, weights}, torch::kFloat64);
  comm_->all_reduce_sum(sums, "the evaluation loss sums");
  ce = sums[0].item<double>(), z = sums[1].item<double>(), weights = sums[2].item<double>();
  const double lm_loss = weights > 0 ? ce / weights : 0.0, z_loss = weights > 0 ? z / weights : 0.0;
  MetricValues values = {{prefix + "lm_loss", lm_loss},
                         {prefix + "z_loss", z_loss},
                         {prefix + "perplexity", std::exp(lm_loss - z_loss)},
                         {prefix + "total_weights", weights}};
  if (split == DataSplit::kValid) {
    values.emplace_back("eval/consumed_samples", static_cast<double>((first_batch + c.eval_steps) * c.global_batch_size));
    values.emplace_back("eval/group", static_cast<double>(first_batch) / static_cast<double>(c.eval_steps));
  }
  return values;
}

void stop_signals_install() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  sigaddset(&action.sa_mask, SIGTERM);  // one handler at a time per thread
  sigaddset(&action.sa_mask, SIGINT);
  // A held signal returns to the interrupted call: restarted, a blocking open or read goes on
  // instead of failing with EINTR (which would end the run with exit 1, not the agreed stop).
  action.sa_flags = SA_RESTART;
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
}

void Trainer::train() {
  const Config& c = config_;
  const bool writer = dist_.rank == 0;  // only rank 0 writes files
  ranks_share_failure(*comm_, "creating or locking the run directory", [&] {
    if (!writer) return;
    run_dir_create(c.run_dir);
    run_dir_lock_ = std::make_unique<RunDirLock>(c.run_dir);
    if (c.enable_checkpointing) checkpoint_check_saves_possible((std::filesystem::path(c.run_dir) / "checkpoints").string());
    // Only under the lock: without it another trainer's save could be in flight.
    if (run_dir_lock_->held()) {
      std::string removed;
      for (const auto& name : checkpoint_remove_unfinished((std::filesystem::path(c.run_dir) / "checkpoints").string()))
        removed += (removed.empty() ? "" : ", ") + name;
      if (!removed.empty()) spdlog::info("deleted what interrupted checkpoint saves left in {}/checkpoints: {}", c.run_dir, removed);
    }
  });
  // However train() ends, the lock goes only after a background save has ended: a trainer that
  // took the lock while it still wrote would delete its .tmp- directory as a leftover.
  struct LockRelease {
    std::unique_ptr<RunDirLock>& lock;
    std::unique_ptr<Checkpointer>& checkpointer;
    ~LockRelease() {
      if (checkpointer)
        if (const std::string error = checkpointer->wait(); !error.empty()) spdlog::error("{}", error);
      lock.reset();
    }
  } lock_release{run_dir_lock_, checkpointer_};
  const int64_t start_step = load_initial_state(StartingFor::kTraining);
  perf_startup_mark("resume");
  // As Megatron, the evaluations after training also follow an empty training loop: with
  // skip_train (--skip-train), and when a finished run is launched again with evaluation on.
  const bool trains = trains_from(start_step);
  const bool evaluates = c.eval_interval > 0 || c.skip_train;
  if (!trains && !evaluates) {
    spdlog::info("{} already reached step {} (steps = {}); nothing to do", initial_state_source_, start_step, c.steps);
    return;
  }
  ranks_share_failure(*comm_, "opening the run's files (config.yml, metrics_file, TensorBoard)", [&] {
    if (!writer) return;
    if (trains) {  // the config that trained (an evaluation alone leaves the run's)
      const std::string config_path = (std::filesystem::path(c.run_dir) / "config.yml").string();
      std::ofstream config_file(config_path);
      config_file << config_to_yaml(c);
      if (!config_file.flush()) throw Error(kExitFailure, "cannot write " + config_path);
    }
    logger_ = std::make_unique<MetricsLogger>(c, start_step, /*evaluation_only=*/!trains);
  });
  if (c.log_all_ranks) {  // every rank's own metrics (its step time and memory differ); a collective
    ranks_share_failure(*comm_, "opening the ranks' own metrics files (log_all_ranks)", [&] {
      if (writer) return;
      Config own = c;
      own.metrics_file = metrics_file_of_rank(c.run_dir, dist_.rank);
      own.enable_tensorboard = false;
      logger_ = std::make_unique<MetricsLogger>(own, start_step, /*evaluation_only=*/!trains);
    });
  }
  // At the start, not at the first evaluation: a split that leaves the validation set empty
  // would otherwise end the run after eval_interval steps, and every resume again.
  if (evaluates) eval_data_open(start_step);
  if (trains && c.enable_checkpointing && (writer || sharded_checkpoints()))
    checkpointer_ = std::make_unique<Checkpointer>(c);
  // A signal held during start-up (g_stop_mode) stops every rank here, before any work is lost.
  g_stop_mode = kStopAfterStep;
  if (ranks_reporting(g_stop_signal.load() != 0, comm_->host_group(), "the stop vote before the first step") > 0) {
    spdlog::warn("received {} during start-up: stopping before step {}, nothing to save; exiting",
                 stop_signal_name(g_stop_signal.load()), start_step);
    return;
  }
  spdlog::info("run_dir {} | model {}: {} parameters ({} active per token), {:.4g} TFLOP per step per device | "
               "device {} | global batch {} sequences x {} tokens, K = {} | {} normalization | {}",
               c.run_dir, c.model_name, size_.total_params, size_.active_params, size_.flops_per_step_per_device / 1e12,
               device_.str(), c.global_batch_size, c.max_target_length, c.gradient_accumulation_steps,
               c.calculate_per_token_loss ? "per-token (sum/sum)" : "Megatron (mean of micro-batch means)",
               trains ? fmt::format("steps {}..{}", start_step, c.steps - 1)
                      : fmt::format("no training ({}): evaluating the state after step {}",
                                    c.skip_train ? "skip_train" : "steps reached", start_step));

  // A failure in this rank's own work in the loop (writing metrics_file or TensorBoard, a
  // checkpoint rank 0 saves alone) is held until the next step's vote when other ranks run:
  // thrown at once, it would leave them waiting out collective_timeout_seconds in that step's
  // all-reduce and exiting 5 (a torchrun or srun launch has no mpirun to take them down). After
  // the vote every rank stops with the failed rank's exit code (ranks_share_failure); the failed
  // rank does no more work of its own meanwhile, and exits with its own error. One process (also
  // with a dist_backend named) has no one to wait: its failure is thrown at once.
  std::exception_ptr own_failure;
  auto own_work = [&](const std::function<void()>& work) {
    if (comm_->world_size() == 1) return work();
    if (own_failure) return;
    try {
      work();
    } catch (...) {
      own_failure = std::current_exception();
      failure_vote_ = true;
    }
  };
  auto share_own_failure = [&](const std::string& when) {
    ranks_share_failure(*comm_, "its own work (metrics, checkpoint) " + when,
                        [&] { if (own_failure) std::rethrow_exception(own_failure); });
  };

  using Clock = std::chrono::steady_clock;
  // Metrics of step t are read after step t+1 has been dispatched, so the read never stalls
  // the device queue; step t's time is the interval between the starts of t and t+1.
  std::optional<StepOutput> pending;
  Clock::time_point pending_start;
  double launch_to_first_step = 0;
  auto report = [&](StepOutput& out, Clock::time_point end) {
    out.step_time_seconds = std::chrono::duration<double>(end - pending_start).count();
    MetricValues values = read_metrics(out);
    if (out.step == start_step) values.emplace_back("perf/launch_to_first_step_seconds", launch_to_first_step);
    if (logger_) own_work([&] { logger_->log(out.step, values); });
    const bool nan = metric_get(values, "learning/is_nan") > 0, inf = metric_get(values, "learning/is_inf") > 0;
    if ((nan && c.abort_on_nan_loss) || (inf && c.abort_on_inf_loss)) {
      throw Error(kExitNumerical,
                  "step " + std::to_string(out.step) + ": " + (nan ? "NaN" : "Inf") +
                      " (learning/loss = " + std::to_string(metric_get(values, "learning/loss")) +
                      ", learning/raw_grad_norm = " + std::to_string(metric_get(values, "learning/raw_grad_norm")) +
                      "); global sample indices of the batch: " + index_ranges(out.sample_indices) +
                      ". Set abort_on_nan_loss/abort_on_inf_loss=false to continue.");
    }
  };
  // The last dispatched step's metrics, before an evaluation, a save or the end: its time ends
  // when the device has finished it (on a GPU the host is ahead of it; otherwise the evaluation
  // or save that follows would absorb its device time, and the next step would show only its
  // dispatch: a too-short step, MFU spiking past 1. Megatron stops its timer, with a
  // synchronize, before evaluating or saving too).
  auto flush = [&] {
    if (!pending) return;
    device_synchronize(device_);
    report(*pending, Clock::now());
    pending.reset();
  };
  // A save records the metrics first, so metrics.jsonl never runs behind a checkpoint.
  // All ranks call it (with ZeRO-1 the snapshot gathers the optimizer shards, with expert
  // parallelism the experts); rank 0 writes, or, with sharded levels, every rank its shard.
  auto save = [&](int64_t completed_steps, bool async) {
    flush();
    // No checkpoint ahead of metrics a rank failed to write (a sharded save would go on without it).
    share_own_failure("before checkpoint " + std::to_string(completed_steps));
    const auto log_blocked = [&](Clock::time_point begin) {
      spdlog::info("checkpoint {}: training blocked for {:.3f} s ({})", completed_steps,
                   std::chrono::duration<double>(Clock::now() - begin).count(), async ? "async" : "sync");
    };
    if (sharded_checkpoints()) {  // every rank saves and commits: a failed shard is the commit's to report
      checkpoint_commit(/*block=*/true, /*fatal=*/false);  // the previous save comes first
      const auto begin = Clock::now();
      checkpointer_->save(snapshot(completed_steps), async);
      if (!async) checkpoint_commit(/*block=*/true, /*fatal=*/true);
      return log_blocked(begin);
    }
    // So does the previous unsharded one: its snapshot and this one were both held (twice the
    // memory plan's snapshot) when checkpoint_period outran the disk.
    if (checkpointer_)
      if (const std::string error = checkpointer_->wait(); !error.empty()) spdlog::error("{}", error);
    const auto begin = Clock::now();
    if (checkpointer_ || snapshot_is_collective()) {
      auto contents = snapshot(completed_steps);
      if (checkpointer_) {
        own_work([&] { checkpointer_->save(std::move(contents), async); });
        if (!own_failure) log_blocked(begin);
      }
    }
    // This blocks rank 0 alone (the write, or the previous save's), for longer than
    // collective_timeout_seconds with a large model: the other ranks wait for it here, not in their
    // next collective (where they would exit 5 as if rank 0 had died).
    comm_->wait_for_rank0("checkpoint " + std::to_string(completed_steps) + " handed to the writer",
                          "saving checkpoint " + std::to_string(completed_steps));
  };
  if (trains && c.enable_checkpointing && c.save_checkpoint_on_start && start_step == 0) save(0, c.async_checkpointing);
  if (trains)
    prefetcher_ = std::make_unique<DataPrefetcher>(data_, start_step, c.steps, c.gradient_accumulation_steps,
                                                   static_cast<size_t>(2 * c.gradient_accumulation_steps));
  // Megatron's validation schedule: one evaluation every eval_interval steps and one after
  // training and its final checkpoint, even when the last step just had one, each on the next
  // eval_steps global batches of the valid split (its position, consumed_valid_samples, is in the
  // checkpoints); then one on the test split's first eval_steps global batches. False when a
  // stop signal dropped the evaluation (all ranks agree); a dropped (or skipped) one's batches are
  // passed over all the same: Megatron finishes an evaluation before it stops, reading them.
  // The next validation evaluation's first global batch, its batches counted as read: from the
  // next whole global batch (a load_full_state_path of a run with another global batch can leave
  // the position between two).
  auto take_validation_batches = [&] {
    const int64_t first_batch = (eval_consumed_samples_ + c.global_batch_size - 1) / c.global_batch_size;
    eval_consumed_samples_ = (first_batch + c.eval_steps) * c.global_batch_size;
    return first_batch;
  };
  auto run_eval = [&](int64_t completed, EvalPhase phase) {
    flush();
    const auto values = phase == EvalPhase::kTestAfterTraining
                            ? evaluate(DataSplit::kTest, 0, /*announce=*/true)
                            : evaluate(DataSplit::kValid, take_validation_batches(),
                                       /*announce=*/phase == EvalPhase::kValidAfterTraining);
    if (values && logger_) own_work([&] { logger_->log_eval(completed - 1, *values, phase); });
    return values.has_value();
  };

  int64_t steps_done = start_step;  // below c.steps after a stop signal
  bool stopped = false;              // by a stop signal (at the last step too)
  for (int64_t step = start_step; trains && step < c.steps; ++step) {
    const auto start = Clock::now();
    stop_vote_ = g_stop_signal.load() != 0;
    StepOutput out = c.debug_cuda_sync_check && step > start_step ? train_step_without_syncs(step) : train_step(step);
    if (step == start_step) {  // once: wait for the first step to finish, to time the startup
      (void)out.loss.item<double>();
      perf_startup_mark("first step");
      launch_to_first_step = perf_process_age_seconds();
      spdlog::info("startup: {}", perf_startup_summary());
    }
    if (out.failure_reported) share_own_failure("before step " + std::to_string(step));
    const bool stop = out.stop_requested;  // agreed by all ranks in the step's all-reduce
    if (pending) report(*pending, start);
    pending = std::move(out);
    pending_start = start;

    const int64_t completed = step + 1;
    steps_done = completed;
    int signal = stop ? std::max(g_stop_signal.load(), 1) : 0;
    if (c.eval_interval > 0 && completed % c.eval_interval == 0) {
      if (signal)  // skipped; its batches count as read, as for a dropped one
        take_validation_batches();
      else if (!run_eval(completed, EvalPhase::kInLoop))
        signal = std::max(g_stop_signal.load(), 1);
    }
    const bool final_step = completed == c.steps || signal != 0;
    if (c.enable_checkpointing &&
        (completed % c.checkpoint_period == 0 || (final_step && (c.save_checkpoint_on_completion || signal))))
      save(completed, c.async_checkpointing && !final_step);
    checkpoint_commit(/*block=*/false, /*fatal=*/false);  // a sharded save whose writes have all ended
    if (signal != 0) {
      flush();
      spdlog::warn("received {}: stopped after step {}{}; exiting",
                   stop_signal_name(signal), step,
                   checkpointer_          ? ", checkpoint " + std::to_string(completed) + " saved"
                   : dist_.rank > 0 ? " (rank 0 saves the checkpoint)"
                                    : " (checkpointing disabled)");
      stopped = true;
      break;
    }
  }
  flush();
  share_own_failure("after the last step");
  prefetcher_.reset();
  // After the final checkpoint, as Megatron: a stop signal during these evaluations drops them and
  // loses no training state.
  bool evaluated = false;  // the evaluations after training, not dropped by a stop signal
  if (evaluates && (steps_done == c.steps || !trains) && !stopped) {
    evaluated = run_eval(steps_done, EvalPhase::kValidAfterTraining) &&
                (!test_data_ || run_eval(steps_done, EvalPhase::kTestAfterTraining));
    share_own_failure("after the evaluations after training");
  }
  checkpoint_commit(/*block=*/true, /*fatal=*/true);
  if (checkpointer_) {
    const std::string error = checkpointer_->wait();
    if (!error.empty()) throw Error(kExitFailure, error);
  }
  if (!trains && evaluated)
    spdlog::info("done: evaluated the state after step {} (no training), metrics in {}", start_step, c.metrics_file);
  else if (!trains)
    spdlog::info("stopped: the evaluations of the state after step {} were dropped (no training)", start_step);
  else if (steps_done == c.steps)
    spdlog::info("done: {} steps, {} updates applied, metrics in {}", c.steps, updates_applied_, c.metrics_file);
  else
    spdlog::info("stopped: {} of {} steps, {} updates applied, metrics in {}", steps_done, c.steps, updates_applied_,
                 c.metrics_file);
}

}  // namespace trainer
