#!/usr/bin/env bash
# The memory plan (--dry-run) against the measured peak RSS of the same run, for the benchmark
# shapes tiny/small/medium and moe-tiny at K=1 and K=8 (fp32, CPU, checkpointing off so the
# training peak is what is measured), head-, expert- and GLA-heavy Ling shapes (fp32 and bf16), and
# attention with segment masks (reset_attention_mask over real documents: the fortunes corpus,
# byte-tokenized into the run's temporary folder) beside the same run without them.
# Prints a markdown table for docs/benchmarks.md.
#   scripts/bench/memory_plan.sh                 ROWS="tiny:1 medium:8" STEPS=2 to choose
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x build/trainer ] && [ -x build/preprocess_data ] || scripts/setup.sh
source scripts/bench/shapes.sh
SHAPES[moe-tiny]="model_name=moe-tiny max_target_length=128 per_device_batch_size=4"
# The head and the loss dominating: Ling 2.0's structure with a 64K vocabulary over 2 x 1024
# tokens (each fp32 (T, V) tensor 512 MiB), MTP on; with z-loss; in bf16.
SHAPES[mtp-head]="model_name=ling-mini-tiny override_model_config=true vocab_size=65536 max_target_length=1024 per_device_batch_size=2"
SHAPES[mtp-head-z]="${SHAPES[mtp-head]} z_loss_multiplier=1e-4"
SHAPES[mtp-head-bf16]="${SHAPES[mtp-head]} dtype=bfloat16"
# The experts dominating: 16 experts of 512 x 512 (top-4) in 3 of 4 layers, head tiled.
SHAPES[moe-wide]="model_name=ling-mini-tiny override_model_config=true vocab_size=4096 base_emb_dim=512 base_num_query_heads=8
  base_num_kv_heads=4 head_dim=64 base_mlp_dim=1024 base_moe_mlp_dim=512 num_experts=16 num_experts_per_tok=4 n_routing_groups=4
  topk_routing_group=2 base_num_decoder_layers=4 max_target_length=1024 per_device_batch_size=2 num_vocab_tiling=8"
SHAPES[moe-wide-bf16]="${SHAPES[moe-wide]} dtype=bfloat16"
# The Ling2 hybrid (4 GLA + 1 MLA layers) at width 512 over 2 x 2048 tokens, GLA chunks of 16.
SHAPES[hybrid]="model_name=ling2-tiny override_model_config=true vocab_size=4096 base_emb_dim=512 base_num_query_heads=8
  base_num_kv_heads=8 head_dim=64 base_mlp_dim=1024 q_lora_rank=128 kv_lora_rank=128 qk_nope_head_dim=64 qk_rope_head_dim=32
  v_head_dim=64 gla_chunk_size=16 max_target_length=2048 per_device_batch_size=2"
SHAPES[hybrid-bf16]="${SHAPES[hybrid]} dtype=bfloat16"
# Every layer MLA (the hybrid's widths, 5 layers, no GLA): what the plan counts as GQA layers.
SHAPES[mla]="${SHAPES[hybrid]} inhomogeneous_layer_cycle_interval=0"
SHAPES[mla-bf16]="${SHAPES[mla]} dtype=bfloat16"
# Attention-heavy over documents: small's layers at 2 x 1024 tokens (a layer's fp32 (B, H, L, L)
# probabilities would be 64 MiB), with and without the per-segment masks. "@DATA@" is the
# fortunes corpus preprocessed below (eod_id 256, pad_id 257: the byte tokenizer's).
SHAPES[segments-off]="${SHAPES[small]} max_target_length=1024 per_device_batch_size=2 vocab_size=512
  dataset_type=megatron dataset_path=@DATA@ eod_id=256 pad_id=257"
SHAPES[segments]="${SHAPES[segments-off]} reset_attention_mask=true"
ROWS=${ROWS:-"tiny:1 tiny:8 small:1 small:8 moe-tiny:1 moe-tiny:8 medium:1 medium:8 mtp-head:1 mtp-head-z:1 mtp-head-bf16:1 moe-wide:1 moe-wide-bf16:1 hybrid:1 hybrid-bf16:1 segments-off:1 segments:1"}
STEPS=${STEPS:-2}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
if [[ " $ROWS" == *" segments"* ]]; then
  build/preprocess_data --input data/fortunes.jsonl --output-prefix "$out/fortunes" --append-eod > /dev/null 2>&1
  for name in segments-off segments; do SHAPES[$name]=${SHAPES[$name]//@DATA@/$out/fortunes_text_document}; done
fi
echo "| shape | K | plan (MiB) | of it activations (MiB) | measured peak RSS (MiB) | plan / measured |"
echo "|---|---|---|---|---|---|"
for row in $ROWS; do
  shape=${row%%:*} K=${row##*:}
  data="dataset_type=synthetic pad_id=0"
  [[ "${SHAPES[$shape]}" == *dataset_type=megatron* ]] && data="data_cache_path=$out/cache"
  args="$data ${SHAPES[$shape]} gradient_accumulation_steps=$K steps=$STEPS
        enable_checkpointing=false base_output_directory=$out run_name=$shape-$K"
  plan=$(build/trainer configs/base.yml $args --dry-run)
  total=$(sed -n 's/.*total .*(\([0-9]*\) bytes).*/\1/p' <<< "$plan")
  activations=$(sed -n 's/^  activations saved for backward[^0-9]*\([0-9.]*\) \(MiB\|GiB\).*/\1 \2/p' <<< "$plan")
  build/trainer configs/base.yml $args > "$out/$shape-$K.log" 2>&1 || { cat "$out/$shape-$K.log" >&2; exit 1; }
  peak=$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readlines()[-1])["memory/peak_rss_bytes"])' \
         "$out/$shape-$K/metrics.jsonl")
  python3 - "$shape" "$K" "$total" "$activations" "$peak" <<'PY'
import sys
shape, K, total, act, peak = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4].split(), float(sys.argv[5])
act_mib = float(act[0]) * (1024 if act[1] == "GiB" else 1)
print(f"| {shape} | {K} | {total / 2**20:.1f} | {act_mib:.1f} | {peak / 2**20:.1f} | {total / peak:.3f} |")
PY
done
