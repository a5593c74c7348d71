// The heart of the product: one optimizer step's forward/backward over K micro-batches with
// both normalization modes (DESIGN section 5). Read this file top to bottom.
//
// Notation: micro-batches i = 1..K on each of R ranks. For micro-batch i
//   ce_i = sum over unmasked targets of (cross-entropy + z * logsumexp^2)
//   w_i  = number of unmasked targets,  W = sum_{r,i} w_i
//   lb_i  = load_balance_loss_weight * mean over MoE layers of LB
//           + router_z_loss_weight * mean over MoE layers of the router z-loss   (moe.cpp)
//           (sums over layers instead with moe_aux_loss_over_layers: sum, Megatron's convention)
//   mtp_i = mtp_loss_scaling_factor * mean over depths k of (depth-k CE sum / depth-k targets)
//           (mtp_per_layer_loss_norm: false pools instead: sum_k CE sum_k / sum_k targets_k)
//   (aux losses are per-token-scale numbers computed on micro-batch i's tokens)
//
// Per-token mode (calculate_per_token_loss: true), the sum/sum objective
//   J = ( sum ce_i + sum (lb_i + mtp_i) * w_i ) / W
// is linear in each micro-batch's term, so each micro-batch backpropagates its unnormalized
//   o_i = ce_i + (lb_i + mtp_i) * w_i
// into the shared fp32 gradient buffer and the sum is scaled once by 1/W at the end:
//   grad J = (1/W) * sum_i grad o_i.
// The aux terms are multiplied by w_i so that the single division by W leaves them at their
// own per-token scale (RFC change 4); without it they would shrink by a factor of ~W.
// (K=4, batch b) and (K=1, batch 4b) therefore give the same J and gradient: both are sums
// over the same tokens divided by the same W.
//
// Megatron mode (false), mean of per-micro-batch means:
//   J = 1/(R*K) * sum_i ( ce_i / max(w_i, 1) + lb_i + mtp_i ),
// so o_i = ce_i / max(w_i, 1) + lb_i + mtp_i and the final scale is 1/(R*K). Micro-batches
// with few tokens weigh as much as full ones, which is why it differs from per-token mode on
// uneven data. With K = R = 1 both give ce/w + lb + mtp.
//
// The reported metrics are the terms of that same J (lm_loss = its CE term, and so on), so
// learning/loss is exactly the optimized objective.
//
// LB and the per-micro-batch MTP means are statistics of the micro-batch's tokens, not sums
// over tokens, so with aux losses on, (K=4, b) and (K=1, 4b) differ by how those statistics
// change with the batch (small; bounded in the tests), while the CE part stays exact.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>

#include "trainer/metrics/perf_counters.h"
#include "trainer/train/cross_entropy.h"
#include "trainer/train/train.h"
#include "trainer/util/torch_compat.h"

