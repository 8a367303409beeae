"""Real-checkpoint loading (``jax_attn.models``) and what model authors need from the backend.

Tiny random Llama, Qwen2 (qkv bias, tied embeddings) and Mistral (sliding window) checkpoints written
by transformers (``save_pretrained``: config.json + safetensors) are loaded by ``load_checkpoint`` and
decoded through the JAX API (paged prefill, captured decode); their logits match transformers' own
forward. Also: configs that raise, Llama 3 rope scaling against transformers' formula, the MIXED batch
layout that docs/models.md describes, and ``FlashAttentionBackend.describe`` against the kernel that
``forward`` actually selects.
"""

import functools
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: transformers never reaches the Hub here

import jax
import jax.numpy as jnp
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import decode_llama  # noqa: E402
import llama  # noqa: E402

from jax_attn import kernel_policy  # noqa: E402
from jax_attn.backend import FlashAttentionBackend, LayerParams  # noqa: E402
from jax_attn.batch import ForwardBatch  # noqa: E402
from jax_attn.capture import StepRunner  # noqa: E402
from jax_attn.kv_cache import KVPool  # noqa: E402
from jax_attn.metadata import ForwardMode  # noqa: E402
from jax_attn.models import from_hf_config, load_checkpoint  # noqa: E402

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=5000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8))),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True, rope_theta=10000.0)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=4, head_dim=32)),
}


