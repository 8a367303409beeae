"""Launch compiled Pallas GPU kernels on torch's current CUDA stream, without JAX dispatch.

A JAX function holding one Pallas kernel call is lowered once per argument shapes, and the kernel
is taken from its custom call:

* a Mosaic GPU kernel (``plgpu.kernel``; custom call ``mosaic_gpu_v2``): its module is compiled
  with ``MosaicGpuCompile`` from JAX's CUDA plugin. A launch calls the plugin's host function
  (jaxlib's Mosaic GPU runtime, pinned to jax 0.11.2), which encodes the TMA descriptors on the host
  (``cuTensorMapEncodeTiled``) and calls ``cuLaunchKernelEx`` on the stream, nothing else;
* a Triton-lowered ``pl.pallas_call`` (custom call ``__gpu$xla.gpu.triton``): its Triton IR (what
  XLA would compile) is compiled to a cubin by the ``triton`` package torch ships, and a launch is
  one ``cuLaunchKernel`` (any CUDA GPU that Triton supports, sm80+).

A launch fills a prebuilt array of device pointers (XLA's order: call operands, then call results)
and launches with ``torch.cuda.current_stream()``: inside ``torch.cuda.graph`` capture it is
recorded as one kernel node whose parameters (pointers, TMA descriptors) are fixed at capture, as
for any captured torch kernel. Launch once before capturing, as torch recommends for any kernel.
A reshape of an argument feeding the call is that argument (torch tensors are contiguous).

Outputs the kernel aliases to an argument (a pool passed through ``jax.new_ref`` and written by
the kernel) are written in place into that torch tensor; other returned outputs go into ``out=``
tensors (no allocation per call) or new ``torch.empty`` tensors. Constants and ``jnp.empty`` /
``jnp.zeros`` buffers feeding the call become device tensors the compiled kernel owns.

Set ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` before JAX first touches the GPU (lowering queries the
device). Keep a compiled kernel (or its ``BoundLaunch``) alive while a CUDA graph that captured it
may replay: its code is unloaded when it is garbage collected. Kernel objects are not thread-safe.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import re
import threading
import weakref
from typing import Any, Callable, NamedTuple, Optional, Sequence, Tuple

import jax

from jax_attn.kernels import kernel_cache
from torch_bridge.dlpack import device_index, keeping_cuda_context, libcuda

try:  # jax internals, pinned below (check_jax_internals says what to update when they move)
    import jax.experimental.mosaic.gpu as _mgpu
    from jax._src.lib.mlir import ir, passmanager
    from jax._src.lib.mlir.dialects import hlo
except ImportError as _e:  # pragma: no cover - other jax versions
    _mgpu = ir = passmanager = hlo = None
    _IMPORT_ERROR = _e

JAX_FAMILY = "0.11.2"
CALL_TARGET = "mosaic_gpu_v2"
TRITON_TARGET = "__gpu$xla.gpu.triton"
_ALIGN = 16  # TMA needs 16-byte aligned global addresses
_LAUNCH_T = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p))
_TORCH_DTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "f64": "float64",
                 "i64": "int64", "i32": "int32", "i16": "int16", "i8": "int8", "ui8": "uint8",
                 "ui16": "uint16", "ui32": "uint32", "ui64": "uint64", "i1": "bool",
                 "f8E4M3FN": "float8_e4m3fn", "f8E5M2": "float8_e5m2"}


def jax_dtype(torch_dtype):
    """The JAX dtype of a torch dtype (``torch.bfloat16`` -> ``bfloat16``)."""
    return jax.numpy.dtype(str(torch_dtype).removeprefix("torch."))


def check_jax_internals() -> None:
    """Raise RuntimeError if the jax/jaxlib internals this module relies on are not the pinned ones."""
    import jaxlib

    for name, version in (("jax", jax.__version__), ("jaxlib", jaxlib.__version__)):
        if not re.match(rf"^{re.escape(JAX_FAMILY)}(\D|$)", version):
            raise RuntimeError(
                f"torch_bridge.launcher is pinned to {name} {JAX_FAMILY}.x, found {version}: re-check "
                "jax/_src/pallas/mosaic_gpu/torch.py and jax/experimental/mosaic/gpu/core.py "
                "(_compile_as_torch_gpu_kernel) of the new version, then update JAX_FAMILY"
            )
    if hlo is None:
        raise RuntimeError(f"jax internals moved ({_IMPORT_ERROR}): update the imports of torch_bridge/launcher.py")
    for owner, attr in ((hlo, "CustomCallOp"), (hlo, "OutputOperandAlias"), (passmanager, "PassManager"),
                        (_mgpu.dialect, "register_inliner_extensions")):
        if not hasattr(owner, attr):
            raise RuntimeError(f"jax internal {owner.__name__}.{attr} is gone: update torch_bridge/launcher.py")


# ---------------------------------------------------------------- plan: where each pointer comes from
class Slot(NamedTuple):
    """One entry of the kernel's buffer list: a caller argument, an output or an owned buffer."""

    kind: str  # "arg" (caller tensor), "out" (returned output), "own" (kernel-owned tensor)
    index: int  # type: ignore[assignment]  # shadows tuple.index, which nothing here calls


