"""Per-layer attention through the Triton-lowered Pallas kernel, launched on torch's stream.

The launch path's second kernel family (``torch_bridge.mosaic_path`` holds the first and the shared
machinery): what the Mosaic kernel does not take (page sizes that are not a multiple of 8, SGLang's
default of 1 among them; head dims it lacks; fp8 pools; absorbed MLA; cross attention
over the encoder tokens; GPUs that are not Hopper) runs ``jax_attn.kernels.triton_paged``'s kernel,
compiled by ``torch_bridge.launcher`` from the same Triton IR that XLA would compile, and launched with
raw pointers on torch's current stream. A layer is then a KV write, an output allocation and one launch
(two with split-KV: the partials, then the merge), and is captured by ``torch.cuda.graph``. A tree
(topk > 1) step's layer is the JAX path's cascade (``TreeCall``): the prefix pass (on Hopper the Mosaic
kernel's, ``mosaic_path.LsePass``, where it covers the pass), the expand pass and ``merge_state``, each
launched the same way; its sliding-window layers are one pass over the tree's SWA table.

Per step a compiled JAX function (the step's planner call) makes the kernel's int32 tables: the work
schedule (``jax_attn.kernels.schedule.plan_schedule``, as the JAX path plans it), the KV lengths, query
offsets and the page table, in one flat array (a split launch's merge reads its query offsets and kv splits
per sequence). Table keys carry ``TRITON_TABLES`` (``mosaic_path.TableKey``).

Dimension legend: T tokens (the step's padded count), Hq / Hkv heads, D / Dv head dims, B sequences,
P page-table width, N work tiles, S kv splits, R = T * Hq output rows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Tuple

import jax
import torch

from jax_attn.kernels.config import DEFAULT_CONFIG
from jax_attn.kernels.merge_state import merge_splits
from jax_attn.kernels.schedule import step_schedule
from jax_attn.kernels.triton_paged import kernel_statics, run_tiles
from torch_bridge.launcher import KernelPlan, TritonModule, jax_dtype

TABLE_PARTS = 7  # tile_seq, tile_q_block, tile_split, seq_num_splits, cache_seqlens, cu_seqlens_q, page_table
SEQ_NUM_SPLITS, CU_SEQLENS_Q = 3, 5  # the parts a split launch's merge reads too

MAX_REGISTERS = 200
"""Registers per thread at most for the decode and speculative verify kernels (at most ``MAX_REGISTERS_Q_LEN``
queries per sequence, 4 warps) that torch's ``triton`` compiles for a launch. XLA's own compile of the same Triton
IR gives the decode tiles 196 registers, two programs per multiprocessor; torch's gave them 166, three per
multiprocessor, and ran slower wherever the last wave of programs is a small one (64 x 4096 at 32/8 heads: 512
programs over 396 slots). Capped at 200, the launched kernel runs as fast as the JAX path's (H200, page 1, one
process, CUPTI time per call, us):

