"""torch_bridge's Mosaic launch path (``torch_bridge.mosaic_path``) against the reference.

On CPU the kernel runs in the Mosaic GPU interpreter through a stand-in for the launcher (same
arguments, same tables, same torch-side packing); the compiled launch, the stream order and
``torch.cuda.graph`` capture of whole steps are checked on the GPU (``gpu`` marker).
"""

import dataclasses
import math
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.experimental.pallas import mosaic_gpu as plgpu

from jax_attn.kv_cache import paged_view
from jax_attn.reference import paged_attention_reference
from tests.paging import shuffled_table
from torch_bridge import (FlashAttentionBackend, ForwardBatch, ForwardMode, MHATokenToKVPool, ModelConfig,
                          ModelRunner, RadixAttention, ReqToTokenPool)
from torch_bridge.mosaic_path import TRITON_TABLES, MosaicPath, kernel_outputs

# engine calls under plain / no_grad / inference mode (tests/conftest.py: JAX_ATTN_GRAD_MODES)
pytestmark = pytest.mark.usefixtures("engine_grad_mode")

HQ, HKV, D, PAGE, MAX_CTX = 4, 2, 64, 16, 96


def same_bytes(t, shape, dtype) -> bool:
    """Whether ``t`` holds what a launch compiled for ``shape`` / ``dtype`` reads through its pointer alone:
    contiguous, that dtype and that many elements (any shape)."""
    return t.dtype == dtype and t.numel() == math.prod(shape) and t.is_contiguous()


class InterpretedKernel:
    """Stand-in for a launched kernel: the same call through the Mosaic GPU interpreter (with
    ``return_lse`` statics, its output and per-tile LSE; the split kernel's partials and per-tile LSE:
    ``mosaic_path.kernel_outputs``)."""

    calls = 0

    def __init__(self, st, num_tiles, example):
        call = kernel_outputs(dataclasses.replace(st, interpret=True), num_tiles, plgpu.InterpretGPUParams())
        self.fn = jax.jit((lambda *a: call(*a)) if st.return_lse else (lambda *a: (call(*a),)))
        self.shapes = [tuple(t.shape) for t in example]

    def bind(self, *tensors, out):
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        assert [tuple(t.shape) for t in tensors] == self.shapes and all(o.is_contiguous() for o in outs)
        return _InterpretedLaunch(self.fn, list(tensors), outs)


class _InterpretedLaunch:
    """A bound launch: reads the bound tensors' current contents when called, as a launch would."""

    def __init__(self, fn, args, outs):
        self.fn, self.args, self.outs = fn, args, outs

    def set_arg(self, i, t):  # a launch reads the pointer: the bytes of the bound shape, in any shape
        assert same_bytes(t, self.args[i].shape, self.args[i].dtype)
        self.args[i] = t.view(self.args[i].shape)

    def set_out(self, i, t):
        assert same_bytes(t, self.outs[i].shape, self.outs[i].dtype)
        self.outs[i] = t.view(self.outs[i].shape)

    def __call__(self):
        InterpretedKernel.calls += 1
        args = [jnp.asarray(t.float().numpy()).astype(jnp.bfloat16) if t.dtype == torch.bfloat16
                else jnp.asarray(t.numpy()) for t in self.args]
        for out, res in zip(self.outs, self.fn(*args), strict=True):
            out.copy_(torch.from_numpy(np.array(res.astype(jnp.float32))))


def setup(seed, device="cpu", page=PAGE, path=None, dtype=torch.bfloat16, num_layers=1):
    table, num_slots = shuffled_table(6, MAX_CTX, page, seed)
    pool = MHATokenToKVPool.create(num_slots, num_layers, HKV, D, dtype, device)
    for buf in pool.k_buffer + pool.v_buffer:  # NaN everywhere a step does not write or read
        buf.fill_(float("nan"))
        buf[0] = 0.0
    runner = ModelRunner(ReqToTokenPool(torch.from_numpy(table).to(device).clone()), pool, ModelConfig(MAX_CTX),
                         page_size=page, device=str(device))
    if path is None and device == "cpu":  # GPU: the device default
        path = MosaicPath(make_kernel=InterpretedKernel)
    return runner, table, FlashAttentionBackend(runner, mosaic_path=path)


def fill(runner, table, rows, lens, rng, layer_id=0):
    kb, vb = runner.token_to_kv_pool.get_kv_buffer(layer_id)
    for r, n in zip(rows, lens):
        s = torch.from_numpy(table[r, :n].astype(np.int64)).to(kb.device)
        for b in (kb, vb):
            b[s] = torch.from_numpy(rng.standard_normal((n, HKV, D)).astype(np.float32)).to(b)


