#!/usr/bin/python3
"""The Ling2 hybrid (GLA + MLA + Ling MoE + MTP) against an independent float64 reference.

The reference below is written from the definitions of the seed RFC's MaxText fork
(Garrybest/maxtext: layers/attention_gla.py, attention_mla.py, normalizations.py, moe.py,
multi_token_prediction.py, models/ling2.py), not from the trainer's C++:
  - layer i (0-based) is MLA when (i + 1) % inhomogeneous_layer_cycle_interval == 0, else GLA; the
    MTP layer is MLA; layers below first_num_dense_layers have a dense SwiGLU, the rest MoE;
  - GLA: q, k, v projections, per-head RMSNorm on q and k, partial rotate-half RoPE, then the
    simple-GLA recurrence S_t = exp(g_h) S_{t-1} + k_t^T v_t, o_t = q_t S_t / sqrt(hd), run token
    by token, with g_h = -slope_h (1 - layer / (N - 1) + 1e-5) and the ALiBi slopes; GroupRMSNorm
    over group_norm_size groups, times sigmoid(x W_g^T), then the output projection;
  - MLA: q = W_qb rmsnorm(W_qa x), [c; k_pe] = W_kva x, [k_nope; v] = W_kvb rmsnorm(c); RoPE on
    pairs (2i, 2i+1) written as a complex rotation (DeepSeek-V3's apply_rotary_emb), k_pe shared
    by the heads, softmax scale (nope + rope)^-1/2;
  - MoE: sigmoid scores, the expert bias for selection only, group-limited top-k (a group scores
    its best 2), weights renormalized (the fork always does for sigmoid) and scaled, plus the
    shared expert;
  - MTP (mtp_final_layernorm): the main hidden state after the final norm, the input ids rolled left
    (0 at the end), concat(enorm(embed), hnorm(h)) -> eh_proj -> the MTP layer -> its own norm -> head.

The trainer trains ling2-tiny for 3 steps (so norms and the expert bias have moved), then writes
its logits, the loss (next-token cross-entropy of the main head) and the gradient of every weight
for a 20-token sequence (--dump-logits ... --dump-gradients). The reference computes the same from
the checkpoint's weights with autograd: logits to 1e-5 and each gradient to 1e-4 of its largest
element must agree.

  ling2_reference.py --trainer build/trainer
"""
import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts", "bench"))
from peer import read_safetensors  # noqa: E402

TOKENS = [5, 17, 3, 88, 42, 42, 7, 60, 1, 33, 90, 12, 200, 4, 4, 150, 77, 9, 31, 255]


def read_config(path):
    """The resolved config.yml the trainer wrote: `key: value  # comment` lines."""
    cfg = {}
    for line in open(path):
        if not line.strip() or line.startswith("#") or ":" not in line:
            continue
        key, value = line.split(":", 1)
        value = value.split("#", 1)[0].strip().strip('"')
        try:
            cfg[key.strip()] = int(value)
        except ValueError:
            try:
                cfg[key.strip()] = float(value)
            except ValueError:
                cfg[key.strip()] = {"true": True, "false": False}.get(value, value)
    return cfg


def alibi_slopes(n):
    def power_of_2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]
    if math.log2(n).is_integer():
        return power_of_2(n)
    closest = 2 ** math.floor(math.log2(n))
    return power_of_2(closest) + alibi_slopes(2 * closest)[0::2][: n - closest]


