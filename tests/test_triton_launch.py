"""torch_bridge's Triton launch path (``torch_bridge.triton_path``) against the reference.

CPU: the layer's kernels run in the Pallas interpreter through a stand-in for the launcher (same
functions, same tables and scratch, same pointer repointing); the kernel's Triton IR is lowered for
CUDA and compiled by ``triton`` to check the launch plan against the compiled parameter list. GPU
(``gpu`` marker): compiled launches at page sizes 1 and 4, eager and captured in ``torch.cuda.graph``.
"""

import dataclasses
import types
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from tests.test_bridge_launch import (HKV, HQ, D, InterpretedKernel, captured_decode_replays, fill, same_bytes, setup,
                                      step)
from torch_bridge import FlashAttentionBackend, ForwardBatch, ForwardMode, RadixAttention
from torch_bridge.mosaic_path import TRITON_TABLES, LayerHit, MosaicPath
from torch_bridge.triton_path import (MAX_REGISTERS, MAX_REGISTERS_Q_LEN, Kernels, Layout, Spec, capped,
                                      kernel_fns, layout_of, part_shapes)


def layer_statics(layer, lay):
    """``triton_paged.kernel_statics`` of ``layer`` over ``lay`` (bf16, sinks), as ``kernel_fns`` makes them."""
    from jax_attn.kernels.config import DEFAULT_CONFIG
    from jax_attn.kernels.triton_paged import kernel_statics

    return kernel_statics(
        num_tokens=lay.num_tokens, num_q_heads=layer.num_q_heads, num_kv_heads=layer.num_kv_heads,
        head_dim=layer.head_dim, head_dim_v=layer.head_dim, page_size=lay.page_size, max_pages=lay.max_pages,
        max_q_len=lay.max_q_len, block_q=lay.block_q, max_splits=lay.max_splits, dtype=jnp.bfloat16,
        kv_dtype=jnp.bfloat16, causal=True, window_size=(7, 0), softcap=0.0, softmax_scale=None, has_sinks=True,
        has_k_descale=False, has_v_descale=False, latent=False, config=DEFAULT_CONFIG, interpret=False)[0]

pytestmark = pytest.mark.usefixtures("engine_grad_mode")


def _to_jax(t: torch.Tensor):
    if t.dtype in (torch.bfloat16, torch.float8_e4m3fn):  # numpy has neither: through float32 (exact)
        return jnp.asarray(t.float().numpy()).astype(jnp.dtype(str(t.dtype).removeprefix("torch.")))
    return jnp.asarray(t.numpy())


def live(t, shape=None):
    """A tensor repointed into a bound launch, held as the launcher holds it: by address only (a weak
    reference here), read as the bound ``shape``. The launch must find it alive: memory torch's allocator
    got back can be another tensor's by then."""
    ref = weakref.ref(t)

    def get():
        got = ref()
        assert got is not None, "a bound launch reads a tensor that was freed after set_arg/set_out"
        return got if shape is None else got.view(shape)
    return get



class _Bound:
    """A bound launch: reads the bound tensors' current contents when called, as a launch would, and
    writes the results where the compiled kernel would (aliased arguments, or ``out``). Tensors given
    at ``bind`` are kept alive (``BoundLaunch`` keeps them); repointed ones are not (``live``)."""

    def __init__(self, fn, args, outs):
        self.fn, self.types = fn, [(a.shape, a.dtype) for a in args]
        self.args = [lambda a=a: a for a in args]
        self.outs = None if outs is None else [lambda o=o: o for o in outs]
        self.out_types = None if outs is None else [(o.shape, o.dtype) for o in outs]

    def set_arg(self, i, t):
        assert same_bytes(t, *self.types[i])
        self.args[i] = live(t, self.types[i][0])

    def set_out(self, i, t):
        assert same_bytes(t, *self.out_types[i])
        self.outs[i] = live(t, self.out_types[i][0])

    def __call__(self):
        InterpretedTriton.calls += 1
        args = [a() for a in self.args]
        res = self.fn(*[_to_jax(a) for a in args])
        dest = args[-2:] if self.outs is None else [o() for o in self.outs]  # no out: into the aliased arguments
        for d, r in zip(dest, res):
            d.copy_(torch.from_numpy(np.array(r.astype(jnp.float32))).to(d.dtype))


