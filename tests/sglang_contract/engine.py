"""Stand-ins for SGLang 0.5.11's engine objects, with its names, defaults and call conventions.

Written by reading ``sglang/srt`` 0.5.11 (``model_executor/forward_batch_info.py``,
``speculative/spec_info.py``, ``server_args.py``, ``configs/model_config.py``,
``layers/radix_attention.py``, ``mem_cache/memory_pool.py``, ``layers/attention/base_attn_backend.py``),
not from ``torch_bridge.types``: an attribute SGLang lacks is absent here too (``ModelConfig`` has no
``max_encoder_len``, ``ModelRunner`` no ``attention_impl``). The speculative inputs are in
``spec_inputs``. Only the attributes the FlashAttention backend, the model runner and the graph
runners touch are modelled; devices are the caller's (``world`` passes ``device.DEVICE``).
"""

from __future__ import annotations

import dataclasses
from enum import Enum, IntEnum, auto
from typing import Any, List, Optional

import torch


class ForwardMode(IntEnum):
    """``sglang.srt.model_executor.forward_batch_info.ForwardMode`` (same members, same values)."""

    EXTEND = auto()
    DECODE = auto()
    MIXED = auto()
    IDLE = auto()
    TARGET_VERIFY = auto()
    DRAFT_EXTEND = auto()
    DRAFT_EXTEND_V2 = auto()
    PREBUILT = auto()
    SPLIT_PREFILL = auto()
    DLLM_EXTEND = auto()

    def _in(self, *modes) -> bool:
        return self in modes

    def is_prefill(self):
        return self.is_extend()

    def is_extend(self, include_draft_extend_v2: bool = False):
        extra = (ForwardMode.DRAFT_EXTEND_V2,) if include_draft_extend_v2 else ()
        return self._in(ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND, ForwardMode.TARGET_VERIFY,
                        ForwardMode.SPLIT_PREFILL, ForwardMode.DLLM_EXTEND, *extra)

    def is_context_parallel_extend(self, include_draft_extend_v2: bool = False):
        extra = (ForwardMode.DRAFT_EXTEND_V2,) if include_draft_extend_v2 else ()
        return self._in(ForwardMode.EXTEND, ForwardMode.MIXED, *extra)

    def is_decode(self):
        return self == ForwardMode.DECODE

    def is_mixed(self):
        return self == ForwardMode.MIXED

    def is_idle(self):
        return self == ForwardMode.IDLE

    def is_decode_or_idle(self):
        return self._in(ForwardMode.DECODE, ForwardMode.IDLE)

    def is_target_verify(self):
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend(self, include_v2: bool = False):
        return self == ForwardMode.DRAFT_EXTEND or (include_v2 and self == ForwardMode.DRAFT_EXTEND_V2)

    def is_draft_extend_v2(self):
        return self == ForwardMode.DRAFT_EXTEND_V2

    def is_extend_or_draft_extend_or_mixed(self, include_draft_extend_v2: bool = False):
        extra = (ForwardMode.DRAFT_EXTEND_V2,) if include_draft_extend_v2 else ()
        return self._in(ForwardMode.EXTEND, ForwardMode.DRAFT_EXTEND, ForwardMode.MIXED, ForwardMode.SPLIT_PREFILL,
                        *extra)

    def is_cuda_graph(self):
        return self._in(ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE, ForwardMode.DLLM_EXTEND)

    def is_cpu_graph(self):
        return self == ForwardMode.DECODE

    def is_split_prefill(self):
        return self == ForwardMode.SPLIT_PREFILL

    def is_extend_without_speculative(self):
        return self.is_extend() and not self.is_target_verify() and not self.is_draft_extend()

    def is_prebuilt(self):
        return self == ForwardMode.PREBUILT

    def is_dllm_extend(self):
        return self == ForwardMode.DLLM_EXTEND


class CaptureHiddenMode(IntEnum):
    NULL = 0
    LAST = 1
    FULL = 2


class SpeculativeAlgorithm(Enum):
    DFLASH = auto()
    EAGLE = auto()
    EAGLE3 = auto()
    STANDALONE = auto()
    NGRAM = auto()
    NONE = auto()

    @classmethod
    def from_string(cls, name: Optional[str]) -> "SpeculativeAlgorithm":
        return cls.NONE if name is None else cls[name.upper()]

    def is_none(self):
        return self == SpeculativeAlgorithm.NONE

    def is_speculative(self):
        return self != SpeculativeAlgorithm.NONE

    def is_eagle(self):
        return self in (SpeculativeAlgorithm.EAGLE, SpeculativeAlgorithm.EAGLE3)

    def is_standalone(self):
        return self == SpeculativeAlgorithm.STANDALONE

    def is_ngram(self):
        return self == SpeculativeAlgorithm.NGRAM

    def is_dflash(self):
        return self == SpeculativeAlgorithm.DFLASH


