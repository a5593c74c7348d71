// Checkpoint save/verify/load (see ckpt.h and docs/checkpoints.md).
//
// Crash safety: a checkpoint is written into checkpoints/.tmp-<step>/, every file fsynced,
// manifest.json (size + CRC32C of every other file) written last, the directory fsynced and then
// renamed to checkpoints/<step>/, and only then checkpoints/latest replaced (write + rename).
// A reader trusts a directory only if its manifest verifies, so a kill at any moment leaves
// either the previous checkpoints or a complete new one; .tmp-* directories are never read.
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <thread>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "trainer/ckpt/ckpt.h"
#include "trainer/ckpt/safetensors.h"
#include "trainer/util/error.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;
const char* const kCheckpointFiles[] = {"model.safetensors", "optimizer.safetensors", "state.json", "config.yml"};

std::string hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%08x", v);
  return buf;
}

std::string read_text(const fs::path& path) {
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
  j["spike_guard"] = {{"losses", s.spike_losses}, {"grad_norms", s.spike_grad_norms}};
  j["rng"] = {{"torch_cpu", s.cpu_rng_state}};
  j["lr_schedule"] = {{"updates_applied", s.updates_applied}};
  j["world_size"] = s.world_size;
  j["zero1"] = nullptr;
  j["config_hash"] = s.config_hash;
  return j.dump(2) + "\n";
}

CheckpointState state_from_json(const std::string& text, const std::string& path) {
  try {
    const auto j = nlohmann::json::parse(text);
    const int version = j.at("format_version").get<int>();
    if (version != kCheckpointFormatVersion)
      throw config_error("checkpoint " + path + " has format_version " + std::to_string(version) +
                         "; this trainer reads version " + std::to_string(kCheckpointFormatVersion));
    CheckpointState s;
    s.step = j.at("step").get<int64_t>();
    s.updates_applied = j.at("updates_applied").get<int64_t>();
    s.consumed_samples = j.at("consumed_samples").get<int64_t>();
    s.spike_losses = j.at("spike_guard").at("losses").get<std::vector<double>>();
    s.spike_grad_norms = j.at("spike_guard").at("grad_norms").get<std::vector<double>>();
    s.cpu_rng_state = j.at("rng").at("torch_cpu").get<std::string>();
    s.world_size = j.at("world_size").get<int64_t>();
    s.config_hash = j.at("config_hash").get<std::string>();
    return s;
  } catch (const nlohmann::json::exception& e) {
    throw config_error("checkpoint " + path + ": state.json is malformed: " + e.what());
  }
}

// `pause_at_step` (testing, debug_pause_checkpoint_save_step): the save of that step stops after
// model.safetensors, with a PAUSED marker in the temporary directory, and waits to be killed, so a
// test can kill a trainer inside a save deterministically.
void write_checkpoint(const std::string& checkpoints_dir, const CheckpointContents& c, int64_t keep,
                      int64_t pause_at_step) {
  const fs::path root(checkpoints_dir);
  fs::create_directories(root);
  const std::string name = std::to_string(c.state.step);
  const fs::path tmp = root / (".tmp-" + name);
  fs::remove_all(tmp);
  fs::create_directories(tmp);

  nlohmann::ordered_json manifest;
  manifest["format_version"] = kCheckpointFormatVersion;
  auto record = [&](const std::string& file, uint32_t crc) {
    manifest["files"][file] = {{"bytes", fs::file_size(tmp / file)}, {"crc32c", hex32(crc)}};
  };
  record("model.safetensors", checkpoint_write_tensors((tmp / "model.safetensors").string(), c.model));
  if (c.state.step == pause_at_step) {
    file_write_durable((tmp / "PAUSED").string(), "paused by debug_pause_checkpoint_save_step\n");
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  record("optimizer.safetensors", checkpoint_write_tensors((tmp / "optimizer.safetensors").string(), c.optimizer));
  const std::string state = state_to_json(c.state);
  file_write_durable((tmp / "state.json").string(), state);
  record("state.json", crc32c_update(0, state.data(), state.size()));
  file_write_durable((tmp / "config.yml").string(), c.config_yaml);
  record("config.yml", crc32c_update(0, c.config_yaml.data(), c.config_yaml.size()));
  file_write_durable((tmp / "manifest.json").string(), manifest.dump(2) + "\n");
  directory_sync(tmp.string());

  const fs::path final_dir = root / name;
  fs::remove_all(final_dir);  // a re-save of the same step replaces it
  fs::rename(tmp, final_dir);
  directory_sync(root.string());
  file_write_durable((root / ".latest.tmp").string(), name + "\n");
  fs::rename(root / ".latest.tmp", root / "latest");
  directory_sync(root.string());

  if (keep > 0) {
    std::vector<int64_t> steps;
    for (const auto& entry : fs::directory_iterator(root)) {
      const auto n = entry.path().filename().string();
      if (entry.is_directory() && !n.empty() && std::all_of(n.begin(), n.end(), ::isdigit)) steps.push_back(std::stoll(n));
    }
    std::sort(steps.rbegin(), steps.rend());
    for (size_t i = static_cast<size_t>(keep); i < steps.size(); ++i) fs::remove_all(root / std::to_string(steps[i]));
  }
}

}  // namespace

