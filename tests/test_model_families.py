"""The model-family table of docs/models.md, kept true: one tiny layer of each family through torch_bridge
(torch CPU tensors, the reference kernels), checked against a float64 softmax written out here; the
"raises" rows raise NotImplementedError before anything is written. The table and FAMILIES must agree."""

import dataclasses
import enum
import os
import re
import types

import numpy as np
import pytest
import torch

from tests.paging import shuffled_table
from torch_bridge import (FlashAttentionBackend, FlashAttentionMultiStepBackend, ForwardBatch, ForwardMode,
                          MHATokenToKVPool, MLATokenToKVPool, ModelRunner, RadixAttention, ReqToTokenPool, ServerArgs,
                          SpecInfo)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
D, MAX_CTX, PAGE = 16, 48, 4
LATENT, ROPE = 16, 8  # MLA rows: the latent (also the value row), then the rope part
ROWS, COMMITTED = np.array([3, 1]), np.array([9, 14])  # request rows and committed tokens of every case
AttentionArch = enum.Enum("AttentionArch", "MHA MLA")  # SGLang's model_config.attention_arch values


@dataclasses.dataclass(frozen=True)
class Family:
    """One row of docs/models.md: what a model of the family asks of the attention backend."""

    name: str  # the row's first column
    status: str  # "works" or "raises"
    heads: tuple = (4, 2)  # (Hq, Hkv)
    layers: tuple = ({},)  # RadixAttention options per layer (logit_cap, sliding_window_size, use_irope)
    sinks: bool = False  # gpt-oss: per-head sink logits passed to forward(..., sinks=)
    config: dict = dataclasses.field(default_factory=dict)  # model_config attributes
    steps: str = "prefill_decode"  # which steps run (see run_family)
    topk: int = 0  # speculative: server_args.speculative_eagle_topk


FAMILIES = [
    Family("Llama", "works"),
    Family("Qwen", "works", heads=(4, 1)),
    Family("Mistral (sliding window)", "works", layers=({"sliding_window_size": 5},)),
    Family("Gemma (logit softcap)", "works", layers=({"logit_cap": 4.0}, {"logit_cap": 4.0, "sliding_window_size": 6})),
    Family("gpt-oss (attention sinks)", "works", sinks=True, layers=({}, {"sliding_window_size": 6})),
    Family("Llama 4 (chunked local attention)", "works", config={"is_local_attention_model": True,
                                                                  "attention_chunk_size": 8},
           layers=({"use_irope": True}, {})),  # a chunked RoPE layer and a global NoPE layer
    Family("DeepSeek (MLA)", "works", heads=(4, 1), config={"attention_arch": AttentionArch.MLA}),
    Family("DeepSeek MTP (MLA, EAGLE chain)", "works", heads=(4, 1), config={"attention_arch": AttentionArch.MLA},
           steps="eagle", topk=1),
    Family("DeepSeek (MLA, EAGLE tree)", "works", heads=(4, 1), config={"attention_arch": AttentionArch.MLA},
           steps="eagle", topk=2),
    Family("EAGLE speculative, chain (topk 1)", "works", steps="eagle", topk=1),
    Family("EAGLE speculative, tree (topk > 1)", "works", steps="eagle", topk=2),
    Family("NGRAM speculative", "works", steps="ngram", topk=2),
]
N_DRAFT, N_STEPS = 5, 3  # verify tokens per request; EAGLE draft steps


