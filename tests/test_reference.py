"""The reference attention and the KV write, checked by hand and against a dense float64 numpy port."""

import functools
import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jax
import jax.numpy as jnp

from jax_attn.kv_cache import KVPool, _distinct_slots, paged_view, set_kv_buffer, validate_out_cache_loc
from jax_attn.reference import merge_state_reference, paged_attention_reference
from tests.attention_cases import reference as jitted_reference

jax.config.update("jax_enable_x64", False)


def dense_attention_f64(q, ks, vs, q_lens, *, causal, window, softcap, sinks, scale):
    """Per-sequence dense attention in float64 numpy (no paging): the independent oracle."""
    outs, lses = [], []
    hq = q.shape[1]
    t0 = 0
    for k, v, ql in zip(ks, vs, q_lens):
        kl, hkv = k.shape[0], k.shape[1]
        g = hq // hkv
        for i in range(ql):
            qpos = kl - ql + i
            o = np.zeros((hq, v.shape[2]))
            lse = np.full(hq, -np.inf)
            for h in range(hq):
                j = np.arange(kl)
                vis = np.ones(kl, bool)
                if causal:
                    vis &= j <= qpos
                if window[0] >= 0:
                    vis &= j >= qpos - window[0]
                if window[1] >= 0:
                    vis &= j <= qpos + window[1]
                s = (k[:, h // g] @ q[t0 + i, h]) * scale
                if softcap > 0:
                    s = softcap * np.tanh(s / softcap)
                s = s[vis]
                extra = [] if sinks is None else [float(sinks[h])]
                allv = np.concatenate([s, extra])
                if allv.size == 0:
                    continue
                m = allv.max()
                den = np.exp(allv - m).sum()
                o[h] = (np.exp(s - m) @ v[vis, h // g]) / den
                lse[h] = m + math.log(den)
            outs.append(o)
            lses.append(lse)
        t0 += ql
    return np.stack(outs), np.stack(lses)


def build_paged(rng, kv_lens, hkv, d, dv, page_size, extra_pages=3):
    """Scatter per-sequence K/V into shuffled pages; unused pages are NaN."""
    pages_per = [max(1, -(-kl // page_size)) for kl in kv_lens]
    width = max(pages_per)
    num_pages = sum(pages_per) + extra_pages + 1
    perm = rng.permutation(np.arange(1, num_pages))  # page 0 stays reserved
    k_cache = np.full((num_pages, page_size, hkv, d), np.nan, np.float32)
    v_cache = np.full((num_pages, page_size, hkv, dv), np.nan, np.float32)
    page_table = np.zeros((len(kv_lens), width), np.int32)
    ks, vs, used = [], [], 0
    for b, kl in enumerate(kv_lens):
        k = rng.standard_normal((kl, hkv, d)).astype(np.float32)
        v = rng.standard_normal((kl, hkv, dv)).astype(np.float32)
        ks.append(k.astype(np.float64))
        vs.append(v.astype(np.float64))
        ids = perm[used:used + pages_per[b]]
        used += pages_per[b]
        page_table[b, : len(ids)] = ids
        for j in range(kl):
            k_cache[ids[j // page_size], j % page_size] = k[j]
            v_cache[ids[j // page_size], j % page_size] = v[j]
    return k_cache, v_cache, page_table, ks, vs


def test_hand_computed_single_query():
    # One sequence, 2 keys, 1 head, d=1: softmax([1*2, 1*0]) with scale 1.
    q = jnp.array([[[1.0]]])
    k = jnp.array([[[[2.0]]], [[[0.0]]]])  # pages of size 1
    v = jnp.array([[[[10.0]]], [[[20.0]]]])
    out, lse = paged_attention_reference(
        q, k, v, jnp.array([2]), jnp.array([0, 1]), jnp.array([[0, 1]]),
        page_size=1, softmax_scale=1.0, return_lse=True,
    )
    w = np.exp([2.0, 0.0]) / np.exp([2.0, 0.0]).sum()
    np.testing.assert_allclose(out[0, 0, 0], w @ [10.0, 20.0], rtol=1e-6)
    np.testing.assert_allclose(lse[0, 0], math.log(math.exp(2) + 1), rtol=1e-6)


def test_hand_computed_causal_sink_softcap():
    # Two queries over 2 keys, causal: query 0 sees key 0 only.
    q = jnp.ones((2, 1, 1))
    k = jnp.array([[[[1.0]], [[3.0]]]])  # one page of size 2
    v = jnp.array([[[[5.0]], [[7.0]]]])
    out = paged_attention_reference(q, k, v, jnp.array([2]), jnp.array([0, 2]), jnp.array([[0]]),
                                    page_size=2, softmax_scale=1.0)
    np.testing.assert_allclose(out[0, 0, 0], 5.0, rtol=1e-6)
    # A sink of logit 1 beside the single key of logit 1 halves the weight: out = 5 / 2.
    out = paged_attention_reference(q[:1], k, v, jnp.array([1]), jnp.array([0, 1]), jnp.array([[0]]),
                                    page_size=2, softmax_scale=1.0, sinks=jnp.array([1.0]))
    np.testing.assert_allclose(out[0, 0, 0], 2.5, rtol=1e-6)
    # softcap 1: logits 1 and 3 become tanh(1), tanh(3).
    out = paged_attention_reference(q[1:], k, v, jnp.array([2]), jnp.array([0, 1]), jnp.array([[0]]),
                                    page_size=2, softmax_scale=1.0, softcap=1.0)
    w = np.exp(np.tanh([1.0, 3.0]))
    np.testing.assert_allclose(out[0, 0, 0], (w @ [5.0, 7.0]) / w.sum(), rtol=1e-6)


def test_padding_tokens_and_empty_rows_are_zero():
    q = jnp.ones((4, 2, 4))
    k = jnp.ones((3, 1, 1, 4))
    out, lse = paged_attention_reference(
        q, k, k, jnp.array([1, 1]), jnp.array([0, 1, 1]), jnp.array([[1], [2]]),
        page_size=1, return_lse=True,
    )
    assert np.all(np.asarray(out[1:]) == 0) and np.all(np.isneginf(np.asarray(lse[1:])))
    assert np.all(np.isfinite(np.asarray(out[0])))


@settings(max_examples=12, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    page_size=st.sampled_from([1, 4, 16]),
    heads=st.sampled_from([(4, 4), (4, 1), (8, 2), (7, 1)]),
    causal=st.booleans(),
    window=st.sampled_from([(-1, -1), (3, 0), (5, 2)]),
    softcap=st.sampled_from([0.0, 5.0]),
    use_sinks=st.booleans(),
)
def test_matches_dense_float64(seed, page_size, heads, causal, window, softcap, use_sinks):
    rng = np.random.default_rng(seed)
    bsz = int(rng.integers(1, 4))
    kv_lens = [int(x) for x in rng.integers(1, 40, bsz)]
    q_lens = [int(rng.integers(1, kl + 1)) for kl in kv_lens]
    hq, hkv = heads
    d, dv = 8, 6
    k_cache, v_cache, page_table, ks, vs = build_paged(rng, kv_lens, hkv, d, dv, page_size)
    total = sum(q_lens)
    q = rng.standard_normal((total + 2, hq, d)).astype(np.float32)  # 2 padding tokens
    sinks = rng.standard_normal(hq).astype(np.float32) if use_sinks else None
    scale = d**-0.5
    # jitted: one compile per example instead of one per jnp op of its shapes (~900 in all, most of the time)
    out, lse = jitted_reference(
        jnp.asarray(q), jnp.asarray(k_cache), jnp.asarray(v_cache), jnp.asarray(kv_lens, jnp.int32),
        jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32), jnp.asarray(page_table),
        page_size=page_size, causal=causal, window_size=window, softcap=softcap,
        sinks=None if sinks is None else jnp.asarray(sinks), return_lse=True,
    )
    want_o, want_lse = dense_attention_f64(q.astype(np.float64), ks, vs, q_lens, causal=causal,
                                           window=window, softcap=softcap, sinks=sinks, scale=scale)
    out, lse = np.asarray(out), np.asarray(lse)
    assert np.all(np.isfinite(out)), "NaN from a poisoned page leaked"
    err = np.linalg.norm(out[:total] - want_o) / max(np.linalg.norm(want_o), 1e-30)
    assert err < 1e-5, err
    fin = np.isfinite(want_lse)
    np.testing.assert_array_equal(np.isfinite(lse[:total]), fin)
    np.testing.assert_allclose(lse[:total][fin], want_lse[fin], rtol=1e-5, atol=1e-5)
    assert np.all(out[total:] == 0)


def test_fp8_descale_matches_upcast():
    rng = np.random.default_rng(0)
    k_cache, v_cache, page_table, _, _ = build_paged(rng, [5, 9], 2, 8, 8, 4, extra_pages=0)
    k_cache, v_cache = np.nan_to_num(k_cache), np.nan_to_num(v_cache)
    k8 = jnp.asarray(k_cache / 0.5).astype(jnp.float8_e4m3fn)
    v8 = jnp.asarray(v_cache / 0.25).astype(jnp.float8_e4m3fn)
    q = jnp.asarray(rng.standard_normal((3, 4, 8)), jnp.float32)
    args = (jnp.array([5, 9]), jnp.array([0, 1, 3]), jnp.asarray(page_table))
    got = paged_attention_reference(q, k8, v8, *args, page_size=4, k_descale=0.5,
                                    v_descale=jnp.full((2, 2), 0.25))
    want = paged_attention_reference(q, k8.astype(jnp.float32) * 0.5, v8.astype(jnp.float32) * 0.25,
                                     *args, page_size=4)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_merge_state_reference_splits_equal_whole():
    rng = np.random.default_rng(1)
    k_cache, v_cache, page_table, _, _ = build_paged(rng, [12], 1, 8, 8, 1, extra_pages=0)
    q = jnp.asarray(rng.standard_normal((1, 2, 8)), jnp.float32)
    kc, vc = jnp.asarray(k_cache), jnp.asarray(v_cache)
    pt = jnp.asarray(page_table)
    whole, lse = paged_attention_reference(q, kc, vc, jnp.array([12]), jnp.array([0, 1]), pt,
                                           page_size=1, causal=False, return_lse=True)
    a = paged_attention_reference(q, kc, vc, jnp.array([5]), jnp.array([0, 1]), pt[:, :5],
                                  page_size=1, causal=False, return_lse=True)
    b = paged_attention_reference(q, kc, vc, jnp.array([7]), jnp.array([0, 1]), pt[:, 5:],
                                  page_size=1, causal=False, return_lse=True)
    o, l = merge_state_reference(*a, *b)
    np.testing.assert_allclose(o, whole, rtol=1e-5)
    np.testing.assert_allclose(l, lse, rtol=1e-5)
    empty = (jnp.full_like(a[0], jnp.nan), jnp.full_like(a[1], -jnp.inf))
    o2, l2 = merge_state_reference(*a, *empty)
    np.testing.assert_allclose(o2, a[0], rtol=1e-6)
    np.testing.assert_allclose(l2, a[1], rtol=1e-6)


@pytest.mark.parametrize("stacked", [False, True])
def test_set_kv_buffer_writes_and_drops_padding(stacked):
    """Padded tokens (slot 0) write nothing: every other slot, slot 0 included, keeps its value, in a pool and in a
    layer of a stacked pool. Catches padding sent past the pool onto a real slot (``num_slots + i`` wrapped or
    clamped), a real token's write dropped with the padding's, or the wrong layer written."""
    pool = KVPool.zeros(16, 2, 4, jnp.float32)
    if stacked:
        pool = KVPool(jnp.full((3, 16, 2, 4), 7.0), jnp.full((3, 16, 2, 4), 7.0))
    before = np.asarray(pool.k).copy()
    loc = jnp.array([5, 0, 9, 0], jnp.int32)  # two padded tokens, between the real ones
    k = jnp.arange(4 * 2 * 4, dtype=jnp.float32).reshape(4, 2, 4) + 1
    write = jax.jit(functools.partial(set_kv_buffer, layer_index=1 if stacked else None), donate_argnums=0)
    new = write(pool, loc, k, -k)
    k_got, v_got = np.asarray(new.k), np.asarray(new.v)
    if stacked:
        np.testing.assert_array_equal(k_got[[0, 2]], before[[0, 2]])
        k_got, v_got, before = k_got[1], v_got[1], before[1]
    np.testing.assert_array_equal(k_got[5], k[0])
    np.testing.assert_array_equal(v_got[9], -k[2])
    untouched = np.setdiff1d(np.arange(16), [5, 9])
    np.testing.assert_array_equal(k_got[untouched], before[untouched])
    assert paged_view(new.k if not stacked else new.k[1], 4).shape == (4, 4, 2, 4)
    with pytest.raises(ValueError, match="multiple of"):
        paged_view(new.k if not stacked else new.k[1], 5)


def test_distinct_slots_keeps_slots_that_would_pass_int32():
    """Past ``INT32_MAX - T`` slots the padding cannot be sent past the pool: the slots stay as they are and the
    scatter is not promised distinct indices."""
    loc = jnp.array([3, 0, 0], jnp.int32)
    got, unique = _distinct_slots(loc, 2**31 - 3)
    assert not unique and np.array_equal(np.asarray(got), [3, 0, 0])
    got, unique = _distinct_slots(loc, 10)
    assert unique and np.array_equal(np.asarray(got), [3, 11, 12])
    bad = jnp.array([3, -1, 0], jnp.int32)  # a negative slot goes past the pool too (never the last slots)
    got, unique = _distinct_slots(bad, 10)
    assert unique and np.array_equal(np.asarray(got), [3, 11, 12])
    got, unique = _distinct_slots(bad, 2**31 - 3)
    assert not unique and np.array_equal(np.asarray(got), [3, 2**31 - 3, 0])


def test_set_kv_buffer_rejects_and_drops_bad_input():
    pool = KVPool.zeros(8, 1, 2, jnp.float32)
    k = jnp.ones((2, 1, 2))
    with pytest.raises(ValueError, match="int32"):
        set_kv_buffer(pool, jnp.array([1, 2], jnp.int64 if jax.config.jax_enable_x64 else jnp.uint32), k, k)
    with pytest.raises(ValueError, match="num_tokens"):
        set_kv_buffer(pool, jnp.array([1], jnp.int32), k, k)
    new = set_kv_buffer(pool, jnp.array([8, -1], jnp.int32), k, k)  # both out of range: nothing changes
    assert np.all(np.asarray(new.k) == 0)
    with pytest.raises(ValueError, match="outside the pool"):
        validate_out_cache_loc(np.array([3, 8]), 8)


def test_set_kv_buffer_fp8_stores_scaled():
    pool = KVPool.zeros(4, 1, 2, jnp.float8_e4m3fn)
    k = jnp.array([[[1.0, -2.0]]])
    new = set_kv_buffer(pool, jnp.array([2], jnp.int32), k, k, k_scale=0.5, v_scale=2.0)
    np.testing.assert_allclose(np.asarray(new.k[2].astype(jnp.float32)), [[2.0, -4.0]])
    np.testing.assert_allclose(np.asarray(new.v[2].astype(jnp.float32)), [[0.5, -1.0]])


@pytest.mark.parametrize("name", ["fp8_descale", "sinks", "window", "window_both", "prefix_extend", "decode_gqa8"])
def test_reference_by_sequence_matches_the_whole_batch(name, monkeypatch):
    # The GPU cases' reference runs in slices (attention_cases.REFERENCE_BYTES; here one query row per
    # slice where the mask is causal). This catches a split that mis-slices descales, positions (the
    # causal diagonal, the window), LSE or the padding rows.
    import dataclasses

    from tests import attention_cases as ac

    case = dataclasses.replace(next(c for c in ac.CPU_CASES if c.name == name), return_lse=True, pad_rows=2)
    q, k, v, md, kwargs = ac.build_inputs(case, seed=3)
    whole = ac.reference_by_sequence(q, k, v, md, **kwargs)
    monkeypatch.setattr(ac, "REFERENCE_BYTES", 0)
    parts = ac.reference_by_sequence(q, k, v, md, **kwargs)
    for w, p in zip(whole, parts):
        assert w.shape == p.shape
        np.testing.assert_allclose(np.asarray(p), np.asarray(w), rtol=1e-5, atol=1e-6)
    assert np.isneginf(np.asarray(parts[1])[-2:]).all() and not np.asarray(parts[0])[-2:].any()