def reference(runner, table, rows, kv_lens, q_lens, q, sinks=None, scale=None, kv_scales=(None, None), layer_id=0):
    """Float32 attention over the pool (``kv_scales``: an fp8 pool's stored values times the layer's scales)."""
    kb, vb = (jnp.asarray(b.float().cpu().numpy()) * (1.0 if s is None else s)
              for b, s in zip(runner.token_to_kv_pool.get_kv_buffer(layer_id), kv_scales))
    page = runner.page_size
    pt = table[rows][:, ::page] // page
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    out = paged_attention_reference(jnp.asarray(q.float().cpu().numpy()).reshape(-1, HQ, D),
                                    paged_view(kb, page), paged_view(vb, page), jnp.asarray(kv_lens, jnp.int32),
                                    jnp.asarray(cu), jnp.asarray(pt), page_size=page,
                                    sinks=None if sinks is None else jnp.asarray(sinks.cpu().numpy()),
                                    softmax_scale=scale)
    return np.asarray(out).reshape(q.shape[0], HQ * D)


def plan_step(runner, table, backend, rows, kv_lens, q_lens, rng, *, replay_bs=None):
    """A decode (every ``q_lens`` 1) or extend batch of ``rows`` holding ``kv_lens`` keys after it, planned
    eagerly or by the replay hook of bucket ``replay_bs``, and random bf16 ``q, k, v`` for its tokens."""
    loc = np.concatenate([table[r, n - m:n] for r, n, m in zip(rows, kv_lens, q_lens)]).astype(np.int64)
    decode = bool((q_lens == 1).all())
    dev = runner.req_to_token_pool.req_to_token.device
    t64 = [torch.from_numpy(x.astype(np.int64)).to(dev) for x in (rows, kv_lens, loc, q_lens)]
    fb = ForwardBatch(ForwardMode.DECODE if decode else ForwardMode.EXTEND, len(rows), t64[0], t64[1], t64[2],
                      extend_seq_lens=None if decode else t64[3], token_to_kv_pool=runner.token_to_kv_pool)
    if replay_bs is None:
        backend.init_forward_metadata(fb)
    else:
        backend.init_forward_metadata_replay_cuda_graph(replay_bs, t64[0], t64[1], None, None, ForwardMode.DECODE,
                                                        None, None, out_cache_loc=t64[2])
    n = int(q_lens.sum())
    q, k, v = (torch.from_numpy(rng.standard_normal((n, h * D)).astype(np.float32)).to(torch.bfloat16).to(dev)
               for h in (HQ, HKV, HKV))
    return fb, q, k, v


