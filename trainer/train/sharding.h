// Sharded data parallelism above ZeRO-1: data_parallel_sharding = optim_grads (ZeRO-2) and
// optim_grads_params (ZeRO-3 / FSDP), docs/distributed.md.
//
// The parameter arena (named_parameters order, P elements) is cut into units: the embedding,
// each decoder layer, and "the rest" (MTP blocks, final norm, head). With expert parallelism a
// MoE layer is cut in up to three units, the stacked routed experts being their own: those differ
// between the ranks of an expert-parallel group, so they shard over the ranks that hold the same
// experts (R/N of them) while everything else shards over all R. Each unit's elements are split
// into equal parts, one per rank of its group (the last zero-padded), and a rank holds its part
// of every unit. The shard buffers (parameters, reduced gradients, AdamW moments) are this rank's
// parts concatenated in unit order, S = sum over units of ceil(numel / ranks) elements. Gradients
// of a decoder layer are reduced right after that layer's backward (every micro-batch), into the
// gradient shard; the outer units (embedding, rest) accumulate locally over the step's
// micro-batches and are reduced once.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "trainer/config/config.h"
#include "trainer/dist/dist.h"
#include "trainer/model/model.h"

namespace trainer {

struct ShardUnit {
  std::string name;          // "model.embed_tokens", "model.layers.3", "the rest (MTP blocks, final norm, head)";
                             // split_experts: "model.layers.3.mlp.experts", "model.layers.3 (after model.layers.3.mlp.experts)"
  int64_t begin = 0;         // its first element in the arena
  int64_t numel = 0;         // its elements
  int64_t layer = -1;        // its decoder layer, -1 for the outer units
  bool experts = false;      // a MoE layer's stacked routed experts, cut out under expert parallelism
  // This rank's view (ShardedModelState):
  int64_t ranks = 1;         // the ranks it is split over: all R (HSDP: D), or R/N for experts
  int64_t group_rank = 0;    // this rank's position among them: it holds part group_rank
  int64_t part = 0;          // ceil(numel / ranks): each rank's part; the parts past numel are zeros
  int64_t shard_offset = 0;  // where this rank's part starts in the shard buffers
  int64_t own = 0;           // elements of this rank's part inside the unit (part, fewer, or 0)
  int64_t buffer_offset = 0; // where the gathered unit (ranks * part) starts in its layer's buffer or the outer one
  int64_t padded() const { return ranks * part; }
};

// The units of the parameter arena in order (embedding, each decoder layer, the rest) with name,
// layer, begin and numel; the per-rank fields keep their defaults. split_experts (expert
// parallelism): the stacked experts of each MoE layer (and MoE MTP block) are a unit of their own
// (`experts`), between the parameters before them and those after them. unit_of_parameter: each
// parameter's unit, in named_parameters() order.
std::vector<ShardUnit> model_units(const Transformer& model, bool split_experts,
                                   std::vector<size_t>* unit_of_parameter = nullptr);

// The communicators a ShardedModelState works with.
struct ShardingGroups {
  Communicator* shard = nullptr;     // the ranks the state is sharded over: all data-parallel ranks, or HSDP's D
  Communicator* replicas = nullptr;  // HSDP: the ranks holding the same shard (the step's gradient shard is summed
                                     // there once, after the last micro-batch); else null
  Communicator* experts = nullptr;   // expert parallelism: the ranks of `shard` holding the same experts, over
                                     // which the expert units shard; else null
};

class ShardedModelState : public DecoderLayerHooks {
 public:
  // Moves the model's parameters into the sharded layout on `device`, points every parameter and
  // .grad at its buffers, and registers itself as the decoder stack's layer hooks. With
  // `deferred_init` the model was built undrawn (model_build(..., draw = false)): each unit is drawn
  // into a host scratch buffer just before its parts are taken, so the rank never holds more
  // than one unit of initial weights (the parameters' own storage, never touched, is released).
  // The norms below sum the shards over `groups.shard`: it holds every element of the model once
  // (with expert parallelism every expert once: `groups.experts` lies inside it).
  ShardedModelState(Transformer model, ShardingGroups groups, const Config& config, const torch::Device& device,
                    ModelInitializer* deferred_init = nullptr);
  ~ShardedModelState() override;

