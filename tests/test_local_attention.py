"""Chunked local attention (Llama-4 iRoPE, #22): the oracle against vLLM's published arrays, the
jitted planner against the oracle, and the JAX backend's local layers against a float64 reference
with the chunk mask, in every supported mode, eager and replayed."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_attn.backend import FlashAttentionBackend, LayerParams
from jax_attn.batch import ForwardBatch, SpecInfo
from jax_attn.capture import StepRunner
from jax_attn.kv_cache import KVPool
from jax_attn.local import local_pages, max_virtual_rows, plan_local
from jax_attn.metadata import ForwardMode
from jax_attn.planner import plan_extend, plan_uniform
from tests.oracle_local import chunk_mask, make_local_virtual_batches
from tests.paging import shuffled_table

# ----------------------------------------------------------------------------- (a) oracle vs vLLM
# vLLM's tests/v1/attention/test_chunked_local_attention.py: (query_lens, seq_lens, chunk, block size,
# expected q lens, expected k lens, expected local block table). The block table there is
# arange(batch * ncols) by rows, ncols = ceil(max(seq_lens) / block_size).
VLLM_CASES = [
    ([4, 10, 5], [6, 17, 9], 4, 2, [2, 2, 1, 4, 4, 1, 4, 1], [4, 2, 4, 4, 4, 1, 4, 1],
     [[0, 1], [2, 3], [11, 12], [13, 14], [15, 16], [17, 17], [20, 21], [22, 23]]),
    ([8], [12], 4, 2, [4, 4], [4, 4], [[2, 3], [4, 5]]),
    ([7], [10], 4, 2, [1, 4, 2], [4, 4, 2], [[0, 1], [2, 3], [4, 4]]),
    ([4], [6], 10, 2, [4], [6], [[0, 1, 2, 2, 2]]),
    ([6, 6], [8, 8], 4, 4, [2, 4, 2, 4], [4, 4, 4, 4], [[0], [1], [2], [3]]),
    ([1], [5], 4, 2, [1], [1], [[2, 2]]),
]
# vLLM's virtual-row counts for its bound test (block size 16): (query_lens, seq_lens, chunk, rows).
VLLM_COUNTS = [([1000], [1000], 256, 4), ([1000], [1255], 256, 5), ([300, 700, 90], [300, 1400, 90], 128, 10),
               ([64, 64], [64, 64], 256, 2), ([1, 1, 1, 1], [16, 32, 48, 64], 16, 4)]


def _arange_table(seq_lens, block):
    ncols = -(-max(seq_lens) // block)
    return np.arange(len(seq_lens) * ncols).reshape(len(seq_lens), ncols)


@pytest.mark.parametrize("case", VLLM_CASES, ids=range(len(VLLM_CASES)))
def test_oracle_matches_vllm(case):
    q_lens, seq_lens, chunk, block, want_q, want_k, want_table = case
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    q, cu_local, k, table = make_local_virtual_batches(chunk, cu, seq_lens, _arange_table(seq_lens, block), block)
    np.testing.assert_array_equal(q, want_q)
    np.testing.assert_array_equal(cu_local, np.concatenate([[0], np.cumsum(want_q)]))
    np.testing.assert_array_equal(k, want_k)
    np.testing.assert_array_equal(table, want_table)
    # The seed's chunk clamp (chunk -> max(seq_lens), page aligned) changes only the table's width here.
    q2, _, k2, table2 = make_local_virtual_batches(chunk, cu, seq_lens, _arange_table(seq_lens, block), block,
                                                   seed_clamp=True)
    np.testing.assert_array_equal(q2, want_q)
    np.testing.assert_array_equal(k2, want_k)
    np.testing.assert_array_equal(table2, np.asarray(want_table)[:, :table2.shape[1]])


def test_seed_clamp_splits_a_short_unaligned_sequence():
    """Why the planner does not copy the seed's clamp: with page 16, chunk 8192 and a longest
    sequence of 100, the seed cuts at 96, so tokens 96..99 lose keys 0..95."""
    q, _, k, _ = make_local_virtual_batches(8192, np.array([0, 100]), np.array([100]), np.zeros((1, 7), int), 16,
                                            seed_clamp=True)
    assert list(q) == [96, 4] and list(k) == [96, 4]
    q, _, k, _ = make_local_virtual_batches(8192, np.array([0, 100]), np.array([100]), np.zeros((1, 7), int), 16)
    assert list(q) == [100] and list(k) == [100]


# ----------------------------------------------------------------------------- (b) planner vs oracle
NUM_ROWS, WIDTH, B_BUCKET = 12, 256, 8


def _check_local(md, chunk, q_lens, kv_lens):
    """plan_local(md) against the oracle on md's own page table; padding rows by the padding rule."""
    loc = plan_local(md, chunk_size=chunk)
    pt = np.asarray(md.page_table)
    n = len(q_lens)
    cu = np.concatenate([[0], np.cumsum(q_lens)])
    want_q, want_cu, want_k, want_table = make_local_virtual_batches(chunk, cu, kv_lens, pt[:n], md.page_size)
    v = len(want_q)
    cs, cu_l, table = (np.asarray(a) for a in (loc.cache_seqlens, loc.cu_seqlens_q, loc.page_table))
    assert v <= loc.batch_size == max_virtual_rows(
        chunk_size=chunk, batch_size=md.batch_size, num_tokens=md.num_tokens, max_kv_len=md.max_kv_len,
        q_len_per_req=md.max_q_len if md.mode != ForwardMode.EXTEND else None)
    assert loc.max_pages == local_pages(chunk_size=chunk, page_size=md.page_size, max_pages=md.max_pages)
    assert int(loc.errors) == 0
    np.testing.assert_array_equal(cs[:v], want_k)
    np.testing.assert_array_equal(cu_l[:v + 1], want_cu)
    for i in range(v):
        used = -(-int(want_k[i]) // md.page_size)
        np.testing.assert_array_equal(table[i, :used], want_table[i, :used], err_msg=f"virtual row {i}")
        assert not table[i, used:].any(), f"virtual row {i}: columns past its chunk's last page must be 0"
    # Rows of padded batch rows, then rows past the last virtual sequence: no queries, one key, page 0.
    assert (np.diff(cu_l)[v:] == 0).all() and (cs[v:] == 1).all() and not table[v:].any()
    assert int(loc.max_seqlen_q) == want_q.max() and int(loc.max_seqlen_k) == max(want_k.max(), 1)
    np.testing.assert_array_equal(np.asarray(loc.out_cache_loc), np.asarray(md.out_cache_loc))


def _table(rng, page_size):
    return jnp.asarray(shuffled_table(NUM_ROWS - 1, WIDTH, page_size, int(rng.integers(1 << 30)))[0])


def _pad(x, fill, size=B_BUCKET):
    return jnp.asarray(np.concatenate([x, np.full(size - len(x), fill)]).astype(np.int32))


@settings(max_examples=10, deadline=None)
@given(data=st.data(), page_size=st.sampled_from([1, 16]))
def test_planner_matches_oracle_extend(data, page_size):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    chunk = page_size * data.draw(st.integers(1, 4 if page_size == 16 else 40))
    n = data.draw(st.integers(1, B_BUCKET))
    kv = rng.integers(1, 200, n)
    q = np.minimum(rng.integers(0, 512 // B_BUCKET + 1, n), kv)  # every query fits the 512-token bucket
    rows = rng.permutation(np.arange(1, NUM_ROWS))[:n]
    md = plan_extend(_table(rng, page_size), _pad(rows, 0), _pad(kv, 1), _pad(q, 0), jnp.zeros(512, jnp.int32),
                     page_size=page_size, max_pages=WIDTH // page_size, max_q_len=512)
    _check_local(md, chunk, np.concatenate([q, np.zeros(B_BUCKET - n, int)]),
                 np.concatenate([kv, np.ones(B_BUCKET - n, int)]))


@settings(max_examples=8, deadline=None)
@given(data=st.data(), page_size=st.sampled_from([1, 16]), q_len=st.sampled_from([1, 4]))
def test_planner_matches_oracle_uniform(data, page_size, q_len):
    """Decode (1 query per row) and verify (4): padded rows (seq_len 1 + offset) are ordinary rows."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31 - 1)))
    chunk = page_size * data.draw(st.integers(1, 3 if page_size == 16 else 20))
    n = data.draw(st.integers(1, B_BUCKET))
    seq = rng.integers(1, 200, n)
    mode = ForwardMode.DECODE if q_len == 1 else ForwardMode.TARGET_VERIFY
    md = plan_uniform(_table(rng, page_size), _pad(rng.permutation(np.arange(1, NUM_ROWS))[:n], 0), _pad(seq, 1),
                      jnp.zeros(B_BUCKET * q_len, jnp.int32), q_len_per_req=q_len, kv_offset=q_len - 1,
                      page_size=page_size, max_pages=WIDTH // page_size, mode=mode)
    kv = np.concatenate([seq, np.ones(B_BUCKET - n, int)]) + q_len - 1
    _check_local(md, chunk, np.full(B_BUCKET, q_len), kv)


@pytest.mark.parametrize("q_lens,seq_lens,chunk,rows", VLLM_COUNTS)
def test_virtual_row_counts_and_bound(q_lens, seq_lens, chunk, rows):
    """vLLM's published counts; the static bound of a tight bucket holds them."""
    width = -(-max(seq_lens) // 16) * 16
    table = jnp.asarray(np.tile(np.arange(width, dtype=np.int32), (len(q_lens), 1)))
    t = sum(q_lens)
    md = plan_extend(table, jnp.arange(len(q_lens), dtype=jnp.int32), jnp.asarray(seq_lens, jnp.int32),
                     jnp.asarray(q_lens, jnp.int32), jnp.zeros(t, jnp.int32), page_size=16,
                     max_pages=table.shape[1] // 16, max_q_len=t)
    loc = plan_local(md, chunk_size=chunk)
    assert int(np.sum(np.diff(np.asarray(loc.cu_seqlens_q)) > 0)) == rows
    assert rows <= loc.batch_size and int(loc.errors) == 0


def test_virtual_row_bound_is_reached():
    """The ragged bound is tight: rows of 2 queries straddling a chunk edge plus one long run
    starting on a chunk's last position reach it exactly."""
    chunk, b = 128, 3
    q_lens, seq_lens = [2, 2, 1086], [129, 129, 127 + 1086]
    width = -(-max(seq_lens) // 16) * 16
    table = jnp.asarray(np.tile(np.arange(width, dtype=np.int32), (b, 1)))
    md = plan_extend(table, jnp.arange(b, dtype=jnp.int32), jnp.asarray(seq_lens, jnp.int32),
                     jnp.asarray(q_lens, jnp.int32), jnp.zeros(sum(q_lens), jnp.int32), page_size=16,
                     max_pages=width // 16, max_q_len=sum(q_lens))
    loc = plan_local(md, chunk_size=chunk)
    assert loc.batch_size == 14 and int(np.sum(np.diff(np.asarray(loc.cu_seqlens_q)) > 0)) == 14


def test_chunk_must_be_page_aligned():
    with pytest.raises(ValueError, match="multiple of page_size"):
        FlashAttentionBackend(np.zeros((2, 64), np.int32), page_size=16, attention_chunk_size=24)


# ----------------------------------------------------------------------------- backend vs float64
HQ, HKV, D = 4, 2, 16
LOCAL = LayerParams(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, use_irope=True)
GEOM = {1: (8, 40), 16: (32, 112)}  # page size -> (chunk, max context): 3 to 5 chunks per sequence
MODES = ("extend", "mixed", "decode", "draft_decode", "verify")


def _lengths(mode, rng, bs, ctx, chunk):
    """(committed KV before this step, new queries) per request; sequences cross chunk boundaries,
    and request 0's new tokens start on the last position of a chunk (verify: they straddle it)."""
    if mode in ("decode", "draft_decode", "verify"):
        prior = rng.integers(ctx // 3, ctx - 4, bs)
        prior[0] = 2 * chunk - 1
        return prior, np.full(bs, 3 if mode == "verify" else 1)
    q = rng.integers(1, ctx // 2, bs)
    if mode == "mixed":
        q[::2] = 1
    return rng.integers(0, ctx // 2, bs), q


def _batch(mode, table, rows, prior, q):
    """ForwardBatch of ``mode``: new tokens right after ``prior`` tokens (draft decode: 1 earlier draft)."""
    loc = np.concatenate([table[r, p:p + n] for r, p, n in zip(rows, prior, q)]).astype(np.int32)
    kv = (prior + q).astype(np.int32)
    if mode == "verify":
        return ForwardBatch(ForwardMode.TARGET_VERIFY, rows, prior.astype(np.int32), loc,
                            spec_info=SpecInfo(num_draft_tokens=3))
    if mode == "draft_decode":  # SGLang passes the committed length; kv offset step_id + 1 = 2
        return ForwardBatch(ForwardMode.DECODE, rows, kv - 2, loc, spec_info=SpecInfo(step_id=1))
    if mode == "decode":
        return ForwardBatch(ForwardMode.DECODE, rows, kv, loc)
    fm = ForwardMode.MIXED if mode == "mixed" else ForwardMode.EXTEND
    return ForwardBatch(fm, rows, kv, loc, extend_seq_lens=q.astype(np.int32))


def _pool(num_slots, table, rows, prior, q, chunk, rng, d=D):
    """K/V of the committed tokens; NaN in every other slot and in every chunk before the chunk of a
    request's first query (no query may read those) but slot 0."""
    k = np.full((num_slots, HKV, d), np.nan, np.float32)
    v = k.copy()
    k[0] = v[0] = 0
    for r, p, n in zip(rows, prior, q):
        lo = (p // chunk) * chunk  # first key any of this step's queries sees
        k[table[r, lo:p]] = rng.standard_normal((p - lo, HKV, d))
        v[table[r, lo:p]] = rng.standard_normal((p - lo, HKV, d))
    return k, v


def _expected(k, v, table, rows, prior, q, tok, chunk):
    """float64 attention with the chunk mask, per request, over the K/V after this step's writes."""
    d = k.shape[-1]
    k, v = k.astype(np.float64), v.astype(np.float64)
    loc = np.concatenate([table[r, p:p + n] for r, p, n in zip(rows, prior, q)])
    k[loc] = np.asarray(tok["k"].astype(jnp.float32), np.float64).reshape(-1, HKV, d)
    v[loc] = np.asarray(tok["v"].astype(jnp.float32), np.float64).reshape(-1, HKV, d)
    qs = np.asarray(tok["q"].astype(jnp.float32), np.float64).reshape(-1, HQ, d)
    out, at = [], 0
    for r, p, n in zip(rows, prior, q):
        kl = p + n
        m = chunk_mask(np.arange(p, kl), kl, chunk)  # [n, kl]
        lo = (p // chunk) * chunk  # earlier keys are NaN: take only the columns the mask may keep
        kk, vv = k[table[r, lo:kl]], v[table[r, lo:kl]]
        qq = qs[at:at + n].reshape(n, HKV, HQ // HKV, d)
        s = np.einsum("nhgd,khd->nhgk", qq, kk) * d ** -0.5
        s = np.where(m[:, None, None, lo:], s, -np.inf)
        w = np.exp(s - s.max(-1, keepdims=True))
        out.append(np.einsum("nhgk,khd->nhgd", w / w.sum(-1, keepdims=True), vv).reshape(n, HQ * d))
        at += n
    return np.concatenate(out)


def _tokens(rng, n, d=D, dtype=jnp.float32):
    return {name: jnp.asarray(rng.standard_normal((n, h * d)), dtype) for name, h in (("q", HQ), ("k", HKV), ("v", HKV))}


def _local_step(backend, layer=LOCAL):
    def step(md, tok, pool):
        return backend.forward(tok["q"], tok["k"], tok["v"], layer, pool, md)
    return step


def _setup(mode, page_size, impl, seed, bs=5, d=D, lengths=None):
    rng = np.random.default_rng(seed)
    chunk, ctx = GEOM[page_size]
    table, num_slots = shuffled_table(16, ctx, page_size, seed)
    backend = FlashAttentionBackend(table, page_size=page_size, max_context_len=ctx, impl=impl, num_heads=(HQ, HKV),
                                    num_slots=num_slots, attention_chunk_size=chunk)
    rows = rng.choice(np.arange(1, 17), bs, replace=False).astype(np.int32)
    prior, q = _lengths(mode, rng, bs, ctx, chunk) if lengths is None else (np.asarray(a) for a in lengths)
    k, v = _pool(num_slots, table, rows, prior, q, chunk, rng, d)
    return rng, chunk, table, backend, rows, prior, q, k, v


def _check_rows(got, want, q, tol):
    """Per-row comparison that names the request and query of the first bad row."""
    got = np.asarray(got)
    assert np.isfinite(got).all(), "a local layer read a NaN page (outside its chunk or unused)"
    err = np.abs(got - want).max(-1)
    bad = np.flatnonzero(err > tol)
    if bad.size:
        req = np.searchsorted(np.cumsum(q), bad[0], side="right")
        pytest.fail(f"token {bad[0]} (request {req}) off by {err[bad[0]]:.2e} > {tol}")


# Every mode at both page sizes with the reference impl; the Triton kernel (slow in CPU interpret
# mode) on the ragged modes and verify here, on decode in test_local_replay_equals_eager.
CHUNK_CASES = ([(m, p, "reference") for m in MODES for p in (1, 16)]
               + [("extend", 16, "triton"), ("mixed", 1, "triton"), ("verify", 16, "triton")])


@pytest.mark.parametrize("mode,page_size,impl", CHUNK_CASES)
def test_local_layer_matches_chunk_mask_reference(mode, page_size, impl):
    rng, chunk, table, backend, rows, prior, q, k, v = _setup(mode, page_size, impl, seed=len(mode) + page_size)
    md = backend.plan(_batch(mode, table, rows, prior, q))
    tok = _tokens(rng, int(q.sum()))
    out, pool = jax.jit(_local_step(backend))(md, tok, KVPool(jnp.asarray(k), jnp.asarray(v)))
    _check_rows(out, _expected(k, v, table, rows, prior, q, tok, chunk), q, 2e-4)
    _check_virtual_tables(md, table, rows, prior + q, q, chunk, page_size)


@pytest.mark.parametrize("mode", ["extend", pytest.param("decode", marks=pytest.mark.gpu),
                                  pytest.param("verify", marks=pytest.mark.gpu)])
def test_local_layer_mosaic(mode):
    """The Mosaic GPU kernel on a local layer (bf16, head dim 64, page size 16); on CPU interpreted,
    where only the multi-chunk extend runs (the interpreter is slow)."""
    d = 64
    layer = dataclasses.replace(LOCAL, head_dim=d)
    lengths = ([30, 5], [40, 3]) if mode == "extend" else None  # CPU: one request over chunks 0-2, one short
    rng, chunk, table, backend, rows, prior, q, k, v = _setup(mode, 16, "mosaic", seed=5, bs=2, d=d, lengths=lengths)
    k, v = (np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32)) for x in (k, v))  # what the pool holds
    md = backend.plan(_batch(mode, table, rows, prior, q))
    tok = _tokens(rng, int(q.sum()), d, jnp.bfloat16)
    pool = KVPool(jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16))
    out, _ = jax.jit(_local_step(backend, layer))(md, tok, pool)
    _check_rows(np.asarray(out.astype(jnp.float32)), _expected(k, v, table, rows, prior, q, tok, chunk), q, 3e-2)


def _check_virtual_tables(md, table, rows, kv, q, chunk, page_size):
    """Each virtual row's used columns are exactly its chunk's pages, in order; nothing else."""
    loc = md.local
    assert loc.max_pages == min(chunk // page_size, md.max_pages)
    cs, pt = np.asarray(loc.cache_seqlens), np.asarray(loc.page_table)
    q_l = np.diff(np.asarray(loc.cu_seqlens_q))
    v = 0
    for r, n, nq in zip(rows, kv, q):
        for c in range((n - nq) // chunk, (n - 1) // chunk + 1):  # the chunks this step's queries sit in
            start = c * chunk
            want_q = min(n, start + chunk) - max(n - nq, start)
            assert (q_l[v], cs[v]) == (want_q, min(n, start + chunk) - start), f"virtual row {v}"
            keys = table[r, start:start + cs[v]]
            pages = keys[::page_size] // page_size if page_size > 1 else keys
            np.testing.assert_array_equal(pt[v, :len(pages)], pages, err_msg=f"virtual row {v}")
            assert not pt[v, len(pages):].any(), f"virtual row {v}: a page outside its chunk"
            v += 1
    assert (q_l[v:] == 0).all() and (cs[v:] == 1).all() and not pt[v:].any(), "padding rows: no query, page 0"


@pytest.mark.parametrize("mode,page_size,impl", [("decode", 1, "triton"), ("decode", 16, "reference"),
                                                  ("verify", 16, "reference"), ("draft_decode", 1, "reference")])
def test_local_replay_equals_eager(mode, page_size, impl):
    """StepRunner: capture a bucket with one set of lengths, replay a smaller batch with others
    (no retrace) == eager == the chunk-mask reference."""
    rng, chunk, table, backend, rows, prior, q, k, v = _setup(mode, page_size, impl, seed=7, bs=3)
    runner = StepRunner(backend, _local_step(backend), batch_buckets=(4,), compile_cache=False)
    pool = KVPool(jnp.asarray(k), jnp.asarray(v))
    per = int(q[0])
    runner.capture([_batch(mode, table, np.arange(1, 5, dtype=np.int32), np.full(4, 20), np.full(4, per))],
                   _tokens(rng, 4 * per), pool, verbose=False)
    tok = _tokens(rng, int(q.sum()))
    fb = _batch(mode, table, rows, prior, q)
    traces = runner.trace_count
    got = np.asarray(runner.replay(fb, tok, pool)[0])
    assert runner.trace_count == traces, "replay inside a captured bucket must not retrace"
    np.testing.assert_allclose(got, np.asarray(runner.eager(fb, tok, pool)[0]), rtol=2e-5, atol=2e-5)
    _check_rows(got, _expected(k, v, table, rows, prior, q, tok, chunk), q, 2e-4)


def test_local_layer_on_a_stacked_pool():
    """A layer-stacked pool (``layer_index``): the virtual page table is shifted with the plan's."""
    rng, chunk, table, backend, rows, prior, q, k, v = _setup("extend", 16, "reference", seed=9, bs=3)
    md = backend.plan(_batch("extend", table, rows, prior, q))
    tok = _tokens(rng, int(q.sum()))
    nan = np.full_like(k, np.nan)
    pool = KVPool(jnp.asarray(np.stack([nan, k])), jnp.asarray(np.stack([nan, v])))

    def step(md, tok, pool):
        return backend.forward(tok["q"], tok["k"], tok["v"], LOCAL, pool, md, layer_index=1)

    out, _ = jax.jit(step)(md, tok, pool)
    _check_rows(out, _expected(k, v, table, rows, prior, q, tok, chunk), q, 2e-4)


def test_local_layer_errors():
    rng, chunk, table, backend, rows, prior, q, k, v = _setup("extend", 16, "reference", seed=3, bs=2)
    pool = KVPool(jnp.asarray(k), jnp.asarray(v))
    tok = _tokens(rng, int(q.sum()))
    fb = _batch("extend", table, rows, prior, q)
    plain = FlashAttentionBackend(table, page_size=16, max_context_len=GEOM[16][1], impl="reference")
    with pytest.raises(ValueError, match="attention_chunk_size"):
        plain.forward(tok["q"], tok["k"], tok["v"], LOCAL, pool, plain.plan(fb))
    draft_ext = dataclasses.replace(fb, forward_mode=ForwardMode.DRAFT_EXTEND, extend_seq_lens=None,
                                    spec_info=SpecInfo(num_accepted_tokens=q.astype(np.int32)))
    with pytest.raises(NotImplementedError, match="DRAFT_EXTEND"):
        backend.forward(tok["q"], tok["k"], tok["v"], LOCAL, pool, backend.plan(draft_ext))
    n = 2
    mask = np.tril(np.ones((len(rows), n, n), bool))
    tree = ForwardBatch(ForwardMode.TARGET_VERIFY, rows, prior.astype(np.int32),
                        np.concatenate([table[r, p:p + n] for r, p in zip(rows, prior)]).astype(np.int32),
                        spec_info=SpecInfo(topk=2, num_draft_tokens=n, draft_mask=mask))
    t2 = _tokens(rng, len(rows) * n)
    with pytest.raises(NotImplementedError, match="TARGET_VERIFY with topk > 1"):
        backend.forward(t2["q"], t2["k"], t2["v"], LOCAL, pool, backend.plan(tree))


# ----------------------------------------------------------------------------- the Llama-4 example
def test_llama4_example_matches_dense_chunk_mask():
    """examples/decode_llama.py with the tiny Llama-4 config (local layers, chunk 8, layer 3 global
    NoPE): prefill and replayed decode match dense attention with the chunk mask, and not without it."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
    import decode_llama
    import llama

    run = decode_llama.generate(config="tiny-llama4", batch=3, min_prompt=9, max_prompt=20, new_tokens=4,
                                page_size=4, impl="reference", seed=1)
    assert decode_llama.report(run, check=True) == 0
    no_chunk = dataclasses.replace(run["cfg"], attention_chunk_size=10**6)  # same layers, mask never cuts
    assert [no_chunk.is_local(i) for i in range(4)] == [True, True, True, False]
    worst, _ = decode_llama.check_against_dense(no_chunk, run["params"], run["prompts"], run["generated"],
                                                run["paged_logits"], 1e-4)
    assert worst > 1e-2, "the check must see the chunk mask"
    with pytest.raises(ValueError, match="identical layers"):
        llama.forward_paged(run["cfg"], None, llama.with_layout(run["params"], "scan"), None, None, None,
                            llama.new_stacked_pool(run["cfg"], 8), scan=True)
