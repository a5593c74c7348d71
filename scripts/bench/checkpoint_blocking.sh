#!/usr/bin/env bash
# Time the training loop is blocked per checkpoint save, sync against async, for the default
# model and a ~100M-parameter model. Reads the "training blocked for" log lines; reports the
# median over the saves of each run (the last save is always synchronous and is excluded).
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x build/trainer ] || scripts/setup.sh
out=$(mktemp -d /tmp/trainer-ckpt-bench-XXXX)
trap 'rm -rf "$out"' EXIT
MEDIUM="model_name=default override_model_config=true vocab_size=8192 base_emb_dim=768 base_num_query_heads=12 \
base_num_kv_heads=12 head_dim=64 base_mlp_dim=2048 base_num_decoder_layers=12 max_target_length=64 per_device_batch_size=1"
DEFAULT="model_name=default"
echo "| model | parameters | mode | median blocked s per save | saves | write s per save |"
echo "|---|---|---|---|---|---|"
for arm in "default|$DEFAULT|${STEPS_DEFAULT:-40}|10" "medium|$MEDIUM|${STEPS_MEDIUM:-12}|3"; do
  IFS='|' read -r name overrides steps period <<< "$arm"
  params=$(build/trainer configs/base.yml --dry-run $overrides | awk '/^parameters:/ {print $2}')
  for mode in sync async; do
    async=$([ "$mode" = async ] && echo true || echo false)
    log="$out/$name-$mode.log"
    build/trainer configs/base.yml $overrides steps="$steps" checkpoint_period="$period" async_checkpointing=$async \
      log_period=1000 base_output_directory="$out" run_name="$name-$mode" > "$log" 2>&1 || { cat "$log" >&2; exit 1; }
    python3 - "$log" "$name" "$params" "$mode" <<'PY'
import re, statistics, sys
text = open(sys.argv[1]).read()
blocked = [float(x) for x in re.findall(r"training blocked for ([0-9.]+) s \((?:sync|async)\)", text)][:-1]
writes = [float(x) for x in re.findall(r"saved checkpoint \S+ in ([0-9.]+) s", text)]
print(f"| {sys.argv[2]} | {int(sys.argv[3]):,} | {sys.argv[4]} | {statistics.median(blocked):.3f} | {len(blocked)} | "
      f"{statistics.median(writes):.3f} |")
PY
    rm -rf "$out/$name-$mode"
  done
done
