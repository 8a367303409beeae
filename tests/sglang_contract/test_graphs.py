"""CUDA-graph capture and replay as SGLang's graph runners drive them (``graph_runner``): state once,
capture every bucket (largest first) on static buffers, then per batch pad to the bucket and call
the replay hook with SGLang's positional order; the graph's batch is then run again.

Each replayed batch is first run eagerly on the same backend; the replay must match it (and the
float64 oracle) on every real row, write only the real slots plus the reserved slot 0 (padding
tokens), and trace nothing new. Batches are replayed with fewer real rows than the bucket and with
other lengths than the capture's. Capture runs themselves may write only the slots of the
capture-time ``out_cache_loc`` buffer.

On a Hopper GPU (``JAX_ATTN_CONTRACT_DEVICE=cuda``) the ``REAL_CASES`` join: bf16, head dim 64, page
size 16, layers the bridge's Mosaic launch path covers, captured in real ``torch.cuda.graph`` s (the
bridge cannot capture the JAX path the other cases take, so those keep the imitation)."""

from __future__ import annotations

import dataclasses
import functools
from typing import List, Optional, Tuple

import pytest
import torch

import torch_bridge
from tests.sglang_contract.batches import (Req, draft_extend_step, draft_extend_v2_step, draft_round, idle_step,
                                          plain_step, server_args_for, step_locs, verify_step)
from tests.sglang_contract.check import QKV, Forward, check_draft_round, check_step, forward_layers, random_qkv
from tests.sglang_contract.device import ON_CUDA, hopper
from tests.sglang_contract.engine import ForwardMode
from tests.sglang_contract.graph_runner import (CudaGraphRunner, EAGLEDraftCudaGraphRunner,
                                                EAGLEDraftExtendCudaGraphRunner)
from tests.sglang_contract.test_spec import EAGLE_CHAIN, EAGLE_TREE, NGRAM_TREE
from tests.sglang_contract.world import CAP, CROSS, PLAIN, SINK, SWA, LayerSpec, World, as_bits

CAPTURE_BS = (3, 6)  # batch classes 4 and 8 (jax_attn.batch.batch_class): buckets padded further, shared plans


@dataclasses.dataclass(frozen=True)
class GraphCase:
    name: str
    kind: str  # decode | verify | draft_decode | draft_extend | draft_extend_v2
    batches: Tuple[Tuple[int, ...], ...]  # committed tokens per request of each replayed batch
    catches: str
    server: Optional[dict] = None
    layers: Tuple[LayerSpec, ...] = (PLAIN,)
    page_size: int = 1
    encoder_decoder: bool = False
    dtype: torch.dtype = torch.float32
    head_dim: Optional[int] = None  # None: the world's default
    real: bool = False  # captured in real torch.cuda.graphs (Hopper GPU, Mosaic launch path layers)


CASES = [
    GraphCase("decode_p1", "decode", ((9, 40, 2), (30,)),
              "padded rows (seq_len 1, row 0, slot 0) and re-planned lengths", layers=(CAP,)),
    GraphCase("decode_p16", "decode", ((15, 47, 16), (33, 3)), "replay at page size 16; bucket without padding",
              layers=(SINK,), page_size=16),
    GraphCase("cross_decode_p1", "decode", ((9, 20, 4), (13,)),
              "encoder lengths padded with max_source_positions; cross layers with k=None",
              layers=(PLAIN, CROSS), encoder_decoder=True),
    GraphCase("verify_chain_p16", "verify", ((9, 40, 2), (20,)), "chain verify replay (kv offset N)",
              server=EAGLE_CHAIN, layers=(SWA,), page_size=16),
    GraphCase("verify_tree_p1", "verify", ((9, 30, 3), (21,)),
              "tree verify replay: the real custom_mask of fewer rows than the bucket", server=EAGLE_TREE,
              layers=(SINK,)),
    GraphCase("verify_ngram_p1", "verify", ((12, 25, 5),), "NGRAM tree replay: topk from server_args",
              server=NGRAM_TREE),
    GraphCase("draft_decode_topk1_p16", "draft_decode", ((9, 40, 2), (30,)), "chain draft decode replay",
              server=EAGLE_CHAIN, layers=(SWA,), page_size=16),
    GraphCase("draft_decode_topk2_p1", "draft_decode", ((9, 30, 3),),
              "tree draft decode replay: out_cache_loc of raw_bs rows padded to the bucket", server=EAGLE_TREE),
    GraphCase("draft_extend_p1", "draft_extend", ((9, 30, 3), (21, 14)),
              "draft extend replay: lengths from num_accepted_tokens (no accept_length in 0.5.11); a full "
              "bucket of rows with fewer tokens than bs * (num_steps + 1)",
              server=EAGLE_CHAIN, layers=(SINK,)),
    GraphCase("draft_extend_v2_p1", "draft_extend_v2", ((9, 30, 3), (21, 14)),
              "DRAFT_EXTEND_V2 replay: extend lengths are the num_draft_tokens in extend_seq_lens, not "
              "num_accepted_tokens", server=EAGLE_CHAIN, layers=(PLAIN,)),
]

