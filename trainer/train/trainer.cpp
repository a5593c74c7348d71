// Trainer: builds the model and its flat fp32 parameter/gradient buffers, runs the loop, applies
// AdamW on the flat buffers, guards against spikes and non-finite steps, and reports metrics.
#include <sys/resource.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <atomic>
#include <csignal>
#include <map>
#include <sstream>
#include <limits>
#include <numeric>
#include <optional>

#include <spdlog/spdlog.h>

#include "trainer/train/train.h"
#include "trainer/util/error.h"

namespace trainer {
namespace {

// Every rank must train the same config. Rank 0's run name (which may carry a timestamp) is
// adopted; any other difference is an error naming the first differing key.
const Config& agree_on_config(Config& c, const DistEnv& env, Communicator& comm) {
  if (comm.world_size() == 1) return c;
  if (env.world_size != c.data_parallel_size)
    throw config_error("the config was resolved for " + std::to_string(c.data_parallel_size) + " ranks, but " +
                       env.launcher + " started " + std::to_string(env.world_size));
  c.run_name = comm.broadcast_string("run_name", c.run_name);
  c.metrics_file = comm.broadcast_string("metrics_file", c.metrics_file);
  c.run_dir = comm.broadcast_string("run_dir", c.run_dir);
  const std::string mine = config_to_yaml(c), theirs = comm.broadcast_string("config", mine);
  if (mine != theirs) {
    std::istringstream a(mine), b(theirs);
    for (std::string x, y; std::getline(a, x) && std::getline(b, y);)
      if (x != y)
        throw config_error("rank " + std::to_string(env.rank) + " has a different config than rank 0: '" + x +
                           "' here, '" + y + "' on rank 0");
  }
  if (env.rank > 0) {
    spdlog::set_level(spdlog::level::warn);  // only rank 0 reports progress
    spdlog::set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%l] [rank " + std::to_string(env.rank) + "] %v");
  }
  return c;
}

torch::Device select_device(const Config& c) {
  if (c.hardware == "gpu") {
    if (!torch::cuda::is_available())
      throw config_error("hardware=gpu, but this LibTorch build sees no CUDA device");
    return torch::Device(torch::kCUDA, 0);
  }
  return torch::Device(torch::kCPU);
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

std::pair<double, double> mean_and_std(const std::deque<double>& values) {
  const double n = static_cast<double>(values.size());
  const double mean = std::accumulate(values.begin(), values.end(), 0.0) / n;
  double var = 0;
  for (double v : values) var += (v - mean) * (v - mean);
  return {mean, std::sqrt(var / n)};
}

}  // namespace

Trainer::Trainer(Config config)
    : config_(std::move(config)),
      dist_(dist_env_resolve()),
      comm_(dist_init(dist_, config_.collective_timeout_seconds)),
      device_(select_device(config_)),
      data_(agree_on_config(config_, dist_, *comm_), dist_.rank),
      size_(model_size(config_)) {
  if (config_.num_threads > 0) torch::set_num_threads(static_cast<int>(config_.num_threads));
  // Nothing in a step draws from the global generator today; seeding it anyway makes its state
  // (saved in checkpoints) a function of the config, so future random ops resume bit-exactly.
  torch::manual_seed(static_cast<uint64_t>(config_.init_weights_seed));
  model_ = model_build(config_);
  model_->to(device_);
  build_flat_buffers();
}

Trainer::~Trainer() = default;

// Moves every parameter into one contiguous fp32 arena and makes each .grad a view into a
// second arena. Autograd then accumulates in place (AccumulateGrad adds into an existing
// .grad when grad mode is off, as it is during backward), so K micro-batches use exactly one
// gradient buffer, and the collective, norm, zero count, clipping and AdamW each run once on
// the whole buffer.
void Trainer::build_flat_buffers() {
  auto params = model_->parameters();
  int64_t total = 0;
  for (const auto& p : params) total += p.numel();
  const auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(device_);
  flat_params_ = torch::empty({total}, opts);
  flat_grads_ = torch::zeros({total}, opts);
  torch::NoGradGuard no_grad;
  int64_t offset = 0;
  for (auto& p : params) {
    const int64_t n = p.numel();
    auto param_view = flat_params_.narrow(0, offset, n).view(p.sizes());
    param_view.copy_(p);
    p.set_data(param_view);
    p.mutable_grad() = flat_grads_.narrow(0, offset, n).view(p.sizes());
    offset += n;
  }
  // ZeRO-1: rank r keeps AdamW state for elements [r*chunk, (r+1)*chunk) only.
  const int64_t ranks = config_.shard_optimizer_over_data ? comm_->world_size() : 1;
  const int64_t chunk = (total + ranks - 1) / ranks;
  shard_begin_ = std::min(total, (ranks > 1 ? comm_->rank() : 0) * chunk);
  shard_end_ = std::min(total, shard_begin_ + chunk);
  const int64_t shard = shard_end_ - shard_begin_;
  adam_m_ = torch::zeros({shard}, opts);
  adam_v_ = torch::zeros({shard}, opts);
  adam_scratch_ = torch::empty({shard}, opts);
  if (sharded()) gather_buffer_ = torch::empty({total}, opts);
  spdlog::info("AdamW state: {:.1f} MiB on this rank{} ({:.1f} MiB without sharding)", 2.0 * 4 * shard / (1 << 20),
               sharded() ? " (ZeRO-1 over " + std::to_string(ranks) + " ranks)" : "", 2.0 * 4 * total / (1 << 20));
}

bool Trainer::spike_guard_rejects(double loss, double grad_norm) {
  if (!std::isfinite(loss) || !std::isfinite(grad_norm)) return true;
  const auto interval = static_cast<size_t>(config_.skip_step_interval);
  bool spike = false;
  if (spike_losses_.size() >= interval) {  // judged only against a full window
    const double f = config_.skip_step_scaling_factor;
    const auto [loss_mean, loss_std] = mean_and_std(spike_losses_);
    const auto [norm_mean, norm_std] = mean_and_std(spike_grad_norms_);
    spike = loss > loss_mean + f * loss_std || grad_norm > norm_mean + f * norm_std;
  }
  if (!spike) {
    spike_losses_.push_back(loss);
    spike_grad_norms_.push_back(grad_norm);
    while (spike_losses_.size() > interval) spike_losses_.pop_front(), spike_grad_norms_.pop_front();
  }
  return spike;
}

void Trainer::optimizer_update(StepOutput& out) {
  const Config& c = config_;
  torch::NoGradGuard no_grad;
  out.learning_rate = learning_rate_at(c, updates_applied_);
  const int64_t collectives_before = comm_->collectives();
  bool skip = out.total_weights == 0;
  if (out.total_weights == 0)
    spdlog::warn("step {}: no unmasked target token in the whole batch (W = 0); update skipped", out.step);
  if (!skip && c.skip_step_on_spikes) {
    // The guard needs this step's values on the host: one sync per step, only when enabled.
    const auto host = torch::stack({out.loss.to(torch::kFloat64), out.raw_grad_norm.to(torch::kFloat64)}).cpu();
    skip = spike_guard_rejects(host[0].item<double>(), host[1].item<double>());
  }
  // Global-norm clipping (optax.clip_by_global_norm): g *= min(1, threshold / ||g||).
  if (c.gradient_clipping_threshold > 0) {
    const auto factor = out.raw_grad_norm.reciprocal().mul(c.gradient_clipping_threshold).clamp_max(1.0);
    flat_grads_.mul_(factor);
    out.grad_norm = out.raw_grad_norm * factor;
  } else {
    out.grad_norm = out.raw_grad_norm;
  }
  if (!skip) {
    // AdamW as optax.adamw: m, v with bias correction, eps outside the sqrt, decoupled weight
    // decay scaled by the learning rate:  p -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * p).
    const double t = static_cast<double>(updates_applied_ + 1);
    const double bias1 = 1.0 - std::pow(c.adam_b1, t);
    const double bias2 = 1.0 - std::pow(c.adam_b2, t);
    const double lr = out.learning_rate;
    const int64_t n = shard_end_ - shard_begin_;
    const auto grads = flat_grads_.narrow(0, shard_begin_, n);
    auto params = flat_params_.narrow(0, shard_begin_, n);
    adam_m_.lerp_(grads, 1.0 - c.adam_b1);
    adam_v_.mul_(c.adam_b2).addcmul_(grads, grads, 1.0 - c.adam_b2);
    torch::sqrt_out(adam_scratch_, adam_v_);
    adam_scratch_.div_(std::sqrt(bias2)).add_(c.adam_eps);
    params.mul_(1.0 - lr * c.adam_weight_decay);
    params.addcdiv_(adam_m_, adam_scratch_, -lr / bias1);
    if (sharded()) gather_shards(params, flat_params_, "the updated parameters");  // ZeRO-1 all-gather
    ++updates_applied_;
    update_expert_bias(out);
  }
  out.step_skipped = skip;
  out.collectives += comm_->collectives() - collectives_before;  // the ZeRO-1 gather, if any
  out.param_norm = flat_params_.norm();
}

// Aux-loss-free balancing (DeepSeek-V3): after an applied update, each MoE layer's selection
// bias moves by routed_bias_update_rate toward balance: up for experts below the mean load, down
// for those above. The load is the step's counts averaged over micro-batches, so K does not
// scale the update.
void Trainer::update_expert_bias(const StepOutput& out) {
  const Config& c = config_;
  if (!c.routed_bias || c.routed_bias_update_rate <= 0 || !out.expert_load.defined()) return;
  auto layers = model_->moe_layers();
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto load = out.expert_load[static_cast<int64_t>(i)];  // (E)
    layers[i]->gate->e_score_correction_bias.add_(torch::sign(load.mean() - load), c.routed_bias_update_rate);
  }
}

