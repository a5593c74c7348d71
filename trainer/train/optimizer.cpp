// The optimizer phase on the flat buffers: arenas, spike guard, clipping, AdamW (optionally
// ZeRO-1 sharded), and the aux-loss-free expert-bias update.
#include <algorithm>
#include <cmath>
#include <csignal>
#include <deque>
#include <numeric>
#include <regex>
#if defined(__SSE2__)
#include <immintrin.h>
#endif

#include <spdlog/spdlog.h>

#include "trainer/metrics/perf_counters.h"
#include "trainer/train/train.h"
#include "trainer/util/error.h"
#include "trainer/util/torch_compat.h"

namespace trainer {
namespace {

// The trainer's AdamW on the CPU, one pass over this segment's flat fp32 arrays: it reads p, g,
// m, v once and writes p, m, v once, where the same update as LibTorch kernels took eight
// elementwise passes (lerp_, mul_, addcmul_, sqrt, div_, add_, mul_, addcdiv_) and a P-sized
// denominator workspace: 7 array passes instead of 20, for an update that is memory-bound. The
// operations per element follow those kernels (lerp's two forms, addcmul's and addcdiv's
// (value * a) * b and (value * a) / b), in fp32:
//   m <- lerp(m, g, 1 - b1)                  v <- b2 v + ((1 - b2) g) g
//   d = sqrt(v) / sqrt(1 - b2^t) + eps       p <- (p - (lr wd) p) + ((-lr / (1 - b1^t)) m) / d
// Four lanes at a time with SSE (every x86-64 has it): the compiler does not vectorize a loop
// with sqrtf, which may set errno. Same IEEE operations in the same order in the vector and the
// scalar form (no FMA), so both give the same bits.
struct AdamwConstants {
  float w1, keep1, b2, w2, root2, eps, lr_decay, step;  // lr_decay = lr * weight_decay
};

template <bool kLerpFromStart>
void adamw_range(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v, int64_t n,
                 const AdamwConstants k) {
  int64_t i = 0;
#if defined(__SSE2__)
  const __m128 w1 = _mm_set1_ps(k.w1), keep1 = _mm_set1_ps(k.keep1), b2 = _mm_set1_ps(k.b2), w2 = _mm_set1_ps(k.w2),
               root2 = _mm_set1_ps(k.root2), eps = _mm_set1_ps(k.eps), lr_decay = _mm_set1_ps(k.lr_decay),
               step = _mm_set1_ps(k.step);
  for (; i + 4 <= n; i += 4) {
    const __m128 gi = _mm_loadu_ps(g + i), m0 = _mm_loadu_ps(m + i), diff = _mm_sub_ps(gi, m0);
    const __m128 mi = kLerpFromStart ? _mm_add_ps(m0, _mm_mul_ps(w1, diff)) : _mm_sub_ps(gi, _mm_mul_ps(diff, keep1));
    const __m128 vi = _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(v + i), b2), _mm_mul_ps(_mm_mul_ps(w2, gi), gi));
    const __m128 denominator = _mm_add_ps(_mm_div_ps(_mm_sqrt_ps(vi), root2), eps);
    _mm_storeu_ps(m + i, mi);
    _mm_storeu_ps(v + i, vi);
    const __m128 pi = _mm_loadu_ps(p + i);
    _mm_storeu_ps(p + i, _mm_add_ps(_mm_sub_ps(pi, _mm_mul_ps(lr_decay, pi)), _mm_div_ps(_mm_mul_ps(step, mi), denominator)));
  }
#endif
  for (; i < n; ++i) {
    const float gi = g[i], diff = gi - m[i];
    const float mi = kLerpFromStart ? m[i] + k.w1 * diff : gi - diff * k.keep1;
    const float vi = v[i] * k.b2 + k.w2 * gi * gi;
    const float denominator = __builtin_sqrtf(vi) / k.root2 + k.eps;
    m[i] = mi;
    v[i] = vi;
    p[i] = (p[i] - k.lr_decay * p[i]) + k.step * mi / denominator;
  }
}

