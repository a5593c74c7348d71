// The training step (DESIGN section 5) checked against independent computations in this file:
// objectives recomputed from the model's logits in float64, finite differences, and the
// invariances that gradient accumulation must keep.
#include <catch2/catch.hpp>

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>
#include <functional>
#include <regex>
#include <limits>
#include <filesystem>

#include "test_numerics.h"
#include "test_support.h"
#include "trainer/train/cross_entropy.h"
#include "trainer/train/memory_plan.h"
#include "trainer/util/torch_compat.h"
#include "trainer/train/train.h"

using namespace trainer;
using namespace trainer::testing;

namespace {

// Uneven synthetic data: valid lengths drawn in [0.2 L, L], so token counts differ per micro-batch.
std::vector<std::string> uneven(std::vector<std::string> extra = {}) {
  std::vector<std::string> o = {"synthetic_min_valid_fraction=0.2", "warmup_steps_fraction=0",
                                "learning_rate=0.01", "steps=3"};
  o.insert(o.end(), extra.begin(), extra.end());
  return o;
}

double weights_of(const MicroBatch& b) {
  double w = 0;
  for (float m : b.loss_mask) w += m;
  return w;
}

// Independent per-micro-batch terms from the model's logits, in float64, via log_softmax
// (the trainer uses logsumexp - gather). Returns {ce_sum, z_sum, w} for each micro-batch.
struct Terms {
  double ce, z, w;
};
std::vector<Terms> reference_terms(Trainer& t, int64_t step, Transformer model) {
  std::vector<Terms> out;
  torch::NoGradGuard no_grad;
  const Config& c = t.config();
  for (int64_t m = 0; m < c.gradient_accumulation_steps; ++m) {
    const MicroBatch b = t.data().data_loader_next(step, m);
    const auto shape = std::vector<int64_t>{b.batch_size, b.seq_len};
    auto tensor = [&](const std::vector<int64_t>& v) { return torch::tensor(v).view(shape); };
    const auto logits = model->forward(tensor(b.inputs), tensor(b.positions), tensor(b.segment_ids)).logits.to(torch::kFloat64);
    const auto targets = tensor(b.targets);
    const auto mask = torch::tensor(b.loss_mask).view(shape).to(torch::kFloat64);
    const auto logp = torch::log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1);
    const auto lse = torch::logsumexp(logits, -1);
    const double z = (c.z_loss_multiplier * lse.square() * mask).sum().item<double>();
    out.push_back({(-logp * mask).sum().item<double>() + z, z, mask.sum().item<double>()});
  }
  return out;
}

double per_token_objective(const std::vector<Terms>& terms) {
  double ce = 0, w = 0;
  for (const auto& t : terms) ce += t.ce, w += t.w;
  return ce / w;
}

double megatron_objective(const std::vector<Terms>& terms) {
  double sum = 0;
  for (const auto& t : terms) sum += t.ce / std::max(t.w, 1.0);
  return sum / static_cast<double>(terms.size());
}

double metric(Trainer& t, const StepOutput& out, const std::string& name) {
  return metric_get(t.read_metrics(out), name);
}

}  // namespace

TEST_CASE("per-token mode: (K=4, b=1) equals (K=1, b=4) on uneven data, through 3 updates", "[training]") {
  // adam_eps 1e-5 instead of 1e-8: AdamW divides m by sqrt(v) + eps, so with eps 1e-8 a weight
  // whose gradient is rounding noise (~1e-9, a near-cancelling sum taken in another order at
  // another batch shape) moves by up to lr either way, and the weight comparison below measures
  // that noise (seen: > 1e-5 with LibTorch 2.6 after the fused q/k/v GEMM). With 1e-5 such weights
  // stay put, while gradients well above 1e-5 are updated almost as with 1e-8.
  Trainer k4(tiny_config(uneven({"gradient_accumulation_steps=4", "per_device_batch_size=1", "z_loss_multiplier=1e-3",
                                 "adam_eps=1e-5"})));
  Trainer k1(tiny_config(uneven({"gradient_accumulation_steps=1", "per_device_batch_size=4", "z_loss_multiplier=1e-3",
                                 "adam_eps=1e-5"})));
  // The data really is uneven: micro-batch token counts differ.
  std::vector<double> w;
  for (int m = 0; m < 4; ++m) w.push_back(weights_of(k4.data().data_loader_next(0, m)));
  CHECK(*std::max_element(w.begin(), w.end()) - *std::min_element(w.begin(), w.end()) >= 4);

  auto a = k4.forward_backward(0), b = k1.forward_backward(0);
  CHECK(a.sample_indices == b.sample_indices);
  CHECK(a.total_weights == b.total_weights);
  CHECK(metric(k4, a, "learning/loss") == Approx(metric(k1, b, "learning/loss")).epsilon(1e-6));
  CHECK(metric(k4, a, "learning/lm_loss") == Approx(metric(k1, b, "learning/lm_loss")).epsilon(1e-6));
  CHECK(metric(k4, a, "learning/z_loss") == Approx(metric(k1, b, "learning/z_loss")).epsilon(1e-6));
  CHECK(torch::allclose(k4.flat_grads(), k1.flat_grads(), 1e-5, 1e-7));
  CHECK(k4.flat_grads().abs().max().item<double>() > 1e-3);  // non-trivial gradients

  k4.optimizer_update(a);
  k1.optimizer_update(b);
  for (int step = 1; step < 3; ++step) {
    k4.train_step(step);
    k1.train_step(step);
  }
  CHECK(k4.updates_applied() == 3);
  // The exact checks are the loss and gradient checks above; the weights agree to 1e-5.
  CHECK(torch::allclose(k4.flat_params(), k1.flat_params(), 1e-5, 1e-5));
  // And the updates moved the weights (so the comparison above is not vacuous).
  Trainer fresh(tiny_config(uneven()));
  CHECK((fresh.flat_params() - k1.flat_params()).abs().max().item<double>() > 1e-3);
}

TEST_CASE("Megatron mode: lm_loss is the mean of per-micro-batch means and differs from per-token", "[training]") {
  const auto opts = uneven({"gradient_accumulation_steps=4", "per_device_batch_size=2"});
  auto megatron_opts = opts;
  megatron_opts.push_back("calculate_per_token_loss=false");
  Trainer meg(tiny_config(megatron_opts)), tok(tiny_config(opts));
  auto m = meg.forward_backward(0), t = tok.forward_backward(0);
  const auto terms = reference_terms(meg, 0, float64_copy(meg));
  CHECK(metric(meg, m, "learning/lm_loss") == Approx(megatron_objective(terms)).epsilon(1e-5));
  CHECK(metric(tok, t, "learning/lm_loss") == Approx(per_token_objective(terms)).epsilon(1e-5));
  CHECK(std::abs(megatron_objective(terms) - per_token_objective(terms)) > 1e-3);
  CHECK(std::abs(metric(meg, m, "learning/lm_loss") - metric(tok, t, "learning/lm_loss")) > 1e-3);
  CHECK_FALSE(torch::allclose(meg.flat_grads(), tok.flat_grads(), 1e-4, 1e-6));
  // What Megatron-LM logs as `lm loss` is the token-weighted mean in both modes (its loss_func
  // returns (sum, count) pairs reduced sum/sum): megatron/lm_loss is that, in either mode.
  CHECK(metric(meg, m, "megatron/lm_loss") == Approx(per_token_objective(terms)).epsilon(1e-5));
  CHECK(metric(tok, t, "megatron/lm_loss") == Approx(per_token_objective(terms)).epsilon(1e-5));
}

TEST_CASE("K=1: both modes give the same loss and gradient", "[training]") {
  Trainer meg(tiny_config(uneven({"per_device_batch_size=3", "calculate_per_token_loss=false"})));
  Trainer tok(tiny_config(uneven({"per_device_batch_size=3"})));
  auto m = meg.forward_backward(0), t = tok.forward_backward(0);
  CHECK(metric(meg, m, "learning/loss") == Approx(metric(tok, t, "learning/loss")).epsilon(1e-6));
  INFO("max abs diff " << (meg.flat_grads() - tok.flat_grads()).abs().max().item<double>()
                        << ", max abs " << tok.flat_grads().abs().max().item<double>());
  CHECK(torch::allclose(meg.flat_grads(), tok.flat_grads(), 1e-5, 1e-7));
}

TEST_CASE("the logged loss is the objective, recomputed independently", "[training]") {
  for (const std::string tiling : {"1", "3"})
  for (const std::string mode : {"true", "false"}) {
    Trainer t(tiny_config(uneven({"gradient_accumulation_steps=3", "per_device_batch_size=2", "num_vocab_tiling=" + tiling,
                                  "z_loss_multiplier=1e-2", "calculate_per_token_loss=" + mode})));
    auto out = t.forward_backward(0);
    const auto terms = reference_terms(t, 0, float64_copy(t));
    const double expected = mode == "true" ? per_token_objective(terms) : megatron_objective(terms);
    INFO("calculate_per_token_loss=" << mode << " num_vocab_tiling=" << tiling);
    CHECK(metric(t, out, "learning/loss") == Approx(expected).epsilon(1e-5));
    CHECK(metric(t, out, "learning/loss") == metric(t, out, "learning/lm_loss"));  // no aux losses
    double z = 0, w = 0;
    for (const auto& term : terms) z += mode == "true" ? term.z : term.z / term.w, w += term.w;
    CHECK(metric(t, out, "learning/z_loss") == Approx(mode == "true" ? z / w : z / 3).epsilon(1e-4));
    CHECK(metric(t, out, "learning/total_weights") == w);
  }
}

