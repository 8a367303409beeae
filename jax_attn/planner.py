"""Metadata planners: one pure, jit-compiled function per mode family.

A planner turns one step's batch description (request rows, sequence lengths, the
request-to-token table) into an ``AttentionMetadata`` that every layer reuses. The same
function serves eager calls, ahead-of-time capture and replay: only the destination of
its result differs.

Dimension legend (see ``jax_attn.metadata``):
  B   padded batch size            T   padded token count
  R   request rows in req_to_token W   req_to_token width (max context length)
  P   page-table width in pages    E   encoder page-table width in slots

Every planner is ``jax.jit``-compiled with its keyword options static. Inputs and outputs
are int32. Nothing reads device values back to the host: the seed's
``seq_lens_cpu.max().item()`` becomes a device scalar (``max_seqlen_k``) and the page-table
width becomes the static bound ``max_pages``.

Padding rule (the caller pads the batch to its bucket): a padded row has seq_len 1 (the
CUDA-graph fill value), request row 0 and output slot 0; in extend modes its extend length
is 0. Page-table columns past a row's last used page are 0 (the reserved page), so the
metadata never depends on stale ``req_to_token`` entries.

Cross attention: as in SGLang, ``seq_lens`` counts decoder tokens only and a request's row
of ``req_to_token`` holds its encoder slots first, then its decoder slots. The encoder table
holds slots (whatever the page size); with page size > 1 each encoder length must be a
multiple of the page size so that the decoder's pages stay aligned (``validate_metadata``
checks it).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp

from jax_attn.metadata import AttentionMetadata, EncoderMetadata, ForwardMode
from jax_attn.planner_validate import validate_metadata

__all__ = ["plan_uniform", "plan_extend", "plan_draft_extend", "plan_idle", "validate_metadata", "with_swa_pool"]

_UNIFORM_MODES = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2)
_EXTEND_MODES = (
    ForwardMode.EXTEND,
    ForwardMode.MIXED,
    ForwardMode.SPLIT_PREFILL,
    ForwardMode.DRAFT_EXTEND,
    ForwardMode.DRAFT_EXTEND_V2,
)


# ----------------------------------------------------------------------------- trace-time checks
def _check_array(name: str, x, ndim: int, dim0: Optional[int] = None) -> None:
    """Shape/dtype check at trace time; raises ValueError with the fix."""
    if x.ndim != ndim:
        raise ValueError(f"{name}: {x.shape=} must have {ndim} dimension(s); reshape it.")
    if x.dtype != jnp.int32:
        raise ValueError(f"{name}: {x.dtype=} must be int32; pass it as x.astype(jnp.int32).")
    if dim0 is not None and x.shape[0] != dim0:
        raise ValueError(
            f"{name}: {x.shape=} must have leading dimension {dim0} (the padded batch / token "
            "bucket); pad it with the fill values of the padding rule."
        )


def _check_static(page_size: int, max_pages: int, mode: ForwardMode, allowed, fn: str) -> None:
    if page_size < 1:
        raise ValueError(f"{fn}: {page_size=} must be >= 1.")
    if max_pages < 1:
        raise ValueError(f"{fn}: {max_pages=} must be >= 1; pass ceil(max_context_len / page_size).")
    if ForwardMode(mode) not in allowed:
        names = ", ".join(m.name for m in allowed)
        raise ValueError(f"{fn}: {mode=} is not served here; use one of {names}.")


def _check_common(req_to_token, req_pool_indices, seq_lens, encoder_lens, max_encoder_len):
    _check_array("req_to_token", req_to_token, 2)
    _check_array("req_pool_indices", req_pool_indices, 1)
    batch = req_pool_indices.shape[0]
    _check_array("seq_lens", seq_lens, 1, batch)
    if encoder_lens is None:
        if max_encoder_len:
            raise ValueError(f"{max_encoder_len=} given without encoder_lens; pass encoder_lens (i32[B]).")
        return
    _check_array("encoder_lens", encoder_lens, 1, batch)
    if not 1 <= max_encoder_len <= req_to_token.shape[1]:
        raise ValueError(
            f"{max_encoder_len=} must lie in [1, {req_to_token.shape[1]}] (req_to_token width) when "
            "encoder_lens is given; pass the static upper bound on encoder lengths."
        )


# ----------------------------------------------------------------------------- shared pieces
def exclusive_cumsum(lens: jax.Array) -> jax.Array:  # lens: [B] -> [B + 1]
    zero = jnp.zeros((1,), jnp.int32)
    return jnp.concatenate([zero, jnp.cumsum(lens, dtype=jnp.int32)])


def _safe_max(x: jax.Array) -> jax.Array:
    return jnp.max(x, initial=0).astype(jnp.int32)


def _page_table(
    req_to_token: jax.Array,  # [R, W]
    rows: jax.Array,  # [B]; already clamped to [0, R)
    cache_seqlens: jax.Array,  # [B]
    shift: jax.Array,  # [B]; position of each row's first self-attention token
    *,
    page_size: int,
    max_pages: int,
) -> jax.Array:  # [B, P]
    """Page (or slot) ids of each row's KV positions; unused columns are 0."""
    width = req_to_token.shape[1]
    first_pos = jnp.arange(max_pages, dtype=jnp.int32) * page_size  # [P]
    pos = jnp.clip(first_pos[None, :] + shift[:, None], 0, width - 1)  # [B, P]
    slots = req_to_token[rows[:, None], pos]
    pages = slots // page_size if page_size > 1 else slots
    used = first_pos[None, :] < cache_seqlens[:, None]
    return jnp.where(used, pages, 0)


