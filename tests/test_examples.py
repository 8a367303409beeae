"""The README's main command (examples/decode_llama.py) runs, and its self-check can fail; its overlap
loop (with and without static replay buffers) decodes the same tokens as the blocking loop; every
weight/pool layout of the example model computes the same step; the JAX-step benchmark's HLO
counts see what a step copies."""

import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import bench_jax_step  # noqa: E402
import decode_llama  # noqa: E402
import decode_mla  # noqa: E402
import llama  # noqa: E402
import step_analysis  # noqa: E402

from jax_attn.backend import FlashAttentionBackend  # noqa: E402
from jax_attn.batch import ForwardBatch  # noqa: E402
from jax_attn.capture import StepRunner  # noqa: E402
from jax_attn.metadata import ForwardMode  # noqa: E402


@pytest.mark.parametrize("layout", ["list", "fused"])
def test_decode_example_passes_its_check(layout):
    assert decode_llama.main(config="tiny", batch=3, new_tokens=4, page_size=4, impl="auto", seed=1,
                             layout=layout) == 0


def test_decode_example_check_detects_wrong_tokens():
    cfg = llama.CONFIGS["tiny"]
    params = llama.init_params(cfg, 0)
    prompt = np.arange(6, dtype=np.int32)
    dense = np.asarray(llama.forward_dense(cfg, params, np.concatenate([prompt, [0, 0]]).astype(np.int32)))
    good = [int(np.argmax(dense[5]))]
    logits = [dense[5]]
    worst, mism = decode_llama.check_against_dense(cfg, params, [prompt], [good], [logits], 1e-4)
    assert mism == 0 and worst < 1e-5
    bad = [(good[0] + 1) % cfg.vocab]
    _, mism = decode_llama.check_against_dense(cfg, params, [prompt], [bad], [[dense[5] + 1.0]], 1e-4)
    assert mism == 1


@pytest.mark.parametrize("front", ["jax", "torch"])
def test_mla_example_passes_its_check(front):
    """The DeepSeek-style example: absorbed MLA over the paged latent pool (the Triton-lowered kernel,
    interpreted), through the JAX API and through the torch bridge, equals un-absorbed dense attention."""
    assert decode_mla.main(batch=3, new_tokens=3, page_size=4, seed=4, front=front) == 0


def test_mla_example_check_detects_wrong_values():
    """The example's check compares against un-absorbed attention: values read from the rope part, or a
    model whose absorbed and dense halves disagree (W_uv swapped for another head's), fail it."""
    cfg = decode_mla.MLAConfig()
    params = decode_mla.init_params(cfg, 0)
    prompt = np.arange(5, dtype=np.int32)
    dense = np.asarray(decode_mla.forward_dense(cfg, params, np.concatenate([prompt, [0]]).astype(np.int32)))
    worst, mism = decode_mla.check_against_dense(cfg, params, [prompt], [[int(np.argmax(dense[4]))]], [[dense[4]]],
                                                 1e-3)
    assert mism == 0 and worst < 1e-6
    bad = dict(params, layers=[dict(lp, w_uv=lp["w_uv"][::-1]) for lp in params["layers"]])
    other = np.asarray(decode_mla.forward_dense(cfg, bad, np.concatenate([prompt, [0]]).astype(np.int32)))
    worst, _ = decode_mla.check_against_dense(cfg, params, [prompt], [[int(np.argmax(other[4]))]], [[other[4]]], 1e-3)
    assert worst > 1e-2


def test_stacked_flag_means_scan_layout(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["decode_llama.py", "--stacked"])
    assert decode_llama.parse()["layout"] == "scan"


def test_model_flags(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["decode_llama.py"])
    assert decode_llama.parse()["model"] is None and decode_llama.parse()["layout"] is None  # main: list
    monkeypatch.setattr(sys, "argv", ["decode_llama.py", "--model", "smollm2", "--prompt", "a", "--prompt", "b"])
    assert decode_llama.parse()["model"] == "smollm2" and decode_llama.parse()["prompts"] == ["a", "b"]


def test_loop_flags(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["decode_llama.py"])
    assert not decode_llama.parse()["overlap"] and not decode_llama.parse()["static_buffers"]
    monkeypatch.setattr(sys, "argv", ["decode_llama.py", "--overlap", "--static-buffers"])
    assert decode_llama.parse()["overlap"] and decode_llama.parse()["static_buffers"]


@functools.lru_cache(maxsize=None)
def _decode(batch: int, overlap: bool, static_buffers: bool):
    """``main``'s run and check on the tiny model: (exit code, generated tokens per request)."""
    run = decode_llama.generate(config="tiny", batch=batch, new_tokens=4, page_size=4, seed=1, overlap=overlap,
                                static_buffers=static_buffers)
    return decode_llama.report(run, check=True), run["generated"]


# batch 4 fills its bucket: replay then returns the static output buffers themselves (no slice), which
# the next replay refills, so a loop that keeps them uncopied fails here.
@pytest.mark.parametrize("batch,overlap,static_buffers", [(3, True, False), (4, True, True), (4, False, True)])
def test_decode_loops_match_the_blocking_loop(batch, overlap, static_buffers):
    code, tokens = _decode(batch, overlap, static_buffers)
    want_code, want = _decode(batch, False, False)
    assert code == 0 and want_code == 0
    assert len(tokens) == batch and all(len(t) == 4 for t in tokens)
    assert tokens == want


