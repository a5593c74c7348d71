// Model: causality, segment isolation, position handling, HF parameter names, counts vs config, and
// the logits against an independent float64 forward written from Hugging Face's definitions.
#include <catch2/catch.hpp>

#include <sys/mman.h>
#include <unistd.h>

#include <fstream>

#include "test_support.h"
#include "trainer/model/layers.h"
#include "trainer/model/model.h"
#include "trainer/model/row_kernels.h"
#include "trainer/train/cross_entropy.h"
#include "trainer/util/torch_compat.h"

using namespace trainer;
using namespace trainer::testing;

namespace {
struct Inputs {
  torch::Tensor tokens, positions, segments;  // (1, L)
};
Inputs two_documents(int64_t L, int64_t split) {
  auto tokens = torch::randint(1, 64, {1, L}, torch::kInt64);
  auto segments = torch::ones({1, L}, torch::kInt64);
  segments.narrow(1, split, L - split).fill_(2);
  auto positions = torch::arange(L, torch::kInt64).unsqueeze(0).clone();
  positions.narrow(1, split, L - split).sub_(split);  // restart per document
  return {tokens, positions, segments};
}

// Attention written out per head, the independent reference of the attention kernels: query head
// h of q (B, Hq, L, hd) against kv head h / (Hq / Hkv) of k (B, Hkv, L, hd) and v (B, Hkv, L, hv),
// masked to allowed (B, 1, L, L), in the inputs' dtype (differentiable). Returns (B, Hq, L, hv).
torch::Tensor per_head_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                 const torch::Tensor& allowed) {
  const int64_t Hq = q.size(1), group = Hq / k.size(1);
  std::vector<torch::Tensor> heads;
  for (int64_t h = 0; h < Hq; ++h) {
    auto scores = torch::matmul(q.select(1, h), k.select(1, h / group).transpose(-2, -1)) /
                  std::sqrt(static_cast<double>(q.size(3)));  // (B, L, L)
    scores = scores.masked_fill(allowed.select(1, 0).logical_not(), -INFINITY);
    heads.push_back(torch::matmul(torch::softmax(scores, -1), v.select(1, h / group)));
  }
  return torch::stack(heads, 1);
}
}  // namespace

TEST_CASE("causality: a future token never changes earlier logits", "[model]") {
  torch::manual_seed(1);
  auto model = model_build(tiny_config({"use_qk_norm=true", "override_model_config=true"}));
  const int64_t L = 16;
  auto in = two_documents(L, L);  // one document
  const auto before = model->forward(in.tokens, in.positions, in.segments).logits;
  auto changed = in.tokens.clone();
  changed[0][10] = changed[0][10].item<int64_t>() % 63 + 1;  // a different id in [1, 64)
  const auto after = model->forward(changed, in.positions, in.segments).logits;
  CHECK(torch::equal(before.narrow(1, 0, 10), after.narrow(1, 0, 10)));
  CHECK_FALSE(torch::allclose(before.narrow(1, 10, 1), after.narrow(1, 10, 1)));  // the test can fail
}

TEST_CASE("segments: packed documents never see each other", "[model]") {
  torch::manual_seed(2);
  auto model = model_build(tiny_config());
  const int64_t L = 16, split = 6;
  auto in = two_documents(L, split);
  const auto before = model->forward(in.tokens, in.positions, in.segments).logits;
  auto changed = in.tokens.clone();
  changed[0][2] = changed[0][2].item<int64_t>() == 5 ? 6 : 5;  // a token of document 1
  const auto after = model->forward(changed, in.positions, in.segments).logits;
  // Document 2 (positions split..L) is untouched; document 1 after position 2 does change.
  CHECK(torch::equal(before.narrow(1, split, L - split), after.narrow(1, split, L - split)));
  CHECK_FALSE(torch::allclose(before.narrow(1, 3, 1), after.narrow(1, 3, 1)));
  // A document's logits depend only on its own tokens and positions: run it alone.
  const auto alone = model->forward(in.tokens.narrow(1, split, L - split), in.positions.narrow(1, split, L - split),
                                    in.segments.narrow(1, split, L - split)).logits;
  CHECK(torch::allclose(alone, before.narrow(1, split, L - split), 1e-5, 1e-5));
}

TEST_CASE("plain causal attention (one segment per row) equals the segment mask path", "[model]") {
  torch::manual_seed(4);
  auto model = model_build(tiny_config({"use_qk_norm=true", "override_model_config=true"}));
  const int64_t L = 16;
  auto in = two_documents(L, L);  // every segment id is 1
  const auto masked = model->forward(in.tokens, in.positions, in.segments, /*one_segment_per_row=*/false).logits;
  const auto causal = model->forward(in.tokens, in.positions, in.segments, /*one_segment_per_row=*/true).logits;
  CHECK(torch::allclose(masked, causal, 1e-6, 1e-6));
  // The flag changes the mask, so with two documents the two paths must differ (the test can fail).
  auto two = two_documents(L, 6);
  const auto segmented = model->forward(two.tokens, two.positions, two.segments, false).logits;
  const auto wrongly_causal = model->forward(two.tokens, two.positions, two.segments, true).logits;
  CHECK_FALSE(torch::allclose(segmented, wrongly_causal, 1e-4, 1e-4));
}

TEST_CASE("grouped attention: repeated and native kv heads equal a per-head float64 softmax", "[model]") {
  torch::manual_seed(5);
  const int64_t B = 2, Hq = 6, Hkv = 2, L = 9, hd = 8;
  const auto q0 = torch::randn({B, Hq, L, hd}), k0 = torch::randn({B, Hkv, L, hd}), v0 = torch::randn({B, Hkv, L, hd});
  // Packed rows: tokens 0-3 and 4-8 of row 1 are two documents.
  auto same = torch::ones({B, 1, L, L}, torch::kBool).tril();
  same[1].narrow(1, 4, 5).narrow(2, 0, 4).fill_(false);
  // The reference: each query head h against kv head h / 3, float64.
  const auto reference = [&](const torch::Tensor& allowed) {
    return per_head_attention(q0.to(torch::kFloat64), k0.to(torch::kFloat64), v0.to(torch::kFloat64), allowed);
  };
  std::vector<bool> natives = {false};
  if (TRAINER_TORCH_AT_LEAST(2, 5)) natives.push_back(true);  // enable_gqa exists from 2.5
  for (const bool native : natives) {
    INFO("native " << native);
    const auto causal = torch::ones({B, 1, L, L}, torch::kBool).tril();
    // Plain causal rows take no mask (on 2.x: the fused causal call).
    const auto plain = compat::grouped_attention(q0, k0, v0, {}, native);
    CHECK(torch::allclose(plain.to(torch::kFloat64), reference(causal), 1e-5, 1e-6));
    const auto packed = compat::grouped_attention(q0, k0, v0, same, native);
    CHECK(torch::allclose(packed.to(torch::kFloat64), reference(same), 1e-5, 1e-6));
    CHECK_FALSE(compat::attention_kernel_name(q0, k0, v0, {}, native).empty());
  }
  CHECK_FALSE(compat::native_gqa_attention(torch::kCPU));  // the CPU repeats k and v (torch_compat.h says why)
}

