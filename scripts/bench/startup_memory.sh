#!/usr/bin/env bash
# Per-rank peak memory of startup (build the model, shard it, export it) for two trainer binaries
# side by side, rows interleaved: what building the model costs each rank before the first step.
# Each run is `--export-safetensors` of a fresh run, which builds, initializes and shards the model,
# then streams its weights out one unit at a time and exits without training; peak RSS per rank
# from /usr/bin/time. CPU, Gloo, fp32. Prints a markdown table for docs/benchmarks.md.
#   BEFORE=/path/to/old/trainer scripts/bench/startup_memory.sh
#   BEFORE=... ROWS="4:optim_grads_params 2:none" SHAPE=medium scripts/bench/startup_memory.sh
# A row is ranks:data_parallel_sharding. AFTER defaults to build/trainer.
set -euo pipefail
cd "$(dirname "$0")/../.."
AFTER=${AFTER:-build/trainer}
BEFORE=${BEFORE:?set BEFORE to the trainer binary to compare against}
[ -x "$AFTER" ] || scripts/setup.sh
source scripts/bench/shapes.sh
SHAPE=${SHAPE:-medium}
ROWS=${ROWS:-"1:none 2:optim_grads_params 4:optim_grads_params"}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

# Peak RSS (MiB) of each rank of one export run, space-separated, and its wall seconds.
measure() {
  local binary=$1 ranks=$2 level=$3 name=$4
  local remat=none
  [ "$level" = optim_grads_params ] && remat=full
  local args="${SHAPES[$SHAPE]} dataset_type=synthetic pad_id=0 steps=1 enable_checkpointing=false
              data_parallel_sharding=$level remat_policy=$remat base_output_directory=$out run_name=$name
              --export-safetensors $out/$name.safetensors"
  local start end
  start=$(date +%s.%N)
  if [ "$ranks" = 1 ]; then
    /usr/bin/time -f "maxrss_kb=%M" "$binary" configs/base.yml $args > "$out/$name.log" 2>&1 \
      || { cat "$out/$name.log" >&2; exit 1; }
  else
    mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$ranks" /usr/bin/time -f "maxrss_kb=%M" \
      "$binary" configs/base.yml $args > "$out/$name.log" 2>&1 || { cat "$out/$name.log" >&2; exit 1; }
  fi
  end=$(date +%s.%N)
  rm -f "$out/$name.safetensors"
  echo "$(grep -o 'maxrss_kb=[0-9]*' "$out/$name.log" | cut -d= -f2 | awk '{printf "%.0f ", $1 / 1024}')" \
       "$(python3 -c "print($end - $start)")"
}

echo "| R | data_parallel_sharding | before: peak RSS per rank (MiB) | after | after / before (largest rank) | wall s before / after |"
echo "|---|---|---|---|---|---|"
for row in $ROWS; do
  IFS=: read -r ranks level <<< "$row"
  read -r -a a <<< "$(measure "$BEFORE" "$ranks" "$level" "before-r$ranks-$level")"
  read -r -a b <<< "$(measure "$AFTER" "$ranks" "$level" "after-r$ranks-$level")"
  python3 - "$ranks" "$level" "${a[*]}" "${b[*]}" <<'PY'
import sys
ranks, level, a, b = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4].split()
ra, rb = [float(x) for x in a[:-1]], [float(x) for x in b[:-1]]
print(f"| {ranks} | {level} | {' / '.join(f'{x:.0f}' for x in sorted(ra, reverse=True))} | "
      f"{' / '.join(f'{x:.0f}' for x in sorted(rb, reverse=True))} | {max(rb) / max(ra):.2f} | "
      f"{float(a[-1]):.1f} / {float(b[-1]):.1f} |")
PY
done
