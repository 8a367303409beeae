"""Tree (topk > 1) speculative decoding: cascade = uniform prefix pass + expand pass + merge.

Target verify (topk > 1): every draft token of a request attends to the request's committed KV
(prefix pass, non-causal, ``num_draft`` queries per request) and to the draft tokens its tree mask
allows (expand pass: one row per draft token over a page table of draft slots, valid columns
first — the sort trick — with ``cache_seqlens`` = number of allowed draft tokens). The two partial
results are merged with ``merge_state``.

Draft decode (topk > 1): ``topk`` queries per request over the committed KV, plus one row per
branch over that branch's own draft slots of steps ``0..step_id``.

Sliding-window layers cannot use the cascade (window positions span both parts); for them the
planner builds one page-size-1 table per draft row: the committed slots followed by its expand
slots (SGLang's SWA spec page table, lifted to any pool page size), in tree verify and tree draft
decode alike. With SGLang's hybrid ``SWAKVPool`` that table is translated slot by slot through
``full_to_swa_index_mapping`` (``with_swa_pool_step``): both its committed part and its draft-token
part then address the SWA pool that sliding-window layers read.

Dimension legend: B requests (padded), N draft tokens per request, S draft steps, K topk.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from jax_attn.metadata import AttentionMetadata, ForwardMode, _pytree_dataclass, static_field
from jax_attn.planner import exclusive_cumsum, plan_uniform, with_swa_pool


@_pytree_dataclass
class CascadeMetadata:
    """Prefix + expand plans of one tree speculative step (and the SWA table when asked)."""

    prefix: AttentionMetadata  # committed KV, queries grouped per request, run non-causal
    expand: AttentionMetadata  # page_size 1: one row per draft query over its draft slots
    swa: Optional[AttentionMetadata] = None  # page_size 1: committed slots then expand slots, per row
    mode: ForwardMode = static_field(default=ForwardMode.TARGET_VERIFY)

    @property
    def out_cache_loc(self) -> jax.Array:
        return self.expand.out_cache_loc


def _rows_md(counts, table, out_cache_loc, mode) -> AttentionMetadata:
    """One query per row over ``table`` slots (page_size 1); ``counts`` valid columns per row."""
    n = counts.shape[0]
    return AttentionMetadata(
        cache_seqlens=counts.astype(jnp.int32), cu_seqlens_q=jnp.arange(n + 1, dtype=jnp.int32),
        cu_seqlens_k=exclusive_cumsum(counts), page_table=table.astype(jnp.int32), out_cache_loc=out_cache_loc,
        max_seqlen_q=jnp.int32(1), max_seqlen_k=jnp.max(counts, initial=0).astype(jnp.int32),
        mode=mode, batch_size=n, num_tokens=n, page_size=1, max_q_len=1, max_pages=table.shape[1],
    )


def _swa_md(req_to_token, rows, seq_lens, expand: AttentionMetadata, group: int, width: int, mode):
    """Per row: committed slots ``[:seq_len]`` of its request, then its expand slots."""
    r = jnp.repeat(rows, group)  # [B*G]
    base = jnp.repeat(seq_lens, group)
    col = jnp.arange(width + expand.max_pages, dtype=jnp.int32)[None]
    pre = req_to_token[r[:, None], jnp.clip(col, 0, req_to_token.shape[1] - 1)]
    exp_col = jnp.clip(col - base[:, None], 0, expand.max_pages - 1)
    post = jnp.take_along_axis(expand.page_table, exp_col, axis=1)
    table = jnp.where(col < base[:, None], pre, post)
    return _rows_md(base + expand.cache_seqlens, table, expand.out_cache_loc, mode)


@functools.partial(jax.jit, static_argnames=("num_draft", "page_size", "max_pages", "with_swa"))
def plan_verify_tree(
    req_to_token,  # i32[R, W]
    req_pool_indices,  # i32[B]
    seq_lens,  # i32[B]; committed lengths (without the draft tokens)
    out_cache_loc,  # i32[B * N]; slots of the draft tokens
    draft_mask,  # bool[B, N, N]; [b, i, j]: draft token i sees draft token j (incl. itself)
    *,
    num_draft: int,
    page_size: int = 1,
    max_pages: int,
    with_swa: bool = False,
) -> CascadeMetadata:
    """Plan target verify with topk > 1 (cascade). Padded rows may carry an all-False mask."""
    bsz = seq_lens.shape[0]
    if draft_mask.shape != (bsz, num_draft, num_draft):
        raise ValueError(f"{draft_mask.shape=} must be (batch, num_draft, num_draft)=({bsz}, {num_draft}, {num_draft})")
    mode = ForwardMode.TARGET_VERIFY
    prefix = plan_uniform(req_to_token, req_pool_indices, seq_lens, out_cache_loc, q_len_per_req=num_draft,
                          kv_offset=0, page_size=page_size, max_pages=max_pages, mode=mode)
    rows = jnp.clip(req_pool_indices, 0, req_to_token.shape[0] - 1)
    j = jnp.arange(num_draft, dtype=jnp.int32)
    cols = jnp.clip(seq_lens[:, None] + j[None], 0, req_to_token.shape[1] - 1)
    slots = req_to_token[rows[:, None], cols]  # [B, N]
    mask = draft_mask.reshape(bsz * num_draft, num_draft)
    keys = jnp.where(mask, j[None], j[None] + num_draft)  # allowed columns sort first, in order
    order = jnp.argsort(keys, axis=1, stable=True)
    table = jnp.take_along_axis(jnp.repeat(slots, num_draft, axis=0), order, axis=1)
    expand = _rows_md(jnp.sum(mask, axis=1, dtype=jnp.int32), table, out_cache_loc, mode)
    swa = _swa_md(req_to_token, rows, seq_lens, expand, num_draft, max_pages * page_size, mode) if with_swa else None
    return CascadeMetadata(prefix=prefix, expand=expand, swa=swa, mode=mode)


@functools.partial(jax.jit, static_argnames=("num_draft",))
def draft_mask_from_custom_mask(custom_mask, seq_lens, *, num_draft: int):
    """SGLang's flat verify ``custom_mask`` -> ``bool[B, N, N]`` (the draft-token columns).

    ``custom_mask`` is ``bool[L]`` (L a static bound, padded): for each request, ``N`` rows of
    ``seq_len + N`` columns, requests one after another. Indices past the real mask (padded rows)
    read nothing and come back False.
    """
    bsz = seq_lens.shape[0]
    row_len = seq_lens + num_draft  # [B]
    starts = exclusive_cumsum(row_len * num_draft)[:-1]  # first element of each request's block
    i = jnp.arange(num_draft, dtype=jnp.int32)
    idx = starts[:, None, None] + i[None, :, None] * row_len[:, None, None] + seq_lens[:, None, None] + i[None, None, :]
    ok = (idx >= 0) & (idx < custom_mask.shape[0])
    vals = custom_mask[jnp.clip(idx, 0, custom_mask.shape[0] - 1)]
    return (ok & vals.astype(bool)).reshape(bsz, num_draft, num_draft)


@functools.partial(jax.jit, static_argnames=("topk", "step_id", "num_steps", "page_size", "max_pages", "with_swa"))
def plan_draft_decode_tree(
    req_to_token,  # i32[R, W]
    req_pool_indices,  # i32[B]
    seq_lens,  # i32[B]; committed lengths
    draft_cache_loc,  # i32[B * K * S]; laid out [B, K, S]: each branch's slots over the draft steps
    *,
    topk: int,
    step_id: int,
    num_steps: int,
    page_size: int = 1,
    max_pages: int,
    with_swa: bool = False,
) -> CascadeMetadata:
    """Plan draft decode step ``step_id`` with topk > 1: prefix over committed KV + own branch
    (``with_swa``: plus the per-branch SWA table of sliding-window layers)."""
    if not 0 <= step_id < num_steps:
        raise ValueError(f"{step_id=} must be in [0, {num_steps=})")
    loc = draft_cache_loc.reshape(-1, num_steps)  # [B*K, S]
    cur = loc[:, step_id]
    mode = ForwardMode.DECODE
    prefix = plan_uniform(req_to_token, req_pool_indices, seq_lens, cur, q_len_per_req=topk, kv_offset=0,
                          page_size=page_size, max_pages=max_pages, mode=mode)
    counts = jnp.full((loc.shape[0],), step_id + 1, jnp.int32)
    expand = _rows_md(counts, loc[:, : step_id + 1], cur, mode)
    md = CascadeMetadata(prefix=prefix, expand=expand, swa=None, mode=mode)
    return with_swa_table(md, req_to_token, req_pool_indices, seq_lens, width=max_pages * page_size) if with_swa else md


def with_swa_table(md: CascadeMetadata, req_to_token, req_pool_indices, seq_lens, *, width: int) -> CascadeMetadata:
    """``md`` with its SWA table: per expand row, the committed slots ``[:seq_len]`` of its request then
    its expand slots (``width``: the committed part's static bound, ``max_pages * page_size``)."""
    rows = jnp.clip(req_pool_indices, 0, req_to_token.shape[0] - 1)
    group = md.expand.batch_size // seq_lens.shape[0]  # draft rows per request: N (verify) or topk (draft)
    return dataclasses.replace(md, swa=_swa_md(req_to_token, rows, seq_lens, md.expand, group, width, md.mode))


def swa_plan_of(md):
    """The plan a sliding-window layer reads: a tree step's SWA table, else ``md`` itself."""
    return md.swa if isinstance(md, CascadeMetadata) else md


def with_swa_pool_step(md, mapping, *, num_swa_slots: int):
    """SGLang's hybrid ``SWAKVPool``: any step's plan with the SWA pool table (traceable). A tree plan's
    ``md.swa`` gets ``swa_page_table``: its committed and draft-token slots translated into the SWA pool
    (``jax_attn.planner.with_swa_pool`` at page size 1: error bit 64 for entries outside it); full layers'
    prefix and expand passes keep reading the full pool. Other plans: ``planner.with_swa_pool``."""
    if not isinstance(md, CascadeMetadata):
        return md if md.mode == ForwardMode.IDLE else with_swa_pool(md, mapping, num_swa_slots=num_swa_slots)
    if md.swa is None:
        raise ValueError("a tree plan for SGLang's SWAKVPool needs its SWA table (plan it with with_swa=True)")
    return dataclasses.replace(md, swa=with_swa_pool(md.swa, mapping, num_swa_slots=num_swa_slots))


def cascade_attention(q, k_pages, v_pages, k_slots, v_slots, md: CascadeMetadata, *, attend, merge,
                      window_size=(-1, -1), sinks=None, return_lse=False, **kw):
    """Run a tree step: prefix (non-causal) + expand, merged; SWA layers use the single SWA table
    (its SWA-pool translation when the plan has one: SGLang's hybrid ``SWAKVPool``).

    ``k_pages`` is the pool's paged view (prefix pass), ``k_slots`` its page-size-1 view (expand
    and SWA passes); ``attend`` is ``jax_attn.attention.attention`` bound to an implementation and
    ``merge`` the matching ``merge_state``. Sinks count once (in the prefix pass).
    """
    if window_size != (-1, -1):
        swa = md.swa
        if swa is None:
            raise ValueError("a sliding-window layer in a tree step needs a plan built with with_swa=True")
        if swa.swa_page_table is not None:  # SWAKVPool: k_slots / v_slots are the layer's SWA pool
            swa = dataclasses.replace(swa, page_table=swa.swa_page_table, swa_page_table=None)
        return attend(q, k_slots, v_slots, swa, causal=True, window_size=window_size, sinks=sinks,
                      return_lse=return_lse, **kw)
    o_p, lse_p = attend(q, k_pages, v_pages, md.prefix, causal=False, sinks=sinks, return_lse=True, **kw)
    o_e, lse_e = attend(q, k_slots, v_slots, md.expand, causal=True, return_lse=True, **kw)
    o, lse = merge(o_p, lse_p, o_e, lse_e)
    return (o, lse) if return_lse else o
