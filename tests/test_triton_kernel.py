"""Tests of the Pallas (Triton-lowered) paged attention, its schedule and the merge kernels.

CPU: the Pallas interpreter on tiny shapes. GPU (``-m gpu``): compiled kernels on real shapes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

from jax_attn.kernels.config import KernelConfig, choose_block_q, kv_heads_per_program, tile_rows
from jax_attn.kernels.merge_state import merge_splits, merge_state
from jax_attn.kernels.schedule import build_schedule, max_num_tiles, plan_schedule, static_num_splits
from jax_attn.kernels.triton_paged import kernel_statics, paged_attention
from jax_attn.reference import merge_state_reference, paged_attention_reference
from tests.attention_cases import CPU_CASES, GPU_CASES, Case, build_inputs, check_attention, compare

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.gpu


# ----------------------------------------------------------------------------- attention cases
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_attention_interpret(case):
    err = check_attention(paged_attention, case, interpret=True)
    if case.dtype == "float32":
        assert err < 2e-5, f"interpreted f32 should be near exact, got {err:.2e}"


@gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_attention_gpu(case):
    check_attention(paged_attention, case)


@gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_small_cases_gpu(case):
    check_attention(paged_attention, case)


# ----------------------------------------------------------------------------- split-KV decode knobs
# Split-KV decode with several kv heads per program (masked cross-head logits, per-row descale and
# sinks, padding rows when the packed heads do not fill the tile) and its own tile sizes.
_PACKED = [
    (Case("pack4_fp8_sinks", ((1, 90), (1, 37), (1, 1)), heads=(16, 4), dtype="bfloat16", fp8=True, sinks=True,
          num_splits=3, pad_rows=1),
     KernelConfig(split_kv_heads=4, split_block_k=16, split_num_warps=2, split_num_stages=1, prefetch_pages=True)),
    (Case("pack_gcd_page1_window_softcap", ((1, 70), (1, 5)), heads=(8, 4), page_size=1, window=(20, 0),
          softcap=5.0, num_splits=None),
     KernelConfig(split_kv_heads=8, split_block_k=16, min_kv_per_split=16)),
]


@pytest.mark.parametrize("case,cfg", _PACKED, ids=[c.name for c, _ in _PACKED])
def test_split_decode_packed_heads(case, cfg):
    err = check_attention(functools.partial(paged_attention, config=cfg), case, interpret=True)
    if case.dtype == "float32":
        assert err < 2e-5, f"interpreted f32 should be near exact, got {err:.2e}"


@pytest.mark.parametrize("name", ["window", "split2_page1_gqa7"])
def test_prefetch_pages(name):
    """Page ids read one step ahead across the masked / unmasked / masked key loops."""
    case = next(c for c in CPU_CASES if c.name == name)
    cfg = KernelConfig(prefetch_pages=True, block_k=16, decode_block_k=16)
    err = check_attention(functools.partial(paged_attention, config=cfg), case, interpret=True)
    assert err < 2e-5, f"interpreted f32 should be near exact, got {err:.2e}"


@gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("pack", [2, 4, 8])
def test_split_decode_packed_heads_gpu(pack):
    case = next(c for c in GPU_CASES if c.name == "split_auto")
    cfg = KernelConfig(split_kv_heads=pack, split_block_k=128 // pack, max_splits=32, prefetch_pages=pack == 4)
    check_attention(functools.partial(paged_attention, config=cfg), case)
    check_attention(functools.partial(paged_attention, config=cfg), dataclasses.replace(case, fp8=True, sinks=True))


def test_split_knobs_choose_tiles_and_splits():
    cfg = KernelConfig(split_block_k=256, split_num_warps=8, split_num_stages=3, split_kv_heads=4, max_splits=64)
    assert cfg.tile_params(decode=True) == (128, 4, 2)  # decode values when the launch does not split
    assert cfg.tile_params(decode=True, split=True) == (256, 8, 3)
    assert cfg.tile_params(decode=False, split=True) == (64, 4, 3)
    assert KernelConfig(decode_num_warps=8).tile_params(decode=True, split=True) == (128, 8, 2)
    assert kv_heads_per_program(cfg, 8, decode=True, split=True) == 4
    assert kv_heads_per_program(cfg, 2, decode=True, split=True) == 2
    assert kv_heads_per_program(cfg, 8, decode=True, split=False) == 1
    assert kv_heads_per_program(cfg, 8, decode=False, split=True) == 1
    # One sequence, 8 kv heads: 2 packed programs per tile ask for 4x the splits of 8 programs; the splits fill
    # at most split_waves (2) programs per SM, 264 (rounded down: 33 splits of 8 programs, not 34)
    kw = dict(num_tokens=1, num_kv_heads=8, block_q=1, num_splits=None)
    assert static_num_splits(config=dataclasses.replace(cfg, split_kv_heads=1), decode=True, **kw) == 33
    assert static_num_splits(config=dataclasses.replace(cfg, max_splits=512), decode=True, **kw) == 132
    assert static_num_splits(config=dataclasses.replace(cfg, max_splits=256, split_kv_heads=1, split_waves=4),
                             decode=True, **kw) == 66
    # 8 sequences of 8 kv heads: 4 splits (256 programs, one wave), where rounding up gave 5 (320: a second wave)
    assert static_num_splits(config=KernelConfig(), decode=True, num_tokens=8, num_kv_heads=8, block_q=1,
                             num_splits=None) == 4
    # and on device each sequence gets the same count under a looser bound (rounding up would give 5)
    sched = build_schedule(jnp.full((8,), 8192, jnp.int32), jnp.arange(9, dtype=jnp.int32), num_tokens=8,
                           max_q_len=1, block_q=1, max_splits=9, num_kv_heads=8)
    assert np.asarray(sched.seq_num_splits).tolist() == [4] * 8
    assert static_num_splits(config=cfg, decode=True, num_tokens=64, num_kv_heads=8, block_q=1,
                             num_splits=None) == 1  # 512 programs fill the GPU: no split, no packing
    for bad in (dict(split_block_k=48), dict(split_num_warps=3), dict(split_kv_heads=3), dict(split_num_stages=0)):
        with pytest.raises(ValueError, match="must be"):
            KernelConfig(**bad)


def decode_statics(**over):
    """``((block_k, num_warps, num_stages), dot dtype)`` that ``kernel_statics`` gives a 32/8-head, d 128 decode
    launch (bf16, unsplit) with ``over`` changed."""
    kw = dict(num_tokens=128, num_q_heads=32, num_kv_heads=8, head_dim=128, head_dim_v=128, page_size=16,
              max_pages=4096, max_q_len=1, block_q=1, max_splits=1, dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
              causal=True, window_size=(-1, -1), softcap=0.0, softmax_scale=None, has_sinks=False,
              has_k_descale=False, has_v_descale=False, latent=False, config=KernelConfig(), interpret=False)
    st, knobs = kernel_statics(**{**kw, **over})
    return (st.block_k, *knobs), st.compute_dtype


def test_many_decode_tile_only_where_measured_and_never_batch_invariant():
    """``KernelConfig.many_decode_tile``: unsplit decode over one-row pages in a launch of at least 1024 (token, kv
    head) programs at head dims up to 128; a batch-invariant call (``num_splits=1``, deterministic mode) keeps the
    decode tile, or a request's bits would depend on how many others share its batch."""
    def tile(**over):
        return decode_statics(**{"page_size": 1, **over})[0]

    assert tile() == (64, 4, 3)  # 1024 programs
    assert tile(head_dim=80, head_dim_v=80) == (64, 4, 3)  # a 128 block
    for over in (dict(batch_invariant=True), dict(num_tokens=127), dict(page_size=16), dict(max_splits=2),
                 dict(head_dim=256, head_dim_v=256), dict(max_q_len=2, block_q=2)):
        assert tile(**over)[0] != 64 or over.get("max_q_len"), over
    assert tile(config=KernelConfig(many_decode_tile=None)) == (128, 4, 2)
    with pytest.raises(ValueError, match="many_decode_tile"):
        KernelConfig(many_decode_tile=(48, 4, 3))


