"""Ragged paged attention for Hopper in Pallas Mosaic GPU: configuration, schedule and entry point.

The kernel itself lives in ``mosaic_kernel`` (see its docstring for the design). One CTA runs one
work tile (sequence, block of ``2 * block_q`` rows) for one head of the row view.

Row views (``pack``): with ``pack == 1`` a row is one query token of one query head (``q`` as it
is, ``[T, Hq, D]``), the layout for prefill/extend. With ``pack == G`` the ``G`` query heads of a
kv head are packed into the rows (row ``t * G + g`` of kv head ``h`` is query head ``h * G + g`` of
token ``t``), so decode and verify fill the tensor core tile with one read of each key block. The
kernel reads q and writes the output (or the split kernel's partials) as ``[T, Hkv, G, D]``, a free
view of ``[T, Hq, D]`` (``pack_rows``).

Split-KV (flash-decoding, ``mosaic_split``): when the CTAs cannot fill the GPU (a few long decode
sequences), each tile's key blocks are cut into kv splits whose float32 partials are merged.

Dimension legend: T tokens, B sequences, Hq / Hkv heads, G = Hq // Hkv, D / Dv head dims,
N work tiles (static bound), R rows of the row view, H heads of the row view.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_attn.kernels.config import HOPPER_NUM_SMS, interpret_default
from jax_attn.kernels.mosaic_kernel import (MAX_CHUNK, TILE_INFO_COLUMNS, TILE_INFO_WORDS, KernelStatics,
                                            kernel_call, row_chunk, tile_rows)
from jax_attn.kernels.mosaic_io import aligned_rows
from jax_attn.kernels.mosaic_smem import fit_shared_memory, swizzle_bytes
from jax_attn.kernels.mosaic_split import kernel_call_split, lse_index, merge_partials, static_num_splits
from jax_attn.kernels.schedule import build_schedule
from jax_attn.metadata import AttentionMetadata


@dataclasses.dataclass(frozen=True)
class MosaicConfig:
    """Knobs of the Mosaic GPU kernel.

    Attributes:
      block_q: rows per compute warpgroup (the wgmma M dimension; 64).
      block_kv: keys per pipeline step (multiple of 64 and of, or divisor of, the page size).
      stages: depth of the key/value ring buffer.
      pack_max_q_len: row packing (``pack = G``) is used when the bucket's ``max_q_len`` is at
        most this; longer query runs use one head per CTA.
      max_splits: static upper bound on kv splits per sequence when ``num_splits`` is left to the
        heuristic (``mosaic_split.static_num_splits``).
      min_kv_per_split: the heuristic never gives a split fewer keys than this.
      num_sms: multiprocessors the split heuristic tries to fill (one CTA each: the kernel's
        shared memory allows one per multiprocessor).
      split_below_fill: the heuristic splits only when the unsplit CTAs fill at most
        ``1 / split_below_fill`` of the multiprocessors. With the defaults (1, and splits of 128 keys or
        more) every decode bucket that leaves multiprocessors idle splits towards one full wave. On an H200
        (``benchmarks/tune.py mosaic --triton``, 32/8 heads, d 128, page 16, 2026-11-29, thirty-seventh
        session), against cuDNN, the old defaults (4 and 512) against these: 8 x 4096 (64 CTAs, unsplit
        before) 0.82x -> 0.96x, 8 x 8192 0.79x -> 0.96x, 1 x 4096 (8 splits before, 16 now) 0.74x -> 0.95x,
        1 x 512 (unsplit before) 0.81x -> 1.01x; the Triton-lowered kernel read 0.93x, 0.95x, 0.67x, 0.65x.
        (On the H100, where these were set before, 64 unsplit CTAs read 0.97x at 8 x 8192: its lower
        bandwidth needs fewer bytes in flight.)
      split_waves: CTAs per multiprocessor the split heuristic aims for (rounded down to whole
        waves of ``num_sms`` CTAs).
      latent_split_below_fill: ``split_below_fill`` for a latent (MLA) cache: its decode reads one row
        of 576 values per key for every query head, so a GPU left half idle costs half the bandwidth
        (1: split whenever the unsplit CTAs do not fill it).
      early_k_wait: with one head per row block (prefill, extend), a compute warpgroup waits for
        the next key block right after issuing this block's P @ V (while it runs) instead of at the
        start of the next step. (Measured on an H100: prefill +1-2%; packed decode rows slower, so
        they keep the wait at the step start.)
      decode_block_kv / decode_stages: ``block_kv`` and ``stages`` for packed rows in an unsplit
        call with at least ``decode_min_ctas`` (token, kv head) programs: many decode sequences,
        shorter and deeper ring steps (H100, 256 x 1024: 2.88-2.90 TB/s against 2.85-2.86 with
        128 x 2; 8 x 8192, 64 programs: 2.53 against 2.76, so few programs keep 128 x 2). None:
        ``block_kv`` / ``stages``.
      solo: when no sequence's packed rows can reach the second compute warpgroup (decode and
        short verify: ``max_q_len * G <= block_q``), that warpgroup sits the kernel out: the first
        one runs alone, with no schedule barrier to take turns through, and only its buffers are
        allocated.
      split_decode_block_kv / split_decode_stages: ``block_kv`` and ``stages`` of solo split calls
        (split decode: one CTA per multiprocessor, a single wave). The smallest ring streams
        fastest there (H100, decode 1 x 32768: 64 x 2 0.973x cuDNN, 128 x 2 0.935x, 128 x 3 0.910x,
        64 x 6 0.893x). None: ``block_kv`` / ``stages``.
      solo_block_kv / solo_stages: ``block_kv`` and ``stages`` of other solo calls (unsplit decode
        with few programs); the shared memory the absent warpgroup leaves allows a deeper ring (up
        to 3 x 128 keys; slower on an H100). None: ``block_kv`` / ``stages``.
      spread_copies: the producer warpgroup's four warps share a key block's TMA copies (copy ``j``
        by warp ``j % 4``) instead of each running every copy's issue code; those instructions
        otherwise take issue slots from the compute warps on the same schedulers.
      batch_invariant: deterministic inference: a call's key block and stages never depend on how
        many tokens the batch holds, so a request's bits do not either (the ``decode_min_ctas``
        switch is off; the many-sequence decode keeps ``block_kv`` x ``stages``: 2.85-2.86 TB/s
        against 2.88-2.90 at 256 x 1024 on an H100).
      store_read_wait: a compute warpgroup's last wait on its output stores is for the stores to
        have read shared memory (``cp.async.bulk.wait_group.read``), not for the writes to land:
        the CTA ends sooner and the next one starts on its multiprocessor. (H100, prefill B=4
        S=4096: 946 / 942 us against 951 / 949 at page 16 / 64; decode unchanged.)
    """

    block_q: int = 64
    block_kv: int = 128
    stages: int = 2
    pack_max_q_len: int = 16
    max_splits: int = 16
    min_kv_per_split: int = 128
    num_sms: int = HOPPER_NUM_SMS
    split_waves: int = 1
    split_below_fill: int = 1
    latent_split_below_fill: int = 1
    early_k_wait: bool = True
    solo: bool = True
    decode_block_kv: int | None = 64
    decode_stages: int | None = 4
    decode_min_ctas: int = 2 * HOPPER_NUM_SMS
    split_decode_block_kv: int | None = 64
    split_decode_stages: int | None = 2
    solo_block_kv: int | None = None
    solo_stages: int | None = None
    spread_copies: bool = True
    store_read_wait: bool = True
    batch_invariant: bool = False

    def __post_init__(self):
        if self.block_q != 64:
            raise ValueError(f"{self.block_q=} must be 64 (one wgmma tile per warpgroup)")
        for name in ("block_kv", "decode_block_kv", "split_decode_block_kv", "solo_block_kv"):
            v = getattr(self, name)
            if v is not None and (v % 64 or v < 64):
                raise ValueError(f"{name}={v} must be a positive multiple of 64")
        for name in ("decode_stages", "split_decode_stages", "solo_stages"):
            if getattr(self, name) is not None and getattr(self, name) < 2:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 2")
        if self.stages < 2:
            raise ValueError(f"{self.stages=} must be >= 2")
        for name in ("max_splits", "min_kv_per_split", "num_sms", "split_waves", "split_below_fill",
                     "latent_split_below_fill"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


DEFAULT_MOSAIC_CONFIG = MosaicConfig()


def supports(q, k_cache, v_cache, md: AttentionMetadata, *, k_descale=None, v_descale=None,
             latent_dim: int | None = None, has_sinks: bool = False) -> str | None:
    """``None`` if the Mosaic kernel runs this call, else the reason it does not (``v_cache=None`` with
    ``latent_dim``: an absorbed MLA latent cache, ``latent_unsupported``)."""
    if k_descale is not None or v_descale is not None or k_cache.dtype.itemsize == 1:
        return "fp8 KV with k/v descale is not in the Mosaic kernel"
    if v_cache is None:
        return latent_unsupported(q.dtype, k_cache.dtype, k_cache.shape[-1], latent_dim, md.page_size, q.shape[1],
                                  k_cache.shape[2], has_sinks=has_sinks)
    return unsupported(q.dtype, k_cache.dtype, v_cache.dtype, k_cache.shape[-1], v_cache.shape[-1], md.page_size,
                       packed_group=choose_pack(md, q.shape[1], k_cache.shape[2], DEFAULT_MOSAIC_CONFIG))


def unsupported(dtype, k_dtype, v_dtype, head_dim: int, head_dim_v: int, page_size: int,
                packed_group: int = 1) -> str | None:
    """The kernel's dtype, head-dim and page-size rules (``supports``; the torch launch path):
    ``None`` when they hold, else the reason. Dtypes are anything ``jnp.dtype`` accepts.
    ``packed_group``: the call's rows pack this many query heads (``choose_pack``)."""
    dtype, k_dtype, v_dtype = (jnp.dtype(x) for x in (dtype, k_dtype, v_dtype))
    if dtype not in (jnp.bfloat16, jnp.float16) or k_dtype != dtype or v_dtype != dtype:
        return f"dtypes {dtype}/{k_dtype}/{v_dtype}: the Mosaic kernel takes bf16 or f16 q and cache"
    if any(swizzle_bytes(d, dtype.itemsize) == 0 or d > MAX_HEAD_DIM or d % row_chunk(d)
           for d in (head_dim, head_dim_v)):
        return (f"head dims {head_dim}/{head_dim_v}: the Mosaic kernel takes multiples of 16 up to {MAX_CHUNK} "
                f"(wgmma's swizzled tiles) and {MAX_HEAD_DIM} (rows staged as 128-column chunks); impl='triton' "
                "(or 'auto') runs the others")
    if packed_group > 1 and not packed_rows_aligned(head_dim, head_dim_v, dtype.itemsize, packed_group):
        return (f"packed rows of {packed_group} query heads at head dims {head_dim}/{head_dim_v}: a head's "
                f"{DEFAULT_MOSAIC_CONFIG.block_q // packed_group} rows would start TMA copies off 128-byte "
                "boundaries; impl='triton' (or 'auto') runs them")
    if page_size in (1, 2, 4):
        if head_dim % 64 or head_dim_v % 64:
            return (f"page_size={page_size} at head dims {head_dim}/{head_dim_v}: the Mosaic kernel gathers rows of "
                    "pages smaller than 8 for head dims that are multiples of 64 only (64, 128, 192, 256)")
    return page_size_unsupported(page_size)


