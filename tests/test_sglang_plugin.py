"""torch_bridge.sglang_plugin against stand-ins of SGLang 0.5.11's modules (SGLang is not installed
here): the attention registry with its decorator, the AttentionBackend base class, the CLI choice
lists and the EAGLE DraftBackendFactory, all inserted into sys.modules under SGLang's paths."""

import abc
import inspect
import logging
import os
import sys
import tomllib
import types

import numpy as np
import pytest
import torch

import torch_bridge.sglang_plugin as plugin
from tests.paging import shuffled_table
from torch_bridge import (FlashAttentionBackend, FlashAttentionMultiStepBackend, ForwardBatch, ForwardMode,
                          MHATokenToKVPool, ModelConfig, ModelRunner, RadixAttention, ReqToTokenPool, ServerArgs)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HQ, HKV, D, MAX_CTX, PAGE = 4, 2, 16, 32, 4


# ---- SGLang stand-ins: the shapes plugin.register() relies on, as in SGLang 0.5.11 -------------------
def _registry():
    m = types.ModuleType(plugin.REGISTRY)
    m.ATTENTION_BACKENDS = {}

    def register_attention_backend(name):
        def decorator(fn):
            m.ATTENTION_BACKENDS[name] = fn
            return fn

        return decorator

    m.register_attention_backend = register_attention_backend
    return m


def _base():
    m = types.ModuleType(plugin.BASE)

    class AttentionBackend(abc.ABC):
        @abc.abstractmethod
        def init_forward_metadata(self, forward_batch):
            raise NotImplementedError()

        def get_verify_buffers_to_fill_after_draft(self):
            return [None, None]

        def support_triton(self):
            return True

    m.AttentionBackend = AttentionBackend
    return m


def _server_args():
    m = types.ModuleType(plugin.SERVER_ARGS)
    m.ATTENTION_BACKEND_CHOICES = ["triton", "fa3", "flashinfer"]
    m.DETERMINISTIC_ATTENTION_BACKEND_CHOICES = ["flashinfer", "fa3", "triton"]
    m.add_attention_backend_choices = m.ATTENTION_BACKEND_CHOICES.extend
    m.add_deterministic_attention_backend_choices = m.DETERMINISTIC_ATTENTION_BACKEND_CHOICES.extend
    return m


def _draft_utils():
    """DraftBackendFactory as in SGLang 0.5.11: name -> creator tables local to two methods."""
    m = types.ModuleType(plugin.DRAFT_UTILS)

    class DraftBackendFactory:
        def __init__(self, server_args, draft_model_runner, topk, speculative_num_steps):
            self.server_args, self.draft_model_runner = server_args, draft_model_runner
            self.topk, self.speculative_num_steps = topk, speculative_num_steps
            self.draft_attn_backend = server_args.speculative_draft_attention_backend

        def _create_backend(self, backend_name, backend_map, error_template):
            backend_type = self.draft_attn_backend or getattr(self.server_args, backend_name)
            if backend_type is None:
                backend_type = self.server_args.attention_backend
            if backend_type not in backend_map:
                raise ValueError(error_template.format(backend_type=backend_type))
            return backend_map[backend_type]()

        def create_decode_backend(self):
            if self.speculative_num_steps == 1:
                return None
            return self._create_backend("decode_attention_backend", {"fa3": self._create_fa3_decode_backend},
                                        "EAGLE is not supported in decode attention backend {backend_type}")

        def create_draft_extend_backend(self):
            return self._create_backend("prefill_attention_backend", {"fa3": self._create_fa3_prefill_backend},
                                        "EAGLE is not supported in attention backend {backend_type}")

        def _create_fa3_decode_backend(self):
            return "sglang fa3 multi-step"

        def _create_fa3_prefill_backend(self):
            return "sglang fa3 draft extend"

    m.DraftBackendFactory = DraftBackendFactory
    return m


def _graph_runner(module: str):
    """A graph runner as SGLang 0.5.11's: ``_capture_graph`` enters ``torch.cuda.graph`` (looked up at
    call time) around the run. Here it reports the capture mode that graph would use, and the run's output."""
    cls_name, backend_path = plugin.GRAPH_RUNNERS[module]
    m = types.ModuleType(module)

    def __init__(self, backend):
        if backend_path == "model_runner.attn_backend":
            self.model_runner = types.SimpleNamespace(attn_backend=backend)
        else:
            setattr(self, backend_path, backend)

    def _capture_graph(self, graph, pool, stream, run_once_fn):
        mode = inspect.signature(torch.cuda.graph.__init__).parameters["capture_error_mode"].default
        return mode, run_once_fn()

    setattr(m, cls_name, type(cls_name, (), {"__init__": __init__, "_capture_graph": _capture_graph}))
    return m


