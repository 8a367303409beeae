"""Llama 4 chunked local attention (iRoPE) through the torch bridge, driven as SGLang drives it: a
``model_config.is_local_attention_model`` model with ``attention_chunk_size = C`` whose
``layer.use_irope`` layers let a query at position ``p`` see only keys ``p // C * C .. p``; its other
(NoPE) layers attend everything. The float64 oracle applies that chunk mask
(``check.layer_rows`` / ``reference64.chunk_local``).

Every case: per-row float64 oracle, pools bit-identical outside the slots the step writes. Each case
names the bug it catches (``catches``); refused combinations raise ``NotImplementedError`` naming
``use_irope`` / ``attention_chunk_size`` before anything is written.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Optional, Tuple

import numpy as np
import pytest
import torch

import torch_bridge
from tests.sglang_contract.batches import (Req, draft_extend_step, draft_round, plain_step, server_args_for,
                                          step_locs, verify_step)
from tests.sglang_contract.device import DEVICE, ON_CUDA, hopper
from tests.sglang_contract.check import check_draft_round, check_step, forward_layers, random_qkv
from tests.sglang_contract.engine import ForwardMode, ModelRunner
from tests.sglang_contract.graph_runner import CudaGraphRunner, EAGLEDraftCudaGraphRunner
from tests.sglang_contract.reference64 import attention64, chunk_local
from tests.sglang_contract.test_graphs import GraphModel, check_idle_replay, traces
from tests.sglang_contract.test_spec import EAGLE_CHAIN, EAGLE_TREE
from tests.sglang_contract.world import PLAIN, SWA, LayerSpec, World, as_bits

EXTEND, DECODE, MIXED = ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED
IROPE = LayerSpec(scaling=0.41, irope=True)
IROPE_SWA_SINK = LayerSpec(scaling=0.33, window=5, sinks=True, irope=True)  # the window applies inside the chunk
IROPE_CAP = LayerSpec(scaling=0.57, softcap=1.5, irope=True)
LLAMA4 = (IROPE, IROPE_CAP, IROPE, PLAIN)  # three chunked RoPE layers, then a global NoPE layer


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    mode: ForwardMode
    reqs: Tuple[Tuple[int, int], ...]  # (prefix, new) per request; positions prefix .. prefix + new - 1
    chunk: int  # attention_chunk_size
    catches: str
    layers: Tuple[LayerSpec, ...] = (IROPE, PLAIN)
    page_size: int = 1
    dtype: torch.dtype = torch.float32
    save_kv_cache: bool = True
    piecewise: bool = False


CASES = [
    Case("extend_p1_c4", EXTEND, ((0, 13), (5, 9), (0, 1), (2, 2)), 4,
         "a prefill crossing 3 chunk boundaries, with and without prefix, attending its whole causal history"),
    Case("extend_prefix_p16_c16", EXTEND, ((20, 30), (33, 7), (0, 40), (16, 1)), 16,
         "page size 16: a virtual row holding another chunk's pages (the seed reads slots as page ids)",
         page_size=16),
    Case("extend_p16_c32", EXTEND, ((10, 45), (0, 3), (31, 2)), 32,
         "window, sinks and softcap inside a chunk; a local layer's plan leaking into the global layer",
         (IROPE_SWA_SINK, IROPE_CAP, PLAIN), page_size=16),
    Case("llama4_mix_p1_c8", EXTEND, ((3, 21), (17, 6)), 8,
         "layers of one model alternating local / global: each picks its own plan (md.local or md)", LLAMA4),
    Case("decode_p1_c8", DECODE, ((7, 1), (8, 1), (30, 1), (0, 1), (55, 1)), 8,
         "decode: a token at a chunk's last position sees the whole chunk, one opening a chunk only itself"),
    Case("decode_p16_c16", DECODE, ((15, 1), (16, 1), (47, 1), (62, 1)), 16, "decode at page = chunk boundaries",
         (IROPE_SWA_SINK, PLAIN), page_size=16),
    Case("decode_p16_c32", DECODE, ((31, 1), (32, 1), (63, 1), (5, 1)), 32,
         "a chunk of two pages: the virtual row's second page id", page_size=16),
    Case("mixed_p16_c16", MIXED, ((0, 20), (30, 1), (12, 9), (47, 1)), 16,
         "MIXED (chunked prefill + decode) gets a virtual batch too (the seed has none)", page_size=16),
    Case("mixed_p1_c4", MIXED, ((3, 6), (9, 1), (0, 1)), 4, "MIXED at page size 1"),
    Case("chunk_1", EXTEND, ((3, 4), (0, 2)), 1, "chunk 1: every query sees itself only"),
    Case("chunk_beyond_context", EXTEND, ((10, 30), (0, 50)), 128,
         "a chunk longer than the context: the virtual row's width bounded by the page table", page_size=16),
    Case("extend_bf16", EXTEND, ((10, 22), (0, 30)), 16, "bf16 activations and pool",
         (IROPE_SWA_SINK, PLAIN), page_size=16, dtype=torch.bfloat16),
    Case("extend_no_save", EXTEND, ((9, 16), (20, 3)), 16, "save_kv_cache=False on a local layer writes nothing",
         page_size=16, save_kv_cache=False),
    Case("extend_piecewise", EXTEND, ((5, 11), (0, 6)), 4,
         "forward_batch._attn_output (piecewise CUDA graph) left unfilled by a local layer", piecewise=True),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_local_mode(case: Case):
    world = World(case.layers, page_size=case.page_size, dtype=case.dtype, chunk=case.chunk)
    backend = torch_bridge.FlashAttentionBackend(world.runner)
    fb, ex = plain_step(world, [Req(world.new_request(), p, n) for p, n in case.reqs], case.mode)
    check_step(world, backend, fb, ex, what=f"{case.name} [{case.catches}]", save_kv_cache=case.save_kv_cache,
               piecewise=case.piecewise)
    assert backend.step.layout.local, f"{case.name}: the step's packed plan must carry md.local"


@pytest.mark.parametrize("page_size,chunk,committed", [(1, 4, (9, 30, 2, 3)), (16, 16, (14, 45, 16))],
                         ids=["p1_c4", "p16_c16"])
def test_local_chain_verify(page_size, chunk, committed):
    """Catches: chain (topk 1) target verify of a local layer attending across a chunk boundary that its
    draft tokens cross (the virtual batch must follow the verify's KV offset of N draft tokens)."""
    world = World((IROPE, SWA), page_size=page_size, chunk=chunk, server_args=server_args_for(**EAGLE_CHAIN))
    n = EAGLE_CHAIN["draft"]
    backend = torch_bridge.FlashAttentionBackend(world.runner)
    fb, ex = verify_step(world, [Req(world.new_request(), c, n) for c in committed], chain=True)
    check_step(world, backend, fb, ex, what=f"chain verify p{page_size} c{chunk}")


def test_use_irope_outside_a_local_model_attends_fully():
    """Catches: ``layer.use_irope`` chunked without ``model_config.is_local_attention_model`` (the seed
    gives such layers full attention)."""
    world = World((IROPE, PLAIN))  # no chunk: is_local_attention_model False
    backend = torch_bridge.FlashAttentionBackend(world.runner)
    fb, ex = plain_step(world, [Req(world.new_request(), 3, 14), Req(world.new_request(), 0, 20)])
    check_step(world, backend, fb, ex, what="use_irope in a global model")
    assert not backend.step.layout.local


class RunnerWithoutChunk(ModelRunner):
    """A runner that does not copy ``model_config.attention_chunk_size`` (None on the runner)."""

    attention_chunk_size = None  # type: ignore[assignment]


def test_chunk_read_from_model_config_when_the_runner_has_none():
    """Catches: the chunk read from ``model_runner.attention_chunk_size`` only: None there means the model
    config's value, not full attention and not an error."""
    world = World((IROPE, PLAIN), chunk=8)
    world.runner.__class__ = RunnerWithoutChunk
    assert world.runner.attention_chunk_size is None
    backend = torch_bridge.FlashAttentionBackend(world.runner)
    fb, ex = plain_step(world, [Req(world.new_request(), 5, 12), Req(world.new_request(), 17, 1)])
    check_step(world, backend, fb, ex, what="chunk from model_config")


# ---- what raises -------------------------------------------------------------------------------------
def test_local_model_without_chunk_size_is_refused():
    """Catches: a local-attention model without ``attention_chunk_size`` (None in SGLang's config when the
    HF config lacks it) run as a global model; the seed asserts."""
    world = World((IROPE,))
    world.runner.model_config.is_local_attention_model = True
    with pytest.raises(ValueError, match="attention_chunk_size"):
        torch_bridge.FlashAttentionBackend(world.runner)


def test_chunk_not_a_page_multiple_is_refused():
    """Catches: a chunk starting inside a page (24 tokens, page 16) silently shrunk to a page multiple as
    the seed does, which changes what the model attends."""
    world = World((IROPE,), page_size=16, chunk=24)
    with pytest.raises(NotImplementedError, match="attention_chunk_size=24 is not a multiple of page_size=16"):
        torch_bridge.FlashAttentionBackend(world.runner)


def _refused(world: World, backend, fb, ex, words: str, plan: bool = True) -> None:
    before = world.snapshot()
    with pytest.raises(NotImplementedError, match=words):
        check_step(world, backend, fb, ex, what="refused", plan=plan)
    world.check_pools(before, f"a refused use_irope step ({words})")


def test_tree_verify_with_a_local_layer_is_refused():
    """Catches: a local layer in tree (topk > 1) verify given full attention (the seed's cascade path has no
    local metadata) or failing after writing its K/V."""
    world = World((IROPE, PLAIN), chunk=8, server_args=server_args_for(**EAGLE_TREE))
    backend = torch_bridge.FlashAttentionBackend(world.runner)
    fb, ex = verify_step(world, [Req(world.new_request(), c, EAGLE_TREE["draft"]) for c in (9, 20)], chain=False)
    _refused(world, backend, fb, ex, "use_irope .* TARGET_VERIFY step with topk=2")


def test_draft_extend_with_a_local_layer_is_refused():
    """Catches: draft extend (no local metadata, in the seed too) running a local layer with full attention."""
    world = World((IROPE,), chunk=8, server_args=server_args_for(**EAGLE_CHAIN))
    backend = torch_bridge.FlashAttentionBackend(world.runner, skip_prefill=False)
    fb, ex = draft_extend_step(world, [Req(world.new_request(), c, a) for c, a in ((10, 2), (20, 4))])
    _refused(world, backend, fb, ex, "use_irope .* DRAFT_EXTEND step")


@pytest.mark.parametrize("page_size,chunk,committed", [(1, 8, (7, 15, 3, 22)), (16, 16, (15, 31, 40))],
                         ids=["p1_c8", "p16_c16"])
def test_local_multistep_draft_decode(page_size, chunk, committed):
    """Catches: chain (topk 1) multi-step draft decode (``FlashAttentionMultiStepBackend``) running a local
    layer with full attention or refusing it, or a step's virtual batch built from another step's KV length:
    step ``i``'s query sits at position ``seq_len + i`` (KV length ``seq_len + i + 1``) and sees its own chunk
    only; committed lengths 7 / 15 / 31 put step 0 and step 1 on either side of a chunk boundary."""
    world = World((IROPE, IROPE_SWA_SINK, PLAIN), page_size=page_size, chunk=chunk,
                  server_args=server_args_for(**EAGLE_CHAIN))
    steps = EAGLE_CHAIN["steps"]
    multi = torch_bridge.FlashAttentionMultiStepBackend(world.runner, 1, steps)
    fb, expects = draft_round(world, [Req(world.new_request(), c, 0) for c in committed], 1, steps)
    check_draft_round(world, multi, fb, expects, what=f"local chain draft p{page_size} c{chunk}")
    assert all(b.step.layout.local for b in multi.attn_backends), "every draft step's plan must carry md.local"


def test_local_multistep_draft_decode_replay_equals_eager():
    """Catches: the draft steps' local virtual batches missing from the captured buckets' packed plans (a
    replay attending the capture batch's chunks, or everything), replays differing from eager, retraces."""
    world = World((IROPE, PLAIN), page_size=1, chunk=8, server_args=server_args_for(**EAGLE_CHAIN))
    steps = EAGLE_CHAIN["steps"]
    multi = torch_bridge.FlashAttentionMultiStepBackend(world.runner, 1, steps)
    graph = EAGLEDraftCudaGraphRunner(world.runner, multi, (2, 4))
    model = GraphModel(world, multi, graph)
    graph.capture(*model.parts)
    for b, committed in enumerate(((7, 30, 15), (23,))):
        fb, expects = draft_round(world, [Req(world.new_request(), c, 0) for c in committed], 1, steps)
        eager = check_draft_round(world, multi, fb, expects, what=f"eager batch {b}")
        before = traces(*multi.attn_backends)
        check_draft_round(world, multi, graph.replay(fb), expects, what=f"replay batch {b}", replay=eager)
        assert all(s.step.layout.local and s.step.graph for s in multi.attn_backends)
        assert traces(*multi.attn_backends) == before, f"batch {b}: replay of a captured bucket traced again"


def test_multistep_tree_draft_decode_with_a_local_layer_is_refused():
    """Catches: tree (topk > 1) draft decode (no local metadata for the cascade, none in the seed either)
    running a local layer with full attention, or failing after its K/V write."""
    world = World((IROPE,), chunk=8, server_args=server_args_for(**EAGLE_TREE))
    topk, steps = EAGLE_TREE["topk"], EAGLE_TREE["steps"]
    multi = torch_bridge.FlashAttentionMultiStepBackend(world.runner, topk, steps)
    fb, expects = draft_round(world, [Req(world.new_request(), c, 0) for c in (9, 21)], topk, steps)
    multi.init_forward_metadata(fb)
    fb.out_cache_loc = step_locs(fb, topk, steps)[0].contiguous()
    _refused(world, multi.attn_backends[0], fb, expects[0], "use_irope .* DECODE step with topk=2", plan=False)


@pytest.mark.parametrize("spec", [LayerSpec(cross=True, irope=True), LayerSpec(encoder_only=True, irope=True)],
                         ids=["cross", "encoder_only"])
def test_non_causal_local_layer_is_refused(spec):
    """Catches: ``use_irope`` on a cross-attention / ENCODER_ONLY layer (no chunk semantics) run as either."""
    world = World((spec,), chunk=8, encoder_decoder=spec.cross)
    backend = torch_bridge.FlashAttentionBackend(world.runner)
    reqs = [Req(world.new_request(), 4, 6, enc=5 if spec.cross else 0, enc_new=spec.cross)]
    fb, ex = plain_step(world, reqs)
    _refused(world, backend, fb, ex, "use_irope .* cross-attention or ENCODER_ONLY")


# ---- CUDA-graph capture and replay ---------------------------------------------------------------------
GRAPH_CASES = [  # (name, server, page_size, chunk, layers, committed tokens per replayed batch)
    ("decode_p1_c8", None, 1, 8, (IROPE, PLAIN), ((7, 8, 30), (55,))),
    ("decode_p16_c16", None, 16, 16, (IROPE_CAP, PLAIN), ((15, 16, 47, 62), (31, 3))),
    ("verify_chain_p16_c16", EAGLE_CHAIN, 16, 16, (IROPE, SWA), ((9, 40, 2), (29,))),
]


def _capture(world: World, graph) -> None:
    allowed = sorted(set(graph.out_cache_loc.tolist()))
    before = world.snapshot()
    graph.capture(lambda fb, n: forward_layers(world, fb, random_qkv(world, n)))
    world.check_pools(before, "capture runs", free=allowed)


@pytest.mark.parametrize("name,server,page_size,chunk,layers,batches", GRAPH_CASES, ids=[c[0] for c in GRAPH_CASES])
def test_local_replay_equals_eager(name, server, page_size, chunk, layers, batches):
    """Catches: the local virtual batch missing from the packed plan buffer (replay attending the capture
    batch's chunks, or everything), a static row bound too small for a replayed bucket, a replay that
    differs from eager on a real row, writes outside the real slots and slot 0, or retraces."""
    world = World(layers, page_size=page_size, chunk=chunk, server_args=server_args_for(**(server or {})))
    backend = torch_bridge.FlashAttentionBackend(world.runner)
    graph = CudaGraphRunner(world.runner, backend, (2, 4))
    _capture(world, graph)
    for b, committed in enumerate(batches):
        what = f"{name} batch {b}"
        rows = [world.new_request() for _ in committed]
        if server is None:
            fb, ex = plain_step(world, [Req(r, c, 1) for r, c in zip(rows, committed)], DECODE)
        else:
            fb, ex = verify_step(world, [Req(r, c, server["draft"]) for r, c in zip(rows, committed)], chain=True)
        outs, qkvs = check_step(world, backend, fb, ex, what=f"eager {what}")
        before = traces(backend)
        graph_fb = graph.replay(fb)
        assert backend.step.layout.local and backend.step.graph
        check_step(world, backend, graph_fb, ex, plan=False, qkvs=qkvs, pad_to=int(graph_fb.out_cache_loc.shape[0]),
                   eager=outs, what=f"replay {what}")
        assert traces(backend) == before, f"{what}: replay of a captured bucket traced again"
    check_idle_replay(world, backend, graph, name)


# ---- the Mosaic launch path (interpreted on the CPU) ---------------------------------------------------
LHQ, LHKV, LD, LPAGE, LCTX, LCHUNK = 4, 2, 64, 16, 96, 32  # shapes the Mosaic kernel covers (bf16, head dim 64)


class _CountedKernel:
    """The compiled kernel for torch launches (``mosaic_path.launcher_kernel``), counting its launches."""

    calls = 0

    def __init__(self, st, num_tiles, example):
        from torch_bridge.mosaic_path import launcher_kernel
        self.kernel = launcher_kernel(st, num_tiles, example)

    def bind(self, *tensors, out):
        launch = self.kernel.bind(*tensors, out=out)

        class Counted:
            set_arg, set_out = launch.set_arg, launch.set_out

            def __call__(self):
                _CountedKernel.calls += 1
                launch()
        return Counted()


def _launch_world(seed: int):
    """Two layers (local, global) on the launch path: the compiled kernel on a Hopper GPU
    (``JAX_ATTN_CONTRACT_DEVICE=cuda``), else the same kernel through the Mosaic GPU interpreter."""
    from tests.paging import shuffled_table
    from tests.test_bridge_launch import InterpretedKernel
    from torch_bridge.mosaic_path import MosaicPath

    if ON_CUDA and not hopper():
        pytest.skip("the bridge's Mosaic launch path needs a Hopper GPU")
    kernel = _CountedKernel if ON_CUDA else InterpretedKernel
    table, num_slots = shuffled_table(6, LCTX, LPAGE, seed)
    pool = torch_bridge.MHATokenToKVPool.create(num_slots, 2, LHKV, LD, torch.bfloat16, DEVICE)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.fill_(float("nan"))
        buf[0] = 0.0
    config = types.SimpleNamespace(  # SGLang's names: the layer shapes seed both table keys
        context_len=LCTX, is_local_attention_model=True, attention_chunk_size=LCHUNK,
        hf_text_config=types.SimpleNamespace(num_attention_heads=LHQ), get_num_kv_heads=lambda tp: LHKV)
    r2t = torch_bridge.ReqToTokenPool(torch.from_numpy(table).clone().to(DEVICE))
    runner = torch_bridge.ModelRunner(r2t, pool, config, page_size=LPAGE)
    backend = torch_bridge.FlashAttentionBackend(runner, mosaic_path=MosaicPath(make_kernel=kernel))
    layers = [torch_bridge.RadixAttention(LHQ, LD, 0.37, LHKV, 0, use_irope=True),
              torch_bridge.RadixAttention(LHQ, LD, 0.29, LHKV, 1)]
    return table, runner, backend, layers, kernel


def _launch_step(table, runner, backend, layers, rng, rows, kv_lens, q_lens, replay_bs: Optional[int] = None):
    """Plan (eager, or the replay hook of bucket ``replay_bs``), run both layers, check each against
    float64 and its pools bit for bit (only the step's slots written)."""
    def rand(*shape):
        return torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(torch.bfloat16).to(DEVICE)
    pool, t = runner.token_to_kv_pool, int(sum(q_lens))
    seen, pos = [], []  # causal keys and position of every query row
    for r, n, m in zip(rows, kv_lens, q_lens):
        cols = torch.from_numpy(table[r, :n].astype(np.int64)).to(DEVICE)
        for b in pool.k_buffer + pool.v_buffer:  # committed K/V
            b[cols[:n - m]] = rand(n - m, LHKV, LD)
        seen += [cols[:n - m + j + 1].cpu().numpy() for j in range(m)]
        pos += list(range(n - m, n))
    loc = torch.from_numpy(np.concatenate([table[r, n - m:n] for r, n, m in zip(rows, kv_lens, q_lens)]).astype(
        np.int64)).to(DEVICE)
    i64 = [torch.from_numpy(np.asarray(x, np.int64)).to(DEVICE) for x in (rows, kv_lens, q_lens)]
    decode = all(m == 1 for m in q_lens)
    fb = torch_bridge.ForwardBatch(DECODE if decode else EXTEND, len(rows), i64[0], i64[1], loc,
                                   extend_seq_lens=None if decode else i64[2], token_to_kv_pool=pool)
    if replay_bs is None:
        backend.init_forward_metadata(fb)
    else:
        backend.init_forward_metadata_replay_cuda_graph(replay_bs, i64[0], i64[1], None, None, DECODE, None, None,
                                                        out_cache_loc=loc)
    for layer in layers:
        q, k, v = rand(t, LHQ * LD), rand(t, LHKV * LD), rand(t, LHKV * LD)
        expected = [x.clone() for x in pool.get_kv_buffer(layer.layer_id)]
        out = backend.forward(q, k, v, layer, fb)
        for name, buf, want, new in zip("KV", pool.get_kv_buffer(layer.layer_id), expected, (k, v)):
            want[loc] = new.reshape(t, LHKV, LD)
            assert torch.equal(as_bits(buf), as_bits(want)), f"layer {layer.layer_id} {name} pool: other slots written"
        kp, vp = (x.double().cpu().numpy() for x in pool.get_kv_buffer(layer.layer_id))
        ref = attention64(q.double().cpu().numpy().reshape(t, LHQ, LD), kp, vp,
                          chunk_local(seen, pos, LCHUNK) if layer.use_irope else seen, scale=layer.scaling)
        np.testing.assert_allclose(out.double().cpu().numpy(), ref.reshape(t, -1), atol=3e-2, rtol=3e-2,
                                   err_msg=f"layer {layer.layer_id} (use_irope={layer.use_irope})")


def test_local_layers_on_the_launch_path():
    """Catches: a local layer launched with the step's tables (full attention) instead of its virtual
    batch's; the local tables missing from the planner call (a second JAX call per step, and none at
    graph replay); local layers silently falling off the launch path (not capturable on a GPU)."""
    table, runner, backend, layers, kernel = _launch_world(3)
    rng = np.random.default_rng(0)
    calls = kernel.calls
    _launch_step(table, runner, backend, layers, rng, [2, 5], [50, 73], [30, 40])  # crosses chunks 0..2
    assert {h for h, _ in backend.step.layout.tables} == {(LHQ, LHKV), (LHQ, LHKV, 1)}
    assert kernel.calls == calls + 2, "both layers must run on the launch path"
    _launch_step(table, runner, backend, layers, rng, [2, 5, 1], [51, 64, 33], [1, 1, 1])
    assert kernel.calls == calls + 4
    backend.init_cuda_graph_state(4, 4)
    z = torch.zeros(4, dtype=torch.long, device=DEVICE)
    backend.init_forward_metadata_capture_cuda_graph(4, 4, z, z + 1, None, DECODE, None)
    _launch_step(table, runner, backend, layers, rng, [1, 3, 4], [32, 5, 95], [1, 1, 1], replay_bs=4)
    local = backend.step.tables[(LHQ, LHKV, 1)].flat.data_ptr()
    _launch_step(table, runner, backend, layers, rng, [2, 6, 3, 5], [64, 17, 33, 90], [1, 1, 1, 1], replay_bs=4)
    assert backend.step.tables[(LHQ, LHKV, 1)].flat.data_ptr() == local, "replay tables in one persistent buffer"
    assert kernel.calls == calls + 8