def step(runner, table, backend, rows, kv_lens, q_lens, rng, *, replay_bs=None, sinks=None, layer=None):
    """Plan (eager, or the replay hook of bucket ``replay_bs``), run one layer (``layer``: the engine's
    object, kept across steps; default a new one), compare."""
    rows, kv_lens, q_lens = (np.asarray(x) for x in (rows, kv_lens, q_lens))
    fill(runner, table, rows, kv_lens - q_lens, rng)
    fb, q, k, v = plan_step(runner, table, backend, rows, kv_lens, q_lens, rng, replay_bs=replay_bs)
    n = q.shape[0]
    layer = RadixAttention(HQ, D, D**-0.5, HKV, 0) if layer is None else layer
    out = backend.forward(q, k, v, layer, fb, sinks=sinks)
    assert out.shape == (n, HQ * D) and out.dtype == torch.bfloat16
    ref = reference(runner, table, rows, kv_lens, q_lens, q, sinks, scale=layer.scaling,
                    kv_scales=(layer.k_scale_float, layer.v_scale_float))
    np.testing.assert_allclose(out.float().cpu().numpy(), ref, atol=3e-2, rtol=3e-2)
    return backend


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [3, 20]], ids=["decode_packed", "extend_rows"])
def test_launch_path_eager(q_lens):
    rng = np.random.default_rng(len(q_lens))
    runner, table, backend = setup(1)
    before = InterpretedKernel.calls
    kv_lens = [40, 27, 90][:len(q_lens)]
    step(runner, table, backend, [2, 5, 1][:len(q_lens)], kv_lens, q_lens, rng)
    assert InterpretedKernel.calls == before + 1  # the layer ran on the launch path, not through JAX
    assert backend.step.tables[(HQ, HKV)].pack == (HQ // HKV if max(q_lens) == 1 else 1)


def test_a_checked_layer_is_rechecked_for_a_new_query_dtype():
    """The launch path skips its checks for a layer it ran before (``LayerHit``), and a launch reads only q's
    pointer: a float16 q after a bfloat16 one through the same layer and plan must not reuse the bfloat16
    kernel (it would read float16 bits as bfloat16). Its output equals a fresh backend's for the float16 q, or
    both refuse it alike. Catches a hit whose match ignores q's dtype."""
    rows, kv_lens, q_lens = np.array([2, 5]), np.array([40, 27]), np.array([1, 1])

    def run(backend, runner, table, dtypes):
        fill(runner, table, rows, kv_lens - q_lens, np.random.default_rng(3))
        fb, q, k, v = plan_step(runner, table, backend, rows, kv_lens, q_lens, np.random.default_rng(4))
        layer, got = RadixAttention(HQ, D, 0.09, HKV, 0), None
        for dt in dtypes:
            try:
                got = backend.forward(q.to(dt), k, v, layer, fb, save_kv_cache=False)
            except (ValueError, NotImplementedError) as e:
                got = type(e)
        return got

    runner, table, backend = setup(5)
    seen = run(backend, runner, table, (torch.bfloat16, torch.float16))
    runner, table, fresh = setup(5)
    want = run(fresh, runner, table, (torch.float16,))
    if isinstance(want, type):
        assert seen is want
    else:
        assert not isinstance(seen, type) and seen.dtype == want.dtype
        np.testing.assert_array_equal(seen.float().numpy(), want.float().numpy())


def test_launch_path_splits_few_long_decode_rows():
    """Decode of a few sequences whose (token, kv head) tiles cannot fill the GPU runs the split kernel and its
    merge on the launch path (split-KV, as the JAX API plans it): an eager step, then a graph bucket's step
    planned by its replay hook. Against the float32 reference over a NaN-poisoned pool. Catches a merge that
    drops a split, reads another row's LSE (the index), or splits that overlap or skip keys, and a launch path
    that still runs the unsplit kernel."""
    from jax_attn.kernels.mosaic_paged import MosaicConfig
    from tests.test_triton_launch import InterpretedTriton

    rng = np.random.default_rng(31)
    path = MosaicPath(make_kernel=InterpretedKernel, make_triton=InterpretedTriton,
                      config=MosaicConfig(min_kv_per_split=32))  # the 96-key bound: 3 splits
    runner, table, backend = setup(9, path=path)
    layer = RadixAttention(HQ, D, 0.07, HKV, 0)
    for replay, kv_lens in ((False, [40, 27, 90]), (True, [96, 1, 33])):
        if replay:
            backend.init_cuda_graph_state(4, 4)
            z = torch.zeros(4, dtype=torch.long)
            backend.init_forward_metadata_capture_cuda_graph(4, 4, z, z + 1, None, ForwardMode.DECODE, None)
        kernels, merges = InterpretedKernel.calls, InterpretedTriton.calls
        step(runner, table, backend, [2, 5, 1], kv_lens, [1, 1, 1], rng, replay_bs=4 if replay else None,
             layer=layer)
        tables = backend.step.tables[(HQ, HKV)]
        assert tables.num_splits == 3 and tables.layout is None  # the Mosaic kernel's split tables
        assert InterpretedKernel.calls == kernels + 1 and InterpretedTriton.calls == merges + 1  # kernel, merge


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("hq", [10, 14], ids=["group5", "group7"])
def test_launch_path_packs_groups_that_do_not_divide_the_block(hq, device, monkeypatch):
    """Query-head groups of 5 and 7 (Llama 4's 40 / 8, Qwen2.5-7B's 28 / 4 heads): a target verify step (4 draft
    tokens per request) launches the Mosaic kernel with the group packed into its rows (12 / 9 tokens a 64-row
    block, the last rows holding no query); decode rows launch the Triton-lowered kernel. Against the float32
    reference over a NaN-poisoned pool. Catches packed rows that read another token's or head's queries, empty
    rows written over the next token's outputs, and a policy sending verify rows elsewhere. (On the GPU: the
    compiled kernels through the real launcher, on a Hopper GPU.)"""
    from tests.test_triton_launch import InterpretedTriton
    from torch_bridge import SpecInfo

    if device == "cuda" and (not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0)):
        pytest.skip("needs a Hopper GPU")
    monkeypatch.setitem(globals(), "HQ", hq)  # the helpers' query heads
    n_draft, rows, committed = 4, np.array([2, 5, 1]), np.array([36, 23, 86])
    rng = np.random.default_rng(hq)
    path = MosaicPath(make_kernel=InterpretedKernel, make_triton=InterpretedTriton) if device == "cpu" else None
    runner, table, backend = setup(40 + hq, device=device, path=path)
    layer = RadixAttention(hq, D, 0.11, HKV, 0)
    fill(runner, table, rows, committed, rng)
    loc = np.concatenate([table[r, c:c + n_draft] for r, c in zip(rows, committed)]).astype(np.int64)
    t64 = [torch.from_numpy(x.astype(np.int64)).to(device) for x in (rows, committed, loc)]
    fb = ForwardBatch(ForwardMode.TARGET_VERIFY, len(rows), *t64, spec_info=SpecInfo(draft_token_num=n_draft),
                      token_to_kv_pool=runner.token_to_kv_pool)
    backend.init_forward_metadata(fb)
    q, k, v = (torch.from_numpy(rng.standard_normal((loc.shape[0], h * D)).astype(np.float32)).to(torch.bfloat16)
               .to(device) for h in (hq, HKV, HKV))
    kernels, tritons = InterpretedKernel.calls, InterpretedTriton.calls
    out = backend.forward(q, k, v, layer, fb)
    assert backend.step.tables[(hq, HKV)].pack == hq // HKV  # the Mosaic kernel's packed tables
    ref = reference(runner, table, rows, committed + n_draft, np.full(len(rows), n_draft), q, scale=layer.scaling)
    np.testing.assert_allclose(out.float().cpu().numpy(), ref, atol=3e-2, rtol=3e-2)
    step(runner, table, backend, rows, committed + n_draft + 1, [1, 1, 1], rng, layer=layer)
    assert (hq, HKV, TRITON_TABLES) in backend.step.tables  # decode rows: the Triton-lowered kernel's tables
    if device == "cpu":
        assert InterpretedKernel.calls == kernels + 1 and InterpretedTriton.calls > tritons