TEST_CASE("block-causal attention: values and gradients equal a per-head float64 softmax", "[model]") {
  torch::manual_seed(7);
  const int64_t B = 2, Hq = 6, L = 23, hd = 8, hv = 5;  // L not a multiple of any block below; hv != hd as in MLA
  // Packed rows: row 1 holds documents [0, 9), [9, 20), [20, 23).
  auto same = torch::ones({B, 1, L, L}, torch::kBool).tril();
  same[1].narrow(1, 9, L - 9).narrow(2, 0, 9).fill_(false);
  same[1].narrow(1, 20, L - 20).narrow(2, 9, 11).fill_(false);
  const auto causal = torch::ones({B, 1, L, L}, torch::kBool).tril();
  const auto reference = per_head_attention;  // independent: per head, written out
  for (const int64_t Hkv : {int64_t{6}, int64_t{2}, int64_t{3}}) {
    for (const int64_t block : {int64_t{1}, int64_t{5}, int64_t{8}, int64_t{64}}) {
      for (const bool packed : {false, true}) {
        INFO("Hkv " << Hkv << " block " << block << " packed " << packed);
        const auto q = torch::randn({B, Hq, L, hd}, torch::kFloat64).requires_grad_();
        const auto k = torch::randn({B, Hkv, L, hd}, torch::kFloat64).requires_grad_();
        const auto v = torch::randn({B, Hkv, L, hv}, torch::kFloat64).requires_grad_();
        const auto upstream = torch::randn({B, Hq, L, hv}, torch::kFloat64);
        const auto expected = reference(q, k, v, packed ? same : causal);
        const auto ours = model_detail::block_causal_attention(q, k, v, packed ? same : torch::Tensor(), block);
        REQUIRE(ours.sizes() == expected.sizes());
        CHECK(torch::allclose(ours, expected, 1e-10, 1e-12));
        const auto g_expected = torch::autograd::grad({expected}, {q, k, v}, {upstream});
        const auto g_ours = torch::autograd::grad({ours}, {q, k, v}, {upstream});
        for (int i = 0; i < 3; ++i) CHECK(torch::allclose(g_ours[i], g_expected[i], 1e-10, 1e-12));
      }
    }
  }
  // fp32 and bf16 against the same float64 reference.
  const auto q = torch::randn({B, Hq, L, hd}), k = torch::randn({B, 2, L, hd}), v = torch::randn({B, 2, L, hv});
  const auto expected = reference(q.to(torch::kFloat64), k.to(torch::kFloat64), v.to(torch::kFloat64), same);
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    const double tol = dtype == torch::kFloat32 ? 1e-5 : 3e-2;
    const auto ours = model_detail::block_causal_attention(q.to(dtype), k.to(dtype), v.to(dtype), same, 8);
    CHECK(ours.scalar_type() == dtype);
    CHECK(torch::allclose(ours.to(torch::kFloat64), expected, tol, tol));
  }
  // The model's dispatch: on 1.13 this kernel, on 2.x scaled_dot_product_attention; both agree.
  const auto dispatched = model_detail::causal_attention(q, k, v, same);
  CHECK(torch::allclose(dispatched.to(torch::kFloat64), expected, 1e-5, 1e-5));
}

TEST_CASE("RMSNorm: the model's and LibTorch's at::rms_norm agree in value and gradients", "[model]") {
  CpuRowKernelsRestore restore;
  for (const bool row_kernel : {true, false}) {
    INFO("CPU row loop " << row_kernel);
    cpu_row_kernels_set(row_kernel);
    torch::manual_seed(6);
    RMSNorm norm(16, 1e-5);
    { torch::NoGradGuard no_grad; norm->weight.uniform_(0.5, 1.5); }
    const auto x0 = torch::randn({3, 5, 16}) * 3;
    // Independent: float64, written out.
    const auto x64 = x0.to(torch::kFloat64);
    const auto expected = x64 * torch::rsqrt(x64.square().mean(-1, true) + 1e-5) * norm->weight.detach().to(torch::kFloat64);
    const auto x = x0.clone().requires_grad_();
    const auto ours = norm(x);
    CHECK(torch::allclose(ours.to(torch::kFloat64), expected, 1e-6, 1e-6));
    {
      // The hand-written backward against autograd through the float64 formula above, and against
      // central differences of the float64 module itself (one input and one weight entry).
      const auto upstream = torch::randn_like(x0).to(torch::kFloat64);
      const auto x64g = x64.clone().requires_grad_();
      const auto w64 = norm->weight.detach().to(torch::kFloat64).requires_grad_();
      const auto reference = x64g * torch::rsqrt(x64g.square().mean(-1, true) + 1e-5) * w64;
      const auto want = torch::autograd::grad({reference}, {x64g, w64}, {upstream});
      const auto x32 = x0.clone().requires_grad_();
      const auto got = torch::autograd::grad({norm(x32)}, {x32, norm->weight}, {upstream.to(torch::kFloat32)});
      CHECK(torch::allclose(got[0].to(torch::kFloat64), want[0], 1e-5, 1e-6));
      CHECK(torch::allclose(got[1].to(torch::kFloat64), want[1], 1e-5, 1e-6));
      RMSNorm norm64(16, 1e-5);
      norm64->to(torch::kFloat64);
      { torch::NoGradGuard no_grad; norm64->weight.copy_(w64.detach()); }
      const auto xg = x64.clone().requires_grad_();
      const auto analytic = torch::autograd::grad({(norm64(xg) * upstream).sum()}, {xg, norm64->weight});
      const auto objective = [&](const torch::Tensor& input) { return (norm64(input) * upstream).sum().item<double>(); };
      const double h = 1e-6;
      auto plus = x64.clone(), minus = x64.clone();
      plus[1][2][3] += h, minus[1][2][3] -= h;
      CHECK(analytic[0][1][2][3].item<double>() == Approx((objective(plus) - objective(minus)) / (2 * h)).epsilon(1e-6));
      torch::NoGradGuard no_grad;
      const double w5 = norm64->weight[5].item<double>();
      norm64->weight[5].fill_(w5 + h);
      const double up = objective(x64);
      norm64->weight[5].fill_(w5 - h);
      const double down = objective(x64);
      CHECK(analytic[1][5].item<double>() == Approx((up - down) / (2 * h)).epsilon(1e-6));
    }
    if (TRAINER_TORCH_AT_LEAST(2, 4)) {  // the fused path's call (CUDA >= 2.9), checked on the CPU
      const auto x2 = x0.clone().requires_grad_();
      const auto theirs = compat::rms_norm(x2, norm->weight, 1e-5);
      CHECK(torch::allclose(theirs, ours, 1e-6, 1e-6));
      const auto upstream = torch::randn_like(x0);
      const auto g_ours = torch::autograd::grad({ours}, {x, norm->weight}, {upstream});
      const auto g_theirs = torch::autograd::grad({theirs}, {x2, norm->weight}, {upstream});
      CHECK(torch::allclose(g_theirs[0], g_ours[0], 1e-5, 1e-6));
      CHECK(torch::allclose(g_theirs[1], g_ours[1], 1e-5, 1e-5));
    }
  }
  CHECK_FALSE(compat::fused_rms_norm(torch::kCPU));
}