def page_size_unsupported(page_size: int) -> str | None:
    """The kernel's page sizes: 1, 2, 4 (rows gathered with ``cp.async``) and multiples of 8 dividing or
    divided by 64 (TMA copies); ``None`` when ``page_size`` is one, else the reason."""
    if page_size in (1, 2, 4) or (page_size % 8 == 0 and (page_size % 64 == 0 or 64 % page_size == 0)):
        return None
    return (f"page_size={page_size}: the Mosaic kernel takes 1, 2, 4 and multiples of 8 dividing or divided "
            "by 64")


MAX_HEAD_DIM = 256  # the widest K and V rows the kernel takes


def latent_unsupported(dtype, kv_dtype, head_dim: int, latent: int | None, page_size: int, num_q_heads: int,
                       num_kv_heads: int, has_sinks: bool = False) -> str | None:
    """The kernel's rules for an absorbed MLA latent cache (rows of ``latent`` value columns, then the rope
    part, ``head_dim`` in all; ``KernelStatics.latent``): ``None`` when they hold, else the reason."""
    dtype, kv_dtype = jnp.dtype(dtype), jnp.dtype(kv_dtype)
    rope = head_dim - (latent or 0)
    if dtype not in (jnp.bfloat16, jnp.float16) or kv_dtype != dtype:
        return f"dtypes {dtype}/{kv_dtype}: the Mosaic kernel takes bf16 or f16 q and latent cache"
    if not latent or latent % (2 * 64) or latent > 2 * 256 or rope != 64:
        return (f"latent cache rows {latent} + {rope}: the Mosaic kernel takes latent widths that are multiples of "
                "128 up to 512 and a rope part of 64 (DeepSeek V2/V3, Kimi K2)")
    if num_kv_heads != 1 or num_q_heads % 8:
        return (f"{num_q_heads}/{num_kv_heads} heads over a latent cache: the Mosaic kernel takes one latent head "
                "and query heads in multiples of 8")
    if (reason := page_size_unsupported(page_size)) is not None:
        return reason
    if has_sinks:
        return "sinks with a latent cache are not in the Mosaic kernel"
    return None


