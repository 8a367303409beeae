"""The dense-attention baseline of ``bench_jax_step.py --baseline dense-cudnn``: the example Llama-style
model (``examples/llama.py``: its weights, config and layer math, run by ``llama.forward_layers``) with
dense attention over a contiguous per-request KV cache, as JAX decode loops in the style of MaxText and
gpt-fast run it.

Per layer a cache ``(k, v)``, each ``[B, C, Hkv, D]``. A step writes its new tokens' k/v at each request's
own position (a dynamic update per request, in place: the caches are donated) and attends through
``jax.nn.dot_product_attention``: cuDNN's fused flash attention on a GPU (``implementation="cudnn"``), with
its native GQA (fewer kv heads than query heads) and the keys past each request's length masked by
``key_value_seq_lengths`` (``query_seq_lengths`` for padded prompt rows). Off a GPU, or for a float32
model, cuDNN cannot run and the baseline takes XLA's implementation (``implementation=None``) instead:
``attention_impl`` says which, and why.

Dimensions: B requests, S tokens per request in the step, C cache positions per request, Hq / Hkv query /
kv heads, D head dim, V vocab.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Optional

import jax
import jax.numpy as jnp

_EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
if _EXAMPLES not in sys.path:
    sys.path.insert(0, _EXAMPLES)

import llama  # noqa: E402

from jax_attn.kv_cache import KVPool  # noqa: E402

NAME = "dense-cudnn"  # the baseline's name on the command line (``--baseline``)


def attention_impl(dtype) -> tuple[Optional[str], str]:
    """``jax.nn.dot_product_attention``'s ``implementation`` for a model of ``dtype``, and why: ``"cudnn"`` on
    a GPU for fp16/bf16; otherwise ``None`` (XLA), since cuDNN's fused attention needs both."""
    if jax.default_backend() != "gpu":
        return None, f"XLA (implementation=None): cuDNN attention needs a GPU, this is {jax.default_backend()}"
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return None, f"XLA (implementation=None): cuDNN attention needs fp16/bf16, the model is {jnp.dtype(dtype)}"
    return "cudnn", "cuDNN (implementation='cudnn')"


def check_config(cfg: llama.Config) -> None:
    """The baseline runs plain Llama layers (global causal attention, no softcap); anything else raises."""
    if cfg.attention_chunk_size or cfg.sliding_window or cfg.attn_softcap:
        raise ValueError(f"the dense baseline runs plain Llama layers: {cfg.attention_chunk_size=}, "
                         f"{cfg.sliding_window=} and {cfg.attn_softcap=} must be 0 (use a config such as '1b')")


def caches_from_pools(pools, slots) -> list:
    """Per-layer dense caches holding the paged pools' contents, ``cache[b, p] = pool[slots[b, p]]``, so both
    paths attend over the same KV values.

    Args:
      pools: per-layer ``KVPool``s or one layer-stacked pool (``llama.LAYOUTS``).
      slots: i32[B, C], each request's row of ``req_to_token``.
    """
    slots = jnp.asarray(slots)
    if isinstance(pools, KVPool):  # stacked: [L, num_slots, Hkv, D]
        return [(pools.k[i][slots], pools.v[i][slots]) for i in range(pools.k.shape[0])]
    return [(p.k[slots], p.v[slots]) for p in pools]


def _write(cache, new, starts):  # cache [B, C, Hkv, D], new [B, S, Hkv, D], starts i32[B]
    """``new`` written into each request's cache rows from its own start (a dynamic update per request)."""
    return jax.vmap(lambda c, x, s: jax.lax.dynamic_update_slice(c, x, (s, 0, 0)))(cache, new.astype(cache.dtype),
                                                                                    starts)


def forward_cached(cfg: llama.Config, impl: Optional[str], params, caches, ids, lens):
    """One step of the model over contiguous caches: ``(logits f32[B * S, V], caches)``.

    Args:
      impl: ``jax.nn.dot_product_attention``'s implementation (``attention_impl``).
      caches: per layer ``(k, v)``, each ``[B, C, Hkv, D]``.
      ids: i32[B, S]. S == 1 decodes: request b's token sits at position ``lens[b] - 1``, is written there,
        and attends the first ``lens[b]`` keys of its cache. S > 1 prefills prompts from position 0: the
        first ``lens[b]`` tokens of row b are real; they attend causally over their own keys, which are
        written to the cache (rows past ``lens[b]`` compute values no one reads).
      lens: i32[B], each request's length including this step's tokens.
    """
    b, s = ids.shape
    starts = lens - 1 if s == 1 else jnp.zeros_like(lens)
    positions = (starts[:, None] + jnp.arange(s, dtype=jnp.int32)[None]).reshape(-1)
    sdpa = functools.partial(jax.nn.dot_product_attention, scale=cfg.softmax_scale(), implementation=impl)

    def attend(i, q, k, v, caches):  # q [B * S, Hq, D], k/v [B * S, Hkv, D] -> ([B * S, Hq * D], caches)
        q, k, v = (a.reshape(b, s, *a.shape[1:]) for a in (q, k, v))
        ck, cv = _write(caches[i][0], k, starts), _write(caches[i][1], v, starts)
        if s == 1:
            out = sdpa(q, ck, cv, key_value_seq_lengths=lens)
        else:
            out = sdpa(q, k, v, is_causal=True, query_seq_lengths=lens, key_value_seq_lengths=lens)
        return out.reshape(b * s, -1), [*caches[:i], (ck, cv), *caches[i + 1:]]

    return llama.forward_layers(cfg, params, ids.reshape(-1), positions, attend, caches)


def make_step(cfg: llama.Config, impl: Optional[str]):
    """The whole step, jitted, caches donated: ``step(params, caches, ids i32[B, S], lens i32[B]) ->
    (dict(logits=f32[B * S, V], next_ids=i32[B * S]), caches)`` (the outputs of ``bench_jax_step``'s paged
    step: logits of every token and their greedy ids)."""
    check_config(cfg)

    def step(params, caches, ids, lens):
        logits, caches = forward_cached(cfg, impl, params, caches, ids, lens)
        return dict(logits=logits, next_ids=jnp.argmax(logits, -1).astype(jnp.int32)), caches
    return jax.jit(step, donate_argnums=1)
