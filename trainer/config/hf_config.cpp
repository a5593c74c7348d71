// Hugging Face config.json <-> model keys (see hf_config.h). The field names and defaults are
// those of transformers' LlamaConfig, Qwen3Config, Qwen3MoeConfig and DeepseekV3Config and of
// inclusionAI's BailingMoeV2Config (Ling-V2 models/configuration_bailing_moe_v2.py); the
// semantics behind each mapping are in docs/checkpoints.md.
#include "trainer/config/hf_config.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>

#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include "trainer/config/keys.h"
#include "trainer/util/error.h"
#include "trainer/util/json_integer.h"

namespace trainer {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kLlama = "LlamaForCausalLM", kQwen3 = "Qwen3ForCausalLM", kQwen3Moe = "Qwen3MoeForCausalLM",
                  kBailing = "BailingMoeV2ForCausalLM", kDeepseekV3 = "DeepseekV3ForCausalLM";

// One translated key: our key, its YAML text, the config.json field it came from, and whether a
// difference changes the shapes of the weights (an error) or only what they compute (a warning).
struct Translated {
  std::string key, text, field;
  bool shapes;
};

class ConfigJson {
 public:
  explicit ConfigJson(const std::string& dir) : path_((fs::path(dir) / "config.json").string()) {
    if (!fs::is_regular_file(path_))
      throw config_error("no config.json in " + dir + " (a Hugging Face model directory has one)");
    std::ifstream in(path_);
    if (!in) throw config_error("cannot read " + path_ + ": " + std::strerror(errno));
    try {
      root_ = json::parse(in);
    } catch (const json::exception& e) {
      throw config_error("cannot parse " + path_ + ": " + e.what());
    }
    if (!root_.is_object()) throw config_error(path_ + " is not a JSON object");
  }
  const std::string& path() const { return path_; }
  bool has(const std::string& field) const { return root_.contains(field) && !root_[field].is_null(); }
  bool present(const std::string& field) const { return root_.contains(field); }  // null included
  [[noreturn]] void fail(const std::string& field, const std::string& why) const {
    throw config_error(path_ + ": field '" + field + "' " + why);
  }
  int64_t integer(const std::string& field, std::optional<int64_t> fallback = std::nullopt) const {
    if (has(field) && root_[field].is_number_integer() && !json_is_int64(root_[field]))
      fail(field, "is " + root_[field].dump() + ", beyond the 64-bit integer range");
    return typed(field, fallback, &json::is_number_integer, "an integer");
  }
  double number(const std::string& field, std::optional<double> fallback = std::nullopt) const {
    return typed(field, fallback, &json::is_number, "a number");
  }
  bool boolean(const std::string& field, bool fallback) const {
    if (!has(field)) return fallback;
    const json& v = root_[field];
    if (!v.is_boolean()) fail(field, "must be true or false, not " + v.dump());
    return v.get<bool>();
  }
  std::string text(const std::string& field, const std::string& fallback) const {
    if (!has(field)) return fallback;
    const json& v = root_[field];
    if (!v.is_string()) fail(field, "must be a string, not " + v.dump());
    return v.get<std::string>();
  }
  std::string architecture() const {
    if (!root_.contains("architectures") || !root_["architectures"].is_array() || root_["architectures"].empty() ||
        !root_["architectures"][0].is_string())
      fail("architectures", "must list the model class, e.g. [\"LlamaForCausalLM\"]");
    const auto name = root_["architectures"][0].get<std::string>();
    if (name != kLlama && name != kQwen3 && name != kQwen3Moe && name != kBailing && name != kDeepseekV3)
      fail("architectures", "names " + name + "; the trainer reads " + kLlama + ", " + kQwen3 + ", " + kQwen3Moe + ", " +
                                kBailing + " and " + kDeepseekV3);
    return name;
  }
  // A feature the trainer does not implement must be off (absent, null, false, or `off`).
  void require_off(const std::string& field, const std::string& what) const {
    if (!has(field)) return;
    const json& v = root_[field];
    if ((v.is_boolean() && !v.get<bool>()) || (v.is_object() && v.empty())) return;
    fail(field, "is " + v.dump() + ": " + what + " is not implemented by the trainer");
  }
  json root_;

