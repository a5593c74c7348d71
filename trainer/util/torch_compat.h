// The one place where differences between LibTorch versions live: Debian 12's 1.13 (CPU), Debian
// 13's 2.6 (CPU, scripts/test_libtorch2.sh) and the 2.x inside the PyTorch wheel (CUDA).
// Everything else calls these wrappers.
#pragma once
#include <atomic>

#include <torch/torch.h>
#include <torch/version.h>
#include <ATen/autocast_mode.h>

#define TRAINER_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR * 100 + TORCH_VERSION_MINOR >= (major) * 100 + (minor))

namespace trainer::compat {

// Autocast for bf16 compute on CPU or CUDA; weights and gradients stay fp32.
// 1.13 has per-device-type setters with distinct names; 2.x takes a DeviceType argument.
struct AutocastGuard {
  AutocastGuard(bool enabled, bool cuda) : enabled_(enabled), cuda_(cuda) {
    if (!enabled_) return;
#if TRAINER_TORCH_AT_LEAST(2, 4)
    const auto type = cuda_ ? at::kCUDA : at::kCPU;
    prev_enabled_ = at::autocast::is_autocast_enabled(type);
    prev_dtype_ = at::autocast::get_autocast_dtype(type);
    at::autocast::set_autocast_enabled(type, true);
    at::autocast::set_autocast_dtype(type, at::kBFloat16);
#else
    if (cuda_) {
      prev_enabled_ = at::autocast::is_enabled();
      prev_dtype_ = at::autocast::get_autocast_gpu_dtype();
      at::autocast::set_enabled(true);
      at::autocast::set_autocast_gpu_dtype(at::kBFloat16);
    } else {
      prev_enabled_ = at::autocast::is_cpu_enabled();
      prev_dtype_ = at::autocast::get_autocast_cpu_dtype();
      at::autocast::set_cpu_enabled(true);
      at::autocast::set_autocast_cpu_dtype(at::kBFloat16);
    }
#endif
    at::autocast::increment_nesting();
  }
  ~AutocastGuard() {
    if (!enabled_) return;
    if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
#if TRAINER_TORCH_AT_LEAST(2, 4)
    const auto type = cuda_ ? at::kCUDA : at::kCPU;
    at::autocast::set_autocast_enabled(type, prev_enabled_);
    at::autocast::set_autocast_dtype(type, prev_dtype_);
#else
    if (cuda_) {
      at::autocast::set_enabled(prev_enabled_);
      at::autocast::set_autocast_gpu_dtype(prev_dtype_);
    } else {
      at::autocast::set_cpu_enabled(prev_enabled_);
      at::autocast::set_autocast_cpu_dtype(prev_dtype_);
    }
#endif
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  bool enabled_;
  bool cuda_;
  bool prev_enabled_ = false;
  at::ScalarType prev_dtype_ = at::kBFloat16;
};

// Autocast's cache of bf16 weight casts off for a scope. The cache keeps every cast of a leaf
// weight until the outermost autocast region ends: around a layer's no-grad forward under
// activation recomputation that was a bf16 copy of every layer's weights at once (and copies
// without a grad_fn), where each layer's is needed only while it runs.
struct AutocastCacheOffGuard {
  AutocastCacheOffGuard() : prev_(at::autocast::is_autocast_cache_enabled()) { at::autocast::set_autocast_cache_enabled(false); }
  ~AutocastCacheOffGuard() { at::autocast::set_autocast_cache_enabled(prev_); }
  AutocastCacheOffGuard(const AutocastCacheOffGuard&) = delete;
  AutocastCacheOffGuard& operator=(const AutocastCacheOffGuard&) = delete;

