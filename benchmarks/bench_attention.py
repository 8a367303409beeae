"""Attention kernels on one GPU: our paged kernels against their peers, and two narrower views.

Modes (``--mode``):

peers (default): our paged kernel against its peers, in one process. Cases (32 query heads, 8 kv
  heads, head dim 128, bf16, random data):
    decode   B x ctx in {64x4096, 1x32768, 8x8192, 256x1024}, page size 1 and 16; TB/s over the
             KV bytes 2 * B * ctx * Hkv * D * 2.
    prefill  causal B=4, S=4096, page size 16, 64 and 1 for ours; TFLOP/s over 4 * B * Hq * S^2 * D / 2.
    extend   B=4, 1024 new tokens on a 4096-token prefix (kv_len 5120), and 512 on 4096 (kv_len 4608),
             bottom-right causal;
             TFLOP/s over 4 * Hq * D * (visible query-key pairs).
    verify   B=32, 4 draft tokens per sequence, ctx 2048 (drafts included), chain (causal) mask;
             TB/s over the KV bytes.
  Peers (benchmarks/peers.py), besides ours (the Triton-lowered kernel) and ours_mosaic (Mosaic GPU): torch
  SDPA (the reference), SGLang's Triton decode / extend kernels, FA3 (flash_attn3_jax's
  flash_mha_with_kvcache on the same paged cache, every case), JAX Pallas paged attention (decode),
  and on prefill the dense JAX Pallas mha / Mosaic GPU attention. Every peer's output is compared
  with torch SDPA on each case (and all of them, SDPA included, with a float32 reference on small
  cases first); a peer off by more than the tolerance is marked WRONG. Timing: ``common``'s
  docstring. The last thing printed is one table; results go to $OUT (or ./out) as JSON, CSV and
  PNG plots of the decode and prefill matrices.
local: chunked local attention (Llama-4 iRoPE layers) against plain attention over one chunk, through
  ``FlashAttentionBackend.forward`` under ``jax.jit`` (``LOCAL_TARGETS``, ``local_decode``).
wall: the Triton kernel alone at two reference points (decode 64 x 4096 at page 1 and 16, causal
  prefill B=4 S=4096 at page 16 and 1), host wall clock of back-to-back calls (``common.triton_point``);
  ``--sweep`` / ``--split-sweep`` time ``KernelConfig`` variants (``WALL_SWEEPS``).
ncu: one prefill call per kernel (ours Mosaic, JAX's dense Mosaic) for Nsight Compute.

Commands (GPU machine, repository root; peers from ``bash benchmarks/fetch_peers.sh .peers``, found in
./.peers when present; FA3 after ``eval "$(bash .peers/peer_site.sh .peers)"``):
  PYTHONPATH=.:.peers:$PYTHONPATH python3 benchmarks/bench_attention.py [--only decode] [--quick] [--rounds 3]
  python3 benchmarks/bench_attention.py --mode local [--impl mosaic] [--page-size 16] [--only decode]
  python3 benchmarks/bench_attention.py --mode wall [--sweep | --split-sweep] [--only decode|prefill]
  PYTHONPATH=. ncu --set full -k regex:"$(python3 benchmarks/bench_attention.py --mode ncu --names)" \
      -o $OUT/prefill python3 benchmarks/bench_attention.py --mode ncu
  JAX_PLATFORMS=cpu python3 benchmarks/bench_attention.py --smoke   # CPU: every mode at toy shapes

Flags: ``--only KIND[,KIND]`` case kinds (peers: decode|prefill|extend|verify; local, wall: decode|prefill);
``--reps N`` timed repetitions (peers: 30, quick 8; local: 15); ``--rounds N`` (peers) time every peer
of a case N times round-robin; ``--quick`` (peers) fewer reps, decode 64x4096 and 1x32768 only;
``--tiny`` toy shapes (peers, local; numbers meaningless); ``--head-dim D`` / ``--heads HQ/HKV`` (peers)
every case at that head shape (e.g. 96 with 32/32 for Phi-3); ``--page-size`` (peers: one page size;
local; ncu's, default 16); ``--impl`` (local); ``--batch``, ``--seq``, ``--calls``,
``--names`` (ncu); ``--kernels`` (peers) each peer's kernels per call and their GPU time in its note (where a
call's time goes: e.g. a merge launch or XLA fusions beside our kernel); ``--smoke`` every mode at toy shapes on
the CPU, skipping what needs a GPU (one line says what).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import os
import statistics
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and torch share the GPU
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (_ROOT, os.path.join(_ROOT, ".peers")):
    if os.path.isdir(_p) and _p not in sys.path:
        sys.path.insert(0, _p)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import common  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
import peers  # noqa: E402
from common import Row  # noqa: E402

HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
# --shapes: real models' attention shapes (name, Hq, Hkv, d), at the grid's two points (page 16)
MODEL_SHAPES = [("SmolLM2-135M", 9, 3, 64), ("Llama-3-8B", 32, 8, 128), ("Phi-3", 32, 32, 96),
                ("head dim 80", 32, 8, 80), ("Gemma 2/3", 16, 8, 256), ("Llama-4, group 5", 40, 8, 128),
                ("Qwen2.5-7B, group 7", 28, 4, 128), ("Llama-70B at TP8", 8, 1, 128)]
GRID_CASES = [("decode", 64, 1, 4096, 16), ("prefill", 4, 2048, 2048, 16)]
DECODE_SHAPES = [(64, 4096), (1, 32768), (8, 8192), (256, 1024)]
TOLERANCE = 2e-2  # relative L2 error against SDPA (bf16 outputs land near 4e-3)
SGLANG_SPLITS = (4, 8, 16)  # decode kv splits tried for SGLang; the fastest is reported


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="peers", choices=["peers", "local", "wall", "ncu"], help="what to measure")
    ap.add_argument("--only", help="peers: one case kind or several, comma-separated (decode, prefill, extend, "
                                   "verify); local, wall, ncu: decode or prefill")
    ap.add_argument("--quick", action="store_true",
                    help="fewer repetitions; decode only 64x4096 and 1x32768")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per peer (default 30, quick 8)")
    ap.add_argument("--tiny", action="store_true", help="toy shapes for a CPU smoke run (numbers meaningless)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="time every peer of a case this many times, round-robin, and report each one's median "
                         "(GPU clocks drift within a run: rounds keep peers of a case on the same footing)")
    ap.add_argument("--smoke", action="store_true", help="every mode at toy shapes on the CPU (or GPU), quickly")
    ap.add_argument("--impl", default="", choices=["", "triton", "mosaic"], help="local: one kernel")
    ap.add_argument("--page-size", type=int, default=0,
                    help="peers: only cases of this page size; local: 1 or 16 (default both); ncu: default 16")
    ap.add_argument("--kernels", action="store_true",
                    help="peers: list each peer's kernels per call and their GPU time (CUPTI) in its note")
    ap.add_argument("--sweep", action="store_true", help="wall: time KernelConfig variants")
    ap.add_argument("--split-sweep", action="store_true", help="wall: sweep split-KV knobs at 1x32768 and 8x8192")
    ap.add_argument("--batch", type=int, default=4, help="ncu: batch")
    ap.add_argument("--seq", type=int, default=4096, help="ncu: sequence length")
    ap.add_argument("--calls", type=int, default=1, help="ncu: calls per kernel after the warm-up")
    ap.add_argument("--names", action="store_true", help="ncu: print the ncu kernel-name regex and exit")
    ap.add_argument("--head-dim", type=int, default=0,
                    help="peers: head dim of every case (default 128; e.g. 80, 96, 112, 192, 256)")
    ap.add_argument("--heads", default="", help="peers: HQ/HKV of every case (default 32/8; e.g. 32/32 for Phi-3)")
    ap.add_argument("--shapes", action="store_true",
                    help="peers: the model-shape grid (MODEL_SHAPES) at decode 64x4096 and prefill B4 S2048, page 16, "
                         "against FA3 and cuDNN only, with the kernel auto picks and a summary table")
    args = ap.parse_args(argv)
    kinds = ("decode", "prefill", "extend", "verify")
    if args.only and not set(args.only.split(",")) <= set(kinds):
        ap.error(f"--only {args.only}: kinds are {', '.join(kinds)}")
    if args.mode in ("local", "wall") and args.only not in (None, "decode", "prefill"):
        ap.error(f"--mode {args.mode} takes --only decode or --only prefill")
    return args


def case_list(args) -> list[tuple[str, int, int, int, int]]:
    """(kind, B, q_len, kv_len, page_size) in run order."""
    if args.tiny:
        shapes = dict(decode=[(2, 64)], prefill=(2, 64), extend=[(2, 16, 80)], verify=(3, 4, 48))
    else:
        shapes = dict(decode=DECODE_SHAPES[:2] if args.quick else DECODE_SHAPES, prefill=(4, 4096),
                      extend=[(4, 1024, 5120), (4, 512, 4608)], verify=(32, 4, 2048))
    cases = []
    for b, ctx in shapes["decode"]:
        cases += [("decode", b, 1, ctx, ps) for ps in (16, 1)]
    b, s = shapes["prefill"]
    cases += [("prefill", b, s, s, ps) for ps in (16, 64, 1)]
    cases += [("extend", *shape, ps) for shape in shapes["extend"] for ps in (16, 1)]
    cases += [("verify", *shapes["verify"], ps) for ps in (16, 1)]
    return [c for c in cases if (args.only is None or c[0] in args.only.split(",")) and args.page_size in (0, c[4])]


def peer_builders(kind: str, page_size: int, with_dense: bool, keep=None):
    """(name, builder) pairs for a case; dense peers run only in the first page-size variant.
    ``keep``: only these names (the smoke run's CPU peers)."""
    out = [("ours", peers.ours)]
    out += [("ours_mosaic", peers.ours_mosaic)]  # n/a where its rules say no (``peers.ours_mosaic``)
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
    return [(n, b) for n, b in out if keep is None or n in keep]


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


def _run_peer(name, build, p, ref, row: Row, amount, reps, flagged, kernels: bool = False) -> Row:
    try:
        run = build(p)
        row.peer = run.name
        measure(run, ref, row, amount, reps)
        if kernels:  # where the call's GPU time goes, kernel by kernel
            parts = common.kernel_times(run.call, *row.timer[1:])  # (row.timer: run, sync, calls)
            row.note = "; ".join(x for x in (row.note, "kernels: " + (
                ", ".join(f"{k[:48]} {t:.1f}" for k, (_, t) in parts.items()) if parts is not None
                else "no CUPTI trace without a CUDA device")) if x)
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


def run_case(kind, b, q_len, kv_len, ps, *, reps, device, with_dense, flagged, rounds=1, keep=None,
             kernels=False) -> list[Row]:
    """All peers on one case; SDPA runs first and its output is the reference for the others (``kernels``: each
    peer's note lists its call's kernels and their GPU time)."""
    p = peers.make_problem(b, q_len, kv_len, ps, device=device, **HEADS)
    case = f"{kind} B={b} " + (f"ctx={kv_len}" if kind == "decode" else f"q={q_len} kv={kv_len}") + f" ps={ps}"
    amount, unit = work(kind, p)
    try:
        picked = f" (auto runs {auto_kernel(kind, b, q_len, ps)})"
    except Exception as e:  # a policy that cannot say is reported, not fatal to the run
        picked = f" (auto: {type(e).__name__})"
    print(f"{case}:{picked}", flush=True)

    def new_row(name):
        return Row(case, kind, name, ps, unit=unit, shape=dict(B=b, q_len=q_len, kv_len=kv_len, **HEADS))

    ref = None
    try:
        base = peers.sdpa(p)
        ref = base.to_tokens(base.call()).clone()
        del base
    except Exception as e:
        print(f"  no SDPA reference for this case ({type(e).__name__}: {e}); errors not checked")
    rows = [_run_peer("sdpa", peers.sdpa, p, None, new_row("sdpa"), amount, reps, flagged, kernels)]
    swept: dict[str, list] = {}  # peers run at several split settings: the fastest is kept
    for name, build in peer_builders(kind, ps, with_dense, keep):
        row = _run_peer(name, build, p, ref, new_row(name), amount, reps, flagged, kernels)
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


SELFCHECK_CASES = [("decode", 3, 1, 200, 16), ("decode", 2, 1, 96, 1), ("prefill", 2, 256, 256, 16),
                   ("extend", 2, 40, 168, 16)]


def selfcheck(device, small=SELFCHECK_CASES, keep=None) -> tuple[list[str], set[str]]:
    """Every peer (SDPA too) against a float32 reference on small cases; returns lines, failing peers."""
    lines, failed = [], set()
    for kind, b, q_len, kv_len, ps in small:
        p = peers.make_problem(b, q_len, kv_len, ps, device=device, seed=7, **HEADS)
        ref = peers.reference_fp32(p)
        builders = [("sdpa", peers.sdpa)] + peer_builders(kind, ps, with_dense=True, keep=keep)
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


SMOKE_CPU_PEERS = ("ours", "ours_mosaic")  # besides SDPA: the peers that run on a CPU (interpreted)
SMOKE_CPU_TIMED = ("ours",)  # of those, timed (the interpreted Mosaic kernel takes seconds a call)


def main_peers(args) -> int:
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.tiny:
        print("no CUDA device: use --tiny for a CPU smoke run")
        return 2
    device = "cuda" if on_gpu else "cpu"
    if args.tiny:
        HEADS.update(num_q_heads=8, num_kv_heads=2, head_dim=64)
    if args.head_dim:
        HEADS.update(head_dim=args.head_dim)
    if args.heads:
        hq, hkv = (int(x) for x in args.heads.split("/"))
        HEADS.update(num_q_heads=hq, num_kv_heads=hkv)
    reps = args.reps or (8 if args.quick or args.tiny else 30)
    keep, checked, checks = None, None, SELFCHECK_CASES
    if args.smoke:
        checks = [("decode", 2, 1, 48, 16)]
        if not on_gpu:
            keep, checked = SMOKE_CPU_TIMED, SMOKE_CPU_PEERS
            print("smoke: skipped on the CPU: SGLang Triton, FA3, JAX Pallas paged / mha and Mosaic mha peers "
                  "(GPU kernels), timing ours_mosaic (self-checked only), CUPTI device time (time = wall), "
                  "the D2D copy ceiling", flush=True)
    meta = environment()
    meta.update(args=vars(args), reps=reps, heads=dict(HEADS), tolerance=TOLERANCE)
    print("environment:", meta, flush=True)
    ours_missing = check_ours()
    meta["ours_import_error"] = ours_missing
    if ours_missing:
        print(f"ours: import failed ({ours_missing}); running the peers alone", flush=True)

    lines, flagged = selfcheck(device, checks, checked)
    print("self-check against float32 (tolerance %.0e):\n%s" % (TOLERANCE, "\n".join(lines)), flush=True)
    meta["selfcheck"], meta["selfcheck_failed"] = lines, sorted(flagged)

    if args.shapes:
        return shape_grid(args, reps, device, flagged, meta)
    rows, seen = [], set()
    cases = case_list(args)
    if args.smoke:
        cases = [c for c in cases if c[0] in ("decode", "prefill") and c[4] == 16]
    for kind, b, q_len, kv_len, ps in cases:
        with_dense = (kind, b, q_len, kv_len) not in seen  # dense peers: once per shape
        seen.add((kind, b, q_len, kv_len))
        rows += run_case(kind, b, q_len, kv_len, ps, reps=reps, device=device, with_dense=with_dense,
                         flagged=flagged, rounds=args.rounds, keep=keep, kernels=args.kernels or args.smoke)
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


def auto_kernel(kind: str, b: int, q_len: int, ps: int) -> str:
    """The kernel ``impl="auto"`` runs for a case of the current ``HEADS`` (``kernel_policy.select_kernel``)."""
    from jax_attn.kernel_policy import Call, select_kernel

    call = Call(max_q_len=q_len, page_size=ps, num_tokens=b * q_len, num_kv_heads=HEADS["num_kv_heads"],
                head_dim=HEADS["head_dim"], head_dim_v=HEADS["head_dim"], dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
                num_q_heads=HEADS["num_q_heads"])
    return select_kernel("auto", call)


def shape_grid(args, reps, device, flagged, meta) -> int:
    """``--shapes``: every model shape of ``MODEL_SHAPES`` at the ``GRID_CASES`` points in this process, our
    two kernels against FA3 (fastest of its splits) and cuDNN; prints one summary row per shape and point."""
    keep = ("ours", "ours_mosaic") + tuple(f"fa3/{s}" for s in peers.FA3_SPLITS)
    rows, summary = [], []
    for name, hq, hkv, d in MODEL_SHAPES:
        HEADS.update(num_q_heads=hq, num_kv_heads=hkv, head_dim=d)
        for kind, b, q_len, kv_len, ps in GRID_CASES:
            got = run_case(kind, b, q_len, kv_len, ps, reps=reps, device=device, with_dense=True, flagged=flagged,
                           rounds=args.rounds, keep=keep)
            by = {r.peer.split("/")[0].split("[")[0]: r for r in got}  # sdpa[cudnn] -> sdpa, fa3/4 -> fa3
            auto = auto_kernel(kind, b, q_len, ps)
            ours = by.get("ours_mosaic" if auto == "mosaic" else "ours")
            value = {k: (r.value if r.status == "ok" else None) for k, r in by.items()}

            def ratio(peer):
                a, p = value.get(ours.peer if ours else ""), value.get(peer)
                return f"{a / p:.2f}" if a and p else "-"

            summary.append((name, f"{hq}/{hkv}", d, kind, auto, common.fmt(value.get("ours"), ".3g"),
                            common.fmt(value.get("ours_mosaic"), ".3g"), common.fmt(value.get("fa3"), ".3g"),
                            common.fmt(value.get("sdpa"), ".3g"), ratio("fa3"), ratio("sdpa"), got[0].unit))
            rows += got
    common.fill_ratios(rows)
    meta["copy_tbps"] = common.copy_bandwidth_tbps()
    files = common.write_results(rows, meta, common.out_dir())
    print("\nwrote:", ", ".join(files))
    print(f"\ndevice: {meta['device']}; torch {meta['torch']}, jax {meta['jax']}; median of {reps} reps; "
          "decode 64 x 4096 in TB/s, prefill B4 S2048 causal in TFLOP/s, page 16, bf16; auto = the kernel "
          "impl='auto' runs; ratios: auto's kernel / the peer")
    head = ("model shape", "Hq/Hkv", "d", "point", "auto", "triton", "mosaic", "fa3", "cudnn", "auto/fa3",
            "auto/cudnn", "unit")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for line in summary:
        print("| " + " | ".join(str(x) for x in line) + " |")
    return 0


# ---- --mode local: chunked local attention (Llama-4 iRoPE layers, #22) ------------------------------
# Targets (H100, issue #22):
#   decode   a local layer at B=64 x ctx 32768, chunk 8192, reaches >= 0.95x the bandwidth of a plain
#            decode over 8192 keys (B=64). Both read the same bytes, 2 * B * 8192 * Hkv * D * 2, so the
#            ratio is plain time / local time.
#   prefill  a local layer over one 32768-token sequence (chunk 8192) costs <= 1.05x a plain prefill
#            of 4 sequences of 8192 tokens (same tokens, same visible query-key pairs).
# Both sides run ``FlashAttentionBackend.forward`` (attention only, ``save_kv_cache=False``) under
# ``jax.jit`` with the step's plan made once beforehand, as every layer of a model reuses it. The
# local layer's cache holds NaN in every position before the last chunk (decode) so any read outside
# the chunk shows as a NaN output; each local output is compared with the plain run over the same
# keys (which must agree to bf16 rounding). Planning (``backend.plan``, the local virtual batch
# included) is timed separately. Llama-4 Scout shapes: 40 query heads, 8 kv heads, head dim 128,
# bf16. Kernels: triton and mosaic at page size 16, triton at page size 1 (no Mosaic page size 1).
LOCAL_TARGETS = {"decode": 0.95, "prefill": 1 / 1.05}  # plain time / local time must reach this


@dataclasses.dataclass(frozen=True)
class LocalShapes:
    hq: int = 40
    hkv: int = 8
    d: int = 128
    decode_batch: int = 64
    decode_ctx: int = 32768
    prefill_len: int = 32768
    chunk: int = 8192


LOCAL_TINY = LocalShapes(hq=4, hkv=2, d=64, decode_batch=2, decode_ctx=96, prefill_len=96, chunk=32)



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


def make_pool(num_slots: int, hkv: int, d: int, nan_slots: np.ndarray, seed: int):
    """Random bf16 K/V (``[num_slots, Hkv, D]``), NaN in ``nan_slots``."""
    from jax_attn.kv_cache import KVPool

    mask = np.zeros(num_slots, bool)
    mask[nan_slots] = True
    return KVPool(*_fill(jax.random.key(seed), jnp.asarray(mask), (hkv, d)))


def attend_fn(backend, layer):
    @jax.jit
    def run(q, pool, md):
        return backend.forward(q, None, None, layer, pool, md, save_kv_cache=False)[0]
    return run


def np_rel_err(a, b) -> float:
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


def compare(s: LocalShapes, table, pool, batches, *, chunk: int, seed: int, warmup: int, reps: int,
            **backend_kw) -> dict:
    """Plan and time one local layer (``batches[0]``, chunk ``chunk``) against a plain layer
    (``batches[1]``) over the same keys: times (s), their relative difference and plan times (s)."""
    from jax_attn.backend import FlashAttentionBackend, LayerParams

    local_be = FlashAttentionBackend(table, attention_chunk_size=chunk, **backend_kw)
    plain_be = FlashAttentionBackend(table, **backend_kw)
    local_batch, plain_batch = batches
    q = jax.random.normal(jax.random.key(seed), (local_batch.num_tokens, s.hq * s.d),
                          jnp.float32).astype(jnp.bfloat16)
    lay = LayerParams(num_q_heads=s.hq, num_kv_heads=s.hkv, head_dim=s.d)
    local_md, plain_md = local_be.plan(local_batch), plain_be.plan(plain_batch)
    local_fn = attend_fn(local_be, dataclasses.replace(lay, use_irope=True))
    plain_fn = attend_fn(plain_be, lay)
    return dict(err=np_rel_err(local_fn(q, pool, local_md), plain_fn(q, pool, plain_md)),
                local=common.wall_seconds(lambda: local_fn(q, pool, local_md), warmup, reps),
                plain=common.wall_seconds(lambda: plain_fn(q, pool, plain_md), warmup, reps),
                plan_local=plan_time(local_be, local_batch, reps), plan_plain=plan_time(plain_be, plain_batch, reps))


def local_decode(s: LocalShapes, impl: str, page_size: int, reps: int) -> dict:
    """Local decode (B x ctx, chunk) vs plain decode (B x chunk) over the same keys."""
    from jax_attn.batch import ForwardBatch
    from jax_attn.metadata import ForwardMode

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


def local_prefill(s: LocalShapes, impl: str, page_size: int, reps: int) -> dict:
    """Local prefill of one sequence of prefill_len tokens vs plain prefill of its chunks as sequences."""
    from jax_attn.batch import ForwardBatch
    from jax_attn.metadata import ForwardMode

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


def local_table(results) -> str:
    head = (f"{'case':<34} {'impl':<7} {'ps':>3} {'local us':>10} {'plain us':>10} {'local':>8} {'plain':>8} "
            f"{'unit':<8} {'plain/local':>11} {'target':>7} {'relerr':>8} {'plan us l/p':>14}  verdict")
    lines = [head, "-" * len(head)]
    for r in results:
        ratio = r["plain_us"] / r["local_us"]
        ok = ratio >= LOCAL_TARGETS[r["kind"]] and r["err"] < 2e-2
        lines.append(f"{r['case']:<34} {r['impl']:<7} {r['page_size']:>3} {r['local_us']:>10.1f} "
                     f"{r['plain_us']:>10.1f} "
                     f"{r['local_val']:>8.3g} {r['plain_val']:>8.3g} {r['unit']:<8} {ratio:>11.3f} "
                     f"{LOCAL_TARGETS[r['kind']]:>7.3f} {r['err']:>8.1e} "
                     f"{r['plan_local_us']:>6.0f}/{r['plan_plain_us']:<6.0f}  {'PASS' if ok else 'FAIL'}")
    return "\n".join(lines)


def main_local(args) -> int:
    s = LOCAL_TINY if args.tiny else LocalShapes()
    reps = args.reps or (2 if args.tiny else 15)
    variants = [("triton", 16), ("mosaic", 16), ("triton", 1)]
    variants = [(i, p) for i, p in variants if args.impl in ("", i) and args.page_size in (0, p)]
    results = []
    for kind, fn in (("decode", local_decode), ("prefill", local_prefill)):
        if args.only and args.only != kind:
            continue
        for im, ps in variants:
            try:
                results.append(fn(s, im, ps, reps))
            except Exception as e:  # one failing variant should not hide the others
                print(f"{kind} impl={im} ps={ps}: {type(e).__name__}: {e}", file=sys.stderr)
    print(f"device={jax.devices()[0].device_kind} heads={s.hq}/{s.hkv} d={s.d} bf16")
    print(local_table(results))
    return 0 if all(r["err"] < 2e-2 for r in results) else 1


# ---- --mode wall: the Triton kernel at two reference points, host wall clock ------------------------
# decode 64 x 4096 and causal prefill B=4 S=4096 (``common.triton_point``), default KernelConfig or, with
# --sweep, the variants below. Measured on one H200 (jax 0.11.2, Triton 3.6; run-to-run spread about 3%),
# default KernelConfig: decode ps=1 / ps=16: 3.8-4.0 / 3.96-4.07 TB/s (block_k 128, 4 warps, 2 stages);
# prefill ps=16 / ps=1: 340-350 / 347-352 TFLOP/s (block_m 128, block_k 64, 4 warps, 3 stages);
# ex2.approx (fast_exp2) is worth 265 -> 350; 8 warps or block_k 128 are slower.
WALL_SWEEPS = dict(
    decode=[  # (decode_block_k, decode_num_warps, decode_num_stages, fast_exp2)
        (128, 4, 2, True), (128, 4, 3, True), (64, 4, 2, True)],
    prefill=[  # (block_m, block_k, num_warps, num_stages, fast_exp2)
        (128, 64, 4, 3, True), (128, 64, 4, 3, False), (64, 64, 4, 3, True), (128, 32, 4, 3, True),
        (128, 64, 8, 3, True), (256, 64, 8, 3, True)],
    split=[  # (decode_block_k, decode_num_warps, decode_num_stages, split_waves, max_splits)
        (128, 4, 2, 4, 16), (128, 4, 3, 4, 16), (128, 4, 4, 4, 16), (64, 4, 4, 4, 16),
        (128, 8, 3, 4, 16), (256, 8, 2, 4, 16), (128, 4, 3, 8, 32), (64, 4, 3, 8, 32)],
)
WALL_SMOKE = dict(batch=2, ctx=64, prefill=(1, 64))  # --smoke: toy points


def wall_split_sweep(shapes=((1, 32768), (8, 8192))):
    """Small-batch long-context decode (split-KV): 1 x 32768 and 8 x 8192 at page 16.

    Wall-clock timing of back-to-back calls: at these sizes (60-100 us of GPU time) it is bound by
    host dispatch (2026-11-22, H200: 0.9-1.8 TB/s where the profiler-timed harness gives 2.1 and
    2.8 TB/s), so use it to rank compile failures, not speed; ``--mode peers`` times GPU work.
    """
    from jax_attn.kernels.config import KernelConfig

    print("batch x ctx  (block_k, warps, stages, waves, max_splits)   time_us   TB/s")
    for batch, ctx in shapes:
        for bk, w, st, waves, ms in WALL_SWEEPS["split"]:
            cfg = KernelConfig(decode_block_k=bk, decode_num_warps=w, decode_num_stages=st, split_waves=waves,
                               max_splits=ms)
            try:
                us, value, _ = common.triton_point("decode", 16, cfg, batch, ctx)
            except Exception as e:  # keep sweeping past a config that fails to compile
                print(f"{batch} x {ctx} {(bk, w, st, waves, ms)}: FAILED {type(e).__name__}: {str(e)[:200]}")
                continue
            print(f"{batch} x {ctx:<6d} {str((bk, w, st, waves, ms)):42s} {us:9.1f} {value:7.3f}", flush=True)


def wall_configs(kind: str, sweep: bool):
    from jax_attn.kernels.config import KernelConfig

    if not sweep:
        return [KernelConfig()]
    if kind == "decode":
        return [KernelConfig(decode_block_k=bk, decode_num_warps=w, decode_num_stages=s, fast_exp2=f)
                for bk, w, s, f in WALL_SWEEPS["decode"]]
    return [KernelConfig(block_m=bm, block_k=bk, num_warps=w, num_stages=s, fast_exp2=f)
            for bm, bk, w, s, f in WALL_SWEEPS["prefill"]]


def main_wall(args) -> int:
    if args.split_sweep:
        wall_split_sweep()
        return 0
    print(f"device: {jax.devices()[0].device_kind}")
    rows = []
    points = [("decode", 1), ("decode", 16), ("prefill", 16), ("prefill", 1)]
    if args.smoke:
        points = [("decode", 16), ("prefill", 16)]
    for kind, ps in points:
        if args.only and kind != args.only:
            continue
        sweep_here = args.sweep and not (kind == "prefill" and ps == 1)
        for cfg in wall_configs(kind, sweep_here):
            try:
                us, value, unit = common.triton_point(kind, ps, cfg, **(WALL_SMOKE if args.smoke else {}))
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
    return 0


# ---- --mode ncu: one prefill call per kernel, for Nsight Compute ----------------------------------
# Causal B=4, S=4096, 32/8 heads, d=128 (ours: bf16, page --page-size; JAX dense: f16), each kernel
# warmed up then called --calls times (profile them all or use ncu's --launch-skip); the kernels that
# --mode peers times (``peers.ours_mosaic`` and ``peers.jax_mosaic``). Then:
#   ncu --import $OUT/prefill.ncu-rep --page details --csv > $OUT/prefill.csv
NCU_KERNEL_NAMES = "paged|attention|mosaic|kernel"  # our kernel and attention_mgpu's (regex for ncu -k)


def main_ncu(args) -> int:
    if args.names:
        print(NCU_KERNEL_NAMES)
        return 0
    p = peers.make_problem(args.batch, args.seq, args.seq, args.page_size or 16)
    for make in (peers.ours_mosaic, peers.jax_mosaic):
        run = make(p)
        jax.block_until_ready(run.call())  # compile + warm-up
        for _ in range(args.calls):
            jax.block_until_ready(run.call())
        print(f"ran {run.name}: {run.note}", file=sys.stderr)
    return 0


def main_smoke(args) -> int:
    """Every mode at toy shapes; what needs a GPU is skipped, and the skip printed in one line."""
    args.tiny, args.reps = True, args.reps or 2
    rc = main_local(argparse.Namespace(**{**vars(args), "only": "decode", "impl": "triton", "page_size": 16}))
    rc = max(rc, main_wall(args))
    if torch.cuda.is_available():
        rc = max(rc, main_ncu(argparse.Namespace(**{**vars(args), "batch": 1, "seq": 64})))
    else:
        print("smoke: --mode ncu skipped on the CPU (Mosaic GPU kernels, Nsight Compute)")
    return max(rc, main_peers(args))  # last: its table ends the output


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        return main_smoke(args)
    return dict(peers=main_peers, local=main_local, wall=main_wall, ncu=main_ncu)[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
