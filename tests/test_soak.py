"""The soak (``benchmarks/soak.py``): random engine steps through both front ends, each step's pool diffed
and its outputs checked against a float64 oracle. The CPU run is a smoke test of the script; the ``gpu``
run is the short soak: both front ends, page sizes 1 and 16, a target and a draft backend on two streams,
the four configurations in four processes, one graph bucket (4: batches of 1 to 4 requests replay it
padded; the full soak captures 1, 2, 4, 8 and 16). The bridge engines build every kernel of the steps to
come in one round at start-up (``FlashAttentionBackend.prebuild``). Its wall time is printed, not asserted
(the issue's target: 60 s). On an H100 (2026-11-28, benchmarks/RESULTS.md): 51 s of soak with empty compile
caches (63 s with buckets 1 and 4), 47 s for this test with buckets 1 and 4 and warm caches."""

import os
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOAK = os.path.join(ROOT, "benchmarks", "soak.py")


def run_soak(*args: str, env_extra=None, timeout: int = 600) -> str:
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", **(env_extra or {}))
    proc = subprocess.run([sys.executable, SOAK, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"soak {args} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc.stdout


def test_soak_smoke_on_cpu():
    """Both front ends in two processes (``--jobs 2``), each with its compile profile (``--profile``)."""
    out = run_soak("--smoke", "--device", "cpu", "--jobs", "2", "--profile", env_extra={"JAX_PLATFORMS": "cpu"})
    lines = [line for line in out.splitlines() if " page " in line]
    assert len(lines) == 2 and all(line.endswith("OK") for line in lines), out
    assert {line.split()[0] for line in lines} == {"bridge", "jax"}, out
    assert all("mismatches 0" in line and "corrupted slots 0" in line for line in lines), out
    profiles = [line for line in out.splitlines() if line.startswith("XLA compiles: ")]
    assert len(profiles) == 2 and all(int(p.split()[2]) > 0 for p in profiles), out  # each process compiled


@pytest.mark.gpu
def test_short_soak_on_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    t0 = time.perf_counter()
    # 600 warm-up steps: after 300 a rare eager shape class could still first show up in the timed steps
    out = run_soak("--steps", "2000", "--warmup", "600", "--pair", "--jobs", "4", "--buckets", "4",
                   env_extra={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    wall = time.perf_counter() - t0
    print(out)
    lines = [line for line in out.splitlines() if " page " in line]
    assert len(lines) == 6 and all(line.endswith("OK") for line in lines), out  # 2 fronts x 2 pages + 2 drafts
    print(f"short soak: {wall:.0f} s (target 60 s)")
