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
* **Prebuild.** Once the first bucket's warm-up has run every layer, the next capture hook plans the
  classes of the remaining sizes and builds every kernel they need at once: Python lowerings in
  parallel processes, GPU code in threads (``MosaicPath.prebuild``).

Tree (topk > 1) steps, draft extend and cross attention keep one plan per bucket: they run through JAX.
"""

from __future__ import annotations

from typing import List

import torch

from jax_attn import batch as jbatch
from jax_attn.backend import PlanKey
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


def prebuild_classes(planner, mode, spec, key: PlanKey) -> int:
    """At a capture hook of ``key`` (a batch class): when layers of this mode have run on the launch path
    and their later classes are not prebuilt yet, plan each class the remaining sizes use (compiling its
    planner) and build all their kernels at once. Returns the number of kernels built."""
    path = planner.mosaic_path
    per_req = key.q_len_per_req
    if path is None or (mode, per_req) in planner.prebuilt:
        return 0
    recipes = path.recipes_for(mode, per_req)
    if not recipes:
        return 0  # the first bucket: its warm-up forward shows the layers
    planner.prebuilt.add((mode, per_req))
    done = {k.batch_size for (m, _), k in planner.graph_keys.items() if m == mode and k.q_len_per_req == per_req}
    classes = sorted({jbatch.batch_class(b) for b in capture_sizes(planner)} - done, reverse=True)
    specs = []
    for c in classes:
        kc = planner.key(mode, c, c * per_req, spec, False, False)
        z = torch.zeros(c, dtype=torch.int64, device=planner.device)
        planner.bucket(kc, spec, z, z + jbatch.SEQ_LEN_FILL_VALUE, None, None, None, capturing=True)
        step = planner.step
        for r in recipes:
            tables = step.tables.get(r.heads) or planner.tables(step, r.heads)
            specs.append(r.spec(path.config, kc, tables))
    planner.step = None
    return path.prebuild(specs)
