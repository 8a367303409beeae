"""A Hugging Face ``config.json`` (as a dict) -> ``Config``, one reader per family.

Llama 2/3, Qwen2/2.5, Mistral, SmolLM2 (``llama``, ``qwen2``, ``mistral``), Gemma 2 (``gemma2``),
Gemma 3 (``gemma3_text``, and the text model of a ``gemma3`` config), Phi-3 (``phi3``). A field the
example model does not compute raises ``NotImplementedError`` naming it; a silently different model
is the bug this module exists to prevent. Fields a checkpoint omits take transformers' defaults.
"""

from __future__ import annotations

import math

from jax_attn.models.config import Config

SUPPORTED = ("llama", "mistral", "qwen2", "gemma2", "gemma3_text", "gemma3", "phi3")
_NOT_DONE = {
    "gemma": "Gemma 1: (1 + w) RMSNorm, sqrt(dim) embedding scale, GeLU MLP, head dim 256 (not read here)",
}
# transformers 5.24's class defaults for the fields the Gemma readers use (hub configs omit some;
# a ``gemma3`` config's ``text_config`` holds only what differs from Gemma3TextConfig).
_GEMMA_DEFAULTS = {
    "gemma2": dict(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                   num_attention_heads=8, num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh",
                   rms_norm_eps=1e-6, tie_word_embeddings=True, rope_theta=10000.0, query_pre_attn_scalar=256,
                   sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    "gemma3_text": dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, tie_word_embeddings=True,
                        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, query_pre_attn_scalar=256,
                        sliding_window=4096, final_logit_softcapping=None, attn_logit_softcapping=None,
                        sliding_window_pattern=6),
}
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_new")  # transformers' names of the tanh-approximated GeLU


def from_hf_config(hf: dict, dtype: str = "float32") -> Config:
    """A Hugging Face ``config.json`` (as a dict) -> ``Config``; raises for what the model does not compute."""
    kind = hf.get("model_type")
    if kind in _NOT_DONE:
        raise NotImplementedError(f"model_type {kind!r} ({_NOT_DONE[kind]}) is not implemented in the example "
                                  f"model; supported: {SUPPORTED}")
    if kind not in SUPPORTED:
        raise NotImplementedError(f"model_type {kind!r} is not a supported Llama-family config {SUPPORTED}")
    if kind == "gemma3":  # the multimodal wrapper: its text model only
        hf = gemma3_text_config(hf)
        kind = "gemma3_text"
    if kind in _GEMMA_DEFAULTS:
        return _gemma(dict(_GEMMA_DEFAULTS[kind], **hf), dtype)
    if kind == "phi3":
        return _phi3(hf, dtype)
    return _llama(hf, dtype)


