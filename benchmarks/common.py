"""Timing, checking and reporting helpers for the attention benchmarks.

Each peer gets two numbers, both after a warm-up (compilation stays out) and both medians:

* device time (the table's ``time``, used for throughput and ratios): the GPU time of one call,
  summed over its kernels, memcpys and memsets as CUPTI records them (torch.profiler sees the
  kernels that XLA launches too, as both share the process). Calls run back to back; each call's
  activities are grouped and summed; the median over the calls is taken. Gaps between the
  kernels of one call are not counted.
* wall time: back-to-back calls as each framework runs them at best. torch / Triton peers are
  captured in a CUDA graph whose replays are bracketed by CUDA events (SGLang runs decode in
  graphs); JAX peers are dispatched asynchronously and the wall clock is read after
  ``block_until_ready`` (JAX runs on its own stream, so torch's events cannot bracket it). The
  host time to enqueue a JAX call is noted, and ``HOST-BOUND`` marks a call whose enqueue time
  approaches its wall time: its wall time then measures dispatch, not the GPU.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import math
import os
import statistics
import tempfile
import time
import warnings
from typing import Callable, Optional, Sequence

import torch

TARGET_REP_US = 2000.0  # each repetition runs the call back to back for about this long


@dataclasses.dataclass
class Row:
    """One measured (case, peer) pair."""

    case: str  # e.g. "decode B=64 ctx=4096 ps=16"
    kind: str  # decode | prefill | extend | verify
    peer: str  # e.g. "ours", "sdpa[cudnn]", "sglang_triton"
    page_size: int
    status: str = "ok"  # ok | WRONG | n/a | error
    time_us: float = float("nan")  # device time per call (CUPTI), falls back to wall time
    wall_us: float = float("nan")  # back-to-back wall time per call
    value: float = float("nan")  # TB/s or TFLOP/s
    unit: str = ""
    rel_err: float = float("nan")  # ||out - sdpa|| / ||sdpa|| on this case
    ratio: float = float("nan")  # our throughput / this peer's throughput (> 1: ours faster)
    note: str = ""
    shape: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Timing:
    time_us: float  # median per call
    spread: float  # (p80 - p20) / median over the repetitions
    note: str = ""


def cuda_available() -> bool:
    return torch.cuda.is_available()


def _inner_count(single_us: float, max_inner: int = 64) -> int:
    return int(min(max_inner, max(2, math.ceil(TARGET_REP_US / max(single_us, 1.0)))))


def _summary(per_call_us: Sequence[float], note: str = "") -> Timing:
    xs = sorted(per_call_us)
    med = statistics.median(xs)
    lo, hi = xs[len(xs) // 5], xs[(4 * len(xs)) // 5 if len(xs) > 1 else 0]
    return Timing(med, (hi - lo) / med if med > 0 else float("nan"), note)


def _events_time_us(run: Callable[[], None]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3


def time_torch(fn: Callable[[], object], reps: int, warmup: int = 3) -> Timing:
    """Median time of ``fn()`` (torch / Triton launches on the current stream), in us."""
    if not cuda_available():
        return time_host(fn, reps, warmup, sync=lambda out: None)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    single = min(_events_time_us(fn) for _ in range(3))
    inner = _inner_count(single)

    def eager():
        for _ in range(inner):
            fn()

    try:
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()  # warm on the capture stream (lazy handles, workspaces)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            eager()
        run, note = graph.replay, f"cuda graph x{inner}"
        run()
        torch.cuda.synchronize()
    except Exception as e:  # some backends cannot be captured: time plain launches
        torch.cuda.synchronize()
        run, note = eager, f"eager x{inner} (graph capture failed: {type(e).__name__})"
    return _summary([_events_time_us(run) / inner for _ in range(reps)], note)


def time_jax(fn: Callable[[], object], reps: int, warmup: int = 3) -> Timing:
    """Median time of a jitted JAX call ``fn()``, in us (wall clock over queued calls)."""
    import jax

    def sync(out):
        jax.block_until_ready(out)

    return time_host(fn, reps, warmup, sync=sync, flag_host_bound=True)


def time_host(fn, reps: int, warmup: int, sync, flag_host_bound: bool = False) -> Timing:
    """Wall-clock median of back-to-back async calls; ``sync(out)`` waits for the last one."""
    for _ in range(warmup):
        sync(fn())
    if cuda_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    sync(fn())
    single = (time.perf_counter() - t0) * 1e6
    inner = _inner_count(single)
    per_call, enqueue = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(inner):
            out = fn()
        t1 = time.perf_counter()
        sync(out)
        t2 = time.perf_counter()
        per_call.append((t2 - t0) * 1e6 / inner)
        enqueue.append((t1 - t0) * 1e6 / inner)
    timing = _summary(per_call, f"queued x{inner}")
    host_us = statistics.median(enqueue)
    note = f"{timing.note}, host {host_us:.0f} us/call"
    if flag_host_bound and host_us > 0.8 * timing.time_us:
        note += " HOST-BOUND"
    return Timing(timing.time_us, timing.spread, note)


_DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def trace_events(prof) -> list:
    """The Chrome-trace events of a finished ``torch.profiler`` run."""
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trace = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(trace)
        with open(trace) as f:
            return json.load(f).get("traceEvents", [])


def device_activities(fn: Callable[[], object], sync: Callable[[object], None], calls: int) -> list:
    """Sorted ``(start, duration us, name)`` of the GPU activities of ``calls`` back-to-back calls
    (one CUPTI trace)."""
    from torch.profiler import ProfilerActivity, profile

    sync(fn())
    torch.cuda.synchronize()
    with warnings.catch_warnings(), profile(activities=[ProfilerActivity.CUDA]) as prof:
        warnings.simplefilter("ignore")  # "Profiler clears events at the end of each cycle"
        for _ in range(calls):
            out = fn()
        sync(out)
        torch.cuda.synchronize()
    events = trace_events(prof)
    return sorted((e["ts"], e["dur"], e.get("name", "")) for e in events
                  if e.get("cat") in _DEVICE_CATEGORIES and "dur" in e)


def kernel_times(fn: Callable[[], object], sync: Callable[[object], None], calls: int) -> Optional[dict]:
    """``{name: (launches per call, GPU us per call)}`` of the kernels (memcpys, memsets) of ``calls`` back-to-back
    calls (one CUPTI trace), longest first; None without a CUDA device."""
    if not callable(fn):  # (checked first, so that a CPU smoke run catches a wrong argument too)
        raise TypeError(f"kernel_times takes the call to time, not {type(fn).__name__}")
    if not cuda_available():
        return None
    per: dict = {}
    for _, dur, name in device_activities(fn, sync, calls):
        n, t = per.get(name, (0.0, 0.0))
        per[name] = (n + 1 / calls, t + dur / calls)
    return dict(sorted(per.items(), key=lambda kv: -kv[1][1]))


def time_device(fn: Callable[[], object], sync: Callable[[object], None], calls: int) -> Optional[Timing]:
    """Median GPU time of one call from a CUPTI trace of ``calls`` back-to-back calls, or None.

    The activities of the trace are split into ``calls`` equal consecutive groups (each call
    launches the same sequence); when the count does not divide, the mean is returned instead.
    """
    if not cuda_available():
        return None
    acts = device_activities(fn, sync, calls)
    if not acts:
        return None
    per = len(acts) // calls
    if per == 0 or len(acts) % calls:
        mean = sum(a[1] for a in acts) / calls
        return Timing(mean, float("nan"), f"cupti mean, {len(acts)} activities / {calls} calls")
    sums = [sum(a[1] for a in acts[i * per:(i + 1) * per]) for i in range(calls)]
    timing = _summary(sums)
    return Timing(timing.time_us, timing.spread, f"{per} kernels/call")


def wall_seconds(fn: Callable[[], object], iters: int = 20, reps: int = 9) -> float:
    """Median seconds per call of a JAX call over ``reps`` runs of ``iters`` back-to-back calls (two
    warm-up calls first; the host clock, so a call that dispatches slower than the GPU runs is
    bound by dispatch)."""
    import jax

    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
    per_call = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn()
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - t0) / iters)
    return statistics.median(per_call)


# ---- the Triton kernel at fixed points (JAX arrays, no torch) ----------------------------------
HQ, HKV, D = 32, 8, 128


def triton_problem(batch: int, ctx: int, q_len: int, page_size: int, seed: int = 0):
    """Random bf16 q / paged cache with shuffled pages; every sequence has ``ctx`` keys.
    Returns ``(q, k, v, md)`` for ``jax_attn.kernels.triton_paged.paged_attention``."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_attn.metadata import AttentionMetadata, ForwardMode

    rng = np.random.default_rng(seed)
    pages_per_seq = -(-ctx // page_size)
    num_pages = batch * pages_per_seq + 1
    table = (rng.permutation(num_pages - 1)[: batch * pages_per_seq] + 1).reshape(batch, pages_per_seq)
    key = jax.random.key(seed)
    k1, k2, k3 = jax.random.split(key, 3)
    shape = (num_pages, page_size, HKV, D)
    k = jax.random.normal(k1, shape, jnp.bfloat16)
    v = jax.random.normal(k2, shape, jnp.bfloat16)
    t = batch * q_len
    q = jax.random.normal(k3, (t, HQ, D), jnp.bfloat16)
    md = AttentionMetadata(
        cache_seqlens=jnp.full((batch,), ctx, jnp.int32),
        cu_seqlens_q=jnp.arange(batch + 1, dtype=jnp.int32) * q_len,
        cu_seqlens_k=jnp.arange(batch + 1, dtype=jnp.int32) * ctx,
        page_table=jnp.asarray(table, jnp.int32),
        out_cache_loc=jnp.zeros((t,), jnp.int32),
        max_seqlen_q=jnp.int32(q_len), max_seqlen_k=jnp.int32(ctx),
        mode=ForwardMode.DECODE if q_len == 1 else ForwardMode.EXTEND,
        batch_size=batch, num_tokens=t, page_size=page_size, max_q_len=q_len, max_pages=pages_per_seq,
    )
    return q, k, v, md


def triton_point(kind: str, page_size: int, cfg, batch: int = 64, ctx: int = 4096, prefill=(4, 4096)):
    """(us per call, value, unit) of the Triton kernel with ``KernelConfig`` ``cfg`` at one point, its
    schedule planned once beforehand: decode ``batch`` x ``ctx`` (TB/s of KV bytes
    ``2 * B * ctx * Hkv * D * 2``) or causal prefill ``prefill = (B, S)`` (TFLOP/s,
    ``4 * B * Hq * S^2 * D / 2``); ``wall_seconds`` of back-to-back calls."""
    from jax_attn.kernels.schedule import plan_schedule
    from jax_attn.kernels.triton_paged import paged_attention

    if kind == "decode":
        q_len = 1
    else:
        (batch, ctx), q_len = prefill, prefill[1]
    q, k, v, md = triton_problem(batch, ctx, q_len, page_size)
    md = dataclasses.replace(md, schedule=plan_schedule(md, num_q_heads=HQ, num_kv_heads=HKV, config=cfg))
    fn = lambda: paged_attention(q, k, v, md, causal=True, config=cfg)
    sec = wall_seconds(fn, iters=20 if kind == "decode" else 5)
    if kind == "decode":
        value, unit = 2 * batch * ctx * HKV * D * 2 / sec / 1e12, "TB/s"
    else:
        value, unit = 4 * batch * HQ * ctx * ctx * D / 2 / sec / 1e12, "TFLOP/s"
    return sec * 1e6, value, unit


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float32; NaN anywhere gives inf."""
    a, b = out.float(), ref.float()
    if a.shape != b.shape:
        raise ValueError(f"{a.shape=} != {b.shape=}: bring both to [num_tokens, num_q_heads, head_dim]")
    if not torch.isfinite(a).all():
        return float("inf")
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b).clamp_min(1e-30))


def copy_bandwidth_tbps(num_bytes: int = 4 << 30, calls: int = 20) -> float:
    """Device-to-device copy rate (bytes read + written) as the memory-bandwidth ceiling."""
    if not cuda_available():
        return float("nan")
    src = torch.randn(num_bytes // 4, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(10):  # let the clocks come up
        dst.copy_(src)
    t = time_device(lambda: dst.copy_(src), lambda out: None, calls)
    return 2 * num_bytes / (t.time_us * 1e-6) / 1e12 if t else float("nan")


def fill_ratios(rows: list[Row]) -> None:
    """ratio = our throughput / peer throughput, against the 'ours' row of the same case."""
    ours = {r.case: r for r in rows if r.peer == "ours" and r.status == "ok"}
    for r in rows:
        o = ours.get(r.case)
        if o is not None and r.status == "ok" and r.value > 0:
            r.ratio = o.value / r.value


def fmt(x: float, spec: str) -> str:
    """format(x, spec), or '-' padded to the same width when x is missing."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        width = "".join(ch for ch in spec.split(".")[0] if ch.isdigit())
        return "-".rjust(int(width) if width else 1)
    return format(x, spec)


def format_table(rows: list[Row]) -> str:
    """Plain-text table: one line per (case, peer)."""
    head = (f"{'case':<32} {'peer':<22} {'time(us)':>9} {'wall(us)':>9} {'value':>7} {'unit':<7} "
            f"{'ours/peer':>9} {'relerr':>7}  status / note")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.case:<32} {r.peer:<22} {fmt(r.time_us, '9.1f')} {fmt(r.wall_us, '9.1f')} {fmt(r.value, '7.3g')} "
            f"{r.unit:<7} {fmt(r.ratio, '9.2f')} {fmt(r.rel_err, '7.1e')}  {r.status}"
            + (f" ({r.note[:110]})" if r.note else "")
        )
    return "\n".join(lines)