# What the bridge captures in a torch.cuda.graph: layers on its Mosaic launch path (bf16 / f16, head dim 64 /
# 128, page size a multiple of 8, topk 1, no cross attention, no sinks with decode-length queries).
_REAL = dict(dtype=torch.bfloat16, head_dim=64, page_size=16, real=True)
REAL_CASES = [
    GraphCase("real_decode_p16", "decode", ((15, 47, 16), (33, 3)),
              "a captured decode reading the capture's tables or lengths, or writing K/V at the capture's slots",
              layers=(PLAIN, CAP), **_REAL),
    GraphCase("real_verify_chain_p16", "verify", ((9, 40, 2), (20,)),
              "a captured chain verify (kv offset N) reading capture-time lengths", server=EAGLE_CHAIN,
              layers=(SWA,), **_REAL),
    GraphCase("real_draft_decode_topk1_p16", "draft_decode", ((9, 40, 2), (30,)),
              "captured draft steps writing the wrong step's column of out_cache_loc", server=EAGLE_CHAIN,
              layers=(SWA, PLAIN), **_REAL),
    GraphCase("real_draft_extend_p16", "draft_extend", ((9, 30, 3), (21, 14)),
              "a captured draft extend reading the capture's extend lengths", server=EAGLE_CHAIN,
              layers=(PLAIN,), **_REAL),
]
if ON_CUDA:
    CASES += REAL_CASES


def traces(*backends) -> int:
    """Traces of the bridge's compiled functions so far (0 when the backend does not count them)."""
    return sum(getattr(b, "trace_count", 0) for b in backends)


def _setup(case: GraphCase):
    kw = {} if case.head_dim is None else {"head_dim": case.head_dim}
    world = World(case.layers, page_size=case.page_size, encoder_decoder=case.encoder_decoder, dtype=case.dtype,
                  server_args=server_args_for(**(case.server or {})), **kw)
    real = {"real": case.real}
    if case.kind == "draft_decode":
        args = world.runner.server_args
        backend = torch_bridge.FlashAttentionMultiStepBackend(world.runner, args.speculative_eagle_topk,
                                                              args.speculative_num_steps)
        return world, backend, EAGLEDraftCudaGraphRunner(world.runner, backend, CAPTURE_BS, **real)
    backend = torch_bridge.FlashAttentionBackend(world.runner, skip_prefill=not case.kind.startswith("draft_extend"))
    if case.kind == "draft_extend":
        return world, backend, EAGLEDraftExtendCudaGraphRunner(world.runner, backend, CAPTURE_BS, **real)
    if case.kind == "draft_extend_v2":
        return world, backend, EAGLEDraftExtendCudaGraphRunner(world.runner, backend, CAPTURE_BS,
                                                               ForwardMode.DRAFT_EXTEND_V2, **real)
    return world, backend, CudaGraphRunner(world.runner, backend, CAPTURE_BS, **real)


class GraphModel:
    """The model the graph runner captures: every layer's attention on the static batch; draft decode has
    one part per draft step (``EAGLEWorker.draft_forward``: step ``i`` on ``attn_backends[i]`` with
    ``out_cache_loc[i]``). Imitated graphs draw fresh activations per run; a real graph reads static
    activation buffers (per part, the largest bucket's tokens) that ``forward`` fills before a replay."""

    def __init__(self, world: World, backend, graph):
        self.world, self.backend, self.graph = world, backend, graph
        self.steps = getattr(backend, "attn_backends", None)
        num_parts = 1 if self.steps is None else len(self.steps)
        self.static: Optional[List[List[QKV]]] = (
            [random_qkv(world, graph.max_num_token) for _ in range(num_parts)] if graph.real else None)
        self.parts = [functools.partial(self.run, part=p) for p in range(num_parts)]

    def run(self, fb, n: int, part: int = 0) -> List[torch.Tensor]:
        if self.static is None:
            qkvs = random_qkv(self.world, n)
        else:
            qkvs = [tuple(None if x is None else x[:n] for x in t) for t in self.static[part]]
        if self.steps is None:
            return forward_layers(self.world, fb, qkvs)
        full = fb.out_cache_loc
        loc = step_locs(fb, self.backend.topk, self.backend.speculative_num_steps)[part]  # captured with the step
        fb.attn_backend, fb.out_cache_loc = self.steps[part], loc
        try:
            return forward_layers(self.world, fb, qkvs)
        finally:
            fb.out_cache_loc = full

    def forward(self, bs: int, part: int = 0) -> Optional[Forward]:
        """For ``check_step``: replay bucket ``bs``'s real graph of ``part`` on the given activations
        (None for an imitated graph: the check calls the layers itself)."""
        if not self.graph.real:
            return None
        static = self.static[part]

        def replay(fb, run: List[QKV]) -> List[torch.Tensor]:
            n = run[0][0].shape[0]
            assert n == bs * self.graph.num_tokens_per_bs, f"{n} activations for bucket {bs}"
            for buffers, given in zip(static, run):
                for buf, x in zip(buffers, given):
                    if x is not None:
                        buf[:n].copy_(x)
            outs = [o.clone() for o in self.graph.launch(bs, part)]
            for i, (buffers, given) in enumerate(zip(static, run)):
                for name, buf, x in zip("qkv", buffers, given):
                    assert x is None or torch.equal(as_bits(buf[:n]), as_bits(x)), (
                        f"replayed graph: layer {i} {name} (a static input) modified in place")
            return outs
        return replay


