"""Deterministic mode (SGLang's ``enable_deterministic_inference``): a request's output is bitwise the
same alone, in a batch and in any bucket, through the JAX backend and the torch bridge.

The sequences hold 1k-8k keys: long enough that the split-KV heuristic splits them (it never gives a
split fewer than ``min_kv_per_split`` keys), and by a count that depends on the bucket. Each test
first checks that the non-deterministic backend splits them differently alone and in the big bucket,
so a backend that ignores deterministic mode fails here instead of passing by luck.

Bugs caught: ``deterministic`` dropped by the JAX backend or by the bridge's settings
(``server_args.enable_deterministic_inference``), a deterministic plan with more than one split.
The bridge's Mosaic launch path (Hopper) in deterministic mode keeps one key block whatever the batch
size (``MosaicConfig.batch_invariant``); a path whose key block followed the batch fails the last test.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jax_attn.backend import FlashAttentionBackend, LayerParams
from jax_attn.batch import ForwardBatch
from jax_attn.capture import StepRunner
from jax_attn.kv_cache import KVPool, paged_view
from jax_attn.metadata import ForwardMode
from tests.attention_cases import TOLERANCE, compare_per_sequence
from tests.attention_cases import reference as reference_attention
from tests.paging import shuffled_table
import torch_bridge

PAGE, CTX = 16, 8192
LENS = np.array([1100, 8000, 2100, 9, 40, 3], np.int32)  # the first three split (min_kv_per_split 512)
LONG = [0, 1, 2]
ROWS = np.arange(1, len(LENS) + 1, dtype=np.int32)
BUCKETS = (1, 64)  # alone; the long three and all six (padded to 64)
GROUPS = [[i] for i in LONG] + [LONG, list(range(len(LENS)))]


@dataclasses.dataclass(frozen=True)
class Setup:
    heads: tuple[int, int]
    head_dim: int
    dtype: str
    impl: str
    device: str


CPU = Setup((2, 1), 16, "float32", "triton", "cpu")  # interpret mode: few heads, small head dim
GPU = Setup((32, 8), 128, "bfloat16", "auto", "cuda")
ON_GPU = jax.default_backend() == "gpu"
def data(s: Setup, seed: int = 0):
    """req_to_token, K/V pools (NaN in every slot no sequence owns, 0 in slot 0) and one query per sequence."""
    hq, hkv = s.heads
    table, num_slots = shuffled_table(len(LENS), CTX, PAGE, seed)
    rng = np.random.default_rng(seed)
    k = np.full((num_slots, hkv, s.head_dim), np.nan, np.float32)
    v = np.full_like(k, np.nan)
    k[0] = v[0] = 0.0
    for r, n in zip(ROWS, LENS):
        k[table[r, :n]], v[table[r, :n]] = rng.standard_normal((2, n, hkv, s.head_dim))
    q = rng.standard_normal((len(LENS), hq * s.head_dim)).astype(np.float32)
    return table, num_slots, k, v, q


def batch(table, idx) -> ForwardBatch:
    rows, lens = ROWS[idx], LENS[idx]
    return ForwardBatch(ForwardMode.DECODE, rows, lens, table[rows, lens - 1])


def plan_splits(s: Setup, *, deterministic: bool, impl: str | None = None) -> dict:
    """``{group: [(seq_num_splits, max_splits) of each kernel schedule of the plan]}`` for each group in its
    bucket: a ``StepRunner`` whose step returns the plan's schedules (compiled once per bucket, no attention)."""
    table, num_slots, *_ = data(s)
    backend = FlashAttentionBackend(table, page_size=PAGE, max_context_len=CTX, impl=impl or s.impl,
                                    deterministic=deterministic, num_heads=s.heads, num_slots=num_slots)

    def step(md, tok):
        scheds = [x for x in (md.schedule, md.mosaic_schedule) if x is not None]
        return tok["x"], [(x.seq_num_splits, jnp.int32(x.max_splits)) for x in scheds]

    runner = StepRunner(backend, step, batch_buckets=BUCKETS, compile_cache=False)
    tok = {"x": np.zeros(len(LENS), np.int32)}
    runner.capture([batch(table, GROUPS[i]) for i in (0, 4)], tok, verbose=False)
    out = {}
    for g in GROUPS:
        scheds = runner.replay(batch(table, g), {"x": tok["x"][g]})[1]
        out[tuple(g)] = [(np.asarray(n)[:len(g)], int(m)) for n, m in scheds]
    return out


