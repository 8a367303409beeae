"""SGLang plug-in: ``--attention-backend jax_attn`` runs ``torch_bridge`` inside SGLang 0.5.11.

    import torch_bridge.sglang_plugin as plugin
    plugin.register()          # True: SGLang found and patched; False: SGLang is not installed

What ``register()`` does, against SGLang 0.5.11's own extension points:

* **Target model.** ``ModelRunner`` creates its attention backend by name from
  ``sglang.srt.layers.attention.attention_registry.ATTENTION_BACKENDS`` (filled by that module's
  ``register_attention_backend(name)`` decorator; the creator is called with the model runner).
  ``register()`` adds ``jax_attn`` there; its creator returns ``torch_bridge.FlashAttentionBackend``
  (mixed with SGLang's ``AttentionBackend`` base class, so the defaults SGLang's own FA3 backend
  inherits, such as ``get_verify_buffers_to_fill_after_draft``, are there too). The draft model's
  runner uses the same registry. NGRAM speculative decoding needs nothing more: it runs target
  verify only.
* **Command line.** ``--attention-backend`` (and ``--prefill-attention-backend``,
  ``--decode-attention-backend``) only accept ``sglang.srt.server_args.ATTENTION_BACKEND_CHOICES``;
  ``register()`` extends it with SGLang's ``add_attention_backend_choices``, and
  ``DETERMINISTIC_ATTENTION_BACKEND_CHOICES`` with ``add_deterministic_attention_backend_choices``
  (the bridge honours ``--enable-deterministic-inference``). It does not claim radix-cache support
  under deterministic inference, so SGLang turns the radix cache off there, with its own warning.
* **EAGLE draft worker.** ``sglang.srt.speculative.draft_utils.DraftBackendFactory`` maps names to
  creators in tables local to ``create_decode_backend`` / ``create_draft_extend_backend``: SGLang
  offers no registration hook for them. ``register()`` wraps the one method both tables pass through,
  ``DraftBackendFactory._create_backend``, adding ``jax_attn`` to the table it is given: draft decode
  -> ``torch_bridge.FlashAttentionMultiStepBackend(draft_runner, topk, speculative_num_steps)``,
  draft extend -> ``FlashAttentionBackend(draft_runner, skip_prefill=False)``. SGLang still resolves
  the name (``--speculative-draft-attention-backend``, then the decode/prefill backend, then
  ``--attention-backend``). When the factory does not look like 0.5.11's, nothing is wrapped, a
  warning is logged, and SGLang raises its own "EAGLE is not supported in ... jax_attn" error when a
  draft worker asks for the name.
* **Graph capture mode.** SGLang's graph runners (``CudaGraphRunner``, the EAGLE draft and draft-extend
  runners) capture in ``torch.cuda.graph``'s default mode, CUDA's global mode, where an unsafe CUDA call
  from *any* thread of the process invalidates the capture. With the bridge in the process, captures
  failed at a random bucket in about half of the warm-ups (H100; ``benchmarks/RESULTS.md``); in
  thread-local mode, which checks only the capturing thread, none did. ``register()`` wraps each runner's
  ``_capture_graph`` so that, when that runner's attention backend is the bridge, ``torch.cuda.graph``
  defaults to ``capture_error_mode="thread_local"`` for the duration of the call. The captured work is
  checked as before; only other threads' calls are let through. Runners with other backends are unchanged.
* ``XLA_PYTHON_CLIENT_PREALLOCATE`` defaults to ``false`` (JAX must not take 75 % of the GPU that
  SGLang sized its KV pool for); an explicit value is kept.

Not covered (SGLang checks fixed lists of names in ``ServerArgs``, which no hook extends): gpt-oss
(``GptOssForCausalLM``), Llama 4, Exaone 4 and Moss-VL require named backends and reject
``jax_attn``; EAGLE with ``--speculative-eagle-topk > 1`` and ``--page-size > 1`` is refused for every
backend but flashinfer and fa3; SGLang never picks ``jax_attn`` by itself. What the bridge itself
does not run (MLA, hybrid SWA pools, ...) raises ``NotImplementedError``: ``docs/models.md``.

Loading: installing this package (``pip install 'jax_attn[cuda,torch]'`` beside SGLang) declares the
entry point ``jax_attn = torch_bridge.sglang_plugin:register`` in the group ``sglang.srt.plugins``.
SGLang 0.5.11 runs ``sglang.srt.plugins.load_plugins()`` in ``python -m sglang.launch_server`` and
``sglang serve`` before parsing arguments, in ``sglang.Engine(...)`` and in every scheduler process,
so nothing else is needed (``SGLANG_PLUGINS=jax_attn`` restricts loading to this one). From a source
checkout without the installed entry point, call ``register()`` before SGLang parses its arguments,
in every process (a ``sitecustomize.py`` on ``PYTHONPATH`` that calls it reaches the scheduler
processes too).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.metadata
import logging
import os
from types import ModuleType
from typing import Callable, Iterator, Optional

from torch_bridge.backend import FlashAttentionBackend
from torch_bridge.multistep import FlashAttentionMultiStepBackend

__all__ = ["BACKEND_NAME", "SGLANG_VERSION", "register", "create_backend", "draft_creator", "thread_local_capture"]

BACKEND_NAME = "jax_attn"  # the --attention-backend value
SGLANG_VERSION = "0.5.11"  # the engine contract (docs/sglang_contract.md)

REGISTRY = "sglang.srt.layers.attention.attention_registry"
BASE = "sglang.srt.layers.attention.base_attn_backend"
SERVER_ARGS = "sglang.srt.server_args"
DRAFT_UTILS = "sglang.srt.speculative.draft_utils"
# The fa3 creators of DraftBackendFactory's two tables tell which table _create_backend was given.
GRAPH_RUNNERS = {  # module -> (graph runner class, the attribute path of its attention backend)
    "sglang.srt.model_executor.cuda_graph_runner": ("CudaGraphRunner", "model_runner.attn_backend"),
    "sglang.srt.speculative.eagle_draft_cuda_graph_runner": ("EAGLEDraftCudaGraphRunner", "draft_attn_backend"),
    "sglang.srt.speculative.eagle_draft_extend_cuda_graph_runner": ("EAGLEDraftExtendCudaGraphRunner",
                                                                     "draft_extend_attn_backend"),
}
_DRAFT_TABLES = {"_create_fa3_decode_backend": "decode", "_create_fa3_prefill_backend": "extend"}

logger = logging.getLogger(__name__)


def register() -> bool:
    """Add ``jax_attn`` to SGLang's attention backends (idempotent).

    Returns:
      True when SGLang's registry was found and ``jax_attn`` is in it; False when SGLang is not
      installed (nothing changed). An SGLang that is installed but fails to import raises.
    """
    registry = _import(REGISTRY)
    if registry is None:
        return False
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    _check_version()
    cls = _bridge_class(getattr(_import(BASE), "AttentionBackend", None))
    registry.register_attention_backend(BACKEND_NAME)(functools.partial(create_backend, backend_class=cls))
    _add_choices(_import(SERVER_ARGS))
    _wrap_draft_factory(_import(DRAFT_UTILS), cls)
    for module, (runner, backend_path) in GRAPH_RUNNERS.items():
        _wrap_graph_capture(_import(module), runner, backend_path)
    return True


def create_backend(runner, backend_class: Optional[type] = None, **kwargs):
    """SGLang's creator: ``runner`` (its ``ModelRunner``) -> the bridge's ``FlashAttentionBackend``.

    ``backend_class``: the class built (default ``FlashAttentionBackend``; ``register()`` passes it
    mixed with SGLang's ``AttentionBackend``); ``kwargs`` go to its constructor (``skip_prefill`` for
    draft extend, ``impl``, ...).
    """
    return (FlashAttentionBackend if backend_class is None else backend_class)(runner, **kwargs)


def draft_creator(factory, table: str, backend_class: Optional[type] = None) -> Callable[[], object]:
    """The ``jax_attn`` entry of ``DraftBackendFactory``'s ``table`` ("decode" or "extend")."""
    if table == "decode":
        return lambda: FlashAttentionMultiStepBackend(factory.draft_model_runner, factory.topk,
                                                      factory.speculative_num_steps)
    if table == "extend":
        return lambda: create_backend(factory.draft_model_runner, backend_class, skip_prefill=False)
    raise ValueError(f"{table=} must be 'decode' or 'extend'")


