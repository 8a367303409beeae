"""jax_attn: paged attention for serving engines in JAX (SGLang FlashAttention-backend semantics)."""

from jax_attn.metadata import (
    AttentionMetadata,
    EncoderMetadata,
    ForwardMode,
    WorkSchedule,
)

__all__ = ["AttentionMetadata", "EncoderMetadata", "ForwardMode", "WorkSchedule"]
