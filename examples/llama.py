"""A small Llama-style model in plain JAX (RMSNorm, RoPE, GQA, SwiGLU): random weights (``init_params``)
or a real Llama-family checkpoint (``params_from_checkpoint`` of ``jax_attn.models.load_checkpoint``:
Llama 2/3, Qwen2/2.5 with qkv biases, Mistral, SmolLM2; tied embeddings, rope theta and scaling, RMS eps
and sliding window from its config).

Gemma 2/3 and Phi-3 are the same forward with the switches of ``Config``: (1 + w) RMSNorm, norms after
attention and after the MLP, q/k norms, a sqrt(dim) embedding scale, GeLU-tanh, attention softcap and
softmax scale (``LayerParams.logit_cap`` / ``scaling``), a final logit softcap, sliding-window layers
chosen per layer, a second rope base for local layers, partial rotary and LongRoPE's attention factor.

``Config.attention_chunk_size > 0`` makes it Llama-4 style (iRoPE): layer i with ``(i + 1) % 4 != 0``
is a chunked local layer with RoPE (a query sees only the keys of its own ``attention_chunk_size``
chunk: ``LayerParams(use_irope=True)``), every fourth layer is global and NoPE (no rotary
embedding). ``CONFIGS["tiny-llama4"]`` is such a model.

Two attention paths share every other line (``forward_layers``: the model around a caller's
attention): ``forward_paged`` runs jax_attn's backend over a paged KV pool; ``forward_dense``
recomputes whole sequences with dense causal attention and is the check. The weights and pools
can be laid out several ways (``LAYOUTS``): per-layer arrays, or fused and stacked over layers so
that a compiled step takes a dozen arguments instead of ~180.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

import numpy as np

from jax_attn.backend import FlashAttentionBackend, LayerParams
from jax_attn.kv_cache import KVPool
from jax_attn.models.config import Config  # noqa: F401  (the model's shape; llama.Config as before)


CONFIGS = {
    "tiny": Config(vocab=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                   dtype="float32"),
    "tiny-llama4": Config(vocab=512, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128,
                          dtype="float32", attention_chunk_size=8),  # layers 0-2 local, 3 global NoPE
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
    unit = functools.partial(jnp.zeros if cfg.norm_plus_one else jnp.ones, dtype=dt)  # an identity norm weight
    layers = [dict(wq=w((cfg.dim, qd)), wk=w((cfg.dim, kd)), wv=w((cfg.dim, kd)), wo=w((qd, cfg.dim)),
                   w1=w((cfg.dim, cfg.ffn_dim)), w3=w((cfg.dim, cfg.ffn_dim)), w2=w((cfg.ffn_dim, cfg.dim)),
                   n1=unit((cfg.dim,)), n2=unit((cfg.dim,)))
              for _ in range(cfg.n_layers)]
    for lp in layers:
        if cfg.qkv_bias:
            lp.update(bq=w((1, qd))[0], bk=w((1, kd))[0], bv=w((1, kd))[0])
        if cfg.sandwich_norms:
            lp.update(n1p=unit((cfg.dim,)), n2p=unit((cfg.dim,)))
        if cfg.qk_norm:
            lp.update(qn=unit((cfg.head_dim,)), kn=unit((cfg.head_dim,)))
    embed = (jax.random.normal(next(keys), (cfg.vocab, cfg.dim), jnp.float32)).astype(dt)
    params = dict(embed=embed, layers=layers, norm=unit((cfg.dim,)))
    return params if cfg.tie_embeddings else dict(params, head=w((cfg.dim, cfg.vocab)))


# Hugging Face names (``jax_attn.models.Checkpoint.tensors``) of each layer weight; ``.T``: stored [out, in].
_HF_LAYER = dict(wq="self_attn.q_proj.weight", wk="self_attn.k_proj.weight", wv="self_attn.v_proj.weight",
                 wo="self_attn.o_proj.weight", w1="mlp.gate_proj.weight", w3="mlp.up_proj.weight",
                 w2="mlp.down_proj.weight", n1="input_layernorm.weight", n2="post_attention_layernorm.weight",
                 bq="self_attn.q_proj.bias", bk="self_attn.k_proj.bias", bv="self_attn.v_proj.bias")
# Gemma 2/3: ``post_attention_layernorm`` normalizes the attention output (n1p); the MLP's input norm is
# ``pre_feedforward_layernorm`` (n2) and its output norm ``post_feedforward_layernorm`` (n2p).
_HF_SANDWICH = dict(n2="pre_feedforward_layernorm.weight", n1p="post_attention_layernorm.weight",
                    n2p="post_feedforward_layernorm.weight")
_HF_QK_NORM = dict(qn="self_attn.q_norm.weight", kn="self_attn.k_norm.weight")  # Gemma 3, over each head


def hf_layer_names(cfg: Config) -> dict:
    """Our name -> Hugging Face name of each weight of a layer of ``cfg`` (``w*``: linear, stored [out, in])."""
    names = {k: v for k, v in _HF_LAYER.items() if k[0] != "b" or cfg.qkv_bias}
    if cfg.sandwich_norms:
        names.update(_HF_SANDWICH)
    if cfg.qk_norm:
        names.update(_HF_QK_NORM)
    return names


def params_from_checkpoint(ckpt) -> dict:
    """A ``jax_attn.models.Checkpoint``'s weights in the ``list`` layout (cast to ``ckpt.config.dtype``)."""
    cfg, t = ckpt.config, ckpt.tensors
    dt = jnp.dtype(cfg.dtype)

    def get(name, transpose=False):
        if name not in t:
            raise ValueError(f"{ckpt.source}: weight {name!r} missing (a Llama-family checkpoint has it)")
        a = np.asarray(t[name])
        return jnp.asarray(a.T if transpose else a, dt)

    names = hf_layer_names(cfg)
    layers = [{k: get(f"model.layers.{i}.{hf}", k[0] == "w") for k, hf in names.items()} for i in range(cfg.n_layers)]
    params = dict(embed=get("model.embed_tokens.weight"), layers=layers, norm=get("model.norm.weight"))
    return params if cfg.tie_embeddings else dict(params, head=get("lm_head.weight", True))


