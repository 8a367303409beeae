"""The graph warm-up's rules: batch classes (``jax_attn.batch.batch_class``) and the capture sizes the
bridge prebuilds for (``torch_bridge.warmup.capture_sizes``). The prebuild itself runs in
``tests/test_bridge_launch.py``."""

import types

import pytest

from jax_attn.batch import DEFAULT_BATCH_BUCKETS, batch_class
from torch_bridge.warmup import capture_sizes

# SGLang 0.5.11 ServerArgs._generate_cuda_graph_batch_sizes for cuda_graph_max_bs 256: normal, speculative
SGLANG_DEFAULT_BS = [1, 2, 4, 8, 12] + list(range(16, 257, 8))
SGLANG_SPEC_BS = list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4)) + list(range(72, 257, 8))


def test_batch_class_is_the_smallest_ladder_bucket_that_holds_the_batch():
    """Catches: a class smaller than its batch (rows dropped), classes off the shared ladder (one more
    kernel per bucket), or sizes past the ladder not rounded to whole 64-row classes."""
    for bs in range(1, 700):
        c = batch_class(bs)
        assert c >= bs, (bs, c)
        if bs <= DEFAULT_BATCH_BUCKETS[-1]:
            assert c in DEFAULT_BATCH_BUCKETS and all(b < bs for b in DEFAULT_BATCH_BUCKETS if b < c)
        else:
            assert c % 64 == 0 and c - bs < 64
    assert [batch_class(b) for b in (3, 5, 9, 13, 17, 40, 136, 257)] == [4, 8, 12, 16, 24, 48, 160, 320]
    with pytest.raises(ValueError, match="bs=0"):
        batch_class(0)


def test_sglang_default_sizes_fall_in_fifteen_classes():
    """Catches: a ladder change that gives SGLang's 36 default capture sizes (51 with speculative
    decoding) more kernels to build."""
    assert (len(SGLANG_DEFAULT_BS), len(SGLANG_SPEC_BS)) == (36, 51)
    assert len({batch_class(b) for b in SGLANG_DEFAULT_BS}) == 15
    assert len({batch_class(b) for b in SGLANG_SPEC_BS}) == 15


def _planner(max_bs, sizes=None, server_args=True):
    args = types.SimpleNamespace(cuda_graph_bs=sizes) if server_args else None
    return types.SimpleNamespace(graph_max=(max_bs, max_bs), model_runner=types.SimpleNamespace(server_args=args))


def test_capture_sizes_follow_server_args_up_to_the_maximum():
    """Catches: prebuilding for sizes the graph runner will not capture (past ``init_cuda_graph_state``'s
    maximum), or ignoring ``server_args.cuda_graph_bs``."""
    assert capture_sizes(_planner(64, SGLANG_DEFAULT_BS)) == [b for b in SGLANG_DEFAULT_BS if b <= 64]
    assert capture_sizes(_planner(10, [1, 3, 10, 12])) == [1, 3, 10]


def test_capture_sizes_without_server_args_use_the_ladder():
    """Catches: an engine without ``server_args`` (or without ``cuda_graph_bs``) getting no prebuild, or
    one past its maximum."""
    for planner in (_planner(20, server_args=False), _planner(20, None), _planner(20, [])):
        assert capture_sizes(planner) == [1, 2, 4, 8, 12, 16, 20]
