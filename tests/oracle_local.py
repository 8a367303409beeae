"""Numpy oracle of the seed's ``make_local_attention_virtual_batches`` (SGLang 0.5.11, vLLM's
algorithm), written anew from its description: host arrays in, host arrays out.

Each sequence b with ``q_b`` new queries and ``k_b`` keys is cut at multiples of the chunk size C;
every chunk that holds one of its queries becomes a virtual row with the queries of that chunk,
the keys of the chunk up to the last query and the chunk's columns of the block table. A sequence
without queries gives one row (its last chunk). Block-table columns past the table's width are
clipped to the last column, as in the seed.

``seed_clamp=True`` reproduces the seed's extra step: the chunk first shrinks to
``max(seq_lens)`` and then to a multiple of ``page_size`` (at least one page). vLLM's current
function has no such step, and its published examples assume none (one of them differs only in
the width of the table).
"""

from __future__ import annotations

import numpy as np


def _cdiv(a, b):
    return -(-a // b)


def make_local_virtual_batches(chunk_size: int, cu_seqlens_q: np.ndarray, seq_lens: np.ndarray,
                               block_table: np.ndarray, page_size: int, *, seed_clamp: bool = False):
    """Returns ``(q_lens, cu_seqlens_q, k_lens, block_table)`` of the virtual batch (numpy)."""
    cu_seqlens_q = np.asarray(cu_seqlens_q, np.int64)
    seq_lens = np.asarray(seq_lens, np.int64)
    block_table = np.asarray(block_table)
    c = int(chunk_size)
    if seed_clamp:
        c = max((min(c, int(seq_lens.max())) // page_size) * page_size, page_size)
    if c % page_size:
        raise ValueError(f"chunk {c} is not a multiple of page size {page_size}")
    q = np.diff(cu_seqlens_q)
    # Queries of each sequence that fall in its first touched chunk, then whole chunks after it.
    offset_in_chunk = (seq_lens - q) % c
    q_first = np.minimum(c - offset_in_chunk, q)
    blocks = 1 + _cdiv(q - q_first, c)  # virtual rows per sequence
    keys_last = seq_lens - ((seq_lens - 1) // c) * c  # keys in the last chunk (1..C for seq_len >= 1)
    rows = []  # (sequence, chunk index within the sequence's touched ones)
    for b, n in enumerate(blocks):
        rows += [(b, j) for j in range(int(n))]
    q_lens = np.zeros(len(rows), np.int64)
    k_lens = np.zeros(len(rows), np.int64)
    k_start = np.zeros(len(rows), np.int64)
    for v, (b, j) in enumerate(rows):
        n = int(blocks[b])
        q_lens[v] = q_first[b] if j == 0 else min(q[b] - q_first[b] - c * (j - 1), c)
        k_lens[v] = keys_last[b] if j == n - 1 else c
        # Chunks counted back from the last one: the last starts keys_last before the end.
        k_start[v] = seq_lens[b] - keys_last[b] - (n - 1 - j) * c
    per_row = c // page_size
    cols = np.clip(k_start[:, None] // page_size + np.arange(per_row)[None, :], None, block_table.shape[1] - 1)
    owners = np.array([b for b, _ in rows], np.int64)
    table = block_table[owners[:, None], cols] if rows else np.zeros((0, per_row), block_table.dtype)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    return q_lens.astype(np.int32), cu.astype(np.int32), k_lens.astype(np.int32), table


def chunk_mask(q_positions: np.ndarray, k_len: int, chunk_size: int) -> np.ndarray:
    """bool[len(q_positions), k_len]: query at position p sees keys in ``[p // C * C, p]``."""
    p = np.asarray(q_positions)[:, None]
    k = np.arange(k_len)[None, :]
    return (k <= p) & (k >= (p // chunk_size) * chunk_size)
