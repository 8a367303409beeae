"""Compile and warm-up time (issue 21), cold and warm, each in a fresh process.

    python benchmarks/bench_compile.py            # GPU: 1B model (16 layers), bridge with 32 layers
    python benchmarks/bench_compile.py --smoke    # CPU or GPU: tiny config, 3 buckets, end to end

Two parts, each run twice in a fresh subprocess: cold (an empty, new persistent compile cache
directory) and warm (the same directory again):

* jax: ``examples/decode_llama.py``'s setup (1B config, 16 layers, default layout, page 16,
  ``impl=auto``): the prefill (EXTEND, eager, compile included) as the example runs it, then
  ``StepRunner.capture`` of decode buckets 1, 8 and 64, one at a time.
* bridge: ``torch_bridge`` driven like SGLang's graph runner for a 32-layer model with 1B-class layers
  (``examples/llama_torch.py``): ``init_cuda_graph_state``, then per bucket of SGLang's default capture
  list (1, 2, 4, 8, 12, 16..256 step 8: 36 sizes), largest first: the capture hook, two warm-up
  forwards of every layer, and ``torch.cuda.graph`` capture (GPU only) in thread-local mode, as SGLang
  captures with ``torch_bridge.sglang_plugin`` (``--capture-error-mode global``: torch's default).

Every figure is wall time in its process. Targets (H100): decode bucket capture <= 10 s cold and
<= 2 s warm; prefill compile <= 10 s cold; bridge 36 buckets <= 60 s cold and <= 15 s warm. Also
printed: each capture's tracing+lowering / compile split, one Mosaic decode kernel built and compiled
alone (its Python build, or the disk cache; then XLA plus the kernel's GPU code, which jaxlib compiles
in every process), per process the kernel builds, kernel disk-cache hits and XLA cache hits, and for
the bridge the garbage collections that started inside a capture (its loop runs inside SGLang's
``freeze_gc``, as the engine's does).

A third part, ``--parts prefill`` (not in the default), compiles the example's prefill alone, cold, in a
fresh process per (prompt tokens, XLA options): ``StepRunner.eager``'s default options (on a GPU, cuBLAS
GEMMs) against ``eager_compiler_options={}`` (autotuned Triton GEMMs, as captured buckets compile), at
the example's 91 ragged tokens and at 8 prompts of 128 and of 512 tokens. Per process: trace, lower and
compile times and the compiled prefill's median time over 20 runs.

Options: ``--parts jax`` / ``--parts bridge`` / ``--parts prefill``; ``--phases cold`` then
``--phases warm`` with the same ``--cache-root DIR`` splits a run into separate commands;
``--bridge-max-bs 64`` captures SGLang's sizes up to 64 only; ``--jax-layout scan`` compares a weight
layout. ``OUT=dir`` also writes ``bench_compile.json`` there.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SGLANG_CAPTURE_BS = (1, 2, 4, 8, 12) + tuple(range(16, 257, 8))  # 36 sizes (max batch size 256)
JAX_BUCKETS = (1, 8, 64)
PREFILL_TOKENS = (0, 128, 512)  # per prompt, 8 prompts (0: the example's 5..24 tokens each)
PREFILL_OPTIONS = {"eager": "StepRunner.eager's (GPU: cuBLAS GEMMs)", "autotuned": "{} (autotuned GEMMs)"}
TARGETS = {"decode": (10.0, 2.0), "prefill": (10.0, None), "bridge": (60.0, 15.0)}
RESULT = "BENCH_COMPILE_RESULT "


# ---- child processes: one part, one cache directory ------------------------------------------------
def _cache_counters():
    """Counters of JAX persistent-cache hits, read back by ``_cache_summary``."""
    import jax

    hits = {"xla": 0}
    jax.monitoring.register_event_listener(
        lambda event, **kw: hits.__setitem__("xla", hits["xla"] + 1)
        if event == "/jax/compilation_cache/cache_hits" else None)
    return hits


def _cache_summary(hits) -> dict:
    from jax_attn.kernels import kernel_cache

    kernels = {}
    for (event, _), n in kernel_cache.stats().items():
        kernels[event] = kernels.get(event, 0) + n
    return dict(xla_cache_hits=hits["xla"], kernel_builds=kernels.get("build", 0),
                kernel_disk_hits=kernels.get("disk", 0))


def mosaic_kernel_alone(num_tokens: int = 4):
    """Seconds to build (Python lowering, or the disk cache) and to compile (XLA plus the kernel's GPU
    code) one decode kernel of 1B shapes that nothing else uses, alone; None off Hopper."""
    import jax
    import jax.numpy as jnp

    from jax_attn.kernel_policy import on_hopper
    from jax_attn.kernels.mosaic_kernel import kernel_call
    from jax_attn.kernels.mosaic_paged import kernel_statics

    if not on_hopper():
        return None
    st = kernel_statics(num_tokens=num_tokens, num_q_heads=32, num_kv_heads=8, head_dim=128, head_dim_v=128,
                        page_size=16, pack=4, dtype=jnp.bfloat16, max_q_len=1)
    s = jax.ShapeDtypeStruct
    cache = s((257, 16, 8, 128), jnp.bfloat16)
    args = (s((num_tokens, 8, 4, 128), jnp.bfloat16), cache, cache, s((num_tokens, 64), jnp.int32),
            s((num_tokens + 1,), jnp.int32), s((num_tokens, 8), jnp.int32), s((8,), jnp.float32))
    t0 = time.perf_counter()
    lowered = jax.jit(kernel_call(st, num_tokens)).trace(*args).lower()
    t1 = time.perf_counter()
    lowered.compile()
    return dict(build_s=t1 - t0, compile_s=time.perf_counter() - t1)


def _example_model(smoke: bool, layout: str, max_bs: int, **runner_kw):
    """The example's model, request table, backend and step runner (``child_jax`` / ``child_prefill``)."""
    import jax

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import decode_llama as dl
    import llama

    from jax_attn.backend import FlashAttentionBackend
    from jax_attn.capture import StepRunner

    config, page = ("tiny", 4) if smoke else ("1b", 16)
    cfg = llama.CONFIGS[config]
    layout = layout or dl.DEFAULT_LAYOUT
    max_ctx = 64 if smoke else 1024
    reqs = dl.PagedRequests(max_bs, max_ctx, page, 0)
    backend = FlashAttentionBackend(reqs.req_to_token, page_size=page, max_context_len=max_ctx, impl="auto",
                                    num_heads=(cfg.n_heads, cfg.n_kv_heads))
    params = llama.with_layout(llama.init_params(cfg, 0), layout)
    pools = llama.layout_pools(cfg, layout, reqs.num_slots)
    runner = StepRunner(backend, dl.make_step(cfg, backend, layout), batch_buckets=dl.BATCH_BUCKETS,
                        donate_argnums=(1,), **runner_kw)
    jax.block_until_ready((params, pools))
    return dict(dl=dl, cfg=cfg, config=config, page=page, layout=layout, reqs=reqs, backend=backend,
                params=params, pools=pools, runner=runner)


