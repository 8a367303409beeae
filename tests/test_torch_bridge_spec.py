"""torch_bridge tree speculative decoding (topk > 1), the multi-step draft backend and cross attention
on torch CPU tensors: bridge == JAX backend == float64 dense oracle; replay == eager, no retrace."""

import dataclasses
import types

import numpy as np
import pytest
import torch

import jax.numpy as jnp

from jax_attn.backend import FlashAttentionBackend as JaxBackend
from jax_attn.backend import LayerParams
from jax_attn.batch import ForwardBatch as JaxBatch
from jax_attn.batch import SpecInfo as JaxSpec
from jax_attn.kv_cache import KVPool
from tests.test_spec import chain, dense_tree_oracle, star, tree_draft_oracle, two_branches
from tests.test_torch_bridge import HKV, HQ, MAX_CTX, D, fill_committed, layer, make_runner, rand_qkv
from torch_bridge import FlashAttentionBackend, ForwardBatch, ForwardMode, SpecInfo
from torch_bridge.multistep import FlashAttentionMultiStepBackend

# engine calls under plain / no_grad / inference mode (tests/conftest.py: JAX_ATTN_GRAD_MODES)
pytestmark = pytest.mark.usefixtures("engine_grad_mode")

N = 5  # draft tokens per request in tree verify (two_branches / star)
TOPK, STEPS = 2, 3


def i64(x):
    return torch.from_numpy(np.asarray(x, np.int64))


def sglang_custom_mask(committed, masks):
    """SGLang's flat verify mask: per request N rows of (committed columns, then draft columns)."""
    rows = [np.concatenate([np.ones((m.shape[0], c), bool), m], 1).reshape(-1) for c, m in zip(committed, masks)]
    return torch.from_numpy(np.concatenate(rows))


def pool_np(runner, layer_id=0):
    return [b.cpu().float().numpy().copy() for b in runner.token_to_kv_pool.get_kv_buffer(layer_id)]


def jax_out(runner, table, page_size, fb_args, q, spec):
    """The JAX backend on the same step, over the pool as torch left it."""
    jb = JaxBackend(table, page_size=page_size, max_context_len=MAX_CTX, impl="reference")
    pool = KVPool(*(jnp.asarray(b) for b in pool_np(runner)))
    md = jb.plan(JaxBatch(*fb_args, spec_info=spec))
    out, _ = jb.forward(jnp.asarray(q.numpy()), None, None, LayerParams(HQ, HKV, D), pool, md, save_kv_cache=False)
    return np.asarray(out)


def tree_backend(runner, launch: bool, path=None, **kw):
    """The bridge under test: the JAX path, or (``launch``) the launch path with the Triton-lowered kernel
    interpreted (a tree step's prefix and expand passes and their merge; ``triton_path.TreeCall``), or
    ``path``'s kernels."""
    from tests.test_triton_launch import triton_path_for_tests

    on_cpu = runner.token_to_kv_pool.k_buffer[0].device.type == "cpu"  # a GPU: the device's own launch path
    if launch:
        runner.attention_impl = "auto"
        # SGLang's model config names the head counts: the tree passes' tables come with every plan from the
        # start (else the first replay after a bucket's warm-up forward replans with them: one retrace)
        runner.model_config.hf_text_config = types.SimpleNamespace(num_attention_heads=HQ)
        runner.model_config.get_num_kv_heads = lambda tp: HKV
    if path is None and launch and on_cpu:
        path = triton_path_for_tests()
    return FlashAttentionBackend(runner, mosaic_path=path, **kw)


def launched(backend, layer_id: int = 0) -> bool:
    """Whether the layer's last call went through the launch path's tree call."""
    from torch_bridge.triton_path import TreeCall

    hit = backend.runner.hits.get(layer_id)
    return hit is not None and isinstance(getattr(hit, "call", None), TreeCall)


LAUNCH = pytest.mark.parametrize("launch", [False, True], ids=["jax", "launch"])


