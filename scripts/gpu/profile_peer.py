#!/usr/bin/env python3
"""Where the time of one eager training step goes on the GPU, by kernel category, measured on the
PyTorch peer arm (scripts/bench/peer.py's model: the same eager operator sequence as the trainer,
whose per-micro-batch time is within a few percent of it; docs/benchmarks.md). Kineto's CUDA
activity trace over 2 steps after 2 warm-up steps; prints GPU time per step by category and the
share of the step's wall time the GPU was busy.

  scripts/gpu/profile_peer.py RUN_DIR     (a run directory with the trainer's config.yml)
"""
import collections
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import peer  # noqa: E402

# First match wins: attention before GEMM, since cuDNN's flash-attention kernels also carry sm90_.
CATEGORIES = [("attention", ("flash", "fmha", "attention", "mem_eff", "sdpa")),
              ("matmul (GEMM)", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas")),
              ("optimizer (fused AdamW)", ("adam",)),
              ("softmax / cross-entropy", ("softmax", "nll", "cross_entropy", "logsumexp")),
              ("reductions (norms, sums)", ("reduce",)),
              ("elementwise / copies / casts", ("elementwise", "vectorized", "unrolled", "copy", "cat", "fill",
                                                "index", "gather", "scatter", "embedding"))]


def category(name):
    lowered = name.lower()
    for label, keys in CATEGORIES:
        if any(k in lowered for k in keys):
            return label
    return "other"


def main():
    c = peer.read_config(os.path.join(sys.argv[1], "config.yml"))
    device = torch.device("cuda")
    model = peer.Llama(c, peer.random_weights(c, device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    B, L, V = c["per_device_batch_size"], c["max_target_length"], c["vocab_size"]
    tokens = torch.randint(0, V, (B, L + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    positions = torch.arange(L, device=device).repeat(B, 1)
    segments = torch.ones(B, L, dtype=torch.long, device=device)

    def step():
        opt.zero_grad(set_to_none=False)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(inputs, positions, segments, True)
        loss = F.cross_entropy(logits.float().reshape(-1, V), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return float(loss.detach())

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(2):
            step()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / 2
    per_category = collections.Counter()
    per_kernel = collections.Counter()
    for event in prof.key_averages():
        us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if us <= 0:
            continue
        per_category[category(event.key)] += us / 2 / 1e6
        per_kernel[event.key[:90]] += us / 2 / 1e6
    busy = sum(per_category.values())
    print(f"step wall time {wall * 1e3:.1f} ms, GPU busy {busy * 1e3:.1f} ms ({100 * busy / wall:.1f}%)")
    print("| category | ms per step | share of GPU time |")
    print("|---|---|---|")
    for label, seconds in per_category.most_common():
        print(f"| {label} | {seconds * 1e3:.1f} | {100 * seconds / busy:.1f}% |")
    print("top kernels:")
    for name, seconds in per_kernel.most_common(12):
        print(f"  {seconds * 1e3:7.2f} ms  {name}")


if __name__ == "__main__":
    main()
