"""One attention problem, shared by every peer, and one adapter per peer.

Dimension legend: B batch, T = B * q_len tokens, Hq / Hkv query / kv heads, D head dim,
P pages per sequence, S kv splits.

All peers read the same random bf16 data. The paged cache is built once in torch
(``k_cache [num_pages, page_size, Hkv, D]``, page 0 reserved, the other pages handed out in a
shuffled order) and shared zero-copy with JAX through DLPack; SGLang's kernels read the same
memory as a token pool ``[num_slots, Hkv, D]``; FA3 (``flash_attn3_jax``) reads the paged cache
and page table as they are, through the same JAX views as ours. Layout copies a peer needs
(contiguous KV for SDPA, head-major pages for JAX's paged kernel) are made once, outside the timed
call.

Peers: ours (Triton, Mosaic GPU), torch SDPA, SGLang's Triton decode / extend kernels, FA3 through
its JAX binding, and JAX's Pallas paged attention / mha / Mosaic GPU attention.

Every adapter returns a ``PeerRun`` or raises ``Unavailable`` with the reason.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import torch
import torch.nn.functional as F


class Unavailable(Exception):
    """The peer cannot run this case (not installed, unsupported shape); the message says why."""


@dataclasses.dataclass
class PeerRun:
    name: str  # label shown in the table, e.g. "sdpa[cudnn]"
    call: Callable[[], object]  # the timed call
    to_tokens: Callable[[object], torch.Tensor]  # call's result -> [T, Hq, D] torch tensor
    framework: str  # "torch" (CUDA-graph timing) or "jax" (queued wall-clock timing)
    note: str = ""


@dataclasses.dataclass
class Problem:
    """Uniform batch: B sequences, q_len new tokens each, kv_len keys each (new ones included)."""

    batch: int
    q_len: int
    kv_len: int
    page_size: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    q: torch.Tensor  # [T, Hq, D] bf16
    k_cache: torch.Tensor  # [num_pages, page_size, Hkv, D] bf16
    v_cache: torch.Tensor  # [num_pages, page_size, Hkv, D] bf16
    page_table: torch.Tensor  # i32[B, P]
    slots: torch.Tensor  # i32[B, kv_len]; slot of key j of sequence b
    _jax: tuple | None = None

    @property
    def num_tokens(self) -> int:
        return self.batch * self.q_len

    @property
    def softmax_scale(self) -> float:
        return self.head_dim**-0.5

    def token_pool(self) -> tuple[torch.Tensor, torch.Tensor]:
        """SGLang's view of the cache: k_buffer, v_buffer [num_slots, Hkv, D] (same memory)."""
        shape = (-1, self.num_kv_heads, self.head_dim)
        return self.k_cache.view(shape), self.v_cache.view(shape)

    def contiguous_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered copies k, v [B, kv_len, Hkv, D]."""
        kb, vb = self.token_pool()
        idx = self.slots.long()
        return kb[idx].contiguous(), vb[idx].contiguous()

    def jax_views(self):
        """(q, k_cache, v_cache, page_table) as JAX arrays sharing this problem's memory."""
        if self._jax is None:
            import jax.dlpack

            if self.q.is_cuda:
                torch.cuda.synchronize()
            self._jax = tuple(
                jax.dlpack.from_dlpack(t) for t in (self.q, self.k_cache, self.v_cache, self.page_table)
            )
        return self._jax