@dataclasses.dataclass(frozen=True)
class Owned:
    """A device tensor the compiled kernel owns: a constant, or scratch the caller never sees."""

    shape: tuple[int, ...]
    dtype: str  # torch dtype name
    fill: Optional[float] = None  # constant value; None = uninitialized scratch
    refill: bool = False  # the kernel writes it: restore the constant before every launch


@dataclasses.dataclass(frozen=True)
class TritonModule:
    """A Triton-lowered Pallas kernel: its Triton IR (text) and launch configuration."""

    ttir: str
    name: str
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]
    num_buffers: int  # pointer parameters XLA would pass: the call's operands, then its results
    max_registers: Optional[int] = None  # ptxas's registers per thread at most (Triton's ``maxnreg``); None: its own


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """How to call one lowered kernel from torch (built once per argument shapes)."""

    module: Any  # the serialized Mosaic GPU module (bytes), or a ``TritonModule``
    arg_types: tuple[tuple[tuple[int, ...], str], ...]  # (shape, torch dtype name) per argument
    out_types: tuple[tuple[tuple[int, ...], str], ...]  # per fresh output (not written into an argument)
    buffers: tuple[Slot, ...]  # call operands, then call results
    returns: tuple[Slot, ...]  # the function's results: ("arg", i) written in place, or ("out", j)
    owned: tuple[Owned, ...]
    single: bool  # the function returns one array, not a tuple


def _tensor_type(value) -> tuple[tuple[int, ...], str]:
    ty = ir.RankedTensorType(value.type)
    elem = str(ty.element_type)
    if elem not in _TORCH_DTYPES:
        raise ValueError(f"element type {elem} has no torch dtype: use one of {sorted(_TORCH_DTYPES)}")
    return tuple(ty.shape), _TORCH_DTYPES[elem]


def _splat_value(op) -> float:
    attr = op.value
    if not isinstance(attr, ir.DenseElementsAttr) or not attr.is_splat:
        raise ValueError(f"only splat constants can feed the kernel, got {op}: pass the array as an argument")
    value = attr.get_splat_value()
    return ir.IntegerAttr(value).value if isinstance(value, ir.IntegerAttr) else ir.FloatAttr(value).value


def _scan_block(block):
    """Classify the values of ``main``'s body; return (sources, the kernel call, the return op)."""
    sources: dict[Any, tuple] = {arg: ("arg", i) for i, arg in enumerate(block.arguments)}
    call = ret = None
    for op in block.operations:
        name = op.operation.name
        target = op.call_target_name.value if isinstance(op, hlo.CustomCallOp) else None
        if name == "stablehlo.constant":
            sources[op.result] = ("const", _splat_value(op), *_tensor_type(op.result))
        elif name == "stablehlo.broadcast_in_dim" and sources.get(op.operand, ("",))[0] == "const":
            sources[op.result] = ("const", sources[op.operand][1], *_tensor_type(op.result))
        elif target == "AllocateBuffer":
            sources[op.result] = ("empty", None, *_tensor_type(op.result))
        elif name == "stablehlo.reshape" and sources.get(op.operand, ("",))[0] in ("arg", "result"):
            sources[op.result] = sources[op.operand]  # a contiguous tensor's other shape: the same buffer
        elif target in (CALL_TARGET, TRITON_TARGET):
            if call is not None:
                raise ValueError("the function holds several kernel calls: launch each one separately")
            call = op
            sources.update({v: ("result", r) for r, v in enumerate(op.results)})
        elif name in ("func.return", "sdy.return"):
            ret = op
        else:
            raise ValueError(
                f"unsupported op outside the kernel: {name}{'/' + target if target else ''}. The function "
                "may hold one plgpu.kernel or pl.pallas_call plus scalar constants, jnp.empty/zeros buffers and "
                "reshapes of its arguments and results: move other JAX ops into the kernel or into torch"
            )
    if call is None or ret is None:
        raise ValueError("no Pallas GPU kernel call found: the function must call a plgpu.kernel or a "
                         "pl.pallas_call (interpret=False)")
    return sources, call, ret


