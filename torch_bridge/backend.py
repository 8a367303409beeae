"""SGLang's attention-backend interface for torch engines, running jax_attn through DLPack.

    backend = FlashAttentionBackend(model_runner)
    backend.init_forward_metadata(forward_batch)          # once per step: int32 inputs, JAX plan
    o = backend.forward(q, k, v, layer, forward_batch)    # per layer: torch KV write, JAX attention

Per step, the engine's (int64) index tensors are converted to int32 and packed into one tensor in
torch, imported once, and planned by a compiled JAX function (no host sync). Per layer, torch
writes the step's K/V into its own pool (``set_kv_buffer``); then either the Mosaic kernel is
launched on torch's stream (the launch path below), or ``q`` is imported, the pools are read
through views imported once, one compiled executable runs, and the output is exported back.
JAX never writes torch memory. See ``torch_bridge.dlpack`` for stream ordering.

Tree speculative decoding (topk > 1) runs jax_attn's cascade (prefix pass + expand pass +
``merge_state``):

* target verify: ``spec_info.custom_mask`` is SGLang's flat bool tree mask (per request, ``N``
  rows of ``seq_len + N`` columns, requests one after another). It joins the packed import as
  int32 words, zero-padded to a static length (eager: the next power of two of its length;
  capture/replay: ``bucket * N * (max_context_len + N)``), and the planner extracts the draft
  columns on device (``jax_attn.spec.draft_mask_from_custom_mask``): no host sync. Sliding-window
  layers (here and in tree draft decode) need ``model_runner.sliding_window_size >= 0`` (or an
  ``SWAKVPool``) so the plan carries the SWA table.
* draft decode: ``init_forward_metadata`` (and the replay hook) takes SGLang's full
  ``out_cache_loc`` of every draft step, ``[bs, topk, num_steps]`` flattened (branch ``k`` of
  request ``b`` writes step ``s`` at ``[b, k, s]``); ``forward`` accepts that same tensor or just
  this step's ``[bs * topk]`` slots (SGLang's per-step ``out_cache_loc[step]``) and writes column
  ``speculative_step_id``. topk <= 1 draft decode takes ``[bs]`` or ``[bs, 1, num_steps]`` alike.

Cross attention: ``forward_batch.encoder_lens`` plans the encoder table (a request's
``req_to_token`` row holds its encoder slots first); a layer with ``is_cross_attention`` writes
its K/V at ``forward_batch.encoder_out_cache_loc`` and attends non-causally over the encoder
tokens. The static bound on encoder lengths is the constructor's ``max_encoder_len``, else the
request table's width (no extra model-config attribute needed).

SGLang's hybrid ``SWAKVPool`` (``token_to_kv_pool`` with ``full_to_swa_index_mapping`` and
``swa_layer_nums > 0``): every plan carries ``swa_page_table`` (the page table translated through the
mapping inside the planner call, imported once: no host sync); sliding-window layers read their SWA
pool through it and write through the pool's ``set_kv_buffer`` (which translates the slots). In tree
(topk > 1) steps full layers run the cascade over the full pool and sliding-window layers their SWA table
(``md.swa``: committed then draft-token slots), translated slot by slot (``md.swa.swa_page_table``).

Llama 4 chunked local attention: in a ``model_config.is_local_attention_model`` model, every plan of
an extend, mixed, decode or target-verify step (topk <= 1) carries the virtual batch of
``attention_chunk_size`` chunks (``jax_attn.local``), and ``layer.use_irope`` layers attend it; so do the
chain draft steps of ``FlashAttentionMultiStepBackend`` (step ``i``: KV length ``seq_len + i + 1``).

The SGLang 0.5.11 attributes read, and those that raise ``NotImplementedError``, are listed in
``docs/sglang_contract.md``; ``torch_bridge.checks.RunnerSettings`` reads the model runner's.

Launch path (Hopper GPUs, ``impl`` ``auto`` or ``mosaic``): layers the Mosaic kernel covers (bf16/f16,
head dims that are multiples of 16 up to 192 and 256, page size a multiple of 8, no cross attention; in a tree
step the prefix pass), and the Triton-lowered kernel the other layers (any CUDA GPU of sm80+;
cross-attention layers over their encoder tokens' tables, tree (topk > 1) steps' layers as two passes and
a merge, their sliding-window layers as one pass over the tree's SWA table; MLA layers), skip JAX at run
time:
torch writes K/V, the kernel is launched on torch's current stream by ``torch_bridge.launcher`` with
tables made once per step (``torch_bridge.mosaic_path``). Such a forward is captured by
``torch.cuda.graph`` (run the bucket once before capturing, as SGLang's graph runner does). A uniform
bucket's graph (decode, chain draft decode and verify) and a tree verify bucket's (topk > 1: its mask
copied by the replay hook into a buffer the graph reads) recompute their tables themselves from the
engine's static buffers, so their replay hooks run no planner (``torch_bridge.graph_tables``); other
buckets' replay hooks (tree draft decode, an ``SWAKVPool``'s tree tables) run the planner, which refreshes
the tables in the persistent buffers the graph reads.

Other layers run a compiled JAX executable per layer. A JAX computation cannot be captured by
``torch.cuda.graph``, so such a forward call during a capture raises. The capture/replay hooks
compile the plan of each batch bucket ahead of time and replay pads the batch with SGLang's rules;
attention executables are compiled by the first forward of each bucket and reused afterwards.
"""

