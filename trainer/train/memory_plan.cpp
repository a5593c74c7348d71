// The memory plan: bytes per rank from the config alone, and the machine's side of the check.
//
// What is counted (T = per_device_batch_size * max_target_length tokens of one micro-batch, D the
// width, q = Hq*hd and kv = Hkv*hd the projection widths, F the MLP width, V the vocabulary; r = 4
// bytes for the fp32 residual stream and norms, m = 4 or 2 bytes for matmul inputs/outputs in
// fp32 or under bf16 autocast). Micro-batches run one after another and each one's activations are
// freed by its backward, so K does not appear in the activations: gradients accumulate in place.
//
// Static, for the whole run:
//   weights and gradients    4P each (the flat fp32 arenas)
//   AdamW                    m and v, 8 bytes per element of this rank's shard (ZeRO-1: P/R); the
//                            CPU's one-pass update and CUDA's fused kernel need no workspace
//   weight copies saved for backward: the per-forward concatenations of q/k/v and gate/up weights
//                            (fp32), or under bf16 autocast the bf16 cast of every matmul weight
//
// Saved for backward, per dense decoder layer (each line one tensor autograd keeps):
//   input RMSNorm: its output (it keeps its input, the residual stream, counted below, and one
//                  fp32 value per row; model.cpp's one-node norm or LibTorch's fused one)   r T D
//   q/k/v GEMM output (RoPE and attention keep views of it)   m T (q + 2kv)
//   RoPE: the swapped halves and the rotated q and k          m T (q + kv) (2 f + [f < 1])
//   attention, LibTorch 1.13 (block-causal core): contiguous q, k, v    m T (q + 2kv)
//              and the probabilities of the computed blocks (b = kAttentionBlock positions):
//              m B Hq sum_i b min(L, (i+1) b), about m B Hq L (L + b) / 2
//   attention, LibTorch >= 2.0 (SDPA): k and v repeated to the query heads (Hq > Hkv) 2 m T q
//              (none with native GQA: CUDA, >= 2.5, no segment masks), the fused kernel's
//              output + logsumexp, and with segment masks the mask it converts (m B L L)
//   attention output, transposed for o_proj                  m T q
//   residual after attention                                 r T D
//   post-attention RMSNorm                                   r T D
//   SwiGLU (one node): gate/up output, the product            3 m T F
//   residual after the MLP (the next layer's input)          r T D
//   bf16 autocast: the bf16 copies of the two normed GEMM inputs   2 * 2 T D
// MoE layers replace the SwiGLU by: router logits and scores (fp32, T E each), and per routed row
// (T k of them), with moe_dispatch=grouped: the sorted input in the compute dtype, [gate | up] and
// the expert output (2 m D + 2 m F); with loop: the gathered input (fp32 + its bf16 copy), the
// expert's four SwiGLU tensors and its output. Plus the shared experts' SwiGLU and three T D sums.
// The head: the final norm, and the log-probabilities (fp32, T V) for the loss; each MTP depth
// adds the shifted embedding, two norms, their concatenation, one dense layer, a norm and its
// fp32 log-probabilities (T V; with z-loss the main head keeps its logits' gradient instead).
//
// With num_vocab_tiling > 1 each head keeps the gradients of its input and weight (fp32 T D +
// V D) instead of its (T, V) tensors.
//
// Transient, on top of everything saved: the backward of the head holds the gradient of the
// log-probabilities and of the logits (2 x fp32 T V; tiled: one tile's) and the output head's
// weight gradient (V D) before it is added into the flat buffer; the block-causal attention two
// block-sized buffers in its backward; a MoE layer's backward its routed rows' gradients and its
// experts' weight gradients. The plan takes the largest.
#include "trainer/train/memory_plan.h"

#include <sys/resource.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "trainer/model/model_size.h"

