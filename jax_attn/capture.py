"""Capture / replay: one ahead-of-time compiled executable per (plan key, bucket).

The JAX counterpart of SGLang's CUDA-graph runner. A *step function*
``step_fn(md, token_inputs, *args) -> (token_outputs, other_outputs)`` (a whole model step, or a
single attention call) is composed with the planner, padded to a batch bucket and compiled once:

    runner = StepRunner(backend, step_fn, donate_argnums=(1,))
    runner.capture(example_batch_for(bs) for bs in (1, 2, 4, 8), token_inputs, *args)
    token_out, other_out = runner.replay(batch, token_inputs, *args)

``token_inputs`` / ``token_outputs`` are pytrees whose leaves have the token axis first; replay
pads them (zeros) and slices the outputs back. Uniform modes (decode, verify, draft extend) pad to a
batch bucket; with ``token_buckets``, ragged extend batches pad to a batch and a token bucket and are
captured and replayed the same way (as SGLang's piecewise graphs serve prefill), so an engine loop
compiles nothing after its capture. Replay and the eager path run the same function.
A step's host inputs travel in one transfer: the plan's int32 batch fields and every token input
that is a host (numpy) int32 array, such as positions, are packed into one vector (``pack_step``);
device arrays (ids sampled on the device) are passed as they are, and one executable takes either.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import sys
import time
from typing import Any, Callable, Iterable, Optional, Sequence, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from jax_attn import compile_cache
from jax_attn.backend import FlashAttentionBackend
from jax_attn.plan_key import PlanKey, batch_arrays, plan_arrays
from jax_attn.batch import DEFAULT_BATCH_BUCKETS, ForwardBatch, bucket_for, pad_batch
from jax_attn.metadata import ForwardMode
from jax_attn.kernels import kernel_cache
from jax_attn.progress import Progress


@dataclasses.dataclass(frozen=True)
class CaptureReport:
    """What ``StepRunner.capture`` took."""

    buckets: int
    seconds: float  # wall time of the whole capture
    lower_s: float  # tracing, kernel builds and lowering, summed (on the calling thread)
    compile_s: float  # XLA compiles (with the Mosaic kernels' GPU code), summed over the threads


def _pad_tokens(tree, num_tokens: int):
    """Zero-pad (or, for capture examples, cut) every leaf's token axis to ``num_tokens``.

    Host (numpy) leaves are padded on the host, so a step's inputs cost one transfer, not a
    device dispatch per leaf.
    """
    def pad(x):
        if x.shape[0] == num_tokens:  # already at the bucket: no slice dispatch for device arrays
            return x
        xp = np if isinstance(x, np.ndarray) else jnp
        x = x[:num_tokens]
        extra = num_tokens - x.shape[0]
        return x if extra == 0 else xp.concatenate([x, xp.zeros((extra,) + x.shape[1:], x.dtype)])
    return jax.tree.map(pad, tree)


class StepRunner:
    """Compiled executables per bucket for one step function (see module docstring).

    Args:
      backend: the planning backend (page size, request table, planner choice).
      step_fn: ``step_fn(md, token_inputs, *args) -> (token_outputs, other_outputs)``.
      batch_buckets: padded batch sizes; a larger batch runs eagerly (said once).
      token_buckets: padded token counts of extend / mixed batches (rows padded to ``batch_buckets``):
        such a batch of at most the last bucket's tokens pads to (batch bucket, token bucket) and can be
        captured; without them (the default), extends run ``eager``, one executable per distinct shape.
      donate_argnums: indices into ``args`` (e.g. the KV pools) donated to the executable.
      compiler_options: XLA options for every executable of this runner.
      command_buffers: let XLA record the kernels of each executable into command buffers (CUDA
        graphs; the default). ``False`` launches them one by one (GPU only; ``benchmarks/RESULTS.md``,
        H100, 1B-class decode step at batch 64): back-to-back steps with no host work between them
        leave the GPU idle 50-72 us per step instead of 95-187, but the executable call then holds
        the host thread until the step's kernels are done, so a loop that does host work per step
        is slower (the example's overlap loop: 8.54 ms/step against 6.92).
      compile_cache: ``capture`` turns on the persistent compilation cache (``jax_attn.compile_cache``:
        per-user directory, ``JAX_ATTN_COMPILE_CACHE=0`` opts out).
      eager_compiler_options: XLA options added for ``eager`` (an executable per distinct batch shape,
        such as each ragged prefill, that is typically run a few times). Default on a GPU
        (``EAGER_GPU_OPTIONS``): no Triton GEMM autotuning, cuBLAS GEMMs instead. ``{}`` compiles eager
        calls like the captured buckets. On an H100 (1B-class step, 16 layers, ``benchmarks/RESULTS.md``)
        a cold prefill compiled in 4.2-4.9 s instead of 7.2-8.9 s; its step ran 0.96x the time at 1024 and
        4096 tokens, and 1.39x at 91 tokens (4.3 ms instead of 3.1 ms, once per such prefill).
      static_buffers: replay like a CUDA graph with static input and output buffers: each bucket
        keeps device buffers for its step inputs and token outputs; a replay first writes the new
        inputs into them (one small call), then runs the executable with the outputs donated back
        into the same buffers. Every buffer of a replay then keeps its address, so XLA's command
        buffers (CUDA graphs) replay without being updated. Token outputs returned for a full
        bucket *are* those buffers: they stay valid until the next replay of that bucket (copy
        them, e.g. to the host, before it), as with SGLang's graph outputs. The write waits on the host
        for the bucket's previous step to finish (its buffers are donated while that step reads them),
        so a loop that queues steps ahead loses its overlap: on an H200 (``benchmarks/RESULTS.md``,
        2026-11-29, 1B-class step at batch 64) that write returned after 4.7 ms, the previous step's
        time, when issued behind it, and after 0.4 ms in a blocking loop. Use it for blocking loops.
    """

    def __init__(self, backend: FlashAttentionBackend, step_fn: Callable, *,
                 batch_buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS, token_buckets: Sequence[int] = (),
                 donate_argnums: Sequence[int] = (),
                 compiler_options: Optional[dict] = None, command_buffers: bool = True,
                 static_buffers: bool = False, compile_cache: bool = True,
                 eager_compiler_options: Optional[dict] = None):
        self.backend = backend
        self.compile_cache = compile_cache
        compiler_options = _with_command_buffers(compiler_options, command_buffers)
        self.step_fn = step_fn
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.token_buckets = tuple(sorted(token_buckets))
        # Positional layout of _full: (key, StepLayout, req_to_token, packed host inputs, token arguments,
        # *args).
        donate = tuple(5 + i for i in donate_argnums)
        self._jit = jax.jit(self._full, static_argnums=(0, 1), donate_argnums=donate,
                            compiler_options=compiler_options)
        self._eager_jit = jax.jit(self._full, static_argnums=(0, 1), donate_argnums=donate,
                                  compiler_options=eager_options(compiler_options, eager_compiler_options))
        self.static_buffers = static_buffers
        # _full_static: (key, StepLayout, req_to_token, (packed, token arguments), token outputs, *args); the unused
        # token-output buffers are kept and donated, so XLA writes the new outputs into them.
        self._jit_static = jax.jit(self._full_static, static_argnums=(0, 1), keep_unused=True,
                                   donate_argnums=(4,) + donate,
                                   compiler_options=compiler_options)
        self._stage = jax.jit(_write_into, donate_argnums=0)
        self.buffers: dict = {}  # plan key -> [step inputs, token outputs] (static_buffers only)
        self._zeros: dict = {}  # shape -> int32 zeros on the device: the argument of a token leaf sent packed
        self.executables: dict = {}
        self.trace_count = 0
        self._warned_eager = False

    def _full(self, key: PlanKey, layout: "StepLayout", req_to_token, packed, token_args, *args):
        self.trace_count += 1  # Python side effect: runs once per trace
        arrays, token_inputs = layout.unpack(packed, token_args)
        md = self.backend.attach_schedule(plan_arrays(key, req_to_token, *arrays))
        return self.step_fn(md, token_inputs, *args)

    def _full_static(self, key: PlanKey, layout, req_to_token, inputs, token_outputs, *args):
        del token_outputs  # donated: only their buffers are used, for the new token outputs
        return self._full(key, layout, req_to_token, *inputs, *args)

    def _padded(self, batch: ForwardBatch) -> Optional[ForwardBatch]:
        """``batch`` padded to its bucket, or None when no bucket serves it (see ``capturable``)."""
        bs = bucket_for(batch.batch_size, self.batch_buckets)
        if bs is None:
            return None
        per_req = batch.tokens_per_req_bound()
        if per_req is not None:
            return pad_batch(batch, bs, bs * per_req)
        tokens = self._extend_tokens(batch)
        return None if tokens is None else pad_batch(batch, bs, tokens)

    def _extend_tokens(self, batch: ForwardBatch) -> Optional[int]:
        """The token bucket of a ragged extend / mixed batch (None: not bucketed)."""
        if batch.forward_mode not in (ForwardMode.EXTEND, ForwardMode.MIXED) or not self.token_buckets:
            return None
        return bucket_for(batch.num_tokens, self.token_buckets)

    def capturable(self, batch: ForwardBatch) -> bool:
        """Whether a bucket serves ``batch``: a uniform mode (decode, verify, draft extend) or, with
        ``token_buckets``, an extend / mixed batch, within the last batch (and token) bucket."""
        return self._padded(batch) is not None

    def capture(self, batches: Iterable[ForwardBatch], token_inputs, *args, verbose: bool = True,
                parallel: Union[bool, int] = True) -> CaptureReport:
        """Compile one executable per batch (already at a bucket size) ahead of time.

        Every batch is traced first; the Mosaic GPU kernels they call that no earlier capture built
        are then built in parallel processes (``kernel_cache.prebuild``); then each bucket is lowered
        on this thread, in order, while earlier buckets compile in a thread pool. ``parallel``: True =
        up to ``os.cpu_count()`` threads and processes, an int = that many, False = nothing in
        parallel (each compile finished before the next lowering). ``verbose`` reports on stderr: a
        line per bucket (bucket i of n, its lowering and compile times, the elapsed time), a bar on a
        terminal, and the totals. Returns the times (``CaptureReport``).
        """
        if self.compile_cache:
            compile_cache.enable()
        batches = list(batches)
        progress = Progress(len(batches), "capture", enabled=verbose)
        workers = _workers(parallel, len(batches))
        t0 = time.perf_counter()
        traced = [self._trace(batch, token_inputs, *args) for batch in batches]
        if parallel:
            kernel_cache.prebuild([k for _, t in traced for k in kernel_cache.kernels_in(t.jaxpr)],
                                  workers=None if parallel is True else int(parallel))
        lower_s = time.perf_counter() - t0  # tracing and kernel builds, shared by the buckets

        def compile_one(key, lowered, lowering_s):
            t0 = time.perf_counter()
            self.executables[key] = lowered.compile()
            dt = time.perf_counter() - t0
            progress.step(f"{key.mode.name} bs={key.batch_size} tokens={key.num_tokens}",
                          f"lower {lowering_s:.1f}s, compile {dt:.1f}s")
            return dt

        with progress, concurrent.futures.ThreadPoolExecutor(workers) as pool:
            jobs = []
            for key, t in traced:
                t0 = time.perf_counter()
                lowered = t.lower()
                dt = time.perf_counter() - t0
                lower_s += dt
                jobs.append(pool.submit(compile_one, key, lowered, dt))
                if workers == 1:
                    jobs[-1].result()  # one at a time
            compile_s = sum(j.result() for j in jobs)  # re-raises a failed compile
            total = progress.finish(f"tracing and lowering {lower_s:.1f}s, compile {compile_s:.1f}s"
                                    + (f" in {workers} threads" if workers > 1 else ""))
        return CaptureReport(len(batches), total, lower_s, compile_s)

    def _trace(self, batch: ForwardBatch, token_inputs, *args):
        """``(plan key, jax.stages.Traced)`` of one batch's bucket (static buffers made here)."""
        padded = self._padded(batch)
        if padded is None:
            raise ValueError(f"{batch.forward_mode.name} bs={batch.batch_size} tokens={batch.num_tokens} is not "
                             f"capturable: bs <= {self.batch_buckets[-1]}, and uniform modes (decode, verify, draft "
                             f"extend) or extends within the token buckets {self.token_buckets}")
        key = self.backend.plan_static(padded)
        layout, packed, tokens = self.pack(padded, _pad_tokens(token_inputs, padded.num_tokens))
        if not self.static_buffers:
            return key, self._jit.trace(key, layout, self.backend.req_to_token, packed, tokens, *args)
        outs = jax.eval_shape(functools.partial(self._full, key, layout), self.backend.req_to_token, packed,
                              tokens, *args)[0]
        bufs = [own_buffers((packed, tokens)), jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), outs)]
        self.buffers[key] = bufs
        return key, self._jit_static.trace(key, layout, self.backend.req_to_token, *bufs, *args)

    def replay(self, batch: ForwardBatch, token_inputs, *args, trim: bool = True):
        """Pad to the bucket, run the captured executable, slice token outputs to the real tokens.

        ``trim=False`` returns the token outputs at the bucket's token count (the step's rows first):
        slicing a device array compiles a small XLA program per distinct size, which a caller that
        converts the outputs anyway (DLPack to torch, a host copy) can do there instead."""
        padded = self._padded(batch)
        key = None if padded is None else self.backend.plan_static(padded)
        exe = self.executables.get(key)
        if exe is None:
            if not self._warned_eager and padded is not None:
                print(f"no captured executable for {batch.forward_mode.name} bs={batch.batch_size} "
                      f"tokens={batch.num_tokens}: running eagerly (compiles per shape)", file=sys.stderr)
                self._warned_eager = True
            return self.eager(batch, token_inputs, *args)
        n = batch.num_tokens
        if self.backend.validate:  # validation mode: host checks and the plan's error flag, before any write
            self.backend.plan(padded)
        # one host-to-device copy for the plan inputs and the host token inputs
        _, packed, tokens = self.pack(padded, _pad_tokens(token_inputs, padded.num_tokens), with_layout=False)
        if self.static_buffers:
            bufs = self.buffers[key]
            bufs[0] = self._stage(bufs[0], (packed, tokens))  # written in place: same addresses
            tok_out, other = exe(self.backend.req_to_token, *bufs, *args)
            bufs[1] = tok_out  # the donated output buffers, refilled
        else:
            tok_out, other = exe(self.backend.req_to_token, packed, tokens, *args)
        if n == padded.num_tokens or not trim:
            return tok_out, other
        return jax.tree.map(lambda x: x[:n], tok_out), other

    def eager(self, batch: ForwardBatch, token_inputs, *args):
        """Run unpadded through ``jax.jit`` (compiles once per distinct shape, with the eager options)."""
        key = self.backend.plan_static(batch)
        layout, packed, tokens = self.pack(batch, token_inputs)
        return self._eager_jit(key, layout, self.backend.req_to_token, packed, tokens, *args)

    def pack(self, batch: ForwardBatch, token_inputs, with_layout: bool = True):
        """``pack_step`` of a batch (padded for a bucket) and its token inputs."""
        return pack_step(batch_arrays(batch), token_inputs, self._device_zeros, with_layout)

    def _device_zeros(self, shape) -> jax.Array:
        hit = self._zeros.get(shape)
        if hit is None:
            hit = self._zeros[shape] = jnp.zeros(shape, jnp.int32)
        return hit


