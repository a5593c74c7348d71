// Hugging Face model directories in and out (see ckpt.h): tensor names per architecture, sharded
// safetensors with their index. The names are those of the Hugging Face modeling code:
// transformers' Llama, Qwen3, Qwen3Moe (ours, but for the router's bias) and DeepseekV3 (ours),
// and inclusionAI's modeling_bailing_moe_v2.py for Ling 2.0.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "trainer/ckpt/ckpt.h"
#include "trainer/ckpt/safetensors.h"
#include "trainer/config/hf_config.h"
#include "trainer/util/error.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Replaces the first occurrence of `from` in `name`; false if there is none.
bool rename_part(std::string& name, const std::string& from, const std::string& to) {
  const auto at = name.find(from);
  if (at == std::string::npos) return false;
  name.replace(at, from.size(), to);
  return true;
}

// BailingMoeV2 names that differ from ours by a substring (ours, theirs). The fused
// query_key_value tensor is handled separately.
const std::vector<std::pair<std::string, std::string>> kBailingParts = {
    {"model.embed_tokens.", "model.word_embeddings."},
    {".self_attn.o_proj.", ".attention.dense."},
    {".self_attn.q_norm.", ".attention.query_layernorm."},
    {".self_attn.k_norm.", ".attention.key_layernorm."},
    {".mlp.gate.e_score_correction_bias", ".mlp.gate.expert_bias"},
    {".shared_head.norm.", ".final_layernorm."},  // the MTP block's norm before the shared head
};
const std::string kQ = ".self_attn.q_proj.weight", kK = ".self_attn.k_proj.weight", kV = ".self_attn.v_proj.weight";
const std::string kQkv = ".attention.query_key_value.weight";

const std::string kBailing = "BailingMoeV2ForCausalLM", kQwen3Moe = "Qwen3MoeForCausalLM",
                  kDeepseekV3 = "DeepseekV3ForCausalLM";

// The decoder layer index of a "model.layers.<i>." name, or -1.
int64_t layer_index_of(const std::string& name) {
  const std::string prefix = "model.layers.";
  if (name.compare(0, prefix.size(), prefix) != 0) return -1;
  const auto end = name.find('.', prefix.size());
  const std::string digits = name.substr(prefix.size(), end == std::string::npos ? std::string::npos : end - prefix.size());
  if (digits.empty() || digits.size() > 9 || digits.find_first_not_of("0123456789") != std::string::npos) return -1;
  return std::stoll(digits);
}

}  // namespace

NamedTensors hf_tensors_from_checkpoint(const Config& c, const NamedTensors& model) {
  const std::string architecture = hf_architecture(c);
  const bool bailing = architecture == kBailing;
  std::map<std::string, torch::Tensor> by_name(model.begin(), model.end());
  NamedTensors out;
  for (const auto& [name, tensor] : model) {
    if (c.logits_via_embedding && name == "lm_head.weight") continue;
    // Qwen3Moe's router has no bias (routed_bias is false there: ours is all zeros, and a load
    // without it keeps the buffer's zeros).
    if (architecture == kQwen3Moe && ends_with(name, ".mlp.gate.e_score_correction_bias")) continue;
    if (!bailing) {
      out.emplace_back(name, tensor);
      continue;
    }
    if (ends_with(name, kK) || ends_with(name, kV)) continue;  // written with q
    if (ends_with(name, kQ)) {
      // query_key_value rows: the Hq query heads, then the Hkv key heads, then the Hkv value heads
      // (BailingMoeV2Attention views them as (Hq + 2 Hkv, hd) and splits in that order).
      const std::string layer = name.substr(0, name.size() - kQ.size());
      out.emplace_back(layer + kQkv, torch::cat({tensor, by_name.at(layer + kK), by_name.at(layer + kV)}, 0));
      continue;
    }
    std::string renamed = name;
    for (const auto& [ours, theirs] : kBailingParts)
      if (rename_part(renamed, ours, theirs)) break;
    out.emplace_back(renamed, tensor);
  }
  return out;
}

