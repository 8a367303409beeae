"""Soak: thousands of random engine steps through the torch bridge and the JAX API, every one checked.

    python benchmarks/soak.py --steps 20000                  # H100: both front ends, page sizes 1 and 16
    python benchmarks/soak.py --steps 200 --fronts bridge --page-sizes 16 --pair   # target + draft backends

An engine (``Engine``) runs requests that arrive, prefill in chunks, decode, verify chains of draft tokens
(topk 1) and draft-extend the accepted ones, finish or are preempted. A finished or preempted request's
pages are NaN-poisoned and go back to the free list, which hands pages out in shuffled order. Each step:

* the whole pool is compared bit for bit with its state before the step plus the step's own writes (no
  other slot may change);
* every ``--check-every``-th step, and every step that serves one of the traced requests, each request's
  output rows are compared with a float64 oracle over that request's own K/V (per-request relative error);
* every 100 steps torch's and JAX's device memory is sampled; after the warm-up steps, retraces of the
  front end's step functions (the bridge's planners and layer executables, the ``StepRunner``'s), Mosaic
  kernel builds and all XLA compiles (glue ops included) are counted (target: none).

At start-up each bridge engine builds the kernels of the steps to come (every bucket's decode, chain verify,
bucketed extend and draft extend) in one round (``FlashAttentionBackend.prebuild``, as an engine's start-up
can; ``--no-prebuild``: each at its first step, a build round per new shape class).

``--pair``: a second (draft-model) engine and backend in the same process, stepped alternately on a second
torch stream, each checked against its own oracle (EAGLE runs target and draft this way).
Prints one line per engine and exits non-zero on any mismatch, corruption or retrace after warm-up.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import sys
import threading
import time
from typing import Dict, List, Optional

import numpy as np
import torch

sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
import soak_fronts as fronts  # noqa: E402

MODES = ("extend", "decode", "decode", "decode", "verify", "draft_extend")  # drawn uniformly
EXTEND_TOKENS = 64  # tokens of a bucketed extend batch (a chunked-prefill budget)
PREEMPT = 0.002  # chance per step that a running request is preempted (its K/V dropped, recomputed later)


@dataclasses.dataclass
class Req:
    rid: int
    row: int
    target: int  # tokens it will hold when done
    length: int = 0  # tokens whose K/V are in the pool
    pages: List[int] = dataclasses.field(default_factory=list)


class Engine:
    """Requests, pages and the request table of one simulated server over one front end."""

    def __init__(self, front, *, page_size: int, num_pages: int, max_reqs: int, max_ctx: int, heads, layers,
                 num_draft: int, dtype, device, seed: int, traced: int = 3, bucketed: bool = False):
        self.front, self.page_size, self.max_ctx, self.max_reqs = front, page_size, max_ctx, max_reqs
        self.heads, self.layers, self.num_draft, self.dtype, self.device = heads, layers, num_draft, dtype, device
        self.rng = np.random.default_rng(seed)
        self.bucketed = bucketed
        self.free_pages = [int(p) for p in self.rng.permutation(np.arange(1, num_pages))]  # page 0 reserved
        self.free_rows = list(range(1, max_reqs + 1))
        self.running: Dict[int, Req] = {}
        self.waiting: List[Req] = []
        self.next_rid = 0
        self.traced = set(range(traced))  # these requests are checked at every step that serves them
        self.gen = torch.Generator(device=device).manual_seed(seed)
        self.stats = dict(steps=0, checked=0, mismatches=0, corrupted=0, finished=0, preempted=0, worst=0.0)

    # ---- allocation -----------------------------------------------------------------------------
    def _admit(self) -> None:
        while len(self.running) < self.max_reqs and self.free_rows and self.rng.random() < 0.7:
            req = self.waiting.pop(0) if self.waiting else self._new_request()
            req.row = self.free_rows.pop(int(self.rng.integers(len(self.free_rows))))
            self.running[req.rid] = req

    def _new_request(self) -> Req:
        self.next_rid += 1
        return Req(self.next_rid - 1, 0, int(self.rng.integers(8, self.max_ctx - 2 * self.num_draft)))

    def _grow(self, req: Req, upto: int) -> bool:
        """Pages for positions ``< upto``; the new slots go into the request table. False: no pages left."""
        need = -(-upto // self.page_size) - len(req.pages)
        if need > len(self.free_pages):
            return False
        if need > 0:
            req.pages += [self.free_pages.pop() for _ in range(need)]
            slots = (np.array(req.pages)[:, None] * self.page_size + np.arange(self.page_size)).reshape(-1)
            row = np.zeros(self.max_ctx, np.int32)
            row[:min(len(slots), self.max_ctx)] = slots[:self.max_ctx]
            self.front.set_rows([req.row], row[None])
        return True

    def _release(self, req: Req, preempt: bool) -> None:
        del self.running[req.rid]
        slots = (np.array(req.pages, np.int64)[:, None] * self.page_size + np.arange(self.page_size)).reshape(-1)
        if len(slots):
            self.front.poison(slots)
        self.front.set_rows([req.row], np.zeros((1, self.max_ctx), np.int32))
        self.free_rows.append(req.row)
        self.free_pages += req.pages
        self.rng.shuffle(self.free_pages)
        req.pages, req.row = [], 0
        if preempt:  # recomputed from scratch later (its K/V are gone)
            req.length = 0
            self.waiting.append(req)
            self.stats["preempted"] += 1
        else:
            self.stats["finished"] += 1

    def slots(self, req: Req, start: int, n: int) -> np.ndarray:
        pos = np.arange(start, start + n)
        return np.array(req.pages, np.int64)[pos // self.page_size] * self.page_size + pos % self.page_size

    # ---- one step ---------------------------------------------------------------------------------
    def next_step(self) -> Optional[fronts.Step]:
        self._admit()
        for req in list(self.running.values()):
            if req.length >= req.target:
                self._release(req, preempt=False)
            elif self.rng.random() < PREEMPT:
                self._release(req, preempt=True)
        self._admit()
        mode = MODES[int(self.rng.integers(len(MODES)))]
        picked = self._pick(mode)
        if picked is None and mode != "extend":
            mode, picked = "extend", self._pick("extend")
        if picked is None:
            return None
        reqs, prefix, new = picked
        for r, p, k in zip(reqs, prefix, new):
            if not self._grow(r, p + k):
                return None  # out of pages this step (finishing requests free them)
        loc = np.concatenate([self.slots(r, p, k) for r, p, k in zip(reqs, prefix, new)])
        seq = [p + (0 if mode == "verify" else k) for p, k in zip(prefix, new)]
        t = len(loc)
        hq, hkv, d = self.heads
        qkv = [tuple(torch.randn(t, h, d, generator=self.gen, device=self.device).to(self.dtype)
                     for h in (hq, hkv, hkv)) for _ in self.layers]
        step = fronts.Step(mode, np.array([r.row for r in reqs], np.int64), np.array(seq, np.int64),
                           np.array(prefix, np.int64), np.array(new, np.int64), loc, qkv, num_draft=self.num_draft)
        step.reqs = reqs  # type: ignore[attr-defined]
        return step

    def _pick(self, mode: str):
        """(requests, keys before this step's tokens, this step's tokens) of a ``mode`` batch, or None.

        ``bucketed`` (the bridge unless ``--ragged-bridge``): extend batches hold a bucket of
        requests and ``EXTEND_TOKENS`` tokens, draft extends a bucket of requests that all accepted N."""
        n = self.num_draft
        if mode == "extend":
            cands = [r for r in self.running.values() if r.length < r.target]
        elif mode == "draft_extend":
            cands = [r for r in self.running.values() if r.length >= (n if self.bucketed else 1)]
        else:
            cands = [r for r in self.running.values() if 0 < r.length and r.length + n <= self.max_ctx]
        cands = [cands[i] for i in self.rng.permutation(len(cands))]
        bs = min(len(cands), int(self.rng.integers(1, fronts.GRAPH_BUCKETS[-1] + 1)))
        if self.bucketed and mode in ("extend", "draft_extend") and bs:
            # down to a bucket; below the smallest, up to it when enough requests qualify (else no step)
            low = min(fronts.GRAPH_BUCKETS)
            bs = max((b for b in fronts.GRAPH_BUCKETS if b <= bs), default=low if low <= len(cands) else 0)
        reqs = cands[:bs]
        if not reqs:
            return None
        if mode == "extend":  # a prefill chunk on top of what each request holds (chunked prefill)
            room = np.array([r.target - r.length for r in reqs])
            if self.bucketed:
                if room.sum() < EXTEND_TOKENS or bs > EXTEND_TOKENS:
                    return None
                new = np.ones(bs, np.int64)
                for _ in range(EXTEND_TOKENS - bs):  # spread the rest at random within each request's room
                    open_ = np.flatnonzero(new < room)
                    new[open_[int(self.rng.integers(len(open_)))]] += 1
            else:
                new = np.minimum(self.rng.integers(1, 65, bs), room)
        elif mode == "decode":
            new = np.ones(bs, np.int64)
        elif mode == "verify":
            new = np.full(bs, n)
        else:  # draft extend: the accepted tokens, already counted in each request's length
            lens = np.array([r.length for r in reqs])
            new = np.full(bs, n) if self.bucketed else np.minimum(self.rng.integers(1, n + 1, bs), lens)
        prefix = [r.length - (int(k) if mode == "draft_extend" else 0) for r, k in zip(reqs, new)]
        return reqs, prefix, [int(k) for k in new]

    def commit(self, step: fronts.Step) -> None:
        """The engine's bookkeeping after a step: verify accepts 1..N of its drafts."""
        for r, k in zip(step.reqs, step.new):  # type: ignore[attr-defined]
            if step.mode == "verify":
                r.length += int(self.rng.integers(1, k + 1))
            elif step.mode != "draft_extend":
                r.length += int(k)
        self.stats["steps"] += 1