class Ling2:
    def __init__(self, cfg, weights):
        self.c = cfg
        self.w = weights  # float64 leaves
        self.eps = cfg["normalization_layer_epsilon"]
        self.group_limited_changes = 0

    def rms(self, x, weight=None, groups=1):
        shape = x.shape
        x = x.reshape(*shape[:-1], groups, shape[-1] // groups)
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).reshape(shape)
        return x if weight is None else x * weight

    def linear(self, x, name):
        return x @ self.w[name].T

    # ---- GLA ------------------------------------------------------------------------------------
    def gla(self, p, x, layer):
        c, L = self.c, x.shape[0]
        H, hd = c["base_num_query_heads"], c["head_dim"]
        qkv = torch.cat([self.linear(x, p + n + ".weight") for n in ("q_proj", "k_proj", "v_proj")], -1)
        if c["use_linear_silu"]:
            qkv = torch.nn.functional.silu(qkv)
        q, k, v = qkv.view(L, 3, H, hd).unbind(1)  # (L, H, hd) each
        if c["use_qk_norm"]:
            q, k = self.rms(q, self.w[p + "q_norm.weight"]), self.rms(k, self.w[p + "k_norm.weight"])
        rot = int(hd * c["partial_rotary_factor"])
        inv_freq = c["rope_max_timescale"] ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
        angle = torch.arange(L, dtype=torch.float64)[:, None] * inv_freq  # (L, rot/2)
        cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]

        def rope(t):  # rotate_half on the first `rot` dims: pairs (i, i + rot/2)
            a, b, rest = t[..., : rot // 2], t[..., rot // 2: rot], t[..., rot:]
            return torch.cat([a * cos - b * sin, b * cos + a * sin, rest], -1)
        q, k = rope(q), rope(k)
        scale = 1 - layer / max(c["base_num_decoder_layers"] - 1, 1) + 1e-5
        decay = torch.exp(torch.tensor([-s * scale for s in alibi_slopes(H)], dtype=torch.float64))
        state = torch.zeros(H, hd, hd, dtype=torch.float64)
        out = []
        for t in range(L):
            state = decay[:, None, None] * state + k[t][:, :, None] * v[t][:, None, :]
            out.append(torch.einsum("hd,hde->he", q[t] / math.sqrt(hd), state))
        o = torch.stack(out).reshape(L, H * hd)
        o = self.rms(o, self.w[p + "g_norm.weight"], groups=c["group_norm_size"])
        o = o * torch.sigmoid(self.linear(x, p + "g_proj.weight"))
        return self.linear(o, p + "o_proj.weight")

    # ---- MLA ------------------------------------------------------------------------------------
    def mla(self, p, x):
        c, L = self.c, x.shape[0]
        H, nope, rope, vd, r = (c["base_num_query_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"],
                                c["kv_lora_rank"])
        if c["q_lora_rank"] > 0:
            q = self.linear(self.rms(self.linear(x, p + "q_a_proj.weight"), self.w[p + "q_a_layernorm.weight"]), p + "q_b_proj.weight")
        else:
            q = self.linear(x, p + "q_proj.weight")
        q = q.view(L, H, nope + rope)
        ckv = self.linear(x, p + "kv_a_proj_with_mqa.weight")
        latent, k_pe = self.rms(ckv[:, :r], self.w[p + "kv_a_layernorm.weight"]), ckv[:, r:]
        kv = self.linear(latent, p + "kv_b_proj.weight").view(L, H, nope + vd)
        freq = c["rope_max_timescale"] ** (-torch.arange(0, rope, 2, dtype=torch.float64) / rope)
        turn = torch.polar(torch.ones(L, rope // 2, dtype=torch.float64), torch.arange(L, dtype=torch.float64)[:, None] * freq)

        def rotate(t, phase):  # t: (..., rope) with pairs (2i, 2i+1) as complex numbers
            z = torch.view_as_complex(t.reshape(*t.shape[:-1], rope // 2, 2).contiguous()) * phase
            return torch.view_as_real(z).reshape(t.shape)
        assert c["mla_interleaved_rope"], "this reference covers the fork's interleaved RoPE"
        q_pe = rotate(q[..., nope:], turn[:, None, :])
        k_pe = rotate(k_pe, turn)  # (L, rope): one for every head
        scale = (nope + rope) ** -0.5
        assert c["max_position_embeddings"] <= c["original_max_position_embeddings"], "no mscale in this case"
        scores = (torch.einsum("ihd,jhd->hij", q[..., :nope], kv[..., :nope]) + torch.einsum("ihd,jd->hij", q_pe, k_pe)) * scale
        scores = scores.masked_fill(torch.triu(torch.ones(L, L, dtype=torch.bool), 1), float("-inf"))
        o = torch.einsum("hij,jhd->ihd", scores.softmax(-1), kv[..., nope:]).reshape(L, H * vd)
        return self.linear(o, p + "o_proj.weight")

    # ---- MLP and MoE ----------------------------------------------------------------------------
    def swiglu(self, p, x):
        return self.linear(torch.nn.functional.silu(self.linear(x, p + "gate_proj.weight")) * self.linear(x, p + "up_proj.weight"),
                           p + "down_proj.weight")

    def moe(self, p, x):
        c = self.c
        E, k, G, kept = c["num_experts"], c["num_experts_per_tok"], c["n_routing_groups"], c["topk_routing_group"]
        scores = torch.sigmoid(self.linear(x, p + "gate.weight"))  # (T, E)
        biased = scores.detach() + self.w[p + "gate.e_score_correction_bias"].detach()
        group_scores = biased.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(kept, dim=-1)[1], 1).bool()
        allowed = keep[:, :, None].expand(-1, G, E // G).reshape(-1, E)
        chosen = biased.masked_fill(~allowed, float("-inf")).topk(k, dim=-1)[1]
        for t in range(x.shape[0]):
            self.group_limited_changes += set(chosen[t].tolist()) != set(biased[t].topk(k)[1].tolist())
        weights = scores.gather(1, chosen)
        weights = weights / weights.sum(-1, keepdim=True) * c["routed_scaling_factor"]
        rows = []
        for t in range(x.shape[0]):
            rows.append(sum(weights[t, j] * self.swiglu(p + "experts.%d." % chosen[t, j].item(), x[t:t + 1])[0] for j in range(k)))
        return torch.stack(rows) + self.swiglu(p + "shared_experts.", x)

    # ---- the model ------------------------------------------------------------------------------
    def layer(self, i, x):
        c, p = self.c, "model.layers.%d." % i
        N, interval = c["base_num_decoder_layers"], c["inhomogeneous_layer_cycle_interval"]
        normed = self.rms(x, self.w[p + "input_layernorm.weight"])
        mla = i >= N or (i + 1) % interval == 0
        h = x + (self.mla(p + "self_attn.", normed) if mla else self.gla(p + "self_attn.", normed, i))
        z = self.rms(h, self.w[p + "post_attention_layernorm.weight"])
        return h + (self.swiglu(p + "mlp.", z) if i < c["first_num_dense_layers"] else self.moe(p + "mlp.", z))

    def forward(self, tokens):
        c = self.c
        ids = torch.tensor(tokens)
        embed = self.w["model.embed_tokens.weight"]
        h = embed[ids]
        N = c["base_num_decoder_layers"]
        for i in range(N):
            h = self.layer(i, h)
        h = self.rms(h, self.w["model.norm.weight"])
        out = {"logits": self.linear(h, "lm_head.weight")}
        for depth in range(1, c["mtp_num_layers"] + 1):
            p = "model.layers.%d." % (N + depth - 1)
            ids = torch.cat((ids[1:], torch.zeros(1, dtype=ids.dtype)))
            u = self.linear(torch.cat((self.rms(embed[ids], self.w[p + "enorm.weight"]), self.rms(h, self.w[p + "hnorm.weight"])), -1),
                            p + "eh_proj.weight")
            h = self.rms(self.layer(N + depth - 1, u), self.w[p + "shared_head.norm.weight"])
            out["mtp_logits.%d" % depth] = self.linear(h, "lm_head.weight")
        return out


def run_trainer(trainer, work, *extra):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}  # nothing else of the caller's environment
    if "LD_LIBRARY_PATH" in os.environ:
        env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
    command = [trainer, os.path.join(ROOT, "configs", "base.yml"), "model_name=ling2-tiny", "dataset_type=synthetic",
               "pad_id=0", "num_threads=1", "base_output_directory=" + work, "run_name=ling2", "log_period=1000",
               "max_target_length=32", "per_device_batch_size=2", "learning_rate=0.01", "warmup_steps_fraction=0"] + list(extra)
    result = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    if result.returncode != 0:
        sys.exit("trainer failed (%d): %s\n%s" % (result.returncode, " ".join(command), result.stdout))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="trainer-ling2-")
    try:
        run_trainer(args.trainer, work, "steps=3")
        dump = os.path.join(work, "dump.safetensors")
        run_trainer(args.trainer, work, "steps=3", "--dump-logits", dump, "--dump-logits-tokens", ",".join(map(str, TOKENS)),
                    "--dump-gradients")
        checkpoint = os.path.join(work, "ling2", "checkpoints", "3")
        cfg = read_config(os.path.join(checkpoint, "config.yml"))
        weights = {n: t.to(torch.float64).requires_grad_(True) for n, t in read_safetensors(os.path.join(checkpoint, "model.safetensors")).items()}
        got = read_safetensors(dump)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    reference = Ling2(cfg, weights)
    want = reference.forward(TOKENS)
    ok = True
    for name, value in want.items():
        diff = (got[name].to(torch.float64) - value.detach()).abs().max().item()
        spread = value.detach().std().item()
        good = diff <= 1e-5 and spread > 0.1
        ok &= good
        print("%s: max |trainer - reference| = %.3g (std %.3g) %s" % (name, diff, spread, "ok" if good else "FAILED"))
    targets = torch.tensor(TOKENS[1:])
    loss = torch.nn.functional.cross_entropy(want["logits"][:-1], targets)
    good = abs(got["loss"].item() - loss.item()) <= 1e-6 * max(1.0, loss.item())
    ok &= good
    print("loss: trainer %.8f reference %.8f %s" % (got["loss"].item(), loss.item(), "ok" if good else "FAILED"))
    names = sorted(n for n in weights if n in {g[len("grad."):] for g in got if g.startswith("grad.")} and weights[n].requires_grad)
    grads = torch.autograd.grad(loss, [weights[n] for n in names], allow_unused=True)
    worst, checked = 0.0, 0
    for name, grad in zip(names, grads):
        grad = torch.zeros_like(weights[name]) if grad is None else grad
        mine = got["grad." + name].to(torch.float64)
        scale = grad.abs().max().item()
        diff = (mine - grad).abs().max().item()
        if scale == 0:
            good = diff == 0
        else:
            good = diff <= 1e-4 * scale
            worst = max(worst, diff / scale)
            checked += 1
        if not good:
            print("grad %s: max |trainer - reference| = %.3g of max %.3g FAILED" % (name, diff, scale))
        ok &= good
    missing = sorted(n for n in weights if "grad." + n not in got and "e_score_correction_bias" not in n)
    if missing:
        print("the trainer wrote no gradient for %s FAILED" % missing)
        ok = False
    print("gradients: %d tensors with non-zero gradients, worst max difference %.3g of the tensor's largest" % (checked, worst))
    kinds = {"gla": "model.layers.0.self_attn.g_proj.weight", "mla": "model.layers.4.self_attn.kv_b_proj.weight"}
    for kind, name in kinds.items():
        if name not in names:
            print("the case must cover %s (%s) FAILED" % (kind, name))
            ok = False
    print("tokens whose experts group-limited routing changed: %d" % reference.group_limited_changes)
    ok &= reference.group_limited_changes > 0
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
