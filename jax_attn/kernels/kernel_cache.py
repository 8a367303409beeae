"""Mosaic GPU kernels built once per process, and kept across processes with the compile cache.

Pallas builds a Mosaic GPU kernel while lowering its call: it traces the body and lowers it to a
Mosaic module in Python (mostly Mosaic's layout inference: about 4 s for the decode attention
kernel on one CPU core), embedded in a ``mosaic_gpu_v2`` custom call. jaxlib compiles that module
to GPU code when the executable is loaded, once per distinct module (keyed by its hash) in a
process. Two things defeated that sharing: a ``plgpu.kernel`` made per call site is a new jaxpr,
lowered again; and every lowering stamps its module with a process-wide counter
(``mosaic_gpu.dump_basename``), so identical kernels hash differently and compile again. A 16-layer
model built its one attention kernel 16 times (issue 21).

``mosaic_call(make, *key, out_shapes=...)`` runs ``make(*key)`` (a compiled ``plgpu.kernel``) through
a primitive whose CUDA lowering emits the kernel's custom call from a cache keyed by
``(make, key, argument types)``. The first lowering in a process lowers the kernel alone (its own
``jax.jit``) and keeps its custom call (attributes as MLIR text); every later call site, executable
and weight layout reuses it, so all carry the same module bytes and jaxlib compiles the kernel
once. While the persistent compile cache is on (``jax_attn.compile_cache.kernel_dir``) the custom
call is also kept on disk, keyed by the jax/jaxlib versions, the sources of this package's kernels,
the key and the GPU architecture: a later process skips the Python lowering as well. A kernel whose
lowering is more than one custom call over the arguments is not cached (its own lowering runs at
every call site, as before). The primitive has no batching rule (no ``vmap``).

``stats()`` counts builds (Python lowerings), disk and memory hits per kernel; tests check that an
N-layer model builds its kernel once.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Callable, Iterable, Optional

import jax
import jax.extend as jex
from jax._src import dispatch, source_info_util  # jax internals (pinned jax 0.11.2, as torch_bridge.launcher)
from jax._src.interpreters import mlir
from jax._src.lib.mlir import ir

CALL_TARGET = "mosaic_gpu_v2"
FORMAT = 1  # of the disk entries

# Not a user frame in source locations: the kernels' ops point at their own lines, not at this module.
source_info_util.register_exclusion(os.path.abspath(__file__))


@dataclasses.dataclass(frozen=True)
class KernelBuild:
    """How to make one kernel: ``make(*key)`` returns the compiled ``plgpu.kernel`` callable.
    ``make`` is a module-level function and ``key`` a hashable tuple with a stable ``repr``."""

    make: Callable
    key: tuple

    @property
    def name(self) -> str:
        return f"{self.make.__module__}.{self.make.__qualname__}"

    def flat(self) -> Callable:
        """The kernel as a function returning a flat tuple of arrays."""
        fn = self.make(*self.key)
        return lambda *args: tuple(jax.tree.leaves(fn(*args)))


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """A kernel's custom call without its MLIR context: attribute and result types as text."""

    attributes: tuple  # ((name, MLIR text), ...)
    result_types: tuple  # (MLIR text, ...)


def mosaic_call(make: Callable, *key, out_shapes) -> Callable:
    """``make(*key)`` as a function of arrays whose kernel is built once per process (module docstring).

    Args:
      make: a module-level function; ``make(*key)`` returns a compiled (not interpreted)
        ``plgpu.kernel`` callable.
      *key: its hashable arguments (frozen dataclasses, ints, tuples), with a stable ``repr``.
      out_shapes: the kernel's outputs, a pytree of ``jax.ShapeDtypeStruct`` (its ``out_type``).
    """
    build = KernelBuild(make, key)
    leaves, tree = jax.tree.flatten(out_shapes)
    out_avals = tuple(jax.core.ShapedArray(s.shape, s.dtype) for s in leaves)

    def call(*args):
        return jax.tree.unflatten(tree, _kernel_p.bind(*args, build=build, out_avals=out_avals))
    return call


# ---- the primitive --------------------------------------------------------------------------
_kernel_p = jex.core.Primitive("jax_attn_mosaic_kernel")
_kernel_p.multiple_results = True
_kernel_p.def_impl(functools.partial(dispatch.apply_primitive, _kernel_p))
_kernel_p.def_abstract_eval(lambda *avals, build, out_avals: out_avals)