void adamw_update_cpu(torch::Tensor& params, const torch::Tensor& grads, torch::Tensor& m, torch::Tensor& v,
                      double lr, double b1, double b2, double weight_decay, double eps, double bias1, double bias2) {
  TORCH_CHECK(params.is_cpu() && params.is_contiguous() && grads.is_contiguous() && m.is_contiguous() &&
                  v.is_contiguous() && params.scalar_type() == torch::kFloat32,
              "adamw_update_cpu: contiguous fp32 segments expected");
  const float w1 = static_cast<float>(1.0 - b1);
  const AdamwConstants k{w1,
                         1.0f - w1,
                         static_cast<float>(b2),
                         static_cast<float>(1.0 - b2),
                         static_cast<float>(std::sqrt(bias2)),
                         static_cast<float>(eps),
                         // p - (lr wd) p, not p (1 - lr wd): 1 - lr wd rounded to fp32 moves the decay
                         // by up to 2^-25 / (lr wd) of itself (+19% at lr wd = 1e-7), the same way for
                         // every weight; lr wd itself rounds to 2^-24 of itself (optax, the fused CUDA
                         // kernel: the same form)
                         static_cast<float>(lr * weight_decay),
                         static_cast<float>(-lr / bias1)};
  float* p = params.data_ptr<float>();
  const float* g = grads.data_ptr<float>();
  float *mp = m.data_ptr<float>(), *vp = v.data_ptr<float>();
  const bool lerp_from_start = std::abs(w1) < 0.5f;  // at::lerp's choice of form
  at::parallel_for(0, params.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    const int64_t n = end - begin;
    if (lerp_from_start)
      adamw_range<true>(p + begin, g + begin, mp + begin, vp + begin, n, k);
    else
      adamw_range<false>(p + begin, g + begin, mp + begin, vp + begin, n, k);
  });
}

// Mean and sample standard deviation (Bessel's correction, as torch.std and MaxText's
// _compute_rolling_stats), both 0 for no values, the std 0 for one.
std::pair<double, double> mean_and_std(const std::deque<double>& values) {
  if (values.empty()) return {0.0, 0.0};
  const double n = static_cast<double>(values.size());
  const double mean = std::accumulate(values.begin(), values.end(), 0.0) / n;
  double var = 0;
  for (double v : values) var += (v - mean) * (v - mean);
  return {mean, std::sqrt(var / std::max(1.0, n - 1))};
}

// Appends [begin, begin + length) to runs kept in order, merged into the last one when adjacent.
void append_run(std::vector<std::pair<int64_t, int64_t>>& runs, int64_t begin, int64_t length) {
  if (!runs.empty() && runs.back().first + runs.back().second == begin)
    runs.back().second += length;
  else
    runs.emplace_back(begin, length);
}

// adamw_mask (MaxText's): the parameters whose name matches a pattern (a search, as Python's
// re.search) take no weight decay. Their runs in the parameter arena (named_parameters order),
// (begin, length) with adjacent ones merged; a pattern that matches nothing is warned about.
std::vector<std::pair<int64_t, int64_t>> adamw_mask_arena_runs(const Transformer& model,
                                                               const std::vector<std::string>& patterns) {
  std::vector<std::pair<int64_t, int64_t>> runs;
  if (patterns.empty()) return runs;
  std::vector<std::regex> mask;
  for (const auto& pattern : patterns) mask.emplace_back(pattern, std::regex::ECMAScript);
  std::vector<int64_t> matches(mask.size(), 0);
  int64_t masked_parameters = 0, masked_elements = 0, offset = 0;
  for (const auto& item : model->named_parameters()) {
    const int64_t n = item.value().numel();
    bool masked = false;  // every pattern is searched: unmatched ones are warned about below
    for (size_t i = 0; i < mask.size(); ++i) {
      const bool match = std::regex_search(item.key(), mask[i]);
      matches[i] += match;
      masked = masked || match;
    }
    if (masked) {
      append_run(runs, offset, n);
      ++masked_parameters;
      masked_elements += n;
    }
    offset += n;
  }
  for (size_t i = 0; i < mask.size(); ++i)
    if (matches[i] == 0)
      spdlog::warn("adamw_mask: '{}' matches no parameter name (names as in docs/model.md, e.g. "
                   "model.layers.0.input_layernorm.weight)", patterns[i]);
  spdlog::info("adamw_mask: {} parameters ({} elements) without weight decay", masked_parameters, masked_elements);
  return runs;
}

}  // namespace

