"""Each distinct kernel is built once per process, whatever the layer count or weight layout.

CPU: the example model's decode step is lowered for CUDA (compiled Mosaic kernels, no GPU needed) and
``jax_attn.kernels.kernel_cache`` counts the Python lowerings of the Mosaic kernel; the lowered step
carries one kernel module (one ``kernel_hash``) however many layers call it. The cached custom call is
checked against the one Pallas emits itself. The Triton kernel's ``pallas_call`` is built once per
trace (``paged_attention`` is a jitted function, lowered once per executable).
"""

import dataclasses
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import decode_llama  # noqa: E402
import llama  # noqa: E402

from jax_attn.backend import FlashAttentionBackend  # noqa: E402
from jax_attn.capture import StepRunner  # noqa: E402
from jax_attn.kernels import kernel_cache, mosaic_kernel, triton_paged  # noqa: E402
from jax_attn.kernels.mosaic_paged import kernel_statics  # noqa: E402

LAYERS = 4
CFG = dataclasses.replace(llama.CONFIGS["small"], n_layers=LAYERS, vocab=256, dim=256, ffn_dim=256, n_heads=8,
                          n_kv_heads=2, head_dim=64)
BATCH, PAGE, MAX_CTX = 4, 16, 64
MOSAIC = "mosaic_kernel._pallas_kernel"


@pytest.fixture
def fresh_builds(monkeypatch):
    """Counts from zero, no disk cache (a build is a build), compiled Mosaic kernels while tracing on CPU."""
    monkeypatch.setenv("JAX_ATTN_COMPILE_CACHE", "0")
    kernel_cache.reset()
    yield
    kernel_cache.reset()


def _compiled_kernels(monkeypatch):
    # paged_attention_mosaic interprets on a CPU backend; claim a GPU while tracing so the compiled
    # kernel is traced, then lower explicitly for CUDA.
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


def _lower_step(layout: str, impl: str, monkeypatch=None):
    """The example's decode step at bucket BATCH, traced (and, for the Mosaic kernel, lowered for CUDA)."""
    reqs = decode_llama.PagedRequests(BATCH, MAX_CTX, PAGE, 0)
    backend = FlashAttentionBackend(reqs.req_to_token, page_size=PAGE, max_context_len=MAX_CTX, impl=impl,
                                    num_heads=(CFG.n_heads, CFG.n_kv_heads))
    runner = StepRunner(backend, decode_llama.make_step(CFG, backend, layout), batch_buckets=(BATCH,),
                        compile_cache=False)
    params = jax.eval_shape(lambda: llama.with_layout(llama.init_params(CFG, 0), layout))
    pools = jax.eval_shape(lambda: llama.layout_pools(CFG, layout, reqs.num_slots))
    padded = runner._padded(decode_llama.decode_batch(reqs, np.full(BATCH, 20, np.int32)))
    key = backend.plan_static(padded)
    tokens = dict(ids=jax.ShapeDtypeStruct((BATCH,), jnp.int32), pos=jax.ShapeDtypeStruct((BATCH,), jnp.int32))
    step_layout, packed, tokens = runner.pack(padded, tokens)
    if monkeypatch is not None:
        _compiled_kernels(monkeypatch)
    traced = runner._jit.trace(key, step_layout, backend.req_to_token, packed, tokens, params, pools)
    if impl != "mosaic":
        return traced.lower().as_text()
    # What StepRunner.capture hands to kernel_cache.prebuild: the step's one kernel (scan bodies too).
    assert len(kernel_cache.kernels_in(traced.jaxpr)) == 1
    return traced.lower(lowering_platforms=("cuda",)).as_text()


def _kernel_hashes(hlo: str) -> list:
    return re.findall(r'kernel_hash = "((?:[^"\\]|\\.)*)"', hlo)


