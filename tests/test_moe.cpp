// MoE, MTP and aux-loss compensation (RFC changes 2 and 4), checked against hand computations
// and independent recomputation in this file.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
#include <numeric>
#include <set>

#include "test_numerics.h"
#include "test_support.h"
#include "trainer/train/train.h"
#include "trainer/util/torch_compat.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

std::vector<std::string> moe_opts(std::vector<std::string> extra = {}) {
  std::vector<std::string> o = {"model_name=moe-tiny", "override_model_config=true", "synthetic_min_valid_fraction=0.2",
                                "warmup_steps_fraction=0", "learning_rate=0.01", "steps=3"};
  o.insert(o.end(), extra.begin(), extra.end());
  return o;
}

double metric(Trainer& t, const StepOutput& out, const std::string& name) {
  return metric_get(t.read_metrics(out), name);
}

double relative_difference(const torch::Tensor& a, const torch::Tensor& b) {
  return (a - b).norm().item<double>() / b.norm().item<double>();
}

// Independent MTP: loops over positions. Depth k at i predicts the sample's token i+k+1 =
// targets[i+k] (the last one beyond the inputs) when i+k < L, that token is in the segment of
// position i, and targets[i+k] is unmasked. The segment of token L: the last input's, or the next
// one when the last input is `eod_opening` (an EOD under reset_attention_mask; -1: none).
// Per-depth per-token mean, averaged over depths; pooled (mtp_per_layer_loss_norm=false): all
// depths' CE over all their targets.
double reference_mtp_raw(const std::vector<torch::Tensor>& depth_logits, const MicroBatch& b, bool pooled = false,
                         int64_t eod_opening = -1) {
  double total = 0, pooled_sum = 0, pooled_count = 0;
  for (size_t d = 0; d < depth_logits.size(); ++d) {
    const int64_t k = static_cast<int64_t>(d) + 1;
    const auto logp = torch::log_softmax(depth_logits[d].to(torch::kFloat64), -1);
    double sum = 0, count = 0;
    for (int64_t r = 0; r < b.batch_size; ++r)
      for (int64_t i = 0; i + k < b.seq_len; ++i) {
        const int64_t j = r * b.seq_len + i + k;
        const int64_t target_segment = i + k + 1 < b.seq_len ? b.segment_ids[j + 1]
                                                             : b.segment_ids[j] + (b.inputs[j] == eod_opening ? 1 : 0);
        if (target_segment != b.segment_ids[r * b.seq_len + i] || b.loss_mask[j] == 0) continue;
        sum -= logp[r][i][b.targets[j]].item<double>();
        count += 1;
      }
    total += sum / std::max(count, 1.0);
    pooled_sum += sum, pooled_count += count;
  }
  return pooled ? pooled_sum / std::max(pooled_count, 1.0) : total / static_cast<double>(depth_logits.size());
}

// The SwiGLU expert with gate_up (2F, D) (gate rows, then up rows) and down (D, F) on rows x (n, D)
// or one row x (D), computed here with plain autograd ops.
torch::Tensor expert_forward(const torch::Tensor& gate_up, const torch::Tensor& down, const torch::Tensor& x) {
  const auto F = gate_up.size(0) / 2;
  const auto gate = torch::matmul(x, gate_up.narrow(0, 0, F).t()), up = torch::matmul(x, gate_up.narrow(0, F, F).t());
  return torch::matmul(torch::silu(gate) * up, down.t());
}

// Expert e of a MoE layer, from its stacked weights.
torch::Tensor expert_forward(const Moe& moe, int64_t e, const torch::Tensor& x) {
  return expert_forward(moe->experts->gate_up_proj[e], moe->experts->down_proj[e], x);
}

// {nodes, Recompute nodes} of the autograd graph that produced `root`.
std::pair<int, int> graph_summary(const torch::Tensor& root) {
  std::vector<torch::autograd::Node*> stack = {root.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  int recomputes = 0;
  while (!stack.empty()) {
    auto* node = stack.back();
    stack.pop_back();
    if (!node || !seen.insert(node).second) continue;
    if (node->name().find("Recompute") != std::string::npos) ++recomputes;
    for (const auto& edge : node->next_edges()) stack.push_back(edge.function.get());
  }
  return {static_cast<int>(seen.size()), recomputes};
}


}  // namespace

TEST_CASE("dense-equivalent exactness: a MoE model without aux losses keeps (K=4,b=1) == (K=1,b=4)", "[moe]") {
  const auto base = moe_opts({"load_balance_loss_weight=0", "mtp_num_layers=1", "mtp_loss_scaling_factor=0"});
  auto a_opts = base, b_opts = base;
  a_opts.insert(a_opts.end(), {"gradient_accumulation_steps=4", "per_device_batch_size=1"});
  b_opts.insert(b_opts.end(), {"gradient_accumulation_steps=1", "per_device_batch_size=4"});
  Trainer a(tiny_config(a_opts)), b(tiny_config(b_opts));
  a.forward_backward(0);
  b.forward_backward(0);
  CHECK(torch::allclose(a.flat_grads(), b.flat_grads(), 1e-5, 1e-7));
}

TEST_CASE("RFC test 4: aux losses compensated by w_i reach the gradient at the same scale for (K=4,b=4) and (K=1,b=16)", "[moe]") {
  auto make = [](int K, int b, bool aux, bool drop_weighting) {
    auto o = moe_opts({aux ? "load_balance_loss_weight=1.0" : "load_balance_loss_weight=0", "mtp_num_layers=1",
                       aux ? "mtp_loss_scaling_factor=0.3" : "mtp_loss_scaling_factor=0",
                       aux ? "router_z_loss_weight=0.01" : "router_z_loss_weight=0"});
    o.push_back("gradient_accumulation_steps=" + std::to_string(K));
    o.push_back("per_device_batch_size=" + std::to_string(b));
    o.push_back("max_target_length=32");
    o.push_back(std::string("debug_drop_aux_token_weighting=") + (drop_weighting ? "true" : "false"));
    return tiny_config(o);
  };
  // The aux part of each gradient: (aux on) - (aux off), same weights and samples.
  auto aux_gradient = [&](int K, int b, bool drop_weighting) {
    Trainer with(make(K, b, true, drop_weighting)), without(make(K, b, false, false));
    with.forward_backward(0);
    without.forward_backward(0);
    return (with.flat_grads() - without.flat_grads()).clone();
  };
  const auto k1 = aux_gradient(1, 16, false), k4 = aux_gradient(4, 4, false), k4_bug = aux_gradient(4, 4, true);
  // Exactness, from a second code path: J's aux part at K=4 is sum_i (w_i / W) (lb_i + mtp_i), so
  // its gradient is the w_i / W-weighted sum of each micro-batch's own aux gradient, taken here with
  // autograd::grad on micro_batch_losses, micro-batch by micro-batch (fp32 model: 1e-5 relative).
  torch::Tensor expected = torch::zeros_like(k4);
  {
    Trainer ref(make(4, 4, true, false));
    auto params = ref.model()->parameters();
    double W = 0;
    std::vector<std::pair<double, torch::Tensor>> parts;
    for (int64_t m = 0; m < 4; ++m) {
      const MicroBatch b = ref.data().data_loader_next(0, m);
      const auto losses = micro_batch_losses(ref.model(), b, ref.config(), torch::kCPU);
      const auto grads = torch::autograd::grad({losses.lb + losses.mtp}, params, {}, false, false, true);
      std::vector<torch::Tensor> flat;
      for (size_t j = 0; j < params.size(); ++j)
        flat.push_back(grads[j].defined() ? grads[j].reshape(-1) : torch::zeros({params[j].numel()}));
      parts.emplace_back(losses.weights, torch::cat(flat));
      W += losses.weights;
    }
    for (const auto& [w, g] : parts) expected.add_(g, w / W);
    INFO("K=4 aux gradient against the per-micro-batch composition: " << relative_difference(k4, expected));
  }
  CHECK(relative_difference(k4, expected) < 1e-5);
  CHECK(relative_difference(k4_bug, expected) > 0.9);  // the composition check sees the bug
  const double scale = k4.norm().item<double>() / k1.norm().item<double>();
  const double scale_bug = k4_bug.norm().item<double>() / k1.norm().item<double>();
  const double cosine = (k4 * k1).sum().item<double>() / (k4.norm() * k1.norm()).item<double>();
  INFO("aux gradient norm ratio K=4/K=1: " << scale << " (cosine " << cosine << "); without * w_i: " << scale_bug);
  // K=4 against K=1: LB and the per-micro-batch MTP means are statistics of each micro-batch's own
  // tokens (LB = E sum_e f_e P_e is a product of two batch means), so the two splits optimize
  // different aux objectives and no identity ties their gradients; the exact statement is the
  // composition above. What compensation guarantees across splits is the scale: each micro-batch's
  // aux gradient is O(1) per token in both, so the ratio is 1 up to how batch statistics differ
  // (measured 1.153, cosine 0.916, at this seed). The bounds below separate that from the bug,
  // which divides the aux gradient by ~w_i (4 x 32 tokens, ~60% unmasked): measured 0.018.
  CHECK(scale > 0.8);
  CHECK(scale < 1.25);
  CHECK(cosine > 0.85);
  CHECK(scale_bug < 0.05);
}

