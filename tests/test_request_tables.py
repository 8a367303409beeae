"""Request tables and grad modes: the JAX backend's table never aliases the caller's array; a stale table
(a real token at the reserved slot 0) is reported, never read silently; the bridge takes an unaligned
``torch.from_numpy`` table and still sees the engine's in-place edits; safe slots are sound under
``torch.inference_mode()`` when the allocator reuses an ``out_cache_loc`` address."""

import numpy as np
import pytest
import torch

from jax_attn.backend import FlashAttentionBackend as JaxBackend
from jax_attn.batch import ForwardBatch as JaxBatch
from jax_attn.metadata import ForwardMode as JaxMode
from tests.paging import shuffled_table
from tests.test_torch_bridge import (HKV, MAX_CTX, D, fill_committed, layer, make_batch, make_runner, rand_qkv,
                                     reference)
from torch_bridge import FlashAttentionBackend

STALE = 128  # jax_attn.safety.ERRORS: a req_to_token entry of 0 inside a real row


def aligned(shape, align: int = 64) -> np.ndarray:
    """A zeroed int32 array whose data starts on an ``align``-byte boundary (the CPU client views those)."""
    n = int(np.prod(shape))
    buf = np.zeros(n + align, np.int32)
    off = (-buf.ctypes.data % align) // 4
    out = buf[off:off + n].reshape(shape)
    assert out.ctypes.data % align == 0
    return out


def decode_batch(table, rows, lens):
    lens = np.asarray(lens, np.int32)
    loc = np.array([table[r, n - 1] for r, n in zip(rows, lens)], np.int32)
    return JaxBatch(JaxMode.DECODE, np.asarray(rows, np.int32), lens, loc)


@pytest.mark.parametrize("assign", [False, True])
def test_jax_backend_keeps_its_own_copy_of_the_table(assign):
    """Bug caught: ``jnp.asarray`` viewing an aligned numpy table in place, so the engine's later edits leak
    into the backend's table (the docstring promises a copy; an engine assigns edits explicitly)."""
    table, _ = shuffled_table(4, MAX_CTX, 4, seed=1)
    mine = aligned(table.shape)
    mine[:] = table
    backend = JaxBackend(table if assign else mine, page_size=4, max_context_len=MAX_CTX)
    if assign:
        backend.req_to_token = mine
    before = np.asarray(backend.req_to_token).copy()
    mine[2, :8] = 999_999  # the engine edits its own table in place
    np.testing.assert_array_equal(np.asarray(backend.req_to_token), before)


@pytest.mark.parametrize("page_size", [1, 4])
def test_stale_table_is_flagged_in_both_modes(page_size):
    """A page handed out but never written into ``req_to_token`` (so attention would read the reserved slot
    0): validation mode raises naming the fix; default mode sets the error bit and ``check`` raises. Padded
    rows (request row 0) read slot 0 by design and are not flagged.

    Bug caught: the guard not checking for page 0 inside a real row's length (nothing reported it)."""
    table, num_slots = shuffled_table(4, MAX_CTX, page_size, seed=2)
    good = decode_batch(table, [2, 4, 1], [9, 17, 5])
    stale = table.copy()
    stale[4, 12:] = 0  # row 4 grew to 17 tokens; the engine forgot to record positions 12..
    backend = JaxBackend(stale, page_size=page_size, max_context_len=MAX_CTX, num_slots=num_slots)
    md = backend.plan(good, bs=4, num_tokens=4)  # one padded row: row 0, length 1, slot 0
    assert int(md.errors) == STALE
    with pytest.raises(ValueError, match="stale"):
        backend.check(md)
    with pytest.raises(ValueError, match="req_to_token"):
        JaxBackend(stale, page_size=page_size, max_context_len=MAX_CTX, validate=True).plan(good)
    clean = JaxBackend(table, page_size=page_size, max_context_len=MAX_CTX, num_slots=num_slots, validate=True)
    assert int(clean.plan(good, bs=4, num_tokens=4).errors) == 0  # the padded row is not a stale one


