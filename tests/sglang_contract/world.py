"""A small SGLang "engine": model runner, pools, request table and layers, built with the mocks of
``engine`` the way SGLang allocates them, plus the KV-pool snapshot and comparison the checks use.

Every request row owns whole pages in shuffled order (row 0 / page 0 reserved for padding, as
``ReqToTokenPool`` and ``MHATokenToKVPool`` reserve them); every slot is NaN until a step or the
test writes it, so a read of anything a request does not own shows up as NaN.

Every tensor lives on ``device.DEVICE`` (the suite's one switch), except SGLang's host copies.
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from tests.sglang_contract.device import DEVICE, ON_CUDA, host
from tests.sglang_contract.engine import (AttentionType, HfTextConfig, MHATokenToKVPool, ModelConfig, ModelRunner,
                                          RadixAttention, ReqToTokenPool, ServerArgs)

HQ, HKV, D = 4, 2, 16  # query heads, KV heads, head dim of every layer (D: the default head dim)
CONTEXT_LEN = 64
SPARE_PAGES = 4  # pages no request row owns (tree draft branches at page size > 1 take slots here)
# relative error of each output row, per dtype: CPU (Pallas interpret mode) and CUDA (compiled kernels;
# bf16 layers the Mosaic launch path covers run that kernel)
_TOL = {"cpu": {torch.float32: 1e-4, torch.bfloat16: 2e-2},
        "cuda": {torch.float32: 1e-4, torch.bfloat16: 2e-2}}
TOL = _TOL["cuda" if ON_CUDA else "cpu"]


@dataclasses.dataclass(frozen=True)
class LayerSpec:
    """One ``RadixAttention`` layer's knobs (``scaling`` is never ``head_dim ** -0.5``)."""

    scaling: float = 0.37
    window: int = -1  # sliding_window_size
    softcap: float = 0.0  # logit_cap
    sinks: bool = False  # forward(..., sinks=[Hq] bfloat16, as gpt-oss passes them)
    cross: bool = False  # is_cross_attention
    encoder_only: bool = False  # attn_type = AttentionType.ENCODER_ONLY
    irope: bool = False  # use_irope (Llama 4 chunked local layer)


PLAIN = LayerSpec()
SWA = LayerSpec(scaling=0.29, window=5)
CAP = LayerSpec(scaling=0.61, softcap=1.5)
SINK = LayerSpec(scaling=0.37, sinks=True)
SWA_SINK = LayerSpec(scaling=0.31, window=5, sinks=True)  # gpt-oss: sliding-window layers with sinks
CROSS = LayerSpec(scaling=0.45, cross=True)
ENC_ONLY = LayerSpec(scaling=0.33, encoder_only=True)