def _workers(parallel: Union[bool, int], jobs: int) -> int:
    """Compile threads for ``jobs`` buckets: ``parallel`` True = up to the CPU count, an int = that many."""
    if parallel is True:
        parallel = os.cpu_count() or 1
    return max(1, min(int(parallel), jobs))


def _with_command_buffers(options: Optional[dict], enabled: bool) -> Optional[dict]:
    """``options`` plus the XLA flag that turns command buffers off, unless ``enabled`` or not on a GPU
    (the flag is GPU-only) or the caller set it already."""
    if enabled or jax.default_backend() != "gpu" or "xla_gpu_enable_command_buffer" in (options or {}):
        return options
    return {**(options or {}), "xla_gpu_enable_command_buffer": ""}


# XLA options of eager executables on a GPU (``StepRunner``'s ``eager_compiler_options``): GEMMs through
# cuBLAS, so no Triton GEMM configurations are compiled and timed for a shape that runs a few times.
EAGER_GPU_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def eager_options(options: Optional[dict], eager: Optional[dict]) -> Optional[dict]:
    """The XLA options of ``StepRunner.eager``'s executables: ``options`` (the runner's), then ``eager``
    (default ``EAGER_GPU_OPTIONS`` on a GPU, nothing elsewhere: the flags are GPU-only)."""
    if eager is None:
        eager = EAGER_GPU_OPTIONS if jax.default_backend() == "gpu" else {}
    merged = {**(options or {}), **eager}
    return merged or None