| point | JAX path (XLA's compile) | launched, torch's compile | launched, capped at 200 |
|---|---|---|---|
| decode 64 x 4096 | 242.0 | 278.6 | 244.4 |
| decode 8 x 8192 (split) | 69.2 + 4.4 merge | 75.7 + 4.0 | 69.0 + 4.2 |
| decode 1 x 32768 (split) | 35.7 + 3.0 | 37.4 + 3.1 | 35.8 + 2.2 |
| decode 256 x 1024 | 256.4 | 257.3 | 259.5 |
| verify 32 x 4 on 2048 | 71.4-72.0 | 75.0-75.4 | 73.2 (168: 75.3, 232: 73.3) |
| verify 8 x 4 on 8192 (split) | 70.5-70.8 | 74.7-75.0 | 74.4 |
| tree prefix 16 x 8 on 4096 (split) | 82.3-82.4 | 83.0-83.2 | 82.6 |

The verify tiles' remaining gap to XLA's compile is not residency (no cap from 128 to 232 closes it).
"""

MAX_REGISTERS_Q_LEN = 8
"""Queries per sequence at most of a layout whose kernels ``capped`` compiles under ``MAX_REGISTERS`` (decode and
speculative verify; prefill tiles hold more rows than 200 registers a thread carry without spilling)."""


def schedule(md, heads, deterministic: bool):
    """The work schedule of layers of ``heads`` over plan ``md`` (the one the JAX path's plan carries)."""
    if md.num_tokens <= 0:
        raise ValueError("Triton launch tables need a plan with a static token count (md.num_tokens)")
    return step_schedule(md, num_q_heads=heads[0], num_kv_heads=heads[1], deterministic=deterministic)


def table_parts(md, heads, deterministic: bool) -> list:
    """The kernel's tables for ``md`` (traced), in launch order."""
    sched = schedule(md, heads, deterministic)
    return [sched.tile_seq, sched.tile_q_block, sched.tile_split, sched.seq_num_splits, md.cache_seqlens,
            md.cu_seqlens_q, md.page_table.reshape(-1)]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Static facts of a step's Triton tables (what a layer's kernel is compiled for)."""

    num_tokens: int  # T
    batch: int  # B
    max_pages: int  # P
    max_q_len: int
    block_q: int
    max_splits: int  # S (1: no split, no merge)
    num_tiles: int  # N
    page_size: int
    batch_invariant: bool = False  # deterministic: the kernel's tiles must not depend on the batch either


def layout_of(md, heads, deterministic: bool) -> Layout:
    """The ``Layout`` of the tables of plan ``md`` (host only: shapes and static fields)."""
    sched = jax.eval_shape(lambda m: schedule(m, heads, deterministic), md)
    b, p = md.page_table.shape
    return Layout(md.num_tokens, b, p, md.max_q_len, sched.block_q, sched.max_splits, sched.tile_seq.shape[0],
                  md.page_size, deterministic)


def part_shapes(lay: Layout) -> Tuple[Tuple[int, ...], ...]:
    n, b = lay.num_tiles, lay.batch
    return ((n,), (n,), (n,), (b,), (b,), (b + 1,), (b * lay.max_pages,))


@dataclasses.dataclass(frozen=True)
class Kernels:
    """One layer shape's compiled launches for one ``Layout``: the tiles, and the merge with splits."""

    tiles: Any
    merge: Any  # None without splits


def descales(lp, kv_dtype) -> Tuple[bool, bool]:
    """Whether the kernel takes a K / V descale: an fp8 pool with the layer's scale (the JAX path's rule,
    ``jax_attn.backend.FlashAttentionBackend``: stored values times the scale)."""
    fp8 = jax.numpy.dtype(kv_dtype).itemsize == 1
    return fp8 and lp.k_scale is not None, fp8 and lp.v_scale is not None


def kernel_fns(lp, lay: Layout, dtype, kv_dtype, has_sinks: bool, interpret: bool, prior: int = 0
               ) -> Tuple[Callable, ...]:
    """The JAX functions holding the layer's kernels: ``tiles(*tables, q, k, v, [k_descale], [v_descale],
    [sinks], [prior_lse, [prior_index], o, lse])`` and, with splits, ``merge(partial_o, partial_lse,
    cu_seqlens_q, seq_num_splits)``. ``prior``: the tiles merge a prior partial into their rows
    (``triton_paged._Static.prior``; its output is ``o``'s value before the launch, and the launch writes ``o`` and
    ``lse`` in place)."""
    hq, hkv, d = lp.num_q_heads, lp.num_kv_heads, lp.head_dim
    has_kd, has_vd = descales(lp, kv_dtype)
    dv = lp.v_head_dim or d
    st, knobs = kernel_statics(
        num_tokens=lay.num_tokens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv,
        page_size=lay.page_size, max_pages=lay.max_pages, max_q_len=lay.max_q_len, block_q=lay.block_q,
        max_splits=lay.max_splits, dtype=dtype, kv_dtype=kv_dtype, causal=lp.attends_causally,
        window_size=lp.window_size, softcap=lp.logit_cap, softmax_scale=lp.scaling, has_sinks=has_sinks,
        has_k_descale=has_kd, has_v_descale=has_vd, latent=lp.mla, config=DEFAULT_CONFIG, interpret=interpret,
        prior=prior, batch_invariant=lay.batch_invariant)
    inputs = TABLE_PARTS + 3 + int(has_kd) + int(has_vd) + int(has_sinks) + prior  # prior: 1 or 2 more inputs
    r = lay.num_tokens * hq

    def tiles(*args):
        init = args[inputs:] if prior else None
        return run_tiles(st, lay.num_tiles, lay.max_splits, args[:inputs], dtype, knobs, interpret, init=init)

    if not st.split_mode:
        return (tiles,)

    def merge(partial_o, partial_lse, cu_seqlens_q, seq_num_splits):
        return merge_splits(partial_o.reshape(lay.max_splits, r, dv), partial_lse.reshape(lay.max_splits, r),
                            (cu_seqlens_q, seq_num_splits), num_heads=hq, out_dtype=dtype, config=DEFAULT_CONFIG,
                            interpret=interpret)

    return tiles, merge


def capped(plan, spec):
    """``plan`` (a kernel of ``spec``) compiled under ``MAX_REGISTERS`` when ``spec`` is a decode or verify layout's
    (``MAX_REGISTERS_Q_LEN``) and the kernel runs 4 warps, else as it is."""
    if not (isinstance(plan, KernelPlan) and isinstance(plan.module, TritonModule) and isinstance(spec, Spec)
            and spec.lay.max_q_len <= MAX_REGISTERS_Q_LEN and plan.module.num_warps == 4):
        return plan
    return dataclasses.replace(plan, module=dataclasses.replace(plan.module, max_registers=MAX_REGISTERS))


@dataclasses.dataclass
class CallArgs:
    """A layer's launch arguments over one layout's tables: the kernels' example arguments (``examples``:
    the tiles', then with splits the merge's) and the persistent tensors among them."""

    examples: list
    sinks: Optional[torch.Tensor]  # f32[Hq], written per call from the layer's sinks
    out: torch.Tensor  # [R, Dv]: the tiles' (no split) or the merge's output example
    lse: torch.Tensor  # f32[R] scratch: the bridge returns no LSE
    partial: Optional[Tuple[torch.Tensor, torch.Tensor]]  # f32[S * R, Dv], f32[S * R] (splits)


def call_args(lp, tables, dtype, k_buf: torch.Tensor, v_buf: Optional[torch.Tensor], has_sinks: bool,
              prior: Sequence[torch.Tensor] = ()) -> CallArgs:
    """The launch arguments of layer ``lp`` (pools ``k_buf`` / ``v_buf``) over ``tables``: the tables, an
    example q, the pools' row views, descales, sinks, a prior partial's LSE (and its index: ``prior``) and then
    its output and LSE, written in place; other launches write ``out`` and ``lse`` (or the split partials) as
    their outputs."""
    lay, dev = tables.layout, k_buf.device
    hq, d = lp.num_q_heads, lp.head_dim
    dv = lp.v_head_dim or d
    r = lay.num_tokens * hq
    split = lay.max_splits > 1
    with torch.inference_mode(False):  # persistent: later launches read and write them
        sinks = torch.zeros(hq, dtype=torch.float32, device=dev) if has_sinks else None
        q_ex = torch.zeros(r, d, dtype=dtype, device=dev)
        out = torch.empty(r, dv, dtype=dtype, device=dev)
        lse = torch.empty(r, dtype=torch.float32, device=dev)
        partial = (torch.empty(lay.max_splits * r, dv, dtype=torch.float32, device=dev),
                   torch.empty(lay.max_splits * r, dtype=torch.float32, device=dev)) if split else None
    # an MLA layer's one latent pool: each key row, its first Dv columns the value row
    v_rows = k_buf.view(-1, d) if lp.mla else v_buf.view(-1, dv)
    tile_args = [*tables.args[:TABLE_PARTS], q_ex, k_buf.view(-1, d), v_rows]
    for has, scale in zip(descales(lp, jax_dtype(k_buf.dtype)), (lp.k_scale, lp.v_scale)):
        if has:  # f32[B * Hkv]: the layer's scale for every (sequence, kv head)
            with torch.inference_mode(False):
                tile_args.append(torch.full((lay.batch * lp.num_kv_heads,), scale, dtype=torch.float32, device=dev))
    tile_args += ([sinks] if has_sinks else []) + list(prior)
    examples = [tile_args + ([out, lse] if prior else [])]
    if split:
        examples.append([*partial, tables.args[CU_SEQLENS_Q], tables.args[SEQ_NUM_SPLITS]])
    return CallArgs(examples, sinks, out, lse, partial)


def padded_rows(q: torch.Tensor, t: int, rows: int) -> torch.Tensor:
    """The engine's ``q`` (``t`` tokens of ``Hq * D``, any shape holding them) as a contiguous tensor of the plan
    bucket's ``rows`` tokens, the padding ones zero (their output is dropped): ``q`` itself when it is that
    already. A launch reads only its pointer, so no view to the kernel's shape is made."""
    if t != rows:
        return torch.nn.functional.pad(q.reshape(t, -1), (0, 0, 0, rows - t))
    return q if q.is_contiguous() else q.contiguous()


@dataclasses.dataclass(frozen=True)
class Spec:
    """What one layer shape's kernels over one ``Layout`` compile (``MosaicPath.prebuild`` builds them)."""

    lp: Any
    lay: Layout
    dtype: torch.dtype
    kv_dtype: torch.dtype
    has_sinks: bool
    examples: list = dataclasses.field(compare=False)
    prior: int = 0  # ``kernel_fns``'s: a tree step's expand pass merges the prefix pass's partial

    @property
    def device(self) -> torch.device:
        return self.examples[0][0].device

    def key(self) -> tuple:
        """What the compiled kernels depend on: layers alike (any layer id, any pool) share them."""
        shape = dataclasses.replace(self.lp, layer_id=0, k_scale=None, v_scale=None)
        return (shape, self.lay, self.dtype, self.kv_dtype, self.has_sinks, self.prior,
                tuple(tuple(tuple(a.shape) for a in ex) for ex in self.examples), self.device)

    def fns(self, interpret: bool) -> Tuple[Callable, ...]:
        return kernel_fns(self.lp, self.lay, jax_dtype(self.dtype), jax_dtype(self.kv_dtype), self.has_sinks,
                          interpret, self.prior)


def spec(lp, tables, dtype, k_buf: torch.Tensor, v_buf: Optional[torch.Tensor], has_sinks: bool) -> Spec:
    """The ``Spec`` of layer ``lp`` launched over ``tables``."""
    return Spec(lp, tables.layout, dtype, k_buf.dtype, has_sinks,
                call_args(lp, tables, dtype, k_buf, v_buf, has_sinks).examples)


class LayerCall:
    """One layer's attention for one plan key over Triton tables: the kernels bound to the layer's pools,
    the tables and persistent scratch; a call repoints q and a new output tensor and launches."""

    heads: Optional[Tuple[int, ...]] = None  # the table key it reads (set by ``MosaicPath.layer_call``)

    def __init__(self, path, lp, tables, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, has_sinks: bool,
                 prior: Sequence[torch.Tensor] = ()):
        lay = tables.layout
        self.t, self.rows, self.hq, self.d = int(q.shape[0]), lay.num_tokens, lp.num_q_heads, lp.head_dim
        self.dv, self.dtype, self.device = lp.v_head_dim or lp.head_dim, q.dtype, q.device
        args = call_args(lp, tables, q.dtype, k_buf, v_buf, has_sinks, prior)
        self.sinks, self.out_ex, self.lse, self.q_index = args.sinks, args.out, args.lse, TABLE_PARTS
        # prior: its LSE (kind 1) or its LSE and their row index (kind 2), the kernel's ``prior``
        kernels = path.built(Spec(lp, lay, q.dtype, k_buf.dtype, has_sinks, args.examples, len(prior)))
        if args.partial is not None:
            self.partial_o, self.partial_lse = args.partial
            self.tiles = kernels.tiles.bind(*args.examples[0], out=args.partial)
            self.merge = kernels.merge.bind(*args.examples[1], out=(self.out_ex, self.lse))
            self.out_index = None
        elif prior:  # the tiles write the prior's output and LSE, their last two arguments, in place
            self.tiles = kernels.tiles.bind(*args.examples[0])
            self.merge, self.out_index = None, len(args.examples[0]) - 2
        else:
            self.tiles = kernels.tiles.bind(*args.examples[0], out=(self.out_ex, self.lse))
            self.merge, self.out_index = None, None
        self.tables = tables

    def run(self, q: torch.Tensor, out: torch.Tensor, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The kernel's query rows ``q`` (``padded_rows``: the bytes of ``[R, D]``) into ``out`` (the
        bytes of ``[R, Dv]``, the padding rows' included; their LSE in ``self.lse``). A ``TreeCall``'s passes both
        write the layer's new output."""
        if sinks is not None:
            self.sinks.copy_(sinks)
        self.tiles.set_arg(self.q_index, q)
        if self.out_index is None:  # the output of the last launch
            (self.tiles if self.merge is None else self.merge).set_out(0, out)
        else:
            self.tiles.set_arg(self.out_index, out)
        self.tiles()
        if self.merge is not None:
            self.merge()
        return out

    def __call__(self, q: torch.Tensor, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``q [t, Hq * D]`` -> a new ``[t, Hq * Dv]`` tensor (stream-ordered on torch's current stream)."""
        out = torch.empty(self.rows, self.hq * self.dv, dtype=self.dtype, device=self.device)
        self.run(padded_rows(q, self.t, self.rows), out, sinks)
        return out if self.t == self.rows else out[:self.t]


class TreeCall:
    """One layer's attention in a tree (topk > 1) speculative step, as the JAX path's cascade
    (``jax_attn.spec.cascade_attention``): the prefix pass (the committed KV, non-causal, the layer's sinks) writes
    the output, then the expand pass (each draft token over the draft tokens its tree allows: page size 1, causal,
    one kv split) merges its own partial into it (``triton_paged._Static.prior``: ``merge_state``'s formula in the
    kernel's epilogue, no third launch). The prefix pass is ``prefix``: the Mosaic kernel with its per-tile LSE
    (``mosaic_path.LsePass``) where it covers the pass, else the Triton-lowered kernel (a ``LayerCall``, split-KV
    possible); both passes read one padding of the queries."""

    heads: Optional[Tuple[int, ...]] = None  # the prefix tables' key (set by ``MosaicPath.tree_call``)
    reads: tuple = ()  # (table key, tables) of both passes (set by ``MosaicPath.tree_call``)

    def __init__(self, path, lp, prefix, prefix_tables, expand, q: torch.Tensor, k_buf: torch.Tensor,
                 v_buf: torch.Tensor):
        self.prefix = prefix
        index = getattr(prefix, "lse_index", None)  # the Mosaic pass's LSE is per tile, found through its index
        prior = [prefix.lse] if index is None else [prefix.lse.view(-1), index]
        # sinks count once, in the prefix
        self.expand = LayerCall(path, lp, expand, q, k_buf, v_buf, False, prior=prior)
        if prefix.out_ex.shape != self.expand.out_ex.shape:
            raise RuntimeError(f"tree passes of {tuple(prefix.out_ex.shape)} and {tuple(self.expand.out_ex.shape)} "
                               "output rows: plan one step")
        self.tables, self.t, self.rows = prefix_tables, self.expand.t, self.expand.rows
        self.hq, self.dv, self.dtype, self.device = self.expand.hq, self.expand.dv, q.dtype, q.device

    def __call__(self, q: torch.Tensor, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``q [t, Hq * D]`` -> a new ``[t, Hq * Dv]`` tensor (stream-ordered on torch's current stream): two launches
        (three with a split prefix pass) into it."""
        q = padded_rows(q, self.t, self.rows)  # both passes read the same rows
        out = torch.empty(self.rows, self.hq * self.dv, dtype=self.dtype, device=self.device)
        self.prefix.run(q, out, sinks)
        self.expand.run(q, out)
        return out if self.t == self.rows else out[:self.t]
