"""Timeline of a blocking decode step through the JAX backend (GPU): where the GPU waits.

Runs ``StepRunner.replay`` of the example model's captured decode step, blocking on the result
every step (what a serving loop that reads its sampled tokens each step does), under one CUPTI
trace (torch.profiler sees every kernel in the process, JAX's included). Per step it splits the
wall time into:

  host to first GPU work   step start -> the first kernel/memcpy of the step starts
  GPU busy                 union of the step's kernels, memcpys and memsets
  GPU idle inside          gaps between the first and the last GPU activity
  tail                     the last GPU activity ends -> the blocking call returns

and lists the largest idle gaps with the activities on either side, and the host time of CUDA
driver/runtime calls by name (graph launches and updates, kernel launches, synchronizations).

With ``--piped``, steps are issued without blocking (as ``bench_host_overhead``'s ``piped``) and
the report gives, per step, the GPU span, busy and idle time and the activities by kind, for the
replays and for bare executable calls on the same device inputs.

    python benchmarks/profile_step.py --config 1b --batch 64 --ctx 4096 --variant fused [--piped]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import tempfile
import warnings

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and torch share the GPU
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import torch  # noqa: E402

import bench_host_overhead as bho  # noqa: E402

_GPU = ("kernel", "gpu_memcpy", "gpu_memset")
_API = ("cuda_runtime", "cuda_driver")


def _events(prof) -> list:
    """The Chrome-trace events of a finished ``torch.profiler`` run."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f).get("traceEvents", [])


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
    return _events(prof)


def trace_window(env, run, steps: int, piped: bool) -> list:
    """Chrome-trace events of ``steps`` steps issued without blocking: replays (``piped``, next ids
    taken on device as ``bench_host_overhead.time_pipelined`` does) or bare executable calls on the
    same device inputs (the kernels' floor)."""
    from torch.profiler import ProfilerActivity, profile

    fb, lens, params = env["fb"], env["lens"], env["params"]
    pools = env["pools"]
    call, same = bho.bare_call(env), bho.device_args(env)
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
    return _events(prof)


def analyze_window(events: list, steps: int, top: int = 8) -> dict:
    """Per step: GPU span, busy and idle time, activities by kind; the largest idle gaps."""
    gpu = sorted((e["ts"], e["ts"] + e["dur"], e.get("name", ""), e.get("cat")) for e in events
                 if e.get("cat") in _GPU and "dur" in e)
    busy = _union_us([(a, b) for a, b, _, _ in gpu])
    span = max(b for _, b, _, _ in gpu) - gpu[0][0]
    gaps, end, prev = [], gpu[0][1], gpu[0][2]
    for a, b, name, _ in gpu[1:]:
        if a > end:
            gaps.append((a - end, prev, name))
        if b > end:
            end, prev = b, name
    kinds = collections.Counter(cat for _, _, _, cat in gpu)
    kind_us = collections.Counter()
    for a, b, _, cat in gpu:
        kind_us[cat] += b - a
    return dict(span=span / steps, busy=busy / steps, idle=(span - busy) / steps,
                kinds={k: (kinds[k] / steps, kind_us[k] / steps) for k in kinds},
                gaps=sorted(gaps, reverse=True)[:top], gaps_over_5us=sum(g for g, _, _ in gaps if g > 5) / steps)


def print_window(name: str, rep: dict) -> None:
    print(f"\n### {name} (per step, us)\n")
    print(f"GPU span {rep['span']:.0f}, busy {rep['busy']:.0f}, idle {rep['idle']:.0f} "
          f"(in gaps over 5 us: {rep['gaps_over_5us']:.0f})")
    print("activities: " + ", ".join(f"{k} {n:.1f} ({us:.0f} us)" for k, (n, us) in sorted(rep["kinds"].items())))
    print("largest idle gaps (us, after -> before):")
    for us, prev, nxt in rep["gaps"]:
        print(f"  {us:8.1f}  {prev[:60]} -> {nxt[:60]}")


