"""Absorbed MLA on the Mosaic GPU kernel (``KernelStatics.latent``): one latent cache whose rows are the
latent ``c_kv`` (also the value row) then ``k_rope``; every query head of a token in the rows, both compute
warpgroups on the same rows, each accumulating half of the latent (value) columns.

CPU: the Mosaic GPU interpreter at latent 128 + rope 64. GPU (``-m gpu``): compiled at DeepSeek's 512 + 64
with 16 and 128 query heads. Every case compares with the float64-accumulated reference of the absorbed
formula per sequence, LSE included; unused pages and slots hold NaN and padding rows must come back zero.
"""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_attn.attention import attention, call_of
from jax_attn.kernel_policy import mosaic_covers
from jax_attn.kernels.mosaic_paged import MosaicConfig, latent_unsupported, paged_attention_mosaic
from tests.attention_cases import Case, build_inputs, compare_per_sequence, reference_by_sequence

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.gpu


def _mla(name, seq_lens, latent, rope, **kw):
    kw = dict(dict(heads=(16, 1), head_dim=latent + rope, softmax_scale=0.11, dtype="bfloat16", num_splits=1), **kw)
    return Case(name, tuple(seq_lens), **kw), latent


# Interpreted: decode with padded batch rows, MTP verify over two kv splits, extend with a prefix, a window.
CPU_CASES = [
    _mla("decode_pad_rows", [(1, 17), (1, 140), (1, 3)], 128, 64, page_size=16, pad_rows=1),
    _mla("verify_q4_split2", [(4, 150), (4, 9)], 128, 64, page_size=64, heads=(8, 1), num_splits=2),
    _mla("extend_prefix", [(12, 40), (3, 33), (20, 20)], 128, 64, page_size=16, heads=(8, 1)),
    # a window and a softcap (the mask and logits code the latent mode shares), eight pages per key block
    _mla("extend_window_softcap_page8", [(9, 70), (1, 41)], 128, 64, page_size=8, heads=(8, 1), window=(20, 0),
         softcap=7.0),
    # a tree step's prefix pass: its draft tokens see every committed key (non-causal), LSE for the merge
    _mla("tree_prefix_noncausal", [(4, 90), (4, 20)], 128, 64, page_size=16, heads=(8, 1), causal=False),
]

# Compiled at DeepSeek's widths: 16 heads (TP8) and 128 (TP1); split decode; MTP verify; extend.
GPU_CASES = [
    _mla("decode_h16", [(1, 700), (1, 4100), (1, 1), (1, 65)], 512, 64, page_size=64, pad_rows=2),
    _mla("decode_h16_split", [(1, 5000), (1, 333)], 512, 64, page_size=64, num_splits=None),
    _mla("decode_h128_page16", [(1, 900), (1, 77)], 512, 64, page_size=16, heads=(128, 1)),
    _mla("verify_q2_h128", [(2, 1500), (2, 64), (2, 2)], 512, 64, page_size=64, heads=(128, 1)),
    _mla("verify_q4_h16_split4", [(4, 3000), (4, 100)], 512, 64, page_size=64, num_splits=4),
    _mla("extend_h16", [(70, 600), (5, 5), (130, 130)], 512, 64, page_size=64),
    # pages of 1, 2, 4 rows: the producer gathers each row's three parts with cp.async (not interpreted)
    _mla("decode_h16_page1", [(1, 700), (1, 4100), (1, 1), (1, 65)], 512, 64, page_size=1, pad_rows=2),
    _mla("verify_q2_h128_page1", [(2, 1500), (2, 64), (2, 2)], 512, 64, page_size=1, heads=(128, 1)),
    _mla("decode_h16_page2_split", [(1, 5000), (1, 333)], 512, 64, page_size=2, num_splits=None),
    _mla("extend_h16_page4_window", [(70, 600), (5, 5)], 512, 64, page_size=4, window=(100, 0), softcap=9.0),
]


def _check(case, latent, **kw_call):
    q, k, _, md, kw = build_inputs(case)
    got = paged_attention_mosaic(q, k, None, md, latent_dim=latent, num_splits=case.num_splits, **kw, **kw_call)
    want = reference_by_sequence(q, k, k[..., :latent], md, **kw)
    n = int(md.cu_seqlens_q[-1])
    assert got[0].shape == q.shape[:2] + (latent,)
    compare_per_sequence(got[0], want[0], md.cu_seqlens_q, tol=3e-2, what=case.name)
    np.testing.assert_allclose(np.asarray(got[1][:n]), np.asarray(want[1][:n]), rtol=2e-3, atol=2e-3)
    np.testing.assert_array_equal(np.asarray(got[0][n:], np.float32), 0.0)  # padding tokens: zeros


