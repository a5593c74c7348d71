#!/usr/bin/env python3
"""What splitting a MoE layer's GEMMs per expert costs on this machine (CPU, LibTorch via Python).

The grouped CPU dispatch (trainer/model/moe.cpp, GroupedSwiGLU) runs six GEMMs per expert and
layer: forward [g|u] = x W^T and y = h W_d^T; backward dh = dy W_d, dW_d = dy^T h, dx = [dg|du] W,
dW = [dg|du]^T x. For each, this times the E per-expert GEMMs (rows split evenly, as a balanced
router would) against ONE GEMM of the same FLOPs (all rows against one expert's weight), side by
side in one process, median of --repeats. The ratio is the price of E small GEMMs over one large
one; the trainer calls sgemm_ directly, so its loop pays ~5 us per call less than this Python loop.
Defaults: the E = 64 arm of scripts/bench/moe_vs_dense.sh (16,384 routed rows, D 64, F 32).
  /usr/bin/python3 scripts/bench/moe_expert_gemms.py [--experts 64] [--rows 16384] [--dim 64] [--hidden 32]
"""
import argparse
import statistics
import time

import torch


def median_seconds(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=30)
    a = ap.parse_args()
    torch.set_num_threads(1)  # the trainer's LibTorch default on this machine; OpenBLAS keeps its pool
    E, M, D, F = a.experts, a.rows, a.dim, a.hidden
    r = M // E
    M = r * E
    x, gu, h, dy = torch.randn(M, D), torch.randn(M, 2 * F), torch.randn(M, F), torch.randn(M, D)
    W, Wd = torch.randn(E, 2 * F, D), torch.randn(E, D, F)
    rows = lambda t, e: t[e * r:(e + 1) * r]
    # name: (per-expert operands, the one-GEMM operands of equal FLOPs, FLOPs)
    gemms = {
        "fwd [g|u] = x W^T": (lambda e: (rows(x, e), W[e].t()), (x, W[0].t()), 2 * M * D * 2 * F),
        "fwd y = h W_d^T": (lambda e: (rows(h, e), Wd[e].t()), (h, Wd[0].t()), 2 * M * F * D),
        "bwd dh = dy W_d": (lambda e: (rows(dy, e), Wd[e]), (dy, Wd[0]), 2 * M * D * F),
        "bwd dW_d = dy^T h": (lambda e: (rows(dy, e).t(), rows(h, e)), (dy.t(), h), 2 * M * D * F),
        "bwd dx = [dg|du] W": (lambda e: (rows(gu, e), W[e]), (gu, W[0]), 2 * M * 2 * F * D),
        "bwd dW = [dg|du]^T x": (lambda e: (rows(gu, e).t(), rows(x, e)), (gu.t(), x), 2 * M * 2 * F * D),
    }
    print(f"E {E}, {M} rows ({r} per expert), D {D}, F {F}; median of {a.repeats}")
    print("| GEMM | E GEMMs ms | GFLOP/s | one GEMM ms | GFLOP/s | E GEMMs / one |")
    print("|---|---|---|---|---|---|")
    total_split = total_one = 0.0
    for name, (per_expert, whole, flops) in gemms.items():
        pairs = [per_expert(e) for e in range(E)]

        def split():
            for p, q in pairs:
                torch.mm(p, q)

        t_split = median_seconds(split, a.repeats)
        t_one = median_seconds(lambda: torch.mm(*whole), a.repeats)
        total_split += t_split
        total_one += t_one
        print(f"| {name} | {t_split * 1e3:.3f} | {flops / t_split / 1e9:.0f} | {t_one * 1e3:.3f} | "
              f"{flops / t_one / 1e9:.0f} | {t_split / t_one:.2f}x |")
    print(f"| all six | {total_split * 1e3:.3f} | | {total_one * 1e3:.3f} | | {total_split / total_one:.2f}x |")


if __name__ == "__main__":
    main()
