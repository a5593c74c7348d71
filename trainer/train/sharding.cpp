// Sharded data parallelism above ZeRO-1 (see sharding.h): the unit layout, the per-layer
// gathers and gradient reductions, and the conversions between shards and the full arena.
#include "trainer/train/sharding.h"

#include <algorithm>
#include <set>
#include <csignal>

#include <spdlog/spdlog.h>

#include "trainer/train/train.h"

namespace trainer {

std::vector<ShardUnit> model_units(const Transformer& model, bool split_experts, std::vector<size_t>* unit_of_parameter) {
  const int64_t layers = model->model->num_decoder_layers;
  const std::string prefix = "model.layers.";
  std::vector<ShardUnit> units;
  std::vector<std::string> bases;  // per unit: the unit it would be part of without split_experts
  std::vector<size_t> unit_index;  // per parameter
  std::set<std::string> closed;    // units already left behind: a parameter out of unit order is a bug
  int64_t offset = 0;
  for (const auto& item : model->named_parameters()) {
    const std::string& key = item.key();
    std::string base = "the rest (MTP blocks, final norm, head)";
    int64_t layer = -1;
    if (key.rfind("model.embed_tokens.", 0) == 0) {
      base = "model.embed_tokens";
    } else if (key.rfind(prefix, 0) == 0) {
      const int64_t i = std::stoll(key.substr(prefix.size(), key.find('.', prefix.size()) - prefix.size()));
      if (i < layers) base = prefix + std::to_string(i), layer = i;  // else an MTP block: the rest
    }
    ShardUnit unit;
    unit.layer = layer;
    if (split_experts && model_is_stacked_experts(key)) {  // "model.layers.3.mlp.experts" (MTP blocks' too)
      unit.name = key.substr(0, key.rfind('.'));
      unit.experts = true;
    } else if (!units.empty() && bases.back() == base && units.back().name != base) {  // after a unit of experts
      unit.name = units.back().experts ? base + " (after " + units.back().name + ")" : units.back().name;
    } else {
      unit.name = base;
    }
    if (units.empty() || units.back().name != unit.name) {
      TORCH_CHECK(closed.insert(unit.name).second, "sharding: parameter ", key, " is out of unit order");
      unit.begin = offset;
      units.push_back(unit);
      bases.push_back(base);
    }
    units.back().numel += item.value().numel();
    unit_index.push_back(units.size() - 1);
    offset += item.value().numel();
  }
  if (unit_of_parameter) *unit_of_parameter = std::move(unit_index);
  return units;
}

ShardedModelState::ShardedModelState(Transformer model, ShardingGroups groups, const Config& config,
                                     const torch::Device& device, ModelInitializer* deferred_init)
    : model_(std::move(model)),
      replicas_(groups.replicas),
      bucket_elements_(std::max<int64_t>(1, config.gradient_bucket_size_mb * (1 << 20) / 4)),
      params_sharded_(config.data_parallel_sharding == "optim_grads_params") {
  TORCH_CHECK(groups.shard, "ShardedModelState needs its sharding group");
  dense_.comm = groups.shard;
  experts_.comm = groups.experts;
  std::vector<size_t> unit_index;  // per parameter, in named_parameters() order
  units_ = model_units(model_, /*split_experts=*/groups.experts != nullptr, &unit_index);
  layer_units_.assign(static_cast<size_t>(model_->model->num_decoder_layers), {0, 0});
  int64_t shard = 0, outer_size = 0, largest_layer = 0, layer_size = 0;
  for (size_t i = 0; i < units_.size(); ++i) {
    ShardUnit& unit = units_[i];
    Communicator& comm = *group(unit).comm;
    unit.ranks = comm.world_size();
    unit.group_rank = comm.rank();
    unit.part = (unit.numel + unit.ranks - 1) / unit.ranks;
    unit.shard_offset = shard;
    unit.own = std::clamp<int64_t>(unit.numel - unit.group_rank * unit.part, 0, unit.part);
    shard += unit.part;
    if (unit.layer < 0) {
      unit.buffer_offset = outer_size;
      outer_size += unit.padded();
      outer_units_.push_back(i);
      continue;
    }
    auto& range = layer_units_[static_cast<size_t>(unit.layer)];
    if (range.second == 0) {  // the layer's first unit
      range = {i, i};
      layer_size = 0;
    }
    range.second = i + 1;
    unit.buffer_offset = layer_size;
    layer_size += unit.padded();
    largest_layer = std::max(largest_layer, layer_size);
  }
  total_ = units_.back().begin + units_.back().numel;

  const auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  grad_shard = torch::zeros({shard}, opts);
  outer_grads_ = torch::zeros({outer_size}, opts);
  layer_grads_ = torch::zeros({largest_layer}, opts);
  if (params_sharded_) {
    param_shard = torch::zeros({shard}, opts);
    outer_params_ = torch::zeros_like(outer_grads_);
    for (auto& buffer : layer_params_) buffer = torch::zeros({largest_layer}, opts);
  } else {
    arena = torch::zeros({total_}, opts);
  }

  torch::NoGradGuard no_grad;
  const auto named = model_->named_parameters();
  int64_t offset = 0;
  torch::Tensor scratch;  // (unit numel) fp32 host: the initial weights of the unit being sharded
  for (size_t i = 0; i < named.size(); ++i) {
    auto p = named[i].value();
    const ShardUnit& unit = units_[unit_index[i]];
    if (deferred_init && (i == 0 || unit_index[i] != unit_index[i - 1])) {
      scratch = torch::empty({unit.numel});
      NamedTensors members;  // the unit's parameters, pointed at the scratch and drawn there
      int64_t at = 0;
      for (size_t j = i; j < named.size() && unit_index[j] == unit_index[i]; ++j) {
        auto member = named[j].value();
        member.set_data(scratch.narrow(0, at, member.numel()).view(member.sizes()));
        members.emplace_back(named[j].key(), member);
        at += member.numel();
      }
      deferred_init->draw(members);
    }
    const int64_t n = p.numel();
    const bool outer = unit.layer < 0;
    // optim_grads_params: this rank's part of the unit that lies in this parameter, into the shard.
    const int64_t part_begin = unit.begin + unit.group_rank * unit.part;
    const int64_t lo = std::max(offset, part_begin), hi = std::min(offset + n, part_begin + unit.own);
    if (params_sharded_ && lo < hi)
      param_shard.narrow(0, unit.shard_offset + lo - part_begin, hi - lo).copy_(p.reshape({-1}).narrow(0, lo - offset, hi - lo));
    const int64_t at = unit.buffer_offset + offset - unit.begin;  // in the outer or the layer buffers
    torch::Tensor view;
    if (!params_sharded_)
      view = arena.narrow(0, offset, n);
    else
      view = outer ? outer_params_.narrow(0, at, n) : layer_params_[unit.layer % 2].narrow(0, at, n);
    if (!params_sharded_ || outer) view.copy_(p.reshape({-1}));  // a layer's values arrive with its gather
    p.set_data(view.view(p.sizes()));
    p.mutable_grad() = (outer ? outer_grads_ : layer_grads_).narrow(0, at, n).view(p.sizes());
    offset += n;
  }
  model_->model->layer_hooks = this;
  for (Group* g : {&dense_, &experts_}) {
    if (!g->comm) continue;
    g->emulated = !g->comm->has_reduce_scatter() && config.debug_emulate_reduce_scatter;
    g->reduce_scatter = g->comm->has_reduce_scatter() || g->emulated;
  }
  if (dense_.reduce_scatter || experts_.reduce_scatter)
    reduce_scatter_buffer_ = torch::empty({std::max<int64_t>(1, std::min(bucket_elements_, shard))}, opts);
  const int64_t R = dense_.comm->world_size();
  const auto how = [](const Group& g) {
    return !g.reduce_scatter ? "all-reduce (this backend has no reduce-scatter that sends fewer bytes)"
           : g.emulated      ? "reduce-scatter, emulated (debug_emulate_reduce_scatter)"
                             : "reduce-scatter";
  };
  spdlog::info("data_parallel_sharding={}: {} units over {} ranks{}{}; this rank holds {:.1f} MiB of each of parameters, "
               "gradients and the two AdamW moments ({:.1f} MiB without sharding); gradients by {}",
               config.data_parallel_sharding, units_.size(), R,
               replicas_ ? " (HSDP: " + std::to_string(replicas_->world_size()) + " replicas of the sharded state)" : "",
               experts_.comm ? ", the routed experts over the " + std::to_string(experts_.comm->world_size()) +
                                   " holding the same ones"
                             : "",
               4.0 * static_cast<double>(shard) / (1 << 20), 4.0 * static_cast<double>(total_) / (1 << 20), how(dense_));
}

ShardedModelState::~ShardedModelState() { model_->model->layer_hooks = nullptr; }

// Over the R ranks of the sharding group, a unit split over `ranks` of them appears R / ranks times
// (expert units: once per expert position, each time with other experts): R part elements
// in the shards, of which R / ranks x numel are the model's.
int64_t ShardedModelState::padding_elements() const {
  const int64_t R = dense_.comm->world_size();
  int64_t padding = 0;
  for (const auto& unit : units_) padding += R * unit.part - R / unit.ranks * unit.numel;
  return padding;
}

std::vector<ShardedModelState::Segment> ShardedModelState::param_segments() const {
  if (params_sharded_) return {{param_shard, 0}};
  std::vector<Segment> out;
  for (const auto& unit : units_)
    if (unit.own > 0) out.push_back({arena_part(unit), unit.shard_offset});
  return out;
}

torch::Tensor ShardedModelState::params_norm() {
  if (params_sharded_) return norm(param_shard);
  if (!experts_.comm) return flat_buffer_norm(arena);
  // Expert parallelism: the arena holds this rank's experts only, but this rank's parts of the
  // units cover, over all ranks, every element of the whole model once.
  auto sum_of_squares = torch::zeros({1}, arena.options().dtype(torch::kFloat64));
  for (const auto& unit : units_)
    if (unit.own > 0) sum_of_squares += flat_buffer_norm(arena_part(unit)).square();
  dense_.comm->all_reduce_sum(sum_of_squares, "the sharded part of the parameter norm");
  return sum_of_squares[0].sqrt();
}

std::pair<int64_t, int64_t> ShardedModelState::kept_of_unit(const ShardUnit& unit, const HostRange& range) {
  const int64_t begin = unit.experts ? range.begin : range.dense_begin, end = unit.experts ? range.end : range.dense_end;
  return {std::max(begin, unit.begin), std::min(end, unit.begin + unit.numel)};
}

torch::Tensor ShardedModelState::params_to_host(const HostRange& range) {
  if (params_sharded_) return gather_to_host(param_shard, "the parameters", range);
  if (range.dense_begin == range.begin && range.dense_end == range.end)
    return arena.narrow(0, range.begin, range.end - range.begin).to(torch::kCPU, false, true);
  auto out = torch::empty({range.end - range.begin}, torch::kFloat32);
  for (const auto& unit : units_) {
    const auto [from, to] = kept_of_unit(unit, range);
    if (from < to) out.narrow(0, from - range.begin, to - from).copy_(arena.narrow(0, from, to - from));
  }
  return out;
}

torch::Tensor ShardedModelState::unit_params_to_host(size_t index, bool keep) {
  torch::NoGradGuard no_grad;
  const ShardUnit& unit = units_.at(index);
  if (!params_sharded_) return keep ? arena.narrow(0, unit.begin, unit.numel).to(torch::kCPU, false, true) : torch::Tensor();
  auto gathered = torch::empty({unit.padded()}, param_shard.options());  // (ranks part)
  gather_unit(unit, own_part(unit, param_shard), gathered, "the parameters");
  return keep ? gathered.narrow(0, 0, unit.numel).to(torch::kCPU, false, true) : torch::Tensor();
}

void ShardedModelState::gather_unit(const ShardUnit& unit, const torch::Tensor& own, torch::Tensor padded,
                                    const std::string& what) {
  for (auto& pending : gather_unit_start(unit, own, std::move(padded), what)) pending->wait();
}

std::vector<std::unique_ptr<PendingCollective>> ShardedModelState::gather_unit_start(const ShardUnit& unit,
                                                                                     const torch::Tensor& own,
                                                                                     torch::Tensor padded,
                                                                                     const std::string& what) {
  std::vector<std::unique_ptr<PendingCollective>> started;
  const int64_t R = unit.ranks;
  const int64_t slice = std::max<int64_t>(1, bucket_elements_ / R);
  for (int64_t offset = 0; offset < unit.part; offset += slice) {
    const int64_t n = std::min(slice, unit.part - offset);
    std::vector<torch::Tensor> parts;
    for (int64_t r = 0; r < R; ++r) parts.push_back(padded.narrow(0, r * unit.part + offset, n));
    auto& mine = parts[static_cast<size_t>(unit.group_rank)];
    const int64_t have = std::clamp<int64_t>(own.numel() - offset, 0, n);
    if (have > 0) mine.narrow(0, 0, have).copy_(own.narrow(0, offset, have));
    if (have < n) mine.narrow(0, have, n - have).zero_();
    started.push_back(
        group(unit).comm->all_gather_start(parts, what + " of " + unit.name + " (all-gather at element " + std::to_string(offset) + ")"));
  }
  return started;
}

// A reduce-scatter (NCCL; Gloo's is R all-reduces, dist.cpp) sums the R parts bucket by bucket, each rank
// receiving its own: (R-1)/R x 4 R part bytes sent. Without one (Gloo) the unit
// is all-reduced bucket by bucket and each rank keeps its part: twice those bytes.
void ShardedModelState::reduce_unit(const ShardUnit& unit, torch::Tensor padded) {
  Group& g = group(unit);
  if (g.reduce_scatter) {
    const int64_t R = unit.ranks;
    // Emulated (a test of this path on Gloo), buckets are cut small so a unit takes several.
    const int64_t slice = g.emulated ? kEmulatedReduceScatterSlice : std::max<int64_t>(1, bucket_elements_ / R);
    for (int64_t offset = 0; offset < unit.part; offset += slice) {
      const int64_t n = std::min(slice, unit.part - offset);
      std::vector<torch::Tensor> parts;
      for (int64_t r = 0; r < R; ++r) parts.push_back(padded.narrow(0, r * unit.part + offset, n));
      auto summed = reduce_scatter_buffer_.narrow(0, 0, n);  // n <= min(bucket, S): n <= part <= S, n <= slice <= bucket
      g.comm->reduce_scatter_sum(parts, summed,
                               "the gradient of " + unit.name + " (reduce-scatter at element " + std::to_string(offset) + ")");
      grad_shard.narrow(0, unit.shard_offset + offset, n).add_(summed);
    }
  } else {
    g.comm->all_reduce_sum_in_buckets(padded.narrow(0, 0, unit.numel), bucket_elements_, "the gradient of " + unit.name);
    grad_shard.narrow(0, unit.shard_offset, unit.part).add_(padded.narrow(0, unit.group_rank * unit.part, unit.part));
  }
  padded.zero_();
}

void ShardedModelState::step_begin() {
  grad_shard.zero_();
  outer_grads_.zero_();
  layer_grads_.zero_();
  params_ensure();
}

void ShardedModelState::params_ensure() {
  if (!params_sharded_ || !outer_stale_) return;
  torch::NoGradGuard no_grad;
  for (const size_t i : outer_units_) {
    const ShardUnit& unit = units_[i];
    gather_unit(unit, own_part(unit, param_shard), outer_params_.narrow(0, unit.buffer_offset, unit.padded()), "the parameters");
  }
  outer_stale_ = false;
}

void ShardedModelState::step_reduce_outer() {
  torch::NoGradGuard no_grad;
  for (const size_t i : outer_units_) {
    const ShardUnit& unit = units_[i];
    reduce_unit(unit, outer_grads_.narrow(0, unit.buffer_offset, unit.padded()));
  }
  // HSDP: each sharding group summed its own ranks' gradients into its shard; the replicas hold
  // the same elements, so one sum over them (once per step: the sum is linear, so summing the
  // step's accumulated shard equals summing every micro-batch's) completes the sum over all ranks.
  if (replicas_) replicas_->all_reduce_sum_in_buckets(grad_shard, bucket_elements_, "the gradient shard over the replicas");
}

void ShardedModelState::params_updated() {
  if (params_sharded_) {
    outer_stale_ = true;
    return;
  }
  torch::NoGradGuard no_grad;
  int64_t largest = 0;
  for (const auto& unit : units_) largest = std::max(largest, unit.padded());
  if (!unit_buffer_.defined() || unit_buffer_.numel() < largest) unit_buffer_ = torch::empty({largest}, arena.options());
  for (const auto& unit : units_) {
    gather_unit(unit, arena_part(unit), unit_buffer_.narrow(0, 0, unit.padded()), "the updated parameters");
    arena.narrow(0, unit.begin, unit.numel).copy_(unit_buffer_.narrow(0, 0, unit.numel));
  }
}

void ShardedModelState::layer_gather_start(int64_t layer) {
  const auto [first, end] = layer_units(layer);
  for (size_t i = first; i < end; ++i) {
    const ShardUnit& unit = units_[i];
    for (auto& pending : gather_unit_start(unit, own_part(unit, param_shard),
                                           layer_params_[layer % 2].narrow(0, unit.buffer_offset, unit.padded()), "the parameters"))
      prefetch_.push_back(std::move(pending));
  }
  prefetched_layer_ = layer;
}

// Layer i's gather overlaps layer i - 1's compute (i + 1's in backward). The buffer it fills,
// layer_params_[i % 2], last held layer i - 2 (i + 2), whose run has finished: forward runs
// without recording, and a backward rerun's graph is released before the next layer's hook.
void ShardedModelState::decoder_layer_gather(int64_t layer, bool backward) {
  if (!params_sharded_) return;
  if (kill_in_next_layer_gather) std::raise(SIGKILL);
  torch::NoGradGuard no_grad;
  if (prefetched_layer_ != layer) {
    for (auto& pending : prefetch_) pending->wait();  // a gather nobody asked for (not expected)
    layer_gather_start(layer);
  }
  for (auto& pending : prefetch_) pending->wait();
  prefetch_.clear();
  prefetched_layer_ = -1;
  const int64_t next = backward ? layer - 1 : layer + 1;
  if (next >= 0 && next < static_cast<int64_t>(layer_units_.size())) layer_gather_start(next);
}

void ShardedModelState::decoder_layer_grads_ready(int64_t layer) {
  torch::NoGradGuard no_grad;
  const auto [first, end] = layer_units(layer);
  for (size_t i = first; i < end; ++i) reduce_unit(units_[i], layer_grads_.narrow(0, units_[i].buffer_offset, units_[i].padded()));
}

torch::Tensor ShardedModelState::norm(const torch::Tensor& shard) {
  auto sum_of_squares = flat_buffer_norm(shard).square().reshape({1});
  dense_.comm->all_reduce_sum(sum_of_squares, "the sharded part of a norm");
  return sum_of_squares[0].sqrt();
}

torch::Tensor ShardedModelState::count_zeros(const torch::Tensor& shard) {
  auto zeros = flat_buffer_count_zeros(shard).reshape({1});
  dense_.comm->all_reduce_sum(zeros, "the sharded part of a zero count");
  return zeros[0] - padding_elements();
}

torch::Tensor ShardedModelState::gather_to_host(const torch::Tensor& shard, const std::string& what, const HostRange& range) {
  torch::NoGradGuard no_grad;
  int64_t largest = 0;
  for (const auto& unit : units_) largest = std::max(largest, unit.padded());
  auto buffer = torch::empty({largest}, shard.options());  // one unit at a time on the device
  auto out = torch::empty({range.end - range.begin}, torch::kFloat32);
  for (const auto& unit : units_) {
    gather_unit(unit, own_part(unit, shard), buffer.narrow(0, 0, unit.padded()), what);
    const auto [from, to] = kept_of_unit(unit, range);
    if (from < to) out.narrow(0, from - range.begin, to - from).copy_(buffer.narrow(0, from - unit.begin, to - from));
  }
  return out;
}

void ShardedModelState::shard_load_range(torch::Tensor& shard, const torch::Tensor& values, int64_t begin) const {
  torch::NoGradGuard no_grad;
  const int64_t end = begin + values.numel();
  for (const auto& unit : units_) {
    const int64_t first = unit.begin + unit.group_rank * unit.part;  // this rank's part: [first, first + own)
    const int64_t from = std::max(begin, first), to = std::min(end, first + unit.own);
    if (from < to) shard.narrow(0, unit.shard_offset + from - first, to - from).copy_(values.narrow(0, from - begin, to - from));
  }
}

void ShardedModelState::params_load_range(const torch::Tensor& values, int64_t begin) {
  torch::NoGradGuard no_grad;
  if (params_sharded_) {
    shard_load_range(param_shard, values, begin);
    outer_stale_ = true;
  } else {
    arena.narrow(0, begin, values.numel()).copy_(values);
  }
}

}  // namespace trainer