def _encoder_metadata(
    req_to_token: jax.Array,  # [R, W]
    rows: jax.Array,  # [B]
    encoder_lens: jax.Array,  # [B]
    max_encoder_len: int,
) -> EncoderMetadata:
    pos = jnp.arange(max_encoder_len, dtype=jnp.int32)  # [E]
    slots = req_to_token[rows[:, None], pos[None, :]]  # [B, E]
    table = jnp.where(pos[None, :] < encoder_lens[:, None], slots, 0)
    return EncoderMetadata(
        encoder_lens=encoder_lens,
        encoder_cu_seqlens_k=exclusive_cumsum(encoder_lens),
        encoder_page_table=table,
        max_encoder_len=max_encoder_len,
    )


def _assemble(
    req_to_token, req_pool_indices, cache_seqlens, cu_seqlens_q, out_cache_loc, max_seqlen_q,
    encoder_lens, *, page_size, max_pages, max_q_len, max_encoder_len, mode,
) -> AttentionMetadata:
    """Page tables, cumulative lengths and bounds shared by every planner."""
    rows = jnp.clip(req_pool_indices, 0, req_to_token.shape[0] - 1)
    encoder = None
    shift = jnp.zeros_like(cache_seqlens)
    if encoder_lens is not None:
        encoder = _encoder_metadata(req_to_token, rows, encoder_lens, max_encoder_len)
        shift = encoder_lens  # decoder tokens follow the encoder tokens in each row
    page_table = _page_table(
        req_to_token, rows, cache_seqlens, shift, page_size=page_size, max_pages=max_pages
    )
    return AttentionMetadata(
        cache_seqlens=cache_seqlens,
        cu_seqlens_q=cu_seqlens_q,
        cu_seqlens_k=exclusive_cumsum(cache_seqlens),
        page_table=page_table,
        out_cache_loc=out_cache_loc,
        max_seqlen_q=max_seqlen_q,
        max_seqlen_k=_safe_max(cache_seqlens),
        encoder=encoder,
        mode=ForwardMode(mode),
        batch_size=cache_seqlens.shape[0],
        num_tokens=out_cache_loc.shape[0],
        page_size=page_size,
        max_q_len=max_q_len,
        max_pages=max_pages,
    )


