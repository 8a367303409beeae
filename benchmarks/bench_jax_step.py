"""A decode step of the example Llama-style model through the JAX backend (``examples/llama.py``), run
as one captured executable per step: its host overhead, its GPU timeline, and its replay's parts.

Variants: ``LAYOUT[-OPTION...]``, LAYOUT one of ``llama.LAYOUTS`` (how weights and KV pools are passed);
options choose the call path (default ``StepRunner.replay`` of the AOT executable) or compiler options:
  jit      the same step through ``jax.jit``'s C++ dispatch instead of the AOT executable
  staged   step inputs first copied into persistent device buffers (stable input addresses, so a
           command buffer needs no update for them)
  nocb     ``StepRunner(command_buffers=False)``: no XLA command buffers (CUDA graphs); kernels are
           launched one by one and the GPU starts on the first while the host enqueues the rest
  dsf      XLA dynamic-slice fusion: slices feeding library GEMMs become address offsets
  static   ``StepRunner(static_buffers=True)``: inputs written into fixed device buffers and token
           outputs donated back into fixed buffers, so no command buffer needs an update
or a set: ``main``, ``alternatives``, ``all`` (``VARIANT_SETS``). Random KV contents (never zeros).

Modes (``--mode``):
host (default): host overhead per variant. Per variant:
  leaves      params + pools arguments of the step
  device      back-to-back executable calls on the same device-resident inputs (the kernels' floor)
  replay      replay from host numpy batch fields, blocking on the result every step
  host        time for the replay call to return (planning inputs, padding, dispatch)
  overhead    replay - device
  piped       wall time per step of replays issued without blocking, the next token ids taken on
              device from the previous step's logits, in steady state (timed from the end of a
              step while later ones are queued: the first step's start from an idle GPU is the
              blocking cost, ``overhead``)
  overlap     as ``piped``, but the host also reads every step's ids, one step late (after the next
              step is launched), as SGLang's overlap scheduler does
  call same / call fresh: host time of the bare executable call with the same device inputs /
              with new input buffers (same values) every call
  and, from the optimized HLO (``step_analysis.hlo_counts``): copy / slice / dynamic-slice
  instructions, fusions rooted in a slice, MB written per step by kernels that only copy or slice
  (total and the largest one: a copied KV pool or weight stack shows here), command buffers the HLO
  holds and kernels it launches outside them. jax 0.11.2's XLA forms its command buffers from the
  thunks, after the HLO, so there the HLO holds none and every kernel counts as outside.
timeline (GPU; CUPTI through torch.profiler): ``StepRunner.replay`` blocking on the result every step,
  each step's wall time split into host to first GPU work, GPU busy, GPU idle inside and tail; the
  largest idle gaps with the activities on either side; the host time of CUDA driver/runtime calls by
  name. ``--piped``: steps issued without blocking (as ``piped`` above), per step the GPU span, busy
  and idle time and the activities by kind, for the replays and for bare executable calls.
replay-parts: each part of ``StepRunner.replay`` alone, host time (one variant; every call path).
baseline (``--baseline dense-cudnn``; issue 38): our captured step (one variant, default ``fused``) against
  what JAX users run today, in one process: the same model (``llama.forward_layers``: same config, weights
  and layers) with dense attention over a contiguous ``[B, max_ctx, Hkv, D]`` cache per layer, the new k/v
  written at each request's position, ``jax.nn.dot_product_attention(implementation="cudnn")`` with its
  native GQA and per-request lengths (``dense_baseline.py``; off a GPU or for float32 models XLA's
  implementation, and the header says so). Both start from the same random weights and KV contents (the
  dense caches are gathered from our pools). Decode at each ``--batches`` x ``--ctxs`` (lengths near ctx,
  ragged by up to 6), prefill at each ``--prefills`` ``BxS`` (B prompts of S tokens from position 0;
  logits of every token in both). One table, times in ms per step:
  ours / dense          steady-state wall time per step of calls issued without blocking on the same
                        device inputs (our bare executable; the jitted dense step), median of 3 windows
  ours/dense tok/s      dense ms / ours ms (> 1: ours is faster); tok/s of each
  blocking              a step from host inputs blocked on every step, median (``StepRunner.replay``;
                        the jitted dense step), lengths advancing one per decode step
  logits rel err        max |dense - ours| / max |ours| of one more step's logits (model dtype)

    python benchmarks/bench_jax_step.py --config 1b --batch 64 --ctx 4096 --variant main
    python benchmarks/bench_jax_step.py --mode timeline --config 1b --batch 64 --ctx 4096 --variant fused [--piped]
    python benchmarks/bench_jax_step.py --mode replay-parts --config 1b --batch 64 --ctx 4096 --variant fused
    python benchmarks/bench_jax_step.py --baseline dense-cudnn --config 1b \
        --batches 1,8,64 --ctxs 512,4096 --prefills 8x512,1x4096
    JAX_PLATFORMS=cpu python benchmarks/bench_jax_step.py --smoke   # CPU: tiny model, baseline, replay-parts, host

Flags: ``--config`` (``llama.CONFIGS``), ``--batch``, ``--ctx``, ``--page-size``, ``--layers``, ``--impl``;
``--steps`` (host 30, timeline 20, baseline 20), ``--variant`` (host ``main``, timeline ``fused``, replay-parts
``list``, baseline ``fused``), ``--piped`` (timeline), ``--baseline``, ``--batches``, ``--ctxs``,
``--prefills`` (baseline, in place of ``--batch`` and ``--ctx``), ``--smoke``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
import warnings

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and torch share the GPU (timeline)
_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.join(os.path.dirname(_HERE), "examples"), _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import dense_baseline  # noqa: E402
import llama  # noqa: E402
from step_analysis import analyze, analyze_window, hlo_counts, print_report, print_window  # noqa: E402

from jax_attn.backend import FlashAttentionBackend  # noqa: E402
from jax_attn.batch import ForwardBatch, pad_batch  # noqa: E402
from jax_attn.capture import StepRunner, _pad_tokens, _write_into, own_buffers  # noqa: E402
from jax_attn.kv_cache import KVPool  # noqa: E402
from jax_attn.metadata import ForwardMode  # noqa: E402

CALL_OPTIONS = ("jit", "staged")
COMPILE_OPTIONS = {"nocb": {},  # StepRunner(command_buffers=False)
                   "dsf": {"xla_gpu_enable_dynamic_slice_fusion": True},
                   "static": {}}  # StepRunner(static_buffers=True): fixed input/output buffers
VARIANT_SETS = {
    "main": ("list", "list-staged", "fused", "fused-jit", "fused-staged", "fused-static", "fused-nocb",
             "fused-static-nocb", "fused-dsf"),
    "alternatives": ("list-nocb", "perlayer", "perlayer-nocb", "flat", "scan", "scan-dsf"),
}
VARIANT_SETS["all"] = VARIANT_SETS["main"] + VARIANT_SETS["alternatives"]


# ---- model, backend, captured step ----------------------------------------------------------
def random_pools(cfg, num_slots, seed, stacked=False):
    """Random K/V: one layer-stacked pool ``[L, num_slots, Hkv, D]``, or a list of per-layer pools."""
    key = jax.random.key(seed)
    dt = jnp.dtype(cfg.dtype)
    shape = (cfg.n_layers, num_slots, cfg.n_kv_heads, cfg.head_dim)
    pool = KVPool(jax.random.normal(key, shape, dt), jax.random.normal(jax.random.fold_in(key, 1), shape, dt))
    if stacked:
        return pool
    return [KVPool(pool.k[i], pool.v[i]) for i in range(cfg.n_layers)]


def runner_options(opts) -> dict:
    """``StepRunner`` keyword arguments for a variant's compile options (see ``COMPILE_OPTIONS``)."""
    xla = {k: v for o in opts for k, v in COMPILE_OPTIONS[o].items()}
    return dict(compiler_options=xla or None, static_buffers="static" in opts, command_buffers="nocb" not in opts)


