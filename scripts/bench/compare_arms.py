#!/usr/bin/env python3
"""Side-by-side benchmark of trainer configurations ("arms") on this machine.

Runs the arms alternately (A B C A B C ...), untraced, each for --steps steps, reads each run's
metrics.jsonl and reports per arm: median / mean / max step time over the steps after --warmup,
tokens/s from the median, peak RSS of the process, and the ratio to the first arm. Ratios are what
to quote on shared CPUs; absolute times only on a dedicated machine (DESIGN section 9).

Usage:
  scripts/bench/compare_arms.py --steps 60 --warmup 10 --rounds 2 \
      --arm dense "model_name=moe-tiny override_model_config=true num_experts=1 shared_experts=0 base_mlp_dim=108" \
      --arm moe   "model_name=moe-tiny"
Two builds of trainer side by side: --binary NAME PATH runs arm NAME with PATH instead of
build/trainer (e.g. a build from before a change). PATH's own source tree's configs/base.yml
(PATH/../../configs/base.yml, when there is one) is its base config: an older binary refuses keys
added since.
"""
import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_arm(binary, overrides, steps, out_dir, run_name):
    own_base = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(binary))), "configs", "base.yml")
    base = own_base if os.path.exists(own_base) else os.path.join(ROOT, "configs", "base.yml")
    cmd = [binary, base,
           f"steps={steps}", f"base_output_directory={out_dir}", f"run_name={run_name}",
           f"log_period={steps}"] + shlex.split(overrides)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    stderr = proc.stderr.read().decode()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"arm failed ({' '.join(cmd)}):\n{stderr}")
    with open(os.path.join(out_dir, run_name, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(out_dir, run_name, "config.yml")) as f:
        config = dict(line.split(": ", 1) for line in f.read().splitlines() if ": " in line and not line.startswith("#"))
    tokens = int(config["per_device_batch_size"]) * int(config["gradient_accumulation_steps"]) * \
        int(config["max_target_length"])
    return rows, tokens, usage.ru_maxrss * 1024


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arm", nargs=2, action="append", metavar=("NAME", "OVERRIDES"), required=True)
    parser.add_argument("--binary", nargs=2, action="append", metavar=("NAME", "PATH"), default=[])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    binaries = dict(args.binary)
    unknown = set(binaries) - {name for name, _ in args.arm}
    if unknown:
        sys.exit(f"--binary names no arm: {', '.join(sorted(unknown))}")
    times = {name: [] for name, _ in args.arm}
    info = {}
    with tempfile.TemporaryDirectory(prefix="trainer-bench-") as out_dir:
        for r in range(args.rounds):
            for name, overrides in args.arm:
                binary = binaries.get(name, os.path.join(ROOT, "build", "trainer"))
                rows, tokens, rss = run_arm(binary, overrides, args.steps, out_dir, f"{name}-{r}")
                times[name] += [row["perf/step_time_seconds"] for row in rows[args.warmup:]]
                info[name] = (tokens, max(rss, info.get(name, (0, 0))[1]))
                print(f"round {r + 1}/{args.rounds} {name}: done", file=sys.stderr)

    base = None
    print(f"| arm | median s/step | mean | max | tokens/s (median) | peak RSS MiB | time vs {args.arm[0][0]} |")
    print("|---|---|---|---|---|---|---|")
    for name, overrides in args.arm:
        t = times[name]
        med = statistics.median(t)
        base = base or med
        tokens, rss = info[name]
        print(f"| {name} | {med:.4f} | {statistics.mean(t):.4f} | {max(t):.4f} | {tokens / med:.0f} | "
              f"{rss / 2**20:.0f} | {med / base:.2f}x |")
    print(f"\n{args.rounds} rounds x {args.steps} steps per arm, alternating; statistics over steps "
          f">= {args.warmup} of every run ({len(times[args.arm[0][0]])} steps per arm).")
    for name, overrides in args.arm:
        print(f"- {name}: `{overrides}`" + (f" with {binaries[name]}" if name in binaries else ""))


if __name__ == "__main__":
    main()