namespace trainer {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kMiB = 1024.0 * 1024.0;
// Resident before the first tensor on the CPU: LibTorch and its libraries, OpenBLAS's per-thread
// GEMM buffers, the allocator's arenas. Measured on Debian 12 (LibTorch 1.13): the peak RSS of
// a run whose tensors are negligible (docs/benchmarks.md, "Memory plan").
constexpr double kCpuRuntimeBytes = 330.0 * kMiB;

std::string count_text(double n) {
  char buf[32];
  if (n >= 1e9)
    std::snprintf(buf, sizeof buf, "%.2fB", n / 1e9);
  else if (n >= 1e6)
    std::snprintf(buf, sizeof buf, "%.1fM", n / 1e6);
  else
    std::snprintf(buf, sizeof buf, "%.0f", n);
  return buf;
}

struct Shapes {
  double B, L, T, D, q, kv, F, V, H, E, k, Fm, Fs, f;
};

// Activations saved for backward by one dense (`moe` false) or MoE decoder layer, in bytes.
// remat_policy=minimal keeps what none keeps: its recomputed SwiGLU keeps gate, up and the product,
// as the one-node SwiGLU does, and norms keep their output under every policy (the GEMM input;
// their input is the residual stream, kept anyway).
// The attention core's own saved tensors (after RoPE, before o_proj's input), in bytes.
// block_causal: contiguous q, k and v in its layout, and the probabilities of the computed blocks:
// query block i (b positions, H heads) against keys [0, min(L, (i+1) b)), in the matmul dtype.
// sdpa: repeated k and v unless read natively, then the fused kernel's output and logsumexp, and
// with segment masks the (B, 1, L, L) mask each call converts to the query's dtype and keeps: the
// fused kernels take masks (measured on LibTorch 2.6's CPU: flash attention, 12.7 MiB kept per
// layer at B 2, H 8, L 1024, d 64 = output + logsumexp + fp32 mask; on CUDA the memory-efficient
// kernel takes them: not measured here).
double attention_saved_bytes(const Shapes& s, double m, AttentionCore core, bool segment_masks, bool native_gqa) {
  if (core == AttentionCore::block_causal) {
    const double b = std::min(static_cast<double>(kAttentionBlock), s.L);
    double kept_columns = 0;  // sum over query positions of the keys their block computes
    for (double start = 0; start < s.L; start += b) kept_columns += (std::min(s.L, start + b) - start) * std::min(s.L, start + b);
    return m * s.T * (s.q + 2 * s.kv) + m * s.B * s.H * kept_columns;
  }
  // Repeated k and v, unless read natively: only without segment masks (see causal_attention).
  const double repeated = (s.q > s.kv && !(native_gqa && !segment_masks)) ? 2 * m * s.T * s.q : 0.0;
  return repeated + m * s.T * s.q + 4 * s.B * s.H * s.L + (segment_masks ? m * s.B * s.L * s.L : 0.0);
}

double layer_saved_bytes(const Shapes& s, bool moe, double r, double m, bool bf16, const MemoryPlanContext& ctx,
                         bool segment_masks, bool qk_norm, bool grouped_experts) {
  const double cast = bf16 ? 2.0 : 0.0;  // bf16 copy of a fp32 GEMM input
  const double norm = 1.0;  // fp32 (B, L, D) tensors an RMSNorm keeps: its output
  // (B, L, F) tensors a SwiGLU keeps: the dense and shared-expert MLPs' one-node SwiGLU keeps
  // gate/up and (down_proj's input) the product, as minimal's recomputed one does; the loop
  // experts' composite, recomputed under no policy, keeps silu(gate) too.
  const double mlp_swiglu = 3.0, loop_swiglu = 4.0;
  double bytes = norm * r * s.T * s.D + cast * s.T * s.D;  // input norm (+ its bf16 copy)
  bytes += m * s.T * (s.q + 2 * s.kv);                     // q/k/v GEMM output
  if (qk_norm) bytes += m * s.T * (s.q + s.kv);  // q/k norm outputs (RoPE's inputs; their inputs are q/k/v views)
  bytes += m * s.T * (s.q + s.kv) * (2 * s.f + (s.f < 1 ? 1 : 0));  // RoPE
  bytes += attention_saved_bytes(s, m, ctx.attention, segment_masks, ctx.native_gqa);
  bytes += m * s.T * s.q;                          // attention output for o_proj
  bytes += r * s.T * s.D;                          // residual
  bytes += norm * r * s.T * s.D + cast * s.T * s.D;  // post-attention norm
  if (!moe) {
    bytes += mlp_swiglu * m * s.T * s.F;  // SwiGLU
  } else {
    bytes += 2 * 4 * s.T * s.E;                                                  // router logits, scores
    bytes += s.T * s.k * (grouped_experts ? 2 * m * s.D + 2 * m * s.Fm                  // routed rows
                                          : (4 + cast) * s.D + loop_swiglu * m * s.Fm + m * s.D);
    if (s.Fs > 0) bytes += mlp_swiglu * m * s.T * s.Fs + cast * s.T * s.D;       // shared experts
    bytes += 2 * r * s.T * s.D;                                                  // expert sum, + shared
  }
  bytes += r * s.T * s.D;  // residual: the layer's output
  return bytes;
}

void add(MemoryPlan& plan, const std::string& name, double bytes, const std::string& detail) {
  plan.items.push_back({name, bytes, detail});
  plan.total_bytes += bytes;
}

}  // namespace

