"""The Llama-family model shape the examples run, and its reading from a Hugging Face ``config.json``.

``Config`` is static (hashable: a ``jax.jit`` static argument). ``from_hf_config`` maps the fields of
Llama 2/3, Qwen2/2.5, Mistral and SmolLM2 configs onto it and raises ``NotImplementedError`` naming
the field for what the example model does not compute (Gemma 2/3, Phi-3, other rope types, ...).
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
    sliding_window: int = 0  # > 0: every layer attends its last ``sliding_window`` keys (Mistral v0.1)

    def is_local(self, i: int) -> bool:
        """Layer ``i`` is a chunked local (RoPE) layer; with a chunk size, every fourth is global NoPE."""
        return self.attention_chunk_size > 0 and (i + 1) % 4 != 0

    def uses_rope(self, i: int) -> bool:
        return self.attention_chunk_size == 0 or self.is_local(i)

    def window_left(self) -> int:
        """FA3's inclusive left window for ``sliding_window`` (SGLang: ``sliding_window - 1``); -1 = none."""
        return self.sliding_window - 1 if self.sliding_window > 0 else -1

    def rope_inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies ``f32[head_dim // 2]`` (rotate-half layout), rope scaling applied."""
        half = self.head_dim // 2
        inv = self.rope_theta ** (-np.arange(half, dtype=np.float64) / half)
        return _scaled(inv, dict(self.rope_scaling)).astype(np.float32)


def _scaled(inv: np.ndarray, scaling: dict) -> np.ndarray:
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
    raise NotImplementedError(f"rope scaling {kind!r} is not implemented in the example model (default, linear, "
                              "llama3 are)")


SUPPORTED = ("llama", "mistral", "qwen2")
_NOT_DONE = {
    "gemma": "Gemma: (1 + w) RMSNorm, sqrt(dim) embedding scale, GeLU MLP, head dim 256",
    "gemma2": "Gemma 2: logit softcap, alternating sliding-window layers, query pre-scale, extra norms",
    "gemma3": "Gemma 3: qk-norm, alternating sliding-window layers, two rope bases, query pre-scale",
    "gemma3_text": "Gemma 3: qk-norm, alternating sliding-window layers, two rope bases, query pre-scale",
    "phi3": "Phi-3: fused qkv_proj and gate_up_proj weights, head dim 96, partial rotary, longrope",
}


def from_hf_config(hf: dict, dtype: str = "float32") -> Config:
    """A Hugging Face ``config.json`` (as a dict) -> ``Config``; raises for what the model does not compute."""
    kind = hf.get("model_type")
    if kind in _NOT_DONE:
        raise NotImplementedError(f"model_type {kind!r} ({_NOT_DONE[kind]}) is not implemented in the example "
                                  f"model; supported: {SUPPORTED}")
    if kind not in SUPPORTED:
        raise NotImplementedError(f"model_type {kind!r} is not a supported Llama-family config {SUPPORTED}")
    _check_unsupported(hf)
    n_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
    rope = _rope_fields(hf)
    window = hf.get("sliding_window") or 0
    if kind == "qwen2":  # Qwen2 carries a sliding_window it only uses with use_sliding_window
        window = 0
    return Config(vocab=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=n_heads,
                  n_kv_heads=hf.get("num_key_value_heads") or n_heads, head_dim=head_dim,
                  ffn_dim=hf["intermediate_size"], rope_theta=float(rope.pop("rope_theta", 10000.0)), dtype=dtype,
                  rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
                  qkv_bias=kind == "qwen2",
                  tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                  rope_scaling=tuple(sorted(rope.items())), sliding_window=int(window))


def _rope_fields(hf: dict) -> dict:
    """``rope_theta`` and the scaling fields, from ``rope_parameters`` (transformers 5) or the older
    ``rope_theta`` + ``rope_scaling``."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if "rope_theta" not in rope and "rope_theta" in hf:
        rope["rope_theta"] = hf["rope_theta"]
    if rope.get("rope_type", rope.get("type")) == "default":
        rope = {"rope_theta": rope["rope_theta"]} if "rope_theta" in rope else {}
    _scaled(np.ones(1), {k: v for k, v in rope.items() if k != "rope_theta"})  # raises for an unknown type
    return rope


def _check_unsupported(hf: dict) -> None:
    act = hf.get("hidden_act", "silu")
    problems = {
        "hidden_act": None if act == "silu" else f"{act!r} (only silu)",
        "mlp_bias": "MLP biases" if hf.get("mlp_bias") else None,
        "use_sliding_window": "Qwen2 sliding-window layers" if hf.get("use_sliding_window") else None,
        "partial_rotary_factor": ("partial rotary" if hf.get("partial_rotary_factor", 1.0) != 1.0 else None),
    }
    if hf.get("attention_bias") and hf.get("model_type") == "llama":
        problems["attention_bias"] = "a Llama o_proj bias"
    bad = {k: v for k, v in problems.items() if v}
    if bad:
        raise NotImplementedError(f"config fields not implemented in the example model: {bad}")