namespace {

// Where each checkpoint tensor of a Hugging Face directory comes from: its stored (the
// architecture's) name and the rows it takes (BailingMoeV2's fused query_key_value gives q, k and
// v), in stored order. A tied model's stored lm_head is left out. Throws config_error naming
// `source` and the tensor when a fused tensor has the wrong shape.
struct HfTensorSource {
  std::string stored;
  int64_t row_begin = 0, rows = -1;  // rows -1: the whole tensor
};
std::vector<std::pair<std::string, HfTensorSource>> hf_checkpoint_sources(
    const Config& c, const std::vector<std::pair<std::string, std::vector<int64_t>>>& stored, const std::string& architecture,
    const std::string& source) {
  const bool bailing = architecture == kBailing;
  const int64_t q_rows = c.base_num_query_heads * c.head_dim, kv_rows = c.base_num_kv_heads * c.head_dim;
  std::vector<std::pair<std::string, HfTensorSource>> out;
  for (const auto& [name, shape] : stored) {
    if (c.logits_via_embedding && name == "lm_head.weight") continue;  // the tied model uses the embedding
    // Older Llama checkpoints store RoPE's frequencies as a buffer; transformers recomputes them
    // from rope_theta, as the trainer does.
    if (ends_with(name, ".rotary_emb.inv_freq")) continue;
    // DeepSeek's releases store their MTP layer after the decoder layers (model.layers.61 of
    // V3); transformers builds none and skips those tensors (_keys_to_ignore_on_load_unexpected).
    if (architecture == kDeepseekV3 && layer_index_of(name) >= c.base_num_decoder_layers) continue;
    if (!bailing) {
      out.push_back({name, {name}});
      continue;
    }
    if (ends_with(name, kQkv)) {
      const std::string layer = name.substr(0, name.size() - kQkv.size());
      if (shape.size() != 2 || shape[0] != q_rows + 2 * kv_rows) {
        std::ostringstream text;
        text << torch::IntArrayRef(shape);
        throw config_error(source + ": " + name + " has shape " + text.str() + "; this config needs (" +
                           std::to_string(q_rows + 2 * kv_rows) + ", " + std::to_string(c.base_emb_dim) +
                           "): (num_attention_heads + 2 num_key_value_heads) x head_dim rows");
      }
      out.push_back({layer + kQ, {name, 0, q_rows}});
      out.push_back({layer + kK, {name, q_rows, kv_rows}});
      out.push_back({layer + kV, {name, q_rows + kv_rows, kv_rows}});
      continue;
    }
    std::string renamed = name;
    for (const auto& [ours, theirs] : kBailingParts)
      if (rename_part(renamed, theirs, ours)) break;
    out.push_back({renamed, {name}});
  }
  // Two stored tensors for one of ours (embed_tokens beside word_embeddings, q_proj beside the
  // fused query_key_value): which one loaded depended on the reader (whole or one at a time).
  std::map<std::string, std::string> stored_as;
  for (const auto& [ours, from] : out)
    if (const auto [at, fresh] = stored_as.emplace(ours, from.stored); !fresh)
      throw config_error(source + ": " + at->second + " and " + from.stored + " both hold " + ours +
                         " (names of two conventions?); keep one");
  return out;
}

// Some tied checkpoints store the head anyway; the embedding is what the model uses.
void hf_warn_if_stored_head_differs(const Config& c, const torch::Tensor& head, const torch::Tensor& embedding,
                                    const std::string& source) {
  if (c.logits_via_embedding && head.defined() && embedding.defined() && !torch::equal(head, embedding))
    spdlog::warn("{}: lm_head.weight differs from the embedding; the tied model uses the embedding", source);
}

std::string hf_embedding_name(const std::string& architecture) {
  return architecture == kBailing ? "model.word_embeddings.weight" : "model.embed_tokens.weight";
}

}  // namespace