def test_fp8_kv_decode_tile_and_f16_dots():
    """Over fp8 KV with 16-bit q the dots run in f16 (e4m3 -> f16 is one instruction per two values, -> bf16
    three); every unsplit decode tile, batch invariant or not, is ``fp8_decode_tile`` and every split one
    ``fp8_split_tile``; prefill tiles, 2-byte KV, float32 q, head dims over 128 and split tiles packing kv heads keep
    their tiles and dot types. Would catch the rule reaching 2-byte pools, prefill or packed split tiles, or the f16
    dots reverting to bf16 (the H200's slower fp8 decode)."""
    def statics(**over):
        return decode_statics(**{**dict(num_tokens=64, kv_dtype=jnp.float8_e4m3fn, has_k_descale=True,
                                        has_v_descale=True), **over})

    fp8_tile, fp8_split = KernelConfig().fp8_decode_tile, KernelConfig().fp8_split_tile
    assert (fp8_tile, fp8_split) == ((64, 2, 5), (128, 4, 3))
    for over in ({}, dict(batch_invariant=True), dict(page_size=1, num_tokens=256), dict(dtype=jnp.float16)):
        assert statics(**over) == (fp8_tile, jnp.float16), over
    assert statics(max_splits=4) == (fp8_split, jnp.float16)
    assert statics(kv_dtype=jnp.bfloat16) == ((128, 4, 2), jnp.bfloat16)  # 2-byte KV: as before
    assert statics(dtype=jnp.float32) == (fp8_tile, jnp.float32)
    assert statics(config=KernelConfig(fp8_f16_dots=False))[1] == jnp.bfloat16
    assert statics(max_q_len=16, block_q=4)[0] == (64, 4, 3)  # a prefill tile
    assert statics(head_dim=256, head_dim_v=256)[0] == (128, 4, 2)  # over 128: the 2-byte decode tile
    packed = KernelConfig(split_kv_heads=4, split_block_k=32)  # kv heads packed into split tiles: their own tile
    assert statics(max_splits=4, config=packed)[0] == (32, 4, 2)
    assert statics(config=KernelConfig(fp8_decode_tile=None))[0] == (128, 4, 2)
    with pytest.raises(ValueError, match="fp8_split_tile"):
        KernelConfig(fp8_split_tile=(96, 4, 3))


