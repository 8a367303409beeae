"""Work schedule of the paged attention kernel, built on device.

A tile is one (sequence, query block, kv split). Tiles are listed by estimated work, most keys
first (a longest-processing-time order that keeps the last wave of programs short). The list is
padded with ``-1`` to a static bound so the kernel grid never changes inside a bucket.

Dimension legend: B sequences, N tiles (static bound).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

from jax_attn.kernels.config import KernelConfig, cdiv, choose_block_q, kv_heads_per_program
from jax_attn.metadata import AttentionMetadata, WorkSchedule



def max_num_tiles(*, num_tokens: int, batch_size: int, max_q_len: int, block_q: int, max_splits: int) -> int:
    """Static upper bound N on the tile count of any batch in the bucket."""
    q_blocks = min(num_tokens // block_q + batch_size, batch_size * cdiv(max(max_q_len, 1), block_q), num_tokens)
    return max(1, q_blocks * max_splits)


def static_num_splits(
    *, num_tokens: int, num_kv_heads: int, block_q: int, num_splits: int | None, config: KernelConfig,
    decode: bool = False,
) -> int:
    """Static bound S on kv splits: ``num_splits`` if given, else what the token bucket can use.

    Splitting only pays when the (kv head, query block) tiles cannot fill the multiprocessors,
    so the bound shrinks as the bucket grows (which also bounds the f32 partial buffers). A
    split-KV decode launch that packs several kv heads per program (``split_kv_heads``) has fewer
    programs per tile, so it may use more splits.
    """
    if num_splits is not None:
        if num_splits < 1:
            raise ValueError(f"{num_splits=} must be >= 1 (or None for the heuristic)")
        return int(num_splits)
    tiles = num_tokens // block_q
    base = max(1, tiles * num_kv_heads)
    if base >= config.num_sms:
        return 1
    want = config.num_sms * config.split_waves  # rounded down: a partial last wave costs a whole one
    s = max(1, min(config.max_splits, want // base))
    if s > 1 and decode:
        pack = kv_heads_per_program(config, num_kv_heads, decode=True, split=True)
        s = max(1, min(config.max_splits, want // max(1, tiles * (num_kv_heads // pack))))
    return int(s)


def build_schedule(
    cache_seqlens: jax.Array,  # i32[B]
    cu_seqlens_q: jax.Array,  # i32[B + 1]
    *,
    num_tokens: int,
    max_q_len: int,
    block_q: int,
    max_splits: int,
    num_kv_heads: int = 1,
    force_splits: bool = False,
    num_sms: int = 132,
    min_kv_per_split: int = 512,
    split_waves: int = 2,
) -> WorkSchedule:
    """Lists the kernel's work tiles for one batch (jit-able; lengths are device values).

    Args:
      cache_seqlens: keys per sequence.
      cu_seqlens_q: query offsets; sequences with no query get no tile.
      num_tokens: T, the padded token count (static).
      max_q_len: static upper bound on queries per sequence.
      block_q: query tokens per tile (static).
      max_splits: static upper bound S on kv splits per sequence.
      num_kv_heads: programs per tile (kv heads, or kv-head packs), used by the heuristic.
      force_splits: give every sequence exactly ``max_splits`` splits (some may be empty).
      num_sms: multiprocessors the heuristic tries to fill.
      min_kv_per_split: the heuristic gives no split fewer keys than this.
      split_waves: programs per multiprocessor the heuristic fills at most (rounded down: a partial last
        wave costs a whole one).

    Returns:
      A ``WorkSchedule`` with ``N = max_num_tiles(...)`` entries, invalid ones ``-1``.
    """
    if block_q < 1 or max_splits < 1:
        raise ValueError(f"{block_q=} and {max_splits=} must be >= 1")
    batch = cache_seqlens.shape[0]
    if cu_seqlens_q.shape != (batch + 1,):
        raise ValueError(f"{cu_seqlens_q.shape=} must be ({batch + 1},) for {cache_seqlens.shape=}")
    cache_seqlens = cache_seqlens.astype(jnp.int32)
    cu_seqlens_q = cu_seqlens_q.astype(jnp.int32)
    q_lens = jnp.maximum(cu_seqlens_q[1:] - cu_seqlens_q[:-1], 0)
    q_blocks = cdiv(q_lens, block_q)  # i32[B]
    splits = _seq_splits(cache_seqlens, q_blocks, max_splits, num_kv_heads, force_splits, num_sms, min_kv_per_split,
                         split_waves)
    counts = q_blocks * splits
    ends = jnp.cumsum(counts).astype(jnp.int32)
    starts = ends - counts
    n = max_num_tiles(
        num_tokens=num_tokens, batch_size=batch, max_q_len=max_q_len, block_q=block_q, max_splits=max_splits
    )
    tile = jnp.arange(n, dtype=jnp.int32)
    # A tile's sequence = how many sequence ends lie at or before it: one [N, B] compare. (The default
    # binary search is an XLA while loop, whose trip predicate the host reads back on every step.)
    seq = jnp.searchsorted(ends, tile, side="right", method="compare_all").astype(jnp.int32)
    valid = seq < batch
    seq_c = jnp.minimum(seq, batch - 1)
    local = tile - starts[seq_c]
    ns = splits[seq_c]
    q_block = q_blocks[seq_c] - 1 - local // ns
    split = local % ns
    # Longest tiles first (keys seen under causal masking, per split) so the last wave is short.
    k_len, q_len = cache_seqlens[seq_c], q_lens[seq_c]
    cost = jnp.maximum(jnp.minimum(k_len, k_len - q_len + (q_block + 1) * block_q) // ns, 0)
    order = jnp.argsort(-jnp.where(valid, cost, -1), stable=True)  # valid tiles (cost >= 0) first
    neg = jnp.full((n,), -1, jnp.int32)
    return WorkSchedule(
        tile_seq=jnp.where(valid, seq_c, neg)[order],
        tile_q_block=jnp.where(valid, q_block, neg)[order],
        tile_split=jnp.where(valid, split, neg)[order],
        seq_num_splits=splits,
        num_tiles=ends[-1] if batch else jnp.int32(0),
        block_q=block_q,
        max_splits=max_splits,
    )


def _seq_splits(cache_seqlens, q_blocks, max_splits, num_kv_heads, force, num_sms, min_kv_per_split,
                split_waves):
    """i32[B] kv splits per sequence, chosen from the lengths on device."""
    if max_splits == 1 or force:
        return jnp.full(cache_seqlens.shape, max_splits, jnp.int32)
    base = jnp.maximum(jnp.sum(q_blocks) * num_kv_heads, 1)
    want = jnp.where(base >= num_sms, 1, jnp.maximum(jnp.int32(num_sms * split_waves) // base, 1))
    by_len = cdiv(cache_seqlens, min_kv_per_split)
    return jnp.clip(jnp.minimum(want, by_len), 1, max_splits).astype(jnp.int32)


def plan_schedule(
    md: AttentionMetadata,
    *,
    num_q_heads: int,
    num_kv_heads: int,
    config: KernelConfig,
    num_splits: int | None = None,
    num_tokens: int | None = None,
) -> WorkSchedule:
    """The schedule ``paged_attention`` would build for ``md`` (a planner may attach it once per step).

    ``num_tokens`` defaults to ``md.num_tokens``; pass it when the metadata leaves that at 0.
    """
    num_tokens = md.num_tokens if num_tokens is None else num_tokens
    group = num_q_heads // num_kv_heads
    decode = md.max_q_len <= 1
    block_q = choose_block_q(config, group, md.max_q_len)
    s = static_num_splits(
        num_tokens=num_tokens, num_kv_heads=num_kv_heads, block_q=block_q, num_splits=num_splits, config=config,
        decode=decode,
    )
    pack = kv_heads_per_program(config, num_kv_heads, decode=decode, split=s > 1)
    sched = build_schedule(
        md.cache_seqlens,
        md.cu_seqlens_q,
        num_tokens=num_tokens,
        max_q_len=md.max_q_len,
        block_q=block_q,
        max_splits=s,
        num_kv_heads=num_kv_heads // pack,  # programs per tile
        force_splits=num_splits is not None,
        num_sms=config.num_sms,
        min_kv_per_split=config.min_kv_per_split,
        split_waves=config.split_waves,
    )
    return dataclasses.replace(sched, heads=(num_q_heads, num_kv_heads))


def num_splits_for(deterministic: bool) -> Optional[int]:
    """The kernels' ``num_splits`` argument of a backend: one kv split per sequence when ``deterministic`` (a
    fixed reduction order), else None (the heuristic)."""
    return 1 if deterministic else None


def step_schedule(md: AttentionMetadata, *, num_q_heads: int, num_kv_heads: int, deterministic: bool) -> WorkSchedule:
    """The schedule a step's plan carries for layers of these heads (``FlashAttentionBackend.attach_schedule``;
    the torch bridge's Triton launch tables): the default config, one kv split per sequence when
    ``deterministic``, else the heuristic."""
    from jax_attn.kernels.config import DEFAULT_CONFIG

    return plan_schedule(md, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, config=DEFAULT_CONFIG,
                         num_splits=num_splits_for(deterministic))
