"""Knobs of the Pallas (Triton-lowered) paged attention kernels.

A ``KernelConfig`` is frozen and hashable so it can be passed as a static argument of ``jax.jit``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax

# Streaming multiprocessors on H100 SXM and H200: the default target of the split heuristic.
HOPPER_NUM_SMS = 132


def cdiv(a, b):
    """Ceiling division for Python ints and JAX integer arrays alike (the one copy)."""
    return -(-a // b)


_CPU_TRACE = contextvars.ContextVar("jax_attn_cpu_trace", default=False)


def interpret_default() -> bool:
    """Whether a Pallas kernel traced now runs in the interpreter when its caller does not say: when JAX's
    default backend is the CPU, or inside ``tracing_for_cpu`` (arrays on the CPU of a GPU machine)."""
    return _CPU_TRACE.get() or jax.default_backend() == "cpu"


@contextlib.contextmanager
def tracing_for_cpu(on: bool = True):
    """Trace (``jit(...).lower``) for arrays that live on the CPU although JAX's default backend is a GPU
    (a torch engine with CPU pools on a GPU machine): kernels traced inside run interpreted."""
    token = _CPU_TRACE.set(bool(on) or _CPU_TRACE.get())
    try:
        yield
    finally:
        _CPU_TRACE.reset(token)


def _is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and compiler knobs of ``paged_attention``.

    Attributes:
      block_m: target rows per tile for multi-token queries; a row is one (query token, query
        head) pair of a kv head, so a tile holds ``block_m // group`` query tokens (at least 1).
        Decode (``max_q_len == 1``) always uses one token per tile.
      block_k: keys per inner-loop step (power of 2, >= 16).
      num_warps: warps per program for the attention kernel.
      num_stages: software-pipelining depth of the key loop.
      decode_block_k / decode_num_warps / decode_num_stages: the same for decode tiles
        (``max_q_len == 1``); ``None`` means "use the prefill value".
      split_block_k / split_num_warps / split_num_stages: the same for decode tiles of a split-KV
        launch (few sequences, long contexts); ``None`` means "use the decode value".
      split_kv_heads: kv heads one program of a split-KV decode launch handles (power of 2); the
        kernel uses the largest power of 2 dividing both this and Hkv. Packing heads fills the
        16-row tile that a small GQA group leaves mostly empty and makes each key's rows of those
        heads one contiguous read; each loop step then moves ``block_k * split_kv_heads`` rows.
      max_splits: static upper bound on KV splits per sequence when ``num_splits`` is left to the
        heuristic.
      min_kv_per_split: the heuristic never gives a split fewer keys than this.
      num_sms: multiprocessors the heuristic tries to fill.
      split_waves: programs per multiprocessor the split heuristic fills at most (rounded down, so
        the splits make one wave) when the (kv head, query block) tiles alone leave multiprocessors
        idle: 2, the decode tiles' residency (196 registers, 4 warps).
      prefetch_pages: read the page ids of the next key block one loop step ahead (carried in
        the loop state), so a step's K/V addresses do not wait on a page-table load of that step.
      merge_block_rows: most rows (token, head pairs) per program of the split-merge kernel; fewer
        when that leaves multiprocessors idle (a split merge of one sequence has only Hq rows).
      merge_num_warps: warps per program of the merge kernels.
      merge_row_num_warps: warps per program of the split merge's one-row kernel (few rows: one to four
        decode sequences), which loads every split's partial row at once. H200, page 1, CUPTI, one process,
        thirty-sixth session (``benchmarks/RESULTS.md``): 1 x 32768 (32 splits) 2.2 us at 8 warps against 3.1-3.2
        at 4 (1 warp: 2.3), 2 x 16384 (16) 1.9 against 2.0, 4 x 8192 (8) 1.9 against 1.8.
      fast_exp2: use the hardware ``ex2.approx.ftz.f32`` for the softmax exponentials when
        compiled (the interpreter always uses ``jnp.exp2``).
      many_decode_tile: ``(block_k, num_warps, num_stages)`` of unsplit decode tiles over pages of at most
        ``many_decode_max_page`` rows, at head dims up to 128, in a launch of at least ``many_decode_programs``
        (token, kv head) programs (many short sequences), unless the call must be batch invariant: a shorter,
        deeper ring, whose key loads do not queue behind each key's page-table load. None: the decode tile
        everywhere. H200, 32/8 heads, d 128, CUPTI time per call, four rounds in one process (thirty-sixth
        session, ``benchmarks/RESULTS.md``), 64/4/3 against the decode tile 128/4/2: page 1 256 x 1024 (2048
        programs) 254.1 against 262.0 us, 128 x 2048 (1024) 252.1 against 255.7, 64 x 4096 (512) 252.5 against
        251.5; page 16 256 x 1024 269.3 against 256.2 (so larger pages keep the decode tile).
      many_decode_programs / many_decode_max_page: see ``many_decode_tile``.
      fp8_decode_tile / fp8_split_tile: ``(block_k, num_warps, num_stages)`` of unsplit / split-KV decode tiles
        (any batch) over 1-byte (fp8) KV at (padded) head dims up to 128 with one kv head a program
        (``split_kv_heads`` packs more into split tiles, whose own tile then holds); None: the 2-byte KV tiles.
        Such a tile converts each K/V element in registers before its dot, so it is bound by that work more than
        by bytes: a deeper ring of short key blocks over two warps helps, longer key blocks or more warps do not.
        H200, 32/8 heads, d 128, f16 dots, CUPTI time per call, ``tune.py triton-decode --kv-dtype fp8``
        (thirty-eighth session, ``benchmarks/RESULTS.md``), one run: page 16 64 x 4096 64/2/5 148.7 us, 64/2/4
        166.6, 64/2/3 166.5, 32/2/4 219.1, 64/1/4 294.1, 128/2/3 396.9; page 1 256 x 1024 64/2/5 166.0, 64/2/4
        179.2; 8 x 8192 (4 splits) 128/4/3 and 128/4/4 52.8, 64/4/4 68.4, 64/2/3 71.2. An earlier run: the
        2-byte tile 128/4/2 187.6 us at 64 x 4096 and 55.7 at 8 x 8192, 128/4/3 175.3 at 64 x 4096, 256/8/2
        296.1.
      fp8_f16_dots: over fp8 KV with 16-bit q, the dots run in f16 (q converted once a tile), not in q's
        dtype. Every e4m3 value is exact in both 16-bit types, and q's bf16 values are exact in f16 between
        2**-14 and 65504 (beyond it f16 overflows to inf and the row turns NaN, never silently wrong); e4m3 ->
        f16 is one conversion instruction per two values on sm89+, e4m3 -> bf16 goes through f16 and f32. Same
        run, 64 x 4096 decode at page 16 with the 2-byte tile: 187.6 us against 246.6 (bf16 KV: 244.2); causal
        prefill B4 S4096 took 1908 us either way in another run that session (bf16 KV: 1482).
      max_tile_elements: most float32 accumulator elements (rows x value block) of one program; a
        query-head group whose tile holds more is split over programs (MLA's 128 heads x 512 latent
        columns), each with at least 8 warps and key blocks of at most 64.
    """

    block_m: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    decode_block_k: int | None = 128
    decode_num_warps: int | None = 4
    decode_num_stages: int | None = 2
    split_block_k: int | None = None
    split_num_warps: int | None = None
    split_num_stages: int | None = None
    split_kv_heads: int = 1
    max_splits: int = 32
    min_kv_per_split: int = 512
    num_sms: int = HOPPER_NUM_SMS
    split_waves: int = 2
    prefetch_pages: bool = False
    merge_block_rows: int = 16
    merge_num_warps: int = 4
    merge_row_num_warps: int = 8
    fast_exp2: bool = True
    max_tile_elements: int = 128 * 256
    many_decode_tile: tuple[int, int, int] | None = (64, 4, 3)
    many_decode_programs: int = 1024
    many_decode_max_page: int = 1
    fp8_decode_tile: tuple[int, int, int] | None = (64, 2, 5)
    fp8_split_tile: tuple[int, int, int] | None = (128, 4, 3)
    fp8_f16_dots: bool = True

    def __post_init__(self):
        for name in ("block_m", "block_k", "num_warps", "merge_block_rows", "merge_num_warps", "merge_row_num_warps"):
            v = getattr(self, name)
            if not _is_pow2(v):
                raise ValueError(f"{name}={v} must be a power of 2 (e.g. 64 or 128)")
        if self.block_m < 16 or self.block_k < 16:
            raise ValueError(f"{self.block_m=} and {self.block_k=} must be >= 16 (tensor-core tiles)")
        for name in ("decode_block_k", "split_block_k"):
            v = getattr(self, name)
            if v is not None and (not _is_pow2(v) or v < 16):
                raise ValueError(f"{name}={v} must be a power of 2 >= 16 (e.g. 64 or 128), or None")
        for name in ("decode_num_warps", "split_num_warps"):
            v = getattr(self, name)
            if v is not None and not _is_pow2(v):
                raise ValueError(f"{name}={v} must be a power of 2 (e.g. 4 or 8), or None")
        if not _is_pow2(self.split_kv_heads):
            raise ValueError(f"{self.split_kv_heads=} must be a power of 2 (1 = one kv head per program)")
        for name in ("num_stages", "decode_num_stages", "split_num_stages"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name}={v} must be >= 1")
        if self.max_splits < 1:
            raise ValueError(f"{self.max_splits=} must be >= 1")
        for name in ("many_decode_tile", "fp8_decode_tile", "fp8_split_tile"):
            tile = getattr(self, name)
            if tile is not None and not (_is_pow2(tile[0]) and tile[0] >= 16 and _is_pow2(tile[1]) and tile[2] >= 1):
                raise ValueError(f"{name}={tile} must be (block_k, num_warps, num_stages): powers of 2 "
                                 "(block_k >= 16) and stages >= 1, e.g. (64, 4, 3); or None")
        if self.min_kv_per_split < 1 or self.num_sms < 1 or self.split_waves < 1:
            raise ValueError(f"{self.min_kv_per_split=}, {self.num_sms=} and {self.split_waves=} must be >= 1")

    def tile_params(self, decode: bool, split: bool = False, *, programs: int = 0, page_size: int = 0,
                    head_dim: int = 0, batch_invariant: bool = False, kv_itemsize: int = 2,
                    kv_pack: int = 1) -> tuple[int, int, int]:
        """(block_k, num_warps, num_stages) for multi-token tiles, decode tiles or split-KV decode tiles; unsplit
        decode tiles of a launch of ``programs`` (token, kv head) programs over pages of ``page_size`` rows at
        (padded) ``head_dim`` may get ``many_decode_tile`` (never when ``batch_invariant``); decode tiles over
        ``kv_itemsize`` 1 (fp8) of one kv head a program (``kv_pack``) get ``fp8_decode_tile`` /
        ``fp8_split_tile``."""
        if not decode:
            return self.block_k, self.num_warps, self.num_stages
        fp8_tile = self.fp8_split_tile if split else self.fp8_decode_tile
        if kv_itemsize == 1 and kv_pack == 1 and fp8_tile is not None and head_dim <= 128:
            return fp8_tile
        if (not split and not batch_invariant and self.many_decode_tile is not None
                and programs >= self.many_decode_programs and 0 < page_size <= self.many_decode_max_page
                and 0 < head_dim <= 128):
            return self.many_decode_tile
        pick = lambda v, d: d if v is None else v
        params = (
            pick(self.decode_block_k, self.block_k),
            pick(self.decode_num_warps, self.num_warps),
            pick(self.decode_num_stages, self.num_stages),
        )
        if not split:
            return params
        return (pick(self.split_block_k, params[0]), pick(self.split_num_warps, params[1]),
                pick(self.split_num_stages, params[2]))


DEFAULT_CONFIG = KernelConfig()


def next_pow2(x: int) -> int:
    """Smallest power of 2 >= x (x >= 1)."""
    return 1 << max(0, (int(x) - 1).bit_length())


def kv_heads_per_program(config: KernelConfig, num_kv_heads: int, *, decode: bool, split: bool) -> int:
    """Kv heads one attention program handles: 1, or for split-KV decode ``split_kv_heads``
    reduced to the largest power of 2 that divides ``num_kv_heads``."""
    if not (decode and split):
        return 1
    return math.gcd(config.split_kv_heads, num_kv_heads)


def choose_block_q(config: KernelConfig, group: int, max_q_len: int) -> int:
    """Query tokens per tile: 1 for decode, else ``block_m // group`` capped by ``max_q_len``."""
    if max_q_len <= 1:
        return 1
    return max(1, min(config.block_m // group, max_q_len))


def tile_rows(block_q: int, group: int) -> int:
    """M, the padded row count of a tile: next power of 2 of ``block_q * group``, at least 16."""
    return next_pow2(max(16, block_q * group))
