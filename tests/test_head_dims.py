"""Head dims that are not powers of 2 (80, 96, 112, 192, ...) and K/V head dims that differ, from the
Triton-lowered kernel up through both front ends; NaN / Inf in q gives NaN in that head's output row.

CPU: the Pallas interpreter on tiny shapes. GPU (``-m gpu``): the same cases compiled, and real shapes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jax_attn import kernel_policy
from jax_attn.attention import attention
from jax_attn.backend import FlashAttentionBackend, LayerParams
from jax_attn.batch import ForwardBatch
from jax_attn.kernel_policy import Call, select_kernel
from jax_attn.kernels.config import KernelConfig
from jax_attn.kernels.merge_state import merge_splits, merge_state
from jax_attn.kernels import mosaic_paged, triton_paged
from jax_attn.kernels.triton_paged import paged_attention
from jax_attn.kv_cache import KVPool, paged_view
from jax_attn.metadata import ForwardMode
from jax_attn.reference import merge_state_reference, paged_attention_reference
from tests.attention_cases import Case, build_inputs, check_attention, compare, reference_by_sequence
from tests.paging import committed_pools, shuffled_table

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.gpu

_MIXED = ((1, 37), (9, 9), (5, 61), (13, 40))
# Every case: NaN in unused pages (build_inputs), padding tokens; f32 unless said.
CASES = [
    Case("d80_extend_softcap_scale", _MIXED, head_dim=80, softcap=5.0, softmax_scale=0.3),
    Case("d96_decode_page1_window", ((1, 17), (1, 40), (1, 1)), head_dim=96, page_size=1, heads=(8, 2),
         window=(13, 0), pad_rows=1),
    Case("d112_split3_sinks", ((1, 90), (5, 70), (1, 2)), head_dim=112, num_splits=3, sinks=True),
    Case("d192_v128_extend_page1_sinks_window", ((12, 40), (3, 33), (1, 9)), head_dim=192, head_dim_v=128,
         page_size=1, sinks=True, window=(9, 0)),
    Case("d192_v128_split2_decode", ((1, 70), (1, 33)), head_dim=192, head_dim_v=128, num_splits=2, heads=(8, 2),
         softmax_scale=0.07),
    Case("d128_v64_mixed_split2", _MIXED, head_dim=128, head_dim_v=64, num_splits=2, heads=(4, 1)),
    Case("d72_fp8_split2_decode", ((1, 60), (1, 44)), head_dim=72, fp8=True, dtype="bfloat16", num_splits=2),
    Case("d8_bf16_page1_noncausal", ((6, 30), (1, 17)), head_dim=8, dtype="bfloat16", page_size=1, causal=False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_head_dims_interpret(case):
    err = check_attention(paged_attention, case, interpret=True)
    if case.dtype == "float32":
        assert err < 2e-5, f"interpreted f32 should be near exact, got {err:.2e}"


def test_head_dims_packed_split_heads():
    """Split-KV decode with two kv heads per program (their rows gathered together) at head dim 80 / 48."""
    case = Case("d80_v48_pack2", ((1, 70), (1, 5)), heads=(8, 4), head_dim=80, head_dim_v=48, page_size=1,
                num_splits=2, softcap=5.0)
    cfg = KernelConfig(split_kv_heads=2, split_block_k=16)
    err = check_attention(functools.partial(paged_attention, config=cfg), case, interpret=True)
    assert err < 2e-5, f"interpreted f32 should be near exact, got {err:.2e}"


@gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_head_dims_gpu_small(case):
    check_attention(paged_attention, case)


_GPU_SEQS = ((1, 3000), (300, 300), (1, 4097), (77, 900))


@gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("d,dv", [(80, 80), (96, 96), (112, 112), (192, 192), (192, 128), (128, 64), (256, 256)])
@pytest.mark.parametrize("num_splits", [1, None])
def test_head_dims_gpu(d, dv, num_splits):
    case = Case(f"d{d}_v{dv}", _GPU_SEQS, heads=(32, 8), head_dim=d, head_dim_v=dv, dtype="bfloat16",
                num_splits=num_splits)
    check_attention(paged_attention, case)
    check_attention(attention, dataclasses.replace(case, page_size=64, window=(255, 0), sinks=True))


def test_unsupported_head_dims_raise():
    for d, dv in ((100, 100), (264, 264), (96, 4)):
        q, k, v, md, _ = build_inputs(Case("bad", ((1, 5),), head_dim=16))
        q = jnp.zeros(q.shape[:2] + (d,), q.dtype)
        k = jnp.zeros(k.shape[:3] + (d,), k.dtype)
        v = jnp.zeros(v.shape[:3] + (dv,), v.dtype)
        with pytest.raises(ValueError, match="multiples of 8 up to 256"):
            paged_attention(q, k, v, md, interpret=True)


# ----------------------------------------------------------------------------- NaN / Inf in q
@pytest.mark.parametrize("q_len,num_splits,head_dim", [(1, 1, 32), (1, 3, 80), (9, 2, 96)])
def test_nan_or_inf_in_q_gives_nan_in_that_row(q_len, num_splits, head_dim):
    """NaN in one (token, head) of q and Inf in another: those output rows are NaN (LSE too), as in the
    reference; every other row stays finite and right. Bug caught: the split merge weighting a NaN
    partial by ``w > 0`` (False for NaN) and returning 0 with LSE -inf."""
    _check_nan_rows(Case("nan_q", ((q_len, 40), (q_len, 70), (q_len, 25)), heads=(4, 2), head_dim=head_dim,
                         num_splits=num_splits, pad_tokens=1), interpret=True)


@gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("q_len,num_splits,head_dim", [(1, None, 128), (1, None, 80), (1, 4, 192), (64, 1, 96),
                                                       (64, None, 128)])
def test_nan_or_inf_in_q_gives_nan_in_that_row_gpu(q_len, num_splits, head_dim):
    """Compiled: Triton's float max drops NaN (maxnum), so only the NaN arithmetic may carry it."""
    _check_nan_rows(Case("nan_q_gpu", ((q_len, 3000), (q_len, 700), (q_len, 2000)), heads=(32, 8),
                         head_dim=head_dim, dtype="bfloat16", num_splits=num_splits, pad_tokens=1), interpret=False)


