#!/usr/bin/python3
"""Hugging Face checkpoints in and out, checked against an independent reference forward.

The reference below is written from the Hugging Face modeling code's semantics, not from the
trainer: transformers' LlamaForCausalLM, Qwen3ForCausalLM (QK norm on each head before RoPE) and
Qwen3MoeForCausalLM (softmax top-k routing over experts, dense layers listed in mlp_only_layers),
and inclusionAI's BailingMoeV2ForCausalLM (Ling-V2 models/modeling_bailing_moe_v2.py): fused
query_key_value, partial RoPE on the first rotary_dim channels of a head, sigmoid fp32 router whose
expert_bias only selects, group-limited top-k (a group scores the sum of its best 2 biased scores),
top-k weights renormalized and scaled, shared experts, and MTP layers that read the main hidden
state after the final norm, roll the input ids left (filling 0), and end in their own
final_layernorm before the shared lm_head. It runs in float64.

Cases (each run by ctest; every one creates and removes its own temporary directory):
  llama | qwen3 | bailing   a random tiny checkpoint of that architecture, written by this script
                            (sharded, with model.safetensors.index.json; llama in bf16), loaded by
                            the trainer with model_name=hf: its logits (and MTP logits) must equal
                            the reference to 1e-5.
  llama3                    llama with Llama 3.1+'s RoPE scaling (rope_scaling rope_type "llama3").
  llama_yarn | qwen3_yarn   YaRN on global attention (transformers' _compute_yarn_parameters): llama
  | bailing_yarn            with betas 16 / 2, attention factor 1 and truncate false; qwen3 with
                            Qwen3's long-context fields (the default factor 0.1 ln 4 + 1 on cos and
                            sin); bailing on its partial RoPE.
  deepseek_v3               transformers' DeepseekV3ForCausalLM: MLA (low-rank q, latent norms at 1e-6,
                            interleaved RoPE on the rope dims), sigmoid group-limited routing with
                            e_score_correction_bias, shared experts; a stored MTP layer is skipped.
  deepseek_v3_yarn          the same with YaRN as transformers computes it for DeepSeek-V3.
  qwen3_moe                 transformers' Qwen3MoeForCausalLM: a dense first layer (mlp_only_layers),
                            then softmax top-k routing over experts without shared ones or bias.
  round_trip_<model>        the trainer trains <model> for 3 steps, exports --export-hf, loads the
                            export with model_name=hf: identical logits; the reference on the
                            export agrees to 1e-5.

  hf_reference.py --trainer build/trainer CASE
"""
import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts", "bench"))
from peer import read_safetensors  # noqa: E402  (F32 and BF16)

TOKENS = [5, 17, 3, 88, 42, 42, 7, 60, 1, 33, 90, 12]
TOLERANCE = 1e-5


# ---- checkpoint files -------------------------------------------------------------------------
def write_safetensors(path, tensors, dtype):
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        t = t.to(torch.float32).contiguous()
        if dtype == "BF16":  # round to nearest even, as torch's own conversion
            raw = t.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
        else:
            raw = t.numpy().tobytes()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def write_hf_directory(directory, config, tensors, dtype, shards=2):
    os.makedirs(directory)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    names = list(tensors)
    weight_map = {}
    for i in range(shards):
        file = "model-%05d-of-%05d.safetensors" % (i + 1, shards)
        part = {n: tensors[n] for n in names[i::shards]}
        write_safetensors(os.path.join(directory, file), part, dtype)
        weight_map.update({n: file for n in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)


def read_hf_directory(directory):
    index = os.path.join(directory, "model.safetensors.index.json")
    if not os.path.exists(index):
        return read_safetensors(os.path.join(directory, "model.safetensors"))
    tensors = {}
    for file in sorted(set(json.load(open(index))["weight_map"].values())):
        tensors.update(read_safetensors(os.path.join(directory, file)))
    return tensors


# ---- tiny random checkpoints --------------------------------------------------------------------
# Llama 3.1+'s RoPE scaling at the tiny head (8 dims, theta 10000: wavelengths 6.3, 63, 628, 6283):
# an original context of 128 keeps the first, blends the second and divides the last two.
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 128}