// BailingMoeV2Gate adds expert_bias to the scores whatever moe_router_enable_expert_bias says, so
// a nonzero one with routed_bias false would compute differently here: refused.
// `name` is the checkpoint name, `stored` the one the message shows.
// Each tensor as it is read: finite, and an expert bias the config would ignore must be zero.
void checkpoint_check_initial_weight(const Config& c, const std::string& name, const std::string& stored,
                                     const torch::Tensor& tensor, const std::string& source) {
  checkpoint_check_finite(stored, tensor, source);
  if (ends_with(name, ".e_score_correction_bias") && !c.routed_bias && tensor.abs().max().item<float>() != 0)
    throw config_error(source + ": " + stored + " is nonzero, but routed_bias is false (it would be ignored): "
                       "pass routed_bias=true (override_model_config=true with a model file)");
}


NamedTensors hf_tensors_to_checkpoint(const Config& c, const NamedTensors& hf, const std::string& architecture,
                                      const std::string& source) {
  std::map<std::string, torch::Tensor> by_name(hf.begin(), hf.end());
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  for (const auto& [name, tensor] : hf) shapes.emplace_back(name, tensor.sizes().vec());
  if (by_name.count("lm_head.weight") && by_name.count(hf_embedding_name(architecture)))
    hf_warn_if_stored_head_differs(c, by_name["lm_head.weight"], by_name[hf_embedding_name(architecture)], source);
  NamedTensors out;
  for (const auto& [name, from] : hf_checkpoint_sources(c, shapes, architecture, source)) {
    auto tensor = by_name.at(from.stored);
    if (from.rows >= 0) tensor = tensor.narrow(0, from.row_begin, from.rows).contiguous();
    checkpoint_check_initial_weight(c, name, from.stored, tensor, source);
    out.emplace_back(name, tensor);
  }
  return out;
}

CheckpointReader CheckpointReader::hugging_face(const std::string& dir, const Config& config, const std::string& architecture) {
  CheckpointReader files = weights(dir);
  std::vector<std::pair<std::string, std::vector<int64_t>>> shapes;
  for (const auto& name : files.model_names_) shapes.emplace_back(name, files.shape(name));
  const std::string& source = dir;  // named in errors as hf_tensors_to_checkpoint's callers name it
  if (files.contains("lm_head.weight") && files.contains(hf_embedding_name(architecture)) && config.logits_via_embedding)
    hf_warn_if_stored_head_differs(config, files.read("lm_head.weight"), files.read(hf_embedding_name(architecture)), source);
  CheckpointReader reader;
  reader.tensors_ = std::move(files.tensors_);
  for (const auto& [name, from] : hf_checkpoint_sources(config, shapes, architecture, source)) {
    reader.model_names_.push_back(name);
    reader.aliases_[name] = {from.stored, from.row_begin, from.rows};
  }
  reader.check_reads([config, source](const std::string& name, const std::string& stored, const torch::Tensor& tensor) {
    checkpoint_check_initial_weight(config, name, stored, tensor, source);
  });
  return reader;
}