namespace trainer {
namespace {

struct MicroBatchTensors {
  torch::Tensor inputs;       // (B, L) int64
  torch::Tensor targets;      // (B, L) int64
  torch::Tensor loss_mask;    // (B, L) fp32
  torch::Tensor segment_ids;  // (B, L) int64
  torch::Tensor positions;    // (B, L) int64
  bool one_segment_per_row;   // every segment id is 1: attention is plain causal
};

// The five (B, L) arrays go to the device as one buffer in one copy: four int64 slots, then the
// fp32 mask in a slot of the same width (so every slot starts 8-byte aligned). On CUDA the buffer
// is pinned (LibTorch's caching host allocator) and the copy asynchronous: the host queues the
// forward without waiting for the GPU to reach the copy (five pageable copies each blocked it),
// and the allocator does not hand the block out again before the copy's recorded event has passed.
MicroBatchTensors to_device(const MicroBatch& b, const torch::Device& device) {
  const int64_t n = b.batch_size * b.seq_len, slot = n * 8;
  const bool cuda = device.is_cuda();
  auto host = torch::empty({5 * slot}, torch::TensorOptions().dtype(torch::kUInt8).pinned_memory(cuda));
  auto* bytes = host.data_ptr<uint8_t>();
  const auto put = [&](int index, const auto& values) {
    TORCH_CHECK(static_cast<int64_t>(values.size()) == n, "micro-batch array of ", values.size(), " values, expected ", n);
    std::memcpy(bytes + index * slot, values.data(), values.size() * sizeof(values[0]));
  };
  put(0, b.inputs);
  put(1, b.targets);
  put(2, b.segment_ids);
  put(3, b.positions);
  put(4, b.loss_mask);
  const auto moved = cuda ? host.to(device, /*non_blocking=*/true) : host;  // (5 slot) bytes
  const auto slot_as = [&](int index, torch::ScalarType type) {
    return moved.narrow(0, index * slot, n * static_cast<int64_t>(torch::elementSize(type))).view(type).view({b.batch_size, b.seq_len});
  };
  const bool one_segment = std::all_of(b.segment_ids.begin(), b.segment_ids.end(), [](int64_t s) { return s == 1; });
  return {slot_as(0, torch::kInt64), slot_as(1, torch::kInt64), slot_as(4, torch::kFloat32),
          slot_as(2, torch::kInt64), slot_as(3, torch::kInt64), one_segment};
}

// Multi-token prediction: depth k at position i predicts token i+k+1 of the sample (its L+1
// tokens: = targets[i+k], the last one beyond the inputs). It counts when i+k < L, that token is
// in the same segment as position i, and targets[i+k] is unmasked: depth k has up to L-k targets
// per row, as Megatron's roll (which zero-fills only the last position per depth). No prediction
// crosses a document boundary, even where the main loss (Megatron-style) predicts across an EOD.
// `target_segments` (B, L) is the segment of each target token (see mtp_target_segments). Each
// depth is a per-token mean on its own (unscaled: the caller multiplies by
// mtp_loss_scaling_factor). `ce_sum(depth, targets, valid)` gives a depth's CE summed over its
// valid (0/1) targets. Returns the (depths) losses and, in `pooled`, the depths' CE sum over
// their target count (mtp_per_layer_loss_norm=false; equal to the mean of the depths when they
// count alike).
template <class CeSum>
torch::Tensor mtp_depth_losses(size_t depths_count, const MicroBatchTensors& t, const torch::Tensor& target_segments,
                               const CeSum& ce_sum, torch::Tensor& pooled) {
  const auto L = t.targets.size(1);
  std::vector<torch::Tensor> depths, sums, counts;
  for (size_t depth = 0; depth < depths_count; ++depth) {
    const int64_t k = static_cast<int64_t>(depth) + 1;
    const auto in_range = torch::arange(L, t.segment_ids.options()) < L - k;
    const auto same_segment = target_segments.roll(-k, 1) == t.segment_ids;
    const auto valid = in_range & same_segment & (t.loss_mask.roll(-k, 1) > 0);  // (B, L) bool
    sums.push_back(ce_sum(depth, t.targets.roll(-k, 1), valid));
    counts.push_back(valid.to(sums.back().scalar_type()).sum());
    depths.push_back(sums.back() / counts.back().clamp_min(1.0));
  }
  pooled = torch::stack(sums).sum() / torch::stack(counts).sum().clamp_min(1.0);
  return torch::stack(depths);
}

// (B, L): the segment of each target token. targets[j] is input token j+1 for j < L-1, so its
// segment is segment_ids[j+1]; the last target (the sample's token L) is beyond the inputs: it
// opens a new segment exactly when the last input is an EOD under reset_attention_mask (the
// Megatron loader's rule: an EOD input closes its segment).
torch::Tensor mtp_target_segments(const MicroBatchTensors& t, const Config& c) {
  const auto L = t.segment_ids.size(1);
  auto last = t.segment_ids.narrow(1, L - 1, 1);
  if (c.reset_attention_mask) last = last + (t.inputs.narrow(1, L - 1, 1) == c.eod_id).to(last.scalar_type());
  return torch::cat({t.segment_ids.narrow(1, 1, L - 1), last}, 1);
}

}  // namespace

MicroBatchLosses micro_batch_losses(Transformer& model, const MicroBatch& batch, const Config& c,
                                    const torch::Device& device) {
  MicroBatchLosses losses;
  for (float m : batch.loss_mask) losses.weights += m;  // host-known: no device sync needed
  const auto t = to_device(batch, device);
  // num_vocab_tiling > 1: the model stops before its head, and the head's GEMMs run inside the
  // tiled loss (with autocast's bf16 rounding when dtype is bfloat16).
  const bool tiled = c.num_vocab_tiling > 1, bf16 = c.dtype == "bfloat16";
  ModelOutput output;
  {
    compat::AutocastGuard autocast(bf16, device.is_cuda());
    output = model->forward(t.inputs, t.positions, t.segment_ids, t.one_segment_per_row, /*logits=*/!tiled);
  }
  const auto head_weight = tiled ? model->head_weight() : torch::Tensor();
  auto sums = tiled ? cross_entropy_sums_tiled(output.head_input, head_weight, t.targets, t.loss_mask,
                                               c.z_loss_multiplier, c.num_vocab_tiling, bf16)
                    : cross_entropy_sums(output.logits, t.targets, t.loss_mask, c.z_loss_multiplier);
  losses.ce = sums.ce;
  losses.z = sums.z;
  losses.lb = torch::zeros({}, sums.ce.options());
  losses.router_z = torch::zeros({}, sums.ce.options());
  losses.lb_unweighted = torch::zeros({}, sums.ce.options());
  losses.router_z_unweighted = torch::zeros({}, sums.ce.options());
  losses.router_probs_std = torch::zeros({}, sums.ce.options());
  if (!output.moe_stats.empty()) {
    std::vector<torch::Tensor> balance, z, counts, probs_std;
    for (const auto& layer : output.moe_stats) {
      balance.push_back(layer.load_balance);
      z.push_back(layer.router_z);
      counts.push_back(layer.counts);
      probs_std.push_back(layer.probs_std);
    }
    losses.router_probs_std = torch::stack(probs_std).mean();
    losses.router_z_unweighted = torch::stack(z).mean();
    losses.lb_unweighted = torch::stack(balance).mean();
    // Megatron applies each router's LB and z-loss inside that router, so its objective sums them
    // over the MoE layers; the default averages (the weights then do not depend on the depth).
    const double layers = c.moe_aux_loss_over_layers == "sum" ? static_cast<double>(output.moe_stats.size()) : 1.0;
    losses.router_z = c.router_z_loss_weight * layers * losses.router_z_unweighted;
    losses.lb = c.load_balance_loss_weight * layers * losses.lb_unweighted + losses.router_z;
    losses.router_z_unweighted = losses.router_z_unweighted.detach();
    losses.lb_unweighted = losses.lb_unweighted.detach();
    losses.expert_counts = torch::stack(counts);
  }
  if (output.mtp_head_inputs.empty()) {
    losses.mtp_raw = torch::zeros({}, sums.ce.options());
  } else {
    const auto depth_ce_sum = [&](size_t depth, const torch::Tensor& targets, const torch::Tensor& valid) {
      if (tiled)
        return cross_entropy_sums_tiled(output.mtp_head_inputs[depth], head_weight, targets, valid, 0.0,
                                        c.num_vocab_tiling, bf16).ce;
      const auto& logits = output.mtp_logits[depth];  // (B, L, V)
      return cross_entropy_sums(logits, targets, valid.to(logits.scalar_type()), 0.0).ce;
    };
    torch::Tensor pooled;
    const auto depths = mtp_depth_losses(output.mtp_head_inputs.size(), t, mtp_target_segments(t, c), depth_ce_sum, pooled);
    losses.mtp_raw = c.mtp_per_layer_loss_norm ? depths.mean() : pooled;
    losses.mtp_depths = depths.detach();
  }
  losses.mtp = c.mtp_loss_scaling_factor * losses.mtp_raw;
  return losses;
}

StepOutput Trainer::forward_backward(int64_t step) {
  const Config& c = config_;
  const int64_t K = c.gradient_accumulation_steps;
  const bool per_token = c.calculate_per_token_loss;
  const bool inject = step == c.debug_inject_nonfinite_step;
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64).device(device_);