class _Interpreted:
    def __init__(self, fn, example):
        self.fn, self.shapes = jax.jit(fn), [tuple(t.shape) for t in example]

    def bind(self, *args, out=None):
        assert [tuple(t.shape) for t in args] == self.shapes
        return _Bound(self.fn, args, None if out is None else list(out))


class InterpretedTriton:
    """``make_triton`` stand-in: the layer's kernel functions in the Pallas interpreter."""

    calls = 0
    built = 0

    def __new__(cls, fns_of, examples):
        cls.built += 1
        built = [_Interpreted(fn, ex) for fn, ex in zip(fns_of(True), examples)]
        return Kernels(built[0], built[1] if len(built) > 1 else None)


def triton_path_for_tests() -> MosaicPath:
    """A CPU launch path whose layers all take the Triton-lowered kernel, interpreted."""
    return MosaicPath(make_kernel=InterpretedKernel, make_triton=InterpretedTriton, hopper=False)


def triton_setup(seed, page, device="cpu"):
    return setup(seed, device=device, page=page, path=triton_path_for_tests() if device == "cpu" else None)


# q_lens per case: decode rows (split-KV at these lengths), extend rows, a mixed batch
CASES = {"decode": ([1, 1, 1], [40, 27, 90]), "extend": ([3, 20], [40, 27]), "mixed": ([1, 9], [60, 33])}


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_launch_eager(page, case):
    """Page sizes the Mosaic kernel does not take run on the Triton launch path (not through JAX), equal
    the reference, and a second step of the same layer reuses the bound launch."""
    rng = np.random.default_rng(page * 10 + len(case))
    runner, table, backend = triton_setup(page, page)
    q_lens, kv_lens = CASES[case]
    layer = RadixAttention(HQ, D, D**-0.5, HKV, 0)
    before, mosaic = InterpretedTriton.calls, InterpretedKernel.calls
    step(runner, table, backend, [2, 5, 1][:len(q_lens)], kv_lens, q_lens, rng, layer=layer)
    assert InterpretedTriton.calls > before and InterpretedKernel.calls == mosaic
    assert (HQ, HKV, TRITON_TABLES) in backend.step.tables
    hit = backend.runner.hits[0]
    step(runner, table, backend, [1, 3, 4][:len(q_lens)], [k + 5 for k in kv_lens], q_lens, rng, layer=layer)
    assert backend.runner.hits[0] is hit  # same plan key: the checked, bound launch again