def _check_nan_rows(case: Case, *, interpret: bool):
    q_len = case.seq_lens[0][0]
    q, k, v, md, kw = build_inputs(case, seed=4)
    q = q.at[q_len, 1, 5].set(jnp.nan)  # sequence 1, head 1
    q = q.at[2 * q_len + q_len // 2, 2, 0].set(jnp.inf)  # sequence 2, head 2
    out, lse = paged_attention(q, k, v, md, num_splits=case.num_splits, interpret=interpret, **kw)
    ref, ref_lse = reference_by_sequence(q, k, v, md, **kw)
    out, ref = np.asarray(out, np.float32), np.asarray(ref)
    bad = np.isnan(ref).any(-1)  # [T, Hq] rows the reference makes NaN
    assert bad[q_len, 1] and bad[2 * q_len + q_len // 2, 2] and bad.sum() == 2
    np.testing.assert_array_equal(np.isnan(out).all(-1), bad)
    np.testing.assert_array_equal(np.isnan(out).any(-1), bad)
    np.testing.assert_array_equal(np.isnan(np.asarray(lse)), bad)
    compare(out[~bad], ref[~bad], tol=2e-5 if case.dtype == "float32" else 1e-2, what="rows without NaN")


def test_merge_kernels_propagate_nan_and_take_any_head_dim():
    """merge_state / merge_splits at head dim 80 (a padded block): right values; a NaN partial gives NaN;
    an empty partial (LSE -inf) holding NaN does not leak."""
    rng = np.random.default_rng(0)
    t, h, d = 7, 3, 80
    o_a, o_b = (jnp.asarray(rng.standard_normal((t, h, d)), jnp.float32) for _ in range(2))
    la, lb = (jnp.asarray(rng.standard_normal((t, h)) * 3, jnp.float32) for _ in range(2))
    o_a = o_a.at[1, 0].set(jnp.nan)
    la = la.at[1, 0].set(-jnp.inf)  # empty partial with garbage: no-op
    la = la.at[2, 1].set(jnp.nan)  # NaN partial: NaN row
    o, lse = merge_state(o_a, la, o_b, lb, interpret=True)
    ro, rl = merge_state_reference(o_a, la, o_b, lb)
    assert np.isnan(np.asarray(o)[2, 1]).all() and np.isnan(np.asarray(lse)[2, 1])
    keep = ~np.isnan(np.asarray(rl))
    compare(np.asarray(o)[keep], np.asarray(ro)[keep], tol=1e-5, what="merge_state d=80")
    s, r = 3, t * h
    po = jnp.asarray(rng.standard_normal((s, r, d)), jnp.float32)
    plse = jnp.asarray(rng.standard_normal((s, r)), jnp.float32).at[1, 4].set(jnp.nan)
    for num_sms in (1, 132):  # row blocks; one row per program
        o2, l2 = merge_splits(po, plse, (jnp.asarray([0, t], jnp.int32), jnp.asarray([s], jnp.int32)), num_heads=h,
                              out_dtype=jnp.float32, config=KernelConfig(num_sms=num_sms), interpret=True)
        o2, l2 = np.asarray(o2), np.asarray(l2)
        assert np.isnan(o2[4]).all() and np.isnan(l2[4]) and np.isfinite(np.delete(o2, 4, 0)).all()
        w = np.exp(np.asarray(plse) - np.asarray(plse).max(0))
        want = (w[..., None] * np.asarray(po)).sum(0) / w.sum(0)[:, None]
        compare(np.delete(o2, 4, 0), np.delete(want, 4, 0), tol=1e-5, what=f"merge_splits d=80 {num_sms=}")


# ----------------------------------------------------------------------------- kernel policy
# (D, Dv, what the Mosaic kernel says): multiples of 16 up to 192, and 256.
_MOSAIC_RULE = [(96, 96, None), (192, 128, None), (80, 80, None), (112, 112, None), (128, 64, None),
                (64, 128, None), (192, 192, None), (256, 128, None), (256, 256, None), (224, 224, "up to 192"),
                (128, 208, "up to 192"), (72, 72, "multiples of 16"), (128, 40, "multiples of 16"),
                (264, 264, "multiples of 16")]


@pytest.mark.parametrize("d,hq,covered", [(80, 32, True), (80, 64, True), (80, 256, False), (96, 256, True),
                                          (96, 512, False), (112, 256, False), (128, 512, True)])
def test_policy_packed_rows_stay_aligned(d, hq, covered, monkeypatch):
    """Packed decode rows of G query heads put a head's 64 / G rows at one offset of the Q and output
    staging buffers: TMA copies need it 128-byte aligned (head dim 80, G = 32: 2 rows of 160 bytes
    are not), so such calls go to the Triton-lowered kernel; prefill rows of the same heads stay."""
    monkeypatch.setattr(kernel_policy, "on_hopper", lambda: True)
    decode = Call(max_q_len=1, page_size=16, num_tokens=8, num_kv_heads=8, head_dim=d, head_dim_v=d,
                  dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, num_q_heads=hq)
    assert kernel_policy.mosaic_covers(decode) is covered
    assert kernel_policy.mosaic_covers(dataclasses.replace(decode, max_q_len=512))
    if not covered:
        with pytest.raises(NotImplementedError, match="packed query heads"):
            mosaic_paged.kernel_statics(num_tokens=8, num_q_heads=hq, num_kv_heads=8, head_dim=d, head_dim_v=d,
                                        page_size=16, pack=hq // 8, dtype=jnp.bfloat16, max_q_len=1)


@pytest.mark.parametrize("d,dv,why", _MOSAIC_RULE)
def test_policy_head_dims(d, dv, why, monkeypatch):
    """On Hopper, head dims the Mosaic kernel takes run there (both front ends; from torch: the
    launch path); the others go to the Triton-lowered kernel (JAX; from torch: its launch path where
    it takes the head dim, else the JAX executable, which raises), with the reason naming the rule."""
    monkeypatch.setattr(kernel_policy, "on_hopper", lambda: True)
    call = Call(max_q_len=512, page_size=16, num_tokens=512, num_kv_heads=8, head_dim=d, head_dim_v=dv,
                dtype=jnp.bfloat16, kv_dtype=jnp.bfloat16, num_q_heads=32)
    reason = mosaic_paged.unsupported(jnp.bfloat16, jnp.bfloat16, jnp.bfloat16, d, dv, 16)
    if why is None:
        assert reason is None
        assert select_kernel("auto", call) == "mosaic" and select_kernel("auto", call, from_torch=True) == "mosaic"
    else:
        assert why in reason and "impl='triton'" in reason
        assert select_kernel("auto", call) == "triton"
        triton_takes = triton_paged.unsupported(jnp.bfloat16, d, dv) is None
        assert select_kernel("auto", call, from_torch=True) == ("triton" if triton_takes else "jax")
        assert select_kernel("mosaic", call, from_torch=True) == "jax"
    if d <= 256 and dv <= 256:
        assert triton_paged.unsupported(jnp.bfloat16, d, dv) is None


@pytest.mark.parametrize("d,dv", [(d, dv) for d, dv, why in _MOSAIC_RULE if why is None])
@pytest.mark.parametrize("pack,max_q_len,splits", [(1, 512, 1), (4, 1, 1), (4, 1, 8), (1, 512, 4)])
def test_mosaic_buffers_fit_shared_memory(d, dv, pack, max_q_len, splits):
    """Every configuration the kernel takes is fitted into shared memory (two warpgroups: Q staging and
    output buffer in the rings; then its ring made shallower, then its key blocks shorter), and wide
    value rows (Dv > 128) get 64-key blocks (registers)."""
    from jax_attn.kernels.mosaic_smem import SMEM_BYTES, statics_smem_bytes

    for num_tokens, config in ((512, mosaic_paged.DEFAULT_MOSAIC_CONFIG),
                               (512, mosaic_paged.MosaicConfig(block_kv=256, stages=4, decode_stages=6))):
        st = mosaic_paged.kernel_statics(num_tokens=num_tokens, num_q_heads=32, num_kv_heads=8, head_dim=d,
                                         head_dim_v=dv, page_size=16, pack=pack, dtype=jnp.bfloat16,
                                         max_q_len=max_q_len, num_splits=splits, config=config)
        assert statics_smem_bytes(st) <= SMEM_BYTES and st.stages >= 2 and st.block_kv % 64 == 0
        smallest = dataclasses.replace(st, kv_staging=False, block_kv=64, stages=2)
        assert st.kv_staging == (statics_smem_bytes(smallest) > SMEM_BYTES)  # only when nothing else fits
        if max(d, dv) > 128:
            assert st.block_kv == 64
    wide = mosaic_paged.kernel_statics(num_tokens=512, num_q_heads=32, num_kv_heads=8, head_dim=64, head_dim_v=64,
                                       page_size=16, pack=1, dtype=jnp.bfloat16, max_q_len=512,
                                       config=mosaic_paged.MosaicConfig(block_kv=256, stages=4))
    assert (wide.block_kv, wide.stages) == (256, 3)  # 4 x 256 keys of 64 + 64 columns overflow; 3 fit


# ----------------------------------------------------------------------------- front ends
HQ, HKV, MAX_CTX, PAGE = 4, 2, 48, 4
# (D, Dv, mode): each front end runs head dim 96 and 192 / 128, extend and decode between them.
JAX_CASES = [(96, 96, "decode"), (192, 128, "extend")]
BRIDGE_CASES = [(96, 96, "extend"), (192, 128, "decode")]


def _expected(k_pool, v_pool, table, rows, seq_lens, q_lens, q, d, dv, scale, page=PAGE):
    pt = table[rows][:, ::page][:, :-(-MAX_CTX // page)] // page
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    out = paged_attention_reference(jnp.asarray(q).reshape(-1, HQ, d), paged_view(jnp.asarray(k_pool), page),
                                    paged_view(jnp.asarray(v_pool), page), jnp.asarray(seq_lens, jnp.int32),
                                    jnp.asarray(cu), jnp.asarray(pt), page_size=page, softmax_scale=scale)
    return np.asarray(out).reshape(-1, HQ * dv)


def _step(rng, mode):
    """(rows, committed tokens, new tokens per request) of a small extend or decode step."""
    rows = np.array([3, 1, 5], np.int32)
    committed = np.array([0, 9, 20]) if mode == "extend" else np.array([4, 9, 30])
    q_lens = rng.integers(1, 6, 3) if mode == "extend" else np.ones(3, np.int64)
    return rows, committed, q_lens.astype(np.int32)


@pytest.mark.parametrize("d,dv,mode", JAX_CASES)
def test_jax_backend_head_dims(d, dv, mode):
    """FlashAttentionBackend: plan, write K/V (Dv may differ from D), attend; equals the reference."""
    rng = np.random.default_rng(d + dv)
    table, num_slots = shuffled_table(6, MAX_CTX, PAGE, seed=1)
    rows, committed, q_lens = _step(rng, mode)
    k, v = committed_pools(table, num_slots, rows, committed, HKV, d, dv, rng)
    loc = np.concatenate([table[r, s:s + n] for r, s, n in zip(rows, committed, q_lens)])
    fm = ForwardMode.EXTEND if mode == "extend" else ForwardMode.DECODE
    fb = ForwardBatch(fm, rows, committed + q_lens, loc, extend_seq_lens=q_lens if mode == "extend" else None)
    n = int(q_lens.sum())
    q = rng.standard_normal((n, HQ * d)).astype(np.float32)
    kn, vn = rng.standard_normal((n, HKV * d)).astype(np.float32), rng.standard_normal((n, HKV * dv)).astype(np.float32)
    backend = FlashAttentionBackend(table, page_size=PAGE, max_context_len=MAX_CTX)  # auto: Triton here
    layer = LayerParams(HQ, HKV, d, v_head_dim=dv, scaling=0.11)
    out, pool = backend.forward(jnp.asarray(q), jnp.asarray(kn), jnp.asarray(vn), layer,
                                KVPool(jnp.asarray(k), jnp.asarray(v)), backend.plan(fb))
    k[loc], v[loc] = kn.reshape(-1, HKV, d), vn.reshape(-1, HKV, dv)
    np.testing.assert_array_equal(np.asarray(pool.v)[loc], v[loc])
    want = _expected(k, v, table, rows, committed + q_lens, q_lens, q, d, dv, 0.11)
    assert out.shape == (n, HQ * dv)
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("d,dv,mode", BRIDGE_CASES)
def test_torch_bridge_head_dims(d, dv, mode):
    """The torch bridge on the CPU runs these head dims through its compiled JAX executable; K/V
    written by torch into pools of different head dims; equals the reference."""
    got, want, _ = _bridge_step(d, dv, mode, "cpu", torch.float32, PAGE)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@gpu
@pytest.mark.skipif(not ON_GPU or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("d,dv,mode,page", [(96, 96, "extend", 16), (80, 80, "decode", 16), (112, 112, "extend", 16),
                                            (192, 128, "extend", 16), (192, 128, "decode", 16), (128, 64, "decode", 16),
                                            (256, 256, "extend", 16), (256, 256, "decode", 16),
                                            (256, 128, "extend", 16), (192, 128, "extend", 1), (256, 256, "extend", 1)])
def test_torch_bridge_head_dims_gpu(d, dv, mode, page):
    """On a Hopper GPU these head dims take the launch path (the Mosaic kernel from torch; at page 1 its rows
    gathered), bf16."""
    got, want, backend = _bridge_step(d, dv, mode, "cuda", torch.bfloat16, page)
    if torch.cuda.get_device_capability() == (9, 0):
        assert backend.mosaic_path is not None and backend.mosaic_path.recipes, "the launch path did not run"
    np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2)


def _bridge_step(d, dv, mode, device, dtype, page):
    """One bridge step of ``mode`` at head dims ``d`` / ``dv``: (output, reference, backend)."""
    from torch_bridge import (FlashAttentionBackend as TorchBackend, ForwardBatch as TorchBatch,
                              ForwardMode as TorchMode, MHATokenToKVPool, ModelConfig, ModelRunner,
                              RadixAttention, ReqToTokenPool, ServerArgs)

    rng = np.random.default_rng(7 + d)
    table, num_slots = shuffled_table(6, MAX_CTX, page, seed=2)
    pool = MHATokenToKVPool.create(num_slots, 1, HKV, d, dtype, device, v_head_dim=dv)
    pool.k_buffer[0].fill_(float("nan"))
    pool.v_buffer[0].fill_(float("nan"))
    pool.k_buffer[0][0] = pool.v_buffer[0][0] = 0.0
    runner = ModelRunner(ReqToTokenPool(torch.from_numpy(table).to(device).clone()), pool, ModelConfig(MAX_CTX),
                         page_size=page, server_args=ServerArgs(), attention_impl="auto", device=device)

    def t(x, dt=None):
        return torch.from_numpy(np.asarray(x)).to(device=device, dtype=dt)

    rows, committed, q_lens = _step(rng, mode)
    for r, n in zip(rows, committed):
        s = t(table[r, :n].astype(np.int64))
        pool.k_buffer[0][s] = t(rng.standard_normal((n, HKV, d)).astype(np.float32), dtype)
        pool.v_buffer[0][s] = t(rng.standard_normal((n, HKV, dv)).astype(np.float32), dtype)
    loc = np.concatenate([table[r, s:s + n] for r, s, n in zip(rows, committed, q_lens)]).astype(np.int64)
    fm = TorchMode.EXTEND if mode == "extend" else TorchMode.DECODE
    ext = t(q_lens.astype(np.int64)) if mode == "extend" else None
    fb = TorchBatch(fm, 3, t(rows.astype(np.int64)), t((committed + q_lens).astype(np.int64)), t(loc),
                    extend_seq_lens=ext, token_to_kv_pool=pool)
    n = int(q_lens.sum())
    q, kn, vn = (t(rng.standard_normal((n, h * x)).astype(np.float32), dtype)
                 for h, x in ((HQ, d), (HKV, d), (HKV, dv)))
    backend = TorchBackend(runner)
    backend.init_forward_metadata(fb)
    got = backend.forward(q, kn, vn, RadixAttention(HQ, d, 0.11, HKV, 0, v_head_dim=dv), fb)
    assert got.shape == (n, HQ * dv)
    assert torch.equal(pool.v_buffer[0][t(loc)], vn.reshape(-1, HKV, dv))
    k_pool, v_pool = (b[0].float().cpu().numpy() for b in (pool.k_buffer, pool.v_buffer))
    want = _expected(k_pool, v_pool, table, rows, committed + q_lens, q_lens, q.float().cpu().numpy(), d, dv, 0.11,
                     page)
    return got.float().cpu().numpy(), want, backend