@dataclasses.dataclass
class ServerArgs:
    """``server_args.ServerArgs`` fields the attention backend and graph runners read (SGLang defaults)."""

    model_path: str = "mock-model"
    context_length: Optional[int] = None
    is_embedding: bool = False
    kv_cache_dtype: str = "auto"
    chunked_prefill_size: Optional[int] = None
    page_size: Optional[int] = None
    tp_size: int = 1
    attention_backend: Optional[str] = None
    decode_attention_backend: Optional[str] = None
    prefill_attention_backend: Optional[str] = None
    speculative_algorithm: Optional[str] = None
    speculative_num_steps: Optional[int] = None
    speculative_eagle_topk: Optional[int] = None
    speculative_num_draft_tokens: Optional[int] = None
    speculative_attention_mode: str = "prefill"
    disable_radix_cache: bool = False
    cuda_graph_bs: Optional[List[int]] = None
    disable_cuda_graph: bool = False
    disable_chunked_prefix_cache: bool = False
    enable_deterministic_inference: bool = False
    enable_two_batch_overlap: bool = False
    enable_torch_compile: bool = False


class AttentionArch(IntEnum):
    MLA = auto()
    MHA = auto()


@dataclasses.dataclass
class HfTextConfig:
    """The HF config fields SGLang's backend reads (``attn_logit_softcapping`` is optional in HF)."""

    num_attention_heads: int
    num_key_value_heads: int
    max_source_positions: int = 0  # encoder-decoder (Whisper-like): the graph runner's encoder_lens fill


@dataclasses.dataclass
class ModelConfig:
    """``configs/model_config.ModelConfig`` attributes the FA backend reads, nothing more."""

    context_len: int
    hf_text_config: HfTextConfig
    head_dim: int
    is_encoder_decoder: bool = False
    attention_arch: AttentionArch = AttentionArch.MHA
    is_local_attention_model: bool = False
    attention_chunk_size: Optional[int] = None
    sliding_window_size: Optional[int] = None
    dtype: torch.dtype = torch.float32

    @property
    def hf_config(self) -> HfTextConfig:
        return self.hf_text_config

    def get_num_kv_heads(self, tensor_parallel_size: int) -> int:
        return max(1, self.hf_text_config.num_key_value_heads // tensor_parallel_size)


class ReqToTokenPool:
    """``mem_cache/memory_pool.ReqToTokenPool``: ``req_to_token`` int32 ``[size + 1, max_context_len]``
    (row 0 reserved for padded batch entries, all zeros)."""

    def __init__(self, size: int, max_context_len: int, device: str, enable_memory_saver: bool):
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int32, device=device)
        self.free_slots = list(range(1, size + 1))

    def write(self, indices, values):
        self.req_to_token[indices] = values

    def alloc_row(self) -> int:
        return self.free_slots.pop(0)


class MHATokenToKVPool:
    """``mem_cache/memory_pool.MHATokenToKVPool``: per layer ``[size + page_size, head_num, head_dim]``
    K and V buffers (page 0 reserved for padded tokens). fp8 pools store uint8 (``store_dtype``), and
    every getter call hands out a new ``view(dtype)`` of the storage, as SGLang's do."""

    def __init__(self, size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int,
                 layer_num: int, device: str, enable_memory_saver: bool, v_head_dim: Optional[int] = None,
                 start_layer: Optional[int] = None, end_layer: Optional[int] = None):
        self.size, self.page_size, self.dtype = size, page_size, dtype
        self.store_dtype = torch.uint8 if dtype in (torch.float8_e5m2, torch.float8_e4m3fn) else dtype
        self.head_num, self.head_dim = head_num, head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim
        self.layer_num, self.device = layer_num, device
        self.start_layer = start_layer or 0
        self.end_layer = end_layer or layer_num - 1
        rows = size + page_size
        store = self.store_dtype
        self.k_buffer = [torch.zeros((rows, head_num, head_dim), dtype=store, device=device) for _ in range(layer_num)]
        self.v_buffer = [torch.zeros((rows, head_num, self.v_head_dim), dtype=store, device=device)
                         for _ in range(layer_num)]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        buf = self.k_buffer[layer_id - self.start_layer]
        return buf.view(self.dtype) if self.store_dtype != self.dtype else buf

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        buf = self.v_buffer[layer_id - self.start_layer]
        return buf.view(self.dtype) if self.store_dtype != self.dtype else buf

    def get_kv_buffer(self, layer_id: int):
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)

    def set_kv_buffer(self, layer, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor,
                      k_scale: Optional[float] = None, v_scale: Optional[float] = None,
                      layer_id_override: Optional[int] = None):
        layer_id = layer.layer_id if layer_id_override is None else layer_id_override
        if cache_k.dtype != self.dtype:
            if k_scale is not None:
                cache_k.div_(k_scale)
            if v_scale is not None:
                cache_v.div_(v_scale)
            cache_k, cache_v = cache_k.to(self.dtype), cache_v.to(self.dtype)
        if self.store_dtype != self.dtype:
            cache_k, cache_v = cache_k.view(self.store_dtype), cache_v.view(self.store_dtype)
        k_buf, v_buf = self.k_buffer[layer_id - self.start_layer], self.v_buffer[layer_id - self.start_layer]
        k_buf[loc] = cache_k.view(-1, self.head_num, self.head_dim)
        v_buf[loc] = cache_v.view(-1, self.head_num, self.v_head_dim)