TEST_CASE("gradient check: trainer gradients match finite differences of the objective", "[training]") {
  for (const std::string tiling : {"1", "3"})
  for (const std::string mode : {"true", "false"}) {
    Trainer t(tiny_config(uneven({"gradient_accumulation_steps=2", "per_device_batch_size=2", "num_vocab_tiling=" + tiling,
                                  "z_loss_multiplier=1e-2", "calculate_per_token_loss=" + mode})));
    t.forward_backward(0);
    auto model64 = float64_copy(t);
    auto objective = [&] {
      const auto terms = reference_terms(t, 0, model64);
      return mode == "true" ? per_token_objective(terms) : megatron_objective(terms);
    };
    auto params64 = model64->named_parameters();
    auto params32 = t.model()->named_parameters();
    for (const std::string name : {"model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight",
                                   "model.norm.weight", "lm_head.weight"}) {
      for (int64_t index : {0, 7}) {
        const double numeric = central_difference(params64[name], index, objective);
        const double analytic = params32[name].grad().view(-1)[index].item<double>();
        INFO(name << "[" << index << "] mode per_token=" << mode << " num_vocab_tiling=" << tiling << " numeric " << numeric
                  << " analytic " << analytic);
        CHECK(analytic == Approx(numeric).epsilon(2e-3).margin(1e-7));
      }
    }
  }
}

TEST_CASE("cross-entropy sums, whole and tiled: sums and gradients equal autograd on log_softmax for any tiling", "[training][numerics]") {
  torch::manual_seed(3);
  const int64_t B = 2, L = 7, D = 8, V = 11;
  const auto f64 = torch::TensorOptions().dtype(torch::kFloat64);
  const auto hidden0 = torch::randn({B, L, D}, f64), weight0 = torch::randn({V, D}, f64) * 0.5;
  const auto targets = torch::randint(V, {B, L}, torch::kInt64);
  auto token_weights = (torch::rand({B, L}, f64) > 0.3).to(torch::kFloat64);
  token_weights[1][3] = 0;  // at least one masked token
  for (const double z : {0.0, 1e-2}) {
    // The reference: the (B, L, V) logits whole, log_softmax, autograd, an objective 2.5 ce.
    const auto h_ref = hidden0.clone().requires_grad_(), w_ref = weight0.clone().requires_grad_();
    const auto logits = torch::matmul(h_ref, w_ref.t());
    const auto lse = torch::logsumexp(logits, -1);
    const auto nll = -torch::log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1);
    const auto ce_ref = ((nll + z * lse.square()) * token_weights).sum();
    (2.5 * ce_ref).backward();
    const double z_ref = (z * lse.square() * token_weights).sum().item<double>();
    // One path (sums from the head's input and weight) against the reference: sums, gradients,
    // and the sums again without gradients (evaluation).
    const auto check_path = [&](const std::function<CrossEntropySums(const torch::Tensor&, const torch::Tensor&)>& sums_of) {
      const auto h = hidden0.clone().requires_grad_(), w = weight0.clone().requires_grad_();
      const auto sums = sums_of(h, w);
      CHECK(sums.ce.item<double>() == Approx(ce_ref.item<double>()).epsilon(1e-12));
      CHECK(sums.z.item<double>() == Approx(z_ref).epsilon(1e-12).margin(1e-15));
      CHECK_FALSE(sums.z.requires_grad());
      (2.5 * sums.ce).backward();
      CHECK(torch::allclose(h.grad(), h_ref.grad(), 1e-10, 1e-12));
      CHECK(torch::allclose(w.grad(), w_ref.grad(), 1e-10, 1e-12));
      // Its kept gradient is freed by the backward: a second one is an error (ours, or LibTorch's
      // for its own cross_entropy), not a zero gradient.
      CHECK_THROWS_WITH((2.5 * sums.ce).backward(),
                        Catch::Contains("backward ran twice") || Catch::Contains("backward through the graph a second time"));
      torch::NoGradGuard no_grad;
      CHECK(sums_of(h, w).ce.item<double>() == Approx(ce_ref.item<double>()).epsilon(1e-12));
    };
    {  // The whole head from its logits (with z-loss LogitsCrossEntropy, without LibTorch's cross_entropy).
      INFO("z " << z << " whole logits");
      check_path([&](const torch::Tensor& h, const torch::Tensor& w) {
        return cross_entropy_sums(torch::matmul(h, w.t()), targets, token_weights, z);
      });
    }
    for (const int64_t tiles : {1, 3, 5, 14, 40}) {  // 14 = one row per tile; 40 > rows
      INFO("z " << z << " tiles " << tiles);
      check_path([&](const torch::Tensor& h, const torch::Tensor& w) {
        return cross_entropy_sums_tiled(h, w, targets, token_weights, z, tiles, /*bf16_compute=*/false);
      });
    }
  }
  // bf16 compute: the GEMMs as autocast runs them (logits rounded to bf16). Against the fp32
  // reference: within bf16 rounding, and far from it if the tiles ran in fp32 (checked above).
  const auto h32 = hidden0.to(torch::kFloat32), w32 = weight0.to(torch::kFloat32);
  torch::Tensor logits_autocast;
  {
    compat::AutocastGuard autocast(true, false);
    logits_autocast = torch::nn::functional::linear(h32, w32).to(torch::kFloat32);
  }
  const auto ce_autocast = cross_entropy_sums(logits_autocast, targets, token_weights.to(torch::kFloat32), 0.0).ce;
  const auto bf16 = cross_entropy_sums_tiled(h32, w32, targets, token_weights.to(torch::kFloat32), 0.0, 3, true).ce;
  CHECK(bf16.scalar_type() == torch::kFloat32);
  CHECK(bf16.item<double>() == Approx(ce_autocast.item<double>()).epsilon(1e-5));
}

TEST_CASE("num_vocab_tiling: training equals the whole head's with MTP and a tied head and memory falls", "[training][cli]") {
  // Step 1 of each pair: same weights, same data, so every metric agrees but for summation order.
  const auto first_step = [](const std::string& args) {
    const auto r = run_trainer(args);
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    const std::string run = args.substr(args.find("run_name=") + 9, args.find(' ', args.find("run_name=")) - args.find("run_name=") - 9);
    return read_lines(test_root() + "/" + run + "/metrics.jsonl").at(0);
  };
  int pair = 0;
  for (const std::string model : {"test-tiny logits_via_embedding=true", "ling2-tiny"})
    for (const std::string mode : {"true", "false"}) {
      const std::string id = std::to_string(++pair);
      const std::string common = "model_name=" + model + " max_target_length=32 steps=1 gradient_accumulation_steps=2 "
                                 "synthetic_min_valid_fraction=0.3 eod_id=1 z_loss_multiplier=1e-3 "
                                 "calculate_per_token_loss=" + mode + " base_output_directory=" + test_root() + " ";
      const auto whole = first_step(common + "run_name=vt-whole" + id),
                 tiled = first_step(common + "run_name=vt-tiled" + id + " num_vocab_tiling=5");
      INFO(model << " per_token=" << mode);
      for (const char* name : {"learning/loss", "learning/lm_loss", "learning/z_loss", "learning/raw_grad_norm",
                               "learning/param_norm", "learning/mtp_loss"})
        CHECK(json_metric(tiled, name) == Approx(json_metric(whole, name)).epsilon(1e-6));
    }
  // A 32K vocabulary over 1024 tokens: the whole head holds (T, V) fp32 tensors of 128 MiB (the
  // logits, their log-probabilities and gradients); 16 tiles hold 8 MiB ones.
  const std::string big = "model_name=test-tiny override_model_config=true vocab_size=32768 max_target_length=256 per_device_batch_size=4 steps=1 "
                          "host_huge_pages=false base_output_directory=" + test_root() + " ";
  const double whole = json_metric(first_step(big + "run_name=vt-big-whole"), "memory/peak_rss_bytes");
  const double tiled = json_metric(first_step(big + "run_name=vt-big-tiled num_vocab_tiling=16"), "memory/peak_rss_bytes");
  INFO("peak RSS whole " << whole / (1 << 20) << " MiB, tiled " << tiled / (1 << 20) << " MiB");
  CHECK(whole - tiled > 192.0 * (1 << 20));  // measured: 310 MiB less (604 -> 294 MiB)
  // The memory plan counts it too.
  const auto planned = [](const std::string& tiling) {
    const auto plan = memory_plan(tiny_config({"override_model_config=true", "vocab_size=32768", "max_target_length=256", "per_device_batch_size=4",
                                               "num_vocab_tiling=" + tiling}), {});
    return plan.activation_bytes;
  };
  CHECK(planned("1") - planned("16") > 100.0 * (1 << 20));
}

