// Dropless mixture-of-experts layer (DeepSeek / Ling style) and its balancing statistics.
//
// For the N valid tokens of a forward (padding excluded), E experts, top-k routing:
//   s_t      = softmax(router_logits_t) or sigmoid(router_logits_t)         (E scores per token)
//   chosen_t = top-k of s_t + bias    (the bias only affects selection: aux-loss-free balancing);
//              with group-limited routing (n_routing_groups G, topk_routing_group g; DeepSeek-V3,
//              Ling 2.0) the E experts form G groups of E/G, a group scores the sum of its two
//              largest s + bias, and the top-k is taken only among the experts of the g best groups
//   weights  = s_t[chosen_t], renormalized to sum 1 if norm_topk_prob, times routed_scaling_factor
//   y_t      = sum_{e in chosen_t} weight_{t,e} * Expert_e(x_t) + SharedExperts(x_t)
// Load balancing (Switch/GShard form, normalized so a balanced router gives 1):
//   f_e = count_e / (k N)       fraction of routed slots that went to expert e (no gradient)
//   P_e = (1/N) sum_t p_{t,e}   mean routing probability, p = s / sum_e s (= s for softmax)
//   LB  = E * sum_e f_e P_e
// The loss that enters J is load_balance_loss_weight * mean over MoE layers of LB, plus
// router_z_loss_weight * mean over layers of mean_t logsumexp(router_logits_t)^2 (see step.cpp).
#include <limits>

#include "trainer/metrics/perf_counters.h"
#include "trainer/model/model.h"

namespace trainer {

namespace F = torch::nn::functional;

MoeGateImpl::MoeGateImpl(int64_t dim, int64_t num_experts) {
  weight = register_parameter("weight", torch::empty({num_experts, dim}));
  e_score_correction_bias = register_buffer("e_score_correction_bias", torch::zeros({num_experts}));
}

MoeImpl::MoeImpl(const Config& c)
    : num_experts_(c.num_experts),
      top_k_(c.num_experts_per_tok),
      sigmoid_(c.routed_score_func == "sigmoid"),
      norm_topk_prob_(c.norm_topk_prob),
      use_bias_(c.routed_bias),
      scaling_(c.routed_scaling_factor),
      routing_groups_(c.n_routing_groups),
      topk_routing_group_(c.topk_routing_group) {
  gate = register_module("gate", MoeGate(c.base_emb_dim, c.num_experts));
  experts = register_module("experts", torch::nn::ModuleList());
  for (int64_t e = 0; e < num_experts_; ++e) experts->push_back(Mlp(c.base_emb_dim, c.base_moe_mlp_dim, /*one_gemm_for_gate_up=*/false));
  if (c.shared_experts > 0)
    shared_experts = register_module("shared_experts", Mlp(c.base_emb_dim, c.shared_experts * c.base_moe_mlp_dim));
}

torch::Tensor MoeImpl::forward(const torch::Tensor& x, const BlockContext& ctx) {
  const auto B = x.size(0), L = x.size(1), D = x.size(2);
  const int64_t N = B * L, E = num_experts_, k = top_k_;
  const auto xf = x.reshape({N, D});  // (N, D)

  // Router in at least fp32, outside autocast: routing decisions should not depend on bf16 rounding.
  const auto wide = at::promote_types(x.scalar_type(), torch::kFloat32);
  torch::Tensor router_logits;  // (N, E)
  {
    c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
    router_logits = F::linear(xf.to(wide), gate->weight.to(wide));
  }
  const auto scores = sigmoid_ ? torch::sigmoid(router_logits) : torch::softmax(router_logits, -1);  // (N, E)
  auto selection = use_bias_ ? scores + gate->e_score_correction_bias.to(wide) : scores;  // (N, E)
  if (routing_groups_ > 0) {
    const int64_t G = routing_groups_;
    const auto group_scores = std::get<0>(selection.view({N, G, E / G}).topk(2, -1)).sum(-1);  // (N, G)
    const auto best_groups = std::get<1>(group_scores.topk(topk_routing_group_, -1));         // (N, g)
    const auto kept = torch::zeros({N, G}, selection.options().dtype(torch::kBool)).scatter_(1, best_groups, true);
    selection = selection.masked_fill(~kept.unsqueeze(-1).expand({N, G, E / G}).reshape({N, E}),
                                      -std::numeric_limits<double>::infinity());
  }
  const auto chosen = std::get<1>(selection.topk(k, -1));  // (N, k) expert ids
  auto weights = scores.gather(1, chosen);                  // (N, k)
  if (norm_topk_prob_) weights = weights / (weights.sum(-1, true) + 1e-20);
  weights = weights * scaling_;

  // Balancing statistics over valid tokens.
  const auto valid = ctx.valid.reshape({N}).to(wide);  // (N)
  const auto n_valid = valid.sum().clamp_min(1.0);
  const auto counts = torch::zeros({E}, valid.options())
                          .index_add_(0, chosen.reshape({N * k}), valid.repeat_interleave(k));  // (E)
  const auto probs = sigmoid_ ? scores / scores.sum(-1, true) : scores;                        // (N, E)
  const auto mean_prob = (probs * valid.unsqueeze(1)).sum(0) / n_valid;                        // (E) P_e
  const auto fraction = counts / (static_cast<double>(k) * n_valid);                           // (E) f_e
  if (ctx.moe_stats) {
    const auto lse = torch::logsumexp(router_logits, -1);
    ctx.moe_stats->push_back({static_cast<double>(E) * (fraction * mean_prob).sum(),
                              (lse.square() * valid).sum() / n_valid, counts.to(torch::kFloat32)});
  }

  // Dispatch: sort the N*k (token, slot) pairs by expert, run each expert on its rows, scatter back.
  const auto flat_expert = chosen.reshape({N * k});                             // (N*k)
  const auto order = std::get<1>(flat_expert.sort(/*stable=*/true, 0, false));  // (N*k)
  const auto token_of = order.div(k, "floor");                                  // (N*k)
  const auto slot_weight = weights.reshape({N * k}).index_select(0, order);     // (N*k)
  // Group sizes on the host: the one device->host sync of a MoE layer (dynamic shapes).
  const auto group_sizes = torch::bincount(flat_expert, {}, E).cpu();
  perf_note_host_read();
  const auto* sizes = group_sizes.data_ptr<int64_t>();
  auto out = torch::zeros({N, D}, x.options());
  int64_t offset = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = sizes[e];
    if (n == 0) continue;
    const auto tokens = token_of.narrow(0, offset, n);
    const auto y = experts[e]->as<MlpImpl>()->forward(xf.index_select(0, tokens), ctx.recompute_elementwise);  // (n, D)
    out.index_add_(0, tokens, (y * slot_weight.narrow(0, offset, n).unsqueeze(1).to(y.scalar_type())).to(out.scalar_type()));
    offset += n;
  }
  if (shared_experts) out = out + shared_experts->forward(xf, ctx.recompute_elementwise).to(out.scalar_type());
  return out.view({B, L, D});
}

}  // namespace trainer
