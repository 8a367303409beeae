"""Graph warm-up: batch classes and kernels built ahead of the capture.

SGLang's graph runner captures one graph per batch size of ``server_args.cuda_graph_bs`` (36 sizes for
a maximum of 256), largest first, each after a warm-up forward of every layer. The launch path's kernel
is compiled for its plan's shapes, so one plan per size would build 36 kernels per layer shape, one
after another, each a Python lowering (seconds, under the GIL) and a GPU compile (seconds).

Two rules cut that down:

* **Batch classes.** A decode or chain (topk 1) verify bucket plans at its batch class
  (``jax_attn.batch.batch_class``: the JAX side's bucket ladder), padded with SGLang's fill rules.
  The buckets of one class share the planner executable, the table buffers and one kernel per layer
  shape; each keeps its own graph. (SGLang's 36 sizes fall in 15 classes.)
* **Prebuild.** When the first bucket's warm-up forward launches a kind of layer for the first time,
  the planner plans the classes of the remaining sizes and builds that layer's kernels for all of them
  at once, its own included: Python lowerings (in parallel processes for four or more Mosaic kernels),
  GPU code in threads (``MosaicPath.prebuild``; the Mosaic kernel and the Triton-lowered one alike). A
  capture hook does the same for layers seen before the capture. An eager step of a new shape class
  builds the kernels of every layer shape seen in steps of its kind at once too, at its first layer
  (``MosaicPath.layer_call``).

Tree (topk > 1) steps, draft extend and steps with an encoder (cross attention) keep one plan per bucket.
"""

from __future__ import annotations

import dataclasses
from typing import List

import jax
import torch

from jax_attn import batch as jbatch
from jax_attn.plan_key import PlanKey
from torch_bridge.translate import UNIFORM


def shares_class(key: PlanKey, encoder_lens) -> bool:
    """Whether a graph bucket of ``key`` plans at its batch class (decode and chain verify, no encoder)."""
    return key.mode in UNIFORM and key.topk == 1 and encoder_lens is None


def capture_sizes(planner) -> List[int]:
    """The batch sizes the graph runner will capture: ``server_args.cuda_graph_bs`` up to
    ``init_cuda_graph_state``'s maximum, else every bucket of the ladder up to it."""
    max_bs = planner.graph_max[0]
    sizes = getattr(getattr(planner.model_runner, "server_args", None), "cuda_graph_bs", None)
    if not sizes:
        sizes = [b for b in jbatch.DEFAULT_BATCH_BUCKETS if b < max_bs] + [max_bs]
    return sorted({int(b) for b in sizes if 0 < int(b) <= max_bs})


def prebuild_classes(planner, key: PlanKey, spec) -> int:
    """At a capture hook of ``key`` (a batch class; ``spec``: its speculative settings): build, all at
    once, the kernels that the classes of the remaining sizes need for the layers seen on the launch
    path in steps like ``key`` and not prebuilt yet (an eager step before the capture shows layers too).
    Returns the number built."""
    path = planner.mosaic_path
    if path is None:
        return 0
    recipes = [r for r in path.recipes_for(key.mode, key.q_len_per_req) if r not in planner.prebuilt]
    if not recipes:
        return 0  # the first bucket: its warm-up forward shows the layers (``prebuild_recipe``)
    planner.prebuilt.update(recipes)
    return path.prebuild(_class_specs(planner, key, spec, recipes))


def prebuild_recipe(planner, recipe, tables) -> int:
    """At a layer's first launch in the warm-up forward of a class-sharing graph bucket: build its
    kernels for this bucket (over ``tables``) and for every class the later sizes use, all at once, so
    the later buckets find them built. Returns the number of kernels built."""
    step, path = planner.step, planner.mosaic_path
    if (path is None or step is None or step.key not in planner.graph_specs or not shares_class(step.key, None)
            or recipe in planner.prebuilt):
        return 0
    planner.prebuilt.add(recipe)
    specs = [recipe.spec(path.config, step.key, tables)]
    try:
        specs += _class_specs(planner, step.key, planner.graph_specs[step.key], [recipe])
    finally:
        planner.step = step  # the warm-up forward goes on with its own step
    return path.prebuild(specs)


def _class_specs(planner, key: PlanKey, spec, recipes) -> list:
    """Plan each batch class of the capture sizes not captured yet in ``key``'s mode (compiling its
    planner) and return the launches of ``recipes`` over its tables. Leaves ``planner.step`` unset."""
    per_req = key.q_len_per_req
    done = {k.batch_size for (m, _), k in planner.graph_keys.items() if m == key.mode and k.q_len_per_req == per_req}
    classes = sorted({jbatch.batch_class(b) for b in capture_sizes(planner)} - done, reverse=True)
    specs = []
    for c in classes:
        kc = dataclasses.replace(key, batch_size=c, num_tokens=c * per_req)
        z = torch.zeros(c, dtype=torch.int64, device=planner.device)
        planner.bucket(kc, spec, z, z + jbatch.SEQ_LEN_FILL_VALUE, None, None, None, capturing=True)
        step = planner.step
        jax.block_until_ready(step.words)  # done before the capture that may follow (``StepPlanner.capture``)
        for r in recipes:
            tables = step.tables.get(r.heads) or planner.tables(step, r.heads)
            specs.append(r.spec(planner.mosaic_path.config, kc, tables))
    planner.step = None
    return specs
