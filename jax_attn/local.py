"""Chunked local attention (Llama-4 iRoPE layers): the virtual-batch planner.

A query at position ``p`` of a local layer sees only the keys of its own chunk, positions
``[p // C * C, p]`` for chunk size ``C``. Every (sequence, chunk) that holds at least one of the
step's queries becomes a *virtual sequence* of an ordinary plan: its queries, the keys of that
chunk up to the last query (``cache_seqlens``), and a page-table row holding that chunk's pages
only. The existing kernels run the virtual plan unchanged, with the usual bottom-right causal
mask, and cannot read a page outside the chunk.

Virtual sequences keep the original queries in their original order (a sequence's chunks follow
one another, sequences follow one another), so the token axis, ``out_cache_loc`` and the layer's
outputs need no permutation.

Dimension legend (see ``jax_attn.metadata``): B padded batch, T padded tokens, P page-table width,
V = ``max_virtual_rows(...)`` static bound on virtual sequences, L = ``local_pages(...)`` pages per
virtual row, C chunk size in tokens.

Where this differs from the seed (SGLang 0.5.11 ``make_local_attention_virtual_batches`` and its
callers), on purpose:

* The seed shrinks the chunk to ``max(seq_lens)`` rounded down to a page multiple (a host sync).
  With page size > 1 and a longest sequence that is not page aligned and shorter than ``C``, that
  splits a sequence the model treats as one chunk. Here the chunk is always ``C``; ``C`` must be a
  multiple of the page size (``check_chunk_size``), as the seed asserts after its rounding.
* The seed's eager path hands the token-level table (``req_to_token`` slots) to the function
  before converting it to page ids, so with page size > 1 it reads slots as page ids. Here the
  virtual table is cut from the plan's page table (page ids).
* The seed builds local metadata for EXTEND, DECODE (incl. draft decode) and TARGET_VERIFY (topk
  <= 1) only, and in CUDA graphs for normal decode only; local layers elsewhere silently attend to
  everything. Here MIXED is supported as well (``LOCAL_MODES``), every supported mode works in
  capture/replay, and a local layer in any other mode raises ``NotImplementedError``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from jax_attn.kernels.config import cdiv
from jax_attn.metadata import AttentionMetadata, ForwardMode
from jax_attn.planner import exclusive_cumsum

__all__ = ["LOCAL_MODES", "check_chunk_size", "local_pages", "max_virtual_rows", "plan_local", "local_plan_of"]

# Modes whose plans carry a local virtual batch (SGLang's plus MIXED). Tree (topk > 1) steps,
# draft extend and split prefill have none: a local layer there raises.
LOCAL_MODES = (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)
_UNIFORM = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)  # plan_uniform: q_len_per_req = max_q_len
_OVERFLOW_BIT = 16  # jax_attn.safety.ERRORS: "query counts do not fit"


def check_chunk_size(chunk_size: int, page_size: int) -> None:
    """Raise ``ValueError`` unless ``chunk_size`` is a positive multiple of ``page_size``.

    A chunk starting inside a page would need a key offset within the first page of every virtual
    row, which the kernels (and FA3) do not take; the seed asserts the same.
    """
    if chunk_size < 1 or chunk_size % page_size:
        raise ValueError(f"attention_chunk_size={chunk_size} must be a positive multiple of {page_size=} "
                         "(a chunk must start on a page boundary); pick a page size that divides it")


def local_pages(*, chunk_size: int, page_size: int, max_pages: int) -> int:
    """L: pages per virtual row, ``min(C / page_size, P)`` (a chunk, or the whole table if shorter)."""
    return max(1, min(chunk_size // page_size, max_pages))


def max_virtual_rows(*, chunk_size: int, batch_size: int, num_tokens: int, max_kv_len: int,
                     q_len_per_req: Optional[int] = None) -> int:
    """V: a static upper bound on the virtual sequences of one step.

    Every sequence gives at least one row (a sequence without queries gives one empty row). Queries
    at positions ``s .. s + q - 1`` touch at most ``1 + ceil((q - 1) / C)`` chunks, and no sequence
    touches more than ``ceil(max_kv_len / C)`` chunks. Uniform plans (``q_len_per_req`` queries in
    every row: decode, verify) have ``V = B * min(1 + ceil((q - 1) / C), ceil(max_kv_len / C))``.
    Ragged plans of ``T`` tokens: only the ``n2 <= min(B, T // 2)`` rows with q >= 2 add rows, at
    most ``1 + (q - 2) // C`` each, so ``V = min(B * ceil(max_kv_len / C), B + max over n2 in
    {0, min(B, T // 2)} of (n2 + (T - 2 * n2) // C))`` (that expression is monotone in n2 for a
    fixed C, so one end is the maximum).
    """
    c, b, t = chunk_size, batch_size, num_tokens
    per_seq_cap = max(1, cdiv(max_kv_len, c))
    if q_len_per_req is not None:
        return b * min(1 + cdiv(max(q_len_per_req - 1, 0), c), per_seq_cap)
    n2 = min(b, t // 2)
    extra = max(n2 + (t - 2 * n2) // c, t // c)
    return max(1, min(b * per_seq_cap, b + extra))


def _virtual_rows(q_lens, kv_lens, *, chunk_size: int, num_rows: int):
    """Per virtual row v < V: owning sequence, chunk start, queries, keys, validity, and the number of
    virtual sequences (rows past it: start 0, no query, one key)."""
    c = chunk_size
    first = jnp.maximum(kv_lens - jnp.maximum(q_lens, 1), 0) // c  # chunk of the first query (or last key)
    last = jnp.maximum(kv_lens - 1, 0) // c
    n = jnp.maximum(last - first + 1, 1)  # virtual rows per sequence (>= 1)
    cum = exclusive_cumsum(n)  # [B + 1]
    v = jnp.arange(num_rows, dtype=jnp.int32)
    seq = jnp.clip(jnp.searchsorted(cum, v, side="right").astype(jnp.int32) - 1, 0, q_lens.shape[0] - 1)
    valid = v < cum[-1]
    start = (first[seq] + v - cum[seq]) * c  # first key position of the row's chunk
    k, q_begin = kv_lens[seq], kv_lens[seq] - q_lens[seq]
    k_local = jnp.minimum(k, start + c) - start
    q_local = jnp.maximum(k_local + start - jnp.maximum(q_begin, start), 0)
    zero = jnp.zeros_like(v)
    return seq, jnp.where(valid, start, zero), jnp.where(valid, q_local, zero), jnp.where(valid, k_local, 1), \
        valid, cum[-1]


@functools.partial(jax.jit, static_argnames=("chunk_size", "q_len_per_req", "num_rows"))
def plan_local(md: AttentionMetadata, *, chunk_size: int, q_len_per_req: Optional[int] = None,
               num_rows: Optional[int] = None) -> AttentionMetadata:
    """The local-attention virtual batch of an ordinary plan (jit-compiled; no host sync).

    Args:
      md: the step's plan (``jax_attn.planner``), whose ``cu_seqlens_q``, ``cache_seqlens`` and
        ``page_table`` describe the real batch; padded rows follow the padding rule.
      chunk_size: C, the attention chunk in tokens (static); a multiple of ``md.page_size``.
      q_len_per_req: queries in every row for uniform plans (static); default: ``md.max_q_len`` for
        DECODE and TARGET_VERIFY plans, ragged otherwise. Only the static bound depends on it.
      num_rows: V, the number of virtual rows (static); default ``max_virtual_rows(...)``.

    Returns:
      ``AttentionMetadata`` with B = V rows and ``max_pages`` = L (``local_pages``), the same token
      axis and ``out_cache_loc`` as ``md``. Row ``v`` covers one chunk of one sequence: its queries
      (``cu_seqlens_q``), the chunk's keys up to its last query (``cache_seqlens`` <= C) and the
      chunk's page ids (columns past its last used page 0). Rows past the last virtual sequence
      are padding: no queries, seq_len 1, page 0. ``errors`` is ``md.errors`` plus bit 16 if the
      plan had more virtual sequences than ``num_rows`` (a non-uniform plan called uniform).
    """
    check_chunk_size(chunk_size, md.page_size)
    if q_len_per_req is None and md.mode in _UNIFORM:
        q_len_per_req = md.max_q_len
    if num_rows is None:
        num_rows = max_virtual_rows(chunk_size=chunk_size, batch_size=md.batch_size, num_tokens=md.num_tokens,
                                    max_kv_len=md.max_kv_len, q_len_per_req=q_len_per_req)
    q_lens = md.cu_seqlens_q[1:] - md.cu_seqlens_q[:-1]
    seq, start, q_local, k_local, valid, total = _virtual_rows(
        q_lens, md.cache_seqlens, chunk_size=chunk_size, num_rows=num_rows)
    width = local_pages(chunk_size=chunk_size, page_size=md.page_size, max_pages=md.max_pages)
    j = jnp.arange(width, dtype=jnp.int32)
    cols = jnp.clip(start[:, None] // md.page_size + j[None, :], 0, md.max_pages - 1)
    pages = md.page_table[seq[:, None], cols]  # [V, L]: only the chunk's columns are gathered
    used = valid[:, None] & (j[None, :] * md.page_size < k_local[:, None])
    prior = jnp.int32(0) if md.errors is None else md.errors
    return AttentionMetadata(
        cache_seqlens=k_local,
        cu_seqlens_q=exclusive_cumsum(q_local),
        cu_seqlens_k=exclusive_cumsum(k_local),
        page_table=jnp.where(used, pages, 0),
        out_cache_loc=md.out_cache_loc,
        max_seqlen_q=jnp.max(q_local, initial=0).astype(jnp.int32),
        max_seqlen_k=jnp.max(jnp.where(valid, k_local, 0), initial=0).astype(jnp.int32),
        errors=prior | jnp.where(total > num_rows, jnp.int32(_OVERFLOW_BIT), jnp.int32(0)),
        mode=md.mode,
        batch_size=num_rows,
        num_tokens=md.num_tokens,
        page_size=md.page_size,
        max_q_len=max(1, min(md.max_q_len, chunk_size)),
        max_pages=width,
    )


def local_plan_of(md) -> AttentionMetadata:
    """The virtual plan a local (``use_irope``) layer runs; raises when the step has none."""
    local = getattr(md, "local", None)
    if local is not None:
        return local
    if not isinstance(md, AttentionMetadata) or md.mode not in LOCAL_MODES:
        mode = md.mode.name + ("" if isinstance(md, AttentionMetadata) else " with topk > 1 (tree speculative step)")
        raise NotImplementedError(
            f"chunked local attention (use_irope layer) in {mode} is not supported: local metadata exists for "
            f"{', '.join(m.name for m in LOCAL_MODES)} only (target verify and draft decode with topk <= 1)")
    raise ValueError("a use_irope layer needs a plan with local metadata: construct FlashAttentionBackend(..., "
                     "attention_chunk_size=C) (the model's attention_chunk_size)")


def with_local(md, *, chunk_size: int):
    """``md`` with ``md.local`` planned when its mode has local metadata (traceable), else ``md``."""
    if not chunk_size or not isinstance(md, AttentionMetadata) or md.mode not in LOCAL_MODES:
        return md
    local = plan_local(md, chunk_size=chunk_size)
    return dataclasses.replace(md, local=local, errors=local.errors)
