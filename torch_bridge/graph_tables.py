"""Launch tables of a captured uniform or tree-verify bucket, recomputed on the GPU inside the engine's
CUDA graph.

The replay hook of a graph bucket normally runs the step planner: one compiled JAX call, an export
and a table copy, 150-250 us of host time per step on the H100 hosts. On the launch path a uniform
bucket (decode, chain draft decode, chain verify: topk 1) has
tables that depend on the step only through ``req_pool_indices``, ``seq_lens`` and
``req_to_token`` (and an encoder-decoder model's ``encoder_lens``), so ``TableRefresh`` writes them with a few
torch ops instead. The first attention
layer of the captured forward runs those ops, so they become part of the engine's graph and read the
tensors the capture hook was given (SGLang's static input buffers). From then on the replay hook
only selects the bucket's step; the graph recomputes the tables on the GPU before its first layer. Each step
backend of a ``FlashAttentionMultiStepBackend`` round is such a bucket (chain drafts) or a tree draft decode
bucket (below; ``torch_bridge.multistep``).

A tree verify bucket (topk > 1, ``jax_attn.spec.plan_verify_tree``) depends on SGLang's flat
``custom_mask`` too, a new tensor each step: the replay hook copies it into a buffer the graph reads
(``TableRefresh.load_mask``), and the graph recomputes both passes' tables and, with sliding-window
layers, the tree's SWA table. A tree draft decode bucket (topk > 1, ``jax_attn.spec.plan_draft_decode_tree``)
depends on every draft step's slots (SGLang's ``out_cache_loc``): the replay hook copies them into a buffer the
graph reads (``TableRefresh.load_loc``), and the graph recomputes its prefix pass's tables and its expand pass's
(each branch's slots of draft steps ``0..step_id``, clipped into the pool). Over SGLang's ``SWAKVPool`` a uniform
bucket's sliding-window layers read the page table translated into the SWA pool: the graph translates it through
the pool's ``full_to_swa_index_mapping`` itself (the engine edits that tensor in place). A local-attention
model's (Llama 4's) uniform bucket writes its chunked layers' virtual batch too (the Mosaic kernel's tables,
split-KV ones included). A tree verify bucket over an ``SWAKVPool`` translates its SWA table
slot by slot the same way, and a tree draft decode bucket of a sliding-window model writes its SWA table too (each
branch's committed slots, then its draft slots of steps ``0..step_id``).

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
* with split-KV (few sequences: ``mosaic_path.Tables.num_splits > 1``) the split schedule's whole tile table
  ``[N, 8]`` instead (kv splits per sequence ``min(want, ceil(length / min_kv_per_split))`` clipped to
  ``[1, S]``, a sequence's splits in order, then sorted by keys per split, longest first, stable) and the
  merge's LSE index ``[S, T * Hq]`` (each split's tile's place in that order times the tile's LSE rows, plus
  a fixed pattern per sequence; -1 past a sequence's splits), ``table_rules.mosaic_split_tables``;
* ``cu_seqlens_q`` does not change within a bucket;
* over an ``SWAKVPool``, the SWA layers' page table ``[B, P]``: each used page's first slot (page id times the page
  size, int32) looked up in ``full_to_swa_index_mapping`` (entries outside int32: -1 below, the SWA pool's size
  above), divided by the page size (floor) and clipped into the SWA pool's pages; 0 past the length
  (``table_rules.swa_pool_table``);
* a local-attention bucket's chunked layers (``jax_attn.local.plan_local`` of ``q`` queries per request): a
  virtual row per chunk holding a request's queries (chunks ``max(length - q, 0) // C`` to
  ``max(length - 1, 0) // C``; verify queries may take two), in request order, rows past the last padding: each
  row's keys ``min(length, start + C) - start`` from its chunk's ``start``, its queries (0 for a request without
  keys), its ``L`` pages from column ``start / page`` (0 past its keys), and the work tiles and query offsets of
  those queries (``table_rules.local_parts``, ``mosaic_tile_table``); with split-KV the split schedule of those
  rows and the merge's LSE index, each row's entries at its query offset in the step's token axis
  (``mosaic_split_tables`` of each row's queries);
* an encoder-decoder bucket (``encoder_lens``, ``jax_attn.planner._assemble``): the page table reads each row's
  columns after its encoder tokens (``p * page + encoder_len``, int32, clipped into the row), lengths are clipped
  to ``min(capacity, W - encoder_len)`` (``plan_key.guard_plan``), and the cross layers' tables
  (``CROSS_TABLES``, ``jax_attn.backend.cross_metadata``: page size 1) hold each row's first ``E`` slots below
  its encoder length (0 past it; not clipped into the pool, as the planner leaves them), the encoder lengths
  as given, and the tiles the planner's schedule gives those lengths (``mosaic_tile_table``,
  ``mosaic_split_tables``, ``triton_schedule``; ``E``: ``max_encoder_len``).

A tree verify bucket (N draft tokens per request) writes its prefix pass's tables as a uniform bucket of N
queries per request with no KV offset (the Mosaic kernel's carry the LSE index of ``LsePass`` too: where each
(token, head) row's LSE lies in the tiles' output, a fixed pattern per sequence moved by its tile's rank), and
its expand pass's (page size 1, one row per draft token, ``jax_attn.spec``'s rules in int32): the tree mask
read from the mask bytes at ``draft_mask_from_custom_mask``'s offsets (False outside the buffer), the draft
slots ``req_to_token[row, clip(seq_len + j, 0, W - 1)]`` with the allowed columns first in column order
(the planner's stable sort), clipped into the pool, and the allowed count per row. Its SWA table (``_swa_md``)
holds per draft row the request's slots of positions ``[0, seq_len)`` then the row's expand slots (before their
clip into the pool), ``seq_len`` plus the allowed count keys, all clipped like the expand pass's.

The Triton-lowered kernel's tables (page sizes the Mosaic kernel does not take, e.g. SGLang's default of
1) hold the same lengths (``cache_seqlens``: ``seq_lens`` clipped to the capacity) and page table, and the
work schedule the planner builds from them (``jax_attn.kernels.schedule.build_schedule``): kv splits per
sequence (``min(want, ceil(length / min_kv_per_split))`` clipped to ``[1, S]``, ``want`` a static of the
bucket), the tiles of each sequence in order, then sorted by estimated keys, longest first (stable).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch

from jax_attn import batch as jbatch
from jax_attn.metadata import ForwardMode
from jax_attn.plan_key import PlanKey
from jax_attn.kernels.config import cdiv
from jax_attn.kernels.mosaic_kernel import TILE_INFO_COLUMNS, TILE_INFO_WORDS, tile_rows
from jax_attn.kernels.mosaic_paged import MosaicConfig
from jax_attn.local import local_pages, max_virtual_rows
from jax_attn.safety import INT32_MAX, INT32_MIN
from torch_bridge.checks import plans_local, same_memory
from torch_bridge.dlpack import capturing
from torch_bridge.launcher import FrontBuffer
from torch_bridge.mosaic_path import (CROSS_TABLES, EXPAND_TABLES, LATENT_TABLES, LOCAL_TABLES, PREFIX_TABLES,
                                      SWA_TABLES, TREE_SWA_TABLES, TRITON_TABLES, TableKey, Tables, key_flags)
from torch_bridge.table_rules import (expand_parts, guarded, local_parts, lse_pattern, mosaic_split_tables,
                                      mosaic_tile_table, offsets, swa_parts, swa_pool_table, tree_mask,
                                      triton_schedule, wrap32)
from torch_bridge.translate import UNIFORM

SEQ, K_LEN, Q_START = (TILE_INFO_COLUMNS.index(c) for c in ("seq", "k_len", "q_start"))
# the table keys' flags a refresh writes (False: a uniform bucket's, True: a tree verify bucket's)
MOSAIC_FLAGS = {False: 0, True: PREFIX_TABLES}
TRITON_FLAGS = {False: (TRITON_TABLES,), True: tuple(TRITON_TABLES | f for f in (PREFIX_TABLES, EXPAND_TABLES,
                                                                                   TREE_SWA_TABLES))}


def tree_verify(key: PlanKey) -> bool:
    return key.topk > 1 and key.mode == ForwardMode.TARGET_VERIFY


def tree_draft(key: PlanKey) -> bool:
    """Tree draft decode (``jax_attn.spec.plan_draft_decode_tree``): each branch's query over the committed keys
    (the prefix pass) and over its own draft tokens of steps ``0..step_id`` (the expand pass)."""
    return key.topk > 1 and key.mode == ForwardMode.DECODE


def reason(key: PlanKey, validate: bool, capacity: int) -> Optional[str]:
    """None when the launch tables of a graph bucket of ``key`` (planned by the capture hook) may be
    refreshed inside the graph, else why not (each table key is checked too: ``TableRefresh.verify``)."""
    if validate:
        return "validation mode reads each step's error flag from the planner"
    if key.mode not in UNIFORM or not (key.topk == 1 or tree_verify(key) or tree_draft(key)):
        return "only uniform steps (decode, draft decode, verify)"
    if key.has_encoder and (key.topk > 1 or key.attention_chunk_size or key.swa_pool):
        return "cross attention only in chain steps without local attention or an SWAKVPool"
    if not 0 <= capacity <= key.max_pages * key.page_size or (capacity + 1) * key.batch_size > INT32_MAX:
        return f"capacity {capacity}: the tile order's int32 key needs capacity * batch within int32"
    return None


def mask_bytes(key: PlanKey, capacity: int) -> int:
    """Bytes of the flat verify mask a tree verify bucket's planner reads, in whole int32 words: a static bound
    (per request ``num_draft`` rows of at most ``capacity + num_draft`` columns); 0 for other buckets."""
    if not tree_verify(key):
        return 0
    n = key.q_len_per_req
    return 4 * cdiv(key.batch_size * n * (capacity + n), 4)


class Parts(NamedTuple):
    """What every table of a refresh is made of (torch tensors of the current inputs)."""

    table: torch.Tensor  # i32[B, P] page table
    lens: torch.Tensor  # i32[B] keys per sequence (``cache_seqlens``), clipped to the capacity
    order: torch.Tensor  # i64[B] sequences longest first, ties in batch order (the Mosaic tile table's)
    rank: torch.Tensor  # i64[B] each sequence's place in ``order``
    # tree verify's expand pass: i32[B * N, N] draft slots, allowed ones first; i32[B * N] allowed per row
    expand: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
    swa: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # its SWA table: i32[B * N, C + N], i32[B * N] keys
    # the page table translated into an SWAKVPool's SWA pool: i32[B, P] (a tree step's SWA table: i32[B * N, C + N])
    swa_pool: Optional[torch.Tensor] = None
    # a local-attention (chunked) step's virtual batch of V rows: i32[V, L] its chunks' pages, keys, queries per row
    local: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
    # a cross-attention step's encoder pass (page size 1): i32[B, E] encoder slots, i32[B] encoder lengths, queries
    cross: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None


def _same(got: Sequence[torch.Tensor], want: Sequence[torch.Tensor]) -> bool:
    """Whether the planner's table parts ``got`` hold the values ``want`` (same count, shapes and values; ``want``
    is compared in ``got``'s integer type, as a refresh's copies narrow it)."""
    return len(got) == len(want) and all(g.shape == w.shape and torch.equal(g, w.to(g.dtype))
                                         for g, w in zip(got, want))


class TableRefresh:
    """Recomputes a graph bucket's launch tables from the capture hook's ``rows`` / ``lens`` tensors (and, for
    tree verify, the flat mask the replay hook copies into ``mask``).

    Args:
      key: the bucket's plan key (its batch class).
      step: the ``Step`` the capture hook planned (its tables are the persistent buffers).
      rows, lens: the capture hook's ``req_pool_indices`` and ``seq_lens`` (the engine's static buffers).
      req_to_token: the request pool's table.
      capacity: KV positions a sequence may hold (``jax_attn.backend.FlashAttentionBackend.capacity``).
      config: the launch path's kernel config.
      spec: the bucket's ``jax_attn.batch.SpecInfo`` (or None), for a planner call of its step.
      mask: tree verify: the capture hook's ``spec_info.custom_mask`` (or None).
      loc: tree draft decode: every draft step's slots, ``[bs, topk, num_steps]`` flattened (or None: zeros).
      swa_mapping: an ``SWAKVPool``'s ``full_to_swa_index_mapping`` (``key.swa_pool``): the graph reads it, as
        the engine updates it in place.
      encoder_lens: cross attention (``key.has_encoder``): the capture hook's ``encoder_lens`` (the engine's static
        buffer): the graph reads it.
    """

    def __init__(self, key: PlanKey, step, rows: torch.Tensor, lens: torch.Tensor, req_to_token: torch.Tensor,
                 capacity: int, config: MosaicConfig, spec=None, mask: Optional[torch.Tensor] = None,
                 loc: Optional[torch.Tensor] = None, swa_mapping: Optional[torch.Tensor] = None,
                 encoder_lens: Optional[torch.Tensor] = None):
        b, dev = key.batch_size, req_to_token.device
        if key.swa_pool and (swa_mapping is None or swa_mapping.dim() != 1 or swa_mapping.device != dev):
            raise ValueError(f"{key} plans an SWAKVPool: pass its full_to_swa_index_mapping (1-D, on {dev})")
        if key.has_encoder != (encoder_lens is not None) or (encoder_lens is not None and encoder_lens.device != dev):
            raise ValueError(f"{key}: pass encoder_lens (on {dev}) exactly when the bucket plans cross attention")
        self.enc = encoder_lens  # the graph reads it (cross attention)
        self.swa_mapping = swa_mapping if key.swa_pool else None
        self.key, self.step, self.r2t, self.spec = key, step, req_to_token, spec
        self.rows_per_tile, self.block_q, self.config = tile_rows(config.block_q, latent=False), config.block_q, config
        self.rows, self.lens = rows, lens  # the graph reads these tensors
        self.n = min(int(rows.shape[0]), b)
        self.tree, self.draft = tree_verify(key), tree_draft(key)
        self.cascade = self.tree or self.draft  # a prefix pass and an expand pass
        self.kv_offset = 0 if self.cascade else key.kv_offset  # a tree's prefix pass reads the committed keys only
        with torch.inference_mode(False):
            # the bucket's padding (rows 0, seq_len fill) in buffers of the batch class; the refresh copies the
            # engine's n entries in front
            self._rows = torch.zeros(b, dtype=torch.int64, device=dev)
            self._lens = torch.full((b,), jbatch.SEQ_LEN_FILL_VALUE, dtype=torch.int64, device=dev)
            self._enc = torch.zeros(b, dtype=torch.int64, device=dev)  # (padding requests: no encoder tokens)
            # cross attention: the encoder positions [1, E], and the columns they are read at (clipped into the
            # request table's width as a JAX gather clamps its indices)
            self.enc_pos = torch.arange(key.max_encoder_len, dtype=torch.int64, device=dev)[None, :]
            self.enc_cols = self.enc_pos.clamp(max=req_to_token.shape[1] - 1)
            # tree verify: the flat mask bytes the planner reads (``mask_bytes``), filled by the replay hook
            self.mask = torch.zeros(mask_bytes(key, capacity), dtype=torch.bool, device=dev) if self.tree else None
            # tree draft decode: every draft step's slots ``[B, topk, num_steps]``, filled by the replay hook
            self.loc = (torch.zeros(b * key.topk * key.num_steps, dtype=torch.int64, device=dev) if self.draft
                        else None)
        self.mask_size = 0 if self.mask is None else int(self.mask.shape[0])
        self._mask_front = None if self.mask is None else FrontBuffer(self.mask)
        self._loc_front = None if self.loc is None else FrontBuffer(self.loc)
        self.mask_len = 0  # bytes of ``mask`` the last load wrote (the rest are 0)
        self.spec_info = types.SimpleNamespace(custom_mask=self.mask) if self.tree else None  # a planner call's
        p, page, width = key.max_pages, key.page_size, req_to_token.shape[1]
        first = torch.arange(p, dtype=torch.int64, device=dev) * page
        self.first_pos = first.to(torch.int32)[None, :]  # [1, P]
        self.pos = first.clamp(max=width - 1)[None, :]  # [1, P]: the columns read (clipped like the planner)
        self.tie = (b - 1 - torch.arange(b, dtype=torch.int32, device=dev))  # earlier index first among equals
        self.index = torch.arange(b, dtype=torch.int64, device=dev)
        self.capacity = int(capacity)
        self.pool_flag = 0 if self.swa_mapping is None else SWA_TABLES  # the SWA pool's tables are written too
        self.chunk = key.attention_chunk_size if plans_local(key) else 0  # local-attention (chunked) tables
        self.local_width = local_pages(chunk_size=self.chunk, page_size=page, max_pages=p) if self.chunk else 0
        self.local_rows = max_virtual_rows(chunk_size=self.chunk, batch_size=b, num_tokens=key.num_tokens,
                                           max_kv_len=p * page, q_len_per_req=key.q_len_per_req) if self.chunk else 0
        why = reason(key, False, capacity)
        if why is not None:
            raise ValueError(f"no in-graph refresh for {key}: {why}")
        if self.tree:
            self.load_mask(mask)
        if self.draft:
            self.load_loc(loc)
        self.num_pages = key.num_slots // page if key.num_slots else 0
        self.lse: Dict[TableKey, Tuple[torch.Tensor, int]] = {}  # Mosaic prefix tables -> (lse_pattern, tile stride)
        self.split_lse: Dict[TableKey, torch.Tensor] = {}  # Mosaic split tables -> one sequence's lse_pattern
        self.serial = 0  # bumped by each replay hook: the next eager layer refreshes
        self.done: Optional[tuple] = None  # (serial, capturing, forward when capturing) of the last refresh
        self.recorded = False  # a capture's first layer ran the refresh: the graph recomputes the tables
        self.stale = False  # the step's plan words are the capture's (a replay hook skipped the planner)
        self.steps: Dict[int, Any] = {}  # entries the replay passed -> the bucket's step for them
        self.verified: set = set()  # table keys whose planner tables matched the refresh's: the ones it writes
        self.planner_too = False  # a table the refresh does not write joined after the capture: plan each step too

    # ---- the rule ----------------------------------------------------------------------------
    def compute(self) -> Parts:
        """The ``Parts`` of the current ``rows`` / ``lens`` (and ``mask``) (torch ops on the GPU, recorded into
        a graph when capturing)."""
        key, n = self.key, self.n
        rows, lens, enc = self.rows, self.lens, self.enc
        if n < key.batch_size or rows.shape[0] != n or lens.shape[0] != n or (enc is not None and enc.shape[0] != n):
            self._rows[:n].copy_(rows[:n])
            self._lens[:n].copy_(lens[:n])
            if enc is not None:
                self._enc[:n].copy_(enc[:n])
                enc = self._enc
            rows, lens = self._rows, self._lens
        rows = rows.clamp(0, self.r2t.shape[0] - 1)
        lens = lens.to(torch.int64).clamp(INT32_MIN, INT32_MAX)
        expand = swa = None
        if self.tree:
            mask = tree_mask(self.mask, lens, key.q_len_per_req)
            table, counts = expand_parts(self.r2t, rows, lens, mask)
            if key.with_swa:
                swa = guarded(*swa_parts(self.r2t, rows, lens, table, counts, key.max_pages * key.page_size),
                              key.num_slots)
            expand = guarded(table, counts, key.num_slots)
        elif self.draft:  # each branch's slots of draft steps 0..step_id, all of them attended
            table = self.loc.view(-1, key.num_steps)[:, :key.step_id + 1]
            counts = torch.full((table.shape[0],), key.step_id + 1, device=table.device)
            if key.with_swa:  # per branch: its request's committed slots, then its draft slots
                swa = guarded(*swa_parts(self.r2t, rows, lens, table, counts, key.max_pages * key.page_size,
                                         group=key.topk), key.num_slots)
            expand = guarded(table, counts, key.num_slots)
        if self.kv_offset:
            lens = lens + self.kv_offset
        lens = lens.to(torch.int32)  # wraps as the planner's int32 sum does
        cross, pos, cap = None, self.pos, None
        if enc is not None:  # a request's decoder positions follow its encoder tokens (jax_attn.planner._assemble)
            enc = enc.to(torch.int64).clamp(INT32_MIN, INT32_MAX)  # (narrowed as the planner's input is)
            width = self.r2t.shape[1]
            pos = wrap32(self.first_pos + enc[:, None]).clamp(0, width - 1)  # [B, P]
            cap = wrap32(width - enc).clamp(max=self.capacity).to(torch.int32)  # plan_key.guard_plan's, per row
            enc = enc.to(torch.int32)
            eslots = self.r2t[rows[:, None], self.enc_cols]  # [B, E]
            cross = (torch.where(self.enc_pos < enc[:, None], eslots, 0), enc,
                     torch.full_like(enc, key.q_len_per_req))
        slots = self.r2t[rows[:, None], pos]  # [B, P]
        pages = torch.div(slots, key.page_size, rounding_mode="floor") if key.page_size > 1 else slots
        table = torch.where(self.first_pos < lens[:, None], pages, 0)
        if self.num_pages:
            table = table.clamp(0, self.num_pages - 1)
        # also the tiles' keys: the capacity is within the page table (an encoder's capacity may fall below 0)
        safe = lens.clamp(0, self.capacity) if cap is None else torch.clamp(lens, min=torch.zeros_like(lens), max=cap)
        # longest first, then batch order (fits int32: checked); a length below 0 sorts as 0, as the tiles' cost
        order_key = safe.clamp(min=0) * key.batch_size + self.tie
        rank = (order_key[None, :] > order_key[:, None]).sum(1)
        order = torch.empty_like(rank).scatter_(0, rank, self.index)  # order[rank[i]] = i
        pool = None
        if self.swa_mapping is not None and swa is not None:  # a tree step's SWA table, slot by slot (page size 1)
            cols = torch.arange(swa[0].shape[1], dtype=torch.int32, device=swa[0].device)[None, :]
            pool = swa_pool_table(self.swa_mapping, swa[0], swa[1], cols, 1, key.num_swa_slots)
        elif self.swa_mapping is not None:
            pool = swa_pool_table(self.swa_mapping, table, safe, self.first_pos, key.page_size, key.num_swa_slots)
        local = None if not self.chunk else local_parts(table, safe, q_len=key.q_len_per_req, chunk=self.chunk,
                                                        page=key.page_size, width=self.local_width,
                                                        rows=self.local_rows)
        return Parts(table, safe, order, rank, expand, swa, pool, local, cross)

    def _pass(self, heads: TableKey, parts: Parts) -> Tuple[torch.Tensor, torch.Tensor, Union[int, torch.Tensor]]:
        """(lengths, page table, queries per sequence) of the plan ``heads``'s tables describe."""
        flags = key_flags(heads)
        one = parts.expand if flags & EXPAND_TABLES else parts.swa if flags & TREE_SWA_TABLES else None
        if one is not None:  # a page-size-1 pass: one query per row (a tree's SWA table over an SWAKVPool: translated)
            return one[1], parts.swa_pool if flags & TREE_SWA_TABLES and flags & SWA_TABLES else one[0], 1
        if flags & LOCAL_TABLES:  # the local virtual batch: one query per row, or none
            table, lens, q = parts.local
            return lens, table, q
        if flags & CROSS_TABLES:  # the encoder tokens (page size 1)
            return parts.cross[1], parts.cross[0], self.key.q_len_per_req
        table = parts.swa_pool if flags & SWA_TABLES else parts.table  # (an SWAKVPool's sliding-window layers)
        return parts.lens, table, self.key.q_len_per_req

    def _mosaic(self, parts: Parts) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The Mosaic tile table's changing columns: tile sequence, keys and query offset."""
        q_start = parts.order if self.key.q_len_per_req == 1 else parts.order * self.key.q_len_per_req
        return parts.order, parts.lens[parts.order], q_start

    def _lse(self, heads: TableKey, parts: Parts) -> torch.Tensor:
        """A tree prefix pass's LSE index (``LsePass``), ``[B, N * Hq]``: its sequence's pattern, moved by its tile."""
        pattern, stride = self.lse[heads]
        return torch.where(pattern >= 0, parts.rank[:, None] * stride + pattern, -1)

    def _split(self, heads: TableKey, tables: Tables, parts: Parts) -> Tuple[torch.Tensor, torch.Tensor]:
        """The Mosaic split kernel's tile table and the merge's LSE index (``table_rules.mosaic_split_tables``), of
        the step's sequences or of a pass planned apart from them (``_ragged``: the local virtual batch's rows, the
        encoder tokens)."""
        latent, row_heads = bool(key_flags(heads) & LATENT_TABLES), self._row_heads(heads, tables)
        ragged = bool(key_flags(heads) & (LOCAL_TABLES | CROSS_TABLES))
        local = bool(key_flags(heads) & LOCAL_TABLES)
        most = min(self.key.q_len_per_req, self.chunk) if local else self.key.q_len_per_req  # queries a row holds
        pattern = self.split_lse.get(heads)
        if pattern is None:
            with torch.inference_mode(False):
                pattern = self.split_lse[heads] = torch.from_numpy(lse_pattern(
                    most, heads[0], row_heads, tables.pack, self.block_q, latent)).to(parts.table.device)
        common: Dict[str, Any] = dict(num_tiles=tables.num_tiles, max_splits=tables.num_splits, pack=tables.pack,
                                      heads=row_heads, rows_per_tile=tile_rows(self.block_q, latent),
                                      config=self.config, pattern=pattern)
        if ragged:
            _, lens, q, max_keys = self._ragged(heads, parts)
            return mosaic_split_tables(lens, batch=lens.shape[0], q_len=q, num_tokens=self.key.num_tokens,
                                       q_heads=heads[0], max_keys=max_keys, **common)
        return mosaic_split_tables(parts.lens, batch=self.key.batch_size, q_len=self.key.q_len_per_req, **common)

    @staticmethod
    def _row_heads(heads: TableKey, tables: Tables) -> int:
        """The heads of the Mosaic kernel's row view (its CTAs per tile)."""
        return heads[0] if tables.pack == 1 else heads[1]

    def _triton(self, heads: TableKey, tables: Tables, parts: Parts) -> List[Optional[torch.Tensor]]:
        """The Triton-lowered kernel's tables in ``triton_path.table_parts`` order, but ``cu_seqlens_q`` (None: fixed
        within the bucket; a local virtual batch's follow its queries)."""
        lens, table, per = self._pass(heads, parts)
        tiles = triton_schedule(lens, tables.layout, heads[1], per)
        return tiles + [lens, self._cu(per), table.reshape(-1)]

    @staticmethod
    def _cu(per) -> Optional[torch.Tensor]:
        """The query offsets of a pass whose rows' queries vary (a tensor ``per``: the local virtual batch), or
        None."""
        return offsets(per).to(torch.int32) if isinstance(per, torch.Tensor) else None

    def _ragged(self, heads: TableKey, parts: Parts) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(page table, keys, queries per row, the page table's keys) of a pass planned apart from the step's
        sequences: the local virtual batch (``LOCAL_TABLES``) or the encoder tokens (``CROSS_TABLES``)."""
        if key_flags(heads) & LOCAL_TABLES:
            return (*parts.local, self.local_width * self.key.page_size)
        return (*parts.cross, self.key.max_encoder_len)

    def _ragged_mosaic(self, heads: TableKey, tables: Tables, parts: Parts) -> List[torch.Tensor]:
        """The Mosaic kernel's tables of such a pass (``_ragged``): its page table, query offsets and tile table
        (``table_rules.mosaic_tile_table``), and with split-KV the merge's LSE index (``_split``)."""
        table, lens, q, max_keys = self._ragged(heads, parts)
        if tables.num_splits > 1:
            return [table, offsets(q).to(torch.int32), *self._split(heads, tables, parts)]
        cu, info = mosaic_tile_table(lens, q, num_tiles=tables.num_tiles, rows_per_tile=self.rows_per_tile,
                                     pack=tables.pack, config=self.config, max_keys=max_keys)
        return [table, cu, info]

    def write(self, heads: TableKey, tables: Tables, parts: Parts) -> None:
        """The refresh's values into ``tables`` (the copies narrow int64 to the tables' int32)."""
        if tables.layout is not None:
            for dst, src in zip(tables.args, self._triton(heads, tables, parts)):
                if src is not None:
                    dst.copy_(src)
            return
        if key_flags(heads) & (LOCAL_TABLES | CROSS_TABLES):
            for dst, src in zip(tables.args, self._ragged_mosaic(heads, tables, parts)):
                dst.copy_(src)
            return
        tables.args[0].copy_(self._pass(heads, parts)[1])
        if tables.num_splits > 1:
            for dst, src in zip(tables.args[2:], self._split(heads, tables, parts)):
                dst.copy_(src)
            return
        seq, k_len, q_start = self._mosaic(parts)
        info = tables.args[2]
        info[:, SEQ].copy_(seq)
        info[:, K_LEN].copy_(k_len)
        info[:, Q_START].copy_(q_start)
        if heads in self.lse:
            tables.args[3].view(parts.rank.shape[0], -1).copy_(self._lse(heads, parts))

    def matches(self, heads: TableKey, tables: Tables, parts: Parts) -> bool:
        """Whether ``tables`` (the planner's, for the current inputs) hold what a refresh writes (a sync)."""
        b, qpr, flags, dev = self.key.batch_size, self.key.q_len_per_req, key_flags(heads), parts.table.device
        # tables this bucket's refresh writes too
        extra = self.pool_flag | (LOCAL_TABLES if self.chunk else 0) | (CROSS_TABLES if self.enc is not None else 0)
        if tables.layout is not None:  # the Triton-lowered kernel's, of a kind this bucket writes (``extra``)
            lay, (lens, _, per) = tables.layout, self._pass(heads, parts)
            rows = lens.shape[0]
            tokens, q = (self.key.num_tokens, min(self.key.q_len_per_req, self.chunk)) if isinstance(
                per, torch.Tensor) else (rows * per, per)  # (the local virtual batch's: the step's token axis)
            if (len(heads) != 3 or flags & ~extra not in TRITON_FLAGS[self.cascade] or lay.batch != rows
                    or lay.num_tokens != tokens or lay.max_q_len != q):
                return False
            cu = torch.arange(rows + 1, dtype=torch.int32, device=dev) * q  # fixed within the bucket
            return _same(tables.args, [cu if x is None else x for x in self._triton(heads, tables, parts)])
        latent = bool(flags & LATENT_TABLES)  # (an MLA latent cache's tiles: one block of rows each)
        if (flags & ~(LATENT_TABLES | extra) != MOSAIC_FLAGS[self.cascade]  # a kind this bucket does not write
                or (latent and self.cascade) or qpr * tables.pack > tile_rows(self.block_q, latent)):
            return False  # (several row blocks per sequence)
        if flags & (LOCAL_TABLES | CROSS_TABLES):  # the local virtual batch, the encoder tokens
            return not latent and _same(tables.args, self._ragged_mosaic(heads, tables, parts))
        table = self._pass(heads, parts)[1]
        cu = torch.arange(b + 1, dtype=torch.int32, device=dev) * qpr
        if tables.num_splits > 1:  # split-KV: the split schedule's tiles and the merge's LSE index
            return _same(tables.args, [table, cu, *self._split(heads, tables, parts)])
        if tables.num_tiles != b:
            return False
        seq, k_len, q_start = (x.to(torch.int32) for x in self._mosaic(parts))
        info = torch.zeros((b, TILE_INFO_WORDS), dtype=torch.int32, device=dev)
        for name, col in (("seq", seq), ("k_len", k_len), ("q_start", q_start), ("q_len", qpr), ("seq_splits", 1)):
            info[:, TILE_INFO_COLUMNS.index(name)] = col  # first_row and split stay 0: one tile per sequence
        want = [table, cu, info]
        if flags & PREFIX_TABLES:  # ``LsePass``'s index
            h = self._row_heads(heads, tables)
            with torch.inference_mode(False):
                pattern = torch.from_numpy(lse_pattern(qpr, heads[0], h, tables.pack, self.block_q)).to(dev)
            self.lse[heads] = pattern, h * self.rows_per_tile
            want.append(self._lse(heads, parts).reshape(-1))
        return _same(tables.args, want)

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
        if not self.verified:
            return
        cap = capturing()
        state = (self.serial, cap, forward if cap else None)
        if state == self.done:
            return
        parts = self.compute()
        for heads in self.verified:
            self.write(heads, self.step.tables[heads], parts)
        self.done = state
        if cap:
            self.recorded = True

    def load_mask(self, mask: Optional[torch.Tensor]) -> None:
        """Tree verify: SGLang's flat ``custom_mask`` into ``self.mask`` as the planner reads it
        (``dlpack.pack_mask_words``: cut to the buffer, nonzero = True, zeros past it; None: all zeros)."""
        if mask is self.mask:
            return
        n = 0
        if mask is not None:
            m = mask if mask.dim() == 1 else mask.reshape(-1)
            n = min(int(m.shape[0]), self.mask_size)
            self._mask_front.load(m, n)
        if n < self.mask_len:
            self._mask_front.zero(n, self.mask_len)
        self.mask_len = n

    def load_loc(self, loc: Optional[torch.Tensor]) -> None:
        """Tree draft decode: the engine's ``out_cache_loc`` (every draft step's slots) into ``self.loc``, as the
        planner reads it (cut to the bucket, zeros past it; None: all zeros)."""
        if loc is self.loc:
            return
        n = 0
        if loc is not None:
            m = loc.reshape(-1)
            n = min(int(m.shape[0]), int(self.loc.shape[0]))
            self._loc_front.load(m, n)
        self._loc_front.zero(n, int(self.loc.shape[0]))

    def take(self, rows: torch.Tensor, lens: torch.Tensor, mask: Optional[torch.Tensor] = None,
             loc: Optional[torch.Tensor] = None, encoder_lens: Optional[torch.Tensor] = None):
        """The replay hook's inputs for a recorded bucket: SGLang passes the captured tensors themselves;
        other tensors have their values copied into those (the graph reads them); tree verify's ``mask`` is
        copied into ``self.mask``, tree draft decode's ``loc`` into ``self.loc``. Returns the step."""
        n = min(int(rows.shape[0]), int(lens.shape[0]), self.key.batch_size)
        if n > self.n:
            raise ValueError(f"{self.key.mode.name} bucket was captured with {self.n} requests; its replay got {n}")
        inputs = [(rows, self.rows, 0), (lens, self.lens, jbatch.SEQ_LEN_FILL_VALUE)]
        if self.enc is not None:
            if encoder_lens is None:
                raise ValueError(f"{self.key.mode.name} bucket was captured with encoder_lens; pass them")
            inputs.append((encoder_lens, self.enc, 0))
        for src, dst, fill in inputs:
            if src is dst or same_memory(src, dst):
                continue
            m = min(n, dst.shape[0])
            dst[:m].copy_(src[:m])
            if m < dst.shape[0]:
                dst[m:].fill_(fill)
        if self.tree:
            self.load_mask(mask)
        if self.draft:
            self.load_loc(loc)
        self.serial += 1
        self.stale = True
        if n == self.n:
            return self.step
        hit = self.steps.get(n)
        if hit is None:
            per_req = self.key.num_tokens // self.key.batch_size
            hit = self.steps[n] = dataclasses.replace(self.step, real_tokens=n * per_req)
        return hit
