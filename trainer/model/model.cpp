// The Llama-family decoder (see model.h).
#include "trainer/model/model.h"

#include <ATen/CPUGeneratorImpl.h>

#include "trainer/util/torch_compat.h"

namespace trainer {

namespace F = torch::nn::functional;

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  // At least fp32 (bf16 inputs are upcast; float64, used by gradient checks, is kept).
  const auto wide = x.to(at::promote_types(x.scalar_type(), torch::kFloat32));
  const auto normed = wide * torch::rsqrt(wide.pow(2).mean(-1, /*keepdim=*/true) + eps_);
  return (normed * weight).to(x.scalar_type());
}

namespace {

torch::nn::Linear linear(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}

// HF rotate_half: pairs are (i, i + rotary_dim/2).
torch::Tensor rotate_half(const torch::Tensor& x) {
  const auto half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// x: (B, H, L, hd). Rotates the first rotary_dim dimensions, passes the rest through.
torch::Tensor apply_rope(const torch::Tensor& x, const RopeTables& rope) {
  const auto rotary_dim = rope.cos.size(-1);
  const auto cos = rope.cos.to(x.scalar_type()), sin = rope.sin.to(x.scalar_type());
  if (rotary_dim == x.size(-1)) return x * cos + rotate_half(x) * sin;
  const auto rot = x.narrow(-1, 0, rotary_dim);
  const auto pass = x.narrow(-1, rotary_dim, x.size(-1) - rotary_dim);
  return torch::cat({rot * cos + rotate_half(rot) * sin, pass}, -1);
}

}  // namespace

AttentionImpl::AttentionImpl(const Config& c)
    : num_heads_(c.base_num_query_heads), num_kv_heads_(c.base_num_kv_heads), head_dim_(c.head_dim) {
  q_proj = register_module("q_proj", linear(c.base_emb_dim, num_heads_ * head_dim_));
  k_proj = register_module("k_proj", linear(c.base_emb_dim, num_kv_heads_ * head_dim_));
  v_proj = register_module("v_proj", linear(c.base_emb_dim, num_kv_heads_ * head_dim_));
  o_proj = register_module("o_proj", linear(num_heads_ * head_dim_, c.base_emb_dim));
  if (c.use_qk_norm) {
    q_norm = register_module("q_norm", RMSNorm(head_dim_, c.normalization_layer_epsilon));
    k_norm = register_module("k_norm", RMSNorm(head_dim_, c.normalization_layer_epsilon));
  }
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const RopeTables& rope,
                                     const torch::Tensor& allowed) {
  const auto B = x.size(0), L = x.size(1);
  auto q = q_proj(x).view({B, L, num_heads_, head_dim_});     // (B, L, Hq, hd)
  auto k = k_proj(x).view({B, L, num_kv_heads_, head_dim_});  // (B, L, Hkv, hd)
  auto v = v_proj(x).view({B, L, num_kv_heads_, head_dim_});  // (B, L, Hkv, hd)
  if (q_norm) {
    q = q_norm(q);
    k = k_norm(k);
  }
  q = apply_rope(q.transpose(1, 2), rope);  // (B, Hq, L, hd)
  k = apply_rope(k.transpose(1, 2), rope);  // (B, Hkv, L, hd)
  v = v.transpose(1, 2);                    // (B, Hkv, L, hd)
  const auto group = num_heads_ / num_kv_heads_;
  if (group > 1) {  // query head h reads kv head h / group (HF repeat_kv)
    k = k.unsqueeze(2).expand({B, num_kv_heads_, group, L, head_dim_}).reshape({B, num_heads_, L, head_dim_});
    v = v.unsqueeze(2).expand({B, num_kv_heads_, group, L, head_dim_}).reshape({B, num_heads_, L, head_dim_});
  }
  const auto out = compat::masked_attention(q, k, v, allowed);  // (B, Hq, L, hd)
  return o_proj(out.transpose(1, 2).reshape({B, L, num_heads_ * head_dim_}));
}

MlpImpl::MlpImpl(const Config& c) {
  gate_proj = register_module("gate_proj", linear(c.base_emb_dim, c.base_mlp_dim));
  up_proj = register_module("up_proj", linear(c.base_emb_dim, c.base_mlp_dim));
  down_proj = register_module("down_proj", linear(c.base_mlp_dim, c.base_emb_dim));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  return down_proj(F::silu(gate_proj(x)) * up_proj(x));
}

DecoderLayerImpl::DecoderLayerImpl(const Config& c) {
  input_layernorm = register_module("input_layernorm", RMSNorm(c.base_emb_dim, c.normalization_layer_epsilon));
  self_attn = register_module("self_attn", Attention(c));
  post_attention_layernorm =
      register_module("post_attention_layernorm", RMSNorm(c.base_emb_dim, c.normalization_layer_epsilon));
  mlp = register_module("mlp", Mlp(c));
}

torch::Tensor DecoderLayerImpl::forward(const torch::Tensor& x, const RopeTables& rope,
                                        const torch::Tensor& allowed) {
  const auto h = x + self_attn(input_layernorm(x), rope, allowed);
  return h + mlp(post_attention_layernorm(h));
}

DecoderStackImpl::DecoderStackImpl(const Config& c)
    : rotary_dim_(static_cast<int64_t>(std::llround(c.partial_rotary_factor * static_cast<double>(c.head_dim)))),
      rope_theta_(c.rope_max_timescale) {
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(c.vocab_size, c.base_emb_dim));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.base_num_decoder_layers; ++i) layers->push_back(DecoderLayer(c));
  norm = register_module("norm", RMSNorm(c.base_emb_dim, c.normalization_layer_epsilon));
}

