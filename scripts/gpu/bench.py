#!/usr/bin/env python3
"""GPU benchmark: trainer against the PyTorch peer (scripts/bench/peer.py) on the same GPU, same
model, data, loss, AdamW and schedule. Default shape: Llama 3.2 1B (1.24B parameters), sequence
2048, bf16 autocast, micro-batch 8, at K=1 and K=8. Arms run one after the other in one process
tree (trainer K=1, peer K=1, trainer K=8, peer K=8); step times are medians after warm-up.
MFU = model FLOPs (MaxText's formula, the trainer's perf/per_device_tflops_per_sec) / time / the
device's dense bf16 peak (989.4 TFLOP/s for H100/H200 SXM). Prints a markdown table.

  scripts/gpu/bench.py [--model llama3.2-1b] [--batch 8] [--seq 2048] [--ks 1,8] [--steps 12]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = os.path.join(ROOT, "build-gpu", "trainer")
OUT = "/tmp/trainer-gpu-bench"
ARM_SECONDS = int(os.environ.get("ARM_SECONDS", "150"))  # one arm's limit: a hang costs this, not the whole call


def trainer_arm(name, overrides, warmup):
    cmd = [TRAINER, os.path.join(ROOT, "configs", "base.yml"), f"base_output_directory={OUT}", f"run_name={name}",
           "save_checkpoint_on_start=false", "enable_checkpointing=false"] + overrides
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=ARM_SECONDS)
    if proc.returncode != 0:  # the trainer's errors go to stdout (spdlog)
        sys.exit(f"trainer arm failed: {' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-3000:]}")
    rows = [json.loads(l) for l in open(os.path.join(OUT, name, "metrics.jsonl")) if '"learning/loss"' in l]
    timed = rows[warmup:]
    times = [r["perf/step_time_seconds"] for r in timed]
    median = statistics.median(times)
    flops = statistics.median(r["perf/per_device_tflops_per_sec"] * r["perf/step_time_seconds"] for r in timed) * 1e12
    return {"median": median, "mean": statistics.mean(times), "max": max(times), "flops": flops,
            "mfu": statistics.median(r.get("perf/mfu", float("nan")) for r in timed),
            "allocated": rows[-1].get("memory/cuda_peak_allocated_bytes", 0),
            "reserved": rows[-1].get("memory/cuda_peak_reserved_bytes", 0), "wall": time.time() - start,
            "loss0": rows[0]["learning/loss"], "log": proc.stdout + proc.stderr}


def peer_arm(name, warmup):
    start = time.time()
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench", "peer.py"), os.path.join(OUT, name),
                           "--device", "cuda", "--random-init", "--trainer", TRAINER, "--warmup", str(warmup)],
                          capture_output=True, text=True, timeout=ARM_SECONDS)
    if proc.returncode != 0:
        sys.exit(f"peer arm failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"median": r["peer_median_step_seconds"], "mean": r["peer_mean"], "max": r["peer_max"],
            "allocated": r.get("peer_cuda_peak_allocated_bytes", 0), "reserved": r.get("peer_cuda_peak_reserved_bytes", 0),
            "wall": time.time() - start, "loss0": r["step0_loss_peer"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama3.2-1b")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--ks", default="1,8")
    ap.add_argument("--steps", type=int, default=12, help="steps at K=1; K>1 runs max(6, steps/K*2)")
    ap.add_argument("--peak", type=float, default=989.4, help="dense bf16 TFLOP/s of the device (H100/H200 SXM)")
    args = ap.parse_args()
    subprocess.run(["rm", "-rf", OUT])
    gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True).stdout.strip()
    print(f"device: {gpu}; model {args.model}, seq {args.seq}, micro-batch {args.batch}, bf16", flush=True)
    print("| arm | K | median s/step | mean | max | tokens/s | TFLOP/s | MFU | peak allocated GiB | peak reserved GiB | step-0 loss |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for K in (int(k) for k in args.ks.split(",")):
        steps = args.steps if K == 1 else max(6, args.steps * 2 // K)
        warmup = 3 if K == 1 else 2
        name = f"{args.model}-k{K}"
        overrides = [f"model_name={args.model}", f"max_target_length={args.seq}", "dtype=bfloat16", "hardware=gpu",
                     f"per_device_batch_size={args.batch}", f"gradient_accumulation_steps={K}", f"steps={steps}",
                     "log_period=1"]
        t = trainer_arm(name, overrides, warmup)
        p = peer_arm(name, warmup)
        tokens = args.batch * K * args.seq
        for arm, r in (("trainer", t), ("peer", p)):
            mfu = t["flops"] / r["median"] / 1e12 / args.peak
            print(f"| {arm} | {K} | {r['median']:.4f} | {r['mean']:.4f} | {r['max']:.4f} | {tokens / r['median']:,.0f} | "
                  f"{t['flops'] / r['median'] / 1e12:.1f} | {100 * mfu:.1f}% | {r['allocated'] / 2**30:.2f} | "
                  f"{r['reserved'] / 2**30:.2f} | {r['loss0']:.4f} |", flush=True)
        print(f"<!-- K={K}: peer/trainer time ratio {p['median'] / t['median']:.3f}; trainer-reported perf/mfu "
              f"{t['mfu']}; wall s trainer {t['wall']:.0f} peer {p['wall']:.0f} -->", flush=True)
        startup = [l for l in t["log"].splitlines() if "perf/mfu against" in l or "startup:" in l]
        print("<!-- " + " / ".join(s[-160:] for s in startup[:2]) + " -->", flush=True)


if __name__ == "__main__":
    main()
