// Checkpoint save/verify/load (see ckpt.h and docs/checkpoints.md).
//
// Crash safety: a checkpoint is written into checkpoints/.tmp-<step>/, every file fsynced,
// manifest.json (size + CRC32C of every other file) written last, the directory fsynced and then
// renamed to checkpoints/<step>/, and only then checkpoints/latest replaced (write + rename).
// A reader trusts a directory only if its manifest verifies, so a kill at any moment leaves
// either the previous checkpoints or a complete new one; .tmp-* directories are never read, and
// the next run on the directory deletes them (checkpoint_remove_unfinished).
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <chrono>
#include <thread>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "trainer/ckpt/ckpt.h"
#include "trainer/ckpt/safetensors.h"
#include "trainer/util/error.h"
#include "trainer/util/json_integer.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

// The step a checkpoint directory name stands for: its step in canonical decimal ("12", not "012"
// or "+12"), or -1 for any other name (.tmp-*, "00", a step too large for int64).
int64_t checkpoint_step_of(const std::string& name) {
  if (name.empty() || name.size() > 18 || !std::all_of(name.begin(), name.end(), ::isdigit)) return -1;
  const int64_t step = std::stoll(name);
  return std::to_string(step) == name ? step : -1;
}

// The steps of the checkpoint directories under `root`, newest first; any other entry is not a
// checkpoint and is left alone.
std::vector<int64_t> checkpoint_steps(const fs::path& root) {
  std::vector<int64_t> steps;
  for (const auto& entry : fs::directory_iterator(root)) {
    const int64_t step = checkpoint_step_of(entry.path().filename().string());
    if (entry.is_directory() && step >= 0) steps.push_back(step);
  }
  std::sort(steps.rbegin(), steps.rend());
  return steps;
}

// The tensor files of a checkpoint written by `shards` ranks (1: one writer): (model, optimizer).
std::pair<std::vector<std::string>, std::vector<std::string>> checkpoint_tensor_files(int64_t shards) {
  if (shards <= 1) return {{"model.safetensors"}, {"optimizer.safetensors"}};
  std::pair<std::vector<std::string>, std::vector<std::string>> files;
  for (int64_t r = 0; r < shards; ++r) {
    files.first.push_back(checkpoint_shard_file_name("model", r, shards, ".safetensors"));
    files.second.push_back(checkpoint_shard_file_name("optimizer", r, shards, ".safetensors"));
  }
  return files;
}

// The files a verified checkpoint must hold: the tensor files, state.json, config.yml and, when
// sharded, the model index.
std::vector<std::string> checkpoint_required_files(int64_t shards) {
  auto [files, optimizer] = checkpoint_tensor_files(shards);
  files.insert(files.end(), optimizer.begin(), optimizer.end());
  files.push_back("state.json");
  files.push_back("config.yml");
  if (shards > 1) files.push_back("model.safetensors.index.json");
  return files;
}

// A manifest's entry for a file holding `bytes` bytes with checksum `crc`.
nlohmann::ordered_json manifest_entry(uint64_t bytes, uint32_t crc) {
  return {{"bytes", bytes}, {"crc32c", hex32(crc)}};
}
nlohmann::ordered_json manifest_entry_of_text(const std::string& text) {
  return manifest_entry(text.size(), crc32c_update(0, text.data(), text.size()));
}

