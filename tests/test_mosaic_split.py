"""Tests of split-KV (flash-decoding) in the Mosaic GPU paged attention kernel.

CPU: the split kernel in the Mosaic GPU interpreter on small shapes, the split heuristic on
bucket shapes, and the split kernel lowered for CUDA (catches layout and shared-memory errors
the interpreter does not). GPU (``-m gpu``): long-context decode against the reference.

Run as a script on a GPU machine for a timing table of kv split counts (TB/s over the KV bytes):
  python -m tests.test_mosaic_split [1x32768 8x8192 ...]
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_attn.kernels.mosaic_paged import MosaicConfig, kernel_statics, paged_attention_mosaic, plan_mosaic_schedule
from jax_attn.kernels.mosaic_split import kernel_call_split
from jax_attn.metadata import AttentionMetadata, ForwardMode
from tests.attention_cases import Case, build_inputs, check_attention

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.gpu
HEADS = (32, 8)


def _c(name, seq_lens, **kw):
    kw = dict(dict(heads=(8, 2), head_dim=64, dtype="bfloat16", page_size=16), **kw)
    return Case(name=name, seq_lens=tuple(seq_lens), **kw)


# block_kv 64 on CPU: 300 keys are 5 blocks, so 3 splits get 2, 2 and 1 blocks; 70 keys get 2
# blocks and one empty split; 5 keys are shorter than one split (two empty splits).
SPLIT_CPU_CASES = [
    _c("decode3_split3", [(1, 300), (1, 70), (1, 5)], num_splits=3, pad_rows=1),
    _c("decode2_page64_split4", [(1, 600), (1, 64)], num_splits=4, heads=(4, 1), page_size=64),
    _c("verify_window_split2", [(4, 200), (4, 40)], num_splits=2, window=(50, 0), softmax_scale=0.3),
    _c("prefill_sinks_split3", [(20, 200), (3, 3)], num_splits=3, sinks=True, heads=(2, 1)),
    _c("decode_auto", [(1, 400)], num_splits=None, heads=(4, 1)),
]
# The heuristic case splits 400 keys only with small splits (the default is 512 keys at least).
_AUTO = MosaicConfig(block_kv=64, min_kv_per_split=64, max_splits=4)


def _config(case):
    if case.num_splits is None:
        return _AUTO
    return MosaicConfig(block_kv=128 if case.page_size == 64 else 64)


@pytest.mark.parametrize("case", SPLIT_CPU_CASES, ids=lambda c: c.name)
def test_split_interpret(case):
    config = _config(case)
    q, k, v, md, _ = build_inputs(case)
    sched = plan_mosaic_schedule(md, num_q_heads=case.heads[0], num_kv_heads=case.heads[1], config=config,
                                 num_splits=case.num_splits)
    assert sched.max_splits > 1, "the case must run the split kernel"
    fn = functools.partial(paged_attention_mosaic, config=config, interpret=plgpu.InterpretGPUParams())
    check_attention(fn, case)


def _uniform_md(batch: int, ctx: int, page_size: int = 16, q_len: int = 1) -> AttentionMetadata:
    """Metadata of a uniform batch (lengths and an identity page table; no cache needed)."""
    pages = -(-ctx // page_size)
    return AttentionMetadata(
        cache_seqlens=jnp.full((batch,), ctx, jnp.int32),
        cu_seqlens_q=jnp.arange(batch + 1, dtype=jnp.int32) * q_len,
        cu_seqlens_k=jnp.arange(batch + 1, dtype=jnp.int32) * ctx,
        page_table=jnp.arange(batch * pages, dtype=jnp.int32).reshape(batch, pages),
        out_cache_loc=jnp.zeros((batch * q_len,), jnp.int32), max_seqlen_q=jnp.int32(q_len),
        max_seqlen_k=jnp.int32(ctx), mode=ForwardMode.DECODE if q_len == 1 else ForwardMode.EXTEND,
        batch_size=batch, num_tokens=batch * q_len, page_size=page_size, max_q_len=q_len, max_pages=pages,
    )


@pytest.mark.parametrize("batch,ctx,num_splits,want_bound,want_seq", [
    (1, 32768, None, 16, 16),  # 8 CTAs per split: 16 splits fill 128 of 132 multiprocessors
    (8, 8192, None, 2, 2),  # 64 CTAs leave half the GPU idle: 2 splits fill 128 of 132 multiprocessors
    (4, 8192, None, 4, 4),  # 32 CTAs: 4 splits fill 128 of 132 multiprocessors
    (17, 4096, None, 1, 1),  # 136 CTAs: more than one wave unsplit
    (64, 4096, None, 1, 1),  # 512 CTAs already fill the GPU
    (1, 100, None, 1, 1),  # no split under 2 x 128 keys
    (1, 300, None, 3, 3),  # splits of at least 128 keys: 3
    (1, 5000, None, 16, 16),  # 16 splits of 313 keys (the 132 / 8 CTA bound)
    (1, 32768, 1, 1, 1),  # 1 = the unsplit kernel
    (2, 100, 4, 4, 4),  # explicit: exactly 4 per sequence, however short
])
def test_split_heuristic(batch, ctx, num_splits, want_bound, want_seq):
    md = _uniform_md(batch, ctx)
    sched = jax.jit(functools.partial(plan_mosaic_schedule, num_q_heads=HEADS[0], num_kv_heads=HEADS[1],
                                      num_splits=num_splits))(md)
    assert sched.max_splits == want_bound and sched.pack == 4
    np.testing.assert_array_equal(sched.seq_num_splits, want_seq)
    assert int(sched.num_tiles) == batch * want_seq
    tiles = np.asarray(sched.tile_split)[: batch * want_seq]
    assert sorted(tiles.tolist()) == sorted(list(range(want_seq)) * batch)


@pytest.mark.parametrize("case", [SPLIT_CPU_CASES[0], SPLIT_CPU_CASES[3]], ids=lambda c: c.name)
def test_tile_table(case):
    """Each tile's row of ``tile_info`` holds what the kernel would look up by sequence: a numpy port
    of that lookup, row by row, on ragged lengths (packed decode rows and one-head prefill rows)."""
    _, _, _, md, _ = build_inputs(case)
    sched = plan_mosaic_schedule(md, num_q_heads=case.heads[0], num_kv_heads=case.heads[1], config=_config(case),
                                 num_splits=case.num_splits)
    info, seq = np.asarray(sched.tile_info), np.asarray(sched.tile_seq)
    k_lens, cu = np.asarray(md.cache_seqlens), np.asarray(md.cu_seqlens_q)
    assert info.shape == (seq.shape[0], 8) and info.dtype == np.int32
    np.testing.assert_array_equal(info[:, 0], seq)
    valid = np.flatnonzero(seq >= 0)
    assert len(valid) == int(sched.num_tiles) > 0
    for n in valid:
        b = seq[n]
        want = [b, sched.tile_q_block[n] * sched.block_q, sched.tile_split[n], k_lens[b], cu[b], cu[b + 1] - cu[b],
                sched.seq_num_splits[b], 0]
        np.testing.assert_array_equal(info[n], want, err_msg=f"tile {n}")


@pytest.mark.parametrize("head_dim,block_kv,stages,q_len,solo", [
    (128, 128, 2, 1, False), (128, 64, 4, 1, False), (64, 128, 2, 1, False), (128, 128, 2, 100, False),
    (128, 64, 5, 1, True), (128, 128, 3, 1, True), (128, 64, 2, 1, True)])
def test_split_lowers_for_cuda(head_dim, block_kv, stages, q_len, solo):
    """The compiled (not interpreted) split kernel lowers, within the 227 KB of shared memory
    (q_len 100: unpacked rows, with sinks; ``solo``: one compute warpgroup's buffers, its float32
    output buffer inside the key ring, and the deeper ring that leaves room for)."""
    md = _uniform_md(1, 3000, q_len=q_len)
    config = MosaicConfig(block_kv=block_kv, stages=stages, solo=solo, split_decode_block_kv=block_kv,
                          split_decode_stages=stages)
    sched = plan_mosaic_schedule(md, num_q_heads=HEADS[0], num_kv_heads=HEADS[1], config=config,
                                 num_splits=None if q_len == 1 else 3)
    assert sched.max_splits > 1
    st = kernel_statics(num_tokens=md.num_tokens, num_q_heads=HEADS[0], num_kv_heads=HEADS[1], head_dim=head_dim,
                        head_dim_v=head_dim, page_size=16, pack=sched.pack, dtype=jnp.bfloat16, config=config,
                        num_splits=sched.max_splits, has_sinks=q_len > 1, max_q_len=q_len)
    assert st.solo == solo and (st.block_kv, st.stages) == (block_kv, stages)
    s = jax.ShapeDtypeStruct
    cache = s((md.page_table.size + 1, 16, HEADS[1], head_dim), jnp.bfloat16)
    q = (md.num_tokens, HEADS[1], st.pack, head_dim) if st.token_major else (md.num_tokens, HEADS[0], head_dim)
    args = (s(q, jnp.bfloat16), cache, cache, md.page_table, md.cu_seqlens_q, sched.tile_info,
            s((st.num_heads,), jnp.float32))
    fn = kernel_call_split(st, sched.tile_seq.shape[0])
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("q_len,causal,solo_stages", [(1, True, None), (1, True, 3), (100, True, None),
                                                     (128, True, None), (100, False, None)])
def test_unsplit_lowers_for_cuda(q_len, causal, solo_stages):
    """The compiled unsplit kernel lowers for CUDA: token-major packed rows (q_len 1, reshaped
    shared-memory views the interpreter does not run; with a 3-deep ring of 128-key blocks, within
    the 227 KB of shared memory) and one head per row (q_len 100: Q staged; q_len 128: a row count
    that is a multiple of 8, so aligned Q tiles load straight into place). Non-causal: Mosaic's
    layout inference once ran out of its search budget on that mask."""
    from jax_attn.kernels.mosaic_kernel import kernel_call

    md = _uniform_md(3, 3000, q_len=q_len)
    config = MosaicConfig(solo_stages=solo_stages)
    sched = plan_mosaic_schedule(md, num_q_heads=HEADS[0], num_kv_heads=HEADS[1], config=config)
    st = kernel_statics(num_tokens=md.num_tokens, num_q_heads=HEADS[0], num_kv_heads=HEADS[1], head_dim=128,
                        head_dim_v=128, page_size=16, pack=sched.pack, dtype=jnp.bfloat16, causal=causal,
                        config=config, max_q_len=q_len)
    assert st.token_major == (q_len == 1) and st.stages == (solo_stages or 2)
    s = jax.ShapeDtypeStruct
    cache = s((md.page_table.size + 1, 16, HEADS[1], 128), jnp.bfloat16)
    q = s((md.num_tokens, HEADS[1], st.pack, 128) if st.token_major else (md.num_tokens, HEADS[0], 128), jnp.bfloat16)
    args = (q, cache, cache, md.page_table, md.cu_seqlens_q, sched.tile_info, s((st.num_heads,), jnp.float32))
    text = jax.jit(kernel_call(st, sched.tile_seq.shape[0])).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


SPLIT_GPU_CASES = [
    _c("decode_1x32768", [(1, 32768)], heads=HEADS, head_dim=128, num_splits=None),
    _c("decode_4x8192", [(1, 8192)] * 4, heads=HEADS, head_dim=128, num_splits=4),  # (padded to 7 tokens, the
    # heuristic would count 7 possible sequences and not split)
    _c("decode_ragged_split8", [(1, n) for n in (20000, 700, 5, 4097)], heads=HEADS, head_dim=128, num_splits=8,
       pad_rows=2),
    _c("decode_page64_split16", [(1, 9000), (1, 100)], heads=HEADS, head_dim=128, num_splits=16, page_size=64),
    _c("verify_split4", [(4, 6000), (4, 300)], heads=HEADS, head_dim=128, num_splits=4),
    _c("prefill_sinks_split4", [(200, 5000)], heads=(16, 2), head_dim=128, num_splits=4, sinks=True),
    _c("decode_d64_f16_window", [(1, 12000), (1, 3000)], heads=(16, 16), head_dim=64, dtype="float16",
       num_splits=6, window=(1000, 0)),
]


@gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", SPLIT_GPU_CASES, ids=lambda c: c.name)
def test_split_gpu(case):
    q, k, v, md, _ = build_inputs(case)
    sched = plan_mosaic_schedule(md, num_q_heads=case.heads[0], num_kv_heads=case.heads[1],
                                 num_splits=case.num_splits)
    assert sched.max_splits > 1, "the case must run the split kernel"
    check_attention(paged_attention_mosaic, case)


@gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_split_gpu_batch_invariant():
    """With an explicit split count a sequence's output does not depend on the rest of the batch."""
    case = _c("batch", [(1, 9000), (1, 3000), (1, 20000)], heads=HEADS, head_dim=128, num_splits=8)
    q, k, v, md, _ = build_inputs(case)
    got = paged_attention_mosaic(q, k, v, md, num_splits=8)
    alone = dataclasses.replace(md, cache_seqlens=md.cache_seqlens[:1], cu_seqlens_q=md.cu_seqlens_q[:2],
                                cu_seqlens_k=md.cu_seqlens_k[:2], page_table=md.page_table[:1],
                                out_cache_loc=md.out_cache_loc[:1], batch_size=1, num_tokens=1)
    want = paged_attention_mosaic(q[:1], k, v, alone, num_splits=8)
    np.testing.assert_array_equal(np.asarray(got[:1], np.float32), np.asarray(want, np.float32))


