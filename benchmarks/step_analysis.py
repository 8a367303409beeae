"""What a captured step does on the device, from text: its optimized HLO (what it copies, slices and
launches) and a CUPTI timeline of its steps (where the GPU waits). Pure Python over strings and trace
events, used by ``bench_jax_step.py`` (``--mode host`` and ``--mode timeline``) and tests."""

from __future__ import annotations

import collections
import math
import re
import statistics

# ---- optimized HLO: what a step copies, slices and launches ------------------------------------
_COMPUTATION = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPERAND = re.compile(r"\s*(?:\w+\[[^\]]*\](?:\{[^}]*\})?\s+)?%?([\w.\-]+)")  # first operand's name
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([\d,]*)\]")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4,
                "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_LAUNCH_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
                "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id"}
_DATA_MOVERS = {"copy", "slice", "dynamic-slice", "transpose"}


def _instruction(rest: str):
    """``'(f32[2], s32[]) tuple(%a, %b)'`` -> (output bytes, opcode, operand text)."""
    if rest.startswith("("):
        depth = 0
        for end, ch in enumerate(rest):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                break
        type_text, tail = rest[:end + 1], rest[end + 1:].lstrip()
    else:
        type_text, _, tail = rest.partition(" ")
    opcode, _, operands = tail.partition("(")
    nbytes = sum(math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES.get(dt, 1 if dt.startswith("f8") else 4)
                 for dt, dims in _ARRAY.findall(type_text))
    return nbytes, opcode.strip(), operands


def parse_hlo(text: str) -> dict:
    """``{computation: dict(entry, insts=[(name, bytes, opcode, operands)], root)}`` of an HLO module."""
    comps, cur = {}, None
    for line in text.splitlines():
        if cur is None:
            m = _COMPUTATION.match(line)
            if m:
                cur = comps.setdefault(m.group(2), dict(entry=bool(m.group(1)), insts=[], root=None))
        elif line.strip() == "}":
            cur = None
        elif m := _INSTRUCTION.match(line):
            inst = (m.group(2), *_instruction(m.group(3)))
            cur["insts"].append(inst)
            cur["root"] = inst if m.group(1) else cur["root"]
    return comps


def _callee(operands: str, attr: str):
    m = re.search(attr + r"=%?([\w.\-]+)", operands)
    return m.group(1) if m else None


def _root_opcode(comp) -> str:
    """Opcode of a fused computation's root, looking through bitcasts and reshapes."""
    if comp is None:
        return ""
    by_name, inst = {i[0]: i for i in comp["insts"]}, comp["root"]
    while inst is not None and inst[2] in ("bitcast", "reshape"):
        m = _OPERAND.match(inst[3])
        inst = by_name.get(m.group(1)) if m else None
    return "" if inst is None else inst[2]


def hlo_counts(text: str) -> dict:
    """copy / slice / dynamic_slice instructions anywhere; kernels rooted in a slice; MB written by
    kernels that only move data (total and largest); command buffers in the HLO and kernels launched outside
    them (an XLA that forms command buffers from thunks, as jax 0.11.2's does, shows none here)."""
    comps = parse_hlo(text)
    fused, graphs, loops = set(), set(), set()
    for comp in comps.values():
        for _, _, opcode, operands in comp["insts"]:
            if opcode == "fusion":
                fused.add(_callee(operands, "calls"))
            elif opcode == "call" and "command_buffer" in (_callee(operands, "to_apply") or ""):
                graphs.add(_callee(operands, "to_apply"))
            elif opcode == "while":
                loops.update(filter(None, (_callee(operands, "body"), _callee(operands, "condition"))))
    out = dict(copy=0, slice=0, dynamic_slice=0, slice_fusions=0, moved_mb=0.0, largest_mb=0.0, graphs=len(graphs),
               loose=0)
    for name, comp in comps.items():
        for _, nbytes, opcode, operands in comp["insts"]:
            if opcode in ("copy", "slice", "dynamic-slice"):
                out[opcode.replace("-", "_")] += 1
            if name in fused:
                continue
            root = _root_opcode(comps.get(_callee(operands, "calls"))) if opcode == "fusion" else opcode
            out["slice_fusions"] += opcode == "fusion" and root in ("slice", "dynamic-slice")
            if root in _DATA_MOVERS:
                out["moved_mb"] += nbytes / 1e6
                out["largest_mb"] = max(out["largest_mb"], nbytes / 1e6)
            out["loose"] += (comp["entry"] or name in loops) and opcode not in _LAUNCH_FREE
    return out


# ---- CUPTI timeline of steps (Chrome-trace events from torch.profiler) ---------------------------
_GPU = ("kernel", "gpu_memcpy", "gpu_memset")
_API = ("cuda_runtime", "cuda_driver")


