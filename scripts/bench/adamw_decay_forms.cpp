// The CPU AdamW pass with the two weight-decay forms side by side: p * fl32(1 - lr wd) (before
// 2026-12-06) and p - (lr wd) p (since), over medium's 104,224,512 parameters, SSE as
// trainer/train/optimizer.cpp. Build and run: g++ -O3 -std=gnu++17 adamw_decay_forms.cpp -o a && ./a
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <vector>
#include <algorithm>
struct K { float w1, keep1, b2, w2, root2, eps, d, step; };
template <bool NEW>
__attribute__((noinline)) void run(float* __restrict p, const float* __restrict g, float* __restrict m, float* __restrict v, int64_t n, const K k) {
  const __m128 w1 = _mm_set1_ps(k.w1), b2 = _mm_set1_ps(k.b2), w2 = _mm_set1_ps(k.w2),
               root2 = _mm_set1_ps(k.root2), eps = _mm_set1_ps(k.eps), d = _mm_set1_ps(k.d), step = _mm_set1_ps(k.step);
  for (int64_t i = 0; i + 4 <= n; i += 4) {
    const __m128 gi = _mm_loadu_ps(g + i), m0 = _mm_loadu_ps(m + i), diff = _mm_sub_ps(gi, m0);
    const __m128 mi = _mm_add_ps(m0, _mm_mul_ps(w1, diff));
    const __m128 vi = _mm_add_ps(_mm_mul_ps(_mm_loadu_ps(v + i), b2), _mm_mul_ps(_mm_mul_ps(w2, gi), gi));
    const __m128 den = _mm_add_ps(_mm_div_ps(_mm_sqrt_ps(vi), root2), eps);
    _mm_storeu_ps(m + i, mi);
    _mm_storeu_ps(v + i, vi);
    const __m128 pi = _mm_loadu_ps(p + i);
    const __m128 decayed = NEW ? _mm_sub_ps(pi, _mm_mul_ps(d, pi)) : _mm_mul_ps(pi, d);
    _mm_storeu_ps(p + i, _mm_add_ps(decayed, _mm_div_ps(_mm_mul_ps(step, mi), den)));
  }
}
int main() {
  const int64_t n = 104224512;
  std::vector<float> p(n, 0.02f), g(n, 0.001f), m(n, 0.0f), v(n, 0.0f);
  for (int64_t i = 0; i < n; ++i) p[i] = 0.02f * ((i % 97) - 48) / 48.0f, g[i] = 1e-3f * ((i % 89) - 44) / 44.0f;
  K kold{0.1f, 0.9f, 0.95f, 0.05f, 0.2f, 1e-8f, 1.0f - 3e-4f, -3e-3f}, knew = kold;
  knew.d = 3e-4f;
  for (int round = 0; round < 4; ++round)
    for (int which = 0; which < 2; ++which) {
      std::vector<double> t;
      for (int rep = 0; rep < 5; ++rep) {
        auto a = std::chrono::steady_clock::now();
        if (which) run<true>(p.data(), g.data(), m.data(), v.data(), n, knew); else run<false>(p.data(), g.data(), m.data(), v.data(), n, kold);
        t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
      }
      std::sort(t.begin(), t.end());
      std::printf("round %d %s: median %.4f s\n", round, which ? "new" : "old", t[2]);
    }
}