// Moves every parameter into one contiguous fp32 arena and makes each .grad a view into a
// second arena. Autograd then accumulates in place (AccumulateGrad adds into an existing
// .grad when grad mode is off, as it is during backward), so K micro-batches use exactly one
// gradient buffer, and the collective, norm, zero count, clipping and AdamW each run once on
// the whole buffer.
void Trainer::build_flat_buffers(ModelInitializer* deferred_init) {
  const auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(device_);
  const std::string& level = config_.data_parallel_sharding;
  int64_t total = 0;
  for (const auto& p : model_->parameters()) total += p.numel();
  if (level == "optim_grads" || level == "optim_grads_params") {
    // The units, shards and gathered buffers are sharding.h's; AdamW runs on the whole shard.
    // HSDP: groups of D consecutive ranks shard the state; ranks r % D (one per group) are its
    // replicas. Every rank makes its two subgroups in the same order, so each rendezvous completes.
    // The divisibility rules were checked in the constructor (config_check_layout).
    const int64_t D = config_shard_degree(config_), R = comm_->world_size(), rank = comm_->rank();
    const int64_t N = config_.expert_parallelism;
    if (D < R) {
      std::vector<int64_t> group, replicas;
      for (int64_t r = rank / D * D; r < rank / D * D + D; ++r) group.push_back(r);
      for (int64_t r = rank % D; r < R; r += D) replicas.push_back(r);
      shard_group_ = comm_->split(group, "sharding group");
      shard_replicas_ = comm_->split(replicas, "sharding replica group");
    }
    // With expert parallelism the routed experts differ between the ranks of an expert-parallel
    // group: they shard over the ranks of the sharding group holding the same ones (all of the
    // expert replica group without HSDP; with it, the D/N of this sharding group, whose replicas in
    // the other groups hold the same parts, so the replica sum covers them as it does the rest).
    Communicator* expert_shards = expert_replicas_.get();
    if (D < R && N > 1) {
      std::vector<int64_t> same_experts;
      for (int64_t r = rank / D * D + rank % N; r < rank / D * D + D; r += N) same_experts.push_back(r);
      expert_shard_group_ = comm_->split(same_experts, "expert sharding group");
      expert_shards = expert_shard_group_.get();
    }
    const ShardingGroups groups{shard_group_ ? shard_group_.get() : comm_.get(), shard_replicas_.get(), expert_shards};
    sharded_state_ = std::make_unique<ShardedModelState>(model_, groups, config_, device_, deferred_init);
    flat_params_ = sharded_state_->arena;  // undefined with optim_grads_params
    shard_begin_ = 0;
    shard_end_ = shard_chunk_ = sharded_state_->grad_shard.numel();
  } else {
    // With ZeRO-1 the parameter arena is padded to R equal chunks (at most R - 1 extra zeros),
    // so each rank's chunk is a view the all-gather fills in place; the parameters view the first
    // `total` elements. rank r owns [r*chunk, (r+1)*chunk) of the padded arena. With expert
    // parallelism R is the expert replica group's size: only its ranks hold the same arena.
    const int64_t ranks = level == "optim" ? zero1_group().world_size() : 1;
    shard_chunk_ = (total + ranks - 1) / ranks;
    flat_params_padded_ = torch::zeros({shard_chunk_ * ranks}, opts);
    flat_grads_ = torch::zeros({total}, opts);
    flat_params_ = flat_params_padded_.narrow(0, 0, total);
    torch::NoGradGuard no_grad;
    int64_t offset = 0;
    for (auto& item : model_->named_parameters()) {  // the order of parameters()
      auto& p = item.value();
      const int64_t n = p.numel();
      auto param_view = flat_params_.narrow(0, offset, n).view(p.sizes());
      param_view.copy_(p);
      p.set_data(param_view);
      p.mutable_grad() = flat_grads_.narrow(0, offset, n).view(p.sizes());
      if (model_is_stacked_experts(item.key())) append_run(expert_segments_, offset, n);  // a layer's gate_up_proj and down_proj: one run
      offset += n;
    }
    shard_begin_ = std::min(total, (ranks > 1 ? zero1_group().rank() : 0) * shard_chunk_);
    shard_end_ = std::min(total, shard_begin_ + shard_chunk_);
  }
  // adamw_mask's runs where AdamW's state has them: this rank's part of each run, at its offset in
  // the moments (the arena's [shard_begin_, shard_end_), or each unit's part in the shard), in
  // order, adjacent ones merged.
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (const auto& [begin, length] : adamw_mask_arena_runs(model_, config_.adamw_mask)) {
    const auto keep = [&, begin = begin, length = length](int64_t own_begin, int64_t own_length, int64_t state_offset) {
      const int64_t from = std::max(begin, own_begin), to = std::min(begin + length, own_begin + own_length);
      if (from < to) runs.emplace_back(state_offset + from - own_begin, to - from);
    };
    if (!sharded_state_)
      keep(shard_begin_, shard_end_ - shard_begin_, 0);
    else
      for (const auto& unit : sharded_state_->units()) keep(unit.begin + unit.group_rank * unit.part, unit.own, unit.shard_offset);
  }
  std::sort(runs.begin(), runs.end());
  for (const auto& [begin, length] : runs) append_run(no_decay_runs_, begin, length);
  // AdamW state for this rank's shard only: all of P without sharding, [r*chunk, (r+1)*chunk)
  // with ZeRO-1, this rank's part of every unit above it.
  adam_m_ = torch::zeros({shard_end_ - shard_begin_}, opts);
  adam_v_ = torch::zeros({shard_end_ - shard_begin_}, opts);
  // The fused CUDA kernel takes the step count on the device (no host-side bias terms).
  if (compat::fused_adamw_available(device_)) adam_step_ = torch::zeros({1}, opts);
  spdlog::info("AdamW state: {:.1f} MiB on this rank{} ({:.1f} MiB without sharding)",
               2.0 * 4 * static_cast<double>(shard_end_ - shard_begin_) / (1 << 20),
               sharded() ? " (ZeRO-1 over " + std::to_string(zero1_group().world_size()) + " ranks" +
                               (expert_replicas_ ? ", those holding the same experts)" : ")")
                         : "",
               2.0 * 4 * static_cast<double>(total) / (1 << 20));
}