def _capture(world: World, backend, graph) -> GraphModel:
    """Capture every bucket; the capture runs may only write the capture buffer's slots."""
    allowed = sorted(set(graph.out_cache_loc.tolist()))
    before = world.snapshot()
    model = GraphModel(world, backend, graph)
    graph.capture(*model.parts)
    world.check_pools(before, "capture runs", free=allowed)
    return model


def _batch(case: GraphCase, world: World, committed):
    rows = [world.new_request() for _ in committed]
    if case.kind == "decode":
        enc = [6, 3, 9, 5][:len(committed)] if case.encoder_decoder else [0] * len(committed)
        return plain_step(world, [Req(r, c, 1, enc=e) for r, c, e in zip(rows, committed, enc)], ForwardMode.DECODE)
    if case.kind == "verify":
        n = case.server["draft"]
        return verify_step(world, [Req(r, c, n) for r, c in zip(rows, committed)], chain=case.server["topk"] == 1,
                           ngram=case.server["algo"] == "NGRAM")
    if case.kind == "draft_extend":
        ntpb = case.server["steps"] + 1
        acc = [1 + (3 * i + 1) % ntpb for i in range(len(committed))]
        return draft_extend_step(world, [Req(r, c, a) for r, c, a in zip(rows, committed, acc)])
    if case.kind == "draft_extend_v2":
        n = case.server["draft"]
        return draft_extend_v2_step(world, [Req(r, c, n) for r, c in zip(rows, committed)],
                                    accepted=[1 + i % n for i in range(len(committed))])
    return draft_round(world, [Req(r, c, 0) for r, c in zip(rows, committed)], case.server["topk"],
                       case.server["steps"])


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_replay_equals_eager(case: GraphCase):
    """Catches (per case, ``catches``): a replay that differs from eager on any real row, writes a slot
    other than the real ones or slot 0, or traces inside a captured bucket; an IDLE batch replayed
    through a decode / EAGLE verify graph failing or writing outside slot 0."""
    if case.real and not hopper():
        pytest.skip("real torch.cuda.graph capture needs the bridge's Mosaic launch path (a Hopper GPU)")
    world, backend, graph = _setup(case)
    model = _capture(world, backend, graph)
    backends = getattr(backend, "attn_backends", [backend])
    for b, committed in enumerate(case.batches):
        bs = graph.bucket(len(committed))
        what = f"{case.name} batch {b} (bs {len(committed)} -> bucket {bs}) [{case.catches}]"
        fb, ex = _batch(case, world, committed)
        if case.kind == "draft_decode":
            eager = check_draft_round(world, backend, fb, ex, what=f"eager {what}")
            before = traces(*backends)
            forwards = None if not graph.real else [model.forward(bs, i) for i in range(len(ex))]
            check_draft_round(world, backend, graph.replay(fb), ex, what=f"replay {what}", replay=eager,
                              forwards=forwards)
        else:
            outs, qkvs = check_step(world, backend, fb, ex, what=f"eager {what}")
            before = traces(*backends)
            graph_fb = graph.replay(fb)
            check_step(world, backend, graph_fb, ex, plan=False, qkvs=qkvs, pad_to=int(graph_fb.out_cache_loc.shape[0]),
                       eager=outs, what=f"replay {what}", forward=model.forward(bs))
        assert traces(*backends) == before, f"{what}: replay of a captured bucket traced again"
    if case.kind == "decode" or (case.kind == "verify" and case.server["algo"] == "EAGLE"):
        check_idle_replay(world, backend, graph, case.name, forward=model.forward(CAPTURE_BS[0]))


def check_idle_replay(world: World, backend, graph, name: str, forward: Optional[Forward] = None) -> None:
    """An IDLE batch (``batch_size`` 0): SGLang's model runner replays it through the graph, the replay
    hook getting the captured DECODE / TARGET_VERIFY mode and, for verify,
    ``EagleVerifyInput.create_idle_input`` with the buffers' custom mask. It must run, write nothing
    but the reserved slot 0 and trace nothing. ``forward``: replay a real graph instead of the layers."""
    fb, _ = idle_step(world)
    before, count = world.snapshot(), traces(backend)
    graph_fb = graph.replay(fb)
    assert graph_fb.batch_size == graph.capture_bs[0], "an idle batch replays through the smallest bucket"
    qkvs = random_qkv(world, int(graph_fb.out_cache_loc.shape[0]))
    if forward is None:
        forward_layers(world, graph_fb, qkvs)
    else:
        forward(graph_fb, qkvs)
    world.check_pools(before, f"idle replay {name}", free=(0,))
    assert traces(backend) == count, f"{name}: idle replay traced again"
