"""A sequence exactly at capacity (``seq_len == max_context_len``) is valid input: in validation mode
(``JAX_ATTN_VALIDATE=1``) both front ends plan it without an error and attend every key, the last one
in the last slot of the pool's last page, as the reference does.

Bugs caught: an off-by-one capacity check (``lens >= cap`` in ``jax_attn.safety.guard`` flags a full
sequence as bad input), a page-id or slot check that rejects the pool's last page, a kernel or planner
that drops the last page of a full page table.
"""

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

from jax_attn.backend import FlashAttentionBackend, LayerParams
from jax_attn.batch import ForwardBatch, SpecInfo
from jax_attn.kv_cache import paged_view
from jax_attn.metadata import ForwardMode
from tests import test_torch_bridge as bridge_tests
from tests.attention_cases import reference
from tests.paging import shuffled_table
from tests.test_backend import HKV, HQ, MAX_CTX, D, make_pool, rand_tokens
import torch_bridge

ROWS = np.array([2, 1, 3], np.int32)  # row 2 at capacity, the others shorter
KV = np.array([MAX_CTX, 17, 30])  # keys per request after the step
Q_LENS = {"decode": 1, "verify": 3, "extend": 5}
KV_OFFSET = {"decode": 0, "verify": 3, "extend": 0}
JAX_CASES = [("decode", 1), ("verify", 4), ("extend", 16)]
BRIDGE_CASES = [("decode", 4), ("extend", 16)]  # (CPU time: the bridge's verify plans as decode does)


def full_table(page_size: int):
    """Shuffled pages, with the pool's last page as the last page of the row at capacity."""
    table, num_slots = shuffled_table(4, MAX_CTX, page_size, seed=page_size)
    last = num_slots // page_size - 1
    r, p = (int(x[0]) for x in np.nonzero(table[:, ::page_size] // page_size == last))
    mine = table[ROWS[0], MAX_CTX - page_size:].copy()
    table[ROWS[0], MAX_CTX - page_size:] = table[r, p * page_size:(p + 1) * page_size]
    table[r, p * page_size:(p + 1) * page_size] = mine
    assert table[ROWS[0], MAX_CTX - 1] == num_slots - 1
    return table, num_slots


def step(mode: str, table):
    """The step's rows, lengths (verify: committed ones), query counts and slots."""
    q_lens = np.full(len(ROWS), Q_LENS[mode])
    start = KV - q_lens
    loc = np.concatenate([table[r, s:s + n] for r, s, n in zip(ROWS, start, q_lens)])
    seq_lens = start if mode == "verify" else KV
    return seq_lens, q_lens, start, loc


def expect(pool, table, q_lens, q, page_size):
    """The reference over the pool with this step's K/V written (the last key of row 2 in the pool's last slot)."""
    pt = table[ROWS][:, ::page_size] // page_size
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return reference(q.reshape(-1, HQ, D), paged_view(pool.k, page_size), paged_view(pool.v, page_size),
                     jnp.asarray(KV, jnp.int32), jnp.asarray(cu), jnp.asarray(pt), page_size=page_size)


@pytest.fixture
def validation_mode(monkeypatch):
    monkeypatch.setenv("JAX_ATTN_VALIDATE", "1")


@pytest.mark.parametrize("mode,page_size", JAX_CASES)
def test_jax_api_at_capacity(mode, page_size, validation_mode):
    rng = np.random.default_rng(page_size)
    table, num_slots = full_table(page_size)
    seq_lens, q_lens, start, loc = step(mode, table)
    spec = SpecInfo(num_draft_tokens=Q_LENS[mode]) if mode == "verify" else None
    fm = {"decode": ForwardMode.DECODE, "verify": ForwardMode.TARGET_VERIFY, "extend": ForwardMode.EXTEND}[mode]
    fb = ForwardBatch(fm, ROWS, seq_lens, loc, extend_seq_lens=q_lens if mode == "extend" else None, spec_info=spec)
    backend = FlashAttentionBackend(table, page_size=page_size, max_context_len=MAX_CTX, impl="triton",
                                    num_slots=num_slots)
    assert backend.validate and backend.capacity == MAX_CTX
    md = backend.plan(fb)  # validation mode: raises if the plan's error flag is set
    pool = make_pool(num_slots, table, ROWS, start, rng)
    tok = rand_tokens(rng, fb.num_tokens)
    out, new_pool = jax.jit(lambda tok, pool, md: backend.forward(tok["q"], tok["k"], tok["v"], LayerParams(HQ, HKV, D),
                                                                  pool, md))(tok, pool, md)
    want = expect(new_pool, table, q_lens, tok["q"], page_size)
    np.testing.assert_allclose(np.asarray(out).reshape(-1, HQ, D), np.asarray(want), rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(np.asarray(new_pool.k)[num_slots - 1],
                                  np.asarray(tok["k"]).reshape(-1, HKV, D)[Q_LENS[mode] - 1])


@pytest.mark.parametrize("mode,page_size", BRIDGE_CASES)
def test_bridge_at_capacity(mode, page_size, validation_mode):
    rng = np.random.default_rng(page_size)
    table, num_slots = full_table(page_size)
    seq_lens, q_lens, start, loc = step(mode, table)
    pool = torch_bridge.MHATokenToKVPool.create(num_slots, 1, HKV, D, torch.float32)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.fill_(float("nan"))
        buf[0] = 0.0
    runner = torch_bridge.ModelRunner(
        torch_bridge.ReqToTokenPool(torch.from_numpy(table).clone()), pool, torch_bridge.ModelConfig(MAX_CTX),
        page_size=page_size, attention_impl="triton",
        server_args=torch_bridge.ServerArgs(speculative_num_draft_tokens=Q_LENS["verify"]))
    backend = torch_bridge.FlashAttentionBackend(runner, topk=1)
    assert backend.jax_backend.validate
    bridge_tests.fill_committed(runner, table, ROWS, start, rng)
    spec = torch_bridge.SpecInfo(draft_token_num=Q_LENS[mode]) if mode == "verify" else None
    fm = {"decode": ForwardMode.DECODE, "verify": ForwardMode.TARGET_VERIFY, "extend": ForwardMode.EXTEND}[mode]

    def i64(x):
        return torch.from_numpy(np.asarray(x, np.int64))
    fb = torch_bridge.ForwardBatch(fm, len(ROWS), i64(ROWS), i64(seq_lens), i64(loc), spec_info=spec,
                                   extend_seq_lens=i64(q_lens) if mode == "extend" else None, token_to_kv_pool=pool)
    q, k, v = bridge_tests.rand_qkv(rng, int(q_lens.sum()))
    backend.init_forward_metadata(fb)  # validation mode: raises if the plan's error flag is set
    got = backend.forward(q, k, v, bridge_tests.layer(), fb).numpy()
    assert torch.equal(pool.k_buffer[0][num_slots - 1], k.reshape(-1, HKV, D)[Q_LENS[mode] - 1])
    want = bridge_tests.reference(runner, table, fb, q_lens.astype(np.int32), q, mode, page_size)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert np.isfinite(got).all()