def _lower_own(ctx, *args, build: KernelBuild, out_avals):
    """The kernel's own (Pallas) lowering, uncached."""
    return mlir.lower_fun(build.flat(), multiple_results=True)(ctx, *args)


def _lower_cuda(ctx, *args, build: KernelBuild, out_avals):
    call = None if ctx.is_forward_compat() else kernel_call_for(build, ctx.avals_in)
    if call is None:
        return _lower_own(ctx, *args, build=build, out_avals=out_avals)
    _compile_ahead(build, ctx.avals_in, out_avals)
    op = ir.Operation.create("stablehlo.custom_call", results=[ir.Type.parse(t) for t in call.result_types],
                             operands=list(args),
                             attributes={name: ir.Attribute.parse(text) for name, text in call.attributes})
    return list(op.results)


mlir.register_lowering(_kernel_p, _lower_own)
mlir.register_lowering(_kernel_p, _lower_cuda, platform="cuda")


# ---- the caches -------------------------------------------------------------------------------
_lock = threading.Lock()
_calls: dict = {}  # (build, argument types) -> KernelCall, or None: not cacheable
_key_locks: dict = {}
_stats: collections.Counter = collections.Counter()  # (event, kernel name) -> count


def stats() -> dict:
    """Counts since the last ``reset()``: ``{(event, kernel name): n}`` with events ``build`` (a
    Python lowering of the kernel), ``disk`` (loaded from the compile cache), ``memory`` (reused in
    this process), ``uncacheable``, and ``ahead`` / ``ahead_failed`` (its GPU code compiled ahead)."""
    with _lock:
        return dict(_stats)


def builds(name_part: str = "") -> int:
    """Python lowerings so far of kernels whose name contains ``name_part``."""
    return sum(n for (event, name), n in stats().items() if event == "build" and name_part in name)


def reset() -> None:
    """Forget this process's built kernels and counts (tests; the disk cache stays)."""
    with _lock:
        _calls.clear()
        _key_locks.clear()
        _stats.clear()
        _ahead.clear()


def _types(avals) -> tuple:
    return tuple((tuple(a.shape), str(a.dtype)) for a in avals)


def kernel_call_for(build: KernelBuild, avals_in) -> Optional[KernelCall]:
    """The kernel's custom call for these argument types: from this process, the disk, or a build."""
    types = _types(avals_in)
    key = (build, types)
    with _lock:
        if key in _calls:
            _stats["memory", build.name] += 1
            return _calls[key]
        key_lock = _key_locks.setdefault(key, threading.Lock())
    with key_lock:  # one build per kernel when threads lower the same kernel at once
        with _lock:
            if key in _calls:
                _stats["memory", build.name] += 1
                return _calls[key]
        text = _key_text(build, types)
        call = _disk_load(text)
        event = "disk"
        if call is None:
            call = _build(build, types)
            event = "build" if call is not None else "uncacheable"
            if call is not None:
                _disk_store(text, call)
        with _lock:
            _calls[key] = call
            _stats[event, build.name] += 1
    return call


def _build(build: KernelBuild, types) -> Optional[KernelCall]:
    """Lower the kernel alone for CUDA and take its one custom call (None if it is not just that)."""
    structs = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in types]
    # Outside the call site's source context (a lowering rule runs inside it): the kernel's ops keep
    # their own source locations.
    with source_info_util.user_context(None, name_stack=source_info_util.NameStack()):
        traced = jax.jit(build.flat(), keep_unused=True).trace(*structs)
        module = traced.lower(lowering_platforms=("cuda",)).compiler_ir()
    found = []

    def visit(op):
        op = op.operation
        if op.name == "stablehlo.custom_call" and ir.StringAttr(op.attributes["call_target_name"]).value == CALL_TARGET:
            found.append(op)
        return ir.WalkResult.ADVANCE

    module.operation.walk(visit)
    if len(found) != 1:
        return None
    op = found[0]
    params = list(op.parent.regions[0].blocks[0].arguments)  # the function the call sits in
    if len(params) != len(types) or [o for o in op.operands] != params:
        return None  # the call takes more than the kernel's arguments (scratch buffers, constants)
    return KernelCall(attributes=tuple((name, str(op.attributes[name])) for name in op.attributes),
                      result_types=tuple(str(r.type) for r in op.results))


