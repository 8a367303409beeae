"""The JAX face of the library: plan once per step, run attention per layer.

    backend = FlashAttentionBackend(req_to_token, page_size=16, max_context_len=4096)
    md = backend.plan(batch)                        # once per step (host padding + jitted planner)
    out, pool = backend.forward(q, k, v, layer, pool, md)   # per layer, inside the model's jit

``forward`` is pure: it returns the new pool (in place under ``jit`` with the pool donated).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from jax_attn import local as local_attn
from jax_attn import safety
from jax_attn import spec as spec_plan
from jax_attn.attention import attention
from jax_attn.kernels.config import cdiv
from jax_attn.kernels.schedule import num_splits_for
from jax_attn.kernel_policy import Call, mosaic_wanted, resolve_impl
from jax_attn.batch import ForwardBatch, check_batch, pad_batch
from jax_attn.kv_cache import KVPool, is_fp8, paged_view, set_kv_buffer
from jax_attn.metadata import AttentionMetadata, ForwardMode
from jax_attn.plan_key import PlanKey, _kv_offset, batch_arrays, plan_arrays
from jax_attn.reference import merge_state_reference


@dataclasses.dataclass(frozen=True)
class LayerParams:
    """Per-layer knobs of SGLang's ``RadixAttention`` (static: hashable, part of the jit key)."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: Optional[int] = None
    scaling: Optional[float] = None  # softmax scale; None = head_dim ** -0.5
    logit_cap: float = 0.0
    sliding_window_size: int = -1  # -1 = full attention; else FA3 window (size, 0)
    is_cross_attention: bool = False  # attends the encoder tokens, non-causal
    causal: bool = True  # False: SGLang's AttentionType.ENCODER_ONLY (bidirectional)
    k_scale: Optional[float] = None  # fp8 pools: stored k = k / k_scale
    v_scale: Optional[float] = None
    layer_id: int = 0
    use_irope: bool = False  # Llama-4 chunked local layer: keys of its own chunk only (the backend's chunk size)
    mla: bool = False  # absorbed MLA (SGLang's AttentionArch.MLA): one latent pool (KVPool.mla), one kv head,
    # head_dim = kv_lora_rank + qk_rope_head_dim, v_head_dim = kv_lora_rank

    def __post_init__(self):
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(f"{self.num_q_heads=} must be a multiple of {self.num_kv_heads=}")
        if self.mla and (self.num_kv_heads != 1 or not 0 < (self.v_head_dim or 0) < self.head_dim):
            raise ValueError(f"an MLA layer has one kv head and v_head_dim (kv_lora_rank) below head_dim "
                             f"(kv_lora_rank + qk_rope_head_dim): got {self.num_kv_heads=}, {self.v_head_dim=}, "
                             f"{self.head_dim=}")

    @property
    def window_size(self):
        return (self.sliding_window_size, 0) if self.sliding_window_size >= 0 else (-1, -1)

    @property
    def attends_causally(self) -> bool:
        """Whether a query sees only the keys up to its own position (a cross layer attends every encoder token)."""
        return self.causal and not self.is_cross_attention


def _table_copy(table) -> jax.Array:
    """A request table as an int32 JAX array that shares no memory with ``table``: on the CPU,
    ``jnp.asarray`` views an aligned numpy array in place, so the engine's later edits would leak in
    (or not, depending on where numpy allocated it). A JAX array is immutable and is kept as it is."""
    if isinstance(table, jax.Array):
        return table.astype(jnp.int32)
    return jnp.array(np.array(safety.check_int32("req_to_token", table), copy=True))


