"""Tensor parallel (``examples/tp.py``, ``decode_llama.py --tp``): 2 shards against 1, on the CPU and on 2 GPUs.

XLA's host device count is fixed when JAX starts, and this process already has 1 device, so the checks
run in a subprocess with ``--xla_force_host_platform_device_count=2`` (``tests/tp_check.py``). They use
the persistent compilation cache like the rest of the suite: about 30 s here when warm, about 140 s cold.
``test_tp2_matches_tp1_on_two_gpus`` (``gpu``) runs the same checks on the first 2 GPUs, in float32 and
bfloat16: no host devices, JAX not preallocating. ``test_tp2_over_two_processes_matches_tp1`` runs the model
check in two processes joined by ``jax.distributed`` (CPU, one device each): ``docs/models.md``'s several-hosts
recipe.

``test_tp2_matches_tp1`` checks two things:

- attention per shard is bitwise: one layer's KV write and paged attention per shard, under
  the one plan of the step, give bitwise the outputs and pool halves of the whole layer (page sizes 1 and
  16, prefill then decode). Catches: shard-local ``LayerParams`` with global head counts, a pool sharded
  on the wrong axis (both raise inside the shard).
- the model matches tp=1: the example's prefill and captured decode steps with ``tp=2`` give the
  greedy tokens of ``tp=1`` and its logits to float32 rounding (the row-parallel sums add partial products
  in another order: not bitwise); list, scan and fused layouts, one kv head replicated on both shards.
  Catches: a missing ``psum``, fused q/k/v or gate/up columns not re-ordered per shard, kv heads sharded
  or replicated wrong.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import llama  # noqa: E402
import tp  # noqa: E402


def _run(which: str, platform: str = "cpu", dtypes: str = "float32") -> list:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    if platform == "cpu":
        env.update(JAX_PLATFORMS="cpu",
                   XLA_FLAGS=(os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip())
    else:  # the real devices; JAX shares them with this process's torch
        env.pop("JAX_PLATFORMS", None)
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    cmd = [sys.executable, os.path.join(ROOT, "tests", "tp_check.py"), which, "--platform", platform,
           "--dtypes", dtypes]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    cases = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert cases and proc.returncode in (0, 1), f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return cases


def _check(cases: list, dtypes) -> None:
    """Every dtype's 2 attention cases are bitwise and its 3 model cases match tp=1."""
    for dtype in dtypes:
        mine = [c for c in cases if c["case"].endswith(f"dtype={dtype}")]
        attention = [c for c in mine if c["case"].startswith("attention")]
        model = [c for c in mine if c["case"].startswith("model")]
        assert len(attention) == 2 and all(c["ok"] for c in attention), f"per-shard attention not bitwise: {attention}"
        assert len(model) == 3 and all(c["ok"] for c in model), f"tp=2 model differs from tp=1: {model}"


def test_tp2_matches_tp1():
    _check(_run("all"), ["float32"])  # one subprocess for both kinds: JAX starts once, and xdist cannot split them


@pytest.mark.gpu
def test_tp2_matches_tp1_on_two_gpus():
    """The same checks on 2 GPUs (the kernels compiled, not interpreted), float32 and bfloat16: attention per
    shard bitwise equal to the whole layer's heads; the model's greedy tokens and logits equal to tp=1's
    within the dtype's rounding (``tp_check.LOGIT_TOL``)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        pytest.skip(f"needs 2 CUDA GPUs; torch sees {gpus}")
    _check(_run("all", platform="gpu", dtypes="float32,bfloat16"), ["float32", "bfloat16"])


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def test_tp2_over_two_processes_matches_tp1():
    """``docs/models.md``'s several-hosts recipe, run: two processes joined by ``jax.distributed.initialize``
    (CPU, gloo collectives, one host device each), each running the example's prefill and captured decode steps
    with ``tp=2`` over the global mesh and with ``tp=1`` on its own device. Both processes give tp=1's greedy
    tokens and its logits to float32 rounding, and the same figures.

    Catches: host inputs (the packed plan vector, the request table, sampled ids) that a multi-process step does
    not take as replicated arrays, weights or pools placed only on the first process's devices, a step that
    differs between processes."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)  # one host device per process
    coordinator = f"localhost:{_free_port()}"
    cmd = [sys.executable, os.path.join(ROOT, "tests", "tp_check.py"), "model", "--platform", "cpu",
           "--processes", "2", "--coordinator", coordinator, "--process-id"]
    procs = [subprocess.Popen(cmd + [str(i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=400)
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            p.kill()
    cases = []
    for rc, out, err in outs:
        mine = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
        assert rc == 0 and len(mine) == 1 and mine[0]["ok"], f"rc={rc}\n{out}\n{err[-4000:]}"
        cases.append(mine[0])
    assert cases[0] == cases[1], cases  # the same step in both processes
    assert cases[0]["same_tokens"]


def test_tp_config_errors_name_the_flag():
    cfg = llama.CONFIGS["tiny"]  # 4 query heads, 2 kv heads, ffn 128
    with pytest.raises(ValueError, match=r"--tp 3 must divide the 4 query heads"):
        tp.check_config(cfg, 3)
    with pytest.raises(ValueError, match=r"--tp 4 must divide the 3 kv heads, or be a multiple"):
        tp.check_config(llama.Config(n_heads=12, n_kv_heads=3, ffn_dim=64), 4)
    tp.check_config(llama.Config(n_heads=8, n_kv_heads=2, ffn_dim=64), 4)  # kv heads replicated twice
    assert tp.kv_replicas(llama.Config(n_heads=8, n_kv_heads=2), 4) == 2
    local = tp.local_config(cfg, 2)
    assert (local.n_heads, local.n_kv_heads, local.ffn_dim) == (2, 1, 64)
    with pytest.raises(ValueError, match=r"--tp 64 needs 64 devices"):
        tp.make_mesh(64)