std::string memory_bytes_text(double bytes) {
  char buf[32];
  if (bytes >= kGiB)
    std::snprintf(buf, sizeof buf, "%.2f GiB", bytes / kGiB);
  else
    std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / kMiB);
  return buf;
}

MemoryPlan memory_plan(const Config& c, const MemoryPlanContext& ctx) {
  const ModelSize size = model_size(c);
  // With expert parallelism a rank holds E/N of each MoE layer's routed experts.
  const double P = static_cast<double>(size.total_params) -
                   static_cast<double>(size.routed_expert_params) * (1.0 - 1.0 / static_cast<double>(c.expert_parallelism));
  const bool bf16 = c.dtype == "bfloat16";
  const double r = 4, m = bf16 ? 2 : 4;
  Shapes s{};
  s.B = static_cast<double>(c.per_device_batch_size);
  s.L = static_cast<double>(c.max_target_length);
  s.T = s.B * s.L;
  s.D = static_cast<double>(c.base_emb_dim);
  s.H = static_cast<double>(c.base_num_query_heads);
  s.q = s.H * static_cast<double>(c.head_dim);
  s.kv = static_cast<double>(c.base_num_kv_heads * c.head_dim);
  s.F = static_cast<double>(c.base_mlp_dim);
  s.V = static_cast<double>(c.vocab_size);
  s.E = static_cast<double>(c.num_experts);
  s.k = static_cast<double>(c.num_experts_per_tok);
  s.Fm = static_cast<double>(c.base_moe_mlp_dim);
  s.Fs = static_cast<double>(c.shared_experts * (c.moe_shared_expert_dim > 0 ? c.moe_shared_expert_dim : c.base_moe_mlp_dim));
  s.f = c.partial_rotary_factor;
  const bool moe_model = c.num_experts > 1;
  const int64_t layers = c.base_num_decoder_layers;
  const int64_t moe_layers = moe_model ? layers - c.first_num_dense_layers : 0;
  const int64_t dense_layers = layers - moe_layers;
  // Packed documents (reset_attention_mask) need (B, 1, L, L) segment masks; plain causal rows none.
  const bool segment_masks = c.reset_attention_mask;

  MemoryPlan plan;
  const std::string params = "P = " + count_text(P) + (c.expert_parallelism > 1 ? " (this rank's share of the experts)" : "");
  // ZeRO-1 shards over the ranks with equal arenas: all, or with expert parallelism R/N.
  const int64_t zero1_ranks = ctx.world_size / c.expert_parallelism;
  const bool zero1 = c.data_parallel_sharding == "optim" && zero1_ranks > 1;
  const bool zero2 = c.data_parallel_sharding == "optim_grads", zero3 = c.data_parallel_sharding == "optim_grads_params";
  const double adam_per_element = 8;  // m and v (both updates work in place, no workspace)
  const std::string adam_detail = "m, v x 4 B over ";
  if (zero2 || zero3) {
    // trainer/train/sharding.h: units (the embedding, each decoder layer, the rest), each split in
    // R parts of ceil(n / R); S = this rank's parts. Gradients reduce per layer, so only one layer's
    // full gradient (and, with optim_grads_params, one layer's gathered weights) exists at a time.
    // With HSDP (data_parallel_shard_degree D) the units are split over the D ranks of a group.
    // With expert parallelism a MoE layer's routed experts (this rank's E/N) are a unit of their
    // own, split over the R/N ranks holding the same experts.
    const int64_t shard_ranks = c.data_parallel_shard_degree > 0 ? std::min(c.data_parallel_shard_degree, ctx.world_size)
                                                                  : ctx.world_size;
    const double R = static_cast<double>(shard_ranks);
    const double expert_ranks = R / static_cast<double>(c.expert_parallelism);
    const auto part = [&](double n) { return std::ceil(n / R); };
    const double embed = s.V * s.D, rest = static_cast<double>(size.mtp_params) + s.D + (c.logits_via_embedding ? 0 : s.V * s.D);
    const double dense_layer = static_cast<double>(size.per_layer_params);
    const double moe_layer = moe_layers > 0 ? (P - embed - rest - static_cast<double>(dense_layers) * dense_layer) /
                                                  static_cast<double>(moe_layers)
                                            : 0;
    // A MoE layer's units: before its experts, the experts (this rank's), after them (the shared
    // experts); without expert parallelism all one unit (`before`).
    const bool cut = c.expert_parallelism > 1;
    const double layer_experts = cut ? s.E / static_cast<double>(c.expert_parallelism) * 3 * s.D * s.Fm : 0;
    const double after_experts = cut ? 3 * s.D * s.Fs : 0;
    const double before_experts = moe_layer - layer_experts - after_experts;
    const double expert_part = std::ceil(layer_experts / expert_ranks);
    const double moe_part = part(before_experts) + part(after_experts) + expert_part;  // this rank's share of one MoE layer
    const double S = part(embed) + part(rest) + static_cast<double>(dense_layers) * part(dense_layer) +
                     static_cast<double>(moe_layers) * moe_part;
    const double moe_gathered = R * (part(before_experts) + part(after_experts)) + expert_ranks * expert_part;
    const double layer = std::max(dense_layers > 0 ? R * part(dense_layer) : 0.0, moe_layers > 0 ? moe_gathered : 0.0);
    // optim_grads gathers one unit at a time (into the arena, through a buffer of the widest).
    const double widest_layer_unit =
        std::max({dense_layers > 0 ? R * part(dense_layer) : 0.0, moe_layers > 0 ? R * part(before_experts) : 0.0,
                  moe_layers > 0 ? R * part(after_experts) : 0.0, moe_layers > 0 ? expert_ranks * expert_part : 0.0});
    const double outer = R * (part(embed) + part(rest));
    const std::string shard_text =
        count_text(S) + " elements (this rank's 1/" + std::to_string(shard_ranks) + " of every unit" +
        (c.expert_parallelism > 1 ? ", 1/" + std::to_string(shard_ranks / c.expert_parallelism) + " of its experts'" : "") + ")";
    if (zero2)
      add(plan, "weights (fp32 flat buffer)", 4 * (P + std::max({widest_layer_unit, R * part(embed), R * part(rest)})),
          params + " x 4 B (AdamW updates this rank's " + shard_text + " in place) and the largest unit's gather buffer");
    else
      add(plan, "weights (fp32 shard + gathered units)", 4 * (S + outer + 2 * layer),
          "the shard of " + shard_text + ", the embedding and the rest (MTP, norm, head) gathered for the step, "
          "two decoder layers' buffers (one computing, the next one's gather in flight)");
    add(plan, "gradients (fp32 shard + unreduced units)", 4 * (S + outer + layer),
        "the reduced shard, the embedding's and the rest's local sums over K micro-batches, one decoder layer's "
        "until its reduction");
    add(plan, "optimizer state (AdamW)", adam_per_element * S, adam_detail + "the shard");
  } else {
    const double shard = zero1 ? std::ceil(P / static_cast<double>(zero1_ranks)) : P;
    const double padded = zero1 ? shard * static_cast<double>(zero1_ranks) : P;  // the arena, R equal chunks
    add(plan, "weights (fp32 flat buffer)", 4 * padded,
        params + " x 4 B" + (padded > P ? " (padded to " + count_text(padded) + ": R equal chunks)" : std::string()));
    add(plan, "gradients (fp32 flat buffer)", 4 * P, params + " x 4 B, accumulated in place over K micro-batches");
    add(plan, "optimizer state (AdamW)", adam_per_element * shard,
        adam_detail + count_text(shard) + " elements" +
            (zero1 ? " (ZeRO-1: 1/" + std::to_string(zero1_ranks) + " of P)" : ""));
  }
  plan.model_state_bytes = plan.total_bytes;

  // Weight copies kept for backward. Under remat_policy=full a decoder layer's copies are made
  // again when it is rerun, so only one layer's exist at a time.
  const bool full = c.remat_policy == "full";
  const double qkv_weights = s.D * (s.q + 2 * s.kv), gate_up_weights = 2 * s.D * s.F;
  const double mtp = static_cast<double>(c.mtp_num_layers);
  const std::string rerun_note = full ? " (remat_policy=full: one decoder layer's at a time)" : "";
  if (!bf16) {
    const double dense_copies = qkv_weights + gate_up_weights, moe_copies = qkv_weights + 2 * s.D * s.Fs;
    const double layer_copies = full ? std::max(dense_layers > 0 ? dense_copies : 0.0, moe_layers > 0 ? moe_copies : 0.0)
                                     : static_cast<double>(dense_layers) * dense_copies +
                                           static_cast<double>(moe_layers) * moe_copies;
    const double fused = layer_copies + mtp * (c.mtp_moe_mlp ? moe_copies : dense_copies);
    add(plan, "fused q/k/v and gate/up weight copies", 4 * fused,
        "concatenated per forward, fp32, kept for backward" + rerun_note);
  } else {
    const double norms_and_router = static_cast<double>(moe_layers) * s.E * s.D;
    const double matmul_weights = P - s.V * s.D * (c.logits_via_embedding ? 0 : 1) - norms_and_router;
    const double attention = qkv_weights + s.q * s.D;
    const double dense_layer = attention + 3 * s.D * s.F, moe_layer = attention + 3 * s.D * (s.E / static_cast<double>(c.expert_parallelism) * s.Fm + s.Fs);
    const double all_layers = static_cast<double>(dense_layers) * dense_layer + static_cast<double>(moe_layers) * moe_layer;
    const double kept_layers =
        full ? std::max(dense_layers > 0 ? dense_layer : 0.0, moe_layers > 0 ? moe_layer : 0.0) : all_layers;
    add(plan, "bf16 weight copies", 2 * (matmul_weights - all_layers + kept_layers),
        "autocast's bf16 cast of every matmul weight, kept for backward" + rerun_note);
  }

  // Activations of one micro-batch.
  // remat_policy=full keeps each decoder layer's input only; backward reruns one layer at a time,
  // whose own saved activations then exist once (the largest layer kind counts).
  const bool minimal = c.remat_policy == "minimal";
  const bool grouped = c.moe_dispatch == "grouped";
  const double dense = layer_saved_bytes(s, false, r, m, bf16, ctx, segment_masks, c.use_qk_norm, grouped);
  const double moe =
      moe_layers > 0 ? layer_saved_bytes(s, true, r, m, bf16, ctx, segment_masks, c.use_qk_norm, grouped) : 0.0;
  const double embedding = r * s.T * s.D;
  const double mask = segment_masks ? 2 * s.B * s.L * s.L + s.L * s.L : 0.0;  // bool masks: same segment, causal, both
  // num_vocab_tiling > 1: each head (the main one and every MTP depth's) keeps, from its tiled
  // forward, the gradients of its input (fp32 T D) and of the head weight (fp32 V D) instead of
  // the fp32 (T, V) log-probabilities.
  const bool tiled = c.num_vocab_tiling > 1;
  const double head_loss = tiled ? 4 * s.T * s.D + 4 * s.V * s.D : 4 * s.T * s.V;
  const double head = 2 * r * s.T * s.D + (bf16 ? 2 : 0) * s.T * s.D + head_loss;
  const double mtp_depth = r * s.T * s.D + 4 * r * s.T * s.D + 2 * r * s.T * s.D + (bf16 ? 4 : 0) * s.T * s.D + (c.mtp_moe_mlp ? moe : dense) +
                           2 * r * s.T * s.D + head_loss;
  // A GLA layer (docs/model.md) is counted as the GQA layer above without its softmax core (no
  // (L, L) probabilities or blocks) and with its chunked core's own tensors: fp32 copies of q, k,
  // v and the scaled, decay-weighted q and k (6 T H hd), the
  // within-chunk scores before and after the decay mask (2 B H L C), the state entering each chunk
  // (B H hd^2 per chunk), and the fp32 GroupRMSNorm input and output, gate and product (4 T H hd).
  // MLA layers are counted as GQA layers of the same heads (an estimate).
  int64_t gla_layers = 0;
  for (int64_t i = 0; i < layers; ++i) gla_layers += model_layer_attention(c, i) == "gla";
  const double hd = static_cast<double>(c.head_dim), chunk = static_cast<double>(std::min(c.gla_chunk_size, c.max_target_length));
  const double gla_extra = gla_layers == 0 ? 0.0
                                           : 4 * (10 * s.T * s.H * hd + 2 * s.B * s.H * s.L * chunk +
                                                  s.B * s.H * hd * hd * std::ceil(s.L / chunk));
  // What a GLA layer keeps beyond the GQA layer it is counted as (negative at long sequences).
  const double gla_delta = gla_layers == 0 ? 0.0 : gla_extra - attention_saved_bytes(s, m, ctx.attention, segment_masks, ctx.native_gqa);
  const double decoder_layers =
      full ? static_cast<double>(layers) * r * s.T * s.D + std::max(dense_layers > 0 ? dense : 0.0, moe) + std::max(0.0, gla_delta)
           : static_cast<double>(dense_layers) * dense + static_cast<double>(moe_layers) * moe +
                 static_cast<double>(gla_layers) * gla_delta;
  const double activations = embedding + mask + decoder_layers + head + mtp * mtp_depth;
  plan.activation_bytes = activations;
  std::string detail = "B " + count_text(s.B) + " x L " + count_text(s.L) + ": " + memory_bytes_text(dense) +
                       " per dense layer";
  if (moe_layers > 0) detail += ", " + memory_bytes_text(moe) + " per MoE layer";
  if (gla_layers > 0)
    detail += ", " + std::string(gla_delta < 0 ? "-" : "+") + memory_bytes_text(std::abs(gla_delta)) +
              " per GLA layer (its chunked core instead of softmax attention's)";
  if (moe_layers > 0 && c.expert_parallelism > 1) {
    // Dropless: a rank computes the rows the router sends its experts, T k in a balanced step. At
    // most every token of the N ranks picks min(k, E/N) of its experts.
    const double local = s.E / static_cast<double>(c.expert_parallelism);
    const double worst = static_cast<double>(c.expert_parallelism) * std::min(s.k, local) / s.k;
    char factor[32];
    std::snprintf(factor, sizeof factor, "%.3g", worst);
    detail += " (MoE rows: T k per rank as a balanced router sends; a rank whose experts every token picks computes up to " +
              std::string(factor) + "x that, no capacity limit)";
  }
  if (full) detail += " (remat_policy=full: each layer keeps its input, " + memory_bytes_text(r * s.T * s.D) +
                      ", and one layer at a time is rerun in backward)";
  if (minimal) detail += " (remat_policy=minimal: norms and SwiGLU recomputed, keeping what none keeps)";
  if (ctx.attention == AttentionCore::block_causal)
    detail += " (block-causal attention, blocks of " + std::to_string(kAttentionBlock) + " positions)";
  else
    detail += segment_masks ? " (fused attention, each layer keeping its B x 1 x L x L mask: " +
                                  memory_bytes_text(m * s.B * s.L * s.L) + ")"
                            : " (fused causal attention)";
  detail += tiled ? ", head input and weight gradients kept by the tiled loss: " + memory_bytes_text(head_loss)
                  : ", head log-probabilities B x L x V: " + memory_bytes_text(4 * s.T * s.V);
  add(plan, "activations saved for backward (one micro-batch)", activations, detail);

  // Tiled: one tile's fp32 logits (turned into their gradient in place) and its bf16 copy, the
  // head weight's bf16 copy, and in the backward the scaled weight gradient.
  const double tile_rows = std::ceil(s.T / static_cast<double>(std::max<int64_t>(c.num_vocab_tiling, 1)));
  // bf16 GEMMs summed as fp32 on the CPU (cpu_bf16_gemm) add fp32 copies of their operands and
  // products: the head weight's and its gradient's and that gradient's bf16 rounding (10 V D), and
  // a tile's fp32 product and gradient (tiled) or the fp32 logits gradient (whole). (The MoE
  // experts' per-thread fp32 operand copies are not counted.)
  // Whole: the peak is log_softmax's backward, holding the log-probabilities (counted above), the
  // gradient it receives and the one it makes (2 x fp32 T V). The (T, V) tensors after it (the
  // gradient's bf16 cast, the fp32 operand of a GEMM summed in fp32) exist once the
  // log-probabilities are freed, so they stay below that peak (measured: the bf16 run's peak equals
  // the fp32 one's, docs/benchmarks.md). With z-loss the whole head keeps the logits' gradient
  // instead of the log-probabilities and scales it in the backward: one (T, V) tensor less.
  const bool fp32_sums = bf16 && ctx.cpu_bf16_fp32_sums;
  const double head_transient = (tiled ? (4 + (bf16 ? 2 : 0)) * tile_rows * s.V + (bf16 ? 2 : 0) * s.V * s.D + 4 * s.V * s.D
                                       : 2 * 4 * s.T * s.V + 4 * s.V * s.D) +
                                (fp32_sums ? 10 * s.V * s.D + (tiled ? 4 * tile_rows * s.V : 0.0) : 0.0);
  // The block-causal attention's backward holds two fp32 (B, H, b, L) buffers for the block at
  // hand (the fused kernels' backward works in tiles).
  // With fp32 sums, the block-causal backward also holds fp32 copies of q, k, v and the output
  // gradient, fp32 k and v gradients, and two more fp32 block buffers.
  const double block_rows = std::min(static_cast<double>(kAttentionBlock), s.L);
  const double attention_transient =
      ctx.attention == AttentionCore::block_causal
          ? 2 * 4 * s.B * s.H * block_rows * s.L +
                (fp32_sums ? 4 * s.T * (2 * s.q + 4 * s.kv) + 2 * 4 * s.B * s.H * block_rows * s.L : 0.0)
          : 0.0;
  // A MoE layer's backward (moe_dispatch=grouped) holds, for its T k routed rows in the compute
  // dtype, the incoming gradient, the recomputed h and the row gradients dh, [dg | du] and dx, and
  // the weight gradients of all of this rank's experts, in the compute dtype and (bf16) their
  // fp32 cast; the loop's autograd holds every expert's fp32 weight gradient while it stacks them
  // into another (and, bf16, each expert's bf16 one).
  const double local_experts = s.E / static_cast<double>(c.expert_parallelism);
  const double expert_weights = local_experts * 3 * s.D * s.Fm;
  const bool moe_blocks = moe_layers > 0 || (c.mtp_num_layers > 0 && c.mtp_moe_mlp);
  const double moe_transient =
      !moe_blocks ? 0.0
      : grouped   ? m * s.T * s.k * (4 * s.Fm + 2 * s.D) + (m + (bf16 ? 4 : 0)) * expert_weights
                  : (8 + (bf16 ? 2 : 0)) * expert_weights;
  const double transient = std::max({head_transient, attention_transient, moe_transient});
  add(plan, "backward transients", transient,
      std::string(transient == head_transient
                      ? (tiled ? "one tile of logits (num_vocab_tiling), output head weight gradient"
                               : "gradients of the logits and log-probabilities, output head weight gradient")
                  : transient == attention_transient ? "attention block gradients"
                                                     : "a MoE layer's routed-row and expert weight gradients") +
          (fp32_sums ? ", with the fp32 operand copies of bf16 GEMMs summed in fp32 (cpu_bf16_gemm)" : ""));

  const double data = 2.0 * static_cast<double>(c.gradient_accumulation_steps + 2) * s.T * (5 * 8 + 4);
  add(plan, "data buffers", data, "prefetched micro-batches, host and device copies");
  if (!ctx.cuda && c.enable_checkpointing) {
    // A save snapshots weights and optimizer state to host memory: all of it on rank 0 (the one
    // writer), or, with sharded levels over several ranks, each rank its own checkpoint shard
    // (about 1/R). With expert parallelism and one writer, every rank also gathers every expert
    // of the three (Trainer::with_all_experts) beside its own copy of its share. Asynchronous
    // saves hold it while training goes on (one at a time: a save waits for the previous one
    // before its snapshot); synchronous ones only between steps, when the activations are gone,
    // so then only the excess over them counts.
    const bool own_shard = (zero2 || zero3) && ctx.world_size > 1;
    const double gathered_experts = !own_shard && c.expert_parallelism > 1 ? static_cast<double>(size.routed_expert_params) : 0.0;
    const double snapshot = 12 * P / (own_shard ? static_cast<double>(ctx.world_size) : 1.0) + 12 * gathered_experts;
    const double counted = c.async_checkpointing ? snapshot : std::max(0.0, snapshot - activations - transient);
    add(plan, "checkpoint snapshot", counted,
        std::string(c.async_checkpointing ? "async saves: " : "synchronous saves, beyond the activations: ") +
            (own_shard ? "this rank's checkpoint shard"
                       : gathered_experts > 0 ? "weights + optimizer state, and every expert of them gathered"
                                              : "weights + optimizer state") +
            " copied to host (" +
            memory_bytes_text(snapshot) + ")");
  }
  if (!ctx.cuda) add(plan, "runtime", kCpuRuntimeBytes, "LibTorch, OpenBLAS buffers, allocator (measured)");
  return plan;
}

