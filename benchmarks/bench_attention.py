"""Attention benchmark: our paged kernel against its peers, in one process, on one GPU.

Cases (32 query heads, 8 kv heads, head dim 128, bf16, random data):
  decode   B x ctx in {64x4096, 1x32768, 8x8192, 256x1024}, page size 1 and 16; TB/s over the
           KV bytes 2 * B * ctx * Hkv * D * 2.
  prefill  causal B=4, S=4096, page size 16, 64 and 1 for ours; TFLOP/s over 4 * B * Hq * S^2 * D / 2.
  extend   B=4, 1024 new tokens on a 4096-token prefix (kv_len 5120), bottom-right causal;
           TFLOP/s over 4 * Hq * D * (visible query-key pairs).
  verify   B=32, 4 draft tokens per sequence, ctx 2048 (drafts included), chain (causal) mask;
           TB/s over the KV bytes.

Peers (benchmarks/peers.py), besides ours (Triton; Mosaic GPU at page sizes divisible by 8): torch
SDPA (the reference), SGLang's Triton decode / extend kernels, FA3 (flash_attn3_jax's
flash_mha_with_kvcache on the same paged cache, every case), JAX Pallas paged attention (decode),
and on prefill the dense JAX Pallas mha / Mosaic GPU attention.

Every peer's output is compared with torch SDPA on each case (and all of them, SDPA included, with
a float32 reference on small cases first); a peer off by more than the tolerance is marked WRONG.
The last thing printed is one table; results go to $OUT (or ./out) as JSON, CSV and a PNG plot
of the decode matrix.

Run on the GPU machine from the repository root (peers from ``bash benchmarks/fetch_peers.sh .peers``,
found in ./.peers when present; FA3 after ``eval "$(bash .peers/peer_site.sh .peers)"``):
  PYTHONPATH=.:.peers:$PYTHONPATH python3 benchmarks/bench_attention.py [--only decode] [--quick]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and torch share the GPU
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (_ROOT, os.path.join(_ROOT, ".peers")):
    if os.path.isdir(_p) and _p not in sys.path:
        sys.path.insert(0, _p)

import torch  # noqa: E402

import common  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
import peers  # noqa: E402
from common import Row  # noqa: E402

HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
DECODE_SHAPES = [(64, 4096), (1, 32768), (8, 8192), (256, 1024)]
TOLERANCE = 2e-2  # relative L2 error against SDPA (bf16 outputs land near 4e-3)
SGLANG_SPLITS = (4, 8, 16)  # decode kv splits tried for SGLang; the fastest is reported


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["decode", "prefill", "extend", "verify"], help="run one group")
    ap.add_argument("--quick", action="store_true",
                    help="fewer repetitions; decode only 64x4096 and 1x32768")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per peer (default 30, quick 8)")
    ap.add_argument("--tiny", action="store_true", help="toy shapes for a CPU smoke run (numbers meaningless)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every peer of a case this many times, round-robin, and report each one's median "
                         "(GPU clocks drift within a run: rounds keep peers of a case on the same footing)")
    return ap.parse_args(argv)


def case_list(args) -> list[tuple[str, int, int, int, int]]:
    """(kind, B, q_len, kv_len, page_size) in run order."""
    if args.tiny:
        shapes = dict(decode=[(2, 64)], prefill=(2, 64), extend=(2, 16, 80), verify=(3, 4, 48))
    else:
        shapes = dict(decode=DECODE_SHAPES[:2] if args.quick else DECODE_SHAPES, prefill=(4, 4096),
                      extend=(4, 1024, 5120), verify=(32, 4, 2048))
    cases = []
    for b, ctx in shapes["decode"]:
        cases += [("decode", b, 1, ctx, ps) for ps in (16, 1)]
    b, s = shapes["prefill"]
    cases += [("prefill", b, s, s, ps) for ps in (16, 64, 1)]
    cases += [("extend", *shapes["extend"], ps) for ps in (16, 1)]
    cases += [("verify", *shapes["verify"], ps) for ps in (16, 1)]
    return [c for c in cases if args.only in (None, c[0])]


def peer_builders(kind: str, page_size: int, with_dense: bool):
    """(name, builder) pairs for a case; dense peers run only in the first page-size variant."""
    out = [("ours", peers.ours)]
    if page_size % 8 == 0:
        out += [("ours_mosaic", peers.ours_mosaic)]
    if kind == "decode":
        out += [(f"sglang_triton/{s}", lambda p, s=s: peers.sglang_decode(p, s)) for s in SGLANG_SPLITS]
        out += [("jax_pallas_paged", peers.jax_paged)]
    else:
        out += [("sglang_triton_extend", peers.sglang_extend)]
    # FA3, paged at every page size; decode and verify try several kv splits (the fastest is kept)
    splits = peers.FA3_SPLITS if kind in ("decode", "verify") else (1,)
    out += [(f"fa3/{s}", lambda p, s=s: peers.fa3(p, s)) for s in splits]
    if kind == "prefill" and with_dense:
        out += [("jax_pallas_mha", peers.jax_mha), ("jax_mosaic_mha", peers.jax_mosaic)]
    return out


def work(kind: str, p: peers.Problem) -> tuple[float, str]:
    """(amount, unit) for one call: KV bytes for memory-bound cases, flops otherwise."""
    kv_bytes = 2 * p.batch * p.kv_len * p.num_kv_heads * p.head_dim * 2
    if kind in ("decode", "verify"):
        return kv_bytes, "TB/s"
    if kind == "prefill":
        return 4 * p.batch * p.num_q_heads * p.kv_len**2 * p.head_dim / 2, "TFLOP/s"
    prefix = p.kv_len - p.q_len
    pairs = p.q_len * prefix + p.q_len * (p.q_len + 1) // 2
    return 4 * p.batch * p.num_q_heads * p.head_dim * pairs, "TFLOP/s"


def measure(run: peers.PeerRun, ref, row: Row, amount: float, reps: int) -> Row:
    """Checks ``run`` against ``ref`` then times it; fills ``row`` in place."""
    out = run.to_tokens(run.call())
    row.rel_err = common.rel_err(out, ref) if ref is not None else float("nan")
    del out
    if row.rel_err > TOLERANCE:
        row.status = "WRONG"
    if run.framework == "jax":
        import jax

        wall, sync = common.time_jax(run.call, reps=reps), jax.block_until_ready
    else:
        wall, sync = common.time_torch(run.call, reps=reps), (lambda out: None)
    dev = common.time_device(run.call, sync, calls=max(reps, 10))
    row.timer = (run, sync, max(reps, 10))  # for later interleaved rounds
    row.wall_us = wall.time_us
    row.time_us = dev.time_us if dev else wall.time_us
    row.value = amount / (row.time_us * 1e-6) / 1e12
    timing_note = f"{dev.note}, spread {dev.spread:.0%}" if dev else "no CUPTI trace: time = wall"
    row.note = "; ".join(x for x in (run.note, timing_note, f"wall: {wall.note}") if x)
    return row


def _run_peer(name, build, p, ref, row: Row, amount, reps, flagged) -> Row:
    try:
        run = build(p)
        row.peer = run.name
        measure(run, ref, row, amount, reps)
    except peers.Unavailable as e:
        row.status, row.note = "n/a", str(e)
    except Exception as e:  # a broken peer must not stop the others
        msg = str(e).splitlines()[0][:160] if str(e) else ""
        row.status, row.note = "error", f"{type(e).__name__}: {msg}"
        traceback.print_exc(limit=3)
    if row.peer in flagged:
        row.note = f"SELFCHECK FAILED; {row.note}"
    print(f"  {row.peer:<30} {row.status:<6} {common.fmt(row.time_us, '9.1f')} us "
          f"(wall {common.fmt(row.wall_us, '.1f')}) "
          f"{common.fmt(row.value, '7.3g')} {row.unit}  err {common.fmt(row.rel_err, '.1e')}  {row.note}",
          flush=True)
    return row


def interleaved_rounds(rows: list[Row], amount: float, rounds: int) -> None:
    """Re-times every timed row of one case ``rounds - 1`` more times, round-robin; each row's time
    becomes the median over all its rounds."""
    timed = [r for r in rows if r.status == "ok" and getattr(r, "timer", None)]
    samples = {id(r): [r.time_us] for r in timed}
    for _ in range(rounds - 1):
        for r in timed:
            run, sync, calls = r.timer
            dev = common.time_device(run.call, sync, calls=calls)
            if dev:
                samples[id(r)].append(dev.time_us)
    for r in timed:
        ts = samples[id(r)]
        r.time_us = statistics.median(ts)
        r.value = amount / (r.time_us * 1e-6) / 1e12
        r.note += f"; median of {len(ts)} interleaved rounds (min {min(ts):.1f}, max {max(ts):.1f} us)"


def _fastest(rows: list[Row]) -> Row:
    ok = [r for r in rows if r.status == "ok"]
    return min(ok, key=lambda r: r.time_us) if ok else rows[0]


def run_case(kind, b, q_len, kv_len, ps, *, reps, device, with_dense, flagged, rounds=1) -> list[Row]:
    """All peers on one case; SDPA runs first and its output is the reference for the others."""
    p = peers.make_problem(b, q_len, kv_len, ps, device=device, **HEADS)
    case = f"{kind} B={b} " + (f"ctx={kv_len}" if kind == "decode" else f"q={q_len} kv={kv_len}") + f" ps={ps}"
    amount, unit = work(kind, p)
    print(f"{case}:", flush=True)

    def new_row(name):
        return Row(case, kind, name, ps, unit=unit, shape=dict(B=b, q_len=q_len, kv_len=kv_len, **HEADS))

    ref = None
    try:
        base = peers.sdpa(p)
        ref = base.to_tokens(base.call()).clone()
        del base
    except Exception as e:
        print(f"  no SDPA reference for this case ({type(e).__name__}: {e}); errors not checked")
    rows = [_run_peer("sdpa", peers.sdpa, p, None, new_row("sdpa"), amount, reps, flagged)]
    swept: dict[str, list] = {}  # peers run at several split settings: the fastest is kept
    for name, build in peer_builders(kind, ps, with_dense):
        row = _run_peer(name, build, p, ref, new_row(name), amount, reps, flagged)
        if "/" in name:
            swept.setdefault(name.split("/")[0], []).append(row)
        else:
            rows.append(row)
    for i, group in enumerate(swept.values()):
        rows.insert(2 + i, _fastest(group))
    sglang = [r for group in swept.values() for r in group]
    if rounds > 1:
        interleaved_rounds(rows, amount, rounds)
    for row in rows + sglang:
        row.timer = None  # frees the peers' buffers
    del p, ref
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def selfcheck(device) -> tuple[list[str], set[str]]:
    """Every peer (SDPA too) against a float32 reference on small cases; returns lines, failing peers."""
    small = [("decode", 3, 1, 200, 16), ("decode", 2, 1, 96, 1), ("prefill", 2, 256, 256, 16),
             ("extend", 2, 40, 168, 16)]
    lines, failed = [], set()
    for kind, b, q_len, kv_len, ps in small:
        p = peers.make_problem(b, q_len, kv_len, ps, device=device, seed=7, **HEADS)
        ref = peers.reference_fp32(p)
        builders = [("sdpa", peers.sdpa)] + peer_builders(kind, ps, with_dense=True)
        for name, build in builders:
            try:
                run = build(p)
                err = common.rel_err(run.to_tokens(run.call()), ref)
                ok = err <= TOLERANCE
                if not ok:
                    failed.add(run.name)
                lines.append(f"  {kind:<8} B={b} q={q_len} kv={kv_len} ps={ps}  {run.name:<22} "
                             f"relerr {err:.1e} {'ok' if ok else 'WRONG'}  {run.note}")
            except peers.Unavailable as e:
                lines.append(f"  {kind:<8} {name:<30} n/a: {e}")
            except Exception as e:
                first = str(e).splitlines()[0][:120] if str(e) else ""
                lines.append(f"  {kind:<8} {name:<30} error: {type(e).__name__}: {first}")
        del p
    return lines, failed


def environment() -> dict:
    import jax

    meta = dict(torch=torch.__version__, jax=jax.__version__, jax_backend=jax.default_backend())
    if torch.cuda.is_available():
        prop = torch.cuda.get_device_properties(0)
        meta.update(device=torch.cuda.get_device_name(0), sms=prop.multi_processor_count,
                    memory_gib=round(prop.total_memory / 2**30, 1))
    else:
        meta["device"] = "cpu (smoke run: numbers meaningless)"
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    return meta


def check_ours() -> str:
    """'' when our kernel imports, else the reason (the peers still run)."""
    try:
        from jax_attn.kernels import triton_paged  # noqa: F401
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return ""


def main(argv=None) -> int:
    args = parse_args(argv)
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.tiny:
        print("no CUDA device: use --tiny for a CPU smoke run")
        return 2
    device = "cuda" if on_gpu else "cpu"
    if args.tiny:
        HEADS.update(num_q_heads=8, num_kv_heads=2, head_dim=64)
    reps = args.reps or (8 if args.quick or args.tiny else 30)
    meta = environment()
    meta.update(args=vars(args), reps=reps, heads=dict(HEADS), tolerance=TOLERANCE)
    print("environment:", meta, flush=True)
    ours_missing = check_ours()
    meta["ours_import_error"] = ours_missing
    if ours_missing:
        print(f"ours: import failed ({ours_missing}); running the peers alone", flush=True)

    lines, flagged = selfcheck(device)
    print("self-check against float32 (tolerance %.0e):\n%s" % (TOLERANCE, "\n".join(lines)), flush=True)
    meta["selfcheck"], meta["selfcheck_failed"] = lines, sorted(flagged)

    rows, seen = [], set()
    for kind, b, q_len, kv_len, ps in case_list(args):
        with_dense = (kind, b, q_len, kv_len) not in seen  # dense peers: once per shape
        seen.add((kind, b, q_len, kv_len))
        rows += run_case(kind, b, q_len, kv_len, ps, reps=reps, device=device, with_dense=with_dense,
                         flagged=flagged, rounds=args.rounds)
    common.fill_ratios(rows)
    meta["copy_tbps"] = common.copy_bandwidth_tbps()

    path = common.out_dir()
    files = common.write_results(rows, meta, path)
    heads = f"{HEADS['num_q_heads']}/{HEADS['num_kv_heads']} heads, d={HEADS['head_dim']}"
    for kind in common.PLOTS:
        ceiling = meta["copy_tbps"] if kind == "decode" else None
        png = common.plot_kind(rows, kind, path, f"{kind}, {heads}, bf16 — {meta['device']}", ceiling,
                               f"D2D copy {ceiling:.2f} TB/s" if ceiling else "")
        files.append(png or f"(no {kind} plot: matplotlib missing or no {kind} rows)")
    print("\nwrote:", ", ".join(files))
    print(f"\ndevice: {meta['device']}; torch {meta['torch']}, jax {meta['jax']}; median of {reps} reps; "
          f"D2D copy {common.fmt(meta['copy_tbps'], '.2f')} TB/s\n"
          "time = GPU time per call (CUPTI); wall = back-to-back calls (torch: CUDA graph, JAX: queued "
          "dispatch); value and ours/peer use time; ours/peer = our throughput / peer's (>1: ours faster)")
    if ours_missing:
        print(f"ours: not measured (import failed: {ours_missing})")
    if flagged:
        print("self-check failed for:", ", ".join(sorted(flagged)))
    print(common.format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
