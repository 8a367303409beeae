"""Shared test fixture: a request table whose rows own shuffled pages (row 0 / page 0 reserved)."""

import numpy as np


def shuffled_table(num_reqs: int, max_ctx: int, page_size: int, seed: int):
    """``(req_to_token i32[num_reqs + 1, max_ctx], num_slots)``; each row's pages in random order."""
    pages_per = -(-max_ctx // page_size)
    order = np.random.default_rng(seed).permutation(np.arange(1, num_reqs * pages_per + 1))
    table = np.zeros((num_reqs + 1, max_ctx), np.int32)
    for r in range(num_reqs):
        pages = order[r * pages_per:(r + 1) * pages_per]
        table[r + 1] = (pages[:, None] * page_size + np.arange(page_size)).reshape(-1)[:max_ctx]
    return table, (num_reqs * pages_per + 1) * page_size


def committed_pools(table, num_slots: int, rows, committed, num_kv_heads: int, head_dim: int, head_dim_v: int, rng):
    """float32 K / V pools ``[num_slots, Hkv, D]`` / ``[..., Dv]``: random keys at each row's first ``committed``
    positions, 0 in the reserved slot 0, NaN everywhere else (a read of a slot nobody owns shows)."""
    k = np.full((num_slots, num_kv_heads, head_dim), np.nan, np.float32)
    v = np.full((num_slots, num_kv_heads, head_dim_v), np.nan, np.float32)
    k[0] = v[0] = 0.0
    for r, n in zip(rows, committed):
        k[table[r, :n]] = rng.standard_normal((n, num_kv_heads, head_dim))
        v[table[r, :n]] = rng.standard_normal((n, num_kv_heads, head_dim_v))
    return k, v