@functools.lru_cache(maxsize=None)
def _tiny_checkpoint(family: str, tmp: str):
    """A random tiny checkpoint of ``family`` saved by transformers into ``tmp``: (path, HF model)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    cfg_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, cfg_cls)(**TINY, **extra, attn_implementation="eager")
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # non-trivial biases and norms (the defaults are zeros and ones)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    path = os.path.join(tmp, family)
    model.save_pretrained(path)
    return path, model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_checkpoint_decodes_like_transformers(family, tmp_path_factory):
    import torch

    path, hf = _tiny_checkpoint(family, str(tmp_path_factory.getbasetemp()))
    ckpt = load_checkpoint(path)
    assert ckpt.config.qkv_bias == (family == "qwen2") and ckpt.config.tie_embeddings == (family == "qwen2")
    assert ckpt.config.sliding_window == (4 if family == "mistral" else 0)
    params = llama.params_from_checkpoint(ckpt)
    prompts = [np.array([5, 9, 2], np.int32), np.arange(10, 19, dtype=np.int32)]  # the window matters in the second
    run = decode_llama.run_batch(ckpt.config, params, prompts, new_tokens=3, page_size=4)
    for prompt, gen, plog in zip(prompts, run["generated"], run["paged_logits"]):
        seq = torch.as_tensor(np.concatenate([prompt, gen[:-1]])[None], dtype=torch.long)
        with torch.no_grad():
            want = hf(seq).logits[0, len(prompt) - 1:].numpy()
        np.testing.assert_allclose(np.stack(plog), want, rtol=1e-4, atol=1e-4)
        assert gen == [int(t) for t in np.argmax(want, -1)]


def test_llama3_rope_scaling_matches_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    _, _, extra = FAMILIES["llama3"]
    hf_cfg = transformers.LlamaConfig(**TINY, **extra)
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg, "cpu")
    got = from_hf_config(hf_cfg.to_dict()).rope_inv_freq()
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    plain = from_hf_config(transformers.LlamaConfig(**TINY, rope_theta=5000.0).to_dict()).rope_inv_freq()
    assert not np.allclose(got, plain)  # the scaling changed something


@pytest.mark.parametrize("model_type,fields,match", [
    ("gemma2", {}, "softcap"),
    ("phi3", {}, "fused qkv_proj"),
    ("llama", dict(hidden_act="gelu"), "hidden_act"),
    ("llama", dict(rope_scaling=dict(rope_type="yarn", factor=4.0)), "yarn"),
    ("llama", dict(attention_bias=True), "o_proj bias"),
    ("qwen2", dict(use_sliding_window=True), "use_sliding_window"),
    ("falcon", {}, "not a supported"),
])
def test_unsupported_configs_raise(model_type, fields, match):
    hf = dict(TINY, model_type=model_type, **fields)
    with pytest.raises(NotImplementedError, match=match):
        from_hf_config(hf)


# ---- a MIXED step, laid out as docs/models.md says ----------------------------------------------
def test_mixed_step_layout():
    """Extend rows first, then decode rows with ``extend_seq_lens`` 1; tokens in row order. A MIXED step
    (request 2's prompt + request 1's next token) gives the logits of separate prefill and decode steps."""
    cfg, page = llama.CONFIGS["tiny"], 4
    reqs = decode_llama.PagedRequests(batch=2, max_ctx=24, page_size=page, seed=5)
    backend = FlashAttentionBackend(reqs.req_to_token, page_size=page, max_context_len=24, impl="reference")
    params = llama.init_params(cfg, 0)
    runner = StepRunner(backend, decode_llama.make_step(cfg, backend))  # pools reused: not donated
    fresh = lambda: jax.tree.map(lambda a: jnp.full_like(a, jnp.nan), llama.new_pools(cfg, reqs.num_slots))  # noqa: E731
    a, b, a_next = np.arange(1, 8, dtype=np.int32), np.arange(30, 35, dtype=np.int32), np.int32(44)
    row_a, row_b = reqs.req_to_token[1], reqs.req_to_token[2]

    def extend(rows, lens, prefix, ids, pools, mode=ForwardMode.EXTEND):
        lens, prefix = np.asarray(lens, np.int32), np.asarray(prefix, np.int32)
        slots = np.concatenate([reqs.req_to_token[r, p:p + n] for r, p, n in zip(rows, prefix, lens)])
        pos = np.concatenate([np.arange(p, p + n) for p, n in zip(prefix, lens)]).astype(np.int32)
        fb = ForwardBatch(mode, np.asarray(rows, np.int32), prefix + lens, slots, extend_seq_lens=lens)
        out, pools = runner.eager(fb, dict(ids=ids, pos=pos), params, pools)
        return np.asarray(out), pools

    _, pools = extend([1], [7], [0], a, fresh())  # request 1 prefilled
    mixed, _ = extend([2, 1], [5, 1], [0, 7], np.concatenate([b, [a_next]]), pools, ForwardMode.MIXED)
    alone_b, _ = extend([2], [5], [0], b, fresh())
    decode_a, _ = extend([1], [1], [7], np.array([a_next]), pools)
    np.testing.assert_allclose(mixed[:5], alone_b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mixed[5], decode_a[0], rtol=1e-5, atol=1e-5)
    assert row_a[7] != row_b[0]  # distinct slots: the rows really share one pool


# ---- FlashAttentionBackend.describe --------------------------------------------------------------
def _plans(page: int):
    reqs = decode_llama.PagedRequests(batch=3, max_ctx=32, page_size=page, seed=1)
    backend = FlashAttentionBackend(reqs.req_to_token, page_size=page, max_context_len=32, attention_chunk_size=16)
    lens = np.array([9, 4, 12], np.int32)
    extend = ForwardBatch(ForwardMode.EXTEND, reqs.rows, lens, reqs.slots(np.zeros(3, np.int32), lens),
                          extend_seq_lens=lens)
    decode = ForwardBatch(ForwardMode.DECODE, reqs.rows, lens + 1, reqs.slots(lens, np.ones(3, np.int32)))
    return backend, {"EXTEND": backend.plan(extend), "DECODE": backend.plan(decode)}


def _forward_choice(backend, md, layer, dtype, monkeypatch) -> str:
    """The kernel ``backend.forward`` selects (recorded), computing with the reference instead."""
    seen = []

    def spy(impl, call, **kw):
        seen.append(kernel_policy.select_kernel(impl, call, **kw))
        return "reference"

    monkeypatch.setattr(sys.modules["jax_attn.attention"], "select_kernel", spy)  # (the package exports a
    # function of the same name as the module)
    t, hq, d = md.num_tokens, layer.num_q_heads, layer.head_dim
    pool = KVPool.zeros(int(backend.req_to_token.max()) + 1, layer.num_kv_heads, d, dtype)
    q = jnp.zeros((t, hq * d), dtype)
    kv = jnp.zeros((t, layer.num_kv_heads * d), dtype)
    backend.forward(q, kv, kv, layer, pool, md)
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("hopper", [False, True])
@pytest.mark.parametrize("dtype,head_dim,irope", [(jnp.bfloat16, 64, False), (jnp.float32, 64, False),
                                                  (jnp.bfloat16, 64, True), (jnp.bfloat16, 32, False)])
def test_describe_names_the_kernel_forward_runs(hopper, dtype, head_dim, irope, monkeypatch):
    monkeypatch.setattr(kernel_policy, "on_hopper", lambda: hopper)
    backend, plans = _plans(page=16)
    layer = LayerParams(num_q_heads=8, num_kv_heads=2, head_dim=head_dim, use_irope=irope)
    part = "local" if irope else "attention"
    for mode, md in plans.items():
        got = backend.describe(md, layer, dtype)
        assert got["mode"] == mode and got["impl"] == "auto"
        assert got[part] == _forward_choice(backend, md, layer, dtype, monkeypatch), (mode, got)
        if not hopper or dtype == jnp.float32 or head_dim == 32:
            assert got[part] == "triton"  # the CPU (interpret mode), or what Mosaic does not cover
    if hopper and dtype == jnp.bfloat16 and head_dim == 64:
        assert backend.describe(plans["EXTEND"], layer, dtype)[part] == "mosaic"


def test_describe_follows_impl():
    backend, plans = _plans(page=16)
    layer = LayerParams(num_q_heads=8, num_kv_heads=2, head_dim=64)
    backend.impl = "reference"
    assert backend.describe(plans["DECODE"], layer)["attention"] == "reference"
    with pytest.raises(ValueError, match="encoder_lens"):
        backend.describe(plans["DECODE"], LayerParams(num_q_heads=8, num_kv_heads=2, head_dim=64,
                                                      is_cross_attention=True))
