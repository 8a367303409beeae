"""SGLang-shaped batches of every forward mode, and what each must compute (``Expect``).

Each builder fills the committed K/V the step reads, builds the ``ForwardBatch`` (and spec input)
the way SGLang's scheduler / ``ForwardBatch.init_new`` / the EAGLE and NGRAM workers do (int64
index tensors, int32 extend lengths, host lists), and derives from ``req_to_token`` the slots each
query row may see. Layouts followed:

* extend / mixed / decode: ``seq_lens`` count every token including this step's; the step's tokens
  sit at columns ``prefix .. prefix + new - 1`` (after the ``encoder_len`` encoder columns in an
  encoder-decoder model; the step writes ``encoder_out_cache_loc`` when its encoder is not cached).
* target verify: ``seq_lens`` are the committed lengths; draft ``j`` sits at column ``seq_len + j``
  (``prepare_for_verify``); ``custom_mask`` is flat, per request ``N`` rows of ``seq_len + N``.
* draft decode: ``out_cache_loc`` is ``[bs, topk, num_steps]`` flattened; page size 1 or topk 1:
  branch ``k`` step ``s`` at column ``seq_len + k * num_steps + s`` (``assign_draft_cache_locs``);
  page size > 1 with topk > 1: slots of pages no request owns (SGLang's per-branch pages).
* draft extend: ``seq_lens`` include the accepted tokens; lengths are ``num_accepted_tokens``.

Tensors go to ``device.DEVICE`` (``i64`` / ``i32`` / ``dev``); SGLang's host copies (``seq_lens_cpu``,
``seq_lens_for_draft_extend_cpu``, the ``*_cpu`` lists) stay on the host (``cpu_i64``).
"""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence, Tuple

import numpy as np
import torch

from tests.sglang_contract.device import DEVICE
from tests.sglang_contract.engine import CaptureHiddenMode, ForwardBatch, ForwardMode, ServerArgs
from tests.sglang_contract.spec_inputs import EagleDraftInput, EagleVerifyInput, NgramVerifyInput
from tests.sglang_contract.reference64 import causal_rows, full_rows, tree_rows
from tests.sglang_contract.world import World


@dataclasses.dataclass(frozen=True)
class Req:
    """One request: ``prefix`` committed decoder tokens (K/V present), ``new`` tokens this step;
    ``enc`` encoder tokens in the row's first columns (``enc_new``: this step writes their K/V)."""

    row: int
    prefix: int
    new: int
    enc: int = 0
    enc_new: bool = False


@dataclasses.dataclass
class Expect:
    """What one forward must attend and write; one entry per query row, requests in batch order."""

    rows: List[np.ndarray]  # decoder self attention: slots each query row sees (causal / tree)
    full: List[np.ndarray]  # ENCODER_ONLY layers: every key of the request (non-causal)
    cross: List[np.ndarray]  # cross layers: the request's encoder slots
    seq: np.ndarray  # request index of each query row
    positions: np.ndarray  # each query's position (chunked local attention)
    loc: np.ndarray  # slots the self-attention layers write
    enc_loc: Optional[np.ndarray] = None  # slots the cross layers write (None: encoder cached, k is None)

    @property
    def num_tokens(self) -> int:
        return len(self.rows)


def i64(x) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x, np.int64), device=DEVICE)


def i32(x) -> torch.Tensor:
    return torch.as_tensor(np.asarray(x, np.int32), device=DEVICE)


def cpu_i64(x) -> torch.Tensor:
    """A host tensor (SGLang's ``*_cpu`` tensors stay on the CPU whatever the device)."""
    return torch.as_tensor(np.asarray(x, np.int64))


def dev(t: torch.Tensor) -> torch.Tensor:
    return t.to(DEVICE)


def _concat(parts, dtype=np.int64) -> np.ndarray:
    return np.concatenate([np.asarray(p, dtype) for p in parts]) if parts else np.zeros(0, dtype)


def _commit(world: World, reqs: Sequence[Req]) -> None:
    r2t = world.r2t
    for r in reqs:
        world.fill(r2t[r.row, r.enc:r.enc + r.prefix])
        if r.enc and not r.enc_new:
            world.fill(r2t[r.row, :r.enc], cross=True)


