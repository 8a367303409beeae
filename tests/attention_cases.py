"""Named attention cases and one checker shared by every attention backend's tests.

``check_attention(attn_fn, case)`` builds a random paged cache with shuffled page ids, NaN in every
page and slot no sequence owns, a ragged query batch with padding tokens (and optionally padded
batch rows), runs ``attn_fn(q, k_cache, v_cache, md, **kwargs)`` and compares it in float32 with
``jax_attn.reference.paged_attention_reference``. ``forbid_kernel_planning(monkeypatch)`` makes a kernel
call that plans its own schedule (instead of using the step plan's) fail the test.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jax_attn.metadata import AttentionMetadata, ForwardMode
from jax_attn.reference import paged_attention_reference

TOLERANCE = {"float32": 1e-4, "bfloat16": 1e-2, "float16": 5e-3}

# One compile per case instead of one per jnp op.
reference = jax.jit(
    paged_attention_reference,
    static_argnames=("page_size", "causal", "window_size", "softcap", "softmax_scale", "return_lse"),
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One attention problem. ``seq_lens`` holds (q_len, kv_len) per real sequence."""

    name: str
    seq_lens: tuple[tuple[int, int], ...]
    page_size: int = 16
    heads: tuple[int, int] = (4, 2)  # (Hq, Hkv)
    head_dim: int = 32
    head_dim_v: int | None = None  # None = head_dim
    dtype: str = "float32"
    causal: bool = True
    window: tuple[int, int] = (-1, -1)
    softcap: float = 0.0
    softmax_scale: float | None = None  # None: the kernels' default, head_dim ** -0.5
    sinks: bool = False
    fp8: bool = False  # float8_e4m3fn cache with per-(sequence, kv head) descale
    num_splits: int | None = 1
    return_lse: bool = True
    pad_tokens: int = 3  # padding tokens after the last real one
    pad_rows: int = 0  # padded batch rows (no query, one key, reserved page 0)
    spare_pages: int = 3  # unused (NaN) pages in the pool

    @property
    def max_q_len(self) -> int:
        return max(max(q for q, _ in self.seq_lens), 1)


def _c(name, seq_lens, **kw):
    return Case(name=name, seq_lens=tuple(seq_lens), **kw)


_MIXED = [(1, 37), (9, 9), (5, 61), (1, 1), (13, 40)]

# Small shapes for the CPU interpreter. A few cases pass a softmax_scale other than head_dim ** -0.5 (SGLang's
# RadixAttention.scaling): a kernel that ignores the caller's scale fails them.
CPU_CASES = [
    _c("decode_only", [(1, 17), (1, 64), (1, 3), (1, 100)], page_size=16),
    _c("decode_page1", [(1, 17), (1, 40), (1, 1)], page_size=1, heads=(8, 2)),
    _c("decode_gqa8", [(1, 33), (1, 70)], heads=(8, 1), pad_rows=2),
    _c("decode_mha", [(1, 33), (1, 70)], heads=(2, 2), head_dim=64),
    _c("decode_gqa7", [(1, 45), (1, 12)], heads=(14, 2), page_size=4, softmax_scale=0.31),
    _c("prefill_only", [(20, 20), (7, 7), (33, 33)], page_size=16),
    _c("prefill_page1", [(20, 20), (11, 11)], page_size=1),
    _c("prefill_gqa7", [(19, 19), (40, 40)], heads=(7, 1), page_size=8),
    _c("mixed", _MIXED, page_size=16),
    _c("mixed_bf16", _MIXED, page_size=16, dtype="bfloat16"),
    _c("prefix_extend", [(12, 80), (30, 47), (3, 99)], page_size=16, heads=(8, 2), softmax_scale=0.05),
    _c("verify", [(4, 30), (4, 77), (4, 4)], page_size=16, heads=(8, 2), pad_rows=1),
    _c("noncausal", [(6, 50), (17, 20)], causal=False),
    _c("window", [(1, 90), (20, 60), (9, 9)], window=(13, 0)),
    _c("window_both", [(10, 50), (1, 33)], causal=False, window=(7, 5)),
    _c("softcap", [(1, 60), (15, 30)], softcap=5.0),
    _c("sinks", [(1, 60), (15, 30), (1, 1)], sinks=True, heads=(8, 2)),
    _c("fp8_descale", [(1, 60), (6, 44)], fp8=True, dtype="bfloat16"),
    # fp8 with every other knob: one-row pages, split decode (the fp8 split tile), a window, a softcap, a scale
    _c("fp8_page1_split_window_softcap", [(1, 70), (1, 40), (4, 33)], fp8=True, dtype="bfloat16", page_size=1,
       heads=(8, 2), num_splits=2, window=(25, 0), softcap=5.0, softmax_scale=0.3),
    _c("dv_differs", [(1, 50), (8, 20)], head_dim=32, head_dim_v=64),
    _c("split3", [(1, 90), (5, 70), (1, 2)], num_splits=3, softmax_scale=0.4),
    _c("split3_sinks_window", [(1, 90), (9, 70)], num_splits=3, sinks=True, window=(20, 0)),
    _c("split_auto", [(1, 100), (1, 64)], num_splits=None, heads=(4, 1)),
    _c("split2_page1_gqa7", [(1, 50), (3, 30)], num_splits=2, page_size=1, heads=(7, 1)),
]

