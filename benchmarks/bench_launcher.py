"""Host cost of launching the Mosaic GPU KV-write kernel from torch, and of a CUDA graph of launches.

    PYTHONPATH=. python3 benchmarks/bench_launcher.py [--tokens 64 --slots 4096 --heads 8 --head-dim 128 --layers 32]

Peers, all in this process on the same tensors (bf16 pools, one layer unless said):

* ``launcher`` (``torch_bridge.launcher``, torch's current stream): checked call, ``check=False``,
  and a bound launch (tensors fixed once).
* ``plgpu.as_torch_kernel``: JAX's own torch interop (torch's default stream).
* ``jax.jit`` of the same function on JAX arrays (pools donated): JAX dispatch.
* ``torch index_copy_``: native torch writing the same rows (two ops).
* a ``torch.cuda.graph`` of ``--layers`` bound launches (one pool pair per layer), replayed:
  host time per replay and GPU time per replay (CUDA events).

``host us`` is the enqueue time per call without synchronising; ``wall us`` is back-to-back time
per call synchronised at the ends (the larger of host and GPU time). Ratios are peer / ours
(``check=False``), so > 1 means the peer costs more host time.
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX shares the GPU with torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

from tests.kv_write_kernel import write_kv  # noqa: E402  (the launcher's test kernel)
from torch_bridge.launcher import compile_for_torch  # noqa: E402

import bench_bridge  # noqa: E402  (the shared host/wall timers; benchmarks/ is on sys.path as a script)


def host_us(fn, iters: int) -> float:
    """Host microseconds per call (no synchronisation inside the loop)."""
    return bench_bridge.host(fn, iters) * 1e6


def wall_us(fn, iters: int) -> float:
    """Microseconds per call, back to back, synchronised at the ends only."""
    return bench_bridge.wall(fn, iters) * 1e6


def make_tensors(tokens: int, slots: int, heads: int, dim: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(tokens, heads, dim, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(tokens, heads, dim, device="cuda", generator=g).to(torch.bfloat16)
    loc = torch.randperm(slots - 1, device="cuda", generator=g)[:tokens].to(torch.int32) + 1
    kp = torch.zeros(slots, heads, dim, device="cuda", dtype=torch.bfloat16)
    vp = torch.zeros_like(kp)
    return [k, v, loc, kp, vp]


def written(args) -> bool:
    k, v, loc, kp, vp = args
    return torch.equal(kp[loc.long()], k) and torch.equal(vp[loc.long()], v)


def peer_rows(args, iters: int):
    """(peer, host us, wall us, status) for one layer's write."""
    rows = []
    kern = compile_for_torch(write_kv, *args)
    bound = kern.bind(*args)
    for name, fn in (("launcher (checked)", lambda: kern(*args)),
                     ("launcher check=False", lambda: kern(*args, check=False)),
                     ("launcher bound", bound)):
        args[3].zero_()
        args[4].zero_()
        fn()
        torch.cuda.synchronize()
        rows.append((name, host_us(fn, iters), wall_us(fn, iters), "ok" if written(args) else "WRONG"))
    rows.append(_as_torch_kernel_row(args, iters))
    rows.append(_jax_row(args, iters))
    k, v, loc, kp, vp = args
    idx = loc.long()

    def native():
        kp.index_copy_(0, idx, k)
        vp.index_copy_(0, idx, v)

    rows.append(("torch index_copy_ x2", host_us(native, iters), wall_us(native, iters), "ok"))
    return rows


def _as_torch_kernel_row(args, iters: int):
    from jax.experimental.pallas import mosaic_gpu as plgpu

    try:
        fn = plgpu.as_torch_kernel(write_kv)
        args[3].zero_()
        args[4].zero_()
        fn(*args)
        torch.cuda.synchronize()
        status = "ok" if written(args) else "WRONG"
        call = lambda: fn(*args)  # noqa: E731
        return ("plgpu.as_torch_kernel", host_us(call, iters), wall_us(call, iters), status)
    except Exception as e:  # report, keep the other rows
        return ("plgpu.as_torch_kernel", float("nan"), float("nan"), f"error: {type(e).__name__}: {str(e)[:60]}")


def _jax_row(args, iters: int):
    jargs = [jnp.asarray(a.float().cpu().numpy(), jnp.bfloat16) if a.is_floating_point()
             else jnp.asarray(a.cpu().numpy()) for a in args]
    step = jax.jit(write_kv, donate_argnums=(3, 4))
    state = {"pools": tuple(jargs[3:])}

    def call():
        state["pools"] = step(*jargs[:3], *state["pools"])

    call()
    jax.block_until_ready(state["pools"])
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    host = (time.perf_counter() - t0) / iters * 1e6
    jax.block_until_ready(state["pools"])
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    jax.block_until_ready(state["pools"])
    wall = (time.perf_counter() - t0) / iters * 1e6
    return ("jax.jit (pools donated)", host, wall, "ok")


def graph_rows(tokens, slots, heads, dim, layers: int, iters: int):
    """A CUDA graph of one bound launch per layer: host and GPU time per replay."""
    per_layer = [make_tensors(tokens, slots, heads, dim, seed=i) for i in range(layers)]
    kern = compile_for_torch(write_kv, *per_layer[0])
    bound = [kern.bind(*a) for a in per_layer]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for b in bound:
            b()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for b in bound:
            b()
    for a in per_layer:
        a[3].zero_()
        a[4].zero_()
    graph.replay()
    torch.cuda.synchronize()
    status = "ok" if all(written(a) for a in per_layer) else "WRONG"
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    gpu = start.elapsed_time(end) * 1e3 / iters
    return [(f"graph of {layers} launches: replay", host_us(graph.replay, iters), gpu, status),
            (f"  eager {layers} bound launches", host_us(lambda: [b() for b in bound], iters),
             wall_us(lambda: [b() for b in bound], iters), "ok")]


def main(tokens: int = 64, slots: int = 4096, heads: int = 8, head_dim: int = 128, layers: int = 32,
         iters: int = 2000):
    args = make_tensors(tokens, slots, heads, head_dim)
    rows = peer_rows(args, iters)
    rows += graph_rows(tokens, slots, heads, head_dim, layers, max(iters // 10, 50))
    ours = rows[1][1]
    print(f"\n{torch.cuda.get_device_name()} | jax {jax.__version__} | torch {torch.__version__} | "
          f"KV write: {tokens} tokens, pool {slots} x {heads} x {head_dim} bf16")
    print("| peer | host us | wall/GPU us | host / ours | status |")
    print("|---|---|---|---|---|")
    for name, host, wall, status in rows:
        print(f"| {name} | {host:.1f} | {wall:.1f} | {host / ours:.2f} | {status} |")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--slots", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--iters", type=int, default=2000)
    a = p.parse_args()
    main(a.tokens, a.slots, a.heads, a.head_dim, a.layers, a.iters)
