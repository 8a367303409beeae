"""The plan guard (``jax_attn.safety.guard``) clamps what a bad ``req_to_token`` entry would send to the
kernels: after planning a page id past the pool (or below 0), every page table of the plan (uniform,
extend, the tree cascade's passes, the local virtual batch) lies inside the pool, and the error flag
says so. The kernels clamp again, so their output would not show a missing clamp; the plan does.

Bug caught: the page-table clamp deleted from the guard (the plan then hands the kernels page ids
outside the pool, and any consumer of the plan that trusts it reads out of bounds).
"""

import numpy as np
import pytest
import torch

from jax_attn import safety
from jax_attn.backend import FlashAttentionBackend
from jax_attn.batch import ForwardBatch, SpecInfo
from jax_attn.metadata import AttentionMetadata, ForwardMode
from jax_attn.spec import CascadeMetadata
from tests.paging import shuffled_table
import torch_bridge

PAGE, CTX = 4, 48
ROWS = np.array([1, 3, 2], np.int32)
COMMITTED = np.array([9, 30, 17], np.int32)
BAD_AT = (ROWS[1], 5 * PAGE)  # a used page of the second request


def metadata_nodes(plan):
    """Every ``AttentionMetadata`` of a plan, nested ones (cascade passes, the local batch) included."""
    if isinstance(plan, CascadeMetadata):
        for part in (plan.prefix, plan.expand, plan.swa):
            if part is not None:
                yield from metadata_nodes(part)
    elif isinstance(plan, AttentionMetadata):
        yield plan
        if plan.local is not None:
            yield from metadata_nodes(plan.local)


def check_inside_the_pool(plan, num_slots: int, what: str):
    nodes = list(metadata_nodes(plan))
    assert nodes, f"{what}: no metadata in the plan"
    for md in nodes:
        table = np.asarray(md.page_table)
        num_pages = num_slots // md.page_size
        assert table.min() >= 0 and table.max() < num_pages, (
            f"{what}: page table (page size {md.page_size}) holds ids in [{table.min()}, {table.max()}], "
            f"outside the pool's {num_pages} pages")
    bits = int(np.asarray(safety.plan_errors(plan)))
    assert bits & 4, f"{what}: the bad page id must set the error flag (bits {bits:#x})"


def batch(mode: str, table):
    if mode == "decode":
        return ForwardBatch(ForwardMode.DECODE, ROWS, COMMITTED + 1, table[ROWS, COMMITTED])
    if mode == "extend":
        ext = np.array([3, 1, 4], np.int32)
        loc = np.concatenate([table[r, c:c + n] for r, c, n in zip(ROWS, COMMITTED, ext)])
        return ForwardBatch(ForwardMode.EXTEND, ROWS, COMMITTED + ext, loc, extend_seq_lens=ext)
    n = 3  # tree verify: two branches over a root
    mask = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 1]], bool)[None].repeat(len(ROWS), 0)
    loc = np.concatenate([table[r, c:c + n] for r, c in zip(ROWS, COMMITTED)])
    return ForwardBatch(ForwardMode.TARGET_VERIFY, ROWS, COMMITTED, loc,
                        spec_info=SpecInfo(topk=2, num_draft_tokens=n, draft_mask=mask, with_swa=True))


@pytest.mark.parametrize("bad", ["past_pool", "negative"])
@pytest.mark.parametrize("mode", ["decode", "extend", "tree_verify"])
def test_jax_plan_page_tables_lie_inside_the_pool(mode, bad):
    table, num_slots = shuffled_table(4, CTX, PAGE, seed=1)
    table[BAD_AT] = num_slots + 8 * PAGE if bad == "past_pool" else -3 * PAGE
    backend = FlashAttentionBackend(table, page_size=PAGE, max_context_len=CTX, impl="reference",
                                    num_slots=num_slots, attention_chunk_size=2 * PAGE if mode == "decode" else 0)
    md = backend.plan(batch(mode, table))
    if mode == "decode":
        assert md.local is not None  # the local virtual batch is derived from the guarded table
    check_inside_the_pool(md, num_slots, f"{mode}, {bad} page id")


def test_bridge_plan_page_table_lies_inside_the_pool():
    table, num_slots = shuffled_table(4, CTX, PAGE, seed=1)
    table[BAD_AT] = num_slots + 8 * PAGE
    pool = torch_bridge.MHATokenToKVPool.create(num_slots, 1, 2, 16, torch.float32)
    runner = torch_bridge.ModelRunner(torch_bridge.ReqToTokenPool(torch.from_numpy(table).clone()), pool,
                                      torch_bridge.ModelConfig(CTX), page_size=PAGE, attention_impl="reference")
    backend = torch_bridge.FlashAttentionBackend(runner, validate=False)
    fb = batch("decode", table)
    i64 = [torch.from_numpy(np.asarray(x, np.int64)) for x in (fb.req_pool_indices, fb.seq_lens, fb.out_cache_loc)]
    backend.init_forward_metadata(torch_bridge.ForwardBatch(ForwardMode.DECODE, len(ROWS), *i64,
                                                            token_to_kv_pool=pool))
    check_inside_the_pool(backend.step.plan(), num_slots, "bridge decode, page id past the pool")