TEST_CASE("gradients accumulate in place in the flat buffer", "[training]") {
  Trainer t(tiny_config(uneven({"gradient_accumulation_steps=3"})));
  const auto* base = t.flat_grads().data_ptr<float>();
  const auto* pbase = t.flat_params().data_ptr<float>();
  t.forward_backward(0);
  int64_t offset = 0;
  for (const auto& p : t.model()->parameters()) {
    CHECK(p.grad().data_ptr<float>() == base + offset);
    CHECK(p.data_ptr<float>() == pbase + offset);
    offset += p.numel();
  }
  CHECK(offset == t.flat_grads().numel());
  CHECK(t.flat_grads().data_ptr<float>() == base);  // never reallocated
}

TEST_CASE("num_zeros counts exact zeros over every gradient, and NaN/Inf flags", "[training]") {
  Trainer t(tiny_config(uneven({"per_device_batch_size=1"})));
  auto out = t.forward_backward(0);
  int64_t zeros = 0;
  for (const auto& p : t.model()->parameters()) zeros += (p.grad() == 0).sum().item<int64_t>();
  CHECK(zeros > 0);  // embedding rows of tokens absent from the batch
  CHECK(metric(t, out, "learning/num_zeros") == static_cast<double>(zeros));
  CHECK(metric(t, out, "learning/is_nan") == 0);
  CHECK(metric(t, out, "learning/is_inf") == 0);

  for (const std::string kind : {"loss_nan", "loss_inf", "grad_nan", "grad_inf"}) {
    Trainer bad(tiny_config(uneven({"debug_inject_nonfinite_step=1", "debug_inject_nonfinite_kind=" + kind})));
    auto ok = bad.forward_backward(0);
    CHECK(metric(bad, ok, "learning/is_nan") == 0);
    auto hit = bad.forward_backward(1);
    const auto values = bad.read_metrics(hit);
    INFO(kind);
    const bool nan = kind.find("nan") != std::string::npos;
    CHECK(metric_get(values, "learning/is_nan") == (nan ? 1 : 0));
    CHECK(metric_get(values, "learning/is_inf") == (nan ? 0 : 1));
    if (kind.rfind("grad_", 0) == 0) CHECK(std::isfinite(metric_get(values, "learning/loss")));
  }
}

TEST_CASE("end to end: NaN aborts with exit 4 naming step and samples, and the spike guard skips it", "[training][cli]") {
  const std::string common = "model_name=test-tiny max_target_length=16 per_device_batch_size=2 steps=5 "
                             "base_output_directory=" + test_root() + " debug_inject_nonfinite_step=2 ";
  std::filesystem::remove_all(test_root() + "/nan-abort");
  std::filesystem::remove_all(test_root() + "/nan-skip");
  auto r = run_trainer(common + "run_name=nan-abort debug_inject_nonfinite_kind=grad_nan");
  CHECK(r.exit_code == 4);
  CHECK_THAT(r.output, Catch::Contains("step 2") && Catch::Contains("NaN") && Catch::Contains("4-5"));

  r = run_trainer(common + "run_name=nan-skip abort_on_nan_loss=false skip_step_on_spikes=true");
  REQUIRE(r.exit_code == 0);
  const auto lines = read_lines(test_root() + "/nan-skip/metrics.jsonl");
  REQUIRE(lines.size() == 5);
  for (int step = 0; step < 5; ++step) {
    INFO("step " << step);
    CHECK(json_metric(lines[step], "step") == step);
    CHECK(json_metric(lines[step], "learning/is_nan") == (step == 2 ? 1 : 0));
    CHECK(json_metric(lines[step], "optim/step_skipped") == (step == 2 ? 1 : 0));
    CHECK(std::isfinite(json_metric(lines[step], "learning/param_norm")));
  }
  // The schedule froze on the skipped step: step 3 uses the learning rate step 2 would have used.
  CHECK(json_metric(lines[3], "learning/current_learning_rate") ==
        json_metric(lines[2], "learning/current_learning_rate"));
}

TEST_CASE("W = 0: zero gradient, skipped update, never NaN", "[training]") {
  // With L = 16 and valid lengths drawn in [1, 16], a one-token sample (no target) is common;
  // find a step whose only sample has no target token.
  Trainer single(tiny_config(uneven({"synthetic_min_valid_fraction=0.0625", "per_device_batch_size=1"})));
  int64_t step = 0;
  for (; step < 500; ++step)
    if (weights_of(single.data().data_loader_next(step, 0)) == 0) break;
  REQUIRE(step < 500);
  for (const std::string mode : {"true", "false"}) {
    Trainer z(tiny_config(uneven({"synthetic_min_valid_fraction=0.0625", "per_device_batch_size=1",
                                  "calculate_per_token_loss=" + mode})));
    const auto before = z.flat_params().clone();
    auto out = z.train_step(step);
    const auto values = z.read_metrics(out);
    INFO("per_token=" << mode);
    CHECK(metric_get(values, "learning/total_weights") == 0);
    CHECK(metric_get(values, "learning/loss") == 0);
    CHECK(metric_get(values, "learning/is_nan") == 0);
    CHECK(metric_get(values, "optim/step_skipped") == 1);
    CHECK(z.flat_grads().abs().max().item<double>() == 0);
    CHECK(torch::equal(before, z.flat_params()));
  }
  // A MoE model: its load-balancing term counts the step's tokens, not its targets. Per-token mode
  // weights it by w_i = 0 (all zero, as above); Megatron mode's J keeps it unweighted, so the loss
  // is that term and its gradient is not zero, and the update is skipped all the same.
  const auto moe = [&](const std::string& mode) {
    return tiny_config(uneven({"model_name=moe-tiny", "max_target_length=16", "synthetic_min_valid_fraction=0.0625",
                               "per_device_batch_size=1", "load_balance_loss_weight=0.01", "calculate_per_token_loss=" + mode}));
  };
  Trainer search(moe("true"));
  for (step = 0; step < 500; ++step)
    if (weights_of(search.data().data_loader_next(step, 0)) == 0) break;
  REQUIRE(step < 500);
  for (const std::string mode : {"true", "false"}) {
    Trainer z(moe(mode));
    const auto before = z.flat_params().clone();
    const auto values = z.read_metrics(z.train_step(step));
    INFO("MoE, per_token=" << mode);
    CHECK(metric_get(values, "learning/total_weights") == 0);
    CHECK(metric_get(values, "learning/lm_loss") == 0);
    CHECK(metric_get(values, "optim/step_skipped") == 1);
    CHECK(torch::equal(before, z.flat_params()));
    if (mode == "true") {
      CHECK(metric_get(values, "learning/loss") == 0);
      CHECK(z.flat_grads().abs().max().item<double>() == 0);
    } else {
      CHECK(metric_get(values, "learning/moe_lb_loss") > 0);
      CHECK(metric_get(values, "learning/loss") == metric_get(values, "learning/moe_lb_loss"));
      CHECK(z.flat_grads().abs().max().item<double>() > 0);
    }
  }
}

TEST_CASE("bf16 compute: weights and gradients stay fp32, loss close to fp32", "[training]") {
  Trainer bf(tiny_config(uneven({"dtype=bfloat16"}))), fp(tiny_config(uneven()));
  auto b = bf.forward_backward(0), f = fp.forward_backward(0);
  CHECK(bf.flat_grads().scalar_type() == torch::kFloat32);
  CHECK(bf.model()->parameters()[0].grad().scalar_type() == torch::kFloat32);
  CHECK(metric(bf, b, "learning/loss") == Approx(metric(fp, f, "learning/loss")).epsilon(2e-2));
  CHECK(metric(bf, b, "learning/loss") != metric(fp, f, "learning/loss"));  // bf16 really ran
  // The gradient under bf16 autocast against fp32, as a bound: every matmul rounds its inputs to
  // bf16 (unit roundoff 2^-9 = 2e-3) and accumulates in fp32, a few matmuls deep on each path, so
  // the gradient's relative error is a small multiple of 2e-3 (measured 3.4e-3, cosine 0.999996).
  // On a CPU without AVX-512, LibTorch 1.13 sums bf16 products in bf16 (1.18e-2, cosine 0.99993
  // on an AVX2 AMD EPYC); the trainer computes them as fp32 GEMMs there (compat::
  // cpu_bf16_gemm_via_fp32), so the bound below is the same on every CPU.
  const double relative = (bf.flat_grads() - fp.flat_grads()).norm().item<double>() / fp.flat_grads().norm().item<double>();
  const double cosine = (bf.flat_grads() * fp.flat_grads()).sum().item<double>() /
                        (bf.flat_grads().norm() * fp.flat_grads().norm()).item<double>();
  INFO("relative gradient difference bf16 vs fp32: " << relative << ", cosine " << cosine);
  CHECK(relative > 0);
  CHECK(relative < 0.01);
  CHECK(cosine > 0.9999);
}