# ---- SGLang's modules ------------------------------------------------------------------------------
def _import(name: str) -> Optional[ModuleType]:
    """``name`` imported, or None when SGLang (or, for the optional modules, ``name``) is absent."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        missing = e.name or ""
        if missing.startswith("sglang") and (name == missing or name.startswith(missing + ".")):
            if name != REGISTRY:
                logger.warning("SGLang module %s not found: jax_attn registered without its part", name)
            return None
        raise


def _check_version() -> None:
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:  # a source tree or a stub: nothing to compare
        return
    if version != SGLANG_VERSION:
        logger.warning("torch_bridge follows SGLang %s; SGLang %s is installed: attributes read by the "
                       "bridge may differ (docs/sglang_contract.md)", SGLANG_VERSION, version)


@functools.cache
def _bridge_with_base(base: type) -> type:
    class SGLangFlashAttentionBackend(FlashAttentionBackend, base):  # type: ignore[valid-type, misc]
        """``torch_bridge.FlashAttentionBackend`` with SGLang's ``AttentionBackend`` defaults."""

    return SGLangFlashAttentionBackend


def _bridge_class(base: Optional[type]) -> type:
    """The bridge, with SGLang's ``AttentionBackend`` defaults when that base class is importable."""
    return FlashAttentionBackend if base is None else _bridge_with_base(base)


