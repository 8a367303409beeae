"""Load a Llama-family checkpoint: a Hugging Face directory (``config.json``, ``*.safetensors``,
``tokenizer.json``) or a GGUF file (weights dequantized to float32 at load).

Either way the result is one ``Checkpoint``: the ``Config``, the weights as numpy arrays under their
Hugging Face names and orientation (``[out_features, in_features]``; rotate-half RoPE layout), the
tokenizer and the chat template. The example models map those names onto their own weights.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from typing import Any, Optional

import numpy as np

from jax_attn.models.config import Config
from jax_attn.models.hf_config import from_hf_config
from jax_attn.models.tokenizer import chat_prompt, gguf_tokenizer


@dataclasses.dataclass
class Checkpoint:
    config: Config
    tensors: dict  # HF name -> np.ndarray ([out, in] for linear layers)
    tokenizer: Any  # tokenizers.Tokenizer, or None when the checkpoint has none
    chat_template: Optional[str] = None
    bos_token: Optional[str] = None
    eos_token: Optional[str] = None
    source: str = ""

    def prompt_ids(self, text: str, chat: bool = True) -> np.ndarray:
        """``text`` (as one user turn of the chat template with ``chat``) -> token ids ``i32[S]``."""
        if self.tokenizer is None:
            raise ValueError(f"{self.source} has no tokenizer: pass token ids instead of text")
        if chat:
            text = chat_prompt(text, self.chat_template, dict(bos_token=self.bos_token or "",
                                                              eos_token=self.eos_token or ""))
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

    def stop_ids(self) -> set:
        """Ids that end a reply: the EOS token and ChatML's ``<|im_end|>`` when the vocabulary has it."""
        if self.tokenizer is None:
            return set()
        ids = {self.tokenizer.token_to_id(t) for t in (self.eos_token, "<|im_end|>", "<|eot_id|>") if t}
        return {i for i in ids if i is not None}


def load_checkpoint(path: str, dtype: str = "float32") -> Checkpoint:
    """A Hugging Face checkpoint directory or a ``.gguf`` file -> ``Checkpoint`` (``dtype``: the
    ``Config.dtype`` the model will compute in; weights stay numpy until the model casts them)."""
    if os.path.isdir(path):
        return _load_hf_dir(path, dtype)
    if path.endswith(".gguf"):
        return _load_gguf(path, dtype)
    raise ValueError(f"{path=} must be a Hugging Face checkpoint directory (config.json, *.safetensors) or a .gguf "
                     "file")


def _load_hf_dir(path: str, dtype: str) -> Checkpoint:
    from safetensors.numpy import load_file

    with open(os.path.join(path, "config.json")) as f:
        hf = json.load(f)
    config = from_hf_config(hf, dtype)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors in {path} (PyTorch .bin checkpoints are not read: convert them)")
    tensors = {}
    for name in files:
        tensors.update(load_file(name))
    tensors = hf_tensor_names(hf, config, tensors)
    tokenizer, template, special = None, None, {}
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    cfg_path = os.path.join(path, "tokenizer_config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path) as f:
            tc = json.load(f)
        template = tc.get("chat_template")
        special = {k: _token_text(tc.get(k)) for k in ("bos_token", "eos_token")}
    return Checkpoint(config, tensors, tokenizer, template if isinstance(template, str) else None,
                      special.get("bos_token"), special.get("eos_token"), path)


# Gemma 3 image-text checkpoints: where the text model's weights live (transformers 5, then 4) -> our names
_GEMMA3_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                    ("language_model.lm_head.", "lm_head."))
_GEMMA3_OTHER = ("model.vision_tower.", "model.multi_modal_projector.", "vision_tower.", "multi_modal_projector.")


