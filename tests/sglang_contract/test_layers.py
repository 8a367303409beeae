"""Layer kinds of SGLang 0.5.11 models: cross attention (encoder-decoder models), ``AttentionType.ENCODER_ONLY``
(embedding models) and Llama 4's ``use_irope`` chunked local layers.

Cross attention as SGLang lays it out (``ScheduleBatch.prepare_encoder_info_extend``): a request's
encoder tokens occupy the first ``encoder_len`` columns of its ``req_to_token`` row and its decoder
tokens follow; ``seq_lens`` count decoder tokens only; a cross layer writes its K/V at
``encoder_out_cache_loc`` while the encoder is not cached and gets ``k = v = None`` afterwards. The
mock ``ModelConfig`` has no ``max_encoder_len`` (SGLang's has none)."""

from __future__ import annotations

import pytest

import torch_bridge
from tests.sglang_contract.batches import Req, plain_step
from tests.sglang_contract.check import check_step
from tests.sglang_contract.device import ON_CUDA
from tests.sglang_contract.engine import ForwardMode
from tests.sglang_contract.world import CROSS, ENC_ONLY, PLAIN, SINK, LayerSpec, World

EXTEND, DECODE = ForwardMode.EXTEND, ForwardMode.DECODE

# (name, mode, reqs as (prefix, new, encoder_len, encoder written this step))
CROSS_CASES = [
    ("first_extend", EXTEND, ((0, 5, 6, True), (0, 3, 4, True))),
    ("extend_cached_encoder", EXTEND, ((7, 4, 6, False), (2, 9, 11, False))),
    ("decode", DECODE, ((9, 1, 6, False), (20, 1, 3, False), (1, 1, 12, False))),
]


@pytest.mark.parametrize("launch", [False, True], ids=["default", "triton_launch"])
@pytest.mark.parametrize("name,mode,reqs", CROSS_CASES, ids=[c[0] for c in CROSS_CASES])
def test_cross_attention(name, mode, reqs, launch):
    """Catches: cross attention demanding ``model_config.max_encoder_len`` (SGLang has none); decoder
    self attention not offset by the request's encoder length; cross K/V written at ``out_cache_loc``
    instead of ``encoder_out_cache_loc``; a causal mask on cross attention; ``k is None`` mishandled.
    ``triton_launch``: every layer on the bridge's launch path with the Triton-lowered kernel (interpreted on
    the CPU; on CUDA the device's own path, which the default case already takes)."""
    if launch and ON_CUDA:
        pytest.skip("on CUDA the default backend launches these layers")
    from tests.test_triton_launch import triton_path_for_tests

    world = World((PLAIN, CROSS, SINK), encoder_decoder=True)
    backend = torch_bridge.FlashAttentionBackend(world.runner, mosaic_path=triton_path_for_tests() if launch else None)
    batch = [Req(world.new_request(), p, n, enc=e, enc_new=w) for p, n, e, w in reqs]
    fb, ex = plain_step(world, batch, mode)
    check_step(world, backend, fb, ex, what=f"cross {name}")


ENCODER_ONLY_CASES = [("no_prefix_p1", ((0, 9), (0, 20), (0, 1)), 1), ("prefix_p16", ((6, 5), (0, 12), (17, 3)), 16)]


@pytest.mark.parametrize("name,reqs,page_size", ENCODER_ONLY_CASES, ids=[c[0] for c in ENCODER_ONLY_CASES])
def test_encoder_only_layer_is_bidirectional(name, reqs, page_size):
    """Catches: ``attn_type == AttentionType.ENCODER_ONLY`` ignored (causal attention for an
    embedding model's bidirectional layers)."""
    world = World((ENC_ONLY, PLAIN), page_size=page_size)
    backend = torch_bridge.FlashAttentionBackend(world.runner)
    fb, ex = plain_step(world, [Req(world.new_request(), p, n) for p, n in reqs])
    check_step(world, backend, fb, ex, what=f"encoder-only {name}")


IROPE = LayerSpec(scaling=0.41, irope=True)


@pytest.mark.parametrize("mode,reqs", [(EXTEND, ((3, 14), (0, 20))), (DECODE, ((13, 1), (30, 1)))],
                         ids=["extend", "decode"])
def test_irope_layer_is_local_or_refused(mode, reqs):
    """Catches: ``layer.use_irope`` in a model with ``is_local_attention_model`` silently given full
    attention. Honoured means chunked local attention (chunk 8: a query sees its own chunk's keys);
    refusing means ``NotImplementedError`` before anything is written."""
    world = World((IROPE, PLAIN), chunk=8)
    backend = torch_bridge.FlashAttentionBackend(world.runner)
    fb, ex = plain_step(world, [Req(world.new_request(), p, n) for p, n in reqs], mode)
    before = world.snapshot()
    try:
        check_step(world, backend, fb, ex, what="use_irope layer")
    except NotImplementedError as e:
        assert "irope" in str(e) or "local" in str(e), f"the error must name what is unsupported: {e}"
        world.check_pools(before, "a refused use_irope layer")