std::map<std::string, std::set<std::string>> hf_directory_files(const std::string& dir) {
  const fs::path root(dir);
  const fs::path index_path = root / "model.safetensors.index.json", single = root / "model.safetensors";
  // Both present: model.safetensors is the model, as transformers' from_pretrained decides (it
  // looks for the single file first), so both load the same weights.
  if (fs::exists(single)) {
    if (fs::exists(index_path))
      spdlog::warn("{} holds both model.safetensors and model.safetensors.index.json: reading model.safetensors, as "
                   "transformers does (the index and its files are ignored)", dir);
    return {{single.string(), {}}};
  }
  if (!fs::exists(index_path)) throw config_error("no model.safetensors or model.safetensors.index.json in " + dir);
  if (!fs::is_regular_file(index_path))  // a directory read as an empty stream: "cannot parse"
    throw config_error(index_path.string() + " is not a file");
  nlohmann::json index;
  try {
    std::ifstream in(index_path);
    if (!in) throw config_error("cannot read " + index_path.string() + ": " + std::strerror(errno));
    index = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw config_error("cannot parse " + index_path.string() + ": " + e.what());
  }
  if (!index.contains("weight_map") || !index["weight_map"].is_object())
    throw config_error(index_path.string() + " has no weight_map object");
  std::map<std::string, std::set<std::string>> names_in_file;  // shard path -> the names the index puts there
  for (const auto& [name, file] : index["weight_map"].items()) {
    if (!file.is_string()) throw config_error(index_path.string() + ": weight_map entry " + name + " is not a file name");
    const fs::path listed(file.get<std::string>());
    const bool escapes = listed.is_absolute() || std::any_of(listed.begin(), listed.end(), [](const fs::path& part) {
                           return part == "..";
                         });
    if (escapes)  // an index names files of its own directory; this one would read any file
      throw config_error(index_path.string() + ": weight_map puts " + name + " in " + listed.string() +
                         ", outside " + dir + " (an index names files of its own directory)");
    const fs::path path = root / listed;
    if (!fs::exists(path))
      throw config_error(index_path.string() + " lists " + file.get<std::string>() + " (for " + name + "), which is missing");
    if (!fs::is_regular_file(path))  // "" or "." names the directory itself
      throw config_error(index_path.string() + " puts " + name + " in \"" + file.get<std::string>() + "\", which is not a file");
    names_in_file[path.string()].insert(name);
  }
  return names_in_file;
}

NamedTensors hf_read_directory(const std::string& dir) {
  // One tensor at a time through the reader, which also refuses a tensor stored in two files.
  const auto reader = CheckpointReader::weights(dir);
  NamedTensors out;
  for (const auto& name : reader.model_names()) out.emplace_back(name, reader.read(name));
  return out;
}

namespace {

// The dtype a tensor is stored in: the export's, except the routers' expert_bias, kept fp32. Its
// updates (routed_bias_update_rate, 1e-3) are finer than bf16's spacing at its typical size, and
// vLLM and SGLang keep it fp32 (transformers casts it with the rest when loading in bf16): a bf16
// copy would route some tokens of nearly tied experts differently from the trained model.
torch::ScalarType hf_stored_dtype(const std::string& name, torch::ScalarType dtype) {
  const std::string bias = ".expert_bias";
  const bool routing_bias = name.size() >= bias.size() && name.compare(name.size() - bias.size(), bias.size(), bias) == 0;
  return routing_bias ? torch::kFloat32 : dtype;
}

}  // namespace

HfDirectoryWriter::HfDirectoryWriter(const std::string& dir, const std::string& config_json, const NamedTensors& plan,
                                     int64_t max_shard_bytes, torch::ScalarType dtype)
    : dir_(dir), target_(fs::absolute(dir)), dtype_(dtype) {
  if (fs::exists(target_) && !(fs::is_directory(target_) && fs::is_empty(target_)))
    throw config_error("--export-hf " + dir + ": the path exists and is not an empty directory; remove it or choose another");
  if (max_shard_bytes <= 0) throw config_error("--export-hf-max-shard-mb must be > 0");
  // Files in plan order: a new file when the next tensor would overflow this one.
  int64_t file_bytes = 0;
  for (const auto& [name, tensor] : plan) {
    const auto stored = hf_stored_dtype(name, dtype);
    const std::string type = stored == torch::kBFloat16 ? "BF16" : "F32";
    const int64_t bytes = tensor.numel() * static_cast<int64_t>(torch::elementSize(stored));
    if (files_.empty() || (!files_.back().entries.empty() && file_bytes + bytes > max_shard_bytes)) {
      files_.emplace_back();
      file_bytes = 0;
    }
    files_.back().entries.push_back({name, type, tensor.sizes().vec(), nullptr, static_cast<size_t>(bytes)});
    file_bytes += bytes;
  }
  if (files_.empty()) files_.emplace_back();
  for (size_t i = 0; i < files_.size(); ++i)
    files_[i].name = files_.size() == 1 ? "model.safetensors"
                                        : checkpoint_shard_file_name("model", static_cast<int64_t>(i),
                                                                     static_cast<int64_t>(files_.size()), ".safetensors");
  partial_ = target_.parent_path() / (target_.filename().string() + ".partial-" + std::to_string(getpid()));
  try {
    fs::remove_all(partial_);
    fs::create_directories(partial_);
    file_write_durable((partial_ / "config.json").string(), config_json);
    writer_ = std::make_unique<SafetensorsStreamWriter>((partial_ / files_[0].name).string(), files_[0].entries,
                                                        std::map<std::string, std::string>{{"format", "pt"}});
  } catch (const std::exception& e) {
    fail(e.what());
  }
}

