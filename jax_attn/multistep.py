"""Multi-step draft decoding: one plan per draft step, sharing the work between steps.

SGLang's ``FlashAttentionMultiStepBackend`` keeps one backend per draft step. Here one jitted
function plans every step at once: the committed-KV part (page table, prefix plan) is computed
once and each step only changes what differs — ``cache_seqlens + step + 1`` for topk <= 1, the
expand table of steps ``0..step`` for topk > 1.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jax_attn.metadata import ForwardMode
from jax_attn.planner import exclusive_cumsum, plan_uniform
from jax_attn.spec import CascadeMetadata, _rows_md


@functools.partial(jax.jit, static_argnames=("topk", "num_steps", "page_size", "max_pages"))
def plan_draft_steps(
    req_to_token,  # i32[R, W]
    req_pool_indices,  # i32[B]
    seq_lens,  # i32[B]; committed lengths
    draft_cache_loc,  # i32[B * K * S]; [B, K, S] (K = max(topk, 1)): slots of each step's draft tokens
    *,
    topk: int,
    num_steps: int,
    page_size: int = 1,
    max_pages: int,
):
    """Plans for draft steps ``0..num_steps-1``: a tuple of ``AttentionMetadata`` (topk <= 1) or
    ``CascadeMetadata`` (topk > 1), all sharing one committed-KV plan."""
    k = max(topk, 1)
    loc = draft_cache_loc.reshape(-1, num_steps)  # [B*K, S]
    # topk <= 1: one plan covering the last step's keys; earlier steps mask the pages they don't use.
    offset = num_steps if topk <= 1 else 0
    base = plan_uniform(req_to_token, req_pool_indices, seq_lens, loc[:, 0], q_len_per_req=k, kv_offset=offset,
                        page_size=page_size, max_pages=max_pages, mode=ForwardMode.DECODE)
    col = jnp.arange(max_pages, dtype=jnp.int32)[None]
    plans = []
    for step in range(num_steps):
        cur = loc[:, step]
        if topk <= 1:
            lens = base.cache_seqlens - num_steps + step + 1
            used = (lens[:, None] + page_size - 1) // page_size
            plans.append(dataclasses.replace(
                base, cache_seqlens=lens, cu_seqlens_k=exclusive_cumsum(lens), out_cache_loc=cur,
                page_table=jnp.where(col < used, base.page_table, 0),
                max_seqlen_k=base.max_seqlen_k - num_steps + step + 1))
        else:
            counts = jnp.full((loc.shape[0],), step + 1, jnp.int32)
            expand = _rows_md(counts, loc[:, : step + 1], cur, ForwardMode.DECODE)
            plans.append(CascadeMetadata(prefix=dataclasses.replace(base, out_cache_loc=cur), expand=expand,
                                         swa=None, mode=ForwardMode.DECODE))
    return tuple(plans)
