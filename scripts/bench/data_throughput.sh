#!/usr/bin/env bash
# Data pipeline throughput: the loader alone (build/bench_data) against what the trainer
# consumes for the default model (tokens/s of a short default run, median step), and
# preprocess_data on the fortunes corpus repeated 20x with 1 and 2 workers.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x build/bench_data ] || scripts/setup.sh
scripts/prepare_corpus.sh
out=$(mktemp -d /tmp/trainer-data-bench-XXXX)
trap 'rm -rf "$out"' EXIT
echo "loader alone (default config, 300 steps of 8 x 128 tokens):"
build/bench_data configs/base.yml --steps 300 data_cache_path="$out/cache"
build/trainer configs/base.yml steps=60 log_period=1000 enable_checkpointing=false base_output_directory="$out" run_name=consume \
  > "$out/consume.log" 2>&1 || { cat "$out/consume.log" >&2; exit 1; }
python3 - "$out/consume/metrics.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])][10:]
print(f"trainer consumption (default model, median of steps 10-59): "
      f"{statistics.median(r['perf/per_device_tokens_per_sec'] for r in rows):.0f} tokens/s; "
      f"median data wait {statistics.median(r['perf/data_wait_seconds'] for r in rows) * 1e3:.3f} ms/step")
PY
for i in $(seq 20); do cat data/fortunes.jsonl; done > "$out/big.jsonl"
echo "preprocess_data, $(du -h "$out/big.jsonl" | cut -f1) of JSON lines:"
# Peak RSS of each run (the children's ru_maxrss): the tool holds one batch of lines and their
# tokens plus the .idx arrays, not the corpus.
peak_rss() {
  python3 -c 'import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True)
print(f"  peak RSS {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024:.0f} MiB", file=sys.stderr)' "$@"
}
PREPROCESS=${PREPROCESS:-build/preprocess_data}
for w in 1 2; do
  peak_rss "$PREPROCESS" --input "$out/big.jsonl" --output-prefix "$out/w$w" --append-eod --workers $w 2>&1 | tail -2
done
cmp "$out/w1_text_document.bin" "$out/w2_text_document.bin" && echo "outputs of 1 and 2 workers are identical"