  StepOutput out;
  out.step = step;
  // Counted from here: with expert parallelism the MoE layers exchange rows during the step.
  const int64_t collectives_before = collectives_so_far();
  const double bytes_before = bytes_sent_so_far();
  // Autograd accumulates into views of the flat buffer in place (sharded: of the unit buffers).
  if (sharded_state_)
    sharded_state_->step_begin();
  else
    flat_grads_.zero_();
  // Detached float64 accumulators of the terms of J (before the final scale).
  auto ce_acc = torch::zeros({}, f64), z_acc = torch::zeros({}, f64);
  auto lb_acc = torch::zeros({}, f64), mtp_acc = torch::zeros({}, f64);
  auto router_z_acc = torch::zeros({}, f64), mtp_raw_acc = torch::zeros({}, f64);
  // Megatron's logged values: the plain CE sum (divided by W at the end, in both modes) and the
  // unweighted aux losses summed over micro-batches (divided by R*K: Megatron's plain means).
  auto ce_sum_acc = torch::zeros({}, f64), lb_unweighted_acc = torch::zeros({}, f64);
  auto router_z_unweighted_acc = torch::zeros({}, f64), router_probs_std_acc = torch::zeros({}, f64);
  auto mtp_depths_acc = torch::zeros({c.mtp_num_layers}, f64);
  torch::Tensor expert_counts;  // (MoE layers, E): summed over micro-batches here, then over ranks
  double W = 0;