 private:
  bool prev_;
};

// Whether autocast is on for this thread and device type (activation recomputation reruns a
// forward under the state it first ran with).
inline bool autocast_is_enabled(bool cuda) {
#if TRAINER_TORCH_AT_LEAST(2, 4)
  return at::autocast::is_autocast_enabled(cuda ? at::kCUDA : at::kCPU);
#else
  return cuda ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
#endif
}

// Autocast off for a region that must compute in fp32 whatever the caller's autocast (the GLA
// state recurrence: a bf16 state would lose the decayed history).
struct AutocastOffGuard {
  explicit AutocastOffGuard(bool cuda) : cuda_(cuda), prev_enabled_(autocast_is_enabled(cuda)) { set(false); }
  ~AutocastOffGuard() { set(prev_enabled_); }
  AutocastOffGuard(const AutocastOffGuard&) = delete;
  AutocastOffGuard& operator=(const AutocastOffGuard&) = delete;

 private:
  void set(bool enabled) const {
#if TRAINER_TORCH_AT_LEAST(2, 4)
    at::autocast::set_autocast_enabled(cuda_ ? at::kCUDA : at::kCPU, enabled);
#else
    if (cuda_)
      at::autocast::set_enabled(enabled);
    else
      at::autocast::set_cpu_enabled(enabled);
#endif
  }
  bool cuda_;
  bool prev_enabled_;
};

}  // namespace trainer::compat

namespace trainer::compat {

// softmax(q k^T / sqrt(hd), masked to `allowed`) v. q, k, v: (B, H, L, hd); allowed:
// (B, 1, L, L) bool with at least one true per row, or undefined for plain causal attention.
// 2.x has fused kernels (flash attention when causal); 1.13 does not (the model runs its own
// block_causal_attention there; this composite is the reference).
// Whether masked_attention runs a fused kernel for plain causal rows (no (B, H, L, L) scores kept
// for backward): the memory plan counts attention activations by it.
constexpr bool kFusedCausalAttention = TRAINER_TORCH_AT_LEAST(2, 0);

inline torch::Tensor masked_attention(const torch::Tensor& q, const torch::Tensor& k,
                                      const torch::Tensor& v, const torch::Tensor& allowed) {
#if TRAINER_TORCH_AT_LEAST(2, 0)
  if (!allowed.defined()) return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true);
  return at::scaled_dot_product_attention(q, k, v, allowed);
#else
  const double scale = 1.0 / std::sqrt(static_cast<double>(q.size(-1)));
  const auto L = q.size(-2);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) * scale;  // (B, H, L, L)
  const auto hidden = allowed.defined() ? allowed.logical_not()
                                        : torch::ones({L, L}, q.options().dtype(torch::kBool)).triu(1);
  scores = scores.masked_fill(hidden, -std::numeric_limits<float>::infinity());
  return torch::matmul(torch::softmax(scores, -1).to(v.scalar_type()), v);
#endif
}

// Whether attention reads k and v with fewer heads than q as they are (scaled_dot_product_attention's
// enable_gqa, LibTorch >= 2.5), instead of repeating them to the query heads first: on CUDA, where
// flash and cuDNN attention take grouped heads. Not on the CPU: 2.6's CPU flash kernel does not,
// and with enable_gqa its dispatcher falls back to the math path (an explicit (B, H, L, L)
// softmax; measured with _fused_sdp_choice: math with enable_gqa, flash with repeated k and v).
inline bool native_gqa_attention(const torch::Device& device) {
  return TRAINER_TORCH_AT_LEAST(2, 5) && device.is_cuda();
}

// masked_attention for grouped queries: q and k (B, Hq or Hkv, L, hd), v (B, Hkv, L, hv) with Hkv
// dividing Hq; query head h reads kv head h / (Hq / Hkv) (HF repeat_kv). `native` (where
// native_gqa_attention says so, or in tests) passes enable_gqa; otherwise k and v are repeated.
inline torch::Tensor grouped_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                       const torch::Tensor& allowed, bool native) {
  const int64_t B = k.size(0), Hkv = k.size(1), L = k.size(2), group = q.size(1) / Hkv;
  if (group == 1) return masked_attention(q, k, v, allowed);
#if TRAINER_TORCH_AT_LEAST(2, 5)
  if (native) {
    if (!allowed.defined())
      return at::scaled_dot_product_attention(q, k, v, {}, 0.0, /*is_causal=*/true, /*scale=*/std::nullopt, /*enable_gqa=*/true);
    return at::scaled_dot_product_attention(q, k, v, allowed, 0.0, false, std::nullopt, /*enable_gqa=*/true);
  }
#else
  TORCH_CHECK(!native, "grouped_attention: native GQA needs LibTorch >= 2.5");
#endif
  const auto repeat = [&](const torch::Tensor& t) {  // (B, Hkv, L, d) -> (B, Hq, L, d)
    const int64_t d = t.size(3);
    return t.unsqueeze(2).expand({B, Hkv, group, L, d}).reshape({B, Hkv * group, L, d});
  };
  return masked_attention(q, repeat(k), repeat(v), allowed);
}

