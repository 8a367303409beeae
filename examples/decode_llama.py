"""Prefill a ragged batch of prompts, then greedy-decode through jax_attn's paged backend.

    python examples/decode_llama.py --config tiny        # CPU, kernels in interpret mode
    python examples/decode_llama.py --config 1b          # GPU, 1B-class shapes (32/8 heads, d=128)

Prefill runs the EXTEND plan eagerly; decode steps replay executables captured per batch bucket.
The script checks itself against the same model with dense (non-paged) attention: identical greedy
tokens (teacher-forced, ties excepted) and close logits; it exits non-zero on a mismatch.
``--layout`` picks how weights and pools reach the compiled step (``llama.LAYOUTS``); every layout
runs the same model and the same check.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama  # noqa: E402

from jax_attn.backend import FlashAttentionBackend  # noqa: E402
from jax_attn.batch import ForwardBatch, bucket_for  # noqa: E402
from jax_attn.capture import StepRunner  # noqa: E402
from jax_attn.metadata import ForwardMode  # noqa: E402

DEFAULT_LAYOUT = "list"


class PagedRequests:
    """A minimal request table: rows 1..B, pages handed out in shuffled order (row/page 0 reserved)."""

    def __init__(self, batch: int, max_ctx: int, page_size: int, seed: int):
        pages_per = -(-max_ctx // page_size)
        num_pages = batch * pages_per + 1
        order = np.random.default_rng(seed).permutation(np.arange(1, num_pages))
        self.num_slots = num_pages * page_size
        self.req_to_token = np.zeros((batch + 1, max_ctx), np.int32)
        for r in range(batch):
            pages = order[r * pages_per:(r + 1) * pages_per]
            slots = (pages[:, None] * page_size + np.arange(page_size)[None]).reshape(-1)
            self.req_to_token[r + 1] = slots[:max_ctx]
        self.rows = np.arange(1, batch + 1, dtype=np.int32)

    def slots(self, starts, lens) -> np.ndarray:
        return np.concatenate([self.req_to_token[r, s:s + n] for r, s, n in zip(self.rows, starts, lens)])


def make_step(cfg, backend, layout="list"):
    def step(md, tokens, params, pools):
        return llama.forward_paged(cfg, backend, params, md, tokens["ids"], tokens["pos"], pools,
                                   scan=layout == "scan")
    return step


def check_against_dense(cfg, params, prompts, generated, paged_logits, tol):
    """Teacher-forced dense run per sequence: same greedy tokens (ties excepted), close logits."""
    worst, mismatches = 0.0, 0
    for prompt, gen, plog in zip(prompts, generated, paged_logits):
        seq = np.concatenate([prompt, gen[:-1]]).astype(np.int32)
        dense = np.asarray(llama.forward_dense(cfg, params, jnp.asarray(seq)))[len(prompt) - 1:]
        plog = np.stack(plog)
        worst = max(worst, float(np.max(np.abs(dense - plog)) / (np.max(np.abs(dense)) + 1e-9)))
        top2 = np.sort(dense, -1)[:, -2:]
        for i, tok in enumerate(gen):
            if tok != int(np.argmax(dense[i])) and top2[i, 1] - top2[i, 0] > tol * np.abs(top2[i, 1]):
                mismatches += 1
    return worst, mismatches


def main(config="tiny", batch=4, min_prompt=5, max_prompt=24, new_tokens=8, page_size=4,
         impl="auto", seed=0, check=True, layout=DEFAULT_LAYOUT):
    cfg = llama.CONFIGS[config]
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(min_prompt, max_prompt + 1, batch).astype(np.int32)
    prompts = [rng.integers(0, cfg.vocab, n).astype(np.int32) for n in prompt_lens]
    max_ctx = int(prompt_lens.max()) + new_tokens + page_size
    reqs = PagedRequests(batch, max_ctx, page_size, seed)
    backend = FlashAttentionBackend(reqs.req_to_token, page_size=page_size, max_context_len=max_ctx, impl=impl,
                                    num_heads=(cfg.n_heads, cfg.n_kv_heads))
    params = llama.with_layout(llama.init_params(cfg, seed), layout)
    pools = llama.layout_pools(cfg, layout, reqs.num_slots)
    runner = StepRunner(backend, make_step(cfg, backend, layout), batch_buckets=(1, 2, 4, 8, 16, 32, 64),
                        donate_argnums=(1,))

    # Prefill (EXTEND, no prefix): ragged prompts in one call.
    zeros = np.zeros(batch, np.int32)
    fb = ForwardBatch(ForwardMode.EXTEND, reqs.rows, prompt_lens, reqs.slots(zeros, prompt_lens),
                      extend_seq_lens=prompt_lens)
    tokens = dict(ids=jnp.asarray(np.concatenate(prompts)),
                  pos=jnp.asarray(np.concatenate([np.arange(n) for n in prompt_lens]), jnp.int32))
    t0 = time.perf_counter()
    logits, pools = runner.eager(fb, tokens, params, pools)
    last = np.asarray(logits)[np.cumsum(prompt_lens) - 1]
    prefill_s = time.perf_counter() - t0
    paged_logits = [[row] for row in last]
    generated = [[int(np.argmax(row))] for row in last]

    # Decode: capture the bucket, then replay every step.
    seq_lens = prompt_lens.copy()

    def decode_batch():
        return ForwardBatch(ForwardMode.DECODE, reqs.rows, seq_lens + 1, reqs.slots(seq_lens, np.ones_like(seq_lens)))

    dec_tokens = lambda: dict(ids=jnp.asarray([g[-1] for g in generated], jnp.int32),  # noqa: E731
                              pos=jnp.asarray(seq_lens, jnp.int32))
    runner.capture([decode_batch()], dec_tokens(), params, pools)
    t0, steps = time.perf_counter(), 0
    for _ in range(new_tokens - 1):
        logits, pools = runner.replay(decode_batch(), dec_tokens(), params, pools)
        logits = np.asarray(logits)  # host sync: greedy sampling on the host
        seq_lens += 1
        steps += 1
        for b in range(batch):
            paged_logits[b].append(logits[b])
            generated[b].append(int(np.argmax(logits[b])))
    decode_s = time.perf_counter() - t0

    bucket = bucket_for(batch, runner.batch_buckets)
    print(f"device={jax.devices()[0].device_kind} impl={backend.impl} config={config} batch={batch} "
          f"(bucket {bucket}) page_size={page_size} layout={layout} prompts={prompt_lens.tolist()}")
    print(f"prefill: {int(prompt_lens.sum())} tokens in {prefill_s:.2f}s (includes compile)")
    if steps:
        print(f"decode: {steps} steps, {steps * batch / decode_s:.1f} tokens/s, {1e3 * decode_s / steps:.2f} ms/step")
    for b in range(min(batch, 4)):
        print(f"  request {b}: {generated[b]}")
    if not check:
        return 0
    tol = 1e-4 if cfg.dtype == "float32" else 2e-2
    worst, mismatches = check_against_dense(cfg, params, prompts, generated, paged_logits, tol)
    ok = mismatches == 0 and worst < (1e-3 if cfg.dtype == "float32" else 5e-2)
    print(f"check vs dense attention: max rel logit diff {worst:.2e}, token mismatches {mismatches}: "
          f"{'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def parse():
    ap = llama.decode_arg_parser(__doc__)
    ap.add_argument("--layout", default=DEFAULT_LAYOUT, choices=llama.LAYOUTS,
                    help="how weights and KV pools are passed to the step (see llama.LAYOUTS)")
    ap.add_argument("--stacked", dest="layout", action="store_const", const="scan",
                    help="same as --layout scan (layer-stacked weights and pool under lax.scan)")
    return vars(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main(**parse()))