def test_triton_launch_sinks_window_softcap_scale():
    """Sinks on packed decode rows, a window, a softcap and a scale reach the kernel (page 1: Triton's)."""
    rng = np.random.default_rng(5)
    runner, table, backend = triton_setup(6, 1)
    before = InterpretedTriton.calls
    sinks = torch.from_numpy(rng.standard_normal(HQ).astype(np.float32))
    layer = RadixAttention(HQ, D, 0.3, HKV, 0, logit_cap=4.0, sliding_window_size=11)
    rows, kv_lens, q_lens = np.array([1, 2]), np.array([30, 45]), np.array([1, 1])
    fill(runner, table, rows, kv_lens - q_lens, rng)
    loc = np.array([table[r, n - 1] for r, n in zip(rows, kv_lens)], np.int64)
    t64 = [torch.from_numpy(x.astype(np.int64)) for x in (rows, kv_lens, loc)]
    fb = ForwardBatch(ForwardMode.DECODE, 2, t64[0], t64[1], t64[2], token_to_kv_pool=runner.token_to_kv_pool)
    backend.init_forward_metadata(fb)
    q, k, v = (torch.from_numpy(rng.standard_normal((2, h * D)).astype(np.float32)).to(torch.bfloat16)
               for h in (HQ, HKV, HKV))
    out = backend.forward(q, k, v, layer, fb, sinks=sinks)
    assert InterpretedTriton.calls > before
    from jax_attn.reference import paged_attention_reference
    from jax_attn.kv_cache import paged_view

    kb, vb = (jnp.asarray(b.float().numpy()) for b in runner.token_to_kv_pool.get_kv_buffer(0))
    ref = paged_attention_reference(
        jnp.asarray(q.float().numpy()).reshape(-1, HQ, D), paged_view(kb, 1), paged_view(vb, 1),
        jnp.asarray(kv_lens, jnp.int32), jnp.asarray([0, 1, 2], jnp.int32), jnp.asarray(table[rows]), page_size=1,
        sinks=jnp.asarray(sinks.numpy()), softmax_scale=0.3, softcap=4.0, window_size=(11, 0))
    for b in range(2):  # per sequence
        np.testing.assert_allclose(out[b].float().numpy(), np.asarray(ref).reshape(2, -1)[b], atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("page,case", [(1, "decode"), (16, "mixed")])
def test_triton_launch_fp8_pool(page, case):
    """An fp8 (e4m3) pool with the layer's K / V scales: the write stores values over the scales, the
    launched kernel reads them times the scales (the Mosaic kernel does not take fp8: Triton even at page 16)."""
    rng = np.random.default_rng(40 + page)
    runner, table, backend = setup(40 + page, page=page, path=triton_path_for_tests(), dtype=torch.float8_e4m3fn)
    layer = RadixAttention(HQ, D, D**-0.5, HKV, 0, k_scale_float=0.5, v_scale_float=2.0)
    q_lens, kv_lens = CASES[case]
    before = InterpretedTriton.calls
    step(runner, table, backend, [2, 5, 1][:len(q_lens)], kv_lens, q_lens, rng, layer=layer)
    assert InterpretedTriton.calls > before


@pytest.mark.parametrize("page", [1, 16])
def test_triton_launch_fp8_over_sglangs_pool(page):
    """SGLang's own fp8 pool (the contract suite's ``MHATokenToKVPool``: uint8 storage, a new ``view(float8)``
    from every getter call): decode steps equal the reference over the scaled pool, write K/V through the pool's
    uint8 storage, and later steps of the same layer reuse its checked launch.

    Bugs caught: the checked call compared pool buffers by object, so over SGLang's fp8 pools every layer call
    redid its checks (a new binding each call); a write or read that skipped the uint8 storage's view."""
    from tests.sglang_contract.engine import MHATokenToKVPool as SglangPool

    rng = np.random.default_rng(60 + page)
    runner, table, _ = setup(60 + page, page=page, path=triton_path_for_tests(), dtype=torch.float8_e4m3fn)
    slots = runner.token_to_kv_pool.k_buffer[0].shape[0]
    pool = SglangPool(slots - page, page, torch.float8_e4m3fn, HKV, D, 1, "cpu", False)
    assert pool.k_buffer[0].dtype == torch.uint8 and pool.get_key_buffer(0) is not pool.get_key_buffer(0)
    for buf in pool.k_buffer + pool.v_buffer:
        buf.fill_(0x7F)  # e4m3 NaN wherever a step neither writes nor reads
        buf[0] = 0
    runner.token_to_kv_pool = pool
    backend = FlashAttentionBackend(runner, mosaic_path=triton_path_for_tests())
    layer = RadixAttention(HQ, D, D**-0.5, HKV, 0, k_scale_float=0.5, v_scale_float=2.0)
    step(runner, table, backend, [1, 2], [20, 30], [1, 1], rng, layer=layer)
    first = backend.runner.hits[0]
    assert isinstance(first, LayerHit)  # launched, not a JAX executable
    written = pool.k_buffer[0][torch.from_numpy(table[[1, 2], [19, 29]].astype(np.int64))]
    assert written.dtype == torch.uint8 and not (written == 0x7F).all()
    step(runner, table, backend, [1, 2], [22, 33], [1, 1], rng, layer=layer)
    assert backend.runner.hits[0] is first, "later steps should reuse the checked launch"


def test_triton_kernel_plan_matches_the_compiled_parameters(monkeypatch):
    """The kernel's Triton IR, lowered for CUDA without a GPU and compiled by ``triton``, takes one pointer
    per launch-plan buffer (call operands, then results; the aliased outputs are the arguments), plus only
    the scratch parameters the launcher passes as null; decode tiles compile under the register cap, others
    with ptxas's own count."""
    pytest.importorskip("triton")
    from jax._src.pallas.triton import pallas_call_registration as reg

    from torch_bridge import launcher

    monkeypatch.setattr(reg.gpu_info_lib, "get_gpu_info", lambda: types.SimpleNamespace(compute_capability=90))
    from jax_attn.backend import LayerParams

    layer = LayerParams(HQ, HKV, D, sliding_window_size=7)
    capped_kinds = []
    # a verify layout (4 queries a sequence), no split; a decode one, split + merge; a prefill one (16 queries)
    for lay in (Layout(8, 2, 5, 4, 4, 1, 4, 1), Layout(2, 2, 90, 1, 1, 3, 6, 1), Layout(32, 2, 5, 16, 16, 1, 4, 1)):
        fns = kernel_fns(layer, lay, jnp.bfloat16, jnp.bfloat16, True, interpret=False)
        assert len(fns) == (2 if lay.max_splits > 1 else 1)
        r = lay.num_tokens * HQ
        tables = [jax.ShapeDtypeStruct(s, jnp.int32) for s in ((lay.num_tiles,),) * 3 + ((2,), (2,), (3,),
                                                                                         (2 * lay.max_pages,))]
        tiles_args = tables + [jax.ShapeDtypeStruct((r, D), jnp.bfloat16)] + \
            [jax.ShapeDtypeStruct((64, D), jnp.bfloat16)] * 2 + [jax.ShapeDtypeStruct((HQ,), jnp.float32)]
        plan = launcher.plan_kernel(fns[0], *tiles_args)
        st = layer_statics(layer, lay)
        # without splits the programs after the tiles zero the padding tokens' rows (no output initialized)
        assert isinstance(plan.module, launcher.TritonModule) and st.pad_programs == (lay.max_splits == 1) * 2
        assert plan.module.grid[1] == lay.num_tiles + st.pad_programs
        n_buf = len(plan.buffers)
        assert plan.module.num_buffers == n_buf  # what the loader reads to fill the kernel's parameters
        assert [s.kind for s in plan.returns] == ["out", "out"]  # new outputs: the tiles' (or partials)
        # decode and verify tiles (few queries a sequence, 4 warps) compile under the register cap, to run as XLA's
        # compile does
        spec = Spec(layer, lay, torch.bfloat16, torch.bfloat16, True, [])
        plan = capped(plan, spec)
        small = lay.max_q_len <= MAX_REGISTERS_Q_LEN and plan.module.num_warps == 4
        assert plan.module.max_registers == (MAX_REGISTERS if small else None)
        assert capped(plan.module, spec) is plan.module  # only launch plans are capped
        compiled = launcher.compile_triton(plan.module, (9, 0))
        extra = launcher.kernel_params(compiled.asm["ptx"], compiled.metadata.name) - n_buf
        assert extra in (0, 1, 2), extra
        assert not getattr(compiled.metadata, "global_scratch_size", 0)
        assert (f".maxnreg {MAX_REGISTERS}" in compiled.asm["ptx"]) == small
        capped_kinds.append(small)
    assert capped_kinds == [True, True, False]  # the verify and decode layouts capped, the prefill one as it is


# ----------------------------------------------------------------------------------------------- GPU
def _needs_cuda():
    if not torch.cuda.is_available() or jax.default_backend() != "gpu":
        pytest.skip("needs a CUDA GPU")


@pytest.mark.gpu
@pytest.mark.parametrize("page", [1, 4])
def test_triton_launch_gpu_eager_and_graph(page):
    """Compiled launches: eager steps == reference (decode, extend), and a captured 1-layer decode step
    replays correctly after the replay hook re-plans other lengths."""
    _needs_cuda()
    rng = np.random.default_rng(20 + page)
    runner, table, backend = triton_setup(30 + page, page, device="cuda")
    assert backend.mosaic_path is not None
    layer = RadixAttention(HQ, D, D**-0.5, HKV, 0)
    step(runner, table, backend, [1, 2, 3], [40, 7, 90], [1, 1, 1], rng, layer=layer)
    assert any(len(h) > 2 and h[2] & TRITON_TABLES for h in backend.step.tables)
    step(runner, table, backend, [4, 5], [33, 60], [3, 20], rng, layer=layer)
    captured_decode_replays(runner, table, backend, rng, layer,
                            [([1, 2, 3, 4], [50, 9, 77, 31]), ([4, 3, 5, 1], [90, 2, 15, 64])])


@pytest.mark.gpu
@pytest.mark.parametrize("page,case", [(1, "decode"), (16, "mixed")])
def test_triton_launch_gpu_fp8(page, case):
    """Compiled launches over an fp8 pool with K / V scales equal the reference over the scaled pool."""
    _needs_cuda()
    rng = np.random.default_rng(50 + page)
    runner, table, backend = setup(50 + page, device="cuda", page=page, dtype=torch.float8_e4m3fn)
    layer = RadixAttention(HQ, D, D**-0.5, HKV, 0, k_scale_float=0.5, v_scale_float=2.0)
    q_lens, kv_lens = CASES[case]
    step(runner, table, backend, [2, 5, 1][:len(q_lens)], kv_lens, q_lens, rng, layer=layer)
    assert isinstance(backend.runner.hits[0], LayerHit)  # launched, not a JAX executable


def test_layouts_are_static_facts():
    lay = Layout(8, 2, 5, 4, 4, 1, 4, 1)
    assert dataclasses.replace(lay) == lay and hash(lay) == hash(Layout(8, 2, 5, 4, 4, 1, 4, 1))


def test_deterministic_layouts_keep_the_decode_tile_at_any_batch():
    """A page-1 decode layout of 1024 (token, kv head) programs launches the many-program tile (64-key blocks,
    ``KernelConfig.many_decode_tile``), except in deterministic mode (``layout_of(..., deterministic=True)`` sets
    ``Layout.batch_invariant``), where a request's bits must not depend on the batch: the decode tile's 128."""
    import re

    from jax_attn.backend import LayerParams
    from tests.attention_cases import Case, build_inputs

    md = build_inputs(Case("decode", ((1, 40), (1, 9)), page_size=1, heads=(HQ, HKV)))[3]
    assert [layout_of(md, (HQ, HKV), det).batch_invariant for det in (False, True)] == [False, True]
    layer = LayerParams(32, 8, 128)
    for invariant in (False, True):
        lay = Layout(128, 128, 1024, 1, 1, 1, 128, 1, invariant)
        tiles = kernel_fns(layer, lay, jnp.bfloat16, jnp.bfloat16, False, interpret=False)[0]
        args = [jax.ShapeDtypeStruct(s, jnp.int32) for s in part_shapes(lay)]
        args += [jax.ShapeDtypeStruct((128 * 32, 128), jnp.bfloat16)] + \
            [jax.ShapeDtypeStruct((128 * 1024 * 8, 128), jnp.bfloat16)] * 2
        names = set(re.findall(r"paged_attention_m\d+_k\d+", str(jax.make_jaxpr(tiles)(*args))))
        assert names == {"paged_attention_m16_k128" if invariant else "paged_attention_m16_k64"}, (invariant, names)