@pytest.fixture
def sglang(monkeypatch):
    """SGLang's packages and the four modules, removed again after the test."""
    mods = {}
    for pkg in ("sglang", "sglang.srt", "sglang.srt.layers", "sglang.srt.layers.attention", "sglang.srt.speculative",
                "sglang.srt.model_executor"):
        mods[pkg] = types.ModuleType(pkg)
        mods[pkg].__path__ = []
    for m in (_registry(), _base(), _server_args(), _draft_utils(), *map(_graph_runner, plugin.GRAPH_RUNNERS)):
        mods[m.__name__] = m
    for name, m in mods.items():
        monkeypatch.setitem(sys.modules, name, m)
    return types.SimpleNamespace(registry=mods[plugin.REGISTRY], base=mods[plugin.BASE],
                                 server_args=mods[plugin.SERVER_ARGS], draft=mods[plugin.DRAFT_UTILS],
                                 runners={name: getattr(mods[module], name)
                                          for module, (name, _) in plugin.GRAPH_RUNNERS.items()})


def mock_runner(**server):
    """What SGLang's ModelRunner offers the backend (torch_bridge.types stand-ins, CPU tensors)."""
    table, num_slots = shuffled_table(6, MAX_CTX, PAGE, seed=1)
    pool = MHATokenToKVPool.create(num_slots, 1, HKV, D, torch.float32)
    return ModelRunner(ReqToTokenPool(torch.from_numpy(table).clone()), pool, ModelConfig(MAX_CTX), page_size=PAGE,
                       server_args=ServerArgs(**server), attention_impl="reference"), table


def draft_server_args(**kw):
    args = dict(attention_backend=plugin.BACKEND_NAME, speculative_draft_attention_backend=None,
                decode_attention_backend=None, prefill_attention_backend=None)
    return types.SimpleNamespace(**{**args, **kw})


