"""Quick timing of the Pallas-Triton paged attention kernel at two reference points.

  decode : B=64, ctx=4096, 32/8 heads, d=128, bf16, page size 1 and 16 (bytes = 2*B*ctx*Hkv*D*2)
  prefill: B=4, S=4096 causal, 32/8 heads, d=128, bf16 (FLOPs = 4*B*Hq*S^2*D/2)

Random data, the work schedule attached to the metadata once (as a planner does), calls
dispatched back to back; the median of several repetitions is reported. ``--sweep`` times a set
of KernelConfig variants.

  python3 benchmarks/quick_kernel.py [--sweep] [--only decode|prefill]

Measured on one H200 (jax 0.11.2, Triton 3.6; run-to-run spread about 3%), default KernelConfig:
  decode  ps=1 / ps=16: 3.8-4.0 / 3.96-4.07 TB/s (block_k 128, 4 warps, 2 stages)
  prefill ps=16 / ps=1: 340-350 / 347-352 TFLOP/s (block_m 128, block_k 64, 4 warps, 3 stages);
    ex2.approx (fast_exp2) is worth 265 -> 350; 8 warps or block_k 128 are slower.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_attn.kernels.config import KernelConfig
from jax_attn.kernels.schedule import plan_schedule
from jax_attn.kernels.triton_paged import paged_attention
from jax_attn.metadata import AttentionMetadata, ForwardMode

HQ, HKV, D = 32, 8, 128


def make_problem(batch: int, ctx: int, q_len: int, page_size: int, seed: int = 0):
    """Random bf16 q / paged cache with shuffled pages; every sequence has ``ctx`` keys."""
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


def time_call(fn, iters: int = 20, reps: int = 9) -> float:
    """Median seconds per call over ``reps`` repetitions of ``iters`` back-to-back calls."""
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


def run_point(kind: str, page_size: int, cfg: KernelConfig, batch: int = 64, ctx: int = 4096):
    if kind == "decode":
        q_len = 1
    else:
        batch, ctx, q_len = 4, 4096, 4096
    q, k, v, md = make_problem(batch, ctx, q_len, page_size)
    md = dataclasses.replace(md, schedule=plan_schedule(md, num_q_heads=HQ, num_kv_heads=HKV, config=cfg))
    fn = lambda: paged_attention(q, k, v, md, causal=True, config=cfg)
    sec = time_call(fn, iters=20 if kind == "decode" else 5)
    if kind == "decode":
        value, unit = 2 * batch * ctx * HKV * D * 2 / sec / 1e12, "TB/s"
    else:
        value, unit = 4 * batch * HQ * ctx * ctx * D / 2 / sec / 1e12, "TFLOP/s"
    return sec * 1e6, value, unit


DECODE_SWEEP = [  # (decode_block_k, decode_num_warps, decode_num_stages, fast_exp2)
    (128, 4, 2, True), (128, 4, 3, True), (64, 4, 2, True),
]
PREFILL_SWEEP = [  # (block_m, block_k, num_warps, num_stages, fast_exp2)
    (128, 64, 4, 3, True), (128, 64, 4, 3, False), (64, 64, 4, 3, True), (128, 32, 4, 3, True),
    (128, 64, 8, 3, True), (256, 64, 8, 3, True),
]


SPLIT_SWEEP = [  # (decode_block_k, decode_num_warps, decode_num_stages, split_waves, max_splits)
    (128, 4, 2, 4, 16), (128, 4, 3, 4, 16), (128, 4, 4, 4, 16), (64, 4, 4, 4, 16),
    (128, 8, 3, 4, 16), (256, 8, 2, 4, 16), (128, 4, 3, 8, 32), (64, 4, 3, 8, 32),
]


def split_sweep():
    """Small-batch long-context decode (split-KV): 1 x 32768 and 8 x 8192 at page 16.

    Wall-clock timing of back-to-back calls: at these sizes (60-100 us of GPU time) it is bound by
    host dispatch (2026-11-22, H200: 0.9-1.8 TB/s where the profiler-timed harness gives 2.1 and
    2.8 TB/s), so use it to rank compile failures, not speed; ``bench_attention.py`` times GPU work.
    """
    print("batch x ctx  (block_k, warps, stages, waves, max_splits)   time_us   TB/s")
    for batch, ctx in ((1, 32768), (8, 8192)):
        for bk, w, st, waves, ms in SPLIT_SWEEP:
            cfg = KernelConfig(decode_block_k=bk, decode_num_warps=w, decode_num_stages=st, split_waves=waves,
                               max_splits=ms)
            try:
                us, value, _ = run_point("decode", 16, cfg, batch, ctx)
            except Exception as e:  # keep sweeping past a config that fails to compile
                print(f"{batch} x {ctx} {(bk, w, st, waves, ms)}: FAILED {type(e).__name__}: {str(e)[:200]}")
                continue
            print(f"{batch} x {ctx:<6d} {str((bk, w, st, waves, ms)):42s} {us:9.1f} {value:7.3f}", flush=True)


def configs(kind: str, sweep: bool):
    if not sweep:
        return [KernelConfig()]
    if kind == "decode":
        return [KernelConfig(decode_block_k=bk, decode_num_warps=w, decode_num_stages=s, fast_exp2=f)
                for bk, w, s, f in DECODE_SWEEP]
    return [KernelConfig(block_m=bm, block_k=bk, num_warps=w, num_stages=s, fast_exp2=f)
            for bm, bk, w, s, f in PREFILL_SWEEP]


def main(sweep: bool = False, only: str | None = None):
    print(f"device: {jax.devices()[0].device_kind}")
    rows = []
    points = [("decode", 1), ("decode", 16), ("prefill", 16), ("prefill", 1)]
    for kind, ps in points:
        if only and kind != only:
            continue
        sweep_here = sweep and not (kind == "prefill" and ps == 1)
        for cfg in configs(kind, sweep_here):
            try:
                us, value, unit = run_point(kind, ps, cfg)
            except Exception as e:  # keep sweeping past a config that fails to compile
                print(f"{kind} ps={ps} {cfg}: FAILED {type(e).__name__}: {str(e)[:300]}")
                continue
            knobs = (cfg.tile_params(kind == "decode"), cfg.block_m, "fast" if cfg.fast_exp2 else "exact")
            rows.append((kind, ps, knobs, us, value, unit))
            print(f"{kind:8s} ps={ps:<3d} (block_k, warps, stages)={knobs[0]} block_m={knobs[1]} {knobs[2]}: "
                  f"{us:9.1f} us  {value:7.3f} {unit}", flush=True)
    print("\nkind     ps  ((block_k, warps, stages), block_m, exp2)   time_us   value")
    for kind, ps, knobs, us, value, unit in rows:
        print(f"{kind:8s} {ps:<3d} {str(knobs):40s} {us:9.1f} {value:7.3f} {unit}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--only", choices=["decode", "prefill"])
    ap.add_argument("--split-sweep", action="store_true", help="sweep split-KV knobs at 1x32768 and 8x8192")
    a = ap.parse_args()
    if a.split_sweep:
        split_sweep()
    else:
        main(sweep=a.sweep, only=a.only)