def example_prompts(cfg, tokens: int, smoke: bool):
    """The example's 8 ragged prompts of 5..24 tokens (``tokens`` 0), or 8 prompts of ``tokens`` each."""
    import numpy as np

    rng = np.random.default_rng(0)
    lens = rng.integers(5, 25, 8) if tokens == 0 else [tokens] * 8
    return [rng.integers(0, cfg.vocab, n).astype(np.int32) for n in lens]


def child_prefill(smoke: bool, tokens: int, options: str) -> dict:
    """The example's prefill compiled alone, one stage at a time, then timed (``--parts prefill``)."""
    import jax
    import numpy as np

    from jax_attn import compile_cache
    from jax_attn.batch import ForwardBatch
    from jax_attn.metadata import ForwardMode

    compile_cache.enable()
    m = _example_model(smoke, "", 8, **({"eager_compiler_options": {}} if options == "autotuned" else {}))
    runner, reqs, backend = m["runner"], m["reqs"], m["backend"]
    prompts = example_prompts(m["cfg"], tokens, smoke)
    lens = np.array([len(p) for p in prompts], np.int32)
    rows = reqs.rows[:len(prompts)]
    fb = ForwardBatch(ForwardMode.EXTEND, rows, lens, reqs.slots(np.zeros_like(lens), lens), extend_seq_lens=lens)
    tok = dict(ids=np.concatenate(prompts), pos=np.concatenate([np.arange(n, dtype=np.int32) for n in lens]))
    t0 = time.perf_counter()
    key = backend.plan_static(fb)
    layout, packed, targs = runner.pack(fb, tok)
    traced = runner._eager_jit.trace(key, layout, backend.req_to_token, packed, targs, m["params"], m["pools"])
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    exe = lowered.compile()
    t3 = time.perf_counter()
    pools, runs = m["pools"], []
    for _ in range(21):
        ta = time.perf_counter()
        out, pools = exe(backend.req_to_token, packed, targs, m["params"], pools)
        jax.block_until_ready(out)
        runs.append(time.perf_counter() - ta)
    return dict(part="prefill", tokens=int(lens.sum()), options=options, trace_s=t1 - t0, lower_s=t2 - t1,
                compile_s=t3 - t2, step_ms=1e3 * sorted(runs[1:])[10], device=jax.devices()[0].device_kind)