def test_layers_build_the_mosaic_kernel_once(fresh_builds, monkeypatch):
    hlo = _lower_step("list", "mosaic", monkeypatch)
    hashes = _kernel_hashes(hlo)
    assert len(hashes) == LAYERS, "one kernel call per layer"
    assert len(set(hashes)) == 1, "every layer's call carries the same module: compiled once by jaxlib"
    assert kernel_cache.builds(MOSAIC) == 1

    # Another executable with the same kernel (a new runner: its own trace and lowering): no new build.
    again = _lower_step("list", "mosaic", monkeypatch)
    assert kernel_cache.builds(MOSAIC) == 1
    assert set(_kernel_hashes(again)) == set(hashes)

    # Layer-stacked layouts read one [L * slots] pool: one other kernel, built once for all of them
    # (unrolled with static slices or fused weights, or under lax.scan).
    stacked = [_kernel_hashes(_lower_step(layout, "mosaic", monkeypatch)) for layout in ("fused", "scan", "perlayer")]
    assert [len(h) for h in stacked] == [LAYERS, 1, LAYERS]
    assert len({h for hs in stacked for h in hs}) == 1
    assert kernel_cache.builds(MOSAIC) == 2


def _small_kernel(num_tokens: int):
    """Statics of a packed decode kernel (4/1 heads, d=64, one tile per token) and its argument types."""
    st = kernel_statics(num_tokens=num_tokens, num_q_heads=4, num_kv_heads=1, head_dim=64, head_dim_v=64,
                        page_size=16, pack=4, dtype=jnp.bfloat16, max_q_len=1)
    s = jax.ShapeDtypeStruct
    cache = s((9, 16, 1, 64), jnp.bfloat16)
    return st, (s((num_tokens, 1, 4, 64), jnp.bfloat16), cache, cache, s((num_tokens, 4), jnp.int32),
                s((num_tokens + 1,), jnp.int32), s((num_tokens, 8), jnp.int32), s((1,), jnp.float32))


def _custom_call_attrs(hlo_module) -> dict:
    """name -> MLIR text of the one mosaic_gpu_v2 custom call's attributes (backend_config entries too)."""
    found = []

    def visit(op):
        op = op.operation
        if op.name == "stablehlo.custom_call" and "mosaic_gpu_v2" in str(op.attributes["call_target_name"]):
            found.append(op)
        return jax._src.lib.mlir.ir.WalkResult.ADVANCE

    hlo_module.operation.walk(visit)
    assert len(found) == 1
    attrs = {name: str(found[0].attributes[name]) for name in found[0].attributes if name != "mhlo.backend_config"}
    config = found[0].attributes["mhlo.backend_config"]
    for name in ("kernel_hash", "module", "use_custom_barrier", "skip_device_barrier", "uses_xla_collective_metadata"):
        if name in config:
            attrs["config." + name] = str(config[name])
    attrs["config.keys"] = sorted(n.name for n in config)
    return attrs


def test_cached_custom_call_matches_pallas(fresh_builds):
    """The call emitted from the cache is the one Pallas emits, but for the module's per-process counter."""
    st, args = _small_kernel(2)

    def lowered(fn):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).compiler_ir()

    own = _custom_call_attrs(lowered(mosaic_kernel._pallas_kernel(st, 2)))
    cached = _custom_call_attrs(lowered(mosaic_kernel.kernel_call(st, 2)))
    assert kernel_cache.builds(MOSAIC) == 1
    differ = {k for k in own if own[k] != cached.get(k)}
    assert set(own) == set(cached) and differ <= {"config.kernel_hash", "config.module"}, differ
    # The modules differ in debug locations and the lowering's counter (``mosaic_gpu.dump_basename``) only.
    assert _module_text(own["config.module"]) == _module_text(cached["config.module"])


def _config_module(backend_config: str) -> str:
    """The ``module`` entry (MLIR text) of a custom call's ``mhlo.backend_config`` dictionary (MLIR text)."""
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib.mlir import ir

    with jax_mlir.make_ir_context():
        return str(ir.DictAttr(ir.Attribute.parse(backend_config))["module"])


