#!/usr/bin/env bash
# num_vocab_tiling: the head and loss over tiles of the B*L tokens against the whole (B, L, V)
# logits, CPU, side by side in one compare_arms run per dtype: the `small` shape of shapes.sh
# with a 32K vocabulary (Llama 2's), 1024 tokens per step, so the head is a large part of the step.
# Reports step time and peak RSS per arm. TILES="4 16" to choose the tiled arms; DTYPES
# ("float32 bfloat16"), STEPS, ROUNDS as in compare_arms.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x build/trainer ] || scripts/setup.sh
source scripts/bench/shapes.sh
for dtype in ${DTYPES:-float32 bfloat16}; do
  common="model_name=default ${SHAPES[small]} vocab_size=32768 dataset_type=synthetic pad_id=0 eod_id=1 dtype=$dtype enable_checkpointing=false"
  arms=(--arm "whole-$dtype" "$common num_vocab_tiling=1")
  for t in ${TILES:-4 16}; do arms+=(--arm "tiles$t-$dtype" "$common num_vocab_tiling=$t"); done
  echo "== small, V 32768, $dtype"
  python3 scripts/bench/compare_arms.py --steps "${STEPS:-8}" --warmup 3 --rounds "${ROUNDS:-2}" "${arms[@]}"
done
