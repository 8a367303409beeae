"""The Mosaic GPU kernel body of ``mosaic_paged`` (TMA page loads, wgmma, warp specialization).

One CTA runs one work tile (sequence, block of ``2 * block_q`` rows) for one head of the row view.
Three warpgroups: two compute warpgroups own ``block_q`` rows each and take turns on the tensor
cores; the third issues the TMA copies, one per KV page, with page ids read from the page table in
the kernel, into a ``stages``-deep ring of key/value buffers.

Row views (``pack``): with ``pack == 1`` a row is one query token of one query head (``q`` as it
is, ``[T, Hq, D]``), the layout for prefill/extend. With ``pack == G`` the ``G`` query heads of a
kv head are packed into the rows (``q`` read as ``[T, Hkv, G, D]``, ``KernelStatics.token_major``),
so decode and verify fill the tensor core tile with one read of each key block.

Latent caches (``KernelStatics.latent``: absorbed MLA, DeepSeek's 512 + 64): one kv head whose rows are the
latent (also the value row) then the rope part. The rows are every query head of a token in q's own order,
and a tile is one ``block_q`` block that both compute warpgroups share: a 64 x 512 float32 accumulator does
not fit one warpgroup's registers, so each accumulates half of the value columns. The first computes the
scores once and hands P and its rescale to the second (``_compute_wg``, ``_follow``). The ring keeps a page's
rows as three parts (``latent_parts``), and the values are read from the key slot.

Ragged outputs: each compute warpgroup stores its valid rows with TMA copies of 64, 32, ..., 1 rows
(the binary digits of the count), so a tile never writes rows of another sequence.

Split-KV (``KernelStatics.num_splits > 1``, launched by ``mosaic_split``): a tile also names a kv
split, a run of the CTA's key blocks; it writes a float32 partial output and its LSE for a merge.

Keys past ``cache_seqlens`` that share the last page are masked out of the scores, and their value
rows are zeroed in shared memory before the P@V product (unused slots may hold anything, NaN too).

The producer, the epilogue with its ragged row stores and the padding rows live in ``mosaic_io``;
the shared-memory layout (swizzle per head dim) and its fitting in ``mosaic_smem``.

Dimension legend: T tokens, B sequences, P page-table width, Hq / Hkv heads, G = Hq // Hkv,
D / Dv head dims, N work tiles (static bound), R rows of the row view, H heads of the row view.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_attn.kernels.config import cdiv
from jax_attn.kernels.kernel_cache import mosaic_call
from jax_attn.kernels.mosaic_io import (COMPUTE_WGS, LOG2E, PAD_BLOCKS, epilogue, fence_async_shared, load_q,
                                        memory_wg, padding_rows, zero_tail_values)
from jax_attn.kernels.mosaic_smem import tiled as tiled_layout


# A tile's row of ``tile_info`` (built by ``mosaic_paged.tile_table``): these columns, zero-padded
# to TILE_INFO_WORDS. ``seq`` is -1 for no tile; ``first_row`` is the tile's first row in the
# sequence's row view; ``seq_splits`` is the sequence's kv split count.
TILE_INFO_COLUMNS = ("seq", "first_row", "split", "k_len", "q_start", "q_len", "seq_splits")
TILE_INFO_WORDS = 8
MAX_CHUNK = 192  # the widest row of an untiled buffer, in elements (``row_chunk``)
LATENT_PARTS = COMPUTE_WGS + 1  # a latent cache's row in shared memory: the value halves, then the rope part


def tile_rows(block_q: int, latent: bool) -> int:
    """Rows of a work tile: one ``block_q`` block per compute warpgroup, or with a latent cache one block
    that both warpgroups share, each accumulating half of the value columns (see the module docstring)."""
    return block_q if latent else COMPUTE_WGS * block_q


def row_chunk(dim: int) -> int:
    """Columns per chunk of the untiled buffers that registers are stored to or loaded from (the Q
    staging and the output buffers), which hold rows of ``dim`` elements as column chunks, each chunk
    its own rows. Mosaic finds no bank-conflict-free transfer between wgmma's register layout and
    untiled shared-memory rows of 512 bytes (head dim 256 in bf16), so such rows go as 128-column
    chunks: each chunk is copied by TMA and moved to or from registers on its own."""
    return 128 if dim > MAX_CHUNK else dim


def chunked(dim: int) -> tuple[int, int]:
    """(chunks, columns per chunk) of an untiled buffer's rows of ``dim`` elements (``row_chunk``). The code
    that moves or copies such a buffer reads both from its shape ``[..., chunks, rows, columns]``."""
    return dim // row_chunk(dim), row_chunk(dim)


@dataclasses.dataclass(frozen=True)
class KernelStatics:
    """Trace-time constants of one kernel instance."""

    num_rows: int  # R
    num_heads: int  # H (row-view heads)
    kv_group: int  # row-view heads per kv head
    pack: int  # rows per query token
    page_size: int
    block_q: int
    block_kv: int
    stages: int
    head_dim: int
    head_dim_v: int
    causal: bool
    window: tuple[int, int]
    softcap: float
    scale: float
    has_sinks: bool
    return_lse: bool
    dtype: jnp.dtype
    interpret: bool
    num_splits: int = 1  # S: static bound on kv splits; > 1 selects the split kernel (``mosaic_split``)
    early_k_wait: bool = False  # wait for the next key block while this block's P @ V runs
    solo: bool = False  # only the first compute warpgroup ever has rows: the second sits the kernel out
    spread_copies: bool = True  # the producer's TMA copies are shared among its four warps
    store_read_wait: bool = True  # the epilogue waits for its stores to read shared memory, not to land
    kv_staging: bool = False  # split kernel, two warpgroups, wide heads: Q staging and float32 output in the rings
    latent: int = 0  # absorbed MLA: the values are each key row's first ``latent`` columns (``head_dim_v``); 0: no

    @property
    def rows_per_tile(self) -> int:
        return tile_rows(self.block_q, bool(self.latent))

    @property
    def value_cols(self) -> int:
        """Value columns one compute warpgroup accumulates."""
        return self.head_dim_v // COMPUTE_WGS if self.latent else self.head_dim_v

    @property
    def active_wgs(self) -> int:
        """Compute warpgroups that run the key loop (and release ring slots)."""
        return 1 if self.solo else COMPUTE_WGS

    @property
    def token_major(self) -> bool:
        """Packed rows read q and write the output (the split kernel: its partials) in the
        token-major ``[T, Hkv, G, D]`` layout, a free view of ``[T, Hq, D]``. A warpgroup's
        ``block_q`` rows are then ``tokens_per_block`` tokens, stored head by head: row
        ``j * tokens_per_block + t`` is query head ``j`` of the group for token ``t`` of the block
        (rows from ``G * tokens_per_block`` on hold no query: a group that does not divide ``block_q``).
        A latent cache (one kv head) keeps q's own order instead: row ``t * Hq + j``, rows contiguous in memory."""
        return self.pack > 1 and not self.latent

    @property
    def tokens_per_block(self) -> int:
        """Query tokens in a warpgroup's ``block_q`` rows with packed rows (``token_major``)."""
        return self.block_q // self.pack

    @property
    def padding_units(self) -> tuple[int, int, int]:
        """(rows per unit, units per row block, units per tile) of the padding CTAs' zeroing
        (``mosaic_io.padding_rows``): whole tokens of packed rows (``token_major``), else rows."""
        unit, per_block = (self.pack, self.tokens_per_block) if self.token_major else (1, self.block_q)
        return unit, per_block, self.rows_per_tile // self.block_q * per_block

    @property
    def ring_staging(self) -> bool:
        """The split kernel's float32 output buffer lives in the key ring (one compute warpgroup:
        the ring is idle once its key loop ends), which leaves room for a deeper ring."""
        return self.split and self.solo

    @property
    def pages_per_block(self) -> int:
        return max(self.block_kv // self.page_size, 1)

    @property
    def gathers_rows(self) -> bool:
        """Pages of fewer than 8 rows (sizes 1, 2, 4) on the GPU: TMA copies whole 8-row swizzle tiles,
        so the producer copies the rows with ``cp.async`` (``mosaic_io._producer_gather``). The
        interpreter copies them with one TMA copy per page."""
        return self.page_size < 8 and not self.interpret

    @property
    def registers(self) -> tuple[int, int]:
        """Registers per thread of each compute warpgroup and of the producer (``setmaxnreg``; their sum over
        the 384 threads stays within the launch's 168 each). The row gather (``gathers_rows``) keeps each copy's
        64-bit row address in registers until its ``cp.async`` has read it: at 40 the producer reused one pair
        for every copy, and each waited for the one before (H200, page 1, 32/8 heads, d 128: prefill B4 S4096
        1011 us at 232 / 40, 996 at 224 / 56; extend 1024 on 4096 540 against 532). Latent caches and values
        wider than 128 columns keep 232 / 40: their compute warpgroups need the registers (MLA decode at page 1,
        16 heads: 89.8 us at 232 / 40, 100.7 at 224 / 56)."""
        if self.gathers_rows and not self.latent and self.value_cols <= 128:
            return 224, 56
        return 232, 40

    @property
    def split(self) -> bool:
        return self.num_splits > 1



def _row_ranges(st: KernelStatics, wg, row_base, seq_rows, q_len, k_len):
    """Rows and key blocks of compute warpgroup ``wg``: (first row, valid rows, kv block lo, hi)."""
    r0 = row_base + wg * st.block_q  # row offset within the sequence
    n_valid = jnp.clip(seq_rows - r0, 0, st.block_q)
    shift = k_len - q_len
    p_first = shift + r0 // st.pack
    p_last = shift + (r0 + jnp.maximum(n_valid, 1) - 1) // st.pack
    left, right = st.window
    hi = k_len
    if st.causal:
        hi = jnp.minimum(hi, p_last + 1)
    if right >= 0:
        hi = jnp.minimum(hi, p_last + right + 1)
    lo = jnp.int32(0)
    if left >= 0:
        lo = jnp.maximum(p_first - left, 0)
    blk_lo = lo // st.block_kv
    blk_hi = jnp.where(n_valid > 0, jnp.maximum(cdiv(hi, st.block_kv), blk_lo), blk_lo)
    # Blocks every valid row sees whole (no mask needed): [full_lo, full_hi).
    full_hi = jnp.minimum(k_len, (p_first + 1) if st.causal else k_len)
    if right >= 0:
        full_hi = jnp.minimum(full_hi, p_first + right + 1)
    full_hi = full_hi // st.block_kv
    full_lo = cdiv(jnp.maximum(p_last - left, 0), st.block_kv) if left >= 0 else jnp.int32(0)
    return r0, n_valid, p_first, blk_lo, blk_hi, full_lo, full_hi


def _split_blocks(cta_lo, cta_hi, split, num_splits):
    """Key blocks ``[lo, hi)`` of kv split ``split``: the CTA's blocks cut into ``num_splits`` runs."""
    chunk = cdiv(jnp.maximum(cta_hi - cta_lo, 0), num_splits)
    lo = jnp.minimum(cta_lo + split * chunk, cta_hi)
    return lo, jnp.minimum(cta_hi, lo + chunk)


def _kernel(st: KernelStatics, num_tiles, refs, smem, bars, used, sched):
    """One CTA: tile ``tiles`` of row-view head ``heads`` (see the module docstring).

    Unsplit: tiles past ``num_tiles`` write zeros to the padding rows (after the last sequence's
    rows). Split (``st.split``): the tile's kv split covers one run of the CTA's key blocks and
    its partial output goes to ``out_ref[split]`` in float32; padding rows are the merge's job.
    """
    q_ref, k_ref, v_ref, pt_ref, cu_ref, info_ref, sinks_ref, out_ref, lse_ref = refs
    q_smem2, k_smem, v_smem, staging, lse_smem2, p_smem2 = smem
    handoff = None
    if st.latent:  # one Q block (its column parts) for both warpgroups; the output buffers in the ring
        (k_smem, o_smem2), q_stage2, handoff = k_smem, None, staging
    elif st.ring_staging:  # see ``kernel_entry``
        (k_smem, o_smem2), q_stage2 = k_smem, staging
    elif st.kv_staging:
        (k_smem, v_smem), q_stage2, o_smem2 = k_smem
    else:
        q_stage2, o_smem2 = staging
    (k_bar, v_bar, q_bar, q_staged, done), (k_used, v_used) = bars, used
    head = lax.axis_index("heads")
    tile = lax.axis_index("tiles")
    wg = lax.axis_index("wg")
    info_row = jnp.minimum(tile, num_tiles - 1)

    def info(name):  # a column of the tile's row of ``tile_info``
        return info_ref[info_row, TILE_INFO_COLUMNS.index(name)]

    seq = info("seq")

    if not st.split:
        pad = functools.partial(padding_rows, st, tile - num_tiles, wg, head, cu_ref, out_ref, o_smem2)
        pl.when((tile >= num_tiles) & (wg < st.active_wgs))(pad)

    @pl.when((tile < num_tiles) & (seq >= 0))
    def _valid_tile():
        row_base, k_len, q_start, q_len = (info(c) for c in ("first_row", "k_len", "q_start", "q_len"))
        seq_rows = q_len * st.pack
        # (A latent cache's warpgroups share one block of rows.)
        ranges = [_row_ranges(st, 0 if st.latent else i, row_base, seq_rows, q_len, k_len) for i in range(COMPUTE_WGS)]
        both = ranges[1][1] > 0  # the second warpgroup has rows
        cta_lo = jnp.where(both, jnp.minimum(ranges[0][3], ranges[1][3]), ranges[0][3])
        cta_hi = jnp.where(both, jnp.maximum(ranges[0][4], ranges[1][4]), ranges[0][4])
        split = None
        if st.split:
            split = info("split")
            cta_lo, cta_hi = _split_blocks(cta_lo, cta_hi, split, info("seq_splits"))
        nblk = jnp.maximum(cta_hi - cta_lo, 0)
        kv_head = head // st.kv_group

        @pl.when(wg < st.active_wgs)
        def _compute():
            plgpu.set_max_registers(st.registers[0], action="increase")
            rng = [jnp.where(wg == 0, a, b) for a, b in zip(ranges[0], ranges[1])]
            out = out_ref if split is None else out_ref.at[split]
            _compute_wg(st, wg, rng, cta_lo, nblk, k_len, q_start * st.pack, head, q_ref, out, lse_ref,
                        sinks_ref, q_smem2 if st.latent else q_smem2.at[wg], k_smem, v_smem,
                        None if st.latent else q_stage2.at[wg], o_smem2.at[wg], lse_smem2,
                        q_bar.at[0 if st.latent else wg], k_bar, v_bar, k_used, v_used, sched, tile, split,
                        None if p_smem2 is None else p_smem2.at[wg], q_staged, done, handoff)

        @pl.when(wg == COMPUTE_WGS)
        def _memory():
            plgpu.set_max_registers(st.registers[1], action="decrease")
            if st.kv_staging:  # the rings hold the Q staging until both warpgroups have their Q
                plgpu.barrier_wait(q_staged)
            memory_wg(st, seq, kv_head, cta_lo, nblk, k_len, k_ref, v_ref, pt_ref, k_smem, v_smem, k_bar, v_bar,
                       k_used, v_used)


def _compute_wg(st, wg, rng, cta_lo, nblk, k_len, seq_row0, head, q_ref, out_ref, lse_ref, sinks_ref, q_smem, k_smem,
                v_smem, q_stage, o_smem, lse_smem2, q_bar, k_bar, v_bar, k_used, v_used, sched, tile, split, p_smem,
                q_staged, done, handoff):
    """Consumer: online softmax over the CTA's key blocks, then the ragged row stores.

    A latent cache (``st.latent``): the first warpgroup leads. It computes the scores over the whole rows
    and the softmax, multiplies P by the first half of the values, and hands P (written over the key
    slot's rope part, which no one reads again) and its row rescale (``handoff``) to the second warpgroup,
    which multiplies P by the second half (``follow``; ``v_bar`` then says a slot's P is ready). Each score
    is computed once; the follower lags the leader by up to the ring's depth."""
    r0, n_valid, p_first, blk_lo, blk_hi, full_lo, full_hi = rng
    bq, bk = st.block_q, st.block_kv
    # (The split kernel's ``q_stage`` may share memory with the other warpgroup's output buffer:
    # each warpgroup reaches its epilogue only after a ``sched`` wait that needs the other's first
    # arrival, which follows its Q load. A ``solo`` kernel has no such wait, and no second
    # warpgroup loading Q either.)
    load_q(st, q_ref, q_smem, q_stage, q_bar, seq_row0 + r0, head, wg)
    if st.kv_staging:
        plgpu.barrier_arrive(q_staged)

    def sched_barrier():
        sched_arrive()
        sched_wait()

    # The warpgroups take turns on the tensor cores (a lone one has no one to wait for; a latent cache's
    # follower has no softmax to hide).
    turns = not (st.solo or st.latent)

    def sched_arrive():
        if turns:
            plgpu.barrier_arrive(sched)

    def sched_wait():
        if turns:
            plgpu.barrier_wait(sched)

    c = st.scale * LOG2E

    def mask(s, blk):
        """-inf where a key is out of the row's causal/window range or past ``k_len``. The range is
        worked out per row (``[bq]`` vectors), then one compare per score against the key iota;
        built inside the masked steps only (index arrays held across the loop would spill)."""
        base = blk * bk
        left, right = st.window
        key = plgpu.broadcasted_iota(jnp.int32, (bq, bk), 1, layout=plgpu.Layout.WGMMA)
        if not (st.causal or right >= 0 or left >= 0):
            # Only the sequence end bounds the keys. Row vectors built and left unused here would
            # leave Mosaic's layout inference a search it does not finish (non-causal kernels).
            return jnp.where(key <= k_len - 1 - base, s, -jnp.inf)
        row_layout = plgpu.Layout.WGMMA.reduce(1)
        row = plgpu.broadcasted_iota(jnp.int32, (bq,), 0, layout=row_layout)
        if st.token_major:
            qpos = p_first + row % st.tokens_per_block
        elif st.pack > 1:
            qpos = p_first + (r0 % st.pack + row) // st.pack
        else:
            qpos = p_first + row
        rel = qpos - base  # the row's query position, counted from the block's first key
        hi = plgpu.layout_cast(jnp.full((bq,), k_len - 1 - base, jnp.int32), row_layout)
        if st.causal:
            hi = jnp.minimum(hi, rel)
        if right >= 0:
            hi = jnp.minimum(hi, rel + right)
        ok = key <= lax.broadcast_in_dim(hi, (bq, bk), [0])
        if left >= 0:
            ok &= key >= lax.broadcast_in_dim(rel - left, (bq, bk), [0])
        return jnp.where(ok, s, -jnp.inf)

    # Scores in log2 units are ``s * post`` with ``s = logits(qk)``. Without softcap (and a positive
    # scale) the scale is left out of ``s`` and applied to the row max and inside ``exp2(s * c - m)``,
    # one fused multiply-add per score instead of a multiply and a subtraction.
    post = c if st.softcap <= 0 and c > 0 else 1.0

    def logits(qk):
        if st.softcap > 0:
            return jnp.tanh(qk * (st.scale / st.softcap)) * (st.softcap * LOG2E)
        return qk if post != 1.0 else qk * c

    def scaled(x):
        return x if post == 1.0 else x * post

    cta_hi = cta_lo + nblk

    def wait_keys(blk):
        """Waits for key block ``blk`` (once per block: from the step itself, or with ``early_k_wait``
        from the step before it, while that step's P @ V is in flight)."""
        pl.when(blk < cta_hi)(lambda: wait_ring(st, k_bar.at[lax.rem(blk - cta_lo, st.stages)]))

    def qk_operands(slot):
        """(Q, keys) pairs whose products sum to the scores: the whole rows, or a latent cache's column
        parts (the two value halves, then the rope part)."""
        if not st.latent:
            return [(q_smem, k_smem.at[slot])]
        (q_lat, q_rope), (lat, rope) = q_smem, k_smem
        return [(q_lat.at[i], lat.at[slot, i]) for i in range(COMPUTE_WGS)] + [(q_rope, rope.at[slot])]

    def values(slot):  # the value rows this warpgroup multiplies (a latent cache: its half of the latent part)
        return k_smem[0].at[slot, wg] if st.latent else v_smem.at[slot]

    # A latent cache's key slot holds the values too: it is released (``k_used``) after P @ V.
    v_ready, v_release = (None, k_used) if st.latent else (v_bar, v_used)

    def step(blk, carry, masked):
        acc, m_i, l_i = carry
        slot = lax.rem(blk - cta_lo, st.stages)
        if not st.early_k_wait:
            wait_ring(st, k_bar.at[slot])

        def qk_fn(acc_ref):
            for a, b in qk_operands(slot):
                plgpu.wgmma(acc_ref, a, b.transpose((1, 0)))
            sched_barrier()
            return acc_ref[...]

        s = logits(pl.run_scoped(qk_fn, plgpu.ACC((bq, bk), jnp.float32)))
        if not st.latent:
            plgpu.barrier_arrive(k_used.at[slot])
        if masked:
            s = mask(s, blk)
        m_new = jnp.maximum(m_i, scaled(s.max(axis=1)))
        m_sub = jnp.where(m_new == -jnp.inf, 0.0, m_new) if masked else m_new
        alpha = jnp.exp2(m_i - m_sub)
        p = jnp.exp2(scaled(s) - lax.broadcast_in_dim(m_sub, s.shape, [0]))
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        l_i = l_i * alpha + p.sum(axis=1)
        p16 = p.astype(st.dtype)
        acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
        if st.latent:  # P and the rescale to the follower
            k_smem[1].at[slot][...] = p16
            handoff[0].at[slot][...] = alpha
            plgpu.commit_smem()
            plgpu.barrier_arrive(v_bar.at[slot])
        sched_arrive()
        if v_ready is not None:
            wait_ring(st, v_ready.at[slot])
        if masked:
            zero_tail_values(st, values(slot), blk, k_len)
        sched_wait()

        acc = _pv(st, acc, p16, values(slot), p_smem,
                  functools.partial(wait_keys, blk + 1) if st.early_k_wait else None)
        plgpu.barrier_arrive(v_release.at[slot])
        return acc, m_new, l_i

    def skip(blk, carry):
        slot = lax.rem(blk - cta_lo, st.stages)
        if st.early_k_wait:
            wait_keys(blk + 1)  # this block's keys were waited for by the step before
        else:
            plgpu.barrier_wait(k_bar.at[slot])
        if not st.latent:
            plgpu.barrier_arrive(k_used.at[slot])
        sched_barrier()
        if v_ready is not None:
            plgpu.barrier_wait(v_ready.at[slot])
        plgpu.barrier_arrive(v_release.at[slot])
        sched_barrier()
        return carry

    acc = plgpu.layout_cast(jnp.zeros((bq, st.value_cols), jnp.float32), plgpu.Layout.WGMMA)
    m_i = plgpu.layout_cast(jnp.full((bq,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    l_i = plgpu.layout_cast(jnp.zeros((bq,), jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    lo = jnp.clip(blk_lo, cta_lo, cta_hi)
    hi = jnp.clip(blk_hi, lo, cta_hi)
    f_lo = jnp.clip(full_lo, lo, hi)
    f_hi = jnp.clip(full_hi, f_lo, hi)
    masked_step = functools.partial(step, masked=True)
    finish = functools.partial(epilogue, st, n_valid=n_valid, row0=seq_row0 + r0, head=head, wg=wg, tile=tile,
                               split=split, sinks_ref=sinks_ref, out_ref=out_ref, lse_ref=lse_ref, o_smem=o_smem,
                               lse_smem2=lse_smem2)  # (``carry`` -> the epilogue)
    if st.latent:
        pl.when(wg == 1)(functools.partial(_follow, st, acc, cta_lo, lo, hi, cta_hi, k_len, values, k_smem, k_bar,
                                           v_bar, k_used, handoff, p_smem, done, finish))
    pl.when(wg == 1)(sched_barrier)
    if st.early_k_wait:
        wait_keys(cta_lo)

    def lead():
        lax.fori_loop(cta_lo, lo, skip, None)
        carry = (acc, m_i, l_i)
        carry = lax.fori_loop(lo, f_lo, masked_step, carry)
        carry = lax.fori_loop(f_lo, f_hi, functools.partial(step, masked=False), carry)
        carry = lax.fori_loop(f_hi, hi, masked_step, carry)
        lax.fori_loop(hi, cta_hi, skip, None)
        pl.when(wg == 0)(sched_barrier)
        if st.latent:  # the row sums, for the follower's epilogue
            handoff[1][...] = carry[2]
        if st.kv_staging or st.latent:  # the output buffer is in the rings: both warpgroups' key loops must be over
            plgpu.barrier_arrive(done)
            plgpu.barrier_wait(done)
        finish(carry)

    if st.latent:
        pl.when(wg == 0)(lead)
    else:
        lead()


def wait_ring(st: KernelStatics, bar):
    """Waits for a ring slot before its rows are read: rows the producer gathered with ``cp.async``
    (``gathers_rows``, written through the generic proxy) are then fenced for wgmma (the async proxy)."""
    plgpu.barrier_wait(bar)
    if st.gathers_rows:
        fence_async_shared()


def _follow(st, acc, cta_lo, lo, hi, cta_hi, k_len, values, k_smem, k_bar, p_bar, k_used, handoff, p_smem, done,
            finish):
    """A latent cache's second warpgroup (see ``_compute_wg``): for each key block the leader computed, its
    P (over the slot's rope part) times this warpgroup's half of the values, after the leader's rescale;
    then the leader's row sums and ``finish`` (the epilogue)."""
    row = plgpu.Layout.WGMMA.reduce(1)

    def skip(blk, carry):  # a block outside the rows' range: the leader only waits for it and releases it
        slot = lax.rem(blk - cta_lo, st.stages)
        plgpu.barrier_wait(k_bar.at[slot])
        plgpu.barrier_arrive(k_used.at[slot])
        return carry

    def step(blk, acc):
        slot = lax.rem(blk - cta_lo, st.stages)
        wait_ring(st, k_bar.at[slot])
        plgpu.barrier_wait(p_bar.at[slot])
        alpha = plgpu.load(handoff[0].at[slot], layout=row)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        zero_tail_values(st, values(slot), blk, k_len)
        acc = _pv(st, acc, None, values(slot), p_smem, p_ref=k_smem[1].at[slot])
        plgpu.barrier_arrive(k_used.at[slot])
        return acc

    lax.fori_loop(cta_lo, lo, skip, None)
    acc = lax.fori_loop(lo, hi, step, acc)
    lax.fori_loop(hi, cta_hi, skip, None)
    plgpu.barrier_arrive(done)  # the output buffers are in the ring
    plgpu.barrier_wait(done)
    l_i = plgpu.load(handoff[1], layout=row)
    finish((acc, l_i, l_i))


def _pv(st, acc, p16, v_slot, p_smem, while_running=None, p_ref=None):
    """``acc + p16 @ v_slot`` accumulated in place by wgmma, ``p16`` from registers (or P from shared
    memory, ``p_ref``). (The interpreter lacks ``run_state`` and register operands: there ``p16`` goes
    through shared memory and the product gets its own accumulator.)"""
    if st.interpret:
        if p_ref is None:
            p_smem[...] = p16
            plgpu.commit_smem()

        def product(acc_ref):
            plgpu.wgmma(acc_ref, p_smem if p_ref is None else p_ref, v_slot)
            return acc_ref[...]

        out = acc + pl.run_scoped(product, plgpu.ACC(acc.shape, jnp.float32))
        if while_running is not None:
            while_running()
        return out

    def chained(acc_ref):
        plgpu.wgmma(acc_ref, p16 if p_ref is None else p_ref, v_slot)
        if while_running is not None:
            while_running()

    return pl.run_state(chained)(plgpu.ACC.init(acc))


def kernel_entry(st: KernelStatics, num_tiles: int, *refs):
    """The ``plgpu.kernel`` body: allocates shared memory and barriers, then runs ``_kernel`` on every
    warpgroup (``refs``: the inputs and outputs of ``kernel_call``, or of ``mosaic_split.kernel_call_split``)."""
    wgs, bq = st.active_wgs, st.block_q  # per-warpgroup buffers only for warpgroups that run (``solo``)
    tiled_v = tiled_layout(st.value_cols, st.dtype)
    smem = _latent_buffers(st) if st.latent else _buffers(st)
    smem = smem + (
        plgpu.SMEM((wgs, bq), jnp.float32),
        # P staging for the interpreter only (see ``_pv``): P @ V's operands share V's swizzle.
        plgpu.SMEM((wgs, bq, st.block_kv), st.dtype, transforms=tiled_v) if st.interpret else None,
    )
    # Arrivals on a ring slot: TMA copies (a latent cache's: three column parts per page), or the gathering
    # warpgroup (each of its threads once its ``cp.async`` copies have landed: ``mosaic_io.cp_async_arrive``).
    ppb = 1 if st.gathers_rows else st.pages_per_block * (LATENT_PARTS if st.latent else 1)
    q_chunks = chunked(st.head_dim)[0]
    q_copies = LATENT_PARTS if st.latent else (st.pack if st.token_major else 1) * q_chunks  # per head and chunk
    both = st.kv_staging or st.latent
    bars = (
        plgpu.Barrier(num_arrivals=ppb, num_barriers=st.stages),
        # values landed; a latent cache's: the leader's P for them is ready (``_compute_wg``)
        plgpu.Barrier(num_arrivals=1 if st.latent else ppb, num_barriers=st.stages),
        plgpu.Barrier(num_arrivals=q_copies, num_barriers=wgs),
        plgpu.Barrier(num_arrivals=wgs) if st.kv_staging else None,  # Q staged (``kv_staging``)
        plgpu.Barrier(num_arrivals=wgs) if both else None,  # key loops over (the output buffer is in the rings)
    )
    used = (plgpu.Barrier(num_arrivals=st.active_wgs, num_barriers=st.stages),) * 2
    sched = plgpu.Barrier(num_arrivals=wgs)
    pl.run_scoped(lambda *a: _kernel(st, num_tiles, refs, *a), smem, bars, used, sched, collective_axes="wg")


def _buffers(st: KernelStatics):
    """Shared memory of the kernel without a latent cache: (Q per warpgroup, the key ring, the value ring,
    the Q staging and output buffers)."""
    tiled, tiled_v = tiled_layout(st.head_dim, st.dtype), tiled_layout(st.head_dim_v, st.dtype)
    wgs, bq = st.active_wgs, st.block_q
    k_ring = plgpu.SMEM((st.stages, st.block_kv, st.head_dim), st.dtype, transforms=tiled)
    # Q is staged through the output buffer (a ``RefUnion``). The split kernel's float32 output buffer
    # shares its memory with the key ring when one warpgroup runs (``ring_staging``: the ring is idle
    # by its epilogue). Two warpgroups whose buffers would not fit otherwise (``kv_staging``: split
    # kernels at head dim 192, every kernel at 256) keep the Q staging and the output buffer in the
    # key/value rings: the producer starts once both warpgroups hold their Q, and they meet at a
    # barrier before their epilogues.
    # The Q staging and output buffers hold each warpgroup's rows as column chunks (``chunked``).
    (q_chunks, q_cols), (o_chunks, o_cols) = chunked(st.head_dim), chunked(st.head_dim_v)
    o32 = plgpu.SMEM((wgs, o_chunks, bq, o_cols), jnp.float32)
    out = o32 if st.split else plgpu.SMEM((wgs, o_chunks, bq, o_cols), st.dtype)
    q_stage = plgpu.SMEM((wgs, q_chunks, bq, q_cols), st.dtype)
    v_ring = plgpu.SMEM((st.stages, st.block_kv, st.head_dim_v), st.dtype, transforms=tiled_v)
    if st.ring_staging:
        k_ring, staging = plgpu.RefUnion(k_ring, o32), q_stage
    elif st.kv_staging:
        k_ring, v_ring, staging = plgpu.RefUnion((k_ring, v_ring), q_stage, out), None, None
    else:
        staging = plgpu.RefUnion(q_stage, out)
    return plgpu.SMEM((wgs, bq, st.head_dim), st.dtype, transforms=tiled), k_ring, v_ring, staging


def latent_parts(st: KernelStatics) -> list[tuple[int, int]]:
    """(first column, columns) of each part of a latent cache's rows as the kernel keeps them: the latent
    (value) columns in ``COMPUTE_WGS`` halves, one per compute warpgroup's P @ V, then the rope columns."""
    half = st.value_cols
    return [(i * half, half) for i in range(COMPUTE_WGS)] + [(st.latent, st.head_dim - st.latent)]


def _latent_buffers(st: KernelStatics):
    """Shared memory of a latent-cache kernel (``st.latent``): the one Q block as (value halves
    ``[2, block_q, Dv / 2]``, rope ``[block_q, R]``); the key ring as the same parts, which is also where
    each warpgroup's output buffer (its value half, in column chunks) lives once the key loops are over; the
    leader's hand-off to the follower (``_compute_wg``): each slot's row rescale, and the row sums at the end.
    The leader writes a slot's P ``[block_q, block_kv]`` over its rope part ``[block_kv, R]``: both are 64 x 64."""
    (_, half), (_, rope) = latent_parts(st)[0], latent_parts(st)[-1]
    tl, tr = tiled_layout(half, st.dtype), tiled_layout(rope, st.dtype)
    chunks, cols = chunked(half)
    out = plgpu.SMEM((COMPUTE_WGS, chunks, st.block_q, cols), jnp.float32 if st.split else st.dtype)
    ring = (plgpu.SMEM((st.stages, COMPUTE_WGS, st.block_kv, half), st.dtype, transforms=tl),
            plgpu.SMEM((st.stages, st.block_kv, rope), st.dtype, transforms=tr))
    q = (plgpu.SMEM((COMPUTE_WGS, st.block_q, half), st.dtype, transforms=tl),
         plgpu.SMEM((st.block_q, rope), st.dtype, transforms=tr))
    if not st.block_q == st.block_kv == rope:
        raise ValueError(f"a latent cache's P goes over the rope part: block_q, block_kv and rope must be equal ({st})")
    handoff = (plgpu.SMEM((st.stages, st.block_q), jnp.float32), plgpu.SMEM((st.block_q,), jnp.float32))
    return q, plgpu.RefUnion(ring, out), None, handoff


def kernel_call(st: KernelStatics, num_tiles: int, interpret=None):
    """The kernel as a function of arrays (nothing else: the torch launcher compiles it alone).

    ``fn(q, k_cache [pages, page_size, Hkv, D], v_cache, page_table i32[B, P], cu_seqlens_q i32[B + 1],
    tile_info i32[N, 8] (``mosaic_paged.tile_table``), sinks f32[H])`` with ``q [T, Hq, D]``
    (``pack == 1``) or ``[T, Hkv, G, D]`` (packed rows: a free view of ``[T, Hq, D]``) returns ``out``
    in q's layout with ``Dv`` (padding tokens zeroed) and ``lse f32[N, H, 2 * block_q]`` per tile.
    """
    if st.split:
        raise ValueError(f"{st.num_splits=}: the split kernel is mosaic_split.kernel_call_split")
    if interpret is None:  # compiled: built once per process, whatever the call sites (``kernel_cache``)
        return mosaic_call(_pallas_kernel, st, num_tiles, out_shapes=out_types(st, num_tiles))
    return _pallas_kernel(st, num_tiles, interpret)


def out_types(st: KernelStatics, num_tiles: int):
    """The kernel's results: ``out`` in q's layout and the per-tile LSE ``f32[N, H, 2 * block_q]``."""
    out_shape: tuple[int, ...] = (st.num_rows, st.num_heads, st.head_dim_v)
    if st.token_major:
        out_shape = (st.num_rows // st.pack, st.num_heads, st.pack, st.head_dim_v)
    return (jax.ShapeDtypeStruct(out_shape, st.dtype),
            jax.ShapeDtypeStruct((num_tiles, st.num_heads, st.rows_per_tile), jnp.float32))


def _pallas_kernel(st: KernelStatics, num_tiles: int, interpret=None):
    unit, _, units_per_tile = st.padding_units
    pad_tiles = cdiv(st.num_rows // unit, units_per_tile * PAD_BLOCKS)
    return plgpu.kernel(
        functools.partial(kernel_entry, st, num_tiles),
        out_type=out_types(st, num_tiles),
        grid=(st.num_heads, num_tiles + pad_tiles),
        grid_names=("heads", "tiles"),
        num_threads=COMPUTE_WGS + 1,
        thread_name="wg",
        # The row reductions stay within warps (WGMMA layout): no cross-warp reduction scratch,
        # which would not leave room for a 3-deep ring of 128-key blocks in a solo kernel.
        compiler_params=plgpu.CompilerParams(approx_math=True, reduction_scratch_bytes=0),
        interpret=interpret,
    )
