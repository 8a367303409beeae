"""One entry point for paged attention over every implementation (``impl``).

``impl``:
  ``"auto"``      the Pallas kernel (compiled on GPU, interpret mode on CPU);
  ``"triton"``    the Pallas kernel lowered through Triton (any page size);
  ``"mosaic"``    the Mosaic GPU kernel for Hopper (not built yet: raises NotImplementedError);
  ``"reference"`` the plain-``jnp`` float32 reference.
"""

from __future__ import annotations

from jax_attn.metadata import AttentionMetadata
from jax_attn.reference import reference_from_metadata

IMPLS = ("auto", "triton", "mosaic", "reference")


def resolve_impl(impl: str) -> str:
    """Map ``auto`` to a concrete implementation for the default device."""
    if impl not in IMPLS:
        raise ValueError(f"{impl=} must be one of {IMPLS}")
    if impl == "mosaic":
        raise NotImplementedError(
            "impl='mosaic' (Pallas Mosaic GPU kernels for Hopper) is not implemented yet; "
            "use impl='triton' or 'auto'"
        )
    return "triton" if impl == "auto" else impl


def attention(q, k_cache, v_cache, md: AttentionMetadata, *, impl: str = "auto", **kw):
    """Paged attention ``q [T, Hq, D]`` over ``k_cache/v_cache [pages, page_size, Hkv, D|Dv]``.

    Keyword arguments are the FA3 feature set shared by every implementation: ``causal``,
    ``window_size``, ``softcap``, ``sinks``, ``k_descale``, ``v_descale``, ``softmax_scale``,
    ``return_lse``, and (kernels only) ``num_splits``, ``config``.
    """
    impl = resolve_impl(impl)
    if impl == "reference":
        kw.pop("num_splits", None)
        kw.pop("config", None)
        return reference_from_metadata(q, k_cache, v_cache, md, **kw)
    from jax_attn.kernels.triton_paged import paged_attention

    return paged_attention(q, k_cache, v_cache, md, **kw)