// MaxText's skip_step_on_spikes (optimizers.py, after OLMo-core's SkipStepOptimizer): against
// the window of the last n = skip_step_interval steps' (loss, clipped grad norm), skipped ones
// included ("so spikes can become the new baseline"), step t is skipped when
//   loss - mean(losses) > f std(losses)  or  norm - mean(norms) > f std(norms)   (sample std),
// judged once the window holds max(2, n / 2) - 1 steps. One difference: a non-finite value is
// skipped and kept out of the window (MaxText appends it, and its NaN mean then rejects every
// step until it leaves the window). In fp64 (MaxText keeps the window in fp32).
bool Trainer::spike_guard_rejects(double loss, double grad_norm) {
  if (!std::isfinite(loss) || !std::isfinite(grad_norm)) return true;
  const auto interval = static_cast<size_t>(config_.skip_step_interval);
  bool spike = false;
  if (spike_losses_.size() + 1 >= std::max<size_t>(2, interval / 2)) {
    const double f = config_.skip_step_scaling_factor;
    const auto [loss_mean, loss_std] = mean_and_std(spike_losses_);
    const auto [norm_mean, norm_std] = mean_and_std(spike_grad_norms_);
    spike = !(loss - loss_mean <= f * loss_std) || !(grad_norm - norm_mean <= f * norm_std);
  }
  spike_losses_.push_back(loss);
  spike_grad_norms_.push_back(grad_norm);
  while (spike_losses_.size() > interval) spike_losses_.pop_front(), spike_grad_norms_.pop_front();
  return spike;
}

