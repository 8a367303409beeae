"""Zero-copy torch <-> JAX hand-off with stream ordering.

Import (torch -> JAX): ``torch.Tensor.__dlpack__(stream=s)`` is called with the stream JAX uses
for external ready events, so torch records an event on its *current* stream and makes ``s``
wait on it; the imported buffer's definition event then orders JAX's computation after every
torch kernel queued so far on torch's current stream (including KV-pool writes queued before
the import). Without a stream (CPU) torch's work is already complete.

Export (JAX -> torch): ``torch.from_dlpack(jax_array)`` passes torch's current stream to
``jax.Array.__dlpack__``, which makes that stream wait until the array is ready (on CPU it blocks
until the computation finished). The exported tensor is therefore safe on torch's current stream.

On CUDA both directions skip the Python wrappers of ``__dlpack__`` / ``torch.from_dlpack`` (they cost
tens of microseconds per call, per layer): the import makes JAX's stream wait on torch's current stream
through one reused event, then hands the raw capsule to jaxlib; the export asks jaxlib for a capsule
that is ready on torch's current stream. The ordering is the same as the wrappers'.

Persistent tensors (KV pools, ``req_to_token``, sinks) are imported once and their views cached by
``(data_ptr, shape, strides, dtype, device)``; JAX only ever reads them (no donation), so torch
keeps ownership. The cache holds the DLPack capsule, which keeps the torch storage alive.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Callable, Dict, Optional, Tuple

import jax
import torch

from jax_attn.kernels.config import cdiv
from jax_attn.safety import INT32_MAX, INT32_MIN

try:  # the fast path skips jax.dlpack.from_dlpack's Python checks (~10 us instead of ~80 us)
    from jax._src import xla_bridge as _xla_bridge
    from jax._src.lib import _jax as _jaxlib
except ImportError:  # pragma: no cover - other jax versions
    _xla_bridge = _jaxlib = None

_KDL_CPU, _KDL_CUDA = 1, 2
RECENT = 64  # 1-D index tensors whose views ``Importer.recent_view`` keeps
_CPU_ALIGN = 64


def capturing() -> bool:
    """Whether torch's current CUDA stream is capturing a CUDA graph. A capture needs CUDA initialized, and
    ``torch.cuda.is_initialized`` costs a tenth of ``is_available`` (which reads the environment: about 1.7
    µs a call on an H200 host, paid by every layer of an eager step over a graph bucket)."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def check_not_capturing() -> None:
    """Raise if torch is capturing a CUDA graph: a JAX computation cannot be captured."""
    if capturing():
        raise RuntimeError(
            "torch_bridge attention was called inside an active torch.cuda.graph capture. JAX "
            "computations cannot be captured into a torch CUDA graph, and the graph would silently "
            "skip attention. Run attention outside the captured region: disable CUDA graphs in the "
            "engine (SGLang: --disable-cuda-graph) and use the bridge's capture/replay hooks, which "
            "compile per batch bucket ahead of time instead."
        )


def device_index(device: torch.device) -> int:
    """The CUDA ordinal of a torch device (``cuda`` alone: torch's current device, as torch reads it); 0 for
    the CPU."""
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def libcuda():
    return ctypes.CDLL("libcuda.so.1")


def keeping_cuda_context(fn: Callable, *args):
    """``fn(*args)`` with this thread's current CUDA context restored after it. CUDA calls of other libraries
    leave the context of their device current: JAX's GPU client, created at JAX's first use, leaves its last
    GPU's, and unloading a kernel leaves its device's. Torch's ``current_device()`` follows the current
    context, so on a host with several GPUs a later ``device="cuda"`` tensor would land on the wrong one."""
    lib, ctx = libcuda(), ctypes.c_void_p()
    lib.cuCtxGetCurrent(ctypes.byref(ctx))
    try:
        return fn(*args)
    finally:
        lib.cuCtxSetCurrent(ctx)


def jax_device_for(device: torch.device):
    """The JAX device whose memory is ``device``'s: for ``cuda:i``, JAX's CUDA device of local hardware id
    ``i`` (a tensor-parallel rank's ``cuda:1`` is not ``jax.devices()[0]``), for the CPU JAX's CPU device.
    Everything the bridge runs in JAX follows it: the imported views are committed there, and executables
    compile for the device of their committed arguments. None without jaxlib's internals (other jax versions)."""
    if _xla_bridge is None:
        return None
    device = torch.device(device)
    if device.type == "cuda":  # the first call creates JAX's GPU client
        backend = keeping_cuda_context(_xla_bridge.get_backend, "cuda")
    else:
        backend = _xla_bridge.get_backend("cpu")
    return backend.device_from_local_hardware_id(device_index(device))


