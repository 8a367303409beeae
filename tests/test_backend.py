"""Backend contract: replay (padded, captured) equals eager and the reference for every mode;
no retrace inside a bucket; idle and error paths (deterministic mode: tests/test_deterministic.py)."""

import zlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_attn.backend import FlashAttentionBackend, LayerParams
from jax_attn.batch import ForwardBatch, SpecInfo
from jax_attn.capture import StepRunner
from jax_attn.kv_cache import KVPool, paged_view
from jax_attn.metadata import ForwardMode
from jax_attn.reference import paged_attention_reference
from tests.attention_cases import forbid_kernel_planning
from tests.paging import shuffled_table

HQ, HKV, D = 4, 2, 16
MAX_CTX = 48
LAYER = LayerParams(num_q_heads=HQ, num_kv_heads=HKV, head_dim=D)


def make_table(num_reqs, page_size, seed):
    """req_to_token with shuffled pages per row (row 0 / page 0 reserved), and the slot count."""
    return shuffled_table(num_reqs, MAX_CTX, page_size, seed)


def make_pool(num_slots, table, rows, kv_lens, rng):
    """Random K/V in the slots the batch owns (its committed tokens); NaN everywhere else but slot 0."""
    k = np.full((num_slots, HKV, D), np.nan, np.float32)
    v = np.full((num_slots, HKV, D), np.nan, np.float32)
    k[0] = v[0] = 0.0
    for r, n in zip(rows, kv_lens):
        s = table[r, :n]
        k[s] = rng.standard_normal((n, HKV, D))
        v[s] = rng.standard_normal((n, HKV, D))
    return KVPool(jnp.asarray(k), jnp.asarray(v))


def make_batch(mode, rows, committed, table, rng, *, num_draft=3, step_id=1):
    """A batch of ``mode`` on top of ``committed`` KV tokens per request."""
    bs = len(rows)
    spec = None
    if mode == "decode":
        q_lens, fm = np.ones(bs, np.int32), ForwardMode.DECODE
    elif mode == "draft_decode":
        q_lens, fm = np.ones(bs, np.int32), ForwardMode.DECODE
        spec = SpecInfo(step_id=step_id)
    elif mode == "verify":
        q_lens, fm = np.full(bs, num_draft, np.int32), ForwardMode.TARGET_VERIFY
        spec = SpecInfo(num_draft_tokens=num_draft)
    elif mode == "draft_extend":
        acc = rng.integers(0, num_draft, bs).astype(np.int32)
        q_lens, fm = acc + 1, ForwardMode.DRAFT_EXTEND
        spec = SpecInfo(accept_length=acc, num_draft_tokens=num_draft)
    else:  # extend with prefix
        q_lens, fm = rng.integers(1, 6, bs).astype(np.int32), ForwardMode.EXTEND
    # New tokens sit right after the tokens already in the cache (draft decode: after the
    # step_id earlier draft tokens). Verify and draft decode pass the committed length.
    start = prior_tokens(mode, committed, step_id)
    loc = np.concatenate([table[r, s:s + n] for r, s, n in zip(rows, start, q_lens)])
    seq_lens = committed if mode in ("verify", "draft_decode") else start + q_lens
    ext = q_lens if mode == "extend" else None
    return ForwardBatch(fm, rows, seq_lens, loc, extend_seq_lens=ext, spec_info=spec), q_lens


def prior_tokens(mode, committed, step_id=1):
    return committed + (step_id if mode == "draft_decode" else 0)


def attn_step(backend):
    def step(md, tok, pool):
        out, pool = backend.forward(tok["q"], tok["k"], tok["v"], LAYER, pool, md)
        return out, pool
    return step


