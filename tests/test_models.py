"""Real-checkpoint loading (``jax_attn.models``) and what model authors need from the backend.

Tiny random Llama, Qwen2 (qkv bias, tied embeddings), Mistral (sliding window), Gemma 2, Gemma 3 and
Phi-3 checkpoints written by transformers (``save_pretrained``: config.json + safetensors) are loaded
by ``load_checkpoint`` and decoded through the JAX API (paged prefill, captured decode; Gemma 3 also
through the torch bridge); their logits match transformers' own forward. Also: configs that raise,
rope scaling, Gemma layer types and Phi-3 LongRoPE against transformers, the MIXED batch layout that
docs/models.md describes, and ``FlashAttentionBackend.describe`` against the kernel that ``forward``
actually selects.
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
# Gemma 2/3 and Phi-3 at their families' head dims (256; Phi-3: 192 / 2 heads = 96), windows (4, 5) shorter
# than the sequences, a query_pre_attn_scalar (64) that is not head_dim, caps that bind (see _tiny_checkpoint).
SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64, rms_norm_eps=1e-6, pad_token_id=0)
GEMMA = dict(head_dim=256, sliding_window=4, query_pre_attn_scalar=64, final_logit_softcapping=3.0)
BIG_FAMILIES = {
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", dict(GEMMA, attn_logit_softcapping=2.0)),  # layer 0 sliding
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(  # layer 0 sliding (rope base 50), 1 global
        GEMMA, sliding_window_pattern=2, rope_theta=1000.0, rope_local_base_freq=50.0,
        rope_scaling=dict(rope_type="linear", factor=4.0))),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(  # 72 of 96 dims rotate; LongRoPE short factors below 32 tokens
        hidden_size=192, sliding_window=5, partial_rotary_factor=0.75, original_max_position_embeddings=32,
        rope_scaling=dict(rope_type="longrope", short_factor=[1.0 + i / 6 for i in range(36)],
                          long_factor=[4.0] * 36))),
}


@functools.lru_cache(maxsize=None)
def _tiny_checkpoint(family: str, tmp: str):
    """A random tiny checkpoint of ``family`` saved by transformers into ``tmp``: (path, HF model)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    cfg_cls, model_cls, extra = {**FAMILIES, **BIG_FAMILIES}[family]
    torch.manual_seed(0)
    config = getattr(transformers, cfg_cls)(**dict(TINY if family in FAMILIES else SMALL, **extra),
                                            attn_implementation="eager")
    model = getattr(transformers, model_cls)(config).eval()
    with torch.no_grad():  # non-trivial biases and norms (the defaults are zeros and ones)
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_((0.1 if family in FAMILIES else 0.5) * torch.randn_like(p))
            elif family in BIG_FAMILIES:  # attention scores and logits of a few units: the softcaps bind
                p.mul_(20.0 if "embed" in name else 4.0)
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
    ("gemma", {}, "Gemma 1"),
    ("gemma2", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
    ("gemma2", dict(hidden_activation="gelu"), "hidden_activation"),
    ("gemma2", dict(attention_bias=True), "attention_bias"),
    ("gemma2", dict(layer_types=["sliding_attention", "chunked_attention"]), "layer_types"),
    ("gemma3_text", dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
    ("gemma3_text", dict(rope_parameters=dict(full_attention=dict(rope_type="yarn", factor=2.0, rope_theta=1e6),
                                              sliding_attention=dict(rope_type="default", rope_theta=1e4))), "yarn"),
    ("gemma3", dict(text_config=dict(model_type="gemma3n_text")), "gemma3n_text"),
    ("gemma3", dict(text_config=dict(final_logit_softcapping=30.0)), "final_logit_softcapping"),
    ("phi3", dict(hidden_act="gelu"), "hidden_act"),
    ("phi3", dict(rope_scaling=dict(rope_type="dynamic", factor=2.0)), "dynamic"),
    ("phi3", dict(partial_rotary_factor=0.0625), "partial_rotary_factor"),  # 1 of 16 dims: odd
    ("phi3", dict(rope_scaling=dict(type="su", long_factor=[1.0] * 8)), "short_factor"),
    ("llama", dict(rope_scaling=dict(rope_type="longrope", short_factor=[1.0] * 8, long_factor=[1.0] * 8)),
     "longrope"),
    ("llama", dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)),
     "partial_rotary_factor"),
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


# ---- Gemma 2, Gemma 3, Phi-3 ---------------------------------------------------------------------
def _max_rel(ours, want) -> float:
    return float(np.max(np.abs(np.asarray(ours) - want)) / np.max(np.abs(want)))


