"""Tokenizers for real checkpoints (the ``tokenizers`` package) and a chat prompt.

A Hugging Face directory brings its ``tokenizer.json``. A GGUF file brings its vocabulary in its
metadata: byte-level BPE (``tokenizer.ggml.model == "gpt2"``: GPT-2, Llama 3, Qwen2, SmolLM2) is
rebuilt from ``tokenizer.ggml.tokens`` / ``merges`` with the pre-tokenizer its ``tokenizer.ggml.pre``
names; control tokens (type 3) become special tokens. SentencePiece vocabularies (``"llama"``:
Llama 2, Mistral) are not rebuilt: put the model's ``tokenizer.json`` beside the ``.gguf`` file.
"""

from __future__ import annotations

import os
from typing import Optional

# Pre-tokenizer split patterns by ``tokenizer.ggml.pre`` (llama.cpp's names). None: GPT-2's, which
# ``ByteLevel(use_regex=True)`` applies itself.
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_SPLITS = {"gpt2": None, "default": None, "smollm": None, "llama-bpe": _LLAMA3, "llama3": _LLAMA3,
           "qwen2": _QWEN2}
_DIGITS = ("smollm",)  # each digit its own word first (SmolLM's tokenizer.json: Digits(individual_digits))
_CONTROL = 3  # llama.cpp token type of special tokens (<|im_start|>, <|endoftext|>, ...)


def gguf_tokenizer(fields: dict, path: str):
    """A ``tokenizers.Tokenizer`` from GGUF metadata (``fields``: name -> value); a ``tokenizer.json``
    beside ``path`` wins."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    beside = os.path.join(os.path.dirname(os.path.abspath(path)), "tokenizer.json")
    if os.path.exists(beside):
        return Tokenizer.from_file(beside)
    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise NotImplementedError(f"GGUF tokenizer model {kind!r}: only byte-level BPE ('gpt2') is rebuilt from "
                                  f"GGUF metadata; put the model's tokenizer.json beside {path}")
    pre = fields.get("tokenizer.ggml.pre", "default")
    if pre not in _SPLITS:
        raise NotImplementedError(f"GGUF pre-tokenizer {pre!r} is not known (known: {sorted(_SPLITS)}); put the "
                                  f"model's tokenizer.json beside {path}")
    tokens = list(fields["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    steps: list = [pre_tokenizers.Digits(individual_digits=True)] if pre in _DIGITS else []
    if _SPLITS[pre] is None:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    types = fields.get("tokenizer.ggml.token_type", [])
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i, t in enumerate(types) if t == _CONTROL])
    return tok


def chat_prompt(user_text: str, template: Optional[str], special: dict) -> str:
    """One user turn, ready for the assistant's reply: the checkpoint's Jinja chat template when it has
    one (``special``: ``bos_token`` / ``eos_token`` strings), else ChatML (SmolLM2, Qwen)."""
    messages = [{"role": "user", "content": user_text}]
    if template:
        import jinja2

        def raise_exception(msg):
            raise ValueError(f"chat template: {msg}")

        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
        return env.from_string(template).render(messages=messages, add_generation_prompt=True,
                                                raise_exception=raise_exception, **special)
    return f"<|im_start|>user\n{user_text}<|im_end|>\n<|im_start|>assistant\n"
