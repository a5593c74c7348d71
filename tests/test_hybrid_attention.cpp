// The Ling2 hybrid's attention variants: GLA's chunked form against the token-by-token recurrence
// (forward and gradients, several chunk sizes, document resets, causality), MLA against the same
// attention computed naively per head from the expanded low-rank matrices with pairwise RoPE, the
// layer pattern, parameter counts, the ling2 FLOP formula against hand-derived numbers, and
// ling2-tiny in training: finite-difference gradients, GA invariance, bf16.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>

#include "test_numerics.h"
#include "test_support.h"
#include "trainer/config/hf_config.h"
#include "trainer/model/model.h"
#include "trainer/train/train.h"
#include "trainer/util/torch_compat.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

// The oracle: S_t = [same document as t-1] e^gamma S_{t-1} + k_t^T v_t,  o_t = q_t S_t / sqrt(dk),
// one token at a time (float64). q, k: (B, H, L, dk); v: (B, H, L, dv); segments (B, L) or undefined.
torch::Tensor gla_recurrent(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& gamma, const torch::Tensor& segments) {
  const auto B = q.size(0), H = q.size(1), L = q.size(2), dk = q.size(3), dv = v.size(3);
  auto state = torch::zeros({B, H, dk, dv}, q.options());
  const auto decay = torch::exp(gamma.to(q.options())).view({1, H, 1, 1});
  std::vector<torch::Tensor> out;
  for (int64_t t = 0; t < L; ++t) {
    auto carry = decay.expand({B, H, 1, 1});
    if (segments.defined() && t > 0)
      carry = carry * (segments.select(1, t) == segments.select(1, t - 1)).to(q.scalar_type()).view({B, 1, 1, 1});
    if (t == 0) carry = carry * 0;
    const auto kt = k.select(2, t).unsqueeze(-1), vt = v.select(2, t).unsqueeze(-2);  // (B, H, dk, 1), (B, H, 1, dv)
    state = carry * state + kt * vt;
    out.push_back(torch::matmul(q.select(2, t).unsqueeze(-2), state).squeeze(-2) / std::sqrt(static_cast<double>(dk)));
  }
  return torch::stack(out, 2);  // (B, H, L, dv)
}

struct GlaInputs {
  torch::Tensor q, k, v, gamma;
};

GlaInputs gla_inputs(int64_t B, int64_t H, int64_t L, int64_t dk, int64_t dv, uint64_t seed) {
  torch::manual_seed(seed);
  const auto opts = torch::TensorOptions().dtype(torch::kFloat64);
  GlaInputs in{torch::randn({B, H, L, dk}, opts), torch::randn({B, H, L, dk}, opts), torch::randn({B, H, L, dv}, opts),
               torch::tensor(std::vector<double>{-0.7, -0.3, -0.05}, opts).narrow(0, 0, H)};
  for (auto* t : {&in.q, &in.k, &in.v}) t->requires_grad_(true);
  return in;
}

// Documents of lengths 5, 9, 4, ... on row 0 and 11, 2, ... on row 1 (ids 1, 2, 3...).
torch::Tensor document_ids(int64_t B, int64_t L) {
  auto seg = torch::zeros({B, L}, torch::kInt64);
  const std::vector<std::vector<int64_t>> lengths = {{5, 9, 4, 3, 30}, {11, 2, 13, 40}};
  for (int64_t b = 0; b < B; ++b) {
    int64_t t = 0, id = 1;
    for (const int64_t n : lengths[static_cast<size_t>(b % 2)])
      for (int64_t i = 0; i < n && t < L; ++i) seg[b][t++] = id, id += (i == n - 1);
  }
  return seg;
}

}  // namespace