HfDirectoryWriter::~HfDirectoryWriter() {
  if (closed_) return;
  writer_.reset();
  std::error_code ignored;
  fs::remove_all(partial_, ignored);
}

void HfDirectoryWriter::fail(const std::string& why) {
  writer_.reset();
  std::error_code ignored;
  fs::remove_all(partial_, ignored);
  closed_ = true;
  throw Error(kExitFailure, "cannot write the Hugging Face checkpoint " + dir_ + ": " + why);
}

void HfDirectoryWriter::append(const NamedTensors& tensors) {
  if (closed_) fail("append after the directory was finished or failed");
  try {
    for (const auto& [name, tensor] : tensors) {
      while (writer_->complete()) {  // the current file is full: close it, open the next
        writer_->finish();
        if (++file_ == files_.size()) throw std::runtime_error("tensor " + name + " is not in the plan");
        writer_ = std::make_unique<SafetensorsStreamWriter>((partial_ / files_[file_].name).string(),
                                                            files_[file_].entries,
                                                            std::map<std::string, std::string>{{"format", "pt"}});
      }
      const auto converted = tensor.to(torch::kCPU).to(hf_stored_dtype(name, dtype_)).contiguous();
      writer_->append(name, converted.data_ptr(), converted.nbytes());
    }
  } catch (const Error&) {
    throw;
  } catch (const std::exception& e) {
    fail(e.what());
  }
}

void HfDirectoryWriter::finish() {
  try {
    if (file_ + 1 != files_.size() || !writer_->complete())
      throw std::runtime_error("finished before the last tensor of the plan");
    writer_->finish();
    writer_.reset();
    if (files_.size() > 1) {
      nlohmann::ordered_json index;
      int64_t total_bytes = 0;
      for (const auto& file : files_)
        for (const auto& entry : file.entries) total_bytes += static_cast<int64_t>(entry.nbytes);
      index["metadata"] = {{"total_size", total_bytes}};
      index["weight_map"] = nlohmann::ordered_json::object();
      for (const auto& file : files_)
        for (const auto& entry : file.entries) index["weight_map"][entry.name] = file.name;
      file_write_durable((partial_ / "model.safetensors.index.json").string(), index.dump(2) + "\n");
    }
    directory_sync(partial_.string());
    if (fs::exists(target_)) fs::remove(target_);  // the empty directory checked at construction
    fs::rename(partial_, target_);
    directory_sync(target_.parent_path().string());
    closed_ = true;
  } catch (const std::exception& e) {
    fail(e.what());
  }
}

void hf_write_directory(const std::string& dir, const std::string& config_json, const NamedTensors& tensors,
                        int64_t max_shard_bytes, torch::ScalarType dtype) {
  HfDirectoryWriter writer(dir, config_json, tensors, max_shard_bytes, dtype);
  writer.append(tensors);
  writer.finish();
}

}  // namespace trainer
