#!/usr/bin/env bash
# Issue-7 targets 2-5 on this machine, in one run (results: docs/benchmarks.md):
#   2. accumulation costs nothing: per-micro-batch time and peak RSS at K=8 against K=1 (small, medium)
#   3. compute efficiency: medium's model TFLOP/s against a square fp32 GEMM of the model width,
#      timed in the same run with the same LibTorch (Debian python3-torch) and thread count
#   4. host reads (device->host syncs) and gradient-sized allocations per step, from the counters
#   5. startup: launch to the end of the first step for the default model, by phase
# Default threads (2 on the CI machine). STEPS_SMALL / STEPS_MEDIUM shorten or lengthen the runs.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x build/trainer ] || scripts/setup.sh
out=$(mktemp -d /tmp/trainer-targets-XXXX)
trap 'rm -rf "$out"' EXIT
source scripts/bench/shapes.sh
declare -A STEPS=([small]=${STEPS_SMALL:-8} [medium]=${STEPS_MEDIUM:-6})
summary() {  # run dir, K -> "median_step_s per_micro_s peak_rss_MiB tflops host_reads grad_sized allocations"
  python3 - "$1" "$2" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if '"learning/loss"' in l]
K = int(sys.argv[2]); timed = rows[2:] if len(rows) > 3 else rows[1:]
t = statistics.median(r["perf/step_time_seconds"] for r in timed)
tf = statistics.median(r["perf/per_device_tflops_per_sec"] for r in timed)
last = rows[-1]
print(f"{t:.3f} {t / K:.3f} {last['memory/peak_rss_bytes'] / 2**20:.0f} {tf:.4f} "
      f"{max(r['perf/host_reads_in_step'] for r in rows):.0f} {max(r['perf/grad_sized_allocations_in_step'] for r in rows):.0f} "
      f"{statistics.median(r['perf/host_allocations_in_step'] for r in timed) / K:.0f}")
PY
}
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(date -u +%F)"
echo
echo "| shape | params | K | median s/step | s per micro-batch | K=8 / K=1 per micro-batch | peak RSS MiB | RSS K=8 / K=1 | model TFLOP/s | host reads in step | grad-sized allocations in step | allocations per micro-batch |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
declare -A TFLOPS
for shape in small medium; do
  params=$(build/trainer configs/base.yml --dry-run ${SHAPES[$shape]} | awk '/^parameters:/ {print $2}')
  base_micro=""; base_rss=""
  for K in 1 8; do
    steps=${STEPS[$shape]}; [ "$K" = 8 ] && steps=$(( steps / 2 + 2 ))
    build/trainer configs/base.yml ${SHAPES[$shape]} gradient_accumulation_steps=$K steps=$steps log_period=1000 \
      enable_checkpointing=false base_output_directory="$out" run_name="$shape-$K" > "$out/$shape-$K.log" 2>&1 ||
      { cat "$out/$shape-$K.log" >&2; exit 1; }
    read -r step micro rss tflops reads grad allocs <<< "$(summary "$out/$shape-$K" "$K")"
    [ "$K" = 1 ] && { base_micro=$micro; base_rss=$rss; TFLOPS[$shape]=$tflops; }
    ratio_t=$(python3 -c "print(f'{$micro / $base_micro:.3f}')"); ratio_m=$(python3 -c "print(f'{$rss / $base_rss:.3f}')")
    echo "| $shape | $(printf "%'d" "$params") | $K | $step | $micro | ${ratio_t}x | $rss | ${ratio_m}x | $tflops | $reads | $grad | $allocs |"
  done
done
echo
threads=$(/usr/bin/python3 -c "import torch; print(torch.get_num_threads())")
gemm=$(/usr/bin/python3 - <<'PY'
import time, torch
n = 768  # medium's width
a, b = torch.randn(n, n), torch.randn(n, n)
for _ in range(5): a @ b
times = []
for _ in range(50):
    t = time.perf_counter(); a @ b; times.append(time.perf_counter() - t)
times.sort()
print(f"{2 * n**3 / times[len(times) // 2] / 1e12:.4f}")
PY
)
echo "GEMM peak (768x768x768 fp32, median of 50, $threads threads, same LibTorch): $gemm TFLOP/s; medium trains at ${TFLOPS[medium]} TFLOP/s = $(python3 -c "print(f'{100 * ${TFLOPS[medium]} / $gemm:.1f}')")% of it"
echo
build/trainer configs/base.yml steps=2 enable_checkpointing=false base_output_directory="$out" run_name=startup 2>&1 |
  grep -o "startup: .*" | sed 's/^/default model /'
