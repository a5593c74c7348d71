// Public face of config/: the typed Config, how it is loaded from YAML + overrides, and
// how it is written back out. Rules (MaxText conventions) are in docs/config.md.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace trainer {

using StringList = std::vector<std::string>;

// Every key: (C++ type, name). configs/base.yml holds the default and a comment for each;
// a test checks that the two lists agree. Order here is the order of the resolved config.
#define TRAINER_CONFIG_KEYS(X)                    \
  /* run */                                       \
  X(std::string, model_name)                      \
  X(bool, override_model_config)                  \
  X(std::string, run_name)                        \
  X(std::string, base_output_directory)           \
  X(std::string, hardware)                        \
  X(int64_t, num_threads)                         \
  X(bool, keep_freed_host_memory)                 \
  X(bool, host_huge_pages)                        \
  X(int64_t, steps)                               \
  X(int64_t, log_period)                          \
  X(std::string, metrics_file)                    \
  X(std::string, log_format)                      \
  X(bool, enable_tensorboard)                     \
  X(bool, log_config)                             \
  X(bool, log_all_ranks)                          \
  X(bool, log_num_zeros_in_grad)                  \
  X(int64_t, debug_pause_checkpoint_save_step)    \
  X(bool, allow_memory_overcommit)                \
  X(double, peak_tflops_per_device)               \
  /* checkpoints */                               \
  X(bool, enable_checkpointing)                   \
  X(int64_t, checkpoint_period)                   \
  X(bool, save_checkpoint_on_start)               \
  X(bool, save_checkpoint_on_completion)          \
  X(int64_t, max_num_checkpoints_to_keep)         \
  X(bool, async_checkpointing)                    \
  X(std::string, load_parameters_path)            \
  X(std::string, load_full_state_path)            \
  /* model */                                     \
  X(int64_t, vocab_size)                          \
  X(int64_t, base_emb_dim)                        \
  X(int64_t, base_num_query_heads)                \
  X(int64_t, base_num_kv_heads)                   \
  X(int64_t, head_dim)                            \
  X(int64_t, base_mlp_dim)                        \
  X(int64_t, base_num_decoder_layers)             \
  X(StringList, mlp_activations)                  \
  X(double, normalization_layer_epsilon)          \
  X(double, rope_max_timescale)                   \
  X(double, partial_rotary_factor)                \
  X(bool, use_qk_norm)                            \
  X(std::string, attention_type)                  \
  X(int64_t, inhomogeneous_layer_cycle_interval)  \
  X(int64_t, q_lora_rank)                         \
  X(int64_t, kv_lora_rank)                        \
  X(int64_t, qk_nope_head_dim)                    \
  X(int64_t, qk_rope_head_dim)                    \
  X(int64_t, v_head_dim)                          \
  X(bool, mla_interleaved_rope)                   \
  X(std::string, rope_type)                       \
  X(double, rope_factor)                          \
  X(double, rope_low_freq_factor)                 \
  X(double, rope_high_freq_factor)                \
  X(int64_t, max_position_embeddings)             \
  X(int64_t, original_max_position_embeddings)    \
  X(double, beta_fast)                            \
  X(double, beta_slow)                            \
  X(double, mscale)                               \
  X(bool, rope_truncate)                          \
  X(bool, rope_attention_scaling)                 \
  X(int64_t, gla_chunk_size)                      \
  X(bool, use_linear_silu)                        \
  X(int64_t, group_norm_size)                     \
  X(bool, gla_reset_at_documents)                 \
  X(bool, logits_via_embedding)                   \
  X(std::string, dtype)                           \
  X(std::string, cpu_bf16_gemm)                   \
  X(int64_t, init_weights_seed)                   \
  X(double, init_method_std)                      \
  X(bool, init_output_layers_scaled)              \
  /* mixture of experts */                        \
  X(int64_t, num_experts)                         \
  X(int64_t, num_experts_per_tok)                 \
  X(int64_t, base_moe_mlp_dim)                    \
  X(int64_t, shared_experts)                      \
  X(int64_t, moe_shared_expert_dim)               \
  X(int64_t, first_num_dense_layers)              \
  X(std::string, routed_score_func)               \
  X(bool, norm_topk_prob)                         \
  X(double, routed_scaling_factor)                \
  X(int64_t, n_routing_groups)                    \
  X(int64_t, topk_routing_group)                  \
  X(double, load_balance_loss_weight)             \
  X(double, router_z_loss_weight)                 \
  X(std::string, moe_aux_loss_over_layers)        \
  X(bool, routed_bias)                            \
  X(double, routed_bias_update_rate)              \
  X(bool, routed_bias_zero_mean_update)           \
  X(std::string, moe_dispatch)                    \
  /* multi-token prediction */                    \
  X(int64_t, mtp_num_layers)                      \
  X(double, mtp_loss_scaling_factor)              \
  X(bool, mtp_moe_mlp)                            \
  X(bool, mtp_input_after_final_norm)             \
  X(bool, mtp_per_layer_loss_norm)                \
  /* data */                                      \
  X(std::string, dataset_type)                    \
  X(std::string, grain_file_type)                 \
  X(std::string, dataset_path)                    \
  X(std::string, split)                           \
  X(std::string, data_cache_path)                 \
  X(bool, eod_mask_loss)                          \
  X(bool, reset_position_ids)                     \
  X(bool, reset_attention_mask)                   \
  X(int64_t, eod_id)                              \
  X(int64_t, eval_interval)                       \
  X(int64_t, eval_steps)                          \
  X(bool, skip_train)                             \
  X(int64_t, max_target_length)                   \
  X(int64_t, per_device_batch_size)               \
  X(int64_t, gradient_accumulation_steps)         \
  X(int64_t, data_shuffle_seed)                   \
  X(double, synthetic_min_valid_fraction)         \
  X(int64_t, pad_id)                              \
  /* distributed */                               \
  X(double, collective_timeout_seconds)           \
  X(std::string, dist_backend)                    \
  X(int64_t, gradient_bucket_size_mb)             \
  X(bool, shard_optimizer_over_data)              \
  X(std::string, data_parallel_sharding)          \
  X(int64_t, data_parallel_shard_degree)          \
  X(int64_t, expert_parallelism)                  \
  X(std::string, remat_policy)                    \
  /* loss and normalization */                    \
  X(bool, calculate_per_token_loss)               \
  X(double, z_loss_multiplier)                    \
  X(int64_t, num_vocab_tiling)                    \
  /* optimizer and schedule */                    \
  X(double, learning_rate)                        \
  X(std::string, lr_schedule_type)                \
  X(int64_t, learning_rate_schedule_steps)        \
  X(double, warmup_steps_fraction)                \
  X(double, learning_rate_final_fraction)         \
  X(double, wsd_decay_steps_fraction)             \
  X(std::string, wsd_decay_style)                 \
  X(double, adam_b1)                              \
  X(double, adam_b2)                              \
  X(double, adam_eps)                             \
  X(double, adam_weight_decay)                    \
  X(StringList, adamw_mask)                       \
  X(double, gradient_clipping_threshold)          \
  /* health */                                    \
  X(bool, abort_on_nan_loss)                      \
  X(bool, abort_on_inf_loss)                      \
  X(bool, skip_step_on_spikes)                    \
  X(int64_t, skip_step_interval)                  \
  X(double, skip_step_scaling_factor)             \
  X(int64_t, debug_inject_nonfinite_step)         \
  X(std::string, debug_inject_nonfinite_kind)     \
  X(bool, debug_drop_aux_token_weighting)         \
  X(int64_t, debug_kill_rank_before_parameter_gather) \
  X(int64_t, debug_kill_rank_in_expert_dispatch)  \
  X(int64_t, debug_block_checkpoint_shard_rank)   \
  X(bool, debug_cuda_sync_check)                  \
  X(bool, debug_emulate_reduce_scatter)