std::string checkpoint_hash_text(const std::string& text) { return hex32(crc32c_update(0, text.data(), text.size())); }

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

NamedTensors checkpoint_read_tensors(const std::string& path) {
  SafetensorsFile file;
  try {
    file = safetensors_read(path);
  } catch (const std::exception& e) {
    throw config_error(e.what());
  }
  NamedTensors out;
  for (const auto& [name, t] : file.tensors) {
    torch::ScalarType type;
    if (t.dtype == "F32") type = torch::kFloat32;
    else if (t.dtype == "BF16") type = torch::kBFloat16;
    else if (t.dtype == "F16") type = torch::kFloat16;
    else if (t.dtype == "F64") type = torch::kFloat64;
    else throw config_error(path + ": tensor " + name + " has dtype " + t.dtype + "; expected F32, BF16, F16 or F64");
    auto tensor = torch::from_blob(file.data.data() + t.offset, t.shape, type).to(torch::kFloat32, false, /*copy=*/true);
    out.emplace_back(name, tensor);
  }
  return out;
}

std::string checkpoint_verify(const std::string& checkpoint_dir) {
  const fs::path dir(checkpoint_dir);
  const fs::path manifest_path = dir / "manifest.json";
  if (!fs::exists(manifest_path)) return "no manifest.json (incomplete save)";
  nlohmann::json manifest;
  try {
    manifest = nlohmann::json::parse(read_text(manifest_path));
    for (const char* file : kCheckpointFiles) {
      if (!manifest.at("files").contains(file)) return std::string("manifest does not list ") + file;
      const auto& entry = manifest["files"][file];
      if (!fs::exists(dir / file)) return std::string(file) + " is missing";
      uint64_t size = 0;
      const uint32_t crc = crc32c_file((dir / file).string(), &size);
      if (size != entry.at("bytes").get<uint64_t>())
        return std::string(file) + " has " + std::to_string(size) + " bytes, manifest says " +
               std::to_string(entry["bytes"].get<uint64_t>());
      if (hex32(crc) != entry.at("crc32c").get<std::string>())
        return std::string(file) + " checksum mismatch (crc32c " + hex32(crc) + ", manifest " +
               entry["crc32c"].get<std::string>() + ")";
    }
  } catch (const std::exception& e) {
    return std::string("manifest unreadable: ") + e.what();
  }
  return "";
}

std::optional<std::string> checkpoint_find_latest(const std::string& checkpoints_dir) {
  const fs::path root(checkpoints_dir);
  if (!fs::is_directory(root)) return std::nullopt;
  std::vector<int64_t> steps;
  for (const auto& entry : fs::directory_iterator(root)) {
    const auto n = entry.path().filename().string();  // .tmp-* and other names are never candidates
    if (entry.is_directory() && !n.empty() && std::all_of(n.begin(), n.end(), ::isdigit)) steps.push_back(std::stoll(n));
  }
  std::sort(steps.rbegin(), steps.rend());
  for (int64_t step : steps) {
    const std::string dir = (root / std::to_string(step)).string();
    const std::string problem = checkpoint_verify(dir);
    if (problem.empty()) return dir;
    spdlog::warn("checkpoint {} is not usable: {}; falling back to an earlier checkpoint", dir, problem);
  }
  return std::nullopt;
}

CheckpointContents checkpoint_load(const std::string& checkpoint_dir) {
  const std::string problem = checkpoint_verify(checkpoint_dir);
  if (!problem.empty()) throw config_error("checkpoint " + checkpoint_dir + " is not usable: " + problem);
  const fs::path dir(checkpoint_dir);
  CheckpointContents c;
  c.model = checkpoint_read_tensors((dir / "model.safetensors").string());
  c.optimizer = checkpoint_read_tensors((dir / "optimizer.safetensors").string());
  c.state = state_from_json(read_text(dir / "state.json"), checkpoint_dir);
  c.config_yaml = read_text(dir / "config.yml");
  return c;
}

Checkpointer::Checkpointer(const Config& config)
    : checkpoints_dir_((fs::path(config.run_dir) / "checkpoints").string()),
      keep_(config.max_num_checkpoints_to_keep),
      pause_at_step_(config.debug_pause_checkpoint_save_step) {}

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
  auto write = [this, step](const CheckpointContents& c) {
    const auto start = std::chrono::steady_clock::now();
    try {
      write_checkpoint(checkpoints_dir_, c, keep_, pause_at_step_);
    } catch (const std::exception& e) {
      throw Error(kExitFailure, "saving checkpoint " + std::to_string(step) + " under " + checkpoints_dir_ +
                                    " failed: " + e.what() + " (earlier checkpoints are intact)");
    }
    spdlog::info("saved checkpoint {}/{} in {:.3f} s", checkpoints_dir_, step,
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  };
  if (!async) {
    write(contents);
    return;
  }
  worker_ = std::thread([this, write, c = std::move(contents)]() {
    try {
      write(c);
    } catch (...) {
      worker_error_ = std::current_exception();
    }
  });
}

}  // namespace trainer