void Trainer::gather_shards(const torch::Tensor& shard, torch::Tensor& full, const std::string& what) {
  gather_buffer_.zero_();
  gather_buffer_.narrow(0, shard_begin_, shard_end_ - shard_begin_).copy_(shard);
  const int64_t bucket = config_.gradient_bucket_size_mb * (1 << 20) / 4;
  for (int64_t offset = 0; offset < gather_buffer_.numel(); offset += bucket) {
    auto view = gather_buffer_.narrow(0, offset, std::min(bucket, gather_buffer_.numel() - offset));
    comm_->all_reduce_sum(view, what + " (ZeRO-1 gather) at element " + std::to_string(offset));
  }
  full.copy_(gather_buffer_);
}

StepOutput Trainer::train_step(int64_t step) {
  StepOutput out = forward_backward(step);
  optimizer_update(out);
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
                                        f64(out.mtp_loss_raw), f64(out.moe_router_z_loss)};
  const bool moe = out.expert_load.defined();
  if (moe) {  // imbalance: max over experts / mean over experts, averaged over MoE layers
    const auto load = out.expert_load.to(torch::kFloat64);
    scalars.push_back((std::get<0>(load.max(1)) / load.mean(1).clamp_min(1e-12)).mean());
  }
  const auto host = torch::stack(scalars).cpu();
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
      {"learning/num_zeros", v[8]},
      {"learning/is_nan", (std::isnan(loss) || std::isnan(raw_grad_norm)) ? 1.0 : 0.0},
      {"learning/is_inf", (std::isinf(loss) || std::isinf(raw_grad_norm)) ? 1.0 : 0.0},
      {"learning/current_learning_rate", out.learning_rate},
      {"optim/step_skipped", out.step_skipped ? 1.0 : 0.0},
      {"perf/step_time_seconds", seconds},
      {"perf/data_wait_seconds", out.data_wait_seconds},
      {"perf/collectives_per_step", static_cast<double>(out.collectives)},
      {"perf/grad_sync_seconds", out.grad_sync_seconds},
      {"perf/per_device_tokens_per_sec", seconds > 0 ? tokens / seconds : 0.0},
      {"perf/per_device_tflops_per_sec", seconds > 0 ? size_.flops_per_step_per_device / seconds / 1e12 : 0.0},
  };
  if (moe) values.emplace_back("moe/expert_load_max_over_mean", v[11]);
  // MFU only against a known peak (peak_tflops_per_device); otherwise it is left out, not guessed.
  if (config_.peak_tflops_per_device > 0 && seconds > 0)
    values.emplace_back("perf/mfu", size_.flops_per_step_per_device / seconds / 1e12 / config_.peak_tflops_per_device);
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  values.emplace_back("memory/peak_rss_bytes", static_cast<double>(usage.ru_maxrss) * 1024.0);
  return values;
}

