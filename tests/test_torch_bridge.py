"""torch_bridge contract on torch CPU tensors: equals the reference and the JAX backend per mode;
capture/replay equals eager with re-planned lengths and never retraces; in-place KV writes are seen
through the cached views; error paths leave the cache unchanged. GPU checks carry ``gpu``."""

import zlib

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

from jax_attn.backend import FlashAttentionBackend as JaxBackend
from jax_attn.backend import LayerParams
from jax_attn.batch import ForwardBatch as JaxBatch
from jax_attn.batch import SpecInfo as JaxSpec
from jax_attn.batch import RAGGED_MIN_ROWS, token_class
from jax_attn.kv_cache import KVPool, paged_view
from jax_attn.reference import paged_attention_reference
from tests.paging import shuffled_table
from torch_bridge import (FlashAttentionBackend, ForwardBatch, ForwardMode, MHATokenToKVPool, ModelConfig,
                          ModelRunner, RadixAttention, ReqToTokenPool, ServerArgs, SpecInfo)

# engine calls under plain / no_grad / inference mode (tests/conftest.py: JAX_ATTN_GRAD_MODES)
pytestmark = pytest.mark.usefixtures("engine_grad_mode")

HQ, HKV, D = 4, 2, 16
MAX_CTX = 48
NUM_DRAFT, STEP_ID = 3, 1
KV_OFFSET = {"decode": 0, "draft_decode": STEP_ID + 1, "verify": NUM_DRAFT, "draft_extend": 0, "extend": 0}


def make_runner(num_reqs, page_size, seed, impl="reference", device="cpu", dtype=torch.float32):
    """Shuffled pages per request row (row 0 / page 0 reserved); NaN pools except slot 0."""
    table, num_slots = shuffled_table(num_reqs, MAX_CTX, page_size, seed)
    pool = MHATokenToKVPool.create(num_slots, 2, HKV, D, dtype, device)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.fill_(float("nan"))
        buf[0] = 0.0
    runner = ModelRunner(ReqToTokenPool(torch.from_numpy(table).to(device).clone()), pool, ModelConfig(MAX_CTX),
                         page_size=page_size, server_args=ServerArgs(speculative_num_draft_tokens=NUM_DRAFT),
                         attention_impl=impl)
    return runner, table


def fill_committed(runner, table, rows, kv_lens, rng, layer_id=0):
    """Random K/V in each request's first ``kv_lens`` positions."""
    kb, vb = runner.token_to_kv_pool.get_kv_buffer(layer_id)
    for r, n in zip(rows, kv_lens):
        s = torch.from_numpy(table[r, :n].astype(np.int64)).to(kb.device)
        kb[s] = torch.from_numpy(rng.standard_normal((n, HKV, D)).astype(np.float32)).to(kb)
        vb[s] = torch.from_numpy(rng.standard_normal((n, HKV, D)).astype(np.float32)).to(vb)


def make_batch(mode, rows, committed, table, rng, runner):
    """SGLang-style batch (int64 tensors) of ``mode`` on top of ``committed`` tokens per request."""
    bs = len(rows)
    spec, ext, fm = None, None, ForwardMode.EXTEND
    if mode in ("decode", "draft_decode"):
        q_lens, fm = np.ones(bs, np.int64), ForwardMode.DECODE
        spec = SpecInfo() if mode == "draft_decode" else None
    elif mode == "verify":
        q_lens, fm = np.full(bs, NUM_DRAFT, np.int64), ForwardMode.TARGET_VERIFY
        spec = SpecInfo(draft_token_num=NUM_DRAFT)
    elif mode == "draft_extend":
        acc = rng.integers(0, NUM_DRAFT, bs)
        q_lens, fm = acc + 1, ForwardMode.DRAFT_EXTEND
        spec = SpecInfo(accept_length=torch.from_numpy(acc.astype(np.int32)), draft_token_num=NUM_DRAFT)
    else:
        q_lens = rng.integers(1, 6, bs)
        ext = torch.from_numpy(q_lens.astype(np.int64))
    start = committed + (STEP_ID if mode == "draft_decode" else 0)
    loc = np.concatenate([table[r, s:s + n] for r, s, n in zip(rows, start, q_lens)]).astype(np.int64)
    seq_lens = committed if mode in ("verify", "draft_decode") else start + q_lens
    fb = ForwardBatch(fm, bs, torch.from_numpy(np.asarray(rows, np.int64)), torch.from_numpy(seq_lens.astype(np.int64)),
                      torch.from_numpy(loc), extend_seq_lens=ext, spec_info=spec,
                      token_to_kv_pool=runner.token_to_kv_pool)
    return fb, q_lens.astype(np.int32), start


