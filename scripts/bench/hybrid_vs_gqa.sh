#!/usr/bin/env bash
# The Ling2 hybrid (4 GLA + 1 MLA per 5 layers) against the same stack with GQA softmax attention
# in every layer, CPU, side by side in one compare_arms run per shape:
#   tiny:  ling2-tiny (5 layers, D 64, MoE) vs attention_type=global (4 kv heads = 4 query heads);
#   100m:  a dense ~100M shape (12 layers, D 768, 12 heads of 64, MLP 2048, byte vocabulary) with
#          the hybrid pattern (layers 4 and 9 MLA) vs all-GQA, 2 sequences of 512 tokens per step.
# SHAPES="tiny" to choose; STEPS, ROUNDS as in compare_arms.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x build/trainer ] || scripts/setup.sh
for shape in ${SHAPES:-tiny 100m}; do
  case $shape in
    tiny)
      common="model_name=ling2-tiny override_model_config=true vocab_size=258 per_device_batch_size=8 max_target_length=256 enable_checkpointing=false"
      steps=${STEPS:-20} warmup=5 ;;
    100m)
      common="model_name=ling2-tiny override_model_config=true vocab_size=258 base_emb_dim=768 base_num_query_heads=12 base_num_kv_heads=12 head_dim=64 base_mlp_dim=2048 base_num_decoder_layers=12 num_experts=1 shared_experts=0 routed_bias=false n_routing_groups=-1 topk_routing_group=-1 mtp_num_layers=0 mtp_moe_mlp=false moe_shared_expert_dim=0 q_lora_rank=384 kv_lora_rank=256 qk_nope_head_dim=64 qk_rope_head_dim=32 v_head_dim=64 gla_chunk_size=64 group_norm_size=4 per_device_batch_size=2 max_target_length=512 enable_checkpointing=false"
      steps=${STEPS:-6} warmup=2 ;;
    *) echo "hybrid_vs_gqa.sh: unknown shape $shape (tiny, 100m)" >&2; exit 2 ;;
  esac
  echo "== $shape"
  python3 scripts/bench/compare_arms.py --steps "$steps" --warmup "$warmup" --rounds "${ROUNDS:-2}" \
    --arm "$shape-gqa" "$common attention_type=global inhomogeneous_layer_cycle_interval=0" \
    --arm "$shape-hybrid" "$common"
done
