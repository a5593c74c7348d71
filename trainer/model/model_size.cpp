// Parameter count and FLOPs from the config (see model_size.h and docs/model.md).
#include "trainer/model/model_size.h"

namespace trainer {

std::string model_layer_attention(const Config& c, int64_t layer) {
  const int64_t interval = c.inhomogeneous_layer_cycle_interval;
  if (interval == 0 || layer >= c.base_num_decoder_layers || (layer + 1) % interval == 0) return c.attention_type;
  return "gla";
}

namespace {

// One layer's attention: its parameters (projections and norms, not the layer's two RMSNorms),
// and its forward FLOPs per token split into weight matmuls and token mixing (scores and values
// for softmax attention, counted at half for causality; the GLA core per its chunked form), as in
// the Ling2 fork's calculate_mla_tflops_per_device / calculate_gla_flops_per_device.
struct AttentionCost {
  int64_t params = 0;
  double weight_flops_per_token = 0;
  double mixing_flops_per_token = 0;
};

AttentionCost attention_cost(const Config& c, const std::string& kind) {
  const double D = static_cast<double>(c.base_emb_dim), L = static_cast<double>(c.max_target_length);
  const int64_t Hq = c.base_num_query_heads, Hkv = c.base_num_kv_heads, hd = c.head_dim, Dm = c.base_emb_dim;
  AttentionCost cost;
  if (kind == "mla") {
    const int64_t qk = c.qk_nope_head_dim + c.qk_rope_head_dim, rq = c.q_lora_rank, rkv = c.kv_lora_rank;
    const int64_t q_params = rq > 0 ? Dm * rq + rq + rq * Hq * qk : Dm * Hq * qk;
    const int64_t kv_params = Dm * (rkv + c.qk_rope_head_dim) + rkv + rkv * Hq * (c.qk_nope_head_dim + c.v_head_dim);
    cost.params = q_params + kv_params + Hq * c.v_head_dim * Dm;
    cost.weight_flops_per_token = 2.0 * static_cast<double>(q_params - (rq > 0 ? rq : 0) + kv_params - rkv) +
                                  2.0 * static_cast<double>(Hq * c.v_head_dim) * D;
    cost.mixing_flops_per_token = 2.0 * L * static_cast<double>(Hq * (qk + c.v_head_dim)) / 2.0;
  } else if (kind == "gla") {
    const int64_t width = Hq * hd;
    cost.params = 5 * Dm * width + (c.use_qk_norm ? 2 * hd : 0) + width;  // q, k, v, g, o; norms
    cost.weight_flops_per_token = 2.0 * D * 5.0 * static_cast<double>(width);
    cost.mixing_flops_per_token = 2.0 * static_cast<double>(Hq * c.gla_chunk_size * 2 * hd) +  // within chunks
                                  4.0 * static_cast<double>(Hq * hd * hd);                      // state read and write
  } else {
    cost.params = Dm * Hq * hd + 2 * Dm * Hkv * hd + Hq * hd * Dm + (c.use_qk_norm ? 2 * hd : 0);
    cost.weight_flops_per_token = 2.0 * D * static_cast<double>((Hq + 2 * Hkv) * hd) + 2.0 * D * static_cast<double>(Hq * hd);
    cost.mixing_flops_per_token = 4.0 * L * static_cast<double>(Hq * hd) / 2.0;
  }
  return cost;
}

}  // namespace

ModelSize model_size(const Config& c) {
  ModelSize s;
  const int64_t D = c.base_emb_dim, F = c.base_mlp_dim, V = c.vocab_size;
  const int64_t N = c.base_num_decoder_layers;
  const bool moe = c.num_experts > 1;
  const int64_t E = c.num_experts, k = c.num_experts_per_tok, Fm = c.base_moe_mlp_dim;
  const int64_t moe_layers = moe ? N - c.first_num_dense_layers : 0;
  const int64_t dense_layers = N - moe_layers;

  const AttentionCost global_attention = attention_cost(c, "global");
  int64_t attention_all = 0;  // every decoder layer's attention
  double attention_weight_flops = 0, attention_mixing_flops = 0;  // per token, all decoder layers
  for (int64_t i = 0; i < N; ++i) {
    const AttentionCost a = attention_cost(c, model_layer_attention(c, i));
    attention_all += a.params;
    attention_weight_flops += a.weight_flops_per_token;
    attention_mixing_flops += a.mixing_flops_per_token;
  }
  const AttentionCost mtp_attention = attention_cost(c, model_layer_attention(c, N));  // MTP layers: attention_type
  const int64_t norms = 2 * D;                                             // the layer's two RMSNorms
  const int64_t dense_mlp = 3 * D * F;                                     // gate, up, down
  const int64_t shared = 3 * D * (c.moe_shared_expert_dim > 0 ? c.moe_shared_expert_dim : Fm) * c.shared_experts;
  const int64_t moe_mlp_total = E * D + E * 3 * D * Fm + shared;           // router + experts + shared
  const int64_t moe_mlp_active = E * D + k * 3 * D * Fm + shared;
  // e/hnorm, eh_proj, the block (its MLP dense, or MoE with mtp_moe_mlp), head norm
  const int64_t mtp_block = 2 * D + 2 * D * D + mtp_attention.params + norms + D;
  const int64_t mtp_depth = mtp_block + (c.mtp_moe_mlp ? moe_mlp_total : dense_mlp);
  const int64_t mtp_depth_active = mtp_block + (c.mtp_moe_mlp ? moe_mlp_active : dense_mlp);

  s.per_layer_params = global_attention.params + norms + dense_mlp;
  s.embedding_params = V * D * (c.logits_via_embedding ? 1 : 2);
  const int64_t common = s.embedding_params + attention_all + N * norms + dense_layers * dense_mlp + D;
  s.total_params = common + moe_layers * moe_mlp_total + c.mtp_num_layers * mtp_depth;
  s.routed_expert_params = (moe_layers + (c.mtp_moe_mlp ? c.mtp_num_layers : 0)) * E * 3 * D * Fm;
  s.active_params = common + moe_layers * moe_mlp_active + c.mtp_num_layers * mtp_depth_active;
  s.mtp_params = c.mtp_num_layers * mtp_depth;
  s.mtp_active_params = c.mtp_num_layers * mtp_depth_active;

  // FLOPs: 2 per multiply-add, x3 for forward + backward (MaxText's calculate_tflops_training_per_device).
  const double T = static_cast<double>(c.per_device_batch_size) * static_cast<double>(c.gradient_accumulation_steps) *
                   static_cast<double>(c.max_target_length);
  const double dense_ffn = 2.0 * T * static_cast<double>(dense_mlp);
  const double moe_ffn = 2.0 * T * static_cast<double>(moe_mlp_active);  // router + k experts + shared
  const double head = 2.0 * T * D * static_cast<double>(V);
  const double mtp = static_cast<double>(c.mtp_num_layers) *
                     (2.0 * T * 2 * D * D + T * mtp_attention.weight_flops_per_token + (c.mtp_moe_mlp ? moe_ffn : dense_ffn) + head);
  s.learnable_weight_flops = 3.0 * (T * attention_weight_flops + dense_layers * dense_ffn + moe_layers * moe_ffn + head + mtp);
  s.attention_flops = 3.0 * T * (attention_mixing_flops + static_cast<double>(c.mtp_num_layers) * mtp_attention.mixing_flops_per_token);
  s.flops_per_step_per_device = s.learnable_weight_flops + s.attention_flops;
  return s;
}

}  // namespace trainer
