"""Small stand-ins for the SGLang objects the bridge reads, with SGLang's attribute names.

An engine that runs SGLang passes its own objects (duck typing); an engine without SGLang builds
these. The bridge reads exactly the attributes listed here and nothing else:

``ModelRunner``
  ``req_to_token_pool.req_to_token`` (``torch.int32 [max_reqs, max_context_len]``, persistent),
  ``token_to_kv_pool`` (the default pool of ``forward_batch.token_to_kv_pool``), ``page_size``,
  ``model_config.context_len``, ``server_args.speculative_eagle_topk``,
  ``server_args.speculative_num_draft_tokens``, ``server_args.enable_deterministic_inference``;
  optional ``attention_impl`` (jax_attn ``impl``), ``sliding_window_size`` (>= 0: tree verify plans
  the sliding-window table), ``model_config.max_encoder_len`` (a tighter static encoder bound than
  the request table's width), ``model_config.is_local_attention_model`` with
  ``attention_chunk_size`` (the runner's, else the model config's: Llama 4 chunked local layers) and
  the settings that raise (``docs/sglang_contract.md``).
``ForwardBatch``
  ``forward_mode``, ``batch_size``, ``req_pool_indices``, ``seq_lens``, ``out_cache_loc``
  (tree draft decode at planning time: ``[bs, topk, num_steps]`` flattened), ``extend_seq_lens``
  (extend modes), ``encoder_lens`` and ``encoder_out_cache_loc`` (cross attention),
  ``spec_info``, ``token_to_kv_pool``.
``spec_info`` (EAGLE / NGRAM inputs)
  ``topk`` (optional: checked against the server's), ``draft_token_num`` (target verify),
  ``custom_mask`` (target verify with topk > 1: SGLang's flat bool tree mask),
  ``num_accepted_tokens`` (draft extend; the older ``accept_length`` is read as ``+ 1``).
``RadixAttention`` layer
  ``tp_q_head_num``, ``tp_k_head_num``, ``tp_v_head_num``, ``head_dim``, ``v_head_dim``,
  ``scaling``, ``logit_cap``, ``sliding_window_size``, ``is_cross_attention``, ``attn_type``,
  ``use_irope`` (a chunked local layer in a local-attention model), ``layer_id``, ``k_scale_float`` /
  ``v_scale_float`` (or ``k_scale`` / ``v_scale``).
``token_to_kv_pool``
  ``get_kv_buffer(layer_id) -> (k_buffer, v_buffer)`` of ``[num_slots, Hkv, D]`` persistent
  tensors, and ``set_kv_buffer(layer, loc, cache_k, cache_v, k_scale, v_scale)``; SGLang's hybrid
  ``SWAKVPool`` also ``full_to_swa_index_mapping`` (full slot -> SWA slot, persistent), ``swa_layer_nums``
  and ``swa_kv_pool`` (or ``size_swa``): its ``get_kv_buffer`` / ``set_kv_buffer`` route by layer and
  translate sliding-window layers' slots.

Index tensors may be int64 (as SGLang keeps them); the bridge converts them once per step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional, Union

import torch

from jax_attn.metadata import ForwardMode

__all__ = [
    "ForwardMode", "ModelConfig", "ServerArgs", "ReqToTokenPool", "MHATokenToKVPool", "ModelRunner",
    "SpecInfo", "ForwardBatch", "RadixAttention",
]


@dataclasses.dataclass
class ModelConfig:
    context_len: int
    max_encoder_len: int = 0  # static bound on encoder lengths (cross attention); 0 = none
    is_local_attention_model: bool = False  # Llama 4: use_irope layers attend their own chunk only
    attention_chunk_size: Optional[int] = None  # the chunk (tokens, a multiple of page_size) of those layers
    attention_arch: str = "MHA"  # SGLang's AttentionArch name: "MLA" = absorbed latent attention (MLATokenToKVPool)


@dataclasses.dataclass
class ServerArgs:
    speculative_eagle_topk: Optional[int] = None  # tree (topk > 1) speculative steps; None: not speculative
    speculative_num_draft_tokens: Optional[int] = None
    enable_deterministic_inference: bool = False
    cuda_graph_bs: Optional[List[int]] = None  # the graph runner's capture sizes (SGLang fills it at start-up)


@dataclasses.dataclass
class MLATokenToKVPool:
    """SGLang's MLA pool: per layer one latent buffer ``[num_slots, 1, kv_lora_rank + qk_rope_head_dim]``
    (the latent ``c_kv``, then ``k_rope``; slot 0 reserved); the value buffer is its latent part."""

    kv_buffer: List[torch.Tensor]
    kv_lora_rank: int
    qk_rope_head_dim: int

    @classmethod
    def create(cls, num_slots: int, num_layers: int, kv_lora_rank: int, qk_rope_head_dim: int, dtype,
               device="cpu") -> "MLATokenToKVPool":
        return cls([torch.zeros(num_slots, 1, kv_lora_rank + qk_rope_head_dim, dtype=dtype, device=device)
                    for _ in range(num_layers)], kv_lora_rank, qk_rope_head_dim)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id][..., :self.kv_lora_rank]

    def get_kv_buffer(self, layer_id: int):
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """Write whole latent rows ``cache_k [T, kv_lora_rank + rope]`` (``cache_v`` is not stored)."""
        buf = self.kv_buffer[layer.layer_id]
        buf[loc] = cache_k.reshape(-1, *buf.shape[1:]).to(buf.dtype)

    def set_mla_kv_buffer(self, layer, loc: torch.Tensor, cache_k_nope: torch.Tensor,
                          cache_k_rope: torch.Tensor) -> None:
        """Write the latent part ``[T, kv_lora_rank]`` and the rope part ``[T, rope]`` of each row."""
        buf = self.kv_buffer[layer.layer_id]
        rows = torch.cat([cache_k_nope.reshape(-1, 1, self.kv_lora_rank),
                          cache_k_rope.reshape(-1, 1, self.qk_rope_head_dim)], dim=-1)
        buf[loc] = rows.to(buf.dtype)


@dataclasses.dataclass
class ReqToTokenPool:
    """Request rows -> KV slots. Row 0 is reserved for padded batch entries."""

    req_to_token: torch.Tensor  # i32[max_reqs, max_context_len]

    @classmethod
    def create(cls, max_reqs: int, max_context_len: int, device="cpu") -> "ReqToTokenPool":
        return cls(torch.zeros(max_reqs, max_context_len, dtype=torch.int32, device=device))


@dataclasses.dataclass
class MHATokenToKVPool:
    """Per-layer K/V buffers ``[num_slots, Hkv, D]`` (slot 0 reserved), written by torch."""

    k_buffer: List[torch.Tensor]
    v_buffer: List[torch.Tensor]

    @classmethod
    def create(cls, num_slots: int, num_layers: int, num_kv_heads: int, head_dim: int, dtype,
               device="cpu", v_head_dim: Optional[int] = None) -> "MHATokenToKVPool":
        dv = head_dim if v_head_dim is None else v_head_dim
        return cls([torch.zeros(num_slots, num_kv_heads, head_dim, dtype=dtype, device=device)
                    for _ in range(num_layers)],
                   [torch.zeros(num_slots, num_kv_heads, dv, dtype=dtype, device=device)
                    for _ in range(num_layers)])

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int):
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                      k_scale: Optional[float] = None, v_scale: Optional[float] = None) -> None:
        """Write ``cache_k/cache_v [T, Hkv * D]`` at slots ``loc [T]`` (fp8 pools store x / scale)."""
        kb, vb = self.get_kv_buffer(layer.layer_id)
        cache_k = cache_k.reshape(-1, *kb.shape[1:])
        cache_v = cache_v.reshape(-1, *vb.shape[1:])
        if cache_k.dtype != kb.dtype:
            if k_scale is not None:
                cache_k = cache_k / k_scale
            if v_scale is not None:
                cache_v = cache_v / v_scale
            cache_k, cache_v = cache_k.to(kb.dtype), cache_v.to(vb.dtype)
        kb[loc] = cache_k
        vb[loc] = cache_v


@dataclasses.dataclass
class ModelRunner:
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: Union[MHATokenToKVPool, MLATokenToKVPool]
    model_config: ModelConfig
    page_size: int = 1
    server_args: ServerArgs = dataclasses.field(default_factory=ServerArgs)
    attention_impl: str = "auto"  # jax_attn impl: "auto", "triton" or "reference"
    device: str = "cpu"
    sliding_window_size: Optional[int] = None  # >= 0 when the model has sliding-window layers


@dataclasses.dataclass
class SpecInfo:
    """EAGLE's ``EagleVerifyInput`` / ``EagleDraftInput`` fields the bridge reads."""

    topk: Optional[int] = None  # EagleVerifyInput carries it; the backend's own topk rules
    draft_token_num: int = 0  # queries per request in target verify
    num_accepted_tokens: Optional[torch.Tensor] = None  # i32[bs]; draft extend: accepted drafts + 1
    accept_length: Optional[torch.Tensor] = None  # i32[bs]; older name: accepted drafts (read as + 1)
    # bool[sum_b N * (seq_lens[b] + N)]; target verify, topk > 1: request b's N rows of
    # seq_lens[b] + N columns (committed tokens, then the draft tokens), requests in batch order
    custom_mask: Optional[torch.Tensor] = None


