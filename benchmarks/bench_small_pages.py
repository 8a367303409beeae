"""Small pages on the Mosaic kernel: its gathered-rows path (pages of 1, 2 or 4 rows) against the
Triton-lowered kernel, FA3 and itself at page 16, in one process (GPU time per call from CUPTI).

    eval "$(bash .peers/peer_site.sh .peers)"
    PYTHONPATH=.:.peers:$PYTHONPATH python benchmarks/bench_small_pages.py [--page-size 1]

Prints, per case, each kernel's time, its throughput and FA3's time over its own (x > 1: faster than
FA3). Mosaic variants (``MosaicConfig``) run at the small page only.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path[:0] = [os.path.dirname(__file__)]

import jax  # noqa: E402

import common  # noqa: E402
import peers  # noqa: E402
from bench_attention import work  # noqa: E402

from jax_attn.kernels.mosaic_paged import MosaicConfig  # noqa: E402

CASES = [("prefill", 4, 4096, 4096), ("extend", 4, 1024, 5120), ("decode", 64, 1, 4096), ("verify", 32, 4, 2048)]
VARIANTS = {"bk64s3": MosaicConfig(block_kv=64, stages=3)}


def device_us(run: peers.PeerRun) -> float:
    sync = jax.block_until_ready if run.framework == "jax" else (lambda out: None)
    run.call()
    timing = common.time_device(run.call, sync, calls=10)
    if timing is None:
        raise RuntimeError("no CUPTI trace: run on a GPU")
    return timing.time_us


def main(page_size: int = 1) -> None:
    for kind, batch, q_len, kv_len in CASES:
        for ps in (page_size, 16):
            p = peers.make_problem(batch, q_len, kv_len, ps)
            amount, unit = work(kind, p)
            runs = {"mosaic": peers.ours_mosaic(p), "triton": peers.ours(p)}
            if ps == page_size and kind in ("prefill", "extend"):
                runs.update({f"mosaic/{n}": peers.ours_mosaic(p, config=c) for n, c in VARIANTS.items()})
            for s in (1,) if kind in ("prefill", "extend") else (1, 16):
                runs[f"fa3/{s}"] = peers.fa3(p, s)
            times = {name: device_us(run) for name, run in runs.items()}
            fa3 = min(t for name, t in times.items() if name.startswith("fa3"))
            print(f"{kind} B{batch} q{q_len} kv{kv_len} page {ps}: " + "  ".join(
                f"{name} {t:.1f} us {amount / t / 1e6:.3g} {unit} x{fa3 / t:.3f}" for name, t in times.items()),
                flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--page-size", type=int, default=1, choices=[1, 2, 4])
    ap.add_argument("--smoke", action="store_true", help="CPU: check the script's set-up, time nothing")
    args = ap.parse_args()
    if args.smoke and not common.cuda_available():
        print("bench_small_pages: every case needs a GPU (CUPTI, FA3, the compiled kernels): skipped")
    else:
        main(args.page_size)
