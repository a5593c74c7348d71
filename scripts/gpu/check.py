#!/usr/bin/env python3
"""GPU checks that cannot run on the CPU machines (run by scripts/gpu/run_all.sh after build.sh).
Each check compares numbers against an independent computation and prints PASS/FAIL with them;
the exit status is the number of failed checks (0 = all passed).

  1. cuda_vs_cpu: the same fp32 run on the GPU and on the CPU (same binary): step-0 loss to 1e-5
     relative, every later step to 1e-3 (summation order differs; AdamW amplifies it slowly).
  2. k_invariance: (K=4, b=1) and (K=1, b=4) on the GPU give the same per-step loss (per-token mode).
  3. nccl_one_rank: dist_backend=nccl (a real ProcessGroupNCCL, one rank) gives exactly the
     losses and weights of the run without a process group, with buckets + 1 collectives per step.
  4. bf16: 30 bf16 steps train (loss falls), perf/mfu is reported against the H200/H100 peak, and
     the CUDA allocator peaks are reported (allocated <= reserved).
  5. peer: scripts/bench/peer.py on the same GPU from the same weights and samples reproduces the
     trainer's fp32 losses to 1e-4.
  6. moe_grouped_mm: moe-tiny in bf16 with moe_dispatch=grouped (at::_grouped_mm, group offsets on
     the device) against moe_dispatch=loop: the same losses to bf16 tolerance, and one host read
     fewer per MoE layer and micro-batch (2 layers x K=2 = 4 per step).
  7. nccl_sharding_levels: one NCCL rank under data_parallel_sharding=optim_grads and
     optim_grads_params (remat full) gives the losses of the unsharded run (1e-5) with its gradients
     reduce-scattered (NCCL's reduce_scatter, which no CPU run can call); prints each level's CUDA
     peak memory (issue 13: "run one rank of each level under NCCL and report memory").
  8. sync_free_step: a dense model's steps after the first under CUDA's sync debug mode "error"
     (debug_cuda_sync_check=true: any device->host synchronization inside the step stops the run
     naming it), on one process and under NCCL (one rank), fp32 and bf16, with
     perf/host_reads_in_step = 0 in every step (issue 16 part 2); under NCCL 1 when the build has
     no Gloo host group (the trainer logs which), the read of the token count and stop vote. A
     positive control must fail: moe_dispatch=loop reads its group sizes inside the step.
A check whose run fails or throws is reported as FAIL with the trainer's last output lines, and
the next check runs. Every trainer run has a time limit (RUN_SECONDS, default 240).
"""
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINER = os.path.join(ROOT, "build-gpu", "trainer")
OUT = "/tmp/trainer-gpu-checks"
SYNTHETIC = ["dataset_type=synthetic", "pad_id=0", "data_shuffle_seed=0", "model_name=test-tiny"]
RUN_SECONDS = int(os.environ.get("RUN_SECONDS", "240"))
failures = []


class RunFailed(Exception):
    pass


