"""The one checker: run a step's layers through SGLang's call path and hold the result to the
float64 oracle per sequence and per row, and the KV pools to bit-identity outside the written slots.

``check_step`` plans (``init_forward_metadata``) unless told not to, calls every layer's
``RadixAttention.forward`` (which calls ``forward_batch.attn_backend.forward`` as SGLang does), then

(a) compares each output row with ``reference64.attention64`` over the slots ``Expect`` lists,
    relative to that row's own reference norm (one dropped page of one sequence fails);
(b) compares every layer's K and V pool bit for bit (NaN-aware) with the state before the step plus
    exactly the writes SGLang's ``set_kv_buffer`` would make (``out_cache_loc``; cross layers
    ``encoder_out_cache_loc``; nothing when ``save_kv_cache=False``).

Graph replays pass ``pad_to`` (the bucket's token count: padding rows get activations of their own
and write the reserved slot 0) and ``eager`` (the eager outputs the replay must reproduce); a replay
of a real ``torch.cuda.graph`` passes ``forward`` (copy the activations into the graph's static
buffers, replay it) instead of calling the layers.

Tensors live on ``device.DEVICE``; outputs, activations and pools reach the oracle through ``host64``.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Tuple

import numpy as np
import torch

from tests.sglang_contract.batches import Expect, step_locs
from tests.sglang_contract.device import ON_CUDA, host64
from tests.sglang_contract.reference64 import attention64, chunk_local
from tests.sglang_contract.world import HKV, HQ, TOL, LayerSpec, World, as_bits, with_writes

QKV = Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]
Forward = Callable[[object, List[QKV]], List[torch.Tensor]]  # forward(graph batch, activations) -> outputs
# replay vs eager, per row and dtype: CPU (interpret mode) and CUDA (compiled kernels)
_REPLAY_TOL = {"cpu": {torch.float32: 1e-5, torch.bfloat16: 1e-2},
               "cuda": {torch.float32: 1e-5, torch.bfloat16: 1e-2}}
REPLAY_TOL = _REPLAY_TOL["cuda" if ON_CUDA else "cpu"]


def fused_qkv(world: World, tokens: int) -> QKV:
    """``q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)`` as SGLang's models make them:
    strided views of one projection output, not contiguous tensors."""
    d = world.head_dim
    return world.rand(tokens, (HQ + 2 * HKV) * d).split([HQ * d, HKV * d, HKV * d], dim=-1)


def make_qkv(world: World, spec: LayerSpec, ex: Expect) -> QKV:
    """Activations of one layer: ``q [T, Hq * D]``; ``k, v [T, Hkv * D]`` (cross layers: one row per
    encoder token written this step, or None when the encoder is cached, as SGLang passes them)."""
    t, d = ex.num_tokens, world.head_dim
    if spec.cross:
        q = world.rand(t, HQ * d)
        if ex.enc_loc is None:
            return q, None, None
        return (q, *world.rand(len(ex.enc_loc), 2 * HKV * d).split([HKV * d, HKV * d], dim=-1))
    return fused_qkv(world, t)


def random_qkv(world: World, tokens: int) -> List[QKV]:
    """Activations of a graph-capture run (cross layers: encoder cached, ``k = v = None``)."""
    return [(world.rand(tokens, HQ * world.head_dim), None, None) if spec.cross else fused_qkv(world, tokens)
            for spec in world.specs]


def writes_of(world: World, ex: Expect, qkvs: Sequence[QKV]):
    """Per layer ``(slots, k, v)`` that SGLang's ``set_kv_buffer`` writes this step, or None."""
    out = []
    for spec, (_, k, v) in zip(world.specs, qkvs):
        loc = ex.enc_loc if spec.cross else ex.loc
        out.append(None if k is None or loc is None else (loc, k, v))
    return out


def forward_layers(world: World, fb, qkvs: Sequence[QKV], save_kv_cache: bool = True,
                   piecewise: bool = False) -> List[torch.Tensor]:
    """The model's attention calls: ``layer.forward(q, k, v, forward_batch, save_kv_cache, sinks=...)``;
    ``piecewise``: through ``unified_attention_with_output`` as SGLang's piecewise CUDA graph does."""
    outs = []
    for layer, (q, k, v), sinks in zip(world.layers, qkvs, world.sinks):
        kw = {} if sinks is None else {"sinks": sinks}
        call = unified_attention_with_output if piecewise else _radix_forward
        outs.append(call(layer, q, k, v, fb, save_kv_cache, **kw))
    return outs


