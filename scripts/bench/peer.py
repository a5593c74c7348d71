#!/usr/bin/python3
"""The PyTorch peer arm: the same dense Llama model, loss (per-token sum/sum), AdamW, clipping and
LR schedule as an ordinary PyTorch training loop, reading the trainer's resolved config.yml so the
arms cannot drift, the trainer's initial weights (checkpoint 0, safetensors) and the trainer's
samples (--dump-samples). Debian's python3-torch (1.13) on CPU; the PyTorch wheel (2.x) on a
GPU, with bf16 autocast when the config says dtype: bfloat16 and the fused causal attention
(scaled_dot_product_attention) where the rows hold one segment, as the trainer does.

  peer.py RUN_DIR [--steps N] [--threads T] [--device cuda] [--random-init]
prints the peer's step losses next to the trainer's metrics.jsonl and the median step time.
Run the trainer first with save_checkpoint_on_start=true (see scripts/bench/peer_parity.sh), or
pass --random-init (speed comparisons of large models: no multi-GB weight file).
"""
import argparse
import json
import math
import os
import statistics
import struct
import subprocess
import sys
import time

import torch
import torch.nn.functional as F


def read_config(path):
    config = {}
    for line in open(path):
        if line.startswith("#") or ": " not in line:
            continue
        key, value = line.rstrip("\n").split(": ", 1)
        value = value.strip().strip('"')
        for cast in (int, float):
            try:
                value = cast(value)
                break
            except ValueError:
                pass
        if value in ("true", "false"):
            value = value == "true"
        config[key] = value
    return config


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        if t["dtype"] == "BF16":  # the upper half of an fp32
            half = torch.frombuffer(bytearray(data[a:b]), dtype=torch.int16).to(torch.int32)
            out[name] = ((half & 0xFFFF) << 16).view(torch.float32).reshape(t["shape"])
        else:
            assert t["dtype"] == "F32", (name, t["dtype"])
            out[name] = torch.frombuffer(bytearray(data[a:b]), dtype=torch.float32).reshape(t["shape"])
    return out


class Llama(torch.nn.Module):
    def __init__(self, c, w):
        super().__init__()
        self.c = c
        self.p = torch.nn.ParameterDict({k.replace(".", "__"): torch.nn.Parameter(v.clone()) for k, v in w.items()
                                         if not k.endswith("e_score_correction_bias")})

    def w(self, name):
        return self.p[name.replace(".", "__")]

    def norm(self, x, name):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.c["normalization_layer_epsilon"]) * self.w(name)

    def forward(self, tokens, positions, segments, one_segment):
        c = self.c
        B, L = tokens.shape
        Hq, Hkv, hd = c["base_num_query_heads"], c["base_num_kv_heads"], c["head_dim"]
        rot = int(round(c["partial_rotary_factor"] * hd))
        inv = c["rope_max_timescale"] ** (-torch.arange(0, rot, 2, dtype=torch.float32, device=tokens.device) / rot)
        if c.get("rope_type", "default") == "llama3":  # transformers' _compute_llama3_parameters
            old = c["original_max_position_embeddings"]
            lo, hi, factor = c["rope_low_freq_factor"], c["rope_high_freq_factor"], c["rope_factor"]
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > old / lo, inv / factor, inv)
            smooth = (old / wavelen - lo) / (hi - lo)
            medium = (wavelen >= old / hi) & (wavelen <= old / lo)
            inv = torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
        else:
            assert c.get("rope_type", "default") == "default", c["rope_type"]
        ang = positions.float().unsqueeze(-1) * inv
        emb = torch.cat([ang, ang], -1).unsqueeze(1)
        cos, sin = emb.cos(), emb.sin()

        def rope(x):
            r, p = x[..., :rot], x[..., rot:]
            half = rot // 2
            rh = torch.cat([-r[..., half:], r[..., :half]], -1)
            return torch.cat([r * cos + rh * sin, p], -1)

        fused = hasattr(F, "scaled_dot_product_attention") and one_segment  # known on the host: no sync
        allowed = (segments.unsqueeze(2) == segments.unsqueeze(1)) & torch.ones(L, L, dtype=torch.bool,
                                                                                device=tokens.device).tril()
        x = F.embedding(tokens, self.w("model.embed_tokens.weight"))
        for i in range(c["base_num_decoder_layers"]):
            pre = f"model.layers.{i}."
            h = self.norm(x, pre + "input_layernorm.weight")
            q = F.linear(h, self.w(pre + "self_attn.q_proj.weight")).view(B, L, Hq, hd)
            k = F.linear(h, self.w(pre + "self_attn.k_proj.weight")).view(B, L, Hkv, hd)
            v = F.linear(h, self.w(pre + "self_attn.v_proj.weight")).view(B, L, Hkv, hd)
            if c["use_qk_norm"]:
                q, k = self.norm(q, pre + "self_attn.q_norm.weight"), self.norm(k, pre + "self_attn.k_norm.weight")
            q, k, v = rope(q.transpose(1, 2)), rope(k.transpose(1, 2)), v.transpose(1, 2)
            k, v = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
            if fused:
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                s = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
                a = s.masked_fill(~allowed.unsqueeze(1), float("-inf")).softmax(-1).to(v.dtype) @ v
            a = a.transpose(1, 2).reshape(B, L, Hq * hd)
            x = x + F.linear(a, self.w(pre + "self_attn.o_proj.weight"))
            h = self.norm(x, pre + "post_attention_layernorm.weight")
            g = F.silu(F.linear(h, self.w(pre + "mlp.gate_proj.weight"))) * F.linear(h, self.w(pre + "mlp.up_proj.weight"))
            x = x + F.linear(g, self.w(pre + "mlp.down_proj.weight"))
        x = self.norm(x, "model.norm.weight")
        head = self.w("model.embed_tokens.weight") if c["logits_via_embedding"] else self.w("lm_head.weight")
        return F.linear(x, head)


