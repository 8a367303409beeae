"""The two front ends the soak drives (``benchmarks/soak.py``): the torch bridge and the JAX API.

Both take the same engine step (``Step``: mode, request rows, lengths, slots, per-layer q / k / v as
torch tensors) and return each layer's output as a torch tensor; both expose their pools as torch
tensors (the JAX pools through zero-copy DLPack) for the soak's whole-pool and oracle checks.

* ``BridgeFront``: SGLang's interface of ``torch_bridge.FlashAttentionBackend``. Decode and chain verify
  batches that fit a bucket go through the capture / replay hooks as SGLang's graph runner drives them;
  decode buckets replay a real ``torch.cuda.graph`` of every layer's attention where the bridge launches
  a kernel from torch (the Mosaic kernel at page sizes that are multiples of 8 on Hopper, else the
  Triton-lowered one), other buckets run their layers eagerly
  after the replay hook. Extend and draft extend batches are planned eagerly, at their shape class
  (``jax_attn.batch.ragged_rows`` / ``token_class``: a cold planner compile and kernel builds per class);
  the engine keeps their shapes to a small set unless ``--ragged-bridge`` (``Engine(bucketed=True)``).
* ``JaxFront``: ``jax_attn.FlashAttentionBackend`` with a ``StepRunner`` that captures every batch bucket
  of the uniform modes (decode, chain verify, draft extend) and, with ``token_buckets``, of ragged extends
  (``EXTEND_TOKEN_BUCKETS``); every step replays one of them, so nothing compiles after the capture.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import List, Sequence

import numpy as np
import torch

import jax
import jax.numpy as jnp

from jax_attn.backend import FlashAttentionBackend as JaxBackend
from jax_attn.backend import LayerParams
from jax_attn.batch import ForwardBatch as JaxBatch
from jax_attn.batch import SpecInfo as JaxSpec
from jax_attn.batch import bucket_for
from jax_attn.capture import StepRunner
from jax_attn.kv_cache import KVPool
from torch_bridge import (FlashAttentionBackend, ForwardBatch, ForwardMode, MHATokenToKVPool, ModelConfig,
                          ModelRunner, RadixAttention, ReqToTokenPool, ServerArgs, SpecInfo)

GRAPH_BUCKETS = (1, 2, 4, 8, 16)
EXTEND_TOKEN_BUCKETS = (64, 256, 1024)  # the JAX front's extend buckets (a batch of <= 16 requests x <= 64 tokens)


@dataclasses.dataclass(frozen=True)
class Layer:
    scaling: float
    window: int = -1  # sliding_window_size (FA (window, 0)); -1: full
    softcap: float = 0.0


@dataclasses.dataclass
class Step:
    """One engine step. ``seq_lens``: SGLang's (committed only in target verify); ``prefix`` / ``new``:
    each request's keys before this step's tokens and this step's tokens (the oracle's view)."""

    mode: str  # extend | decode | verify | draft_extend
    rows: np.ndarray  # i64[bs]
    seq_lens: np.ndarray  # i64[bs]
    prefix: np.ndarray  # i64[bs]
    new: np.ndarray  # i64[bs]
    loc: np.ndarray  # i64[num_tokens]
    qkv: List[tuple]  # per layer (q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D])
    num_draft: int = 0


class BridgeFront:
    """The torch bridge over one engine's pools (``torch.int32`` request table edited in place)."""

    name = "bridge"

    def __init__(self, layers: Sequence[Layer], heads, page_size: int, num_slots: int, max_reqs: int,
                 max_ctx: int, num_draft: int, dtype, device, graphs: bool):
        self.layers, (self.hq, self.hkv, self.d), self.device = list(layers), heads, torch.device(device)
        pool = MHATokenToKVPool.create(num_slots, len(layers), self.hkv, self.d, dtype, device)
        self.r2t = torch.zeros(max_reqs + 1, max_ctx, dtype=torch.int32, device=device)
        self.runner = ModelRunner(ReqToTokenPool(self.r2t), pool, ModelConfig(max_ctx), page_size=page_size,
                                  server_args=ServerArgs(speculative_num_draft_tokens=num_draft,
                                                        cuda_graph_bs=list(GRAPH_BUCKETS)),
                                  device=str(device))
        self.backend = FlashAttentionBackend(self.runner, topk=1, verbose=False)
        self.radix = [RadixAttention(self.hq, self.d, lay.scaling, self.hkv, i, logit_cap=lay.softcap,
                                     sliding_window_size=lay.window) for i, lay in enumerate(layers)]
        self.graphs: dict = {}  # decode bucket -> (torch CUDA graph, its outputs)
        self.num_draft, self.dtype = num_draft, dtype
        self.real_graphs = graphs and self.backend.mosaic_path is not None

    def pools(self):
        pool = self.runner.token_to_kv_pool
        return list(zip(pool.k_buffer, pool.v_buffer))

    def poison(self, slots: np.ndarray) -> None:
        idx = torch.as_tensor(slots, dtype=torch.int64, device=self.device)
        for k, v in self.pools():
            k[idx] = float("nan")
            v[idx] = float("nan")

    def set_rows(self, rows, table: np.ndarray) -> None:
        """The engine's in-place edit of its request table (no assignment: the bridge views it)."""
        self.r2t[torch.as_tensor(rows, device=self.device)] = torch.as_tensor(table, device=self.device)

    def _batch(self, s: Step) -> ForwardBatch:
        dev = self.device
        ext, spec, mode = None, None, ForwardMode.EXTEND
        if s.mode == "decode":
            mode = ForwardMode.DECODE
        elif s.mode == "verify":
            mode, spec = ForwardMode.TARGET_VERIFY, SpecInfo(draft_token_num=s.num_draft)
        elif s.mode == "draft_extend":
            mode = ForwardMode.DRAFT_EXTEND
            spec = SpecInfo(num_accepted_tokens=torch.as_tensor(s.new, dtype=torch.int32, device=dev),
                            draft_token_num=s.num_draft)
        else:
            ext = torch.as_tensor(s.new, dtype=torch.int32, device=dev)
        return ForwardBatch(mode, len(s.rows), torch.as_tensor(s.rows, device=dev),
                            torch.as_tensor(s.seq_lens, device=dev), torch.as_tensor(s.loc, device=dev),
                            extend_seq_lens=ext, spec_info=spec, token_to_kv_pool=self.runner.token_to_kv_pool)

    def _layers(self, fb, qkv) -> list:
        return [self.backend.forward(q.reshape(q.shape[0], -1), k, v, lay, fb)
                for lay, (q, k, v) in zip(self.radix, qkv)]

    def run(self, s: Step) -> list:
        bs = len(s.rows)
        if s.mode in ("decode", "verify") and bs <= GRAPH_BUCKETS[-1]:
            return self._replay(s, bucket_for(bs, GRAPH_BUCKETS))
        fb = self._batch(s)
        self.backend.init_forward_metadata(fb)
        return [o.reshape(len(s.loc), self.hq, self.d) for o in self._layers(fb, s.qkv)]

    def prebuild(self, extend_tokens: int = 0) -> int:
        """Build the kernels of the steps to come in one round, as an engine's start-up can
        (``FlashAttentionBackend.prebuild``): each bucket's decode and chain verify and, with ``extend_tokens``
        (bucketed extends), its extend of that many tokens and its draft extend. Returns the kernels built."""
        n, batches = self.num_draft, []
        for bs in GRAPH_BUCKETS:
            ones, zeros = np.ones(bs, np.int64), np.zeros(bs, np.int64)
            steps = [Step("decode", zeros, ones, zeros, ones, np.zeros(bs, np.int64), []),
                     Step("verify", zeros, ones, ones, ones * n, np.zeros(bs * n, np.int64), [], num_draft=n)]
            if extend_tokens >= bs:  # as the engine's bucketed extends: a request per row, the rest in the first
                new = ones.copy()
                new[0] += extend_tokens - bs
                steps += [Step("extend", zeros, new, zeros, new, np.zeros(extend_tokens, np.int64), []),
                          Step("draft_extend", zeros, ones * n, zeros, ones * n, np.zeros(bs * n, np.int64), [],
                               num_draft=n)]
            batches += [self._batch(st) for st in steps]
        return self.backend.prebuild(batches, self.radix, self.dtype)

    # ---- SGLang's graph runners: decode and verify buckets, one static buffer set sliced per bucket ----
    def capture(self) -> None:
        dtype, graphs = self.dtype, self.real_graphs
        top, n, dev = GRAPH_BUCKETS[-1], self.num_draft, self.device
        self.backend.init_cuda_graph_state(top, top * n)
        self.rows = torch.zeros(top, dtype=torch.int64, device=dev)
        self.lens = torch.ones(top, dtype=torch.int64, device=dev)
        self.locs = torch.zeros(top * n, dtype=torch.int64, device=dev)
        self.qkv = [tuple(torch.zeros(top, h, self.d, dtype=dtype, device=dev) for h in (self.hq, self.hkv, self.hkv))
                    for _ in self.layers]
        verify = SpecInfo(draft_token_num=n)
        for mode, per, spec in ((ForwardMode.DECODE, 1, None), (ForwardMode.TARGET_VERIFY, n, verify)):
            for bs in GRAPH_BUCKETS:
                self.backend.init_forward_metadata_capture_cuda_graph(bs, bs * per, self.rows[:bs], self.lens[:bs],
                                                                      None, mode, spec)
                if mode != ForwardMode.DECODE or not graphs:
                    continue  # replayed hook-only: the layers run eagerly after the replay hook
                fb = ForwardBatch(mode, bs, self.rows[:bs], self.lens[:bs], self.locs[:bs],
                                  token_to_kv_pool=self.runner.token_to_kv_pool)
                qkv = [tuple(t[:bs] for t in x) for x in self.qkv]
                self._layers(fb, qkv)  # warm-up outside the capture (builds the kernels)
                torch.cuda.synchronize(dev)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    outs = self._layers(fb, qkv)
                self.graphs[bs] = (g, outs)

    def _replay(self, s: Step, bs: int) -> list:
        n, dev = len(s.rows), self.device
        self.rows.zero_()
        self.lens.fill_(1)
        self.rows[:n] = torch.as_tensor(s.rows, device=dev)
        self.lens[:n] = torch.as_tensor(s.seq_lens, device=dev)
        graph = self.graphs.get(bs) if s.mode == "decode" else None
        mode = ForwardMode.DECODE if s.mode == "decode" else ForwardMode.TARGET_VERIFY
        spec = None if s.mode == "decode" else SpecInfo(draft_token_num=s.num_draft)
        t, real = bs * (1 if s.mode == "decode" else s.num_draft), len(s.loc)
        self.locs.zero_()
        self.locs[:real] = torch.as_tensor(s.loc, device=dev)
        if graph is None:  # hook-only bucket: the layers run eagerly on the bucket's padded batch, as in SGLang
            self.backend.init_forward_metadata_replay_cuda_graph(bs, self.rows[:bs], self.lens[:bs], None, None,
                                                                 mode, spec, None)
            fb = ForwardBatch(mode, bs, self.rows[:bs], self.lens[:bs], self.locs[:t], spec_info=spec,
                              token_to_kv_pool=self.runner.token_to_kv_pool)
            pad = [tuple(torch.cat([x, x.new_zeros((t - real,) + tuple(x.shape[1:]))]) for x in y) for y in s.qkv]
            return [o[:real].reshape(real, self.hq, self.d) for o in self._layers(fb, pad)]
        for static, new in zip(self.qkv, s.qkv):
            for dst, src in zip(static, new):
                dst.zero_()
                dst[:n] = src
        self.backend.init_forward_metadata_replay_cuda_graph(bs, self.rows[:bs], self.lens[:bs], None, None,
                                                             mode, None, None)
        g, outs = graph
        g.replay()
        return [o[:n].reshape(n, self.hq, self.d) for o in outs]

    def compiles(self) -> int:
        """Traces of the bridge's JAX functions (planner and layer executables)."""
        return self.backend.trace_count


