"""SGLang's hybrid SWA KV pool (``SWAKVPool``) through the torch bridge, driven as SGLang drives it.

Models with interleaved sliding-window layers (gpt-oss, Gemma-style hybrids) run with
``token_to_kv_pool`` = ``SWAKVPool`` (``mem_cache/swa_memory_pool.py``): full-attention layers keep their
K/V in a full pool, sliding-window layers in a smaller SWA pool; ``full_to_swa_index_mapping`` maps a
full slot (what ``req_to_token`` and ``out_cache_loc`` hold) to its SWA slot. The seed reads SWA layers
through the translated page table and the pool's ``set_kv_buffer`` translates their writes.

The stand-in below is SGLang 0.5.11's class (same attribute names and method semantics) over the
contract suite's ``MHATokenToKVPool``; its mapping is a random page-level injection into a smaller
SWA pool (SGLang's paged allocator keeps a page's slots together). Both sub-pools start NaN, so a read
of a slot no request owns (a full slot read in the SWA pool, an untranslated page id) shows. Every
step: per-row float64 oracle from each layer's own pool via the mapping, and both sub-pools bit for
bit against the state before plus exactly SGLang's writes (SWA layers at ``mapping[out_cache_loc]``).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import pytest
import torch

import torch_bridge
from tests.sglang_contract.batches import (Expect, Req, draft_extend_step, draft_round, plain_step, server_args_for,
                                          verify_step)
from tests.sglang_contract.check import (REPLAY_TOL, check_draft_round, check_rows, check_untouched, forward_layers,
                                         make_qkv, pad_qkv, random_qkv)
from tests.sglang_contract.device import DEVICE, ON_CUDA, hopper, host, host64
from tests.sglang_contract.engine import ForwardMode, MHATokenToKVPool
from tests.sglang_contract.graph_runner import CudaGraphRunner, EAGLEDraftCudaGraphRunner
from tests.sglang_contract.test_graphs import _capture, traces
from tests.sglang_contract.reference64 import attention64
from tests.sglang_contract.test_spec import EAGLE_CHAIN, EAGLE_TREE
from tests.sglang_contract.world import CAP, HKV, HQ, PLAIN, SINK, SWA, SWA_SINK, TOL, World, as_bits

EXTEND, DECODE, MIXED = ForwardMode.EXTEND, ForwardMode.DECODE, ForwardMode.MIXED
GPT_OSS = (SWA_SINK, SINK, SWA, PLAIN)  # sliding-window layers interleaved with full ones (window 5 < context)
SWA_REQS = 5  # requests one test may create: the SWA pool holds their pages only (smaller than the full pool)


class SWAKVPool:
    """SGLang 0.5.11 ``mem_cache.swa_memory_pool.SWAKVPool`` (the attributes and methods the model runner,
    the attention backends and the allocator use), over two ``MHATokenToKVPool`` sub-pools."""

    def __init__(self, size: int, size_swa: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int,
                 swa_attention_layer_ids: List[int], full_attention_layer_ids: List[int],
                 enable_kvcache_transpose: bool, device: str, token_to_kv_pool_class=MHATokenToKVPool, **kwargs):
        assert not enable_kvcache_transpose
        self.size, self.size_swa, self.dtype = size, size_swa, dtype
        self.head_num, self.head_dim, self.device = head_num, head_dim, device
        self.swa_layer_nums = len(swa_attention_layer_ids)
        self.full_layer_nums = len(full_attention_layer_ids)
        self.start_layer, self.page_size, self.swa_loc = 0, page_size, None
        self.swa_kv_pool = token_to_kv_pool_class(size_swa, page_size, dtype, head_num, head_dim,
                                                  self.swa_layer_nums, device, False)
        self.full_kv_pool = token_to_kv_pool_class(size, page_size, dtype, head_num, head_dim,
                                                   self.full_layer_nums, device, False)
        self.layers_mapping: Dict[int, Tuple[int, bool]] = {}
        for i, layer_id in enumerate(full_attention_layer_ids):
            self.layers_mapping[layer_id] = (i, False)
        for i, layer_id in enumerate(swa_attention_layer_ids):
            self.layers_mapping[layer_id] = (i, True)
        self.full_to_swa_index_mapping: Optional[torch.Tensor] = None

    def register_mapping(self, full_to_swa_index_mapping: torch.Tensor):
        self.full_to_swa_index_mapping = full_to_swa_index_mapping

    def _sub(self, layer_id: int):
        index, is_swa = self.layers_mapping[layer_id]
        return (self.swa_kv_pool if is_swa else self.full_kv_pool), index

    def get_key_buffer(self, layer_id: int):
        pool, index = self._sub(layer_id)
        return pool.get_key_buffer(index)

    def get_value_buffer(self, layer_id: int):
        pool, index = self._sub(layer_id)
        return pool.get_value_buffer(index)

    def get_kv_buffer(self, layer_id: int):
        pool, index = self._sub(layer_id)
        return pool.get_kv_buffer(index)

    def set_swa_loc(self, loc: torch.Tensor):
        self.swa_loc = loc

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor):
        assert self.full_to_swa_index_mapping is not None
        return self.full_to_swa_index_mapping[kv_indices].to(torch.int32)

    def set_kv_buffer(self, layer, loc, cache_k, cache_v, k_scale: float = 1.0, v_scale: float = 1.0):
        index, is_swa = self.layers_mapping[layer.layer_id]
        if is_swa:
            if self.swa_loc is not None:
                loc = self.swa_loc
            elif self.full_to_swa_index_mapping is not None:
                loc = self.translate_loc_from_full_to_swa(loc)
            self.swa_kv_pool.set_kv_buffer(None, loc, cache_k, cache_v, k_scale, v_scale, layer_id_override=index)
        else:
            self.full_kv_pool.set_kv_buffer(None, loc, cache_k, cache_v, k_scale, v_scale, layer_id_override=index)


class SWAWorld(World):
    """``World`` whose ``token_to_kv_pool`` is an ``SWAKVPool``: layers with a window live in the SWA pool.
    Each new request's pages get SWA pages at random (``SWATokenToKVPoolAllocator``: page ``p`` of the full
    pool -> page ``m(p)`` of the SWA pool, slot offsets kept); unmapped full slots map to 0, and SGLang's
    trailing ``-1`` entry is kept."""

    def __init__(self, layers, *, page_size: int = 1, **kw):
        super().__init__(layers, page_size=page_size, **kw)
        full_slots = int(self.kv.k_buffer[0].shape[0])
        ps = page_size
        swa_ids = [i for i, s in enumerate(self.specs) if s.window >= 0]
        full_ids = [i for i, s in enumerate(self.specs) if s.window < 0]
        swa_pages = SWA_REQS * self._pages_per_req + 4
        self.kv = SWAKVPool(full_slots - ps, swa_pages * ps, ps, self.dtype, HKV, self.head_dim, swa_ids, full_ids,
                            False, str(DEVICE))
        mapping = torch.zeros(full_slots + 1, dtype=torch.int64, device=DEVICE)
        mapping[-1] = -1
        self.kv.register_mapping(mapping)
        for pool in (self.kv.full_kv_pool, self.kv.swa_kv_pool):
            for buf in pool.k_buffer + pool.v_buffer:
                buf.fill_(float("nan"))
        self.runner.token_to_kv_pool = self.kv
        self._free_swa = [int(p) for p in self.rng.permutation(np.arange(1, swa_pages + 1))]
        assert swa_pages * ps < full_slots - ps, "the SWA pool must be smaller than the full pool"

    def _map_slots(self, slots: np.ndarray) -> None:
        for page in np.unique(np.asarray(slots) // self.page_size):
            swa = self._free_swa.pop()
            idx = torch.arange(self.page_size, device=DEVICE)
            self.kv.full_to_swa_index_mapping[int(page) * self.page_size + idx] = swa * self.page_size + idx

    def new_request(self) -> int:
        row = super().new_request()
        self._map_slots(self.r2t[row])
        return row

    def spare_slots(self, n: int) -> np.ndarray:
        """Per-branch draft pages (tree drafts, page size > 1) get SWA pages too, as every page SGLang hands out."""
        slots = super().spare_slots(n)
        self._map_slots(slots)
        return slots

    @property
    def mapping(self) -> np.ndarray:
        return host(self.kv.full_to_swa_index_mapping).astype(np.int64)

    def own_slots(self, layer_id: int, slots) -> np.ndarray:
        """Where a layer keeps full slots ``slots``: itself, or their SWA slots for a sliding-window layer."""
        slots = np.asarray(slots, np.int64)
        return self.mapping[slots] if self.specs[layer_id].window >= 0 else slots

    def fill(self, slots: np.ndarray, *, cross: bool = False) -> None:
        for layer in self.layers:
            idx = torch.from_numpy(self.own_slots(layer.layer_id, slots)).to(DEVICE)
            kb, vb = self.kv.get_kv_buffer(layer.layer_id)
            kb[idx] = self.rand(len(idx), HKV, self.head_dim)
            vb[idx] = self.rand(len(idx), HKV, self.head_dim)

    def snapshot(self):
        """Every buffer of both sub-pools (each layer's own)."""
        return [tuple(b.clone() for b in self.kv.get_kv_buffer(layer.layer_id)) for layer in self.layers]

    def check_pools(self, expected, what: str, free: Sequence[int] = ()) -> None:
        """Both sub-pools bit for bit; ``free`` slots (0: padding) are excused in every layer's own pool."""
        for layer_id, (want, got) in enumerate(zip(expected, self.snapshot())):
            for name, g, w in zip("KV", got, want):
                diff = (as_bits(g) != as_bits(w)).flatten(1).any(1)
                diff[list(free)] = False
                bad = torch.nonzero(diff).flatten().tolist()
                pool = "SWA" if self.specs[layer_id].window >= 0 else "full"
                assert not bad, f"{what}: layer {layer_id} {name} ({pool} pool) differs at slots {bad[:12]}"

    def with_writes(self, snapshot, qkvs, ex: Expect):
        """``snapshot`` after SGLang's ``set_kv_buffer`` of every layer (SWA layers at mapping[loc])."""
        out = []
        for layer_id, ((k, v), (_, nk, nv)) in enumerate(zip(snapshot, qkvs)):
            k, v = k.clone(), v.clone()
            if nk is not None:
                idx = torch.from_numpy(self.own_slots(layer_id, ex.loc)).to(DEVICE)
                k[idx] = nk.reshape(len(idx), *k.shape[1:]).to(k.dtype)
                v[idx] = nv.reshape(len(idx), *v.shape[1:]).to(v.dtype)
            out.append((k, v))
        return out


def check_swa_step(world: SWAWorld, backend, fb, ex: Expect, *, what: str, plan: bool = True, qkvs=None,
                   pad_to: Optional[int] = None, eager=None):
    """``check.check_step`` for an ``SWAKVPool``: oracle from each layer's own pool via the mapping."""
    qkvs = list(qkvs) if qkvs is not None else [make_qkv(world, s, ex) for s in world.specs]
    before = world.snapshot()
    expected = world.with_writes(before, qkvs, ex)
    run = qkvs if pad_to is None else pad_qkv(world, qkvs, pad_to)
    kept = [tuple(x.clone() for x in t) for t in run]
    fb.attn_backend = backend
    if plan:
        backend.init_forward_metadata(fb)
    outs = forward_layers(world, fb, run)
    check_untouched(run, kept, what)
    world.check_pools(expected, what, free=() if pad_to is None else (0,))
    for i, (spec, (k_pool, v_pool), (q, _, _), sinks) in enumerate(zip(world.specs, expected, qkvs, world.sinks)):
        rows = [world.own_slots(i, r) for r in ex.rows]
        q64 = host64(q[:ex.num_tokens]).reshape(ex.num_tokens, HQ, world.head_dim)
        ref = attention64(q64, host64(k_pool), host64(v_pool), rows, scale=spec.scaling, softcap=spec.softcap,
                          window=spec.window, sinks=None if sinks is None else host64(sinks))
        ref = ref.reshape(ex.num_tokens, -1)
        check_rows(outs[i], ref, ex, TOL[world.dtype], f"{what} layer {i} ({spec})")
        if eager is not None:
            check_rows(outs[i], host64(eager[i][:ex.num_tokens]), ex, REPLAY_TOL[world.dtype], f"{what} layer {i}: "
                       "replay vs eager")
    return outs, qkvs


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    mode: ForwardMode
    reqs: Tuple[Tuple[int, int], ...]  # (prefix, new) per request
    catches: str
    layers: Tuple = GPT_OSS
    page_size: int = 1


CASES = [
    Case("extend_p1", EXTEND, ((0, 9), (20, 17), (3, 1)),
         "SWA layers reading the full pool's page ids (untranslated page table: NaN / another request's K/V)"),
    Case("extend_p16", EXTEND, ((33, 7), (0, 21), (2, 14)),
         "page size 16: the mapping applied to page ids instead of token slots, or // page_size skipped",
         page_size=16),
    Case("mixed_p16", MIXED, ((0, 7), (30, 1), (12, 4), (47, 1)), "MIXED step: SWA table of the ragged plan",
         page_size=16),
    Case("decode_p1", DECODE, ((8, 1), (55, 1), (0, 1), (30, 1)),
         "decode: SWA layer's K/V written at full slots in the SWA pool (the pool's translation bypassed)"),
    Case("decode_p16", DECODE, ((15, 1), (16, 1), (60, 1)), "decode at page boundaries in the SWA pool",
         (SWA, CAP, SWA_SINK), page_size=16),
]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_swa_pool_mode(case: Case):
    world = SWAWorld(case.layers, page_size=case.page_size, sliding_window=5)
    backend = torch_bridge.FlashAttentionBackend(world.runner)
    fb, ex = plain_step(world, [Req(world.new_request(), p, n) for p, n in case.reqs], case.mode)
    check_swa_step(world, backend, fb, ex, what=f"{case.name} [{case.catches}]")
    assert backend.step.layout.swa, "the step's packed plan must carry md.swa_page_table"


def test_swa_pool_extend_then_decode():
    """Catches: the SWA page table or the writes of one step not matching the next (a full-slot write in
    the SWA pool would be read back as NaN or the wrong token by the decode steps)."""
    world = SWAWorld(GPT_OSS, page_size=16, sliding_window=5)
    rows = [world.new_request() for _ in range(2)]
    backend = torch_bridge.FlashAttentionBackend(world.runner)
    fb, ex = plain_step(world, [Req(rows[0], 0, 18), Req(rows[1], 0, 5)])
    check_swa_step(world, backend, fb, ex, what="prefill")
    for step in range(2):
        fb, ex = plain_step(world, [Req(rows[0], 18 + step, 1), Req(rows[1], 5 + step, 1)], DECODE, commit=False)
        check_swa_step(world, backend, fb, ex, what=f"decode {step}")


@pytest.mark.skipif(not ON_CUDA, reason="the Mosaic launch path runs on a CUDA device (JAX_ATTN_CONTRACT_DEVICE=cuda)")
@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_swa_pool_launch_path(mode):
    """Catches: launch-path sliding-window layers reading the full page table or tables of the full plan
    (the SWA tables, ``TableKey`` variant 2), or their KV writes landing at full slots in the SWA pool."""
    if not hopper():
        pytest.skip("the bridge's Mosaic launch path needs a Hopper GPU")
    world = SWAWorld((SWA, PLAIN, SWA, CAP), page_size=16, sliding_window=5, dtype=torch.bfloat16, head_dim=64)
    backend = torch_bridge.FlashAttentionBackend(world.runner)
    assert backend.mosaic_path is not None, "expected the launch path on a Hopper GPU"
    rows = [world.new_request() for _ in range(3)]
    fb, ex = plain_step(world, [Req(rows[0], 0, 40), Req(rows[1], 0, 7), Req(rows[2], 0, 23)])
    check_swa_step(world, backend, fb, ex, what="launch path prefill")
    if mode == "decode":
        fb, ex = plain_step(world, [Req(rows[0], 40, 1), Req(rows[1], 7, 1), Req(rows[2], 23, 1)], DECODE,
                            commit=False)
        check_swa_step(world, backend, fb, ex, what="launch path decode")
    hits = backend.runner.hits
    assert any(h.swa for h in hits.values()) and any(not h.swa for h in hits.values()), \
        f"both SWA and full layers must run on the launch path, got {sorted(hits)}"


@pytest.mark.parametrize("page_size,committed", [(1, (9, 30, 2)), (16, (14, 45, 16))], ids=["p1", "p16"])
def test_swa_pool_chain_verify(page_size, committed):
    """Catches: chain (topk 1) target verify of an SWA layer with the kv offset of N draft tokens missing
    from its translated page table (the last draft page untranslated)."""
    world = SWAWorld(GPT_OSS, page_size=page_size, sliding_window=5, server_args=server_args_for(**EAGLE_CHAIN))
    backend = torch_bridge.FlashAttentionBackend(world.runner)
    fb, ex = verify_step(world, [Req(world.new_request(), c, EAGLE_CHAIN["draft"]) for c in committed], chain=True)
    check_swa_step(world, backend, fb, ex, what=f"chain verify p{page_size}")


def test_swa_pool_draft_extend():
    """Catches: draft extend (lengths from num_accepted_tokens) planned without the SWA page table."""
    world = SWAWorld(GPT_OSS, sliding_window=5, server_args=server_args_for(**EAGLE_CHAIN))
    backend = torch_bridge.FlashAttentionBackend(world.runner)
    fb, ex = draft_extend_step(world, [Req(world.new_request(), c, a) for c, a in ((9, 2), (30, 4), (3, 1))])
    check_swa_step(world, backend, fb, ex, what="draft extend")


GRAPH_CASES = [("decode", 16, ((15, 47, 16), (33, 3))), ("verify", 1, ((9, 40, 2), (20,)))]


@pytest.mark.parametrize("kind,page_size,batches", GRAPH_CASES, ids=["decode_p16", "verify_p1"])
def test_swa_pool_graph_replay_equals_eager(kind, page_size, batches):
    """Catches: the captured bucket's packed plan without md.swa_page_table (a replay reading the capture's
    table or the full page ids), replays differing from eager, writes outside the real slots and slot 0,
    or a retrace inside a bucket."""
    server = server_args_for(**EAGLE_CHAIN) if kind == "verify" else None
    world = SWAWorld(GPT_OSS, page_size=page_size, sliding_window=5, server_args=server)
    backend = torch_bridge.FlashAttentionBackend(world.runner, skip_prefill=True)
    graph = CudaGraphRunner(world.runner, backend, (2, 4))
    before = world.snapshot()
    graph.capture(lambda fb, n: forward_layers(world, fb, random_qkv(world, n)))
    world.check_pools(before, "capture runs", free=(0,))  # the capture buffer's slots are all 0
    for b, committed in enumerate(batches):
        rows = [world.new_request() for _ in committed]
        if kind == "decode":
            fb, ex = plain_step(world, [Req(r, c, 1) for r, c in zip(rows, committed)], DECODE)
        else:
            fb, ex = verify_step(world, [Req(r, c, EAGLE_CHAIN["draft"]) for r, c in zip(rows, committed)], chain=True)
        outs, qkvs = check_swa_step(world, backend, fb, ex, what=f"eager {kind} batch {b}")
        count = backend.trace_count
        graph_fb = graph.replay(fb)
        assert backend.step.layout.swa
        check_swa_step(world, backend, graph_fb, ex, plan=False, qkvs=qkvs, eager=outs,
                       pad_to=int(graph_fb.out_cache_loc.shape[0]), what=f"replay {kind} batch {b}")
        assert backend.trace_count == count, f"{kind} batch {b}: replay of a captured bucket traced again"


@pytest.mark.parametrize("where", ["committed", "written"])
def test_swa_pool_bad_mapping_entry(where):
    """Catches: a mapping entry outside the SWA pool read (an SWA page id past the pool) or written (the
    pool's translation would index past the SWA pool, or -1 would write its last slot): validation mode
    raises at planning with both sub-pools bit-identical; without it the plan's flag is set and the SWA
    layers' write goes to the reserved slot 0 only."""
    world = SWAWorld(GPT_OSS, page_size=16, sliding_window=5)
    reqs = [Req(world.new_request(), 20, 3), Req(world.new_request(), 5, 2)]
    fb, ex = plain_step(world, reqs)
    # committed: the first slot of the page holding position 16 (the seed translates page starts), in the window
    bad_slot = int(world.r2t[reqs[0].row, 16] if where == "committed" else ex.loc[1])
    world.kv.full_to_swa_index_mapping[bad_slot] = world.kv.swa_kv_pool.k_buffer[0].shape[0] + 5
    qkvs = [make_qkv(world, s, ex) for s in world.specs]
    before = world.snapshot()
    strict = torch_bridge.FlashAttentionBackend(world.runner, validate=True)
    fb.attn_backend = strict
    with pytest.raises(ValueError, match="full_to_swa_index_mapping"):
        strict.init_forward_metadata(fb)
    world.check_pools(before, f"{where}: validation mode")
    lenient = torch_bridge.FlashAttentionBackend(world.runner)
    fb.attn_backend = lenient
    lenient.init_forward_metadata(fb)
    with pytest.raises(ValueError, match="full_to_swa_index_mapping"):
        lenient.check()
    forward_layers(world, fb, qkvs)
    if where == "written":  # full layers write every token; SWA layers all but the bad one (sent to slot 0)
        keep = np.arange(ex.num_tokens) != 1
        expected = []
        for i, ((k, v), (_, nk, nv)) in enumerate(zip(before, qkvs)):
            sel = np.ones_like(keep) if world.specs[i].window < 0 else keep
            k, v = k.clone(), v.clone()
            idx = torch.from_numpy(world.own_slots(i, ex.loc[sel])).to(DEVICE)
            k[idx] = nk.reshape(ex.num_tokens, *k.shape[1:])[torch.from_numpy(sel)]
            v[idx] = nv.reshape(ex.num_tokens, *v.shape[1:])[torch.from_numpy(sel)]
            expected.append((k, v))
        world.check_pools(expected, "written: lenient mode", free=(0,))


def check_swa_round(world: SWAWorld, multi, fb, expects: Sequence[Expect], *, what: str, replay=None):
    """``check.check_draft_round`` for an ``SWAKVPool``: each step checked by ``check_swa_step``, and each
    step's plan must carry the SWA table (``replay``: the eager round's results)."""
    def check(world, backend, fb, ex, **kw):
        result = check_swa_step(world, backend, fb, ex, **kw)
        assert backend.step.layout.swa, f"{kw['what']}: the plan must carry the SWA table"
        return result
    return check_draft_round(world, multi, fb, expects, what=what, replay=replay, check=check)


@pytest.mark.parametrize("launch", [False, True], ids=["default", "triton_launch"])
@pytest.mark.parametrize("page_size,committed", [(1, (9, 30, 2)), (16, (14, 45))], ids=["p1", "p16"])
def test_swa_pool_tree_verify(page_size, committed, launch):
    """Catches: tree (topk > 1) target verify of sliding-window layers reading the SWA spec table's full
    slots in the SWA pool (NaN or another request's K/V): its committed part and its draft-token part must
    both go through ``full_to_swa_index_mapping``; full layers keep the cascade over the full pool.
    ``triton_launch``: the bridge's launch path, interpreted (on CUDA the default backend launches): the
    sliding-window layers then run one launch over the tree's SWA table translated into the SWA pool."""
    if launch and ON_CUDA:
        pytest.skip("on CUDA the default backend launches these layers")
    from tests.test_triton_launch import triton_path_for_tests
    from torch_bridge.mosaic_path import SWA_TABLES, TREE_SWA_TABLES, key_flags

    world = SWAWorld(GPT_OSS, page_size=page_size, sliding_window=5, server_args=server_args_for(**EAGLE_TREE))
    backend = torch_bridge.FlashAttentionBackend(world.runner, mosaic_path=triton_path_for_tests() if launch else None)
    fb, ex = verify_step(world, [Req(world.new_request(), c, EAGLE_TREE["draft"]) for c in committed], chain=False)
    check_swa_step(world, backend, fb, ex, what=f"tree verify p{page_size}")
    assert backend.step.layout.swa, "the tree plan must carry md.swa.swa_page_table"
    if launch:
        swa_calls = [h.call for h in backend.runner.hits.values() if h.swa and hasattr(h, "call")]
        assert swa_calls and all(key_flags(c.heads) & (TREE_SWA_TABLES | SWA_TABLES) == TREE_SWA_TABLES | SWA_TABLES
                                 for c in swa_calls), [getattr(c, "heads", None) for c in swa_calls]


@pytest.mark.parametrize("page_size,committed", [(1, (9, 30, 2)), (16, (17, 33))], ids=["p1", "p16"])
def test_swa_pool_tree_draft_decode(page_size, committed):
    """Catches: tree draft decode (``FlashAttentionMultiStepBackend``, topk 2) with sliding-window layers
    reading their branch's draft slots or the committed slots untranslated (a full slot in the SWA pool),
    their K/V written at full slots, or a step's SWA table covering another step's or branch's slots."""
    world = SWAWorld(GPT_OSS, page_size=page_size, sliding_window=5, server_args=server_args_for(**EAGLE_TREE))
    topk, steps = EAGLE_TREE["topk"], EAGLE_TREE["steps"]
    multi = torch_bridge.FlashAttentionMultiStepBackend(world.runner, topk, steps)
    fb, expects = draft_round(world, [Req(world.new_request(), c, 0) for c in committed], topk, steps)
    check_swa_round(world, multi, fb, expects, what=f"tree draft p{page_size}")


@pytest.mark.parametrize("kind", ["verify", "draft_decode"])
def test_swa_pool_tree_graph_replay_equals_eager(kind):
    """Catches: a captured tree bucket whose packed plan lacks md.swa.swa_page_table (a replay reading the
    capture's SWA table or full slots), replays differing from eager, writes outside the real slots and
    slot 0, or a retrace inside a bucket."""
    # one SWA-pool and one full-pool layer, one bucket (both batches replay it: the second must replace the first
    # replay's plan): every layer and bucket compiles its own interpreted kernels (tree buckets share no class)
    world = SWAWorld((SWA_SINK, PLAIN), page_size=1, sliding_window=5, server_args=server_args_for(**EAGLE_TREE))
    topk, steps = EAGLE_TREE["topk"], EAGLE_TREE["steps"]
    if kind == "verify":
        backend = torch_bridge.FlashAttentionBackend(world.runner, skip_prefill=True)
        graph, backends = CudaGraphRunner(world.runner, backend, (4,)), [backend]
    else:
        backend = torch_bridge.FlashAttentionMultiStepBackend(world.runner, topk, steps)
        graph, backends = EAGLEDraftCudaGraphRunner(world.runner, backend, (4,)), backend.attn_backends
    _capture(world, backend, graph)
    for b, committed in enumerate(((9, 30, 3), (21,))):
        reqs = [Req(world.new_request(), c, EAGLE_TREE["draft"] if kind == "verify" else 0) for c in committed]
        what = f"tree {kind} batch {b}"
        if kind == "verify":
            fb, ex = verify_step(world, reqs, chain=False)
            outs, qkvs = check_swa_step(world, backend, fb, ex, what=f"eager {what}")
            count = traces(*backends)
            graph_fb = graph.replay(fb)
            assert backend.step.layout.swa
            check_swa_step(world, backend, graph_fb, ex, plan=False, qkvs=qkvs, eager=outs,
                           pad_to=int(graph_fb.out_cache_loc.shape[0]), what=f"replay {what}")
        else:
            fb, expects = draft_round(world, reqs, topk, steps)
            eager = check_swa_round(world, backend, fb, expects, what=f"eager {what}")
            count = traces(*backends)
            check_swa_round(world, backend, graph.replay(fb), expects, what=f"replay {what}", replay=eager)
        assert traces(*backends) == count, f"{what}: replay of a captured bucket traced again"


def test_swa_pool_detected_as_the_seed_does():
    """Catches: a duck-typed SWAKVPool (another class name) missed, or one with ``swa_layer_nums == 0``
    (no SWA layers: the seed reads it as one pool) planned with a SWA table."""
    world = SWAWorld(GPT_OSS, sliding_window=5)
    swa_slots = world.kv.swa_kv_pool.k_buffer[0].shape[0]
    assert torch_bridge.FlashAttentionBackend(world.runner).settings.num_swa_slots == swa_slots
    world.kv.swa_layer_nums = 0
    assert torch_bridge.FlashAttentionBackend(world.runner).settings.num_swa_slots == 0
