#!/usr/bin/env bash
# bf16 on the CPU: the trainer's fp32-summed bf16 GEMMs (cpu_bf16_gemm=fp32, what `auto` picks
# where LibTorch 1.13 has no fp32-accumulating bf16 GEMM: no AVX-512) against LibTorch's own
# (cpu_bf16_gemm=native), with fp32 as the first arm, side by side in one compare_arms run per
# shape (scripts/bench/shapes.sh). SHAPES_RUN="tiny small" to choose; STEPS, ROUNDS as in
# compare_arms.py. Step times only; the numerics are tested (tests/test_model.cpp "bf16 GEMMs on
# the CPU summed in fp32").
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x build/trainer ] || scripts/setup.sh
source scripts/bench/shapes.sh
declare -A STEPS_OF=([tiny]=40 [small]=6 [medium]=4) WARMUP_OF=([tiny]=5 [small]=2 [medium]=1)
for shape in ${SHAPES_RUN:-tiny small}; do
  common="${SHAPES[$shape]} enable_checkpointing=false"
  echo "== $shape: ${SHAPES[$shape]}"
  python3 scripts/bench/compare_arms.py --steps "${STEPS:-${STEPS_OF[$shape]}}" --warmup "${WARMUP_OF[$shape]}" \
    --rounds "${ROUNDS:-2}" \
    --arm "$shape-fp32" "$common dtype=float32" \
    --arm "$shape-bf16-native" "$common dtype=bfloat16 cpu_bf16_gemm=native" \
    --arm "$shape-bf16-fp32" "$common dtype=bfloat16 cpu_bf16_gemm=fp32"
done