# ---- GPU code compiled ahead, in a thread ---------------------------------------------------------
# XLA runs a custom call's instantiate stage when it builds the executable's thunks, at compile time;
# there the CUDA plugin compiles the kernel's GPU code (seconds) and keeps it, by the hash of its module,
# for every later executable of the process. Compiling the kernel alone as soon as its custom call is
# known therefore takes that compile off the path of the executable being lowered (the rest of its
# lowering and XLA's compile run meanwhile).
_ahead: set = set()  # (build, argument types) whose GPU code this process compiles or compiled ahead
AHEAD_THREAD = "jax_attn compile ahead: "  # the threads' names (``wait_ahead``)
_local = threading.local()


@contextlib.contextmanager
def module_only():
    """Lowerings inside only want the kernel's module (the torch launcher compiles it itself): no GPU
    code is compiled ahead for them."""
    before = getattr(_local, "module_only", False)
    _local.module_only = True
    try:
        yield
    finally:
        _local.module_only = before


def wait_ahead() -> None:
    """Wait for the GPU code compiles started ahead. A torch engine calls this before a CUDA-graph capture
    (``torch_bridge``'s capture hook): a compile loads modules, which a capture in CUDA's global mode
    forbids to every thread."""
    for t in threading.enumerate():
        if t.name.startswith(AHEAD_THREAD):
            t.join()


def _on_cuda() -> bool:
    """Whether this process runs on a GPU (the devices, not ``jax.default_backend``, which tests that trace
    compiled kernels on a CPU patch)."""
    return jax.devices()[0].platform == "gpu"


def _compile_ahead(build: KernelBuild, avals_in, out_avals) -> None:
    """Once per kernel and process, on a CUDA backend: compile the kernel alone in a thread."""
    if getattr(_local, "module_only", False) or not _on_cuda():
        return
    key = (build, _types(avals_in))
    with _lock:
        if key in _ahead:
            return
        _ahead.add(key)
    structs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals_in]
    threading.Thread(target=_compile_alone, args=(build, structs, out_avals), name=AHEAD_THREAD + build.name).start()


def _compile_alone(build: KernelBuild, structs, out_avals) -> None:
    def kernel(*args):
        return _kernel_p.bind(*args, build=build, out_avals=out_avals)
    try:
        jax.jit(kernel, keep_unused=True).lower(*structs).compile()
    except Exception:  # noqa: BLE001 - ahead of time only: the executable that carries it compiles it then
        with _lock:
            _stats["ahead_failed", build.name] += 1
        return
    with _lock:
        _stats["ahead", build.name] += 1


# ---- builds in worker processes ------------------------------------------------------------------
def kernels_in(jaxpr) -> list:
    """``(build, argument types)`` of every cached Mosaic kernel called in ``jaxpr`` (a traced step's
    ``jax.stages.Traced.jaxpr``), sub-jaxprs (scan bodies, nested jits) included, first seen first."""
    found: dict = {}  # insertion-ordered set
    stack = [jaxpr if hasattr(jaxpr, "eqns") else jaxpr.jaxpr]
    while stack:
        for eqn in stack.pop().eqns:
            if eqn.primitive is _kernel_p:
                found.setdefault((eqn.params["build"], _types(v.aval for v in eqn.invars)), None)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if isinstance(sub, (jex.core.ClosedJaxpr, jex.core.Jaxpr)):
                        stack.append(sub if hasattr(sub, "eqns") else sub.jaxpr)
    return list(found)


# A prebuild worker's program (``python -c``: running this module with ``-m`` would import it twice, the
# package importing it first, and warn).
_WORKER = "import sys; from jax_attn.kernels import kernel_cache; kernel_cache._worker(*sys.argv[1:3])"


