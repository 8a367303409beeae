"""Merging partial attention results over disjoint key sets (Pallas kernels, Triton lowering).

A partial result is ``(o, lse)``: the softmax-weighted values over its keys and the natural-log
sum of their exponentiated logits. An empty partial has ``lse = -inf`` and merges as a no-op;
when every partial is empty the result is ``o = 0``, ``lse = -inf``. A NaN partial (NaN in its
queries or keys) gives NaN. Any head dim: a block is the next power of 2 of D wide, its padded
columns neither read nor written.

Dimension legend: T tokens, H heads, D head dim, S partials, R = T * H rows.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_attn.kernels.config import DEFAULT_CONFIG, KernelConfig, interpret_default, next_pow2

_NEG_INF = float("-inf")


def block_cols(dim: int, width: int | None = None):
    """Columns of a block ``width`` wide (default: the next power of 2 of ``dim``, as Triton block
    shapes need) over a ``dim``-column ref: ``(cols i32[width], ok bool[width] or None)``. Columns
    past ``dim`` must be masked by ``ok`` (None when the block is not padded). They are left as
    they are, not clamped: a clamp would hide from Triton that the columns are contiguous (no
    vector loads), and a store to a repeated column may win over the real one in the interpreter,
    which clamps out-of-range reads and drops out-of-range writes itself."""
    width = next_pow2(dim) if width is None else width
    if width < dim:
        raise ValueError(f"block {width=} must cover the ref's {dim} columns")
    cols = jnp.arange(width, dtype=jnp.int32)
    if width == dim:
        return cols, None
    return cols, cols < dim


def _block_mask(ok, col_ok, shape):
    """bool[shape] from a row mask and a column mask (either may be None); None when both are."""
    if ok is None and col_ok is None:
        return None
    if col_ok is None:
        return jnp.broadcast_to(ok[:, None], shape)
    if ok is None:
        return jnp.broadcast_to(col_ok[None, :], shape)
    return ok[:, None] & col_ok[None, :]


def load_rows(ref, rows, ok, other=0, width: int | None = None, col0: int = 0, dim: int | None = None):
    """Gathers ``ref[rows, col0:col0 + dim]`` -> [len(rows), width]; rows where ``ok`` is False read
    ``other``.

    ``ok=None`` reads every row; ``other=None`` leaves masked elements undefined. ``width``: the
    block's columns (``block_cols``); columns past ``dim`` (default: the rest of the row) are not
    read and hold ``other``. ``rows`` must be in range even where ``ok`` is False.
    """
    cols, col_ok = block_cols(ref.shape[1] - col0 if dim is None else dim, width)
    at = ref.at[rows[:, None], (cols if col0 == 0 else cols + col0)[None, :]]
    mask = _block_mask(ok, col_ok, (rows.shape[0], cols.shape[0]))
    if mask is None:
        return plgpu.load(at)
    if other is None:  # masked elements are undefined
        return plgpu.load(at, mask=mask)
    return plgpu.load(at, mask=mask, other=other)


def store_rows(ref, rows, ok, val):
    """Scatters ``val [len(rows), width]`` into ``ref[rows, :]`` where ``ok``; other rows, and
    columns past ``ref.shape[1]`` (a padded block, ``block_cols``), write nothing."""
    cols, col_ok = block_cols(ref.shape[1], val.shape[1])
    rows = jnp.where(ok, rows, ref.shape[0])  # out of range: dropped by the interpreter too
    mask = _block_mask(ok, col_ok, val.shape)
    plgpu.store(ref.at[rows[:, None], cols[None, :]], val, mask=mask)


def store_vec(ref, idx, ok, val):
    """Scatters ``val`` into ``ref[idx]`` where ``ok``."""
    plgpu.store(ref.at[jnp.where(ok, idx, ref.shape[0])], val, mask=ok)


def merge_rows(parts, block_rows: int, dim: int):
    """Online merge of ``parts``: callables returning (o f32[BR, D], lse f32[BR]); rows whose parts are all
    empty give (0, -inf), a NaN part stays NaN."""
    acc = jnp.zeros((block_rows, dim), jnp.float32)
    m = jnp.full((block_rows,), _NEG_INF, jnp.float32)
    tot = jnp.zeros((block_rows,), jnp.float32)
    for load in parts:
        o_s, lse_s = load()
        m_new = jnp.maximum(m, lse_s)
        m_use = jnp.where(m_new == _NEG_INF, 0.0, m_new)
        alpha = jnp.exp(m - m_use)
        w = jnp.exp(lse_s - m_use)
        acc = acc * alpha[:, None] + jnp.where(w[:, None] != 0.0, o_s * w[:, None], 0.0)  # NaN stays NaN
        tot = tot * alpha + w
        m = m_new
    m_use = jnp.where(m == _NEG_INF, 0.0, m)
    ok = tot != 0.0
    safe = jnp.where(ok, tot, 1.0)
    out = jnp.where(ok[:, None], acc / safe[:, None], 0.0)
    lse = jnp.where(ok, m_use + jnp.log(safe), _NEG_INF)
    return out, lse


def partial_rows(o_ref, lse_ref, index_ref, rows, ok, width: int | None = None):
    """A loader of one partial result at ``rows`` (for ``merge_rows``): ``o_ref [R, D]`` and its natural-log LSE,
    ``lse_ref [R]``, or with ``index_ref`` (i32[R]) at ``lse_ref[index_ref[row]]`` (-1: empty). Rows where ``ok``
    is False read an empty partial."""
    def load():
        if index_ref is None:
            lse_s = plgpu.load(lse_ref.at[rows], mask=ok, other=_NEG_INF)
        else:
            at = plgpu.load(index_ref.at[rows], mask=ok, other=-1)
            valid = at >= 0
            lse_s = plgpu.load(lse_ref.at[jnp.maximum(at, 0)], mask=valid, other=_NEG_INF)
        return load_rows(o_ref, rows, ok, width=width).astype(jnp.float32), lse_s.astype(jnp.float32)
    return load


def _row_block(block_rows: int, num_rows: int):
    rows = pl.program_id(0) * block_rows + jnp.arange(block_rows, dtype=jnp.int32)
    ok = rows < num_rows
    return jnp.where(ok, rows, 0), ok


def _split_lse(sel_refs, plse_ref, rows, sp, ok, ns, *, num_rows: int, num_splits: int, indexed: bool):
    """``(valid, lse)`` of kv split(s) ``sp`` for ``rows`` (broadcast together): partials ``[0, ns)`` of each row
    (``_row_splits``; split ``s``'s LSE at ``s * R + row``), or with ``indexed`` those at the LSE positions per
    ``(split, row)`` in ``sel_refs[0]``, ``-1`` for none (``ns`` unused)."""
    in_range = ok & (sp < num_splits)
    if indexed:
        at = plgpu.load(sel_refs[0].at[jnp.where(in_range, rows + sp * num_rows, 0)], mask=in_range, other=-1)
        valid = at >= 0
        return valid, plgpu.load(plse_ref.at[jnp.maximum(at, 0)], mask=valid, other=_NEG_INF)
    # Every split's slot is read whether the row has that split or not, so the load does not wait for the
    # row's split count; slots past the count (never written: any bits) are then dropped.
    raw = plgpu.load(plse_ref.at[jnp.where(in_range, rows + sp * num_rows, 0)], mask=in_range, other=_NEG_INF)
    valid = in_range & (sp < ns)
    return valid, jnp.where(valid, raw, _NEG_INF)


def _row_splits(sel_refs, rows, ok, indexed: bool, num_heads: int):
    """Each row's split count, or None with ``indexed`` selectors: row ``t * H + h``'s token ``t`` belongs to the
    sequence whose query offsets (``sel_refs[0]``, ``cu_seqlens_q`` i32[B + 1]) hold it, and gets that sequence's
    count (``sel_refs[1]``, i32[B]); a padding token (past the last sequence) gets 0."""
    if indexed:
        return None
    cu_ref, splits_ref = sel_refs
    b = splits_ref.shape[0]
    ends = jnp.arange(next_pow2(b), dtype=jnp.int32) + 1  # cu_seqlens_q[1:], padded with never-reached ends
    ends = plgpu.load(cu_ref.at[jnp.minimum(ends, b)], mask=ends <= b, other=jnp.iinfo(jnp.int32).max)
    token = rows // num_heads
    seq = jnp.sum((ends[None, :] <= token[:, None]).astype(jnp.int32), axis=1)  # sequence ends at or before it
    real = ok & (seq < b)
    return plgpu.load(splits_ref.at[jnp.where(real, seq, 0)], mask=real, other=0)


def _splits_kernel(po_ref, plse_ref, *refs, num_splits: int, num_rows: int, block_rows: int, indexed: bool,
                   num_heads: int):
    """Two passes: the max and the sum over every split's LSE at once, then a weighted sum of the
    partial outputs whose loads do not wait on one another."""
    *sel_refs, o_ref, lse_ref = refs
    rows, ok = _row_block(block_rows, num_rows)
    ns = _row_splits(sel_refs, rows, ok, indexed, num_heads)
    split_lse = functools.partial(_split_lse, sel_refs, plse_ref, num_rows=num_rows, num_splits=num_splits,
                                  indexed=indexed)
    sp = jnp.arange(next_pow2(num_splits), dtype=jnp.int32)[:, None]
    _, lse_all = split_lse(rows[None, :], sp, ok[None, :], None if ns is None else ns[None, :])  # [S_pad, BR]
    m = jnp.max(lse_all, axis=0)
    m_use = jnp.where(m == _NEG_INF, 0.0, m)
    tot = jnp.sum(jnp.exp(lse_all - m_use[None, :]), axis=0)
    acc = jnp.zeros((block_rows, next_pow2(po_ref.shape[-1])), jnp.float32)
    for s in range(num_splits):
        valid_s, lse_s = split_lse(rows, s, ok, ns)
        w = jnp.exp(lse_s - m_use)
        # Read whether the row has split s or not (w is 0 where it has not), so the load waits for no count.
        o_s = load_rows(po_ref, rows + s * num_rows, ok, 0.0).astype(jnp.float32)
        # Empty partials (w == 0) may hold garbage; a NaN partial (NaN LSE, so NaN w) stays NaN.
        acc = acc + jnp.where(w[:, None] != 0.0, o_s * w[:, None], 0.0)
    nonempty = tot != 0.0  # NaN from a partial stays NaN
    safe = jnp.where(nonempty, tot, 1.0)
    out = jnp.where(nonempty[:, None], acc / safe[:, None], 0.0)
    store_rows(o_ref, rows, ok, out.astype(o_ref.dtype))
    store_vec(lse_ref, rows, ok, jnp.where(nonempty, m_use + jnp.log(safe), _NEG_INF))


def _splits_row_kernel(po_ref, plse_ref, *refs, num_splits: int, num_rows: int, indexed: bool, num_heads: int):
    """One row per program, every split's partial loaded at once as one ``[S_pad, D]`` block: the
    loads do not queue behind one another, so a merge of many splits costs about one load latency."""
    *sel_refs, o_ref, lse_ref = refs
    row = pl.program_id(0)
    sp = jnp.arange(next_pow2(num_splits), dtype=jnp.int32)
    rows = jnp.full_like(sp, row)
    ns = _row_splits(sel_refs, rows, sp >= 0, indexed, num_heads)
    _, lse_all = _split_lse(sel_refs, plse_ref, rows, sp, sp >= 0, ns, num_rows=num_rows, num_splits=num_splits,
                            indexed=indexed)
    # Every split's partial row is loaded unmasked (split indices clamped into range), so this load
    # does not wait for the LSE loads; partials that are not valid get weight 0 below.
    o_all = load_rows(po_ref, row + jnp.minimum(sp, num_splits - 1) * num_rows, None).astype(jnp.float32)
    m = jnp.max(lse_all)
    m_use = jnp.where(m == _NEG_INF, 0.0, m)
    w = jnp.exp(lse_all - m_use)  # 0 for splits past the row's count
    acc = jnp.sum(jnp.where(w[:, None] != 0.0, o_all * w[:, None], 0.0), axis=0)  # as in _splits_kernel
    tot = jnp.sum(w)
    nonempty = tot != 0.0
    safe = jnp.where(nonempty, tot, 1.0)
    out = jnp.where(nonempty, acc / safe, 0.0)
    cols, col_ok = block_cols(o_ref.shape[1])
    plgpu.store(o_ref.at[row, cols], out.astype(o_ref.dtype), mask=col_ok)
    plgpu.store(lse_ref.at[jnp.full((1,), row, jnp.int32)],
                jnp.full((1,), jnp.where(nonempty, m_use + jnp.log(safe), _NEG_INF), jnp.float32))


ROW_MERGE_MAX_ELEMENTS = 64 * 128  # f32 elements of one row's partials that one program loads at once


# Jitted: every call site with the same shapes shares one traced pallas_call, lowered once per
# executable (not once per layer).
@functools.partial(jax.jit, static_argnames=("num_heads", "out_dtype", "config", "interpret"))
def merge_splits(
    partial_o,  # f32[S, R, D]
    partial_lse,  # f32[S, R], or with lse_index any flat f32[M]
    seq_splits=None,  # (cu_seqlens_q i32[B + 1], seq_num_splits i32[B]), with num_heads: R = T * H rows
    *,
    num_heads: int = 0,  # H, with seq_splits
    lse_index=None,  # i32[S, R]; instead of seq_splits: partial (s, r)'s LSE is partial_lse[lse_index[s, r]], -1 = none
    out_dtype,
    config: KernelConfig = DEFAULT_CONFIG,
    interpret: bool = False,
):
    """Merges kv-split partials (``paged_attention``'s, the Mosaic split kernel's); rows with no
    valid partial give (0, -inf). With ``seq_splits``, row ``t * H + h`` merges partials ``[0, n)``, ``n`` the
    split count of the sequence that holds token ``t``; tokens past the last sequence are padding."""
    s, r, d = partial_o.shape
    if (seq_splits is None) == (lse_index is None):
        raise ValueError("pass exactly one of seq_splits ((cu_seqlens_q, seq_num_splits)) and lse_index (i32[S, R])")
    indexed = lse_index is not None
    if not indexed and (num_heads < 1 or r % num_heads):
        raise ValueError(f"{num_heads=} must divide the {r} rows (token-major: R = T * H) with seq_splits")
    sels = [lse_index.reshape(-1).astype(jnp.int32)] if indexed else [a.astype(jnp.int32) for a in seq_splits]
    # Few rows (one long sequence) get few rows per program, so the merge still spans the SMs.
    br = min(config.merge_block_rows, next_pow2(pl.cdiv(r, config.num_sms)))
    if br == 1 and next_pow2(s) * next_pow2(d) <= ROW_MERGE_MAX_ELEMENTS:
        kernel = functools.partial(_splits_row_kernel, num_splits=s, num_rows=r, indexed=indexed, num_heads=num_heads)
        warps = config.merge_row_num_warps
    else:
        kernel = functools.partial(_splits_kernel, num_splits=s, num_rows=r, block_rows=br, indexed=indexed,
                                   num_heads=num_heads)
        warps = config.merge_num_warps
    return pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((r, d), out_dtype), jax.ShapeDtypeStruct((r,), jnp.float32)],
        grid=(pl.cdiv(r, br),),
        compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
        interpret=interpret,
        name="merge_splits",
    )(partial_o.reshape(s * r, d), partial_lse.reshape(-1), *sels)


def _pair_kernel(*refs, num_rows: int, block_rows: int, indexed: bool):
    if indexed:  # row r's LSE of part a at la_ref[ia_ref[r]] (-1: an empty partial)
        oa_ref, la_ref, ia_ref, ob_ref, lb_ref, o_ref, lse_ref = refs
    else:
        (oa_ref, la_ref, ob_ref, lb_ref, o_ref, lse_ref), ia_ref = refs, None
    rows, ok = _row_block(block_rows, num_rows)

    out, lse = merge_rows([partial_rows(oa_ref, la_ref, ia_ref, rows, ok), partial_rows(ob_ref, lb_ref, None, rows, ok)],
                          block_rows, next_pow2(o_ref.shape[-1]))
    store_rows(o_ref, rows, ok, out.astype(o_ref.dtype))
    store_vec(lse_ref, rows, ok, lse)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def merge_state(
    o_a,  # [T, H, D]
    lse_a,  # f32[T, H]
    o_b,  # [T, H, D]
    lse_b,  # f32[T, H]
    *,
    lse_a_index=None,  # i32[T, H]: row (t, h)'s LSE of part a at lse_a.reshape(-1)[index], -1 = none
    config: KernelConfig | None = None,
    interpret: bool | None = None,
):
    """Merges two partial attention results over disjoint key sets (SGLang's ``merge_state``).

    Args:
      o_a, o_b: partial outputs, same shape and dtype.
      lse_a, lse_b: their natural-log softmax denominators; ``-inf`` marks an empty partial.
      lse_a_index: ``lse_a`` is then any flat f32 array holding part a's LSE where this index says (the
        Mosaic kernel's per-tile LSE and its ``lse_index``); ``-1`` marks an empty partial.
      config: ``merge_block_rows`` / ``merge_num_warps`` are used.
      interpret: run the Pallas interpreter; None = only on CPU.

    Returns:
      ``(o [T, H, D] in o_a.dtype, lse f32[T, H])``.
    """
    config = DEFAULT_CONFIG if config is None else config
    if interpret is None:
        interpret = interpret_default()
    if o_a.ndim != 3 or o_a.shape != o_b.shape or o_a.dtype != o_b.dtype:
        raise ValueError(f"{o_a.shape=} {o_a.dtype=} and {o_b.shape=} {o_b.dtype=} must match and be [T, H, D]")
    indexed = lse_a_index is not None
    a_shape = lse_a_index.shape if indexed else lse_a.shape  # lse_a: any flat array with an index
    if a_shape != o_a.shape[:2] or lse_b.shape != o_a.shape[:2]:
        raise ValueError(f"{a_shape=} (lse_a, or lse_a_index with one) and {lse_b.shape=} must be "
                         f"{o_a.shape[:2]} ([T, H], e.g. softmax_lse.T)")
    t, h, d = o_a.shape
    r = t * h
    br = config.merge_block_rows
    kernel = functools.partial(_pair_kernel, num_rows=r, block_rows=br, indexed=indexed)
    part_a = [o_a.reshape(r, d), lse_a.reshape(-1).astype(jnp.float32)]
    if indexed:
        part_a.append(lse_a_index.reshape(r).astype(jnp.int32))
    o, lse = pl.pallas_call(
        kernel,
        out_shape=[jax.ShapeDtypeStruct((r, d), o_a.dtype), jax.ShapeDtypeStruct((r,), jnp.float32)],
        grid=(max(1, pl.cdiv(r, br)),),
        compiler_params=plgpu.CompilerParams(num_warps=config.merge_num_warps, num_stages=1),
        interpret=interpret,
        name="merge_state",
    )(*part_a, o_b.reshape(r, d), lse_b.reshape(r).astype(jnp.float32))
    return o.reshape(t, h, d), lse.reshape(t, h)
