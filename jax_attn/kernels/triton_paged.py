"""Ragged paged attention: a Pallas kernel lowered through Triton (any page size, GQA, split-KV).

Each program handles one kv head and one work tile (sequence, query block, kv split) from a
``WorkSchedule``. Its M rows are (query token, query head of this kv head) pairs, so grouped
query heads share every key block. Query rows are gathered from ``q`` seen as ``[T * Hq, D]``;
key rows from the cache seen as ``[num_slots * Hkv, D]`` through the page table, one row per key,
which works for any page size including 1.

Head dims: any multiple of 8 up to 256 (and any power of 2 >= 16). A head dim that is not a power of
2 >= 16 (80, 96, 112, 192, ...) computes in a block of the next one (``head_dim_block``): q, k and v
loads mask the padded columns (q and k read 0 there, so the logits are exact), and the output store
skips them. The caches are read in place, never padded or copied; the padded columns cost FLOPs
(80 computes as 128), not bytes.

Without splits, programs after the tiles write the padding tokens' rows (zeros, LSE -inf), so no output is
initialized before the launch; split-KV tiles write float32 partials that ``merge_state.merge_splits``
combines (its padding rows too).

A split-KV decode launch may pack C kv heads into one program (``KernelConfig.split_kv_heads``):
its rows are then the query heads of all C kv heads, each loop step gathers the C adjacent rows
of every key (one contiguous read per key), and a logit whose key row belongs to another kv head
than its query row is masked out.

Dimension legend:
  T query tokens, B sequences, P page-table width, Hq / Hkv query / kv heads, G = Hq // Hkv,
  D / Dv key / value head dims (Dp / Dvp their blocks, ``head_dim_block``), S kv splits (static bound),
  N work tiles (static bound), M tile rows, R = T * Hq output rows, C kv heads per program.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_attn.kernels.config import (DEFAULT_CONFIG, KernelConfig, interpret_default, kv_heads_per_program,
                                      next_pow2, tile_rows)
from jax_attn.kernels.merge_state import (block_cols, load_rows, merge_rows, merge_splits, partial_rows, store_rows,
                                          store_vec)
from jax_attn.kernels.schedule import plan_schedule
from jax_attn.metadata import AttentionMetadata

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
_NEG_INF = float("-inf")
MAX_PADDED_HEAD_DIM = 256  # head dims that are not powers of 2 are taken up to this
PAD_PROGRAMS = 8  # programs per grid column that zero the padding tokens' rows (``_pad_rows``)


def head_dim_block(d: int) -> int:
    """The block width a head dim computes in: the next power of 2, at least 16 (Triton's dot)."""
    return max(16, next_pow2(d))


def unsupported(dtype, head_dim: int, head_dim_v: int, latent: bool = False) -> str | None:
    """The Triton-lowered kernel's dtype and head-dim rules: ``None`` when they hold, else the reason.

    Head dims: multiples of 8 up to 256, or powers of 2 >= 16 (K and V may differ); padded inside
    the kernel (``head_dim_block``). Any page size, GQA group, fp8 KV with descale. ``latent`` (MLA):
    a key row is the value row (``head_dim_v`` columns) then the rope part (the rest): each part
    follows the head-dim rule (DeepSeek: 512 + 64)."""
    parts = (("head_dim", head_dim), ("head_dim_v", head_dim_v))
    if latent:
        if not 0 < head_dim_v < head_dim:
            return f"latent (MLA) cache: {head_dim_v=} must be below {head_dim=} (the rope part is the rest)"
        parts = (("the latent part (head_dim_v)", head_dim_v), ("the rope part", head_dim - head_dim_v))
    for name, d in parts:
        pow2 = d >= 16 and d & (d - 1) == 0
        if not (pow2 or (d > 0 and d % 8 == 0 and d <= MAX_PADDED_HEAD_DIM)):
            return (f"{name}={d}: the Triton-lowered kernel takes head dims that are multiples of 8 up to "
                    f"{MAX_PADDED_HEAD_DIM}, or powers of 2 >= 16")
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16, jnp.float32):
        return f"q dtype {jnp.dtype(dtype)}: the Triton-lowered kernel takes bfloat16, float16 or float32"
    return None


