"""Tensor parallelism for the example model (``llama.py``), Megatron style, over a 1-D device mesh.

    mesh = tp.make_mesh(2)                                   # axis "tp" over the first 2 devices
    params, pools, forward = tp.shard(cfg, backend, params, layout, num_slots, mesh)
    logits, pools = forward(params, md, ids, positions, pools, scan=...)   # inside the jitted step

What is sharded over the ``tp`` axis (N shards):

- q/k/v and gate/up projections (and their biases) by columns: shard s holds query heads
  ``[s * Hq/N, (s+1) * Hq/N)``, kv heads ``[s * Hkv/N, ...)`` and ``ffn/N`` MLP columns. Fused weights
  (``wqkv``, ``w13``) are re-ordered so that each shard's block is its own ``[q | k | v]`` / ``[gate | up]``.
- o and down projections by rows; their partial outputs are summed with ``lax.psum`` (``reduce`` of
  ``llama.forward_paged``).
- the KV pool on its kv-head axis: each shard writes and reads only its kv heads.
- replicated: the embedding, the final norm, the logits head, every norm weight, the plan.

Attention runs per shard with the shard's head counts (``local_config``: ``LayerParams(Hq/N, Hkv/N)``),
under the one plan of the step (``AttentionMetadata``, ``P()``: the planner runs once, outside
``shard_map``, and every shard reads the same plan). With fewer kv heads than shards (``N % Hkv == 0``),
each kv head is replicated on ``N / Hkv`` shards, as SGLang does: the pool then holds N kv heads, one
per shard, and every shard's query heads belong to that one kv head.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import llama

AXIS = "tp"
_COLUMN = frozenset({"wq", "wk", "wv", "bq", "bk", "bv", "wqkv", "bqkv", "w1", "w3", "w13"})  # last axis sharded
_ROW = frozenset({"wo", "w2"})  # input axis (-2) sharded; outputs summed with psum


def make_mesh(tp: int, devices=None) -> Mesh:
    """A 1-D mesh of axis ``"tp"`` over the first ``tp`` devices (default ``jax.devices()``: every host's
    devices after ``jax.distributed.initialize()``)."""
    devices = jax.devices() if devices is None else list(devices)
    if tp > len(devices):
        raise ValueError(f"--tp {tp} needs {tp} devices, found {len(devices)} ({devices[0].platform}); on the CPU "
                         f"set XLA_FLAGS=--xla_force_host_platform_device_count={tp} before JAX starts")
    return Mesh(np.array(devices[:tp]), (AXIS,))


def check_config(cfg, tp: int) -> None:
    """Raise ``ValueError`` naming ``--tp`` when the model does not split over ``tp`` shards."""
    if tp < 1:
        raise ValueError(f"--tp {tp} must be >= 1")
    if cfg.n_heads % tp:
        raise ValueError(f"--tp {tp} must divide the {cfg.n_heads} query heads")
    if cfg.n_kv_heads % tp and tp % cfg.n_kv_heads:
        raise ValueError(f"--tp {tp} must divide the {cfg.n_kv_heads} kv heads, or be a multiple of them "
                         "(each kv head is then replicated on tp / kv_heads shards)")
    if cfg.ffn_dim % tp:
        raise ValueError(f"--tp {tp} must divide ffn_dim {cfg.ffn_dim}")


def kv_replicas(cfg, tp: int) -> int:
    """Shards holding each kv head: 1, or ``tp / Hkv`` when there are fewer kv heads than shards."""
    return max(1, tp // cfg.n_kv_heads)


def local_config(cfg, tp: int):
    """The model one shard computes: ``Hq/N`` query heads, ``max(Hkv/N, 1)`` kv heads, ``ffn/N``."""
    check_config(cfg, tp)
    return dataclasses.replace(cfg, n_heads=cfg.n_heads // tp, n_kv_heads=max(1, cfg.n_kv_heads // tp),
                               ffn_dim=cfg.ffn_dim // tp)


def _repeat_kv(cfg, tp, a):  # [..., Hkv * D] -> [..., Hkv * r * D], each kv head r times in a row
    r = kv_replicas(cfg, tp)
    if r == 1:
        return a
    heads = a.reshape(*a.shape[:-1], cfg.n_kv_heads, cfg.head_dim)
    return jnp.repeat(heads, r, axis=-2).reshape(*a.shape[:-1], -1)


def _interleave(parts, tp):  # [q | k | v] -> [q_0 | k_0 | v_0 | q_1 | ...]: shard s's block is its own fused weight
    blocks = [p.reshape(*p.shape[:-1], tp, p.shape[-1] // tp) for p in parts]
    out = jnp.concatenate(blocks, -1)
    return out.reshape(*out.shape[:-2], -1)


def _arrange_layer(cfg, tp, lp: dict) -> dict:
    """One layer's weights (per-layer or layer-stacked) in the column order the shards split evenly."""
    qd, kd = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    out = dict(lp)
    for name in ("wk", "wv", "bk", "bv"):
        if name in lp:
            out[name] = _repeat_kv(cfg, tp, lp[name])
    for name in ("wqkv", "bqkv"):
        if name in lp:
            q, k, v = jnp.split(lp[name], [qd, qd + kd], axis=-1)
            out[name] = _interleave([q, _repeat_kv(cfg, tp, k), _repeat_kv(cfg, tp, v)], tp)
    if "w13" in lp:
        out["w13"] = _interleave(jnp.split(lp["w13"], 2, axis=-1), tp)
    return out