def gemma3_text_config(hf: dict) -> dict:
    """A ``gemma3`` (image-text) config -> its ``text_config`` as a ``gemma3_text`` config dict."""
    text = dict(hf.get("text_config") or {})
    if text.get("model_type", "gemma3_text") != "gemma3_text":
        raise NotImplementedError(f"gemma3 text_config of model_type {text['model_type']!r} (gemma3_text expected)")
    if text.get("final_logit_softcapping") is not None:
        raise NotImplementedError(f"final_logit_softcapping {text['final_logit_softcapping']} in a gemma3 text_config "
                                  "(transformers' Gemma3ForConditionalGeneration ignores it; its causal LM does not)")
    text["model_type"] = "gemma3_text"
    if "tie_word_embeddings" in hf:  # Gemma3ForConditionalGeneration ties by the outer config
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def _shape(hf: dict, dtype: str) -> dict:
    """The fields every family shares, as ``Config`` keyword arguments."""
    n_heads = hf["num_attention_heads"]
    return dict(vocab=hf["vocab_size"], dim=hf["hidden_size"], n_layers=hf["num_hidden_layers"], n_heads=n_heads,
                n_kv_heads=hf.get("num_key_value_heads") or n_heads,
                head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads, ffn_dim=hf["intermediate_size"],
                dtype=dtype, rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def _raise_for(problems: dict) -> None:
    bad = {k: v for k, v in problems.items() if v}
    if bad:
        raise NotImplementedError(f"config fields not implemented in the example model: {bad}")


# ---- Llama, Qwen2, Mistral -------------------------------------------------------------------------
def _llama(hf: dict, dtype: str) -> Config:
    kind = hf["model_type"]
    act = hf.get("hidden_act", "silu")
    _raise_for({
        "hidden_act": None if act == "silu" else f"{act!r} (only silu)",
        "mlp_bias": "MLP biases" if hf.get("mlp_bias") else None,
        "use_sliding_window": "Qwen2 sliding-window layers" if hf.get("use_sliding_window") else None,
        "partial_rotary_factor": "partial rotary" if hf.get("partial_rotary_factor", 1.0) != 1.0 else None,
        "attention_bias": "a Llama o_proj bias" if hf.get("attention_bias") and kind == "llama" else None,
    })
    rope = rope_fields(hf)
    window = 0 if kind == "qwen2" else hf.get("sliding_window") or 0  # Qwen2 uses it only with use_sliding_window
    return Config(**_shape(hf, dtype), rope_theta=float(rope.pop("rope_theta", 10000.0)), qkv_bias=kind == "qwen2",
                  rope_scaling=tuple(sorted(rope.items())), sliding_window=int(window))


def rope_fields(hf: dict) -> dict:
    """``rope_theta`` and the scaling fields, from ``rope_parameters`` (transformers 5) or the older
    ``rope_theta`` + ``rope_scaling``."""
    return _rope_dict(dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {}), hf.get("rope_theta"))


def _rope_dict(rope: dict, theta, allowed=("default", "linear", "llama3")) -> dict:
    """A rope dict with ``rope_theta`` (``theta`` where it has none); raises for a type not in ``allowed``."""
    if "rope_theta" not in rope and theta is not None:
        rope["rope_theta"] = theta
    partial = rope.pop("partial_rotary_factor", 1.0)  # transformers 5 files it here; Phi-3 pops it first
    if partial != 1.0:
        raise NotImplementedError(f"partial_rotary_factor {partial} (partial rotary) is not implemented for this "
                                  "family in the example model")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in allowed:
        raise NotImplementedError(f"rope scaling {kind!r} is not implemented in the example model for this family "
                                  f"({', '.join(allowed)} are)")
    if kind == "default":
        rope = {"rope_theta": rope["rope_theta"]} if "rope_theta" in rope else {}
    return rope


# ---- Gemma 2, Gemma 3 ------------------------------------------------------------------------------
def _gemma(hf: dict, dtype: str) -> Config:
    kind, n = hf["model_type"], hf["num_hidden_layers"]
    act = hf["hidden_activation"]
    capped = hf.get("attn_logit_softcapping")
    _raise_for({
        "hidden_activation": None if act in _GELU_TANH else f"{act!r} (only the tanh GeLU)",
        "attention_bias": "q/k/v/o projection biases" if hf.get("attention_bias") else None,
        "use_bidirectional_attention": "bidirectional attention" if hf.get("use_bidirectional_attention") else None,
        # transformers' Gemma3Attention never passes the cap to attention: a capped config is ambiguous
        "attn_logit_softcapping": (f"{capped} on Gemma 3 (transformers does not apply it)"
                                   if capped and kind == "gemma3_text" else None),
    })
    types = hf.get("layer_types") or _gemma_layer_types(kind, n, hf.get("sliding_window_pattern", 6))
    if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
        raise NotImplementedError(f"layer_types {types} (one of sliding_attention, full_attention per layer)")
    global_rope, local_rope = _gemma_ropes(hf) if kind == "gemma3_text" else (rope_fields(hf), None)
    theta = float(global_rope.pop("rope_theta"))
    local = () if local_rope is None else (float(local_rope.pop("rope_theta")), tuple(sorted(local_rope.items())))
    return Config(**_shape(hf, dtype), rope_theta=theta, rope_scaling=tuple(sorted(global_rope.items())),
                  sliding_window=int(hf.get("sliding_window") or 0),
                  sliding_layers=tuple(t == "sliding_attention" for t in types), local_rope=local,
                  norm_plus_one=True, sandwich_norms=True, qk_norm=kind == "gemma3_text", embed_scale=True,
                  act="gelu_tanh", query_scale=float(hf["query_pre_attn_scalar"]) ** -0.5,
                  attn_softcap=float(capped or 0.0), final_softcap=float(hf.get("final_logit_softcapping") or 0.0))


