"""One entry point for paged attention over every implementation (``impl``).

Which kernel runs is decided in one place, ``jax_attn.kernel_policy`` (its docstring lists the
``impl`` values and ``auto``'s rule); this module builds the call's facts and dispatches.
"""

from __future__ import annotations

import dataclasses

from jax_attn.kernel_policy import VARLEN_PAGE, Call, select_kernel, varlen_repaged
from jax_attn.metadata import AttentionMetadata, ForwardMode
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
    absorbed MLA over one latent cache (both kernels; ``mosaic_paged.latent_unsupported`` says what the
    Mosaic kernel takes).
    """
    impl = select_kernel(impl, call_of(q, k_cache, v_cache, md, **kw))
    if impl == "reference":
        kw.pop("num_splits", None)
        kw.pop("config", None)
        latent = kw.pop("latent_dim", None)
        if v_cache is None:
            v_cache = k_cache[..., :latent]
        return reference_from_metadata(q, k_cache, v_cache, md, **kw)
    if impl == "mosaic":
        from jax_attn.kernels.mosaic_paged import paged_attention_mosaic

        return paged_attention_mosaic(q, k_cache, v_cache, md, **kw)
    from jax_attn.kernels.triton_paged import paged_attention

    return paged_attention(q, k_cache, v_cache, md, **kw)


def varlen_metadata(cu_seqlens_q, cu_seqlens_k, *, num_tokens: int, num_keys: int, max_seqlen_q: int,
                    max_seqlen_k: int) -> AttentionMetadata:
    """FA3's ``flash_attn_varlen_func`` batch (queries and keys in contiguous ragged runs, no cache) as
    a paged call: page size 1 over the keys themselves, ``page_table[b, j] = cu_seqlens_k[b] + j``.
    ``max_seqlen_*`` are static bounds (a new value compiles anew)."""
    import jax.numpy as jnp

    cu_q, cu_k = jnp.asarray(cu_seqlens_q, jnp.int32), jnp.asarray(cu_seqlens_k, jnp.int32)
    lens = cu_k[1:] - cu_k[:-1]
    cols = jnp.arange(max(max_seqlen_k, 1), dtype=jnp.int32)
    table = jnp.clip(cu_k[:-1, None] + cols[None, :], 0, max(num_keys - 1, 0))
    return AttentionMetadata(
        cache_seqlens=lens, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, page_table=table,
        out_cache_loc=jnp.zeros((num_tokens,), jnp.int32), max_seqlen_q=jnp.max(cu_q[1:] - cu_q[:-1]),
        max_seqlen_k=jnp.max(lens), mode=ForwardMode.EXTEND, batch_size=int(cu_q.shape[0]) - 1,
        num_tokens=num_tokens, page_size=1, max_q_len=max(max_seqlen_q, 1), max_pages=max(max_seqlen_k, 1))


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q: int, max_seqlen_k: int,
                     impl: str = "auto", **kw):
    """``flash_attn_varlen_func``: ``q [Tq, Hq, D]`` over ``k [Tk, Hkv, D]`` / ``v [Tk, Hkv, Dv]`` in
    ragged runs (``cu_seqlens_q`` / ``cu_seqlens_k``, i32[B + 1]); bottom-right causal when ``causal``.
    The keys are pages of one row, or (``kernel_policy.varlen_repaged``: prefill on the Mosaic kernel) copied
    into pages of ``VARLEN_PAGE`` rows first (``varlen_pages``).
    Keyword arguments as ``attention`` (``causal``, ``softmax_scale``, ``return_lse``, ...). MLA's
    chunked-prefix prefill runs its 192 / 128 multi-head chunks through it."""
    md = varlen_metadata(cu_seqlens_q, cu_seqlens_k, num_tokens=q.shape[0], num_keys=k.shape[0],
                         max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k)
    if varlen_repaged(impl, call_of(q, k[:, None], v[:, None], md, **kw)):
        return attention(q, *varlen_pages(k, v, md, VARLEN_PAGE), impl=impl, **kw)
    return attention(q, k[:, None], v[:, None], md, impl=impl, **kw)


def varlen_pages(k, v, md: AttentionMetadata, page_size: int):
    """A varlen call's keys (``md``: ``varlen_metadata``'s) copied into a paged pool: sequence ``b``'s rows
    from the start of its own page on, each sequence padded to whole pages (rows after a sequence's end hold
    some key, masked). Returns ``(k_pages, v_pages, md)``: pools ``[P, page_size, Hkv, D|Dv]``, with ``P`` the
    static bound ``ceil(Tk / page_size) + B``, and the call's metadata over them."""
    import jax.numpy as jnp

    b, lens = md.batch_size, md.cache_seqlens
    first = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum((lens + page_size - 1) // page_size)])
    num_pages = -(-k.shape[0] // page_size) + b
    page = jnp.arange(num_pages, dtype=jnp.int32)
    # each page's sequence: how many sequences end at or before it (a compare, not a search loop: one fusion)
    seq = jnp.minimum(jnp.sum(first[None, 1:] <= page[:, None], axis=1, dtype=jnp.int32), b - 1)
    seq = jnp.repeat(seq, page_size)
    offset = jnp.arange(num_pages * page_size, dtype=jnp.int32) - first[seq] * page_size
    src = jnp.where(offset < lens[seq], md.cu_seqlens_k[seq] + offset, 0)
    max_pages = -(-md.max_pages // page_size)
    table = jnp.minimum(first[:-1, None] + jnp.arange(max_pages, dtype=jnp.int32)[None, :], num_pages - 1)
    pages = [x[src].reshape((num_pages, page_size) + x.shape[1:]) for x in (k, v)]
    return (*pages, dataclasses.replace(md, page_table=table, page_size=page_size, max_pages=max_pages))