TEST_CASE("RMSNorm's CPU row loop equals its ATen kernels on many rows over two threads", "[model]") {
  // Rows enough for two chunks on two intra-op threads (each with its own weight-gradient partial
  // sums), a width that is no multiple of the loop's 8 lanes, and a strided input.
  CpuRowKernelsRestore restore;
  const int threads = at::get_num_threads();
  at::set_num_threads(2);
  torch::manual_seed(7);
  RMSNorm norm(203, 1e-6);
  { torch::NoGradGuard no_grad; norm->weight.uniform_(0.5, 1.5); }
  const auto x0 = (torch::randn({2, 203, 700}) * 2).transpose(1, 2);  // (2, 700, 203), strided
  const auto upstream = torch::randn({2, 700, 203});
  std::vector<torch::Tensor> results[2];
  for (const bool row_kernel : {true, false}) {
    cpu_row_kernels_set(row_kernel);
    const auto x = x0.clone(at::MemoryFormat::Preserve).requires_grad_();
    REQUIRE_FALSE(x.is_contiguous());
    const auto y = norm(x);
    auto grads = torch::autograd::grad({y}, {x, norm->weight}, {upstream});
    results[row_kernel] = {y.detach(), grads[0], grads[1]};
  }
  at::set_num_threads(threads);
  // Independent: float64 autograd through the formula.
  const auto x64 = x0.to(torch::kFloat64).requires_grad_();
  const auto w64 = norm->weight.detach().to(torch::kFloat64).requires_grad_();
  const auto reference = x64 * torch::rsqrt(x64.square().mean(-1, true) + 1e-6) * w64;
  const auto want = torch::autograd::grad({reference}, {x64, w64}, {upstream.to(torch::kFloat64)});
  const std::vector<torch::Tensor> expected = {reference.detach(), want[0], want[1]};
  const char* names[] = {"y", "dx", "dweight"};
  for (int i = 0; i < 3; ++i) {
    INFO(names[i]);
    for (const bool row_kernel : {true, false}) {
      INFO("CPU row loop " << row_kernel);
      const auto got = results[row_kernel][i].to(torch::kFloat64);
      const double scale = expected[i].abs().max().item<double>();
      CHECK((got - expected[i]).abs().max().item<double>() < 2e-6 * scale);
    }
    CHECK(torch::allclose(results[1][i], results[0][i], 1e-5, 1e-5 * expected[i].abs().max().item<double>()));
  }
}

TEST_CASE("parameters carry Hugging Face names and match the config-only count", "[model]") {
  for (const auto& overrides : std::vector<std::vector<std::string>>{
           {}, {"override_model_config=true", "use_qk_norm=true", "logits_via_embedding=true"}}) {
    const Config c = tiny_config(overrides);
    auto model = model_build(c);
    int64_t numel = 0;
    for (const auto& p : model->parameters()) numel += p.numel();
    CHECK(numel == model_size(c).total_params);
    const auto params = model->named_parameters();
    CHECK(params.contains("model.embed_tokens.weight"));
    CHECK(params.contains("model.layers.1.self_attn.q_proj.weight"));
    CHECK(params.contains("model.layers.0.mlp.down_proj.weight"));
    CHECK(params.contains("model.norm.weight"));
    CHECK(params.contains("lm_head.weight") == !c.logits_via_embedding);
    CHECK(params.contains("model.layers.0.self_attn.q_norm.weight") == c.use_qk_norm);
    // Linear weights are [out_features, in_features].
    CHECK(params["model.layers.0.self_attn.k_proj.weight"].sizes() == torch::IntArrayRef({2 * 8, 32}));
  }
}

TEST_CASE("RoPE's one-node backward equals autograd through HF's rotate_half form", "[model]") {
  // apply_rope's node (model.cpp, RopeFunction) has a hand-derived backward. Independent: HF's
  // formula x * cos + rotate_half(x) * sin in float64 with autograd, on a transposed (strided)
  // input as the attention passes it, with full and partial rotary dimensions; on the CPU both
  // as row loops and as ATen kernels.
  CpuRowKernelsRestore restore;
  torch::manual_seed(8);
  for (const int64_t rotary_dim : {16, 8}) {
    INFO("rotary_dim " << rotary_dim);
    const int64_t B = 2, H = 3, L = 5, hd = 16, half = rotary_dim / 2;
    const auto angles = torch::randn({B, 1, L, half}, torch::kFloat64) * 3;
    const auto cos = torch::cat({angles.cos(), angles.cos()}, -1), sin = torch::cat({angles.sin(), angles.sin()}, -1);
    const auto sin_signed = torch::cat({-angles.sin(), angles.sin()}, -1);
    const auto x0 = torch::randn({B, L, H, hd}, torch::kFloat64);
    const auto upstream = torch::randn({B, H, L, hd}, torch::kFloat64);
    const auto rotate_half = [&](const torch::Tensor& r) {
      return torch::cat({-r.narrow(-1, half, half), r.narrow(-1, 0, half)}, -1);
    };
    const auto x_ref = x0.clone().requires_grad_();
    const auto xt = x_ref.transpose(1, 2);  // (B, H, L, hd)
    const auto rot = xt.narrow(-1, 0, rotary_dim);
    const auto reference =
        torch::cat({rot * cos + rotate_half(rot) * sin, xt.narrow(-1, rotary_dim, hd - rotary_dim)}, -1);
    const auto want = torch::autograd::grad({reference}, {x_ref}, {upstream})[0];
    for (const auto dtype : {torch::kFloat64, torch::kFloat32}) {
      INFO(dtype);
      std::vector<torch::Tensor> by_path[2];
      for (const bool row_kernel : {true, false}) {
        INFO("CPU row loop " << row_kernel);
        cpu_row_kernels_set(row_kernel);
        const auto x = x0.to(dtype).requires_grad_();
        const auto out = model_detail::apply_rope(x.transpose(1, 2), cos.to(dtype), sin_signed.to(dtype));
        const auto got = torch::autograd::grad({out}, {x}, {upstream.to(dtype)})[0];
        const double tolerance = dtype == torch::kFloat64 ? 1e-12 : 1e-6;
        CHECK(torch::allclose(out.to(torch::kFloat64), reference.detach(), tolerance, tolerance));
        CHECK(torch::allclose(got.to(torch::kFloat64), want, tolerance, tolerance));
        by_path[row_kernel] = {out.detach(), got};
      }
      // One rounding apart at most (LibTorch's AVX2 addcmul may fuse the multiply-add).
      const double ulps = dtype == torch::kFloat64 ? 1e-15 : 5e-7;
      CHECK(torch::allclose(by_path[1][0], by_path[0][0], ulps, ulps));
      CHECK(torch::allclose(by_path[1][1], by_path[0][1], ulps, ulps));
    }
  }
}

TEST_CASE("SwiGLU's one-node backward equals autograd through silu(x W_g^T) * (x W_u^T)", "[model]") {
  // Mlp runs gate and up as one GEMM and SwiGLU as one node (model.cpp, SwiGLUFunction) with a
  // hand-derived backward. Independent: the three projections written out in float64 autograd.
  torch::manual_seed(9);
  Mlp mlp(12, 20);
  draw_weights(*mlp, 0.4);
  const auto x0 = torch::randn({2, 5, 12}, torch::kFloat64) * 2;
  const auto upstream = torch::randn({2, 5, 12}, torch::kFloat64);
  const auto wg = mlp->gate_proj->weight.detach().to(torch::kFloat64).requires_grad_();
  const auto wu = mlp->up_proj->weight.detach().to(torch::kFloat64).requires_grad_();
  const auto wd = mlp->down_proj->weight.detach().to(torch::kFloat64).requires_grad_();
  const auto x_ref = x0.clone().requires_grad_();
  const auto reference = torch::matmul(torch::silu(torch::matmul(x_ref, wg.t())) * torch::matmul(x_ref, wu.t()), wd.t());
  const auto want = torch::autograd::grad({reference}, {x_ref, wg, wu, wd}, {upstream});
  // fp32 and bf16 on the CPU run the node as a row loop (row_kernels.cpp) unless switched off; both
  // ways are checked. bf16 rounds every GEMM output, so it gets bf16's tolerance.
  CpuRowKernelsRestore restore;
  for (const auto dtype : {torch::kFloat64, torch::kFloat32, torch::kBFloat16}) {
    for (const bool row_kernel : {true, false}) {
      INFO(dtype << ", CPU row loop " << row_kernel);
      cpu_row_kernels_set(row_kernel);
      mlp->to(dtype);
      const auto x = x0.to(dtype).requires_grad_();
      const auto out = mlp(x);
      const auto got = torch::autograd::grad(
          {out}, {x, mlp->gate_proj->weight, mlp->up_proj->weight, mlp->down_proj->weight}, {upstream.to(dtype)});
      const double tolerance = dtype == torch::kFloat64 ? 1e-12 : dtype == torch::kFloat32 ? 1e-5 : 6e-2;
      CHECK(torch::allclose(out.to(torch::kFloat64), reference.detach(), tolerance, tolerance));
      for (size_t i = 0; i < got.size(); ++i) {
        INFO("gradient " << i);
        const double scale = dtype == torch::kBFloat16 ? want[i].abs().max().item<double>() : 1.0;
        CHECK(torch::allclose(got[i].to(torch::kFloat64), want[i], tolerance, tolerance * scale));
      }
    }
  }
}