def _union_us(spans) -> float:
    total, end = 0.0, -1e30
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def analyze(events: list, top: int = 8) -> dict:
    """Per-step medians of the timeline parts, the largest gaps and API host time per step."""
    marks = {n: sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == n and "dur" in e)
             for n in ("step", "call")}
    gpu = sorted((e["ts"], e["ts"] + e["dur"], e.get("name", "")) for e in events
                 if e.get("cat") in _GPU and "dur" in e)
    api = [(e["ts"], e["dur"], e.get("name", "")) for e in events if e.get("cat") in _API and "dur" in e]
    rows, gaps, api_us = [], [], collections.Counter()
    for s0, s1 in marks["step"]:
        c1 = next((c for b, c in marks["call"] if s0 <= b < s1), s0)
        acts = [a for a in gpu if s0 <= a[0] < s1]
        if not acts:
            continue
        busy = _union_us([(a, b) for a, b, _ in acts])
        g0, g1 = acts[0][0], max(a[1] for a in acts)
        rows.append(dict(wall=s1 - s0, call=c1 - s0, first=g0 - s0, busy=busy, idle=(g1 - g0) - busy,
                         tail=s1 - g1, acts=len(acts)))
        end, prev = acts[0][1], acts[0][2]
        for a, b, name in acts[1:]:
            if a > end:
                gaps.append((a - end, prev, name))
            if b > end:
                end, prev = b, name
        for t, d, name in api:
            if s0 <= t < s1:
                api_us[name] += d
    n = max(1, len(rows))
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {}
    return dict(steps=len(rows), median=med, gaps=sorted(gaps, reverse=True)[:top],
                api=[(name, us / n) for name, us in api_us.most_common(top)])


def print_report(name: str, rep: dict) -> None:
    m = rep["median"]
    print(f"\n### {name}: {rep['steps']} blocking steps (median us)\n")
    print("| wall | call returns | host to first GPU work | GPU busy | GPU idle inside | tail | activities |")
    print("|---|---|---|---|---|---|---|")
    print("| " + " | ".join(f"{m[k]:.0f}" for k in ("wall", "call", "first", "busy", "idle", "tail", "acts")) + " |")
    print("\nlargest idle gaps (us, after -> before):")
    for us, prev, nxt in rep["gaps"]:
        print(f"  {us:8.1f}  {prev[:60]} -> {nxt[:60]}")
    print("\nCUDA API host time per step (us):")
    for api_name, us in rep["api"]:
        print(f"  {us:8.1f}  {api_name}")


def main(config="1b", batch=64, ctx=4096, page_size=16, steps=20, layers=None, variant="fused", piped=False):
    for (layout, opts), variants in bho.parse_variants(variant).items():
        env = bho.setup(config, batch, ctx, page_size, steps + 8, layers, "auto", layout, opts)
        where = (f"{jax.devices()[0].device_kind} (layers {env['cfg'].n_layers}, batch {batch}, ctx {ctx}, "
                 f"page {page_size})")
        if piped:
            print_window(f"{where} {layout}: bare calls, same inputs",
                         analyze_window(trace_window(env, None, steps, piped=False), steps))
        for name, call in variants:
            run = bho.call_path(env, call)
            if piped:
                print_window(f"{where} {name}: pipelined replays", analyze_window(trace_window(env, run, steps, True),
                                                                                  steps))
            else:
                print_report(f"{where} {name}", analyze(trace_steps(env, run, steps)))
        del env


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("profile_step.py needs a CUDA GPU (the timeline comes from a CUPTI trace)")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="1b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--variant", default="fused", help="bench_host_overhead variants, comma-separated")
    ap.add_argument("--piped", action="store_true",
                    help="steps issued without blocking (and bare calls on the same inputs): GPU busy/idle per step")
    main(**{k.replace("-", "_"): v for k, v in vars(ap.parse_args()).items()})