def run_status(name, args):
    """One trainer run: (metric rows, log) or (None, log) when it failed or timed out. The log is
    stdout and stderr together (the trainer's errors go to stdout through spdlog)."""
    cmd = [TRAINER, os.path.join(ROOT, "configs", "base.yml"), f"base_output_directory={OUT}", f"run_name={name}",
           "log_period=1000", "enable_checkpointing=false"] + args
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_SECONDS)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        return None, f"timed out after {RUN_SECONDS} s: {' '.join(cmd)}\n" + \
            (out.decode(errors="replace") if isinstance(out, bytes) else out)[-1500:]
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        return None, f"exit {proc.returncode}: {' '.join(cmd)}\n" + log[-1500:]
    with open(os.path.join(OUT, name, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if "learning/loss" in r], log


def run(name, args):
    """run_status() that raises RunFailed (the check then FAILs with the log's tail)."""
    rows, log = run_status(name, args)
    if rows is None:
        raise RunFailed(log)
    return rows, log


def attempt(name, body):
    """Runs one check; a failed run or an exception is that check's FAIL, and the next one runs."""
    try:
        body()
    except RunFailed as e:
        check(name, False, "a trainer run failed: " + str(e).strip().replace("\n", " | ")[-1500:])
    except Exception as e:  # a missing metric, a parse error: report it, go on
        check(name, False, f"{type(e).__name__}: {e}")


def check(name, ok, detail):
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        failures.append(name)


def rel(a, b):
    return abs(a - b) / max(abs(b), 1e-30)


def losses(rows, key="learning/loss"):
    return [r[key] for r in rows]


subprocess.run(["rm", "-rf", OUT])
common = SYNTHETIC + ["steps=5", "per_device_batch_size=2", "gradient_accumulation_steps=2", "use_qk_norm=true",
                      "override_model_config=true"]


def cuda_vs_cpu():
    cpu, _ = run("cpu", common + ["hardware=cpu"])
    gpu, _ = run("gpu", common + ["hardware=gpu"])
    worst = max(rel(g, c) for g, c in zip(losses(gpu), losses(cpu)))
    check("cuda_vs_cpu", rel(gpu[0]["learning/loss"], cpu[0]["learning/loss"]) <= 1e-5 and worst <= 1e-3 and
          rel(gpu[0]["learning/raw_grad_norm"], cpu[0]["learning/raw_grad_norm"]) <= 1e-4,
          f"step-0 loss gpu {gpu[0]['learning/loss']!r} cpu {cpu[0]['learning/loss']!r}; worst relative loss "
          f"difference over 5 steps {worst:.2e}; step-0 grad norm gpu {gpu[0]['learning/raw_grad_norm']!r} "
          f"cpu {cpu[0]['learning/raw_grad_norm']!r}")


def k_invariance():
    split, _ = run("k4", SYNTHETIC + ["hardware=gpu", "steps=4", "per_device_batch_size=1", "gradient_accumulation_steps=4"])
    whole, _ = run("k1", SYNTHETIC + ["hardware=gpu", "steps=4", "per_device_batch_size=4", "gradient_accumulation_steps=1"])
    worst = max(rel(a, b) for a, b in zip(losses(split), losses(whole)))
    check("k_invariance", worst <= 1e-5 and losses(split)[0] != losses(split)[1],
          f"(K=4,b=1) vs (K=1,b=4): worst relative loss difference over 4 steps {worst:.2e}; "
          f"losses {losses(split)}")


def nccl_one_rank():
    plain, _ = run("local", common + ["hardware=gpu"])
    nccl, log = run("nccl", common + ["hardware=gpu", "dist_backend=nccl", "gradient_bucket_size_mb=1"])
    check("nccl_one_rank", losses(nccl) == losses(plain) and
          losses(nccl, "learning/param_norm") == losses(plain, "learning/param_norm") and "NCCL" in log and
          nccl[0]["perf/collectives_per_step"] >= 2,
          f"losses equal: {losses(nccl) == losses(plain)}; param norms equal: "
          f"{losses(nccl, 'learning/param_norm') == losses(plain, 'learning/param_norm')}; "
          f"collectives per step {nccl[0]['perf/collectives_per_step']}; NCCL named in the log: {'NCCL' in log}")


def nccl_sharding_levels():
    levels = {}
    for level in ["none", "optim_grads", "optim_grads_params"]:
        levels[level] = run("nccl-" + level, common + ["hardware=gpu", "dist_backend=nccl", "remat_policy=full",
                                                       f"data_parallel_sharding={level}"])
    worst = max(rel(a, b) for level in ["optim_grads", "optim_grads_params"]
                for a, b in zip(losses(levels[level][0]), losses(levels["none"][0])))
    scattered = all("gradients by reduce-scatter" in levels[level][1] for level in ["optim_grads", "optim_grads_params"])
    check("nccl_sharding_levels", worst <= 1e-5 and scattered,
          f"worst relative loss difference against none {worst:.2e}; reduce-scatter named in both logs: {scattered}; "
          "cuda peak allocated per level: " +
          ", ".join(f"{level} {levels[level][0][-1].get('memory/cuda_peak_allocated_bytes')}" for level in levels))


def bf16():
    rows, log = run("bf16", SYNTHETIC + ["hardware=gpu", "dtype=bfloat16", "steps=30", "per_device_batch_size=8"])
    first, last = sum(losses(rows)[:5]) / 5, sum(losses(rows)[-5:]) / 5
    row = rows[-1]
    mfu_ok = "perf/mfu" in row and 0 < row["perf/mfu"] < 1 and ("989.4" in log or "H200" not in log)
    mem_ok = 0 < row.get("memory/cuda_peak_allocated_bytes", 0) <= row.get("memory/cuda_peak_reserved_bytes", 0)
    check("bf16", last < first and all(map(math.isfinite, losses(rows))) and mfu_ok and mem_ok,
          f"mean loss of the first 5 steps {first:.4f}, last 5 {last:.4f}; perf/mfu {row.get('perf/mfu')}; "
          f"cuda peak allocated {row.get('memory/cuda_peak_allocated_bytes')} reserved "
          f"{row.get('memory/cuda_peak_reserved_bytes')}; peak line: "
          f"{[l for l in log.splitlines() if 'perf/mfu' in l][:1]}")


def peer():
    run("parity", ["hardware=gpu", "steps=4", "save_checkpoint_on_start=true", "enable_checkpointing=true",
                   "gradient_accumulation_steps=2", "per_device_batch_size=2", "override_model_config=true",
                   "use_qk_norm=true"])
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "bench", "peer.py"), os.path.join(OUT, "parity"),
                           "--device", "cuda", "--trainer", TRAINER, "--check-steps", "4", "--tolerance", "1e-4",
                           "--warmup", "0"], capture_output=True, text=True, timeout=RUN_SECONDS)
    check("peer", proc.returncode == 0, (proc.stdout + proc.stderr).strip().replace("\n", " | ")[-1500:])