def out_dir() -> str:
    path = os.environ.get("OUT") or "out"
    os.makedirs(path, exist_ok=True)
    return path


def write_results(rows: list[Row], meta: dict, path: str) -> list[str]:
    """Writes bench_results.json and bench_results.csv under ``path``; returns the file names."""
    records = [dataclasses.asdict(r) for r in rows]
    jpath, cpath = os.path.join(path, "bench_results.json"), os.path.join(path, "bench_results.csv")
    with open(jpath, "w") as f:
        json.dump({"meta": meta, "rows": records}, f, indent=1, default=str)
    fields = [f.name for f in dataclasses.fields(Row) if f.name != "shape"]
    with open(cpath, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(records)
    return [jpath, cpath]


PLOTS = {  # kind: (file, y label, case-name prefix dropped from the tick labels)
    "decode": ("decode_matrix.png", "TB/s (KV bytes / time)", "decode "),
    "prefill": ("prefill_matrix.png", "TFLOP/s (causal)", "prefill "),
}


def plot_kind(rows: list[Row], kind: str, path: str, title: str,
              ceiling: Optional[float] = None, ceiling_label: str = "") -> Optional[str]:
    """Grouped bars of one kind's figure (``PLOTS``) per case and peer; returns the file, or None
    without matplotlib or rows of that kind."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    sel = [r for r in rows if r.kind == kind and r.status == "ok"]
    if not sel:
        return None
    fname, ylabel, prefix = PLOTS[kind]
    cases = list(dict.fromkeys(r.case for r in sel))
    peers = list(dict.fromkeys(r.peer for r in sel))
    width = 0.8 / len(peers)
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(cases)), 5))
    for i, p in enumerate(peers):
        vals = [next((r.value for r in sel if r.case == c and r.peer == p), 0.0) for c in cases]
        ax.bar([x + (i - (len(peers) - 1) / 2) * width for x in range(len(cases))], vals, width, label=p)
    if ceiling and not math.isnan(ceiling):
        ax.axhline(ceiling, color="k", ls="--", lw=1, label=ceiling_label)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([c.replace(prefix, "").replace(" ps", "\nps") for c in cases], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10, pad=28)
    ax.legend(fontsize=7, ncol=len(peers) + 1, loc="lower center", bbox_to_anchor=(0.5, 1.0), frameon=False)
    fig.tight_layout()
    out = os.path.join(path, fname)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