# ----------------------------------------------------------------------------- planners
@functools.partial(
    jax.jit,
    static_argnames=("q_len_per_req", "kv_offset", "page_size", "max_pages", "mode", "max_encoder_len"),
)
def plan_uniform(
    req_to_token: jax.Array,  # [R, W]
    req_pool_indices: jax.Array,  # [B]
    seq_lens: jax.Array,  # [B]
    out_cache_loc: jax.Array,  # [B * q_len_per_req]
    *,
    q_len_per_req: int = 1,
    kv_offset: int = 0,
    page_size: int = 1,
    max_pages: int,
    mode: ForwardMode = ForwardMode.DECODE,
    encoder_lens: Optional[jax.Array] = None,  # [B]
    max_encoder_len: int = 0,
) -> AttentionMetadata:
    """Plans a batch where every sequence has the same number of new queries.

    Serves normal decode (``q_len_per_req=1, kv_offset=0``), draft decode with topk <= 1
    (``q_len_per_req=1, kv_offset=step_id + 1``) and target verify with topk <= 1
    (``q_len_per_req=kv_offset=num_draft_tokens``, ``mode=TARGET_VERIFY``, ``seq_lens`` the
    committed lengths, as SGLang passes them).

    Args:
      req_to_token: request-to-token table; ``[r, j]`` is the slot of position j of row r.
      req_pool_indices: request row of each batch entry (padded rows: 0).
      seq_lens: KV length of each sequence before ``kv_offset`` (padded rows: 1).
      out_cache_loc: slot written by each new token, ``q_len_per_req`` per sequence.
      q_len_per_req: queries per sequence (static).
      kv_offset: added to ``seq_lens`` to give ``cache_seqlens`` (static).
      page_size: tokens per KV page (static); page size 1 stores slots in the page table.
      max_pages: page-table width, >= ceil(max_context_len / page_size) (static).
      mode: forward mode recorded in the metadata (static).
      encoder_lens: encoder tokens per request for cross attention, or None. Unlike SGLang,
        which supports one encoder length per batch, each row may have its own: the
        self-attention page table of row i starts at position ``encoder_lens[i]``.
      max_encoder_len: static upper bound on ``encoder_lens`` (width of the encoder table).

    Returns:
      The step's ``AttentionMetadata`` (B = len(seq_lens), T = B * q_len_per_req).
    """
    fn = "plan_uniform"
    _check_static(page_size, max_pages, mode, _UNIFORM_MODES, fn)
    _check_common(req_to_token, req_pool_indices, seq_lens, encoder_lens, max_encoder_len)
    if q_len_per_req < 1 or kv_offset < 0:
        raise ValueError(f"{fn}: {q_len_per_req=} must be >= 1 and {kv_offset=} >= 0.")
    batch = seq_lens.shape[0]
    _check_array("out_cache_loc", out_cache_loc, 1, batch * q_len_per_req)
    cache_seqlens = seq_lens + jnp.int32(kv_offset)
    cu_seqlens_q = jnp.arange(batch + 1, dtype=jnp.int32) * q_len_per_req
    max_seqlen_q = jnp.int32(q_len_per_req if batch else 0)
    return _assemble(
        req_to_token, req_pool_indices, cache_seqlens, cu_seqlens_q, out_cache_loc, max_seqlen_q,
        encoder_lens, page_size=page_size, max_pages=max_pages, max_q_len=q_len_per_req,
        max_encoder_len=max_encoder_len, mode=mode,
    )


def _plan_extend_body(
    req_to_token, req_pool_indices, seq_lens, extend_seq_lens, out_cache_loc, *,
    page_size, max_pages, max_q_len, mode, encoder_lens, max_encoder_len, fn,
) -> AttentionMetadata:
    _check_static(page_size, max_pages, mode, _EXTEND_MODES, fn)
    _check_common(req_to_token, req_pool_indices, seq_lens, encoder_lens, max_encoder_len)
    _check_array("extend_seq_lens", extend_seq_lens, 1, seq_lens.shape[0])
    _check_array("out_cache_loc", out_cache_loc, 1)
    if max_q_len < 1:
        raise ValueError(f"{fn}: {max_q_len=} must be >= 1; pass the static bound on extend lengths.")
    cu_seqlens_q = exclusive_cumsum(extend_seq_lens)
    token = jnp.arange(out_cache_loc.shape[0], dtype=jnp.int32)
    out_cache_loc = jnp.where(token < cu_seqlens_q[-1], out_cache_loc, 0)
    return _assemble(
        req_to_token, req_pool_indices, seq_lens, cu_seqlens_q, out_cache_loc,
        _safe_max(extend_seq_lens), encoder_lens, page_size=page_size, max_pages=max_pages,
        max_q_len=max_q_len, max_encoder_len=max_encoder_len, mode=mode,
    )