std::string read_text(const fs::path& path) {
  file_require_regular(path.string());
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string state_to_json(const CheckpointState& s) {
  nlohmann::ordered_json j;
  j["format_version"] = kCheckpointFormatVersion;
  j["step"] = s.step;
  j["updates_applied"] = s.updates_applied;
  j["consumed_samples"] = s.consumed_samples;
  j["data"] = {{"type", "global_sample_index"}, {"consumed_samples", s.consumed_samples}};
  if (s.consumed_valid_samples >= 0) j["consumed_valid_samples"] = s.consumed_valid_samples;
  j["spike_guard"] = {{"losses", s.spike_losses}, {"grad_norms", s.spike_grad_norms}};
  j["rng"] = {{"torch_cpu", s.cpu_rng_state}};
  j["lr_schedule"] = {{"updates_applied", s.updates_applied}};
  j["world_size"] = s.world_size;
  j["zero1"] = nullptr;
  j["config_hash"] = s.config_hash;
  return j.dump(2) + "\n";
}

// A checkpoint of another format is not damage: the run stops (falling back to an older one would
// let this run's next save at that step delete the newer one). `where`: "state.json", "manifest".
Error checkpoint_format_error(const std::string& checkpoint, const std::string& where, int64_t version) {
  return config_error("checkpoint " + checkpoint + " has format_version " + std::to_string(version) + " in its " + where +
                      "; this trainer reads version " + std::to_string(kCheckpointFormatVersion) +
                      " (use the trainer that wrote it)");
}

CheckpointState state_from_json(const std::string& text, const std::string& path) {
  const auto malformed = [&](const std::string& what) {
    return config_error("checkpoint " + path + ": state.json is malformed: " + what);
  };
  // Each field by its name: a missing one, or 2.5 where an integer belongs (get<int64_t> would
  // read it as 2), is named in the message.
  const auto member = [&](const nlohmann::json& parent, const std::string& key, const std::string& name) -> const nlohmann::json& {
    if (!parent.is_object() || !parent.contains(key)) throw malformed(name + " is missing");
    return parent.at(key);
  };
  const auto integer = [&](const nlohmann::json& parent, const std::string& key) {
    const auto& v = member(parent, key, key);
    if (!v.is_number_integer()) throw malformed(key + " is " + v.dump() + ", not an integer");
    if (!json_is_int64(v))
      throw malformed(key + " is " + v.dump() + ", beyond the 64-bit integer range");
    return v.get<int64_t>();
  };
  try {
    const auto j = nlohmann::json::parse(text);
    const int64_t version = integer(j, "format_version");
    if (version != kCheckpointFormatVersion) throw checkpoint_format_error(path, "state.json", version);
    CheckpointState s;
    s.step = integer(j, "step");
    s.updates_applied = integer(j, "updates_applied");
    s.consumed_samples = integer(j, "consumed_samples");
    s.world_size = integer(j, "world_size");
    if (j.contains("consumed_valid_samples")) {
      s.consumed_valid_samples = integer(j, "consumed_valid_samples");
      if (s.consumed_valid_samples < 0) throw malformed("consumed_valid_samples is negative");
    }
    const auto& spike = member(j, "spike_guard", "spike_guard");
    try {
      s.spike_losses = member(spike, "losses", "spike_guard.losses").get<std::vector<double>>();
      s.spike_grad_norms = member(spike, "grad_norms", "spike_guard.grad_norms").get<std::vector<double>>();
    } catch (const nlohmann::json::exception&) {
      throw malformed("spike_guard.losses and spike_guard.grad_norms must be lists of numbers");
    }
    // The guard keeps one (loss, grad norm) pair per accepted step and pops both together.
    if (s.spike_losses.size() != s.spike_grad_norms.size())
      throw malformed("spike_guard.losses has " + std::to_string(s.spike_losses.size()) +
                      " values and spike_guard.grad_norms " + std::to_string(s.spike_grad_norms.size()) +
                      " (one pair per accepted step)");
    const auto& rng = member(member(j, "rng", "rng"), "torch_cpu", "rng.torch_cpu");
    const auto& hash = member(j, "config_hash", "config_hash");
    if (!rng.is_string()) throw malformed("rng.torch_cpu is " + rng.dump() + ", not a string");
    if (!hash.is_string()) throw malformed("config_hash is " + hash.dump() + ", not a string");
    s.cpu_rng_state = rng.get<std::string>();
    s.config_hash = hash.get<std::string>();
    // A checkpoint directory is named by its step; the counters cannot be negative or disagree.
    auto dir = fs::path(path).lexically_normal();
    if (!dir.has_filename()) dir = dir.parent_path();  // "ckpt/12/"
    const std::string name = dir.filename().string();
    if (s.step < 0 || s.updates_applied < 0 || s.updates_applied > s.step || s.consumed_samples < 0)
      throw malformed("step " + std::to_string(s.step) + ", updates_applied " + std::to_string(s.updates_applied) +
                      ", consumed_samples " + std::to_string(s.consumed_samples) +
                      " (need 0 <= updates_applied <= step, consumed_samples >= 0)");
    if (s.world_size < 1) throw malformed("world_size " + std::to_string(s.world_size) + " (a run has at least one rank)");
    if (!name.empty() && std::all_of(name.begin(), name.end(), ::isdigit) && name != std::to_string(s.step))
      throw malformed("step " + std::to_string(s.step) + " in the checkpoint of step " + name);
    if (s.cpu_rng_state.size() % 2 != 0 || !std::all_of(s.cpu_rng_state.begin(), s.cpu_rng_state.end(), ::isxdigit))
      throw malformed("rng.torch_cpu is not a string of hex byte pairs");
    return s;
  } catch (const nlohmann::json::exception& e) {
    throw config_error("checkpoint " + path + ": state.json is malformed: " + e.what());
  }
}

// Moves a complete temporary directory to checkpoints/<name>/, then replaces `latest`, then
// removes all but the newest `keep` checkpoints (keep 0: all).
void commit_directory(const fs::path& root, const fs::path& tmp, const std::string& name, int64_t keep) {
  directory_sync(tmp.string());
  const fs::path final_dir = root / name;
  if (fs::exists(fs::symlink_status(final_dir)) && !fs::is_directory(fs::symlink_status(final_dir))) {
    // Not a checkpoint (a file or link someone put there): kept, under another name.
    fs::path aside = root / (name + ".not-a-checkpoint");
    for (int n = 1; fs::exists(fs::symlink_status(aside)); ++n) aside = root / (name + ".not-a-checkpoint." + std::to_string(n));
    fs::rename(final_dir, aside);
    spdlog::warn("checkpoint {}: {} was not a checkpoint directory (a file or a link); moved to {} before saving", name, final_dir.string(),
                 aside.string());
  }
  // A re-save of the same step (a resume from it with save_checkpoint_on_start, or after a
  // fallback past a damaged newer one) replaces it: the old one is moved aside first and deleted
  // only once the new one is in place, so a kill between the renames leaves a whole checkpoint
  // (checkpoint_remove_unfinished moves it back).
  const fs::path replaced = root / (".replaced-" + name);
  const bool resave = fs::exists(fs::symlink_status(final_dir));
  if (resave) {
    fs::remove_all(replaced);
    fs::rename(final_dir, replaced);
  }
  try {
    fs::rename(tmp, final_dir);
  } catch (...) {
    if (resave) fs::rename(replaced, final_dir);
    throw;
  }
  directory_sync(root.string());
  file_write_durable((root / ".latest.tmp").string(), name + "\n");
  fs::rename(root / ".latest.tmp", root / "latest");
  directory_sync(root.string());
  if (resave) fs::remove_all(replaced);

  // The saved step and the keep - 1 newest before it stay. Steps after it (a run that resumed from
  // an earlier checkpoint because a newer one was damaged, or with fewer steps) are not this
  // run's to judge: counting them would delete the checkpoint just written.
  if (keep > 0) {
    const int64_t saved = checkpoint_step_of(name);
    int64_t kept = 0;
    for (const int64_t step : checkpoint_steps(root))
      if (step <= saved && ++kept > keep) fs::remove_all(root / std::to_string(step));
  }
}

// `pause_at_step` (testing, debug_pause_checkpoint_save_step): the save of that step stops after
// the (first) model file, with a PAUSED marker in the temporary directory, and waits to be
// killed, or for a file CONTINUE beside the marker (both are then removed and the save goes on),
// so a test can kill a trainer inside a save, or hold a save as long as it likes.
void pause_if_asked(const fs::path& tmp, int64_t step, int64_t pause_at_step) {
  if (step != pause_at_step) return;
  file_write_durable((tmp / "PAUSED").string(), "paused by debug_pause_checkpoint_save_step\n");
  while (!fs::exists(tmp / "CONTINUE")) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  fs::remove(tmp / "CONTINUE");
  fs::remove(tmp / "PAUSED");
}

// One writer (shard_count 1): every file, the manifest last, then the commit.
void write_checkpoint(const std::string& checkpoints_dir, const CheckpointContents& c, int64_t keep,
                      int64_t pause_at_step, int64_t block_shard_rank) {
  const fs::path root(checkpoints_dir);
  fs::create_directories(root);
  const std::string name = std::to_string(c.state.step);
  const fs::path tmp = root / (".tmp-" + name);
  fs::remove_all(tmp);
  fs::create_directories(tmp);

  nlohmann::ordered_json manifest;
  manifest["format_version"] = kCheckpointFormatVersion;
  auto record = [&](const std::string& file, uint32_t crc) { manifest["files"][file] = manifest_entry(fs::file_size(tmp / file), crc); };
  if (block_shard_rank == 0) fs::create_directories(tmp / "model.safetensors" / "blocked");
  record("model.safetensors", checkpoint_write_tensors((tmp / "model.safetensors").string(), c.model));
  pause_if_asked(tmp, c.state.step, pause_at_step);
  record("optimizer.safetensors", checkpoint_write_tensors((tmp / "optimizer.safetensors").string(), c.optimizer));
  const std::string state = state_to_json(c.state);
  file_write_durable((tmp / "state.json").string(), state);
  manifest["files"]["state.json"] = manifest_entry_of_text(state);
  file_write_durable((tmp / "config.yml").string(), c.config_yaml);
  manifest["files"]["config.yml"] = manifest_entry_of_text(c.config_yaml);
  file_write_durable((tmp / "manifest.json").string(), manifest.dump(2) + "\n");
  commit_directory(root, tmp, name, keep);
}

// How many ranks wrote a checkpoint directory (1: one writer), from its manifest.
int64_t manifest_shards(const fs::path& dir) {
  return nlohmann::json::parse(read_text(dir / "manifest.json")).value("shards", int64_t{1});
}

std::string shard_record_name(int64_t rank, int64_t count) {
  return checkpoint_shard_file_name("shard", rank, count, ".json");
}

// One rank's part of a sharded checkpoint (shard_count > 1): its model and optimizer files, then
// a record of their sizes, checksums and tensor names (rank 0 also writes state.json and
// config.yml). The temporary directory is shared, so no rank clears it; rank 0's commit
// (checkpoint_commit_shards) turns the records into the manifest.
// `block_shard_rank` (testing, debug_block_checkpoint_shard_rank): that rank first makes a
// directory where its model shard goes, so its write fails as on a broken filesystem (rank 0 does
// the same in a one-writer save). (A test cannot plant it beforehand: the run deletes leftover
// .tmp- directories when it starts.)
void write_checkpoint_shard(const std::string& checkpoints_dir, const CheckpointContents& c, int64_t pause_at_step,
                            int64_t block_shard_rank) {
  const fs::path tmp = fs::path(checkpoints_dir) / (".tmp-" + std::to_string(c.state.step));
  fs::create_directories(tmp);
  nlohmann::ordered_json record;
  const std::string model = checkpoint_shard_file_name("model", c.shard_rank, c.shard_count, ".safetensors");
  const std::string optimizer = checkpoint_shard_file_name("optimizer", c.shard_rank, c.shard_count, ".safetensors");
  if (c.shard_rank == block_shard_rank) fs::create_directories(tmp / model / "blocked");
  const uint32_t model_crc = checkpoint_write_tensors((tmp / model).string(), c.model);
  record["files"][model] = manifest_entry(fs::file_size(tmp / model), model_crc);
  if (c.shard_rank == 0) pause_if_asked(tmp, c.state.step, pause_at_step);
  const uint32_t optimizer_crc = checkpoint_write_tensors((tmp / optimizer).string(), c.optimizer);
  record["files"][optimizer] = manifest_entry(fs::file_size(tmp / optimizer), optimizer_crc);
  if (c.shard_rank == 0) {
    const std::string state = state_to_json(c.state);
    file_write_durable((tmp / "state.json").string(), state);
    record["files"]["state.json"] = manifest_entry_of_text(state);
    file_write_durable((tmp / "config.yml").string(), c.config_yaml);
    record["files"]["config.yml"] = manifest_entry_of_text(c.config_yaml);
  }
  int64_t model_bytes = 0;
  for (const auto& [name, tensor] : c.model) {
    record["model_tensors"].push_back(name);
    model_bytes += static_cast<int64_t>(tensor.nbytes());
  }
  record["model_tensor_bytes"] = model_bytes;
  file_write_durable((tmp / shard_record_name(c.shard_rank, c.shard_count)).string(), record.dump(2) + "\n");
}

}  // namespace

