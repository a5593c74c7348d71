// Parameter count and FLOPs from the config (see model_size.h and docs/model.md).
#include "trainer/model/model_size.h"

namespace trainer {

ModelSize model_size(const Config& c) {
  ModelSize s;
  const int64_t D = c.base_emb_dim, F = c.base_mlp_dim, V = c.vocab_size;
  const int64_t Hq = c.base_num_query_heads, Hkv = c.base_num_kv_heads, hd = c.head_dim;
  const int64_t N = c.base_num_decoder_layers;
  const bool moe = c.num_experts > 1;
  const int64_t E = c.num_experts, k = c.num_experts_per_tok, Fm = c.base_moe_mlp_dim;
  const int64_t moe_layers = moe ? N - c.first_num_dense_layers : 0;
  const int64_t dense_layers = N - moe_layers;

  const int64_t attention = D * Hq * hd + 2 * D * Hkv * hd + Hq * hd * D;  // q, k, v, o
  const int64_t norms = 2 * D + (c.use_qk_norm ? 2 * hd : 0);
  const int64_t dense_mlp = 3 * D * F;                                     // gate, up, down
  const int64_t shared = 3 * D * Fm * c.shared_experts;
  const int64_t moe_mlp_total = E * D + E * 3 * D * Fm + shared;           // router + experts + shared
  const int64_t moe_mlp_active = E * D + k * 3 * D * Fm + shared;
  // e/hnorm, eh_proj, the block (its MLP dense, or MoE with mtp_moe_mlp), head norm
  const int64_t mtp_block = 2 * D + 2 * D * D + attention + norms + D;
  const int64_t mtp_depth = mtp_block + (c.mtp_moe_mlp ? moe_mlp_total : dense_mlp);
  const int64_t mtp_depth_active = mtp_block + (c.mtp_moe_mlp ? moe_mlp_active : dense_mlp);

  s.per_layer_params = attention + norms + dense_mlp;
  s.embedding_params = V * D * (c.logits_via_embedding ? 1 : 2);
  const int64_t common = s.embedding_params + N * (attention + norms) + dense_layers * dense_mlp + D;
  s.total_params = common + moe_layers * moe_mlp_total + c.mtp_num_layers * mtp_depth;
  s.routed_expert_params = (moe_layers + (c.mtp_moe_mlp ? c.mtp_num_layers : 0)) * E * 3 * D * Fm;
  s.active_params = common + moe_layers * moe_mlp_active + c.mtp_num_layers * mtp_depth_active;
  s.mtp_params = c.mtp_num_layers * mtp_depth;
  s.mtp_active_params = c.mtp_num_layers * mtp_depth_active;

  // FLOPs: 2 per multiply-add, x3 for forward + backward (MaxText's calculate_tflops_training_per_device).
  const double T = static_cast<double>(c.per_device_batch_size) * static_cast<double>(c.gradient_accumulation_steps) *
                   static_cast<double>(c.max_target_length);
  const double L = static_cast<double>(c.max_target_length);
  const double attention_weights = 2.0 * T * D * static_cast<double>((Hq + 2 * Hkv) * hd)  // qkv
                                   + 2.0 * T * D * static_cast<double>(Hq * hd);            // projection
  const double dense_ffn = 2.0 * T * static_cast<double>(dense_mlp);
  const double moe_ffn = 2.0 * T * static_cast<double>(moe_mlp_active);  // router + k experts + shared
  const double head = 2.0 * T * D * static_cast<double>(V);
  const double causal_attention = 4.0 * T * L * static_cast<double>(Hq * hd) / 2.0;
  const double mtp = static_cast<double>(c.mtp_num_layers) *
                     (2.0 * T * 2 * D * D + attention_weights + (c.mtp_moe_mlp ? moe_ffn : dense_ffn) + head);
  s.learnable_weight_flops = 3.0 * (static_cast<double>(N) * attention_weights + dense_layers * dense_ffn +
                                    moe_layers * moe_ffn + head + mtp);
  s.attention_flops = 3.0 * causal_attention * static_cast<double>(N + c.mtp_num_layers);
  s.flops_per_step_per_device = s.learnable_weight_flops + s.attention_flops;
  return s;
}

}  // namespace trainer
