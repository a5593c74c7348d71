#!/usr/bin/env bash
# Host overhead and throughput against the PyTorch peer (scripts/bench/peer.py) on the CPU: the
# same model, data, loss, AdamW and schedule, both with one LibTorch intra-op thread (OpenBLAS
# keeps its own pool), alternating trainer / peer per round, median step time over the steps
# after warm-up. Shapes: tiny (host-bound), small (25M), medium (104M); fp32 and bf16 autocast.
#   scripts/bench/peer_vs_trainer.sh                 the rows of docs/benchmarks.md
#   ROWS="tiny:8:bfloat16 small:1:float32" scripts/bench/peer_vs_trainer.sh   chosen rows
# A row is shape:K:dtype. Steps, warm-up and rounds per shape are below (small and medium take
# seconds per step on 2 cores, so they run fewer steps and one round); ROW_ROUNDS=N runs every
# row N rounds (trainer, peer, trainer, peer, ...) and reports the median of the rounds.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x build/trainer ] || scripts/setup.sh
out=$(mktemp -d /tmp/trainer-peer-bench-XXXX)
trap 'rm -rf "$out"' EXIT
source scripts/bench/shapes.sh
declare -A STEPS=([tiny]=100 [small]=8 [medium]=6) WARMUP=([tiny]=10 [small]=2 [medium]=2) ROUNDS=([tiny]=2 [small]=1 [medium]=1)
if [ -n "${ROW_ROUNDS:-}" ]; then ROUNDS=([tiny]=$ROW_ROUNDS [small]=$ROW_ROUNDS [medium]=$ROW_ROUNDS); fi
ROWS=${ROWS:-"tiny:1:float32 tiny:8:float32 tiny:1:bfloat16 tiny:8:bfloat16 small:1:float32 small:1:bfloat16 medium:1:float32"}
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); $(date -u +%F); both arms 1 LibTorch thread"
echo
echo "| shape | K | dtype | params | steps (warm-up) x rounds | trainer median s/step | peer median s/step | peer / trainer | per round |"
echo "|---|---|---|---|---|---|---|---|---|"
for row in $ROWS; do
  IFS=: read -r shape K dtype <<< "$row"
  steps=${STEPS[$shape]}; warmup=${WARMUP[$shape]}; rounds=${ROUNDS[$shape]}
  params=$(build/trainer configs/base.yml --dry-run ${SHAPES[$shape]} | awk '/^parameters:/ {print $2}')
  t=(); p=()
  for round in $(seq "$rounds"); do
    name="$shape-$K-$dtype-$round"
    build/trainer configs/base.yml ${SHAPES[$shape]} gradient_accumulation_steps=$K steps=$steps num_threads=1 \
      dtype=$dtype save_checkpoint_on_start=true checkpoint_period=100000 base_output_directory="$out" \
      run_name="$name" log_period=1000 > "$out/$name.log" 2>&1 || { cat "$out/$name.log" >&2; exit 1; }
    t+=($(python3 -c "import json,statistics; r=[json.loads(l) for l in open('$out/$name/metrics.jsonl')][$warmup:]; print(statistics.median(x['perf/step_time_seconds'] for x in r))"))
    p+=($(/usr/bin/python3 scripts/bench/peer.py "$out/$name" --threads 1 --warmup "$warmup" | tail -1 |
          python3 -c "import json,sys; print(json.load(sys.stdin)['peer_median_step_seconds'])"))
  done
  python3 - "$shape" "$K" "$dtype" "$params" "$steps" "$warmup" "$rounds" "${t[*]}" "${p[*]}" <<'PY'
import statistics, sys
shape, K, dtype, params, steps, warmup, rounds = sys.argv[1:8]
t = [float(x) for x in sys.argv[8].split()]; p = [float(x) for x in sys.argv[9].split()]
tm, pm = statistics.median(t), statistics.median(p)
per_round = " ".join(f"{b / a:.2f}" for a, b in zip(t, p))
print(f"| {shape} | {K} | {dtype} | {int(params):,} | {steps} ({warmup}) x {rounds} | {tm:.4f} | {pm:.4f} | {pm / tm:.2f}x | {per_round} |")
PY
done