TEST_CASE("RFC test 5: reported aux losses at K=4 equal those at K=1, not K times larger", "[moe]") {
  const auto base = moe_opts({"load_balance_loss_weight=1.0", "mtp_num_layers=1"});
  auto a_opts = base, b_opts = base;
  a_opts.insert(a_opts.end(), {"gradient_accumulation_steps=4", "per_device_batch_size=1"});
  b_opts.insert(b_opts.end(), {"gradient_accumulation_steps=1", "per_device_batch_size=4"});
  Trainer k4(tiny_config(a_opts)), k1(tiny_config(b_opts));
  auto a = k4.forward_backward(0), b = k1.forward_backward(0);
  for (const char* name : {"learning/moe_lb_loss", "learning/mtp_loss", "learning/mtp_loss_raw"}) {
    INFO(name << ": K=4 " << metric(k4, a, name) << ", K=1 " << metric(k1, b, name));
    CHECK(metric(k1, b, name) > 0);
    // Same scale (the bug this guards against made K=4 report 4x). LB is a statistic of each
    // micro-batch's routing (E sum f P over its tokens), so one-sample micro-batches legitimately
    // see another balance than four-sample ones: measured 1.092 vs 1.017 (7%); 12% bounds that and
    // is far from the 4x of the bug (the exact per-micro-batch values are checked in "reported aux
    // terms are the terms of J"). The MTP terms are per-token means over the same tokens, apart
    // from how uneven valid counts weigh them: measured 4e-5 relative.
    const double tolerance = std::string(name) == "learning/moe_lb_loss" ? 0.12 : 1e-3;
    CHECK(metric(k4, a, name) == Approx(metric(k1, b, name)).epsilon(tolerance));
  }
  CHECK(metric(k4, a, "learning/lm_loss") == Approx(metric(k1, b, "learning/lm_loss")).epsilon(1e-6));
  CHECK(metric(k4, a, "learning/loss") == Approx(metric(k4, a, "learning/lm_loss") + metric(k4, a, "learning/moe_lb_loss") +
                                                 metric(k4, a, "learning/mtp_loss")).epsilon(1e-12));
  CHECK(metric(k4, a, "learning/mtp_loss") == Approx(0.1 * metric(k4, a, "learning/mtp_loss_raw")).epsilon(1e-6));
}

TEST_CASE("reported aux terms are the terms of J, recomputed per micro-batch in the test", "[moe]") {
  // moe_aux_loss_over_layers: mean (the default) divides the per-layer LB and router z-loss sums by
  // the number of MoE layers; sum (Megatron: each router adds its own terms) does not. Megatron's
  // logged load-balancing loss is the per-layer mean either way.
  for (const std::string over_layers : {"mean", "sum"})
    for (const std::string mode : {"false", "true"}) {
      Trainer t(tiny_config(moe_opts({"load_balance_loss_weight=0.5", "router_z_loss_weight=0.01", "mtp_num_layers=2",
                                      "gradient_accumulation_steps=4", "per_device_batch_size=2",
                                      "calculate_per_token_loss=" + mode, "moe_aux_loss_over_layers=" + over_layers})));
      auto out = t.forward_backward(0);
      double lb_sum = 0, mtp_sum = 0, lb_weighted = 0, mtp_weighted = 0, W = 0, balance_mean_sum = 0;
      torch::NoGradGuard no_grad;
      for (int64_t m = 0; m < 4; ++m) {
        const MicroBatch b = t.data().data_loader_next(0, m);
        const auto output = t.model()->forward(micro_batch_tensor(b.inputs, b), micro_batch_tensor(b.positions, b), micro_batch_tensor(b.segment_ids, b));
        double balance = 0, z = 0;
        for (const auto& layer : output.moe_stats) balance += layer.load_balance.item<double>(), z += layer.router_z.item<double>();
        const double layers = static_cast<double>(output.moe_stats.size());
        REQUIRE(layers == 2);
        const double lb = (0.5 * balance + 0.01 * z) / (over_layers == "mean" ? layers : 1.0);
        const double mtp = 0.1 * reference_mtp_raw(output.mtp_logits, b);
        double w = 0;
        for (float x : b.loss_mask) w += x;
        lb_sum += lb, mtp_sum += mtp, lb_weighted += lb * w, mtp_weighted += mtp * w, W += w;
        balance_mean_sum += balance / layers;
      }
      INFO("calculate_per_token_loss=" << mode << ", moe_aux_loss_over_layers=" << over_layers);
      const bool per_token = mode == "true";
      CHECK(metric(t, out, "learning/moe_lb_loss") == Approx(per_token ? lb_weighted / W : lb_sum / 4).epsilon(1e-5));
      CHECK(metric(t, out, "learning/mtp_loss") == Approx(per_token ? mtp_weighted / W : mtp_sum / 4).epsilon(1e-5));
      CHECK(metric(t, out, "megatron/load_balancing_loss") == Approx(balance_mean_sum / 4).epsilon(1e-5));
    }
}

TEST_CASE("mtp_per_layer_loss_norm=false pools the depths: their CE sum over their target count", "[moe][mtp]") {
  // Depth k has fewer targets than depth k-1 (k more positions fall off the end of each
  // document), so the pooled value and the mean of per-depth means differ, and the check can fail.
  double values[2] = {0, 0};
  for (const bool per_layer : {true, false}) {
    Trainer t(tiny_config(moe_opts({"mtp_num_layers=3", "per_device_batch_size=2", "max_target_length=12",
                                    std::string("mtp_per_layer_loss_norm=") + (per_layer ? "true" : "false")})));
    const auto out = t.forward_backward(0);
    const MicroBatch b = t.data().data_loader_next(0, 0);
    torch::NoGradGuard no_grad;
    const auto output = t.model()->forward(micro_batch_tensor(b.inputs, b), micro_batch_tensor(b.positions, b), micro_batch_tensor(b.segment_ids, b));
    INFO("mtp_per_layer_loss_norm=" << per_layer);
    const double got = metric(t, out, "learning/mtp_loss_raw");
    CHECK(got == Approx(reference_mtp_raw(output.mtp_logits, b, /*pooled=*/!per_layer)).epsilon(1e-6));
    values[per_layer ? 0 : 1] = got;
  }
  CHECK(std::abs(values[0] - values[1]) > 1e-5);
}

TEST_CASE("the load-balancing loss counts the unbiased top-k, the expert load the biased routing", "[moe]") {
  // Sigmoid, E = 2, k = 1, router logits = x. Unbiased, tokens 0 and 2 prefer expert 0 and token 1
  // expert 1; a bias of +1 on expert 1 sends all three there. Megatron's f_e (and DeepSeek-V3's)
  // counts the unbiased choice: f = (2/3, 1/3). By the biased choice, f = (0, 1), LB would be
  // 2 P_1 < 1 and its gradient would push expert 1's probabilities down instead of expert 0's.
  // With load_balance_loss_weight 0 the (logged only) statistic counts the routing: 2 P_1.
  const double logits[3][2] = {{1, 0}, {0, 1}, {0.8, 0.2}};
  double P[2] = {0, 0};
  for (const auto& l : logits) {
    const double s0 = 1 / (1 + std::exp(-l[0])), s1 = 1 / (1 + std::exp(-l[1]));
    P[0] += s0 / (s0 + s1) / 3, P[1] += s1 / (s0 + s1) / 3;
  }
  for (const bool loss_on : {true, false}) {
    const Config c = tiny_config({"override_model_config=true", "base_emb_dim=2", "num_experts=2", "num_experts_per_tok=1",
                                  "base_moe_mlp_dim=4", "routed_score_func=sigmoid", "routed_bias=true",
                                  std::string("load_balance_loss_weight=") + (loss_on ? "0.01" : "0")});
    Moe moe(c);
    draw_weights(*moe, 0.3);
    torch::NoGradGuard no_grad;
    moe->gate->weight.copy_(torch::eye(2));
    moe->gate->e_score_correction_bias.copy_(torch::tensor({0.0f, 1.0f}));
    const auto x = torch::tensor({1.0f, 0.0f, 0.0f, 1.0f, 0.8f, 0.2f}).view({1, 3, 2});
    std::vector<MoeLayerStats> stats;
    BlockContext ctx;
    ctx.valid = torch::tensor({true, true, true}).view({1, 3});
    ctx.moe_stats = &stats;
    moe->forward(x, ctx);
    REQUIRE(stats.size() == 1);
    INFO("load_balance_loss_weight > 0: " << loss_on);
    const double expected = loss_on ? 2 * (2.0 / 3 * P[0] + 1.0 / 3 * P[1]) : 2 * P[1];
    CHECK(stats[0].load_balance.item<double>() == Approx(expected).epsilon(1e-6));
    CHECK(stats[0].counts[0].item<double>() == 0);  // the load as dispatched: all three to expert 1
    CHECK(stats[0].counts[1].item<double>() == 3);
  }
}