TEST_CASE("GLA chunked form equals the token-by-token recurrence, forward and gradients", "[model][hybrid]") {
  const int64_t B = 2, H = 3, L = 21, dk = 4, dv = 5;
  for (const bool documents : {false, true}) {
    const auto seg = documents ? document_ids(B, L) : torch::Tensor();
    auto in = gla_inputs(B, H, L, dk, dv, 11);
    const auto want = gla_recurrent(in.q, in.k, in.v, in.gamma, seg);
    const auto upstream = torch::randn_like(want);
    const auto want_grads = torch::autograd::grad({want}, {in.q, in.k, in.v}, {upstream});
    for (const int64_t chunk : {1, 4, 7, 8, 21, 64}) {  // 21 % 4 != 0, one chunk, chunk > L
      INFO("documents " << documents << ", chunk " << chunk);
      const auto got = model_gla_attention_chunked(in.q, in.k, in.v, in.gamma, seg, chunk);
      CHECK(got.scalar_type() == torch::kFloat64);
      CHECK((got - want).abs().max().item<double>() < 1e-10);
      const auto grads = torch::autograd::grad({got}, {in.q, in.k, in.v}, {upstream});
      for (int i = 0; i < 3; ++i) CHECK((grads[i] - want_grads[i]).abs().max().item<double>() < 1e-10);
    }
  }
  // In fp32 (the trainer's compute) the two agree to 1e-5 as the issue asks.
  auto in = gla_inputs(B, H, L, dk, dv, 12);
  const auto want = gla_recurrent(in.q, in.k, in.v, in.gamma, {});
  const auto got = model_gla_attention_chunked(in.q.to(torch::kFloat32), in.k.to(torch::kFloat32), in.v.to(torch::kFloat32),
                                         in.gamma.to(torch::kFloat32), {}, 8);
  CHECK(got.scalar_type() == torch::kFloat32);
  CHECK((got.to(torch::kFloat64) - want).abs().max().item<double>() < 1e-5);
}

TEST_CASE("GLA: an output never depends on a later token, nor on another document", "[model][hybrid]") {
  const int64_t B = 2, H = 2, L = 19, d = 4;
  const auto seg = document_ids(B, L);
  auto in = gla_inputs(B, H, L, d, d, 13);
  torch::NoGradGuard no_grad;
  const auto base = model_gla_attention_chunked(in.q, in.k, in.v, in.gamma, seg, 4);
  for (const int64_t t : {0, 6, 13, 18}) {
    auto k2 = in.k.clone(), v2 = in.v.clone();
    k2.select(2, t).add_(1.0);
    v2.select(2, t).add_(1.0);
    const auto changed = model_gla_attention_chunked(in.q, k2, v2, in.gamma, seg, 4);
    const auto moved = (changed - base).abs().amax({1, 3});  // (B, L): which outputs moved
    for (int64_t b = 0; b < B; ++b)
      for (int64_t s = 0; s < L; ++s) {
        const bool may = s >= t && seg[b][s].item<int64_t>() == seg[b][t].item<int64_t>();
        INFO("row " << b << ", token " << t << " changed, output " << s);
        CHECK((moved[b][s].item<double>() > 1e-12) == may);
      }
  }
  // Without document ids the state flows across the boundary (what the fork does): the same
  // change at token 6 then moves outputs of row 0's next document too.
  auto k2 = in.k.clone();
  k2.select(2, 6).add_(1.0);
  const auto unsegmented = model_gla_attention_chunked(in.q, in.k, in.v, in.gamma, {}, 4);
  const auto moved = (model_gla_attention_chunked(in.q, k2, in.v, in.gamma, {}, 4) - unsegmented).abs().amax({1, 3});
  CHECK(moved[0][15].item<double>() > 1e-12);
}

TEST_CASE("GLA head slopes are ALiBi's, and a layer's decay follows its depth", "[model][hybrid]") {
  const auto s16 = model_gla_head_slopes(16);
  REQUIRE(s16.size() == 16);
  for (int h = 0; h < 16; ++h) CHECK(s16[h] == Approx(std::pow(2.0, -(h + 1) / 2.0)).epsilon(1e-12));
  // 6 heads: the 4 of a power of two, then every other slope of 8 heads (2^-1, 2^-3).
  const auto s6 = model_gla_head_slopes(6);
  const std::vector<double> want6 = {0.25, 0.0625, 0.015625, 0.00390625, 0.5, 0.125};
  REQUIRE(s6.size() == 6);
  for (int h = 0; h < 6; ++h) CHECK(s6[h] == Approx(want6[h]).epsilon(1e-12));
  // ling2-tiny: 5 decoder layers, so layer 2's scale is 1 - 2/4 + 1e-5.
  const Config c = tiny_config({"model_name=ling2-tiny"});
  GlaAttention layer2(c, 2);
  const auto gamma = layer2->decay(torch::kCPU);
  const auto slopes = model_gla_head_slopes(c.base_num_query_heads);
  for (int h = 0; h < c.base_num_query_heads; ++h)
    CHECK(gamma[h].item<double>() == Approx(-slopes[h] * (0.5 + 1e-5)).epsilon(1e-6));
}

