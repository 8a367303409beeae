"""Tests of the Mosaic GPU paged attention kernel (Hopper).

CPU: the Mosaic GPU interpreter (``plgpu.InterpretGPUParams``) on small shapes. GPU (``-m gpu``):
the compiled kernel on the shared case table, every case the kernel covers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_attn.kernels.mosaic_paged import MosaicConfig, paged_attention_mosaic, supports
from tests.attention_cases import CPU_CASES, GPU_CASES, Case, build_inputs, check_attention

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.gpu


def _c(name, seq_lens, **kw):
    kw = dict(dict(heads=(4, 2), head_dim=64, dtype="bfloat16", page_size=16, num_splits=None), **kw)
    return Case(name=name, seq_lens=tuple(seq_lens), **kw)


# Row counts that cross the 64-row warpgroup and 128-row tile edges; pages shuffled, NaN in unused slots.
MOSAIC_CPU_CASES = [
    _c("prefill_ragged", [(70, 70), (5, 5), (130, 140)], heads=(2, 1), softmax_scale=0.05),
    # 144 rows (a multiple of 8): Q tiles starting on a multiple of 8 are loaded straight into the
    # tiled buffer, the others (sequence 3 starts at row 69) through the staging buffer
    _c("prefill_aligned", [(64, 64), (5, 20), (75, 100)], heads=(2, 1)),
    _c("decode_packed", [(1, 17), (1, 130), (1, 3)], pad_rows=1),
    # 300 padding tokens: 600 padding rows, zeroed by one padding CTA over five row blocks, both halves
    _c("decode_packed_long_pad", [(1, 17), (1, 40)], pad_tokens=300),
    _c("verify_packed", [(4, 40), (4, 4)], heads=(8, 2), softmax_scale=0.3),  # a scale other than D ** -0.5
    _c("mixed_window", [(1, 90), (40, 60)], window=(13, 0), heads=(2, 2)),
    _c("noncausal_softcap", [(20, 50), (3, 9)], causal=False, softcap=5.0, page_size=8),
    _c("sinks_page64", [(1, 60), (66, 150)], sinks=True, page_size=64, heads=(2, 1)),
    # gpt-oss: sinks on packed decode and verify rows (each row its query head's sink), a window
    _c("sinks_decode_packed_window", [(1, 17), (1, 130), (1, 3)], sinks=True, heads=(8, 2), window=(40, 0),
       pad_rows=1),
    _c("sinks_verify_packed", [(4, 40), (4, 9)], sinks=True, heads=(8, 2), softmax_scale=0.2),
    _c("sinks_decode_packed_split2", [(1, 200), (1, 70)], sinks=True, heads=(8, 2), num_splits=2),  # split 0's sinks
    _c("f16_dv128", [(9, 30), (1, 70)], dtype="float16", head_dim=128, heads=(2, 1)),
    # Head dims other than 64 / 128: 64-byte (96) and 32-byte (80) swizzled tiles; D != Dv (Q and
    # output staging differ); 192 / 128 gets 64-key blocks; a split tile of two warpgroups at
    # D = 192 keeps its Q staging and float32 output in the key and value rings (``kv_staging``).
    _c("d96_prefill_softcap", [(70, 70), (5, 5)], head_dim=96, heads=(2, 1), softcap=4.0),
    _c("d80_packed_tails", [(1, 17), (7, 70)], head_dim=80, pad_rows=1),  # 7 tokens: 4 + a 3-row tail
    _c("d192_v128_extend_window", [(20, 50), (3, 9)], head_dim=192, head_dim_v=128, heads=(2, 1), window=(13, 0)),
    _c("d192_split2_two_wgs", [(70, 90)], head_dim=192, heads=(2, 1), num_splits=2),
    # Head dim 256 (Gemma): Q staging and output buffer in the rings (``kv_staging``), their rows staged as two
    # 128-column chunks (``row_chunk``); 69 rows, so Q goes through the staging buffer.
    _c("d256_prefill_softcap", [(64, 64), (5, 9)], head_dim=256, heads=(2, 1), softcap=30.0),
    # Pages of 1, 2 and 4 rows (SGLang's default is 1): rows gathered one by one (on the GPU by the
    # producer's cp.async copies); shuffled slots, NaN in every unused one.
    _c("page4_prefill_ragged", [(70, 70), (5, 5), (30, 140)], page_size=4, heads=(2, 1), softmax_scale=0.07),
    _c("page2_verify_softcap", [(4, 40), (4, 9)], page_size=2, heads=(8, 2), softcap=6.0),
    # Groups that do not divide the 64-row block (Llama 4's 5, Qwen2.5's 7): 12 / 9 tokens a block, the last
    # 4 / 1 rows hold no query; padding tokens zeroed in whole tokens (300 after the sequences); split-KV's LSE
    # index skips the empty rows; sinks per row
    _c("decode_packed_g5_long_pad", [(1, 17), (1, 130), (1, 3)], heads=(10, 2), pad_tokens=300, softmax_scale=0.09),
    _c("verify_packed_g7_split2_sinks_window", [(4, 90), (3, 9)], heads=(7, 1), num_splits=2, sinks=True,
       window=(50, 0), softcap=8.0),
]
# Head dim 256 on the GPU: the split kernel's float32 output in the rings, packed decode, D != Dv, Gemma's
# window and softcap.
WIDE_GPU_CASES = [
    _c("d256_split2_two_wgs", [(70, 900), (1, 300)], head_dim=256, heads=(2, 1), num_splits=2),
    _c("d256_decode_packed", [(1, 17), (1, 1300), (1, 3)], head_dim=256, heads=(8, 4), pad_rows=1),
    _c("d256_v128_extend", [(40, 500), (3, 9)], head_dim=256, head_dim_v=128, heads=(4, 2)),
    _c("d256_gemma_window_softcap", [(900, 900), (77, 300)], head_dim=256, heads=(16, 8), window=(255, 0),
       softcap=50.0, softmax_scale=0.0625, page_size=16),
]
# More small pages on the GPU only (the interpreter's one TMA copy per page is slow to trace at page 1).
SMALL_PAGE_GPU_CASES = [
    _c("page1_prefill_ragged", [(70, 70), (5, 5), (30, 140)], page_size=1, heads=(2, 1), softmax_scale=0.07),
    _c("page1_decode_packed_window", [(1, 17), (1, 130), (1, 3)], page_size=1, window=(40, 0), pad_rows=1),
    _c("page4_d128_extend", [(9, 75), (1, 70)], page_size=4, head_dim=128, heads=(2, 1)),
    _c("page1_d128_long_prefill", [(700, 700), (33, 1200)], page_size=1, head_dim=128, heads=(4, 1)),
    # wider rows gathered in passes of 256, 128 and 64 columns: MLA's chunked-prefix 192/128, head dim 256
    _c("page1_d192_v128_prefill", [(300, 300), (40, 700), (1, 1)], page_size=1, head_dim=192, head_dim_v=128,
       heads=(4, 4), softmax_scale=0.07),
    _c("page1_d256_extend_softcap", [(90, 600), (7, 7)], page_size=1, head_dim=256, heads=(4, 2), softcap=30.0),
    _c("page2_d192_decode_packed", [(1, 900), (1, 5), (1, 77)], page_size=2, head_dim=192, heads=(8, 2),
       pad_rows=1),
]

INTERPRET = dict(interpret=plgpu.InterpretGPUParams())


@pytest.mark.parametrize("case", MOSAIC_CPU_CASES, ids=lambda c: c.name)
def test_mosaic_interpret(case):
    config = MosaicConfig(block_kv=64 if case.page_size != 64 else 128)
    check_attention(functools.partial(paged_attention_mosaic, config=config, **INTERPRET), case)


def test_pack_for_groups_that_do_not_divide_the_block():
    """Packed rows for every group up to 64 whose sequences' queries fit one 64-row block (a group dividing 64
    as long as ``pack_max_q_len`` allows). Catches a rule that packs a query run spilling into the next block,
    whose rows the kernel would map to the wrong tokens."""
    from jax_attn.kernels.mosaic_paged import pack_for

    assert [pack_for(g, 1) for g in (1, 3, 4, 5, 7, 8, 16, 64, 65)] == [1, 3, 4, 5, 7, 8, 16, 64, 1]
    assert (pack_for(5, 12), pack_for(5, 13), pack_for(7, 9), pack_for(7, 10)) == (5, 1, 7, 1)
    assert (pack_for(16, 16), pack_for(4, 17)) == (16, 1)  # (pack_max_q_len 16)


@pytest.mark.parametrize("name,config", [
    ("prefill_ragged", MosaicConfig(block_kv=64, early_k_wait=False)),
    ("mixed_window", MosaicConfig(block_kv=64, early_k_wait=False)),
    ("decode_packed", MosaicConfig(block_kv=64, solo=False)),
    ("verify_packed", MosaicConfig(block_kv=64, solo=False)),
    ("decode_packed", MosaicConfig(decode_min_ctas=1)),  # the many-sequence decode ring: 64 keys x 4 stages
    ("decode_packed_long_pad", MosaicConfig(block_kv=64, solo=False)),  # each warpgroup zeroes its own rows
], ids=["prefill_late_k", "window_late_k", "decode_paired", "verify_paired", "decode_deep_ring", "long_pad_paired"])
def test_mosaic_config_variants_interpret(name, config):
    """The orders the defaults do not pick for these rows. One-head rows wait for each key block from
    the step before it (``early_k_wait``); here each step waits for its own block, skipped blocks and
    window edges included. Packed decode/verify rows run one compute warpgroup (``solo``); here both,
    the second with no rows, taking turns as prefill tiles do. And the decode ring that calls with
    many programs use (``decode_block_kv`` / ``decode_stages``)."""
    case = next(c for c in MOSAIC_CPU_CASES if c.name == name)
    check_attention(functools.partial(paged_attention_mosaic, config=config, **INTERPRET), case)


def test_mosaic_rejects_what_it_does_not_cover():
    q, k, v, md, _ = build_inputs(dataclasses.replace(MOSAIC_CPU_CASES[0], dtype="float32"))
    assert "bf16 or f16" in supports(q, k, v, md)
    with pytest.raises(NotImplementedError, match="impl='mosaic'"):
        paged_attention_mosaic(q, k, v, md, **INTERPRET)
    q, k, v, md, kw = build_inputs(next(c for c in CPU_CASES if c.fp8))
    assert "fp8 KV" in supports(q, k, v, md, k_descale=kw["k_descale"])
    q, k, v, md, _ = build_inputs(MOSAIC_CPU_CASES[1])
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention_mosaic(q.astype(jnp.bfloat16), k, v, md, num_splits=0, **INTERPRET)


def _covered(case):
    q, k, v, md, kw = build_inputs(case)
    return supports(q, k, v, md, k_descale=kw.get("k_descale")) is None


@gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", [c for c in GPU_CASES + MOSAIC_CPU_CASES + SMALL_PAGE_GPU_CASES + WIDE_GPU_CASES
                                  if _covered(c)],
                         ids=lambda c: c.name)
def test_mosaic_gpu(case):
    check_attention(paged_attention_mosaic, case)


@gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("block_kv,stages", [(64, 2), (64, 4)])  # (128, 3) exceeds shared memory
def test_mosaic_gpu_configs(block_kv, stages):
    case = next(c for c in GPU_CASES if c.name == "mixed")
    check_attention(functools.partial(paged_attention_mosaic, config=MosaicConfig(block_kv=block_kv, stages=stages)),
                    case)


def test_attention_dispatch_runs_mosaic():
    """``attention(impl="mosaic")`` reaches the kernel (interpreted on CPU); ``auto`` picks Triton off Hopper."""
    from jax_attn.attention import attention, call_of
    from jax_attn.kernel_policy import on_hopper, select_kernel

    def choose_impl(impl, q, k, v, md, **kw):
        return select_kernel(impl, call_of(q, k, v, md, **kw))

    case = MOSAIC_CPU_CASES[2]
    check_attention(functools.partial(attention, impl="mosaic"), case)
    q, k, v, md, _ = build_inputs(case)

    assert choose_impl("auto", q, k, v, md) == ("mosaic" if on_hopper() and md.max_q_len > 16 else "triton")
    assert choose_impl("auto", q, k, v, md, num_splits=1) == "triton"  # deterministic mode: one kernel
    with pytest.raises(ValueError, match="must be one of"):
        choose_impl("cuda", q, k, v, md)


def test_auto_rule_on_hopper(monkeypatch):
    """``auto`` on a Hopper GPU (faked): Mosaic for prefill and for decode whose (token, kv head)
    programs fit in one wave; Triton for big decode buckets, decode of a query-head group that does not
    divide the row block (its verify rows Mosaic when they pack), sinks with decode rows, decode at pages
    of 1, 2 and 4 rows (prefill there runs Mosaic), deterministic mode and what the Mosaic kernel does not
    cover."""
    from jax_attn import kernel_policy
    from jax_attn.attention import call_of

    monkeypatch.setattr(kernel_policy, "on_hopper", lambda: True)

    def choose_impl(impl, q, k, v, md, **kw):
        return kernel_policy.select_kernel(impl, call_of(q, k, v, md, **kw))

    def impl(seq_lens, heads=(32, 8), page_size=16, **kw):
        q, k, v, md, _ = build_inputs(Case(name="rule", seq_lens=tuple(seq_lens), heads=heads, head_dim=64,
                                           dtype="bfloat16", page_size=page_size, pad_tokens=0))
        assert md.num_tokens == sum(n for n, _ in seq_lens)
        return choose_impl("auto", q, k, v, md, **kw)

    assert impl([(40, 60)]) == "mosaic"  # prefill / extend
    assert impl([(1, 300)] * 16) == "mosaic"  # 16 tokens x 8 kv heads = 128 programs: one wave
    assert impl([(1, 300)] * 17) == "triton"  # 136 programs
    assert impl([(1, 300)] * 16, heads=(32, 4)) == "mosaic"
    assert impl([(1, 300)] * 4, heads=(40, 8)) == "triton"  # group 5 decode: Triton is faster (H200)
    assert impl([(4, 300)] * 32, heads=(40, 8)) == "mosaic"  # its verify rows: packed, faster, whatever the batch
    assert impl([(4, 300)] * 32, heads=(28, 4)) == "mosaic"  # group 7 alike
    assert impl([(10, 300)] * 2, heads=(28, 4)) == "triton"  # 10 tokens: more than a row block packs (9)
    assert impl([(40, 60)], heads=(40, 8)) == "mosaic"  # prefill rows are one head each anyway
    assert impl([(1, 300)] * 4, sinks=jnp.zeros((32,), jnp.float32)) == "triton"  # covered, but slower there
    assert choose_impl("mosaic", *build_inputs(Case(name="s", seq_lens=((1, 30),), heads=(8, 2), dtype="bfloat16"))[:4],
                       sinks=jnp.zeros((8,), jnp.float32)) == "mosaic"
    assert impl([(40, 60)], sinks=jnp.zeros((32,), jnp.float32)) == "mosaic"
    assert impl([(1, 300)] * 4, page_size=1) == "triton"  # decode at page 1: Triton is faster
    assert impl([(40, 60)], page_size=1) == "mosaic"  # prefill at pages of 1, 2, 4: rows gathered
    assert impl([(40, 60)], page_size=4) == "mosaic"
    assert impl([(40, 60)], page_size=2, heads=(8, 8)) == "mosaic"
    assert impl([(1, 300)] * 4, page_size=2) == "triton"
    q, k, v, md, _ = build_inputs(Case(name="p1", seq_lens=((40, 60),), heads=(32, 8), head_dim=64, dtype="bfloat16",
                                       page_size=1))
    torch_extend, torch_decode = call_of(q, k, v, md), dataclasses.replace(call_of(q, k, v, md), max_q_len=1)
    assert kernel_policy.select_kernel("auto", torch_extend, from_torch=True) == "mosaic"  # the bridge alike
    assert kernel_policy.select_kernel("auto", torch_decode, from_torch=True) == "triton"
    assert kernel_policy.select_kernel("mosaic", torch_decode, from_torch=True) == "mosaic"  # asked for
    # Llama 4 (group 5), Qwen2.5-7B (group 7): decode on Triton, verify rows the Mosaic kernel packs on Mosaic
    for heads, q_len, want in (((40, 8), 1, "triton"), ((40, 8), 4, "mosaic"), ((28, 4), 8, "mosaic"),
                               ((28, 4), 10, "triton"), ((32, 8), 16, "mosaic")):
        grouped = dataclasses.replace(torch_decode, page_size=16, num_q_heads=heads[0], num_kv_heads=heads[1],
                                      max_q_len=q_len)
        assert kernel_policy.select_kernel("auto", grouped, from_torch=True) == want  # the bridge: as the JAX API
        assert kernel_policy.select_kernel("auto", dataclasses.replace(grouped, max_q_len=40), from_torch=True) == (
            "mosaic")  # prefill rows are one head each
    sinks16 = dataclasses.replace(torch_decode, page_size=16, has_sinks=True)
    assert kernel_policy.select_kernel("auto", sinks16, from_torch=True) == "triton"  # packed rows with sinks
    assert kernel_policy.select_kernel("mosaic", sinks16, from_torch=True) == "mosaic"
    assert kernel_policy.select_kernel("auto", dataclasses.replace(torch_extend, head_dim=96, head_dim_v=96),
                                       from_torch=True) == "triton"  # gathered rows: multiples of 64 only
    for d, dv in ((192, 128), (256, 256)):  # MLA's chunked-prefix MHA, Gemma
        assert kernel_policy.select_kernel("auto", dataclasses.replace(torch_extend, head_dim=d, head_dim_v=dv),
                                           from_torch=True) == "mosaic"
    assert impl([(1, 300)] * 4, num_splits=1) == "triton"
    q, k, v, md, _ = build_inputs(Case(name="t0", seq_lens=((1, 300),), heads=(32, 8), head_dim=64, dtype="bfloat16",
                                       page_size=16))
    unknown = dataclasses.replace(call_of(q, k, v, md), num_tokens=0)
    assert not kernel_policy.mosaic_wanted(unknown)  # unknown token count
