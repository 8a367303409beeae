"""The bridge's layer runner: SGLang's per-layer ``forward`` over the current ``Step``.

A layer call never plans: it reads the step the step planner installed. Its trip is

* launch path (a CUDA GPU, and the Mosaic kernel on Hopper or else the Triton-lowered kernel covers
  the layer): torch KV write, one raw launch on torch's stream (two for a split-KV Triton call:
  ``torch_bridge.mosaic_path``, ``torch_bridge.triton_path``); a layer seen before with the same step
  tables and buffers skips every check (``LayerHit``);
* otherwise: torch KV write, then one compiled JAX executable (import q, call, export out); a layer
  seen before with the same pool buffers, token count and plan layout skips every check too
  (``JaxLayerHit``), and reads the current step's plan.

Both write K/V only after every check passed, at slots made safe once per forward (``SafeLocs``).
SGLang's hybrid ``SWAKVPool``: a sliding-window layer (``is_swa_layer``) reads its SWA pool through the
plan's ``md.swa_page_table`` (launch path: the ``TableKey`` ``(Hq, Hkv, 2)`` tables) and writes through
the pool's ``set_kv_buffer``, which translates the slots; slots whose translation leaves the SWA pool
go to slot 0 first.
A chunked local layer (Llama 4 ``use_irope`` in a local-attention model) takes the same trip over the
step's local virtual batch (``md.local``): the executable attends it, the launch path reads its own
tables (``mosaic_path.TableKey`` ``(Hq, Hkv, 1)``).
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import jax
import numpy as np
import torch

from jax_attn.backend import FlashAttentionBackend as JaxBackend
from jax_attn.backend import LayerParams
from jax_attn.kernel_policy import Call
from jax_attn.kernels.config import tracing_for_cpu
from jax_attn.kv_cache import KVPool
from torch_bridge.checks import (CheckedLayer, SafeLocs, check_layer, check_shapes, is_swa_layer, layer_buffers,
                                 store_kv, write_loc)
from torch_bridge.dlpack import Importer, check_not_capturing
from torch_bridge.launcher import jax_dtype
from torch_bridge.mosaic_path import (EXPAND_TABLES, PREFIX_TABLES, TREE_SWA_TABLES, LayerHit, MosaicPath,
                                      table_key)
from torch_bridge.step import Step
from torch_bridge.step_planner import StepPlanner
from torch_bridge.translate import UNIFORM, layer_params


class LayerRunner:
    """Runs one layer's attention for the current step (see the module docstring)."""

    def __init__(self, planner: StepPlanner, jax_backend: JaxBackend, importer: Importer,
                 mosaic_path: Optional[MosaicPath], num_slots: int, step_id: int, num_swa_slots: int = 0):
        self.planner, self.jax_backend, self.importer = planner, jax_backend, importer
        self.mosaic_path, self.step_id = mosaic_path, step_id
        self.safe_locs = SafeLocs(num_slots, num_swa_slots)
        self._jit = jax.jit(self._attn_fn, static_argnums=(0, 1))
        self.executables: Dict[tuple, Any] = {}  # (layer, plan structure, q/k/v/sinks signatures) -> compiled
        self._layers: Dict[int, Tuple[Any, LayerParams]] = {}
        self.hits: Dict[int, Any] = {}  # layer_id -> the layer's checked call (LayerHit, JaxLayerHit)
        # Forwards seen: a layer id not above the last one starts a new forward (the model's layers run in
        # order). Per-forward work (safe slots, a graph bucket's tables) is redone at each, so a second
        # capture of one step records it too.
        self.forward = 0
        self._last_layer = -1
        self.trace_count = 0

    def share(self, other: "LayerRunner") -> None:
        """Use ``other``'s compiled executables (draft steps of one multi-step backend)."""
        self.executables = other.executables

    def _attn_fn(self, layer: LayerParams, layout, q, k_buffer, v_buffer, sinks, words):
        # q [T, Hq, D]; k_buffer [num_slots, Hkv, D]; v_buffer [num_slots, Hkv, Dv] (None: an MLA latent pool);
        # sinks [Hq] | None
        self.trace_count += 1
        md = layout.unpack(words)
        sinks = None if sinks is None else sinks.astype(np.float32)
        out, _ = self.jax_backend.forward(q, None, None, layer, KVPool(k_buffer, v_buffer), md,
                                          sinks=sinks, save_kv_cache=False)
        return out

    def run(self, step: Step, q, k, v, layer, forward_batch, save_kv_cache: bool, sinks):
        """``q [T, Hq * D]`` -> ``[T, Hq * Dv]``, writing this step's K/V first (unless told not to)."""
        if layer.layer_id <= self._last_layer:
            self.forward += 1
        self._last_layer = layer.layer_id
        if step.refresh is not None:  # a graph bucket's tables, written by the first layer (``graph_tables``)
            step.refresh.before_layer(self.forward)
        hit = self.hits.get(layer.layer_id)
        if hit is not None and step.loc_steps == 1 and hit.matches(layer, step, q, forward_batch, sinks):
            if hit.reads_plan:
                step = self.planner.fresh(step)
            loc = None
            if save_kv_cache:
                loc = self.safe_locs(forward_batch.out_cache_loc, self.forward,
                                     swa_mapping(forward_batch) if hit.swa else None)
            return hit(q, k, v, loc, sinks, step)
        lp = self.layer_params(layer)
        check_layer(lp, step.key, step.layout.local)
        swa = is_swa_layer(lp, step.key)  # SWAKVPool: reads the SWA pool through md.swa_page_table
        pool = forward_batch.token_to_kv_pool
        k_buf, v_buf = layer_buffers(pool, layer.layer_id, lp.mla)
        t = check_shapes(q, lp, step, k_buf, v_buf, self.planner.jax_backend.page_size)
        call = self._launch_call(lp, step, q, k_buf, v_buf, sinks, swa)
        if call is None:
            check_not_capturing()
            step = self.planner.fresh(step)
        loc = None
        if save_kv_cache and k is not None:  # SWA layers: slots the pool's own translation keeps in the SWA pool
            loc = self.safe_locs(write_loc(forward_batch, step, lp, t, k, v, self.step_id), self.forward,
                                 swa_mapping(forward_batch) if swa else None)
        if loc is not None and (call is None or lp.is_cross_attention):
            # written here: a JAX-path layer's, and a cross layer's (its slots are the encoder's, not one per token)
            store_kv(pool, layer, lp, loc, k, v)
            loc = None
        if call is not None:
            hit = LayerHit(layer, lp, call, pool, (k_buf, v_buf), sinks is None, swa)
        else:
            if self.planner.jax_heads is None and self.jax_backend.impl != "reference":
                self.planner.jax_heads = (lp.num_q_heads, lp.num_kv_heads)  # the next eager plans carry its schedules
            hit = self._jax_hit(step, lp, layer, t, q, pool, k_buf, v_buf, sinks, swa)
        # Later calls skip the checks, except for cross layers (their K/V slots are not out_cache_loc) and sinks
        # that are not viewed in place (imported per call, so a later in-place update is read)
        if not lp.is_cross_attention and (sinks is None or sinks.is_contiguous()):
            self.hits[layer.layer_id] = hit
        return hit(q, k, v, loc, sinks, step)

    def _jax_hit(self, step: Step, lp: LayerParams, layer, t: int, q, pool, k_buf, v_buf, sinks, swa: bool):
        """The layer's compiled executable over its pool views, as a ``JaxLayerHit``."""
        views = (self.importer.view(k_buf), None if v_buf is None else self.importer.view(v_buf),
                 None if sinks is None else self.importer.view(sinks, strict=False))
        device = self.importer.jax_device
        sharding = None if device is None else jax.sharding.SingleDeviceSharding(device)
        q_struct = jax.ShapeDtypeStruct((step.key.num_tokens, lp.num_q_heads, lp.head_dim), jax_dtype(q.dtype),
                                        sharding=sharding)
        exe = self._executable(lp, step, q_struct, *views)
        return JaxLayerHit(layer, lp, exe, self.importer, step.layout, t, q.dtype, pool, (k_buf, v_buf), views,
                           sinks, swa)

    def _launch_call(self, lp: LayerParams, step: Step, q, k_buf, v_buf, sinks, swa: bool = False):
        """This layer's bound launch (the Mosaic or the Triton-lowered kernel) when the launch path covers the
        call, else None."""
        path, key = self.mosaic_path, step.key
        if key.topk > 1 and (path is None or not path.launches_trees(self.jax_backend.impl)):
            return None
        if key.topk > 1 and lp.sliding_window_size < 0:
            # a tree step: the cascade's two passes and their merge (``triton_path.TreeCall``); the prefix pass
            # (each request's queries over its committed keys) on the Mosaic kernel where it covers the pass, the
            # expand pass (page size 1) and the merge on the Triton-lowered one
            if path.reason(lp, key, q, k_buf, v_buf) is not None:
                return None
            mosaic = self._kernel(lp, key, q.dtype, k_buf, sinks is not None, key.q_len_per_req) == "mosaic"
            passes = (table_key(lp, triton=not mosaic, tree_pass=PREFIX_TABLES),
                      table_key(lp, triton=True, tree_pass=EXPAND_TABLES))
            prefix, expand = (self._tables(step, h) for h in passes)
            return path.tree_call(lp, key, prefix, expand, q, k_buf, v_buf, sinks is not None, passes)
        route = self._route(lp, step, q.dtype, k_buf, v_buf, sinks is not None, swa)
        if route is None:
            return None
        heads, tables = route
        return path.layer_call(lp, key, tables, q, k_buf, v_buf, sinks is not None, heads,
                               on_new=self.planner.prebuild_recipe)

    def _route(self, lp: LayerParams, step: Step, dtype: torch.dtype, k_buf, v_buf, has_sinks: bool, swa: bool):
        """(table key, tables) of a layer one launch serves (a chain step's layer, or a tree step's
        sliding-window layer over the tree's SWA table) when it launches from torch, else None: which kernel
        (``MosaicPath.kernel_for``) is decided before any table is made, so layers off the path cost the plan
        nothing."""
        path, key = self.mosaic_path, step.key
        if path is None or path.reason(lp, key, None, k_buf, v_buf) is not None:
            return None
        if key.topk > 1:  # a tree's SWA table: committed then draft slots per row, one query each, page size 1
            max_q_len, page_size, tree_pass = 1, 1, TREE_SWA_TABLES
        else:
            max_q_len = key.q_len_per_req if key.mode in UNIFORM else key.num_tokens
            if lp.use_irope:  # a virtual sequence holds one chunk's queries at most
                max_q_len = min(max_q_len, key.attention_chunk_size)
            page_size, tree_pass = None, 0
        kernel = self._kernel(lp, key, dtype, k_buf, has_sinks, max_q_len, page_size)
        if kernel is None:
            return None
        # local layers: the local virtual batch's tables; SWA layers: md.swa_page_table's; cross layers: the encoder's
        heads = table_key(lp, swa, triton=kernel == "triton", tree_pass=tree_pass)
        return heads, self._tables(step, heads)

    def _tables(self, step: Step, heads) -> Any:
        """The step's tables of ``heads``: those its plan brought, else made now (the next plans bring them)."""
        tables = step.tables.get(heads)
        return tables if tables is not None else self.planner.tables(step, heads)

    def _kernel(self, lp: LayerParams, key, dtype: torch.dtype, k_buf, has_sinks: bool, max_q_len: int,
                page_size: Optional[int] = None):
        """The kernel the launch path runs this layer's call with (``MosaicPath.kernel_for``): ``"mosaic"``,
        ``"triton"`` or None (the JAX path). A cross layer reads the encoder tokens' slots (page size 1)."""
        if page_size is None:
            page_size = 1 if lp.is_cross_attention else key.page_size
        call = Call(max_q_len=max_q_len, page_size=page_size,
                    num_tokens=key.num_tokens, num_kv_heads=lp.num_kv_heads, head_dim=lp.head_dim,
                    head_dim_v=lp.v_head_dim or lp.head_dim, dtype=jax_dtype(dtype), kv_dtype=jax_dtype(k_buf.dtype),
                    has_sinks=has_sinks, num_q_heads=lp.num_q_heads, latent=lp.mla)
        kernel = self.mosaic_path.kernel_for(self.jax_backend.impl, call)
        if kernel == "mosaic" and lp.mla and key.topk > 1:  # an MLA tree step's passes: the Triton-lowered kernel
            kernel = self.mosaic_path.kernel_for("triton", call)
        return kernel

    def launch_specs(self, step: Step, layer, pool, dtype: torch.dtype, has_sinks: bool = False) -> list:
        """What ``layer``'s launch over ``step`` builds (``MosaicPath.prebuild`` specs; ``dtype``: its
        queries'), without building it: none for a layer on the JAX path or in a tree (topk > 1) step (built
        at its first call)."""
        if step.key.topk > 1 or self.mosaic_path is None:
            return []
        lp = self.layer_params(layer)
        check_layer(lp, step.key, step.layout.local)
        k_buf, v_buf = layer_buffers(pool, layer.layer_id, lp.mla)
        route = self._route(lp, step, dtype, k_buf, v_buf, has_sinks, is_swa_layer(lp, step.key))
        if route is None:
            return []
        heads, tables = route
        recipe = self.mosaic_path.recipe(lp, step.key, heads, dtype, k_buf, v_buf, has_sinks)
        return [recipe.spec(self.mosaic_path.config, step.key, tables)]

    def _executable(self, lp: LayerParams, step: Step, q, k_buf, v_buf, sinks):
        def sig(x):
            return None if x is None else (x.shape, x.dtype)
        ck = (lp, step.layout, sig(q), sig(k_buf), sig(v_buf), sig(sinks))
        exe = self.executables.get(ck)
        if exe is None:
            with tracing_for_cpu(self.planner.device.type == "cpu"):  # CPU pools: kernels interpreted
                exe = self.executables[ck] = self._jit.lower(lp, step.layout, q, k_buf, v_buf, sinks,
                                                             step.words).compile()
        return exe

    def layer_params(self, layer) -> LayerParams:
        hit = self._layers.get(layer.layer_id)
        if hit is not None and hit[0] is layer:
            return hit[1]
        lp = layer_params(layer, local_model=self.planner.settings.attention_chunk_size > 0,
                          mla=self.planner.settings.mla)
        self._layers[layer.layer_id] = (layer, lp)
        return lp