def _module_text(module_attr: str) -> str:
    """A kernel's serialized Mosaic GPU module (the custom call's ``module``, an MLIR string attribute
    holding bytecode) as text without debug locations, the lowering's counter
    (``mosaic_gpu.dump_basename``) blanked."""
    from jax._src.interpreters import mlir as jax_mlir
    from jax._src.lib.mlir import ir
    from jax.experimental.mosaic.gpu import dialect as mgpu_dialect

    escapes = {b"\\": b"\\", b'"': b'"', b"n": b"\n", b"t": b"\t"}  # MLIR's string escapes, in one pass
    raw = re.sub(rb'\\([0-9A-Fa-f]{2}|[\\"nt])',
                 lambda m: escapes.get(m.group(1)) or bytes([int(m.group(1), 16)]),
                 module_attr[1:-1].encode("latin-1"))
    ctx = jax_mlir.make_ir_context()
    mgpu_dialect.register_dialect(ctx)
    ctx.allow_unregistered_dialects = True
    with ctx:
        text = ir.Module.parse(raw).operation.get_asm(enable_debug_info=False)
    return re.sub(r'mosaic_gpu.dump_basename = "[^"]*"', "mosaic_gpu.dump_basename = _", text)


def test_triton_kernel_built_once_per_trace(fresh_builds, monkeypatch):
    """The Triton kernel's pallas_call is made once for all layers (``paged_attention`` is jitted: one
    trace, one lowering per executable, called by every layer)."""
    triton_paged.paged_attention.clear_cache()  # a trace from an earlier test would hide the count
    calls = []
    real = triton_paged.run_tiles
    monkeypatch.setattr(triton_paged, "run_tiles", lambda *a, **k: calls.append(1) or real(*a, **k))
    hlo = _lower_step("list", "triton")
    assert len(calls) == 1
    assert len(re.findall(r"\bcall @paged_attention\(", hlo)) == LAYERS
    assert len(re.findall(r"func\.func private @paged_attention\b", hlo)) == 1