def _triton_module(config, num_buffers: int) -> TritonModule:
    from jax._src.pallas.triton.lowering import _new_ir_context  # the context that reads Triton IR

    def num(key):
        return ir.IntegerAttr(config[key]).value

    with _new_ir_context():
        ttir = str(ir.Module.parse(ir.StringAttr(config["ir"]).value_bytes).operation.get_asm(enable_debug_info=False))
    return TritonModule(ttir, ir.StringAttr(config["name"]).value, num("num_warps"), num("num_stages"),
                        (num("grid_x"), num("grid_y"), num("grid_z")), num_buffers)


def _call_module(call):
    config = call.attributes["mhlo.backend_config"]
    if call.call_target_name.value == TRITON_TARGET:
        return _triton_module(config, len(call.operands) + len(call.results))
    for flag in ("use_custom_barrier", "uses_xla_collective_metadata"):
        if flag in config and ir.BoolAttr(config[flag]).value:
            raise ValueError(f"the kernel sets {flag}: multi-device kernels cannot be launched from torch")
    if "module" not in config:
        raise RuntimeError(f"{CALL_TARGET} backend_config has no 'module': a jax internal changed, update the launcher")
    return ir.StringAttr(config["module"]).value_bytes


def _call_aliases(call) -> dict[int, int]:
    """result index -> operand index, from the call's ``output_operand_aliases``."""
    aliases: dict[int, int] = {}
    if "output_operand_aliases" not in call.attributes:
        return aliases
    for attr in call.attributes["output_operand_aliases"]:
        alias = hlo.OutputOperandAlias(attr)
        if alias.operand_tuple_indices or len(alias.output_tuple_indices) > 1:
            raise ValueError("tupled operands/results in output_operand_aliases are not supported")
        result = alias.output_tuple_indices[0] if alias.output_tuple_indices else 0
        aliases[result] = alias.operand_index
    return aliases


def _assign_slots(sources, call, ret, aliases):
    """Slots for the call's operands and results, the function's returns, owned tensors, outputs."""
    operand_src = [sources[v] for v in call.operands]
    results = list(call.results)
    returned, shown = [], {}  # result index per return; the type each fresh result is returned as
    for v in ret.operands:
        src = sources.get(v, ("",))
        if src[0] != "result":
            raise ValueError("the function may only return results of the kernel call (not inputs or constants)")
        r = src[1]
        if shown.setdefault(r, _tensor_type(v)) != _tensor_type(v) or (r in aliases and v != results[r]):
            raise ValueError(f"kernel result {r} is returned reshaped: return it once, in one shape (an output "
                             "written into an argument in the argument's shape)")
        returned.append(r)
    owned, out_types, out_of_result = [], [], {}
    for r in dict.fromkeys(returned):  # fresh outputs, in return order
        src = operand_src[aliases[r]] if r in aliases else None
        if src is not None and src[0] == "const":
            raise NotImplementedError("a returned output aliases a constant: pass its initial value as an argument")
        if src is None or src[0] == "empty":
            out_of_result[r] = len(out_types)
            out_types.append(shown[r])
    written = {aliases[r] for r in aliases}
    operand_slots = []
    for j, src in enumerate(operand_src):
        out_r = next((r for r, o in aliases.items() if o == j and r in out_of_result), None)
        if src[0] == "arg":
            operand_slots.append(Slot("arg", src[1]))
        elif out_r is not None:
            operand_slots.append(Slot("out", out_of_result[out_r]))
        else:
            fill = src[1] if src[0] == "const" else None
            owned.append(Owned(tuple(src[2]), src[3], fill, refill=fill is not None and j in written))
            operand_slots.append(Slot("own", len(owned) - 1))
    result_slots = []
    for r, value in enumerate(results):
        if r in aliases:
            result_slots.append(operand_slots[aliases[r]])
        elif r in out_of_result:
            result_slots.append(Slot("out", out_of_result[r]))
        else:  # a result nobody reads: scratch owned by the kernel
            owned.append(Owned(*_tensor_type(value)))
            result_slots.append(Slot("own", len(owned) - 1))
    returns = [result_slots[r] for r in returned]
    return tuple(operand_slots + result_slots), tuple(returns), tuple(owned), tuple(out_types)


