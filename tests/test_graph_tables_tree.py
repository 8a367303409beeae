"""In-graph launch tables of tree verify and tree draft decode buckets (topk > 1, ``torch_bridge.graph_tables``):
the replay hook copies SGLang's flat custom mask (verify) or every draft step's slots (draft decode) into the buffer
the graph reads and runs no planner; the first layer (inside the engine's graph: every replay) rewrites both
passes' tables.

* the refresh turns any earlier step's tables into exactly the planner's tables of the new inputs and mask, bit
  for bit: random trees with all-False (padded) rows, masks shorter or longer than the planner's bound or of
  another dtype, bad rows and lengths, page ids and draft slots outside the pool; pages 1, 4 and 16 (the
  prefix pass on the Triton-lowered kernel or, with its LSE index, the Mosaic one), 4 x 8 trees among them,
  and sliding-window models' SWA table (over an ``SWAKVPool`` too, translated into its SWA pool), in tree
  verify and tree draft decode;
* after a recorded capture (simulated on CPU) the replay hook runs no planner, the step's output matches the
  float64 oracle and the planner path, and the NaN pool is untouched but for the written slots;
* on a GPU (``gpu``), a real ``torch.cuda.graph`` replays the refresh bitwise as the eager step.
"""

import numpy as np
import pytest
import torch

from jax_attn.safety import INT32_MAX, INT32_MIN

from tests.test_bridge_launch import HKV, HQ, D, fill
from tests.test_graph_tables import (MAX_CTX, REQS, SWA_PAGES, bad_inputs, edited, make,
                                     refuses_new_table_and_flags_bad_input)
from torch_bridge import ForwardBatch, ForwardMode, RadixAttention, SpecInfo
from torch_bridge import graph_tables
from torch_bridge.mosaic_path import (EXPAND_TABLES, PREFIX_TABLES, SWA_TABLES, TREE_SWA_TABLES, TRITON_TABLES,
                                      key_flags)

pytestmark = pytest.mark.usefixtures("engine_grad_mode")

VERIFY = ForwardMode.TARGET_VERIFY


def tree_mask(rng, lens, n: int, size: int) -> torch.Tensor:
    """A flat custom mask for committed lengths ``lens``: SGLang's layout (per request n rows of committed then
    draft columns) with random trees, a quarter of the rows all False; where a length is bad, random bytes of
    a random length up to past the planner's bound ``size``."""
    if not all(0 <= x <= 4096 for x in lens):
        return torch.from_numpy(rng.random(int(rng.integers(0, size + 64))) < 0.5)
    blocks = []
    for length in lens:
        draft = rng.random((n, n)) < 0.5
        draft[rng.random(n) < 0.25] = False
        blocks.append(np.concatenate([rng.random((n, int(length))) < 0.5, draft], 1).reshape(-1))
    return torch.from_numpy(np.concatenate(blocks))


def draft_edit(rng, rows, lens, n: int, num_slots: int, capacity: int):
    """A ``req_to_token`` edit of one draft slot (position ``seq_len + j`` of a good request): past the pool or
    below 0; None when no request is good."""
    ok = [i for i in range(len(rows)) if 1 <= rows[i] <= REQS and 0 <= lens[i] <= capacity - n]
    if not ok:
        return None
    i = ok[rng.integers(0, len(ok))]
    return int(rows[i]), int(lens[i]) + int(rng.integers(0, n)), int(rng.choice([num_slots + 5, 1 << 30, -1]))


def capture_tree(backend, bs: int, topk: int, n: int, rows, lens, mask=None):
    backend.init_cuda_graph_state(bs, bs * n)
    spec = SpecInfo(topk=topk, draft_token_num=n, custom_mask=mask)
    backend.init_forward_metadata_capture_cuda_graph(bs, bs * n, rows, lens, None, VERIFY, spec)
    return backend.planner.refreshes[(VERIFY, bs)]


@pytest.mark.parametrize("page, topk, n, bs, window, pool", [
    (16, 4, 8, 3, None, False), (1, 4, 8, 2, None, False), (16, 2, 5, 4, 7, False), (1, 2, 3, 5, 0, False),
    (4, 2, 5, 3, None, False), (1, 4, 8, 3, 16, False), (16, 2, 5, 4, 7, True), (1, 4, 8, 3, 16, True)])