  for (int64_t micro = 0; micro < K; ++micro) {
    const MicroBatch batch = prefetcher_ ? prefetcher_->data_prefetcher_next(step, micro, &out.data_wait_seconds)
                                         : data_.data_loader_next(step, micro);
    out.sample_indices.insert(out.sample_indices.end(), batch.sample_indices.begin(),
                              batch.sample_indices.end());
    MicroBatchLosses m = micro_batch_losses(model_, batch, c, device_);
    const double w = m.weights;
    if (inject && micro == 0 && c.debug_inject_nonfinite_kind.rfind("loss_", 0) == 0) {
      // A non-finite constant in the loss: the gradient stays finite, the loss does not.
      m.ce = m.ce + (c.debug_inject_nonfinite_kind == "loss_nan" ? std::numeric_limits<double>::quiet_NaN()
                                                                 : std::numeric_limits<double>::infinity());
    }
    if (m.expert_counts.defined())
      expert_counts = expert_counts.defined() ? expert_counts + m.expert_counts : m.expert_counts;

    const double inv_w = 1.0 / std::max(w, 1.0);
    const double aux_backward_weight = c.debug_drop_aux_token_weighting ? 1.0 : w;  // RFC change 4
    const auto objective = per_token ? m.ce + (m.lb + m.mtp) * aux_backward_weight : m.ce * inv_w + m.lb + m.mtp;
    objective.backward();

    torch::NoGradGuard no_grad;
    const double term_weight = per_token ? 1.0 : inv_w;  // ce_i or ce_i / max(w_i, 1)
    const double aux_weight = per_token ? w : 1.0;        // (lb_i + mtp_i) * w_i or as is
    ce_acc.add_(m.ce.detach().to(torch::kFloat64), term_weight);
    z_acc.add_(m.z.to(torch::kFloat64), term_weight);
    lb_acc.add_(m.lb.detach().to(torch::kFloat64), aux_weight);
    mtp_acc.add_(m.mtp.detach().to(torch::kFloat64), aux_weight);
    router_z_acc.add_(m.router_z.detach().to(torch::kFloat64), aux_weight);
    mtp_raw_acc.add_(m.mtp_raw.detach().to(torch::kFloat64), aux_weight);
    ce_sum_acc.add_(m.ce.detach().to(torch::kFloat64));
    lb_unweighted_acc.add_(m.lb_unweighted.to(torch::kFloat64));
    router_z_unweighted_acc.add_(m.router_z_unweighted.to(torch::kFloat64));
    router_probs_std_acc.add_(m.router_probs_std.to(torch::kFloat64));
    if (m.mtp_depths.defined()) mtp_depths_acc.add_(m.mtp_depths.to(torch::kFloat64));
    W += w;
    if (inject && micro == 0 && c.debug_inject_nonfinite_kind.rfind("grad_", 0) == 0) {
      // A non-finite value that reaches only the gradient, as a bad backward kernel would.
      step_grads()[0].fill_(c.debug_inject_nonfinite_kind == "grad_nan"
                           ? std::numeric_limits<float>::quiet_NaN()
                               : std::numeric_limits<float>::infinity());
    }
  }

