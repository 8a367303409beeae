"""SGLang 0.5.11's CUDA-graph runners: their static buffers, call order and padding.

Read from ``model_executor/cuda_graph_runner.py`` (decode / target verify),
``speculative/eagle_draft_cuda_graph_runner.py`` (draft decode, multi-step backend) and
``speculative/eagle_draft_extend_cuda_graph_runner.py`` (draft extend). By default there is no
``torch.cuda.graph``: "capture" runs the model right after the capture hook on a batch of static
buffers, "replay" fills the buffers as SGLang's ``replay`` / ``replay_prepare`` do, calls the replay
hook, and returns that same static batch for the caller to run the model on again. That is the only
way on the CPU, and on a GPU for layers the bridge runs through JAX (a JAX computation cannot be
captured; the bridge raises inside a capture).

``real=True`` (CUDA only; layers on the bridge's Mosaic launch path, which torch can capture): capture
warms the bucket up twice as SGLang does, then records the model in a real ``torch.cuda.graph`` per
bucket (and per part: draft decode captures one graph per draft step, so that each step's writes can
be checked on their own); ``launch(bs, part)`` replays it after the caller's ``replay`` and returns the
outputs the capture allocated. The model then reads its activations from static buffers of its own.

Buffers live on ``device.DEVICE`` except ``seq_lens_cpu``, which SGLang keeps on the host.

Padding (read from SGLang): ``seq_lens`` filled with ``get_cuda_graph_seq_len_fill_value()``,
``req_pool_indices`` and ``out_cache_loc`` with 0 (the draft-decode runner zeroes
``req_pool_indices`` too), ``seq_lens_cpu`` with the fill value, encoder lengths with
``hf_config.max_source_positions``; draft extend pads ``num_accepted_*`` and ``extend_seq_lens``
with ``num_tokens_per_bs`` and passes the whole (max_bs) buffers to the replay hook.
"""

from __future__ import annotations

import bisect
import functools
from typing import Any, Callable, Dict, Sequence, Tuple

import torch

from tests.sglang_contract.device import DEVICE, synchronize
from tests.sglang_contract.engine import CaptureHiddenMode, ForwardBatch, ForwardMode, ModelRunner
from tests.sglang_contract.spec_inputs import EagleDraftInput, EagleVerifyInput, NgramVerifyInput

Model = Callable[[ForwardBatch, int], object]  # model(graph batch, num query tokens) -> outputs


