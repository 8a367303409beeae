"""Where a captured decode step's host time goes (GPU): each part of ``StepRunner.replay`` alone.

    python benchmarks/profile_replay.py --config 1b --batch 64 --ctx 4096 --variant fused

``--variant`` is one ``bench_host_overhead`` variant (layout and compiler options; the call path
options do not apply here: every path is timed).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_host_overhead as bho  # noqa: E402

from jax_attn.backend import batch_arrays  # noqa: E402
from jax_attn.batch import pad_batch  # noqa: E402
from jax_attn.capture import _pad_tokens, pack_int32  # noqa: E402


def timed(name, fn, n=20):
    """Median host time of ``fn`` (no blocking inside), then block once."""
    out, ts = None, []
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    jax.block_until_ready(out)
    print(f"| {name} | {np.median(ts):.0f} |")
    return out


def main(config="1b", batch=64, ctx=4096, page_size=16, layers=None, variant="list"):
    groups = bho.parse_variants(variant)
    if len(groups) != 1:
        raise ValueError(f"{variant=} must name one variant, e.g. 'fused' or 'fused-nocb'")
    (model_layout, opts), _ = next(iter(groups.items()))
    env = bho.setup(config, batch, ctx, page_size, steps=30, layers=layers, impl="auto", layout=model_layout,
                    opts=opts)
    runner, fb, tok, params, pools = env["runner"], env["fb"], env["tok"], env["params"], env["pools"]
    exe = next(iter(runner.executables.values()))
    key = next(iter(runner.executables))
    lens = env["lens"]
    padded = pad_batch(fb(lens), batch, batch)
    layout, packed = pack_int32(batch_arrays(padded))
    dev = jax.device_put((packed, _pad_tokens(tok(lens), batch)))
    state = {"pools": pools}

    def call(f, *a):
        out, state["pools"] = f(*a, params, state["pools"])
        return out

    print("| part | host us |\n|---|---|")
    timed("pad_batch + plan_static", lambda: runner.backend.plan_static(pad_batch(fb(lens), batch, batch)))
    timed("pack + device_put of step inputs",
          lambda: jax.device_put((pack_int32(batch_arrays(padded))[1], _pad_tokens(tok(lens), batch))))
    timed("AOT executable, device inputs", lambda: call(exe, runner.backend.req_to_token, *dev))
    timed("jit call, device inputs", lambda: call(runner._jit, key, layout, runner.backend.req_to_token, *dev))
    timed("replay (all)", lambda: call(runner.replay, fb(lens), tok(lens)))
    staged = bho.StagedReplay(runner)
    timed("staged replay (inputs copied to fixed buffers)", lambda: call(staged, fb(lens), tok(lens)))
    print(f"leaves per call: {len(jax.tree.leaves((params, pools)))} (params + pools)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default="1b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--variant", default="list")
    main(**{k.replace("-", "_"): v for k, v in vars(ap.parse_args()).items()})