def test_stale_table_is_flagged_by_the_bridge():
    runner, table = make_runner(6, 4, seed=3)
    rng = np.random.default_rng(3)
    rows = np.array([2, 5], np.int32)
    fb, _, _ = make_batch("decode", rows, np.array([6, 13], np.int64), table, rng, runner)
    runner.req_to_token_pool.req_to_token[5, 8:] = 0  # stale: row 5's positions 8.. never recorded
    backend = FlashAttentionBackend(runner)
    backend.init_forward_metadata(fb)
    with pytest.raises(ValueError, match="stale"):
        backend.check()
    strict = FlashAttentionBackend(runner, validate=True)
    with pytest.raises(ValueError, match="stale"):
        strict.init_forward_metadata(fb)


@pytest.mark.parametrize("grad_mode", ["inference"])
def test_bridge_takes_an_unaligned_numpy_table_and_sees_in_place_edits(engine_grad_mode):
    """A ``torch.from_numpy`` request table that is not 64-byte aligned (the CPU client cannot view it in
    place) works, and an edit the engine makes in place after start-up reaches the next plan.

    Bugs caught: the table refused for its alignment ("not 64-byte aligned"); an aligned copy taken once
    at start-up (the edit below would then be missed and the step would read the old slots)."""
    runner, table = make_runner(4, 1, seed=4)
    wide = np.zeros(table.size + 1, np.int32)  # offset by one int32: never 64-byte aligned
    unaligned = wide[1:].reshape(table.shape)
    unaligned[:] = table
    r2t = torch.from_numpy(unaligned)
    assert r2t.data_ptr() % 64
    runner.req_to_token_pool.req_to_token = r2t
    backend = FlashAttentionBackend(runner)
    rng = np.random.default_rng(4)
    rows = np.array([3, 1], np.int32)
    free = sorted(set(range(1, runner.token_to_kv_pool.k_buffer[0].shape[0])) - set(table[1:].ravel().tolist()))
    for step in range(2):
        if step == 1:  # the engine moves row 3's positions 0..4 to other slots, in place
            moved = table.copy()
            moved[3, :5] = np.arange(5) + 1 if not free else np.array(free[:5])
            unaligned[3, :5] = moved[3, :5]
            table = moved
        fb, q_lens, start = make_batch("decode", rows, np.array([7, 3], np.int64), table, rng, runner)
        fill_committed(runner, table, rows, start, rng)
        q, k, v = rand_qkv(rng, int(q_lens.sum()))
        backend.init_forward_metadata(fb)
        got = backend.forward(q, k, v, layer(), fb).numpy()
        np.testing.assert_allclose(got, reference(runner, table, fb, q_lens, q, "decode", 1), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("grad_mode", ["plain", "no_grad", "inference"])
def test_safe_slots_under_every_grad_mode_with_a_reused_address(engine_grad_mode):
    """Two eager steps whose ``out_cache_loc`` tensors share one address (as when the allocator hands a freed
    block out again), the second written in place (no version bump under inference mode), with other slots:
    each step's K/V lands at its own slots, in every grad mode.

    Bugs caught: a safe-slot key reading ``_version`` (raises under inference mode); a key of address and
    shape alone (the second step would write at the first step's slots)."""
    runner, table = make_runner(4, 4, seed=5)
    backend = FlashAttentionBackend(runner)
    rng = np.random.default_rng(5)
    kb = runner.token_to_kv_pool.k_buffer[0]
    block = torch.empty(2, dtype=torch.int64)  # the allocator's block, reused by both steps' tensors
    for rows in ([1, 2], [3, 4]):
        rows = np.array(rows, np.int32)
        fb, q_lens, start = make_batch("decode", rows, np.array([5, 9], np.int64), table, rng, runner)
        block.copy_(fb.out_cache_loc)
        fb.out_cache_loc = block.view(2)  # a new tensor object at the same address
        fill_committed(runner, table, rows, start, rng)
        q, k, v = rand_qkv(rng, 2)
        backend.init_forward_metadata(fb)
        got = backend.forward(q, k, v, layer(), fb).numpy()
        np.testing.assert_array_equal(kb[fb.out_cache_loc].numpy(), k.reshape(-1, HKV, D).numpy())
        np.testing.assert_allclose(got, reference(runner, table, fb, q_lens, q, "decode", 4), rtol=1e-4, atol=1e-4)