class FlashAttentionBackend:
    """SGLang's FlashAttention backend for JAX model code.

    Args:
      req_to_token: ``i32[max_reqs, max_context_len]`` request table (row 0 reserved), copied to the
        device; an engine that edits its table assigns the new one to ``backend.req_to_token``.
      page_size: tokens per KV page.
      max_context_len: longest sequence (bounds the page-table width).
      impl: attention implementation (``jax_attn.attention.IMPLS``).
      deterministic: one KV split per sequence, so a request's output is bitwise independent
        of the rest of the batch (SGLang's ``enable_deterministic_inference``).
      max_encoder_len: static bound on encoder lengths for cross attention (0 = none).
      num_slots: slots of the KV pool (per layer); lets the plan's error flag cover page ids and
        ``out_cache_loc`` (``jax_attn.safety``). 0: unknown (kernels still clamp to the pool).
      validate: validation mode: every plan's device-side error flag is read back (a host sync)
        and a bad step raises before anything is written. Default: ``JAX_ATTN_VALIDATE=1``.
      num_heads: ``(num_q_heads, num_kv_heads)`` of the model's layers; with a kernel ``impl``
        the plan then carries the kernel's work schedule, built once per step instead of per
        layer (layers with other head counts still get a correct, per-call schedule).
      mla: the model's layers are absorbed MLA layers (``LayerParams(mla=True)``): with ``num_heads``
        (``(Hq, 1)``) the plan carries the Mosaic kernel's latent-cache tiles (``plan_mosaic_schedule(...,
        latent=True)``) where ``auto`` or ``impl="mosaic"`` would run it.
      attention_chunk_size: Llama-4 chunked local attention (SGLang's ``attention_chunk_size``; 0 =
        none): every plan of a mode in ``jax_attn.local.LOCAL_MODES`` then carries the virtual batch
        (``md.local``) that ``use_irope`` layers run. A multiple of ``page_size``.
      num_swa_slots, full_to_swa_index_mapping: SGLang's hybrid ``SWAKVPool``: slots of the SWA pool and
        the full slot -> SWA slot map (``i32[num_slots + 1]``); plans then carry ``md.swa_page_table``,
        which sliding-window layers read (pass them their SWA pool); tree steps carry it on ``md.swa``.
    """

    def __init__(self, req_to_token, *, page_size: int = 1, max_context_len: Optional[int] = None,
                 impl: str = "auto", deterministic: bool = False, max_encoder_len: int = 0,
                 num_heads: Optional[tuple] = None, num_slots: int = 0, validate: Optional[bool] = None,
                 attention_chunk_size: int = 0, num_swa_slots: int = 0, full_to_swa_index_mapping=None,
                 mla: bool = False):
        if attention_chunk_size:
            local_attn.check_chunk_size(attention_chunk_size, page_size)
        self.attention_chunk_size = int(attention_chunk_size or 0)
        self._req_to_token = _table_copy(req_to_token)
        self.page_size = page_size
        ctx = self.req_to_token.shape[1] if max_context_len is None else max_context_len
        self.max_pages = cdiv(ctx, page_size)
        self.impl = resolve_impl(impl)
        self.deterministic = deterministic
        self.max_encoder_len = max_encoder_len
        self.num_heads = num_heads
        self.mla = bool(mla)
        self.num_slots = int(num_slots)
        self.validate = safety.validate_default() if validate is None else bool(validate)
        self.num_swa_slots = int(num_swa_slots)  # SGLang's hybrid SWAKVPool: slots of its SWA pool
        self.full_to_swa_index_mapping = full_to_swa_index_mapping

    @property
    def req_to_token(self):
        """The request table plans read (a device copy: JAX arrays are immutable). An engine that
        changes its table assigns the new one here; same shape and dtype, so executables stay valid."""
        return self._req_to_token

    @req_to_token.setter
    def req_to_token(self, table):
        table = _table_copy(table)
        if table.shape != self._req_to_token.shape:
            raise ValueError(f"req_to_token {table.shape=} must keep the shape {self._req_to_token.shape}")
        self._req_to_token = table

    # ---- planning -------------------------------------------------------------------------
    def plan(self, batch: ForwardBatch, *, bs: Optional[int] = None,
             num_tokens: Optional[int] = None) -> AttentionMetadata:
        """Plan one step; pads to ``bs`` rows / ``num_tokens`` tokens first when given.

        The host checks of ``jax_attn.batch.check_batch`` run first (a bad batch raises
        ``ValueError`` saying what to fix); in validation mode the device-side flag is read too.
        """
        key = self.plan_static(batch)
        check_batch(batch, num_rows=self.req_to_token.shape[0], capacity=self.capacity, kv_offset=key.kv_offset,
                    num_slots=self.num_slots)
        if bs is not None:
            batch = pad_batch(batch, bs, num_tokens if num_tokens is not None else batch.num_tokens)
            key = self.plan_static(batch)
        mapping = None if not key.swa_pool else jnp.asarray(self.full_to_swa_index_mapping, jnp.int32)
        rows, lens, loc, ext, enc, mask = batch_arrays(batch)
        md = self.attach_schedule(plan_arrays(key, self.req_to_token, rows, lens, loc, ext, enc, mask, mapping))
        if batch.encoder_out_cache_loc is not None and getattr(md, "encoder", None) is not None:
            md = dataclasses.replace(md, encoder=dataclasses.replace(
                md.encoder, out_cache_loc=jnp.asarray(batch.encoder_out_cache_loc, jnp.int32)))
        if self.validate:
            safety.check(md, "plan")
        return md

    @property
    def capacity(self) -> int:
        """KV positions a sequence may hold: the page table's, within the request table's width."""
        return min(self.max_pages * self.page_size, self.req_to_token.shape[1])

    @staticmethod
    def check(md) -> None:
        """Raise ``ValueError`` when the plan's device-side error flag is set (a host sync)."""
        safety.check(md, "plan")

    def attach_schedule(self, md, with_lse: bool = False, num_heads: Optional[tuple] = None):
        """Add the kernels' work schedules for layers of ``num_heads`` (default: the backend's) to a
        plan (traceable; no-op without heads). A cascade's parts return their LSE for the merge: their
        Mosaic schedules carry its index."""
        heads = num_heads or self.num_heads
        if heads is None or self.impl == "reference" or md.mode == ForwardMode.IDLE:
            return md
        if isinstance(md, spec_plan.CascadeMetadata):
            part = functools.partial(self.attach_schedule, num_heads=heads)
            return dataclasses.replace(md, prefix=part(md.prefix, with_lse=True), expand=part(md.expand, with_lse=True),
                                       swa=None if md.swa is None else part(md.swa))
        from jax_attn.kernels.schedule import step_schedule

        hq, hkv = heads
        splits = num_splits_for(self.deterministic)
        sched = step_schedule(md, num_q_heads=hq, num_kv_heads=hkv, deterministic=self.deterministic)
        mosaic = None
        call = Call(max_q_len=md.max_q_len, page_size=md.page_size, num_tokens=md.num_tokens, num_kv_heads=hkv,
                    head_dim=0, head_dim_v=0, dtype=None, kv_dtype=None, deterministic=self.deterministic,
                    num_q_heads=hq, latent=self.mla)
        if self.impl == "mosaic" or (self.impl == "auto" and mosaic_wanted(call)):
            from jax_attn.kernels.mosaic_paged import plan_mosaic_schedule

            mosaic = plan_mosaic_schedule(md, num_q_heads=hq, num_kv_heads=hkv, num_splits=splits, with_lse=with_lse,
                                          latent=self.mla)
        # chunked local layers' own tiles
        local = None if md.local is None else self.attach_schedule(md.local, num_heads=heads)
        encoder = md.encoder
        if encoder is not None:  # cross layers: page size 1, so the Triton-lowered kernel (kernel_policy)
            encoder = dataclasses.replace(encoder, schedule=step_schedule(
                cross_metadata(md), num_q_heads=hq, num_kv_heads=hkv, deterministic=self.deterministic))
        return dataclasses.replace(md, schedule=sched, mosaic_schedule=mosaic, local=local, encoder=encoder)

    def plan_settings(self) -> tuple:
        """Every backend setting ``plan_static`` reads, in one tuple (``plan_static`` reads them only from
        here, so a memo of plan keys that includes this tuple stays complete)."""
        return (self.page_size, self.max_pages, self.max_encoder_len, self.num_slots, self.attention_chunk_size,
                self.num_swa_slots)

    def plan_static(self, batch: ForwardBatch) -> "PlanKey":
        """The static part of a plan (mode, sizes): the compile-cache key of a step."""
        page_size, max_pages, max_encoder_len, num_slots, chunk_size, num_swa_slots = self.plan_settings()
        spec = batch.spec_info
        tree = spec is not None and spec.is_tree()
        if tree and batch.forward_mode not in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
            raise NotImplementedError(f"{batch.forward_mode.name} with topk={spec.topk}: only target verify and "
                                      "draft decode have a tree (cascade) form")
        if num_swa_slots and batch.encoder_lens is not None:
            raise NotImplementedError("SGLang's hybrid SWAKVPool with cross attention (encoder_lens) is not supported")
        if tree and batch.forward_mode == ForwardMode.TARGET_VERIFY and spec.draft_mask is None:
            raise ValueError("tree target verify needs spec_info.draft_mask (see spec.draft_mask_from_custom_mask)")
        return PlanKey(
            mode=batch.forward_mode, batch_size=batch.batch_size, num_tokens=batch.num_tokens,
            q_len_per_req=batch.q_len_per_req(), kv_offset=_kv_offset(batch),
            page_size=page_size, max_pages=max_pages,
            has_encoder=batch.encoder_lens is not None, max_encoder_len=max_encoder_len,
            topk=spec.topk if tree else 1, num_steps=spec.num_steps if tree else 1,
            step_id=spec.step_id if tree else 0, num_slots=num_slots,
            with_swa=bool(tree and (spec.with_swa or num_swa_slots)),  # an SWAKVPool has SWA layers
            attention_chunk_size=chunk_size, num_swa_slots=num_swa_slots,
        )

    # ---- per layer ------------------------------------------------------------------------
    def forward(self, q, k, v, layer: LayerParams, pool: KVPool, md: AttentionMetadata, *,
                sinks=None, save_kv_cache: bool = True, return_lse: bool = False, layer_index=None,
                q_rope=None, k_rope=None):
        """Write this step's K/V (optional) and attend. ``q [T, Hq*D]`` or ``[T, Hq, D]``.

        ``pool`` is one layer's pool, or a layer-stacked pool with ``layer_index`` (may be traced:
        a model can ``lax.scan`` over layers and pass two pool leaves instead of 2·L).

        An MLA layer (``layer.mla``, absorbed; pool ``KVPool.mla``) takes ``q`` rows of the absorbed
        ``q_nope`` then ``q_rope`` per head and ``k`` rows of the latent then ``k_rope`` (``v`` is not
        used: the values are the latent part), or, as SGLang passes them, the latent parts in ``q`` /
        ``k`` with ``q_rope`` ``[T, Hq * rope]`` and ``k_rope`` ``[T, rope]`` beside them.

        Returns ``(out [T, Hq * Dv], new_pool)`` (and LSE ``f32[T, Hq]`` when ``return_lse``).
        """
        if md.mode == ForwardMode.IDLE:
            dv = layer.v_head_dim or layer.head_dim
            out = jnp.zeros((0, layer.num_q_heads * dv), q.dtype)
            return (out, pool, jnp.zeros((0, layer.num_q_heads), jnp.float32)) if return_lse else (out, pool)
        q, k = _mla_rows(layer, pool, md, q, k, q_rope, k_rope)
        t = q.shape[0]
        if q.size != t * layer.num_q_heads * layer.head_dim or t != _num_tokens(md):
            raise ValueError(f"{q.shape=} must be [{_num_tokens(md)} planned tokens, {layer.num_q_heads} * "
                             f"{layer.head_dim}] (the layer's num_q_heads * head_dim); plan this batch's tokens")
        q = q.reshape(t, layer.num_q_heads, layer.head_dim)
        tree = isinstance(md, spec_plan.CascadeMetadata)
        if tree and (layer.is_cross_attention or not layer.causal):
            raise NotImplementedError("a cross-attention or non-causal (encoder-only) layer inside a tree "
                                      "(topk > 1) speculative step is not supported")
        swa_pool = getattr(spec_plan.swa_plan_of(md), "swa_page_table", None) is not None  # SGLang's SWAKVPool
        if layer.use_irope:  # chunked local layer: checked before anything is written
            if layer.sliding_window_size >= 0 and swa_pool:
                raise NotImplementedError("a use_irope (chunked local) sliding-window layer in an SWAKVPool model "
                                          "is not supported")
            if layer.is_cross_attention or not layer.causal:
                raise NotImplementedError("use_irope (chunked local attention) on a cross-attention or non-causal "
                                          "layer is not supported")
            local_attn.local_plan_of(md)
        if save_kv_cache and k is not None:
            if layer.sliding_window_size >= 0 and swa_pool:
                raise NotImplementedError("an SWAKVPool sliding-window layer's K/V go to translated SWA slots "
                                          "(full_to_swa_index_mapping[out_cache_loc]): write them yourself and "
                                          "pass save_kv_cache=False")
            loc = _write_slots(layer, md, k)
            k = k.reshape(loc.shape[0], layer.num_kv_heads, layer.head_dim)
            v = None if layer.mla else v.reshape(loc.shape[0], layer.num_kv_heads, layer.v_head_dim or layer.head_dim)
            pool = set_kv_buffer(pool, loc, k, v, k_scale=layer.k_scale, v_scale=layer.v_scale,
                                 layer_index=layer_index)
        view, amd = pool, md
        if layer_index is not None and swa_pool:
            raise NotImplementedError("a layer-stacked pool (layer_index) with an SWAKVPool plan is not supported")
        if layer_index is not None:  # read the stacked pool as one big pool, this layer's slots
            view, amd = pool.flat(), offset_slots(md, layer_index * pool.num_slots)
        if layer.use_irope:  # the step's virtual batch: one row per (sequence, chunk) (jax_attn.local)
            res = self._attend(q, layer, view, amd.local, sinks=sinks, return_lse=return_lse)
        elif tree:
            res = self._attend_tree(q, layer, view, amd, sinks=sinks, return_lse=return_lse)
        else:
            res = self._attend(q, layer, view, amd, sinks=sinks, return_lse=return_lse)
        out = res[0] if return_lse else res
        out = out.reshape(t, -1)
        return (out, pool, res[1]) if return_lse else (out, pool)

    forward_extend = forward
    forward_decode = forward

    def _attend_tree(self, q, layer: LayerParams, pool: KVPool, md, *, sinks, return_lse):
        kw = self._features(layer, pool)
        if self.impl == "reference":
            merge = merge_state_reference
        else:
            from jax_attn.kernels.merge_state import merge_state as merge
        if layer.mla:  # the latent pool: values are the latent part of each key row
            kw["latent_dim"] = layer.v_head_dim
        v_pages, v_slots = (None, None) if layer.mla else (paged_view(pool.v, md.prefix.page_size),
                                                          paged_view(pool.v, 1))
        return spec_plan.cascade_attention(
            q, paged_view(pool.k, md.prefix.page_size), v_pages, paged_view(pool.k, 1), v_slots, md,
            attend=functools.partial(attention, impl=self.impl), merge=merge,
            window_size=layer.window_size, sinks=sinks, return_lse=return_lse, **kw)

    def _features(self, layer: LayerParams, pool: KVPool) -> dict:
        fp8 = is_fp8(pool.k.dtype)
        kw = dict(softcap=layer.logit_cap, softmax_scale=layer.scaling,
                  k_descale=layer.k_scale if fp8 else None, v_descale=layer.v_scale if fp8 else None)
        if self.impl != "reference":
            kw["num_splits"] = num_splits_for(self.deterministic)
        return kw

    def _attend(self, q, layer: LayerParams, pool: KVPool, md: AttentionMetadata, *, sinks, return_lse):
        kw = dict(self._features(layer, pool), sinks=sinks, return_lse=return_lse)
        if layer.is_cross_attention:
            if md.encoder is None:
                raise ValueError("a cross-attention layer needs metadata planned with encoder_lens")
            return attention(q, paged_view(pool.k, 1), paged_view(pool.v, 1), cross_metadata(md), impl=self.impl,
                             causal=layer.attends_causally, **kw)
        if layer.sliding_window_size >= 0 and md.swa_page_table is not None:  # the SWAKVPool's SWA pool
            md = dataclasses.replace(md, page_table=md.swa_page_table, swa_page_table=None)
        if layer.mla:  # values: the latent part of each key row (one read of the pool)
            return attention(q, paged_view(pool.k, md.page_size), None, md, impl=self.impl, causal=layer.causal,
                             window_size=layer.window_size, latent_dim=layer.v_head_dim, **kw)
        return attention(q, paged_view(pool.k, md.page_size), paged_view(pool.v, md.page_size), md,
                         impl=self.impl, causal=layer.causal, window_size=layer.window_size, **kw)

    def describe(self, md, layer: LayerParams, dtype=jnp.bfloat16, kv_dtype=None, *, has_sinks: bool = False) -> dict:
        """Which kernel ``forward(q, k, v, layer, pool, md)`` runs, without running it (host only).

        Args:
          md: a plan (``plan`` or a captured step's), any mode.
          layer: the layer's parameters; dtype: q's dtype; kv_dtype: the pool's (default ``dtype``);
          has_sinks: whether the call passes ``sinks``.
        Returns:
          ``{"mode": md.mode.name, "impl": self.impl, <part>: kernel, ...}``: kernel ``"mosaic"``, ``"triton"``
          or ``"reference"`` (``jax_attn.kernel_policy.select_kernel``, as ``auto`` decides on this device),
          per part the call runs: ``"attention"``; a ``use_irope`` layer's ``"local"`` virtual batch; a
          cross-attention layer's ``"cross"``; a tree (topk > 1) step's ``"prefix"`` and ``"expand"``.
        """
        from jax_attn.attention import call_of
        from jax_attn.kernel_policy import select_kernel

        kv_dtype = dtype if kv_dtype is None else kv_dtype
        extra = {"sinks": True if has_sinks else None, "num_splits": num_splits_for(self.deterministic)}

        def kernel(part) -> str:  # the facts forward's attention call would hand the policy (call_of)
            shape = (1, part.page_size, layer.num_kv_heads)
            q = jax.ShapeDtypeStruct((part.num_tokens, layer.num_q_heads, layer.head_dim), dtype)
            k = jax.ShapeDtypeStruct(shape + (layer.head_dim,), kv_dtype)
            v = jax.ShapeDtypeStruct(shape + (layer.v_head_dim or layer.head_dim,), kv_dtype)
            if layer.mla:
                return select_kernel(self.impl, call_of(q, k, None, part, latent_dim=layer.v_head_dim, **extra))
            return select_kernel(self.impl, call_of(q, k, v, part, **extra))

        out = {"mode": md.mode.name, "impl": self.impl}
        if isinstance(md, spec_plan.CascadeMetadata):
            return {**out, "prefix": kernel(md.prefix), "expand": kernel(md.expand)}
        if layer.is_cross_attention:
            if md.encoder is None:
                raise ValueError("a cross-attention layer needs metadata planned with encoder_lens")
            return {**out, "cross": kernel(cross_metadata(md))}
        if layer.use_irope:
            return {**out, "local": kernel(local_attn.local_plan_of(md))}
        return {**out, "attention": kernel(md)}