  // Data parallel: one bucketed all-reduce of the flat gradient and the step's scalars, once per
  // step, not per micro-batch. Sharded levels reduced each decoder layer's gradient after its
  // backward; the outer units' now. The scalars come in two kinds: W and the stop and failure
  // votes, which the host holds, and the J accumulators and expert counts, which live on the
  // device. Each is summed where it is (host values on the host group: Gloo, also under NCCL), so
  // the host never waits for the device here; where one group serves both (Gloo on the CPU) it is
  // one all-reduce.
  const auto sync_start = std::chrono::steady_clock::now();
  if (sharded_state_) sharded_state_->step_reduce_outer();
  if (!comm_->is_local()) {
    if (!sharded_state_) reduce_gradients();
    auto host_stats = torch::tensor({W, stop_vote_ ? 1.0 : 0.0, failure_vote_ ? 1.0 : 0.0}, torch::kFloat64);  // (3)
    std::vector<torch::Tensor> device_parts = {torch::stack({ce_acc, z_acc, lb_acc, mtp_acc, router_z_acc, mtp_raw_acc,
                                                             ce_sum_acc, lb_unweighted_acc, router_z_unweighted_acc,
                                                             router_probs_std_acc}),
                                               mtp_depths_acc};
    if (expert_counts.defined()) device_parts.push_back(expert_counts.to(torch::kFloat64).reshape({-1}));
    auto device_stats = torch::cat(device_parts);  // (10 + depths + MoE layers * E) on the device
    Communicator& host_group = comm_->host_group();
    if (&host_group == comm_.get()) {
      // One group for both. Where it reduces device tensors (NCCL in a build without Gloo, whose
      // PyTorch wheel ships no Gloo headers; or Gloo with hardware=gpu) the host values ride along
      // on the device, copied there without a wait, and come back in the step's one host read,
      // counted and allowed under debug_cuda_sync_check.
      const bool on_host = device_stats.device() == host_stats.device();
      auto stats = torch::cat({on_host ? host_stats : host_stats.pin_memory().to(device_stats.device(), /*non_blocking=*/true),
                               device_stats});
      comm_->all_reduce_sum(stats, "the step's token count, loss sums and expert load");
      device_stats = stats.narrow(0, host_stats.numel(), device_stats.numel());
      if (on_host) {
        host_stats = stats.narrow(0, 0, host_stats.numel());
      } else {
        const bool checking = device_sync_errors_get(device_);
        device_sync_errors_set(device_, false);
        host_stats = stats.narrow(0, 0, host_stats.numel()).cpu();
        device_sync_errors_set(device_, checking);
        perf_note_host_read();
      }
    } else {
      host_group.all_reduce_sum(host_stats, "the step's token count, stop and failure votes");
      comm_->all_reduce_sum(device_stats, "the step's loss sums and expert load");
    }
    W = host_stats[0].item<double>();  // a host tensor: no device read
    out.stop_requested = host_stats[1].item<double>() > 0;
    out.failure_reported = host_stats[2].item<double>() > 0;
    const auto at = [&](int64_t i) { return device_stats[i]; };
    ce_acc = at(0), z_acc = at(1), lb_acc = at(2), mtp_acc = at(3), router_z_acc = at(4), mtp_raw_acc = at(5);
    ce_sum_acc = at(6), lb_unweighted_acc = at(7), router_z_unweighted_acc = at(8), router_probs_std_acc = at(9);
    const int64_t depths = mtp_depths_acc.numel();
    mtp_depths_acc = device_stats.narrow(0, 10, depths);
    if (expert_counts.defined())
      expert_counts = device_stats.narrow(0, 10 + depths, expert_counts.numel()).view(expert_counts.sizes()).to(expert_counts.scalar_type());
  } else {
    out.stop_requested = stop_vote_;
  }
  out.grad_sync_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - sync_start).count();

  // The single normalization of the step. W = 0 (no target token anywhere) gives a zero
  // gradient and a skipped step, never 0/0.
  const double R = static_cast<double>(comm_->world_size());
  const double scale = per_token ? (W > 0 ? 1.0 / W : 0.0) : 1.0 / (R * static_cast<double>(K));
  torch::NoGradGuard no_grad;
  step_grads().mul_(scale);
  out.total_weights = W;
  out.lm_loss = ce_acc * scale;
  out.z_loss = z_acc * scale;
  out.moe_lb_loss = lb_acc * scale;
  out.mtp_loss = mtp_acc * scale;
  out.moe_router_z_loss = router_z_acc * scale;
  out.mtp_loss_raw = mtp_raw_acc * scale;
  out.loss = out.lm_loss + out.moe_lb_loss + out.mtp_loss;
  const double plain_mean = 1.0 / (R * static_cast<double>(K));
  out.megatron_lm_loss = ce_sum_acc * (W > 0 ? 1.0 / W : 0.0);
  out.megatron_load_balancing_loss = lb_unweighted_acc * plain_mean;
  out.megatron_z_loss = router_z_unweighted_acc * plain_mean;
  out.moe_router_probs_std = router_probs_std_acc * plain_mean;
  if (c.mtp_num_layers > 0) out.megatron_mtp_depth_losses = mtp_depths_acc * plain_mean;
  out.expert_counts = expert_counts;  // summed: exact integers, as Megatron's bias update reads them
  if (sharded_state_) {
    out.raw_grad_norm = sharded_state_->norm(sharded_state_->grad_shard);
    if (c.log_num_zeros_in_grad) out.num_zeros = sharded_state_->count_zeros(sharded_state_->grad_shard);
  } else {
    out.raw_grad_norm = arena_norm(flat_grads_);
    if (c.log_num_zeros_in_grad) out.num_zeros = arena_count_zeros(flat_grads_);
  }
  out.collectives = collectives_so_far() - collectives_before;  // with the norms' sums
  out.collective_bytes = bytes_sent_so_far() - bytes_before;
  return out;
}

