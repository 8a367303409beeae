"""Speculative decoding, eager, driven as SGLang's EAGLE / NGRAM workers drive the backends:

* target verify: ``FlashAttentionBackend(model_runner)`` on the target worker; topk from
  ``server_args.speculative_eagle_topk`` (NGRAM inputs carry no topk);
* draft decode: ``FlashAttentionMultiStepBackend(model_runner, topk, num_steps)``; one
  ``init_forward_metadata`` per round with every step's ``out_cache_loc``, then step ``i`` runs with
  ``attn_backends[i]`` and ``out_cache_loc[i]`` (``EAGLEWorker.draft_forward``);
* draft extend: ``FlashAttentionBackend(model_runner, skip_prefill=False)``, lengths from
  ``num_accepted_tokens`` (0.5.11 has no ``accept_length``).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Tuple

import pytest

import torch_bridge
from tests.sglang_contract.batches import (Req, draft_extend_step, draft_extend_v2_step, draft_round, idle_step,
                                          plain_step, server_args_for, verify_step)
from tests.sglang_contract.check import check_draft_round, check_step
from tests.sglang_contract.device import ON_CUDA
from torch_bridge.layer_runner import JaxLayerHit
from tests.sglang_contract.world import CAP, PLAIN, SINK, SWA, SWA_SINK, LayerSpec, World

EAGLE_CHAIN = dict(algo="EAGLE", topk=1, steps=3, draft=4)  # topk 1: draft tokens = steps + 1
EAGLE_TREE = dict(algo="EAGLE", topk=2, steps=3, draft=5)
NGRAM_TREE = dict(algo="NGRAM", topk=4, draft=6)  # topk = speculative_ngram_max_bfs_breadth


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    server: dict
    committed: Tuple[int, ...]  # committed tokens per request
    catches: str
    layers: Tuple[LayerSpec, ...] = (PLAIN,)
    page_size: int = 1
    sliding_window: Optional[int] = None  # model_runner.sliding_window_size


def _world(case: Case) -> World:
    return World(case.layers, page_size=case.page_size, server_args=server_args_for(**case.server),
                 sliding_window=case.sliding_window)


VERIFY = [
    Case("chain_p1", EAGLE_CHAIN, (9, 30, 1), "chain verify: KV offset of N draft tokens, causal",
         (PLAIN, SWA_SINK)),
    Case("chain_p16", EAGLE_CHAIN, (15, 44, 16), "chain verify across page boundaries", (SINK, CAP), page_size=16),
    Case("tree_p1", EAGLE_TREE, (9, 30, 2), "tree verify (cascade + merge); sinks counted once over both passes",
         (PLAIN, SINK)),
    Case("tree_p16", EAGLE_TREE, (14, 45), "tree verify at page size 16 (allowed for fa3), drafts across a page",
         (CAP, SINK), page_size=16),
    Case("tree_swa_p1", EAGLE_TREE, (12, 3, 25), "tree verify of sliding-window layers (SWA spec table), with sinks",
         (SWA_SINK, SWA), sliding_window=5),
    Case("ngram_p1", NGRAM_TREE, (11, 27), "NGRAM tree verify must take topk from server_args.speculative_eagle_topk",
         (PLAIN, SINK)),
]


@pytest.mark.parametrize("launch", [False, True], ids=["default", "triton_launch"])
@pytest.mark.parametrize("case", VERIFY, ids=[c.name for c in VERIFY])
def test_target_verify(case: Case, launch: bool):
    """``triton_launch``: the bridge's launch path with the Triton-lowered kernel, interpreted (on CUDA the
    default backend launches these layers itself): a tree step's layers then run its two passes and their
    merge from torch (``triton_path.TreeCall``), its sliding-window layers one launch over the tree's SWA table."""
    if launch and ON_CUDA:
        pytest.skip("on CUDA the default backend launches these layers")
    from tests.test_triton_launch import triton_path_for_tests

    world = _world(case)
    n = case.server["draft"]
    reqs = [Req(world.new_request(), c, n) for c in case.committed]
    backend = torch_bridge.FlashAttentionBackend(world.runner, mosaic_path=triton_path_for_tests() if launch else None)
    fb, ex = verify_step(world, reqs, chain=case.server["topk"] == 1, ngram=case.server["algo"] == "NGRAM")
    check_step(world, backend, fb, ex, what=f"verify {case.name} [{case.catches}]")
    if launch:  # every layer launched from torch (a tree's sliding-window layers too), none through JAX
        assert backend.runner.hits and all(not isinstance(h, JaxLayerHit) for h in backend.runner.hits.values())


DRAFT_DECODE = [
    Case("topk1_p1", EAGLE_CHAIN, (9, 30, 1), "chain draft: KV length seq_len + step + 1 per step",
         (PLAIN, SWA_SINK)),
    Case("topk1_p16", EAGLE_CHAIN, (15, 40), "chain draft at page size 16", (SINK, CAP), page_size=16),
    Case("topk2_p1", EAGLE_TREE, (9, 30, 2), "tree draft: branch k step s at out_cache_loc[b, k, s]; sinks once",
         (SINK,)),
    Case("topk2_p16", EAGLE_TREE, (17, 33), "tree draft at page size 16: branch slots only in out_cache_loc",
         (CAP,), page_size=16),
    Case("topk2_swa_p16", EAGLE_TREE, (17, 3, 33), "tree draft of sliding-window layers: the per-branch SWA table "
         "(committed slots then the branch's own draft slots), window counted over both, sinks once",
         (SWA_SINK, SWA, PLAIN), page_size=16, sliding_window=5),
]