void Trainer::optimizer_update(StepOutput& out) {
  const Config& c = config_;
  torch::NoGradGuard no_grad;
  out.learning_rate = learning_rate_at(c, updates_applied_);
  const int64_t collectives_before = collectives_so_far();
  const double bytes_before = bytes_sent_so_far();
  bool skip = out.total_weights == 0;
  if (out.total_weights == 0)
    spdlog::warn("step {}: no unmasked target token in the whole batch (W = 0); update skipped", out.step);
  if (!skip && c.skip_step_on_spikes) {
    // The guard needs this step's values on the host: one sync per step, only when enabled.
    const auto host = torch::stack({out.loss.to(torch::kFloat64), out.raw_grad_norm.to(torch::kFloat64)}).cpu();
    perf_note_host_read();
    // The norm after clipping, as MaxText's train step hands the guard (the factor as below).
    const double raw = host[1].item<double>(), threshold = c.gradient_clipping_threshold;
    skip = spike_guard_rejects(host[0].item<double>(), threshold > 0 ? raw * std::min(threshold * (1.0 / raw), 1.0) : raw);
  }
  // Global-norm clipping (optax.clip_by_global_norm): g *= min(1, threshold / ||g||).
  if (c.gradient_clipping_threshold > 0) {
    const auto factor = out.raw_grad_norm.reciprocal().mul(c.gradient_clipping_threshold).clamp_max(1.0);  // fp64
    step_grads().mul_(factor.to(torch::kFloat32));
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
    // The shard as segments: params pair with the gradient and moments at [offset, + numel). One
    // segment except for optim_grads, whose parts of each unit are views of the arena.
    std::vector<ShardedModelState::Segment> segments;
    if (sharded_state_)
      segments = sharded_state_->param_segments();
    else
      segments.push_back({flat_params_.narrow(0, shard_begin_, shard_end_ - shard_begin_), 0});
    if (adam_step_.defined()) adam_step_.fill_(t);  // CUDA: bias terms from t on the device
    // Elements [from, to) of a segment, with weight decay wd.
    const auto adamw = [&](torch::Tensor& params, const torch::Tensor& grads, torch::Tensor& m, torch::Tensor& v,
                           int64_t from, int64_t to, double wd) {
      if (from >= to) return;
      auto p_part = params.narrow(0, from, to - from), m_part = m.narrow(0, from, to - from), v_part = v.narrow(0, from, to - from);
      const auto g_part = grads.narrow(0, from, to - from);
      if (adam_step_.defined())  // CUDA: the same formula in one kernel
        compat::fused_adamw(p_part, g_part, m_part, v_part, adam_step_, lr, c.adam_b1, c.adam_b2, wd, c.adam_eps);
      else
        adamw_update_cpu(p_part, g_part, m_part, v_part, lr, c.adam_b1, c.adam_b2, wd, c.adam_eps, bias1, bias2);
    };
    for (auto& [params, offset] : segments) {
      const int64_t n = params.numel();
      const auto grads = sharded_state_ ? sharded_state_->grad_shard.narrow(0, offset, n) : flat_grads_.narrow(0, shard_begin_, n);
      auto m = adam_m_.narrow(0, offset, n), v = adam_v_.narrow(0, offset, n);
      // adamw_mask's runs (offsets in the moments, as the segment's) with wd = 0, the elements
      // between them with adam_weight_decay.
      int64_t done = 0;
      for (const auto& [begin, length] : no_decay_runs_) {
        const int64_t from = std::max(begin - offset, done), to = std::min(begin + length - offset, n);
        if (from >= to) continue;
        adamw(params, grads, m, v, done, from, c.adam_weight_decay);
        adamw(params, grads, m, v, from, to, 0.0);
        done = to;
      }
      adamw(params, grads, m, v, done, n, c.adam_weight_decay);
    }
    if (c.debug_kill_rank_before_parameter_gather == comm_->rank() && out.step == 1) {
      if (sharded_state_ && sharded_state_->params_sharded())
        sharded_state_->kill_in_next_layer_gather = true;  // the next gathers are the layers' in forward
      else
        std::raise(SIGKILL);
    }
    if (sharded()) all_gather_chunks(flat_params_padded_, "the updated parameters");  // ZeRO-1, in place
    if (sharded_state_) sharded_state_->params_updated();
    ++updates_applied_;
  }
  update_expert_bias(out, /*apply=*/!skip);
  out.step_skipped = skip;
  // Megatron steps its scheduler after the update and logs the rate it then holds: the next
  // update's (the same again after a skipped step).
  out.megatron_learning_rate = learning_rate_at(c, updates_applied_);
  // A collective with expert parallelism or sharding.
  out.param_norm = sharded_state_ ? sharded_state_->params_norm() : arena_norm(flat_params_);
  out.collectives += collectives_so_far() - collectives_before;  // the ZeRO-1 gather, the norm's sum
  out.collective_bytes += bytes_sent_so_far() - bytes_before;
}

