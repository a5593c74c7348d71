// Hugging Face config.json <-> model keys, for the five architectures whose checkpoints the
// trainer reads and writes (docs/checkpoints.md "Hugging Face checkpoints"):
//   LlamaForCausalLM, Qwen3ForCausalLM (Llama + QK norm), Qwen3MoeForCausalLM (softmax-routed
//   experts), DeepseekV3ForCausalLM (MLA + sigmoid-routed experts), BailingMoeV2ForCausalLM (Ling 2.0).
// Plain C++ (no LibTorch); the tensor names are mapped in ckpt/hf_checkpoint.cpp.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "trainer/config/config.h"

namespace trainer {

// One model key as YAML scalar text and the config.json field it comes from, e.g.
// {"base_emb_dim", "2048", "hidden_size"}.
struct HfModelKey {
  std::string key, text, field;
};
using HfModelKeys = std::vector<HfModelKey>;

// The model keys a Hugging Face model directory describes (`dir`/config.json), as a model file
// would set them: what `model_name: hf` loads. Throws config_error (exit 2) naming the file and
// the field for an unknown architecture, a missing field, or a feature the trainer does not
// implement (rope_scaling, biases, sliding windows, an activation other than SiLU).
HfModelKeys hf_config_model_keys(const std::string& dir);

// The architecture `dir`/config.json names (its `architectures`), checked to be one of the three.
std::string hf_config_architecture(const std::string& dir);

// The architecture a config exports as: "BailingMoeV2ForCausalLM" with routed experts,
// "Qwen3ForCausalLM" with QK norm, else "LlamaForCausalLM". Throws config_error naming the key
// when the model cannot be written as any of them (softmax routing, a dense model with partial
// RoPE or MTP, ...).
std::string hf_architecture(const Config& config);

// config.json for `config` (the fields the Hugging Face code reads; torch_dtype as given).
std::string hf_config_json(const Config& config, const std::string& torch_dtype);

// How `dir`/config.json differs from the model of `config`. A difference in a field that sets
// the shapes of the weights (sizes, layer counts, tied head, QK norm, experts, MTP depths) makes
// the weights unusable; one that only changes what they compute (RoPE base, epsilon, routing
// details) is legitimate, e.g. Ling's 4k pretraining uses RoPE base 10000 on the released weights.
struct HfConfigDifferences {
  std::string first_shape_mismatch;  // "" when the weights fit, e.g. "num_hidden_layers in DIR/config.json
                                     // means base_num_decoder_layers: 20, but the config has ...: 3"
  std::vector<std::string> other;    // the same form, for the fields that do not change shapes, and
                                     // a nonzero attention_dropout / hidden_dropout (no dropout here)
};
HfConfigDifferences hf_config_compare(const Config& config, const std::string& dir);

}  // namespace trainer