NamedTensors Trainer::model_tensors() const {
  NamedTensors out;
  for (const auto& item : model_->named_parameters()) out.emplace_back(item.key(), item.value());
  for (const auto& item : model_->named_buffers()) out.emplace_back(item.key(), item.value());
  return out;
}

CheckpointContents Trainer::snapshot(int64_t completed_steps) {
  torch::NoGradGuard no_grad;
  CheckpointContents c;
  // One copy per flat buffer; the named tensors are views into those copies.
  const auto params = flat_params_.to(torch::kCPU, /*non_blocking=*/false, /*copy=*/true);
  torch::Tensor m, v;  // (P) full moments; with ZeRO-1 assembled from every rank (a collective)
  if (sharded()) {
    auto full = torch::empty_like(flat_params_);
    gather_shards(adam_m_, full, "the AdamW first moments");
    m = full.to(torch::kCPU, false, true);
    gather_shards(adam_v_, full, "the AdamW second moments");
    v = full.to(torch::kCPU, false, true);
  } else {
    m = adam_m_.to(torch::kCPU, false, true), v = adam_v_.to(torch::kCPU, false, true);
  }
  int64_t offset = 0;
  NamedTensors exp_avg, exp_avg_sq;
  for (const auto& item : model_->named_parameters()) {
    const auto n = item.value().numel();
    const auto shape = item.value().sizes();
    c.model.emplace_back(item.key(), params.narrow(0, offset, n).view(shape));
    exp_avg.emplace_back("exp_avg." + item.key(), m.narrow(0, offset, n).view(shape));
    exp_avg_sq.emplace_back("exp_avg_sq." + item.key(), v.narrow(0, offset, n).view(shape));
    offset += n;
  }
  for (const auto& item : model_->named_buffers())
    c.model.emplace_back(item.key(), item.value().to(torch::kCPU, torch::kFloat32, false, true).contiguous());
  c.optimizer = std::move(exp_avg);
  c.optimizer.insert(c.optimizer.end(), exp_avg_sq.begin(), exp_avg_sq.end());
  c.state.step = completed_steps;
  c.state.updates_applied = updates_applied_;
  c.state.consumed_samples = completed_steps * config_.global_batch_size;
  c.state.spike_losses.assign(spike_losses_.begin(), spike_losses_.end());
  c.state.spike_grad_norms.assign(spike_grad_norms_.begin(), spike_grad_norms_.end());
  const auto rng = at::detail::getDefaultCPUGenerator().get_state();
  static const char* digits = "0123456789abcdef";
  for (int64_t i = 0; i < rng.numel(); ++i) {
    const auto byte = rng.data_ptr<uint8_t>()[i];
    c.state.cpu_rng_state += digits[byte >> 4];
    c.state.cpu_rng_state += digits[byte & 15];
  }
  c.state.world_size = config_.data_parallel_size;
  c.config_yaml = config_to_yaml(config_);
  c.state.config_hash = checkpoint_hash_text(c.config_yaml);
  return c;
}