# ---- weight layouts ----------------------------------------------------------------------
# How the weights (and KV pools) are passed to a compiled step; every layout computes the same model.
#   list      per-layer dicts of unfused weights, per-layer pools (9 + 2 leaves per layer)
#   fused     fused weights stacked over layers (wqkv, wo, w13, w2, n1, n2: [L, ...]), one
#             layer-stacked pool; an unrolled loop takes layer i with a static index
#   scan      as fused, the layers under ``lax.scan`` (traced layer index)
#   flat      every layer's fused weights in one 1-D buffer at static offsets, stacked pool
#   perlayer  per-layer dicts of fused weights (6 leaves per layer), stacked pool
LAYOUTS = ("list", "fused", "scan", "flat", "perlayer")


def fuse_layer(lp: dict) -> dict:
    """Unfused layer weights -> ``wqkv [dim, (Hq+2Hkv)*D]``, ``w13 [dim, 2*ffn]`` (same math)."""
    fused = dict(wqkv=jnp.concatenate([lp["wq"], lp["wk"], lp["wv"]], -1), wo=lp["wo"],
                 w13=jnp.concatenate([lp["w1"], lp["w3"]], -1), w2=lp["w2"], n1=lp["n1"], n2=lp["n2"])
    if "bq" in lp:
        fused["bqkv"] = jnp.concatenate([lp["bq"], lp["bk"], lp["bv"]], -1)
    fused.update({k: a for k, a in lp.items() if k not in _FUSED_AWAY})  # Gemma's extra norms as they are
    return fused