TEST_CASE("end to end: the default-shaped run learns and writes every metric each step", "[training][cli]") {
  std::filesystem::remove_all(test_root() + "/learn");
  auto r = run_trainer("model_name=test-tiny max_target_length=32 steps=60 learning_rate=0.01 log_period=20 "
                       "base_output_directory=" + test_root() + " run_name=learn gradient_accumulation_steps=2");
  REQUIRE(r.exit_code == 0);
  CHECK_THAT(r.output, Catch::Contains("completed step: 20"));
  const auto lines = read_lines(test_root() + "/learn/metrics.jsonl");
  REQUIRE(lines.size() == 60);
  for (const char* name : {"learning/loss", "learning/lm_loss", "learning/moe_lb_loss", "learning/mtp_loss",
                           "learning/z_loss", "learning/total_weights", "learning/grad_norm",
                           "learning/raw_grad_norm", "learning/param_norm", "learning/num_zeros",
                           "learning/is_nan", "learning/is_inf", "learning/current_learning_rate",
                           "optim/step_skipped", "perf/step_time_seconds", "perf/per_device_tokens_per_sec",
                           "perf/per_device_tflops_per_sec", "perf/per_device_tokens", "perf/per_device_tflops",
                           "learning/perplexity"})
    CHECK_NOTHROW(json_metric(lines.back(), name));
  // MaxText's definitions: exp(lm_loss); B x K x L tokens per device; the step's TFLOPs, which over
  // the step time is the rate.
  const auto& last = lines.back();
  CHECK(json_metric(last, "learning/perplexity") == Approx(std::exp(json_metric(last, "learning/lm_loss"))).epsilon(1e-12));
  CHECK(json_metric(last, "perf/per_device_tokens") == 8 * 2 * 32);  // base.yml: 8 sequences per micro-batch
  CHECK(json_metric(last, "perf/per_device_tflops") / json_metric(last, "perf/step_time_seconds") ==
        Approx(json_metric(last, "perf/per_device_tflops_per_sec")).epsilon(1e-9));
  CHECK(json_metric(lines.back(), "learning/loss") < json_metric(lines.front(), "learning/loss") - 1.0);
  CHECK(std::filesystem::exists(test_root() + "/learn/config.yml"));
}

namespace {
// Float64 norm and zero count of a contiguous fp32 buffer by a plain loop: the reference.
std::pair<double, int64_t> reference_norm_and_zeros(const torch::Tensor& flat) {
  const float* x = flat.data_ptr<float>();
  double sum = 0;
  int64_t zeros = 0;
  for (int64_t i = 0; i < flat.numel(); ++i) {
    sum += static_cast<double>(x[i]) * static_cast<double>(x[i]);
    zeros += x[i] == 0.0f;
  }
  return {std::sqrt(sum), zeros};
}
}  // namespace

TEST_CASE("flat-buffer norm and zero count agree with float64 on 24M elements", "[training][numerics]") {
  // Mixed magnitudes, as a gradient has (embedding rows near 0, a few large entries): LibTorch
  // 1.13's fp32 norm() of this buffer is ~5e-4 low; the requirement is 1e-6.
  const int64_t n = 24 * 1000 * 1000 + 37;  // not a multiple of the row length: the tail counts
  auto generator = at::make_generator<at::CPUGeneratorImpl>(7);
  auto flat = torch::randn({n}, generator, torch::kFloat32).mul_(1e-2);
  flat.narrow(0, 0, n / 3).mul_(1e-3);
  flat.slice(0, 5, n, 9973).mul_(300.0);
  flat.slice(0, 11, n, 4099).zero_();
  flat[n - 1] = 0.0f;
  flat[n - 2] = -0.0f;  // counts as zero, as eq(0) does
  const auto [norm, zeros] = reference_norm_and_zeros(flat);
  REQUIRE(zeros > 5000);
  INFO("fp32 norm() relative error " << (flat.norm().item<double>() - norm) / norm);
  CHECK(std::abs(flat_buffer_norm(flat).item<double>() - norm) <= 1e-6 * norm);
  CHECK(flat_buffer_norm(flat).scalar_type() == torch::kFloat64);
  CHECK(flat_buffer_count_zeros(flat).item<int64_t>() == zeros);
  // Non-finite values propagate (the NaN/Inf flags depend on it) and NaN is not a zero.
  flat[3] = std::numeric_limits<float>::infinity();
  CHECK(std::isinf(flat_buffer_norm(flat).item<double>()));
  flat[3] = std::numeric_limits<float>::quiet_NaN();
  CHECK(std::isnan(flat_buffer_norm(flat).item<double>()));
  CHECK(flat_buffer_count_zeros(flat).item<int64_t>() == zeros);
  // Shorter than one row: only the tail path.
  auto small = torch::tensor({3.0f, 0.0f, 4.0f});
  CHECK(flat_buffer_norm(small).item<double>() == 5.0);
  CHECK(flat_buffer_count_zeros(small).item<int64_t>() == 1);
}

TEST_CASE("expert-parallel norm and zero count: dense runs plus the group's expert runs, Inf stays Inf", "[training][numerics]") {
  // One process: the group's expert part is this rank's, so the result must equal the plain
  // reductions over the whole buffer, through a no-op group and through a one-rank Gloo group.
  DistOptions gloo;
  gloo.backend = "gloo";
  for (const auto& options : {DistOptions{}, gloo}) {
    auto group = dist_init(DistEnv{}, options);
    auto flat = torch::randn({5000}, torch::kFloat32);
    flat.slice(0, 0, 5000, 7).zero_();
    const std::vector<std::pair<int64_t, int64_t>> segments = {{0, 300}, {1100, 2048}, {4000, 1000}};  // to the end
    const double norm = flat.to(torch::kFloat64).norm().item<double>();
    CHECK(std::abs(flat_buffer_norm_expert_parallel(flat, segments, *group).item<double>() - norm) <= 1e-6 * norm);  // fp32 rows (~1e-8)
    CHECK(flat_buffer_count_zeros_expert_parallel(flat, segments, *group).item<int64_t>() == flat.eq(0).sum().item<int64_t>());
    // An Inf in an expert run is Inf, as on the ranks that only receive it through the group sum
    // (total minus experts made it Inf - Inf = NaN on the rank holding it); NaN stays NaN.
    flat[1500] = std::numeric_limits<float>::infinity();
    CHECK(std::isinf(flat_buffer_norm_expert_parallel(flat, segments, *group).item<double>()));
    flat[2000] = -std::numeric_limits<float>::infinity();
    CHECK(std::isinf(flat_buffer_norm_expert_parallel(flat, segments, *group).item<double>()));
    flat[500] = std::numeric_limits<float>::quiet_NaN();
    CHECK(std::isnan(flat_buffer_norm_expert_parallel(flat, segments, *group).item<double>()));
  }
}

TEST_CASE("reported gradient and parameter norms are the float64 norms, and clipping honours them", "[training][numerics]") {
  // The default model (0.46M parameters), where LibTorch 1.13's fp32 norm() was 1e-5 low.
  const auto options = uneven({"model_name=default", "max_target_length=64", "per_device_batch_size=4"});
  Trainer t(tiny_config(options));
  auto out = t.forward_backward(0);
  REQUIRE(t.flat_grads().numel() > 400000);
  const auto [grad_norm, grad_zeros] = reference_norm_and_zeros(t.flat_grads());
  const auto values = t.read_metrics(out);
  CHECK(std::abs(metric_get(values, "learning/raw_grad_norm") - grad_norm) <= 1e-6 * grad_norm);
  CHECK(metric_get(values, "learning/num_zeros") == static_cast<double>(grad_zeros));
  t.optimizer_update(out);
  const auto [param_norm, param_zeros] = reference_norm_and_zeros(t.flat_params());
  CHECK(std::abs(metric_get(t.read_metrics(out), "learning/param_norm") - param_norm) <= 1e-6 * param_norm);

  // Clipping to half the norm leaves a gradient whose float64 norm is the threshold.
  auto clip_options = options;
  clip_options.push_back("gradient_clipping_threshold=" + std::to_string(grad_norm / 2));
  const double threshold = std::stod(std::to_string(grad_norm / 2));
  Trainer clipped(tiny_config(clip_options));
  auto c = clipped.forward_backward(0);
  clipped.optimizer_update(c);
  CHECK(std::abs(reference_norm_and_zeros(clipped.flat_grads()).first - threshold) <= 1e-6 * threshold);
  CHECK(metric(clipped, c, "learning/grad_norm") == Approx(threshold).epsilon(1e-12));
}

TEST_CASE("log_num_zeros_in_grad=false leaves learning/num_zeros out", "[training]") {
  Trainer t(tiny_config(uneven({"log_num_zeros_in_grad=false"})));
  auto out = t.forward_backward(0);
  CHECK_FALSE(out.num_zeros.defined());
  const auto values = t.read_metrics(out);
  CHECK_THROWS(metric_get(values, "learning/num_zeros"));
  CHECK(std::isfinite(metric_get(values, "learning/raw_grad_norm")));
}

namespace {
double plan_item(const MemoryPlan& plan, const std::string& prefix) {
  for (const auto& item : plan.items)
    if (item.name.rfind(prefix, 0) == 0) return item.bytes;
  throw std::runtime_error("no plan item " + prefix);
}
}  // namespace

