"""Test-wide settings: hypothesis draws a fixed sequence of examples under CI (CI=true), random
examples elsewhere, so a CI run is reproducible while local runs keep exploring; CPU runs compile with
LLVM at -O0 (below); engine calls run under a grad mode."""

import contextlib
import os
import zlib

import pytest
import torch
from hypothesis import settings

# ---- XLA's CPU compiles ---------------------------------------------------------------------------
# On the CPU every Pallas kernel runs interpreted: a grid loop of thousands of HLO ops per layer, compiled
# anew for each plan shape (4-10 s each). With an empty persistent cache (a fresh CI machine) those compiles
# are most of the suite's time; LLVM at -O0 cuts them by about a quarter, and the tiny shapes run no slower
# that matters. Set here, before JAX creates its CPU client; benchmark and example subprocesses inherit it.
# Only for CPU runs (JAX_PLATFORMS=cpu: make test, CI), never for the GPU suite; an XLA_FLAGS that sets the
# level itself wins.
if os.environ.get("JAX_PLATFORMS") == "cpu" and "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()


def pytest_configure(config):
    """On a host with several GPUs: create JAX's GPU client now, keeping the thread's CUDA context. Created at
    JAX's first use (a module-level array in a test helper), it leaves the last GPU's context current, and
    torch's ``device="cuda"`` follows that context: single-GPU tests' tensors then landed on cuda:1."""
    if os.environ.get("JAX_PLATFORMS") == "cpu" or not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        return
    import jax

    from torch_bridge.dlpack import keeping_cuda_context
    keeping_cuda_context(jax.devices)


settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("dev", print_blob=True)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


# ---- the grad mode an engine calls the bridge under ------------------------------------------------
# vLLM runs its forward under torch.inference_mode(), SGLang under inference_mode or no_grad
# (SGLANG_ENABLE_TORCH_INFERENCE_MODE), tests and scripts often in plain mode: the bridge must behave the
# same in all three. A test that takes the ``engine_grad_mode`` fixture runs its body in one of them:
# JAX_ATTN_GRAD_MODES=all runs every such test in all three; the default (``rotate``) gives each test
# function one mode, chosen by its name, so a CPU run covers the three modes at the cost of one.
GRAD_MODES = {"plain": contextlib.nullcontext, "no_grad": torch.no_grad, "inference": torch.inference_mode}


def pytest_generate_tests(metafunc):
    if "grad_mode" not in metafunc.fixturenames:
        return
    if any("grad_mode" in str(m.args[0]) for m in metafunc.definition.iter_markers("parametrize")):
        return  # the test names its modes itself
    which = os.environ.get("JAX_ATTN_GRAD_MODES", "rotate") or "rotate"
    if which == "all":
        modes = list(GRAD_MODES)
    elif which == "rotate":
        modes = [list(GRAD_MODES)[zlib.crc32(metafunc.definition.nodeid.encode()) % len(GRAD_MODES)]]
    else:
        modes = which.split(",")
        unknown = set(modes) - set(GRAD_MODES)
        if unknown:
            raise ValueError(f"JAX_ATTN_GRAD_MODES={which}: {sorted(unknown)} not in {list(GRAD_MODES)} "
                             "(or 'all' / 'rotate')")
    metafunc.parametrize("grad_mode", modes)


@pytest.fixture
def engine_grad_mode(grad_mode):
    """The test body runs under ``grad_mode`` (``GRAD_MODES``), as an engine's forward does."""
    with GRAD_MODES[grad_mode]():
        yield grad_mode
