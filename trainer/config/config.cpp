// Config layering (base.yml -> models/<model_name>.yml -> CLI -> M_<KEY> env), validation and
// derived values. See docs/config.md for the rules this implements.
#include "trainer/config/config.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <ctime>
#include <filesystem>
#include <initializer_list>
#include <map>
#include <optional>
#include <regex>
#include <set>

#include <yaml-cpp/yaml.h>

#include "trainer/config/hf_config.h"
#include "trainer/config/keys.h"
#include "trainer/dist/env.h"
#include "trainer/util/error.h"

extern char** environ;

namespace trainer {
namespace {

namespace fs = std::filesystem;
using config_detail::find_key;
using config_detail::key_registry;
using config_detail::nearest_key;
using config_detail::node_text;

struct RawValue {
  YAML::Node node;
  std::string source;  // "configs/base.yml", "command line", "environment M_STEPS"
};
using RawLayer = std::map<std::string, RawValue>;

// MaxText keys with no key of that name here, and what covers them (the nearest spelling is no
// help: weight_dtype was "did you mean 'rope_type'?").
const std::map<std::string, std::string>& maxtext_key_notes() {
  static const std::map<std::string, std::string> notes = {
      {"weight_dtype", "weights, gradients and AdamW state are always float32 here; 'dtype' sets the compute dtype"},
      {"mu_dtype", "the AdamW moments are always float32 here"},
      {"opt_type", "the optimizer is always AdamW here (adam_b1, adam_b2, adam_eps, adam_weight_decay)"},
      {"adam_eps_root", "not supported: 'adam_eps' is added outside the square root (optax's eps), there is no eps inside it"},
      {"global_batch_size", "it is derived: per_device_batch_size x data-parallel ranks x gradient_accumulation_steps"},
      {"normalize_embedding_logits", "a tied head ('logits_via_embedding') gives unscaled logits here (Hugging Face's "
                                     "convention), as MaxText's normalize_embedding_logits=false"},
      {"rope_use_scale", "Llama 3.1's RoPE scaling is rope_type=llama3 (rope_factor, rope_low_freq_factor, "
                         "rope_high_freq_factor, original_max_position_embeddings); rope_type=default does not scale"},
      {"rope_linear_scaling_factor", "not supported: linear RoPE scaling (rope_type is default, yarn or llama3)"},
      {"rope_interleave", "MLA's pairing is 'mla_interleaved_rope'; global and GLA layers always rotate half-split "
                          "(MaxText's rope_interleave=false)"},
      {"ici_expert_parallelism", "use 'expert_parallelism' (ranks per expert-parallel group)"},
      {"ici_fsdp_parallelism", "use 'data_parallel_sharding' (and 'data_parallel_shard_degree'); the ranks come from the launcher"},
      {"ici_data_parallelism", "data parallelism is the launcher's ranks (mpirun -np, or RANK/WORLD_SIZE)"},
      {"dcn_data_parallelism", "data parallelism is the launcher's ranks (mpirun -np, or RANK/WORLD_SIZE)"},
  };
  return notes;
}

[[noreturn]] void unknown_key(const std::string& key, const std::string& source) {
  const auto note = maxtext_key_notes().find(key);
  if (note != maxtext_key_notes().end())
    throw config_error("unknown config key '" + key + "' (from " + source + "): " + note->second);
  throw config_error("unknown config key '" + key + "' (from " + source + "); did you mean '" +
                     nearest_key(key) + "'?");
}

YAML::Node load_yaml_file(const fs::path& path) {
  if (!fs::exists(path)) throw config_error("config file not found: " + path.string());
  if (fs::is_directory(path)) throw config_error("config file " + path.string() + " is a directory");
  // All documents: LoadFile reads the first only, so keys after a "---" would go unchecked.
  std::vector<YAML::Node> documents;
  try {
    documents = YAML::LoadAllFromFile(path.string());
  } catch (const YAML::Exception& e) {
    throw config_error("cannot parse config file " + path.string() + ": " + e.what());
  } catch (const std::exception& e) {  // unreadable (permissions, I/O)
    throw config_error("cannot read config file " + path.string() + ": " + e.what());
  }
  // A trailing "---" starts an empty document: harmless.
  if (documents.size() > 1 &&
      std::any_of(documents.begin() + 1, documents.end(), [](const YAML::Node& d) { return !d.IsNull(); }))
    throw config_error("config file " + path.string() + " holds " + std::to_string(documents.size()) +
                       " YAML documents (separated by '---'); the trainer reads one");
  return documents.empty() ? YAML::Node() : documents[0];
}

// Reads a YAML file, following `base_config:` (relative to the file) first, so the file's own
// keys win over the ones it inherits.
RawLayer load_file_layer(const fs::path& path, int depth = 0) {
  if (depth > 16) throw config_error("base_config chain deeper than 16 files at " + path.string());
  const YAML::Node root = load_yaml_file(path);
  RawLayer layer;
  if (root.IsNull()) return layer;
  if (!root.IsMap()) throw config_error("config file " + path.string() + " is not a key: value map");
  if (const YAML::Node base = root["base_config"]) {
    if (!base.IsScalar()) throw config_error("config file " + path.string() + ": base_config must be a file name");
    layer = load_file_layer(path.parent_path() / base.as<std::string>(), depth + 1);
  }
  std::set<std::string> seen;  // YAML forbids a key twice in a map; yaml-cpp keeps both
  for (const auto& item : root) {
    if (!item.first.IsScalar()) throw config_error("config file " + path.string() + ": a key that is not a name");
    const std::string key = item.first.as<std::string>();
    if (!seen.insert(key).second) throw config_error("config file " + path.string() + ": key '" + key + "' appears twice");
    if (key == "base_config") continue;
    if (!find_key(key)) unknown_key(key, path.string());
    layer[key] = {item.second, path.string()};
  }
  return layer;
}

YAML::Node parse_scalar_text(const std::string& key, const std::string& text,
                             const std::string& source) {
  try {
    return YAML::Load(text);
  } catch (const YAML::Exception&) {
    throw config_error("config key '" + key + "': value '" + text + "' (from " + source +
                       ") is not valid YAML");
  }
}

RawLayer parse_cli_overrides(const std::vector<std::string>& overrides) {
  RawLayer layer;
  for (const auto& arg : overrides) {
    const auto eq = arg.find('=');
    if (eq == std::string::npos || eq == 0)
      throw config_error("override '" + arg + "' is not of the form key=value");
    const std::string key = arg.substr(0, eq);
    if (!find_key(key)) unknown_key(key, "command line");
    layer[key] = {parse_scalar_text(key, arg.substr(eq + 1), "command line"), "command line"};
  }
  return layer;
}

RawLayer parse_environment(const std::vector<std::string>& environment) {
  RawLayer layer;
  for (const auto& entry : environment) {
    if (entry.rfind("M_", 0) != 0) continue;
    const auto eq = entry.find('=');
    if (eq == std::string::npos) continue;
    const std::string var = entry.substr(0, eq);
    std::string key = var.substr(2);
    std::transform(key.begin(), key.end(), key.begin(),
                   [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    const std::string source = "environment " + var;
    if (!find_key(key)) unknown_key(key, source);
    layer[key] = {parse_scalar_text(key, entry.substr(eq + 1), source), source};
  }
  return layer;
}

// The value as the key's type would print it, so "1e-5" and "0.00001" compare equal.
std::string canonical(const std::string& key, const RawValue& value) {
  const auto* info = find_key(key);
  Config scratch;
  info->assign(scratch, value.node, value.source);
  return info->format(scratch);
}

std::string timestamp() {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  localtime_r(&now, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y%m%d_%H%M%S", &tm);
  return buf;
}

// More would only starve each other; an absurd count (a typo) would start them all before failing.
constexpr int64_t kMaxThreads = 1024;

// Cross-field and range rules. Every violation is collected; each message names all its fields.
std::vector<std::string> validation_errors(const Config& c) {
  std::vector<std::string> errors;
  auto require = [&errors](bool ok, const std::string& message) {
    if (!ok) errors.push_back(message);
  };
  // "<key> <rule> (got <value>)", the value printed as the key prints it; a note joins it:
  // "(0 = keep all; got -2)".
  auto bad_value = [&c](const std::string& key, const std::string& rule, const std::string& note = "") {
    const config_detail::KeyInfo* info = find_key(key);
    if (info == nullptr) throw std::logic_error("validation names an unknown key: " + key);
    return key + " " + rule + " (" + (note.empty() ? "" : note + "; ") + "got " + info->format(c) + ")";
  };
  auto positive = [&require, &bad_value](int64_t v, const char* name) { require(v > 0, bad_value(name, "must be > 0")); };
  positive(c.vocab_size, "vocab_size");
  positive(c.base_emb_dim, "base_emb_dim");
  positive(c.base_num_query_heads, "base_num_query_heads");
  positive(c.base_num_kv_heads, "base_num_kv_heads");
  positive(c.head_dim, "head_dim");
  positive(c.base_mlp_dim, "base_mlp_dim");
  positive(c.base_num_decoder_layers, "base_num_decoder_layers");
  positive(c.max_target_length, "max_target_length");
  positive(c.per_device_batch_size, "per_device_batch_size");
  positive(c.gradient_accumulation_steps, "gradient_accumulation_steps");
  positive(c.log_period, "log_period");
  positive(c.skip_step_interval, "skip_step_interval");
  positive(c.checkpoint_period, "checkpoint_period");
  require(c.max_num_checkpoints_to_keep >= 0, bad_value("max_num_checkpoints_to_keep", "must be >= 0", "0 = keep all"));
  require(c.load_parameters_path.empty() || c.load_full_state_path.empty(),
          "load_parameters_path and load_full_state_path are both set: choose one");
  require(c.num_threads >= 0 && c.num_threads <= kMaxThreads,
          "num_threads must be in [0, " + std::to_string(kMaxThreads) + "] (0 = LibTorch default; got " +
              std::to_string(c.num_threads) + ")");
  if (c.base_num_query_heads > 0 && c.base_num_kv_heads > 0)
    require(c.base_num_query_heads % c.base_num_kv_heads == 0,
            "base_num_kv_heads (" + std::to_string(c.base_num_kv_heads) +
                ") must divide base_num_query_heads (" + std::to_string(c.base_num_query_heads) +
                ")");
  const int64_t rotary_dim =
      static_cast<int64_t>(std::llround(c.partial_rotary_factor * static_cast<double>(c.head_dim)));
  require(c.partial_rotary_factor > 0 && c.partial_rotary_factor <= 1 && rotary_dim % 2 == 0 &&
              std::abs(c.partial_rotary_factor * c.head_dim - rotary_dim) < 1e-9,
          "partial_rotary_factor (" + std::to_string(c.partial_rotary_factor) +
              ") times head_dim (" + std::to_string(c.head_dim) +
              ") must be an even whole number of dimensions in (0, head_dim]");
  // Attention variants (docs/model.md). Which layers use which: model_layer_attention.
  require(c.inhomogeneous_layer_cycle_interval >= 0,
          bad_value("inhomogeneous_layer_cycle_interval", "must be >= 0", "0 = every layer uses attention_type"));
  require(c.inhomogeneous_layer_cycle_interval == 0 || c.attention_type != "gla",
          "inhomogeneous_layer_cycle_interval=" + std::to_string(c.inhomogeneous_layer_cycle_interval) +
              " makes every N-th layer use attention_type, which must then be global or mla (got gla)");
  require(c.attention_type != "gla" || c.mtp_num_layers == 0,
          "attention_type=gla with mtp_num_layers=" + std::to_string(c.mtp_num_layers) +
              ": MTP layers use full attention (set attention_type=global|mla with inhomogeneous_layer_cycle_interval)");
  const bool any_gla = c.attention_type == "gla" || c.inhomogeneous_layer_cycle_interval > 1;
  if (c.attention_type == "mla") {
    require(c.q_lora_rank >= 0, bad_value("q_lora_rank", "must be >= 0", "0 = full-rank query projection"));
    positive(c.kv_lora_rank, "kv_lora_rank");
    require(c.qk_nope_head_dim >= 0, bad_value("qk_nope_head_dim", "must be >= 0"));
    require(c.qk_rope_head_dim > 0 && c.qk_rope_head_dim % 2 == 0,
            "qk_rope_head_dim must be even and > 0 (got " + std::to_string(c.qk_rope_head_dim) + ")");
    positive(c.v_head_dim, "v_head_dim");
    require(c.rope_factor >= 1, bad_value("rope_factor", "must be >= 1"));
    positive(c.max_position_embeddings, "max_position_embeddings");
    positive(c.original_max_position_embeddings, "original_max_position_embeddings");
    require(c.base_num_kv_heads == c.base_num_query_heads,
            "MLA layers give every query head its own key and value: base_num_kv_heads (" + std::to_string(c.base_num_kv_heads) +
                ") must equal base_num_query_heads (" + std::to_string(c.base_num_query_heads) + ")");
    require(c.rope_type != "llama3", "rope_type=llama3 scales the RoPE of global and GLA layers; MLA's RoPE part takes "
                                     "default or yarn (attention_type=mla)");
  } else {
    require(c.rope_type != "yarn" || !any_gla,
            "rope_type=yarn scales the RoPE of global and MLA layers, and this model has GLA layers (attention_type=" +
                c.attention_type + ", inhomogeneous_layer_cycle_interval=" + std::to_string(c.inhomogeneous_layer_cycle_interval) +
                "); their scaling is rope_type=llama3");
  }
  if (c.rope_type == "yarn") {
    // YaRN (docs/model.md): frequencies blended with f / rope_factor over the dims that turn
    // between beta_slow and beta_fast times in the original context.
    require(c.rope_factor >= 1, bad_value("rope_factor", "must be >= 1", "rope_type=yarn divides frequencies by it"));
    // Equal betas are one boundary dim (Kimi K2: 1 and 1): the ramp then spans floor .. ceil of it.
    require(c.beta_fast >= c.beta_slow && c.beta_slow > 0,
            "rope_type=yarn needs beta_fast >= beta_slow > 0 (got " + find_key("beta_fast")->format(c) + " and " +
                find_key("beta_slow")->format(c) + ")");
    positive(c.original_max_position_embeddings, "original_max_position_embeddings");
    positive(c.max_position_embeddings, "max_position_embeddings");
  }
  require(c.rope_type == "yarn" || !c.rope_attention_scaling,
          "rope_attention_scaling=true scales YaRN's rotation (rope_type=yarn), and rope_type is " + c.rope_type);
  require(c.rope_type == "yarn" || c.rope_truncate,
          "rope_truncate=false changes YaRN's correction range (rope_type=yarn), and rope_type is " + c.rope_type);
  if (c.rope_type == "llama3") {
    // Llama 3.1's rule (docs/model.md): wavelengths past original / low are divided, those under
    // original / high kept, the band between blended; it needs low < high and a factor >= 1.
    require(c.rope_factor >= 1, bad_value("rope_factor", "must be >= 1", "rope_type=llama3 divides frequencies by it"));
    require(c.rope_low_freq_factor > 0, bad_value("rope_low_freq_factor", "must be > 0"));
    require(c.rope_high_freq_factor > c.rope_low_freq_factor,
            bad_value("rope_high_freq_factor", "must be > rope_low_freq_factor = " + find_key("rope_low_freq_factor")->format(c)));
    positive(c.original_max_position_embeddings, "original_max_position_embeddings");
    positive(c.max_position_embeddings, "max_position_embeddings");
  }
  if (any_gla) {
    require(c.base_num_kv_heads == c.base_num_query_heads,
            "GLA layers need base_num_kv_heads (" + std::to_string(c.base_num_kv_heads) + ") == base_num_query_heads (" +
                std::to_string(c.base_num_query_heads) + "): every head has its own key and value");
    positive(c.gla_chunk_size, "gla_chunk_size");
    require(c.group_norm_size > 0 && (c.base_num_query_heads * c.head_dim) % c.group_norm_size == 0,
            "group_norm_size (" + std::to_string(c.group_norm_size) + ") must be > 0 and divide base_num_query_heads * head_dim (" +
                std::to_string(c.base_num_query_heads * c.head_dim) + ")");
  }
  require(c.moe_shared_expert_dim >= 0, bad_value("moe_shared_expert_dim", "must be >= 0", "0 = base_moe_mlp_dim"));
  require(c.mlp_activations == StringList{"silu", "linear"},
          bad_value("mlp_activations", "must be [silu, linear] (SwiGLU); other MLPs are not implemented"));
  require(c.normalization_layer_epsilon > 0, bad_value("normalization_layer_epsilon", "must be > 0"));
  require(c.rope_max_timescale > 0, bad_value("rope_max_timescale", "must be > 0"));
  require(c.synthetic_min_valid_fraction > 0 && c.synthetic_min_valid_fraction <= 1,
          bad_value("synthetic_min_valid_fraction", "must be in (0, 1]"));
  require(c.pad_id >= -1 && c.pad_id < c.vocab_size,
          "pad_id (" + std::to_string(c.pad_id) + ") must be in [0, vocab_size (" +
              std::to_string(c.vocab_size) + ")), or -1 for none (Megatron data only)");
  require(c.pad_id >= 0 || c.dataset_type != "synthetic", bad_value("pad_id", "must be >= 0 with synthetic data"));
  require(c.vocab_size >= 4, bad_value("vocab_size", "must be >= 4"));
  // Any negative id meant "none" before, silently; only -1 says so (as for pad_id).
  require(c.eod_id >= -1, "eod_id (" + std::to_string(c.eod_id) + ") must be >= 0, or -1 for none");
  if (c.dataset_type != "synthetic") {
    require(c.dataset_type == "megatron" || c.grain_file_type == "mmap_npy",
            "dataset_type=grain needs grain_file_type=mmap_npy (Megatron .bin/.idx); other grain formats are not supported");
    require(!c.dataset_path.empty(), "dataset_type=" + c.dataset_type + " needs dataset_path (a prefix or \"w1 prefix1 w2 prefix2\")");
    require(c.eod_id < c.vocab_size, "eod_id (" + std::to_string(c.eod_id) + ") must be < vocab_size (" +
                                         std::to_string(c.vocab_size) + "), or -1 for none");
    require(!(c.eod_mask_loss || c.reset_position_ids || c.reset_attention_mask) || c.eod_id >= 0,
            "eod_mask_loss, reset_position_ids and reset_attention_mask need eod_id >= 0");
  } else {
    // Synthetic rows are random tokens then padding, one document each: the flags would change
    // nothing (they were accepted and ignored, silently).
    for (const auto& [key, on] : {std::pair<const char*, bool>{"eod_mask_loss", c.eod_mask_loss},
                                  {"reset_position_ids", c.reset_position_ids},
                                  {"reset_attention_mask", c.reset_attention_mask}})
      require(!on, std::string(key) + "=true needs documents that end in eod_id (dataset_type=megatron); "
                   "synthetic rows have none, so it would change nothing");
  }
  require(c.eval_interval >= 0, bad_value("eval_interval", "must be >= 0", "0 = no evaluation"));
  require(c.eval_steps > 0, bad_value("eval_steps", "must be > 0"));
  require(c.peak_tflops_per_device >= 0, bad_value("peak_tflops_per_device", "must be >= 0", "0 = known GPU peaks, else unknown"));
  // c10d counts it in int64 milliseconds: a larger one would overflow there.
  // Collectives take whole milliseconds: a shorter timeout would be 0 (no wait at all).
  require(c.collective_timeout_seconds >= 0.001 && c.collective_timeout_seconds <= 1e9,
          bad_value("collective_timeout_seconds", "must be in [0.001, 1e9]", "whole milliseconds; 1e9 s is 31 years"));
  require(c.dist_backend != "nccl" || c.hardware == "gpu", "dist_backend=nccl needs hardware=gpu (NCCL reduces CUDA tensors)");
  for (const auto& [key, value] : std::vector<std::pair<const char*, int64_t>>{
           {"debug_inject_nonfinite_step", c.debug_inject_nonfinite_step},
           {"debug_block_checkpoint_shard_rank", c.debug_block_checkpoint_shard_rank},
           {"debug_pause_checkpoint_save_step", c.debug_pause_checkpoint_save_step},
           {"debug_kill_rank_before_parameter_gather", c.debug_kill_rank_before_parameter_gather},
           {"debug_kill_rank_in_expert_dispatch", c.debug_kill_rank_in_expert_dispatch}})
    require(value >= -1, bad_value(key, "must be >= -1", "-1 = never"));
  require(!c.debug_cuda_sync_check || c.hardware == "gpu",
          "debug_cuda_sync_check needs hardware=gpu (it uses CUDA's synchronization debug mode)");
  // Bounded so that its size in elements cannot overflow (a bucket past the model is one bucket).
  require(c.gradient_bucket_size_mb > 0 && c.gradient_bucket_size_mb <= 1048576,
          bad_value("gradient_bucket_size_mb", "must be in [1, 1048576]", "1048576 MB is 1 TiB"));
  require(!c.shard_optimizer_over_data || c.data_parallel_sharding == "none" || c.data_parallel_sharding == "optim",
          "shard_optimizer_over_data=true (the old name of data_parallel_sharding=optim) contradicts "
          "data_parallel_sharding=" + c.data_parallel_sharding);
  require(c.data_parallel_sharding != "optim_grads_params" || c.remat_policy == "full",
          "data_parallel_sharding=optim_grads_params needs remat_policy=full (remat_policy=" + c.remat_policy +
              "): a decoder layer's parameters are freed after its forward and gathered again for its backward, "
              "which reruns the layer from its input (docs/distributed.md)");
  require(c.data_parallel_shard_degree == -1 || c.data_parallel_shard_degree >= 1,
          "data_parallel_shard_degree must be -1 (shard over all data-parallel ranks) or >= 1, got " +
              std::to_string(c.data_parallel_shard_degree));
  require(c.data_parallel_shard_degree == -1 || c.data_parallel_sharding == "optim_grads" ||
              c.data_parallel_sharding == "optim_grads_params",
          "data_parallel_shard_degree=" + std::to_string(c.data_parallel_shard_degree) +
              " (HSDP) needs data_parallel_sharding=optim_grads or optim_grads_params (data_parallel_sharding=" +
              c.data_parallel_sharding + ")");
  require(c.expert_parallelism >= 1, bad_value("expert_parallelism", "must be >= 1", "1 = every rank holds every expert"));
  if (c.expert_parallelism > 1) {
    const std::string ep = "expert_parallelism=" + std::to_string(c.expert_parallelism);
    require(c.num_experts > 1 && c.num_experts % c.expert_parallelism == 0,
            ep + " must divide num_experts (" + std::to_string(c.num_experts) + ") of a MoE model");
  }
  require(c.z_loss_multiplier >= 0, bad_value("z_loss_multiplier", "must be >= 0"));
  require(c.num_vocab_tiling >= 1, bad_value("num_vocab_tiling", "must be >= 1", "1 = the whole (B, L, V) logits at once"));
  require(c.learning_rate >= 0, bad_value("learning_rate", "must be >= 0"));
  require(c.warmup_steps_fraction >= 0 && c.warmup_steps_fraction <= 1,
          bad_value("warmup_steps_fraction", "must be in [0, 1]"));
  require(c.learning_rate_final_fraction >= 0 && c.learning_rate_final_fraction <= 1,
          bad_value("learning_rate_final_fraction", "must be in [0, 1]"));
  if (c.lr_schedule_type == "wsd")
    require(c.wsd_decay_steps_fraction >= 0 &&
                c.warmup_steps_fraction + c.wsd_decay_steps_fraction <= 1,
            "warmup_steps_fraction + wsd_decay_steps_fraction must be <= 1 with "
            "lr_schedule_type=wsd");
  require(c.adam_b1 >= 0 && c.adam_b1 < 1, bad_value("adam_b1", "must be in [0, 1)"));
  require(c.adam_b2 >= 0 && c.adam_b2 < 1, bad_value("adam_b2", "must be in [0, 1)"));
  require(std::isfinite(c.init_method_std) && c.init_method_std > 0, bad_value("init_method_std", "must be a finite number > 0"));
  require(c.adam_eps > 0, bad_value("adam_eps", "must be > 0", "with 0, a parameter whose gradient is exactly 0 gets 0/0 = NaN"));
  require(c.adam_weight_decay >= 0, bad_value("adam_weight_decay", "must be >= 0"));
  for (const auto& pattern : c.adamw_mask) {
    try {
      (void)std::regex(pattern, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      errors.push_back("config key 'adamw_mask': '" + pattern + "' is not a regular expression (ECMAScript): " + e.what());
    }
  }
  require(c.gradient_clipping_threshold >= 0,
          bad_value("gradient_clipping_threshold", "must be >= 0", "0 disables clipping"));
  require(c.skip_step_scaling_factor > 0, bad_value("skip_step_scaling_factor", "must be > 0"));
  // A dense model has no router: a top-k other than the default would be silently ignored.
  require(c.num_experts > 1 || c.num_experts_per_tok == 1,
          "num_experts_per_tok=" + std::to_string(c.num_experts_per_tok) + " on a dense model (num_experts=" +
              std::to_string(c.num_experts) + "): set num_experts > 1 for a MoE model, or leave it at 1");
  if (c.num_experts > 1) {
    require(c.num_experts_per_tok >= 1 && c.num_experts_per_tok <= c.num_experts,
            "num_experts_per_tok (" + std::to_string(c.num_experts_per_tok) + ") must be in [1, num_experts (" +
                std::to_string(c.num_experts) + ")]");
    require(c.base_moe_mlp_dim > 0, bad_value("base_moe_mlp_dim", "must be > 0 when num_experts > 1"));
    require(c.first_num_dense_layers >= 0 && c.first_num_dense_layers < c.base_num_decoder_layers,
            "first_num_dense_layers (" + std::to_string(c.first_num_dense_layers) +
                ") must be in [0, base_num_decoder_layers (" + std::to_string(c.base_num_decoder_layers) +
                ")) when num_experts > 1");
  } else {
    require(c.num_experts >= 0, bad_value("num_experts", "must be >= 0", "0 or 1 = dense"));
    require(c.shared_experts == 0 && !c.routed_bias,
            "shared_experts and routed_bias need num_experts > 1 (got num_experts = " +
                std::to_string(c.num_experts) + ")");
  }
  require(c.shared_experts >= 0, bad_value("shared_experts", "must be >= 0"));
  require(c.routed_scaling_factor > 0, bad_value("routed_scaling_factor", "must be > 0"));
  // One renormalized sigmoid score is s / s = 1: every weight would be routed_scaling_factor and the
  // loss would send the router no gradient through it. Megatron and Hugging Face's Ling
  // (BailingMoeV2Gate) renormalize sigmoid weights only when top-k > 1.
  require(!(c.num_experts > 1 && c.routed_score_func == "sigmoid" && c.num_experts_per_tok == 1 && c.norm_topk_prob),
          "norm_topk_prob=true with routed_score_func=sigmoid and num_experts_per_tok=1 makes every routing weight "
          "routed_scaling_factor (one score divided by itself); Megatron and Ling renormalize sigmoid weights only for "
          "top-k > 1: set norm_topk_prob=false");
  require(!c.mtp_moe_mlp || (c.num_experts > 1 && c.mtp_num_layers > 0),
          "mtp_moe_mlp=true needs num_experts > 1 and mtp_num_layers > 0");
  if (c.n_routing_groups != -1 || c.topk_routing_group != -1) {
    const int64_t groups = c.n_routing_groups;
    require(c.num_experts > 1 && groups > 0 && c.num_experts % groups == 0 && c.num_experts / groups >= 2,
            "n_routing_groups (" + std::to_string(groups) + ") must divide num_experts (" + std::to_string(c.num_experts) +
                ") into groups of at least 2 experts (a group's score is its top-2 sum); -1 = off");
    require(groups > 0 && c.topk_routing_group >= 1 && c.topk_routing_group <= groups &&
                c.topk_routing_group * (c.num_experts / groups) >= c.num_experts_per_tok,
            "topk_routing_group (" + std::to_string(c.topk_routing_group) + ") must be in [1, n_routing_groups (" +
                std::to_string(groups) + ")] and keep at least num_experts_per_tok (" +
                std::to_string(c.num_experts_per_tok) + ") experts (both keys -1 = no group limit)");
  }
  require(c.load_balance_loss_weight >= 0, bad_value("load_balance_loss_weight", "must be >= 0"));
  require(c.router_z_loss_weight >= 0, bad_value("router_z_loss_weight", "must be >= 0"));
  require(c.routed_bias_update_rate >= 0, bad_value("routed_bias_update_rate", "must be >= 0"));
  require(c.mtp_num_layers >= 0 && c.mtp_num_layers < c.max_target_length,
          "mtp_num_layers (" + std::to_string(c.mtp_num_layers) + ") must be in [0, max_target_length (" +
              std::to_string(c.max_target_length) + ")): depth d predicts the token d + 1 ahead");
  // numpy.random.RandomState, which Megatron shuffles with, takes seeds in [0, 2^32).
  require(c.data_shuffle_seed >= 0 && c.data_shuffle_seed <= 0xffffffffLL,
          "data_shuffle_seed (" + std::to_string(c.data_shuffle_seed) + ") must be in [0, 2^32), as numpy's RandomState");
  // (With MTP layers a longer cycle is how a decoder of GLA layers only gets full-attention MTP.)
  require(c.inhomogeneous_layer_cycle_interval <= c.base_num_decoder_layers || c.mtp_num_layers > 0,
          "inhomogeneous_layer_cycle_interval (" + std::to_string(c.inhomogeneous_layer_cycle_interval) +
              ") must be <= base_num_decoder_layers (" + std::to_string(c.base_num_decoder_layers) +
              ") without MTP layers: with more, no layer would use attention_type=" + c.attention_type);
  // A ceiling far above any real model, so that no parameter or FLOP count overflows int64: an
  // upper bound of the parameters, every width taken as the widest.
  {
    const long double widest = std::max<long double>(
        {1.0L * c.base_emb_dim, 1.0L * c.base_mlp_dim, 1.0L * c.base_moe_mlp_dim, 1.0L * c.moe_shared_expert_dim,
         1.0L * c.base_num_query_heads * c.head_dim, 1.0L * c.base_num_query_heads * (c.qk_nope_head_dim + c.qk_rope_head_dim + c.v_head_dim),
         1.0L * c.q_lora_rank, 1.0L * c.kv_lora_rank});
    const long double bound = 8.0L * widest * widest * (c.base_num_decoder_layers + c.mtp_num_layers + 1.0L) *
                                  (std::max<int64_t>(c.num_experts, 1) + std::max<int64_t>(c.shared_experts, 0) + 1.0L) +
                              2.0L * c.vocab_size * c.base_emb_dim;
    require(bound < 1e17L, "the model's dimensions allow over 1e17 parameters (base_emb_dim, base_mlp_dim, base_moe_mlp_dim, "
                           "vocab_size, heads x head_dim, base_num_decoder_layers, num_experts): check them for a typo");
  }
  require(c.mtp_loss_scaling_factor >= 0, bad_value("mtp_loss_scaling_factor", "must be >= 0"));
  require(c.steps != -1 || c.learning_rate_schedule_steps != -1,
          "steps and learning_rate_schedule_steps are both unset (-1): set at least one");
  if (c.steps > 0 && c.learning_rate_schedule_steps > 0)
    require(c.learning_rate_schedule_steps >= c.steps,
            "learning_rate_schedule_steps (" + std::to_string(c.learning_rate_schedule_steps) +
                ") must be >= steps (" + std::to_string(c.steps) + ")");
  require(c.steps == -1 || c.steps > 0, bad_value("steps", "must be > 0, or -1 for learning_rate_schedule_steps"));
  require(c.learning_rate_schedule_steps == -1 || c.learning_rate_schedule_steps > 0,
          bad_value("learning_rate_schedule_steps", "must be > 0, or -1 for steps"));
  return errors;
}

}  // namespace

void config_derive_and_validate(Config& c) {
  if (c.data_parallel_sharding == "no_shard") c.data_parallel_sharding = "none";  // Megatron's spelling
  const auto errors = validation_errors(c);
  if (!errors.empty()) {
    std::string message = "invalid config:";
    for (const auto& e : errors) message += "\n  - " + e;
    throw config_error(message);
  }
  // One source of truth for the sharding level; the old boolean is kept equal to it so that a
  // printed config reloads to the same one.
  if (c.shard_optimizer_over_data && c.data_parallel_sharding == "none") c.data_parallel_sharding = "optim";
  c.shard_optimizer_over_data = c.data_parallel_sharding == "optim";
  if (c.steps == -1) c.steps = c.learning_rate_schedule_steps;
  if (c.learning_rate_schedule_steps == -1) c.learning_rate_schedule_steps = c.steps;
  if (c.data_parallel_size < 1) c.data_parallel_size = 1;  // set from the launcher by config_load
  // The data index counts samples (and their tokens) in int64: a run whose sample counts do not
  // fit is refused here, before anything multiplies them (steps=1e18 with a global batch of 16
  // wrapped to a negative count).
  const auto product = [](std::initializer_list<int64_t> factors) -> std::optional<int64_t> {
    int64_t out = 1;
    for (int64_t f : factors)
      if (__builtin_mul_overflow(out, f, &out)) return std::nullopt;
    return out;
  };
  const auto batch = product({c.per_device_batch_size, c.data_parallel_size, c.gradient_accumulation_steps});
  const auto samples = batch ? product({c.steps, *batch, c.max_target_length + 1}) : std::nullopt;
  if (!samples)
    throw config_error("steps=" + std::to_string(c.steps) + " x global_batch_size (per_device_batch_size=" +
                       std::to_string(c.per_device_batch_size) + " x " + std::to_string(c.data_parallel_size) +
                       " ranks x gradient_accumulation_steps=" + std::to_string(c.gradient_accumulation_steps) +
                       ") x (max_target_length + 1) tokens does not fit in 64 bits: lower steps");
  if (c.eval_interval > 0 && !product({c.steps / c.eval_interval + 1, c.eval_steps, *batch, c.max_target_length + 1}))
    throw config_error("(steps / eval_interval + 1) x eval_steps=" + std::to_string(c.eval_steps) +
                       " x global_batch_size x (max_target_length + 1) evaluation tokens do not fit in 64 bits: "
                       "lower eval_steps or raise eval_interval");
  if ((c.eval_interval > 0 || c.skip_train) && !product({c.eval_steps, *batch, c.max_target_length + 1}))  // the test split's, skip_train's
    throw config_error("eval_steps=" + std::to_string(c.eval_steps) +
                       " x global_batch_size x (max_target_length + 1) evaluation tokens do not fit in 64 bits: lower eval_steps");
  c.global_batch_size = *batch;
  // One directory below base_output_directory: "..", "." or a path would write a run's files into
  // the folder shared by all runs, or anywhere.
  if (c.run_name == "." || c.run_name == ".." || c.run_name.find('/') != std::string::npos)
    throw config_error("config key 'run_name': '" + c.run_name +
                       "' must name one directory below base_output_directory (no '/', not '.' or '..')");
  if (c.run_name.empty()) {
    // A new run each time: a second run started within the same second took the first one's
    // directory (and moved its metrics aside as an earlier run's). Under a launcher every rank
    // adopts rank 0's name.
    const std::string stamped = c.model_name + "_" + timestamp();
    c.run_name = stamped;
    c.run_name_stem = stamped;  // claimed when training starts (run_dir_claim_generated)
    std::error_code unsearchable;  // the run directory's own checks name the problem later
    for (int n = 1; fs::exists(fs::path(c.base_output_directory) / c.run_name, unsearchable); ++n)
      c.run_name = stamped + "_" + std::to_string(n);
  }
  c.run_dir = (fs::path(c.base_output_directory) / c.run_name).string();
  if (c.metrics_file.empty()) c.metrics_file = (fs::path(c.run_dir) / "metrics.jsonl").string();
  // The run's own files: a metrics file there would move config.yml aside as "an earlier run's
  // lines", or sit among the checkpoints or event files.
  const fs::path metrics = fs::absolute(c.metrics_file).lexically_normal(), run = fs::absolute(c.run_dir).lexically_normal();
  for (const char* own : {"config.yml", ".lock", "checkpoints", "tensorboard"}) {
    const fs::path reserved = run / own;
    const auto [end, at] = std::mismatch(reserved.begin(), reserved.end(), metrics.begin(), metrics.end());
    if (end == reserved.end())
      throw config_error("metrics_file " + c.metrics_file + " is " + (at == metrics.end() ? "" : "inside ") +
                         "the run's own " + own + " (" + reserved.string() + "): name another file");
  }
  // "DIR/" names a directory (the run created DIR, then failed opening it as the file).
  if (c.metrics_file.back() == '/' || fs::path(c.metrics_file).filename() == "." || fs::path(c.metrics_file).filename() == "..")
    throw config_error("metrics_file " + c.metrics_file + " names a directory, not a file");
}

int64_t config_eval_samples(const Config& c, int64_t steps) {
  return (steps / std::max<int64_t>(c.eval_interval, 1) + 1) * c.eval_steps * c.global_batch_size;
}

Config config_load(const std::string& path, const std::vector<std::string>& overrides,
                   const std::vector<std::string>& environment) {
  const fs::path config_path(path);
  RawLayer merged = load_file_layer(config_path);
  const RawLayer cli = parse_cli_overrides(overrides);
  const RawLayer env = parse_environment(environment);

  auto latest = [&](const std::string& key) -> const RawValue* {
    if (auto it = env.find(key); it != env.end()) return &it->second;
    if (auto it = cli.find(key); it != cli.end()) return &it->second;
    if (auto it = merged.find(key); it != merged.end()) return &it->second;
    return nullptr;
  };

  // The model file is chosen by the final model_name, from whichever layer set it last.
  const RawValue* model_name_value = latest("model_name");
  Config scratch;
  if (model_name_value) find_key("model_name")->assign(scratch, model_name_value->node, model_name_value->source);
  const fs::path models_dir = config_path.parent_path() / "models";
  RawLayer model_layer;
  std::map<std::string, std::string> hf_fields;  // model key -> the config.json field it comes from
  std::string hf_source;                          // that config.json
  if (scratch.model_name == "hf") {
    // The model is the one a Hugging Face directory describes (hf_config.h); its weights are
    // read from the same directory when training starts.
    const RawValue* weights = latest("load_parameters_path");
    if (weights) find_key("load_parameters_path")->assign(scratch, weights->node, weights->source);
    if (scratch.load_parameters_path.empty())
      throw config_error("model_name: hf reads the model from load_parameters_path/config.json: set "
                         "load_parameters_path to a Hugging Face model directory");
    hf_source = (fs::path(scratch.load_parameters_path) / "config.json").string();
    for (const auto& entry : hf_config_model_keys(scratch.load_parameters_path)) {
      model_layer[entry.key] = {parse_scalar_text(entry.key, entry.text, hf_source), hf_source};
      hf_fields[entry.key] = entry.field;
    }
  } else if (!scratch.model_name.empty()) {
    const fs::path model_path = models_dir / (scratch.model_name + ".yml");
    if (!fs::exists(model_path)) {
      std::string known;
      if (fs::is_directory(models_dir))
        for (const auto& entry : fs::directory_iterator(models_dir))
          if (entry.path().extension() == ".yml")
            known += (known.empty() ? "" : ", ") + entry.path().stem().string();
      throw config_error("config key 'model_name': no model file " + model_path.string() +
                         " (known models: " + known + "; hf: the model of the Hugging Face directory load_parameters_path)");
    }
    model_layer = load_file_layer(model_path);
    // Run choices, not the model's: override_model_config there would not allow overrides (it is
    // read from the base, the command line and the environment), and the file's model_name is not
    // the one that chose it.
    for (const char* run_key : {"override_model_config", "model_name"})
      if (model_layer.count(run_key))
        throw config_error("config key '" + std::string(run_key) + "' in the model file " + model_layer[run_key].source +
                           ": it belongs to the run (base config, command line or environment), not to a model file");
  }

  const RawValue* override_value = latest("override_model_config");
  bool override_model = false;
  if (override_value) {
    find_key("override_model_config")->assign(scratch, override_value->node, override_value->source);
    override_model = scratch.override_model_config;
  }
  if (!override_model) {
    for (const RawLayer* layer : std::initializer_list<const RawLayer*>{&cli, &env}) {
      for (const auto& [key, value] : *layer) {
        auto it = model_layer.find(key);
        if (it == model_layer.end()) continue;
        if (canonical(key, value) != canonical(key, it->second))
          throw config_error("config key '" + key + "' is set by the model file " +
                             it->second.source + " (" + node_text(it->second.node) +
                             ") and differently by " + value.source + " (" + node_text(value.node) +
                             "); pass override_model_config=true to allow this");
      }
    }
  }

  for (const RawLayer* layer : std::initializer_list<const RawLayer*>{&model_layer, &cli, &env})
    for (const auto& [key, value] : *layer) merged[key] = value;

  Config config;
  for (const auto& key : key_registry()) {
    auto it = merged.find(key.name);
    if (it == merged.end())
      throw config_error("config key '" + key.name + "' has no value: " + path +
                         " (or its base_config) must define every key; see configs/base.yml");
    key.assign(config, it->second.node, it->second.source);
  }
  config.config_dir = config_path.parent_path().string();
  config.data_parallel_size = dist_env_resolve(environment).world_size;
  try {
    config_derive_and_validate(config);
  } catch (const Error& e) {
    // A model key from config.json is named by its trainer key in the checks: say which field of
    // the file it is (only for keys whose value is still the file's, not a command-line override).
    const std::string message = e.what();
    const auto mentions = [&](const std::string& key) {  // as a whole word: num_experts is not num_experts_per_tok
      const auto word = [](char ch) { return std::isalnum(static_cast<unsigned char>(ch)) || ch == '_'; };
      for (size_t at = message.find(key); at != std::string::npos; at = message.find(key, at + 1))
        if ((at == 0 || !word(message[at - 1])) && (at + key.size() == message.size() || !word(message[at + key.size()])))
          return true;
      return false;
    };
    std::string fields;
    for (const auto& [key, field] : hf_fields)
      if (merged.at(key).source == hf_source && mentions(key))
        fields += (fields.empty() ? "" : ", ") + key + " is field '" + field + "'";
    if (fields.empty()) throw;
    throw Error(e.exit_code(), message + "\n  (model_name=hf, from " + hf_source + ": " + fields + ")");
  }
  return config;
}

Config config_load(const std::string& path, const std::vector<std::string>& overrides) {
  std::vector<std::string> environment;
  for (char** e = environ; e && *e; ++e) environment.emplace_back(*e);
  return config_load(path, overrides, environment);
}

std::string config_to_yaml(const Config& config) {
  std::string out = "# resolved trainer config\n";
  for (const auto& key : key_registry()) out += key.name + ": " + key.format(config) + "\n";
  out += "# derived\n";
  out += "# data_parallel_size: " + std::to_string(config.data_parallel_size) + "\n";
  out += "# global_batch_size: " + std::to_string(config.global_batch_size) + "\n";
  out += "# run_dir: " + config_detail::yaml_double_quoted(config.run_dir) + "\n";  // one line, whatever run_name holds
  return out;
}

std::string config_value_canonical(const std::string& key, const std::string& text) {
  const config_detail::KeyInfo* info = find_key(key);
  if (info == nullptr) return text;
  try {
    Config scratch;
    info->assign(scratch, YAML::Load(text), "a checkpoint's config.yml");
    return info->format(scratch);
  } catch (const std::exception&) {
    return text;
  }
}

double config_rope_attention_factor(const Config& c) {
  if (c.rope_type != "yarn" || !c.rope_attention_scaling || c.rope_factor <= 1) return 1.0;
  return 0.1 * std::log(c.rope_factor) + 1.0;
}

int64_t config_shard_degree(const Config& config) {
  return config.data_parallel_shard_degree == -1 ? config.data_parallel_size : config.data_parallel_shard_degree;
}

void config_check_layout(const Config& c, int64_t world_size) {
  const int64_t N = c.expert_parallelism, R = world_size;
  if (R % N != 0)
    throw config_error("expert_parallelism=" + std::to_string(N) + " must divide the number of ranks (" + std::to_string(R) + ")");
  if (c.data_parallel_sharding != "optim_grads" && c.data_parallel_sharding != "optim_grads_params") return;
  const int64_t D = c.data_parallel_shard_degree == -1 ? R : c.data_parallel_shard_degree;
  if (R % D != 0)
    throw config_error("data_parallel_shard_degree=" + std::to_string(D) + " must divide the number of ranks (" +
                       std::to_string(R) + ")");
  if (D < R && N > 1 && D % N != 0)
    throw config_error("expert_parallelism=" + std::to_string(N) + " must divide data_parallel_shard_degree=" +
                       std::to_string(D) + " (HSDP): each sharding group must hold whole expert-parallel groups");
}

}  // namespace trainer
