"""Planner tests: every field against the numpy oracle of SGLang's seed, padding rule,
no retrace inside a bucket, idle and encoder plans, and the value checks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_attn.metadata import ForwardMode
from jax_attn.planner import plan_draft_extend, plan_extend, plan_idle, plan_uniform, validate_metadata
from tests import oracle_sglang

B_BUCKET = 8  # padded batch size used by the property tests
T_BUCKET = 1024  # padded token count of extend batches
NUM_ROWS = 16  # request rows in req_to_token (row 0 reserved)
WIDTH = 512  # req_to_token width (max context length)
MAX_LEN = 160  # longest drawn sequence
SETTINGS = settings(max_examples=15, deadline=None, derandomize=True)


# ----------------------------------------------------------------------------- batch builders
def make_pool(rng, total_lens, page_size, encoder_lens=None):
    """req_to_token with shuffled rows and pages; slots of request i cover its first
    enc_i + total_lens[i] positions page by page, the rest of each row is stale junk."""
    n = len(total_lens)
    enc = np.zeros(n, np.int64) if encoder_lens is None else np.asarray(encoder_lens)
    need = [-(-(int(e) + int(t)) // page_size) for e, t in zip(enc, total_lens)]
    num_pages = 1 + sum(need) + 3
    rows = rng.permutation(np.arange(1, NUM_ROWS))[:n]
    pages = rng.permutation(np.arange(1, num_pages))
    r2t = np.zeros((NUM_ROWS, WIDTH), np.int32)
    r2t[1:] = rng.integers(0, num_pages * page_size, size=(NUM_ROWS - 1, WIDTH))
    start = 0
    for i in range(n):
        own = pages[start : start + need[i]]
        start += need[i]
        slots = (own[:, None] * page_size + np.arange(page_size)[None, :]).reshape(-1)
        r2t[rows[i], : min(slots.size, WIDTH)] = slots[:WIDTH]
    return r2t, rows.astype(np.int32), num_pages


def pad(x, fill, size=B_BUCKET):
    x = np.asarray(x, np.int32)
    return np.concatenate([x, np.full(size - x.size, fill, np.int32)])


def dev(x):
    return jnp.asarray(np.asarray(x, np.int32))


def new_token_slots(r2t, rows, total_lens, q_lens, encoder_lens=None):
    """Slots of each request's last q_len positions (its new tokens)."""
    enc = np.zeros(len(rows), np.int64) if encoder_lens is None else encoder_lens
    out = [r2t[r, e + t - q : e + t] for r, t, q, e in zip(rows, total_lens, q_lens, enc)]
    return np.concatenate(out).astype(np.int32)


