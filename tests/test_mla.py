"""Absorbed MLA (DeepSeek V2/V3, Kimi K2) on the Triton-lowered kernel: one latent cache whose rows
are the latent ``c_kv`` (also the value row) then ``k_rope``, queries ``[q_nope absorbed | q_rope]``.

Checked against the float64 reference of the absorbed formula (values = the latent part of each key
row) and against the un-absorbed multi-head attention it stands for. Tiny latent / rope widths on the
CPU (interpret mode); unused pages hold NaN (``build_inputs``).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jax_attn.kernels.triton_paged import paged_attention, unsupported
from jax_attn.reference import paged_attention_reference
from tests.attention_cases import Case, build_inputs, compare, compare_per_sequence, reference_by_sequence

LATENT, ROPE = 32, 16  # DeepSeek: 512 + 64


def _mla(name, seq_lens, **kw):
    kw = dict(dict(heads=(8, 1), head_dim=LATENT + ROPE, softmax_scale=0.23, num_splits=1), **kw)
    return Case(name, tuple(seq_lens), **kw)


CASES = [
    _mla("decode_page1", [(1, 17), (1, 40), (1, 3)], page_size=1, pad_rows=1),
    _mla("extend_prefix_page16", [(12, 40), (3, 33), (20, 20)], page_size=16),
    _mla("verify_q4_page16_split2", [(4, 70), (4, 9)], page_size=16, num_splits=2),  # MTP / EAGLE verify
    _mla("decode_page64_bf16", [(1, 90), (1, 130)], page_size=64, dtype="bfloat16", heads=(16, 1)),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_absorbed_mla_matches_reference(case):
    """The kernel reads K and V from one latent row (V = its first LATENT columns)."""
    q, k, _, md, kw = build_inputs(case)
    assert kw["return_lse"]  # build_inputs passes the case's LSE request (a default True)
    got = paged_attention(q, k, None, md, latent_dim=LATENT, num_splits=case.num_splits, **kw)
    want = reference_by_sequence(q, k, k[..., :LATENT], md, **kw)
    tol = 2e-2 if case.dtype == "bfloat16" else 2e-5
    compare(got[0], want[0], tol=tol, what=case.name)
    compare_per_sequence(got[0], want[0], md.cu_seqlens_q, tol=2 * tol, what=case.name)
    n = int(md.cu_seqlens_q[-1])
    np.testing.assert_allclose(np.asarray(got[1][:n]), np.asarray(want[1][:n]), rtol=1e-4, atol=1e-4)
    assert got[0].shape == q.shape[:2] + (LATENT,)


@pytest.mark.parametrize("name", ["decode_page1", "verify_q4_page16_split2"])
def test_head_group_split_over_programs(name):
    """A query-head group whose tile exceeds ``max_tile_elements`` (DeepSeek's 128 heads x 512 latent
    columns on a GPU) is split over programs, each with its part of the heads: same result."""
    from jax_attn.kernels.config import KernelConfig
    from jax_attn.kernels.triton_paged import head_split

    case = dataclasses.replace(next(c for c in CASES if c.name == name), heads=(32, 1))
    cfg = KernelConfig(max_tile_elements=16 * LATENT)  # decode: 32 rows x 32 latent columns, split in 2
    assert head_split(1, 32, 1, LATENT, cfg.max_tile_elements) == 2
    assert head_split(4, 32, 1, LATENT, cfg.max_tile_elements) == 8  # verify: 4 tokens x 32 heads
    q, k, _, md, kw = build_inputs(case)
    got = paged_attention(q, k, None, md, latent_dim=LATENT, num_splits=case.num_splits, config=cfg, **kw)
    want = reference_by_sequence(q, k, k[..., :LATENT], md, **kw)
    compare_per_sequence(got[0], want[0], md.cu_seqlens_q, tol=4e-5, what=name)
    n = int(md.cu_seqlens_q[-1])
    np.testing.assert_allclose(np.asarray(got[1][:n]), np.asarray(want[1][:n]), rtol=1e-4, atol=1e-4)


def test_absorbed_equals_unabsorbed_attention():
    """MLA absorbed into the latent space equals the multi-head attention it compresses: per head,
    k_nope = c_kv @ W_uk, v = c_kv @ W_uv; absorbed, q_nope @ W_uk^T meets c_kv and the latent output
    goes through W_uv. (A wrong latent/rope split or values read from the rope part fail here.)"""
    rng = np.random.default_rng(5)
    case = _mla("unabsorbed", [(5, 30), (1, 19), (9, 9)], page_size=4)
    _, latent, _, md, _ = build_inputs(case)
    hq, nope, vdim = 8, 24, 20
    t = int(md.cu_seqlens_q[-1])
    w_uk = rng.standard_normal((hq, LATENT, nope)).astype(np.float32) / LATENT**0.5
    w_uv = rng.standard_normal((hq, LATENT, vdim)).astype(np.float32) / LATENT**0.5
    q_nope = rng.standard_normal((t, hq, nope)).astype(np.float32)
    q_rope = rng.standard_normal((t, hq, ROPE)).astype(np.float32)
    scale = (nope + ROPE) ** -0.5
    q_abs = np.einsum("thn,hln->thl", q_nope, w_uk)
    q_all = jnp.asarray(np.concatenate([q_abs, q_rope], -1))
    out_latent = paged_attention(q_all, latent, None, md, latent_dim=LATENT, softmax_scale=scale)
    got = np.einsum("thl,hlv->thv", np.asarray(out_latent), w_uv)
    c_kv, k_rope = np.asarray(latent[..., 0, :LATENT]), np.asarray(latent[..., 0, LATENT:])  # [pages, ps, .]
    k_heads = np.concatenate([np.einsum("psl,hln->pshn", c_kv, w_uk),
                              np.broadcast_to(k_rope[:, :, None], k_rope.shape[:2] + (hq, ROPE))], -1)
    v_heads = np.einsum("psl,hlv->pshv", c_kv, w_uv)
    want = paged_attention_reference(jnp.asarray(np.concatenate([q_nope, q_rope], -1)), jnp.asarray(k_heads),
                                     jnp.asarray(v_heads), md.cache_seqlens, md.cu_seqlens_q, md.page_table,
                                     page_size=case.page_size, softmax_scale=scale)
    compare_per_sequence(got, np.asarray(want)[:t], md.cu_seqlens_q, tol=1e-4, what="absorbed vs un-absorbed")


def test_latent_rules():
    assert unsupported(jnp.bfloat16, 576, 512, latent=True) is None  # DeepSeek: 512 latent + 64 rope
    assert "below" in unsupported(jnp.bfloat16, 512, 512, latent=True)
    assert "rope part" in unsupported(jnp.bfloat16, 512 + 20, 512, latent=True)
    assert unsupported(jnp.bfloat16, 576, 576) is not None  # not as one 576-wide head
    q, k, _, md, _ = build_inputs(CASES[0])
    with pytest.raises(ValueError, match="latent_dim"):
        paged_attention(q, k, None, md)
    with pytest.raises(ValueError, match="MLA latent cache"):
        paged_attention(q, k, k, md, latent_dim=LATENT)
    fp8 = dataclasses.replace(CASES[0], dtype="bfloat16")
    q, k, _, md, _ = build_inputs(fp8)
    with pytest.raises(NotImplementedError, match="fp8 latent"):
        paged_attention(q, k.astype(jnp.float8_e4m3fn), None, md, latent_dim=LATENT)


# ----------------------------------------------------------------------------- JAX backend
HQ, MAX_CTX = 4, 48


@pytest.mark.parametrize("mode,page,split_inputs", [("extend", 1, True), ("decode", 16, False),
                                                    ("extend", 16, False)])
def test_jax_backend_mla_layer(mode, page, split_inputs):
    """``FlashAttentionBackend.forward`` on an MLA layer (``KVPool.mla``): writes each new token's
    latent + rope row, attends with the latent part as values; equals the float64 reference over the
    updated pool; no slot outside the step's writes changes (NaN in every unused slot). Inputs either
    whole rows or SGLang's split form (latent ``q`` / ``k`` with ``q_rope`` / ``k_rope``)."""
    from jax_attn.backend import FlashAttentionBackend, LayerParams
    from jax_attn.kv_cache import KVPool
    from tests.paging import committed_pools, shuffled_table

    rng = np.random.default_rng(page)
    d = LATENT + ROPE
    table, num_slots = shuffled_table(6, MAX_CTX, page, seed=3)
    rows = np.array([3, 1, 5], np.int32)
    committed = np.array([0, 9, 20]) if mode == "extend" else np.array([4, 9, 30])
    q_lens = (rng.integers(1, 6, 3) if mode == "extend" else np.ones(3, np.int64)).astype(np.int32)
    k_pool, _ = committed_pools(table, num_slots, rows, committed, 1, d, 1, rng)
    loc, fb = mla_step(table, rows, committed, q_lens, mode)
    n = int(q_lens.sum())
    q = rng.standard_normal((n, HQ * d)).astype(np.float32)
    k_new = rng.standard_normal((n, d)).astype(np.float32)
    backend = FlashAttentionBackend(table, page_size=page, max_context_len=MAX_CTX)
    layer = LayerParams(HQ, 1, d, v_head_dim=LATENT, scaling=0.19, mla=True)
    pool = KVPool(jnp.asarray(k_pool), None)
    if split_inputs:
        q3 = q.reshape(n, HQ, d)
        args = (jnp.asarray(q3[..., :LATENT].reshape(n, -1)), jnp.asarray(k_new[:, :LATENT]), None)
        kw = dict(q_rope=jnp.asarray(q3[..., LATENT:].reshape(n, -1)), k_rope=jnp.asarray(k_new[:, LATENT:]))
    else:
        args, kw = (jnp.asarray(q), jnp.asarray(k_new), None), {}
    out, new_pool = backend.forward(*args, layer, pool, backend.plan(fb), **kw)
    assert new_pool.v is None and out.shape == (n, HQ * LATENT)
    k_pool[loc, 0] = k_new
    check_mla_step(out, new_pool, k_pool, q, table, rows, committed, q_lens, page, MAX_CTX, LATENT, 0.19, 2e-5, mode)


