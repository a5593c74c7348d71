// The attention variants of the Ling2 hybrid (see model.h): multi-head latent attention (MLA) and
// gated linear attention (GLA) with its chunked parallel form, and the GLA output's GroupRMSNorm.
// Formulas and the chunked derivation are in docs/model.md.
#include <cmath>

#include "trainer/model/layers.h"
#include "trainer/model/model.h"
#include "trainer/util/torch_compat.h"

namespace trainer {

namespace F = torch::nn::functional;
using model_detail::apply_rope;
using model_detail::linear;
using model_detail::linear_fused;

GroupRMSNormImpl::GroupRMSNormImpl(int64_t dim, int64_t groups, double eps) : groups_(groups), eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor GroupRMSNormImpl::forward(const torch::Tensor& x) {
  const auto wide = x.to(at::promote_types(x.scalar_type(), torch::kFloat32));
  auto grouped_shape = wide.sizes().vec();
  grouped_shape.back() /= groups_;
  grouped_shape.insert(grouped_shape.end() - 1, groups_);
  const auto grouped = wide.reshape(grouped_shape);  // (..., groups, dim / groups)
  const auto normed = (grouped * torch::rsqrt(grouped.pow(2).mean(-1, /*keepdim=*/true) + eps_)).reshape(wide.sizes());
  return (normed * weight).to(x.scalar_type());
}

// ---------------------------------------------------------------------------------------- MLA

MlaAttentionImpl::MlaAttentionImpl(const Config& c)
    : num_heads_(c.base_num_query_heads),
      q_lora_rank_(c.q_lora_rank),
      kv_lora_rank_(c.kv_lora_rank),
      nope_dim_(c.qk_nope_head_dim),
      rope_dim_(c.qk_rope_head_dim),
      v_dim_(c.v_head_dim),
      interleaved_rope_(c.mla_interleaved_rope) {
  const int64_t D = c.base_emb_dim, qk_dim = nope_dim_ + rope_dim_;
  if (q_lora_rank_ > 0) {
    q_a_proj = register_module("q_a_proj", linear(D, q_lora_rank_));
    q_a_layernorm = register_module("q_a_layernorm", RMSNorm(q_lora_rank_, c.normalization_layer_epsilon));
    q_b_proj = register_module("q_b_proj", linear(q_lora_rank_, num_heads_ * qk_dim));
  } else {
    q_proj = register_module("q_proj", linear(D, num_heads_ * qk_dim));
  }
  kv_a_proj_with_mqa = register_module("kv_a_proj_with_mqa", linear(D, kv_lora_rank_ + rope_dim_));
  kv_a_layernorm = register_module("kv_a_layernorm", RMSNorm(kv_lora_rank_, c.normalization_layer_epsilon));
  kv_b_proj = register_module("kv_b_proj", linear(kv_lora_rank_, num_heads_ * (nope_dim_ + v_dim_)));
  o_proj = register_module("o_proj", linear(num_heads_ * v_dim_, D));
  softmax_scale = 1.0 / std::sqrt(static_cast<double>(qk_dim));
  if (c.max_position_embeddings > c.original_max_position_embeddings) {
    const double m = 0.1 * c.mscale * std::log(c.rope_factor) + 1.0;
    softmax_scale *= m * m;
  }
}

torch::Tensor MlaAttentionImpl::forward(const torch::Tensor& x, const RopeTables& rope, const torch::Tensor& allowed) {
  const auto B = x.size(0), L = x.size(1), H = num_heads_, qk_dim = nope_dim_ + rope_dim_;
  // The two projections of x run as one GEMM: [q_a (or q); kv_a].
  const auto first = q_lora_rank_ > 0 ? q_a_proj->weight : q_proj->weight;
  const auto q_width = first.size(0);
  const auto projected = linear_fused(x, {first, kv_a_proj_with_mqa->weight})  // (B, L, q_width + r_kv + rope)
                             .split_with_sizes({q_width, kv_lora_rank_, rope_dim_}, -1);
  auto q = projected[0];
  if (q_lora_rank_ > 0) q = q_b_proj(q_a_layernorm(q));
  q = q.view({B, L, H, qk_dim}).transpose(1, 2);                                          // (B, H, L, nope + rope)
  const auto latent = kv_a_layernorm(projected[1]);  // (B, L, r_kv)
  auto k_pe = projected[2].unsqueeze(1);             // (B, 1, L, rope)
  const auto kv = kv_b_proj(latent).view({B, L, H, nope_dim_ + v_dim_}).transpose(1, 2);  // (B, H, L, nope + v)
  auto q_pe = q.narrow(-1, nope_dim_, rope_dim_);  // (B, H, L, rope)
  if (interleaved_rope_) {
    // Pairs (2i, 2i+1) become (i, i + rope/2): [evens | odds], then rotate_half RoPE. q and k are
    // permuted alike, so q.k is that of interleaved RoPE (the fork keeps this layout too).
    const auto deinterleave = [](const torch::Tensor& t) {
      auto shape = t.sizes().vec();
      const auto d = shape.back();
      shape.back() = d / 2;
      shape.push_back(2);
      return t.reshape(shape).transpose(-1, -2).reshape(t.sizes());
    };
    q_pe = deinterleave(q_pe);
    k_pe = deinterleave(k_pe);
  }
  const auto cos = rope.cos.to(q.scalar_type()), sin_signed = rope.sin_signed.to(q.scalar_type());
  q_pe = apply_rope(q_pe, cos, sin_signed);
  k_pe = apply_rope(k_pe, cos, sin_signed);
  // causal_attention scales by qk_dim^-1/2; the rest of softmax_scale (mscale) goes into q.
  const double extra = softmax_scale * std::sqrt(static_cast<double>(qk_dim));
  auto query = torch::cat({q.narrow(-1, 0, nope_dim_), q_pe}, -1);  // (B, H, L, nope + rope)
  if (std::abs(extra - 1.0) > 1e-12) query = query * extra;
  const auto key = torch::cat({kv.narrow(-1, 0, nope_dim_), k_pe.expand({B, H, L, rope_dim_})}, -1);  // (B, H, L, nope + rope)
  const auto value = kv.narrow(-1, nope_dim_, v_dim_);                                                 // (B, H, L, v)
  // The fused kernels take v as wide as q and k (compat::attention_pads_value): zero columns
  // added, and the output's matching zero columns dropped.
  const bool pad = compat::kFusedCausalAttention && compat::attention_pads_value(query, key, value, allowed);
  const auto out = pad ? model_detail::causal_attention(query, key, F::pad(value, F::PadFuncOptions({0, qk_dim - v_dim_})), allowed)
                             .narrow(-1, 0, v_dim_)
                       : model_detail::causal_attention(query, key, value.contiguous(), allowed);  // (B, H, L, v)
  return o_proj(out.transpose(1, 2).reshape({B, L, H * v_dim_}));
}

// ---------------------------------------------------------------------------------------- GLA

std::vector<double> model_gla_head_slopes(int64_t heads) {
  const auto power_of_two = [](int64_t n) {
    const double start = std::pow(2.0, -std::pow(2.0, -(std::log2(static_cast<double>(n)) - 3)));
    std::vector<double> out;
    for (int64_t i = 0; i < n; ++i) out.push_back(start * std::pow(start, static_cast<double>(i)));
    return out;
  };
  const double log2n = std::log2(static_cast<double>(heads));
  if (std::floor(log2n) == log2n) return power_of_two(heads);
  const int64_t closest = int64_t{1} << static_cast<int64_t>(std::floor(log2n));
  auto out = power_of_two(closest);
  const auto wider = model_gla_head_slopes(2 * closest);
  for (int64_t i = 0; static_cast<int64_t>(out.size()) < heads; i += 2) out.push_back(wider[i]);
  return out;
}

GlaAttentionImpl::GlaAttentionImpl(const Config& c, int64_t layer_index)
    : num_heads_(c.base_num_query_heads),
      head_dim_(c.head_dim),
      chunk_size_(c.gla_chunk_size),
      linear_silu_(c.use_linear_silu),
      reset_at_documents_(c.gla_reset_at_documents) {
  const int64_t D = c.base_emb_dim, width = num_heads_ * head_dim_;
  q_proj = register_module("q_proj", linear(D, width));
  k_proj = register_module("k_proj", linear(D, width));
  v_proj = register_module("v_proj", linear(D, width));
  g_proj = register_module("g_proj", linear(D, width));
  o_proj = register_module("o_proj", linear(width, D));
  if (c.use_qk_norm) {
    q_norm = register_module("q_norm", RMSNorm(head_dim_, c.normalization_layer_epsilon));
    k_norm = register_module("k_norm", RMSNorm(head_dim_, c.normalization_layer_epsilon));
  }
  g_norm = register_module("g_norm", GroupRMSNorm(width, c.group_norm_size, c.normalization_layer_epsilon));
  // Deeper layers decay more slowly (remember further back); the last layer nearly not at all.
  const double depth = static_cast<double>(layer_index) / static_cast<double>(std::max<int64_t>(c.base_num_decoder_layers - 1, 1));
  for (const double slope : model_gla_head_slopes(num_heads_)) gamma_.push_back(-slope * (1.0 - depth + 1e-5));
}

torch::Tensor GlaAttentionImpl::decay(const torch::Device& device) {
  if (!gamma_cache_.defined() || gamma_cache_.device() != device)
    gamma_cache_ = torch::tensor(gamma_, torch::TensorOptions().dtype(torch::kFloat64)).to(torch::kFloat32).to(device);
  return gamma_cache_;
}

torch::Tensor GlaAttentionImpl::forward(const torch::Tensor& x, const RopeTables& rope, const torch::Tensor& segment_ids) {
  const auto B = x.size(0), L = x.size(1), H = num_heads_, hd = head_dim_, width = H * hd;
  auto qkv = linear_fused(x, {q_proj->weight, k_proj->weight, v_proj->weight});  // (B, L, 3 H hd)
  if (linear_silu_) qkv = F::silu(qkv);
  const auto parts = qkv.split_with_sizes({width, width, width}, -1);
  auto q = parts[0].view({B, L, H, hd});
  auto k = parts[1].view({B, L, H, hd});
  const auto v = parts[2].view({B, L, H, hd}).transpose(1, 2);  // (B, H, L, hd)
  if (q_norm) {
    q = q_norm(q);
    k = k_norm(k);
  }
  const auto cos = rope.cos.to(q.scalar_type()), sin_signed = rope.sin_signed.to(q.scalar_type());
  q = apply_rope(q.transpose(1, 2), cos, sin_signed);  // (B, H, L, hd)
  k = apply_rope(k.transpose(1, 2), cos, sin_signed);  // (B, H, L, hd)
  const auto documents = reset_at_documents_ ? segment_ids : torch::Tensor();
  const auto o = model_gla_attention_chunked(q, k, v, decay(x.device()), documents, chunk_size_).to(q.scalar_type());  // (B, H, L, hd)
  const auto normed = g_norm(o.transpose(1, 2).reshape({B, L, width}));  // (B, L, H hd)
  return o_proj(normed * torch::sigmoid(g_proj(x)));
}

// The chunked form. With n = t - (start of t's chunk) and gamma < 0, the recurrence unrolls to
//   o_t = e^{(n+1) gamma} q_t S_c                               (the state entering chunk c)
//       + sum_{s in chunk, s <= t} e^{(t-s) gamma} (q_t . k_s) v_s      (within the chunk)
//   S_{c+1} = e^{C gamma} S_c + sum_{s in chunk} e^{(C-1-j_s) gamma} k_s^T v_s     (j_s: s's index in it)
// so each chunk is two dense products and the sequential part is n / C small (dk, dv) updates. Every
// exponent is <= 0: nothing overflows. Document resets: S_c holds only the document of the token
// before chunk c (documents are contiguous runs), so token t reads it only when it is in that
// document, the state carries over a chunk only when the chunk ends in it, and a chunk's own
// update keeps only the tokens of the document it ends in; within a chunk the pair mask is
// "same document".
torch::Tensor model_gla_attention_chunked(const torch::Tensor& q_in, const torch::Tensor& k_in, const torch::Tensor& v_in,
                                    const torch::Tensor& gamma_in, const torch::Tensor& segment_ids, int64_t chunk) {
  compat::AutocastOffGuard fp32(q_in.is_cuda());
  const auto dtype = at::promote_types(q_in.scalar_type(), torch::kFloat32);  // float64 in gradient checks
  const auto B = q_in.size(0), H = q_in.size(1), L = q_in.size(2), dk = q_in.size(3), dv = v_in.size(3);
  const int64_t C = std::min(chunk, L), chunks = (L + C - 1) / C, padded = chunks * C;
  const auto pad = [&](const torch::Tensor& t) {  // (B, H, L, d) -> (B, H, chunks, C, d), zeros after L
    const auto wide = t.to(dtype);
    const auto full = padded == L ? wide : torch::cat({wide, torch::zeros({B, H, padded - L, t.size(3)}, wide.options())}, 2);
    return full.view({B, H, chunks, C, t.size(3)});
  };
  const auto q = pad(q_in) * (1.0 / std::sqrt(static_cast<double>(dk))), k = pad(k_in), v = pad(v_in);
  const auto opts = q.options();
  const auto gamma = gamma_in.to(opts).view({H, 1, 1});                                    // (H, 1, 1)
  const auto j = torch::arange(C, opts);                                                    // (C)
  const auto lag = j.view({C, 1}) - j.view({1, C});                                         // (C, C): t - s
  const auto within = (torch::exp(lag.clamp_min(0) * gamma) * (lag >= 0).to(dtype)).unsqueeze(1);  // (H, 1, C, C)
  const auto read_decay = torch::exp((j + 1).view({1, C, 1}) * gamma).unsqueeze(1);         // (H, 1, C, 1)
  const auto write_decay = torch::exp((C - 1 - j).view({1, C, 1}) * gamma).unsqueeze(1);    // (H, 1, C, 1)
  const auto carry_decay = torch::exp(gamma * static_cast<double>(C)).view({1, H, 1, 1});   // (1, H, 1, 1)

  auto pair_weight = within;                 // (H, 1, C, C), or (B, H, chunks, C, C) with documents
  auto written = k * write_decay;            // (B, H, chunks, C, dk)
  torch::Tensor seg, chunk_last;             // (B, chunks, C), (B, chunks)
  if (segment_ids.defined()) {
    auto s = segment_ids.to(torch::kLong);
    if (padded != L) s = torch::cat({s, torch::full({B, padded - L}, -1, s.options())}, 1);  // padding: its own document
    seg = s.view({B, chunks, C});
    chunk_last = seg.select(2, C - 1);
    const auto same = (seg.unsqueeze(3) == seg.unsqueeze(2)).to(dtype).unsqueeze(1);        // (B, 1, chunks, C, C)
    pair_weight = within * same;
    written = written * (seg == chunk_last.unsqueeze(2)).to(dtype).unsqueeze(1).unsqueeze(-1);
  }
  const auto intra = torch::matmul(torch::matmul(q, k.transpose(-1, -2)) * pair_weight, v);  // (B, H, chunks, C, dv)
  const auto updates = torch::matmul(written.transpose(-1, -2), v);                           // (B, H, chunks, dk, dv)
  const auto q_read = q * read_decay;                                                         // (B, H, chunks, C, dk)
  std::vector<torch::Tensor> inter{torch::zeros({B, H, C, dv}, opts)};
  // S_1 (B, H, dk, dv). A copy: the read products below keep each state for backward, and a view
  // would keep all chunks' updates alive with it (as many bytes as the states themselves).
  auto state = updates.select(2, 0).clone();
  for (int64_t c = 1; c < chunks; ++c) {
    auto read = torch::matmul(q_read.select(2, c), state);  // (B, H, C, dv)
    auto carry = carry_decay;
    if (seg.defined()) {
      const auto previous = chunk_last.select(1, c - 1).view({B, 1});  // the document S_c holds
      read = read * (seg.select(1, c) == previous).to(dtype).view({B, 1, C, 1});
      carry = carry * (chunk_last.select(1, c) == previous.view({B})).to(dtype).view({B, 1, 1, 1});
    }
    inter.push_back(read);
    if (c + 1 < chunks) state = carry * state + updates.select(2, c);
  }
  const auto out = intra + torch::stack(inter, 2);  // (B, H, chunks, C, dv)
  return out.view({B, H, padded, dv}).narrow(2, 0, L);
}

}  // namespace trainer
