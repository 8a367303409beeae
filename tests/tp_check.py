"""Tensor-parallel checks, run by ``tests/test_tp.py`` in a process of its own with 2 host devices (XLA's
host device count is fixed when JAX starts; the test suite's processes already have 1):

    XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu python tests/tp_check.py attention

``attention``: one layer's ``backend.forward`` (KV write + paged attention) per shard, on its heads and its
half of the pool, under the one plan of the step, against the whole layer: outputs and pools bitwise
equal, for a prefill then decode steps, page sizes 1 and 16. ``model``: ``decode_llama.run_batch`` with
``tp=2`` against ``tp=1`` (float32): greedy tokens equal, logits equal to float32 rounding. Prints one JSON
line per case.
"""

from __future__ import annotations

import dataclasses
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


def check_attention(page_size: int, decode_steps: int = 2, seed: int = 0) -> dict:
    cfg = TINY
    mesh = tp.make_mesh(2)
    rng = np.random.default_rng(seed)
    lens = np.array(PROMPTS, np.int32)
    reqs = decode_llama.PagedRequests(len(lens), int(lens.max()) + decode_steps + page_size, page_size, seed)
    (full_be, whole), (shard_be, sharded) = _layer_fns(cfg, page_size, reqs.req_to_token, mesh)
    pool1 = KVPool.zeros(reqs.num_slots, cfg.n_kv_heads, cfg.head_dim, jnp.float32)
    pool2 = tp.new_pools(cfg, "list", reqs.num_slots, mesh)[0][0]  # layer 0's pool, sharded as the example's
    steps = [ForwardBatch(ForwardMode.EXTEND, reqs.rows, lens, reqs.slots(np.zeros_like(lens), lens),
                          extend_seq_lens=lens)]
    steps += [decode_llama.decode_batch(reqs, lens + i) for i in range(decode_steps)]
    worst_out = worst_pool = 0.0
    for batch in steps:
        t = batch.num_tokens
        q = jnp.asarray(rng.standard_normal((t, cfg.n_heads, cfg.head_dim)), jnp.float32)
        k, v = (jnp.asarray(rng.standard_normal((t, cfg.n_kv_heads, cfg.head_dim)), jnp.float32) for _ in "kv")
        out1, pool1 = whole(q, k, v, pool1, full_be.plan(batch))
        out2, pool2 = sharded(q, k, v, pool2, shard_be.plan(batch))  # one plan, replicated to both shards
        worst_out = max(worst_out, float(jnp.max(jnp.abs(out1 - out2))))
        pairs = ((pool1.k, pool2.k), (pool1.v, pool2.v))
        worst_pool = max([worst_pool] + [float(jnp.max(jnp.abs(a - b))) for a, b in pairs])
    return dict(case=f"attention page_size={page_size}", out_max_abs_diff=worst_out, pool_max_abs_diff=worst_pool,
                ok=worst_out == 0.0 and worst_pool == 0.0)


def check_model(page_size: int, layout: str, n_kv_heads: int = 2, new_tokens: int = 3, seed: int = 0) -> dict:
    cfg = dataclasses.replace(TINY, n_kv_heads=n_kv_heads)
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, cfg.vocab, n).astype(np.int32) for n in PROMPTS]
    params = llama.with_layout(llama.init_params(cfg, seed), layout)
    runs = [decode_llama.run_batch(cfg, params, prompts, new_tokens=new_tokens, page_size=page_size, seed=seed,
                                   layout=layout, tp=n) for n in (1, 2)]
    a, b = (np.stack([np.stack(r) for r in run["paged_logits"]]) for run in runs)
    rel = float(np.max(np.abs(a - b)) / np.max(np.abs(a)))
    same_tokens = runs[0]["generated"] == runs[1]["generated"]
    return dict(case=f"model page_size={page_size} layout={layout} kv_heads={n_kv_heads}", logits_max_rel_diff=rel,
                same_tokens=same_tokens, ok=same_tokens and rel < 1e-5)


def main(which: str) -> int:
    if len(jax.devices()) < 2:
        print("needs 2 devices: XLA_FLAGS=--xla_force_host_platform_device_count=2", file=sys.stderr)
        return 2
    compile_cache.enable()  # the suite's persistent compilation cache: a second run compiles nothing
    cases = []
    if which in ("attention", "all"):
        cases += [check_attention(1), check_attention(16)]
    if which in ("model", "all"):
        cases += [check_model(1, "list"), check_model(16, "scan"), check_model(16, "fused", n_kv_heads=1)]
    for c in cases:
        print(json.dumps(c), flush=True)
    return 0 if all(c["ok"] for c in cases) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "all"))