_FUSED_AWAY = ("wq", "wk", "wv", "w1", "w3", "bq", "bk", "bv")


def stack_layers(params):
    """Per-layer weight dicts -> one dict of ``[L, ...]`` arrays."""
    return dict(params, layers=jax.tree.map(lambda *xs: jnp.stack(xs), *params["layers"]))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["buf"], meta_fields=["entries", "layer_size"])
@dataclasses.dataclass(frozen=True)
class FlatLayers:
    """Every layer's weights in one 1-D buffer; layer ``i`` starts at ``i * layer_size``."""

    buf: jax.Array  # [L * layer_size], one dtype
    entries: tuple  # ((name, offset, shape), ...) within one layer; offsets 128-element aligned
    layer_size: int

    def layer(self, i: int) -> dict:
        """Layer ``i``'s weights: static slices of the buffer (``i`` a Python int)."""
        base = i * self.layer_size
        return {name: jax.lax.slice(self.buf, (base + off,), (base + off + math.prod(shape),)).reshape(shape)
                for name, off, shape in self.entries}


def flatten_layers(layers: list) -> FlatLayers:
    """Per-layer weight dicts (one dtype) -> ``FlatLayers``."""
    dtypes = {a.dtype for lp in layers for a in lp.values()}
    if len(dtypes) != 1:
        raise ValueError(f"flat layout needs one weight dtype, got {sorted(map(str, dtypes))}: cast the weights first")
    aligned = lambda n: -(-n // 128) * 128  # noqa: E731
    entries, at = [], 0
    for name, a in layers[0].items():
        entries.append((name, at, tuple(a.shape)))
        at += aligned(a.size)
    parts = []
    for lp in layers:
        for name, _, shape in entries:
            a = lp[name].reshape(-1)
            parts += [a, jnp.zeros((aligned(a.size) - a.size,), a.dtype)]
    return FlatLayers(jnp.concatenate(parts), tuple(entries), at)


def with_layout(params, layout: str):
    """``init_params`` weights (``list`` layout) re-arranged for ``layout`` (see ``LAYOUTS``)."""
    if layout not in LAYOUTS:
        raise ValueError(f"{layout=} must be one of {LAYOUTS}")
    if layout == "list":
        return params
    fused = [fuse_layer(lp) for lp in params["layers"]]
    if layout == "perlayer":
        return dict(params, layers=fused)
    if layout == "flat":
        return dict(params, layers=flatten_layers(fused))
    return stack_layers(dict(params, layers=fused))


def layer_weights(layers, i: int) -> dict:
    """Layer ``i``'s weight dict from any layout's ``params["layers"]`` (static ``i``: no copy intended)."""
    if isinstance(layers, FlatLayers):
        return layers.layer(i)
    if isinstance(layers, dict):
        return {name: a[i] for name, a in layers.items()}
    return layers[i]


def new_stacked_pool(cfg: Config, num_slots: int) -> KVPool:
    """All layers' KV in one ``[L, num_slots, Hkv, D]`` pool (two leaves per call instead of 2·L)."""
    shape = (cfg.n_layers, num_slots, cfg.n_kv_heads, cfg.head_dim)
    return KVPool(jnp.zeros(shape, jnp.dtype(cfg.dtype)), jnp.zeros(shape, jnp.dtype(cfg.dtype)))


def new_pools(cfg: Config, num_slots: int):
    return [KVPool.zeros(num_slots, cfg.n_kv_heads, cfg.head_dim, jnp.dtype(cfg.dtype))
            for _ in range(cfg.n_layers)]


def layout_pools(cfg: Config, layout: str, num_slots: int):
    """Empty KV pools for ``layout``: a list of per-layer pools (``list``) or one stacked pool."""
    return new_pools(cfg, num_slots) if layout == "list" else new_stacked_pool(cfg, num_slots)


def layer_params(cfg: Config, layer_id: int) -> LayerParams:
    """Layer ``layer_id``'s attention knobs: its window (sliding layers), softcap and softmax scale."""
    return LayerParams(num_q_heads=cfg.n_heads, num_kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                       layer_id=layer_id, use_irope=cfg.is_local(layer_id),
                       sliding_window_size=cfg.window_left(layer_id), scaling=cfg.query_scale or None,
                       logit_cap=cfg.attn_softcap)


# ---- layer math ---------------------------------------------------------------------------
def rms_norm(x, w, eps=1e-5, plus_one=False):
    """RMSNorm; ``plus_one`` (Gemma): scale by ``1 + w`` in float32, then cast (Llama: cast, then ``* w``)."""
    xf = x.astype(jnp.float32)
    n = xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + eps)
    if plus_one:
        return (n * (1.0 + w.astype(jnp.float32))).astype(x.dtype)
    return n.astype(x.dtype) * w