@pytest.mark.parametrize("case,latent", CPU_CASES, ids=lambda c: getattr(c, "name", ""))
def test_mosaic_latent_interpret(case, latent):
    if ON_GPU:
        pytest.skip("interpreter cases run on the CPU")
    from jax.experimental.pallas import mosaic_gpu as plgpu

    _check(case, latent, interpret=plgpu.InterpretGPUParams())


@gpu
@pytest.mark.parametrize("case,latent", GPU_CASES, ids=lambda c: getattr(c, "name", ""))
def test_mosaic_latent_gpu(case, latent):
    if not ON_GPU:
        pytest.skip("needs a Hopper GPU")
    _check(case, latent)


def test_latent_rules():
    """What the kernel takes of a latent cache, and that ``auto``'s capability check asks the same rules."""
    ok = dict(dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, head_dim=576, latent=512, page_size=64, num_q_heads=16,
              num_kv_heads=1)
    assert latent_unsupported(**ok) is None
    assert latent_unsupported(**{**ok, "page_size": 1}) is None  # rows gathered
    for change, words in ((dict(page_size=12), "page_size=12"), (dict(num_q_heads=12), "multiples of 8"),
                          (dict(latent=448, head_dim=512), "multiples of 128"), (dict(head_dim=608), "rope part of 64"),
                          (dict(kv_dtype=jnp.float32), "dtypes"), (dict(num_kv_heads=2), "one latent head")):
        assert words in latent_unsupported(**{**ok, **change}), change
    assert "sinks" in latent_unsupported(**ok, has_sinks=True)
    case, latent = GPU_CASES[0]
    q, k, _, md, _ = build_inputs(Case("tiny", ((1, 20),), page_size=64, heads=(16, 1), head_dim=576,
                                       dtype="bfloat16"))
    assert mosaic_covers(call_of(q, k, None, md, latent_dim=512))
    assert not mosaic_covers(call_of(q[:, :12], k, None, md, latent_dim=512))
    with pytest.raises(NotImplementedError, match="multiples of 8"):
        attention(q[:, :12], k, None, md, impl="mosaic", latent_dim=512)


@pytest.mark.parametrize("page,heads,want", [(64, 16, "mosaic"), (16, 128, "mosaic"), (1, 16, "mosaic"),
                                             (1, 128, "mosaic"), (2, 12, "triton"), (64, 12, "triton")])
def test_policy_latent(page, heads, want, monkeypatch):
    """``auto`` on Hopper runs every latent-cache call the Mosaic kernel takes there (decode of any batch
    included), the rest on Triton, and the torch bridge's launch path does the same (split-KV where the unsplit
    tiles cannot fill the GPU); deterministic mode keeps Triton."""
    from jax_attn import kernel_policy
    from jax_attn.kernel_policy import select_kernel

    monkeypatch.setattr(kernel_policy, "on_hopper", lambda: True)
    q, k, _, md, _ = build_inputs(Case("c", ((1, 20),), page_size=page, heads=(16, 1), head_dim=576,
                                       dtype="bfloat16"))
    q = jnp.zeros((1024, heads, 576), q.dtype)  # many decode tokens: more than one wave of (token, head) programs
    call = call_of(q, k, None, md, latent_dim=512)
    assert select_kernel("auto", call) == want
    assert select_kernel("auto", call, from_torch=True, hopper=True) == want  # unsplit tiles fill the GPU
    few = call_of(q[:64], k, None, md, latent_dim=512)  # 64 sequences: 64 unsplit tiles at 16 heads (split)
    assert select_kernel("auto", few, from_torch=True, hopper=True) == want
    assert select_kernel("auto", call_of(q, k, None, md, latent_dim=512, num_splits=1)) == "triton"


