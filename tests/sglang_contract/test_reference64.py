"""The float64 oracle on hand-computed cases (it judges every other test here, so it is tested first).

Bugs these catch in the oracle itself: a sink added to the numerator, a window off by one, softcap
applied after scaling the wrong way, GQA heads mapped to the wrong KV head, causal rows aligned
top-left instead of bottom-right, a tree row reading the wrong mask columns."""

import math

import numpy as np
import pytest

from tests.sglang_contract.reference64 import attention64, causal_rows, chunk_local, full_rows, tree_rows

LN2, LN3 = math.log(2.0), math.log(3.0)


def _pool(values):
    """A one-head, one-dim pool: slot i holds values[i]."""
    return np.asarray(values, np.float64).reshape(-1, 1, 1)


# keys 0 and 1 at slots 1 and 2 (k = 0, 1), values 3 and 6; q = ln 2, scale 1: weights 1 : 2.
K, V, Q = _pool([np.nan, 0.0, 1.0]), _pool([np.nan, 3.0, 6.0]), np.full((1, 1, 1), LN2)
E6 = math.exp(math.tanh(LN2))  # softcap 1: s = tanh(ln 2) = 0.6 exactly
HAND = [
    ("plain", {}, (3 * 1 + 6 * 2) / 3),  # 5
    ("sink", {"sinks": np.array([LN3])}, (3 * 1 + 6 * 2) / (1 + 2 + 3)),  # 2.5
    ("window0", {"window": 0}, 6.0),  # (0, 0): only the query's own key
    ("window1", {"window": 1}, 5.0),  # both keys
    ("softcap", {"softcap": 1.0}, (3 + 6 * E6) / (1 + E6)),
    ("scale", {"scale": 2.0}, (3 * 1 + 6 * 4) / 5),  # s = 2 ln 2: weights 1 : 4
]


@pytest.mark.parametrize("name,kw,want", HAND, ids=[h[0] for h in HAND])
def test_hand_computed(name, kw, want):
    kw = {"scale": 1.0, **kw}
    got = attention64(Q, K, V, [np.array([1, 2])], **kw)
    assert got.shape == (1, 1, 1)
    assert got[0, 0, 0] == pytest.approx(want, rel=1e-12), name


def test_softcap_value():
    assert math.tanh(LN2) == pytest.approx(0.6, rel=1e-12)


def test_gqa_maps_query_heads_to_their_kv_head():
    k = np.zeros((3, 2, 1))
    v = np.zeros((3, 2, 1))
    k[1:, 1, 0] = [0.0, 1.0]  # KV head 1: the keys above; KV head 0: equal scores
    v[1:, 0, 0] = [10.0, 20.0]
    v[1:, 1, 0] = [3.0, 6.0]
    q = np.full((1, 4, 1), LN2)  # Hq = 4, Hkv = 2: heads 0, 1 -> KV 0; heads 2, 3 -> KV 1
    got = attention64(q, k, v, [np.array([1, 2])], scale=1.0)[0, :, 0]
    np.testing.assert_allclose(got, [15.0, 15.0, 5.0, 5.0], rtol=1e-12)


def test_empty_row_is_zero_and_sink_only_row_is_zero():
    assert not attention64(Q, K, V, [np.array([], np.int64)], scale=1.0).any()
    assert not attention64(Q, K, V, [np.array([], np.int64)], scale=1.0, sinks=np.array([1.0])).any()


def test_causal_rows_are_bottom_right():
    r2t = np.array([[0, 0, 0], [5, 7, 9]])
    rows = causal_rows(r2t, 1, q_len=2, kv_len=3)
    assert [r.tolist() for r in rows] == [[5, 7], [5, 7, 9]]
    assert [r.tolist() for r in causal_rows(r2t, 1, q_len=1, kv_len=2, col0=1)] == [[7, 9]]
    assert [r.tolist() for r in full_rows(r2t, 1, q_len=2, kv_len=2, col0=1)] == [[7, 9], [7, 9]]


def test_tree_rows_read_the_request_block():
    r2t = np.array([[0, 0, 0], [4, 8, 12]])  # committed slot 4, drafts at 8 and 12
    mask = np.array([[1, 1, 0], [1, 0, 1]], bool)  # two siblings under the committed prefix
    assert [r.tolist() for r in tree_rows(r2t, 1, 1, mask)] == [[4, 8], [4, 12]]
    with pytest.raises(ValueError):
        tree_rows(r2t, 1, 2, mask)


def test_chunk_local_keeps_the_query_chunk():
    rows = causal_rows(np.arange(10)[None], 0, q_len=2, kv_len=10)  # positions 8, 9
    assert [r.tolist() for r in chunk_local(rows, [8, 9], chunk=4)] == [[8], [8, 9]]