def _expect(world: World, reqs: Sequence[Req], per_req) -> Expect:
    """``per_req[b] = (rows, positions)`` of request ``b``'s decoder queries; the rest follows the layout."""
    r2t = world.r2t
    rows, full, cross, seq, pos = [], [], [], [], []
    for b, (r, (rr, pp)) in enumerate(zip(reqs, per_req)):
        rows += rr
        pos += list(pp)
        full += full_rows(r2t, r.row, len(rr), r.prefix + r.new, col0=r.enc)
        cross += full_rows(r2t, r.row, len(rr), r.enc)
        seq += [b] * len(rr)
    loc = _concat([r2t[r.row, r.enc + r.prefix:r.enc + r.prefix + r.new] for r in reqs])
    enc = [r2t[r.row, :r.enc] for r in reqs if r.enc_new]
    return Expect(rows, full, cross, np.array(seq, np.int64), np.array(pos, np.int64), loc,
                  _concat(enc) if enc else None)


def _causal(world: World, reqs: Sequence[Req]):
    return [(causal_rows(world.r2t, r.row, r.new, r.prefix + r.new, col0=r.enc), r.prefix + np.arange(r.new))
            for r in reqs]


def _base(world: World, reqs: Sequence[Req], mode: ForwardMode, seq_lens, loc, **kw) -> ForwardBatch:
    seq_lens = np.asarray(seq_lens, np.int64)
    fb = ForwardBatch(forward_mode=mode, batch_size=len(reqs),
                      input_ids=torch.zeros(len(loc), dtype=torch.int64, device=DEVICE),
                      req_pool_indices=i64([r.row for r in reqs]), seq_lens=i64(seq_lens), out_cache_loc=i64(loc),
                      seq_lens_sum=int(seq_lens.sum()), seq_lens_cpu=cpu_i64(seq_lens),
                      req_to_token_pool=world.req_pool, token_to_kv_pool=world.kv,
                      spec_algorithm=world.runner.spec_algorithm, capture_hidden_mode=CaptureHiddenMode.NULL, **kw)
    fb.num_token_non_padded_cpu = len(loc)
    if world.runner.model_config.is_encoder_decoder:
        fb.encoder_lens = i64([r.enc for r in reqs])
        fb.encoder_lens_cpu = [r.enc for r in reqs]
        fb.encoder_cached = [not r.enc_new for r in reqs]
        fb.encoder_out_cache_loc = i64(_concat([world.r2t[r.row, :r.enc] for r in reqs if r.enc_new]))
    return fb


def _extend_fields(fb: ForwardBatch, prefix: Sequence[int], new: Sequence[int]) -> None:
    fb.extend_num_tokens = int(sum(new))
    fb.extend_seq_lens = i32(new)
    fb.extend_prefix_lens = i32(prefix)
    fb.extend_start_loc = i32(np.concatenate([[0], np.cumsum(new)[:-1]]) if len(new) else [])
    fb.extend_prefix_lens_cpu = [int(p) for p in prefix]
    fb.extend_seq_lens_cpu = [int(n) for n in new]


def plain_step(world: World, reqs: Sequence[Req], mode: ForwardMode = ForwardMode.EXTEND, commit: bool = True):
    """EXTEND / MIXED (``prefix`` may be 0) or DECODE (``new`` = 1): ``(ForwardBatch, Expect)``.
    ``commit=False`` keeps the K/V earlier steps wrote (no fresh committed values)."""
    if commit:
        _commit(world, reqs)
    ex = _expect(world, reqs, _causal(world, reqs))
    fb = _base(world, reqs, mode, [r.prefix + r.new for r in reqs], ex.loc, positions=i64(ex.positions))
    if mode != ForwardMode.DECODE:
        _extend_fields(fb, [r.prefix for r in reqs], [r.new for r in reqs])
    return fb, ex


def idle_step(world: World):
    """An IDLE batch (``ScheduleBatch.prepare_for_idle``: a data-parallel rank without requests); a
    target-verify server gives it ``EagleVerifyInput.create_idle_input``."""
    ex = Expect([], [], [], np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64))
    args = world.runner.server_args
    spec = None
    if world.runner.spec_algorithm.is_eagle():
        spec = EagleVerifyInput.create_idle_input(args.speculative_eagle_topk, args.speculative_num_steps,
                                                  args.speculative_num_draft_tokens)
    fb = _base(world, [], ForwardMode.IDLE, [], ex.loc, positions=i64([]), spec_info=spec)
    return fb, ex