@pytest.mark.gpu
@pytest.mark.parametrize("page", [1, 4])
def test_launch_path_gathers_rows_at_small_pages(page):
    """Pages of 1 and 4 rows (SGLang's default is 1): an extend step launches the Mosaic kernel, whose
    producer gathers the key rows (cp.async on the GPU), over a NaN-poisoned pool with shuffled slots;
    a decode step keeps the Triton-lowered kernel there. Catches a gather reading the wrong slot or
    row order (the reference check) and a policy sending small-page prefill elsewhere. (On the CPU the
    interpreted kernel at page 1 is ``test_mosaic_kernel``'s, the rule ``test_auto_rule_on_hopper``'s.)"""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper GPU")
    rng = np.random.default_rng(page)
    runner, table, backend = setup(20 + page, device="cuda", page=page)
    layer = RadixAttention(HQ, D, D**-0.5, HKV, 0)
    kb, _ = runner.token_to_kv_pool.get_kv_buffer(0)

    def kernel():  # what the launch path picked for this step's layer (``LayerRunner._route``'s choice)
        key = backend.step.key
        max_q_len = 1 if key.mode.name == "DECODE" else key.num_tokens
        return backend.runner._kernel(backend.runner.layer_params(layer), key, torch.bfloat16, kb, False, max_q_len)

    step(runner, table, backend, [4, 5, 1], [33, 50, 70], [3, 20, 70], rng, layer=layer)
    assert (HQ, HKV) in backend.step.tables and kernel() == "mosaic", "small-page extend: the Mosaic kernel"
    step(runner, table, backend, [1, 2, 3], [40, 7, 90], [1, 1, 1], rng, layer=layer)
    assert kernel() == "triton", "decode at a small page runs the Triton-lowered kernel"


def test_launch_path_replay_reuses_persistent_tables():
    rng = np.random.default_rng(7)
    runner, table, backend = setup(2)
    backend.init_cuda_graph_state(4, 4)
    z = torch.zeros(4, dtype=torch.long)
    backend.init_forward_metadata_capture_cuda_graph(4, 4, z, z + 1, None, ForwardMode.DECODE, None)
    step(runner, table, backend, [1, 3, 4], [33, 5, 64], [1, 1, 1], rng, replay_bs=4)  # 3 rows padded to 4
    flat = backend.step.tables[(HQ, HKV)].flat
    # The next replay plans the bucket's tables before any layer runs, into the same buffer.
    step(runner, table, backend, [2, 5, 6, 3], [80, 17, 1, 48], [1, 1, 1, 1], rng, replay_bs=4)
    assert backend.step.tables[(HQ, HKV)].flat.data_ptr() == flat.data_ptr()


def test_calls_the_kernel_does_not_cover_run_through_jax():
    rng = np.random.default_rng(3)
    runner, table, backend = setup(3)
    backend.jax_backend.impl = "reference"
    before = InterpretedKernel.calls
    sinks = torch.from_numpy(rng.standard_normal(HQ).astype(np.float32))
    step(runner, table, backend, [1, 2], [20, 30], [1, 1], rng, sinks=sinks)  # sinks + packed decode rows
    assert InterpretedKernel.calls == before
    lp = backend.runner.layer_params(RadixAttention(HQ, D, D**-0.5, HKV, 0))
    kb, vb = runner.token_to_kv_pool.get_kv_buffer(0)
    assert "contiguous" in backend.mosaic_path.reason(lp, backend.step.key, kb, kb[:, :, ::2], vb)
    from jax_attn.kernel_policy import Call, select_kernel
    f32 = Call(max_q_len=1, page_size=PAGE, num_tokens=2, num_kv_heads=HKV, head_dim=D, head_dim_v=D,
               dtype="float32", kv_dtype="bfloat16")
    assert select_kernel("auto", f32, from_torch=True) == "triton"  # the Mosaic kernel takes bf16 / f16 only
    fp8 = dataclasses.replace(f32, dtype="bfloat16", kv_dtype="float8_e4m3fn", fp8_descale=True)
    assert select_kernel("auto", fp8, from_torch=True) == "triton"  # fp8 descale: the Triton-lowered kernel
    assert select_kernel("triton", dataclasses.replace(f32, head_dim=100), from_torch=True) == "jax"  # raises there