TEST_CASE("MLA equals attention computed per head from the expanded low-rank matrices, with pairwise RoPE",
          "[model][hybrid]") {
  for (const std::string variant : {"lora", "full-rank q", "half-split rope", "mscale"}) {
    INFO(variant);
    std::vector<std::string> overrides = {"model_name=ling2-tiny", "override_model_config=true"};
    if (variant == "full-rank q") overrides.push_back("q_lora_rank=0");
    if (variant == "half-split rope") overrides.push_back("mla_interleaved_rope=false");
    if (variant == "mscale") overrides.insert(overrides.end(), {"max_position_embeddings=65536", "mscale=0.7"});
    const Config c = tiny_config(overrides);
    torch::manual_seed(21);
    MlaAttention mla(c);
    mla->to(torch::kFloat64);
    {
      torch::NoGradGuard no_grad;
      for (auto& p : mla->parameters()) p.normal_(0.0, 0.3);
    }
    const int64_t B = 2, L = 9, D = c.base_emb_dim, H = c.base_num_query_heads;
    const int64_t nope = c.qk_nope_head_dim, rope = c.qk_rope_head_dim, vd = c.v_head_dim;
    const auto x = torch::randn({B, L, D}, torch::kFloat64);
    auto positions = torch::arange(L, torch::kInt64).repeat({B, 1});
    positions[1] = torch::arange(L, torch::kInt64) + 5;
    auto segments = torch::ones({B, L}, torch::kInt64);
    segments[1].narrow(0, 4, L - 4).fill_(2);
    // The stack's context gives the MLA tables and the mask.
    DecoderStack stack(c);
    const auto ctx = stack->context(positions, segments, /*one_segment_per_row=*/false);
    const auto got = mla->forward(x, ctx.rope_mla, ctx.allowed);

    // Naive: expand W_q = W_qb diag-free of the norm (the norm sits between, so apply it on the latent),
    // then per head and per pair of positions.
    auto rms = [](const torch::Tensor& t, const torch::Tensor& w) {
      return t * torch::rsqrt(t.pow(2).mean(-1, true) + 1e-6) * w;
    };
    torch::Tensor q_all;  // (B, L, H*(nope+rope))
    if (c.q_lora_rank > 0)
      q_all = torch::matmul(rms(torch::matmul(x, mla->q_a_proj->weight.t()), mla->q_a_layernorm->weight), mla->q_b_proj->weight.t());
    else
      q_all = torch::matmul(x, mla->q_proj->weight.t());
    const auto kv_a = torch::matmul(x, mla->kv_a_proj_with_mqa->weight.t());
    const auto latent = rms(kv_a.narrow(-1, 0, c.kv_lora_rank), mla->kv_a_layernorm->weight);  // (B, L, r)
    const auto k_pe = kv_a.narrow(-1, c.kv_lora_rank, rope);                                   // (B, L, rope)
    const auto Wkvb = mla->kv_b_proj->weight.view({H, nope + vd, c.kv_lora_rank});
    auto rotate = [&](torch::Tensor t, int64_t b, int64_t i) {  // t: (rope) at position positions[b][i]
      auto out = t.clone();
      const double pos = static_cast<double>(positions[b][i].item<int64_t>());
      for (int64_t p = 0; p < rope / 2; ++p) {
        const double angle = pos * std::pow(c.rope_max_timescale, -2.0 * p / static_cast<double>(rope));
        const int64_t a = c.mla_interleaved_rope ? 2 * p : p, z = c.mla_interleaved_rope ? 2 * p + 1 : p + rope / 2;
        const double xa = t[a].item<double>(), xz = t[z].item<double>();
        out[a] = xa * std::cos(angle) - xz * std::sin(angle);
        out[z] = xz * std::cos(angle) + xa * std::sin(angle);
      }
      return out;
    };
    double scale = 1.0 / std::sqrt(static_cast<double>(nope + rope));
    if (variant == "mscale") scale *= std::pow(0.1 * 0.7 * std::log(c.rope_factor) + 1.0, 2);
    auto heads = torch::zeros({B, L, H, vd}, torch::kFloat64);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h) {
        const auto Wk = Wkvb[h].narrow(0, 0, nope), Wv = Wkvb[h].narrow(0, nope, vd);  // (nope, r), (vd, r)
        for (int64_t i = 0; i < L; ++i) {
          const auto q = q_all[b][i].view({H, nope + rope})[h];
          const auto q_rot = rotate(q.narrow(0, nope, rope), b, i);
          std::vector<double> scores;
          std::vector<int64_t> keys;
          for (int64_t j = 0; j <= i; ++j) {
            if (segments[b][j].item<int64_t>() != segments[b][i].item<int64_t>()) continue;
            const auto k_nope = torch::matmul(Wk, latent[b][j]);
            const double s = torch::dot(q.narrow(0, 0, nope), k_nope).item<double>() +
                             torch::dot(q_rot, rotate(k_pe[b][j], b, j)).item<double>();
            scores.push_back(s * scale), keys.push_back(j);
          }
          const double top = *std::max_element(scores.begin(), scores.end());
          double total = 0;
          for (double& s : scores) total += (s = std::exp(s - top));
          for (size_t n = 0; n < keys.size(); ++n) heads[b][i][h] += scores[n] / total * torch::matmul(Wv, latent[b][keys[n]]);
        }
      }
    const auto want = torch::matmul(heads.view({B, L, H * vd}), mla->o_proj->weight.t());
    // 1e-6, not float64's 1e-12: the trainer's RoPE tables are fp32 (angles rounded to ~1e-7).
    CHECK((got - want).abs().max().item<double>() < 1e-6);
    CHECK(want.abs().max().item<double>() > 1.0);
  }
}

