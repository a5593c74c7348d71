// Parameter count and training FLOPs computed from the config alone (no tensors allocated),
// so a 7B config can be checked on a laptop. Formulas in docs/model.md.
#pragma once
#include <cstdint>
#include <string>

#include "trainer/config/config.h"

namespace trainer {

struct ModelSize {
  int64_t total_params = 0;
  int64_t active_params = 0;        // used per token: k routed experts instead of all E
  int64_t embedding_params = 0;     // token embedding (+ separate output head when untied)
  int64_t per_layer_params = 0;     // one dense decoder layer
  int64_t mtp_params = 0;           // all MTP depths (included in the totals)
  int64_t mtp_active_params = 0;    // of active_params, the MTP depths' share
  int64_t routed_expert_params = 0; // the routed experts of every MoE layer (split by expert_parallelism)
  // MaxText's calculate_tflops_training_per_device: 3x forward FLOPs (forward + backward),
  // causal attention counted at half. Per device, per optimizer step (all K micro-batches).
  double flops_per_step_per_device = 0;
  double learnable_weight_flops = 0;  // the matmul-with-weights part of the above
  double attention_flops = 0;         // the QK^T and AV part of the above
};

ModelSize model_size(const Config& config);

// The query block of the LibTorch 1.13 attention core (model_detail::block_causal_attention), in
// positions; the memory plan counts its kept probabilities by it. 64 measured best of 32/64/128
// at L = 256 and 512 (docs/benchmarks.md).
constexpr int64_t kAttentionBlock = 64;

// The attention of layer `layer` (0-based; MTP depth k is layer base_num_decoder_layers + k - 1):
// "global", "mla" or "gla". With inhomogeneous_layer_cycle_interval = N > 0 (the Ling2 fork's
// pattern), layers with (layer + 1) % N == 0 and every MTP layer use attention_type, the rest
// GLA; with N = 0 every layer uses attention_type.
std::string model_layer_attention(const Config& config, int64_t layer);

}  // namespace trainer