def _hf_logits(hf, prompt, generated) -> np.ndarray:
    """transformers' logits for the positions that chose ``generated`` (teacher-forced, one sequence)."""
    import torch

    seq = torch.as_tensor(np.concatenate([prompt, generated[:-1]])[None], dtype=torch.long)
    with torch.no_grad():
        return hf(seq).logits[0, len(prompt) - 1:].numpy()


PROMPTS = (np.arange(7, 18, dtype=np.int32), np.array([5, 9, 2], np.int32))  # 11 and 3 tokens: windows bind


# Each case catches, among others (planted, each failed): Gemma's (1 + w) norm dropped; sliding and
# global layers swapped; query_pre_attn_scalar ignored; attention or final softcap dropped; post-attention /
# post-MLP norms dropped; SiLU for GeLU-tanh; Gemma 3's q/k norm dropped, local and global rope bases
# swapped, linear scaling dropped; Phi-3's fused q/k/v or gate/up split in the wrong order, full rotary
# for partial, LongRoPE's short factors or attention factor dropped, the window dropped.
# The reference attention (the kernels' head dims, windows, softcaps and scales have their own tests; the
# interpreted Triton kernel would triple this test's time on the CPU).
@pytest.mark.parametrize("family,page_size,layout", [("gemma2", 1, "list"), ("gemma2", 16, "fused"),
                                                     ("gemma3", 1, "fused"), ("gemma3", 16, "list"),
                                                     ("phi3", 1, "scan"), ("phi3", 16, "list")])
def test_gemma_phi3_checkpoints_decode_like_transformers(family, page_size, layout, tmp_path_factory):
    path, hf = _tiny_checkpoint(family, str(tmp_path_factory.getbasetemp()))
    ckpt = load_checkpoint(path)
    params = llama.with_layout(llama.params_from_checkpoint(ckpt), layout)
    run = decode_llama.run_batch(ckpt.config, params, list(PROMPTS), new_tokens=4, page_size=page_size,
                                 impl="reference", layout=layout)
    for prompt, gen, plog in zip(PROMPTS, run["generated"], run["paged_logits"]):
        want = _hf_logits(hf, prompt, gen)
        assert _max_rel(np.stack(plog), want) < 1e-4, (family, len(prompt))  # float32: measured ~1e-6
        assert gen == [int(t) for t in np.argmax(want, -1)]


def test_gemma3_through_the_torch_bridge(tmp_path_factory):
    """examples/llama_torch.py's model (q/k norm, two rope bases, sandwich norms, per-layer windows and the
    query pre-scale as RadixAttention fields) through the torch bridge: prefill, capture, replayed decode."""
    import torch

    import decode_torch
    import llama_torch
    from torch_bridge import FlashAttentionBackend

    path, hf = _tiny_checkpoint("gemma3", str(tmp_path_factory.getbasetemp()))
    ckpt = load_checkpoint(path)
    model = llama_torch.TorchLlama.from_checkpoint(ckpt)
    runner = decode_torch.make_runner(ckpt.config, len(PROMPTS), 11 + 4 + 16, 16, "reference", 0, torch.device("cpu"))
    tokens, logits, _ = decode_torch.run_bridge(model, runner, FlashAttentionBackend(runner),
                                                [torch.from_numpy(p).long() for p in PROMPTS], 4, "cpu")
    for b, prompt in enumerate(PROMPTS):
        gen = [int(t) for t in tokens[b]]
        want = _hf_logits(hf, prompt, gen)
        assert _max_rel(logits[b].numpy(), want) < 1e-4 and gen == [int(t) for t in np.argmax(want, -1)]
        dense = model.forward(torch.as_tensor(np.concatenate([prompt, gen[:-1]])), torch.arange(len(prompt) + 3),
                              model.dense_attend)[len(prompt) - 1:]
        assert _max_rel(dense.numpy(), want) < 1e-4  # decode_torch's own check agrees


def test_gemma3_image_text_checkpoint_loads_its_text_model(tmp_path):
    """A ``gemma3`` (Gemma3ForConditionalGeneration) checkpoint: the text model of its ``text_config`` (which
    holds only what differs from Gemma3TextConfig's defaults on the Hub), weights renamed, vision dropped."""
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    text = dict(SMALL, **dict(BIG_FAMILIES["gemma3"][2], vocab_size=300, final_logit_softcapping=None))  # a cap raises
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=28, patch_size=14)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=299, boi_token_index=297, eoi_token_index=298,
                                    attn_implementation="eager")
    hf = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.add_(0.5 * torch.randn_like(p)) if "norm" in name else p.mul_(4.0)
    hf.save_pretrained(tmp_path)
    ckpt = load_checkpoint(str(tmp_path))
    seq = np.arange(3, 15, dtype=np.int32)
    with torch.no_grad():
        want = hf(input_ids=torch.as_tensor(seq[None]).long()).logits[0].numpy()
    got = llama.forward_dense(ckpt.config, llama.params_from_checkpoint(ckpt), jnp.asarray(seq))
    assert _max_rel(got, want) < 1e-4
    partial = dict(model_type="gemma3", text_config=dict(hidden_size=2560, num_hidden_layers=34, sliding_window=1024,
                                                         rope_scaling=dict(rope_type="linear", factor=8.0)))
    assert from_hf_config(partial) == from_hf_config(transformers.Gemma3TextConfig(
        **partial["text_config"]).to_dict())  # gemma-3-4b's text_config: the rest from the defaults


