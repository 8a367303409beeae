"""The Llama-family model shape the examples run (``Config``), with per-family switches.

``Config`` is static (hashable: a ``jax.jit`` static argument). Its defaults are a Llama; the switches
turn on what Gemma 2/3 and Phi-3 add: (1 + w) RMSNorm, sandwich norms, q/k norms, the embedding
scale, GeLU-tanh, attention and final logit softcaps, a softmax scale of its own, sliding-window
layers chosen per layer, a second rope base for local layers, partial rotary, LongRoPE (short factors).
``from_hf_config`` (``jax_attn.models.hf_config``) reads a Hugging Face ``config.json`` onto it.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 32000
    dim: int = 2048
    n_layers: int = 16
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int = 128
    ffn_dim: int = 8192
    rope_theta: float = 500000.0
    dtype: str = "bfloat16"
    attention_chunk_size: int = 0  # > 0: Llama-4 iRoPE layers (see ``is_local``)
    rms_eps: float = 1e-5
    qkv_bias: bool = False  # Qwen2: biases on q, k and v projections
    tie_embeddings: bool = False  # the output head is the embedding (no ``head`` weight)
    rope_scaling: tuple = ()  # sorted (key, value) items of HF ``rope_scaling``; () = plain RoPE
    sliding_window: int = 0  # > 0: sliding layers attend their last ``sliding_window`` keys (HF's W)
    # -- Gemma 2/3, Phi-3 (the defaults are Llama's) --
    sliding_layers: tuple = ()  # per layer: True = sliding-window layer; () = every layer (Mistral, Phi-3)
    norm_plus_one: bool = False  # Gemma: RMSNorm scales by (1 + w), in float32 before the cast
    sandwich_norms: bool = False  # Gemma 2/3: norms after attention and after the MLP too
    qk_norm: bool = False  # Gemma 3: RMSNorm over each head of q and k (before RoPE)
    embed_scale: bool = False  # Gemma: embeddings times sqrt(dim), the scale rounded to ``dtype``
    act: str = "silu"  # gated MLP activation: "silu" or "gelu_tanh"
    query_scale: float = 0.0  # softmax scale; 0 = head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float = 0.0  # > 0: attention logits cap * tanh(s / cap)
    final_softcap: float = 0.0  # > 0: output logits cap * tanh(l / cap)
    local_rope: tuple = ()  # Gemma 3 sliding layers: (theta, scaling items); () = the global rope
    rotary_dim: int = 0  # partial rotary: the leading ``rotary_dim`` dims of a head rotate; 0 = head_dim
    max_context: int = 0  # > 0: longest sequence the rope is valid for (LongRoPE short factors)

    def __post_init__(self):
        if self.sliding_layers and len(self.sliding_layers) != self.n_layers:
            raise ValueError(f"{len(self.sliding_layers)=} must be {self.n_layers=} (one flag per layer)")
        if self.act not in ("silu", "gelu_tanh"):
            raise ValueError(f"{self.act=} must be 'silu' or 'gelu_tanh'")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ValueError(f"{self.rotary_dim=} must be even and <= {self.head_dim=}")

    def is_local(self, i: int) -> bool:
        """Layer ``i`` is a chunked local (RoPE) layer; with a chunk size, every fourth is global NoPE."""
        return self.attention_chunk_size > 0 and (i + 1) % 4 != 0

    def uses_rope(self, i: int) -> bool:
        return self.attention_chunk_size == 0 or self.is_local(i)

    def is_sliding(self, i: int) -> bool:
        """Layer ``i`` attends a sliding window (every layer when ``sliding_layers`` is empty)."""
        return self.sliding_window > 0 and (not self.sliding_layers or bool(self.sliding_layers[i]))

    def window_left(self, i: int = 0) -> int:
        """Layer ``i``'s FA3 inclusive left window (SGLang: ``sliding_window - 1``); -1 = none."""
        return self.sliding_window - 1 if self.is_sliding(i) else -1

    def softmax_scale(self) -> float:
        return self.query_scale or self.head_dim**-0.5

    def uniform_layers(self) -> bool:
        """Every layer computes the same function of its weights (``lax.scan`` over layers is possible)."""
        return not self.attention_chunk_size and len({self.is_sliding(i) for i in range(self.n_layers)}) <= 1

    def _rope(self, i: int) -> tuple:
        if self.local_rope and self.is_sliding(i):
            return self.local_rope
        return self.rope_theta, self.rope_scaling

    def rope_inv_freq(self, i: int = 0) -> np.ndarray:
        """Layer ``i``'s RoPE inverse frequencies ``f32[rotary_dim // 2]`` (rotate-half layout over the
        leading ``rotary_dim`` dims), rope scaling applied."""
        theta, scaling = self._rope(i)
        half = (self.rotary_dim or self.head_dim) // 2
        inv = theta ** (-np.arange(half, dtype=np.float64) / half)
        return scaled_inv_freq(inv, dict(scaling)).astype(np.float32)

    def rope_scale(self, i: int = 0) -> float:
        """Factor on layer ``i``'s cos and sin (HF's ``attention_scaling``; LongRoPE's attention factor)."""
        return float(dict(self._rope(i)[1]).get("attention_factor", 1.0))

    def check_context(self, n: int) -> None:
        """Raise unless sequences of ``n`` tokens are computed as the checkpoint's reference code does."""
        if self.max_context and n > self.max_context:
            raise NotImplementedError(
                f"a sequence of {n} tokens is longer than original_max_position_embeddings={self.max_context}: "
                "LongRoPE's long_factor (which Hugging Face switches to past that length) is not implemented")


def scaled_inv_freq(inv: np.ndarray, scaling: dict) -> np.ndarray:
    """``inv`` (plain RoPE inverse frequencies) under HF's ``rope_scaling`` ``scaling``; raises for a type
    not implemented."""
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":  # Llama 3.1: long wavelengths slowed by `factor`, a smooth band between
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = np.clip((old_len / wavelen - lo) / (hi - lo), 0.0, 1.0)
        mixed = (1 - smooth) * inv / factor + smooth * inv
        return np.where(wavelen > old_len / lo, inv / factor, np.where(wavelen < old_len / hi, inv, mixed))
    if kind == "longrope":  # Phi-3: per-frequency short factors (sequences up to the original length)
        short = np.asarray(scaling["short_factor"], np.float64)
        if short.shape != inv.shape:
            raise ValueError(f"longrope short_factor has {short.size} entries; the rotary dims need {inv.size}")
        return inv / short
    raise NotImplementedError(f"rope scaling {kind!r} is not implemented in the example model (default, linear, "
                              "llama3, longrope are)")
