"""The README's main command (examples/decode_llama.py) runs, and its self-check can fail."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import decode_llama  # noqa: E402
import llama  # noqa: E402


def test_decode_example_passes_its_check():
    assert decode_llama.main(config="tiny", batch=3, new_tokens=4, page_size=4, impl="auto", seed=1) == 0


def test_decode_example_check_detects_wrong_tokens():
    cfg = llama.CONFIGS["tiny"]
    params = llama.init_params(cfg, 0)
    prompt = np.arange(6, dtype=np.int32)
    dense = np.asarray(llama.forward_dense(cfg, params, np.concatenate([prompt, [0, 0]]).astype(np.int32)))
    good = [int(np.argmax(dense[5]))]
    logits = [dense[5]]
    worst, mism = decode_llama.check_against_dense(cfg, params, [prompt], [good], [logits], 1e-4)
    assert mism == 0 and worst < 1e-5
    bad = [(good[0] + 1) % cfg.vocab]
    _, mism = decode_llama.check_against_dense(cfg, params, [prompt], [bad], [[dense[5] + 1.0]], 1e-4)
    assert mism == 1


def test_torch_engine_example_passes_its_check():
    import decode_torch

    assert decode_torch.main(config="tiny", batch=3, new_tokens=4, page_size=4, seed=2) == 0