_EXTEND_STATIC = ("page_size", "max_pages", "max_q_len", "mode", "max_encoder_len")


@functools.partial(jax.jit, static_argnames=_EXTEND_STATIC)
def plan_extend(
    req_to_token: jax.Array,  # [R, W]
    req_pool_indices: jax.Array,  # [B]
    seq_lens: jax.Array,  # [B]
    extend_seq_lens: jax.Array,  # [B]
    out_cache_loc: jax.Array,  # [T]
    *,
    page_size: int = 1,
    max_pages: int,
    max_q_len: int,
    mode: ForwardMode = ForwardMode.EXTEND,
    encoder_lens: Optional[jax.Array] = None,  # [B]
    max_encoder_len: int = 0,
) -> AttentionMetadata:
    """Plans an extend, mixed or prefill batch (ragged new tokens, with or without prefix).

    ``cache_seqlens = seq_lens`` and ``cu_seqlens_q`` is the exclusive prefix sum of
    ``extend_seq_lens``; without prefixes this equals ``cu_seqlens_k`` as in SGLang.

    Args:
      req_to_token: request-to-token table (see ``plan_uniform``).
      req_pool_indices: request row of each batch entry (padded rows: 0).
      seq_lens: KV length of each sequence including the new tokens (padded rows: 1).
      extend_seq_lens: new tokens per sequence (padded rows: 0).
      out_cache_loc: slot of each new token; T is the static token bucket, tokens at or past
        ``sum(extend_seq_lens)`` are padding and come out as slot 0.
      page_size: tokens per KV page (static).
      max_pages: page-table width (static).
      max_q_len: static upper bound on ``extend_seq_lens``.
      mode: EXTEND, MIXED, SPLIT_PREFILL or a draft-extend mode (static).
      encoder_lens: per-row encoder lengths or None (see ``plan_uniform``).
      max_encoder_len: static upper bound on ``encoder_lens``.

    Returns:
      The step's ``AttentionMetadata`` (B = len(seq_lens), T = len(out_cache_loc)).
    """
    return _plan_extend_body(
        req_to_token, req_pool_indices, seq_lens, extend_seq_lens, out_cache_loc,
        page_size=page_size, max_pages=max_pages, max_q_len=max_q_len, mode=mode,
        encoder_lens=encoder_lens, max_encoder_len=max_encoder_len, fn="plan_extend",
    )


@functools.partial(jax.jit, static_argnames=_EXTEND_STATIC)
def plan_draft_extend(
    req_to_token: jax.Array,  # [R, W]
    req_pool_indices: jax.Array,  # [B]
    seq_lens: jax.Array,  # [B]
    accept_length: jax.Array,  # [B]
    out_cache_loc: jax.Array,  # [T]
    *,
    page_size: int = 1,
    max_pages: int,
    max_q_len: int,
    mode: ForwardMode = ForwardMode.DRAFT_EXTEND,
    encoder_lens: Optional[jax.Array] = None,  # [B]
    max_encoder_len: int = 0,
) -> AttentionMetadata:
    """Plans the draft model's extend after verification (SGLang's DRAFT_EXTEND).

    Each sequence extends by ``accept_length + 1`` tokens (the accepted drafts plus the
    bonus token); otherwise identical to ``plan_extend``. Padded rows pass
    ``accept_length = -1`` so that their extend length is 0.

    Args:
      accept_length: accepted draft tokens per sequence.
      max_q_len: static upper bound on ``accept_length + 1`` (e.g. num_draft_tokens).
      Others: as in ``plan_extend``.

    Returns:
      The step's ``AttentionMetadata``.
    """
    _check_array("accept_length", accept_length, 1, seq_lens.shape[0])
    return _plan_extend_body(
        req_to_token, req_pool_indices, seq_lens, accept_length + 1, out_cache_loc,
        page_size=page_size, max_pages=max_pages, max_q_len=max_q_len, mode=mode,
        encoder_lens=encoder_lens, max_encoder_len=max_encoder_len, fn="plan_draft_extend",
    )


