"""examples/speculative_decode.py: tree speculative decoding reproduces plain greedy decoding."""

import os
import re
import sys

import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
import speculative_decode as sd  # noqa: E402

RUN = dict(config="tiny", batch=3, min_prompt=4, max_prompt=9, new_tokens=9, topk=2, num_steps=3,
           deep_layer_scale=0.3, page_size=4, seed=1)


def _stat(text, name):
    return float(re.search(name + r": ([0-9.]+)", text).group(1))


def test_example_matches_greedy_and_accepts_draft_tokens(capsys):
    assert sd.main(**RUN) == 0
    out = capsys.readouterr().out
    assert "OK" in out
    assert _stat(out, "acceptance rate") > 0
    # The tree matters: some round accepted a branch other than the draft's top-1 child.
    assert int(re.search(r"(\d+) of \d+ accepts on a branch other", out).group(1)) > 0


def test_example_check_fails_without_the_kv_commit(monkeypatch, capsys):
    # Leaving the accepted side-branch KV where verify wrote it must change later tokens.
    monkeypatch.setattr(sd, "move_kv", lambda pools, src, dst: pools)
    assert sd.main(**RUN) == 1
    assert "FAILED" in capsys.readouterr().out


def test_tree_mask_and_layout():
    t = sd.Tree(topk=2, depth=2)  # root 0; branch 0: 1 -> 2; branch 1: 3 -> 4
    want = np.array([[1, 0, 0, 0, 0],
                     [1, 1, 0, 0, 0],
                     [1, 1, 1, 0, 0],
                     [1, 0, 0, 1, 0],
                     [1, 0, 0, 1, 1]], bool)
    np.testing.assert_array_equal(t.mask(), want)
    np.testing.assert_array_equal(t.levels(), [0, 1, 2, 1, 2])
    np.testing.assert_array_equal(t.parents(), [[0, 1], [0, 3]])


@pytest.mark.parametrize("draft,greedy,want", [
    # greedy[j] = the target's token after tree token j (root 0; branch 0: 1, 2; branch 1: 3, 4)
    ([[5, 6], [7, 8]], [5, 6, 9, 1, 1], (0, 2, 9)),  # whole first branch, bonus after token 2
    ([[5, 6], [7, 8]], [7, 0, 0, 8, 4], (1, 2, 4)),  # second branch wins
    ([[5, 6], [7, 8]], [7, 0, 0, 3, 4], (1, 1, 3)),  # second branch, one token
    ([[5, 6], [7, 8]], [2, 6, 0, 8, 0], (0, 0, 2)),  # nothing accepted: bonus after the root
    ([[5, 6], [5, 8]], [5, 0, 0, 8, 1], (1, 2, 1)),  # same first token: the longer branch wins
])
def test_accept_greedy(draft, greedy, want):
    t = sd.Tree(topk=2, depth=2)
    got = sd.accept_greedy(t, jnp.asarray([draft], jnp.int32), jnp.asarray([greedy], jnp.int32))
    assert tuple(int(x[0]) for x in got) == want


def test_compare_tells_mismatches_from_near_ties():
    plain = [[1, 2, 3], [4, 5, 6]]
    tops, gaps = [[10.0] * 3, [10.0] * 3], [[1.0, 1.0, 1.0], [1.0, 1e-6, 1.0]]
    assert sd.compare(plain, plain, tops, gaps, 1e-4) == ([], [])
    assert sd.compare([[1, 2, 7], [4, 9, 6]], plain, tops, gaps, 1e-4) == ([(0, 2)], [(1, 1)])
    assert sd.compare([[1, 2], [4, 5, 6]], plain, tops, gaps, 1e-4) == ([(0, 2)], [])