TEST_CASE("load-balancing loss of a crafted router equals the hand-computed value", "[moe]") {
  for (const std::string func : {"softmax", "sigmoid"}) {
    const Config c = tiny_config({"override_model_config=true", "base_emb_dim=2", "num_experts=2", "num_experts_per_tok=1",
                                  "base_moe_mlp_dim=4", "routed_score_func=" + func});
    Moe moe(c);
    draw_weights(*moe, 0.3);
    torch::NoGradGuard no_grad;
    moe->gate->weight.copy_(torch::eye(2));  // router logits = x
    // Three valid tokens and one padding token that must not count.
    const auto x = torch::tensor({2.0f, 0.0f, 0.0f, 1.0f, 1.0f, 0.0f, 0.0f, 5.0f}).view({1, 4, 2});
    std::vector<MoeLayerStats> stats;
    BlockContext ctx;
    ctx.valid = torch::tensor({true, true, true, false}).view({1, 4});
    ctx.moe_stats = &stats;
    const auto y = moe->forward(x, ctx);
    REQUIRE(stats.size() == 1);
    // By hand: scores s, p = s normalized per token; top-1 picks experts 0, 1, 0.
    auto score = [&](double a, double b, int e) {
      if (func == "softmax") return std::exp(e == 0 ? a : b) / (std::exp(a) + std::exp(b));
      return 1 / (1 + std::exp(-(e == 0 ? a : b)));
    };
    const double logits[3][2] = {{2, 0}, {0, 1}, {1, 0}};
    double P[2] = {0, 0}, z = 0;
    for (const auto& l : logits) {
      const double s0 = score(l[0], l[1], 0), s1 = score(l[0], l[1], 1);
      P[0] += s0 / (s0 + s1) / 3;
      P[1] += s1 / (s0 + s1) / 3;
      z += std::pow(std::log(std::exp(l[0]) + std::exp(l[1])), 2) / 3;
    }
    const double f[2] = {2.0 / 3, 1.0 / 3};
    INFO(func);
    // moe/router_probs_std: the population std of the 6 scores of the 3 valid tokens.
    double sum = 0, sum_sq = 0;
    for (const auto& l : logits)
      for (int e = 0; e < 2; ++e) sum += score(l[0], l[1], e), sum_sq += std::pow(score(l[0], l[1], e), 2);
    CHECK(stats[0].probs_std.item<double>() == Approx(std::sqrt(sum_sq / 6 - std::pow(sum / 6, 2))).epsilon(1e-6));
    CHECK(stats[0].load_balance.item<double>() == Approx(2 * (f[0] * P[0] + f[1] * P[1])).epsilon(1e-6));
    CHECK(stats[0].router_z.item<double>() == Approx(z).epsilon(1e-6));
    CHECK(stats[0].counts[0].item<double>() == 2);
    CHECK(stats[0].counts[1].item<double>() == 1);
    CHECK(stats[0].load_balance.item<double>() > 1.0);
    // Dispatch: token 0 went to expert 0 with weight s_0 (no renormalization with k = 1... unless asked).
    const auto expected0 = score(2, 0, 0) * expert_forward(moe, 0, x[0][0].unsqueeze(0));
    CHECK(torch::allclose(y[0][0], expected0.squeeze(0), 1e-5, 1e-6));

    // A perfectly balanced router: f = P = (1/2, 1/2) gives the minimum, exactly 1.
    stats.clear();
    ctx.valid = torch::ones({1, 2}, torch::kBool);
    moe->forward(torch::tensor({1.0f, 0.0f, 0.0f, 1.0f}).view({1, 2, 2}), ctx);
    CHECK(stats[0].load_balance.item<double>() == Approx(1.0).epsilon(1e-6));
  }
}

TEST_CASE("MTP never uses a target from another segment", "[moe][mtp]") {
  const Config c = tiny_config(moe_opts({"mtp_num_layers=2", "max_target_length=16"}));
  auto model = model_build(c);
  // Document 1 = positions 0..14, document 2 = position 15. Megatron-style, document 1's last
  // target is document 2's first token (unmasked), so a segment-blind shift would use it.
  MicroBatch b;
  b.batch_size = 1, b.seq_len = 16;
  for (int64_t i = 0; i < 16; ++i) {
    b.inputs.push_back(10 + 3 * i);
    b.segment_ids.push_back(i < 15 ? 1 : 2);
    b.positions.push_back(i < 15 ? i : 0);
  }
  for (int64_t i = 0; i < 16; ++i) {
    b.targets.push_back(i < 15 ? b.inputs[i + 1] : 0);
    b.loss_mask.push_back(i < 15 ? 1.0f : 0.0f);
  }
  b.sample_indices = {0};
  torch::NoGradGuard no_grad;
  const auto base = micro_batch_losses(model, b, c, torch::kCPU);
  MicroBatch next_doc = b;  // change the token of document 2
  next_doc.inputs[15] = 200, next_doc.targets[14] = 200;
  const auto changed = micro_batch_losses(model, next_doc, c, torch::kCPU);
  CHECK(changed.ce.item<double>() != base.ce.item<double>());            // the main loss sees it (as Megatron's)
  CHECK(changed.mtp_raw.item<double>() == base.mtp_raw.item<double>());  // MTP does not
  MicroBatch same_doc = b;  // the control: a token of document 1 does change MTP
  same_doc.inputs[5] = 200, same_doc.targets[4] = 200;
  CHECK(micro_batch_losses(model, same_doc, c, torch::kCPU).mtp_raw.item<double>() != base.mtp_raw.item<double>());
  // And the value is the independent loop-based computation.
  const auto output = model->forward(micro_batch_tensor(b.inputs, b), micro_batch_tensor(b.positions, b), micro_batch_tensor(b.segment_ids, b));
  CHECK(base.mtp_raw.item<double>() == Approx(reference_mtp_raw(output.mtp_logits, b)).epsilon(1e-5));
}

TEST_CASE("MTP counts the sample's last token as Megatron does, unless an EOD under reset_attention_mask ends the row", "[moe][mtp]") {
  // A Megatron sample holds L+1 tokens: targets[L-1] is token L, beyond the inputs. Depth k has
  // L-k targets per row (Megatron's roll zero-fills only the last position per depth); the last,
  // at i = L-k-1, is token L.
  MicroBatch b;
  b.batch_size = 1, b.seq_len = 16;
  for (int64_t i = 0; i < 17; ++i) b.inputs.push_back(10 + 3 * i);
  for (int64_t i = 0; i < 16; ++i) {
    b.targets.push_back(b.inputs[i + 1]);
    b.loss_mask.push_back(1.0f);
    b.segment_ids.push_back(1);
    b.positions.push_back(i);
  }
  b.inputs.pop_back();
  b.sample_indices = {0};
  torch::NoGradGuard no_grad;
  for (const bool reset : {false, true}) {
    Config c = tiny_config(moe_opts({"mtp_num_layers=2", "max_target_length=16", "eod_id=56"}));
    c.reset_attention_mask = reset;  // (the config check allows it with Megatron data only)
    auto model = model_build(c);
    MicroBatch ends_in_eod = b;  // the last input is an EOD: token L opens the next document
    ends_in_eod.inputs[15] = 56, ends_in_eod.targets[14] = 56;  // (b's tokens 10 + 3i are never 56)
    for (const MicroBatch& row : {b, ends_in_eod}) {
      const bool opens = reset && row.inputs[15] == 56;
      INFO("reset_attention_mask=" << reset << ", last input EOD=" << (row.inputs[15] == 56));
      const auto base = micro_batch_losses(model, row, c, torch::kCPU);
      const auto output = model->forward(micro_batch_tensor(row.inputs, row), micro_batch_tensor(row.positions, row),
                                         micro_batch_tensor(row.segment_ids, row));
      CHECK(base.mtp_raw.item<double>() == Approx(reference_mtp_raw(output.mtp_logits, row, false, reset ? 56 : -1)).epsilon(1e-6));
      MicroBatch last_changed = row;  // token L differs: MTP sees it unless it opens another document
      last_changed.targets[15] = 200;
      const auto changed = micro_batch_losses(model, last_changed, c, torch::kCPU);
      CHECK(changed.ce.item<double>() != base.ce.item<double>());
      if (opens)
        CHECK(changed.mtp_raw.item<double>() == base.mtp_raw.item<double>());
      else
        CHECK(changed.mtp_raw.item<double>() != base.mtp_raw.item<double>());
    }
  }
}

TEST_CASE("expert bias moves toward underloaded experts, from the step's counts whatever K", "[moe]") {
  const auto base = moe_opts({"routed_bias=true", "routed_bias_update_rate=0.01", "routed_score_func=sigmoid"});
  auto a_opts = base, b_opts = base;
  a_opts.insert(a_opts.end(), {"gradient_accumulation_steps=4", "per_device_batch_size=1"});
  b_opts.insert(b_opts.end(), {"gradient_accumulation_steps=1", "per_device_batch_size=4"});
  Trainer k4(tiny_config(a_opts)), k1(tiny_config(b_opts));
  auto a = k4.train_step(0);
  k1.train_step(0);
  auto layers4 = k4.model()->moe_layers(), layers1 = k1.model()->moe_layers();
  REQUIRE(layers4.size() == 2);
  for (size_t l = 0; l < layers4.size(); ++l) {
    const auto bias = layers4[l]->gate->e_score_correction_bias;
    CHECK(torch::equal(bias, layers1[l]->gate->e_score_correction_bias));  // K does not scale it
    const auto load = a.expert_counts[static_cast<int64_t>(l)];
    const double mean = load.mean().item<double>();
    for (int64_t e = 0; e < bias.size(0); ++e) {
      const double expected = load[e].item<double>() < mean ? 0.01 : load[e].item<double>() > mean ? -0.01 : 0.0;
      CHECK(bias[e].item<double>() == Approx(expected).margin(1e-9));
    }
    CHECK(bias.abs().sum().item<double>() > 0);
  }
}

TEST_CASE("expert bias: an expert exactly at the mean load stays put (the sign of summed counts, as Megatron)", "[moe]") {
  // Megatron's get_updated_expert_bias takes sign(sum / E - count) on the counts summed over
  // micro-batches and ranks. Counts divided by K x R = 3 first round, and their fp32 mean may
  // miss the experts at the mean: they would move. Expected signs from integers here.
  Trainer t(tiny_config(moe_opts({"routed_bias=true", "routed_bias_update_rate=0.01", "routed_score_func=sigmoid",
                                  "routed_bias_zero_mean_update=false", "gradient_accumulation_steps=3",
                                  "warmup_steps_fraction=0"})));
  auto out = t.forward_backward(0);
  REQUIRE(out.expert_counts.sizes() == torch::IntArrayRef({2, 8}));
  const std::vector<std::vector<int64_t>> counts = {{4, 1, 7, 4, 4, 4, 4, 4}, {5, 2, 11, 5, 5, 5, 5, 2}};
  out.expert_counts = torch::tensor({4, 1, 7, 4, 4, 4, 4, 4, 5, 2, 11, 5, 5, 5, 5, 2}, torch::kFloat32).view({2, 8});
  t.optimizer_update(out);
  REQUIRE_FALSE(out.step_skipped);
  auto layers = t.model()->moe_layers();
  for (size_t l = 0; l < 2; ++l) {
    int64_t sum = 0;
    for (const int64_t n : counts[l]) sum += n;
    for (int64_t e = 0; e < 8; ++e) {
      const int64_t below = sum - 8 * counts[l][static_cast<size_t>(e)];  // sign(mean - count)
      const double expected = below > 0 ? 0.01 : below < 0 ? -0.01 : 0.0;
      INFO("layer " << l << " expert " << e);
      CHECK(layers[l]->gate->e_score_correction_bias[e].item<double>() == Approx(expected).margin(1e-9));
    }
  }
}

