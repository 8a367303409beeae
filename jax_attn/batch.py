"""Host-side description of one step (SGLang's ``ForwardBatch`` fields) and bucket padding.

Padding follows SGLang's CUDA-graph rules: padded rows get ``seq_len = SEQ_LEN_FILL_VALUE``,
request row 0 (reserved) and output slot 0 (reserved); padded extend rows get zero new tokens.
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Optional, Sequence

import numpy as np

from jax_attn.kernels.config import cdiv
from jax_attn.metadata import ForwardMode
from jax_attn.safety import check_int32

SEQ_LEN_FILL_VALUE = 1  # get_cuda_graph_seq_len_fill_value()
DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)


@dataclasses.dataclass(frozen=True)
class SpecInfo:
    """The speculative-decoding fields the planners read (EAGLE's ``spec_info``)."""

    topk: int = 1
    num_draft_tokens: int = 0  # queries per request in target verify
    step_id: int = 0  # draft decode (DECODE with spec_info): kv offset = step_id + 1
    num_accepted_tokens: Optional[np.ndarray] = None  # i32[bs], draft extend: accepted drafts + 1 (SGLang 0.5.11)
    accept_length: Optional[np.ndarray] = None  # i32[bs], draft extend, older name: accepted drafts
    num_steps: int = 1  # draft steps; tree draft decode's out_cache_loc is [bs, topk, num_steps]
    draft_mask: Optional[np.ndarray] = None  # bool[bs, N, N]; tree verify (see spec.draft_mask_from_custom_mask)
    with_swa: bool = False  # tree (topk > 1) verify and draft decode: also build the sliding-window table

    def is_tree(self) -> bool:
        return self.topk > 1


def accepted_tokens(spec_info):
    """New tokens per request of a draft extend: SGLang 0.5.11's ``num_accepted_tokens``, or the older
    ``accept_length + 1``; None when ``spec_info`` carries neither. Works on numpy and torch alike."""
    n = getattr(spec_info, "num_accepted_tokens", None)
    if n is not None:
        return n
    acc = getattr(spec_info, "accept_length", None)
    return None if acc is None else acc + 1


@dataclasses.dataclass(frozen=True)
class ForwardBatch:
    """One step's batch on the host (numpy int32), SGLang names.

    ``seq_lens`` count every KV token including this step's new ones, except in target verify,
    where SGLang passes the committed length and the draft tokens are added by the planner.
    """

    forward_mode: ForwardMode
    req_pool_indices: np.ndarray  # i32[bs]
    seq_lens: np.ndarray  # i32[bs]
    out_cache_loc: np.ndarray  # i32[num_tokens]
    extend_seq_lens: Optional[np.ndarray] = None  # i32[bs]; extend modes
    encoder_lens: Optional[np.ndarray] = None  # i32[bs]; cross attention
    spec_info: Optional[SpecInfo] = None
    encoder_out_cache_loc: Optional[np.ndarray] = None  # i32[sum encoder_lens]; cross layers' K/V slots

    def __post_init__(self):
        for name in ("req_pool_indices", "seq_lens", "out_cache_loc", "extend_seq_lens", "encoder_lens",
                     "encoder_out_cache_loc"):
            x = getattr(self, name)
            if x is not None:  # int64 values outside int32 raise (never wrap)
                object.__setattr__(self, name, check_int32(name, x))
        if self.req_pool_indices.shape != self.seq_lens.shape:
            raise ValueError(f"{self.req_pool_indices.shape=} must equal {self.seq_lens.shape=}")

    @property
    def batch_size(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.out_cache_loc.shape[0]) // self.cache_locs_per_token()

    def is_tree_draft_decode(self) -> bool:
        return self.forward_mode == ForwardMode.DECODE and self.spec_info is not None and self.spec_info.is_tree()

    def cache_locs_per_token(self) -> int:
        """Tree draft decode carries every draft step's slots: ``num_steps`` per query token."""
        return self.spec_info.num_steps if self.is_tree_draft_decode() else 1

    def tokens_per_req_bound(self) -> Optional[int]:
        """Static tokens per request when the mode is capturable (uniform or draft extend), else None."""
        if self.forward_mode.is_draft_extend():
            return self.spec_info.num_draft_tokens or None
        if self.forward_mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
            return self.q_len_per_req()
        return None

    def q_len_per_req(self) -> int:
        """Queries per request for uniform modes (decode, draft decode, verify)."""
        if self.forward_mode == ForwardMode.TARGET_VERIFY:
            return self.spec_info.num_draft_tokens
        return self.spec_info.topk if self.is_tree_draft_decode() else 1


def bucket_for(n: int, buckets: Sequence[int]) -> Optional[int]:
    """Smallest bucket >= n, or None when n exceeds every bucket."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


def batch_class(bs: int) -> int:
    """The compiled batch size that serves a padded batch of ``bs`` rows: the smallest of
    ``DEFAULT_BATCH_BUCKETS`` that holds it, past the last one the next multiple of 64. Graph buckets of
    one class share their compiled plan and kernels (the torch bridge's capture hook)."""
    if bs < 1:
        raise ValueError(f"{bs=} must be >= 1")
    return bucket_for(bs, DEFAULT_BATCH_BUCKETS) or cdiv(bs, 64) * 64


def token_class(n: int) -> int:
    """The compiled token count that serves an eager ragged step (extend, mixed, draft extend) of ``n``
    tokens: the smallest of 16, 24, 32, 48, 64, 96, ... (powers of two and 1.5 times them) that holds it,
    so a class pads at most a third and ragged traffic compiles two classes per doubling of its size."""
    if n < 1:
        raise ValueError(f"{n=} must be >= 1")
    c = 16
    while c < n:
        c = c * 3 // 2 if c & (c - 1) == 0 else c * 4 // 3
    return c


RAGGED_MIN_ROWS = 16  # rows of an eager ragged step of few requests on a GPU (the smallest token class)


def ragged_rows(bs: int, min_rows: int = RAGGED_MIN_ROWS) -> int:
    """The compiled row count of an eager ragged step (extend, mixed, draft extend) of ``bs`` requests: the
    batch class of at least ``min_rows``. With the default, steps of up to 16 requests differ only in their
    token class, so chunked-prefill traffic compiles one plan and one kernel per token class, not per (batch
    class, token class) pair (five times as many). A padded row costs a page-table row and a work-tile slot
    that holds no work: nothing on a GPU, where such a program exits at once, but a grid step of the
    interpreted kernel on the CPU, where the torch bridge passes ``min_rows=1``."""
    return batch_class(max(bs, min_rows))


def _pad(x: Optional[np.ndarray], size: int, fill: int) -> Optional[np.ndarray]:
    if x is None or x.shape[0] == size:
        return x
    out = np.full((size,) + x.shape[1:], fill, np.int32)
    out[: x.shape[0]] = x
    return out


def pad_batch(batch: ForwardBatch, bs: int, num_tokens: int) -> ForwardBatch:
    """Pad to ``bs`` rows and ``num_tokens`` tokens with SGLang's fill rules."""
    if bs < batch.batch_size or num_tokens < batch.num_tokens:
        raise ValueError(f"cannot pad {batch.batch_size=}, {batch.num_tokens=} down to {bs=}, {num_tokens=}")
    if bs == batch.batch_size and num_tokens == batch.num_tokens:
        return batch  # a full bucket: nothing to pad (saves host time on every replay)
    spec = batch.spec_info
    if spec is not None and accepted_tokens(spec) is not None:  # padded rows: no new token
        spec = dataclasses.replace(spec, num_accepted_tokens=_pad(np.asarray(accepted_tokens(spec), np.int32), bs, 0),
                                   accept_length=None)
    if spec is not None and spec.draft_mask is not None:
        mask = np.zeros((bs,) + spec.draft_mask.shape[1:], bool)  # padded rows see no draft token
        mask[: batch.batch_size] = spec.draft_mask
        spec = dataclasses.replace(spec, draft_mask=mask)
    return dataclasses.replace(
        batch,
        req_pool_indices=_pad(batch.req_pool_indices, bs, 0),
        seq_lens=_pad(batch.seq_lens, bs, SEQ_LEN_FILL_VALUE),
        out_cache_loc=_pad(batch.out_cache_loc, num_tokens * batch.cache_locs_per_token(), 0),
        extend_seq_lens=_pad(batch.extend_seq_lens, bs, 0),
        encoder_lens=_pad(batch.encoder_lens, bs, 0),
        spec_info=spec,
    )


def _first(mask: np.ndarray) -> int:
    return int(np.argmax(mask))


def check_lengths(mode: ForwardMode, seq_lens: np.ndarray, extend_seq_lens: Optional[np.ndarray], num_tokens: int,
                  *, capacity: int, kv_offset: int = 0, padded: bool = False) -> None:
    """Host checks of a step's lengths (numpy, no device work), each error saying what to fix.

    ``seq_lens`` as SGLang passes them (target verify and draft decode: before ``kv_offset``);
    ``capacity``: KV positions the page table holds; ``padded``: the token count is a bucket.
    """
    if mode == ForwardMode.IDLE:
        return
    if seq_lens.shape[0] == 0:
        raise ValueError(f"a {mode.name} batch of size 0: plan an empty step as ForwardMode.IDLE")
    if extend_seq_lens is None and 1 - kv_offset <= seq_lens.min() and seq_lens.max() <= capacity - kv_offset:
        return  # the common case in two reductions; the checks below name the first bad row
    kv = seq_lens + kv_offset
    if (seq_lens < 0).any():
        i = _first(seq_lens < 0)
        raise ValueError(f"seq_lens[{i}]={seq_lens[i]} is negative")
    if (kv > capacity).any():
        i = _first(kv > capacity)
        raise ValueError(f"seq_lens[{i}]={seq_lens[i]} needs {kv[i]} KV positions but the page table holds "
                         f"{capacity} (max_context_len): raise max_context_len or check seq_lens")
    if extend_seq_lens is None:
        if (kv < 1).any():
            i = _first(kv < 1)
            raise ValueError(f"seq_lens[{i}]=0 in a {mode.name} row: a query token needs its own key "
                             "(seq_lens count the new token)")
        return
    ext = extend_seq_lens
    if (ext < 0).any() or (ext > seq_lens).any():
        i = _first((ext < 0) | (ext > seq_lens))
        raise ValueError(f"extend_seq_lens[{i}]={ext[i]} must lie in [0, seq_lens[{i}]={seq_lens[i]}] "
                         "(seq_len = prefix_len + extend_len)")
    total = int(ext.sum())
    if total > num_tokens or (not padded and total != num_tokens):
        raise ValueError(f"sum(extend_seq_lens)={total} must equal the step's {num_tokens} tokens "
                         "(out_cache_loc entries / q rows)")


def check_batch(batch: ForwardBatch, *, num_rows: int, capacity: int, kv_offset: int = 0, num_slots: int = 0,
                padded: bool = False) -> None:
    """Every host check of a JAX ``ForwardBatch``: lengths, request rows and (with ``num_slots``) slots."""
    check_lengths(batch.forward_mode, batch.seq_lens, accepted_tokens(batch.spec_info)
                  if batch.forward_mode.is_draft_extend() and batch.extend_seq_lens is None else batch.extend_seq_lens,
                  batch.num_tokens, capacity=capacity, kv_offset=kv_offset, padded=padded)
    rows = batch.req_pool_indices
    if ((rows < 0) | (rows >= num_rows)).any():
        i = _first((rows < 0) | (rows >= num_rows))
        raise ValueError(f"req_pool_indices[{i}]={rows[i]} is outside the {num_rows} rows of req_to_token")
    loc = batch.out_cache_loc
    if num_slots and ((loc < 0) | (loc >= num_slots)).any():
        i = _first((loc < 0) | (loc >= num_slots))
        raise ValueError(f"out_cache_loc[{i}]={loc[i]} is outside the KV pool's {num_slots} slots: "
                         "allocate slots from the pool")
