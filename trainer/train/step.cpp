// The heart of the product: one optimizer step's forward/backward over K micro-batches with
// both normalization modes (DESIGN section 5). Read this file top to bottom.
//
// Notation: micro-batches i = 1..K on each of R ranks. For micro-batch i
//   ce_i = sum over unmasked targets of (cross-entropy + z * logsumexp^2)
//   w_i  = number of unmasked targets,  W = sum_{r,i} w_i
//   lb_i, mtp_i = auxiliary losses, already at per-token scale (0 until MoE/MTP land)
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
#include <limits>

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
};

MicroBatchTensors to_device(const MicroBatch& b, const torch::Device& device) {
  const auto as_tensor = [&](const auto& values, torch::ScalarType type) {
    auto host = torch::from_blob(const_cast<void*>(static_cast<const void*>(values.data())),
                                 {b.batch_size, b.seq_len}, type);
    return device.is_cpu() ? host.clone() : host.to(device);
  };
  return {as_tensor(b.inputs, torch::kInt64), as_tensor(b.targets, torch::kInt64),
          as_tensor(b.loss_mask, torch::kFloat32), as_tensor(b.segment_ids, torch::kInt64),
          as_tensor(b.positions, torch::kInt64)};
}

struct CrossEntropySums {
  torch::Tensor ce;  // sum over unmasked targets of CE + z-loss term, fp32, differentiable
  torch::Tensor z;   // the z-loss part of ce, detached
};

// logits (B, L, V) fp32. Per token: lse - logit[target] + z * lse^2.
CrossEntropySums cross_entropy_sums(const torch::Tensor& logits, const torch::Tensor& targets,
                                    const torch::Tensor& mask, double z_loss_multiplier) {
  const auto lse = torch::logsumexp(logits, -1);                                  // (B, L)
  const auto target_logit = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1);  // (B, L)
  auto per_token = lse - target_logit;
  torch::Tensor z_sum = torch::zeros({}, logits.options());
  if (z_loss_multiplier > 0) {
    const auto z = z_loss_multiplier * lse.square();
    per_token = per_token + z;
    z_sum = (z.detach() * mask).sum();
  }
  return {(per_token * mask).sum(), z_sum};
}

}  // namespace

StepOutput Trainer::forward_backward(int64_t step) {
  const Config& c = config_;
  const int64_t K = c.gradient_accumulation_steps;
  const bool per_token = c.calculate_per_token_loss;
  const bool inject = step == c.debug_inject_nonfinite_step;
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64).device(device_);

  StepOutput out;
  out.step = step;
  flat_grads_.zero_();  // autograd accumulates into views of this buffer, in place
  // Detached float64 accumulators of the terms of J (before the final scale).
  auto ce_acc = torch::zeros({}, f64), z_acc = torch::zeros({}, f64);
  auto lb_acc = torch::zeros({}, f64), mtp_acc = torch::zeros({}, f64);
  double W = 0;

  for (int64_t micro = 0; micro < K; ++micro) {
    const MicroBatch batch = data_.data_loader_next(step, micro);
    out.sample_indices.insert(out.sample_indices.end(), batch.sample_indices.begin(),
                              batch.sample_indices.end());
    double w = 0;  // host-known: no device sync needed for the token count
    for (float m : batch.loss_mask) w += m;
    const auto t = to_device(batch, device_);

    torch::Tensor logits;  // (B, L, V) fp32
    {
      compat::AutocastGuard autocast(c.dtype == "bfloat16", device_.is_cuda());
      logits = model_->forward(t.inputs, t.positions, t.segment_ids);
    }
    auto sums = cross_entropy_sums(logits, t.targets, t.loss_mask, c.z_loss_multiplier);
    if (inject && micro == 0 && c.debug_inject_nonfinite_kind.rfind("loss_", 0) == 0) {
      // A non-finite constant in the loss: the gradient stays finite, the loss does not.
      sums.ce = sums.ce + (c.debug_inject_nonfinite_kind == "loss_nan"
                               ? std::numeric_limits<double>::quiet_NaN()
                               : std::numeric_limits<double>::infinity());
    }
    // Auxiliary-loss hooks (MoE load balancing, MTP): per-token-scale scalars, 0 for dense.
    const auto lb = torch::zeros({}, sums.ce.options());
    const auto mtp = torch::zeros({}, sums.ce.options());

    const double inv_w = 1.0 / std::max(w, 1.0);
    const auto objective = per_token ? sums.ce + (lb + mtp) * w : sums.ce * inv_w + lb + mtp;
    objective.backward();

    torch::NoGradGuard no_grad;
    const double term_weight = per_token ? 1.0 : inv_w;  // ce_i or ce_i / max(w_i, 1)
    const double aux_weight = per_token ? w : 1.0;        // (lb_i + mtp_i) * w_i or as is
    ce_acc.add_(sums.ce.detach().to(torch::kFloat64), term_weight);
    z_acc.add_(sums.z.to(torch::kFloat64), term_weight);
    lb_acc.add_(lb.to(torch::kFloat64), aux_weight);
    mtp_acc.add_(mtp.to(torch::kFloat64), aux_weight);
    W += w;
    if (inject && micro == 0 && c.debug_inject_nonfinite_kind.rfind("grad_", 0) == 0) {
      // A non-finite value that reaches only the gradient, as a bad backward kernel would.
      flat_grads_[0].fill_(c.debug_inject_nonfinite_kind == "grad_nan"
                           ? std::numeric_limits<float>::quiet_NaN()
                               : std::numeric_limits<float>::infinity());
    }
  }

  // The single normalization of the step. W = 0 (no target token anywhere) gives a zero
  // gradient and a skipped step, never 0/0.
  const double R = static_cast<double>(c.data_parallel_size);
  const double scale = per_token ? (W > 0 ? 1.0 / W : 0.0) : 1.0 / (R * static_cast<double>(K));
  torch::NoGradGuard no_grad;
  flat_grads_.mul_(scale);
  out.total_weights = W;
  out.lm_loss = ce_acc * scale;
  out.z_loss = z_acc * scale;
  out.moe_lb_loss = lb_acc * scale;
  out.mtp_loss = mtp_acc * scale;
  out.loss = out.lm_loss + out.moe_lb_loss + out.mtp_loss;
  out.raw_grad_norm = flat_grads_.norm();
  out.num_zeros = flat_grads_.eq(0).sum();
  return out;
}

}  // namespace trainer