TEST_CASE("SwiGLU's CPU row loop equals float64 formulas from -200 to 200 in fp32 and bf16", "[model]") {
  // The loop's own sigmoid (an exp polynomial, clamped by the exponent) against the exact
  // formulas, at the ends where it underflows and saturates, around 0, and on random values:
  //   h = g sigmoid(g) u,  du = dh g sigmoid(g),  dg = dh u sigmoid(g) (1 + g (1 - sigmoid(g))).
  torch::manual_seed(10);
  const auto edges = torch::tensor({-200.0, -100.0, -88.0, -87.0, -30.0, -1e-3, 0.0, 1e-3, 0.5, 30.0, 88.0, 100.0, 200.0},
                                   torch::kFloat64);
  const int64_t F = edges.size(0) + 51;
  const auto g64 = torch::cat({edges, torch::randn({51}, torch::kFloat64) * 4}).unsqueeze(0).repeat({3, 1});  // (3, F)
  const auto u64 = torch::randn({3, F}, torch::kFloat64), dh64 = torch::randn({3, F}, torch::kFloat64);
  for (const auto dtype : {torch::kFloat32, torch::kBFloat16}) {
    INFO(dtype);
    // The stored inputs, and the exact results from them.
    const auto g = g64.to(dtype), u = u64.to(dtype), dh = dh64.to(dtype);
    const auto ge = g.to(torch::kFloat64), ue = u.to(torch::kFloat64), dhe = dh.to(torch::kFloat64);
    const auto sig = torch::sigmoid(ge);
    const auto h_want = ge * sig * ue, du_want = dhe * ge * sig, dg_want = dhe * ue * sig * (1 + ge * (1 - sig));
    const auto gate_up = torch::cat({g, u}, 1).contiguous();  // (3, 2F)
    auto h = torch::empty({3, F}, gate_up.options()), dgate_up = torch::empty({3, 2 * F}, gate_up.options());
    if (dtype == torch::kFloat32) {
      model_detail::swiglu_rows_forward(gate_up.data_ptr<float>(), 3, F, h.data_ptr<float>());
      model_detail::swiglu_rows_backward(gate_up.data_ptr<float>(), dh.contiguous().data_ptr<float>(), 3, F,
                                         dgate_up.data_ptr<float>());
    } else {
      const auto bits = [](const torch::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); };
      const auto dh_rows = dh.contiguous();
      model_detail::swiglu_rows_forward(bits(gate_up), 3, F, bits(h));
      model_detail::swiglu_rows_backward(bits(gate_up), bits(dh_rows), 3, F, bits(dgate_up));
    }
    // fp32: a few ulp of fp32 over the exact value; bf16: the exact value rounded once (half an
    // ulp, 2^-9) plus the fp32 work before it; both flush what is below ~1e-38 (g < -87) to 0.
    const double rel = dtype == torch::kFloat32 ? 1e-6 : 1.0 / 256, abs = 1e-30;
    const std::pair<torch::Tensor, torch::Tensor> checks[] = {
        {h, h_want}, {dgate_up.narrow(1, F, F), du_want}, {dgate_up.narrow(1, 0, F), dg_want}};
    const char* names[] = {"h", "du", "dg"};
    for (int i = 0; i < 3; ++i) {
      INFO(names[i]);
      const auto got = checks[i].first.to(torch::kFloat64);
      CHECK(torch::isfinite(got).all().item<bool>());
      CHECK(((got - checks[i].second).abs() <= checks[i].second.abs() * rel + abs).all().item<bool>());
    }
  }
}

// The pairing itself (rotate_half's (i, i + rot/2), not interleaved) is checked against the
// independent forward at the end of this file; this one checks relative-position invariance.
TEST_CASE("RoPE scores depend only on relative positions, and the position input is used", "[model]") {
  // One attention head, identity-ish check: relative-position invariance. Shifting all positions of
  // a document by a constant leaves the logits unchanged (RoPE scores depend on differences only).
  torch::manual_seed(3);
  auto model = model_build(tiny_config());
  auto in = two_documents(12, 12);
  const auto base = model->forward(in.tokens, in.positions, in.segments).logits;
  const auto shifted = model->forward(in.tokens, in.positions + 7, in.segments).logits;
  CHECK(torch::allclose(base, shifted, 1e-4, 1e-4));
  // ... but reversing positions does change them (positions are really used).
  // (Compared with the shift's float noise: how far the logits move depends on the init's scale.)
  const auto reversed = model->forward(in.tokens, in.positions.flip({1}), in.segments).logits;
  const double noise = (base - shifted).abs().max().item<double>(), moved = (base - reversed).abs().max().item<double>();
  INFO("shift: " << noise << ", reversal: " << moved);
  CHECK(moved > 1e-5);
  CHECK(moved > 100 * noise);
}

