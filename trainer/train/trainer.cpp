// Trainer: builds the model and its flat fp32 parameter/gradient buffers, runs the loop, applies
// AdamW on the flat buffers, guards against spikes and non-finite steps, and reports metrics.
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numeric>
#include <optional>

#include <spdlog/spdlog.h>

#include "trainer/train/train.h"
#include "trainer/util/error.h"

namespace trainer {
namespace {

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
      device_(select_device(config_)),
      data_(config_, /*rank=*/0),
      size_(model_size(config_)) {
  if (config_.num_threads > 0) torch::set_num_threads(static_cast<int>(config_.num_threads));
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
  adam_m_ = torch::zeros({total}, opts);
  adam_v_ = torch::zeros({total}, opts);
  adam_scratch_ = torch::empty({total}, opts);
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
    adam_m_.lerp_(flat_grads_, 1.0 - c.adam_b1);
    adam_v_.mul_(c.adam_b2).addcmul_(flat_grads_, flat_grads_, 1.0 - c.adam_b2);
    torch::sqrt_out(adam_scratch_, adam_v_);
    adam_scratch_.div_(std::sqrt(bias2)).add_(c.adam_eps);
    flat_params_.mul_(1.0 - lr * c.adam_weight_decay);
    flat_params_.addcdiv_(adam_m_, adam_scratch_, -lr / bias1);
    ++updates_applied_;
    update_expert_bias(out);
  }
  out.step_skipped = skip;
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
      {"perf/per_device_tokens_per_sec", seconds > 0 ? tokens / seconds : 0.0},
      {"perf/per_device_tflops_per_sec", seconds > 0 ? size_.flops_per_step_per_device / seconds / 1e12 : 0.0},
  };
  if (moe) values.emplace_back("moe/expert_load_max_over_mean", v[11]);
  return values;
}

void Trainer::train() {
  const Config& c = config_;
  std::filesystem::create_directories(c.run_dir);
  std::ofstream(std::filesystem::path(c.run_dir) / "config.yml") << config_to_yaml(c);
  logger_ = std::make_unique<MetricsLogger>(c);
  spdlog::info("run_dir {} | model {}: {} parameters ({} active per token), {:.4g} TFLOP per step per device | "
               "device {} | global batch {} sequences x {} tokens, K = {} | {} normalization",
               c.run_dir, c.model_name, size_.total_params, size_.active_params, size_.flops_per_step_per_device / 1e12,
               device_.str(), c.global_batch_size, c.max_target_length, c.gradient_accumulation_steps,
               c.calculate_per_token_loss ? "per-token (sum/sum)" : "Megatron (mean of micro-batch means)");

  using Clock = std::chrono::steady_clock;
  // Metrics of step t are read after step t+1 has been dispatched, so the read never stalls
  // the device queue; step t's time is the interval between the starts of t and t+1.
  std::optional<StepOutput> pending;
  Clock::time_point pending_start;
  auto report = [&](StepOutput& out, Clock::time_point end) {
    out.step_time_seconds = std::chrono::duration<double>(end - pending_start).count();
    const MetricValues values = read_metrics(out);
    logger_->log(out.step, values);
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
  for (int64_t step = 0; step < c.steps; ++step) {
    const auto start = Clock::now();
    StepOutput out = train_step(step);
    if (pending) report(*pending, start);
    pending = std::move(out);
    pending_start = start;
  }
  if (pending) report(*pending, Clock::now());
  spdlog::info("done: {} steps, {} updates applied, metrics in {}", c.steps, updates_applied_, c.metrics_file);
}

}  // namespace trainer