@dataclasses.dataclass
class ForwardBatch:
    """One step. ``seq_lens`` include this step's tokens, except in target verify (committed)."""

    forward_mode: ForwardMode
    batch_size: int
    req_pool_indices: torch.Tensor  # i64/i32[bs]
    seq_lens: torch.Tensor  # i64/i32[bs]
    out_cache_loc: torch.Tensor  # i64/i32[num_tokens]
    extend_seq_lens: Optional[torch.Tensor] = None  # [bs]; extend modes
    positions: Optional[torch.Tensor] = None  # [num_tokens]; read by models, not by the bridge
    spec_info: Optional[Any] = None
    encoder_lens: Optional[torch.Tensor] = None  # [bs]; cross attention: encoder tokens per request
    encoder_out_cache_loc: Optional[torch.Tensor] = None  # [sum encoder_lens]; cross-attention K/V slots
    token_to_kv_pool: Optional[Union[MHATokenToKVPool, MLATokenToKVPool]] = None
    req_to_token_pool: Optional[ReqToTokenPool] = None
    attn_backend: Optional[Any] = None
    # MLA's chunked-prefix MHA (SGLang's ForwardBatchDeepSeekMHAMixin; torch_bridge.mla)
    attn_attend_prefix_cache: Optional[bool] = None
    prefix_chunk_idx: Optional[int] = None
    prefix_chunk_cu_seq_lens: Optional[Any] = None  # per chunk: i32[bs + 1] key offsets
    prefix_chunk_max_seq_lens: Optional[List[int]] = None
    mha_return_lse: Optional[bool] = None
    mha_one_shot: Optional[bool] = None
    extend_seq_lens_cpu: Optional[List[int]] = None
    seq_lens_cpu: Optional[torch.Tensor] = None