@functools.lru_cache(maxsize=None)
def _prefill_then_decode(layout: str):
    """Two ragged prompts prefilled, then one decode step, with ``layout``; pools start as NaN."""
    cfg, page = llama.CONFIGS["tiny"], 4
    reqs = decode_llama.PagedRequests(batch=2, max_ctx=16, page_size=page, seed=3)
    backend = FlashAttentionBackend(reqs.req_to_token, page_size=page, max_context_len=16, impl="reference")
    params = llama.with_layout(llama.init_params(cfg, 0), layout)
    pools = jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), llama.layout_pools(cfg, layout, reqs.num_slots))
    runner = StepRunner(backend, decode_llama.make_step(cfg, backend, layout), donate_argnums=(1,))
    lens = np.array([6, 3], np.int32)
    prompt_ids = np.array([7, 8, 9, 10, 11, 12, 20, 21, 22], np.int32)
    fb = ForwardBatch(ForwardMode.EXTEND, reqs.rows, lens, reqs.slots(np.zeros(2, np.int32), lens),
                      extend_seq_lens=lens)
    pos = np.concatenate([np.arange(n) for n in lens]).astype(np.int32)
    prefill, pools = runner.eager(fb, dict(ids=prompt_ids, pos=pos), params, pools)
    fb = ForwardBatch(ForwardMode.DECODE, reqs.rows, lens + 1, reqs.slots(lens, np.ones(2, np.int32)))
    decode, _ = runner.eager(fb, dict(ids=np.array([5, 4], np.int32), pos=lens), params, pools)
    return np.asarray(prefill), np.asarray(decode), params


@pytest.mark.parametrize("layout", [lay for lay in llama.LAYOUTS if lay != "list"])
def test_every_layout_computes_the_list_layout_step(layout):
    want_prefill, want_decode, _ = _prefill_then_decode("list")
    got_prefill, got_decode, params = _prefill_then_decode(layout)
    assert np.all(np.isfinite(got_decode))
    np.testing.assert_allclose(got_prefill, want_prefill, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got_decode, want_decode, rtol=1e-5, atol=1e-5)
    dense = llama.forward_dense(llama.CONFIGS["tiny"], params, jnp.array([20, 21, 22, 4], jnp.int32))
    np.testing.assert_allclose(got_decode[1], np.asarray(dense)[-1], rtol=1e-4, atol=1e-4)


def test_hlo_counts_see_a_materialised_slice():
    w, x = jnp.ones((8, 16, 32)), jnp.ones((4, 16))
    sliced = step_analysis.hlo_counts(jax.jit(lambda w, x: x @ w[3]).lower(w, x).compile().as_text())
    whole = step_analysis.hlo_counts(jax.jit(lambda w, x: x @ w).lower(w[3], x).compile().as_text())
    assert sliced["slice"] >= 1 and sliced["slice_fusions"] == 1
    assert sliced["largest_mb"] == pytest.approx(16 * 32 * 4 / 1e6)
    assert whole["slice"] == whole["slice_fusions"] == 0 and whole["moved_mb"] == 0.0


def test_fused_step_reads_the_stacked_pool_in_place():
    env = bench_jax_step.setup("tiny", batch=4, ctx=1024, page_size=4, steps=2, layers=None, impl="auto",
                                    layout="fused")
    counts = step_analysis.hlo_counts(env["exe"].as_text())
    layer_pool_mb = env["pools"].k[0].nbytes / 1e6
    assert 0 < counts["largest_mb"] < layer_pool_mb / 4, (counts, layer_pool_mb)


def test_torch_engine_example_passes_its_check():
    import decode_torch

    assert decode_torch.main(config="tiny", batch=3, new_tokens=4, page_size=4, seed=2) == 0


def test_step_timeline_splits_a_step_into_its_parts():
    """``step_analysis.analyze`` on a hand-made trace: two steps, overlapping GPU work, one gap."""

    def ev(name, ts, dur, cat=None):
        return dict(name=name, ts=ts, dur=dur, **({"cat": cat} if cat else {}))

    events = []
    for s0 in (0, 1000):
        events += [ev("step", s0, 500), ev("call", s0, 80),
                   ev("Memcpy HtoD", s0 + 50, 10, "gpu_memcpy"), ev("k1", s0 + 100, 100, "kernel"),
                   ev("k2", s0 + 150, 100, "kernel"),  # overlaps k1: busy 150, not 200
                   ev("k3", s0 + 300, 100, "kernel"), ev("cuLaunchKernelEx", s0 + 20, 5, "cuda_driver")]
    rep = step_analysis.analyze(events)
    assert rep["steps"] == 2
    assert rep["median"] == dict(wall=500, call=80, first=50, busy=260, idle=90, tail=100, acts=4)
    assert rep["gaps"][0] == (50, "k2", "k3") and len(rep["gaps"]) == 4  # 40 and 50 us gaps, per step
    assert rep["api"] == [("cuLaunchKernelEx", 5.0)]