def plan_kernel(fn: Callable, *arg_structs: jax.ShapeDtypeStruct) -> KernelPlan:
    """Lower ``fn`` for CUDA at ``arg_structs`` and describe how to launch its one Pallas GPU kernel.

    A Mosaic GPU kernel's plan needs no GPU (the lowering targets CUDA explicitly), so plans can be
    checked on a CPU machine; a Triton-lowered kernel's lowering asks JAX for the GPU's compute capability.
    """
    check_jax_internals()
    for s in arg_structs:
        if not hasattr(s, "shape") or not hasattr(s, "dtype"):
            raise ValueError(f"{s!r}: pass one jax.ShapeDtypeStruct (or array) per argument, no pytrees")
    traced = jax.jit(fn, keep_unused=True).trace(*arg_structs)
    out_leaves, out_tree = jax.tree.flatten(traced.out_info)
    single = out_tree == jax.tree.structure(0)  # type: ignore[operator]  # PyTreeDef has ==; its stub does not say
    if not single and out_tree != jax.tree.structure((0,) * len(out_leaves)):  # type: ignore[operator]
        raise ValueError(f"the function must return an array or a flat tuple of arrays, got {out_tree}")
    with kernel_cache.module_only():  # the plugin compiles this module itself (cuda_loader)
        module = traced.lower(lowering_platforms=("cuda",)).compiler_ir()
    with module.context:
        _mgpu.dialect.register_inliner_extensions(module.context)  # undo jax.jit's outlining
        passmanager.PassManager.parse("builtin.module(inline{default-pipeline=})").run(module.operation)
        mains = [op for op in module.body.operations if op.operation.name == "func.func"
                 and op.attributes["sym_name"].value == "main"]
        if len(mains) != 1:
            raise ValueError("expected one main function in the lowered module (nested calls left after inlining)")
        block = mains[0].regions[0].blocks[0]
        sources, call, ret = _scan_block(block)
        buffers, returns, owned, out_types = _assign_slots(sources, call, ret, _call_aliases(call))
        arg_types = tuple(_tensor_type(a) for a in block.arguments)
        return KernelPlan(_call_module(call), arg_types, out_types, buffers, returns, owned, single)


# ---------------------------------------------------------------- compile and launch
class Compiled(NamedTuple):
    handle: int  # the plugin's loaded-kernel handle
    launch: Callable  # launch(handle, stream, buffers)
    unload: Callable[[], None]


@functools.cache
def _plugin_library():
    check_jax_internals()
    try:
        try:
            import jax_plugins.xla_cuda13 as plugin
        except ImportError:
            import jax_plugins.xla_cuda12 as plugin
    except ImportError:
        raise RuntimeError("JAX's CUDA plugin (jax-cuda13-plugin / jax-cuda12-plugin) is not installed") from None
    lib = ctypes.CDLL(plugin._get_library_path())
    for sym in ("MosaicGpuCompile", "MosaicGpuUnload"):
        if not hasattr(lib, sym):
            raise RuntimeError(f"{sym} is missing from the CUDA plugin: a jaxlib internal changed, update the launcher")
    lib.MosaicGpuCompile.argtypes = [ctypes.c_char_p, ctypes.c_int]
    lib.MosaicGpuCompile.restype = ctypes.POINTER(ctypes.c_void_p)
    lib.MosaicGpuUnload.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    lib.MosaicGpuUnload.restype = None
    return lib


def _primary_context(index: int) -> int:
    """The primary context (torch's and JAX's) of CUDA device ``index``, as an address."""
    lib, dev, ctx = libcuda(), ctypes.c_int(), ctypes.c_void_p()
    for what, rc in (("cuDeviceGet", lambda: lib.cuDeviceGet(ctypes.byref(dev), index)),
                     ("cuDevicePrimaryCtxRetain", lambda: lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))):
        err = rc()
        if err:
            raise RuntimeError(f"{what} failed with CUDA error {err} (device {index})")
    release = getattr(lib, "cuDevicePrimaryCtxRelease_v2", None) or lib.cuDevicePrimaryCtxRelease
    release(dev)  # the CUDA runtime (torch, JAX) keeps its own reference
    return int(ctx.value)


def _bind_primary_context(device) -> None:
    """Make ``device``'s primary context (torch's) current on this thread. A thread that has made no
    CUDA runtime call has no current context, and the plugin's compile and module load use the driver."""
    index = device_index(device)
    err = libcuda().cuCtxSetCurrent(ctypes.c_void_p(_primary_context(index)))
    if err:
        raise RuntimeError(f"cuCtxSetCurrent failed with CUDA error {err} (device {index})")


class _DeviceLaunch:
    """Launches on torch's current stream of one CUDA device, in that device's context: when another context
    is current on this thread, this one is made current for the launch and the other restored after it.
    JAX leaves the context of the device it last ran on current (XLA does not restore it), and a raw launch
    on the default stream (handle 0) goes to the current context: after JAX ran on device 0, a kernel of a
    ``cuda:1`` pool would be launched into device 0's context. Restoring keeps the thread's current device
    (torch's ``current_device()`` reads it) as the caller left it."""

    def __init__(self, index: int, raw: Callable[[], int]):
        lib = libcuda()
        self._get, self._set, self._raw = lib.cuCtxGetCurrent, lib.cuCtxSetCurrent, raw
        self._ctx = ctypes.c_void_p(_primary_context(index))
        self._current = ctypes.c_void_p()
        self._ref = ctypes.byref(self._current)

    def __call__(self, launch: Callable, handle, ptrs) -> None:
        self._get(self._ref)
        if self._current.value == self._ctx.value:
            launch(handle, self._raw(), ptrs)
            return
        previous = ctypes.c_void_p(self._current.value)
        self._set(self._ctx)
        try:
            launch(handle, self._raw(), ptrs)
        finally:
            self._set(previous)


