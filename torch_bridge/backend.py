"""SGLang's attention-backend interface for torch engines, running jax_attn through DLPack.

    backend = FlashAttentionBackend(model_runner)
    backend.init_forward_metadata(forward_batch)          # once per step: int32 inputs, JAX plan
    o = backend.forward(q, k, v, layer, forward_batch)    # per layer: torch KV write, JAX attention

Per step, the engine's (int64) index tensors are converted to int32 and packed into one tensor in
torch, imported once, and planned by a compiled JAX function (no host sync). Per layer, torch
writes the step's K/V into its own pool (``set_kv_buffer``); then either the Mosaic kernel is
launched on torch's stream (the launch path below), or ``q`` is imported, the pools are read
through views imported once, one compiled executable runs, and the output is exported back.
JAX never writes torch memory. See ``torch_bridge.dlpack`` for stream ordering.

Tree speculative decoding (topk > 1) runs jax_attn's cascade (prefix pass + expand pass +
``merge_state``):

* target verify: ``spec_info.custom_mask`` is SGLang's flat bool tree mask (per request, ``N``
  rows of ``seq_len + N`` columns, requests one after another). It joins the packed import as
  int32 words, zero-padded to a static length (eager: the next power of two of its length;
  capture/replay: ``bucket * N * (max_context_len + N)``), and the planner extracts the draft
  columns on device (``jax_attn.spec.draft_mask_from_custom_mask``): no host sync. Sliding-window
  layers need ``model_runner.sliding_window_size >= 0`` so the plan carries the SWA table.
* draft decode: ``init_forward_metadata`` (and the replay hook) takes SGLang's full
  ``out_cache_loc`` of every draft step, ``[bs, topk, num_steps]`` flattened (branch ``k`` of
  request ``b`` writes step ``s`` at ``[b, k, s]``); ``forward`` accepts that same tensor or just
  this step's ``[bs * topk]`` slots (SGLang's per-step ``out_cache_loc[step]``) and writes column
  ``speculative_step_id``. topk <= 1 draft decode takes ``[bs]`` or ``[bs, 1, num_steps]`` alike.

Cross attention: ``forward_batch.encoder_lens`` plans the encoder table (a request's
``req_to_token`` row holds its encoder slots first); a layer with ``is_cross_attention`` writes
its K/V at ``forward_batch.encoder_out_cache_loc`` and attends non-causally over the encoder
tokens. The static bound on encoder lengths is the constructor's ``max_encoder_len``, else the
request table's width (no extra model-config attribute needed).

The SGLang 0.5.11 attributes read, and those that raise ``NotImplementedError``, are listed in
``docs/sglang_contract.md``; ``torch_bridge.checks.RunnerSettings`` reads the model runner's.

Launch path (Hopper GPUs, ``impl`` ``auto`` or ``mosaic``): layers the Mosaic kernel covers (bf16/f16,
head dim 64/128, page size a multiple of 8, no tree step, no cross attention) skip JAX at run time:
torch writes K/V, the kernel is launched on torch's current stream by ``torch_bridge.launcher`` with
tables made once per step (``torch_bridge.mosaic_path``). Such a forward is captured by
``torch.cuda.graph`` (run the bucket once before capturing, as SGLang's graph runner does); the
replay hook refreshes the tables in the persistent buffers the graph reads.

Other layers run a compiled JAX executable per layer. A JAX computation cannot be captured by
``torch.cuda.graph``, so such a forward call during a capture raises. The capture/replay hooks
compile the plan of each batch bucket ahead of time and replay pads the batch with SGLang's rules;
attention executables are compiled by the first forward of each bucket and reused afterwards.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jax_attn import batch as jbatch
from jax_attn.backend import FlashAttentionBackend as JaxBackend
from jax_attn.backend import LayerParams, PlanKey, guard_plan, plan_arrays
from jax_attn.kv_cache import KVPool
from jax_attn.metadata import ForwardMode
from jax_attn.multistep import plan_draft_steps
from jax_attn.spec import draft_mask_from_custom_mask
from jax_attn.batch import accepted_tokens
from jax_attn import safety
from torch_bridge.checks import (RunnerSettings, check_host_lengths, check_layer, check_local, check_shapes,
                                 SafeLocs, pool_slots, write_loc)
from torch_bridge.dlpack import Importer, capturing, check_not_capturing, export, pack_mask_words, pad_int32, to_int32
from torch_bridge.mosaic_path import WARM_UP_MESSAGE, LayerHit, MosaicPath, Tables
from torch_bridge.translate import (UNIFORM, custom_mask, extend_lens, layer_params, loc_steps, locs_per_token,
                                    plan_locs, to_mode)

@dataclasses.dataclass(frozen=True)
class _Step:
    """The current step's plan, shared by every layer (the interface's one piece of state)."""

    key: PlanKey
    treedef: Any  # AttentionMetadata's pytree structure (carries the static fields)
    leaves: Tuple[jax.Array, ...]  # AttentionMetadata's arrays
    real_tokens: int  # tokens the engine passes when it does not pad (replay pads to key.num_tokens)
    loc_steps: int = 1  # draft decode: out_cache_loc may carry num_steps slots per query token
    graph: bool = False  # planned by the capture/replay hooks (kernel tables in persistent buffers)
    tables: Dict[Tuple[int, int], Tables] = dataclasses.field(default_factory=dict)  # (Hq, Hkv) -> tables


@dataclasses.dataclass(frozen=True)
class _Packing:
    """Static layout of one step's packed int32 inputs (one import per step) and what to plan."""

    key: PlanKey
    num_locs: int  # out_cache_loc entries (tree draft decode: B * topk * num_steps)
    has_ext: bool = False  # extend_seq_lens (extend modes)
    has_enc: bool = False  # encoder_lens (cross attention)
    mask_words: int = 0  # int32 words of the flat verify custom mask (tree verify)
    all_steps: int = 0  # > 0: plan draft steps 0..all_steps-1 at once (multi-step backend)
    exact: bool = False  # eager: extend lengths must cover every token (no bucket padding)

    def sizes(self) -> Tuple[int, ...]:
        b = self.key.batch_size
        return (b, b, self.num_locs, b * self.has_ext, b * self.has_enc, self.mask_words)


