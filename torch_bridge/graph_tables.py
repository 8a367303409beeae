"""Launch tables of a captured uniform bucket, recomputed on the GPU inside the engine's CUDA graph.

The replay hook of a graph bucket normally runs the step planner: one compiled JAX call, an export
and a table copy, 150-250 us of host time per step on the H100 hosts. On the launch path a uniform
bucket (decode, chain draft decode, chain verify: topk 1, no encoder, no local or SWA tables) has
tables that depend on the step only through ``req_pool_indices``, ``seq_lens`` and
``req_to_token``, so ``TableRefresh`` writes them with a few torch ops instead. The first attention
layer of the captured forward runs those ops, so they become part of the engine's graph and read the
tensors the capture hook was given (SGLang's static input buffers). From then on the replay hook
only selects the bucket's step; the graph recomputes the tables on the GPU before its first layer.

The step planner stays the definition of the tables. A refresh writes exactly the planner's values
(``tests/test_graph_tables.py`` compares them bit for bit over random and bad input), and every
table it writes is first compared with the planner's own for the capture hook's batch; a bucket
whose tables differ keeps the planner.

What a refresh writes, per ``mosaic_path.Tables`` (B: the bucket's batch class, P: page-table
width, R x W: ``req_to_token``), with the planner's rules (``jax_attn.planner._page_table``,
``jax_attn.safety.guard``, ``jax_attn.kernels.mosaic_paged.plan_mosaic_schedule``):

* lengths: ``seq_lens`` saturated to int32 plus the key's ``kv_offset`` (int32 arithmetic);
* page table ``[B, P]``: page ``p`` of row ``clip(rows, 0, R - 1)`` is
  ``req_to_token[row, min(p * page, W - 1)] // page`` where ``p * page`` is below the length, else 0,
  clipped into the pool's pages;
* tile table ``[B, 8]``: one tile per sequence, longest first (ties by batch index), with its
  sequence, ``min(clip(length, 0, capacity), P * page)`` keys and query offset; the other columns are
  the same for every step of the bucket and stay as the planner wrote them at capture;
* ``cu_seqlens_q`` does not change within a bucket.

The Triton-lowered kernel's tables (page sizes the Mosaic kernel does not take, e.g. SGLang's default of
1) hold the same lengths (``cache_seqlens``: ``seq_lens`` clipped to the capacity) and page table, and the
work schedule the planner builds from them (``jax_attn.kernels.schedule.build_schedule``): kv splits per
sequence (``min(want, ceil(length / min_kv_per_split))`` clipped to ``[1, S]``, ``want`` a static of the
bucket), the tiles of each sequence in order, then sorted by estimated keys, longest first (stable), and
with splits each output row's split count (``row_num_splits``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import torch

from jax_attn import batch as jbatch
from jax_attn.plan_key import PlanKey
from jax_attn.kernels.config import DEFAULT_CONFIG as TRITON_CONFIG
from jax_attn.kernels.config import cdiv, kv_heads_per_program
from jax_attn.kernels.mosaic_io import COMPUTE_WGS
from jax_attn.kernels.mosaic_kernel import TILE_INFO_COLUMNS, TILE_INFO_WORDS
from jax_attn.kernels.mosaic_paged import MosaicConfig
from jax_attn.safety import INT32_MAX, INT32_MIN
from torch_bridge.checks import plans_local
from torch_bridge.dlpack import capturing
from torch_bridge.mosaic_path import TRITON_TABLES, TableKey, Tables, key_flags
from torch_bridge.translate import UNIFORM

SEQ, K_LEN, Q_START = (TILE_INFO_COLUMNS.index(c) for c in ("seq", "k_len", "q_start"))


def reason(key: PlanKey, step, validate: bool, capacity: int) -> Optional[str]:
    """None when the launch tables of ``step`` (a graph bucket's, planned by the capture hook) may be
    refreshed inside the graph, else why not (each table key is checked too: ``TableRefresh.verify``)."""
    if validate:
        return "validation mode reads each step's error flag from the planner"
    if key.mode not in UNIFORM or key.topk != 1 or key.has_encoder:
        return "only uniform chain steps without encoder (decode, chain draft decode and verify)"
    if key.swa_pool or plans_local(key) or step.layout.local or step.layout.swa:
        return "SWA pool and local-attention tables come from the planner"
    if not 0 <= capacity <= key.max_pages * key.page_size or (capacity + 1) * key.batch_size > INT32_MAX:
        return f"capacity {capacity}: the tile order's int32 key needs capacity * batch within int32"
    return None


class Parts(NamedTuple):
    """What every table of a refresh is made of (torch tensors of the current inputs)."""

    table: torch.Tensor  # i32[B, P] page table
    lens: torch.Tensor  # i32[B] keys per sequence (``cache_seqlens``), clipped to the capacity
    order: torch.Tensor  # i64[B] sequences longest first, ties in batch order (the Mosaic tile table's)


def triton_schedule(lens: torch.Tensor, lay, hkv: int, q_len_per_req: int) -> List[torch.Tensor]:
    """``jax_attn.kernels.schedule.plan_schedule``'s tables for a uniform bucket (every sequence
    ``q_len_per_req`` queries) of layout ``lay`` (``triton_path.Layout``) over ``lens``: tile sequence, query
    block and split, then kv splits per sequence (the planner's default config, its rules in int32)."""
    b, n, s, bq = lay.batch, lay.num_tiles, lay.max_splits, lay.block_q
    dev, i32 = lens.device, torch.int32
    qb = cdiv(q_len_per_req, bq)
    if s == 1:
        splits = torch.ones(b, dtype=i32, device=dev)
    else:
        cfg = TRITON_CONFIG
        pack = kv_heads_per_program(cfg, hkv, decode=lay.max_q_len <= 1, split=True)
        base = max(b * qb * (hkv // pack), 1)
        want = 1 if base >= cfg.num_sms else cdiv(cfg.num_sms * cfg.split_waves, base)
        by_len = torch.div(lens + (cfg.min_kv_per_split - 1), cfg.min_kv_per_split, rounding_mode="floor")
        splits = by_len.clamp(max=want).clamp(1, s).to(i32)
    counts = splits * qb
    ends = torch.cumsum(counts, 0).to(i32)
    starts = ends - counts
    tile = torch.arange(n, dtype=i32, device=dev)
    seq = (ends[None, :] <= tile[:, None]).sum(1)  # searchsorted(ends, tile, side="right")
    valid = seq < b
    seq_c = seq.clamp(max=b - 1)
    local = tile - starts[seq_c]
    ns = splits[seq_c]
    q_block = (qb - 1) - torch.div(local, ns, rounding_mode="floor")
    split = torch.remainder(local, ns)
    k_len = lens[seq_c]
    cost = torch.div(torch.minimum(k_len, k_len - q_len_per_req + (q_block + 1) * bq), ns, rounding_mode="floor")
    cost = torch.where(valid, cost.clamp(min=0), -1)
    order = torch.argsort(-cost, stable=True)
    neg = torch.full_like(tile, -1)
    return [torch.where(valid, x.to(i32), neg)[order] for x in (seq_c, q_block, split)] + [splits]


class TableRefresh:
    """Recomputes a graph bucket's launch tables from the capture hook's ``rows`` / ``lens`` tensors.

    Args:
      key: the bucket's plan key (its batch class).
      step: the ``Step`` the capture hook planned (its tables are the persistent buffers).
      rows, lens: the capture hook's ``req_pool_indices`` and ``seq_lens`` (the engine's static buffers).
      req_to_token: the request pool's table.
      capacity: KV positions a sequence may hold (``jax_attn.backend.FlashAttentionBackend.capacity``).
      config: the launch path's kernel config.
      spec: the bucket's ``jax_attn.batch.SpecInfo`` (or None), for a planner call of its step.
    """

    def __init__(self, key: PlanKey, step, rows: torch.Tensor, lens: torch.Tensor, req_to_token: torch.Tensor,
                 capacity: int, config: MosaicConfig, spec=None):
        b, dev = key.batch_size, req_to_token.device
        self.key, self.step, self.r2t, self.spec = key, step, req_to_token, spec
        self.rows_per_tile = COMPUTE_WGS * config.block_q
        self.rows, self.lens = rows, lens  # the graph reads these tensors
        self.n = min(int(rows.shape[0]), b)
        with torch.inference_mode(False):
            # the bucket's padding (rows 0, seq_len fill) in buffers of the batch class; the refresh copies the
            # engine's n entries in front
            self._rows = torch.zeros(b, dtype=torch.int64, device=dev)
            self._lens = torch.full((b,), jbatch.SEQ_LEN_FILL_VALUE, dtype=torch.int64, device=dev)
        p, page, width = key.max_pages, key.page_size, req_to_token.shape[1]
        first = torch.arange(p, dtype=torch.int64, device=dev) * page
        self.first_pos = first.to(torch.int32)[None, :]  # [1, P]
        self.pos = first.clamp(max=width - 1)[None, :]  # [1, P]: the columns read (clipped like the planner)
        self.tie = (b - 1 - torch.arange(b, dtype=torch.int32, device=dev))  # earlier index first among equals
        self.index = torch.arange(b, dtype=torch.int64, device=dev)
        self.capacity = int(capacity)
        why = reason(key, step, False, capacity)
        if why is not None:
            raise ValueError(f"no in-graph refresh for {key}: {why}")
        self.num_pages = key.num_slots // page if key.num_slots else 0
        self.serial = 0  # bumped by each replay hook: the next eager layer refreshes
        self.done: Optional[tuple] = None  # (serial, capturing, forward when capturing) of the last refresh
        self.recorded = False  # a capture's first layer ran the refresh: the graph recomputes the tables
        self.stale = False  # the step's plan words are the capture's (a replay hook skipped the planner)
        self.steps: Dict[int, Any] = {}  # entries the replay passed -> the bucket's step for them
        self.verified: set = set()  # table keys whose planner tables matched the refresh's: the ones it writes
        self.planner_too = False  # a table the refresh does not write joined after the capture: plan each step too

    # ---- the rule ----------------------------------------------------------------------------
    def compute(self) -> Parts:
        """The ``Parts`` of the current ``rows`` / ``lens`` (torch ops on the GPU, recorded into a graph when
        capturing)."""
        key, n = self.key, self.n
        rows, lens = self.rows, self.lens
        if n < key.batch_size or rows.shape[0] != n or lens.shape[0] != n:
            self._rows[:n].copy_(rows[:n])
            self._lens[:n].copy_(lens[:n])
            rows, lens = self._rows, self._lens
        rows = rows.clamp(0, self.r2t.shape[0] - 1)
        lens = lens.to(torch.int64).clamp(INT32_MIN, INT32_MAX)
        if key.kv_offset:
            lens = lens + key.kv_offset
        lens = lens.to(torch.int32)  # wraps as the planner's int32 sum does
        slots = self.r2t[rows[:, None], self.pos]  # [B, P]
        pages = torch.div(slots, key.page_size, rounding_mode="floor") if key.page_size > 1 else slots
        table = torch.where(self.first_pos < lens[:, None], pages, 0)
        if self.num_pages:
            table = table.clamp(0, self.num_pages - 1)
        safe = lens.clamp(0, self.capacity)  # also the tiles' keys: the capacity is within the page table
        order_key = safe * key.batch_size + self.tie  # longest first, then batch order (fits int32: checked)
        rank = (order_key[None, :] > order_key[:, None]).sum(1)
        order = torch.empty_like(rank).scatter_(0, rank, self.index)  # order[rank[i]] = i
        return Parts(table, safe, order)

    def _mosaic(self, parts: Parts) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The Mosaic tile table's changing columns: tile sequence, keys and query offset."""
        q_start = parts.order if self.key.q_len_per_req == 1 else parts.order * self.key.q_len_per_req
        return parts.order, parts.lens[parts.order], q_start

    def _triton(self, heads: TableKey, tables: Tables, parts: Parts) -> List[torch.Tensor]:
        """The Triton-lowered kernel's tables in ``triton_path.table_parts`` order, but ``cu_seqlens_q`` (fixed)."""
        lay = tables.layout
        tiles = triton_schedule(parts.lens, lay, heads[1], self.key.q_len_per_req)
        out = tiles + [parts.lens, None, parts.table.reshape(-1)]
        if lay.max_splits > 1:  # output row -> splits of its sequence (every token of the bucket is a real row)
            out.append(torch.repeat_interleave(tiles[3], self.key.q_len_per_req * heads[0]))
        return out

    def write(self, heads: TableKey, tables: Tables, parts: Parts) -> None:
        """The refresh's values into ``tables`` (the copies narrow int64 to the tables' int32)."""
        if tables.layout is not None:
            for dst, src in zip(tables.args, self._triton(heads, tables, parts)):
                if src is not None:
                    dst.copy_(src)
            return
        seq, k_len, q_start = self._mosaic(parts)
        tables.args[0].copy_(parts.table)
        info = tables.args[2]
        info[:, SEQ].copy_(seq)
        info[:, K_LEN].copy_(k_len)
        info[:, Q_START].copy_(q_start)

    def matches(self, heads: TableKey, tables: Tables, parts: Parts) -> bool:
        """Whether ``tables`` (the planner's, for the current inputs) hold what a refresh writes (a sync)."""
        b, qpr = self.key.batch_size, self.key.q_len_per_req
        cu = torch.arange(b + 1, dtype=torch.int32, device=parts.table.device) * qpr  # fixed within the bucket
        if tables.layout is not None:  # the Triton-lowered kernel's: plain tables only (not local / SWA / ...)
            lay = tables.layout
            if (len(heads) != 3 or key_flags(heads) != TRITON_TABLES or lay.batch != b or lay.num_tokens != b * qpr
                    or lay.max_q_len != qpr):
                return False
            want = [cu if x is None else x.to(torch.int32) for x in self._triton(heads, tables, parts)]
            return len(want) == len(tables.args) and all(
                got.shape == x.shape and torch.equal(got, x) for got, x in zip(tables.args, want))
        if (len(heads) != 2 or tables.num_tiles != b  # local / SWA tables; several tiles
                or qpr * tables.pack > self.rows_per_tile):  # per sequence
            return False
        table, (seq, k_len, q_start) = parts.table, (x.to(torch.int32) for x in self._mosaic(parts))
        info = torch.zeros((b, TILE_INFO_WORDS), dtype=torch.int32, device=table.device)
        for name, col in (("seq", seq), ("k_len", k_len), ("q_start", q_start), ("q_len", qpr), ("seq_splits", 1)):
            info[:, TILE_INFO_COLUMNS.index(name)] = col  # first_row and split stay 0: one tile per sequence
        got = tables.args
        return (got[0].shape == table.shape and got[2].shape == info.shape and torch.equal(got[0], table)
                and torch.equal(got[1], cu) and torch.equal(got[2], info))

    # ---- when it runs ------------------------------------------------------------------------
    def verify(self, heads: Optional[TableKey] = None) -> bool:
        """Compare the refresh with the planner's tables just planned for the current inputs (every table
        key, or ``heads``); False when any differs."""
        todo = self.step.tables if heads is None else {heads: self.step.tables[heads]}
        if not todo:
            return True
        parts = self.compute()
        ok = {h for h, t in todo.items() if self.matches(h, t, parts)}
        self.verified |= ok
        return len(ok) == len(todo)

    def before_layer(self, forward: int) -> None:
        """Called before each attention layer of a step of this bucket (``forward``: the layer runner's count
        of forwards): the first layer after a replay hook, and the first layer of each forward inside a
        capture, write the tables (inside a capture: into the graph)."""
        cap = capturing()
        state = (self.serial, cap, forward if cap else None)
        if state == self.done or not self.verified:
            return
        parts = self.compute()
        for heads in self.verified:
            self.write(heads, self.step.tables[heads], parts)
        self.done = state
        if cap:
            self.recorded = True

    def take(self, rows: torch.Tensor, lens: torch.Tensor):
        """The replay hook's inputs for a recorded bucket: SGLang passes the captured tensors themselves;
        other tensors have their values copied into those (the graph reads them). Returns the step."""
        n = min(int(rows.shape[0]), int(lens.shape[0]), self.key.batch_size)
        if n > self.n:
            raise ValueError(f"{self.key.mode.name} bucket was captured with {self.n} requests; its replay got {n}")
        for src, dst, fill in ((rows, self.rows, 0), (lens, self.lens, jbatch.SEQ_LEN_FILL_VALUE)):
            if src.data_ptr() == dst.data_ptr() and src.shape == dst.shape and src.stride() == dst.stride():
                continue
            m = min(n, dst.shape[0])
            dst[:m].copy_(src[:m])
            if m < dst.shape[0]:
                dst[m:].fill_(fill)
        self.serial += 1
        self.stale = True
        if n == self.n:
            return self.step
        hit = self.steps.get(n)
        if hit is None:
            per_req = self.key.num_tokens // self.key.batch_size
            hit = self.steps[n] = dataclasses.replace(self.step, real_tokens=n * per_req)
        return hit