def _add_choices(server_args: Optional[ModuleType]) -> None:
    if server_args is None:
        return
    for names, add in (("ATTENTION_BACKEND_CHOICES", "add_attention_backend_choices"),
                       ("DETERMINISTIC_ATTENTION_BACKEND_CHOICES", "add_deterministic_attention_backend_choices")):
        choices, adder = getattr(server_args, names, None), getattr(server_args, add, None)
        if choices is None or adder is None:
            logger.warning("%s.%s not found: --attention-backend %s may be refused by the argument parser",
                           SERVER_ARGS, add, BACKEND_NAME)
        elif BACKEND_NAME not in choices:
            adder([BACKEND_NAME])


def _wrap_draft_factory(draft_utils: Optional[ModuleType], backend_class: type) -> None:
    factory = getattr(draft_utils, "DraftBackendFactory", None)
    original = getattr(factory, "_create_backend", None)
    if factory is None or original is None or not all(hasattr(factory, n) for n in _DRAFT_TABLES):
        if draft_utils is not None:
            logger.warning("%s.DraftBackendFactory is not SGLang %s's: EAGLE draft workers cannot use %s "
                           "(SGLang will say so when one asks for it)", DRAFT_UTILS, SGLANG_VERSION, BACKEND_NAME)
        return
    if getattr(original, "_jax_attn_wrapped", False):
        return

    @functools.wraps(original)
    def _create_backend(self, backend_name, backend_map, error_template):
        table = _DRAFT_TABLES.get(getattr(backend_map.get("fa3"), "__name__", ""))
        if table is not None and BACKEND_NAME not in backend_map:
            backend_map = {**backend_map, BACKEND_NAME: draft_creator(self, table, backend_class)}
        return original(self, backend_name, backend_map, error_template)

    _create_backend._jax_attn_wrapped = True  # type: ignore[attr-defined]
    factory._create_backend = _create_backend


@contextlib.contextmanager
def thread_local_capture() -> Iterator[None]:
    """Within the block, ``torch.cuda.graph`` captures in thread-local mode unless told otherwise (what
    ``register`` does around SGLang's graph captures; an engine that captures the bridge itself should
    capture in this mode too: see the module docstring)."""
    import torch

    graph = torch.cuda.graph
    torch.cuda.graph = _thread_local_graph(graph)  # type: ignore[misc, assignment]
    try:
        yield
    finally:
        torch.cuda.graph = graph  # type: ignore[misc]


@functools.cache
def _thread_local_graph(graph: type) -> type:
    class ThreadLocalGraph(graph):  # type: ignore[valid-type, misc]
        """``torch.cuda.graph`` with thread-local capture as its default."""

        def __init__(self, cuda_graph, pool=None, stream=None, capture_error_mode: str = "thread_local"):
            super().__init__(cuda_graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode)

    return ThreadLocalGraph


def _uses_bridge(runner, backend_path: str) -> bool:
    backend = functools.reduce(lambda obj, name: getattr(obj, name, None), backend_path.split("."), runner)
    return isinstance(backend, (FlashAttentionBackend, FlashAttentionMultiStepBackend))


def _wrap_graph_capture(module: Optional[ModuleType], runner: str, backend_path: str) -> None:
    cls = getattr(module, runner, None)
    original = getattr(cls, "_capture_graph", None)
    if original is None:
        if module is not None:
            logger.warning("%s.%s has no _capture_graph (not SGLang %s's): its captures stay in CUDA's global "
                           "mode, where they may fail with cudaErrorStreamCaptureInvalidated", module.__name__,
                           runner, SGLANG_VERSION)
        return
    if getattr(original, "_jax_attn_wrapped", False):
        return

    @functools.wraps(original)
    def _capture_graph(self, *args, **kwargs):
        if not _uses_bridge(self, backend_path):
            return original(self, *args, **kwargs)
        with thread_local_capture():
            return original(self, *args, **kwargs)

    _capture_graph._jax_attn_wrapped = True  # type: ignore[attr-defined]
    cls._capture_graph = _capture_graph
