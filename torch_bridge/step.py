"""A bridge step's data: the plan's one ``words`` buffer and its layout (``PlanLayout``), the step every
layer reads (``Step``), and the static layout of a planner call's inputs (``Packing``)."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jax_attn import safety
from jax_attn.plan_key import PlanKey
from jax_attn.spec import swa_plan_of
from torch_bridge.mosaic_path import TableKey, Tables


ALIGN_WORDS = 64  # each leaf and table of a plan's words starts 256 bytes in: a jitted layer call hands its static
# slices to kernels as views of the buffer, and the Mosaic GPU kernels take only 256-byte aligned operands


def _aligned(n: int) -> int:
    return -(-n // ALIGN_WORDS) * ALIGN_WORDS


@dataclasses.dataclass(frozen=True)
class PlanLayout:
    """Where a plan's int32 arrays (md.local's and md.swa_page_table too) and launch tables sit in its one
    ``words`` buffer."""

    treedef: Any  # the plan's pytree structure (carries the static fields)
    shapes: Tuple[Tuple[int, ...], ...]  # each leaf's shape, in tree order
    tables: Tuple[Tuple[TableKey, int], ...] = ()  # (table key, words) of each launch table
    spans: Tuple[Tuple[int, int], ...] = ()  # [start, end) of each leaf, then of each table, in words
    local: bool = False  # the plan carries md.local (chunked local layers' virtual batch)
    swa: bool = False  # the plan carries md.swa_page_table (tree steps: md.swa.swa_page_table; SWAKVPool)

    @staticmethod
    def of(plan, tables=()) -> "PlanLayout":
        """The layout of ``plan`` (arrays or their shapes) and ``(table key, flat table)`` pairs."""
        leaves, treedef = jax.tree_util.tree_flatten(plan)
        if any(jnp.dtype(x.dtype) != jnp.int32 for x in leaves):
            raise TypeError("a plan packed into one int32 buffer must hold int32 arrays only")
        shapes = tuple(tuple(x.shape) for x in leaves)
        sized = tuple((heads, int(flat.shape[0])) for heads, flat in tables)
        sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes] + [n for _, n in sized]
        starts = np.cumsum([0] + [_aligned(n) for n in sizes[:-1]])
        return PlanLayout(treedef, shapes, sized, tuple((int(a), int(a) + n) for a, n in zip(starts, sizes)), getattr(
            plan, "local", None) is not None, getattr(swa_plan_of(plan), "swa_page_table", None) is not None)

    @staticmethod
    def pack(plan, tables=()) -> jax.Array:
        """i32[N]: the plan's leaves then the flat tables, each from a 256-byte boundary (traced inside the
        planner call)."""
        parts = [x.reshape(-1).astype(jnp.int32) for x in jax.tree_util.tree_leaves(plan)] + list(tables)
        parts = [jnp.pad(p, (0, _aligned(p.shape[0]) - p.shape[0])) for p in parts[:-1]] + parts[-1:]
        return jnp.concatenate(parts) if parts else jnp.zeros((0,), jnp.int32)

    def unpack(self, words):
        """The plan from its words (static slices: free inside a jitted layer call)."""
        leaves = [words[a:b].reshape(shape) for shape, (a, b) in zip(self.shapes, self.spans)]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def table_range(self, heads: TableKey) -> Optional[Tuple[int, int]]:
        for (h, _), span in zip(self.tables, self.spans[len(self.shapes):]):
            if h == heads:
                return span
        return None


@dataclasses.dataclass(eq=False)
class Step:
    """One step's plan, read by every layer (the interface's one piece of state). Only ``words`` changes
    after it is made: a graph bucket's step whose tables the graph refreshes gets the planner's words
    again when something reads them (``StepPlanner.fresh``)."""

    key: PlanKey
    layout: PlanLayout
    words: jax.Array  # i32[N]: the plan and the launch tables, one device buffer
    real_tokens: int  # tokens the engine passes when it does not pad (replay pads to key.num_tokens)
    loc_steps: int = 1  # draft decode: out_cache_loc may carry num_steps slots per query token
    graph: bool = False  # planned by the capture/replay hooks (kernel tables in persistent buffers)
    tables: Dict[TableKey, Tables] = dataclasses.field(default_factory=dict)  # table key -> tables
    # JAX results torch copies from: kept while the step is current, since JAX may hand a freed buffer to
    # its next computation before torch's queued copy has read it (the next plan's import orders them)
    keep: List[jax.Array] = dataclasses.field(default_factory=list)
    # a graph bucket whose launch tables the engine's graph recomputes (``torch_bridge.graph_tables``)
    refresh: Any = None

    def plan(self):
        return self.layout.unpack(self.words)

    def plan_shapes(self):
        """The plan's structure, static fields and array shapes, with no device work (``plan()`` run eagerly
        compiles a slice per leaf and new shape)."""
        return jax.eval_shape(self.layout.unpack, self.words)


@dataclasses.dataclass(frozen=True)
class Packing:
    """Static layout of one planner call's inputs, and what to plan (the compile-cache key)."""

    key: PlanKey
    num_locs: int  # out_cache_loc entries (tree draft decode: B * topk * num_steps)
    has_ext: bool = False  # extend_seq_lens (extend modes)
    has_enc: bool = False  # encoder_lens (cross attention)
    mask_words: int = 0  # int32 words of the flat verify custom mask (tree verify)
    all_steps: int = 0  # > 0: plan draft steps 0..all_steps-1 at once (multi-step backend)
    exact: bool = False  # eager: extend lengths must add up to the step's real tokens (checked in the plan)
    wide: bool = False  # the inputs are int64 seen as int32 word pairs (narrowed in the planner)
    split: bool = False  # only rows and seq_lens, int64 (a replay of SGLang's static buffers)
    heads: Tuple[TableKey, ...] = ()  # table keys whose launch tables come out of the call
    jax_heads: Optional[Tuple[int, int]] = None  # (Hq, Hkv) of the JAX-path layers: the plan carries their schedules

    @property
    def counted(self) -> bool:
        """An eager extend: its real token count travels as one more input word (``StepPlanner.plan``)."""
        return self.exact and self.has_ext

    def sizes(self) -> Tuple[int, ...]:
        b = self.key.batch_size
        return (b, b, self.num_locs, b * self.has_ext, b * self.has_enc, self.mask_words, int(self.counted))


def narrow(words: jax.Array) -> jax.Array:
    """int64 values seen as little-endian int32 words (``[2 * n]``: pairs) -> i32[n], saturating: a
    value outside int32 becomes INT32_MIN / INT32_MAX, which every range check flags."""
    words = words.reshape(-1, 2)
    low, high = words[:, 0], words[:, 1]
    fits = high == (low >> 31)  # the high word only extends the low word's sign
    return jnp.where(fits, low, jnp.where(high < 0, jnp.int32(safety.INT32_MIN), jnp.int32(safety.INT32_MAX)))


def as_words(t: torch.Tensor) -> torch.Tensor:
    """A 1-D int64 tensor as its int32 words ``[2 * n]`` (a view of a contiguous one: no kernel)."""
    return t.contiguous().view(torch.int32)


def packing(key: PlanKey, loc, ext, enc, words, all_steps: int = 0, exact: bool = False) -> Packing:
    return Packing(key, int(loc.shape[0]), ext is not None, enc is not None,
                   0 if words is None else int(words.shape[0]), all_steps, exact)