@functools.partial(jax.jit, static_argnames=("page_size", "max_pages"))
def plan_idle(*, page_size: int = 1, max_pages: int = 1) -> AttentionMetadata:
    """Plans an empty step (SGLang's IDLE mode: no requests on this rank).

    Args:
      page_size: tokens per KV page (static).
      max_pages: page-table width (static).

    Returns:
      Valid metadata with B = 0 and T = 0.
    """
    _check_static(page_size, max_pages, ForwardMode.IDLE, (ForwardMode.IDLE,), "plan_idle")
    empty = jnp.zeros((0,), jnp.int32)
    zero_cu = jnp.zeros((1,), jnp.int32)
    return AttentionMetadata(
        cache_seqlens=empty,
        cu_seqlens_q=zero_cu,
        cu_seqlens_k=zero_cu,
        page_table=jnp.zeros((0, max_pages), jnp.int32),
        out_cache_loc=empty,
        max_seqlen_q=jnp.int32(0),
        max_seqlen_k=jnp.int32(0),
        mode=ForwardMode.IDLE,
        batch_size=0,
        num_tokens=0,
        page_size=page_size,
        max_q_len=1,
        max_pages=max_pages,
    )


# ----------------------------------------------------------------------------- hybrid SWA pool
_SWA_BIT = 64  # jax_attn.safety.ERRORS: a full_to_swa_index_mapping entry outside the SWA pool


def with_swa_pool(md: AttentionMetadata, mapping: jax.Array, *, num_swa_slots: int) -> AttentionMetadata:
    """``md`` with ``swa_page_table``: SGLang's hybrid ``SWAKVPool`` (traceable, no host sync).

    As the seed: the token-level entry at each page's first position (``page_table * page_size``: the
    plan's page table holds the strided ``req_to_token`` entries) is translated with
    ``full_to_swa_index_mapping``, then ``// page_size``. Used entries outside the SWA pool, and real
    ``out_cache_loc`` slots whose mapping is, set error bit 64 and are clamped (reads) into the pool.

    Args:
      md: a guarded plan (page ids already inside the full pool).
      mapping: ``i32[S_full + 1]`` full slot -> SWA slot (SGLang appends one ``-1``), or its int64
        words ``i32[S_full + 1, 2]`` (narrowed here, saturating).
      num_swa_slots: slots of the SWA pool (static).
    """
    if mapping.ndim == 2:  # int64 seen as little-endian int32 word pairs
        low, high = mapping[:, 0], mapping[:, 1]
        mapping = jnp.where(high == (low >> 31), low, jnp.where(high < 0, jnp.int32(-1), jnp.int32(num_swa_slots)))
    n, ps = mapping.shape[0], md.page_size
    num_pages = max(num_swa_slots // ps, 1)

    def translate(slots):  # full slots -> (SWA slots, in range)
        swa = mapping[jnp.clip(slots, 0, n - 1)]
        return swa, (slots >= 0) & (slots < n) & (swa >= 0) & (swa < num_swa_slots)

    swa, ok = translate(md.page_table * ps)
    used = jnp.arange(md.max_pages, dtype=jnp.int32)[None, :] * ps < md.cache_seqlens[:, None]
    table = jnp.where(used, jnp.clip(swa // ps, 0, num_pages - 1), 0)
    real = jnp.arange(md.num_tokens, dtype=jnp.int32) < md.cu_seqlens_q[-1]
    _, loc_ok = translate(md.out_cache_loc)
    bad = jnp.any(used & ~ok) | jnp.any(real & ~loc_ok)
    prior = jnp.int32(0) if md.errors is None else md.errors
    return dataclasses.replace(md, swa_page_table=table,
                               errors=prior | jnp.where(bad, jnp.int32(_SWA_BIT), jnp.int32(0)))