def _gemma_layer_types(kind: str, n: int, pattern: int) -> list:
    """transformers' default when a config has no ``layer_types``: Gemma 2 alternates (layer 0 sliding);
    Gemma 3 makes every ``sliding_window_pattern``-th layer (1-based) global, the rest sliding."""
    period = 2 if kind == "gemma2" else pattern
    return ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(n)]


def _gemma_ropes(hf: dict) -> tuple:
    """Gemma 3's (global, local) rope dicts: ``rope_parameters`` keyed by layer type (transformers 5), or
    ``rope_theta`` + ``rope_scaling`` (global) and ``rope_local_base_freq`` (local)."""
    params = hf.get("rope_parameters")
    if params:
        if set(params) - {"full_attention", "sliding_attention"}:
            raise NotImplementedError(f"rope_parameters {params} (Gemma 3 keys them by full_attention and "
                                      "sliding_attention)")
        full, sliding = dict(params.get("full_attention") or {}), dict(params.get("sliding_attention") or {})
    else:
        full, sliding = dict(hf.get("rope_scaling") or {}), {}
    full.setdefault("rope_theta", hf["rope_theta"])
    sliding.setdefault("rope_theta", hf["rope_local_base_freq"])
    return _rope_dict(full, None), _rope_dict(sliding, None)


# ---- Phi-3 -----------------------------------------------------------------------------------------
def _phi3(hf: dict, dtype: str) -> Config:
    act = hf.get("hidden_act", "silu")
    _raise_for({"hidden_act": None if act == "silu" else f"{act!r} (only silu)"})
    shape = _shape(hf, dtype)
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    partial = float(rope.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    rotary_dim = int(shape["head_dim"] * partial)
    if rotary_dim % 2 or rotary_dim <= 0:
        raise NotImplementedError(f"partial_rotary_factor {partial} gives {rotary_dim} rotary dims (an even "
                                  "number > 0 needed)")
    max_context = 0
    if rope.get("rope_type", rope.get("type")) in ("longrope", "su", "yarn"):  # Phi3Config: su, yarn = longrope
        rope, max_context = _longrope(hf, rope, rotary_dim)
    rope = _rope_dict(rope, hf.get("rope_theta"), ("default", "longrope"))
    return Config(**shape, rope_theta=float(rope.pop("rope_theta", 10000.0)), rope_scaling=tuple(sorted(rope.items())),
                  sliding_window=int(hf.get("sliding_window") or 0),
                  rotary_dim=0 if rotary_dim == shape["head_dim"] else rotary_dim, max_context=max_context)


def _longrope(hf: dict, rope: dict, rotary_dim: int) -> tuple:
    """transformers' ``_compute_longrope_parameters`` for sequences up to ``original_max_position_embeddings``
    (short factors): the rope dict for ``Config.rope_scaling`` and that length."""
    original = int(hf.get("original_max_position_embeddings", 4096))  # Phi3Config's own field wins
    factor = rope.get("factor") or hf.get("max_position_embeddings", 4096) / original
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    if "short_factor" not in rope:
        raise NotImplementedError(f"rope_scaling {rope} (LongRoPE without short_factor)")
    short = tuple(float(f) for f in rope["short_factor"])
    if len(short) != rotary_dim // 2:
        raise ValueError(f"longrope short_factor has {len(short)} entries; {rotary_dim} rotary dims need "
                         f"{rotary_dim // 2}")
    out = dict(rope_type="longrope", short_factor=short, attention_factor=float(attention_factor))
    if "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    return out, original
