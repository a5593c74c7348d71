// Sharded data parallelism above ZeRO-1 (see sharding.h): the unit layout, the per-layer
// gathers and gradient reductions, and the conversions between shards and the full arena.
#include "trainer/train/sharding.h"

#include <algorithm>
#include <csignal>

#include <spdlog/spdlog.h>

#include "trainer/train/train.h"

namespace trainer {
namespace {

// The unit of a parameter: 0 for the embedding, 1 + i for decoder layer i (not an MTP block), the
// last index for everything else.
size_t unit_of(const std::string& name, int64_t decoder_layers) {
  const std::string layers = "model.layers.";
  if (name.rfind("model.embed_tokens.", 0) == 0) return 0;
  if (name.rfind(layers, 0) == 0) {
    const int64_t i = std::stoll(name.substr(layers.size(), name.find('.', layers.size()) - layers.size()));
    if (i < decoder_layers) return static_cast<size_t>(i) + 1;
  }
  return static_cast<size_t>(decoder_layers) + 1;
}

}  // namespace

std::vector<ShardUnit> model_units(const Transformer& model, std::vector<size_t>* unit_of_parameter) {
  const int64_t layers = model->model->num_decoder_layers;
  std::vector<ShardUnit> units(static_cast<size_t>(layers) + 2);
  units.front().name = "model.embed_tokens";
  for (int64_t i = 0; i < layers; ++i) {
    units[static_cast<size_t>(i) + 1].name = "model.layers." + std::to_string(i);
    units[static_cast<size_t>(i) + 1].layer = i;
  }
  units.back().name = "the rest (MTP blocks, final norm, head)";
  // Units are contiguous runs of the arena because named_parameters() lists modules in order.
  std::vector<size_t> unit_index;
  for (const auto& item : model->named_parameters()) {
    const size_t u = unit_of(item.key(), layers);
    TORCH_CHECK(unit_index.empty() || u >= unit_index.back(), "sharding: parameter ", item.key(), " is out of unit order");
    unit_index.push_back(u);
    units[u].numel += item.value().numel();
  }
  int64_t begin = 0;
  for (auto& unit : units) {
    unit.begin = begin;
    begin += unit.numel;
  }
  if (unit_of_parameter) *unit_of_parameter = std::move(unit_index);
  return units;
}

ShardedModelState::ShardedModelState(Transformer model, Communicator& comm, Communicator* replicas, const Config& config,
                                     const torch::Device& device, ModelInitializer* deferred_init)
    : model_(std::move(model)),
      comm_(comm),
      replicas_(replicas),
      bucket_elements_(std::max<int64_t>(1, config.gradient_bucket_size_mb * (1 << 20) / 4)),
      params_sharded_(config.data_parallel_sharding == "optim_grads_params") {
  const int64_t R = comm_.world_size(), rank = comm_.rank();
  std::vector<size_t> unit_index;  // per parameter, in named_parameters() order
  units_ = model_units(model_, &unit_index);
  int64_t shard = 0, largest_layer = 0;
  for (auto& unit : units_) {
    unit.part = (unit.numel + R - 1) / R;
    unit.shard_offset = shard;
    unit.own = std::clamp<int64_t>(unit.numel - rank * unit.part, 0, unit.part);
    shard += unit.part;
    if (unit.layer >= 0) largest_layer = std::max(largest_layer, R * unit.part);
  }
  total_ = units_.back().begin + units_.back().numel;
  rank_ = rank;

  const auto opts = torch::TensorOptions().dtype(torch::kFloat32).device(device);
  grad_shard = torch::zeros({shard}, opts);
  outer_rest_offset_ = R * units_.front().part;
  outer_grads_ = torch::zeros({outer_rest_offset_ + R * units_.back().part}, opts);
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
    const int64_t part_begin = unit.begin + rank * unit.part;
    const int64_t lo = std::max(offset, part_begin), hi = std::min(offset + n, part_begin + unit.own);
    if (params_sharded_ && lo < hi)
      param_shard.narrow(0, unit.shard_offset + lo - part_begin, hi - lo).copy_(p.reshape({-1}).narrow(0, lo - offset, hi - lo));
    const int64_t in_unit = offset - unit.begin;
    const int64_t outer_at = (&unit == &units_.back() ? outer_rest_offset_ : 0) + in_unit;
    torch::Tensor view;
    if (!params_sharded_)
      view = arena.narrow(0, offset, n);
    else
      view = outer ? outer_params_.narrow(0, outer_at, n) : layer_params_[unit.layer % 2].narrow(0, in_unit, n);
    if (!params_sharded_ || outer) view.copy_(p.reshape({-1}));  // a layer's values arrive with its gather
    p.set_data(view.view(p.sizes()));
    p.mutable_grad() = (outer ? outer_grads_.narrow(0, outer_at, n) : layer_grads_.narrow(0, in_unit, n)).view(p.sizes());
    offset += n;
  }
  model_->model->layer_hooks = this;
  emulated_reduce_scatter_ = !comm_.has_reduce_scatter() && config.debug_emulate_reduce_scatter;
  reduce_scatter_ = comm_.has_reduce_scatter() || emulated_reduce_scatter_;
  if (reduce_scatter_)
    reduce_scatter_buffer_ = torch::empty({std::max<int64_t>(1, std::min(bucket_elements_ / R, shard))}, opts);
  spdlog::info("data_parallel_sharding={}: {} units over {} ranks{}; this rank holds {:.1f} MiB of each of parameters, "
               "gradients and the two AdamW moments ({:.1f} MiB without sharding); gradients by {}",
               config.data_parallel_sharding, units_.size(), R,
               replicas_ ? " (HSDP: " + std::to_string(replicas_->world_size()) + " replicas of the sharded state)" : "",
               4.0 * static_cast<double>(shard) / (1 << 20), 4.0 * static_cast<double>(total_) / (1 << 20),
               !reduce_scatter_           ? "all-reduce (this backend has no reduce-scatter)"
               : emulated_reduce_scatter_ ? "reduce-scatter, emulated (debug_emulate_reduce_scatter)"
                                          : "reduce-scatter");
}

