"""Bad input through both front ends: a clear error that says what to fix and a bit-identical cache,
or a correct answer. One table of cases, one checker per front end (the README's fuzz table).

The JAX API sees every index on the host and raises from its host checks; values only the device
sees (a bad page id in ``req_to_token``) raise in validation mode. The torch bridge runs in
validation mode (``validate=True``): index tensors live on the device, and the plan's error flag is
read before any layer writes. Without validation the bridge still never writes another slot (an
out-of-range slot goes to the reserved slot 0), bounds every kernel loop, and ``check()`` reports.

Bugs these catch: int64 indices wrapping to int32 (``2**32 + s`` aliasing slot ``s``), ``-1`` writing
the pool's last slot, a K write before a failing V write, a kernel looping to ``seq_len = 2**30``,
page ids read outside the pool, extend lengths that do not cover the tokens, NaN hidden as zeros.
"""

import dataclasses
from typing import Callable, Optional

import numpy as np
import pytest
import torch

import jax.numpy as jnp

from jax_attn.backend import FlashAttentionBackend as JaxBackend
from jax_attn.backend import LayerParams
from jax_attn.batch import ForwardBatch as JaxBatch
from jax_attn.kv_cache import KVPool
from jax_attn.metadata import ForwardMode
from tests.paging import shuffled_table
from torch_bridge import FlashAttentionBackend, ForwardBatch, MHATokenToKVPool, ModelConfig, ModelRunner
from torch_bridge import RadixAttention, ReqToTokenPool

HQ, HKV, D, CTX, PAGE, ROWS = 4, 2, 16, 48, 4, 4
SCALE = 0.31


@dataclasses.dataclass
class Step:
    mode: ForwardMode
    rows: np.ndarray
    seq_lens: np.ndarray
    loc: np.ndarray
    ext: Optional[np.ndarray] = None
    table: Optional[np.ndarray] = None  # a replaced req_to_token


def decode_step(table):
    rows, lens = np.array([1, 2, 3]), np.array([9, 14, 20])
    return Step(ForwardMode.DECODE, rows, lens, np.array([table[r, n - 1] for r, n in zip(rows, lens)]))


def extend_step(table):
    rows, prefix, ext = np.array([1, 2]), np.array([5, 8]), np.array([3, 4])
    loc = np.concatenate([table[r, p:p + e] for r, p, e in zip(rows, prefix, ext)])
    return Step(ForwardMode.EXTEND, rows, prefix + ext, loc, ext)


def with_(field, index, value):
    def mutate(step, table, num_slots):
        arr = getattr(step, field).astype(np.int64).copy()
        arr[index] = value(step, table, num_slots) if callable(value) else value
        setattr(step, field, arr)
    return mutate


def bad_page(step, table, num_slots):
    step.table = table.copy()
    step.table[step.rows[1], PAGE] = num_slots + 8 * PAGE  # the slot of a page start: a page id past the pool


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    base: Callable
    mutate: Callable
    jax: Optional[str]  # message the JAX API raises with (None: not a JAX case)
    bridge: Optional[str]  # message the bridge raises with in validation mode (None: not a bridge case)


