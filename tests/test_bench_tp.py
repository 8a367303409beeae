"""``benchmarks/bench_tp.py --smoke`` still runs: on the CPU with 2 host devices (the script sets them up
itself, in a subprocess: this process's device count is fixed), a tiny model's captured decode step at
tp 1 and tp 2, timed, with their logits compared. About 20 s here.

Catches what breaks silently between GPU runs: a ``bench_jax_step`` helper the script imports renamed or
re-signed, ``examples/tp.py``'s sharding API changed, a tp 2 step whose logits differ from tp 1's at the
same step (the script exits 1). The timings themselves mean nothing on the CPU; only their shape is checked.
"""

import math
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_tp_smoke():
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_tp.py"), "--smoke"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, f"bench_tp.py --smoke exited {proc.returncode}:\n{out[-3000:]}\n{proc.stderr[-3000:]}"
    assert "device=cpu x2" in out, out  # 2 host devices, set up by the script
    rows = {m[0]: [float(x) for x in m[1:]] for m in re.findall(
        r"^\| (1|2|tp2 / tp1) \| (\S+) \| (\S+) \| (\S+) \|$", out, flags=re.M)}
    assert set(rows) == {"1", "2", "tp2 / tp1"}, out
    assert all(math.isfinite(x) and x > 0 for row in rows.values() for x in row), out
    m = re.search(r"logits at the same step: max rel diff (\S+), greedy ids equal for (\d+)% of the batch: OK", out)
    assert m and float(m[1]) < 1e-5 and m[2] == "100", out  # float32: the psum's summation order only
    assert "tp2 piped step <= 0.6x tp1" in out