TEST_CASE("zero-mean expert-bias update: rate * (s - mean(s)) per layer, as Ling's Megatron patch", "[moe]") {
  // s = sign(mean load - load) per layer; the centred step sums to zero over the experts, so the
  // layer's mean bias never drifts. Checked against that formula from the step's own load, and
  // against the plain update of the same step (which differs wherever the signs do not balance).
  auto run = [](bool zero_mean) {
    Trainer t(tiny_config(moe_opts({"routed_bias=true", "routed_bias_update_rate=0.01", "routed_score_func=sigmoid",
                                    "per_device_batch_size=2",
                                    std::string("routed_bias_zero_mean_update=") + (zero_mean ? "true" : "false")})));
    auto out = t.train_step(0);
    REQUIRE_FALSE(out.step_skipped);
    std::vector<torch::Tensor> biases;
    for (auto& layer : t.model()->moe_layers()) biases.push_back(layer->gate->e_score_correction_bias.clone());
    // moe/router_bias_mean: the updated biases' mean over experts and layers.
    CHECK(metric(t, out, "moe/router_bias_mean") == Approx(torch::stack(biases).to(torch::kFloat64).mean().item<double>()).margin(1e-12));
    return std::pair{out.expert_counts.clone(), biases};
  };
  const auto [load, centred] = run(true);
  const auto [plain_load, plain] = run(false);
  REQUIRE(torch::equal(load, plain_load));  // the same first step: the bias only moves after it
  bool differs = false;
  for (size_t l = 0; l < centred.size(); ++l) {
    const auto layer_load = load[static_cast<int64_t>(l)];
    const auto signs = torch::sign(layer_load.mean() - layer_load);  // (E)
    CHECK(torch::allclose(centred[l], (signs - signs.mean()) * 0.01, 0, 1e-9));
    CHECK(std::abs(centred[l].sum().item<double>()) < 1e-7);
    CHECK(torch::allclose(plain[l], signs * 0.01, 0, 1e-9));
    differs |= std::abs(signs.sum().item<double>()) > 0;
  }
  CHECK(differs);  // some layer had unbalanced signs, where the two updates part
  CHECK(std::abs(torch::stack(plain).mean().item<double>()) > 1e-4);  // so the plain bias mean moved
}

TEST_CASE("dropless: every valid token reaches k experts, and routed experts get gradient", "[moe]") {
  Trainer t(tiny_config(moe_opts({"per_device_batch_size=4"})));
  auto out = t.forward_backward(0);
  const MicroBatch b = t.data().data_loader_next(0, 0);
  double valid = 0;
  for (auto s : b.segment_ids) valid += s != 0;
  const auto load = out.expert_counts;  // (layers, E)
  for (int64_t l = 0; l < load.size(0); ++l) CHECK(load[l].sum().item<double>() == 2 * valid);
  auto layers = t.model()->moe_layers();
  int routed = 0;
  for (size_t l = 0; l < layers.size(); ++l)
    for (int64_t e = 0; e < load.size(1); ++e) {
      const auto grad = layers[l]->experts->gate_up_proj.grad()[e];
      const bool has_grad = grad.abs().sum().item<double>() > 0;
      CHECK(has_grad == (load[static_cast<int64_t>(l)][e].item<double>() > 0));
      routed += has_grad;
    }
  CHECK(routed > 4);
}

TEST_CASE("MoE and MTP parameter counts: config formula, built model, hand count", "[moe][model]") {
  for (const std::string model : {"moe-tiny", "ling-mini-tiny"}) {
    const Config c = tiny_config({"model_name=" + model, "mtp_num_layers=2", "override_model_config=true"});
    auto built = model_build(c);
    int64_t numel = 0;
    for (const auto& p : built->parameters()) numel += p.numel();
    INFO(model);
    CHECK(numel == model_size(c).total_params);
    const auto checkpoint = checkpoint_tensors(built);
    CHECK(checkpoint.count("model.layers.1.mlp.experts.7.down_proj.weight") == 1);
    CHECK(checkpoint.count("model.layers.1.mlp.experts.7.gate_proj.weight") == 1);
    CHECK(checkpoint.count("model.layers.1.mlp.experts.8.gate_proj.weight") == 0);
    CHECK(built->named_parameters().contains("model.layers.1.mlp.gate.weight"));
    CHECK(built->named_parameters().contains("model.layers.1.mlp.shared_experts.up_proj.weight"));
    CHECK(built->named_parameters().contains("model.layers.3.eh_proj.weight"));  // MTP depth 1 after 3 layers
    CHECK(built->named_parameters().contains("model.layers.4.shared_head.norm.weight"));
    CHECK(built->named_buffers().contains("model.layers.2.mlp.gate.e_score_correction_bias"));
  }
  // moe-tiny by hand: embeddings 2*256*64, attention 3 x (64*64*2 + 2*64*32) + norms 3*128, one
  // dense MLP 3*64*128, two MoE layers of router 8*64 + k=2 active experts 2*3*64*32 + shared 3*64*32.
  const Config c = tiny_config({"model_name=moe-tiny"});
  CHECK(model_size(c).total_params == 206272);
  CHECK(model_size(c).active_params == 32768 + 3 * (12288 + 128) + 24576 + 2 * (512 + 2 * 6144 + 6144) + 64);
}

TEST_CASE("Ling 2.0 MTP: a MoE block in the balancing statistics and bias updates, fed the normed hidden state", "[moe][mtp]") {
  // mtp_input_after_final_norm: depth 1 reads norm(h) instead of h, where h is the decoder stack's
  // output. Recomputed here from the modules: h, norm, the MTP block, the head; for both settings
  // on the same weights, and the two must differ (the flag is read).
  torch::Tensor with_flag[2];
  for (const bool after : {false, true}) {
    INFO("mtp_input_after_final_norm=" << after);
    const Config c = tiny_config({"model_name=ling-mini-tiny", "override_model_config=true", "max_target_length=8",
                                  std::string("mtp_input_after_final_norm=") + (after ? "true" : "false")});
    auto model = model_build(c);
    torch::NoGradGuard no_grad;
    torch::manual_seed(3);
    // Trained final-norm weights (at init they are 1, and hnorm(norm(h)) = hnorm(h): RMSNorm
    // ignores the scale of its input, so only the weights make the two inputs differ).
    model->model->norm->weight.uniform_(0.5, 1.5);
    const auto tokens = torch::randint(0, 256, {1, 8}), positions = torch::arange(8).view({1, 8});
    const auto segments = torch::ones({1, 8}, torch::kInt64);
    const auto out = model->forward(tokens, positions, segments);
    BlockContext ctx = model->model->context(positions, segments, false);
    std::vector<MoeLayerStats> stats;
    ctx.moe_stats = &stats;
    const auto h = model->model->forward(model->model->embed_tokens(tokens), ctx);
    auto mtp = model->model->layers[3]->as<MtpLayerImpl>();
    REQUIRE(mtp->moe);  // mtp_moe_mlp: the block's MLP is a MoE block
    const auto shifted = model->model->embed_tokens(mtp_shift_tokens(tokens, segments, 1));
    const auto depth = mtp->forward_depth(after ? model->model->norm(h) : h, shifted, ctx);
    const auto expected = model->lm_head(mtp->shared_head->norm(depth));
    CHECK(torch::allclose(out.mtp_logits[0], expected, 1e-5, 1e-6));
    CHECK(out.moe_stats.size() == 3);  // two decoder MoE layers and the MTP block's
    with_flag[after ? 1 : 0] = out.mtp_logits[0];
  }
  CHECK_FALSE(torch::allclose(with_flag[0], with_flag[1], 1e-3, 1e-4));

  // The MTP block's router is balanced like the others: its expert load is the last row, and its
  // bias moves by rate * sign(mean load - load) after an applied update (the plain update here;
  // the zero-mean one has its own test).
  Trainer t(tiny_config({"model_name=ling-mini-tiny", "override_model_config=true", "routed_bias_update_rate=0.01",
                         "routed_bias_zero_mean_update=false", "per_device_batch_size=2", "warmup_steps_fraction=0"}));
  auto out = t.forward_backward(0);
  REQUIRE(out.expert_counts.size(0) == 3);
  const auto load = out.expert_counts[2].clone();
  const auto bias_before = t.model()->moe_layers().at(2)->gate->e_score_correction_bias.clone();
  t.optimizer_update(out);
  REQUIRE_FALSE(out.step_skipped);
  const auto moved = t.model()->moe_layers().at(2)->gate->e_score_correction_bias - bias_before;
  CHECK(torch::allclose(moved, torch::sign(load.mean() - load) * 0.01, 0, 1e-7));
  CHECK(moved.abs().sum().item<double>() > 0);
  CHECK(t.model()->moe_layers().at(2).ptr() == t.model()->model->layers[3]->as<MtpLayerImpl>()->moe.ptr());
}