std::string checkpoint_hash_text(const std::string& text) { return hex32(crc32c_update(0, text.data(), text.size())); }

std::string checkpoint_manifest_hash(const std::string& checkpoint_dir) {
  return checkpoint_hash_text(read_text(fs::path(checkpoint_dir) / "manifest.json"));
}

std::string checkpoint_shard_file_name(const std::string& stem, int64_t index, int64_t count, const std::string& suffix) {
  char name[64];
  std::snprintf(name, sizeof name, "-%05lld-of-%05lld", static_cast<long long>(index + 1), static_cast<long long>(count));
  return stem + name + suffix;
}

uint32_t checkpoint_write_tensors(const std::string& path, const NamedTensors& tensors) {
  std::vector<SafetensorsEntry> entries;
  entries.reserve(tensors.size());
  for (const auto& [name, t] : tensors) {
    const bool bf16 = t.scalar_type() == torch::kBFloat16;
    TORCH_CHECK(t.is_contiguous() && t.device().is_cpu() && (bf16 || t.scalar_type() == torch::kFloat32),
                "checkpoint tensors must be contiguous fp32 or bf16 CPU tensors: ", name);
    entries.push_back({name, bf16 ? "BF16" : "F32", t.sizes().vec(), t.data_ptr(), static_cast<size_t>(t.nbytes())});
  }
  return safetensors_write(path, entries, {{"format", "pt"}});
}

