// The attention core shared by GQA and MLA layers: softmax(q k^T / sqrt(hd), causal [and
// same-segment] mask) v. LibTorch >= 2.0 runs scaled_dot_product_attention (compat); on 1.13,
// which has no fused kernel, block_causal_attention below does less work than the plain
// matmul-softmax-matmul composite.
#include <cmath>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <tuple>

#include "trainer/model/layers.h"
#include "trainer/model/model_size.h"
#include "trainer/util/torch_compat.h"

namespace trainer::model_detail {
namespace {

// Which keys packed documents let each query read: (B, 1, L, L) bool, causal and same segment;
// undefined for plain causal rows. A struct, not a tensor argument: autograd's apply() takes every
// tensor argument for an input, and this one is neither differentiable nor always defined.
struct SegmentMask {
  torch::Tensor allowed;  // (B, 1, L, L) bool or undefined
};

// Plain causal, within a diagonal block: row r (position s + r/g) may not see key s + c, c > r/g.
// (block*g, block) of 0 and -inf in the scores' dtype, added to the diagonal block's scores (a
// vectorized add: LibTorch 1.13's CPU masked_fill_ with a bool mask is a scalar loop, and it was 2%
// of a tiny step). For finite scores the same as masking (only a score overflowed to +inf in a
// hidden position would now give NaN, which the step's non-finite check reports, where masking
// hid it). The same for every layer and step: built once per (block, g, dtype, device) and
// kept for the process (the map is never destroyed, so no device tensor outlives its runtime).
torch::Tensor diagonal_block_bias(int64_t block, int64_t group, torch::ScalarType dtype, const torch::Device& device) {
  static std::mutex mutex;
  static auto* biases = new std::map<std::tuple<int64_t, int64_t, int, int, int>, torch::Tensor>;
  const std::lock_guard<std::mutex> lock(mutex);
  auto& bias = (*biases)[{block, group, static_cast<int>(dtype), static_cast<int>(device.type()), device.index()}];
  if (!bias.defined()) {
    const auto opts = torch::TensorOptions().dtype(torch::kLong).device(device);
    const auto hidden =
        torch::arange(block, opts).unsqueeze(0) > torch::arange(block * group, opts).div(group, "floor").unsqueeze(1);
    bias = torch::zeros(hidden.sizes(), opts.dtype(dtype)).masked_fill_(hidden, -std::numeric_limits<double>::infinity());
  }
  return bias;
}

// Block-causal attention as one autograd node. Inputs are laid out so that a block of query
// positions is a contiguous row range for every kv head:
//   q3 (N, L*g, hd): N = B*Hkv, row l*g + j = position l of query head kv*g + j (the g query
//                     heads that read kv head kv, HF repeat_kv order);
//   k3 (N, L, hd), v3 (N, L, hv).
// Query block [s, e) only needs keys [0, e): the upper-right blocks of the (L, L) scores, all
// masked, are never computed (with blocks of b positions, (L/b + 1) / (2 L/b) of the full
// scores' GEMM FLOPs, softmax and memory). The scale goes into q once (qs = scale q: hd columns
// instead of L per row). Forward per block, S = qs_blk k[:e]^T, masked, P = softmax(S),
// O_blk = P v[:e]; the probabilities P are kept. Backward per block, with dO_blk the output
// gradient:
//   dv[:e] += P^T dO_blk                dP = dO_blk v[:e]^T
//   dS = P * (dP - rowsum(P * dP))      (softmax backward: _softmax_backward_data, one kernel)
//   dqs_blk = dS k[:e]                  dk[:e] += dS^T qs_blk
// and dq = scale dqs at the end. (No GEMM with beta = 0 into uninitialized memory: 1.13's
// small-matrix baddbmm path multiplies the old contents by beta, so 0 * NaN would leak in.)
// Masked entries have P = 0, hence dS = 0: the mask needs no backward. Every query row attends
// to at least itself, so no row is all -inf.
// bf16 where compat::cpu_bf16_gemm_via_fp32() (LibTorch 1.13 without AVX-512, whose bf16 GEMMs sum
// in bf16): the GEMMs take fp32 copies of the bf16 operands and round S, O_blk, dP and dqs to bf16
// (a GPU's bf16 GEMM); dk and dv are summed over the blocks in fp32 and rounded once at the end.
class BlockCausalAttention : public torch::autograd::Function<BlockCausalAttention> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& q3,
                               const torch::Tensor& k3, const torch::Tensor& v3, const SegmentMask& segments,
                               int64_t group, int64_t block) {
    const int64_t N = k3.size(0), L = k3.size(1), hv = v3.size(2);
    const auto qs = q3 * (1.0 / std::sqrt(static_cast<double>(q3.size(2))));  // (N, L*g, hd)
    auto out = torch::empty({N, L * group, hv}, q3.options());  // (N, L*g, hv)
    const auto gemm = compat::gemm_operand_dtype(q3);  // q3's, or fp32 for bf16 on such CPUs
    const bool rounded = gemm != q3.scalar_type();
    std::optional<c10::impl::ExcludeDispatchKeyGuard> no_autocast;  // the fp32 GEMMs stay fp32
    if (rounded) no_autocast.emplace(c10::autocast_dispatch_keyset);
    const auto qs_g = qs.to(gemm), k_g = k3.to(gemm), v_g = v3.to(gemm);  // the operands, as multiplied
    const auto& allowed = segments.allowed;
    const auto diagonal_bias =
        allowed.defined() ? torch::Tensor() : diagonal_block_bias(block, group, q3.scalar_type(), q3.device());
    std::vector<torch::Tensor> saved = {qs, k3, v3};
    for (int64_t s = 0; s < L; s += block) {
      const int64_t e = std::min(L, s + block), rows = (e - s) * group;
      auto scores = torch::bmm(qs_g.narrow(1, s * group, rows), k_g.narrow(1, 0, e).transpose(1, 2))
                        .to(q3.scalar_type());  // (N, rows, e)
      if (allowed.defined()) {
        // Inverted per block: no (B, L, L) copy per layer.
        const int64_t B = allowed.size(0);
        const auto hidden = allowed.narrow(2, s, e - s).narrow(3, 0, e).logical_not();  // (B, 1, e-s, e)
        scores.view({B, N / B, e - s, group, e})
            .masked_fill_(hidden.reshape({B, 1, e - s, 1, e}), -std::numeric_limits<double>::infinity());
      } else {
        scores.narrow(2, s, e - s).add_(diagonal_bias.narrow(0, 0, rows).narrow(1, 0, e - s));
      }
      // bf16: LibTorch's CPU softmax accumulates reduced-precision rows in fp32 and rounds once,
      // as an fp32 softmax cast back would, without the fp32 (N, rows, e) copy.
      const auto probs = torch::softmax(scores, -1);  // (N, rows, e)
      auto out_block = out.narrow(1, s * group, rows);
      if (rounded)
        out_block.copy_(torch::bmm(probs.to(gemm), v_g.narrow(1, 0, e)));
      else
        at::bmm_out(out_block, probs, v3.narrow(1, 0, e));
      saved.push_back(probs);
    }
    ctx->save_for_backward(saved);
    ctx->saved_data["group"] = group;
    ctx->saved_data["block"] = block;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const auto &qs = saved[0], &k3 = saved[1], &v3 = saved[2];
    const int64_t group = ctx->saved_data["group"].toInt(), block = ctx->saved_data["block"].toInt();
    const int64_t L = k3.size(1);
    const double scale = 1.0 / std::sqrt(static_cast<double>(qs.size(2)));
    const auto dtype = qs.scalar_type(), gemm = compat::gemm_operand_dtype(qs);
    std::optional<c10::impl::ExcludeDispatchKeyGuard> no_autocast;
    if (gemm != dtype) no_autocast.emplace(c10::autocast_dispatch_keyset);
    const auto qs_g = qs.to(gemm), k_g = k3.to(gemm), v_g = v3.to(gemm);
    const auto grad_out = grad_outputs[0].to(dtype).to(gemm).contiguous();  // (N, L*g, hv)
    // In the GEMMs' dtype; dqs rounded to qs's dtype block by block (bmm_out's rounding elsewhere).
    auto grad_q = torch::empty_like(qs), grad_k = torch::zeros_like(k_g), grad_v = torch::zeros_like(v_g);
    for (int64_t s = 0, i = 3; s < L; s += block, ++i) {
      const int64_t e = std::min(L, s + block), rows = (e - s) * group;
      const auto& probs = saved[i];  // (N, rows, e)
      const auto probs_g = probs.to(gemm);
      const auto grad_out_block = grad_out.narrow(1, s * group, rows);
      auto grad_v_head = grad_v.narrow(1, 0, e), grad_k_head = grad_k.narrow(1, 0, e);
      grad_v_head.baddbmm_(probs_g.transpose(1, 2), grad_out_block);
      const auto grad_probs = torch::bmm(grad_out_block, v_g.narrow(1, 0, e).transpose(1, 2)).to(dtype);  // (N, rows, e)
      const auto grad_scores = at::_softmax_backward_data(grad_probs, probs, -1, probs.scalar_type()).to(gemm);
      auto grad_q_block = grad_q.narrow(1, s * group, rows);
      if (gemm != dtype)
        grad_q_block.copy_(torch::bmm(grad_scores, k_g.narrow(1, 0, e)));
      else
        at::bmm_out(grad_q_block, grad_scores, k3.narrow(1, 0, e));
      grad_k_head.baddbmm_(grad_scores.transpose(1, 2), qs_g.narrow(1, s * group, rows));
    }
    grad_q.mul_(scale);
    return {grad_q, grad_k.to(dtype), grad_v.to(dtype), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor block_causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                     const torch::Tensor& segment_mask, int64_t block) {
  const int64_t B = q.size(0), Hq = q.size(1), L = q.size(2), hd = q.size(3);
  const int64_t Hkv = k.size(1), hv = v.size(3), group = Hq / Hkv;
  TORCH_CHECK(Hq % Hkv == 0 && k.size(2) == L && v.size(2) == L && k.size(3) == hd && block > 0,
              "block_causal_attention: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes(), ", block ", block);
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "block_causal_attention: q, k and v must share a dtype");
  TORCH_CHECK(!segment_mask.defined() || (segment_mask.dim() == 4 && segment_mask.size(0) == B),
              "block_causal_attention: segment_mask must be (B, 1, L, L)");
  const auto q3 = q.view({B, Hkv, group, L, hd}).permute({0, 1, 3, 2, 4}).reshape({B * Hkv, L * group, hd});
  const auto k3 = k.reshape({B * Hkv, L, hd}), v3 = v.reshape({B * Hkv, L, hv});
  const auto out = BlockCausalAttention::apply(q3, k3, v3, SegmentMask{segment_mask}, group, std::min(block, L));  // (N, L*g, hv)
  // (B, Hkv, L, g, hv) -> (B, L, Hq*hv) in one copy; returned as the (B, Hq, L, hv) view of it, so
  // the caller's transpose back to (B, L, Hq*hv) for the output projection is free.
  return out.view({B, Hkv, L, group, hv}).permute({0, 2, 1, 3, 4}).reshape({B, L, Hq, hv}).transpose(1, 2);
}

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                               const torch::Tensor& segment_mask) {
  // With a segment mask no fused kernel takes grouped heads (flash takes no mask, efficient
  // attention no grouped heads), so enable_gqa would choose the math kernel, which repeats k and v
  // itself: repeat them here and keep the efficient kernel.
  if (compat::kFusedCausalAttention)
    return compat::grouped_attention(q, k, v, segment_mask,
                                     compat::native_gqa_attention(q.device()) && !segment_mask.defined());
  return block_causal_attention(q, k, v, segment_mask, kAttentionBlock);
}

}  // namespace trainer::model_detail
