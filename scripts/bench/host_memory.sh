#!/usr/bin/env bash
# keep_freed_host_memory (glibc malloc keeps freed memory: no trim, fixed 32 MiB mmap threshold)
# on and off, side by side in one compare_arms run per shape, fp32 on the CPU, synthetic data.
#   scripts/bench/host_memory.sh                 shapes tiny, small and the MoE of moe_vs_dense.sh (E = 64)
#   SHAPES_TO_RUN="small" ROUNDS=3 scripts/bench/host_memory.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x build/trainer ] || scripts/setup.sh
source scripts/bench/shapes.sh
SHAPES[moe64]="model_name=moe-tiny override_model_config=true vocab_size=258 first_num_dense_layers=0 shared_experts=0
  num_experts=64 num_experts_per_tok=8 base_moe_mlp_dim=32 per_device_batch_size=8 max_target_length=256"
for shape in ${SHAPES_TO_RUN:-tiny small moe64}; do
  common="$(echo ${SHAPES[$shape]}) dataset_type=synthetic pad_id=0 enable_checkpointing=false"
  echo "== $shape"
  python3 scripts/bench/compare_arms.py --steps "${STEPS:-12}" --warmup 4 --rounds "${ROUNDS:-3}" \
    --arm "$shape-returned" "$common keep_freed_host_memory=false" \
    --arm "$shape-kept" "$common keep_freed_host_memory=true"
done