def _norm(cfg, x, w):
    return rms_norm(x, w, cfg.rms_eps, cfg.norm_plus_one)


def rope(x, positions, inv_freq, scale=1.0):  # x [T, H, D], positions i32[T], inv_freq f32[R // 2] (R <= D)
    """Rotate-half RoPE over the leading ``R = 2 * len(inv_freq)`` dims (partial rotary: the rest pass);
    cos and sin times ``scale`` (LongRoPE's attention factor)."""
    half = len(inv_freq)
    ang = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None]  # [T, half]
    cos, sin = jnp.cos(ang)[:, None] * scale, jnp.sin(ang)[:, None] * scale
    x1, x2 = x[..., :half].astype(jnp.float32), x[..., half:2 * half].astype(jnp.float32)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)
    return out if 2 * half == x.shape[-1] else jnp.concatenate([out, x[..., 2 * half:]], -1)


def _qkv(cfg, lp, h, positions, i=0):  # h [T, dim] -> q [T, Hq, D], k/v [T, Hkv, D]; i: the layer (static)
    t = h.shape[0]
    qd, kd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    if "wqkv" in lp:
        qkv = h @ lp["wqkv"] + lp["bqkv"] if "bqkv" in lp else h @ lp["wqkv"]
        q, k, v = jnp.split(qkv, [qd, qd + kd], axis=-1)
    else:
        q, k, v = h @ lp["wq"], h @ lp["wk"], h @ lp["wv"]
        if "bq" in lp:  # Qwen2
            q, k, v = q + lp["bq"], k + lp["bk"], v + lp["bv"]
    q, k = q.reshape(t, cfg.n_heads, cfg.head_dim), k.reshape(t, cfg.n_kv_heads, cfg.head_dim)
    if cfg.qk_norm:  # Gemma 3: per head, before RoPE
        q, k = _norm(cfg, q, lp["qn"]), _norm(cfg, k, lp["kn"])
    if cfg.uses_rope(i):  # Llama-4's global layers are NoPE
        inv_freq, scale = cfg.rope_inv_freq(i), cfg.rope_scale(i)
        q, k = rope(q, positions, inv_freq, scale), rope(k, positions, inv_freq, scale)
    return q, k, v.reshape(t, cfg.n_kv_heads, cfg.head_dim)


def _mlp(cfg, lp, x, reduce=None):
    h = _norm(cfg, x, lp["n2"])
    gate, up = jnp.split(h @ lp["w13"], 2, axis=-1) if "w13" in lp else (h @ lp["w1"], h @ lp["w3"])
    act = jax.nn.silu(gate) if cfg.act == "silu" else jax.nn.gelu(gate, approximate=True)
    out = (act * up) @ lp["w2"]
    out = reduce(out) if reduce else out  # tensor parallel: the row-parallel down projection's psum
    return x + (_norm(cfg, out, lp["n2p"]) if cfg.sandwich_norms else out)