torch::Tensor DecoderStackImpl::forward(const torch::Tensor& tokens, const torch::Tensor& positions,
                                        const torch::Tensor& segment_ids) {
  const auto L = tokens.size(1);
  // RoPE in fp32: inv_freq_i = theta^(-2i/rotary_dim), angle = position * inv_freq.
  const auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(tokens.device());
  const auto inv_freq =
      torch::pow(rope_theta_, -torch::arange(0, rotary_dim_, 2, opts) / static_cast<double>(rotary_dim_));
  const auto angles = positions.to(torch::kFloat32).unsqueeze(-1) * inv_freq;  // (B, L, rot/2)
  const auto emb = torch::cat({angles, angles}, -1).unsqueeze(1);               // (B, 1, L, rot)
  const RopeTables rope{emb.cos(), emb.sin()};
  // Query i may attend key j when j <= i and both are in the same segment (packed documents).
  const auto causal = torch::ones({L, L}, torch::TensorOptions().dtype(torch::kBool).device(tokens.device())).tril();
  const auto same_segment = segment_ids.unsqueeze(2) == segment_ids.unsqueeze(1);  // (B, L, L)
  const auto allowed = (same_segment & causal).unsqueeze(1);                       // (B, 1, L, L)

  auto x = embed_tokens(tokens);  // (B, L, D)
  for (const auto& layer : *layers) x = layer->as<DecoderLayer>()->forward(x, rope, allowed);
  return norm(x);
}

TransformerImpl::TransformerImpl(const Config& c) {
  model = register_module("model", DecoderStack(c));
  if (!c.logits_via_embedding) lm_head = register_module("lm_head", linear(c.base_emb_dim, c.vocab_size));
}

torch::Tensor TransformerImpl::forward(const torch::Tensor& tokens, const torch::Tensor& positions,
                                       const torch::Tensor& segment_ids) {
  const auto hidden = model(tokens, positions, segment_ids);
  const auto logits = lm_head ? lm_head(hidden) : F::linear(hidden, model->embed_tokens->weight);
  return logits.to(at::promote_types(logits.scalar_type(), torch::kFloat32));
}

Transformer model_build(const Config& config) {
  Transformer model(config);
  auto generator = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(config.init_weights_seed));
  torch::NoGradGuard no_grad;
  for (auto& item : model->named_parameters()) {
    const auto& name = item.key();
    auto& p = item.value();
    const bool is_norm = name.size() > 11 && name.compare(name.size() - 11, 11, "norm.weight") == 0;
    if (is_norm)
      p.fill_(1.0);
    else
      p.normal_(0.0, 0.02, generator);
  }
  return model;
}

}  // namespace trainer