namespace {

// fp32 CPU copy of one tensor's little-endian bytes (F32, BF16, F16, F64 accepted).
torch::Tensor tensor_from_bytes(const char* bytes, const SafetensorsTensor& t, const std::string& path,
                                const std::string& name) {
  torch::ScalarType type;
  if (t.dtype == "F32") type = torch::kFloat32;
  else if (t.dtype == "BF16") type = torch::kBFloat16;
  else if (t.dtype == "F16") type = torch::kFloat16;
  else if (t.dtype == "F64") type = torch::kFloat64;
  else throw config_error(path + ": tensor " + name + " has dtype " + t.dtype + "; expected F32, BF16, F16 or F64");
  return torch::from_blob(const_cast<char*>(bytes), t.shape, type).to(torch::kFloat32, false, /*copy=*/true);
}

// A damaged file is input data (exit 3, as the same damage inside a checkpoint directory); a path
// that cannot be read is the config's (exit 2).
SafetensorsFile read_safetensors_or_error(const std::string& path, bool with_data) {
  try {
    return safetensors_read(path, with_data);
  } catch (const SafetensorsFormatError& e) {
    throw Error(kExitData, e.what());
  } catch (const std::exception& e) {
    throw config_error(e.what());
  }
}

}  // namespace

NamedTensors checkpoint_read_tensors(const std::string& path) {
  const SafetensorsFile file = read_safetensors_or_error(path, /*with_data=*/true);
  NamedTensors out;
  for (const auto& [name, t] : file.tensors) out.emplace_back(name, tensor_from_bytes(file.data.data() + t.offset, t, path, name));
  return out;
}

CheckpointReader::CheckpointReader(const std::string& checkpoint_dir) {
  const fs::path dir(checkpoint_dir);
  const auto [model_files, optimizer_files] = checkpoint_tensor_files(manifest_shards(dir));
  for (const auto& file : model_files) add_file((dir / file).string(), /*model=*/true);
  for (const auto& file : optimizer_files) add_file((dir / file).string(), /*model=*/false);
}

