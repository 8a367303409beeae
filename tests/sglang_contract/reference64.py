"""Float64 attention oracle read straight from the torch KV pools and ``req_to_token``.

Independent of jax_attn (no metadata, no ``jax_attn.reference``). Each query row is given the
ordered list of KV slots it may see (oldest first); the helpers below derive those lists from a
request's ``req_to_token`` row the way SGLang's FlashAttention backend does:

* causal, bottom-right aligned: query ``i`` of ``q_len`` over ``kv_len`` keys sees keys
  ``0 .. kv_len - q_len + i``;
* non-causal (cross attention, ``AttentionType.ENCODER_ONLY``): every key;
* tree target verify: the committed keys plus the draft keys the flat ``custom_mask`` allows
  (per request ``N`` rows of ``seq_len + N`` columns);
* window ``(left, 0)`` inclusive keeps the last ``left + 1`` keys of a row's list (its keys are
  contiguous positions ending at the query, in every mode, trees included);
* Llama 4 chunked local attention keeps the keys in the query's chunk.

Cross attention: a request's encoder tokens occupy the first ``encoder_len`` columns of its
``req_to_token`` row and the decoder's tokens follow (the seed slices ``page_table`` from column
``encoder_max_seq_len_k``).

Dimension legend: T query rows, Hq / Hkv heads, D / Dv head dims, S pool slots.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np


def causal_rows(r2t: np.ndarray, row: int, q_len: int, kv_len: int, col0: int = 0) -> List[np.ndarray]:
    """Slots per query row, causal bottom-right, keys at columns ``col0 .. col0 + kv_len - 1``."""
    cols = r2t[row, col0:col0 + kv_len].astype(np.int64)
    return [cols[:kv_len - q_len + i + 1] for i in range(q_len)]


def full_rows(r2t: np.ndarray, row: int, q_len: int, kv_len: int, col0: int = 0) -> List[np.ndarray]:
    """Slots per query row, non-causal: every query sees all ``kv_len`` keys from column ``col0``."""
    cols = r2t[row, col0:col0 + kv_len].astype(np.int64)
    return [cols] * q_len


def tree_rows(r2t: np.ndarray, row: int, seq_len: int, mask: np.ndarray) -> List[np.ndarray]:
    """Target verify: ``mask`` is this request's ``[N, seq_len + N]`` block of SGLang's flat custom mask."""
    n = mask.shape[0]
    if mask.shape != (n, seq_len + n):
        raise ValueError(f"{mask.shape=} must be [N, seq_len + N] with {seq_len=}")
    cols = r2t[row, :seq_len + n].astype(np.int64)
    return [cols[mask[i]] for i in range(n)]


def chunk_local(rows: Sequence[np.ndarray], positions: Sequence[int], chunk: int) -> List[np.ndarray]:
    """Llama 4 local attention: a causal row's keys restricted to the query's chunk
    (positions ``p - p % chunk .. p``)."""
    return [keys[len(keys) - (p % chunk) - 1:] for keys, p in zip(rows, positions)]


def attention64(q: np.ndarray, k_pool: np.ndarray, v_pool: np.ndarray, rows: Sequence[np.ndarray], *,
                scale: float, softcap: float = 0.0, window: int = -1,
                sinks: Optional[np.ndarray] = None) -> np.ndarray:
    """Attention of each query row over its slots, in float64.

    Args:
      q: ``[T, Hq, D]`` queries (any float dtype; computed in float64).
      k_pool, v_pool: ``[S, Hkv, D]`` / ``[S, Hkv, Dv]`` one layer's pools.
      rows: ``T`` int arrays, the slots each row sees, oldest first (window counts from the end).
      scale: softmax scale (SGLang's ``layer.scaling``).
      softcap: ``cap * tanh(s / cap)`` when > 0.
      window: ``left`` of FA's ``(left, 0)``: keep each row's last ``left + 1`` keys; < 0: all.
      sinks: ``[Hq]`` per-head sink logits added to each head's softmax denominator.

    Returns:
      ``[T, Hq, Dv]`` float64. A row without keys and without sinks is 0.
    """
    q = np.asarray(q, np.float64)
    t, hq, _ = q.shape
    hkv, dv = k_pool.shape[1], v_pool.shape[2]
    group = hq // hkv
    out = np.zeros((t, hq, dv))
    for i, slots in enumerate(rows):
        slots = np.asarray(slots, np.int64)
        if window >= 0:
            slots = slots[max(len(slots) - window - 1, 0):]
        k = np.repeat(np.asarray(k_pool[slots], np.float64), group, axis=1)  # [n, Hq, D]
        v = np.repeat(np.asarray(v_pool[slots], np.float64), group, axis=1)  # [n, Hq, Dv]
        s = np.einsum("hd,nhd->hn", q[i], k) * scale  # [Hq, n]
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        if sinks is not None:
            s = np.concatenate([s, np.asarray(sinks, np.float64)[:, None]], axis=1)
        if s.shape[1] == 0:
            continue
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        out[i] = np.einsum("hn,nhd->hd", p[:, :len(slots)], v)
    return out