// Whether scaled_dot_product_attention would take its math path for q, k (.., hd) and a narrower
// v (.., hv < hd), keeping the (B, H, L, L) probabilities for backward, but a fused kernel once v is
// zero-padded to hd: flash attention takes only equal head dims (2.6's CPU dispatcher then falls
// back to math: MLA's 96 / 64 at width 512 kept 3.5 GB where the plan said 1.9). The padded
// columns of the output are zero and the others unchanged, so the caller pads and narrows back.
// Asked of _fused_sdp_choice (shapes and dtypes only), with q standing in for the padded v (same
// batch, heads, length and width: MLA's; otherwise no padding), nothing allocated on the step's path.
inline bool attention_pads_value(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                 const torch::Tensor& allowed) {
#if TRAINER_TORCH_AT_LEAST(2, 5)
  if (v.size(-1) >= q.size(-1) || v.size(0) != q.size(0) || v.size(1) != q.size(1) || v.size(2) != q.size(2)) return false;
  const auto choice = [&](const torch::Tensor& value) {
    return allowed.defined() ? at::_fused_sdp_choice(q, k, value, allowed, 0.0, false)
                             : at::_fused_sdp_choice(q, k, value, {}, 0.0, true);
  };
  return choice(v) == 0 && choice(q) != 0;  // sdp::SDPBackend::math is 0
#else
  (void)q, (void)k, (void)v, (void)allowed;
  return false;
#endif
}

// The kernel scaled_dot_product_attention picks for these inputs (what the trainer logs at
// start-up): "flash", "efficient", "cudnn", "math", or on 1.13 "explicit softmax".
inline std::string attention_kernel_name(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                         const torch::Tensor& allowed, bool native) {
#if TRAINER_TORCH_AT_LEAST(2, 5)
  const auto group = q.size(1) / k.size(1);
  const auto kk = native || group == 1 ? k : k.repeat_interleave(group, 1), vv = native || group == 1 ? v : v.repeat_interleave(group, 1);
  const int64_t choice = allowed.defined() ? at::_fused_sdp_choice(q, kk, vv, allowed, 0.0, false, std::nullopt, native)
                                           : at::_fused_sdp_choice(q, kk, vv, {}, 0.0, true, std::nullopt, native);
  switch (choice) {  // sdp::SDPBackend
    case 0: return "math";
    case 1: return "flash";
    case 2: return "efficient";
    case 3: return "cudnn";
    default: return "backend " + std::to_string(choice);
  }
#else
  (void)q, (void)k, (void)v, (void)allowed, (void)native;
  return "explicit softmax";
#endif
}

// Whether RMSNorm runs as LibTorch's own at::rms_norm: on CUDA with LibTorch >= 2.9, where its
// forward and backward are fused kernels (one pass each instead of five elementwise ops). It
// exists from 2.4, but as the same composite of ops the model writes out, so elsewhere the model
// keeps its own. Only for inputs of the weight's dtype (at::rms_norm falls back otherwise).
inline bool fused_rms_norm(const torch::Device& device) {
  return TRAINER_TORCH_AT_LEAST(2, 9) && device.is_cuda();
}

// x * rsqrt(mean(x^2, -1) + eps) * weight over the last dimension, by at::rms_norm (>= 2.4).
inline torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
#if TRAINER_TORCH_AT_LEAST(2, 4)
  return at::rms_norm(x, {weight.size(0)}, weight, eps);