def oracle_errors(step: fronts.Step, page_size: int, pools, outs, layers, heads) -> List[float]:
    """Per request, the worst relative error over layers against float64 attention over its own K/V."""
    hq, hkv, _ = heads
    errs, start = [], 0
    for r, p, k in zip(step.reqs, step.prefix.tolist(), step.new.tolist()):  # type: ignore[attr-defined]
        pos = np.arange(p + k)
        slots = np.array(r.pages, np.int64)[pos // page_size] * page_size + pos % page_size
        idx = torch.as_tensor(slots, device=pools[0][0].device)
        worst = 0.0
        for lay, (kb, vb), (q, _, _), out in zip(layers, pools, step.qkv, outs):
            kk = kb[idx].double().repeat_interleave(hq // hkv, 1)
            vv = vb[idx].double().repeat_interleave(hq // hkv, 1)
            s = torch.einsum("thd,nhd->htn", q[start:start + k].double(), kk) * lay.scaling
            if lay.softcap > 0:
                s = lay.softcap * torch.tanh(s / lay.softcap)
            qpos = torch.arange(p, p + k, device=s.device)[:, None]
            kpos = torch.arange(p + k, device=s.device)[None, :]
            mask = kpos <= qpos
            if lay.window >= 0:
                mask &= kpos >= qpos - lay.window
            probs = torch.softmax(s.masked_fill(~mask[None], float("-inf")), -1)
            want = torch.einsum("htn,nhd->thd", probs, vv)
            got = out[start:start + k].double()
            worst = max(worst, float((got - want).norm() / (want.norm() + 1e-12)))
        errs.append(worst)
        start += k
    return errs


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def corrupted_slots(before, after, step: fronts.Step) -> int:
    """Slots (but the reserved slot 0) whose K or V differ from ``before`` plus the step's own writes."""
    idx = torch.as_tensor(step.loc, device=after[0][0].device)
    bad = torch.zeros(after[0][0].shape[0], dtype=torch.bool, device=idx.device)
    for (k0, v0), (k1, v1), (_, k, v) in zip(before, after, step.qkv):
        for old, new, written in ((k0, k1, k), (v0, v1, v)):
            want = old.clone()
            want[idx] = written.to(want.dtype)
            bad |= (bits(want) != bits(new)).flatten(1).any(1)
    bad[0] = False
    return int(bad.sum())


class Counters:
    """XLA compiles and Mosaic kernel builds in this process (``jax.monitoring``, ``kernel_cache``)."""

    def __init__(self):
        import jax.monitoring

        from jax_attn.kernels import kernel_cache
        self.compiles = 0
        self._kernels = kernel_cache

        def on_event(event: str, *_args, **_kw) -> None:
            if event.endswith("backend_compile_duration"):
                self.compiles += 1
        jax.monitoring.register_event_duration_secs_listener(on_event)

    def now(self) -> tuple:
        return self.compiles, self._kernels.builds()

    def profile(self) -> None:
        """Record each jitted function's tracing, lowering and XLA compile seconds (``jax_log_compiles``), by
        function name, for ``report``."""
        import logging

        import jax
        self.by_name: Dict[str, list] = {}
        pattern = re.compile(r"Finished (tracing |jaxpr to MLIR module conversion |XLA compilation of )(.+?)"
                             r"(?: for jit)? in ([0-9.]+) sec")
        phases = {"tracing ": 1, "jaxpr to MLIR module conversion ": 2, "XLA compilation of ": 3}
        by_name = self.by_name

        class Handler(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                m = pattern.search(record.getMessage())
                if m:  # [compiles, trace s, lower s, compile s]
                    name = m.group(2).removeprefix("jit(").removesuffix(")")
                    entry = by_name.setdefault(name, [0, 0.0, 0.0, 0.0])
                    entry[0] += m.group(1) == "XLA compilation of "
                    entry[phases[m.group(1)]] += float(m.group(3))
        jax.config.update("jax_log_compiles", True)
        logger = logging.getLogger("jax")
        logger.setLevel(logging.WARNING)
        logger.propagate = False  # keep the compile lines off the console
        for h in list(logger.handlers):
            logger.removeHandler(h)
        logger.addHandler(Handler())
        self.timed: Dict[str, list] = {}
        from torch_bridge import launcher, mosaic_path
        # TorchKernel binds its default loader at definition: its time is TorchKernel's
        for owner, attr, label in ((launcher, "plan_kernel", "launcher.plan_kernel (Python lowering)"),
                                   (mosaic_path, "plan_kernel", "launcher.plan_kernel (Python lowering)"),
                                   (launcher, "compile_triton", "launcher.compile_triton (Triton to cubin)"),
                                   (launcher, "triton_loader", "launcher.triton_loader (compile + load)"),
                                   (launcher.TorchKernel, "__init__", "TorchKernel (compile + load)"),
                                   (mosaic_path.MosaicPath, "prebuild", "MosaicPath.prebuild (wall)")):
            setattr(owner, attr, self._timer(getattr(owner, attr), label))

    def _timer(self, fn, label: str):
        timed = self.timed

        def wrapper(*args, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                if threading.current_thread() is threading.main_thread():
                    entry = timed.setdefault(label, [0, 0.0])
                    entry[0] += 1
                    entry[1] += time.perf_counter() - t0
        return wrapper

    def report(self, top: int = 25) -> None:
        """The jitted functions so far by total seconds (trace + lower + compile), and kernel builds by name."""
        rows = sorted(self.by_name.items(), key=lambda kv: -sum(kv[1][1:]))
        total = [sum(e[i] for e in self.by_name.values()) for i in range(4)]
        print(f"XLA compiles: {total[0]} (tracing {total[1]:.1f} s, lowering {total[2]:.1f} s, "
              f"compiling {total[3]:.1f} s)")
        for name, (n, tr, lo, co) in rows[:top]:
            print(f"  {tr + lo + co:7.2f} s ({tr:6.2f} + {lo:6.2f} + {co:6.2f}) {n:4d} compiles of {name}")
        for label, (n, t) in sorted(self.timed.items(), key=lambda kv: -kv[1][1]):
            print(f"  {t:7.2f} s {n:5d} calls of {label} (main thread)")
        kernels: Dict[str, int] = {}  # since the process started
        for (event, name), n in self._kernels.stats().items():
            kernels[f"{event} {name}"] = kernels.get(f"{event} {name}", 0) + n
        for name, n in sorted(kernels.items(), key=lambda kv: -kv[1]):
            print(f"  kernel {name}: {n}")
        self.by_name.clear()  # the next report counts from here
        self.timed.clear()


def device_memory(device) -> tuple:
    """(torch allocated, JAX bytes in use) on the device, in bytes (0 where it does not say)."""
    import jax
    if torch.device(device).type != "cuda":
        return 0, 0
    stats = jax.local_devices()[0].memory_stats() or {}
    return torch.cuda.memory_allocated(device), int(stats.get("bytes_in_use", 0))


def run(engines, steps: int, warmup: int, check_every: int, tol: float, counters: Counters, streams) -> list:
    """Step the engines in turn (each on its stream); returns a report per engine."""
    reports = [dict(mem=[]) for _ in engines]
    base, warm_s = None, 0.0
    t0 = time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup:
            base, warm_s, t0 = counters.now(), time.perf_counter() - t0, time.perf_counter()
            for e in engines:
                e.front.warm_traces = e.front.compiles()
        for e, rep, stream in zip(engines, reports, streams):
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                one_step(e, check_every, tol, i, warm=i < warmup)
            if i >= warmup and (i - warmup) % 100 == 0:
                rep["mem"].append(device_memory(e.device))
    wall = time.perf_counter() - t0
    builds = tuple(b - a for a, b in zip(base, counters.now())) if base else (0, 0)
    for e, rep in zip(engines, reports):
        rep.update(e.stats, wall=wall, warm_s=warm_s, at_warm=base, xla_compiles=builds[0], kernel_builds=builds[1],
                   traces=e.front.compiles() - getattr(e.front, "warm_traces", 0))
    return reports


PROFILE = False
STEP_SECONDS: Dict[tuple, list] = {}  # (mode, warm-up?) -> [steps, seconds] (``--profile``)


def one_step(e: Engine, check_every: int, tol: float, i: int, warm: bool = False) -> None:
    t0 = time.perf_counter()
    step = e.next_step()
    if step is None:
        return
    _one_step(e, step, check_every, tol, i)
    if not PROFILE:
        return
    if torch.device(e.device).type == "cuda":
        torch.cuda.synchronize(e.device)
    entry = STEP_SECONDS.setdefault((step.mode, warm), [0, 0.0])
    entry[0] += 1
    entry[1] += time.perf_counter() - t0


def _one_step(e: Engine, step, check_every: int, tol: float, i: int) -> None:
    before = [(k.clone(), v.clone()) for k, v in e.front.pools()]
    outs = e.front.run(step)
    after = e.front.pools()
    bad = corrupted_slots(before, after, step)
    e.stats["corrupted"] += bad
    traced = any(r.rid in e.traced for r in step.reqs)  # type: ignore[attr-defined]
    if i % check_every == 0 or traced or bad:
        errs = oracle_errors(step, e.page_size, after, outs, e.layers, e.heads)
        e.stats["checked"] += 1
        e.stats["worst"] = max(e.stats["worst"], max(errs))
        e.stats["mismatches"] += sum(x > tol or not np.isfinite(x) for x in errs)
    e.commit(step)


LAYERS = (fronts.Layer(scaling=0.083), fronts.Layer(scaling=0.11, window=40, softcap=30.0))


def make_engine(front_name: str, page_size: int, args, seed: int, layers=LAYERS) -> Engine:
    dtype = getattr(torch, args.dtype)
    heads = (args.hq, args.hkv, args.head_dim)
    num_pages = args.pool_tokens // page_size
    front = fronts.FRONTS[front_name](layers, heads, page_size, num_pages * page_size, args.max_reqs,
                                      args.max_ctx, args.num_draft, dtype, args.device, graphs=args.graphs)
    bucketed = front_name == "bridge" and not args.ragged_bridge
    if front_name == "bridge" and args.prebuild:  # one build round for the kernels of the steps to come
        front.prebuild(EXTEND_TOKENS if bucketed else 0)
    front.capture()
    return Engine(front, page_size=page_size, num_pages=num_pages, max_reqs=args.max_reqs, max_ctx=args.max_ctx,
                  heads=heads, layers=layers, num_draft=args.num_draft, dtype=dtype, device=args.device, seed=seed,
                  bucketed=bucketed)


def run_jobs(argv, configs, per: int, jobs: int) -> int:
    """Each configuration in its own process (``jobs`` at once); prints their lines; non-zero if any failed."""
    import subprocess
    import tempfile

    drop = {"--jobs", "--fronts", "--page-sizes", "--steps"}
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        name = a.split("=")[0]
        if name in drop:
            skip = "=" not in a
            continue
        rest.append(a)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")  # processes share the GPU
    pending = [[sys.executable, os.path.abspath(__file__), "--fronts", f, "--page-sizes", str(p), "--steps", str(per),
                *rest] for f, p in configs]
    running: list = []
    rc = 0
    while pending or running:
        while pending and len(running) < jobs:
            log = tempfile.TemporaryFile("w+")  # a file, not a pipe: a chatty process never blocks on it
            running.append((subprocess.Popen(pending.pop(0), env=env, stdout=log, stderr=subprocess.STDOUT), log))
        proc, log = running.pop(0)
        rc = proc.wait() or rc
        log.seek(0)
        print(log.read(), end="", flush=True)
        log.close()
    return rc


def main(argv=None) -> int:
    global EXTEND_TOKENS, PROFILE
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20000, help="steps after warm-up, split over the engines")
    ap.add_argument("--warmup", type=int, default=None, help="default: a fifth of each engine's steps, at least 300")
    ap.add_argument("--fronts", default="bridge,jax")
    ap.add_argument("--page-sizes", default="1,16")
    ap.add_argument("--pair", action="store_true", help="a draft engine beside each bridge engine, 2 streams")
    ap.add_argument("--check-every", type=int, default=25)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hq", type=int, default=8)
    ap.add_argument("--hkv", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--max-reqs", type=int, default=24)
    ap.add_argument("--max-ctx", type=int, default=512)
    ap.add_argument("--pool-tokens", type=int, default=8192)
    ap.add_argument("--num-draft", type=int, default=4)
    ap.add_argument("--no-graphs", dest="graphs", action="store_false")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--buckets", default="1,2,4,8,16", help="graph / StepRunner batch buckets")
    ap.add_argument("--extend-tokens", type=int, default=64, help="tokens of a bucketed extend batch")
    ap.add_argument("--ragged-bridge", action="store_true",
                    help="the bridge gets the JAX front's ragged extends and draft extends too (its eager steps "
                         "compile per shape class: more classes, a longer cold warm-up)")
    ap.add_argument("--no-prebuild", dest="prebuild", action="store_false",
                    help="the bridge builds each kernel at its first step (a build round per new shape class), "
                         "not all at start-up (``FlashAttentionBackend.prebuild``)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="run the (front end, page size) configurations in this many processes at once, sharing "
                         "the GPU (each its own warm-up; the steps per configuration stay the same)")
    ap.add_argument("--profile", action="store_true",
                    help="print the XLA compiles by function (seconds, count), kernel builds by kernel and step "
                         "seconds by mode, in warm-up and after")
    ap.add_argument("--smoke", action="store_true",
                    help="a few CPU-sized steps per engine; compiles after warm-up are reported, not failed")
    args = ap.parse_args(argv)
    if args.smoke:
        args.steps, args.warmup, args.check_every = 2 * len(args.fronts.split(",")), 2, 1
        args.page_sizes, args.dtype, args.hq, args.hkv, args.head_dim = "4", "float32", 4, 2, 16
        args.max_reqs, args.max_ctx, args.pool_tokens, args.buckets, args.extend_tokens = 3, 48, 256, "1,2", 8
        fronts.EXTEND_TOKEN_BUCKETS = (128,)  # one extend bucket (2 requests x <= 64 tokens): fewer captures
    EXTEND_TOKENS = args.extend_tokens
    fronts.GRAPH_BUCKETS = tuple(int(b) for b in args.buckets.split(","))
    configs = [(f, int(p)) for f in args.fronts.split(",") for p in args.page_sizes.split(",")]
    per = max(args.steps // len(configs), 1)
    if args.jobs > 1 and len(configs) > 1:  # the child processes count and profile, this one only waits
        return run_jobs(argv if argv is not None else sys.argv[1:], configs, per, args.jobs)
    counters = Counters()
    if args.profile:
        PROFILE = True
        counters.profile()
    tol = 2e-2 if args.dtype == "bfloat16" else 1e-3
    warmup = args.warmup if args.warmup is not None else max(per // 5, 300)
    ok = True
    for n, (front_name, page_size) in enumerate(configs):
        t0, cold = time.perf_counter(), counters.now()
        engines = [make_engine(front_name, page_size, args, args.seed + n)]
        streams = [None]
        if args.pair and front_name == "bridge" and args.device.startswith("cuda"):
            engines.append(make_engine(front_name, page_size, args, args.seed + 100 + n, layers=LAYERS[:1]))
            streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        setup_s = time.perf_counter() - t0
        for k, (e, rep) in enumerate(zip(engines, run(engines, per, warmup, args.check_every, tol, counters,
                                                      streams))):
            mem = rep.pop("mem")
            growth = [(b[0] - mem[0][0], b[1] - mem[0][1]) for b in mem] if mem else [(0, 0)]
            grow_mib = max(max(t, j) for t, j in growth) / 2**20
            # after warm-up, any retrace of a step function, kernel build or XLA compile (glue ops included)
            # fails the run
            warm = args.smoke or rep["kernel_builds"] == rep["traces"] == rep["xla_compiles"] == 0
            good = rep["mismatches"] == 0 and rep["corrupted"] == 0 and rep["checked"] > 0 and warm
            ok &= good
            warm_counts = [b - a for a, b in zip(cold, rep.pop("at_warm") or cold)]  # set-up + warm-up
            print(f"{front_name}{'/draft' if k else ''} page {page_size}: {rep['steps']} steps "
                  f"({warmup} warm-up) in {rep['wall']:.1f} s (set-up {setup_s:.1f} s, warm-up {rep['warm_s']:.1f} s, "
                  f"{warm_counts[0]} XLA compiles and {warm_counts[1]} kernel builds before the timed steps), "
                  f"checked {rep['checked']}, mismatches "
                  f"{rep['mismatches']} (worst rel err {rep['worst']:.2e}), corrupted slots {rep['corrupted']}, "
                  f"finished {rep['finished']} preempted {rep['preempted']}, after warm-up: XLA compiles "
                  f"{rep['xla_compiles']} kernel builds {rep['kernel_builds']} traces {rep['traces']}, "
                  f"memory growth {grow_mib:.2f} MiB: {'OK' if good else 'FAILED'}", flush=True)
        if args.profile:
            counters.report()
            for (mode, warm_step), (n, t) in sorted(STEP_SECONDS.items(), key=lambda kv: -kv[1][1]):
                print(f"  steps {'warm-up' if warm_step else 'timed':7s} {mode:12s} {n:6d} in {t:7.2f} s")
            STEP_SECONDS.clear()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