class FlashAttentionBackend:
    """SGLang's ``FlashAttentionBackend`` interface over jax_attn.

    Args:
      model_runner: SGLang's ``ModelRunner`` or ``torch_bridge.types.ModelRunner`` (the attributes
        read are listed in ``torch_bridge.types``).
      skip_prefill: accepted for SGLang compatibility (draft backends); no effect here.
      speculative_step_id: draft decode step: KV length = seq_lens + step_id + 1 (topk <= 1), or
        the branch's draft slots of steps ``0..step_id`` (topk > 1).
      topk: EAGLE topk, used when ``server_args.speculative_eagle_topk`` is None (SGLang reads that
        one); > 1 runs target verify and draft decode as tree (cascade) attention.
      speculative_num_steps: draft steps (the last axis of tree draft decode's ``out_cache_loc``).
      fa_impl_ver: SGLang's FlashAttention version (3 or 4): accepted, same attention either way.
      impl: jax_attn implementation; default ``model_runner.attention_impl`` or ``"auto"``.
      max_encoder_len: static bound on encoder lengths (cross attention); default
        ``model_runner.model_config.max_encoder_len`` when present, else the request table's width.
      validate: validation mode (``jax_attn.safety``): every plan's error flag is read back (a host
        sync) and a bad step raises before any layer writes; default ``JAX_ATTN_VALIDATE=1``.
      mosaic_path: the Mosaic launch path (``torch_bridge.mosaic_path.MosaicPath``) for the layers
        it covers; default: one on Hopper GPUs when ``impl`` is ``auto`` or ``mosaic``; False: off
        (every layer runs a compiled JAX executable).
    """

    def __init__(self, model_runner, skip_prefill: bool = False, speculative_step_id: int = 0,
                 topk: int = 0, speculative_num_steps: int = 0, fa_impl_ver: int = 3, *,
                 impl: Optional[str] = None, max_encoder_len: Optional[int] = None, mosaic_path=None,
                 validate: Optional[bool] = None):
        self.settings = RunnerSettings.of(model_runner, fa_impl_ver, topk)
        self.model_runner = model_runner
        self.skip_prefill = skip_prefill
        self.speculative_step_id = speculative_step_id
        self.topk = self.settings.topk
        self.fa_impl_ver = fa_impl_ver
        self.speculative_num_steps = speculative_num_steps
        self.page_size = int(getattr(model_runner, "page_size", 1))
        self.num_draft_tokens = self.settings.num_draft_tokens
        self.with_swa = self.settings.with_swa  # tree verify plans carry the SWA table
        r2t = model_runner.req_to_token_pool.req_to_token
        if r2t.dtype != torch.int32 or r2t.dim() != 2:
            raise ValueError(f"req_to_token {r2t.dtype=} {r2t.shape=} must be a 2-D torch.int32 tensor "
                             "(SGLang's ReqToTokenPool layout)")
        self.importer = Importer(r2t.device)
        self.device = r2t.device
        config = getattr(model_runner, "model_config", None)
        self.max_context_len = min(int(getattr(config, "context_len", r2t.shape[1])), r2t.shape[1])
        if max_encoder_len is None:  # a static bound every encoder length fits: the request table's width
            max_encoder_len = int(getattr(config, "max_encoder_len", 0) or r2t.shape[1])
        impl = impl or getattr(model_runner, "attention_impl", "auto")
        self.num_slots = pool_slots(getattr(model_runner, "token_to_kv_pool", None))
        self._safe_locs = SafeLocs(self.num_slots)
        self.jax_backend = JaxBackend(self.importer.view(r2t), page_size=self.page_size,
                                      max_context_len=self.max_context_len, impl=impl,
                                      deterministic=self.settings.deterministic, max_encoder_len=max_encoder_len,
                                      num_slots=self.num_slots, validate=validate)
        self._plan_jit = jax.jit(self._plan_fn, static_argnums=0)
        self._attn_jit = jax.jit(self._attn_fn, static_argnums=(0, 1))
        self._plan_exes: Dict[tuple, Any] = {}
        self._attn_exes: Dict[tuple, Any] = {}
        self._layers: Dict[int, Tuple[Any, LayerParams]] = {}
        self._step: Optional[_Step] = None
        self._step_exes: Dict[tuple, Any] = {}
        self._graph_max: Optional[Tuple[int, int]] = None
        self._graph_keys: Dict[Tuple[ForwardMode, int], PlanKey] = {}
        self.trace_count = 0  # traces of the plan / attention functions (tests assert no retrace)
        if mosaic_path is None:
            mosaic_path = MosaicPath.for_device(self.device, impl)
        self.mosaic_path = mosaic_path or None
        self._launch_heads: set = set()  # (Hq, Hkv) of layers on the launch path: their tables are made per step
        self._hits: Dict[int, LayerHit] = {}  # layer_id -> the layer's checked launch (see ``_run``)

    def share_compiled(self, other: "FlashAttentionBackend") -> None:
        """Reuse ``other``'s imported views and compiled executables (same runner and settings)."""
        self.importer, self.jax_backend = other.importer, other.jax_backend
        self._plan_exes, self._attn_exes = other._plan_exes, other._attn_exes
        self.mosaic_path, self._launch_heads = other.mosaic_path, other._launch_heads

    # ---- traced functions -------------------------------------------------------------------
    def _plan_fn(self, pk: _Packing, req_to_token, packed):  # packed: i32[sum(pk.sizes())]
        self.trace_count += 1
        offs = np.cumsum((0,) + pk.sizes())
        rows, lens, loc, ext, enc, words = (packed[a:b] for a, b in zip(offs[:-1], offs[1:]))
        key = pk.key
        if pk.all_steps:
            plans = plan_draft_steps(req_to_token, rows, lens, loc, topk=key.topk, num_steps=pk.all_steps,
                                     page_size=key.page_size, max_pages=key.max_pages)
            return guard_plan(plans, key, req_to_token, rows)
        mask = None
        if pk.mask_words:
            flat = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)  # [4 * words] mask bytes
            mask = draft_mask_from_custom_mask(flat, lens, num_draft=key.q_len_per_req)
        md = plan_arrays(key, req_to_token, rows, lens, loc, ext if pk.has_ext else None,
                         enc if pk.has_enc else None, mask)
        if pk.exact and pk.has_ext:  # fewer extend tokens than slots would send the rest to the padding slot
            md = safety.flag(md, md.cu_seqlens_q[-1] != md.num_tokens, 16)
        return md

    def _attn_fn(self, layer: LayerParams, treedef, q, k_buffer, v_buffer, sinks, *leaves):
        # q [T, Hq, D]; k_buffer [num_slots, Hkv, D]; v_buffer [num_slots, Hkv, Dv]; sinks [Hq] | None
        self.trace_count += 1
        md = jax.tree_util.tree_unflatten(treedef, leaves)
        sinks = None if sinks is None else sinks.astype(np.float32)
        out, _ = self.jax_backend.forward(q, None, None, layer, KVPool(k_buffer, v_buffer), md,
                                          sinks=sinks, save_kv_cache=False)
        return out

    # ---- per step ---------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch) -> None:
        """Plan one step (eager): convert the index tensors once, run the JAX planner."""
        mode = to_mode(forward_batch.forward_mode)
        if mode == ForwardMode.IDLE:
            self._step = None
            return
        spec = self._spec(forward_batch.spec_info, mode)
        ext = extend_lens(mode, forward_batch.extend_seq_lens, forward_batch.spec_info)
        enc = getattr(forward_batch, "encoder_lens", None)
        bs = int(forward_batch.seq_lens.shape[0])
        if bs == 0:
            raise ValueError(f"a {mode.name} batch of size 0: SGLang plans an empty step as ForwardMode.IDLE")
        loc = plan_locs(forward_batch.out_cache_loc, spec, mode, bs, self.speculative_step_id)
        tokens = int(loc.shape[0]) // locs_per_token(spec, mode)
        key = self._key(mode, bs, tokens, spec, ext is not None, enc is not None)
        check_host_lengths(forward_batch, mode, tokens, ext is not None, capacity=self.jax_backend.capacity,
                           kv_offset=key.kv_offset)
        words = None
        if key.topk > 1 and mode == ForwardMode.TARGET_VERIFY:
            n = int(custom_mask(forward_batch.spec_info).numel())
            words = pack_mask_words(forward_batch.spec_info.custom_mask, max(64, 1 << (n - 1).bit_length()),
                                    self.device)
        pk = dataclasses.replace(self._packing(key, loc, ext, enc, words), exact=True)
        md = self._run_plan(pk, forward_batch.req_pool_indices, forward_batch.seq_lens, loc, ext, enc, words)
        self._install(key, md, tokens, loc_steps(spec, mode))

    def _spec(self, spec_info, mode: ForwardMode) -> Optional[jbatch.SpecInfo]:
        """jax_attn's static SpecInfo from EAGLE's spec_info and this backend's settings."""
        speculative = mode == ForwardMode.TARGET_VERIFY or mode.is_draft_extend()
        if not speculative and (spec_info is None or mode != ForwardMode.DECODE):
            return None
        topk = self._topk(spec_info)
        if mode.is_draft_extend():
            topk = 1  # draft extend is a causal extend over the accepted tokens, never a tree
        draft = int(getattr(spec_info, "draft_token_num", 0) or 0) or self.num_draft_tokens
        if mode == ForwardMode.TARGET_VERIFY and draft < 1:
            raise ValueError("target verify needs spec_info.draft_token_num or "
                             "server_args.speculative_num_draft_tokens >= 1")
        steps = max(self.speculative_num_steps, 1)
        if topk > 1 and mode == ForwardMode.DECODE and not 0 <= self.speculative_step_id < steps:
            raise ValueError(f"tree draft decode step {self.speculative_step_id} needs speculative_num_steps > "
                             f"step id (got {self.speculative_num_steps}); pass it to the backend")
        placeholder = np.zeros((1, draft, draft), bool) if topk > 1 else None  # the mask itself is planned on device
        return jbatch.SpecInfo(topk=topk, num_draft_tokens=draft, step_id=self.speculative_step_id,
                               num_steps=steps, draft_mask=placeholder,
                               with_swa=self.with_swa and mode == ForwardMode.TARGET_VERIFY)

    def _topk(self, spec_info) -> int:
        """SGLang's ``server_args.speculative_eagle_topk`` (or the constructor's ``topk``); without
        either, an EAGLE ``spec_info.topk``. A spec_info that disagrees with the server raises."""
        own = getattr(spec_info, "topk", None)
        own = int(own) if isinstance(own, int) and own > 0 else 0
        if self.topk > 0 and own and own != self.topk:
            raise ValueError(f"spec_info.topk={own} differs from server_args.speculative_eagle_topk={self.topk}")
        return max(self.topk or own, 1)

    def _key(self, mode, bs: int, tokens: int, spec, has_ext: bool, has_enc: bool = False) -> PlanKey:
        """The static plan key, through jax_attn's own rules (one place for offsets and modes)."""
        z = np.zeros(bs, np.int32)
        locs = np.zeros(tokens * locs_per_token(spec, mode), np.int32)
        shape_batch = jbatch.ForwardBatch(mode, z, z, locs, extend_seq_lens=z if has_ext else None,
                                          encoder_lens=z if has_enc else None, spec_info=spec)
        return self.jax_backend.plan_static(shape_batch)

    def _packing(self, key: PlanKey, loc, ext, enc, words, all_steps: int = 0) -> _Packing:
        return _Packing(key, int(loc.shape[0]), ext is not None, enc is not None,
                        0 if words is None else int(words.shape[0]), all_steps)

    def _run_plan(self, pk: _Packing, req_pool_indices, seq_lens, loc, ext=None, enc=None, words=None):
        """Pack the step's index tensors into one int32 tensor, import it once, run the planner."""
        packed = to_int32(req_pool_indices, seq_lens, loc, ext, enc, words)
        if packed.device != self.device:
            raise ValueError(f"index tensors on {packed.device} must be on the pools' device {self.device}")
        if packed.shape[0] != sum(pk.sizes()):
            raise ValueError(f"req_pool_indices / seq_lens / extend_seq_lens / encoder_lens must have one entry "
                             f"per request ({pk.key.batch_size}); got {packed.shape[0]} packed entries, "
                             f"expected {sum(pk.sizes())}")
        r2t = self.importer.view(self.model_runner.req_to_token_pool.req_to_token)
        ck = (pk, r2t.shape)
        exe = self._plan_exes.get(ck)
        if exe is None:
            spec = jax.ShapeDtypeStruct((int(packed.shape[0]),), np.int32)
            exe = self._plan_exes[ck] = self._plan_jit.lower(pk, r2t, spec).compile()
        return exe(r2t, self.importer(packed))

    def _install(self, key: PlanKey, md, real_tokens: int, loc_steps: int = 1, graph: bool = False) -> None:
        if self.jax_backend.validate:
            self._step = None  # a bad step raises here, before any layer writes the cache
            safety.check(md, "torch_bridge plan")
        leaves, treedef = jax.tree_util.tree_flatten(md)
        step = self._step = _Step(key, treedef, tuple(leaves), real_tokens, loc_steps, graph)
        self._step_exes = {}
        if self.mosaic_path is not None and key.topk == 1:  # tables for the layer shapes seen so far
            for heads in self._launch_heads:
                step.tables[heads] = self.mosaic_path.tables(treedef, step.leaves, key, heads, graph)

    # ---- capture / replay -------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Set the largest batch / token bucket the capture hook will be asked for."""
        self._graph_max = (int(max_bs), int(max_num_tokens))
        self._graph_keys = {}

    def init_forward_metadata_capture_cuda_graph(self, bs: int, num_tokens: int, req_pool_indices,
                                                 seq_lens, encoder_lens, forward_mode, spec_info) -> None:
        """Compile the plan of bucket ``bs`` ahead of time and plan the capture run with it."""
        if self._graph_max is None:
            raise RuntimeError("call init_cuda_graph_state(max_bs, max_num_tokens) before capturing")
        if bs > self._graph_max[0] or num_tokens > self._graph_max[1]:
            raise ValueError(f"{bs=}, {num_tokens=} exceed init_cuda_graph_state's {self._graph_max}")
        mode = to_mode(forward_mode)
        spec = self._spec(spec_info, mode)
        per_req = self._tokens_per_req(mode, spec)
        if num_tokens != bs * per_req:
            raise ValueError(f"{mode.name}: {num_tokens=} must be bs * {per_req} = {bs * per_req}")
        has_enc = encoder_lens is not None
        key = self._key(mode, bs, num_tokens, spec, mode not in UNIFORM, has_enc)
        self._graph_keys[(mode, bs)] = key
        self._replay(key, spec, req_pool_indices, seq_lens, encoder_lens, spec_info, None, capturing=True)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices, seq_lens, seq_lens_sum,
                                                encoder_lens, forward_mode, spec_info, seq_lens_cpu,
                                                out_cache_loc=None) -> None:
        """Pad the batch to bucket ``bs`` (seq_len 1, row 0, slot 0) and run the captured plan."""
        mode = to_mode(forward_mode)
        key = self._graph_keys.get((mode, bs))
        if key is None:
            raise ValueError(f"no captured plan for {mode.name} bs={bs}; call "
                             "init_forward_metadata_capture_cuda_graph for this bucket first")
        if key.has_encoder != (encoder_lens is not None):
            raise ValueError(f"bucket bs={bs} was captured with{'' if key.has_encoder else 'out'} encoder_lens; "
                             "replay must pass the same kind of batch")
        spec = self._spec(spec_info, mode)  # same checks as capture (topk, steps)
        self._replay(key, spec, req_pool_indices, seq_lens, encoder_lens, spec_info, out_cache_loc)

    def _tokens_per_req(self, mode: ForwardMode, spec) -> int:
        if mode == ForwardMode.DECODE:
            return spec.topk if spec is not None else 1
        if mode == ForwardMode.TARGET_VERIFY or mode.is_draft_extend():
            if spec is None or spec.num_draft_tokens < 1:
                raise ValueError(f"{mode.name} capture needs speculative_num_draft_tokens >= 1")
            return spec.num_draft_tokens
        raise ValueError(f"{mode.name} is not capturable (ragged tokens per request); plan it eagerly "
                         "with init_forward_metadata")

    def _replay(self, key: PlanKey, spec, req_pool_indices, seq_lens, encoder_lens, spec_info, out_cache_loc,
                capturing: bool = False) -> None:
        bs, tokens, mode = key.batch_size, key.num_tokens, key.mode
        n = min(int(seq_lens.shape[0]), bs)
        rows = pad_int32(req_pool_indices[:n], bs, 0)
        lens = pad_int32(seq_lens[:n], bs, jbatch.SEQ_LEN_FILL_VALUE)
        loc = rows[:0] if out_cache_loc is None else plan_locs(out_cache_loc, spec, mode, None, self.speculative_step_id)
        loc = pad_int32(loc, tokens * locs_per_token(spec, mode), 0)
        enc = None if encoder_lens is None else pad_int32(encoder_lens[:n], bs, 0)
        ext = None
        real = n * (tokens // bs)
        if mode not in UNIFORM:  # draft extend: each request's accepted tokens (capture: one each)
            acc = accepted_tokens(spec_info)
            if acc is None and not capturing:
                raise ValueError("draft extend replay needs spec_info.num_accepted_tokens (or accept_length)")
            ext = pad_int32(acc[:n] if acc is not None else rows[:n] * 0 + 1, bs, 0)
            real = tokens  # draft extend replays the padded token layout
        words = None
        if key.topk > 1 and mode == ForwardMode.TARGET_VERIFY:
            mask = getattr(spec_info, "custom_mask", None) if capturing else custom_mask(spec_info)
            n_draft = key.q_len_per_req  # the static bound covers any committed lengths of the bucket
            words = pack_mask_words(mask, bs * n_draft * (self.max_context_len + n_draft), self.device)
        md = self._run_plan(self._packing(key, loc, ext, enc, words), rows, lens, loc, ext, enc, words)
        self._install(key, md, real, loc_steps(spec, mode), graph=True)

    def check(self) -> None:
        """Raise ``ValueError`` when the current step's plan flagged bad input (reads the flag: a sync)."""
        if self._step is not None:
            safety.check(jax.tree_util.tree_unflatten(self._step.treedef, self._step.leaves), "torch_bridge plan")

    @staticmethod
    def get_cuda_graph_seq_len_fill_value() -> int:
        return jbatch.SEQ_LEN_FILL_VALUE

    # ---- per layer ---------------------------------------------------------------------------
    def forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """SGLang's dispatch: idle -> empty, decode -> ``forward_decode``, else ``forward_extend``."""
        mode = to_mode(forward_batch.forward_mode)
        if mode == ForwardMode.IDLE:
            return q.new_empty(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
        fn = self.forward_decode if mode == ForwardMode.DECODE else self.forward_extend
        return fn(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       q_rope=None, k_rope=None, sinks=None):
        """Extend / mixed / verify / draft extend: ``q [T, Hq * D]`` -> ``[T, Hq * Dv]``."""
        return self._run(q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope, sinks)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       q_rope=None, k_rope=None, sinks=None):
        """Decode / draft decode: ``q [B * q_len, Hq * D]`` -> ``[B * q_len, Hq * Dv]``."""
        return self._run(q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope, sinks)

    def _run(self, q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope, sinks):
        if q_rope is not None or k_rope is not None:
            raise NotImplementedError("q_rope / k_rope (MLA, absorbed latent attention) is not supported "
                                      "by torch_bridge yet")
        step = self._step
        if step is None:
            raise RuntimeError("call init_forward_metadata (or the replay hook) before forward")
        check_local(layer, self.settings)
        out = self._attend(q, k, v, layer, forward_batch, save_kv_cache, sinks, step)
        dest = getattr(forward_batch, "_attn_output", None)  # SGLang's preallocated output (extend path)
        if dest is not None and dest.data_ptr() != out.data_ptr():
            return dest.view(out.shape).copy_(out)
        return out

    def _attend(self, q, k, v, layer, forward_batch, save_kv_cache, sinks, step: _Step):
        hit = self._hits.get(layer.layer_id)
        if hit is not None and step.loc_steps == 1 and hit.matches(layer, step.tables, q, forward_batch, sinks):
            return hit(q, k, v, self._safe_locs(forward_batch.out_cache_loc, step) if save_kv_cache else None, sinks)
        lp = self._layer_params(layer)
        check_layer(lp, step.key)
        pool = forward_batch.token_to_kv_pool
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        t = check_shapes(q, lp, step, k_buf, v_buf, self.page_size)
        call = self._launch_call(lp, step, q, k_buf, v_buf, sinks)
        if call is None:
            check_not_capturing()
        loc = None
        if save_kv_cache and k is not None:
            loc = self._safe_locs(write_loc(forward_batch, step, lp, t, k, v, self.speculative_step_id), step)
        if call is not None:
            hit = self._hits[layer.layer_id] = LayerHit(layer, lp, call, pool, (k_buf, v_buf), sinks is None)
            return hit(q, k, v, loc, sinks)
        if loc is not None:
            pool.set_kv_buffer(layer, loc, k, v, lp.k_scale, lp.v_scale)
        q = q.reshape(t, lp.num_q_heads, lp.head_dim)
        if t != step.key.num_tokens:
            q = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, step.key.num_tokens - t))
        elif not q.is_contiguous():
            q = q.contiguous()
        fast = (layer.layer_id, lp, t, q.dtype, k_buf.data_ptr(), v_buf.data_ptr(), sinks is None)
        exe = self._step_exes.get(fast)
        views = (self.importer.view(k_buf), self.importer.view(v_buf),
                 None if sinks is None else self.importer.view(sinks, strict=False))
        jq = self.importer(q)
        if exe is None:
            exe = self._step_exes[fast] = self._attn_exe(lp, step, jq, *views)
        out = export(exe(jq, *views, *step.leaves))
        return out if t == step.key.num_tokens else out[:t]

    def _launch_call(self, lp: LayerParams, step: _Step, q, k_buf, v_buf, sinks):
        """This layer's bound Mosaic launch when the launch path covers the call, else None."""
        path = self.mosaic_path
        if path is None or path.reason(lp, step.key, q, k_buf, v_buf) is not None:
            return None
        heads = (lp.num_q_heads, lp.num_kv_heads)
        tables = step.tables.get(heads)
        if tables is None:
            if capturing():
                raise RuntimeError(WARM_UP_MESSAGE)
            tables = step.tables[heads] = path.tables(step.treedef, step.leaves, step.key, heads, step.graph)
            self._launch_heads.add(heads)
        if sinks is not None and tables.pack > 1:
            return None  # sinks with packed decode rows: the JAX path
        return path.layer_call(lp, step.key, tables, q, k_buf, v_buf, sinks is not None)

    def _attn_exe(self, lp: LayerParams, step: _Step, q, k_buf, v_buf, sinks):
        def sig(x):
            return None if x is None else (x.shape, x.dtype)
        ck = (lp, step.treedef, sig(q), sig(k_buf), sig(v_buf), sig(sinks))
        exe = self._attn_exes.get(ck)
        if exe is None:
            exe = self._attn_exes[ck] = self._attn_jit.lower(
                lp, step.treedef, q, k_buf, v_buf, sinks, *step.leaves).compile()
        return exe

    def _layer_params(self, layer) -> LayerParams:
        hit = self._layers.get(layer.layer_id)
        if hit is not None and hit[0] is layer:
            return hit[1]
        lp = layer_params(layer)
        self._layers[layer.layer_id] = (layer, lp)
        return lp
