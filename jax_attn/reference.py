"""Plain-``jnp`` reference attention over a paged KV cache (float32 accumulation).

This is the semantic definition every kernel is tested against. It favours clarity over speed:
each query token gathers its sequence's whole (padded) key range.

Dimension legend:
  T  query tokens (ragged over sequences; tokens past ``cu_seqlens_q[B]`` are padding)
  B  sequences;  P  page-table width;  K = P * page_size  keys gathered per sequence
  Hq / Hkv  query / key-value heads;  D / Dv  key / value head dims
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from jax_attn.metadata import AttentionMetadata


def _descale(descale, batch: int, num_kv_heads: int) -> jax.Array:
    """Broadcast ``None`` / scalar / ``[B, Hkv]`` descale factors to f32[B, Hkv]."""
    if descale is None:
        return jnp.ones((batch, num_kv_heads), jnp.float32)
    d = jnp.asarray(descale, jnp.float32)
    if d.ndim == 0:
        return jnp.full((batch, num_kv_heads), d)
    if d.shape != (batch, num_kv_heads):
        raise ValueError(f"{d.shape=} must be () or (batch, num_kv_heads)=({batch}, {num_kv_heads})")
    return d


def token_positions(cache_seqlens, cu_seqlens_q, num_tokens: int):
    """Per query token: (sequence id, position in its sequence's keys, valid flag).

    Returns i32[T] sequence ids, i32[T] bottom-right-aligned query positions, bool[T] validity.
    """
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    batch = cache_seqlens.shape[0]
    seq = jnp.searchsorted(cu_seqlens_q, t, side="right").astype(jnp.int32) - 1
    valid = (seq >= 0) & (seq < batch) & (t < cu_seqlens_q[batch])
    seq = jnp.clip(seq, 0, max(batch - 1, 0))
    q_len = cu_seqlens_q[seq + 1] - cu_seqlens_q[seq]
    qpos = cache_seqlens[seq] - q_len + (t - cu_seqlens_q[seq])
    return seq, qpos, valid


def visible_mask(qpos, k_len, key_pos, *, causal: bool, window_size):
    """bool[..., K]: which keys each query sees (bottom-right causal, inclusive window)."""
    left, right = window_size
    qp = qpos[..., None]
    m = key_pos < k_len[..., None]
    if causal:
        m &= key_pos <= qp
    if left >= 0:
        m &= key_pos >= qp - left
    if right >= 0:
        m &= key_pos <= qp + right
    return m


def paged_attention_reference(
    q,  # [T, Hq, D]
    k_cache,  # [num_pages, page_size, Hkv, D]
    v_cache,  # [num_pages, page_size, Hkv, Dv]
    cache_seqlens,  # i32[B]
    cu_seqlens_q,  # i32[B + 1]
    page_table,  # i32[B, P]
    *,
    page_size: int,
    causal: bool = True,
    window_size=(-1, -1),
    softcap: float = 0.0,
    sinks: Optional[jax.Array] = None,  # f32[Hq]
    k_descale=None,  # None, scalar or f32[B, Hkv]
    v_descale=None,
    softmax_scale: Optional[float] = None,
    return_lse: bool = False,
):
    """Ragged-query attention over a paged KV cache, in float32.

    Args:
      q: queries ``[T, Hq, D]``; token ``t`` belongs to the sequence ``b`` with
        ``cu_seqlens_q[b] <= t < cu_seqlens_q[b + 1]``.
      k_cache, v_cache: paged pools ``[num_pages, page_size, Hkv, D|Dv]``.
      cache_seqlens: keys per sequence, including the new tokens.
      cu_seqlens_q: query offsets.
      page_table: page ids per sequence (slot ids when ``page_size == 1``).
      page_size: tokens per page (static).
      causal, window_size, softcap, sinks, k_descale, v_descale, softmax_scale: FA3 semantics
        (``docs/semantics.md``).
      return_lse: also return the natural-log softmax denominator ``f32[T, Hq]``.

    Returns:
      ``out [T, Hq, Dv]`` in ``q.dtype`` (zeros for padding tokens and queries that see no key),
      and ``lse f32[T, Hq]`` (``-inf`` there) when ``return_lse``.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    _, ps, num_kv_heads, _ = k_cache.shape
    if ps != page_size:
        raise ValueError(f"{k_cache.shape=} has page size {ps} but page_size={page_size}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} must be a multiple of {num_kv_heads=}")
    group = num_q_heads // num_kv_heads
    batch, width = page_table.shape
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale

    seq, qpos, valid = token_positions(cache_seqlens, cu_seqlens_q, num_tokens)
    key_pos = jnp.arange(width * page_size, dtype=jnp.int32)
    pages = page_table[:, key_pos // page_size]  # [B, K]
    offs = key_pos % page_size
    k_seq = k_cache[pages, offs].astype(jnp.float32)  # [B, K, Hkv, D]
    v_seq = v_cache[pages, offs].astype(jnp.float32)  # [B, K, Hkv, Dv]
    k_seq = k_seq * _descale(k_descale, batch, num_kv_heads)[:, None, :, None]
    v_seq = v_seq * _descale(v_descale, batch, num_kv_heads)[:, None, :, None]

    mask = visible_mask(qpos, cache_seqlens[seq], key_pos, causal=causal, window_size=window_size)
    mask &= valid[:, None]  # [T, K]
    # Masked keys may hold NaN (poisoned pages): zero them before any product.
    kv_ok = key_pos[None, :] < cache_seqlens[:, None]  # [B, K]
    k_seq = jnp.where(kv_ok[:, :, None, None], k_seq, 0.0)
    v_seq = jnp.where(kv_ok[:, :, None, None], v_seq, 0.0)

    qf = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    s = jnp.einsum("tkgd,tjkd->tkgj", qf, k_seq[seq], precision="highest") * scale
    if softcap > 0:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(mask[:, None, None, :], s, -jnp.inf)
    m = jnp.max(s, axis=-1)  # [T, Hkv, G]
    if sinks is not None:
        sink = jnp.asarray(sinks, jnp.float32).reshape(num_kv_heads, group)[None]
        m = jnp.maximum(m, sink)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m_safe[..., None])
    denom = jnp.sum(p, axis=-1)
    if sinks is not None:
        denom = denom + jnp.exp(sink - m_safe)
    o = jnp.einsum("tkgj,tjkd->tkgd", p, v_seq[seq], precision="highest")
    # No visible key: out 0; LSE -inf, or the sink's own logit when sinks are given. NaN in q or
    # in a visible key stays NaN (``!= 0`` is true for NaN), as in FA3 and SDPA.
    pos = (denom != 0) & valid[:, None, None]
    safe = jnp.where(pos, denom, 1.0)
    o = jnp.where(pos[..., None], o / safe[..., None], 0.0)
    lse = jnp.where(pos, m_safe + jnp.log(safe), -jnp.inf)
    out = o.reshape(num_tokens, num_q_heads, -1).astype(q.dtype)
    if return_lse:
        return out, lse.reshape(num_tokens, num_q_heads)
    return out


def reference_from_metadata(q, k_cache, v_cache, md: AttentionMetadata, **kw):
    """``paged_attention_reference`` reading lengths and the page table from ``md``."""
    return paged_attention_reference(
        q, k_cache, v_cache, md.cache_seqlens, md.cu_seqlens_q, md.page_table,
        page_size=md.page_size, **kw,
    )


def merge_state_reference(o_a, lse_a, o_b, lse_b):
    """Merge two partial attention results over disjoint key sets (``-inf`` LSE = empty).

    ``o_* [T, H, D]``, ``lse_* f32[T, H]`` natural log. Returns ``(o [T, H, D], lse f32[T, H])``.
    """
    m = jnp.maximum(lse_a, lse_b)
    m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
    wa = jnp.exp(lse_a - m_safe)
    wb = jnp.exp(lse_b - m_safe)
    tot = wa + wb
    safe = jnp.where(tot != 0, tot, 1.0)  # NaN partials stay NaN; empty ones (weight 0) are skipped
    part_a = jnp.where((wa != 0)[..., None], o_a.astype(jnp.float32) * (wa / safe)[..., None], 0.0)
    part_b = jnp.where((wb != 0)[..., None], o_b.astype(jnp.float32) * (wb / safe)[..., None], 0.0)
    o = part_a + part_b
    lse = jnp.where(tot != 0, m_safe + jnp.log(safe), -jnp.inf)
    return o.astype(o_a.dtype), lse