def _spec(name: str, a) -> P:
    if name in _COLUMN:
        return P(*[None] * (a.ndim - 1), AXIS)
    if name in _ROW:
        return P(*[None] * (a.ndim - 2), AXIS, None)
    return P()


def param_specs(params):
    """The ``PartitionSpec`` of every weight (``params`` in a ``list``, ``perlayer``, ``fused`` or ``scan`` layout)."""
    layers = params["layers"]
    if isinstance(layers, llama.FlatLayers):
        raise ValueError("--tp needs a layout with named weights (list, perlayer, fused, scan), not flat")
    named = lambda lp: {k: _spec(k, a) for k, a in lp.items()}  # noqa: E731
    specs = {k: P() for k in params if k != "layers"}
    specs["layers"] = named(layers) if isinstance(layers, dict) else [named(lp) for lp in layers]
    return specs


def shard_params(cfg, params, mesh: Mesh):
    """``params`` re-arranged for the shards and placed on ``mesh``: ``(sharded params, their specs)``."""
    tp = mesh.shape[AXIS]
    layers = params["layers"]
    arranged = dict(params, layers=_arrange_layer(cfg, tp, layers) if isinstance(layers, dict)
                    else [_arrange_layer(cfg, tp, lp) for lp in layers])
    specs = param_specs(arranged)
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    return jax.tree.map(put, arranged, specs), specs


def new_pools(cfg, layout: str, num_slots: int, mesh: Mesh):
    """Empty KV pools for ``layout``, sharded on the kv-head axis (``kv_replicas`` copies of each head):
    ``(pools, their specs)``. Each device allocates only its own heads."""
    tp = mesh.shape[AXIS]
    wide = dataclasses.replace(cfg, n_kv_heads=cfg.n_kv_heads * kv_replicas(cfg, tp))
    shapes = jax.eval_shape(lambda: llama.layout_pools(wide, layout, num_slots))
    spec = lambda a: P(*[None] * (a.ndim - 2), AXIS, None)  # noqa: E731
    specs = jax.tree.map(spec, shapes)
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    return jax.jit(lambda: llama.layout_pools(wide, layout, num_slots), out_shardings=shardings)(), specs


def forward_paged(cfg, backend, mesh: Mesh, params_spec, pools_spec):
    """``llama.forward_paged`` (without ``cfg``, ``backend``) over the shards: every shard runs the model
    of ``local_config`` on its weights and pool, the plan ``md`` replicated; logits come out replicated."""
    local = local_config(cfg, mesh.shape[AXIS])
    reduce = functools.partial(jax.lax.psum, axis_name=AXIS)

    def fn(params, md, token_ids, positions, pools, *, scan: bool = False):
        body = functools.partial(llama.forward_paged, local, backend, scan=scan, reduce=reduce)
        # check_vma=False: the Pallas kernels' outputs carry no varying-axes type; the logits are replicated
        # by construction (the residual stream is psum-reduced after every row-parallel projection)
        sharded = jax.shard_map(body, mesh=mesh, in_specs=(params_spec, P(), P(), P(), pools_spec),
                                out_specs=(P(), pools_spec), check_vma=False)
        return sharded(params, md, token_ids, positions, pools)

    return fn


def shard(cfg, backend, params, layout: str, num_slots: int, mesh: Mesh):
    """Everything a step needs on ``mesh``: ``(sharded params, sharded empty pools, forward)``; ``forward``
    as ``forward_paged`` returns it. ``backend`` must be planned for the shard's heads
    (``num_heads=(local.n_heads, local.n_kv_heads)`` of ``local_config``)."""
    check_config(cfg, mesh.shape[AXIS])
    params, pspec = shard_params(cfg, params, mesh)
    pools, kvspec = new_pools(cfg, layout, num_slots, mesh)
    return params, pools, forward_paged(cfg, backend, mesh, pspec, kvspec)