def tiny_config(arch):
    if arch == "llama3":
        return dict(tiny_config("llama"), rope_scaling=LLAMA3_SCALING, max_position_embeddings=1024)
    common = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
              "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "hidden_act": "silu", "rope_scaling": None}
    if arch == "llama":
        return dict(common, architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=2,
                    rope_theta=10000.0, tie_word_embeddings=False)
    if arch == "qwen3":  # head_dim is not hidden_size / heads in Qwen3
        return dict(common, architectures=["Qwen3ForCausalLM"], model_type="qwen3", num_hidden_layers=2,
                    head_dim=16, rope_theta=1000000.0, tie_word_embeddings=True)
    if arch == "deepseek_v3":  # MLA (low-rank q, interleaved RoPE) with a dense first layer, then MoE
        return dict(common, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_hidden_layers=3,
                    num_key_value_heads=4, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                    q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6,
                    rope_interleave=True, max_position_embeddings=64, n_routed_experts=8, num_experts_per_tok=2,
                    moe_intermediate_size=16, n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                    routed_scaling_factor=2.5, norm_topk_prob=True)
    if arch == "deepseek_v3_yarn":  # DeepSeek-V3's RoPE: YaRN over 8 rope dims (kept, blended, stretched)
        return dict(tiny_config("deepseek_v3"), qk_rope_head_dim=8, max_position_embeddings=1024,
                    rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256,
                                  "beta_fast": 32, "beta_slow": 1, "mscale": 0.7, "mscale_all_dim": 0.7})
    if arch == "qwen3_yarn":  # Qwen3's long-context recipe: factor and original only, the default attention factor
        return dict(tiny_config("qwen3"), max_position_embeddings=1024,
                    rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256})
    if arch == "llama_yarn":  # bf16 Llama, YaRN with its own betas, unfloored range and attention factor 1
        return dict(tiny_config("llama"), max_position_embeddings=1024,
                    rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128,
                                  "beta_fast": 16, "beta_slow": 2, "attention_factor": 1.0, "truncate": False})
    if arch == "bailing_yarn":  # partial RoPE: the attention factor scales the rotated channels only
        return dict(tiny_config("bailing"), max_position_embeddings=2048,
                    rope_scaling={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 256})
    if arch == "qwen3_moe":  # the first layer dense (mlp_only_layers), softmax top-2 of 8, renormalized
        return dict(common, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_hidden_layers=3,
                    head_dim=16, rope_theta=1000000.0, tie_word_embeddings=False, num_experts=8,
                    num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True, decoder_sparse_step=1,
                    mlp_only_layers=[0])
    return dict(common, architectures=["BailingMoeV2ForCausalLM"], model_type="bailing_moe_v2", num_hidden_layers=3,
                head_dim=16, rope_theta=600000.0, tie_word_embeddings=False, partial_rotary_factor=0.5,
                use_qk_norm=True, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                num_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2,
                routed_scaling_factor=2.5, moe_router_enable_expert_bias=True, num_nextn_predict_layers=1,
                mtp_loss_scaling_factor=0.1)


