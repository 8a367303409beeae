"""Absorbed MLA (DeepSeek-style) decode on one GPU: our kernel against SGLang's Triton MLA decode.

Dimension legend: B batch, Hq query heads, T = B * q_len tokens, L latent width (kv_lora_rank, 512),
R rope width (qk_rope_head_dim, 64), D = L + R (576).

One latent cache ``[num_pages, page_size, 1, D]`` (a row is the latent ``c_kv``, also the value row,
then ``k_rope``), random bf16, built once in torch by ``peers.make_problem`` (page 0 reserved, pages
shuffled) and shared zero-copy with JAX through DLPack. Queries ``[T, Hq, D]`` are the absorbed
``q_nope`` then ``q_rope``; the output is ``[T, Hq, L]``; softmax scale ``(128 + 64) ** -0.5``
(DeepSeek's qk_nope + rope head dims, no YaRN factor).

Peers:
  ours_<kernel>  ``jax_attn.attention.attention(q, latent, None, md, impl=--impl, latent_dim=L, ...)``,
                 metadata from ``peers._ours_metadata`` and the work schedules planned once beforehand
                 (the Mosaic kernel's with ``latent=True``; it takes pages that are multiples of 8).
  sglang_triton  SGLang's ``decode_attention_fwd`` (triton_ops/decode_attention.py) as its MLA path calls
                 it: k_buffer = the cache as token rows ``[slots, 1, D]``, v_buffer = its first L columns
                 (a view), token-level kv_indptr / kv_indices, f32 attn_logits / attn_lse scratch; kv
                 splits 4, 8 and 16 are tried and the fastest kept. One query per request: no q_len 2 row.

Points (``POINTS``), B=64, ctx 4096 (drafts included), bf16, page size 64 and 1; and decode of few long
sequences (H=16, page 64: B=1 ctx 32768, B=8 ctx 8192), where the kernels split the keys:
  decode H=16    latent-cache read bandwidth, TB/s of ``B * ctx * D * 2`` bytes plus q and out.
  decode H=128   both peers; TB/s and TFLOP/s.
  verify q=2 H=128  MTP verify (bottom-right causal), ours alone, TFLOP/s of ``2 * B * q_len * Hq * ctx * (D + L)``.
Every row prints both TB/s and TFLOP/s; each of our rows carries ``ours/peer`` = its throughput / SGLang's
(> 1: ours faster).

``--prefix-mha``: instead, the chunked-prefix prefill's multi-head calls (``PREFIX_POINTS``) through
``jax_attn.attention.varlen_attention`` (contiguous ragged K/V, as ``flash_attn_varlen_func``), B=4, Hq=Hkv=16
(DeepSeek at TP8), bf16: the extend part (causal, S=4096 each) at q/k head dim 192 and v 128, against the same
call at 128/128 (the issue's anchor), and one prefix chunk (1024 queries on 4096 keys, non-causal, LSE). TFLOP/s
of ``2 * Hq * pairs * (Dqk + Dv)`` (pairs: visible query-key pairs). Rows: ``ours_triton``, ``ours_mosaic`` (what
``varlen_attention(impl="mosaic")`` runs: ``kernel_policy.varlen_repaged`` copies the keys into pages of 64 rows,
copy included, only at head dims whose rows cannot be gathered) and ``ours_mosaic-rows`` (the Mosaic kernel on
pages of one row, its rows gathered). Each kernel's output is compared with the first kernel's, the first
sequence with a float32 reference.

Correctness, before timing: each peer's output on the first ``--check-seqs`` sequences is compared with
a float32 torch evaluation of the absorbed formula; the max absolute error is printed, and an error over
``TOLERANCE`` marks the row FAIL (it is still timed; the table goes on). Exit status 1 when a row
FAILs or ours does not run.

Timing (``common``'s docstring): GPU time per call from a CUPTI trace (median, warm-up excluded), and
the wall time of back-to-back calls (torch: CUDA graph; JAX: queued dispatch).

Commands (GPU machine, repository root; SGLang from ``bash benchmarks/fetch_peers.sh .peers``):
  PYTHONPATH=.:.peers:$PYTHONPATH python3 benchmarks/bench_mla.py [--page-size 64] [--reps 30]
  JAX_PLATFORMS=cpu python3 benchmarks/bench_mla.py --smoke   # CPU: ours interpreted at toy shapes

Flags: ``--smoke`` toy points (CPU: the SGLang peer and CUPTI are skipped, one line says so);
``--reps N`` timed repetitions (30; smoke 2); ``--page-size`` only points of this page size;
``--impl`` auto, triton, mosaic, bridge or a comma-separated list (ours: one row each, named by the kernel
run; ``bridge``: the torch bridge's layer call on its launch path, decode points, GPU);
``--check-seqs N`` sequences compared with the float32 reference (2).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import sys
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX and torch share the GPU
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (_ROOT, os.path.join(_ROOT, ".peers")):
    if os.path.isdir(_p) and _p not in sys.path:
        sys.path.insert(0, _p)

import jax  # noqa: E402
import torch  # noqa: E402

import common  # noqa: E402  (benchmarks/ is on sys.path when run as a script)
import peers  # noqa: E402

SCALE = (128 + 64) ** -0.5  # DeepSeek V2/V3: qk_nope_head_dim 128 + qk_rope_head_dim 64
TOLERANCE = 2e-2  # max |out - float32 reference| (bf16 outputs land near 1e-3)
SGLANG_SPLITS = (4, 8, 16)  # max_kv_splits tried for SGLang; the fastest is reported


@dataclasses.dataclass(frozen=True)
class Point:
    heads: int  # Hq
    batch: int  # B
    q_len: int  # queries per request (1 decode, 2 MTP verify)
    ctx: int  # keys per request, new tokens included
    page_size: int
    latent: int = 512  # L (kv_lora_rank)
    rope: int = 64  # R (qk_rope_head_dim)

    @property
    def name(self) -> str:
        kind = "decode" if self.q_len == 1 else f"verify q={self.q_len}"
        return f"{kind} H={self.heads} B={self.batch} ctx={self.ctx} ps={self.page_size}"

    def bytes(self) -> int:
        """Latent-cache rows read plus q and out (bf16)."""
        t = self.batch * self.q_len
        return 2 * (self.batch * self.ctx * (self.latent + self.rope) + t * self.heads * (2 * self.latent + self.rope))

    def flops(self) -> int:
        """QK^T over D columns plus PV over L columns, every query against every key."""
        return 2 * self.batch * self.q_len * self.heads * self.ctx * (2 * self.latent + self.rope)


POINTS = ([Point(h, 64, q, 4096, ps) for h, q in ((16, 1), (128, 1), (128, 2)) for ps in (64, 1)]
          + [Point(16, 1, 1, 32768, 64), Point(16, 8, 1, 8192, 64)])  # few long sequences: split-KV
SMOKE_POINTS = [Point(4, 3, 1, 40, 16), Point(4, 2, 2, 24, 1)]


@dataclasses.dataclass(frozen=True)
class PrefixPoint:
    """One multi-head call of the chunked-prefix prefill (``--prefix-mha``): ``batch`` sequences of
    ``q_len`` queries on ``kv_len`` keys each, contiguous (varlen)."""

    batch: int
    q_len: int
    kv_len: int
    causal: bool
    head_dim: int  # q/k (qk_nope + qk_rope: 192)
    head_dim_v: int  # v (v_head_dim: 128)
    heads: int = 16

    @property
    def name(self) -> str:
        kind = "extend causal" if self.causal else "prefix chunk"
        return f"{kind} {self.head_dim}/{self.head_dim_v} B={self.batch} q={self.q_len} k={self.kv_len}"

    def pairs(self) -> int:
        if not self.causal:
            return self.batch * self.q_len * self.kv_len
        shift = self.kv_len - self.q_len  # bottom-right causal
        return self.batch * sum(shift + i + 1 for i in range(self.q_len))

    def flops(self) -> int:
        return 2 * self.heads * self.pairs() * (self.head_dim + self.head_dim_v)

    def bytes(self) -> int:
        """q, k, v and out (bf16)."""
        return 2 * self.heads * self.batch * ((self.q_len + self.kv_len) * (self.head_dim + self.head_dim_v))


PREFIX_POINTS = [PrefixPoint(4, 4096, 4096, True, 192, 128), PrefixPoint(4, 4096, 4096, True, 128, 128),
                 PrefixPoint(4, 1024, 4096, False, 192, 128)]
SMOKE_PREFIX_POINTS = [PrefixPoint(2, 24, 24, True, 192, 128, heads=2), PrefixPoint(2, 8, 40, False, 192, 128, heads=2)]


def prefix_problem(pt: PrefixPoint, seed: int = 0):
    """Random bf16 ``q [B*q, H, Dqk]``, ``k [B*kv, H, Dqk]``, ``v [B*kv, H, Dv]`` and the cu_seqlens."""
    import jax.numpy as jnp

    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (pt.batch * pt.q_len, pt.heads, pt.head_dim), jnp.bfloat16)
    k = jax.random.normal(kk, (pt.batch * pt.kv_len, pt.heads, pt.head_dim), jnp.bfloat16)
    v = jax.random.normal(kv, (pt.batch * pt.kv_len, pt.heads, pt.head_dim_v), jnp.bfloat16)
    cu_q = jnp.arange(pt.batch + 1, dtype=jnp.int32) * pt.q_len
    cu_k = jnp.arange(pt.batch + 1, dtype=jnp.int32) * pt.kv_len
    return q, k, v, cu_q, cu_k


def run_prefix_point(pt: PrefixPoint, impls: list[str], reps: int) -> list[Result]:
    """Our kernels on one chunked-prefix call (``run_peer``: checked against a float32 evaluation of the first
    sequence, then timed), and the kernels against each other over the whole batch."""
    import jax.numpy as jnp

    from jax_attn.attention import attention, varlen_attention, varlen_metadata

    print(f"{pt.name}:", flush=True)
    q, k, v, cu_q, cu_k = prefix_problem(pt)
    kw = dict(causal=pt.causal, softmax_scale=SCALE, return_lse=not pt.causal)
    sizes = dict(max_seqlen_q=pt.q_len, max_seqlen_k=pt.kv_len)

    def rows(q, k, v, cu_q, cu_k):  # the Mosaic kernel on pages of one row (its gathered rows), not copied
        md = varlen_metadata(cu_q, cu_k, num_tokens=q.shape[0], num_keys=k.shape[0], **sizes)
        return attention(q, k[:, None], v[:, None], md, impl="mosaic", **kw)

    def out_of(res):  # the attention output (without the LSE) as a torch tensor, once JAX has written it
        return torch.from_dlpack(jax.block_until_ready(res[0] if isinstance(res, tuple) else res))

    # float32 reference of the first sequence (bottom-right causal)
    q0, k0, v0 = (x[:n].astype(jnp.float32) for x, n in ((q, pt.q_len), (k, pt.kv_len), (v, pt.kv_len)))
    s = jnp.einsum("qhd,khd->hqk", q0, k0) * SCALE
    if pt.causal:
        s = jnp.where(jnp.arange(pt.kv_len)[None, :] <= jnp.arange(pt.q_len)[:, None] + pt.kv_len - pt.q_len,
                      s, -jnp.inf)
    ref0 = torch.from_dlpack(jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, axis=-1), v0))
    results, calls = [], {}
    for impl in impls:
        fn = jax.jit(rows if impl == "mosaic-rows" else functools.partial(varlen_attention, impl=impl, **sizes, **kw))
        calls[impl] = functools.partial(fn, q, k, v, cu_q, cu_k)
        results.append(run_peer(f"ours_{impl}", lambda impl=impl: peers.PeerRun(f"ours_{impl}", calls[impl], out_of,
                                                                                "jax"), pt, ref0, reps))
    ran = [r for r in results if r.status != "error"]
    outs = [out_of(calls[r.peer[len("ours_"):]]()).float() for r in ran]
    if len(outs) > 1:
        diffs = {r.peer: float((o - outs[0]).abs().max()) for r, o in zip(ran[1:], outs[1:])}
        print(f"  over the batch, max |out - {ran[0].peer}'s| (output max {float(outs[0].abs().max()):.2f}): "
              + ", ".join(f"{peer} {d:.1e}" for peer, d in diffs.items()), flush=True)
        if not max(diffs.values()) <= TOLERANCE:
            for r in results:
                r.status = "FAIL"
    return results


def prefix_ratios(results: list[Result]) -> None:
    """Each 192/128 extend row's ``ratio``: its TFLOP/s over the same kernel's 128/128 extend (the target's
    anchor, ``>= 0.9``)."""
    anchor = {r.peer: r.tflops for r in results if " 128/128 " in r.point and r.status == "ok"}
    for r in results:
        if r.point.startswith("extend causal 192/128") and r.peer in anchor:
            r.ratio = r.tflops / anchor[r.peer]


@dataclasses.dataclass
class Result:
    """One measured (point, peer) pair."""

    point: str
    peer: str
    status: str = "ok"  # ok | FAIL (max_err over TOLERANCE) | n/a | error
    time_us: float = float("nan")  # GPU time per call (CUPTI), falls back to wall time
    wall_us: float = float("nan")  # back-to-back wall time per call
    tbps: float = float("nan")  # Point.bytes() / time
    tflops: float = float("nan")  # Point.flops() / time
    max_err: float = float("nan")  # max |out - float32 reference| on the checked sequences
    ratio: float = float("nan")  # our throughput / this peer's (> 1: ours faster)
    note: str = ""


def make_problem(pt: Point, device: str, seed: int = 0) -> peers.Problem:
    """The shared random problem: ``k_cache`` is the latent cache ``[num_pages, ps, 1, D]``;
    ``v_cache`` is the same tensor (MLA keeps no separate values: they are its first L columns)."""
    p = peers.make_problem(pt.batch, pt.q_len, pt.ctx, pt.page_size, num_q_heads=pt.heads, num_kv_heads=1,
                           head_dim=pt.latent + pt.rope, device=device, seed=seed)
    return dataclasses.replace(p, v_cache=p.k_cache)


def reference(p: peers.Problem, pt: Point, num_seqs: int) -> torch.Tensor:
    """Float32 absorbed MLA on the first ``num_seqs`` sequences: ``[num_seqs * q_len, Hq, L]``."""
    n = min(num_seqs, p.batch)
    rows = p.k_cache.reshape(-1, p.head_dim)[p.slots[:n].long()].float()  # [n, ctx, D]
    q = p.q[: n * pt.q_len].float().view(n, pt.q_len, pt.heads, p.head_dim)
    s = torch.einsum("bqhd,bkd->bhqk", q, rows) * SCALE
    qpos = pt.ctx - pt.q_len + torch.arange(pt.q_len, device=q.device)
    visible = torch.arange(pt.ctx, device=q.device)[None, :] <= qpos[:, None]  # bottom-right causal
    s = s.masked_fill(~visible, float("-inf"))
    out = torch.einsum("bhqk,bkl->bqhl", s.softmax(-1), rows[..., : pt.latent])
    return out.reshape(n * pt.q_len, pt.heads, pt.latent)


def ours(p: peers.Problem, pt: Point, impl: str) -> peers.PeerRun:
    """``jax_attn.attention.attention`` over the latent cache (v_cache=None), schedule planned once."""
    from jax_attn.attention import attention, call_of
    from jax_attn.kernel_policy import select_kernel
    from jax_attn.kernels.config import DEFAULT_CONFIG
    from jax_attn.kernels.schedule import plan_schedule

    q, k, _, md = peers._ours_metadata(p)  # DECODE (q_len 1) or TARGET_VERIFY (q_len 2) metadata
    sched = jax.jit(functools.partial(plan_schedule, num_q_heads=pt.heads, num_kv_heads=1, config=DEFAULT_CONFIG))(md)
    md = dataclasses.replace(md, schedule=jax.block_until_ready(sched))
    kw = dict(latent_dim=pt.latent, softmax_scale=SCALE, causal=True)
    kernel = select_kernel(impl, call_of(q, k, None, md, **kw))
    if kernel == "mosaic":  # its own tiles, planned once (a step plan carries them)
        from jax_attn.kernels.mosaic_paged import latent_unsupported, plan_mosaic_schedule

        reason = latent_unsupported(q.dtype, k.dtype, k.shape[-1], pt.latent, pt.page_size, pt.heads, 1)
        if reason is not None:
            raise peers.Unavailable(reason)
        plan = functools.partial(plan_mosaic_schedule, num_q_heads=pt.heads, num_kv_heads=1, num_splits=None,
                                 latent=True)
        md = dataclasses.replace(md, mosaic_schedule=jax.block_until_ready(jax.jit(plan)(md)))
    fn = jax.jit(lambda q, k, md: attention(q, k, None, md, impl=impl, **kw))

    def to_tokens(out):
        jax.block_until_ready(out)
        return torch.from_dlpack(out).reshape(p.num_tokens, pt.heads, pt.latent)

    note = f"impl={impl} -> {kernel}, {md.mode.name.lower()}"
    return peers.PeerRun(f"ours_{kernel}", lambda: fn(q, k, md), to_tokens, "jax", note)


def bridge(p: peers.Problem, pt: Point) -> peers.PeerRun:
    """The torch bridge's MLA layer on its launch path: ``FlashAttentionBackend`` over an SGLang-style
    ``MLATokenToKVPool`` holding the same latent cache, one decode step planned, one forward to bind the layer;
    then the bound layer call (the kernel and, with split-KV, its merge, launched from torch; no KV write)."""
    from torch_bridge import (FlashAttentionBackend, ForwardBatch, ForwardMode, MLATokenToKVPool, ModelConfig,
                              ModelRunner, RadixAttention, ReqToTokenPool)

    if pt.q_len != 1:
        raise peers.Unavailable("decode only (a verify step needs the engine's spec info)")
    if not p.q.is_cuda:
        raise peers.Unavailable("the launch path needs a CUDA device")
    b, dev = p.batch, p.q.device
    buf = p.k_cache.view(-1, 1, p.head_dim)  # [slots, 1, D]: the cache's own memory
    pool = MLATokenToKVPool([buf], pt.latent, pt.rope)
    table = torch.zeros(b + 1, pt.ctx, dtype=torch.int32, device=dev)  # row 0 reserved
    table[1:] = p.slots
    runner = ModelRunner(ReqToTokenPool(table), pool, ModelConfig(pt.ctx, attention_arch="MLA"),
                         page_size=pt.page_size, device=str(dev))
    backend = FlashAttentionBackend(runner)
    layer = RadixAttention(pt.heads, p.head_dim, SCALE, 1, 0, v_head_dim=pt.latent)
    rows = torch.arange(1, b + 1, device=dev)
    loc = p.slots[:, -1].long()
    fb = ForwardBatch(ForwardMode.DECODE, b, rows, torch.full((b,), pt.ctx, device=dev), loc, token_to_kv_pool=pool)
    backend.init_forward_metadata(fb)
    q = p.q.reshape(b, -1)
    backend.forward(q, buf[loc, 0].clone(), buf[loc, 0, :pt.latent].clone(), layer, fb)  # writes the same rows
    hits = backend.runner.hits
    if len(hits) != 1 or not hasattr(hits[0], "call"):
        raise peers.Unavailable("the layer did not take the launch path")
    call = hits[0].call
    splits = getattr(call.tables, "num_splits", 1)
    note = f"bridge {type(call).__module__.split('.')[-1]}, {splits} kv split(s)"
    return peers.PeerRun("ours_bridge", lambda: call(q), lambda o: o.reshape(b, pt.heads, pt.latent), "torch", note)


def sglang_mla(p: peers.Problem, pt: Point, max_kv_splits: int) -> peers.PeerRun:
    """SGLang's Triton decode kernel on the latent cache as its MLA backend calls it (Lk = D, Lv = L)."""
    if pt.q_len != 1:
        raise peers.Unavailable("decode kernel takes one query per request (no q_len > 1)")
    if not p.q.is_cuda:
        raise peers.Unavailable("Triton GPU kernel: no CUDA device")
    try:
        from sglang.srt.layers.attention.triton_ops.decode_attention import decode_attention_fwd
    except Exception as e:
        raise peers.Unavailable(f"import failed ({type(e).__name__}: {e}); "
                                "run benchmarks/fetch_peers.sh, carry .peers") from e
    b, dev = p.batch, p.q.device
    k_buffer = p.k_cache.view(-1, 1, p.head_dim)  # [slots, 1, D]
    v_buffer = k_buffer[..., : pt.latent]  # [slots, 1, L], a view (as SGLang's MLA pool hands it)
    kv_indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * pt.ctx
    kv_indices = p.slots.reshape(-1).contiguous()
    out = torch.empty(b, pt.heads, pt.latent, dtype=p.q.dtype, device=dev)
    logits = torch.empty(b, pt.heads, max_kv_splits, pt.latent, dtype=torch.float32, device=dev)
    lse = torch.empty(b, pt.heads, max_kv_splits, dtype=torch.float32, device=dev)
    splits = torch.full((b,), max_kv_splits, dtype=torch.int32, device=dev)

    def call():
        decode_attention_fwd(p.q, k_buffer, v_buffer, out, kv_indptr, kv_indices, logits, lse, splits,
                             max_kv_splits, SCALE, 1.0, 1.0)
        return out

    note = f"kv_splits={max_kv_splits}, token indices" + (" (no paged variant)" if pt.page_size > 1 else "")
    return peers.PeerRun("sglang_triton", call, lambda o: o.clone(), "torch", note)


