"""A tiny DeepSeek-style model (MLA attention, random weights) decoding through the JAX API.

    python examples/decode_mla.py                        # CPU: tiny shapes (kernels interpreted)
    python examples/decode_mla.py --page-size 1 --new-tokens 8
    python examples/decode_mla.py --front torch          # the torch model through torch_bridge

Each layer compresses keys and values into a latent ``c_kv`` (``kv_lora_rank`` wide) plus one shared
``k_rope``; the pool keeps one latent row per token (``KVPool.mla``). Attention runs absorbed: ``q_nope``
is taken into the latent space with the per-head ``W_uk`` and the latent output leaves it through
``W_uv`` (``LayerParams(mla=True)``, ``FlashAttentionBackend.forward(..., q_rope=, k_rope=)``), as
SGLang's DeepSeek models call the attention backend. ``--front torch`` runs the same model in torch
with its attention through ``torch_bridge`` (an MLA model runner over SGLang's ``MLATokenToKVPool``).

The script checks itself against the same model with un-absorbed dense attention (per head
``k_nope = c_kv W_uk``, ``v = c_kv W_uv``, a causal softmax over the whole sequence): equal greedy
tokens (near-ties excepted) and close logits; it exits non-zero on a mismatch and prints tokens/s.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_attn.backend import FlashAttentionBackend, LayerParams
from jax_attn.batch import ForwardBatch
from jax_attn.kv_cache import KVPool
from jax_attn.metadata import ForwardMode

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_llama import PagedRequests  # noqa: E402


@dataclasses.dataclass(frozen=True)
class MLAConfig:
    vocab: int = 128
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    nope: int = 16  # qk_nope_head_dim
    rope: int = 8  # qk_rope_head_dim
    v_dim: int = 16  # v_head_dim
    kv_lora_rank: int = 32
    rope_theta: float = 10000.0

    @property
    def scale(self) -> float:
        return (self.nope + self.rope) ** -0.5


def init_params(cfg: MLAConfig, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)

    def w(*shape, fan_in):
        return jnp.asarray(rng.standard_normal(shape).astype(np.float32) / np.sqrt(fan_in))

    h, d, lat = cfg.n_heads, cfg.dim, cfg.kv_lora_rank
    layers = [dict(wq=w(d, h * (cfg.nope + cfg.rope), fan_in=d), w_dkv=w(d, lat + cfg.rope, fan_in=d),
                   w_uk=w(h, lat, cfg.nope, fan_in=lat), w_uv=w(h, lat, cfg.v_dim, fan_in=lat),
                   wo=w(h * cfg.v_dim, d, fan_in=h * cfg.v_dim), w1=w(d, 2 * d, fan_in=d), w2=w(2 * d, d, fan_in=2 * d))
              for _ in range(cfg.n_layers)]
    return dict(embed=w(cfg.vocab, d, fan_in=1), layers=layers)


def _rms(x):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)


def _rope(x, pos, theta):  # x [T, H, R] (rotate-half), pos i32[T]
    half = x.shape[-1] // 2
    inv = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    ang = pos[:, None, None].astype(jnp.float32) * inv
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang), x2 * jnp.cos(ang) + x1 * jnp.sin(ang)], -1)


def _project(cfg, lp, x, pos):
    """(q_nope [T, H, nope], q_rope [T, H, rope], c_kv [T, L], k_rope [T, rope]) of one layer."""
    t = x.shape[0]
    q = (_rms(x) @ lp["wq"]).reshape(t, cfg.n_heads, cfg.nope + cfg.rope)
    kv = _rms(x) @ lp["w_dkv"]
    q_rope = _rope(q[..., cfg.nope:], pos, cfg.rope_theta)
    k_rope = _rope(kv[:, None, cfg.kv_lora_rank:], pos, cfg.rope_theta)[:, 0]
    return q[..., :cfg.nope], q_rope, kv[:, :cfg.kv_lora_rank], k_rope


def _mlp(lp, x):
    return jax.nn.silu(_rms(x) @ lp["w1"]) @ lp["w2"]


def forward_paged(cfg: MLAConfig, backend, params, md, tokens, pos, pools):
    """One step over the paged latent pools: logits f32[T, V] and the updated pools."""
    x = params["embed"][tokens]
    t, new_pools = x.shape[0], []
    layer = LayerParams(cfg.n_heads, 1, cfg.kv_lora_rank + cfg.rope, v_head_dim=cfg.kv_lora_rank, scaling=cfg.scale,
                        mla=True)
    for lp, pool in zip(params["layers"], pools):
        q_nope, q_rope, c_kv, k_rope = _project(cfg, lp, x, pos)
        q_lat = jnp.einsum("thn,hln->thl", q_nope, lp["w_uk"])  # absorbed into the latent space
        out, pool = backend.forward(q_lat.reshape(t, -1), c_kv, None, layer, pool, md,
                                    q_rope=q_rope.reshape(t, -1), k_rope=k_rope)
        out = jnp.einsum("thl,hlv->thv", out.reshape(t, cfg.n_heads, cfg.kv_lora_rank), lp["w_uv"])
        x = x + out.reshape(t, -1) @ lp["wo"]
        x = x + _mlp(lp, x)
        new_pools.append(pool)
    return _rms(x) @ params["embed"].T, new_pools


def forward_dense(cfg: MLAConfig, params, tokens):
    """The same model, un-absorbed, over one whole sequence: logits f32[S, V]."""
    x = params["embed"][tokens]
    s = x.shape[0]
    pos = jnp.arange(s)
    causal = jnp.tril(jnp.ones((s, s), bool))
    for lp in params["layers"]:
        q_nope, q_rope, c_kv, k_rope = _project(cfg, lp, x, pos)
        k_nope = jnp.einsum("sl,hln->shn", c_kv, lp["w_uk"])
        v = jnp.einsum("sl,hlv->shv", c_kv, lp["w_uv"])
        scores = (jnp.einsum("thn,shn->hts", q_nope, k_nope) + jnp.einsum("thr,sr->hts", q_rope, k_rope)) * cfg.scale
        p = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        x = x + jnp.einsum("hts,shv->thv", p, v).reshape(s, -1) @ lp["wo"]
        x = x + _mlp(lp, x)
    return _rms(x) @ params["embed"].T


def torch_front(cfg: MLAConfig, params, reqs, page_size: int, max_ctx: int):
    """The same model in torch, its attention through ``torch_bridge`` (an MLA model runner over SGLang's
    ``MLATokenToKVPool``): ``step(mode, tokens, pos, rows, lens, loc, ext) -> logits f32[T, V]``."""
    import torch

    from torch_bridge import (FlashAttentionBackend as TorchBackend, ForwardBatch as TorchBatch,
                              ForwardMode as TorchMode, MLATokenToKVPool, ModelConfig, ModelRunner, RadixAttention,
                              ReqToTokenPool)

    tp = {k: torch.from_numpy(np.array(v)) for k, v in params.items() if k != "layers"}
    layers = [{k: torch.from_numpy(np.array(v)) for k, v in lp.items()} for lp in params["layers"]]
    pool = MLATokenToKVPool.create(reqs.num_slots, cfg.n_layers, cfg.kv_lora_rank, cfg.rope, torch.float32)
    runner = ModelRunner(ReqToTokenPool(torch.from_numpy(reqs.req_to_token).clone()), pool,
                         ModelConfig(max_ctx, attention_arch="MLA"), page_size=page_size)
    backend = TorchBackend(runner)
    attn = [RadixAttention(cfg.n_heads, cfg.kv_lora_rank + cfg.rope, cfg.scale, 1, i, v_head_dim=cfg.kv_lora_rank)
            for i in range(cfg.n_layers)]

    def rms(x):
        return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6)

    def rope(x, pos):  # x [T, H, R]
        half = x.shape[-1] // 2
        inv = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float32) / half)
        ang = pos[:, None, None].float() * inv
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)

    def step(mode, tokens, pos, rows, lens, loc, ext=None):
        t64 = [torch.from_numpy(np.asarray(a, np.int64)) for a in (rows, lens, loc)]
        fb = TorchBatch(TorchMode.EXTEND if mode == "extend" else TorchMode.DECODE, len(rows), *t64,
                        extend_seq_lens=None if ext is None else torch.from_numpy(np.asarray(ext, np.int64)),
                        token_to_kv_pool=pool)
        backend.init_forward_metadata(fb)
        pos = torch.from_numpy(np.asarray(pos, np.int64))
        x = tp["embed"][torch.from_numpy(np.asarray(tokens, np.int64))]
        t, h = x.shape[0], cfg.n_heads
        for lp, layer in zip(layers, attn):
            q = (rms(x) @ lp["wq"]).reshape(t, h, cfg.nope + cfg.rope)
            kv = rms(x) @ lp["w_dkv"]
            q_lat = torch.einsum("thn,hln->thl", q[..., :cfg.nope], lp["w_uk"])
            out = backend.forward(q_lat.reshape(t, -1), kv[:, :cfg.kv_lora_rank], None, layer, fb,
                                  q_rope=rope(q[..., cfg.nope:], pos).reshape(t, -1),
                                  k_rope=rope(kv[:, None, cfg.kv_lora_rank:], pos)[:, 0])
            out = torch.einsum("thl,hlv->thv", out.reshape(t, h, cfg.kv_lora_rank), lp["w_uv"])
            x = x + out.reshape(t, -1) @ lp["wo"]
            x = x + torch.nn.functional.silu(rms(x) @ lp["w1"]) @ lp["w2"]
        return (rms(x) @ tp["embed"].T).numpy()

    return step


def check_against_dense(cfg, params, prompts, generated, step_logits, tol: float):
    """(worst relative logit error, mismatched tokens that were not near-ties) against ``forward_dense``."""
    worst, mismatches = 0.0, 0
    for prompt, toks, logits in zip(prompts, generated, step_logits):
        seq = np.concatenate([prompt, toks]).astype(np.int32)
        dense = np.asarray(forward_dense(cfg, params, jnp.asarray(seq)))
        for j, (tok, got) in enumerate(zip(toks, logits)):
            want = dense[len(prompt) - 1 + j]
            worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
            top2 = np.sort(want)[-2:]
            if tok != int(np.argmax(want)) and top2[1] - top2[0] > tol * np.abs(want).max():
                mismatches += 1
    return worst, mismatches


def main(batch: int = 3, new_tokens: int = 4, page_size: int = 4, impl: str = "auto", seed: int = 0,
         max_ctx: int = 64, front: str = "jax") -> int:
    cfg = MLAConfig()
    params = init_params(cfg, seed)
    rng = np.random.default_rng(seed + 1)
    prompts = [rng.integers(0, cfg.vocab, int(n)).astype(np.int32) for n in rng.integers(3, 12, batch)]
    reqs = PagedRequests(batch, max_ctx, page_size, seed)  # pages handed out shuffled; page 0 reserved
    table, rows = reqs.req_to_token, reqs.rows
    backend = FlashAttentionBackend(table, page_size=page_size, max_context_len=max_ctx, impl=impl)
    pools = [KVPool.mla(reqs.num_slots, cfg.kv_lora_rank, cfg.rope, jnp.float32) for _ in range(cfg.n_layers)]
    jitted = jax.jit(lambda params, md, tokens, pos, pools: forward_paged(cfg, backend, params, md, tokens, pos,
                                                                          pools))
    bridge = torch_front(cfg, params, reqs, page_size, max_ctx) if front == "torch" else None

    def step(mode, tokens, pos, lens, loc, ext=None):
        """One step's logits (numpy) through the chosen front end."""
        nonlocal pools
        if bridge is not None:
            return bridge(mode, tokens, pos, rows, lens, loc, ext)
        fb = ForwardBatch(ForwardMode.EXTEND if mode == "extend" else ForwardMode.DECODE, rows, lens, loc,
                          extend_seq_lens=ext)
        logits, pools = jitted(params, backend.plan(fb), jnp.asarray(tokens), jnp.asarray(pos), pools)
        return np.asarray(logits)
    lens = np.array([len(p) for p in prompts], np.int32)
    loc = np.concatenate([table[r, :n] for r, n in zip(rows, lens)])
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    last = step("extend", np.concatenate(prompts), pos, lens, loc, lens)[np.cumsum(lens) - 1]
    generated, step_logits = [[] for _ in range(batch)], [[] for _ in range(batch)]
    t0 = None
    for i in range(new_tokens):
        toks = np.argmax(last, axis=-1).astype(np.int32)
        for b in range(batch):
            generated[b].append(int(toks[b]))
            step_logits[b].append(last[b])
        if i == new_tokens - 1:
            break
        loc = table[rows, lens]
        lens = lens + 1
        last = step("decode", toks, lens - 1, lens, loc)
        if t0 is None:
            t0 = time.perf_counter()  # the first decode step compiled
    secs = time.perf_counter() - t0 if t0 is not None and new_tokens > 2 else float("nan")
    worst, mismatches = check_against_dense(cfg, params, prompts, generated, step_logits, tol=1e-3)
    print(f"MLA decode ({front}): batch {batch}, page size {page_size}, {new_tokens} tokens each; "
          f"{batch * (new_tokens - 2) / secs:.1f} tokens/s, {1e3 * secs / max(new_tokens - 2, 1):.1f} ms/step after "
          f"the first decode step; against un-absorbed dense attention: worst relative logit error {worst:.2e}, "
          f"{mismatches} mismatched tokens")
    return 0 if mismatches == 0 and worst < 1e-4 else 1


def parse() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--page-size", type=int, default=4)
    ap.add_argument("--impl", default="auto", choices=["auto", "triton", "reference"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--front", default="jax", choices=["jax", "torch"],
                    help="jax: FlashAttentionBackend; torch: a torch model through torch_bridge")
    return vars(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main(**parse()))
