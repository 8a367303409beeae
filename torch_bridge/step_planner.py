"""The bridge's step planner: SGLang's ``init_forward_metadata`` and the three CUDA-graph hooks.

Eager, capture and replay share one prepare path (``StepPlanner.plan``): the step's index tensors
go to one compiled JAX planner call (``jax_attn.plan_key.plan_arrays``, guarded against bad input)
and come back as a ``Step``, the one object every layer of the step reads. Per step the host does:

* eager: one torch concat of SGLang's int64 index tensors, seen as int32 word pairs (no cast
  kernel), one DLPack import, one compiled call; values outside int32 saturate inside the planner;
* replay of a bucket whose tensors SGLang already padded (its static buffers): ``req_pool_indices`` and
  ``seq_lens`` imported as they are (no torch kernel), one compiled call;
* replay of a uniform or tree verify bucket captured on the launch path: no planner call at all. The
  capture's first layer recorded torch ops that recompute the launch tables from SGLang's static buffers into
  the graph (``torch_bridge.graph_tables``); the hook selects the bucket's step (tree verify: after one copy
  of the step's flat mask into the buffer the graph reads), and the plan words are planned again only if
  something reads them (``fresh``);
* on the Mosaic launch path, the launch tables of every layer shape come out of the same call, and
  one export plus one copy refreshes the persistent buffers the captured graph reads.

Dimension legend: B requests (the bucket), T tokens, N draft tokens, S draft steps.
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jax_attn import batch as jbatch
from jax_attn import safety
from jax_attn.backend import FlashAttentionBackend as JaxBackend
from jax_attn.kernel_policy import Call
from jax_attn.plan_key import PlanKey, guard_plan, plan_arrays
from jax_attn.kernels import kernel_cache
from jax_attn.local import with_local
from jax_attn.metadata import ForwardMode
from jax_attn.multistep import plan_draft_steps
from jax_attn.spec import draft_mask_from_custom_mask, with_swa_pool_step, with_swa_table
from torch_bridge.checks import RunnerSettings, check_host_lengths, plans_local
from torch_bridge import graph_tables
from torch_bridge.dlpack import Importer, capturing, narrow_int32, pack_mask_words, pad_int32
from torch_bridge.launcher import jax_dtype
from torch_bridge.mosaic_path import (CROSS_TABLES, EXPAND_TABLES, LATENT_TABLES, LOCAL_TABLES, PREFIX_TABLES,
                                      SWA_TABLES, TREE_SWA_TABLES, TREE_TABLES, TRITON_TABLES, WARM_UP_MESSAGE,
                                      MosaicPath, TableKey, Tables, flatten_tables, key_flags)
from torch_bridge.step import Packing, PlanLayout, Step, as_words, narrow, packing
from torch_bridge.warmup import prebuild_classes, prebuild_recipe, shares_class
from torch_bridge.translate import (UNIFORM, custom_mask, extend_lens, loc_steps, locs_per_token, pad_wide, plan_locs,
                                   replay_extend_lens)


class StepPlanner:
    """Turns SGLang's batch tensors into a ``Step`` (see the module docstring).

    Args:
      model_runner: SGLang's ``ModelRunner`` (or ``torch_bridge.types.ModelRunner``).
      settings: what the runner asks for, checked (``torch_bridge.checks.RunnerSettings``).
      jax_backend: the JAX backend whose planners and static rules are used.
      importer: DLPack importer of the pools' device.
      mosaic_path: the launch path, or None.
      speculative_step_id, speculative_num_steps: this backend's draft step (draft decode).
    """

    def __init__(self, model_runner, settings: RunnerSettings, jax_backend: JaxBackend, importer: Importer,
                 mosaic_path: Optional[MosaicPath], speculative_step_id: int, speculative_num_steps: int):
        self.model_runner, self.settings, self.jax_backend = model_runner, settings, jax_backend
        self.importer, self.mosaic_path = importer, mosaic_path
        self.step_id, self.num_steps = speculative_step_id, speculative_num_steps
        self.device = importer_device(model_runner)
        # eager ragged steps' minimum rows (``jax_attn.batch.ragged_rows``): on the CPU a padded row's empty
        # work tile is a grid step of the interpreted kernel, so rows stay at the batch class there
        self.ragged_min_rows = jbatch.RAGGED_MIN_ROWS if self.device.type == "cuda" else 1
        self._jit = jax.jit(self._plan_fn, static_argnums=0)
        self.executables: Dict[tuple, Any] = {}  # (Packing, req_to_token shape) -> compiled planner
        self.launch_heads: set = set()  # table keys of launch-path layers: their tables come with each plan
        if mosaic_path is not None and settings.heads is not None:
            # SGLang's model config names the layer shapes: their tables come with every plan (a key first
            # seen in a graph bucket's warm-up would otherwise change the plans its replays make)
            for triton in expected_kernels(mosaic_path, settings, model_runner, jax_backend):
                flags = TRITON_TABLES if triton else LATENT_TABLES if settings.mla else 0
                self.launch_heads.add(settings.heads + ((flags,) if flags else ()))
                if settings.attention_chunk_size:  # a local-attention model's use_irope layers read md.local
                    self.launch_heads.add(settings.heads + (LOCAL_TABLES | flags,))
                if settings.num_swa_slots:  # an SWAKVPool's sliding-window layers read md.swa_page_table
                    self.launch_heads.add(settings.heads + (SWA_TABLES | flags,))
            if settings.topk > 1 and mosaic_path.launches_trees(jax_backend.impl):
                # tree steps' two passes (``triton_path.TreeCall``): the prefix on either kernel (as its queries
                # per request decide: the draft tokens in verify, the branches in draft decode), the expand pass
                # on the Triton-lowered one
                q_lens = tuple({settings.num_draft_tokens or settings.topk, settings.topk})
                for triton in expected_kernels(mosaic_path, settings, model_runner, jax_backend, q_lens):
                    self.launch_heads.add(settings.heads + ((TRITON_TABLES if triton else 0) | PREFIX_TABLES,))
                self.launch_heads.add(settings.heads + (TRITON_TABLES | EXPAND_TABLES,))
                if settings.with_swa:  # sliding-window layers: one pass over the tree's SWA table
                    pool_swa = SWA_TABLES if settings.num_swa_slots else 0
                    self.launch_heads.add(settings.heads + (TRITON_TABLES | TREE_SWA_TABLES | pool_swa,))
        # (Hq, Hkv) of the first layer run as a JAX executable (``LayerRunner``): eager plans carry its
        # kernels' schedules from then on (layers of other heads plan theirs inside the call)
        self.jax_heads: Optional[Tuple[int, int]] = None
        self.graph_max: Optional[Tuple[int, int]] = None
        self.graph_keys: Dict[Tuple[ForwardMode, int], PlanKey] = {}
        self.share_graph_kernels = True  # graph buckets of one batch class share plans and kernels
        self.prebuilt: set = set()  # mosaic_path.Recipe s whose kernels for the later classes were prebuilt
        self.graph_specs: dict = {}  # batch-class plan key -> its speculative settings, from the capture hook
        # (mode, bs) -> the bucket's in-graph table refresh (``torch_bridge.graph_tables``)
        self.refreshes: Dict[Tuple[ForwardMode, int], graph_tables.TableRefresh] = {}
        self.prebuilt_kernels = 0
        self.step: Optional[Step] = None
        self.trace_count = 0
        self._final: Dict[tuple, Packing] = {}  # (packing, graph, jax_heads) -> the packing the planner runs
        self._keys: Dict[tuple, Tuple[TableKey, ...]] = {}  # (plan key, local) -> table_keys
        self._plan_keys: Dict[tuple, PlanKey] = {}  # key()'s of steps without spec_info
        self._specs: Dict[tuple, jbatch.SpecInfo] = {}  # spec()'s, by (mode, spec_info's topk and draft tokens)

    def share(self, other: "StepPlanner") -> None:
        """Use ``other``'s compiled planners and layer shapes (draft steps of one multi-step backend)."""
        self.executables, self.launch_heads = other.executables, other.launch_heads

    # ---- the traced planner -----------------------------------------------------------------
    def _plan_fn(self, pk: Packing, req_to_token, mapping, *inputs):
        """The planner call: the plan (and launch tables) as one int32 buffer (per draft step).
        ``mapping``: the SWAKVPool's ``full_to_swa_index_mapping`` (its int64 words) or None."""
        self.trace_count += 1
        plans, tables = self._plan_tree(pk, req_to_token, mapping, *inputs)
        if pk.all_steps:
            return tuple(PlanLayout.pack(md) for md in plans)
        return PlanLayout.pack(plans, tables)

    def _plan_tree(self, pk: Packing, req_to_token, mapping, *inputs):
        """(plan, launch tables per ``pk.heads``); for ``pk.all_steps`` (plans of every draft step, ())."""
        if pk.split:  # rows and seq_lens, one bucket each
            rows, lens = narrow(inputs[0]), narrow(inputs[1])
            ext = enc = words = None
            loc = jnp.zeros((pk.num_locs,), jnp.int32)
        else:
            packed = narrow(inputs[0]) if pk.wide else inputs[0]
            offs = np.cumsum((0,) + pk.sizes())
            rows, lens, loc, ext, enc, words, count = (packed[a:b] for a, b in zip(offs[:-1], offs[1:]))
        key = pk.key
        if pk.all_steps:
            plans = plan_draft_steps(req_to_token, rows, lens, loc, topk=key.topk, num_steps=pk.all_steps,
                                     page_size=key.page_size, max_pages=key.max_pages)
            if key.with_swa:  # tree draft steps: sliding-window layers' per-branch tables
                plans = tuple(with_swa_table(md, req_to_token, rows, lens, width=key.max_pages * key.page_size)
                              for md in plans)
            plans = guard_plan(plans, key, req_to_token, rows)
            if key.swa_pool:  # SWAKVPool: each step's SWA table (tree steps: md.swa's slots) translated
                plans = tuple(with_swa_pool_step(md, mapping, num_swa_slots=key.num_swa_slots) for md in plans)
            plans = tuple(with_local(md, chunk_size=key.attention_chunk_size) for md in plans)  # chain: md.local
            return tuple(self.jax_backend.attach_schedule(md, num_heads=pk.jax_heads) for md in plans), ()
        mask = None
        if pk.mask_words:
            flat = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)  # [4 * words] mask bytes
            mask = draft_mask_from_custom_mask(flat, lens, num_draft=key.q_len_per_req)
        md = plan_arrays(key, req_to_token, rows, lens, loc, ext if pk.has_ext else None,
                         enc if pk.has_enc else None, mask, swa_mapping=mapping)
        if pk.counted:  # extend lengths that do not add up to the step's tokens would drop or misplace some
            md = safety.flag(md, md.cu_seqlens_q[-1] != count[0], 16)
        path = self.mosaic_path
        tables = tuple(flatten_tables(md, heads, path.config, path.deterministic) for heads in pk.heads)
        return self.jax_backend.attach_schedule(md, num_heads=pk.jax_heads), tables

    def _run(self, pk: Packing, inputs):
        """(layout or layouts, words or tuple of words) of the planner call for ``pk``."""
        r2t = self.importer.table_view(self.model_runner.req_to_token_pool.req_to_token)
        mapping = self.swa_mapping() if pk.key.swa_pool else None
        ck = (pk, r2t.shape, None if mapping is None else mapping.shape)
        hit = self.executables.get(ck)
        if hit is None:
            specs = [jax.ShapeDtypeStruct(tuple(x.shape), np.int32) for x in inputs]
            layout = self._layouts(pk, r2t, mapping, specs)
            hit = self.executables[ck] = (self._jit.lower(pk, r2t, mapping, *specs).compile(), layout)
        exe, layout = hit
        if pk.split:  # seq_lens imported (it orders the call after torch's stream); req_pool_indices is the
            lens = self.importer(inputs[1])  # graph runner's static buffer, viewed once
            return layout, exe(r2t, mapping, self.importer.recent_view(inputs[0]), lens)
        return layout, exe(r2t, mapping, *self.importer.many(inputs))

    def swa_mapping(self) -> jax.Array:
        """The SWAKVPool's ``full_to_swa_index_mapping`` as the planner takes it (``Importer.index_view``)."""
        mapping = getattr(self.model_runner.token_to_kv_pool, "full_to_swa_index_mapping", None)
        if mapping is None:
            raise ValueError("token_to_kv_pool (SWAKVPool) has no full_to_swa_index_mapping: register_mapping "
                             "(SGLang's SWATokenToKVPoolAllocator does) before planning a step")
        if mapping.device != self.device or mapping.dim() != 1:
            raise ValueError(f"full_to_swa_index_mapping {mapping.shape=} on {mapping.device} must be 1-D on the "
                             f"pools' device {self.device}")
        return self.importer.index_view(mapping)

    def _layouts(self, pk: Packing, r2t, mapping, specs):
        """The static layout(s) of the planner's output words (an abstract evaluation, no compile)."""
        plans, tables = jax.eval_shape(lambda *a: self._plan_tree(pk, *a), r2t, mapping, *specs)
        if pk.all_steps:
            return tuple(PlanLayout.of(md) for md in plans)
        return PlanLayout.of(plans, tuple(zip(pk.heads, tables)))

    # ---- one prepare path ---------------------------------------------------------------------
    def key(self, mode: ForwardMode, bs: int, tokens: int, spec, has_ext: bool, has_enc: bool = False) -> PlanKey:
        """The static plan key, through jax_attn's own rules (one place for offsets and modes)."""
        jb = self.jax_backend
        memo = None if spec is not None else (mode, bs, tokens, has_ext, has_enc, jb.plan_settings())
        hit = self._plan_keys.get(memo) if memo is not None else None
        if hit is not None:
            return hit
        z = np.zeros(bs, np.int32)
        locs = np.zeros(tokens * locs_per_token(spec, mode), np.int32)
        shape_batch = jbatch.ForwardBatch(mode, z, z, locs, extend_seq_lens=z if has_ext else None,
                                          encoder_lens=z if has_enc else None, spec_info=spec)
        key = jb.plan_static(shape_batch)
        if memo is not None:
            self._plan_keys[memo] = key
        return key

    def plan(self, pk: Packing, rows, lens, loc=None, ext=None, enc=None, words=None, *, real_tokens: int,
             graph: bool = False, draft_steps: int = 1):
        """Run the planner on the step's tensors; returns the plan (a tuple of plans for
        ``pk.all_steps``) and installs it as the current ``Step`` unless ``pk.all_steps``."""
        parts = [t for t in (rows, lens, loc, ext, enc, words) if t is not None]
        if pk.counted:  # the step's real token count, which its extend lengths must add up to
            parts.append(torch.full((1,), real_tokens, dtype=parts[0].dtype, device=parts[0].device))
        if any(t.device != self.device for t in parts):
            raise ValueError(f"index tensors must be on the pools' device {self.device}")
        wide = pk.split or all(t.dtype == torch.int64 for t in parts)  # split inputs come as int64
        pk = self.final(pk, wide, graph)
        if pk.split:  # no torch kernel: rows viewed, seq_lens imported (``_run``)
            inputs = [as_words(rows), as_words(lens)]
        else:
            parts = [t if t.dim() == 1 else t.reshape(-1) for t in parts]
            if not wide:  # mixed dtypes: saturate each part in torch
                parts = [narrow_int32(t) for t in parts]
            packed = torch.cat(parts) if len(parts) > 1 else parts[0]
            if packed.shape[0] != sum(pk.sizes()):
                raise ValueError(f"req_pool_indices / seq_lens / extend_seq_lens / encoder_lens must have one entry "
                                 f"per request ({pk.key.batch_size}); got {packed.shape[0]} packed entries, "
                                 f"expected {sum(pk.sizes())}")
            inputs = [as_words(packed) if wide else packed]
        layout, words = self._run(pk, inputs)
        if pk.all_steps:
            return list(zip(layout, words))
        self.install(pk.key, layout, words, real_tokens, draft_steps, graph)

    def final(self, pk: Packing, wide: bool, graph: bool) -> Packing:
        """``pk`` as the planner runs it: input width, the launch tables and JAX-path schedules it brings."""
        memo = (pk, wide, graph, self.jax_heads, len(self.launch_heads))
        hit = self._final.get(memo)
        if hit is None:
            heads = self.table_keys(pk.key, plans_local(pk.key) and not pk.all_steps)
            # Eager plans carry the schedules of the JAX-path layers' kernels once such a layer has run (graph
            # buckets do not: a JAX-path layer cannot run inside a captured graph, and a replay keeps its layout).
            hit = self._final[memo] = dataclasses.replace(pk, wide=wide, heads=heads,
                                                          jax_heads=None if graph else self.jax_heads)
        return hit

    def table_keys(self, key: PlanKey, local: bool) -> Tuple[TableKey, ...]:
        """The launch tables a step of ``key`` brings (``local``: its plan carries md.local)."""
        if self.mosaic_path is None:
            return ()
        tree = key.topk > 1  # a tree step's plan is a cascade: only its passes' tables
        memo = (key, local, len(self.launch_heads))  # launch_heads only grows
        hit = self._keys.get(memo)
        if hit is None:
            hit = self._keys[memo] = tuple(sorted(h for h in self.launch_heads
                                                  if (local or not key_flags(h) & LOCAL_TABLES)
                                                  and (key.swa_pool or not key_flags(h) & SWA_TABLES)
                                                  and (key.has_encoder or not key_flags(h) & CROSS_TABLES)
                                                  and (key.with_swa or not key_flags(h) & TREE_SWA_TABLES)
                                                  and tree == bool(key_flags(h) & (TREE_TABLES | TREE_SWA_TABLES))))
        return hit

    def install(self, key: PlanKey, layout: PlanLayout, words, real_tokens: int, draft_steps: int = 1,
                graph: bool = False) -> Step:
        """Make the planned ``words`` the current step (validation mode reads its error flag first)."""
        step = Step(key, layout, words, real_tokens, draft_steps, graph)
        if self.jax_backend.validate:
            self.step = None  # a bad step raises here, before any layer writes the cache
            safety.check(step.plan(), "torch_bridge plan")
        self.step = step
        keys = self.table_keys(key, layout.local)
        if keys:
            exported = self.importer.export(words) if layout.tables else None  # one export for every table
            for heads in keys:
                span = layout.table_range(heads)
                flat = None if span is None else exported[span[0]:span[1]]
                step.tables[heads] = self.mosaic_path.tables(step, heads, flat)
        return step

    def tables(self, step: Step, heads: TableKey) -> Tables:
        """The launch tables of a table key first seen in this step (the next plans bring them)."""
        if capturing():
            raise RuntimeError(WARM_UP_MESSAGE)
        step = self.fresh(step)
        tables = step.tables[heads] = self.mosaic_path.tables(step, heads, None)
        self.launch_heads.add(heads)
        r = step.refresh
        if r is not None and not r.verify(heads):  # tables the refresh would not write as the planner does
            self.drop_refresh(r)
        return tables

    def fresh(self, step: Step) -> Step:
        """``step`` with its plan words describing the current inputs: a graph bucket whose replay hook
        skipped the planner (``torch_bridge.graph_tables``) runs it now, for whatever reads the words (a
        JAX-path layer, a new table key, ``check``)."""
        r = step.refresh
        if r is None or not r.stale:
            return step
        self.bucket(r.key, r.spec, r.rows, r.lens, None, r.spec_info, r.loc)
        words = self.step.words
        for s in (r.step, *r.steps.values()):
            s.words = words
        r.stale = False
        self.step = step
        return step

    def drop_refresh(self, r: "graph_tables.TableRefresh") -> None:
        """The bucket's tables come from the planner from now on. A graph that recorded the refresh still
        runs it, reading the captured input buffers: its replay hook then fills those and runs the planner."""
        if r.recorded:
            r.planner_too = True
            return
        for k, v in list(self.refreshes.items()):
            if v is r:
                del self.refreshes[k]
        for s in (r.step, *r.steps.values()):
            s.refresh = None

    # ---- SGLang's entry points ----------------------------------------------------------------
    def spec(self, spec_info, mode: ForwardMode) -> Optional[jbatch.SpecInfo]:
        """jax_attn's static SpecInfo from EAGLE's / NGRAM's spec_info and this backend's settings (made once per
        mode, topk and draft tokens the spec_info names: each replay hook asks)."""
        speculative = mode == ForwardMode.TARGET_VERIFY or mode.is_draft_extend()
        if not speculative and (spec_info is None or mode != ForwardMode.DECODE):
            return None
        own, draft = getattr(spec_info, "topk", None), getattr(spec_info, "draft_token_num", 0)
        memo = (mode, own, draft) if isinstance(own, (int, type(None))) and isinstance(draft, (int, type(None))) \
            else None
        hit = self._specs.get(memo) if memo is not None else None
        if hit is None:
            hit = self._make_spec(spec_info, mode)
            if memo is not None:
                self._specs[memo] = hit
        return hit

    def _make_spec(self, spec_info, mode: ForwardMode) -> jbatch.SpecInfo:
        topk = 1 if mode.is_draft_extend() else self.topk(spec_info)  # draft extend is never a tree
        draft = int(getattr(spec_info, "draft_token_num", 0) or 0) or self.settings.num_draft_tokens
        if mode == ForwardMode.TARGET_VERIFY and draft < 1:
            raise ValueError("target verify needs spec_info.draft_token_num or "
                             "server_args.speculative_num_draft_tokens >= 1")
        steps = max(self.num_steps, 1)
        if topk > 1 and mode == ForwardMode.DECODE and not 0 <= self.step_id < steps:
            raise ValueError(f"tree draft decode step {self.step_id} needs speculative_num_steps > "
                             f"step id (got {self.num_steps}); pass it to the backend")
        placeholder = np.zeros((1, draft, draft), bool) if topk > 1 else None  # the mask itself is planned on device
        return jbatch.SpecInfo(topk=topk, num_draft_tokens=draft, step_id=self.step_id, num_steps=steps,
                               draft_mask=placeholder,
                               with_swa=self.settings.with_swa and topk > 1)  # tree verify / draft decode

    def topk(self, spec_info) -> int:
        """SGLang's ``server_args.speculative_eagle_topk`` (or the constructor's ``topk``); without
        either, an EAGLE ``spec_info.topk``. A spec_info that disagrees with the server raises."""
        server = self.settings.topk
        own = getattr(spec_info, "topk", None)
        own = int(own) if isinstance(own, int) and own > 0 else 0
        if server > 0 and own and own != server:
            raise ValueError(f"spec_info.topk={own} differs from server_args.speculative_eagle_topk={server}")
        return max(server or own, 1)

    def eager(self, forward_batch, mode: ForwardMode) -> None:
        """``init_forward_metadata``: plan the batch at its shape class (``eager_shape``), so ragged engine
        traffic compiles one planner and one kernel per class, not per batch shape."""
        spec = self.spec(forward_batch.spec_info, mode)
        ext = extend_lens(mode, forward_batch.extend_seq_lens, forward_batch.spec_info)
        enc = getattr(forward_batch, "encoder_lens", None)
        bs = int(forward_batch.seq_lens.shape[0])
        if bs == 0:
            raise ValueError(f"a {mode.name} batch of size 0: SGLang plans an empty step as ForwardMode.IDLE")
        loc = plan_locs(forward_batch.out_cache_loc, spec, mode, bs, self.step_id)
        per_loc = locs_per_token(spec, mode)
        tokens = int(loc.shape[0]) // per_loc
        rows, lens = forward_batch.req_pool_indices, forward_batch.seq_lens
        pbs, ptokens = eager_shape(mode, bs, tokens, spec, ext is not None, enc is not None, self.ragged_min_rows)
        key = self.key(mode, pbs, ptokens, spec, ext is not None, enc is not None)
        check_host_lengths(forward_batch, mode, tokens, ext is not None, capacity=self.jax_backend.capacity,
                           kv_offset=key.kv_offset)
        if (pbs, ptokens) != (bs, tokens):  # padded rows: row 0, seq_len 1, no new token; padded tokens: slot 0
            rows, lens = pad_as_is(rows, pbs, 0), pad_as_is(lens, pbs, jbatch.SEQ_LEN_FILL_VALUE)
            loc = pad_as_is(loc, ptokens * per_loc, 0)
            ext = None if ext is None else pad_as_is(ext, pbs, 0)
        words = None
        if key.topk > 1 and mode == ForwardMode.TARGET_VERIFY:
            n = int(custom_mask(forward_batch.spec_info).numel())
            words = pack_mask_words(forward_batch.spec_info.custom_mask, max(64, 1 << (n - 1).bit_length()),
                                    self.device).to(loc.dtype)
        pk = packing(key, loc, ext, enc, words, exact=True)
        self.plan(pk, rows, lens, loc, ext, enc, words, real_tokens=tokens, draft_steps=loc_steps(spec, mode))

    def init_graphs(self, max_bs: int, max_num_tokens: int) -> None:
        self.graph_max = (int(max_bs), int(max_num_tokens))
        self.graph_keys = {}
        self.graph_specs = {}
        self.refreshes = {}

    def capture(self, bs: int, num_tokens: int, req_pool_indices, seq_lens, encoder_lens, mode: ForwardMode,
                spec_info) -> None:
        """The capture hook: compile bucket ``bs``'s planner and plan the capture run with it.

        Decode and chain (topk 1) verify buckets plan at their batch class (``jax_attn.batch.batch_class``):
        the buckets of a class share one planner and one kernel per layer shape. Once layers have run on
        the launch path, the first capture hook of a mode plans the classes the later buckets will use and
        builds their kernels at once (``torch_bridge.warmup``)."""
        if self.graph_max is None:
            raise RuntimeError("call init_cuda_graph_state(max_bs, max_num_tokens) before capturing")
        if bs > self.graph_max[0] or num_tokens > self.graph_max[1]:
            raise ValueError(f"{bs=}, {num_tokens=} exceed init_cuda_graph_state's {self.graph_max}")
        spec = self.spec(spec_info, mode)
        per_req = self.tokens_per_req(mode, spec)
        if num_tokens != bs * per_req:
            raise ValueError(f"{mode.name}: {num_tokens=} must be bs * {per_req} = {bs * per_req}")
        key = self.key(mode, bs, num_tokens, spec, mode not in UNIFORM, encoder_lens is not None)
        if self.share_graph_kernels and shares_class(key, encoder_lens):  # plan (and compile) at the batch class
            cls = jbatch.batch_class(bs)
            key = self.key(mode, cls, cls * per_req, spec, False, False)
            self.graph_specs[key] = spec
            self.prebuilt_kernels += prebuild_classes(self, key, spec)
        self.graph_keys[(mode, bs)] = key
        self.bucket(key, spec, req_pool_indices, seq_lens, encoder_lens, spec_info, None, capturing=True)
        self.make_refresh(mode, bs, key, spec, req_pool_indices, seq_lens, getattr(spec_info, "custom_mask", None),
                          encoder_lens=encoder_lens)
        # The engine captures next. Nothing of this step may still run on the GPU, and no kernel compile may
        # load modules. In CUDA's global capture mode an unsafe call from *any* thread invalidates the
        # capture: SGLang's 36 warm-up captures on an H100 failed at a random bucket in 4 of 8 runs in that
        # mode, in none of 4 in thread-local mode, which only checks the capturing thread (so another thread
        # made the call; JAX's runtime threads are the likely callers, not confirmed). torch_bridge.sglang_plugin
        # captures in thread-local mode. The full collection below lowered the failures when the engine does
        # not freeze the collector (0 of 6); under SGLang's ``freeze_gc`` it neither helps nor costs.
        jax.block_until_ready(self.step.words)
        gc.collect()
        kernel_cache.wait_ahead()  # no kernel compile of a JAX-path layer may load modules during the capture

    def make_refresh(self, mode: ForwardMode, bs: int, key: PlanKey, spec, rows, lens, mask=None, loc=None,
                     encoder_lens=None) -> None:
        """Give bucket ``bs`` an in-graph table refresh when its tables allow one and the refresh writes
        what the planner just wrote (``torch_bridge.graph_tables``; ``mask``: tree verify's custom mask; ``loc``:
        tree draft decode's slots of every draft step, as planned; ``encoder_lens``: cross attention's)."""
        self.refreshes.pop((mode, bs), None)
        capacity = self.jax_backend.capacity
        if self.mosaic_path is None or graph_tables.reason(key, self.jax_backend.validate, capacity) is not None:
            return
        r2t = self.model_runner.req_to_token_pool.req_to_token
        inputs = (rows, lens, encoder_lens)
        if r2t.dtype != torch.int32 or any(x is not None and x.device != self.device for x in inputs):
            return
        mapping = getattr(self.model_runner.token_to_kv_pool, "full_to_swa_index_mapping", None) if key.swa_pool \
            else None  # (an SWAKVPool's: the graph reads it)
        if key.swa_pool and (mapping is None or mapping.dim() != 1 or mapping.device != self.device):
            return
        r = graph_tables.TableRefresh(key, self.step, rows, lens, r2t, capacity, self.mosaic_path.config, spec,
                                      mask, loc, mapping, encoder_lens)
        if r.verify():
            self.step.refresh = r
            self.refreshes[(mode, bs)] = r

    def prebuild_recipe(self, recipe, tables) -> None:
        """A layer's first launch on the launch path (``MosaicPath.layer_call``): in a graph bucket's warm-up,
        build its kernels for the later buckets too (``torch_bridge.warmup.prebuild_recipe``)."""
        self.prebuilt_kernels += prebuild_recipe(self, recipe, tables)

    def replay(self, bs: int, req_pool_indices, seq_lens, encoder_lens, mode: ForwardMode, spec_info,
               out_cache_loc=None) -> None:
        """The replay hook: pad to bucket ``bs``'s plan (its batch class: seq_len 1, row 0, slot 0) and
        run its planner."""
        key = self.graph_keys.get((mode, bs))
        if key is None:
            raise ValueError(f"no captured plan for {mode.name} bs={bs}; call "
                             "init_forward_metadata_capture_cuda_graph for this bucket first")
        if key.has_encoder != (encoder_lens is not None):
            raise ValueError(f"bucket bs={bs} was captured with{'' if key.has_encoder else 'out'} encoder_lens; "
                             "replay must pass the same kind of batch")
        spec = self.spec(spec_info, mode)  # same checks as capture (topk, steps)
        r = self.recorded(mode, bs)
        if r is not None:  # the graph recomputes the tables from its input buffers
            self.take_recorded(r, req_pool_indices, seq_lens, spec_info, out_cache_loc, encoder_lens)
            return
        self.bucket(key, spec, req_pool_indices, seq_lens, encoder_lens, spec_info, out_cache_loc)

    def recorded(self, mode: ForwardMode, bs: int) -> Optional["graph_tables.TableRefresh"]:
        """Bucket ``bs``'s table refresh when a capture recorded it into the engine's graph, else None."""
        r = self.refreshes.get((mode, bs))
        return r if r is not None and r.recorded else None

    def take_recorded(self, r: "graph_tables.TableRefresh", req_pool_indices, seq_lens, spec_info,
                      out_cache_loc=None, encoder_lens=None) -> None:
        """The replay hook of a bucket whose graph recomputes its tables (``r``, as ``recorded`` returned it): the
        step's inputs into the buffers the graph reads, no planner."""
        if r.r2t is not self.model_runner.req_to_token_pool.req_to_token:
            raise ValueError(f"{r.key.mode.name} bucket bs={r.key.batch_size}: req_to_token_pool.req_to_token is not "
                             "the tensor its graph was captured with; capture the graphs again after reallocating it")
        self.step = r.take(req_pool_indices, seq_lens, custom_mask(spec_info) if r.tree else None,
                           out_cache_loc if r.draft else None, encoder_lens)
        if r.planner_too:
            self.fresh(self.step)

    def tokens_per_req(self, mode: ForwardMode, spec) -> int:
        if mode == ForwardMode.DECODE:
            return spec.topk if spec is not None else 1
        if mode == ForwardMode.TARGET_VERIFY or mode.is_draft_extend():
            if spec is None or spec.num_draft_tokens < 1:
                raise ValueError(f"{mode.name} capture needs speculative_num_draft_tokens >= 1")
            return spec.num_draft_tokens
        raise ValueError(f"{mode.name} is not capturable (ragged tokens per request); plan it eagerly "
                         "with init_forward_metadata")

    def bucket(self, key: PlanKey, spec, req_pool_indices, seq_lens, encoder_lens, spec_info, out_cache_loc,
               capturing: bool = False) -> None:
        """Plan a graph bucket: SGLang's static buffers as they are, or padded here."""
        bs, tokens, mode = key.batch_size, key.num_tokens, key.mode
        n = min(int(seq_lens.shape[0]), bs)
        real = n * (tokens // bs)
        if mode in UNIFORM and key.topk == 1 and encoder_lens is None:
            # Rows and seq_lens only; SGLang's graph runner hands its static buffers already padded, so
            # nothing is padded here. The plan's slots stay 0: graph steps write K/V from the engine's
            # out_cache_loc in torch (made safe per step), never through the plan.
            pk = Packing(key, tokens * locs_per_token(spec, mode), split=True)
            rows = req_pool_indices if req_pool_indices.shape[0] == n else req_pool_indices[:n]
            lens = seq_lens if seq_lens.shape[0] == n else seq_lens[:n]
            self.plan(pk, pad_wide(rows, bs, 0), pad_wide(lens, bs, jbatch.SEQ_LEN_FILL_VALUE), real_tokens=real,
                      graph=True, draft_steps=loc_steps(spec, mode))
            return
        rows = pad_int32(req_pool_indices[:n], bs, 0)
        lens = pad_int32(seq_lens[:n], bs, jbatch.SEQ_LEN_FILL_VALUE)
        loc = rows[:0] if out_cache_loc is None else plan_locs(out_cache_loc, spec, mode, None, self.step_id)
        loc = pad_int32(loc, tokens * locs_per_token(spec, mode), 0)
        enc = None if encoder_lens is None else pad_int32(encoder_lens[:n], bs, 0)
        ext = None
        if mode not in UNIFORM:  # draft extend: each request's new tokens (capture: one each)
            acc = replay_extend_lens(mode, spec_info, tokens // bs, n, self.device)
            if acc is None and not capturing:
                raise ValueError("draft extend replay needs spec_info.num_accepted_tokens (or accept_length)")
            ext = pad_int32(acc[:n] if acc is not None else rows[:n] * 0 + 1, bs, 0)
            real = tokens  # draft extend replays the padded token layout
        words = None
        if key.topk > 1 and mode == ForwardMode.TARGET_VERIFY:
            mask = getattr(spec_info, "custom_mask", None) if capturing else custom_mask(spec_info)
            # the static bound covers any committed lengths of the bucket
            words = pack_mask_words(mask, graph_tables.mask_bytes(key, self.jax_backend.capacity), self.device)
        self.plan(packing(key, loc, ext, enc, words), rows, lens, loc, ext, enc, words, real_tokens=real,
                  graph=True, draft_steps=loc_steps(spec, mode))

    def draft_key(self, bs: int, spec_info) -> PlanKey:
        """The plan key of this backend's draft decode step for ``bs`` requests."""
        spec = self.spec(spec_info, ForwardMode.DECODE)
        return self.key(ForwardMode.DECODE, bs, bs * spec.topk, spec, False)

    def draft_round(self, bs: int, rows, seq_lens, loc, spec_info, num_steps: int, graph: bool = False):
        """Plans of draft steps ``0..num_steps-1`` in one planner call (the multi-step backend; ``graph``:
        a graph bucket's)."""
        key = self.draft_key(bs, spec_info)
        return self.plan(packing(key, loc, None, None, None, all_steps=num_steps), rows, seq_lens, loc,
                         real_tokens=0, graph=graph)


def expected_kernels(path: MosaicPath, settings: RunnerSettings, model_runner, jax_backend,
                     q_lens: Tuple[int, ...] = (1, 2)) -> Tuple[bool, ...]:
    """Which launched kernels (False: Mosaic, True: Triton-lowered) the model's layers will take, from its
    pool (head dims, dtype; q in the pool's dtype, bf16 over an fp8 pool) and the policy, for steps of these
    queries per request (default: decode, and extend steps)."""
    pool = getattr(model_runner, "token_to_kv_pool", None)
    if settings.mla:  # absorbed MLA: the Triton-lowered kernel, and the Mosaic one for batches it fills the GPU with
        latent, buf = getattr(pool, "kv_lora_rank", None), getattr(pool, "kv_buffer", None)
        if not isinstance(latent, int) or not buf:
            return (True,)
        kv_dtype = jax_dtype(buf[0].dtype)
        call = Call(max_q_len=1, page_size=jax_backend.page_size, num_tokens=1 << 20, num_kv_heads=1,
                    head_dim=buf[0].shape[-1], head_dim_v=latent, dtype=kv_dtype, kv_dtype=kv_dtype,
                    num_q_heads=settings.heads[0], latent=True)
        return (False, True) if path.kernel_for(jax_backend.impl, call) == "mosaic" else (True,)
    try:
        k_buf, v_buf = pool.get_kv_buffer(0)
    except (AttributeError, IndexError, TypeError):
        return () if jax_backend.page_size % 8 else (False,)  # an unusual pool: Mosaic tables, as before
    kv_dtype = jax_dtype(k_buf.dtype)
    dtype = jnp.bfloat16 if kv_dtype.itemsize == 1 else kv_dtype
    hq, hkv = settings.heads
    kinds = set()
    for max_q_len in q_lens:
        call = Call(max_q_len=max_q_len, page_size=jax_backend.page_size, num_tokens=0, num_kv_heads=hkv,
                    head_dim=k_buf.shape[-1], head_dim_v=v_buf.shape[-1], dtype=dtype, kv_dtype=kv_dtype,
                    num_q_heads=hq)
        kind = path.kernel_for(jax_backend.impl, call)
        if kind is not None:
            kinds.add(kind == "triton")
    return tuple(sorted(kinds))


def importer_device(model_runner) -> torch.device:
    return model_runner.req_to_token_pool.req_to_token.device


def eager_shape(mode: ForwardMode, bs: int, tokens: int, spec, has_ext: bool, has_enc: bool,
                min_rows: int = jbatch.RAGGED_MIN_ROWS) -> Tuple[int, int]:
    """(rows, tokens) an eager plan of ``bs`` requests and ``tokens`` tokens is compiled for: for ragged modes
    (extend, mixed, draft extend) ``jax_attn.batch.ragged_rows(bs, min_rows)`` and the token class
    (``jax_attn.batch.token_class``), for uniform modes the batch class (``jax_attn.batch.batch_class``) and
    their tokens per request. Tree (topk > 1) and cross-attention steps plan at their exact shape."""
    if (spec is not None and spec.topk > 1) or has_enc:
        return bs, tokens
    if has_ext:
        return jbatch.ragged_rows(bs, min_rows), jbatch.token_class(tokens)
    pbs = jbatch.batch_class(bs)
    return pbs, pbs * (tokens // bs)


def pad_as_is(x: torch.Tensor, size: int, fill: int) -> torch.Tensor:
    """``x`` (1-D) padded with ``fill`` to ``size`` entries in its own dtype: a padded eager plan takes the
    same input widths, so the same compiled planner, as an unpadded one of its class. Already ``size``
    entries (the rows of a batch at its class, padded tokens only): ``x`` as it is, no copy."""
    x = x.reshape(-1)
    if x.numel() == size:
        return x
    return torch.cat([x, x.new_full((size - x.numel(),), fill)])