struct Config {
#define TRAINER_DECLARE_FIELD(type, name) type name{};
  TRAINER_CONFIG_KEYS(TRAINER_DECLARE_FIELD)
#undef TRAINER_DECLARE_FIELD

  // Derived values (DESIGN section 3); filled by config_derive(), never read from YAML.
  int64_t data_parallel_size = 1;
  int64_t global_batch_size = 0;  // sequences per optimizer step, all ranks
  std::string run_dir;
  std::string run_name_stem;  // a generated run_name's <model_name>_<timestamp>; empty: the user named the run
  std::string config_dir;  // directory of the top-level config file (models/ lives under it)
};

// Loads `path` (following base_config:), then configs/models/<model_name>.yml, then the CLI
// `key=value` overrides, then M_<KEY> variables from `environment` ("NAME=value" strings).
// Validates types, allowed values and cross-field rules and fills the derived values.
// Throws trainer::Error with exit code 2 on any problem, naming the key(s).
Config config_load(const std::string& path, const std::vector<std::string>& overrides,
                   const std::vector<std::string>& environment);

// Same, reading the process environment.
Config config_load(const std::string& path, const std::vector<std::string>& overrides);

// Megatron's validation size for a run of `steps` steps: (steps / eval_interval + 1) x eval_steps
// global batches (an eval_interval below 1 counts as 1). config_load checks that it fits 64 bits.
int64_t config_eval_samples(const Config& config, int64_t steps);

// Checks types/ranges/cross-field rules and fills derived values (called by config_load;
// tests that edit a Config call it again).
void config_derive_and_validate(Config& config);

// The resolved config as YAML, every key in declaration order plus the derived values as comments.
std::string config_to_yaml(const Config& config);

// `text`, a value of `key` as a config file holds it, printed as the key prints values now; the
// text itself when the key is unknown or the text does not parse. Two spellings of one value
// (a checkpoint's 0.00029999999999999997 and today's 0.0003) come out equal.
std::string config_value_canonical(const std::string& key, const std::string& text);

// The ranks each sharding group spans (HSDP): data_parallel_shard_degree, or all data-parallel
// ranks when it is -1. R / degree groups each hold a full copy of the model state, sharded.
int64_t config_shard_degree(const Config& config);

// The factor YaRN's rope_attention_scaling puts on cos and sin (so on q . k its square):
// 0.1 ln(rope_factor) + 1 (MaxText's YarnRotaryEmbedding, transformers' default attention_factor), else 1.
double config_rope_attention_factor(const Config& config);

// The rules that need the number of ranks (`world_size`): expert_parallelism and
// data_parallel_shard_degree must divide it, and expert_parallelism the shard degree (HSDP).
// config_error naming the key. Not part of config_derive_and_validate: a config for another
// world (a test building one rank's model of a larger run) stays loadable. The Trainer checks
// them against its process group, --dry-run against the launcher's world size.
void config_check_layout(const Config& config, int64_t world_size);

// Names of every key, in declaration order.
const std::vector<std::string>& config_key_names();

}  // namespace trainer
