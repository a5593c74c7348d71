// Row loops for the CPU (see row_kernels.h). Written so that GCC vectorizes them without
// -ffast-math: sums run in kLanes independent partial sums (a fixed order, so the result is the
// same on every run and every machine), and on x86-64 each entry point is also compiled for AVX2
// (target_clones: the loader picks the variant the CPU has). FMA is not enabled in the AVX2
// variant, so both variants round alike.
#include "trainer/model/row_kernels.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TRAINER_ROW_KERNEL __attribute__((target_clones("avx2", "default")))
#else
#define TRAINER_ROW_KERNEL
#endif

namespace trainer::model_detail {
namespace {

constexpr int64_t kLanes = 8;

// sum_j term(j) over one row of dim values, in T: kLanes partial sums, then the tail, then the
// lanes in order (term is inlined, so the lanes vectorize).
template <typename T, typename Term>
inline __attribute__((always_inline)) T row_sum(int64_t dim, Term term) {
  T lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= dim; j += kLanes)
    for (int64_t k = 0; k < kLanes; ++k) lanes[k] += term(j + k);
  T sum = 0;
  for (; j < dim; ++j) sum += term(j);
  for (int64_t k = 0; k < kLanes; ++k) sum += lanes[k];
  return sum;
}

template <typename T>
inline __attribute__((always_inline)) void forward_rows(const T* x, const T* weight, int64_t rows, int64_t dim,
                                                        double eps, T* y, T* rstd) {
  for (int64_t i = 0; i < rows; ++i) {
    const T* xi = x + i * dim;
    T* yi = y + i * dim;
    const T r = T(1) / std::sqrt(row_sum<T>(dim, [&](int64_t j) { return xi[j] * xi[j]; }) / T(dim) + T(eps));
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
    const T dot = row_sum<T>(dim, [&](int64_t j) { return dyi[j] * weight[j] * xi[j]; });
    const T mean_g_xhat = dot * r / T(dim);
    for (int64_t j = 0; j < dim; ++j) {
      const T xhat = xi[j] * r;
      dxi[j] = (dyi[j] * weight[j] - xhat * mean_g_xhat) * r;
    }
    if (dweight_sum)
      for (int64_t j = 0; j < dim; ++j) dweight_sum[j] += double(dyi[j] * (xi[j] * r));
  }
}

// One row; out never overlaps the input or the tables (restrict lets GCC vectorize without
// run-time overlap checks, which on rows of 8-64 values cost as much as the work).
template <typename T>
inline __attribute__((always_inline)) void rope_row(const T* __restrict__ x, const T* __restrict__ cs,
                                                    const T* __restrict__ sn, int64_t half, bool adjoint,
                                                    T* __restrict__ y) {
  // The first half reads the second (P(j) = j + half), the second the first (j - half).
  if (adjoint) {
    for (int64_t j = 0; j < half; ++j) y[j] = x[j + half] * sn[j + half] + x[j] * cs[j];
    for (int64_t j = 0; j < half; ++j) y[j + half] = x[j] * sn[j] + x[j + half] * cs[j + half];
  } else {
    for (int64_t j = 0; j < half; ++j) y[j] = x[j + half] * sn[j] + x[j] * cs[j];
    for (int64_t j = 0; j < half; ++j) y[j + half] = x[j] * sn[j + half] + x[j + half] * cs[j + half];
  }
}

template <typename T>
inline __attribute__((always_inline)) void rope_rows_impl(const T* in, const RowGrid& in_grid, const T* cos,
                                                          const T* sin_signed, const RowGrid& table_grid, int64_t rot,
                                                          bool adjoint, T* out, const RowGrid& out_grid) {
  const auto &n = in_grid.sizes, &si = in_grid.strides, &st = table_grid.strides, &so = out_grid.strides;
  for (int64_t a = 0; a < n[0]; ++a)
    for (int64_t b = 0; b < n[1]; ++b)
      for (int64_t c = 0; c < n[2]; ++c) {
        const int64_t table = a * st[0] + b * st[1] + c * st[2];
        rope_row(in + a * si[0] + b * si[1] + c * si[2], cos + table, sin_signed + table, rot / 2, adjoint,
                 out + a * so[0] + b * so[1] + c * so[2]);
      }
}

// e^-a for a >= 0, in fp32, without branches or float compares, so loops calling it vectorize
// (a clamp made GCC evaluate the division after it once per clamp case): -a = n ln2 + r,
// |r| <= ln2/2, n rounded by the 1.5 * 2^23 trick (no SSE4.1 round needed), ln2 in two parts
// (Cody-Waite), a degree-6 polynomial for e^r (Cephes' expf coefficients), and 2^n put into the
// exponent bits. n is clamped as an integer at -127, where 2^n becomes 0: results below ~1e-38
// are 0, and nothing overflows.
inline __attribute__((always_inline)) float exp_negative(float a) {
  const float x = -a;
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  int32_t exponent = static_cast<int32_t>(n);
  exponent = exponent < -127 ? -127 : exponent;
  const int32_t bits = (exponent + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return e * scale;
}

// sigmoid(g) = 1 / (1 + e^-g), from e = e^-|g| <= 1: 1 / (1 + e) for g >= 0, e / (1 + e) below.
// Within 2e-7 relative of the exact value for g > -87 (measured on a 0.0007 grid over
// [-87, 120]); below, it underflows to 0 as ~1e-38 does.
inline __attribute__((always_inline)) float sigmoid(float g) {
  const float e = exp_negative(std::fabs(g));
  const float q = 1.0f / (1.0f + e);
  return g >= 0.0f ? q : e * q;
}

inline __attribute__((always_inline)) float to_float(float x) { return x; }
inline __attribute__((always_inline)) float to_float(uint16_t bf16) {
  const uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline __attribute__((always_inline)) void store(float* out, float x) { *out = x; }
// Round to nearest even, NaN to the quiet NaN 0x7FC0 (c10::BFloat16's rounding).
inline __attribute__((always_inline)) void store(uint16_t* out, float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  *out = static_cast<uint16_t>((bits & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : rounded);
}

template <typename T>
inline __attribute__((always_inline)) void swiglu_forward_impl(const T* gate_up, int64_t rows, int64_t F, T* h) {
  for (int64_t i = 0; i < rows; ++i) {
    const T* __restrict__ g = gate_up + i * 2 * F;
    const T* __restrict__ u = g + F;
    T* __restrict__ y = h + i * F;
    for (int64_t j = 0; j < F; ++j) {
      const float gj = to_float(g[j]);
      store(y + j, gj * sigmoid(gj) * to_float(u[j]));
    }
  }
}

template <typename T>
inline __attribute__((always_inline)) void swiglu_backward_impl(const T* gate_up, const T* dh, int64_t rows,
                                                                int64_t F, T* dgate_up) {
  for (int64_t i = 0; i < rows; ++i) {
    const T* __restrict__ g = gate_up + i * 2 * F;
    const T* __restrict__ u = g + F;
    const T* __restrict__ d = dh + i * F;
    T* __restrict__ dg = dgate_up + i * 2 * F;
    T* __restrict__ du = dg + F;
    for (int64_t j = 0; j < F; ++j) {
      const float gj = to_float(g[j]), dj = to_float(d[j]);
      const float s = sigmoid(gj);
      store(du + j, dj * (gj * s));
      store(dg + j, dj * to_float(u[j]) * (s * (1.0f + gj * (1.0f - s))));
    }
  }
}

// An integer whose order is the scores' order (NaN: the lowest number, at kMin + 1; +0 = -0).
// Positive floats order as their bits; a negative float's bits with the 31 (or 63) value bits
// flipped order the other way round, as they must.
template <typename T, typename Key>
inline __attribute__((always_inline)) Key order_key(T v) {
  static_assert(sizeof(T) == sizeof(Key), "one key per score, of the score's width");
  Key bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits = bits >= 0 ? bits : static_cast<Key>(bits ^ std::numeric_limits<Key>::max());
  bits = v == 0 ? 0 : bits;
  return v != v ? std::numeric_limits<Key>::min() + 1 : bits;
}

template <typename T, typename Key>
inline __attribute__((always_inline)) void top_k_impl(const T* scores, int64_t rows, int64_t E, int64_t k, Key* keys,
                                                      int64_t* chosen) {
  using Index = Key;  // the index reduction in the keys' lane width vectorizes
  constexpr Key kTaken = std::numeric_limits<Key>::min();
  const Index n = static_cast<Index>(E);
  for (int64_t t = 0; t < rows; ++t) {
    const T* __restrict__ row = scores + t * E;
    for (Index e = 0; e < n; ++e) keys[e] = order_key<T, Key>(row[e]);
    for (int64_t j = 0; j < k; ++j) {
      Key best = kTaken;
      for (Index e = 0; e < n; ++e) best = keys[e] > best ? keys[e] : best;
      Index first = n;
      for (Index e = 0; e < n; ++e) {
        const Index at = keys[e] == best ? e : n;
        first = at < first ? at : first;
      }
      chosen[t * k + j] = first;
      keys[first] = kTaken;
    }
  }
}

// The router's row loops (row_kernels.h; moe.cpp derives them). fp32 takes its exponentials from
// exp_negative, which vectorizes; fp64 from libm.
inline __attribute__((always_inline)) float exp_neg(float a) { return exp_negative(a); }
inline __attribute__((always_inline)) double exp_neg(double a) { return std::exp(-a); }
inline __attribute__((always_inline)) float sigmoid_of(float g) { return sigmoid(g); }
inline __attribute__((always_inline)) double sigmoid_of(double g) { return 1.0 / (1.0 + std::exp(-g)); }

// max over one row in kLanes lanes (an elementwise select GCC vectorizes, where a running max is
// a reduction it will not reorder); NaN is skipped, and a row of NaN or -inf gives -inf.
template <typename T>
inline __attribute__((always_inline)) T row_max(const T* __restrict__ x, int64_t dim) {
  T lanes[kLanes];
  for (int64_t k = 0; k < kLanes; ++k) lanes[k] = -std::numeric_limits<T>::infinity();
  int64_t j = 0;
  for (; j + kLanes <= dim; j += kLanes)
    for (int64_t k = 0; k < kLanes; ++k) lanes[k] = x[j + k] > lanes[k] ? x[j + k] : lanes[k];
  T best = -std::numeric_limits<T>::infinity();
  for (; j < dim; ++j) best = x[j] > best ? x[j] : best;
  for (int64_t k = 0; k < kLanes; ++k) best = lanes[k] > best ? lanes[k] : best;
  return best;
}

// Group-limited routing on one row of selection scores: the best top_groups groups (a group's
// score: the sum of its two largest; ties to the lower group) have their experts moved, in group
// order, to the front of selection, and their indices written, ascending, to kept_groups. Returns
// how many groups were kept. The top-k then reads only those experts (half the row for Ling's 4 of
// 8 groups), in expert order, so ties still go to the lower expert.
template <typename T>
inline __attribute__((always_inline)) int64_t keep_best_groups(T* selection, const RouterShape& shape, T* group_score,
                                                               char* kept, int64_t* kept_groups) {
  const int64_t groups = shape.groups, per_group = shape.experts / shape.groups;
  constexpr T kNone = -std::numeric_limits<T>::infinity();
  for (int64_t g = 0; g < groups; ++g) {
    T first = kNone, second = kNone;
    for (int64_t i = 0; i < per_group; ++i) {
      const T v = selection[g * per_group + i];
      if (v > first) {
        second = first;
        first = v;
      } else if (v > second) {
        second = v;
      }
    }
    group_score[g] = first + second;
    kept[g] = false;
  }
  for (int64_t pick = 0; pick < shape.top_groups; ++pick) {
    int64_t best = -1;
    for (int64_t g = 0; g < groups; ++g)
      if (!kept[g] && (best < 0 || group_score[g] > group_score[best])) best = g;
    if (best < 0) break;  // top_groups > groups: every group kept
    kept[best] = true;
  }
  int64_t count = 0;
  for (int64_t g = 0; g < groups; ++g) {
    if (!kept[g]) continue;
    if (count < g)  // moves forward: the ranges do not overlap
      std::copy(selection + g * per_group, selection + (g + 1) * per_group, selection + count * per_group);
    kept_groups[count++] = g;
  }
  return count;
}

template <typename T, typename Key>
inline __attribute__((always_inline)) void router_forward_impl(const T* logits, const T* bias, const T* valid,
                                                               int64_t rows, const RouterShape& shape, T* scores,
                                                               int64_t* chosen, T* weights, T* lse, double* sums,
                                                               double* prob_sum, double* counts) {
  const int64_t E = shape.experts, k = shape.top_k;
  std::vector<T> selection(static_cast<size_t>(E)), group_score(static_cast<size_t>(std::max<int64_t>(shape.groups, 1)));
  std::vector<Key> keys(static_cast<size_t>(E));
  std::vector<char> kept(static_cast<size_t>(std::max<int64_t>(shape.groups, 1)));
  std::vector<int64_t> kept_groups(kept.size());
  for (int64_t t = 0; t < rows; ++t) {
    const T* __restrict__ l = logits + t * E;
    T* __restrict__ s = scores + t * E;
    T* __restrict__ sel = selection.data();
    const T m = row_max(l, E);
    T sum_exp;
    if (shape.sigmoid) {
      sum_exp = row_sum<T>(E, [&](int64_t e) { return exp_neg(m - l[e]); });
      for (int64_t e = 0; e < E; ++e) s[e] = sigmoid_of(l[e]);
    } else {
      for (int64_t e = 0; e < E; ++e) s[e] = exp_neg(m - l[e]);
      sum_exp = row_sum<T>(E, [&](int64_t e) { return s[e]; });
      const T inverse = T(1) / sum_exp;
      for (int64_t e = 0; e < E; ++e) s[e] *= inverse;
    }
    lse[t] = std::isinf(m) ? m : m + std::log(sum_exp);  // +-inf as logsumexp gives, not inf - inf

    if (bias) {
      for (int64_t e = 0; e < E; ++e) sel[e] = s[e] + bias[e];
    } else {
      for (int64_t e = 0; e < E; ++e) sel[e] = s[e];
    }
    int64_t* c = chosen + t * k;
    if (shape.groups > 0) {
      const int64_t per_group = E / shape.groups;
      const int64_t candidates = per_group * keep_best_groups(sel, shape, group_score.data(), kept.data(),
                                                              kept_groups.data());
      top_k_impl(sel, 1, candidates, k, keys.data(), c);
      for (int64_t j = 0; j < k; ++j) c[j] = kept_groups[c[j] / per_group] * per_group + c[j] % per_group;
    } else {
      top_k_impl(sel, 1, E, k, keys.data(), c);
    }
    T* w = weights + t * k;
    T chosen_sum = 0;
    for (int64_t j = 0; j < k; ++j) chosen_sum += s[c[j]];
    for (int64_t j = 0; j < k; ++j)
      w[j] = shape.normalize ? s[c[j]] / (chosen_sum + T(1e-20)) * T(shape.scaling) : s[c[j]] * T(shape.scaling);

    const double v = static_cast<double>(valid[t]);
    const double score_sum = row_sum<double>(E, [&](int64_t e) { return static_cast<double>(s[e]); });
    sums[0] += v;
    sums[1] += v * score_sum;
    sums[2] += v * row_sum<double>(E, [&](int64_t e) { return static_cast<double>(s[e]) * static_cast<double>(s[e]); });
    if (shape.sigmoid) {
      const T total = row_sum<T>(E, [&](int64_t e) { return s[e]; });
      for (int64_t e = 0; e < E; ++e) prob_sum[e] += v * static_cast<double>(s[e] / total);
    } else {
      for (int64_t e = 0; e < E; ++e) prob_sum[e] += v * static_cast<double>(s[e]);
    }
    for (int64_t j = 0; j < k; ++j) counts[c[j]] += v;
  }
}

template <typename T>
inline __attribute__((always_inline)) void router_backward_impl(const T* logits, const T* scores, const T* lse,
                                                                const int64_t* chosen, const T* valid,
                                                                const T* dweights, const T* dprob_sum, const T* dlse,
                                                                int64_t rows, const RouterShape& shape, T* dlogits) {
  const int64_t E = shape.experts, k = shape.top_k;
  const T scaling = T(shape.scaling);
  std::vector<T> grad(static_cast<size_t>(E));  // d/ds of the row
  for (int64_t t = 0; t < rows; ++t) {
    const T* __restrict__ l = logits ? logits + t * E : nullptr;  // null for softmax scores
    const T* __restrict__ s = scores + t * E;
    T* __restrict__ dl = dlogits + t * E;
    T* __restrict__ g = grad.data();
    const T v = valid[t];
    if (!dprob_sum) {
      for (int64_t e = 0; e < E; ++e) g[e] = 0;
    } else if (shape.sigmoid) {  // p = s / S:  dp/ds^T gp = (gp - gp . p) / S
      const T total = row_sum<T>(E, [&](int64_t e) { return s[e]; });
      const T dot = v * row_sum<T>(E, [&](int64_t e) { return dprob_sum[e] * s[e]; }) / total;
      for (int64_t e = 0; e < E; ++e) g[e] = (v * dprob_sum[e] - dot) / total;
    } else {
      for (int64_t e = 0; e < E; ++e) g[e] = v * dprob_sum[e];
    }
    if (dweights) {
      const int64_t* c = chosen + t * k;
      const T* gw = dweights + t * k;
      if (shape.normalize) {  // w_j = c r_j / (R + eps):  dr_i = c / (R + eps) (gw_i - gw . r / (R + eps))
        T chosen_sum = 0, dot = 0;
        for (int64_t j = 0; j < k; ++j) chosen_sum += s[c[j]];
        for (int64_t j = 0; j < k; ++j) dot += gw[j] * s[c[j]];
        const T inverse = T(1) / (chosen_sum + T(1e-20));
        for (int64_t j = 0; j < k; ++j) g[c[j]] += scaling * inverse * (gw[j] - dot * inverse);
      } else {
        for (int64_t j = 0; j < k; ++j) g[c[j]] += scaling * gw[j];
      }
    }
    const T dz = dlse ? dlse[t] : T(0);
    if (shape.sigmoid) {
      for (int64_t e = 0; e < E; ++e) dl[e] = g[e] * s[e] * (T(1) - s[e]);
      if (dlse)
        for (int64_t e = 0; e < E; ++e) dl[e] += dz * exp_neg(lse[t] - l[e]);  // d lse / dl = softmax(l)
    } else {  // ds/dl^T g = s (g - g . s), and d lse / dl = s
      const T dot = row_sum<T>(E, [&](int64_t e) { return g[e] * s[e]; });
      for (int64_t e = 0; e < E; ++e) dl[e] = s[e] * (g[e] - dot) + dz * s[e];
    }
  }
}

}  // namespace

TRAINER_ROW_KERNEL void top_k_rows(const float* scores, int64_t rows, int64_t E, int64_t k, int32_t* key_scratch,
                                   int64_t* chosen) {
  top_k_impl(scores, rows, E, k, key_scratch, chosen);
}
TRAINER_ROW_KERNEL void top_k_rows(const double* scores, int64_t rows, int64_t E, int64_t k, int64_t* key_scratch,
                                   int64_t* chosen) {
  top_k_impl(scores, rows, E, k, key_scratch, chosen);
}

TRAINER_ROW_KERNEL void router_rows_forward(const float* logits, const float* bias, const float* valid, int64_t rows,
                                            const RouterShape& shape, float* scores, int64_t* chosen, float* weights,
                                            float* lse, double* sums, double* prob_sum, double* counts) {
  router_forward_impl<float, int32_t>(logits, bias, valid, rows, shape, scores, chosen, weights, lse, sums, prob_sum,
                                      counts);
}
TRAINER_ROW_KERNEL void router_rows_forward(const double* logits, const double* bias, const double* valid,
                                            int64_t rows, const RouterShape& shape, double* scores, int64_t* chosen,
                                            double* weights, double* lse, double* sums, double* prob_sum,
                                            double* counts) {
  router_forward_impl<double, int64_t>(logits, bias, valid, rows, shape, scores, chosen, weights, lse, sums,
                                       prob_sum, counts);
}
TRAINER_ROW_KERNEL void router_rows_backward(const float* logits, const float* scores, const float* lse,
                                             const int64_t* chosen, const float* valid, const float* dweights,
                                             const float* dprob_sum, const float* dlse, int64_t rows,
                                             const RouterShape& shape, float* dlogits) {
  router_backward_impl(logits, scores, lse, chosen, valid, dweights, dprob_sum, dlse, rows, shape, dlogits);
}
TRAINER_ROW_KERNEL void router_rows_backward(const double* logits, const double* scores, const double* lse,
                                             const int64_t* chosen, const double* valid, const double* dweights,
                                             const double* dprob_sum, const double* dlse, int64_t rows,
                                             const RouterShape& shape, double* dlogits) {
  router_backward_impl(logits, scores, lse, chosen, valid, dweights, dprob_sum, dlse, rows, shape, dlogits);
}

TRAINER_ROW_KERNEL void swiglu_rows_forward(const float* gate_up, int64_t rows, int64_t F, float* h) {
  swiglu_forward_impl(gate_up, rows, F, h);
}
TRAINER_ROW_KERNEL void swiglu_rows_forward(const uint16_t* gate_up, int64_t rows, int64_t F, uint16_t* h) {
  swiglu_forward_impl(gate_up, rows, F, h);
}
TRAINER_ROW_KERNEL void swiglu_rows_backward(const float* gate_up, const float* dh, int64_t rows, int64_t F,
                                             float* dgate_up) {
  swiglu_backward_impl(gate_up, dh, rows, F, dgate_up);
}
TRAINER_ROW_KERNEL void swiglu_rows_backward(const uint16_t* gate_up, const uint16_t* dh, int64_t rows, int64_t F,
                                             uint16_t* dgate_up) {
  swiglu_backward_impl(gate_up, dh, rows, F, dgate_up);
}

TRAINER_ROW_KERNEL void rope_rows(const float* in, const RowGrid& in_grid, const float* cos, const float* sin_signed,
                                  const RowGrid& table_grid, int64_t rot, bool adjoint, float* out,
                                  const RowGrid& out_grid) {
  rope_rows_impl(in, in_grid, cos, sin_signed, table_grid, rot, adjoint, out, out_grid);
}
TRAINER_ROW_KERNEL void rope_rows(const double* in, const RowGrid& in_grid, const double* cos,
                                  const double* sin_signed, const RowGrid& table_grid, int64_t rot, bool adjoint,
                                  double* out, const RowGrid& out_grid) {
  rope_rows_impl(in, in_grid, cos, sin_signed, table_grid, rot, adjoint, out, out_grid);
}

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
