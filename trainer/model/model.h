// Public face of model/: the Llama-family decoder (DESIGN section 4). Submodules are registered
// under Hugging Face Llama/Qwen3 names, so named_parameters() are the checkpoint keys:
// model.embed_tokens.weight, model.layers.N.self_attn.q_proj.weight, model.norm.weight, lm_head.weight.
#pragma once
#include <torch/torch.h>

#include "trainer/config/config.h"
#include "trainer/model/model_size.h"

namespace trainer {

// y = x / rms(x) * weight, computed in fp32 whatever the input dtype.
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;  // (dim)
 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

// Rotary embedding tables for explicit per-token positions (positions restart per document).
struct RopeTables {
  torch::Tensor cos;  // (B, 1, L, rotary_dim)
  torch::Tensor sin;  // (B, 1, L, rotary_dim)
};

// Causal grouped-query attention that only attends within the token's own segment.
class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const Config& config);
  // x: (B, L, D); allowed: (B, 1, L, L) bool, true where query i may attend to key j.
  torch::Tensor forward(const torch::Tensor& x, const RopeTables& rope, const torch::Tensor& allowed);
  torch::nn::Linear q_proj{nullptr};  // (Hq*hd, D)
  torch::nn::Linear k_proj{nullptr};  // (Hkv*hd, D)
  torch::nn::Linear v_proj{nullptr};  // (Hkv*hd, D)
  torch::nn::Linear o_proj{nullptr};  // (D, Hq*hd)
  RMSNorm q_norm{nullptr};            // (hd), only with use_qk_norm
  RMSNorm k_norm{nullptr};            // (hd), only with use_qk_norm
 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
};
TORCH_MODULE(Attention);

// SwiGLU: down(silu(gate(x)) * up(x)).
class MlpImpl : public torch::nn::Module {
 public:
  explicit MlpImpl(const Config& config);
  torch::Tensor forward(const torch::Tensor& x);
  torch::nn::Linear gate_proj{nullptr};  // (F, D)
  torch::nn::Linear up_proj{nullptr};    // (F, D)
  torch::nn::Linear down_proj{nullptr};  // (D, F)
};
TORCH_MODULE(Mlp);

class DecoderLayerImpl : public torch::nn::Module {
 public:
  explicit DecoderLayerImpl(const Config& config);
  torch::Tensor forward(const torch::Tensor& x, const RopeTables& rope, const torch::Tensor& allowed);
  RMSNorm input_layernorm{nullptr};
  Attention self_attn{nullptr};
  RMSNorm post_attention_layernorm{nullptr};
  Mlp mlp{nullptr};
};
TORCH_MODULE(DecoderLayer);

// The decoder stack without the output head ("model." in HF names).
class DecoderStackImpl : public torch::nn::Module {
 public:
  explicit DecoderStackImpl(const Config& config);
  torch::Tensor forward(const torch::Tensor& tokens, const torch::Tensor& positions,
                        const torch::Tensor& segment_ids);  // -> (B, L, D) after the final norm
  torch::nn::Embedding embed_tokens{nullptr};  // (V, D)
  torch::nn::ModuleList layers{nullptr};
  RMSNorm norm{nullptr};  // (D)
 private:
  int64_t rotary_dim_;
  double rope_theta_;
};
TORCH_MODULE(DecoderStack);

class TransformerImpl : public torch::nn::Module {
 public:
  explicit TransformerImpl(const Config& config);
  // tokens, positions, segment_ids: (B, L) int64. Returns logits (B, L, V) in fp32
  // (or float64 when the model was converted to float64, as gradient checks do).
  torch::Tensor forward(const torch::Tensor& tokens, const torch::Tensor& positions,
                        const torch::Tensor& segment_ids);
  DecoderStack model{nullptr};
  torch::nn::Linear lm_head{nullptr};  // (V, D); null with logits_via_embedding (tied)
};
TORCH_MODULE(Transformer);

// Builds the model on the CPU with deterministic weights from init_weights_seed:
// every Linear and the embedding ~ N(0, 0.02^2), norms = 1. Parameters are drawn in
// named_parameters() order from one generator, so the same seed gives the same weights
// on any device.
Transformer model_build(const Config& config);

}  // namespace trainer