TEST_CASE("rope_type=llama3: Llama 3.1's three frequency bands (hand-derived), wired into the model", "[model]") {
  // head_dim 8, theta 10000: f = 1, 0.1, 0.01, 0.001, wavelengths 2 pi / f = 6.28, 62.8, 628, 6283.
  // Original context 128, low 1, high 4: kept below 128 / 4 = 32, divided by 8 above 128 / 1, and
  // 62.8 blended with s = (128 / 62.83 - 1) / (4 - 1) = (2.03718 - 1) / 3.
  const std::vector<std::string> shape = {"override_model_config=true", "head_dim=8", "rope_max_timescale=10000",
                                          "original_max_position_embeddings=128", "rope_low_freq_factor=1",
                                          "rope_high_freq_factor=4"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), shape.begin(), shape.end());
    return tiny_config(extra);
  };
  const auto f = model_llama3_rope_inverse_frequencies(with({"rope_type=llama3", "rope_factor=8"}));
  REQUIRE(f.size() == 4);
  const double s = (128 * 0.1 / (2 * M_PI) - 1) / 3;
  CHECK(s == Approx(0.345727).epsilon(1e-5));
  CHECK(f[0] == Approx(1.0).epsilon(1e-12));
  CHECK(f[1] == Approx((1 - s) * 0.1 / 8 + s * 0.1).epsilon(1e-12));
  CHECK(f[2] == Approx(0.01 / 8).epsilon(1e-12));
  CHECK(f[3] == Approx(0.001 / 8).epsilon(1e-12));
  // Partial rotary: the bands are over the rotated dims (transformers' dim = head_dim x factor).
  CHECK(model_llama3_rope_inverse_frequencies(with({"rope_type=llama3", "rope_factor=8", "partial_rotary_factor=0.5"})).size() == 2);

  // In the model: factor 1 is the plain rotation (to fp32 rounding); factor 8 moves the logits.
  torch::manual_seed(5);
  const auto in = two_documents(24, 24);
  auto logits = [&](std::vector<std::string> extra) {
    auto model = model_build(with(std::move(extra)));
    return model->forward(in.tokens, in.positions * 5, in.segments).logits;
  };
  const auto plain = logits({}), unit = logits({"rope_type=llama3", "rope_factor=1"}),
             scaled = logits({"rope_type=llama3", "rope_factor=8"});
  const double same = (plain - unit).abs().max().item<double>(), moved = (plain - scaled).abs().max().item<double>();
  INFO("factor 1: " << same << ", factor 8: " << moved);
  CHECK(same < 1e-5);
  CHECK(moved > 1e-4);
  CHECK(moved > 100 * same);

  // What it cannot mean is refused by name.
  CHECK_THROWS_WITH(tiny_config({"rope_type=llama3", "rope_high_freq_factor=1"}),
                    Catch::Contains("rope_high_freq_factor must be > rope_low_freq_factor = 1.0 (got 1.0)"));
  // MaxText's names say what they are here.
  CHECK_THROWS_WITH(tiny_config({"rope_type=llama3.1"}), Catch::Contains("MaxText's llama3.1 is rope_type=llama3 with rope_factor=8"));
  CHECK_THROWS_WITH(tiny_config({"rope_use_scale=true"}), Catch::Contains("rope_type=llama3"));
  CHECK_THROWS_WITH(tiny_config({"rope_type=llama3", "rope_factor=0.5"}), Catch::Contains("rope_factor must be >= 1"));
  CHECK_THROWS_WITH(tiny_config({"model_name=ling2", "rope_type=llama3"}),
                    Catch::Contains("rope_type=llama3 scales the RoPE of global and GLA layers"));
}

TEST_CASE("rope_type=yarn on global attention: hand-derived frequencies, rope_attention_scaling is q . k times m^2",
          "[model]") {
  // head_dim 8, theta 10000: f = 1, 0.1, 0.01, 0.001. Original context 128, betas 32 / 1 (base.yml): the
  // correction dims c(r) = 8 ln(128 / (2 pi r)) / (2 ln 10000) are c(32) = -0.19612 and
  // c(1) = 1.30903. Floored / ceiled (rope_truncate): low 0, high 2, ramp i / 2; not: low 0
  // (clamped), high 1.30903, ramp i / 1.30903. Each f_i -> f_i (1 - ramp) + f_i / 8 ramp.
  const std::vector<std::string> shape = {"override_model_config=true", "head_dim=8", "rope_max_timescale=10000",
                                          "original_max_position_embeddings=128", "max_position_embeddings=1024"};
  auto with = [&](std::vector<std::string> extra) {
    extra.insert(extra.end(), shape.begin(), shape.end());
    return tiny_config(extra);
  };
  const auto blend = [](double f, double ramp) { return f * (1 - ramp) + f / 8 * ramp; };
  const auto truncated = model_yarn_rope_inverse_frequencies(with({"rope_type=yarn", "rope_factor=8"}), 8);
  REQUIRE(truncated.size() == 4);
  CHECK(truncated[0] == Approx(1.0).epsilon(1e-12));
  CHECK(truncated[1] == Approx(blend(0.1, 0.5)).epsilon(1e-12));
  CHECK(truncated[2] == Approx(0.01 / 8).epsilon(1e-12));
  CHECK(truncated[3] == Approx(0.001 / 8).epsilon(1e-12));
  const auto exact = model_yarn_rope_inverse_frequencies(with({"rope_type=yarn", "rope_factor=8", "rope_truncate=false"}), 8);
  CHECK(exact[0] == Approx(1.0).epsilon(1e-12));
  CHECK(exact[1] == Approx(blend(0.1, 1 / 1.3090301012897532)).epsilon(1e-12));
  CHECK(exact[2] == Approx(0.01 / 8).epsilon(1e-12));
  // Equal betas (Kimi K2's 1 and 1): low = floor(1.30903) = 1, high = 2, ramp i - 1.
  const auto equal = model_yarn_rope_inverse_frequencies(with({"rope_type=yarn", "rope_factor=8", "beta_fast=1"}), 8);
  CHECK(equal[1] == Approx(0.1).epsilon(1e-12));
  CHECK(equal[2] == Approx(0.01 / 8).epsilon(1e-12));

  torch::manual_seed(5);
  const auto in = two_documents(24, 24);
  auto logits = [&](std::vector<std::string> extra, double q_scale = 1.0) {
    auto model = model_build(with(std::move(extra)));
    if (q_scale != 1.0) {
      torch::NoGradGuard no_grad;
      for (auto& item : model->named_parameters())
        if (item.key().find("self_attn.q_proj.weight") != std::string::npos) item.value().mul_(q_scale);
    }
    return model->forward(in.tokens, in.positions * 5, in.segments).logits;
  };
  // The frequencies reach the model: factor 1 is the plain rotation, factor 8 moves the logits.
  const auto plain = logits({}), unit = logits({"rope_type=yarn", "rope_factor=1"}),
             stretched = logits({"rope_type=yarn", "rope_factor=8"});
  const double same = (plain - unit).abs().max().item<double>(), moved = (plain - stretched).abs().max().item<double>();
  INFO("factor 1: " << same << ", factor 8: " << moved);
  CHECK(same < 1e-5);
  CHECK(moved > 1e-4);
  // The attention factor m = 0.1 ln 8 + 1 on cos and sin of q and k is, with every dim rotated and
  // no q/k norm, the same as queries m^2 larger (a second path: the weights scaled instead).
  const double m = 0.1 * std::log(8.0) + 1.0;
  const auto scaled = logits({"rope_type=yarn", "rope_factor=8", "rope_attention_scaling=true"});
  const auto by_weights = logits({"rope_type=yarn", "rope_factor=8"}, m * m);
  const double agree = (scaled - by_weights).abs().max().item<double>(), effect = (scaled - stretched).abs().max().item<double>();
  INFO("scaled vs q weights x m^2: " << agree << ", scaling's effect: " << effect);
  CHECK(agree < 1e-5);
  CHECK(effect > 1e-4);
  CHECK(effect > 100 * agree);

  // What it cannot mean is refused by name.
  CHECK_THROWS_WITH(tiny_config({"rope_attention_scaling=true"}),
                    Catch::Contains("rope_attention_scaling=true scales YaRN's rotation (rope_type=yarn), and rope_type is default"));
  CHECK_THROWS_WITH(tiny_config({"rope_type=llama3", "rope_truncate=false"}),
                    Catch::Contains("rope_truncate=false changes YaRN's correction range (rope_type=yarn), and rope_type is llama3"));
  CHECK_THROWS_WITH(tiny_config({"rope_type=yarn", "beta_slow=0"}),
                    Catch::Contains("rope_type=yarn needs beta_fast >= beta_slow > 0 (got 32.0 and 0.0)"));
  CHECK_THROWS_WITH(tiny_config({"rope_type=yarn", "beta_fast=1", "beta_slow=2"}), Catch::Contains("(got 1.0 and 2.0)"));
  CHECK_THROWS_WITH(tiny_config({"rope_type=yarn", "rope_factor=0.5"}), Catch::Contains("rope_factor must be >= 1"));
  CHECK_THROWS_WITH(tiny_config({"model_name=ling2-tiny", "override_model_config=true", "attention_type=global", "rope_type=yarn"}),
                    Catch::Contains("rope_type=yarn scales the RoPE of global and MLA layers, and this model has GLA layers"));
  // MaxText's pairing flag says what covers it.
  CHECK_THROWS_WITH(tiny_config({"rope_interleave=false"}), Catch::Contains("'mla_interleaved_rope'"));
}

