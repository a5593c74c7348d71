#!/usr/bin/env bash
# Data-parallel sharding levels and activation recomputation, side by side in one run: per-rank
# peak RSS against the --dry-run memory plan, step time (median of the steps after the first two),
# collectives and bytes sent per step. CPU, Gloo, fp32, synthetic data, checkpointing off.
# Prints a markdown table for docs/benchmarks.md.
#   scripts/bench/sharding.sh                         all rows below, `medium` shape
#   ROWS="1:none:none 2:optim:none" SHAPE=small STEPS=6 scripts/bench/sharding.sh
# A row is ranks:data_parallel_sharding:remat_policy[:data_parallel_shard_degree] (HSDP; default -1).
set -euo pipefail
cd "$(dirname "$0")/../.."
TRAINER=${TRAINER:-build/trainer}
[ -x "$TRAINER" ] || scripts/setup.sh
source scripts/bench/shapes.sh
SHAPE=${SHAPE:-medium}
ROWS=${ROWS:-"1:none:none 1:none:full 1:none:minimal 2:none:none 2:optim:none 4:none:none 4:optim:none"}
STEPS=${STEPS:-6}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "| R | data_parallel_sharding (shard degree) | remat_policy | plan per rank (MiB) | peak RSS rank 0 (MiB) | plan / peak | step (s) | collectives / step | MiB sent / step |"
echo "|---|---|---|---|---|---|---|---|---|"
for row in $ROWS; do
  IFS=: read -r ranks level remat degree <<< "$row"
  degree=${degree:--1}
  name="r$ranks-$level-$remat-$degree"
  args="${SHAPES[$SHAPE]} dataset_type=synthetic pad_id=0 steps=$STEPS enable_checkpointing=false
        data_parallel_sharding=$level remat_policy=$remat data_parallel_shard_degree=$degree
        base_output_directory=$out run_name=$name"
  # The plan as rank 0 of `ranks` sees it (the launcher variables are all it needs).
  plan=$(WORLD_SIZE=$ranks RANK=0 LOCAL_RANK=0 "$TRAINER" configs/base.yml $args --dry-run)
  total=$(sed -n 's/.*total .*(\([0-9]*\) bytes).*/\1/p' <<< "$plan")
  if [ "$ranks" = 1 ]; then
    "$TRAINER" configs/base.yml $args > "$out/$name.log" 2>&1 || { cat "$out/$name.log" >&2; exit 1; }
  else
    mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$ranks" "$TRAINER" configs/base.yml $args \
      > "$out/$name.log" 2>&1 || { cat "$out/$name.log" >&2; exit 1; }
  fi
  python3 - "$ranks" "$level" "$remat" "$total" "$out/$name/metrics.jsonl" "$degree" <<'PY'
import json, statistics, sys
ranks, level, remat, total, path, degree = sys.argv[1:7]
if degree != "-1":
    level += f" ({degree})"
rows = [json.loads(line) for line in open(path)]
peak = max(r["memory/peak_rss_bytes"] for r in rows)
step = statistics.median(r["perf/step_time_seconds"] for r in rows[2:])
last = rows[-1]
print(f"| {ranks} | {level} | {remat} | {float(total) / 2**20:.0f} | {peak / 2**20:.0f} | {float(total) / peak:.3f} | "
      f"{step:.2f} | {last['perf/collectives_per_step']:.0f} | {last.get('perf/collective_bytes_per_step', 0) / 2**20:.1f} |")
PY
done