@functools.cache  # once per session and setup
def check_the_heuristic_splits(s: Setup):
    """The non-deterministic backend splits each long sequence alone, by another count in the big bucket:
    without deterministic mode these outputs would differ (the tests below cannot pass vacuously)."""
    splits = plan_splits(s, deterministic=False)
    kernel = -1  # the schedule the kernel runs: Mosaic's when the plan carries one
    alone = np.array([splits[(i,)][kernel][0][0] for i in LONG])
    full = splits[tuple(GROUPS[-1])][kernel][0][LONG]
    assert (alone > 1).all(), f"sequences of {LENS[LONG]} keys must split alone, got {alone}"
    assert (alone != full).any(), f"split counts alone {alone} and in bucket {BUCKETS[-1]} {full} must differ"


def expect_bitwise_equal(outs: dict, s: Setup, ref):
    """Every group's output of each sequence is bitwise its first; and the outputs match the reference."""
    for i in range(len(LENS)):
        seen = [(g, o[g.index(i)]) for g, o in outs.items() if i in g]
        first_g, first = seen[0]
        for g, o in seen[1:]:
            np.testing.assert_array_equal(o, first, err_msg=f"sequence {i} ({LENS[i]} keys): batch {list(g)} "
                                          f"vs batch {list(first_g)}")
    full = outs[tuple(GROUPS[-1])]
    cu = np.arange(len(LENS) + 1)
    compare_per_sequence(full, ref, cu, tol=TOLERANCE[s.dtype], what="deterministic decode vs reference")


def reference(s: Setup, table, k, v, q):
    hq, hkv = s.heads
    pt = table[ROWS][:, ::PAGE] // PAGE
    dtype = jnp.dtype(s.dtype)
    out = reference_attention(
        jnp.asarray(q, dtype).reshape(-1, hq, s.head_dim), paged_view(jnp.asarray(k, dtype), PAGE),
        paged_view(jnp.asarray(v, dtype), PAGE), jnp.asarray(LENS), jnp.arange(len(LENS) + 1, dtype=jnp.int32),
        jnp.asarray(pt), page_size=PAGE)
    return np.asarray(out.astype(jnp.float32)).reshape(len(LENS), -1)


# ----------------------------------------------------------------------------- JAX backend
def run_jax(s: Setup):
    check_the_heuristic_splits(s)
    table, num_slots, k, v, q = data(s)
    dtype = jnp.dtype(s.dtype)
    backend = FlashAttentionBackend(table, page_size=PAGE, max_context_len=CTX, impl=s.impl, deterministic=True,
                                    num_heads=s.heads, num_slots=num_slots)
    layer = LayerParams(*s.heads, s.head_dim)

    def step(md, tok, pool):
        return backend.forward(tok["q"], None, None, layer, pool, md, save_kv_cache=False)[0], None

    runner = StepRunner(backend, step, batch_buckets=BUCKETS, compile_cache=False)
    pool = KVPool(jnp.asarray(k, dtype), jnp.asarray(v, dtype))
    runner.capture([batch(table, g) for g in (GROUPS[0], GROUPS[4])], {"q": jnp.asarray(q, dtype)}, pool,
                   verbose=False)
    outs = {}
    for g in GROUPS:
        traces = runner.trace_count
        out, _ = runner.replay(batch(table, g), {"q": jnp.asarray(q[g], dtype)}, pool)
        assert runner.trace_count == traces, "each group must replay a captured bucket"
        outs[tuple(g)] = np.asarray(out.astype(jnp.float32))
    expect_bitwise_equal(outs, s, reference(s, table, k, v, q))


def test_jax_backend_is_bitwise_batch_and_bucket_invariant():
    run_jax(CPU)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_jax_backend_is_bitwise_batch_and_bucket_invariant_gpu():
    run_jax(GPU)


# ----------------------------------------------------------------------------- torch bridge
def run_bridge(s: Setup):
    check_the_heuristic_splits(s)
    table, _, k, v, q = data(s)
    hq, hkv = s.heads
    dtype = getattr(torch, s.dtype)
    pool = torch_bridge.MHATokenToKVPool([torch.from_numpy(k).to(s.device, dtype).clone()],
                                         [torch.from_numpy(v).to(s.device, dtype).clone()])
    runner = torch_bridge.ModelRunner(
        torch_bridge.ReqToTokenPool(torch.from_numpy(table).to(s.device).clone()), pool, torch_bridge.ModelConfig(CTX),
        page_size=PAGE, server_args=torch_bridge.ServerArgs(enable_deterministic_inference=True),
        attention_impl=s.impl, device=s.device)
    backend = torch_bridge.FlashAttentionBackend(runner, verbose=False)
    layer = torch_bridge.RadixAttention(hq, s.head_dim, s.head_dim**-0.5, hkv, 0)
    big = BUCKETS[-1]
    backend.init_cuda_graph_state(big, big)
    zeros = torch.zeros(big, dtype=torch.int64, device=s.device)
    backend.init_forward_metadata_capture_cuda_graph(big, big, zeros, zeros + 1, None, ForwardMode.DECODE, None)

    def i64(x):
        return torch.from_numpy(np.asarray(x, np.int64)).to(s.device)

    outs = {}
    for g in GROUPS:
        fb = batch(table, g)
        tb = torch_bridge.ForwardBatch(ForwardMode.DECODE, len(g), i64(fb.req_pool_indices), i64(fb.seq_lens),
                                       i64(fb.out_cache_loc), token_to_kv_pool=pool)
        if len(g) < len(LENS):  # eager plans of 1 and 3 requests
            backend.init_forward_metadata(tb)
        else:  # the graph bucket: padded to 64
            backend.init_forward_metadata_replay_cuda_graph(big, tb.req_pool_indices, tb.seq_lens, None, None,
                                                            ForwardMode.DECODE, None, None)
        out = backend.forward(torch.from_numpy(q[g]).to(s.device, dtype), None, None, layer, tb, save_kv_cache=False)
        outs[tuple(g)] = out.float().cpu().numpy()
    expect_bitwise_equal(outs, s, reference(s, table, k, v, q))


