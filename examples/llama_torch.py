"""The Llama-style model of ``examples/llama.py`` (same configs and layer math) in torch: random weights, or
a real checkpoint (``TorchLlama.from_checkpoint`` of ``jax_attn.models.load_checkpoint``: qkv biases, tied
head, rope scaling, RMS eps and norm weights from its config; Gemma 2/3 and Phi-3 through the same
``Config`` switches as the JAX model: each layer's ``RadixAttention`` carries its window, softcap and scale).

Attention is a parameter: ``forward(ids, positions, attend)`` calls ``attend(layer_id, q, k, v)``
with ``q [T, Hq, D]``, ``k/v [T, Hkv, D]`` (RoPE applied) and expects ``[T, Hq * D]``. Three
attention paths share every other line:
  ``bridge_attend``        torch_bridge (paged KV pool, SGLang's backend interface);
  ``model.dense_attend``   whole sequence, causal, the layer's window / softcap / scale, no cache (the check);
  ``ContiguousKV``         SDPA decode over a contiguous per-request KV cache (the native baseline; plain
                           causal layers only).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama import CONFIGS, Config, hf_layer_names  # noqa: E402,F401  (same configs and weight names as the JAX example)

from torch_bridge import RadixAttention  # noqa: E402

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TorchLlama:
    """Random weights (scaled by 1/sqrt(fan_in)) from ``seed``; RMSNorm, RoPE, GQA, SwiGLU (identity norms)."""

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
        if cfg.attention_chunk_size:
            raise NotImplementedError("the torch example model has no chunked local layers: use examples/llama.py")
        self.attn = [RadixAttention(cfg.n_heads, cfg.head_dim, cfg.softmax_scale(), cfg.n_kv_heads, i,
                                    logit_cap=cfg.attn_softcap, sliding_window_size=cfg.window_left(i))
                     for i in range(cfg.n_layers)]
        self.ropes = [(torch.from_numpy(cfg.rope_inv_freq(i)).to(device), cfg.rope_scale(i))
                      for i in range(cfg.n_layers)]
        self.embed_scale = float(torch.tensor(cfg.dim**0.5).to(self.dtype)) if cfg.embed_scale else None

    @classmethod
    def from_checkpoint(cls, ckpt, device="cpu") -> "TorchLlama":
        """A ``jax_attn.models.Checkpoint``'s weights (cast to ``ckpt.config.dtype``), HF names mapped as
        ``llama.params_from_checkpoint`` maps them."""
        self = cls.__new__(cls)
        self.cfg, self.dtype = ckpt.config, _DTYPES[ckpt.config.dtype]
        get = lambda name, transpose=False: torch.from_numpy(  # noqa: E731
            (ckpt.tensors[name].T if transpose else ckpt.tensors[name]).copy()).to(device, self.dtype)
        names = hf_layer_names(self.cfg)
        self.layers = [{k: get(f"model.layers.{i}.{hf}", k[0] == "w") for k, hf in names.items()}
                       for i in range(self.cfg.n_layers)]
        self.embed, self.norm = get("model.embed_tokens.weight"), get("model.norm.weight")
        self.head = self.embed.T if self.cfg.tie_embeddings else get("lm_head.weight", True)
        self._setup(device)
        return self

    def rope(self, x, positions, i):  # x [T, H, D], positions [T]; layer i's frequencies (leading dims)
        freqs, scale = self.ropes[i]
        half = freqs.shape[0]
        ang = positions.float()[:, None] * freqs[None]  # [T, half]
        cos, sin = ang.cos()[:, None], ang.sin()[:, None]
        if scale != 1.0:  # LongRoPE's attention factor
            cos, sin = cos * scale, sin * scale
        x1, x2 = x[..., :half].float(), x[..., half:2 * half].float()
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)
        return out if 2 * half == x.shape[-1] else torch.cat([out, x[..., 2 * half:]], -1)  # partial rotary

    def rms_norm(self, x, w=None):
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_eps)
        if self.cfg.norm_plus_one:  # Gemma: (1 + w) in float32, then the cast
            return (out if w is None else out * (1.0 + w.float())).to(x.dtype)
        return out.to(x.dtype) if w is None else out.to(x.dtype) * w

    @torch.inference_mode()
    def forward(self, ids, positions, attend):
        """``ids [T]`` new tokens -> ``logits f32[T, V]``."""
        cfg, t = self.cfg, ids.shape[0]
        x = self.embed[ids] if self.embed_scale is None else self.embed[ids] * self.embed_scale
        for i, lp in enumerate(self.layers):
            h = self.rms_norm(x, lp.get("n1"))
            q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
            if "bq" in lp:  # Qwen2
                q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
            q, k = q.view(t, cfg.n_heads, cfg.head_dim), k.view(t, cfg.n_kv_heads, cfg.head_dim)
            if cfg.qk_norm:  # Gemma 3
                q, k = self.rms_norm(q, lp["qn"]), self.rms_norm(k, lp["kn"])
            o = attend(i, self.rope(q, positions, i), self.rope(k, positions, i),
                       v.view(t, cfg.n_kv_heads, cfg.head_dim)) @ lp["wo"]
            x = x + (self.rms_norm(o, lp.get("n1p")) if cfg.sandwich_norms else o)
            h = self.rms_norm(x, lp.get("n2"))
            gate = h @ lp["w1"]
            act = F.silu(gate) if cfg.act == "silu" else F.gelu(gate, approximate="tanh")
            m = (act * (h @ lp["w3"])) @ lp["w2"]
            x = x + (self.rms_norm(m, lp.get("n2p")) if cfg.sandwich_norms else m)
        logits = (self.rms_norm(x, self.norm) @ self.head).float()
        return cfg.final_softcap * torch.tanh(logits / cfg.final_softcap) if cfg.final_softcap else logits

    def dense_attend(self, i, q, k, v):
        """One whole sequence, causal, with layer ``i``'s window, softcap and scale (no cache): the check."""
        layer, t, g = self.attn[i], q.shape[0], q.shape[1] // k.shape[1]
        qh, kh, vh = (a.float().repeat_interleave(r, 1).transpose(0, 1) for a, r in ((q, 1), (k, g), (v, g)))
        s = qh @ kh.transpose(1, 2) * layer.scaling  # [H, T, T]
        if layer.logit_cap:
            s = layer.logit_cap * torch.tanh(s / layer.logit_cap)
        pos = torch.arange(t, device=q.device)
        mask = pos[None, :] <= pos[:, None]
        if layer.sliding_window_size >= 0:  # FA3's inclusive left window
            mask &= pos[:, None] - pos[None, :] <= layer.sliding_window_size
        o = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ vh
        return o.transpose(0, 1).reshape(t, -1).to(q.dtype)


def bridge_attend(model: TorchLlama, forward_batch):
    """Attention through the batch's ``attn_backend`` (torch_bridge), SGLang's call shape."""
    def attend(i, q, k, v):
        t = q.shape[0]
        return model.attn[i](q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1), forward_batch)
    return attend


def dense_attend(i, q, k, v):
    """One whole sequence, causal SDPA (no cache); plain layers only (``TorchLlama.dense_attend`` has them all)."""
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                       v.transpose(0, 1)[None], is_causal=True, enable_gqa=True)
    return o[0].transpose(0, 1).reshape(q.shape[0], -1)


class ContiguousKV:
    """Per-request contiguous cache ``[L, B, Hkv, max_ctx, D]`` and SDPA decode (one token each)."""

    def __init__(self, cfg: Config, batch: int, max_ctx: int, dtype, device):
        if cfg.sliding_window or cfg.attn_softcap or cfg.query_scale:
            raise NotImplementedError("the SDPA baseline computes plain causal attention (no window, softcap or "
                                      "softmax scale of the model's own)")
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