def compile_triton(module: TritonModule, capability: Tuple[int, int]):
    """``module`` compiled by the ``triton`` package for a CUDA GPU of this compute capability (Triton's
    own on-disk cache makes a second compile of the same IR a lookup). Needs no GPU."""
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, module.name + ".ttir")
        with open(path, "w") as f:
            f.write(module.ttir)
        options = dict(num_warps=module.num_warps, num_stages=module.num_stages)
        if module.max_registers is not None:
            options["maxnreg"] = module.max_registers
        return triton.compile(path, target=GPUTarget("cuda", 10 * capability[0] + capability[1], 32), options=options)


def kernel_params(ptx: str, name: str) -> int:
    """How many parameters the PTX entry ``name`` takes."""
    m = re.search(rf"\.entry\s+{re.escape(name)}\s*\((.*?)\)", ptx, re.S)
    if m is None:
        raise RuntimeError(f"no .entry {name} in the compiled Triton kernel's PTX")
    return m.group(1).count(".param")


@functools.cache
def _cu_launch_kernel():
    """``cuLaunchKernel`` called with ctypes objects made once (no ``argtypes``: converting eleven Python
    arguments per call cost about 1.2 of its 6.4 µs on an H200 host)."""
    fn = libcuda().cuLaunchKernel
    fn.restype = ctypes.c_int
    return fn


class TritonLaunch:
    """``launch(handle, stream, ptrs)`` of one loaded Triton kernel: ``cuLaunchKernel`` with the kernel's
    pointer parameters read from ``ptrs`` (call operands, then results) and null pointers for the scratch
    parameters Triton appends (the kernel must not need scratch memory)."""

    def __init__(self, function: int, grid: tuple, num_warps: int, shared: int, num_buffers: int, num_params: int):
        extra = num_params - num_buffers
        if extra not in (0, 1, 2):
            raise RuntimeError(f"the compiled Triton kernel takes {num_params} parameters for {num_buffers} "
                               "buffers: a jax or triton internal changed, update torch_bridge/launcher.py")
        u = ctypes.c_uint
        # cuLaunchKernel's arguments before the stream: function, grid, block, shared bytes
        self._head = (ctypes.c_void_p(function), *(u(g) for g in grid), u(32 * num_warps), u(1), u(1), u(shared))
        self._stream: tuple = (None, None)  # the last stream handle and its ctypes argument
        self._num_buffers, self._null = num_buffers, (ctypes.c_void_p * max(extra, 1))()
        self._extra = [ctypes.addressof(self._null) + 8 * i for i in range(extra)]
        self._params: dict = {}  # address of a pointer array -> the kernel parameter array reading it
        self._launch = _cu_launch_kernel()
        self.keep: Any = None  # what must outlive the loaded code (the compiled kernel)

    def _params_of(self, ptrs):
        base = ctypes.addressof(ptrs)
        params = self._params.get(base)
        if params is None:  # arrays of one kernel all hold num_buffers pointers: an address reused is safe
            addrs = [base + 8 * i for i in range(self._num_buffers)] + self._extra
            params = self._params[base] = (ctypes.c_void_p * len(addrs))(*addrs)
        return params

    def __call__(self, handle, stream, ptrs) -> None:
        if stream != self._stream[0]:
            self._stream = (stream, ctypes.c_void_p(stream))
        err = self._launch(*self._head, self._stream[1], self._params_of(ptrs), None)
        if err:
            raise RuntimeError(f"cuLaunchKernel failed with CUDA error {err}")


def triton_loader(module: TritonModule, device) -> Compiled:
    """Compile a Triton-lowered kernel for ``device`` and load it into torch's context."""
    import torch
    from triton.runtime import driver

    with torch.cuda.device(device):
        torch.empty(1, device=device)  # the primary context exists
        _bind_primary_context(torch.device(device))
        kernel = compile_triton(module, torch.cuda.get_device_capability(device))
        md = kernel.metadata
        if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
            raise NotImplementedError(f"Triton kernel {module.name} needs scratch memory: not launchable from torch")
        _, function, _, _, max_threads = driver.active.utils.load_binary(
            md.name, kernel.asm["cubin"], md.shared, torch.device(device).index)
    if 32 * md.num_warps > max_threads:
        raise RuntimeError(f"Triton kernel {module.name}: {md.num_warps} warps exceed {max_threads} threads")
    launch = TritonLaunch(function, module.grid, md.num_warps, md.shared, module.num_buffers,
                          kernel_params(kernel.asm["ptx"], md.name))
    launch.keep = kernel  # the module stays loaded while the kernel object lives
    return Compiled(0, launch, lambda: None)


