"""The Mosaic GPU KV-write kernel and the torch-stream launcher.

CPU: the kernel in the Mosaic GPU interpreter against ``set_kv_buffer``; launch plans lowered for
CUDA without a GPU; pointer plumbing through a recording loader on CPU tensors. GPU (``-m gpu``):
the compiled kernel launched from torch equals JAX, respects torch's stream order, is captured by
``torch.cuda.graph``, and costs little host time.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX shares the GPU with torch

import dataclasses
import functools
import gc
import time
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.experimental.pallas import mosaic_gpu as plgpu

from tests.kv_write_kernel import write_kv, write_kv_reference
from torch_bridge import launcher
from torch_bridge.launcher import Compiled, MosaicLauncher, Slot, compile_for_torch, plan_kernel

ON_GPU = torch.cuda.is_available() and jax.default_backend() == "gpu"
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU with JAX's CUDA plugin")


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    slots: tuple  # destination per token; duplicates only on slot 0 (padding)
    num_slots: int
    heads: int
    d: int
    dv: int
    dtype: str


CPU_CASES = [
    Case("decode_bf16", (3, 15, 6, 14), 16, 2, 64, 64, "bfloat16"),
    Case("padded_slot0_f16", (5, 9, 0, 0, 0, 2), 16, 2, 32, 32, "float16"),
    Case("out_of_range_f32_dv", (3, -1, 8, 100, 0), 8, 1, 16, 32, "float32"),
    Case("mla_row_chunks_bf16", (6, 1), 8, 1, 576, 512, "bfloat16"),
    Case("fp8_e4m3", (7, 0, 2), 8, 2, 64, 64, "float8_e4m3fn"),
]


def make_inputs(case: Case, seed: int = 0):
    """New rows (padding rows identical, so duplicate slot-0 writes agree) and NaN-poisoned pools."""
    rng = np.random.default_rng(seed)
    t, dt = len(case.slots), jnp.dtype(case.dtype)
    k = rng.standard_normal((t, case.heads, case.d)).astype(np.float32)
    v = rng.standard_normal((t, case.heads, case.dv)).astype(np.float32)
    pad = [i for i, s in enumerate(case.slots) if s == 0]
    k[pad], v[pad] = k[pad[:1]], v[pad[:1]]
    k_pool = np.full((case.num_slots, case.heads, case.d), np.nan, np.float32)
    v_pool = np.full((case.num_slots, case.heads, case.dv), np.nan, np.float32)
    return (k.astype(dt), v.astype(dt), np.asarray(case.slots, np.int32), k_pool.astype(dt), v_pool.astype(dt))


def assert_same(got, want):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# ------------------------------------------------------------------------------ the kernel (CPU)
def test_reference_by_hand():
    k_pool, v_pool = jnp.zeros((4, 1, 2)), jnp.zeros((4, 1, 2))
    k = jnp.array([[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 6.0]]])
    kp, vp = write_kv_reference(k, -k, jnp.array([2, -1, 4], jnp.int32), k_pool, v_pool)
    assert_same(kp, [[[0, 0]], [[0, 0]], [[1, 2]], [[0, 0]]])
    assert_same(vp, [[[0, 0]], [[0, 0]], [[-1, -2]], [[0, 0]]])


@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.name)
def test_write_kv_interpret(case):
    inputs = make_inputs(case)
    got = jax.jit(functools.partial(write_kv, interpret=True), donate_argnums=(3, 4))(*map(jnp.asarray, inputs))
    want = write_kv_reference(*map(jnp.asarray, inputs))
    pad = [i for i, s in enumerate(case.slots) if s == 0]
    for g, w, new in zip(got, want, inputs[:2]):
        assert_same(g[1:], w[1:])  # every slot but the reserved one, as the reference (set_kv_buffer) writes it
        # slot 0: this kernel writes the padded tokens' (identical) row there; set_kv_buffer drops those writes
        assert_same(g[0], np.asarray(new[pad[0]]) if pad else w[0])


@pytest.mark.parametrize("change, match", [
    (lambda a: (a[0], a[1], a[2].astype(np.float32), a[3], a[4]), "int32"),
    (lambda a: (a[0].astype(np.float32), *a[1:]), "must equal the pool"),
    (lambda a: (a[0][:, :, :4], a[1], a[2], a[3][:, :, :4], a[4]), "multiple of 16 bytes"),
    (lambda a: (a[0], a[1], a[2][:2], a[3], a[4]), "token count"),
])
def test_write_kv_rejects(change, match):
    args = change(make_inputs(CPU_CASES[1]))
    with pytest.raises(ValueError, match=match):
        write_kv(*map(jnp.asarray, args), interpret=True)


# ------------------------------------------------------------------------------ plans (CPU)
def kv_structs(case: Case):
    return [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in make_inputs(case)]


N_SCALE = 256


def _scale_body(x, c, o, unused, smem, bar):  # refs: f32[N] i32[16] -> f32[N], i32[16]
    plgpu.copy_gmem_to_smem(x, smem, bar)
    plgpu.barrier_wait(bar)
    smem[...] = smem[...] * 2.0 + 1.0
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(smem, o)
    plgpu.wait_smem_to_gmem(0)


def scale_fn(x, interpret=False):
    """``2x + 1`` through a kernel with a constant input and a second, unread output."""
    kern = plgpu.kernel(
        _scale_body, out_type=(jax.ShapeDtypeStruct((N_SCALE,), jnp.float32), jax.ShapeDtypeStruct((16,), jnp.int32)),
        grid=(1,), grid_names=("g",),
        scratch_types=[plgpu.SMEM((N_SCALE,), jnp.float32), plgpu.Barrier(num_arrivals=1)],
        interpret=plgpu.InterpretGPUParams() if interpret else None)
    o, spare = kern(x, jnp.full((16,), 3, jnp.int32))
    return spare, o


def test_plan_kv_write_aliases_pools_to_arguments():
    plan = plan_kernel(functools.partial(write_kv, interpret=False), *kv_structs(CPU_CASES[0]))
    assert plan.buffers == tuple(Slot("arg", i) for i in (0, 1, 2, 3, 4, 3, 4))
    assert plan.returns == (Slot("arg", 3), Slot("arg", 4)) and not plan.single
    assert plan.out_types == () and plan.owned == () and len(plan.module) > 0


def test_plan_fresh_outputs_and_constants():
    plan = plan_kernel(scale_fn, jax.ShapeDtypeStruct((N_SCALE,), jnp.float32))
    assert plan.buffers == (Slot("arg", 0), Slot("own", 0), Slot("out", 1), Slot("out", 0))
    assert plan.returns == (Slot("out", 0), Slot("out", 1))
    assert plan.out_types == (((16,), "int32"), ((N_SCALE,), "float32"))
    assert plan.owned == (launcher.Owned((16,), "int32", 3, refill=False),)
    scaled = jax.jit(functools.partial(scale_fn, interpret=True))(jnp.arange(N_SCALE, dtype=jnp.float32))
    np.testing.assert_array_equal(scaled[1], 2 * np.arange(N_SCALE) + 1)


def _copy_body(x, r, o, smem, bar):  # refs: f32[N] (in), f32[N] (written) -> f32[N]
    plgpu.copy_gmem_to_smem(x, smem, bar)
    plgpu.barrier_wait(bar)
    plgpu.copy_smem_to_gmem(smem, r)
    plgpu.copy_smem_to_gmem(smem, o)
    plgpu.wait_smem_to_gmem(0)


def copy_into(x, init):
    """Copies ``x`` into a ref initialised by ``init`` (jnp.empty / jnp.zeros) and into an output."""
    kern = plgpu.kernel(_copy_body, out_type=jax.ShapeDtypeStruct((N_SCALE,), jnp.float32), grid=(1,),
                        grid_names=("g",),
                        scratch_types=[plgpu.SMEM((N_SCALE,), jnp.float32), plgpu.Barrier(num_arrivals=1)])
    ref = jax.new_ref(init((N_SCALE,), jnp.float32))
    o = kern(x, ref)
    return jax.freeze(ref), o


def test_plan_written_buffers():
    x = jax.ShapeDtypeStruct((N_SCALE,), jnp.float32)
    plan = plan_kernel(lambda x: copy_into(x, jnp.empty), x)  # an empty ref written and returned: an output
    assert plan.buffers == (Slot("arg", 0), Slot("out", 0), Slot("out", 1), Slot("out", 0))
    assert plan.returns == (Slot("out", 0), Slot("out", 1)) and plan.owned == ()
    plan = plan_kernel(lambda x: copy_into(x, jnp.zeros)[1], x)  # a constant the kernel writes: refilled
    assert plan.owned == (launcher.Owned((N_SCALE,), "float32", 0.0, refill=True),) and plan.single
    assert plan.buffers == (Slot("arg", 0), Slot("own", 0), Slot("out", 0), Slot("own", 0))
    with pytest.raises(NotImplementedError, match="aliases a constant"):
        plan_kernel(lambda x: copy_into(x, jnp.zeros), x)


def test_plan_reshaped_results_are_the_same_buffers():
    """A result returned in another shape (``merge_state``'s ``[T, H, D]`` view of its ``[T * H, D]`` output) is
    still the kernel's output buffer: an ``out`` of the returned shape. Catches: reshapes of results rejected
    (tree steps could not launch their merge), or the output checked against the kernel's own shape."""
    x = jax.ShapeDtypeStruct((N_SCALE // 4, 4), jnp.float32)
    plan = plan_kernel(lambda x: scale_fn(x.reshape(N_SCALE))[1].reshape(4, 8, -1).reshape(N_SCALE // 8, 8), x)
    assert plan.buffers == (Slot("arg", 0), Slot("own", 0), Slot("out", 0), Slot("own", 1)) and plan.single
    assert plan.returns == (Slot("out", 0),) and plan.out_types == (((N_SCALE // 8, 8), "float32"),)


@pytest.mark.parametrize("fn, match", [
    (lambda x: scale_fn(x * 2.0), "unsupported op"),
    (lambda x: (lambda o: (o, o.reshape(16, -1)))(scale_fn(x)[1]), "one shape"),
    (lambda x: (scale_fn(x)[1], scale_fn(x)[1]), "several kernel calls"),
    (lambda x: (scale_fn(x)[1], x), "only return results of the kernel"),
    (lambda x: {"o": scale_fn(x)[1]}, "flat tuple"),
    (lambda x: x + 1.0, "unsupported op|no Pallas GPU kernel"),
])
def test_plan_rejects(fn, match):
    with pytest.raises(ValueError, match=match):
        plan_kernel(fn, jax.ShapeDtypeStruct((N_SCALE,), jnp.float32))


def test_version_pin(monkeypatch):
    monkeypatch.setattr(jax, "__version__", "0.12.0")
    with pytest.raises(RuntimeError, match="pinned to jax 0.11.2"):
        launcher.check_jax_internals()


# ------------------------------------------------------------------------------ pointer plumbing (CPU)
class RecordingLoader:
    """Stands in for the CUDA plugin: records the pointer list of every launch."""

    def __init__(self):
        self.calls, self.unloaded = [], 0

    def __call__(self, module: bytes, device) -> Compiled:
        def launch(handle, stream, ptrs):
            self.calls.append((handle, stream, [p or 0 for p in ptrs]))

        return Compiled(7, launch, self._unload)

    def _unload(self):
        self.unloaded += 1


def cpu_tensors(case: Case):
    return [torch.from_numpy(np.asarray(x).view(np.uint16)).view(torch.bfloat16) if x.dtype == jnp.bfloat16
            else torch.from_numpy(np.asarray(x)) for x in make_inputs(case)]


def test_launch_fills_pointers_in_xla_order():
    loader = RecordingLoader()
    fn = functools.partial(write_kv, interpret=False)
    args = cpu_tensors(CPU_CASES[0])
    kern = compile_for_torch(fn, *args, loader=loader)
    k_pool, v_pool = kern(*args)
    assert k_pool is args[3] and v_pool is args[4]  # written in place, nothing allocated
    ptr = [a.data_ptr() for a in args]
    assert loader.calls == [(7, 0, ptr + ptr[3:])]
    kern(*args, check=False)
    assert len(loader.calls) == 2
    bound = kern.bind(*args)
    k_out, v_out = bound()
    assert k_out is args[3] and v_out is args[4] and loader.calls[-1][2] == ptr + ptr[3:]
    del kern, bound
    import gc

    gc.collect()
    assert loader.unloaded == 1


def test_launch_out_and_owned_buffers():
    loader = RecordingLoader()
    x = torch.arange(N_SCALE, dtype=torch.float32)
    kern = compile_for_torch(scale_fn, x, loader=loader)
    spare, o = torch.empty(16, dtype=torch.int32), torch.empty(N_SCALE)
    got = kern(x, out=(spare, o))
    assert got[0] is spare and got[1] is o
    const = kern._owned[0]
    assert torch.equal(const, torch.full((16,), 3, dtype=torch.int32))
    assert loader.calls[-1][2] == [x.data_ptr(), const.data_ptr(), o.data_ptr(), spare.data_ptr()]
    fresh = kern(x)  # allocated when out= is not given
    assert fresh[1].shape == (N_SCALE,) and fresh[0].dtype == torch.int32


def test_launch_refills_written_constants():
    loader = RecordingLoader()
    x = torch.arange(N_SCALE, dtype=torch.float32)
    kern = compile_for_torch(lambda x: copy_into(x, jnp.zeros)[1], x, loader=loader)
    kern._owned[0].fill_(5.0)  # what the previous launch left there
    o = kern(x)
    assert torch.all(kern._owned[0] == 0.0) and o.shape == (N_SCALE,)
    assert loader.calls[-1][2] == [x.data_ptr(), kern._owned[0].data_ptr(), o.data_ptr(), kern._owned[0].data_ptr()]


@pytest.mark.parametrize("bad, match", [
    (lambda a: a[:1] + [a[1].float()] + a[2:], r"argument\[1\]"),
    (lambda a: a[:3] + [a[3][:8]] + a[4:], r"argument\[3\]"),
    (lambda a: a[:3] + [a[3].transpose(0, 1).contiguous().transpose(0, 1)] + a[4:], "contiguous"),
    (lambda a: a[:4], "expected 5 argument"),
])
def test_launch_checks(bad, match):
    loader = RecordingLoader()
    args = cpu_tensors(CPU_CASES[0])
    kern = compile_for_torch(functools.partial(write_kv, interpret=False), *args, loader=loader)
    with pytest.raises(ValueError, match=match):
        kern(*bad(list(args)))
    assert loader.calls == []


def test_launcher_caches_per_shape():
    loader = RecordingLoader()
    launch = MosaicLauncher(functools.partial(write_kv, interpret=False), loader=loader)
    a, b = cpu_tensors(CPU_CASES[0]), cpu_tensors(CPU_CASES[1])
    assert launch.kernel(*a) is launch.kernel(*a) and launch.kernel(*a) is not launch.kernel(*b)


# ------------------------------------------------------------------------------ GPU
GPU_CASES = [
    Case("decode_64_bf16", tuple(range(100, 164)), 4096, 8, 128, 128, "bfloat16"),
    Case("padded_invalid_f16", (17, 0, 0, -1, 4096, 3), 4096, 8, 128, 128, "float16"),
    Case("f32_dv", (1, 2, 5, 0), 64, 4, 64, 32, "float32"),
    Case("mla_576_bf16", (9, 3, 0), 64, 1, 576, 512, "bfloat16"),
]


def torch_inputs(case: Case, seed=0):
    dt = getattr(torch, case.dtype)
    rng = np.random.default_rng(seed)
    t = len(case.slots)
    k = torch.from_numpy(rng.standard_normal((t, case.heads, case.d)).astype(np.float32)).to("cuda", dt)
    v = torch.from_numpy(rng.standard_normal((t, case.heads, case.dv)).astype(np.float32)).to("cuda", dt)
    pad = [i for i, s in enumerate(case.slots) if s == 0]
    if pad:  # every write to the shared padding slot carries the same row, so the result is defined
        k[pad], v[pad] = k[pad[0]].clone(), v[pad[0]].clone()
    slots = torch.tensor(case.slots, dtype=torch.int32, device="cuda")
    kp = torch.full((case.num_slots, case.heads, case.d), float("nan"), dtype=dt, device="cuda")
    vp = torch.full((case.num_slots, case.heads, case.dv), float("nan"), dtype=dt, device="cuda")
    return [k, v, slots, kp, vp]


def torch_reference(k, v, slots, kp, vp):
    ok = (slots >= 0) & (slots < kp.shape[0])
    kp, vp = kp.clone(), vp.clone()
    kp[slots[ok].long()], vp[slots[ok].long()] = k[ok], v[ok]
    return kp, vp


def same(a, b) -> bool:
    return torch.equal(torch.nan_to_num(a.float(), nan=1234.5), torch.nan_to_num(b.float(), nan=1234.5))


@gpu
@needs_gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
def test_gpu_launcher_equals_jax(case):
    args = torch_inputs(case)
    want = torch_reference(*args)
    jax_args = [jnp.asarray(np.asarray(a.float().cpu()), jnp.dtype(case.dtype)) if a.is_floating_point()
                else jnp.asarray(a.cpu().numpy()) for a in args]
    jax_out = jax.jit(write_kv)(*jax_args)  # the compiled kernel through XLA
    kern = compile_for_torch(write_kv, *args)
    got = kern(*args)
    torch.cuda.synchronize()
    for g, w, j in zip(got, want, jax_out):
        assert same(g, w)
        assert same(g.cpu(), torch.from_numpy(np.asarray(j.astype(jnp.float32))))


@gpu
@needs_gpu
def test_gpu_out_tensors_and_owned_buffers():
    x = torch.arange(N_SCALE, dtype=torch.float32, device="cuda")
    kern = compile_for_torch(scale_fn, x)
    spare, o = torch.empty(16, dtype=torch.int32, device="cuda"), torch.full((N_SCALE,), float("nan"), device="cuda")
    kern(x, out=(spare, o))  # warm up
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    got = kern(x, out=(spare, o), check=False)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before  # no torch allocation per call
    assert got[1] is o and torch.equal(o, 2 * x + 1)
    copy = compile_for_torch(lambda x: copy_into(x, jnp.zeros)[1], x)
    assert torch.equal(copy(x), x) and torch.equal(copy(x + 1), x + 1)


@gpu
@needs_gpu
def test_gpu_side_stream_order():
    case = GPU_CASES[0]
    args = torch_inputs(case)
    kern = compile_for_torch(write_kv, *args)
    kern(*args)
    src = torch.randn_like(args[0])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # a launch on another stream would overtake the copy below
        args[0].copy_(src * 2)
        args[3].fill_(float("nan"))
        kern(*args)
        total = args[3].float().nan_to_num(0.0).sum()  # consumed on the side stream
    torch.cuda.synchronize()
    assert same(args[3][torch.tensor(case.slots).long()], src * 2)
    assert torch.allclose(total, (src * 2).float().sum(), rtol=1e-3, atol=1e-2)


@gpu
@needs_gpu
def test_gpu_graph_capture_and_replay():
    case = GPU_CASES[1]
    args = torch_inputs(case)
    kern = compile_for_torch(write_kv, *args)
    bound = kern.bind(*args)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside the capture
        kern(*args)
        bound()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kern(*args, check=False)
    for seed in (1, 2):
        slots = tuple(np.random.default_rng(seed).permutation(64)[:6].tolist())
        fresh = torch_inputs(dataclasses.replace(case, slots=slots), seed)
        for dst, src in zip(args, fresh):
            dst.copy_(src)
        want = torch_reference(*args)
        graph.replay()
        torch.cuda.synchronize()
        assert same(args[3], want[0]) and same(args[4], want[1])


@gpu
@needs_gpu
def test_gpu_identical_modules_compile_once_and_unload_with_the_last_kernel():
    """Two kernels of one module (a target and a draft backend with the same layer shape) share one compiled
    module; it stays loaded, and launchable, while either kernel lives (bug caught: a compile per kernel,
    or the first kernel's death unloading what the second still launches)."""
    x = torch.arange(N_SCALE, dtype=torch.float32, device="cuda")
    plan = launcher.plan_kernel(lambda x: scale_fn(x)[1], jax.ShapeDtypeStruct((N_SCALE,), jnp.float32))
    first = launcher.TorchKernel(plan, x.device)
    second = launcher.TorchKernel(plan, x.device)
    assert first._handle == second._handle, "an identical module was compiled twice"
    loaded = [v for v in launcher._loaded.values() if v.handle == first._handle]
    assert len(loaded) == 1
    del first
    gc.collect()
    assert torch.equal(second(x), 2 * x + 1)  # still loaded
    alive = weakref.ref(loaded.pop())
    del second
    gc.collect()
    assert alive() is None, "the shared module outlived its last kernel"


def _host_us(fn, n=2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


@gpu
@needs_gpu
def test_gpu_host_time_per_call():
    args = torch_inputs(Case("t8", tuple(range(1, 9)), 256, 8, 128, 128, "bfloat16"))
    kern = compile_for_torch(write_kv, *args)
    bound = kern.bind(*args)
    checked = _host_us(lambda: kern(*args))
    fast = _host_us(lambda: kern(*args, check=False))
    bound_us = _host_us(bound)
    print(f"\nhost us per launch: checked {checked:.1f}, check=False {fast:.1f}, bound {bound_us:.1f}")
    assert fast < 50.0
