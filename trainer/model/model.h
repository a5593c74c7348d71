// Public face of model/: the Llama-family decoder (DESIGN section 4). Submodules are registered
// under Hugging Face Llama/Qwen3 names, so named_parameters() are the checkpoint keys:
// model.embed_tokens.weight, model.layers.N.self_attn.q_proj.weight, model.norm.weight, lm_head.weight.
#pragma once
#include <functional>

#include <torch/torch.h>

#include "trainer/config/config.h"
#include "trainer/model/model_size.h"

namespace trainer {

class Communicator;  // dist/dist.h: the expert-parallel group of a MoE layer

// y = x / rms(x) * weight, computed in fp32 whatever the input dtype.
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;  // (dim)
 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

// The model's weights are built uninitialized: construction allocates but touches no memory, and
// model_build (or, under optim_grads_params, the sharded state, one unit at a time) draws every
// value. So a rank that shards the model never holds more than one unit of initial weights.

// A bias-free linear layer, y = x W^T (torch::nn::Linear without its initialization).
class LinearImpl : public torch::nn::Module {
 public:
  LinearImpl(int64_t in, int64_t out);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;  // (out, in)
};
TORCH_MODULE(Linear);

// A token embedding table (torch::nn::Embedding without its initialization).
class EmbeddingImpl : public torch::nn::Module {
 public:
  EmbeddingImpl(int64_t vocab, int64_t dim);
  torch::Tensor forward(const torch::Tensor& tokens);  // (B, L) int64 -> (B, L, D)
  torch::Tensor weight;  // (V, D)
};
TORCH_MODULE(Embedding);

// Rotary embedding tables for explicit per-token positions (positions restart per document).
struct RopeTables {
  torch::Tensor cos;         // (B, 1, L, rotary_dim): cos of (angles, angles)
  torch::Tensor sin_signed;  // (B, 1, L, rotary_dim): (-sin(angles), sin(angles)), see apply_rope
};

// Causal grouped-query attention that only attends within the token's own segment.
class AttentionImpl : public torch::nn::Module {
 public:
  explicit AttentionImpl(const Config& config);
  // x: (B, L, D); allowed: (B, 1, L, L) or (L, L) bool, true where query i may attend to key
  // j, or undefined for plain causal attention (LibTorch 2.x).
  // recompute_norms: q/k norms recomputed in backward (remat_policy=minimal).
  torch::Tensor forward(const torch::Tensor& x, const RopeTables& rope, const torch::Tensor& allowed,
                        bool recompute_norms = false);
  Linear q_proj{nullptr};  // (Hq*hd, D)
  Linear k_proj{nullptr};  // (Hkv*hd, D)
  Linear v_proj{nullptr};  // (Hkv*hd, D)
  Linear o_proj{nullptr};  // (D, Hq*hd)
  RMSNorm q_norm{nullptr};            // (hd), only with use_qk_norm
  RMSNorm k_norm{nullptr};            // (hd), only with use_qk_norm
 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
};
TORCH_MODULE(Attention);

// RMSNorm over `groups` equal slices of the last dimension (the GLA output norm, GroupRMSNorm
// of the Ling2 fork: group_norm_size is the number of groups), fp32 whatever the input dtype.
class GroupRMSNormImpl : public torch::nn::Module {
 public:
  GroupRMSNormImpl(int64_t dim, int64_t groups, double eps);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;  // (dim)
 private:
  int64_t groups_;
  double eps_;
};
TORCH_MODULE(GroupRMSNorm);

// Multi-head latent attention (DeepSeek-V3; the Ling2 fork's attention_mla.py), HF DeepSeek names:
//   c_q = q_a_layernorm(x W_qa^T)                       (B, L, r_q)     [q_lora_rank > 0]
//   q   = c_q W_qb^T  (or x W_q^T)  -> per head (q_nope, q_pe)      (nope + rope dims)
//   [c_kv; k_pe] = x W_kva^T,  c_kv = kv_a_layernorm(c_kv)          (r_kv, rope dims)
//   [k_nope; v] = c_kv W_kvb^T per head;  k = (k_nope, RoPE(k_pe)) with k_pe shared by every head
//   o = softmax(s (q_nope.k_nope + RoPE(q_pe).RoPE(k_pe)), causal and same segment) v
// s = (nope + rope)^-1/2, times (0.1 mscale ln(rope_factor) + 1)^2 when max_position_embeddings >
// original_max_position_embeddings. RoPE pairs (2i, 2i+1) with mla_interleaved_rope.
class MlaAttentionImpl : public torch::nn::Module {
 public:
  explicit MlaAttentionImpl(const Config& config);
  // x: (B, L, D); rope: the MLA tables (qk_rope_head_dim wide); allowed as for AttentionImpl.
  torch::Tensor forward(const torch::Tensor& x, const RopeTables& rope, const torch::Tensor& allowed);
  Linear q_a_proj{nullptr};            // (r_q, D), with q_lora_rank > 0
  RMSNorm q_a_layernorm{nullptr};                 // (r_q), with q_lora_rank > 0
  Linear q_b_proj{nullptr};            // (H*(nope+rope), r_q), with q_lora_rank > 0
  Linear q_proj{nullptr};              // (H*(nope+rope), D), with q_lora_rank = 0
  Linear kv_a_proj_with_mqa{nullptr};  // (r_kv + rope, D)
  RMSNorm kv_a_layernorm{nullptr};                // (r_kv)
  Linear kv_b_proj{nullptr};           // (H*(nope+v), r_kv)
  Linear o_proj{nullptr};              // (D, H*v)
  double softmax_scale = 0;                       // s above
 private:
  int64_t num_heads_, q_lora_rank_, kv_lora_rank_, nope_dim_, rope_dim_, v_dim_;
  bool interleaved_rope_;
};
TORCH_MODULE(MlaAttention);

// Gated linear attention as the Ling2 fork defines it (attention_gla.py, "simple GLA" with a
// constant per-head decay, Lightning-Attention style): per head h, for t = 1..L,
//   S_t = exp(gamma_h) S_{t-1} + k_t^T v_t,   o_t = q_t S_t / sqrt(hd)         (S: (hd, hd))
// with q, k after their RMSNorm (use_qk_norm) and partial RoPE, the state reset where a new
// document (segment) begins. gamma_h = -slope_h (1 - layer / (N - 1) + 1e-5), slope_h the ALiBi
// slopes of H heads. Then y = o_proj(g_norm(o) * sigmoid(x W_g^T)). Computed in chunks
// (model_gla_attention_chunked); the token-by-token recurrence is the test oracle.
class GlaAttentionImpl : public torch::nn::Module {
 public:
  GlaAttentionImpl(const Config& config, int64_t layer_index);
  // x: (B, L, D); rope: the decoder's tables; segment_ids: (B, L), or undefined for one document per row.
  torch::Tensor forward(const torch::Tensor& x, const RopeTables& rope, const torch::Tensor& segment_ids);
  torch::Tensor decay(const torch::Device& device);  // (H) fp32 gamma_h, on `device`
  Linear q_proj{nullptr};  // (H*hd, D)
  Linear k_proj{nullptr};  // (H*hd, D)
  Linear v_proj{nullptr};  // (H*hd, D)
  Linear g_proj{nullptr};  // (H*hd, D): output gate
  Linear o_proj{nullptr};  // (D, H*hd)
  RMSNorm q_norm{nullptr};            // (hd), only with use_qk_norm
  RMSNorm k_norm{nullptr};            // (hd), only with use_qk_norm
  GroupRMSNorm g_norm{nullptr};       // (H*hd), group_norm_size groups
 private:
  int64_t num_heads_, head_dim_, chunk_size_;
  bool linear_silu_, reset_at_documents_;
  std::vector<double> gamma_;  // (H) on the host
  torch::Tensor gamma_cache_;  // (H) gamma_ on the device of the last forward
};
TORCH_MODULE(GlaAttention);

// The GLA core in chunked parallel form. q, k: (B, H, L, dk); v: (B, H, L, dv); gamma: (H) log
// decays (< 0); segment_ids: (B, L) with each document one contiguous run, or undefined (one
// document per row); chunk: tokens per chunk (L need not be a multiple). Computes in fp32 (autocast
// off) and returns (B, H, L, dv) fp32: o_t = sum over s <= t in t's document of
// exp((t - s) gamma) (q_t . k_s) v_s / sqrt(dk).
torch::Tensor model_gla_attention_chunked(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                    const torch::Tensor& gamma, const torch::Tensor& segment_ids, int64_t chunk);

// ALiBi slopes of H heads (Press et al.; the Ling2 fork's build_slope_tensor): 2^(-8i/H) for
// i = 1..H when H is a power of two, else the next power's odd-indexed slopes fill the rest.
std::vector<double> model_gla_head_slopes(int64_t heads);

// SwiGLU: down(silu(gate(x)) * up(x)), gate and up as one GEMM over their concatenated weights
// (model.cpp, linear_fused) and silu(g) * u as one autograd node that keeps only its input.
class MlpImpl : public torch::nn::Module {
 public:
  MlpImpl(int64_t dim, int64_t hidden);
  torch::Tensor forward(const torch::Tensor& x);
  Linear gate_proj{nullptr};  // (F, D)
  Linear up_proj{nullptr};    // (F, D)
  Linear down_proj{nullptr};  // (D, F)
};
TORCH_MODULE(Mlp);

// What every MoE layer of one forward reports (see moe.cpp for the formulas).
struct MoeLayerStats {
  torch::Tensor load_balance;  // 0-dim: E * sum_e f_e P_e over valid tokens (1 when balanced)
  torch::Tensor router_z;      // 0-dim: mean over valid tokens of logsumexp(router logits)^2
  torch::Tensor counts;        // (E) fp32, detached: valid tokens routed to each expert
  torch::Tensor probs_std;     // 0-dim, detached: std of the router scores (before the bias) over
                               // valid tokens and experts; near 0 when the router cannot tell experts apart
};

// Per-forward context shared by all blocks.
struct BlockContext {
  RopeTables rope;
  RopeTables rope_mla;    // MLA layers' tables (qk_rope_head_dim wide, rope_type); undefined without MLA
  torch::Tensor segment_ids;  // (B, L) int64 for GLA's document resets; undefined with one segment per row
  torch::Tensor allowed;  // (B, 1, L, L) bool: causal and same segment; undefined for plain
                          // causal (one segment per row)
  torch::Tensor valid;    // (B, L) bool: real tokens (segment id != 0)
  std::vector<MoeLayerStats>* moe_stats = nullptr;  // MoE layers append here
  bool recompute_elementwise = false;  // remat_policy=minimal while recording: see recompute()
};

// Activation recomputation (remat_policy, docs/memory.md). Returns fn(inputs); while autograd
// records, fn's intermediate tensors are not kept: fn runs once without recording, and again in
// backward from the saved inputs (under the autocast state of the forward), whose gradients then
// flow through the rerun. Parameters fn reads get their gradients there, accumulated into .grad
// as usual. fn must be deterministic (no randomness in this model) and must not append to
// anything outside its result (MoE statistics are returned as outputs instead, so they are
// counted once). Outputs that backward gives no gradient (counts) carry none.
using RecomputeFn = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;
std::vector<torch::Tensor> recompute(const RecomputeFn& fn, const std::vector<torch::Tensor>& inputs);

// A decoder layer as a unit of sharded data parallelism (data_parallel_sharding = optim_grads |
// optim_grads_params, trainer/train/sharding.h): the stack calls `gather` before every run of
// layer i (its forward, and its rerun in backward: `backward`, when the next layer to run is i - 1),
// so that its parameters hold their values, and
// `grads_ready` right after layer i's backward, when its parameters' .grad hold this micro-batch's
// gradients of the layer and nothing else (the hook reduces them and zeroes .grad).
class DecoderLayerHooks {
 public:
  virtual ~DecoderLayerHooks() = default;
  virtual void decoder_layer_gather(int64_t layer, bool backward) = 0;
  virtual void decoder_layer_grads_ready(int64_t layer) = 0;
  // Whether backward reruns the layer from its input (needed when its parameters are freed after
  // forward); otherwise the layer's autograd graph is kept from forward.
  virtual bool decoder_layer_rerun() const = 0;
};

// recompute() with hooks: before_run precedes every run of fn (its argument: the run is the rerun
// in backward); after_backward follows the
// backward through fn, once its parameter gradients are accumulated. rerun=false keeps fn's graph
// from forward instead of rerunning it (the hooks still bracket backward). Without recording,
// fn runs once after before_run.
struct UnitHooks {
  bool rerun = true;
  std::function<void(bool backward)> before_run;
  std::function<void()> after_backward;
};
std::vector<torch::Tensor> run_unit(const RecomputeFn& fn, const std::vector<torch::Tensor>& inputs, UnitHooks hooks);

// Router of a MoE layer ("mlp.gate" in DeepSeek-V3 names).
class MoeGateImpl : public torch::nn::Module {
 public:
  MoeGateImpl(int64_t dim, int64_t num_experts);
  torch::Tensor weight;                   // (E, D)
  torch::Tensor e_score_correction_bias;  // (E) buffer: selection-only bias, updated outside autograd
};
TORCH_MODULE(MoeGate);

// The routed experts of one MoE layer, stacked so that all of them run as one grouped computation
// (and, with expert parallelism, so that a rank's share is one slice). Expert e is the SwiGLU
//   Expert_e(x) = down_proj[e] (silu(x W_gate^T) * (x W_up^T)),  [W_gate; W_up] = gate_up_proj[e].
// Checkpoints keep one tensor per expert under Hugging Face names (model_checkpoint_views).
class MoeExpertsImpl : public torch::nn::Module {
 public:
  MoeExpertsImpl(int64_t num_experts, int64_t dim, int64_t hidden);
  // x_sorted: (M, D) rows grouped by expert, group_sizes[e] rows for expert e in order (host
  // values summing to M). Returns (M, D) in the compute dtype (bf16 under autocast).
  // grouped: one autograd node over all experts with a hand-written backward (moe.cpp);
  // otherwise one autograd subgraph per non-empty expert (the reference the grouped path is tested against).
  torch::Tensor forward(const torch::Tensor& x_sorted, const std::vector<int64_t>& group_sizes, bool grouped);
  // The grouped path with the group sizes left on the device (group_sizes: (E) int64 there):
  // at::_grouped_mm, CUDA and bf16 autocast only; usable_on_device says when.
  bool usable_on_device(const torch::Tensor& x_sorted) const;
  torch::Tensor forward_on_device(const torch::Tensor& x_sorted, const torch::Tensor& group_sizes);
  torch::Tensor gate_up_proj;  // (E, 2F, D): rows [0, F) gate, [F, 2F) up
  torch::Tensor down_proj;     // (E, D, F)
};
TORCH_MODULE(MoeExperts);

// The indices (N, k) of the k largest entries of each row of scores (N, E), largest first, k
// distinct experts per row. On the CPU ties go to the lower index and a NaN is never preferred to
// a number; on other devices this is ATen's topk.
torch::Tensor moe_top_k_experts(const torch::Tensor& scores, int64_t k);

// How many contiguous runs of experts the grouped CPU experts (fp32/fp64 on OpenBLAS) compute in
// parallel, each on its own thread with BLAS single-threaded; 0 (the default) = OpenBLAS's thread
// count. For tests: results do not depend on it.
void moe_expert_parts_set(int parts);

// Whether RMSNorm, RoPE, SwiGLU and a MoE layer's routing on the CPU run as loops over rows
// (row_kernels.h) or as ATen kernels, as on CUDA (and, for RMSNorm and RoPE, for bf16 inputs). On
// by default. For tests: both compute the same function.
void cpu_row_kernels_set(bool enabled);

// DeepSeek/Ling-style dropless MoE: router -> softmax|sigmoid scores -> top-k (on scores + bias)
// -> optional renormalization -> routed_scaling_factor; routed SwiGLU experts plus shared experts.
class MoeImpl : public torch::nn::Module {
 public:
  explicit MoeImpl(const Config& config);
  // x: (B, L, D) -> (B, L, D); appends this layer's stats to ctx.moe_stats.
  torch::Tensor forward(const torch::Tensor& x, const BlockContext& ctx);
  // Expert parallelism: this layer holds experts [rank * E/N, (rank + 1) * E/N) of its group of N
  // ranks (`group`, which outlives the model) and sends each routed row to the rank holding its
  // expert. `name` ("MoE layer 2 (model.layers.2.mlp)") is used in error messages.
  // kill_before_dispatch: the debug hook of the death test (SIGKILL before the first exchange).
  void expert_parallel_set(Communicator* group, const std::string& name, bool kill_before_dispatch = false);
  MoeGate gate{nullptr};
  MoeExperts experts{nullptr};             // E routed SwiGLU experts of width base_moe_mlp_dim
  Mlp shared_experts{nullptr};             // Mlp(D, shared_experts * base_moe_mlp_dim), optional
 private:
  int64_t num_experts_, top_k_;
  bool sigmoid_, norm_topk_prob_, use_bias_;
  double scaling_;
  int64_t routing_groups_, topk_routing_group_;  // group-limited routing; -1 = off
  bool grouped_dispatch_;                        // moe_dispatch == grouped
  bool balance_loss_on_;                         // load_balance_loss_weight > 0
  Communicator* expert_group_ = nullptr;         // expert parallelism; null: every expert is here
  std::string name_;
  bool kill_before_dispatch_ = false;
  // The experts' output for x_sorted (rows grouped by expert, group_sizes[e] for each of the E
  // experts), from the local experts or through the expert-parallel group.
  torch::Tensor run_experts(const torch::Tensor& x_sorted, const std::vector<int64_t>& group_sizes);
};
TORCH_MODULE(Moe);

// A decoder layer: x + attn(input_layernorm(x)), then + mlp(post_attention_layernorm(.)). Its
// attention is the one model_layer_attention gives for its index (0-based; MTP layers follow
// the decoder layers), registered as "self_attn" whichever it is.
class DecoderLayerImpl : public torch::nn::Module {
 public:
  DecoderLayerImpl(const Config& config, bool use_moe, int64_t layer_index);
  torch::Tensor forward(const torch::Tensor& x, const BlockContext& ctx);
  RMSNorm input_layernorm{nullptr};
  Attention self_attn{nullptr};        // attention_type global
  MlaAttention mla_attn{nullptr};      // attention_type mla (registered as "self_attn")
  GlaAttention gla_attn{nullptr};      // GLA (registered as "self_attn")
  RMSNorm post_attention_layernorm{nullptr};
  Mlp mlp{nullptr};  // registered as "mlp" when dense
  Moe moe{nullptr};  // registered as "mlp" when MoE
};
TORCH_MODULE(DecoderLayer);

// One DeepSeek-V3 multi-token-prediction depth, stored after the decoder layers as
// model.layers.{N + k - 1}: h_k = Block(eh_proj([enorm(embed(t_{i+k})); hnorm(h_{k-1})])),
// logits_k = head(shared_head.norm(h_k)). The embedding and the output head are shared with the
// main model. The block's MLP is dense, or a MoE block like the decoder's with mtp_moe_mlp (Ling
// 2.0); h_{k-1} is taken before or after its final norm (mtp_input_after_final_norm).
class SharedHeadImpl : public torch::nn::Module {
 public:
  SharedHeadImpl(int64_t dim, double eps);
  RMSNorm norm{nullptr};
};
TORCH_MODULE(SharedHead);

class MtpLayerImpl : public DecoderLayerImpl {
 public:
  MtpLayerImpl(const Config& config, int64_t depth);  // depth k = 1.. is layer N + k - 1
  // previous: (B, L, D) hidden of depth k-1 (pre final norm); shifted_embeddings: (B, L, D).
  torch::Tensor forward_depth(const torch::Tensor& previous, const torch::Tensor& shifted_embeddings,
                              const BlockContext& ctx);
  RMSNorm enorm{nullptr};
  RMSNorm hnorm{nullptr};
  Linear eh_proj{nullptr};  // (D, 2D)
  SharedHead shared_head{nullptr};
};
TORCH_MODULE(MtpLayer);

// The decoder stack without the output head ("model." in HF names).
class DecoderStackImpl : public torch::nn::Module {
 public:
  explicit DecoderStackImpl(const Config& config);
  // Rotary tables, attention mask and validity for one batch (see TransformerImpl::forward).
  BlockContext context(const torch::Tensor& positions, const torch::Tensor& segment_ids, bool one_segment_per_row) const;
  // The decoder layers (not MTP): embeddings (B, L, D) -> hidden (B, L, D) before the final norm.
  torch::Tensor forward(const torch::Tensor& embeddings, const BlockContext& ctx);
  Embedding embed_tokens{nullptr};  // (V, D)
  torch::nn::ModuleList layers{nullptr};       // N DecoderLayers, then mtp_num_layers MtpLayers
  RMSNorm norm{nullptr};                       // (D)
  int64_t num_decoder_layers = 0;
  std::string remat_policy = "none";           // none | full | minimal
  DecoderLayerHooks* layer_hooks = nullptr;    // set by sharded data parallelism (not owned)
 private:
  int64_t rotary_dim_;
  double rope_theta_;
  std::vector<double> scaled_inv_freq_;          // (rotary_dim / 2) global layers' llama3 / yarn frequencies; empty: unscaled
  mutable torch::Tensor global_inv_freq_device_;  // (rotary_dim / 2) fp32, on the device of the last forward
  std::vector<double> mla_inv_freq_;          // (qk_rope_head_dim / 2) MLA RoPE frequencies; empty unless attention_type=mla
  mutable torch::Tensor mla_inv_freq_device_;  // (qk_rope_head_dim / 2) fp32, on the device of the last forward
  double global_rope_scale_ = 1.0, mla_rope_scale_ = 1.0;  // cos and sin times this (config_rope_attention_factor)
};
TORCH_MODULE(DecoderStack);

struct ModelOutput {
  torch::Tensor logits;                   // (B, L, V) fp32: position i predicts token i+1
  std::vector<torch::Tensor> mtp_logits;  // mtp_num_layers x (B, L, V) fp32: depth k predicts token i+k+1
  torch::Tensor head_input;                    // (B, L, D): the final norm's output, what the head reads
  std::vector<torch::Tensor> mtp_head_inputs;  // mtp_num_layers x (B, L, D): each depth's head input
  std::vector<MoeLayerStats> moe_stats;   // one entry per MoE layer, in layer order
};

class TransformerImpl : public torch::nn::Module {
 public:
  explicit TransformerImpl(const Config& config);
  // tokens, positions, segment_ids: (B, L) int64. Logits are fp32 (or float64 when the model
  // was converted to float64, as gradient checks do). one_segment_per_row: the caller knows
  // every segment id is 1 (no padding, no packed-document boundary), so the segment mask equals
  // the causal mask and attention runs as plain causal (LibTorch 2.x: the fused flash kernel,
  // which takes no arbitrary mask). The result is the same either way. logits=false leaves
  // logits and mtp_logits empty (the tiled loss applies the head itself, to head_weight()).
  ModelOutput forward(const torch::Tensor& tokens, const torch::Tensor& positions,
                      const torch::Tensor& segment_ids, bool one_segment_per_row = false, bool logits = true);
  // The output head's (V, D) weight: lm_head's, or the embedding's when tied.
  torch::Tensor head_weight() const;
  // The MoE layers in order, decoder layers then MTP blocks with mtp_moe_mlp (empty for dense
  // models): the order of ModelOutput::moe_stats. Their gate buffers hold the expert bias.
  std::vector<Moe> moe_layers();
  DecoderStack model{nullptr};
  Linear lm_head{nullptr};  // (V, D); null with logits_via_embedding (tied)
 private:
  torch::Tensor head(const torch::Tensor& normed_hidden);
  int64_t mtp_num_layers_;
  bool mtp_input_after_final_norm_;
};
TORCH_MODULE(Transformer);

// Depth-k MTP inputs: the token k positions ahead in the same segment, else token 0 (Megatron's
// roll_tensor fills 0; a pad id of -1 could not be embedded). Only positions whose loss is not
// counted get the fill, and causal attention keeps it from the counted ones.
// tokens, segment_ids: (B, L). Returns (B, L).
torch::Tensor mtp_shift_tokens(const torch::Tensor& tokens, const torch::Tensor& segment_ids, int64_t k);

// Checkpoint tensors under Hugging Face names (docs/checkpoints.md) from tensors named as
// named_parameters() (the parameters themselves, or same-shaped views of a copy of the arena):
// every stacked expert parameter becomes one view per expert,
//   experts.gate_up_proj (E, 2F, D) -> experts.{e}.gate_proj.weight, experts.{e}.up_proj.weight
//   experts.down_proj    (E, D, F)  -> experts.{e}.down_proj.weight
// in the order e = 0..E-1 (gate, up, down), the order a per-expert model had; everything else
// passes through. Views share storage: copying into them writes the parameters.
// Whether a parameter is a stacked expert tensor (mlp.experts.gate_up_proj, mlp.experts.down_proj).
bool model_is_stacked_experts(const std::string& parameter_name);
// The second of a layer's two stacked expert tensors (down_proj after gate_up_proj): checkpoint
// names pair them, so whatever splits parameters into groups keeps it with the one before.
bool model_is_stacked_down_proj(const std::string& parameter_name);

// With expert parallelism the stacked tensors hold experts [first_expert, first_expert + E/N):
// they are named by those global ids.
using NamedTensors = std::vector<std::pair<std::string, torch::Tensor>>;  // also declared by ckpt.h
NamedTensors model_checkpoint_views(const NamedTensors& by_parameter, int64_t first_expert = 0);

// MLA's RoPE inverse frequencies (qk_rope_head_dim / 2), rope_type default or yarn (model.cpp).
std::vector<double> model_mla_rope_inverse_frequencies(const Config& config);
// YaRN's inverse frequencies over `rotary_dims` (rotary_dims / 2), whatever rope_type says.
std::vector<double> model_yarn_rope_inverse_frequencies(const Config& config, int64_t rotary_dims);
// The RoPE inverse frequencies of global and GLA layers under rope_type=llama3 (rotary_dim / 2).
std::vector<double> model_llama3_rope_inverse_frequencies(const Config& config);

// The initial weights from init_weights_seed: every Linear, expert, router and the embedding
// ~ N(0, init_method_std^2), o_proj and down_proj at init_method_std / sqrt(2 x decoder layers)
// (Megatron's; init_output_layers_scaled), norms = 1. Tensors are drawn in checkpoint order (model_checkpoint_views) from
// one generator, so the same seed gives the same weights on any device, stacking the experts
// changed no weight, and drawing named_parameters() in consecutive runs (one sharding unit after
// another) gives the values of drawing them all at once.
// With expert_parallelism N, the MoE layers hold the E/N experts of position expert_rank in the
// group (every expert is still drawn, in order, so each keeps the weights it has without EP).
class ModelInitializer {
 public:
  ModelInitializer(const Config& config, int64_t expert_rank);
  // Fills `parameters`, the next run of named_parameters() (CPU tensors of their shapes); a run
  // holds a layer's experts.gate_up_proj and experts.down_proj together.
  void draw(const NamedTensors& parameters);

 private:
  at::Generator generator_;
  int64_t first_expert_ = 0;
  int64_t total_experts_ = 0;  // 0 for a dense model
  double std_ = 0.02;          // init_method_std
  double output_std_ = 0.02;   // o_proj, down_proj: scaled by 1 / sqrt(2 x layers) unless turned off
};

// Builds the model on the CPU; `draw` false leaves every parameter uninitialized (and untouched)
// for the caller to draw with a ModelInitializer.
Transformer model_build(const Config& config, int64_t expert_rank = 0, bool draw = true);

}  // namespace trainer
