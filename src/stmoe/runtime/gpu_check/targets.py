"""The GPU check's targets (issue 43's, and the check's own), read off the stages' records
as ``{name, met, value, goal}``: MET, NOT MET, or no figure (a stage that did not run, or a
dry run, which claims nothing).
"""

from __future__ import annotations

from typing import Any

from stmoe.evaluate.compare import closed
from stmoe.runtime.gpu_check.decode import SPLIT
from stmoe.runtime.gpu_check.record import MIB, Check

AT = ("gpu", "50%")  # where issue 43's targets are read: pinned memory, half the experts


def targets(c: Check) -> None:
    """Every target, in the order the issue lists them after the check's own."""
    st = c.doc["stages"]
    _environment_targets(c, st)
    runs = {(r["tier"], r["capacity"], r["system"]): r
            for r in st.get("decode_table", {}).get("runs", []) if "decode_tok_s" in r}
    speed = {k[2]: r["decode_tok_s"] for k, r in runs.items() if k[:2] == AT}
    _identity(c, st)
    plus, lru, oracle = speed.get("stmoe-plus"), speed.get("lru-only"), speed.get("oracle")
    _ratio(c, "50% in HBM from pinned: stmoe-plus vs lru-only decode", plus, lru, 1.0)
    _gap(c, "stmoe-plus", plus, lru, oracle)
    _gap(c, "stmoe-plus-score (score eviction, the check's own)", speed.get("stmoe-plus-score"),
         lru, oracle)
    _gap(c, "stmoe-plus-split (each layer's cache its own size, the check's own)",
         speed.get(SPLIT), lru, oracle)
    acc = st.get("accelerate_offload", {}).get("decode_tok_s")
    _ratio(c, "stmoe-plus vs accelerate's offload decode (50% of the experts in HBM)", plus,
           acc, 5.0)
    peak = st.get("h2d", {}).get("pinned_peak_GBps")
    ondemand = runs.get((*AT, "on-demand"), {}).get("copy_GBps")
    _ratio(c, "on-demand's achieved copy bandwidth vs the measured pinned peak", ondemand,
           peak, 0.7)
    _ratio(c, "stmoe-plus vs the GPU-resident model's decode", plus,
           st.get("decode_table", {}).get("resident", {}).get("decode_tok_s"), 0.6)
    rows = [r for r in st.get("calibrate_simulator", {}).get("systems", [])
            if r.get("measured_over_simulated")]
    worst = max((abs(r["measured_over_simulated"] - 1) for r in rows), default=None)
    c.target("the simulator calibrated on the GPU vs every measured system (decode)",
             None if worst is None else worst <= 0.2,
             None if worst is None else f"worst {worst:.1%} off ({len(rows)} systems)",
             "within 20%")


def _gap(c: Check, system: str, it: float | None, lru: float | None,
         oracle: float | None) -> None:
    gap = closed(1 / lru, 1 / it, 1 / oracle) if it and lru and oracle else None
    c.target(f"50% in HBM from pinned: share of the lru-only -> oracle gap {system} closes",
             None if gap is None or gap != gap else gap >= 0.5,
             None if gap is None else round(gap, 3), ">= 50% on held-out routing",
             "" if gap is None or gap == gap else "no gap: the oracle is not faster")


def _ratio(c: Check, name: str, a: float | None, b: float | None, goal: float) -> None:
    value = round(a / b, 3) if a and b else None
    c.target(name, None if value is None else value >= goal, value, f">= {goal:g}x")


def _identity(c: Check, st: dict[str, Any]) -> None:
    """Bit-identity: every decode-table run's tokens the GPU-resident model's (bf16, every
    predictor), and the cuda-marked tests (every family, int8 and int4)."""
    runs = [r for r in st.get("decode_table", {}).get("runs", []) if "skipped" not in r]
    same = [r.get("identical") is True for r in runs]
    tests = st.get("cuda_tests", {})
    passed = _passed(tests)
    met = None if not runs or passed is None else all(same) and passed
    c.target("bit-identical to the GPU-resident model in the same format, every family, "
             "every predictor, bf16 and int4", met,
             f"{sum(same)} of {len(same)} decode-table runs; cuda tests: "
             f"{tests.get('summary') or 'not run'}" if runs else None, "all identical")


def _environment_targets(c: Check, st: dict[str, Any]) -> None:
    h = st.get("h2d", {})
    if h.get("status") == "ok":
        big = [r for r in h["sizes"] if r["bytes"] >= 64 * MIB] or h["sizes"][-1:]
        name = "the pinned store's registered mapping copies as fast as torch's pinned memory "\
               "(>= 64 MiB)"
        refused = next((r["registered_error"] for r in big if "registered_error" in r), None)
        if refused:  # the stores were then allocated locked (host_lock): nothing to compare
            c.target(name, None, f"registering refused: {refused}", ">= 0.9x")
        else:
            ratio = min(r["registered_GBps"] / r["pinned_GBps"] for r in big)
            c.target(name, ratio >= 0.9, round(ratio, 3), ">= 0.9x")
    k = st.get("kernels", {})
    for fmt in ("int8", "int4"):
        errs = [v["rel_err"] for key, v in k.get("results", {}).items() if f"_{fmt}" in key]
        c.target(f"CUDA {fmt} weight-only kernel on the stored layout computes the "
                 "dequantized matrix (max error / max value)",
                 (max(errs) <= 0.02) if errs else None, max(errs) if errs else None, "<= 0.02")
    t = st.get("cuda_tests", {})
    c.target("the cuda-marked tests pass", _passed(t), t.get("summary"), "all pass")
    runs = st.get("tier_gpu", {}).get("runs", [])
    same = [r["identical"] for r in runs]
    c.target("--tier gpu: greedy tokens identical to the GPU-resident shipped model",
             all(x is True for x in same) if same else None,
             f"{sum(x is True for x in same)} of {len(same)} runs" if same else None,
             "all identical")


def _passed(tests: dict[str, Any]) -> bool | None:
    """The cuda-marked tests' verdict: None where they did not run or did not finish, or
    where none of them passed (all skipped: nothing was tested), or where the GPU refused
    their process (``judged`` False)."""
    code = tests.get("returncode") if tests.get("ran") and tests.get("judged", True) else None
    if code is None:
        return None
    return None if code == 0 and " passed" not in str(tests.get("summary")) else code == 0


def target_lines(doc: dict[str, Any]) -> list[str]:
    """One line per target: MET, NOT MET or n/a (a dry run's, or a figure not measured)."""
    marks = {True: "MET", False: "NOT MET", None: "n/a"}
    return [f"{marks[t['met']]:8} {t['name']}: {t['value']} (goal {t['goal']})"
            for t in doc["targets"]]