_LOC, _LENS, _ROWS = "out_cache_loc slot outside", "longer than the page table", "req_pool_indices outside"
CASES = [
    Case("loc_2**32+s_aliases_s", decode_step, with_("loc", 1, lambda s, t, n: 2**32 + int(s.loc[0])),
         "outside int32", _LOC),
    Case("loc_minus_1", decode_step, with_("loc", 1, -1), "outside the KV pool", _LOC),
    Case("loc_past_pool", decode_step, with_("loc", 2, lambda s, t, n: n + 3), "outside the KV pool", _LOC),
    Case("seq_len_2**30", decode_step, with_("seq_lens", 0, 2**30), "page table holds", _LENS),
    Case("seq_len_2**32+9", decode_step, with_("seq_lens", 0, 2**32 + 9), "outside int32", _LENS),
    Case("seq_len_past_capacity", decode_step, with_("seq_lens", 2, CTX + 1), "page table holds", _LENS),
    Case("row_2**32+1", decode_step, with_("rows", 0, 2**32 + 1), "outside int32", _ROWS),
    Case("row_out_of_range", decode_step, with_("rows", 0, ROWS + 7), "rows of req_to_token", _ROWS),
    Case("decode_seq_len_0", decode_step, with_("seq_lens", 1, 0), r"seq_lens\[1\]=0", "query counts"),
    Case("page_id_past_pool", decode_step, bad_page, "req_to_token entry", "req_to_token entry"),
    Case("empty_decode", decode_step, lambda s, t, n: _empty(s), "size 0", "size 0"),
    Case("extend_sum_short", extend_step, with_("ext", 1, 3), r"sum\(extend_seq_lens\)", "query counts"),
    Case("extend_sum_long", extend_step, with_("ext", 1, 5), r"sum\(extend_seq_lens\)", "query counts"),
    Case("extend_past_seq_len", extend_step, with_("seq_lens", 0, 2), r"extend_seq_lens\[0\]", "query counts"),
]


def _empty(step):
    step.rows, step.seq_lens, step.loc = step.rows[:0], step.seq_lens[:0], step.loc[:0]


def setup(seed=0):
    """req_to_token with shuffled pages, pools that are NaN except slot 0 and the steps' history."""
    table, num_slots = shuffled_table(ROWS, CTX, PAGE, seed)
    rng = np.random.default_rng(seed)
    k = np.full((num_slots, HKV, D), np.nan, np.float32)
    v = np.full((num_slots, HKV, D), np.nan, np.float32)
    k[0] = v[0] = 0.0
    for r in range(1, ROWS + 1):
        k[table[r, :CTX]], v[table[r, :CTX]] = rng.standard_normal((2, CTX, HKV, D))
    return table, num_slots, k, v


def make(case: Case, table, num_slots):
    step = case.base(table)
    case.mutate(step, table, num_slots)
    return step


def qkv(n, rng):
    return (rng.standard_normal((n, HQ * D)).astype(np.float32), rng.standard_normal((n, HKV * D)).astype(np.float32),
            rng.standard_normal((n, HKV * D)).astype(np.float32))


# ----------------------------------------------------------------------------- JAX API
def run_jax(step: Step, table, k, v, *, validate=True, q=None):
    backend = JaxBackend(table if step.table is None else step.table, page_size=PAGE, max_context_len=CTX,
                         impl="reference", num_slots=k.shape[0], validate=validate)
    batch = JaxBatch(step.mode, step.rows, step.seq_lens, step.loc, extend_seq_lens=step.ext)
    md = backend.plan(batch)
    n = len(step.loc)
    q_, kn, vn = qkv(n, np.random.default_rng(1))
    q = q_ if q is None else q
    out, pool = backend.forward(jnp.asarray(q), jnp.asarray(kn), jnp.asarray(vn),
                                LayerParams(HQ, HKV, D, scaling=SCALE), KVPool(jnp.asarray(k), jnp.asarray(v)), md)
    return np.asarray(out), pool, md, backend


@pytest.mark.parametrize("case", [c for c in CASES if c.jax], ids=lambda c: c.name)
def test_jax_api_rejects_bad_input(case):
    table, num_slots, k, v = setup()
    with pytest.raises(ValueError, match=case.jax):
        run_jax(make(case, table, num_slots), table, k, v)


def test_jax_api_rejects_bad_shapes():
    table, num_slots, k, v = setup()
    step = decode_step(table)
    backend = JaxBackend(table, page_size=PAGE, max_context_len=CTX, impl="reference", num_slots=num_slots)
    md = backend.plan(JaxBatch(step.mode, step.rows, step.seq_lens, step.loc))
    pool = KVPool(jnp.asarray(k), jnp.asarray(v))
    q, kn, vn = (jnp.asarray(x) for x in qkv(3, np.random.default_rng(0)))
    with pytest.raises(ValueError, match="num_q_heads"):
        backend.forward(q, kn, vn, LayerParams(HQ + 2, HKV, D), pool, md)
    with pytest.raises(ValueError, match="one row per written slot"):
        backend.forward(q, kn[:2], vn[:2], LayerParams(HQ, HKV, D), pool, md)


