"""In-graph launch tables (``torch_bridge.graph_tables``): a captured uniform bucket's replay hook skips
the JAX planner, and the first layer (inside the engine's graph: every replay) rewrites the tables.

* the refresh turns any earlier step's tables into exactly the planner's tables of the new inputs, bit
  for bit, over random and bad input (rows outside the table, lengths negative, past the capacity,
  outside int32, ties, a ``req_to_token`` page id past the pool or below 0), page sizes 8 / 16 / 64,
  decode, chain verify and chain draft decode, batch buckets padded to their class; over SGLang's ``SWAKVPool``
  the sliding-window layers' tables too (translated through a mapping with bad entries), and a local-attention
  model's chunked layers' decode tables;
* after a recorded capture (simulated on CPU) the replay hook runs no planner, the step's output
  matches the reference, and whatever reads the plan words (a JAX-path layer, ``check``) gets the
  planner's words for the new inputs;
* on a Hopper GPU (``gpu``), a real ``torch.cuda.graph`` replays the refresh.
"""

import contextlib
import types
from typing import Optional

import numpy as np
import pytest
import torch

import jax.numpy as jnp

from jax_attn.kernels.config import DEFAULT_CONFIG, choose_block_q, kv_heads_per_program
from jax_attn.kernels.mosaic_paged import DEFAULT_MOSAIC_CONFIG, MosaicConfig
from jax_attn.kernels.schedule import build_schedule, static_num_splits
from jax_attn.safety import INT32_MAX
from tests.paging import shuffled_table
from tests.test_bridge_launch import HKV, HQ, InterpretedKernel, fill, reference
from tests.test_spec import tree_draft_oracle
from tests.test_triton_launch import InterpretedTriton
from torch_bridge import (FlashAttentionBackend, ForwardBatch, ForwardMode, MHATokenToKVPool, ModelConfig,
                          ModelRunner, RadixAttention, ReqToTokenPool, SpecInfo)
from torch_bridge import graph_tables, table_rules
from torch_bridge.mosaic_path import CROSS_TABLES, LOCAL_TABLES, SWA_TABLES, TRITON_TABLES, MosaicPath
from torch_bridge.triton_path import Layout

# engine calls under plain / no_grad / inference mode (tests/conftest.py: JAX_ATTN_GRAD_MODES)
pytestmark = pytest.mark.usefixtures("engine_grad_mode")

D, MAX_CTX, REQS = 64, 128, 6
N_DRAFT = 3


SWA_PAGES = 24  # pages of the SWA pool of ``make(swa_pool=True)``


def make(page: int, device="cpu", step_id: int = 0, num_steps: int = 0, seed: int = 0, layers: int = 1,
         topk: int = 0, window: Optional[int] = None, mosaic_config: Optional[MosaicConfig] = None,
         swa_pool: bool = False, chunk: int = 0, encoder: int = 0):
    """A runner whose model config names the heads (the launch tables come with every plan) and a backend
    (``topk`` > 1: tree speculative steps; ``window``: the model's sliding window, for their SWA tables;
    ``mosaic_config``: the launch path's Mosaic config; ``swa_pool``: SGLang's hybrid ``SWAKVPool``, layer 0
    full and layer 1 in an SWA pool of ``SWA_PAGES`` pages, its ``full_to_swa_index_mapping`` random with about
    one entry in six bad: -1, past the SWA pool, or outside int32 either way; ``chunk``: a local-attention model,
    Llama 4's, with chunks of that many tokens; ``encoder``: an encoder-decoder model's bound on encoder lengths,
    ``model_config.max_encoder_len``)."""
    table, num_slots = shuffled_table(REQS, MAX_CTX, page, seed)
    if swa_pool:
        from tests.sglang_contract.engine import MHATokenToKVPool as EnginePool
        from tests.sglang_contract.test_swa_pool import SWAKVPool

        pool = SWAKVPool(num_slots - page, (SWA_PAGES - 1) * page, page, torch.bfloat16, HKV, D, [1], [0], False,
                         str(device), token_to_kv_pool_class=EnginePool)
        rng = np.random.default_rng(seed + 99)
        mapping = rng.integers(0, SWA_PAGES * page, num_slots + 1)
        bad = rng.random(num_slots + 1) < 1 / 6
        mapping[bad] = rng.choice([-1, SWA_PAGES * page + 5, 1 << 33, -(1 << 33)], int(bad.sum()))
        mapping[-1] = -1
        pool.register_mapping(torch.from_numpy(mapping).to(device).clone())  # (64-byte aligned: JAX views it)
        bufs = [b for sub in (pool.full_kv_pool, pool.swa_kv_pool) for b in sub.k_buffer + sub.v_buffer]
    else:
        pool = MHATokenToKVPool.create(num_slots, layers, HKV, D, torch.bfloat16, device)
        bufs = pool.k_buffer + pool.v_buffer
    for buf in bufs:
        buf.fill_(float("nan"))
        buf[0] = 0.0
    config = ModelConfig(MAX_CTX)
    config.hf_text_config = types.SimpleNamespace(num_attention_heads=HQ)
    config.get_num_kv_heads = lambda tp: HKV
    if chunk:
        config.is_local_attention_model, config.attention_chunk_size = True, chunk
    if encoder:
        config.max_encoder_len = encoder
    runner = ModelRunner(ReqToTokenPool(torch.from_numpy(table).to(device).clone()), pool, config, page_size=page,
                         device=str(device))
    runner.sliding_window_size = window
    # on the CPU both kernels interpreted: the Mosaic kernel at pages of 8k, the Triton-lowered one at others
    path = None if mosaic_config is None else MosaicPath(config=mosaic_config)
    if device == "cpu":
        path = MosaicPath(make_kernel=InterpretedKernel, make_triton=InterpretedTriton,
                          config=mosaic_config or DEFAULT_MOSAIC_CONFIG)
    backend = FlashAttentionBackend(runner, mosaic_path=path, speculative_step_id=step_id,
                                    speculative_num_steps=num_steps, topk=topk)
    return runner, table, backend


MODES = {  # name -> (mode, queries per request, spec_info, draft step)
    "decode": (ForwardMode.DECODE, 1, None, None),
    "verify": (ForwardMode.TARGET_VERIFY, N_DRAFT, SpecInfo(topk=1, draft_token_num=N_DRAFT), None),
    "draft": (ForwardMode.DECODE, 1, SpecInfo(topk=1), 1),
}


