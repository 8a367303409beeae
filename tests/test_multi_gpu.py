"""The torch bridge on a second device, as an SGLang tensor-parallel rank runs it: ``torch.cuda.set_device(1)``,
then pools, request table and activations on ``cuda:1`` while ``jax.devices()[0]`` is GPU 0.

``test_bridge_on_cuda1`` (``gpu``, 2 CUDA devices; the launch path and the JAX path): an extend step with
prefixes, then a decode step continuing those requests, then the replay hook of a decode bucket re-planning
other lengths, through ``torch_bridge.FlashAttentionBackend``; each sequence against a float64 reference.
Outputs and pools are on ``cuda:1``; the JAX side on JAX's device of local hardware id 1 (the plan, the
request table's view, every JAX array the steps leave alive); torch allocates nothing on ``cuda:0`` (its
peak allocation there never rises). On Hopper, the launch path's decode bucket is also captured in a torch
CUDA graph on ``cuda:1`` and replayed after re-planning (``test_bridge_launch.captured_decode_replays``).

``test_bridge_follows_the_pools_jax_device`` (CPU): the same steps in a subprocess with 2 host devices,
the bridge told that the pools' JAX device is host device 1 (``torch_bridge.dlpack.jax_device_for``, the one
place that maps a torch device to a JAX device): every JAX array the bridge makes must land there. Catches
an executable compiled, or an array made, for the default device: on a rank using ``cuda:1`` that is a copy
per step or an error.

Run this file's ``gpu`` tests in their own pytest process: JAX makes the context of the device it last worked
on current, and torch's ``current_device()`` follows it, so after these tests a later single-GPU test's
``device="cuda"`` tensors can land on cuda:1 (seen on 2 H200s, 2026-11-27, despite the ``rank1`` fixture's
reset). The bridge itself keeps the context where it touches CUDA (launches, unloads, JAX's client creation).
"""

import gc
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # run as a script (the CPU check's subprocess)
    sys.path.insert(0, ROOT)

from tests.test_bridge_launch import HKV, HQ, D, captured_decode_replays, fill, plan_step, setup  # noqa: E402
from torch_bridge import FlashAttentionBackend, ForwardMode, RadixAttention  # noqa: E402
from torch_bridge.dlpack import jax_device_for  # noqa: E402

pytestmark = pytest.mark.usefixtures("engine_grad_mode")  # grad modes: tests/conftest.py

# (rows, kv lengths with this step's tokens, new tokens per row); rows new to a step get random K/V first
EXTEND = ([1, 2, 3], [40, 7, 90], [5, 7, 30])  # prefixes of 35, 0 and 60 tokens
DECODE = ([1, 2, 3, 4], [41, 8, 91, 33], [1, 1, 1, 1])  # rows 1-3 continue the extend; row 4 is new
REPLAY = ([5, 1, 6, 3], [20, 42, 61, 92], [1, 1, 1, 1])  # bucket 4, re-planned by the replay hook
TOL = 2e-2  # bf16 outputs: relative to each sequence's largest reference value