def test_jax_api_without_validation_drops_bad_slots_and_flags_them():
    """Default mode, a device-only error: nothing but the step's valid slots changes; check() raises."""
    table, num_slots, k, v = setup()
    step = make(CASES[9], table, num_slots)  # bad page id
    step.loc = step.loc.copy()
    _, pool, md, backend = run_jax(step, table, k, v, validate=False)
    changed = ~(np.asarray(pool.k).view(np.int32) == k.view(np.int32)).all(axis=(1, 2))
    assert set(np.nonzero(changed)[0]) == set(step.loc.tolist())
    with pytest.raises(ValueError, match="req_to_token entry"):
        backend.check(md)


# ----------------------------------------------------------------------------- torch bridge
def bridge_runner(table, k, v):
    pool = MHATokenToKVPool([torch.from_numpy(k).clone()], [torch.from_numpy(v).clone()])
    return ModelRunner(ReqToTokenPool(torch.from_numpy(table).clone()), pool, ModelConfig(CTX), page_size=PAGE,
                       attention_impl="reference")


def run_bridge(step: Step, runner, *, validate=True, q=None, cpu_lens=False):
    if step.table is not None:
        runner.req_to_token_pool.req_to_token.copy_(torch.from_numpy(step.table))
    backend = FlashAttentionBackend(runner, validate=validate)
    i64 = [torch.from_numpy(np.asarray(x, np.int64)) for x in (step.rows, step.seq_lens, step.loc)]
    fb = ForwardBatch(step.mode, len(step.rows), *i64, token_to_kv_pool=runner.token_to_kv_pool,
                      extend_seq_lens=None if step.ext is None else torch.from_numpy(step.ext.astype(np.int64)))
    if cpu_lens:
        fb.seq_lens_cpu = i64[1].clone()
    backend.init_forward_metadata(fb)
    q_, kn, vn = (torch.from_numpy(x) for x in qkv(len(step.loc), np.random.default_rng(1)))
    q = q_ if q is None else torch.from_numpy(q)
    return backend.forward(q, kn, vn, RadixAttention(HQ, D, SCALE, HKV, 0), fb).numpy(), backend


def pool_bits(runner):
    p = runner.token_to_kv_pool
    return [b.clone().view(torch.int32) for b in p.k_buffer + p.v_buffer]


@pytest.mark.parametrize("case", [c for c in CASES if c.bridge], ids=lambda c: c.name)
def test_bridge_rejects_bad_input_and_keeps_the_cache(case):
    table, num_slots, k, v = setup()
    runner = bridge_runner(table, k, v)
    step = make(case, table, num_slots)
    before = pool_bits(runner)
    with pytest.raises(ValueError, match=case.bridge):
        run_bridge(step, runner)
    assert all(torch.equal(a, b) for a, b in zip(before, pool_bits(runner))), f"{case.name}: cache changed"


@pytest.mark.parametrize("case", [c for c in CASES if c.bridge and c.name != "empty_decode"], ids=lambda c: c.name)
def test_bridge_without_validation_writes_no_other_slot(case):
    """Default mode: the step completes (bounded loops), only its valid slots and the reserved slot 0
    change, and ``check()`` reports the bad input."""
    table, num_slots, k, v = setup()
    runner = bridge_runner(table, k, v)
    step = make(case, table, num_slots)
    before = pool_bits(runner)
    _, backend = run_bridge(step, runner, validate=False)
    loc = np.asarray(step.loc, np.int64)
    allowed = {0} | {int(s) for s in loc if 0 <= s < num_slots}
    changed = {int(i) for a, b in zip(before, pool_bits(runner)) for i in np.nonzero(~(a == b).all(-1).all(-1))[0]}
    assert changed <= allowed, f"{case.name}: slots {sorted(changed - allowed)} written"
    with pytest.raises(ValueError, match=case.bridge):
        backend.check()


