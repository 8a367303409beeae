"""The step planner's table rules as torch ops, for ``torch_bridge.graph_tables``: each function writes what
its JAX counterpart (named in its docstring) writes, bit for bit, in the planner's int32 arithmetic; the graph's
table refresh runs them on the GPU inside the engine's CUDA graph."""

from __future__ import annotations

from typing import List, Optional, Tuple, Union

import numpy as np
import torch

from jax_attn.kernels.config import DEFAULT_CONFIG as TRITON_CONFIG
from jax_attn.kernels.config import cdiv, kv_heads_per_program
from jax_attn.kernels.mosaic_kernel import TILE_INFO_COLUMNS, TILE_INFO_WORDS, tile_rows
from jax_attn.kernels.mosaic_split import stored_rows


def wrap32(x: torch.Tensor) -> torch.Tensor:  # i64 -> i64
    """The value int32 arithmetic (the planner's) gives for a sum or product computed here in int64."""
    return x.to(torch.int32).to(torch.int64)


def tree_mask(mask: torch.Tensor, lens: torch.Tensor, n: int) -> torch.Tensor:  # bool[L], i64[B] -> bool[B * N, N]
    """``jax_attn.spec.draft_mask_from_custom_mask`` over the flat mask bytes ``mask`` (``lens``: the int32
    committed lengths): its int32 offsets, False outside the buffer."""
    row_len = lens + n
    size = row_len * n
    starts = torch.cumsum(size, 0) - size
    i = torch.arange(n, dtype=torch.int64, device=lens.device)
    idx = wrap32(starts[:, None, None] + (i * row_len[:, None])[:, :, None] + (lens[:, None] + i)[:, None, :])
    ok = (idx >= 0) & (idx < mask.shape[0])
    return (ok & mask[idx.clamp(0, mask.shape[0] - 1)]).reshape(-1, n)


def expand_parts(r2t: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, mask: torch.Tensor
                 ) -> Tuple[torch.Tensor, torch.Tensor]:
    """The expand pass's page table and lengths (``plan_verify_tree``, before the guard): per draft row (``mask``'s
    rows), its request's draft slots with the columns it allows first in column order, and how many it allows.
    ``rows``: clipped request rows; ``lens``: the int32 committed lengths."""
    b, n = lens.shape[0], mask.shape[1]
    j = torch.arange(n, dtype=torch.int64, device=lens.device)
    cols = wrap32(lens[:, None] + j).clamp(0, r2t.shape[1] - 1)
    slots = r2t[rows[:, None], cols][:, None, :].expand(b, n, n).reshape(b * n, n)
    allowed = mask.to(torch.int64)
    before = torch.cumsum(allowed, 1) - allowed  # allowed columns left of each column
    count = allowed.sum(1)
    dest = torch.where(mask, before, count[:, None] + j - before)  # the stable sort's place of each column
    return torch.empty_like(slots).scatter_(1, dest, slots), count