def reference64(runner, table, rows, kv_lens, q_lens, q) -> list:
    """Per sequence, float64 causal attention (bottom-right aligned) over the pool as torch holds it:
    ``[q_len, HQ * D]`` each."""
    kb, vb = (b.double().cpu().numpy() for b in runner.token_to_kv_pool.get_kv_buffer(0))
    q = q.double().cpu().numpy().reshape(-1, HQ, D)
    out, start = [], 0
    for r, n, m in zip(rows, kv_lens, q_lens):
        k, v = (np.repeat(b[table[r, :n]], HQ // HKV, axis=1) for b in (kb, vb))  # [n, HQ, D]
        s = np.einsum("qhd,khd->hqk", q[start:start + m], k) * D**-0.5
        s = np.where(np.arange(n)[None, None, :] <= (n - m + np.arange(m))[None, :, None], s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        out.append(np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v).reshape(m, HQ * D))
        start += m
    return out


def check_per_sequence(out, refs, what: str) -> None:
    got = out.double().cpu().numpy()
    bounds = np.cumsum([0] + [r.shape[0] for r in refs])
    errs = [np.abs(got[a:b] - ref).max() / np.abs(ref).max() for a, b, ref in zip(bounds[:-1], bounds[1:], refs)]
    assert max(errs) < TOL, f"{what}: per-sequence relative error {errs}"


def run_step(runner, table, backend, step, rng, *, replay_bs=None):
    """One layer of a step (eager plan, or the replay hook of bucket ``replay_bs``); checked; returns the output."""
    rows, kv_lens, q_lens = (np.asarray(x) for x in step)
    fb, q, k, v = plan_step(runner, table, backend, rows, kv_lens, q_lens, rng, replay_bs=replay_bs)
    out = backend.forward(q, k, v, RadixAttention(HQ, D, D**-0.5, HKV, 0), fb)
    check_per_sequence(out, reference64(runner, table, rows, kv_lens, q_lens, q), f"{fb.forward_mode.name} {step}")
    return out


def bridge_steps(runner, table, backend, rng) -> list:
    """EXTEND, DECODE, then REPLAY through the capture/replay hooks of bucket 4 (no CUDA graph); the outputs."""
    filled: set = set()
    outs = []
    for i, step in enumerate((EXTEND, DECODE, REPLAY)):
        new = [(r, n - m) for r, n, m in zip(*step) if r not in filled]  # rows the bridge has not written yet
        fill(runner, table, [r for r, _ in new], [n for _, n in new], rng)
        filled.update(step[0])
        if step is REPLAY:
            dev = runner.req_to_token_pool.req_to_token.device
            z = torch.zeros(4, dtype=torch.long, device=dev)
            backend.init_cuda_graph_state(4, 4)
            backend.init_forward_metadata_capture_cuda_graph(4, 4, z, z + 1, None, ForwardMode.DECODE, None)
        outs.append(run_step(runner, table, backend, step, rng, replay_bs=4 if step is REPLAY else None))
    return outs


def check_jax_side(backend, jax_device, live_before: set) -> None:
    """The bridge's JAX work is on ``jax_device``: its imports, its request table, the step's plan, and every
    JAX array made since ``live_before`` (ids of ``jax.live_arrays()``) that is still alive."""
    placed = dict(importer={backend.planner.importer.jax_device},
                  req_to_token=backend.jax_backend.req_to_token.devices(), plan=backend.planner.step.words.devices())
    assert all(d == {jax_device} for d in placed.values()), f"not all on {jax_device}: {placed}"
    stray = [(a.shape, a.dtype, a.devices()) for a in jax.live_arrays()
             if id(a) not in live_before and a.devices() != {jax_device}]
    assert not stray, f"JAX arrays the bridge made off {jax_device}: {stray[:8]} ({len(stray)} in all)"


@pytest.fixture
def rank1():
    """``torch.cuda.set_device(1)`` for the test, as an SGLang TP rank does; skips without 2 CUDA devices."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        pytest.skip(f"needs 2 CUDA devices; torch sees {gpus}")
    previous = torch.cuda.current_device()
    torch.cuda.set_device(1)
    try:
        yield torch.device("cuda", 1)
    finally:
        # JAX makes the context of a device it works on current (torch's current device follows it), and its
        # runtime frees a dropped array's buffer later, during another call: collect the test's objects, run
        # one JAX op on the previous device, then set it, so the next test starts there
        gc.collect()
        jax.block_until_ready(jax.device_put(np.int32(0), jax.devices()[previous]) + 1)
        torch.cuda.set_device(previous)


@pytest.mark.gpu
@pytest.mark.parametrize("path", ["launch", "jax"])
def test_bridge_on_cuda1(rank1, path):
    gc.collect()
    torch.cuda.synchronize(0)
    torch.cuda.reset_peak_memory_stats(0)
    on_cuda0 = torch.cuda.memory_allocated(0)
    live = {id(a) for a in jax.live_arrays()}
    rng = np.random.default_rng(31)
    runner, table, backend = setup(8, device="cuda:1", path=None if path == "launch" else False)
    assert (backend.mosaic_path is not None) == (path == "launch"), "an sm80+ GPU with impl auto has the launch path"
    outs = bridge_steps(runner, table, backend, rng)
    pool = runner.token_to_kv_pool
    tensors = outs + pool.k_buffer + pool.v_buffer + [runner.req_to_token_pool.req_to_token]
    assert {t.device for t in tensors} == {rank1}
    jax_device = jax_device_for(rank1)
    assert jax_device.local_hardware_id == 1 and jax_device.platform == "gpu"
    check_jax_side(backend, jax_device, live)
    torch.cuda.synchronize(1)
    peak = torch.cuda.max_memory_allocated(0)
    assert peak == on_cuda0, f"torch allocated on cuda:0 during the test: peak {peak} B, {on_cuda0} B before"


@pytest.mark.gpu
def test_bridge_graph_bucket_on_cuda1(rank1):
    """A captured decode bucket on ``cuda:1`` (as ``test_bridge_launch.test_launch_path_gpu_graph_capture`` on
    device 0): replays equal the reference per sequence and, bitwise, the same step run eagerly."""
    if torch.cuda.get_device_capability(1) != (9, 0):
        pytest.skip("the launch path's graph capture needs a Hopper GPU")
    rng = np.random.default_rng(31)
    runner, table, backend = setup(8, device="cuda:1", path=None)
    bridge_steps(runner, table, backend, rng)
    graphs = FlashAttentionBackend(runner)  # a fresh backend on the same pools: bucket 4 not captured yet
    captured_decode_replays(runner, table, graphs, rng, RadixAttention(HQ, D, D**-0.5, HKV, 0),
                            [([1, 2, 3, 4], [50, 9, 77, 31]), ([6, 5, 2, 3], [3, 70, 12, 95])])


def _host_device_1() -> dict:
    """The CPU check (run in a process with 2 host devices): the steps with the pools' JAX device set to host
    device 1, on the JAX path (the launch path is CUDA only), kernels as the reference impl (the device
    placement is the same for every impl; interpreted kernels would only cost compile time)."""
    import torch_bridge.dlpack as dlpack

    device = jax.devices("cpu")[1]
    dlpack.jax_device_for = lambda _: device  # what cuda:1 maps to on a 2-GPU host, here on the CPU
    live = {id(a) for a in jax.live_arrays()}
    runner, table, _ = setup(9, device="cpu", path=False)
    runner.attention_impl = "reference"
    backend = FlashAttentionBackend(runner, mosaic_path=False)
    outs = bridge_steps(runner, table, backend, np.random.default_rng(32))
    check_jax_side(backend, device, live)
    return dict(ok=True, steps=len(outs), jax_device=device.id)


def test_bridge_follows_the_pools_jax_device():
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
               XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip())
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=300)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    assert json.loads(lines[-1]) == dict(ok=True, steps=3, jax_device=1)


@pytest.mark.gpu
def test_bridge_creating_jax_client_keeps_torch_current_device():
    """JAX's GPU client, created at JAX's first use, leaves its last GPU's context current, and torch's
    ``current_device()`` follows it. The bridge's first JAX use (``dlpack.jax_device_for``) keeps the thread's
    context: a fresh process that makes a ``cuda:0`` importer first still creates ``device="cuda"`` tensors on
    cuda:0 (bug caught: they went to cuda:1 on a 2-GPU host)."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    code = ("import torch; torch.empty(1, device='cuda:0'); from torch_bridge.dlpack import Importer; "
            "Importer(torch.device('cuda', 0)); print(torch.empty(1, device='cuda').device.index)")
    env = dict(os.environ, PYTHONPATH=ROOT, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "0", out.stdout


if __name__ == "__main__":
    print(json.dumps(_host_device_1()), flush=True)

