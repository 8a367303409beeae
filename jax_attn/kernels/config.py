"""Knobs of the Pallas (Triton-lowered) paged attention kernels.

A ``KernelConfig`` is frozen and hashable so it can be passed as a static argument of ``jax.jit``.
"""

from __future__ import annotations

import dataclasses

# Streaming multiprocessors on H100 SXM and H200: the default target of the split heuristic.
HOPPER_NUM_SMS = 132


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
      max_splits: static upper bound on KV splits per sequence when ``num_splits`` is left to the
        heuristic.
      min_kv_per_split: the heuristic never gives a split fewer keys than this.
      num_sms: multiprocessors the heuristic tries to fill.
      split_waves: programs per multiprocessor the split heuristic aims for when the (kv head,
        query block) tiles alone leave multiprocessors idle (memory-bound decode wants several
        programs in flight per multiprocessor).
      merge_block_rows: rows (token, head pairs) per program of the split-merge kernel.
      merge_num_warps: warps per program of the merge kernels.
      fast_exp2: use the hardware ``ex2.approx.ftz.f32`` for the softmax exponentials when
        compiled (the interpreter always uses ``jnp.exp2``).
    """

    block_m: int = 128
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    decode_block_k: int | None = 128
    decode_num_warps: int | None = 4
    decode_num_stages: int | None = 2
    max_splits: int = 16
    min_kv_per_split: int = 512
    num_sms: int = HOPPER_NUM_SMS
    split_waves: int = 4
    merge_block_rows: int = 16
    merge_num_warps: int = 4
    fast_exp2: bool = True

    def __post_init__(self):
        for name in ("block_m", "block_k", "num_warps", "merge_block_rows", "merge_num_warps"):
            v = getattr(self, name)
            if not _is_pow2(v):
                raise ValueError(f"{name}={v} must be a power of 2 (e.g. 64 or 128)")
        if self.block_m < 16 or self.block_k < 16:
            raise ValueError(f"{self.block_m=} and {self.block_k=} must be >= 16 (tensor-core tiles)")
        if self.decode_block_k is not None and (not _is_pow2(self.decode_block_k) or self.decode_block_k < 16):
            raise ValueError(f"{self.decode_block_k=} must be a power of 2 >= 16, or None")
        if self.decode_num_warps is not None and not _is_pow2(self.decode_num_warps):
            raise ValueError(f"{self.decode_num_warps=} must be a power of 2, or None")
        for name in ("num_stages", "decode_num_stages"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name}={v} must be >= 1")
        if self.max_splits < 1:
            raise ValueError(f"{self.max_splits=} must be >= 1")
        if self.min_kv_per_split < 1 or self.num_sms < 1 or self.split_waves < 1:
            raise ValueError(f"{self.min_kv_per_split=}, {self.num_sms=} and {self.split_waves=} must be >= 1")

    def tile_params(self, decode: bool) -> tuple[int, int, int]:
        """(block_k, num_warps, num_stages) for decode or multi-token tiles."""
        if not decode:
            return self.block_k, self.num_warps, self.num_stages
        pick = lambda v, d: d if v is None else v
        return (
            pick(self.decode_block_k, self.block_k),
            pick(self.decode_num_warps, self.num_warps),
            pick(self.decode_num_stages, self.num_stages),
        )


DEFAULT_CONFIG = KernelConfig()


def next_pow2(x: int) -> int:
    """Smallest power of 2 >= x (x >= 1)."""
    return 1 << max(0, (int(x) - 1).bit_length())


def choose_block_q(config: KernelConfig, group: int, max_q_len: int) -> int:
    """Query tokens per tile: 1 for decode, else ``block_m // group`` capped by ``max_q_len``."""
    if max_q_len <= 1:
        return 1
    return max(1, min(config.block_m // group, max_q_len))


def tile_rows(block_q: int, group: int) -> int:
    """M, the padded row count of a tile: next power of 2 of ``block_q * group``, at least 16."""
    return next_pow2(max(16, block_q * group))