TEST_CASE("memory plan: model state is exactly what the trainer allocates, sharded by ZeRO-1", "[training][memory]") {
  const Config c = tiny_config({"model_name=moe-tiny", "mtp_num_layers=1"});
  Trainer t(c);
  const double P = static_cast<double>(t.flat_params().numel());  // what was really allocated
  const MemoryPlan plan = memory_plan(c, {});
  CHECK(plan_item(plan, "weights") == 4 * P);
  CHECK(plan_item(plan, "gradients") == 4 * P);
  CHECK(plan_item(plan, "optimizer") == 8 * P);  // m and v: the one-pass CPU update needs no workspace
  CHECK(plan.model_state_bytes == 16 * P);
  double sum = 0;
  for (const auto& item : plan.items) sum += item.bytes;
  CHECK(plan.total_bytes == sum);
  // ZeRO-1 over 4 ranks: a quarter of the optimizer state (rounded up); the weights arena is padded
  // to 4 equal chunks and gathered in place, so there is no parameter-sized gather buffer.
  Config zero = c;
  zero.data_parallel_sharding = "optim";
  const MemoryPlan sharded = memory_plan(zero, {4, 1, false});
  CHECK(plan_item(sharded, "optimizer") == 8 * std::ceil(P / 4));
  CHECK(plan_item(sharded, "weights") == 4 * 4 * std::ceil(P / 4));
  CHECK(sharded.model_state_bytes == 4 * 4 * std::ceil(P / 4) + 4 * P + 8 * std::ceil(P / 4));
  // On a GPU the same optimizer state, and there is no host runtime line.
  const MemoryPlan gpu = memory_plan(c, {1, 1, true});
  CHECK(plan_item(gpu, "optimizer") == 8 * P);
  CHECK_THROWS(plan_item(gpu, "runtime"));
}

TEST_CASE("sharded levels at one rank: the shard is the arena in unit order, training equals plain training",
          "[training][sharding]") {
  const std::vector<std::string> base = {"model_name=moe-tiny", "override_model_config=true", "mtp_num_layers=1", "load_balance_loss_weight=0.1",
                                         "gradient_accumulation_steps=2", "per_device_batch_size=1", "adam_eps=0.01", "learning_rate=0.01",
                                         "warmup_steps_fraction=0"};
  Trainer plain(tiny_config(base));
  const int64_t P = plain.flat_params().numel();
  const auto initial = plain.flat_params().clone();
  auto plain_out = plain.forward_backward(0);
  const auto plain_grads = plain.flat_grads().clone();
  REQUIRE(plain_grads.abs().max().item<double>() > 1e-3);
  plain.optimizer_update(plain_out);
  for (int step = 1; step < 3; ++step) plain.train_step(step);
  REQUIRE((plain.flat_params() - initial).abs().max().item<double>() > 1e-4);  // the weights moved

  for (const auto& level : std::vector<std::vector<std::string>>{{"data_parallel_sharding=optim_grads"},
                                                                  {"data_parallel_sharding=optim_grads", "remat_policy=minimal"},
                                                                  {"data_parallel_sharding=optim_grads_params", "remat_policy=full"},
                                                                  {"data_parallel_sharding=optim_grads_params", "remat_policy=full",
                                                                   "num_vocab_tiling=3"}}) {
    auto overrides = base;
    overrides.insert(overrides.end(), level.begin(), level.end());
    const bool tiled = level.size() > 2;  // the head's weight gathered with the outer units, its gradient from the tiled loss
    INFO(level[0] << " " << (level.size() > 1 ? level[1] : "") << (tiled ? " num_vocab_tiling=3" : ""));
    Trainer t(tiny_config(overrides));
    const ShardedModelState* state = t.sharded_state();
    REQUIRE(state != nullptr);
    CHECK(t.flat_params().defined() == (level[0] == "data_parallel_sharding=optim_grads"));
    // The embedding, the 3 decoder layers, the rest; contiguous and covering the arena. One rank
    // holds the whole of every unit, so its shard is the arena itself.
    const auto& units = state->units();
    REQUIRE(units.size() == 5);
    CHECK(units.front().name == "model.embed_tokens");
    CHECK(units[2].name == "model.layers.1");
    int64_t next = 0;
    for (const auto& unit : units) {
      CHECK(unit.begin == next);
      CHECK(unit.part == unit.numel);
      CHECK(unit.shard_offset == unit.begin);
      next += unit.numel;
    }
    CHECK(next == P);
    CHECK(state->padding_elements() == 0);
    // optim_grads updates its parts in place in the arena; optim_grads_params keeps a shard.
    CHECK(state->param_shard.defined() == !t.flat_params().defined());
    const auto params_of = [&] { return t.flat_params().defined() ? t.flat_params() : state->param_shard; };
    CHECK(torch::equal(params_of(), initial));

    auto out = t.forward_backward(0);
    CHECK(metric(t, out, "learning/loss") == Approx(metric(plain, plain_out, "learning/loss")).epsilon(tiled ? 1e-6 : 1e-12));
    INFO("largest gradient difference " << (state->grad_shard - plain_grads).abs().max().item<double>());
    CHECK(torch::allclose(state->grad_shard, plain_grads, 1e-5, 1e-7));  // minimal remat reorders a few sums
    // Every decoder layer's gradient was reduced into the shard right after its backward.
    for (const auto& item : t.model()->named_parameters())
      if (item.key().rfind("model.layers.0.", 0) == 0) CHECK(item.value().grad().abs().max().item<double>() == 0);
    t.optimizer_update(out);
    for (int step = 1; step < 3; ++step) t.train_step(step);
    CHECK(torch::allclose(params_of(), plain.flat_params(), 1e-6, 1e-7));
  }
}

TEST_CASE("memory plan: sharded levels count the shard and one unit's buffers, as the trainer allocates", "[training][memory]") {
  for (const std::string level : {"optim_grads", "optim_grads_params"}) {
    INFO(level);
    const Config c = tiny_config({"model_name=moe-tiny", "mtp_num_layers=1", "data_parallel_sharding=" + level,
                                  "remat_policy=full"});
    Trainer t(c);
    const auto& units = t.sharded_state()->units();
    const double P = static_cast<double>(t.sharded_state()->total_params());
    // At R = 4 a unit of n elements keeps ceil(n / 4) on each rank; the unreduced (and, for
    // optim_grads_params, gathered) buffers are the embedding's and the rest's padded to 4 parts,
    // plus the largest decoder layer's.
    for (const double R : {1.0, 4.0}) {
      double S = 0, layer = 0, widest = 0;
      for (const auto& unit : units) {
        const double part = std::ceil(static_cast<double>(unit.numel) / R);
        S += part;
        if (unit.layer >= 0) layer = std::max(layer, R * part);
        widest = std::max(widest, R * part);
      }
      const double outer = R * (std::ceil(static_cast<double>(units.front().numel) / R) +
                                std::ceil(static_cast<double>(units.back().numel) / R));
      const MemoryPlan plan = memory_plan(c, {static_cast<int64_t>(R), 1, false});
      CHECK(plan_item(plan, "weights") == (level == "optim_grads" ? 4 * (P + widest) : 4 * (S + outer + 2 * layer)));
      CHECK(plan_item(plan, "gradients") == 4 * (S + outer + layer));
      CHECK(plan_item(plan, "optimizer") == 8 * S);
      if (R == 1) CHECK(S == P);
    }
    // Expert parallelism, N = 2 of R = 4: this rank's half of a MoE layer's experts is a unit of
    // its own, split over the R/N = 2 ranks that hold the same experts; the shared expert after it
    // another. Built as rank 0 of the expert-parallel group would build it (no process group needed).
    const Config ep = tiny_config({"model_name=moe-tiny", "mtp_num_layers=1", "data_parallel_sharding=" + level,
                                   "remat_policy=full", "expert_parallelism=2"});
    const auto model = model_build(ep, /*expert_rank=*/0, /*draw=*/false);
    double P_rank = 0, S = 0, outer = 0, widest = 0;
    std::map<int64_t, double> layers;  // gathered elements per decoder layer
    size_t expert_units = 0;
    for (const auto& unit : model_units(model, /*split_experts=*/true)) {
      const double ranks = unit.experts ? 2 : 4, part = std::ceil(static_cast<double>(unit.numel) / ranks);
      P_rank += static_cast<double>(unit.numel);
      S += part;
      (unit.layer >= 0 ? layers[unit.layer] : outer) += ranks * part;
      widest = std::max(widest, ranks * part);
      expert_units += unit.experts;
    }
    CHECK(expert_units == 2);  // moe-tiny's two MoE layers
    double layer = 0;
    for (const auto& [index, elements] : layers) layer = std::max(layer, elements);
    const MemoryPlan plan = memory_plan(ep, {4, 1, false});
    CHECK(plan_item(plan, "weights") == (level == "optim_grads" ? 4 * (P_rank + widest) : 4 * (S + outer + 2 * layer)));
    CHECK(plan_item(plan, "gradients") == 4 * (S + outer + layer));
    CHECK(plan_item(plan, "optimizer") == 8 * S);
  }
}

