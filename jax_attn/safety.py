"""Bad input never reaches memory it should not: a plan guard and a device-side error flag.

``guard`` runs inside every jitted planner call (``jax_attn.plan_key.plan_arrays``, so the JAX
backend, ``StepRunner`` and the torch bridge all get it). It costs a few element-wise ops and no
host sync:

* it clamps what could send a kernel outside the pools or into a loop without end: KV lengths to
  the page table's capacity, page ids into the pool (when the pool size is known), query offsets
  into the token axis;
* it records what it found in ``AttentionMetadata.errors`` (``i32[]``, a bitmask of ``ERRORS``),
  a stale request table included: slot 0 is reserved (padding rows read and write it) and so is
  request row 0 (SGLang's ``ReqToTokenPool``), so page 0 inside a real row's length is a token the
  engine never wrote into ``req_to_token``.

Reading the flag needs a host sync, so it is read only where the caller asks: ``check(md)``
(``FlashAttentionBackend.check`` in both front ends), or on every step in validation mode
(``validate=True``, or the environment variable ``JAX_ATTN_VALIDATE=1``), which raises at the step
that went wrong, before any layer writes the cache. KV writes drop out-of-range slots either way
(``jax_attn.kv_cache.set_kv_buffer``; the torch bridge sends them to the reserved slot 0).
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_attn.metadata import AttentionMetadata

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

# bit -> what went wrong and how to fix it
ERRORS = {
    1: "req_pool_indices outside [0, req_to_token rows): pass request rows of the ReqToTokenPool",
    2: "a sequence is longer than the page table holds (seq_len > max_context_len): raise max_context_len "
       "or check seq_lens",
    4: "a page id (req_to_token entry) outside the KV pool: fill req_to_token with slots of the pool",
    8: "an out_cache_loc slot outside the KV pool: allocate slots from the pool (the write was dropped)",
    16: "query counts do not fit: extend_seq_lens sum past the token count, an extend longer than its seq_len, "
        "or a decode row with seq_len 0",
    32: "a negative length (seq_lens or extend_seq_lens)",
    64: "a full_to_swa_index_mapping entry (SGLang's SWAKVPool) outside the SWA pool, for a slot the step reads "
        "or writes: map full slots to SWA slots of the pool (0 for freed ones); the write was sent to slot 0",
    128: "a req_to_token entry inside a real request's seq_len points at the reserved slot 0 (page 0): the request "
         "table is stale; write every token's slot into req_to_token before planning (JAX API: assign the "
         "updated table to backend.req_to_token)",
}


def validate_default() -> bool:
    """Validation mode's default: the environment variable ``JAX_ATTN_VALIDATE`` (``1`` = on)."""
    return os.environ.get("JAX_ATTN_VALIDATE", "0") not in ("", "0", "false", "False")


def describe(bits: int) -> str:
    """The messages of the error bits set in ``bits``."""
    return "; ".join(msg for bit, msg in ERRORS.items() if bits & bit)


def _bit(cond, bit: int):
    return jnp.where(jnp.any(cond), jnp.int32(bit), jnp.int32(0))


def guard(md: AttentionMetadata, *, req_pool_indices, num_rows: int, num_slots: int = 0,
          capacity=None, check_queries: bool = True) -> AttentionMetadata:
    """``md`` with every index clamped into range and ``errors`` set (traceable, no host sync).

    Args:
      md: a planner's output.
      req_pool_indices: the raw request rows the plan was built from (the planners clip them).
      num_rows: rows of ``req_to_token``.
      num_slots: slots of the KV pool (0: unknown, page ids and slots are not checked).
      capacity: KV positions a sequence may hold (default ``max_pages * page_size``; may be per row).
      check_queries: flag rows with more queries than keys (off for cascade passes, where the
        other pass holds the rest of a query's keys).
    """
    cap = md.max_pages * md.page_size if capacity is None else capacity
    t = md.num_tokens
    lens = md.cache_seqlens
    q_lens = md.cu_seqlens_q[1:] - md.cu_seqlens_q[:-1]
    rows = jnp.asarray(req_pool_indices, jnp.int32)
    err = _bit((rows < 0) | (rows >= num_rows), 1)
    err |= _bit(lens > cap, 2)
    err |= _bit(md.cu_seqlens_q[-1] > t, 16)
    if check_queries:
        err |= _bit(q_lens > lens, 16)
    err |= _bit((lens < 0) | (q_lens < 0), 32)
    safe_lens = jnp.clip(lens, 0, cap)
    cu_q = jnp.clip(md.cu_seqlens_q, 0, t)
    table = md.page_table
    used = jnp.arange(md.max_pages, dtype=jnp.int32)[None, :] * md.page_size < safe_lens[:, None]
    if rows.shape[0] == table.shape[0]:  # a table of request rows (not a tree step's expand pass)
        err |= _bit(used & (rows != 0)[:, None] & (table == 0), 128)
    if num_slots:
        num_pages = num_slots // md.page_size
        err |= _bit(used & ((table < 0) | (table >= num_pages)), 4)
        table = jnp.clip(table, 0, num_pages - 1)
        real = jnp.arange(t, dtype=jnp.int32) < cu_q[-1]
        err |= _bit(real & ((md.out_cache_loc < 0) | (md.out_cache_loc >= num_slots)), 8)
    prior = jnp.int32(0) if md.errors is None else md.errors
    return dataclasses.replace(
        md, cache_seqlens=safe_lens, cu_seqlens_q=cu_q,
        cu_seqlens_k=jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(safe_lens, dtype=jnp.int32)]),
        max_seqlen_k=jnp.max(safe_lens, initial=0).astype(jnp.int32), page_table=table, errors=prior | err)


def flag(md: AttentionMetadata, cond, bit: int) -> AttentionMetadata:
    """``md`` with ``bit`` set in its error flag where ``cond`` holds (traceable)."""
    prior = jnp.int32(0) if md.errors is None else md.errors
    return dataclasses.replace(md, errors=prior | _bit(cond, bit))


def plan_errors(plan) -> jax.Array:
    """The OR of the ``errors`` of every ``AttentionMetadata`` in a plan (i32[]; 0 = clean)."""
    nodes = jax.tree_util.tree_leaves(plan, is_leaf=lambda x: isinstance(x, AttentionMetadata))
    bits = [n.errors for n in nodes if isinstance(n, AttentionMetadata) and n.errors is not None]
    out = jnp.int32(0)
    for b in bits:
        out = out | b
    return out


def check(plan, where: str = "plan") -> None:
    """Raise ``ValueError`` when the plan's device-side error flag is set (reads it: a host sync)."""
    bits = int(np.asarray(plan_errors(plan)))
    if bits:
        raise ValueError(f"{where}: bad step input ({describe(bits)}) [error bits {bits:#x}]")


def check_int32(name: str, x) -> np.ndarray:
    """A host integer array as int32; values that do not fit raise instead of wrapping."""
    a = np.asarray(x)
    if a.size == 0:
        return a.astype(np.int32)
    if a.dtype.kind not in "iu":
        raise ValueError(f"{name} has dtype {a.dtype}; pass integer indices")
    if a.size and (a.dtype.itemsize > 4 or a.dtype == np.uint32):
        lo, hi = int(a.min()), int(a.max())
        if lo < INT32_MIN or hi > INT32_MAX:
            raise ValueError(f"{name} holds {hi if hi > INT32_MAX else lo}, outside int32: indices and lengths "
                             "must fit int32 (they are never wrapped)")
    return a.astype(np.int32, copy=False)
