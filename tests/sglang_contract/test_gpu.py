"""The contract suite on a CUDA GPU (``gpu`` marker): every case of ``tests/sglang_contract`` again, in a
subprocess with ``JAX_ATTN_CONTRACT_DEVICE=cuda`` (``device.DEVICE``), so that pools, ``req_to_token``,
forward-batch, spec-info and graph-buffer tensors live on the GPU and the bridge runs its compiled kernels;
on Hopper the graph cases the bridge can capture run in real ``torch.cuda.graph`` s
(``test_graphs.REAL_CASES``).

The same run by hand (``benchmarks/run_gpu_suite.sh contract`` runs it too)::

    JAX_ATTN_CONTRACT_DEVICE=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false \\
        python3 -m pytest -q -p no:cacheprovider -m "not gpu" tests/sglang_contract
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from tests.sglang_contract.device import ENV, ON_CUDA

pytestmark = pytest.mark.gpu

SUITE = pathlib.Path(__file__).resolve().parent
ROOT = SUITE.parents[1]


def test_contract_suite_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if ON_CUDA:
        pytest.skip(f"this process is already the {ENV}=cuda run")
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and not {"cuda", "gpu"} & set(platforms.split(",")):
        pytest.skip(f"JAX_PLATFORMS={platforms} hides the GPU from JAX")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", str(SUITE)]
    if importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", "8"]  # compile-bound: one process per case group (16 CPU cores on the H100 host)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not an xdist worker's
    env.update({ENV: "cuda", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    summary = proc.stdout.strip().rsplit("\n", 1)[-1]
    print(f"{ENV}=cuda contract suite: {summary}")
    assert proc.returncode == 0, f"{ENV}=cuda {' '.join(cmd[2:])}: rc {proc.returncode}\n{proc.stdout[-12000:]}"