def _block(cfg, lp, x, positions, i, attend, reduce=None):
    """One decoder layer (``i`` static) around ``attend(q, k, v) -> (out [T, Hq * D], state)``: ``(x, state)``.
    ``reduce``: applied to the o and down projections' outputs (tensor parallel: their ``psum``)."""
    q, k, v = _qkv(cfg, lp, _norm(cfg, x, lp["n1"]), positions, i)
    out, state = attend(q, k, v)
    out = out @ lp["wo"]
    out = reduce(out) if reduce else out
    return _mlp(cfg, lp, x + (_norm(cfg, out, lp["n1p"]) if cfg.sandwich_norms else out), reduce), state


def _paged_attend(cfg, backend, md, i, q, k, v, pools):
    """Layer ``i``'s attention through the paged backend: ``(out [T, Hq * D], pools)``; ``pools`` a per-layer
    list or one stacked pool (``i`` may be traced then: identical layers, so layer 0's knobs)."""
    layer = layer_params(cfg, i if isinstance(i, int) else 0)
    if isinstance(pools, KVPool):  # the stacked pool, read whole with this layer's slot offset
        return backend.forward(q, k, v, layer, pools, md, layer_index=i)
    attn, pool = backend.forward(q, k, v, layer, pools[i], md)
    return attn, [*pools[:i], pool, *pools[i + 1:]]


def _layer(cfg, backend, lp, md, x, positions, pools, i, reduce=None):
    """One decoder layer over the paged pools (``lax.scan``'s body: ``i`` traced)."""
    attend = lambda q, k, v: _paged_attend(cfg, backend, md, i, q, k, v, pools)  # noqa: E731
    return _block(cfg, lp, x, positions, i if isinstance(i, int) else 0, attend, reduce)


def _embed(cfg, params, token_ids):  # Gemma: times sqrt(dim), the scale rounded to the model dtype (as HF)
    x = params["embed"][token_ids]
    return x * jnp.asarray(cfg.dim**0.5, x.dtype) if cfg.embed_scale else x


def _logits(cfg, params, x):  # x [T, dim] -> f32[T, V]; a tied head is the embedding
    head = params["embed"].T if cfg.tie_embeddings else params["head"]
    logits = (_norm(cfg, x, params["norm"]) @ head).astype(jnp.float32)
    return cfg.final_softcap * jnp.tanh(logits / cfg.final_softcap) if cfg.final_softcap else logits


def forward_paged(cfg: Config, backend: FlashAttentionBackend, params, md, token_ids, positions, pools, *,
                  scan: bool = False, reduce=None):
    """One step over ragged new tokens ``token_ids i32[T]``; returns ``(logits f32[T, V], pools)``.

    ``params`` in any of ``LAYOUTS`` with ``pools`` as ``layout_pools`` makes them. The layers run
    as an unrolled loop (static layer index), or under ``lax.scan`` with ``scan=True`` (stacked
    weights and pool only). ``reduce`` (tensor parallel, ``examples/tp.py``): called on the o and down
    projections' partial outputs, e.g. ``lambda x: lax.psum(x, "tp")``; ``cfg`` then has the shard's heads.
    """
    if scan:
        x = _embed(cfg, params, token_ids)
        if not isinstance(params["layers"], dict) or not isinstance(pools, KVPool):
            raise ValueError("scan=True needs layer-stacked weights (with_layout(params, 'scan')) and a stacked pool")
        if not cfg.uniform_layers():
            raise ValueError("scan=True needs identical layers; a config with local and global layers (Llama 4, "
                             "Gemma 2/3) needs an unrolled layout (fused)")

        def body(carry, xs):
            return _layer(cfg, backend, xs[0], md, carry[0], positions, carry[1], xs[1], reduce), None

        steps = (params["layers"], jnp.arange(cfg.n_layers, dtype=jnp.int32))
        (x, pools), _ = jax.lax.scan(body, (x, pools), steps)
        return _logits(cfg, params, x), pools
    return forward_layers(cfg, params, token_ids, positions, functools.partial(_paged_attend, cfg, backend, md), pools,
                          reduce)