@pytest.mark.parametrize("num_splits", [None, 1])
def test_many_decode_tile_runs_right_and_only_without_batch_invariance(num_splits):
    """The many-program decode tile (64 keys, 3 stages; here from 8 programs on) against the reference over
    one-row pages, NaN-poisoned spare pages; the launch is named by its key block, so the jaxpr says which tile
    ran: 64 keys under the heuristic, the decode tile's 128 when the call must be batch invariant."""
    case = Case("many_decode_page1", ((1, 150), (1, 70), (1, 130), (1, 3)), page_size=1, heads=(4, 2),
                num_splits=num_splits, spare_pages=5)
    cfg = KernelConfig(many_decode_programs=8, num_sms=4)  # 14 programs fill "the GPU": no split under the heuristic
    err = check_attention(functools.partial(paged_attention, config=cfg), case, interpret=True)
    assert err < 2e-5, f"interpreted f32 should be near exact, got {err:.2e}"
    q, k, v, md, kwargs = build_inputs(case)
    jaxpr = str(jax.make_jaxpr(functools.partial(paged_attention, config=cfg, num_splits=num_splits, interpret=True,
                                                 **kwargs))(q, k, v, md))
    assert ("_k64" in jaxpr) == (num_splits is None) and ("_k128" in jaxpr) == (num_splits == 1)