def test_init_cuda_graph_state_refuses_layers_a_graph_cannot_capture(monkeypatch):
    """On CUDA pools a layer that would run a compiled JAX executable cannot sit in a torch CUDA graph, so
    ``init_cuda_graph_state`` raises, naming why, before any bucket is captured: no launch path, a
    non-contiguous pool buffer, K and V pools of two dtypes. A backend whose layers all launch passes, and
    so do CPU pools (no graph). (CPU tensors stand in for CUDA ones.) Catches a check that lets through
    what would fail at capture or replay, or one that refuses the launch path."""
    import torch_bridge.checks as checks

    runner, _, backend = setup(31)
    backend.init_cuda_graph_state(4, 4)  # CPU pools: the hooks plan as usual
    monkeypatch.setattr(checks, "on_cuda", lambda t: True)
    backend.init_cuda_graph_state(4, 4)  # every layer on the launch path
    assert backend.cuda_graph_blocker() is None
    _, _, jax_only = setup(32, path=False)
    assert "no launch path" in jax_only.cuda_graph_blocker()  # what an engine can ask before enabling graphs
    with pytest.raises(NotImplementedError, match="no launch path.*JAX executable"):
        jax_only.init_cuda_graph_state(4, 4)
    pool = runner.token_to_kv_pool
    k, v = pool.k_buffer[0], pool.v_buffer[0]
    pool.k_buffer[0] = torch.cat([k, k], dim=-1)[..., :D]  # same values, a strided view
    with pytest.raises(NotImplementedError, match="layer 0: pool buffers must be contiguous"):
        backend.init_cuda_graph_state(4, 4)
    pool.k_buffer[0], pool.v_buffer[0] = k, v.float()
    with pytest.raises(NotImplementedError, match="one dtype for the K and V pools"):
        backend.init_cuda_graph_state(4, 4)


def test_checked_layer_rebinds_when_the_pool_buffer_changes():
    """The fast path of a checked layer is bound to the pool's buffers: an engine that reallocates a
    layer's buffer gets a new binding (reads the new buffer), not a launch on freed memory."""
    rng = np.random.default_rng(9)
    runner, table, backend = setup(6)
    layer = RadixAttention(HQ, D, D**-0.5, HKV, 0)  # one object, as an engine's layer (else every call rebinds)
    step(runner, table, backend, [1, 2], [20, 30], [1, 1], rng, layer=layer)
    first = backend.runner.hits[0]
    step(runner, table, backend, [1, 2], [22, 33], [1, 1], rng, layer=layer)
    assert backend.runner.hits[0] is first, "the same layer and buffers should reuse the checked launch"
    pool = runner.token_to_kv_pool
    pool.k_buffer[0] = pool.k_buffer[0].clone()  # same contents, new storage
    pool.v_buffer[0] = pool.v_buffer[0].clone()
    step(runner, table, backend, [1, 2], [21, 31], [1, 1], rng, layer=layer)
    assert backend.runner.hits[0] is not first and backend.runner.hits[0].buffers[0] is pool.k_buffer[0]


def test_eager_table_buffers_are_bounded(monkeypatch):
    """Eager plan keys keep at most MAX_UNPINNED table buffers; dropping one drops its bound launches."""
    import torch_bridge.mosaic_path as mp

    monkeypatch.setattr(mp, "MAX_UNPINNED", 1)
    rng = np.random.default_rng(10)
    runner, table, backend = setup(7)
    for rows in ([1], [1, 2], [3, 4, 5]):  # three batch sizes: three plan keys
        step(runner, table, backend, rows, [20 + 7 * r for r in rows], [1] * len(rows), rng)
    path = backend.mosaic_path
    assert len(path._persistent) == 1
    live = next(iter(path._persistent.values()))
    assert path._calls and all(c.tables is live for c in path._calls.values())


def test_graph_table_buffers_survive_eager_evictions(monkeypatch):
    """A graph bucket's table buffer stays put while eager steps of other shapes come and go, also when an
    eager step of the bucket's plan key made it first: a captured graph reads that buffer on every replay.

    Bug caught: a bucket's buffer left unpinned (made by the eager step), evicted by later eager plans, so
    replays refresh a new buffer while the graph keeps reading the dropped one."""
    import torch_bridge.mosaic_path as mp

    monkeypatch.setattr(mp, "MAX_UNPINNED", 1)
    rng = np.random.default_rng(12)
    runner, table, backend = setup(8)
    backend.planner.share_graph_kernels = False  # the bucket plans at its own size: the eager key of 4 rows
    step(runner, table, backend, [1, 2, 3, 4], [20, 9, 33, 5], [1] * 4, rng)  # eager first: makes the buffer
    backend.init_cuda_graph_state(4, 4)
    z = torch.zeros(4, dtype=torch.long)
    backend.init_forward_metadata_capture_cuda_graph(4, 4, z, z + 1, None, ForwardMode.DECODE, None)
    step(runner, table, backend, [2, 5, 6, 1], [40, 17, 3, 28], [1] * 4, rng, replay_bs=4)
    flat = backend.step.tables[(HQ, HKV)].flat
    for rows in ([1], [1, 2], [3, 4, 5]):  # other eager plan keys push the unpinned buffers out
        step(runner, table, backend, rows, [20 + 7 * r for r in rows], [1] * len(rows), rng)
    step(runner, table, backend, [3, 1, 2, 6], [12, 50, 7, 21], [1] * 4, rng, replay_bs=4)
    assert backend.step.tables[(HQ, HKV)].flat.data_ptr() == flat.data_ptr()


