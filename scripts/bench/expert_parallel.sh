#!/usr/bin/env bash
# Expert parallelism against plain data parallelism at the same R, side by side in one run:
# per-rank memory plan and peak RSS, step time (median of the steps after the first two),
# collectives and bytes sent per step. CPU, Gloo, fp32, synthetic data, checkpointing off. The
# model is moe-tiny's attention with 3 MoE layers of E experts (top-8, width 32), so the experts
# are most of the parameters. Prints a markdown table for docs/benchmarks.md.
#   scripts/bench/expert_parallel.sh                     rows 2:1 2:2, E = 64
#   ROWS="2:1 2:2 4:1 4:2 4:4" EXPERTS=256 STEPS=8 scripts/bench/expert_parallel.sh
#   ROWS="4:1:optim_grads_params 4:2:optim_grads_params" scripts/bench/expert_parallel.sh
# A row is ranks:expert_parallelism[:data_parallel_sharding] (default none; optim_grads_params
# adds remat_policy=full, which it needs).
set -euo pipefail
cd "$(dirname "$0")/../.."
TRAINER=${TRAINER:-build/trainer}
[ -x "$TRAINER" ] || scripts/setup.sh
E=${EXPERTS:-64}
ROWS=${ROWS:-"2:1 2:2"}
STEPS=${STEPS:-10}
model="model_name=moe-tiny override_model_config=true vocab_size=258 first_num_dense_layers=0 shared_experts=0
       num_experts=$E num_experts_per_tok=8 base_moe_mlp_dim=32 per_device_batch_size=8 max_target_length=256"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "| R | expert_parallelism | data_parallel_sharding | experts per rank | plan per rank (MiB) | peak RSS rank 0 (MiB) | step (s) | collectives / step | MiB sent / step |"
echo "|---|---|---|---|---|---|---|---|---|"
for row in $ROWS; do
  IFS=: read -r ranks ep level <<< "$row"
  level=${level:-none}
  name="r$ranks-ep$ep-$level"
  remat=""
  [ "$level" = optim_grads_params ] && remat="remat_policy=full"
  args="$model dataset_type=synthetic pad_id=0 steps=$STEPS enable_checkpointing=false expert_parallelism=$ep
        data_parallel_sharding=$level $remat base_output_directory=$out run_name=$name"
  plan=$(WORLD_SIZE=$ranks RANK=0 LOCAL_RANK=0 "$TRAINER" configs/base.yml $args --dry-run)
  total=$(sed -n 's/.*total .*(\([0-9]*\) bytes).*/\1/p' <<< "$plan")
  mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$ranks" "$TRAINER" configs/base.yml $args \
    > "$out/$name.log" 2>&1 || { cat "$out/$name.log" >&2; exit 1; }
  python3 - "$ranks" "$ep" "$level" "$E" "$total" "$out/$name/metrics.jsonl" <<'PY'
import json, statistics, sys
ranks, ep, level, experts, total, path = sys.argv[1:7]
rows = [json.loads(line) for line in open(path)]
peak = max(r["memory/peak_rss_bytes"] for r in rows)
step = statistics.median(r["perf/step_time_seconds"] for r in rows[2:])
last = rows[-1]
print(f"| {ranks} | {ep} | {level} | {int(experts) // int(ep)} | {float(total) / 2**20:.0f} | {peak / 2**20:.0f} | {step:.3f} | "
      f"{last['perf/collectives_per_step']:.0f} | {last.get('perf/collective_bytes_per_step', 0) / 2**20:.1f} |")
PY
done
echo
echo "Model: \`$(echo $model | tr -s ' ')\`, $STEPS steps per row."