class JaxFront:
    """``jax_attn``'s JAX API over JAX pools (donated each step); the request table is assigned after edits."""

    name = "jax"

    def __init__(self, layers: Sequence[Layer], heads, page_size: int, num_slots: int, max_reqs: int,
                 max_ctx: int, num_draft: int, dtype, device, graphs: bool):
        self.layers, (self.hq, self.hkv, self.d) = list(layers), heads
        self.num_draft, self.device = num_draft, torch.device(device)
        self.table = np.zeros((max_reqs + 1, max_ctx), np.int32)
        jdt = jnp.dtype(str(dtype).replace("torch.", ""))
        self.backend = JaxBackend(self.table, page_size=page_size, max_context_len=max_ctx, num_slots=num_slots,
                                  num_heads=(self.hq, self.hkv))
        self.params = [LayerParams(self.hq, self.hkv, self.d, scaling=lay.scaling, logit_cap=lay.softcap,
                                   sliding_window_size=lay.window, layer_id=i) for i, lay in enumerate(layers)]
        self.kv = [KVPool(*(jnp.full((num_slots, self.hkv, self.d), jnp.nan, jdt) for _ in "kv")) for _ in layers]
        self.num_slots, self.poison_len = num_slots, -(-max_ctx // page_size) * page_size
        self.runner = StepRunner(self.backend, self._step_fn, batch_buckets=GRAPH_BUCKETS,
                                 token_buckets=EXTEND_TOKEN_BUCKETS, donate_argnums=(0,), compile_cache=False)

    def _step_fn(self, md, token_inputs, pools):
        outs, new = [], []
        for lp, (q, k, v), pool in zip(self.params, token_inputs, pools):
            o, pool = self.backend.forward(q, k, v, lp, pool, md)
            outs.append(o)
            new.append(pool)
        return tuple(outs), new

    def pools(self):
        return [(torch.from_dlpack(p.k), torch.from_dlpack(p.v)) for p in self.kv]

    def poison(self, slots: np.ndarray) -> None:
        """NaN into ``slots`` of every pool: one compiled update, the slots padded to a request's most with an
        index past the pool (dropped)."""
        idx = np.full(self.poison_len, self.num_slots, np.int32)
        idx[:len(slots)] = slots
        self.kv = self._poison(self.kv, idx)

    @staticmethod
    @functools.partial(jax.jit, donate_argnums=0)
    def _poison(pools, idx):
        return [KVPool(p.k.at[idx].set(jnp.nan, mode="drop"), p.v.at[idx].set(jnp.nan, mode="drop")) for p in pools]

    def set_rows(self, rows, table: np.ndarray) -> None:
        self.table[rows] = table
        self.backend.req_to_token = self.table  # the API's contract: assign the edited table

    def _batch(self, s: Step) -> JaxBatch:
        i32 = lambda x: np.asarray(x, np.int32)  # noqa: E731
        mode, ext, spec = ForwardMode.EXTEND, None, None
        if s.mode == "decode":
            mode = ForwardMode.DECODE
        elif s.mode == "verify":
            mode, spec = ForwardMode.TARGET_VERIFY, JaxSpec(num_draft_tokens=s.num_draft)
        elif s.mode == "draft_extend":
            mode, spec = ForwardMode.DRAFT_EXTEND, JaxSpec(num_draft_tokens=s.num_draft,
                                                           num_accepted_tokens=i32(s.new))
        else:
            ext = i32(s.new)
        return JaxBatch(mode, i32(s.rows), i32(s.seq_lens), i32(s.loc), ext, spec_info=spec)

    def run(self, s: Step) -> list:
        # host arrays: the runner pads them on the host and sends them with the step (no per-shape device op);
        # outputs come back at the bucket's size and are sliced in torch (slicing in JAX compiles per size)
        tokens = tuple(tuple(host(t) for t in x) for x in s.qkv)
        outs, self.kv = self.runner.replay(self._batch(s), tokens, self.kv, trim=False)
        n = len(s.loc)
        jax.block_until_ready(outs)  # written before torch reads them (as ``peers._jax_to_tokens`` waits)
        return [torch.from_dlpack(o)[:n].reshape(n, self.hq, self.d) for o in outs]

    def capture(self) -> None:
        """Capture every bucket: decode, chain verify and draft extend per batch bucket, extends per batch
        and token bucket."""
        n, dt = self.num_draft, self.kv[0].k.dtype
        tokens = tuple((jnp.zeros((1, self.hq, self.d), dt), jnp.zeros((1, self.hkv, self.d), dt),
                        jnp.zeros((1, self.hkv, self.d), dt)) for _ in self.layers)
        batches = []
        for bs in GRAPH_BUCKETS:
            ones = np.ones(bs, np.int64)
            for mode, per in (("decode", 1), ("verify", n), ("draft_extend", n)):
                batches.append(self._batch(Step(mode, ones * 0, ones * n, ones * 0, ones * per,
                                                np.zeros(bs * per, np.int64), [], num_draft=n)))
            for t in EXTEND_TOKEN_BUCKETS:
                if t >= bs:  # a request per row, the rest of the bucket's tokens in the first
                    new = ones.copy()
                    new[0] += t - bs
                    batches.append(self._batch(Step("extend", ones * 0, new, ones * 0, new, np.zeros(t, np.int64), [])))
        self.runner.capture(batches, tokens, self.kv, verbose=False)

    def compiles(self) -> int:
        return self.runner.trace_count


def host(t: torch.Tensor) -> np.ndarray:
    """A torch tensor's values as a host numpy array (bfloat16 as ``ml_dtypes.bfloat16``)."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(jnp.bfloat16)
    return t.numpy()


FRONTS = {"bridge": BridgeFront, "jax": JaxFront}
