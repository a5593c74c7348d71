#!/usr/bin/env bash
# MoE step time against a dense model of the same active FLOPs, for E = 8, 64 and 256 routed
# experts (top-8, expert width 32, all 3 layers MoE, no shared expert; moe-tiny's attention and
# embeddings; 8 sequences of 256 tokens per step, so 16,384 routed rows per MoE layer). The dense arm's MLP width is k * F + E / 3, so that its FLOPs per token match the k
# experts plus the router (E x D). Per E, side by side in one compare_arms run:
#   dense, moe_dispatch=loop (per-expert autograd), moe_dispatch=grouped (the default),
# and, with BEFORE=path/to/trainer (a build from before the grouped dispatch), that binary's MoE.
# EXPERTS="8 64" to choose the E values; STEPS, ROUNDS as in compare_arms.py.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x build/trainer ] || scripts/setup.sh
k=8 width=32
# vocab_size 258: base.yml's byte-tokenizer eod (256) and pad (257) ids must fit.
common="model_name=moe-tiny override_model_config=true vocab_size=258 first_num_dense_layers=0 shared_experts=0 per_device_batch_size=8 max_target_length=256 enable_checkpointing=false"
for E in ${EXPERTS:-8 64 256}; do
  moe="$common num_experts=$E num_experts_per_tok=$k base_moe_mlp_dim=$width"
  before=()
  [ -n "${BEFORE:-}" ] && before=(--arm "E$E-before" "$moe" --binary "E$E-before" "$BEFORE")
  echo "== E = $E, top-$k, expert width $width; dense MLP width $((k * width + E / 3))"
  python3 scripts/bench/compare_arms.py --steps "${STEPS:-20}" --warmup 5 --rounds "${ROUNDS:-3}" \
    --arm "E$E-dense" "$common num_experts=1 base_mlp_dim=$((k * width + E / 3))" \
    "${before[@]}" \
    --arm "E$E-loop" "$moe moe_dispatch=loop" \
    --arm "E$E-grouped" "$moe moe_dispatch=grouped"
done