def build(config, batch, max_ctx, page_size, layers, impl, layout="list", opts=(), token_buckets=()):
    """Model in ``layout`` with random weights and random pools, rows 1..batch of a request table with
    shuffled pages, the backend and a runner of the model's step (nothing captured yet)."""
    cfg = llama.CONFIGS[config]
    if layers:
        cfg = dataclasses.replace(cfg, n_layers=layers)
    pages_per = -(-max_ctx // page_size)
    table = np.zeros((batch + 1, pages_per * page_size), np.int32)
    perm = np.random.default_rng(0).permutation(np.arange(1, batch * pages_per + 1))
    for r in range(batch):
        pages = perm[r * pages_per:(r + 1) * pages_per]
        table[r + 1] = (pages[:, None] * page_size + np.arange(page_size)).reshape(-1)
    num_slots = (batch * pages_per + 1) * page_size
    backend = FlashAttentionBackend(table, page_size=page_size, max_context_len=max_ctx, impl=impl,
                                    num_heads=(cfg.n_heads, cfg.n_kv_heads))
    params = llama.with_layout(llama.init_params(cfg, 0), layout)
    pools = random_pools(cfg, num_slots, 1, stacked=layout != "list")

    def step(md, tok, params, pools):
        logits, pools = llama.forward_paged(cfg, backend, params, md, tok["ids"], tok["pos"], pools,
                                            scan=layout == "scan")
        return dict(logits=logits, next_ids=jnp.argmax(logits, -1).astype(jnp.int32)), pools

    runner = StepRunner(backend, step, batch_buckets=(batch,), token_buckets=token_buckets, donate_argnums=(1,),
                        **runner_options(opts))
    return dict(cfg=cfg, backend=backend, runner=runner, table=table, rows=np.arange(1, batch + 1, dtype=np.int32),
                params=params, pools=pools, batch=batch)


def decode_batch(table, rows, lens) -> ForwardBatch:  # lens i32[B]: lengths with the new token
    """One new token per request, at position ``lens - 1``."""
    return ForwardBatch(ForwardMode.DECODE, rows, lens, table[rows, lens - 1])


def setup(config, batch, ctx, page_size, steps, layers, impl, layout="list", opts=()):
    """``build`` with the decode bucket captured, at lengths near ``ctx``; batch/token factories of lengths."""
    env = build(config, batch, ctx + 2 * steps + 16, page_size, layers, impl, layout, opts)
    cfg, table, rows = env["cfg"], env["table"], env["rows"]
    lens = np.full(batch, ctx, np.int32) - np.arange(batch, dtype=np.int32) % 7

    def fb(lens):
        return decode_batch(table, rows, lens)

    def tok(lens):
        return dict(ids=np.asarray(lens % cfg.vocab, np.int32), pos=np.asarray(lens - 1, np.int32))

    env["runner"].capture([fb(lens)], tok(lens), env["params"], env["pools"])
    return dict(env, exe=next(iter(env["runner"].executables.values())), fb=fb, tok=tok, lens=lens)


def step_inputs(runner, padded, tokens):
    """``(packed host inputs, token arguments)`` of a padded batch, as ``StepRunner.replay`` packs them."""
    return runner.pack(padded, _pad_tokens(tokens, padded.num_tokens))[1:]


def device_args(env):
    """``(req_to_token, packed host inputs, token arguments)`` for the bare executable, in new device buffers."""
    lens = env["lens"]
    return (env["backend"].req_to_token, *jax.device_put(step_inputs(env["runner"], env["fb"](lens), env["tok"](lens))))


class StagedReplay:
    """Replay that first copies the step's inputs into persistent device buffers (stable addresses)."""

    def __init__(self, runner: StepRunner):
        self.runner, self.bufs = runner, None
        self._update = jax.jit(_write_into, donate_argnums=0)  # in place: the buffers keep their addresses

    def __call__(self, batch, token_inputs, *args):
        runner = self.runner
        padded = runner._padded(batch)
        exe = runner.executables[runner.backend.plan_static(padded)]
        new = step_inputs(runner, padded, token_inputs)
        self.bufs = own_buffers(new) if self.bufs is None else self._update(self.bufs, new)
        return exe(runner.backend.req_to_token, *self.bufs, *args)


def call_path(env, mode: str):
    """The function a decode loop calls per step: ``run(batch, tokens, params, pools)``."""
    if mode == "jit":
        return env["runner"].eager  # batch == bucket: the same padded step, through jax.jit
    if mode == "staged":
        return StagedReplay(env["runner"])
    return env["runner"].replay


# ---- measurements (each threads the donated pools through env["pools"]) ----------------------
def _median_us(ts):
    return statistics.median(ts) * 1e6


def bare_call(env):
    """``call(args, pools) -> (token outputs, pools)``: one bare executable call on ``device_args``
    (with ``static_buffers``, on the runner's fixed buffers, the donated outputs threaded through)."""
    exe, params = env["exe"], env["params"]
    bufs = next(iter(env["runner"].buffers.values()), None)

    def call(args, pools):
        if bufs is None:
            return exe(*args, params, pools)
        bufs[1], pools = exe(args[0], bufs[0], bufs[1], params, pools)
        return bufs[1], pools
    return call


class _SteadyClock:
    """The steady-state clock of ``time_calls`` / ``time_pipelined``: started at the end of step
    ``warm - 1``, observed once two later steps are queued (the GPU is busy when that step ends)."""

    def __init__(self, warm: int):
        self.warm, self.marker, self.t0 = warm, None, None

    def after_issue(self, i: int, ids) -> None:
        """Call after issuing step ``i`` whose sampled ids are ``ids``."""
        if i == self.warm - 1:
            self.marker = jnp.copy(ids)  # static_buffers reuse the output buffers on the next call
        elif i == self.warm + 1:
            jax.block_until_ready(self.marker)
            self.t0 = time.perf_counter()

    def per_step_us(self, steps: int) -> float:
        return (time.perf_counter() - self.t0) / steps * 1e6


def time_calls(env, steps: int, fresh: bool, warm: int = 4):
    """Bare executable calls: (wall us per call in steady state, timed as ``time_pipelined`` does;
    median host us per call). ``fresh``: new input buffers."""
    pools, call = env["pools"], bare_call(env)
    same = device_args(env)
    arg_sets = [device_args(env) if fresh else same for _ in range(warm + steps)]
    jax.block_until_ready(arg_sets)
    host, clock = [], _SteadyClock(warm)
    for i, args in enumerate(arg_sets):
        t1 = time.perf_counter()
        out, pools = call(args, pools)
        host.append(time.perf_counter() - t1)
        clock.after_issue(i, out["next_ids"])
    jax.block_until_ready(pools)
    env["pools"] = pools
    return clock.per_step_us(steps), _median_us(host[warm:])


def time_replay(env, run, steps: int):
    """Replay from host batch fields, blocking each step: (median replay us, median host us)."""
    fb, tok, lens, params, pools = env["fb"], env["tok"], env["lens"], env["params"], env["pools"]
    replay, host = [], []
    for i in range(steps + 3):
        cur = lens + i
        t0 = time.perf_counter()
        out, pools = run(fb(cur), tok(cur), params, pools)
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        if i >= 3:
            host.append(t1 - t0)
            replay.append(time.perf_counter() - t0)
    env["pools"] = pools
    return _median_us(replay), _median_us(host)


def time_pipelined(env, run, steps: int, read_ids: bool = False, warm: int = 4) -> float:
    """Wall us per step of replays issued without blocking, in steady state; token ids stay on device.

    The clock runs from the end of step ``warm - 1`` to the end of step ``warm + steps - 1``, read
    while later steps are already queued, so it counts ``steps`` steps of a running pipeline and not
    the first step's path from an idle GPU (a blocking step's cost, which ``time_replay`` reports).
    If the host cannot keep up, the GPU waits for it inside the window and the time shows it.

    ``read_ids``: the host also reads every step's sampled ids, one step late: step i+1 is launched
    (its ids taken on device) before the host waits for step i's ids, as SGLang's overlap scheduler
    runs. The host then sees every token, one step behind the GPU.
    """
    fb, lens, params, pools = env["fb"], env["lens"], env["params"], env["pools"]
    ids = jnp.asarray(env["tok"](lens)["ids"])
    pending, clock = None, _SteadyClock(warm)
    for i in range(warm + steps):
        cur = lens + i
        out, pools = run(fb(cur), dict(ids=ids, pos=np.asarray(cur - 1, np.int32)), params, pools)
        ids = out["next_ids"]
        if read_ids:
            if pending is not None:
                np.asarray(pending)  # blocks on step i - 1 only
                if i == warm:  # the end of step warm - 1, read with step warm queued
                    clock.t0 = time.perf_counter()
            pending = jnp.copy(ids)  # static_buffers reuse ``out``'s buffers on the next replay
        else:
            clock.after_issue(i, ids)
    jax.block_until_ready(ids) if pending is None else np.asarray(pending)
    env["pools"] = pools
    return clock.per_step_us(steps)


def argument_probe(n: int, iters: int = 50) -> float:
    """Median host us of an AOT call of a one-kernel function with ``n`` small arguments."""
    xs = [jnp.full((8,), i, jnp.float32) for i in range(n)]
    exe = jax.jit(lambda *a: a[0] + 1, keep_unused=True).lower(*xs).compile()
    host = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = exe(*xs)
        host.append(time.perf_counter() - t0)
    jax.block_until_ready(out)
    return _median_us(host)


# ---- driver ---------------------------------------------------------------------------------
def parse_variants(spec: str):
    """``"main"`` / ``"list,fused-jit,..."`` -> {(layout, compile options): [(name, call option)]}."""
    groups = {}
    for name in VARIANT_SETS.get(spec, tuple(n for n in spec.split(",") if n)):
        layout, *opts = name.split("-")
        bad = [o for o in opts if o not in CALL_OPTIONS and o not in COMPILE_OPTIONS]
        calls = [o for o in opts if o in CALL_OPTIONS]
        if layout not in llama.LAYOUTS or bad or len(calls) > 1:
            raise ValueError(f"variant {name!r} must be LAYOUT[-OPTION...] with LAYOUT in {llama.LAYOUTS}, at most "
                             f"one of {CALL_OPTIONS} and any of {sorted(COMPILE_OPTIONS)}; or a set: "
                             f"{sorted(VARIANT_SETS)}")
        key = (layout, tuple(sorted(o for o in opts if o in COMPILE_OPTIONS)))
        groups.setdefault(key, []).append((name, calls[0] if calls else "aot"))
    return groups


def measure_group(env, group: str, variants, steps: int):
    """Timing rows for each ``(name, call option)`` of one compiled step, and its HLO counts."""
    hlo = hlo_counts(env["exe"].as_text())
    device, call_same = time_calls(env, steps, fresh=False)
    _, call_fresh = time_calls(env, steps, fresh=True)
    leaves = len(jax.tree.leaves((env["params"], env["pools"])))
    rows = []
    for name, call in variants:
        run = call_path(env, call)
        replay, host = time_replay(env, run, steps)
        piped = time_pipelined(env, run, steps)
        overlap = time_pipelined(env, run, steps, read_ids=True)
        rows.append((name, leaves, device, replay, host, replay - device, piped, piped - device, overlap - device))
    return rows, (group, leaves, call_same, call_fresh, hlo)


def print_tables(timing, calls, probe):
    print("| variant | leaves | device | replay | host | overhead | piped | piped - device | overlap - device |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, leaves, *us in timing:
        print(f"| {name} | {leaves} | " + " | ".join(f"{u:.0f}" for u in us) + " |")
    print("\n| variant | call same | call fresh | copy | slice | dyn-slice | slice fusions | MB moved "
          "| largest MB | graphs | loose kernels |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, _, same, fresh, h in calls:
        print(f"| {name} | {same:.0f} | {fresh:.0f} | {h['copy']} | {h['slice']} | {h['dynamic_slice']} | "
              f"{h['slice_fusions']} | {h['moved_mb']:.1f} | {h['largest_mb']:.1f} | {h['graphs']} | {h['loose']} |")
    if probe:
        print("\nbare AOT call of a one-kernel function, host us: " +
              ", ".join(f"{n} args {us:.0f}" for n, us in probe))


def main_host(config="1b", batch=64, ctx=4096, page_size=16, steps=30, layers=None, impl="auto", variant="main"):
    """Host overhead per variant: two markdown tables (timing; bare calls and HLO counts)."""
    groups = parse_variants(variant)
    timing, calls = [], []
    for (layout, opts), variants in groups.items():
        env = setup(config, batch, ctx, page_size, steps, layers, impl, layout, opts)
        if not timing:
            cfg = env["cfg"]
            print(f"device={jax.devices()[0].device_kind} config={config} layers={cfg.n_layers} batch={batch} "
                  f"ctx={ctx} page_size={page_size} impl={env['backend'].impl} steps={steps} (times in us)")
        rows, call_row = measure_group(env, "-".join((layout, *opts)), variants, steps)
        timing += rows
        calls.append(call_row)
        print("  " + "; ".join(f"{r[0]}: overhead {r[5]:.0f}, piped - device {r[7]:.0f}, overlap - device {r[8]:.0f}"
                               for r in rows),
              file=sys.stderr)
        del env
        gc.collect()
    probe = [(n, argument_probe(n)) for n in (12, 180)] if len(groups) > 1 else []
    print_tables(timing, calls, probe)


# ---- --mode timeline: CUPTI trace of steps -------------------------------------------------------
def trace_steps(env, run, steps: int) -> list:
    """Chrome-trace events of ``steps`` blocking replays, each inside a ``step`` annotation."""
    from torch.profiler import ProfilerActivity, profile, record_function

    fb, tok, lens, params = env["fb"], env["tok"], env["lens"], env["params"]
    pools = env["pools"]
    for i in range(3):  # warm up outside the trace
        out, pools = run(fb(lens + i), tok(lens + i), params, pools)
        jax.block_until_ready(out)
    with warnings.catch_warnings(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        warnings.simplefilter("ignore")
        for i in range(steps):
            cur = lens + 3 + i
            with record_function("step"):
                with record_function("call"):
                    out, pools = run(fb(cur), tok(cur), params, pools)
                jax.block_until_ready(out)
    env["pools"] = pools
    import common  # torch: the timeline mode only

    return common.trace_events(prof)


def trace_window(env, run, steps: int, piped: bool) -> list:
    """Chrome-trace events of ``steps`` steps issued without blocking: replays (``piped``, next ids
    taken on device as ``time_pipelined`` does) or bare executable calls on the
    same device inputs (the kernels' floor)."""
    from torch.profiler import ProfilerActivity, profile

    fb, lens, params = env["fb"], env["lens"], env["params"]
    pools = env["pools"]
    call, same = bare_call(env), device_args(env)
    ids = jax.numpy.asarray(env["tok"](lens)["ids"])

    def go(n, ids, pools):
        for i in range(n):
            if piped:
                cur = lens + i
                out, pools = run(fb(cur), dict(ids=ids, pos=(cur - 1).astype("int32")), params, pools)
                ids = out["next_ids"]
            else:
                pools = call(same, pools)[1]
        jax.block_until_ready((ids, pools))
        return ids, pools

    ids, pools = go(3, ids, pools)
    with warnings.catch_warnings(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        warnings.simplefilter("ignore")
        ids, pools = go(steps, ids, pools)
    env["pools"] = pools
    import common  # torch: the timeline mode only

    return common.trace_events(prof)


def main_timeline(config="1b", batch=64, ctx=4096, page_size=16, steps=20, layers=None, impl="auto", variant="fused",
                  piped=False):
    """GPU timeline of steps per variant (CUPTI)."""
    for (layout, opts), variants in parse_variants(variant).items():
        env = setup(config, batch, ctx, page_size, steps + 8, layers, impl, layout, opts)
        where = (f"{jax.devices()[0].device_kind} (layers {env['cfg'].n_layers}, batch {batch}, ctx {ctx}, "
                 f"page {page_size})")
        if piped:
            print_window(f"{where} {layout}: bare calls, same inputs",
                         analyze_window(trace_window(env, None, steps, piped=False), steps))
        for name, call in variants:
            run = call_path(env, call)
            if piped:
                print_window(f"{where} {name}: pipelined replays", analyze_window(trace_window(env, run, steps, True),
                                                                                  steps))
            else:
                print_report(f"{where} {name}", analyze(trace_steps(env, run, steps)))
        del env


# ---- --mode replay-parts: each part of a replay alone ------------------------------------------------
def timed_part(name, fn, n=20):
    """Median host time of ``fn`` (no blocking inside), then block once."""
    out, ts = None, []
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    jax.block_until_ready(out)
    print(f"| {name} | {np.median(ts):.0f} |")
    return out


def main_replay_parts(config="1b", batch=64, ctx=4096, page_size=16, layers=None, impl="auto", variant="list"):
    """Host time of each part of ``StepRunner.replay`` alone, one variant."""
    groups = parse_variants(variant)
    if len(groups) != 1:
        raise ValueError(f"{variant=} must name one variant, e.g. 'fused' or 'fused-nocb'")
    (model_layout, opts), _ = next(iter(groups.items()))
    env = setup(config, batch, ctx, page_size, steps=30, layers=layers, impl=impl, layout=model_layout,
                    opts=opts)
    runner, fb, tok, params, pools = env["runner"], env["fb"], env["tok"], env["params"], env["pools"]
    exe = next(iter(runner.executables.values()))
    key = next(iter(runner.executables))
    lens = env["lens"]
    padded = pad_batch(fb(lens), batch, batch)
    layout = runner.pack(padded, _pad_tokens(tok(lens), batch))[0]
    dev = jax.device_put(step_inputs(runner, padded, tok(lens)))
    state = {"pools": pools}

    def call(f, *a):
        out, state["pools"] = f(*a, params, state["pools"])
        return out

    print("| part | host us |\n|---|---|")
    timed_part("pad_batch + plan_static", lambda: runner.backend.plan_static(pad_batch(fb(lens), batch, batch)))
    timed_part("pack + device_put of step inputs", lambda: jax.device_put(step_inputs(runner, padded, tok(lens))))
    timed_part("AOT executable, device inputs", lambda: call(exe, runner.backend.req_to_token, *dev))
    timed_part("jit call, device inputs", lambda: call(runner._jit, key, layout, runner.backend.req_to_token, *dev))
    timed_part("replay (all)", lambda: call(runner.replay, fb(lens), tok(lens)))
    staged = StagedReplay(runner)
    timed_part("staged replay (inputs copied to fixed buffers)", lambda: call(staged, fb(lens), tok(lens)))
    print(f"leaves per call: {len(jax.tree.leaves((params, pools)))} (params + pools)")


# ---- --mode baseline: our captured step against a dense-cache model (dense_baseline.py) -------------------
BASELINES = (dense_baseline.NAME,)


def setup_prefill(config, prompt_lens, page_size, layers, impl, layout="fused", opts=(), room=0, capture=True):
    """``build`` for prompts of ``prompt_lens`` random tokens from position 0 (EXTEND, one token bucket of
    their sum; ``room`` more positions per request), the bucket captured unless ``capture=False``;
    factories as ``setup``'s, and ``prompts`` i32[B, max(prompt_lens)] (the dense baseline's input)."""
    lens = np.asarray(prompt_lens, np.int32)
    env = build(config, len(lens), int(lens.max()) + room, page_size, layers, impl, layout, opts,
                token_buckets=(int(lens.sum()),))
    table, rows = env["table"], env["rows"]
    prompts = np.random.default_rng(2).integers(1, env["cfg"].vocab, (len(lens), lens.max())).astype(np.int32)

    def fb(lens):
        slots = np.concatenate([table[r, :n] for r, n in zip(rows, lens)])
        return ForwardBatch(ForwardMode.EXTEND, rows, lens, slots, extend_seq_lens=lens)

    def tok(lens):
        return dict(ids=np.concatenate([p[:n] for p, n in zip(prompts, lens)]),
                    pos=np.concatenate([np.arange(n, dtype=np.int32) for n in lens]))

    if capture:
        env["runner"].capture([fb(lens)], tok(lens), env["params"], env["pools"])
    exe = next(iter(env["runner"].executables.values()), None)
    return dict(env, exe=exe, fb=fb, tok=tok, lens=lens, prompts=prompts)


def dense_ids(env, lens) -> np.ndarray:
    """The dense step's ids i32[B, S] for the paged step's tokens at ``lens`` (decode: one per request)."""
    return env["prompts"] if "prompts" in env else env["tok"](lens)["ids"][:, None]


def steady_us(issue, steps: int, warm: int = 3, windows: int = 3) -> float:
    """Median over ``windows`` runs of the steady-state wall us per step of calls ``issue(i) -> ids`` issued
    without blocking (``_SteadyClock``: the GPU's time per step, the host's hidden behind it)."""
    per, ids = [], None
    for _ in range(windows):
        clock = _SteadyClock(warm)
        for i in range(warm + steps):
            ids = issue(i)
            clock.after_issue(i, ids)
        jax.block_until_ready(ids)
        per.append(clock.per_step_us(steps))
    return statistics.median(per)


def blocking_us(call, steps: int, warm: int = 3) -> float:
    """Median wall us of ``call(i)`` blocked on its result, ``i`` from ``warm`` (``warm`` untimed calls first)."""
    ts = []
    for i in range(warm + steps):
        t0 = time.perf_counter()
        jax.block_until_ready(call(i))
        ts.append(time.perf_counter() - t0)
    return _median_us(ts[warm:])


def time_stepper(device_step, host_step, steps: int) -> tuple:
    """(device us: ``device_step(i)`` issued without blocking, steady state; blocking us: ``host_step(i)``
    from host inputs, blocked on; the logits of ``host_step`` one step past those, host)."""
    times = steady_us(lambda i: device_step(i)["next_ids"], steps), blocking_us(host_step, steps)
    return (*times, np.asarray(host_step(steps + 3)["logits"]))


def time_ours(env, run, steps: int, advance: int):
    """Our captured step (``time_stepper``): bare executable calls on the same device inputs; ``run``
    (``call_path``) from host inputs, lengths ``lens + advance * i``."""
    lens, params, call, args = env["lens"], env["params"], bare_call(env), device_args(env)
    state = dict(pools=env["pools"])

    def device_step(i):
        out, state["pools"] = call(args, state["pools"])
        return out

    def host_step(i):
        cur = lens + advance * i
        out, state["pools"] = run(env["fb"](cur), env["tok"](cur), params, state["pools"])
        return out

    result = time_stepper(device_step, host_step, steps)
    env["pools"] = state["pools"]
    return result


def time_dense(env, step, caches, steps: int, advance: int):
    """The dense baseline on ``env``'s weights, tokens and lengths, as ``time_ours`` times ours (device: the
    jitted step on device-resident inputs; blocking: from host inputs, lengths advancing)."""
    lens, params = env["lens"], env["params"]
    args = jax.device_put((dense_ids(env, lens), lens))
    state = dict(caches=caches)

    def device_step(i):
        out, state["caches"] = step(params, state["caches"], *args)
        return out

    def host_step(i):
        cur = lens + advance * i
        out, state["caches"] = step(params, state["caches"], dense_ids(env, cur), cur)
        return out

    return time_stepper(device_step, host_step, steps)


def rel_err(ours, dense) -> float:
    """max |dense - ours| / max |ours|."""
    return float(np.max(np.abs(dense - ours)) / (np.max(np.abs(ours)) + 1e-30))


def compare_case(env, call: str, dense_impl, steps: int, phase: str) -> tuple:
    """One table row: our step and the dense baseline on the same weights, tokens and KV contents (the dense
    caches gathered from the pools before either runs), and the two paths' logits of one more step."""
    caches = dense_baseline.caches_from_pools(env["pools"], env["table"][env["rows"]])
    advance = int(phase == "decode")
    ours = time_ours(env, call_path(env, call), steps, advance)
    dense = time_dense(env, dense_baseline.make_step(env["cfg"], dense_impl), caches, steps, advance)
    tokens = len(env["tok"](env["lens"])["ids"])
    ctx = int(env["lens"].max()) if phase == "prefill" else int(env["lens"][0])
    return (phase, env["batch"], ctx, tokens, ours[0], dense[0], ours[1], dense[1], rel_err(ours[2], dense[2]))


def print_baseline_table(rows) -> None:
    print("| phase | batch | ctx | ours ms | dense ms | ours/dense tok/s | ours tok/s | dense tok/s "
          "| ours blocking ms | dense blocking ms | ours/dense blocking | logits rel err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for phase, batch, ctx, tokens, ours, dense, ours_b, dense_b, err in rows:
        print(f"| {phase} | {batch} | {ctx} | {ours / 1e3:.3f} | {dense / 1e3:.3f} | {dense / ours:.2f} | "
              f"{tokens / ours * 1e6:.0f} | {tokens / dense * 1e6:.0f} | {ours_b / 1e3:.3f} | {dense_b / 1e3:.3f} | "
              f"{dense_b / ours_b:.2f} | {err:.1e} |")


def int_list(spec: str) -> list:
    return [int(x) for x in str(spec).split(",") if x]


def main_baseline(config="1b", batches="1,8,64", ctxs="512,4096", prefills="8x512,1x4096", page_size=16, steps=20,
                  layers=None, impl="auto", variant="fused", baseline=dense_baseline.NAME):
    """Our captured step against ``baseline`` (``BASELINES``): decode at each batch and context, prefill at
    each ``BxS`` (B prompts of S tokens); one table."""
    groups = parse_variants(variant)
    if len(groups) != 1 or len(next(iter(groups.values()))) != 1:
        raise ValueError(f"{variant=} must name one variant, e.g. 'fused' or 'fused-static'")
    if baseline not in BASELINES:
        raise ValueError(f"{baseline=} must be one of {BASELINES}")
    (layout, opts), [(name, call)] = next(iter(groups.items()))
    cfg = llama.CONFIGS[config]
    dense_impl, why = dense_baseline.attention_impl(cfg.dtype)
    dense_baseline.check_config(cfg)  # before any compile
    print(f"device={jax.devices()[0].device_kind} config={config} layers={layers or cfg.n_layers} "
          f"page_size={page_size} ours={name} (impl={impl}) steps={steps}; baseline {baseline}: dense attention over "
          f"a contiguous [B, max_ctx, Hkv, D] cache per layer, jax.nn.dot_product_attention through {why}")
    cases = [("decode", b, c) for b in int_list(batches) for c in int_list(ctxs)]
    cases += [("prefill", *map(int, p.split("x"))) for p in prefills.split(",") if p]
    rows = []
    for phase, batch, n in cases:
        t0 = time.perf_counter()
        if phase == "decode":
            env = setup(config, batch, n, page_size, steps, layers, impl, layout, opts)
        else:
            env = setup_prefill(config, [n] * batch, page_size, layers, impl, layout, opts)
        rows.append(compare_case(env, call, dense_impl, steps, phase))
        r = rows[-1]
        print(f"  {phase} batch {batch} ctx {n}: ours {r[4] / 1e3:.3f} ms, dense {r[5] / 1e3:.3f} ms, logits rel err "
              f"{r[8]:.1e} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        del env
        gc.collect()
    print_baseline_table(rows)


def check_baseline(config="tiny", prompt_lens=(5, 12, 9), page_size=4, layers=None, impl="auto", layout="list"):
    """The dense baseline against our paged step on the same weights and KV contents: ragged prompts
    prefilled by both, then one decode step by both. Returns ``(prefill, decode)`` logits ``rel_err`` (a
    float32 config on the CPU: both near float32 rounding)."""
    env = setup_prefill(config, prompt_lens, page_size, layers, impl, layout, room=1, capture=False)
    lens, table, rows, params, runner = env["lens"], env["table"], env["rows"], env["params"], env["runner"]
    step = dense_baseline.make_step(env["cfg"], dense_baseline.attention_impl(env["cfg"].dtype)[0])
    caches = dense_baseline.caches_from_pools(env["pools"], table[rows])
    ours, pools = runner.eager(env["fb"](lens), env["tok"](lens), params, env["pools"])
    dense, caches = step(params, caches, env["prompts"], lens)
    width = env["prompts"].shape[1]
    real = np.concatenate([b * width + np.arange(n) for b, n in enumerate(lens)])
    prefill = rel_err(np.asarray(ours["logits"]), np.asarray(dense["logits"])[real])
    ids = np.asarray(ours["next_ids"])[np.cumsum(lens) - 1]  # each request's next token, at position lens
    ours, pools = runner.eager(decode_batch(table, rows, lens + 1), dict(ids=ids, pos=lens), params, pools)
    dense, caches = step(params, caches, ids[:, None], lens + 1)
    return prefill, rel_err(np.asarray(ours["logits"]), np.asarray(dense["logits"]))


# ---- command line --------------------------------------------------------------------------------
MODES = {"host": (main_host, dict(steps=30, variant="main")),
         "timeline": (main_timeline, dict(steps=20, variant="fused")),
         "replay-parts": (main_replay_parts, dict(variant="list")),
         "baseline": (main_baseline, dict(steps=20, variant="fused"))}
SMOKE = dict(config="tiny", batch=4, ctx=64, layers=2, page_size=16)  # --smoke: every mode at these sizes
SMOKE_BASELINE = dict(config="tiny", layers=2, page_size=16, batches="2", ctxs="48", prefills="2x16")
BASELINE_FLAGS = ("baseline", "batches", "ctxs", "prefills")  # --mode baseline only (its cases replace --batch, --ctx)


def run_mode(mode: str, steps=None, variant=None, piped=False, **kw) -> None:
    """Runs one mode; ``steps`` and ``variant`` default per mode (``MODES``)."""
    fn, defaults = MODES[mode]
    kw["variant"] = variant or defaults["variant"]
    if "steps" in defaults:
        kw["steps"] = steps or defaults["steps"]
    if mode == "timeline":
        kw["piped"] = piped
    fn(**kw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default=None, choices=sorted(MODES), help="default host; baseline with --baseline")
    ap.add_argument("--config", default="1b", choices=sorted(llama.CONFIGS))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=None, help="timed steps (host 30, timeline 20)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--variant", default=None,
                    help=f"comma-separated LAYOUT[-OPTION...] ({'|'.join(llama.LAYOUTS)}; "
                         f"{'|'.join(CALL_OPTIONS + tuple(COMPILE_OPTIONS))}) or a set: {', '.join(VARIANT_SETS)} "
                         "(default: host main, timeline fused, replay-parts list)")
    ap.add_argument("--piped", action="store_true",
                    help="timeline: steps issued without blocking (and bare calls on the same inputs)")
    ap.add_argument("--baseline", default=None, choices=BASELINES,
                    help="--mode baseline (implied): our step against this baseline (dense_baseline.py)")
    ap.add_argument("--batches", default=None, help="baseline: decode batch sizes (default 1,8,64)")
    ap.add_argument("--ctxs", default=None, help="baseline: decode context lengths (default 512,4096)")
    ap.add_argument("--prefills", default=None, help="baseline: prefill shapes BxS, B prompts of S tokens "
                                                     "(default 8x512,1x4096; '' for none)")
    ap.add_argument("--smoke", action="store_true", help="tiny model on the CPU (or GPU): every mode that runs there")
    args = vars(ap.parse_args(argv))
    mode, smoke = args.pop("mode"), args.pop("smoke")
    baseline_args = {k: v for k in BASELINE_FLAGS if (v := args.pop(k)) is not None}
    mode = mode or ("baseline" if baseline_args else "host")
    if baseline_args and mode != "baseline":
        sys.exit(f"--{'/--'.join(baseline_args)} belong to --mode baseline, not --mode {mode}")
    if smoke:
        import torch

        run_mode("baseline", **SMOKE_BASELINE, steps=3)
        run_mode("replay-parts", **SMOKE, variant="fused")
        if torch.cuda.is_available():
            run_mode("timeline", **SMOKE, steps=3, variant="fused")
        else:
            print("smoke: --mode timeline skipped on the CPU (a CUPTI trace of GPU work)")
        run_mode("host", **SMOKE, steps=3, variant="list,fused-jit")  # last: its tables end the output
        return 0
    if mode == "timeline":
        import torch

        if not torch.cuda.is_available():
            sys.exit("--mode timeline needs a CUDA GPU (the timeline comes from a CUPTI trace)")
    if mode == "baseline":
        del args["batch"], args["ctx"]
        args.update(baseline_args)
    run_mode(mode, **args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