#else
  (void)x, (void)weight, (void)eps;
  TORCH_CHECK(false, "compat::rms_norm needs LibTorch >= 2.4");
#endif
}

}  // namespace trainer::compat

namespace trainer::compat {

// One fused AdamW kernel over a flat fp32 buffer on a CUDA device (LibTorch >= 2.1), with the
// trainer's formula: p -= (lr*wd) * p; m = lerp(m, g, 1-b1); v = b2*v + (1-b2)*g^2;
// p -= lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps). `step` is a 1-element fp32 device tensor
// holding t. Call only where fused_adamw_available(device) is true.
inline void fused_adamw(torch::Tensor& params, const torch::Tensor& grads, torch::Tensor& m, torch::Tensor& v,
                        const torch::Tensor& step, double lr, double b1, double b2, double weight_decay, double eps) {
#if TRAINER_TORCH_AT_LEAST(2, 1)
  std::vector<at::Tensor> p_list{params}, g_list{grads}, m_list{m}, v_list{v}, steps{step};
  at::_fused_adamw_(p_list, g_list, m_list, v_list, /*max_exp_avg_sqs=*/{}, steps, lr, b1, b2, weight_decay, eps,
                    /*amsgrad=*/false, /*maximize=*/false);
#else
  (void)params, (void)grads, (void)m, (void)v, (void)step, (void)lr, (void)b1, (void)b2, (void)weight_decay, (void)eps;
  TORCH_CHECK(false, "fused AdamW needs LibTorch >= 2.1 on CUDA");
#endif
}

inline bool fused_adamw_available(const torch::Device& device) {
  return TRAINER_TORCH_AT_LEAST(2, 1) && device.is_cuda();
}

}  // namespace trainer::compat

namespace trainer::compat {

// LibTorch >= 2.4 starts a TCPStore server on its libuv backend by default, and builds without
// libuv (Debian's 2.x) throw "use_libuv was requested but PyTorch was build without libuv
// support" instead of falling back. Switches `options` (a c10d::TCPStoreOptions) to the classic
// backend and returns true; returns false where there is no such switch (1.13 has only that one).
template <class StoreOptions>
bool tcp_store_use_classic_backend(StoreOptions& options) {
#if TRAINER_TORCH_AT_LEAST(2, 3)
  if (!options.useLibUV) return false;
  options.useLibUV = false;
  return true;
#else
  (void)options;
  return false;
#endif
}

}  // namespace trainer::compat

