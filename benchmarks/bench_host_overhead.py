"""Host overhead of a decode step through the JAX backend (plan + pad + dispatch), batch 64.

Runs the example Llama-style model (``examples/llama.py``) as one captured executable per step
and reports, per decode step:
  device  time of back-to-back executable calls on device-resident inputs (the kernels' floor)
  replay  ``StepRunner.replay`` from host numpy batch fields, blocking on the result each step
  host    time for ``replay`` to return before blocking (planning inputs, padding, dispatch)
overhead = replay - device. Random KV contents (never zeros).

    python benchmarks/bench_host_overhead.py --config 1b --batch 64 --ctx 4096
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import llama  # noqa: E402

from jax_attn.backend import FlashAttentionBackend  # noqa: E402
from jax_attn.batch import ForwardBatch  # noqa: E402
from jax_attn.capture import StepRunner, _pad_tokens, pack_int32  # noqa: E402
from jax_attn.backend import batch_arrays  # noqa: E402
from jax_attn.kv_cache import KVPool  # noqa: E402
from jax_attn.metadata import ForwardMode  # noqa: E402


def random_pools(cfg, num_slots, seed, stacked=False):
    """Random K/V: one layer-stacked pool ``[L, num_slots, Hkv, D]``, or a list of per-layer pools."""
    key = jax.random.key(seed)
    dt = jnp.dtype(cfg.dtype)
    shape = (cfg.n_layers, num_slots, cfg.n_kv_heads, cfg.head_dim)
    pool = KVPool(jax.random.normal(key, shape, dt), jax.random.normal(jax.random.fold_in(key, 1), shape, dt))
    if stacked:
        return pool
    return [KVPool(pool.k[i], pool.v[i]) for i in range(cfg.n_layers)]


def setup(config, batch, ctx, page_size, steps, layers, impl, stacked=False):
    """Model, backend and a runner with the decode bucket captured; the batch/token factories."""
    cfg = llama.CONFIGS[config]
    if layers:
        import dataclasses
        cfg = dataclasses.replace(cfg, n_layers=layers)
    max_ctx = ctx + steps + 8
    pages_per = -(-max_ctx // page_size)
    table = np.zeros((batch + 1, pages_per * page_size), np.int32)
    perm = np.random.default_rng(0).permutation(np.arange(1, batch * pages_per + 1))
    for r in range(batch):
        pages = perm[r * pages_per:(r + 1) * pages_per]
        table[r + 1] = (pages[:, None] * page_size + np.arange(page_size)).reshape(-1)
    num_slots = (batch * pages_per + 1) * page_size
    backend = FlashAttentionBackend(table, page_size=page_size, max_context_len=max_ctx, impl=impl,
                                    num_heads=(cfg.n_heads, cfg.n_kv_heads))
    params = llama.init_params(cfg, 0)
    params = llama.stack_layers(params) if stacked else params
    pools = random_pools(cfg, num_slots, 1, stacked)

    def step(md, tok, params, pools):
        return llama.forward_paged(cfg, backend, params, md, tok["ids"], tok["pos"], pools)

    runner = StepRunner(backend, step, batch_buckets=(batch,), donate_argnums=(1,))
    rows = np.arange(1, batch + 1, dtype=np.int32)
    lens = np.full(batch, ctx, np.int32) - np.arange(batch, dtype=np.int32) % 7

    def fb(lens):
        return ForwardBatch(ForwardMode.DECODE, rows, lens, table[rows, lens - 1])

    def tok(lens):
        return dict(ids=np.asarray(lens % cfg.vocab, np.int32), pos=np.asarray(lens - 1, np.int32))

    runner.capture([fb(lens)], tok(lens), params, pools, verbose=False)
    return dict(cfg=cfg, backend=backend, runner=runner, fb=fb, tok=tok, params=params, pools=pools, lens=lens)


def main(config="1b", batch=64, ctx=4096, page_size=16, steps=30, layers=None, impl="auto", stacked=False):
    env = setup(config, batch, ctx, page_size, steps, layers, impl, stacked)
    cfg, backend, runner, fb, tok = env["cfg"], env["backend"], env["runner"], env["fb"], env["tok"]
    params, pools, lens = env["params"], env["pools"], env["lens"]
    exe = next(iter(runner.executables.values()))
    # Device floor: back-to-back calls on device-resident inputs.
    layout, packed = pack_int32(batch_arrays(fb(lens)))
    dev_in = jax.device_put((backend.req_to_token, packed, _pad_tokens(tok(lens), batch)))
    for _ in range(3):
        _, pools = exe(*dev_in, params, pools)
    jax.block_until_ready(pools)
    t0 = time.perf_counter()
    for _ in range(steps):
        _, pools = exe(*dev_in, params, pools)
    jax.block_until_ready(pools)
    device_us = (time.perf_counter() - t0) / steps * 1e6
    replay, host = [], []
    for i in range(steps + 3):
        cur = lens + i
        t0 = time.perf_counter()
        logits, pools = runner.replay(fb(cur), tok(cur), params, pools)
        t1 = time.perf_counter()
        jax.block_until_ready(logits)
        t2 = time.perf_counter()
        if i >= 3:
            host.append((t1 - t0) * 1e6)
            replay.append((t2 - t0) * 1e6)
    rep, hst = statistics.median(replay), statistics.median(host)
    print(f"device={jax.devices()[0].device_kind} config={config} layers={cfg.n_layers} batch={batch} "
          f"ctx={ctx} page_size={page_size} impl={backend.impl} stacked={stacked} "
          f"leaves={len(jax.tree.leaves((params, pools)))}")
    print("| metric | us per step |\n|---|---|")
    print(f"| device (back-to-back executable) | {device_us:.0f} |")
    print(f"| replay (host fields -> result) | {rep:.0f} |")
    print(f"| host enqueue (replay returns) | {hst:.0f} |")
    print(f"| overhead = replay - device | {rep - device_us:.0f} |")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="1b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--impl", default="auto")
    ap.add_argument("--stacked", action="store_true", help="layer-stacked params and pool, lax.scan over layers")
    main(**{k.replace("-", "_"): v for k, v in vars(ap.parse_args()).items()})