void checkpoint_check_finite(const std::string& name, const torch::Tensor& tensor, const std::string& source) {
  // In float64 a sum of finite fp32/bf16/f16 values cannot overflow, so a finite sum proves every
  // element finite in one cheap pass; counting with isfinite (a bool tensor of the weights' size,
  // ~45 ns/element here) runs only for a file that has a non-finite value.
  if (!tensor.is_floating_point() || std::isfinite(tensor.sum(torch::kFloat64).item<double>())) return;
  const int64_t non_finite = tensor.numel() - torch::isfinite(tensor).sum().item<int64_t>();
  if (non_finite > 0)
    throw Error(kExitData, source + ": " + name + " holds " + std::to_string(non_finite) +
                               " non-finite values (NaN or Inf); the file is damaged or not a trained model");
}

CheckpointReader CheckpointReader::weights(const std::string& path) {
  CheckpointReader reader;
  if (!fs::is_directory(path)) {
    reader.add_file(path, /*model=*/true);
    return reader;
  }
  for (const auto& [file, listed] : hf_directory_files(path)) {
    reader.add_file(file, /*model=*/true);
    for (const auto& name : listed) {
      const auto* at = reader.find_stored(name);
      if (!at || at->path != file)
        throw config_error((fs::path(path) / "model.safetensors.index.json").string() + " puts " + name + " in " +
                           fs::path(file).filename().string() + ", which does not hold it");
    }
  }
  return reader;
}

void CheckpointReader::add_file(const std::string& path, bool model) {
  auto header = std::make_shared<SafetensorsFile>(read_safetensors_or_error(path, /*with_data=*/false));
  for (const auto& [name, tensor] : header->tensors) {
    const auto [held, added] = tensors_.try_emplace(name, Location{path, header, tensor});
    if (!added)  // which copy would load would depend on the order the files are read in
      throw config_error(name + " is stored twice, in " + held->second.path + " and in " + path +
                         "; keep one (model.safetensors.index.json says which file holds each tensor)");
    if (model) model_names_.push_back(name);
  }
}

const CheckpointReader::Location* CheckpointReader::find(const std::string& name) const {
  if (!aliases_.empty()) {
    const auto alias = aliases_.find(name);
    return alias == aliases_.end() ? nullptr : find_stored(alias->second.stored);
  }
  return find_stored(name);
}

const CheckpointReader::Location* CheckpointReader::find_stored(const std::string& stored) const {
  const auto it = tensors_.find(stored);
  return it == tensors_.end() ? nullptr : &it->second;
}

std::vector<int64_t> CheckpointReader::shape(const std::string& name) const {
  const auto* at = find(name);
  if (!at) return {};
  auto shape = at->tensor.shape;
  const auto alias = aliases_.find(name);
  if (alias != aliases_.end() && alias->second.rows >= 0) shape.at(0) = alias->second.rows;
  return shape;
}

std::istream& CheckpointReader::open_file(const std::string& path) const {
  if (const auto it = open_files_.find(path); it != open_files_.end()) return *it->second;
  // Within the file-descriptor limit: one file makes room (the first by name, the earliest shard
  // of a model read in name order), so a read of more shards does not reopen every one each time.
  if (open_files_.size() >= kOpenFilesKept) open_files_.erase(open_files_.begin());
  file_require_regular(path);
  auto in = std::make_shared<std::ifstream>(path, std::ios::binary);
  if (!*in) throw std::runtime_error("cannot open " + path + ": " + std::strerror(errno));
  return *open_files_.emplace(path, std::move(in)).first->second;
}

torch::Tensor CheckpointReader::read(const std::string& name) const {
  const auto* at = find(name);
  if (!at) throw config_error("the checkpoint holds no tensor " + name);
  std::vector<char> bytes;
  try {
    bytes = safetensors_read_bytes(open_file(at->path), at->path, *at->header, at->tensor);
  } catch (const SafetensorsFormatError& e) {
    throw Error(kExitData, e.what());  // truncated after its header was read
  } catch (const std::exception& e) {
    throw config_error(e.what());
  }
  auto tensor = tensor_from_bytes(bytes.data(), at->tensor, at->path, name);
  const auto alias = aliases_.find(name);
  if (alias != aliases_.end() && alias->second.rows >= 0)
    tensor = tensor.narrow(0, alias->second.row_begin, alias->second.rows).contiguous();
  if (check_read_) check_read_(name, alias != aliases_.end() ? alias->second.stored : name, tensor);
  return tensor;
}

std::vector<int64_t> checkpoint_list_steps(const std::string& checkpoints_dir) {
  return fs::is_directory(checkpoints_dir) ? checkpoint_steps(checkpoints_dir) : std::vector<int64_t>{};
}

