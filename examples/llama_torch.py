"""The Llama-style model of ``examples/llama.py`` (same configs and layer math) in torch.

Attention is a parameter: ``forward(ids, positions, attend)`` calls ``attend(layer_id, q, k, v)``
with ``q [T, Hq, D]``, ``k/v [T, Hkv, D]`` (RoPE applied) and expects ``[T, Hq * D]``. Three
attention paths share every other line:
  ``bridge_attend``   torch_bridge (paged KV pool, SGLang's backend interface);
  ``dense_attend``    whole sequence, causal SDPA, no cache (the check);
  ``ContiguousKV``    SDPA decode over a contiguous per-request KV cache (the native baseline).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama import CONFIGS, Config  # noqa: E402,F401  (same configs as the JAX example)

from torch_bridge import RadixAttention  # noqa: E402

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchLlama:
    """Random weights (scaled by 1/sqrt(fan_in)) from ``seed``; RMSNorm, RoPE, GQA, SwiGLU."""

    def __init__(self, cfg: Config, seed: int = 0, device="cpu"):
        self.cfg = cfg
        self.dtype = _DTYPES[cfg.dtype]
        g = torch.Generator(device=device).manual_seed(seed)

        def w(*shape):
            return (torch.randn(shape, generator=g, device=device) / shape[0] ** 0.5).to(self.dtype)

        qd, kd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.layers = [dict(wq=w(cfg.dim, qd), wk=w(cfg.dim, kd), wv=w(cfg.dim, kd), wo=w(qd, cfg.dim),
                            w1=w(cfg.dim, cfg.ffn_dim), w3=w(cfg.dim, cfg.ffn_dim), w2=w(cfg.ffn_dim, cfg.dim))
                       for _ in range(cfg.n_layers)]
        self.embed = torch.randn(cfg.vocab, cfg.dim, generator=g, device=device).to(self.dtype)
        self.head = w(cfg.dim, cfg.vocab)
        self.attn = [RadixAttention(cfg.n_heads, cfg.head_dim, cfg.head_dim**-0.5, cfg.n_kv_heads, i)
                     for i in range(cfg.n_layers)]
        half = cfg.head_dim // 2
        self.freqs = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float32, device=device) / half)

    def rope(self, x, positions):  # x [T, H, D], positions [T]
        half = x.shape[-1] // 2
        ang = positions.float()[:, None] * self.freqs[None]  # [T, half]
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)

    @staticmethod
    def rms_norm(x, eps=1e-5):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    @torch.inference_mode()
    def forward(self, ids, positions, attend):
        """``ids [T]`` new tokens -> ``logits f32[T, V]``."""
        cfg, t = self.cfg, ids.shape[0]
        x = self.embed[ids]
        for i, lp in enumerate(self.layers):
            h = self.rms_norm(x)
            q = self.rope((h @ lp["wq"]).view(t, cfg.n_heads, cfg.head_dim), positions)
            k = self.rope((h @ lp["wk"]).view(t, cfg.n_kv_heads, cfg.head_dim), positions)
            v = (h @ lp["wv"]).view(t, cfg.n_kv_heads, cfg.head_dim)
            x = x + attend(i, q, k, v) @ lp["wo"]
            h = self.rms_norm(x)
            x = x + (F.silu(h @ lp["w1"]) * (h @ lp["w3"])) @ lp["w2"]
        return (self.rms_norm(x) @ self.head).float()


def bridge_attend(model: TorchLlama, forward_batch):
    """Attention through the batch's ``attn_backend`` (torch_bridge), SGLang's call shape."""
    def attend(i, q, k, v):
        t = q.shape[0]
        return model.attn[i](q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), forward_batch)
    return attend


def dense_attend(i, q, k, v):
    """One whole sequence, causal SDPA (no cache)."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
    return o[0].transpose(0, 1).reshape(q.shape[0], -1)


class ContiguousKV:
    """Per-request contiguous cache ``[L, B, Hkv, max_ctx, D]`` and SDPA decode (one token each)."""

    def __init__(self, cfg: Config, batch: int, max_ctx: int, dtype, device):
        shape = (cfg.n_layers, batch, cfg.n_kv_heads, max_ctx, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.lens = torch.zeros(batch, dtype=torch.long, device=device)

    def prefill_attend(self, b: int):
        """Dense causal attention for request ``b``'s prompt, storing its K/V."""
        def attend(i, q, k, v):
            n = q.shape[0]
            self.k[i, b, :, :n] = k.transpose(0, 1)
            self.v[i, b, :, :n] = v.transpose(0, 1)
            return dense_attend(i, q, k, v)
        return attend

    def decode_attend(self, uniform_len: int = 0):
        """Decode at position ``lens[b]``; ``uniform_len`` > 0: every request has that many keys (no mask).

        Without ``uniform_len`` the whole capacity is attended under a length mask, so the shapes
        stay fixed from step to step (SDPA backends plan per shape).
        """
        rows = torch.arange(self.k.shape[1], device=self.k.device)

        def attend(i, q, k, v):  # q [B, Hq, D], k/v [B, Hkv, D]
            self.k[i, rows, :, self.lens] = k
            self.v[i, rows, :, self.lens] = v
            n = uniform_len or self.k.shape[3]
            keys = torch.arange(n, device=q.device)
            mask = None if uniform_len else (keys[None] <= self.lens[:, None])[:, None, None]
            o = F.scaled_dot_product_attention(q[:, :, None], self.k[i, :, :, :n], self.v[i, :, :, :n],
                                               attn_mask=mask, enable_gqa=True)
            return o.reshape(q.shape[0], -1)
        return attend