def test_bridge_host_checks_use_sglang_cpu_lengths():
    """With SGLang's seq_lens_cpu the error is raised on the host, without validation mode."""
    table, num_slots, k, v = setup()
    runner = bridge_runner(table, k, v)
    step = make(CASES[3], table, num_slots)
    before = pool_bits(runner)
    with pytest.raises(ValueError, match="page table holds"):
        run_bridge(step, runner, validate=False, cpu_lens=True)
    assert all(torch.equal(a, b) for a, b in zip(before, pool_bits(runner)))


def test_bridge_rejects_a_strided_pool_before_writing():
    table, num_slots, k, v = setup()
    runner = bridge_runner(table, k, v)
    wide = torch.from_numpy(np.concatenate([k, k], axis=2)).clone()
    runner.token_to_kv_pool.k_buffer[0] = wide[:, :, :D]  # same shape, not contiguous
    before = pool_bits(runner)
    with pytest.raises(ValueError, match="contiguous"):
        run_bridge(decode_step(table), runner)
    assert all(torch.equal(a, b) for a, b in zip(before, pool_bits(runner)))


# ----------------------------------------------------------------------------- NaN stays NaN
@pytest.mark.parametrize("front", ["jax", "bridge"])
def test_nan_in_one_query_gives_nan_in_that_row_only(front):
    table, num_slots, k, v = setup()
    step = decode_step(table)
    q = qkv(3, np.random.default_rng(1))[0]
    clean = run_jax(step, table, k, v, q=q)[0] if front == "jax" else run_bridge(step, bridge_runner(table, k, v),
                                                                                    q=q)[0]
    q[1, :D] = np.nan  # one head of token 1
    q[2, 3] = np.inf
    out = run_jax(step, table, k, v, q=q)[0] if front == "jax" else run_bridge(step, bridge_runner(table, k, v),
                                                                                  q=q)[0]
    out = out.reshape(3, HQ, D)
    assert np.isnan(out[1, 0]).all() and np.isnan(out[2, 0]).all(), "a NaN / Inf query must give NaN"
    np.testing.assert_array_equal(out[0], clean.reshape(3, HQ, D)[0])  # other tokens untouched
    np.testing.assert_array_equal(out[1, 1:], clean.reshape(3, HQ, D)[1, 1:])


def test_step_runner_validation_raises_before_the_step_runs():
    """Validation mode covers StepRunner replays: a bad page id raises before the executable writes."""
    from jax_attn.capture import StepRunner

    table, num_slots, k, v = setup()
    backend = JaxBackend(table, page_size=PAGE, max_context_len=CTX, impl="reference", num_slots=num_slots,
                         validate=True)
    layer = LayerParams(HQ, HKV, D, scaling=SCALE)

    def step_fn(md, tok, pool):
        out, pool = backend.forward(tok["q"], tok["k"], tok["v"], layer, pool, md)
        return out, pool
    runner = StepRunner(backend, step_fn, batch_buckets=(4,))
    step = decode_step(table)
    q, kn, vn = (jnp.asarray(x) for x in qkv(3, np.random.default_rng(2)))
    tok = {"q": q, "k": kn, "v": vn}
    pool = KVPool(jnp.asarray(k), jnp.asarray(v))
    batch = JaxBatch(step.mode, step.rows, step.seq_lens, step.loc)
    runner.capture([batch], tok, pool, verbose=False)
    runner.replay(batch, tok, pool)  # clean: runs
    backend.req_to_token = make(CASES[9], table, num_slots).table  # a page id past the pool
    with pytest.raises(ValueError, match="req_to_token entry"):
        runner.replay(batch, tok, pool)
