"""A small Llama-style model in plain JAX (RMSNorm, RoPE, GQA, SwiGLU) with random weights.

Two attention paths share every other line: ``forward_paged`` runs jax_attn's backend over a
paged KV pool; ``forward_dense`` recomputes whole sequences with dense causal attention and is
the check.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_attn.backend import FlashAttentionBackend, LayerParams
from jax_attn.kv_cache import KVPool


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 32000
    dim: int = 2048
    n_layers: int = 16
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    ffn_dim: int = 8192
    rope_theta: float = 500000.0
    dtype: str = "bfloat16"


CONFIGS = {
    "tiny": Config(vocab=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                   dtype="float32"),
    "small": Config(vocab=4096, dim=512, n_layers=4, n_heads=8, n_kv_heads=2, head_dim=64, ffn_dim=1024),
    "1b": Config(),
}


def init_params(cfg: Config, seed: int = 0):
    """Random weights scaled by 1/sqrt(fan_in)."""
    dt = jnp.dtype(cfg.dtype)
    keys = iter(jax.random.split(jax.random.key(seed), 4 + 7 * cfg.n_layers))

    def w(shape):
        return (jax.random.normal(next(keys), shape, jnp.float32) / shape[0] ** 0.5).astype(dt)

    qd, kd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    layers = [dict(wq=w((cfg.dim, qd)), wk=w((cfg.dim, kd)), wv=w((cfg.dim, kd)), wo=w((qd, cfg.dim)),
                   w1=w((cfg.dim, cfg.ffn_dim)), w3=w((cfg.dim, cfg.ffn_dim)), w2=w((cfg.ffn_dim, cfg.dim)),
                   n1=jnp.ones((cfg.dim,), dt), n2=jnp.ones((cfg.dim,), dt))
              for _ in range(cfg.n_layers)]
    embed = (jax.random.normal(next(keys), (cfg.vocab, cfg.dim), jnp.float32)).astype(dt)
    return dict(embed=embed, layers=layers, norm=jnp.ones((cfg.dim,), dt), head=w((cfg.dim, cfg.vocab)))


def stack_layers(params):
    """Per-layer weight dicts -> one dict of ``[L, ...]`` arrays (for the scanned forward)."""
    return dict(params, layers=jax.tree.map(lambda *xs: jnp.stack(xs), *params["layers"]))


def new_stacked_pool(cfg: Config, num_slots: int) -> KVPool:
    """All layers' KV in one ``[L, num_slots, Hkv, D]`` pool (two leaves per call instead of 2·L)."""
    shape = (cfg.n_layers, num_slots, cfg.n_kv_heads, cfg.head_dim)
    return KVPool(jnp.zeros(shape, jnp.dtype(cfg.dtype)), jnp.zeros(shape, jnp.dtype(cfg.dtype)))


def layer_params(cfg: Config, layer_id: int) -> LayerParams:
    return LayerParams(num_q_heads=cfg.n_heads, num_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                       layer_id=layer_id)


def new_pools(cfg: Config, num_slots: int):
    return [KVPool.zeros(num_slots, cfg.n_kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype))
            for _ in range(cfg.n_layers)]


def rms_norm(x, w, eps=1e-5):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)).astype(x.dtype) * w


def rope(x, positions, theta):  # x [T, H, D], positions i32[T]
    half = x.shape[-1] // 2
    freqs = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    ang = positions.astype(jnp.float32)[:, None] * freqs[None]  # [T, half]
    cos, sin = jnp.cos(ang)[:, None], jnp.sin(ang)[:, None]
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def _qkv(cfg, lp, h, positions):
    t = h.shape[0]
    q = (h @ lp["wq"]).reshape(t, cfg.n_heads, cfg.head_dim)
    k = (h @ lp["wk"]).reshape(t, cfg.n_kv_heads, cfg.head_dim)
    v = (h @ lp["wv"]).reshape(t, cfg.n_kv_heads, cfg.head_dim)
    return rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta), v