def test_tree_refresh_rewrites_the_planners_tables_bit_for_bit(page, topk, n, bs, window, pool):
    """Page 16: the prefix pass's Mosaic tables with the LSE index; pages 1 and 4: the Triton-lowered kernel's;
    the expand pass's always the Triton-lowered kernel's. ``window``: a sliding-window model, whose tree steps
    carry the SWA table too (committed then draft slots per row, the Triton-lowered kernel's); ``pool``: over
    SGLang's ``SWAKVPool``, that table translated slot by slot into the SWA pool (a mapping with bad entries:
    catches a translation that is not the planner's, or an SWA slot outside the SWA pool)."""
    runner, _, backend = make(page, topk=topk, window=window, swa_pool=pool)
    rows, lens = torch.zeros(bs, dtype=torch.int64), torch.ones(bs, dtype=torch.int64)
    r = capture_tree(backend, bs, topk, n, rows, lens, torch.ones(bs * n * 40, dtype=torch.bool))
    prefix = PREFIX_TABLES if page % 8 == 0 else TRITON_TABLES | PREFIX_TABLES  # Mosaic at pages of 8k
    want_keys = {(HQ, HKV, prefix), (HQ, HKV, TRITON_TABLES | EXPAND_TABLES)}
    if window is not None:
        want_keys.add((HQ, HKV, TRITON_TABLES | TREE_SWA_TABLES | (SWA_TABLES if pool else 0)))
    assert r.tree and r.verified == set(r.step.tables) == want_keys and not r.recorded
    tables = dict(r.step.tables)
    rng = np.random.default_rng(page * 10 + n)
    capacity = backend.jax_backend.capacity
    r2t = runner.req_to_token_pool.req_to_token
    num_slots = runner.token_to_kv_pool.get_key_buffer(0).shape[0]
    size = r.mask.shape[0]

    def planned(values, mask):  # the planner's tables for these inputs (the hook runs it: the bucket is not recorded)
        rows.copy_(torch.from_numpy(values[0])), lens.copy_(torch.from_numpy(values[1]))
        spec = SpecInfo(topk=topk, draft_token_num=n, custom_mask=mask)
        backend.init_forward_metadata_replay_cuda_graph(bs, rows, lens, None, None, VERIFY, spec, None)
        assert all(backend.step.tables[h] is t for h, t in tables.items())
        return {h: t.flat.clone() for h, t in tables.items()}

    def step_inputs(trial):
        values = bad_inputs(rng, bs, capacity - n, trial, page, num_slots)
        if trial % 4 == 3:  # lengths whose offsets wrap in int32 (and saturate first)
            values[1][rng.integers(0, bs)] = rng.choice([-(1 << 40), INT32_MIN, INT32_MAX - 2, 1 << 40])
        mask = tree_mask(rng, values[1], n, size)
        if trial % 5 == 4:  # another dtype: nonzero is True
            mask = mask.to(torch.int32) * 3
        return values, mask, draft_edit(rng, values[0], values[1], n, num_slots, capacity) if trial % 3 else None

    drafts = 0
    for trial in range(12):
        values, mask, draft = step_inputs(trial)
        with edited(r2t, values[2]), edited(r2t, draft):
            before = planned(values, mask)
        values, mask, draft = step_inputs(trial + 1)
        drafts += draft is not None
        with edited(r2t, values[2]), edited(r2t, draft):
            after = planned(values, mask)
            for h, t in tables.items():  # the previous step's tables, then the refresh of the new inputs
                t.flat.copy_(before[h])
            r.take(rows, lens, mask)
            r.before_layer(0)
            for h, t in tables.items():
                assert torch.equal(t.flat, after[h]), f"trial {trial} {h}: {rows.tolist()=} {lens.tolist()=}"
            for h in tables:
                if key_flags(h) & (EXPAND_TABLES | TREE_SWA_TABLES):
                    slots, bound = tables[h].args[6], SWA_PAGES * page if key_flags(h) & SWA_TABLES else num_slots
                    assert 0 <= int(slots.min()) and int(slots.max()) < bound, f"{h}: slots outside the pool"
    assert drafts >= 4, "the trials must include draft slots outside the pool"


def random_tree(rng, n: int) -> np.ndarray:
    """bool[n, n]: draft token i sees itself and its ancestors (a random parent before it, or the root)."""
    parent = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    m = np.eye(n, dtype=bool)
    for i in range(n):
        j = parent[i]
        while j >= 0:
            m[i, j], j = True, parent[j]
    return m


