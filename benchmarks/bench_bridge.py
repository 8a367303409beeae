"""torch_bridge on the GPU: per-layer host overhead, a 32-layer decode step vs native torch, the host
path under cProfile, and the torch launcher of compiled Mosaic kernels.

Parts (``--parts``, comma-separated; default ``host,decode``):

host: host overhead of one bridge call (decode, batch 1, short context: the GPU work is negligible),
  measured as back-to-back host time per call, and split into its parts (import q, compiled call,
  export), and the same on the Mosaic launch path (page 16, Hopper). Calls are enqueued without
  synchronising, so this is what a layer costs the CPU.
decode: decode step of a Llama-style model (1B-class layer shapes: dim 2048, 32/8 heads, d=128, bf16,
  ``--layers`` layers), batch ``--batch`` at context ``--ctx``: through the bridge (paged pool, plan
  replayed per step) vs the same model with SDPA on a contiguous KV cache, each eager and captured
  whole in a ``torch.cuda.graph`` (the bridge's launch path is capturable); also every bridge layer
  through a JAX executable, and attention alone (the per-layer calls of one step). Every row is
  measured in this process; ratios are bridge / native (lower is better). Where the launch path splits
  the keys (few long sequences), its unsplit launch is timed too; the host time of each captured
  bucket's replay hook is printed.
kernels: the GPU kernels of one eager decode step, native and the bridge, by name (torch's profiler): where the
  step's GPU time goes.
verify: a ``--layers``-layer target-verify step, batch ``--verify-batch``, 8 draft tokens per request at
  context ``--ctx``: an EAGLE tree of topk 4 (prefix pass, expand pass and merge per layer) against chain
  verify (topk 1) of the same tokens, eager and in a CUDA graph, and the host time of one layer call and
  of the replay hook of each.
hostgrid: issue 36's "every configuration" host rows: per configuration (page 16 and 1, split-KV, head dims 96 and
  256, fp8 KV, sinks with a window, softcap, deterministic mode; chain and tree target verify), one layer's host
  time per call without and with its KV write, and its bucket's replay hook after a real graph capture; which
  call ran (``GRID``).
profile: cProfile of the bridge's host path: the replay hook, the eager plan and one layer call, at
  page 1 (JAX path) and 16, each repeated ``--profile-iters`` times.
launcher: host cost of launching the Mosaic GPU KV-write kernel (``tests/kv_write_kernel.py``) from
  torch, and of a CUDA graph of launches. Peers, all in this process on the same tensors (bf16 pools,
  one layer unless said): ``torch_bridge.launcher`` (torch's current stream: checked call,
  ``check=False``, and a bound launch), ``plgpu.as_torch_kernel`` (JAX's own torch interop, torch's
  default stream), ``jax.jit`` of the same function on JAX arrays (pools donated), ``torch
  index_copy_`` (two ops), and a ``torch.cuda.graph`` of ``--layers`` bound launches (one pool pair
  per layer), replayed: host time and GPU time (CUDA events) per replay. ``host us`` is the enqueue
  time per call without synchronising; ``wall us`` is back-to-back time per call synchronised at the
  ends. Ratios are peer / ours (``check=False``): > 1 means the peer costs more host time.

    PYTHONPATH=. python3 benchmarks/bench_bridge.py [--batch 64 --ctx 4096 --layers 32 --page-size 16]
    PYTHONPATH=. python3 benchmarks/bench_bridge.py --parts verify [--verify-batch 16 --ctx 4096]
    PYTHONPATH=. python3 benchmarks/bench_bridge.py --parts hostgrid [--host-iters 2000]
    PYTHONPATH=. python3 benchmarks/bench_bridge.py --parts profile [--profile-iters 300]
    PYTHONPATH=. python3 benchmarks/bench_bridge.py --parts launcher [--tokens 64 --slots 4096 --heads 8 \
        --head-dim 128 --layers 32 --host-iters 2000]
    JAX_PLATFORMS=cpu PYTHONPATH=. python3 benchmarks/bench_bridge.py --smoke   # CPU: tiny model, no graphs

Flags: ``--iters`` (decode timing, 10), ``--host-iters`` (host and launcher timing, 2000), ``--layers``
(decode model layers, launcher graph launches), ``--tokens``, ``--slots``, ``--heads``, ``--head-dim``
(launcher), ``--profile-iters`` (profile), ``--smoke`` (every part at toy sizes; what needs CUDA is
skipped and said in one line).
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import os
import pstats
import statistics
import sys
import time
import types

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the repository (tests.kv_write_kernel), the examples, the benchmarks (common)
for _p in (_ROOT, os.path.join(_ROOT, "examples"), os.path.join(_ROOT, "benchmarks")):
    if _p not in sys.path:
        sys.path.insert(0, _p)
import common  # noqa: E402
import llama_torch as lt  # noqa: E402

from torch_bridge import (FlashAttentionBackend, ForwardBatch, ForwardMode, MHATokenToKVPool,  # noqa: E402
                          ModelConfig, ModelRunner, RadixAttention, ReqToTokenPool)

DEVICE = "cuda"  # "cpu" for a smoke run on a machine without CUDA


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def wall(fn, iters: int, warmup: int = 3, wait=sync) -> float:
    """Seconds per call, back to back, synchronised at the ends only (``wait``: the synchronisation)."""
    for _ in range(warmup):
        fn()
    wait()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    wait()
    return (time.perf_counter() - t0) / iters


def host(fn, iters: int, wait=sync, rounds: int = 10) -> float:
    """Host seconds per call: the fastest of ``rounds`` rounds of ``iters / rounds`` calls (no
    synchronisation inside a round; ``wait``: the one around it). Other load on the machine only slows
    a round, so the fastest is the steadiest figure of the call's own cost."""
    fn()
    wait()
    n, best = max(1, iters // rounds), float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
        wait()
    return best


def make_runner(cfg, batch: int, ctx: int, page_size: int, num_layers: int, dtype=torch.bfloat16):
    """Contiguous slots per request (page order does not change the work); row 0 / page 0 reserved."""
    r2t = torch.zeros(batch + 1, ctx, dtype=torch.int32, device=DEVICE)
    r2t[1:] = (page_size + torch.arange(batch * ctx, dtype=torch.int32, device=DEVICE)).view(batch, ctx)
    pool = MHATokenToKVPool.create(page_size + batch * ctx, num_layers, cfg.n_kv_heads, cfg.head_dim,
                                   dtype, DEVICE)
    for b in pool.k_buffer + pool.v_buffer:
        b.copy_(torch.randn(b.shape, device=DEVICE))  # (fp8 pools have no normal_)
    return ModelRunner(ReqToTokenPool(r2t), pool, ModelConfig(ctx), page_size=page_size, device=DEVICE)


def name_heads(runner, cfg) -> None:
    """Give the runner's model config SGLang's head-count attributes: the launch tables then come with every
    plan (in-graph tables and tree buckets need that)."""
    runner.model_config.hf_text_config = types.SimpleNamespace(num_attention_heads=cfg.n_heads)
    runner.model_config.get_num_kv_heads = lambda tp: cfg.n_kv_heads


class StaticBatch:
    """A decode bucket's inputs in persistent int64 buffers, as SGLang's graph runner keeps them: the
    replay hook gets the same tensors every step (their values would be copied in between)."""

    def __init__(self, runner, backend, batch: int, ctx: int):
        self.backend, self.batch = backend, batch
        self.graphs = graph_hooks(backend)  # (asked once: the timed hook is the backend's alone)
        self.rows = torch.arange(1, batch + 1, device=DEVICE)
        self.lens = torch.full((batch,), ctx, device=DEVICE)
        loc = runner.req_to_token_pool.req_to_token[self.rows, ctx - 1].long()
        self.fb = ForwardBatch(ForwardMode.DECODE, batch, self.rows, self.lens, loc, positions=self.lens - 1,
                               token_to_kv_pool=runner.token_to_kv_pool, attn_backend=backend)

    def replay(self):
        """SGLang's replay hook call (positional, as cuda_graph_runner makes it); an eager plan for a backend
        that refuses CUDA graphs (``graph_hooks``)."""
        if not self.graphs:
            self.backend.init_forward_metadata(self.fb)
            return self.fb
        self.backend.init_forward_metadata_replay_cuda_graph(self.batch, self.rows, self.lens, None, None,
                                                             ForwardMode.DECODE, None, None)
        return self.fb


def eager_step(model, tokens, batch):
    """A bridge step without a graph: ``batch``'s replay hook (or eager plan; a ``StaticBatch`` or
    ``VerifyBatch``), then the model's forward over the batch it returns."""
    def step():
        fb = batch.replay()
        return model.forward(tokens, fb.positions, lt.bridge_attend(model, fb))
    return step


def graph_hooks(backend) -> bool:
    """Whether ``backend`` takes SGLang's CUDA-graph hooks: on CUDA it refuses them when some layer would run
    a JAX executable (``init_cuda_graph_state``), so the every-layer-through-JAX rows plan eagerly there."""
    return backend.cuda_graph_blocker() is None


def decode_batch(runner, backend, batch: int, ctx: int):
    return StaticBatch(runner, backend, batch, ctx).replay()


def capture(backend, batch: int, static: "StaticBatch | None" = None):
    """The capture hook of bucket ``batch``, given ``static``'s buffers as SGLang gives its own (else
    placeholders: a replay with other tensors copies their values in). None where the backend refuses CUDA
    graphs (``graph_hooks``)."""
    if not graph_hooks(backend):
        return
    backend.init_cuda_graph_state(batch, batch)
    z = torch.zeros(batch, dtype=torch.long, device=DEVICE)
    rows, lens = (z, z + 1) if static is None else (static.rows, static.lens)
    backend.init_forward_metadata_capture_cuda_graph(batch, batch, rows, lens, None, ForwardMode.DECODE, None)


def one_layer(cfg, page_size: int, mosaic_path=None):
    """A batch-1, ctx-256 decode step planned through the replay hook, one layer and its q / k, run once
    (``mosaic_path=False``: every layer through a JAX executable)."""
    runner = make_runner(cfg, 1, 256, page_size, 1)
    backend = FlashAttentionBackend(runner, mosaic_path=mosaic_path)
    capture(backend, 1)
    fb = decode_batch(runner, backend, 1, 256)
    layer = RadixAttention(cfg.n_heads, cfg.head_dim, cfg.head_dim**-0.5, cfg.n_kv_heads, 0)
    q = torch.randn(1, cfg.n_heads * cfg.head_dim, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(1, cfg.n_kv_heads * cfg.head_dim, dtype=torch.bfloat16, device=DEVICE)
    backend.forward(q, k, k, layer, fb)
    return runner, backend, fb, layer, q, k


def bench_launch_overhead(cfg, iters: int) -> dict:
    """Host time of a bridge call on the Mosaic launch path (page 16), if the device has it."""
    runner, backend, fb, layer, q, k = one_layer(cfg, 16)
    if backend.mosaic_path is None:
        return {}
    kv = lt.ContiguousKV(dataclasses.replace(cfg, n_layers=1), 1, 256, torch.bfloat16, DEVICE)
    kv.lens = torch.full((1,), 255, device=DEVICE)
    native = kv.decode_attend(uniform_len=256)
    q3, k3 = q.view(1, cfg.n_heads, cfg.head_dim), k.view(1, cfg.n_kv_heads, cfg.head_dim)
    rows = {
        "native torch attention (KV write + SDPA), same shape": host(lambda: native(0, q3, k3, k3), iters),
        "launch path (page 16): call, no KV write":
            host(lambda: backend.forward(q, None, None, layer, fb, save_kv_cache=False), iters),
        "launch path (page 16): call + torch KV write": host(lambda: backend.forward(q, k, k, layer, fb), iters),
        "launch path (page 16): per-step plan + tables (replay hook)": host(StaticBatch(runner, backend, 1, 256).replay,
                                                                           iters),
    }
    rows.update(bench_graph_hook(cfg, iters))
    rows.update(bench_graph_hook(cfg, iters, page=1))
    return rows


def bench_graph_hook(cfg, iters: int, rounds: int = 5, page: int = 16) -> dict:
    """The replay hook of a bucket captured in a CUDA graph, as SGLang's graph runner drives it (capture
    hook and replays given the same static buffers), with the launch tables recomputed inside the graph
    (``torch_bridge.graph_tables``: the hook runs no planner) and, in the same process, with the planner
    run by each hook (the refresh turned off for that backend). Medians of ``rounds`` alternating rounds."""
    if DEVICE != "cuda":
        return {}
    runner = make_runner(cfg, 1, 256, page, 1)
    name_heads(runner, cfg)
    layer = RadixAttention(cfg.n_heads, cfg.head_dim, cfg.head_dim**-0.5, cfg.n_kv_heads, 0)
    q = torch.randn(1, cfg.n_heads * cfg.head_dim, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(1, cfg.n_kv_heads * cfg.head_dim, dtype=torch.bfloat16, device=DEVICE)
    fns, tag = {}, f"launch path (page {page})"
    for name in ("in-graph tables", "planner per hook"):
        backend = FlashAttentionBackend(runner)
        if backend.mosaic_path is None:
            return {}
        if name == "planner per hook":
            backend.planner.make_refresh = lambda *a, **kw: None
        static = StaticBatch(runner, backend, 1, 256)
        capture(backend, 1, static)
        step = graph_step(lambda b=backend, s=static: b.forward(q, k, k, layer, s.fb))
        recorded = any(r.recorded for r in backend.planner.refreshes.values())
        if recorded != (name == "in-graph tables"):
            raise RuntimeError(f"{name}: the in-graph refresh is {'on' if recorded else 'off'}")
        fns[f"{tag}: replay hook, graph bucket, {name}"] = static.replay
        fns[f"{tag}: replay hook + 1-layer graph replay, {name}"] = lambda s=static, st=step: (s.replay(), st())
    times: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(host(fn, iters))
    return {name: statistics.median(t) for name, t in times.items()}


def bench_host(cfg, iters: int):
    launch_rows = bench_launch_overhead(cfg, iters)
    runner, backend, fb, layer, q, k = one_layer(cfg, 1)  # page 1: the Triton-lowered kernel
    tag = "JAX path (page 1)" if backend.mosaic_path is None else "Triton launch path (page 1)"
    rows = {
        f"{tag}: call, no KV write": host(lambda: backend.forward(q, None, None, layer, fb, save_kv_cache=False),
                                          iters),
        f"{tag}: call + torch KV write": host(lambda: backend.forward(q, k, k, layer, fb), iters),
        "torch set_kv_buffer alone": host(
            lambda: runner.token_to_kv_pool.set_kv_buffer(layer, fb.out_cache_loc, k, k), iters),
        f"{tag}: per-step plan (replay hook)": host(StaticBatch(runner, backend, 1, 256).replay, iters),
    }
    runner, backend, fb, layer, q, k = one_layer(cfg, 1, mosaic_path=False)
    rows["JAX path (page 1): call, no KV write"] = host(
        lambda: backend.forward(q, None, None, layer, fb, save_kv_cache=False), iters)
    hit = backend.runner.hits[layer.layer_id]  # the layer's checked JAX-path call
    exe, views, importer = hit.exe, hit.views, backend.runner.importer
    q3 = q.view(1, cfg.n_heads, cfg.head_dim)
    jq = importer(q3)
    words = backend.step.words
    out = exe(jq, *views, words)
    rows["  part: import q (DLPack, stream-ordered)"] = host(lambda: importer(q3), iters)
    rows["  part: jax.dlpack.from_dlpack (for comparison)"] = host(lambda: jax.dlpack.from_dlpack(q3), iters)
    rows["  part: compiled JAX call"] = host(lambda: exe(jq, *views, words), iters)
    rows["  part: export (Importer.export)"] = host(lambda: importer.export(out), iters)
    rows["  part: torch.from_dlpack (for comparison)"] = host(lambda: torch.from_dlpack(out), iters)
    rows["  chain: import + call + export"] = host(lambda: importer.export(exe(importer(q3), *views, words)), iters)
    hook = "replay hook" if graph_hooks(backend) else "eager: CUDA graphs refused on this path"
    rows[f"JAX path (page 1): per-step plan ({hook})"] = host(StaticBatch(runner, backend, 1, 256).replay, iters)
    eager = StaticBatch(runner, backend, 1, 256).fb
    rows["per-step plan (init_forward_metadata, eager)"] = host(lambda: backend.init_forward_metadata(eager), iters)
    eager.seq_lens_cpu = eager.seq_lens.cpu()
    rows["  eager plan with seq_lens_cpu (host checks on)"] = host(lambda: backend.init_forward_metadata(eager),
                                                                   iters)
    rows.update(launch_rows)
    print("\n## host time per call (us), decode batch 1, ctx 256 (page 1: the Triton-lowered kernel)")
    for name, s in rows.items():
        print(f"{name:48s} {1e6 * s:8.1f}")


def graph_step(run, refresh=None):
    """``run`` captured once in a CUDA graph; the returned step calls ``refresh`` then replays it."""
    run()  # warm-up outside the capture (compiles, learns layer shapes)
    sync()
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


def bridge_variant(name, path, runner, model, tokens, qkv, cfg, batch: int, ctx: int, iters: int, steps: dict,
                   results: dict, graphs: dict, hooks: dict) -> bool:
    """One bridge variant of ``bench_decode`` (``path``: its launch path; None the default, False none): its eager
    step, attention alone and, on a GPU, its CUDA-graph step and replay hook host time into the dicts. Returns
    whether its launch tables split the keys."""
    split = False
    backend = FlashAttentionBackend(runner, mosaic_path=path)
    if path is None and backend.mosaic_path is None:
        return False  # no launch path on this device
    if name == "bridge, planner per hook":  # the launch tables from the planner at each replay hook
        if DEVICE != "cuda":
            return False
        backend.planner.make_refresh = lambda *a, **kw: None
    static = StaticBatch(runner, backend, batch, ctx)
    capture(backend, batch, static)
    if path is not False and DEVICE == "cuda":  # captured right after the capture hook, in SGLang's order (a
        # replay hook in between would plan a step of its own, and the graph would not record the table refresh)
        graphs[f"{name} step, CUDA graph"] = graph_step(
            lambda: model.forward(tokens, static.fb.positions, lt.bridge_attend(model, static.fb)), static.replay)
        hooks[f"{name}: replay hook"] = host(static.replay, 300)

    if name != "bridge, planner per hook":
        steps[f"{name} step"] = eager_step(model, tokens, static)
    fb = static.replay()
    q, k, v = (x.reshape(batch, -1) for x in qkv)
    if name != "bridge, planner per hook":
        results[f"{name} attention x layers"] = wall(
            lambda: [model.attn[i](q, k, v, fb) for i in range(cfg.n_layers)], iters)
    if name == "bridge":
        split = any(t.layout is None and t.num_splits > 1 for t in backend.step.tables.values())  # Mosaic split
        splits = sorted((k, t.kv_splits) for k, t in backend.step.tables.items())
        print(f"bridge launch tables: {splits} (table key, kv splits)")
    return split


def native_decode(cfg, batch: int, ctx: int):
    """The model, its step's tokens and the native decode step: SDPA over a contiguous cache, every request at
    ctx keys. Returns (model, tokens, attend, step)."""
    model = lt.TorchLlama(cfg, 0, DEVICE)
    tokens = torch.randint(0, cfg.vocab, (batch,), device=DEVICE)
    kv = lt.ContiguousKV(cfg, batch, ctx, torch.bfloat16, DEVICE)
    kv.k.normal_(), kv.v.normal_()
    kv.lens = torch.full((batch,), ctx - 1, device=DEVICE)
    attend = kv.decode_attend(uniform_len=ctx)
    return model, tokens, attend, lambda: model.forward(tokens, kv.lens, attend)


def bench_kernels(cfg, batch: int, ctx: int, page_size: int, iters: int):
    """Each eager decode step's GPU kernels, native against the bridge's launch path: where a step's GPU time
    goes (calls per step, us per step, by kernel name)."""
    model, tokens, _, native = native_decode(cfg, batch, ctx)
    runner = make_runner(cfg, batch, ctx, page_size, cfg.n_layers)
    name_heads(runner, cfg)
    backend = FlashAttentionBackend(runner)
    static = StaticBatch(runner, backend, batch, ctx)
    capture(backend, batch, static)
    bridge = eager_step(model, tokens, static)
    print(f"\n## kernels of one eager decode step, batch {batch}, ctx {ctx}, {cfg.n_layers} layers, page_size "
          f"{page_size} (us per step; calls per step)")
    for name, step in (("native", native), ("bridge", bridge)):
        times = common.kernel_times(step, lambda _: sync(), iters)
        total = sum(t for _, t in times.values())
        print(f"{name}: {total:.1f} us of GPU time per step")
        for k, (n, t) in list(times.items())[:14]:
            print(f"  {t:9.1f} us  {n:5.1f}x  {k[:110]}")


def bench_decode(cfg, batch: int, ctx: int, page_size: int, iters: int):
    model, tokens, attend, native = native_decode(cfg, batch, ctx)
    steps = {"native step": native}
    qkv = [torch.randn(batch, h, cfg.head_dim, dtype=torch.bfloat16, device=DEVICE)
           for h in (cfg.n_heads, cfg.n_kv_heads, cfg.n_kv_heads)]
    results = {"native attention x layers": wall(lambda: [attend(i, *qkv) for i in range(cfg.n_layers)], iters)}
    graphs = {}  # CUDA-graph steps, timed in alternation like the eager ones (the GPU's clocks drift too)
    if DEVICE != "cuda":
        print("smoke: CUDA graph rows skipped on the CPU")
    else:
        try:
            graphs["native step, CUDA graph"] = graph_step(steps["native step"])
        except RuntimeError as e:  # an SDPA backend that cannot be captured: report, keep going
            print(f"native step, CUDA graph: not capturable here ({str(e).splitlines()[0]})")
    # Bridge: paged pool, plan replayed per step; the default backend (launch path on Hopper at page
    # sizes the Mosaic kernel takes) and, for comparison, every layer through a JAX executable.
    runner = make_runner(cfg, batch, ctx, page_size, cfg.n_layers)
    name_heads(runner, cfg)  # as SGLang's model config does: the launch tables come with every plan
    split = False  # whether the default launch path split the keys (then its unsplit launch is timed too)
    hooks = {}  # host time of each captured bucket's replay hook
    for name, path in (("bridge", None), ("bridge via JAX", False), ("bridge, planner per hook", None),
                       ("bridge, unsplit launch", "unsplit")):
        if path == "unsplit":  # the launch path as it was before split-KV: one CTA per (sequence, kv head)
            if not split:
                continue
            from jax_attn.kernels.mosaic_paged import DEFAULT_MOSAIC_CONFIG
            from torch_bridge.mosaic_path import MosaicPath
            path = MosaicPath(config=dataclasses.replace(DEFAULT_MOSAIC_CONFIG, max_splits=1))
        try:
            split = bridge_variant(name, path, runner, model, tokens, qkv, cfg, batch, ctx, iters, steps, results,
                                   graphs, hooks) or split
        except Exception as e:  # one variant failing must not hide the others' rows
            for d in (steps, results, graphs, hooks):
                for key in (f"{name} step", f"{name} attention x layers", f"{name} step, CUDA graph",
                            f"{name}: replay hook"):
                    d.pop(key, None)
            print(f"{name}: failed ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})")
    results.update(interleaved(steps, iters))
    results.update(interleaved(graphs, max(iters, 50)))
    print(f"\n## decode step, batch {batch}, ctx {ctx}, {cfg.n_layers} layers, {cfg.n_heads}/{cfg.n_kv_heads} "
          f"heads, d={cfg.head_dim}, bf16, page_size {page_size}  (ms; steps: median of 5 interleaved rounds, "
          f"graph steps {max(iters, 50)} per round)")
    for name, s in sorted(results.items()):
        print(f"{name:36s} {1e3 * s:8.3f}")
    for name in ("bridge", "bridge via JAX", "bridge, unsplit launch"):
        if f"{name} step" in results:
            print(f"{'ratio step (' + name + '/native)':36s} {results[name + ' step'] / results['native step']:8.3f}")
    for name in ("bridge", "bridge, planner per hook", "bridge, unsplit launch"):
        if f"{name} step, CUDA graph" in results and "native step, CUDA graph" in results:
            print(f"{'ratio graph step (' + name + '/native)':36s} "
                  f"{results[name + ' step, CUDA graph'] / results['native step, CUDA graph']:8.3f}")
    for name, s in hooks.items():
        print(f"{name + ' (us)':36s} {1e6 * s:8.1f}")


# ---- --parts verify: tree (topk > 1) against chain target verify ------------------------------------
def tree_mask(batch: int, committed: int, draft: int, topk: int) -> torch.Tensor:
    """SGLang's flat verify mask (``SpecInfo.custom_mask``) of an EAGLE-style tree per request: token 0 is
    the root, tokens 1..topk its children, every later token the child of the one ``topk`` before it;
    each draft row sees every committed token, its ancestors and itself."""
    parent = [-1] + [max(0, i - topk) for i in range(1, draft)]
    tree = torch.zeros(draft, draft, dtype=torch.bool)
    for i in range(draft):
        j = i
        while j >= 0:
            tree[i, j] = True
            j = parent[j]
    rows = torch.cat([torch.ones(draft, committed, dtype=torch.bool), tree], 1).reshape(-1)
    return rows.repeat(batch).to(DEVICE)


class VerifyBatch:
    """A target-verify bucket's inputs in persistent buffers (``draft`` tokens per request after ``ctx``
    committed ones), with SGLang's capture and replay hook calls."""

    def __init__(self, runner, backend, batch: int, ctx: int, draft: int, topk: int):
        from torch_bridge.types import SpecInfo

        self.backend, self.batch, self.draft = backend, batch, draft
        self.rows = torch.arange(1, batch + 1, device=DEVICE)
        self.lens = torch.full((batch,), ctx, device=DEVICE)
        mask = tree_mask(batch, ctx, draft, topk) if topk > 1 else None
        self.spec = SpecInfo(topk=topk, draft_token_num=draft, custom_mask=mask)
        loc = runner.req_to_token_pool.req_to_token[self.rows, ctx:ctx + draft].reshape(-1).long()
        self.positions = (ctx + torch.arange(draft, device=DEVICE)).repeat(batch)
        self.fb = ForwardBatch(ForwardMode.TARGET_VERIFY, batch, self.rows, self.lens, loc, positions=self.positions,
                               spec_info=self.spec, token_to_kv_pool=runner.token_to_kv_pool, attn_backend=backend)
        backend.init_cuda_graph_state(batch, batch * draft)
        backend.init_forward_metadata_capture_cuda_graph(batch, batch * draft, self.rows, self.lens, None,
                                                         ForwardMode.TARGET_VERIFY, self.spec)

    def replay(self):
        self.backend.init_forward_metadata_replay_cuda_graph(self.batch, self.rows, self.lens, None, None,
                                                             ForwardMode.TARGET_VERIFY, self.spec, None)
        return self.fb


def bench_verify(cfg, batch: int, ctx: int, page_size: int, iters: int, host_iters: int, draft: int = 8,
                 topk: int = 4):
    """A ``cfg.n_layers``-layer target-verify step (``draft`` tokens per request) through the bridge: an
    EAGLE tree of ``topk`` (the cascade: prefix pass, expand pass, merge per layer) against chain verify
    (topk 1) of the same token count, eager and captured in a CUDA graph; and the host time of one layer
    call of each. Ratios are tree / chain (the issue's target: graph step <= 1.1x)."""
    model = lt.TorchLlama(cfg, 0, DEVICE)
    runner = make_runner(cfg, batch, ctx + draft, page_size, cfg.n_layers)
    name_heads(runner, cfg)
    tokens = torch.randint(0, cfg.vocab, (batch * draft,), device=DEVICE)
    steps, graphs, hosts, ran = {}, {}, {}, {}
    for name, k in (("chain verify (topk 1)", 1), (f"tree verify (topk {topk})", topk)):
        backend = FlashAttentionBackend(runner, topk=k)
        vb = VerifyBatch(runner, backend, batch, ctx, draft, k)
        steps[f"{name} step"] = eager_step(model, tokens, vb)
        if DEVICE == "cuda":
            graphs[f"{name} step, CUDA graph"] = graph_step(
                lambda vb=vb: model.forward(tokens, vb.fb.positions, lt.bridge_attend(model, vb.fb)), vb.replay)
        fb = vb.replay()
        q = torch.randn(batch * draft, cfg.n_heads * cfg.head_dim, dtype=torch.bfloat16, device=DEVICE)
        hosts[f"{name}: layer call, no KV write"] = host(
            lambda b=backend, f=fb: b.forward(q, None, None, model.attn[0], f, save_kv_cache=False), host_iters)
        hosts[f"{name}: replay hook"] = host(vb.replay, host_iters)
        call = getattr(backend.runner.hits.get(0), "call", None)  # the launch path's call; else the JAX path
        ran[name] = "JAX executable" if call is None else type(call).__name__
    results = interleaved(steps, iters)
    results.update(interleaved(graphs, max(iters, 50)))
    print(f"\n## target verify, batch {batch}, {draft} draft tokens per request, ctx {ctx}, {cfg.n_layers} layers, "
          f"{cfg.n_heads}/{cfg.n_kv_heads} heads, d={cfg.head_dim}, bf16, page_size {page_size} (ms)")
    for name, s in results.items():
        print(f"{name:44s} {1e3 * s:8.3f}")
    chain, tree = "chain verify (topk 1)", f"tree verify (topk {topk})"
    for kind in ("step", "step, CUDA graph"):
        if f"{chain} {kind}" in results:
            ratio = results[f"{tree} {kind}"] / results[f"{chain} {kind}"]
            print(f"{'ratio ' + kind + ' (tree/chain)':44s} {ratio:8.3f}")
    print("\n## host time per call (us); layer 0 ran: " + ", ".join(f"{n}: {r}" for n, r in ran.items()))
    for name, s in hosts.items():
        print(f"{name:44s} {1e6 * s:8.1f}")


# ---- --parts hostgrid: host time of a layer call and of the replay hook, per configuration ---------------
@dataclasses.dataclass(frozen=True)
class GridCase:
    """One configuration of ``--parts hostgrid``: a decode bucket of ``batch`` requests at ``ctx``."""

    name: str
    heads: tuple = (32, 8)  # query / kv heads
    head_dim: int = 128
    page: int = 16
    batch: int = 8
    ctx: int = 4096
    kv_dtype: str = "bfloat16"
    sinks: bool = False
    deterministic: bool = False
    layer: tuple = ()  # RadixAttention attributes, (name, value) pairs


GRID = (
    GridCase("Llama 32/8 d128, page 16"),
    GridCase("page 1", page=1),
    GridCase("page 16, B1 ctx 32768 (split)", batch=1, ctx=32768),
    GridCase("page 1, B1 ctx 32768 (split)", page=1, batch=1, ctx=32768),
    GridCase("Phi-3 32/32 d96, page 16", heads=(32, 32), head_dim=96),
    GridCase("Gemma 16/8 d256, page 16", heads=(16, 8), head_dim=256),
    GridCase("fp8 KV (scales 0.5 / 0.7), page 16", kv_dtype="float8_e4m3fn",
             layer=(("k_scale_float", 0.5), ("v_scale_float", 0.7))),
    GridCase("gpt-oss 64/8 d64 + sinks, window 128, page 16", heads=(64, 8), head_dim=64, sinks=True,
             layer=(("sliding_window_size", 127),)),
    GridCase("softcap 30, page 1", page=1, layer=(("logit_cap", 30.0),)),
    GridCase("deterministic, page 16", deterministic=True),
)


def grid_calls(case: GridCase) -> dict:
    """One configuration's timed calls (a layer call without and with its KV write, the replay hook of its
    decode bucket captured in a CUDA graph; on the CPU the eager plan) and what ran."""
    hq, hkv = case.heads
    cfg = types.SimpleNamespace(n_heads=hq, n_kv_heads=hkv, head_dim=case.head_dim)
    runner = make_runner(cfg, case.batch, case.ctx, case.page, 1, getattr(torch, case.kv_dtype))
    runner.server_args.enable_deterministic_inference = case.deterministic
    name_heads(runner, cfg)
    backend = FlashAttentionBackend(runner)
    layer = RadixAttention(hq, case.head_dim, case.head_dim**-0.5, hkv, 0, **dict(case.layer))
    g = torch.Generator(device=DEVICE).manual_seed(0)
    q = torch.randn(case.batch, hq * case.head_dim, device=DEVICE, generator=g).to(torch.bfloat16)
    k = torch.randn(case.batch, hkv * case.head_dim, device=DEVICE, generator=g).to(torch.bfloat16)
    sinks = torch.randn(hq, device=DEVICE, generator=g) if case.sinks else None
    static = StaticBatch(runner, backend, case.batch, case.ctx)
    capture(backend, case.batch, static)
    graph = None
    if DEVICE == "cuda" and static.graphs:
        graph = graph_step(lambda: backend.forward(q, k, k, layer, static.fb, sinks=sinks))
    fb = static.replay()
    return _grid_entry(backend, graph, static.replay,
                       lambda: backend.forward(q, None, None, layer, fb, save_kv_cache=False, sinks=sinks),
                       lambda: backend.forward(q, k, k, layer, fb, sinks=sinks))


def _grid_entry(backend, graph, hook, call, call_kv) -> dict:
    call()
    hit = getattr(backend.runner.hits.get(0), "call", None)
    ran = "JAX executable" if hit is None else type(hit).__module__.rsplit(".", 1)[-1] + "." + type(hit).__name__ + (
        " + merge" if getattr(hit, "merge", None) is not None else "")
    # the hook first: the first layer call after it refreshes the tables once (untimed, ``bench_host_grid``)
    return {"fns": {"replay hook": hook, "call, no KV write": call, "call + KV write": call_kv},
            "ran": ran, "bucket": "captured" if graph is not None else "eager", "keep": (backend, graph)}


def verify_calls(cfg, batch: int, ctx: int) -> dict:
    """``grid_calls`` for target verify (8 draft tokens a request): chain, and trees at pages 16 and 1."""
    entries = {}
    for name, topk, page in (("chain verify, page 16", 1, 16), ("tree verify topk 4, page 16", 4, 16),
                             ("tree verify topk 4, page 1", 4, 1)):
        runner = make_runner(cfg, batch, ctx + 8, page, 1)
        name_heads(runner, cfg)
        backend = FlashAttentionBackend(runner, topk=topk)
        vb = VerifyBatch(runner, backend, batch, ctx, 8, topk)
        layer = RadixAttention(cfg.n_heads, cfg.head_dim, cfg.head_dim**-0.5, cfg.n_kv_heads, 0)
        q = torch.randn(batch * 8, cfg.n_heads * cfg.head_dim, device=DEVICE).to(torch.bfloat16)
        k = torch.randn(batch * 8, cfg.n_kv_heads * cfg.head_dim, device=DEVICE).to(torch.bfloat16)
        graph = None
        if DEVICE == "cuda":
            graph = graph_step(lambda b=backend, v=vb: b.forward(q, k, k, layer, v.fb), vb.replay)
        fb = vb.replay()
        entries[f"{name}, B{batch} ctx {ctx}"] = _grid_entry(
            backend, graph, vb.replay,
            lambda b=backend, f=fb, q=q: b.forward(q, None, None, layer, f, save_kv_cache=False),
            lambda b=backend, f=fb, q=q, k=k: b.forward(q, k, k, layer, f))
    return entries


def bench_host_grid(cfg, iters: int, smoke: bool = False):
    """Issue 36's "every configuration" rows: per configuration, the host time of one layer call (no KV write;
    with it: the step's safe slots, recomputed by each call here as by a step's first layer, and the pool's
    ``set_kv_buffer``) and of its bucket's replay hook. Every configuration is built first, then the calls are
    timed round-robin, ``iters / rounds`` calls a turn, and each figure is its fastest turn: host speed on a
    shared machine drifts for seconds at a time, and round-robin turns see the same drift."""
    rounds = 4 if smoke else 40
    cases = [dataclasses.replace(c, batch=2, ctx=64) for c in GRID[:2]] if smoke else GRID
    entries = {}
    for case in cases:
        name = f"{case.name}, B{case.batch} ctx {case.ctx}"
        try:
            entries[name] = grid_calls(case)
        except Exception as e:  # a configuration this device cannot run: said in its row
            entries[name] = {"fns": {}, "ran": f"failed: {type(e).__name__}: {e}"[:160]}
    entries.update(verify_calls(cfg, *((2, 64) if smoke else (16, 4096))))
    best = {(n, m): float("inf") for n, e in entries.items() for m in e["fns"]}
    n = max(1, iters // rounds)
    for _ in range(rounds):
        for name, e in entries.items():
            for metric, fn in e["fns"].items():
                sync()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                best[name, metric] = min(best[name, metric], (time.perf_counter() - t0) / n)
                if metric == "replay hook":
                    e["fns"]["call, no KV write"]()  # the step's table refresh, after a hook (once a step)
    sync()
    print(f"\n## host time per call (us), one layer; {rounds} round-robin turns of {n} calls, the fastest turn")
    print("| configuration | call, no KV write | call + KV write | replay hook | ran | bucket |")
    print("|---|---|---|---|---|---|")
    for name, e in entries.items():
        us = [f"{1e6 * best[name, m]:.1f}" if (name, m) in best else "-"
              for m in ("call, no KV write", "call + KV write", "replay hook")]
        print(f"| {name} | {' | '.join(us)} | {e['ran']} | {e.get('bucket', '-')} |")


# ---- --parts profile: cProfile of the host path ----------------------------------------------------
def profile(name, fn, iters):
    """cProfile of ``iters`` calls of ``fn`` (after one), the 18 largest by own time."""
    fn()
    sync()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(iters):
        fn()
    pr.disable()
    sync()
    print(f"\n######## {name} ({iters} calls)")
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)


def bench_profile(iters: int = 300, config: str = "1b"):
    """cProfile of the host path: replay hook, eager plan, one layer call; page 1 and 16."""
    cfg = dataclasses.replace(lt.CONFIGS[config], n_layers=1, dtype="bfloat16")  # 1b: bf16 already
    for page in (1, 16):
        runner, backend, fb, layer, q, k = one_layer(cfg, page)
        static = StaticBatch(runner, backend, 1, 256)
        profile(f"replay hook, page {page}", static.replay, iters)
        profile(f"eager plan, page {page}", lambda: backend.init_forward_metadata(static.fb), iters)
        static.replay()
        profile(f"layer call, page {page}", lambda: backend.forward(q, k, k, layer, static.fb), iters)
    profile_tree(cfg, iters)


def profile_tree(cfg, iters: int, draft: int = 8, topk: int = 4, page: int = 16):
    """cProfile of a tree (topk > 1) verify bucket's replay hook and of one layer call (no KV write) on it: batch 16,
    ctx 4096 (``--parts verify``'s; on the CPU batch 4, ctx 256). On CUDA the layer is captured in a graph first, so
    the hook is the planner-free one (the title says which ran); on the CPU it runs the planner."""
    batch, ctx = (16, 4096) if DEVICE == "cuda" else (4, 256)
    runner = make_runner(cfg, batch, ctx + draft, page, 1)
    name_heads(runner, cfg)  # the capture hook then knows the layers' tables, and the graph recomputes them
    backend = FlashAttentionBackend(runner, topk=topk)
    vb = VerifyBatch(runner, backend, batch, ctx, draft, topk)
    layer = RadixAttention(cfg.n_heads, cfg.head_dim, cfg.head_dim**-0.5, cfg.n_kv_heads, 0)
    q = torch.randn(batch * draft, cfg.n_heads * cfg.head_dim, dtype=torch.bfloat16, device=DEVICE)
    def call():
        return backend.forward(q, None, None, layer, vb.fb, save_kv_cache=False)

    graph = None  # on CUDA a capture (SGLang's order: capture hook, warm-up, capture, then replays) records the
    if DEVICE == "cuda":  # bucket's in-graph tables: the hook then runs no planner
        graph = graph_step(call, vb.replay)
    vb.replay()
    call()
    r = backend.planner.recorded(ForwardMode.TARGET_VERIFY, batch)
    hook = "planner-free" if r is not None and not r.planner_too else "with the planner"
    profile(f"tree verify replay hook (topk {topk}, {hook}), page {page}", vb.replay, iters)
    profile(f"tree verify layer call, no KV write (topk {topk}), page {page}", call, iters)
    del graph  # kept alive while the hook whose tables it recomputes was profiled


# ---- --parts launcher: the torch launcher of compiled Mosaic kernels --------------------------------
def host_us(fn, iters: int) -> float:
    """Host microseconds per call (no synchronisation inside the loop)."""
    return host(fn, iters) * 1e6


def wall_us(fn, iters: int) -> float:
    """Microseconds per call, back to back, synchronised at the ends only."""
    return wall(fn, iters) * 1e6


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
    from tests.kv_write_kernel import write_kv
    from torch_bridge.launcher import compile_for_torch

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

    from tests.kv_write_kernel import write_kv

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
    from tests.kv_write_kernel import write_kv

    jargs = [jnp.asarray(a.float().cpu().numpy(), jnp.bfloat16) if a.is_floating_point()
             else jnp.asarray(a.cpu().numpy()) for a in args]
    step = jax.jit(write_kv, donate_argnums=(3, 4))
    state = {"pools": tuple(jargs[3:])}

    def call():
        state["pools"] = step(*jargs[:3], *state["pools"])

    def wait():
        jax.block_until_ready(state["pools"])
    return ("jax.jit (pools donated)", host(call, iters, wait) * 1e6, wall(call, iters, 0, wait) * 1e6, "ok")


def graph_rows(tokens, slots, heads, dim, layers: int, iters: int):
    """A CUDA graph of one bound launch per layer: host and GPU time per replay."""
    from tests.kv_write_kernel import write_kv
    from torch_bridge.launcher import compile_for_torch

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


def bench_kv_launcher(tokens: int = 64, slots: int = 4096, heads: int = 8, head_dim: int = 128, layers: int = 32,
                   iters: int = 2000):
    """The launcher's KV-write rows and the graph of launches: one markdown table."""
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


def main(batch=64, ctx=4096, layers=32, page_size=16, iters=10, host_iters=2000, parts="host,decode",
         profile_iters=300, tokens=64, slots=4096, heads=8, head_dim=128, verify_batch=16, smoke=False):
    global DEVICE
    config = "1b"
    if smoke:
        DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
        config, parts, batch, ctx, layers, iters, host_iters, profile_iters, verify_batch = (
            "tiny", "profile,launcher,host,decode,kernels,verify,hostgrid", 2, 64, 2, 2, 20, 3, 2)
    else:
        assert torch.cuda.is_available(), "bench_bridge needs a CUDA GPU (or --smoke)"
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (smoke run: numbers meaningless)"
    print(f"device: {name}  jax {jax.__version__}  torch {torch.__version__}")
    cfg = dataclasses.replace(lt.CONFIGS[config], n_layers=layers, dtype="bfloat16")  # 1b: bf16 already
    todo = [p for p in parts.split(",") if p]
    if "profile" in todo:
        bench_profile(profile_iters, config)
    if "launcher" in todo:
        if DEVICE == "cuda":
            bench_kv_launcher(tokens, slots, heads, head_dim, layers, host_iters)
        else:
            print("smoke: launcher part skipped on the CPU (a Mosaic GPU kernel launched on a CUDA stream)")
    if "host" in todo:
        bench_host(cfg, host_iters)
    if "decode" in todo:
        bench_decode(cfg, batch, ctx, page_size, iters)
    if "kernels" in todo:
        if DEVICE == "cuda":
            bench_kernels(cfg, batch, ctx, page_size, iters)
        else:
            print("smoke: kernels part skipped on the CPU (a CUDA profile)")
    if "verify" in todo:
        bench_verify(cfg, verify_batch, ctx, page_size, iters, host_iters)
    if "hostgrid" in todo:
        bench_host_grid(cfg, host_iters, smoke)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="host,decode",
                    help="comma-separated: host, decode, kernels, verify, hostgrid, profile, launcher")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=32, help="decode: model layers; launcher: launches in the graph")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--host-iters", type=int, default=2000, help="host and launcher: calls per timing")
    ap.add_argument("--profile-iters", type=int, default=300, help="profile: calls per cProfile run")
    ap.add_argument("--tokens", type=int, default=64, help="launcher: tokens written")
    ap.add_argument("--slots", type=int, default=4096, help="launcher: pool slots")
    ap.add_argument("--heads", type=int, default=8, help="launcher: kv heads")
    ap.add_argument("--head-dim", type=int, default=128, help="launcher: head dim")
    ap.add_argument("--verify-batch", type=int, default=16, help="verify: requests (8 draft tokens each)")
    ap.add_argument("--smoke", action="store_true", help="every part at toy sizes on the CPU (or GPU)")
    sys.exit(main(**vars(ap.parse_args())))