class CountingKernel(InterpretedKernel):
    built = 0

    def __init__(self, *args):
        CountingKernel.built += 1
        super().__init__(*args)


@pytest.mark.parametrize("eager_first", [False, True], ids=["fresh", "eager_step_first"])
def test_graph_buckets_share_batch_classes_and_prebuild(eager_first):
    """SGLang's capture order (largest first, a warm-up forward after each hook). Catches: buckets of one
    batch class compiling their own planner or kernel; the first bucket's warm-up (or, for a layer an
    eager step showed, the first hook) not building the remaining classes' kernels at once (a kernel
    built while a later bucket warms up); the prebuild's planning leaving the warm-up forward on another
    step; a bucket padded to its class returning wrong rows or reading the padding (``step`` compares
    each run with the reference)."""
    rng = np.random.default_rng(12)
    runner, table, _ = setup(8)
    runner.server_args = types.SimpleNamespace(cuda_graph_bs=[3, 4, 5, 6])  # classes 4 (3, 4) and 8 (5, 6)
    backend = FlashAttentionBackend(runner, mosaic_path=MosaicPath(make_kernel=CountingKernel))
    if eager_first:  # an eager decode of 3 requests plans at class 4: class 4's kernel; the layer is known
        step(runner, table, backend, [1, 2, 3], [20, 31, 42], [1, 1, 1], rng)
    backend.init_cuda_graph_state(6, 6)
    z = torch.zeros(6, dtype=torch.long)
    built, exes = CountingKernel.built, len(backend.planner.executables)
    counts = []
    for bs in (6, 5, 4, 3):
        backend.init_forward_metadata_capture_cuda_graph(bs, bs, z[:bs], z[:bs] + 1, None, ForwardMode.DECODE, None)
        counts.append((CountingKernel.built - built, len(backend.planner.executables) - exes))
        rows = list(range(1, bs))  # one padding row of SGLang's bucket, then the class's
        step(runner, table, backend, rows, [9 + 11 * r for r in rows], [1] * len(rows), rng, replay_bs=bs)
        counts.append((CountingKernel.built - built, len(backend.planner.executables) - exes))
    assert backend.planner.graph_keys[(ForwardMode.DECODE, 6)].batch_size == 8
    assert backend.planner.graph_keys[(ForwardMode.DECODE, 3)].batch_size == 4
    if eager_first:
        # Hook 6 plans classes 8 and 4 (two graph planners) and builds class 8's kernel (class 4's came with
        # the eager step); nothing is built after it.
        assert counts == [(1, 2)] * 8, counts
    else:
        # Hook 6: class 8's planner. Its warm-up forward meets the layer: it plans class 4 (with the layer's
        # tables) and builds both classes' kernels at once. Hook 5 replans class 8 with tables (a third
        # planner: this runner's model config names no head counts). Nothing is built after that.
        assert counts == [(0, 1), (2, 2)] + [(2, 3)] * 6, counts
    assert backend.planner.prebuilt_kernels == (1 if eager_first else 2)


def test_prebuild_compiles_in_threads_and_retries_a_failed_one_alone(monkeypatch):
    """``MosaicPath.prebuild`` with the launcher: one lowering per kernel in this process (after the
    parallel builds), the GPU compiles in threads; a compile that fails in a thread (the CUDA plugin
    returns no kernel) is retried on the calling thread. Catches: a failed thread compile raising out of
    the warm-up, or kernels of the same statics compiled twice."""
    import threading

    import torch_bridge.mosaic_path as mp

    rng = np.random.default_rng(13)
    runner, table, backend = setup(9)
    step(runner, table, backend, [1, 2], [20, 30], [1, 1], rng)  # the layer shape, on the launch path
    path, st = backend.mosaic_path, backend.step
    (recipe,) = path.recipes_for(ForwardMode.DECODE, 1)
    spec = recipe.spec(path.config, st.key, st.tables[recipe.heads])
    main, loads, lowered = threading.current_thread(), [], []

    class Loaded:
        def __init__(self, plan, device):
            loads.append(threading.current_thread() is main)
            if len(loads) == 1:  # the first compile fails wherever it runs
                raise RuntimeError("MosaicGpuCompile failed")

    monkeypatch.setattr(mp, "TorchKernel", Loaded)
    monkeypatch.setattr(mp, "plan_kernel", lambda fn, *structs: lowered.append(structs) or object())
    monkeypatch.setattr(mp.kernel_cache, "prebuild", lambda kernels: len(list(kernels)))
    path._make_kernel, path._kernels = mp.launcher_kernel, {}
    other = dataclasses.replace(spec, statics=dataclasses.replace(spec.statics, scale=0.5))
    assert path.prebuild([spec, other, spec]) == 2
    assert len(lowered) == 2 and loads.count(True) == 1 and len(loads) == 3  # 2 in threads, 1 retry here
    assert all(isinstance(k, Loaded) for k in path._kernels.values()) and len(path._kernels) == 2
    assert path.prebuild([spec]) == 0  # built: nothing to do