def random_tree(rng: np.random.Generator, n: int, chain: bool = False) -> Tuple[np.ndarray, np.ndarray]:
    """A draft tree of ``n`` tokens rooted at token 0: ``([n, n]`` ancestor-or-self mask, depths)``."""
    mask, depth = np.eye(n, dtype=bool), np.zeros(n, np.int64)
    for j in range(1, n):
        parent = j - 1 if chain else int(rng.integers(0, j))
        mask[j] |= mask[parent]
        depth[j] = depth[parent] + 1
    return mask, depth


def verify_step(world: World, reqs: Sequence[Req], *, chain: bool, ngram: bool = False):
    """TARGET_VERIFY of ``new`` = N draft tokens per request over ``prefix`` committed tokens."""
    _commit(world, reqs)
    r2t, n = world.r2t, reqs[0].new
    trees = [random_tree(world.rng, n, chain) for _ in reqs]
    blocks = [np.concatenate([np.ones((n, r.prefix), bool), m], axis=1) for r, (m, _) in zip(reqs, trees)]
    ex = _expect(world, reqs, [(tree_rows(r2t, r.row, r.prefix, block), r.prefix + depth)
                               for r, block, (_, depth) in zip(reqs, blocks, trees)])
    custom = dev(torch.from_numpy(np.concatenate([b.reshape(-1) for b in blocks])))
    seq_lens = np.array([r.prefix for r in reqs], np.int64)
    positions, bs = i64(ex.positions), len(reqs)
    args = world.runner.server_args
    draft_token = torch.zeros(bs * n, dtype=torch.int64, device=DEVICE)
    retrieve = [torch.full((bs, n), -1, device=DEVICE) for _ in range(3)]  # index, next token, next sibling
    if ngram:
        spec = NgramVerifyInput(draft_token, custom, positions, *retrieve, n)
    else:
        spec = EagleVerifyInput(draft_token, custom, positions, *retrieve, None, args.speculative_num_steps,
                                args.speculative_eagle_topk, n, CaptureHiddenMode.FULL, int(seq_lens.sum()),
                                cpu_i64(seq_lens))
    fb = _base(world, reqs, ForwardMode.TARGET_VERIFY, seq_lens, ex.loc, positions=positions, spec_info=spec)
    return fb, ex


def draft_extend_step(world: World, reqs: Sequence[Req]):
    """DRAFT_EXTEND after verify (spec v1): ``new`` = ``num_accepted_tokens`` over ``prefix`` older tokens."""
    _commit(world, reqs)
    ex = _expect(world, reqs, _causal(world, reqs))
    acc = np.array([r.new for r in reqs], np.int64)
    seq_lens = np.array([r.prefix + r.new for r in reqs], np.int64)
    steps = world.runner.server_args.speculative_num_steps
    spec = EagleDraftInput(hidden_states=world.rand(int(acc.sum()), 8), capture_hidden_mode=CaptureHiddenMode.LAST,
                           verified_id=torch.zeros(int(acc.sum()), dtype=torch.int32, device=DEVICE),
                           num_accepted_drafts=i32(acc - 1), num_accepted_tokens=i32(acc),
                           num_accepted_drafts_cpu=[int(a) - 1 for a in acc],
                           num_accepted_tokens_cpu=[int(a) for a in acc], num_tokens_per_req=steps + 1,
                           num_tokens_for_logprob_per_req=1, seq_lens_for_draft_extend=i64(seq_lens),
                           seq_lens_for_draft_extend_cpu=cpu_i64(seq_lens),
                           req_pool_indices_for_draft_extend=i64([r.row for r in reqs]))
    fb = _base(world, reqs, ForwardMode.DRAFT_EXTEND, seq_lens, ex.loc, positions=i64(ex.positions),
               spec_info=spec)
    fb.capture_hidden_mode = CaptureHiddenMode.LAST
    _extend_fields(fb, [r.prefix for r in reqs], acc)
    return fb, ex