def rand_qkv(rng, n):
    def t(h):
        return torch.from_numpy(rng.standard_normal((n, h * D)).astype(np.float32))
    return t(HQ), t(HKV), t(HKV)


def layer(layer_id=0, **kw):
    return RadixAttention(HQ, D, D**-0.5, HKV, layer_id, **kw)


def reference(runner, table, fb, q_lens, q, mode, page_size, layer_id=0, **kw):
    """Reference over the pool as torch left it (after the bridge wrote this step's K/V)."""
    kb, vb = (jnp.asarray(b.cpu().numpy()) for b in runner.token_to_kv_pool.get_kv_buffer(layer_id))
    rows = fb.req_pool_indices.numpy()
    kv_lens = fb.seq_lens.numpy().astype(np.int32) + KV_OFFSET[mode]
    width = -(-MAX_CTX // page_size)
    pt = table[rows][:, ::page_size][:, :width] // page_size if page_size > 1 else table[rows]
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    out = paged_attention_reference(jnp.asarray(q.numpy()).reshape(-1, HQ, D), paged_view(kb, page_size),
                                    paged_view(vb, page_size), jnp.asarray(kv_lens), jnp.asarray(cu),
                                    jnp.asarray(pt), page_size=page_size, **kw)
    return np.asarray(out).reshape(q.shape[0], HQ * D)


def jax_backend_out(runner, table, fb, q, mode, page_size, impl="reference"):
    """The JAX backend on the same batch, pool read back from torch (no write: already written)."""
    jb = JaxBackend(table, page_size=page_size, max_context_len=MAX_CTX, impl=impl)
    spec = None
    if fb.spec_info is not None:
        acc = fb.spec_info.accept_length
        spec = JaxSpec(num_draft_tokens=NUM_DRAFT, step_id=STEP_ID,
                       accept_length=None if acc is None else acc.numpy())
    batch = JaxBatch(ForwardMode(fb.forward_mode), fb.req_pool_indices.numpy(), fb.seq_lens.numpy(),
                     fb.out_cache_loc.numpy(), None if fb.extend_seq_lens is None else fb.extend_seq_lens.numpy(),
                     spec_info=spec)
    pool = KVPool(*(jnp.asarray(b.numpy()) for b in runner.token_to_kv_pool.get_kv_buffer(0)))
    out, _ = jb.forward(jnp.asarray(q.numpy()), None, None, LayerParams(HQ, HKV, D), pool, jb.plan(batch),
                        save_kv_cache=False)
    return np.asarray(out)


MODES = ["extend", "decode", "draft_decode", "verify", "draft_extend"]


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("mode", MODES)
def test_matches_reference_and_jax_backend(mode, page_size):
    rng = np.random.default_rng(zlib.crc32(repr((mode, page_size)).encode()))
    runner, table = make_runner(8, page_size, seed=page_size)
    backend = FlashAttentionBackend(runner, speculative_step_id=STEP_ID, topk=1)
    rows = np.array([3, 1, 6, 2], np.int32)
    committed = np.array([0 if mode == "extend" else 4, 9, 17, 30], np.int64)
    fb, q_lens, start = make_batch(mode, rows, committed, table, rng, runner)
    fill_committed(runner, table, rows, start, rng)
    q, k, v = rand_qkv(rng, int(q_lens.sum()))
    backend.init_forward_metadata(fb)
    got = backend.forward(q, k, v, layer(), fb)
    assert got.shape == (q.shape[0], HQ * D) and got.dtype == torch.float32
    got = got.numpy()
    assert np.all(np.isfinite(got))
    kb = runner.token_to_kv_pool.k_buffer[0]
    np.testing.assert_array_equal(kb[fb.out_cache_loc].numpy(), k.reshape(-1, HKV, D).numpy())
    np.testing.assert_allclose(got, reference(runner, table, fb, q_lens, q, mode, page_size), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got, jax_backend_out(runner, table, fb, q, mode, page_size), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["extend", "decode", "verify", "draft_extend"])
def test_jax_path_layers_take_their_schedules_from_the_plan(mode, monkeypatch):
    """Once a layer has run as a JAX executable, the next eager plans carry its kernel's work schedule:
    from the second step on, planning inside a layer call raises here, and results stay right.

    Bug caught: the JAX path planning the schedule again in every layer call of every step."""
    from tests.attention_cases import forbid_kernel_planning

    rng = np.random.default_rng(zlib.crc32(repr(("jax_heads", mode)).encode()))
    runner, table = make_runner(16, 4, seed=2, impl="triton")
    backend = FlashAttentionBackend(runner, speculative_step_id=STEP_ID, topk=1)
    for step in range(2):
        if step == 1:
            assert backend.planner.jax_heads == (HQ, HKV)
            forbid_kernel_planning(monkeypatch)
        bs = 5 + step  # a new batch size: the layer's executable is traced again (the planning happens then)
        rows = rng.choice(np.arange(1, 17), bs, replace=False).astype(np.int32)
        fb, q_lens, start = make_batch(mode, rows, rng.integers(1, 30, bs), table, rng, runner)
        fill_committed(runner, table, rows, start, rng)
        q, k, v = rand_qkv(rng, int(q_lens.sum()))
        backend.init_forward_metadata(fb)
        traces = backend.trace_count
        got = backend.forward(q, k, v, layer(), fb).numpy()
        assert backend.trace_count > traces, "the layer's executable must be traced in each step here"
        np.testing.assert_allclose(got, reference(runner, table, fb, q_lens, q, mode, 4), rtol=1e-4, atol=1e-4)


def test_layer_options_sinks_window_softcap_and_triton():
    """Sliding window, logit cap and sinks reach the kernel; the Pallas kernel path (interpret) agrees."""
    _layer_options_case()


def test_cpu_pools_run_the_pallas_kernel_interpreted_when_jax_defaults_to_a_gpu(monkeypatch):
    """torch CPU pools on a GPU machine (JAX's default backend a GPU): the layer executable is compiled for
    the CPU, so its Pallas kernel must run interpreted. Bug caught: the kernel choosing compiled Triton by
    ``jax.default_backend()`` (failed on the H100 machine)."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    _layer_options_case()


def _layer_options_case():
    rng = np.random.default_rng(5)
    runner, table = make_runner(6, 4, seed=9, impl="triton")
    backend = FlashAttentionBackend(runner)
    rows = np.array([2, 5, 1], np.int32)
    fb, q_lens, start = make_batch("extend", rows, np.array([3, 11, 20], np.int64), table, rng, runner)
    fill_committed(runner, table, rows, start, rng)
    q, k, v = rand_qkv(rng, int(q_lens.sum()))
    sinks = torch.from_numpy(rng.standard_normal(HQ).astype(np.float32))
    lay = layer(logit_cap=5.0, sliding_window_size=7)
    backend.init_forward_metadata(fb)
    got = backend.forward(q, k, v, lay, fb, sinks=sinks).numpy()
    want = reference(runner, table, fb, q_lens, q, "extend", 4, softcap=5.0, window_size=(7, 0),
                     sinks=jnp.asarray(sinks.numpy()))
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("mode", ["extend", "decode", "draft_extend"])
def test_eager_steps_compile_once_per_shape_class(mode):
    """Eager steps plan at their shape class (``step_planner.eager_shape``: batch class for decode; for ragged
    modes 16 rows up to 16 requests on a GPU, ``jax_attn.batch.ragged_rows``, and the token class), so engine traffic of
    ever-new shapes stops compiling once its classes are seen: three decode batches of 5-8 requests (class 8),
    or three ragged batches of 1, 3 and 6 requests (batch classes 1, 4, 8) of one token class, trace nothing
    after the first, and each equals the reference with its K/V written and every other slot unchanged.
    Catches a plan keyed on the exact shape (a compile per step), a ragged plan keyed on the batch class,
    padded rows or tokens read as real ones, and padded writes."""
    rng = np.random.default_rng(zlib.crc32(f"class {mode}".encode()))  # not hash(): salted per process
    runner, table = make_runner(16, 4, seed=7)
    backend = FlashAttentionBackend(runner, speculative_step_id=STEP_ID, topk=1)
    assert backend.planner.ragged_min_rows == 1  # the CPU's rule (a padded row costs an interpreted grid step)
    backend.planner.ragged_min_rows = RAGGED_MIN_ROWS  # the GPU's, tested here
    traces, cls = None, None
    for bs in (6, 8, 5) if mode == "decode" else (1, 3, 6):
        for _ in range(500):  # ragged token counts, all of the first batch's token class
            rows = rng.choice(np.arange(1, 17), bs, replace=False).astype(np.int32)
            fb, q_lens, start = make_batch(mode, rows, rng.integers(1, 30, bs), table, rng, runner)
            cls = cls or token_class(int(q_lens.sum()))
            if token_class(int(q_lens.sum())) == cls:
                break
        assert token_class(int(q_lens.sum())) == cls, f"no batch of {bs} requests drawn in token class {cls}"
        fill_committed(runner, table, rows, start, rng)
        q, k, v = rand_qkv(rng, int(q_lens.sum()))
        before = [b.clone() for b in runner.token_to_kv_pool.get_kv_buffer(0)]
        backend.init_forward_metadata(fb)
        got = backend.forward(q, k, v, layer(), fb).numpy()
        if traces is not None:
            assert backend.trace_count == traces, f"{mode} bs={bs}, {q.shape[0]} tokens: a new shape class compiled"
        traces = backend.trace_count
        np.testing.assert_allclose(got, reference(runner, table, fb, q_lens, q, mode, 4), rtol=1e-4, atol=1e-4)
        loc = fb.out_cache_loc
        for old, new, written in zip(before, runner.token_to_kv_pool.get_kv_buffer(0), (k, v)):
            want = old.clone()
            want[loc] = written.reshape(-1, HKV, D)
            torch.testing.assert_close(new, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("mode,page_size", [("decode", 1), ("verify", 4), ("draft_extend", 4), ("draft_decode", 4)])
def test_capture_replay_equals_eager_no_retrace(mode, page_size):
    rng = np.random.default_rng(zlib.crc32(repr(("cap", mode, page_size)).encode()))
    runner, table = make_runner(16, page_size, seed=3)
    backend = FlashAttentionBackend(runner, speculative_step_id=STEP_ID, topk=1)
    per_req = NUM_DRAFT if mode in ("verify", "draft_extend") else 1
    backend.init_cuda_graph_state(8, 8 * per_req)
    # Capture bucket 8 (SGLang's capture inputs: fill values), then the capture run.
    fb8, _, _ = make_batch(mode, np.arange(1, 9), np.full(8, 5, np.int64), table, rng, runner)
    backend.init_forward_metadata_capture_cuda_graph(8, 8 * per_req, fb8.req_pool_indices, fb8.seq_lens, None,
                                                     fb8.forward_mode, fb8.spec_info)
    qc, kc, vc = rand_qkv(rng, 8 * per_req)
    backend.forward(qc, kc, vc, layer(), fb8, save_kv_cache=False)
    traces = backend.trace_count
    for bs in (5, 8):  # re-planned lengths, raw (unpadded) inputs
        rows = rng.choice(np.arange(1, 17), bs, replace=False).astype(np.int32)
        fb, q_lens, start = make_batch(mode, rows, rng.integers(1, 30, bs), table, rng, runner)
        fill_committed(runner, table, rows, start, rng)
        n_tok = int(q_lens.sum())
        q, k, v = rand_qkv(rng, n_tok)
        runner.token_to_kv_pool.set_kv_buffer(layer(), fb.out_cache_loc, k, v)
        backend.init_forward_metadata_replay_cuda_graph(8, fb.req_pool_indices, fb.seq_lens, None, None,
                                                        fb.forward_mode, fb.spec_info, None)
        if mode == "draft_extend":  # replay runs the padded token layout, as SGLang's graph runner does
            pad = 8 * per_req - n_tok
            got = backend.forward(torch.cat([q, q.new_zeros(pad, q.shape[1])]), None, None, layer(), fb,
                                  save_kv_cache=False)[:n_tok]
        else:
            got = backend.forward(q, None, None, layer(), fb, save_kv_cache=False)
        assert backend.trace_count == traces, "replay inside a captured bucket must not retrace"
        backend.init_forward_metadata(fb)
        eager = backend.forward(q, None, None, layer(), fb, save_kv_cache=False)
        np.testing.assert_allclose(got.numpy(), eager.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got.numpy(), reference(runner, table, fb, q_lens, q, mode, page_size),
                                   rtol=1e-4, atol=1e-4)
        traces = backend.trace_count


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_replay_reads_static_buffers_written_in_place(device):
    """SGLang's graph runner copies each step's indices into the same static buffers and passes slices
    of them to the replay hook: every replay must plan from the values written since the last one (on
    CUDA the copies are queued on torch's stream, the plan runs on JAX's).

    Bug caught: the view of ``req_pool_indices`` kept across replays reading a copy (or the first
    replay's rows), or a plan not ordered after the copies, so later steps attend other requests' pages."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    rng = np.random.default_rng(13)
    # CUDA: layers launched from torch (the Triton-lowered kernel at float32), as the hooks need there
    runner, table = make_runner(16, 4, seed=6, device=device, impl="auto" if device == "cuda" else "reference")
    backend = FlashAttentionBackend(runner)
    backend.init_cuda_graph_state(6, 6)
    rows_buf = torch.zeros(6, dtype=torch.int64, device=device)
    lens_buf = torch.ones(6, dtype=torch.int64, device=device)
    backend.init_forward_metadata_capture_cuda_graph(4, 4, rows_buf[:4], lens_buf[:4], None, ForwardMode.DECODE, None)
    lay = layer()
    for _ in range(3):
        rows = rng.choice(np.arange(1, 17), 4, replace=False).astype(np.int32)
        fb, q_lens, start = make_batch("decode", rows, rng.integers(1, 40, 4), table, rng, runner)
        fill_committed(runner, table, rows, start, rng)
        if device == "cuda":
            torch.cuda._sleep(20_000_000)  # the copies below wait in torch's stream: an unordered plan reads old rows
        rows_buf[:4].copy_(fb.req_pool_indices.to(device), non_blocking=True)
        lens_buf[:4].copy_(fb.seq_lens.to(device), non_blocking=True)
        q, k, v = (x.to(device) for x in rand_qkv(rng, 4))
        fb.out_cache_loc = fb.out_cache_loc.to(device)
        backend.init_forward_metadata_replay_cuda_graph(4, rows_buf[:4], lens_buf[:4], None, None, ForwardMode.DECODE,
                                                        None, None)
        out = backend.forward(q, k, v, lay, fb).cpu().numpy()
        got_ref = reference(runner, table, fb, q_lens, q.cpu(), "decode", 4)
        tol = 1e-4 if device == "cpu" else 2e-3  # (a kernel's float32 dots on the GPU; other rows' keys: O(1))
        np.testing.assert_allclose(out, got_ref, rtol=tol, atol=tol)


def test_inplace_kv_write_is_seen_through_cached_view():
    rng = np.random.default_rng(1)
    runner, table = make_runner(4, 4, seed=0)
    backend = FlashAttentionBackend(runner)
    rows = np.array([1, 2], np.int32)
    fb, q_lens, start = make_batch("decode", rows, np.array([6, 13], np.int64), table, rng, runner)
    fill_committed(runner, table, rows, start, rng)
    q, k, v = rand_qkv(rng, 2)
    backend.init_forward_metadata(fb)
    first = backend.forward(q, k, v, layer(), fb).numpy()
    views = dict(backend.runner.importer._views)
    kb = runner.token_to_kv_pool.k_buffer[0]
    assert any(x.unsafe_buffer_pointer() == kb.data_ptr() for x in views.values())
    k2, v2 = k * 3.0, v - 1.0  # same slots, new values: torch writes in place
    second = backend.forward(q, k2, v2, layer(), fb).numpy()
    assert backend.runner.importer._views.keys() == views.keys(), "pools must be imported once, not per call"
    assert not np.allclose(first, second)
    np.testing.assert_allclose(second, reference(runner, table, fb, q_lens, q, "decode", 4), rtol=1e-4, atol=1e-4)
    kb[torch.from_numpy(table[1, :3].astype(np.int64))] += 1.0  # a direct torch write, no bridge call
    third = backend.forward(q, None, None, layer(), fb, save_kv_cache=False).numpy()
    np.testing.assert_allclose(third, reference(runner, table, fb, q_lens, q, "decode", 4), rtol=1e-4, atol=1e-4)
    assert not np.allclose(second[0], third[0])


def _bits(t):
    return t.view(torch.int32).clone()


def decode_steps(runner, table, backend, lay, rng, committed, rows):
    """Decode steps (one per ``committed`` / ``rows`` pair, page size 4) through ``backend``, each checked
    against the reference. Returns layer 0's checked call after each step and the last step's
    ``(fb, q_lens, q, k, v)``."""
    hits = []
    for done, r in zip(committed, rows):
        r = np.array(r, np.int32)
        fb, q_lens, start = make_batch("decode", r, np.array(done, np.int64), table, rng, runner)
        fill_committed(runner, table, r, start, rng)
        q, k, v = rand_qkv(rng, len(r))
        backend.init_forward_metadata(fb)
        out = backend.forward(q, k, v, lay, fb).numpy()
        np.testing.assert_allclose(out, reference(runner, table, fb, q_lens, q, "decode", 4), rtol=1e-4, atol=1e-4)
        hits.append(backend.runner.hits[0])
    return hits, (fb, q_lens, q, k, v)


def test_checked_layer_calls_are_reused_only_while_they_still_hold():
    """A layer checked once on the JAX path (``JaxLayerHit``) skips the checks on later calls: across
    steps of one plan key it reads each step's own plan, a bad call still raises before any write, and a
    reallocated pool buffer is read, not the one it was checked with.

    Bugs caught: a reused call bound to the first step's plan (stale lengths and pages); a reused call
    writing K/V of the wrong shape; a reused call reading a pool the engine replaced."""
    rng = np.random.default_rng(11)
    runner, table = make_runner(8, 4, seed=5)
    backend = FlashAttentionBackend(runner)
    lay = layer()  # the engine's layer object, the same every step
    outs, (fb, q_lens, q, k, v) = decode_steps(runner, table, backend, lay, rng, ([7, 20, 3], [30, 2, 11]),
                                               ([1, 4, 6], [2, 5, 7]))
    assert outs[0] is outs[1], "the second step's call should reuse the checked call"
    before = [_bits(b) for b in runner.token_to_kv_pool.k_buffer + runner.token_to_kv_pool.v_buffer]
    for bq, bk, bv in [(q, k[:, :-2], v), (q, k, v[:-1]), (q, k, v[:, :-1])]:
        with pytest.raises(ValueError, match="must"):
            backend.forward(bq, bk, bv, lay, fb)
    after = [_bits(b) for b in runner.token_to_kv_pool.k_buffer + runner.token_to_kv_pool.v_buffer]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a rejected call must not write the cache"
    pool = runner.token_to_kv_pool
    pool.k_buffer[0] = pool.k_buffer[0] * 2.0  # the engine hands a new buffer (another address)
    pool.v_buffer[0] = pool.v_buffer[0] - 0.5
    out = backend.forward(q, None, None, lay, fb, save_kv_cache=False).numpy()
    np.testing.assert_allclose(out, reference(runner, table, fb, q_lens, q, "decode", 4), rtol=1e-4, atol=1e-4)
    assert backend.runner.hits[0] is not outs[0]


class ViewingPool(MHATokenToKVPool):
    """SGLang's fp8 pools: the buffers are stored in another dtype (``store_dtype``) and every
    ``get_key_buffer`` / ``get_value_buffer`` call hands out a new ``view(dtype)`` of them. Here int32
    storage viewed as float32."""

    def get_key_buffer(self, layer_id):
        return self.k_buffer[layer_id].view(torch.float32)

    def get_value_buffer(self, layer_id):
        return self.v_buffer[layer_id].view(torch.float32)

    def get_kv_buffer(self, layer_id):
        return self.get_key_buffer(layer_id), self.get_value_buffer(layer_id)


def test_checked_layer_call_reused_over_a_pool_that_hands_out_new_views(monkeypatch):
    """A pool whose buffer getters return a new view object each call (SGLang's fp8 pools) still reuses the
    checked layer call, and reads right; a view of other memory (a reallocated buffer) is not reused.

    Bug caught: the reuse test comparing buffer objects only, so every layer call over an SGLang fp8 pool
    redid the checks (and on the launch path looked up its launch again)."""
    from torch_bridge import layer_runner

    rng = np.random.default_rng(12)
    runner, table = make_runner(8, 4, seed=6)
    plain = runner.token_to_kv_pool
    pool = ViewingPool([b.view(torch.int32) for b in plain.k_buffer], [b.view(torch.int32) for b in plain.v_buffer])
    runner.token_to_kv_pool = pool
    checked = []
    real_check = layer_runner.check_layer
    monkeypatch.setattr(layer_runner, "check_layer", lambda *a, **kw: checked.append(1) or real_check(*a, **kw))
    backend = FlashAttentionBackend(runner)
    lay = layer()
    hits, (fb, q_lens, q, _, _) = decode_steps(runner, table, backend, lay, rng, ([9, 4, 21], [13, 30, 2]),
                                               ([1, 3, 6], [2, 5, 7]))
    assert hits[0] is hits[1] and len(checked) == 1, "the second step should reuse the checked call"
    pool.k_buffer[0] = (pool.get_key_buffer(0) * 3.0).view(torch.int32)  # new memory, the same shape
    out = backend.forward(q, None, None, lay, fb, save_kv_cache=False).numpy()
    np.testing.assert_allclose(out, reference(runner, table, fb, q_lens, q, "decode", 4), rtol=1e-4, atol=1e-4)
    assert backend.runner.hits[0] is not hits[0] and len(checked) == 2


def test_errors_leave_cache_unchanged():
    rng = np.random.default_rng(2)
    runner, table = make_runner(4, 1, seed=0)
    backend = FlashAttentionBackend(runner)
    fb, q_lens, start = make_batch("extend", np.array([1, 2], np.int32), np.array([2, 5], np.int64), table, rng, runner)
    q, k, v = rand_qkv(rng, int(q_lens.sum()))
    with pytest.raises(RuntimeError, match="init_forward_metadata"):
        backend.forward(q, k, v, layer(), fb)
    backend.init_forward_metadata(fb)
    before = [_bits(b) for b in runner.token_to_kv_pool.k_buffer + runner.token_to_kv_pool.v_buffer]
    bad = [(q[:, :-1], k, v), (q, k[:, :-2], v), (q, k, v[:-1]), (q[:-1], k[:-1], v[:-1])]
    for bq, bk, bv in bad:
        with pytest.raises(ValueError, match="must"):
            backend.forward(bq, bk, bv, layer(), fb)
    with pytest.raises(ValueError, match="pool buffers"):
        backend.forward(q, k, v, RadixAttention(HQ, D, 1.0, 1, 0), fb)
    with pytest.raises(NotImplementedError, match="MLA"):
        backend.forward(q, k, v, layer(), fb, q_rope=q)
    after = [_bits(b) for b in runner.token_to_kv_pool.k_buffer + runner.token_to_kv_pool.v_buffer]
    assert all(torch.equal(a, b) for a, b in zip(before, after)), "a rejected call must not write the cache"
    # Modes and hooks.
    tree = ForwardBatch(ForwardMode.TARGET_VERIFY, 1, fb.req_pool_indices[:1], fb.seq_lens[:1],
                        fb.out_cache_loc[:NUM_DRAFT], spec_info=SpecInfo(topk=4, draft_token_num=NUM_DRAFT))
    with pytest.raises(ValueError, match="custom_mask"):
        backend.init_forward_metadata(tree)
    with pytest.raises(ValueError, match="not capturable"):
        backend.init_cuda_graph_state(4, 64)
        backend.init_forward_metadata_capture_cuda_graph(4, 16, fb.req_pool_indices, fb.seq_lens, None,
                                                         ForwardMode.EXTEND, None)
    with pytest.raises(ValueError, match="no captured plan"):
        backend.init_forward_metadata_replay_cuda_graph(2, fb.req_pool_indices, fb.seq_lens, None, None,
                                                        ForwardMode.DECODE, None, None)
    idle = ForwardBatch(ForwardMode.IDLE, 0, fb.seq_lens[:0], fb.seq_lens[:0], fb.seq_lens[:0])
    backend.init_forward_metadata(idle)
    assert backend.forward(q[:0], k[:0], v[:0], layer(), idle).shape == (0, HQ * D)
    runner.req_to_token_pool.req_to_token = runner.req_to_token_pool.req_to_token.long()
    with pytest.raises(ValueError, match="int32"):
        FlashAttentionBackend(runner)
    assert backend.get_cuda_graph_seq_len_fill_value() == 1


def test_forward_inside_cuda_graph_capture_raises(monkeypatch):
    """Stand-in for a capture on CPU; the real capture runs in the gpu test below."""
    rng = np.random.default_rng(3)
    runner, table = make_runner(2, 1, seed=0)
    backend = FlashAttentionBackend(runner)
    fb, q_lens, _ = make_batch("decode", np.array([1], np.int32), np.array([3], np.int64), table, rng, runner)
    backend.init_forward_metadata(fb)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="outside the captured region"):
        backend.forward(*rand_qkv(rng, 1), layer(), fb)


@pytest.mark.gpu
def test_gpu_nondefault_stream_and_graph_capture():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    rng = np.random.default_rng(4)
    runner, table = make_runner(8, 4, seed=1, impl="auto", device="cuda")
    backend = FlashAttentionBackend(runner)
    rows = np.array([3, 1, 6, 2], np.int32)
    fb, q_lens, start = make_batch("extend", rows, np.array([4, 9, 17, 30], np.int64), table, rng, runner)
    fb.req_pool_indices, fb.seq_lens = fb.req_pool_indices.cuda(), fb.seq_lens.cuda()
    fb.out_cache_loc, fb.extend_seq_lens = fb.out_cache_loc.cuda(), fb.extend_seq_lens.cuda()
    fill_committed(runner, table, rows, start, rng)
    q, k, v = (x.cuda() for x in rand_qkv(rng, int(q_lens.sum())))
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # keep the stream busy so unordered reads would see stale data
        kk, vv, qq = k * 2.0, v + 1.0, q * 0.5  # produced on the side stream
        backend.init_forward_metadata(fb)
        junk = [torch.randn(1 << 20, device="cuda") for _ in range(8)]  # concurrent allocations
        out = backend.forward(qq, kk, vv, layer(), fb)
        out = out * 1.0  # consumed on the side stream
        del junk
    torch.cuda.synchronize()
    pool = runner.token_to_kv_pool
    cpu_pool = MHATokenToKVPool([b.cpu() for b in pool.k_buffer], [b.cpu() for b in pool.v_buffer])
    cpu = ModelRunner(runner.req_to_token_pool, cpu_pool, ModelConfig(MAX_CTX))
    fb_cpu = ForwardBatch(fb.forward_mode, 4, fb.req_pool_indices.cpu(), fb.seq_lens.cpu(), fb.out_cache_loc.cpu())
    np.testing.assert_array_equal(cpu.token_to_kv_pool.k_buffer[0][fb_cpu.out_cache_loc].numpy(),
                                  kk.cpu().reshape(-1, HKV, D).numpy())
    want = reference(cpu, table, fb_cpu, q_lens, qq.cpu(), "extend", 4)
    np.testing.assert_allclose(out.cpu().numpy(), want, rtol=1e-2, atol=1e-2)
    # float32 at page 4: the Triton launch path, so the layer's launch is captured; a layer through a JAX
    # executable (a backend without launch path) cannot be, and says so
    if backend.mosaic_path is not None:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = backend.forward(qq, None, None, layer(), fb, save_kv_cache=False)
        graph.replay()
        torch.cuda.synchronize()
        np.testing.assert_allclose(captured.cpu().numpy(), want, rtol=1e-2, atol=1e-2)
    backend = FlashAttentionBackend(runner, mosaic_path=False)
    backend.init_forward_metadata(fb)
    backend.forward(qq, None, None, layer(), fb, save_kv_cache=False)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="outside the captured region"):
        with torch.cuda.graph(graph):
            backend.forward(qq, None, None, layer(), fb, save_kv_cache=False)
