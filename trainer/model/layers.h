// Building blocks shared by the attention variants and the decoder (model/ internal): a bias-free
// Linear, one GEMM for several projections of one input, RoPE, and the RMSNorm that
// remat_policy=minimal recomputes in backward. Defined in model.cpp.
#pragma once
#include <initializer_list>

#include <torch/torch.h>

#include "trainer/model/model.h"

namespace trainer::model_detail {

Linear linear(int64_t in, int64_t out);  // weight (out, in), no bias, uninitialized

// F::linear(x, cat(weights)): (..., sum out_i); callers split_with_sizes it (model.cpp says why).
torch::Tensor linear_fused(const torch::Tensor& x, std::initializer_list<torch::Tensor> weights);

// x: (B, H, L, hd). Rotates the first cos.size(-1) dims, pairing i with i + rot/2 (rotate_half).
torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin_signed);

// norm(x), recomputed in backward when recompute_elementwise (remat_policy=minimal).
torch::Tensor norm_forward(RMSNorm& norm, const torch::Tensor& x, bool recompute_elementwise);

// RoPE tables for positions (B, L) and inverse frequencies (rot/2): cos (B, 1, L, rot) and sin_signed.
RopeTables rope_tables(const torch::Tensor& positions, const torch::Tensor& inv_freq);

}  // namespace trainer::model_detail
