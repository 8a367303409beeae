"""Tuning sweeps of our kernels' knobs, one sub-sweep per kernel family.

mosaic: Mosaic GPU kernel variants against cuDNN SDPA (contiguous KV), in one process, interleaved
  rounds. Points (32 query / 8 kv heads, d 128, bf16 paged cache with shuffled pages): causal prefill
  B=4 S=4096 at page 16 and 64 (TFLOP/s, ``4 * B * Hq * S^2 * D / 2``) and decode 64 x 4096, 1 x 32768,
  8 x 8192 and 256 x 1024 at page 16 (TB/s of KV, ``2 * B * ctx * Hkv * D * 2``), and more
  (``MOSAIC_POINTS``). Variants are ``MosaicConfig`` settings by name (``MOSAIC_VARIANTS``). Every
  output is checked against SDPA's before it is timed; time = GPU time per call from a CUPTI trace
  (``common.time_device``), each peer timed ``--rounds`` times round-robin, median kept.
  Flags: ``--points prefill_p16,...``, ``--variants default,late_k,...``, ``--rounds N`` (3),
  ``--calls N`` (10), ``--kernels`` (print each peer's kernels of one call).

triton-decode: decode knob sweep of the Triton-lowered paged kernel (split-KV tiles, kv-head packing,
  splits, merge). Points (32 query / 8 kv heads, d 128, bf16, shuffled pages, unused page 0 filled
  with NaN): 1 x 32768 and 8 x 8192 (split-KV launches) and 64 x 4096 (one program per sequence and
  kv head, no split), each at page size 16 and 1, and 256 x 1024 at page 1. TB/s counts the KV bytes
  2 * B * ctx * Hkv * D * 2.
  Timing: GPU time per call from a CUPTI trace of back-to-back calls, the method of
  ``common.time_device``; the same trace splits that time into the attention kernel, the split merge
  and the rest (schedule glue). Host wall clock is not used: at 60-100 us of GPU work a JAX call is
  bound by dispatch. Order, to stay within about 4 minutes on an H200: every split config runs at
  1 x 32768 and 8 x 8192 with page 16, the decode configs at 64 x 4096 with page 16; then page 1: the
  default and the ``--top`` best page-16 split configs of each split point, and every decode config.
  No config starts after ``--budget-s``. Each (config, point) output is checked against the float32
  reference before it is timed; a wrong output is reported and not timed. Results also go to
  $OUT/tune_triton_decode.json.
  The model behind the list: a memory-bound kernel reaches bandwidth BW only with about
  BW x latency bytes in flight, 4.8 TB/s x ~1 us / 132 SMs ~ 36 KB per SM. The default split tile
  (block_k 128, 2 stages; K and V are 64 KB a step, 128 KB of shared memory) fits one program per
  SM with at most one step ahead. Column ``kb/SM`` estimates resident programs (shared memory, warps
  and grid size) x (stages - 1) x step bytes. If the attention kernel stays far below bandwidth with
  64 KB nominally in flight, the loads are not overlapped (a step's K/V addresses wait on that
  step's page-table read, which ``prefetch_pages`` removes), or more resident programs (smaller
  steps with more splits, or packed kv heads) are what add bytes in flight.
  Flags: ``--full``, ``--top N`` (4), ``--points 1x32768x16,...``, ``--only NAME,...``, ``--calls N``
  (20), ``--budget-s S`` (200), ``--tiny`` (CPU: small contexts, 4 configs, interpreter).

Wall-clock sweeps of ``KernelConfig`` tiles at fixed points: ``bench_attention.py --mode wall --sweep``.

  python benchmarks/tune.py mosaic [--points prefill_p16,decode_256x1024] [--variants default,late_k] [--kernels]
  python benchmarks/tune.py triton-decode [--full] [--top 4] [--points 1x32768x16,8x8192x1] [--only NAME,...]
  JAX_PLATFORMS=cpu python benchmarks/tune.py --smoke   # CPU: both sub-sweeps at toy points
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and torch share the GPU
_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (os.path.dirname(_HERE), _HERE):
    if _p not in sys.path:
        sys.path.insert(0, _p)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import common  # noqa: E402
import peers  # noqa: E402
from common import HKV, HQ, D  # noqa: E402
from jax_attn.kernels.config import HOPPER_NUM_SMS, KernelConfig, kv_heads_per_program  # noqa: E402
from jax_attn.kernels.mosaic_paged import MosaicConfig  # noqa: E402
from jax_attn.kernels.schedule import plan_schedule  # noqa: E402
from jax_attn.kernels.triton_paged import paged_attention  # noqa: E402
from jax_attn.reference import paged_attention_reference  # noqa: E402

TOLERANCE = 2e-2  # relative L2 error against the reference (bf16 lands near 4e-3)


# ============================================================================= mosaic
MOSAIC_POINTS = {  # name: (kind, batch, q_len, kv_len, page_size[, kv heads, default 8])
    "prefill_p16": ("prefill", 4, 4096, 4096, 16),
    "prefill_p64": ("prefill", 4, 4096, 4096, 64),
    "decode_64x4096": ("decode", 64, 1, 4096, 16),
    "decode_1x32768": ("decode", 1, 1, 32768, 16),
    "decode_8x8192": ("decode", 8, 1, 8192, 16),
    "decode_256x1024": ("decode", 256, 1, 1024, 16),
    # per-CTA fixed costs: the same grids with half / double the work per CTA (single-wave split decode)
    # or half the CTAs for the same work per CTA (prefill)
    "decode_1x16384": ("decode", 1, 1, 16384, 16),
    "decode_1x65536": ("decode", 1, 1, 65536, 16),
    "prefill_p16_b2s8192": ("prefill", 2, 8192, 8192, 16),
    # the bytes of decode 1 x 32768 with fewer kv heads per page row (1: each page one contiguous run)
    "decode_8x32768_kv1": ("decode", 8, 1, 32768, 16, 1),
    "decode_2x32768_kv4": ("decode", 2, 1, 32768, 16, 4),
    "decode_1x32768_p64": ("decode", 1, 1, 32768, 64),  # a quarter of the TMA copies, four times the size
    # the small decode buckets of a model step (bench_jax_step.py --baseline): under one wave of CTAs unsplit
    "decode_8x4096": ("decode", 8, 1, 4096, 16),
    "decode_4x2048": ("decode", 4, 1, 2048, 16),
    "decode_16x2048": ("decode", 16, 1, 2048, 16),
    "decode_1x4096": ("decode", 1, 1, 4096, 16),
    "decode_1x512": ("decode", 1, 1, 512, 16),
    "decode_8x512": ("decode", 8, 1, 512, 16),
    "decode_64x512": ("decode", 64, 1, 512, 16),
}
MOSAIC_VARIANTS = {
    "default": MosaicConfig(),  # early_k_wait for one-head rows (prefill) only
    "late_k": MosaicConfig(early_k_wait=False),  # every step waits for its key block at its start
    "paired": MosaicConfig(solo=False),  # packed decode keeps both compute warpgroups
    "decode128": MosaicConfig(decode_block_kv=None, decode_stages=None),  # unsplit decode at block_kv 128 x 2
    "ring64": MosaicConfig(block_kv=64, stages=4, split_decode_stages=4),  # every call with 64-key x 4-stage rings
    "fill2": MosaicConfig(split_below_fill=2),  # split when the unsplit CTAs fill at most half of the GPU
    "solo64x5": MosaicConfig(solo_block_kv=64, solo_stages=5, split_decode_stages=5),  # 64-key x 5-stage rings
    "one_wg_copies": MosaicConfig(spread_copies=False),  # every producer warp runs every copy's issue code
    "land_wait": MosaicConfig(store_read_wait=False),  # the epilogue waits for its stores to land
    "solo3": MosaicConfig(solo_stages=3, split_decode_block_kv=128, split_decode_stages=3),  # 3 x 128-key rings
    "solo64x6": MosaicConfig(solo_block_kv=64, solo_stages=6, split_decode_stages=6),  # 64-key x 6-stage rings
    "split128x2": MosaicConfig(split_decode_block_kv=128, split_decode_stages=2),  # split decode: the 128-key ring
    "solo64x2": MosaicConfig(solo_block_kv=64, solo_stages=2),  # unsplit solo calls: a 64-key x 2-stage ring too
    "fill1": MosaicConfig(split_below_fill=1),  # split whenever the unsplit CTAs fit one wave
    "fill1_kv256": MosaicConfig(split_below_fill=1, min_kv_per_split=256),  # ... into splits of 256 keys or more
    "kv128": MosaicConfig(min_kv_per_split=128),  # splits of 128 keys or more
}

def mosaic_amount(kind, p) -> float:
    if kind == "prefill":
        return 4 * p.batch * p.num_q_heads * p.kv_len**2 * p.head_dim / 2
    return 2 * p.batch * p.kv_len * p.num_kv_heads * p.head_dim * 2


def print_kernels(name: str, run, sync) -> None:
    """The GPU activities of one call of ``run`` (name, us), from a CUPTI trace."""
    acts = common.device_activities(run.call, sync, calls=1)
    print(f"{name}: {run.name}: {len(acts)} kernels: " + ", ".join(f"{n[:40]} {d:.1f}" for _, d, n in acts), flush=True)


def mosaic_point(name: str, variants: list[str], rounds: int, calls: int, kernels: bool = False,
                 device: str = "cuda", points=None, heads=(32, 128),
                 triton: bool = False) -> list[tuple[str, str, float, float]]:
    """(point, peer, value, rel. error) rows of one point (``kernels``: also each peer's kernel list);
    ``points`` (default ``MOSAIC_POINTS``) names it, ``heads`` = (query heads, head dim), ``triton``: decode
    points also time the Triton-lowered kernel."""
    kind, b, q_len, kv_len, ps, *kv_heads = (points or MOSAIC_POINTS)[name]
    p = peers.make_problem(b, q_len, kv_len, ps, device=device, num_q_heads=heads[0],
                           num_kv_heads=(kv_heads or [8])[0], head_dim=heads[1])
    runs = [peers.sdpa(p)] + [peers.ours_mosaic(p, MOSAIC_VARIANTS[v], name=f"mosaic[{v}]") for v in variants]
    if kind == "decode" and triton:
        runs.append(peers.ours(p))  # the Triton-lowered kernel, the other choice of auto's decode rule
    if kind == "prefill":
        runs.append(peers.jax_mosaic(p))
    ref = runs[0].to_tokens(runs[0].call()).clone()
    timed, rows = [], []
    for run in runs:
        err = common.rel_err(run.to_tokens(run.call()), ref)
        sync = jax.block_until_ready if run.framework == "jax" else (lambda out: None)
        if err > TOLERANCE and run is not runs[0]:
            rows.append((name, run.name, float("nan"), err))
            print(f"{name}: {run.name} WRONG (rel. err. {err:.1e}): not timed", flush=True)
            continue
        timed.append((run, sync, err, []))
        if kernels:
            print_kernels(name, run, sync)
    for _ in range(rounds):
        for run, sync, _, ts in timed:
            t = common.time_device(run.call, sync, calls=calls)
            if t is None and not common.cuda_available():  # CPU smoke run: no CUPTI, host wall clock
                t = common.time_host(run.call, calls, 1, sync)
            ts.append(t.time_us)
    work = mosaic_amount(kind, p)
    for run, _, err, ts in timed:
        us = statistics.median(ts)
        rows.append((name, run.name, work / (us * 1e-6) / 1e12, err))
        print(f"{name}: {run.name:28s} {us:9.1f} us  {rows[-1][2]:7.3f} {'TFLOP/s' if kind == 'prefill' else 'TB/s'}"
              f"  (rounds {', '.join(f'{t:.1f}' for t in ts)})  err {err:.1e}", flush=True)
    del p, runs, timed
    torch.cuda.empty_cache()
    return rows

def main_mosaic(a) -> int:
    on_gpu = common.cuda_available()
    variants = [v for v in a.variants.split(",") if v]
    rows = []
    for name in (n for n in a.points.split(",") if n):
        rows += mosaic_point(name, variants, a.rounds, a.calls, a.kernels, device="cuda" if on_gpu else "cpu",
                             triton=a.triton, **(dict(points=MOSAIC_SMOKE_POINTS, heads=(8, 64)) if a.smoke else {}))
    device = torch.cuda.get_device_name() if on_gpu else "cpu (smoke run: numbers meaningless)"
    print(f"\ndevice: {device}\n\n| point | peer | value | / SDPA |\n|---|---|---|---|")
    base = {r[0]: r[2] for r in rows if r[1].startswith("sdpa")}
    for point, peer, value, _ in rows:
        print(f"| {point} | {peer} | {value:.3g} | {value / base[point]:.3f} |")
    return 0


MOSAIC_SMOKE_POINTS = {"decode_1x32": ("decode", 1, 1, 32, 16, 2)}  # 8 / 2 heads, d 64: interpreted on a CPU


# ============================================================================= triton-decode
SMEM_PER_SM = 227 * 1024  # Hopper, bytes a resident program set may use
WARPS_PER_SM = 64

# (name, batch, ctx, page size, group); the page-1 twin of a split point uses its page-16 ranking.
DECODE_POINTS = [("1x32768x16", 1, 32768, 16, "split"), ("8x8192x16", 8, 8192, 16, "split"),
          ("64x4096x16", 64, 4096, 16, "decode"), ("1x32768x1", 1, 32768, 1, "split"),
          ("8x8192x1", 8, 8192, 1, "split"), ("64x4096x1", 64, 4096, 1, "decode"),
          ("256x1024x1", 256, 1024, 1, "decode")]


def _split(bk: int, warps: int, stages: int, **kw) -> KernelConfig:
    # (the forced tile over fp8 KV too)
    return KernelConfig(split_block_k=bk, split_num_warps=warps, split_num_stages=stages, fp8_split_tile=None, **kw)


def _decode(bk: int, warps: int, stages: int, **kw) -> KernelConfig:
    # (the forced tile everywhere: no many-program tile at page 1, over fp8 KV too)
    return KernelConfig(decode_block_k=bk, decode_num_warps=warps, decode_num_stages=stages, many_decode_tile=None,
                        fp8_decode_tile=None, **kw)


def _fp8_variants(field: str, tiles) -> list:
    """fp8 KV variants of one tile knob (``fp8_decode_tile`` / ``fp8_split_tile``): none (the 2-byte tile, f16 dots),
    the tile before f16 dots as well, and each of ``tiles`` (named ``fp8 BK/W/S``); bf16 KV ignores them."""
    return [("no fp8 tile", KernelConfig(**{field: None})),
            ("fp8 before", KernelConfig(**{field: None}, fp8_f16_dots=False)),
            *((f"fp8 {'/'.join(map(str, t))}", KernelConfig(**{field: t})) for t in tiles)]


SPLIT_CONFIGS = [
    ("default", KernelConfig()),
    ("w4", KernelConfig(split_waves=4)),
    ("ms4", KernelConfig(max_splits=4)),
    ("ms8", KernelConfig(max_splits=8)),
    ("ms16", KernelConfig(max_splits=16)),
    ("ms32", KernelConfig(max_splits=32)),
    ("ms64", KernelConfig(max_splits=64)),
    ("ms64 merge4", KernelConfig(max_splits=64, merge_block_rows=4)),
    ("prefetch", KernelConfig(prefetch_pages=True)),
    ("t128/4/3", _split(128, 4, 3)),
    ("t128/8/2", _split(128, 8, 2)),
    ("t256/8/2", _split(256, 8, 2)),
    ("t256/4/2", _split(256, 4, 2)),
    *_fp8_variants("fp8_split_tile", [(64, 4, 4), (128, 4, 4), (64, 2, 3)]),
    ("t64/4/2 ms64 w8", _split(64, 4, 2, max_splits=64, split_waves=8)),
    ("t64/4/3 ms64 w8", _split(64, 4, 3, max_splits=64, split_waves=8)),
    ("t64/4/4 ms64", _split(64, 4, 4, max_splits=64)),
    ("t32/4/4 ms64 w8", _split(32, 4, 4, max_splits=64, split_waves=8)),
    ("t64/4/3 ms64 w8 prefetch", _split(64, 4, 3, max_splits=64, split_waves=8, prefetch_pages=True)),
    ("pack2 t64/4/3 ms64", _split(64, 4, 3, split_kv_heads=2, max_splits=64)),
    ("pack4 t32/4/3 ms64", _split(32, 4, 3, split_kv_heads=4, max_splits=64)),
    ("pack4 t32/8/3 ms64", _split(32, 8, 3, split_kv_heads=4, max_splits=64)),
    ("pack4 t32/4/4 ms64 prefetch", _split(32, 4, 4, split_kv_heads=4, max_splits=64, prefetch_pages=True)),
    ("pack8 t16/4/3 ms128 kv256", _split(16, 4, 3, split_kv_heads=8, max_splits=128, min_kv_per_split=256)),
]
DECODE_CONFIGS = [
    ("default", KernelConfig()),
    ("d64/4/2", _decode(64, 4, 2)),
    ("d64/4/3", _decode(64, 4, 3)),
    ("d128/4/3", _decode(128, 4, 3)),
    ("d128/8/2", _decode(128, 8, 2)),
    ("d64/4/4", _decode(64, 4, 4)),
    ("d128/4/4", _decode(128, 4, 4)),
    ("d256/8/2", _decode(256, 8, 2)),
    ("d256/8/3", _decode(256, 8, 3)),
    ("d256/4/2", _decode(256, 4, 2)),
    *_fp8_variants("fp8_decode_tile", [(128, 4, 3), (32, 2, 4), (64, 2, 3), (64, 2, 4), (64, 1, 4), (128, 2, 3)]),
    ("prefetch", KernelConfig(prefetch_pages=True)),
]


@dataclasses.dataclass
class Result:
    point: str
    config: str
    status: str = "ok"  # ok | WRONG | FAILED | skipped
    total_us: float = math.nan
    tbps: float = math.nan
    attn_us: float = math.nan
    merge_us: float = math.nan
    other_us: float = math.nan
    rel_err: float = math.nan
    splits: int = 0  # static bound S
    programs: int = 0  # non-empty attention programs
    tile: tuple = ()  # (block_k, warps, stages) of the launch
    pack: int = 1  # kv heads per program
    kb_per_sm: float = math.nan  # estimated bytes in flight per SM, KiB
    compile_s: float = math.nan
    note: str = ""


# ----------------------------------------------------------------------------- timing
def _part(name: str) -> str:
    if "paged_attention" in name:
        return "attn"
    return "merge" if "merge" in name else "other"


def profile_call(fn, calls: int):
    """(total, {attn, merge, other}) median GPU us per call from one CUPTI trace, or None without CUDA."""
    if not common.cuda_available():
        return None
    acts = [(ts, dur, _part(name)) for ts, dur, name in common.device_activities(fn, jax.block_until_ready, calls)]
    per = len(acts) // calls
    if per == 0 or len(acts) % calls:  # calls not separable: means
        parts = {k: sum(d for _, d, p in acts if p == k) / calls for k in ("attn", "merge", "other")}
        return sum(parts.values()), parts
    groups = [acts[i * per:(i + 1) * per] for i in range(calls)]
    total = statistics.median(sum(d for _, d, _ in g) for g in groups)
    parts = {k: statistics.median(sum(d for _, d, p in g if p == k) for g in groups)
             for k in ("attn", "merge", "other")}
    return total, parts


def host_time_us(fn, calls: int) -> float:
    """CPU smoke runs only: wall clock per call."""
    jax.block_until_ready(fn())
    t0 = time.perf_counter()
    for _ in range(calls):
        out = fn()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / calls * 1e6


# ----------------------------------------------------------------------------- one point
_reference = jax.jit(paged_attention_reference, static_argnames=("page_size", "causal"))


FP8_SCALES = (0.37, 0.61)  # k / v descales of --kv-dtype fp8 (not 1: a dropped descale shows in the error)


def make_point(batch: int, ctx: int, page_size: int, kv_dtype: str = "bf16"):
    """(q, k, v, md, ref f32[T, Hq, D], kv bytes, descales); page 0 (owned by no sequence) holds NaN (bf16) or
    e4m3's NaN (fp8: K and V stored as ``x / scale`` in float8_e4m3fn, descaled by the kernel)."""
    q, k, v, md = common.triton_problem(batch, ctx, 1, page_size)
    k, v = k.at[0].set(jnp.nan), v.at[0].set(jnp.nan)
    descales, itemsize = {}, 2
    if kv_dtype == "fp8":
        ks, vs = FP8_SCALES
        k, v = ((x.astype(jnp.float32) / s).astype(jnp.float8_e4m3fn) for x, s in ((k, ks), (v, vs)))
        descales, itemsize = dict(k_descale=jnp.float32(ks), v_descale=jnp.float32(vs)), 1
        kr, vr = ((x.astype(jnp.float32) * s).astype(jnp.bfloat16) for x, s in ((k, ks), (v, vs)))
    else:
        kr, vr = k, v
    ref = _reference(q, kr, vr, md.cache_seqlens, md.cu_seqlens_q, md.page_table, page_size=page_size, causal=True)
    ref = jax.block_until_ready(ref.astype(jnp.float32))
    return q, k, v, md, ref, 2 * batch * ctx * HKV * D * itemsize, descales


@jax.jit
def _rel_err(out, ref):
    out = out.astype(jnp.float32)
    err = jnp.linalg.norm(out - ref) / jnp.maximum(jnp.linalg.norm(ref), 1e-30)
    return jnp.where(jnp.all(jnp.isfinite(out)), err, jnp.inf)


def launch_shape(cfg: KernelConfig, sched, num_sms: int, itemsize: int = 2, *, num_tokens: int = 0,
                 page_size: int = 0):
    """(tile, pack, programs, estimated KiB in flight per SM) of the attention launch (its tile as
    ``triton_paged.kernel_statics`` picks it for ``num_tokens`` decode tokens over pages of ``page_size``)."""
    split = sched.max_splits > 1
    pack = kv_heads_per_program(cfg, HKV, decode=True, split=split)
    tile = cfg.tile_params(decode=True, split=split, programs=num_tokens * HKV, page_size=page_size, head_dim=D,
                           kv_itemsize=itemsize, kv_pack=pack)
    programs = int(sched.num_tiles) * (HKV // pack)
    bk, warps, stages = tile
    step = bk * pack * 2 * D * itemsize  # K and V rows of one loop step
    fit = min(SMEM_PER_SM // (max(stages, 1) * step), WARPS_PER_SM // warps)
    resident = min(fit, -(-programs // num_sms))
    return tile, pack, programs, resident * max(stages - 1, 1) * step / 1024


def run_config(point: str, name: str, cfg: KernelConfig, data, calls: int, num_sms: int) -> Result:
    """Plans, compiles, checks against the reference, then times one config at one point."""
    q, k, v, md, ref, kv_bytes, descales = data
    res = Result(point, name)
    try:
        sched = jax.block_until_ready(jax.jit(functools.partial(
            plan_schedule, num_q_heads=HQ, num_kv_heads=HKV, config=cfg))(md))
        res.splits = sched.max_splits
        res.tile, res.pack, res.programs, res.kb_per_sm = launch_shape(
            cfg, sched, num_sms, k.dtype.itemsize, num_tokens=q.shape[0], page_size=md.page_size)
        md_s = dataclasses.replace(md, schedule=sched)
        fn = jax.jit(functools.partial(paged_attention, causal=True, config=cfg, **descales))
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(q, k, v, md_s))
        res.compile_s = time.perf_counter() - t0
        res.rel_err = float(_rel_err(out, ref))
        if not res.rel_err <= TOLERANCE:
            res.status = "WRONG"
            return res
        timed = profile_call(lambda: fn(q, k, v, md_s), calls)
        if timed is None or not timed[0] > 0:
            why = "no CUDA" if timed is None else "no kernels in the CUPTI trace"
            res.total_us, res.note = host_time_us(lambda: fn(q, k, v, md_s), calls), f"host wall clock ({why})"
        else:
            res.total_us, parts = timed
            res.attn_us, res.merge_us, res.other_us = parts["attn"], parts["merge"], parts["other"]
        res.tbps = kv_bytes / (res.total_us * 1e-6) / 1e12
    except Exception as e:  # a config that does not compile (e.g. out of shared memory) must not stop the sweep
        res.status, res.note = "FAILED", f"{type(e).__name__}: {str(e).splitlines()[0][:150] if str(e) else ''}"
    return res


# ----------------------------------------------------------------------------- sweep
TINY_POINTS = [("1x2048x16", 1, 2048, 16, "split"), ("1x2048x1", 1, 2048, 1, "split"),
               ("32x256x16", 32, 256, 16, "decode")]
TINY_CONFIGS = ("default", "pack4 t32/4/3 ms64", "t64/4/3 ms64 w8 prefetch", "prefetch")


def configs_for(point, args, results: list[Result], suffix: str = ""):
    """The (name, config) list to run at ``point``: page-1 split twins get the page-16 leaders (of the same KV
    dtype: ``suffix``)."""
    name, batch, ctx, ps, group = point
    pool = SPLIT_CONFIGS if group == "split" else DECODE_CONFIGS
    wanted = [s for s in args.only.split(",") if s] or (TINY_CONFIGS if args.tiny else None)
    pool = [(n, c) for n, c in pool if wanted is None or n in wanted]
    if args.full or group != "split" or ps != 1:
        return pool
    twin = [r for r in results if r.point == f"{batch}x{ctx}x16{suffix}" and r.status == "ok"]
    if not twin:
        return pool
    lead = [r.config for r in sorted(twin, key=lambda r: -r.tbps)[: args.top]]
    return [(n, c) for n, c in pool if n == "default" or n in lead]


def fmt_row(r: Result, base: float) -> str:
    f = common.fmt
    tile = "/".join(str(x) for x in r.tile) if r.tile else "-"
    return (f"{r.point:<11} {r.config:<28} {r.splits:>4} {r.programs:>5} {tile:>9} {r.pack:>2} "
            f"{f(r.kb_per_sm, '6.0f')} {f(r.total_us, '8.1f')} {f(r.tbps, '6.2f')} {f(r.tbps / base, '5.2f')} "
            f"{f(r.attn_us, '7.1f')} {f(r.merge_us, '6.1f')} {f(r.other_us, '6.1f')} {f(r.rel_err, '7.1e')} "
            f"{f(r.compile_s, '5.1f')}  {r.status}" + (f" ({r.note})" if r.note else ""))


HEADER = (f"{'point':<11} {'config':<28} {'S':>4} {'progs':>5} {'tile':>9} {'C':>2} {'kb/SM':>6} "
          f"{'us':>8} {'TB/s':>6} {'xdef':>5} {'attn':>7} {'merge':>6} {'other':>6} {'relerr':>7} {'comp':>5}  status")


def print_table(results: list[Result]) -> None:
    print(HEADER)
    print("-" * len(HEADER))
    for point in dict.fromkeys(r.point for r in results):
        rows = [r for r in results if r.point == point]
        base = next((r.tbps for r in rows if r.config == "default" and r.status == "ok"), math.nan)
        for r in sorted(rows, key=lambda r: -r.tbps if r.status == "ok" else math.inf):
            print(fmt_row(r, base))
    for point in dict.fromkeys(r.point for r in results):
        ok = [r for r in results if r.point == point and r.status == "ok"]
        base = next((r.tbps for r in ok if r.config == "default"), math.nan)
        if ok:
            best = max(ok, key=lambda r: r.tbps)
            ratio = common.fmt(best.tbps / base, ".2f")
            print(f"best at {point}: {best.config} {best.tbps:.2f} TB/s ({ratio}x default {common.fmt(base, '.2f')})")
            bf16 = next((r for r in results
                         if f"{r.point}-fp8" == point and r.config == "default" and r.status == "ok"), None)
            if bf16 is not None:  # an fp8 point beside its bf16 twin: time against bf16's default
                default = next((r for r in ok if r.config == "default"), None)
                vs_default = common.fmt(default.total_us / bf16.total_us, ".3f") if default else "-"
                print(f"  fp8 time / bf16 default time: default {vs_default}, best {best.total_us / bf16.total_us:.3f}")


def sweep(args, points, num_sms: int, t_start: float) -> list[Result]:
    results: list[Result] = []
    for kv_dtype, point in [(t, p) for t in args.kv_dtype.split(",") for p in points]:
        suffix = "" if kv_dtype == "bf16" else f"-{kv_dtype}"
        pname, batch, ctx, ps, _ = point
        pname += suffix
        todo = configs_for(point, args, results, suffix)
        data = make_point(batch, ctx, ps, kv_dtype)
        base = math.nan
        for name, cfg in todo:
            if time.perf_counter() - t_start > args.budget_s:
                results.append(Result(pname, name, status="skipped", note="time budget; rerun with --points/--only"))
                continue
            r = run_config(pname, name, cfg, data, args.calls, num_sms)
            results.append(r)
            if name == "default" and r.status == "ok":
                base = r.tbps
            print(fmt_row(r, base), flush=True)
        del data
    return results

def main_triton_decode(args) -> int:
    t_start = time.perf_counter()
    on_gpu = jax.default_backend() == "gpu"
    if not on_gpu and not args.tiny:
        print("no GPU for JAX: use --tiny for a CPU smoke run")
        return 2
    points = TINY_POINTS if args.tiny else DECODE_POINTS
    if args.points:
        points = [p for p in points if p[0] in args.points.split(",")]
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count if common.cuda_available() else HOPPER_NUM_SMS
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; {num_sms} SMs; heads {HQ}/{HKV}, "
          f"d {D}, bf16; {args.calls} profiled calls per config", flush=True)
    print(HEADER, flush=True)
    results = sweep(args, points, num_sms, t_start)
    path = os.path.join(common.out_dir(), "tune_triton_decode.json")
    with open(path, "w") as f:
        json.dump([dataclasses.asdict(r) for r in results], f, indent=1)
    print(f"\nwrote {path}; {time.perf_counter() - t_start:.0f} s in all\n"
          "S = static kv-split bound, progs = non-empty attention programs, tile = block_k/warps/stages, "
          "C = kv heads per program,\nkb/SM = estimated KiB in flight per SM, us = GPU time per call (CUPTI), "
          "xdef = TB/s over the default config's, attn/merge/other = us per kernel kind\n")
    print_table(results)
    return 0


# ============================================================================= command line
def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true",
                    help="toy points on the CPU (or GPU): every sub-sweep, or the one named after it")
    sub = ap.add_subparsers(dest="sweep")
    m = sub.add_parser("mosaic", help="Mosaic GPU kernel variants against cuDNN SDPA")
    m.add_argument("--points", default=",".join(MOSAIC_POINTS))
    m.add_argument("--variants", default=",".join(MOSAIC_VARIANTS))
    m.add_argument("--rounds", type=int, default=3)
    m.add_argument("--calls", type=int, default=10)
    m.add_argument("--kernels", action="store_true", help="print each peer's kernels (name, us) of one call")
    m.add_argument("--triton", action="store_true", help="decode points: also time the Triton-lowered kernel")
    ap_t = sub.add_parser("triton-decode", help="decode knobs of the Triton kernel, time per kernel")
    ap_t.add_argument("--full", action="store_true", help="every config at every point of its group")
    ap_t.add_argument("--top", type=int, default=4, help="best page-16 configs re-run at page 1")
    ap_t.add_argument("--points", default="", help="comma-separated point names (default: all)")
    ap_t.add_argument("--only", default="", help="comma-separated config names (default: all)")
    ap_t.add_argument("--calls", type=int, default=20, help="profiled back-to-back calls per config")
    ap_t.add_argument("--budget-s", type=float, default=200.0, help="start no new config after this many seconds")
    ap_t.add_argument("--tiny", action="store_true", help="CPU smoke run: small contexts, 3 configs, interpreter")
    ap_t.add_argument("--kv-dtype", default="bf16", help="bf16, fp8 (float8_e4m3fn pools with k/v descales) or "
                                                          "bf16,fp8 (both, the fp8 points timed against bf16's)")
    args = ap.parse_args(argv)
    if args.sweep is None and not args.smoke:
        ap.error("name a sub-sweep (mosaic, triton-decode) or pass --smoke")
    return args, ap


SMOKE = {  # sub-sweep: its arguments at toy points (a CPU interprets the kernels)
    "mosaic": ["mosaic", "--points", "decode_1x32", "--variants", "default", "--rounds", "1", "--calls", "2"],
    "triton-decode": ["triton-decode", "--tiny", "--points", "1x2048x16,32x256x16", "--only", "default",
                      "--calls", "2", "--kv-dtype", "bf16,fp8"],
}


def main(argv=None) -> int:
    args, ap = parse_args(argv)
    mains = {"mosaic": main_mosaic, "triton-decode": main_triton_decode}
    if not args.smoke:
        return mains[args.sweep](args)
    rc = 0
    for name in [args.sweep] if args.sweep else list(SMOKE):
        print(f"=== tune.py {name} (smoke)", flush=True)
        sub_args, _ = parse_args(SMOKE[name])
        sub_args.smoke = True
        rc = max(rc, mains[name](sub_args))
    if not common.cuda_available():
        print("smoke: on the CPU, time = host wall clock (no CUPTI trace), SDPA is torch's CPU kernel (no cuDNN)")
    return rc


if __name__ == "__main__":
    sys.exit(main())