  bool params_sharded() const { return params_sharded_; }  // optim_grads_params
  const std::vector<ShardUnit>& units() const { return units_; }
  int64_t total_params() const { return total_; }                // P
  int64_t padding_elements() const;  // the zeros of every rank's shards together (the sum over ranks of S, minus P
                                     // counting each expert once)

  torch::Tensor param_shard;  // (S) fp32: this rank's parts of the parameters (optim_grads_params; undefined with
                              // optim_grads, whose parts are views of the arena: param_segments)
  torch::Tensor grad_shard;   // (S) fp32: the gradient of those parts, summed over ranks and micro-batches
  torch::Tensor arena;        // (P) fp32: every parameter a view (optim_grads); undefined with optim_grads_params

  // This rank's parameter elements as AdamW sees them: each segment's `params` pairs with
  // grad_shard (and the moments) at [offset, offset + params.numel()). One segment, the whole
  // param_shard, with optim_grads_params; one per unit, a view of the arena, with optim_grads.
  struct Segment {
    torch::Tensor params;
    int64_t offset = 0;
  };
  std::vector<Segment> param_segments() const;
  torch::Tensor params_norm();    // fp64 L2 norm of all parameters (a collective with optim_grads_params or experts)
  // What a rank keeps on the host of the arena (a checkpoint shard): the elements [begin, end)
  // of the expert units, and of the other units those in [dense_begin, dense_end), a part of it.
  // Only those elements of the (end - begin) host buffer are written; the rest is never written,
  // so fresh pages there are not made resident. Without expert parallelism the ranges are equal.
  struct HostRange {
    int64_t begin = 0, end = 0, dense_begin = 0, dense_end = 0;
  };
  // Host copy of the arena's elements in `range` (a collective with optim_grads_params: every
  // rank takes part, whatever range it keeps; an empty range keeps nothing).
  torch::Tensor params_to_host(const HostRange& range);
  // Host copy of one unit's parameters (units()[index]) on the ranks that `keep` them, undefined
  // elsewhere (a collective with optim_grads_params: every rank calls it for the same unit).
  torch::Tensor unit_params_to_host(size_t index, bool keep);

  // The step's phases: zero the gradients and make the outer units' parameters current; reduce the
  // outer units' gradients after the last micro-batch (and, with HSDP, the gradient shard over the replicas); bring the parameters up to date after AdamW
  // changed param_shard (optim_grads: every unit gathered into the arena; optim_grads_params: the
  // outer units are gathered again before the next forward, the layers before each of theirs).
  void step_begin();
  void step_reduce_outer();
  void params_updated();
  void params_ensure();  // before a forward outside a step (evaluation, logits)
  bool kill_in_next_layer_gather = false;  // debug_kill_rank_before_parameter_gather under optim_grads_params

  // fp64 L2 norm / int64 zero count of a shard-shaped buffer over all ranks (padding excluded).
  torch::Tensor norm(const torch::Tensor& shard);
  torch::Tensor count_zeros(const torch::Tensor& shard);
  // The arena elements in `range` of a shard-shaped buffer, on the host, gathered unit by unit
  // through one unit-sized device buffer (a collective: every rank takes part in every unit's
  // gather, whatever range it keeps).
  torch::Tensor gather_to_host(const torch::Tensor& shard, const std::string& what, const HostRange& range);
  // A restore in pieces: `values` holds the arena's elements [begin, begin + values.numel()); this
  // rank's parts among them go into `shard` (shard-shaped, e.g. an AdamW moment), or into the
  // parameters (all of them with optim_grads, which keeps the whole arena).
  void shard_load_range(torch::Tensor& shard, const torch::Tensor& values, int64_t begin) const;
  void params_load_range(const torch::Tensor& values, int64_t begin);