@gpu
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_jax_backend_mla_on_mosaic(mode):
    """``FlashAttentionBackend.forward`` on a DeepSeek-wide MLA layer (16 heads, 512 + 64, bf16, page 64) on
    Hopper: ``describe`` names the Mosaic kernel, the new rows land in the pool, no other slot changes
    (NaN everywhere else), and the output equals the float32 reference per sequence."""
    if not ON_GPU:
        pytest.skip("needs a Hopper GPU")
    from jax_attn.backend import FlashAttentionBackend, LayerParams
    from jax_attn.kv_cache import KVPool
    from tests.paging import committed_pools, shuffled_table
    from tests.test_mla import check_mla_step, mla_step

    hq, latent, page, max_ctx = 16, 512, 64, 2048
    d = latent + 64
    rng = np.random.default_rng(7)
    table, num_slots = shuffled_table(6, max_ctx, page, seed=3)
    rows = np.array([3, 1, 5], np.int32)
    committed = np.array([0, 900, 1500]) if mode == "extend" else np.array([40, 900, 1999])
    q_lens = (np.array([70, 3, 129]) if mode == "extend" else np.ones(3, np.int64)).astype(np.int32)
    bf = jnp.bfloat16
    k_pool = np.asarray(jnp.asarray(committed_pools(table, num_slots, rows, committed, 1, d, 1, rng)[0], bf),
                        np.float32)  # (the pool's values, NaN kept)
    loc, fb = mla_step(table, rows, committed, q_lens, mode)
    n = int(q_lens.sum())
    q = rng.standard_normal((n, hq * d)).astype(np.float32)
    k_new = rng.standard_normal((n, d)).astype(np.float32)
    backend = FlashAttentionBackend(table, page_size=page, max_context_len=max_ctx, num_heads=(hq, 1))
    layer = LayerParams(hq, 1, d, v_head_dim=latent, scaling=0.07, mla=True)
    md = backend.plan(fb)
    assert backend.describe(md, layer)["attention"] == "mosaic"
    out, new_pool = backend.forward(jnp.asarray(q, bf), jnp.asarray(k_new, bf), None, layer,
                                    KVPool(jnp.asarray(k_pool, bf), None), md)
    k_pool[loc, 0] = np.asarray(jnp.asarray(k_new, bf), np.float32)
    check_mla_step(out, new_pool, k_pool, jnp.asarray(q, bf), table, rows, committed, q_lens, page, max_ctx, latent,
                   0.07, 3e-2, mode)


@pytest.mark.parametrize("device,page,split", [("cpu", 16, False), ("cpu", 16, True),
                                               pytest.param("cuda", 64, True, marks=gpu),
                                               pytest.param("cuda", 1, True, marks=gpu)])
def test_torch_bridge_mla_mosaic_launch(device, page, split, monkeypatch):
    """An MLA model through the bridge on the Mosaic launch path (the latent kernel launched from torch; on
    the CPU interpreted): two decode steps (the second reuses the bound launch), the write lands only at the
    step's slots (NaN in every unused slot), the output equals the float32 reference per sequence. Three
    sequences cannot fill the GPU: ``split`` runs the split kernel and its merge (on the GPU: the 1024-key bound
    in splits of the default ``min_kv_per_split`` keys, 8 of 128 since the thirty-seventh session, as three CTAs
    leave the SMs idle; on the CPU a config that cuts the 96-key bound into 3), else one tile per sequence."""
    import torch

    from tests.paging import shuffled_table
    from tests.test_bridge_launch import InterpretedKernel
    from torch_bridge import (FlashAttentionBackend, ForwardBatch, ForwardMode, MLATokenToKVPool, ModelConfig,
                              ModelRunner, RadixAttention, ReqToTokenPool)
    from torch_bridge import mosaic_path
    from torch_bridge.mosaic_path import MosaicPath

    if device == "cuda" and not ON_GPU:
        pytest.skip("needs a Hopper GPU")
    latent, rope, hq, max_ctx = (128, 64, 8, 96) if device == "cpu" else (512, 64, 16, 1024)
    d = latent + rope
    rng = np.random.default_rng(5)
    table, num_slots = shuffled_table(6, max_ctx, page, seed=4)
    pool = MLATokenToKVPool.create(num_slots, 1, latent, rope, torch.bfloat16, device)
    buf = pool.kv_buffer[0]
    buf.fill_(float("nan"))
    buf[0] = 0.0
    runner = ModelRunner(ReqToTokenPool(torch.from_numpy(table).to(device).clone()), pool,
                         ModelConfig(max_ctx, attention_arch="MLA"), page_size=page, device=device)
    path = None
    if device == "cpu":
        from tests.test_triton_launch import InterpretedTriton

        config = MosaicConfig(min_kv_per_split=32 if split else 512)
        path = MosaicPath(make_kernel=InterpretedKernel, make_triton=InterpretedTriton, hopper=True, triton=False,
                          config=config)
    backend = FlashAttentionBackend(runner, mosaic_path=path)
    layer = RadixAttention(hq, d, 0.09, 1, 0, v_head_dim=latent)
    rows = np.array([3, 1, 5], np.int64)
    launches = InterpretedKernel.calls
    for step in range(2):
        committed = np.array([4, 40, 90 if device == "cpu" else 1000]) - 2 + step
        for r, n in zip(rows, committed):
            buf[torch.from_numpy(table[r, :n].astype(np.int64)).to(device)] = torch.from_numpy(
                rng.standard_normal((n, 1, d)).astype(np.float32)).to(device, torch.bfloat16)
        loc = torch.from_numpy(table[rows, committed].astype(np.int64)).to(device)
        fb = ForwardBatch(ForwardMode.DECODE, 3, torch.from_numpy(rows).to(device),
                          torch.from_numpy(committed + 1).to(device), loc, token_to_kv_pool=pool)
        q = torch.from_numpy(rng.standard_normal((3, hq, d)).astype(np.float32)).to(device, torch.bfloat16)
        k_new = torch.from_numpy(rng.standard_normal((3, d)).astype(np.float32)).to(device, torch.bfloat16)
        before = buf.clone()
        backend.init_forward_metadata(fb)
        out = backend.forward(q.reshape(3, -1), k_new, k_new[:, :latent], layer, fb)
        before[loc, 0] = k_new
        torch.testing.assert_close(buf, before, rtol=0, atol=0, equal_nan=True)  # only the step's slots
        want = _latent_decode_reference(buf, table, rows, committed + 1, q, page, max_ctx, latent, 0.09)
        compare_per_sequence(out.float().cpu().numpy().reshape(3, hq, latent), want, np.arange(4, dtype=np.int32),
                             tol=3e-2, what=f"step {step}")
        splits = 3 if device == "cpu" else max_ctx // MosaicConfig().min_kv_per_split
        assert backend.step.tables[(hq, 1, mosaic_path.LATENT_TABLES)].num_splits == (splits if split else 1)
    assert len(backend.runner.hits) == 1
    assert isinstance(backend.runner.hits[0].call, mosaic_path.LayerCall)  # the Mosaic kernel's launch
    if device == "cpu":
        assert InterpretedKernel.calls == launches + 2  # launched once per step