def test_bridge_is_bitwise_batch_and_bucket_invariant():
    run_bridge(CPU)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs a Hopper GPU (the launch path)")
def test_bridge_is_bitwise_batch_and_bucket_invariant_gpu():
    run_bridge(GPU)


def test_bridge_launch_path_is_bitwise_batch_invariant():
    """The bridge's Mosaic launch path (Hopper; here the Mosaic GPU interpreter, ``InterpretedKernel``) in
    deterministic mode: one request alone and in a batch of four. ``decode_min_ctas=4`` puts the batch of
    four (4 tokens x 2 kv heads) past the kernel's many-CTA threshold, as 33 decode tokens x 8 kv heads are
    on an H100 with the default config: a kernel that then took 64-key blocks instead of 128 (the
    non-deterministic choice) would change the bits of request 0."""
    import types

    from jax_attn.kernels.mosaic_paged import MosaicConfig
    from tests.test_bridge_launch import InterpretedKernel
    from torch_bridge.mosaic_path import MosaicPath

    hq, hkv, d, ctx = 4, 2, 64, 320
    lens, rows = np.array([300, 200, 150, 90]), np.arange(1, 5)
    table, num_slots = shuffled_table(4, ctx, PAGE, 0)
    rng = np.random.default_rng(0)
    k, v, q = (torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(torch.bfloat16)
               for shape in ((num_slots, hkv, d), (num_slots, hkv, d), (4, hq * d)))
    pool = torch_bridge.MHATokenToKVPool([k], [v])
    config = torch_bridge.ModelConfig(ctx)
    config.hf_text_config = types.SimpleNamespace(num_attention_heads=hq)  # the launch tables come with the plan
    config.get_num_kv_heads = lambda tp: hkv
    runner = torch_bridge.ModelRunner(torch_bridge.ReqToTokenPool(torch.from_numpy(table).clone()), pool, config,
                                      page_size=PAGE,
                                      server_args=torch_bridge.ServerArgs(enable_deterministic_inference=True))
    path = MosaicPath(make_kernel=InterpretedKernel, config=MosaicConfig(decode_min_ctas=4))
    backend = torch_bridge.FlashAttentionBackend(runner, mosaic_path=path, verbose=False)
    layer = torch_bridge.RadixAttention(hq, d, d**-0.5, hkv, 0)
    outs = []
    for g in ([0], [0, 1, 2, 3]):
        i64 = [torch.from_numpy(np.asarray(x, np.int64)) for x in (rows[g], lens[g], table[rows[g], lens[g] - 1])]
        fb = torch_bridge.ForwardBatch(ForwardMode.DECODE, len(g), *i64, token_to_kv_pool=pool)
        backend.init_forward_metadata(fb)
        calls = InterpretedKernel.calls
        outs.append(backend.forward(q[g], None, None, layer, fb, save_kv_cache=False).float().numpy()[0])
        assert InterpretedKernel.calls == calls + 1, "the layer must run on the launch path"
    np.testing.assert_array_equal(outs[1], outs[0], err_msg="request 0 alone vs in a batch of four")


# ----------------------------------------------------------------------------- the plan itself
@pytest.mark.parametrize("impl", ["triton", "mosaic"])
def test_deterministic_plan_has_one_split_per_sequence(impl):
    """Every kernel schedule of a deterministic plan has one split per sequence, in every bucket (the same
    plans without deterministic mode split: ``check_the_heuristic_splits``)."""
    for g, scheds in plan_splits(CPU, deterministic=True, impl=impl).items():
        assert len(scheds) == (2 if impl == "mosaic" else 1)
        for n, m in scheds:
            assert m == 1 and (n == 1).all(), f"{impl}, batch {list(g)}: deterministic plan with {n} splits (max {m})"
    if impl == "triton":
        check_the_heuristic_splits(CPU)
