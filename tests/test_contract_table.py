"""docs/sglang_contract.md is kept true: every "raises" row of the attribute table has a case here
that raises ``NotImplementedError`` naming the attribute and leaves the cache bit-identical; tree
steps count sinks once (the exact softmax), which a float64 oracle tells apart from counting twice.

Bugs these catch: an attribute listed as raising that is silently ignored (a Llama 4 ``use_irope``
layer attending its whole history in a tree step, a chunk that does not start on a page boundary
shrunk as the seed does, an MLA model run as MHA, a hybrid SWA pool read as one pool); a
row added to the table without a case; a change to how tree steps apply sinks."""

import dataclasses
import pathlib
import re

import numpy as np
import pytest
import torch

from tests.test_spec import star, two_branches
from tests.test_torch_bridge import HKV, HQ, D, layer, make_runner, rand_qkv
from tests.test_torch_bridge_spec import N, TOPK, pool_np, verify_case
from torch_bridge import (FlashAttentionBackend, ForwardBatch, ForwardMode, MHATokenToKVPool, MLATokenToKVPool,
                          RadixAttention)

TABLE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "sglang_contract.md"


def raises_rows():
    """(object, attribute cell) of every row whose status is ``raises``."""
    rows = []
    for line in TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[2] == "raises":
            rows.append((cells[0], cells[1]))
    return rows


@dataclasses.dataclass
class Arch:
    name: str


class HybridPool(MHATokenToKVPool):
    """A pool with SGLang's SWAKVPool mapping attribute but no ``swa_layer_nums`` (not a whole SWAKVPool)."""

    full_to_swa_index_mapping = None


def _runner(**attrs):
    runner, table = make_runner(6, 4, seed=7)
    for name, value in attrs.items():
        target = runner.model_config if name in ("attention_arch", "is_local_attention_model",
                                                 "attention_chunk_size") else runner
        setattr(target, name, value)
    return runner, table


def _decode_step(runner, table, rng):
    rows, lens = np.array([2, 5]), np.array([9, 14])
    loc = np.array([table[r, n - 1] for r, n in zip(rows, lens)], np.int64)
    fb = ForwardBatch(ForwardMode.DECODE, 2, torch.from_numpy(rows), torch.from_numpy(lens), torch.from_numpy(loc),
                      token_to_kv_pool=runner.token_to_kv_pool)
    return fb, rand_qkv(rng, 2)


def construct(**attrs):
    def case(rng):
        runner, _ = _runner(**attrs)
        FlashAttentionBackend(runner, impl="reference")
        return runner
    return case


def decode_layer(layer_kw=None, runner_kw=None, call_kw=None, fb_kw=None):
    """A decode step whose forward call gets ``layer(**layer_kw)`` and ``call_kw``."""
    def case(rng):
        runner, table = _runner(**(runner_kw or {}))
        backend = FlashAttentionBackend(runner, impl="reference")
        fb, (q, k, v) = _decode_step(runner, table, rng)
        for name, value in (fb_kw or {}).items():
            setattr(fb, name, value)
        backend.init_forward_metadata(fb)
        kw = {name: (q if value == "q" else value) for name, value in (call_kw or {}).items()}
        backend.forward(q, k, v, layer(**(layer_kw or {})), fb, **kw)
        return runner
    return case


def tree_verify_layer(runner_kw=None, **layer_kw):
    def case(rng):
        runner, table = make_runner(8, 4, seed=3)
        for name, value in (runner_kw or {}).items():
            setattr(runner.model_config, name, value)
        backend = FlashAttentionBackend(runner, topk=TOPK, impl="reference")
        fb, (q, k, v) = verify_case(runner, table, np.array([3, 1]), np.array([9, 17]), [two_branches(), star(N)],
                                    rng)
        backend.init_forward_metadata(fb)
        backend.forward(q, k, v, layer(**layer_kw), fb)
        return runner
    return case


class UnknownMode:
    name = "PREBUILT"


LOCAL = {"is_local_attention_model": True, "attention_chunk_size": 8}  # a Llama 4 model config (page size 4)

