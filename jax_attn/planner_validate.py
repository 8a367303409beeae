"""Host-side value checks of planned metadata (tests and debug runs; never the hot path).

``validate_metadata`` reads the metadata back to the host and raises ``ValueError`` naming
the field, the first bad row and the fix. Shape and dtype errors are caught earlier, at
trace time, by the planners themselves.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from jax_attn.kernels.config import cdiv
from jax_attn.metadata import AttentionMetadata, EncoderMetadata


def _fail(field: str, row, problem: str, fix: str) -> None:
    where = f"{field}[{row}]" if row is not None else field
    raise ValueError(f"{where}: {problem}. Fix: {fix}.")


def _first_bad(mask: np.ndarray):
    """Index (int or tuple) of the first True entry of mask, or None."""
    hits = np.argwhere(mask)
    if hits.size == 0:
        return None
    idx = tuple(int(i) for i in hits[0])
    return idx[0] if len(idx) == 1 else idx


def _check_shapes(md: AttentionMetadata, cs, cu_q, cu_k, pt, loc) -> None:
    b, t, p = md.batch_size, md.num_tokens, md.max_pages
    expected = {
        "cache_seqlens": (cs, (b,)),
        "cu_seqlens_q": (cu_q, (b + 1,)),
        "cu_seqlens_k": (cu_k, (b + 1,)),
        "page_table": (pt, (b, p)),
        "out_cache_loc": (loc, (t,)),
    }
    for name, (arr, shape) in expected.items():
        if arr.shape != shape:
            _fail(name, None, f"shape {arr.shape} != {shape} (batch_size={b}, num_tokens={t}, "
                  f"max_pages={p})", "build the metadata with a planner of jax_attn.planner")


def _check_queries(md: AttentionMetadata, cs, cu_q) -> np.ndarray:
    """Checks cu_seqlens_q against T, cache_seqlens and max_q_len; returns q_lens."""
    if cu_q[0] != 0:
        _fail("cu_seqlens_q", 0, f"starts at {cu_q[0]}, not 0", "use an exclusive prefix sum")
    q_lens = np.diff(cu_q)
    bad = _first_bad(q_lens < 0)
    if bad is not None:
        _fail("cu_seqlens_q", bad + 1, f"decreases ({cu_q[bad]} -> {cu_q[bad + 1]})",
              "extend_seq_lens must be >= 0 (padded rows 0)")
    if cu_q[-1] > md.num_tokens:
        _fail("cu_seqlens_q", md.batch_size, f"total {cu_q[-1]} queries exceed num_tokens="
              f"{md.num_tokens}", "pick a token bucket >= sum(extend_seq_lens)")
    bad = _first_bad(q_lens > cs)
    if bad is not None:
        _fail("cu_seqlens_q", bad, f"q_len {q_lens[bad]} > cache_seqlens {cs[bad]}",
              "seq_lens must include the new tokens (seq_len = prefix_len + extend_len)")
    bad = _first_bad(q_lens > md.max_q_len)
    if bad is not None:
        _fail("cu_seqlens_q", bad, f"q_len {q_lens[bad]} > max_q_len={md.max_q_len}",
              "raise the static max_q_len bound")
    return q_lens


def _check_keys(md: AttentionMetadata, cs, cu_k, pt, num_pages: int) -> None:
    bad = _first_bad(cs < 0)
    if bad is not None:
        _fail("cache_seqlens", bad, f"negative length {cs[bad]}", "pass seq_lens >= 0 (padded rows 1)")
    used_pages = cdiv(cs, md.page_size)
    bad = _first_bad(used_pages > md.max_pages)
    if bad is not None:
        _fail("cache_seqlens", bad, f"{cs[bad]} tokens need {used_pages[bad]} pages but the page "
              f"table holds max_pages={md.max_pages}", "raise max_pages to ceil(max_context_len / page_size)")
    expected_cu = np.concatenate([[0], np.cumsum(cs)])
    bad = _first_bad(cu_k != expected_cu)
    if bad is not None:
        _fail("cu_seqlens_k", bad, f"{cu_k[bad]} != prefix sum {expected_cu[bad]} of cache_seqlens",
              "recompute cu_seqlens_k from cache_seqlens")
    used = np.arange(md.max_pages)[None, :] < used_pages[:, None]
    bad = _first_bad(used & ((pt < 0) | (pt >= num_pages)))
    if bad is not None:
        _fail("page_table", bad[0], f"page id {pt[bad]} at column {bad[1]} outside [0, {num_pages})",
              "fill req_to_token with slot ids of the KV pool (page = slot // page_size)")


def _check_bounds(md: AttentionMetadata, q_lens, cs) -> None:
    max_q, max_k = int(np.asarray(md.max_seqlen_q)), int(np.asarray(md.max_seqlen_k))
    if q_lens.size and max_q < q_lens.max():
        _fail("max_seqlen_q", None, f"{max_q} < longest query run {q_lens.max()}", "replan the batch")
    if cs.size and max_k < cs.max():
        _fail("max_seqlen_k", None, f"{max_k} < longest KV run {cs.max()}", "replan the batch")


def _check_slots(md: AttentionMetadata, cu_q, loc, num_slots: int) -> None:
    bad = _first_bad((loc < 0) | (loc >= num_slots))
    if bad is not None:
        _fail("out_cache_loc", bad, f"slot {loc[bad]} outside [0, {num_slots})",
              "allocate slots from the KV pool")
    pad = np.arange(md.num_tokens) >= cu_q[-1]
    bad = _first_bad(pad & (loc != 0))
    if bad is not None:
        _fail("out_cache_loc", bad, f"padding token writes slot {loc[bad]}", "point padding tokens at slot 0")


def _check_encoder(enc: EncoderMetadata, batch: int, num_slots: int) -> np.ndarray:
    lens = np.asarray(enc.encoder_lens)
    cu = np.asarray(enc.encoder_cu_seqlens_k)
    table = np.asarray(enc.encoder_page_table)
    if lens.shape != (batch,) or cu.shape != (batch + 1,) or table.shape != (batch, enc.max_encoder_len):
        _fail("encoder", None, f"shapes {lens.shape}, {cu.shape}, {table.shape} do not match batch "
              f"{batch} / max_encoder_len {enc.max_encoder_len}", "build it with a planner")
    bad = _first_bad((lens < 0) | (lens > enc.max_encoder_len))
    if bad is not None:
        _fail("encoder_lens", bad, f"{lens[bad]} outside [0, max_encoder_len={enc.max_encoder_len}]",
              "raise the static max_encoder_len bound")
    bad = _first_bad(cu != np.concatenate([[0], np.cumsum(lens)]))
    if bad is not None:
        _fail("encoder_cu_seqlens_k", bad, "is not the prefix sum of encoder_lens", "recompute it")
    used = np.arange(enc.max_encoder_len)[None, :] < lens[:, None]
    bad = _first_bad(used & ((table < 0) | (table >= num_slots)))
    if bad is not None:
        _fail("encoder_page_table", bad[0], f"slot {table[bad]} outside [0, {num_slots})",
              "fill req_to_token's encoder positions with pool slots")
    return lens


def validate_metadata(
    md: AttentionMetadata, *, num_pages: int, req_to_token_shape: Optional[Sequence[int]] = None
) -> None:
    """Checks a planned ``AttentionMetadata`` by value (reads it back to the host).

    Args:
      md: the metadata to check.
      num_pages: pages in the KV cache (``num_slots // page_size``).
      req_to_token_shape: ``(R, W)`` of the table the plan was built from; when given, checks
        that every row's tokens (encoder tokens included) fit in its width.

    Raises:
      ValueError: naming the field, the first bad row and the fix.
    """
    cs, cu_q, cu_k = (np.asarray(a) for a in (md.cache_seqlens, md.cu_seqlens_q, md.cu_seqlens_k))
    pt, loc = np.asarray(md.page_table), np.asarray(md.out_cache_loc)
    _check_shapes(md, cs, cu_q, cu_k, pt, loc)
    _check_keys(md, cs, cu_k, pt, num_pages)
    q_lens = _check_queries(md, cs, cu_q)
    _check_bounds(md, q_lens, cs)
    num_slots = num_pages * md.page_size
    _check_slots(md, cu_q, loc, num_slots)
    enc_lens = np.zeros_like(cs)
    if md.encoder is not None:
        enc_lens = _check_encoder(md.encoder, md.batch_size, num_slots)
        bad = _first_bad(enc_lens % md.page_size != 0)
        if bad is not None:
            _fail("encoder_lens", bad, f"{enc_lens[bad]} is not a multiple of page_size={md.page_size}, "
                  "so the decoder's pages are misaligned", "pad each encoder run to whole pages")
    if req_to_token_shape is not None:
        width = int(req_to_token_shape[1])
        bad = _first_bad(enc_lens + cs > width)
        if bad is not None:
            _fail("cache_seqlens", bad, f"{enc_lens[bad]} encoder + {cs[bad]} tokens exceed the "
                  f"req_to_token width {width}", "raise max_context_len (req_to_token width)")