TEST_CASE("the same init_weights_seed gives the same weights, another seed does not", "[model]") {
  auto a = model_build(tiny_config()), b = model_build(tiny_config());
  auto c = model_build(tiny_config({"init_weights_seed=1"}));
  const auto pa = a->named_parameters(), pb = b->named_parameters(), pc = c->named_parameters();
  CHECK(torch::equal(pa["model.layers.0.mlp.up_proj.weight"], pb["model.layers.0.mlp.up_proj.weight"]));
  CHECK_FALSE(torch::equal(pa["model.layers.0.mlp.up_proj.weight"], pc["model.layers.0.mlp.up_proj.weight"]));
}

TEST_CASE("init: N(0, init_method_std^2), o_proj and down_proj at std / sqrt(2 layers) as Megatron's, norms 1", "[model]") {
  // Sample standard deviations of every weight with enough elements to pin them to 10%; the
  // output projections (attention, MLP, routed and shared experts) against std / sqrt(2 L).
  for (const std::string model : {"test-tiny", "ling2-tiny"})
    for (const bool scaled : {true, false}) {
      const Config c = tiny_config({"model_name=" + model, "init_method_std=0.05",
                                    std::string("init_output_layers_scaled=") + (scaled ? "true" : "false")});
      const double out_std = scaled ? 0.05 / std::sqrt(2.0 * static_cast<double>(c.base_num_decoder_layers)) : 0.05;
      auto m = model_build(c);
      int64_t outputs = 0, others = 0;
      for (const auto& item : m->named_parameters()) {
        const auto& name = item.key();
        const auto& w = item.value();
        INFO(model << " scaled=" << scaled << " " << name);
        if (name.find("norm") != std::string::npos) {
          CHECK(torch::all(w == 1).item<bool>());
          continue;
        }
        if (w.numel() < 2000) continue;
        const bool output = name.find("o_proj") != std::string::npos || name.find("down_proj") != std::string::npos;
        (output ? outputs : others) += 1;
        CHECK(w.std().item<double>() == Approx(output ? out_std : 0.05).epsilon(0.1));
        CHECK(std::abs(w.mean().item<double>()) < 0.1 * (output ? out_std : 0.05));
      }
      CHECK(outputs >= 2);
      CHECK(others >= 2);
    }
  CHECK_THROWS_WITH(tiny_config({"init_method_std=0"}), Catch::Contains("init_method_std must be"));
}

namespace {
// Resident set size of this process (bytes), from /proc/self/statm.
double resident_bytes() {
  std::ifstream statm("/proc/self/statm");
  double pages_total = 0, pages_resident = 0;
  statm >> pages_total >> pages_resident;
  return pages_resident * static_cast<double>(sysconf(_SC_PAGESIZE));
}

// The fraction of the pages holding these tensors' data that are resident (mincore): what the
// process touched of exactly those bytes, whatever else it freed or reused meanwhile.
double resident_fraction(const std::vector<torch::Tensor>& tensors) {
  const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  double pages = 0, resident = 0;
  for (const auto& t : tensors) {
    const auto first = reinterpret_cast<uintptr_t>(t.data_ptr()) / page * page;
    const auto end = reinterpret_cast<uintptr_t>(t.data_ptr()) + t.nbytes();
    std::vector<unsigned char> in_core((end - first + page - 1) / page);
    REQUIRE(mincore(reinterpret_cast<void*>(first), end - first, in_core.data()) == 0);
    pages += static_cast<double>(in_core.size());
    for (const unsigned char c : in_core) resident += c & 1;
  }
  return resident / pages;
}
}  // namespace

TEST_CASE("weights drawn unit by unit (optim_grads_params) equal model_build's, and an undrawn model touches no memory",
          "[model][sharding]") {
  SECTION("drawn in runs, one decoder layer (or other parameter) at a time") {
    for (const auto& [options, expert_rank] : std::vector<std::pair<std::vector<std::string>, int64_t>>{
             {{"model_name=ling-mini-tiny"}, 0},
             {{"model_name=ling-mini-tiny", "expert_parallelism=2"}, 1},
             {{"model_name=ling2-tiny"}, 0}}) {
      const Config c = tiny_config(options);
      INFO(options.back() << ", expert rank " << expert_rank);
      auto whole = model_build(c, expert_rank);
      auto undrawn = model_build(c, expert_rank, /*draw=*/false);
      // Runs split independently of sharding.h's units: by "model.layers.N." prefix, else one
      // parameter per run (a layer's stacked experts must share a run; nothing else must).
      std::vector<NamedTensors> runs;
      std::string previous;
      for (const auto& item : undrawn->named_parameters()) {
        const auto& name = item.key();
        const auto dot = name.find('.', std::string("model.layers.").size());
        const auto key = name.rfind("model.layers.", 0) == 0 ? name.substr(0, dot) : name;
        if (runs.empty() || key != previous) runs.emplace_back();
        runs.back().emplace_back(name, item.value());
        previous = key;
      }
      CHECK(runs.size() > c.base_num_decoder_layers);
      ModelInitializer initializer(c, expert_rank);
      for (const auto& run : runs) initializer.draw(run);
      const auto expected = whole->named_parameters();
      for (const auto& item : undrawn->named_parameters()) {
        INFO(item.key());
        CHECK(torch::equal(item.value(), expected[item.key()]));
      }
    }
  }
  SECTION("construction allocates but does not touch the weights; drawing does") {
    const Config c = tiny_config({"override_model_config=true", "base_num_decoder_layers=8", "base_emb_dim=512",
                                  "base_mlp_dim=8192"});
    const double before = resident_bytes();
    auto model = model_build(c, 0, /*draw=*/false);
    const double built = resident_bytes();
    double bytes = 0;
    for (const auto& p : model->parameters()) bytes += 4.0 * static_cast<double>(p.numel());
    REQUIRE(bytes > 300e6);
    // RSS here, not the weights' pages: after a Trainer kept freed heap memory in the same process,
    // construction may reuse resident pages without touching them.
    CHECK(built - before < 0.05 * bytes);
    ModelInitializer(c, 0).draw([&] {
      NamedTensors all;
      for (const auto& item : model->named_parameters()) all.emplace_back(item.key(), item.value());
      return all;
    }());
    // The weights' own pages, not the RSS: after other tests, drawing can reuse freed heap pages
    // and the allocator can return others, so the RSS grows by less than the weights' bytes.
    CHECK(resident_fraction(model->parameters()) > 0.99);
  }
}

