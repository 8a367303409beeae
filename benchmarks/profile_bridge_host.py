"""cProfile of the bridge's host path on the GPU: the replay hook, the eager plan and one JAX-path
layer call, each repeated (``python3 benchmarks/profile_bridge_host.py [--iters N]``)."""

import argparse
import cProfile
import dataclasses
import os
import pstats
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import bench_bridge as bb  # noqa: E402


def profile(name, fn, iters):
    fn()
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(iters):
        fn()
    pr.disable()
    torch.cuda.synchronize()
    print(f"\n######## {name} ({iters} calls)")
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)


def main(iters=300):
    cfg = dataclasses.replace(bb.lt.CONFIGS["1b"], n_layers=1)
    for page in (1, 16):
        runner, backend, fb, layer, q, k = bb.one_layer(cfg, page)
        static = bb.StaticBatch(runner, backend, 1, 256)
        profile(f"replay hook, page {page}", static.replay, iters)
        profile(f"eager plan, page {page}", lambda: backend.init_forward_metadata(static.fb), iters)
        static.replay()
        profile(f"layer call, page {page}", lambda: backend.forward(q, k, k, layer, static.fb), iters)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=300)
    main(**vars(ap.parse_args()))