class _Loaded:
    """A Mosaic GPU module compiled and loaded into one device's context, shared by every ``TorchKernel`` of
    an identical module in the process (two backends with the same layer shape: a target and its draft
    model); unloaded when the last of them is gone."""

    def __init__(self, handle: int, launch: Callable, unload: Callable[[], None]):
        self.handle, self.launch = handle, launch
        weakref.finalize(self, unload).atexit = False  # the process is ending: nothing to free


_loaded: "weakref.WeakValueDictionary[tuple, _Loaded]" = weakref.WeakValueDictionary()
_load_locks: dict = {}  # (module digest, device index) -> lock: one compile per module when threads race
_load_lock = threading.Lock()


def cuda_loader(module, device) -> Compiled:
    """Compile a lowered kernel (``KernelPlan.module``) for ``device``: a serialized Mosaic GPU module
    with the CUDA plugin (once per identical module and device in the process), a ``TritonModule`` with
    ``triton`` (``triton_loader``; Triton's on-disk cache makes a repeated compile a lookup)."""
    import torch

    if isinstance(module, TritonModule):
        return triton_loader(module, device)
    key = (hashlib.sha256(module).digest(), device_index(torch.device(device)))
    with _load_lock:
        lock = _load_locks.setdefault(key, threading.Lock())
    with lock:
        loaded = _loaded.get(key)
        if loaded is None:
            loaded = _loaded[key] = _Loaded(*_mosaic_compile(module, device))
    # the kernel's unload callback holds the shared module: it lives while any kernel of it does
    return Compiled(loaded.handle, loaded.launch, functools.partial(_keep, loaded))


def _keep(_loaded_module: _Loaded) -> None:
    """A ``TorchKernel``'s unload of a shared module: only drops its reference (``_Loaded`` unloads)."""


def _mosaic_compile(module: bytes, device) -> Tuple[int, Callable, Callable[[], None]]:
    import torch

    lib = _plugin_library()
    with torch.cuda.device(device):
        torch.empty(1, device=device)  # the primary context exists
        _bind_primary_context(torch.device(device))  # current on this thread too (a new thread has none)
        res = lib.MosaicGpuCompile(module, len(module))
    if not res:
        raise RuntimeError("MosaicGpuCompile failed "
                           "(set MOSAIC_GPU_DUMP_PTX=1 / MOSAIC_GPU_DUMP_MLIR_PASSES=1 to see why)")
    return res[0], _LAUNCH_T(res[1]), functools.partial(keeping_cuda_context, lib.MosaicGpuUnload, res)


def _device_launcher(device) -> Callable[[Callable, Any, Any], None]:
    """``run(launch, handle, ptrs)``: ``launch(handle, stream, ptrs)`` on torch's current stream of ``device``,
    in its context (``_DeviceLaunch``); off CUDA (tests' fake loaders), on stream 0."""
    import torch

    if device.type != "cuda":
        return lambda launch, handle, ptrs: launch(handle, 0, ptrs)
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return _DeviceLaunch(device.index, functools.partial(raw, device.index))
    return _DeviceLaunch(device.index, lambda: torch.cuda.current_stream(device).cuda_stream)


@functools.cache
def _device_run(index: int) -> Callable[[Callable, Any, Any], None]:
    """``run(launch, handle, ptrs)`` on torch's current stream of CUDA device ``index`` (``_DeviceLaunch``)."""
    import torch

    return _device_launcher(torch.device("cuda", index))


@functools.cache
def _copy_fns() -> Tuple[Callable, Callable]:
    lib = libcuda()
    copy, memset = lib.cuMemcpyDtoDAsync_v2, lib.cuMemsetD8Async
    copy.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    memset.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_void_p]
    copy.restype = memset.restype = ctypes.c_int
    return copy, memset


def _raw_copy(dst: int, stream, src_bytes) -> None:
    err = _copy_fns()[0](dst, src_bytes[0], src_bytes[1], stream)
    if err:
        raise RuntimeError(f"cuMemcpyDtoDAsync failed with CUDA error {err}")


def _raw_zero(dst: int, stream, nbytes: int) -> None:
    err = _copy_fns()[1](dst, 0, nbytes, stream)
    if err:
        raise RuntimeError(f"cuMemsetD8Async failed with CUDA error {err}")


