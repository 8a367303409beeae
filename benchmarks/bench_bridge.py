"""torch_bridge on the GPU: per-layer host overhead, and a 32-layer decode step vs native torch.

    PYTHONPATH=. python3 benchmarks/bench_bridge.py [--batch 64 --ctx 4096 --layers 32 --page-size 16]

1. Host overhead of one bridge call (decode, batch 1, short context: the GPU work is negligible),
   measured as back-to-back host time per call, and split into its parts (import q, compiled call,
   export), and the same on the Mosaic launch path (page 16, Hopper). Calls are enqueued without
   synchronising, so this is what a layer costs the CPU.
2. Decode step of a Llama-style model (1B-class layer shapes: dim 2048, 32/8 heads, d=128, bf16,
   ``--layers`` layers), batch ``--batch`` at context ``--ctx``: through the bridge (paged pool,
   plan replayed per step) vs the same model with SDPA on a contiguous KV cache, each eager and
   captured whole in a ``torch.cuda.graph`` (the bridge's launch path is capturable); also every
   bridge layer through a JAX executable, and attention alone (the per-layer calls of one step).
   Every row is measured in this process; ratios are bridge / native (lower is better).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import jax  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import llama_torch as lt  # noqa: E402

from torch_bridge import (FlashAttentionBackend, ForwardBatch, ForwardMode, MHATokenToKVPool,  # noqa: E402
                          ModelConfig, ModelRunner, RadixAttention, ReqToTokenPool)


def wall(fn, iters: int, warmup: int = 3) -> float:
    """Seconds per call, back to back, synchronised at the ends only."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def host(fn, iters: int) -> float:
    """Host seconds per call (no synchronisation inside the loop)."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    dt = (time.perf_counter() - t0) / iters
    torch.cuda.synchronize()
    return dt


def make_runner(cfg, batch: int, ctx: int, page_size: int, num_layers: int):
    """Contiguous slots per request (page order does not change the work); row 0 / page 0 reserved."""
    r2t = torch.zeros(batch + 1, ctx, dtype=torch.int32, device="cuda")
    r2t[1:] = (page_size + torch.arange(batch * ctx, dtype=torch.int32, device="cuda")).view(batch, ctx)
    pool = MHATokenToKVPool.create(page_size + batch * ctx, num_layers, cfg.n_kv_heads, cfg.head_dim,
                                   torch.bfloat16, "cuda")
    for b in pool.k_buffer + pool.v_buffer:
        b.normal_()
    return ModelRunner(ReqToTokenPool(r2t), pool, ModelConfig(ctx), page_size=page_size, device="cuda")


class StaticBatch:
    """A decode bucket's inputs in persistent int64 buffers, as SGLang's graph runner keeps them: the
    replay hook gets the same tensors every step (their values would be copied in between)."""

    def __init__(self, runner, backend, batch: int, ctx: int):
        self.backend, self.batch = backend, batch
        self.rows = torch.arange(1, batch + 1, device="cuda")
        self.lens = torch.full((batch,), ctx, device="cuda")
        loc = runner.req_to_token_pool.req_to_token[self.rows, ctx - 1].long()
        self.fb = ForwardBatch(ForwardMode.DECODE, batch, self.rows, self.lens, loc, positions=self.lens - 1,
                               token_to_kv_pool=runner.token_to_kv_pool, attn_backend=backend)

    def replay(self):
        """SGLang's replay hook call (positional, as cuda_graph_runner makes it)."""
        self.backend.init_forward_metadata_replay_cuda_graph(self.batch, self.rows, self.lens, None, None,
                                                             ForwardMode.DECODE, None, None)
        return self.fb


def decode_batch(runner, backend, batch: int, ctx: int):
    return StaticBatch(runner, backend, batch, ctx).replay()


def capture(backend, batch: int):
    backend.init_cuda_graph_state(batch, batch)
    z = torch.zeros(batch, dtype=torch.long, device="cuda")
    backend.init_forward_metadata_capture_cuda_graph(batch, batch, z, z + 1, None, ForwardMode.DECODE, None)