TEST_CASE("gradient check with MoE, MTP and compensated aux losses (per-token and Megatron)", "[moe][training]") {
  for (const std::string mode : {"true", "false"}) {
    Trainer t(tiny_config(moe_opts({"load_balance_loss_weight=1.0", "mtp_num_layers=1", "mtp_loss_scaling_factor=0.5",
                                    "gradient_accumulation_steps=2", "per_device_batch_size=2",
                                    "calculate_per_token_loss=" + mode})));
    t.forward_backward(0);
    auto model64 = float64_copy(t);
    // J recomputed here: CE via log_softmax, LB from the layer statistics, MTP by loops.
    auto objective = [&] {
      torch::NoGradGuard no_grad;
      double sum = 0, W = 0;
      for (int64_t m = 0; m < 2; ++m) {
        const MicroBatch b = t.data().data_loader_next(0, m);
        const auto out = model64->forward(micro_batch_tensor(b.inputs, b), micro_batch_tensor(b.positions, b), micro_batch_tensor(b.segment_ids, b));
        const auto [ce, w] = masked_cross_entropy(out.logits, b);
        double lb = 0;
        for (const auto& layer : out.moe_stats) lb += layer.load_balance.item<double>() / out.moe_stats.size();
        const double aux = lb + 0.5 * reference_mtp_raw(out.mtp_logits, b);
        sum += mode == "true" ? ce + aux * w : ce / std::max(w, 1.0) + aux;
        W += w;
      }
      return mode == "true" ? sum / W : sum / 2;
    };
    auto params64 = checkpoint_tensors(model64);
    auto grads32 = checkpoint_tensors(t.model(), /*gradients=*/true);
    for (const std::string name : {"model.layers.1.mlp.gate.weight", "model.layers.2.mlp.experts.3.up_proj.weight",
                                   "model.layers.2.mlp.experts.5.down_proj.weight", "model.layers.1.mlp.experts.0.gate_proj.weight",
                                   "model.layers.3.eh_proj.weight", "model.layers.0.self_attn.v_proj.weight"}) {
      for (int64_t index : {1, 5}) {
        const double numeric = central_difference(params64.at(name), index, objective);
        const double analytic = grads32.at(name).reshape(-1)[index].item<double>();
        INFO(name << "[" << index << "] per_token=" << mode << " numeric " << numeric << " analytic " << analytic);
        CHECK(analytic == Approx(numeric).epsilon(5e-3).margin(2e-7));
      }
    }
  }
}

TEST_CASE("end to end: moe-tiny and ling2-tiny train with falling loss and report aux metrics", "[moe][cli]") {
  // ling2-tiny (5 layers, 4 of them GLA) needs more steps than moe-tiny for the same drop: at 40
  // steps it has fallen ~0.5, at 80 ~1.7 (measured).
  for (const auto& [model, steps] : {std::pair<std::string, int>{"moe-tiny", 40}, {"ling2-tiny", 80}}) {
    std::filesystem::remove_all(test_root() + "/e2e-" + model);
    auto r = run_trainer("model_name=" + model + " max_target_length=32 steps=" + std::to_string(steps) +
                         " log_period=20 per_device_batch_size=4 base_output_directory=" + test_root() + " run_name=e2e-" + model);
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    CHECK_THAT(r.output, Catch::Contains("moe_lb_loss"));
    const auto lines = read_lines(test_root() + "/e2e-" + model + "/metrics.jsonl");
    REQUIRE(lines.size() == static_cast<size_t>(steps));
    CHECK(json_metric(lines.back(), "learning/lm_loss") < json_metric(lines.front(), "learning/lm_loss") - 0.5);
    // A bound only (the value is checked against a constructed routing in its own test): between
    // balanced (1) and every token on the same k experts (E / k = 4).
    CHECK(json_metric(lines.back(), "moe/expert_load_max_over_mean") >= 1.0);
    CHECK(json_metric(lines.back(), "moe/expert_load_max_over_mean") <= 4.0);
    if (model == "ling2-tiny") {
      CHECK(json_metric(lines.back(), "learning/mtp_loss") > 0);
      CHECK(json_metric(lines.back(), "learning/mtp_loss_raw") ==
            Approx(10 * json_metric(lines.back(), "learning/mtp_loss")).epsilon(1e-6));
    }
  }
}

TEST_CASE("expert load imbalance of a constructed routing: every token on the same k experts gives E / k", "[moe]") {
  // moe-tiny: E = 8, k = 2. A selection bias of +100 on experts 0 and 1 makes every token choose
  // them (selection uses score + bias), so each gets all n tokens and the others none: max = n,
  // mean = n k / E, max / mean = E / k = 4 exactly, in every MoE layer.
  Trainer t(tiny_config(moe_opts({"routed_bias=true", "routed_bias_update_rate=0"})));
  REQUIRE(t.config().num_experts == 8);
  REQUIRE(t.config().num_experts_per_tok == 2);
  {
    torch::NoGradGuard no_grad;
    for (auto& layer : t.model()->moe_layers()) {
      layer->gate->e_score_correction_bias.zero_();
      layer->gate->e_score_correction_bias.narrow(0, 0, 2).fill_(100.0);
    }
  }
  const auto out = t.forward_backward(0);
  CHECK(metric(t, out, "moe/expert_load_max_over_mean") == Approx(4.0).epsilon(1e-12));
  // Unbiased routing of the same model is far more balanced (the metric moves with the routing).
  Trainer plain(tiny_config(moe_opts({"routed_bias=true", "routed_bias_update_rate=0"})));
  CHECK(metric(plain, plain.forward_backward(0), "moe/expert_load_max_over_mean") < 3.0);
}

TEST_CASE("top-k dispatch with norm_topk_prob and routed_scaling_factor equals a hand computation", "[moe]") {
  // E = 3 experts, k = 2, router logits = x W^T with W rows (1,0), (0,1), (1,1); per token the two
  // largest scores are chosen and the output is sum_e w_e * expert_e(x), with
  //   w_e = s_e / (sum of the chosen s) * scale   (norm_topk_prob)    or   s_e * scale   (not).
  for (const std::string func : {"sigmoid", "softmax"})
    for (const bool normalize : {true, false}) {
      INFO(func << ", norm_topk_prob " << normalize);
      const double scale = 2.5;
      const Config c = tiny_config({"override_model_config=true", "base_emb_dim=2", "num_experts=3",
                                    "num_experts_per_tok=2", "base_moe_mlp_dim=4", "shared_experts=0",
                                    "routed_bias=false", "routed_scaling_factor=2.5", "routed_score_func=" + func,
                                    std::string("norm_topk_prob=") + (normalize ? "true" : "false")});
      torch::manual_seed(5);
      Moe moe(c);
      draw_weights(*moe, 0.3);
      torch::NoGradGuard no_grad;
      moe->gate->weight.copy_(torch::tensor({1.0f, 0.0f, 0.0f, 1.0f, 1.0f, 1.0f}).view({3, 2}));
      const auto x = torch::tensor({0.3f, -1.2f, 2.0f, 0.5f, -0.4f, -0.9f}).view({1, 3, 2});
      BlockContext ctx;
      ctx.valid = torch::ones({1, 3}, torch::kBool);
      const auto y = moe->forward(x, ctx);  // (1, 3, 2)
      for (int64_t t = 0; t < 3; ++t) {
        const double a = x[0][t][0].item<double>(), b = x[0][t][1].item<double>();
        const double logits[3] = {a, b, a + b};
        double s[3];
        for (int e = 0; e < 3; ++e)
          s[e] = func == "sigmoid" ? 1 / (1 + std::exp(-logits[e]))
                                   : std::exp(logits[e]) / (std::exp(a) + std::exp(b) + std::exp(a + b));
        // The expert with the smallest score is the one left out.
        const int out = static_cast<int>(std::min_element(s, s + 3) - s);
        double chosen_sum = 0;
        for (int e = 0; e < 3; ++e)
          if (e != out) chosen_sum += s[e];
        auto expected = torch::zeros({2}, torch::kFloat64);
        for (int e = 0; e < 3; ++e) {
          if (e == out) continue;
          const double w = (normalize ? s[e] / chosen_sum : s[e]) * scale;
          expected += w * expert_forward(moe, e, x[0][t].unsqueeze(0)).squeeze(0).to(torch::kFloat64);
        }
        INFO("token " << t << ": " << y[0][t] << " vs " << expected);
        CHECK(torch::allclose(y[0][t].to(torch::kFloat64), expected, 1e-5, 1e-6));
      }
    }
}

