// The language-model cross-entropy sums of a micro-batch: from the (B, L, V) logits, or tiled
// from the head's input and weight so that no more than one tile's logits exist at a time
// (num_vocab_tiling; docs/training.md).
#pragma once
#include <torch/torch.h>

namespace trainer {

struct CrossEntropySums {
  torch::Tensor ce;  // sum over tokens of weight * (CE + z-loss term), differentiable
  torch::Tensor z;   // the z-loss part of ce, detached
};

// logits (B, L, V) fp32; targets (B, L) int64; token_weights (B, L) (the loss mask). Per token:
// lse - logit[target] + z * lse^2.
CrossEntropySums cross_entropy_sums(const torch::Tensor& logits, const torch::Tensor& targets,
                                    const torch::Tensor& token_weights, double z_loss_multiplier);

// The same sums with logits = hidden head_weight^T, computed over `tiles` tiles of rows of the
// flattened (B*L) tokens. The gradients with respect to hidden and head_weight are computed tile
// by tile in the forward and kept (a hidden-sized and a weight-sized tensor), so neither pass
// ever holds more than one tile's (rows, V) logits. hidden (..., D) as the model's final norm
// gives it; head_weight (V, D); targets and token_weights shaped like hidden without D.
// bf16_compute: the two GEMMs run in bf16 as under autocast (logits rounded to bf16, then fp32);
// otherwise in the promoted type of hidden and head_weight (fp32, or float64 in gradient checks).
CrossEntropySums cross_entropy_sums_tiled(const torch::Tensor& hidden, const torch::Tensor& head_weight,
                                          const torch::Tensor& targets, const torch::Tensor& token_weights,
                                          double z_loss_multiplier, int64_t tiles, bool bf16_compute);

}  // namespace trainer