def forward_layers(cfg: Config, params, token_ids, positions, attend, state, reduce=None):
    """The model around a caller's attention: embedding, the layers unrolled (static index ``i``), the head.

    ``attend(i, q, k, v, state) -> (out [T, Hq * D], state)`` with q ``[T, Hq, D]`` and k/v ``[T, Hkv, D]``
    (roped) runs layer ``i``'s attention; ``state`` (KV pools or caches) is threaded through the layers.
    ``forward_paged`` and ``forward_dense`` are this with their attention; so is the contiguous-cache
    baseline of ``benchmarks/bench_jax_step.py --mode baseline``. Returns ``(logits f32[T, V], state)``.
    """
    x = _embed(cfg, params, token_ids)
    for i in range(cfg.n_layers):
        layer_attend = lambda q, k, v, i=i, state=state: attend(i, q, k, v, state)  # noqa: E731
        x, state = _block(cfg, layer_weights(params["layers"], i), x, positions, i, layer_attend, reduce)
    return _logits(cfg, params, x), state


def _dense_causal(q, k, v, chunk: int = 0, window: int = 0, scale=None, softcap: float = 0.0):
    """q [S, Hq, D], k/v [S, Hkv, D] -> [S, Hq * D]: causal softmax over whole sequences."""
    s_len, hq, d = q.shape
    g = hq // k.shape[1]
    qf = q.astype(jnp.float32).reshape(s_len, k.shape[1], g, d)
    s = jnp.einsum("skgd,tkd->kgst", qf, k.astype(jnp.float32)) * (scale or d**-0.5)
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    mask = jnp.tril(jnp.ones((s_len, s_len), bool))
    pos = jnp.arange(s_len)
    if chunk:  # query p sees keys in [p // chunk * chunk, p]
        mask &= (pos[None, :] // chunk) == (pos[:, None] // chunk)
    if window:  # query p sees its last `window` keys (HF's sliding_window)
        mask &= pos[:, None] - pos[None, :] < window
    s = jnp.where(mask, s, -jnp.inf)
    o = jnp.einsum("kgst,tkd->skgd", jax.nn.softmax(s, -1), v.astype(jnp.float32))
    return o.reshape(s_len, hq * d).astype(q.dtype)


@functools.partial(jax.jit, static_argnums=0)
def forward_dense(cfg: Config, params, token_ids):
    """Whole-sequence forward with dense causal attention (no cache; local layers: the chunk mask, sliding
    layers: the window): ``logits f32[S, V]``."""
    cfg.check_context(token_ids.shape[0])
    positions = jnp.arange(token_ids.shape[0], dtype=jnp.int32)

    def dense(i, q, k, v, state):
        chunk = cfg.attention_chunk_size if cfg.is_local(i) else 0
        window = cfg.sliding_window if cfg.is_sliding(i) else 0
        return _dense_causal(q, k, v, chunk, window, cfg.softmax_scale(), cfg.attn_softcap), state

    if isinstance(params["layers"], dict) and cfg.uniform_layers():  # stacked layers: one compiled body
        body = lambda x, lp: _block(cfg, lp, x, positions, 0, lambda q, k, v: dense(0, q, k, v, None))  # noqa: E731
        return _logits(cfg, params, jax.lax.scan(body, _embed(cfg, params, token_ids), params["layers"])[0])
    return forward_layers(cfg, params, token_ids, positions, dense, None)[0]


def decode_arg_parser(doc: str) -> argparse.ArgumentParser:
    """The command-line options the decode examples share (JAX and torch)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny", choices=sorted(CONFIGS))
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--min-prompt", type=int, default=5)
    ap.add_argument("--max-prompt", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--page-size", type=int, default=4)
    ap.add_argument("--impl", default="auto", choices=["auto", "triton", "mosaic", "reference"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-check", dest="check", action="store_false")
    return ap