def draft_extend_v2_step(world: World, reqs: Sequence[Req], accepted: Sequence[int]):
    """DRAFT_EXTEND_V2 (spec v2, ``prepare_for_extend_to_fill_draft_kvcache``): every request extends
    all ``new`` = ``num_draft_tokens`` draft tokens; ``num_accepted_tokens`` still holds the verify's
    ``accepted`` counts (``_draft_extend_for_decode``), which are not the extend lengths."""
    _commit(world, reqs)
    ex = _expect(world, reqs, _causal(world, reqs))
    acc = np.asarray(accepted, np.int64)
    steps = world.runner.server_args.speculative_num_steps
    spec = EagleDraftInput(hidden_states=world.rand(ex.num_tokens, 8), num_tokens_per_req=steps + 1,
                           num_tokens_for_logprob_per_req=steps + 1, num_accepted_drafts=i32(acc - 1),
                           num_accepted_tokens=i32(acc))
    fb = _base(world, reqs, ForwardMode.DRAFT_EXTEND_V2, [r.prefix + r.new for r in reqs], ex.loc,
               positions=i64(ex.positions), spec_info=spec)
    fb.capture_hidden_mode = CaptureHiddenMode.FULL
    _extend_fields(fb, [r.prefix for r in reqs], [r.new for r in reqs])
    return fb, ex


def draft_round(world: World, reqs: Sequence[Req], topk: int, num_steps: int):
    """One EAGLE draft round (DECODE with an ``EagleDraftInput``) over ``prefix`` committed tokens:
    ``(ForwardBatch with every step's out_cache_loc, [Expect of step 0 .. num_steps - 2])``."""
    _commit(world, reqs)
    r2t, bs = world.r2t, len(reqs)
    branch = np.zeros((bs, topk, num_steps), np.int64)  # [b, k, s] -> slot
    for b, r in enumerate(reqs):
        if world.page_size == 1 or topk == 1:
            branch[b] = r2t[r.row, r.prefix:r.prefix + topk * num_steps].reshape(topk, num_steps)
        else:
            branch[b] = world.spare_slots(topk * num_steps).reshape(topk, num_steps)
    expects = []
    for i in range(num_steps - 1):
        rows = [np.concatenate([r2t[r.row, :r.prefix], branch[b, k, :i + 1]])
                for b, r in enumerate(reqs) for k in range(topk)]
        seq = np.repeat(np.arange(bs), topk)
        pos = np.repeat([r.prefix + i for r in reqs], topk)
        expects.append(Expect(rows, rows, [np.zeros(0, np.int64)] * len(rows), seq, pos, branch[:, :, i].reshape(-1)))
    seq_lens = np.array([r.prefix for r in reqs], np.int64)
    spec = EagleDraftInput(topk_p=dev(torch.rand(bs, topk)),
                           topk_index=torch.zeros(bs, topk, dtype=torch.int64, device=DEVICE),
                           hidden_states=world.rand(bs, 8), capture_hidden_mode=CaptureHiddenMode.LAST)
    fb = _base(world, reqs, ForwardMode.DECODE, seq_lens, branch.reshape(-1),
               positions=i64(np.repeat(seq_lens, topk)), spec_info=spec)
    fb.input_ids = torch.zeros(bs * topk, dtype=torch.int64, device=DEVICE)  # one query token per branch
    fb.capture_hidden_mode = CaptureHiddenMode.LAST
    return fb, expects


def step_locs(fb: ForwardBatch, topk: int, num_steps: int) -> torch.Tensor:
    """``[num_steps, bs * topk]``: EAGLE's ``draft_forward`` view of the round's ``out_cache_loc``."""
    return fb.out_cache_loc.reshape(-1, topk, num_steps).permute(2, 0, 1).reshape(num_steps, -1)


def server_args_for(*, algo: Optional[str] = None, topk: Optional[int] = None, steps: Optional[int] = None,
                    draft: Optional[int] = None, **kw):
    """``ServerArgs`` of a speculative (or plain) server with the FA3 backend."""
    return ServerArgs(attention_backend="fa3", speculative_algorithm=algo, speculative_eagle_topk=topk,
                      speculative_num_steps=steps, speculative_num_draft_tokens=draft, **kw)

