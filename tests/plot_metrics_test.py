#!/usr/bin/python3
"""scripts/plot_metrics.py: what it reads from metrics.jsonl and Megatron logs (values checked),
and the inputs it refuses with a message instead of a traceback. The plot itself is drawn where
matplotlib is installed (Debian 12's half of the suite; the LibTorch 2 chroot has none) and says
which it did."""
import importlib.util
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "plot_metrics.py")
spec = importlib.util.spec_from_file_location("plot_metrics", SCRIPT)
plot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot)
failures = []


def check(condition, what):
    if not condition:
        failures.append(what)


def run(*args):
    result = subprocess.run([sys.executable, SCRIPT, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            timeout=120)
    return result.returncode, result.stdout


work = tempfile.mkdtemp(prefix="trainer-plot-")
try:
    jsonl = os.path.join(work, "metrics.jsonl")
    rows = [{"step": s, "learning/loss": 5.0 - s, "learning/lm_loss": 4.5 - s, "learning/raw_grad_norm": 1.5,
             "learning/current_learning_rate": 1e-3, "perf/per_device_tokens_per_sec": 1000.0 + s} for s in range(3)]
    with open(jsonl, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
        f.write('{"step": 2, "eval/lm_loss": 4.0}\n')  # an evaluation line: not a training step
        f.write('{"step": 3, "learning/lo')  # a run still writing: the torn last line is left out
    series = plot.read_run(jsonl)
    check(series["learning/loss"] == [(0, 5.0), (1, 4.0), (2, 3.0)], "loss series %s" % series.get("learning/loss"))
    check(series["perf/per_device_tokens_per_sec"][-1] == (2, 1002.0), "tokens/s series")

    megatron = os.path.join(work, "megatron.log")
    with open(megatron, "w") as f:
        f.write(" [2026-12-01 10:00:00.000000] iteration        1/      10 | consumed samples:            8 | "
                "elapsed time per iteration (ms): 250.0 | learning rate: 1.000000E-03 | global batch size:     8 | "
                "lm loss: 5.500000E+00 | loss scale: 1.0 | grad norm: 2.000 | params norm: 10.000 |\n")
    plot.SEQ_LENGTH, plot.WORLD_SIZE = 128, 2
    series = plot.read_run(megatron)
    check(series["learning/lm_loss"] == [(0, 5.5)], "Megatron lm loss %s" % series.get("learning/lm_loss"))
    # Its learning rate is the one after the scheduler's step: the rate of the next iteration (step 1).
    check(series["learning/current_learning_rate"] == [(1, 1e-3)], "Megatron lr %s" % series.get("learning/current_learning_rate"))
    # 8 samples x 128 tokens / 2 ranks in 0.25 s: it was parsed and never used (an empty panel).
    check(series["perf/per_device_tokens_per_sec"] == [(0, 2048.0)], "Megatron tokens/s %s" % series.get("perf/per_device_tokens_per_sec"))

    # Refusals: a message and a code, never a traceback.
    broken = os.path.join(work, "broken.jsonl")
    with open(broken, "w") as f:
        f.write('{"step": 0, "learning/loss": 1.0}\n{"step": 1, "learn\n{"step": 2, "learning/loss": 1.0}\n')
    for args, code, message in [
        ((os.path.join(work, "nope.jsonl"),), 1, "cannot read"),
        ((broken,), 1, "broken.jsonl line 2 is not JSON"),
        ((jsonl, megatron, "--labels", "A"), 2, "--labels gives 1 labels for 2 inputs"),
        ((jsonl, "-o", os.path.join(work, "missing", "x.png")), 2, "no directory"),
    ]:
        got_code, output = run(*args)
        check(got_code == code and message in output and "Traceback" not in output,
              "%s: exit %d, output %r" % (args, got_code, output))

    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_metrics_test: the reading and the refusals checked; no matplotlib here, so no plot drawn")
    else:
        png = os.path.join(work, "out.png")
        got_code, output = run(jsonl, megatron, "--seq-length", "128", "-o", png)
        check(got_code == 0 and os.path.getsize(png) > 1000, "plot: exit %d, %r" % (got_code, output))
        with open(png, "rb") as f:
            check(f.read(8) == b"\x89PNG\r\n\x1a\n", "the plot is a PNG")
finally:
    subprocess.run(["rm", "-rf", work])

for failure in failures:
    print("FAILED:", failure)
sys.exit(1 if failures else 0)
