#!/usr/bin/python3
"""Plot training runs: loss, lm_loss, grad norm, learning rate and throughput, runs overlaid.

Inputs are trainer metrics.jsonl files (one JSON object per step) or Megatron-LM logs (lines with
"iteration N/M | ... | lm loss: X | ... | grad norm: Y |"). Needs Debian's python3-matplotlib.

  scripts/plot_metrics.py runs/a/metrics.jsonl runs/b/metrics.jsonl megatron.log -o runs.png
"""
import argparse
import json
import os
import re
import sys

PANELS = [("learning/loss", "loss (J)"), ("learning/lm_loss", "lm_loss"), ("learning/raw_grad_norm", "grad norm (raw)"),
          ("learning/current_learning_rate", "learning rate"), ("perf/per_device_tokens_per_sec", "tokens/s/device")]
SEQ_LENGTH, WORLD_SIZE = 0, 1  # --seq-length, --world-size
MEGATRON = {"lm loss": "learning/lm_loss", "grad norm": "learning/raw_grad_norm", "learning rate": "learning/current_learning_rate"}


def read_run(path):
    """{metric: [(step, value)]} of one metrics.jsonl or Megatron log; exits naming the path or line."""
    series = {}
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n")
    except OSError as e:
        sys.exit(f"plot_metrics: cannot read {path}: {e.strerror}")
    for number, line in enumerate(lines, 1):
        line = line.strip()
        if line.startswith("{"):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                if number == len(lines):  # a run still writing: its last line is torn
                    continue
                sys.exit(f"plot_metrics: {path} line {number} is not JSON: {e.msg}")
            if not isinstance(row, dict) or "step" not in row:
                sys.exit(f"plot_metrics: {path} line {number} has no \"step\"")
            if "learning/loss" not in row:
                continue  # evaluation lines
            for key, _ in PANELS:
                if key in row:
                    series.setdefault(key, []).append((row["step"], row[key]))
        elif "iteration" in line and "|" in line:  # Megatron training_log
            m = re.search(r"iteration\s+(\d+)/", line)
            if not m:
                continue
            step = int(m.group(1)) - 1
            for name, key in MEGATRON.items():
                v = re.search(re.escape(name) + r": ([0-9.eE+-]+)", line)
                if v:
                    # Megatron logs the rate after its scheduler's step: the next iteration's.
                    series.setdefault(key, []).append((step + 1 if name == "learning rate" else step, float(v.group(1))))
            # Throughput from the iteration time and global batch size; the sequence length is
            # not in the line: --seq-length gives it (without it the panel stays empty).
            ms = re.search(r"elapsed time per iteration \(ms\): ([0-9.]+)", line)
            bs = re.search(r"global batch size:\s+(\d+)", line)
            if ms and bs and SEQ_LENGTH and float(ms.group(1)) > 0:
                tokens = int(bs.group(1)) * SEQ_LENGTH / WORLD_SIZE
                series.setdefault("perf/per_device_tokens_per_sec", []).append(
                    (step, tokens / (float(ms.group(1)) / 1000)))
            if "learning/lm_loss" in series and ("learning/loss" not in series or len(series["learning/loss"]) < len(series["learning/lm_loss"])):
                series.setdefault("learning/loss", []).append(series["learning/lm_loss"][-1])
    if not series:
        sys.exit(f"plot_metrics: no metrics found in {path}")
    return series


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", help="metrics.jsonl files or Megatron logs")
    parser.add_argument("-o", "--output", default="metrics.png")
    parser.add_argument("--labels", nargs="*", help="one label per input (default: the paths)")
    parser.add_argument("--seq-length", type=int, default=0,
                        help="Megatron logs: tokens per sample, for the tokens/s panel (the log does not say)")
    parser.add_argument("--world-size", type=int, default=1, help="Megatron logs: ranks, for tokens/s per device")
    args = parser.parse_args()
    if args.labels is not None and len(args.labels) != len(args.inputs):
        parser.error(f"--labels gives {len(args.labels)} labels for {len(args.inputs)} inputs")
    if args.seq_length < 0 or args.world_size < 1:
        parser.error("--seq-length must be >= 0 and --world-size >= 1")
    global SEQ_LENGTH, WORLD_SIZE
    SEQ_LENGTH, WORLD_SIZE = args.seq_length, args.world_size
    output_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(output_dir):
        parser.error(f"-o {args.output}: no directory {output_dir}")
    labels = args.labels or args.inputs
    runs = [read_run(path) for path in args.inputs]  # every input read before anything is drawn
    import matplotlib  # here: reading and checking need no matplotlib (tests/plot_metrics_test.py)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.4))
    for series, label in zip(runs, labels):
        for ax, (key, title) in zip(axes, PANELS):
            if key in series:
                steps, values = zip(*series[key])
                ax.plot(steps, values, label=label, linewidth=1)
            ax.set_title(title)
            ax.set_xlabel("step")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(args.output, dpi=90)
    print(f"plot_metrics: wrote {args.output}", file=sys.stderr)


if __name__ == "__main__":
    main()