std::string memory_plan_format(const MemoryPlan& plan) {
  std::string out;
  char buf[512];
  for (const auto& item : plan.items) {
    std::snprintf(buf, sizeof buf, "  %-50s %12s  (%s)\n", item.name.c_str(), memory_bytes_text(item.bytes).c_str(),
                  item.detail.c_str());
    out += buf;
  }
  std::snprintf(buf, sizeof buf, "  %-50s %12s  (%.0f bytes)\n", "total", memory_bytes_text(plan.total_bytes).c_str(),
                plan.total_bytes);
  return out + buf;
}

namespace {

// The number after `key` in a /proc file of "Key:   123 kB" lines, in bytes; -1 if absent.
double proc_kb(const std::string& path, const std::string& key) {
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);)
    if (line.rfind(key + ":", 0) == 0) return std::stod(line.substr(key.size() + 1)) * 1024.0;
  return -1;
}

// A number from a one-line cgroup file; -1 for "max", absent or unreadable.
double cgroup_value(const std::string& path) {
  std::ifstream in(path);
  std::string text;
  if (!(in >> text) || text == "max") return -1;
  try {
    return std::stod(text);
  } catch (...) {
    return -1;
  }
}

}  // namespace

HostMemory host_memory_available(int64_t ranks_on_host) {
  HostMemory memory;
  memory.available_bytes = -1;
  memory.resident_bytes = std::max(0.0, proc_kb("/proc/self/status", "VmRSS"));
  const std::string divided =
      ranks_on_host > 1 ? ", divided by the " + std::to_string(ranks_on_host) + " ranks on this machine" : "";
  const auto consider = [&](double bytes, const std::string& source, bool shared) {
    if (bytes < 0) return;
    if (shared) bytes /= static_cast<double>(std::max<int64_t>(1, ranks_on_host));
    if (memory.available_bytes < 0 || bytes < memory.available_bytes) {
      memory.available_bytes = bytes;
      memory.source = source + (shared ? divided : "");
    }
  };
  consider(proc_kb("/proc/meminfo", "MemAvailable"), "MemAvailable in /proc/meminfo", true);
  // cgroup v2, then v1 (a container's limit is below MemAvailable, which shows the host's).
  const double limit2 = cgroup_value("/sys/fs/cgroup/memory.max");
  if (limit2 >= 0)
    consider(limit2 - std::max(0.0, cgroup_value("/sys/fs/cgroup/memory.current")), "the cgroup's memory.max", true);
  const double limit1 = cgroup_value("/sys/fs/cgroup/memory/memory.limit_in_bytes");
  if (limit1 >= 0 && limit1 < 1e18)
    consider(limit1 - std::max(0.0, cgroup_value("/sys/fs/cgroup/memory/memory.usage_in_bytes")),
             "the cgroup's memory.limit_in_bytes", true);
  struct rlimit limit {};
  if (getrlimit(RLIMIT_AS, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY)
    consider(static_cast<double>(limit.rlim_cur) - std::max(0.0, proc_kb("/proc/self/status", "VmSize")),
             "RLIMIT_AS (ulimit -v)", false);
  if (getrlimit(RLIMIT_DATA, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY)
    consider(static_cast<double>(limit.rlim_cur) - std::max(0.0, proc_kb("/proc/self/status", "VmData")),
             "RLIMIT_DATA (ulimit -d)", false);
  memory.available_bytes = std::max(0.0, memory.available_bytes);
  if (memory.source.empty()) memory.source = "none readable: /proc/meminfo, the cgroup, the rlimits";
  return memory;
}

std::vector<std::string> memory_plan_suggestions(const Config& config, const MemoryPlanContext& context,
                                                 double available_bytes, double already_resident_bytes) {
  const auto fits = [&](const Config& c) {
    return memory_plan(c, context).total_bytes - already_resident_bytes <= available_bytes;
  };
  std::vector<std::string> out;
  const auto try_config = [&](Config c, const std::string& text) {
    if (fits(c)) out.push_back(text);
  };
  const int64_t B = config.per_device_batch_size, K = config.gradient_accumulation_steps;
  // The largest smaller batch that fits, with K raised to keep the global batch.
  for (int64_t b = B / 2; b >= 1; b /= 2) {
    if (B % b != 0) continue;
    Config c = config;
    c.per_device_batch_size = b;
    c.gradient_accumulation_steps = K * (B / b);
    if (fits(c)) {
      out.push_back("per_device_batch_size=" + std::to_string(b) + " gradient_accumulation_steps=" +
                    std::to_string(K * (B / b)) + " (same global batch)");
      break;
    }
  }
  if (context.world_size > 1 && config.data_parallel_sharding == "none") {
    Config c = config;
    c.data_parallel_sharding = "optim";
    try_config(c, "data_parallel_sharding=optim (ZeRO-1 over " + std::to_string(context.world_size / config.expert_parallelism) +
                      " ranks)");
  }
  if (context.world_size > 1 && config.data_parallel_sharding != "optim_grads_params") {
    Config c = config;
    c.data_parallel_sharding = "optim_grads_params";
    c.remat_policy = "full";
    try_config(c, "data_parallel_sharding=optim_grads_params remat_policy=full (ZeRO-3 over " +
                      std::to_string(context.world_size) + " ranks)");
  }
  if (config.remat_policy != "full") {
    Config c = config;
    c.remat_policy = "full";
    try_config(c, "remat_policy=full (each decoder layer keeps its input only and is rerun in backward)");
  }
  if (config.num_vocab_tiling == 1) {  // the fewest tiles that fit: each tile is one more pass over the head's weight
    for (const int64_t tiles : {4, 16, 64}) {
      Config c = config;
      c.num_vocab_tiling = tiles;
      if (fits(c)) {
        out.push_back("num_vocab_tiling=" + std::to_string(tiles) + " (no whole (B, L, V) logits)");
        break;
      }
    }
  }
  if (config.dtype == "float32") {
    Config c = config;
    c.dtype = "bfloat16";
    try_config(c, "dtype=bfloat16 (bf16 activations)");
  }
  if (config.enable_checkpointing && config.async_checkpointing) {
    Config c = config;
    c.async_checkpointing = false;
    try_config(c, "async_checkpointing=false (no snapshot held while training)");
  }
  return out;
}

}  // namespace trainer