 private:
  // The field as T, or `fallback` when it is absent or null (without one: an error).
  template <class T>
  T typed(const std::string& field, std::optional<T> fallback, bool (json::*is_kind)() const noexcept,
          const std::string& kind) const {
    if (!has(field)) {
      if (fallback) return *fallback;
      fail(field, "is missing");
    }
    const json& v = root_[field];
    if (!(v.*is_kind)()) fail(field, "must be " + kind + ", not " + v.dump());
    return v.get<T>();
  }
  std::string path_;
};

// What translate_* functions write: add(key, text, field, shapes) and add_int(key, field[, fallback]),
// the key's text read from the field as an integer (a shape).
struct TranslatedAdd {
  std::vector<Translated>& out;
  void operator()(const std::string& key, const std::string& text, const std::string& field, bool shapes) const {
    out.push_back({key, text, field, shapes});
  }
};
struct TranslatedAddInt {
  const ConfigJson& f;
  const TranslatedAdd& add;
  void operator()(const std::string& key, const std::string& field, std::optional<int64_t> fallback = std::nullopt) const {
    add(key, std::to_string(f.integer(field, fallback)), field, true);
  }
};

// The shortest text that reads back as v (1e-05, not 1.0000000000000001e-05).
std::string number_text(double v) {
  char buffer[64];
  for (int digits = 15; digits <= 17; ++digits) {
    std::snprintf(buffer, sizeof buffer, "%.*g", digits, v);
    if (std::strtod(buffer, nullptr) == v) break;
  }
  std::string s = buffer;
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";  // stays a float in YAML
  return s;
}

// RoPE's settings: the top-level rope_theta / partial_rotary_factor / rope_scaling of
// transformers 4, or transformers 5's rope_parameters {rope_type, rope_theta, ...} (which it writes
// instead: read as 4's fields, theta silently defaulted to 10000 and its scaling went unseen).
// Implemented: the unscaled ("default") rotation, Llama 3.1's "llama3" frequency scaling and YaRN.
struct Llama3Scaling {
  double factor, low_freq_factor, high_freq_factor;
  int64_t original_max_position_embeddings;
};
struct RopeFields {
  std::optional<double> theta, partial;
  std::optional<Llama3Scaling> llama3;
  std::optional<nlohmann::json> yarn;  // the YaRN object as written (read by translate_yarn)
  std::string scaling_field;           // where the scaling was: rope_scaling or rope_parameters
};
RopeFields rope_fields(const ConfigJson& f) {
  RopeFields fields;
  // The scaling object's type: "default" (no scaling) or "llama3", whose four fields are then
  // required (transformers validates them too); `also` lists the fields that object may carry besides.
  const auto read_scaling = [&](const std::string& field, const nlohmann::json& scaling,
                                const std::vector<std::string>& also) {
    const char* type_field = scaling.contains("rope_type") ? "rope_type" : scaling.contains("type") ? "type" : nullptr;
    if (type_field == nullptr) f.fail(field, "has no rope_type: " + scaling.dump());
    const nlohmann::json& type = scaling[type_field];
    const bool llama3 = type.is_string() && type.get<std::string>() == "llama3";
    const bool yarn = type.is_string() && type.get<std::string>() == "yarn";
    if (!llama3 && !yarn && !(type.is_string() && type.get<std::string>() == "default"))
      f.fail(field, "has rope_type " + type.dump() + ": the trainer implements \"default\", \"llama3\" and \"yarn\" RoPE");
    std::vector<std::string> known = also;
    known.insert(known.end(), {"rope_type", "type"});
    if (llama3) known.insert(known.end(), {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"});
    if (yarn)
      known.insert(known.end(), {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
                                 "mscale_all_dim", "attention_factor", "truncate"});
    for (const auto& [name, value] : scaling.items())
      if (std::find(known.begin(), known.end(), name) == known.end())
        f.fail(field, "has \"" + name + "\", which the trainer does not implement with rope_type " + type.dump());
    if (llama3 || yarn) fields.scaling_field = field;
    if (yarn) fields.yarn = scaling;
    if (!llama3) return;
    const auto number = [&](const char* name) {
      if (!scaling.contains(name) || !scaling[name].is_number())
        f.fail(field, std::string("needs a number \"") + name + "\" with rope_type \"llama3\" (has " +
                          (scaling.contains(name) ? scaling[name].dump() : "none") + ")");
      return scaling[name].get<double>();
    };
    const double original = number("original_max_position_embeddings");
    if (original != std::floor(original) || original < 1)
      f.fail(field, "has original_max_position_embeddings " + scaling["original_max_position_embeddings"].dump() +
                        ", not a positive integer");
    fields.llama3 = Llama3Scaling{number("factor"), number("low_freq_factor"), number("high_freq_factor"),
                                  static_cast<int64_t>(original)};
  };
  if (f.has("rope_scaling")) {
    const nlohmann::json& scaling = f.root_["rope_scaling"];
    if (scaling.is_object() && !scaling.empty())
      read_scaling("rope_scaling", scaling, {});
    else
      f.require_off("rope_scaling", "RoPE scaling");
  }
  if (f.has("rope_theta")) fields.theta = f.number("rope_theta");
  if (f.has("partial_rotary_factor")) fields.partial = f.number("partial_rotary_factor");
  if (!f.has("rope_parameters")) return fields;
  const nlohmann::json& parameters = f.root_["rope_parameters"];
  if (!parameters.is_object()) f.fail("rope_parameters", "must be an object, not " + parameters.dump());
  if (parameters.contains("rope_type") || parameters.contains("type")) {
    // transformers 5 takes `rope_scaling or rope_parameters`, 4 knows rope_scaling only: a type in
    // both is ambiguous, even {"rope_type": "default"} beside a scaling.
    if (f.has("rope_scaling") && f.root_["rope_scaling"].is_object() && !f.root_["rope_scaling"].empty())
      f.fail("rope_parameters", "and rope_scaling both name a rope_type: which one holds?");
    read_scaling("rope_parameters", parameters, {"rope_theta", "partial_rotary_factor"});
  }
  for (const char* name : {"rope_theta", "partial_rotary_factor"}) {
    if (!parameters.contains(name)) continue;
    const nlohmann::json& value = parameters[name];
    if (!value.is_number()) f.fail("rope_parameters", std::string("has ") + name + " " + value.dump() + ", not a number");
    auto& field = std::string(name) == "rope_theta" ? fields.theta : fields.partial;
    if (field && *field != value.get<double>())
      f.fail("rope_parameters", std::string("has ") + name + " " + value.dump() + ", but the top-level " + name + " is " +
                                    number_text(*field) + ": which one holds?");
    field = value.get<double>();
  }
  if (!parameters.contains("rope_type") && !parameters.contains("type"))
    for (const auto& [name, value] : parameters.items())
      if (name != "rope_theta" && name != "partial_rotary_factor")
        f.fail("rope_parameters", "has \"" + name + "\", which the trainer does not implement (it reads rope_type "
                                  "\"default\", \"llama3\" or \"yarn\", rope_theta and partial_rotary_factor)");
  return fields;
}

// The routed experts (field `experts_field`, at least `minimum`) and top-k of a MoE config.json,
// each defaulted as its config class does, added as num_experts / num_experts_per_tok.
int64_t translate_expert_counts(const ConfigJson& f, const std::string& experts_field, int64_t default_experts,
                                int64_t minimum, std::vector<Translated>& out) {
  const int64_t experts = f.integer(experts_field, default_experts), top_k = f.integer("num_experts_per_tok", 8);
  if (experts < minimum)
    f.fail(experts_field, "must be >= " + std::to_string(minimum) + ", not " + std::to_string(experts) +
                              (minimum > 1 ? " (a model of one expert is dense)" : ""));
  if (top_k < 1 || top_k > experts)
    f.fail("num_experts_per_tok",
           "must be in [1, " + experts_field + " " + std::to_string(experts) + "], not " + std::to_string(top_k));
  out.push_back({"num_experts", std::to_string(experts), experts_field, true});
  out.push_back({"num_experts_per_tok", std::to_string(top_k), "num_experts_per_tok", false});
  return experts;
}

// Group-limited routing as BailingMoeV2Gate and DeepseekV3MoE do it (a group scores the sum of its
// best 2 biased scores, n_group groups, the best topk_group kept); one group, or every group kept,
// is plain top-k (-1 here).
void translate_routing_groups(const ConfigJson& f, int64_t experts, std::vector<Translated>& out) {
  const int64_t groups = f.integer("n_group", 8), kept = f.integer("topk_group", 4);
  if (groups < 1 || experts % groups != 0 || experts / groups < 2 || kept < 1 || kept > groups)
    f.fail("n_group", "(" + std::to_string(groups) + ", topk_group " + std::to_string(kept) + ") must divide the " +
                          std::to_string(experts) + " experts into groups of at least 2 and keep 1..n_group of them");
  const bool off = groups == 1 || kept == groups;
  out.push_back({"n_routing_groups", off ? "-1" : std::to_string(groups), "n_group", false});
  out.push_back({"topk_routing_group", off ? "-1" : std::to_string(kept), "topk_group", false});
}

// YaRN as transformers applies it (modeling_rope_utils' _compute_yarn_parameters; for
// DeepseekV3 also DeepseekV3Attention), against the trainer's (docs/model.md):
//   frequencies: blended with f / factor' over the correction range of beta_fast / beta_slow at
//     the original context (floored / ceiled unless `truncate` is false), factor' =
//     max_position_embeddings / original_max_position_embeddings where the object names the
//     original (transformers 4.5x overrides `factor` so; 5 keeps `factor` and warns);
//   cos and sin times attention_factor, which defaults to mscale(factor', mscale) /
//     mscale(factor', mscale_all_dim) with both nonzero, else mscale(factor') = 0.1 ln factor' + 1;
//   DeepseekV3 only: the softmax scale times mscale(factor, mscale_all_dim)^2 when mscale_all_dim != 0.
// The trainer blends by rope_factor (rope_truncate the same switch), scales cos and sin by
// 0.1 ln rope_factor + 1 with rope_attention_scaling (else 1), and MLA's softmax by
// (0.1 mscale ln rope_factor + 1)^2 when max_position_embeddings > original. So it reads the same
// when factor = max / original > 1 and the attention factor is 1 or 0.1 ln factor + 1; for MLA,
// mscale_all_dim -> mscale (0: no softmax scaling, as there). Anything else is refused by name.
void translate_yarn(const ConfigJson& f, const nlohmann::json& yarn, const std::string& field, int64_t context, bool mla,
                    std::vector<Translated>& out) {
  auto add = [&](const std::string& key, const std::string& text) { out.push_back({key, text, field, false}); };
  const auto given = [&](const char* name) { return yarn.contains(name) && !yarn[name].is_null(); };
  const auto number = [&](const char* name, std::optional<double> fallback) {
    if (!given(name)) {
      if (fallback) return *fallback;
      f.fail(field, std::string("needs \"") + name + "\" with rope_type \"yarn\" (the trainer's YaRN reads it)");
    }
    if (!yarn[name].is_number()) f.fail(field, std::string("has ") + name + " " + yarn[name].dump() + ", not a number");
    return yarn[name].get<double>();
  };
  const double factor = number("factor", std::nullopt), original = number("original_max_position_embeddings", std::nullopt);
  if (original != std::floor(original) || original < 1)
    f.fail(field, "has original_max_position_embeddings " + number_text(original) + ", not a positive integer");
  if (factor <= 1 || factor * original != static_cast<double>(context))
    f.fail(field, "has factor " + number_text(factor) + " and original_max_position_embeddings " +
                      std::to_string(static_cast<int64_t>(original)) +
                      ", but max_position_embeddings is " + std::to_string(context) +
                      ": transformers stretches by max / original, the trainer by factor; they must agree, and exceed 1");
  // Python's `mscale and mscale_all_dim`: both present and nonzero.
  const double mscale = number("mscale", 0.0), mscale_all_dim = number("mscale_all_dim", 0.0);
  const auto get_mscale = [&](double m) { return 0.1 * m * std::log(factor) + 1.0; };
  const double attention_factor = given("attention_factor")   ? number("attention_factor", std::nullopt)
                                  : mscale != 0 && mscale_all_dim != 0 ? get_mscale(mscale) / get_mscale(mscale_all_dim)
                                                                       : get_mscale(1.0);
  const double scaled = get_mscale(1.0);
  const bool scaling = std::abs(attention_factor - scaled) <= 1e-12 * scaled;
  if (!scaling && attention_factor != 1.0)
    f.fail(field, "gives an attention factor of " + number_text(attention_factor) +
                      (given("attention_factor") ? "" : " (mscale / mscale_all_dim)") +
                      " on cos and sin: the trainer scales them by 1 or by 0.1 ln(factor) + 1 = " + number_text(scaled) +
                      " (rope_attention_scaling)");
  // Python's truthiness again: a null truncate is false.
  bool truncate = true;
  if (yarn.contains("truncate")) {
    if (!yarn["truncate"].is_null() && !yarn["truncate"].is_boolean())
      f.fail(field, "has truncate " + yarn["truncate"].dump() + ", not true or false");
    truncate = yarn["truncate"].is_boolean() && yarn["truncate"].get<bool>();
  }
  // `or` in transformers: a 0 or null beta takes the default.
  const double beta_fast = number("beta_fast", 32.0), beta_slow = number("beta_slow", 1.0);
  add("rope_type", "yarn");
  add("rope_factor", number_text(factor));
  add("original_max_position_embeddings", std::to_string(static_cast<int64_t>(original)));
  add("beta_fast", number_text(beta_fast == 0 ? 32.0 : beta_fast));
  add("beta_slow", number_text(beta_slow == 0 ? 1.0 : beta_slow));
  add("rope_truncate", truncate ? "true" : "false");
  add("rope_attention_scaling", scaling ? "true" : "false");
  if (mla) add("mscale", number_text(mscale_all_dim));
}

// DeepseekV3ForCausalLM (transformers' modeling_deepseek_v3.py; DeepSeek-V3, Kimi K2, Moonlight):
// MLA attention in every layer, the first first_k_dense_replace layers dense, then a MoE block of
// sigmoid scores, an always-applied e_score_correction_bias for selection, group-limited top-k
// (a group scores its best 2), weights renormalized with norm_topk_prob and scaled, and shared
// experts moe_intermediate_size * n_shared_experts wide. The defaults are DeepseekV3Config's.
void translate_deepseek_v3(const ConfigJson& f, const RopeFields& rope, std::vector<Translated>& out) {
  const TranslatedAdd add{out};
  const TranslatedAddInt add_int{f, add};
  // Its q_a_layernorm and kv_a_layernorm are built with RMSNorm's default eps 1e-6, whatever
  // rms_norm_eps says; the trainer's use normalization_layer_epsilon.
  if (const double eps = f.number("rms_norm_eps", 1e-6); eps != 1e-6)
    f.fail("rms_norm_eps", "is " + number_text(eps) + ": DeepseekV3's latent norms use 1e-6 whatever it says, and the "
                           "trainer's MLA norms take rms_norm_eps; only 1e-6 reads the same");
  if (rope.llama3) f.fail(rope.scaling_field, "is llama3's, which the trainer does not apply to MLA");
  if (f.has("moe_layer_freq") && f.integer("moe_layer_freq") != 1)
    f.fail("moe_layer_freq", "is " + f.root_["moe_layer_freq"].dump() + ": MoE layers at intervals are not implemented");
  if (f.has("scoring_func") && f.text("scoring_func", "sigmoid") != "sigmoid")
    f.fail("scoring_func", "is \"" + f.text("scoring_func", "") + "\": DeepseekV3ForCausalLM routes by sigmoid scores");
  if (f.has("topk_method") && f.text("topk_method", "noaux_tc") != "noaux_tc")
    f.fail("topk_method", "is \"" + f.text("topk_method", "") + "\": DeepseekV3ForCausalLM selects by noaux_tc");
  add("attention_type", "mla", "architectures", true);
  add("inhomogeneous_layer_cycle_interval", "0", "architectures", true);
  add("q_lora_rank", std::to_string(f.present("q_lora_rank") && !f.has("q_lora_rank") ? 0 : f.integer("q_lora_rank", 1536)),
      "q_lora_rank", true);
  add_int("kv_lora_rank", "kv_lora_rank", 512);
  add_int("qk_nope_head_dim", "qk_nope_head_dim", 128);
  add_int("qk_rope_head_dim", "qk_rope_head_dim", 64);
  add_int("v_head_dim", "v_head_dim", 128);
  // A null field is Python's None there, which `if config.rope_interleave:` / `if self.norm_topk_prob:` read as false.
  const auto truthy = [&](const std::string& field, bool fallback) {
    return !f.present(field) ? fallback : f.has(field) && f.boolean(field, false);
  };
  add("mla_interleaved_rope", truthy("rope_interleave", true) ? "true" : "false", "rope_interleave", false);
  const int64_t context = f.integer("max_position_embeddings", 4096);
  add("max_position_embeddings", std::to_string(context), "max_position_embeddings", false);
  if (!rope.yarn) {
    // No scaling: no softmax mscale either, which the trainer applies when max > original.
    add("rope_type", "default", "rope_scaling", false);
    add("original_max_position_embeddings", std::to_string(context), "max_position_embeddings", false);
  } else {
    translate_yarn(f, *rope.yarn, rope.scaling_field, context, /*mla=*/true, out);
  }
  const int64_t experts = translate_expert_counts(f, "n_routed_experts", 256, 2, out);
  add_int("base_moe_mlp_dim", "moe_intermediate_size", 2048);
  add_int("shared_experts", "n_shared_experts", 1);
  add_int("first_num_dense_layers", "first_k_dense_replace", 3);
  add("routed_score_func", "sigmoid", "architectures", false);
  add("norm_topk_prob", truthy("norm_topk_prob", true) ? "true" : "false", "norm_topk_prob", false);
  add("routed_scaling_factor", number_text(f.number("routed_scaling_factor", 2.5)), "routed_scaling_factor", false);
  translate_routing_groups(f, experts, out);
  add("routed_bias", "true", "architectures", false);  // the selection always adds e_score_correction_bias
  // num_nextn_predict_layers: transformers builds no MTP layer and skips their tensors; so does the trainer.
}

std::vector<Translated> translate(const ConfigJson& f) {
  const std::string arch = f.architecture();
  const bool bailing = arch == kBailing;
  // transformers' ACT2FN maps both names to SiLU.
  if (const std::string act = f.text("hidden_act", "silu"); act != "silu" && act != "swish")
    f.fail("hidden_act", "is " + act + ": the trainer's MLP is SwiGLU (silu)");
  const RopeFields rope = rope_fields(f);
  f.require_off(bailing ? "use_qkv_bias" : "attention_bias", "a bias in the attention projections");
  f.require_off(bailing ? "use_bias" : "mlp_bias", "a bias in the projections");
  f.require_off("use_sliding_window", "sliding-window attention");
  // DeepSeek-V3's release is FP8 with per-block scales: dequantized weights are what loads.
  f.require_off("quantization_config", "reading quantized weights (dequantize them to BF16 or F32 first)");

  std::vector<Translated> out;
  const TranslatedAdd add{out};
  const TranslatedAddInt add_int{f, add};
  const int64_t heads = f.integer("num_attention_heads");
  if (heads <= 0) f.fail("num_attention_heads", "must be > 0, not " + std::to_string(heads));  // divides below
  add_int("vocab_size", "vocab_size");
  add_int("base_emb_dim", "hidden_size");
  add_int("base_num_query_heads", "num_attention_heads");
  // A field the file leaves out takes its config class's default, as from_pretrained does
  // (transformers' Qwen3Config, inclusionAI's BailingMoeV2Config; LlamaConfig derives both): kv
  // heads 32 (Qwen3) or 4 (Bailing), head_dim 128. Written as null it means the query heads, and
  // hidden / heads (a Bailing head_dim of 0 too).
  // Qwen3MoeConfig: kv heads 4, and no head_dim field of its own (hidden / heads when left out).
  // DeepseekV3Config: kv heads 128 (null: the query heads); its head_dim is qk_rope_head_dim, set
  // by the class (MLA has its own dims, read below).
  const bool qwen3 = arch == kQwen3, qwen3_moe = arch == kQwen3Moe, deepseek = arch == kDeepseekV3;
  const int64_t derived_head_dim = f.integer("hidden_size") / heads;
  add_int("base_num_kv_heads", "num_key_value_heads",
          f.present("num_key_value_heads") ? heads : bailing || qwen3_moe ? 4 : qwen3 ? 32 : deepseek ? 128 : heads);
  if (!deepseek) {
    const int64_t head_dim = f.integer("head_dim", f.present("head_dim") || !(bailing || qwen3) ? derived_head_dim : 128);
    add("head_dim", std::to_string(bailing && head_dim == 0 ? derived_head_dim : head_dim), "head_dim", true);
  }
  add_int("base_mlp_dim", "intermediate_size");
  add_int("base_num_decoder_layers", "num_hidden_layers");
  add("mlp_activations", "[silu, linear]", "hidden_act", false);
  add("normalization_layer_epsilon", number_text(f.number("rms_norm_eps", 1e-6)), "rms_norm_eps", false);
  add("rope_max_timescale", number_text(rope.theta.value_or(bailing ? 600000.0 : 10000.0)), "rope_theta", false);
  const double partial = rope.partial.value_or(1.0);
  if (!bailing && partial != 1.0)
    f.fail("partial_rotary_factor", "is " + number_text(partial) + ": " + arch + " rotates the whole head");
  add("partial_rotary_factor", number_text(partial), "partial_rotary_factor", false);
  const std::string& scaling_field = rope.scaling_field;
  // The context the model serves, left out: the config class's default (LlamaConfig's 2048,
  // Qwen3Config's, Qwen3MoeConfig's and BailingMoeV2Config's 32768).
  const int64_t context = f.integer("max_position_embeddings", arch == kLlama ? 2048 : 32768);
  if (rope.yarn && !deepseek) {
    translate_yarn(f, *rope.yarn, scaling_field, context, /*mla=*/false, out);
    add("max_position_embeddings", std::to_string(context), "max_position_embeddings", false);
  }
  if (!deepseek && !rope.yarn)
    add("rope_type", rope.llama3 ? "llama3" : "default", rope.llama3 ? scaling_field : "rope_scaling", false);
  if (rope.llama3) {
    add("rope_factor", number_text(rope.llama3->factor), scaling_field, false);
    add("rope_low_freq_factor", number_text(rope.llama3->low_freq_factor), scaling_field, false);
    add("rope_high_freq_factor", number_text(rope.llama3->high_freq_factor), scaling_field, false);
    add("original_max_position_embeddings", std::to_string(rope.llama3->original_max_position_embeddings), scaling_field, false);
    // Not used by the rotation, carried to an export's config.json.
    add("max_position_embeddings", std::to_string(context), "max_position_embeddings", false);
  }
  const bool qk_norm = qwen3 || qwen3_moe || (bailing && f.boolean("use_qk_norm", true));
  add("use_qk_norm", qk_norm ? "true" : "false", bailing ? "use_qk_norm" : "architectures", true);
  add("logits_via_embedding", f.boolean("tie_word_embeddings", false) ? "true" : "false", "tie_word_embeddings", true);
  if (deepseek) translate_deepseek_v3(f, rope, out);

  // BailingMoeV2Config's defaults where a field is left out: 256 experts, top-8 of 512-wide ones,
  // one shared expert, the first layer dense; a null num_experts is a dense model, a null
  // num_shared_experts none.
  const bool moe = bailing && (f.has("num_experts") || !f.present("num_experts"));
  if (moe) {
    // Named here: num_experts 0 used to surface as an n_group error.
    const int64_t experts = translate_expert_counts(f, "num_experts", 256, 1, out), top_k = f.integer("num_experts_per_tok", 8);
    add_int("base_moe_mlp_dim", "moe_intermediate_size", 512);
    add("shared_experts", std::to_string(f.integer("num_shared_experts", f.present("num_shared_experts") ? 0 : 1)),
        "num_shared_experts", true);
    add_int("first_num_dense_layers", "first_k_dense_replace", 1);
    // BailingMoeV2Gate applies sigmoid whatever score_function says; a file naming another function
    // was meant for other modeling code (or is wrong), and reading it as sigmoid would be silent.
    const std::string score = f.text("score_function", "sigmoid");
    if (score != "sigmoid")
      f.fail("score_function", "is \"" + score + "\": BailingMoeV2ForCausalLM's modeling code routes by sigmoid scores "
                               "whatever this field says; set it to \"sigmoid\" (or remove it) if the model was trained so");
    add("routed_score_func", "sigmoid", f.has("score_function") ? "score_function" : "architectures", false);
    // The Gate renormalizes the top-k weights only when k > 1 (a single weight stays the score).
    add("norm_topk_prob", top_k > 1 ? "true" : "false", "num_experts_per_tok", false);
    add("routed_scaling_factor", number_text(f.number("routed_scaling_factor", 1.0)), "routed_scaling_factor", false);
    translate_routing_groups(f, experts, out);  // BailingMoeV2Gate always routes by groups
    add("routed_bias", f.boolean("moe_router_enable_expert_bias", true) ? "true" : "false",
        "moe_router_enable_expert_bias", false);
  } else if (deepseek) {
    // MLA and MoE keys: translate_deepseek_v3.
  } else if (qwen3_moe) {
    // Qwen3MoeSparseMoeBlock: softmax over all experts in fp32, top-k, renormalized only with
    // norm_topk_prob (default false); no shared expert, no bias, no groups, no scaling.
    translate_expert_counts(f, "num_experts", 128, 2, out);
    if (const int64_t step = f.integer("decoder_sparse_step", 1); step != 1)
      f.fail("decoder_sparse_step", "is " + std::to_string(step) + ": MoE layers every " + std::to_string(step) +
                                        " layers are not implemented (the trainer's dense layers come first, then all MoE)");
    // mlp_only_layers: dense layers, which the trainer puts first: [0, k) only.
    int64_t dense = 0;
    if (f.has("mlp_only_layers")) {
      const json& layers = f.root_["mlp_only_layers"];
      if (!layers.is_array()) f.fail("mlp_only_layers", "must be a list of layer indices, not " + layers.dump());
      for (const auto& layer : layers)
        if (!layer.is_number_integer() || layer.get<int64_t>() != dense++)
          f.fail("mlp_only_layers", "is " + layers.dump() + ": the trainer's dense layers are the first k ([0, 1, ..., k-1])");
    }
    add_int("base_moe_mlp_dim", "moe_intermediate_size", 768);
    add("shared_experts", "0", "architectures", true);
    add("first_num_dense_layers", std::to_string(dense), "mlp_only_layers", true);
    add("routed_score_func", "softmax", "architectures", false);
    add("norm_topk_prob", f.boolean("norm_topk_prob", false) ? "true" : "false", "norm_topk_prob", false);
    add("routed_scaling_factor", "1.0", "architectures", false);
    add("n_routing_groups", "-1", "architectures", false);
    add("topk_routing_group", "-1", "architectures", false);
    add("routed_bias", "false", "architectures", false);
  } else {
    add("num_experts", "1", bailing ? "num_experts" : "architectures", true);
    add("first_num_dense_layers", "0", "architectures", true);
  }
  const int64_t mtp = bailing ? f.integer("num_nextn_predict_layers", 0) : 0;
  if (mtp > 0 && !moe) f.fail("num_nextn_predict_layers", "needs num_experts: the MTP block's MLP is a MoE block");
  add("mtp_num_layers", std::to_string(mtp), bailing ? "num_nextn_predict_layers" : "architectures", true);
  if (mtp > 0) {
    add("mtp_moe_mlp", "true", "num_nextn_predict_layers", true);
    add("mtp_input_after_final_norm", "true", "num_nextn_predict_layers", false);
    // A training coefficient, not part of the model: taken when the file sets one.
    const double factor = f.number("mtp_loss_scaling_factor", 0.0);
    if (factor < 0) f.fail("mtp_loss_scaling_factor", "must be >= 0, not " + number_text(factor));  // was ignored
    if (factor > 0) add("mtp_loss_scaling_factor", number_text(factor), "mtp_loss_scaling_factor", false);
  }
  return out;
}

const config_detail::KeyInfo& key_info(const std::string& key) {
  const auto* info = config_detail::find_key(key);
  if (!info) throw std::logic_error("hf_config: unknown key " + key);
  return *info;
}

}  // namespace

HfModelKeys hf_config_model_keys(const std::string& dir) {
  HfModelKeys keys;
  for (const auto& t : translate(ConfigJson(dir))) keys.push_back({t.key, t.text, t.field});
  return keys;
}

std::string hf_config_architecture(const std::string& dir) { return ConfigJson(dir).architecture(); }

std::string hf_architecture(const Config& c) {
  auto refuse = [](const std::string& why) {
    throw config_error("cannot write a Hugging Face checkpoint: " + why);
  };
  if (c.mlp_activations != StringList{"silu", "linear"})
    refuse("mlp_activations must be [silu, linear] (SwiGLU), as in every supported architecture");
  if (c.rope_type == "yarn" && !(c.rope_factor > 1 && c.rope_factor * static_cast<double>(c.original_max_position_embeddings) ==
                                                        static_cast<double>(c.max_position_embeddings)))
    refuse("rope_factor (" + number_text(c.rope_factor) + ") is not max_position_embeddings / original_max_position_embeddings (" +
           std::to_string(c.max_position_embeddings) + " / " + std::to_string(c.original_max_position_embeddings) +
           "), or not > 1; transformers' YaRN stretches by that ratio");
  if (c.attention_type == "mla" && c.inhomogeneous_layer_cycle_interval <= 1) {  // every layer MLA
    // DeepseekV3ForCausalLM: MLA in every layer, sigmoid-routed MoE after the dense layers.
    const auto deepseek_needs = [&](bool ok, const std::string& what) {
      if (!ok) refuse(what + "; DeepseekV3ForCausalLM (the architecture of MLA models) differs");
    };
    deepseek_needs(c.num_experts > 1, "num_experts is " + std::to_string(c.num_experts) + " (a dense MLA model)");
    deepseek_needs(c.routed_score_func == "sigmoid", "routed_score_func is " + c.routed_score_func);
    deepseek_needs(c.shared_experts > 0, "shared_experts is 0 (its MoE block always has a shared expert)");
    deepseek_needs(c.moe_shared_expert_dim == 0 || c.moe_shared_expert_dim == c.base_moe_mlp_dim,
                   "moe_shared_expert_dim (" + std::to_string(c.moe_shared_expert_dim) + ") is not base_moe_mlp_dim");
    deepseek_needs(c.n_routing_groups == -1 || c.num_experts / c.n_routing_groups >= 2,
                   "n_routing_groups leaves groups of one expert (a group scores its best 2)");
    deepseek_needs(c.normalization_layer_epsilon == 1e-6,
                   "normalization_layer_epsilon is " + number_text(c.normalization_layer_epsilon) +
                       " (its q_a_layernorm and kv_a_layernorm use 1e-6 whatever rms_norm_eps says)");
    if (c.rope_type != "yarn")
      deepseek_needs(c.max_position_embeddings <= c.original_max_position_embeddings,
                     "max_position_embeddings > original_max_position_embeddings turns the softmax mscale on without YaRN");
    deepseek_needs(c.mtp_num_layers == 0, "mtp_num_layers is " + std::to_string(c.mtp_num_layers) +
                                              " (transformers builds no MTP layer; export with --export-safetensors)");
    return kDeepseekV3;
  }
  if (c.attention_type != "global" || c.inhomogeneous_layer_cycle_interval > 1)
    refuse("attention_type=" + c.attention_type + " (inhomogeneous_layer_cycle_interval=" +
           std::to_string(c.inhomogeneous_layer_cycle_interval) +
           "): GLA layers and the GLA/MLA hybrid have no Hugging Face architecture here; export with --export-safetensors");
  if (c.num_experts > 1 && c.routed_score_func == "softmax") {
    // Qwen3MoeForCausalLM: softmax routing over every expert, the rest of the Ling machinery off.
    const auto qwen3_moe_needs = [&](bool ok, const std::string& what) {
      if (!ok) refuse(what + ", which Qwen3MoeForCausalLM (the architecture of softmax routing) has not (BailingMoeV2 routes by sigmoid)");
    };
    if (!c.use_qk_norm) refuse("use_qk_norm is false; Qwen3MoeForCausalLM (the architecture of softmax routing) normalizes q and k");
    qwen3_moe_needs(c.shared_experts == 0, "shared_experts is " + std::to_string(c.shared_experts));
    qwen3_moe_needs(!c.routed_bias, "routed_bias is true: an expert bias");
    qwen3_moe_needs(c.n_routing_groups == -1, "n_routing_groups is " + std::to_string(c.n_routing_groups) + ": group-limited routing");
    qwen3_moe_needs(c.routed_scaling_factor == 1.0, "routed_scaling_factor is " + number_text(c.routed_scaling_factor));
    qwen3_moe_needs(c.mtp_num_layers == 0, "mtp_num_layers is " + std::to_string(c.mtp_num_layers) + ": MTP layers");
    qwen3_moe_needs(c.partial_rotary_factor == 1.0,
                    "partial_rotary_factor is " + number_text(c.partial_rotary_factor) + ": partial RoPE");
    return kQwen3Moe;
  }
  if (c.num_experts > 1) {  // sigmoid scores: BailingMoeV2ForCausalLM
    if (c.shared_experts > 0 && c.moe_shared_expert_dim > 0 && c.moe_shared_expert_dim != c.base_moe_mlp_dim)
      refuse("moe_shared_expert_dim (" + std::to_string(c.moe_shared_expert_dim) +
             ") differs from base_moe_mlp_dim; BailingMoeV2's shared expert has the routed experts' width");
    if (c.norm_topk_prob != (c.num_experts_per_tok > 1))
      refuse(std::string("norm_topk_prob is ") + (c.norm_topk_prob ? "true" : "false") +
             "; BailingMoeV2ForCausalLM renormalizes the top-k weights exactly when num_experts_per_tok > 1");
    if (c.n_routing_groups != -1 && c.num_experts / c.n_routing_groups < 2)
      refuse("n_routing_groups leaves groups of one expert; BailingMoeV2's group score sums each group's best 2");
    if (c.mtp_num_layers > 0 && !(c.mtp_moe_mlp && c.mtp_input_after_final_norm))
      refuse("BailingMoeV2's MTP block is MoE and reads the hidden state after the final norm: "
             "set mtp_moe_mlp and mtp_input_after_final_norm to true");
    return kBailing;
  }
  if (c.partial_rotary_factor != 1.0)
    refuse("partial_rotary_factor is " + number_text(c.partial_rotary_factor) +
           "; LlamaForCausalLM and Qwen3ForCausalLM rotate the whole head (BailingMoeV2 needs routed experts)");
  if (c.mtp_num_layers > 0) refuse("mtp_num_layers > 0 needs routed experts (BailingMoeV2ForCausalLM)");
  return c.use_qk_norm ? kQwen3 : kLlama;
}

namespace {
// The MoE fields BailingMoeV2Config and DeepseekV3Config share by name (both always route by
// groups: -1 here is one group).
void write_group_routed_moe(nlohmann::json& j, const Config& c) {
  j["num_experts_per_tok"] = c.num_experts_per_tok;
  j["moe_intermediate_size"] = c.base_moe_mlp_dim;
  j["first_k_dense_replace"] = c.first_num_dense_layers;
  j["norm_topk_prob"] = c.norm_topk_prob;
  j["routed_scaling_factor"] = c.routed_scaling_factor;
  j["n_group"] = c.n_routing_groups == -1 ? 1 : c.n_routing_groups;
  j["topk_group"] = c.topk_routing_group == -1 ? 1 : c.topk_routing_group;
}
}  // namespace

std::string hf_config_json(const Config& c, const std::string& torch_dtype) {
  const std::string arch = hf_architecture(c);
  json j;
  j["architectures"] = {arch};
  j["model_type"] = arch == kLlama        ? "llama"
                    : arch == kQwen3      ? "qwen3"
                    : arch == kQwen3Moe   ? "qwen3_moe"
                    : arch == kDeepseekV3 ? "deepseek_v3"
                                          : "bailing_moe_v2";
  if (arch == kBailing) {
    // inclusionAI's modeling code is not part of transformers: copy configuration_bailing_moe_v2.py
    // and modeling_bailing_moe_v2.py next to this file and load with trust_remote_code=True.
    j["auto_map"] = {{"AutoConfig", "configuration_bailing_moe_v2.BailingMoeV2Config"},
                     {"AutoModel", "modeling_bailing_moe_v2.BailingMoeV2Model"},
                     {"AutoModelForCausalLM", "modeling_bailing_moe_v2.BailingMoeV2ForCausalLM"}};
  }
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.base_emb_dim;
  j["intermediate_size"] = c.base_mlp_dim;
  j["num_hidden_layers"] = c.base_num_decoder_layers;
  j["num_attention_heads"] = c.base_num_query_heads;
  j["num_key_value_heads"] = c.base_num_kv_heads;
  if (arch != kDeepseekV3) j["head_dim"] = c.head_dim;  // DeepseekV3Config sets its own (qk_rope_head_dim)
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = c.normalization_layer_epsilon;
  j["rope_theta"] = c.rope_max_timescale;
  if (c.rope_type == "yarn") {
    // The attention factor written out: transformers' default would come from factor' and the
    // mscale pair; the trainer's is 1 or 0.1 ln(factor) + 1 (translate_yarn).
    j["rope_scaling"] = {{"rope_type", "yarn"},
                         {"factor", c.rope_factor},
                         {"original_max_position_embeddings", c.original_max_position_embeddings},
                         {"beta_fast", c.beta_fast},
                         {"beta_slow", c.beta_slow},
                         {"attention_factor", config_rope_attention_factor(c)}};
    if (!c.rope_truncate) j["rope_scaling"]["truncate"] = false;  // true is the default everywhere
    j["max_position_embeddings"] = c.max_position_embeddings;  // = factor x original (hf_architecture)
  } else if (c.rope_type == "llama3") {
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", c.rope_factor},
                         {"low_freq_factor", c.rope_low_freq_factor},
                         {"high_freq_factor", c.rope_high_freq_factor},
                         {"original_max_position_embeddings", c.original_max_position_embeddings}};
    j["max_position_embeddings"] = std::max(c.max_position_embeddings, c.max_target_length);
  } else {
    j["rope_scaling"] = nullptr;
    j["max_position_embeddings"] = c.max_target_length;
  }
  j["tie_word_embeddings"] = c.logits_via_embedding;
  j["initializer_range"] = c.init_method_std;
  j["torch_dtype"] = torch_dtype;
  // Both written, null where the run has none: BailingMoeV2Config's defaults (156892) would
  // otherwise name a row past a smaller vocabulary, and its embedding's padding_idx then fails
  // to build in from_pretrained.
  j["eos_token_id"] = c.eod_id >= 0 && c.eod_id < c.vocab_size ? json(c.eod_id) : json(nullptr);
  j["pad_token_id"] = c.pad_id >= 0 && c.pad_id < c.vocab_size ? json(c.pad_id) : json(nullptr);
  if (arch == kBailing) {
    j["use_qkv_bias"] = false;
    j["use_bias"] = false;
    j["use_qk_norm"] = c.use_qk_norm;
    j["partial_rotary_factor"] = c.partial_rotary_factor;
    j["num_experts"] = c.num_experts;
    write_group_routed_moe(j, c);
    // 0, not null, for none: vLLM's BailingMoE builds its layers with `num_shared_experts > 0`
    // (None raises there) and SGLang's runs that test in every forward; the HF code's `is not
    // None` builds a zero-width shared MLP that adds exactly 0.
    j["num_shared_experts"] = c.shared_experts;
    j["score_function"] = "sigmoid";  // informational: the modeling code always routes by sigmoid
    j["moe_router_enable_expert_bias"] = c.routed_bias;
    // Not read by the HF modeling code, but by vLLM's and SGLang's BailingMoE, as the released
    // configs carry them: without use_rmsnorm vLLM builds the q/k norms as LayerNorm, without
    // router_dtype it routes in bf16, without norm_topk_prob (written above) it fails to load.
    j["use_rmsnorm"] = true;
    j["router_dtype"] = "fp32";
    j["num_nextn_predict_layers"] = c.mtp_num_layers;
    j["mtp_loss_scaling_factor"] = c.mtp_num_layers > 0 ? c.mtp_loss_scaling_factor : 0.0;
  } else {
    j["attention_bias"] = false;
    if (arch != kDeepseekV3) j["mlp_bias"] = false;  // DeepseekV3Config has no such field
    if (arch == kQwen3 || arch == kQwen3Moe) j["use_sliding_window"] = false;
  }
  if (arch == kDeepseekV3) {
    j["q_lora_rank"] = c.q_lora_rank > 0 ? json(c.q_lora_rank) : json(nullptr);
    j["kv_lora_rank"] = c.kv_lora_rank;
    j["qk_nope_head_dim"] = c.qk_nope_head_dim;
    j["qk_rope_head_dim"] = c.qk_rope_head_dim;
    j["v_head_dim"] = c.v_head_dim;
    j["rope_interleave"] = c.mla_interleaved_rope;
    j["max_position_embeddings"] = c.max_position_embeddings;
    if (c.rope_type == "yarn") {  // the softmax mscale from mscale_all_dim; mscale equal (their ratio 1)
      j["rope_scaling"]["mscale"] = c.mscale;
      j["rope_scaling"]["mscale_all_dim"] = c.mscale;
    }
    j["n_routed_experts"] = c.num_experts;
    j["n_shared_experts"] = c.shared_experts;
    write_group_routed_moe(j, c);
    // Read by DeepSeek's own modeling_deepseek.py and by vLLM / SGLang; transformers' ignores them.
    j["scoring_func"] = "sigmoid";
    j["topk_method"] = "noaux_tc";
    j["moe_layer_freq"] = 1;
    j["num_nextn_predict_layers"] = 0;
  }
  if (arch == kQwen3Moe) {
    j["num_experts"] = c.num_experts;
    j["num_experts_per_tok"] = c.num_experts_per_tok;
    j["moe_intermediate_size"] = c.base_moe_mlp_dim;
    j["norm_topk_prob"] = c.norm_topk_prob;
    j["decoder_sparse_step"] = 1;
    json dense = json::array();
    for (int64_t i = 0; i < c.first_num_dense_layers; ++i) dense.push_back(i);
    j["mlp_only_layers"] = dense;
  }
  return j.dump(2) + "\n";
}

HfConfigDifferences hf_config_compare(const Config& c, const std::string& dir) {
  const ConfigJson file(dir);
  HfConfigDifferences out;
  for (const auto& t : translate(file)) {
    const auto& info = key_info(t.key);
    Config theirs = c;
    info.assign(theirs, YAML::Load(t.text), file.path());
    const std::string want = info.format(theirs), have = info.format(c);
    if (want == have) continue;
    const std::string field = t.field == "architectures" ? "architectures (" + file.architecture() + ")" : t.field;
    const std::string what = field + " in " + file.path() + " means " + t.key + ": " + want + ", but the config has " +
                             t.key + ": " + have;
    if (t.shapes && out.first_shape_mismatch.empty()) out.first_shape_mismatch = what;
    if (!t.shapes) out.other.push_back(what);
  }
  // Training settings the trainer has no counterpart for: said, not silently dropped.
  for (const char* field : {"attention_dropout", "hidden_dropout"})
    if (file.has(field) && file.root_[field].is_number() && file.root_[field].get<double>() != 0)
      out.other.push_back(std::string(field) + " in " + file.path() + " is " + file.root_[field].dump() +
                          ", but the trainer has no dropout: it trains without");
  return out;
}

}  // namespace trainer
