// Plain-C++ loops over contiguous rows for the CPU, where a step of small tensors is host-bound
// and one pass over each row beats a chain of ATen kernels (each a dispatch, an allocation and a
// full sweep). No LibTorch here: model.cpp hands in raw pointers of contiguous CPU tensors. Only
// the model folder includes this header.
#pragma once

#include <cstdint>

namespace trainer::model_detail {

// RMSNorm over rows of `dim` values (the math is derived at RmsNormFunction in model.cpp):
//   rstd = rsqrt(mean(x^2) + eps),  y = (x rstd) w.
// Writes y (rows, dim) and rstd (rows).
void rms_norm_rows_forward(const float* x, const float* weight, int64_t rows, int64_t dim, double eps, float* y,
                           float* rstd);
void rms_norm_rows_forward(const double* x, const double* weight, int64_t rows, int64_t dim, double eps, double* y,
                           double* rstd);

// Its backward from dy: with xhat = x rstd and g = dy w,
//   dx = rstd (g - xhat mean(g xhat)),  dweight += sum over rows of dy xhat.
// dweight_sum (dim doubles, accumulated into, may be null) sums in double whatever the input type,
// so the weight gradient of many rows loses nothing to the order of the sum.
void rms_norm_rows_backward(const float* x, const float* weight, const float* rstd, const float* dy, int64_t rows,
                            int64_t dim, float* dx, double* dweight_sum);
void rms_norm_rows_backward(const double* x, const double* weight, const double* rstd, const double* dy,
                            int64_t rows, int64_t dim, double* dx, double* dweight_sum);

// Where each row of `dim` contiguous values starts in a (A, B, C, dim) view: row (a, b, c) at
// a * strides[0] + b * strides[1] + c * strides[2] elements (a stride 0 broadcasts).
struct RowGrid {
  int64_t sizes[3];
  int64_t strides[3];
};

// RoPE in the rotate_half form over rows of rot values (model.cpp derives it), with
// P(j) = (j + rot/2) mod rot and the tables' rows c (cos) and s (sin_signed):
//   forward:  out_j = in_P(j) s_j + in_j c_j
//   adjoint:  out_j = in_P(j) s_P(j) + in_j c_j     (dx from dy)
// rounded as LibTorch's roll, mul and addcmul round them (but without a fused multiply-add, which
// LibTorch's AVX2 kernels may use: the two differ in the last bit at most). `in`, the tables and
// `out` each have their own grid over the same sizes.
void rope_rows(const float* in, const RowGrid& in_grid, const float* cos, const float* sin_signed,
               const RowGrid& table_grid, int64_t rot, bool adjoint, float* out, const RowGrid& out_grid);
void rope_rows(const double* in, const RowGrid& in_grid, const double* cos, const double* sin_signed,
               const RowGrid& table_grid, int64_t rot, bool adjoint, double* out, const RowGrid& out_grid);

// SwiGLU on rows of gate_up = [g | u] (2F values, contiguous): h = silu(g) u (F values), and its
// backward from dh into [dg | du] (2F values):
//   s = sigmoid(g),  du = dh g s,  dg = dh u s (1 + g (1 - s))
// computed in fp32 with a sigmoid within 2e-7 relative that GCC vectorizes (ATen's exp is Sleef's,
// 1 ulp), each result
// rounded once to the storage type. bf16 is passed as its raw 16 bits (uint16_t), rounded to
// nearest even as LibTorch rounds. (LibTorch 1.13's bf16 silu rounds to bf16 after each of its
// steps, and was a fifth of a tiny bf16 step.)
void swiglu_rows_forward(const float* gate_up, int64_t rows, int64_t F, float* h);
void swiglu_rows_forward(const uint16_t* gate_up, int64_t rows, int64_t F, uint16_t* h);
void swiglu_rows_backward(const float* gate_up, const float* dh, int64_t rows, int64_t F, float* dgate_up);
void swiglu_rows_backward(const uint16_t* gate_up, const uint16_t* dh, int64_t rows, int64_t F, uint16_t* dgate_up);

// The k largest of each row of E scores, best first, as expert ids (rows, k): ties go to the lower
// index, and NaN ranks below every number (and equals itself), so the choice is the same on every
// machine. k passes of two vectorized reductions over order-preserving integer keys (a max, then
// the first index holding it): ~2x an insertion pass at E = 64, k = 8, whose one branch per score
// is taken about a third of the time on random scores. Costs k E per row, so meant for k << E.
// `key_scratch` holds E keys (E int32 for float scores, E int64 for double).
void top_k_rows(const float* scores, int64_t rows, int64_t E, int64_t k, int32_t* key_scratch, int64_t* chosen);
void top_k_rows(const double* scores, int64_t rows, int64_t E, int64_t k, int64_t* key_scratch, int64_t* chosen);

// The router of a MoE layer over rows of E logits l (moe.cpp derives the math and its backward):
//   s = softmax(l) or sigmoid(l),  lse = logsumexp(l),
//   chosen = the top k of s + bias as top_k_rows picks them, among the experts of the best
//            top_groups groups when groups > 0 (E/groups experts each; a group scores the sum of
//            its two largest s + bias, ties to the lower group),
//   weights = s[chosen] / (their sum + 1e-20) when normalize, times scaling.
// scores (rows, E), chosen and weights (rows, k) and lse (rows) are written; with v = valid[t],
// sums[0] += v, sums[1] += v sum_e s, sums[2] += v sum_e s^2, prob_sum[e] += v p_e (p = s for
// softmax, s / sum(s) for sigmoid) and counts[chosen] += v are accumulated, in double.
struct RouterShape {
  int64_t experts = 0, top_k = 0;
  bool sigmoid = false, normalize = false;
  double scaling = 1.0;
  int64_t groups = 0, top_groups = 0;  // group-limited routing; groups <= 0: off
};
void router_rows_forward(const float* logits, const float* bias, const float* valid, int64_t rows,
                         const RouterShape& shape, float* scores, int64_t* chosen, float* weights, float* lse,
                         double* sums, double* prob_sum, double* counts);
void router_rows_forward(const double* logits, const double* bias, const double* valid, int64_t rows,
                         const RouterShape& shape, double* scores, int64_t* chosen, double* weights, double* lse,
                         double* sums, double* prob_sum, double* counts);

// Its backward into dlogits (rows, E), from the forward's logits, scores, lse and chosen and from
// dweights (rows, k), dprob_sum (E: the gradient of prob_sum) and dlse (rows); any of the three
// may be null (no gradient). The logits are read only for sigmoid scores with a dlse (softmax's
// lse gradient is its scores), and may be null otherwise.
void router_rows_backward(const float* logits, const float* scores, const float* lse, const int64_t* chosen,
                          const float* valid, const float* dweights, const float* dprob_sum, const float* dlse,
                          int64_t rows, const RouterShape& shape, float* dlogits);
void router_rows_backward(const double* logits, const double* scores, const double* lse, const int64_t* chosen,
                          const double* valid, const double* dweights, const double* dprob_sum, const double* dlse,
                          int64_t rows, const RouterShape& shape, double* dlogits);

}  // namespace trainer::model_detail
