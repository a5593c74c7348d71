// Parameter count and FLOPs from the config (see model_size.h).
#include "trainer/model/model_size.h"

namespace trainer {

ModelSize model_size(const Config& c) {
  ModelSize s;
  const int64_t D = c.base_emb_dim, F = c.base_mlp_dim, V = c.vocab_size;
  const int64_t Hq = c.base_num_query_heads, Hkv = c.base_num_kv_heads, hd = c.head_dim;
  const int64_t attention = D * Hq * hd + 2 * D * Hkv * hd + Hq * hd * D;  // q, k, v, o
  const int64_t mlp = 3 * D * F;                                           // gate, up, down
  const int64_t norms = 2 * D + (c.use_qk_norm ? 2 * hd : 0);
  s.per_layer_params = attention + mlp + norms;
  s.embedding_params = V * D * (c.logits_via_embedding ? 1 : 2);
  s.total_params = s.embedding_params + c.base_num_decoder_layers * s.per_layer_params + D;

  // FLOPs: 2 per multiply-add, x3 for forward + backward.
  const double tokens = static_cast<double>(c.per_device_batch_size) *
                        static_cast<double>(c.gradient_accumulation_steps) *
                        static_cast<double>(c.max_target_length);
  const double L = static_cast<double>(c.max_target_length);
  const double layers = static_cast<double>(c.base_num_decoder_layers);
  const double ffn = 2.0 * tokens * static_cast<double>(mlp);
  const double qkv = 2.0 * tokens * D * static_cast<double>((Hq + 2 * Hkv) * hd);
  const double projection = 2.0 * tokens * D * static_cast<double>(Hq * hd);
  const double embedding = 2.0 * tokens * D * static_cast<double>(V);
  const double causal_attention = 4.0 * tokens * L * static_cast<double>(Hq * hd) / 2.0;
  s.learnable_weight_flops = 3.0 * ((ffn + qkv + projection) * layers + embedding);
  s.attention_flops = 3.0 * causal_attention * layers;
  s.flops_per_step_per_device = s.learnable_weight_flops + s.attention_flops;
  return s;
}

}  // namespace trainer