@pytest.mark.parametrize("launch", [False, True], ids=["default", "triton_launch"])
@pytest.mark.parametrize("case", DRAFT_DECODE, ids=[c.name for c in DRAFT_DECODE])
def test_draft_decode(case: Case, launch: bool):
    """``triton_launch``: as in ``test_target_verify`` (tree steps' sliding-window layers: one launch over the
    tree's SWA table per draft step)."""
    if launch and ON_CUDA:
        pytest.skip("on CUDA the default backend launches these layers")
    from tests.test_triton_launch import InterpretedTriton, triton_path_for_tests

    world = _world(case)
    topk, steps = case.server["topk"], case.server["steps"]
    reqs = [Req(world.new_request(), c, 0) for c in case.committed]
    multi = torch_bridge.FlashAttentionMultiStepBackend(world.runner, topk, steps,
                                                        mosaic_path=triton_path_for_tests() if launch else None)
    assert len(multi.attn_backends) == steps - 1, "SGLang builds one backend per draft step but the last"
    fb, expects = draft_round(world, reqs, topk, steps)
    launches = InterpretedTriton.calls
    check_draft_round(world, multi, fb, expects, what=f"draft {case.name} [{case.catches}]")
    if launch:  # every layer of every draft step launched from torch, none through a JAX executable
        assert all(not isinstance(h, JaxLayerHit) for b in multi.attn_backends for h in b.runner.hits.values())
        assert InterpretedTriton.calls > launches


DRAFT_EXTEND = [
    Case("p1", EAGLE_CHAIN, (10, 20, 5), "draft extend: lengths from num_accepted_tokens", (PLAIN, SWA)),
    Case("p16", EAGLE_TREE, (15, 33), "draft extend at page size 16", (SINK, CAP), page_size=16),
]


@pytest.mark.parametrize("case", DRAFT_EXTEND, ids=[c.name for c in DRAFT_EXTEND])
def test_draft_extend(case: Case):
    world = _world(case)
    accepted = [1 + (i * 2) % (case.server["steps"] + 1) for i in range(len(case.committed))]  # 1 .. steps + 1
    reqs = [Req(world.new_request(), c, a) for c, a in zip(case.committed, accepted)]
    backend = torch_bridge.FlashAttentionBackend(world.runner, skip_prefill=False)  # draft_utils' prefill backend
    fb, ex = draft_extend_step(world, reqs)
    check_step(world, backend, fb, ex, what=f"draft extend {case.name} [{case.catches}]")


@pytest.mark.parametrize("page_size", [1, 16])
def test_draft_extend_v2(page_size):
    """Catches: DRAFT_EXTEND_V2 (spec v2, SGLang 0.5.11's default for EAGLE topk 1) extended by
    ``num_accepted_tokens`` instead of ``extend_seq_lens``: v2 fills the draft KV of all
    ``num_draft_tokens`` tokens while ``num_accepted_tokens`` keeps the verify's counts."""
    world = World((PLAIN, SWA_SINK), page_size=page_size, server_args=server_args_for(**EAGLE_CHAIN))
    n = EAGLE_CHAIN["draft"]
    reqs = [Req(world.new_request(), c, n) for c in (10, 29, 5)]
    backend = torch_bridge.FlashAttentionBackend(world.runner, skip_prefill=False)
    fb, ex = draft_extend_v2_step(world, reqs, accepted=[1, 3, 2])
    check_step(world, backend, fb, ex, what=f"draft extend v2 p{page_size}")


def test_target_backend_serves_each_mode_in_turn():
    """Catches: state of one step leaking into the next on the target worker's single backend (EAGLE
    alternates prefill EXTEND, TARGET_VERIFY of varying batches and IDLE): a stale plan, a stale
    custom mask, executables reused across step kinds."""
    world = World((PLAIN, SINK), page_size=16, server_args=server_args_for(**EAGLE_TREE))
    rows = [world.new_request() for _ in range(3)]
    backend = torch_bridge.FlashAttentionBackend(world.runner)
    n = EAGLE_TREE["draft"]
    steps = [
        lambda: plain_step(world, [Req(rows[0], 0, 12), Req(rows[1], 4, 20)]),
        lambda: verify_step(world, [Req(rows[0], 12, n), Req(rows[1], 24, n)], chain=False),
        lambda: idle_step(world),
        lambda: verify_step(world, [Req(rows[2], 7, n), Req(rows[0], 14, n), Req(rows[1], 25, n)], chain=False),
        lambda: plain_step(world, [Req(rows[2], 9, 3), Req(rows[0], 15, 6)]),
    ]
    for i, make in enumerate(steps):
        fb, ex = make()
        check_step(world, backend, fb, ex, what=f"step {i} ({fb.forward_mode.name})")
