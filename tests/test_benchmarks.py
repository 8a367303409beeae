"""Every benchmark script in benchmarks/ still runs: its ``--smoke`` mode, on the CPU in a subprocess,
exits 0 and prints its table. The GPU measurements themselves are not checked here (the numbers
of a CPU run mean nothing); what breaks silently between GPU runs is caught: an import of a renamed
library name, a changed signature, a helper moved between benchmark modules."""

import math
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_smoke(script: str, tmp_path, *extra: str, timeout: int = 120) -> str:
    """Runs ``benchmarks/<script> --smoke`` on the CPU; returns its stdout (fails on a non-zero exit)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT, OUT=str(tmp_path), PYTHONUNBUFFERED="1")
    env.pop("JAX_ATTN_COMPILE_CACHE_DIR", None)  # bench_compile makes its own cache directories
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--smoke", *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{script} --smoke exited {proc.returncode}:\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-3000:]}")
    return proc.stdout


def header_line(out: str, *words: str) -> str:
    """The first line holding every one of ``words`` (a table's header), or ''."""
    return next((line for line in out.splitlines() if all(w in line for w in words)), "")


def test_bench_attention_smoke(tmp_path):
    """Catches a peers / local / wall mode that no longer runs: an adapter in peers.py or a helper in
    common.py renamed under bench_attention.py, or a jax_attn kernel or backend signature changed
    beneath the peers table, the local-attention comparison or the Triton reference points."""
    out = run_smoke("bench_attention.py", tmp_path)
    assert header_line(out, "case", "peer", "time(us)", "relerr")
    assert header_line(out, "case", "impl", "plain/local", "verdict")  # --mode local
    assert header_line(out, "kind", "ps", "time_us")  # --mode wall
    assert "ours" in out and "skipped on the CPU" in out
    assert "kernels: no CUPTI trace without a CUDA device" in out  # the smoke run takes the --kernels path
    assert os.path.exists(tmp_path / "bench_results.json")


def test_bench_mla_smoke(tmp_path):
    """Catches an absorbed-MLA benchmark that no longer runs or no longer agrees with its float32
    reference: ``attention``'s latent path (``v_cache=None``, ``latent_dim``) or the kernel policy
    changed, ``peers.make_problem`` / ``_ours_metadata`` moved, or ours drifting off the absorbed
    formula (a FAIL row). The SGLang Triton peer needs a GPU: its skip is printed."""
    out = run_smoke("bench_mla.py", tmp_path)
    head = header_line(out, "point", "peer", "TB/s", "TFLOP/s", "ours/peer", "maxerr")
    assert head and "skipped on the CPU: SGLang" in out
    table = out[out.index(head):]
    assert "FAIL" not in table
    # peer, time(us), wall(us), TB/s, TFLOP/s, ours/peer, maxerr, status
    rows = re.findall(r" ours_triton +(\S+) +(\S+) +(\S+) +(\S+) +(\S+) +(\S+) +(\S+)", table)
    assert len(rows) == 2, table  # the decode and the verify point (ours: the kernel auto runs on the CPU)
    for time_us, _, tbps, tflops, _, maxerr, status in rows:
        assert status == "ok" and math.isfinite(float(time_us)) and float(tbps) > 0 and float(tflops) > 0
        assert float(maxerr) <= 2e-2
    assert os.path.exists(tmp_path / "bench_mla.json")


def test_bench_jax_step_smoke(tmp_path):
    """Catches a JAX decode-step benchmark broken by a change to StepRunner / capture internals it
    calls (``_pad_tokens``, ``pack``, ``executables``, ``buffers``), to the example model's
    layouts (``llama.forward_layers``, which the dense baseline runs too), or to the HLO text that
    step_analysis parses; and a ``--mode baseline`` whose two paths stopped agreeing on the logits."""
    out = run_smoke("bench_jax_step.py", tmp_path)
    assert header_line(out, "| variant | leaves | device | replay |")
    assert header_line(out, "| variant | call same | call fresh |")
    assert header_line(out, "| part | host us |")  # --mode replay-parts
    assert header_line(out, "| phase | batch | ctx | ours ms | dense ms | ours/dense tok/s |")  # --mode baseline
    assert "through XLA (implementation=None)" in out  # no cuDNN on the CPU, and the output says so
    rows = re.findall(r"^\| (decode|prefill) \|.* \| (\S+) \|$", out, re.M)  # last column: logits rel err
    assert [phase for phase, _ in rows] == ["decode", "prefill"], out
    assert all(float(err) < 1e-5 for _, err in rows), rows


def test_bench_bridge_smoke(tmp_path):
    """Catches a torch-bridge benchmark broken by a change to torch_bridge's SGLang-facing interface
    (the replay / capture hooks, ModelRunner, the pools) or to its step-executable internals that the
    host-overhead split reads (``runner._step_exes``, ``importer``, ``step.words``)."""
    out = run_smoke("bench_bridge.py", tmp_path)
    assert header_line(out, "## host time per call")
    assert header_line(out, "## decode step")
    assert "ratio step" in out and "######## layer call" in out  # the decode table and the profile part
    grid = header_line(out, "| configuration |", "call, no KV write", "replay hook")  # the hostgrid table
    assert grid and "| tree verify topk 4, page 1" in out and "failed:" not in out


def test_bench_compile_smoke(tmp_path):
    """Catches a compile / warm-up benchmark whose child processes fail (an example's setup or the
    compile cache's API changed, or StepRunner internals the prefill part stages by hand: ``pack``,
    ``_eager_jit``), or whose result line the parent no longer parses. Cold phase only: the warm phase runs
    the same child code again on a filled cache, and a second process reusing the cache's executables is
    tests/test_compile_cache.py's check."""
    out = run_smoke("bench_compile.py", tmp_path, "--parts", "jax,bridge,prefill", "--phases", "cold", timeout=240)
    assert header_line(out, "figure", "cold s", "warm s")
    assert header_line(out, "prompt tokens", "XLA options", "trace / lower / compile s")


def test_tune_smoke(tmp_path):
    """Catches a tuning sweep that no longer runs: a MosaicConfig or KernelConfig field renamed or
    removed under the variant lists, or the schedule planner's signature changed."""
    out = run_smoke("tune.py", tmp_path, timeout=240)  # 22 s alone; 77 s beside another CI worker on 2 cores
    assert header_line(out, "| point | peer | value | / SDPA |")  # mosaic
    assert header_line(out, "point", "config", "TB/s", "relerr", "status")  # triton-decode
    assert os.path.exists(tmp_path / "tune_triton_decode.json")



def test_dense_baseline_matches_paged_step():
    """Catches a dense baseline (``bench_jax_step.py --baseline dense-cudnn``) that computes something other
    than our paged step, which would make its comparison meaningless: a cache write at the wrong position,
    a length mask off by one, a layer's cache mixed up with another's, the prompt padding attended. Same
    weights and KV contents (float32, tiny config), ragged prompts prefilled by both, then a decode step
    by both; in process, on the CPU: the baseline's XLA path (its cuDNN path runs on a GPU only, where the
    mode's table carries the two paths' logits error)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import bench_jax_step

    prefill, decode = bench_jax_step.check_baseline("tiny", prompt_lens=(5, 12, 9), page_size=4)
    assert prefill < 1e-5, f"prefill logits: rel err {prefill:.1e}"
    assert decode < 1e-5, f"decode logits: rel err {decode:.1e}"
