"""The suite's one device switch: ``JAX_ATTN_CONTRACT_DEVICE`` (default ``cpu``; ``cuda`` on the GPU machine).

Every torch tensor the suite makes (pools, ``req_to_token``, forward-batch and spec-info tensors, graph
runners' static buffers, activations, sinks) is created on ``DEVICE``; SGLang's host copies
(``seq_lens_cpu``, ``*_cpu`` lists) stay on the host as in SGLang. Checks read device tensors through
``host`` / ``host64`` (``.cpu()`` before ``.numpy()``); the float64 oracle stays in numpy.

On ``cuda`` the bridge runs its compiled kernels (and, on Hopper, the Mosaic launch path for the layers
it covers); JAX must not preallocate the GPU it shares with torch, so ``XLA_PYTHON_CLIENT_PREALLOCATE``
defaults to ``false`` (set before any test touches the device). GPU command::

    JAX_ATTN_CONTRACT_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider -m "not gpu" tests/sglang_contract
"""

from __future__ import annotations

import os

import numpy as np
import torch

ENV = "JAX_ATTN_CONTRACT_DEVICE"


def _device() -> torch.device:
    device = torch.device(os.environ.get(ENV, "cpu") or "cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"{ENV}={device} but torch sees no CUDA device")
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX shares the GPU with torch
        if device.index is None:  # one concrete device: tensors report cuda:N
            device = torch.device("cuda", torch.cuda.current_device())
    elif device.type != "cpu":
        raise ValueError(f"{ENV}={device}: 'cpu' or 'cuda' (or 'cuda:N')")
    return device


DEVICE = _device()
ON_CUDA = DEVICE.type == "cuda"


def host(t: torch.Tensor) -> np.ndarray:
    """A tensor's values in numpy (a copy from the device; on the CPU the tensor's own memory)."""
    return t.detach().cpu().numpy()


def host64(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as float64 numpy (the oracle's precision)."""
    return t.detach().cpu().double().numpy()


def synchronize() -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if ON_CUDA:
        torch.cuda.synchronize(DEVICE)


def hopper() -> bool:
    """Whether ``DEVICE`` is a Hopper GPU (where the bridge's Mosaic launch path, and so real
    ``torch.cuda.graph`` capture of attention, is available)."""
    return ON_CUDA and torch.cuda.get_device_capability(DEVICE) == (9, 0)