def analyze_window(events: list, steps: int, top: int = 8) -> dict:
    """Per step: GPU span, busy and idle time, activities by kind; the largest idle gaps."""
    gpu = sorted((e["ts"], e["ts"] + e["dur"], e.get("name", ""), e.get("cat")) for e in events
                 if e.get("cat") in _GPU and "dur" in e)
    busy = _union_us([(a, b) for a, b, _, _ in gpu])
    span = max(b for _, b, _, _ in gpu) - gpu[0][0]
    gaps = _idle_gaps(gpu)
    kinds = collections.Counter(cat for _, _, _, cat in gpu)
    kind_us = collections.Counter()
    for a, b, _, cat in gpu:
        kind_us[cat] += b - a
    return dict(span=span / steps, busy=busy / steps, idle=(span - busy) / steps,
                kinds={k: (kinds[k] / steps, kind_us[k] / steps) for k in kinds},
                gaps=sorted(gaps, reverse=True)[:top], gaps_over_5us=sum(g for g, _, _ in gaps if g > 5) / steps)


def print_window(name: str, rep: dict) -> None:
    print(f"\n### {name} (per step, us)\n")
    print(f"GPU span {rep['span']:.0f}, busy {rep['busy']:.0f}, idle {rep['idle']:.0f} "
          f"(in gaps over 5 us: {rep['gaps_over_5us']:.0f})")
    print("activities: " + ", ".join(f"{k} {n:.1f} ({us:.0f} us)" for k, (n, us) in sorted(rep["kinds"].items())))
    print("largest idle gaps (us, after -> before):")
    for us, prev, nxt in rep["gaps"]:
        print(f"  {us:8.1f}  {prev[:60]} -> {nxt[:60]}")


def _idle_gaps(acts) -> list:
    """``(gap us, activity before, activity after)`` for each stretch of time covered by none of
    ``acts`` (sorted ``(start, end, name, ...)``) between the first and the last."""
    gaps, end, prev = [], acts[0][1], acts[0][2]
    for a, b, name, *_ in acts[1:]:
        if a > end:
            gaps.append((a - end, prev, name))
        if b > end:
            end, prev = b, name
    return gaps


def _union_us(spans) -> float:
    total, end = 0.0, -1e30
    for s, e in sorted(spans):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def analyze(events: list, top: int = 8) -> dict:
    """Per-step medians of the timeline parts, the largest gaps and API host time per step."""
    marks = {n: sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == n and "dur" in e)
             for n in ("step", "call")}
    gpu = sorted((e["ts"], e["ts"] + e["dur"], e.get("name", "")) for e in events
                 if e.get("cat") in _GPU and "dur" in e)
    api = [(e["ts"], e["dur"], e.get("name", "")) for e in events if e.get("cat") in _API and "dur" in e]
    rows, gaps, api_us = [], [], collections.Counter()
    for s0, s1 in marks["step"]:
        c1 = next((c for b, c in marks["call"] if s0 <= b < s1), s0)
        acts = [a for a in gpu if s0 <= a[0] < s1]
        if not acts:
            continue
        busy = _union_us([(a, b) for a, b, _ in acts])
        g0, g1 = acts[0][0], max(a[1] for a in acts)
        rows.append(dict(wall=s1 - s0, call=c1 - s0, first=g0 - s0, busy=busy, idle=(g1 - g0) - busy,
                         tail=s1 - g1, acts=len(acts)))
        gaps += _idle_gaps(acts)
        for t, d, name in api:
            if s0 <= t < s1:
                api_us[name] += d
    n = max(1, len(rows))
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]} if rows else {}
    return dict(steps=len(rows), median=med, gaps=sorted(gaps, reverse=True)[:top],
                api=[(name, us / n) for name, us in api_us.most_common(top)])


def print_report(name: str, rep: dict) -> None:
    m = rep["median"]
    print(f"\n### {name}: {rep['steps']} blocking steps (median us)\n")
    print("| wall | call returns | host to first GPU work | GPU busy | GPU idle inside | tail | activities |")
    print("|---|---|---|---|---|---|---|")
    print("| " + " | ".join(f"{m[k]:.0f}" for k in ("wall", "call", "first", "busy", "idle", "tail", "acts")) + " |")
    print("\nlargest idle gaps (us, after -> before):")
    for us, prev, nxt in rep["gaps"]:
        print(f"  {us:8.1f}  {prev[:60]} -> {nxt[:60]}")
    print("\nCUDA API host time per step (us):")
    for api_name, us in rep["api"]:
        print(f"  {us:8.1f}  {api_name}")