// Copies checkpoint tensors into the model (and, for a full state, the optimizer and counters).
// Names and shapes must match exactly; every difference is listed (exit code 2).
void Trainer::restore(const CheckpointContents& c, bool full_state, const std::string& source) {
  torch::NoGradGuard no_grad;
  std::map<std::string, torch::Tensor> saved(c.model.begin(), c.model.end());
  std::vector<std::string> problems;
  for (auto& [name, tensor] : model_tensors()) {
    auto it = saved.find(name);
    const bool is_buffer = !model_->named_parameters().contains(name);
    if (it == saved.end()) {
      if (!is_buffer || full_state) problems.push_back("missing " + name);
      continue;
    }
    if (it->second.sizes() != tensor.sizes()) {
      std::ostringstream msg;
      msg << name << " has shape " << it->second.sizes() << " in the checkpoint, " << tensor.sizes() << " in the model";
      problems.push_back(msg.str());
    } else {
      tensor.copy_(it->second);
    }
    saved.erase(it);
  }
  for (const auto& [name, tensor] : saved) problems.push_back("unexpected " + name);
  if (!problems.empty()) {
    std::string message = source + " does not match the model of this config:";
    for (size_t i = 0; i < problems.size() && i < 20; ++i) message += "\n  - " + problems[i];
    if (problems.size() > 20) message += "\n  - ... and " + std::to_string(problems.size() - 20) + " more";
    throw config_error(message);
  }
  if (!full_state) return;
  std::map<std::string, torch::Tensor> moments(c.optimizer.begin(), c.optimizer.end());
  auto full_m = torch::empty_like(flat_params_), full_v = torch::empty_like(flat_params_);  // (P)
  int64_t offset = 0;
  for (const auto& item : model_->named_parameters()) {
    const auto n = item.value().numel();
    for (auto [prefix, flat] : {std::pair{"exp_avg.", full_m}, std::pair{"exp_avg_sq.", full_v}}) {
      auto it = moments.find(prefix + item.key());
      if (it == moments.end() || it->second.numel() != n)
        throw config_error(source + ": optimizer state lacks " + prefix + item.key() + " or its shape differs");
      flat.narrow(0, offset, n).copy_(it->second.reshape({n}));
    }
    offset += n;
  }
  // Checkpoints hold the full moments, so any world size and sharding can load them.
  adam_m_.copy_(full_m.narrow(0, shard_begin_, shard_end_ - shard_begin_));
  adam_v_.copy_(full_v.narrow(0, shard_begin_, shard_end_ - shard_begin_));
  if (c.state.world_size != config_.data_parallel_size)
    spdlog::warn("{} was written with {} ranks, resuming with {}", source, c.state.world_size, config_.data_parallel_size);
  updates_applied_ = c.state.updates_applied;
  spike_losses_.assign(c.state.spike_losses.begin(), c.state.spike_losses.end());
  spike_grad_norms_.assign(c.state.spike_grad_norms.begin(), c.state.spike_grad_norms.end());
  if (!c.state.cpu_rng_state.empty()) {
    auto rng = torch::empty({static_cast<int64_t>(c.state.cpu_rng_state.size() / 2)}, torch::kUInt8);
    for (int64_t i = 0; i < rng.numel(); ++i)
      rng.data_ptr<uint8_t>()[i] = static_cast<uint8_t>(std::stoi(c.state.cpu_rng_state.substr(2 * i, 2), nullptr, 16));
    auto generator = at::detail::getDefaultCPUGenerator();
    generator.set_state(rng);
  }
  const std::string current_yaml = config_to_yaml(config_);
  if (checkpoint_hash_text(current_yaml) != c.state.config_hash) {
    // Name the keys that changed (steps or log_period may legitimately change on resume).
    std::map<std::string, std::string> before, after;
    auto parse = [](const std::string& yaml, std::map<std::string, std::string>& out) {
      std::istringstream in(yaml);
      for (std::string line; std::getline(in, line);)
        if (const auto colon = line.find(": "); colon != std::string::npos && line[0] != '#')
          out[line.substr(0, colon)] = line.substr(colon + 2);
    };
    parse(c.config_yaml, before);
    parse(current_yaml, after);
    std::string changed;
    for (const auto& [key, value] : after)
      if (before.count(key) && before[key] != value) changed += (changed.empty() ? "" : ", ") + key + " " + before[key] + " -> " + value;
    if (!changed.empty()) spdlog::warn("resuming with a config that differs from the checkpoint's: {}", changed);
  }
}

