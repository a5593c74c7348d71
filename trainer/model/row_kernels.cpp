// Row loops for the CPU (see row_kernels.h). Written so that GCC vectorizes them without
// -ffast-math: sums run in kLanes independent partial sums (a fixed order, so the result is the
// same on every run and every machine), and on x86-64 each entry point is also compiled for AVX2
// (target_clones: the loader picks the variant the CPU has). FMA is not enabled in the AVX2
// variant, so both variants round alike.
#include "trainer/model/row_kernels.h"

#include <cmath>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TRAINER_ROW_KERNEL __attribute__((target_clones("avx2", "default")))
#else
#define TRAINER_ROW_KERNEL
#endif

namespace trainer::model_detail {
namespace {

constexpr int64_t kLanes = 8;

// sum_j a_j b_j over one row, in T: kLanes partial sums, then the tail, then the lanes in order.
template <typename T>
inline __attribute__((always_inline)) T row_dot(const T* a, const T* b, int64_t dim) {
  T lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= dim; j += kLanes)
    for (int64_t k = 0; k < kLanes; ++k) lanes[k] += a[j + k] * b[j + k];
  T sum = 0;
  for (; j < dim; ++j) sum += a[j] * b[j];
  for (int64_t k = 0; k < kLanes; ++k) sum += lanes[k];
  return sum;
}

template <typename T>
inline __attribute__((always_inline)) void forward_rows(const T* x, const T* weight, int64_t rows, int64_t dim,
                                                        double eps, T* y, T* rstd) {
  for (int64_t i = 0; i < rows; ++i) {
    const T* xi = x + i * dim;
    T* yi = y + i * dim;
    const T r = T(1) / std::sqrt(row_dot(xi, xi, dim) / T(dim) + T(eps));
    rstd[i] = r;
    for (int64_t j = 0; j < dim; ++j) yi[j] = xi[j] * r * weight[j];
  }
}

template <typename T>
inline __attribute__((always_inline)) void backward_rows(const T* x, const T* weight, const T* rstd, const T* dy,
                                                         int64_t rows, int64_t dim, T* dx, double* dweight_sum) {
  for (int64_t i = 0; i < rows; ++i) {
    const T *xi = x + i * dim, *dyi = dy + i * dim;
    T* dxi = dx + i * dim;
    const T r = rstd[i];
    // mean(g xhat) = r mean(dy w x): one dot product, then dx in one more pass.
    T lanes[kLanes] = {};
    int64_t j = 0;
    for (; j + kLanes <= dim; j += kLanes)
      for (int64_t k = 0; k < kLanes; ++k) lanes[k] += dyi[j + k] * weight[j + k] * xi[j + k];
    T dot = 0;
    for (; j < dim; ++j) dot += dyi[j] * weight[j] * xi[j];
    for (int64_t k = 0; k < kLanes; ++k) dot += lanes[k];
    const T mean_g_xhat = dot * r / T(dim);
    for (j = 0; j < dim; ++j) {
      const T xhat = xi[j] * r;
      dxi[j] = (dyi[j] * weight[j] - xhat * mean_g_xhat) * r;
    }
    if (dweight_sum)
      for (j = 0; j < dim; ++j) dweight_sum[j] += double(dyi[j] * (xi[j] * r));
  }
}

}  // namespace

TRAINER_ROW_KERNEL void rms_norm_rows_forward(const float* x, const float* weight, int64_t rows, int64_t dim,
                                              double eps, float* y, float* rstd) {
  forward_rows(x, weight, rows, dim, eps, y, rstd);
}
TRAINER_ROW_KERNEL void rms_norm_rows_forward(const double* x, const double* weight, int64_t rows, int64_t dim,
                                              double eps, double* y, double* rstd) {
  forward_rows(x, weight, rows, dim, eps, y, rstd);
}
TRAINER_ROW_KERNEL void rms_norm_rows_backward(const float* x, const float* weight, const float* rstd,
                                               const float* dy, int64_t rows, int64_t dim, float* dx,
                                               double* dweight_sum) {
  backward_rows(x, weight, rstd, dy, rows, dim, dx, dweight_sum);
}
TRAINER_ROW_KERNEL void rms_norm_rows_backward(const double* x, const double* weight, const double* rstd,
                                               const double* dy, int64_t rows, int64_t dim, double* dx,
                                               double* dweight_sum) {
  backward_rows(x, weight, rstd, dy, rows, dim, dx, dweight_sum);
}

}  // namespace trainer::model_detail