def child_jax(smoke: bool, buckets, layout: str) -> dict:
    """Prefill compile and decode captures of the JAX example (its own helpers; its default layout unless
    ``--jax-layout``)."""
    import types

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_attn import compile_cache
    from jax_attn.batch import ForwardBatch
    from jax_attn.metadata import ForwardMode

    hits = _cache_counters()
    t_start = time.perf_counter()
    cache_dir = compile_cache.enable()
    max_bs, prompt = max(buckets), 24 if smoke else 512
    m = _example_model(smoke, layout, max(max_bs, 8))
    dl, cfg, config, page, layout = m["dl"], m["cfg"], m["config"], m["page"], m["layout"]
    reqs, params, pools, runner = m["reqs"], m["params"], m["pools"], m["runner"]
    setup_s = time.perf_counter() - t_start

    # The example's prefill: 8 ragged prompts of 5..24 tokens (its defaults) in the first rows of the table.
    prompts = example_prompts(cfg, 0, smoke)
    first_rows = types.SimpleNamespace(rows=reqs.rows[:len(prompts)], slots=reqs.slots)
    _, pools, prefill_s = dl.prefill(runner, first_rows, prompts, params, pools)

    decode = {}
    for bs in buckets:
        lens = np.full(bs, prompt, np.int32)
        fb = ForwardBatch(ForwardMode.DECODE, reqs.rows[:bs], lens + 1, reqs.slots(lens, np.ones_like(lens)))
        tokens = dict(ids=jnp.zeros(bs, jnp.int32), pos=jnp.asarray(lens))
        report = runner.capture([fb], tokens, params, pools, verbose=True)
        decode[bs] = dict(seconds=report.seconds, lower_s=report.lower_s, compile_s=report.compile_s)
    alone = None if smoke else mosaic_kernel_alone()
    return dict(part="jax", config=config, layers=cfg.n_layers, layout=layout, page_size=page, kernel_alone=alone,
                device=jax.devices()[0].device_kind, cache_dir=cache_dir, setup_s=setup_s,
                prefill_s=prefill_s, prefill_tokens=int(sum(map(len, prompts))), decode=decode, **_cache_summary(hits))