def _mlp(lp, x):
    h = rms_norm(x, lp["n2"])
    return x + (jax.nn.silu(h @ lp["w1"]) * (h @ lp["w3"])) @ lp["w2"]


def forward_paged(cfg: Config, backend: FlashAttentionBackend, params, md, token_ids, positions, pools):
    """One step over ragged new tokens ``token_ids i32[T]``; returns ``(logits f32[T, V], pools)``.

    ``params["layers"]`` is a list with ``pools`` a list of per-layer pools, or stacked
    (``stack_layers``) with ``pools`` one stacked pool: then the layers run under ``lax.scan``.
    """
    if isinstance(params["layers"], dict):
        return _forward_scanned(cfg, backend, params, md, token_ids, positions, pools)
    x = params["embed"][token_ids]
    new_pools = []
    for i, lp in enumerate(params["layers"]):
        q, k, v = _qkv(cfg, lp, rms_norm(x, lp["n1"]), positions)
        attn, pool = backend.forward(q, k, v, layer_params(cfg, i), pools[i], md)
        new_pools.append(pool)
        x = _mlp(lp, x + attn @ lp["wo"])
    logits = (rms_norm(x, params["norm"]) @ params["head"]).astype(jnp.float32)
    return logits, new_pools


def _forward_scanned(cfg, backend, params, md, token_ids, positions, pool: KVPool):
    lp0 = layer_params(cfg, 0)

    def body(carry, xs):
        x, pool = carry
        lp, i = xs
        q, k, v = _qkv(cfg, lp, rms_norm(x, lp["n1"]), positions)
        attn, pool = backend.forward(q, k, v, lp0, pool, md, layer_index=i)
        return (_mlp(lp, x + attn @ lp["wo"]), pool), None

    x = params["embed"][token_ids]
    (x, pool), _ = jax.lax.scan(body, (x, pool), (params["layers"], jnp.arange(cfg.n_layers, dtype=jnp.int32)))
    return (rms_norm(x, params["norm"]) @ params["head"]).astype(jnp.float32), pool


def _dense_causal(q, k, v):  # q [S, Hq, D], k/v [S, Hkv, D]
    s_len, hq, d = q.shape
    g = hq // k.shape[1]
    qf = q.astype(jnp.float32).reshape(s_len, k.shape[1], g, d)
    s = jnp.einsum("skgd,tkd->kgst", qf, k.astype(jnp.float32)) * d**-0.5
    s = jnp.where(jnp.tril(jnp.ones((s_len, s_len), bool)), s, -jnp.inf)
    o = jnp.einsum("kgst,tkd->skgd", jax.nn.softmax(s, -1), v.astype(jnp.float32))
    return o.reshape(s_len, hq * d).astype(q.dtype)


@functools.partial(jax.jit, static_argnums=0)
def forward_dense(cfg: Config, params, token_ids):
    """Whole-sequence forward with dense causal attention (no cache): ``logits f32[S, V]``."""
    positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)
    x = params["embed"][token_ids]
    layers = params["layers"]
    if isinstance(layers, dict):
        layers = [jax.tree.map(lambda a, i=i: a[i], layers) for i in range(cfg.n_layers)]
    for lp in layers:
        q, k, v = _qkv(cfg, lp, rms_norm(x, lp["n1"]), positions)
        x = _mlp(lp, x + _dense_causal(q, k, v) @ lp["wo"])
    return (rms_norm(x, params["norm"]) @ params["head"]).astype(jnp.float32)


def decode_arg_parser(doc: str) -> argparse.ArgumentParser:
    """The command-line options the decode examples share (JAX and torch)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--min-prompt", type=int, default=5)
    ap.add_argument("--max-prompt", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=4)
    ap.add_argument("--impl", default="auto", choices=["auto", "triton", "reference"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-check", dest="check", action="store_false")
    return ap
