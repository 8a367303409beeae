"""Greedy tree speculative decoding (EAGLE-style) through jax_attn's paged backend.

    python examples/speculative_decode.py --config tiny      # CPU, kernels in interpret mode
    python examples/speculative_decode.py --config small     # GPU sizes

Target: the Llama-style model of ``examples/llama.py``. Draft: the same model truncated to its
first ``--draft-layers`` layers, sharing the embeddings, final norm and head. With random weights
a truncated model predicts nothing about the full one, so the target's deeper layers have their
output projections (``wo``, ``w2``) scaled by ``--deep-layer-scale`` (default 0.3; 1.0 is the
plain truncation, 0.05 gets nearly every draft token accepted): they then nudge the residual
stream less and the draft approximates the target. This is a demo device for a meaningful
acceptance rate, not a property of real models.

Both models share one request table: a token's KV sits at the same slot in the target's and the
draft's pools, so one plan serves both in prefill (EXTEND). Each round, per request (committed
length ``L``, pending token ``root`` at position ``L``), one compiled executable runs:

1. draft DECODE of ``root`` (its draft KV at position ``L``); its top-``topk`` tokens start one
   branch each;
2. ``num_steps`` tree draft-decode steps (``ForwardMode.DECODE`` + ``SpecInfo(topk, num_steps,
   step_id)``): every branch extends itself greedily, attending to the committed KV plus its own
   draft KV. The tree is ``topk`` chains of ``num_steps`` tokens: ``N = 1 + topk * num_steps``
   tokens with the root, tree index ``1 + k * num_steps + i`` for branch ``k``, level ``i``;
3. one target TARGET_VERIFY call (topk > 1: cascade attention) over all ``N`` tokens with the
   tree mask, writing tree token ``j``'s KV at the slot of position ``L + j``, where step 2 wrote
   the draft's KV of the same token;
4. greedy acceptance: the longest branch prefix whose every token equals the target's argmax at
   its parent, plus the target's bonus token after it;
5. commit: the accepted tokens' KV is copied, in both models' pools, to positions
   ``L + 1 .. L + a`` (SGLang moves KV the same way when pages hold several tokens).

The script then greedy-decodes the same prompts with plain DECODE steps of the target (from the
same prefill) and checks that both produce the same tokens; a divergence at a numerical near-tie
of the target's logits is reported, not failed. It exits non-zero on a mismatch.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import llama  # noqa: E402
from decode_llama import PagedRequests  # noqa: E402

from jax_attn.backend import FlashAttentionBackend  # noqa: E402
from jax_attn.plan_key import plan_arrays  # noqa: E402
from jax_attn.batch import ForwardBatch, SpecInfo  # noqa: E402
from jax_attn.capture import StepRunner  # noqa: E402
from jax_attn.kv_cache import KVPool  # noqa: E402
from jax_attn.metadata import ForwardMode  # noqa: E402


# ---- models -------------------------------------------------------------------------------
def make_models(cfg: llama.Config, seed: int, draft_layers: int, deep_layer_scale: float):
    """Target params (deep layers' ``wo``/``w2`` scaled), draft params (its first layers), draft config."""
    if not 1 <= draft_layers <= cfg.n_layers:
        raise ValueError(f"{draft_layers=} must be in [1, {cfg.n_layers}] (the target's layer count)")
    params = llama.init_params(cfg, seed)
    layers = [dict(lp) if i < draft_layers else
              dict(lp, wo=lp["wo"] * deep_layer_scale, w2=lp["w2"] * deep_layer_scale)
              for i, lp in enumerate(params["layers"])]
    return dict(params, layers=layers), dict(params, layers=layers[:draft_layers]), \
        dataclasses.replace(cfg, n_layers=draft_layers)


def _top(logits):  # logits f32[T, V] -> greedy ids, top-1 logit, top-1/top-2 gap
    vals, ids = jax.lax.top_k(logits, 2)
    return dict(ids=ids[:, 0], top=vals[:, 0], gap=vals[:, 0] - vals[:, 1])


def make_decode_step(cfg: llama.Config, backend: FlashAttentionBackend):
    """``StepRunner`` step of the target alone (plain greedy decode)."""
    def step(md, tokens, params, pools):
        logits, pools = llama.forward_paged(cfg, backend, params, md, tokens["ids"], tokens["pos"], pools)
        return _top(logits), pools
    return step


def make_prefill_step(cfg: llama.Config, draft_cfg: llama.Config, backend: FlashAttentionBackend):
    """``StepRunner`` step running one plan through both models (they share slots)."""
    def step(md, tokens, target_params, draft_params, target_pools, draft_pools):
        logits, target_pools = llama.forward_paged(cfg, backend, target_params, md, tokens["ids"], tokens["pos"],
                                                   target_pools)
        _, draft_pools = llama.forward_paged(draft_cfg, backend, draft_params, md, tokens["ids"], tokens["pos"],
                                             draft_pools)
        return _top(logits), (target_pools, draft_pools)
    return step


# ---- the tree -----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Tree:
    """``topk`` chains of ``depth`` draft tokens under a root (tree index 0)."""

    topk: int
    depth: int

    @property
    def size(self) -> int:
        return 1 + self.topk * self.depth

    def index(self, k, i):
        """Tree index of branch ``k``, level ``i`` (works on arrays)."""
        return 1 + k * self.depth + i

    def mask(self) -> np.ndarray:
        """bool[N, N]: token i sees token j iff j is i or an ancestor of i."""
        m = np.eye(self.size, dtype=bool)
        m[:, 0] = True
        for k in range(self.topk):
            for i in range(self.depth):
                m[self.index(k, i), self.index(k, 0):self.index(k, i) + 1] = True
        return m

    def levels(self) -> np.ndarray:
        """i32[N]: position offset of each tree token from the root."""
        return np.concatenate([[0], np.tile(np.arange(1, self.depth + 1), self.topk)]).astype(np.int32)

    def parents(self) -> np.ndarray:
        """i32[topk, depth]: tree index of each draft token's parent."""
        k, i = np.meshgrid(np.arange(self.topk), np.arange(self.depth), indexing="ij")
        return np.where(i == 0, 0, self.index(k, i - 1)).astype(np.int32)


def accept_greedy(tree: Tree, draft, greedy):
    """Greedy tree acceptance, batched.

    Args:
      draft: i32[B, topk, depth] proposed tokens.
      greedy: i32[B, N] the target's argmax after each tree token (tree index order).

    Returns:
      ``(branch i32[B], accepted i32[B], bonus i32[B])``: the first branch with the longest
      accepted prefix, its length, and the target's token after it.
    """
    match = draft == greedy[:, tree.parents()]  # [B, topk, depth]
    lens = jnp.sum(jnp.cumprod(match, axis=-1), axis=-1).astype(jnp.int32)  # [B, topk]
    branch = jnp.argmax(lens, axis=-1).astype(jnp.int32)
    accepted = jnp.take_along_axis(lens, branch[:, None], 1)[:, 0]
    last = jnp.where(accepted > 0, tree.index(branch, accepted - 1), 0)
    return branch, accepted, jnp.take_along_axis(greedy, last[:, None], 1)[:, 0]


def move_kv(pools, src, dst):
    """Every pool in ``pools`` (a pytree of ``KVPool``): slot ``dst[i]`` takes slot ``src[i]``'s KV.

    ``src``/``dst`` are i32[M]; all reads happen before the writes; unused entries carry 0 -> 0.
    """
    def one(p: KVPool) -> KVPool:
        return KVPool(p.k.at[dst].set(p.k[src]), p.v.at[dst].set(p.v[src]))
    return jax.tree.map(one, pools, is_leaf=lambda x: isinstance(x, KVPool))


# ---- one speculative round ----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Models:
    """The static side of a round: both configs, the backend and the tree."""

    cfg: llama.Config
    draft_cfg: llama.Config
    backend: FlashAttentionBackend
    tree: Tree

    def keys(self, batch_size: int):
        """Static plan keys of the round's steps: draft root decode, tree draft steps, tree verify.

        They depend on the batch size only, so placeholder lengths and slots describe them.
        """
        t, b, plan = self.tree, batch_size, self.backend.plan_static
        rows, lens = np.arange(1, b + 1, dtype=np.int32), np.ones(b, np.int32)
        root = plan(ForwardBatch(ForwardMode.DECODE, rows, lens, np.zeros(b, np.int32)))
        steps = tuple(plan(ForwardBatch(ForwardMode.DECODE, rows, lens, np.zeros(b * t.topk * t.depth, np.int32),
                                        spec_info=SpecInfo(topk=t.topk, num_steps=t.depth, step_id=s)))
                      for s in range(t.depth))
        mask = np.broadcast_to(t.mask(), (b, t.size, t.size))
        verify = plan(ForwardBatch(ForwardMode.TARGET_VERIFY, rows, lens, np.zeros(b * t.size, np.int32),
                                   spec_info=SpecInfo(topk=t.topk, num_draft_tokens=t.size, draft_mask=mask)))
        return root, steps, verify


def _draft(m: Models, keys, req_to_token, rows, committed, slots, roots, params, pools):
    """Steps 1-2 of a round: i32[B, topk, depth] draft tokens and the draft pools."""
    t, b = m.tree, rows.shape[0]
    root_key, step_keys, _ = keys
    md = plan_arrays(root_key, req_to_token, rows, committed + 1, slots[:, 0])
    logits, pools = llama.forward_paged(m.draft_cfg, m.backend, params, md, roots, committed, pools)
    cur = jax.lax.top_k(logits, t.topk)[1].reshape(-1).astype(jnp.int32)  # [B * topk]: level 0
    levels, loc = [cur], slots[:, 1:].reshape(-1)
    for s, key in enumerate(step_keys):
        md = plan_arrays(key, req_to_token, rows, committed + 1, loc)
        pos = jnp.repeat(committed + 1 + s, t.topk)
        logits, pools = llama.forward_paged(m.draft_cfg, m.backend, params, md, cur, pos, pools)
        cur = jnp.argmax(logits, -1).astype(jnp.int32)
        if s + 1 < t.depth:  # the last step only writes the deepest level's draft KV
            levels.append(cur)
    return jnp.stack(levels, -1).reshape(b, t.topk, t.depth), pools


def spec_round(m: Models, keys, req_to_token, rows, committed, roots, target_params, draft_params,
               target_pools, draft_pools):
    """One round (module docstring, steps 1-5); jit with ``m`` and ``keys`` static.

    Args:
      req_to_token: i32[R, W]; rows, committed, roots: i32[B] request rows, committed lengths,
        pending tokens (position ``committed``).

    Returns:
      ``(draft i32[B, topk, depth], branch, accepted, bonus i32[B], target_pools, draft_pools)``.
    """
    t, b = m.tree, rows.shape[0]
    cols = committed[:, None] + jnp.arange(t.size, dtype=jnp.int32)[None]
    slots = req_to_token[rows[:, None], cols]  # [B, N]
    draft, draft_pools = _draft(m, keys, req_to_token, rows, committed, slots, roots, draft_params, draft_pools)
    ids = jnp.concatenate([roots[:, None], draft.reshape(b, -1)], 1).reshape(-1)
    pos = (committed[:, None] + jnp.asarray(t.levels())[None]).reshape(-1)
    mask = jnp.broadcast_to(jnp.asarray(t.mask()), (b, t.size, t.size))
    md = plan_arrays(keys[2], req_to_token, rows, committed, slots.reshape(-1), None, None, mask)
    logits, target_pools = llama.forward_paged(m.cfg, m.backend, target_params, md, ids, pos, target_pools)
    greedy = jnp.argmax(logits, -1).astype(jnp.int32).reshape(b, t.size)
    branch, accepted, bonus = accept_greedy(t, draft, greedy)
    i = jnp.arange(t.depth, dtype=jnp.int32)[None]
    keep = i < accepted[:, None]  # [B, depth]
    src = jnp.where(keep, jnp.take_along_axis(slots, t.index(branch[:, None], i), 1), 0).reshape(-1)
    dst = jnp.where(keep, slots[:, 1:t.depth + 1], 0).reshape(-1)
    target_pools, draft_pools = move_kv((target_pools, draft_pools), src, dst)
    return draft, branch, accepted, bonus, target_pools, draft_pools


# ---- the two decoders ---------------------------------------------------------------------
def prefill(runner: StepRunner, reqs: PagedRequests, prompts, params, pools):
    """EXTEND over the ragged prompts (both models, one plan).

    Returns ``(first token, its top-1 logit, top-1/top-2 gap)`` per request and the pools.
    """
    lens = np.array([len(p) for p in prompts], np.int32)
    fb = ForwardBatch(ForwardMode.EXTEND, reqs.rows, lens, reqs.slots(np.zeros_like(lens), lens),
                      extend_seq_lens=lens)
    tok = dict(ids=jnp.asarray(np.concatenate(prompts)),
               pos=jnp.asarray(np.concatenate([np.arange(n) for n in lens]), jnp.int32))
    out, pools = runner.eager(fb, tok, *params, *pools)
    last = np.cumsum(lens) - 1
    return tuple(np.asarray(out[x])[last] for x in ("ids", "top", "gap")), pools


def speculative_decode(m: Models, reqs: PagedRequests, committed, roots, new_tokens: int, params, pools):
    """Tree rounds until every request has ``new_tokens`` tokens (``roots`` counts as the first).

    Args:
      committed: i32[B] prompt lengths; roots: i32[B] the first generated tokens;
      params, pools: ``(target, draft)`` pairs.

    Returns:
      ``(tokens, stats)``: per-request token lists (cut to ``new_tokens``) and counters.
    """
    keys = m.keys(len(committed))
    round_fn = jax.jit(spec_round, static_argnums=(0, 1), donate_argnums=(8, 9))
    generated = [[int(r)] for r in roots]
    stats = dict(rounds=0, accepted=0, proposed=0, produced=0, side_branch=0, seconds=0.0)
    args = (m.backend.req_to_token, jnp.asarray(reqs.rows), jnp.asarray(committed), jnp.asarray(roots))
    t0 = time.perf_counter()
    exe = round_fn.lower(m, keys, *args, *params, *pools).compile()  # the round's "capture"
    stats["compile_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    while min(len(g) for g in generated) < new_tokens:
        out = exe(args[0], args[1], jnp.asarray(committed), jnp.asarray(roots), *params, *pools)
        draft, branch, accepted, bonus = (np.asarray(x) for x in out[:4])  # host sync
        pools = out[4:]
        for i, (k, a) in enumerate(zip(branch, accepted)):
            generated[i] += [int(x) for x in draft[i, k, :a]] + [int(bonus[i])]
        committed, roots = committed + 1 + accepted, bonus
        stats["rounds"] += 1
        stats["accepted"] += int(accepted.sum())
        stats["proposed"] += len(roots) * (m.tree.size - 1)
        stats["produced"] += int(accepted.sum()) + len(roots)
        stats["side_branch"] += int(np.sum((branch > 0) & (accepted > 0)))  # a non-first child won
    stats["seconds"] = time.perf_counter() - t0
    return [g[:new_tokens] for g in generated], stats


def greedy_decode(runner: StepRunner, reqs: PagedRequests, seq_lens, first, new_tokens: int, params, pools):
    """Plain greedy DECODE steps of the target after the prefill's ``first = (ids, top, gap)``.

    Returns ``(tokens, top-1 logits, top-1/top-2 gaps, seconds)``; per request, entry ``i`` of
    the logit lists belongs to the step that produced token ``i``.
    """
    tokens, tops, gaps = ([[x] for x in a.tolist()] for a in first)

    def batch():
        return ForwardBatch(ForwardMode.DECODE, reqs.rows, seq_lens + 1, reqs.slots(seq_lens, np.ones_like(seq_lens)))

    b = len(seq_lens)
    runner.capture([batch()], dict(ids=jnp.zeros(b, jnp.int32), pos=jnp.zeros(b, jnp.int32)), params, pools)
    t0 = time.perf_counter()
    for _ in range(new_tokens - 1):
        tok = dict(ids=jnp.asarray([g[-1] for g in tokens], jnp.int32), pos=jnp.asarray(seq_lens))
        out, pools = runner.replay(batch(), tok, params, pools)
        ids, top, gap = (np.asarray(out[x]) for x in ("ids", "top", "gap"))
        seq_lens = seq_lens + 1
        for i in range(b):
            tokens[i].append(int(ids[i]))
            tops[i].append(float(top[i]))
            gaps[i].append(float(gap[i]))
    return tokens, tops, gaps, time.perf_counter() - t0


def compare(spec, plain, tops, gaps, tol: float):
    """Per request: the first index where the two decodes differ, and whether it is a near-tie.

    ``tops``/``gaps`` hold the plain decode's top-1 logit and top-1/top-2 gap before each token.
    Returns ``(mismatches, ties)``: lists of ``(request, index)``; a divergence is a tie when the
    gap there is within ``tol * |top-1 logit|``.
    """
    mismatches, ties = [], []
    for r, (a, b) in enumerate(zip(spec, plain)):
        diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        if not diff and len(a) != len(b):
            diff = [min(len(a), len(b))]
        if diff:
            i = diff[0]
            tie = i < len(gaps[r]) and gaps[r][i] <= tol * abs(tops[r][i])
            (ties if tie else mismatches).append((r, i))
    return mismatches, ties


# ---- entry point --------------------------------------------------------------------------
def main(config="tiny", batch=3, min_prompt=5, max_prompt=16, new_tokens=12, topk=2, num_steps=3,
         draft_layers=None, deep_layer_scale=0.3, page_size=4, impl="auto", seed=0):
    """Speculative decode, plain greedy decode, compare; returns the exit code (0 = same tokens).

    Args:
      config: ``llama.CONFIGS`` key of the target model.
      batch: number of requests (prompts of random lengths in ``[min_prompt, max_prompt]``).
      new_tokens: tokens generated per request (the first comes from prefill).
      topk: branches of the draft tree (>= 2: tree verify and tree draft decode).
      num_steps: draft tokens per branch (tree draft-decode steps per round).
      draft_layers: the draft's layer count (default: a quarter of the target's, at least 1).
      deep_layer_scale: factor on the target's ``wo``/``w2`` beyond ``draft_layers``.
      page_size: KV page size of the pools.
      impl: attention implementation (``jax_attn.attention.IMPLS``).
      seed: prompts, weights and page shuffling.
    """
    if topk < 2 or num_steps < 1:
        raise ValueError(f"{topk=} must be >= 2 and {num_steps=} >= 1: this example drafts a tree")
    cfg = llama.CONFIGS[config]
    draft_layers = draft_layers or max(1, cfg.n_layers // 4)
    rng = np.random.default_rng(seed)
    lens = rng.integers(min_prompt, max_prompt + 1, batch).astype(np.int32)
    prompts = [rng.integers(0, cfg.vocab, n).astype(np.int32) for n in lens]
    tree = Tree(topk, num_steps)
    # A request that accepts every draft token grows by num_steps + 1 per round.
    max_ctx = max_prompt + new_tokens * (num_steps + 1) + tree.size + page_size
    reqs = PagedRequests(batch, max_ctx, page_size, seed)
    backend = FlashAttentionBackend(reqs.req_to_token, page_size=page_size, max_context_len=max_ctx, impl=impl)
    target_params, draft_params, draft_cfg = make_models(cfg, seed, draft_layers, deep_layer_scale)
    params = (target_params, draft_params)
    pools = (llama.new_pools(cfg, reqs.num_slots), llama.new_pools(draft_cfg, reqs.num_slots))

    t0 = time.perf_counter()
    runner = StepRunner(backend, make_prefill_step(cfg, draft_cfg, backend), donate_argnums=(2, 3))
    first, pools = prefill(runner, reqs, prompts, params, pools)
    prefill_s = time.perf_counter() - t0
    plain_pools = jax.tree.map(jnp.copy, pools[0])  # plain decode starts from the same prefill
    spec, st = speculative_decode(Models(cfg, draft_cfg, backend, tree), reqs, lens, first[0], new_tokens,
                                  params, pools)
    runner = StepRunner(backend, make_decode_step(cfg, backend), batch_buckets=(1, 2, 4, 8, 16, 32, 64),
                        donate_argnums=(1,))
    plain, tops, gaps, plain_s = greedy_decode(runner, reqs, lens, first, new_tokens, target_params, plain_pools)
    print(f"device={jax.devices()[0].device_kind} impl={backend.impl} config={config} batch={batch} "
          f"page_size={page_size} prompts={lens.tolist()}")
    print(f"target {cfg.n_layers} layers, draft {draft_layers} (deep-layer scale {deep_layer_scale}); tree: topk "
          f"{topk} x {num_steps} steps = {tree.size - 1} draft tokens per request per round; "
          f"prefill (both models, one plan) {prefill_s:.2f}s incl. compile")
    report(st, spec, plain_s, batch=batch, num_steps=num_steps, new_tokens=new_tokens)
    tol = 1e-4 if cfg.dtype == "float32" else 2e-2
    mismatches, ties = compare(spec, plain, tops, gaps, tol)
    for r, i in ties:
        print(f"  request {r} diverges at token {i}, where the target's top-2 logits are a near-tie")
    verdict = "FAILED" if mismatches else "OK"
    print(f"check vs plain greedy decode: mismatching (request, token) {mismatches}: {verdict}")
    return 1 if mismatches else 0


def report(st: dict, spec, plain_s: float, *, batch: int, num_steps: int, new_tokens: int) -> None:
    """Print the speculative counters ``st``, both decoders' speed and the first tokens ``spec``."""
    steps = max(st["rounds"] * batch, 1)
    print(f"acceptance rate: {st['accepted'] / max(st['proposed'], 1):.3f} ({st['accepted']} of {st['proposed']} "
          f"draft tokens); mean accepted length {st['accepted'] / steps:.2f} of {num_steps}; "
          f"{st['side_branch']} of {steps} accepts on a branch other than the draft's top-1")
    print(f"speculative: {st['rounds']} target steps, {st['produced'] / steps:.2f} tokens per target step per request, "
          f"{st['produced'] / st['seconds']:.1f} tokens/s (round compiled in {st['compile_s']:.1f}s, not counted)")
    if new_tokens > 1:
        print(f"plain greedy: {new_tokens - 1} target steps, {batch * (new_tokens - 1) / plain_s:.1f} tokens/s")
    for b in range(min(batch, 4)):
        print(f"  request {b}: {spec[b]}")


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="tiny", choices=sorted(llama.CONFIGS))
    ap.add_argument("--batch", type=int, default=3)
    ap.add_argument("--min-prompt", type=int, default=5)
    ap.add_argument("--max-prompt", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=12)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--num-steps", type=int, default=3)
    ap.add_argument("--draft-layers", type=int, default=None)
    ap.add_argument("--deep-layer-scale", type=float, default=0.3)
    ap.add_argument("--page-size", type=int, default=4)
    ap.add_argument("--impl", default="auto", choices=["auto", "triton", "reference"])
    ap.add_argument("--seed", type=int, default=0)
    return vars(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main(**parse()))