def _nan_fill(pool: MHATokenToKVPool) -> None:
    for buf in pool.k_buffer + pool.v_buffer:
        buf.fill_(float("nan"))


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of a float tensor (NaN-aware bitwise equality)."""
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


class World:
    """Model runner, pools, request table and layers of one test.

    Args:
      layers: one ``LayerSpec`` per layer (layer ids in order).
      page_size: SGLang's ``page_size``.
      dtype: pool / activation dtype.
      server_args: ``ServerArgs`` (default: ``attention_backend="fa3"``, nothing speculative).
      num_reqs: request rows (each owns ``CONTEXT_LEN`` columns of pages).
      encoder_decoder: ``model_config.is_encoder_decoder``.
      chunk: Llama 4 ``attention_chunk_size``; sets ``model_config.is_local_attention_model``.
      sliding_window: ``model_runner.sliding_window_size`` (SGLang sets it when a model has SWA layers).
      head_dim: every layer's head dim (default ``D``; the bridge's Mosaic launch path takes 64 / 128).
    """

    def __init__(self, layers: Sequence[LayerSpec], *, page_size: int = 1, dtype=torch.float32,
                 server_args: Optional[ServerArgs] = None, num_reqs: int = 6, encoder_decoder: bool = False,
                 chunk: Optional[int] = None, sliding_window: Optional[int] = None, seed: int = 0,
                 head_dim: int = D):
        with torch.inference_mode(False):  # SGLang allocates pools and tables at start-up, in no grad mode
            self._init(layers, page_size, dtype, server_args, num_reqs, encoder_decoder, chunk, sliding_window,
                       seed, head_dim)

    def _init(self, layers, page_size, dtype, server_args, num_reqs, encoder_decoder, chunk, sliding_window,
              seed, head_dim) -> None:
        self.rng = np.random.default_rng(seed)
        self.specs = tuple(layers)
        self.page_size, self.dtype, self.head_dim = page_size, dtype, head_dim
        pages_per_req = -(-CONTEXT_LEN // page_size)
        num_pages = num_reqs * pages_per_req + SPARE_PAGES
        self.kv = MHATokenToKVPool(num_pages * page_size, page_size, dtype, HKV, head_dim, len(self.specs),
                                   str(DEVICE), False)
        _nan_fill(self.kv)
        self.req_pool = ReqToTokenPool(num_reqs, CONTEXT_LEN, str(DEVICE), False)
        self.req_pool.free_slots = [int(r) for r in self.rng.permutation(self.req_pool.free_slots)]  # rows out of order
        pages = [int(p) for p in self.rng.permutation(np.arange(1, num_pages + 1))]
        self._free_pages, self._spare_pages = pages[SPARE_PAGES:], pages[:SPARE_PAGES]
        self._pages_per_req = pages_per_req
        config = ModelConfig(CONTEXT_LEN, HfTextConfig(HQ, HKV, max_source_positions=8 if encoder_decoder else 0),
                             head_dim=head_dim, is_encoder_decoder=encoder_decoder,
                             is_local_attention_model=chunk is not None, attention_chunk_size=chunk, dtype=dtype)
        server_args = server_args or ServerArgs(attention_backend="fa3")
        server_args.page_size = page_size
        self.runner = ModelRunner(config, self.req_pool, self.kv, server_args, page_size=page_size,
                                  device=DEVICE.type, sliding_window_size=sliding_window)
        self.layers = [self._layer(i, s) for i, s in enumerate(self.specs)]
        # gpt-oss keeps its sinks in bfloat16 with the FA backends (float32 only for trtllm_mha)
        self.sinks = [torch.from_numpy(self.rng.standard_normal(HQ) * 2.0).to(torch.bfloat16).to(DEVICE)
                      if s.sinks else None for s in self.specs]

    def _layer(self, layer_id: int, s: LayerSpec) -> RadixAttention:
        kind = AttentionType.ENCODER_ONLY if s.encoder_only else AttentionType.DECODER
        return RadixAttention(HQ, self.head_dim, s.scaling, HKV, layer_id, logit_cap=s.softcap,
                              sliding_window_size=s.window, is_cross_attention=s.cross, attn_type=kind,
                              use_irope=s.irope)

    # ---- allocation ---------------------------------------------------------------------------
    @property
    def r2t(self) -> np.ndarray:  # i32[num_reqs + 1, CONTEXT_LEN] (CPU: shares memory with req_to_token)
        return host(self.req_pool.req_to_token)

    def new_request(self) -> int:
        """A request row owning ``CONTEXT_LEN`` columns of shuffled pages."""
        row = self.req_pool.alloc_row()
        pages = np.array([self._free_pages.pop() for _ in range(self._pages_per_req)])
        slots = (pages[:, None] * self.page_size + np.arange(self.page_size)).reshape(-1)[:CONTEXT_LEN]
        self.req_pool.req_to_token[row] = torch.from_numpy(slots.astype(np.int32)).to(DEVICE)
        return row

    def spare_slots(self, n: int) -> np.ndarray:
        """``n`` slots of pages no request row owns (SGLang's per-branch draft pages)."""
        pages = [self._spare_pages.pop() for _ in range(-(-n // self.page_size))]
        return (np.array(pages)[:, None] * self.page_size + np.arange(self.page_size)).reshape(-1)[:n]

    # ---- KV contents --------------------------------------------------------------------------
    def rand(self, *shape) -> torch.Tensor:
        return torch.from_numpy(self.rng.standard_normal(shape).astype(np.float32)).to(self.dtype).to(DEVICE)

    def fill(self, slots: np.ndarray, *, cross: bool = False) -> None:
        """Random committed K/V at ``slots`` in the self-attention layers (``cross``: the cross layers)."""
        idx = torch.from_numpy(np.asarray(slots, np.int64)).to(DEVICE)
        for spec, layer in zip(self.specs, self.layers):
            if spec.cross == cross:
                kb, vb = self.kv.get_kv_buffer(layer.layer_id)
                kb[idx] = self.rand(len(idx), HKV, self.head_dim)
                vb[idx] = self.rand(len(idx), HKV, self.head_dim)

    def snapshot(self) -> List[Tuple[torch.Tensor, torch.Tensor]]:
        return [(k.clone(), v.clone()) for k, v in zip(self.kv.k_buffer, self.kv.v_buffer)]

    def check_pools(self, expected, what: str, free: Sequence[int] = ()) -> None:
        """The pools equal ``expected`` bit for bit (NaN included), except slots in ``free``."""
        keep = torch.ones(self.kv.k_buffer[0].shape[0], dtype=torch.bool, device=self.kv.k_buffer[0].device)
        keep[list(free)] = False
        for layer_id, ((k, v), (ek, ev)) in enumerate(zip(zip(self.kv.k_buffer, self.kv.v_buffer), expected)):
            for name, got, want in (("K", k, ek), ("V", v, ev)):
                diff = (as_bits(got) != as_bits(want)).flatten(1).any(1) & keep
                bad = torch.nonzero(diff).flatten().tolist()
                assert not bad, (f"{what}: layer {layer_id} {name} pool differs from the expected state at slots "
                                 f"{bad[:12]}{' ...' if len(bad) > 12 else ''} ({len(bad)} slots)")


def with_writes(snapshot, writes) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``snapshot`` after SGLang's ``set_kv_buffer``: ``writes[layer] = (loc, k, v)`` or None."""
    out = []
    for (k, v), w in zip(snapshot, writes):
        k, v = k.clone(), v.clone()
        if w is not None:
            loc, nk, nv = w
            idx = torch.from_numpy(np.asarray(loc, np.int64)).to(k.device)
            k[idx] = nk.reshape(len(idx), *k.shape[1:]).to(k.dtype)
            v[idx] = nv.reshape(len(idx), *v.shape[1:]).to(v.dtype)
        out.append((k, v))
    return out