# ----------------------------------------------------------------------------- tree verify
def verify_case(runner, table, rows, committed, masks, rng):
    loc = np.concatenate([table[r, c:c + N] for r, c in zip(rows, committed)])
    fill_committed(runner, table, rows, committed, rng)
    spec = SpecInfo(topk=TOPK, draft_token_num=N, custom_mask=sglang_custom_mask(committed, masks))
    fb = ForwardBatch(ForwardMode.TARGET_VERIFY, len(rows), i64(rows), i64(committed), i64(loc), spec_info=spec,
                      token_to_kv_pool=runner.token_to_kv_pool)
    return fb, rand_qkv(rng, len(rows) * N)


def verify_oracle(runner, table, fb, masks, q, window=-1):
    """float64: committed keys + the draft keys each row's tree mask allows (positions along the path)."""
    k, v = pool_np(runner)
    loc = fb.out_cache_loc.numpy()
    qs = q.numpy().reshape(-1, HQ, D)
    want = []
    for b, (r, c, m) in enumerate(zip(fb.req_pool_indices.numpy(), fb.seq_lens.numpy(), masks)):
        for i in range(N):
            sel = loc[b * N + np.nonzero(m[i])[0]]
            keys, vals = np.concatenate([k[table[r, :c]], k[sel]]), np.concatenate([v[table[r, :c]], v[sel]])
            pos = np.arange(c + len(sel))
            want.append(dense_tree_oracle(qs[b * N + i], keys, vals, pos, c + len(sel) - 1, window))
    return np.stack(want).reshape(len(want), HQ * D)


@LAUNCH
@pytest.mark.parametrize("page_size", [1, 4])
def test_tree_verify_equals_jax_backend_and_dense_oracle(page_size, launch):
    """``launch``: the tree layer on the launch path, the sliding-window one too (one pass over the tree's SWA
    table). Catches there: the prefix pass masked causally or given no sinks, the expand pass over the wrong
    tables, the merge dropped, the window layer reading the prefix or expand tables instead of the SWA one."""
    rng = np.random.default_rng(10 + page_size)
    runner, table = make_runner(8, page_size, seed=page_size)
    runner.sliding_window_size = 5  # the plan carries the SWA table for the windowed layer below
    backend = tree_backend(runner, launch, topk=TOPK)
    rows, committed, masks = np.array([3, 1]), np.array([9, 17]), [two_branches(), star(N)]
    fb, (q, k, v) = verify_case(runner, table, rows, committed, masks, rng)
    backend.init_forward_metadata(fb)
    got = backend.forward(q, k, v, layer(), fb).numpy()
    assert launched(backend) == launch
    kb = runner.token_to_kv_pool.k_buffer[0]
    np.testing.assert_array_equal(kb[fb.out_cache_loc].numpy(), k.reshape(-1, HKV, D).numpy())
    np.testing.assert_allclose(got, verify_oracle(runner, table, fb, masks, q), rtol=1e-4, atol=1e-4)
    spec = JaxSpec(topk=TOPK, num_draft_tokens=N, draft_mask=np.stack(masks))
    want = jax_out(runner, table, page_size, (ForwardMode.TARGET_VERIFY, rows, committed, fb.out_cache_loc.numpy()),
                   q, spec)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    got_w = backend.forward(q, None, None, layer(sliding_window_size=5), fb, save_kv_cache=False).numpy()
    np.testing.assert_allclose(got_w, verify_oracle(runner, table, fb, masks, q, window=5), rtol=1e-4, atol=1e-4)
    if launch:  # one launch over the tree's SWA table (committed then draft slots per row), no JAX dispatch
        from torch_bridge.mosaic_path import TREE_SWA_TABLES, key_flags
        call = backend.runner.hits[0].call
        assert key_flags(call.heads) & TREE_SWA_TABLES, call.heads


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_tree_verify_prefix_pass_on_the_mosaic_kernel(device):
    """Page 16, bf16: a tree layer's prefix pass takes the Mosaic kernel (interpreted) with its per-tile LSE,
    merged through the tables' LSE index with the Triton-lowered expand pass. Catches: the prefix LSE read in
    row order (the kernel stores it per tile, packed rows token-major within a warpgroup), the pass masked
    causally, the index of another step's tables, the expand pass's rows merged with the wrong prefix rows.
    ``cuda``: the compiled kernels on a Hopper GPU (the device's own launch path)."""
    from tests.test_bridge_launch import InterpretedKernel
    from tests.test_triton_launch import InterpretedTriton
    from torch_bridge.mosaic_path import LsePass, MosaicPath

    if device == "cuda" and not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("needs a Hopper GPU")
    rng = np.random.default_rng(16)
    runner, table = make_runner(8, 16, seed=16, dtype=torch.bfloat16, device=device)
    # CPU: Hopper's kernel choice (Mosaic where it covers), both kernels interpreted
    path = MosaicPath(make_kernel=InterpretedKernel, make_triton=InterpretedTriton) if device == "cpu" else None
    backend = tree_backend(runner, True, path, topk=TOPK)
    rows, committed, masks = np.array([3, 1, 6]), np.array([9, 30, 17]), [two_branches(), star(N), chain(N)]
    fb, qkv = verify_case(runner, table, rows, committed, masks, rng)
    spec = dataclasses.replace(fb.spec_info, custom_mask=fb.spec_info.custom_mask.to(device))
    fb = dataclasses.replace(fb, spec_info=spec, **{f: getattr(fb, f).to(device)
                                                    for f in ("req_pool_indices", "seq_lens", "out_cache_loc")})
    q, k, v = (x.to(device=device, dtype=torch.bfloat16) for x in qkv)
    backend.init_forward_metadata(fb)
    got = backend.forward(q, k, v, layer(), fb).float().cpu().numpy()
    assert launched(backend) and isinstance(backend.runner.hits[0].call.prefix, LsePass)
    fb_host = dataclasses.replace(fb, **{f: getattr(fb, f).cpu() for f in ("req_pool_indices", "seq_lens",
                                                                            "out_cache_loc")})
    want = verify_oracle(runner, table, fb_host, masks, q.float().cpu())
    err = np.abs(got - want).reshape(len(rows), -1).max(1) / np.abs(want).reshape(len(rows), -1).max(1)
    assert (err < 2e-2).all(), err  # per request (bf16 output)


