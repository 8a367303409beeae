"""Per-layer attention through the Mosaic GPU kernel, launched on torch's stream (no JAX dispatch).

Once per step a compiled JAX function turns the step's plan into the kernel's int32 tables (page
table, KV lengths, query offsets, work tiles) in one flat array that is exported to torch once.
Per layer, torch writes K/V, and ``torch_bridge.launcher`` launches the kernel on torch's current
stream with raw pointers, reading ``q`` and writing a new output tensor in the engine's layout. A
layer is therefore a KV write, one allocation and one raw launch: it costs a few microseconds of
host time, is ordered with torch work, and is captured by ``torch.cuda.graph``.

Tables are kept per ``TableKey``: a layer shape ``(Hq, Hkv)`` over the step's plan, ``(Hq, Hkv, 1)``
over its chunked local virtual batch (``md.local``: Llama 4 ``use_irope`` layers), or ``(Hq, Hkv, 2)``
over its SWA pool page table (``md.swa_page_table``: sliding-window layers of SGLang's ``SWAKVPool``),
and over a tree step's passes (the flags below). A tree step's prefix pass runs this kernel where it covers
the pass, returning its per-tile LSE for the merge (``LsePass``).

Batch buckets planned by the capture/replay hooks keep their tables in persistent torch buffers
that every replay hook overwrites (or, for uniform and tree verify buckets, the graph itself:
``torch_bridge.graph_tables``),
so a captured graph reads the current step's tables.

Dimension legend: T tokens (the step's padded count), Hq / Hkv heads, D head dim, B sequences,
P page-table width, N work tiles.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Any, Callable, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jax_attn.backend import LayerParams, cross_metadata
from jax_attn.kernel_policy import select_kernel
from jax_attn.plan_key import PlanKey
from jax_attn.kernels.mosaic_kernel import KernelStatics, kernel_call, out_types
from jax_attn.kernels.mosaic_paged import (DEFAULT_MOSAIC_CONFIG, TILE_INFO_WORDS, MosaicConfig, choose_pack,
                                           kernel_statics, plan_mosaic_schedule, schedule_splits)
from jax_attn.kernels.mosaic_split import kernel_call_split, merge_partials, split_out_types
from jax_attn.kernels.schedule import num_splits_for
from torch_bridge import triton_path
from torch_bridge.checks import CheckedLayer, pool_launch_reason
from torch_bridge.dlpack import capturing
from jax_attn.kernels import kernel_cache
from jax_attn.kernels.config import cdiv
from torch_bridge.launcher import TorchKernel, as_structs, compile_for_torch, jax_dtype, plan_kernel

MAX_UNPINNED = 16  # table buffers kept for eager (non-graph) plan keys
PROCESS_LOWERINGS = 4  # Mosaic kernels a prebuild lowers in worker processes, at least
_WORDS = 4  # each table starts 16-byte aligned in the flat array (TMA and the launcher need it)
WARM_UP_MESSAGE = ("torch_bridge: this layer's kernel or step tables are not ready inside a torch.cuda.graph "
                   "capture. Run the bucket's forward once outside the capture first (a warm-up, as SGLang's "
                   "graph runner does): it compiles the kernel and learns the layer shapes the replay hooks "
                   "must prepare.")
# (Hq, Hkv): the Mosaic kernel's tables of the step's plan; (Hq, Hkv, flags): LOCAL_TABLES over md.local,
# SWA_TABLES over md.swa_page_table, CROSS_TABLES over the encoder tokens (``jax_attn.backend.cross_metadata``),
# PREFIX_TABLES / EXPAND_TABLES over a tree step's two passes (``jax_attn.spec.CascadeMetadata``),
# TREE_SWA_TABLES over its SWA table (a sliding-window layer's one pass: committed then draft slots per row; with
# SWA_TABLES, translated into an ``SWAKVPool``'s SWA pool), TRITON_TABLES the Triton-lowered kernel's
# (``torch_bridge.triton_path``), LATENT_TABLES the Mosaic kernel's tiles for an MLA latent cache (every query head
# of a token in the rows, ``KernelStatics.latent``)
TableKey = Tuple[int, ...]
LOCAL_TABLES, SWA_TABLES, TRITON_TABLES, CROSS_TABLES, PREFIX_TABLES, EXPAND_TABLES = 1, 2, 4, 8, 16, 32
TREE_SWA_TABLES, LATENT_TABLES = 64, 128
TREE_TABLES = PREFIX_TABLES | EXPAND_TABLES


def key_flags(key: TableKey) -> int:
    return key[2] if len(key) > 2 else 0


def kernel_outputs(st: KernelStatics, num_tiles: int, interpret=None) -> Callable:
    """The compiled kernel (``interpret``: interpreted, tests) as a function of arrays returning its output
    and, with ``st.return_lse`` (a tree step's prefix pass, ``LsePass``), its per-tile LSE (else scratch the
    compiled kernel owns); the split kernel (``st.split``) returns its partials and their per-tile LSE."""
    if st.split:
        split = kernel_call_split(st, num_tiles, interpret)
        return lambda *args: tuple(split(*args))
    call = kernel_call(st, num_tiles, interpret)
    if st.return_lse:
        return lambda *args: tuple(call(*args))
    return lambda *args: call(*args)[0]


def triton_one_split(key: TableKey, deterministic: bool) -> bool:
    """Whether the Triton-lowered kernel's tables of ``key`` are planned with one kv split per sequence (the
    schedule's ``deterministic``): in deterministic mode, and for a tree step's expand pass (at most its draft
    tokens a row; it merges the prefix pass's partial into its unsplit tiles: ``triton_path.TreeCall``)."""
    return deterministic or bool(key_flags(key) & EXPAND_TABLES)


def table_splits(key: TableKey, deterministic: bool) -> Optional[int]:
    """The ``num_splits`` the Mosaic tables of ``key`` are planned with: the split heuristic (split-KV where
    the unsplit tiles cannot fill the GPU, ``mosaic_paged.plan_mosaic_schedule``), as the JAX API plans its
    steps, but one split in deterministic mode and for a tree step's prefix pass (``LsePass`` merges one
    partial per row)."""
    return 1 if key_flags(key) & PREFIX_TABLES else num_splits_for(deterministic)


def launcher_kernel(st: KernelStatics, num_tiles: int, example: Tuple[torch.Tensor, ...]):
    """The kernel of ``st`` compiled for torch launches: ``kernel(*tensors, out=None, check=True) -> out``."""
    return compile_for_torch(kernel_outputs(st, num_tiles), *example)


@dataclasses.dataclass(frozen=True)
class Tables:
    """The kernel's per-step tables: torch views into one flat int32 tensor."""

    flat: torch.Tensor  # i32[sum of the padded table sizes]
    args: Tuple[torch.Tensor, ...]  # page_table [B, P], cu_seqlens_q [B + 1], tile_info [N, 8] (Triton: its parts)
    pack: int  # rows per query token of the row view
    num_tiles: int  # N
    max_q_len: int  # static bound on queries per sequence (the plan's)
    layout: Optional[triton_path.Layout] = None  # Triton tables' static facts (None: the Mosaic kernel's)
    num_splits: int = 1  # the Mosaic tables' kv splits S (> 1: the split kernel and its merge, ``LayerCall``)

    @property
    def kv_splits(self) -> int:
        """The most kv splits a sequence gets from these tables (either kernel's)."""
        return self.layout.max_splits if self.layout is not None else self.num_splits


def _padded(n: int) -> int:
    return cdiv(n, _WORDS) * _WORDS


def table_key(lp: LayerParams, swa: bool = False, triton: bool = False, tree_pass: int = 0) -> TableKey:
    """Which tables a layer reads: its head counts, whether it runs on the local virtual batch, (``swa``: a
    sliding-window layer of an ``SWAKVPool``) on the SWA pool's page table, (a cross-attention layer) on
    the encoder tokens or (``tree_pass``: ``PREFIX_TABLES``, ``EXPAND_TABLES`` or ``TREE_SWA_TABLES``) on a
    tree step's pass, and which kernel (``triton``: the Triton-lowered one; an MLA layer's Mosaic tiles are the
    latent kernel's) reads them."""
    flags = (LOCAL_TABLES if lp.use_irope else SWA_TABLES if swa else CROSS_TABLES if lp.is_cross_attention else 0)
    flags |= (TRITON_TABLES if triton else LATENT_TABLES if lp.mla else 0) | tree_pass
    return (lp.num_q_heads, lp.num_kv_heads) + ((flags,) if flags else ())


def table_plan(md, key: TableKey):
    """The plan the tables of ``key`` describe: the step's, its local virtual batch, its encoder tokens
    (page size 1, ``cross_metadata``), a tree step's prefix or expand pass or SWA table, or the step's (or
    the tree's SWA table) over the SWA pool's page table."""
    flags = key_flags(key)
    if not flags & (LOCAL_TABLES | SWA_TABLES | CROSS_TABLES | TREE_TABLES | TREE_SWA_TABLES):
        return md
    if flags & TREE_SWA_TABLES:  # a tree step's sliding-window layers: one pass over its SWA table
        if md.swa is None:
            raise ValueError("tree SWA tables of a plan without md.swa (plan with model_runner.sliding_window_size)")
        md = md.swa
        if not flags & SWA_TABLES:
            return md
    elif flags & TREE_TABLES:
        return md.prefix if flags & PREFIX_TABLES else md.expand
    if flags & LOCAL_TABLES:
        return md.local
    if flags & CROSS_TABLES:
        if md.encoder is None:
            raise ValueError("cross-attention tables of a plan without md.encoder (no encoder_lens)")
        return cross_metadata(md)
    if md.swa_page_table is None:
        raise ValueError("SWA pool tables of a plan without md.swa_page_table (not an SWAKVPool step)")
    return dataclasses.replace(md, page_table=md.swa_page_table, swa_page_table=None)


def flatten_tables(md, key: TableKey, config: Optional[MosaicConfig] = None, deterministic: bool = False):
    """The kernel's tables of step plan ``md`` for ``key`` as one i32 array (traced: inside the step's
    planner call, or alone for a table key the planner did not know yet)."""
    config = DEFAULT_MOSAIC_CONFIG if config is None else config
    md = table_plan(md, key)
    if key_flags(key) & TRITON_TABLES:
        parts = triton_path.table_parts(md, key[:2], triton_one_split(key, deterministic))
    else:  # a tree step's prefix pass and split tables carry where the kernel puts each row's LSE for the merge
        lse = bool(key_flags(key) & PREFIX_TABLES)
        sched = plan_mosaic_schedule(md, num_q_heads=key[0], num_kv_heads=key[1], config=config, with_lse=lse,
                                     latent=bool(key_flags(key) & LATENT_TABLES),
                                     num_splits=table_splits(key, deterministic))
        parts = [md.page_table, md.cu_seqlens_q, sched.tile_info]
        parts += [sched.lse_index] if sched.lse_index is not None else []
    flat = [jnp.pad(p.reshape(-1).astype(jnp.int32), (0, _padded(p.size) - p.size)) for p in parts]
    return jnp.concatenate(flat)


class MosaicPath:
    """Runs a layer's attention from torch with the Mosaic kernel, or with the Triton-lowered kernel
    (``torch_bridge.triton_path``) where the policy picks that (see the module docstrings).

    Args:
      make_kernel: ``make_kernel(statics, num_tiles, example_tensors)`` returns a kernel for
        ``mosaic_kernel.kernel_call`` with ``kernel.bind(*tensors, out=buffer)`` -> a callable that
        launches it on those tensors; default ``launcher_kernel`` (``torch_bridge.launcher``,
        compiled, launched on torch's current stream). Tests pass an interpreting one.
      config: the kernel's ``MosaicConfig``.
      make_triton: ``make_triton(fns_of, examples)`` -> ``triton_path.Kernels`` from the layer's kernel
        functions (``fns_of(interpret)``) and example arguments; default: compiled for torch launches.
      hopper: whether the Mosaic kernel can run here (else only the Triton-lowered kernel launches).
      triton: whether the Triton-lowered kernel launches here; default: when compiled (no ``make_kernel``)
        or given ``make_triton`` (a path with only an interpreting Mosaic kernel sends those layers to JAX).
    """

    def __init__(self, make_kernel: Optional[Callable] = None, config: MosaicConfig = DEFAULT_MOSAIC_CONFIG,
                 make_triton: Optional[Callable] = None, hopper: bool = True, triton: Optional[bool] = None):
        self._make_kernel = make_kernel or launcher_kernel
        self._make_triton = make_triton
        self.config, self.hopper = config, hopper
        self.triton = (make_kernel is None or make_triton is not None) if triton is None else triton
        self.deterministic = False  # Triton tables: one kv split per sequence (the backend sets it)
        self._kernels: Dict[tuple, Any] = {}
        self._table_fns: Dict[tuple, Any] = {}
        self._persistent: Dict[tuple, Tables] = {}  # insertion order = least recently planned first
        self._pinned: set = set()
        self._calls: Dict[tuple, Any] = {}
        self._scratch: Dict[tuple, torch.Tensor] = {}
        self.recipes: Dict[Recipe, Recipe] = {}  # layers seen on the launch path (``prebuild``), first seen first

    @staticmethod
    def for_device(device: torch.device, impl: str) -> Optional["MosaicPath"]:
        """A path for CUDA devices that Triton supports (sm80+) when ``impl`` allows a launched kernel (the
        Mosaic kernel on Hopper only), else None."""
        if device.type != "cuda" or impl not in ("auto", "mosaic", "triton") or not torch.cuda.is_available():
            return None
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 0):
            return None
        return MosaicPath(hopper=capability == (9, 0))

    def scratch(self, shape: Tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer that every layer call of this shape launched on the current stream shares (the split
        kernel's partials and LSE: each layer's merge reads them right after its kernel wrote them, in stream
        order, so layers in turn, captured or not, never see another's)."""
        stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (tuple(shape), dtype, device, stream)
        buf = self._scratch.get(key)
        if buf is None:
            with torch.inference_mode(False):
                buf = self._scratch[key] = torch.empty(shape, dtype=dtype, device=device)
        return buf

    def launches_trees(self, impl: str) -> bool:
        """Whether tree (topk > 1) steps' layers launch here under ``impl``: the Triton-lowered kernel runs
        their passes and merge (``triton_path.TreeCall``), so this path must build it and ``impl`` allow it."""
        return self.triton and impl in ("auto", "triton")

    def kernel_for(self, impl: str, call) -> Optional[str]:
        """The kernel this path launches for ``call`` (a ``kernel_policy.Call``): ``"mosaic"`` or ``"triton"``,
        or None when the call goes through a JAX executable."""
        kernel = select_kernel(impl, call, from_torch=True, hopper=self.hopper)
        return kernel if kernel == "mosaic" or (kernel == "triton" and self.triton) else None

    def reason(self, lp: LayerParams, key: PlanKey, q: Optional[torch.Tensor], k_buf: torch.Tensor,
               v_buf: Optional[torch.Tensor]) -> Optional[str]:
        """None when this layer's call can be launched from torch, else why not. What the kernel
        itself covers is the policy's question (``jax_attn.kernel_policy.select_kernel``)."""
        if key.topk > 1 and lp.use_irope:
            return "chunked local layers in a tree (topk > 1) step run through JAX"
        return pool_launch_reason(k_buf, v_buf)

    # ---- per step ---------------------------------------------------------------------------
    def tables(self, step, heads: TableKey, flat: Optional[torch.Tensor] = None) -> Tables:
        """The step's tables for layers of ``heads`` (a ``TableKey``): one copy of ``flat`` (the step
        planner's call made them and exported its buffer), else one JAX call and one export first.

        They go into a persistent buffer per (plan key, heads), so a captured graph and the bound
        launches of every layer keep reading the current step's values. Graph buckets' buffers
        (``step.graph``) stay; at most ``MAX_UNPINNED`` others (eager plans) are kept, oldest first.
        """
        if flat is None:
            fn_key = (step.layout, heads)
            fn = self._table_fns.get(fn_key)
            if fn is None:
                def flat_fn(words):
                    return flatten_tables(step.layout.unpack(words), heads, self.config, self.deterministic)
                fn = self._table_fns[fn_key] = jax.jit(flat_fn)
            result = fn(step.words)
            step.keep.append(result)
            flat = torch.from_dlpack(result)  # torch's current stream waits for the JAX result
        buf_key = (step.key, heads)
        if step.graph:  # graph buckets' buffers stay (pinned), in no order
            hit = self._persistent.get(buf_key)
            if hit is not None:
                self._pinned.add(buf_key)  # made by an eager step of the same key
        else:
            hit = self._persistent.pop(buf_key, None)
            if hit is not None:
                self._persistent[buf_key] = hit  # most recent last
        if hit is None:
            with torch.inference_mode(False):  # a normal tensor: later steps update it in place
                buf = torch.empty_like(flat)
            hit = self._persistent[buf_key] = self._views(buf, table_plan(step.plan_shapes(), heads), heads)
            if step.graph:
                self._pinned.add(buf_key)
            self._evict()  # only a new buffer can take the unpinned ones over the bound
        hit.flat.copy_(flat)
        return hit

    def _evict(self) -> None:
        unpinned = [k for k in self._persistent if k not in self._pinned]
        for k in unpinned[:max(0, len(unpinned) - MAX_UNPINNED)]:
            gone = self._persistent.pop(k)
            self._calls = {ck: c for ck, c in self._calls.items() if all(t is not gone for _, t in reads(c))}

    def _views(self, flat: torch.Tensor, md, heads: TableKey) -> Tables:
        if key_flags(heads) & TRITON_TABLES:
            lay = triton_path.layout_of(md, heads[:2], triton_one_split(heads, self.deterministic))
            return Tables(flat, self._cut(flat, triton_path.part_shapes(lay)), 1, lay.num_tiles,
                          md.max_q_len, lay)
        b, p = md.page_table.shape
        latent = bool(key_flags(heads) & LATENT_TABLES)
        pack = choose_pack(md, heads[0], heads[1], self.config, latent)
        s = schedule_splits(md, num_q_heads=heads[0], num_kv_heads=heads[1], config=self.config, latent=latent,
                            num_splits=table_splits(heads, self.deterministic))
        rows = md.num_tokens * heads[0]
        # the LSE index: ``LsePass``'s (one split), the merge's with splits
        lse = (s, rows) if s > 1 else (rows,) if key_flags(heads) & PREFIX_TABLES else None
        num_tiles = (flat.shape[0] - _padded(b * p) - _padded(b + 1) - (_padded(int(np.prod(lse))) if lse else 0)) \
            // TILE_INFO_WORDS
        shapes = ((b, p), (b + 1,), (num_tiles, TILE_INFO_WORDS)) + ((lse,) if lse else ())
        return Tables(flat, self._cut(flat, shapes), pack, num_tiles, md.max_q_len, num_splits=s)

    @staticmethod
    def _cut(flat: torch.Tensor, shapes) -> Tuple[torch.Tensor, ...]:
        """Views of ``flat`` in ``shapes``, each starting on a 16-byte boundary."""
        views, off = [], 0
        for shape in shapes:
            n = int(np.prod(shape))
            views.append(flat[off:off + n].view(shape))
            off += _padded(n)
        if off != flat.shape[0]:
            raise RuntimeError(f"table layout mismatch ({off} != {flat.shape[0]}): shapes {shapes}")
        return tuple(views)

    # ---- per layer ---------------------------------------------------------------------------
    def layer_call(self, lp: LayerParams, key: PlanKey, tables: Tables, q: torch.Tensor, k_buf: torch.Tensor,
                   v_buf: torch.Tensor, has_sinks: bool, heads: Optional[TableKey] = None,
                   on_new: Optional[Callable[["Recipe", Tables], Any]] = None) -> Any:
        """The bound launch of one layer for this plan key (built on first use, then reused). ``heads``:
        the layer's ``TableKey``; the layer is then remembered for ``prebuild``, and ``on_new`` is called
        with it and ``tables`` when it is new, before its kernel is built (``torch_bridge.warmup``)."""
        ck = (lp, key, id(tables), q.shape[0], q.dtype, k_buf.data_ptr(), v_buf is None or v_buf.data_ptr(),
              has_sinks)
        call = self._calls.get(ck)
        if call is None:
            if capturing():
                raise RuntimeError(WARM_UP_MESSAGE)
            if heads is not None:
                recipe = self.recipe(lp, key, heads, q.dtype, k_buf, v_buf, has_sinks)
                if recipe not in self.recipes:
                    self.recipes[recipe] = recipe
                    if on_new is not None:
                        on_new(recipe, tables)
                self._build_alike(recipe, key, tables)
            if tables.layout is not None:  # the Triton-lowered kernel
                call = triton_path.LayerCall(self, lp, tables, q, k_buf, v_buf, has_sinks)
            else:
                call = LayerCall(self, lp, key, tables, q, k_buf, v_buf, has_sinks)
            self._calls[ck] = call
            call.heads = heads
        return call

    @staticmethod
    def recipe(lp: LayerParams, key: PlanKey, heads: TableKey, dtype: torch.dtype, k_buf: torch.Tensor,
               v_buf: Optional[torch.Tensor], has_sinks: bool) -> "Recipe":
        """A layer's ``Recipe`` in steps like ``key`` (``dtype``: its queries')."""
        return Recipe(dataclasses.replace(lp, layer_id=0), heads, key.mode, key.q_len_per_req, dtype, k_buf.device,
                      has_sinks, k_buf, v_buf)

    def tree_call(self, lp: LayerParams, key: PlanKey, prefix: Tables, expand: Tables, q: torch.Tensor,
                  k_buf: torch.Tensor, v_buf: torch.Tensor, has_sinks: bool, heads: Tuple[TableKey, TableKey]) -> Any:
        """The bound launches of one layer in a tree (topk > 1) step of this plan key: its prefix pass over
        ``prefix``, its expand pass over ``expand`` and their merge (``triton_path.TreeCall``; built on first
        use, then reused). ``heads``: the two tables' keys."""
        ck = (lp, key, id(prefix), id(expand), q.shape[0], q.dtype, k_buf.data_ptr(),
              v_buf is None or v_buf.data_ptr(), has_sinks)
        call = self._calls.get(ck)
        if call is None:
            if capturing():
                raise RuntimeError(WARM_UP_MESSAGE)
            first_lp = dataclasses.replace(lp, causal=False)  # the committed keys: every draft token sees them all
            first: Any
            if prefix.layout is None:  # Mosaic tables: the Mosaic kernel, with its LSE for the merge
                first = LsePass(self, first_lp, key, prefix, q, k_buf, v_buf, has_sinks)
            else:
                first = triton_path.LayerCall(self, first_lp, prefix, q, k_buf, v_buf, has_sinks)
            call = self._calls[ck] = triton_path.TreeCall(self, lp, first, prefix, expand, q, k_buf, v_buf)
            call.heads, call.reads = heads[0], ((heads[0], prefix), (heads[1], expand))
        return call

    def _build_alike(self, recipe: "Recipe", key: PlanKey, tables: Tables) -> None:
        """A layer's first call over ``tables``: when its kernels are not built, build those of every layer
        shape seen in steps like ``key`` over the same tables at once (a new shape class of an eager step
        then costs one round of parallel builds, not one build per layer shape in turn)."""
        others = [r for r in self.recipes_for(key.mode, key.q_len_per_req) if r.heads == recipe.heads and r != recipe]
        if not others:
            return
        own = recipe.spec(self.config, key, tables)
        if self.spec_key(own) not in self._kernels:
            self.prebuild([own] + [r.spec(self.config, key, tables) for r in others])

    @staticmethod
    def spec_key(spec) -> tuple:
        """What a ``LaunchSpec``'s kernel or a ``triton_path.Spec``'s kernels depend on (shared by layers alike)."""
        if not isinstance(spec, LaunchSpec):  # triton_path.Spec, SplitMergeSpec
            return spec.key()
        return (spec.statics, spec.num_tiles, tuple(tuple(a.shape) for a in spec.args), spec.device)

    def built(self, spec) -> Any:
        """The compiled kernel of a ``LaunchSpec`` (the Mosaic kernel), or the ``triton_path.Kernels`` of a
        ``triton_path.Spec`` (the tiles and, with splits, the merge, compiled at once) or ``SplitMergeSpec``:
        built on first use (``prebuild``), shared by layers alike."""
        self.prebuild([spec])
        return self._kernels[self.spec_key(spec)]

    def recipes_for(self, mode, q_len_per_req: int) -> list:
        """The layers seen on the launch path in steps of this mode and queries per request."""
        return [r for r in self.recipes.values() if r.mode == mode and r.q_len_per_req == q_len_per_req]

    def prebuild(self, specs) -> int:
        """Build the kernels of these specs (``LaunchSpec`` s of the Mosaic kernel, ``triton_path.Spec`` s of the
        Triton-lowered one) that are not built yet, all at once: the Python lowerings here (those of four or
        more Mosaic kernels in parallel processes, ``kernel_cache.prebuild``), the GPU code in one thread per
        core (the CUDA plugin's compile and Triton's run mostly outside the GIL). Returns how many specs were
        built. A test's ``make_kernel`` / ``make_triton`` builds them one by one."""
        todo: Dict[tuple, Any] = {}
        for spec in [m for s in specs for m in (s, getattr(s, "merge", None)) if m is not None]:
            ck = self.spec_key(spec)
            if ck not in self._kernels:
                todo.setdefault(ck, spec)
        mosaic = {ck: s for ck, s in todo.items() if isinstance(s, LaunchSpec)}
        triton = {ck: s for ck, s in todo.items() if not isinstance(s, LaunchSpec)}
        if self._make_kernel is not launcher_kernel:
            for ck, spec in mosaic.items():
                self._kernels[ck] = self._make_kernel(spec.statics, spec.num_tiles, spec.args)
            mosaic = {}
        if self._make_triton is not None:
            for ck, spec in triton.items():
                self._kernels[ck] = self._make_triton(spec.fns, spec.examples)
            triton = {}
        plans: Dict[tuple, list] = {}  # the lowered kernels of each spec
        if mosaic:
            fns = {ck: kernel_outputs(spec.statics, spec.num_tiles) for ck, spec in mosaic.items()}
            structs = {ck: as_structs(spec.args) for ck, spec in mosaic.items()}
            if len(mosaic) >= PROCESS_LOWERINGS:  # fewer: a worker's start-up costs about what it saves
                kernel_cache.prebuild([k for ck in mosaic for k in kernel_cache.kernels_in(
                    jax.make_jaxpr(fns[ck])(*structs[ck]).jaxpr)])
            for ck, spec in mosaic.items():  # the lowering reuses the processes' builds
                plans[ck] = [plan_kernel(fns[ck], *structs[ck])]
        for ck, spec in triton.items():
            plans[ck] = [triton_path.capped(plan_kernel(fn, *as_structs(ex)), spec)
                         for fn, ex in zip(spec.fns(False), spec.examples)]
        jobs = [(ck, i, plan, todo[ck].device) for ck, ps in plans.items() for i, plan in enumerate(ps)]
        built: Dict[tuple, Any] = {}
        if jobs:
            with concurrent.futures.ThreadPoolExecutor(max(1, min(len(jobs), os.cpu_count() or 1))) as pool:
                futures = [(ck, i, plan, dev, pool.submit(TorchKernel, plan, dev)) for ck, i, plan, dev in jobs]
                for ck, i, plan, dev, future in futures:
                    try:
                        built[ck, i] = future.result()
                    except RuntimeError:  # a compile that failed in a thread gets one more try here, alone
                        built[ck, i] = TorchKernel(plan, dev)
        for ck in mosaic:
            self._kernels[ck] = built[ck, 0]
        for ck in triton:
            self._kernels[ck] = triton_path.Kernels(built[ck, 0], built.get((ck, 1)))
        return len(todo)


@dataclasses.dataclass(frozen=True)
class LaunchSpec:
    """What one layer's launch for one plan key compiles and binds."""

    statics: KernelStatics
    num_tiles: int
    q_shape: Tuple[int, ...]  # the kernel's q: [R, Hq, D], or [R, Hkv, G, D] with packed rows (R: the key's tokens)
    out_shape: Tuple[int, ...]
    args: Tuple[torch.Tensor, ...]  # examples: q, k / v pages, the tables, sinks (the call's own sinks buffer)
    out: torch.Tensor  # example output (the split kernel: its float32 partials)
    lse: Optional[torch.Tensor] = None  # example per-tile LSE (``statics.return_lse``: a tree's prefix pass, splits)
    merge: Optional["SplitMergeSpec"] = None  # the split kernel's merge (``statics.split``)

    @property
    def device(self) -> torch.device:
        return self.args[0].device


@dataclasses.dataclass(frozen=True)
class SplitMergeSpec:
    """What the merge of the split kernel's partials compiles (``mosaic_split.merge_partials``: the
    Triton-lowered ``merge_splits``; ``MosaicPath.prebuild`` builds it as ``triton_path.Kernels.tiles``)."""

    out_dtype: torch.dtype
    examples: list = dataclasses.field(compare=False)  # [[partials, per-tile LSE, LSE index i32[S, T * Hq]]]

    @property
    def device(self) -> torch.device:
        return self.examples[0][0].device

    @property
    def out_shape(self) -> Tuple[int, ...]:
        """The merged output's shape, ``[T, Hq, Dv]`` (a latent cache's: ``[T * Hq, 1, Dv]``)."""
        shape = tuple(self.examples[0][0].shape)
        return (shape[1], int(np.prod(shape[2:-1])), shape[-1])

    def key(self) -> tuple:
        return ("merge_splits",) + tuple(tuple(a.shape) for a in self.examples[0]) + (self.out_dtype, self.device)

    def fns(self, interpret: bool) -> Tuple[Callable, ...]:
        dtype = jax_dtype(self.out_dtype)
        return (lambda part, lse, index: merge_partials(part, lse, index, out_dtype=dtype, interpret=interpret),)


def launch_spec(config: MosaicConfig, lp: LayerParams, key: PlanKey, tables: Tables, dtype: torch.dtype,
                device: torch.device, k_buf: torch.Tensor, v_buf: torch.Tensor, has_sinks: bool,
                return_lse: bool = False, scratch: Optional[Callable] = None) -> LaunchSpec:
    """The kernel statics and example arguments of ``lp`` launched over ``tables`` (a step of ``key``;
    ``return_lse``: the kernel returns its per-tile LSE too). Split tables (``Tables.num_splits > 1``): the
    split kernel, whose partials and per-tile LSE come from ``scratch(shape, dtype, device)`` (default: new
    tensors), and its merge."""
    hq, hkv, d = lp.num_q_heads, lp.num_kv_heads, lp.head_dim
    dv, g, rows = lp.v_head_dim or d, tables.pack, key.num_tokens
    q_shape = (rows, hkv, g, d) if g > 1 else (rows, hq, d)
    out_shape = (rows, hkv, g, dv) if g > 1 else (rows, hq, dv)
    if lp.mla:  # a latent cache: q's rows as they are (``mosaic_paged.pack_rows``), the values in the key rows
        q_shape, out_shape, v_buf = (rows * hq, 1, d), (rows * hq, 1, dv), k_buf
    with torch.inference_mode(False):
        sinks = torch.zeros(hq, dtype=torch.float32, device=device)  # packed rows read their group's
    st = kernel_statics(
        num_tokens=rows, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv,
        page_size=key.page_size, pack=g, dtype=jax_dtype(dtype),
        causal=lp.attends_causally, window_size=lp.window_size, softcap=lp.logit_cap, softmax_scale=lp.scaling,
        has_sinks=has_sinks, return_lse=return_lse, config=config, max_q_len=tables.max_q_len,
        latent=dv if lp.mla else 0, num_splits=tables.num_splits)
    # (the tables' fourth part, a prefix pass's LSE index, is not a kernel argument)
    args = (torch.empty(q_shape, dtype=dtype, device=device), k_buf.view(-1, key.page_size, hkv, d),
            v_buf.view(-1, key.page_size, hkv, d if lp.mla else dv), *tables.args[:3], sinks)
    with torch.inference_mode(False):  # persistent results (``LsePass``, split partials): normal tensors
        if st.split:
            make = scratch or (lambda shape, dt, dev: torch.empty(shape, dtype=dt, device=dev))
            part, lse = (make(tuple(o.shape), torch.float32, device) for o in split_out_types(st, tables.num_tiles))
            merge = SplitMergeSpec(dtype, [[part, lse, tables.args[3]]])
            return LaunchSpec(st, tables.num_tiles, q_shape, merge.out_shape, args, part, lse, merge)
        lse = torch.empty(out_types(st, tables.num_tiles)[1].shape, dtype=torch.float32, device=device) \
            if return_lse else None
        return LaunchSpec(st, tables.num_tiles, q_shape, out_shape, args,
                          torch.empty(out_shape, dtype=dtype, device=device), lse)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """A layer seen on the launch path, enough to build its kernel for another plan key ahead of time."""

    lp: LayerParams
    heads: TableKey
    mode: Any  # the plan key's mode and queries per request: kernels are prebuilt for keys alike
    q_len_per_req: int
    dtype: torch.dtype
    device: torch.device
    has_sinks: bool
    # the first such layer's pool buffers (not compared: layers alike share a kernel whatever their pools)
    k_buf: torch.Tensor = dataclasses.field(compare=False)
    v_buf: torch.Tensor = dataclasses.field(compare=False)

    def spec(self, config: MosaicConfig, key: PlanKey, tables: Tables):
        """The launch of this layer over ``tables`` (a step of ``key``): a ``LaunchSpec``, or over Triton
        tables a ``triton_path.Spec``."""
        if tables.layout is not None:
            return triton_path.spec(self.lp, tables, self.dtype, self.k_buf, self.v_buf, self.has_sinks)
        return launch_spec(config, self.lp, key, tables, self.dtype, self.device, self.k_buf, self.v_buf,
                           self.has_sinks)


class LayerCall:
    """One layer's attention for one plan key: the kernel bound to the layer's pools and the key's
    tables; a call repoints q and a new output tensor and launches.

    The kernel reads q and writes the output in the engine's ``[T, Hq, D]`` layout (packed decode
    rows use its free view ``[T, Hkv, G, D]``), so a call is one allocation plus one launch (and
    a pad when the engine passes fewer tokens than the plan's bucket).
    """

    heads: Optional[TableKey] = None  # the table key it reads (set by ``MosaicPath.layer_call``)

    def __init__(self, path: MosaicPath, lp: LayerParams, key: PlanKey, tables: Tables, q: torch.Tensor,
                 k_buf: torch.Tensor, v_buf: torch.Tensor, has_sinks: bool):
        spec = launch_spec(path.config, lp, key, tables, q.dtype, q.device, k_buf, v_buf, has_sinks,
                           scratch=path.scratch)
        self.tables, self.t, self.rows = tables, int(q.shape[0]), key.num_tokens
        self.flat_out = (self.rows, lp.num_q_heads * (lp.v_head_dim or lp.head_dim))
        self.dtype, self.device, self.sinks = q.dtype, q.device, spec.args[-1]
        # split-KV: the kernel writes the (shared) partials, the merge reads them into the output
        self.launch = path.built(spec).bind(*spec.args, out=spec.out if spec.merge is None else (spec.out, spec.lse))
        self.merge = None
        if spec.merge is not None:
            lse = path.scratch((spec.out_shape[0], spec.out_shape[1]), torch.float32, q.device)  # not returned
            self.merge = path.built(spec.merge).tiles.bind(*spec.merge.examples[0], out=(
                torch.empty(spec.out_shape, dtype=q.dtype, device=q.device), lse))

    def __call__(self, q: torch.Tensor, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``q [t, Hq * D]`` -> a new ``[t, Hq * Dv]`` tensor (stream-ordered on torch's current stream)."""
        q = triton_path.padded_rows(q, self.t, self.rows)
        out = torch.empty(self.flat_out, dtype=self.dtype, device=self.device)  # the kernel's out_shape, flat
        if sinks is not None:
            self.sinks.copy_(sinks)
        self.launch.set_arg(0, q)  # a launch reads pointers: any contiguous tensor of the rows' bytes
        if self.merge is None:
            self.launch.set_out(0, out)
            self.launch()
        else:
            self.launch()
            self.merge.set_out(0, out)
            self.merge()
        return out if self.t == self.rows else out[:self.t]


class LsePass:
    """A tree (topk > 1) step's prefix pass on the Mosaic kernel (``triton_path.TreeCall``): the kernel bound to
    the layer's pools and the pass's tables, writing its output where told and its per-tile LSE into a persistent
    buffer the expand pass reads; ``lse_index`` (in the tables) says where each (token, query head) row's LSE
    is."""

    def __init__(self, path: MosaicPath, lp: LayerParams, key: PlanKey, tables: Tables, q: torch.Tensor,
                 k_buf: torch.Tensor, v_buf: torch.Tensor, has_sinks: bool):
        spec = launch_spec(path.config, lp, key, tables, q.dtype, q.device, k_buf, v_buf, has_sinks, return_lse=True)
        self.sinks, self.lse_index = spec.args[-1], tables.args[3]
        self.out_ex = spec.out.view(-1, lp.v_head_dim or lp.head_dim)  # [R * Hq, Dv], token-major
        self.lse = spec.lse
        self.launch = path.built(spec).bind(*spec.args, out=(spec.out, spec.lse))

    def run(self, q: torch.Tensor, out: torch.Tensor, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The pass over the query rows ``q`` (``triton_path.padded_rows``: the bytes of ``[R * Hq, D]``) into
        ``out`` (the bytes of ``[R * Hq, Dv]``) and ``lse``."""
        if sinks is not None:
            self.sinks.copy_(sinks)
        self.launch.set_arg(0, q)
        self.launch.set_out(0, out)
        self.launch()
        return out


def reads(call, default_heads: Optional[TableKey] = None) -> Tuple[Tuple[Optional[TableKey], Tables], ...]:
    """``(table key, tables)`` of every table set a bound call reads (a tree step's call: two)."""
    return getattr(call, "reads", None) or ((call.heads or default_heads, call.tables),)


class LayerHit(CheckedLayer):
    """A layer checked once on the launch path. A later call with the same layer object, pool and
    buffers, token count and plan tables (so the same plan key) skips the checks: KV write, then
    the bound launch."""

    reads_plan = False  # the launch reads the step's tables, not its plan words

    def __init__(self, layer, lp: LayerParams, call: Any, pool, buffers, no_sinks: bool, swa: bool = False):
        super().__init__(layer, lp, call.t, pool, buffers, swa)
        self.call, self.no_sinks, self.dtype = call, no_sinks, call.dtype
        self.reads = reads(call, table_key(lp, swa))  # the tables the call reads, by key

    def matches(self, layer, step, q, forward_batch, sinks) -> bool:
        # q's dtype too: the kernel was compiled for it, and a launch reads only q's pointer
        if q.dtype is not self.dtype or (sinks is None) != self.no_sinks:
            return False
        tables = step.tables
        for h, t in self.reads:
            if tables.get(h) is not t:
                return False
        return self.same(layer, q, forward_batch)

    def __call__(self, q, k, v, loc, sinks, step=None):
        """The KV write, then the launch (over the step tables it was bound to: ``step`` is not read)."""
        self.write(k, v, loc)
        return self.call(q, sinks)