def capture_cuda_graph(fn: Callable[[], Any]) -> Tuple[Callable[[], None], Any]:
    """Record ``fn()`` in a ``torch.cuda.graph`` (on torch's capture stream; nothing runs): returns
    ``(replay, what fn returned)``, the latter being tensors the graph's replays overwrite."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph.replay, out


def _batch(runner: ModelRunner, **kw) -> ForwardBatch:
    return ForwardBatch(req_to_token_pool=runner.req_to_token_pool, token_to_kv_pool=runner.token_to_kv_pool,
                        spec_algorithm=runner.spec_algorithm, **kw)


class _Runner:
    """Shared buffers of the three runners (``DecodeInputBuffers`` / ``Eagle*InputBuffers``)."""

    def __init__(self, runner: ModelRunner, capture_bs: Sequence[int], num_tokens_per_bs: int, fill: int,
                 real: bool = False):
        self.runner, self.capture_bs = runner, sorted(capture_bs)
        self.num_tokens_per_bs, self.fill = num_tokens_per_bs, fill
        self.max_bs = max(self.capture_bs)
        self.max_num_token = self.max_bs * num_tokens_per_bs
        self.req_pool_indices = torch.zeros(self.max_bs, dtype=torch.int64, device=DEVICE)
        self.seq_lens = torch.full((self.max_bs,), fill, dtype=torch.int32, device=DEVICE)
        self.seq_lens_cpu = torch.full((self.max_bs,), fill, dtype=torch.int32)  # host, as in SGLang
        self.positions = torch.zeros(self.max_num_token, dtype=torch.int64, device=DEVICE)
        self.input_ids = torch.zeros(self.max_num_token, dtype=torch.int64, device=DEVICE)
        self.graphs: Dict[int, ForwardBatch] = {}
        self.real = real
        self.cuda_graphs: Dict[Tuple[int, int], Tuple[Callable[[], None], Any]] = {}  # (bs, part) -> (replay, out)

    def bucket(self, raw_bs: int) -> int:
        return self.capture_bs[bisect.bisect_left(self.capture_bs, raw_bs)]

    def capture(self, *parts: Model) -> None:
        """Largest bucket first (SGLang captures in reverse for memory sharing). Per bucket, after the
        capture hook, the model (its ``parts`` in order) runs twice: a warm-up run (SGLang makes two) and
        the captured one; ``real``: two warm-up runs, then each part recorded in its own CUDA graph."""
        for bs in reversed(self.capture_bs):
            fb = self._capture_one(bs)
            n = bs * self.num_tokens_per_bs
            for _ in range(2):
                for model in parts:
                    model(fb, n)
            if self.real:
                for part, model in enumerate(parts):
                    synchronize()
                    self.cuda_graphs[(bs, part)] = capture_cuda_graph(functools.partial(model, fb, n))
            self.graphs[bs] = fb

    def launch(self, bs: int, part: int = 0):
        """``real``: replay bucket ``bs``'s graph of ``part`` (after ``replay`` prepared the bucket) and
        return the outputs its capture allocated, ready for reading."""
        replay, out = self.cuda_graphs[(bs, part)]
        replay()
        synchronize()
        return out

    def _copy_common(self, fb: ForwardBatch, raw_bs: int, bs: int) -> None:
        self.req_pool_indices[:raw_bs].copy_(fb.req_pool_indices)
        self.seq_lens[:raw_bs].copy_(fb.seq_lens)
        if fb.seq_lens_cpu is not None:
            if bs != raw_bs:
                self.seq_lens_cpu.fill_(self.fill)
            self.seq_lens_cpu[:raw_bs].copy_(fb.seq_lens_cpu)


class CudaGraphRunner(_Runner):
    """``cuda_graph_runner.CudaGraphRunner``: DECODE, or TARGET_VERIFY on a speculative server. IDLE
    batches (``batch_size`` 0) replay the smallest bucket with the captured mode, all rows padding."""

    def __init__(self, runner: ModelRunner, attn_backend, capture_bs: Sequence[int], *, real: bool = False):
        args = runner.server_args
        self.mode, ntpb = ForwardMode.DECODE, 1
        if runner.spec_algorithm.is_speculative():
            self.mode, ntpb = ForwardMode.TARGET_VERIFY, args.speculative_num_draft_tokens
        self.attn_backend = attn_backend
        attn_backend.init_cuda_graph_state(max(capture_bs), max(capture_bs) * ntpb)
        super().__init__(runner, capture_bs, ntpb, attn_backend.get_cuda_graph_seq_len_fill_value(), real)
        self.out_cache_loc = torch.zeros(self.max_num_token, dtype=torch.int64, device=DEVICE)
        self.custom_mask = torch.ones((self.max_bs * self.fill + self.max_num_token) * ntpb, dtype=torch.bool,
                                      device=DEVICE)
        config = runner.model_config
        self.encoder_lens = (torch.full((self.max_bs,), config.hf_config.max_source_positions, dtype=torch.int32,
                                        device=DEVICE) if config.is_encoder_decoder else None)

    def _spec_info(self):
        args, algo = self.runner.server_args, self.runner.spec_algorithm
        if algo.is_eagle() or algo.is_standalone():
            return EagleVerifyInput(None, self.custom_mask, None, None, None, None, None, args.speculative_num_steps,
                                    args.speculative_eagle_topk, args.speculative_num_draft_tokens,
                                    CaptureHiddenMode.FULL, None, None)
        if algo.is_ngram():
            spec = NgramVerifyInput(None, self.custom_mask, None, None, None, None, self.num_tokens_per_bs)
            spec.capture_hidden_mode = CaptureHiddenMode.NULL
            return spec
        return None

    def _capture_one(self, bs: int) -> ForwardBatch:
        n = bs * self.num_tokens_per_bs
        seq_lens = self.seq_lens[:bs]
        fb = _batch(self.runner, forward_mode=self.mode, batch_size=bs, input_ids=self.input_ids[:n],
                    req_pool_indices=self.req_pool_indices[:bs], seq_lens=seq_lens, seq_lens_cpu=self.seq_lens_cpu[:bs],
                    out_cache_loc=self.out_cache_loc[:n], seq_lens_sum=int(seq_lens.sum()),
                    positions=self.positions[:n],
                    encoder_lens=None if self.encoder_lens is None else self.encoder_lens[:bs],
                    spec_info=self._spec_info(), attn_backend=self.attn_backend, orig_seq_lens=seq_lens)
        fb.capture_hidden_mode = CaptureHiddenMode.NULL if fb.spec_info is None else fb.spec_info.capture_hidden_mode
        self.attn_backend.init_forward_metadata_capture_cuda_graph(bs, n, fb.req_pool_indices, fb.seq_lens,
                                                                   fb.encoder_lens, fb.forward_mode, fb.spec_info)
        return fb

    def replay(self, fb: ForwardBatch) -> ForwardBatch:
        """``replay_prepare``: pad into the buffers, call the replay hook; returns the graph's batch."""
        raw_bs = fb.batch_size
        raw_num_token = raw_bs * self.num_tokens_per_bs
        bs = self.bucket(raw_bs)
        if bs != raw_bs:
            self.seq_lens.fill_(self.fill)
            self.out_cache_loc.zero_()
        self.input_ids[:raw_num_token].copy_(fb.input_ids)
        self.out_cache_loc[:raw_num_token].copy_(fb.out_cache_loc)
        self.positions[:raw_num_token].copy_(fb.positions)
        if self.encoder_lens is not None and fb.encoder_lens is not None:
            self.encoder_lens[:raw_bs].copy_(fb.encoder_lens)
        self._copy_common(fb, raw_bs, bs)
        if fb.forward_mode.is_idle() and fb.spec_info is not None:
            fb.spec_info.custom_mask = self.custom_mask
        self.attn_backend.init_forward_metadata_replay_cuda_graph(
            bs, self.req_pool_indices[:bs], self.seq_lens[:bs], fb.seq_lens_sum + (bs - raw_bs) * self.fill,
            None if self.encoder_lens is None else self.encoder_lens[:bs], self.mode, fb.spec_info,
            seq_lens_cpu=self.seq_lens_cpu[:bs])
        return self.graphs[bs]