TEST_CASE("group-limited routing picks the top-k among the best groups' experts, as Ling 2.0's gate", "[moe]") {
  // E = 8 experts in G = 4 groups of 2, keep g = 2 groups, k = 2, sigmoid scores with a selection
  // bias. The gate weight is the identity, so router logits are x itself. Per token, by hand: a
  // group's score is the sum of its two biased scores; the two best groups' experts are candidates;
  // the two largest biased scores among them are chosen; their unbiased scores, renormalized and
  // scaled, weigh the experts' outputs.
  const Config c = tiny_config({"override_model_config=true", "base_emb_dim=8", "num_experts=8", "num_experts_per_tok=2",
                                "base_moe_mlp_dim=4", "shared_experts=0", "routed_bias=true", "routed_score_func=sigmoid",
                                "norm_topk_prob=true", "routed_scaling_factor=2.5", "n_routing_groups=4",
                                "topk_routing_group=2"});
  torch::manual_seed(11);
  Moe moe(c);
  draw_weights(*moe, 0.3);
  torch::NoGradGuard no_grad;
  moe->gate->weight.copy_(torch::eye(8));
  const std::vector<double> bias = {0.0, 0.05, -0.1, 0.0, 0.02, 0.0, 0.0, -0.03};
  moe->gate->e_score_correction_bias.copy_(torch::tensor(bias, torch::kFloat32));
  // Token 0 is crafted so that group limiting changes the choice: biased scores 0.9, 0.1 | 0.8, 0.75
  // | 0.85, 0.05 | 0.7, 0.7 (before the bias): the global top-2 are experts 0 and 4, the group-limited
  // ones come from groups 1 and 3. The other tokens are random.
  auto logit = [](double p) { return std::log(p / (1 - p)); };
  std::vector<float> crafted;
  for (double p : {0.9, 0.1, 0.8, 0.75, 0.85, 0.05, 0.7, 0.7}) crafted.push_back(static_cast<float>(logit(p)));
  const auto x = torch::cat({torch::tensor(crafted).view({1, 8}), torch::randn({5, 8}) * 1.5}).view({1, 6, 8});
  BlockContext ctx;
  ctx.valid = torch::ones({1, 6}, torch::kBool);
  std::vector<MoeLayerStats> stats;
  ctx.moe_stats = &stats;
  const auto y = moe->forward(x, ctx);  // (1, 6, 8)
  bool limiting_changed_a_choice = false;
  for (int64_t t = 0; t < 6; ++t) {
    double s[8], biased[8];
    for (int e = 0; e < 8; ++e) {
      s[e] = 1 / (1 + std::exp(-x[0][t][e].item<double>()));
      biased[e] = s[e] + bias[e];
    }
    std::vector<int> groups = {0, 1, 2, 3};
    std::sort(groups.begin(), groups.end(), [&](int a, int b) {
      return biased[2 * a] + biased[2 * a + 1] > biased[2 * b] + biased[2 * b + 1];
    });
    std::vector<int> candidates = {2 * groups[0], 2 * groups[0] + 1, 2 * groups[1], 2 * groups[1] + 1};
    std::sort(candidates.begin(), candidates.end(), [&](int a, int b) { return biased[a] > biased[b]; });
    const int chosen[2] = {candidates[0], candidates[1]};
    std::vector<int> all = {0, 1, 2, 3, 4, 5, 6, 7};
    std::sort(all.begin(), all.end(), [&](int a, int b) { return biased[a] > biased[b]; });
    limiting_changed_a_choice |= std::set<int>{all[0], all[1]} != std::set<int>{chosen[0], chosen[1]};
    auto expected = torch::zeros({8}, torch::kFloat64);
    for (int e : chosen) {
      const double w = s[e] / (s[chosen[0]] + s[chosen[1]]) * 2.5;
      expected += w * expert_forward(moe, e, x[0][t].unsqueeze(0)).squeeze(0).to(torch::kFloat64);
    }
    INFO("token " << t << ": chosen " << chosen[0] << ", " << chosen[1]);
    CHECK(torch::allclose(y[0][t].to(torch::kFloat64), expected, 1e-5, 1e-6));
  }
  CHECK(limiting_changed_a_choice);  // token 0 at least: the test sees the groups, not a plain top-k
  // Bad group settings are config errors naming the keys.
  for (const auto& bad : std::vector<std::vector<std::string>>{{"n_routing_groups=3", "topk_routing_group=1"},
                                                             {"n_routing_groups=4", "topk_routing_group=5"},
                                                             {"n_routing_groups=8", "topk_routing_group=1"}}) {
    auto o = std::vector<std::string>{"model_name=moe-tiny", "override_model_config=true", "num_experts=8"};
    o.insert(o.end(), bad.begin(), bad.end());
    CHECK_THROWS_WITH(tiny_config(o), Catch::Contains("n_routing_groups") || Catch::Contains("topk_routing_group"));
  }
}

TEST_CASE("remat_policy full and minimal: the gradients, losses and MoE statistics of none", "[moe][training][remat]") {
  // Recomputation reruns the same operations in backward, so gradients agree to rounding (1e-6
  // relative, as the issue asks; bf16 below); the MoE statistics must be counted once (twice would
  // double the expert load); under bf16 autocast the rerun must be in bf16 too.
  struct Variant {
    std::string name;
    std::vector<std::string> options;
  };
  const std::vector<Variant> variants = {
      {"dense", {"model_name=test-tiny", "gradient_accumulation_steps=2", "per_device_batch_size=2"}},
      {"moe+mtp", moe_opts({"load_balance_loss_weight=0.5", "router_z_loss_weight=0.01", "mtp_num_layers=1",
                            "gradient_accumulation_steps=2", "per_device_batch_size=2"})},
      {"moe bf16", moe_opts({"load_balance_loss_weight=0.5", "dtype=bfloat16", "per_device_batch_size=2"})},
      {"ling2-tiny (GLA + MLA)", moe_opts({"model_name=ling2-tiny", "gradient_accumulation_steps=2", "per_device_batch_size=2"})},
  };
  for (const auto& variant : variants) {
    auto with = [&](const std::string& policy) {
      auto o = variant.options;
      o.push_back("remat_policy=" + policy);
      return tiny_config(o);
    };
    Trainer reference(with("none"));
    const auto expected = reference.forward_backward(0);
    for (const std::string policy : {"full", "minimal"}) {
      INFO(variant.name << ", remat_policy=" << policy);
      Trainer t(with(policy));
      const auto out = t.forward_backward(0);
      const double difference = relative_difference(t.flat_grads(), reference.flat_grads());
      INFO("relative gradient difference " << difference);
      // fp32: the same operations, 1e-6. bf16: the rerun's backward may pick kernels that sum bf16
      // products in another order (LibTorch 2.6: 9.7e-5; 1.13: 4e-8), while a rerun in fp32 (the
      // autocast state lost) differs by 4e-3, the bf16 resolution; 5e-4 separates the two.
      CHECK(difference < (variant.name == "moe bf16" ? 5e-4 : 1e-6));
      CHECK(reference.flat_grads().norm().item<double>() > 0);
      std::vector<std::string> names = {"learning/loss", "learning/lm_loss"};
      if (variant.name != "dense") names.insert(names.end(), {"learning/moe_lb_loss", "megatron/z_loss"});
      if (variant.name == "moe+mtp") names.push_back("learning/mtp_loss");
      for (const auto& name : names)
        CHECK(metric(t, out, name) == Approx(metric(reference, expected, name)).epsilon(1e-6));
      if (expected.expert_counts.defined()) {
        REQUIRE(out.expert_counts.defined());
        CHECK(torch::equal(out.expert_counts, expected.expert_counts));
      }
      // The policy really acted: the recorded graph holds Recompute nodes, and under full far
      // fewer nodes (a block's internals are not recorded).
      const MicroBatch b = t.data().data_loader_next(0, 0);
      const auto graph = [&](Trainer& trainer) {
        return graph_summary(micro_batch_losses(trainer.model(), b, trainer.config(), torch::kCPU).ce);
      };
      const auto [nodes, recomputes] = graph(t);
      const auto [reference_nodes, reference_recomputes] = graph(reference);
      INFO("graph nodes " << nodes << " (" << recomputes << " recomputed) against " << reference_nodes);
      CHECK(reference_recomputes == 0);
      CHECK(recomputes > 0);
      if (policy == "full") CHECK(nodes < reference_nodes / 2);
    }
  }
}

TEST_CASE("grouped expert dispatch equals the per-expert loop: outputs and gradients", "[moe][dispatch]") {
  // The grouped path has a hand-written backward (moe.cpp, GroupedSwiGLU); the loop path is plain
  // autograd per expert. Same weights, same input, same upstream gradient: the outputs and every
  // gradient must agree to rounding, including where most experts get no row.
  struct Case {
    std::string name;
    std::vector<std::string> options;
    std::vector<int64_t> favoured;  // experts given a selection bias of 100: they take every token
  };
  const std::vector<Case> cases = {
      {"top-2, shared experts", {"num_experts_per_tok=2", "shared_experts=1"}, {}},
      {"top-2, no shared experts", {"num_experts_per_tok=2", "shared_experts=0"}, {}},
      {"top-k = E", {"num_experts=4", "num_experts_per_tok=4", "shared_experts=1"}, {}},
      {"one expert takes every token", {"num_experts_per_tok=1", "shared_experts=0", "routed_bias=true"}, {3}},
      {"two experts take every token", {"num_experts_per_tok=2", "shared_experts=1", "routed_bias=true"}, {3, 5}},
  };
  // parts: the grouped experts cut into runs computed on that many threads (moe_expert_parts_set;
  // 3 makes uneven runs of these 8 experts); 1 is one thread.
  struct DefaultPartsAfter {
    ~DefaultPartsAfter() { moe_expert_parts_set(0); }
  } default_parts_after;
  for (const auto& test : cases)
    for (const auto dtype : {torch::kFloat32, torch::kFloat64})
      for (const int parts : {1, 3}) {
        INFO(test.name << ", " << dtype << ", parts " << parts);
        moe_expert_parts_set(parts);
        auto options = std::vector<std::string>{"override_model_config=true", "base_emb_dim=16", "num_experts=8",
                                                "base_moe_mlp_dim=12", "routed_score_func=sigmoid"};
        options.insert(options.end(), test.options.begin(), test.options.end());
        auto with_dispatch = [&](const std::string& dispatch) {
          auto o = options;
          o.push_back("moe_dispatch=" + dispatch);
          return tiny_config(o);
        };
        torch::manual_seed(21);
        Moe grouped(with_dispatch("grouped")), loop(with_dispatch("loop"));
        grouped->to(dtype);
        loop->to(dtype);
        {
          torch::NoGradGuard no_grad;
          // Modules are built undrawn (model_build draws); these scales keep the routing decisive.
          for (auto& item : grouped->named_parameters()) item.value().normal_(0.0, 0.15);
          grouped->gate->weight.normal_(0.0, 0.5);
          auto source = grouped->named_parameters();
          for (auto& item : loop->named_parameters()) item.value().copy_(source[item.key()]);
          for (const int64_t e : test.favoured)
            for (Moe* moe : {&grouped, &loop}) (*moe)->gate->e_score_correction_bias[e].fill_(100.0);
        }
        const auto x = torch::randn({2, 9, 16}, dtype);
        const auto upstream = torch::randn({2, 9, 16}, dtype);
        BlockContext ctx;
        ctx.valid = torch::ones({2, 9}, torch::kBool);
        ctx.valid[1].narrow(0, 7, 2).fill_(false);  // two padding tokens: routed like any other
        auto run = [&](Moe& moe) {
          const auto input = x.clone().requires_grad_(true);
          const auto y = moe->forward(input, ctx);
          (y * upstream).sum().backward();
          return std::pair{y.detach(), input.grad()};
        };
        const auto [y_grouped, dx_grouped] = run(grouped);
        const auto [y_loop, dx_loop] = run(loop);
        const double tolerance = dtype == torch::kFloat32 ? 1e-6 : 1e-12;
        CHECK(relative_difference(y_grouped, y_loop) < tolerance);
        CHECK(relative_difference(dx_grouped, dx_loop) < tolerance);
        auto loop_params = loop->named_parameters();
        for (const auto& item : grouped->named_parameters()) {
          INFO(item.key());
          const auto& expected = loop_params[item.key()].grad();
          REQUIRE(expected.defined());
          CHECK(relative_difference(item.value().grad(), expected) < tolerance);
        }
        // Where every token went to the favoured experts, the others have zero gradient.
        if (!test.favoured.empty()) {
          const auto per_expert = grouped->experts->gate_up_proj.grad().abs().sum({1, 2});  // (E)
          for (int64_t e = 0; e < 8; ++e) {
            const bool favoured = std::count(test.favoured.begin(), test.favoured.end(), e) > 0;
            CHECK((per_expert[e].item<double>() > 0) == favoured);
          }
        }
      }
}