ShardedModelState::~ShardedModelState() { model_->model->layer_hooks = nullptr; }

int64_t ShardedModelState::padding_elements() const { return comm_.world_size() * grad_shard.numel() - total_; }

std::vector<ShardedModelState::Segment> ShardedModelState::param_segments() const {
  if (params_sharded_) return {{param_shard, 0}};
  std::vector<Segment> out;
  for (const auto& unit : units_)
    if (unit.own > 0) out.push_back({arena_part(unit), unit.shard_offset});
  return out;
}

torch::Tensor ShardedModelState::params_norm() {
  return params_sharded_ ? norm(param_shard) : flat_buffer_norm(arena);
}

torch::Tensor ShardedModelState::params_to_host(int64_t begin, int64_t end) {
  if (params_sharded_) return gather_to_host(param_shard, "the parameters", begin, end);
  return arena.narrow(0, begin, end - begin).to(torch::kCPU, false, true);
}

torch::Tensor ShardedModelState::unit_params_to_host(size_t index, bool keep) {
  torch::NoGradGuard no_grad;
  const ShardUnit& unit = units_.at(index);
  if (!params_sharded_) return keep ? arena.narrow(0, unit.begin, unit.numel).to(torch::kCPU, false, true) : torch::Tensor();
  auto gathered = torch::empty({comm_.world_size() * unit.part}, param_shard.options());  // (R part)
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
  const int64_t R = comm_.world_size();
  const int64_t slice = std::max<int64_t>(1, bucket_elements_ / R);
  for (int64_t offset = 0; offset < unit.part; offset += slice) {
    const int64_t n = std::min(slice, unit.part - offset);
    std::vector<torch::Tensor> parts;
    for (int64_t r = 0; r < R; ++r) parts.push_back(padded.narrow(0, r * unit.part + offset, n));
    auto& mine = parts[static_cast<size_t>(rank_)];
    const int64_t have = std::clamp<int64_t>(own.numel() - offset, 0, n);
    if (have > 0) mine.narrow(0, 0, have).copy_(own.narrow(0, offset, have));
    if (have < n) mine.narrow(0, have, n - have).zero_();
    started.push_back(
        comm_.all_gather_start(parts, what + " of " + unit.name + " (all-gather at element " + std::to_string(offset) + ")"));
  }
  return started;
}