@contextlib.contextmanager
def sglang_freeze_gc():
    """SGLang 0.5.11's ``cuda_graph_runner.freeze_gc`` with ``enable_cudagraph_gc`` off (its default): one
    collection, then ``gc.freeze()`` for the whole capture loop, so the collections during the loop (the
    bridge's capture hook runs one) skip every object older than the loop; unfreeze and collect after."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.collect()


def child_bridge(smoke: bool, buckets, layers: int, ctx: int, capture_error_mode: str = "thread_local") -> dict:
    """SGLang's graph runner over the bridge: the capture hook, two warm-ups, graph capture; largest first."""
    import dataclasses

    import torch

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import decode_torch as dt
    import llama_torch as lt

    import jax
    from jax_attn import compile_cache
    from jax_attn.progress import Progress
    from torch_bridge import FlashAttentionBackend, ForwardBatch, ForwardMode

    hits = _cache_counters()
    t_start = time.perf_counter()
    cache_dir = compile_cache.enable()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config, page = ("tiny", 4) if smoke else ("1b", 16)
    cfg = dataclasses.replace(lt.CONFIGS[config], n_layers=layers)
    model = lt.TorchLlama(cfg, 0, device)
    max_bs = max(buckets)
    runner = dt.make_runner(cfg, max_bs, ctx, page, "auto", 0, device)
    backend = FlashAttentionBackend(runner)
    dt.sync(device)
    setup_s = time.perf_counter() - t_start

    t0 = time.perf_counter()
    backend.init_cuda_graph_state(max_bs, max_bs)
    fill = backend.get_cuda_graph_seq_len_fill_value()
    z = torch.zeros(max_bs, dtype=torch.long, device=device)  # SGLang's static buffers (int64)
    req_pool_indices, out_cache_loc, positions, input_ids = (z.clone() for _ in range(4))
    seq_lens = z + fill
    graphs, per_bucket = {}, {}
    use_graphs = device.type == "cuda" and dt.launches(backend, cfg, page)
    progress = Progress(len(buckets), "bridge capture")
    in_capture = collections.Counter()  # collections that started inside a capture, by generation

    def note_collection(phase, info):
        if phase == "start" and device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            in_capture[info["generation"]] += 1
    gc.callbacks.append(note_collection)
    with sglang_freeze_gc():  # as SGLang 0.5.11 wraps its capture loop (cuda_graph_runner.freeze_gc)
        for bs in sorted(buckets, reverse=True):
            tb = time.perf_counter()
            backend.init_forward_metadata_capture_cuda_graph(bs, bs, req_pool_indices[:bs], seq_lens[:bs], None,
                                                             ForwardMode.DECODE, None)
            fb = ForwardBatch(ForwardMode.DECODE, bs, req_pool_indices[:bs], seq_lens[:bs], out_cache_loc[:bs],
                              positions=positions[:bs], token_to_kv_pool=runner.token_to_kv_pool, attn_backend=backend)
            for _ in range(2):  # SGLang's warm-up runs before the capture
                model.forward(input_ids[:bs], positions[:bs], lt.bridge_attend(model, fb))
            dt.sync(device)
            if use_graphs:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, capture_error_mode=capture_error_mode):
                    model.forward(input_ids[:bs], positions[:bs], lt.bridge_attend(model, fb))
                graphs[bs] = g
            dt.sync(device)
            per_bucket[bs] = time.perf_counter() - tb
            progress.step(f"bs={bs}", f"{per_bucket[bs]:.1f}s")
    total = time.perf_counter() - t0
    gc.callbacks.remove(note_collection)
    progress.finish()
    return dict(part="bridge", gc_in_capture={f"gen{g}": n for g, n in sorted(in_capture.items())},
                config=config, layers=layers, page_size=page, ctx=ctx, cuda_graphs=use_graphs,
                device=str(torch.cuda.get_device_name() if device.type == "cuda" else jax.devices()[0].device_kind),
                cache_dir=cache_dir, setup_s=setup_s, buckets=len(buckets), total_s=total,
                per_bucket=per_bucket, **_cache_summary(hits))


