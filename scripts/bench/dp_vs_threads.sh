#!/usr/bin/env bash
# Data parallel R=2 x 1 thread (mpirun, Gloo) against R=1 x 2 threads on this machine, same
# global batch and samples, alternating A B A B; reports median step time after warm-up,
# tokens/s for the whole job, and the measured gradient-sync time per step. Also R=1 with
# LibTorch's default thread setting, since forcing 2 intra-op threads is slower on this VM.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x build/trainer ] || scripts/setup.sh
out=$(mktemp -d /tmp/trainer-dp-bench-XXXX)
trap 'rm -rf "$out"' EXIT
STEPS=${STEPS:-40}
COMMON="dataset_type=synthetic pad_id=0 model_name=default max_target_length=128 steps=$STEPS log_period=1000 \
enable_checkpointing=false base_output_directory=$out"
for round in 1 2; do
  for arm in "r1-$round num_threads=2 per_device_batch_size=8" "r1d-$round num_threads=0 per_device_batch_size=8"; do
    read -r name settings <<< "$arm"
    build/trainer configs/base.yml $COMMON $settings run_name="$name" > "$out/$name.log" 2>&1 || { cat "$out/$name.log" >&2; exit 1; }
  done
  mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 build/trainer configs/base.yml $COMMON num_threads=1 \
    per_device_batch_size=4 run_name=r2-$round > "$out/r2-$round.log" 2>&1 || { cat "$out/r2-$round.log" >&2; exit 1; }
done
python3 - "$out" <<'PY'
import json, statistics, sys
def rows(name):
    out = []
    for r in (1, 2):
        out += [json.loads(l) for l in open(f"{sys.argv[1]}/{name}-{r}/metrics.jsonl")][10:]
    return out
base = None
print("| arm | median s/step | mean | max | tokens/s (job) | median grad sync s/step | time vs R=1 x 2 threads |")
print("|---|---|---|---|---|---|---|")
for name, label, ranks in (("r1", "R=1 x 2 threads (num_threads=2), batch 8", 1),
                           ("r1d", "R=1, LibTorch default threads, batch 8", 1),
                           ("r2", "R=2 x 1 thread, batch 4 each", 2)):
    rs = rows(name)
    t = [r["perf/step_time_seconds"] for r in rs]
    med = statistics.median(t)
    base = base or med
    tokens = statistics.median(r["perf/per_device_tokens_per_sec"] for r in rs) * ranks
    sync = statistics.median(r["perf/grad_sync_seconds"] for r in rs)
    print(f"| {label} | {med:.4f} | {statistics.mean(t):.4f} | {max(t):.4f} | {tokens:.0f} | {sync:.4f} | {med / base:.2f}x |")
PY