def _latent_decode_reference(buf, table, rows, kv_lens, q, page, max_ctx, latent, scale):
    """Float32 absorbed decode over the latent pool ``buf [slots, 1, D]`` (one query token per row of ``table``
    in ``rows``): ``[B, Hq, latent]``."""
    from jax_attn.reference import paged_attention_reference

    d = buf.shape[-1]
    pt = table[rows][:, ::page][:, :-(-max_ctx // page)] // page
    paged = jnp.asarray(buf.float().cpu().numpy()).reshape(-1, page, 1, d)
    return np.asarray(paged_attention_reference(
        jnp.asarray(q.float().cpu().numpy()), paged, paged[..., :latent], jnp.asarray(kv_lens, jnp.int32),
        jnp.arange(len(rows) + 1, dtype=jnp.int32), jnp.asarray(pt.astype(np.int32)), page_size=page,
        softmax_scale=scale))


@gpu
@pytest.mark.parametrize("page", [64, 1])
def test_latent_decode_bucket_in_a_torch_cuda_graph(page, monkeypatch, engine_grad_mode):
    """A DeepSeek-wide MLA decode bucket (16 or 128 heads, 512 + 64, bf16) on the Mosaic launch path, captured in a
    real ``torch.cuda.graph`` after a warm-up forward (SGLang's graph-runner order), then replayed after the replay
    hook re-plans other lengths and slots: each replay equals the float32 reference per sequence, equals the
    eager step bit for bit, and writes only the step's slots (NaN elsewhere). Catches a graph that reads the
    capture-time tables or lengths, and a refresh that differs from the eager planner."""
    import torch

    from tests.paging import shuffled_table
    from torch_bridge import (FlashAttentionBackend, ForwardBatch, ForwardMode, MLATokenToKVPool, ModelConfig,
                              ModelRunner, RadixAttention, ReqToTokenPool)
    from torch_bridge import mosaic_path

    if not ON_GPU:
        pytest.skip("needs a Hopper GPU")
    latent, rope, max_ctx, bs = 512, 64, 2048, 4
    hq = 16 if page > 1 else 128  # DeepSeek at TP8 and at TP1
    d = latent + rope
    rng = np.random.default_rng(11)
    table, num_slots = shuffled_table(8, max_ctx, page, seed=6)
    pool = MLATokenToKVPool.create(num_slots, 1, latent, rope, torch.bfloat16, "cuda")
    buf = pool.kv_buffer[0]
    buf.fill_(float("nan"))
    buf[0] = 0.0
    config = ModelConfig(max_ctx, attention_arch="MLA")
    config.hf_text_config = types.SimpleNamespace(num_attention_heads=hq)
    config.get_num_kv_heads = lambda tp: 1
    runner = ModelRunner(ReqToTokenPool(torch.from_numpy(table).cuda()), pool, config, page_size=page, device="cuda")
    backend = FlashAttentionBackend(runner)
    layer = RadixAttention(hq, d, 0.08, 1, 0, v_head_dim=latent)
    backend.init_cuda_graph_state(bs, bs)
    z = torch.zeros(bs, dtype=torch.long, device="cuda")
    backend.init_forward_metadata_capture_cuda_graph(bs, bs, z, z + 1, None, ForwardMode.DECODE, None)
    q = torch.zeros(bs, hq * d, dtype=torch.bfloat16, device="cuda")
    k_new = torch.zeros(bs, d, dtype=torch.bfloat16, device="cuda")
    loc = torch.zeros(bs, dtype=torch.long, device="cuda")
    fb = ForwardBatch(ForwardMode.DECODE, bs, z, z + 1, loc, token_to_kv_pool=pool)
    backend.forward(q, k_new, k_new[:, :latent], layer, fb)  # warm-up outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = backend.forward(q, k_new, k_new[:, :latent], layer, fb)
    assert isinstance(backend.runner.hits[0].call, mosaic_path.LayerCall)  # the latent kernel's launch
    for committed in (np.array([40, 1900, 700, 3]), np.array([1500, 5, 64, 999])):
        rows = rng.permutation(np.arange(1, 8))[:bs]
        for r, n in zip(rows, committed):
            buf[torch.from_numpy(table[r, :n].astype(np.int64)).cuda()] = torch.from_numpy(
                rng.standard_normal((n, 1, d)).astype(np.float32)).to("cuda", torch.bfloat16)
        new_loc = torch.from_numpy(table[rows, committed].astype(np.int64)).cuda()
        args = [torch.from_numpy(x.astype(np.int64)).cuda() for x in (rows, committed + 1)]
        backend.init_forward_metadata_replay_cuda_graph(bs, *args, int(committed.sum()) + bs, None,
                                                        ForwardMode.DECODE, None, None, out_cache_loc=new_loc)
        loc.copy_(new_loc)
        q.copy_(torch.from_numpy(rng.standard_normal((bs, hq * d)).astype(np.float32)).to(q))
        k_new.copy_(torch.from_numpy(rng.standard_normal((bs, d)).astype(np.float32)).to(k_new))
        before = buf.clone()
        g.replay()
        torch.cuda.synchronize()
        before[new_loc, 0] = k_new
        torch.testing.assert_close(buf, before, rtol=0, atol=0, equal_nan=True)  # only the step's slots
        want = _latent_decode_reference(buf, table, rows, committed + 1, q.reshape(bs, hq, d), page, max_ctx,
                                        latent, layer.scaling)
        compare_per_sequence(out.float().cpu().numpy().reshape(bs, hq, latent), want, np.arange(bs + 1), tol=3e-2,
                             what=f"replay at {committed}")
        eager_fb = ForwardBatch(ForwardMode.DECODE, bs, *args, new_loc, token_to_kv_pool=pool)
        backend.init_forward_metadata(eager_fb)
        eager = backend.forward(q, k_new, k_new[:, :latent], layer, eager_fb)
        torch.testing.assert_close(out, eager, rtol=0, atol=0)  # replay == eager, bit for bit


@pytest.mark.parametrize("name, bs, split", [("decode", 4, False), ("verify", 3, False), ("decode", 4, True),
                                            ("verify", 3, True)])
def test_latent_graph_bucket_refreshes_its_tables_in_the_graph(name, bs, split, monkeypatch):
    """A captured MLA bucket on the Mosaic launch path (the latent kernel's tiles: one per sequence, or with
    ``split`` its split schedule and the merge's LSE index) refreshes its tables inside the graph: the capture
    checks the refresh against the planner, and over valid and bad inputs the refresh writes the planner's
    tables bit for bit (``test_graph_tables.refresh_trials``)."""
    import torch

    from tests.paging import shuffled_table
    from tests.test_bridge_launch import InterpretedKernel
    from tests.test_graph_tables import MAX_CTX, MODES, REQS, refresh_trials
    from tests.test_triton_launch import InterpretedTriton
    from torch_bridge import FlashAttentionBackend, MLATokenToKVPool, ModelConfig, ModelRunner, ReqToTokenPool
    from torch_bridge.mosaic_path import LATENT_TABLES, MosaicPath

    hq, page = 8, 16
    table, num_slots = shuffled_table(REQS, MAX_CTX, page, 0)
    pool = MLATokenToKVPool.create(num_slots, 1, 128, 64, torch.bfloat16)
    config = ModelConfig(MAX_CTX, attention_arch="MLA")
    config.hf_text_config = types.SimpleNamespace(num_attention_heads=hq)
    config.get_num_kv_heads = lambda tp: 1
    runner = ModelRunner(ReqToTokenPool(torch.from_numpy(table).clone()), pool, config, page_size=page)
    config = MosaicConfig(min_kv_per_split=16 if split else 512)  # (split: the 128-key bound in up to 8 splits)
    backend = FlashAttentionBackend(runner, mosaic_path=MosaicPath(make_kernel=InterpretedKernel,
                                                                   make_triton=InterpretedTriton, config=config))
    mode, per_req, spec, _ = MODES[name]
    backend.init_cuda_graph_state(8, 8 * per_req)
    rows, lens = torch.zeros(bs, dtype=torch.int64), torch.ones(bs, dtype=torch.int64)
    backend.init_forward_metadata_capture_cuda_graph(bs, bs * per_req, rows, lens, None, mode, spec)
    r = backend.planner.refreshes[(mode, bs)]
    heads = (hq, 1, LATENT_TABLES)
    assert heads in r.verified and not r.recorded
    assert (r.step.tables[heads].num_splits > 1) == split
    refresh_trials(runner, backend, r, heads, rows, lens, mode, spec, bs, page)


@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_jax_backend_plans_the_latent_tiles_once_per_step(mode, monkeypatch):
    """``FlashAttentionBackend(mla=True, num_heads=(Hq, 1))``: the plan carries the latent kernel's tiles, so
    an MLA layer's Mosaic call plans nothing itself (``forbid_kernel_planning``), and the step is right: the
    pool changes only at its rows, the output equals the reference per sequence (interpreted on the CPU)."""
    if ON_GPU:
        pytest.skip("interpreter case (the GPU runs test_jax_backend_mla_on_mosaic)")
    from jax_attn.backend import FlashAttentionBackend, LayerParams
    from jax_attn.kv_cache import KVPool
    from tests.attention_cases import forbid_kernel_planning
    from tests.paging import committed_pools, shuffled_table
    from tests.test_mla import check_mla_step, mla_step

    hq, latent, page, max_ctx = 8, 128, 16, 96
    d, bf = latent + 64, jnp.bfloat16
    rng = np.random.default_rng(3)
    table, num_slots = shuffled_table(4, max_ctx, page, seed=2)
    rows = np.array([3, 1], np.int32)
    committed = np.array([10, 70])
    q_lens = (np.array([5, 9]) if mode == "extend" else np.ones(2, np.int64)).astype(np.int32)
    k_pool = np.asarray(jnp.asarray(committed_pools(table, num_slots, rows, committed, 1, d, 1, rng)[0], bf),
                        np.float32)
    loc, fb = mla_step(table, rows, committed, q_lens, mode)
    n = int(q_lens.sum())
    q = jnp.asarray(rng.standard_normal((n, hq * d)), bf)
    k_new = jnp.asarray(rng.standard_normal((n, d)), bf)
    backend = FlashAttentionBackend(table, page_size=page, max_context_len=max_ctx, num_heads=(hq, 1), impl="mosaic",
                                    mla=True)
    md = backend.plan(fb)
    assert md.mosaic_schedule.block_q == 64 and md.mosaic_schedule.pack == hq  # the latent kernel's tiles
    forbid_kernel_planning(monkeypatch)
    layer = LayerParams(hq, 1, d, v_head_dim=latent, scaling=0.1, mla=True)
    out, new_pool = backend.forward(q, k_new, None, layer, KVPool(jnp.asarray(k_pool, bf), None), md)
    k_pool[loc, 0] = np.asarray(k_new, np.float32)
    check_mla_step(out, new_pool, k_pool, q, table, rows, committed, q_lens, page, max_ctx, latent, 0.1, 3e-2, mode)