@pytest.mark.parametrize("triton", [False, True], ids=["mosaic", "triton"])
def test_a_new_eager_class_builds_every_layer_shape_at_once(triton):
    """Two layer shapes (another scale on the second) run in an extend step; an extend step of a new shape
    class then builds both layers' kernels at once, at its first layer's call (``MosaicPath._build_alike``),
    and both layers still match the reference. Catches: each layer's kernel built at its own first call, one
    after another (a cold class costing one build round per layer shape), and a kernel co-built for the wrong
    layer's shape (the second layer's output)."""
    from tests.test_triton_launch import triton_path_for_tests

    rng = np.random.default_rng(17)
    page = 1 if triton else PAGE
    runner, table, backend = setup(17, page=page, path=triton_path_for_tests() if triton else None, num_layers=2)
    layers = [RadixAttention(HQ, D, D**-0.5, HKV, 0), RadixAttention(HQ, D, 0.3, HKV, 1)]
    path = backend.mosaic_path
    rows = np.array([2, 5])
    built = []
    for kv_lens, q_lens in (([20, 17], [3, 5]), ([30, 25], [12, 10])):  # token classes 16 and 24
        kv_lens, q_lens = np.array(kv_lens), np.array(q_lens)
        for i in range(2):
            fill(runner, table, rows, kv_lens - q_lens, rng, layer_id=i)
        fb, q, k, v = plan_step(runner, table, backend, rows, kv_lens, q_lens, rng)
        for i, (layer, scale) in enumerate(zip(layers, (None, 0.3))):
            before = len(path._kernels)
            out = backend.forward(q, k, v, layer, fb)
            built.append(len(path._kernels) - before)
            ref = reference(runner, table, rows, kv_lens, q_lens, q, scale=scale, layer_id=i)
            np.testing.assert_allclose(out.float().cpu().numpy(), ref, atol=3e-2, rtol=3e-2)
    # first class: each layer shape is new at its own call; second class: both at the first layer's
    assert built == [1, 1, 2, 0], built


@pytest.mark.parametrize("triton", [False, True], ids=["mosaic", "triton"])
def test_backend_prebuild_builds_the_batches_kernels_in_one_round(triton):
    """``FlashAttentionBackend.prebuild`` of an extend and a decode batch for two layer shapes: one
    ``MosaicPath.prebuild`` call builds all four kernels; running those batches afterwards builds nothing and
    matches the reference. Catches: a prebuilt kernel keyed apart from the one the layer's call looks up (the
    call builds it again), builds spread over several rounds, a kernel built for the wrong layer's shape, and
    the prebuild's planning leaving another step installed."""
    from tests.test_triton_launch import triton_path_for_tests

    rng = np.random.default_rng(19)
    page = 1 if triton else PAGE
    runner, table, backend = setup(19, page=page, path=triton_path_for_tests() if triton else None, num_layers=2)
    layers = [RadixAttention(HQ, D, D**-0.5, HKV, 0), RadixAttention(HQ, D, 0.3, HKV, 1)]
    path, rounds = backend.mosaic_path, []
    real_prebuild = path.prebuild
    def counted(specs):  # the number of kernels each round built
        rounds.append(real_prebuild(specs))
        return rounds[-1]
    path.prebuild = counted
    cases = [(np.array([2, 5]), np.array([20, 17]), np.array([3, 5])),  # extend, token class 16
             (np.array([1, 3, 4]), np.array([9, 30, 41]), np.array([1, 1, 1]))]  # decode, batch class 4
    batches = [plan_step(runner, table, backend, *case, rng)[0] for case in cases]
    backend.init_forward_metadata(batches[0])
    installed = backend.step
    assert backend.prebuild(batches, layers, torch.bfloat16) == 4
    assert rounds == [4] and backend.step is installed
    for rows, kv_lens, q_lens in cases:
        for i in range(2):
            fill(runner, table, rows, kv_lens - q_lens, rng, layer_id=i)
        fb, q, k, v = plan_step(runner, table, backend, rows, kv_lens, q_lens, rng)
        for i, (layer, scale) in enumerate(zip(layers, (None, 0.3))):
            out = backend.forward(q, k, v, layer, fb)
            ref = reference(runner, table, rows, kv_lens, q_lens, q, scale=scale, layer_id=i)
            np.testing.assert_allclose(out.float().cpu().numpy(), ref, atol=3e-2, rtol=3e-2)
    assert [n for n in rounds if n] == [4], rounds  # nothing built at the calls
    assert backend.prebuild(batches, layers, torch.bfloat16) == 0