void Trainer::reduce_gradients() {
  const int64_t bucket = config_.gradient_bucket_size_mb * (1 << 20) / 4;
  const auto reduce = [&](Communicator& group, int64_t begin, int64_t end) {
    group.all_reduce_sum_in_buckets(flat_grads_.narrow(0, begin, end - begin), bucket, "the gradient bucket", begin);
  };
  // Dense runs between the expert segments go over all ranks; each expert segment over the ranks
  // holding the same experts (the gradient of rows from the whole group reached it through the
  // backward of the expert exchange).
  int64_t dense_begin = 0;
  if (expert_group_)
    for (const auto& [offset, numel] : expert_segments_) {
      reduce(*comm_, dense_begin, offset);
      reduce(*expert_replicas_, offset, offset + numel);
      dense_begin = offset + numel;
    }
  reduce(*comm_, dense_begin, flat_grads_.numel());
}

torch::Tensor Trainer::arena_norm(const torch::Tensor& flat) {
  if (!expert_group_) return flat_buffer_norm(flat);
  return flat_buffer_norm_expert_parallel(flat, expert_segments_, *expert_group_);
}

torch::Tensor Trainer::arena_count_zeros(const torch::Tensor& flat) {
  if (!expert_group_) return flat_buffer_count_zeros(flat);
  return flat_buffer_count_zeros_expert_parallel(flat, expert_segments_, *expert_group_);
}

