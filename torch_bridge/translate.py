"""SGLang's batch and layer objects -> jax_attn's inputs, for ``torch_bridge.backend``.

Forward modes by name, the draft-decode slot layouts of ``out_cache_loc``, extend lengths, the tree
verify mask and a ``RadixAttention`` layer's knobs as ``LayerParams``.
"""

from __future__ import annotations

from typing import Optional

import torch

from jax_attn import batch as jbatch
from jax_attn.backend import LayerParams
from jax_attn.batch import accepted_tokens
from jax_attn.metadata import ForwardMode
from torch_bridge.checks import scale_of

UNIFORM = (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY)  # modes with a static token count per request


def to_mode(mode) -> ForwardMode:
    """SGLang's ``ForwardMode`` (or ours) -> ``jax_attn.metadata.ForwardMode`` by name."""
    if isinstance(mode, ForwardMode):
        return mode
    try:
        return ForwardMode[mode.name]
    except (KeyError, AttributeError):
        raise NotImplementedError(f"forward_batch.forward_mode={mode!r} is not supported by torch_bridge") from None


def is_draft_decode(spec, mode: ForwardMode) -> bool:
    return mode == ForwardMode.DECODE and spec is not None


def locs_per_token(spec, mode: ForwardMode) -> int:
    """out_cache_loc entries per query token in the plan's input (tree draft decode: num_steps)."""
    return spec.num_steps if is_draft_decode(spec, mode) and spec.topk > 1 else 1


def loc_steps(spec, mode: ForwardMode) -> int:
    """Draft steps whose slots ``out_cache_loc`` may carry per query token (draft decode)."""
    return spec.num_steps if is_draft_decode(spec, mode) else 1


def plan_locs(out_cache_loc: torch.Tensor, spec, mode: ForwardMode, bs: Optional[int], step_id: int) -> torch.Tensor:
    """The slots the planner takes: all draft steps (tree draft decode), column ``step_id`` (topk <= 1
    draft decode given every step's slots), else ``out_cache_loc`` as it is. ``bs`` is None on
    replay, where the engine's locs may cover fewer rows than the bucket."""
    loc = out_cache_loc.reshape(-1)
    if not is_draft_decode(spec, mode) or spec.num_steps == 1:
        return loc
    per_req = spec.topk * spec.num_steps
    if spec.topk > 1:
        if (bs is not None and loc.shape[0] != bs * per_req) or loc.shape[0] % per_req:
            raise ValueError(f"tree draft decode: {out_cache_loc.shape=} must hold every draft step's "
                             f"slots, [bs, topk={spec.topk}, num_steps={spec.num_steps}] flattened")
        return loc
    if bs is not None and loc.shape[0] == bs:
        return loc  # already this step's slots
    if loc.shape[0] % spec.num_steps:
        raise ValueError(f"draft decode: {out_cache_loc.shape=} must be [bs] or [bs, 1, "
                         f"num_steps={spec.num_steps}] flattened")
    return loc.reshape(-1, spec.num_steps)[:, step_id]


def extend_lens(mode: ForwardMode, extend_seq_lens, spec_info):
    """New tokens per request: None for uniform modes; draft extend without ``extend_seq_lens`` takes
    ``spec_info.num_accepted_tokens`` (SGLang 0.5.11; older ``accept_length + 1``)."""
    if mode in UNIFORM:
        return None
    if extend_seq_lens is None and mode.is_draft_extend():
        extend_seq_lens = accepted_tokens(spec_info)
    if extend_seq_lens is None:
        raise ValueError(f"{mode.name} needs forward_batch.extend_seq_lens (new tokens per request)"
                         + (" or spec_info.num_accepted_tokens" if mode.is_draft_extend() else ""))
    return extend_seq_lens


def causal_of(layer) -> bool:
    """SGLang's ``layer.attn_type``: ENCODER_ONLY attends both ways; DECODER and
    DECODER_BIDIRECTIONAL are causal (as in SGLang's FlashAttention backend)."""
    kind = getattr(layer, "attn_type", None)
    name = getattr(kind, "name", None if kind is None else str(kind))
    if name in (None, "DECODER", "DECODER_BIDIRECTIONAL"):
        return True
    if name == "ENCODER_ONLY":
        return False
    raise NotImplementedError(f"layer.attn_type={kind!r} is not supported by torch_bridge")


def layer_params(layer, local_model: bool = False, mla: bool = False) -> LayerParams:
    """A ``RadixAttention``-like layer's knobs; ``layer_id`` stays 0, so layers with one
    configuration share one executable. ``layer.use_irope`` makes a chunked local layer only in a
    local-attention model (``local_model``); elsewhere it attends fully, as in the seed. ``mla``: the
    model is MLA (absorbed latent attention: ``head_dim`` = kv_lora_rank + rope, ``v_head_dim`` =
    kv_lora_rank, one kv head)."""
    window = getattr(layer, "sliding_window_size", -1)
    return LayerParams(
        num_q_heads=layer.tp_q_head_num, num_kv_heads=layer.tp_k_head_num, head_dim=layer.head_dim,
        v_head_dim=layer.v_head_dim, scaling=layer.scaling, logit_cap=float(layer.logit_cap or 0.0),
        sliding_window_size=-1 if window is None else int(window),
        is_cross_attention=bool(getattr(layer, "is_cross_attention", False)), causal=causal_of(layer),
        k_scale=scale_of(layer, "k"), v_scale=scale_of(layer, "v"),
        use_irope=local_model and bool(getattr(layer, "use_irope", False)), mla=mla,
    )


def custom_mask(spec_info) -> torch.Tensor:
    mask = getattr(spec_info, "custom_mask", None)
    if mask is None:
        raise ValueError("target verify with topk > 1 needs spec_info.custom_mask (SGLang's flat bool tree "
                         "mask: per request, num_draft rows of seq_len + num_draft columns)")
    return mask


def replay_extend_lens(mode: ForwardMode, spec_info, per_req: int, rows: int, device):
    """New tokens per request at a draft-extend graph replay, as SGLang 0.5.11 takes them: DRAFT_EXTEND
    from ``num_accepted_tokens``; DRAFT_EXTEND_V2 from ``spec_info.extend_seq_lens_tensor``, else
    ``extend_seq_lens_cpu``, else ``num_tokens_per_req`` (default: the bucket's tokens per request)."""
    if mode != ForwardMode.DRAFT_EXTEND_V2:
        return jbatch.accepted_tokens(spec_info)
    lens = getattr(spec_info, "extend_seq_lens_tensor", None)
    if lens is None and getattr(spec_info, "extend_seq_lens_cpu", None) is not None:
        lens = torch.as_tensor(spec_info.extend_seq_lens_cpu, dtype=torch.int64, device=device)
    if lens is None and spec_info is not None:
        each = getattr(spec_info, "num_tokens_per_req", None)
        lens = torch.full((rows,), per_req if each is None or each < 1 else each, dtype=torch.int64, device=device)
    return lens


def pad_wide(x: torch.Tensor, size: int, fill: int) -> torch.Tensor:  # [n] -> i64[size]
    """As int64 padded with ``fill`` to ``size`` entries; a full int64 buffer passes untouched."""
    if x.dim() != 1:
        x = x.reshape(-1)
    if x.dtype != torch.int64:
        x = x.to(torch.int64)
    if x.shape[0] > size:
        raise ValueError(f"{x.shape[0]} entries do not fit the bucket of {size}; capture a larger bucket")
    if x.shape[0] == size:
        return x
    return torch.cat([x, torch.full((size - x.shape[0],), fill, dtype=torch.int64, device=x.device)])