def one_layer(cfg, page_size: int):
    """A batch-1, ctx-256 decode step planned through the replay hook, one layer and its q / k, run once."""
    runner = make_runner(cfg, 1, 256, page_size, 1)
    backend = FlashAttentionBackend(runner)
    capture(backend, 1)
    fb = decode_batch(runner, backend, 1, 256)
    layer = RadixAttention(cfg.n_heads, cfg.head_dim, cfg.head_dim**-0.5, cfg.n_kv_heads, 0)
    q = torch.randn(1, cfg.n_heads * cfg.head_dim, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(1, cfg.n_kv_heads * cfg.head_dim, dtype=torch.bfloat16, device="cuda")
    backend.forward(q, k, k, layer, fb)
    return runner, backend, fb, layer, q, k


def bench_launch_overhead(cfg, iters: int) -> dict:
    """Host time of a bridge call on the Mosaic launch path (page 16), if the device has it."""
    runner, backend, fb, layer, q, k = one_layer(cfg, 16)
    if backend.mosaic_path is None:
        return {}
    kv = lt.ContiguousKV(dataclasses.replace(cfg, n_layers=1), 1, 256, torch.bfloat16, "cuda")
    kv.lens = torch.full((1,), 255, device="cuda")
    native = kv.decode_attend(uniform_len=256)
    q3, k3 = q.view(1, cfg.n_heads, cfg.head_dim), k.view(1, cfg.n_kv_heads, cfg.head_dim)
    return {
        "native torch attention (KV write + SDPA), same shape": host(lambda: native(0, q3, k3, k3), iters),
        "launch path (page 16): call, no KV write":
            host(lambda: backend.forward(q, None, None, layer, fb, save_kv_cache=False), iters),
        "launch path (page 16): call + torch KV write": host(lambda: backend.forward(q, k, k, layer, fb), iters),
        "launch path (page 16): per-step plan + tables (replay hook)": host(StaticBatch(runner, backend, 1, 256).replay,
                                                                           iters),
    }


def bench_host_overhead(cfg, iters: int):
    launch_rows = bench_launch_overhead(cfg, iters)
    runner, backend, fb, layer, q, k = one_layer(cfg, 1)
    rows = {
        "bridge call, no KV write": host(lambda: backend.forward(q, None, None, layer, fb, save_kv_cache=False), iters),
        "bridge call + torch KV write": host(lambda: backend.forward(q, k, k, layer, fb), iters),
        "torch set_kv_buffer alone": host(
            lambda: runner.token_to_kv_pool.set_kv_buffer(layer, fb.out_cache_loc, k, k), iters),
    }
    exe = next(iter(backend.runner._step_exes.values()))
    kb, vb = runner.token_to_kv_pool.get_kv_buffer(0)
    views = (backend.runner.importer.view(kb), backend.runner.importer.view(vb), None)
    q3 = q.view(1, cfg.n_heads, cfg.head_dim)
    jq = backend.runner.importer(q3)
    words = backend.step.words
    out = exe(jq, *views, words)
    rows["  part: import q (DLPack, stream-ordered)"] = host(lambda: backend.runner.importer(q3), iters)
    rows["  part: jax.dlpack.from_dlpack (for comparison)"] = host(lambda: jax.dlpack.from_dlpack(q3), iters)
    rows["  part: compiled JAX call"] = host(lambda: exe(jq, *views, words), iters)
    rows["  part: export (torch.from_dlpack)"] = host(lambda: torch.from_dlpack(out), iters)
    rows["  chain: import + call + export"] = host(
        lambda: torch.from_dlpack(exe(backend.runner.importer(q3), *views, words)), iters)
    rows["per-step plan (replay hook)"] = host(StaticBatch(runner, backend, 1, 256).replay, iters)
    eager = StaticBatch(runner, backend, 1, 256).fb
    rows["per-step plan (init_forward_metadata, eager)"] = host(lambda: backend.init_forward_metadata(eager), iters)
    eager.seq_lens_cpu = eager.seq_lens.cpu()
    rows["  eager plan with seq_lens_cpu (host checks on)"] = host(lambda: backend.init_forward_metadata(eager),
                                                                   iters)
    rows.update(launch_rows)
    print("\n## host time per call (us), decode batch 1, ctx 256 (JAX path: page 1)")
    for name, s in rows.items():
        print(f"{name:48s} {1e6 * s:8.1f}")


def graph_step(run, refresh=None):
    """``run`` captured once in a CUDA graph; the returned step calls ``refresh`` then replays it."""
    run()  # warm-up outside the capture (compiles, learns layer shapes)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        run()

    def step():
        if refresh is not None:
            refresh()
        g.replay()
    step.graph = g  # keep the graph alive with the step
    return step


def interleaved(steps: dict, iters: int, rounds: int = 5) -> dict:
    """Median over ``rounds`` of ``wall`` per step, the steps taken in turn each round: host speed
    drifts on a shared machine (the same eager step measured 25.8 then 33.0 ms minutes apart), so
    eager steps are compared in alternation, not one after the other."""
    times = {name: [] for name in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            times[name].append(wall(fn, iters))
    return {name: statistics.median(t) for name, t in times.items()}


def bench_decode(cfg, batch: int, ctx: int, page_size: int, iters: int):
    model = lt.TorchLlama(cfg, 0, "cuda")
    tokens = torch.randint(0, cfg.vocab, (batch,), device="cuda")
    # Native: SDPA over a contiguous cache, every request at ctx keys.
    kv = lt.ContiguousKV(cfg, batch, ctx, torch.bfloat16, "cuda")
    kv.k.normal_(), kv.v.normal_()
    kv.lens = torch.full((batch,), ctx - 1, device="cuda")
    attend = kv.decode_attend(uniform_len=ctx)
    steps = {"native step": lambda: model.forward(tokens, kv.lens, attend)}
    qkv = [torch.randn(batch, h, cfg.head_dim, dtype=torch.bfloat16, device="cuda")
           for h in (cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads)]
    results = {"native attention x layers": wall(lambda: [attend(i, *qkv) for i in range(cfg.n_layers)], iters)}
    try:
        results["native step, CUDA graph"] = wall(graph_step(steps["native step"]), iters)
    except RuntimeError as e:  # an SDPA backend that cannot be captured: report, keep going
        print(f"native step, CUDA graph: not capturable here ({str(e).splitlines()[0]})")
    # Bridge: paged pool, plan replayed per step; the default backend (launch path on Hopper at page
    # sizes the Mosaic kernel takes) and, for comparison, every layer through a JAX executable.
    runner = make_runner(cfg, batch, ctx, page_size, cfg.n_layers)
    for name, path in (("bridge", None), ("bridge via JAX", False)):
        backend = FlashAttentionBackend(runner, mosaic_path=path)
        if path is None and backend.mosaic_path is None:
            continue  # no launch path on this device
        capture(backend, batch)

        static = StaticBatch(runner, backend, batch, ctx)

        def step(static=static):
            fb = static.replay()
            return model.forward(tokens, fb.positions, lt.bridge_attend(model, fb))
        steps[f"{name} step"] = step
        fb = static.replay()
        q, k, v = (x.reshape(batch, -1) for x in qkv)
        results[f"{name} attention x layers"] = wall(
            lambda: [model.attn[i](q, k, v, fb) for i in range(cfg.n_layers)], iters)
        if path is None:
            results[f"{name} step, CUDA graph"] = wall(graph_step(
                lambda: model.forward(tokens, fb.positions, lt.bridge_attend(model, fb)), static.replay), iters)
    results.update(interleaved(steps, iters))
    print(f"\n## decode step, batch {batch}, ctx {ctx}, {cfg.n_layers} layers, {cfg.n_heads}/{cfg.n_kv_heads} "
          f"heads, d={cfg.head_dim}, bf16, page_size {page_size}  (ms; eager steps: median of 5 interleaved rounds)")
    for name, s in sorted(results.items()):
        print(f"{name:36s} {1e3 * s:8.2f}")
    for name in ("bridge", "bridge via JAX"):
        if f"{name} step" in results:
            print(f"{'ratio step (' + name + '/native)':36s} {results[name + ' step'] / results['native step']:8.2f}")
    if "bridge step, CUDA graph" in results and "native step, CUDA graph" in results:
        print(f"{'ratio graph step (bridge/native)':36s} "
              f"{results['bridge step, CUDA graph'] / results['native step, CUDA graph']:8.2f}")


def main(batch=64, ctx=4096, layers=32, page_size=16, iters=10, host_iters=2000):
    assert torch.cuda.is_available(), "bench_bridge needs a CUDA GPU"
    print(f"device: {torch.cuda.get_device_name()}  jax {jax.__version__}  torch {torch.__version__}")
    cfg = dataclasses.replace(lt.CONFIGS["1b"], n_layers=layers)
    bench_host_overhead(cfg, host_iters)
    bench_decode(cfg, batch, ctx, page_size, iters)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--host-iters", type=int, default=2000)
    sys.exit(main(**vars(ap.parse_args())))