from __future__ import annotations

import dataclasses

from typing import Optional

import torch

from jax_attn import compile_cache as jax_compile_cache
from jax_attn import safety
from jax_attn.backend import FlashAttentionBackend as JaxBackend
from jax_attn.metadata import ForwardMode
from jax_attn.progress import Progress
from torch_bridge.checks import RunnerSettings, graph_capture_blocker, pool_slots
from torch_bridge.dlpack import Importer
from torch_bridge.layer_runner import LayerRunner
from torch_bridge.mla import PrefixMHA, mla_rows, uses_prefix_mha
from torch_bridge.mosaic_path import MosaicPath
from torch_bridge.step import Step
from torch_bridge.step_planner import StepPlanner
from torch_bridge.translate import to_mode


class FlashAttentionBackend:
    """SGLang's ``FlashAttentionBackend`` interface over jax_attn: a ``StepPlanner`` (the per-step
    hooks) and a ``LayerRunner`` (``forward``).

    Args:
      model_runner: SGLang's ``ModelRunner`` or ``torch_bridge.types.ModelRunner`` (the attributes
        read are listed in ``docs/sglang_contract.md``).
      skip_prefill: accepted for SGLang compatibility (draft backends); no effect here.
      speculative_step_id: draft decode step: KV length = seq_lens + step_id + 1 (topk <= 1), or
        the branch's draft slots of steps ``0..step_id`` (topk > 1).
      topk: EAGLE topk, used when ``server_args.speculative_eagle_topk`` is None (SGLang reads that
        one); > 1 runs target verify and draft decode as tree (cascade) attention.
      speculative_num_steps: draft steps (the last axis of tree draft decode's ``out_cache_loc``).
      fa_impl_ver: SGLang's FlashAttention version (3 or 4): accepted, same attention either way.
      impl: jax_attn implementation; default ``model_runner.attention_impl`` or ``"auto"``.
      max_encoder_len: static bound on encoder lengths (cross attention); default
        ``model_runner.model_config.max_encoder_len`` when present, else the request table's width.
      validate: validation mode (``jax_attn.safety``): every plan's error flag is read back (a host
        sync) and a bad step raises before any layer writes; default ``JAX_ATTN_VALIDATE=1``.
      mosaic_path: the Mosaic launch path (``torch_bridge.mosaic_path.MosaicPath``) for the layers
        it covers; default: one on Hopper GPUs when ``impl`` is ``auto`` or ``mosaic``; False: off
        (every layer runs a compiled JAX executable).
      compile_cache: turn on the persistent compilation cache (``jax_attn.compile_cache``: a per-user
        0700 directory; ``JAX_ATTN_COMPILE_CACHE=0`` opts out), so a restarted server reuses its
        compiled plans, executables and kernels.
      verbose: the graph capture reports each bucket on stderr (``jax_attn.progress``: bucket i of n,
        elapsed time; n from ``server_args.cuda_graph_bs`` when set).
      share_graph_kernels: decode and chain-verify graph buckets plan at their batch class and share
        its planner and kernels, which are built ahead for the remaining buckets at the second capture
        hook (``torch_bridge.warmup``); False: one plan and kernel set per bucket, built as captured.
    """

    def __init__(self, model_runner, skip_prefill: bool = False, speculative_step_id: int = 0,
                 topk: int = 0, speculative_num_steps: int = 0, fa_impl_ver: int = 3, *,
                 impl: Optional[str] = None, max_encoder_len: Optional[int] = None, mosaic_path=None,
                 validate: Optional[bool] = None, compile_cache: bool = True, verbose: bool = True,
                 share_graph_kernels: bool = True):
        if compile_cache:
            jax_compile_cache.enable()  # warns and runs without it when the directory is unsafe
        self.verbose = verbose
        self._capture_progress: Optional[Progress] = None
        self._reported_kernels = 0  # prebuilt kernels the progress lines have counted
        self.settings = RunnerSettings.of(model_runner, fa_impl_ver, topk)
        self.model_runner = model_runner
        self.skip_prefill = skip_prefill
        self.speculative_step_id = speculative_step_id
        self.topk = self.settings.topk
        self.fa_impl_ver = fa_impl_ver
        self.speculative_num_steps = speculative_num_steps
        self.page_size = int(getattr(model_runner, "page_size", 1))
        r2t = model_runner.req_to_token_pool.req_to_token
        if r2t.dtype != torch.int32 or r2t.dim() != 2:
            raise ValueError(f"req_to_token {r2t.dtype=} {r2t.shape=} must be a 2-D torch.int32 tensor "
                             "(SGLang's ReqToTokenPool layout)")
        self.device = r2t.device
        importer = Importer(r2t.device)
        config = getattr(model_runner, "model_config", None)
        max_context_len = min(int(getattr(config, "context_len", r2t.shape[1])), r2t.shape[1])
        if max_encoder_len is None:  # a static bound every encoder length fits: the request table's width
            max_encoder_len = int(getattr(config, "max_encoder_len", 0) or r2t.shape[1])
        impl = impl or getattr(model_runner, "attention_impl", "auto")
        num_slots = pool_slots(getattr(model_runner, "token_to_kv_pool", None))
        self.jax_backend = JaxBackend(importer.table_view(r2t), page_size=self.page_size,
                                      max_context_len=max_context_len, impl=impl,
                                      deterministic=self.settings.deterministic,
                                      max_encoder_len=max_encoder_len, num_slots=num_slots, validate=validate,
                                      attention_chunk_size=self.settings.attention_chunk_size,
                                      num_swa_slots=self.settings.num_swa_slots, mla=self.settings.mla)
        if mosaic_path is None:
            mosaic_path = MosaicPath.for_device(self.device, impl)
        if mosaic_path and self.settings.deterministic:  # a request's bits must not depend on the batch
            mosaic_path.config = dataclasses.replace(mosaic_path.config, batch_invariant=True)
            mosaic_path.deterministic = True  # Triton tables: one kv split per sequence
        self.mosaic_path = mosaic_path or None
        self.planner = StepPlanner(model_runner, self.settings, self.jax_backend, importer, self.mosaic_path,
                                   speculative_step_id, speculative_num_steps)
        self.planner.share_graph_kernels = share_graph_kernels
        self.prefix_mha = PrefixMHA(importer, self.jax_backend.impl)
        self.runner = LayerRunner(self.planner, self.jax_backend, importer, self.mosaic_path, num_slots,
                                  speculative_step_id, self.settings.num_swa_slots)

    def share_compiled(self, other: "FlashAttentionBackend") -> None:
        """Reuse ``other``'s compiled planners and executables (draft steps of one multi-step backend)."""
        self.planner.share(other.planner)
        self.runner.share(other.runner)

    @property
    def step(self) -> Optional[Step]:
        """The current step's plan (None before the first plan and on idle steps)."""
        return self.planner.step

    @property
    def trace_count(self) -> int:
        """Traces of the planner and attention functions (tests assert no retrace inside a bucket)."""
        return self.planner.trace_count + self.runner.trace_count

    # ---- per step ---------------------------------------------------------------------------
    def init_forward_metadata(self, forward_batch) -> None:
        """Plan one step (eager): convert the index tensors once, run the JAX planner."""
        mode = to_mode(forward_batch.forward_mode)
        if mode == ForwardMode.IDLE:
            self.planner.step = None
            return
        self.planner.eager(forward_batch, mode)

    def prebuild(self, forward_batches, layers, dtype: torch.dtype, has_sinks: bool = False) -> int:
        """Build ahead, in one round, the kernels ``layers`` (``RadixAttention`` s) launch from torch in steps
        like ``forward_batches`` (``dtype``: their queries'; ``has_sinks``: they take ``sinks``).

        Each batch is planned as ``init_forward_metadata`` plans it (a new shape class compiles its
        planner); then every layer's kernels are lowered and compiled together (``MosaicPath.prebuild``:
        Python lowerings in parallel processes, GPU code in threads), where one by one, at first use, each new
        shape class of a step would cost a round of its own. For an engine's start-up: the batch shapes it
        will run eagerly (its chunked-prefill and draft-extend shapes) and hook-only graph buckets. Batches
        are only planned, no layer runs; the current step is left as it was. Layers on the JAX path and tree
        (topk > 1) steps build at their first call. Returns the number of kernels built."""
        if self.mosaic_path is None:
            return 0
        step, specs = self.planner.step, []
        try:
            for fb in forward_batches:
                self.init_forward_metadata(fb)
                if self.planner.step is None:  # an idle batch
                    continue
                pool = getattr(fb, "token_to_kv_pool", None) or self.model_runner.token_to_kv_pool
                for layer in layers:
                    specs += self.runner.launch_specs(self.planner.step, layer, pool, dtype, has_sinks)
        finally:
            self.planner.step = step
        return self.mosaic_path.prebuild(specs)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Set the largest batch / token bucket the capture hook will be asked for.

        Raises ``NotImplementedError`` on CUDA pools when some layer could not be captured in a torch
        CUDA graph (it would run a compiled JAX executable: ``checks.graph_capture_blocker``), rather
        than at the capture or the replay."""
        blocker = self.cuda_graph_blocker()
        if blocker is not None:
            raise NotImplementedError(f"CUDA graphs: {blocker}; launch every layer from torch (impl='auto' with "
                                      "contiguous pools of one dtype) or run the engine without CUDA graphs")
        self.planner.init_graphs(max_bs, max_num_tokens)
        sizes = getattr(getattr(self.model_runner, "server_args", None), "cuda_graph_bs", None)
        self._reported_kernels = self.planner.prebuilt_kernels
        self._capture_progress = Progress(len(sizes) if sizes else None, "torch_bridge graph capture",
                                          enabled=self.verbose)

    def cuda_graph_blocker(self) -> Optional[str]:
        """Why this backend refuses CUDA graphs (``init_cuda_graph_state`` raises with it), or None: on CUDA
        pools, some layer would run a compiled JAX executable, which a torch graph cannot hold."""
        return graph_capture_blocker(getattr(self.model_runner, "token_to_kv_pool", None), self.settings,
                                     self.mosaic_path, self.jax_backend.impl)

    def init_forward_metadata_capture_cuda_graph(self, bs: int, num_tokens: int, req_pool_indices,
                                                 seq_lens, encoder_lens, forward_mode, spec_info) -> None:
        """Compile the plan of bucket ``bs`` ahead of time and plan the capture run with it."""
        mode = to_mode(forward_mode)
        self.planner.capture(bs, num_tokens, req_pool_indices, seq_lens, encoder_lens, mode, spec_info)
        if self._capture_progress is not None:  # the elapsed time includes the earlier buckets' warm-up runs
            # kernels built since the last line: in the last bucket's warm-up forward and in this hook
            built = self.planner.prebuilt_kernels - self._reported_kernels
            self._reported_kernels += built
            self._capture_progress.step(f"{mode.name} bs={bs}", "plan compiled" + (
                f", {built} kernels prebuilt" if built else ""))

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices, seq_lens, seq_lens_sum,
                                                encoder_lens, forward_mode, spec_info, seq_lens_cpu,
                                                out_cache_loc=None) -> None:
        """Pad the batch to bucket ``bs`` (seq_len 1, row 0, slot 0) and run the captured plan."""
        if self._capture_progress is not None:  # the first replay ends the warm-up: report its total
            self._capture_progress.finish("capture hooks, warm-up forwards and graph captures")
            self._capture_progress = None
        self.planner.replay(bs, req_pool_indices, seq_lens, encoder_lens, to_mode(forward_mode), spec_info,
                            out_cache_loc)

    def check(self) -> None:
        """Raise ``ValueError`` when the current step's plan flagged bad input (reads the flag: a sync)."""
        if self.planner.step is not None:
            safety.check(self.planner.fresh(self.planner.step).plan(), "torch_bridge plan")

    @staticmethod
    def get_cuda_graph_seq_len_fill_value() -> int:
        from jax_attn.batch import SEQ_LEN_FILL_VALUE

        return SEQ_LEN_FILL_VALUE

    # ---- per layer ---------------------------------------------------------------------------
    def forward(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        """SGLang's dispatch: idle -> empty, decode -> ``forward_decode``, else ``forward_extend``."""
        mode = to_mode(forward_batch.forward_mode)
        if mode == ForwardMode.IDLE:
            return q.new_empty(q.shape[0], layer.tp_q_head_num * layer.v_head_dim)
        fn = self.forward_decode if mode == ForwardMode.DECODE else self.forward_extend
        return fn(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       q_rope=None, k_rope=None, sinks=None):
        """Extend / mixed / verify / draft extend: ``q [T, Hq * D]`` -> ``[T, Hq * Dv]``."""
        return self._run(q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope, sinks)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True,
                       q_rope=None, k_rope=None, sinks=None):
        """Decode / draft decode: ``q [B * q_len, Hq * D]`` -> ``[B * q_len, Hq * Dv]``."""
        return self._run(q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope, sinks)

    def _run(self, q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope, sinks):
        if self.planner.settings.mla:
            if uses_prefix_mha(forward_batch):  # the seed's chunked-prefix MHA: ragged K/V, no cache
                return self.prefix_mha(q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope, sinks)
            q, k = mla_rows(q, k, layer, q_rope, k_rope)
        elif q_rope is not None or k_rope is not None:
            raise NotImplementedError("q_rope / k_rope are for MLA models (model_config.attention_arch == MLA)")
        step = self.planner.step
        if step is None:
            raise RuntimeError("call init_forward_metadata (or the replay hook) before forward")
        out = self.runner.run(step, q, k, v, layer, forward_batch, save_kv_cache, sinks)
        dest = getattr(forward_batch, "_attn_output", None)  # SGLang's preallocated output (extend path)
        if dest is not None and dest.data_ptr() != out.data_ptr():
            return dest.view(out.shape).copy_(out)
        return out