// Aux-loss-free balancing (DeepSeek-V3): after an applied update, each MoE layer's selection
// bias moves by routed_bias_update_rate toward balance: up for experts below the mean load, down
// for those above. The load is the step's token counts summed over micro-batches and ranks, the
// sign taken as Megatron's get_updated_expert_bias takes it (fp32, sum / E - count): an expert
// exactly at the mean stays put (counts divided by K x R first could round off the mean). With routed_bias_zero_mean_update (Ling 2.0's Megatron patch,
// `--bias-zero-mean-update`) the signs are centred first, s - mean_e(s), so the layer's biases
// keep a zero-sum drift: with more experts above the mean than below, plain signs would push every
// bias down over time.
void Trainer::update_expert_bias(StepOutput& out, bool apply) {
  const Config& c = config_;
  if (!c.routed_bias || !out.expert_counts.defined()) return;
  auto layers = model_->moe_layers();
  std::vector<torch::Tensor> bias_means;  // 0-dim fp64 per MoE layer
  for (size_t i = 0; i < layers.size(); ++i) {
    auto& bias = layers[i]->gate->e_score_correction_bias;       // (E)
    if (apply && c.routed_bias_update_rate > 0) {
      const auto counts = out.expert_counts[static_cast<int64_t>(i)];  // (E) fp32
      auto direction = torch::sign(counts.sum() / static_cast<double>(counts.numel()) - counts);  // (E) s
      if (c.routed_bias_zero_mean_update) direction = direction - direction.mean();
      bias.add_(direction, c.routed_bias_update_rate);
    }
    bias_means.push_back(bias.to(torch::kFloat64).mean());
  }
  out.moe_router_bias_mean = torch::stack(bias_means).mean();
}

void Trainer::all_gather_chunks(torch::Tensor& padded, const std::string& what) {
  // Bucketed: each round gathers one bucket-sized slice of every rank's chunk, so the transient
  // buffer c10d uses for the exchange is R x bucket, never parameter-sized.
  Communicator& group = zero1_group();
  const int64_t ranks = group.world_size();
  const int64_t slice = std::max<int64_t>(1, config_.gradient_bucket_size_mb * (1 << 20) / 4 / ranks);
  for (int64_t offset = 0; offset < shard_chunk_; offset += slice) {
    const int64_t n = std::min(slice, shard_chunk_ - offset);
    std::vector<torch::Tensor> parts;
    for (int64_t r = 0; r < ranks; ++r) parts.push_back(padded.narrow(0, r * shard_chunk_ + offset, n));
    group.all_gather(parts, what + " (ZeRO-1 all-gather) at chunk offset " + std::to_string(offset));
  }
}

}  // namespace trainer