def make_problem(batch, q_len, kv_len, page_size, *, num_q_heads=32, num_kv_heads=8, head_dim=128,
                 device="cuda", seed=0) -> Problem:
    """Random bf16 problem with a shuffled page table (page 0 reserved but filled too)."""
    if kv_len < q_len:
        raise ValueError(f"{kv_len=} < {q_len=}: kv_len counts the new tokens too")
    g = torch.Generator(device="cpu").manual_seed(seed)
    pages_per_seq = -(-kv_len // page_size)
    num_pages = batch * pages_per_seq + 1
    perm = torch.randperm(batch * pages_per_seq, generator=g).to(torch.int32) + 1
    page_table = perm.view(batch, pages_per_seq)
    j = torch.arange(kv_len, dtype=torch.int32)
    slots = page_table[:, j // page_size] * page_size + j % page_size
    gen = torch.Generator(device=device).manual_seed(seed + 1)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.float32).to(torch.bfloat16)

    kv_shape = (num_pages, page_size, num_kv_heads, head_dim)
    return Problem(
        batch, q_len, kv_len, page_size, num_q_heads, num_kv_heads, head_dim,
        q=rand(batch * q_len, num_q_heads, head_dim), k_cache=rand(*kv_shape), v_cache=rand(*kv_shape),
        page_table=page_table.to(device), slots=slots.to(device),
    )


def reference_fp32(p: Problem) -> torch.Tensor:
    """Plain float32 attention with bottom-right causal masking: [T, Hq, D] (small cases only)."""
    k, v = (x.float().repeat_interleave(p.num_q_heads // p.num_kv_heads, dim=2) for x in p.contiguous_kv())
    q = p.q.float().view(p.batch, p.q_len, p.num_q_heads, p.head_dim)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * p.softmax_scale
    qpos = p.kv_len - p.q_len + torch.arange(p.q_len, device=q.device)
    visible = torch.arange(p.kv_len, device=q.device)[None, :] <= qpos[:, None]
    s = s.masked_fill(~visible, float("-inf"))
    out = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v)
    return out.reshape(p.num_tokens, p.num_q_heads, p.head_dim)


def _jax_to_tokens(p: Problem):
    def convert(out):
        import jax

        jax.block_until_ready(out)
        return torch.from_dlpack(out).reshape(p.num_tokens, p.num_q_heads, p.head_dim)

    return convert


# ----------------------------------------------------------------------------- ours


def _ours_metadata(p: Problem):
    """(q, k, v, AttentionMetadata) for our kernels on the shared paged cache."""
    import jax.numpy as jnp

    from jax_attn.metadata import AttentionMetadata, ForwardMode

    q, k, v, pt = p.jax_views()
    b, t = p.batch, p.num_tokens
    if p.q_len == 1:
        mode = ForwardMode.DECODE
    elif p.q_len <= 8 and p.kv_len > p.q_len:
        mode = ForwardMode.TARGET_VERIFY
    else:
        mode = ForwardMode.EXTEND
    new_slots = p.slots[:, p.kv_len - p.q_len:].reshape(-1).cpu().numpy()
    md = AttentionMetadata(
        cache_seqlens=jnp.full((b,), p.kv_len, jnp.int32),
        cu_seqlens_q=jnp.arange(b + 1, dtype=jnp.int32) * p.q_len,
        cu_seqlens_k=jnp.arange(b + 1, dtype=jnp.int32) * p.kv_len,
        page_table=pt,
        out_cache_loc=jnp.asarray(new_slots, jnp.int32),
        max_seqlen_q=jnp.int32(p.q_len),
        max_seqlen_k=jnp.int32(p.kv_len),
        mode=mode, batch_size=b, num_tokens=t, page_size=p.page_size,
        max_q_len=p.q_len, max_pages=int(pt.shape[1]),
    )
    return q, k, v, md


def ours(p: Problem) -> PeerRun:
    """jax_attn.kernels.triton_paged.paged_attention on the shared paged cache."""
    try:
        import jax

        from jax_attn.kernels.triton_paged import paged_attention
    except Exception as e:  # the kernel may not exist yet: peers still run
        raise Unavailable(f"import failed: {type(e).__name__}: {e}") from e
    q, k, v, md = _ours_metadata(p)
    # The work schedule is part of the step's plan (built once, reused by every layer).
    from jax_attn.kernels.config import DEFAULT_CONFIG
    from jax_attn.kernels.schedule import plan_schedule

    sched = jax.jit(functools.partial(plan_schedule, num_q_heads=q.shape[1], num_kv_heads=k.shape[2],
                                      config=DEFAULT_CONFIG))(md)
    md = dataclasses.replace(md, schedule=jax.block_until_ready(sched))
    fn = jax.jit(functools.partial(paged_attention, causal=True))
    return PeerRun("ours", lambda: fn(q, k, v, md), _jax_to_tokens(p), "jax", f"{md.mode.name.lower()}")


def ours_mosaic(p: Problem, config=None, name: str = "ours_mosaic") -> PeerRun:
    """jax_attn.kernels.mosaic_paged (Mosaic GPU) on the shared paged cache
    (``config``: a ``MosaicConfig``, default the library's)."""
    import jax

    from jax_attn.kernels.mosaic_paged import paged_attention_mosaic, plan_mosaic_schedule, supports

    q, k, v, md = _ours_metadata(p)
    reason = supports(q, k, v, md)
    if reason is not None:
        raise Unavailable(reason)
    sched = jax.jit(functools.partial(plan_mosaic_schedule, num_q_heads=q.shape[1], num_kv_heads=k.shape[2],
                                      num_splits=None, config=config))(md)  # split-KV by the heuristic
    md = dataclasses.replace(md, mosaic_schedule=jax.block_until_ready(sched))
    fn = jax.jit(functools.partial(paged_attention_mosaic, causal=True, config=config))
    return PeerRun(name, lambda: fn(q, k, v, md), _jax_to_tokens(p), "jax", f"{md.mode.name.lower()}")


# ----------------------------------------------------------------------------- torch SDPA


def _sdpa_candidates(on_cuda: bool):
    from torch.nn.attention import SDPBackend

    names = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
             ("efficient", SDPBackend.EFFICIENT_ATTENTION)]
    if not on_cuda:
        names.append(("math", SDPBackend.MATH))
    return names


def _sdpa_masks(p: Problem, device):
    """(label, kwargs) ways to express this case's causal mask, best first."""
    if p.q_len == 1:
        return [("", {})]  # one query sees every key
    if p.q_len == p.kv_len:
        return [("", {"is_causal": True})]
    from torch.nn.attention.bias import causal_lower_right

    qpos = p.kv_len - p.q_len + torch.arange(p.q_len, device=device)
    dense = torch.arange(p.kv_len, device=device)[None, :] <= qpos[:, None]
    return [("bool mask", {"attn_mask": dense}),
            ("lower-right bias", {"attn_mask": causal_lower_right(p.q_len, p.kv_len)})]


def sdpa(p: Problem) -> PeerRun:
    """torch SDPA on contiguous KV; cuDNN first, then flash / efficient; native GQA first."""
    from torch.nn.attention import sdpa_kernel

    b, hq, d = p.batch, p.num_q_heads, p.head_dim
    q4 = p.q.view(b, p.q_len, hq, d).transpose(1, 2)  # [B, Hq, q_len, D] view of BSHD
    kc, vc = p.contiguous_kv()
    k4, v4 = kc.transpose(1, 2), vc.transpose(1, 2)  # [B, Hkv, kv_len, D]
    group = hq // p.num_kv_heads
    errors = []
    for kv_label in ("gqa", "kv-expanded"):
        if kv_label == "gqa":
            kk, vv, extra = k4, v4, {"enable_gqa": group > 1}
        else:
            kk, vv, extra = k4.repeat_interleave(group, 1), v4.repeat_interleave(group, 1), {}
        for mask_label, mask_kw in _sdpa_masks(p, p.q.device):
            for name, backend in _sdpa_candidates(p.q.is_cuda):
                sdpa_kw = {**mask_kw, **extra}

                def call(kk=kk, vv=vv, kw=sdpa_kw, backend=backend):
                    with sdpa_kernel(backend):
                        return F.scaled_dot_product_attention(q4, kk, vv, scale=p.softmax_scale, **kw)

                try:
                    call()
                except Exception as e:
                    errors.append(f"{name}/{kv_label}/{mask_label or 'plain'}: {str(e).splitlines()[0][:80]}")
                    continue
                label = ",".join(x for x in (name, mask_label, kv_label if kv_label != "gqa" else "") if x)
                to_tokens = lambda o: o.transpose(1, 2).reshape(p.num_tokens, hq, d)
                return PeerRun(f"sdpa[{label}]", call, to_tokens, "torch", "contiguous KV")
    raise Unavailable("no SDPA backend ran: " + " | ".join(errors[:4]))


# ----------------------------------------------------------------------------- SGLang Triton


def sglang_decode(p: Problem, max_kv_splits: int) -> PeerRun:
    """SGLang's Triton decode kernel (token-index paging; page size 1 native)."""
    if p.q_len != 1:
        raise Unavailable("decode kernel takes one query per sequence")
    try:
        from sglang.srt.layers.attention.triton_ops.decode_attention import decode_attention_fwd
    except Exception as e:
        raise Unavailable(f"import failed ({type(e).__name__}: {e}); "
                          "run benchmarks/fetch_peers.sh, carry .peers") from e
    b, hq, d, dev = p.batch, p.num_q_heads, p.head_dim, p.q.device
    kb, vb = p.token_pool()
    kv_indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * p.kv_len
    kv_indices = p.slots.reshape(-1).contiguous()
    out = torch.empty(b, hq, d, dtype=p.q.dtype, device=dev)
    logits = torch.empty(b, hq, max_kv_splits, d, dtype=torch.float32, device=dev)
    lse = torch.empty(b, hq, max_kv_splits, dtype=torch.float32, device=dev)
    splits = torch.full((b,), max_kv_splits, dtype=torch.int32, device=dev)

    def call():
        decode_attention_fwd(p.q, kb, vb, out, kv_indptr, kv_indices, logits, lse, splits,
                             max_kv_splits, p.softmax_scale, 1.0, 1.0)
        return out

    note = f"kv_splits={max_kv_splits}" + (", token indices (no paged variant)" if p.page_size > 1 else "")
    return PeerRun("sglang_triton", call, lambda o: o.clone(), "torch", note)


def sglang_extend(p: Problem) -> PeerRun:
    """SGLang's Triton extend kernel: prefix from the pool by token index, new tokens contiguous."""
    try:
        from sglang.srt.layers.attention.triton_ops.extend_attention import extend_attention_fwd
    except Exception as e:
        raise Unavailable(f"import failed ({type(e).__name__}: {e}); "
                          "run benchmarks/fetch_peers.sh, carry .peers") from e
    b, dev = p.batch, p.q.device
    prefix = p.kv_len - p.q_len
    kb, vb = p.token_pool()
    new = p.slots[:, prefix:].reshape(-1).long()
    k_ext, v_ext = kb[new].contiguous(), vb[new].contiguous()  # [T, Hkv, D]
    qo_indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * p.q_len
    kv_indptr = torch.arange(b + 1, dtype=torch.int32, device=dev) * prefix
    if prefix:
        kv_indices = p.slots[:, :prefix].reshape(-1).contiguous()
    else:
        kv_indices = torch.zeros(1, dtype=torch.int32, device=dev)
    out = torch.empty_like(p.q)

    def call():
        extend_attention_fwd(p.q, k_ext, v_ext, out, kb, vb, qo_indptr, kv_indptr, kv_indices,
                             None, True, None, p.q_len, 1.0, 1.0, sm_scale=p.softmax_scale)
        return out

    note = "causal (a chain verify mask is causal)" if p.q_len <= 8 else "causal"
    return PeerRun("sglang_triton_extend", call, lambda o: o.clone(), "torch", note)


# ----------------------------------------------------------------------------- JAX Pallas


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def jax_paged(p: Problem, k_splits: int = 16) -> PeerRun:
    """jax.experimental.pallas.ops.gpu.paged_attention (head-major pages, q pre-scaled)."""
    if p.q_len != 1:
        raise Unavailable("decode only")
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    q, k, v, pt = p.jax_views()
    kp, vp = (jnp.transpose(x, (2, 0, 1, 3)) for x in (k, v))  # [Hkv, num_pages, ps, D]
    per_block = max(1, 128 // p.page_size)  # 128 keys per block (a power of two, as Triton needs)
    k_splits = max(1, min(k_splits, pt.shape[1] // per_block))
    per_split = _cdiv(_cdiv(pt.shape[1], k_splits), per_block) * per_block  # pages per split
    table = jnp.pad(pt, ((0, 0), (0, per_split * k_splits - pt.shape[1])))  # padded entries: page 0
    lengths = jnp.full((p.batch,), p.kv_len, jnp.int32)
    q3 = (q.astype(jnp.float32) * p.softmax_scale).astype(q.dtype)
    fn = jax.jit(functools.partial(paged_attention, k_splits=k_splits, pages_per_compute_block=per_block))
    jax.block_until_ready((kp, vp, table, q3))
    note = f"k_splits={k_splits}, pages/block={per_block}, head-major copy"
    return PeerRun("jax_pallas_paged", lambda: fn(q3, kp, vp, table, lengths), _jax_to_tokens(p), "jax", note)


def _dense_jax(p: Problem, expand: bool):
    import jax
    import jax.numpy as jnp

    if p.q_len != p.kv_len:
        raise Unavailable("dense kernels here take q_len == kv_len (top-left causal)")
    kc, vc = p.contiguous_kv()
    if kc.is_cuda:
        torch.cuda.synchronize()
    k, v = jax.dlpack.from_dlpack(kc), jax.dlpack.from_dlpack(vc)  # [B, S, Hkv, D]
    if expand:
        g = p.num_q_heads // p.num_kv_heads
        k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    q = p.jax_views()[0].reshape(p.batch, p.q_len, p.num_q_heads, p.head_dim)
    jax.block_until_ready((k, v))
    return q, k, v, (kc, vc)


def jax_mha(p: Problem) -> PeerRun:
    """jax.experimental.pallas.ops.gpu.attention.mha (Triton lowering), KV heads expanded."""
    import jax
    from jax.experimental.pallas.ops.gpu.attention import mha

    q, k, v, keep = _dense_jax(p, expand=True)
    fn = jax.jit(lambda q, k, v: mha(q, k, v, None, p.softmax_scale, True))
    call = functools.partial(fn, q, k, v)
    call.keep_alive = keep  # torch memory behind k, v
    return PeerRun("jax_pallas_mha", call, _jax_to_tokens(p), "jax", "dense, KV expanded to Hq heads")


def jax_mosaic(p: Problem) -> PeerRun:
    """jax.experimental.pallas.ops.gpu.attention_mgpu.attention (Mosaic GPU, Hopper), q pre-scaled."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.pallas.ops.gpu import attention_mgpu

    if jax.default_backend() != "gpu":
        raise Unavailable("Mosaic GPU needs a GPU")
    q, k, v, keep = _dense_jax(p, expand=False)
    # bf16 inputs fail to lower in this version (a float16 buffer inside): run it on f16 copies
    q = (q.astype(jnp.float32) * p.softmax_scale).astype(jnp.float16)
    k, v = k.astype(jnp.float16), v.astype(jnp.float16)
    cfg = attention_mgpu.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2, causal=True)
    fn = jax.jit(lambda q, k, v: attention_mgpu.attention(q, k, v, cfg))
    call = functools.partial(fn, q, k, v)
    call.keep_alive = keep  # torch memory behind k, v
    return PeerRun("jax_mosaic_mha", call, _jax_to_tokens(p), "jax", "dense, native GQA, f16 inputs")


# ----------------------------------------------------------------------------- FA3 (JAX binding)


FA3_SPLITS = (1, 4, 16)  # num_splits tried per case; the fastest is kept


def fa3(p: Problem, num_splits: int = 1) -> PeerRun:
    """FlashAttention-3 through ``flash_attn3_jax.flash_mha_with_kvcache`` (the kernel SGLang's FA3
    backend calls) on the shared paged cache: q ``[B, q_len, Hq, D]``, k/v cache
    ``[num_pages, page_size, Hkv, D]``, ``page_table`` i32[B, P], ``cache_seqlens`` = kv_len (the new
    tokens are already in the cache), bottom-right causal. Hopper (sm90), bf16 / f16; any page size
    (page sizes that are not a multiple of 128 take FA3's non-TMA paged path, as all cases here).
    This binding takes no ``num_splits=0`` (FA3's own choice), so the benchmark runs several
    ``num_splits`` and keeps the fastest, as it does for SGLang's kv splits."""
    try:
        import jax
        import jax.numpy as jnp
        from flash_attn3_jax import flash_mha_with_kvcache
    except Exception as e:
        raise Unavailable(f"import failed ({type(e).__name__}: {e}); run benchmarks/fetch_peers.sh, carry "
                          '.peers, and eval "$(bash .peers/peer_site.sh .peers)"') from e
    if jax.default_backend() != "gpu":
        raise Unavailable(f"FA3 needs a CUDA GPU (jax backend {jax.default_backend()})")
    cap = torch.cuda.get_device_capability(p.q.device)
    if cap[0] != 9:
        raise Unavailable(f"this flash_attn3_jax wheel has sm90 (Hopper) kernels only; device is sm{cap[0]}{cap[1]}")
    if p.q.dtype not in (torch.bfloat16, torch.float16):
        raise Unavailable(f"FA3 takes bf16 / f16, not {p.q.dtype}")
    q, k, v, pt = p.jax_views()
    q4 = q.reshape(p.batch, p.q_len, p.num_q_heads, p.head_dim)  # free: [T, Hq, D] is batch-major
    lengths = jnp.full((p.batch,), p.kv_len, jnp.int32)
    splits = int(num_splits)

    def attend(q4, k, v, lengths, pt):
        return flash_mha_with_kvcache(q4, k, v, cache_seqlens=lengths, page_table=pt,
                                      softmax_scale=float(p.softmax_scale), is_causal=True, num_splits=splits)

    fn = jax.jit(attend)
    jax.block_until_ready((q4, lengths))
    note = f"paged ps={p.page_size}, num_splits={splits} (fastest of {FA3_SPLITS})"
    return PeerRun("fa3", lambda: fn(q4, k, v, lengths, pt), _jax_to_tokens(p), "jax", note)
