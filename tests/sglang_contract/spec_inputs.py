"""SGLang 0.5.11's speculative-decoding inputs (``speculative/spec_info.py``, ``eagle_info.py``,
``ngram_info.py``), with its field names: ``EagleDraftInput`` carries ``num_accepted_drafts`` and
``num_accepted_tokens`` (= drafts + 1) and their host lists, no ``accept_length``;
``NgramVerifyInput`` stores its ``tree_mask`` as ``custom_mask`` and has no ``topk``. Tensors made here
are on ``device.DEVICE`` (SGLang's ``"cuda"``), ``seq_lens_cpu`` on the host."""

from __future__ import annotations

import dataclasses
from enum import IntEnum, auto
from typing import Any, List, Optional

import torch

from tests.sglang_contract.device import DEVICE
from tests.sglang_contract.engine import CaptureHiddenMode


class SpecInputType(IntEnum):
    EAGLE_DRAFT = auto()
    EAGLE_VERIFY = auto()
    DFLASH_DRAFT = auto()
    DFLASH_VERIFY = auto()
    NGRAM_VERIFY = auto()


class SpecInput:
    def __init__(self, spec_input_type: SpecInputType):
        self.spec_input_type = spec_input_type

    def is_draft_input(self) -> bool:
        return self.spec_input_type in (SpecInputType.EAGLE_DRAFT, SpecInputType.DFLASH_DRAFT)

    def is_verify_input(self) -> bool:
        return self.spec_input_type in (SpecInputType.EAGLE_VERIFY, SpecInputType.DFLASH_VERIFY,
                                        SpecInputType.NGRAM_VERIFY)


@dataclasses.dataclass
class EagleVerifyInput(SpecInput):
    """``speculative/eagle_info.py``: target verify input (``custom_mask`` flat bool, per request
    ``draft_token_num`` rows of ``seq_len + draft_token_num`` columns)."""

    draft_token: Optional[torch.Tensor]
    custom_mask: Optional[torch.Tensor]
    positions: Optional[torch.Tensor]
    retrieve_index: Optional[torch.Tensor]
    retrieve_next_token: Optional[torch.Tensor]
    retrieve_next_sibling: Optional[torch.Tensor]
    retrieve_cum_len: Optional[torch.Tensor]
    spec_steps: int
    topk: int
    draft_token_num: int
    capture_hidden_mode: CaptureHiddenMode
    seq_lens_sum: Optional[int]
    seq_lens_cpu: Optional[torch.Tensor]
    grammar: Any = None
    num_tokens_per_req: int = -1

    def __post_init__(self):
        SpecInput.__init__(self, SpecInputType.EAGLE_VERIFY)
        if self.num_tokens_per_req < 0:
            self.num_tokens_per_req = self.draft_token_num

    @classmethod
    def create_idle_input(cls, topk: int, spec_steps: int, num_verify_tokens: int) -> "EagleVerifyInput":
        """The verify input of an IDLE batch (a data-parallel rank without requests)."""
        none = torch.full((0, num_verify_tokens), -1, dtype=torch.long, device=DEVICE)
        return cls(torch.empty(0, dtype=torch.long, device=DEVICE), torch.full((0,), True, device=DEVICE),
                   torch.empty(0, dtype=torch.int64, device=DEVICE),
                   none, none.clone(), none.clone(), None, spec_steps, topk, num_verify_tokens,
                   CaptureHiddenMode.FULL, 0, torch.empty(0, dtype=torch.int32))


@dataclasses.dataclass
class EagleDraftInput(SpecInput):
    """``speculative/eagle_info.py``: draft decode / draft extend input. 0.5.11 names:
    ``num_accepted_tokens = num_accepted_drafts + 1`` (no ``accept_length``)."""

    topk_p: Optional[torch.Tensor] = None
    topk_index: Optional[torch.Tensor] = None
    hidden_states: Optional[torch.Tensor] = None
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.FULL
    verified_id: Optional[torch.Tensor] = None
    num_accepted_drafts: Optional[torch.Tensor] = None
    num_accepted_tokens: Optional[torch.Tensor] = None
    num_accepted_drafts_cpu: Optional[List[int]] = None
    num_accepted_tokens_cpu: Optional[List[int]] = None
    kv_indptr: Optional[torch.Tensor] = None
    kv_indices: Optional[torch.Tensor] = None
    num_tokens_per_req: int = -1
    num_tokens_for_logprob_per_req: int = -1
    seq_lens_for_draft_extend: Optional[torch.Tensor] = None
    seq_lens_for_draft_extend_cpu: Optional[torch.Tensor] = None
    req_pool_indices_for_draft_extend: Optional[torch.Tensor] = None
    future_indices: Any = None
    new_seq_lens: Optional[torch.Tensor] = None
    verify_done: Any = None

    def __post_init__(self):
        SpecInput.__init__(self, SpecInputType.EAGLE_DRAFT)


class NgramVerifyInput(SpecInput):
    """``speculative/ngram_info.py``: the constructor stores ``tree_mask`` as ``custom_mask``; no ``topk``."""

    def __init__(self, draft_token, tree_mask, positions, retrieve_index, retrieve_next_token,
                 retrieve_next_sibling, draft_token_num: int, grammar=None):
        super().__init__(SpecInputType.NGRAM_VERIFY)
        self.draft_token = draft_token
        self.custom_mask = tree_mask
        self.positions = positions
        self.retrieve_index = retrieve_index
        self.retrieve_next_token = retrieve_next_token
        self.retrieve_next_sibling = retrieve_next_sibling
        self.draft_token_num = draft_token_num
        self.device = tree_mask.device
        self.grammar = grammar