def swa_parts(r2t: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, expand: torch.Tensor, counts: torch.Tensor,
              width: int, group: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """The tree's SWA table and lengths (``jax_attn.spec._swa_md``, before the guard): per draft row (``group`` a
    request: its N draft tokens in verify, the default, or its topk branches in draft decode), its request's slots
    of positions ``[0, seq_len)`` (``width`` columns at most) then its ``expand`` slots (unclipped)."""
    b, n = lens.shape[0], expand.shape[1]
    g = group or n
    base = lens[:, None].expand(b, g).reshape(-1)  # [B * G]
    col = torch.arange(width + n, dtype=torch.int64, device=lens.device)[None, :]
    pre = r2t[rows[:, None].expand(b, g).reshape(-1, 1), col.clamp(0, r2t.shape[1] - 1)]
    post = torch.gather(expand, 1, wrap32(col - base[:, None]).clamp(0, n - 1))
    return torch.where(col < base[:, None], pre, post), wrap32(base + counts)


def guarded(table: torch.Tensor, lens: torch.Tensor, num_slots: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A page-size-1 pass's table and lengths as ``jax_attn.safety.guard`` leaves them: slots into the pool,
    lengths into ``[0, table width]``."""
    if num_slots:
        table = table.clamp(0, num_slots - 1)
    return table, lens.clamp(0, table.shape[1]).to(torch.int32)


def swa_pool_table(mapping: torch.Tensor, table: torch.Tensor, lens: torch.Tensor, first_pos: torch.Tensor, page: int,
                   num_swa_slots: int) -> torch.Tensor:  # -> i64[B, P]
    """``jax_attn.planner.with_swa_pool``'s ``swa_page_table``: each used page's first slot (``table * page``, the
    guarded page table; ``lens``: the guarded lengths; ``first_pos``: each column's first position) translated
    through an ``SWAKVPool``'s ``full_to_swa_index_mapping`` (int64 entries narrowed as the planner narrows them:
    outside int32, -1 below and ``num_swa_slots`` above), then to SWA pages clipped into the SWA pool."""
    n = mapping.shape[0]
    swa = mapping[wrap32(table.to(torch.int64) * page).clamp(0, n - 1)].to(torch.int64)
    fits = (swa >= -(1 << 31)) & (swa < (1 << 31))
    swa = torch.where(fits, swa, torch.where(swa < 0, -1, num_swa_slots))
    pages = torch.div(swa, page, rounding_mode="floor").clamp(0, max(num_swa_slots // page, 1) - 1)
    return torch.where(first_pos < lens[:, None], pages, 0)


def lse_pattern(n: int, hq: int, heads: int, pack: int, block_q: int, latent: bool = False) -> np.ndarray:
    """``jax_attn.kernels.mosaic_split.lse_index`` (i64[n * hq]) of a sequence of ``n`` tokens that is tile 0's
    alone (one tile per sequence, ``heads`` head rows per tile): where the kernel puts each (token, query head)
    row's LSE in the tile's output ``[heads, rows_per_tile]``, -1 where it puts none. Tile ``t``'s rows are
    ``t * heads * rows_per_tile`` further on. ``latent``: a latent cache's tiles (one block of rows in q's
    order)."""
    rows = tile_rows(block_q, latent)
    pos = stored_rows(block_q, pack, latent)  # storage position -> row of the row view
    h = np.arange(heads)[:, None]
    out_row = (pos // pack)[None, :] * hq + h * pack + (pos % pack)[None, :]  # [heads, rows]
    ok = np.broadcast_to(pos < n * pack, out_row.shape)
    index = np.full(n * hq, -1, np.int64)
    index[out_row[ok]] = np.arange(heads * rows).reshape(heads, rows)[ok]
    return index


def _uniform_schedule(lens: torch.Tensor, *, batch: int, num_tiles: int, max_splits: int, q_len, block_q: int,
                      programs: int, num_sms: int, split_waves: int, min_kv_per_split: int) -> dict:
    """``jax_attn.kernels.schedule.build_schedule`` of a uniform bucket (every sequence ``q_len`` queries, or
    rows of the row view; or ``q_len`` a tensor of each sequence's: a local virtual batch, whose rows hold one
    query or none; ``programs`` CTAs per tile for the split heuristic), its rules in int32: each tile's
    sequence, query block and split before the sort (``seq``, ``q_block``, ``split``, ``valid``), the sort
    (``order``: tiles longest first, stable), kv splits per sequence (``splits``) and each sequence's first
    tile (``starts``)."""
    b, n, s = batch, num_tiles, max_splits
    dev, i32 = lens.device, torch.int32
    if not isinstance(q_len, torch.Tensor):  # (in the lengths' type: int32 sums wrap as the planner's do)
        q_len = torch.full((b,), q_len, dtype=lens.dtype, device=dev)
    qb = cdiv(q_len, block_q)  # (the planner's ceiling division, int32 wraps and all)
    if s == 1:
        splits = torch.ones(b, dtype=i32, device=dev)
    else:  # the split heuristic over the step's query blocks
        by_len = cdiv(lens, min_kv_per_split)
        blocks = (qb.sum() * programs).clamp(min=1)
        want = torch.where(blocks >= num_sms, 1,
                           torch.div(num_sms * split_waves, blocks, rounding_mode="floor").clamp(min=1))
        splits = torch.minimum(by_len, want).clamp(1, s).to(i32)
    counts = splits * qb
    ends = torch.cumsum(counts, 0).to(i32)
    starts = ends - counts
    tile = torch.arange(n, dtype=i32, device=dev)
    seq = (ends[None, :] <= tile[:, None]).sum(1)  # searchsorted(ends, tile, side="right")
    valid = seq < b
    seq_c = seq.clamp(max=b - 1)
    local = tile - starts[seq_c]
    ns = splits[seq_c]
    q_block = (qb[seq_c] - 1) - torch.div(local, ns, rounding_mode="floor")
    split = torch.remainder(local, ns)
    k_len = lens[seq_c]
    cost = torch.div(torch.minimum(k_len, k_len - q_len[seq_c] + (q_block + 1) * block_q), ns, rounding_mode="floor")
    cost = torch.where(valid, cost.clamp(min=0), -1)
    order = torch.argsort(-cost, stable=True)
    return dict(seq=seq_c, q_block=q_block, split=split, valid=valid, order=order, splits=splits, starts=starts)


def triton_schedule(lens: torch.Tensor, lay, hkv: int, q_len_per_req) -> List[torch.Tensor]:
    """``jax_attn.kernels.schedule.plan_schedule``'s tables for a uniform bucket (every sequence
    ``q_len_per_req`` queries, or a tensor of each sequence's) of layout ``lay`` (``triton_path.Layout``) over
    ``lens``: tile sequence, query block and split, then kv splits per sequence (the planner's default config,
    its rules in int32)."""
    cfg = TRITON_CONFIG
    programs = hkv // kv_heads_per_program(cfg, hkv, decode=lay.max_q_len <= 1, split=True)
    t = _uniform_schedule(lens, batch=lay.batch, num_tiles=lay.num_tiles, max_splits=lay.max_splits,
                          q_len=q_len_per_req, block_q=lay.block_q, programs=programs, num_sms=cfg.num_sms,
                          split_waves=cfg.split_waves, min_kv_per_split=cfg.min_kv_per_split)
    neg = torch.full_like(t["seq"], -1)
    return [torch.where(t["valid"], t[x].to(torch.int32), neg)[t["order"]] for x in ("seq", "q_block", "split")] + [
        t["splits"]]


def offsets(counts: torch.Tensor) -> torch.Tensor:  # i64[B] -> i64[B + 1]
    """The exclusive cumulative sum of ``counts`` with its total (query offsets from queries per sequence)."""
    return torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0)]).to(torch.int64)


def tile_info(t: dict, k_lens: torch.Tensor, cu: torch.Tensor, rows_per_tile: int) -> torch.Tensor:
    """``jax_attn.kernels.mosaic_paged.tile_table`` (``i32[N, TILE_INFO_WORDS]``) of schedule ``t``
    (``_uniform_schedule``), each tile's keys from ``k_lens`` and its queries from the offsets ``cu``."""
    seq, q_block, split = (torch.where(t["valid"], t[x].to(torch.int64), -1)[t["order"]]
                           for x in ("seq", "q_block", "split"))
    seq0 = seq.clamp(min=0)
    cols = dict(seq=seq, first_row=q_block * rows_per_tile, split=split, k_len=k_lens[seq0].to(torch.int64),
                q_start=cu[seq0], q_len=cu[seq0 + 1] - cu[seq0], seq_splits=t["splits"][seq0].to(torch.int64))
    pad = [torch.zeros_like(seq)] * (TILE_INFO_WORDS - len(TILE_INFO_COLUMNS))
    return torch.stack([cols[c] for c in TILE_INFO_COLUMNS] + pad, 1).to(torch.int32)


def mosaic_tile_table(lens: torch.Tensor, q_lens: torch.Tensor, *, num_tiles: int, rows_per_tile: int, pack: int,
                      config, max_keys: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``plan_mosaic_schedule``'s unsplit tile table (``num_splits=1``) of a ragged bucket whose sequences fit one
    row block (``q_lens * pack <= rows_per_tile``): ``(cu_seqlens_q i32[B + 1], tile table i32[N, TILE_INFO_WORDS])``,
    keys clipped to ``max_keys`` (the plan's page table)."""
    t = _uniform_schedule(lens, batch=lens.shape[0], num_tiles=num_tiles, max_splits=1, q_len=q_lens * pack,
                          block_q=rows_per_tile, programs=1, num_sms=config.num_sms, split_waves=config.split_waves,
                          min_kv_per_split=config.min_kv_per_split)
    cu = offsets(q_lens)
    return cu.to(torch.int32), tile_info(t, lens.clamp(max=max_keys), cu, rows_per_tile)


def local_parts(table: torch.Tensor, lens: torch.Tensor, *, q_len: int, chunk: int, page: int, width: int,
                rows: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``jax_attn.local.plan_local`` of a uniform plan (``q_len`` queries a row: decode, chain verify) from its
    guarded page table ``[B, P]`` and lengths: ``rows`` virtual rows (``max_virtual_rows``), one per chunk that
    holds a row's queries, in row order (rows past the last: no query, one key, page 0): their page tables
    ``[rows, width]`` (0 past the keys), keys, and queries (0 for a row without keys)."""
    b, dev = lens.shape[0], lens.device
    first = torch.div((lens - max(q_len, 1)).clamp(min=0), chunk, rounding_mode="floor")  # the first query's chunk
    last = torch.div((lens - 1).clamp(min=0), chunk, rounding_mode="floor")
    n = (last - first + 1).clamp(min=1)
    ends = torch.cumsum(n, 0)
    cum = ends - n  # each row's first virtual row
    v = torch.arange(rows, dtype=torch.int64, device=dev)
    seq = ((ends[None, :] <= v[:, None]).sum(1)).clamp(max=b - 1)  # searchsorted(cum, v, "right") - 1, clipped
    valid = v < ends[-1]
    start = (first[seq] + v - cum[seq]) * chunk
    k = lens[seq]
    k_local = torch.minimum(k, start + chunk) - start
    q_local = (k_local + start - torch.maximum(k - q_len, start)).clamp(min=0)
    start, q_local, k_local = (torch.where(valid, x, fill) for x, fill in ((start, 0), (q_local, 0), (k_local, 1)))
    j = torch.arange(width, dtype=torch.int64, device=dev)
    cols = (torch.div(start, page, rounding_mode="floor")[:, None] + j[None, :]).clamp(0, table.shape[1] - 1)
    pages = table[seq[:, None], cols]
    used = valid[:, None] & (j[None, :] * page < k_local[:, None])
    return torch.where(used, pages, 0), k_local, q_local


def mosaic_split_tables(lens: torch.Tensor, *, batch: int, num_tiles: int, max_splits: int,
                        q_len: Union[int, torch.Tensor], pack: int, heads: int, rows_per_tile: int, config,
                        pattern: torch.Tensor, num_tokens: int = 0, q_heads: int = 0,
                        max_keys: Optional[int] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """``jax_attn.kernels.mosaic_paged.plan_mosaic_schedule``'s split schedule (``num_splits=None``) of a uniform
    bucket whose sequences fit one row block (``q_len * pack <= rows_per_tile``): its tile table
    ``i32[N, TILE_INFO_WORDS]`` (``tile_table``) and ``mosaic_split.lse_index`` ``i32[S, T * Hq]``.
    ``heads``: the row view's heads; ``pattern``: ``lse_pattern`` of one sequence of the most queries a sequence
    holds; ``config``: the ``MosaicConfig``. ``q_len`` a tensor (a pass planned apart from the step's sequences:
    each row's queries, in the order of the step's ``num_tokens`` tokens of ``q_heads`` query heads; a local
    virtual batch, an encoder-decoder step's encoder rows): a row's LSE entries follow its query offset;
    ``max_keys`` clips the tile table's keys (the pass's page table)."""
    dev = lens.device
    t = _uniform_schedule(lens, batch=batch, num_tiles=num_tiles, max_splits=max_splits, q_len=q_len * pack,
                          block_q=rows_per_tile, programs=heads, num_sms=config.num_sms,
                          split_waves=config.split_waves, min_kv_per_split=config.min_kv_per_split)
    order, splits = t["order"], t["splits"]
    if isinstance(q_len, torch.Tensor):
        cu = offsets(q_len)
    else:
        cu = torch.arange(batch + 1, dtype=torch.int64, device=dev) * q_len
    info = tile_info(t, lens if max_keys is None else lens.clamp(max=max_keys), cu, rows_per_tile)
    n = order.shape[0]
    place = torch.empty_like(order).scatter_(0, order, torch.arange(n, dtype=order.dtype, device=order.device))
    s = torch.arange(max_splits, dtype=torch.int64, device=dev)[:, None]  # [S, 1]
    at = place[(t["starts"].to(torch.int64)[None, :] + s).clamp(max=n - 1)]  # [S, B]: each split's tile, sorted
    stride = heads * rows_per_tile  # a tile's LSE rows
    ok = (s < splits[None, :])[:, :, None] & (pattern >= 0)[None, None, :]  # [S, B, entries of a sequence]
    value = at[:, :, None] * stride + pattern[None, None, :]
    if not isinstance(q_len, torch.Tensor):
        return info, torch.where(ok, value, -1).reshape(max_splits, -1).to(torch.int32)
    # each row's entries (token-major: token j's query heads) at its tokens' places in the step's token axis
    e = torch.arange(pattern.shape[0], dtype=torch.int64, device=dev)
    ok = ok & (torch.div(e, q_heads, rounding_mode="floor")[None, None, :] < q_len[None, :, None])
    size = max_splits * num_tokens * q_heads
    dest = torch.where(ok, s[:, :, None] * (num_tokens * q_heads) + cu[:-1][None, :, None] * q_heads + e, size)
    index = torch.full((size + 1,), -1, dtype=torch.int64, device=dev)
    index.scatter_(0, dest.reshape(-1), value.reshape(-1))
    return info, index[:size].reshape(max_splits, -1).to(torch.int32)
