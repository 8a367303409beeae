"""SGLang's attention-backend interface for torch engines, running jax_attn through DLPack.

    backend = FlashAttentionBackend(model_runner)
    backend.init_forward_metadata(forward_batch)          # once per step: int32 inputs, JAX plan
    o = backend.forward(q, k, v, layer, forward_batch)    # per layer: torch KV write, JAX attention

Per step, the engine's (int64) index tensors are converted to int32 and packed into one tensor in
torch, imported once, and planned by a compiled JAX function (no host sync). Per layer, torch
writes the step's K/V into its own pool (``set_kv_buffer``), ``q`` is imported, the pools are read
through views imported once, one compiled executable runs, and the output is exported back.
JAX never writes torch memory. See ``torch_bridge.dlpack`` for stream ordering.

CUDA graphs: a JAX computation cannot be captured by ``torch.cuda.graph``; a forward call during a
capture raises. The capture/replay hooks instead compile the plan of each batch bucket ahead of
time and replay pads the batch with SGLang's rules; attention executables are compiled by the
first forward of each bucket and reused afterwards (no retrace).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional, Tuple

import jax
import numpy as np
import torch

from jax_attn import batch as jbatch
from jax_attn.backend import FlashAttentionBackend as JaxBackend
from jax_attn.backend import LayerParams, PlanKey, plan_arrays
from jax_attn.kv_cache import KVPool
from jax_attn.metadata import ForwardMode
from torch_bridge.dlpack import Importer, check_not_capturing, export, to_int32

_UNIFORM = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)


@dataclasses.dataclass(frozen=True)
class _Step:
    """The current step's plan, shared by every layer (the interface's one piece of state)."""

    key: PlanKey
    treedef: Any  # AttentionMetadata's pytree structure (carries the static fields)
    leaves: Tuple[jax.Array, ...]  # AttentionMetadata's arrays
    real_tokens: int  # tokens the engine passes when it does not pad (replay pads to key.num_tokens)


def to_mode(mode) -> ForwardMode:
    """SGLang's ``ForwardMode`` (or ours) -> ``jax_attn.metadata.ForwardMode`` by name."""
    if isinstance(mode, ForwardMode):
        return mode
    try:
        return ForwardMode[mode.name]
    except (KeyError, AttributeError):
        raise NotImplementedError(f"forward mode {mode!r} is not supported by torch_bridge") from None