def _time_table(shapes=((1, 32768), (8, 8192), (64, 4096)), splits=(None, 1, 2, 4, 8, 16), page_size=16):
    """Prints us per call and TB/s (KV bytes) for each decode shape and kv split count."""
    sys.path.insert(0, "benchmarks")
    import common  # noqa: E402  (benchmarks/common.py: CUPTI device timing)

    from jax_attn.kernels.triton_paged import paged_attention

    hq, hkv, d = HEADS[0], HEADS[1], 128
    print(f"{'B x ctx':>12} {'kernel (num_splits)':>20} {'S':>3} {'us':>8} {'TB/s':>6}  note")
    for batch, ctx in shapes:
        md = _uniform_md(batch, ctx, page_size)
        keys = jax.random.split(jax.random.key(0), 3)
        cache_shape = (md.page_table.size, page_size, hkv, d)
        k, v = (jax.random.normal(key, cache_shape, jnp.bfloat16) for key in keys[:2])
        q = jax.random.normal(keys[2], (batch, hq, d), jnp.bfloat16)
        gbytes = 2 * batch * ctx * hkv * d * 2 / 1e12
        runs = [("triton", None, jax.jit(paged_attention), md)]
        for ns in splits:
            sched = jax.jit(functools.partial(plan_mosaic_schedule, num_q_heads=hq, num_kv_heads=hkv,
                                              num_splits=ns))(md)
            runs.append((f"mosaic {ns}", sched.max_splits, jax.jit(functools.partial(paged_attention_mosaic,
                         num_splits=ns)), dataclasses.replace(md, mosaic_schedule=sched)))
        for name, bound, fn, mdx in runs:
            call = functools.partial(fn, q, k, v, mdx)
            t = common.time_device(call, jax.block_until_ready, calls=20) or common.time_jax(call, reps=10)
            print(f"{batch:>5} x {ctx:<5} {name:>20} {bound or '-':>3} {t.time_us:8.1f} {gbytes / t.time_us * 1e6:6.2f}"
                  f"  {t.note}")


if __name__ == "__main__":  # optional shapes as BxCTX, e.g. 1x32768 8x8192
    _time_table(*[tuple(tuple(int(x) for x in a.split("x")) for a in sys.argv[1:])] if sys.argv[1:] else [])