def sglang_mask(committed, masks) -> torch.Tensor:
    """SGLang's flat verify mask: per request N rows of (committed columns, then draft columns)."""
    return torch.from_numpy(np.concatenate([np.concatenate([np.ones((len(m), c), bool), m], 1).reshape(-1)
                                            for c, m in zip(committed, masks)]))


def tree_oracle(runner, table, rows, committed, loc, masks, q) -> np.ndarray:
    """float64: each draft token over its request's committed keys and the draft keys its tree allows."""
    k, v = (b.float().cpu().numpy().astype(np.float64) for b in runner.token_to_kv_pool.get_kv_buffer(0))
    qs, g, n = q.float().cpu().numpy().reshape(-1, HQ, D).astype(np.float64), HQ // HKV, len(masks[0])
    out = np.zeros((len(qs), HQ, D))
    for b, (r, c, m) in enumerate(zip(rows, committed, masks)):
        for i in range(n):
            sel = np.concatenate([table[r, :c], loc[b * n + np.nonzero(m[i])[0]]])
            for h in range(HQ):
                s = k[sel, h // g] @ qs[b * n + i, h] * D**-0.5
                p = np.exp(s - s.max())
                out[b * n + i, h] = p @ v[sel, h // g] / p.sum()
    return out.reshape(len(qs), HQ * D)


def tree_step(runner, table, rng, rows, committed, n: int):
    """Committed K/V of each request, its draft tokens' slots, random trees and random q / k / v."""
    fill(runner, table, rows, committed, rng)
    loc = np.concatenate([table[r, c:c + n] for r, c in zip(rows, committed)]).astype(np.int64)
    q, k, v = (torch.from_numpy(rng.standard_normal((len(rows) * n, h * D)).astype(np.float32)).to(torch.bfloat16)
               for h in (HQ, HKV, HKV))
    return loc, [random_tree(rng, n) for _ in rows], q, k, v


def two_layers(backend, pool, lay, windowed, window):
    """``forward(q, k, v, fb, save=True)``: layer ``lay``, then (a sliding-window model, ``window``) the windowed
    layer 1 over what layer 0 holds; returns both outputs (the second None without a window)."""
    def forward(q, k, v, fb, save: bool = True):
        out = backend.forward(q, k, v, lay, fb, save_kv_cache=save)
        if window is None:
            return out, None
        for bufs in (pool.k_buffer, pool.v_buffer):
            bufs[1].copy_(bufs[0])  # layer 1 reads what layer 0 holds
        return out, backend.forward(q, None, None, windowed, fb, save_kv_cache=False)
    return forward


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int16)  # bf16 bit patterns (NaN compares equal to itself)


@pytest.mark.parametrize("page, topk, n, window", [(16, 4, 8, None), (1, 2, 5, 6)])
def test_recorded_tree_bucket_replays_without_the_planner(page, topk, n, window, monkeypatch):
    """Page 16: the prefix pass on the Mosaic kernel (its LSE index refreshed too); page 1: on the Triton-lowered
    one, and a sliding-window layer over the tree's SWA table (equal, bitwise, to the planner path's). Steps with
    the captured buffers and with other tensors, a padded request (row 0, seq_len 1, no mask: all-False tree
    rows), masks of other trees and lengths each step."""
    rng = np.random.default_rng(7 + page)
    runner, table, backend = make(page, seed=3, topk=topk, window=window, layers=2)
    planner, bs = backend.planner, 3
    rows, lens = torch.tensor([1, 2, 3]), torch.tensor([9, 40, 17])  # the engine's static buffers
    loc_buf = torch.zeros(bs * n, dtype=torch.int64)
    cap_spec = SpecInfo(topk=topk, draft_token_num=n, custom_mask=torch.ones(bs * n * (MAX_CTX + n), dtype=torch.bool))
    r = capture_tree(backend, bs, topk, n, rows, lens, cap_spec.custom_mask)
    lay = RadixAttention(HQ, D, D**-0.5, HKV, 0)
    pool = runner.token_to_kv_pool
    windowed = RadixAttention(HQ, D, D**-0.5, HKV, 1, sliding_window_size=window if window is not None else -1)

    forward = two_layers(backend, pool, lay, windowed, window)

    fb = ForwardBatch(VERIFY, bs, rows, lens, loc_buf, token_to_kv_pool=pool, spec_info=cap_spec)
    loc, _, q, k, v = tree_step(runner, table, rng, rows.numpy(), lens.numpy(), n)
    loc_buf.copy_(torch.from_numpy(loc))
    forward(q, k, v, fb)  # warm-up
    with monkeypatch.context() as m:  # the capture's forward (on CPU: the refresh is recorded, nothing else)
        m.setattr(graph_tables, "capturing", lambda: True)
        forward(q, k, v, fb)
    assert r.recorded and len(r.verified) == (2 if window is None else 3)
    runs = []
    real_run = planner._run
    monkeypatch.setattr(planner, "_run", lambda *a: runs.append(a) or real_run(*a))
    kb = runner.token_to_kv_pool.k_buffer[0]
    for step_rows, committed, same in (([5, 1, 6], [70, 33, 100], True), ([3, 4, 2], [12, 12, 90], False),
                                       ([6, 5, 0], [50, 7, 1], True)):
        real = 2 if step_rows[-1] == 0 else 3  # a padded request: row 0, seq_len 1, none of the mask
        step_rows, committed = np.array(step_rows), np.array(committed)
        loc, masks, q, k, v = tree_step(runner, table, rng, step_rows[:real], committed[:real], n)
        loc = np.concatenate([loc, np.zeros((bs - real) * n, np.int64)])
        spec = SpecInfo(topk=topk, draft_token_num=n, custom_mask=sglang_mask(committed[:real], masks))
        if same:  # SGLang: new values in the captured buffers
            rows.copy_(torch.from_numpy(step_rows)), lens.copy_(torch.from_numpy(committed))
            args = rows, lens
        else:  # other tensors: copied into the captured ones
            args = torch.from_numpy(step_rows), torch.from_numpy(committed)
        loc_buf.copy_(torch.from_numpy(loc))
        backend.init_forward_metadata_replay_cuda_graph(bs, *args, None, None, VERIFY, spec, None)
        assert not runs, "the replay hook of a recorded tree bucket must not run the planner"
        before = bits(kb).clone()
        q = torch.cat([q, torch.zeros((bs - real) * n, HQ * D, dtype=q.dtype)])
        k, v = (torch.cat([x, torch.zeros((bs - real) * n, HKV * D, dtype=x.dtype)]) for x in (k, v))
        out, out_w = forward(q, k, v, fb)
        written = torch.from_numpy(loc[:real * n])
        untouched = torch.ones(kb.shape[0], dtype=torch.bool)
        untouched[written] = untouched[0] = False  # slot 0: the padded tokens' writes
        assert torch.equal(bits(kb)[untouched], before[untouched]), "the step wrote outside its draft slots"
        want = tree_oracle(runner, table, step_rows, committed, loc, masks, q[:real * n])
        err = np.abs(out[:real * n].float().numpy() - want).max() / np.abs(want).max()
        assert err < 2e-2, err
        assert not runs
        # the planner path on the same step (an eager plan: its tables land in the same buffers)
        eager_fb = ForwardBatch(VERIFY, bs, torch.from_numpy(step_rows), torch.from_numpy(committed), loc_buf,
                                token_to_kv_pool=pool, spec_info=spec)
        backend.init_forward_metadata(eager_fb)
        eager, eager_w = forward(q, k, v, eager_fb, save=False)
        assert runs and torch.equal(bits(out[:real * n]), bits(eager[:real * n]))
        if window is not None:  # launched over the tree's SWA table
            assert key_flags(backend.runner.hits[1].call.heads) & TREE_SWA_TABLES
            assert torch.equal(bits(out_w[:real * n]), bits(eager_w[:real * n]))
        runs.clear()
    refuses_new_table_and_flags_bad_input(runner, backend, bs, rows, lens, VERIFY, spec, runs, r)


@pytest.mark.gpu
@pytest.mark.parametrize("page, topk, n, window", [(16, 4, 8, None), (1, 2, 5, 6)])
def test_tree_refresh_replays_inside_a_torch_cuda_graph(page, topk, n, window):
    """A tree verify bucket captured with the engine's static buffers in a real ``torch.cuda.graph``; each replay
    hook copies the step's mask and skips the planner, the graph's refresh writes both passes' tables (and the
    SWA table), and the output matches the float64 oracle and, bitwise, the same step planned eagerly. Page 16:
    the prefix pass on the Mosaic kernel (Hopper); page 1: on the Triton-lowered kernel (any CUDA GPU), with a
    sliding-window layer after the full one."""
    if not torch.cuda.is_available() or (page % 8 == 0 and torch.cuda.get_device_capability() != (9, 0)):
        pytest.skip("needs a CUDA GPU (Hopper for page 16)")
    dev, bs = torch.device("cuda"), 3
    rng = np.random.default_rng(23)
    runner, table, backend = make(page, device="cuda", seed=6, topk=topk, window=window, layers=2)
    pool = runner.token_to_kv_pool
    rows = torch.tensor([1, 2, 3], dtype=torch.int64, device=dev)
    lens = torch.full((bs,), 5, dtype=torch.int64, device=dev)
    loc = torch.zeros(bs * n, dtype=torch.int64, device=dev)
    cap_mask = torch.ones(bs * n * (MAX_CTX + n), dtype=torch.bool, device=dev)  # SGLang's static capture buffer
    r = capture_tree(backend, bs, topk, n, rows, lens, cap_mask)
    lay = RadixAttention(HQ, D, D**-0.5, HKV, 0)
    q = torch.zeros(bs * n, HQ * D, dtype=torch.bfloat16, device=dev)
    k, v = (torch.zeros(bs * n, HKV * D, dtype=torch.bfloat16, device=dev) for _ in range(2))
    windowed = RadixAttention(HQ, D, D**-0.5, HKV, 1, sliding_window_size=window if window is not None else -1)

    forward = two_layers(backend, pool, lay, windowed, window)

    fb = ForwardBatch(VERIFY, bs, rows, lens, loc, token_to_kv_pool=pool,
                      spec_info=SpecInfo(topk=topk, draft_token_num=n, custom_mask=cap_mask))
    forward(q, k, v, fb)  # warm-up outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, out_w = forward(q, k, v, fb)
    assert r.recorded and len(r.verified) == (2 if window is None else 3)
    runs = []
    real_run = backend.planner._run
    backend.planner._run = lambda *a: runs.append(a) or real_run(*a)
    for step_rows, committed in (([4, 1, 6], [50, 100, 9]), ([2, 3, 5], [77, 77, 1]), ([6, 4, 2], [1, 64, 110])):
        step_rows, committed = np.array(step_rows), np.array(committed)
        step_loc, masks, qs, ks, vs = tree_step(runner, table, rng, step_rows, committed, n)
        rows.copy_(torch.from_numpy(step_rows)), lens.copy_(torch.from_numpy(committed))
        loc.copy_(torch.from_numpy(step_loc))
        spec = SpecInfo(topk=topk, draft_token_num=n, custom_mask=sglang_mask(committed, masks).to(dev))
        backend.init_forward_metadata_replay_cuda_graph(bs, rows, lens, None, None, VERIFY, spec, None)
        for x, y in ((q, qs), (k, ks), (v, vs)):
            x.copy_(y)
        g.replay()
        torch.cuda.synchronize()
        assert not runs
        want = tree_oracle(runner, table, step_rows, committed, step_loc, masks, qs)
        err = np.abs(out.float().cpu().numpy() - want).max() / np.abs(want).max()
        assert err < 2e-2, err
        eager_fb = ForwardBatch(VERIFY, bs, rows.clone(), lens.clone(), loc, token_to_kv_pool=pool, spec_info=spec)
        backend.init_forward_metadata(eager_fb)  # the planner's tables of the step, in the same buffers
        eager, eager_w = forward(q, k, v, eager_fb, save=False)
        assert torch.equal(bits(eager), bits(out)), "graph replay != the same step planned eagerly"
        if window is not None:
            assert torch.equal(bits(eager_w), bits(out_w)), "sliding-window layer: graph replay != eager"
        runs.clear()


@pytest.mark.parametrize("page, topk, step, bs, window, pool", [
    (16, 2, 1, 3, None, False), (1, 4, 0, 2, None, False), (4, 2, 2, 4, None, False), (16, 2, 2, 3, 7, False),
    (1, 4, 1, 2, 16, True), (8, 2, 0, 3, 5, True)])
def test_tree_draft_refresh_rewrites_the_planners_tables_bit_for_bit(page, topk, step, bs, window, pool):
    """Tree draft decode (topk > 1, draft step ``step`` of 3): the refresh writes the prefix pass's tables (each
    branch's query over the committed keys: Mosaic at page 16, the Triton-lowered kernel's at pages 1 and 4) and
    the expand pass's (each branch's slots of draft steps 0..step, read from the slots the replay hook copies
    into the graph's buffer) exactly as the planner does, over bad rows and lengths, page ids outside the pool,
    and draft slots outside the pool, below 0 or past int32. Catches another branch's or step's slots, slots
    left unclipped, and stale slots. ``window``: a sliding-window model, whose draft steps carry an SWA table too
    (each branch's committed slots, then its draft slots; ``pool``: translated into an ``SWAKVPool``'s SWA pool):
    catches a branch given another request's committed slots or another branch's draft slots."""
    steps = 3
    runner, _, backend = make(page, topk=topk, step_id=step, num_steps=steps, window=window, swa_pool=pool)
    rows, lens = torch.zeros(bs, dtype=torch.int64), torch.ones(bs, dtype=torch.int64)
    backend.init_cuda_graph_state(bs, bs * topk)
    spec = SpecInfo(topk=topk)
    backend.init_forward_metadata_capture_cuda_graph(bs, bs * topk, rows, lens, None, ForwardMode.DECODE, spec)
    r = backend.planner.refreshes[(ForwardMode.DECODE, bs)]
    prefix = PREFIX_TABLES if page % 8 == 0 else TRITON_TABLES | PREFIX_TABLES
    want_keys = {(HQ, HKV, prefix), (HQ, HKV, TRITON_TABLES | EXPAND_TABLES)}
    if window is not None:
        want_keys.add((HQ, HKV, TRITON_TABLES | TREE_SWA_TABLES | (SWA_TABLES if pool else 0)))
    assert r.draft and r.verified == set(r.step.tables) == want_keys
    tables = dict(r.step.tables)
    rng = np.random.default_rng(page * 10 + topk + step)
    capacity = backend.jax_backend.capacity
    r2t = runner.req_to_token_pool.req_to_token
    num_slots = runner.token_to_kv_pool.get_key_buffer(0).shape[0]

    def planned(values, loc):  # the planner's tables for these inputs (the hook runs it: the bucket is not recorded)
        rows.copy_(torch.from_numpy(values[0])), lens.copy_(torch.from_numpy(values[1]))
        backend.init_forward_metadata_replay_cuda_graph(bs, rows, lens, None, None, ForwardMode.DECODE, spec, None,
                                                        out_cache_loc=loc)
        assert all(backend.step.tables[h] is t for h, t in tables.items())
        return {h: t.flat.clone() for h, t in tables.items()}

    def step_inputs(trial):
        values = bad_inputs(rng, bs, capacity - steps, trial, page, num_slots)
        loc = rng.integers(0, num_slots, bs * topk * steps)
        if trial % 2:  # draft slots outside the pool, below 0, past int32
            loc[rng.integers(0, loc.shape[0], 3)] = rng.choice([num_slots, num_slots + 7, -1, 1 << 40], 3)
        return values, torch.from_numpy(loc.astype(np.int64))

    for trial in range(10):
        values, loc = step_inputs(trial)
        with edited(r2t, values[2]):
            before = planned(values, loc)
        values, loc = step_inputs(trial + 1)
        with edited(r2t, values[2]):
            after = planned(values, loc)
            for h, t in tables.items():  # the previous step's tables, then the refresh of the new inputs
                t.flat.copy_(before[h])
            r.take(rows, lens, None, loc)
            r.before_layer(0)
            for h, t in tables.items():
                assert torch.equal(t.flat, after[h]), f"trial {trial} {h}: {rows.tolist()=} {lens.tolist()=}"
            for h, t in tables.items():
                if key_flags(h) & (EXPAND_TABLES | TREE_SWA_TABLES):
                    bound = SWA_PAGES * page if key_flags(h) & SWA_TABLES else num_slots
                    assert 0 <= int(t.args[6].min()) and int(t.args[6].max()) < bound, f"{h}: slots outside the pool"


def draft_inputs(runner, table, rng, step_rows, committed, topk: int, step: int, steps: int):
    """A tree draft decode step's inputs (draft step ``step`` of ``steps``): committed K/V and the draft K/V of
    the steps before (this step writes its own), every draft step's slots (flat, and ``[B, topk, steps]``) and
    random bf16 q, k, v of its ``B * topk`` tokens, on the pool's device."""
    fill(runner, table, step_rows, committed, rng)
    loc = np.stack([table[r, c:c + topk * steps].reshape(topk, steps) for r, c in zip(step_rows, committed)])
    kb, vb = runner.token_to_kv_pool.get_kv_buffer(0)
    dev = kb.device
    prev = torch.from_numpy(loc[:, :, :step].reshape(-1).astype(np.int64)).to(dev)
    for b in (kb, vb):
        b[prev] = torch.from_numpy(rng.standard_normal((prev.numel(), HKV, D)).astype(np.float32)).to(b)
    q, k, v = (torch.from_numpy(rng.standard_normal((len(step_rows) * topk, h * D)).astype(np.float32))
               .to(torch.bfloat16).to(dev) for h in (HQ, HKV, HKV))
    return torch.from_numpy(loc.reshape(-1).astype(np.int64)).to(dev), loc, q, k, v


def test_recorded_tree_draft_bucket_replays_without_the_planner(monkeypatch):
    """A single tree draft decode backend (draft step 1 of 3, topk 2, SGLang's ``speculative_step_id``): after a
    recorded capture (simulated on CPU) its replay hook takes the step's ``out_cache_loc`` (every draft step's
    slots) into the graph's buffer and runs no planner; each branch's output equals the reference (the committed
    keys, then its own slots of steps 0..1). Catches a hook that plans, or that leaves the slots of the capture."""
    from tests.test_graph_tables import tree_draft_reference

    page, topk, step, steps, bs, scale = 16, 2, 1, 3, 3, 0.11
    rng = np.random.default_rng(17)
    runner, table, backend = make(page, topk=topk, step_id=step, num_steps=steps)
    rows, lens = torch.tensor([1, 2, 3]), torch.tensor([20, 7, 33])  # the engine's static buffers
    spec = SpecInfo(topk=topk)
    lay = RadixAttention(HQ, D, scale, HKV, 0)
    backend.init_cuda_graph_state(bs, bs * topk)

    def step_inputs(step_rows, committed):
        return draft_inputs(runner, table, rng, step_rows, committed, topk, step, steps)

    loc_t, loc, q, k, v = step_inputs(rows.numpy(), lens.numpy())
    backend.init_forward_metadata_capture_cuda_graph(bs, bs * topk, rows, lens, None, ForwardMode.DECODE, spec)
    fb = ForwardBatch(ForwardMode.DECODE, bs, rows, lens, loc_t, spec_info=spec,
                      token_to_kv_pool=runner.token_to_kv_pool)
    backend.forward(q, k, v, lay, fb)  # warm-up (SGLang's order: capture hook, warm-up, capture)
    with monkeypatch.context() as m:  # the capture's forward (on CPU: the refresh is recorded, nothing else)
        m.setattr(graph_tables, "capturing", lambda: True)
        backend.forward(q, k, v, lay, fb)
    r = backend.planner.refreshes[(ForwardMode.DECODE, bs)]
    assert r.draft and r.recorded
    runs = []
    real_run = backend.planner._run
    monkeypatch.setattr(backend.planner, "_run", lambda *a: runs.append(a) or real_run(*a))
    for step_rows, committed in (([4, 1, 6], [50, 3, 90]), ([2, 5, 3], [11, 64, 40])):
        loc_t, loc, q, k, v = step_inputs(np.array(step_rows), np.array(committed))
        rows.copy_(torch.tensor(step_rows)), lens.copy_(torch.tensor(committed))
        fb.out_cache_loc = loc_t
        backend.init_forward_metadata_replay_cuda_graph(bs, rows, lens, None, None, ForwardMode.DECODE, spec, None,
                                                        out_cache_loc=loc_t)
        assert not runs, "the replay hook of a recorded tree draft bucket must not run the planner"
        out = backend.forward(q, k, v, lay, fb)
        want = tree_draft_reference(runner, table, step_rows, committed, loc, q, step, scale)
        np.testing.assert_allclose(out.float().numpy(), want, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("page, topk, step", [(16, 2, 1), (1, 4, 2)])
def test_tree_draft_refresh_replays_inside_a_torch_cuda_graph(page, topk, step):
    """A tree draft decode bucket (topk > 1, draft step ``step`` of 3) captured with the engine's static buffers
    in a real ``torch.cuda.graph``: each replay hook copies the step's slots (every draft step's) into the graph's
    buffer and runs no planner, the graph's refresh writes both passes' tables and the KV write goes to this
    step's slots; the output matches the oracle (the committed keys, then the branch's own draft slots of steps
    0..step) and, bitwise, the same step planned eagerly. Page 16: the prefix pass on the Mosaic kernel (Hopper);
    page 1: on the Triton-lowered kernel."""
    from tests.test_graph_tables import tree_draft_reference

    if not torch.cuda.is_available() or (page % 8 == 0 and torch.cuda.get_device_capability() != (9, 0)):
        pytest.skip("needs a CUDA GPU (Hopper for page 16)")
    steps, bs, scale, dev = 3, 3, 0.11, torch.device("cuda")
    rng = np.random.default_rng(29 + page)
    runner, table, backend = make(page, device="cuda", topk=topk, step_id=step, num_steps=steps)
    rows = torch.tensor([1, 2, 3], device=dev)
    lens = torch.tensor([20, 7, 33], device=dev)  # the engine's static buffers
    loc_buf = torch.zeros(bs * topk * steps, dtype=torch.int64, device=dev)
    spec = SpecInfo(topk=topk)
    lay = RadixAttention(HQ, D, scale, HKV, 0)
    backend.init_cuda_graph_state(bs, bs * topk)
    loc_t, _, q_in, k_in, v_in = draft_inputs(runner, table, rng, rows.cpu().numpy(), lens.cpu().numpy(), topk,
                                              step, steps)
    loc_buf.copy_(loc_t)
    q, k, v = q_in.clone(), k_in.clone(), v_in.clone()
    backend.init_forward_metadata_capture_cuda_graph(bs, bs * topk, rows, lens, None, ForwardMode.DECODE, spec)
    fb = ForwardBatch(ForwardMode.DECODE, bs, rows, lens, loc_buf, spec_info=spec,
                      token_to_kv_pool=runner.token_to_kv_pool)
    backend.forward(q, k, v, lay, fb)  # warm-up outside the capture (SGLang's order: hook, warm-up, capture)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = backend.forward(q, k, v, lay, fb)
    r = backend.planner.refreshes[(ForwardMode.DECODE, bs)]
    assert r.draft and r.recorded
    runs = []
    real_run = backend.planner._run
    backend.planner._run = lambda *a: runs.append(a) or real_run(*a)
    kb, vb = runner.token_to_kv_pool.get_kv_buffer(0)
    for step_rows, committed in (([4, 1, 6], [50, 3, 90]), ([2, 5, 3], [11, 64, 40])):
        step_rows, committed = np.array(step_rows), np.array(committed)
        loc_t, loc, q_in, k_in, v_in = draft_inputs(runner, table, rng, step_rows, committed, topk, step, steps)
        rows.copy_(torch.from_numpy(step_rows)), lens.copy_(torch.from_numpy(committed)), loc_buf.copy_(loc_t)
        for x, y in ((q, q_in), (k, k_in), (v, v_in)):
            x.copy_(y)
        backend.init_forward_metadata_replay_cuda_graph(bs, rows, lens, None, None, ForwardMode.DECODE, spec, None,
                                                        out_cache_loc=loc_t.clone())  # a tensor of the step's own
        pool_before = [bits(b).clone() for b in (kb, vb)]
        g.replay()
        torch.cuda.synchronize()
        assert not runs, "the replay hook of a recorded tree draft bucket must not run the planner"
        mine = torch.from_numpy(loc[:, :, step].reshape(-1).astype(np.int64)).to(dev)  # this step's slots
        for b, before, new in ((kb, pool_before[0], k), (vb, pool_before[1], v)):
            assert torch.equal(b[mine], new.view(-1, HKV, D)), "the graph's KV write missed this step's slots"
            keep = torch.ones(b.shape[0], dtype=torch.bool, device=dev)
            keep[mine] = False
            assert torch.equal(bits(b)[keep], before[keep]), "a slot outside the step changed"
        want = tree_draft_reference(runner, table, step_rows, committed, loc, q.cpu(), step, scale)
        np.testing.assert_allclose(out.float().cpu().numpy(), want, atol=3e-2, rtol=3e-2)
        eager_fb = ForwardBatch(ForwardMode.DECODE, bs, rows.clone(), lens.clone(), loc_t, spec_info=spec,
                                token_to_kv_pool=runner.token_to_kv_pool)
        backend.init_forward_metadata(eager_fb)
        eager = backend.forward(q, k, v, lay, eager_fb, save_kv_cache=False)
        assert torch.equal(bits(eager), bits(out)), "graph replay != the same step eagerly"
        runs.clear()