@pytest.mark.parametrize("indexed", [False, True])
@pytest.mark.parametrize("num_splits,block_rows,num_sms", [(5, 4, 132), (40, 16, 132), (5, 4, 1), (2, 16, 1)])
def test_merge_splits_interpret(num_splits, block_rows, num_sms, indexed):
    """Rows merge partials [0, n), n the split count of the sequence holding the row's token (``seq_splits``:
    queries per sequence 1, 1, 3, 2, 2, then two padding tokens, which merge nothing); later partials hold NaN;
    empty ones have LSE -inf. With 132 SMs the 11 rows get one program each (all splits loaded at once); with 1,
    row blocks.
    ``indexed``: the LSEs lie shuffled in a larger NaN-filled buffer, found through ``lse_index``
    (-1 past a row's count), as the Mosaic split kernel leaves them."""
    rng = np.random.default_rng(num_splits)
    r, d = 11, 32
    po = rng.standard_normal((num_splits, r, d)).astype(np.float32)
    plse = (rng.standard_normal((num_splits, r)) * 4).astype(np.float32)
    cu = np.array([0, 1, 2, 5, 7, 9], np.int32)  # five sequences over tokens 0..8; tokens 9 and 10 pad
    seq_splits = rng.integers(0, num_splits + 1, 5).astype(np.int32)
    seq_splits[:2] = (0, num_splits)
    ns = np.concatenate([np.repeat(seq_splits, np.diff(cu)), [0, 0]]).astype(np.int32)
    plse[rng.random((num_splits, r)) < 0.25] = -np.inf
    plse[:, 2] = -np.inf  # every partial of row 2 empty
    for row in range(r):
        po[ns[row]:, row] = np.nan
        plse[ns[row]:, row] = np.nan
    cfg = KernelConfig(merge_block_rows=block_rows, num_sms=num_sms)
    if indexed:
        where = rng.permutation(3 * num_splits * r)[: num_splits * r].reshape(num_splits, r).astype(np.int32)
        flat = np.full(3 * num_splits * r, np.nan, np.float32)
        flat[where] = plse
        where[np.arange(num_splits)[:, None] >= ns[None, :]] = -1
        o, lse = merge_splits(jnp.asarray(po), jnp.asarray(flat), lse_index=jnp.asarray(where), out_dtype=jnp.float32,
                              config=cfg, interpret=True)
    else:
        o, lse = merge_splits(jnp.asarray(po), jnp.asarray(plse), (jnp.asarray(cu), jnp.asarray(seq_splits)),
                              num_heads=1, out_dtype=jnp.float32, config=cfg, interpret=True)
    want_o, want_lse = np.zeros((r, d), np.float32), np.full((r,), -np.inf, np.float32)
    for row in range(r):
        lse_r = plse[: ns[row], row]
        if ns[row] and np.isfinite(lse_r).any():
            w = np.exp(lse_r - lse_r.max())
            want_o[row] = (w[:, None] * np.where(w[:, None] > 0, po[: ns[row], row], 0)).sum(0) / w.sum()
            want_lse[row] = lse_r.max() + np.log(w.sum())
    compare(o, want_o, tol=1e-5, what="merged out")
    assert (np.isneginf(np.asarray(lse)) == np.isneginf(want_lse)).all()
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(np.asarray(lse)[fin], want_lse[fin], rtol=1e-5, atol=1e-5)


def test_merge_splits_warps_follow_its_kernel():
    """The one-row merge kernel (few rows: 32 here, one decode token of 32 heads) compiles with
    ``merge_row_num_warps``, the row-block kernel (1024 rows) with ``merge_num_warps``."""
    import re

    cfg = KernelConfig(merge_row_num_warps=2, merge_num_warps=16)
    for rows, want in ((32, 2), (1024, 16)):
        args = (jnp.zeros((32, rows, 128)), jnp.zeros((32, rows)), jnp.array([0, rows // 32], jnp.int32),
                jnp.ones((1,), jnp.int32))
        jaxpr = str(jax.make_jaxpr(lambda a, b, c, d: merge_splits(a, b, (c, d), num_heads=32, out_dtype=jnp.float32,
                                                                  config=cfg, interpret=True))(*args))
        assert set(re.findall(r"num_warps=(\d+)", jaxpr)) == {str(want)}, (rows, jaxpr[:200])
    with pytest.raises(ValueError, match="merge_row_num_warps"):
        KernelConfig(merge_row_num_warps=3)


# ----------------------------------------------------------------------------- ragged batches
_BUCKET_B, _BUCKET_T, _KV_MAX = 4, 24, 60


@settings(max_examples=8, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 8), st.integers(0, 40)), min_size=1, max_size=_BUCKET_B),
       st.sampled_from([1, 4]), st.integers(0, 2**16))