def mla_step(table, rows, committed, q_lens, mode: str):
    """(the slots a decode or extend step over ``rows`` writes, its ``ForwardBatch``): ``q_lens`` new tokens
    after each row's ``committed`` ones."""
    from jax_attn.batch import ForwardBatch
    from jax_attn.metadata import ForwardMode

    loc = np.concatenate([table[r, s:s + n] for r, s, n in zip(rows, committed, q_lens)])
    fm = ForwardMode.EXTEND if mode == "extend" else ForwardMode.DECODE
    return loc, ForwardBatch(fm, rows, committed + q_lens, loc, extend_seq_lens=q_lens if mode == "extend" else None)


def check_mla_step(out, new_pool, want_pool, q, table, rows, committed, q_lens, page: int, max_ctx: int, latent: int,
                   scale: float, tol: float, what: str):
    """An MLA layer's step (``mla_step``) against ``want_pool`` (the latent pool with the step's rows
    written, NaN where no one wrote): the pool equals it (no other slot written), and the output equals the
    reference over it per sequence (``q`` in the layer's dtype's values)."""
    from jax_attn.kv_cache import paged_view

    n, d = int(np.sum(q_lens)), want_pool.shape[-1]
    after = np.asarray(new_pool.k, np.float32)
    np.testing.assert_array_equal(np.isnan(after), np.isnan(want_pool))
    np.testing.assert_array_equal(after[~np.isnan(after)], want_pool[~np.isnan(want_pool)])
    pt = table[rows][:, ::page][:, :-(-max_ctx // page)] // page
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    paged = paged_view(jnp.asarray(want_pool), page)
    want = paged_attention_reference(jnp.asarray(q, jnp.float32).reshape(n, -1, d), paged, paged[..., :latent],
                                     jnp.asarray(committed + q_lens, jnp.int32), jnp.asarray(cu), jnp.asarray(pt),
                                     page_size=page, softmax_scale=scale)
    compare_per_sequence(np.asarray(out, np.float32).reshape(n, -1, latent), np.asarray(want), cu, tol=tol, what=what)


def test_jax_backend_mla_rules():
    from jax_attn.backend import FlashAttentionBackend, LayerParams
    from jax_attn.batch import ForwardBatch
    from jax_attn.kv_cache import KVPool
    from jax_attn.metadata import ForwardMode
    from tests.paging import shuffled_table

    with pytest.raises(ValueError, match="one kv head"):
        LayerParams(4, 2, 48, v_head_dim=32, mla=True)
    with pytest.raises(ValueError, match="one kv head"):
        LayerParams(4, 1, 48, mla=True)  # no kv_lora_rank
    table, num_slots = shuffled_table(2, 16, 4, seed=0)
    backend = FlashAttentionBackend(table, page_size=4, max_context_len=16)
    md = backend.plan(ForwardBatch(ForwardMode.DECODE, np.array([1], np.int32), np.array([3]),
                                   table[1, 2:3].astype(np.int32)))
    q, k = jnp.zeros((1, 4 * 48)), jnp.zeros((1, 48))
    mla = LayerParams(4, 1, 48, v_head_dim=32, mla=True)
    with pytest.raises(ValueError, match="KVPool.mla"):
        backend.forward(q, k, k, mla, KVPool.zeros(num_slots, 1, 48, jnp.float32), md)
    latent = KVPool.mla(num_slots, 32, 16, jnp.float32)
    with pytest.raises(ValueError, match="needs an MLA layer"):
        backend.forward(q, k, k, LayerParams(4, 1, 48), latent, md)
    with pytest.raises(NotImplementedError, match="q_rope"):
        backend.forward(q, k, k, LayerParams(4, 1, 48), KVPool.zeros(num_slots, 1, 48, jnp.float32), md,
                        q_rope=q)
    with pytest.raises(NotImplementedError, match="use_irope"):
        backend.forward(q, k, None, dataclasses.replace(mla, use_irope=True), latent, md)
    assert backend.describe(md, mla, jnp.bfloat16)["attention"] == "triton"


# ----------------------------------------------------------------------------- torch bridge
@pytest.mark.parametrize("mode,page,split_inputs,launch", [("extend", 1, True, False), ("decode", 16, False, False),
                                                           ("extend", 1, False, True), ("decode", 16, True, True)])
def test_torch_bridge_mla(mode, page, split_inputs, launch):
    """An MLA model through the bridge (``model_config.attention_arch == "MLA"``, SGLang's
    ``MLATokenToKVPool``): the write goes through the pool's ``set_mla_kv_buffer``, attention reads the
    latent rows; equals the float64 reference over the updated pool; no other slot changes (NaN in every
    unused slot); a second step reuses the checked layer. ``launch``: through the Triton launch path
    (``torch_bridge.triton_path``, its kernels interpreted), not a JAX executable."""
    import torch

    from tests.test_triton_launch import InterpretedTriton, triton_path_for_tests

    from tests.paging import shuffled_table
    from torch_bridge import (FlashAttentionBackend, ForwardBatch, ForwardMode, MLATokenToKVPool, ModelConfig,
                              ModelRunner, RadixAttention, ReqToTokenPool)

    rng = np.random.default_rng(11 + page)
    d = LATENT + ROPE
    table, num_slots = shuffled_table(6, MAX_CTX, page, seed=4)
    pool = MLATokenToKVPool.create(num_slots, 1, LATENT, ROPE, torch.float32)
    buf = pool.kv_buffer[0]
    buf.fill_(float("nan"))
    buf[0] = 0.0
    writes = []
    pool.set_mla_kv_buffer = lambda *a, f=pool.set_mla_kv_buffer: (writes.append(a[1].clone()), f(*a))[1]
    runner = ModelRunner(ReqToTokenPool(torch.from_numpy(table).clone()), pool,
                         ModelConfig(MAX_CTX, attention_arch="MLA"), page_size=page)
    backend = FlashAttentionBackend(runner, mosaic_path=triton_path_for_tests() if launch else None)
    layer = RadixAttention(HQ, d, 0.21, 1, 0, v_head_dim=LATENT)
    launches = InterpretedTriton.calls
    rows = np.array([3, 1, 5], np.int64)
    for step in range(2):
        committed = np.array([0, 9, 20]) + 5 * step if mode == "extend" else np.array([4, 9, 30]) + step
        q_lens = rng.integers(1, 6, 3) if mode == "extend" else np.ones(3, np.int64)
        for r, n in zip(rows, committed):  # committed latent rows
            buf[torch.from_numpy(table[r, :n].astype(np.int64))] = torch.from_numpy(
                rng.standard_normal((n, 1, d)).astype(np.float32))
        loc = np.concatenate([table[r, s:s + n] for r, s, n in zip(rows, committed, q_lens)]).astype(np.int64)
        fm = ForwardMode.EXTEND if mode == "extend" else ForwardMode.DECODE
        fb = ForwardBatch(fm, 3, torch.from_numpy(rows), torch.from_numpy(committed + q_lens), torch.from_numpy(loc),
                          extend_seq_lens=torch.from_numpy(q_lens) if mode == "extend" else None,
                          token_to_kv_pool=pool)
        n = int(q_lens.sum())
        q = torch.from_numpy(rng.standard_normal((n, HQ, d)).astype(np.float32))
        k_new = torch.from_numpy(rng.standard_normal((n, d)).astype(np.float32))
        before = buf.clone()
        backend.init_forward_metadata(fb)
        if split_inputs:
            out = backend.forward(q[..., :LATENT].reshape(n, -1), k_new[:, :LATENT], k_new[:, :LATENT], layer, fb,
                                  q_rope=q[..., LATENT:].reshape(n, -1), k_rope=k_new[:, LATENT:])
        else:
            out = backend.forward(q.reshape(n, -1), k_new, k_new[:, :LATENT], layer, fb)
        assert out.shape == (n, HQ * LATENT) and torch.equal(writes[-1], torch.from_numpy(loc))
        before[torch.from_numpy(loc), 0] = k_new
        torch.testing.assert_close(buf, before, rtol=0, atol=0, equal_nan=True)  # only the step's slots
        pt = table[rows][:, ::page][:, :-(-MAX_CTX // page)] // page
        cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        paged = jnp.asarray(buf.numpy()).reshape(-1, page, 1, d)
        want = paged_attention_reference(jnp.asarray(q.numpy()), paged, paged[..., :LATENT],
                                         jnp.asarray(committed + q_lens, jnp.int32), jnp.asarray(cu),
                                         jnp.asarray(pt.astype(np.int32)), page_size=page, softmax_scale=0.21)
        compare_per_sequence(out.numpy().reshape(n, HQ, LATENT), np.asarray(want), cu, tol=2e-5, what=mode)
    assert len(backend.runner.hits) == 1
    assert (InterpretedTriton.calls > launches) == launch


def test_torch_bridge_mla_rules():
    """What an MLA model cannot run through the bridge raises, naming it; q_rope elsewhere raises."""
    import torch

    from tests.paging import shuffled_table
    from torch_bridge import (FlashAttentionBackend, ForwardBatch, ForwardMode, MHATokenToKVPool, MLATokenToKVPool,
                              ModelConfig, ModelRunner, RadixAttention, ReqToTokenPool)

    table, num_slots = shuffled_table(2, 16, 4, seed=0)
    pool = MLATokenToKVPool.create(num_slots, 1, LATENT, ROPE, torch.float32)
    rtt = ReqToTokenPool(torch.from_numpy(table).clone())
    with pytest.raises(NotImplementedError, match="attention_arch == MLA with a sliding-window model"):
        FlashAttentionBackend(ModelRunner(rtt, pool, ModelConfig(16, attention_arch="MLA"), page_size=4,
                                          sliding_window_size=8))
    backend = FlashAttentionBackend(ModelRunner(rtt, pool, ModelConfig(16, attention_arch="MLA"), page_size=4))
    fb = ForwardBatch(ForwardMode.EXTEND, 1, torch.tensor([1]), torch.tensor([3]),
                      torch.from_numpy(table[1, :3].astype(np.int64)), extend_seq_lens=torch.tensor([3]),
                      token_to_kv_pool=pool)
    fb.attn_attend_prefix_cache = False
    backend.init_forward_metadata(fb)
    layer = RadixAttention(HQ, LATENT + ROPE, 0.2, 1, 0, v_head_dim=LATENT)
    q, k = torch.zeros(3, HQ * (LATENT + ROPE)), torch.zeros(3, LATENT + ROPE)
    before = pool.kv_buffer[0].clone()
    with pytest.raises(NotImplementedError, match="attn_attend_prefix_cache"):
        backend.forward(q, k, k, layer, fb)
    assert torch.equal(pool.kv_buffer[0], before)
    mha = MHATokenToKVPool.create(num_slots, 1, 1, 8, torch.float32)
    plain = FlashAttentionBackend(ModelRunner(rtt, mha, ModelConfig(16), page_size=4))
    fb = ForwardBatch(ForwardMode.EXTEND, 1, torch.tensor([1]), torch.tensor([3]),
                      torch.from_numpy(table[1, :3].astype(np.int64)), extend_seq_lens=torch.tensor([3]),
                      token_to_kv_pool=mha)
    plain.init_forward_metadata(fb)
    with pytest.raises(NotImplementedError, match="q_rope"):
        plain.forward(torch.zeros(3, 8), torch.zeros(3, 8), torch.zeros(3, 8), RadixAttention(1, 8, 0.3, 1, 0), fb,
                      q_rope=torch.zeros(3, 8))


def test_torch_bridge_mla_graph_replay_equals_eager():
    """An MLA decode bucket: the capture hook, then the replay hook with other lengths; the layer run
    after the replay hook equals an eager step of the same batch (CPU: the JAX path under both)."""
    import torch

    from tests.paging import shuffled_table
    from torch_bridge import (FlashAttentionBackend, ForwardBatch, ForwardMode, MLATokenToKVPool, ModelConfig,
                              ModelRunner, RadixAttention, ReqToTokenPool)

    rng = np.random.default_rng(21)
    d, page, bs = LATENT + ROPE, 4, 4
    table, num_slots = shuffled_table(6, MAX_CTX, page, seed=5)
    pool = MLATokenToKVPool.create(num_slots, 1, LATENT, ROPE, torch.float32)
    pool.kv_buffer[0].copy_(torch.from_numpy(rng.standard_normal((num_slots, 1, d)).astype(np.float32)))
    runner = ModelRunner(ReqToTokenPool(torch.from_numpy(table).clone()), pool,
                         ModelConfig(MAX_CTX, attention_arch="MLA"), page_size=page)
    layer = RadixAttention(HQ, d, 0.17, 1, 0, v_head_dim=LATENT)
    graph = FlashAttentionBackend(runner)
    graph.init_cuda_graph_state(bs, bs)
    z = torch.zeros(bs, dtype=torch.long)
    graph.init_forward_metadata_capture_cuda_graph(bs, bs, z, z + 1, None, ForwardMode.DECODE, None)
    rows, lens = np.array([2, 5, 1], np.int64), np.array([17, 30, 9], np.int64)
    loc = torch.from_numpy(np.array([table[r, n - 1] for r, n in zip(rows, lens)], np.int64))
    q = torch.from_numpy(rng.standard_normal((3, HQ * d)).astype(np.float32))
    k = torch.from_numpy(rng.standard_normal((3, d)).astype(np.float32))
    pad = lambda x, fill: torch.cat([x, torch.full((bs - 3,) + tuple(x.shape[1:]), fill, dtype=x.dtype)])  # noqa: E731
    graph.init_forward_metadata_replay_cuda_graph(bs, pad(torch.from_numpy(rows), 0), pad(torch.from_numpy(lens), 1),
                                                  None, None, ForwardMode.DECODE, None, None,
                                                  out_cache_loc=pad(loc, 0))
    fb = ForwardBatch(ForwardMode.DECODE, bs, pad(torch.from_numpy(rows), 0), pad(torch.from_numpy(lens), 1),
                      pad(loc, 0), token_to_kv_pool=pool)
    replayed = graph.forward(pad(q, 0.0), pad(k, 0.0), None, layer, fb)[:3]
    eager = FlashAttentionBackend(runner)
    fb = ForwardBatch(ForwardMode.DECODE, 3, torch.from_numpy(rows), torch.from_numpy(lens), loc, token_to_kv_pool=pool)
    eager.init_forward_metadata(fb)
    torch.testing.assert_close(replayed, eager.forward(q, k, None, layer, fb), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["prefix_chunk", "extend_part", "one_shot"])
def test_torch_bridge_mla_chunked_prefix_mha(kind):
    """The seed's chunked-prefix MHA of an MLA model (``attn_attend_prefix_cache`` on an extend): the
    model's multi-head layer (q/k 24 = nope + rope, v 16) over ragged K/V given in the call; a prefix
    chunk non-causal (one sequence's chunk empty: output 0, LSE -inf), the extend part or, with
    ``mha_one_shot``, the whole sequence causal; LSE when ``mha_return_lse``; the cache untouched."""
    import torch

    from tests.paging import shuffled_table
    from torch_bridge import (FlashAttentionBackend, ForwardBatch, ForwardMode, MLATokenToKVPool, ModelConfig,
                              ModelRunner, RadixAttention, ReqToTokenPool)

    rng = np.random.default_rng(len(kind))
    table, num_slots = shuffled_table(6, MAX_CTX, 4, seed=6)
    pool = MLATokenToKVPool.create(num_slots, 1, LATENT, ROPE, torch.float32)
    runner = ModelRunner(ReqToTokenPool(torch.from_numpy(table).clone()), pool,
                         ModelConfig(MAX_CTX, attention_arch="MLA"), page_size=4)
    backend = FlashAttentionBackend(runner)
    rows, prefix, ext = np.array([3, 1, 5]), np.array([9, 0, 6]), np.array([4, 7, 2])
    seq = prefix + ext
    loc = np.concatenate([table[r, p:p + n] for r, p, n in zip(rows, prefix, ext)]).astype(np.int64)
    fb = ForwardBatch(ForwardMode.EXTEND, 3, torch.from_numpy(rows), torch.from_numpy(seq), torch.from_numpy(loc),
                      extend_seq_lens=torch.from_numpy(ext), token_to_kv_pool=pool, extend_seq_lens_cpu=ext.tolist(),
                      seq_lens_cpu=torch.from_numpy(seq))
    kv_lens = {"prefix_chunk": prefix, "extend_part": ext, "one_shot": seq}[kind]
    fb.attn_attend_prefix_cache = kind == "prefix_chunk"
    fb.mha_return_lse = kind != "extend_part"
    fb.mha_one_shot = kind == "one_shot"
    if kind == "prefix_chunk":
        fb.prefix_chunk_idx = 0
        fb.prefix_chunk_cu_seq_lens = [torch.from_numpy(np.concatenate([[0], np.cumsum(prefix)]).astype(np.int32))]
        fb.prefix_chunk_max_seq_lens = [int(prefix.max())]
    backend.init_forward_metadata(fb)
    h, d, dv, t, nk = HQ, 24, 16, int(ext.sum()), int(kv_lens.sum())
    q = rng.standard_normal((t, h, d)).astype(np.float32)
    k = rng.standard_normal((nk, h, d)).astype(np.float32)
    v = rng.standard_normal((nk, h, dv)).astype(np.float32)
    before = pool.kv_buffer[0].clone()
    res = backend.forward(*(torch.from_numpy(x.reshape(x.shape[0], -1)) for x in (q, k, v)),
                          RadixAttention(h, d, 0.29, h, 1, v_head_dim=dv), fb, save_kv_cache=False)
    out, lse = res if fb.mha_return_lse else (res, None)
    assert torch.equal(pool.kv_buffer[0].isnan(), before.isnan())
    want, want_lse = np.zeros((t, h, dv)), np.full((t, h), -np.inf)
    cu_q, cu_k = np.concatenate([[0], np.cumsum(ext)]), np.concatenate([[0], np.cumsum(kv_lens)])
    for b in range(3):
        for i in range(ext[b]):
            n = kv_lens[b] if kind == "prefix_chunk" else kv_lens[b] - ext[b] + i + 1
            if n <= 0:
                continue
            s = np.einsum("khd,hd->hk", k[cu_k[b]:cu_k[b] + n], q[cu_q[b] + i]) * 0.29
            m = s.max(1, keepdims=True)
            p = np.exp(s - m)
            want[cu_q[b] + i] = np.einsum("hk,khv->hv", p, v[cu_k[b]:cu_k[b] + n]) / p.sum(1, keepdims=True)
            want_lse[cu_q[b] + i] = m[:, 0] + np.log(p.sum(1))
    np.testing.assert_allclose(out.numpy().reshape(t, h, dv), want, rtol=1e-4, atol=1e-5)
    if lse is not None:
        assert lse.shape == (t, h)
        np.testing.assert_array_equal(np.isinf(lse.numpy()), np.isinf(want_lse))
        fin = np.isfinite(want_lse)
        np.testing.assert_allclose(lse.numpy()[fin], want_lse[fin], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("launch", [False, True, pytest.param("gpu", marks=pytest.mark.gpu)],
                         ids=["jax", "launch", "gpu"])
def test_torch_bridge_mla_tree_verify(launch):
    """A tree (topk 2) target verify of an MLA layer through the bridge: the committed latent rows
    (non-causal) and the draft rows each draft token's tree allows, merged. ``launch``: on the Triton
    launch path (both passes and their merge launched from torch, interpreted), not a JAX executable.
    Equals the float64 absorbed formula per request, and writes only the step's slots. Catches: the
    prefix pass masked causally, a draft row seeing a draft outside its branch, values read past the
    latent part, the merge dropped, and (``launch``) the layer falling back to JAX. ``gpu``: the compiled
    kernels launched on a CUDA GPU (the device's own launch path)."""
    import torch

    dev = "cuda" if launch == "gpu" else "cpu"
    if dev == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")

    from tests.paging import shuffled_table
    from tests.test_triton_launch import triton_path_for_tests
    from torch_bridge import (FlashAttentionBackend, ForwardBatch, ForwardMode, MLATokenToKVPool, ModelConfig,
                              ModelRunner, RadixAttention, ReqToTokenPool, ServerArgs, SpecInfo)
    from torch_bridge.layer_runner import JaxLayerHit

    rng = np.random.default_rng(23)
    page, n_draft, d, scale = 4, 4, LATENT + ROPE, 0.21
    parent = [-1, 0, 0, 1]  # a draft tree: two branches from the first draft token
    mask = np.zeros((n_draft, n_draft), bool)
    for i in range(n_draft):
        j = i
        while j >= 0:  # each draft token sees itself and its ancestors
            mask[i, j], j = True, parent[j]
    table, num_slots = shuffled_table(6, MAX_CTX, page, seed=5)
    pool = MLATokenToKVPool.create(num_slots, 1, LATENT, ROPE, torch.float32, device=dev)
    buf = pool.kv_buffer[0]
    buf.fill_(float("nan"))
    buf[0] = 0.0
    runner = ModelRunner(ReqToTokenPool(torch.from_numpy(table).to(dev)), pool,
                         ModelConfig(MAX_CTX, attention_arch="MLA"), page_size=page, device=dev,
                         server_args=ServerArgs(speculative_eagle_topk=2, speculative_num_draft_tokens=n_draft))
    backend = FlashAttentionBackend(runner, mosaic_path=triton_path_for_tests() if launch is True else None, topk=2)
    layer = RadixAttention(HQ, d, scale, 1, 0, v_head_dim=LATENT)
    rows, committed = np.array([3, 1], np.int64), np.array([9, 22], np.int64)
    def t(x):
        return torch.from_numpy(x).to(dev)
    for r, c in zip(rows, committed):
        buf[t(table[r, :c].astype(np.int64))] = t(rng.standard_normal((c, 1, d)).astype(np.float32))
    loc = np.concatenate([table[r, c:c + n_draft] for r, c in zip(rows, committed)]).astype(np.int64)
    custom = np.concatenate([np.concatenate([np.ones((n_draft, c), bool), mask], 1).reshape(-1) for c in committed])
    fb = ForwardBatch(ForwardMode.TARGET_VERIFY, 2, t(rows), t(committed), t(loc), token_to_kv_pool=pool,
                      spec_info=SpecInfo(topk=2, draft_token_num=n_draft, custom_mask=t(custom)))
    n = len(loc)
    q = rng.standard_normal((n, HQ, d)).astype(np.float32)
    k_new = t(rng.standard_normal((n, d)).astype(np.float32))
    before = buf.clone()
    backend.init_forward_metadata(fb)
    out = backend.forward(t(q).reshape(n, -1), k_new, k_new[:, :LATENT], layer, fb).cpu().numpy()
    before[t(loc), 0] = k_new
    torch.testing.assert_close(buf, before, rtol=0, atol=0, equal_nan=True)  # only the step's slots
    rows_np = buf[:, 0].double().cpu().numpy()
    for b, (r, c) in enumerate(zip(rows, committed)):
        want = np.zeros((n_draft, HQ, LATENT))
        for i in range(n_draft):
            keys = rows_np[np.concatenate([table[r, :c], loc[b * n_draft + np.nonzero(mask[i])[0]]])]
            s = np.einsum("kd,hd->hk", keys, q[b * n_draft + i].astype(np.float64)) * scale
            p = np.exp(s - s.max(1, keepdims=True))
            want[i] = (p / p.sum(1, keepdims=True)) @ keys[:, :LATENT]
        got = out[b * n_draft:(b + 1) * n_draft].reshape(n_draft, HQ, LATENT)
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < (2e-3 if dev == "cuda" else 2e-5), (b, err)  # the GPU's dots: tf32
    hit = backend.runner.hits[0]
    assert isinstance(hit, JaxLayerHit) != bool(launch), type(hit)