std::string checkpoint_verify(const std::string& checkpoint_dir, bool weights_only, bool checksums) {
  const fs::path dir(checkpoint_dir);
  const fs::path manifest_path = dir / "manifest.json";
  if (!fs::exists(dir)) return "it does not exist";
  if (!fs::is_directory(dir)) return "it is not a directory";
  if (!fs::exists(manifest_path)) return "no manifest.json (incomplete save)";
  nlohmann::json manifest;
  try {
    manifest = nlohmann::json::parse(read_text(manifest_path));
  } catch (const std::exception& e) {
    return std::string("manifest unreadable: ") + e.what();
  }
  if (manifest.is_object() && manifest.contains("format_version") && manifest["format_version"].is_number_integer() &&
      manifest["format_version"].get<int64_t>() != kCheckpointFormatVersion)
    throw checkpoint_format_error(checkpoint_dir, "manifest", manifest["format_version"].get<int64_t>());
  try {
    if (!manifest.is_object() || !manifest.contains("format_version")) return "manifest has no format_version";
    if (!manifest["format_version"].is_number_integer()) return "manifest format_version is not an integer";
    const int64_t shards = manifest.value("shards", int64_t{1});
    // Each shard lists two files: a damaged count must not make millions of names to look for.
    if (shards < 1 || !manifest.contains("files") || shards > static_cast<int64_t>(manifest["files"].size()))
      return "manifest shards " + std::to_string(shards) + " does not fit the files it lists";
    std::vector<std::string> files = checkpoint_required_files(shards);
    if (weights_only) {
      files = checkpoint_tensor_files(shards).first;
      if (shards > 1) files.push_back("model.safetensors.index.json");
    }
    for (const std::string& file : files) {
      if (!manifest.at("files").contains(file)) return "manifest does not list " + file;
      const auto& entry = manifest["files"][file];
      if (!fs::exists(dir / file)) return file + " is missing";
      if (!fs::is_regular_file(dir / file)) return file + " is not a regular file";  // a FIFO would block the read
      // A float or negative count would be read as 0 or wrapped: name what the manifest holds.
      if (!entry.is_object() || !entry.contains("bytes") || !entry["bytes"].is_number_unsigned())
        return "manifest bytes of " + file + " is not a byte count: " +
               (entry.is_object() && entry.contains("bytes") ? entry["bytes"].dump() : std::string("missing"));
      uint64_t size = checksums ? 0 : fs::file_size(dir / file);
      const uint32_t crc = checksums ? crc32c_file((dir / file).string(), &size) : 0;
      if (size != entry.at("bytes").get<uint64_t>())
        return file + " has " + std::to_string(size) + " bytes, manifest says " +
               std::to_string(entry["bytes"].get<uint64_t>());
      if (checksums && hex32(crc) != entry.at("crc32c").get<std::string>())
        return file + " checksum mismatch (crc32c " + hex32(crc) + ", manifest " +
               entry["crc32c"].get<std::string>() + ")";
    }
  } catch (const std::exception& e) {
    return std::string("manifest unreadable: ") + e.what();
  }
  return "";
}

void checkpoint_check_full_state_path(const std::string& path) {
  const std::string key = "load_full_state_path " + path;
  std::error_code ec;
  const auto status = fs::status(path, ec);
  if (status.type() == fs::file_type::not_found) throw config_error(key + ": no such directory");
  if (ec) throw config_error(key + ": " + ec.message());
  if (!fs::is_directory(status)) throw config_error(key + " is not a directory (it names one checkpoint directory)");
  if (!fs::exists(fs::path(path) / "manifest.json", ec)) {
    // The directories users mistake for a checkpoint: name the one they probably meant.
    const auto newest_in = [](const fs::path& root) -> std::string {
      std::error_code error;
      if (!fs::is_directory(root, error)) return "";
      try {
        const auto steps = checkpoint_steps(root);
        return steps.empty() ? "" : (root / std::to_string(steps.front())).string();
      } catch (const fs::filesystem_error&) {
        return "";  // unreadable: the message below names what is missing
      }
    };
    const fs::path checkpoints = fs::path(path) / "checkpoints";
    const std::string in_run_dir = newest_in(checkpoints), here = newest_in(path);
    if (!in_run_dir.empty())
      throw config_error(key + " is a run directory, not a checkpoint: name one of its checkpoints, e.g. " + in_run_dir +
                         " (the newest), or resume it by running with its base_output_directory and run_name");
    if (fs::is_directory(checkpoints, ec))
      throw config_error(key + " is a run directory with no checkpoint yet (" + checkpoints.string() + " holds none)");
    if (!here.empty())
      throw config_error(key + " is a checkpoints directory, not a checkpoint: name one of its checkpoints, e.g. " + here +
                         " (the newest)");
    if (fs::exists(fs::path(path) / "config.json", ec))
      throw config_error(key + " is a Hugging Face model directory, not a checkpoint: load its weights with "
                               "load_parameters_path (the optimizer and step start fresh)");
  }
  // A directory with no manifest at all is an interrupted save or not a checkpoint; either way
  // its files cannot be trusted: data error, as a damaged one.
  if (const std::string problem = checkpoint_verify(path); !problem.empty())
    throw Error(kExitData, key + " is not usable: " + problem);
}