TEST_CASE("grouped experts with no rows, and under bf16 autocast", "[moe][dispatch]") {
  torch::manual_seed(3);
  MoeExperts experts(4, 16, 12);
  draw_weights(*experts, 0.3);
  // A rank of an expert-parallel group may receive no rows at all.
  const auto none = torch::zeros({0, 16}).requires_grad_(true);
  const auto y = experts->forward(none, {0, 0, 0, 0}, /*grouped=*/true);
  CHECK(y.sizes() == torch::IntArrayRef({0, 16}));
  y.sum().backward();
  CHECK(experts->gate_up_proj.grad().abs().sum().item<double>() == 0);
  CHECK(experts->down_proj.grad().abs().sum().item<double>() == 0);
  CHECK(experts->forward(none.detach(), {0, 0, 0, 0}, /*grouped=*/false).sizes() == torch::IntArrayRef({0, 16}));

  // bf16 autocast: both paths compute in bf16 and return bf16; the weight gradients come back fp32.
  // They differ only by the order of bf16 roundings, far below what an fp32 computation would differ.
  const auto x = torch::randn({20, 16});
  const std::vector<int64_t> sizes = {7, 0, 5, 8};
  const auto upstream = torch::randn({20, 16});
  auto run = [&](bool grouped) {
    for (auto& p : experts->parameters()) p.mutable_grad() = torch::Tensor();
    const auto input = x.clone().requires_grad_(true);
    torch::Tensor out;
    {
      compat::AutocastGuard autocast(true, false);
      out = experts->forward(input, sizes, grouped);
    }
    (out.to(torch::kFloat32) * upstream).sum().backward();
    return std::tuple{out, input.grad(), experts->gate_up_proj.grad().clone(), experts->down_proj.grad().clone()};
  };
  const auto [y_grouped, dx_grouped, dw_grouped, dd_grouped] = run(true);
  const auto [y_loop, dx_loop, dw_loop, dd_loop] = run(false);
  CHECK(y_grouped.scalar_type() == torch::kBFloat16);
  CHECK(y_loop.scalar_type() == torch::kBFloat16);
  CHECK(dw_grouped.scalar_type() == torch::kFloat32);
  CHECK(dx_grouped.scalar_type() == torch::kFloat32);
  const double y_diff = relative_difference(y_grouped.to(torch::kFloat32), y_loop.to(torch::kFloat32));
  const double dx_diff = relative_difference(dx_grouped, dx_loop);
  const double dw_diff = relative_difference(dw_grouped, dw_loop), dd_diff = relative_difference(dd_grouped, dd_loop);
  INFO("bf16 relative differences: y " << y_diff << ", dx " << dx_diff << ", d gate_up " << dw_diff << ", d down " << dd_diff);
  CHECK(y_diff < 1e-2);
  CHECK(dx_diff < 1e-2);
  CHECK(dw_diff < 1e-2);
  CHECK(dd_diff < 1e-2);
  // Really computed in bf16: the fp32 result is a bf16 rounding away.
  const auto y_fp32 = experts->forward(x, sizes, /*grouped=*/true);
  CHECK(y_fp32.scalar_type() == torch::kFloat32);
  const double rounding = relative_difference(y_grouped.to(torch::kFloat32), y_fp32.detach());
  INFO("bf16 against fp32: " << rounding);
  CHECK(rounding > 1e-4);
  CHECK(rounding < 2e-2);

  // A whole layer under bf16 autocast: the grouped dispatch (gather, experts and combine in one
  // node) against the loop's separate autograd nodes, output and every gradient.
  auto layer_run = [&](const std::string& dispatch) {
    const Config c = tiny_config({"override_model_config=true", "base_emb_dim=16", "num_experts=8",
                                  "num_experts_per_tok=3", "base_moe_mlp_dim=12", "shared_experts=0",
                                  "moe_dispatch=" + dispatch});
    torch::manual_seed(5);
    Moe moe(c);
    {
      torch::NoGradGuard no_grad;
      draw_weights(*moe, 0.3);
      moe->gate->weight.normal_(0.0, 0.5);
    }
    torch::manual_seed(6);
    const auto input = torch::randn({2, 10, 16}).requires_grad_(true);
    const auto layer_upstream = torch::randn({2, 10, 16});
    BlockContext ctx;
    ctx.valid = torch::ones({2, 10}, torch::kBool);
    torch::Tensor out;
    {
      compat::AutocastGuard autocast(true, false);
      out = moe->forward(input, ctx);
    }
    (out.to(torch::kFloat32) * layer_upstream).sum().backward();
    return std::tuple{out.detach(), input.grad(), moe->gate->weight.grad(), moe->experts->gate_up_proj.grad(),
                      moe->experts->down_proj.grad()};
  };
  const auto [out_grouped, din_grouped, dgate_grouped, dgu_grouped, ddown_grouped] = layer_run("grouped");
  const auto [out_loop, din_loop, dgate_loop, dgu_loop, ddown_loop] = layer_run("loop");
  CHECK(out_grouped.scalar_type() == out_loop.scalar_type());
  CHECK(dgu_grouped.scalar_type() == torch::kFloat32);
  CHECK(relative_difference(out_grouped.to(torch::kFloat32), out_loop.to(torch::kFloat32)) < 1e-2);
  CHECK(relative_difference(din_grouped, din_loop) < 1e-2);
  CHECK(relative_difference(dgate_grouped, dgate_loop) < 1e-2);
  CHECK(relative_difference(dgu_grouped, dgu_loop) < 1e-2);
  CHECK(relative_difference(ddown_grouped, ddown_loop) < 1e-2);
}

TEST_CASE("a model with grouped dispatch trains as with the loop: gradients of a step", "[moe][dispatch][training]") {
  for (const std::string model : {"moe-tiny", "ling2-tiny"})
    for (const std::string per_token : {"true", "false"}) {
      INFO(model << ", calculate_per_token_loss=" << per_token);
      auto with = [&](const std::string& dispatch) {
        return tiny_config(moe_opts({"model_name=" + model, "load_balance_loss_weight=0.5", "gradient_accumulation_steps=2",
                                     "per_device_batch_size=2", "calculate_per_token_loss=" + per_token,
                                     "moe_dispatch=" + dispatch}));
      };
      Trainer grouped(with("grouped")), loop(with("loop"));
      const auto a = grouped.forward_backward(0);
      const auto b = loop.forward_backward(0);
      // Float rounding (the experts' sums in another order): measured up to 1.02e-6 for ling2-tiny
      // under LibTorch 2.6 with Megatron's init; a wrong expert or weight would be far off.
      INFO("relative gradient difference " << relative_difference(grouped.flat_grads(), loop.flat_grads()));
      CHECK(relative_difference(grouped.flat_grads(), loop.flat_grads()) < 3e-6);
      CHECK(metric(grouped, a, "learning/loss") == Approx(metric(loop, b, "learning/loss")).epsilon(1e-6));
      CHECK(torch::equal(a.expert_counts, b.expert_counts));
    }
}

TEST_CASE("moe_top_k_experts equals a stable sort of each row: ties to the lower index (-0 = 0) and NaN last", "[moe][dispatch]") {
  // Scores from a handful of values, so most rows have ties, with -inf (group-limited routing's
  // mask) and NaN entries. The reference ranks every number above NaN, larger first, and keeps
  // equal keys in index order (std::stable_sort).
  torch::manual_seed(8);
  for (const auto dtype : {torch::kFloat32, torch::kFloat64})
    for (const int64_t E : {8, 64, 256})
      for (const int64_t k : {int64_t{1}, int64_t{3}, int64_t{8}, E}) {
        INFO(dtype << ", E " << E << ", k " << k);
        const int64_t N = 300;  // more than one parallel_for block
        auto scores = torch::randint(0, 4, {N, E}, torch::kFloat64).div_(4);  // (N, E)
        scores.masked_fill_(torch::rand({N, E}) < 0.1, -std::numeric_limits<double>::infinity());
        scores.masked_fill_(torch::rand({N, E}) < 0.05, std::numeric_limits<double>::quiet_NaN());
        scores.masked_fill_(torch::rand({N, E}) < 0.05, -0.0);  // ties with 0.0, whose bits differ
        scores[0].fill_(std::numeric_limits<double>::quiet_NaN());  // a row of NaN still yields k experts
        scores = scores.to(dtype);
        const auto chosen = moe_top_k_experts(scores, k);
        REQUIRE(chosen.sizes() == torch::IntArrayRef({N, k}));
        const auto wide = scores.to(torch::kFloat64);
        int mismatches = 0;
        for (int64_t t = 0; t < N; ++t) {
          const double* row = wide[t].data_ptr<double>();
          std::vector<int64_t> order(static_cast<size_t>(E));
          std::iota(order.begin(), order.end(), 0);
          std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
            const bool a_nan = std::isnan(row[a]), b_nan = std::isnan(row[b]);
            if (a_nan || b_nan) return !a_nan && b_nan;
            return row[a] > row[b];
          });
          for (int64_t j = 0; j < k; ++j) mismatches += chosen[t][j].item<int64_t>() != order[static_cast<size_t>(j)];
        }
        CHECK(mismatches == 0);
      }
}

