"""Numpy oracle of SGLang's ``FlashAttentionBackend.init_forward_metadata`` (eager path).

It follows the seed's semantics step by step, on host arrays, with the seed's host-side
quantities (``seq_lens_cpu.max()``) as plain integers:

* decode: ``cache_seqlens = seq_lens``; draft decode (topk <= 1) adds ``step_id + 1``;
  ``cu_seqlens_q = arange(B + 1)``.
* target verify (topk <= 1): ``cache_seqlens = seq_lens + num_draft_tokens``,
  ``cu_seqlens_q = arange(B + 1) * num_draft_tokens``, ``max_seq_len_q = num_draft_tokens``.
* extend / mixed / draft extend: ``cache_seqlens = seq_lens``; with any prefix, or in
  DRAFT_EXTEND, ``cu_seqlens_q`` is the prefix sum of ``extend_seq_lens``; otherwise the seed
  reuses ``cu_seqlens_k`` (and ``max_seq_len_q = max_seq_len_k``).
* page table: ``req_to_token[rows, :max_seq_len_k]``; with an encoder, the decoder part
  ``req_to_token[rows, enc : enc + max_seq_len_k]`` (seq_lens exclude encoder tokens); for
  page size > 1 every ``page_size``-th column divided by ``page_size``.
* encoder: ``encoder_page_table = req_to_token[rows, :max(encoder_lens)]`` (slots).

The seed accepts one encoder length per batch (a batch of one request). Here the shift is
taken per row, which is the seed's formula whenever all rows share the encoder length; the
planner lifts the restriction the same way. topk > 1 (cascade) is not covered here.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from jax_attn.metadata import ForwardMode


def _cumsum0(x: np.ndarray) -> np.ndarray:
    return np.pad(np.cumsum(x, dtype=np.int64), (1, 0)).astype(np.int32)


def _decode_like(mode, seq_lens, batch, draft_step_id, num_draft_tokens):
    """(cache_seqlens, max_seq_len_k, max_seq_len_q, cu_seqlens_q) of decode / verify."""
    if mode == ForwardMode.TARGET_VERIFY:
        extra = num_draft_tokens
        max_q = num_draft_tokens
        cu_q = np.arange(0, batch * num_draft_tokens + 1, num_draft_tokens)
    else:
        extra = 0 if draft_step_id is None else draft_step_id + 1
        max_q = 1
        cu_q = np.arange(0, batch + 1)
    cache = seq_lens + extra
    return cache, int(seq_lens.max()) + extra, max_q, cu_q


def _extend_like(mode, seq_lens, extend_seq_lens, extend_prefix_lens):
    cache = seq_lens
    max_k = int(seq_lens.max())
    cu_k = _cumsum0(cache)
    if np.any(extend_prefix_lens) or mode == ForwardMode.DRAFT_EXTEND:
        return cache, max_k, int(np.max(extend_seq_lens)), _cumsum0(extend_seq_lens)
    return cache, max_k, max_k, cu_k


def init_forward_metadata(
    mode: ForwardMode,
    req_to_token: np.ndarray,  # [R, W]
    req_pool_indices: np.ndarray,  # [B]
    seq_lens: np.ndarray,  # [B]
    *,
    page_size: int,
    draft_step_id: Optional[int] = None,
    num_draft_tokens: int = 0,
    extend_seq_lens: Optional[np.ndarray] = None,  # [B]
    extend_prefix_lens: Optional[np.ndarray] = None,  # [B]
    encoder_lens: Optional[np.ndarray] = None,  # [B]
) -> dict:
    """Returns the seed's metadata fields as int32 numpy arrays / ints.

    ``draft_step_id`` not None selects draft decode with topk <= 1. The page table has the
    seed's width (``ceil(max_seq_len_k / page_size)`` columns, less if the table is narrower).
    """
    seq_lens = np.asarray(seq_lens, np.int64)
    rows = np.asarray(req_pool_indices, np.int64)
    batch = seq_lens.shape[0]
    if mode in (ForwardMode.DECODE, ForwardMode.IDLE, ForwardMode.TARGET_VERIFY):
        cache, max_k, max_q, cu_q = _decode_like(mode, seq_lens, batch, draft_step_id, num_draft_tokens)
    elif mode in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND):
        ext = np.asarray(extend_seq_lens, np.int64)
        pre = np.zeros_like(ext) if extend_prefix_lens is None else np.asarray(extend_prefix_lens)
        cache, max_k, max_q, cu_q = _extend_like(mode, seq_lens, ext, pre)
    else:
        raise NotImplementedError(f"oracle does not model {mode!r}")

    out = {
        "cache_seqlens": cache.astype(np.int32),
        "cu_seqlens_q": np.asarray(cu_q, np.int32),
        "cu_seqlens_k": _cumsum0(cache),
        "max_seqlen_q": max_q,
        "max_seqlen_k": max_k,
    }
    if encoder_lens is None:
        table = req_to_token[rows, :max_k]
    else:
        enc = np.asarray(encoder_lens, np.int64)
        max_enc = int(enc.max())
        out["encoder_lens"] = enc.astype(np.int32)
        out["encoder_cu_seqlens_k"] = _cumsum0(enc)
        out["encoder_max_seq_len_k"] = max_enc
        out["encoder_page_table"] = req_to_token[rows, :max_enc].astype(np.int32)
        # Decoder tokens follow each row's encoder tokens; a slice cut short by the table
        # width is zero-padded (those columns lie past every valid prefix).
        table = np.stack([_pad_to(req_to_token[r, e : e + max_k], max_k) for r, e in zip(rows, enc)])
    if page_size > 1:
        table = table[:, ::page_size] // page_size
    out["page_table"] = np.asarray(table, np.int32)
    return out


def _pad_to(x: np.ndarray, n: int) -> np.ndarray:
    return np.pad(x, (0, n - x.shape[0]))
