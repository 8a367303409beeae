"""JAX backend layer kinds SGLang hands the FA backend: cross attention writes its K/V at
``encoder_out_cache_loc`` and attends the encoder tokens; encoder-only layers attend both ways;
neither may run inside a tree step. Checked against a float64 oracle per token row, and the whole
pool diffed (NaN in every slot no request owns).

Bugs these catch: a cross layer's K/V written at ``out_cache_loc`` (the decoder's slots); an
``ENCODER_ONLY`` layer run causally; a cross layer in a tree step run as self attention."""

import numpy as np
import pytest

import jax.numpy as jnp

from jax_attn.backend import FlashAttentionBackend, LayerParams
from jax_attn.batch import ForwardBatch, SpecInfo
from jax_attn.kv_cache import KVPool
from jax_attn.metadata import ForwardMode
from tests.paging import shuffled_table
from tests.attention_cases import forbid_kernel_planning

HQ, HKV, D, CTX, PAGE = 4, 2, 16, 48, 4
SCALE = 0.29


def _oracle(q, k, v, causal_end=None):
    """float64 attention of q [Hq, D] over k / v [n, Hkv, D]; keys past ``causal_end`` masked."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    g = HQ // HKV
    out = np.zeros((HQ, D))
    for h in range(HQ):
        s = k[:, h // g] @ q[h] * SCALE
        if causal_end is not None:
            s[causal_end + 1:] = -np.inf
        e = np.exp(s - s.max())
        out[h] = e @ v[:, h // g] / e.sum()
    return out


def _setup(rng):
    table, slots = shuffled_table(4, CTX, PAGE, seed=3)
    k = np.full((slots, HKV, D), np.nan, np.float32)
    v = np.full((slots, HKV, D), np.nan, np.float32)
    k[0] = v[0] = 0.0
    return table, k, v


def _rows_error(got, want):
    got = np.asarray(got, np.float64).reshape(want.shape)
    return (np.abs(got - want).max(axis=(1, 2)) / np.abs(want).max(axis=(1, 2))).max()


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_cross_layer_writes_encoder_slots_and_attends_them(impl, monkeypatch):
    """Also: the cross layer's kernel runs on the encoder schedule the step planned (none planned in the call)."""
    forbid_kernel_planning(monkeypatch)
    rng = np.random.default_rng(0)
    table, kp, vp = _setup(rng)
    rows, enc_lens, dec_lens = np.array([2, 4]), np.array([5, 3]), np.array([6, 9])
    for r, e, n in zip(rows, enc_lens, dec_lens):  # decoder K/V after the encoder slots of each row
        s = table[r, e:e + n]
        kp[s], vp[s] = rng.standard_normal((2, n, HKV, D))
    enc_loc = np.concatenate([table[r, :e] for r, e in zip(rows, enc_lens)]).astype(np.int32)
    dec_loc = np.array([table[r, e + n - 1] for r, e, n in zip(rows, enc_lens, dec_lens)], np.int32)
    batch = ForwardBatch(ForwardMode.DECODE, rows, dec_lens, dec_loc, encoder_lens=enc_lens,
                         encoder_out_cache_loc=enc_loc)
    backend = FlashAttentionBackend(table, page_size=PAGE, max_context_len=CTX, impl=impl, max_encoder_len=8,
                                    num_heads=(HQ, HKV))
    md = backend.plan(batch)
    cross = LayerParams(HQ, HKV, D, scaling=SCALE, is_cross_attention=True)
    q = rng.standard_normal((2, HQ, D)).astype(np.float32)
    k_enc, v_enc = rng.standard_normal((2, int(enc_lens.sum()), HKV, D)).astype(np.float32)
    out, pool = backend.forward(jnp.asarray(q), jnp.asarray(k_enc), jnp.asarray(v_enc), cross,
                                KVPool(jnp.asarray(kp), jnp.asarray(vp)), md)
    new_k, new_v = np.asarray(pool.k), np.asarray(pool.v)
    changed = ~((new_k.view(np.int32) == kp.view(np.int32)).all(axis=(1, 2)))
    assert set(np.nonzero(changed)[0]) == set(enc_loc.tolist()), "only the encoder slots may change"
    np.testing.assert_array_equal(new_k[enc_loc], k_enc)
    np.testing.assert_array_equal(new_v[enc_loc], v_enc)
    starts = np.concatenate([[0], np.cumsum(enc_lens)])
    want = np.stack([_oracle(q[b], k_enc[starts[b]:starts[b + 1]], v_enc[starts[b]:starts[b + 1]])
                     for b in range(2)])
    assert _rows_error(out, want) < 1e-4
    bare = ForwardBatch(ForwardMode.DECODE, rows, dec_lens, dec_loc, encoder_lens=enc_lens)
    with pytest.raises(ValueError, match="encoder_out_cache_loc"):
        backend.forward(jnp.asarray(q), jnp.asarray(k_enc), jnp.asarray(v_enc), cross, pool, backend.plan(bare))


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_encoder_only_layer_attends_both_ways(impl):
    rng = np.random.default_rng(1)
    table, kp, vp = _setup(rng)
    rows, lens = np.array([1, 3]), np.array([7, 12])
    loc = np.concatenate([table[r, :n] for r, n in zip(rows, lens)]).astype(np.int32)
    batch = ForwardBatch(ForwardMode.EXTEND, rows, lens, loc, extend_seq_lens=lens)
    backend = FlashAttentionBackend(table, page_size=PAGE, max_context_len=CTX, impl=impl)
    k, v = rng.standard_normal((2, int(lens.sum()), HKV, D)).astype(np.float32)
    q = rng.standard_normal((int(lens.sum()), HQ, D)).astype(np.float32)
    pool = KVPool(jnp.asarray(kp), jnp.asarray(vp))
    enc = LayerParams(HQ, HKV, D, scaling=SCALE, causal=False)
    out, _ = backend.forward(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), enc, pool, backend.plan(batch))
    starts = np.concatenate([[0], np.cumsum(lens)])
    want = np.stack([_oracle(q[t], k[starts[b]:starts[b + 1]], v[starts[b]:starts[b + 1]])
                     for b in range(2) for t in range(starts[b], starts[b + 1])])
    assert _rows_error(out, want) < 1e-4
    causal = np.stack([_oracle(q[t], k[starts[b]:starts[b + 1]], v[starts[b]:starts[b + 1]], t - starts[b])
                       for b in range(2) for t in range(starts[b], starts[b + 1])])
    assert _rows_error(causal, want) > 1e-2, "the case cannot tell causal from bidirectional"


def test_cross_and_encoder_only_layers_raise_in_tree_steps():
    rng = np.random.default_rng(2)
    table, kp, vp = _setup(rng)
    n = 3
    mask = np.tril(np.ones((n, n), bool))[None].repeat(2, 0)
    rows, committed = np.array([1, 2]), np.array([5, 8])
    loc = np.concatenate([table[r, c:c + n] for r, c in zip(rows, committed)]).astype(np.int32)
    batch = ForwardBatch(ForwardMode.TARGET_VERIFY, rows, committed, loc,
                         spec_info=SpecInfo(topk=2, num_draft_tokens=n, draft_mask=mask))
    backend = FlashAttentionBackend(table, page_size=PAGE, max_context_len=CTX, impl="reference")
    md = backend.plan(batch)
    q = jnp.asarray(rng.standard_normal((2 * n, HQ, D)), jnp.float32)
    pool = KVPool(jnp.asarray(kp), jnp.asarray(vp))
    for lp in (LayerParams(HQ, HKV, D, is_cross_attention=True), LayerParams(HQ, HKV, D, causal=False)):
        with pytest.raises(NotImplementedError, match="tree"):
            backend.forward(q, None, None, lp, pool, md)