class Importer:
    """Imports torch tensors of one device into JAX without copying, stream-ordered."""

    def __init__(self, device: torch.device):
        device = torch.device(device)
        self.dl_type = _KDL_CUDA if device.type == "cuda" else _KDL_CPU
        index = device_index(device)
        self.stream: Optional[int] = None
        self.jax_device = jax_device_for(device)
        if self.jax_device is not None:
            try:
                self.stream = self.jax_device.get_stream_for_external_ready_events()
            except Exception:  # UNIMPLEMENTED on CPU
                self.stream = None
        self._views: Dict[Tuple, jax.Array] = {}
        self._recent: Dict[Tuple, jax.Array] = {}  # recent_view's, least recently used first
        self._twin: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # table_view's (table, aligned copy)
        self._order = _StreamOrder(self.stream, index) if self.stream is not None and device.type == "cuda" else None

    def __call__(self, t: torch.Tensor, ordered: bool = False) -> jax.Array:
        """A JAX view of ``t`` (contiguous), ordered after work queued on torch's current stream
        (``ordered``: an import made just before, with no torch work queued since, ordered it already)."""
        if self.dl_type == _KDL_CPU and t.data_ptr() % _CPU_ALIGN:
            t = t.clone()  # XLA's CPU client views only 64-byte aligned memory (torch allocates so)
        if self.jax_device is None:
            return jax.dlpack.from_dlpack(t, copy=False)
        if self._order is not None:  # what t.__dlpack__(stream=self.stream) does, without its Python checks
            if not ordered:
                self._order.after_torch()
            capsule = torch._C._to_dlpack(t.detach() if t.requires_grad else t)
        else:
            capsule = t.__dlpack__(stream=self.stream) if self.stream is not None else t.__dlpack__()
        return _jaxlib.dlpack_managed_tensor_to_buffer(capsule, self.jax_device, self.stream, False,
                                                        self.dl_type)

    def many(self, tensors) -> list:
        """``[self(t) for t in tensors]``, ordered after torch's current stream once."""
        return [self(t, ordered=i > 0) for i, t in enumerate(tensors)]

    def export(self, x: jax.Array) -> torch.Tensor:
        """JAX array -> torch tensor (zero copy), ready for use on torch's current stream."""
        if self._order is None:
            return torch.from_dlpack(x)
        capsule = _jaxlib.buffer_to_dlpack_managed_tensor(x.addressable_data(0), stream=self._order.torch_stream())
        return torch._C._from_dlpack(capsule)

    def view(self, t: torch.Tensor, strict: bool = True) -> jax.Array:
        """The cached JAX view of a persistent tensor (imported on first use only).

        ``strict=False`` (small read-only parameters such as sinks): a tensor that cannot be
        viewed in place is imported per call instead of raising.
        """
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device)
        v = self._views.get(key)
        if v is None:
            aligned = self.dl_type != _KDL_CPU or t.data_ptr() % _CPU_ALIGN == 0
            if not strict and not (aligned and t.is_contiguous()):
                return self(t.contiguous())
            if not t.is_contiguous():
                raise ValueError(f"{t.shape=} with strides {t.stride()} must be contiguous to be viewed "
                                 "zero-copy; allocate the pool as one dense tensor per layer")
            if self.dl_type == _KDL_CPU and t.data_ptr() % _CPU_ALIGN:
                raise ValueError(f"a persistent CPU buffer at {t.data_ptr():#x} is not {_CPU_ALIGN}-byte "
                                 "aligned, so JAX cannot view it; allocate it with torch (e.g. .clone())")
            v = self(t)
            if t.numel() and v.unsafe_buffer_pointer() != t.data_ptr():
                raise RuntimeError("DLPack import copied a persistent buffer; in-place writes would be lost")
            self._views[key] = v
        return v

    def table_view(self, t: torch.Tensor) -> jax.Array:
        """``view(t)`` of a table the engine edits in place (``req_to_token``). A CPU tensor that JAX cannot
        view in place (not 64-byte aligned, e.g. ``torch.from_numpy``) is copied into an aligned twin on
        every call instead, so each plan still reads the engine's latest edits."""
        if self.dl_type != _KDL_CPU or t.data_ptr() % _CPU_ALIGN == 0:
            return self.view(t)
        if self._twin is None or self._twin[0] is not t:  # an engine's one table (a new one replaces it)
            with torch.inference_mode(False):
                self._twin = (t, torch.empty(t.shape, dtype=t.dtype))  # torch aligns to 64 B
        self._twin[1].copy_(t)
        return self.view(self._twin[1])

    def recent_view(self, t: torch.Tensor) -> jax.Array:
        """A JAX view of ``t`` kept for its next calls while it is among the ``RECENT`` most recent (an
        engine's static index buffer, passed again every replay). Reading a kept view is not ordered after
        torch's stream: call it after an import of the same step (``many``), which orders the computation."""
        key = (t.data_ptr(), t.shape[0], t.dtype)
        v = self._recent.pop(key, None)
        if v is None:
            if not t.is_contiguous() or t.dim() != 1 or (self.dl_type == _KDL_CPU and t.data_ptr() % _CPU_ALIGN):
                return self(t)  # a copy would be read stale later: imported per call
            v = self(t, ordered=True)
            if len(self._recent) >= RECENT:
                self._recent.pop(next(iter(self._recent)))  # the least recently used
        self._recent[key] = v
        return v

    def index_view(self, t: torch.Tensor) -> jax.Array:
        """A persistent 1-D index tensor (``full_to_swa_index_mapping``) viewed once: int64 as its int32 word
        pairs ``[n, 2]`` (narrowed, saturating, where it is read), int32 as it is; other dtypes are
        converted per call (a copy)."""
        if t.dtype == torch.int64 and t.is_contiguous():
            return self.view(t.view(torch.int32).view(-1, 2))
        if t.dtype == torch.int32 and t.is_contiguous():
            return self.view(t)
        return self(narrow_int32(t).contiguous())

    def clear(self) -> None:
        """Forget cached views (after the engine reallocates its pools)."""
        self._views.clear()
        self._recent.clear()