class FrontBuffer:
    """A fixed 1-D tensor that a replay hook refills on torch's current stream: ``load(src, n)`` is
    ``dst[:n] = src[:n]`` and ``zero(start, stop)`` is ``dst[start:stop] = 0``. On a contiguous CUDA tensor a load
    from a contiguous tensor of its device and dtype is one ``cuMemcpyDtoDAsync`` (a torch ``copy_`` costs several
    times its host time) and a zero one ``cuMemsetD8Async``; others are torch ops (dtype conversions included).
    What depends on the destination alone (its address, element size, device launcher) is read once."""

    def __init__(self, dst):
        self.dst = dst
        self._raw = dst.is_cuda and dst.is_contiguous()
        if self._raw:
            self._run, self._ptr, self._size = _device_run(dst.device.index), dst.data_ptr(), dst.element_size()
            self._device, self._dtype = dst.device, dst.dtype

    def load(self, src, n: int) -> None:
        if n <= 0:
            return
        if self._raw and src.dtype == self._dtype and src.device == self._device and src.is_contiguous():
            self._run(_raw_copy, self._ptr, (src.data_ptr(), n * self._size))
        else:
            self.dst[:n].copy_(src[:n])

    def zero(self, start: int, stop: int) -> None:
        if stop <= start:
            return
        if self._raw:
            self._run(_raw_zero, self._ptr + start * self._size, (stop - start) * self._size)
        else:
            self.dst[start:stop].zero_()


class TorchKernel:
    """One compiled kernel for fixed argument shapes: ``kernel(*tensors, out=None, check=True)``."""

    def __init__(self, plan: KernelPlan, device, loader: Callable[[bytes, Any], Compiled] = cuda_loader):
        import torch

        self.plan, self.device, self._empty = plan, torch.device(device), torch.empty
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        compiled = loader(plan.module, self.device)
        self._handle, self._launch = compiled.handle, compiled.launch
        self._finalizer = weakref.finalize(self, compiled.unload)
        self._finalizer.atexit = False  # the process is ending: nothing to free, CUDA may be gone
        self._run = _device_launcher(self.device)
        self._device_index = self.device.index if self.device.type == "cuda" else -1
        self._torch_arg = [(tuple(s), getattr(torch, d)) for s, d in plan.arg_types]
        self._torch_out = [(tuple(s), getattr(torch, d)) for s, d in plan.out_types]
        self._owned = [torch.empty(o.shape, dtype=getattr(torch, o.dtype), device=self.device) if o.fill is None
                       else torch.full(o.shape, o.fill, dtype=getattr(torch, o.dtype), device=self.device)
                       for o in plan.owned]
        self._refill = [(t, o.fill) for t, o in zip(self._owned, plan.owned) if o.refill]
        self._ptrs = (ctypes.c_void_p * len(plan.buffers))()
        self._arg_pos = [(s.index, i) for i, s in enumerate(plan.buffers) if s.kind == "arg"]
        self._out_pos = [(s.index, i) for i, s in enumerate(plan.buffers) if s.kind == "out"]
        self._returns = [(s.kind == "arg", s.index) for s in plan.returns]
        for i, s in enumerate(plan.buffers):
            if s.kind == "own":
                self._ptrs[i] = self._owned[s.index].data_ptr()

    def _check(self, tensors: Sequence, expected, what: str) -> None:
        if len(tensors) != len(expected):
            raise ValueError(f"expected {len(expected)} {what} tensors, got {len(tensors)}")
        dev = self._device_index
        for i, (t, (shape, dtype)) in enumerate(zip(tensors, expected)):
            if (t.shape != shape or t.dtype is not dtype or t.get_device() != dev or not t.is_contiguous()
                    or t.data_ptr() % _ALIGN):
                raise ValueError(
                    f"{what}[{i}] is {tuple(t.shape)} {t.dtype} on {t.device} (contiguous={t.is_contiguous()}, "
                    f"address % {_ALIGN} = {t.data_ptr() % _ALIGN}); the kernel was compiled for a contiguous "
                    f"{shape} {dtype} tensor on {self.device} with a {_ALIGN}-byte aligned address"
                )

    def _prepare(self, ptrs, args, out, check: bool):
        """Check (optionally), write the pointers of ``args`` and the outputs into ``ptrs``; return the outputs."""
        if check:
            self._check(args, self._torch_arg, "argument")
        outs: Sequence[Any]  # torch tensors
        if out is None:
            outs = [self._empty(s, dtype=d, device=self.device) for s, d in self._torch_out]
        else:
            outs = (out,) if hasattr(out, "data_ptr") else tuple(out)
            if check:
                self._check(outs, self._torch_out, "out")
        arg_ptrs = [t.data_ptr() for t in args]
        for a, i in self._arg_pos:
            ptrs[i] = arg_ptrs[a]
        for o, i in self._out_pos:
            ptrs[i] = outs[o].data_ptr()
        return outs

    def _result(self, args, outs):
        res = tuple([args[i] if is_arg else outs[i] for is_arg, i in self._returns])
        return res[0] if self.plan.single else res

    def __call__(self, *args, out=None, check: bool = True):
        """Launch on torch's current stream; returns the function's outputs as torch tensors.

        Args:
          *args: one tensor per argument of the function (contiguous, on the kernel's device).
            An argument that the kernel aliases to an output is written in place.
          out: tensors for the returned outputs that are not written into an argument (one
            tensor or a sequence, in return order); None allocates them.
          check: verify shapes, dtypes, device, contiguity and alignment first. ``check=False``
            is the fast path for callers that pass the same kind of tensors every time.
        """
        outs = self._prepare(self._ptrs, args, out, check)
        for t, v in self._refill:
            t.fill_(v)
        self._run(self._launch, self._handle, self._ptrs)
        return self._result(args, outs)

    def bind(self, *args, out=None) -> "BoundLaunch":
        """Check once and fix the tensors (persistent buffers): the bound launch only reads the stream."""
        ptrs = (ctypes.c_void_p * len(self._ptrs))(*self._ptrs)
        outs = self._prepare(ptrs, args, out, True)
        return BoundLaunch(self, ptrs, self._result(args, outs), (args, outs))