def random_weights(cfg, generator):
    """Every tensor the architecture's modeling code holds, with the names it gives them."""
    bailing = cfg["architectures"][0].startswith("Bailing")
    deepseek = cfg["architectures"][0] == "DeepseekV3ForCausalLM"
    D, V, F = cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]
    Hq, Hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or D // Hq
    w = {}

    def linear(name, rows, cols, scale=None):
        w[name] = torch.randn(rows, cols, generator=generator, dtype=torch.float64) * (scale or 1.0 / math.sqrt(cols))

    def norm(name, size):
        w[name] = 1.0 + 0.2 * torch.randn(size, generator=generator, dtype=torch.float64)

    def mlp(prefix, hidden):
        linear(prefix + "gate_proj.weight", hidden, D)
        linear(prefix + "up_proj.weight", hidden, D)
        linear(prefix + "down_proj.weight", D, hidden)

    def layer(p, moe):
        norm(p + "input_layernorm.weight", D)
        norm(p + "post_attention_layernorm.weight", D)
        if deepseek:
            c = cfg
            qk, rank = c["qk_nope_head_dim"] + c["qk_rope_head_dim"], c["q_lora_rank"]
            if rank:
                linear(p + "self_attn.q_a_proj.weight", rank, D)
                norm(p + "self_attn.q_a_layernorm.weight", rank)
                linear(p + "self_attn.q_b_proj.weight", Hq * qk, rank)
            else:
                linear(p + "self_attn.q_proj.weight", Hq * qk, D)
            linear(p + "self_attn.kv_a_proj_with_mqa.weight", c["kv_lora_rank"] + c["qk_rope_head_dim"], D)
            norm(p + "self_attn.kv_a_layernorm.weight", c["kv_lora_rank"])
            linear(p + "self_attn.kv_b_proj.weight", Hq * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"])
            linear(p + "self_attn.o_proj.weight", D, Hq * c["v_head_dim"])
        elif bailing:
            linear(p + "attention.query_key_value.weight", (Hq + 2 * Hkv) * hd, D)
            linear(p + "attention.dense.weight", D, Hq * hd)
            norm(p + "attention.query_layernorm.weight", hd)
            norm(p + "attention.key_layernorm.weight", hd)
        else:
            for n, rows in (("q", Hq * hd), ("k", Hkv * hd), ("v", Hkv * hd)):
                linear(p + "self_attn.%s_proj.weight" % n, rows, D)
            linear(p + "self_attn.o_proj.weight", D, Hq * hd)
            if cfg["architectures"][0].startswith("Qwen3"):
                norm(p + "self_attn.q_norm.weight", hd)
                norm(p + "self_attn.k_norm.weight", hd)
        if not moe:
            mlp(p + "mlp.", F)
            return
        E, Fm = cfg["n_routed_experts" if deepseek else "num_experts"], cfg["moe_intermediate_size"]
        linear(p + "mlp.gate.weight", E, D, scale=1.0)
        for e in range(E):
            mlp(p + "mlp.experts.%d." % e, Fm)
        if not (bailing or deepseek):  # Qwen3Moe: no bias, no shared expert
            return
        # A bias of the size of the score differences, so that it changes selections.
        bias = "mlp.gate.e_score_correction_bias" if deepseek else "mlp.gate.expert_bias"
        w[p + bias] = 0.3 * torch.randn(E, generator=generator, dtype=torch.float64)
        mlp(p + "mlp.shared_experts.", Fm * cfg["n_shared_experts" if deepseek else "num_shared_experts"])

    w["model.word_embeddings.weight" if bailing else "model.embed_tokens.weight"] = torch.randn(
        V, D, generator=generator, dtype=torch.float64)
    N = cfg["num_hidden_layers"]
    for i in range(N):
        layer("model.layers.%d." % i, moe_layer(cfg, i))
    for k in range(cfg.get("num_nextn_predict_layers", 0)):
        p = "model.layers.%d." % (N + k)
        layer(p, True)
        norm(p + "enorm.weight", D)
        norm(p + "hnorm.weight", D)
        norm(p + "final_layernorm.weight", D)
        linear(p + "eh_proj.weight", D, 2 * D)
    norm("model.norm.weight", D)
    if not cfg["tie_word_embeddings"]:
        linear("lm_head.weight", V, D)
    return w


def moe_layer(cfg, i):
    """Whether decoder layer i holds a MoE block: Bailing's after first_k_dense_replace; Qwen3Moe's
    where i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    if cfg["architectures"][0].startswith("Bailing") or cfg["architectures"][0] == "DeepseekV3ForCausalLM":
        return i >= cfg["first_k_dense_replace"]
    if cfg["architectures"][0] == "Qwen3MoeForCausalLM":
        return i not in cfg.get("mlp_only_layers", []) and (i + 1) % cfg.get("decoder_sparse_step", 1) == 0
    return False


def yarn_mscale(scale, mscale=1):  # DeepSeek's yarn_get_mscale
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


# ---- the reference forward ----------------------------------------------------------------------
class Reference:
    def __init__(self, cfg, weights):
        self.c = cfg
        self.w = {n: t.to(torch.float64) for n, t in weights.items()}
        self.bailing = cfg["architectures"][0].startswith("Bailing")
        self.qwen3 = cfg["architectures"][0].startswith("Qwen3")  # Qwen3 and Qwen3Moe: q/k norms
        self.deepseek = cfg["architectures"][0] == "DeepseekV3ForCausalLM"
        self.hd = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        self.group_limited_changes = 0  # tokens whose experts group-limited routing changed
        self.bias_changes = 0           # tokens whose experts the expert bias changed
        self.fill_changes = 0           # tokens whose experts a 0.0 (not -inf) fill of dropped groups changed

    def norm(self, x, name, eps=None):
        eps = self.c["rms_norm_eps"] if eps is None else eps
        return self.w[name] * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(self, length):
        dim = int(self.hd * self.c.get("partial_rotary_factor", 1.0) if self.bailing else self.hd)
        if self.deepseek:  # MLA rotates its qk_rope_head_dim part only
            dim = self.c["qk_rope_head_dim"]
        inv_freq = 1.0 / (self.c["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        scaling = self.c.get("rope_scaling") or {"rope_type": "default"}
        kind = scaling.get("rope_type", scaling.get("type"))
        attention_factor = 1.0
        if kind == "yarn":  # transformers' _compute_yarn_parameters
            factor, mscale, mscale_all_dim = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
            original = self.c["max_position_embeddings"]
            if "original_max_position_embeddings" in scaling:  # DeepSeek's: the ratio overrides factor
                original = scaling["original_max_position_embeddings"]
                factor = self.c["max_position_embeddings"] / original
            attention_factor = scaling.get("attention_factor")
            if attention_factor is None:
                attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim) \
                    if mscale and mscale_all_dim else yarn_mscale(factor)
            beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

            def correction_dim(rotations):
                return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(self.c["rope_theta"]))
            low, high = correction_dim(beta_fast), correction_dim(beta_slow)
            if scaling.get("truncate", True):
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, dim - 1)
            ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low if high != low else 0.001)).clamp(0, 1)
            extrapolation = 1 - ramp
            inv_freq = inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation
        elif kind == "llama3":  # transformers' _compute_llama3_parameters
            factor, old = scaling["factor"], scaling["original_max_position_embeddings"]
            low_wavelen, high_wavelen = old / scaling["low_freq_factor"], old / scaling["high_freq_factor"]
            wavelen = 2 * math.pi / inv_freq
            scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
            smooth = (old / wavelen - scaling["low_freq_factor"]) / (scaling["high_freq_factor"] - scaling["low_freq_factor"])
            medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
            inv_freq = torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
        else:
            assert kind == "default", scaling
        freqs = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos() * attention_factor, emb.sin() * attention_factor

    @staticmethod
    def apply_rope(x, cos, sin):  # x: (H, L, hd); RoPE on the first cos.shape[-1] channels
        rd = cos.shape[-1]
        rot, passed = x[..., :rd], x[..., rd:]
        half = torch.cat((-rot[..., rd // 2:], rot[..., :rd // 2]), dim=-1)
        return torch.cat((rot * cos + half * sin, passed), dim=-1)

    def mla_attention(self, p, x, cos, sin):  # transformers' DeepseekV3Attention, no RoPE scaling
        c, L, H = self.c, x.shape[0], self.c["num_attention_heads"]
        nope, rope, vd, rank = c["qk_nope_head_dim"], c["qk_rope_head_dim"], c["v_head_dim"], c["kv_lora_rank"]
        w = lambda name: self.w[p + "self_attn." + name + ".weight"]  # noqa: E731
        if c.get("q_lora_rank"):  # its latent norms: RMSNorm's default eps 1e-6
            q = self.norm(x @ w("q_a_proj").T, p + "self_attn.q_a_layernorm.weight", 1e-6) @ w("q_b_proj").T
        else:
            q = x @ w("q_proj").T
        q = q.view(L, H, nope + rope).transpose(0, 1)                      # (H, L, nope + rope)
        q_pass, q_rot = q.split([nope, rope], dim=-1)
        k_pass, k_rot = (x @ w("kv_a_proj_with_mqa").T).split([rank, rope], dim=-1)
        kv = (self.norm(k_pass, p + "self_attn.kv_a_layernorm.weight", 1e-6) @ w("kv_b_proj").T)
        k_pass, v = kv.view(L, H, nope + vd).transpose(0, 1).split([nope, vd], dim=-1)
        k_rot = k_rot.view(1, L, rope)
        if c.get("rope_interleave", True):  # pairs (2i, 2i+1) -> halves, then rotate_half
            q_rot = q_rot.reshape(H, L, rope // 2, 2).transpose(-1, -2).reshape(H, L, rope)
            k_rot = k_rot.reshape(1, L, rope // 2, 2).transpose(-1, -2).reshape(1, L, rope)
        q_rot, k_rot = self.apply_rope(q_rot, cos, sin), self.apply_rope(k_rot, cos, sin)
        q = torch.cat((q_pass, q_rot), dim=-1)
        k = torch.cat((k_pass, k_rot.expand(H, L, rope)), dim=-1)
        scale = (nope + rope) ** -0.5
        scaling = c.get("rope_scaling") or {}
        if scaling.get("rope_type", scaling.get("type", "default")) != "default" and scaling.get("mscale_all_dim"):
            scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
        scores = q @ k.transpose(1, 2) * scale
        scores = scores.masked_fill(torch.triu(torch.ones(L, L, dtype=torch.bool), 1), float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(0, 1).reshape(L, H * vd)
        return y @ w("o_proj").T

    def attention(self, p, x, cos, sin):
        if self.deepseek:
            return self.mla_attention(p, x, cos, sin)
        L, Hq, Hkv, hd = x.shape[0], self.c["num_attention_heads"], self.c["num_key_value_heads"], self.hd
        if self.bailing:
            qkv = (x @ self.w[p + "attention.query_key_value.weight"].T).view(L, Hq + 2 * Hkv, hd)
            q, k, v = qkv.split([Hq, Hkv, Hkv], dim=1)
            q_norm, k_norm, out = "attention.query_layernorm.weight", "attention.key_layernorm.weight", "attention.dense.weight"
        else:
            q = (x @ self.w[p + "self_attn.q_proj.weight"].T).view(L, Hq, hd)
            k = (x @ self.w[p + "self_attn.k_proj.weight"].T).view(L, Hkv, hd)
            v = (x @ self.w[p + "self_attn.v_proj.weight"].T).view(L, Hkv, hd)
            q_norm, k_norm, out = "self_attn.q_norm.weight", "self_attn.k_norm.weight", "self_attn.o_proj.weight"
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # (H, L, hd)
        if self.qwen3 or (self.bailing and self.c.get("use_qk_norm", True)):
            q, k = self.norm(q, p + q_norm), self.norm(k, p + k_norm)
        q, k = self.apply_rope(q, cos, sin), self.apply_rope(k, cos, sin)
        k, v = k.repeat_interleave(Hq // Hkv, dim=0), v.repeat_interleave(Hq // Hkv, dim=0)
        scores = q @ k.transpose(1, 2) / math.sqrt(hd)
        scores = scores.masked_fill(torch.triu(torch.ones(L, L, dtype=torch.bool), 1), float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(0, 1).reshape(L, Hq * hd)
        return y @ self.w[p + out].T

    def mlp(self, p, x):
        gate, up = x @ self.w[p + "gate_proj.weight"].T, x @ self.w[p + "up_proj.weight"].T
        return (torch.nn.functional.silu(gate) * up) @ self.w[p + "down_proj.weight"].T

    def softmax_moe(self, p, x):  # transformers' Qwen3MoeSparseMoeBlock
        c = self.c
        k = c["num_experts_per_tok"]
        weights, chosen = torch.softmax(x @ self.w[p + "mlp.gate.weight"].T, dim=-1).topk(k, dim=-1)  # (T, k)
        if c.get("norm_topk_prob", False):
            weights = weights / weights.sum(-1, keepdim=True)
        y = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(k):
                y[t] += weights[t, j] * self.mlp(p + "mlp.experts.%d." % chosen[t, j].item(), x[t:t + 1])[0]
        return y

    def moe(self, p, x):
        c = self.c
        if not (self.bailing or self.deepseek):
            return self.softmax_moe(p, x)
        E = c["n_routed_experts" if self.deepseek else "num_experts"]
        k, G, kept = c["num_experts_per_tok"], c["n_group"], c["topk_group"]
        scores = torch.sigmoid(x @ self.w[p + "mlp.gate.weight"].T)  # (T, E)
        biased = scores + self.w[p + ("mlp.gate.e_score_correction_bias" if self.deepseek else "mlp.gate.expert_bias")]
        group_scores = biased.view(-1, G, E // G).topk(2, dim=-1)[0].sum(-1)        # (T, G)
        best_groups = group_scores.topk(kept, dim=-1)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, best_groups, 1).bool()
        expert_mask = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E)
        # BailingMoeV2Gate fills the dropped groups with -inf; transformers' DeepseekV3MoE with 0.0,
        # which differs where fewer than k kept experts have a positive biased score.
        fill = 0.0 if self.deepseek else float("-inf")
        chosen = biased.masked_fill(~expert_mask, fill).topk(k, dim=-1)[1]  # (T, k)
        strict = biased.masked_fill(~expert_mask, float("-inf")).topk(k, dim=-1)[1]
        for t in range(x.shape[0]):
            self.fill_changes += set(chosen[t].tolist()) != set(strict[t].tolist())
        ungrouped, unbiased = biased.topk(k, dim=-1)[1], scores.topk(k, dim=-1)[1]
        for t in range(x.shape[0]):
            self.group_limited_changes += set(chosen[t].tolist()) != set(ungrouped[t].tolist())
            self.bias_changes += set(ungrouped[t].tolist()) != set(unbiased[t].tolist())
        weights = scores.gather(1, chosen)
        # BailingMoeV2Gate renormalizes when k > 1; DeepseekV3MoE when norm_topk_prob says so.
        if (c.get("norm_topk_prob", True) if self.deepseek else k > 1):
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        weights = weights * c["routed_scaling_factor"]
        y = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for j in range(k):
                y[t] += weights[t, j] * self.mlp(p + "mlp.experts.%d." % chosen[t, j].item(), x[t:t + 1])[0]
        return y + self.mlp(p + "mlp.shared_experts.", x)

    def block(self, p, x, moe, cos, sin):
        h = x + self.attention(p, self.norm(x, p + "input_layernorm.weight"), cos, sin)
        z = self.norm(h, p + "post_attention_layernorm.weight")
        return h + (self.moe(p, z) if moe else self.mlp(p + "mlp.", z))

    def head(self, h):
        c = self.c
        embedding = self.w["model.word_embeddings.weight" if self.bailing else "model.embed_tokens.weight"]
        return h @ (embedding if c["tie_word_embeddings"] else self.w["lm_head.weight"]).T

    def forward(self, tokens):
        c = self.c
        embedding = self.w["model.word_embeddings.weight" if self.bailing else "model.embed_tokens.weight"]
        ids = torch.tensor(tokens)
        cos, sin = self.rope(len(tokens))
        h = embedding[ids]
        N = c["num_hidden_layers"]
        for i in range(N):
            h = self.block("model.layers.%d." % i, h, moe_layer(c, i), cos, sin)
        h = self.norm(h, "model.norm.weight")
        out = {"logits": self.head(h)}
        for k in range(c.get("num_nextn_predict_layers", 0) if self.bailing else 0):
            p = "model.layers.%d." % (N + k)
            ids = torch.cat((ids[1:], torch.zeros(1, dtype=ids.dtype)))  # roll left, fill 0
            e = self.norm(embedding[ids], p + "enorm.weight")
            x = torch.cat((e, self.norm(h, p + "hnorm.weight")), dim=-1) @ self.w[p + "eh_proj.weight"].T
            h = self.norm(self.block(p, x, True, cos, sin), p + "final_layernorm.weight")
            out["mtp_logits.%d" % (k + 1)] = self.head(h)
        return out


# ---- the trainer --------------------------------------------------------------------------------
def run_trainer(args, work, *extra):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}  # nothing else of the caller's environment
    if "LD_LIBRARY_PATH" in os.environ:
        env["LD_LIBRARY_PATH"] = os.environ["LD_LIBRARY_PATH"]
    command = [args.trainer, os.path.join(ROOT, "configs", "base.yml"), "dataset_type=synthetic", "pad_id=0",
               "num_threads=1", "base_output_directory=" + work, "log_period=1000"] + list(extra)
    result = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=600)
    if result.returncode != 0:
        sys.exit("trainer failed (%d): %s\n%s" % (result.returncode, " ".join(command), result.stdout))
    return result.stdout


def trainer_logits(args, work, name, *extra):
    path = os.path.join(work, name + ".safetensors")
    run_trainer(args, work, "run_name=" + name, "--dump-logits", path,
                "--dump-logits-tokens", ",".join(map(str, TOKENS)), *extra)
    return read_safetensors(path)


def compare(label, got, want):
    failed = False
    if sorted(got) != sorted(want):
        print("%s: the trainer wrote %s, the reference has %s" % (label, sorted(got), sorted(want)))
        return False
    for name in sorted(want):
        diff = (got[name].to(torch.float64) - want[name]).abs().max().item()
        spread = want[name].std().item()
        ok = diff <= TOLERANCE and spread > 0.1  # a tolerance that means something: logits of O(1)
        failed |= not ok
        print("%s %s: max |trainer - reference| = %.3g (logit std %.3g) %s" %
              (label, name, diff, spread, "ok" if ok else "FAILED"))
    return not failed


def case_random(args, work, arch):
    cfg = tiny_config(arch)
    weights = random_weights(cfg, torch.Generator().manual_seed(1234))
    directory = os.path.join(work, "hf")
    if arch.startswith("deepseek_v3"):  # DeepSeek's releases store an MTP layer after the decoder layers; HF skips it
        cfg["num_nextn_predict_layers"] = 1
        weights["model.layers.%d.enorm.weight" % cfg["num_hidden_layers"]] = torch.ones(cfg["hidden_size"])
    write_hf_directory(directory, cfg, weights, "BF16" if arch in ("llama", "llama3", "llama_yarn") else "F32")
    # The reference sees exactly what the file holds (bf16 rounding included).
    reference = Reference(cfg, read_hf_directory(directory))
    want = reference.forward(TOKENS)
    got = trainer_logits(args, work, "import", "model_name=hf", "load_parameters_path=" + directory)
    ok = compare(arch, got, want)
    if cfg["rope_scaling"]:
        # The case must exercise what it checks: logits that the scaling moves.
        unscaled = Reference(dict(cfg, rope_scaling=None), read_hf_directory(directory)).forward(TOKENS)["logits"]
        moved = (unscaled - want["logits"]).abs().max().item()
        print("%s: the scaling moves the reference's logits by up to %.3g" % (arch, moved))
        ok &= moved > 1e-3
    if arch in ("qwen3_yarn", "bailing_yarn"):  # and the attention factor (0.1 ln 4 + 1, 0.1 ln 8 + 1) by itself
        unfactored = dict(cfg, rope_scaling=dict(cfg["rope_scaling"], attention_factor=1.0))
        moved = (Reference(unfactored, read_hf_directory(directory)).forward(TOKENS)["logits"] - want["logits"]).abs().max().item()
        print("%s: the attention factor moves the reference's logits by up to %.3g" % (arch, moved))
        ok &= moved > 1e-3
    if arch in ("bailing", "bailing_yarn", "deepseek_v3", "deepseek_v3_yarn"):
        # The case must exercise what it checks: selections that the groups and the bias change.
        print(arch + ": tokens whose experts group-limited routing changed: %d, the expert bias changed: %d, "
              "the 0.0 fill of dropped groups changed: %d" %
              (reference.group_limited_changes, reference.bias_changes, reference.fill_changes))
        ok &= reference.group_limited_changes > 0 and reference.bias_changes > 0
    return ok


def case_round_trip(args, work, model_args):
    run_trainer(args, work, "run_name=trained", "steps=3", "per_device_batch_size=2", "max_target_length=32",
                "learning_rate=0.01", "warmup_steps_fraction=0", *model_args)
    directory = os.path.join(work, "hf")
    before = trainer_logits(args, work, "trained", "steps=3", *model_args, "--export-hf", directory,
                            "--export-hf-max-shard-mb", "1")
    after = trainer_logits(args, work, "imported", "model_name=hf", "load_parameters_path=" + directory)
    ok = sorted(before) == sorted(after) and all(torch.equal(before[n], after[n]) for n in before)
    print("round trip (export, import): logits %s" % ("identical" if ok else "DIFFER"))
    cfg = json.load(open(os.path.join(directory, "config.json")))
    if any(a.startswith("routed_bias_update_rate=") for a in model_args):  # a trained expert bias went out
        exported = read_hf_directory(directory)
        bias = max(t.abs().max().item() for n, t in exported.items() if n.endswith("e_score_correction_bias"))
        print("export: largest |e_score_correction_bias| %.3g" % bias)
        ok &= bias > 1e-3
    if "rope_type=yarn" in model_args:  # what the export says of its RoPE
        print("export: rope_scaling %s, max_position_embeddings %s" % (cfg["rope_scaling"], cfg["max_position_embeddings"]))
        scaled = "rope_attention_scaling=true" in model_args
        ok &= cfg["rope_scaling"]["attention_factor"] == (0.1 * math.log(4) + 1 if scaled else 1.0)
        ok &= cfg["rope_scaling"].get("truncate", True) == ("rope_truncate=false" not in model_args)
    if "rope_type=llama3" in model_args:  # what the export says of its RoPE
        print("export: rope_scaling %s, max_position_embeddings %s" % (cfg["rope_scaling"], cfg["max_position_embeddings"]))
        ok &= cfg["rope_scaling"] == EXPORTED_SCALING and cfg["max_position_embeddings"] == 4096
    return compare("export", after, Reference(cfg, read_hf_directory(directory)).forward(TOKENS)) and ok


ROUND_TRIPS = {
    "round_trip_ling_mini_tiny": ["model_name=ling-mini-tiny"],
    "round_trip_qwen3": ["override_model_config=true", "use_qk_norm=true", "logits_via_embedding=true"],
    # moe-tiny (softmax top-2 of 8 after a dense layer) as Qwen3Moe: q/k norms on, no shared expert.
    # ling2-tiny made all-MLA (DeepseekV3): full-rank q and half-split RoPE here (the random case
    # has the low-rank q and the interleaved RoPE), its expert bias trained away from 0.
    "round_trip_deepseek_v3": ["model_name=ling2-tiny", "override_model_config=true", "inhomogeneous_layer_cycle_interval=0",
                               "moe_shared_expert_dim=0", "mtp_num_layers=0", "mtp_moe_mlp=false", "base_num_decoder_layers=3",
                               "q_lora_rank=0", "mla_interleaved_rope=false", "routed_bias_update_rate=0.05"],
    # ... and with YaRN (DeepSeek-V3's RoPE): stretched 4x from 256 positions, mscale 0.7.
    "round_trip_deepseek_v3_yarn": ["model_name=ling2-tiny", "override_model_config=true",
                                    "inhomogeneous_layer_cycle_interval=0", "moe_shared_expert_dim=0", "mtp_num_layers=0",
                                    "mtp_moe_mlp=false", "base_num_decoder_layers=3", "rope_type=yarn", "rope_factor=4",
                                    "original_max_position_embeddings=256", "max_position_embeddings=1024", "mscale=0.7"],
    # ... with YaRN scaling cos and sin instead of the softmax (mscale 0, rope_attention_scaling).
    "round_trip_deepseek_v3_yarn_scaled": ["model_name=ling2-tiny", "override_model_config=true",
                                           "inhomogeneous_layer_cycle_interval=0", "moe_shared_expert_dim=0",
                                           "mtp_num_layers=0", "mtp_moe_mlp=false", "base_num_decoder_layers=3",
                                           "rope_type=yarn", "rope_factor=4", "original_max_position_embeddings=256",
                                           "max_position_embeddings=1024", "mscale=0", "rope_attention_scaling=true"],
    # Qwen3 with YaRN on its global attention: 32-dim heads, the range not floored (dims 0 .. 4.03 blended).
    "round_trip_qwen3_yarn": ["override_model_config=true", "use_qk_norm=true", "logits_via_embedding=true",
                              "rope_type=yarn", "rope_factor=4", "original_max_position_embeddings=64",
                              "max_position_embeddings=256", "rope_attention_scaling=true", "rope_truncate=false"],
    "round_trip_qwen3_moe": ["model_name=moe-tiny", "override_model_config=true", "use_qk_norm=true", "shared_experts=0"],
    "round_trip_llama": [],
    # The default model's 32-dim heads at theta 10000 have wavelengths 6.3 .. 4.4e4: an original
    # context of 64 with factors 2 / 8 puts dims in all three bands.
    "round_trip_llama3": ["override_model_config=true", "rope_type=llama3", "rope_factor=4", "rope_low_freq_factor=2",
                          "rope_high_freq_factor=8", "original_max_position_embeddings=64", "max_position_embeddings=4096"],
}
EXPORTED_SCALING = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                    "original_max_position_embeddings": 64}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trainer", required=True)
    randoms = ["llama", "llama3", "llama_yarn", "qwen3", "qwen3_yarn", "qwen3_moe", "deepseek_v3", "deepseek_v3_yarn",
               "bailing", "bailing_yarn"]
    parser.add_argument("case", choices=randoms + sorted(ROUND_TRIPS))
    args = parser.parse_args()
    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="trainer-hf-")
    try:
        ok = case_random(args, work, args.case) if args.case in randoms else \
            case_round_trip(args, work, ROUND_TRIPS[args.case])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
