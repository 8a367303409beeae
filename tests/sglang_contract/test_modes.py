"""Non-speculative forward modes driven as SGLang drives them: ``FlashAttentionBackend(model_runner)``,
``init_forward_metadata(forward_batch)``, then ``RadixAttention.forward`` per layer.

Every case: per-row float64 oracle, pools bit-identical outside the slots the step writes.
Bugs these catch are named per case (``catches``)."""

from __future__ import annotations

import dataclasses
from typing import Tuple

import pytest
import torch

import torch_bridge
from tests.sglang_contract.batches import Req, idle_step, plain_step
from tests.sglang_contract.check import check_step
from tests.sglang_contract.engine import ForwardMode
from tests.sglang_contract.world import CAP, PLAIN, SINK, SWA, SWA_SINK, LayerSpec, World

EXTEND, DECODE, MIXED = ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    mode: ForwardMode
    reqs: Tuple[Tuple[int, int], ...]  # (prefix, new) per request
    catches: str  # the bug this case exists for
    layers: Tuple[LayerSpec, ...] = (PLAIN,)
    page_size: int = 1
    dtype: torch.dtype = torch.float32
    save_kv_cache: bool = True
    piecewise: bool = False  # extend through unified_attention_with_output (forward_batch._attn_output)


CASES = [
    Case("extend_p1", EXTEND, ((0, 9), (0, 17), (0, 1)), "prefill without prefix: cu_seqlens_q from extend lengths",
         (PLAIN, SWA)),
    Case("extend_p16", EXTEND, ((0, 21), (0, 3), (0, 40)), "page-table stride / page ids at page size 16",
         (PLAIN, CAP), page_size=16),
    Case("extend_prefix_p1", EXTEND, ((20, 5), (3, 12), (40, 1)), "prefix (radix cache hit): queries offset",
         (SINK, SWA_SINK)),
    Case("extend_prefix_p16", EXTEND, ((33, 7), (2, 14), (50, 9)), "prefix crossing pages; a dropped last page",
         (PLAIN, SINK), page_size=16),
    Case("decode_p1", DECODE, ((8, 1), (55, 1), (0, 1), (30, 1)), "decode: seq_lens include the new token",
         (PLAIN, SWA)),
    Case("decode_p16", DECODE, ((15, 1), (16, 1), (60, 1)), "decode at page boundaries (15, 16, 60 tokens)",
         (CAP, SINK), page_size=16),
    Case("mixed_p16", MIXED, ((0, 7), (30, 1), (12, 4), (47, 1)), "MIXED (chunked prefill + decode) batch",
         (PLAIN, SWA), page_size=16),
    Case("extend_bf16", EXTEND, ((10, 12), (0, 30)), "bf16 activations / pool", (SWA, SINK),
         page_size=16, dtype=torch.bfloat16),
    Case("decode_bf16", DECODE, ((44, 1), (7, 1)), "bf16 decode", (PLAIN, CAP), dtype=torch.bfloat16),
    Case("extend_no_save", EXTEND, ((9, 6), (20, 3)), "save_kv_cache=False must write nothing",
         (PLAIN, SWA), page_size=16, save_kv_cache=False),
    Case("decode_no_save", DECODE, ((9, 1), (33, 1)), "save_kv_cache=False in decode must write nothing",
         (SINK,), save_kv_cache=False),
    Case("extend_piecewise", EXTEND, ((5, 11), (0, 6)), "forward_batch._attn_output (piecewise CUDA graph) "
         "written wrong or left unfilled", (PLAIN, SINK), page_size=16, piecewise=True),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_mode(case: Case):
    world = World(case.layers, page_size=case.page_size, dtype=case.dtype)
    reqs = [Req(world.new_request(), p, n) for p, n in case.reqs]
    backend = torch_bridge.FlashAttentionBackend(world.runner)
    fb, ex = plain_step(world, reqs, case.mode)
    check_step(world, backend, fb, ex, what=f"{case.name} [{case.catches}]", save_kv_cache=case.save_kv_cache,
               piecewise=case.piecewise)


def test_extend_then_decode_reads_what_the_bridge_wrote():
    """Catches: K/V written through ``set_kv_buffer`` in one step not seen by the next step's plan
    (stale imported views of the pools or of ``req_to_token``)."""
    world = World((PLAIN,), page_size=16)
    rows = [world.new_request() for _ in range(2)]
    backend = torch_bridge.FlashAttentionBackend(world.runner)
    fb, ex = plain_step(world, [Req(rows[0], 0, 18), Req(rows[1], 0, 5)])
    check_step(world, backend, fb, ex, what="prefill")
    for step in range(2):
        fb, ex = plain_step(world, [Req(rows[0], 18 + step, 1), Req(rows[1], 5 + step, 1)], DECODE, commit=False)
        check_step(world, backend, fb, ex, what=f"decode {step} over the prefill's K/V")


def test_idle_returns_empty_and_writes_nothing():
    """Catches: IDLE (data-parallel attention without requests) planned or dispatched as decode."""
    world = World((PLAIN, SINK))
    backend = torch_bridge.FlashAttentionBackend(world.runner)
    fb, ex = idle_step(world)
    outs, _ = check_step(world, backend, fb, ex, what="idle")
    assert [tuple(o.shape) for o in outs] == [(0, 64), (0, 64)]
