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
