"""Warm-up progress (``jax_attn.progress``) and ``StepRunner.capture``'s report: a line per bucket (i of
n, elapsed), a bar only on a terminal, the total; buckets compiled in threads replay as eagerly."""

import io

import numpy as np
import pytest

from jax_attn.backend import FlashAttentionBackend
from jax_attn.capture import StepRunner
from jax_attn.progress import Progress
from tests.test_backend import MAX_CTX, attn_step, make_batch, make_pool, make_table, rand_tokens


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_lines_without_a_terminal():
    out, clock = io.StringIO(), FakeClock()
    progress = Progress(3, "capture", stream=out, clock=clock)
    for i, label in enumerate(["DECODE bs=8", "DECODE bs=4", "DECODE bs=1"]):
        clock.t += 1.5
        progress.step(label, f"compile {i}.0s")
    clock.t += 0.5
    assert progress.finish("compile 3.0s") == pytest.approx(5.0)
    assert out.getvalue().splitlines() == [
        "capture 1/3 DECODE bs=8: compile 0.0s [1.5s]",
        "capture 2/3 DECODE bs=4: compile 1.0s [3.0s]",
        "capture 3/3 DECODE bs=1: compile 2.0s [4.5s]",
        "capture: 3 of 3 in 5.0s (compile 3.0s)",
    ]


def test_bar_on_a_terminal():
    out, clock = Tty(), FakeClock()
    with Progress(2, "capture", stream=out, clock=clock) as progress:
        clock.t += 2.0
        progress.step("DECODE bs=8")
        progress.finish()
    text = out.getvalue()
    assert text.startswith("capture [" + "." * 24 + "] 0/2 0.0s")  # drawn before the first bucket ends
    assert "capture [" + "#" * 12 + "." * 12 + "] 1/2 2.0s" in text
    assert "\r\x1b[2K" in text  # the bar is erased before each line
    lines = [ln.split("\x1b[2K")[-1] for ln in text.split("\n") if ln]
    assert lines == ["capture 1/2 DECODE bs=8 [2.0s]", "capture: 1 of 2 in 2.0s"]


def test_unknown_total():
    out, clock = Tty(), FakeClock()  # no bar without a total, even on a terminal
    progress = Progress(None, "bridge capture", stream=out, clock=clock)
    clock.t += 1.0
    progress.step("bs=256")
    progress.finish()
    assert out.getvalue() == "bridge capture 1 bs=256 [1.0s]\nbridge capture: 1 in 1.0s\n"


def test_disabled_reports_nothing():
    out = Tty()
    progress = Progress(2, stream=out, enabled=False)
    progress.step("x")
    assert progress.finish() >= 0 and out.getvalue() == "" and progress.done == 1


@pytest.mark.parametrize("parallel", [True, False])
def test_capture_reports_and_parallel_buckets_replay(parallel, capsys):
    rng = np.random.default_rng(0)
    table, num_slots = make_table(16, 4, seed=1)
    backend = FlashAttentionBackend(table, page_size=4, max_context_len=MAX_CTX, impl="reference")
    runner = StepRunner(backend, attn_step(backend), batch_buckets=(2, 4, 8), compile_cache=False)
    batches = [make_batch("decode", np.arange(1, bs + 1, dtype=np.int32), np.full(bs, 9, np.int32), table, rng)[0]
               for bs in (8, 4, 2)]  # largest first, as SGLang captures
    pool = make_pool(num_slots, table, np.arange(1, 9), np.full(8, 20), rng)
    report = runner.capture(batches, rand_tokens(rng, 8), pool, parallel=parallel)
    err = capsys.readouterr().err.splitlines()
    assert report.buckets == 3 and report.seconds >= report.lower_s > 0 and report.compile_s > 0
    assert sorted(line.split(" DECODE")[0] for line in err[:3]) == ["capture 1/3", "capture 2/3", "capture 3/3"]
    assert err[3].startswith("capture: 3 of 3 in ") and "compile" in err[3]
    assert len(runner.executables) == 3
    for fb in batches:  # every captured bucket replays as the eager path computes
        tok = rand_tokens(rng, fb.num_tokens)
        traces = runner.trace_count
        got, _ = runner.replay(fb, tok, pool)
        assert runner.trace_count == traces
        want, _ = runner.eager(fb, tok, pool)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
