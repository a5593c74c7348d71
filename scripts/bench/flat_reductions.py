#!/usr/bin/python3
"""Cost of the exact flat-buffer reductions (train/step.cpp: fp32 rows of 1024 combined in fp64)
against the plain fp32 norm() and eq(0).sum() they replaced, on gradient-sized buffers, with the
same LibTorch kernels (Debian's python3-torch is the same 1.13 build the trainer links), one
thread, side by side in one run: the median of REPS after 3 warm-up calls, and each one's
relative error against a float64 reference.
  scripts/bench/flat_reductions.py [--sizes 459904,25000000,104000000] [--reps 15]"""
import argparse
import statistics
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--sizes", default="459904,25000000,104000000")
parser.add_argument("--reps", type=int, default=15)
args = parser.parse_args()
torch.set_num_threads(1)
ROW = 1024


def new_norm(x):
    rows = x.numel() // ROW
    total = torch.linalg.vector_norm(x[: rows * ROW].view(rows, ROW), 2, dim=1).double().square().sum()
    return (total + x[rows * ROW:].double().square().sum()).sqrt()


def new_zeros(x):
    rows = x.numel() // ROW
    nonzero = torch.linalg.vector_norm(x[: rows * ROW].view(rows, ROW), 0, dim=1).double().sum()
    return x.numel() - (nonzero + (x[rows * ROW:] != 0).sum())


def median_seconds(fn, x):
    for _ in range(3):
        fn(x)
    times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


print("| elements | old norm + zeros (ms) | new norm + zeros (ms) | new / old | old norm rel. error | new norm rel. error |")
print("|---|---|---|---|---|---|")
for n in (int(s) for s in args.sizes.split(",")):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, generator=g) * 1e-2
    x[::7] *= 100
    x[::13] = 0
    reference = x.double().square().sum().sqrt().item()
    old = median_seconds(lambda t: (t.norm(), t.eq(0).sum()), x)
    new = median_seconds(lambda t: (new_norm(t), new_zeros(t)), x)
    print(f"| {n:,} | {old * 1e3:.2f} | {new * 1e3:.2f} | {new / old:.2f} | "
          f"{(x.norm().item() - reference) / reference:.1e} | {(new_norm(x).item() - reference) / reference:.1e} |")