class EAGLEDraftCudaGraphRunner(_Runner):
    """``eagle_draft_cuda_graph_runner``: draft decode through ``FlashAttentionMultiStepBackend``;
    ``out_cache_loc`` holds every step's slots, ``[bs, topk, num_steps]``."""

    def __init__(self, runner: ModelRunner, draft_attn_backend, capture_bs: Sequence[int], *, real: bool = False):
        args = runner.server_args
        self.topk, self.num_steps = args.speculative_eagle_topk, args.speculative_num_steps
        self.draft_attn_backend = draft_attn_backend
        draft_attn_backend.init_cuda_graph_state(max(capture_bs), max(capture_bs) * self.topk)
        super().__init__(runner, capture_bs, self.topk,
                         draft_attn_backend.attn_backends[0].get_cuda_graph_seq_len_fill_value(), real)
        self.out_cache_loc = torch.zeros(self.max_num_token * self.num_steps, dtype=torch.int64, device=DEVICE)
        self.extend_seq_lens = torch.full((self.max_bs,), self.fill, dtype=torch.int32, device=DEVICE)
        self.topk_p = torch.zeros(self.max_bs, self.topk, device=DEVICE)
        self.topk_index = torch.zeros(self.max_bs, self.topk, dtype=torch.int64, device=DEVICE)
        self.hidden_states = torch.zeros(self.max_bs, 8, device=DEVICE)

    def _capture_one(self, bs: int) -> ForwardBatch:
        n = bs * self.num_tokens_per_bs
        spec = EagleDraftInput(topk_p=self.topk_p[:bs], topk_index=self.topk_index[:bs],
                               hidden_states=self.hidden_states[:bs], capture_hidden_mode=CaptureHiddenMode.LAST)
        seq_lens = self.seq_lens[:bs]
        fb = _batch(self.runner, forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=None,
                    req_pool_indices=self.req_pool_indices[:bs], seq_lens=seq_lens, seq_lens_cpu=self.seq_lens_cpu[:bs],
                    extend_seq_lens=self.extend_seq_lens[:bs], extend_seq_lens_cpu=[self.fill] * bs,
                    out_cache_loc=self.out_cache_loc[:n * self.num_steps], seq_lens_sum=int(seq_lens.sum()),
                    positions=self.positions[:n], spec_info=spec, capture_hidden_mode=CaptureHiddenMode.LAST)
        self.draft_attn_backend.init_forward_metadata_capture_cuda_graph(fb)
        return fb

    def replay(self, fb: ForwardBatch) -> ForwardBatch:
        raw_bs = fb.batch_size
        raw_num_token = raw_bs * self.num_tokens_per_bs
        bs = self.bucket(raw_bs)
        if bs != raw_bs:
            self.seq_lens.fill_(self.fill)
            self.out_cache_loc.zero_()
            self.positions.zero_()
            self.req_pool_indices.zero_()
        self.out_cache_loc[:raw_num_token * self.num_steps].copy_(fb.out_cache_loc)
        self.positions[:raw_num_token].copy_(fb.positions)
        self._copy_common(fb, raw_bs, bs)
        saved = (fb.batch_size, fb.seq_lens, fb.req_pool_indices, fb.positions, fb.seq_lens_cpu)
        if bs != raw_bs:
            fb.batch_size, fb.seq_lens = bs, self.seq_lens[:bs]
            fb.req_pool_indices, fb.positions = self.req_pool_indices[:bs], self.positions[:bs * self.topk]
        if fb.seq_lens_cpu is not None:
            fb.seq_lens_cpu = self.seq_lens_cpu[:bs]
        self.draft_attn_backend.init_forward_metadata_replay_cuda_graph(fb, bs)
        fb.batch_size, fb.seq_lens, fb.req_pool_indices, fb.positions, fb.seq_lens_cpu = saved
        return self.graphs[bs]