def own_buffers(tree):
    """New device buffers holding ``tree``'s values, one per leaf (none shared with a caller's array or
    with another leaf, such as the cached zeros of ``pack_step``): they can be donated."""
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def _write_into(old, new):
    """``new`` written over ``old`` (same tree and shapes); with ``old`` donated, in place."""
    return jax.tree.map(lambda o, n: jax.lax.dynamic_update_slice(o, jnp.asarray(n, o.dtype), (0,) * o.ndim),
                        old, new)


def pack_int32(arrays, with_layout: bool = True):
    """Host int/bool arrays (``None`` allowed) -> (static layout, one i32 vector); ``with_layout=False``: the
    layout is None (a replay, whose executable has its layout already, skips making it)."""
    parts = [a.reshape(-1) for a in arrays if a is not None]
    # one pass: converted to int32 while concatenated (bool and int64 fields as np.asarray(a, np.int32) would)
    vector = np.concatenate(parts, dtype=np.int32, casting="unsafe") if parts else np.zeros((0,), np.int32)
    if not with_layout:
        return None, vector
    return tuple(None if a is None else (a.shape, a.dtype.char) for a in arrays), vector  # (dtype.char: cheap)


@dataclasses.dataclass(frozen=True)
class StepLayout:
    """Where a step's inputs are (``pack_step``): a static argument of the step's executable."""

    arrays: tuple  # pack_int32 layout: the plan's batch fields, the int32 token leaves, their sources
    num_plan: int  # how many of ``arrays`` are batch fields
    tokens: Any  # the token inputs' treedef
    slots: Tuple[bool, ...]  # per token leaf: int32, so it has a slot in the packed vector

    def unpack(self, packed, token_args):
        """``(batch fields, token_inputs)`` inside the traced step."""
        parts = unpack_int32(packed, self.arrays)
        num_slots = sum(self.slots)
        from_packed = iter(parts[self.num_plan:self.num_plan + num_slots])
        source = parts[-1] if num_slots else None  # per slot: 1 = the packed copy, 0 = the argument
        leaves, i = [], 0
        for slot, arg in zip(self.slots, token_args):
            if slot:
                arg = jnp.where(source[i] != 0, next(from_packed), arg)
                i += 1
            leaves.append(arg)
        return parts[:self.num_plan], jax.tree.unflatten(self.tokens, leaves)


