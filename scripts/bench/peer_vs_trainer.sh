#!/usr/bin/env bash
# Host overhead and throughput against the PyTorch peer (scripts/bench/peer.py): the same model,
# data, loss, AdamW and schedule, both single-threaded, alternating trainer / peer per round,
# median step time over the steps after warm-up. Shapes: tiny (host-bound) and small.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x build/trainer ] || scripts/setup.sh
out=$(mktemp -d /tmp/trainer-peer-bench-XXXX)
trap 'rm -rf "$out"' EXIT
STEPS=${STEPS:-25}
declare -A SHAPES=(
  [tiny]="override_model_config=true base_emb_dim=64 base_num_query_heads=4 base_num_kv_heads=2 head_dim=16 base_mlp_dim=192 base_num_decoder_layers=2 max_target_length=64 per_device_batch_size=4"
  [small]="override_model_config=true base_emb_dim=384 base_num_query_heads=6 base_num_kv_heads=2 head_dim=64 base_mlp_dim=1024 base_num_decoder_layers=6 max_target_length=256 per_device_batch_size=4"
)
echo "| shape | K | params | trainer median s/step | peer median s/step | peer / trainer |"
echo "|---|---|---|---|---|---|"
for shape in tiny small; do
  KS="1 8"
  [ "$shape" = small ] && KS=${SMALL_KS:-1}  # small at K=8 takes ~20 minutes on 2 cores
  for K in $KS; do
    params=$(build/trainer configs/base.yml --dry-run ${SHAPES[$shape]} | awk '/^parameters:/ {print $2}')
    t=(); p=()
    for round in 1 2; do
      run="$out/$shape-$K-$round"
      build/trainer configs/base.yml ${SHAPES[$shape]} gradient_accumulation_steps=$K steps=$STEPS num_threads=1 \
        save_checkpoint_on_start=true base_output_directory="$out" run_name="$shape-$K-$round" log_period=1000 > /dev/null 2>&1
      t+=($(python3 -c "import json,statistics,sys; r=[json.loads(l) for l in open('$run/metrics.jsonl')][5:]; print(statistics.median(x['perf/step_time_seconds'] for x in r))"))
      p+=($(/usr/bin/python3 scripts/bench/peer.py "$run" --threads 1 | tail -1 | python3 -c "import json,sys; print(json.load(sys.stdin)['peer_median_step_seconds'])"))
    done
    python3 - "$shape" "$K" "$params" "${t[@]}" "${p[@]}" <<'PY'
import statistics, sys
shape, K, params = sys.argv[1:4]
t = [float(x) for x in sys.argv[4:6]]; p = [float(x) for x in sys.argv[6:8]]
tm, pm = statistics.median(t), statistics.median(p)
print(f"| {shape} | {K} | {int(params):,} | {tm:.4f} | {pm:.4f} | {pm / tm:.2f}x |")
PY
  done
done
