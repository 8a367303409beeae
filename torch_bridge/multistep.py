"""SGLang's ``FlashAttentionMultiStepBackend`` for torch engines: one backend per draft step.

    draft = FlashAttentionMultiStepBackend(model_runner, topk=2, speculative_num_steps=3)
    draft.init_forward_metadata(forward_batch)       # plans every draft step in one JAX call
    for i, backend in enumerate(draft.attn_backends):
        forward_batch.attn_backend = backend         # step i: model forward as usual
        forward_batch.out_cache_loc = loc[i]         # or keep the full [bs, topk, num_steps] tensor

SGLang re-plans every step from scratch; here one compiled call of
``jax_attn.multistep.plan_draft_steps`` builds the committed-KV plan once and derives each
step's plan from it, and each step's backend receives its plan (no per-step planning, one
packed import per draft round). The step backends share imported views and compiled
executables. A captured round (chain or tree drafts) on the launch path plans nothing in its replay hook:
each step's tables are recomputed inside the engine's graph (``torch_bridge.graph_tables``).
``forward_batch.out_cache_loc`` at planning time holds every draft step's slots,
``[bs, topk, num_steps]`` flattened (``topk`` = 1 for chain drafts), as SGLang's EAGLE worker
allocates them. In a Llama 4 model every chain (topk 1) step's plan carries its chunked local virtual batch
(step ``i``: query at position ``seq_len + i``); tree steps carry the per-branch SWA table of sliding-window
layers (translated into the SWA pool of an ``SWAKVPool``).
"""

from __future__ import annotations

from typing import List, Optional, Tuple


from jax_attn import batch as jbatch
from jax_attn.metadata import ForwardMode
from torch_bridge.backend import FlashAttentionBackend
from torch_bridge.checks import RunnerSettings
from torch_bridge.dlpack import pad_int32



