"""One entry point for paged attention over every implementation (``impl``).

Which kernel runs is decided in one place, ``jax_attn.kernel_policy`` (its docstring lists the
``impl`` values and ``auto``'s rule); this module builds the call's facts and dispatches.
"""

from __future__ import annotations

from jax_attn.kernel_policy import Call, select_kernel
from jax_attn.metadata import AttentionMetadata
from jax_attn.reference import reference_from_metadata


def call_of(q, k_cache, v_cache, md: AttentionMetadata, **kw) -> Call:
    """The policy's facts about ``attention(q, k_cache, v_cache, md, **kw)``."""
    fp8 = kw.get("k_descale") is not None or kw.get("v_descale") is not None or k_cache.dtype.itemsize == 1
    return Call(max_q_len=md.max_q_len, page_size=md.page_size, num_tokens=q.shape[0], num_kv_heads=k_cache.shape[2],
                head_dim=k_cache.shape[-1], head_dim_v=v_cache.shape[-1], dtype=q.dtype, kv_dtype=k_cache.dtype,
                has_sinks=kw.get("sinks") is not None, fp8_descale=fp8, deterministic=kw.get("num_splits") == 1,
                num_q_heads=q.shape[1])


def attention(q, k_cache, v_cache, md: AttentionMetadata, *, impl: str = "auto", **kw):
    """Paged attention ``q [T, Hq, D]`` over ``k_cache/v_cache [pages, page_size, Hkv, D|Dv]``.

    Keyword arguments are the FA3 feature set shared by every implementation: ``causal``,
    ``window_size``, ``softcap``, ``sinks``, ``k_descale``, ``v_descale``, ``softmax_scale``,
    ``return_lse``, and (kernels only) ``num_splits``, ``config``.
    """
    impl = select_kernel(impl, call_of(q, k_cache, v_cache, md, **kw))
    if impl == "reference":
        kw.pop("num_splits", None)
        kw.pop("config", None)
        return reference_from_metadata(q, k_cache, v_cache, md, **kw)
    if impl == "mosaic":
        from jax_attn.kernels.mosaic_paged import paged_attention_mosaic

        return paged_attention_mosaic(q, k_cache, v_cache, md, **kw)
    from jax_attn.kernels.triton_paged import paged_attention

    return paged_attention(q, k_cache, v_cache, md, **kw)