# Real shapes for the compiled GPU kernels.
_GPU_MIXED = [(1, 1500), (300, 300), (1, 4097), (77, 900), (1, 1)]
GPU_CASES = [
    _c("decode_only", [(1, n) for n in (17, 1024, 3000, 4096, 65, 2049, 1, 513)], heads=(32, 8), head_dim=128,
       dtype="bfloat16", page_size=16, pad_rows=2),
    _c("decode_page1", [(1, n) for n in (100, 2048, 3001, 7)], page_size=1, heads=(32, 8), head_dim=128,
       dtype="bfloat16"),
    _c("decode_page64", [(1, n) for n in (100, 2048, 3001, 7)], page_size=64, heads=(32, 8), head_dim=128,
       dtype="bfloat16"),
    _c("decode_gqa7", [(1, n) for n in (900, 2500)], heads=(28, 4), head_dim=128, dtype="bfloat16",
       softmax_scale=0.15),
    _c("decode_gqa5_split", [(1, n) for n in (9000, 33)], heads=(40, 8), head_dim=128, dtype="bfloat16",
       pad_rows=3),  # Llama 4: 12 tokens a row block; one long sequence splits
    _c("verify_gqa7", [(4, n) for n in (100, 2000, 5)], heads=(28, 4), head_dim=128, dtype="bfloat16",
       window=(700, 0)),
    _c("decode_mha_d64", [(1, n) for n in (900, 2500)], heads=(16, 16), head_dim=64, dtype="bfloat16"),
    _c("decode_d256", [(1, n) for n in (900, 2500)], heads=(16, 4), head_dim=256, dtype="bfloat16"),
    _c("prefill_only", [(1000, 1000), (513, 513), (2048, 2048)], heads=(32, 8), head_dim=128, dtype="bfloat16"),
    _c("prefill_page1", [(700, 700), (129, 129)], page_size=1, heads=(32, 8), head_dim=128, dtype="bfloat16"),
    _c("prefill_gqa7", [(600, 600), (97, 97)], heads=(28, 4), head_dim=128, dtype="bfloat16", page_size=64),
    _c("prefill_d64_gqa1", [(600, 600)], heads=(8, 8), head_dim=64, dtype="bfloat16"),
    _c("prefill_d256", [(600, 600), (33, 33)], heads=(16, 2), head_dim=256, dtype="bfloat16"),
    _c("mixed", _GPU_MIXED, heads=(32, 8), head_dim=128, dtype="bfloat16"),
    _c("mixed_f32", _GPU_MIXED, heads=(8, 2), head_dim=128, dtype="float32"),
    _c("prefix_extend", [(200, 2000), (64, 3000)], heads=(32, 8), head_dim=128, dtype="bfloat16", page_size=64,
       softmax_scale=0.03),
    _c("verify", [(4, n) for n in (100, 2000, 4000, 5)], heads=(32, 8), head_dim=128, dtype="bfloat16",
       softmax_scale=0.15),
    _c("window", [(1, 3000), (500, 1500)], heads=(32, 8), head_dim=128, dtype="bfloat16", window=(255, 0)),
    _c("softcap", [(1, 3000), (500, 1500)], heads=(32, 8), head_dim=128, dtype="bfloat16", softcap=30.0),
    _c("sinks", [(1, 3000), (500, 1500)], heads=(64, 8), head_dim=64, dtype="bfloat16", sinks=True,
       window=(127, 0)),
    _c("fp8_descale", [(1, 3000), (300, 1500)], heads=(32, 8), head_dim=128, dtype="bfloat16", fp8=True),
    _c("split_auto", [(1, 8000), (1, 3000)], heads=(32, 8), head_dim=128, dtype="bfloat16", num_splits=None),
    _c("split4", [(1, 5000), (40, 3000)], heads=(32, 8), head_dim=128, dtype="bfloat16", num_splits=4,
       sinks=True),
]


