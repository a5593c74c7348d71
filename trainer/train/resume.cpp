// Resume and export: the host snapshot a checkpoint holds, restoring it (with every mismatch
// named), choosing the starting state, and writing the weights alone.
#include <unistd.h>

#include <charconv>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <tuple>
#include <sstream>

#include <spdlog/spdlog.h>

#include "trainer/config/hf_config.h"
#include "trainer/train/train.h"
#include "trainer/util/error.h"
#include "trainer/util/torch_compat.h"

namespace trainer {


// flat: (P) laid out as the parameter arena (the arena itself, a copy, or a moment buffer).
// Returns one view per parameter, named and shaped as named_parameters().
NamedTensors Trainer::arena_views(const torch::Tensor& flat, int64_t begin) const {
  NamedTensors out;
  int64_t offset = 0;
  for (const auto& item : model_->named_parameters()) {
    const auto n = item.value().numel();
    if (offset >= begin && offset + n <= begin + flat.numel())
      out.emplace_back(item.key(), flat.narrow(0, offset - begin, n).view(item.value().sizes()));
    offset += n;
  }
  return out;
}

std::pair<int64_t, int64_t> Trainer::checkpoint_range(int64_t rank) const {
  const int64_t R = comm_->world_size();
  const int64_t P = sharded_state_ ? sharded_state_->total_params() : flat_params_.numel();
  // Rank r's range starts at the first parameter that starts at or after r P / R (a stacked
  // experts' down_proj stays with its gate_up_proj: the checkpoint names pair them).
  const auto boundary = [&](int64_t r) {
    if (r >= R) return P;
    const int64_t target = r * (P / R) + std::min(r, P % R);
    int64_t offset = 0;
    for (const auto& item : model_->named_parameters()) {
      if (offset >= target && !model_is_stacked_down_proj(item.key())) return offset;
      offset += item.value().numel();
    }
    return P;
  };
  return {boundary(rank), boundary(rank + 1)};
}

NamedTensors Trainer::with_all_experts(NamedTensors views, const std::string& what) {
  if (!expert_group_) return views;
  const int64_t N = expert_group_->world_size();
  for (auto& [name, tensor] : views) {
    if (!model_is_stacked_experts(name)) continue;
    auto shape = tensor.sizes().vec();
    shape[0] *= N;
    if (tensor.is_meta()) {  // shapes only: nothing to gather
      tensor = torch::empty(shape, tensor.options());
      continue;
    }
    auto whole = torch::empty(shape, tensor.options().device(device_));  // (E, ...)
    auto parts = whole.chunk(N, 0);                                       // rank i's experts: part i
    parts[static_cast<size_t>(expert_rank_)].copy_(tensor);
    expert_group_->all_gather(parts, what + " of " + name);
    tensor = whole.to(tensor.device());
  }
  return views;
}

NamedTensors Trainer::restore_targets(const torch::Tensor& flat) const {
  auto targets = arena_views(flat);
  if (!expert_group_) return targets;
  for (auto& [name, tensor] : targets) {
    if (!model_is_stacked_experts(name)) continue;
    auto shape = tensor.sizes().vec();
    shape[0] *= expert_group_->world_size();
    tensor = torch::empty(shape, torch::kFloat32);  // the whole layer's experts, on the host
  }
  return targets;
}

void Trainer::keep_local_experts(const NamedTensors& targets, const torch::Tensor& flat) const {
  if (!expert_group_) return;
  const auto views = arena_views(flat);
  for (size_t i = 0; i < views.size(); ++i) {
    if (!model_is_stacked_experts(views[i].first)) continue;
    auto local = views[i].second;
    local.copy_(targets[i].second.narrow(0, expert_rank_ * local.size(0), local.size(0)));
  }
}

CheckpointContents Trainer::snapshot(int64_t completed_steps) {
  torch::NoGradGuard no_grad;
  CheckpointContents c;
  const int64_t rank = comm_->rank();
  const int64_t P = sharded_state_ ? sharded_state_->total_params() : flat_params_.numel();
  // The arena range this rank keeps host copies of: its checkpoint shard, or, when one rank writes
  // everything, all on rank 0 and nothing elsewhere; every rank takes part in the gathers. (With
  // expert parallelism every rank gathers the experts from its host copy below.)
  const bool own_shard = sharded_checkpoints();
  const auto [begin, end] = own_shard ? checkpoint_range(rank)
                            : rank == 0 || expert_group_ ? std::pair<int64_t, int64_t>{0, P}
                                                         : std::pair<int64_t, int64_t>{0, 0};
  if (own_shard) {
    c.shard_rank = rank;
    c.shard_count = comm_->world_size();
  }
  // Sharded with expert parallelism, a rank writes the other tensors of its range, and its own
  // experts of each stacked expert tensor in its expert-parallel group's ranges: the group's N
  // ranks hold the N slices of every such tensor, so together they write each expert once.
  int64_t keep_begin = begin, keep_end = end;  // the arena range this rank copies to the host
  if (own_shard && expert_group_) {
    const int64_t N = expert_group_->world_size(), first = rank / N * N;
    keep_begin = checkpoint_range(first).first;
    keep_end = checkpoint_range(first + N - 1).second;
  }
  const auto own_shard_views = [&, begin = begin, end = end](const torch::Tensor& host) {
    NamedTensors kept;
    int64_t offset = 0;
    std::map<std::string, int64_t> offsets;
    for (const auto& item : model_->named_parameters()) offsets[item.key()] = offset, offset += item.value().numel();
    for (auto& [name, view] : arena_views(host, keep_begin))
      if (model_is_stacked_experts(name) || (offsets[name] >= begin && offsets[name] < end)) kept.emplace_back(name, view);
    return model_checkpoint_views(kept, expert_rank_ * (config_.num_experts / config_.expert_parallelism));
  };
  // One copy per flat buffer; the named tensors are views into those copies.
  // Sharded levels gather every unit through one unit-sized buffer (docs/checkpoints.md).
  const ShardedModelState::HostRange kept{keep_begin, keep_end, begin, end};
  const auto params = sharded_state_ ? sharded_state_->params_to_host(kept)
                                     : flat_params_.narrow(0, begin, end - begin).to(torch::kCPU, false, /*copy=*/true);
  // Moments on the host; with ZeRO-1 assembled from every rank (a collective) through a transient
  // padded buffer laid out as the parameter arena, in which this rank fills its chunk.
  torch::Tensor full = sharded() ? torch::zeros_like(flat_params_padded_) : torch::Tensor();
  const auto host_moments = [&](const torch::Tensor& shard, const std::string& what) {
    if (sharded_state_) return sharded_state_->gather_to_host(shard, what, kept);
    if (!sharded()) return shard.narrow(0, begin, end - begin).to(torch::kCPU, false, true);
    full.narrow(0, shard_begin_, shard_end_ - shard_begin_).copy_(shard);
    all_gather_chunks(full, what);
    return full.narrow(0, begin, end - begin).to(torch::kCPU, false, true);
  };
  const auto m = host_moments(adam_m_, "the AdamW first moments");
  const auto v = host_moments(adam_v_, "the AdamW second moments");
  if (keep_begin == keep_end) return c;  // nothing kept here
  // With expert parallelism every stacked expert tensor is gathered from the group: a checkpoint
  // holds every expert under its HF name, whatever expert_parallelism wrote it.
  c.model = own_shard ? own_shard_views(params) : model_checkpoint_views(with_all_experts(arena_views(params), "the expert weights"));
  if (rank == 0 || !own_shard)
    for (const auto& item : model_->named_buffers())
      c.model.emplace_back(item.key(), item.value().to(torch::kCPU, torch::kFloat32, false, true).contiguous());
  for (const auto& [prefix, moments] : {std::pair{"exp_avg.", m}, std::pair{"exp_avg_sq.", v}})
    for (const auto& [name, view] : own_shard ? own_shard_views(moments)
                                              : model_checkpoint_views(with_all_experts(arena_views(moments), "the expert AdamW moments")))
      c.optimizer.emplace_back(prefix + name, view);
  c.state.step = completed_steps;
  c.state.updates_applied = updates_applied_;
  c.state.consumed_samples = completed_steps * config_.global_batch_size;
  c.state.consumed_valid_samples = eval_consumed_samples_;
  c.state.spike_losses.assign(spike_losses_.begin(), spike_losses_.end());
  c.state.spike_grad_norms.assign(spike_grad_norms_.begin(), spike_grad_norms_.end());
  const auto rng = at::detail::getDefaultCPUGenerator().get_state();
  static const char* digits = "0123456789abcdef";
  for (int64_t i = 0; i < rng.numel(); ++i) {
    const auto byte = rng.data_ptr<uint8_t>()[i];
    c.state.cpu_rng_state += digits[byte >> 4];
    c.state.cpu_rng_state += digits[byte & 15];
  }
  c.state.world_size = config_.data_parallel_size;
  c.config_yaml = config_to_yaml(config_);
  c.state.config_hash = checkpoint_hash_text(c.config_yaml);
  return c;
}

void Trainer::checkpoint_commit(bool block, bool fatal) {
  if (!checkpointer_ || !sharded_checkpoints() || checkpointer_->uncommitted_step() < 0) return;
  const int64_t R = comm_->world_size(), rank = comm_->rank(), step = checkpointer_->uncommitted_step();
  const bool ended = block || !checkpointer_->writing();
  if (ended) {
    const std::string error = checkpointer_->wait();  // once; kept until the ranks decide
    if (!error.empty()) {
      spdlog::error("rank {}: {}", rank, error);
      checkpoint_write_error_ = error;
    }
  }
  // Entries r and R + r: whether rank r's writes have ended, and whether they failed; summed over
  // the ranks, so every rank takes the same decision.
  auto status = torch::zeros({2 * R}, torch::kFloat32);
  status[rank] = ended ? 1.0 : 0.0;
  status[R + rank] = checkpoint_write_error_.empty() ? 0.0 : 1.0;
  auto on_device = status.to(device_);
  comm_->all_reduce_sum(on_device, "the status of checkpoint " + std::to_string(step) + "'s writes");
  status = on_device.cpu();
  const auto counts = status.accessor<float, 1>();
  for (int64_t r = 0; r < R; ++r)
    if (counts[r] < 1) return;  // not yet: after the next step
  checkpoint_write_error_.clear();
  std::string failed;
  for (int64_t r = 0; r < R; ++r)
    if (counts[R + r] > 0) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
  std::string problem;
  if (!failed.empty()) {
    checkpointer_->abandon_shards(/*writer=*/rank == 0);
    problem = "checkpoint " + std::to_string(step) + " was not saved: rank(s) " + failed +
              " could not write their shard (their log says why); earlier checkpoints are intact";
  } else {
    try {  // rank 0 alone writes the manifest and renames: its failure is every rank's
      ranks_share_failure(*comm_, "committing checkpoint " + std::to_string(step),
                          [&] { checkpointer_->commit_shards(/*writer=*/rank == 0); });
    } catch (const Error& e) {
      problem = e.what();
    }
  }
  if (problem.empty()) return;
  if (fatal) throw Error(kExitFailure, problem);
  spdlog::error("{}", problem);
}

namespace {

void throw_if_mismatched(const std::vector<std::string>& problems, const std::string& source) {
  if (problems.empty()) return;
  std::string message = source + " does not match the model of this config:";
  for (size_t i = 0; i < problems.size() && i < 20; ++i) message += "\n  - " + problems[i];
  if (problems.size() > 20) message += "\n  - ... and " + std::to_string(problems.size() - 20) + " more";
  throw config_error(message);
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << torch::IntArrayRef(shape);
  return out.str();
}

}  // namespace

void Trainer::restore_streamed(const CheckpointReader& reader, bool full_state, const std::string& source) {
  torch::NoGradGuard no_grad;
  std::vector<std::string> problems;
  std::set<std::string> restored, mismatched;
  // Parameters in arena order, in groups restored together: a layer's stacked experts
  // (gate_up_proj, down_proj) share their per-expert checkpoint names; every other parameter is
  // its own group. Each group goes through host tensors of its size, then this rank keeps its parts.
  // With expert parallelism the host tensors of stacked experts hold the whole layer (every
  // expert is read, so every name is accounted for), and this rank keeps its experts' slice.
  std::vector<std::tuple<std::string, torch::Tensor, int64_t>> parameters;  // name, parameter, arena offset
  int64_t offset = 0;
  for (const auto& item : model_->named_parameters()) {
    parameters.emplace_back(item.key(), item.value(), offset);
    offset += item.value().numel();
  }
  for (size_t first = 0; first < parameters.size();) {
    size_t last = first + 1;
    while (last < parameters.size() && model_is_stacked_down_proj(std::get<0>(parameters[last]))) ++last;
    for (const std::string prefix : {"", "exp_avg.", "exp_avg_sq."}) {
      if (!full_state && !prefix.empty()) break;  // weights only
      NamedTensors group;  // host tensors shaped as the parameters
      for (size_t i = first; i < last; ++i) {
        auto shape = std::get<1>(parameters[i]).sizes().vec();
        if (expert_group_ && model_is_stacked_experts(std::get<0>(parameters[i]))) shape[0] *= expert_group_->world_size();
        group.emplace_back(std::get<0>(parameters[i]), torch::empty(shape, torch::kFloat32));
      }
      for (auto& [name, view] : model_checkpoint_views(group)) {
        const std::string key = prefix + name;
        if (!prefix.empty() && mismatched.count(name)) continue;  // its weight's problem is listed
        const auto shape = reader.shape(key);
        if (!reader.contains(key)) {
          problems.push_back("missing " + key);
          mismatched.insert(name);
        } else if (shape != view.sizes().vec()) {
          mismatched.insert(name);
          problems.push_back(key + " has shape " + shape_text(shape) + " in the checkpoint, " + shape_text(view.sizes().vec()) +
                             " in the model");
        } else {
          view.copy_(reader.read(key));
          restored.insert(key);
        }
      }
      if (!problems.empty()) continue;  // reported below; nothing more is copied
      for (size_t i = first; i < last; ++i) {
        auto values = group[i - first].second;
        const int64_t local = std::get<1>(parameters[i]).size(0);
        if (values.size(0) != local) values = values.narrow(0, expert_rank_ * local, local);  // this rank's experts
        values = values.reshape({-1});
        const int64_t begin = std::get<2>(parameters[i]);
        if (prefix.empty()) sharded_state_->params_load_range(values, begin);
        else sharded_state_->shard_load_range(prefix == "exp_avg." ? adam_m_ : adam_v_, values, begin);
      }
    }
    first = last;
  }
  for (const auto& item : model_->named_buffers()) {
    if (!reader.contains(item.key())) {
      if (full_state) problems.push_back("missing " + item.key());  // a weights file may leave buffers out
    } else if (reader.shape(item.key()) != item.value().sizes().vec()) {
      problems.push_back(item.key() + " has shape " + shape_text(reader.shape(item.key())) + " in the checkpoint, " +
                         shape_text(item.value().sizes().vec()) + " in the model");
    } else {
      item.value().copy_(reader.read(item.key()));
      restored.insert(item.key());
    }
  }
  for (const auto& name : reader.model_names())
    if (!restored.count(name)) problems.push_back("unexpected " + name);
  throw_if_mismatched(problems, source);
}

// Copies checkpoint tensors into the model (and, for a full state, the optimizer and counters).
// Names and shapes must match exactly; every difference is listed (exit code 2). The levels that
// hold the whole arena only: the sharded ones restore through restore_streamed.
void Trainer::restore(const CheckpointContents& c, bool full_state, const std::string& source) {
  TORCH_CHECK(!sharded_state_, "restore: the sharded levels restore one tensor at a time (restore_streamed)");
  torch::NoGradGuard no_grad;
  std::map<std::string, torch::Tensor> saved(c.model.begin(), c.model.end());
  std::vector<std::string> problems;
  const auto params = flat_params_;
  const auto targets = restore_targets(params);  // with expert parallelism: whole-layer experts
  NamedTensors tensors = model_checkpoint_views(targets);
  for (const auto& item : model_->named_buffers()) tensors.emplace_back(item.key(), item.value());
  for (auto& [name, tensor] : tensors) {
    auto it = saved.find(name);
    const bool is_buffer = model_->named_buffers().contains(name);
    if (it == saved.end()) {
      if (!is_buffer || full_state) problems.push_back("missing " + name);
      continue;
    }
    if (it->second.sizes() != tensor.sizes()) {
      std::ostringstream msg;
      msg << name << " has shape " << it->second.sizes() << " in the checkpoint, " << tensor.sizes() << " in the model";
      problems.push_back(msg.str());
    } else {
      tensor.copy_(it->second);
    }
    saved.erase(it);
  }
  for (const auto& [name, tensor] : saved) problems.push_back("unexpected " + name);
  throw_if_mismatched(problems, source);
  keep_local_experts(targets, params);
  if (!full_state) return;
  std::map<std::string, torch::Tensor> moments(c.optimizer.begin(), c.optimizer.end());
  auto full_m = torch::empty_like(params), full_v = torch::empty_like(params);  // (P)
  for (auto [prefix, flat] : {std::pair{"exp_avg.", full_m}, std::pair{"exp_avg_sq.", full_v}}) {
    const auto moment_targets = restore_targets(flat);
    for (auto& [name, view] : model_checkpoint_views(moment_targets)) {
      auto it = moments.find(prefix + name);
      if (it == moments.end() || it->second.numel() != view.numel())
        throw config_error(source + ": optimizer state lacks " + prefix + name + " or its shape differs");
      view.copy_(it->second.reshape(view.sizes()));
    }
    keep_local_experts(moment_targets, flat);
  }
  // Checkpoints hold the full moments, so any world size and sharding can load them.
  adam_m_.copy_(full_m.narrow(0, shard_begin_, shard_end_ - shard_begin_));
  adam_v_.copy_(full_v.narrow(0, shard_begin_, shard_end_ - shard_begin_));
  restore_state(c.state, c.config_yaml, source);
}

void Trainer::restore_state(const CheckpointState& state, const std::string& config_yaml, const std::string& source) {
  restored_consumed_samples_ = state.consumed_samples;
  // A state.json without the validation position: where the evaluations of its steps under this
  // config left it (Megatron derives it alike from its checkpoint's iteration).
  // Megatron's --skip-train evaluates from the validation split's start.
  eval_consumed_samples_ = state.consumed_valid_samples >= 0 && !config_.skip_train ? state.consumed_valid_samples : 0;
  if (state.consumed_valid_samples < 0 && config_.eval_interval > 0 && !config_.skip_train &&
      (__builtin_mul_overflow(state.step / config_.eval_interval, config_.eval_steps, &eval_consumed_samples_) ||
       __builtin_mul_overflow(eval_consumed_samples_, config_.global_batch_size, &eval_consumed_samples_)))
    throw config_error(source + ": its step " + std::to_string(state.step) + " x eval_steps x global_batch_size does "
                       "not fit in 64 bits");
  if (state.world_size != config_.data_parallel_size)
    spdlog::warn("{} was written with {} ranks, resuming with {}", source, state.world_size, config_.data_parallel_size);
  updates_applied_ = state.updates_applied;
  spike_losses_.assign(state.spike_losses.begin(), state.spike_losses.end());
  spike_grad_norms_.assign(state.spike_grad_norms.begin(), state.spike_grad_norms.end());
  // A shorter skip_step_interval than the checkpoint's: the window is its newest entries, as if
  // the run had had this interval all along (the window holds the last n steps, skipped included).
  while (spike_losses_.size() > static_cast<size_t>(config_.skip_step_interval))
    spike_losses_.pop_front(), spike_grad_norms_.pop_front();
  if (!state.cpu_rng_state.empty()) {
    auto rng = torch::empty({static_cast<int64_t>(state.cpu_rng_state.size() / 2)}, torch::kUInt8);
    for (int64_t i = 0; i < rng.numel(); ++i)
      rng.data_ptr<uint8_t>()[i] = static_cast<uint8_t>(std::stoi(state.cpu_rng_state.substr(2 * i, 2), nullptr, 16));
    auto generator = at::detail::getDefaultCPUGenerator();
    try {
      generator.set_state(rng);
    } catch (const c10::Error& e) {
      throw config_error(source + ": state.json's rng.torch_cpu is not a CPU generator state this LibTorch reads: " +
                         e.what_without_backtrace());
    }
  }
  const std::string current_yaml = config_to_yaml(config_);
  if (checkpoint_hash_text(current_yaml) != state.config_hash) {
    // Name the keys that changed (steps or log_period may legitimately change on resume).
    std::map<std::string, std::string> before, after;
    auto parse = [](const std::string& yaml, std::map<std::string, std::string>& out) {
      std::istringstream in(yaml);
      for (std::string line; std::getline(in, line);)
        if (const auto colon = line.find(": "); colon != std::string::npos && line[0] != '#')
          out[line.substr(0, colon)] = line.substr(colon + 2);
    };
    parse(config_yaml, before);
    parse(current_yaml, after);
    std::string changed;
    for (const auto& [key, value] : after)
      if (before.count(key) && config_value_canonical(key, before[key]) != value)  // not another spelling of it
        changed += (changed.empty() ? "" : ", ") + key + " " + before[key] + " -> " + value;
    if (!changed.empty()) spdlog::warn("resuming with a config that differs from the checkpoint's: {}", changed);
    // An edited config.yml whose steps is not an integer leaves it unknown (no steps warning).
    if (before.count("steps")) {
      const std::string& text = before["steps"];
      int64_t steps = 0;
      if (std::from_chars(text.data(), text.data() + text.size(), steps).ptr == text.data() + text.size()) restored_steps_ = steps;
    }
  }
}

// Every rank looks for the newest valid checkpoint itself, and all must resume from the same one:
// a rank that sees another (a node-local or stale copy of the run directory, a read error that
// made it skip the newest) would average its gradients with replicas at another step and commit
// checkpoints that look valid. Rank 0's pick is broadcast; a rank that found another makes every
// rank exit 3, each naming what it found. (Megatron takes the maximum iteration over the ranks.)
namespace {
// Where rank 0 verifies a checkpoint's checksums, another rank checks that it sees its files at
// their sizes (a node that lacks the path fails here, not in the load after the others went on).
void checkpoint_check_files_present(const std::string& key, const std::string& path, bool weights_only) {
  if (const std::string problem = checkpoint_verify(path, weights_only, /*checksums=*/false); !problem.empty())
    throw Error(kExitData, key + " " + path + " is not usable on this rank: " + problem);
}
}  // namespace

void Trainer::on_rank0_alone(const std::string& what, const std::function<void()>& work,
                             const std::function<void()>& others_work) {
  std::exception_ptr failure;
  if (dist_.rank == 0) {
    try {
      work();
    } catch (...) {
      failure = std::current_exception();
    }
  }
  comm_->wait_for_rank0(what + ": done", what);
  // Rank 0's outcome first: its message is the one that says what is wrong (a run directory
  // named for a checkpoint), where the others would only see files missing.
  ranks_share_failure(*comm_, what, [&] {
    if (failure) std::rethrow_exception(failure);
  });
  if (others_work) ranks_share_failure(*comm_, what + " (the other ranks)", [&] {
    if (dist_.rank > 0) others_work();
  });
}

std::optional<std::string> Trainer::agree_on_latest_checkpoint() {
  const std::string checkpoints_dir = (std::filesystem::path(config_.run_dir) / "checkpoints").string();
  std::optional<std::string> newest;
  std::string described;  // rank 0's: its pick and its manifest's checksum, "" for none
  // Rank 0 verifies every file's checksum (falling back past damaged ones); the others check that
  // they see the same: rank 0's pick with the same manifest.json (which holds every file's
  // checksum) and file sizes, or, where rank 0 found none, no checkpoint directory either. Two
  // copies of a run directory (node-local working directories, a stale cache) can hold other
  // checkpoints, or others under one step.
  on_rank0_alone("looking for a checkpoint in " + checkpoints_dir, [&] {
    newest = checkpoint_find_latest(checkpoints_dir);
    if (newest && !comm_->is_local()) described = *newest + " (manifest.json checksum " + checkpoint_manifest_hash(*newest) + ")";
  });
  if (comm_->is_local()) return newest;
  const std::string rank0 = comm_->broadcast_string("checkpoint to resume", described);
  std::string mine = rank0;  // as rank 0 describes it, or what this rank sees instead
  if (dist_.rank > 0) {
    ranks_share_failure(*comm_, "checking rank 0's checkpoint in " + checkpoints_dir, [&] {
      if (rank0.empty()) {
        std::string steps;
        for (const int64_t step : checkpoint_list_steps(checkpoints_dir)) steps += (steps.empty() ? "" : ", ") + std::to_string(step);
        if (!steps.empty()) mine = "checkpoint directories of steps " + steps;
        return;
      }
      newest = rank0.substr(0, rank0.rfind(" (manifest.json checksum "));
      if (!std::filesystem::exists(std::filesystem::path(*newest) / "manifest.json")) {
        mine = "no " + *newest + "/manifest.json";
      } else if (const std::string problem = checkpoint_verify(*newest, false, /*checksums=*/false); !problem.empty()) {
        mine = *newest + " not usable: " + problem;
      } else {
        mine = *newest + " (manifest.json checksum " + checkpoint_manifest_hash(*newest) + ")";
      }
    });
  } else {
    ranks_share_failure(*comm_, "checking rank 0's checkpoint in " + checkpoints_dir, [] {});
  }
  const int64_t differing = ranks_reporting(mine != rank0, *comm_, "the checkpoint agreement");
  const std::string rank0_text = rank0.empty() ? std::string("none (a fresh start)") : rank0;
  if (mine != rank0)
    throw Error(kExitData, "rank " + std::to_string(dist_.rank) + " sees the checkpoints in " + checkpoints_dir +
                               " otherwise than rank 0: rank 0 resumes from " + rank0_text + ", and here there is " +
                               (mine.empty() ? std::string("no checkpoint") : mine) +
                               ": every rank must see the same run directory (a shared filesystem; docs/distributed.md)");
  if (differing > 0)
    throw Error(kExitData, "rank " + std::to_string(dist_.rank) + ": " + std::to_string(differing) +
                               " rank(s) see the checkpoints in " + checkpoints_dir + " otherwise than rank 0, which resumes from " +
                               rank0_text + " (their messages say what they see); every rank must see the same run directory");
  return newest;
}

int64_t Trainer::load_initial_state(StartingFor use) {
  const Config& c = config_;
  const auto own = agree_on_latest_checkpoint();
  // `dir` was verified (checkpoint_find_latest, checkpoint_check_full_state_path). Sharded levels
  // read one tensor at a time and keep their parts; the others read it all.
  const auto restore_full = [&](const std::string& dir, const std::string& source) {
    if (sharded_state_) {
      restore_streamed(CheckpointReader(dir), /*full_state=*/true, source);
      const auto [state, config_yaml] = checkpoint_load_state(dir);
      restore_state(state, config_yaml, source);
      return state;
    }
    const auto contents = checkpoint_load(dir);
    restore(contents, /*full_state=*/true, source);
    return contents.state;
  };
  if (own) {
    // The data position is step x global_batch_size (data_first_sample_index): with another global
    // batch a resumed run would skip or repeat samples, so a changed one is refused, not followed,
    // from state.json alone, before minutes of reading tensors. (A finished run has nothing to
    // skip, an export reads no data; a load_full_state_path of another run starts a new data
    // stream: its position is not checked.)
    if (use == StartingFor::kTraining && !c.skip_train) {
      const CheckpointState peek = checkpoint_load_state(*own).first;
      if (peek.step < c.steps && peek.consumed_samples != peek.step * c.global_batch_size)
        throw config_error("checkpoint " + *own + " consumed " + std::to_string(peek.consumed_samples) + " samples in " +
                           std::to_string(peek.step) + " steps, but this run's global_batch_size is " +
                           std::to_string(c.global_batch_size) + " (per_device_batch_size " +
                           std::to_string(c.per_device_batch_size) + " x " + std::to_string(c.data_parallel_size) +
                           " ranks x gradient_accumulation_steps " + std::to_string(c.gradient_accumulation_steps) +
                           "): it would skip or repeat samples; keep the product at " +
                           (peek.step > 0 ? std::to_string(peek.consumed_samples / peek.step) : std::string("the checkpoint's")));
    }
    const auto state = restore_full(*own, "checkpoint " + *own);
    const bool continues = use == StartingFor::kTraining && !c.skip_train && state.step < c.steps;
    // Megatron's index is shuffled over whole epochs of the run's steps x global_batch_size
    // samples: another `steps` that changes a dataset's epochs is another sample order (as in
    // Megatron when --train-iters changes).
    if (continues && restored_steps_ > 0 && restored_steps_ != c.steps &&
        !data_.data_loader_same_samples_as_built_for(restored_steps_ * c.global_batch_size))
      spdlog::warn("steps changed from {} to {}, and the data index built for {} x global_batch_size samples spans other "
                   "epochs than the checkpoint's run had: from step {} on the samples differ from those that run would "
                   "have drawn, and some it already trained on may come again (Megatron does the same when "
                   "--train-iters changes; docs/data.md)",
                   restored_steps_, c.steps, c.steps, state.step);
    spdlog::info("resumed from checkpoint {} (step {}, {} updates applied)", *own, state.step, state.updates_applied);
    initial_state_source_ = "run_dir " + c.run_dir;
    return state.step;
  }
  if (!c.load_full_state_path.empty()) {
    on_rank0_alone("checking load_full_state_path " + c.load_full_state_path,
                   [&] { checkpoint_check_full_state_path(c.load_full_state_path); },
                   [&] { checkpoint_check_files_present("load_full_state_path", c.load_full_state_path, false); });
    const auto state = restore_full(c.load_full_state_path, "load_full_state_path " + c.load_full_state_path);
    spdlog::info("loaded full state from {} (step {})", c.load_full_state_path, state.step);
    initial_state_source_ = "load_full_state_path " + c.load_full_state_path;
    return state.step;
  }
  if (!c.load_parameters_path.empty() && std::filesystem::exists(std::filesystem::path(c.load_parameters_path) / "config.json")) {
    load_hf_parameters(c.load_parameters_path);
  } else if (!c.load_parameters_path.empty()) {
    // A file, or a checkpoint directory: its model.safetensors or, written by several ranks, the
    // shards its model.safetensors.index.json lists.
    // Sharded levels read it one tensor at a time, as a resume does; the others read it all.
    const std::string& path = c.load_parameters_path;
    bool dir = false, checkpoint_dir = false;
    ranks_share_failure(*comm_, "opening load_parameters_path " + path, [&] {
      dir = std::filesystem::is_directory(path);
      if (!dir && !std::filesystem::exists(path)) throw config_error("load_parameters_path: no file " + path);
      checkpoint_dir = dir && std::filesystem::exists(std::filesystem::path(path) / "manifest.json");
    });
    // A checkpoint directory's model files are verified as a resume verifies them (sizes and
    // CRC32C against its manifest): a flipped byte used to load as a weight of 5051. Its
    // optimizer files are not read (they were, and are twice the weights' size). Rank 0 says
    // whether it is one (every rank takes the same branch; one that sees no manifest fails its check).
    if (!comm_->is_local()) checkpoint_dir = comm_->broadcast_string("load_parameters_path is a checkpoint", checkpoint_dir ? "1" : "") == "1";
    if (checkpoint_dir)
      on_rank0_alone(
          "verifying load_parameters_path " + path,
          [&] {
            if (const std::string problem = checkpoint_verify(path, /*weights_only=*/true); !problem.empty())
              throw Error(kExitData, "load_parameters_path " + path + " is not usable: " + problem);
          },
          [&] { checkpoint_check_files_present("load_parameters_path", path, true); });
    if (sharded_state_) {
      auto reader = CheckpointReader::weights(path);
      reader.check_reads([&](const std::string& name, const std::string& stored, const torch::Tensor& tensor) {
        checkpoint_check_initial_weight(c, name, stored, tensor, path);
      });
      restore_streamed(reader, /*full_state=*/false, "load_parameters_path " + path);
    } else {
      CheckpointContents weights;
      weights.model = dir ? hf_read_directory(path) : checkpoint_read_tensors(path);
      // Initial weights must be finite (a resume may read what a diverged run saved; these not).
      for (const auto& [name, tensor] : weights.model) checkpoint_check_initial_weight(c, name, name, tensor, path);
      restore(weights, /*full_state=*/false, "load_parameters_path " + path);
    }
    spdlog::info("loaded weights from {}{}; optimizer and step start fresh", path,
                 sharded_state_ ? " (one tensor at a time, each rank keeping its parts)" : "");
  }
  return 0;
}

void Trainer::load_hf_parameters(const std::string& dir) {
  const auto differences = hf_config_compare(config_, dir);
  if (!differences.first_shape_mismatch.empty())
    throw config_error("load_parameters_path " + dir + " holds a different model: " + differences.first_shape_mismatch);
  for (const auto& difference : differences.other)
    spdlog::warn("load_parameters_path: {} (the weights fit; they will compute differently than there)", difference);
  const std::string architecture = hf_config_architecture(dir);
  if (sharded_state_) {  // one tensor at a time, each rank keeping its parts, as a resume reads
    restore_streamed(CheckpointReader::hugging_face(dir, config_, architecture), /*full_state=*/false,
                     "Hugging Face checkpoint " + dir);
  } else {
    CheckpointContents weights;
    weights.model = hf_tensors_to_checkpoint(config_, hf_read_directory(dir), architecture, dir);
    restore(weights, /*full_state=*/false, "Hugging Face checkpoint " + dir);
  }
  spdlog::info("loaded the {} weights of {}{}; optimizer and step start fresh", architecture, dir,
               sharded_state_ ? " (one tensor at a time, each rank keeping its parts)" : "");
}

// Exports stream the weights one unit at a time (sharding.h's model_units: the embedding, each
// decoder layer, with expert parallelism its stacked experts apart, the rest), then the buffers: no rank ever holds more than one unit of weights
// beyond its own state, and the optimizer moments are not read. Rank 0 first plans the files from
// the same walk over meta tensors (names and shapes, no data, no collective), so each file's header
// is written before its tensors arrive.
NamedTensors Trainer::export_unit(const ShardUnit& unit, size_t index, bool meta) {
  torch::NoGradGuard no_grad;
  const bool rank0 = comm_->rank() == 0;
  torch::Tensor params;  // (numel) the unit's arena elements, on the host (or meta)
  if (meta) {
    if (!rank0) return {};
    params = torch::empty({unit.numel}, torch::TensorOptions().dtype(torch::kFloat32).device(torch::kMeta));
  } else if (sharded_state_) {
    // A collective with optim_grads_params; with expert parallelism every rank brings its experts.
    params = sharded_state_->unit_params_to_host(index, rank0 || unit.experts);
  } else if (rank0 || unit.experts) {  // every rank brings its experts
    params = flat_params_.narrow(0, unit.begin, unit.numel).to(torch::kCPU, false, /*copy=*/true);
  }
  if (!params.defined()) return {};
  auto views = with_all_experts(arena_views(params, unit.begin), "the expert weights");
  if (!rank0) return {};
  return model_checkpoint_views(views);
}

NamedTensors Trainer::export_buffers(bool meta) const {
  NamedTensors out;
  if (comm_->rank() != 0) return out;
  for (const auto& item : model_->named_buffers())
    out.emplace_back(item.key(), meta ? torch::empty(item.value().sizes(), torch::TensorOptions().dtype(torch::kFloat32).device(torch::kMeta))
                                      : item.value().to(torch::kCPU, torch::kFloat32, false, true).contiguous());
  return out;
}

NamedTensors Trainer::export_plan() {
  NamedTensors plan;
  const auto units = model_units(model_, /*split_experts=*/expert_group_ != nullptr);
  for (size_t i = 0; i < units.size(); ++i)
    for (auto& item : export_unit(units[i], i, /*meta=*/true)) plan.push_back(std::move(item));
  for (auto& item : export_buffers(/*meta=*/true)) plan.push_back(std::move(item));
  return plan;
}

void Trainer::export_stream(const std::function<void(const NamedTensors&)>& write, std::exception_ptr& failure) {
  const auto units = model_units(model_, /*split_experts=*/expert_group_ != nullptr);
  for (size_t i = 0; i <= units.size(); ++i) {
    const auto tensors = i < units.size() ? export_unit(units[i], i, /*meta=*/false) : export_buffers(/*meta=*/false);
    if (tensors.empty() || failure) continue;  // a failed write: the others still take part to the end
    try {
      write(tensors);
    } catch (...) {
      failure = std::current_exception();
    }
  }
}

void Trainer::export_hf(const std::string& dir, int64_t max_shard_bytes, torch::ScalarType dtype) {
  const std::string config_json = hf_config_json(config_, dtype == torch::kBFloat16 ? "bfloat16" : "float32");
  std::unique_ptr<HfDirectoryWriter> writer;
  std::exception_ptr failure;
  if (comm_->rank() == 0) {
    try {
      writer = std::make_unique<HfDirectoryWriter>(dir, config_json, hf_tensors_from_checkpoint(config_, export_plan()),
                                                   max_shard_bytes, dtype);
    } catch (...) {
      failure = std::current_exception();
    }
  }
  export_stream([&](const NamedTensors& tensors) { writer->append(hf_tensors_from_checkpoint(config_, tensors)); }, failure);
  if (comm_->rank() != 0) return;
  if (failure) std::rethrow_exception(failure);
  writer->finish();
}

void Trainer::export_model(const std::string& path) {
  std::unique_ptr<SafetensorsStreamWriter> writer;
  const std::filesystem::path target(path);
  const std::filesystem::path partial = target.string() + ".partial-" + std::to_string(getpid());
  std::exception_ptr failure;
  if (comm_->rank() == 0) {
    try {
      std::vector<SafetensorsEntry> entries;
      for (const auto& [name, tensor] : export_plan())
        entries.push_back({name, "F32", tensor.sizes().vec(), nullptr, static_cast<size_t>(tensor.numel()) * 4});
      if (!target.parent_path().empty()) std::filesystem::create_directories(target.parent_path());
      writer = std::make_unique<SafetensorsStreamWriter>(partial.string(), std::move(entries),
                                                         std::map<std::string, std::string>{{"format", "pt"}});
    } catch (...) {
      failure = std::current_exception();
    }
  }
  export_stream(
      [&](const NamedTensors& tensors) {
        for (const auto& [name, tensor] : tensors) {
          const auto bytes = tensor.contiguous();
          writer->append(name, bytes.data_ptr(), bytes.nbytes());
        }
      },
      failure);
  if (comm_->rank() != 0) return;
  try {
    if (failure) std::rethrow_exception(failure);
    writer->finish();
    std::filesystem::rename(partial, target);
    directory_sync(target.parent_path().empty() ? "." : target.parent_path().string());
  } catch (const std::exception& e) {
    writer.reset();
    std::error_code ignored;
    std::filesystem::remove(partial, ignored);
    throw Error(kExitFailure, std::string("cannot export weights: ") + e.what());
  }
}

NamedTensors Trainer::logits_for(const std::vector<int64_t>& tokens, bool with_gradients) {
  torch::AutoGradMode record(with_gradients);
  const auto length = static_cast<int64_t>(tokens.size());
  const auto row = torch::tensor(tokens, torch::kInt64).reshape({1, length}).to(device_);  // (1, L)
  const auto positions = torch::arange(length, torch::kInt64).reshape({1, length}).to(device_);
  const auto segments = torch::ones({1, length}, torch::kInt64).to(device_);
  ModelOutput out;
  if (sharded_state_) sharded_state_->params_ensure();
  {
    compat::AutocastGuard autocast(config_.dtype == "bfloat16", device_.is_cuda());
    out = model_->forward(row, positions, segments, /*one_segment_per_row=*/true);
  }
  const auto host = [](const torch::Tensor& t) { return t.detach().to(torch::kCPU, torch::kFloat32).contiguous(); };
  NamedTensors named{{"logits", host(out.logits[0])}};  // (L, V)
  for (size_t k = 0; k < out.mtp_logits.size(); ++k) named.emplace_back("mtp_logits." + std::to_string(k + 1), host(out.mtp_logits[k][0]));
  if (!with_gradients) return named;
  if (length < 2) throw config_error("--dump-gradients needs at least 2 tokens (the loss predicts token i+1 from i)");
  if (comm_->world_size() > 1)
    throw config_error("--dump-gradients runs in one process (this run has " + std::to_string(comm_->world_size()) + " ranks)");
  // Recomputed units add their weights' gradients to .grad inside their own backward, out of
  // autograd::grad's reach: they would read as zeros.
  if (config_.remat_policy != "none")
    throw config_error("--dump-gradients needs remat_policy=none (got " + config_.remat_policy + ")");
  const auto logits = out.logits[0].narrow(0, 0, length - 1);  // (L-1, V)
  const auto loss = torch::nn::functional::cross_entropy(logits, row[0].narrow(0, 1, length - 1));
  NamedTensors parameters;
  std::vector<torch::Tensor> leaves;
  for (const auto& item : model_->named_parameters()) {
    parameters.emplace_back(item.key(), item.value());
    leaves.push_back(item.value());
  }
  const auto grads = torch::autograd::grad({loss}, leaves, {}, /*retain_graph=*/false, /*create_graph=*/false, /*allow_unused=*/true);
  NamedTensors by_parameter;
  for (size_t i = 0; i < parameters.size(); ++i)
    by_parameter.emplace_back(parameters[i].first, grads[i].defined() ? host(grads[i]) : torch::zeros_like(host(parameters[i].second)));
  named.emplace_back("loss", host(loss).reshape({1}));
  for (const auto& [name, grad] : model_checkpoint_views(by_parameter))
    named.emplace_back("grad." + name, grad.contiguous());
  return named;
}

}  // namespace trainer