@pytest.mark.parametrize("kind,fields", [
    ("gemma2", dict(num_hidden_layers=5)),  # no layer_types: layers 0, 2, 4 sliding
    ("gemma3_text", dict(num_hidden_layers=7, sliding_window_pattern=3, rope_theta=1e5, rope_local_base_freq=1e3,
                         rope_scaling=dict(rope_type="linear", factor=8.0))),  # the pre-transformers-5 fields
    ("gemma3_text", dict(num_hidden_layers=8))])  # pattern 6 by default: layer 5 global
def test_gemma_configs_read_like_transformers(kind, fields):
    """Layer types and per-layer rope from a config written without ``layer_types`` / ``rope_parameters`` (as
    on the Hub) equal transformers' reading of the same fields, and its own ``to_dict`` reads the same."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RotaryEmbedding
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    fields = dict(fields, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    hf_cfg = (transformers.Gemma2Config if kind == "gemma2" else transformers.Gemma3TextConfig)(**fields)
    ours = from_hf_config(dict(fields, model_type=kind))
    assert ours == from_hf_config(hf_cfg.to_dict())
    assert [ours.is_sliding(i) for i in range(ours.n_layers)] == [t == "sliding_attention" for t in hf_cfg.layer_types]
    assert len(set(ours.sliding_layers)) == 2
    for i, layer_type in enumerate(hf_cfg.layer_types):
        if kind == "gemma2":
            want = Gemma2RotaryEmbedding(hf_cfg).inv_freq
        else:
            want = getattr(Gemma3RotaryEmbedding(hf_cfg), f"{layer_type}_inv_freq")
        np.testing.assert_allclose(ours.rope_inv_freq(i), want.numpy(), rtol=1e-6)


def test_phi3_longrope_matches_transformers():
    """Phi-3's LongRoPE (also under its old names ``su`` and ``yarn``): short factors and the attention factor
    as transformers computes them (factor from max_position_embeddings / original_max_position_embeddings),
    partial rotary; a sequence past original_max_position_embeddings (HF's switch to long_factor) raises."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

    fields = dict(SMALL, **BIG_FAMILIES["phi3"][2])
    hf_cfg = transformers.Phi3Config(**fields)
    rotary = Phi3RotaryEmbedding(hf_cfg)
    factors = {k: v for k, v in fields["rope_scaling"].items() if k != "rope_type"}
    legacy = [dict(fields, model_type="phi3", rope_scaling=dict(factors, type=name))
              for name in ("longrope", "su", "yarn")]  # (transformers 5.24 itself fails on "su": no original length)
    for ours in [from_hf_config(hf_cfg.to_dict())] + [from_hf_config(hf) for hf in legacy]:
        np.testing.assert_allclose(ours.rope_inv_freq(), rotary.inv_freq.numpy(), rtol=1e-6)
        assert ours.rope_scale() == pytest.approx(rotary.attention_scaling) and ours.rope_scale() > 1.0
        assert (ours.rotary_dim, ours.head_dim, ours.max_context) == (72, 96, 32)
    with pytest.raises(NotImplementedError, match="long_factor"):
        decode_llama.run_batch(ours, None, [np.zeros(30, np.int32)], new_tokens=4, page_size=1)


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
                                                  (jnp.bfloat16, 64, True), (jnp.bfloat16, 40, False)])
def test_describe_names_the_kernel_forward_runs(hopper, dtype, head_dim, irope, monkeypatch):
    monkeypatch.setattr(kernel_policy, "on_hopper", lambda: hopper)
    backend, plans = _plans(page=16)
    layer = LayerParams(num_q_heads=8, num_kv_heads=2, head_dim=head_dim, use_irope=irope)
    part = "local" if irope else "attention"
    for mode, md in plans.items():
        got = backend.describe(md, layer, dtype)
        assert got["mode"] == mode and got["impl"] == "auto"
        assert got[part] == _forward_choice(backend, md, layer, dtype, monkeypatch), (mode, got)
        if not hopper or dtype == jnp.float32 or head_dim == 40:
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