int64_t Trainer::load_initial_state() {
  const Config& c = config_;
  const auto own = checkpoint_find_latest((std::filesystem::path(c.run_dir) / "checkpoints").string());
  if (own) {
    const auto contents = checkpoint_load(*own);
    restore(contents, /*full_state=*/true, "checkpoint " + *own);
    spdlog::info("resumed from checkpoint {} (step {}, {} updates applied)", *own, contents.state.step,
                 contents.state.updates_applied);
    return contents.state.step;
  }
  if (!c.load_full_state_path.empty()) {
    const auto contents = checkpoint_load(c.load_full_state_path);
    restore(contents, /*full_state=*/true, "load_full_state_path " + c.load_full_state_path);
    spdlog::info("loaded full state from {} (step {})", c.load_full_state_path, contents.state.step);
    return contents.state.step;
  }
  if (!c.load_parameters_path.empty()) {
    std::string file = c.load_parameters_path;
    if (std::filesystem::is_directory(file)) file = (std::filesystem::path(file) / "model.safetensors").string();
    if (!std::filesystem::exists(file)) throw config_error("load_parameters_path: no file " + file);
    CheckpointContents weights;
    weights.model = checkpoint_read_tensors(file);
    restore(weights, /*full_state=*/false, "load_parameters_path " + file);
    spdlog::info("loaded weights from {}; optimizer and step start fresh", file);
  }
  return 0;
}

