"""Split-KV (flash-decoding) for the Mosaic GPU paged attention kernel.

When the (row-view head, work tile) CTAs cannot fill the GPU, as in decode of a few long
sequences, each tile's key blocks are cut into kv splits. The split kernel (``mosaic_kernel``
with ``KernelStatics.num_splits > 1``) runs one CTA per (head, sequence, row block, split): it
writes the split's normalized partial output in float32 and its natural-log LSE (``-inf`` where
the split saw no key). ``merge_splits`` (``merge_state``) then combines the partials of each row
into the output and its LSE, finding each partial's LSE where ``lse_index`` (built once per step
by the planner) says the kernel wrote it: the call is these two kernels. Splits are whole key
blocks of the CTA's causal/window key range, so a split never reads a key block that the unsplit
kernel would skip.

Dimension legend: T tokens, B sequences, Hq query heads, R rows of the row view, H heads of the
row view, Dv value head dim, S kv splits (static bound), N work tiles (static bound).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_attn.kernels.config import DEFAULT_CONFIG, cdiv
from jax_attn.kernels.kernel_cache import mosaic_call
from jax_attn.kernels.merge_state import merge_splits
from jax_attn.kernels.mosaic_kernel import COMPUTE_WGS, KernelStatics, kernel_entry, tile_rows
from jax_attn.metadata import WorkSchedule



def static_num_splits(*, num_splits: int | None, num_tokens: int, max_q_len: int, pack: int, num_heads: int,
                      max_kv_len: int, block_rows: int, max_splits: int, num_sms: int, split_waves: int,
                      min_kv_per_split: int, split_below_fill: int) -> int:
    """Static bound S on kv splits: ``num_splits`` if given, else what the bucket can use.

    The bucket's tiles are estimated as if every token were real (at least one tile per
    sequence, ``ceil(T / max_q_len)`` sequences), each tile running ``num_heads`` CTAs. A CTA
    holds a whole multiprocessor (shared memory), so S is the largest count that keeps the CTAs
    within ``num_sms * split_waves`` (rounded down: a partial last wave costs a whole one), none
    when the unsplit CTAs already fill more than ``1 / split_below_fill`` of the GPU, and
    no split of the longest possible sequence (``max_kv_len``) gets fewer than
    ``min_kv_per_split`` keys. On device, ``build_schedule`` gives each sequence at most S splits
    by its length.
    """
    if num_splits is not None:
        if num_splits < 1:
            raise ValueError(f"{num_splits=} must be >= 1 (or None for the heuristic)")
        return int(num_splits)
    tiles = max(cdiv(num_tokens * pack, block_rows), cdiv(num_tokens, max(max_q_len, 1)), 1)
    if tiles * num_heads * split_below_fill > num_sms:
        return 1  # the unsplit grid fills enough of the GPU: the partials and merge cost more than they gain
    by_sms = (num_sms * split_waves) // (tiles * num_heads)
    return int(max(1, min(max_splits, by_sms, cdiv(max_kv_len, min_kv_per_split))))


def kernel_call_split(st: KernelStatics, num_tiles: int, interpret=None):
    """The split kernel as a function of arrays.

    ``fn`` takes the arguments of ``mosaic_kernel.kernel_call`` and returns the partial outputs
    ``f32[S, T, Hq, Dv]`` (packed rows: ``f32[S, T, Hkv, G, Dv]``, the same memory; rows of splits a
    sequence does not use, and of padding tokens, are not written) and ``lse f32[N, H, 2 * block_q]``
    per tile (``-inf`` for a split with no keys; ``lse_index`` says where each row's value is).
    """
    if not st.split or not st.return_lse:
        raise ValueError(f"{st.num_splits=} must be > 1 and {st.return_lse=} True for the split kernel")
    if interpret is None:  # compiled: built once per process, whatever the call sites (``kernel_cache``)
        return mosaic_call(_pallas_kernel, st, num_tiles, out_shapes=split_out_types(st, num_tiles))
    return _pallas_kernel(st, num_tiles, interpret)


def split_out_types(st: KernelStatics, num_tiles: int):
    """The split kernel's results: the partials ``f32[S, T, Hq, Dv]`` (packed rows: ``[S, T, Hkv, G, Dv]``) and
    the per-tile LSE ``f32[N, H, rows_per_tile]``."""
    part_shape: tuple[int, ...] = (st.num_splits, st.num_rows, st.num_heads, st.head_dim_v)
    if st.token_major:
        part_shape = (st.num_splits, st.num_rows // st.pack, st.num_heads, st.pack, st.head_dim_v)
    return (jax.ShapeDtypeStruct(part_shape, jnp.float32),
            jax.ShapeDtypeStruct((num_tiles, st.num_heads, st.rows_per_tile), jnp.float32))


def _pallas_kernel(st: KernelStatics, num_tiles: int, interpret=None):
    return plgpu.kernel(
        functools.partial(kernel_entry, st, num_tiles),
        out_type=split_out_types(st, num_tiles),
        grid=(st.num_heads, num_tiles),
        grid_names=("heads", "tiles"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        # The row reductions stay within warps (WGMMA layout): the default cross-warp reduction
        # scratch would push the float32 output staging past the 227 KB of shared memory.
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        interpret=interpret,
    )


def lse_index(
    sched: WorkSchedule,
    cu_seqlens_q: jax.Array,  # i32[B + 1]
    *,
    num_tokens: int,
    num_q_heads: int,
    num_heads: int,
    block_q: int,
    latent: bool = False,
) -> jax.Array:
    """``i32[S, T * Hq]``: where the kernel put the LSE of each (kv split, token, query head) in its
    per-tile output ``f32[N, H, 2 * block_q]`` (flattened), ``-1`` where no tile wrote one.

    The kernel writes a tile's LSE in its warpgroups' row order: the row view's order with one head
    per row, token-major within each warpgroup's ``block_q`` rows for packed rows
    (``KernelStatics.token_major``). ``S = sched.max_splits``; an unsplit schedule gives ``S = 1``.
    ``latent``: a latent cache's tiles (one block of rows in q's own order, ``KernelStatics.rows_per_tile``).
    """
    pack, rows_per_tile = sched.pack, tile_rows(block_q, latent)
    n = sched.tile_seq.shape[0]
    pos = stored_rows(block_q, pack, latent)
    seq = jnp.maximum(sched.tile_seq, 0)
    seq_rows = (cu_seqlens_q[seq + 1] - cu_seqlens_q[seq]) * pack
    r = sched.tile_q_block[:, None] * rows_per_tile + jnp.asarray(pos, jnp.int32)[None]  # [N, rows]
    ok = (sched.tile_seq[:, None] >= 0) & (r < seq_rows[:, None])
    row = cu_seqlens_q[seq][:, None] * pack + r
    h = jnp.arange(num_heads, dtype=jnp.int32)[None, :, None]
    out_row = (row // pack)[:, None, :] * num_q_heads + h * pack + (row % pack)[:, None, :]  # [N, H, rows]
    total = sched.max_splits * num_tokens * num_q_heads
    dest = jnp.where(ok[:, None, :], jnp.maximum(sched.tile_split, 0)[:, None, None] * (num_tokens * num_q_heads)
                     + out_row, total)
    src = jnp.arange(n * num_heads * rows_per_tile, dtype=jnp.int32)
    index = jnp.full((total,), -1, jnp.int32).at[dest.reshape(-1)].set(src, mode="drop")
    return index.reshape(sched.max_splits, num_tokens * num_q_heads)


def stored_rows(block_q: int, pack: int, latent: bool = False) -> np.ndarray:
    """``i64[rows_per_tile]``: the row of the row view (within its tile) whose LSE the kernel stores at each
    position of a tile's LSE output. Packed rows (``KernelStatics.token_major``) are stored token-major within
    each warpgroup's ``block_q`` rows; positions from ``pack * tokens_per_block`` on hold no row and get
    ``1 << 30`` (past every row). Other rows (a latent cache's included) are stored in their own order."""
    pos = np.arange(tile_rows(block_q, latent))
    if pack == 1 or latent:
        return pos
    tpb = block_q // pack
    in_block = pos % block_q
    return np.where(in_block < pack * tpb, (pos // block_q) * block_q + (in_block % tpb) * pack + in_block // tpb,
                    1 << 30)


def merge_partials(
    part_o: jax.Array,  # f32[S, T, Hq, Dv] (or its packed-row view [S, T, Hkv, G, Dv])
    lse_tiles: jax.Array,  # f32[N, H, rows_per_tile]
    index: jax.Array,  # i32[S, T * Hq] (``lse_index``)
    *,
    out_dtype,
    interpret: bool,
):
    """Merges the split kernel's partials: ``out [T, Hq, Dv]`` in ``out_dtype`` and ``lse f32[T, Hq]``
    (padding tokens: zeros and ``-inf``)."""
    s, t, dv = part_o.shape[0], part_o.shape[1], part_o.shape[-1]
    out, lse = merge_splits(part_o.reshape(s, -1, dv), lse_tiles.reshape(-1), lse_index=index,
                            out_dtype=out_dtype, config=DEFAULT_CONFIG, interpret=interpret)
    return out.reshape(t, -1, dv), lse.reshape(t, -1)
