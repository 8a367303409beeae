"""Graph capture on the GPU (``gpu`` marker): SGLang's TARGET_VERIFY (chain) captured in a real
``torch.cuda.graph`` on the launch path, replayed after the replay hook re-plans other lengths; and a
JAX ``StepRunner`` decode bucket captured with short sequences and replayed with one long enough for
split-KV, equal to eager.

Bugs these catch: a captured verify step reading capture-time lengths or tables (the graph must read
the tables the replay hook rewrites), a split kernel reading the capture-time ``seqlen_k``."""

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

from jax_attn.backend import FlashAttentionBackend as JaxBackend
from jax_attn.backend import LayerParams
from jax_attn.batch import ForwardBatch as JaxBatch
from jax_attn.capture import StepRunner
from jax_attn.kv_cache import KVPool
from jax_attn.metadata import ForwardMode
from tests.paging import shuffled_table
from tests.test_bridge_launch import HKV, HQ, D, fill, reference, setup
from torch_bridge import ForwardBatch, RadixAttention, ServerArgs, SpecInfo

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("engine_grad_mode")]  # grad modes: tests/conftest.py


def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper GPU")


def test_target_verify_captured_in_a_torch_cuda_graph():
    _hopper()
    rng = np.random.default_rng(21)
    n_draft, bs = 3, 4
    runner, table, backend = setup(6, device="cuda")
    runner.server_args = ServerArgs(speculative_eagle_topk=1, speculative_num_draft_tokens=n_draft)
    backend = type(backend)(runner)
    assert backend.mosaic_path is not None
    backend.init_cuda_graph_state(bs, bs * n_draft)
    z = torch.zeros(bs, dtype=torch.long, device="cuda")
    spec = SpecInfo(draft_token_num=n_draft)
    backend.init_forward_metadata_capture_cuda_graph(bs, bs * n_draft, z, z + 1, None, ForwardMode.TARGET_VERIFY,
                                                     spec)
    layer = RadixAttention(HQ, D, 0.37, HKV, 0)
    t = bs * n_draft
    q = torch.zeros(t, HQ * D, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.zeros(t, HKV * D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    loc = torch.zeros(t, dtype=torch.long, device="cuda")
    fb = ForwardBatch(ForwardMode.TARGET_VERIFY, bs, z, z + 1, loc, spec_info=spec,
                      token_to_kv_pool=runner.token_to_kv_pool)
    backend.forward(q, k, v, layer, fb)  # warm-up outside the capture, as SGLang's graph runner does
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = backend.forward(q, k, v, layer, fb)
    for committed in (np.array([40, 9, 70, 25]), np.array([5, 60, 33, 81])):
        rows = np.array([1, 2, 3, 4])
        fill(runner, table, rows, committed, rng)
        new_loc = np.concatenate([table[r, c:c + n_draft] for r, c in zip(rows, committed)]).astype(np.int64)
        args = [torch.from_numpy(x.astype(np.int64)).cuda() for x in (rows, committed)]
        backend.init_forward_metadata_replay_cuda_graph(bs, *args, None, None, ForwardMode.TARGET_VERIFY, spec,
                                                        None, out_cache_loc=torch.from_numpy(new_loc).cuda())
        loc.copy_(torch.from_numpy(new_loc))
        for x, h in ((q, HQ), (k, HKV), (v, HKV)):
            x.copy_(torch.from_numpy(rng.standard_normal((t, h * D)).astype(np.float32)).to(x))
        g.replay()
        torch.cuda.synchronize()
        want = reference(runner, table, rows, committed + n_draft, np.full(bs, n_draft), q, scale=layer.scaling)
        got = out.float().cpu().numpy()
        err = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)  # per token row
        assert err.max() < 2e-2, f"per-row error {err}"


def test_step_runner_replay_with_split_kv_equals_eager():
    if jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA GPU")
    page, ctx, hq, hkv, d = 16, 8192, 32, 8, 128
    table, num_slots = shuffled_table(4, ctx, page, 3)
    rng = np.random.default_rng(3)
    pool = KVPool(*(jnp.asarray(rng.standard_normal((num_slots, hkv, d)), jnp.bfloat16) for _ in range(2)))
    backend = JaxBackend(table, page_size=page, max_context_len=ctx, impl="triton", num_heads=(hq, hkv))
    layer = LayerParams(hq, hkv, d, scaling=0.09)

    def step_fn(md, tok, pool):
        out, _ = backend.forward(tok["q"], None, None, layer, pool, md, save_kv_cache=False)
        return out, None
    runner = StepRunner(backend, step_fn, batch_buckets=(4,))
    rows = np.array([1, 2, 3, 4], np.int32)

    def batch(lens):
        lens = np.asarray(lens, np.int32)
        return JaxBatch(ForwardMode.DECODE, rows[:len(lens)], lens, table[rows[:len(lens)], lens - 1])
    tok = {"q": jnp.asarray(rng.standard_normal((4, hq, d)), jnp.bfloat16)}
    runner.capture([batch([3, 5, 7, 9])], tok, pool)  # short: no split at capture
    long = batch([8000, 17, 3000])  # one row long enough to split, one padded row
    got, _ = runner.replay(long, {"q": tok["q"][:3]}, pool)
    want, _ = jax.jit(step_fn)(backend.plan(long), {"q": tok["q"][:3]}, pool)
    ref = JaxBackend(table, page_size=page, max_context_len=ctx, impl="reference")
    exact, _ = jax.jit(lambda md, q, p: ref.forward(q, None, None, layer, p, md, save_kv_cache=False))(
        ref.plan(long), tok["q"][:3], pool)
    splits = np.asarray(backend.plan(long, bs=4, num_tokens=4).schedule.seq_num_splits)
    assert splits[0] > 1 and splits[1] == 1, f"the case must split the long row only at replay: {splits}"
    got, want, exact = (np.asarray(x, np.float32) for x in (got, want, exact))
    np.testing.assert_allclose(got, want, atol=2e-2, rtol=2e-2)
    err = np.abs(got - exact).max(axis=1) / np.abs(exact).max(axis=1)
    assert err.max() < 2e-2, f"per-row error {err}"