# (object, attribute cell) -> (case, words the message must contain)
CASES = {
    ("layer", "`is_cross_attention` (tree step)"): (tree_verify_layer(is_cross_attention=True), "cross-attention"),
    ("layer", "`attn_type` (other values)"): (decode_layer({"attn_type": "ENCODER_DECODER"}), "attn_type"),
    ("layer", "`attn_type` (tree step)"): (tree_verify_layer(attn_type="ENCODER_ONLY"), "ENCODER_ONLY"),
    ("layer", "`use_irope` (tree step, draft extend)"):
        (tree_verify_layer(LOCAL, use_irope=True), "use_irope"),
    ("layer", "`use_irope` (cross attention, `ENCODER_ONLY`)"):
        (decode_layer({"use_irope": True, "attn_type": "ENCODER_ONLY"}, LOCAL), "use_irope"),
    ("forward call", "`q_rope`, `k_rope` (not MLA)"): (decode_layer(call_kw={"q_rope": "q"}), "q_rope"),
    ("model_runner", "`attn_cp_size`"): (construct(attn_cp_size=2), "attn_cp_size"),
    ("model_runner", "`token_to_kv_pool` (a stand-in without `swa_layer_nums`; `SWAKVPool` with `encoder_lens`)"):
        (None, "SWAKVPool"),  # filled below (needs the runner's pool)
    ("model_runner", "`attention_chunk_size` (not a multiple of `page_size`)"):  # page size 4
        (construct(is_local_attention_model=True, attention_chunk_size=6), "attention_chunk_size"),
    ("model_config", "`attention_arch` (MLA with local attention, sliding window, `SWAKVPool`)"):
        (construct(attention_arch=Arch("MLA"), **LOCAL), "attention_arch == MLA with a local-attention model"),
    ("forward_batch", "`forward_mode` (`PREBUILT`, `DLLM_EXTEND`)"): (None, "forward_mode"),
    ("forward_batch", "`attn_cp_metadata`"): (construct(attn_cp_size=2), "attn_cp_size"),
    ("forward_batch", "`attn_attend_prefix_cache` (with `save_kv_cache` and K/V, `q_rope`, softcap, window, sinks)"):
        (None, "attn_attend_prefix_cache"),  # filled below (an MLA runner)
}


def mla_chunked_prefix(rng):
    """An MLA extend step of the seed's chunked-prefix MHA asked to write the cache."""
    runner, table = _runner(attention_arch=Arch("MLA"))
    slots = runner.token_to_kv_pool.k_buffer[0].shape[0]
    pool = runner.token_to_kv_pool = MLATokenToKVPool.create(slots, 1, 16, 8, torch.float32)
    backend = FlashAttentionBackend(runner, impl="reference")
    loc = torch.from_numpy(table[2, :5].astype(np.int64))
    fb = ForwardBatch(ForwardMode.EXTEND, 1, torch.tensor([2]), torch.tensor([5]), loc,
                      extend_seq_lens=torch.tensor([5]), token_to_kv_pool=pool)
    fb.attn_attend_prefix_cache = False  # set (False: the extend part without the prefix)
    backend.init_forward_metadata(fb)
    q, k = torch.from_numpy(rng.standard_normal((5, HQ * 24)).astype(np.float32)), torch.zeros(5, 24)
    backend.forward(q, k, k[:, :16], RadixAttention(HQ, 24, 0.2, 1, 0, v_head_dim=16), fb)


def hybrid_pool(rng):
    runner, _ = _runner()
    pool = runner.token_to_kv_pool
    runner.token_to_kv_pool = HybridPool(pool.k_buffer, pool.v_buffer)
    try:
        FlashAttentionBackend(runner, impl="reference")
    finally:
        runner.token_to_kv_pool = pool


def unknown_mode(rng):
    runner, table = _runner()
    fb, _ = _decode_step(runner, table, rng)
    fb.forward_mode = UnknownMode()
    FlashAttentionBackend(runner, impl="reference").init_forward_metadata(fb)


CASES[("model_runner", "`token_to_kv_pool` (a stand-in without `swa_layer_nums`; `SWAKVPool` with `encoder_lens`)")] = (
    hybrid_pool, "SWAKVPool")
