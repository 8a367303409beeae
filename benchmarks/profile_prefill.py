"""Run one prefill case per kernel for Nsight Compute: our paged Mosaic kernel and JAX's dense one.

    PYTHONPATH=. ncu --set full -k regex:"$(python3 benchmarks/profile_prefill.py --names)" \
        -o $OUT/prefill python3 benchmarks/profile_prefill.py
    ncu --import $OUT/prefill.ncu-rep --page details --csv > $OUT/prefill.csv

Causal B=4, S=4096, 32/8 heads, d=128 (ours: bf16, page ``--page-size``; JAX dense: f16), each
kernel warmed up then called ``--calls`` times (profile them all or ``--launch-skip``). The
kernels are the ones ``benchmarks/bench_attention.py`` times (``peers.ours_mosaic`` and
``peers.jax_mosaic``).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peers  # noqa: E402

KERNEL_NAMES = "paged|attention|mosaic|kernel"  # our kernel and attention_mgpu's (regex for ncu -k)


def main(batch=4, seq=4096, page_size=16, calls=1, names=False):
    if names:
        print(KERNEL_NAMES)
        return 0
    p = peers.make_problem(batch, seq, seq, page_size)
    for make in (peers.ours_mosaic, peers.jax_mosaic):
        run = make(p)
        jax.block_until_ready(run.call())  # compile + warm-up
        for _ in range(calls):
            jax.block_until_ready(run.call())
        print(f"ran {run.name}: {run.note}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--names", action="store_true", help="print the ncu kernel-name regex and exit")
    sys.exit(main(**vars(ap.parse_args())))