class BoundLaunch:
    """A kernel with its tensors fixed (persistent buffers): ``bound()`` launches and returns outputs.

    ``set_arg`` / ``set_out`` repoint one argument or output (same shape and dtype, unchecked) for
    callers whose other tensors stay put, e.g. a new activation per call over fixed caches.
    """

    def __init__(self, kernel: TorchKernel, ptrs, result, keep_alive):
        self._kernel, self._ptrs, self.result, self._keep = kernel, ptrs, result, keep_alive
        self._launch, self._handle, self._run = kernel._launch, kernel._handle, kernel._run
        self._arg_slots = {a: [i for j, i in kernel._arg_pos if j == a] for a, _ in kernel._arg_pos}
        self._out_slots = {o: [i for j, i in kernel._out_pos if j == o] for o, _ in kernel._out_pos}

    def set_arg(self, index: int, tensor) -> None:
        for i in self._arg_slots[index]:
            self._ptrs[i] = tensor.data_ptr()

    def set_out(self, index: int, tensor) -> None:
        for i in self._out_slots[index]:
            self._ptrs[i] = tensor.data_ptr()

    def __call__(self):
        for t, v in self._kernel._refill:
            t.fill_(v)
        self._run(self._launch, self._handle, self._ptrs)
        return self.result


def as_structs(args) -> list:
    """``jax.ShapeDtypeStruct`` s for torch tensors (structs pass through): what ``plan_kernel`` takes."""
    return [a if isinstance(a, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(tuple(a.shape), jax_dtype(a.dtype))
            for a in args]


def compile_for_torch(fn: Callable, *arg_structs, device=None, loader=cuda_loader) -> TorchKernel:
    """Compile ``fn`` (one Mosaic GPU kernel call) for these argument shapes, to launch from torch.

    Args:
      fn: a JAX function of arrays that calls one ``plgpu.kernel`` (compiled, not interpreted).
      *arg_structs: one ``jax.ShapeDtypeStruct`` or torch tensor per argument.
      device: the CUDA device (default: the first tensor's device, else torch's current device).
      loader: compiles the serialized module (tests pass a fake one).

    Returns:
      A ``TorchKernel``: ``kernel(*tensors, out=None, check=True)`` launches on the current stream.
    """
    import torch

    if device is None:
        device = next((a.device for a in arg_structs if isinstance(a, torch.Tensor)), None)
        device = device if device is not None else torch.device("cuda", torch.cuda.current_device())
    return TorchKernel(plan_kernel(fn, *as_structs(arg_structs)), device, loader)


class MosaicLauncher:
    """``fn`` compiled once per (shapes, dtypes, device) of the torch tensors it is called with."""

    def __init__(self, fn: Callable, loader=cuda_loader):
        self.fn, self._loader = fn, loader
        self._kernels: dict = {}

    def kernel(self, *tensors) -> TorchKernel:
        """The compiled kernel for these tensors' shapes (compiled on first use)."""
        key = tuple((tuple(t.shape), t.dtype) for t in tensors) + (tensors[0].device if tensors else None,)
        k = self._kernels.get(key)
        if k is None:
            k = self._kernels[key] = compile_for_torch(self.fn, *tensors, loader=self._loader)
        return k

    def __call__(self, *tensors, out=None, check: bool = True):
        return self.kernel(*tensors)(*tensors, out=out, check=check)