namespace trainer::compat {

// A c10::Allocator that hands every request to another one and sees each block (size, data)
// before returning it. LibTorch
// 2.3 made allocate() non-const and added the pure virtual copy_data(); both live here. The
// DataPtrs come from the base, with its deleter, so frees go where they always went.
class ForwardingAllocator : public c10::Allocator {
 public:
  explicit ForwardingAllocator(c10::Allocator* base) : base_(base) {}
#if TRAINER_TORCH_AT_LEAST(2, 3)
  c10::DataPtr allocate(size_t n) override {
#else
  c10::DataPtr allocate(size_t n) const override {
#endif
    auto block = base_->allocate(n);
    on_allocate(n, block.get());
    return block;
  }
  c10::DeleterFnPtr raw_deleter() const override { return base_->raw_deleter(); }
#if TRAINER_TORCH_AT_LEAST(2, 3)
  void copy_data(void* dest, const void* src, std::size_t count) const override { base_->copy_data(dest, src, count); }
  bool is_simple_data_ptr(const c10::DataPtr& data_ptr) const override { return base_->is_simple_data_ptr(data_ptr); }
#endif

 protected:
  virtual void on_allocate(size_t n, void* data) const = 0;

 private:
  c10::Allocator* base_;
};

}  // namespace trainer::compat

namespace trainer::compat {

// Grouped GEMM with the group boundaries on the device (no host read; MoE experts): rows
// [offsets[g-1], offsets[g]) of x (M, K) times w[g] (K, N) -> (M, N). bf16 on CUDA (sm90),
// LibTorch >= 2.8 (at::_grouped_mm, differentiable); K and N multiples of 8 (16-byte rows).
constexpr bool kGroupedMm = TRAINER_TORCH_AT_LEAST(2, 8);

inline bool grouped_mm_usable(const torch::Device& device, at::ScalarType dtype, int64_t k, int64_t n) {
  return kGroupedMm && device.is_cuda() && dtype == at::kBFloat16 && k % 8 == 0 && n % 8 == 0;
}

inline torch::Tensor grouped_mm(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& offsets) {
#if TRAINER_TORCH_AT_LEAST(2, 8)
  return at::_grouped_mm(x, w, offsets);
#else
  (void)x, (void)w, (void)offsets;
  TORCH_CHECK(false, "grouped_mm needs LibTorch >= 2.8 on CUDA");
  return {};
#endif
}

}  // namespace trainer::compat

namespace trainer::compat {

// bf16 matrix products on the CPU. LibTorch 1.13 serves them through oneDNN (fp32 accumulation)
// only where the CPU has AVX-512 BW, VL and DQ. Elsewhere its fallback is scalar code that sums
// in bf16 when neither operand is transposed (a (64, K) x (K, 64) product of bf16 inputs off by
// 1.0% of its norm at K = 64, 3.7% at 1024, 9.8% at 8192, measured on an AVX2 AMD EPYC) and is
// 12-60x slower than OpenBLAS's fp32 GEMM of the same operands (docs/training.md). There the trainer multiplies bf16 operands as fp32 (every product of two bf16
// values is exact in fp32), sums in fp32 and rounds the result to bf16 once: what a GPU's bf16
// GEMM does. LibTorch >= 2.0 accumulates in fp32 on every CPU (measured with 2.6 on the same
// machine), so it keeps its own kernels. gemm_via_fp32_set overrides the choice (tests).
inline std::atomic<int>& cpu_bf16_gemm_override() {
  static std::atomic<int> mode{-1};  // -1: this CPU's need; 0 / 1: forced off / on
  return mode;
}

inline bool cpu_bf16_gemm_native_accumulates_in_fp32() {
  if (TRAINER_TORCH_AT_LEAST(2, 0)) return true;
#if defined(__x86_64__) || defined(__i386__)
  // 1.13's mkldnn_bf16_device_check: oneDNN's bf16 GEMM needs these three.
  static const bool onednn = __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                             __builtin_cpu_supports("avx512dq");
  return onednn;
#else
  return false;
#endif
}

// The config key cpu_bf16_gemm as a mode: auto -1, native 0, fp32 1.
inline int cpu_bf16_gemm_mode_of(const std::string& key) { return key == "fp32" ? 1 : key == "native" ? 0 : -1; }

// Whether a mode computes bf16 GEMMs on this CPU as fp32 GEMMs of the bf16 operands.
inline bool cpu_bf16_gemm_via_fp32_in(int mode) { return mode < 0 ? !cpu_bf16_gemm_native_accumulates_in_fp32() : mode == 1; }

// Whether bf16 GEMMs on the CPU run as fp32 GEMMs of the bf16 operands now (see above).
inline bool cpu_bf16_gemm_via_fp32() { return cpu_bf16_gemm_via_fp32_in(cpu_bf16_gemm_override().load()); }

inline void cpu_bf16_gemm_via_fp32_set(int mode) { cpu_bf16_gemm_override() = mode; }

// The dtype a GEMM operand of this dtype and device is multiplied in: fp32 for a bf16 CPU tensor
// where cpu_bf16_gemm_via_fp32(), else its own. Callers convert both operands with .to(it) (a
// no-op otherwise) and round the product back to bf16, outside autocast (which would cast the fp32
// operands back to bf16).
inline at::ScalarType gemm_operand_dtype(const torch::Tensor& t) {
  return t.is_cpu() && t.scalar_type() == at::kBFloat16 && cpu_bf16_gemm_via_fp32() ? at::kFloat : t.scalar_type();
}

}  // namespace trainer::compat
