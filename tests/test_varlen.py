"""``varlen_attention`` (FA3's ``flash_attn_varlen_func``: keys in contiguous ragged runs) on the Mosaic kernel:
its keys as pages of one row (the kernel gathers the rows), or, at head dims whose rows it cannot gather (not
multiples of 64, e.g. 96), copied into pages of 64 rows first (``attention.varlen_pages``), where the kernel's
TMA copies read them.

Bugs these catch: a sequence's keys copied to the wrong pages or from the wrong rows (another sequence's
keys), a sequence's last page not padded or its rows past the end unmasked, an empty sequence (zeros, LSE
-inf) taking pages from its neighbour, the policy copying what it should not (decode, fp8,
``impl='triton'``). Checked per sequence against the float32 reference of the same call on pages of one row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_attn import kernel_policy
from jax_attn.attention import call_of, varlen_attention, varlen_metadata
from tests.attention_cases import compare_per_sequence

ON_GPU = jax.default_backend() == "gpu"


@dataclasses.dataclass(frozen=True)
class VarlenCase:
    name: str
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    head_dim: int = 192
    head_dim_v: int = 128
    heads: tuple[int, int] = (4, 2)
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    return_lse: bool = False


# Head dim 96: rows the kernel cannot gather, so the keys are copied into pages (``varlen_pages``).
CPU_CASES = [
    # an extend (causal, bottom-right), sequences ending inside pages
    VarlenCase("extend_96", (70, 5, 30), (70, 40, 75), head_dim=96, head_dim_v=96),
    # a prefix chunk: non-causal with LSE, one sequence without keys (zeros, LSE -inf)
    VarlenCase("prefix_chunk_lse_96", (40, 4, 70), (130, 0, 61), head_dim=96, head_dim_v=96, causal=False,
               return_lse=True),
]
GPU_CASES = CPU_CASES + [
    # MLA's chunked-prefix calls at 192 / 128: the rows of one-row pages gathered
    VarlenCase("extend_192_128", (70, 5, 30), (70, 40, 75)),
    VarlenCase("prefix_chunk_lse", (40, 4, 70), (130, 0, 61), causal=False, return_lse=True),
    VarlenCase("long_192_128", (700, 1, 1300), (700, 2000, 1300), heads=(8, 8)),
    VarlenCase("d96_window", (300, 40), (300, 900), head_dim=96, head_dim_v=96, heads=(8, 8), window=(127, 0)),
    VarlenCase("d128_gqa_lse", (64, 256), (1000, 256), head_dim=128, head_dim_v=128, heads=(8, 2), causal=False,
               return_lse=True),
]


def _run(case: VarlenCase, impl: str, by_sequence: bool = False):
    """The call's (out, lse) and cu_seqlens_q; ``by_sequence``: one call per sequence (the reference's
    memory grows with the batch's longest rows)."""
    rng = np.random.default_rng(len(case.name))
    hq, hkv = case.heads
    cu_q, cu_k = (np.concatenate([[0], np.cumsum(x)]).astype(np.int32) for x in (case.q_lens, case.k_lens))
    q = jnp.asarray(rng.standard_normal((cu_q[-1], hq, case.head_dim)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((cu_k[-1], hkv, case.head_dim)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((cu_k[-1], hkv, case.head_dim_v)), jnp.bfloat16)
    kw = dict(causal=case.causal, window_size=case.window, softmax_scale=0.09, return_lse=True, impl=impl)
    if by_sequence:  # (a sequence without keys: zeros and LSE -inf, by definition)
        parts = [varlen_attention(q[cu_q[b]:cu_q[b + 1]], k[cu_k[b]:cu_k[b + 1]], v[cu_k[b]:cu_k[b + 1]],
                                  jnp.asarray([0, nq], jnp.int32), jnp.asarray([0, nk], jnp.int32),
                                  max_seqlen_q=nq, max_seqlen_k=nk, **kw) if nk else
                 (jnp.zeros((nq, hq, case.head_dim_v), jnp.bfloat16), jnp.full((nq, hq), -jnp.inf))
                 for b, (nq, nk) in enumerate(zip(case.q_lens, case.k_lens))]
        res = tuple(jnp.concatenate(x) for x in zip(*parts))
    else:
        res = varlen_attention(q, k, v, jnp.asarray(cu_q), jnp.asarray(cu_k), max_seqlen_q=max(case.q_lens),
                               max_seqlen_k=max(case.k_lens), **{**kw, "return_lse": case.return_lse})
    return (res if case.return_lse or by_sequence else (res, None)), cu_q


def _check(case: VarlenCase, impl: str):
    (out, lse), cu_q = _run(case, impl)
    (want, want_lse), _ = _run(case, "reference", by_sequence=True)
    compare_per_sequence(out, want, cu_q, tol=2e-2, what=case.name)
    if case.return_lse:
        lse, want_lse = np.asarray(lse), np.asarray(want_lse)
        np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
        fin = np.isfinite(want_lse)
        np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=2e-3, atol=2e-3)
        empty = [b for b, n in enumerate(case.k_lens) if n == 0]
        for b in empty:  # a sequence without keys: zeros
            np.testing.assert_array_equal(np.asarray(out[cu_q[b]:cu_q[b + 1]], np.float32), 0.0)


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_varlen_repaged_interpret(case, monkeypatch):
    if ON_GPU:
        pytest.skip("interpreter cases run on the CPU")
    from jax_attn.kernels import mosaic_paged

    pages, real = [], mosaic_paged.paged_attention_mosaic
    monkeypatch.setattr(mosaic_paged, "paged_attention_mosaic",
                        lambda q, k, v, md, **kw: pages.append(md.page_size) or real(q, k, v, md, **kw))
    _check(case, "mosaic")
    assert pages == [kernel_policy.VARLEN_PAGE], "the keys were not copied into pages"


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_varlen_gpu(case):
    if not ON_GPU:
        pytest.skip("needs a Hopper GPU")
    _check(case, "mosaic")
    _check(case, "auto")


def test_varlen_repaged_policy(monkeypatch):
    """On Hopper ``auto`` copies the keys of prefill-like varlen calls into pages for the Mosaic kernel where
    the rows of one-row pages cannot be gathered (96: not a multiple of 64), and gathers them elsewhere (192 /
    128, 128 / 128: faster than the copy); not decode-like calls, not fp8, not ``impl='triton'``."""
    monkeypatch.setattr(kernel_policy, "on_hopper", lambda: True)

    def call(d, dv, dtype=jnp.bfloat16, q_len=300):
        cu = jnp.asarray([0, q_len, 2 * q_len], jnp.int32)
        md = varlen_metadata(cu, cu, num_tokens=2 * q_len, num_keys=2 * q_len, max_seqlen_q=q_len,
                             max_seqlen_k=q_len)
        q = jnp.zeros((2 * q_len, 8, d), jnp.bfloat16)
        return call_of(q, jnp.zeros((2 * q_len, 1, 8, d), dtype), jnp.zeros((2 * q_len, 1, 8, dv), dtype), md)

    for d, dv in ((192, 128), (128, 128)):
        assert not kernel_policy.varlen_repaged("auto", call(d, dv))  # the rows gathered
    assert kernel_policy.varlen_repaged("auto", call(96, 96))  # one-row pages cannot be gathered at 96
    assert not kernel_policy.varlen_repaged("auto", call(128, 128, q_len=1))  # decode-like: the copy would cost
    assert not kernel_policy.varlen_repaged("auto", call(128, 128, jnp.float8_e4m3fn))
    assert not kernel_policy.varlen_repaged("triton", call(128, 128))
    assert kernel_policy.varlen_repaged("mosaic", call(96, 96))
    assert not kernel_policy.varlen_repaged("mosaic", call(128, 128))