@dataclasses.dataclass
class ModelRunner:
    """The ``ModelRunner`` attributes SGLang's ``FlashAttentionBackend.__init__`` and the graph runners
    read. No ``attention_impl``: SGLang has none."""

    model_config: ModelConfig
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: MHATokenToKVPool
    server_args: ServerArgs
    page_size: int = 1
    device: str = "cpu"
    tp_size: int = 1
    attn_cp_size: int = 1
    sliding_window_size: Optional[int] = None
    is_draft_worker: bool = False
    attn_backend: Any = None

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        return self.token_to_kv_pool.dtype

    @property
    def attention_chunk_size(self) -> Optional[int]:
        return self.model_config.attention_chunk_size

    @property
    def spec_algorithm(self) -> SpeculativeAlgorithm:
        return SpeculativeAlgorithm.from_string(self.server_args.speculative_algorithm)


class AttentionType(Enum):
    DECODER = "decoder"
    DECODER_BIDIRECTIONAL = "decoder_bidirectional"
    ENCODER_ONLY = "encoder_only"


class RadixAttention(torch.nn.Module):
    """``layers/radix_attention.RadixAttention``: SGLang's constructor, attributes and ``forward``."""

    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int,
                 logit_cap: float = 0.0, v_head_dim: int = -1, sliding_window_size: int = -1,
                 is_cross_attention: bool = False, attn_type: AttentionType = AttentionType.DECODER,
                 use_irope: bool = False, prefix: str = ""):
        super().__init__()
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.tp_v_head_num = num_kv_heads
        self.head_dim = head_dim
        self.qk_head_dim = head_dim
        self.v_head_dim = v_head_dim if v_head_dim != -1 else head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        self.logit_cap = logit_cap
        self.sliding_window_size = sliding_window_size or -1
        self.is_cross_attention = is_cross_attention
        self.use_irope = use_irope
        self.k_scale = None
        self.v_scale = None
        self.k_scale_float = None
        self.v_scale_float = None
        self.quant_method = None
        self.attn_type = attn_type

    def forward(self, q, k, v, forward_batch: "ForwardBatch", save_kv_cache: bool = True, **kwargs):
        if k is not None:
            k = k.view(-1, self.tp_k_head_num, self.qk_head_dim)
            v = v.view(-1, self.tp_v_head_num, self.v_head_dim)
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, save_kv_cache, **kwargs)


@dataclasses.dataclass
class ForwardBatch:
    """``forward_batch_info.ForwardBatch`` (and its DeepSeek-MHA mixin fields): SGLang's names, None defaults."""

    forward_mode: ForwardMode
    batch_size: int
    input_ids: Optional[torch.Tensor]
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens_sum: int
    orig_seq_lens: Optional[torch.Tensor] = None
    out_cache_loc_swa: Optional[torch.Tensor] = None
    seq_lens_cpu: Optional[torch.Tensor] = None
    return_logprob: bool = False
    positions: Optional[torch.Tensor] = None
    extend_num_tokens: Optional[int] = None
    extend_seq_lens: Optional[torch.Tensor] = None
    extend_prefix_lens: Optional[torch.Tensor] = None
    extend_start_loc: Optional[torch.Tensor] = None
    extend_prefix_lens_cpu: Optional[List[int]] = None
    extend_seq_lens_cpu: Optional[List[int]] = None
    extend_logprob_start_lens_cpu: Optional[List[int]] = None
    encoder_cached: Optional[List[bool]] = None
    encoder_lens: Optional[torch.Tensor] = None
    encoder_lens_cpu: Optional[List[int]] = None
    encoder_out_cache_loc: Optional[torch.Tensor] = None
    req_to_token_pool: Optional[ReqToTokenPool] = None
    token_to_kv_pool: Optional[MHATokenToKVPool] = None
    attn_backend: Any = None
    spec_info: Optional[SpecInput] = None
    spec_algorithm: Optional[SpeculativeAlgorithm] = None
    capture_hidden_mode: Optional[CaptureHiddenMode] = None
    padded_static_len: int = -1
    num_token_non_padded: Optional[torch.Tensor] = None
    num_token_non_padded_cpu: Optional[int] = None
    attn_cp_metadata: Any = None
    # ForwardBatchDeepSeekMHAMixin (MLA paths of the seed)
    attn_attend_prefix_cache: Optional[bool] = None
    prefix_chunk_idx: Optional[int] = None
    prefix_chunk_cu_seq_lens: Optional[torch.Tensor] = None
    prefix_chunk_max_seq_lens: Optional[List[int]] = None
    mha_return_lse: Optional[bool] = None
    mha_one_shot: Optional[bool] = None
