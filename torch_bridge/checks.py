"""Per-layer checks of the torch bridge, run before anything is written (a bad call leaves the
cache unchanged), and the conversion of SGLang's layer attributes."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

import numpy as np

from jax_attn.backend import LayerParams
from jax_attn.plan_key import PlanKey
from jax_attn.batch import check_lengths
from jax_attn.local import LOCAL_MODES
from jax_attn.metadata import ForwardMode
from torch_bridge.dlpack import capturing


def scale_of(layer, which: str) -> Optional[float]:
    """``layer.k_scale`` / ``v_scale`` (or the ``*_scale_float`` copies) as a Python float."""
    s = getattr(layer, f"{which}_scale_float", None)
    if s is None:
        s = getattr(layer, f"{which}_scale", None)
    return None if s is None else float(s)


FA_IMPL_VERSIONS = (3, 4)  # SGLang's fa_impl_ver: FA3 or FA4; both mean the same attention here


@dataclasses.dataclass(frozen=True)
class RunnerSettings:
    """What SGLang's ``FlashAttentionBackend.__init__`` reads from the model runner, checked once:
    every setting is honoured here or raises ``NotImplementedError`` naming it."""

    topk: int  # server_args.speculative_eagle_topk (0: none)
    num_draft_tokens: int  # server_args.speculative_num_draft_tokens (0: none)
    deterministic: bool  # server_args.enable_deterministic_inference
    attention_chunk_size: int  # Llama 4 chunked local layers' chunk (0: not model_config.is_local_attention_model)
    with_swa: bool  # model_runner.sliding_window_size >= 0 (tree verify / draft decode plan the SWA table)
    heads: Optional[tuple] = None  # (Hq, Hkv) per TP rank from model_config, when it says (launch tables)
    num_swa_slots: int = 0  # > 0: token_to_kv_pool is SGLang's hybrid SWAKVPool; slots of its SWA pool
    mla: bool = False  # model_config.attention_arch == MLA: absorbed latent attention over MLATokenToKVPool

    @classmethod
    def of(cls, model_runner, fa_impl_ver: int, topk: int) -> "RunnerSettings":
        if fa_impl_ver not in FA_IMPL_VERSIONS:
            raise ValueError(f"Invalid version: {fa_impl_ver=} (SGLang's FlashAttention backend takes 3 or 4)")
        config = getattr(model_runner, "model_config", None)
        arch = getattr(config, "attention_arch", None)
        mla = getattr(arch, "name", arch) == "MLA"
        if int(getattr(model_runner, "attn_cp_size", 1) or 1) > 1:
            raise NotImplementedError("model_runner.attn_cp_size > 1 (context-parallel attention) is not supported "
                                      "by torch_bridge")
        num_swa_slots = swa_pool_slots(getattr(model_runner, "token_to_kv_pool", None))
        window = getattr(model_runner, "sliding_window_size", None)
        if window is not None and bool(getattr(config, "is_encoder_decoder", False)):
            raise ValueError("sliding window and cross attention are not supported together (as in SGLang)")
        args = getattr(model_runner, "server_args", None)
        server_topk = getattr(args, "speculative_eagle_topk", None)
        chunk = local_chunk_size(model_runner, config)
        text = getattr(config, "hf_text_config", None)
        tp = int(getattr(model_runner, "tp_size", 1) or 1)
        hq, kv_heads = getattr(text, "num_attention_heads", None), getattr(config, "get_num_kv_heads", None)
        heads = (int(hq) // tp, int(kv_heads(tp))) if isinstance(hq, int) and callable(kv_heads) else None
        settings = cls(topk=int(server_topk if server_topk is not None else topk or 0), heads=heads,
                       num_draft_tokens=int(getattr(args, "speculative_num_draft_tokens", None) or 0),
                       deterministic=bool(getattr(args, "enable_deterministic_inference", False)),
                       attention_chunk_size=chunk, num_swa_slots=num_swa_slots,
                       with_swa=window is not None and window >= 0, mla=mla)
        if mla:
            for name, bad in (("a local-attention model", chunk > 0), ("a sliding-window model", settings.with_swa),
                              ("a hybrid SWAKVPool", num_swa_slots > 0)):
                if bad:
                    raise NotImplementedError(f"model_config.attention_arch == MLA with {name} is not supported "
                                              "by torch_bridge")
        return settings


def local_chunk_size(model_runner, config) -> int:
    """The chunk of a local-attention model (``model_config.is_local_attention_model``, Llama 4), as the
    seed reads it: ``model_runner.attention_chunk_size`` (SGLang copies ``model_config``'s), else
    ``model_config.attention_chunk_size``; 0 for other models (their ``use_irope`` layers attend fully,
    as in the seed). Checked against ``model_runner.page_size``."""
    if not bool(getattr(config, "is_local_attention_model", False)):
        return 0
    chunk = getattr(model_runner, "attention_chunk_size", None)
    if chunk is None:
        chunk = getattr(config, "attention_chunk_size", None)
    if chunk is None:  # the seed asserts the same
        raise ValueError("model_config.is_local_attention_model needs attention_chunk_size (model_runner's or "
                         "model_config's): the chunk of the use_irope layers")
    chunk, page = int(chunk), int(getattr(model_runner, "page_size", 1) or 1)
    if chunk < 1:
        raise ValueError(f"attention_chunk_size={chunk} must be >= 1")
    if chunk % page:
        raise NotImplementedError(
            f"attention_chunk_size={chunk} is not a multiple of page_size={page}: chunked local attention needs "
            "every chunk to start on a page boundary (the seed shrinks the chunk instead, which changes the "
            "model's attention); use a page size that divides attention_chunk_size")
    return chunk


def plans_local(key: PlanKey) -> bool:
    """Whether a step of ``key`` carries the local virtual batch (``jax_attn.local.with_local``'s rule)."""
    return key.attention_chunk_size > 0 and key.topk == 1 and key.mode in LOCAL_MODES


def check_local(lp: LayerParams, key: PlanKey, has_local: bool) -> None:
    """A chunked local layer (``lp.use_irope``: ``layer.use_irope`` in a local-attention model) needs a
    causal self-attention layer and a step whose plan carries the local virtual batch."""
    if not lp.use_irope:
        return
    if lp.is_cross_attention or not lp.causal:
        raise NotImplementedError("layer.use_irope (chunked local attention) on a cross-attention or ENCODER_ONLY "
                                  "layer is not supported")
    if not has_local:
        if key.topk > 1:
            what = f"{key.mode.name} step with topk={key.topk} (tree)"
        elif key.mode in LOCAL_MODES:  # planned without the virtual batch: the multi-step draft backend
            what = "multi-step draft decode (FlashAttentionMultiStepBackend)"
        else:
            what = f"{key.mode.name} step"
        raise NotImplementedError(
            f"layer.use_irope (chunked local attention, attention_chunk_size={key.attention_chunk_size}) in a "
            f"{what} is not supported by torch_bridge: local metadata exists for "
            f"{', '.join(m.name for m in LOCAL_MODES)} steps with topk <= 1 planned by FlashAttentionBackend")


def is_swa_pool(pool) -> bool:
    """SGLang's hybrid ``SWAKVPool`` with sliding-window layers, as the seed detects it (the class, or a
    stand-in with ``full_to_swa_index_mapping``, and ``swa_layer_nums > 0``)."""
    if not (type(pool).__name__ == "SWAKVPool" or hasattr(pool, "full_to_swa_index_mapping")):
        return False
    nums = getattr(pool, "swa_layer_nums", None)
    if nums is None:
        raise NotImplementedError("token_to_kv_pool looks like SGLang's hybrid SWAKVPool (full_to_swa_index_mapping) "
                                  "but has no swa_layer_nums: torch_bridge needs SGLang's SWAKVPool attributes")
    return int(nums) > 0


def swa_pool_slots(pool) -> int:
    """Slots of an ``SWAKVPool``'s SWA pool (``swa_kv_pool``'s buffers, else ``size_swa + page_size`` as
    SGLang allocates them); 0 when ``pool`` is not one."""
    if not is_swa_pool(pool):
        return 0
    sub = getattr(pool, "swa_kv_pool", None)
    try:
        return int(sub.get_kv_buffer(0)[0].shape[0])
    except Exception:  # a stand-in without sub-pools: SGLang's sizes
        pass
    size, page = getattr(pool, "size_swa", None), getattr(pool, "page_size", None)
    if size is None or page is None:
        raise ValueError("token_to_kv_pool (SWAKVPool) must say how many slots its SWA pool has: swa_kv_pool, "
                         "or size_swa and page_size")
    return int(size) + int(page)


def pool_slots(pool) -> int:
    """Slots per layer of the engine's (full) KV pool (0 when the pool does not say). An ``SWAKVPool``'s
    full pool has one slot per ``full_to_swa_index_mapping`` entry but its last (SGLang's ``-1``)."""
    try:
        if is_swa_pool(pool):
            sub = getattr(pool, "full_kv_pool", None)
            if sub is not None and int(getattr(pool, "full_layer_nums", 1)) > 0:
                return int(sub.get_kv_buffer(0)[0].shape[0])
            return int(pool.full_to_swa_index_mapping.shape[0]) - 1
        return int(pool.get_kv_buffer(0)[0].shape[0])
    except Exception:  # a pool without layer 0 or buffers yet: range checks then rely on the kernels' clamps
        return 0


def is_swa_layer(lp: LayerParams, key: PlanKey) -> bool:
    """The seed's ``is_swa_layer`` in an ``SWAKVPool`` step: the layer reads the SWA pool."""
    return key.swa_pool and lp.sliding_window_size >= 0


class SafeLocs:
    """``out_cache_loc`` with every slot outside the pool sent to the reserved slot 0 (where padding
    tokens write), so a torch KV write never lands on another slot (``-1`` would be the last one) and
    never fails half-way. Computed by the first layer of each forward (``forward``: the layer runner's
    count) and reused by the others; a capture's first layer so records it into the graph, which
    recomputes it from the engine's static buffer on replay. The reuse is keyed on the forward and on
    the very tensors (held, so their addresses cannot be handed to new ones), never on ``_version``:
    inference tensors have none, and an engine edits ``out_cache_loc`` only between forwards.

    ``SWAKVPool`` sliding-window layers (``mapping`` given): the pool's ``set_kv_buffer`` translates the
    slots with ``full_to_swa_index_mapping``, so a slot whose SWA slot lies outside the SWA pool
    (``num_swa_slots``) goes to slot 0 too (SGLang maps slot 0 to the SWA pool's reserved slot 0)."""

    def __init__(self, num_slots: int, num_swa_slots: int = 0):
        self.num_slots, self.num_swa_slots = num_slots, num_swa_slots
        self._last: dict = {}

    def __call__(self, loc: torch.Tensor, forward: int, mapping: Optional[torch.Tensor] = None) -> torch.Tensor:
        if not self.num_slots:
            return loc
        key = (forward, capturing())
        last = self._last.get(mapping is None)
        if last is not None and last[0] == key and last[1] is loc and last[2] is mapping:
            return last[3]
        ok = (loc >= 0) & (loc < self.num_slots)
        if mapping is not None:
            swa = mapping[torch.where(ok, loc, torch.zeros_like(loc)).clamp(max=mapping.shape[0] - 1).long()]
            ok &= (swa >= 0) & (swa < self.num_swa_slots)
        safe = torch.where(ok, loc, torch.zeros_like(loc))
        self._last[mapping is None] = (key, loc, mapping, safe)
        return safe


def check_host_lengths(forward_batch, mode: ForwardMode, tokens: int, extend: bool, *, capacity: int,
                       kv_offset: int) -> None:
    """SGLang's host copies (``seq_lens_cpu``, ``extend_seq_lens_cpu``) checked before planning: no
    device sync, a few microseconds. Batches without them are covered by the plan's error flag."""
    lens = getattr(forward_batch, "seq_lens_cpu", None)
    if lens is None:
        return
    lens = np.asarray(lens.numpy() if isinstance(lens, torch.Tensor) else lens, np.int64)
    ext = getattr(forward_batch, "extend_seq_lens_cpu", None) if extend else None
    if extend and ext is None and mode.is_draft_extend():
        ext = getattr(forward_batch.spec_info, "num_accepted_tokens_cpu", None)
    if extend and ext is None:
        return
    check_lengths(mode, lens, None if ext is None else np.asarray(ext, np.int64), tokens, capacity=capacity,
                  kv_offset=kv_offset)


def check_layer(lp: LayerParams, key: PlanKey, has_local: bool = False) -> None:
    """Layer kinds the step's plan cannot serve, caught before anything is written (``has_local``: the
    plan carries the local virtual batch)."""
    check_local(lp, key, has_local)
    if lp.use_irope and is_swa_layer(lp, key):
        raise NotImplementedError("a use_irope (chunked local) sliding-window layer in a model whose token_to_kv_pool "
                                  "is SGLang's hybrid SWAKVPool is not supported")
    if key.topk > 1 and (lp.is_cross_attention or not lp.causal):
        raise NotImplementedError("a cross-attention or encoder-only (attn_type ENCODER_ONLY) layer inside a tree "
                                  "(topk > 1) speculative step is not supported")
    if lp.is_cross_attention and not key.has_encoder:
        raise ValueError("a cross-attention layer needs a step planned with forward_batch.encoder_lens")
    if key.topk > 1 and lp.sliding_window_size >= 0 and not key.with_swa:
        raise ValueError(f"a sliding-window layer in a tree (topk > 1) {key.mode.name} step needs the SWA table: "
                         "set model_runner.sliding_window_size >= 0 before creating the backend")

def layer_buffers(pool, layer_id: int, mla: bool):
    """The layer's pool buffers ``(k, v)``; an MLA pool's one latent buffer as ``(k, None)``."""
    return (pool.get_key_buffer(layer_id), None) if mla else pool.get_kv_buffer(layer_id)


def same_memory(a: Optional[torch.Tensor], b: Optional[torch.Tensor]) -> bool:
    """Whether two tensors (or Nones) read the very same elements: same address, dtype, shape, strides and
    device."""
    if a is None or b is None:
        return a is b
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride() and a.device == b.device)


def pool_launch_reason(k_buf: torch.Tensor, v_buf: Optional[torch.Tensor]) -> Optional[str]:
    """None when a layer's pool buffers can be read by a kernel launched from torch, else why not (the
    launch binds raw pointers: contiguous buffers, one dtype for K and V)."""
    if not (k_buf.is_contiguous() and (v_buf is None or v_buf.is_contiguous())):
        return "pool buffers must be contiguous"
    if v_buf is not None and v_buf.dtype != k_buf.dtype:
        return f"dtypes {k_buf.dtype}/{v_buf.dtype}: one dtype for the K and V pools"
    return None


def graph_capture_blocker(pool, settings: RunnerSettings, launch_path, impl: str) -> Optional[str]:
    """Why ``torch.cuda.graph`` could not capture some layer's call over ``pool`` (None: every layer is
    launched from torch), judged at ``init_cuda_graph_state`` from what is known before any layer runs: a
    layer off the launch path runs a compiled JAX executable, which a torch graph cannot hold. Pools
    off CUDA (no graph to capture) pass."""
    layers = _pool_layers(pool, settings.mla)
    if not layers or not on_cuda(layers[0][1]):
        return None
    if launch_path is None:
        return (f"impl={impl!r} with no launch path (mosaic_path=False, impl='reference', or a GPU below sm80) "
                "runs every layer through a compiled JAX executable")
    for layer_id, k_buf, v_buf in layers:
        reason = pool_launch_reason(k_buf, v_buf)
        if reason is not None:
            return f"layer {layer_id}: {reason} (it would run through a compiled JAX executable)"
    return None


def on_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def _pool_layers(pool, mla: bool) -> list:
    """``(layer_id, k, v)`` of every layer the pool holds (``layer_buffers``), as far as it says."""
    count = getattr(pool, "layer_num", None)
    if count is None:
        count = len(getattr(pool, "kv_buffer" if mla else "k_buffer", None) or ())
    first = int(getattr(pool, "start_layer", 0) or 0)  # SGLang's pipeline stages number layers from there
    out = []
    for layer_id in range(first, first + int(count or 0)):
        try:
            out.append((layer_id, *layer_buffers(pool, layer_id, mla)))
        except (AttributeError, IndexError, KeyError, TypeError):
            break
    return out


def store_kv(pool, layer, lp: LayerParams, loc, k, v) -> None:
    """The torch KV write at ``loc``: SGLang's ``set_kv_buffer``, or for an MLA layer (``k`` whole latent
    rows) its ``set_mla_kv_buffer`` with the latent and rope parts, as the seed calls it."""
    if lp.mla:
        rows = k.reshape(-1, lp.head_dim)
        pool.set_mla_kv_buffer(layer, loc, rows[:, :lp.v_head_dim], rows[:, lp.v_head_dim:])
    else:
        pool.set_kv_buffer(layer, loc, k, v, lp.k_scale, lp.v_scale)


def check_shapes(q, lp: LayerParams, step, k_buf, v_buf, page_size: int) -> int:
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
    if lp.mla:  # one latent buffer: its latent part is the value buffer
        v_buf = k_buf[..., :dv]
        if not k_buf.is_contiguous():
            raise ValueError(f"the MLA latent buffer with strides {k_buf.stride()} must be contiguous")
    if tuple(k_buf.shape[1:]) != (lp.num_kv_heads, lp.head_dim) or tuple(v_buf.shape[1:]) != (lp.num_kv_heads, dv):
        raise ValueError(f"pool buffers {tuple(k_buf.shape)}, {tuple(v_buf.shape)} must be "
                         f"[num_slots, {lp.num_kv_heads}, {lp.head_dim}] / [num_slots, {lp.num_kv_heads}, {dv}]")
    if k_buf.shape[0] % page_size:
        raise ValueError(f"{k_buf.shape[0]=} slots must be a multiple of page_size={page_size}")
    if not lp.mla and not (k_buf.is_contiguous() and v_buf.is_contiguous()):
        raise ValueError(f"pool buffers with strides {k_buf.stride()} / {v_buf.stride()} must be contiguous: "
                         "allocate each layer's K and V pool as one dense tensor")
    return t

def write_loc(forward_batch, step, lp: LayerParams, t: int, k, v, step_id: int) -> torch.Tensor:
    """The slots this layer's K/V go to (checked against k / v before anything is written).

    Self attention: ``out_cache_loc`` (draft decode: this step's column when it holds every
    step's slots). Cross attention: ``encoder_out_cache_loc``, one slot per encoder token in k.
    """
    if lp.is_cross_attention:
        loc = getattr(forward_batch, "encoder_out_cache_loc", None)
        if loc is None:
            raise ValueError("a cross-attention layer writing K/V needs forward_batch.encoder_out_cache_loc")
        rows, what = int(loc.shape[0]), "encoder_out_cache_loc"
    else:
        loc, rows, what = forward_batch.out_cache_loc, t, "query token"
        if step.loc_steps > 1 and loc.shape[0] == t * step.loc_steps:
            loc = loc.reshape(-1, step.loc_steps)[:, step_id]
        if loc.shape[0] != t:
            raise ValueError(f"{forward_batch.out_cache_loc.shape=} must have one slot per token ({t})"
                             + (f" or {step.loc_steps} per token (every draft step)" if step.loc_steps > 1 else ""))
    dv = lp.v_head_dim or lp.head_dim
    if (k.shape[0] != rows or k.numel() != rows * lp.num_kv_heads * lp.head_dim
            or (not lp.mla and v.numel() != rows * lp.num_kv_heads * dv)):  # MLA: no value rows to write
        raise ValueError(f"{k.shape=} / {v.shape=} must be [{rows}, {lp.num_kv_heads} * {lp.head_dim}] / "
                         f"[{rows}, {lp.num_kv_heads} * {dv}] (one row per {what})")
    return loc


class CheckedLayer:
    """A layer call checked once (the launch path's ``LayerHit``, the JAX path's ``JaxLayerHit``): a later
    call with the same layer object, pool and pool buffers and token count may skip the checks, and its
    K/V write is checked against these before anything is written."""

    def __init__(self, layer, lp: LayerParams, t: int, pool, buffers, swa: bool):
        self.layer, self.lp, self.t, self.pool, self.buffers = layer, lp, t, pool, buffers
        self.swa = swa  # an SWAKVPool sliding-window layer: its locs are made safe for the SWA pool too
        dv = lp.v_head_dim or lp.head_dim
        self.numel = (t * lp.num_q_heads * lp.head_dim, t * lp.num_kv_heads * lp.head_dim,
                      t * lp.num_kv_heads * dv)  # q, k, v

    def same(self, layer, q, forward_batch) -> bool:
        """Same layer object, token count, pool and pool buffers as the checked call."""
        if (self.layer is not layer or q.shape[0] != self.t or q.numel() != self.numel[0]
                or forward_batch.token_to_kv_pool is not self.pool):
            return False
        k_buf, v_buf = layer_buffers(self.pool, layer.layer_id, self.lp.mla)
        if k_buf is self.buffers[0] and v_buf is self.buffers[1]:
            return True
        # SGLang's fp8 pools store uint8 and hand out a new ``view(dtype)`` per call: the same memory
        return same_memory(k_buf, self.buffers[0]) and same_memory(v_buf, self.buffers[1])

    def write(self, k, v, loc) -> None:
        """Torch KV write at ``loc`` (None: no write; the pool translates an SWA layer's), checked first."""
        if loc is None or k is None:
            return
        lp, t = self.lp, self.t
        v_bad = not lp.mla and (v.shape[0] != t or v.numel() != self.numel[2])  # MLA: no value rows
        if k.numel() != self.numel[1] or v_bad or loc.shape[0] != t:
            raise ValueError(f"{k.shape=} / {getattr(v, 'shape', None)} / out_cache_loc {tuple(loc.shape)} must have "
                             f"one row per token ({t}) of [{lp.num_kv_heads} * {lp.head_dim}] / "
                             f"[{lp.num_kv_heads} * {lp.v_head_dim or lp.head_dim}]")
        store_kv(self.pool, self.layer, lp, loc, k, v)