def _radix_forward(layer, q, k, v, fb, save_kv_cache, **kw):
    return layer.forward(q, k, v, fb, save_kv_cache, **kw)


def unified_attention_with_output(layer, q, k, v, fb, save_kv_cache, **kw):
    """``radix_attention.unified_attention_with_output`` (extend modes under a forward context): the
    backend gets ``forward_batch._attn_output`` (a NaN-filled preallocated output here) and the
    result is copied into it when the backend returned another tensor."""
    k = None if k is None else k.view(-1, layer.tp_k_head_num, layer.qk_head_dim)
    v = None if v is None else v.view(-1, layer.tp_v_head_num, layer.v_head_dim)
    output = torch.full((q.shape[0], layer.tp_q_head_num * layer.v_head_dim), float("nan"), dtype=q.dtype,
                        device=q.device)
    fb._attn_output = output[:q.shape[0]]  # SGLang leaves it set on the batch
    ret = fb.attn_backend.forward(q, k, v, layer, fb, save_kv_cache, **kw)
    if ret.data_ptr() != output.data_ptr():
        output[:q.shape[0]].view(ret.shape).copy_(ret)
    return output


def layer_rows(world: World, spec: LayerSpec, ex: Expect) -> List[np.ndarray]:
    if spec.cross:
        return ex.cross
    if spec.encoder_only:
        return ex.full
    chunk = world.runner.model_config.attention_chunk_size
    return chunk_local(ex.rows, ex.positions, chunk) if spec.irope and chunk else ex.rows


def reference(world: World, pools, qkvs: Sequence[QKV], ex: Expect) -> List[np.ndarray]:
    """Oracle outputs ``[T, Hq * D]`` per layer from the expected pools."""
    refs = []
    for spec, (k_pool, v_pool), (q, _, _), sinks in zip(world.specs, pools, qkvs, world.sinks):
        q64 = host64(q[:ex.num_tokens]).reshape(ex.num_tokens, HQ, world.head_dim)
        out = attention64(q64, host64(k_pool), host64(v_pool), layer_rows(world, spec, ex),
                          scale=spec.scaling, softcap=spec.softcap, window=-1 if spec.cross else spec.window,
                          sinks=None if sinks is None else host64(sinks))
        refs.append(out.reshape(ex.num_tokens, HQ * world.head_dim))
    return refs


