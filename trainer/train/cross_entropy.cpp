// The cross-entropy sums of the LM loss, whole or tiled over the tokens (see cross_entropy.h).
#include "trainer/train/cross_entropy.h"

#include <algorithm>

#include "trainer/util/torch_compat.h"

namespace trainer {

namespace {

// For one token with weight w, logits x, s = softmax(x) and lse = logsumexp(x), the loss
//   f = w (lse - x_t + z lse^2)
// has d f / d x = w ((1 + 2 z lse) s - onehot_t), since d lse / d x = s. With g that (rows, V)
// gradient of a tile whose input rows are h (rows, D), and logits = h W^T:
//   d f / d h = g W   (rows, D),     d f / d W = g^T h   (V, D), summed over the tiles.

// One tile's sums, and (need_grad) its gradient written over its fp32 logits (n, V): w ((1 + 2 z
// lse) softmax - onehot), as derived above. targets (n, 1) int64, weights (n) fp32.
CrossEntropySums tile_sums_into_gradient(torch::Tensor& logits, const torch::Tensor& targets,
                                         const torch::Tensor& weights, double z_loss_multiplier, bool need_grad) {
  const auto lse = torch::logsumexp(logits, -1);                                  // (n)
  const auto z_rows = z_loss_multiplier * lse.square();                           // (n)
  CrossEntropySums sums{(weights * (lse - logits.gather(1, targets).squeeze(1) + z_rows)).sum(),
                        (weights * z_rows).sum()};
  if (need_grad) {
    logits.sub_(lse.unsqueeze(1)).exp_();                                         // (n, V) softmax
    logits.mul_((weights * (1 + 2 * z_loss_multiplier * lse)).unsqueeze(1));
    logits.scatter_add_(1, targets, -weights.unsqueeze(1));
  }
  return sums;
}

// Both nodes below compute their input gradients in the forward (ce enters the objective
// linearly); the backward takes each kept gradient out of the node (saved_data lives as long as
// the graph: a (N, V) or (V, D) tensor is freed now, not with the graph) and scales it by
// d objective / d ce, a 0-dim tensor.
torch::Tensor take_kept_gradient_scaled(torch::autograd::AutogradContext* ctx, const std::string& key,
                                        const torch::Tensor& scale, const char* node) {
  TORCH_CHECK(ctx->saved_data.count(key), node, ": backward ran twice (its kept gradients are freed after the first)");
  const auto kept = ctx->saved_data[key].toTensor();
  ctx->saved_data.erase(key);
  return kept * scale.to(kept.scalar_type());
}

// The whole head's sums with z-loss from its (B, L, V) logits. logsumexp + gather would keep the
// logits and make two more (B, L, V) tensors in their backward; this makes the gradient once, in the
// forward, in a copy of the logits, keeps it instead of them and only scales it in the backward.
class LogitsCrossEntropy : public torch::autograd::Function<LogitsCrossEntropy> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& logits,
                                                const torch::Tensor& targets, const torch::Tensor& token_weights,
                                                double z_loss_multiplier, bool need_grad) {
    const int64_t V = logits.size(-1);
    const auto accumulate = at::promote_types(logits.scalar_type(), torch::kFloat32);
    auto grad = logits.reshape({-1, V}).to(accumulate, /*non_blocking=*/false, /*copy=*/true);  // (N, V)
    const auto w = token_weights.reshape({-1}).to(accumulate);                                    // (N)
    auto sums = tile_sums_into_gradient(grad, targets.reshape({-1, 1}), w, z_loss_multiplier, need_grad);
    if (need_grad) ctx->saved_data["grad"] = grad.view(logits.sizes()).to(logits.scalar_type());
    ctx->mark_non_differentiable({sums.z});
    return {sums.ce, sums.z};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto& scale = grad_outputs[0];  // 0-dim: d objective / d ce
    torch::Tensor grad_logits;
    if (scale.defined()) grad_logits = take_kept_gradient_scaled(ctx, "grad", scale, "LogitsCrossEntropy");
    return {grad_logits, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

// The tiled head: g W and g^T h are computed in the forward, where the tile's logits exist anyway,
// and kept; the backward only scales them by the incoming gradient (ce enters the objective
// linearly). That costs no extra GEMM, unlike recomputing the logits in the backward, and the
// (B*L, V) logits and their gradient never exist whole.
class TiledCrossEntropy : public torch::autograd::Function<TiledCrossEntropy> {
 public:
  // Returns {ce, z}: ce differentiable with respect to hidden and head_weight, z not.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& hidden,
                                                const torch::Tensor& head_weight, const torch::Tensor& targets,
                                                const torch::Tensor& token_weights, double z_loss_multiplier,
                                                int64_t tiles, bool bf16_compute, bool need_grads) {
    const int64_t D = hidden.size(-1), N = targets.numel(), V = head_weight.size(0);
    // Explicit dtypes below: the caller's autocast (if any) must not re-cast the tile GEMMs.
    compat::AutocastOffGuard no_autocast(hidden.is_cuda());
    const auto compute = bf16_compute ? torch::kBFloat16 : at::promote_types(hidden.scalar_type(), head_weight.scalar_type());
    const auto accumulate = at::promote_types(compute, torch::kFloat32);  // the logits' and sums' type
    const auto h = hidden.reshape({N, D});                                // (N, D)
    const auto t = targets.reshape({N});                                  // (N)
    const auto w = token_weights.reshape({N}).to(accumulate);             // (N)
    const auto weight_c = head_weight.to(compute);                        // (V, D)
    // The GEMMs' operand dtype: compute's, or fp32 for bf16 on a CPU whose LibTorch sums bf16
    // products in bf16 (compat::cpu_bf16_gemm_via_fp32); their products are rounded to compute.
    const auto gemm = compat::gemm_operand_dtype(weight_c);
    const auto weight_g = weight_c.to(gemm);                              // (V, D)
    // Without gradients (evaluation) only the sums are computed.
    auto grad_hidden = need_grads ? torch::empty({N, D}, hidden.options()) : torch::Tensor();       // (N, D)
    auto grad_weight = need_grads ? torch::zeros({V, D}, head_weight.options()) : torch::Tensor();  // (V, D)
    auto ce = torch::zeros({}, w.options()), z = torch::zeros({}, w.options());
    const int64_t n_tiles = std::max<int64_t>(tiles, 1), rows = std::max<int64_t>(1, (N + n_tiles - 1) / n_tiles);
    for (int64_t first = 0; first < N; first += rows) {
      const int64_t n = std::min(rows, N - first);
      const auto h_tile = h.narrow(0, first, n).to(compute).to(gemm);                 // (n, D)
      const auto t_tile = t.narrow(0, first, n).unsqueeze(1);                         // (n, 1)
      const auto w_tile = w.narrow(0, first, n);                                      // (n)
      auto grad = h_tile.mm(weight_g.t()).to(compute).to(accumulate);  // (n, V) the logits, then their gradient
      const auto tile = tile_sums_into_gradient(grad, t_tile, w_tile, z_loss_multiplier, need_grads);
      ce.add_(tile.ce);
      z.add_(tile.z);
      if (!need_grads) continue;
      const auto grad_c = grad.to(compute).to(gemm);                                 // (n, V)
      grad_hidden.narrow(0, first, n).copy_(grad_c.mm(weight_g).to(compute));
      if (compute == grad_weight.scalar_type() && gemm == compute)
        grad_weight.addmm_(grad_c.t(), h_tile);  // accumulated by the GEMM itself: no (V, D) temporary
      else
        grad_weight.add_(grad_c.t().mm(h_tile).to(compute));  // bf16 product, summed over tiles in fp32
    }
    if (need_grads) {
      ctx->saved_data["grad_hidden"] = grad_hidden.view(hidden.sizes());
      ctx->saved_data["grad_weight"] = grad_weight;
    }
    ctx->mark_non_differentiable({z});
    return {ce, z};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto& scale = grad_outputs[0];  // 0-dim: d objective / d ce
    torch::Tensor grad_hidden, grad_weight;
    if (scale.defined()) {
      grad_hidden = take_kept_gradient_scaled(ctx, "grad_hidden", scale, "TiledCrossEntropy");
      grad_weight = take_kept_gradient_scaled(ctx, "grad_weight", scale, "TiledCrossEntropy");
    }
    return {grad_hidden, grad_weight, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor()};
  }
};

}  // namespace

// Without z-loss, LibTorch's cross_entropy (log_softmax + nll) computes lse - logit: its backward
// keeps only the log-probabilities. With z-loss, LogitsCrossEntropy (no logsumexp + gather, whose
// backward makes several (B, L, V) tensors; at a 128K vocabulary each is gigabytes).
CrossEntropySums cross_entropy_sums(const torch::Tensor& logits, const torch::Tensor& targets,
                                    const torch::Tensor& token_weights, double z_loss_multiplier) {
  if (z_loss_multiplier == 0) {
    const auto V = logits.size(-1);
    const auto per_token = torch::nn::functional::cross_entropy(
        logits.reshape({-1, V}), targets.reshape({-1}),
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));  // (B*L)
    return {(per_token.view_as(token_weights) * token_weights).sum(), torch::zeros({}, logits.options())};
  }
  const bool need_grad = torch::GradMode::is_enabled() && logits.requires_grad();
  const auto out = LogitsCrossEntropy::apply(logits, targets, token_weights, z_loss_multiplier, need_grad);
  return {out[0], out[1]};
}

CrossEntropySums cross_entropy_sums_tiled(const torch::Tensor& hidden, const torch::Tensor& head_weight,
                                          const torch::Tensor& targets, const torch::Tensor& token_weights,
                                          double z_loss_multiplier, int64_t tiles, bool bf16_compute) {
  const bool need_grads = torch::GradMode::is_enabled() && (hidden.requires_grad() || head_weight.requires_grad());
  const auto out = TiledCrossEntropy::apply(hidden, head_weight, targets, token_weights, z_loss_multiplier, tiles,
                                            bf16_compute, need_grads);
  return {out[0], out[1]};
}

}  // namespace trainer