def random_weights(c, device):
    """Fresh weights of the trainer's shapes and init law, made on the device (no file)."""
    D, F_, V, hd = c["base_emb_dim"], c["base_mlp_dim"], c["vocab_size"], c["head_dim"]
    Hq, Hkv = c["base_num_query_heads"], c["base_num_kv_heads"]
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    if not c["logits_via_embedding"]:
        shapes["lm_head.weight"] = (V, D)
    for i in range(c["base_num_decoder_layers"]):
        pre = f"model.layers.{i}."
        shapes.update({pre + "input_layernorm.weight": (D,), pre + "post_attention_layernorm.weight": (D,),
                       pre + "self_attn.q_proj.weight": (Hq * hd, D), pre + "self_attn.k_proj.weight": (Hkv * hd, D),
                       pre + "self_attn.v_proj.weight": (Hkv * hd, D), pre + "self_attn.o_proj.weight": (D, Hq * hd),
                       pre + "mlp.gate_proj.weight": (F_, D), pre + "mlp.up_proj.weight": (F_, D),
                       pre + "mlp.down_proj.weight": (D, F_)})
        if c["use_qk_norm"]:
            shapes.update({pre + "self_attn.q_norm.weight": (hd,), pre + "self_attn.k_norm.weight": (hd,)})
    gen = torch.Generator(device=device).manual_seed(c["init_weights_seed"])
    std = c.get("init_method_std", 0.02)
    out_std = std / math.sqrt(2 * c["base_num_decoder_layers"]) if c.get("init_output_layers_scaled", False) else std
    return {name: (torch.ones(shape, device=device) if name.endswith("norm.weight")
                   else torch.empty(shape, device=device).normal_(
                       0.0, out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else std, generator=gen))
            for name, shape in shapes.items()}


def lr_at(c, n):  # the trainer's cosine schedule (docs/training.md)
    peak, total = c["learning_rate"], c["learning_rate_schedule_steps"]
    final = peak * c["learning_rate_final_fraction"]
    warm = math.floor(c["warmup_steps_fraction"] * total)
    if n < warm:
        return peak * n / warm
    if c["lr_schedule_type"] == "constant":
        return peak
    if n >= total:
        return final
    return final + (peak - final) * 0.5 * (1 + math.cos(math.pi * (n - warm) / max(total - warm, 1)))