def test_ragged_batches(seqs, page_size, seed):
    """Random ragged batches inside one bucket (one compile per page size)."""
    seq_lens = tuple((q, q + extra) for q, extra in seqs)
    seq_lens = tuple((q, max(k, 1)) for q, k in seq_lens)
    n_tokens = sum(q for q, _ in seq_lens)
    case = dataclasses.replace(
        CPU_CASES[0], name="ragged", seq_lens=seq_lens, page_size=page_size, pad_tokens=_BUCKET_T - n_tokens,
        pad_rows=_BUCKET_B - len(seq_lens), spare_pages=2,
    )
    q, k, v, md, kw = build_inputs(case, seed)
    # Put every draw in the same static bucket so that the kernel compiles once.
    pages = -(-_KV_MAX // page_size) + 1
    table = jnp.zeros((_BUCKET_B, pages), jnp.int32).at[:, : md.page_table.shape[1]].set(md.page_table)
    md = dataclasses.replace(md, page_table=table, max_pages=pages, max_q_len=8)
    fixed_pages = _BUCKET_B * pages + 4
    nan_pages = jnp.full((fixed_pages - k.shape[0], *k.shape[1:]), jnp.nan, k.dtype)
    k, v = jnp.concatenate([k, nan_pages]), jnp.concatenate([v, nan_pages])
    out, lse = paged_attention(q, k, v, md, interpret=True, **kw)
    ref, ref_lse = paged_attention_reference(q, k, v, md.cache_seqlens, md.cu_seqlens_q, table,
                                             page_size=page_size, **kw)
    compare(out, ref, tol=2e-5, what="ragged out")
    assert (np.isneginf(lse) == np.isneginf(ref_lse)).all()


# ----------------------------------------------------------------------------- contracts
def test_attached_schedule_and_no_retrace():
    """A planner-attached schedule gives the same result; new lengths in the bucket do not retrace."""
    case = CPU_CASES[8]  # mixed
    q, k, v, md, kw = build_inputs(case, 1)
    cfg = KernelConfig()
    sched = plan_schedule(md, num_q_heads=case.heads[0], num_kv_heads=case.heads[1], config=cfg, num_splits=2)
    md2 = dataclasses.replace(md, schedule=sched)
    a = paged_attention(q, k, v, md, num_splits=2, interpret=True, **kw)
    b = paged_attention(q, k, v, md2, num_splits=2, interpret=True, **kw)
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(b[0]))
    # The jit cache gains an entry on the second call with the very same arguments (JAX's C++ dispatch
    # cache), so count after a repeat: a retrace for new lengths would still add one.
    paged_attention(q, k, v, md, num_splits=2, interpret=True, **kw)
    traces = paged_attention._cache_size()
    shorter = dataclasses.replace(md, cache_seqlens=md.cache_seqlens - 1)
    paged_attention(q, k, v, shorter, num_splits=2, interpret=True, **kw)
    assert paged_attention._cache_size() == traces, "changing lengths inside a bucket must not retrace"


def _check_batch_invariance(interpret):
    """num_splits=1: a request's output is bitwise the same whatever else is in the batch."""
    base = dataclasses.replace(CPU_CASES[8], num_splits=1)
    q, k, v, md, kw = build_inputs(base, 3)
    full = paged_attention(q, k, v, md, num_splits=1, interpret=interpret, **kw)[0]
    alone = dataclasses.replace(base, seq_lens=base.seq_lens[2:3])
    q2, _, _, md2, kw2 = build_inputs(alone, 3)
    # The same request (queries, cache pages) alone in a batch of one, same static q bound.
    start = int(md.cu_seqlens_q[2])
    ql, _ = base.seq_lens[2]
    q2 = q2.at[:ql].set(q[start:start + ql])
    md2 = dataclasses.replace(md2, page_table=md.page_table[2:3, : md2.page_table.shape[1]], max_q_len=md.max_q_len)
    one = paged_attention(q2, k, v, md2, num_splits=1, interpret=interpret, **kw2)[0]
    np.testing.assert_array_equal(np.asarray(one[:ql]), np.asarray(full[start:start + ql]))


