"""A minimal torch engine: prefill a ragged batch, then greedy-decode through torch_bridge.

    python examples/decode_torch.py --config tiny      # CPU: torch CPU tensors + JAX CPU (interpret)
    python examples/decode_torch.py --config 1b        # GPU: 1B-class shapes (32/8 heads, d=128)

The engine speaks SGLang's backend interface: ``init_forward_metadata`` for the prefill (EXTEND),
the capture hook once for the decode bucket, then the replay hook per decode step. On Hopper GPUs
with a page size the Mosaic kernel takes (e.g. ``--page-size 16``) the bridge launches attention on
torch's stream, so the whole decode step is captured in a ``torch.cuda.graph`` and replayed. The script
checks itself against the same torch model with dense SDPA attention (teacher-forced: identical
greedy tokens, ties excepted, and close logits), times decode steps through the bridge and through
SDPA over a contiguous KV cache, and exits non-zero on a mismatch.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama_torch as lt  # noqa: E402
from llama import decode_arg_parser  # noqa: E402

from jax_attn.batch import bucket_for  # noqa: E402
from jax_attn.kernels.mosaic_paged import unsupported  # noqa: E402
from torch_bridge import (FlashAttentionBackend, ForwardBatch, ForwardMode, MHATokenToKVPool,  # noqa: E402
                          ModelConfig, ModelRunner, ReqToTokenPool)

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def make_runner(cfg, batch: int, max_ctx: int, page_size: int, impl: str, seed: int, device):
    """Request rows 1..B with pages handed out in shuffled order (row 0 / page 0 reserved)."""
    pages_per = -(-max_ctx // page_size)
    num_pages = batch * pages_per + 1
    order = torch.from_numpy(np.random.default_rng(seed).permutation(np.arange(1, num_pages)))
    r2t = torch.zeros(batch + 1, max_ctx, dtype=torch.int32)
    for r in range(batch):
        pages = order[r * pages_per:(r + 1) * pages_per]
        r2t[r + 1] = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:max_ctx]
    pool = MHATokenToKVPool.create(num_pages * page_size, cfg.n_layers, cfg.n_kv_heads, cfg.head_dim,
                                   lt._DTYPES[cfg.dtype], device)
    return ModelRunner(ReqToTokenPool(r2t.to(device)), pool, ModelConfig(max_ctx), page_size=page_size,
                       attention_impl=impl, device=str(device))


def slots(runner, rows, starts, lens):
    r2t = runner.req_to_token_pool.req_to_token
    return torch.cat([r2t[r, s:s + n] for r, s, n in zip(rows.tolist(), starts.tolist(), lens.tolist())]).long()


def sync(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def run_bridge(model, runner, backend, prompts, new_tokens, device):
    """Prefill (eager plan) + decode (capture the bucket once, replay per step). Greedy tokens/logits."""
    batch = len(prompts)
    model.cfg.check_context(max(len(p) for p in prompts) + new_tokens - 1)  # LongRoPE: raises past its short factors
    pool = runner.token_to_kv_pool
    rows = torch.arange(1, batch + 1, device=device)
    lens = torch.tensor([len(p) for p in prompts], device=device)
    ids = torch.cat(prompts)
    pos = torch.cat([torch.arange(n, device=device) for n in lens.tolist()])
    fb = ForwardBatch(ForwardMode.EXTEND, batch, rows, lens, slots(runner, rows, lens * 0, lens),
                      extend_seq_lens=lens, positions=pos, token_to_kv_pool=pool, attn_backend=backend)
    backend.init_forward_metadata(fb)
    last = model.forward(ids, pos, lt.bridge_attend(model, fb))[lens.cumsum(0) - 1]
    logits, tokens = [last], [last.argmax(-1)]

    bucket = bucket_for(batch, BUCKETS)
    zeros = torch.zeros(bucket, dtype=torch.long, device=device)
    # The bucket's static input buffers, as SGLang's graph runner keeps them: the capture hook and every
    # replay hook get these tensors, new values copied in (padding rows: row 0, seq_len 1). A captured
    # decode step recomputes its attention tables from them inside the graph.
    static_rows, static_lens = zeros.clone(), zeros + 1
    hooks = backend.cuda_graph_blocker() is None  # False: some layer runs JAX here, CUDA graphs refused
    graph = None
    if hooks:
        backend.init_cuda_graph_state(BUCKETS[-1], BUCKETS[-1])
        backend.init_forward_metadata_capture_cuda_graph(bucket, bucket, static_rows, static_lens, None,
                                                         ForwardMode.DECODE, None)
        cap = ForwardBatch(ForwardMode.DECODE, bucket, static_rows, static_lens, zeros, token_to_kv_pool=pool,
                           attn_backend=backend)
        model.forward(zeros, zeros, lt.bridge_attend(model, cap))  # the capture run: compiles attention (slot 0)
        graph = capture_decode(model, cap) if launches(backend, model.cfg, runner.page_size) else None
    sync(device)
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
        loc = slots(runner, rows, lens, torch.ones_like(lens))
        fb = ForwardBatch(ForwardMode.DECODE, batch, rows, lens + 1, loc, positions=lens,
                          token_to_kv_pool=pool, attn_backend=backend)
        if graph is None:  # eager layers: the hook takes the real rows and pads them itself (or an eager plan)
            if hooks:
                backend.init_forward_metadata_replay_cuda_graph(bucket, rows, lens + 1, None, None,
                                                                ForwardMode.DECODE, None, None, out_cache_loc=loc)
            else:
                backend.init_forward_metadata(fb)
            step = model.forward(tokens[-1], lens, lt.bridge_attend(model, fb))
        else:
            static_rows[batch:], static_lens[batch:] = 0, 1
            static_rows[:batch], static_lens[:batch] = rows, lens + 1
            backend.init_forward_metadata_replay_cuda_graph(bucket, static_rows, static_lens, None, None,
                                                            ForwardMode.DECODE, None, None)
            step = graph(tokens[-1], lens, loc)
        logits.append(step)
        tokens.append(step.argmax(-1))
        lens = lens + 1
    sync(device)
    return torch.stack(tokens, 1), torch.stack(logits, 1), (time.perf_counter() - t0) / max(new_tokens - 1, 1)


def launches(backend, cfg, page_size: int) -> bool:
    """Whether the bridge launches this model's attention itself (the Mosaic path covers its dtype,
    head dim and page size): only then can a ``torch.cuda.graph`` capture the decode step."""
    return backend.mosaic_path is not None and unsupported(
        cfg.dtype, cfg.dtype, cfg.dtype, cfg.head_dim, cfg.head_dim, page_size) is None


def capture_decode(model, cap):
    """The bucket's decode step captured whole in a ``torch.cuda.graph`` (the bridge's launch path
    is capturable). Returns ``step(ids, positions, out_cache_loc) -> logits`` for the real rows:
    it copies them into the captured inputs (padding rows: token 0, position 0, slot 0) and replays.
    Call the replay hook first, with the bucket's static buffers holding the step's rows and lengths: the
    graph recomputes the tables its kernels read from those buffers."""
    ids, pos, loc = (cap.out_cache_loc.clone() for _ in range(3))
    fb = dataclasses.replace(cap, positions=pos, out_cache_loc=loc)
    model.forward(ids, pos, lt.bridge_attend(model, fb))  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        logits = model.forward(ids, pos, lt.bridge_attend(model, fb))

    def step(new_ids, new_pos, new_loc):
        n = new_ids.shape[0]
        for dst, src in ((ids, new_ids), (pos, new_pos), (loc, new_loc)):
            dst.zero_()
            dst[:n] = src
        g.replay()
        return logits[:n].clone()
    step.graph = g
    return step


def run_sdpa_decode(model, prompts, tokens, max_ctx, device):
    """Native baseline: the same decode steps (teacher-forced) with SDPA over a contiguous cache."""
    cfg = model.cfg
    kv = lt.ContiguousKV(cfg, len(prompts), max_ctx, model.dtype, device)
    for b, p in enumerate(prompts):
        model.forward(p, torch.arange(len(p), device=device), kv.prefill_attend(b))
    kv.lens = torch.tensor([len(p) for p in prompts], device=device)
    steps = tokens.shape[1] - 1
    sync(device)
    t0 = time.perf_counter()
    out = []
    for s in range(steps):
        out.append(model.forward(tokens[:, s], kv.lens, kv.decode_attend()))
        kv.lens = kv.lens + 1
    sync(device)
    return torch.stack(out, 1) if out else None, (time.perf_counter() - t0) / max(steps, 1)


def check_dense(model, prompts, tokens, logits, tol):
    """Teacher-forced dense SDPA per sequence: worst relative logit diff and greedy mismatches."""
    worst, mismatches = 0.0, 0
    for b, p in enumerate(prompts):
        seq = torch.cat([p, tokens[b, :-1]])
        dense = model.forward(seq, torch.arange(len(seq), device=seq.device), model.dense_attend)[len(p) - 1:]
        worst = max(worst, float((dense - logits[b]).abs().max() / (dense.abs().max() + 1e-9)))
        top2 = dense.topk(2, -1).values
        decisive = (top2[:, 0] - top2[:, 1]) > tol * top2[:, 0].abs()
        mismatches += int(((tokens[b] != dense.argmax(-1)) & decisive).sum())
    return worst, mismatches


def main(config="tiny", batch=4, min_prompt=5, max_prompt=24, new_tokens=8, page_size=4, impl="auto",
         seed=0, device=None, check=True):
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cfg = lt.CONFIGS[config]
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(min_prompt, max_prompt + 1, batch)
    prompts = [torch.from_numpy(rng.integers(0, cfg.vocab, n)).to(device) for n in prompt_lens]
    max_ctx = int(prompt_lens.max()) + new_tokens + page_size
    model = lt.TorchLlama(cfg, seed, device)
    runner = make_runner(cfg, batch, max_ctx, page_size, impl, seed, device)
    backend = FlashAttentionBackend(runner)
    tokens, logits, bridge_s = run_bridge(model, runner, backend, prompts, new_tokens, device)
    sdpa_logits, sdpa_s = run_sdpa_decode(model, prompts, tokens, max_ctx, device)

    launch = ("Mosaic launch path, decode step in a CUDA graph" if launches(backend, cfg, page_size)
              else "JAX executables")
    print(f"device={device} impl={backend.jax_backend.impl} config={config} batch={batch} "
          f"page_size={page_size} attention via {launch} prompts={prompt_lens.tolist()}")
    print(f"decode step: bridge {1e3 * bridge_s:.2f} ms, SDPA contiguous KV {1e3 * sdpa_s:.2f} ms "
          f"(ratio {bridge_s / sdpa_s:.2f}x)")
    for b in range(min(batch, 4)):
        print(f"  request {b}: {tokens[b].tolist()}")
    if not check:
        return 0
    tol = 1e-4 if cfg.dtype == "float32" else 2e-2
    worst, mismatches = check_dense(model, prompts, tokens, logits, tol)
    base_diff = 0.0 if sdpa_logits is None else float(
        (sdpa_logits - logits[:, 1:]).abs().max() / (sdpa_logits.abs().max() + 1e-9))
    limit = 1e-3 if cfg.dtype == "float32" else 5e-2
    ok = mismatches == 0 and worst < limit and base_diff < limit
    print(f"check vs dense SDPA: max rel logit diff {worst:.2e} (vs contiguous-KV decode {base_diff:.2e}), "
          f"token mismatches {mismatches}: {'OK' if ok else 'FAILED'}")
    return 0 if ok else 1


def parse():
    ap = decode_arg_parser(__doc__)
    ap.add_argument("--device", default=None)
    return vars(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main(**parse()))