def swa_mapping(forward_batch):
    """The pool's ``full_to_swa_index_mapping`` (an ``SWAKVPool`` sliding-window layer's write)."""
    mapping = getattr(forward_batch.token_to_kv_pool, "full_to_swa_index_mapping", None)
    if mapping is None:
        raise ValueError("token_to_kv_pool (SWAKVPool) has no full_to_swa_index_mapping: register_mapping first")
    return mapping


class JaxLayerHit(CheckedLayer):
    """A layer checked once on the JAX path. A later call with the same layer object, pool and buffers,
    token count, q dtype, sinks and plan layout (so the same plan key and executable) skips the checks:
    KV write, then import q, the compiled call and the export."""

    reads_plan = True  # the executable reads the step's plan words

    def __init__(self, layer, lp: LayerParams, exe, importer: Importer, layout, t: int, dtype, pool, buffers, views,
                 sinks, swa: bool):
        super().__init__(layer, lp, t, pool, buffers, swa)
        self.exe, self.importer, self.layout, self.views = exe, importer, layout, views
        self.dtype, self.sinks = dtype, sinks

    def matches(self, layer, step: Step, q, forward_batch, sinks) -> bool:
        return (step.layout is self.layout and q.dtype == self.dtype and sinks is self.sinks
                and self.same(layer, q, forward_batch))

    def __call__(self, q, k, v, loc, sinks, step: Step):
        """The KV write, then the executable over ``step``'s plan."""
        self.write(k, v, loc)
        lp, t, padded = self.lp, self.t, step.key.num_tokens
        q = q.reshape(t, lp.num_q_heads, lp.head_dim)
        if t != padded:
            q = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, padded - t))
        elif not q.is_contiguous():
            q = q.contiguous()
        out = self.importer.export(self.exe(self.importer(q), *self.views, step.words))
        return out if t == padded else out[:t]