class FlashAttentionBackend:
    """SGLang's ``FlashAttentionBackend`` interface over jax_attn.

    Args:
      model_runner: SGLang's ``ModelRunner`` or ``torch_bridge.types.ModelRunner`` (the attributes
        read are listed in ``torch_bridge.types``).
      skip_prefill: accepted for SGLang compatibility (draft backends); no effect here.
      speculative_step_id: draft decode step: KV length = seq_lens + step_id + 1.
      topk: EAGLE topk; > 1 (cascade speculative decoding) raises NotImplementedError on use.
      speculative_num_steps: accepted for SGLang compatibility.
      impl: jax_attn implementation; default ``model_runner.attention_impl`` or ``"auto"``.
    """

    def __init__(self, model_runner, skip_prefill: bool = False, speculative_step_id: int = 0,
                 topk: int = 0, speculative_num_steps: int = 0, *, impl: Optional[str] = None):
        self.model_runner = model_runner
        self.skip_prefill = skip_prefill
        self.speculative_step_id = speculative_step_id
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.page_size = int(getattr(model_runner, "page_size", 1))
        args = getattr(model_runner, "server_args", None)
        self.num_draft_tokens = int(getattr(args, "speculative_num_draft_tokens", None) or 0)
        r2t = model_runner.req_to_token_pool.req_to_token
        if r2t.dtype != torch.int32 or r2t.dim() != 2:
            raise ValueError(f"req_to_token {r2t.dtype=} {r2t.shape=} must be a 2-D torch.int32 tensor "
                             "(SGLang's ReqToTokenPool layout)")
        self.importer = Importer(r2t.device)
        self.device = r2t.device
        ctx = int(getattr(getattr(model_runner, "model_config", None), "context_len", r2t.shape[1]))
        impl = impl or getattr(model_runner, "attention_impl", "auto")
        self.jax_backend = JaxBackend(self.importer.view(r2t), page_size=self.page_size,
                                      max_context_len=min(ctx, r2t.shape[1]), impl=impl,
                                      deterministic=bool(getattr(args, "enable_deterministic_inference", False)))
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

    # ---- traced functions -------------------------------------------------------------------
    def _plan_fn(self, key: PlanKey, req_to_token, packed):  # packed: i32[2 * B + T (+ B)]
        self.trace_count += 1
        b, t = key.batch_size, key.num_tokens
        ext = packed[2 * b + t:3 * b + t] if key.mode not in _UNIFORM else None
        return plan_arrays(key, req_to_token, packed[:b], packed[b:2 * b], packed[2 * b:2 * b + t], ext)

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
        if getattr(forward_batch, "encoder_lens", None) is not None:
            raise NotImplementedError("cross attention (encoder_lens) is not supported by torch_bridge yet")
        spec = self._spec(forward_batch.spec_info, mode)
        ext = self._extend_lens(mode, forward_batch.extend_seq_lens, forward_batch.spec_info)
        bs, tokens = int(forward_batch.seq_lens.shape[0]), int(forward_batch.out_cache_loc.shape[0])
        key = self._key(mode, bs, tokens, spec, ext is not None)
        self._set_step(key, tokens, forward_batch.req_pool_indices, forward_batch.seq_lens,
                       forward_batch.out_cache_loc, ext)

    def _spec(self, spec_info, mode: ForwardMode) -> Optional[jbatch.SpecInfo]:
        """jax_attn's static SpecInfo from EAGLE's spec_info and this backend's settings."""
        speculative = mode == ForwardMode.TARGET_VERIFY or mode.is_draft_extend()
        if not speculative and (spec_info is None or mode != ForwardMode.DECODE):
            return None
        topk = max(self.topk, int(getattr(spec_info, "topk", 0) or 0), 1)
        if topk > 1:
            raise NotImplementedError(
                f"{mode.name} with topk={topk} needs cascade speculative decoding (tree drafts: prefix "
                "pass + expand pass + merge_state), which torch_bridge does not implement yet; use topk=1")
        draft = int(getattr(spec_info, "draft_token_num", 0) or 0) or self.num_draft_tokens
        if mode == ForwardMode.TARGET_VERIFY and draft < 1:
            raise ValueError("target verify needs spec_info.draft_token_num or "
                             "server_args.speculative_num_draft_tokens >= 1")
        return jbatch.SpecInfo(topk=topk, num_draft_tokens=draft, step_id=self.speculative_step_id)

    @staticmethod
    def _extend_lens(mode: ForwardMode, extend_seq_lens, spec_info):
        if mode in _UNIFORM:
            return None
        if extend_seq_lens is None and mode.is_draft_extend():
            return spec_info.accept_length + 1
        if extend_seq_lens is None:
            raise ValueError(f"{mode.name} needs forward_batch.extend_seq_lens (new tokens per request)")
        return extend_seq_lens

    def _key(self, mode, bs: int, tokens: int, spec, has_ext: bool) -> PlanKey:
        """The static plan key, through jax_attn's own rules (one place for offsets and modes)."""
        shape_batch = jbatch.ForwardBatch(
            mode, np.zeros(bs, np.int32), np.zeros(bs, np.int32), np.zeros(tokens, np.int32),
            extend_seq_lens=np.zeros(bs, np.int32) if has_ext else None, spec_info=spec)
        return self.jax_backend.plan_static(shape_batch)

    def _set_step(self, key: PlanKey, real_tokens: int, req_pool_indices, seq_lens, out_cache_loc, ext):
        packed = to_int32(req_pool_indices, seq_lens, out_cache_loc, ext)
        if packed.device != self.device:
            raise ValueError(f"index tensors on {packed.device} must be on the pools' device {self.device}")
        r2t = self.importer.view(self.model_runner.req_to_token_pool.req_to_token)
        exe = self._plan_exe(key, r2t, packed)
        md = exe(r2t, self.importer(packed))
        leaves, treedef = jax.tree_util.tree_flatten(md)
        self._step = _Step(key, treedef, tuple(leaves), real_tokens)
        self._step_exes = {}

    def _plan_exe(self, key: PlanKey, r2t, packed: torch.Tensor):
        ck = (key, r2t.shape, int(packed.shape[0]))
        exe = self._plan_exes.get(ck)
        if exe is None:
            spec = jax.ShapeDtypeStruct((int(packed.shape[0]),), np.int32)
            exe = self._plan_exes[ck] = self._plan_jit.lower(key, r2t, spec).compile()
        return exe

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
        if encoder_lens is not None:
            raise NotImplementedError("cross attention (encoder_lens) is not supported by torch_bridge yet")
        spec = self._spec(spec_info, mode)
        per_req = self._tokens_per_req(mode, spec)
        if num_tokens != bs * per_req:
            raise ValueError(f"{mode.name}: {num_tokens=} must be bs * {per_req} = {bs * per_req}")
        key = self._key(mode, bs, num_tokens, spec, mode not in _UNIFORM)
        self._graph_keys[(mode, bs)] = key
        self._replay(key, req_pool_indices, seq_lens, spec_info, None)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices, seq_lens, seq_lens_sum,
                                                encoder_lens, forward_mode, spec_info, seq_lens_cpu,
                                                out_cache_loc=None) -> None:
        """Pad the batch to bucket ``bs`` (seq_len 1, row 0, slot 0) and run the captured plan."""
        mode = to_mode(forward_mode)
        key = self._graph_keys.get((mode, bs))
        if key is None:
            raise ValueError(f"no captured plan for {mode.name} bs={bs}; call "
                             "init_forward_metadata_capture_cuda_graph for this bucket first")
        if encoder_lens is not None:
            raise NotImplementedError("cross attention (encoder_lens) is not supported by torch_bridge yet")
        self._spec(spec_info, mode)  # same checks as capture (topk)
        self._replay(key, req_pool_indices, seq_lens, spec_info, out_cache_loc)

    def _tokens_per_req(self, mode: ForwardMode, spec) -> int:
        if mode == ForwardMode.DECODE:
            return 1
        if mode == ForwardMode.TARGET_VERIFY or mode.is_draft_extend():
            if spec is None or spec.num_draft_tokens < 1:
                raise ValueError(f"{mode.name} capture needs speculative_num_draft_tokens >= 1")
            return spec.num_draft_tokens
        raise ValueError(f"{mode.name} is not capturable (ragged tokens per request); plan it eagerly "
                         "with init_forward_metadata")

    def _replay(self, key: PlanKey, req_pool_indices, seq_lens, spec_info, out_cache_loc) -> None:
        bs, tokens = key.batch_size, key.num_tokens
        n = min(int(seq_lens.shape[0]), bs)
        rows = _pad(req_pool_indices[:n], bs, 0)
        lens = _pad(seq_lens[:n], bs, jbatch.SEQ_LEN_FILL_VALUE)
        loc = _pad(out_cache_loc if out_cache_loc is not None else rows[:0], tokens, 0)
        ext = None
        real = n * (tokens // bs)
        if key.mode not in _UNIFORM:
            acc = getattr(spec_info, "accept_length", None)
            ext = _pad(acc[:n] + 1 if acc is not None else rows[:n] * 0 + 1, bs, 0)
            real = tokens  # draft extend replays the padded token layout
        self._set_step(key, real, rows, lens, loc, ext)

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
        check_not_capturing()
        if q_rope is not None or k_rope is not None:
            raise NotImplementedError("q_rope / k_rope (MLA, absorbed latent attention) is not supported "
                                      "by torch_bridge yet")
        step = self._step
        if step is None:
            raise RuntimeError("call init_forward_metadata (or the replay hook) before forward")
        lp = self._layer_params(layer)
        pool = forward_batch.token_to_kv_pool
        k_buf, v_buf = pool.get_kv_buffer(layer.layer_id)
        t = self._check_shapes(q, k if save_kv_cache else None, v, lp, step, k_buf, v_buf, forward_batch)
        if save_kv_cache and k is not None:
            pool.set_kv_buffer(layer, forward_batch.out_cache_loc, k, v, lp.k_scale, lp.v_scale)
        q = q.reshape(t, lp.num_q_heads, lp.head_dim)
        if t != step.key.num_tokens:
            q = torch.nn.functional.pad(q, (0, 0, 0, 0, 0, step.key.num_tokens - t))
        elif not q.is_contiguous():
            q = q.contiguous()
        fast = (layer.layer_id, t, q.dtype, k_buf.data_ptr(), v_buf.data_ptr(), sinks is None)
        exe = self._step_exes.get(fast)
        views = (self.importer.view(k_buf), self.importer.view(v_buf),
                 None if sinks is None else self.importer.view(sinks, strict=False))
        jq = self.importer(q)
        if exe is None:
            exe = self._step_exes[fast] = self._attn_exe(lp, step, jq, *views)
        out = export(exe(jq, *views, *step.leaves))
        return out if t == step.key.num_tokens else out[:t]

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
        if getattr(layer, "is_cross_attention", False):
            raise NotImplementedError("cross-attention layers are not supported by torch_bridge yet")
        window = getattr(layer, "sliding_window_size", -1)
        lp = LayerParams(
            num_q_heads=layer.tp_q_head_num, num_kv_heads=layer.tp_k_head_num, head_dim=layer.head_dim,
            v_head_dim=layer.v_head_dim, scaling=layer.scaling, logit_cap=float(layer.logit_cap or 0.0),
            sliding_window_size=-1 if window is None else int(window),
            k_scale=_scale(layer, "k"), v_scale=_scale(layer, "v"),
        )  # layer_id stays 0: layers with one configuration share one executable
        self._layers[layer.layer_id] = (layer, lp)
        return lp

    def _check_shapes(self, q, k, v, lp: LayerParams, step: _Step, k_buf, v_buf, forward_batch) -> int:
        """Trace-free shape checks before anything is written: a bad call leaves the cache unchanged."""
        dv = lp.v_head_dim or lp.head_dim
        t = int(q.shape[0])
        if q.numel() != t * lp.num_q_heads * lp.head_dim:
            raise ValueError(f"{q.shape=} must be [num_tokens, {lp.num_q_heads} * {lp.head_dim}] "
                             "(tp_q_head_num * head_dim)")
        if t not in (step.real_tokens, step.key.num_tokens):
            raise ValueError(f"q has {t} tokens; it must have the {step.real_tokens} tokens the step was "
                             f"planned for (or {step.key.num_tokens} padded): call init_forward_metadata "
                             "for this batch")
        if tuple(k_buf.shape[1:]) != (lp.num_kv_heads, lp.head_dim) or tuple(v_buf.shape[1:]) != (lp.num_kv_heads, dv):
            raise ValueError(f"pool buffers {tuple(k_buf.shape)}, {tuple(v_buf.shape)} must be "
                             f"[num_slots, {lp.num_kv_heads}, {lp.head_dim}] / [num_slots, {lp.num_kv_heads}, {dv}]")
        if k_buf.shape[0] % self.page_size:
            raise ValueError(f"{k_buf.shape[0]=} slots must be a multiple of page_size={self.page_size}")
        if k is not None:
            if k.shape[0] != t or k.numel() != t * lp.num_kv_heads * lp.head_dim or v.numel() != t * lp.num_kv_heads * dv:
                raise ValueError(f"{k.shape=} / {v.shape=} must be [{t}, {lp.num_kv_heads} * {lp.head_dim}] / "
                                 f"[{t}, {lp.num_kv_heads} * {dv}] (one row per query token)")
            if forward_batch.out_cache_loc.shape[0] != t:
                raise ValueError(f"{forward_batch.out_cache_loc.shape=} must have one slot per token ({t})")
        return t


def _scale(layer, which: str) -> Optional[float]:
    s = getattr(layer, f"{which}_scale_float", None)
    if s is None:
        s = getattr(layer, f"{which}_scale", None)
    return None if s is None else float(s)


def _pad(x: torch.Tensor, size: int, fill: int) -> torch.Tensor:  # [n] -> i32[size]
    x = x.reshape(-1).to(torch.int32)
    if x.shape[0] == size:
        return x
    return torch.cat([x, torch.full((size - x.shape[0],), fill, dtype=torch.int32, device=x.device)])
