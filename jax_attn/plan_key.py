"""A step's plan from its batch: the static ``PlanKey`` (equal keys share one compiled executable),
the padded host arrays (``batch_arrays``) and the one jitted planner call (``plan_arrays``) that every
front end runs, guarded against bad input inside the call (``guard_plan``)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from jax_attn import local as local_attn
from jax_attn import planner, safety
from jax_attn import spec as spec_plan
from jax_attn.batch import ForwardBatch, accepted_tokens
from jax_attn.metadata import ForwardMode


@dataclasses.dataclass(frozen=True)
class PlanKey:
    """Everything static about a step's plan; equal keys share one compiled executable."""

    mode: ForwardMode
    batch_size: int
    num_tokens: int
    q_len_per_req: int
    kv_offset: int
    page_size: int
    max_pages: int
    has_encoder: bool
    max_encoder_len: int
    topk: int = 1  # > 1: tree (cascade) plan
    num_steps: int = 1
    step_id: int = 0
    with_swa: bool = False
    num_slots: int = 0  # KV pool slots (0: unknown): the error flag then also covers page ids and slots
    attention_chunk_size: int = 0  # > 0: plans of jax_attn.local.LOCAL_MODES carry the local virtual batch
    num_swa_slots: int = 0  # > 0: SGLang's hybrid SWAKVPool; plans carry md.swa_page_table into an SWA pool this big

    @property
    def swa_pool(self) -> bool:
        return self.num_swa_slots > 0


def _kv_offset(batch: ForwardBatch) -> int:
    """Target verify adds the draft tokens; draft decode (decode with spec_info) adds step_id + 1."""
    spec = batch.spec_info
    if batch.forward_mode == ForwardMode.TARGET_VERIFY:
        return spec.num_draft_tokens
    if batch.forward_mode == ForwardMode.DECODE and spec is not None and not spec.is_tree():
        return spec.step_id + 1
    return 0


def batch_arrays(batch: ForwardBatch):
    """The device inputs of a plan, in ``plan_arrays`` order (int32 numpy)."""
    ext = batch.extend_seq_lens
    if batch.forward_mode.is_draft_extend():
        ext = accepted_tokens(batch.spec_info)
    mask = None if batch.spec_info is None else batch.spec_info.draft_mask
    return (batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc, ext, batch.encoder_lens, mask)


def plan_arrays(key: PlanKey, req_to_token, req_pool_indices, seq_lens, out_cache_loc,
                extend_seq_lens=None, encoder_lens=None, draft_mask=None, swa_mapping=None):
    """Dispatch to the planner of ``key.mode`` (traceable: capture and replay call this too).

    Returns ``AttentionMetadata``, or ``spec.CascadeMetadata`` for tree (topk > 1) steps, with every
    index clamped into range and the bad-input flag set (``guard_plan``). ``swa_mapping``: SGLang's
    ``full_to_swa_index_mapping`` when ``key.swa_pool`` (``i32[S + 1]`` or int64 words ``i32[S + 1, 2]``).
    """
    md = _plan(key, req_to_token, req_pool_indices, seq_lens, out_cache_loc, extend_seq_lens, encoder_lens,
               draft_mask)
    md = _with_swa_pool(guard_plan(md, key, req_to_token, req_pool_indices, encoder_lens), key, swa_mapping)
    return local_attn.with_local(md, chunk_size=key.attention_chunk_size)  # from the guarded (clamped) plan


def _with_swa_pool(md, key: PlanKey, mapping):
    """``md`` (or each plan of a tuple) with ``swa_page_table`` when ``key.swa_pool`` (traceable)."""
    if not key.swa_pool:
        return md
    if mapping is None:
        raise ValueError("a plan for SGLang's SWAKVPool needs full_to_swa_index_mapping (swa_mapping)")
    if isinstance(md, (tuple, list)):
        return type(md)(_with_swa_pool(m, key, mapping) for m in md)
    return spec_plan.with_swa_pool_step(md, mapping, num_swa_slots=key.num_swa_slots)  # tree plans: md.swa


def guard_plan(md, key: PlanKey, req_to_token, req_pool_indices, encoder_lens=None):
    """``jax_attn.safety.guard`` over every part of a plan (tree steps: only the prefix pass's
    query counts are checked; the expand pass may see fewer keys than it has queries)."""
    if isinstance(md, (tuple, list)):
        return type(md)(guard_plan(m, key, req_to_token, req_pool_indices, encoder_lens) for m in md)
    kw = dict(num_rows=req_to_token.shape[0], num_slots=key.num_slots)
    if isinstance(md, spec_plan.CascadeMetadata):
        none = jnp.zeros((0,), jnp.int32)
        return dataclasses.replace(
            md, prefix=guard_plan(md.prefix, key, req_to_token, req_pool_indices),
            expand=safety.guard(md.expand, req_pool_indices=none, check_queries=False, **kw),
            swa=None if md.swa is None else safety.guard(md.swa, req_pool_indices=none, check_queries=False, **kw))
    if md.mode == ForwardMode.IDLE:
        return md
    cap = jnp.int32(min(md.max_pages * md.page_size, req_to_token.shape[1]))
    if encoder_lens is not None:  # decoder positions follow each row's encoder tokens
        cap = jnp.minimum(cap, req_to_token.shape[1] - encoder_lens)
    return safety.guard(md, req_pool_indices=req_pool_indices, capacity=cap,
                        check_queries=key.topk == 1, **kw)


def _plan(key: PlanKey, req_to_token, req_pool_indices, seq_lens, out_cache_loc, extend_seq_lens=None,
          encoder_lens=None, draft_mask=None):
    if key.topk > 1:
        if key.mode == ForwardMode.TARGET_VERIFY:
            return spec_plan.plan_verify_tree(
                req_to_token, req_pool_indices, seq_lens, out_cache_loc, draft_mask, num_draft=key.q_len_per_req,
                page_size=key.page_size, max_pages=key.max_pages, with_swa=key.with_swa)
        return spec_plan.plan_draft_decode_tree(
            req_to_token, req_pool_indices, seq_lens, out_cache_loc, topk=key.topk, step_id=key.step_id,
            num_steps=key.num_steps, page_size=key.page_size, max_pages=key.max_pages, with_swa=key.with_swa)
    enc = dict(encoder_lens=encoder_lens, max_encoder_len=key.max_encoder_len) if key.has_encoder else {}
    common = dict(page_size=key.page_size, max_pages=key.max_pages, **enc)
    if key.mode == ForwardMode.IDLE:
        return planner.plan_idle(page_size=key.page_size, max_pages=key.max_pages)
    if key.mode in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY):
        return planner.plan_uniform(
            req_to_token, req_pool_indices, seq_lens, out_cache_loc, q_len_per_req=key.q_len_per_req,
            kv_offset=key.kv_offset, mode=key.mode, **common,
        )
    if extend_seq_lens is None:
        raise ValueError(f"{key.mode.name} needs extend_seq_lens (or spec_info.num_accepted_tokens)")
    return planner.plan_extend(
        req_to_token, req_pool_indices, seq_lens, extend_seq_lens, out_cache_loc,
        max_q_len=key.num_tokens, mode=key.mode, **common,
    )
