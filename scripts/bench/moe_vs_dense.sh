#!/usr/bin/env bash
# moe-tiny against a dense model of (almost) the same active size, plus moe-tiny with every
# token sent to all 8 experts (4x the expert FLOPs, same dispatch) to show where MoE time goes.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x build/trainer ] || scripts/setup.sh
exec python3 scripts/bench/compare_arms.py --steps "${STEPS:-60}" --warmup 10 --rounds "${ROUNDS:-2}" \
  --arm dense-132k "model_name=moe-tiny override_model_config=true num_experts=1 shared_experts=0 first_num_dense_layers=0 base_mlp_dim=108" \
  --arm moe-tiny "model_name=moe-tiny" \
  --arm moe-tiny-top8 "model_name=moe-tiny override_model_config=true num_experts_per_tok=8"