namespace {
// An independent float64 forward of the Llama/Qwen3 decoder, written from Hugging Face's
// modeling code rather than from model.cpp: parameters looked up by their HF names, attention one
// head at a time with query head h reading kv head h / (Hq / Hkv) (HF repeat_kv), RoPE on explicit
// pairs (i, i + rot/2) of the first rot = partial_rotary_factor * hd dimensions (HF rotate_half;
// an interleaved (2i, 2i+1) RoPE would differ), inv_freq_i = theta^(-2i/rot), optional per-head
// QK RMSNorm before RoPE, and attention allowed only to earlier positions of the same segment.
torch::Tensor reference_logits(const Config& c, torch::OrderedDict<std::string, torch::Tensor> p,
                               const torch::Tensor& tokens, const torch::Tensor& positions, const torch::Tensor& segments) {
  const auto P = [&](const std::string& name) { return p[name].to(torch::kFloat64); };
  const double eps = c.normalization_layer_epsilon;
  const auto rms = [&](const torch::Tensor& x, const torch::Tensor& w) {
    return x / torch::sqrt(x.square().mean(-1, true) + eps) * w;
  };
  const int64_t B = tokens.size(0), L = tokens.size(1), Hq = c.base_num_query_heads, Hkv = c.base_num_kv_heads;
  const int64_t hd = c.head_dim, rot = std::llround(c.partial_rotary_factor * static_cast<double>(hd)), half = rot / 2;
  const auto rope = [&](const torch::Tensor& x) {  // x (B, L, hd) for one head
    auto out = x.clone();
    for (int64_t i = 0; i < half; ++i) {
      const double inv_freq = std::pow(c.rope_max_timescale, -2.0 * static_cast<double>(i) / static_cast<double>(rot));
      const auto angle = positions.to(torch::kFloat64) * inv_freq;  // (B, L)
      const auto a = x.select(-1, i), b = x.select(-1, i + half);
      out.select(-1, i).copy_(a * angle.cos() - b * angle.sin());
      out.select(-1, i + half).copy_(b * angle.cos() + a * angle.sin());
    }
    return out;
  };
  // allowed[b][i][j]: j <= i and the same segment.
  const auto allowed = (segments.unsqueeze(2) == segments.unsqueeze(1)) & torch::ones({L, L}, torch::kBool).tril();
  auto x = P("model.embed_tokens.weight").index_select(0, tokens.reshape({-1})).view({B, L, -1});
  for (int64_t layer = 0; layer < c.base_num_decoder_layers; ++layer) {
    const std::string pre = "model.layers." + std::to_string(layer) + ".";
    const auto normed = rms(x, P(pre + "input_layernorm.weight"));
    const auto q = torch::matmul(normed, P(pre + "self_attn.q_proj.weight").t()).view({B, L, Hq, hd});
    const auto k = torch::matmul(normed, P(pre + "self_attn.k_proj.weight").t()).view({B, L, Hkv, hd});
    const auto v = torch::matmul(normed, P(pre + "self_attn.v_proj.weight").t()).view({B, L, Hkv, hd});
    std::vector<torch::Tensor> heads;
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t g = h / (Hq / Hkv);
      auto qh = q.select(2, h), kh = k.select(2, g);  // (B, L, hd)
      if (c.use_qk_norm) {
        qh = rms(qh, P(pre + "self_attn.q_norm.weight"));
        kh = rms(kh, P(pre + "self_attn.k_norm.weight"));
      }
      auto scores = torch::matmul(rope(qh), rope(kh).transpose(1, 2)) / std::sqrt(static_cast<double>(hd));  // (B, L, L)
      scores = scores.masked_fill(allowed.logical_not(), -std::numeric_limits<double>::infinity());
      heads.push_back(torch::matmul(torch::softmax(scores, -1), v.select(2, g)));  // (B, L, hd)
    }
    x = x + torch::matmul(torch::cat(heads, -1), P(pre + "self_attn.o_proj.weight").t());
    const auto n2 = rms(x, P(pre + "post_attention_layernorm.weight"));
    const auto gate = torch::matmul(n2, P(pre + "mlp.gate_proj.weight").t());
    const auto up = torch::matmul(n2, P(pre + "mlp.up_proj.weight").t());
    x = x + torch::matmul(gate * torch::sigmoid(gate) * up, P(pre + "mlp.down_proj.weight").t());
  }
  const auto head = c.logits_via_embedding ? P("model.embed_tokens.weight") : P("lm_head.weight");
  return torch::matmul(rms(x, P("model.norm.weight")), head.t());
}
}  // namespace

TEST_CASE("logits equal an independent float64 forward (GQA, rotate_half RoPE, partial rotary, QK-norm, segments)",
          "[model][numerics]") {
  for (const std::vector<std::string> overrides :
       {std::vector<std::string>{"partial_rotary_factor=0.5", "use_qk_norm=true", "base_num_query_heads=8",
                                 "base_num_kv_heads=2", "override_model_config=true", "logits_via_embedding=false"},
        std::vector<std::string>{"override_model_config=true", "logits_via_embedding=true", "rope_max_timescale=100"}}) {
    const Config c = tiny_config(overrides);
    INFO("Hq " << c.base_num_query_heads << ", Hkv " << c.base_num_kv_heads << ", rotary " << c.partial_rotary_factor
               << ", qk-norm " << c.use_qk_norm << ", tied head " << c.logits_via_embedding);
    torch::manual_seed(11);
    auto model = model_build(c);
    {
      torch::NoGradGuard no_grad;  // norm weights away from 1, so a missing norm weight shows
      for (auto& item : model->named_parameters())
        if (item.key().find("norm") != std::string::npos) item.value().uniform_(0.5, 1.5);
    }
    model->to(torch::kFloat64);
    const auto in = two_documents(14, 6);
    torch::NoGradGuard no_grad;
    const auto ours = model->forward(in.tokens, in.positions, in.segments).logits;
    const auto reference = reference_logits(c, model->named_parameters(), in.tokens, in.positions, in.segments);
    // The model builds its RoPE tables in fp32 (as HF does), so angles carry ~6e-8 relative
    // rounding even in a float64 model; everything else is float64. 1e-6 of the logits' scale
    // leaves that and catches a wrong pairing or head mapping (measured: ~1e-1 of the scale).
    const double scale = reference.abs().max().item<double>(), difference = (ours - reference).abs().max().item<double>();
    INFO("max abs difference " << difference << ", logits scale " << scale);
    CHECK(difference <= 1e-6 * scale);
  }
}

namespace {
// ||a - b|| / ||b|| in float64.
double relative_error(const torch::Tensor& a, const torch::Tensor& b) {
  const auto b64 = b.to(torch::kFloat64);
  return ((a.to(torch::kFloat64) - b64).norm() / b64.norm()).item<double>();
}
// Puts compat's bf16 GEMM choice back to this CPU's own when a test that forced it ends.
struct Bf16GemmModeRestore {
  const int mode = compat::cpu_bf16_gemm_override().load();
  ~Bf16GemmModeRestore() { compat::cpu_bf16_gemm_via_fp32_set(mode); }
};
}  // namespace