std::optional<std::string> checkpoint_find_latest(const std::string& checkpoints_dir) {
  const fs::path root(checkpoints_dir);
  if (!fs::is_directory(root)) return std::nullopt;
  const auto steps = checkpoint_steps(root);
  std::string problems;
  for (size_t i = 0; i < steps.size(); ++i) {
    const std::string dir = (root / std::to_string(steps[i])).string();
    const std::string problem = checkpoint_verify(dir);
    if (problem.empty()) return dir;
    spdlog::warn("checkpoint {} is not usable: {}{}", dir, problem,
                 i + 1 < steps.size() ? "; falling back to an earlier checkpoint" : "");
    problems += "\n  " + dir + ": " + problem;
  }
  // Starting over would overwrite them: a run whose every checkpoint is damaged stops instead.
  if (!steps.empty())
    throw Error(kExitData, "no usable checkpoint in " + checkpoints_dir + ", and the run does not start over on top of " +
                               "them (that would overwrite them):" + problems +
                               "\nrepair or move the checkpoints directory away, or use another run_name");
  return std::nullopt;
}

std::pair<CheckpointState, std::string> checkpoint_load_state(const std::string& checkpoint_dir) {
  const fs::path dir(checkpoint_dir);
  return {state_from_json(read_text(dir / "state.json"), checkpoint_dir), read_text(dir / "config.yml")};
}

CheckpointContents checkpoint_load(const std::string& checkpoint_dir) {
  const fs::path dir(checkpoint_dir);
  CheckpointContents c;
  c.model = hf_read_directory(checkpoint_dir);  // model.safetensors, or the shards its index lists
  for (const auto& file : checkpoint_tensor_files(manifest_shards(dir)).second)
    for (auto& item : checkpoint_read_tensors((dir / file).string())) c.optimizer.push_back(std::move(item));
  c.state = state_from_json(read_text(dir / "state.json"), checkpoint_dir);
  c.config_yaml = read_text(dir / "config.yml");
  return c;
}

void checkpoint_check_saves_possible(const std::string& checkpoints_dir) {
  std::error_code ec;
  const fs::path root(checkpoints_dir), latest = root / "latest";
  if (fs::exists(root, ec) && !fs::is_directory(root, ec))
    throw config_error(checkpoints_dir + " is not a directory: the run saves its checkpoints there; move it away");
  if (fs::exists(latest, ec) && !fs::is_regular_file(latest, ec))
    throw config_error(latest.string() + " is not a file: every save replaces it with a file naming the newest step "
                                         "(the save would fail after the steps ran); move it away");
}

std::vector<std::string> checkpoint_remove_unfinished(const std::string& checkpoints_dir) {
  std::vector<std::string> removed;
  std::error_code ec;
  if (!fs::is_directory(checkpoints_dir, ec)) return removed;
  std::vector<fs::path> entries;
  for (const auto& entry : fs::directory_iterator(checkpoints_dir)) entries.push_back(entry.path());
  for (const auto& path : entries) {
    // Only the names a save writes: .tmp-<step in canonical decimal>/, the file .latest.tmp, and
    // .replaced-<step>/ (a re-saved step's old checkpoint, moved aside until the new one is in
    // place: it goes back where it was if a kill came between the two renames).
    const std::string name = path.filename().string();
    const bool replaced = name.rfind(".replaced-", 0) == 0 && checkpoint_step_of(name.substr(10)) >= 0 &&
                          fs::is_directory(fs::symlink_status(path));
    if (replaced && !fs::exists(fs::symlink_status(path.parent_path() / name.substr(10)))) {
      fs::rename(path, path.parent_path() / name.substr(10), ec);
      if (ec)
        spdlog::warn("cannot move {} back to {}: {}", path.string(), name.substr(10), ec.message());
      else
        spdlog::warn("checkpoint {}: a re-save of it was interrupted; the earlier one is back in place", name.substr(10));
      continue;
    }
    const bool save_dir = fs::is_directory(fs::symlink_status(path)) && name.rfind(".tmp-", 0) == 0 &&
                          checkpoint_step_of(name.substr(5)) >= 0;
    if (!save_dir && !replaced && !(name == ".latest.tmp" && fs::is_regular_file(fs::symlink_status(path)))) continue;
    fs::remove_all(path, ec);
    if (ec)
      spdlog::warn("cannot delete {} left by an interrupted save: {}", path.string(), ec.message());
    else
      removed.push_back(name);
  }
  std::sort(removed.begin(), removed.end());
  return removed;
}

Checkpointer::Checkpointer(const Config& config)
    : checkpoints_dir_((fs::path(config.run_dir) / "checkpoints").string()),
      keep_(config.max_num_checkpoints_to_keep),
      pause_at_step_(config.debug_pause_checkpoint_save_step),
      block_shard_rank_(config.debug_block_checkpoint_shard_rank) {}

Checkpointer::~Checkpointer() {
  const std::string error = wait();
  if (!error.empty()) spdlog::error("{}", error);
}

std::string Checkpointer::wait() {
  if (worker_.joinable()) worker_.join();
  if (!worker_error_) return "";
  std::string message;
  try {
    std::rethrow_exception(worker_error_);
  } catch (const std::exception& e) {
    message = e.what();
  }
  worker_error_ = nullptr;
  return message;
}