def measure(run: peers.PeerRun, ref: torch.Tensor, pt: Point | PrefixPoint, res: Result, reps: int) -> None:
    """Checks ``run`` against ``ref`` (its first rows), then times it; fills ``res``."""
    out = run.to_tokens(run.call())[: ref.shape[0]].float()
    res.max_err = float((out - ref).abs().max()) if bool(torch.isfinite(out).all()) else float("inf")
    del out
    if not res.max_err <= TOLERANCE:
        res.status = "FAIL"
    if run.framework == "jax":
        wall, sync = common.time_jax(run.call, reps=reps), jax.block_until_ready
    else:
        wall, sync = common.time_torch(run.call, reps=reps), (lambda out: None)
    dev = common.time_device(run.call, sync, calls=max(reps, 10))
    res.wall_us = wall.time_us
    res.time_us = dev.time_us if dev else wall.time_us
    res.tbps = pt.bytes() / (res.time_us * 1e-6) / 1e12
    res.tflops = pt.flops() / (res.time_us * 1e-6) / 1e12
    timing = f"{dev.note}, spread {dev.spread:.0%}" if dev else "no CUPTI trace: time = wall"
    res.note = "; ".join(x for x in (run.note, timing, f"wall: {wall.note}") if x)


def run_peer(name: str, build, pt: Point | PrefixPoint, ref: torch.Tensor, reps: int) -> Result:
    res = Result(pt.name, name.split("/")[0])  # the built run's name once it exists
    try:
        run = build()
        res.peer = run.name
        measure(run, ref, pt, res, reps)
    except peers.Unavailable as e:
        res.status, res.note = "n/a", str(e)
    except Exception as e:  # a broken peer must not stop the others
        first = str(e).splitlines()[0][:160] if str(e) else ""
        res.status, res.note = "error", f"{type(e).__name__}: {first}"
        traceback.print_exc(limit=3)
    print(f"  {name:<18} {res.status:<6} {common.fmt(res.time_us, '9.1f')} us  {common.fmt(res.tbps, '6.3g')} TB/s  "
          f"{common.fmt(res.tflops, '6.3g')} TFLOP/s  max err {common.fmt(res.max_err, '.1e')}  {res.note}", flush=True)
    return res