def _cdiv(a, b):
    return -(-a // b)


def build_inputs(case: Case, seed: int = 0):
    """Random (q, k_cache, v_cache, md, kwargs) for ``case``; unused pages/slots hold NaN."""
    rng = np.random.default_rng(seed)
    hq, hkv = case.heads
    d, dv, ps = case.head_dim, case.head_dim_v or case.head_dim, case.page_size
    q_lens = [q for q, _ in case.seq_lens] + [0] * case.pad_rows
    k_lens = [k for _, k in case.seq_lens] + [1] * case.pad_rows
    batch = len(q_lens)
    pages_per_seq = [_cdiv(k, ps) for k in k_lens[: len(case.seq_lens)]]
    width = max(pages_per_seq) + 1
    num_pages = 1 + sum(pages_per_seq) + case.spare_pages  # page 0 reserved
    ids = rng.permutation(np.arange(1, num_pages)).astype(np.int32)
    spare = ids[sum(pages_per_seq):]
    table = np.zeros((batch, width), np.int32)  # padded rows use page 0
    k_pool = rng.standard_normal((num_pages, ps, hkv, d)).astype(np.float32)
    v_pool = rng.standard_normal((num_pages, ps, hkv, dv)).astype(np.float32)
    used = np.zeros((num_pages, ps), bool)
    used[0, 0] = True
    nxt = 0
    for b, n in enumerate(pages_per_seq):
        table[b, :n] = ids[nxt:nxt + n]
        table[b, n:] = rng.choice(spare, width - n) if len(spare) else 0
        nxt += n
        for j in range(k_lens[b]):
            used[table[b, j // ps], j % ps] = True
    k_pool[~used] = np.nan
    v_pool[~used] = np.nan
    num_tokens = sum(q_lens) + case.pad_tokens
    cu_q = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    q = rng.standard_normal((num_tokens, hq, d)).astype(np.float32)
    dtype = jnp.dtype(case.dtype)
    cache_dtype = jnp.float8_e4m3fn if case.fp8 else dtype
    md = AttentionMetadata(
        cache_seqlens=jnp.asarray(k_lens, jnp.int32),
        cu_seqlens_q=jnp.asarray(cu_q),
        cu_seqlens_k=jnp.asarray(np.concatenate([[0], np.cumsum(k_lens)]), jnp.int32),
        page_table=jnp.asarray(table),
        out_cache_loc=jnp.zeros((num_tokens,), jnp.int32),
        max_seqlen_q=jnp.int32(max(q_lens)),
        max_seqlen_k=jnp.int32(max(k_lens)),
        mode=ForwardMode.DECODE if case.max_q_len == 1 else ForwardMode.EXTEND,
        batch_size=batch, num_tokens=num_tokens, page_size=ps, max_q_len=case.max_q_len, max_pages=width,
    )
    kwargs = dict(causal=case.causal, window_size=case.window, softcap=case.softcap, return_lse=case.return_lse)
    if case.softmax_scale is not None:
        kwargs["softmax_scale"] = case.softmax_scale
    if case.sinks:
        kwargs["sinks"] = jnp.asarray(rng.standard_normal(hq) * 2.0, jnp.float32)
    if case.fp8:
        kwargs["k_descale"] = jnp.asarray(rng.uniform(0.5, 2.0, (batch, hkv)), jnp.float32)
        kwargs["v_descale"] = jnp.asarray(rng.uniform(0.5, 2.0, (batch, hkv)), jnp.float32)
    return jnp.asarray(q, dtype), jnp.asarray(k_pool, cache_dtype), jnp.asarray(v_pool, cache_dtype), md, kwargs


def compare(out, ref, *, tol: float, what: str):
    """Relative Frobenius error of ``out`` against ``ref`` (float32), NaN never passes."""
    out = np.asarray(jnp.asarray(out, jnp.float32))
    ref = np.asarray(jnp.asarray(ref, jnp.float32))
    assert out.shape == ref.shape, f"{what}: {out.shape=} != {ref.shape=}"
    assert np.isfinite(out).all(), f"{what}: {np.isnan(out).sum()} NaN / inf values"
    err = np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30)
    assert err < tol, f"{what}: relative error {err:.3e} >= {tol:.1e}"
    return err


def compare_per_sequence(out, ref, cu_seqlens_q, *, tol: float, what: str):
    """Relative error of each sequence's rows against that sequence's own reference norm, so a wrong
    page of one sequence fails even when the batch-wide error is small. Returns the worst error."""
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    cu = np.asarray(cu_seqlens_q)
    worst, bad = 0.0, []
    for b in range(len(cu) - 1):
        o, r = out[cu[b]:cu[b + 1]], ref[cu[b]:cu[b + 1]]
        if not r.size:
            continue
        err = np.linalg.norm(o - r) / max(np.linalg.norm(r), 1e-30)
        worst = max(worst, err) if np.isfinite(err) else np.inf
        if not err < tol:
            bad.append(f"sequence {b} (rows {cu[b]}:{cu[b + 1]}): {err:.3e}")
    assert not bad, f"{what}: relative error >= {tol:.1e} in " + "; ".join(bad)
    return worst


# The dense reference gathers every query row's keys ([T, kv width, Hkv, D] in float32); above this many
# bytes it runs in slices: the GPU cases reach tens of GiB, more than the GPU holds when tests run in
# parallel.
REFERENCE_BYTES = 1 << 30


def reference_by_sequence(q, k, v, md, **kwargs):
    """``reference`` over the whole batch, or in slices where its key gather would exceed
    ``REFERENCE_BYTES``: one sequence at a time, and under a causal mask a few query rows at a time with
    the keys past the slice's last row left out (no row of the slice can see them). Rows past the last
    sequence: 0, LSE -inf, as the reference gives them."""
    cu, lens = np.asarray(md.cu_seqlens_q), np.asarray(md.cache_seqlens)
    row_bytes = md.page_table.shape[1] * md.page_size * k.shape[2] * max(k.shape[3], v.shape[3]) * 4
    if q.shape[0] * row_bytes <= REFERENCE_BYTES:
        return reference(q, k, v, md.cache_seqlens, md.cu_seqlens_q, md.page_table, page_size=md.page_size,
                         **kwargs)
    outs, lses = [], []
    for b in range(len(cu) - 1):
        n = int(cu[b + 1] - cu[b])
        rows = max(1, REFERENCE_BYTES // row_bytes) if kwargs.get("causal", True) else max(n, 1)
        per = {name: (a[b:b + 1] if name.endswith("descale") and getattr(a, "ndim", 0) == 2 else a)
               for name, a in kwargs.items()}
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            got = reference(q[cu[b] + r0:cu[b] + r1], k, v, jnp.asarray([lens[b] - (n - r1)], jnp.int32),
                            jnp.asarray([0, r1 - r0], jnp.int32), md.page_table[b:b + 1],
                            page_size=md.page_size, **per)
            out, lse = got if kwargs.get("return_lse") else (got, None)
            outs.append(out)
            lses.append(lse)
    pad = q.shape[0] - int(cu[-1])
    out = jnp.concatenate(outs + [jnp.zeros((pad,) + outs[0].shape[1:], outs[0].dtype)])
    if not kwargs.get("return_lse"):
        return out
    return out, jnp.concatenate(lses + [jnp.full((pad,) + lses[0].shape[1:], -jnp.inf, jnp.float32)])

def check_attention(attn_fn, case: Case, *, seed: int = 0, tol: float | None = None, **extra):
    """Runs ``attn_fn`` on ``case`` and checks it against the reference; returns the relative error."""
    q, k, v, md, kwargs = build_inputs(case, seed)
    tol = TOLERANCE[case.dtype] if tol is None else tol
    got = attn_fn(q, k, v, md, num_splits=case.num_splits, **kwargs, **extra)
    want = reference_by_sequence(q, k, v, md, **kwargs)
    out, lse = got if case.return_lse else (got, None)
    ref_out, ref_lse = want if case.return_lse else (want, None)
    assert out.dtype == q.dtype, f"{out.dtype=} must equal {q.dtype=}"
    err = compare(out, ref_out, tol=tol, what=f"{case.name} out")
    compare_per_sequence(out, ref_out, md.cu_seqlens_q, tol=2 * tol, what=f"{case.name} out per sequence")
    n_real = int(md.cu_seqlens_q[-1])
    assert not np.asarray(out[n_real:], np.float32).any(), f"{case.name}: padding tokens must be 0"
    if lse is not None:
        lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
        assert lse.dtype == np.float32 and lse.shape == ref_lse.shape, f"{lse.dtype=} {lse.shape=}"
        assert (np.isneginf(lse) == np.isneginf(ref_lse)).all(), f"{case.name}: -inf LSE pattern differs"
        assert np.isneginf(lse[n_real:]).all(), f"{case.name}: padding tokens must have LSE -inf"
        fin = np.isfinite(ref_lse)
        lse_err = np.abs(lse[fin] - ref_lse[fin]).max(initial=0.0)
        assert lse_err < 20 * tol, f"{case.name}: LSE max abs error {lse_err:.3e}"
    return err


def forbid_kernel_planning(monkeypatch):
    """Kernel calls must use the step's planned schedules: planning inside a Triton or Mosaic call
    raises (the planners' own ``schedule.plan_schedule`` / ``plan_mosaic_schedule`` are left alone)."""
    from jax_attn.kernels import mosaic_paged, triton_paged

    def replanned(*args, **kw):
        raise AssertionError("the Triton kernel call planned its own schedule: the step plan has none that fits")

    def replanned_mosaic(plan, *args, **kw):
        raise AssertionError(f"the Mosaic kernel call ran {plan.__name__}: the step plan has none that fits")
    monkeypatch.setattr(triton_paged, "plan_schedule", replanned)
    monkeypatch.setattr(mosaic_paged, "_plan_in_call", replanned_mosaic)
    triton_paged.paged_attention.clear_cache()  # a call traced by an earlier test would not plan again
