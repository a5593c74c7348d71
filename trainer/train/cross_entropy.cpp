// The cross-entropy sums of the LM loss, whole or tiled over the tokens (see cross_entropy.h).
#include "trainer/train/cross_entropy.h"

#include <algorithm>

#include "trainer/util/torch_compat.h"

namespace trainer {

// Without z-loss, LibTorch's cross_entropy (log_softmax + nll) computes the same lse - logit:
// its backward keeps only the log-probabilities and makes one (B, L, V) gradient, where
// logsumexp + gather keep the logits and make two; at a 128K vocabulary that is gigabytes.
CrossEntropySums cross_entropy_sums(const torch::Tensor& logits, const torch::Tensor& targets,
                                    const torch::Tensor& token_weights, double z_loss_multiplier) {
  if (z_loss_multiplier == 0) {
    const auto V = logits.size(-1);
    const auto per_token = torch::nn::functional::cross_entropy(
        logits.reshape({-1, V}), targets.reshape({-1}),
        torch::nn::functional::CrossEntropyFuncOptions().reduction(torch::kNone));  // (B*L)
    return {(per_token.view_as(token_weights) * token_weights).sum(), torch::zeros({}, logits.options())};
  }
  const auto lse = torch::logsumexp(logits, -1);                                  // (B, L)
  const auto target_logit = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1);  // (B, L)
  const auto z = z_loss_multiplier * lse.square();
  return {((lse - target_logit + z) * token_weights).sum(), (z.detach() * token_weights).sum()};
}

namespace {

// For one token with weight w, logits x, s = softmax(x) and lse = logsumexp(x), the loss
//   f = w (lse - x_t + z lse^2)
// has d f / d x = w ((1 + 2 z lse) s - onehot_t), since d lse / d x = s. With g that (rows, V)
// gradient of a tile whose input rows are h (rows, D), and logits = h W^T:
//   d f / d h = g W   (rows, D),     d f / d W = g^T h   (V, D), summed over the tiles.
// Both are computed in the forward, where the tile's logits exist anyway, and kept; the backward
// only scales them by the incoming gradient (ce enters the objective linearly). That costs no
// extra GEMM, unlike recomputing the logits in the backward, and the (B*L, V) logits and their
// gradient never exist whole.
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
      auto logits = h_tile.mm(weight_g.t()).to(compute).to(accumulate);              // (n, V)
      const auto lse = torch::logsumexp(logits, -1);                                  // (n)
      const auto z_tile = z_loss_multiplier * lse.square();                           // (n)
      ce.add_((w_tile * (lse - logits.gather(1, t_tile).squeeze(1) + z_tile)).sum());
      z.add_((w_tile * z_tile).sum());
      if (!need_grads) continue;
      // The tile's gradient, in place of its logits: w ((1 + 2 z lse) softmax - onehot).
      auto& grad = logits.sub_(lse.unsqueeze(1)).exp_();                              // (n, V) softmax
      grad.mul_((w_tile * (1 + 2 * z_loss_multiplier * lse)).unsqueeze(1));
      grad.scatter_add_(1, t_tile, -w_tile.unsqueeze(1));
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
    if (scale.defined() && ctx->saved_data.count("grad_hidden")) {
      const auto kept_hidden = ctx->saved_data["grad_hidden"].toTensor(), kept_weight = ctx->saved_data["grad_weight"].toTensor();
      grad_hidden = kept_hidden * scale.to(kept_hidden.scalar_type());
      grad_weight = kept_weight * scale.to(kept_weight.scalar_type());
    }
    return {grad_hidden, grad_weight, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor(),
            torch::Tensor()};
  }
};

}  // namespace

CrossEntropySums cross_entropy_sums_tiled(const torch::Tensor& hidden, const torch::Tensor& head_weight,
                                          const torch::Tensor& targets, const torch::Tensor& token_weights,
                                          double z_loss_multiplier, int64_t tiles, bool bf16_compute) {
  const bool need_grads = torch::GradMode::is_enabled() && (hidden.requires_grad() || head_weight.requires_grad());
  const auto out = TiledCrossEntropy::apply(hidden, head_weight, targets, token_weights, z_loss_multiplier, tiles,
                                            bf16_compute, need_grads);
  return {out[0], out[1]};
}

}  // namespace trainer
