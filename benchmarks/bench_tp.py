"""Tensor parallel decode step: the example model's captured decode step with its weights, heads and KV pool
split over ``--tp`` devices (``examples/tp.py``) against the same step on one device, in one process.

    python benchmarks/bench_tp.py                 # 2 GPUs: 1b (16 layers), batch 64, KV context ~4096, page 16
    python benchmarks/bench_tp.py --smoke         # the CPU, 2 host devices: tiny model, batch 4, context 64

The issue's target: the TP2 step at batch 64, context 4096, 1B shape at most 0.6x the TP1 step.

Setup (``bench_jax_step.setup``, shared with the single-device step benchmark): random weights, a request
table with shuffled pages, random K/V in the whole pool (never zeros) and each request's length set
directly to about ``--ctx`` (no prefill), the decode bucket captured. TP``N`` takes the same weights and
pool, re-arranged and placed on an ``N``-device mesh (``tp.shard_params``, the pool split on its kv-head
axis, the request table replicated), with a backend planned for the shard's heads, and captures the same step
through ``tp.forward_paged``.

Per ``tp``, in ms per step:
  device    back-to-back calls of the captured executable on the same device inputs, steady state: the
            kernels', GEMMs' and all-reduces' time (``bench_jax_step.time_calls``)
  piped     ``StepRunner.replay`` from host inputs, issued without blocking, steady state: a decode loop's
            step when the host keeps ahead (``bench_jax_step.time_pipelined``)
  blocking  ``StepRunner.replay`` waited on every step (``decode_llama``'s ms/step; ``time_replay``)
and the ratio TP``N`` / TP1 of each. Before timing, both run one step at the same lengths on the same pool
contents: their logits must agree (relative difference printed; the script fails past 0.1 or on a
non-finite logit, a broken split, not rounding). Exit status: non-zero only on such an error.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

SMOKE = dict(config="tiny", batch=4, ctx=64, page_size=16, steps=3)  # --smoke: the CPU, 2 host devices

if __name__ == "__main__" and "--smoke" in sys.argv[1:]:  # before JAX starts: its host device count is fixed then
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # as bench_jax_step: allocate what the steps need
_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.join(os.path.dirname(_HERE), "examples"), _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import decode_llama  # noqa: E402
import tp as tensor_parallel  # noqa: E402
from bench_jax_step import runner_options, setup, time_calls, time_pipelined, time_replay  # noqa: E402

from jax_attn.backend import FlashAttentionBackend  # noqa: E402
from jax_attn.capture import StepRunner  # noqa: E402

MAX_LOGIT_REL_DIFF = 0.1  # TPN against TP1 at the same step: bf16 rounding is far below; a wrong split is not


def shard_env(env: dict, tp: int, layout: str) -> dict:
    """``env`` (``bench_jax_step.setup``'s, tp 1) moved onto a ``tp``-device mesh: its weights and pool
    (contents kept) sharded as ``examples/tp.py`` shards them, a backend for the shard's heads, the decode
    bucket captured. ``env``'s weights and pools are handed over (set to None)."""
    cfg, one = env["cfg"], env["backend"]
    if tensor_parallel.kv_replicas(cfg, tp) > 1:
        raise ValueError(f"--tp {tp} exceeds the {cfg.n_kv_heads} kv heads: replicating a filled pool is not done here")
    mesh = tensor_parallel.make_mesh(tp)
    local = tensor_parallel.local_config(cfg, tp)
    # the request table replicated on the mesh, where the step reads it (left on one device, as
    # decode_llama --tp leaves it, every step would first copy it to the other devices)
    table = jax.device_put(np.asarray(one.req_to_token), NamedSharding(mesh, P()))
    backend = FlashAttentionBackend(table, page_size=one.page_size,
                                    max_context_len=one.max_pages * one.page_size, impl=one.impl,
                                    num_heads=(local.n_heads, local.n_kv_heads))
    params, pspec = tensor_parallel.shard_params(cfg, env["params"], mesh)
    kvspec = jax.tree.map(lambda a: P(*[None] * (a.ndim - 2), tensor_parallel.AXIS, None), env["pools"])
    pools = jax.device_put(env["pools"], jax.tree.map(lambda s: NamedSharding(mesh, s), kvspec))
    env["params"] = env["pools"] = None  # the tp 1 copies are freed with the caller's last reference
    forward = tensor_parallel.forward_paged(cfg, backend, mesh, pspec, kvspec)
    step = decode_llama.make_step(cfg, backend, layout, next_ids=True, forward=forward)
    runner = StepRunner(backend, step, batch_buckets=(env["batch"],), donate_argnums=(1,), **runner_options(()))
    lens = env["lens"]
    runner.capture([env["fb"](lens)], env["tok"](lens), params, pools)
    return dict(env, backend=backend, runner=runner, exe=next(iter(runner.executables.values())), params=params,
                pools=pools)


def step_logits(env: dict) -> np.ndarray:
    """f32[B, V]: one replay at the setup's lengths (it rewrites the same KV slots with the same values)."""
    lens = env["lens"]
    out, env["pools"] = env["runner"].replay(env["fb"](lens), env["tok"](lens), env["params"], env["pools"])
    return np.asarray(out["logits"])


def measure(env: dict, steps: int) -> dict:
    """ms per step: ``device``, ``piped``, ``blocking`` (see the module docstring)."""
    device, _ = time_calls(env, steps, fresh=False)
    piped = time_pipelined(env, env["runner"].replay, steps)
    blocking, _ = time_replay(env, env["runner"].replay, steps)
    return dict(device=device / 1e3, piped=piped / 1e3, blocking=blocking / 1e3)


def print_table(times: dict, tp: int) -> None:
    cols = ("device", "piped", "blocking")
    print("| tp | " + " | ".join(f"{c} ms" for c in cols) + " |")
    print("|---|" + "---|" * len(cols))
    for n, row in times.items():
        print(f"| {n} | " + " | ".join(f"{row[c]:.3f}" for c in cols) + " |")
    print(f"| tp{tp} / tp1 | " + " | ".join(f"{times[tp][c] / times[1][c]:.3f}" for c in cols) + " |")


def run(config="1b", batch=64, ctx=4096, page_size=16, steps=20, layers=None, impl="auto", layout="fused",
        tp=2) -> int:
    """Times tp 1 then tp ``tp``; prints the table. Returns 1 when their logits disagree, else 0."""
    devices = jax.devices()
    if len(devices) < tp:
        raise SystemExit(f"--tp {tp} needs {tp} devices, found {len(devices)} {devices[0].platform} "
                         "(CPU: --smoke, or XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    t0 = time.perf_counter()
    env = setup(config, batch, ctx, page_size, steps, layers, impl, layout)
    cfg = env["cfg"]
    print(f"device={devices[0].device_kind} x{tp} config={config} layers={cfg.n_layers} dtype={cfg.dtype} "
          f"batch={batch} ctx~{ctx} page_size={page_size} layout={layout} impl={env['backend'].impl} steps={steps}")
    logits = {1: step_logits(env)}
    print(f"tp1: set up and captured in {time.perf_counter() - t0:.1f}s", flush=True)
    times = {1: measure(env, steps)}
    t0 = time.perf_counter()
    env = shard_env(env, tp, layout)
    logits[tp] = step_logits(env)
    print(f"tp{tp}: sharded and captured in {time.perf_counter() - t0:.1f}s", flush=True)
    times[tp] = measure(env, steps)
    print_table(times, tp)
    a, b = logits[1], logits[tp]
    rel = float(np.max(np.abs(a - b)) / np.max(np.abs(a)))
    agree = float(np.mean(np.argmax(a, -1) == np.argmax(b, -1)))
    ok = bool(np.isfinite(a).all() and np.isfinite(b).all() and rel <= MAX_LOGIT_REL_DIFF)
    print(f"tp{tp} vs tp1 logits at the same step: max rel diff {rel:.2e}, greedy ids equal for {agree:.0%} of "
          f"the batch: {'OK' if ok else 'FAILED'}")
    print(f"target (issue #38): tp{tp} piped step <= 0.6x tp1: {times[tp]['piped'] / times[1]['piped']:.3f}x")
    return 0 if ok else 1


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="1b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096, help="KV tokens per request (about: lengths ctx - (i %% 7))")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    ap.add_argument("--layers", type=int, default=None, help="override the config's layer count")
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--layout", default="fused", help="llama.LAYOUTS with named weights: list, perlayer, fused, scan")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU with 2 host devices")
    args = vars(ap.parse_args(argv))
    if args.pop("smoke"):
        args.update(SMOKE)
    return run(**args)


if __name__ == "__main__":
    sys.exit(main())