def hf_tensor_names(hf: dict, config: Config, tensors: dict) -> dict:
    """A checkpoint's tensors under the Llama-family names the example models read: Phi-3's fused
    ``qkv_proj`` and ``gate_up_proj`` split into ``q/k/v_proj`` and ``gate/up_proj``; a ``gemma3`` image-text
    checkpoint's text model renamed to a causal LM's names (its vision tower and projector dropped)."""
    if hf.get("model_type") == "gemma3":
        out = {}
        for name, w in tensors.items():
            new = next((to + name[len(frm):] for frm, to in _GEMMA3_PREFIXES if name.startswith(frm)), None)
            if new is not None:
                out[new] = w
            elif not name.startswith(_GEMMA3_OTHER):
                raise NotImplementedError(f"gemma3 checkpoint tensor {name!r} is neither the text model's nor the "
                                          "vision tower's")
        tensors = out
    out = {}
    q, kv = config.n_heads * config.head_dim, config.n_kv_heads * config.head_dim
    for name, w in tensors.items():
        if name.endswith("self_attn.qkv_proj.weight"):  # rows: q, then k, then v
            if w.shape[0] != q + 2 * kv:
                raise ValueError(f"{name}: {w.shape[0]} rows, expected {q} + 2 * {kv} (q, k, v heads * head_dim)")
            stem = name[:-len("qkv_proj.weight")]
            out.update({stem + "q_proj.weight": w[:q], stem + "k_proj.weight": w[q:q + kv],
                        stem + "v_proj.weight": w[q + kv:]})
        elif name.endswith("mlp.gate_up_proj.weight"):  # rows: gate, then up (transformers' chunk(2))
            stem, half = name[:-len("gate_up_proj.weight")], w.shape[0] // 2
            out.update({stem + "gate_proj.weight": w[:half], stem + "up_proj.weight": w[half:]})
        elif name.endswith(("qkv_proj.bias", "gate_up_proj.bias")):
            raise NotImplementedError(f"{name}: fused projection biases are not implemented in the example model")
        else:
            out[name] = w
    return out


def _token_text(tok) -> Optional[str]:
    return tok.get("content") if isinstance(tok, dict) else tok


# GGUF tensor names (llama.cpp) -> Hugging Face names; {i} the layer.
_GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2"}  # GGUF general.architecture -> HF model_type


def _gguf_fields(reader) -> dict:
    out = {}
    for name, field in reader.fields.items():
        try:
            out[name] = field.contents()
        except Exception:  # a field type gguf cannot decode: not one we read
            continue
    return out


def gguf_hf_config(fields: dict) -> dict:
    """GGUF metadata -> the fields of a Hugging Face ``config.json`` that ``from_hf_config`` reads."""
    arch = fields["general.architecture"]
    if arch not in _GGUF_ARCHS:
        raise NotImplementedError(f"GGUF architecture {arch!r} is not supported (supported: {sorted(_GGUF_ARCHS)})")
    get = lambda key, default=None: fields.get(f"{arch}.{key}", default)  # noqa: E731
    n_heads = get("attention.head_count")
    hf = dict(model_type=_GGUF_ARCHS[arch], hidden_size=get("embedding_length"), num_hidden_layers=get("block_count"),
              num_attention_heads=n_heads, num_key_value_heads=get("attention.head_count_kv", n_heads),
              intermediate_size=get("feed_forward_length"), rope_theta=get("rope.freq_base", 10000.0),
              rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
              vocab_size=get("vocab_size", len(fields.get("tokenizer.ggml.tokens", []))))
    head_dim = get("attention.key_length")
    if head_dim:
        hf["head_dim"] = head_dim
    rot = get("rope.dimension_count")
    if rot and rot != (head_dim or hf["hidden_size"] // n_heads):
        hf["partial_rotary_factor"] = rot / (head_dim or hf["hidden_size"] // n_heads)
    scaling = get("rope.scaling.type")
    if scaling and scaling != "none":
        hf["rope_scaling"] = dict(rope_type=scaling, factor=get("rope.scaling.factor"))
    window = get("attention.sliding_window")
    if window:
        hf["sliding_window"] = window
    return hf


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores Llama's q/k rows per head in interleaved (GPT-J) RoPE order; back to rotate-half."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _load_gguf(path: str, dtype: str) -> Checkpoint:
    import gguf

    reader = gguf.GGUFReader(path)
    fields = _gguf_fields(reader)
    hf = gguf_hf_config(fields)
    config = from_hf_config(hf, dtype)
    tensors = {}
    for t in reader.tensors:
        m = re.fullmatch(r"blk\.(\d+)\.(.+)", t.name)
        key = m.group(2) if m else t.name
        if key not in _GGUF_NAMES:
            raise NotImplementedError(f"GGUF tensor {t.name!r} has no place in the Llama-family model")
        name = _GGUF_NAMES[key] if not m else f"model.layers.{m.group(1)}.{_GGUF_NAMES[key]}"
        w = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)
        if hf["model_type"] == "llama" and key in ("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias"):
            w = _unpermute(w, config.n_heads if key.startswith("attn_q") else config.n_kv_heads)
        tensors[name] = w
    if "lm_head.weight" not in tensors:
        config = dataclasses.replace(config, tie_embeddings=True)
    tokens = fields.get("tokenizer.ggml.tokens")
    tok_text = lambda key: tokens[fields[key]] if tokens is not None and key in fields else None  # noqa: E731
    return Checkpoint(config, tensors, gguf_tokenizer(fields, path), fields.get("tokenizer.chat_template"),
                      tok_text("tokenizer.ggml.bos_token_id"), tok_text("tokenizer.ggml.eos_token_id"), path)