@dataclasses.dataclass(frozen=True)
class _Static:
    """Trace-time constants of one kernel instance."""

    num_tokens: int  # T
    num_q_heads: int  # Hq
    num_kv_heads: int  # Hkv
    head_dim: int  # D
    head_dim_v: int  # Dv
    page_size: int
    max_pages: int  # P
    block_q: int
    block_k: int
    rows: int  # M
    kv_pack: int  # C, kv heads per program
    prefetch_pages: bool  # read the next step's page ids one step ahead
    split_mode: bool
    causal: bool
    window: tuple[int, int]
    softcap: float
    scale: float
    has_sinks: bool
    has_k_descale: bool
    has_v_descale: bool
    compute_dtype: jnp.dtype  # dtype of the dot operands
    fast_exp2: bool  # ex2.approx through inline PTX (compiled GPU kernels only)
    fp8_kv: bool  # 1-byte caches: masked loads get no fill value (Triton cannot cast one)
    latent: bool = False  # MLA: V is the first Dv columns of each key row; the rest is the rope part
    head_split: int = 1  # H, programs per (kv head, tile), each with 1/H of the query-head group (kv_pack 1)
    # a prior partial result over other keys merged into each row's (no splits): 0 none; 1 its LSE per row; 2 its
    # LSE through a row index (the Mosaic kernel's per-tile LSE). Its output is the aliased output's initial value.
    prior: int = 0

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def d_block(self) -> int:  # Dp
        return head_dim_block(self.head_dim)

    @property
    def dv_block(self) -> int:  # Dvp
        return head_dim_block(self.head_dim_v)

    @property
    def rope_block(self) -> int:  # latent (MLA) caches: the block of a key row's rope part
        return head_dim_block(self.head_dim - self.head_dim_v)

    @property
    def programs(self) -> int:
        """Programs per tile: the grid's first dimension (kv heads, or packs of them, times ``head_split``)."""
        return self.num_kv_heads // self.kv_pack * self.head_split

    @property
    def pad_programs(self) -> int:
        """Programs per grid column after the tiles that write the padding tokens' rows (zeros, LSE -inf); none
        with a prior partial, whose rows no tile writes keep the prior's values, or with splits (the merge's)."""
        return 0 if self.prior or self.split_mode else min(-(-self.num_tokens // self.block_q), PAD_PROGRAMS)


def _kv_range(st: _Static, q_len, k_len, q_block):
    """[lo, hi) keys any row of the tile may see; lo aligned down to block_k."""
    first = q_block * st.block_q  # first query of the tile within its sequence
    last = jnp.minimum(first + st.block_q, q_len) - 1
    shift = k_len - q_len  # qpos = shift + query index
    left, right = st.window
    hi = k_len
    if st.causal:
        hi = jnp.minimum(hi, shift + last + 1)
    if right >= 0:
        hi = jnp.minimum(hi, shift + last + right + 1)
    lo = jnp.int32(0)
    if left >= 0:
        lo = jnp.maximum(shift + first - left, 0)
        lo = (lo // st.block_k) * st.block_k
    return lo, hi


def _split_range(st: _Static, lo, hi, split, num_splits):
    """This split's share [s_lo, s_hi) of [lo, hi), in whole key blocks."""
    span = jnp.maximum(hi - lo, 0)
    per = (span + num_splits - 1) // num_splits
    chunk = ((per + st.block_k - 1) // st.block_k) * st.block_k
    s_lo = lo + split * chunk
    s_hi = jnp.minimum(hi, s_lo + chunk)
    return s_lo, s_hi


def _visible(st: _Static, keys, s_hi, qpos):
    """bool[M, block_k] mask of keys each row sees."""
    ok = (keys < s_hi)[None, :]
    left, right = st.window
    kp = keys[None, :]
    qp = qpos[:, None]
    if st.causal:
        ok = ok & (kp <= qp)
    if left >= 0:
        ok = ok & (kp >= qp - left)
    if right >= 0:
        ok = ok & (kp <= qp + right)
    return ok


def _exp2(x, fast: bool):
    if not fast:
        return jnp.exp2(x)
    [y] = plgpu.elementwise_inline_asm(
        "ex2.approx.ftz.f32 $0, $1;", args=[x], constraints="=f,f", pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )
    return y


def _dot(a, b, *, trans_b=False):
    precision = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return plgpu.dot(a, b, trans_b=trans_b, precision=precision)


def _attn_kernel(*refs, st: _Static, num_tiles: int):
    """One (kv head, tile) program: online softmax over the tile's key range; programs past ``num_tiles`` write
    the padding tokens' rows (``_pad_rows``)."""
    (tile_seq_ref, tile_qb_ref, tile_split_ref, seq_splits_ref, seqlens_ref, cu_q_ref, pt_ref,
     q_ref, k_ref, v_ref, *rest) = refs
    kd_ref = rest.pop(0) if st.has_k_descale else None
    vd_ref = rest.pop(0) if st.has_v_descale else None
    sinks_ref = rest.pop(0) if st.has_sinks else None
    prior_lse_ref = rest.pop(0) if st.prior else None
    prior_index_ref = rest.pop(0) if st.prior == 2 else None
    if st.prior:
        rest = rest[2:]  # the aliased output initial values (the prior's)
    o_ref, lse_ref = rest  # with splits: the partials

    h = pl.program_id(0) // st.head_split * st.kv_pack  # first kv head of this program
    part = pl.program_id(0) % st.head_split  # which part of the query-head group
    n = pl.program_id(1)
    seq = tile_seq_ref[jnp.minimum(n, num_tiles - 1)]

    @pl.when((n < num_tiles) & (seq >= 0))
    def _():
        _attn_tile(st, h, part, n, seq, tile_qb_ref, tile_split_ref, seq_splits_ref, seqlens_ref, cu_q_ref,
                   pt_ref, q_ref, k_ref, v_ref, kd_ref, vd_ref, sinks_ref, o_ref, lse_ref,
                   (prior_lse_ref, prior_index_ref))

    if st.pad_programs:
        pl.when(n >= num_tiles)(lambda: _pad_rows(st, h, part, n - num_tiles, cu_q_ref, o_ref, lse_ref))


def _tile_rows(st: _Static, h, part, first_token):
    """A tile's rows from its first token, each row's (token, token index within the tile, query head, kv head
    relative to ``h``), i32[M] each."""
    g_part = st.group // st.head_split  # query heads of a kv head in this program
    heads_per_tok = g_part * st.kv_pack
    rows = jnp.arange(st.rows, dtype=jnp.int32)
    tok_in_tile, slot = rows // heads_per_tok, rows % heads_per_tok
    return first_token + tok_in_tile, tok_in_tile, h * st.group + part * g_part + slot, slot // g_part


def _pad_rows(st: _Static, h, part, p, cu_q_ref, o_ref, lse_ref):
    """Pad program ``p``: zeros and LSE -inf into the rows of the padding tokens (from ``cu_seqlens_q[B]`` on)
    among every ``pad_programs``-th ``block_q`` tokens from its ``p``-th."""
    real = cu_q_ref[cu_q_ref.shape[0] - 1]  # tokens of real sequences
    chunks, step = -(-st.num_tokens // st.block_q), st.pad_programs
    first = real // st.block_q  # the first chunk holding a padding token
    i_lo = jnp.where(first > p, (first - p + step - 1) // step, 0)

    def body(i, carry):
        token, tok_in_tile, head, _ = _tile_rows(st, h, part, (p + i * step) * st.block_q)
        ok = (tok_in_tile < st.block_q) & (token >= real) & (token < st.num_tokens)
        row = jnp.where(ok, token * st.num_q_heads + head, 0)
        store_rows(o_ref, row, ok, jnp.zeros((st.rows, st.dv_block), o_ref.dtype))
        store_vec(lse_ref, row, ok, jnp.full((st.rows,), _NEG_INF, jnp.float32))
        return carry

    lax.fori_loop(i_lo, (chunks - p + step - 1) // step, body, 0)


def _attn_tile(st, h, part, n, b, tile_qb_ref, tile_split_ref, seq_splits_ref, seqlens_ref, cu_q_ref,
               pt_ref, q_ref, k_ref, v_ref, kd_ref, vd_ref, sinks_ref, o_ref, lse_ref, prior_refs):
    hq, hkv = st.num_q_heads, st.num_kv_heads
    q_block = tile_qb_ref[n]
    split = tile_split_ref[n]
    q_start = cu_q_ref[b]
    q_len = cu_q_ref[b + 1] - q_start
    k_len = jnp.minimum(seqlens_ref[b], st.max_pages * st.page_size)  # never past the page table

    token, tok_in_tile, head, row_kvh = _tile_rows(st, h, part, q_start + q_block * st.block_q)
    q_idx = q_block * st.block_q + tok_in_tile  # query index within the sequence
    row_ok = (tok_in_tile < st.block_q) & (q_idx < q_len) & (token < st.num_tokens)
    q_row = jnp.where(row_ok, token * hq + head, 0)
    shift = k_len - q_len  # qpos = shift + query index (bottom-right aligned)
    if st.latent:  # (the latent part [M, Dvp], the rope part [M, rope block])
        q = tuple(load_rows(q_ref, q_row, row_ok, width=w, col0=c0, dim=dim).astype(st.compute_dtype)
                  for w, c0, dim in _latent_parts(st))
    else:
        q = load_rows(q_ref, q_row, row_ok, width=st.d_block).astype(st.compute_dtype)  # [M, Dp]; 0 past D

    lo, hi = _kv_range(st, q_len, k_len, q_block)
    s_lo, s_hi = _split_range(st, lo, hi, split, seq_splits_ref[b])
    first = shift + q_block * st.block_q
    last = shift + jnp.minimum(q_block * st.block_q + st.block_q, q_len) - 1
    bounds = _block_bounds(st, s_lo, s_hi, first, last)

    k_scale = st.scale  # natural-log domain; LOG2E is applied after the softcap
    if st.has_k_descale:
        k_scale = k_scale * _head_descale(st, kd_ref, b * hkv + h, row_kvh)
    kv = (pt_ref, k_ref, v_ref, b, h)
    acc, m, l = _key_loop(st, q, shift + q_idx, row_kvh, kv, k_scale, s_lo, s_hi, bounds)

    sink = None
    if st.has_sinks:
        sink = jnp.where(split == 0, plgpu.load(sinks_ref.at[head]) * LOG2E, _NEG_INF)
    v_scale = _head_descale(st, vd_ref, b * hkv + h, row_kvh) if st.has_v_descale else None
    out, lse = _finish(acc, m, l, sink, v_scale)
    out_row = q_row
    if st.split_mode:
        out_row = q_row + split * (st.num_tokens * hq)
    if st.prior:  # the prior partial (written in o_ref before this launch) first, as merge_state(prior, this)
        prior = partial_rows(o_ref, prior_refs[0], prior_refs[1], out_row, row_ok, width=st.dv_block)
        out, lse = merge_rows([prior, lambda: (out, lse)], st.rows, st.dv_block)
    store_rows(o_ref, out_row, row_ok, out.astype(o_ref.dtype))
    store_vec(lse_ref, out_row, row_ok, lse)


def _latent_parts(st: _Static):
    """(block width, first column, columns) of a latent row's two parts: the latent (the value row)
    and the rope part."""
    dv = st.head_dim_v
    return ((st.dv_block, 0, dv), (st.rope_block, dv, st.head_dim - dv))


def _head_descale(st: _Static, ref, first, row_kvh):
    """Descale of the program's kv head (scalar), or of each row's kv head (f32[M]) when packed."""
    if st.kv_pack == 1:
        return ref[first]
    return plgpu.load(ref.at[first + row_kvh])


def _per_row(x):
    """Broadcasts a per-row factor (f32[M]) against [M, columns]; scalars pass through."""
    return x[:, None] if jnp.ndim(x) == 1 else x


def _block_bounds(st: _Static, s_lo, s_hi, first_qpos, last_qpos):
    """Key-block indices (i_lo, i_hi, n): blocks [i_lo, i_hi) need no mask for any row of the tile."""
    bk = st.block_k
    left, right = st.window
    n = jnp.maximum((s_hi - s_lo + bk - 1) // bk, 0)
    i_lo = jnp.int32(0)
    if left >= 0:
        i_lo = (jnp.maximum(last_qpos - left - s_lo, 0) + bk - 1) // bk
    bound = s_hi
    if st.causal:
        bound = jnp.minimum(bound, first_qpos + 1)
    if right >= 0:
        bound = jnp.minimum(bound, first_qpos + right + 1)
    i_lo = jnp.minimum(i_lo, n)
    i_hi = jnp.clip(jnp.maximum(bound - s_lo, 0) // bk, i_lo, n)
    return i_lo, i_hi, n


def _key_loop(st: _Static, q, qpos, row_kvh, kv, k_scale, s_lo, s_hi, bounds):
    """Online softmax (base 2) over key blocks; returns (acc f32[M, Dv], m f32[M], l f32[M]).

    A step covers ``block_k`` keys; with C packed kv heads its column ``j`` is key ``j // C`` of
    kv head ``h + j % C``.
    """
    pt_ref, k_ref, v_ref, b, h = kv
    ps, hkv, bk, pack = st.page_size, st.num_kv_heads, st.block_k, st.kv_pack
    cols = jnp.arange(bk * pack, dtype=jnp.int32)
    koffs, col_head, own_head = cols, h, None  # key of each column (relative to the step), its kv head
    if pack > 1:  # a row only sees the columns of its own kv head
        koffs, col_head = cols // pack, h + cols % pack
        own_head = (cols % pack)[None, :] == row_kvh[:, None]  # bool[M, block_k * C]

    def page_ids(keys, ok):  # i32[block_k * C]; 0 where not ok
        return plgpu.load(pt_ref.at[jnp.where(ok, b * st.max_pages + keys // ps, 0)], mask=ok, other=0)

    num_pages = k_ref.shape[0] // (ps * hkv)
    fill = None if st.fp8_kv else 0
    _, k_col_ok = block_cols(st.head_dim, st.d_block)

    def load_kv(page, keys, kv_ok):  # k [block_k * C, Dp], v [block_k * C, Dvp]; 0 past D / Dv (not fp8)
        page = jnp.clip(page, 0, num_pages - 1)  # a bad page id reads a page of the pool, never past it
        kv_row = (page * ps + keys % ps) * hkv + col_head
        if kv_ok is not None:
            kv_row = jnp.where(kv_ok, kv_row, 0)
        if st.latent:  # one read of the row: the latent part is the value row too
            k = tuple(load_rows(k_ref, kv_row, kv_ok, fill, width=w, col0=c0, dim=dim)
                      for w, c0, dim in _latent_parts(st))
            return k, k[0]
        return (load_rows(k_ref, kv_row, kv_ok, fill, width=st.d_block),
                load_rows(v_ref, kv_row, kv_ok, fill, width=st.dv_block))

    def make_body(masked: bool):
        def body(it, carry):
            acc, m, l, *ahead = carry
            keys = s_lo + it * bk + koffs
            kv_ok = keys < s_hi if masked else None
            if st.prefetch_pages:  # this step's page ids came with the carry; read the next step's
                page, ahead = ahead[0], [page_ids(keys + bk, keys + bk < s_hi)]
            elif masked:
                page = page_ids(keys, kv_ok)
            else:
                page = plgpu.load(pt_ref.at[b * st.max_pages + keys // ps])
            k, v = load_kv(page, keys, kv_ok)
            if st.latent:  # scores over both parts: q_latent . c_kv + q_rope . k_rope
                s = sum(_dot(qp, kp.astype(st.compute_dtype), trans_b=True) for qp, kp in zip(q, k))
            else:
                k = k.astype(st.compute_dtype)
                if st.fp8_kv and k_col_ok is not None:  # fp8 masked loads have no fill value
                    k = jnp.where(k_col_ok[None, :], k, 0)  # padded columns: 0 * garbage could be NaN
                s = _dot(q, k, trans_b=True)  # [M, block_k * C] f32
            if st.softcap > 0:
                s = jnp.tanh(s * _per_row(k_scale / st.softcap)) * (st.softcap * LOG2E)
                c = 1.0
            else:
                c = k_scale * LOG2E  # folded into the exponent: exp2(s * c - m)
            seen = _visible(st, keys, s_hi, qpos) if masked else None
            if own_head is not None:
                seen = own_head if seen is None else seen & own_head
            if seen is not None:
                s = jnp.where(seen, s, _NEG_INF)
            m_new = jnp.maximum(m, jnp.max(s, axis=1) * c)
            m_use = jnp.where(m_new == _NEG_INF, 0.0, m_new) if masked else m_new
            alpha = _exp2(m - m_use, st.fast_exp2)
            p = _exp2(s * _per_row(c) - m_use[:, None], st.fast_exp2)
            l = l * alpha + jnp.sum(p, axis=1)
            v = v.astype(st.compute_dtype)
            if masked and kv_ok is not None and st.fp8_kv:
                v = jnp.where(kv_ok[:, None], v, 0)  # fp8 masked loads have no fill value
            acc = acc * alpha[:, None] + _dot(p.astype(st.compute_dtype), v)
            return (acc, m_new, l, *ahead)
        return body

    i_lo, i_hi, n = bounds
    carry: tuple = (jnp.zeros((st.rows, st.dv_block), jnp.float32),  # padded columns are never stored
             jnp.full((st.rows,), _NEG_INF, jnp.float32),
             jnp.zeros((st.rows,), jnp.float32))
    if st.prefetch_pages:  # the three loops walk consecutive blocks, so the carried ids stay in step
        carry += (page_ids(s_lo + koffs, s_lo + koffs < s_hi),)
    carry = lax.fori_loop(0, i_lo, make_body(True), carry)
    carry = lax.fori_loop(i_lo, i_hi, make_body(False), carry)
    return lax.fori_loop(i_hi, n, make_body(True), carry)[:3]


def _finish(acc, m, l, sink, v_scale):
    """Adds the sink to the denominator, normalizes; returns (out f32[M, Dv], natural lse f32[M])."""
    if sink is not None:
        m_fin = jnp.maximum(m, sink)
        m_use = jnp.where(m_fin == _NEG_INF, 0.0, m_fin)
        alpha = jnp.exp2(m - m_use)
        l = l * alpha + jnp.exp2(sink - m_use)
        acc = acc * alpha[:, None]
        m = m_fin
    m_use = jnp.where(m == _NEG_INF, 0.0, m)
    nonempty = l != 0.0  # NaN (from q or a visible key) stays NaN, as in FA3
    safe = jnp.where(nonempty, l, 1.0)
    inv = jnp.where(nonempty, 1.0 / safe, 0.0)
    if v_scale is not None:
        inv = inv * v_scale
    lse = jnp.where(nonempty, (m_use + jnp.log2(safe)) * LN2, _NEG_INF)
    return acc * inv[:, None], lse


def _check_inputs(q, k_cache, v_cache, md: AttentionMetadata, sinks, latent_dim=None):
    if v_cache is None:  # an MLA latent cache: values are the first latent_dim columns of each key row
        if latent_dim is None:
            raise ValueError("v_cache=None (an MLA latent cache) needs latent_dim, the value columns of a key row")
        if k_cache.dtype.itemsize == 1:
            raise NotImplementedError("an fp8 latent (MLA) cache is not supported by the Triton-lowered kernel")
        v_cache = jax.ShapeDtypeStruct(k_cache.shape[:3] + (latent_dim,), k_cache.dtype)
    elif latent_dim is not None:
        raise ValueError(f"{latent_dim=} is for v_cache=None (an MLA latent cache)")
    if q.ndim != 3 or k_cache.ndim != 4 or v_cache.ndim != 4:
        raise ValueError(
            f"{q.shape=} must be [T, Hq, D] and {k_cache.shape=}, {v_cache.shape=} must be "
            "[num_pages, page_size, Hkv, D]; reshape a [num_slots, Hkv, D] pool to [num_slots // page_size, ...]"
        )
    num_pages, ps, hkv, d = k_cache.shape
    if v_cache.shape[:3] != (num_pages, ps, hkv):
        raise ValueError(f"{v_cache.shape=} must match {k_cache.shape=} except the last dim")
    if q.shape[2] != d:
        raise ValueError(f"{q.shape=} head dim must equal {k_cache.shape=}[-1]")
    if q.shape[1] % hkv:
        raise ValueError(f"{q.shape[1]=} query heads must be a multiple of {hkv=} kv heads")
    if ps != md.page_size:
        raise ValueError(f"{k_cache.shape=} has page size {ps}, metadata says {md.page_size}")
    b = md.cache_seqlens.shape[0]
    if md.cu_seqlens_q.shape != (b + 1,) or md.page_table.ndim != 2 or md.page_table.shape[0] != b:
        raise ValueError(f"{md.cu_seqlens_q.shape=} / {md.page_table.shape=} disagree with {b=} sequences")
    for name in ("cache_seqlens", "cu_seqlens_q", "page_table"):
        if getattr(md, name).dtype != jnp.int32:
            raise ValueError(f"md.{name} must be int32, got {getattr(md, name).dtype}; cast with .astype(jnp.int32)")
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"{sinks.shape=} must be ({q.shape[1]},), one logit per query head")
    reason = unsupported(q.dtype, d, v_cache.shape[-1], latent=latent_dim is not None)
    if reason is not None:
        raise ValueError(f"{q.shape=}, {v_cache.shape=}: {reason}")


def _check_scale(softmax_scale):
    if softmax_scale is not None and not softmax_scale > 0:
        raise ValueError(f"{softmax_scale=} must be > 0 (the kernel folds it into exp2 of the max)")


def run_tiles(st: _Static, num_tiles: int, max_splits: int, inputs, out_dtype, knobs, interpret: bool,
              init=None):
    """The attention pallas_call over its operands (tables, q rows, K/V rows, descales, sinks, with ``st.prior``
    the prior partial's LSE and its index): ``(o [R or S*R, Dv], lse f32[R or S*R])`` with R = T * Hq (with splits
    the float32 partials, for ``merge_splits``). Without splits the padding tokens' rows are zeros and -inf;
    with ``st.prior``, ``init`` (o, lse) holds the prior partial: each row merges its own into it, and rows no
    tile writes keep it."""
    rows_out = st.num_tokens * st.num_q_heads * (max_splits if st.split_mode else 1)
    dv = st.head_dim_v
    o_dtype = jnp.float32 if st.split_mode else out_dtype
    out_shape = [jax.ShapeDtypeStruct((rows_out, dv), o_dtype), jax.ShapeDtypeStruct((rows_out,), jnp.float32)]
    aliases = {}
    inputs = list(inputs)
    if st.prior:
        if init is None:
            raise ValueError("a prior partial's launch takes its output and LSE as init")
        aliases = {len(inputs): 0, len(inputs) + 1: 1}
        inputs = inputs + list(init)
    num_warps, num_stages = knobs
    return pl.pallas_call(
        functools.partial(_attn_kernel, st=st, num_tiles=num_tiles),
        out_shape=out_shape,
        grid=(st.programs, num_tiles + st.pad_programs),
        input_output_aliases=aliases,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"paged_attention_m{st.rows}_k{st.block_k}" + (f"_c{st.kv_pack}" if st.kv_pack > 1 else "")
        + (f"_h{st.head_split}" if st.head_split > 1 else ""),
    )(*inputs)


def head_split(block_q: int, group: int, pack: int, head_dim_v: int, max_elements: int) -> int:
    """Programs that share a (kv head, tile)'s query heads: 1, or the least power of 2 that brings the
    tile's float32 accumulator (rows x the value block) to ``max_elements`` (MLA's 128 heads x 512
    latent columns do not fit one program's registers and shared memory; each part re-reads the tile's
    keys, mostly from L2)."""
    split = 1
    while (pack == 1 and group % (2 * split) == 0
           and tile_rows(block_q, group // split) * head_dim_block(head_dim_v) > max_elements):
        split *= 2
    return split


def kernel_statics(*, num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, head_dim_v: int,
                   page_size: int, max_pages: int, max_q_len: int, block_q: int, max_splits: int, dtype, kv_dtype,
                   causal: bool, window_size, softcap: float, softmax_scale, has_sinks: bool, has_k_descale: bool,
                   has_v_descale: bool, latent: bool, config: KernelConfig, interpret: bool, prior: int = 0,
                   batch_invariant: bool = False):
    """(statics, (num_warps, num_stages)) of one kernel instance: what ``paged_attention`` traces, also
    what ``torch_bridge`` compiles for a torch launch (``prior``: ``_Static.prior``; ``batch_invariant``: the tiles
    must not depend on the batch, ``KernelConfig.many_decode_tile``)."""
    decode = max_q_len <= 1 and block_q == 1
    split_mode = max_splits > 1
    if prior and split_mode:
        raise ValueError("a prior partial merges into unsplit tiles only (plan the pass with one kv split)")
    hq, hkv = num_q_heads, num_kv_heads
    kv_bytes = jnp.dtype(kv_dtype).itemsize
    fp8_kv = kv_bytes == 1
    pack = kv_heads_per_program(config, hkv, decode=decode, split=split_mode)
    block_k, num_warps, num_stages = config.tile_params(
        decode, split_mode, programs=num_tokens * num_kv_heads, page_size=page_size,
        head_dim=max(head_dim_block(head_dim), head_dim_block(head_dim_v)), batch_invariant=batch_invariant,
        kv_itemsize=kv_bytes, kv_pack=pack)
    # a key block never outgrows the plan's static key bound (a tree step's expand pass: at most its draft tokens)
    block_k = min(block_k, max(16, next_pow2(max_pages * page_size)))
    compute_dtype = jnp.float32 if jnp.dtype(dtype) == jnp.float32 else jnp.dtype(dtype)
    if fp8_kv and compute_dtype != jnp.float32 and config.fp8_f16_dots:
        compute_dtype = jnp.float16  # KernelConfig.fp8_f16_dots
    split = head_split(block_q, hq // hkv, pack, head_dim_v, config.max_tile_elements)
    if split > 1:  # a wide value block: more warps for the accumulator, shorter key blocks for shared memory
        block_k, num_warps = min(block_k, 64), max(num_warps, 8)
    st = _Static(
        num_tokens=num_tokens, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim, head_dim_v=head_dim_v,
        page_size=page_size, max_pages=max_pages, block_q=block_q, block_k=block_k,
        rows=tile_rows(block_q, pack * hq // hkv // split), kv_pack=pack, head_split=split,
        prefetch_pages=config.prefetch_pages,
        split_mode=split_mode, causal=causal, window=tuple(int(w) for w in window_size),  # type: ignore[arg-type]
        softcap=float(softcap), scale=float(head_dim**-0.5 if softmax_scale is None else softmax_scale),
        has_sinks=has_sinks, has_k_descale=has_k_descale, has_v_descale=has_v_descale,
        compute_dtype=jnp.dtype(compute_dtype), fast_exp2=config.fast_exp2 and not interpret,
        fp8_kv=fp8_kv, latent=latent, prior=prior,
    )
    return st, (num_warps, num_stages)


def _descale_rows(descale, batch: int, hkv: int):
    """None / scalar / [B, Hkv] descale -> None or f32[B * Hkv]."""
    if descale is None:
        return None
    d = jnp.asarray(descale, jnp.float32)
    if d.ndim == 0:
        return jnp.full((batch * hkv,), d)
    if d.shape != (batch, hkv):
        raise ValueError(f"descale shape {d.shape} must be () or (batch, num_kv_heads)=({batch}, {hkv})")
    return d.reshape(-1)


@functools.partial(
    jax.jit,
    static_argnames=("causal", "window_size", "softcap", "softmax_scale", "return_lse", "num_splits",
                     "config", "interpret", "latent_dim"),
)
def paged_attention(
    q,  # [T, Hq, D]
    k_cache,  # [num_pages, page_size, Hkv, D]
    v_cache,  # [num_pages, page_size, Hkv, Dv], or None: an MLA latent cache (``latent_dim``)
    md: AttentionMetadata,
    *,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks=None,  # f32[Hq]
    k_descale=None,  # None, scalar or f32[B, Hkv]
    v_descale=None,  # None, scalar or f32[B, Hkv]
    softmax_scale: float | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
    config: KernelConfig | None = None,
    interpret: bool | None = None,
    latent_dim: int | None = None,
):
    """Ragged-query attention over a paged KV cache (SGLang / FA3 semantics: ``docs/semantics.md``).

    Args:
      q: queries; token ``t`` of sequence ``b`` lies in ``[cu_seqlens_q[b], cu_seqlens_q[b+1])``.
      k_cache, v_cache: paged pools; fp8 (float8_e4m3fn) pools are upcast and descaled.
      md: the step's metadata (lengths, page table, static bounds); ``md.schedule`` is used when set.
      causal: bottom-right aligned causal mask.
      window_size: ``(left, right)`` inclusive sliding window, -1 = unbounded.
      softcap: if > 0, logits become ``softcap * tanh(logits / softcap)``.
      sinks: per-query-head sink logits added to the softmax denominator.
      k_descale, v_descale: fp8 dequantization factors.
      softmax_scale: defaults to ``D ** -0.5``.
      return_lse: also return the natural-log softmax denominator.
      num_splits: None = heuristic split-KV; 1 = no split (deterministic, batch invariant: the tiles do not
        depend on the batch either);
        n > 1 = exactly n kv splits per sequence.
      config: tile sizes and compiler knobs.
      interpret: run the Pallas interpreter; None = only on CPU.
      latent_dim: with ``v_cache=None``, absorbed MLA over one latent cache: a key row is the latent
        (``latent_dim`` columns, also the value row) then the rope part; ``q`` rows are the absorbed
        ``q_nope`` then ``q_rope`` (SGLang's ``kv_lora_rank`` + ``qk_rope_head_dim``, 512 + 64).

    Returns:
      ``out [T, Hq, Dv]`` in ``q.dtype`` (zeros for padding tokens), and ``lse f32[T, Hq]``
      (``-inf`` for padding tokens) when ``return_lse``.
    """
    config = DEFAULT_CONFIG if config is None else config
    if interpret is None:
        interpret = interpret_default()
    _check_inputs(q, k_cache, v_cache, md, sinks, latent_dim)
    _check_scale(softmax_scale)
    t, hq, d = q.shape
    latent = v_cache is None
    num_pages, ps, hkv, _ = k_cache.shape
    dv = latent_dim if latent else v_cache.shape[-1]
    batch, max_pages = md.page_table.shape
    sched = md.schedule
    if sched is None or not sched.fits_heads(hq, hkv):  # none planned for these heads: plan here
        sched = plan_schedule(md, num_q_heads=hq, num_kv_heads=hkv, config=config, num_splits=num_splits,
                              num_tokens=t)
    st, knobs = kernel_statics(
        num_tokens=t, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv, page_size=ps, max_pages=max_pages,
        max_q_len=md.max_q_len, block_q=sched.block_q, max_splits=sched.max_splits, dtype=q.dtype,
        kv_dtype=k_cache.dtype, causal=causal, window_size=window_size, softcap=softcap, softmax_scale=softmax_scale,
        has_sinks=sinks is not None, has_k_descale=k_descale is not None, has_v_descale=v_descale is not None,
        latent=latent, config=config, interpret=interpret, batch_invariant=num_splits == 1)
    inputs = [sched.tile_seq, sched.tile_q_block, sched.tile_split, sched.seq_num_splits,
              md.cache_seqlens, md.cu_seqlens_q, md.page_table.reshape(-1),
              q.reshape(t * hq, d), k_cache.reshape(-1, d),
              k_cache.reshape(-1, d) if latent else v_cache.reshape(-1, dv)]  # latent: values come from the keys
    for extra in (_descale_rows(k_descale, batch, hkv), _descale_rows(v_descale, batch, hkv)):
        if extra is not None:
            inputs.append(extra)
    if sinks is not None:
        inputs.append(jnp.asarray(sinks, jnp.float32))
    o, lse = run_tiles(st, sched.tile_seq.shape[0], sched.max_splits, inputs, q.dtype, knobs, interpret)
    if st.split_mode:
        o, lse = merge_splits(
            o.reshape(sched.max_splits, t * hq, dv), lse.reshape(sched.max_splits, t * hq),
            (md.cu_seqlens_q, sched.seq_num_splits), num_heads=hq, out_dtype=q.dtype, config=config,
            interpret=interpret,
        )
    out = o.reshape(t, hq, dv)
    if return_lse:
        return out, lse.reshape(t, hq)
    return out