TEST_CASE("memory plan: under expert parallelism the activations name the unbalanced worst case", "[training][memory]") {
  // moe-tiny: 8 experts, top-2. At N = 2 a rank holds 4 experts: every token of both ranks may pick
  // 2 of them, 2x a balanced rank's T k rows; at N = 8 a rank holds 1: each token picks it at most
  // once, 8 x 1 / 2 = 4x.
  const auto detail_of = [](const std::string& ep, int64_t ranks) {
    for (const auto& item : memory_plan(tiny_config({"model_name=moe-tiny", "expert_parallelism=" + ep}), {ranks, 1, false}).items)
      if (item.name.rfind("activations", 0) == 0) return item.detail;
    return std::string();
  };
  CHECK_THAT(detail_of("2", 2), Catch::Contains("computes up to 2x that, no capacity limit"));
  CHECK_THAT(detail_of("8", 8), Catch::Contains("computes up to 4x that, no capacity limit"));
  CHECK_THAT(detail_of("1", 1), !Catch::Contains("capacity"));
}

TEST_CASE("memory plan: a save's snapshot under expert parallelism counts every expert gathered to host", "[training][memory]") {
  // With one writer every rank copies its share (P_rank: weights, m, v) and gathers all experts of
  // the three (Trainer::with_all_experts): 12 (P_rank + E_all) bytes. The plan counted 12 P_rank
  // (the measured peak was 784 MiB after a save, against a plan of 623 MiB).
  const Config ep = tiny_config({"model_name=moe-tiny", "mtp_num_layers=1", "expert_parallelism=2"});
  const auto model = model_build(ep, /*expert_rank=*/0, /*draw=*/false);
  double P_rank = 0, all_experts = 0;
  for (const auto& item : model->named_parameters()) {
    P_rank += static_cast<double>(item.value().numel());
    if (model_is_stacked_experts(item.key())) all_experts += 2 * static_cast<double>(item.value().numel());  // N = 2 shares
  }
  REQUIRE(all_experts > 0);
  CHECK(plan_item(memory_plan(ep, {2, 1, false}), "checkpoint snapshot") == 12 * (P_rank + all_experts));
  // Each rank writing its own shard gathers nothing: about 1/R of its share.
  const Config sharded = tiny_config({"model_name=moe-tiny", "mtp_num_layers=1", "expert_parallelism=2",
                                      "data_parallel_sharding=optim_grads"});
  CHECK(plan_item(memory_plan(sharded, {2, 1, false}), "checkpoint snapshot") == 12 * P_rank / 2);
}

TEST_CASE("memory plan: activations scale with the micro-batch, not with K", "[training][memory]") {
  const auto activations = [](std::vector<std::string> overrides) {
    overrides.push_back("model_name=default");
    return memory_plan(tiny_config(overrides), {}).activation_bytes;
  };
  const double base = activations({"per_device_batch_size=2", "max_target_length=128"});
  CHECK(activations({"per_device_batch_size=2", "max_target_length=128", "gradient_accumulation_steps=8"}) == base);
  // Linear in B: plain causal rows need no mask.
  CHECK(activations({"per_device_batch_size=4", "max_target_length=128"}) == Approx(2 * base).epsilon(1e-12));
  // The only term quadratic in L: the block-causal attention keeps, per layer, fp32 probabilities
  // of query block i (64 positions) against keys [0, 64 (i + 1)): B H L (L + 64) / 2 in all.
  const Config c = tiny_config({"model_name=default"});
  const double kept_128 = 128.0 * (128 + 64) / 2, kept_256 = 256.0 * (256 + 64) / 2;
  CHECK(activations({"per_device_batch_size=2", "max_target_length=256"}) - 2 * base ==
        Approx(4.0 * 2 * c.base_num_query_heads * c.base_num_decoder_layers * (kept_256 - 2 * kept_128)).epsilon(1e-12));
  // Packed documents add (B, L, L) masks and an (L, L) one, shared by the batch (16 KiB here).
  // (Megatron data: synthetic rows have no documents to reset at.)
  const std::vector<std::string> megatron = {"dataset_type=megatron", "dataset_path=unused", "reset_attention_mask=true"};
  const double packed = activations({"per_device_batch_size=2", "max_target_length=128", megatron[0], megatron[1], megatron[2]});
  CHECK(activations({"per_device_batch_size=4", "max_target_length=128", megatron[0], megatron[1], megatron[2]}) - 2 * packed ==
        Approx(-128.0 * 128).margin(0.5));
  // bf16 autocast halves the matmul activations, not the fp32 residual stream.
  const double bf16 = activations({"per_device_batch_size=2", "max_target_length=128", "dtype=bfloat16"});
  CHECK(bf16 < base);
  CHECK(bf16 > 0.5 * base);
}

TEST_CASE("memory plan: a GLA layer keeps no (L, L) attention, so the hybrid's activations grow nearly linearly in L", "[training][memory]") {
  // ling2-tiny: 4 GLA layers and 1 MLA layer (softmax). From L to 2L the all-softmax stack's
  // attention grows ~4x; the hybrid's only in its one MLA layer (and the MTP block). Charging the
  // GLA layers a softmax core on top of their own (as the plan did) made the growth the same.
  const auto growth = [](const std::vector<std::string>& more) {
    const auto activations = [&](int64_t L) {
      std::vector<std::string> overrides = {"model_name=ling2-tiny", "override_model_config=true", "per_device_batch_size=1",
                                            "mtp_num_layers=0", "mtp_moe_mlp=false", "max_target_length=" + std::to_string(L)};
      overrides.insert(overrides.end(), more.begin(), more.end());
      return memory_plan(tiny_config(overrides), {}).activation_bytes;
    };
    return activations(4096) - activations(2048);
  };
  const double hybrid = growth({}), softmax = growth({"attention_type=global", "inhomogeneous_layer_cycle_interval=0"});
  INFO("activation growth from L 2048 to 4096: hybrid " << hybrid << " B, all softmax " << softmax << " B");
  CHECK(hybrid < 0.5 * softmax);  // measured 0.34 (one softmax layer of five, and the GLA cores' linear terms)
}

TEST_CASE("a hardware=gpu --dry-run from a build without CUDA plans for the CUDA build's attention, and says so", "[training][memory][cli]") {
  // It planned the 1.13 CPU build's block-causal attention (its (L, L) blocks) for a GPU run.
  const auto r = run_trainer("model_name=test-tiny hardware=gpu max_target_length=512 --dry-run");
  INFO(r.output);
  CHECK(r.exit_code == 0);
  if (at::hasCUDA()) {
    CHECK_THAT(r.output, !Catch::Contains("this build has no CUDA"));
  } else {
    CHECK_THAT(r.output, Catch::Contains("(GPU, float32, 1 rank; planned for a CUDA build of LibTorch >= 2.5 (this build has no CUDA)):") &&
                             Catch::Contains("(fused causal attention)") && !Catch::Contains("block-causal"));
  }
}

TEST_CASE("memory plan: remat_policy full keeps one (B, L, D) input per layer and minimal keeps what none keeps", "[training][memory][remat]") {
  const auto activations = [](const std::string& policy, int layers, std::vector<std::string> more = {}) {
    std::vector<std::string> overrides = {"model_name=default", "override_model_config=true", "per_device_batch_size=2",
                                          "max_target_length=64", "base_num_decoder_layers=" + std::to_string(layers),
                                          "remat_policy=" + policy};
    overrides.insert(overrides.end(), more.begin(), more.end());
    return memory_plan(tiny_config(overrides), {}).activation_bytes;
  };
  const Config c = tiny_config({"model_name=default"});
  const double input_bytes = 4.0 * 2 * 64 * static_cast<double>(c.base_emb_dim);  // fp32 (B, L, D)
  // One more layer costs its input under full, a whole layer's activations otherwise.
  CHECK(activations("full", 5) - activations("full", 4) == Approx(input_bytes).epsilon(1e-12));
  const double layer = activations("none", 5) - activations("none", 4);
  const double layer_minimal = activations("minimal", 5) - activations("minimal", 4);
  CHECK(layer > 10 * input_bytes);
  // A dense layer's norms and SwiGLU are one-node ops that keep only what minimal's recompute
  // keeps (their outputs, gate/up and the product), so minimal saves nothing there.
  CHECK(layer_minimal == Approx(layer).epsilon(1e-12));
  CHECK(activations("full", 4) < activations("minimal", 4));
  // Nor on MoE layers: the loop experts are recomputed under no policy.
  const std::vector<std::string> loop_experts = {"num_experts=4", "num_experts_per_tok=2", "base_moe_mlp_dim=16",
                                                 "first_num_dense_layers=0", "moe_dispatch=loop"};
  CHECK(activations("minimal", 4, loop_experts) == Approx(activations("none", 4, loop_experts)).epsilon(1e-12));
}