CASES[("forward_batch", "`forward_mode` (`PREBUILT`, `DLLM_EXTEND`)")] = (unknown_mode, "forward_mode")
PREFIX_MHA_ROW = "`attn_attend_prefix_cache` (with `save_kv_cache` and K/V, `q_rope`, softcap, window, sinks)"
CASES[("forward_batch", PREFIX_MHA_ROW)] = (mla_chunked_prefix, "attn_attend_prefix_cache")


def _buffers(pool):
    return pool.kv_buffer if isinstance(pool, MLATokenToKVPool) else pool.k_buffer + pool.v_buffer


def test_every_raises_row_has_a_case():
    rows = raises_rows()
    assert len(rows) >= 10, f"the table lost its raises rows: {rows}"
    assert set(rows) == set(CASES), (f"rows without a case: {set(rows) - set(CASES)}; "
                                     f"stale cases: {set(CASES) - set(rows)}")


@pytest.mark.parametrize("row", sorted(CASES), ids=lambda r: f"{r[0]}.{r[1]}")
def test_raises_row_raises_naming_it_and_writes_nothing(row, monkeypatch):
    case, words = CASES[row]
    pools = []  # every pool a case builds: snapshot before forward runs
    real_init = FlashAttentionBackend.init_forward_metadata

    def snapshot(self, fb):
        pools.append([b.clone() for b in _buffers(fb.token_to_kv_pool)] + [fb.token_to_kv_pool])
        return real_init(self, fb)
    monkeypatch.setattr(FlashAttentionBackend, "init_forward_metadata", snapshot)
    with pytest.raises(NotImplementedError, match=re.escape(words)):
        case(np.random.default_rng(0))
    for snap in pools:
        pool, before = snap[-1], snap[:-1]
        after = _buffers(pool)
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(before, after)), \
            f"{row}: the rejected call changed the cache"


def _sink_oracle(runner, table, fb, masks, q, sinks, copies):
    """float64: committed keys + the draft keys each row's tree mask allows, ``copies`` sink terms."""
    kp, vp = (x.astype(np.float64) for x in pool_np(runner))
    loc, qs = fb.out_cache_loc.numpy(), q.numpy().reshape(-1, HQ, D).astype(np.float64)
    out = np.zeros_like(qs)
    for b, (r, c, m) in enumerate(zip(fb.req_pool_indices.numpy(), fb.seq_lens.numpy(), masks)):
        for i in range(N):
            slots = np.concatenate([table[r, :c], loc[b * N + np.nonzero(m[i])[0]]])
            for h in range(HQ):
                s = kp[slots, h // (HQ // HKV)] @ qs[b * N + i, h] * 0.37
                top = max(s.max(), sinks[h])
                e = np.exp(s - top)
                out[b * N + i, h] = e @ vp[slots, h // (HQ // HKV)] / (e.sum() + copies * np.exp(sinks[h] - top))
    return out


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_tree_verify_counts_sinks_once(impl):
    rng = np.random.default_rng(11)
    runner, table = make_runner(8, 4, seed=4)
    masks = [two_branches(), star(N)]
    fb, (q, k, v) = verify_case(runner, table, np.array([3, 1]), np.array([9, 17]), masks, rng)
    backend = FlashAttentionBackend(runner, topk=TOPK, impl=impl)
    backend.init_forward_metadata(fb)
    sinks = rng.standard_normal(HQ) * 2.0
    lay = dataclasses.replace(layer(), scaling=0.37)
    got = backend.forward(q, k, v, lay, fb, sinks=torch.from_numpy(sinks.astype(np.float32))).numpy()
    got = got.reshape(-1, HQ, D)
    once = _sink_oracle(runner, table, fb, masks, q, sinks, 1)
    twice = _sink_oracle(runner, table, fb, masks, q, sinks, 2)
    err = np.abs(got - once).max(axis=(1, 2)) / np.abs(once).max(axis=(1, 2))  # per draft row
    assert err.max() < 1e-4, f"per-row error against the one-sink oracle: {err}"
    assert np.abs(once - twice).max() > 1e-2, "the case cannot tell one sink from two"