void Trainer::export_model(const std::string& path) {
  const auto c = snapshot(0);
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  try {
    checkpoint_write_tensors(path, c.model);
  } catch (const std::exception& e) {
    throw Error(kExitFailure, std::string("cannot export weights: ") + e.what());
  }
}

MetricValues Trainer::evaluate(int64_t index) {
  const Config& c = config_;
  if (!eval_data_) {
    // Megatron's validation size: (steps / eval_interval + 1) * eval_steps global batches.
    const int64_t interval = std::max<int64_t>(c.eval_interval, 1);
    const int64_t samples = (c.steps / interval + 1) * c.eval_steps * c.global_batch_size;
    std::shared_ptr<SampleSource> source;
    if (c.dataset_type == "synthetic") {
      Config shifted = c;
      shifted.data_shuffle_seed = c.data_shuffle_seed + 1;  // disjoint from the training samples
      source = std::make_shared<SyntheticDataset>(shifted);
    } else {
      source = megatron_source(c, DataSplit::kValid, samples, dist_.rank);
    }
    eval_data_ = std::make_unique<DataLoader>(c, dist_.rank, std::move(source));
  }
  torch::NoGradGuard no_grad;
  double ce = 0, weights = 0;
  for (int64_t s = 0; s < c.eval_steps; ++s)
    for (int64_t micro = 0; micro < c.gradient_accumulation_steps; ++micro) {
      const auto batch = eval_data_->data_loader_next(index * c.eval_steps + s, micro);
      const auto m = micro_batch_losses(model_, batch, c, device_);
      ce += (m.ce - m.z).item<double>();  // cross-entropy only (no z-loss), token-weighted
      weights += m.weights;
    }
  auto sums = torch::tensor({ce, weights}, torch::kFloat64);
  comm_->all_reduce_sum(sums, "the evaluation loss sums");
  ce = sums[0].item<double>(), weights = sums[1].item<double>();
  const double lm_loss = weights > 0 ? ce / weights : 0.0;
  return {{"eval/lm_loss", lm_loss}, {"eval/perplexity", std::exp(lm_loss)}, {"eval/total_weights", weights}};
}

namespace {
// SIGTERM/SIGINT: the first one asks the loop to finish the step, save and exit 0; a second
// one exits at once (code 1) without saving.
std::atomic<int> g_stop_signal{0};
extern "C" void on_stop_signal(int signo) {
  if (g_stop_signal.exchange(signo) != 0) std::_Exit(kExitFailure);
}
void install_stop_handlers() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);
}
}  // namespace

