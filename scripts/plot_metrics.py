#!/usr/bin/python3
"""Plot training runs: loss, lm_loss, grad norm, learning rate and throughput, runs overlaid.

Inputs are trainer metrics.jsonl files (one JSON object per step) or Megatron-LM logs (lines with
"iteration N/M | ... | lm loss: X | ... | grad norm: Y |"). Needs Debian's python3-matplotlib.

  scripts/plot_metrics.py runs/a/metrics.jsonl runs/b/metrics.jsonl megatron.log -o runs.png
"""
import argparse
import json
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

PANELS = [("learning/loss", "loss (J)"), ("learning/lm_loss", "lm_loss"), ("learning/raw_grad_norm", "grad norm (raw)"),
          ("learning/current_learning_rate", "learning rate"), ("perf/per_device_tokens_per_sec", "tokens/s/device")]
MEGATRON = {"lm loss": "learning/lm_loss", "grad norm": "learning/raw_grad_norm", "learning rate": "learning/current_learning_rate"}


def read_run(path):
    series = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                row = json.loads(line)
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
                        series.setdefault(key, []).append((step, float(v.group(1))))
                ms = re.search(r"elapsed time per iteration \(ms\): ([0-9.]+)", line)
                bs = re.search(r"global batch size:\s+(\d+)", line)
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
    args = parser.parse_args()
    labels = args.labels or args.inputs
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.4))
    for path, label in zip(args.inputs, labels):
        series = read_run(path)
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