def test_prebuild_in_worker_processes(fresh_builds):
    """Kernels found in a traced step are built by worker processes; lowering the step then builds none,
    and a worker's custom call is the one this process would have made."""
    kernels = [_small_kernel(t) for t in (2, 3)]

    def step(*args):
        return [mosaic_kernel.kernel_call(st, st.num_rows // 4)(*args[i * 7:(i + 1) * 7])
                for i, (st, _) in enumerate(kernels)]

    traced = jax.jit(step).trace(*[a for _, args in kernels for a in args])
    found = kernel_cache.kernels_in(traced.jaxpr)
    assert [build.key[1] for build, _ in found] == [2, 3]
    assert kernel_cache.prebuild(found, workers=2) == 2
    assert kernel_cache.builds(MOSAIC) == 2
    traced.lower(lowering_platforms=("cuda",))
    assert kernel_cache.builds(MOSAIC) == 2, "lowering after a prebuild builds nothing"
    build, types = found[0]
    avals = [jax.core.ShapedArray(shape, dtype) for shape, dtype in types]
    worker_call = kernel_cache.kernel_call_for(build, avals)
    kernel_cache.reset()
    own_call = kernel_cache.kernel_call_for(build, avals)  # built here this time
    assert kernel_cache.builds(MOSAIC) == 1
    worker, own = dict(worker_call.attributes), dict(own_call.attributes)
    assert set(worker) == set(own) and worker_call.result_types == own_call.result_types
    assert all(worker[k] == own[k] for k in own if k != "mhlo.backend_config")
    assert _module_text(_config_module(worker["mhlo.backend_config"])) == _module_text(
        _config_module(own["mhlo.backend_config"]))


def test_split_merge_kernel_built_once_per_trace(monkeypatch):
    """The split-KV merge (a Triton kernel after each split attention call) is one function for all
    layers, as the attention kernels are."""
    merge_state = sys.modules["jax_attn.kernels.merge_state"]  # (the package exports a function of that name)
    merge_state.merge_splits.clear_cache()
    calls = []
    real = merge_state.pl.pallas_call
    monkeypatch.setattr(merge_state.pl, "pallas_call", lambda *a, **k: calls.append(1) or real(*a, **k))
    s, r, d = 2, 8, 16
    index = jnp.arange(s * r, dtype=jnp.int32).reshape(s, r)

    def layers(o, lse):
        return [merge_state.merge_splits(o * (i + 1), lse, lse_index=index, out_dtype=jnp.float32, interpret=True)
                for i in range(LAYERS)]

    hlo = jax.jit(layers).lower(jnp.zeros((s, r, d)), jnp.zeros((s * r,))).as_text()
    assert len(calls) == 1
    assert len(re.findall(r"\bcall @merge_splits\(", hlo)) == LAYERS


def test_gpu_code_compiled_ahead_once_per_kernel(fresh_builds, monkeypatch):
    """On a GPU the first lowering of a kernel in a process starts one compile of the kernel alone in a
    thread (the CUDA plugin keeps its GPU code for the executable being lowered). Catches: a compile per
    call site or executable (one thread per layer), one for the torch launcher's module-only lowering,
    or one on a CPU backend."""
    started = []
    monkeypatch.setattr(kernel_cache, "_compile_alone", lambda build, structs, out: started.append(
        (build.name, tuple(s.shape for s in structs), len(out))))

    def lower(num_tiles, sites=2):
        st = kernel_statics(num_tokens=2, num_q_heads=4, num_kv_heads=1, head_dim=64, head_dim_v=64,
                            page_size=16, pack=4, dtype=jnp.bfloat16, max_q_len=1)
        s = jax.ShapeDtypeStruct
        cache = s((9, 16, 1, 64), jnp.bfloat16)
        args = (s((2, 1, 4, 64), jnp.bfloat16), cache, cache, s((2, 4), jnp.int32), s((3,), jnp.int32),
                s((num_tiles, 8), jnp.int32), s((1,), jnp.float32))
        fn = mosaic_kernel.kernel_call(st, num_tiles)

        def step(*a):  # ``sites`` call sites of the same kernel, as layers are
            return [fn(*a)[0] for _ in range(sites)]
        jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",))
        kernel_cache.wait_ahead()

    lower(2)
    assert started == [], "a CPU process compiles no GPU code"
    monkeypatch.setattr(kernel_cache, "_on_cuda", lambda: True)
    lower(2)
    lower(2, sites=3)  # another executable with the kernel
    assert [name.endswith(MOSAIC) for name, _, _ in started] == [True], started
    assert started[0][1][-2] == (2, 8) and started[0][2] == 2  # its argument shapes and its two outputs
    with kernel_cache.module_only():
        lower(3)
    assert len(started) == 1, "the torch launcher's lowering compiles the module itself"
    lower(3)
    assert len(started) == 2


@pytest.mark.gpu
@pytest.mark.skipif(jax.devices()[0].platform != "gpu", reason="needs a CUDA GPU")
def test_gpu_code_compiled_ahead_on_the_gpu(fresh_builds):
    """The compile ahead succeeds on the GPU, and the executable that carries the kernel still runs it:
    a decode kernel call compiled and run once, against the reference."""
    from jax_attn.kernels.mosaic_paged import paged_attention_mosaic
    from tests.attention_cases import GPU_CASES, build_inputs, reference_by_sequence

    case = next(c for c in GPU_CASES if c.name == "decode_only")  # bf16, 32 / 8 heads, head dim 128, page 16
    q, k, v, md, kwargs = build_inputs(case, 0)
    kwargs.pop("return_lse", None)
    got = jax.jit(lambda *a: paged_attention_mosaic(*a, md, num_splits=1, **kwargs))(q, k, v)
    kernel_cache.wait_ahead()
    counts = {event: n for (event, _), n in kernel_cache.stats().items()}
    assert counts.get("ahead", 0) >= 1 and not counts.get("ahead_failed"), counts
    want = reference_by_sequence(q, k, v, md, **kwargs)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=2e-2, rtol=2e-2)