TEST_CASE("MLA's narrower value heads are zero-padded where that turns the math path into a fused kernel",
          "[model][hybrid]") {
  // q/k head dim 24, v 16 (ling2-tiny's). On LibTorch 2.x the CPU dispatcher runs flash attention
  // only for equal head dims, else the math path with its (B, H, L, L) probabilities (MLA layers
  // kept 3.5 GB where the plan said 1.9). The padded call, narrowed, must equal the unpadded one.
  torch::manual_seed(3);
  const auto q = torch::randn({2, 3, 40, 24}, torch::kFloat64), k = torch::randn({2, 3, 40, 24}, torch::kFloat64);
  const auto v = torch::randn({2, 3, 40, 16}, torch::kFloat64);
  for (const bool masked : {false, true}) {
    INFO("segment mask: " << masked);
    torch::Tensor allowed;  // (B, 1, L, L): two documents per row, causal within each
    if (masked) {
      const auto position = torch::arange(40), segment = (position >= 17).to(torch::kInt64);
      allowed = (segment.view({40, 1}) == segment.view({1, 40})).logical_and(position.view({40, 1}) >= position.view({1, 40}));
      allowed = allowed.view({1, 1, 40, 40}).expand({2, 1, 40, 40}).contiguous();
    }
    const auto q32 = q.to(torch::kFloat32), k32 = k.to(torch::kFloat32), v32 = v.to(torch::kFloat32);
    const bool pads = compat::attention_pads_value(q32, k32, v32, allowed);
    if (!compat::kFusedCausalAttention) {
      CHECK_FALSE(pads);  // 1.13: the model's block-causal kernel takes any value width
      continue;
    }
    CHECK(pads);
    CHECK_FALSE(compat::attention_pads_value(q32, k32, torch::randn({2, 3, 40, 24}), allowed));  // equal widths
    const auto padded = compat::masked_attention(q32, k32, torch::nn::functional::pad(v32, torch::nn::functional::PadFuncOptions({0, 8})), allowed);
    CHECK(padded.narrow(-1, 16, 8).abs().max().item<double>() == 0.0);
    // The reference: the explicit softmax in float64.
    auto scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(24.0);
    const auto keep = masked ? allowed : torch::ones({40, 40}, torch::kBool).tril();
    scores = scores.masked_fill(keep.logical_not(), -std::numeric_limits<double>::infinity());
    const auto reference = torch::matmul(torch::softmax(scores, -1), v);
    CHECK((padded.narrow(-1, 0, 16).to(torch::kFloat64) - reference).abs().max().item<double>() < 1e-5);
  }
}