TEST_CASE("a run whose memory plan exceeds the machine exits 2 with the plan and what would fit", "[training][memory][cli]") {
  // ulimit -v caps this process's address space (RLIMIT_AS): the check sees ~2 GB available.
  const std::string limit = "ulimit -v 3000000;";
  // Well over the limit with either attention core: 4.6 GiB planned on 1.13 (block-causal keeps
  // probabilities); on 2.6 (SDPA) batch 64 planned 2.20 GiB, within 4% of the limit, so 96.
  const std::string big = "model_name=default per_device_batch_size=96 max_target_length=1024 steps=1 "
                          "base_output_directory=" + test_root() + " run_name=memory-plan ";
  auto r = run_trainer(big, limit);
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("the memory plan does not fit on rank 0") &&
                           Catch::Contains("RLIMIT_AS (ulimit -v)") && Catch::Contains("activations saved for backward") &&
                           Catch::Contains("would fit: per_device_batch_size=") &&
                           Catch::Contains("allow_memory_overcommit=true skips"));
  // The suggestion really fits: --dry-run of it, under the same limit, says so.
  std::smatch m;
  REQUIRE(std::regex_search(r.output, m, std::regex("would fit: (per_device_batch_size=[0-9]+ gradient_accumulation_steps=[0-9]+)")));
  const auto suggested = run_trainer(big + m[1].str() + " --dry-run", limit);
  CHECK(suggested.exit_code == 0);
  CHECK_THAT(suggested.output, Catch::Contains("(RLIMIT_AS (ulimit -v)): fits"));
  const auto dry = run_trainer(big + " --dry-run", limit);
  CHECK_THAT(dry.output, Catch::Contains("does NOT fit") && Catch::Contains("memory plan per rank") &&
                            Catch::Contains("would fit: " + m[1].str()));  // the same suggestion as training's
  // One sequence whose head does not fit whole (a 256K vocabulary: 1 GiB per fp32 (L, V) tensor):
  // no smaller batch exists, and the fewest tiles that fit are suggested, and fit.
  const std::string head = "model_name=test-tiny override_model_config=true vocab_size=262144 per_device_batch_size=1 "
                           "max_target_length=1024 steps=1 base_output_directory=" + test_root() + " run_name=memory-plan-head ";
  const auto whole_head = run_trainer(head, limit);
  CHECK(whole_head.exit_code == 2);
  CHECK_THAT(whole_head.output, !Catch::Contains("per_device_batch_size=") && Catch::Contains(" (no whole (B, L, V) logits)"));
  REQUIRE(std::regex_search(whole_head.output, m, std::regex("(num_vocab_tiling=[0-9]+) \\(no whole")));
  const auto tiled = run_trainer(head + m[1].str() + " --dry-run", limit);
  CHECK_THAT(tiled.output, Catch::Contains("(RLIMIT_AS (ulimit -v)): fits"));
  // Another rank of a launch prints no plan, but names itself when its own machine does not fit
  // (another node may have less memory than rank 0's), and says nothing when it does.
  const std::string rank_one = "OMPI_COMM_WORLD_RANK=1 OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_LOCAL_RANK=0 "
                               "OMPI_COMM_WORLD_LOCAL_SIZE=1 ";
  const auto other = run_trainer(big + " --dry-run", limit + rank_one);
  CHECK(other.exit_code == 0);
  CHECK_THAT(other.output, Catch::Contains("--dry-run: rank 1 (host ") && Catch::Contains("this machine does NOT fit") &&
                               !Catch::Contains("memory plan per rank"));
  const auto other_fits = run_trainer("model_name=test-tiny steps=1 --dry-run", limit + rank_one);
  CHECK(other_fits.exit_code == 0);
  CHECK(other_fits.output.empty());

  // Each process has its own rlimits: two ranks on the machine do not halve them (MemAvailable
  // and the cgroup, which they share, are divided).
  const auto available_per_rank = [&](const std::string& prefix) {
    const auto out = run_trainer("model_name=test-tiny steps=1 --dry-run", prefix).output;
    std::smatch found;
    const bool matched = std::regex_search(out, found, std::regex("this machine: ([0-9.]+) (GiB|MiB) available per rank \\(([^)]*\\)?)"));
    INFO(out);
    REQUIRE(matched);
    return std::make_pair(std::stod(found[1].str()) * (found[2].str() == "GiB" ? 1024.0 : 1.0), found[3].str());
  };
  const std::string two_ranks = "OMPI_COMM_WORLD_RANK=0 OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_LOCAL_RANK=0 "
                                "OMPI_COMM_WORLD_LOCAL_SIZE=2 ";
  const auto one_limited = available_per_rank(limit), two_limited = available_per_rank(limit + two_ranks);
  CHECK(one_limited.second == "RLIMIT_AS (ulimit -v)");
  CHECK(two_limited.second == "RLIMIT_AS (ulimit -v)");
  CHECK(two_limited.first == Approx(one_limited.first).epsilon(0.05));
  CHECK_THAT(available_per_rank(two_ranks).second, Catch::Contains(", divided by the 2 ranks on this machine"));

  // A 7B model: nothing fits, said so, and nothing was allocated (it ends at once, exit 2).
  r = run_trainer("model_name=llama2-7b steps=1 base_output_directory=" + test_root() + " run_name=memory-plan-7b", limit);
  CHECK(r.exit_code == 2);
  CHECK_THAT(r.output, Catch::Contains("nothing the plan knows of fits") && Catch::Contains("weights, gradients and optimizer state alone need"));

  // allow_memory_overcommit=true goes on, and the allocation failure is a one-line error, exit 1.
  r = run_trainer(big + "allow_memory_overcommit=true", limit);
  CHECK(r.exit_code == 1);
  CHECK_THAT(r.output, Catch::Contains("going on (allow_memory_overcommit)") && Catch::Contains("out of memory"));
  CHECK_THAT(r.output, !Catch::Contains("frame #"));
}

TEST_CASE("AdamW's weight decay takes lr x wd of each weight, unbiased by fp32 rounding of 1 - lr x wd", "[training][numerics]") {
  // With a zero gradient the update is the decay alone: p <- p - lr wd p. At lr wd = 1e-6 the
  // factor 1 - lr wd rounds in fp32 to 1 - 17 x 2^-24 = 1 - 1.0133e-6: every weight decayed 1.3%
  // too much, the same way. Over the weights of magnitude below 0.5 (each rounds to its own fp32
  // grid, up and down), the decay taken must be lr wd of their sum to 0.2%.
  Trainer t(tiny_config(uneven({"lr_schedule_type=constant", "learning_rate=1e-5", "adam_weight_decay=0.1"})));
  auto out = t.forward_backward(0);
  t.flat_grads().zero_();
  const auto before = t.flat_params().to(torch::kFloat64).clone();
  t.optimizer_update(out);
  REQUIRE(metric(t, out, "optim/step_skipped") == 0);
  const auto after = t.flat_params().to(torch::kFloat64);
  const auto small = (before.abs() < 0.5) & (before != 0);
  REQUIRE(small.sum().item<int64_t>() > 10000);
  const double taken = ((before - after) * before.sign()).masked_select(small).sum().item<double>();
  const double expected = 1e-6 * before.abs().masked_select(small).sum().item<double>();
  INFO("decay taken / expected: " << taken / expected);
  CHECK(taken / expected == Approx(1.0).epsilon(2e-3));
}

TEST_CASE("adamw_mask: the parameters it names take no weight decay, the others the same update as without it", "[training][numerics]") {
  // With a zero gradient AdamW's step is the decay alone (m = v = 0: 0 / (0 + eps)), so after one
  // update a masked weight is exactly what it was and every other weight exactly what the run
  // without a mask made of it. [norm] names every 1-D parameter of these models (Megatron's
  // default exclusion), and nothing else: checked against the shapes.
  for (const std::string model : {"test-tiny", "moe-tiny", "ling2-tiny"}) {
    INFO(model);
    const std::vector<std::string> common = {"model_name=" + model, "lr_schedule_type=constant", "learning_rate=1e-3",
                                             "adam_weight_decay=0.1"};
    auto with_mask = common;
    with_mask.push_back("adamw_mask=[norm, 'no_such_parameter']");
    Trainer masked(tiny_config(uneven(with_mask))), plain(tiny_config(uneven(common)));
    const auto before = masked.flat_params().clone();
    REQUIRE(torch::equal(before, plain.flat_params()));
    for (Trainer* t : {&masked, &plain}) {
      auto out = t->forward_backward(0);
      t->flat_grads().zero_();
      t->optimizer_update(out);
      REQUIRE(metric(*t, out, "optim/step_skipped") == 0);
    }
    auto is_masked = torch::zeros({before.numel()}, torch::kBool);
    int64_t one_dimensional = 0, named_norm = 0;
    const auto* arena = masked.flat_params().data_ptr<float>();
    for (const auto& item : masked.model()->named_parameters()) {
      const bool norm = item.key().find("norm") != std::string::npos;
      one_dimensional += item.value().dim() == 1;
      named_norm += norm;
      CHECK((item.value().dim() == 1) == norm);
      if (norm) is_masked.narrow(0, item.value().data_ptr<float>() - arena, item.value().numel()).fill_(true);
    }
    CHECK(named_norm == one_dimensional);
    REQUIRE(named_norm > 0);
    const auto after = masked.flat_params();
    CHECK(torch::equal(after.masked_select(is_masked), before.masked_select(is_masked)));
    CHECK(torch::equal(after.masked_select(~is_masked), plain.flat_params().masked_select(~is_masked)));
    // ... and the decay did act there: norm weights start at 1 and lose lr wd = 1e-4 of it.
    CHECK(plain.flat_params().masked_select(is_masked).max().item<float>() < 0.99995f);
  }
}

