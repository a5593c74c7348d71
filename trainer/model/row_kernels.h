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

}  // namespace trainer::model_detail