TEST_CASE("the start-up log names the MLA layers' attention kernel and the value padding", "[model][hybrid][cli]") {
  const auto r = run_trainer("model_name=ling2-tiny steps=1 enable_checkpointing=false base_output_directory=" + test_root() +
                             "/mla-kernel run_name=log");
  INFO(r.output);
  REQUIRE(r.exit_code == 0);
  if (compat::kFusedCausalAttention)
    CHECK_THAT(r.output, Catch::Contains("MLA attention: flash kernel for plain causal rows (q/k head dim 24, v 16, v "
                                         "zero-padded to 24: flash takes equal head dims)"));
  else
    CHECK_THAT(r.output, Catch::Contains("MLA attention: block-causal kernel, query blocks of 64 positions (q/k head dim 24, v 16)"));
}

TEST_CASE("the layer pattern: every 5th layer and the MTP layer use attention_type, the rest GLA", "[model][hybrid]") {
  const Config ling2 = config_load(source_path("configs/base.yml"), {"model_name=ling2"}, {});
  std::string pattern;
  for (int64_t i = 0; i < ling2.base_num_decoder_layers + ling2.mtp_num_layers; ++i)
    pattern += model_layer_attention(ling2, i) == "mla" ? 'M' : model_layer_attention(ling2, i) == "gla" ? 'G' : '?';
  CHECK(pattern == "GGGGMGGGGMGGGGMGGGGM" "M");
  auto model = model_build(tiny_config({"model_name=ling2-tiny"}));
  const auto params = model->named_parameters();
  CHECK(params.contains("model.layers.0.self_attn.g_proj.weight"));
  CHECK(params.contains("model.layers.0.self_attn.g_norm.weight"));
  CHECK(params.contains("model.layers.0.mlp.down_proj.weight"));  // dense first layer
  CHECK(params.contains("model.layers.4.self_attn.kv_b_proj.weight"));
  CHECK(params.contains("model.layers.5.self_attn.q_a_layernorm.weight"));  // MTP: MLA
  CHECK(params.contains("model.layers.4.mlp.shared_experts.up_proj.weight"));
  CHECK(params["model.layers.4.mlp.shared_experts.up_proj.weight"].size(0) == 48);  // moe_shared_expert_dim
  CHECK_FALSE(params.contains("model.layers.3.self_attn.kv_b_proj.weight"));
  // GLA needs as many key/value heads as query heads; GLA in MTP layers is refused.
  CHECK_THROWS_WITH(tiny_config({"model_name=ling2-tiny", "override_model_config=true", "base_num_kv_heads=2"}),
                    Catch::Contains("GLA layers need base_num_kv_heads"));
  CHECK_THROWS_WITH(tiny_config({"model_name=ling2-tiny", "override_model_config=true", "attention_type=gla",
                                 "inhomogeneous_layer_cycle_interval=0"}),
                    Catch::Contains("MTP layers use full attention"));
  CHECK_THROWS_WITH(tiny_config({"model_name=ling2-tiny", "override_model_config=true", "group_norm_size=3"}),
                    Catch::Contains("group_norm_size (3)"));
  CHECK_THROWS_WITH(tiny_config({"model_name=ling2-tiny", "override_model_config=true", "inhomogeneous_layer_cycle_interval=1",
                                 "base_num_kv_heads=2"}),
                    Catch::Contains("MLA layers give every query head its own key and value"));
  CHECK_THROWS_WITH(tiny_config({"model_name=ling2-tiny", "override_model_config=true", "attention_type=gla",
                                 "inhomogeneous_layer_cycle_interval=0", "mtp_num_layers=0", "rope_type=yarn"}),
                    Catch::Contains("this model has GLA layers (attention_type=gla"));
  // No Hugging Face architecture holds MLA/GLA layers: --export-hf refuses, naming the key.
  CHECK_THROWS_WITH(hf_architecture(tiny_config({"model_name=ling2-tiny"})),
                    Catch::Contains("attention_type=mla") && Catch::Contains("--export-safetensors"));
}