def test_prebuild_compiles_triton_kernels_in_threads(monkeypatch):
    """``MosaicPath.prebuild`` of a ``triton_path.Spec`` with split-KV tables: the tiles and the merge lowered
    here, compiled in threads, put together as the spec's ``Kernels``. Catches: the merge left unbuilt, the
    kernels swapped, or a Triton compile on the calling thread."""
    import threading

    import torch_bridge.mosaic_path as mp
    from tests.test_triton_launch import triton_path_for_tests
    from torch_bridge import triton_path

    rng = np.random.default_rng(19)
    runner, table, backend = setup(19, page=1, path=triton_path_for_tests())
    step(runner, table, backend, [2, 5, 1], [40, 27, 90], [1, 1, 1], rng)  # decode rows: split-KV tables
    path, st = backend.mosaic_path, backend.step
    (recipe,) = path.recipes_for(ForwardMode.DECODE, 1)
    spec = recipe.spec(path.config, st.key, st.tables[recipe.heads])
    assert isinstance(spec, triton_path.Spec) and spec.lay.max_splits > 1
    main, loads = threading.current_thread(), []

    class Loaded:
        def __init__(self, plan, device):
            loads.append(threading.current_thread() is main)
            self.plan = plan

    monkeypatch.setattr(mp, "TorchKernel", Loaded)
    monkeypatch.setattr(mp, "plan_kernel", lambda fn, *structs: fn.__name__)
    path._make_triton, path._kernels = None, {}
    assert path.prebuild([spec, spec]) == 1
    kernels = path._kernels[spec.key()]
    assert (kernels.tiles.plan, kernels.merge.plan) == ("tiles", "merge") and loads == [False, False]


@pytest.mark.gpu
def test_launch_path_gpu_graph_capture():
    """On a Hopper GPU: eager launch == reference, then a captured 1-layer decode step replays correctly
    after the replay hook re-plans other lengths (pointers and tables fixed at capture)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper GPU")
    rng = np.random.default_rng(11)
    runner, table, backend = setup(4, device="cuda")
    assert backend.mosaic_path is not None, "Hopper + impl auto must enable the launch path"
    step(runner, table, backend, [1, 2, 3], [40, 7, 90], [1, 1, 1], rng)
    step(runner, table, backend, [4, 5], [33, 60], [3, 20], rng)
    captured_decode_replays(runner, table, backend, rng, RadixAttention(HQ, D, D**-0.5, HKV, 0),
                            [([1, 2, 3, 4], [50, 9, 77, 31])])


def captured_decode_replays(runner, table, backend, rng, layer, steps, bs: int = 4):
    """Capture a 1-layer decode step of bucket ``bs`` in a torch CUDA graph (after a warm-up forward), then
    for each ``(rows, kv_lens)`` of ``steps``: the replay hook re-plans those lengths, the graph replays,
    and its output equals the reference per sequence and, bitwise, the same step run eagerly."""
    backend.init_cuda_graph_state(bs, bs)
    z = torch.zeros(bs, dtype=torch.long, device="cuda")
    backend.init_forward_metadata_capture_cuda_graph(bs, bs, z, z + 1, None, ForwardMode.DECODE, None)
    q = torch.zeros(bs, HQ * D, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.zeros(bs, HKV * D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    loc = torch.zeros(bs, dtype=torch.long, device="cuda")
    fb = ForwardBatch(ForwardMode.DECODE, bs, z, z + 1, loc, token_to_kv_pool=runner.token_to_kv_pool)
    backend.forward(q, k, v, layer, fb)  # warm-up outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = backend.forward(q, k, v, layer, fb)
    for rows, kv_lens in steps:
        rows, kv_lens = np.array(rows), np.array(kv_lens)
        fill(runner, table, rows, kv_lens - 1, rng)
        new_loc = np.array([table[r, n - 1] for r, n in zip(rows, kv_lens)], np.int64)
        t = [torch.from_numpy(x.astype(np.int64)).cuda() for x in (rows, kv_lens, new_loc)]
        backend.init_forward_metadata_replay_cuda_graph(bs, t[0], t[1], None, None, ForwardMode.DECODE, None, None,
                                                        out_cache_loc=t[2])
        loc.copy_(t[2])
        for x, h in ((q, HQ), (k, HKV), (v, HKV)):
            x.copy_(torch.from_numpy(rng.standard_normal((bs, h * D)).astype(np.float32)).to(x))
        g.replay()
        torch.cuda.synchronize()
        ref = reference(runner, table, rows, kv_lens, np.ones(bs, np.int64), q)
        for b in range(bs):  # per sequence
            np.testing.assert_allclose(out[b].float().cpu().numpy(), ref[b], atol=3e-2, rtol=3e-2)
        eager = backend.forward(q, k, v, layer, fb, save_kv_cache=False)  # the same step, eager: the graph's bits
        assert torch.equal(eager, out)


@pytest.mark.gpu
def test_launch_path_gpu_side_stream_and_concurrent_allocations():
    """Work queued on a non-default torch stream (KV fill, q) is seen by the launch, and the output
    is valid on that stream while other allocations churn the caching allocator."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("needs a Hopper GPU")
    rng = np.random.default_rng(12)
    runner, table, backend = setup(5, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(3):
            churn = [torch.randn(1 << 20, device="cuda") for _ in range(4)]  # the allocator reuses blocks
            backend = step(runner, table, backend, [1, 2, 3], [70, 12, 33], [1, 1, 1], rng)
            backend = step(runner, table, backend, [4, 6], [40, 90], [5, 30], rng)
            del churn
    side.synchronize()