void Trainer::train() {
  const Config& c = config_;
  const int64_t start_step = load_initial_state();
  if (start_step >= c.steps) {
    spdlog::info("run_dir {} already reached step {} (steps = {}); nothing to do", c.run_dir, start_step, c.steps);
    return;
  }
  const bool writer = dist_.rank == 0;  // only rank 0 writes files
  if (writer) {
    std::filesystem::create_directories(c.run_dir);
    std::ofstream(std::filesystem::path(c.run_dir) / "config.yml") << config_to_yaml(c);
    logger_ = std::make_unique<MetricsLogger>(c, start_step);
    if (c.enable_checkpointing) checkpointer_ = std::make_unique<Checkpointer>(c);
  }
  install_stop_handlers();
  if (c.peak_tflops_per_device <= 0)
    spdlog::info("perf/mfu is not reported: the device's peak TFLOP/s is unknown (set peak_tflops_per_device)");
  spdlog::info("run_dir {} | model {}: {} parameters ({} active per token), {:.4g} TFLOP per step per device | "
               "device {} | global batch {} sequences x {} tokens, K = {} | {} normalization | steps {}..{}",
               c.run_dir, c.model_name, size_.total_params, size_.active_params, size_.flops_per_step_per_device / 1e12,
               device_.str(), c.global_batch_size, c.max_target_length, c.gradient_accumulation_steps,
               c.calculate_per_token_loss ? "per-token (sum/sum)" : "Megatron (mean of micro-batch means)",
               start_step, c.steps - 1);

  using Clock = std::chrono::steady_clock;
  // Metrics of step t are read after step t+1 has been dispatched, so the read never stalls
  // the device queue; step t's time is the interval between the starts of t and t+1.
  std::optional<StepOutput> pending;
  Clock::time_point pending_start;
  auto report = [&](StepOutput& out, Clock::time_point end) {
    out.step_time_seconds = std::chrono::duration<double>(end - pending_start).count();
    const MetricValues values = read_metrics(out);
    if (logger_) logger_->log(out.step, values);
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
  auto flush = [&](Clock::time_point end) {
    if (pending) report(*pending, end);
    pending.reset();
  };
  // A save records the metrics first, so metrics.jsonl never runs behind a checkpoint.
  // All ranks call it (with ZeRO-1 the snapshot gathers the optimizer shards); rank 0 writes.
  auto save = [&](int64_t completed_steps, bool async) {
    flush(Clock::now());
    if (!checkpointer_ && !sharded()) return;
    const auto begin = Clock::now();
    auto contents = snapshot(completed_steps);
    if (!checkpointer_) return;
    checkpointer_->save(std::move(contents), async);
    spdlog::info("checkpoint {}: training blocked for {:.3f} s ({})", completed_steps,
                 std::chrono::duration<double>(Clock::now() - begin).count(), async ? "async" : "sync");
  };
  if (c.enable_checkpointing && c.save_checkpoint_on_start && start_step == 0) save(0, c.async_checkpointing);
  prefetcher_ = std::make_unique<DataPrefetcher>(data_, start_step, c.steps, c.gradient_accumulation_steps,
                                                 static_cast<size_t>(2 * c.gradient_accumulation_steps));
  auto run_eval = [&](int64_t completed) {
    flush(Clock::now());
    const MetricValues values = evaluate(completed / c.eval_interval - 1 + (completed % c.eval_interval != 0));
    if (logger_) logger_->log_eval(completed - 1, values);
  };

  for (int64_t step = start_step; step < c.steps; ++step) {
    const auto start = Clock::now();
    stop_vote_ = g_stop_signal.load() != 0;
    StepOutput out = train_step(step);
    const bool stop = out.stop_requested;  // agreed by all ranks in the step's all-reduce
    if (pending) report(*pending, start);
    pending = std::move(out);
    pending_start = start;

    const int64_t completed = step + 1;
    const int signal = stop ? std::max(g_stop_signal.load(), 1) : 0;
    const bool final_step = completed == c.steps || signal != 0;
    if (c.eval_interval > 0 && (completed % c.eval_interval == 0 || completed == c.steps)) run_eval(completed);
    if (c.enable_checkpointing &&
        (completed % c.checkpoint_period == 0 || (final_step && (c.save_checkpoint_on_completion || signal))))
      save(completed, c.async_checkpointing && !final_step);
    if (signal != 0) {
      flush(Clock::now());
      spdlog::warn("received {}: stopped after step {}{}; exiting",
                   signal == SIGTERM ? "SIGTERM" : signal == SIGINT ? "SIGINT" : "a stop signal on another rank", step,
                   checkpointer_          ? ", checkpoint " + std::to_string(completed) + " saved"
                   : dist_.rank > 0 ? " (rank 0 saves the checkpoint)"
                                    : " (checkpointing disabled)");
      break;
    }
  }
  flush(Clock::now());
  prefetcher_.reset();
  if (checkpointer_) {
    const std::string error = checkpointer_->wait();
    if (!error.empty()) throw Error(kExitFailure, error);
  }
  spdlog::info("done: {} steps, {} updates applied, metrics in {}", c.steps, updates_applied_, c.metrics_file);
}

}  // namespace trainer
