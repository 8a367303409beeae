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
    dv = kw.get("latent_dim") if v_cache is None else v_cache.shape[-1]
    return Call(max_q_len=md.max_q_len, page_size=md.page_size, num_tokens=q.shape[0], num_kv_heads=k_cache.shape[2],
                head_dim=k_cache.shape[-1], head_dim_v=dv, dtype=q.dtype, kv_dtype=k_cache.dtype,
                has_sinks=kw.get("sinks") is not None, fp8_descale=fp8, deterministic=kw.get("num_splits") == 1,
                num_q_heads=q.shape[1], latent=v_cache is None)


def attention(q, k_cache, v_cache, md: AttentionMetadata, *, impl: str = "auto", **kw):
    """Paged attention ``q [T, Hq, D]`` over ``k_cache/v_cache [pages, page_size, Hkv, D|Dv]``.

    Keyword arguments are the FA3 feature set shared by every implementation: ``causal``,
    ``window_size``, ``softcap``, ``sinks``, ``k_descale``, ``v_descale``, ``softmax_scale``,
    ``return_lse``, and (kernels only) ``num_splits``, ``config``. ``v_cache=None`` with ``latent_dim``:
    absorbed MLA over one latent cache (``triton_paged.paged_attention``); the Mosaic kernel does not
    take it.
    """
    impl = select_kernel(impl, call_of(q, k_cache, v_cache, md, **kw))
    if impl == "reference":
        kw.pop("num_splits", None)
        kw.pop("config", None)
        latent = kw.pop("latent_dim", None)
        if v_cache is None:
            v_cache = k_cache[..., :latent]
        return reference_from_metadata(q, k_cache, v_cache, md, **kw)
    if impl == "mosaic" and v_cache is None:
        raise NotImplementedError("impl='mosaic': a latent (MLA) cache (v_cache=None) is not in the Mosaic kernel; "
                                  "use impl='triton' (or 'auto')")
    if impl == "mosaic":
        from jax_attn.kernels.mosaic_paged import paged_attention_mosaic

        return paged_attention_mosaic(q, k_cache, v_cache, md, **kw)
    from jax_attn.kernels.triton_paged import paged_attention

    return paged_attention(q, k_cache, v_cache, md, **kw)