# ---- the world: one model runner, its pool, and a float64 oracle over that pool ----------------------
class World:
    def __init__(self, fam: Family, seed: int = 0):
        self.fam, self.rng = fam, np.random.default_rng(seed)
        self.hq, self.hkv = fam.heads
        self.table, num_slots = shuffled_table(6, MAX_CTX, PAGE, seed)
        self.mla = fam.config.get("attention_arch") == AttentionArch.MLA  # one latent pool, values its latent part
        self.dk, self.dv = (LATENT + ROPE, LATENT) if self.mla else (D, D)
        if self.mla:
            pool = MLATokenToKVPool.create(num_slots, len(fam.layers), LATENT, ROPE, torch.float32)
            bufs = pool.kv_buffer
        else:
            pool = MHATokenToKVPool.create(num_slots, len(fam.layers), self.hkv, D, torch.float32)
            bufs = pool.k_buffer + pool.v_buffer
        for buf in bufs:  # committed tokens random, everything else NaN
            buf.fill_(float("nan"))
            buf[0] = 0.0
            for r, n in zip(ROWS, COMMITTED):
                buf[self.slots(r, 0, n)] = self.randn(n, self.hkv, buf.shape[-1])
        config = types.SimpleNamespace(context_len=MAX_CTX, **fam.config)
        args = ServerArgs(speculative_eagle_topk=fam.topk or None, speculative_num_draft_tokens=N_DRAFT)
        self.runner = ModelRunner(ReqToTokenPool(torch.from_numpy(self.table).clone()), pool, config,
                                  page_size=PAGE, server_args=args, attention_impl="reference")
        self.sinks = self.randn(self.hq) if fam.sinks else None
        self.chunk = fam.config.get("attention_chunk_size") if fam.config.get("is_local_attention_model") else None

    def randn(self, *shape):
        return torch.from_numpy(self.rng.standard_normal(shape).astype(np.float32))

    def slots(self, row, start, n):
        return torch.from_numpy(self.table[row, start:start + n].astype(np.int64))

    def layer(self, i):
        return RadixAttention(self.hq, self.dk, self.dk**-0.5, self.hkv, i, v_head_dim=self.dv, **self.fam.layers[i])

    def qkv(self, n):
        return self.randn(n, self.hq * self.dk), self.randn(n, self.hkv * self.dk), self.randn(n, self.hkv * self.dv)

    def pool(self, i):
        return [b.double().numpy() for b in self.runner.token_to_kv_pool.get_kv_buffer(i)]

    def oracle(self, i, q, keys, positions, qpos):
        """float64 attention of one query ``q [Hq * D]`` over slots ``keys`` at ``positions``."""
        opts, (kb, vb) = self.fam.layers[i], self.pool(i)
        window, cap = opts.get("sliding_window_size", -1), opts.get("logit_cap", 0.0)
        vis = (positions <= qpos) & ((positions >= qpos - window) if window >= 0 else True)
        if opts.get("use_irope") and self.chunk:  # Llama 4 local layer: the query's own chunk only
            vis &= positions >= qpos // self.chunk * self.chunk
        q, g, out = q.double().numpy().reshape(self.hq, self.dk), self.hq // self.hkv, np.zeros((self.hq, self.dv))
        for h in range(self.hq):
            s = kb[keys[vis], h // g] @ q[h] * self.dk**-0.5
            s = cap * np.tanh(s / cap) if cap > 0 else s
            m = s.max() if self.sinks is None else max(s.max(), float(self.sinks[h]))
            p = np.exp(s - m)
            den = p.sum() + (0.0 if self.sinks is None else np.exp(float(self.sinks[h]) - m))
            out[h] = p @ vb[keys[vis], h // g] / den
        return out.reshape(-1)

    def forward(self, backend, i, q, k, v, fb):
        return backend.forward(q, k, v, self.layer(i), fb, sinks=self.sinks).numpy()


def batch(mode, w, q_lens, seq_lens, loc, spec=None, extend=False):
    return ForwardBatch(mode, len(ROWS), torch.from_numpy(ROWS.astype(np.int64)),
                        torch.from_numpy(np.asarray(seq_lens, np.int64)), loc, spec_info=spec,
                        extend_seq_lens=torch.from_numpy(np.asarray(q_lens, np.int64)) if extend else None,
                        token_to_kv_pool=w.runner.token_to_kv_pool)


# ---- steps -------------------------------------------------------------------------------------------
def check_causal_step(w, backend, mode, q_lens, spec=None, extend=False, kv_before=COMMITTED):
    """``q_lens[b]`` new tokens after ``kv_before[b]`` keys, every layer: bottom-right causal."""
    loc = torch.cat([w.slots(r, c, n) for r, c, n in zip(ROWS, kv_before, q_lens)])
    seq_lens = COMMITTED if mode == ForwardMode.TARGET_VERIFY else kv_before + q_lens
    fb = batch(mode, w, q_lens, seq_lens, loc, spec, extend)
    backend.init_forward_metadata(fb)
    for i in range(len(w.fam.layers)):
        q, k, v = w.qkv(int(sum(q_lens)))
        got = w.forward(backend, i, q, k, v, fb)
        t = 0
        for r, c, n in zip(ROWS, kv_before, q_lens):
            keys, pos = w.table[r, :c + n], np.arange(c + n)
            for j in range(n):
                np.testing.assert_allclose(got[t], w.oracle(i, q[t], keys, pos, c + j), rtol=1e-4, atol=1e-5)
                t += 1


def prefill_decode(w):
    backend, prefill = FlashAttentionBackend(w.runner), np.array([4, 6])
    check_causal_step(w, backend, ForwardMode.EXTEND, prefill, extend=True)  # prefill after a cached prefix
    check_causal_step(w, backend, ForwardMode.DECODE, np.array([1, 1]), kv_before=COMMITTED + prefill)


def tree_mask():  # N_DRAFT draft tokens: 0 -> {1, 2}, 1 -> 3, 2 -> 4
    m = np.eye(N_DRAFT, dtype=bool)
    m[1:, 0] = True
    m[3, 1] = m[4, 2] = True
    return m


def tree_verify(w, spec):
    """Target verify of a draft tree: committed keys plus the draft keys on each token's path."""
    backend, mask = FlashAttentionBackend(w.runner), tree_mask()
    loc = torch.cat([w.slots(r, c, N_DRAFT) for r, c in zip(ROWS, COMMITTED)])
    spec.custom_mask = torch.from_numpy(np.concatenate(  # SGLang's flat mask: N rows of (committed, drafts)
        [np.concatenate([np.ones((N_DRAFT, c), bool), mask], 1).reshape(-1) for c in COMMITTED]))
    fb = batch(ForwardMode.TARGET_VERIFY, w, [N_DRAFT] * 2, COMMITTED, loc, spec)
    backend.init_forward_metadata(fb)
    q, k, v = w.qkv(2 * N_DRAFT)
    got = w.forward(backend, 0, q, k, v, fb)
    for b, (r, c) in enumerate(zip(ROWS, COMMITTED)):
        for i in range(N_DRAFT):
            path = np.nonzero(mask[i])[0]
            keys = np.concatenate([w.table[r, :c], loc.numpy()[b * N_DRAFT + path]])
            pos = np.arange(len(keys))
            np.testing.assert_allclose(got[b * N_DRAFT + i], w.oracle(0, q[b * N_DRAFT + i], keys, pos, pos[-1]),
                                       rtol=1e-4, atol=1e-5)


def eagle_draft_decode(w, topk):
    """Step 0 of SGLang's multi-step draft backend: each branch sees the prefix and its own slot."""
    multi = FlashAttentionMultiStepBackend(w.runner, topk, N_STEPS)
    loc = np.stack([w.table[r, c:c + topk * N_STEPS].reshape(topk, N_STEPS) for r, c in zip(ROWS, COMMITTED)])
    fb = batch(ForwardMode.DECODE, w, [topk] * 2, COMMITTED, torch.from_numpy(loc.reshape(-1).astype(np.int64)),
               SpecInfo(topk=topk))
    multi.init_forward_metadata(fb)
    fb.out_cache_loc = torch.from_numpy(loc[:, :, 0].reshape(-1).astype(np.int64))  # this step's slots
    q, k, v = w.qkv(2 * topk)
    got = w.forward(multi.attn_backends[0], 0, q, k, v, fb)
    for b, (r, c) in enumerate(zip(ROWS, COMMITTED)):
        for br in range(topk):
            keys = np.concatenate([w.table[r, :c], loc[b, br, :1]])
            pos = np.arange(c + 1)
            np.testing.assert_allclose(got[b * topk + br], w.oracle(0, q[b * topk + br], keys, pos, c),
                                       rtol=1e-4, atol=1e-5)


def eagle(w):
    if w.fam.topk > 1:
        tree_verify(w, SpecInfo(topk=w.fam.topk, draft_token_num=N_DRAFT))
    else:  # chain drafts: a uniform verify batch of N_DRAFT causal queries per request
        check_causal_step(w, FlashAttentionBackend(w.runner), ForwardMode.TARGET_VERIFY, np.array([N_DRAFT] * 2),
                          SpecInfo(draft_token_num=N_DRAFT))
    eagle_draft_decode(w, w.fam.topk)
    accepted = np.array([2, 4])  # draft extend: the accepted tokens (+1) of each request
    spec = SpecInfo(draft_token_num=N_DRAFT, num_accepted_tokens=torch.from_numpy(accepted.astype(np.int32)))
    check_causal_step(w, FlashAttentionBackend(w.runner), ForwardMode.DRAFT_EXTEND, accepted, spec)


def ngram(w):
    # NgramVerifyInput carries no topk: the bridge reads it from server_args.speculative_eagle_topk.
    tree_verify(w, types.SimpleNamespace(draft_token_num=N_DRAFT, custom_mask=None))


STEPS = {"prefill_decode": prefill_decode, "eagle": eagle, "ngram": ngram}


def run_family(fam: Family):
    w = World(fam)
    if fam.status == "works":
        STEPS[fam.steps](w)
        return
    before = [b.clone() for b in w.runner.token_to_kv_pool.k_buffer]
    with pytest.raises(NotImplementedError):
        prefill_decode(w)
    for b, a in zip(before, w.runner.token_to_kv_pool.k_buffer):
        torch.testing.assert_close(a, b, equal_nan=True)  # nothing was written


@pytest.mark.parametrize("fam", FAMILIES, ids=[f.name for f in FAMILIES])
def test_family(fam):
    run_family(fam)


def test_llama4_case_tells_local_from_global():
    """The Llama 4 row crosses chunk boundaries (chunk 8; prefill at 9..12 and 14..19, decode at 13 and 20):
    an oracle blind to the chunk rejects the bridge's local layer, so a local layer given full attention
    would fail the row."""
    fam = next(f for f in FAMILIES if f.name.startswith("Llama 4"))
    w = World(fam)
    w.chunk = None
    with pytest.raises(AssertionError):
        prefill_decode(w)


def test_docs_table_matches_families():
    with open(os.path.join(ROOT, "docs", "models.md")) as f:
        text = f.read()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 3 and cells[1] in ("works", "raises"):
            rows[re.sub(r"[*`]", "", cells[0])] = cells[1]
    assert rows == {f.name: f.status for f in FAMILIES}
