"""Shared memory of the Mosaic GPU kernel (``mosaic_kernel``): the swizzled tile layout wgmma reads
for each head dim, the bytes of the kernel's buffers, and the fitting of a call's ring into a
Hopper multiprocessor's 227 KiB (``fit_shared_memory``)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

if TYPE_CHECKING:
    from jax_attn.kernels.mosaic_kernel import KernelStatics


SMEM_BYTES = 227 * 1024  # shared memory one CTA may use on a Hopper multiprocessor


def swizzle_bytes(dim: int, itemsize: int) -> int:
    """The widest wgmma swizzle (128, 64 or 32 bytes) whose row of elements divides ``dim``, the
    minor (contracted or output) dimension of a tile; 0 when none does (not a multiple of 16 bf16s)."""
    return next((b for b in (128, 64, 32) if dim % (b // itemsize) == 0), 0)


def tiled(dim, dtype):  # (untyped: mypy sees the transforms as abstract)
    """The shared-memory layout wgmma reads for rows of ``dim`` elements: 8-row tiles one swizzle
    wide (128 bytes for head dims that are multiples of 64, else 64 or 32)."""
    swizzle = swizzle_bytes(dim, jnp.dtype(dtype).itemsize)
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def smem_bytes(*, wgs: int, block_q: int, block_kv: int, stages: int, head_dim: int, head_dim_v: int,
               itemsize: int, split: bool = False, ring_staging: bool = False, kv_staging: bool = False) -> int:
    """Shared memory of ``kernel_entry``'s buffers (without the interpreter's P staging): Q, the
    key/value ring, the output/Q staging (float32 for the split kernel) and the LSE rows."""
    q = wgs * block_q * head_dim * itemsize
    k_ring = stages * block_kv * head_dim * itemsize
    v_ring = stages * block_kv * head_dim_v * itemsize
    out = wgs * block_q * head_dim_v * (4 if split else itemsize)  # the split kernel's output is float32
    if ring_staging:
        k_ring, staging = max(k_ring, out), q
    elif kv_staging:  # the Q staging and the output share the rings
        k_ring, v_ring, staging = max(k_ring + v_ring, q, out), 0, 0
    else:
        staging = max(q, out)
    return q + k_ring + v_ring + staging + wgs * block_q * 4


def statics_smem_bytes(st: "KernelStatics") -> int:
    if st.latent:  # one Q block, the ring (whole rows, in parts) with both warpgroups' output halves in it, the
        # LSE rows and the leader's hand-off (``mosaic_kernel._latent_buffers``)
        itemsize = jnp.dtype(st.dtype).itemsize
        out = st.block_q * st.head_dim_v * (4 if st.split else itemsize)
        handoff = (st.stages + 1) * st.block_q * 4
        return (st.block_q * st.head_dim * itemsize + max(st.stages * st.block_kv * st.head_dim * itemsize, out)
                + st.active_wgs * st.block_q * 4 + handoff)
    return smem_bytes(wgs=st.active_wgs, block_q=st.block_q, block_kv=st.block_kv, stages=st.stages,
                      head_dim=st.head_dim, head_dim_v=st.head_dim_v, itemsize=jnp.dtype(st.dtype).itemsize,
                      split=st.split, ring_staging=st.ring_staging, kv_staging=st.kv_staging)


def fit_shared_memory(st: KernelStatics) -> KernelStatics:
    """``st`` with its ring made shallower (then its key blocks shorter, 64 at least) until the
    kernel's buffers fit in shared memory (wide head dims). When even the smallest ring does not
    leave room for the staging buffers, a kernel of two warpgroups keeps them in the rings
    (``kv_staging``: the split kernel at head dim 192, every kernel at 256)."""
    def shrink(st):
        while statics_smem_bytes(st) > SMEM_BYTES and (st.stages > 2 or st.block_kv > 64):
            if st.stages > 2:
                st = dataclasses.replace(st, stages=st.stages - 1)
            else:
                st = dataclasses.replace(st, block_kv=st.block_kv - 64)
        return st

    fitted = shrink(st)
    if statics_smem_bytes(fitted) > SMEM_BYTES and not (st.solo or st.latent):
        fitted = shrink(dataclasses.replace(st, kv_staging=True))
    if statics_smem_bytes(fitted) > SMEM_BYTES:
        raise ValueError(f"the Mosaic kernel's buffers ({statics_smem_bytes(fitted)} bytes) exceed {SMEM_BYTES}: {st}")
    return fitted
