"""Tensor-parallel checks, run by ``tests/test_tp.py`` in a process of its own: on the CPU with 2 host
devices (XLA's host device count is fixed when JAX starts; the test suite's processes already have 1), or
on 2 GPUs. One code path for both; only the devices differ:

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu python tests/tp_check.py attention
    XLA_PYTHON_CLIENT_PREALLOCATE=false python tests/tp_check.py all --platform gpu --dtypes float32,bfloat16
    JAX_PLATFORMS=cpu python tests/tp_check.py model --processes 2 --process-id I --coordinator localhost:PORT

``attention``: one layer's ``backend.forward`` (KV write + paged attention) per shard, on its heads and its
half of the pool, under the one plan of the step, against the whole layer: outputs and pools bitwise
equal, for a prefill then decode steps, page sizes 1 and 16. ``model``: ``decode_llama.run_batch`` with
``tp=2`` against ``tp=1``: greedy tokens equal (ties within the tolerance excepted) and logits equal to the
dtype's rounding (float32: 1e-5 relative, its GEMMs at full precision so a GPU's TF32 default does not hide
a bug; bfloat16: 2e-2, a few bf16 ulps: each row-parallel ``psum`` adds bf16 partial outputs that tp=1 sums
in float32 inside one GEMM). ``--dtypes``: the model and attention dtypes (default float32). ``--platform``:
fail unless JAX runs there. ``--processes N`` (with ``--process-id`` and ``--coordinator``): one of N processes
joined by ``jax.distributed.initialize`` (on the CPU with gloo collectives, one host device each), every one
running the same cases over the global mesh, as ``docs/models.md`` describes for several hosts; ``model`` then
runs one case (page 1, ``list`` layout). Prints one JSON line per case.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)
import decode_llama  # noqa: E402
import llama  # noqa: E402
import tp  # noqa: E402

from jax_attn import compile_cache  # noqa: E402
from jax_attn.backend import FlashAttentionBackend, LayerParams  # noqa: E402
from jax_attn.batch import ForwardBatch  # noqa: E402
from jax_attn.kv_cache import KVPool  # noqa: E402
from jax_attn.metadata import ForwardMode  # noqa: E402

TINY = llama.Config(vocab=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=128,
                    dtype="float32")
PROMPTS = (5, 17, 9)  # ragged prompt lengths (shorter than a KV split: one split per sequence)
LOGIT_TOL = {"float32": 1e-5, "bfloat16": 2e-2}  # max |tp2 - tp1| / max |tp1| over the compared logits


def _layer_fns(cfg, page_size, req_to_token, mesh):
    """``(whole, sharded)``: ``f(q, k, v, pool, md) -> (out [T, Hq * D], pool)`` for all heads / per shard."""
    local = tp.local_config(cfg, mesh.shape[tp.AXIS])
    pool_spec = tp.new_pools(cfg, "list", 8, mesh)[1][0]  # the example's pool sharding (kv-head axis)
    full = FlashAttentionBackend(req_to_token, page_size=page_size, num_heads=(cfg.n_heads, cfg.n_kv_heads))
    shard_be = FlashAttentionBackend(req_to_token, page_size=page_size, num_heads=(local.n_heads, local.n_kv_heads))
    layer = LayerParams(cfg.n_heads, cfg.n_kv_heads, cfg.head_dim)
    local_layer = LayerParams(local.n_heads, local.n_kv_heads, cfg.head_dim)  # the shard's heads
    heads = P(None, tp.AXIS, None)  # q/k/v [T, H, D]: split on heads

    def per_shard(q, k, v, pool, md):
        return shard_be.forward(q, k, v, local_layer, pool, md)

    sharded = jax.shard_map(per_shard, mesh=mesh, in_specs=(heads, heads, heads, pool_spec, P()),
                            out_specs=(P(None, tp.AXIS), pool_spec), check_vma=False)
    whole = jax.jit(lambda q, k, v, pool, md: full.forward(q, k, v, layer, pool, md))
    return (full, whole), (shard_be, jax.jit(sharded))


def _same_bits(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)  # a sharded array is gathered
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


def check_attention(page_size: int, dtype: str = "float32", decode_steps: int = 2, seed: int = 0) -> dict:
    cfg = dataclasses.replace(TINY, dtype=dtype)
    dt = jnp.dtype(dtype)
    mesh = tp.make_mesh(2)
    rng = np.random.default_rng(seed)
    lens = np.array(PROMPTS, np.int32)
    reqs = decode_llama.PagedRequests(len(lens), int(lens.max()) + decode_steps + page_size, page_size, seed)
    (full_be, whole), (shard_be, sharded) = _layer_fns(cfg, page_size, reqs.req_to_token, mesh)
    pool1 = KVPool.zeros(reqs.num_slots, cfg.n_kv_heads, cfg.head_dim, dt)
    pool2 = tp.new_pools(cfg, "list", reqs.num_slots, mesh)[0][0]  # layer 0's pool, sharded as the example's
    steps = [ForwardBatch(ForwardMode.EXTEND, reqs.rows, lens, reqs.slots(np.zeros_like(lens), lens),
                          extend_seq_lens=lens)]
    steps += [decode_llama.decode_batch(reqs, lens + i) for i in range(decode_steps)]
    worst_out = worst_pool = 0.0
    bitwise = True
    diff = lambda a, b: float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))  # noqa: E731
    for batch in steps:
        t = batch.num_tokens
        q = jnp.asarray(rng.standard_normal((t, cfg.n_heads, cfg.head_dim)), dt)
        k, v = (jnp.asarray(rng.standard_normal((t, cfg.n_kv_heads, cfg.head_dim)), dt) for _ in "kv")
        out1, pool1 = whole(q, k, v, pool1, full_be.plan(batch))
        out2, pool2 = sharded(q, k, v, pool2, shard_be.plan(batch))  # one plan, replicated to both shards
        worst_out = max(worst_out, diff(out1, out2))
        pairs = ((out1, out2), (pool1.k, pool2.k), (pool1.v, pool2.v))
        worst_pool = max([worst_pool] + [diff(a, b) for a, b in pairs[1:]])
        bitwise = bitwise and all(_same_bits(a, b) for a, b in pairs)  # every head's output, both pool halves
    return dict(case=f"attention page_size={page_size} dtype={dtype}", out_max_abs_diff=worst_out,
                pool_max_abs_diff=worst_pool, ok=bitwise)


def compare_runs(one: dict, two: dict, tol: float):
    """``(max relative logit difference, ties, mismatches)`` of two ``run_batch`` results, request by
    request while their tokens agree: where a token differs, the request's later steps had other inputs, so
    its comparison stops there; the difference is a tie (allowed) when tp=1's best two logits were within
    ``tol`` of each other (relative), else a mismatch."""
    scale = max(float(np.max(np.abs(np.stack(r)))) for r in one["paged_logits"])
    worst, ties, mismatches = 0.0, 0, 0
    for gen1, gen2, log1, log2 in zip(one["generated"], two["generated"], one["paged_logits"], two["paged_logits"]):
        for t1, t2, a, b in zip(gen1, gen2, log1, log2):
            worst = max(worst, float(np.max(np.abs(a - b))) / scale)
            if t1 != t2:
                top2 = np.sort(a)[-2:]
                close = top2[1] - top2[0] <= tol * scale
                ties, mismatches = ties + close, mismatches + (not close)
                break
    return worst, ties, mismatches


def check_model(page_size: int, layout: str, n_kv_heads: int = 2, dtype: str = "float32", new_tokens: int = 3,
                seed: int = 0) -> dict:
    cfg = dataclasses.replace(TINY, n_kv_heads=n_kv_heads, dtype=dtype)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, cfg.vocab, n).astype(np.int32) for n in PROMPTS]
    params = llama.with_layout(llama.init_params(cfg, seed), layout)
    # float32: full-precision GEMMs (a GPU's default TF32 would hide a sharding bug in rounding)
    precision = jax.default_matmul_precision("highest") if dtype == "float32" else contextlib.nullcontext()
    with precision:
        runs = [decode_llama.run_batch(cfg, params, prompts, new_tokens=new_tokens, page_size=page_size, seed=seed,
                                       layout=layout, tp=n) for n in (1, 2)]
    tol = LOGIT_TOL[dtype]
    rel, ties, mismatches = compare_runs(*runs, tol)
    same_tokens = runs[0]["generated"] == runs[1]["generated"]
    return dict(case=f"model page_size={page_size} layout={layout} kv_heads={n_kv_heads} dtype={dtype}",
                logits_max_rel_diff=rel, same_tokens=same_tokens, ties=ties, mismatches=mismatches,
                ok=mismatches == 0 and rel < tol)


def main(which: str = "all", dtypes=("float32",), platform=None, processes: int = 1, process_id: int = 0,
         coordinator=None) -> int:
    if processes > 1:  # before any use of JAX's devices
        if os.environ.get("JAX_PLATFORMS") == "cpu":
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=coordinator, num_processes=processes, process_id=process_id,
                                   initialization_timeout=120)
    devices = jax.devices()
    print(f"tp_check: {len(devices)} {devices[0].platform} devices ({devices[0].device_kind})", file=sys.stderr)
    if platform is not None and devices[0].platform != platform:
        print(f"--platform {platform}: JAX runs on {devices[0].platform}", file=sys.stderr)
        return 2
    if len(devices) < 2:
        print("needs 2 devices (CPU: XLA_FLAGS=--xla_force_host_platform_device_count=2)", file=sys.stderr)
        return 2
    compile_cache.enable()  # the suite's persistent compilation cache: a second run compiles nothing
    runs = []
    for dtype in dtypes:
        if which in ("attention", "all"):
            runs += [functools.partial(check_attention, p, dtype) for p in (1, 16)]
        if which == "model" and processes > 1:
            runs += [functools.partial(check_model, 1, "list", dtype=dtype)]
        elif which in ("model", "all"):
            runs += [functools.partial(check_model, 1, "list", dtype=dtype),
                     functools.partial(check_model, 16, "scan", dtype=dtype),
                     functools.partial(check_model, 16, "fused", n_kv_heads=1, dtype=dtype)]
    ok = True
    for run in runs:  # each case printed as it finishes
        case = run()
        print(json.dumps(case), flush=True)
        ok = ok and case["ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("which", nargs="?", default="all", choices=("attention", "model", "all"))
    ap.add_argument("--dtypes", default="float32", help="comma-separated: float32,bfloat16")
    ap.add_argument("--platform", choices=("cpu", "gpu"), help="exit 2 unless JAX's devices are of this platform")
    ap.add_argument("--processes", type=int, default=1, help="processes joined by jax.distributed.initialize")
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--coordinator", help="host:port of process 0's coordinator (with --processes)")
    args = ap.parse_args()
    sys.exit(main(args.which, tuple(d for d in args.dtypes.split(",") if d), args.platform, args.processes,
                  args.process_id, args.coordinator))