TEST_CASE("ling2 parameter count and FLOPs match numbers derived by hand from the fork's formulas", "[model][hybrid]") {
  for (const std::string model : {"ling2-tiny", "ling2"}) {
    INFO(model);
    const Config c = tiny_config({"model_name=" + model, "max_target_length=4096", "per_device_batch_size=1"});
    const auto size = model_size(c);
    if (model == "ling2-tiny") {  // the built model's tensors, counted
      auto built = model_build(c);
      int64_t numel = 0;
      for (const auto& p : built->parameters()) numel += p.numel();
      CHECK(numel == size.total_params);
      continue;
    }
    // ling2 by hand (D 2048, H 16, hd 128, V 157184, 20 layers: 16 GLA + 4 MLA, 1 dense + 19 MoE, 1 MTP).
    const double D = 2048, V = 157184;
    const double gla = 5 * D * 2048 + 2 * 128 + 2048;                                        // q k v g o, q/k norm, g_norm
    const double mla = D * 256 + 256 + 256 * 16 * 192 + D * 576 + 512 + 512 * 16 * 256 + 16 * 128 * D;
    const double moe = 256 * D + 256 * 3 * D * 512 + 3 * D * 2048;                           // router, experts, shared
    const double layer_norms = 2 * D;
    const double decoder = 16 * gla + 4 * mla + 20 * layer_norms + 3 * D * 5120 + 19 * moe;
    const double mtp = 2 * D + 2 * D * D + mla + layer_norms + moe + D;                      // e/hnorm, eh_proj, block, head norm
    CHECK(static_cast<double>(size.total_params) == 2 * V * D + decoder + D + mtp);
    // FLOPs per step (T = 4096 tokens): the fork's calculate_tflops_training_per_device, ling2 branch.
    const double T = 4096, L = 4096;
    const double ffn_moe = 2 * T * D * 256 + 2 * T * 2048 * D * 3 + 8 * 2 * T * 512 * D * 3;
    const double ffn = 2 * T * 5120 * D * 3 + 19 * ffn_moe;
    const double mla_w = 2 * T * (D * 256 + 256 * 16 * 192) + 2 * T * (D * 576 + 512 * 16 * 256) + 2 * T * D * 16 * 128;
    const double mla_attn = 2 * T * L * 16 * (192 + 128) / 2;
    const double gla_w = 2 * T * D * 48 * 128 + 2 * T * 16 * 128 * D + 2 * T * D * 16 * 128;
    const double gla_attn = 2 * T * 16 * 64 * 256 + 4 * T * 16 * 128 * 128;
    const double embed = 2 * T * D * V;
    const double weights = ffn + embed + 4 * mla_w + 16 * gla_w + (mla_w + ffn_moe + 2 * T * 2 * D * D + embed);
    const double attention = 4 * mla_attn + 16 * gla_attn + mla_attn;
    CHECK(size.learnable_weight_flops == Approx(3 * weights).epsilon(1e-12));
    CHECK(size.attention_flops == Approx(3 * attention).epsilon(1e-12));
  }
}

namespace {

std::vector<std::string> ling2_tiny(std::vector<std::string> extra = {}) {
  std::vector<std::string> o = {"model_name=ling2-tiny", "override_model_config=true", "synthetic_min_valid_fraction=0.3",
                                "warmup_steps_fraction=0", "learning_rate=0.01", "steps=3", "max_target_length=20"};
  o.insert(o.end(), extra.begin(), extra.end());
  return o;
}

}  // namespace