// A reduce-scatter (NCCL; Gloo has none, in 1.13 or 2.6) sums the R parts bucket by bucket, each rank
// receiving its own: (R-1)/R x 4 R part bytes sent. Without one (Gloo) the unit
// is all-reduced bucket by bucket and each rank keeps its part: twice those bytes.
void ShardedModelState::reduce_unit(const ShardUnit& unit, torch::Tensor padded) {
  if (reduce_scatter_) {
    const int64_t R = comm_.world_size();
    // Emulated (a test of this path on Gloo), buckets are cut small so a unit takes several.
    const int64_t slice = emulated_reduce_scatter_ ? kEmulatedReduceScatterSlice : std::max<int64_t>(1, bucket_elements_ / R);
    for (int64_t offset = 0; offset < unit.part; offset += slice) {
      const int64_t n = std::min(slice, unit.part - offset);
      std::vector<torch::Tensor> parts;
      for (int64_t r = 0; r < R; ++r) parts.push_back(padded.narrow(0, r * unit.part + offset, n));
      auto summed = reduce_scatter_buffer_.narrow(0, 0, n);  // n <= the buffer: n <= part <= S, n <= bucket / R
      comm_.reduce_scatter_sum(parts, summed,
                               "the gradient of " + unit.name + " (reduce-scatter at element " + std::to_string(offset) + ")");
      grad_shard.narrow(0, unit.shard_offset + offset, n).add_(summed);
    }
  } else {
    for (int64_t offset = 0; offset < unit.numel; offset += bucket_elements_) {
      auto view = padded.narrow(0, offset, std::min(bucket_elements_, unit.numel - offset));
      comm_.all_reduce_sum(view, "the gradient of " + unit.name + " at element " + std::to_string(offset));
    }
    grad_shard.narrow(0, unit.shard_offset, unit.part).add_(padded.narrow(0, rank_ * unit.part, unit.part));
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
  const int64_t R = comm_.world_size();
  gather_unit(units_.front(), own_part(units_.front(), param_shard), outer_params_.narrow(0, 0, R * units_.front().part),
              "the parameters");
  gather_unit(units_.back(), own_part(units_.back(), param_shard),
              outer_params_.narrow(0, outer_rest_offset_, R * units_.back().part), "the parameters");
  outer_stale_ = false;
}

void ShardedModelState::step_reduce_outer() {
  torch::NoGradGuard no_grad;
  const int64_t R = comm_.world_size();
  reduce_unit(units_.front(), outer_grads_.narrow(0, 0, R * units_.front().part));
  reduce_unit(units_.back(), outer_grads_.narrow(0, outer_rest_offset_, R * units_.back().part));
  // HSDP: each sharding group summed its own ranks' gradients into its shard; the replicas hold
  // the same elements, so one sum over them (once per step: the sum is linear, so summing the
  // step's accumulated shard equals summing every micro-batch's) completes the sum over all ranks.
  if (!replicas_) return;
  for (int64_t offset = 0; offset < grad_shard.numel(); offset += bucket_elements_) {
    auto view = grad_shard.narrow(0, offset, std::min(bucket_elements_, grad_shard.numel() - offset));
    replicas_->all_reduce_sum(view, "the gradient shard over the replicas at element " + std::to_string(offset));
  }
}

void ShardedModelState::params_updated() {
  if (params_sharded_) {
    outer_stale_ = true;
    return;
  }
  torch::NoGradGuard no_grad;
  const int64_t R = comm_.world_size();
  int64_t largest = 0;
  for (const auto& unit : units_) largest = std::max(largest, R * unit.part);
  if (!unit_buffer_.defined() || unit_buffer_.numel() < largest) unit_buffer_ = torch::empty({largest}, arena.options());
  for (const auto& unit : units_) {
    gather_unit(unit, arena_part(unit), unit_buffer_.narrow(0, 0, R * unit.part), "the updated parameters");
    arena.narrow(0, unit.begin, unit.numel).copy_(unit_buffer_.narrow(0, 0, unit.numel));
  }
}

void ShardedModelState::layer_gather_start(int64_t layer) {
  const ShardUnit& unit = layer_unit(layer);
  prefetch_ = gather_unit_start(unit, own_part(unit, param_shard),
                                layer_params_[layer % 2].narrow(0, 0, comm_.world_size() * unit.part), "the parameters");
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
  if (next >= 0 && next < static_cast<int64_t>(units_.size()) - 2) layer_gather_start(next);
}

void ShardedModelState::decoder_layer_grads_ready(int64_t layer) {
  torch::NoGradGuard no_grad;
  const ShardUnit& unit = layer_unit(layer);
  reduce_unit(unit, layer_grads_.narrow(0, 0, comm_.world_size() * unit.part));
}

torch::Tensor ShardedModelState::norm(const torch::Tensor& shard) {
  auto sum_of_squares = flat_buffer_norm(shard).square().reshape({1});
  comm_.all_reduce_sum(sum_of_squares, "the sharded part of a norm");
  return sum_of_squares[0].sqrt();
}

torch::Tensor ShardedModelState::count_zeros(const torch::Tensor& shard) {
  auto zeros = flat_buffer_count_zeros(shard).reshape({1});
  comm_.all_reduce_sum(zeros, "the sharded part of a zero count");
  return zeros[0] - padding_elements();
}

torch::Tensor ShardedModelState::gather_to_host(const torch::Tensor& shard, const std::string& what, int64_t begin,
                                                int64_t end) {
  torch::NoGradGuard no_grad;
  const int64_t R = comm_.world_size();
  int64_t largest = 0;
  for (const auto& unit : units_) largest = std::max(largest, R * unit.part);
  auto buffer = torch::empty({largest}, shard.options());  // one unit at a time on the device
  auto out = torch::empty({end - begin}, torch::kFloat32);
  for (const auto& unit : units_) {
    gather_unit(unit, own_part(unit, shard), buffer.narrow(0, 0, R * unit.part), what);
    const int64_t from = std::max(begin, unit.begin), to = std::min(end, unit.begin + unit.numel);
    if (from < to) out.narrow(0, from - begin, to - from).copy_(buffer.narrow(0, from - unit.begin, to - from));
  }
  return out;
}

torch::Tensor ShardedModelState::shard_of(const torch::Tensor& full) const {
  auto out = torch::zeros({grad_shard.numel()}, full.options());
  for (const auto& unit : units_)
    if (unit.own > 0) out.narrow(0, unit.shard_offset, unit.own).copy_(full.narrow(0, unit.begin + rank_ * unit.part, unit.own));
  return out;
}

void ShardedModelState::params_load(const torch::Tensor& full) {
  torch::NoGradGuard no_grad;
  if (params_sharded_) {
    param_shard.copy_(shard_of(full));
    outer_stale_ = true;
  } else {
    arena.copy_(full);
  }
}

void ShardedModelState::shard_load_range(torch::Tensor& shard, const torch::Tensor& values, int64_t begin) const {
  torch::NoGradGuard no_grad;
  const int64_t end = begin + values.numel();
  for (const auto& unit : units_) {
    const int64_t first = unit.begin + rank_ * unit.part;  // this rank's part: [first, first + own)
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
