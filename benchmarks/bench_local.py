"""Chunked local attention (Llama-4 iRoPE layers, #22) against plain attention over one chunk.

Targets (H100, issue #22):
  decode   a local layer at B=64 x ctx 32768, chunk 8192, reaches >= 0.95x the bandwidth of a plain
           decode over 8192 keys (B=64). Both read the same bytes, 2 * B * 8192 * Hkv * D * 2, so the
           ratio is plain time / local time.
  prefill  a local layer over one 32768-token sequence (chunk 8192) costs <= 1.05x a plain prefill
           of 4 sequences of 8192 tokens (same tokens, same visible query-key pairs).

Both sides run ``FlashAttentionBackend.forward`` (attention only, ``save_kv_cache=False``) under
``jax.jit`` with the step's plan made once beforehand, as every layer of a model reuses it. The
local layer's cache holds NaN in every position before the last chunk (decode) so any read
outside the chunk shows as a NaN output; each local output is compared with the plain run over
the same keys (which must agree to bf16 rounding). Planning (``backend.plan``, the local virtual
batch included) is timed separately.

Llama-4 Scout shapes: 40 query heads, 8 kv heads, head dim 128, bf16. Kernels: triton and mosaic
at page size 16, triton at page size 1 (the Mosaic kernel has no page size 1).

  python3 benchmarks/bench_local.py                  # GPU: the table and PASS/FAIL per target
  python3 benchmarks/bench_local.py --impl mosaic --page-size 16
  JAX_PLATFORMS=cpu python3 benchmarks/bench_local.py --tiny   # CPU smoke run (numbers meaningless)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_attn.backend import FlashAttentionBackend, LayerParams  # noqa: E402
from jax_attn.batch import ForwardBatch  # noqa: E402
from jax_attn.kv_cache import KVPool  # noqa: E402
from jax_attn.metadata import ForwardMode  # noqa: E402

TARGETS = {"decode": 0.95, "prefill": 1 / 1.05}  # plain time / local time must reach this


@dataclasses.dataclass(frozen=True)
class Shapes:
    hq: int = 40
    hkv: int = 8
    d: int = 128
    decode_batch: int = 64
    decode_ctx: int = 32768
    prefill_len: int = 32768
    chunk: int = 8192


TINY = Shapes(hq=4, hkv=2, d=64, decode_batch=2, decode_ctx=96, prefill_len=96, chunk=32)


def time_call(fn, iters: int, reps: int) -> float:
    """Median seconds per call of ``reps`` runs of ``iters`` back-to-back calls (after a warm-up)."""
    jax.block_until_ready(fn())
    jax.block_until_ready(fn())
    per = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(iters):
            out = fn()
        jax.block_until_ready(out)
        per.append((time.perf_counter() - t0) / iters)
    return statistics.median(per)


def contiguous_table(rows: int, ctx: int, page_size: int):
    """req_to_token: row r + 1 owns slots [page_size + r * ctx, ...) in order (row 0 / page 0 reserved)."""
    table = np.zeros((rows + 1, ctx), np.int32)
    table[1:] = page_size + np.arange(rows, dtype=np.int32)[:, None] * ctx + np.arange(ctx, dtype=np.int32)[None]
    return table


@functools.partial(jax.jit, static_argnums=2)
def _fill(key, mask, kv_shape):  # mask bool[num_slots]: NaN where set
    shape = mask.shape + kv_shape
    return tuple(jnp.where(mask[:, None, None], jnp.nan, jax.random.normal(k, shape, jnp.bfloat16))
                 for k in jax.random.split(key))


def make_pool(num_slots: int, hkv: int, d: int, nan_slots: np.ndarray, seed: int) -> KVPool:
    """Random bf16 K/V (``[num_slots, Hkv, D]``), NaN in ``nan_slots``."""
    mask = np.zeros(num_slots, bool)
    mask[nan_slots] = True
    return KVPool(*_fill(jax.random.key(seed), jnp.asarray(mask), (hkv, d)))


def attend_fn(backend, layer):
    @jax.jit
    def run(q, pool, md):
        return backend.forward(q, None, None, layer, pool, md, save_kv_cache=False)[0]
    return run


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if not np.isfinite(a).all():
        return float("inf")
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def plan_time(backend, batch, reps: int) -> float:
    """Median seconds of ``backend.plan(batch)`` (host work + device planner, waited for)."""
    jax.block_until_ready(backend.plan(batch))
    per = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(backend.plan(batch))
        per.append(time.perf_counter() - t0)
    return statistics.median(per)


def compare(s: Shapes, table, pool, batches, *, chunk: int, seed: int, warmup: int, reps: int, **backend_kw) -> dict:
    """Plan and time one local layer (``batches[0]``, chunk ``chunk``) against a plain layer
    (``batches[1]``) over the same keys: times (s), their relative difference and plan times (s)."""
    local_be = FlashAttentionBackend(table, attention_chunk_size=chunk, **backend_kw)
    plain_be = FlashAttentionBackend(table, **backend_kw)
    local_batch, plain_batch = batches
    q = jax.random.normal(jax.random.key(seed), (local_batch.num_tokens, s.hq * s.d),
                          jnp.float32).astype(jnp.bfloat16)
    lay = LayerParams(num_q_heads=s.hq, num_kv_heads=s.hkv, head_dim=s.d)
    local_md, plain_md = local_be.plan(local_batch), plain_be.plan(plain_batch)
    local_fn = attend_fn(local_be, dataclasses.replace(lay, use_irope=True))
    plain_fn = attend_fn(plain_be, lay)
    return dict(err=rel_err(local_fn(q, pool, local_md), plain_fn(q, pool, plain_md)),
                local=time_call(lambda: local_fn(q, pool, local_md), warmup, reps),
                plain=time_call(lambda: plain_fn(q, pool, plain_md), warmup, reps),
                plan_local=plan_time(local_be, local_batch, reps), plan_plain=plan_time(plain_be, plain_batch, reps))


def bench_decode(s: Shapes, impl: str, page_size: int, reps: int) -> dict:
    """Local decode (B x ctx, chunk) vs plain decode (B x chunk) over the same keys."""
    b, ctx, c = s.decode_batch, s.decode_ctx, s.chunk
    table = contiguous_table(b, ctx, page_size)
    num_slots = page_size + b * ctx
    # The plain batch's rows b + 1 .. 2b point at the local rows' last chunk (same slots).
    plain_rows = np.zeros((b, ctx), np.int32)
    plain_rows[:, :c] = table[1:, ctx - c:]
    table = np.concatenate([table, plain_rows])
    before_last = table[1:b + 1, :ctx - c].reshape(-1)  # never visible to the decode query
    pool = make_pool(num_slots, s.hkv, s.d, before_last, seed=0)
    rows = np.arange(1, b + 1, dtype=np.int32)
    local_batch = ForwardBatch(ForwardMode.DECODE, rows, np.full(b, ctx, np.int32), table[rows, ctx - 1])
    plain_batch = ForwardBatch(ForwardMode.DECODE, rows + b, np.full(b, c, np.int32), table[rows + b, c - 1])
    r = compare(s, table, pool, (local_batch, plain_batch), chunk=c, seed=1, warmup=20, reps=reps,
                page_size=page_size, max_context_len=ctx, impl=impl, num_heads=(s.hq, s.hkv), num_slots=num_slots)
    nbytes = 2 * b * c * s.hkv * s.d * 2
    return dict(kind="decode", case=f"decode B={b} ctx={ctx} chunk={c}", impl=impl, page_size=page_size,
                local_us=r["local"] * 1e6, plain_us=r["plain"] * 1e6, local_val=nbytes / r["local"] / 1e12,
                plain_val=nbytes / r["plain"] / 1e12, unit="TB/s", err=r["err"],
                plan_local_us=r["plan_local"] * 1e6, plan_plain_us=r["plan_plain"] * 1e6)


def bench_prefill(s: Shapes, impl: str, page_size: int, reps: int) -> dict:
    """Local prefill of one sequence of prefill_len tokens vs plain prefill of its chunks as sequences."""
    n, c = s.prefill_len, s.chunk
    parts = n // c
    table = contiguous_table(1, n, page_size)
    # Plain rows 2 .. parts + 1: chunk i of the long sequence, as a sequence of its own.
    extra = np.zeros((parts, n), np.int32)
    for i in range(parts):
        extra[i, :c] = table[1, i * c:(i + 1) * c]
    table = np.concatenate([table, extra])
    num_slots = page_size + n
    pool = make_pool(num_slots, s.hkv, s.d, np.zeros(0, np.int64), seed=2)
    loc = table[1, :n]
    local_batch = ForwardBatch(ForwardMode.EXTEND, np.array([1], np.int32), np.array([n], np.int32), loc,
                               extend_seq_lens=np.array([n], np.int32))
    plain_rows = np.arange(2, parts + 2, dtype=np.int32)
    plain_batch = ForwardBatch(ForwardMode.EXTEND, plain_rows, np.full(parts, c, np.int32), loc,
                               extend_seq_lens=np.full(parts, c, np.int32))
    r = compare(s, table, pool, (local_batch, plain_batch), chunk=c, seed=3, warmup=3, reps=reps,
                page_size=page_size, max_context_len=n, impl=impl, num_heads=(s.hq, s.hkv), num_slots=num_slots)
    flops = 4 * s.hq * s.d * parts * c * (c + 1) / 2  # visible (query, key) pairs, causal within chunks
    return dict(kind="prefill", case=f"prefill S={n} chunk={c}", impl=impl, page_size=page_size,
                local_us=r["local"] * 1e6, plain_us=r["plain"] * 1e6, local_val=flops / r["local"] / 1e12,
                plain_val=flops / r["plain"] / 1e12, unit="TFLOP/s", err=r["err"],
                plan_local_us=r["plan_local"] * 1e6, plan_plain_us=r["plan_plain"] * 1e6)


def table(results) -> str:
    head = (f"{'case':<34} {'impl':<7} {'ps':>3} {'local us':>10} {'plain us':>10} {'local':>8} {'plain':>8} "
            f"{'unit':<8} {'plain/local':>11} {'target':>7} {'relerr':>8} {'plan us l/p':>14}  verdict")
    lines = [head, "-" * len(head)]
    for r in results:
        ratio = r["plain_us"] / r["local_us"]
        ok = ratio >= TARGETS[r["kind"]] and r["err"] < 2e-2
        lines.append(f"{r['case']:<34} {r['impl']:<7} {r['page_size']:>3} {r['local_us']:>10.1f} {r['plain_us']:>10.1f} "
                     f"{r['local_val']:>8.3g} {r['plain_val']:>8.3g} {r['unit']:<8} {ratio:>11.3f} "
                     f"{TARGETS[r['kind']]:>7.3f} {r['err']:>8.1e} "
                     f"{r['plan_local_us']:>6.0f}/{r['plan_plain_us']:<6.0f}  {'PASS' if ok else 'FAIL'}")
    return "\n".join(lines)


def main(tiny: bool = False, impl: str = "", page_size: int = 0, only: str = "", reps: int = 0) -> int:
    s = TINY if tiny else Shapes()
    reps = reps or (2 if tiny else 15)
    variants = [("triton", 16), ("mosaic", 16), ("triton", 1)]
    variants = [(i, p) for i, p in variants if impl in ("", i) and page_size in (0, p)]
    results = []
    for kind, fn in (("decode", bench_decode), ("prefill", bench_prefill)):
        if only and only != kind:
            continue
        for im, ps in variants:
            try:
                results.append(fn(s, im, ps, reps))
            except Exception as e:  # one failing variant should not hide the others
                print(f"{kind} impl={im} ps={ps}: {type(e).__name__}: {e}", file=sys.stderr)
    print(f"device={jax.devices()[0].device_kind} heads={s.hq}/{s.hkv} d={s.d} bf16")
    print(table(results))
    return 0 if all(r["err"] < 2e-2 for r in results) else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="toy shapes for a CPU smoke run")
    ap.add_argument("--impl", default="", choices=["", "triton", "mosaic"])
    ap.add_argument("--page-size", type=int, default=0, choices=[0, 1, 16])
    ap.add_argument("--only", default="", choices=["", "decode", "prefill"])
    ap.add_argument("--reps", type=int, default=0)
    sys.exit(main(**vars(ap.parse_args())))