TEST_CASE("ling2-tiny gradients of GLA, MLA and the shared expert equal finite differences of the objective",
          "[model][hybrid][training]") {
  // lm_loss only (no aux terms): J = sum CE / W over 2 micro-batches, recomputed in float64 from the
  // model's logits. Padding makes a row two segments, so GLA runs its document-reset path.
  Trainer t(tiny_config(ling2_tiny({"mtp_loss_scaling_factor=0", "router_z_loss_weight=0", "gradient_accumulation_steps=2",
                                    "per_device_batch_size=2"})));
  t.forward_backward(0);
  bool padded = false;  // the reset path runs only where a row holds padding (segment 0)
  for (int64_t m = 0; m < 2; ++m)
    for (const int64_t id : t.data().data_loader_next(0, m).segment_ids) padded = padded || id == 0;
  REQUIRE(padded);
  auto model64 = float64_copy(t);
  auto objective = [&] {
    torch::NoGradGuard no_grad;
    double ce = 0, W = 0;
    for (int64_t m = 0; m < 2; ++m) {
      const MicroBatch b = t.data().data_loader_next(0, m);
      const auto logits = model64->forward(micro_batch_tensor(b.inputs, b), micro_batch_tensor(b.positions, b),
                                           micro_batch_tensor(b.segment_ids, b)).logits;
      const auto terms = masked_cross_entropy(logits, b);
      ce += terms.sum, W += terms.count;
    }
    return ce / W;
  };
  auto params64 = checkpoint_tensors(model64);
  auto grads32 = checkpoint_tensors(t.model(), /*gradients=*/true);
  for (const std::string name : {"model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                                 "model.layers.2.self_attn.v_proj.weight", "model.layers.3.self_attn.g_proj.weight",
                                 "model.layers.1.self_attn.g_norm.weight", "model.layers.0.self_attn.q_norm.weight",
                                 "model.layers.4.self_attn.q_a_proj.weight", "model.layers.4.self_attn.q_b_proj.weight",
                                 "model.layers.4.self_attn.kv_a_proj_with_mqa.weight", "model.layers.4.self_attn.kv_b_proj.weight",
                                 "model.layers.4.self_attn.kv_a_layernorm.weight", "model.layers.4.self_attn.o_proj.weight",
                                 "model.layers.2.mlp.shared_experts.down_proj.weight"}) {
    for (int64_t index : {1, 7}) {
      const double numeric = central_difference(params64.at(name), index, objective);
      const double analytic = grads32.at(name).reshape(-1)[index].item<double>();
      INFO(name << "[" << index << "] numeric " << numeric << " analytic " << analytic);
      CHECK(analytic == Approx(numeric).epsilon(5e-3).margin(2e-7));
    }
  }
}

TEST_CASE("ling2-tiny: per-token lm_loss and gradients at (K=4, b=1) equal (K=1, b=4), and K=1 modes agree",
          "[model][hybrid][training]") {
  // Without the per-micro-batch aux terms (MTP, router z-loss) the objective is a sum over tokens:
  // accumulation changes nothing. Uneven data: the micro-batches hold different token counts.
  const auto opts = [](const std::string& K, const std::string& b, const std::string& per_token) {
    return tiny_config(ling2_tiny({"mtp_loss_scaling_factor=0", "router_z_loss_weight=0", "adam_eps=1e-5",
                                   "gradient_accumulation_steps=" + K, "per_device_batch_size=" + b,
                                   "calculate_per_token_loss=" + per_token}));
  };
  Trainer k4(opts("4", "1", "true")), k1(opts("1", "4", "true"));
  const auto a = k4.forward_backward(0), b = k1.forward_backward(0);
  CHECK(a.sample_indices == b.sample_indices);
  const auto lm = [](Trainer& t, const StepOutput& o) { return metric_get(t.read_metrics(o), "learning/lm_loss"); };
  CHECK(lm(k4, a) == Approx(lm(k1, b)).epsilon(1e-6));
  // Float rounding only (sums in another order at another batch shape): with Megatron's init
  // (o_proj and down_proj at 0.02 / sqrt(2 L)) measured 1.08e-5 under LibTorch 2.6's attention; a
  // wrong accumulation would be orders of magnitude off.
  const auto relative = [](const torch::Tensor& x, const torch::Tensor& y) { return ((x - y).norm() / y.norm()).item<double>(); };
  INFO("K=4 against K=1 gradients, relative: " << relative(k4.flat_grads(), k1.flat_grads()));
  CHECK(relative(k4.flat_grads(), k1.flat_grads()) < 3e-5);
  CHECK(k4.flat_grads().abs().max().item<double>() > 1e-3);
  Trainer megatron(opts("1", "4", "false"));
  const auto c = megatron.forward_backward(0);
  CHECK(lm(megatron, c) == Approx(lm(k1, b)).epsilon(1e-6));
  CHECK(relative(megatron.flat_grads(), k1.flat_grads()) < 3e-5);
  // And Megatron mode at K=4 differs (a mean of per-micro-batch means over uneven micro-batches).
  Trainer megatron4(opts("4", "1", "false"));
  const auto d = megatron4.forward_backward(0);
  CHECK(std::abs(lm(megatron4, d) - lm(k4, a)) > 1e-4);
}

