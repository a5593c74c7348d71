#!/usr/bin/env bash
# The GPU session in two calls of the device tool (each call may run 600 s at most; the build
# of the first stays on the machine while it is warm): part 1 builds against the wheel's LibTorch
# and runs the GPU checks and the resume-crash tests; part 2 the benchmark against the PyTorch
# peer, GLA against SDPA, the memory plan, the profile, then the CPU test suite under this
# LibTorch (minus the mpirun tests: no MPI there) for the time that is left of TOTAL_SECONDS
# (default 480). Part 2 builds first if build-gpu/ is missing (a cold machine).
# Logs go to $OUT (the device tool's folder) or ./gpu-logs.
#   scripts/gpu/run_all.sh 1 | 2 | all    needs .gpu-deps/ (scripts/gpu/prepare_deps.sh) beside it
#   (all: both parts in one call, when the call's limit allows)
set -uo pipefail
cd "$(dirname "$0")/../.."
log=${OUT:-$PWD/gpu-logs}
mkdir -p "$log" data
cp -n .gpu-deps/data/* data/ 2>/dev/null
export LD_LIBRARY_PATH="$PWD/.gpu-deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
phase() { echo "=== $1 ($(date +%T), ${SECONDS}s)"; }
part=${1:-all}
case "$part" in 1|2|all) ;; *) echo "usage: scripts/gpu/run_all.sh 1|2|all" >&2; exit 2 ;; esac
shift $(( $# > 0 ? 1 : 0 ))

phase "device"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$log/device.txt"
g++ --version | head -1 | tee -a "$log/device.txt"
# Every phase runs (one machine start gathers all it can); the exit status says whether any failed.
failures=()
finish() {
  phase "done${1:+ ($1)}"
  if (( ${#failures[@]} > 0 )); then echo "failed: ${failures[*]}"; exit 1; fi
  exit 0
}
if [[ $part != 2 || ! -x build-gpu/trainer ]]; then
  phase "build"
  if ! scripts/gpu/build.sh > "$log/build.log" 2>&1; then
    grep -E "error|Error|CMake Error" "$log/build.log" | head -60
    tail -40 "$log/build.log"
    exit 1
  fi
  tail -3 "$log/build.log"
fi
if [[ $part != 2 ]]; then
phase "checks"
python3 scripts/gpu/check.py 2>&1 | tee "$log/check.log" || failures+=(checks)
phase "the 2.11 resume crash (docs/checkpoints.md, known issue): the two tests, native stack on a crash"
(cd build-gpu && timeout 120 ./trainer_tests "a flipped byte in model.safetensors*" \
   "kill -9 at random moments never leaves a checkpoint that is taken for complete" > "$log/resume_crash.log" 2>&1) ||
  failures+=(resume-crash-tests)
grep -E "fatal signal|^/|libtorch|trainer\(|test cases|assertions" "$log/resume_crash.log" | head -80
fi
[[ $part == 1 ]] && finish "part 1"
phase "benchmark"
timeout "${BENCH_SECONDS:-240}" python3 scripts/gpu/bench.py "$@" 2>&1 | tee "$log/bench.log" || failures+=(benchmark)
phase "one GLA layer against one SDPA (GQA) layer and one MLA layer at 4096 tokens, bf16 (issue 17; docs/benchmarks.md)"
# ling2's layer shape (D 2048, 16 heads of 128), one decoder layer with a dense MLP, byte vocabulary:
# the attention is what differs. Tokens/s is the median over steps 4-11.
for kind in global gla mla; do  # mla: its layer at ling2's dims (q/k 192, v 128), and the kernel CUDA picks for it
  timeout 120 build-gpu/trainer configs/base.yml hardware=gpu dtype=bfloat16 model_name=ling2 override_model_config=true \
    attention_type=$kind inhomogeneous_layer_cycle_interval=0 base_num_decoder_layers=1 num_experts=1 shared_experts=0 \
    routed_bias=false n_routing_groups=-1 topk_routing_group=-1 moe_shared_expert_dim=0 mtp_num_layers=0 mtp_moe_mlp=false \
    vocab_size=258 max_target_length=4096 per_device_batch_size=1 steps=12 log_period=12 enable_checkpointing=false \
    dataset_type=synthetic pad_id=0 base_output_directory=/tmp/trainer-gpu-gla run_name=$kind > "$log/gla_$kind.log" 2>&1 \
    || { echo "$kind: failed"; tail -5 "$log/gla_$kind.log"; failures+=("gla-$kind"); continue; }
  python3 -c 'import json,statistics,sys; r=[json.loads(l) for l in open(sys.argv[1])][4:]; print("%s layer: %.0f tokens/s (median step %.4f s)" % (sys.argv[2], statistics.median(x["perf/per_device_tokens_per_sec"] for x in r), statistics.median(x["perf/step_time_seconds"] for x in r)))' \
    "/tmp/trainer-gpu-gla/$kind/metrics.jsonl" "$kind" | tee -a "$log/gla_vs_sdpa.log"
  grep -h "attention:" "$log/gla_$kind.log" | tee -a "$log/gla_vs_sdpa.log"
done
phase "memory plan against the CUDA allocator's peak (docs/memory.md)"
for K in 1 8; do
  plan=$(timeout 30 build-gpu/trainer configs/base.yml hardware=gpu dtype=bfloat16 model_name=llama3.2-1b \
         max_target_length=2048 per_device_batch_size=8 gradient_accumulation_steps=$K --dry-run | sed -n 's/.*total .*(\([0-9]*\) bytes).*/\1/p')
  peak=$(python3 -c 'import json,sys; print(json.loads(open(sys.argv[1]).readlines()[-1]).get("memory/cuda_peak_allocated_bytes", 0))' \
         "/tmp/trainer-gpu-bench/llama3.2-1b-k$K/metrics.jsonl" 2>/dev/null)
  echo "llama3.2-1b bf16 K=$K: plan $plan bytes, CUDA peak allocated ${peak:-unknown} bytes" | tee -a "$log/memory_plan.log"
done
phase "profile (peer arm, kernel categories)"
timeout 90 python3 scripts/gpu/profile_peer.py /tmp/trainer-gpu-bench/llama3.2-1b-k1 2>&1 | tee "$log/profile.log"
phase "CPU test suite on this LibTorch (no mpirun, no Gloo here)"
left=$(( ${TOTAL_SECONDS:-480} - SECONDS ))
echo "ctest gets ${left}s"
# Left out, by name: the tests that launch mpirun, the one that needs Gloo (the wheel ships no Gloo
# headers; NCCL's one-rank group is checked by check.py instead) and the Debian-python peer test.
if (( left > 10 )); then
  (cd build-gpu && timeout "${CTEST_SECONDS:-$left}" ctest -j 1 --timeout 120 --output-on-failure \
     -E "mpirun|^one all-reduce per gradient|^a rank that dies|R=2 resume|pretrain_ling2|^ZeRO-1|peer_parity|^a named backend" \
     > "$log/ctest.log" 2>&1) || failures+=(ctest)
else
  echo "no time left for ctest (TOTAL_SECONDS=${TOTAL_SECONDS:-480})" > "$log/ctest.log"
  failures+=(ctest-not-run)
fi
grep -E "tests passed|tests failed|\*\*\*Failed|Timeout|Not Run|FAILED|with expansion|^  [A-Za-z0-9(]" "$log/ctest.log" | head -60
finish