def expected(pool, table, rows, fb, q_lens, tok, page_size, kv_offset):
    """Write the new K/V with numpy, then the reference over the true (unpadded) batch."""
    k, v = np.array(pool.k), np.array(pool.v)
    k[fb.out_cache_loc] = np.asarray(tok["k"]).reshape(-1, HKV, D)
    v[fb.out_cache_loc] = np.asarray(tok["v"]).reshape(-1, HKV, D)
    kv_lens = fb.seq_lens + kv_offset
    width = -(-MAX_CTX // page_size)
    pt = table[rows][:, ::page_size][:, :width] // page_size if page_size > 1 else table[rows]
    return paged_attention_reference(
        jnp.asarray(tok["q"]).reshape(-1, HQ, D), paged_view(jnp.asarray(k), page_size),
        paged_view(jnp.asarray(v), page_size),
        jnp.asarray(kv_lens, jnp.int32), jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
        jnp.asarray(pt), page_size=page_size,
    )


def rand_tokens(rng, n):
    return dict(q=jnp.asarray(rng.standard_normal((n, HQ * D)), jnp.float32),
                k=jnp.asarray(rng.standard_normal((n, HKV * D)), jnp.float32),
                v=jnp.asarray(rng.standard_normal((n, HKV * D)), jnp.float32))


KV_OFFSET = {"decode": 0, "draft_decode": 2, "verify": 3, "draft_extend": 0, "extend": 0}


CASES = [("decode", 1), ("decode", 4), ("draft_decode", 4), ("verify", 1), ("verify", 4), ("draft_extend", 4)]


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("mode,page_size", CASES)
def test_replay_equals_eager_and_reference(mode, page_size, impl, monkeypatch):
    forbid_kernel_planning(monkeypatch)
    rng = np.random.default_rng(zlib.crc32(repr((mode, page_size)).encode()))
    table, num_slots = make_table(16, page_size, seed=3)
    backend = FlashAttentionBackend(table, page_size=page_size, max_context_len=MAX_CTX, impl=impl,
                                    num_heads=(HQ, HKV))  # kernels: schedule planned once per step
    runner = StepRunner(backend, attn_step(backend), batch_buckets=(8, 16), donate_argnums=())
    # Capture at bucket 8 with one set of lengths ...
    rows0 = np.arange(1, 9, dtype=np.int32)
    fb0, q0 = make_batch(mode, rows0, rng.integers(5, 20, 8).astype(np.int32), table, rng)
    pool0 = make_pool(num_slots, table, rows0, np.full(8, 40), rng)
    runner.capture([fb0], rand_tokens(rng, fb0.num_tokens), pool0, verbose=False)
    # ... then replay batches of 5 (bucket 8) and 13 (bucket 16, not captured: eager).
    for bs in (5, 13):
        rows = rng.choice(np.arange(1, 17), bs, replace=False).astype(np.int32)
        committed = rng.integers(1, 30, bs).astype(np.int32)
        fb, q_lens = make_batch(mode, rows, committed, table, rng)
        pool = make_pool(num_slots, table, rows, prior_tokens(mode, committed), rng)
        tok = rand_tokens(rng, fb.num_tokens)
        traces = runner.trace_count
        got, new_pool = runner.replay(fb, tok, pool)
        if bs <= 8:
            assert runner.trace_count == traces, "replay inside a captured bucket must not retrace"
        eager = runner.eager(fb, tok, pool)[0] if bs <= 8 else got
        want = expected(pool, table, rows, fb, q_lens, tok, page_size, KV_OFFSET[mode])
        got, eager = np.asarray(got), np.asarray(eager)
        assert got.shape == (fb.num_tokens, HQ * D)
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, eager, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(got.reshape(-1, HQ, D), np.asarray(want), rtol=1e-4, atol=1e-4)
        # The step's K/V landed in the pool; slots of other requests are untouched.
        np.testing.assert_array_equal(np.asarray(new_pool.k)[fb.out_cache_loc],
                                      np.asarray(tok["k"]).reshape(-1, HKV, D))


@pytest.mark.parametrize("mode", ["decode", "verify"])
def test_static_buffer_replay_equals_eager_and_keeps_addresses(mode):
    """``static_buffers``: every replay of a bucket reuses the same input and output buffers (so XLA's
    command buffers need no update), the previous outputs are handed back to it, and results equal
    the eager path and the reference."""
    rng = np.random.default_rng(11)
    table, num_slots = make_table(16, 4, seed=5)
    backend = FlashAttentionBackend(table, page_size=4, max_context_len=MAX_CTX, impl="triton", num_heads=(HQ, HKV))
    runner = StepRunner(backend, attn_step(backend), batch_buckets=(8,), donate_argnums=(0,), static_buffers=True)
    rows0 = np.arange(1, 9, dtype=np.int32)
    fb0, _ = make_batch(mode, rows0, rng.integers(5, 20, 8).astype(np.int32), table, rng)
    pool = make_pool(num_slots, table, rows0, np.full(8, 40), rng)
    runner.capture([fb0], rand_tokens(rng, fb0.num_tokens), pool, verbose=False)
    addresses, prev = None, None
    for bs in (8, 5, 8):
        rows = rng.choice(np.arange(1, 17), bs, replace=False).astype(np.int32)
        committed = rng.integers(1, 30, bs).astype(np.int32)
        fb, q_lens = make_batch(mode, rows, committed, table, rng)
        pool = make_pool(num_slots, table, rows, prior_tokens(mode, committed), rng)
        tok = rand_tokens(rng, fb.num_tokens)
        want = expected(pool, table, rows, fb, q_lens, tok, 4, KV_OFFSET[mode])
        eager = np.asarray(runner.eager(fb, tok, KVPool(pool.k + 0, pool.v + 0))[0])
        traces = runner.trace_count
        got, _ = runner.replay(fb, tok, pool)
        assert runner.trace_count == traces, "a static-buffer replay must not retrace"
        inputs, outputs = runner.buffers[next(iter(runner.buffers))]
        now = [x.unsafe_buffer_pointer() for x in jax.tree.leaves((inputs, outputs))]
        assert addresses is None or now == addresses, "static buffers moved between replays"
        addresses = now
        if prev is not None:
            assert prev.is_deleted(), "the previous full-bucket output must be the reused buffer"
        prev = got if bs == 8 else None
        got = np.asarray(jnp.copy(got))  # on CPU, np.asarray(got) itself would pin the buffer (zero-copy view)
        np.testing.assert_allclose(got, eager, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(got.reshape(-1, HQ, D), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_extend_token_buckets_capture_and_replay():
    """``token_buckets``: a ragged extend pads to (batch bucket, token bucket) and replays its captured
    executable (no retrace), equal to the eager step and the reference per token, with the step's K/V
    written and nothing else changed; ``trim=False`` hands back the bucket's rows, the step's first; an
    extend past the last token bucket runs eagerly. Catches padded tokens planned into a real request,
    padded writes landing outside slot 0, and a replay that retraces per ragged shape."""
    rng = np.random.default_rng(21)
    table, num_slots = make_table(16, 4, seed=9)
    backend = FlashAttentionBackend(table, page_size=4, max_context_len=MAX_CTX, impl="triton", num_heads=(HQ, HKV))
    runner = StepRunner(backend, attn_step(backend), batch_buckets=(4, 8), token_buckets=(16, 32),
                        donate_argnums=())
    rows0 = np.arange(1, 9, dtype=np.int32)
    lens0 = np.array([4] * 7 + [28], np.int32)  # 32 tokens: the (8, 32) bucket
    fb0 = ForwardBatch(ForwardMode.EXTEND, rows0, lens0, np.zeros(32, np.int32), extend_seq_lens=lens0)
    assert runner.capturable(fb0) and fb0.num_tokens == 32
    pool0 = make_pool(num_slots, table, rows0, np.full(8, 40), rng)
    runner.capture([fb0], rand_tokens(rng, 32), pool0, verbose=False)
    traces = runner.trace_count
    for bs in (5, 7):  # two ragged shapes, one bucket (8 rows, 32 tokens)
        rows = rng.choice(np.arange(1, 17), bs, replace=False).astype(np.int32)
        committed = rng.integers(0, 20, bs).astype(np.int32)
        fb, q_lens = make_batch("extend", rows, committed, table, rng)
        assert runner.capturable(fb), fb.num_tokens
        pool = make_pool(num_slots, table, rows, committed, rng)
        tok = rand_tokens(rng, fb.num_tokens)
        want = expected(pool, table, rows, fb, q_lens, tok, 4, 0)
        eager = np.asarray(runner.eager(fb, tok, pool)[0])
        traces = runner.trace_count
        full, new_pool = runner.replay(fb, tok, pool, trim=False)
        assert runner.trace_count == traces, "an extend inside a captured token bucket must not retrace"
        full = np.asarray(full)
        assert full.shape == (32, HQ * D)
        got = full[:fb.num_tokens]
        np.testing.assert_allclose(got, eager, rtol=2e-5, atol=2e-5)
        np.testing.assert_allclose(got.reshape(-1, HQ, D), np.asarray(want), rtol=1e-4, atol=1e-4)
        k_want = np.array(pool.k)
        k_want[fb.out_cache_loc] = np.asarray(tok["k"]).reshape(-1, HKV, D)
        k_got = np.array(new_pool.k)
        k_want[0] = k_got[0]  # slot 0 takes the padded tokens' writes
        np.testing.assert_array_equal(k_got, k_want)
    # past the last token bucket: eager (a new trace), still right
    rows = np.arange(1, 5, dtype=np.int32)
    fb = ForwardBatch(ForwardMode.EXTEND, rows, np.full(4, 10, np.int32), table[rows, :10].reshape(-1),
                      extend_seq_lens=np.full(4, 10, np.int32))
    assert not runner.capturable(fb)
    pool = make_pool(num_slots, table, rows, np.zeros(4, np.int32), rng)
    tok = rand_tokens(rng, 40)
    got, _ = runner.replay(fb, tok, pool)
    want = expected(pool, table, rows, fb, np.full(4, 10), tok, 4, 0)
    np.testing.assert_allclose(np.asarray(got).reshape(-1, HQ, D), np.asarray(want), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_extend_with_prefix_eager(impl):
    rng = np.random.default_rng(7)
    table, num_slots = make_table(6, 4, seed=1)
    backend = FlashAttentionBackend(table, page_size=4, max_context_len=MAX_CTX, impl=impl)
    runner = StepRunner(backend, attn_step(backend))
    rows = np.array([3, 1, 5], np.int32)
    committed = np.array([0, 9, 17], np.int32)
    fb, q_lens = make_batch("extend", rows, committed, table, rng)
    pool = make_pool(num_slots, table, rows, committed, rng)
    tok = rand_tokens(rng, fb.num_tokens)
    got, _ = runner.eager(fb, tok, pool)
    want = expected(pool, table, rows, fb, q_lens, tok, 4, 0)
    np.testing.assert_allclose(np.asarray(got).reshape(-1, HQ, D), np.asarray(want), rtol=1e-4, atol=1e-4)


def test_idle_and_errors():
    table, _ = make_table(2, 1, seed=0)
    backend = FlashAttentionBackend(table, page_size=1, max_context_len=MAX_CTX, impl="reference")
    idle = ForwardBatch(ForwardMode.IDLE, np.zeros(0), np.zeros(0), np.zeros(0))
    md = backend.plan(idle)
    pool = KVPool.zeros(MAX_CTX * 3, HKV, D, jnp.float32)
    out, same = backend.forward(jnp.zeros((0, HQ * D)), jnp.zeros((0, HKV * D)), jnp.zeros((0, HKV * D)),
                                LAYER, pool, md)
    assert out.shape == (0, HQ * D) and same is pool
    with pytest.raises(NotImplementedError, match="topk"):
        backend.plan(ForwardBatch(ForwardMode.DRAFT_EXTEND, [1], [4], [1, 2],
                                  spec_info=SpecInfo(topk=2, accept_length=np.array([1]))))
    with pytest.raises(ValueError, match="draft_mask"):
        backend.plan(ForwardBatch(ForwardMode.TARGET_VERIFY, [1], [4], [1, 2],
                                  spec_info=SpecInfo(topk=2, num_draft_tokens=2)))
    with pytest.raises(ValueError, match="must be one of"):
        FlashAttentionBackend(table, impl="cuda")
    with pytest.raises(ValueError, match="multiple"):
        LayerParams(num_q_heads=6, num_kv_heads=4, head_dim=8)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_layer_stacked_pool_equals_per_layer_pool(impl):
    rng = np.random.default_rng(5)
    table, num_slots = make_table(4, 4, seed=6)
    backend = FlashAttentionBackend(table, page_size=4, max_context_len=MAX_CTX, impl=impl)
    rows = np.array([2, 4, 1], np.int32)
    committed = np.array([7, 20, 3], np.int32)
    pools = [make_pool(num_slots, table, rows, committed, rng) for _ in range(2)]
    stacked = KVPool(jnp.stack([p.k for p in pools]), jnp.stack([p.v for p in pools]))
    fb, _ = make_batch("decode", rows, committed, table, rng)
    md = backend.plan(fb)
    tok = rand_tokens(rng, fb.num_tokens)
    want, want_pool = backend.forward(tok["q"], tok["k"], tok["v"], LAYER, pools[1], md)
    got, new_stacked = jax.jit(lambda s, i: backend.forward(tok["q"], tok["k"], tok["v"], LAYER, s, md,
                                                            layer_index=i))(stacked, jnp.int32(1))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.asarray(new_stacked.k[1]), np.asarray(want_pool.k))
    np.testing.assert_array_equal(np.asarray(new_stacked.k[0]), np.asarray(pools[0].k))  # other layer untouched
    with pytest.raises(ValueError, match="layer_index"):
        backend.forward(tok["q"], tok["k"], tok["v"], LAYER, stacked, md)


def test_validation_mode_reads_the_device_flag():
    table, num_slots = make_table(4, 4, seed=1)
    rows = np.array([1, 2], np.int32)
    ok = ForwardBatch(ForwardMode.DECODE, rows, [5, 9], table[rows, [4, 8]])
    too_long = ForwardBatch(ForwardMode.DECODE, rows, [5, MAX_CTX + 9], table[rows, [4, 8]])
    bad_table = table.copy()
    bad_table[2, 4] = num_slots + 40  # a page id past the pool: only the device sees req_to_token
    for validate in (False, True):
        backend = FlashAttentionBackend(bad_table, page_size=4, max_context_len=MAX_CTX, impl="reference",
                                        num_slots=num_slots, validate=validate)
        with pytest.raises(ValueError, match="page table holds"):
            backend.plan(too_long)  # host check, always on
        backend.plan(ForwardBatch(ForwardMode.DECODE, rows[:1], [5], table[rows[:1], [4]]))  # row 1 is clean
        if validate:
            with pytest.raises(ValueError, match="outside the KV pool"):
                backend.plan(ok)
        else:
            md = backend.plan(ok)  # no sync by default: the flag waits for check()
            with pytest.raises(ValueError, match="req_to_token entry"):
                backend.check(md)


def test_command_buffers_flag_only_on_gpu(monkeypatch):
    """``StepRunner(command_buffers=False)`` clears XLA's command-buffer flag on a GPU; the default
    keeps them, other backends (the flag is GPU-only) and an explicit caller setting are left alone."""
    from jax_attn import capture

    flag = "xla_gpu_enable_command_buffer"
    monkeypatch.setattr(capture.jax, "default_backend", lambda: "cpu")
    assert capture._with_command_buffers(None, False) is None
    monkeypatch.setattr(capture.jax, "default_backend", lambda: "gpu")
    assert capture._with_command_buffers(None, True) is None
    assert capture._with_command_buffers(None, False) == {flag: ""}
    assert capture._with_command_buffers({"a": 1}, False) == {"a": 1, flag: ""}
    assert capture._with_command_buffers({flag: "FUSION"}, False) == {flag: "FUSION"}


def test_eager_compiler_options_reach_eager_executables_only(monkeypatch):
    """``StepRunner(eager_compiler_options=...)`` compiles ``eager`` calls with them and captured buckets
    without them. Catches eager calls compiled by the buckets' ``jax.jit`` (the options would be lost),
    and buckets compiled with the eager options (autotuning the executables that replay most)."""
    from jax_attn import capture

    bogus = {"xla_jax_attn_no_such_option": True}  # XLA rejects an option it does not know
    rng = np.random.default_rng(5)
    table, num_slots = make_table(8, 4, seed=3)
    backend = FlashAttentionBackend(table, page_size=4, max_context_len=MAX_CTX, impl="reference")
    runner = StepRunner(backend, attn_step(backend), batch_buckets=(4,), compile_cache=False,
                        eager_compiler_options=bogus)
    rows = np.arange(1, 5, dtype=np.int32)
    committed = np.array([3, 9, 1, 14], np.int32)
    fb, _ = make_batch("decode", rows, committed, table, rng)
    pool = make_pool(num_slots, table, rows, committed, rng)
    tok = rand_tokens(rng, 4)
    runner.capture([fb], tok, pool, verbose=False)  # the bucket compiles without them
    runner.replay(fb, tok, pool)
    with pytest.raises(Exception, match="xla_jax_attn_no_such_option"):
        runner.eager(fb, tok, pool)

    # The default: cuBLAS GEMMs for eager executables on a GPU, nothing added elsewhere.
    monkeypatch.setattr(capture.jax, "default_backend", lambda: "cpu")
    assert capture.eager_options(None, None) is None
    assert capture.eager_options({"a": 1}, None) == {"a": 1}
    monkeypatch.setattr(capture.jax, "default_backend", lambda: "gpu")
    assert capture.eager_options(None, None) == capture.EAGER_GPU_OPTIONS
    assert capture.eager_options({"a": 1}, None) == {"a": 1, **capture.EAGER_GPU_OPTIONS}
    assert capture.eager_options({"a": 1}, {}) == {"a": 1}  # opted out
    assert capture.eager_options(None, {"xla_gpu_enable_triton_gemm": True}) == {"xla_gpu_enable_triton_gemm": True}


@pytest.mark.parametrize("static_buffers", [False, True])
def test_int32_token_inputs_travel_packed_from_host_or_as_device_arguments(static_buffers):
    """Host int32 token leaves go to the device inside the plan's packed vector; device ones are
    arguments; a bucket captured with one kind replays with the other. The step reads both leaves
    (same shape: a shared cached zeros argument must not be donated twice) and the planned lengths.
    Catches a step that reads a slot's zeros when the argument was given (or the reverse), a replay
    that reuses the capture's values, and token outputs not sliced back to the real tokens."""
    table, num_slots = make_table(8, 4, seed=4)
    backend = FlashAttentionBackend(table, page_size=4, max_context_len=MAX_CTX, impl="reference")

    def step(md, tok, scale):
        return tok["x"] * 3 + tok["y"] + md.cache_seqlens[:tok["x"].shape[0]], scale * 2.0

    runner = StepRunner(backend, step, batch_buckets=(4,), compile_cache=False, static_buffers=static_buffers)
    rows = np.arange(1, 5, dtype=np.int32)
    lens = np.array([3, 9, 2, 14], np.int32)
    fb = ForwardBatch(ForwardMode.DECODE, rows, lens, table[rows, lens - 1])
    scale = jnp.float32(1.5)
    runner.capture([fb], dict(x=np.full(4, 7, np.int32), y=jnp.full(4, 5, jnp.int32)), scale, verbose=False)
    traces = runner.trace_count
    rng = np.random.default_rng(9)
    for x_host, y_host in [(True, False), (False, True), (True, True), (False, False)]:
        x = rng.integers(-50, 50, 4).astype(np.int32)
        y = rng.integers(-50, 50, 4).astype(np.int32)
        tok = dict(x=x if x_host else jnp.asarray(x), y=y if y_host else jnp.asarray(y))
        out, other = runner.replay(fb, tok, scale)
        np.testing.assert_array_equal(np.asarray(out), x * 3 + y + lens, err_msg=f"{x_host=} {y_host=}")
        assert float(other) == 3.0
        # three requests: padded to the bucket, token outputs cut back to three
        three = ForwardBatch(ForwardMode.DECODE, rows[:3], lens[:3], table[rows[:3], lens[:3] - 1])
        out3, _ = runner.replay(three, jax.tree.map(lambda a: a[:3], tok), scale)
        np.testing.assert_array_equal(np.asarray(out3), (x * 3 + y + lens)[:3])
    assert runner.trace_count == traces, "host and device token leaves must replay the same executable"


def _tree_verify_batch(rows, committed, table, num_draft=3):
    mask = np.tril(np.ones((num_draft, num_draft), bool))[None].repeat(len(rows), 0)
    loc = np.concatenate([table[r, c:c + num_draft] for r, c in zip(rows, committed)]).astype(np.int32)
    return ForwardBatch(ForwardMode.TARGET_VERIFY, rows, committed, loc,
                        spec_info=SpecInfo(topk=2, num_draft_tokens=num_draft, draft_mask=mask, with_swa=True))


@pytest.mark.parametrize("impl", ["triton", "auto_on_hopper"])
@pytest.mark.parametrize("mode", ["decode", "extend", "verify", "draft_decode", "draft_extend", "tree_verify"])
def test_layer_calls_take_their_schedules_from_the_step_plan(mode, impl, monkeypatch):
    """Every kernel call of a step takes its work schedule (and, for a cascade's Mosaic parts, the LSE
    index) from the step plan: full, sliding-window and Llama-4 local layers, the tree cascade's
    prefix, expand and SWA passes. ``auto_on_hopper``: ``auto`` with Hopper faked, so the Mosaic
    kernel (traced, not run) takes what it covers. Planning inside a call raises here.

    Bug caught: a part of a plan left without its schedule makes every layer of every step plan it
    again on the device (this is how cross layers, the tree SWA pass and Mosaic's cascade LSE index ran)."""
    from jax_attn import kernel_policy

    forbid_kernel_planning(monkeypatch)
    if impl == "auto_on_hopper":
        monkeypatch.setattr(kernel_policy, "on_hopper", lambda: True)
    page, d, ctx = 16, 64, 64
    table, num_slots = shuffled_table(8, ctx, page, seed=4)
    backend = FlashAttentionBackend(table, page_size=page, max_context_len=ctx, impl=impl.split("_")[0],
                                    num_heads=(HQ, HKV), attention_chunk_size=32)
    rows, committed = np.array([1, 3, 6], np.int32), np.array([20, 9, 40], np.int32)
    rng = np.random.default_rng(0)
    fb = _tree_verify_batch(rows, committed, table) if mode == "tree_verify" else \
        make_batch(mode, rows, committed, table, rng)[0]
    md = backend.plan(fb)
    layers = [LayerParams(HQ, HKV, d), LayerParams(HQ, HKV, d, sliding_window_size=8, logit_cap=30.0)]
    if mode in ("decode", "extend", "verify", "draft_decode"):  # modes whose plans carry the local batch
        layers.append(LayerParams(HQ, HKV, d, use_irope=True))
    t = fb.num_tokens
    bf16 = jnp.bfloat16
    q = jax.ShapeDtypeStruct((t, HQ * d), bf16)
    kv = jax.ShapeDtypeStruct((t, HKV * d), bf16)
    pool = KVPool(jax.ShapeDtypeStruct((num_slots, HKV, d), bf16), jax.ShapeDtypeStruct((num_slots, HKV, d), bf16))
    for layer in layers:
        out, _ = jax.eval_shape(lambda md, q, k, v, pool: backend.forward(q, k, v, layer, pool, md), md, q, kv, kv,
                                pool)
        assert out.shape == (t, HQ * d)


def test_a_layer_with_other_heads_plans_its_own_schedule(monkeypatch):
    """A schedule says the heads it was planned for: a layer with other heads (here 8 / 2 under a plan
    for 4 / 2) plans its own inside the call, and its output is right.

    Bug caught: the Triton kernel taking a schedule planned for another query-head group."""
    rng = np.random.default_rng(21)
    table, num_slots = make_table(8, 4, seed=8)
    backend = FlashAttentionBackend(table, page_size=4, max_context_len=MAX_CTX, impl="triton", num_heads=(HQ, HKV))
    rows, committed = np.array([2, 5, 7], np.int32), np.array([6, 19, 33], np.int32)
    fb, q_lens = make_batch("verify", rows, committed, table, rng)
    md = backend.plan(fb)
    assert md.schedule.heads == (HQ, HKV)
    wide = LayerParams(num_q_heads=2 * HQ, num_kv_heads=HKV, head_dim=D)
    pool = make_pool(num_slots, table, rows, committed + 3, rng)
    q = jnp.asarray(rng.standard_normal((fb.num_tokens, 2 * HQ * D)), jnp.float32)
    out, _ = backend.forward(q, None, None, wide, pool, md, save_kv_cache=False)
    width = -(-MAX_CTX // 4)
    want = paged_attention_reference(
        q.reshape(-1, 2 * HQ, D), paged_view(pool.k, 4), paged_view(pool.v, 4), jnp.asarray(committed + 3),
        jnp.asarray(np.concatenate([[0], np.cumsum(q_lens)]), jnp.int32),
        jnp.asarray(table[rows][:, ::4][:, :width] // 4), page_size=4)
    np.testing.assert_allclose(np.asarray(out).reshape(-1, 2 * HQ, D), np.asarray(want), rtol=1e-4, atol=1e-4)
    forbid_kernel_planning(monkeypatch)  # (clears the traced call above)
    with pytest.raises(AssertionError, match="planned its own schedule"):
        backend.forward(q, None, None, wide, pool, md, save_kv_cache=False)