def prebuild(kernels: Iterable, *, workers: Optional[int] = None) -> int:
    """Build the kernels this process has not built yet (``kernels_in`` pairs), in parallel processes.

    A kernel's Python lowering holds the GIL, so kernels lowered while tracing or lowering a step are
    built one after another; here each worker process (JAX on its CPU: lowering for CUDA needs no GPU)
    builds a share of them at once, and this process takes their custom calls (and keeps them on disk
    with the compile cache on). Only for Hopper (the architecture a CPU-only lowering assumes); else,
    or for fewer than two kernels, nothing is done (each kernel is built when lowered). Returns the
    number of kernels built by workers.
    """
    todo = [(b, t) for b, t in dict.fromkeys(kernels) if not _known(b, t)]
    workers = min(workers or os.cpu_count() or 1, len(todo))
    if workers < 2 or _arch() != repr((9, 0)):
        return 0
    tmp = tempfile.mkdtemp(prefix="jax_attn_prebuild_")  # mode 0700
    try:
        env = dict(os.environ, JAX_PLATFORMS="cpu", CUDA_VISIBLE_DEVICES="",
                   PYTHONPATH=os.pathsep.join([_package_root(), os.environ.get("PYTHONPATH", "")]))
        procs = []
        for w in range(workers):
            inp, out = os.path.join(tmp, f"{w}.in"), os.path.join(tmp, f"{w}.out")
            with open(inp, "wb") as f:
                pickle.dump(todo[w::workers], f)
            procs.append((todo[w::workers], out, subprocess.Popen(
                [sys.executable, "-c", _WORKER, inp, out], env=env, stdout=subprocess.DEVNULL)))
        built = 0
        for share, out, proc in procs:
            if proc.wait() != 0 or not os.path.exists(out):
                continue  # left to the lowering, in this process
            with open(out, "rb") as f:
                calls = pickle.load(f)
            for (build, types), call in zip(share, calls):
                _remember(build, types, call, "build" if call is not None else "uncacheable")
                built += call is not None
        return built
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _known(build: KernelBuild, types) -> bool:
    """In this process already, or loaded now from the disk cache."""
    with _lock:
        if (build, types) in _calls:
            return True
    text = _key_text(build, types)
    call = _disk_load(text)
    if call is not None:
        _remember(build, types, call, "disk", store=False)
    return call is not None


def _remember(build, types, call, event: str, store: bool = True) -> None:
    with _lock:
        _calls.setdefault((build, types), call)
        _stats[event, build.name] += 1
    if store and call is not None:
        _disk_store(_key_text(build, types), call)


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _worker(inp: str, out: str) -> None:
    """A prebuild worker (``_WORKER IN OUT``): build the pickled kernels, pickle their calls."""
    with open(inp, "rb") as f:
        todo = pickle.load(f)
    calls = [_build(build, types) for build, types in todo]
    with open(out + ".tmp", "wb") as f:
        pickle.dump(calls, f)
    os.replace(out + ".tmp", out)


# ---- disk -----------------------------------------------------------------------------------------
@functools.cache
def _sources_digest() -> str:
    """sha256 of this package's kernel sources (a kernel's code changes: its entries are not found)."""
    h = hashlib.sha256()
    here = os.path.dirname(os.path.abspath(__file__))
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            with open(os.path.join(here, name), "rb") as f:
                h.update(name.encode() + b"\0" + f.read() + b"\0")
    return h.hexdigest()


def _arch() -> str:
    try:
        from jax.experimental.mosaic.gpu import utils as mgpu_utils

        return repr(mgpu_utils._infer_arch())  # what the lowering writes into the module
    except Exception as e:  # noqa: BLE001 - a key part, never an error
        return f"unknown ({type(e).__name__})"


def _key_text(build: KernelBuild, types) -> str:
    import jaxlib

    env = sorted((k, v) for k, v in os.environ.items() if k.startswith("MOSAIC_GPU"))
    flags = sorted((k, repr(v)) for k, v in jax.config.values.items() if "mosaic" in k or "pallas" in k)
    return json.dumps([FORMAT, jax.__version__, jaxlib.__version__, _sources_digest(), build.name, repr(build.key),
                       types, _arch(), env, flags])


def _disk_path(text: str) -> Optional[str]:
    from jax_attn.compile_cache import kernel_dir

    root = kernel_dir()
    return None if root is None else os.path.join(root, hashlib.sha256(text.encode()).hexdigest() + ".json")


def _disk_load(text: str) -> Optional[KernelCall]:
    path = _disk_path(text)
    if path is None or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            entry = json.load(f)
        if entry.get("key") != text:
            return None
        return KernelCall(attributes=tuple((n, t) for n, t in entry["attributes"]),
                          result_types=tuple(entry["result_types"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # unreadable or from another format: built again and rewritten


def _disk_store(text: str, call: KernelCall) -> None:
    path = _disk_path(text)
    if path is None:
        return
    entry = dict(key=text, attributes=[list(a) for a in call.attributes], result_types=list(call.result_types))
    try:
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")  # mode 0600
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f)
        os.replace(tmp, path)
    except OSError:
        pass  # a full or read-only disk costs the next process a build, nothing else