  // optim_grads_params: waits for layer's gather (started while the previous layer ran, or now),
  // then starts the gather of the layer that runs next (layer + 1, or layer - 1 in backward).
  void decoder_layer_gather(int64_t layer, bool backward) override;
  void decoder_layer_grads_ready(int64_t layer) override;
  bool decoder_layer_rerun() const override { return params_sharded_; }

 private:
  // A unit's communicator, and how its gradients are reduced.
  struct Group {
    Communicator* comm = nullptr;
    bool reduce_scatter = false;  // the backend has one (else gradients are all-reduced)
    bool emulated = false;        // debug_emulate_reduce_scatter on a backend without one
  };
  Group& group(const ShardUnit& unit) { return unit.experts && experts_.comm ? experts_ : dense_; }
  // Fills `padded` (unit.padded()) with the whole unit from every rank's part, this rank's being
  // `own` (its first `part` or fewer elements; the rest of the part is zeros). Bucketed in-place
  // all-gathers over the unit's group: each round ranks x bucket elements.
  void gather_unit(const ShardUnit& unit, const torch::Tensor& own, torch::Tensor padded, const std::string& what);
  std::vector<std::unique_ptr<PendingCollective>> gather_unit_start(const ShardUnit& unit, const torch::Tensor& own,
                                                                    torch::Tensor padded, const std::string& what);
  void layer_gather_start(int64_t layer);  // into layer_params_[layer % 2], as prefetch_
  torch::Tensor own_part(const ShardUnit& unit, const torch::Tensor& shard) const {
    return shard.narrow(0, unit.shard_offset, unit.part);
  }
  torch::Tensor arena_part(const ShardUnit& unit) const {  // optim_grads: this rank's part, in the arena
    return arena.narrow(0, unit.begin + unit.group_rank * unit.part, unit.own);
  }
  // Sums `padded` (unit.padded(), the unit's gradient in its first numel) over the unit's group
  // and adds this rank's part into grad_shard; zeroes `padded` for the next use.
  void reduce_unit(const ShardUnit& unit, torch::Tensor padded);
  // The arena elements of `unit` that `range` keeps: [first, second), empty if first >= second.
  static std::pair<int64_t, int64_t> kept_of_unit(const ShardUnit& unit, const HostRange& range);
  // The units of a decoder layer: units_[first, end).
  std::pair<size_t, size_t> layer_units(int64_t layer) const { return layer_units_[static_cast<size_t>(layer)]; }

  Transformer model_;
  Group dense_, experts_;   // everything but the expert units; the expert units (expert parallelism only)
  Communicator* replicas_;  // HSDP only
  static constexpr int64_t kEmulatedReduceScatterSlice = 1000;  // elements per part and bucket, emulated
  torch::Tensor reduce_scatter_buffer_;  // (min(bucket, S)) fp32: one bucket's summed part
  int64_t bucket_elements_;
  bool params_sharded_;
  int64_t total_ = 0;
  std::vector<ShardUnit> units_;  // embedding, the decoder layers' in order, the rest
  std::vector<std::pair<size_t, size_t>> layer_units_;  // per decoder layer: its units [first, end)
  std::vector<size_t> outer_units_;                     // the embedding and the rest
  // Gathered parameters (optim_grads_params): the outer units, each padded to its group's parts,
  // valid for a step; and two decoder layers' (layer i's parameters view layer_params_[i % 2],
  // valid after its gather), so the next layer's gather can run while this one computes.
  torch::Tensor outer_params_, layer_params_[2];
  int64_t prefetched_layer_ = -1;                             // the layer whose gather is in flight
  std::vector<std::unique_ptr<PendingCollective>> prefetch_;  // its bucketed all-gathers
  bool outer_stale_ = false;
  // Local gradients before their reduction: the outer units' (padded each, the step's
  // micro-batches summed), and one decoder layer's (every layer's .grad views it).
  torch::Tensor outer_grads_, layer_grads_;
  torch::Tensor unit_buffer_;  // optim_grads: the largest unit, padded; a unit's all-gather lands here first
};

}  // namespace trainer
