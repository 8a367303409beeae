"""The Llama-style model of ``examples/llama.py`` (same configs and layer math) in torch: random weights, or
a real checkpoint (``TorchLlama.from_checkpoint`` of ``jax_attn.models.load_checkpoint``: qkv biases, tied
head, rope scaling, RMS eps and norm weights from its config; no sliding window here).

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
from llama import _HF_LAYER, CONFIGS, Config  # noqa: E402,F401  (same configs and weight names as the JAX example)

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
        self.norm = None  # final RMSNorm weight (None: ones)
        self._setup(device)

    def _setup(self, device):
        cfg = self.cfg
        if cfg.sliding_window:
            raise NotImplementedError("the torch example model has no sliding window: use examples/llama.py")
        self.attn = [RadixAttention(cfg.n_heads, cfg.head_dim, cfg.head_dim**-0.5, cfg.n_kv_heads, i)
                     for i in range(cfg.n_layers)]
        self.freqs = torch.from_numpy(cfg.rope_inv_freq()).to(device)

    @classmethod
    def from_checkpoint(cls, ckpt, device="cpu") -> "TorchLlama":
        """A ``jax_attn.models.Checkpoint``'s weights (cast to ``ckpt.config.dtype``), HF names mapped as
        ``llama.params_from_checkpoint`` maps them."""
        self = cls.__new__(cls)
        self.cfg, self.dtype = ckpt.config, _DTYPES[ckpt.config.dtype]
        get = lambda name, transpose=False: torch.from_numpy(  # noqa: E731
            (ckpt.tensors[name].T if transpose else ckpt.tensors[name]).copy()).to(device, self.dtype)
        names = [k for k in _HF_LAYER if k[0] != "b" or self.cfg.qkv_bias]
        self.layers = [{k: get(f"model.layers.{i}.{_HF_LAYER[k]}", k[0] == "w") for k in names}
                       for i in range(self.cfg.n_layers)]
        self.embed, self.norm = get("model.embed_tokens.weight"), get("model.norm.weight")
        self.head = self.embed.T if self.cfg.tie_embeddings else get("lm_head.weight", True)
        self._setup(device)
        return self

    def rope(self, x, positions):  # x [T, H, D], positions [T]
        half = x.shape[-1] // 2
        ang = positions.float()[:, None] * self.freqs[None]  # [T, half]
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)

    def rms_norm(self, x, w=None):
        xf = x.float()
        out = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_eps)).to(x.dtype)
        return out if w is None else out * w

    @torch.inference_mode()
    def forward(self, ids, positions, attend):
        """``ids [T]`` new tokens -> ``logits f32[T, V]``."""
        cfg, t = self.cfg, ids.shape[0]
        x = self.embed[ids]
        for i, lp in enumerate(self.layers):
            h = self.rms_norm(x, lp.get("n1"))
            q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
            if "bq" in lp:  # Qwen2
                q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
            q = self.rope(q.view(t, cfg.n_heads, cfg.head_dim), positions)
            k = self.rope(k.view(t, cfg.n_kv_heads, cfg.head_dim), positions)
            x = x + attend(i, q, k, v.view(t, cfg.n_kv_heads, cfg.head_dim)) @ lp["wo"]
            h = self.rms_norm(x, lp.get("n2"))
            x = x + (F.silu(h @ lp["w1"]) * (h @ lp["w3"])) @ lp["w2"]
        return (self.rms_norm(x, self.norm) @ self.head).float()


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