def _num_tokens(md) -> int:
    return md.prefix.num_tokens if isinstance(md, spec_plan.CascadeMetadata) else md.num_tokens


def cross_metadata(md: AttentionMetadata) -> AttentionMetadata:
    """A cross layer's view of step plan ``md``: each request's encoder tokens are its keys (page size 1),
    with the encoder's own schedule (None until ``attach_schedule``: the kernel then plans its own)."""
    enc = md.encoder
    return dataclasses.replace(
        md, cache_seqlens=enc.encoder_lens, cu_seqlens_k=enc.encoder_cu_seqlens_k, page_table=enc.encoder_page_table,
        page_size=1, max_pages=enc.max_encoder_len, schedule=enc.schedule, mosaic_schedule=None, local=None,
        encoder=None)


def _mla_rows(layer: LayerParams, pool: KVPool, md, q, k, q_rope, k_rope):
    """``(q, k)`` of an MLA layer as whole rows (latent, then rope; see ``forward``); checks what an
    MLA layer does not run here. Other layers must not get ``q_rope`` / ``k_rope``."""
    if not layer.mla:
        if q_rope is not None or k_rope is not None:
            raise NotImplementedError("q_rope / k_rope are for absorbed MLA layers (LayerParams(mla=True))")
        if pool.v is None:
            raise ValueError("an MLA latent pool (KVPool.mla, v=None) needs an MLA layer (LayerParams(mla=True))")
        return q, k
    if pool.v is not None:
        raise ValueError("an MLA layer reads one latent pool: KVPool.mla(num_slots, kv_lora_rank, "
                         "qk_rope_head_dim, dtype)")
    for name, bad in (("is_cross_attention", layer.is_cross_attention), ("use_irope", layer.use_irope),
                      ("a sliding window in a tree (topk > 1) step", isinstance(md, spec_plan.CascadeMetadata)
                       and layer.sliding_window_size >= 0),
                      ("an SWAKVPool plan", getattr(md, "swa_page_table", None) is not None)):
        if bad:
            raise NotImplementedError(f"an MLA (absorbed latent) layer with {name} is not supported")
    t, h, dv = q.shape[0], layer.num_q_heads, layer.v_head_dim
    rope = layer.head_dim - dv
    if q_rope is not None:
        q = jnp.concatenate([q.reshape(t, h, dv), q_rope.reshape(t, h, rope).astype(q.dtype)], axis=-1)
    if k_rope is not None:
        if k is None:
            raise ValueError("k_rope without k (the latent part): pass both, or neither with save_kv_cache=False")
        k = jnp.concatenate([k.reshape(-1, 1, dv), k_rope.reshape(-1, 1, rope).astype(k.dtype)], axis=-1)
    return q, k