class EAGLEDraftExtendCudaGraphRunner(_Runner):
    """``eagle_draft_extend_cuda_graph_runner``: DRAFT_EXTEND (spec v1; a request's accepted tokens are
    packed at the front of the token buffers) or DRAFT_EXTEND_V2 (spec v2's ``EagleDraftWorker``);
    ``num_tokens_per_bs = num_steps + 1``."""

    def __init__(self, runner: ModelRunner, attn_backend, capture_bs: Sequence[int],
                 forward_mode: ForwardMode = ForwardMode.DRAFT_EXTEND, *, real: bool = False):
        self.attn_backend, self.forward_mode = attn_backend, forward_mode
        ntpb = runner.server_args.speculative_num_steps + 1
        attn_backend.init_cuda_graph_state(max(capture_bs), max(capture_bs) * ntpb)
        super().__init__(runner, capture_bs, ntpb, attn_backend.get_cuda_graph_seq_len_fill_value(), real)
        self.extend_seq_lens_cpu = [ntpb] * self.max_bs
        self.out_cache_loc = torch.ones(self.max_num_token, dtype=torch.int64, device=DEVICE)
        self.extend_seq_lens = torch.full((self.max_bs,), ntpb, dtype=torch.int32, device=DEVICE)
        self.num_accepted_drafts = torch.full((self.max_bs,), ntpb, dtype=torch.int32, device=DEVICE)
        self.num_accepted_tokens = torch.full((self.max_bs,), ntpb, dtype=torch.int32, device=DEVICE)
        self.hidden_states = torch.zeros(self.max_num_token, 8, device=DEVICE)

    def _capture_one(self, bs: int) -> ForwardBatch:
        n = bs * self.num_tokens_per_bs
        spec = EagleDraftInput(hidden_states=self.hidden_states[:n], num_accepted_drafts=self.num_accepted_drafts[:bs],
                               num_accepted_tokens=self.num_accepted_tokens[:bs])
        spec.positions = None
        seq_lens = self.seq_lens[:bs]
        fb = _batch(self.runner, forward_mode=self.forward_mode, batch_size=bs, input_ids=self.input_ids[:n],
                    req_pool_indices=self.req_pool_indices[:bs], seq_lens=seq_lens, seq_lens_cpu=self.seq_lens_cpu[:bs],
                    extend_seq_lens=self.extend_seq_lens[:bs], extend_seq_lens_cpu=self.extend_seq_lens_cpu[:bs],
                    out_cache_loc=self.out_cache_loc[:n], seq_lens_sum=int(seq_lens.sum()),
                    positions=self.positions[:n], spec_info=spec, capture_hidden_mode=CaptureHiddenMode.LAST,
                    attn_backend=self.attn_backend)
        self.attn_backend.init_forward_metadata_capture_cuda_graph(bs=bs, num_tokens=n,
                                                                   req_pool_indices=fb.req_pool_indices,
                                                                   seq_lens=seq_lens, encoder_lens=None,
                                                                   forward_mode=fb.forward_mode, spec_info=spec)
        return fb

    def replay(self, fb: ForwardBatch) -> ForwardBatch:
        raw_bs, num_tokens, ntpb = fb.batch_size, fb.input_ids.shape[0], self.num_tokens_per_bs
        bs = self.bucket(raw_bs)
        spec = fb.spec_info
        if bs * ntpb != num_tokens:
            self.seq_lens.fill_(self.fill)
            self.out_cache_loc.zero_()
            self.positions.zero_()
            self.num_accepted_drafts.fill_(ntpb)
            self.num_accepted_tokens.fill_(ntpb)
            self.extend_seq_lens.fill_(ntpb)
        self.input_ids[:num_tokens].copy_(fb.input_ids)
        if fb.extend_seq_lens is not None:
            self.extend_seq_lens[:raw_bs].copy_(fb.extend_seq_lens)
        else:
            self.extend_seq_lens[:raw_bs].fill_(ntpb)
        self.out_cache_loc[:num_tokens].copy_(fb.out_cache_loc)
        self.positions[:num_tokens].copy_(fb.positions)
        if spec.num_accepted_drafts is not None:
            self.num_accepted_drafts[:raw_bs].copy_(spec.num_accepted_drafts)
            self.num_accepted_tokens[:raw_bs].copy_(spec.num_accepted_tokens)
        self._copy_common(fb, raw_bs, bs)
        cpu = fb.extend_seq_lens_cpu or [ntpb] * raw_bs
        self.extend_seq_lens_cpu[:raw_bs] = cpu
        self.extend_seq_lens_cpu[raw_bs:bs] = [ntpb] * (bs - raw_bs)
        spec.extend_seq_lens_cpu = list(self.extend_seq_lens_cpu[:bs])
        spec.extend_seq_lens_tensor = self.extend_seq_lens[:bs]
        saved = (spec.num_accepted_drafts, spec.num_accepted_tokens)
        if bs != raw_bs:
            spec.positions = self.positions[:num_tokens]
            spec.num_accepted_drafts = self.num_accepted_drafts[:bs]
            spec.num_accepted_tokens = self.num_accepted_tokens[:bs]
        self.attn_backend.init_forward_metadata_replay_cuda_graph(
            bs=bs, req_pool_indices=self.req_pool_indices, seq_lens=self.seq_lens,
            seq_lens_sum=fb.seq_lens_sum + (bs - raw_bs) * self.fill, encoder_lens=None,
            forward_mode=self.forward_mode, spec_info=spec, seq_lens_cpu=self.seq_lens_cpu)
        spec.num_accepted_drafts, spec.num_accepted_tokens = saved
        return self.graphs[bs]
