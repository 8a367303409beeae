"""One entry point for paged attention over every implementation (``impl``).

``impl``:
  ``"auto"``      per call: the Mosaic GPU kernel on Hopper GPUs for prefill/extend and for decode
                  of few tokens (``mosaic_wanted``) when it covers the call (bf16/f16, head dim
                  64/128, page size a multiple of 8, no fp8 descale, no sinks with decode rows,
                  not deterministic mode), else the Triton-lowered kernel (interpret mode on CPU);
  ``"triton"``    the Pallas kernel lowered through Triton (any page size, every feature);
  ``"mosaic"``    the Pallas Mosaic GPU kernel for Hopper (raises ``NotImplementedError`` for what
                  it does not cover: see ``jax_attn.kernels.mosaic_paged.supports``);
  ``"reference"`` the plain-``jnp`` float32 reference.
"""

from __future__ import annotations

import functools

import jax

from jax_attn.metadata import AttentionMetadata
from jax_attn.reference import reference_from_metadata

IMPLS = ("auto", "triton", "mosaic", "reference")
_HOPPER = ("H100", "H200", "H800", "H20", "GH200")


def resolve_impl(impl: str) -> str:
    """Check ``impl``; ``auto`` stays ``auto`` (each call picks a kernel, see ``choose_impl``)."""
    if impl not in IMPLS:
        raise ValueError(f"{impl=} must be one of {IMPLS}")
    return impl


@functools.cache
def on_hopper() -> bool:
    """Whether the default device is a Hopper GPU (the Mosaic kernel's target)."""
    dev = jax.devices()[0]
    return dev.platform == "gpu" and any(name in dev.device_kind for name in _HOPPER)


def mosaic_wanted(md: AttentionMetadata, *, num_kv_heads: int | None = None, num_tokens: int | None = None,
                  deterministic: bool = False) -> bool:
    """``auto``'s static rule: Mosaic on Hopper for query runs longer than the packed-decode bound,
    and for decode (short query runs) whose (token, kv head) programs fit in one wave of the GPU
    (``num_tokens``: the padded token count, default ``md.num_tokens``; unknown counts stay on Triton).

    On an H100 (page 16, 32/8 heads, benchmarks/RESULTS.md) the Mosaic kernel is ahead of the
    Triton one at 1 x 32768 (split decode) and 8 x 8192, about level at 64 x 4096 and behind at
    256 x 1024: decode buckets of many tokens stay on Triton. Deterministic mode keeps one kernel
    for every batch (bitwise batch invariance).
    """
    from jax_attn.kernels.mosaic_paged import DEFAULT_MOSAIC_CONFIG as config

    if deterministic or not on_hopper() or md.page_size % 8:
        return False
    if md.max_q_len > config.pack_max_q_len:
        return True
    num_tokens = md.num_tokens if num_tokens is None else num_tokens
    return num_kv_heads is not None and 0 < num_tokens * num_kv_heads <= config.num_sms


def choose_impl(impl: str, q, k_cache, v_cache, md: AttentionMetadata, **kw) -> str:
    """The concrete implementation a call runs with."""
    impl = resolve_impl(impl)
    if impl != "auto":
        return impl
    if not mosaic_wanted(md, num_kv_heads=k_cache.shape[2], num_tokens=q.shape[0],
                         deterministic=kw.get("num_splits") == 1):
        return "triton"
    from jax_attn.kernels.mosaic_paged import DEFAULT_MOSAIC_CONFIG, supports

    if kw.get("sinks") is not None and md.max_q_len <= DEFAULT_MOSAIC_CONFIG.pack_max_q_len:
        return "triton"  # sinks with packed decode rows are not in the Mosaic kernel
    covered = supports(q, k_cache, v_cache, md, k_descale=kw.get("k_descale"), v_descale=kw.get("v_descale"))
    return "mosaic" if covered is None else "triton"


def attention(q, k_cache, v_cache, md: AttentionMetadata, *, impl: str = "auto", **kw):
    """Paged attention ``q [T, Hq, D]`` over ``k_cache/v_cache [pages, page_size, Hkv, D|Dv]``.

    Keyword arguments are the FA3 feature set shared by every implementation: ``causal``,
    ``window_size``, ``softcap``, ``sinks``, ``k_descale``, ``v_descale``, ``softmax_scale``,
    ``return_lse``, and (kernels only) ``num_splits``, ``config``.
    """
    impl = choose_impl(impl, q, k_cache, v_cache, md, **kw)
    if impl == "reference":
        kw.pop("num_splits", None)
        kw.pop("config", None)
        return reference_from_metadata(q, k_cache, v_cache, md, **kw)
    if impl == "mosaic":
        from jax_attn.kernels.mosaic_paged import paged_attention_mosaic

        return paged_attention_mosaic(q, k_cache, v_cache, md, **kw)
    from jax_attn.kernels.triton_paged import paged_attention

    return paged_attention(q, k_cache, v_cache, md, **kw)
