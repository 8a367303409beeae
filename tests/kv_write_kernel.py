"""KV-cache write as a Mosaic GPU kernel (SGLang's ``set_kv_buffer`` for one layer).

One CTA per new token: TMA-load the token's ``[Hkv, D]`` key row and ``[Hkv, Dv]`` value row
into shared memory, then TMA-store them into slot ``slots[t]`` of the pools. A slot outside
``[0, num_slots)`` is skipped (its stores are skipped); slot 0 is a real, reserved slot
that padded tokens write into, as in SGLang.

The pools are passed to the kernel as mutable refs, so the lowered call aliases each pool to an
output (``output_operand_aliases``): under ``jax.jit`` with the pools donated the write is in
place, and ``torch_bridge.launcher`` launches the same kernel on torch-owned pools.

Dimension legend: T new tokens, S pool slots, H kv heads, D key head dim, Dv value head dim.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_attn.kv_cache import KVPool, set_kv_buffer

# A TMA box holds at most 256 elements along any dimension: longer rows are copied in chunks.
_TMA_MAX_BOX = 256
# TMA needs every row of a box (and every global stride) to be a multiple of 16 bytes.
_TMA_ALIGN_BYTES = 16
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn, jnp.float8_e5m2)


def _row_chunks(width: int, itemsize: int) -> tuple[tuple[int, int], ...]:
    """Split a row of ``width`` elements into ``(start, size)`` chunks a TMA box can hold."""
    if (width * itemsize) % _TMA_ALIGN_BYTES:
        raise ValueError(
            f"head dim {width} x {itemsize} bytes is not a multiple of {_TMA_ALIGN_BYTES} bytes, "
            "which TMA copies need: pad the head dim, or use jax_attn.kv_cache.set_kv_buffer"
        )
    n = -(-width // _TMA_MAX_BOX)
    while width % n or ((width // n) * itemsize) % _TMA_ALIGN_BYTES:
        n += 1
    size = width // n
    return tuple((i * size, size) for i in range(n))


def _check_inputs(k_new, v_new, slots, k_pool, v_pool) -> None:
    if k_new.ndim != 3 or v_new.ndim != 3 or k_pool.ndim != 3 or v_pool.ndim != 3:
        raise ValueError(
            f"{k_new.shape=} {v_new.shape=} {k_pool.shape=} {v_pool.shape=} must be [T, H, D], "
            "[T, H, Dv], [S, H, D], [S, H, Dv]: pass one layer's pool (index a stacked pool first)"
        )
    if k_new.shape[1:] != k_pool.shape[1:] or v_new.shape[1:] != v_pool.shape[1:]:
        raise ValueError(f"{k_new.shape=} / {v_new.shape=} must match the pools' rows {k_pool.shape=} {v_pool.shape=}")
    if k_new.shape[0] != v_new.shape[0] or slots.shape != (k_new.shape[0],):
        raise ValueError(f"{slots.shape=}, {k_new.shape=}, {v_new.shape=} must share the token count T")
    if k_pool.shape[0] != v_pool.shape[0]:
        raise ValueError(f"{k_pool.shape=} and {v_pool.shape=} must have the same number of slots")
    if slots.dtype != jnp.int32:
        raise ValueError(f"{slots.dtype=} must be int32 (convert once per step, not per layer)")
    for name, new, pool in (("k", k_new, k_pool), ("v", v_new, v_pool)):
        if new.dtype != pool.dtype:
            raise ValueError(
                f"{name}_new.dtype={new.dtype} must equal the pool's {pool.dtype}: cast (and scale fp8) "
                "before the write, or use jax_attn.kv_cache.set_kv_buffer"
            )
        if jnp.dtype(pool.dtype) not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
            raise ValueError(f"{name}_pool.dtype={pool.dtype} is not one of {SUPPORTED_DTYPES}")
    if k_pool.shape[1] > _TMA_MAX_BOX:
        raise ValueError(f"{k_pool.shape[1]=} kv heads exceed the TMA box limit {_TMA_MAX_BOX}")


def _kernel_body(k_chunks, v_chunks, num_slots,
                 k_new, v_new, slots, k_pool, v_pool,  # refs: [T,H,D] [T,H,Dv] i32[T] [S,H,D] [S,H,Dv]
                 k_smem, v_smem, barriers):
    t = jax.lax.axis_index("t")
    slot = slots[t]
    valid = (slot >= 0) & (slot < num_slots)
    dst = jnp.clip(slot, 0, num_slots - 1)  # keeps every address in range
    copies = [(k_new, k_pool, k_smem, c, k_chunks[c]) for c in range(len(k_chunks))]
    copies += [(v_new, v_pool, v_smem, c, v_chunks[c]) for c in range(len(v_chunks))]

    for i, (src, _, smem, c, (start, size)) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src.at[t, :, pl.ds(start, size)], smem.at[c], barriers.at[i])
    for i in range(len(copies)):
        plgpu.barrier_wait(barriers.at[i])

    @pl.when(valid)
    def _store():
        for _, pool, smem, c, (start, size) in copies:
            plgpu.copy_smem_to_gmem(smem.at[c], pool.at[dst, :, pl.ds(start, size)])
        plgpu.wait_smem_to_gmem(0)  # the SMEM rows must outlive the stores


def _build_kernel(tokens: int, num_slots: int, heads: int, k_dtype, v_dtype,
                  k_chunks, v_chunks, interpret):
    k_width, v_width = k_chunks[0][1], v_chunks[0][1]
    scratch: list[Any] = [
        plgpu.SMEM((len(k_chunks), heads, k_width), k_dtype),
        plgpu.SMEM((len(v_chunks), heads, v_width), v_dtype),
        plgpu.Barrier(num_arrivals=1, num_barriers=len(k_chunks) + len(v_chunks)),
    ]
    return plgpu.kernel(
        functools.partial(_kernel_body, k_chunks, v_chunks, num_slots),
        out_type=(),
        grid=(tokens,),
        grid_names=("t",),
        scratch_types=scratch,
        interpret=interpret,
        kernel_name="kv_write",
    )


def write_kv(
    k_new: jax.Array,  # [T, H, D]
    v_new: jax.Array,  # [T, H, Dv]
    slots: jax.Array,  # i32[T]
    k_pool: jax.Array,  # [S, H, D]
    v_pool: jax.Array,  # [S, H, Dv]
    *,
    interpret: Optional[bool] = None,
) -> tuple[jax.Array, jax.Array]:
    """Write token ``t``'s key and value rows into slot ``slots[t]`` of the pools.

    Same result as ``jax_attn.kv_cache.set_kv_buffer`` for non-fp8-scaled writes: slots outside
    ``[0, S)`` write nothing, slot 0 (reserved, used by padded tokens) is written. When several
    tokens target one slot, one of them wins (padding only does that, on slot 0).

    Args:
      k_new, v_new: the new rows, already in the pools' dtypes (bf16, f16, f32 or fp8).
      slots: destination slot per token.
      k_pool, v_pool: one layer's pools. In place under ``jax.jit`` when donated.
      interpret: run the Mosaic GPU interpreter; None = only when JAX's backend is the CPU.

    Returns:
      ``(k_pool, v_pool)`` with the rows written.
    """
    _check_inputs(k_new, v_new, slots, k_pool, v_pool)
    if interpret is None:
        interpret = jax.default_backend() == "cpu"
    num_slots, heads = k_pool.shape[0], k_pool.shape[1]
    k_chunks = _row_chunks(k_pool.shape[2], jnp.dtype(k_pool.dtype).itemsize)
    v_chunks = _row_chunks(v_pool.shape[2], jnp.dtype(v_pool.dtype).itemsize)
    if k_new.shape[0] == 0:
        return k_pool, v_pool
    kernel = _build_kernel(
        k_new.shape[0], num_slots, heads, k_pool.dtype, v_pool.dtype, k_chunks, v_chunks,
        plgpu.InterpretGPUParams() if interpret else None,
    )
    k_ref, v_ref = jax.new_ref(k_pool), jax.new_ref(v_pool)
    kernel(k_new, v_new, slots, k_ref, v_ref)
    return jax.freeze(k_ref), jax.freeze(v_ref)


def write_kv_reference(
    k_new: jax.Array,  # [T, H, D]
    v_new: jax.Array,  # [T, H, Dv]
    slots: jax.Array,  # i32[T]
    k_pool: jax.Array,  # [S, H, D]
    v_pool: jax.Array,  # [S, H, Dv]
) -> tuple[jax.Array, jax.Array]:
    """Plain-``jnp`` reference of ``write_kv`` (``set_kv_buffer`` on one layer's pool)."""
    pool = set_kv_buffer(KVPool(k_pool, v_pool), slots, k_new, v_new)
    return pool.k, pool.v
