"""Metadata types: what a planner returns once per step and every layer reads.

Dimension legend used in the shape comments:
  B   padded batch size (the bucket; padded rows are real rows of length 1 on request 0)
  T   padded token count (the token bucket); tokens past cu_seqlens_q[B] are padding
  P   page-table width in pages (static upper bound)
  E   encoder page-table width in slots (static upper bound)
  N   number of kernel work tiles (static upper bound)

All arrays are int32. A field's comment says which prefix holds valid values.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional, dataclass_transform

import jax


class ForwardMode(enum.IntEnum):
    """SGLang's forward modes (``sglang.srt.model_executor.forward_batch_info``)."""

    EXTEND = 1
    DECODE = 2
    MIXED = 3
    IDLE = 4
    TARGET_VERIFY = 5
    DRAFT_EXTEND = 6
    DRAFT_EXTEND_V2 = 7
    SPLIT_PREFILL = 8

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_extend(self) -> bool:
        """Modes whose queries are ragged new tokens (prefill-like)."""
        return self in (
            ForwardMode.EXTEND,
            ForwardMode.MIXED,
            ForwardMode.DRAFT_EXTEND,
            ForwardMode.DRAFT_EXTEND_V2,
            ForwardMode.TARGET_VERIFY,
            ForwardMode.SPLIT_PREFILL,
        )

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend(self) -> bool:
        return self in (ForwardMode.DRAFT_EXTEND, ForwardMode.DRAFT_EXTEND_V2)

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_decode_or_idle(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)


@dataclass_transform(frozen_default=True)  # type checkers see the dataclass fields
def _pytree_dataclass(cls):
    """Frozen dataclass registered as a pytree; fields marked ``static`` become meta fields."""
    cls = dataclasses.dataclass(frozen=True)(cls)
    data, meta = [], []
    for f in dataclasses.fields(cls):
        (meta if f.metadata.get("static") else data).append(f.name)
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)


def static_field(**kw):
    return dataclasses.field(metadata={"static": True}, **kw)


@_pytree_dataclass
class EncoderMetadata:
    """Cross-attention (encoder) tables. Each request may have its own encoder length."""

    encoder_lens: jax.Array  # i32[B]; encoder tokens per request
    encoder_cu_seqlens_k: jax.Array  # i32[B + 1]; exclusive prefix sum of encoder_lens
    encoder_page_table: jax.Array  # i32[B, E]; slots of the encoder tokens; [i, :encoder_lens[i]] valid
    max_encoder_len: int = static_field()  # E, static upper bound on encoder_lens
    out_cache_loc: Optional[jax.Array] = None  # i32[sum encoder_lens]; slots cross layers write K/V to
    schedule: Optional[WorkSchedule] = None  # the kernel's tiles of cross attention (``backend.attach_schedule``)


@_pytree_dataclass
class WorkSchedule:
    """Kernel work tiles: one (sequence, query block, kv split) per entry, built on device."""

    tile_seq: jax.Array  # i32[N]; sequence of each tile; [:num_tiles] valid, the rest -1
    tile_q_block: jax.Array  # i32[N]; query block index within the sequence
    tile_split: jax.Array  # i32[N]; kv split index within the sequence
    seq_num_splits: jax.Array  # i32[B]; kv splits used by each sequence (>= 1)
    num_tiles: jax.Array  # i32[]; number of valid tiles
    block_q: int = static_field()  # queries per tile
    max_splits: int = static_field()  # static upper bound on seq_num_splits
    pack: int = static_field(default=1)  # rows per query token (query heads packed per kv head)
    heads: tuple = static_field(default=())  # (Hq, Hkv) it was planned for; a call with others plans its own
    lse_index: Optional[jax.Array] = None  # i32[S, T * Hq]; Mosaic split kernel: where each split's LSE is
    tile_info: Optional[jax.Array] = None  # i32[N, 8]; Mosaic kernel: each tile's row (``mosaic_paged.tile_table``)

    def fits_heads(self, num_q_heads: int, num_kv_heads: int) -> bool:
        """Whether a call with these heads may run on this schedule (one planned without heads fits any)."""
        return self.heads in ((), (num_q_heads, num_kv_heads))


@_pytree_dataclass
class AttentionMetadata:
    """One step's attention metadata, shared by every layer.

    Built by the planners in ``jax_attn.planner``. Bucket sizes, page size and mode are static
    (changing them recompiles); everything else is device data (changing it does not).
    """

    cache_seqlens: jax.Array  # i32[B]; KV tokens per sequence incl. the new ones; padded rows 1
    cu_seqlens_q: jax.Array  # i32[B + 1]; query offsets into the token axis
    cu_seqlens_k: jax.Array  # i32[B + 1]; exclusive prefix sum of cache_seqlens
    # i32[B, P]; page ids (slots when page_size == 1); [i, :ceil(cache_seqlens[i]/page_size)] valid
    page_table: jax.Array
    out_cache_loc: jax.Array  # i32[T]; slot written by each new token; padded tokens 0
    max_seqlen_q: jax.Array  # i32[]; longest query run in the batch
    max_seqlen_k: jax.Array  # i32[]; longest KV run in the batch
    encoder: Optional[EncoderMetadata] = None
    schedule: Optional[WorkSchedule] = None  # the Triton-lowered kernel's tiles
    mosaic_schedule: Optional[WorkSchedule] = None  # the Mosaic GPU kernel's tiles (rows of its row view)
    errors: Optional[jax.Array] = None  # i32[]; bad-input bitmask (jax_attn.safety.ERRORS), 0 = clean
    local: Optional["AttentionMetadata"] = None  # chunked local layers' virtual batch (jax_attn.local)
    # i32[B, P]; SGLang's hybrid SWAKVPool: page ids in the SWA pool that sliding-window layers read
    # (full_to_swa_index_mapping of each page's first slot, // page_size); same valid prefix as page_table
    swa_page_table: Optional[jax.Array] = None
    mode: ForwardMode = static_field(default=ForwardMode.DECODE)
    batch_size: int = static_field(default=0)  # B (padded)
    num_tokens: int = static_field(default=0)  # T (padded)
    page_size: int = static_field(default=1)
    max_q_len: int = static_field(default=1)  # static upper bound on queries per sequence
    max_pages: int = static_field(default=0)  # P

    @property
    def max_kv_len(self) -> int:
        """Static upper bound on cache_seqlens."""
        return self.max_pages * self.page_size