# ----------------------------------------------------------------------------- comparison helper
def check_against_oracle(md, ref, n, *, page_size, pad_kv_len, pad_q_len, r2t):
    """Compares the valid prefix bit-exactly and the padded rows against the padding rule."""
    cs, cu_q, cu_k = (np.asarray(a) for a in (md.cache_seqlens, md.cu_seqlens_q, md.cu_seqlens_k))
    pt = np.asarray(md.page_table)
    np.testing.assert_array_equal(cs[:n], ref["cache_seqlens"])
    np.testing.assert_array_equal(cu_q[: n + 1], ref["cu_seqlens_q"])
    np.testing.assert_array_equal(cu_k[: n + 1], ref["cu_seqlens_k"])
    assert int(md.max_seqlen_q) == ref["max_seqlen_q"]
    assert int(md.max_seqlen_k) == ref["max_seqlen_k"]
    for i in range(n):
        used = -(-int(cs[i]) // page_size)
        np.testing.assert_array_equal(pt[i, :used], ref["page_table"][i, :used], err_msg=f"row {i}")
        assert not pt[i, used:].any(), f"row {i}: columns past the last used page must be 0"
    # Padding rule: seq_len 1 (+ offset), request row 0 (reserved, slot/page 0), fixed q_len.
    assert (cs[n:] == pad_kv_len).all()
    assert (np.diff(cu_q)[n:] == pad_q_len).all()
    assert (pt[n:, 0] == r2t[0, 0] // page_size).all() and not pt[n:, 1:].any()
    np.testing.assert_array_equal(cu_k, np.concatenate([[0], np.cumsum(cs)]))


# ----------------------------------------------------------------------------- uniform modes
@st.composite
def uniform_cases(draw):
    kind = draw(st.sampled_from(["decode", "draft_decode", "target_verify"]))
    step = draw(st.integers(0, 2)) if kind == "draft_decode" else None
    num_draft = draw(st.sampled_from([2, 4])) if kind == "target_verify" else 0
    n = draw(st.integers(1, 6))
    return dict(
        kind=kind, step=step, num_draft=num_draft,
        page_size=draw(st.sampled_from([1, 16, 64])),
        seq_lens=draw(st.lists(st.integers(1, MAX_LEN), min_size=n, max_size=n)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


@SETTINGS
@given(uniform_cases())
def test_plan_uniform_matches_seed(case):
    ps, n, seq = case["page_size"], len(case["seq_lens"]), np.array(case["seq_lens"])
    if case["kind"] == "target_verify":
        q_len = kv_offset = case["num_draft"]
        mode = ForwardMode.TARGET_VERIFY
    else:
        q_len, kv_offset, mode = 1, (0 if case["step"] is None else case["step"] + 1), ForwardMode.DECODE
    rng = np.random.default_rng(case["seed"])
    r2t, rows, num_pages = make_pool(rng, seq + kv_offset, ps)
    loc = new_token_slots(r2t, rows, seq + kv_offset, [q_len] * n)
    md = plan_uniform(
        dev(r2t), dev(pad(rows, 0)), dev(pad(seq, 1)), dev(pad(loc, 0, B_BUCKET * q_len)),
        q_len_per_req=q_len, kv_offset=kv_offset, page_size=ps, max_pages=WIDTH // ps, mode=mode,
    )
    ref = oracle_sglang.init_forward_metadata(
        mode, r2t, rows, seq, page_size=ps, draft_step_id=case["step"], num_draft_tokens=case["num_draft"]
    )
    check_against_oracle(md, ref, n, page_size=ps, pad_kv_len=1 + kv_offset, pad_q_len=q_len, r2t=r2t)
    np.testing.assert_array_equal(np.asarray(md.out_cache_loc)[: n * q_len], loc)
    assert (md.batch_size, md.num_tokens, md.max_q_len, md.mode) == (B_BUCKET, B_BUCKET * q_len, q_len, mode)
    validate_metadata(md, num_pages=num_pages, req_to_token_shape=r2t.shape)


# ----------------------------------------------------------------------------- extend modes
@st.composite
def extend_cases(draw):
    mode = draw(st.sampled_from([ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.DRAFT_EXTEND]))
    n = draw(st.integers(1, 6))
    seq = draw(st.lists(st.integers(1, MAX_LEN), min_size=n, max_size=n))
    if mode == ForwardMode.DRAFT_EXTEND:  # accept_length + 1 new tokens on top of a prefix
        ext = [draw(st.integers(1, min(4, s))) for s in seq]
    elif draw(st.booleans()):  # plain prefill: no prefix
        ext = list(seq)
    else:
        ext = [draw(st.integers(1, s)) for s in seq]
    return dict(mode=mode, page_size=draw(st.sampled_from([1, 16, 64])), seq_lens=seq,
                extend_lens=ext, seed=draw(st.integers(0, 2**31 - 1)))


@SETTINGS
@given(extend_cases())
def test_plan_extend_matches_seed(case):
    ps, mode = case["page_size"], case["mode"]
    seq, ext = np.array(case["seq_lens"]), np.array(case["extend_lens"])
    n, prefix = seq.size, seq - ext
    rng = np.random.default_rng(case["seed"])
    r2t, rows, num_pages = make_pool(rng, seq, ps)
    loc = new_token_slots(r2t, rows, seq, ext)
    args = (dev(r2t), dev(pad(rows, 0)), dev(pad(seq, 1)))
    loc_padded = dev(pad(loc, 7, T_BUCKET))  # junk past the valid tokens: the planner zeroes it
    kw = dict(page_size=ps, max_pages=WIDTH // ps, mode=mode)
    if mode == ForwardMode.DRAFT_EXTEND:
        md = plan_draft_extend(*args, dev(pad(ext - 1, -1)), loc_padded, max_q_len=4, **kw)
    else:
        md = plan_extend(*args, dev(pad(ext, 0)), loc_padded, max_q_len=MAX_LEN, **kw)
    ref = oracle_sglang.init_forward_metadata(
        mode, r2t, rows, seq, page_size=ps, extend_seq_lens=ext, extend_prefix_lens=prefix
    )
    check_against_oracle(md, ref, n, page_size=ps, pad_kv_len=1, pad_q_len=0, r2t=r2t)
    out_loc = np.asarray(md.out_cache_loc)
    np.testing.assert_array_equal(out_loc[: loc.size], loc)
    assert not out_loc[loc.size :].any()
    if not prefix.any():  # no prefix: cu_seqlens_q is cu_seqlens_k (the seed reuses it)
        np.testing.assert_array_equal(md.cu_seqlens_q[: n + 1], md.cu_seqlens_k[: n + 1])
    validate_metadata(md, num_pages=num_pages, req_to_token_shape=r2t.shape)


# ----------------------------------------------------------------------------- no retrace, no sync
def _uniform_inputs(lens, rng):
    r2t, rows, _ = make_pool(rng, np.array(lens), 16)
    return dev(r2t), dev(pad(rows, 0, 4)), dev(pad(lens, 1, 4)), dev(np.zeros(4))


def test_no_retrace_inside_bucket():
    rng = np.random.default_rng(0)
    kw = dict(page_size=16, max_pages=WIDTH // 16 + 1)  # a bucket no other test uses
    before_u, before_e = plan_uniform._cache_size(), plan_extend._cache_size()
    plans = []
    for lens in ([3, 9, 1], [40, 2, 77]):
        r2t, rows, seq, loc = _uniform_inputs(lens, rng)
        plans.append(plan_uniform(r2t, rows, seq, loc, **kw))
        ext = dev(pad(np.minimum(lens, 5), 0, 4))
        plans.append(plan_extend(r2t, rows, seq, ext, dev(np.zeros(32)), max_q_len=8, **kw))
    assert plan_uniform._cache_size() == before_u + 1
    assert plan_extend._cache_size() == before_e + 1
    assert list(np.asarray(plans[0].cache_seqlens)) == [3, 9, 1, 1]
    assert list(np.asarray(plans[2].cache_seqlens)) == [40, 2, 77, 1]
    assert int(plans[3].max_seqlen_q) == 5 and int(plans[2].max_seqlen_k) == 77


def test_plans_trace_from_shapes_alone():
    """Planning needs no concrete value: lowering from abstract shapes succeeds (no host sync)."""
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    plan_uniform.trace(i32(4, 64), i32(8), i32(8), i32(24), q_len_per_req=3, kv_offset=3,
                       page_size=16, max_pages=4, mode=ForwardMode.TARGET_VERIFY).lower()
    plan_extend.trace(i32(4, 64), i32(8), i32(8), i32(8), i32(64), page_size=1, max_pages=64,
                      max_q_len=16, encoder_lens=i32(8), max_encoder_len=8).lower()


# ----------------------------------------------------------------------------- idle, encoder
def test_plan_idle():
    md = plan_idle(page_size=16, max_pages=4)
    assert (md.batch_size, md.num_tokens, md.mode) == (0, 0, ForwardMode.IDLE)
    assert md.page_table.shape == (0, 4) and md.cache_seqlens.shape == (0,)
    assert list(np.asarray(md.cu_seqlens_q)) == [0] and list(np.asarray(md.cu_seqlens_k)) == [0]
    assert int(md.max_seqlen_q) == 0 and int(md.max_seqlen_k) == 0
    validate_metadata(md, num_pages=1)


@pytest.mark.parametrize("page_size,enc_lens", [(1, [3, 7]), (16, [16, 32]), (1, [5])])
@pytest.mark.parametrize("planner", ["uniform", "extend"])
def test_encoder_per_row_lengths(planner, page_size, enc_lens):
    rng = np.random.default_rng(1)
    enc = np.array(enc_lens)
    n = enc.size
    seq = np.array([5, 2][:n]) if planner == "uniform" else np.array([9, 4][:n])
    ext = np.ones(n, np.int64) if planner == "uniform" else np.array([4, 4][:n])
    r2t, rows, num_pages = make_pool(rng, seq, page_size, encoder_lens=enc)
    loc = new_token_slots(r2t, rows, seq, ext, encoder_lens=enc)
    common = (dev(r2t), dev(pad(rows, 0, 4)), dev(pad(seq, 1, 4)))
    kw = dict(page_size=page_size, max_pages=WIDTH // page_size, encoder_lens=dev(pad(enc, 0, 4)),
              max_encoder_len=40)
    if planner == "uniform":
        md = plan_uniform(*common, dev(pad(loc, 0, 4)), **kw)
        ref = oracle_sglang.init_forward_metadata(
            ForwardMode.DECODE, r2t, rows, seq, page_size=page_size, encoder_lens=enc)
    else:
        md = plan_extend(*common, dev(pad(ext, 0, 4)), dev(pad(loc, 0, 16)), max_q_len=4, **kw)
        ref = oracle_sglang.init_forward_metadata(
            ForwardMode.EXTEND, r2t, rows, seq, page_size=page_size, encoder_lens=enc,
            extend_seq_lens=ext, extend_prefix_lens=seq - ext)
    pad_q = 1 if planner == "uniform" else 0
    check_against_oracle(md, ref, n, page_size=page_size, pad_kv_len=1, pad_q_len=pad_q, r2t=r2t)
    e = md.encoder
    np.testing.assert_array_equal(np.asarray(e.encoder_lens)[:n], enc)
    np.testing.assert_array_equal(np.asarray(e.encoder_cu_seqlens_k)[: n + 1], ref["encoder_cu_seqlens_k"])
    table = np.asarray(e.encoder_page_table)
    for i in range(n):  # encoder slots, then the decoder's pages right after them
        np.testing.assert_array_equal(table[i, : enc[i]], r2t[rows[i], : enc[i]])
        assert not table[i, enc[i] :].any()
        assert np.asarray(md.page_table)[i, 0] == r2t[rows[i], enc[i]] // page_size
    validate_metadata(md, num_pages=num_pages, req_to_token_shape=r2t.shape)


# ----------------------------------------------------------------------------- value checks
def _good_extend_plan():
    """Three requests (one with no prefix), two with encoder runs, padded to 4 rows; page size 16."""
    rng = np.random.default_rng(2)
    seq, ext = np.array([20, 33, 7]), np.array([4, 1, 7])
    r2t, rows, num_pages = make_pool(rng, seq, 16, encoder_lens=[16, 0, 32])
    loc = new_token_slots(r2t, rows, seq, ext, encoder_lens=[16, 0, 32])
    md = plan_extend(dev(r2t), dev(pad(rows, 0, 4)), dev(pad(seq, 1, 4)), dev(pad(ext, 0, 4)),
                     dev(pad(loc, 0, 16)), page_size=16, max_pages=4, max_q_len=8,
                     encoder_lens=dev([16, 0, 32, 0]), max_encoder_len=32)
    return md, num_pages


# name: (field, index, new value (or f(num_pages)), expected message). Index None replaces the
# whole field; "encoder." fields live in the encoder metadata.
BAD_CASES = {
    "page_id_out_of_range": ("page_table", (1, 2), lambda P: P, r"page_table\[1\].*outside"),
    "negative_page_id": ("page_table", (0, 0), -1, r"page_table\[0\]"),
    "length_over_capacity": ("cache_seqlens", 2, 65, r"cache_seqlens\[2\].*max_pages"),
    "cu_k_inconsistent": ("cu_seqlens_k", 2, 5, r"cu_seqlens_k\[2\]"),
    "cu_q_not_monotone": ("cu_seqlens_q", 2, 1, r"cu_seqlens_q\[2\].*decreases"),
    "cu_q_past_tokens": ("cu_seqlens_q", 4, 17, r"cu_seqlens_q\[4\].*num_tokens"),
    "q_longer_than_k": ("cu_seqlens_q", None, [0, 4, 5, 12, 14], r"cu_seqlens_q\[3\].*cache_seqlens"),
    "q_over_max_q_len": ("max_q_len", None, 6, r"cu_seqlens_q\[2\].*max_q_len"),
    "max_seqlen_k_low": ("max_seqlen_k", None, 3, r"max_seqlen_k"),
    "slot_out_of_range": ("out_cache_loc", 0, lambda P: P * 16, r"out_cache_loc\[0\].*outside"),
    "padding_token_writes": ("out_cache_loc", 15, 3, r"out_cache_loc\[15\].*padding"),
    "encoder_len_over_bound": ("encoder.encoder_lens", 1, 33, r"encoder_lens\[1\]"),
}


def _corrupt(md, field, index, value):
    """md with one field (or one entry of it) replaced."""
    if field.startswith("encoder."):
        return dataclasses.replace(md, encoder=_corrupt(md.encoder, field[len("encoder."):], index, value))
    if isinstance(getattr(md, field), int):  # a static field
        return dataclasses.replace(md, **{field: value})
    old = getattr(md, field)
    new = jnp.asarray(value, jnp.int32) if index is None else old.at[index].set(value)
    return dataclasses.replace(md, **{field: new})


def test_validate_accepts_good_plan():
    md, num_pages = _good_extend_plan()
    validate_metadata(md, num_pages=num_pages, req_to_token_shape=(NUM_ROWS, WIDTH))


@pytest.mark.parametrize("name", sorted(BAD_CASES))
def test_validate_catches(name):
    md, num_pages = _good_extend_plan()
    field, index, value, pattern = BAD_CASES[name]
    value = value(num_pages) if callable(value) else value
    with pytest.raises(ValueError, match=pattern) as info:
        validate_metadata(_corrupt(md, field, index, value), num_pages=num_pages)
    assert "Fix:" in str(info.value)


def test_validate_catches_misaligned_encoder_pages():
    rng = np.random.default_rng(3)
    r2t, rows, num_pages = make_pool(rng, np.array([4]), 16, encoder_lens=[5])
    md = plan_uniform(dev(r2t), dev(rows), dev([4]), dev([0]), page_size=16, max_pages=4,
                      encoder_lens=dev([5]), max_encoder_len=8)
    with pytest.raises(ValueError, match=r"encoder_lens\[0\].*multiple of page_size"):
        validate_metadata(md, num_pages=num_pages)


def test_validate_catches_rows_past_req_to_token_width():
    md, num_pages = _good_extend_plan()
    with pytest.raises(ValueError, match=r"cache_seqlens\[0\].*width"):
        validate_metadata(md, num_pages=num_pages, req_to_token_shape=(NUM_ROWS, 35))


# ----------------------------------------------------------------------------- trace-time checks
@pytest.mark.parametrize("bad,pattern", [
    ("float_seq_lens", r"seq_lens: x.dtype=.*int32"),
    ("short_out_cache_loc", r"out_cache_loc: x.shape=\(3,\)"),
    ("extend_mode", r"mode=.*DECODE"),
    ("encoder_bound_missing", r"max_encoder_len=0"),
])
def test_trace_time_checks(bad, pattern):
    r2t, rows, seq, loc = jnp.zeros((4, 64), jnp.int32), jnp.zeros(4, jnp.int32), jnp.ones(4, jnp.int32), \
        jnp.zeros(4, jnp.int32)
    kw = dict(page_size=1, max_pages=64)
    if bad == "float_seq_lens":
        seq = seq.astype(jnp.float32)
    elif bad == "short_out_cache_loc":
        loc = loc[:3]
    elif bad == "extend_mode":
        kw["mode"] = ForwardMode.EXTEND
    else:
        kw["encoder_lens"] = rows
    with pytest.raises(ValueError, match=pattern):
        plan_uniform(r2t, rows, seq, loc, **kw)