class FlashAttentionMultiStepBackend:
    """Draft-decode backends for steps ``0..speculative_num_steps - 2`` sharing one plan per round.

    Args:
      model_runner: as for ``FlashAttentionBackend``.
      topk: EAGLE topk (> 1: tree drafts, cascade attention per step); as in SGLang,
        ``server_args.speculative_eagle_topk`` rules when set.
      speculative_num_steps: draft steps per round; the last step runs no attention (SGLang).
      fa_impl_ver: SGLang's FlashAttention version (3 or 4): accepted, same attention either way.
      impl: jax_attn implementation (default ``model_runner.attention_impl``).
    """

    def __init__(self, model_runner, topk: int, speculative_num_steps: int, fa_impl_ver: int = 3, *,
                 impl: Optional[str] = None, mosaic_path=None):
        if speculative_num_steps < 1:
            raise ValueError(f"{speculative_num_steps=} must be >= 1")
        self.model_runner = model_runner
        self.topk = RunnerSettings.of(model_runner, fa_impl_ver, topk).topk
        self.speculative_num_steps = speculative_num_steps
        self.attn_backends: List[FlashAttentionBackend] = []
        for i in range(speculative_num_steps - 1):
            b = FlashAttentionBackend(model_runner, skip_prefill=True, speculative_step_id=i, topk=topk,
                                      speculative_num_steps=speculative_num_steps, fa_impl_ver=fa_impl_ver, impl=impl,
                                      mosaic_path=mosaic_path)  # one path (its kernels) for every step
            if self.attn_backends:
                b.share_compiled(self.attn_backends[0])
            self.attn_backends.append(b)
        self._graph_max: Optional[Tuple[int, int]] = None
        self._graph_buckets: set = set()

    @property
    def _per_req(self) -> int:  # out_cache_loc entries per request: [topk, num_steps]
        return max(self.topk, 1) * self.speculative_num_steps

    def init_forward_metadata(self, forward_batch) -> None:
        """Plan every draft step of this round (eager) and hand each step's backend its plan."""
        if not self.attn_backends:
            return
        bs = int(forward_batch.seq_lens.shape[0])
        loc = forward_batch.out_cache_loc.reshape(-1)
        if loc.shape[0] != bs * self._per_req:
            raise ValueError(f"{forward_batch.out_cache_loc.shape=} must hold every draft step's slots: "
                             f"[bs={bs}, topk={max(self.topk, 1)}, num_steps={self.speculative_num_steps}] flattened")
        self._plan(bs, forward_batch.req_pool_indices, forward_batch.seq_lens, loc, forward_batch.spec_info, bs)

    def _plan(self, bs: int, rows, seq_lens, loc, spec_info, real_reqs: int, graph: bool = False) -> None:
        """One compiled planner call for all steps (``rows``, ``seq_lens``: [bs]; ``loc``: [bs*K*S])."""
        plans = self.attn_backends[0].planner.draft_round(bs, rows, seq_lens, loc, spec_info,
                                                          self.speculative_num_steps, graph)
        for b, (layout, words) in zip(self.attn_backends, plans):
            b.planner.install(b.planner.draft_key(bs, spec_info), layout, words, real_reqs * max(self.topk, 1),
                              self.speculative_num_steps, graph)

    # ---- capture / replay -------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Set the largest bucket the capture hook will be asked for (every step backend too)."""
        self._graph_max = (int(max_bs), int(max_num_tokens))
        self._graph_buckets = set()
        for b in self.attn_backends:
            b.init_cuda_graph_state(max_bs, max_num_tokens)

    def init_forward_metadata_capture_cuda_graph(self, forward_batch) -> None:
        """Compile the all-steps plan of bucket ``forward_batch.batch_size`` and plan the capture run."""
        if self._graph_max is None:
            raise RuntimeError("call init_cuda_graph_state(max_bs, max_num_tokens) before capturing")
        bs = int(forward_batch.batch_size)
        if bs > self._graph_max[0] or bs * max(self.topk, 1) > self._graph_max[1]:
            raise ValueError(f"{bs=} exceeds init_cuda_graph_state's {self._graph_max}")
        if getattr(forward_batch, "spec_info", None) is None:
            raise ValueError("draft decode capture needs forward_batch.spec_info (EAGLE's draft input)")
        self._graph_buckets.add(bs)
        self._plan_replay(forward_batch, bs)
        for b in self.attn_backends:  # each step's tables recomputed inside the engine's graph (where they can be)
            p, spec_info = b.planner, forward_batch.spec_info
            p.make_refresh(ForwardMode.DECODE, bs, p.draft_key(bs, spec_info), p.spec(spec_info, ForwardMode.DECODE),
                           forward_batch.req_pool_indices, forward_batch.seq_lens, loc=self._locs(forward_batch, bs))

    def init_forward_metadata_replay_cuda_graph(self, forward_batch, bs: int) -> None:
        """Pad the batch to bucket ``bs`` (seq_len 1, row 0, slot 0) and run the captured plan."""
        if bs not in self._graph_buckets:
            raise ValueError(f"no captured draft plan for bs={bs}; call init_forward_metadata_capture_cuda_graph "
                             "for this bucket first")
        self._replay(forward_batch, bs)

    def _replay(self, forward_batch, bs: int) -> None:
        """A replay hook: where every step's graph recomputes its tables (chain or tree drafts captured on the
        launch path: ``torch_bridge.graph_tables``), the step inputs (rows, lengths, every step's slots) go into
        the buffers those graphs read and no planner runs; else one planner call for all steps."""
        planners = [b.planner for b in self.attn_backends]
        refreshes = [p.recorded(ForwardMode.DECODE, bs) for p in planners]
        if planners and all(r is not None for r in refreshes):
            locs = self._locs(forward_batch, bs)
            for p, r in zip(planners, refreshes):
                p.take_recorded(r, forward_batch.req_pool_indices, forward_batch.seq_lens, forward_batch.spec_info,
                                locs)
            return
        self._plan_replay(forward_batch, bs)

    def _locs(self, forward_batch, bs: int):
        """Every draft step's slots of the batch's requests (at most bucket ``bs``'s), flattened; None if none."""
        loc = forward_batch.out_cache_loc
        n = min(int(forward_batch.seq_lens.shape[0]), bs)
        return None if loc is None else loc.reshape(-1)[: n * self._per_req]

    def _plan_replay(self, forward_batch, bs: int) -> None:
        """Plan bucket ``bs``'s draft round (padded: seq_len 1, row 0, slot 0) with one planner call."""
        if not self.attn_backends:
            return
        seq_lens = forward_batch.seq_lens
        n = min(int(seq_lens.shape[0]), bs)
        rows = pad_int32(forward_batch.req_pool_indices[:n], bs, 0)
        lens = pad_int32(seq_lens[:n], bs, jbatch.SEQ_LEN_FILL_VALUE)
        loc = self._locs(forward_batch, bs)
        loc = rows[:0] if loc is None else loc
        self._plan(bs, rows, lens, pad_int32(loc, bs * self._per_req, 0), forward_batch.spec_info, n, graph=True)