moe = ["dataset_type=synthetic", "pad_id=0", "data_shuffle_seed=0", "model_name=moe-tiny", "hardware=gpu",
       "dtype=bfloat16", "steps=4", "per_device_batch_size=2", "gradient_accumulation_steps=2"]


def moe_grouped_mm():
    grouped, _ = run("moe-grouped", moe + ["moe_dispatch=grouped"])
    loop, _ = run("moe-loop", moe + ["moe_dispatch=loop"])
    worst = max(rel(a, b) for a, b in zip(losses(grouped), losses(loop)))
    reads = [r["perf/host_reads_in_step"] for r in grouped], [r["perf/host_reads_in_step"] for r in loop]
    check("moe_grouped_mm", worst <= 2e-2 and all(g == l - 4 for g, l in zip(*reads)),
          f"worst relative loss difference grouped vs loop {worst:.2e}; host reads per step grouped {reads[0]} "
          f"loop {reads[1]}")


def sync_free_step():
    sync = ["hardware=gpu", "steps=4", "per_device_batch_size=2", "gradient_accumulation_steps=2",
            "skip_step_on_spikes=false", "debug_cuda_sync_check=true"]
    results = {}
    for label, extra in [("fp32", []), ("bf16", ["dtype=bfloat16"]), ("nccl-fp32", ["dist_backend=nccl"]),
                         ("nccl-bf16", ["dist_backend=nccl", "dtype=bfloat16"])]:
        rows, log = run_status("sync-" + label, SYNTHETIC + sync + extra)
        # Under NCCL without a Gloo host group the token count and stop vote come back from the
        # device: one counted, allowed read per step (the trainer's start-up log says which).
        expected = 1 if "one host read per step" in log else 0
        ok = rows is not None and len(rows) == 4 and all(r["perf/host_reads_in_step"] == expected for r in rows)
        detail = (f"host reads per step {[r['perf/host_reads_in_step'] for r in rows]} (expected {expected})"
                  if rows is not None else log.strip().splitlines()[-1] if log.strip() else "failed")
        results[label] = (ok, detail)
    # Positive control: the loop dispatch reads its group sizes inside the step, so the mode must stop it.
    rows, log = run_status("sync-control", ["dataset_type=synthetic", "pad_id=0", "data_shuffle_seed=0",
                                            "model_name=moe-tiny", "moe_dispatch=loop"] + sync)
    stopped = "the step made the host wait" in log  # the trainer's own message, not the command line
    results["control (must fail)"] = (rows is None and stopped,
                                      "stopped: " + next((l for l in log.splitlines() if "the step made the host wait" in l),
                                                         "no, it ran through" if rows is not None else log[-300:]))
    check("sync_free_step", all(ok for ok, _ in results.values()),
          "; ".join(f"{label}: {detail}" for label, (ok, detail) in results.items()))


CHECKS = [("cuda_vs_cpu", cuda_vs_cpu), ("k_invariance", k_invariance), ("nccl_one_rank", nccl_one_rank),
          ("bf16", bf16), ("peer", peer), ("moe_grouped_mm", moe_grouped_mm), ("sync_free_step", sync_free_step),
          ("nccl_sharding_levels", nccl_sharding_levels)]
only = set(sys.argv[1:])  # check.py [name ...]: only those
for name, body in CHECKS:
    if not only or name in only:
        attempt(name, body)

ran = len(only) if only else len(CHECKS)
print(f"{len(failures)} of {ran} GPU checks failed: {failures}" if failures else f"all {ran} GPU checks passed")
sys.exit(len(failures))