// Reductions over parameter-sized buffers. A plain fp32 `norm()` of P elements is off by up to
// a few percent at P ~ 1e8 on CPU (LibTorch 1.13 accumulates each SIMD lane sequentially in fp32:
// once the running sum is ~1e7 times an addend, the addend is rounded away). Here the buffer is
// viewed as rows of kReductionRow elements; each row reduces in fp32 (at most 1024 addends: the
// relative error is ~1e-8), and the P / kReductionRow row results are combined in fp64. The only
// temporary is that (rows) vector, 1/1024 of the buffer, and the same two kernels run on CUDA.
namespace {
constexpr int64_t kReductionRow = 1024;

// Applies `per_row` (rows, kReductionRow) -> (rows) and `tail` (n) -> 0-dim to the buffer, and
// returns the fp64 sum of both.
template <typename RowFn, typename TailFn>
torch::Tensor flat_buffer_reduce(const torch::Tensor& flat, RowFn per_row, TailFn tail) {
  TORCH_CHECK(flat.dim() == 1 && flat.is_contiguous(), "flat_buffer_reduce: a contiguous 1-D buffer");
  const int64_t rows = flat.numel() / kReductionRow, body = rows * kReductionRow;
  auto total = per_row(flat.narrow(0, 0, body).view({rows, kReductionRow})).to(torch::kFloat64).sum();
  if (body < flat.numel()) total = total + tail(flat.narrow(0, body, flat.numel() - body)).to(torch::kFloat64);
  return total;
}
}  // namespace

torch::Tensor flat_buffer_norm(const torch::Tensor& flat) {
  // sum over rows of (row norm)^2, in fp64; NaN and Inf propagate as in norm().
  const auto sum_of_squares = flat_buffer_reduce(
      flat, [](const torch::Tensor& rows) { return at::linalg_vector_norm(rows, 2, {1}).to(torch::kFloat64).square(); },
      [](const torch::Tensor& tail) { return tail.to(torch::kFloat64).square().sum(); });
  return sum_of_squares.sqrt();
}

torch::Tensor flat_buffer_count_zeros(const torch::Tensor& flat) {
  // The L0 "norm" counts non-zero elements (NaN counts as non-zero, -0.0 as zero) without the
  // (P) bool temporary of eq(0); per row it is an integer <= 1024, exact in fp32.
  const auto nonzero = flat_buffer_reduce(
      flat, [](const torch::Tensor& rows) { return at::linalg_vector_norm(rows, 0, {1}); },
      [](const torch::Tensor& tail) { return tail.ne(0).sum(); });
  return (static_cast<double>(flat.numel()) - nonzero).to(torch::kInt64);
}

namespace {
// Sums `reduce` (a 0-dim tensor per run) over the dense runs and, all-reduced over the
// expert-parallel group, over the expert runs: (dense, experts of the whole group).
template <typename ReduceFn>
std::pair<torch::Tensor, torch::Tensor> flat_buffer_reduce_expert_parallel(
    const torch::Tensor& flat, const std::vector<std::pair<int64_t, int64_t>>& expert_segments, Communicator& expert_group,
    ReduceFn reduce, torch::ScalarType dtype, const std::string& what) {
  auto dense = torch::zeros({}, flat.options().dtype(dtype)), experts = torch::zeros({1}, flat.options().dtype(dtype));
  const auto add = [&](torch::Tensor& total, int64_t begin, int64_t end) {
    if (begin < end) total += reduce(flat.narrow(0, begin, end - begin));
  };
  int64_t dense_begin = 0;
  for (const auto& [offset, numel] : expert_segments) {
    add(dense, dense_begin, offset);
    add(experts, offset, offset + numel);
    dense_begin = offset + numel;
  }
  add(dense, dense_begin, flat.numel());
  expert_group.all_reduce_sum(experts, what);
  return {dense, experts[0]};
}
}  // namespace

torch::Tensor flat_buffer_norm_expert_parallel(const torch::Tensor& flat,
                                               const std::vector<std::pair<int64_t, int64_t>>& expert_segments,
                                               Communicator& expert_group) {
  const auto [dense, experts] = flat_buffer_reduce_expert_parallel(
      flat, expert_segments, expert_group, [](const torch::Tensor& run) { return flat_buffer_norm(run).square(); },
      torch::kFloat64, "the expert part of a norm");
  return (dense + experts).sqrt();
}

torch::Tensor flat_buffer_count_zeros_expert_parallel(const torch::Tensor& flat,
                                                      const std::vector<std::pair<int64_t, int64_t>>& expert_segments,
                                                      Communicator& expert_group) {
  const auto [dense, experts] = flat_buffer_reduce_expert_parallel(
      flat, expert_segments, expert_group, flat_buffer_count_zeros, torch::kInt64, "the expert part of a zero count");
  return dense + experts;
}

}  // namespace trainer