# ---- parent: cold and warm subprocesses, one table ---------------------------------------------
def run_child(part: str, cache_root: str, args, extra=()) -> dict:
    env = dict(os.environ, JAX_ATTN_COMPILE_CACHE_DIR=cache_root, PYTHONPATH=ROOT + os.pathsep
               + os.environ.get("PYTHONPATH", ""), XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env.pop("JAX_ATTN_COMPILE_CACHE", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", part] + (["--smoke"] if args.smoke else []) + [
        "--bridge-layers", str(args.bridge_layers), "--bridge-ctx", str(args.bridge_ctx),
        "--bridge-max-bs", str(args.bridge_max_bs), "--capture-error-mode", args.capture_error_mode] + (
        ["--jax-layout", args.jax_layout] if args.jax_layout else []) + list(extra)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{part} child failed (exit {out.returncode}); its stderr is above")
    line = [ln for ln in out.stdout.splitlines() if ln.startswith(RESULT)][-1]
    return dict(json.loads(line[len(RESULT):]), process_s=time.perf_counter() - t0)


def _target(kind: str) -> str:
    cold, warm = TARGETS[kind]
    return f"<= {cold:g} / " + ("-" if warm is None else f"<= {warm:g}")


def _row(name: str, phases: dict, value, target: str = "") -> tuple:
    """One table row: ``value(result)`` per phase (a number: seconds; "-" where the phase did not run)."""
    cells = []
    for phase in ("cold", "warm"):
        v = value(phases[phase]) if phase in phases else None
        cells.append("-" if v is None else (f"{v:.1f}" if isinstance(v, (int, float)) else str(v)))
    return (name, *cells, target)


def _counts(r: dict) -> str:
    return f"{r['kernel_builds']}/{r['kernel_disk_hits']}/{r['xla_cache_hits']}"


def report(results: dict) -> str:
    rows = [("figure", "cold s", "warm s", "target cold / warm")]
    jx = results.get("jax")
    if jx:
        c = next(iter(jx.values()))
        what = f"{c['layers']} layers, layout {c['layout']}, page {c['page_size']}"
        rows.append(_row(f"prefill compile+run, {c['prefill_tokens']} tokens ({what})", jx,
                         lambda r: r["prefill_s"], _target("prefill")))
        for bs in c["decode"]:
            rows.append(_row(f"decode capture bs={bs} ({what})", jx, lambda r: r["decode"][bs]["seconds"],
                             _target("decode")))
            rows.append(_row("  of which trace+lower / compile", jx,
                             lambda r: f"{r['decode'][bs]['lower_s']:.1f}/{r['decode'][bs]['compile_s']:.1f}"))
        if c.get("kernel_alone"):
            rows.append(_row("one Mosaic decode kernel alone: build / compile (GPU code)", jx,
                             lambda r: f"{r['kernel_alone']['build_s']:.1f}/{r['kernel_alone']['compile_s']:.1f}"))
        rows.append(_row("jax process: setup (weights, pools)", jx, lambda r: r["setup_s"]))
        rows.append(_row("jax process: kernel builds / disk hits / XLA cache hits", jx, _counts))
    br = results.get("bridge")
    if br:
        c = next(iter(br.values()))
        rows.append(_row(f"bridge: {c['buckets']} buckets, {c['layers']} layers, page {c['page_size']}"
                         f"{', CUDA graphs' if c['cuda_graphs'] else ', no graphs'}", br, lambda r: r["total_s"],
                         _target("bridge")))
        rows.append(_row("  first (largest) bucket", br, lambda r: r["per_bucket"][max(r["per_bucket"], key=int)]))
        rows.append(_row("  slowest bucket", br, lambda r: max(r["per_bucket"].values())))
        rows.append(_row("bridge process: kernel builds / disk hits / XLA cache hits", br, _counts))
        rows.append(_row("  garbage collections started inside a capture", br,
                         lambda r: " ".join(f"{g}:{n}" for g, n in r["gc_in_capture"].items()) or "0"))
    text = ""
    if jx or br:
        device = next(iter((jx or br).values()))["device"]
        text = (f"compile and warm-up times on {device} (cold: empty cache; warm: same cache, new process)\n"
                + _table(rows))
    pf = results.get("prefill")
    if pf:
        prows = [("prompt tokens", "XLA options", "trace / lower / compile s", "step ms")]
        prows += [(str(r["tokens"]), PREFILL_OPTIONS[r["options"]],
                   f"{r['trace_s']:.2f} / {r['lower_s']:.2f} / {r['compile_s']:.2f}", f"{r['step_ms']:.2f}")
                  for r in pf.values()]
        device = next(iter(pf.values()))["device"]
        head = f"cold prefill compile, one fresh process each, on {device}\n"
        text += ("\n\n" if text else "") + head + _table(prows)
    return text


def _table(rows) -> str:
    width = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(width[i]) for i, cell in enumerate(r)).rstrip() for r in rows]
    return "\n".join(lines[:1] + ["-" * len(lines[0])] + lines[1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny config, 3 buckets (runs on a CPU)")
    ap.add_argument("--parts", default="jax,bridge", help="comma-separated: jax, bridge, prefill")
    ap.add_argument("--jax-layout", default=None, help="weight layout of the JAX part (default: the example's)")
    ap.add_argument("--bridge-layers", type=int, default=32)
    ap.add_argument("--bridge-ctx", type=int, default=512,
                    help="request table width (tokens) of the bridge run; its KV pool holds max batch x this")
    ap.add_argument("--bridge-max-bs", type=int, default=256, help="capture only SGLang's sizes up to this")
    ap.add_argument("--phases", default="cold,warm", help="comma-separated: cold, warm (see --cache-root)")
    ap.add_argument("--cache-root", help="keep each part's cache in ROOT/<part> (cold empties it first; warm "
                    "reuses it, so cold and warm can run as separate commands); default: temporary directories")
    ap.add_argument("--keep-cache", action="store_true", help="keep the temporary cache directories")
    ap.add_argument("--capture-error-mode", default="thread_local", choices=["global", "thread_local", "relaxed"],
                    help="torch.cuda.graph's mode for the bridge captures: SGLang with torch_bridge.sglang_plugin "
                         "captures in thread_local; global (torch's default) shows the failures that caused that")
    ap.add_argument("--child", choices=["jax", "bridge", "prefill"], help=argparse.SUPPRESS)
    ap.add_argument("--prefill-tokens", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--prefill-options", choices=sorted(PREFILL_OPTIONS), default="eager", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child == "prefill":
        print(RESULT + json.dumps(child_prefill(args.smoke, args.prefill_tokens, args.prefill_options)), flush=True)
        return 0
    if args.child:
        bridge_bs = tuple(bs for bs in SGLANG_CAPTURE_BS if bs <= args.bridge_max_bs)
        buckets = (1, 2, 4) if args.smoke else (JAX_BUCKETS if args.child == "jax" else bridge_bs)
        if args.child == "jax":
            res = child_jax(args.smoke, buckets, args.jax_layout)
        else:
            res = child_bridge(args.smoke, buckets, 2 if args.smoke else args.bridge_layers,
                               32 if args.smoke else args.bridge_ctx, args.capture_error_mode)
        print(RESULT + json.dumps(res), flush=True)
        return 0
    results, phases = {}, args.phases.split(",")
    for part in args.parts.split(","):
        if part == "prefill":  # cold only: a fresh cache per process
            results[part] = {}
            for tokens in ((16,) if args.smoke else PREFILL_TOKENS):
                for options in PREFILL_OPTIONS:
                    with tempfile.TemporaryDirectory(prefix="jax_attn_bench_compile_prefill_") as root:
                        extra = ["--prefill-tokens", str(tokens), "--prefill-options", options]
                        results[part][f"{tokens}/{options}"] = run_child(part, root, args, extra)
            continue
        if args.cache_root:
            root = os.path.join(os.path.abspath(args.cache_root), part)
            if "cold" in phases:
                shutil.rmtree(root, ignore_errors=True)
        else:
            root = tempfile.mkdtemp(prefix=f"jax_attn_bench_compile_{part}_")
        results[part] = {phase: run_child(part, root, args) for phase in phases}
        kept = args.keep_cache or args.cache_root
        print(f"{part}: cache in {root}" + ("" if kept else " (removed)"), file=sys.stderr)
        if not kept:
            shutil.rmtree(root, ignore_errors=True)
    print(report(results))
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "bench_compile.json"), "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