def row_errors(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    """Relative error of each row against that row's reference norm (NaN stays NaN)."""
    return np.linalg.norm(got - want, axis=1) / np.maximum(np.linalg.norm(want, axis=1), 1e-6)


def check_rows(got: torch.Tensor, want: np.ndarray, ex: Expect, tol: float, what: str) -> None:
    """Every row within ``tol``; the message names each failing sequence and its rows."""
    t = ex.num_tokens
    assert got.dim() == 2 and got.shape[0] >= t and got.shape[1] == want.shape[1], (
        f"{what}: output {tuple(got.shape)} must be [{t}(+padding), {want.shape[1]}] (tokens, Hq * v_head_dim)")
    err = row_errors(host64(got[:t]), want)
    bad = np.flatnonzero(~(err < tol))
    if bad.size:
        lines = [f"seq {s}: rows {bad[ex.seq[bad] == s].tolist()} max rel err {np.max(err[ex.seq == s]):.3g}"
                 for s in np.unique(ex.seq[bad])]
        raise AssertionError(f"{what}: {bad.size}/{t} rows off (tol {tol:g}):\n  " + "\n  ".join(lines))


def _clone(qkvs: Sequence[QKV]) -> List[QKV]:
    return [tuple(None if x is None else x.clone() for x in t) for t in qkvs]


def check_untouched(qkvs: Sequence[QKV], kept: Sequence[QKV], what: str) -> None:
    """The backend must not modify the activations it is given (the model reuses them)."""
    for i, (now, was) in enumerate(zip(qkvs, kept)):
        for name, a, b in zip("qkv", now, was):
            assert a is None or torch.equal(as_bits(a), as_bits(b)), f"{what}: layer {i} {name} modified in place"


def pad_qkv(world: World, qkvs: Sequence[QKV], tokens: int) -> List[QKV]:
    """Graph buffers: the step's activations, then padding rows with activations of their own
    (cross layers' encoder K/V, None in decode, are not per query token)."""
    def pad(x):
        return torch.cat([x, world.rand(tokens - x.shape[0], x.shape[1])])
    return [(pad(q), k, v) if spec.cross or k is None else (pad(q), pad(k), pad(v))
            for spec, (q, k, v) in zip(world.specs, qkvs)]


def check_step(world: World, backend, fb, ex: Expect, *, what: str, plan: bool = True, save_kv_cache: bool = True,
               qkvs: Optional[Sequence[QKV]] = None, pad_to: Optional[int] = None,
               eager: Optional[Sequence[torch.Tensor]] = None, piecewise: bool = False,
               forward: Optional[Forward] = None) -> Tuple[List[torch.Tensor], List[QKV]]:
    """Run one forward of every layer and check outputs and pools; returns ``(outputs, activations)``.
    ``forward(fb, activations)``: a captured graph's replay in place of the layer calls."""
    qkvs = list(qkvs) if qkvs is not None else [make_qkv(world, s, ex) for s in world.specs]
    writes = writes_of(world, ex, qkvs)
    if not save_kv_cache:  # the model stored K/V itself (SGLang's fused rope + KV-store kernels)
        for (kb, vb), (k, v) in zip(zip(world.kv.k_buffer, world.kv.v_buffer), with_writes(world.snapshot(), writes)):
            kb.copy_(k)
            vb.copy_(v)
    before = world.snapshot()
    expected = with_writes(before, writes) if save_kv_cache else before
    run = qkvs if pad_to is None else pad_qkv(world, qkvs, pad_to)
    kept = _clone(run)
    fb.attn_backend = backend
    if plan:
        backend.init_forward_metadata(fb)
    if forward is None:
        outs = forward_layers(world, fb, run, save_kv_cache, piecewise)
    else:
        outs = forward(fb, run)
    check_untouched(run, kept, what)
    world.check_pools(expected, what, free=() if pad_to is None else (0,))
    tol = TOL[world.dtype]
    for i, (out, ref) in enumerate(zip(outs, reference(world, expected, qkvs, ex))):
        assert out.dtype == world.dtype, f"{what}: layer {i} output {out.dtype}, activations {world.dtype}"
        check_rows(out, ref, ex, tol, f"{what} layer {i} ({world.specs[i]})")
        if eager is not None:
            check_rows(out, host64(eager[i][:ex.num_tokens]), ex, REPLAY_TOL[world.dtype],
                       f"{what} layer {i}: replay vs eager")
    return outs, qkvs


def check_draft_round(world: World, multi, fb, expects: Sequence[Expect], *, what: str, replay=None,
                      forwards: Optional[Sequence[Forward]] = None, check=None):
    """``EAGLEWorker.draft_forward``: step ``i`` runs on ``multi.attn_backends[i]`` with ``out_cache_loc[i]``.

    Eager (``replay`` None): one ``init_forward_metadata`` with every step's slots first. Replay:
    ``fb`` is the graph's static batch, already planned by the replay hook, and ``replay`` holds the
    eager round's per-step ``(outputs, activations)`` to reproduce; ``forwards[i]`` replays step ``i``'s
    captured graph (real ``torch.cuda.graph``). ``check`` replaces ``check_step`` (same signature), e.g.
    for another pool layout. Returns per step the same pair."""
    check = check_step if check is None else check
    args = world.runner.server_args
    full = fb.out_cache_loc
    if replay is None:
        multi.init_forward_metadata(fb)
    per_step = step_locs(fb, args.speculative_eagle_topk, args.speculative_num_steps)
    results = []
    for i, ex in enumerate(expects):
        fb.out_cache_loc = per_step[i]
        kw = {} if replay is None else dict(qkvs=replay[i][1], eager=replay[i][0], pad_to=per_step.shape[1])
        if forwards is not None:
            kw["forward"] = forwards[i]
        results.append(check(world, multi.attn_backends[i], fb, ex, plan=False, what=f"{what} step {i}", **kw))
    fb.out_cache_loc = full
    return results
