// Helpers for the numerical tests: a float64 copy of a trainer's model, a micro-batch's masked
// cross-entropy recomputed from logits, and central differences.
#pragma once
#include <map>

#include <torch/torch.h>

#include "trainer/train/train.h"

namespace trainer::testing {

// A float64 copy of the trainer's current model, for independent recomputation.
inline Transformer float64_copy(Trainer& t) {
  auto copy = model_build(t.config());
  copy->to(torch::kFloat64);
  torch::NoGradGuard no_grad;
  auto src = t.model()->named_parameters();
  for (auto& item : copy->named_parameters()) item.value().copy_(src[item.key()]);
  return copy;
}

// A model's checkpoint tensors by Hugging Face name (one view per routed expert), or the views
// of their gradients (gradients = true).
inline std::map<std::string, torch::Tensor> checkpoint_tensors(Transformer& model, bool gradients = false) {
  NamedTensors by_parameter;
  for (const auto& item : model->named_parameters())
    by_parameter.emplace_back(item.key(), gradients ? item.value().grad() : item.value());
  const auto views = model_checkpoint_views(by_parameter);
  return {views.begin(), views.end()};
}

// A micro-batch field (B * L values, row-major) as a (B, L) tensor.
inline torch::Tensor micro_batch_tensor(const std::vector<int64_t>& values, const MicroBatch& b) {
  return torch::tensor(values).view({b.batch_size, b.seq_len});
}

// The cross-entropy summed over b's unmasked targets and their count, in float64 from logits (B, L, V)
// via log_softmax (the trainer uses logsumexp - gather).
struct MaskedCrossEntropy {
  double sum = 0, count = 0;
};
inline MaskedCrossEntropy masked_cross_entropy(const torch::Tensor& logits, const MicroBatch& b) {
  const auto logp = torch::log_softmax(logits.to(torch::kFloat64), -1)
                        .gather(-1, micro_batch_tensor(b.targets, b).unsqueeze(-1))
                        .squeeze(-1);
  const auto mask = torch::tensor(b.loss_mask).view({b.batch_size, b.seq_len}).to(torch::kFloat64);
  return {(-logp * mask).sum().item<double>(), mask.sum().item<double>()};
}

// (f(p + h) - f(p - h)) / 2h for element `index` of a float64 parameter; restores the element.
template <typename Objective>
double central_difference(torch::Tensor parameter, int64_t index, Objective&& objective, double h = 1e-5) {
  torch::NoGradGuard no_grad;
  auto flat = parameter.view(-1);
  const double original = flat[index].item<double>();
  flat[index].fill_(original + h);
  const double up = objective();
  flat[index].fill_(original - h);
  const double down = objective();
  flat[index].fill_(original);
  return (up - down) / (2 * h);
}

}  // namespace trainer::testing