def run_point(pt: Point, *, device: str, impls: list[str], reps: int, check_seqs: int) -> list[Result]:
    """Ours (each of ``impls``) and SGLang (the fastest of its kv splits) on one point; each of our rows
    carries ours/peer against SGLang's."""
    print(f"{pt.name}:", flush=True)
    p = make_problem(pt, device)
    ref = reference(p, pt, check_seqs)
    mine = [run_peer(f"ours/{impl}", lambda impl=impl: bridge(p, pt) if impl == "bridge" else ours(p, pt, impl), pt,
                     ref, reps) for impl in impls]
    tries = []
    for s in SGLANG_SPLITS:
        tries.append(run_peer(f"sglang_triton/{s}", lambda s=s: sglang_mla(p, pt, s), pt, ref, reps))
        if tries[-1].status == "n/a":  # the reason does not depend on the splits
            break
    timed = [r for r in tries if r.status == "ok"]
    theirs = min(timed, key=lambda r: r.time_us) if timed else tries[0]
    for r in mine:
        if r.status == "ok" and theirs.status == "ok":
            r.ratio = theirs.time_us / r.time_us
    return mine + [theirs]


def format_table(results: list[Result]) -> str:
    head = (f"{'point':<38} {'peer':<14} {'time(us)':>9} {'wall(us)':>9} {'TB/s':>6} {'TFLOP/s':>7} "
            f"{'ours/peer':>9} {'maxerr':>7}  status / note")
    lines = [head, "-" * len(head)]
    for r in results:
        lines.append(f"{r.point:<38} {r.peer:<14} {common.fmt(r.time_us, '9.1f')} {common.fmt(r.wall_us, '9.1f')} "
                     f"{common.fmt(r.tbps, '6.3g')} {common.fmt(r.tflops, '7.3g')} {common.fmt(r.ratio, '9.2f')} "
                     f"{common.fmt(r.max_err, '7.1e')}  {r.status}" + (f" ({r.note[:110]})" if r.note else ""))
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="toy points; on the CPU ours runs interpreted, SGLang skipped")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per peer (default 30, smoke 2)")
    ap.add_argument("--page-size", type=int, default=0, help="only points of this page size (64 or 1)")
    ap.add_argument("--impl", default="auto", help="our kernel choices, comma-separated: auto, triton, mosaic, bridge")
    ap.add_argument("--check-seqs", type=int, default=2, help="sequences compared with the float32 reference")
    ap.add_argument("--prefix-mha", action="store_true",
                    help="the chunked-prefix prefill's multi-head calls (192/128 against 128/128) instead")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.smoke:
        print("no CUDA device: use --smoke for a CPU smoke run")
        return 2
    device = "cuda" if on_gpu else "cpu"
    name = torch.cuda.get_device_name(0) if on_gpu else "cpu (smoke run: numbers meaningless)"
    reps = args.reps or (2 if args.smoke else 30)
    if args.prefix_mha:
        return prefix_main(args, name, reps)
    points = [pt for pt in (SMOKE_POINTS if args.smoke else POINTS) if args.page_size in (0, pt.page_size)]
    if not points:
        print(f"no point has --page-size {args.page_size} (points: 64 and 1; smoke: 16 and 1)")
        return 2
    print(f"device: {name}; jax {jax.__version__} ({jax.devices()[0].device_kind}), torch {torch.__version__}",
          flush=True)
    if not on_gpu:
        print("smoke: skipped on the CPU: SGLang Triton MLA decode (GPU kernel), CUPTI device time (time = wall)",
              flush=True)
    results = []
    for pt in points:
        results += run_point(pt, device=device, impls=args.impl.split(","), reps=reps, check_seqs=args.check_seqs)
        gc.collect()  # the point's problem and peers' buffers
        if on_gpu:
            torch.cuda.empty_cache()
    path = os.path.join(common.out_dir(), "bench_mla.json")
    with open(path, "w") as f:
        json.dump({"device": name, "args": vars(args), "tolerance": TOLERANCE, "scale": SCALE,
                   "points": [dataclasses.asdict(pt) for pt in points],
                   "rows": [dataclasses.asdict(r) for r in results]}, f, indent=1, default=str)
    print(f"\nwrote: {path}")
    print(f"\ndevice: {name}; median of {reps} reps; absorbed MLA, latent {points[0].latent} + rope {points[0].rope}, "
          f"bf16, scale {SCALE:.4g}\n"
          "time = GPU time per call (CUPTI); wall = back-to-back calls (torch: CUDA graph, JAX: queued dispatch); "
          "TB/s = latent cache + q + out bytes / time; TFLOP/s = 2*B*q_len*Hq*ctx*(D+L) / time; "
          f"ours/peer = our throughput / peer's (>1: ours faster); maxerr vs float32 on {args.check_seqs} sequences, "
          f"FAIL over {TOLERANCE:.0e}")
    print(format_table(results))
    bad = [r for r in results if r.status == "FAIL" or (r.peer.startswith("ours") and r.status not in ("ok", "n/a"))]
    return 1 if bad else 0


def prefix_main(args, name: str, reps: int) -> int:
    impls = ["triton", "mosaic-rows", "mosaic"] if args.impl == "auto" else args.impl.split(",")
    if not torch.cuda.is_available():
        impls = ["triton"]  # (the CPU runs the Triton-lowered kernel interpreted)
    results = []
    for pt in SMOKE_PREFIX_POINTS if args.smoke else PREFIX_POINTS:
        results += run_prefix_point(pt, impls, reps)
        gc.collect()
    prefix_ratios(results)
    path = os.path.join(common.out_dir(), "bench_mla_prefix.json")
    with open(path, "w") as f:
        json.dump({"device": name, "args": vars(args), "rows": [dataclasses.asdict(r) for r in results]}, f,
                  indent=1, default=str)
    print(f"\nwrote: {path}\n\ndevice: {name}; median of {reps} reps; chunked-prefix MHA through varlen_attention, "
          "bf16; TFLOP/s = 2*H*pairs*(Dqk+Dv) / time; ours/peer here = 192/128 TFLOP/s over the same kernel's "
          "128/128 (target >= 0.9)")
    print(format_table(results))
    return 1 if any(r.status != "ok" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