TEST_CASE("adamw_mask: a pattern that is not a regex is refused naming the key, one that names nothing warned about", "[training][config]") {
  const auto bad = run_trainer("model_name=test-tiny steps=1 'adamw_mask=[norm, \"(unclosed\"]' --print-config");
  CHECK(bad.exit_code == 2);
  CHECK_THAT(bad.output, Catch::Contains("config key 'adamw_mask': '(unclosed' is not a regular expression"));
  // A pattern that names nothing is a warning (a typo would otherwise decay what it meant to spare).
  const auto typo = run_trainer("model_name=test-tiny steps=1 max_target_length=8 per_device_batch_size=1 'adamw_mask=[nrom]' "
                                "enable_checkpointing=false base_output_directory=" + test_root() + " run_name=adamw-mask-typo");
  INFO(typo.output);
  CHECK(typo.exit_code == 0);
  CHECK_THAT(typo.output, Catch::Contains("adamw_mask: 'nrom' matches no parameter name") &&
                              Catch::Contains("adamw_mask: 0 parameters (0 elements) without weight decay"));
  // The printed config loads back to the same patterns (each quoted: a regex may hold ',' or ']').
  const auto printed = run_trainer("model_name=test-tiny 'adamw_mask=[\"a,b\", \"x]\"]' --print-config");
  CHECK(printed.exit_code == 0);
  CHECK_THAT(printed.output, Catch::Contains("\nadamw_mask: [\"a,b\", \"x]\"]\n"));
}

TEST_CASE("two AdamW steps with clipping equal a hand computation in float64", "[training][numerics]") {
  // optax.adamw / torch.optim.AdamW, written out per element: g <- g * min(1, c / ||g||);
  // m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;  m_hat = m / (1 - b1^t), v_hat = v / (1 - b2^t);
  // p <- p - lr (m_hat / (sqrt(v_hat) + eps) + wd p). Constant schedule, no warm-up: lr is fixed.
  // b1 = 0.3 takes the CPU update's other form of lerp (weight 1 - b1 >= 0.5).
  for (const double b1 : {0.8, 0.3}) {
    INFO("b1 " << b1);
    const double lr = 3e-3, b2 = 0.9, eps = 1e-6, wd = 0.05;
    Trainer t(tiny_config(uneven({"lr_schedule_type=constant", "learning_rate=" + std::to_string(lr),
                                  "adam_b1=" + std::to_string(b1), "adam_b2=0.9", "adam_eps=1e-6", "adam_weight_decay=0.05",
                                  "gradient_clipping_threshold=0.05"})));
    const int64_t n = t.flat_params().numel();
    auto p = t.flat_params().to(torch::kFloat64).clone();
    auto m = torch::zeros({n}, torch::kFloat64), v = torch::zeros({n}, torch::kFloat64);
    double clip_factors[2];
    for (int step = 0; step < 2; ++step) {
      auto out = t.forward_backward(step);
      auto g = t.flat_grads().to(torch::kFloat64).clone();
      const double norm = std::sqrt(g.square().sum().item<double>());
      clip_factors[step] = std::min(1.0, 0.05 / norm);
      g.mul_(clip_factors[step]);
      t.optimizer_update(out);
      CHECK(metric(t, out, "learning/current_learning_rate") == Approx(lr).epsilon(1e-12));
      m = b1 * m + (1 - b1) * g;
      v = b2 * v + (1 - b2) * g.square();
      const double tt = step + 1;
      const auto m_hat = m / (1 - std::pow(b1, tt)), v_hat = v / (1 - std::pow(b2, tt));
      p = p - lr * (m_hat / (v_hat.sqrt() + eps) + wd * p);
      // The trainer keeps p, m, v in fp32: each step rounds p to ~6e-8 of |p| (norm weights are ~1),
      // so the bound is a few fp32 ulps of the weight plus 1e-6 of the step size. A formula error
      // (bias correction, eps inside the sqrt, decay not scaled by lr) is ~1e-4 of |p| or more.
      const auto excess = (t.flat_params().to(torch::kFloat64) - p).abs() - (4e-7 * p.abs() + 1e-6 * lr);
      INFO("step " << step << ": max |trainer - hand| = " << (t.flat_params().to(torch::kFloat64) - p).abs().max().item<double>());
      CHECK(excess.max().item<double>() <= 0);
    }
    CHECK(clip_factors[0] < 1.0);  // clipping really acted, so the check covers it
    CHECK((t.flat_params().to(torch::kFloat64) - p).abs().max().item<double>() <
          1e-3 * (t.flat_params() - Trainer(tiny_config(uneven())).flat_params()).abs().max().item<double>());
  }
}

TEST_CASE("spike guard: skip decisions on crafted losses and norms equal a hand computation", "[training][numerics]") {
  // MaxText's rule (optimizers.py skip_step_on_spikes; docs/training.md, step 5): with the last
  // n = skip_step_interval steps' losses l_j and clipped gradient norms g_j (skipped steps
  // included, non-finite ones not), step t is skipped iff a value is non-finite, or the window
  // holds at least max(2, n / 2) - 1 steps and l_t - mean(l) > f std(l) or g_t - mean(g) > f std(g)
  // (sample std). A skipped step leaves the parameters and the AdamW step count unchanged.
  // The (loss, norm) pairs below replace each step's measured ones; n = 6 (judged from a window
  // of 2), f = 1. Each line says which part of the rule it pins down.
  struct Case {
    double loss, norm;
    bool skipped;
  };
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const auto run = [](const std::string& clipping, const std::vector<Case>& cases) {
    Trainer t(tiny_config(uneven({"skip_step_on_spikes=true", "skip_step_interval=6", "skip_step_scaling_factor=1.0",
                                  "gradient_clipping_threshold=" + clipping, "steps=10"})));
    for (size_t step = 0; step < cases.size(); ++step) {
      auto out = t.forward_backward(static_cast<int64_t>(step));
      out.loss = torch::tensor(cases[step].loss, torch::kFloat64);
      out.raw_grad_norm = torch::tensor(cases[step].norm, torch::kFloat64);
      const auto before = t.flat_params().clone();
      const int64_t updates_before = t.updates_applied();
      t.optimizer_update(out);
      INFO("clipping " << clipping << ", step " << step << ": loss " << cases[step].loss << ", grad norm " << cases[step].norm);
      CHECK(out.step_skipped == cases[step].skipped);
      CHECK(torch::equal(t.flat_params(), before) == cases[step].skipped);
      CHECK(t.updates_applied() == updates_before + (cases[step].skipped ? 0 : 1));
    }
  };
  run("0", {
               {1.0, 10, false},    // window of 0: not judged
               {2.0, 10, false},    // window of 1: not judged (its std 0 would reject 2 > 1)
               {1.6, 10, false},    // l = {1, 2}: mean 1.5, std 0.707; g = {10, 10}: std 0, and 10 - 10 <= 0
               {2.0, 10, false},    // l = {1, 2, 1.6}: 2.0 <= 1.533 + 0.503 (sample std; the population std 0.411 rejects)
               {100.0, 10, true},   // a plain loss spike ...
               {2.5, 10, false},    // ... which joined the window: mean 21.3, std 44 (without it: 2.5 > 1.65 + 0.47)
               {2.0, 10.5, true},   // a gradient-norm spike alone (g all 10: std 0)
               {nan, 10, true},     // non-finite: skipped, and kept out of the window
               {2.0, 10, false},    // g = {10, 10, 10, 10, 10, 10.5}: 10 <= 10.083 + 0.204
           });
  // The norm judged is the clipped one: with the threshold 11.2, a raw 40 counts as 11.2, within
  // g = {9, 11}: mean 10 + std 1.414.
  run("11.2", {{1.0, 9, false}, {2.0, 11, false}, {1.6, 40, false}});
  run("0", {{1.0, 9, false}, {2.0, 11, false}, {1.6, 40, true}});  // unclipped, 40 is a spike
}

TEST_CASE("the whole head keeps one (T, V) tensor per loss: with z-loss and with an MTP depth", "[training][memory]") {
  // A 32K vocabulary over 1024 tokens: each fp32 (T, V) tensor is 128 MiB. F::cross_entropy keeps
  // the log-probabilities; logsumexp + gather (how z-loss and the MTP loss were computed) kept the
  // logits and made two more (T, V) tensors in their backward.
  const std::string big = "model_name=test-tiny override_model_config=true vocab_size=32768 max_target_length=256 per_device_batch_size=4 steps=1 "
                          "host_huge_pages=false base_output_directory=" + test_root() + " ";
  const auto peak_mib = [&](const std::string& args, const std::string& run) {
    const auto r = run_trainer(big + args + " run_name=" + run);
    INFO(r.output);
    REQUIRE(r.exit_code == 0);
    return json_metric(read_lines(test_root() + "/" + run + "/metrics.jsonl").at(0), "memory/peak_rss_bytes") / (1 << 20);
  };
  const double plain = peak_mib("", "head-plain"), z_loss = peak_mib("z_loss_multiplier=1e-3", "head-z"),
               mtp = peak_mib("mtp_num_layers=1", "head-mtp");
  INFO("peak RSS MiB: plain " << plain << ", z-loss " << z_loss << ", one MTP depth " << mtp);
  CHECK(z_loss - plain < 64);  // measured: -8 MiB (was +250 MiB)
  CHECK(mtp - plain < 192);    // one more log-probabilities tensor, 128 MiB (was +256 MiB)
}
