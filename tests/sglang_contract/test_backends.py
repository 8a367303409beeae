"""The backends' Python interface as SGLang 0.5.11 calls it: constructor and hook signatures (names,
order, defaults), construction the way ``model_runner`` / ``speculative/draft_utils.py`` do it, and the
graph runners' fill value."""

from __future__ import annotations

import inspect

import pytest

import torch_bridge
from tests.sglang_contract.batches import Req, plain_step, server_args_for
from tests.sglang_contract.check import check_step
from tests.sglang_contract.engine import ForwardMode
from tests.sglang_contract.world import PLAIN, SWA, World

REQUIRED = inspect.Parameter.empty
_FWD = (("q", REQUIRED), ("k", REQUIRED), ("v", REQUIRED), ("layer", REQUIRED), ("forward_batch", REQUIRED),
        ("save_kv_cache", True))
_MLA = (("q_rope", None), ("k_rope", None), ("sinks", None))

# (class, method, SGLang's leading parameters (name, default), SGLang takes **kwargs)
SIGNATURES = [
    ("FlashAttentionBackend", "__init__", (("model_runner", REQUIRED), ("skip_prefill", False),
                                           ("speculative_step_id", 0), ("topk", 0), ("speculative_num_steps", 0),
                                           ("fa_impl_ver", 3)), False),
    ("FlashAttentionBackend", "init_forward_metadata", (("forward_batch", REQUIRED),), False),
    ("FlashAttentionBackend", "forward", _FWD, True),
    ("FlashAttentionBackend", "forward_extend", _FWD + _MLA, False),
    ("FlashAttentionBackend", "forward_decode", _FWD + _MLA, False),
    ("FlashAttentionBackend", "init_cuda_graph_state", (("max_bs", REQUIRED), ("max_num_tokens", REQUIRED)), False),
    ("FlashAttentionBackend", "init_forward_metadata_capture_cuda_graph",
     tuple((n, REQUIRED) for n in ("bs", "num_tokens", "req_pool_indices", "seq_lens", "encoder_lens", "forward_mode",
                                   "spec_info")), False),
    ("FlashAttentionBackend", "init_forward_metadata_replay_cuda_graph",
     tuple((n, REQUIRED) for n in ("bs", "req_pool_indices", "seq_lens", "seq_lens_sum", "encoder_lens",
                                   "forward_mode", "spec_info", "seq_lens_cpu")) + (("out_cache_loc", None),), False),
    ("FlashAttentionBackend", "get_cuda_graph_seq_len_fill_value", (), False),
    ("FlashAttentionMultiStepBackend", "__init__", (("model_runner", REQUIRED), ("topk", REQUIRED),
                                                    ("speculative_num_steps", REQUIRED), ("fa_impl_ver", 3)), False),
    ("FlashAttentionMultiStepBackend", "init_forward_metadata", (("forward_batch", REQUIRED),), False),
    ("FlashAttentionMultiStepBackend", "init_cuda_graph_state", (("max_bs", REQUIRED), ("max_num_tokens", REQUIRED)),
     False),
    ("FlashAttentionMultiStepBackend", "init_forward_metadata_capture_cuda_graph", (("forward_batch", REQUIRED),),
     False),
    ("FlashAttentionMultiStepBackend", "init_forward_metadata_replay_cuda_graph",
     (("forward_batch", REQUIRED), ("bs", REQUIRED)), False),
]


@pytest.mark.parametrize("cls,method,params,var_kw", SIGNATURES, ids=[f"{c}.{m}" for c, m, _, _ in SIGNATURES])
def test_signature_matches_sglang(cls, method, params, var_kw):
    """Catches: a hook SGLang calls positionally or by keyword with other names, order or defaults
    (e.g. ``fa_impl_ver`` missing: a TypeError when draft_utils builds the backend)."""
    sig = inspect.signature(getattr(getattr(torch_bridge, cls), method))
    got = [p for p in sig.parameters.values() if p.name != "self"]
    positional = [p for p in got if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert [(p.name, p.default) for p in positional[:len(params)]] == list(params), f"{cls}.{method}{sig}"
    assert all(p.default is not REQUIRED or p.kind == p.VAR_KEYWORD or p.kind == p.VAR_POSITIONAL
               for p in got[len(params):]), f"{cls}.{method}{sig}: extra parameters must be optional"
    if var_kw:
        assert any(p.kind == p.VAR_KEYWORD for p in got), f"{cls}.{method}{sig} must take **kwargs as SGLang's"


@pytest.mark.parametrize("fa_impl_ver", [3, 4])
def test_constructed_as_sglang_then_decodes(fa_impl_ver):
    """Catches: ``fa_impl_ver`` (3 or 4, both valid in SGLang) rejected, or the full keyword
    construction of ``model_runner`` / ``draft_utils`` failing; the backend then serves a step."""
    world = World((PLAIN, SWA), page_size=16)
    backend = torch_bridge.FlashAttentionBackend(world.runner, skip_prefill=False, speculative_step_id=0, topk=0,
                                                 speculative_num_steps=0, fa_impl_ver=fa_impl_ver)
    fb, ex = plain_step(world, [Req(world.new_request(), 20, 1), Req(world.new_request(), 3, 1)], ForwardMode.DECODE)
    check_step(world, backend, fb, ex, what=f"decode through a fa_impl_ver={fa_impl_ver} backend")


def test_invalid_fa_impl_ver_raises_value_error():
    """Catches: a version SGLang rejects (``ValueError: Invalid version``) silently accepted."""
    world = World((PLAIN,))
    with pytest.raises(ValueError):
        torch_bridge.FlashAttentionBackend(world.runner, fa_impl_ver=2)


def test_multistep_constructed_as_draft_utils():
    """Catches: ``FlashAttentionMultiStepBackend(runner, topk, num_steps, fa_impl_ver=3)`` failing, or a
    step count other than SGLang's (one backend per draft step but the last)."""
    world = World((PLAIN,), server_args=server_args_for(algo="EAGLE", topk=2, steps=4, draft=6))
    multi = torch_bridge.FlashAttentionMultiStepBackend(world.runner, 2, 4, fa_impl_ver=3)
    assert len(multi.attn_backends) == 3
    assert [b.speculative_step_id for b in multi.attn_backends] == [0, 1, 2]


def test_fill_value_is_sglangs():
    """Catches: a fill value other than 1; SGLang's graph runners pad ``seq_lens`` with it."""
    world = World((PLAIN,))
    assert torch_bridge.FlashAttentionBackend(world.runner).get_cuda_graph_seq_len_fill_value() == 1


def test_sliding_window_with_cross_attention_is_refused():
    """Catches: the seed's assertion (no sliding window in an encoder-decoder model) dropped."""
    world = World((PLAIN,), encoder_decoder=True, sliding_window=4)
    with pytest.raises((AssertionError, ValueError, NotImplementedError)):
        torch_bridge.FlashAttentionBackend(world.runner)