class _StreamOrder:
    """Orders JAX's stream for external ready events after torch's current stream with one reused event
    (``cudaStreamWaitEvent`` takes the event's state when it is called, so re-recording it later is safe)."""

    def __init__(self, stream: int, index: int):
        self.index, self.jax_raw = index, stream
        self.jax_stream = torch.cuda.ExternalStream(stream, device=torch.device("cuda", index))
        self.event = torch.cuda.Event()
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._raw = (lambda: raw(index)) if raw is not None else (lambda: torch.cuda.current_stream(index).cuda_stream)
        self._streams: Dict[int, torch.cuda.Stream] = {}  # raw handle -> torch's stream object (one per handle)

    def torch_stream(self) -> int:
        """The raw handle of torch's current stream on this device."""
        return self._raw()

    def after_torch(self) -> None:
        raw = self._raw()
        if raw == self.jax_raw:
            return
        current = self._streams.get(raw)
        if current is None:  # a Stream object only names its handle, so one per handle serves every call
            if len(self._streams) >= 16:
                self._streams.clear()
            current = self._streams[raw] = torch.cuda.current_stream(self.index)
        self.event.record(current)
        self.jax_stream.wait_event(self.event)


def narrow_int32(x: torch.Tensor) -> torch.Tensor:
    """Any int tensor as int32 without wrapping: values outside int32 saturate (on the device, no sync)
    to a bound no pool, table or length can have, so the plan's error flag reports them."""
    if x.dtype == torch.int32:
        return x
    return x.clamp(INT32_MIN, INT32_MAX).to(torch.int32)


def pad_int32(x: torch.Tensor, size: int, fill: int) -> torch.Tensor:  # [n] -> i32[size]
    """Flatten to int32 and pad with ``fill`` up to ``size`` entries (bucket padding, in torch)."""
    x = narrow_int32(x.reshape(-1))
    if x.shape[0] > size:
        raise ValueError(f"{x.shape[0]} entries do not fit the bucket of {size}; capture a larger bucket")
    if x.shape[0] == size:
        return x
    return torch.cat([x, torch.full((size - x.shape[0],), fill, dtype=torch.int32, device=x.device)])


def pack_mask_words(mask: Optional[torch.Tensor], num_bytes: int, device) -> torch.Tensor:
    """A flat boolean mask as ``i32[ceil(num_bytes / 4)]`` words (zero-padded or cut to ``num_bytes``).

    Four mask bytes travel in one int32 word so the mask joins the step's single packed import;
    the planner bit-casts the words back to bytes (both sides little-endian). ``None`` packs zeros.
    """
    words = cdiv(num_bytes, 4)
    buf = torch.zeros(words * 4, dtype=torch.uint8, device=device)
    if mask is not None:
        m = mask.reshape(-1)
        m = m.view(torch.uint8) if m.dtype == torch.bool else (m != 0).view(torch.uint8)
        n = min(int(m.shape[0]), words * 4)
        buf[:n] = m[:n]
    return buf.view(torch.int32)


def export(x: jax.Array) -> torch.Tensor:
    """JAX array -> torch tensor (zero copy), ready for use on torch's current stream (``Importer.export``
    is the same without the Python wrappers)."""
    return torch.from_dlpack(x)