TEST_CASE("ling2-tiny under bf16 autocast: the GLA state stays fp32, the loss is close to fp32", "[model][hybrid][training]") {
  Trainer fp32(tiny_config(ling2_tiny({"per_device_batch_size=2"}))), bf16(tiny_config(ling2_tiny({"per_device_batch_size=2", "dtype=bfloat16"})));
  const auto a = fp32.forward_backward(0), b = bf16.forward_backward(0);
  const double la = metric_get(fp32.read_metrics(a), "learning/lm_loss"), lb = metric_get(bf16.read_metrics(b), "learning/lm_loss");
  INFO("fp32 " << la << " bf16 " << lb);
  CHECK(std::isfinite(lb));
  CHECK(std::abs(la - lb) < 2e-2);
  CHECK(std::abs(la - lb) > 0);  // bf16 really ran
  // The chunked core under autocast computes and returns fp32.
  torch::manual_seed(5);
  const auto q = torch::randn({1, 2, 12, 4}).to(torch::kBFloat16);
  compat::AutocastGuard autocast(true, false);
  const auto o = model_gla_attention_chunked(q, q, q, torch::tensor({-0.5f, -0.1f}), {}, 4);
  CHECK(o.scalar_type() == torch::kFloat32);
}

TEST_CASE("YaRN frequencies for MLA: kept above the fast boundary, divided by rope_factor below the slow one",
          "[model][hybrid]") {
  // Ling2's numbers (rope dims 64, theta 10000, factor 32, original context 4096, beta 32 / 1):
  // the correction dims are 64 ln(4096 / (2 pi 32)) / (2 ln 10000) = 10.47 and
  // 64 ln(4096 / (2 pi)) / (2 ln 10000) = 22.51, so low = 10 and high = 23 (MaxText's values).
  const Config yarn = tiny_config({"model_name=ling2", "override_model_config=true", "rope_type=yarn"});
  const Config plain = tiny_config({"model_name=ling2"});
  const auto f = model_mla_rope_inverse_frequencies(yarn), base = model_mla_rope_inverse_frequencies(plain);
  REQUIRE(f.size() == 32);
  for (int i = 0; i < 32; ++i) {
    INFO("dim pair " << i);
    CHECK(base[i] == Approx(std::pow(10000.0, -2.0 * i / 64)).epsilon(1e-12));
    const double ramp = std::clamp((i - 10.0) / 13.0, 0.0, 1.0);  // 0 below low, 1 above high
    CHECK(f[i] == Approx(base[i] * (1 - ramp) + base[i] / 32 * ramp).epsilon(1e-12));
  }
  CHECK(f[5] == base[5]);
  CHECK(f[31] == Approx(base[31] / 32).epsilon(1e-12));
  // The softmax mscale: on only when the context is extended past the original.
  CHECK(MlaAttention(plain)->softmax_scale == Approx(1.0 / std::sqrt(192.0)).epsilon(1e-12));
  const Config extended = tiny_config({"model_name=ling2", "override_model_config=true", "max_position_embeddings=131072"});
  const double m = 0.1 * std::log(32.0) + 1.0;
  CHECK(MlaAttention(extended)->softmax_scale == Approx(m * m / std::sqrt(192.0)).epsilon(1e-12));
}

TEST_CASE("gla_reset_at_documents=false lets the GLA state run across packed documents, as the fork", "[model][hybrid]") {
  const int64_t B = 2, L = 19;
  const auto seg = document_ids(B, L);
  auto positions = torch::arange(L, torch::kInt64).repeat({B, 1});
  torch::manual_seed(17);
  const auto x = torch::randn({B, L, 64});
  for (const bool reset : {true, false}) {
    INFO("gla_reset_at_documents=" << reset);
    const Config c = tiny_config({"model_name=ling2-tiny", "override_model_config=true",
                                  std::string("gla_reset_at_documents=") + (reset ? "true" : "false")});
    torch::manual_seed(3);
    GlaAttention gla(c, 1);
    draw_weights(*gla, 0.3);
    DecoderStack stack(c);
    torch::NoGradGuard no_grad;
    const auto ctx = stack->context(positions, seg, /*one_segment_per_row=*/false);
    const auto with_documents = gla->forward(x, ctx.rope, seg);
    const auto one_document = gla->forward(x, ctx.rope, torch::Tensor());
    CHECK(torch::allclose(with_documents, one_document, 1e-6, 1e-6) == !reset);
  }
}