def test_deterministic_batch_invariant():
    _check_batch_invariance(interpret=True)


@gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_deterministic_batch_invariant_gpu():
    _check_batch_invariance(interpret=False)


# ----------------------------------------------------------------------------- schedule / config
@settings(max_examples=10, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(1, 3000)), min_size=1, max_size=6),
       st.integers(1, 8), st.integers(1, 4), st.booleans())
@example(seqs=[(0, 1), (4, 1)], block_q=1, max_splits=1, force=False)  # more queries than keys
def test_schedule_covers_every_tile_once(seqs, block_q, max_splits, force):
    q_lens = np.array([q for q, _ in seqs], np.int32)
    k_lens = np.array([k for _, k in seqs], np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = int(cu[-1]) + 2
    s = build_schedule(jnp.asarray(k_lens), jnp.asarray(cu), num_tokens=t, max_q_len=max(int(q_lens.max()), 1),
                       block_q=block_q, max_splits=max_splits, num_kv_heads=2, force_splits=force, num_sms=16,
                       min_kv_per_split=256)
    ns = np.asarray(s.seq_num_splits)
    assert ((ns >= 1) & (ns <= max_splits)).all()
    if force:
        assert (ns == max_splits).all()
    want = {(b, qb, sp) for b in range(len(seqs)) for qb in range(-(-q_lens[b] // block_q)) for sp in range(ns[b])}
    seq, qb, sp = (np.asarray(x) for x in (s.tile_seq, s.tile_q_block, s.tile_split))
    got = [(int(a), int(b), int(c)) for a, b, c in zip(seq, qb, sp) if a >= 0]
    assert len(got) == len(set(got)) and set(got) == want
    assert int(s.num_tiles) == len(want) and (seq[len(want):] == -1).all()
    assert seq.shape[0] == max_num_tiles(num_tokens=t, batch_size=len(seqs), max_q_len=max(int(q_lens.max()), 1),
                                         block_q=block_q, max_splits=max_splits)


def test_config_checks_and_tiles():
    with pytest.raises(ValueError, match="power of 2"):
        KernelConfig(block_k=48)
    with pytest.raises(ValueError, match=">= 16"):
        KernelConfig(block_m=8)
    cfg = KernelConfig(block_m=128)
    assert choose_block_q(cfg, 7, 1) == 1 and tile_rows(1, 7) == 16
    assert choose_block_q(cfg, 7, 500) == 18 and tile_rows(18, 7) == 128
    assert choose_block_q(cfg, 4, 4) == 4 and tile_rows(4, 4) == 16


def test_input_checks():
    q, k, v, md, kw = build_inputs(CPU_CASES[0])
    with pytest.raises(ValueError, match="query heads must be a multiple"):
        paged_attention(q[:, :3], k, v, md, interpret=True)
    with pytest.raises(ValueError, match="page size"):
        paged_attention(q, k.reshape(-1, 8, *k.shape[2:]), v.reshape(-1, 8, *v.shape[2:]), md, interpret=True)


# ----------------------------------------------------------------------------- merge_state
def _merge_inputs(seed, t=13, h=3, d=32, dtype=jnp.float32, empty=0.3):
    rng = np.random.default_rng(seed)
    o_a, o_b = (jnp.asarray(rng.standard_normal((t, h, d)), dtype) for _ in range(2))
    la, lb = (rng.standard_normal((t, h)).astype(np.float32) * 3 for _ in range(2))
    la[rng.random((t, h)) < empty] = -np.inf
    lb[rng.random((t, h)) < empty] = -np.inf
    la[0, :] = lb[0, :] = -np.inf  # both empty
    return o_a, jnp.asarray(la), o_b, jnp.asarray(lb)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merge_state_interpret(dtype):
    o_a, la, o_b, lb = _merge_inputs(0, dtype=jnp.dtype(dtype))
    o_a = o_a.at[1].set(jnp.nan)  # garbage in an empty partition must not leak
    la = la.at[1].set(-jnp.inf)
    o, lse = merge_state(o_a, la, o_b, lb, interpret=True)
    ro, rl = merge_state_reference(o_a, la, o_b, lb)
    compare(o, ro, tol=1e-5 if dtype == "float32" else 1e-2, what="merge out")
    assert (np.isneginf(lse) == np.isneginf(rl)).all() and not np.asarray(o[0], np.float32).any()
    fin = np.isfinite(np.asarray(rl))
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(rl)[fin], rtol=1e-6, atol=1e-6)


def test_merge_state_reads_part_a_lse_through_an_index():
    """``lse_a_index``: part a's LSE scattered over a larger flat array (the Mosaic kernel's per-tile LSE),
    ``-1`` for rows no tile wrote. Catches: the index ignored (rows read in order), -1 read as position 0
    (an empty partial merged with a stale LSE), and garbage beside the indexed LSEs leaking in."""
    o_a, la, o_b, lb = _merge_inputs(2)
    t, h = la.shape
    rng = np.random.default_rng(5)
    flat = rng.standard_normal(4 * t * h).astype(np.float32) * 50  # garbage everywhere not indexed
    pos = (1 + rng.permutation(flat.size - 1)[:t * h]).reshape(t, h).astype(np.int32)  # never position 0
    flat[pos] = np.asarray(la)
    pos[np.isneginf(np.asarray(la))] = -1  # an empty partial: no tile wrote its LSE
    flat[0] = 1e3  # a -1 read as position 0 would dominate the merge
    o, lse = merge_state(o_a, jnp.asarray(flat), o_b, lb, lse_a_index=jnp.asarray(pos), interpret=True)
    ro, rl = merge_state_reference(o_a, la, o_b, lb)
    compare(o, ro, tol=1e-5, what="indexed merge out")
    fin = np.isfinite(np.asarray(rl))
    assert (np.isneginf(lse) == np.isneginf(rl)).all()
    np.testing.assert_allclose(np.asarray(lse)[fin], np.asarray(rl)[fin], rtol=1e-6, atol=1e-6)


@gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_merge_state_gpu():
    o_a, la, o_b, lb = _merge_inputs(1, t=1000, h=32, d=128, dtype=jnp.bfloat16)
    o, lse = merge_state(o_a, la, o_b, lb)
    ro, rl = merge_state_reference(o_a, la, o_b, lb)
    compare(o, ro, tol=1e-2, what="merge out")
    assert (np.isneginf(lse) == np.isneginf(rl)).all()


@pytest.mark.parametrize("page_size, max_pages, want", [(1, 8, 16), (1, 40, 64), (16, 2, 32), (16, 256, None)])
def test_key_block_fits_the_static_key_bound(page_size, max_pages, want):
    """A plan whose tables bound every sequence to a few keys (a tree step's expand pass: its draft tokens)
    gets key blocks no longer than that bound, rounded up to a power of 2 (at least 16); long plans keep the
    config's block. Catches: the expand pass of 8 keys per token compiled with 128-key blocks (16x the
    masked loads and dots: 22 us of a 32-layer verify step's 125 us per layer on an H100)."""
    kw = dict(num_tokens=32, num_q_heads=8, num_kv_heads=2, head_dim=64, head_dim_v=64, page_size=page_size,
              max_pages=max_pages, max_q_len=1, block_q=1, max_splits=1, dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16,
              causal=True, window_size=(-1, -1), softcap=0.0, softmax_scale=None, has_sinks=False,
              has_k_descale=False, has_v_descale=False, latent=False, config=KernelConfig(), interpret=True)
    full = KernelConfig().tile_params(True, False)[0]
    assert kernel_statics(**kw)[0].block_k == (full if want is None else min(full, want))