def bad_inputs(rng, bs: int, capacity: int, trial: int, page: int, num_slots: int):
    """Rows, lengths and a ``req_to_token`` edit ((row, position, slot) or None) for one trial: valid
    ones, with some entries bad or tied, and every other trial a used page id outside the pool."""
    rows = rng.integers(1, REQS + 1, bs)
    lens = rng.integers(1, capacity - N_DRAFT, bs)
    if trial % 3 == 1:  # equal lengths: the tile order breaks ties by batch index
        lens[:] = lens[0]
    if trial % 3 == 2:
        i = rng.integers(0, bs)
        rows[i] = rng.choice([-1, REQS + 1, 1 << 40, -(1 << 40)])
        lens[(i + 1) % bs] = rng.choice([0, -3, capacity + 5, INT32_MAX, 1 << 40, -(1 << 40)])
    edit = None
    ok = [i for i in range(bs) if 1 <= rows[i] <= REQS and 1 <= lens[i] <= capacity]
    if trial % 2 == 1 and ok:  # a page this step reads: its first slot past the pool, or below 0
        i = ok[rng.integers(0, len(ok))]
        pos = int(rng.integers(0, -(-int(lens[i]) // page))) * page
        edit = int(rows[i]), pos, int(rng.choice([num_slots + 3 * page, 1 << 30, -page]))
    return rows, lens, edit


@contextlib.contextmanager
def edited(req_to_token: torch.Tensor, edit):
    """``req_to_token`` with one entry changed in place (the planner and the refresh read it), then restored."""
    if edit is None:
        yield
        return
    row, pos, slot = edit
    old = int(req_to_token[row, pos])
    req_to_token[row, pos] = slot
    try:
        yield
    finally:
        req_to_token[row, pos] = old


def captured(page: int, name: str, bs: int, **make_kw):
    """``make``'s runner and backend with a graph bucket of ``bs`` requests of mode ``name`` captured (rows 0,
    lengths 1), and that bucket's refresh (None: none): ``(runner, backend, refresh, rows, lens, mode, spec, triton)``,
    ``triton`` the flags of the tables' kernel (``TRITON_TABLES`` at pages the Mosaic kernel does not take, else 0)."""
    mode, per_req, spec, step_id = MODES[name]
    enc = make_kw.pop("encoder_lens", None)  # an encoder-decoder model's bucket: the capture hook's encoder_lens
    runner, _, backend = make(page, step_id=step_id or 0, num_steps=2 if step_id else 0, **make_kw)
    if enc is not None:  # its cross layers' tables come with each plan (after a first cross layer, in an engine)
        backend.planner.launch_heads.add((HQ, HKV, CROSS_TABLES | (0 if page % 8 == 0 else TRITON_TABLES)))
    backend.init_cuda_graph_state(8, 8 * per_req)
    rows, lens = torch.zeros(bs, dtype=torch.int64), torch.ones(bs, dtype=torch.int64)
    backend.init_forward_metadata_capture_cuda_graph(bs, bs * per_req, rows, lens, enc, mode, spec)
    triton = 0 if page % 8 == 0 else TRITON_TABLES
    return runner, backend, backend.planner.refreshes.get((mode, bs)), rows, lens, mode, spec, triton


@pytest.mark.parametrize("page, name, bs", [(16, "decode", 4), (8, "decode", 3), (64, "verify", 4), (16, "draft", 2),
                                            (8, "verify", 3), (1, "decode", 4), (1, "verify", 3), (4, "decode", 3),
                                            (1, "draft", 2)])
def test_refresh_rewrites_the_planners_tables_bit_for_bit(page, name, bs):
    """Pages 1 and 4: the Triton-lowered kernel's tables (lengths, page table, the work schedule and, with
    split-KV, each row's split count)."""
    runner, backend, r, rows, lens, mode, spec, triton = captured(page, name, bs)
    heads = (HQ, HKV) + ((triton,) if triton else ())
    assert r.verified == {heads} and not r.recorded
    refresh_trials(runner, backend, r, heads, rows, lens, mode, spec, bs, page)


@pytest.mark.parametrize("page, name, bs", [(16, "decode", 4), (8, "verify", 3), (64, "draft", 2)])
def test_refresh_rewrites_the_mosaic_split_tables_bit_for_bit(page, name, bs):
    """Few sequences (their tiles cannot fill the GPU) run the Mosaic split kernel: the refresh writes its split
    schedule's tile table (kv splits per sequence by length, tiles longest first) and the merge's LSE index as
    the planner does (a config that splits the 128-key bound into up to 8). Catches a split count, a tile order
    or an LSE index that differs from the planner's for any input, bad ones included."""
    runner, backend, r, rows, lens, mode, spec, _ = captured(page, name, bs,
                                                             mosaic_config=MosaicConfig(min_kv_per_split=16))
    heads = (HQ, HKV)
    assert r.verified == {heads} and r.step.tables[heads].num_splits > 1
    refresh_trials(runner, backend, r, heads, rows, lens, mode, spec, bs, page)


@pytest.mark.parametrize("kind, page, name, bs", [
    ("swa_pool", 16, "decode", 4), ("swa_pool", 1, "decode", 3), ("swa_pool", 16, "verify", 3),
    ("swa_pool", 1, "draft", 2), ("swa_pool", 8, "draft", 2),
    ("local", 16, "decode", 4), ("local", 1, "decode", 3), ("local", 8, "draft", 2), ("local", 1, "draft", 2),
    ("local", 4, "decode", 3), ("local", 16, "verify", 3), ("local", 1, "verify", 4), ("local", 8, "verify", 2)])
def test_refresh_rewrites_swa_pool_and_local_tables_bit_for_bit(kind, page, name, bs):
    """``swa_pool``: SGLang's ``SWAKVPool``, whose sliding-window layers read the step's page table translated
    into the SWA pool (``table_rules.swa_pool_table``, the planner's ``with_swa_pool``). Catches a translation that
    reads the mapping somewhere else than each page's first slot, narrows its int64 entries otherwise than the
    planner (-1 below int32, the SWA pool's size above), or leaves an SWA page id outside the SWA pool.
    ``local``: a local-attention model (Llama 4, chunks of 32 tokens), whose chunked layers read its local virtual
    batch (``jax_attn.local.plan_local``: a row per chunk that holds a request's queries, so a verify request's
    queries may take two rows; each row's pages, keys and queries; a row without keys has no query, which moves the
    work tiles; ``table_rules.local_parts``, ``mosaic_tile_table``). Catches a chunk start off by one chunk, a
    request's queries that cross a chunk boundary left in one row, a local page table cut from the wrong columns,
    or tiles given to rows without a query. Both for valid and bad input; the refresh writes those tables as well
    as the full layers'."""
    kw = dict(swa_pool=True) if kind == "swa_pool" else dict(chunk=32)
    runner, backend, r, rows, lens, mode, spec, triton = captured(page, name, bs, **kw)
    check_swa_pool_and_local(kind, page, bs, runner, backend, r, rows, lens, mode, spec, triton)


@pytest.mark.parametrize("page, name, bs", [(16, "decode", 4), (8, "verify", 3), (16, "draft", 2)])
def test_refresh_rewrites_local_split_tables_bit_for_bit(page, name, bs):
    """A local-attention model's chunked layers on the Mosaic split kernel (a config that splits the 128-key bound
    into up to 8): the virtual batch's split schedule (rows without a query get no tile; a verify request's
    queries may take two rows) and the merge's LSE index at each row's query offset in the step's token axis.
    Catches an LSE entry put at the row's index instead of its query offset, a row without queries given tiles or
    LSE entries, or keys left unclipped to the local page table."""
    runner, backend, r, rows, lens, mode, spec, triton = captured(
        page, name, bs, chunk=32, mosaic_config=MosaicConfig(min_kv_per_split=16))
    local = (HQ, HKV, LOCAL_TABLES)
    assert backend.step.tables[local].num_splits > 1
    check_swa_pool_and_local("local", page, bs, runner, backend, r, rows, lens, mode, spec, triton)


@pytest.mark.parametrize("page, name, bs, split", [(16, "decode", 4, False), (1, "decode", 3, False),
                                                   (8, "verify", 3, False), (16, "decode", 2, True),
                                                   (4, "verify", 2, False)])
def test_refresh_rewrites_encoder_tables_bit_for_bit(page, name, bs, split):
    """A cross-attention (encoder-decoder) bucket: its decoder tables read each request's positions after its
    encoder tokens (``jax_attn.planner._assemble``: the page table shifted by ``encoder_lens``, the capacity
    ``W - encoder_lens``), and its cross layers' tables the encoder tokens (page size 1: their slots, the encoder
    lengths unclipped, as ``cross_metadata`` leaves them; ``split``: the Mosaic split kernel's). Catches a decoder
    table read from column 0, an int32 shift or capacity that wraps otherwise than the planner's, encoder slots
    past a request's encoder length, or tiles ordered by clipped encoder lengths."""
    enc = torch.full((bs,), 4, dtype=torch.int64)
    runner, backend, r, rows, lens, mode, spec, triton = captured(
        page, name, bs, encoder=16, encoder_lens=enc,
        mosaic_config=MosaicConfig(min_kv_per_split=4) if split else None)
    full, cross = (HQ, HKV) + ((triton,) if triton else ()), (HQ, HKV, CROSS_TABLES | (TRITON_TABLES if page < 8
                                                                                      else 0))
    assert r is not None and r.verified == {full, cross}, r and r.verified
    if split:
        assert r.step.tables[cross].num_splits > 1
    for heads, pages in ((cross, 0), (full, None)):
        refresh_trials(runner, backend, r, heads, rows, lens, mode, spec, bs, page, num_pages=pages, enc=enc)


def check_swa_pool_and_local(kind, page, bs, runner, backend, r, rows, lens, mode, spec, triton):
    """The two tests above: the refresh writes both kinds of tables (the full layers' and the SWA / chunked
    layers'), over valid and bad input (``refresh_trials``)."""
    flag = SWA_TABLES if kind == "swa_pool" else LOCAL_TABLES
    full, other = (HQ, HKV) + ((triton,) if triton else ()), (HQ, HKV, flag | triton)
    assert r.verified == {full, other}
    if kind == "swa_pool":
        assert r.swa_mapping is runner.token_to_kv_pool.full_to_swa_index_mapping
    for heads, pages in ((other, SWA_PAGES if kind == "swa_pool" else None), (full, None)):
        refresh_trials(runner, backend, r, heads, rows, lens, mode, spec, bs, page, num_pages=pages)


def refresh_trials(runner, backend, r, heads, rows, lens, mode, spec, bs: int, page: int,
                   num_pages: Optional[int] = None, enc: Optional[torch.Tensor] = None):
    """Twelve trials of valid and bad inputs (rows, lengths, page ids outside the pool): after the planner's
    tables of one input, the refresh of the next must write exactly the planner's tables of that one
    (``rows`` / ``lens``: the capture hook's buffers; ``r``: the bucket's ``TableRefresh``; ``num_pages``: the
    pages the tables' page ids must stay within, default the KV pool's, 0: not checked (an encoder's slots are
    not clipped into the pool); ``enc``: the capture hook's ``encoder_lens``, given valid and bad values too)."""
    tables = r.step.tables[heads]
    rng = np.random.default_rng(page + bs)
    capacity = backend.jax_backend.capacity

    r2t = runner.req_to_token_pool.req_to_token
    num_slots = runner.token_to_kv_pool.get_key_buffer(0).shape[0]
    num_pages = num_slots // page if num_pages is None else num_pages

    def planned(values):  # the planner's tables for these inputs (the hook runs it: the bucket is not recorded)
        rows.copy_(torch.from_numpy(values[0])), lens.copy_(torch.from_numpy(values[1]))
        if enc is not None:
            enc.copy_(torch.from_numpy(values[3]))
        backend.init_forward_metadata_replay_cuda_graph(bs, rows, lens, None, enc, mode, spec, None)
        assert backend.step.tables[heads] is tables
        pt = tables.args[0 if tables.layout is None else 6]  # the page table (Mosaic / Triton tables)
        assert not num_pages or (0 <= int(pt.min()) and int(pt.max()) < num_pages), "page ids outside the pool"
        return tables.flat.clone()

    def inputs(trial):
        values = bad_inputs(rng, bs, capacity, trial, page, num_slots)
        if enc is None:
            return values
        most = backend.jax_backend.max_encoder_len  # encoder lengths: valid, or (every third trial) one bad
        lengths = rng.integers(0, most + 1, bs)
        if trial % 3 == 2:
            lengths[int(rng.integers(0, bs))] = rng.choice([-3, most + 5, r2t.shape[1] + 9, 1 << 40, -(1 << 40)])
        return (*values, lengths)

    edits = 0
    for trial in range(12):
        values = inputs(trial)
        with edited(r2t, values[2]):
            before = planned(values)
        values = inputs(trial + 1)
        edits += values[2] is not None
        with edited(r2t, values[2]):
            after = planned(values)
            tables.flat.copy_(before)  # the previous step's tables, then the refresh of the new inputs
            r.serial += 1
            r.before_layer(0)
            assert torch.equal(tables.flat, after), f"trial {trial}: {rows.tolist()=} {lens.tolist()=} {values[2]=}"
    assert edits >= 4, "the trials must include bad req_to_token page ids"


@pytest.mark.parametrize("b, per_req, hq, hkv",
                         [(4, 1, 8, 2), (3, 4, 8, 2), (16, 1, 32, 8), (2, 8, 4, 4), (64, 1, 32, 8)])
def test_triton_schedule_equals_the_planners(b, per_req, hq, hkv):
    """The refresh's torch port of the work schedule equals ``build_schedule`` with the planner's statics, bit
    for bit, over lengths that split (up to 20k keys: several kv splits per sequence), ties and zeros.
    Catches: an unstable sort, a split count off by one, C-style division or modulo."""
    cfg = DEFAULT_CONFIG
    rng = np.random.default_rng(b * 10 + per_req)
    block_q = choose_block_q(cfg, hq // hkv, per_req)
    s = static_num_splits(num_tokens=b * per_req, num_kv_heads=hkv, block_q=block_q, num_splits=None, config=cfg,
                          decode=per_req <= 1)
    pack = kv_heads_per_program(cfg, hkv, decode=per_req <= 1, split=s > 1)
    for trial in range(6):
        lens = rng.integers(0, 20000, b).astype(np.int32)
        if trial % 2:
            lens[: b // 2 + 1] = lens[0]  # ties: batch order
        sched = build_schedule(jnp.asarray(lens), jnp.arange(b + 1, dtype=jnp.int32) * per_req,
                               num_tokens=b * per_req, max_q_len=per_req, block_q=block_q, max_splits=s,
                               num_kv_heads=hkv // pack, num_sms=cfg.num_sms, min_kv_per_split=cfg.min_kv_per_split,
                               split_waves=cfg.split_waves)
        lay = Layout(b * per_req, b, 1, per_req, block_q, s, int(sched.tile_seq.shape[0]), 1)
        got = table_rules.triton_schedule(torch.from_numpy(lens), lay, hkv, per_req)
        for name, g, w in zip(("tile_seq", "tile_q_block", "tile_split", "seq_num_splits"), got,
                              (sched.tile_seq, sched.tile_q_block, sched.tile_split, sched.seq_num_splits)):
            np.testing.assert_array_equal(g.numpy(), np.asarray(w), err_msg=f"{name}, lens {lens.tolist()}")
    if s > 1 and b <= 4:
        assert int(np.asarray(sched.seq_num_splits).max()) > 1, "the case must split some sequence"


def decode_step(runner, table, rng, rows, kv_lens, per_req: int = 1):
    """K/V of each request's first ``kv_lens - per_req`` positions, the slots of the last ``per_req`` (this
    step's tokens), and random q / k / v for them."""
    fill(runner, table, rows, kv_lens - per_req, rng)
    loc = torch.tensor(np.concatenate([table[r, n - per_req:n] for r, n in zip(rows, kv_lens)]), dtype=torch.int64)
    q, k, v = (torch.from_numpy(rng.standard_normal((len(rows) * per_req, h * D)).astype(np.float32))
               .to(torch.bfloat16) for h in (HQ, HKV, HKV))
    return loc, q, k, v


@pytest.mark.parametrize("name, page, split", [("decode", 16, False), ("verify", 16, False), ("decode", 1, False),
                                              ("verify", 1, False), ("verify", 8, True)])
def test_recorded_bucket_replays_without_the_planner(name, page, split, monkeypatch):
    """Page 1: the Triton-lowered kernel's tables, recomputed in the graph too; ``split``: the Mosaic split
    kernel's (a config that cuts the 128-key bound into 2 splits), its merge reading the refreshed LSE index."""
    mode, per_req, spec, _ = MODES[name]
    offset = per_req if mode == ForwardMode.TARGET_VERIFY else 0  # verify: seq_lens are the committed lengths
    rng = np.random.default_rng(5)
    runner, table, backend = make(page, seed=3, mosaic_config=MosaicConfig(min_kv_per_split=64) if split else None)
    planner = backend.planner
    bs = 4
    backend.init_cuda_graph_state(bs, bs * per_req)
    rows = torch.tensor([1, 2, 3, 4], dtype=torch.int64)  # the engine's static buffers
    kv_lens = np.array([9, 40, 17, 5])
    lens = torch.from_numpy(kv_lens - offset)
    loc_buf = torch.zeros(bs * per_req, dtype=torch.int64)
    backend.init_forward_metadata_capture_cuda_graph(bs, bs * per_req, rows, lens, None, mode, spec)
    lay = RadixAttention(HQ, D, D**-0.5, HKV, 0)
    fb = ForwardBatch(mode, bs, rows, lens, loc_buf, token_to_kv_pool=runner.token_to_kv_pool, spec_info=spec)
    loc, q, k, v = decode_step(runner, table, rng, rows.numpy(), kv_lens, per_req)
    loc_buf.copy_(loc)
    backend.forward(q, k, v, lay, fb)  # warm-up
    with monkeypatch.context() as m:  # the capture's forward (on CPU: the refresh is recorded, nothing else)
        m.setattr(graph_tables, "capturing", lambda: True)
        backend.forward(q, k, v, lay, fb)
    r = planner.refreshes[(mode, bs)]
    assert r.recorded
    assert split == (r.step.tables.get((HQ, HKV)) is not None and r.step.tables[(HQ, HKV)].num_splits > 1)
    runs = []
    real_run = planner._run
    monkeypatch.setattr(planner, "_run", lambda *a: runs.append(a) or real_run(*a))
    for step_rows, step_kv, same in (([5, 1, 6, 2], [70, 33, 128, 4], True), ([3, 4, 2, 1], [12, 12, 90, 64], False),
                                     ([6, 5, 4, 3], [100, 7, 7, 50], True)):
        step_rows, step_kv = np.array(step_rows), np.array(step_kv)
        loc, q, k, v = decode_step(runner, table, rng, step_rows, step_kv, per_req)
        step_lens = torch.from_numpy(step_kv - offset)
        if same:  # SGLang: new values in the captured buffers
            rows.copy_(torch.from_numpy(step_rows)), lens.copy_(step_lens)
            args = rows, lens
        else:  # other tensors: copied into the captured ones
            args = torch.from_numpy(step_rows), step_lens
        loc_buf.copy_(loc)
        backend.init_forward_metadata_replay_cuda_graph(bs, *args, None, None, mode, spec, None)
        assert not runs, "the replay hook of a recorded bucket must not run the planner"
        assert r.stale
        out = backend.forward(q, k, v, lay, fb)
        ref = reference(runner, table, step_rows, step_kv, np.full(bs, per_req), q)
        np.testing.assert_allclose(out.float().numpy(), ref, atol=3e-2, rtol=3e-2)
        assert torch.equal(rows, torch.from_numpy(step_rows)) and torch.equal(lens, step_lens)
    refuses_new_table_and_flags_bad_input(runner, backend, bs, rows, lens, mode, spec, runs, r)


REPLAY_KINDS = [("swa_pool", "decode"), ("local", "decode"), ("local", "verify"), ("encoder", "decode"),
                ("encoder", "verify")]


@pytest.mark.parametrize("kind, name", REPLAY_KINDS)
@pytest.mark.parametrize("page", [16, 1])
def test_recorded_bucket_replays_equal_eager_steps(kind, name, page, monkeypatch):
    """A decode bucket recorded (a capture simulated on the CPU) over an ``SWAKVPool`` (a full layer and a
    sliding-window layer, whose tables the graph translates into the SWA pool from the mapping as the engine left
    it: entries are remapped between steps), of a local-attention model (a full layer and a chunked one, chunks
    of 32 tokens; ``verify``: chain target verify of 3 draft tokens, whose queries cross a chunk boundary in the
    second step's first request) or of an encoder-decoder model (a self-attention layer over the positions after
    each request's encoder tokens and a cross-attention layer over those; the encoder lengths change between
    steps): each replay hook skips the planner, and each layer gives bit for bit what an eager step of the same
    inputs gives through another backend (the planner's tables). Catches a refresh that translates with the
    capture's mapping, gives the SWA, chunked or cross layer the full page table, reads the capture's encoder
    lengths, or leaves its tables to the capture's step."""
    replays_equal_eager(kind, name, page, "cpu", monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("kind, name, split", [(k, n, False) for k, n in REPLAY_KINDS] + [("local", "decode", True)])
@pytest.mark.parametrize("page", [16, 1])
def test_recorded_bucket_replays_equal_eager_steps_in_a_torch_cuda_graph(kind, name, split, page, monkeypatch):
    """The same steps with both layers captured in a real ``torch.cuda.graph`` and replayed: the graph's outputs
    equal an eager backend's bit for bit (page 16: the Mosaic kernel, Hopper; page 1: the Triton-lowered one;
    ``split``: both backends split every chunk of more than 16 keys, so a page-16 bucket's chunked layer runs the
    Mosaic split kernel on its virtual batch)."""
    if not torch.cuda.is_available() or (page % 8 == 0 and torch.cuda.get_device_capability() != (9, 0)):
        pytest.skip("needs a CUDA GPU (Hopper for page 16)")
    replays_equal_eager(kind, name, page, "cuda", monkeypatch,
                        mosaic_config=MosaicConfig(min_kv_per_split=16) if split else None)


def replays_equal_eager(kind: str, name: str, page: int, device: str, monkeypatch,
                        mosaic_config: Optional[MosaicConfig] = None):
    """The two tests above: on the CPU the capture is simulated (the refresh recorded, layers run after each
    replay hook); on ``cuda`` both layers' forwards are captured in one ``torch.cuda.graph`` and replayed."""
    rng = np.random.default_rng(11)
    runner, table, backend = make(page, device=device, seed=4, swa_pool=kind == "swa_pool",
                                  chunk=32 if kind == "local" else 0, layers=2, mosaic_config=mosaic_config,
                                  encoder=16 if kind == "encoder" else 0)
    pool = runner.token_to_kv_pool
    subs = (pool.full_kv_pool, pool.swa_kv_pool) if kind == "swa_pool" else (pool,)
    for sub in subs:
        for buf in sub.k_buffer + sub.v_buffer:  # every slot a distinct finite value: any other key changes the output
            buf.copy_(torch.from_numpy(rng.standard_normal(tuple(buf.shape)).astype(np.float32)))
    cpu = device == "cpu"
    config = mosaic_config or DEFAULT_MOSAIC_CONFIG
    path = (MosaicPath(make_kernel=InterpretedKernel, make_triton=InterpretedTriton, config=config) if cpu
            else MosaicPath(config=config))
    eager = FlashAttentionBackend(runner, mosaic_path=path)
    mode, per_req, spec, _ = MODES[name]
    offset = per_req if mode == ForwardMode.TARGET_VERIFY else 0  # verify: seq_lens are the committed lengths
    planner, bs = backend.planner, 3
    backend.init_cuda_graph_state(4, 4 * per_req)
    rows, lens = torch.tensor([1, 2, 3], device=device), torch.tensor([9, 30, 17], device=device)
    enc = torch.tensor([4, 16, 0], device=device) if kind == "encoder" else None  # the engine's static buffer
    loc = torch.zeros(bs * per_req, dtype=torch.int64, device=device)
    backend.init_forward_metadata_capture_cuda_graph(bs, bs * per_req, rows, lens, enc, mode, spec)
    second = dict(sliding_window_size=5) if kind == "swa_pool" else dict(is_cross_attention=True) \
        if kind == "encoder" else dict(use_irope=True)
    layers = [RadixAttention(HQ, D, D**-0.5, HKV, 0), RadixAttention(HQ, D, D**-0.5, HKV, 1, **second)]
    fb = ForwardBatch(mode, bs, rows, lens, loc, token_to_kv_pool=pool, spec_info=spec, encoder_lens=enc)

    def forward(b, lay, batch):  # a cross layer reads the encoder's K/V, written by the request's first step
        if lay.is_cross_attention:
            return b.forward(q, None, None, lay, batch, save_kv_cache=False)
        return b.forward(q, k, v, lay, batch)
    q, k, v = (torch.zeros(bs * per_req, h * D, dtype=torch.bfloat16, device=device) for h in (HQ, HKV, HKV))

    def new_qkv():  # written into the captured inputs
        for x, h in ((q, HQ), (k, HKV), (v, HKV)):
            x.copy_(torch.from_numpy(rng.standard_normal((bs * per_req, h * D)).astype(np.float32)))

    new_qkv()
    for lay in layers:
        forward(backend, lay, fb)  # warm-up
    graph = None
    if cpu:
        with monkeypatch.context() as m:  # the capture's forward (on CPU: the refresh is recorded, nothing else)
            m.setattr(graph_tables, "capturing", lambda: True)
            for lay in layers:
                forward(backend, lay, fb)
    else:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = [forward(backend, lay, fb) for lay in layers]
    r = planner.refreshes[(mode, bs)]
    flag = {"swa_pool": SWA_TABLES, "local": LOCAL_TABLES, "encoder": CROSS_TABLES}[kind]
    assert r.recorded and any(len(h) == 3 and h[2] & flag for h in r.verified)
    if mosaic_config is not None and page % 8 == 0:
        assert backend.step.tables[(HQ, HKV, LOCAL_TABLES)].num_splits > 1
    runs = []
    real_run = planner._run
    monkeypatch.setattr(planner, "_run", lambda *a: runs.append(a) or real_run(*a))
    steps = (([5, 1, 6], [70, 33, 128], [0, 0, 0]), ([2, 4, 3], [65, 32, 90], [0, 0, 0]))
    if kind == "encoder":  # each request's encoder tokens come first in its row
        steps = (([5, 1, 6], [70, 33, 100], [9, 16, 1]), ([2, 4, 3], [65, 32, 90], [16, 0, 5]))
    for step_rows, step_lens, step_enc in steps:
        if kind == "swa_pool":  # the engine's in-place edits of the mapping
            mapping = pool.full_to_swa_index_mapping
            remap = torch.from_numpy(rng.integers(0, SWA_PAGES * page, mapping.shape[0] - 1)).to(device)
            mapping[:-1] = torch.where(torch.rand(remap.shape, device=device) < 0.5, remap, mapping[:-1])
        rows.copy_(torch.tensor(step_rows)), lens.copy_(torch.tensor(step_lens) - offset)
        if enc is not None:
            enc.copy_(torch.tensor(step_enc))
        loc.copy_(torch.tensor(np.concatenate([table[r_, e + n - per_req:e + n]
                                               for r_, n, e in zip(step_rows, step_lens, step_enc)]),
                               dtype=torch.int64))
        backend.init_forward_metadata_replay_cuda_graph(bs, rows, lens, None, enc, mode, spec, None)
        assert not runs, "the replay hook of a recorded bucket must not run the planner"
        new_qkv()
        if graph is None:
            got = [forward(backend, lay, fb).float().cpu().numpy() for lay in layers]
        else:
            graph.replay()
            got = [o.float().cpu().numpy() for o in outs]
        fb_eager = ForwardBatch(mode, bs, rows.clone(), lens.clone(), loc.clone(), token_to_kv_pool=pool,
                                spec_info=spec, encoder_lens=None if enc is None else enc.clone())
        eager.init_forward_metadata(fb_eager)
        want = [forward(eager, lay, fb_eager).float().cpu().numpy() for lay in layers]
        for i, (g, w) in enumerate(zip(got, want)):
            assert np.isfinite(w).all(), "the eager step must read finite keys"
            np.testing.assert_array_equal(g, w, err_msg=f"layer {i} (rows {step_rows}, lens {step_lens})")


def refuses_new_table_and_flags_bad_input(runner, backend, bs, rows, lens, mode, spec, runs, r):
    """After a recorded bucket's replays: a reallocated request table (the graph would read the old one)
    makes the hook refuse; what reads the plan words gets the planner's, for the new inputs: a bad
    length is flagged (one planner run, by ``check``)."""
    pool = runner.req_to_token_pool
    old, pool.req_to_token = pool.req_to_token, pool.req_to_token.clone()
    with pytest.raises(ValueError, match="capture the graphs again"):
        backend.init_forward_metadata_replay_cuda_graph(bs, rows, lens, None, None, mode, spec, None)
    pool.req_to_token = old
    lens[2] = backend.jax_backend.capacity + 1
    backend.init_forward_metadata_replay_cuda_graph(bs, rows, lens, None, None, mode, spec, None)
    assert not runs
    with pytest.raises(ValueError, match="bad step input"):
        backend.check()
    assert len(runs) == 1 and not r.stale


def tree_draft_reference(runner, table, rows, committed, loc, q, step: int, scale: float) -> np.ndarray:
    """``tests.test_spec.tree_draft_oracle`` over layer 0's pool and a bf16 ``q [B * K, Hq * D]``."""
    kb, vb = (b.float().cpu().numpy() for b in runner.token_to_kv_pool.get_kv_buffer(0))
    return tree_draft_oracle(kb, vb, table, rows, committed, loc, step, q.float().numpy().reshape(-1, HQ, D), scale)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("topk", [1, 2], ids=["chain", "tree"])
def test_multistep_draft_round_replays_without_the_planner(topk, device, monkeypatch):
    """SGLang's multi-step draft backend (EAGLE drafts, 3 steps, so 2 attention steps) captured on the launch
    path: each step backend's tables are recomputed inside the engine's graph, so its replay hook runs no
    planner, and each step's output equals the reference. Chain drafts (topk 1): step i's query over the
    committed keys, then draft tokens 0..i. Tree drafts (topk 2): each branch's query over the committed keys
    (the prefix pass), then its own draft tokens 0..i (the expand pass, from the slots the replay hook copies
    into the graph's buffer). On the CPU the capture is simulated; on a GPU (Hopper: page 16) the whole round is
    one real ``torch.cuda.graph``, replayed. Catches a replay hook that still plans the round, a step refreshed
    with another step's key offset or draft columns, another branch's slots, and a refresh reading stale rows,
    lengths or slots."""
    from torch_bridge import FlashAttentionMultiStepBackend

    if device == "cuda" and (not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0)):
        pytest.skip("needs a Hopper GPU (page 16)")
    rng = np.random.default_rng(13 + topk)
    page, bs, steps, scale, dev = 16, 4, 3, 0.09, torch.device(device)
    runner, table, _ = make(page, device=device, seed=4)
    path = MosaicPath(make_kernel=InterpretedKernel, make_triton=InterpretedTriton) if device == "cpu" else None
    draft = FlashAttentionMultiStepBackend(runner, topk=topk, speculative_num_steps=steps, mosaic_path=path)
    draft.init_cuda_graph_state(bs, bs * topk)
    rows = torch.tensor([1, 2, 3, 4], device=dev)  # the engine's static buffers
    lens = torch.tensor([9, 40, 17, 5], device=dev)
    loc_buf = torch.zeros(bs * topk * steps, dtype=torch.int64, device=dev)  # [bs, topk, steps]: every step's slots
    fb = ForwardBatch(ForwardMode.DECODE, bs, rows, lens, loc_buf, spec_info=SpecInfo(topk=topk),
                      token_to_kv_pool=runner.token_to_kv_pool)
    lay = RadixAttention(HQ, D, scale, HKV, 0)
    qkv = [[torch.zeros(bs * topk, h * D, dtype=torch.bfloat16, device=dev) for h in (HQ, HKV, HKV)]
           for _ in draft.attn_backends]  # each draft step's inputs, in buffers a graph reads

    def prepare(step_rows, committed) -> np.ndarray:
        """K/V of the committed tokens, the round's draft slots (each request's next positions: chain drafts
        read them through its table, tree drafts through the slots the hooks see) into the engine's buffer, and
        random q, k, v for each draft step."""
        fill(runner, table, step_rows, committed, rng)
        loc = np.stack([table[r, c:c + topk * steps].reshape(topk, steps) for r, c in zip(step_rows, committed)])
        loc_buf.copy_(torch.from_numpy(loc.reshape(-1).astype(np.int64)))
        for bufs in qkv:
            for b in bufs:
                b.copy_(torch.from_numpy(rng.standard_normal(tuple(b.shape)).astype(np.float32)))
        return loc

    def draft_round():
        return [backend.forward(*bufs, lay, fb) for backend, bufs in zip(draft.attn_backends, qkv)]

    def check(outs, step_rows, committed, loc):
        """Each draft step's layer against the reference."""
        for i, out in enumerate(outs):
            q = qkv[i][0].cpu()
            if topk == 1:
                ref = reference(runner, table, step_rows, committed + i + 1, np.ones(bs, np.int64), q, scale=scale)
            else:
                ref = tree_draft_reference(runner, table, step_rows, committed, loc, q, i, scale)
            np.testing.assert_allclose(out.float().cpu().numpy(), ref, atol=3e-2, rtol=3e-2, err_msg=f"draft step {i}")

    loc = prepare(rows.cpu().numpy(), lens.cpu().numpy())
    draft.init_forward_metadata_capture_cuda_graph(fb)
    check(draft_round(), rows.cpu().numpy(), lens.cpu().numpy(), loc)  # warm-up
    graph = None
    if device == "cpu":
        with monkeypatch.context() as m:  # the capture's forward (simulated: the refreshes are recorded)
            m.setattr(graph_tables, "capturing", lambda: True)
            draft_round()
    else:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            graph_outs = draft_round()
    planners = [b.planner for b in draft.attn_backends]
    assert len(planners) == steps - 1 and all(p.recorded(ForwardMode.DECODE, bs) for p in planners)
    runs = []
    for p in planners:
        real_run = p._run
        monkeypatch.setattr(p, "_run", lambda *a, real_run=real_run: runs.append(a) or real_run(*a))
    for step_rows, committed in (([5, 1, 6, 2], [70, 33, 120, 4]), ([3, 4, 2, 1], [12, 12, 90, 64])):
        rows.copy_(torch.tensor(step_rows)), lens.copy_(torch.tensor(committed))
        loc = prepare(np.array(step_rows), np.array(committed))
        draft.init_forward_metadata_replay_cuda_graph(fb, bs)
        assert not runs, "the replay hook of recorded draft steps must not run the planner"
        if graph is None:
            outs = draft_round()
        else:
            graph.replay()
            torch.cuda.synchronize()
            outs = graph_outs
        check(outs, np.array(step_rows), np.array(committed), loc)


def test_each_captured_forward_records_the_refresh_and_the_safe_slots(monkeypatch):
    """Two captures of one step (no hook between): each graph must hold its own table refresh and safe-slot
    computation; reusing the first capture's would leave the second graph reading the first one's memory."""
    from torch_bridge import checks

    rng = np.random.default_rng(9)
    runner, table, backend = make(16, seed=5)
    bs = 4
    backend.init_cuda_graph_state(bs, bs)
    rows, lens = torch.tensor([1, 2, 3, 4]), torch.tensor([30, 8, 64, 17])
    backend.init_forward_metadata_capture_cuda_graph(bs, bs, rows, lens, None, ForwardMode.DECODE, None)
    loc, q, k, v = decode_step(runner, table, rng, rows.numpy(), lens.numpy())
    fb = ForwardBatch(ForwardMode.DECODE, bs, rows, lens, loc, token_to_kv_pool=runner.token_to_kv_pool)
    lay = RadixAttention(HQ, D, D**-0.5, HKV, 0)
    backend.forward(q, k, v, lay, fb)  # warm-up
    r = backend.planner.refreshes[(ForwardMode.DECODE, bs)]
    computed = []
    real_compute = r.compute
    monkeypatch.setattr(r, "compute", lambda: computed.append(1) or real_compute())
    with monkeypatch.context() as m:
        m.setattr(graph_tables, "capturing", lambda: True)
        m.setattr(checks, "capturing", lambda: True)
        for capture in range(2):
            safe_before = backend.runner.safe_locs._last[True][-1]
            backend.forward(q, k, v, lay, fb)  # one layer: each call is a forward
            assert len(computed) == capture + 1, "each captured forward runs the refresh once"
            assert backend.runner.safe_locs._last[True][-1] is not safe_before


def test_jax_path_layer_after_a_planner_free_replay_reads_fresh_words(monkeypatch):
    """A layer whose K and V pools differ in dtype runs through JAX (a launch binds one dtype for both):
    after a replay hook that skipped the planner, that layer must see the new inputs' plan, not the
    capture's."""
    rng = np.random.default_rng(8)
    runner, table, backend = make(16, seed=4, layers=2)
    pool = runner.token_to_kv_pool
    pool.v_buffer[1] = pool.v_buffer[1].to(torch.float16)  # layer 1: bf16 keys, f16 values
    bs = 4
    backend.init_cuda_graph_state(bs, bs)
    rows = torch.tensor([1, 2, 3, 4], dtype=torch.int64)
    lens = torch.tensor([20, 5, 60, 31], dtype=torch.int64)
    backend.init_forward_metadata_capture_cuda_graph(bs, bs, rows, lens, None, ForwardMode.DECODE, None)
    launch, jax_layer = RadixAttention(HQ, D, D**-0.5, HKV, 0), RadixAttention(HQ, D, D**-0.5, HKV, 1)

    def copy_layer():  # layer 1 reads what layer 0 holds (the reference reads layer 0)
        for bufs in (pool.k_buffer, pool.v_buffer):
            bufs[1].copy_(bufs[0])
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    loc, q, k, v = decode_step(runner, table, rng, rows.numpy(), lens.numpy())
    fb = ForwardBatch(ForwardMode.DECODE, bs, rows, lens, loc, token_to_kv_pool=runner.token_to_kv_pool)
    backend.forward(q, k, v, launch, fb)
    copy_layer()
    backend.forward(q, None, None, jax_layer, fb, save_kv_cache=False, sinks=sinks)
    with monkeypatch.context() as m:
        m.setattr(graph_tables, "capturing", lambda: True)
        backend.forward(q, k, v, launch, fb)
    assert backend.planner.refreshes[(ForwardMode.DECODE, bs)].recorded
    new_rows, new_lens = np.array([6, 5, 1, 2]), np.array([128, 77, 3, 45])
    new_loc, q, k, v = decode_step(runner, table, rng, new_rows, new_lens)
    rows.copy_(torch.from_numpy(new_rows)), lens.copy_(torch.from_numpy(new_lens))
    loc.copy_(new_loc)  # the engine's forward batch and buffers, new values (the layers' checks are kept)
    backend.init_forward_metadata_replay_cuda_graph(bs, rows, lens, None, None, ForwardMode.DECODE, None, None)
    calls = InterpretedKernel.calls
    out = backend.forward(q, k, v, launch, fb)
    assert InterpretedKernel.calls == calls + 1
    copy_layer()
    np.testing.assert_allclose(out.float().numpy(), reference(runner, table, new_rows, new_lens, np.ones(bs), q),
                               atol=3e-2, rtol=3e-2)
    out = backend.forward(q, None, None, jax_layer, fb, save_kv_cache=False, sinks=sinks)
    assert InterpretedKernel.calls == calls + 1  # through JAX
    ref = reference(runner, table, new_rows, new_lens, np.ones(bs), q, sinks=sinks)
    np.testing.assert_allclose(out.float().numpy(), ref, atol=3e-2, rtol=3e-2)
    # Next step: a JAX-path layer not seen before runs first (the checked path, not a kept one).
    new_rows, new_lens = np.array([3, 4, 6, 1]), np.array([14, 100, 66, 2])
    new_loc, q, k, v = decode_step(runner, table, rng, new_rows, new_lens)
    rows.copy_(torch.from_numpy(new_rows)), lens.copy_(torch.from_numpy(new_lens))
    backend.init_forward_metadata_replay_cuda_graph(bs, rows, lens, None, None, ForwardMode.DECODE, None, None)
    pool.set_kv_buffer(launch, new_loc, k, v)  # this step's K/V (no launch-path layer runs first)
    copy_layer()
    out = backend.forward(q, None, None, RadixAttention(HQ, D, D**-0.5, HKV, 1), fb, save_kv_cache=False, sinks=sinks)
    ref = reference(runner, table, new_rows, new_lens, np.ones(bs), q, sinks=sinks)
    np.testing.assert_allclose(out.float().numpy(), ref, atol=3e-2, rtol=3e-2)


def test_buckets_the_refresh_does_not_cover_keep_the_planner():
    runner, _, backend = make(16)
    backend.init_cuda_graph_state(4, 4)
    z = torch.zeros(4, dtype=torch.int64)
    backend.init_forward_metadata_capture_cuda_graph(4, 4, z, z + 1, None, ForwardMode.DECODE, None)
    assert (ForwardMode.DECODE, 4) in backend.planner.refreshes
    runner2, _, validating = make(16)
    validating.jax_backend.validate = True
    validating.init_cuda_graph_state(4, 4)
    validating.init_forward_metadata_capture_cuda_graph(4, 4, z, z + 1, None, ForwardMode.DECODE, None)
    assert not validating.planner.refreshes  # validation reads each step's error flag from the planner
    key = backend.planner.graph_keys[(ForwardMode.DECODE, 4)]
    assert graph_tables.reason(key, True, backend.jax_backend.capacity)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 1])
def test_refresh_replays_inside_a_torch_cuda_graph(page):
    """A decode bucket (3 requests in class 4) captured with the engine's static buffers; each replay hook
    skips the planner, the graph's refresh writes the tables, the output matches the reference. Page 16:
    the Mosaic kernel (Hopper); page 1: the Triton-lowered kernel (any CUDA GPU)."""
    if not torch.cuda.is_available() or (page % 8 == 0 and torch.cuda.get_device_capability() != (9, 0)):
        pytest.skip("needs a CUDA GPU (Hopper for page 16)")
    rng = np.random.default_rng(21)
    runner, table, backend = make(page, device="cuda", seed=6)
    bs = 3
    backend.init_cuda_graph_state(8, 8)
    rows = torch.tensor([1, 2, 3], dtype=torch.int64, device="cuda")
    lens = torch.ones(bs, dtype=torch.int64, device="cuda")
    loc = torch.zeros(bs, dtype=torch.int64, device="cuda")
    backend.init_forward_metadata_capture_cuda_graph(bs, bs, rows, lens, None, ForwardMode.DECODE, None)
    lay = RadixAttention(HQ, D, D**-0.5, HKV, 0)
    q = torch.zeros(bs, HQ * D, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.zeros(bs, HKV * D, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    fb = ForwardBatch(ForwardMode.DECODE, bs, rows, lens, loc, token_to_kv_pool=runner.token_to_kv_pool)
    backend.forward(q, k, v, lay, fb)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = backend.forward(q, k, v, lay, fb)
    r = backend.planner.refreshes[(ForwardMode.DECODE, bs)]
    assert r.recorded
    runs = []
    real_run = backend.planner._run
    backend.planner._run = lambda *a: runs.append(a) or real_run(*a)
    for step_rows, step_lens in (([4, 1, 6], [50, 128, 9]), ([2, 3, 5], [77, 77, 1]), ([6, 4, 2], [1, 64, 100])):
        step_rows, step_lens = np.array(step_rows), np.array(step_lens)
        fill(runner, table, step_rows, step_lens - 1, rng)
        rows.copy_(torch.from_numpy(step_rows)), lens.copy_(torch.from_numpy(step_lens))
        loc.copy_(torch.tensor([table[r_, n - 1] for r_, n in zip(step_rows, step_lens)], dtype=torch.int64))
        backend.init_forward_metadata_replay_cuda_graph(bs, rows, lens, None, None, ForwardMode.DECODE, None, None)
        for x, h in ((q, HQ), (k, HKV), (v, HKV)):
            x.copy_(torch.from_numpy(rng.standard_normal((bs, h * D)).astype(np.float32)).to(x))
        g.replay()
        torch.cuda.synchronize()
        assert not runs
        ref = reference(runner, table, step_rows, step_lens, np.ones(bs, np.int64), q)
        np.testing.assert_allclose(out.float().cpu().numpy(), ref, atol=3e-2, rtol=3e-2)