@LAUNCH
def test_tree_verify_replay_equals_eager_no_retrace(launch):
    rng = np.random.default_rng(3)
    runner, table = make_runner(8, 4, seed=2)
    backend = tree_backend(runner, launch, topk=TOPK)
    backend.init_cuda_graph_state(4, 4 * N)
    cap_mask = torch.ones(4 * N * (MAX_CTX + N), dtype=torch.bool)  # SGLang's static capture buffer
    backend.init_forward_metadata_capture_cuda_graph(4, 4 * N, i64([1, 2, 3, 4]), i64([5] * 4), None,
                                                     ForwardMode.TARGET_VERIFY,
                                                     SpecInfo(topk=TOPK, draft_token_num=N, custom_mask=cap_mask))
    qc = rand_qkv(rng, 4 * N)[0]
    fb_cap = ForwardBatch(ForwardMode.TARGET_VERIFY, 4, i64([1, 2, 3, 4]), i64([5] * 4), i64(np.zeros(4 * N)),
                          token_to_kv_pool=runner.token_to_kv_pool)
    backend.forward(qc, None, None, layer(), fb_cap, save_kv_cache=False)
    traces = backend.trace_count
    masks = [two_branches(), star(N), chain(N)]
    fb, (q, k, v) = verify_case(runner, table, np.array([6, 2, 5]), np.array([4, 21, 13]), masks, rng)
    runner.token_to_kv_pool.set_kv_buffer(layer(), fb.out_cache_loc, k, v)
    backend.init_forward_metadata_replay_cuda_graph(4, fb.req_pool_indices, fb.seq_lens, None, None,
                                                    fb.forward_mode, fb.spec_info, None)
    got = backend.forward(q, None, None, layer(), fb, save_kv_cache=False).numpy()
    assert backend.trace_count == traces, "replay inside a captured bucket must not retrace"
    assert launched(backend) == launch
    backend.init_forward_metadata(fb)
    eager = backend.forward(q, None, None, layer(), fb, save_kv_cache=False).numpy()
    np.testing.assert_allclose(got, eager, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got, verify_oracle(runner, table, fb, masks, q), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_tree_verify_gpu_graph_replay_equals_eager():
    """On a GPU: a tree verify bucket on the launch path (the compiled Triton-lowered passes and merge) is
    captured in a torch CUDA graph; after the replay hook plans steps of other lengths and trees, each replay
    equals the float64 oracle and, bitwise, the same planned step run eagerly. Catches: tree tables in a
    buffer the replay hook does not refresh, a pass or the merge left out of the graph."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev, bs = torch.device("cuda"), 4
    rng = np.random.default_rng(31)
    runner, table = make_runner(8, 4, seed=2, device="cuda")
    backend = tree_backend(runner, True, topk=TOPK)
    assert backend.mosaic_path is not None
    backend.init_cuda_graph_state(bs, bs * N)
    rows, lens = torch.arange(1, bs + 1, device=dev), torch.full((bs,), 5, device=dev)
    spec = SpecInfo(topk=TOPK, draft_token_num=N,
                    custom_mask=torch.ones(bs * N * (MAX_CTX + N), dtype=torch.bool, device=dev))
    backend.init_forward_metadata_capture_cuda_graph(bs, bs * N, rows, lens, None, ForwardMode.TARGET_VERIFY, spec)
    q = torch.zeros(bs * N, HQ * D, device=dev)
    fb = ForwardBatch(ForwardMode.TARGET_VERIFY, bs, rows, lens, torch.zeros(bs * N, dtype=torch.int64, device=dev),
                      spec_info=spec, token_to_kv_pool=runner.token_to_kv_pool)
    backend.forward(q, None, None, layer(), fb, save_kv_cache=False)  # warm-up outside the capture
    assert launched(backend)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = backend.forward(q, None, None, layer(), fb, save_kv_cache=False)
    for real_rows, committed in (([6, 2, 5], [4, 21, 13]), ([3, 7, 1, 8], [30, 2, 9, 17])):
        n, masks = len(real_rows), [two_branches(), star(N), chain(N), two_branches()][:len(real_rows)]
        step_fb, (qs, k, v) = verify_case(runner, table, np.array(real_rows), np.array(committed), masks, rng)
        runner.token_to_kv_pool.set_kv_buffer(layer(), step_fb.out_cache_loc.to(dev), k.to(dev), v.to(dev))
        step_spec = SpecInfo(topk=TOPK, draft_token_num=N, custom_mask=step_fb.spec_info.custom_mask.to(dev))
        backend.init_forward_metadata_replay_cuda_graph(bs, step_fb.req_pool_indices.to(dev), step_fb.seq_lens.to(dev),
                                                        None, None, ForwardMode.TARGET_VERIFY, step_spec, None)
        q.zero_()
        q[:n * N] = qs.to(dev)
        g.replay()
        torch.cuda.synchronize()
        want = verify_oracle(runner, table, step_fb, masks, qs)
        for b in range(n):  # per request (float32 pools; the kernel's dots may round through TF32)
            np.testing.assert_allclose(out[b * N:(b + 1) * N].cpu().numpy(), want[b * N:(b + 1) * N],
                                       rtol=5e-3, atol=5e-3)
        eager = backend.forward(q, None, None, layer(), fb, save_kv_cache=False)  # the replayed plan, eagerly
        assert torch.equal(eager, out)


# ----------------------------------------------------------------------------- tree draft decode
def draft_case(runner, table, rows, committed, step, rng, topk=TOPK):
    """Draft slots [bs, topk, STEPS] past each committed prefix; K/V of steps < ``step`` in the pool."""
    loc = np.stack([table[r, c:c + topk * STEPS].reshape(topk, STEPS) for r, c in zip(rows, committed)])
    fill_committed(runner, table, rows, committed, rng)
    kb, vb = runner.token_to_kv_pool.get_kv_buffer(0)
    prev = torch.from_numpy(loc[:, :, :step].reshape(-1).astype(np.int64))
    kb[prev] = torch.from_numpy(rng.standard_normal((prev.numel(), HKV, D)).astype(np.float32)).to(kb)
    vb[prev] = torch.from_numpy(rng.standard_normal((prev.numel(), HKV, D)).astype(np.float32)).to(vb)
    fb = ForwardBatch(ForwardMode.DECODE, len(rows), i64(rows), i64(committed), i64(loc.reshape(-1)),
                      spec_info=SpecInfo(topk=topk), token_to_kv_pool=runner.token_to_kv_pool)
    return fb, loc


def draft_oracle(runner, table, fb, loc, step, q):
    """float64: each branch sees the committed prefix and its own slots of steps 0..step."""
    k, v = pool_np(runner)
    return tree_draft_oracle(k, v, table, fb.req_pool_indices.numpy(), fb.seq_lens.numpy(), loc, step,
                             q.numpy().reshape(-1, HQ, D))


@LAUNCH
def test_tree_draft_decode_equals_jax_backend_and_dense_oracle(launch):
    rng, step = np.random.default_rng(4), 1
    runner, table = make_runner(8, 4, seed=5)
    backend = tree_backend(runner, launch, speculative_step_id=step, topk=TOPK, speculative_num_steps=STEPS)
    rows, committed = np.array([3, 1]), np.array([6, 11])
    fb, loc = draft_case(runner, table, rows, committed, step, rng)
    q, k, v = rand_qkv(rng, 2 * TOPK)
    backend.init_forward_metadata(fb)  # full [bs, topk, num_steps] slots
    got = backend.forward(q, k, v, layer(), fb).numpy()
    assert launched(backend) == launch
    kb = runner.token_to_kv_pool.k_buffer[0]
    np.testing.assert_array_equal(kb[i64(loc[:, :, step].reshape(-1))].numpy(), k.reshape(-1, HKV, D).numpy())
    np.testing.assert_allclose(got, draft_oracle(runner, table, fb, loc, step, q), rtol=1e-4, atol=1e-4)
    spec = JaxSpec(topk=TOPK, num_steps=STEPS, step_id=step)
    want = jax_out(runner, table, 4, (ForwardMode.DECODE, rows, committed, loc.reshape(-1)), q, spec)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    fb.out_cache_loc = i64(loc[:, :, step].reshape(-1))  # SGLang's per-step slots at forward time
    again = backend.forward(q, k * 2.0, v, layer(), fb).numpy()
    np.testing.assert_array_equal(kb[fb.out_cache_loc].numpy(), (k * 2.0).reshape(-1, HKV, D).numpy())
    np.testing.assert_allclose(again, draft_oracle(runner, table, fb, loc, step, q), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="every draft step"):
        backend.init_forward_metadata(fb)  # planning needs every step's slots


def test_tree_draft_decode_prefix_pass_on_the_mosaic_kernel():
    """Page 16, bf16, Hopper's kernel choice (interpreted): a tree draft decode layer's prefix pass (each
    branch's query over the committed keys) takes the Mosaic kernel with its per-tile LSE, merged with the
    branch's own draft slots. Catches what the verify case does, for topk queries per request (another
    packing of the prefix rows than the verify's draft tokens)."""
    from tests.test_bridge_launch import InterpretedKernel
    from tests.test_triton_launch import InterpretedTriton
    from torch_bridge.mosaic_path import LsePass, MosaicPath

    rng, step = np.random.default_rng(6), 2
    runner, table = make_runner(8, 16, seed=6, dtype=torch.bfloat16)
    path = MosaicPath(make_kernel=InterpretedKernel, make_triton=InterpretedTriton)
    backend = tree_backend(runner, True, path, speculative_step_id=step, topk=TOPK, speculative_num_steps=STEPS)
    rows, committed = np.array([3, 1, 6]), np.array([6, 27, 17])
    fb, loc = draft_case(runner, table, rows, committed, step, rng)
    q, k, v = (x.to(torch.bfloat16) for x in rand_qkv(rng, len(rows) * TOPK))
    backend.init_forward_metadata(fb)
    got = backend.forward(q, k, v, layer(), fb).float().numpy()
    assert launched(backend) and isinstance(backend.runner.hits[0].call.prefix, LsePass)
    want = draft_oracle(runner, table, fb, loc, step, q.float())
    err = np.abs(got - want).reshape(len(rows), -1).max(1) / np.abs(want).reshape(len(rows), -1).max(1)
    assert (err < 2e-2).all(), err  # per request (bf16 output)


# ----------------------------------------------------------------------------- multi-step backend
@pytest.mark.parametrize("topk", [1, TOPK])
def test_multistep_equals_single_step_backends_and_replay_equals_eager(topk):
    rng = np.random.default_rng(20 + topk)
    runner, table = make_runner(8, 4, seed=7)
    multi = FlashAttentionMultiStepBackend(runner, topk, STEPS)
    assert [b.speculative_step_id for b in multi.attn_backends] == list(range(STEPS - 1))
    rows, committed = np.array([5, 2, 7]), np.array([3, 14, 9])
    fb, loc = draft_case(runner, table, rows, committed, 0, rng, topk)
    multi.init_cuda_graph_state(4, 4 * topk)
    cap = ForwardBatch(ForwardMode.DECODE, 4, i64([1, 2, 3, 4]), i64([1] * 4), i64(np.zeros(4 * topk * STEPS)),
                       spec_info=SpecInfo(topk=topk))
    multi.init_forward_metadata_capture_cuda_graph(cap)
    multi.init_forward_metadata(fb)  # compiles the eager (bs 3) plan
    for step, backend in enumerate(multi.attn_backends):
        q, k, v = rand_qkv(rng, 3 * topk)
        step_fb = ForwardBatch(ForwardMode.DECODE, 3, fb.req_pool_indices, fb.seq_lens,
                               i64(loc[:, :, step].reshape(-1)), spec_info=fb.spec_info,
                               token_to_kv_pool=runner.token_to_kv_pool)
        traces = [b.trace_count for b in multi.attn_backends]
        multi.init_forward_metadata_replay_cuda_graph(fb, 4)
        assert [b.trace_count for b in multi.attn_backends] == traces, "replay must not retrace"
        replayed = backend.forward(q, k, v, layer(), step_fb).numpy()  # writes this step's K/V
        multi.init_forward_metadata(fb)
        eager = backend.forward(q, None, None, layer(), step_fb, save_kv_cache=False).numpy()
        single = FlashAttentionBackend(runner, speculative_step_id=step, topk=topk, speculative_num_steps=STEPS)
        single.init_forward_metadata(fb)
        alone = single.forward(q, None, None, layer(), fb, save_kv_cache=False).numpy()
        np.testing.assert_array_equal(eager, alone)
        np.testing.assert_allclose(replayed, eager, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(eager, draft_oracle(runner, table, fb, loc, step, q), rtol=1e-4, atol=1e-4)
        single.init_cuda_graph_state(4, 4 * topk)  # the single backend's own capture/replay hooks
        single.init_forward_metadata_capture_cuda_graph(4, 4 * topk, cap.req_pool_indices, cap.seq_lens, None,
                                                        ForwardMode.DECODE, cap.spec_info)
        single.init_forward_metadata_replay_cuda_graph(4, fb.req_pool_indices, fb.seq_lens, None, None,
                                                       ForwardMode.DECODE, fb.spec_info, None, fb.out_cache_loc)
        np.testing.assert_allclose(single.forward(q, None, None, layer(), fb, save_kv_cache=False).numpy(), eager,
                                   rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- cross attention
@pytest.mark.parametrize("launch", [False, True], ids=["jax", "launch"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_cross_attention_encoder_then_decoder_slots(page_size, launch):
    """Each request row holds its encoder slots first; a cross layer writes at encoder_out_cache_loc and
    attends non-causally over them, a self layer attends causally over the decoder tokens after them.
    ``launch``: both layers on the launch path (the Triton-lowered kernel, interpreted; the cross layer over
    its encoder tables, ``CROSS_TABLES``). Catches: a cross layer reading the decoder's tables or masking
    causally, its K/V written at out_cache_loc, or the launch path refusing cross layers."""
    from tests.test_triton_launch import triton_path_for_tests
    from torch_bridge.mosaic_path import CROSS_TABLES, TRITON_TABLES

    rng = np.random.default_rng(30 + page_size)
    runner, table = make_runner(6, page_size, seed=11, impl="auto" if launch else "reference")
    runner.model_config.max_encoder_len = 16
    backend = FlashAttentionBackend(runner, mosaic_path=triton_path_for_tests() if launch else None)
    rows, enc, prefix, ext = np.array([4, 1, 3]), np.array([8, 4, 12]), np.array([0, 5, 2]), np.array([3, 2, 4])
    fill_committed(runner, table, rows, enc + prefix, rng)  # layer 0: committed decoder (and encoder) KV
    loc = np.concatenate([table[r, e + p:e + p + n] for r, e, p, n in zip(rows, enc, prefix, ext)])
    enc_loc = np.concatenate([table[r, :e] for r, e in zip(rows, enc)])
    fb = ForwardBatch(ForwardMode.EXTEND, 3, i64(rows), i64(prefix + ext), i64(loc), extend_seq_lens=i64(ext),
                      encoder_lens=i64(enc), encoder_out_cache_loc=i64(enc_loc),
                      token_to_kv_pool=runner.token_to_kv_pool)
    q, k, v = rand_qkv(rng, int(ext.sum()))
    ke, ve = rand_qkv(rng, int(enc.sum()))[1:]
    cross = layer(layer_id=1, is_cross_attention=True)
    backend.init_forward_metadata(fb)
    got_self = backend.forward(q, k, v, layer(), fb).numpy()
    got_cross = backend.forward(q, ke, ve, cross, fb).numpy()
    np.testing.assert_array_equal(runner.token_to_kv_pool.k_buffer[1][i64(enc_loc)].numpy(),
                                  ke.reshape(-1, HKV, D).numpy())
    if launch:  # both layers launched: the step's tables, and the encoder's for the cross layer
        assert set(backend.step.tables) == {(HQ, HKV, TRITON_TABLES), (HQ, HKV, TRITON_TABLES | CROSS_TABLES)}
    (k0, v0), (k1, v1) = pool_np(runner, 0), pool_np(runner, 1)
    qs, t = q.numpy().reshape(-1, HQ, D), 0
    for r, e, p, n in zip(rows, enc, prefix, ext):
        for i in range(n):
            dec = table[r, e:e + p + i + 1]  # decoder keys up to this query's position
            want_self = dense_tree_oracle(qs[t], k0[dec], v0[dec], None, None).reshape(-1)
            want_cross = dense_tree_oracle(qs[t], k1[table[r, :e]], v1[table[r, :e]], None, None).reshape(-1)
            np.testing.assert_allclose(got_self[t], want_self, rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(got_cross[t], want_cross, rtol=1e-4, atol=1e-4)
            t += 1
    with pytest.raises(ValueError, match="encoder_lens"):
        fb_plain = ForwardBatch(ForwardMode.EXTEND, 3, i64(rows), i64(prefix + ext), i64(loc),
                                extend_seq_lens=i64(ext), token_to_kv_pool=runner.token_to_kv_pool)
        backend.init_forward_metadata(fb_plain)
        backend.forward(q, None, None, cross, fb_plain, save_kv_cache=False)
