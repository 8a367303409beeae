"""Data movement of the Mosaic GPU kernel (``mosaic_kernel``): the TMA producer warpgroup (for pages
of 1, 2 or 4 rows: its ``cp.async`` row gather), the compute warpgroups' Q loads, epilogue and
ragged row stores, zeroed padding rows and value rows past the sequence end.

``st`` is the kernel's ``mosaic_kernel.KernelStatics``.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax._src import core as jax_core  # jax internals (pinned jax 0.11.2): ``cp_async_arrive``'s primitive
from jax._src.pallas.mosaic_gpu import core as gpu_core
from jax._src.pallas.mosaic_gpu import lowering as mgpu_lowering
from jax._src.pallas.mosaic_gpu import primitives as mgpu_primitives
from jax._src.state import primitives as state_primitives
from jax.experimental import pallas as pl
import numpy as np
from jax.experimental.mosaic import gpu as mgpu
from jax.experimental.mosaic.gpu import utils as mgpu_utils
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import arith, llvm, memref, nvvm, vector

from jax_attn.kernels.config import cdiv
from jax_attn.kernels.mosaic_smem import tiled as tiled_layout

COMPUTE_WGS = 2  # compute warpgroups per CTA; the producer is warpgroup COMPUTE_WGS
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)
PAD_BLOCKS = 8  # row blocks of COMPUTE_WGS * block_q rows zeroed by one padding CTA
WARPS_PER_WG = 4


def padding_rows(st, pad_tile, wg, head, cu_ref, out_ref, o_smem2):
    """Zeros for the rows after the last sequence's rows (``PAD_BLOCKS`` row blocks per padding tile;
    in a ``solo`` kernel the one running warpgroup zeroes both warpgroups' rows)."""
    o_smem = o_smem2.at[wg]
    for c in range(o_smem.shape[0]):  # its column chunks
        o_smem.at[c][...] = plgpu.layout_cast(jnp.zeros(o_smem.shape[1:], o_smem.dtype), plgpu.Layout.WGMMA)
    plgpu.commit_smem()
    # In units of whole tokens with packed rows (a row block holds ``tokens_per_block`` of them), else rows.
    unit, per_block, units_per_tile = st.padding_units
    first = cu_ref[cu_ref.shape[0] - 1] * (st.pack // unit) + pad_tile * (PAD_BLOCKS * units_per_tile)
    halves = COMPUTE_WGS // st.active_wgs
    # (A latent cache's warpgroups zero their value halves of the same rows.)
    own, col0 = (0, wg * st.value_cols) if st.latent else (wg * halves * per_block, 0)

    # A loop, not unrolled: each store_rows call site is a few dozen TMA copies to lower and compile.
    @pl.loop(0, PAD_BLOCKS * halves)
    def _block(i):
        start = first + (i // halves) * units_per_tile + own + (i % halves) * per_block
        n = jnp.clip(st.num_rows // unit - start, 0, per_block)
        pl.when(n > 0)(functools.partial(store_rows, st, o_smem, out_ref, start * unit, n * unit, head,
                                         st.token_major, col0))
    plgpu.wait_smem_to_gmem(0, wait_read_only=st.store_read_wait)


def memory_wg(st, seq, kv_head, cta_lo, nblk, k_len, k_ref, v_ref, pt_ref, k_smem, v_smem, k_bar, v_bar, k_used,
               v_used):
    """Producer: one TMA copy per page (or per block when a page holds several blocks). The four
    warps of the warpgroup share the copies (copy ``j`` of a block is issued by warp ``j % 4``): the
    instructions that issue a copy then take a quarter of each scheduler's slots, which the compute
    warps on the same schedulers would otherwise wait for."""
    if st.gathers_rows:
        _producer_gather(st, seq, kv_head, cta_lo, nblk, k_len, k_ref, v_ref, pt_ref, k_smem, v_smem, k_bar, v_bar,
                         k_used, v_used)
        return
    body = functools.partial(_producer_warp, st, seq, kv_head, cta_lo, nblk, k_len, k_ref, v_ref, pt_ref, k_smem,
                             v_smem, k_bar, v_bar, k_used, v_used)
    if not st.spread_copies:  # the whole warpgroup issues every copy
        body(None)
        return
    copies_per_block = (1 if st.page_size >= st.block_kv else st.pages_per_block) * len(_ring_parts(st, k_smem))
    if copies_per_block >= WARPS_PER_WG:
        plgpu.warp_map(body)
        return
    # A warp with no copy to issue sits the loop out: waiting on the ring's barriers without gating
    # them, it could fall two phases behind, and a parity wait would then block forever.
    plgpu.warp_map(lambda warp: pl.when(warp < copies_per_block)(functools.partial(body, warp)))


def _producer_warp(st, seq, kv_head, cta_lo, nblk, k_len, k_ref, v_ref, pt_ref, k_smem, v_smem, k_bar, v_bar, k_used,
                   v_used, warp):
    """One warp of the producer (``memory_wg``; ``warp`` None: the whole warpgroup)."""
    # Reads stay inside the page table and the pool whatever the plan says (bad ids read some page).
    last_page = jnp.clip((k_len + st.page_size - 1) // st.page_size - 1, 0, pt_ref.shape[1] - 1)

    def read_page(col):
        return jnp.clip(pt_ref[seq, col], 0, k_ref.shape[0] - 1)

    def copies(step):
        """(page id, source rows, destination rows) of each TMA copy of key block ``step``."""
        blk = cta_lo + step
        if st.page_size >= st.block_kv:
            key0 = blk * st.block_kv
            page = read_page(jnp.minimum(key0 // st.page_size, last_page))
            return [(page, pl.ds(key0 % st.page_size, st.block_kv), pl.ds(0, st.block_kv))]
        ppb = st.pages_per_block

        def page_id(j):
            return read_page(jnp.minimum(blk * ppb + j, last_page))

        if warp is None or st.latent:  # (a latent cache's copies of a page are spread over the warps)
            ids = [page_id(j) for j in range(ppb)]
        else:  # a warp reads only the page ids of its own copies j = warp + 4 i
            mine = [page_id(warp + WARPS_PER_WG * i) for i in range(cdiv(ppb, WARPS_PER_WG))]
            ids = [mine[j // WARPS_PER_WG] for j in range(ppb)]
        return [(ids[j], pl.ds(0, st.page_size), pl.ds(j * st.page_size, st.page_size)) for j in range(ppb)]

    def issue(plan, slot, src_ref, dst_smem, bar):
        parts = _ring_parts(st, dst_smem)
        for j, (page, src, dst) in enumerate(plan):
            for c, (cols, dst_part) in enumerate(parts):
                rows = src_ref.at[page, src, kv_head]
                copy = functools.partial(plgpu.copy_gmem_to_smem, rows if cols is None else rows.at[:, cols],
                                         dst_part(slot).at[dst], bar.at[slot])
                if warp is None:
                    copy()
                else:
                    pl.when(warp == (j * len(parts) + c) % WARPS_PER_WG)(copy)

    def issue_both(plan, slot):
        issue(plan, slot, k_ref, k_smem, k_bar)
        if not st.latent:  # (a latent cache's values are its key rows)
            issue(plan, slot, v_ref, v_smem, v_bar)

    # The first blocks' page ids are all read before any copy is issued (one round of loads, not one
    # per block); a block past ``nblk`` reads clamped ids it never uses.
    plans = [copies(i) for i in range(st.stages)]
    for i in range(st.stages):
        pl.when(i < nblk)(functools.partial(issue_both, plans[i], i))

    # The page ids are read before waiting for the slot, and a key slot is refilled as soon as both
    # warpgroups' Q @ K^T of it is done, before their P @ V: the next keys then have a whole softmax
    # and P @ V to arrive.
    @pl.loop(st.stages, jnp.maximum(nblk, st.stages))
    def _refill(step):
        slot = lax.rem(step, st.stages)
        plan = copies(step)
        plgpu.barrier_wait(k_used.at[slot])
        issue(plan, slot, k_ref, k_smem, k_bar)
        if not st.latent:
            plgpu.barrier_wait(v_used.at[slot])
            issue(plan, slot, v_ref, v_smem, v_bar)

    # Drain: observe the consumers' last arrivals so every barrier ends on a completed phase.
    @pl.loop(jnp.maximum(nblk - st.stages, 0), nblk)
    def _drain(step):
        slot = lax.rem(step, st.stages)
        plgpu.barrier_wait(k_used.at[slot])
        if not st.latent:
            plgpu.barrier_wait(v_used.at[slot])


def _ring_parts(st, ring):
    """(source columns, a slot's destination) of each part of a ring slot's rows: the whole rows (columns
    None), or a latent cache's three column parts (``mosaic_kernel.latent_parts``: ``ring`` is then the
    (value halves, rope) pair of rings). The TMA producer copies a page's rows into each part, the row
    gather a block's."""
    if not st.latent:
        return [(None, lambda slot: ring.at[slot])]
    from jax_attn.kernels.mosaic_kernel import latent_parts

    halves, rope = ring
    parts = latent_parts(st)
    return ([(pl.ds(c0, w), functools.partial(lambda i, slot: halves.at[slot, i], i))
             for i, (c0, w) in enumerate(parts[:-1])]
            + [(pl.ds(*parts[-1]), lambda slot: rope.at[slot])])


def _producer_gather(st, seq, kv_head, cta_lo, nblk, k_len, k_ref, v_ref, pt_ref, k_smem, v_smem, k_bar, v_bar,
                     k_used, v_used):
    """Producer for pages of fewer than 8 rows (``KernelStatics.gathers_rows``): TMA copies whole
    8-row swizzle tiles, so the warpgroup's threads copy the key and value rows themselves, 16 bytes
    per ``cp.async``, straight into the swizzled tiles wgmma reads (``_gather_block``).

    After a block's key copies (and after its value copies) each producer thread arrives on the slot's
    ``k_bar`` / ``v_bar`` with ``cp_async_arrive``: the arrival happens when that thread's copies have
    landed, so a block is announced as soon as its rows are in shared memory, as a TMA copy announces
    itself, whatever the producer is waiting for meanwhile (the consumers fence the rows for wgmma:
    ``mosaic_kernel.wait_ring``). The producer itself waits only for slot releases: iteration ``s``
    refills K(s - 1)'s slot with K(s + stages - 1) once both warpgroups' Q @ K^T of it is done, then
    V(s - 1)'s slot. (Before, the producer announced each block itself after ``cp.async.wait_group``, so
    an announcement waited behind the releases the producer was blocked on: 0.89x FA3 at page 1 on an
    H200.) The block's row slots are read from the page table once, for its keys and values, at the top
    of the iteration (``_gather_slots``): the read is in flight while the iteration waits."""
    rings = [(k_ref, k_smem, k_bar, k_used)]
    if not st.latent:  # (a latent cache's values are its key rows, and ``v_bar`` is the leader's hand-off)
        rings.append((v_ref, v_smem, v_bar, v_used))

    def issue(blk_step, slots, slot, src_ref, ring, bar):  # block ``cta_lo + blk_step`` (nothing past nblk)
        dsts = [(part(slot), 0 if cols is None else cols.start) for cols, part in _ring_parts(st, ring)]

        @pl.when(blk_step < nblk)
        def _copy():
            _gather_block(st, src_ref, dsts, kv_head, slots)
            cp_async_arrive(bar.at[slot])

    firsts = [_gather_slots(st, pt_ref, k_ref.shape[0], seq, cta_lo + i, k_len) for i in range(st.stages - 1)]
    for i in range(st.stages - 1):
        for src_ref, ring, bar, _ in rings:
            issue(i, firsts[i], i, src_ref, ring, bar)

    @pl.loop(0, nblk)
    def _step(step):
        ahead = step + st.stages - 1  # refills the slot of block step - 1
        ahead_slot = lax.rem(ahead, st.stages)
        slots = _gather_slots(st, pt_ref, k_ref.shape[0], seq, cta_lo + ahead, k_len)
        for src_ref, ring, bar, used in rings:
            pl.when(step > 0)(functools.partial(plgpu.barrier_wait, used.at[ahead_slot]))
            issue(ahead, slots, ahead_slot, src_ref, ring, bar)

    @pl.when(nblk > 0)
    def _drain():  # the last block's releases (the loop waited for the others')
        last = lax.rem(nblk - 1, st.stages)
        for _, _, _, used in rings:
            plgpu.barrier_wait(used.at[last])

    _cp_async_wait(0)


def _cp_async_wait(pending: int):
    @plgpu.inline_mgpu()
    def wait(ctx):
        nvvm.cp_async_wait_group(pending)

    wait()


_cp_async_arrive_p = jax_core.Primitive("cp_async_barrier_arrive")
_cp_async_arrive_p.multiple_results = True


@_cp_async_arrive_p.def_effectful_abstract_eval
def _cp_async_arrive_abstract_eval(barrier, *transforms, transforms_treedef):
    del barrier, transforms, transforms_treedef
    return (), {gpu_core._memory_effect}


@mgpu_lowering.register_lowering_rule(_cp_async_arrive_p, mgpu.LoweringSemantics.Lane)
@mgpu_lowering.register_lowering_rule(_cp_async_arrive_p, mgpu.LoweringSemantics.Warpgroup)
def _cp_async_arrive_lowering(ctx, barrier, *flat_transforms, transforms_treedef):
    index = mgpu_primitives._get_barrier_base_index(ctx.avals_in[0], transforms_treedef.unflatten(flat_transforms))
    if index is not None:
        barrier = barrier[index]
    mgpu_utils.inline_ptx("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [$0];", barrier.get_ptr(),
                          has_side_effects=True)
    return ()


def cp_async_arrive(barrier):
    """Every thread of the warpgroup arrives on ``barrier`` once its earlier ``cp.async`` copies have landed
    (``cp.async.mbarrier.arrive.noinc``: each thread's arrival is one of the 128 a warpgroup arrival
    counts, so the barrier is declared with one arrival per warpgroup, as for ``plgpu.barrier_arrive``).
    Pallas has no such primitive (jax 0.11.2)."""
    ref, transforms = state_primitives.get_ref_and_transforms(barrier, None, "cp_async_arrive")
    flat, treedef = jax.tree_util.tree_flatten(transforms)
    _cp_async_arrive_p.bind(ref, *flat, transforms_treedef=treedef)


def fence_async_shared():
    """Makes shared memory written through the generic proxy (``cp.async`` rows) visible to wgmma."""
    @plgpu.inline_mgpu()
    def fence(ctx):
        nvvm.fence_proxy(nvvm.ProxyKind.async_shared, space=nvvm.SharedSpace.shared_cta)

    fence()


GATHER_PARTS = (256, 128, 64)  # columns one gather pass copies of a row (a warp's 32 lanes: whole rows)


def gather_spans(width: int) -> list[tuple[int, int]]:
    """(first column, columns) of the passes that gather rows of ``width`` columns (a multiple of 64):
    the widest ``GATHER_PARTS`` first, e.g. 192 as 128 + 64."""
    spans, c0 = [], 0
    for w in GATHER_PARTS:
        while width - c0 >= w:
            spans.append((c0, w))
            c0 += w
    if c0 != width:
        raise ValueError(f"rows of {width} columns: the row gather takes multiples of 64")
    return spans


_SLOTS_SHAPE = (WARPS_PER_WG * 32,)
_SLOTS = plgpu.Layout.WG_STRIDED(_SLOTS_SHAPE, vec_size=1)  # one i32 per producer thread


def _gather_slots(st, pt_ref, num_pages: int, seq, blk, k_len):
    """The pool slots of key block ``blk``'s rows, one per producer thread (``_SLOTS``): warp ``w``'s
    lane ``l`` holds row ``w * bk / 4 + l % (bk / 4)``'s, read from the page table (clamped to the
    sequence's pages and to the pool, as the TMA producer clamps)."""
    splat = plgpu.Layout.WG_SPLAT(shape=())

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), splat, splat, splat),
                       return_type=plgpu.ShapeDtypeStruct(_SLOTS_SHAPE, jnp.int32, layout=_SLOTS))
    def slots(ctx, pt, seq_a, blk_a, k_len_a):
        i32 = ir.IntegerType.get_signless(32)

        def c(v):
            return mgpu_utils.c(v, i32)

        def clamp(x, lo: int, hi: int):
            return arith.minsi(arith.maxsi(x, c(lo)), c(hi))

        seq_v, blk_v, k_len_v = (a.registers.item() for a in (seq_a, blk_a, k_len_a))
        width_pt = ir.MemRefType(pt.type).shape[1]
        bk, ps = st.block_kv, st.page_size
        rows_per_warp = bk // WARPS_PER_WG
        tid = arith.remui(mgpu_utils.thread_idx(), c(128))
        lane, warp = arith.remui(tid, c(32)), arith.divui(tid, c(32))
        row = arith.addi(arith.muli(warp, c(rows_per_warp)), arith.remui(lane, c(rows_per_warp)))
        key = arith.addi(arith.muli(blk_v, c(bk)), row)
        last_page = clamp(arith.subi(arith.divsi(arith.addi(k_len_v, c(ps - 1)), c(ps)), c(1)), 0, width_pt - 1)
        col = arith.minsi(arith.divsi(key, c(ps)), last_page)
        index = ir.IndexType.get()
        page_id = clamp(memref.load(pt, [arith.index_cast(index, seq_v), arith.index_cast(index, col)]), 0,
                        num_pages - 1)
        slot = arith.addi(arith.muli(page_id, c(ps)), arith.remsi(key, c(ps))) if ps > 1 else page_id
        reg = vector.broadcast(ir.VectorType.get((1,), i32), slot)
        return mgpu.FragmentedArray(_registers=np.array([reg], dtype=object), _layout=_SLOTS.to_mgpu(),
                                    _is_signed=True)

    return slots(pt_ref, seq, blk, k_len)


def _gather_block(st, src_ref, dsts, kv_head, slots):
    """``cp.async`` copies of a key block's rows of ``src_ref`` (the paged pool, ``[pages, page_size, Hkv,
    D]``; the rows' slots from ``_gather_slots``) into ring slots in wgmma's 128-byte swizzled tiles of 8 x
    64 elements (``mosaic_smem.tiled``; widths that are multiples of 64). ``dsts``: (slot ``[block_kv, W]``,
    first source column) pairs, each taking ``W`` columns of every row (a latent cache's three parts, or
    whole rows).

    Warp ``w`` copies rows ``[w * bk / 4, (w + 1) * bk / 4)``; the warp passes its lanes' slots round by
    shuffles. A row's columns go in passes of 64, 128 or 256 (``gather_spans``), its 16-byte chunks to
    consecutive lanes, so each copy instruction reads whole rows or whole row parts (coalesced)."""
    splat = plgpu.Layout.WG_SPLAT(shape=())
    dst_types = tuple(plgpu.RefType(tiled_layout(d.shape[-1], d.dtype)) for d, _ in dsts)

    @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), *dst_types, splat, _SLOTS))
    def gather(ctx, src, *rest):
        smems, (head_a, slots_a) = rest[:len(dsts)], rest[len(dsts):]
        i32, i64, i8 = (ir.IntegerType.get_signless(b) for b in (32, 64, 8))

        def c(v, ty=i32):
            return mgpu_utils.c(v, ty)

        head_v = head_a.registers.item()
        slot = vector.extract(slots_a.registers.item(), dynamic_position=[], static_position=[0])
        _, _, hkv, src_width = ir.MemRefType(src.type).shape
        itemsize = jnp.dtype(st.dtype).itemsize
        tid = arith.remui(mgpu_utils.thread_idx(), c(128))
        lane, warp = arith.remui(tid, c(32)), arith.divui(tid, c(32))
        src_row_bytes = src_width * itemsize
        src_ptr = llvm.addrspacecast(llvm.PointerType.get(address_space=1), mgpu_utils.memref_ptr(src))
        src_ptr = mgpu_utils.getelementptr(src_ptr, [arith.extui(i64, arith.muli(head_v, c(src_row_bytes)))], i8)
        for smem, (dst, src_col0) in zip(smems, dsts):
            tiles_per_row = dst.shape[-1] * itemsize // 128
            for part_col0, part_width in gather_spans(dst.shape[-1]):
                _gather_pass(c, lane, warp, slot, src_ptr, mgpu_utils.memref_ptr(smem),
                             rows_per_warp=st.block_kv // WARPS_PER_WG, chunks=part_width * itemsize // 16,
                             tiles_per_row=tiles_per_row, first_tile=part_col0 * itemsize // 128,
                             src_offset=(src_col0 + part_col0) * itemsize, src_slot_bytes=hkv * src_row_bytes)

    gather(src_ref, *(d for d, _ in dsts), kv_head, slots)


def _gather_pass(c, lane, warp, slot, src_ptr, dst_ptr, *, rows_per_warp, chunks, tiles_per_row, first_tile,
                 src_offset, src_slot_bytes):
    """One pass of ``_gather_block``: ``chunks`` 16-byte chunks (a multiple of 8) of each of the warp's rows,
    from byte ``src_offset`` of the row, into tile columns ``first_tile...`` of the destination's
    ``tiles_per_row``.

    Eight lanes share a row, so each ``cp.async`` instruction of the warp reads 128 contiguous bytes of
    each of 4 rows. (H200, page 1, prefill B4 S4096 at d 128: 987 us, against 1004 with 4 lanes a row (64
    bytes of 8 rows); 16 lanes (whole rows of 2) took 1059 against 8 lanes' 1011 at 40 producer registers,
    thirty-first session. At d 256, 16/8 heads, 920 and 931 us in two runs against 933 with 16 lanes: within
    run-to-run noise.)
    A lane copies chunk ``chunk`` of each 128-byte tile of the row, from one row address: the same place
    in each tile, so the same swizzle (destination + 1024, source + 128 bytes per tile). Pass i copies row
    j = 4 * i + q of the warp's run, whose place in its 8-row tile is (4 * i) % 8 + q (an OR: q < 4), so the
    swizzled offset is a per-thread base plus a constant, the XOR of the chunk with the row picked from one
    table per distinct (4 * i) % 8."""
    i64, i8 = ir.IntegerType.get_signless(64), ir.IntegerType.get_signless(8)
    lanes_per_row, rows_per_pass = 8, 4
    if chunks % lanes_per_row:
        raise ValueError(f"a gather pass of {chunks} 16-byte chunks: the row gather takes multiples of 8")
    per_lane = chunks // lanes_per_row
    chunk = arith.remui(lane, c(lanes_per_row))  # this lane's place in each 128-byte tile
    q = arith.divui(lane, c(lanes_per_row))
    x = arith.xori(chunk, q)
    tile = arith.muli(warp, c(rows_per_warp // 8 * tiles_per_row))
    base = arith.addi(arith.muli(arith.addi(tile, c(first_tile)), c(1024)), arith.muli(q, c(128)))
    swizzled = {k: arith.addi(base, arith.muli(arith.xori(x, c(k)), c(16)))
                for k in sorted({(i * rows_per_pass) % 8 for i in range(rows_per_warp // rows_per_pass)})}
    src_ptr = mgpu_utils.getelementptr(src_ptr, [arith.extui(i64, arith.addi(arith.muli(chunk, c(16)),
                                                                             c(src_offset)))], i8)
    for i in range(rows_per_warp // rows_per_pass):
        first = i * rows_per_pass
        slot_j = nvvm.shfl_sync(c(0xFFFFFFFF), slot, arith.addi(q, c(first)), c(0x1F), nvvm.ShflKind.idx)
        static = (first // 8) * tiles_per_row * 1024 + (first % 8) * 128
        src_row = mgpu_utils.getelementptr(src_ptr, [arith.muli(arith.extui(i64, slot_j), c(src_slot_bytes, i64))],
                                           i8)
        dst_at = arith.addi(swizzled[first % 8], c(static))
        for p in range(per_lane):
            nvvm.cp_async_shared_global(mgpu_utils.getelementptr(dst_ptr, [arith.addi(dst_at, c(p * 1024))], i8),
                                        mgpu_utils.getelementptr(src_row, [c(p * 128, i64)], i8), 16,
                                        nvvm.LoadCacheModifierKind.CG)


def load_q(st, q_ref, q_smem, q_stage, q_bar, row0, head, wg):
    """Rows ``[row0, row0 + block_q)`` of row-view head ``head`` into ``q_smem``, tiled for wgmma.

    TMA into the tiled layout needs 8-aligned rows (and a q array whose row count is a multiple of
    8): other rows, and packed rows (gathered head by head, ``st.token_major``), are staged through
    the untiled ``q_stage``, then stored tiled. A latent cache's rows (``st.latent``: always 8-aligned,
    as the query heads are a multiple of 8) go to its column parts, copied by the first warpgroup for both.
    """
    if st.latent:
        from jax_attn.kernels.mosaic_kernel import latent_parts

        rows = q_ref.at[pl.ds(pl.multiple_of(row0, 8), st.block_q), head]
        dsts = [q_smem[0].at[i] for i in range(COMPUTE_WGS)] + [q_smem[1]]

        @pl.when(wg == 0)
        def _copy():
            for (c0, w), dst in zip(latent_parts(st), dsts):
                plgpu.copy_gmem_to_smem(rows.at[:, pl.ds(c0, w)], dst, q_bar)

        plgpu.barrier_wait(q_bar)
        return
    bq, chunks, w = st.block_q, q_stage.shape[0], q_stage.shape[-1]  # ``q_stage``: [chunks, block_q, columns]

    def restage():
        for c in range(chunks):
            (q_smem if chunks == 1 else q_smem.at[:, pl.ds(c * w, w)])[...] = q_stage.at[c][...]

    def stage(src, rows=None):  # TMA copies of ``src`` rows into the staging chunks
        for c in range(chunks):
            dst = q_stage.at[c] if rows is None else q_stage.at[c, rows]
            plgpu.copy_gmem_to_smem(src if chunks == 1 else src.at[:, pl.ds(c * w, w)], dst, q_bar)

    if st.token_major:  # one copy per query head of the group
        tpb = st.tokens_per_block
        for j in range(st.pack):
            stage(q_ref.at[pl.ds(row0 // st.pack, tpb), head, j], pl.ds(j * tpb, tpb))
        plgpu.barrier_wait(q_bar)
        restage()
    elif st.num_rows % 8:
        stage(q_ref.at[pl.ds(row0, bq), head])
        plgpu.barrier_wait(q_bar)
        restage()
    else:
        aligned = row0 % 8 == 0

        @pl.when(aligned)
        def _direct():
            plgpu.copy_gmem_to_smem(q_ref.at[pl.ds(pl.multiple_of(row0, 8), bq), head], q_smem, q_bar)
            for _ in range(chunks - 1):  # the barrier counts the staged path's copies, one per chunk
                plgpu.barrier_arrive(q_bar)

        pl.when(~aligned)(lambda: stage(q_ref.at[pl.ds(row0, bq), head]))
        plgpu.barrier_wait(q_bar)
        pl.when(~aligned)(restage)
    plgpu.commit_smem()


def zero_tail_values(st, v_slot, blk, k_len):
    """Zero value rows of keys >= k_len in this block (they meet p == 0, but 0 * NaN is NaN)."""
    @pl.when((blk + 1) * st.block_kv > k_len)
    def _():
        for c in range(st.block_kv // 64):
            rows = v_slot.at[pl.ds(c * 64, 64)]
            ids = plgpu.broadcasted_iota(jnp.int32, (64, v_slot.shape[-1]), 0, layout=plgpu.Layout.WGMMA)
            v = plgpu.load(rows, layout=plgpu.Layout.WGMMA)  # layouts pinned: less for layout inference to search
            keep = jnp.where(ids + (blk * st.block_kv + c * 64) < k_len, v, jnp.zeros_like(v))
            rows[...] = plgpu.layout_cast(keep, plgpu.Layout.WGMMA)
        plgpu.commit_smem()


def store_rows(st, o_smem, out_ref, row0, n, head, token_major: bool = False, col0=0):
    """TMA-stores rows ``[0, n)`` of ``o_smem`` (``[chunks, block_q, Dv // chunks]``: column chunks,
    ``mosaic_kernel.chunked``) to ``out_ref[row0:row0 + n, head]`` (n <= block_q): one copy per
    binary digit of ``n`` and chunk, so no row outside the range is written. ``token_major``:
    ``out_ref`` is ``[T, H, G, Dv]`` and rows go as whole tokens (``row0`` and ``n`` are multiples of G).
    ``col0``: the buffer's first column is this column of ``out_ref`` (a latent cache's value halves).

    A TMA copy's shared-memory address is 128-byte aligned: when a row is not a multiple of 128
    bytes (head dims 80, 96, 112, ...), copies start on multiples of ``aligned_rows`` rows only, and
    the last ``n % aligned_rows`` rows go as one copy of that many rows."""
    g = st.pack if token_major else 1
    tpb = st.block_q // g  # rows (tokens) per query head in the buffer (``tokens_per_block``)
    row0, n = (row0 // g, n // g) if token_major else (row0, n)
    step = aligned_rows(o_smem.shape[-1] * o_smem.dtype.itemsize)
    off: Any = 0  # a Python int while static: a numpy scalar here would make the slice size dynamic

    chunks, w = o_smem.shape[0], o_smem.shape[-1]

    def copy(at, size):
        for j in range(g):
            rows = pl.ds(row0 + at, size)
            dst = out_ref.at[rows, head, j] if token_major else out_ref.at[rows, head]
            for c in range(chunks):
                src = o_smem.at[c, pl.ds(j * tpb + at, size)]
                whole = chunks == 1 and w == dst.shape[-1]
                plgpu.copy_smem_to_gmem(src, dst if whole else dst.at[:, pl.ds(col0 + c * w, w)])

    size = 1 << (tpb.bit_length() - 1)  # n <= tpb < 2 * size: n's binary digits from size down
    while size >= step:
        take = (n & size) != 0
        pl.when(take)(functools.partial(copy, off, size))
        off = off + jnp.where(take, size, 0)
        size //= 2
    for tail in range(1, step):  # rows [off, n): fewer than ``step``, from an aligned row
        pl.when(n - off == tail)(functools.partial(copy, off, tail))


def aligned_rows(row_bytes: int) -> int:
    """Rows whose bytes are a multiple of 128 (the alignment of a TMA copy's shared-memory address)."""
    return 128 // math.gcd(row_bytes, 128)


def _row_sinks(st, sinks_ref, head):
    """The sink logit of each row: the CTA's query head's (``sinks_ref`` is ``f32[Hq]``), or with packed rows
    (``token_major``: row ``j * tokens_per_block + t`` is query head ``j`` of kv head ``head``'s group) a
    ``[block_q]`` vector of the group's ``G`` sinks."""
    if st.pack == 1:
        return sinks_ref[head]
    tpb = st.tokens_per_block
    row = plgpu.broadcasted_iota(jnp.int32, (st.block_q,), 0, layout=plgpu.Layout.WGMMA.reduce(1))
    first = head * st.pack
    vec = plgpu.layout_cast(jnp.full((st.block_q,), sinks_ref[first], jnp.float32), plgpu.Layout.WGMMA.reduce(1))
    for j in range(1, st.pack):
        vec = jnp.where(row >= j * tpb, sinks_ref[first + j], vec)
    return vec


def epilogue(st, carry, n_valid, row0, head, wg, tile, split, sinks_ref, out_ref, lse_ref, o_smem, lse_smem2):
    """A compute warpgroup's end: the sinks folded in, the rows normalized and stored (``store_rows``),
    the LSE (natural log) of its rows written to its tile's slot."""
    acc, m_i, l_i = carry
    if st.has_sinks:  # kv split 0 only
        sink = _row_sinks(st, sinks_ref, head) * LOG2E
        if split is not None:
            sink = sink + jnp.where(split == 0, 0.0, -jnp.inf)  # (a scalar select: packed rows' sinks are a vector)
        m_new = jnp.maximum(m_i, sink)
        m_sub = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m_i - m_sub)
        l_i = l_i * alpha + jnp.exp2(sink - m_sub)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        m_i = m_new
    l_safe = jnp.where(l_i == 0.0, 1.0, l_i)
    acc = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
    chunks, w = o_smem.shape[0], o_smem.shape[-1]  # ``o_smem``: [chunks, block_q, columns]
    for c in range(chunks):
        o_smem.at[c][...] = (acc if chunks == 1 else acc[:, c * w:(c + 1) * w]).astype(o_smem.dtype)
    if st.return_lse:
        lse_smem2.at[wg][...] = jnp.where(l_i == 0.0, -jnp.inf, m_i * LN2 + jnp.log(l_safe))
    plgpu.commit_smem()
    store_rows(st, o_smem, out_ref, row0, n_valid, head, token_major=st.token_major,
               col0=wg * st.value_cols if st.latent else 0)
    if st.return_lse:
        lse = functools.partial(plgpu.copy_smem_to_gmem, lse_smem2.at[wg],
                                lse_ref.at[tile, head, pl.ds(wg * st.block_q, st.block_q)])
        if st.latent:  # the warpgroups hold the same rows: the first one writes their LSE
            pl.when(wg == 0)(lse)
        else:
            lse()
    plgpu.wait_smem_to_gmem(0, wait_read_only=st.store_read_wait)
