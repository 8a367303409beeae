"""Pallas GPU kernels (Triton lowering): ragged paged attention, split merge, merge_state."""

from jax_attn.kernels.config import DEFAULT_CONFIG, KernelConfig
from jax_attn.kernels.merge_state import merge_state
from jax_attn.kernels.schedule import build_schedule, plan_schedule
from jax_attn.kernels.triton_paged import paged_attention

__all__ = ["DEFAULT_CONFIG", "KernelConfig", "merge_state", "build_schedule", "plan_schedule", "paged_attention"]