def rows(c, samples):
    # The trainer's samples as the model reads them (a Megatron pad id shows as token 0) and their
    # loss masks (pads, eod_mask_loss, Megatron's pad rules: docs/data.md).
    tokens = torch.tensor([s["tokens"] for s in samples])
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    mask = torch.tensor([s["loss_mask"] for s in samples], dtype=torch.float32)
    B, L = inputs.shape
    positions = torch.arange(L).repeat(B, 1)
    segments = torch.ones(B, L, dtype=torch.long)
    assert not c["reset_position_ids"] and not c["reset_attention_mask"], "peer: reset flags not implemented"
    return inputs, targets, mask, positions, segments


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--trainer", default=os.path.join(os.path.dirname(__file__), "../../build/trainer"))
    ap.add_argument("--check-steps", type=int, default=0,
                    help="exit 1 unless the first N step losses match the trainer's to --tolerance (relative)")
    ap.add_argument("--tolerance", type=float, default=1e-5)
    ap.add_argument("--device", default="cpu", help="cpu | cuda")
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the timing statistics")
    ap.add_argument("--random-init", action="store_true",
                    help="weights ~ N(0, init_method_std^2) (o_proj, down_proj scaled as the trainer's), norms 1 (as the trainer's init, not its values) instead of checkpoint 0")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    c = read_config(os.path.join(args.run_dir, "config.yml"))
    assert c["num_experts"] <= 1 and c["mtp_num_layers"] == 0 and c["calculate_per_token_loss"], "peer: dense per-token only"
    device = torch.device(args.device)
    if args.random_init:
        model = Llama(c, random_weights(c, device))
    else:
        model = Llama(c, read_safetensors(os.path.join(args.run_dir, "checkpoints", "0", "model.safetensors"))).to(device)
    autocast = c["dtype"] == "bfloat16"
    steps = args.steps or c["steps"]
    K, b = c["gradient_accumulation_steps"], c["per_device_batch_size"]
    gbs = K * b  # one process
    dump = subprocess.run([args.trainer, os.path.join(args.run_dir, "config.yml"), "model_name=",
                           f"--dump-samples={steps * gbs}"], capture_output=True, text=True, check=True).stdout
    samples = [json.loads(l) for l in dump.splitlines() if l.startswith("{")]
    # On CUDA the fused AdamW kernel: the fastest stock PyTorch optimizer, so the peer is a strong one.
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, betas=(c["adam_b1"], c["adam_b2"]), eps=c["adam_eps"],
                            weight_decay=c["adam_weight_decay"], **fused)
    losses, times = [], []
    for step in range(steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        batches = [rows(c, samples[step * gbs + m * b: step * gbs + (m + 1) * b]) for m in range(K)]
        W = sum(float(bt[2].sum()) for bt in batches)  # host-side, like the trainer's
        total = torch.zeros((), dtype=torch.float64, device=device)
        for batch in batches:
            one_segment = bool((batch[4] == 1).all())
            inputs, targets, mask, positions, segments = (t.to(device) for t in batch)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                logits = model(inputs, positions, segments, one_segment)
            logits = logits.float()
            ce = (F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
                  * mask.reshape(-1)).sum()
            (ce / W).backward()
            total += ce.detach().double()
        if c["gradient_clipping_threshold"] > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), c["gradient_clipping_threshold"])
        for g in opt.param_groups:
            g["lr"] = lr_at(c, step)
        opt.step()
        losses.append(float(total) / W)  # one device->host read per step (the step's loss)
        times.append(time.perf_counter() - start)
    trainer = [json.loads(l) for l in open(os.path.join(args.run_dir, "metrics.jsonl")) if '"learning/loss"' in l]
    for s in range(min(3, steps)):
        print(f"step {s}: peer loss {losses[s]:.6f}, trainer loss {trainer[s]['learning/loss']:.6f}")
    for s in range(args.check_steps):
        peer, ours = losses[s], trainer[s]["learning/loss"]
        if abs(peer - ours) > args.tolerance * abs(ours):
            sys.exit(f"peer.py: step {s} loss differs: peer {peer!r}, trainer {ours!r}")
    after = times[args.warmup:] if len(times) > args.warmup + 1 else times
    result = {"peer_median_step_seconds": statistics.median(after), "peer_mean": statistics.mean(after),
              "peer_max": max(after), "step0_loss_peer": losses[0], "step0_loss_trainer": trainer[0]["learning/loss"]}
    if device.type == "cuda":
        result["peer_cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
        result["peer_cuda_peak_reserved_bytes"] = torch.cuda.max_memory_reserved(device)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