void Checkpointer::save(CheckpointContents contents, bool async) {
  const std::string previous_error = wait();
  if (!previous_error.empty()) spdlog::error("{}", previous_error);
  const auto step = contents.state.step;
  const bool sharded = contents.shard_count > 1;
  if (sharded) uncommitted_ = {step, contents.shard_count};
  auto write = [this, step, sharded](const CheckpointContents& c) {
    const auto start = std::chrono::steady_clock::now();
    try {
      if (sharded)
        write_checkpoint_shard(checkpoints_dir_, c, pause_at_step_, block_shard_rank_);
      else
        write_checkpoint(checkpoints_dir_, c, keep_, pause_at_step_, block_shard_rank_);
    } catch (const std::exception& e) {
      // A failed save's partial files go at once (a sharded one's when the ranks have agreed it
      // failed: abandon_shards): a run that keeps failing to save, a full disk, must not also fill
      // it with one partial checkpoint per attempt.
      if (!sharded) remove_unfinished_save(step);
      throw Error(kExitFailure, std::string(sharded ? "writing this rank's shard of checkpoint " : "saving checkpoint ") +
                                    std::to_string(step) + " under " + checkpoints_dir_ + " failed: " + e.what() +
                                    " (earlier checkpoints are intact)");
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (sharded)
      spdlog::info("wrote shard {} of {} of checkpoint {}/{} in {:.3f} s", c.shard_rank + 1, c.shard_count,
                   checkpoints_dir_, step, seconds);
    else
      spdlog::info("saved checkpoint {}/{} in {:.3f} s", checkpoints_dir_, step, seconds);
  };
  if (!async && sharded) {  // a failed shard is reported by the commit, which every rank reaches
    try {
      write(contents);
    } catch (...) {
      worker_error_ = std::current_exception();
    }
    return;
  }
  if (!async) {
    write(contents);
    return;
  }
  writing_ = true;
  worker_ = std::thread([this, write, c = std::move(contents)]() {
    try {
      write(c);
    } catch (...) {
      worker_error_ = std::current_exception();
    }
    writing_ = false;
  });
}

void Checkpointer::remove_unfinished_save(int64_t step) const {
  const fs::path tmp = fs::path(checkpoints_dir_) / (".tmp-" + std::to_string(step));
  std::error_code ec;
  fs::remove_all(tmp, ec);
  if (ec) spdlog::warn("cannot delete {} left by the failed save: {}", tmp.string(), ec.message());
}

void Checkpointer::abandon_shards(bool writer) {
  const int64_t step = uncommitted_.first;
  uncommitted_ = {-1, 0};
  if (writer && step >= 0) remove_unfinished_save(step);
}

void Checkpointer::commit_shards(bool writer) {
  const auto [step, shards] = uncommitted_;
  uncommitted_ = {-1, 0};
  if (!writer || step < 0) return;
  const fs::path root(checkpoints_dir_);
  const std::string name = std::to_string(step);
  const fs::path tmp = root / (".tmp-" + name);
  try {
    nlohmann::ordered_json manifest, index;
    manifest["format_version"] = kCheckpointFormatVersion;
    manifest["shards"] = shards;
    index["metadata"] = {{"total_size", 0}};
    index["weight_map"] = nlohmann::ordered_json::object();
    int64_t total = 0;
    std::set<std::string> listed{"manifest.json", "model.safetensors.index.json"};
    for (int64_t r = 0; r < shards; ++r) {
      const fs::path record_path = tmp / shard_record_name(r, shards);
      const auto record = nlohmann::json::parse(read_text(record_path));
      for (const auto& [file, entry] : record.at("files").items()) {
        manifest["files"][file] = entry;
        listed.insert(file);
      }
      const std::string model = checkpoint_shard_file_name("model", r, shards, ".safetensors");
      for (const auto& tensor : record.value("model_tensors", nlohmann::json::array())) index["weight_map"][tensor.get<std::string>()] = model;
      total += record.at("model_tensor_bytes").get<int64_t>();
    }
    index["metadata"]["total_size"] = total;
    const std::string index_text = index.dump(2) + "\n";
    file_write_durable((tmp / "model.safetensors.index.json").string(), index_text);
    manifest["files"]["model.safetensors.index.json"] = manifest_entry_of_text(index_text);
    // What the manifest does not list (the shard records, files of an abandoned attempt at this
    // step with another world size) does not belong in the checkpoint.
    for (const auto& entry : fs::directory_iterator(tmp))
      if (!listed.count(entry.path().filename().string())) fs::remove_all(entry.path());
    file_write_durable((tmp / "manifest.json").string(), manifest.dump(2) + "\n");
    commit_directory(root, tmp, name, keep_);
  } catch (const std::exception& e) {
    remove_unfinished_save(step);
    throw Error(kExitFailure, "committing checkpoint " + name + " under " + checkpoints_dir_ + " failed: " + e.what() +
                                  " (earlier checkpoints are intact)");
  }
  spdlog::info("saved checkpoint {}/{} ({} shards)", checkpoints_dir_, step, shards);
}

}  // namespace trainer