// Every bf16 GEMM the model makes on a CPU, with compat's fp32 summation forced on, against
// float64 products of the same bf16-rounded operands. Each result is rounded to bf16 once (or a
// few times through attention's softmax), a relative error of a few 2^-9; summing the products in
// bf16, as LibTorch 1.13's CPU fallback does, is off by ~1% at inner size 64 and ~5% at 2048
// (each bound below failed with the choice forced off on an AVX2 machine under 1.13).
TEST_CASE("bf16 GEMMs on the CPU summed in fp32: linear, block attention, MoE experts against float64", "[model]") {
  Bf16GemmModeRestore restore;
  compat::cpu_bf16_gemm_via_fp32_set(1);
  REQUIRE(compat::cpu_bf16_gemm_via_fp32());
  const auto rounded = [](const torch::Tensor& t) { return t.to(torch::kBFloat16).to(torch::kFloat64); };
  torch::manual_seed(11);

  // Linear under CPU autocast: fp32 weight and input, bf16 output, fp32 gradients.
  const int64_t rows = 16, in = 2048, out = 2048;
  const auto x = torch::randn({rows, in}).requires_grad_();
  const auto weight = (torch::randn({out, in}) / std::sqrt(static_cast<double>(in))).requires_grad_();
  const auto dy = torch::randn({rows, out}).to(torch::kBFloat16);
  torch::Tensor y;
  {
    compat::AutocastGuard autocast(true, false);
    y = model_detail::linear_gemm(x, weight);
  }
  y.backward(dy);
  CHECK(y.scalar_type() == torch::kBFloat16);
  CHECK(x.grad().scalar_type() == torch::kFloat32);
  CHECK(weight.grad().scalar_type() == torch::kFloat32);
  const auto y_ref = rounded(x).mm(rounded(weight).t());  // (rows, out)
  const auto dx_ref = dy.to(torch::kFloat64).mm(rounded(weight));  // (rows, in): inner size out
  const auto dw_ref = dy.to(torch::kFloat64).t().mm(rounded(x));   // (out, in): inner size rows
  INFO("linear: y " << relative_error(y, y_ref) << ", dx " << relative_error(x.grad(), dx_ref) << ", dW "
                    << relative_error(weight.grad(), dw_ref));
  CHECK(relative_error(y, y_ref) < 4e-3);
  CHECK(relative_error(x.grad(), dx_ref) < 4e-3);
  CHECK(relative_error(weight.grad(), dw_ref) < 4e-3);
  // Rounded once: every element within one bf16 rounding (2^-8 relative) of the exact product, up
  // to fp32's summation error (far smaller here).
  CHECK(((y.to(torch::kFloat64) - y_ref).abs() <= y_ref.abs() * std::ldexp(1.0, -8) + 1e-5).all().item<bool>());

  // Block-causal attention in bf16 (the 1.13 kernel), 512 positions: the probabilities' product
  // with v sums up to 512 terms.
  const int64_t B = 1, Hq = 4, Hkv = 2, L = 512, hd = 32;
  const auto q = torch::randn({B, Hq, L, hd}).to(torch::kBFloat16).requires_grad_();
  const auto k = torch::randn({B, Hkv, L, hd}).to(torch::kBFloat16).requires_grad_();
  const auto v = torch::randn({B, Hkv, L, hd}).to(torch::kBFloat16).requires_grad_();
  const auto upstream = torch::randn({B, Hq, L, hd}).to(torch::kBFloat16);
  const auto attended = model_detail::block_causal_attention(q, k, v, torch::Tensor(), 64);
  const auto grads = torch::autograd::grad({attended}, {q, k, v}, {upstream});
  const auto q64 = q.detach().to(torch::kFloat64).requires_grad_(), k64 = k.detach().to(torch::kFloat64).requires_grad_(),
             v64 = v.detach().to(torch::kFloat64).requires_grad_();
  const auto causal = torch::ones({B, 1, L, L}, torch::kBool).tril();
  const auto attended_ref = per_head_attention(q64, k64, v64, causal);
  const auto grads_ref = torch::autograd::grad({attended_ref}, {q64, k64, v64}, {upstream.to(torch::kFloat64)});
  CHECK(attended.scalar_type() == torch::kBFloat16);
  INFO("attention: out " << relative_error(attended, attended_ref) << ", dq " << relative_error(grads[0], grads_ref[0])
                         << ", dk " << relative_error(grads[1], grads_ref[1]) << ", dv "
                         << relative_error(grads[2], grads_ref[2]));
  CHECK(relative_error(attended, attended_ref) < 6e-3);
  for (int i = 0; i < 3; ++i) CHECK(relative_error(grads[i], grads_ref[i]) < 1.2e-2);

  // Grouped MoE experts under autocast (GEMMs straight into the experts' buffers), width 1024.
  const int64_t E = 3, D = 1024, Fh = 256, M = 48;
  MoeExperts experts(E, D, Fh);
  draw_weights(*experts, 0.03);
  const std::vector<int64_t> sizes = {20, 0, 28};
  const auto xe = torch::randn({M, D}).requires_grad_();
  const auto dye = torch::randn({M, D});
  torch::Tensor ye;
  {
    compat::AutocastGuard autocast(true, false);
    ye = experts->forward(xe, sizes, /*grouped=*/true);
  }
  (ye.to(torch::kFloat32) * dye).sum().backward();
  // float64 reference, per expert, of the rounded inputs and weights (intermediates unrounded).
  const auto xe64 = rounded(xe.detach()).requires_grad_();
  const auto gu64 = rounded(experts->gate_up_proj.detach()).requires_grad_(), down64 = rounded(experts->down_proj.detach()).requires_grad_();
  std::vector<torch::Tensor> pieces;
  for (int64_t e = 0, first = 0; e < E; first += sizes[static_cast<size_t>(e)], ++e) {
    const auto xr = xe64.narrow(0, first, sizes[static_cast<size_t>(e)]);
    const auto gu = xr.mm(gu64[e].t()).split(Fh, 1);
    pieces.push_back((torch::silu(gu[0]) * gu[1]).mm(down64[e].t()));
  }
  const auto ye_ref = torch::cat(pieces);
  const auto experts_ref = torch::autograd::grad({ye_ref}, {xe64, gu64, down64}, {dye.to(torch::kFloat64)});
  INFO("experts: y " << relative_error(ye, ye_ref) << ", dx " << relative_error(xe.grad(), experts_ref[0])
                     << ", d gate_up " << relative_error(experts->gate_up_proj.grad(), experts_ref[1]) << ", d down "
                     << relative_error(experts->down_proj.grad(), experts_ref[2]));
  CHECK(relative_error(ye, ye_ref) < 8e-3);
  CHECK(relative_error(xe.grad(), experts_ref[0]) < 1.2e-2);
  CHECK(relative_error(experts->gate_up_proj.grad(), experts_ref[1]) < 1.2e-2);
  CHECK(relative_error(experts->down_proj.grad(), experts_ref[2]) < 1.2e-2);

  // The tiled LM head's cross-entropy in bf16: logits of inner size 2048, the hidden gradient of
  // inner size V = 512.
  const int64_t V = 512, width = 2048;
  const auto hidden = torch::randn({4, 16, width}).requires_grad_();
  const auto head = (torch::randn({V, width}) / std::sqrt(static_cast<double>(width))).requires_grad_();
  const auto targets = torch::randint(0, V, {4, 16}, torch::kInt64);
  const auto token_weights = torch::rand({4, 16});
  const auto ce = cross_entropy_sums_tiled(hidden, head, targets, token_weights, 0.0, 3, /*bf16_compute=*/true).ce;
  ce.backward();
  const auto hidden64 = rounded(hidden.detach()).requires_grad_(), head64 = rounded(head.detach()).requires_grad_();
  const auto logits64 = torch::matmul(hidden64, head64.t());  // (4, 16, V)
  const auto ce64 = ((torch::logsumexp(logits64, -1) - logits64.gather(-1, targets.unsqueeze(-1)).squeeze(-1)) *
                     token_weights.to(torch::kFloat64)).sum();
  const auto ce_grads = torch::autograd::grad({ce64}, {hidden64, head64});
  INFO("cross-entropy: ce " << relative_error(ce, ce64) << ", d hidden " << relative_error(hidden.grad(), ce_grads[0])
                            << ", d head " << relative_error(head.grad(), ce_grads[1]));
  CHECK(relative_error(ce, ce64) < 1e-3);
  CHECK(relative_error(hidden.grad(), ce_grads[0]) < 1.2e-2);
  CHECK(relative_error(head.grad(), ce_grads[1]) < 1.2e-2);
}
