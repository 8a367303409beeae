"""Tree (topk > 1) speculative decoding: cascade == one attention with the full tree mask."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_attn.backend import FlashAttentionBackend, LayerParams
from jax_attn.batch import ForwardBatch, SpecInfo
from jax_attn.capture import StepRunner
from jax_attn.kv_cache import KVPool
from jax_attn.metadata import ForwardMode
from jax_attn.spec import draft_mask_from_custom_mask
from tests.paging import committed_pools, shuffled_table

HQ, HKV, D, CTX = 4, 2, 16, 40


def chain(n):
    return np.tril(np.ones((n, n), bool))


def star(n):
    m = np.eye(n, dtype=bool)
    m[:, 0] = True
    return m


def two_branches():  # 0 -> {1, 2}, 1 -> 3, 2 -> 4
    m = np.eye(5, dtype=bool)
    m[1:, 0] = True
    m[3, 1] = m[4, 2] = True
    return m


def setup(rows, committed, n_new, page_size, seed):
    rng = np.random.default_rng(seed)
    table, num_slots = shuffled_table(int(max(rows)), CTX, page_size, seed)
    k, v = committed_pools(table, num_slots, rows, committed, HKV, D, D, rng)
    q = rng.standard_normal((n_new, HQ, D)).astype(np.float32)
    kn = rng.standard_normal((n_new, HKV, D)).astype(np.float32)
    vn = rng.standard_normal((n_new, HKV, D)).astype(np.float32)
    return table, KVPool(jnp.asarray(k), jnp.asarray(v)), q, kn, vn


def dense_tree_oracle(q, keys, vals, positions, qpos, window=-1, sinks=None, scale=None):
    """float64 attention of one query ``q [Hq, D]`` over an explicit key list ``keys`` / ``vals [L, Hkv, D]``
    (positions for the window); ``sinks[h]`` adds ``exp(sinks[h] - max)`` to head h's softmax denominator;
    ``scale`` defaults to ``D ** -0.5``."""
    hq, d = q.shape
    g = hq // keys.shape[1]
    scale = d**-0.5 if scale is None else scale
    out = np.zeros((hq, vals.shape[2]))
    for h in range(hq):
        kk, vv = keys[:, h // g].astype(np.float64), vals[:, h // g].astype(np.float64)
        s = kk @ q[h].astype(np.float64) * scale
        vis = np.ones(len(s), bool) if window < 0 else positions >= qpos - window
        m = s[vis].max()
        p = np.exp(s[vis] - m)
        out[h] = p @ vv[vis] / (p.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - m)))
    return out


def tree_draft_oracle(k, v, table, rows, committed, loc, step: int, q, scale=None):
    """float64 tree draft decode, ``[B * K, Hq * D]``: branch (b, k)'s query (``q [B * K, Hq, D]``) over request
    b's committed keys (``table[rows[b], :committed[b]]`` of the pool ``k`` / ``v [slots, Hkv, D]``), then its own
    draft tokens of steps ``0..step`` (``loc [B, K, S]``: slots)."""
    topk = loc.shape[1]
    want = []
    for b, (r, c) in enumerate(zip(rows, committed)):
        for br in range(topk):
            slots = np.concatenate([table[r, :c], loc[b, br, :step + 1]])
            want.append(dense_tree_oracle(q[b * topk + br], k[slots], v[slots], None, None, scale=scale))
    return np.stack(want).reshape(len(want), -1)


def run_backend(impl, table, pool, fb, q, kn, vn, page_size, window=-1, sinks=None):
    backend = FlashAttentionBackend(table, page_size=page_size, max_context_len=CTX, impl=impl)
    md = backend.plan(fb)
    layer = LayerParams(HQ, HKV, D, sliding_window_size=window)
    sinks = None if sinks is None else jnp.asarray(sinks, jnp.float32)
    out, new_pool = backend.forward(jnp.asarray(q), jnp.asarray(kn), jnp.asarray(vn), layer, pool, md, sinks=sinks)
    return np.asarray(out).reshape(-1, HQ, D), new_pool


def verify_batch(rows, committed, masks, table):
    n = masks[0].shape[0]
    loc = np.concatenate([table[r, c:c + n] for r, c in zip(rows, committed)])
    spec = SpecInfo(topk=2, num_draft_tokens=n, draft_mask=np.stack(masks), with_swa=True)
    return ForwardBatch(ForwardMode.TARGET_VERIFY, rows, committed, loc, spec_info=spec)


def verify_oracle(rows, committed, masks, table, pool, kn, vn, q, window=-1, sinks=None):
    k, v = np.array(pool.k), np.array(pool.v)
    n = masks[0].shape[0]
    want = []
    for b, (r, c, m) in enumerate(zip(rows, committed, masks)):
        for i in range(n):
            sel = np.nonzero(m[i])[0]
            keys = np.concatenate([k[table[r, :c]], kn[b * n + sel]])
            vals = np.concatenate([v[table[r, :c]], vn[b * n + sel]])
            pos = np.concatenate([np.arange(c), c + np.arange(len(sel))])
            want.append(dense_tree_oracle(q[b * n + i], keys, vals, pos, c + len(sel) - 1, window, sinks))
    return np.stack(want)


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("tree,page_size", [("chain", 1), ("star", 4), ("branches", 1)])
def test_tree_verify_equals_full_mask(impl, tree, page_size):
    mask = {"chain": chain(4), "star": star(4), "branches": two_branches()}[tree]
    rows, committed = np.array([2, 1], np.int32), np.array([9, 17], np.int32)
    n = mask.shape[0]
    table, pool, q, kn, vn = setup(rows, committed, 2 * n, page_size, seed=n)
    fb = verify_batch(rows, committed, [mask, mask[::-1, ::-1] & mask.T[::-1, ::-1] | np.eye(n, dtype=bool)], table)
    masks = list(fb.spec_info.draft_mask)
    got, new_pool = run_backend(impl, table, pool, fb, q, kn, vn, page_size)
    want = verify_oracle(rows, committed, masks, table, pool, kn, vn, q)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(new_pool.k)[fb.out_cache_loc], kn)
    # Sliding-window layer: the SWA table path, window positions along the tree depth.
    got_w, _ = run_backend(impl, table, pool, fb, q, kn, vn, page_size, window=5)
    want_w = verify_oracle(rows, committed, masks, table, pool, kn, vn, q, window=5)
    np.testing.assert_allclose(got_w, want_w, rtol=1e-4, atol=1e-4)


def test_tree_verify_with_sinks():
    """Attention sinks in a tree step (gpt-oss style, with and without a sliding window): each head's sink
    joins the softmax once, though the cascade splits a query's keys over a prefix and an expand pass
    (and the SWA pass) whose partial results are merged.

    Bugs caught: the sink added in both passes (or in neither), the sinks not reaching the cascade."""
    rows, committed = np.array([2, 1], np.int32), np.array([9, 17], np.int32)
    mask = two_branches()
    n = mask.shape[0]
    table, pool, q, kn, vn = setup(rows, committed, 2 * n, 4, seed=11)
    sinks = np.random.default_rng(12).standard_normal(HQ) * 2.0
    fb = verify_batch(rows, committed, [mask, star(n)], table)
    masks = list(fb.spec_info.draft_mask)
    for window in (-1, 5):
        got, _ = run_backend("triton", table, pool, fb, q, kn, vn, 4, window=window, sinks=sinks)
        want = verify_oracle(rows, committed, masks, table, pool, kn, vn, q, window=window, sinks=sinks)
        plain = verify_oracle(rows, committed, masks, table, pool, kn, vn, q, window=window)
        assert np.abs(want - plain).max() > 1e-2, "the sinks must change the answer"
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=f"{window=}")


def test_chain_tree_equals_uniform_verify_and_batch_of_two_equals_two_runs():
    rows, committed = np.array([1, 2], np.int32), np.array([7, 12], np.int32)
    table, pool, q, kn, vn = setup(rows, committed, 8, 4, seed=5)
    fb = verify_batch(rows, committed, [chain(4), chain(4)], table)
    tree, _ = run_backend("reference", table, pool, fb, q, kn, vn, 4)
    uni = ForwardBatch(ForwardMode.TARGET_VERIFY, rows, committed, fb.out_cache_loc,
                       spec_info=SpecInfo(topk=1, num_draft_tokens=4))
    flat, _ = run_backend("reference", table, pool, uni, q, kn, vn, 4)
    np.testing.assert_allclose(tree, flat, rtol=1e-5, atol=1e-5)
    for b in range(2):
        one = verify_batch(rows[b:b + 1], committed[b:b + 1], [chain(4)], table)
        alone, _ = run_backend("reference", table, pool, one, q[4 * b:4 * b + 4], kn[4 * b:4 * b + 4],
                               vn[4 * b:4 * b + 4], 4)
        np.testing.assert_allclose(alone, tree[4 * b:4 * b + 4], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_tree_draft_decode(impl):
    rows, committed = np.array([1, 2], np.int32), np.array([6, 11], np.int32)
    topk, steps, step_id = 2, 3, 1
    table, pool, q, kn, vn = setup(rows, committed, 4, 1, seed=9)
    # Branch slots: [B, K, S] beyond each request's committed tokens.
    loc = np.stack([table[r, c:c + topk * steps].reshape(topk, steps) for r, c in zip(rows, committed)])
    k, v = np.array(pool.k), np.array(pool.v)
    rng = np.random.default_rng(1)
    prev = loc[:, :, :step_id].reshape(-1)  # earlier draft steps already in the cache
    k[prev] = rng.standard_normal((prev.size, HKV, D))
    v[prev] = rng.standard_normal((prev.size, HKV, D))
    pool = KVPool(jnp.asarray(k), jnp.asarray(v))
    spec = SpecInfo(topk=topk, num_steps=steps, step_id=step_id)
    fb = ForwardBatch(ForwardMode.DECODE, rows, committed, loc.reshape(-1), spec_info=spec)
    got, _ = run_backend(impl, table, pool, fb, q, kn, vn, 1)
    want = []
    for b, (r, c) in enumerate(zip(rows, committed)):
        for br in range(topk):
            t = b * topk + br
            own = loc[b, br, :step_id]
            keys = np.concatenate([k[table[r, :c]], k[own], kn[t:t + 1]])
            vals = np.concatenate([v[table[r, :c]], v[own], vn[t:t + 1]])
            want.append(dense_tree_oracle(q[t], keys, vals, None, None))
    np.testing.assert_allclose(got, np.stack(want), rtol=1e-4, atol=1e-4)


def test_tree_verify_replay_equals_eager():
    table, pool, _, _, _ = setup(np.arange(1, 7), np.full(6, 10), 1, 1, seed=2)
    backend = FlashAttentionBackend(table, page_size=1, max_context_len=CTX, impl="triton")
    layer = LayerParams(HQ, HKV, D)

    def step(md, tok, pool):
        return backend.forward(tok["q"], tok["k"], tok["v"], layer, pool, md)

    runner = StepRunner(backend, step, batch_buckets=(4,))
    rng = np.random.default_rng(3)

    def batch(rows, lens):
        return verify_batch(rows, lens, [two_branches()] * len(rows), table)

    def tokens(n):
        return {x: jnp.asarray(rng.standard_normal((n, HQ if x == "q" else HKV, D)), jnp.float32) for x in "qkv"}

    runner.capture([batch(np.arange(1, 5, dtype=np.int32), np.full(4, 8, np.int32))], tokens(20), pool,
                   verbose=False)
    traces = runner.trace_count
    fb = batch(np.array([5, 3, 6], np.int32), np.array([4, 13, 9], np.int32))
    tok = tokens(15)
    got, _ = runner.replay(fb, tok, pool)
    assert runner.trace_count == traces
    eager, _ = runner.eager(fb, tok, pool)
    np.testing.assert_allclose(np.asarray(got), np.asarray(eager), rtol=1e-5, atol=1e-5)


def test_draft_mask_from_sglang_custom_mask_is_padding_safe():
    seq_lens = np.array([3, 5], np.int32)
    n = 3
    blocks, want = [], []
    rng = np.random.default_rng(0)
    for L in seq_lens:
        m = rng.random((n, n)) < 0.5
        want.append(m)
        blocks.append(np.concatenate([np.ones((n, L), bool), m], 1).reshape(-1))
    flat = np.concatenate(blocks + [np.ones(7, bool)])  # padded tail must never be read as mask
    got = draft_mask_from_custom_mask(jnp.asarray(flat), jnp.asarray(seq_lens), num_draft=n)
    np.testing.assert_array_equal(np.asarray(got), np.stack(want))
    # A padded row (seq_len 1, past the real mask) reads nothing: all False.
    got = draft_mask_from_custom_mask(jnp.asarray(flat[: sum(b.size for b in blocks)]),
                                      jnp.asarray(np.array([3, 5, 1], np.int32)), num_draft=n)
    assert not np.asarray(got)[2].any()


@pytest.mark.parametrize("topk", [1, 2])
def test_multistep_plans_equal_single_step_plans(topk):
    from jax_attn.multistep import plan_draft_steps
    from jax_attn.planner import plan_uniform
    from jax_attn.spec import plan_draft_decode_tree

    rows, committed = np.array([2, 1], np.int32), np.array([3, 9], np.int32)  # steps cross page edges
    table, _, _, _, _ = setup(rows, committed, 1, 4, seed=4)
    steps, k = 3, max(topk, 1)
    loc = np.concatenate([table[r, c:c + k * steps] for r, c in zip(rows, committed)]).astype(np.int32)
    args = (jnp.asarray(table), jnp.asarray(rows), jnp.asarray(committed))
    plans = plan_draft_steps(*args, jnp.asarray(loc), topk=topk, num_steps=steps, page_size=4, max_pages=10)
    for step, got in enumerate(plans):
        if topk > 1:
            want = plan_draft_decode_tree(*args, jnp.asarray(loc), topk=topk, step_id=step, num_steps=steps,
                                          page_size=4, max_pages=10)
        else:
            want = plan_uniform(*args, jnp.asarray(loc.reshape(-1, steps)[:, step]), kv_offset=step + 1,
                                page_size=4, max_pages=10)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert jax.tree.structure(got) == jax.tree.structure(want)


def test_tree_draft_decode_replay_equals_eager():
    rows_all = np.arange(1, 7, dtype=np.int32)
    table, pool, _, _, _ = setup(rows_all, np.full(6, 12), 1, 1, seed=8)
    backend = FlashAttentionBackend(table, page_size=1, max_context_len=CTX, impl="triton", num_heads=(HQ, HKV))
    layer = LayerParams(HQ, HKV, D)
    topk, steps, step_id = 2, 3, 2
    rng = np.random.default_rng(4)

    def step(md, tok, pool):
        return backend.forward(tok["q"], tok["k"], tok["v"], layer, pool, md)

    def batch(rows, lens):
        loc = np.concatenate([table[r, c:c + topk * steps] for r, c in zip(rows, lens)]).astype(np.int32)
        spec = SpecInfo(topk=topk, num_steps=steps, step_id=step_id)
        return ForwardBatch(ForwardMode.DECODE, rows, lens, loc, spec_info=spec)

    def tokens(n):
        return {x: jnp.asarray(rng.standard_normal((n, HQ if x == "q" else HKV, D)), jnp.float32) for x in "qkv"}

    runner = StepRunner(backend, step, batch_buckets=(4,))
    runner.capture([batch(rows_all[:4], np.full(4, 8, np.int32))], tokens(4 * topk), pool, verbose=False)
    traces = runner.trace_count
    fb = batch(np.array([6, 2, 5], np.int32), np.array([3, 11, 7], np.int32))
    assert fb.num_tokens == 3 * topk
    tok = tokens(fb.num_tokens)
    got, new_pool = runner.replay(fb, tok, pool)
    assert runner.trace_count == traces, "replay inside a captured bucket must not retrace"
    eager, _ = runner.eager(fb, tok, pool)
    np.testing.assert_allclose(np.asarray(got), np.asarray(eager), rtol=1e-5, atol=1e-5)
    # This step's K/V went to each branch's step_id column.
    cur = fb.out_cache_loc.reshape(-1, steps)[:, step_id]
    np.testing.assert_array_equal(np.asarray(new_pool.k)[cur], np.asarray(tok["k"]))