def pack_step(arrays, token_inputs, zeros: Callable, with_layout: bool = True):
    """A step's inputs as ``(StepLayout, packed int32 host vector, token arguments)``: one host-to-device
    transfer for the batch fields (``plan_key.batch_arrays``) and the token inputs that are host int32
    arrays.

    Every int32 token leaf has a slot in the vector and an argument of its own; one more word per slot
    says which the step reads. A host (numpy) array goes into its slot, and its argument is a cached
    device array of zeros (``zeros(shape)``); a device array (ids sampled on the device) is the argument,
    and its slot holds zeros. The layout therefore does not depend on where a leaf lives: a bucket
    captured with host positions replays with device ones, and the other way round. Other leaves are
    arguments. ``with_layout=False`` (a replay): the layout is None."""
    leaves, tree = jax.tree.flatten(token_inputs)
    slots, parts, sources, args = [], list(arrays), [], []
    for x in leaves:
        slot = x.dtype == np.int32
        host = slot and isinstance(x, np.ndarray)  # sent in the vector
        slots.append(slot)
        if slot:
            parts.append(x if host else np.zeros(x.shape, np.int32))
            sources.append(host)
        args.append(zeros(x.shape) if host else x)
    if sources:
        parts.append(np.array(sources, np.int32))
    arrays_layout, vector = pack_int32(parts, with_layout)
    layout = StepLayout(arrays_layout, len(arrays), tree, tuple(slots)) if with_layout else None
    return layout, vector, args


def unpack_int32(packed, layout):
    """Inverse of ``pack_int32`` inside a traced function (static slices: free)."""
    out, at = [], 0
    for item in layout:
        if item is None:
            out.append(None)
            continue
        shape, dtype = item
        size = int(np.prod(shape, dtype=np.int64))
        out.append(packed[at:at + size].reshape(shape).astype(dtype))
        at += size
    return out
