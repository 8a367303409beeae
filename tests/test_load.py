"""A 300-step random serving load through the JAX backend: requests arrive, prefill in chunks
(extend with prefix), decode, verify speculative chains, finish; their pages are reallocated from a
shuffled free list and NaN-filled when freed. Every step runs at a fixed bucket (batch 8, tokens
32), so after warm-up nothing retraces; every output row is checked against a float64 oracle built
from the engine's own copy of each request's K/V (not from the pool), so a write to another
request's slot, a stale page table or a padding row leaking into a real one all show up.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_attn.backend import FlashAttentionBackend, LayerParams
from jax_attn.batch import ForwardBatch, SpecInfo
from jax_attn.kv_cache import KVPool
from jax_attn.metadata import ForwardMode

HQ, HKV, D, CTX, ROWS, BS, TOKENS, N_DRAFT = 4, 2, 16, 48, 6, 8, 32, 3
LAYER = LayerParams(HQ, HKV, D, scaling=0.41, sliding_window_size=-1)
STEPS = 300


class Engine:
    """Request rows, a shuffled page allocator and each request's true K/V."""

    def __init__(self, page_size: int, rng):
        self.ps, self.rng = page_size, rng
        pages_per_req = -(-CTX // page_size)
        self.num_pages = 1 + ROWS * pages_per_req + 4
        self.free = list(rng.permutation(np.arange(1, self.num_pages)))
        self.table = np.zeros((ROWS + 1, CTX), np.int32)
        self.reqs = {}  # row -> dict(target, k [n, Hkv, D], v)
        k = np.full((self.num_pages * page_size, HKV, D), np.nan, np.float32)
        k[0] = 0.0
        self.pool = KVPool(jnp.asarray(k), jnp.asarray(k))

    def admit(self):
        row = next(r for r in range(1, ROWS + 1) if r not in self.reqs)
        n_pages = -(-CTX // self.ps)
        pages = [self.free.pop(self.rng.integers(len(self.free))) for _ in range(n_pages)]
        slots = (np.asarray(pages)[:, None] * self.ps + np.arange(self.ps)).reshape(-1)[:CTX]
        self.table[row] = slots
        self.reqs[row] = dict(target=int(self.rng.integers(6, CTX - N_DRAFT)), k=np.zeros((0, HKV, D)),
                              v=np.zeros((0, HKV, D)), pages=pages)

    def finish(self, row):
        req = self.reqs.pop(row)
        slots = (np.asarray(req["pages"])[:, None] * self.ps + np.arange(self.ps)).reshape(-1)
        nan = jnp.full((len(slots), HKV, D), jnp.nan)
        self.pool = KVPool(self.pool.k.at[slots].set(nan), self.pool.v.at[slots].set(nan))
        self.free += req["pages"]
        self.table[row] = 0


def oracle(q, keys, vals, n_q):
    """float64 bottom-right causal attention of n_q queries over keys [n, Hkv, D]."""
    out = np.zeros((n_q, HQ, D))
    n = keys.shape[0]
    for i in range(n_q):
        vis = n - n_q + i + 1
        for h in range(HQ):
            s = keys[:vis, h // (HQ // HKV)] @ q[i, h] * LAYER.scaling
            e = np.exp(s - s.max())
            out[i, h] = e @ vals[:vis, h // (HQ // HKV)] / e.sum()
    return out


def next_step(eng: Engine, rng):
    """(mode, rows, seq_lens, new tokens per row, spec) of a random step over the live requests."""
    if len(eng.reqs) < ROWS and (not eng.reqs or rng.random() < 0.25):
        eng.admit()
    prefilling = [r for r, q in eng.reqs.items() if len(q["k"]) == 0 or len(q["k"]) < 4]
    if prefilling:
        rows = prefilling[:3]
        new = [int(rng.integers(1, 9)) for _ in rows]
        return ForwardMode.EXTEND, rows, new, None
    rows = list(eng.reqs)[:BS]
    if rng.random() < 0.3:
        return ForwardMode.TARGET_VERIFY, rows, [N_DRAFT] * len(rows), SpecInfo(num_draft_tokens=N_DRAFT)
    return ForwardMode.DECODE, rows, [1] * len(rows), None


@pytest.mark.parametrize("page_size", [1, 16])
def test_random_load_matches_float64_without_retrace(page_size):
    rng = np.random.default_rng(page_size)
    eng = Engine(page_size, rng)
    backend = FlashAttentionBackend(eng.table, page_size=page_size, max_context_len=CTX, impl="reference",
                                    num_slots=eng.num_pages * page_size)
    traces = []

    def step(md, q, k, v, pool):
        traces.append(1)
        return backend.forward(q, k, v, LAYER, pool, md)
    run = jax.jit(step, donate_argnums=4)
    mismatches, warm = 0, None
    for it in range(STEPS):
        mode, rows, new, spec = next_step(eng, rng)
        committed = [len(eng.reqs[r]["k"]) for r in rows]
        loc = np.concatenate([eng.table[r, c:c + n] for r, c, n in zip(rows, committed, new)])
        lens = np.asarray(committed) + (0 if mode == ForwardMode.TARGET_VERIFY else np.asarray(new))
        ext = np.asarray(new) if mode == ForwardMode.EXTEND else None
        batch = ForwardBatch(mode, np.asarray(rows), lens, loc, extend_seq_lens=ext, spec_info=spec)
        backend.req_to_token = eng.table  # the engine's table changes as requests come and go
        per_req = {ForwardMode.DECODE: 1, ForwardMode.TARGET_VERIFY: N_DRAFT}.get(mode)
        md = backend.plan(batch, bs=BS, num_tokens=TOKENS if per_req is None else BS * per_req)
        t = md.num_tokens
        q, k, v = (rng.standard_normal((t, h, D)).astype(np.float32) for h in (HQ, HKV, HKV))
        out, eng.pool = run(md, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), eng.pool)
        out = np.asarray(out).reshape(t, HQ, D)
        at = 0
        for r, n in zip(rows, new):
            req = eng.reqs[r]
            req["k"] = np.concatenate([req["k"], k[at:at + n]])
            req["v"] = np.concatenate([req["v"], v[at:at + n]])
            want = oracle(q[at:at + n].astype(np.float64), req["k"], req["v"], n)
            err = np.abs(out[at:at + n] - want).max(axis=(1, 2)) / np.abs(want).max(axis=(1, 2))
            mismatches += int((err > 1e-4).sum())
            at += n
            if mode == ForwardMode.TARGET_VERIFY:  # keep one accepted token, as after verification
                req["k"], req["v"] = req["k"][:len(req["k"]) - n + 1], req["v"][:len(req["v"]) - n + 1]
            if len(req["k"]) >= req["target"]:
                eng.finish(r)
        if it == 60:
            warm = len(traces)
    assert mismatches == 0, f"{mismatches} token rows differ from the float64 oracle"
    assert len(traces) == warm, f"{len(traces) - warm} retraces after warm-up"