@dataclasses.dataclass
class RadixAttention:
    """One attention layer's static description (SGLang's ``RadixAttention`` attributes)."""

    num_heads: int
    head_dim: int
    scaling: float
    num_kv_heads: int
    layer_id: int
    logit_cap: float = 0.0
    v_head_dim: int = -1
    sliding_window_size: int = -1
    is_cross_attention: bool = False
    attn_type: str = "DECODER"  # or "ENCODER_ONLY" (bidirectional); SGLang's AttentionType by name
    use_irope: bool = False  # Llama 4 chunked local layer (in a local-attention model; else full attention)
    k_scale_float: Optional[float] = None
    v_scale_float: Optional[float] = None

    def __post_init__(self):
        if self.v_head_dim < 0:
            self.v_head_dim = self.head_dim

    @property
    def tp_q_head_num(self) -> int:
        return self.num_heads

    @property
    def tp_k_head_num(self) -> int:
        return self.num_kv_heads

    @property
    def tp_v_head_num(self) -> int:
        return self.num_kv_heads

    def forward(self, q, k, v, forward_batch: ForwardBatch, save_kv_cache: bool = True, **kw):
        """As SGLang: ``forward_batch.attn_backend.forward(q, k, v, self, forward_batch, ...)``."""
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, save_kv_cache, **kw)

    __call__ = forward