def _write_slots(layer: LayerParams, md, k):
    """Where this layer's new K/V go: ``out_cache_loc``, or the encoder's slots for a cross layer
    (SGLang's ``encoder_out_cache_loc``). Checked at trace time, before anything is written."""
    if not layer.is_cross_attention:
        loc = md.out_cache_loc
    elif md.encoder is None or md.encoder.out_cache_loc is None:
        raise ValueError("a cross-attention layer writing K/V needs a plan of a batch with encoder_lens and "
                         "encoder_out_cache_loc (or pass save_kv_cache=False / k=None)")
    else:
        loc = md.encoder.out_cache_loc
    if k.shape[0] != loc.shape[0]:
        raise ValueError(f"{k.shape=} must have one row per written slot ({loc.shape[0]}: "
                         f"{'encoder_out_cache_loc' if layer.is_cross_attention else 'out_cache_loc'})")
    return loc


def offset_slots(md, slot_offset):
    """Shift every page/slot table of a plan by ``slot_offset`` slots (a multiple of the page size)."""
    if isinstance(md, spec_plan.CascadeMetadata):
        return dataclasses.replace(
            md, prefix=offset_slots(md.prefix, slot_offset), expand=offset_slots(md.expand, slot_offset),
            swa=None if md.swa is None else offset_slots(md.swa, slot_offset))
    enc = md.encoder
    if enc is not None:
        enc = dataclasses.replace(enc, encoder_page_table=enc.encoder_page_table + slot_offset)
    local = None if md.local is None else offset_slots(md.local, slot_offset)
    return dataclasses.replace(md, page_table=md.page_table + slot_offset // md.page_size, encoder=enc, local=local)
