"""Mosaic GPU kernel variants against cuDNN SDPA (contiguous KV), in one process, interleaved rounds.

Points (32 query / 8 kv heads, d 128, bf16 paged cache with shuffled pages): causal prefill B=4
S=4096 at page 16 and 64 (TFLOP/s, ``4 * B * Hq * S^2 * D / 2``) and decode 64 x 4096, 1 x 32768,
8 x 8192 and 256 x 1024 at page 16 (TB/s of KV, ``2 * B * ctx * Hkv * D * 2``). Variants are
``MosaicConfig`` settings by name (``VARIANTS``). Every output is checked against SDPA's before it
is timed; time = GPU time per call from a CUPTI trace (``common.time_device``), each peer timed
``--rounds`` times round-robin, median kept.

    python benchmarks/tune_mosaic.py [--points prefill_p16,decode_256x1024] [--variants default,late_k] [--kernels]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and torch share the GPU
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import torch  # noqa: E402

import common  # noqa: E402
import peers  # noqa: E402
from jax_attn.kernels.mosaic_paged import MosaicConfig  # noqa: E402

POINTS = {  # name: (kind, batch, q_len, kv_len, page_size[, kv heads, default 8])
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
}
VARIANTS = {
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
}
TOLERANCE = 2e-2


def amount(kind, p) -> float:
    if kind == "prefill":
        return 4 * p.batch * p.num_q_heads * p.kv_len**2 * p.head_dim / 2
    return 2 * p.batch * p.kv_len * p.num_kv_heads * p.head_dim * 2


def print_kernels(name: str, run, sync) -> None:
    """The GPU activities of one call of ``run`` (name, us), from a CUPTI trace."""
    acts = common.device_activities(run.call, sync, calls=1)
    print(f"{name}: {run.name}: {len(acts)} kernels: " + ", ".join(f"{n[:40]} {d:.1f}" for _, d, n in acts), flush=True)


def run_point(name: str, variants: list[str], rounds: int, calls: int,
              kernels: bool = False) -> list[tuple[str, str, float, float]]:
    """(point, peer, value, rel. error) rows of one point (``kernels``: also each peer's kernel list)."""
    kind, b, q_len, kv_len, ps, *kv_heads = POINTS[name]
    p = peers.make_problem(b, q_len, kv_len, ps, device="cuda", num_q_heads=32, num_kv_heads=(kv_heads or [8])[0],
                           head_dim=128)
    runs = [peers.sdpa(p)] + [peers.ours_mosaic(p, VARIANTS[v], name=f"mosaic[{v}]") for v in variants]
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
            ts.append(t.time_us)
    work = amount(kind, p)
    for run, _, err, ts in timed:
        us = statistics.median(ts)
        rows.append((name, run.name, work / (us * 1e-6) / 1e12, err))
        print(f"{name}: {run.name:28s} {us:9.1f} us  {rows[-1][2]:7.3f} {'TFLOP/s' if kind == 'prefill' else 'TB/s'}"
              f"  (rounds {', '.join(f'{t:.1f}' for t in ts)})  err {err:.1e}", flush=True)
    del p, runs, timed
    torch.cuda.empty_cache()
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default=",".join(POINTS))
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--calls", type=int, default=10)
    ap.add_argument("--kernels", action="store_true", help="print each peer's kernels (name, us) of one call")
    a = ap.parse_args(argv)
    variants = [v for v in a.variants.split(",") if v]
    rows = []
    for name in (n for n in a.points.split(",") if n):
        rows += run_point(name, variants, a.rounds, a.calls, a.kernels)
    print(f"\ndevice: {torch.cuda.get_device_name()}\n\n| point | peer | value | / SDPA |\n|---|---|---|---|")
    base = {r[0]: r[2] for r in rows if r[1].startswith("sdpa")}
    for point, peer, value, _ in rows:
        print(f"| {point} | {peer} | {value:.3g} | {value / base[point]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