def packed_rows_aligned(head_dim: int, head_dim_v: int, itemsize: int, group: int,
                        config: MosaicConfig = DEFAULT_MOSAIC_CONFIG) -> bool:
    """Whether packed rows keep every TMA copy aligned: a query head's ``block_q // group`` rows of
    Q, of the output and of the split kernel's float32 partials start on 128-byte boundaries."""
    rows = config.block_q // group
    return all(rows % aligned_rows(d * size) == 0 for d, size in ((head_dim, itemsize), (head_dim_v, itemsize),
                                                                 (head_dim_v, 4)))


def choose_pack(md: AttentionMetadata, num_q_heads: int, num_kv_heads: int, config: MosaicConfig,
                latent: bool = False) -> int:
    """Rows per query token of this call (``pack_for``; a latent cache's rows hold every query head)."""
    return num_q_heads if latent else pack_for(num_q_heads // num_kv_heads, md.max_q_len, config)


def pack_for(group: int, max_q_len: int, config: MosaicConfig = DEFAULT_MOSAIC_CONFIG) -> int:
    """Rows per query token: the kv head's ``group`` query heads packed for short query runs, else 1. A row
    block holds ``block_q // group`` whole tokens (``KernelStatics.tokens_per_block``): a group dividing
    ``block_q`` fills it, another one (Llama 4's 5, Qwen2.5's 7) leaves its last ``block_q % group`` rows
    without a query and is packed only when every sequence's queries fit one block."""
    if group <= 1 or max_q_len > config.pack_max_q_len:
        return 1
    return group if config.block_q % group == 0 or max_q_len <= config.block_q // group else 1


def plan_mosaic_schedule(md: AttentionMetadata, *, num_q_heads: int, num_kv_heads: int,
                         config: MosaicConfig | None = None, num_tokens: int | None = None,
                         num_splits: int | None = 1, with_lse: bool = False, latent: bool = False):
    """The kernel's work tiles for one step (jit-able; a planner attaches it as ``md.mosaic_schedule``).

    ``num_splits``: 1 (the default) = no split-KV, the unsplit kernel; None = the split heuristic
    (splits only when the CTAs cannot fill the GPU; per sequence by its length); k > 1 = exactly
    k kv splits per sequence (short sequences get empty splits). ``max_splits > 1`` in the result
    selects the split kernel, and the schedule then carries the merge's ``lse_index``, as it does
    with ``with_lse`` (the calls return the LSE: a cascade's parts). ``latent``: for an absorbed MLA
    latent cache (every query head in the rows, one ``block_q`` block per tile: ``KernelStatics.latent``).
    """
    config = DEFAULT_MOSAIC_CONFIG if config is None else config
    pack = choose_pack(md, num_q_heads, num_kv_heads, config, latent)
    t = md.num_tokens if num_tokens is None else num_tokens
    rows_per_tile = tile_rows(config.block_q, latent)
    num_heads = num_q_heads if pack == 1 else num_kv_heads
    s = schedule_splits(md, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, config=config, num_tokens=t,
                        num_splits=num_splits, latent=latent)
    sched = build_schedule(md.cache_seqlens, md.cu_seqlens_q * pack, num_tokens=t * pack,
                           max_q_len=md.max_q_len * pack, block_q=rows_per_tile, max_splits=s,
                           num_kv_heads=num_heads, force_splits=num_splits is not None, num_sms=config.num_sms,
                           min_kv_per_split=config.min_kv_per_split, split_waves=config.split_waves)
    k_lens = jnp.minimum(md.cache_seqlens, md.max_pages * md.page_size)  # loops never pass the page table
    sched = dataclasses.replace(sched, pack=pack, heads=(num_q_heads, num_kv_heads),
                                tile_info=tile_table(sched, k_lens, md.cu_seqlens_q, rows_per_tile=rows_per_tile))
    if s > 1 or with_lse:
        sched = dataclasses.replace(sched, lse_index=lse_index(sched, md.cu_seqlens_q, num_tokens=t,
                                                               num_q_heads=num_q_heads, num_heads=num_heads,
                                                               block_q=config.block_q, latent=latent))
    return sched


def schedule_splits(md: AttentionMetadata, *, num_q_heads: int, num_kv_heads: int, config: MosaicConfig,
                    num_tokens: int | None = None, num_splits: int | None = 1, latent: bool = False) -> int:
    """The static bound S on kv splits of ``plan_mosaic_schedule``'s schedule for these arguments (host only:
    reads the plan's static fields, so a plan of shapes will do). S > 1: the split kernel and its merge."""
    pack = choose_pack(md, num_q_heads, num_kv_heads, config, latent)
    return static_num_splits(
        num_splits=num_splits, num_tokens=md.num_tokens if num_tokens is None else num_tokens,
        max_q_len=md.max_q_len, pack=pack, num_heads=num_q_heads if pack == 1 else num_kv_heads,
        max_kv_len=md.max_kv_len, block_rows=tile_rows(config.block_q, latent), max_splits=config.max_splits,
        num_sms=config.num_sms, split_waves=config.split_waves, min_kv_per_split=config.min_kv_per_split,
        split_below_fill=config.latent_split_below_fill if latent else config.split_below_fill)


def tile_table(sched, cache_seqlens: jax.Array, cu_seqlens_q: jax.Array, *, rows_per_tile: int) -> jax.Array:
    """``i32[N, TILE_INFO_WORDS]``: what the kernel needs of each tile, in one row (the columns of
    ``mosaic_kernel.TILE_INFO_COLUMNS``, zero-padded). A CTA reads its row in one round of loads;
    looking the lengths up by sequence would put one more dependent load before its first
    page-table read and TMA copy."""
    seq = jnp.maximum(sched.tile_seq, 0)
    cu = cu_seqlens_q.astype(jnp.int32)
    cols = dict(seq=sched.tile_seq, first_row=sched.tile_q_block * rows_per_tile, split=sched.tile_split,
                k_len=cache_seqlens.astype(jnp.int32)[seq], q_start=cu[seq], q_len=cu[seq + 1] - cu[seq],
                seq_splits=sched.seq_num_splits[seq])
    pad = [jnp.zeros_like(seq)] * (TILE_INFO_WORDS - len(TILE_INFO_COLUMNS))
    return jnp.stack([cols[name] for name in TILE_INFO_COLUMNS] + pad, axis=1).astype(jnp.int32)


def kernel_statics(*, num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, head_dim_v: int,
                   page_size: int, pack: int, dtype, causal: bool = True, window_size=(-1, -1),
                   softcap: float = 0.0, softmax_scale: float | None = None, has_sinks: bool = False,
                   return_lse: bool = False, config: MosaicConfig | None = None,
                   interpret: bool = False, num_splits: int = 1, max_q_len: int | None = None,
                   latent: int = 0) -> KernelStatics:
    """The kernel's trace-time constants for one call shape (the row view follows ``pack``;
    ``num_splits > 1``: the split kernel, which always writes the LSE; ``max_q_len``: the static bound
    on queries per sequence, which lets packed decode run one compute warpgroup, ``MosaicConfig.solo``;
    ``latent``: an absorbed MLA latent cache's value columns, ``head_dim_v``, with ``pack`` = every query head)."""
    config = DEFAULT_MOSAIC_CONFIG if config is None else config
    g = num_q_heads // num_kv_heads
    block_kv, stages = config.block_kv, config.stages
    solo = (config.solo and pack > 1 and not latent and max_q_len is not None
            and max_q_len * pack <= config.block_q)
    many = num_tokens * num_kv_heads >= config.decode_min_ctas and not config.batch_invariant
    if pack > 1 and num_splits == 1 and many:
        block_kv = config.decode_block_kv or block_kv
        stages = config.decode_stages or stages
    elif solo and num_splits > 1:
        block_kv = config.split_decode_block_kv or block_kv
        stages = config.split_decode_stages or stages
    elif solo:
        block_kv = config.solo_block_kv or block_kv
        stages = config.solo_stages or stages
    if max(head_dim, head_dim_v) > 128:
        block_kv = 64  # 64 x Dv float32 accumulators leave registers for 64 keys of scores, not 128
    itemsize = jnp.dtype(dtype).itemsize
    if pack > 1 and not latent and not packed_rows_aligned(head_dim, head_dim_v, itemsize, pack, config):
        raise NotImplementedError(f"impl='mosaic': {pack} packed query heads at head dims {head_dim}/{head_dim_v} "
                                  "(unaligned TMA copies); use impl='triton'")
    st = KernelStatics(
        num_rows=num_tokens * pack, num_heads=num_q_heads if pack == 1 else num_kv_heads, kv_group=g // pack,
        pack=pack, page_size=page_size, block_q=config.block_q, block_kv=block_kv, stages=stages,
        head_dim=head_dim, head_dim_v=head_dim_v, causal=causal, window=tuple(int(w) for w in window_size),  # type: ignore[arg-type]
        softcap=float(softcap), scale=float(head_dim**-0.5 if softmax_scale is None else softmax_scale),
        has_sinks=has_sinks, return_lse=return_lse or num_splits > 1, dtype=jnp.dtype(dtype), interpret=interpret,
        num_splits=num_splits, early_k_wait=config.early_k_wait and pack == 1,
        solo=solo, spread_copies=config.spread_copies, store_read_wait=config.store_read_wait, latent=latent,
    )
    return fit_shared_memory(st)


def pack_rows(q, pack: int, num_kv_heads: int, latent: bool = False):
    """``q [T, Hq, D]`` -> the kernel's q argument: itself, or with packed rows the free view
    ``[T, Hkv, G, D]`` (a latent cache's: ``[T * Hq, 1, D]``, rows in q's own order)."""
    t, hq, d = q.shape
    if latent:
        return q.reshape(t * hq, 1, d)
    if pack == 1:
        return q
    return q.reshape(t, num_kv_heads, pack, d)


def _plan_in_call(plan, *args, **kw):
    """``plan(*args, **kw)`` inside a kernel call: what a standalone call without a fitting plan does
    (the backend and the torch bridge pass the step's; their tests make this raise)."""
    return plan(*args, **kw)


def paged_attention_mosaic(
    q: jax.Array,  # [T, Hq, D]
    k_cache: jax.Array,  # [num_pages, page_size, Hkv, D]
    v_cache: jax.Array | None,  # [num_pages, page_size, Hkv, Dv]; None: an MLA latent cache (``latent_dim``)
    md: AttentionMetadata,
    *,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    sinks: jax.Array | None = None,  # f32[Hq]
    k_descale=None,
    v_descale=None,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    num_splits: int | None = None,
    config: MosaicConfig | None = None,
    interpret=None,
    latent_dim: int | None = None,
):
    """Paged attention with the Mosaic GPU kernel (same semantics as ``triton_paged.paged_attention``).

    ``md.mosaic_schedule`` is used when it fits the call (a planner attaches it once per step;
    ``num_splits=None`` accepts its splits, an explicit ``num_splits`` must match its bound).
    ``num_splits``: None = split-KV by the heuristic (``plan_mosaic_schedule``); 1 = no split
    (deterministic, batch invariant); k > 1 = exactly k kv splits per sequence.

    ``v_cache=None`` with ``latent_dim``: absorbed MLA over one latent cache ``[pages, page_size, 1, D]``
    whose values are the first ``latent_dim`` columns of each key row (``KernelStatics.latent``).

    Returns ``out [T, Hq, Dv]`` (zeros for padding tokens) and, with ``return_lse``, ``lse f32[T, Hq]``.
    Raises ``NotImplementedError`` for what the kernel does not cover (see ``supports``).
    """
    config = DEFAULT_MOSAIC_CONFIG if config is None else config
    if interpret is None and interpret_default():
        interpret = plgpu.InterpretGPUParams()
    reason = supports(q, k_cache, v_cache, md, k_descale=k_descale, v_descale=v_descale, latent_dim=latent_dim,
                      has_sinks=sinks is not None)
    if reason is not None:
        raise NotImplementedError(f"impl='mosaic': {reason}; use impl='triton'")
    latent = v_cache is None
    t, hq, d = q.shape
    _, page_size, hkv, dv = k_cache.shape[:3] + (latent_dim,) if latent else v_cache.shape
    if hq % hkv:
        raise ValueError(f"{hq=} query heads must be a multiple of {hkv=} kv heads")
    if page_size != md.page_size:
        raise ValueError(f"cache page size {page_size} != metadata page_size {md.page_size}")
    sched = md.mosaic_schedule
    if (sched is None or sched.tile_info is None or sched.block_q != tile_rows(config.block_q, latent)
            or sched.pack != choose_pack(md, hq, hkv, config, latent) or not sched.fits_heads(hq, hkv)
            or (num_splits is not None and sched.max_splits != num_splits)):
        sched = _plan_in_call(plan_mosaic_schedule, md, num_q_heads=hq, num_kv_heads=hkv, config=config,
                              num_tokens=t, num_splits=num_splits, latent=latent)
    pack = sched.pack
    st = kernel_statics(num_tokens=t, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, head_dim_v=dv,
                        page_size=page_size, pack=pack, dtype=q.dtype, causal=causal, window_size=window_size,
                        softcap=softcap, softmax_scale=softmax_scale, has_sinks=sinks is not None,
                        return_lse=return_lse, config=config, interpret=interpret is not None,
                        num_splits=sched.max_splits, max_q_len=md.max_q_len, latent=dv if latent else 0)
    tables = (md.page_table.astype(jnp.int32), md.cu_seqlens_q.astype(jnp.int32), sched.tile_info)
    # Without sinks the kernel never reads its sinks argument: an array that exists already stands
    # in for it (zeros made here would be one more kernel per call, 0.9 us on an H100).
    sinks_arr = tables[1] if sinks is None else sinks.astype(jnp.float32)
    index = sched.lse_index  # planned once per step (split schedules, ``with_lse``); else built here
    if (st.split or return_lse) and (index is None or index.shape != (st.num_splits, t * hq)):
        index = _plan_in_call(lse_index, sched, md.cu_seqlens_q, num_tokens=t, num_q_heads=hq,
                              num_heads=st.num_heads, block_q=config.block_q, latent=latent)
    q_rows = pack_rows(q, pack, hkv, latent)
    v_cache = k_cache if latent else v_cache  # (the kernel reads a latent cache's values from its key rows)
    if st.split:
        part_o, lse_tiles = kernel_call_split(st, sched.tile_seq.shape[0], interpret)(
            q_rows, k_cache, v_cache, *tables, sinks_arr)
        out, lse = merge_partials(part_o, lse_tiles, index, out_dtype=q.dtype,
                                  interpret=interpret is not None or interpret_default())
        out, lse = out.reshape(t, hq, dv), lse.reshape(t, hq)
        return (out, lse) if return_lse else out
    out, lse_tiles = kernel_call(st, sched.tile_seq.shape[0], interpret)(
        q_rows, k_cache, v_cache, *tables, sinks_arr)
    out = out.reshape(t, hq, dv)
    if not return_lse:
        return out
    index = index[0]
    lse = jnp.where(index >= 0, lse_tiles.reshape(-1)[jnp.maximum(index, 0)], -jnp.inf)
    return out, lse.reshape(t, hq)
