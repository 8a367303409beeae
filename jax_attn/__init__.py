"""jax_attn: paged attention for serving engines in JAX (SGLang FlashAttention-backend semantics)."""

__version__ = "0.1.0"  # the package version (pyproject reads it)

from jax_attn.attention import attention, varlen_attention
from jax_attn.backend import FlashAttentionBackend, LayerParams
from jax_attn.batch import ForwardBatch, SpecInfo
from jax_attn.capture import StepRunner
from jax_attn.kv_cache import KVPool, set_kv_buffer
from jax_attn.metadata import AttentionMetadata, EncoderMetadata, ForwardMode, WorkSchedule
from jax_attn.planner import plan_draft_extend, plan_extend, plan_idle, plan_uniform, validate_metadata
from jax_attn.reference import merge_state_reference, paged_attention_reference
from jax_attn.spec import CascadeMetadata, plan_draft_decode_tree, plan_verify_tree

__all__ = [
    "attention", "varlen_attention", "FlashAttentionBackend", "LayerParams", "ForwardBatch", "SpecInfo", "StepRunner",
    "KVPool", "set_kv_buffer", "AttentionMetadata", "EncoderMetadata", "ForwardMode", "WorkSchedule",
    "plan_uniform", "plan_extend", "plan_draft_extend", "plan_idle", "validate_metadata",
    "paged_attention_reference", "merge_state_reference", "CascadeMetadata", "plan_verify_tree",
    "plan_draft_decode_tree",
]