# ---- tests ---------------------------------------------------------------------------------------
def test_without_sglang_register_returns_false_and_changes_nothing(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # `import sglang` fails as when it is not installed
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    assert plugin.register() is False
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" not in os.environ


def test_an_sglang_that_fails_to_import_raises(monkeypatch, tmp_path):
    pkg = tmp_path / "sglang" / "srt" / "layers" / "attention"
    pkg.mkdir(parents=True)
    for d in (pkg, pkg.parent, pkg.parent.parent, pkg.parent.parent.parent):
        (d / "__init__.py").write_text("")
    (pkg / "attention_registry.py").write_text("import jax_attn_missing_dependency_of_sglang\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    try:
        with pytest.raises(ModuleNotFoundError, match="jax_attn_missing_dependency_of_sglang"):
            plugin.register()
    finally:
        for name in [n for n in sys.modules if n == "sglang" or n.startswith("sglang.")]:
            del sys.modules[name]


def test_register_adds_jax_attn_and_the_creator_builds_the_bridge(sglang, monkeypatch):
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    assert plugin.register() is True
    assert plugin.register() is True  # idempotent
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"
    assert sglang.server_args.ATTENTION_BACKEND_CHOICES.count("jax_attn") == 1
    assert sglang.server_args.DETERMINISTIC_ATTENTION_BACKEND_CHOICES.count("jax_attn") == 1

    runner, table = mock_runner()
    backend = sglang.registry.ATTENTION_BACKENDS["jax_attn"](runner)  # as ModelRunner does
    assert isinstance(backend, FlashAttentionBackend)
    assert isinstance(backend, sglang.base.AttentionBackend)
    assert backend.model_runner is runner and not backend.skip_prefill
    assert backend.get_verify_buffers_to_fill_after_draft() == [None, None]  # SGLang's default
    assert backend.support_triton()

    # It runs: one decode step of one layer against a float64 softmax over the request's keys.
    rng = np.random.default_rng(0)
    kb, vb = runner.token_to_kv_pool.get_kv_buffer(0)
    kb[1:] = torch.from_numpy(rng.standard_normal(kb[1:].shape).astype(np.float32))
    vb[1:] = torch.from_numpy(rng.standard_normal(vb[1:].shape).astype(np.float32))
    rows, lens = np.array([2, 5]), np.array([7, 12])
    loc = np.array([table[r, n - 1] for r, n in zip(rows, lens)])
    fb = ForwardBatch(ForwardMode.DECODE, 2, torch.from_numpy(rows), torch.from_numpy(lens), torch.from_numpy(loc),
                      token_to_kv_pool=runner.token_to_kv_pool)
    q = torch.from_numpy(rng.standard_normal((2, HQ * D)).astype(np.float32))
    backend.init_forward_metadata(fb)
    got = backend.forward(q, None, None, RadixAttention(HQ, D, D**-0.5, HKV, 0), fb, save_kv_cache=False).numpy()
    for b, (r, n) in enumerate(zip(rows, lens)):
        keys, vals = kb[table[r, :n]].double().numpy(), vb[table[r, :n]].double().numpy()
        for h in range(HQ):
            s = keys[:, h // (HQ // HKV)] @ q[b].double().numpy().reshape(HQ, D)[h] * D**-0.5
            p = np.exp(s - s.max())
            want = (p / p.sum()) @ vals[:, h // (HQ // HKV)]
            np.testing.assert_allclose(got[b].reshape(HQ, D)[h], want, rtol=1e-4, atol=1e-5)


def test_an_explicit_preallocate_setting_is_kept(sglang, monkeypatch):
    monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "true")
    plugin.register()
    assert os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true"


def test_eagle_draft_factory_builds_the_multistep_and_draft_extend_backends(sglang):
    plugin.register()
    runner, _ = mock_runner(speculative_eagle_topk=2, speculative_num_draft_tokens=4)
    factory = sglang.draft.DraftBackendFactory(draft_server_args(), runner, 2, 3)
    decode = factory.create_decode_backend()
    assert isinstance(decode, FlashAttentionMultiStepBackend)
    assert decode.model_runner is runner and decode.topk == 2 and decode.speculative_num_steps == 3
    assert [b.speculative_step_id for b in decode.attn_backends] == [0, 1]
    extend = factory.create_draft_extend_backend()
    assert isinstance(extend, FlashAttentionBackend) and isinstance(extend, sglang.base.AttentionBackend)
    assert extend.model_runner is runner and extend.skip_prefill is False
    # SGLang's own resolution is kept: one draft step has no decode backend; other names are SGLang's.
    assert sglang.draft.DraftBackendFactory(draft_server_args(), runner, 2, 1).create_decode_backend() is None
    fa3 = sglang.draft.DraftBackendFactory(draft_server_args(speculative_draft_attention_backend="fa3"), runner, 2, 3)
    assert fa3.create_decode_backend() == "sglang fa3 multi-step"
    assert fa3.create_draft_extend_backend() == "sglang fa3 draft extend"
    plugin.register()  # wraps once
    assert factory.create_draft_extend_backend().skip_prefill is False


def test_graph_runners_capture_in_thread_local_mode_with_the_bridge_only(sglang):
    """SGLang's three graph runners capture in CUDA's thread-local mode when their backend is the bridge
    (another thread's CUDA call invalidated global-mode captures, H100), and in torch's default otherwise.
    Catches a runner left unwrapped, a wrap that leaks the mode to other backends or outlives the call, and
    a double wrap."""
    plugin.register()
    plugin.register()
    runner, _ = mock_runner(speculative_eagle_topk=1, speculative_num_draft_tokens=2)
    bridge = sglang.registry.ATTENTION_BACKENDS["jax_attn"](runner)
    backends = {"CudaGraphRunner": bridge, "EAGLEDraftCudaGraphRunner": FlashAttentionMultiStepBackend(runner, 1, 2),
                "EAGLEDraftExtendCudaGraphRunner": bridge}
    default = inspect.signature(torch.cuda.graph.__init__).parameters["capture_error_mode"].default
    assert default == "global"
    for name, cls in sglang.runners.items():
        assert cls._capture_graph._jax_attn_wrapped and not hasattr(cls._capture_graph.__wrapped__, "__wrapped__")
        assert cls(backends[name])._capture_graph(None, None, None, lambda: "out") == ("thread_local", "out")
        assert cls("sglang fa3")._capture_graph(None, None, None, lambda: "out") == ("global", "out")
        assert inspect.signature(torch.cuda.graph.__init__).parameters["capture_error_mode"].default == "global"


def test_a_draft_factory_of_another_shape_is_left_alone_with_a_warning(sglang, caplog):
    del sglang.draft.DraftBackendFactory._create_fa3_prefill_backend
    original = sglang.draft.DraftBackendFactory._create_backend
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        assert plugin.register() is True  # the target backend is still registered
    assert "jax_attn" in sglang.registry.ATTENTION_BACKENDS
    assert sglang.draft.DraftBackendFactory._create_backend is original
    assert "EAGLE draft workers cannot use jax_attn" in caplog.text


def test_missing_optional_modules_are_reported(sglang, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, plugin.SERVER_ARGS, None)
    monkeypatch.setitem(sys.modules, plugin.BASE, None)
    with caplog.at_level(logging.WARNING, logger=plugin.__name__):
        assert plugin.register() is True
    assert plugin.SERVER_ARGS in caplog.text and plugin.BASE in caplog.text
    runner, _ = mock_runner()
    assert type(sglang.registry.ATTENTION_BACKENDS["jax_attn"](runner)) is FlashAttentionBackend


def test_the_entry_point_sglang_loads_is_declared():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    target = project["entry-points"]["sglang.srt.plugins"]["jax_attn"]
    module, func = target.split(":")
    assert getattr(sys.modules.get(module) or __import__(module, fromlist=[func]), func) is plugin.register


@pytest.mark.gpu
def test_thread_local_capture_captures_a_real_graph():
    """On a GPU: the wrapped ``torch.cuda.graph`` captures and replays, in thread-local mode."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    x = torch.ones(8, device="cuda")
    g = torch.cuda.CUDAGraph()
    with plugin.thread_local_capture():
        ctx = torch.cuda.graph(g)
        assert ctx.capture_error_mode == "thread_local"
        with ctx:
            y = x * 2
    x.fill_(3.0)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full((8,), 6.0, device="cuda"))
    assert torch.cuda.graph is not type(ctx)