TEST_CASE("a MoE layer equals a per-token float64 computation: output and every gradient", "[moe][dispatch]") {
  // The reference routes token by token on the host (std::stable_sort of the biased scores) and
  // sums its experts' outputs with plain autograd ops: no expert ordering, gather or combine of
  // moe.cpp takes part. Both dispatch paths, both score functions, a selection bias.
  const int64_t E = 8, k = 3, D = 16;
  for (const std::string dispatch : {"grouped", "loop"})
    for (const std::string func : {"sigmoid", "softmax"}) {
      INFO(dispatch << ", " << func);
      const Config c = tiny_config({"override_model_config=true", "base_emb_dim=16", "num_experts=8",
                                    "num_experts_per_tok=3", "base_moe_mlp_dim=12", "shared_experts=0",
                                    "routed_bias=true", "norm_topk_prob=true", "routed_scaling_factor=2.5",
                                    "routed_score_func=" + func, "moe_dispatch=" + dispatch});
      torch::manual_seed(13);
      Moe moe(c);
      moe->to(torch::kFloat64);
      {
        torch::NoGradGuard no_grad;
        draw_weights(*moe, 0.2);
        moe->gate->weight.normal_(0.0, 0.5);
        moe->gate->e_score_correction_bias.normal_(0.0, 0.1);
      }
      const auto x = torch::randn({3, 40, D}, torch::kFloat64);
      const auto upstream = torch::randn({3, 40, D}, torch::kFloat64);
      BlockContext ctx;
      ctx.valid = torch::ones({3, 40}, torch::kBool);
      const auto input = x.clone().requires_grad_(true);
      const auto y = moe->forward(input, ctx);
      (y * upstream).sum().backward();

      const auto gate = moe->gate->weight.detach().clone().requires_grad_(true);         // (E, D)
      const auto gate_up = moe->experts->gate_up_proj.detach().clone().requires_grad_(true);  // (E, 2F, D)
      const auto down = moe->experts->down_proj.detach().clone().requires_grad_(true);   // (E, D, F)
      const auto bias = moe->gate->e_score_correction_bias.detach().to(torch::kFloat64);
      const auto ref_input = x.clone().requires_grad_(true);
      const auto tokens = ref_input.reshape({-1, D});
      std::vector<torch::Tensor> outputs;
      for (int64_t t = 0; t < tokens.size(0); ++t) {
        const auto x_t = tokens[t];                       // (D)
        const auto logits = torch::mv(gate, x_t);         // (E)
        const auto s = func == "sigmoid" ? torch::sigmoid(logits) : torch::softmax(logits, 0);
        const auto biased = (s.detach() + bias).contiguous();
        const double* b = biased.data_ptr<double>();
        std::vector<int64_t> experts(E);
        std::iota(experts.begin(), experts.end(), 0);
        std::stable_sort(experts.begin(), experts.end(), [&](int64_t i, int64_t j) { return b[i] > b[j]; });
        torch::Tensor chosen_sum = torch::zeros({}, torch::kFloat64);
        for (int64_t j = 0; j < k; ++j) chosen_sum = chosen_sum + s[experts[j]];
        torch::Tensor out = torch::zeros({D}, torch::kFloat64);
        for (int64_t j = 0; j < k; ++j) {
          const int64_t e = experts[j];
          out = out + s[e] / chosen_sum * 2.5 * expert_forward(gate_up[e], down[e], x_t);
        }
        outputs.push_back(out);
      }
      const auto reference = torch::stack(outputs).view({3, 40, D});
      (reference * upstream).sum().backward();
      CHECK(relative_difference(y.detach(), reference.detach()) < 1e-12);
      CHECK(relative_difference(input.grad(), ref_input.grad()) < 1e-12);
      CHECK(relative_difference(moe->gate->weight.grad(), gate.grad()) < 1e-12);
      CHECK(relative_difference(moe->experts->gate_up_proj.grad(), gate_up.grad()) < 1e-12);
      CHECK(relative_difference(moe->experts->down_proj.grad(), down.grad()) < 1e-12);
    }
}

TEST_CASE("the CPU router's row loops equal its ATen kernels: choices and weights and statistics and gradients", "[moe][dispatch]") {
  // RouterRows (moe.cpp, row_kernels.cpp) against the same layer routed by ATen kernels under
  // autograd (cpu_row_kernels_set(false)), on the same weights: the output, the load-balancing and
  // z terms and the score std, the expert counts exactly, and the gradients of a loss that uses
  // the output and both aux terms, and of one that uses the output only (no statistics asked for:
  // the node gets no gradient for them). Every score function, renormalization and bias; E = 8
  // (one row of the loops' 8 lanes) and E = 12 (a tail), without groups, in 4 groups of 2 keeping
  // 2, and in 3 groups of 4 keeping 2 and all 3; 300 tokens (three row blocks, the last partial)
  // with 37 padding tokens.
  CpuRowKernelsRestore restore;
  const int64_t D = 16;
  struct Routing {
    int64_t experts, groups, kept;
  };
  for (const auto dtype : {torch::kFloat64, torch::kFloat32})
    for (const std::string func : {"softmax", "sigmoid"})
      for (const bool normalize : {true, false})
        for (const bool bias : {true, false})
          for (const Routing routing : {Routing{8, 0, 0}, Routing{8, 4, 2}, Routing{12, 0, 0}, Routing{12, 3, 2},
                                        Routing{12, 3, 3}}) {
            INFO(c10::toString(dtype) << " " << func << " normalize " << normalize << " bias " << bias << " E "
                                      << routing.experts << " groups " << routing.groups << " keep " << routing.kept);
            std::vector<std::string> o = {"override_model_config=true", "base_emb_dim=16",
                                          "num_experts=" + std::to_string(routing.experts), "num_experts_per_tok=3",
                                          "base_moe_mlp_dim=12", "shared_experts=0", "routed_score_func=" + func,
                                          "routed_scaling_factor=2.5",
                                          std::string("routed_bias=") + (bias ? "true" : "false"),
                                          std::string("norm_topk_prob=") + (normalize ? "true" : "false")};
            if (routing.groups > 0)
              o.insert(o.end(), {"n_routing_groups=" + std::to_string(routing.groups),
                                 "topk_routing_group=" + std::to_string(routing.kept)});
            torch::manual_seed(21);
            Moe moe(tiny_config(o));
            moe->to(dtype);
            {
              torch::NoGradGuard no_grad;
              draw_weights(*moe, 0.2);
              moe->gate->weight.normal_(0.0, 0.5);
              moe->gate->e_score_correction_bias.normal_(0.0, 0.1);
            }
            const auto x = torch::randn({3, 100, D}, dtype);
            const auto upstream = torch::randn({3, 100, D}, dtype);
            auto valid = torch::ones({3, 100}, torch::kBool);
            valid[2].narrow(0, 63, 37).fill_(false);
            struct Run {
              torch::Tensor y, load_balance, router_z, counts, probs_std, dx, dgate, dgate_up, ddown;
            };
            const auto run = [&](bool row_kernels, bool statistics) {
              cpu_row_kernels_set(row_kernels);
              moe->zero_grad();
              BlockContext ctx;
              ctx.valid = valid;
              std::vector<MoeLayerStats> stats;
              if (statistics) ctx.moe_stats = &stats;
              const auto input = x.clone().requires_grad_(true);
              const auto y = moe->forward(input, ctx);
              auto loss = (y * upstream).sum();
              if (statistics) loss = loss + 0.7 * stats[0].load_balance + 0.3 * stats[0].router_z;
              loss.backward();
              Run r{y.detach(), {}, {}, {}, {}, input.grad(), moe->gate->weight.grad().clone(),
                    moe->experts->gate_up_proj.grad().clone(), moe->experts->down_proj.grad().clone()};
              if (statistics) {
                r.load_balance = stats[0].load_balance.detach();
                r.router_z = stats[0].router_z.detach();
                r.counts = stats[0].counts;
                r.probs_std = stats[0].probs_std.detach();
              }
              return r;
            };
            const double tolerance = dtype == torch::kFloat64 ? 1e-12 : 2e-6;
            const Run loops = run(true, true), aten = run(false, true);
            CHECK(torch::equal(loops.counts, aten.counts));
            CHECK(loops.counts.sum().item<double>() == 3 * 263);  // k per valid token
            CHECK(relative_difference(loops.y, aten.y) < tolerance);
            CHECK(relative_difference(loops.load_balance, aten.load_balance) < tolerance);
            CHECK(relative_difference(loops.router_z, aten.router_z) < tolerance);
            CHECK(relative_difference(loops.probs_std, aten.probs_std) < 10 * tolerance);
            CHECK(relative_difference(loops.dx, aten.dx) < 10 * tolerance);
            CHECK(relative_difference(loops.dgate, aten.dgate) < 10 * tolerance);
            CHECK(relative_difference(loops.dgate_up, aten.dgate_up) < tolerance);
            CHECK(relative_difference(loops.ddown, aten.ddown) < tolerance);
            const Run loops_plain = run(true, false), aten_plain = run(false, false);
            CHECK(relative_difference(loops_plain.y, loops.y) == 0);
            CHECK(relative_difference(loops_plain.dgate, aten_plain.dgate) < 10 * tolerance);
            CHECK(relative_difference(loops_plain.dx, aten_plain.dx) < 10 * tolerance);
            CHECK(relative_difference(loops_plain.dgate, loops.dgate) > 1e-6);  // the aux terms had a gradient
          }
}
