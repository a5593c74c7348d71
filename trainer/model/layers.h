// Building blocks shared by the attention variants and the decoder (model/ internal): a bias-free
// Linear, one GEMM for several projections of one input, RoPE, and the RMSNorm that
// remat_policy=minimal recomputes in backward. Defined in model.cpp.
#pragma once
#include <initializer_list>

#include <torch/torch.h>

#include "trainer/model/model.h"

namespace trainer::model_detail {

Linear linear(int64_t in, int64_t out);  // weight (out, in), no bias, uninitialized

// x W^T: x (..., in), weight (out, in) -> (..., out). F::linear, except for bf16 on a CPU where
// compat::cpu_bf16_gemm_via_fp32(): there the GEMMs (forward and backward) sum in fp32.
torch::Tensor linear_gemm(const torch::Tensor& x, const torch::Tensor& weight);

// linear_gemm(x, cat(weights)): (..., sum out_i); callers split_with_sizes it (model.cpp says why).
torch::Tensor linear_fused(const torch::Tensor& x, std::initializer_list<torch::Tensor> weights);

// x: (B, H, L, hd). Rotates the first cos.size(-1) dims, pairing i with i + rot/2 (rotate_half).
torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin_signed);

// The backward of SwiGLU, h = silu(g) * u, from dh, written into dg and du (callers pass the two
// halves of one (.., 2F) gradient [dg | du]); silu_g = silu(g), which the caller already has:
//   du = dh * silu(g),   dg = dh * u * silu'(g),   silu'(g) = s (1 + g (1 - s)), s = sigmoid(g)
// (silu_backward: one kernel). Used by the dense MLP's node and the grouped MoE experts.
void swiglu_backward_out(torch::Tensor dg, torch::Tensor du, const torch::Tensor& dh, const torch::Tensor& g,
                         const torch::Tensor& u, const torch::Tensor& silu_g);

// SwiGLU's CPU row loops (row_kernels.h) on tensors: whether they apply (the CPU, fp32 or bf16,
// contiguous (.., 2F) gate_up; cpu_row_kernels_set), h (.., F) = silu(g) u, and [dg | du] from dh.
bool swiglu_row_kernel_applies(const torch::Tensor& gate_up);
void swiglu_rows_forward_into(const torch::Tensor& gate_up, torch::Tensor& h);
void swiglu_rows_backward_into(const torch::Tensor& gate_up, const torch::Tensor& dh, torch::Tensor& dgate_up);

// Whether a MoE layer's routing runs as RouterRows (moe.cpp) over the router's row loops
// (row_kernels.h): the CPU, fp32 or fp64 logits (N, E); cpu_row_kernels_set.
bool router_row_kernel_applies(const torch::Tensor& logits);

// norm(x), recomputed in backward when recompute_elementwise (remat_policy=minimal).
torch::Tensor norm_forward(RMSNorm& norm, const torch::Tensor& x, bool recompute_elementwise);

// softmax(q k^T / sqrt(hd), causal and, when segment_mask is defined, same-segment) v for grouped
// heads: q (B, Hq, L, hd), k (B, Hkv, L, hd), v (B, Hkv, L, hv), query head h reading kv head
// h / (Hq / Hkv); segment_mask (B, 1, L, L) bool or undefined for plain causal. Returns
// (B, Hq, L, hv). LibTorch >= 2.0: scaled_dot_product_attention (compat::grouped_attention);
// 1.13: block_causal_attention. Defined in attention_core.cpp.
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& segment_mask);

// The same in query blocks of `block` positions (kAttentionBlock in the model) that skip the
// all-masked key blocks and read k and v unrepeated, as one autograd node (attention_core.cpp
// derives its backward).
torch::Tensor block_causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     const torch::Tensor& segment_mask, int64_t block);

// RoPE tables for positions (B, L) and inverse frequencies (rot/2): cos (B, 1, L, rot) and sin_signed.
// Both tables times `scale` (YaRN's attention factor) unless it is 1.
RopeTables rope_tables(const torch::Tensor& positions, const torch::Tensor& inv_freq, double scale = 1.0);

}  // namespace trainer::model_detail
