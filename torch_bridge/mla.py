"""MLA models (``model_config.attention_arch == MLA``, DeepSeek V2/V3/R1, Kimi K2) in the bridge.

Absorbed layers (the latent ``MLATokenToKVPool``) run as any layer does (``layer_runner``) once their
``q`` / ``k`` are whole latent rows (``mla_rows``). The seed's chunked-prefix prefill is another call:
when ``forward_batch.attn_attend_prefix_cache`` is set on an extend step, the layer is the model's
multi-head one (q/k head dim ``qk_nope + qk_rope``, v ``v_head_dim``) and attends ragged K/V given in
the call, not the cache: the prefix chunk ``prefix_chunk_idx`` (non-causal, ``cu_seqlens_k`` from
``prefix_chunk_cu_seq_lens``), else the extend part itself (causal; with ``mha_one_shot`` the whole
sequence, ``seq_lens``), returning the LSE when ``mha_return_lse`` (``PrefixMHA``, through
``jax_attn.attention.varlen_attention``).
"""

from __future__ import annotations

import functools

import jax
import torch

from jax_attn.attention import varlen_attention
from jax_attn.kernels.config import next_pow2
from jax_attn.metadata import ForwardMode
from torch_bridge.translate import to_mode


def uses_prefix_mha(forward_batch) -> bool:
    """An extend step of the seed's chunked-prefix MHA (``attn_attend_prefix_cache`` set)."""
    return (getattr(forward_batch, "attn_attend_prefix_cache", None) is not None
            and to_mode(forward_batch.forward_mode) in (ForwardMode.EXTEND, ForwardMode.MIXED))


def mla_rows(q, k, layer, q_rope, k_rope):
    """An absorbed MLA layer's ``q`` / ``k`` as whole latent rows (the latent part, then rope), as the
    seed reads them: SGLang passes them whole, or the latent parts with ``q_rope`` / ``k_rope``."""
    dv, rope, hq = layer.v_head_dim, layer.head_dim - layer.v_head_dim, layer.tp_q_head_num
    if q_rope is not None:
        t = q.shape[0]
        q = torch.cat([q.reshape(t, hq, dv), q_rope.reshape(t, hq, rope).to(q.dtype)], dim=-1).reshape(t, -1)
    if k_rope is not None:
        if k is None:
            raise ValueError("k_rope without k (the latent part): pass both, or neither")
        k = torch.cat([k.reshape(-1, dv), k_rope.reshape(-1, rope).to(k.dtype)], dim=-1)
    return q, k


def _cu(lens: torch.Tensor) -> torch.Tensor:  # i32[B + 1] exclusive prefix sum, on the lengths' device
    return torch.nn.functional.pad(torch.cumsum(lens.to(torch.int32), 0, dtype=torch.int32), (1, 0))


def _bound(n: int) -> int:  # static bounds in powers of 2: a handful of compiled shapes, not one per batch
    return next_pow2(max(int(n), 1))


class PrefixMHA:
    """The seed's chunked-prefix MHA calls of an MLA model (see the module docstring)."""

    def __init__(self, importer, impl: str):
        self.importer, self.impl = importer, impl
        self._fns: dict = {}  # static bounds and options -> jitted call

    def __call__(self, q, k, v, layer, fb, save_kv_cache: bool, q_rope, k_rope, sinks):
        for name, bad in (("q_rope / k_rope", q_rope is not None or k_rope is not None),
                          ("save_kv_cache with K/V (the latent cache is written by the absorbed layer)",
                           save_kv_cache and k is not None),
                          ("layer.logit_cap", bool(layer.logit_cap)),
                          ("layer.sliding_window_size", _window(layer) >= 0),
                          ("sinks", sinks is not None)):
            if bad:
                raise NotImplementedError(f"{name} in MLA's chunked-prefix MHA (attn_attend_prefix_cache) is not "
                                          "supported")
        hq, hkv, d, dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim, layer.v_head_dim
        lens_q = fb.extend_seq_lens
        if lens_q is None:
            raise ValueError("MLA's chunked-prefix MHA needs forward_batch.extend_seq_lens")
        cu_q = _cu(lens_q)
        max_q = max(fb.extend_seq_lens_cpu) if getattr(fb, "extend_seq_lens_cpu", None) else q.shape[0]
        if fb.attn_attend_prefix_cache:  # one prefix chunk: every query sees all its keys
            idx, cus, maxes = (getattr(fb, n, None) for n in ("prefix_chunk_idx", "prefix_chunk_cu_seq_lens",
                                                               "prefix_chunk_max_seq_lens"))
            if idx is None or idx < 0 or cus is None or maxes is None:
                raise ValueError("attn_attend_prefix_cache=True needs prefix_chunk_idx, prefix_chunk_cu_seq_lens "
                                 "and prefix_chunk_max_seq_lens (ForwardBatchDeepSeekMHAMixin)")
            cu_k, max_k, causal = cus[idx].to(torch.int32), maxes[idx], False
        elif getattr(fb, "mha_one_shot", None):  # the whole sequence's K/V
            seq_cpu = getattr(fb, "seq_lens_cpu", None)
            cu_k, causal = _cu(fb.seq_lens), True
            max_k = int(seq_cpu.max()) if seq_cpu is not None else k.shape[0]
        else:  # the extend part only
            cu_k, max_k, causal = cu_q, max_q, True
        t, nk = q.shape[0], k.shape[0]
        qs = q.reshape(t, hq, d)
        ks, vs = k.reshape(nk, hkv, d).to(q.dtype), v.reshape(nk, hkv, dv).to(q.dtype)
        return_lse = bool(getattr(fb, "mha_return_lse", None))
        fn = self._fn(_bound(max_q), _bound(max_k), causal, float(layer.scaling), return_lse)
        args = [self.importer(x.contiguous()) for x in (qs, ks, vs, cu_q, cu_k.contiguous())]
        res = fn(*args)
        if return_lse:
            out, lse = res
            return self.importer.export(out).reshape(t, hq * dv), self.importer.export(lse)
        return self.importer.export(res).reshape(t, hq * dv)

    def _fn(self, max_q: int, max_k: int, causal: bool, scale: float, return_lse: bool):
        key = (max_q, max_k, causal, scale, return_lse)
        if key not in self._fns:
            self._fns[key] = jax.jit(functools.partial(_varlen, max_q=max_q, max_k=max_k, causal=causal, scale=scale,
                                                       return_lse=return_lse, impl=self.impl))
        return self._fns[key]


def _window(layer) -> int:
    w = getattr(layer, "sliding_window_size", -1)
    return -1 if w is None else int(w)


def _varlen(q, k, v, cu_q, cu_k, *, max_q, max_k, causal, scale, return_lse, impl):
    return varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k, causal=causal,
                            softmax_scale=scale, return_lse=return_lse, impl=impl)
