"""The simulator checked against the runtime: simulated against measured decode time.

Takes bench_offload_real.py's JSON (``--measured``: every run's figures per tier
and system) and a hardware preset of this machine from ``stmoe calibrate``
(``--hardware``, or ``--calibrate`` to measure it now on the benchmark's own
checkpoint and store, about 30 s), simulates the same systems on the same trace
cut to the same layers and decode tokens with ``stmoe simulate --pipeline
runtime``'s model (``stmoe.sim.host.systems``), and prints per system the
simulated and measured decode tokens/s, their ratio and MET / NOT MET (within
20%), with the hit rate, stall share and bytes moved beside, so a disagreement
can be traced. Writes the figure docs/figures/sim_vs_measured.png.

    python benchmarks/bench_sim_check.py --measured /tmp/bench_real2.json \\
        [--hardware hw.toml | --calibrate [--hardware hw.toml]] [--tier-from-runs]
        [--layers N] [--tokens N]   (default: the benchmark's, from its JSON)

Without --hardware or --calibrate, the JSON must come from a benchmark run with
--calibrate: its presets, one per round, are the check (and the first the base
of --tier-from-runs).

A virtual disk's speed drifts over minutes (0.4 to 1.8 GB/s on this machine), so
a preset measured at another time than the benchmark predicts another disk.
``--tier-from-runs`` checks the model apart from that drift: the tier's speed
is the one the benchmark's runs met (the compute thread's reads of its misses
in the on-demand and LRU-only runs, which the runtime times; those systems
have no prefetch, so nothing else reads meanwhile), every other figure
calibrate's (the parallel readers' speed kept in calibrate's proportion to one
reader's). Both checks are printed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from stmoe.evaluate.systems import HEADLINE_SYSTEMS
from stmoe.sim.host.check import (
    CALIBRATED,
    CheckError,
    base_preset,
    per_round,
    run_read_s,
    with_read_s,
)

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"
SAMPLE = SHARED / "qwen3.6-35b-a3b_chat-1prompt.npz"
PRESET = "qwen3.6-35b-a3b"
SYSTEMS = HEADLINE_SYSTEMS  # on-demand, lru-only, stmoe, stmoe-plus, oracle
TOLERANCE = 0.2
FIGURE = Path(__file__).resolve().parents[1] / "docs" / "figures" / "sim_vs_measured.png"


def bench_setup(path: Path, layers: int, tokens: int) -> argparse.Namespace:
    """The benchmark's model shape, routing and tables as its JSON records them
    (``setup``; an older JSON: the shared sample, its first layers, in-sample tables),
    in bench_offload_real.py's arguments."""
    import bench_offload_real as real

    setup = json.loads(path.read_text()).get("setup") or {}
    args = argparse.Namespace(
        like=setup.get("like", PRESET), trace=Path(setup.get("trace", SAMPLE)),
        layers=setup.get("layers", str(layers)), profile_on=setup.get("profile_on", ""),
        split_at=setup.get("split_at", 0), split_prompt=setup.get("split_prompt", 8),
        held_out=setup.get("held_out", False), in_sample=not setup.get("held_out", False))
    real.set_layers(args)
    if layers and layers != args.layers:  # --layers: the first N of the benchmark's cut
        args.layers, args.cut = layers, (str(layers) if ":" not in args.cut
                                         else f"{args.cut_start}:{args.cut_start + layers}")
    args.tokens = tokens
    return args


def bench_paths(setup: argparse.Namespace) -> tuple[Path, Path, Path]:
    """(checkpoint, store, tables) of the benchmark (bench_offload_real.py's, built once):
    what ``--calibrate`` measures on."""
    import bench_offload_real as real

    return real.prepare(setup)


def routing(setup: argparse.Namespace) -> Any:
    """The routing the benchmark replayed: its layers cut, from ``--split-at`` if given."""
    import bench_offload_real as real

    from stmoe.trace import load_trace
    from stmoe.trace.select import select_layers

    trace = select_layers(load_trace(setup.trace), setup.cut)
    return real.split_routing(setup, trace)[1] if setup.split_at else trace


def measured_runs(path: Path, tier: str) -> tuple[dict[str, list[dict[str, Any]]], dict[str, Any]]:
    """The benchmark's runs of ``tier`` per system, and that tier's record (its MoE layers
    and new tokens per replay, where the benchmark wrote them)."""
    data = json.loads(path.read_text())
    if tier not in data or "runs" not in data[tier]:
        raise SystemExit(f"{path}: no runs of tier {tier!r} (tiers: {', '.join(data)})")
    return data[tier]["runs"], data[tier]


def simulated(args: argparse.Namespace, read_s: float | None = None,
              hardware: str | None = None) -> dict[str, Any]:
    from stmoe.sim.host.systems import HostOptions, simulate_runtime
    from stmoe.sim.specs import hardware_preset, model_preset

    setup = args.setup
    model = dataclasses.replace(model_preset(setup.like), layers=setup.layers)
    hw = hardware_preset(hardware or str(args.hardware))
    if read_s is not None:
        hw = with_read_s(hw, model, read_s)
    share = float(args.capacity.rstrip("%")) / 100
    options = HostOptions(capacity=round(share * model.num_experts),
                          decode_tokens=args.tokens - 1, tables=args.tables)
    return simulate_runtime(args.routing, model, hw, args.systems, options)


def compare(sim: dict[str, Any], runs: dict[str, list[dict[str, Any]]],
            label: str) -> list[dict[str, Any]]:
    """Per system, simulated against measured (printed as a table under ``label``)."""
    rows = []
    print(f"\n{label} ({sim['hardware']})")
    print(
        f"{'system':14} {'sim tok/s':>9} {'measured tok/s':>22} {'time ratio':>10} "
        f"{'x lru sim/meas':>15} {'hit sim/meas':>13} {'stall sim/meas':>15} "
        f"{'moved GiB sim/meas':>19}  within 20%"
    )
    lru_sim = sim["systems"]["lru-only"]["decode_tokens_per_s"]
    lru_meas = statistics.median(r["decode_tokens_per_s"] for r in runs["lru-only"])
    for name in sim["systems"]:
        s, rs = sim["systems"][name], runs[name]
        speeds = [r["decode_tokens_per_s"] for r in rs]
        med = {k: statistics.median(r[k] for r in rs) for k in ("hit_rate", "stall_share",
                                                                  "bytes_moved")}
        m = statistics.median(speeds)
        ratio = m / s["decode_tokens_per_s"]  # simulated time over measured time
        ok = abs(ratio - 1) <= TOLERANCE
        x_sim, x_meas = s["decode_tokens_per_s"] / lru_sim, m / lru_meas  # x lru-only
        rows.append({"system": name, "simulated": s["decode_tokens_per_s"], "measured": m,
                     "x_lru_simulated": x_sim, "x_lru_measured": x_meas,
                     "range": [min(speeds), max(speeds)], "time_ratio": ratio, "met": ok,
                     "sim": {k: s[k] for k in ("hit_rate", "stall_share", "bytes_moved")},
                     "measured_median": med})
        print(f"{name:14} {s['decode_tokens_per_s']:9.2f} {m:8.2f} [{min(speeds):5.2f}, "
              f"{max(speeds):5.2f}] {ratio:10.2f} {x_sim:7.2f}/{x_meas:.2f} "
              f"{s['hit_rate']:6.3f}/{med['hit_rate']:.3f} "
              f"{s['stall_share']:7.2f}/{med['stall_share']:.2f} "
              f"{s['bytes_moved'] / 2**30:9.2f}/{med['bytes_moved'] / 2**30:.2f}  "
              f"{'MET' if ok else 'NOT MET'}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--measured", type=Path, required=True, help="bench_offload_real.py --json")
    ap.add_argument("--hardware", type=Path,
                    help=f"a preset from stmoe calibrate (with --calibrate: written there; "
                    f"default {CALIBRATED})")
    ap.add_argument("--calibrate", action="store_true", help="run stmoe calibrate first")
    ap.add_argument("--seconds", default="4", help="calibrate's reading time per measurement")
    ap.add_argument("--tier", default="disk")
    ap.add_argument("--layers", type=int, default=0,
                    help="MoE layers measured (default: the benchmark's, else 8)")
    ap.add_argument("--tokens", type=int, default=0,
                    help="new tokens per replay (default: the benchmark's, else 64)")
    ap.add_argument("--capacity", default="50%")
    ap.add_argument("--figure", type=Path, default=FIGURE)
    ap.add_argument("--json", type=Path, help="write the comparison here")
    ap.add_argument("--tier-from-runs", action="store_true",
                    help="also simulate with the tier's speed the measured runs met")
    args = ap.parse_args()
    runs, record = measured_runs(args.measured, args.tier)
    args.layers = args.layers or record.get("layers") or 8
    args.tokens = args.tokens or record.get("tokens") or 64
    args.setup = bench_setup(args.measured, args.layers, args.tokens)
    import bench_offload_real as real

    from stmoe.predictors import load_tables

    # read once for every simulation: the routing replayed and the benchmark's tables
    # (profiled here if its folder lacks them; no checkpoint is built for them)
    args.routing, args.tables = routing(args.setup), load_tables(real.tables_for(args.setup))
    # the systems measured, the benchmark's admission-off variants (-all) included
    args.systems = [s for s in runs if s in SYSTEMS or s.endswith("-all")]
    presets = record.get("presets") or []
    if presets and len(presets) != len(runs["oracle"]):
        raise SystemExit(f"{args.measured}: {len(presets)} presets for "
                         f"{len(runs['oracle'])} rounds")
    args.hardware, separate = base_preset(args.hardware, args.calibrate, presets)
    if args.calibrate:
        model, store, _ = bench_paths(args.setup)
        subprocess.run([sys.executable, "-m", "stmoe", "calibrate", "--model", str(model),
                        "--store", str(store), "--tier", args.tier, "--capacity", args.capacity,
                        "--seconds", args.seconds, "--routing", str(args.setup.trace),
                        "-o", str(args.hardware)],
                       check=True)
    sims: dict[str, dict[str, Any]] = {}
    labels: dict[str, str] = {}
    if separate:
        sims["preset"] = simulated(args)
        labels["preset"] = "calibrate's preset, as written"
    if presets:
        sims["per_round"] = per_round(lambda p: simulated(args, hardware=p), presets,
                                      args.systems)
        labels["per_round"] = "calibrate's preset of each round (the benchmark's --calibrate)"
    read: dict[str, float] = {}
    if args.tier_from_runs:
        read_s, reads = run_read_s(runs)
        read = {"read_s": read_s, "reads": reads}
        sims["tier_from_runs"] = simulated(args, read_s)
        base = "round 1's preset" if not separate else args.hardware.stem
        labels["tier_from_runs"] = (f"the tier's speed the runs met ({read_s * 1e3:.2f} ms a "
                                    f"read, {reads} reads), the rest {base}'s")
    checks = {key: compare(sim, runs, labels[key]) for key, sim in sims.items()}
    for key, rows in checks.items():
        print(f"{labels[key]}: {sum(r['met'] for r in rows)} of {len(rows)} within "
              f"{TOLERANCE:.0%}")
    sim = next(iter(sims.values()))
    c = sim["costs"]
    print(f"host costs of the first check ({sim['hardware']}; round 1's where per round): "
          f"layer {c['layer_s'] * 1e3:.2f} ms, token {c['token_s'] * 1e3:.2f} ms, "
          f"expert {c['expert_s'] * 1e3:.3f} ms, read {c['read_s'] * 1e3:.2f} ms, parallel x"
          f"{c['parallel']:.2f}, first touch {c['first_touch_s'] * 1e3:.2f} ms")
    from stmoe.sim.specs import model_preset

    top_k = model_preset(args.setup.like).top_k
    compute = c["token_s"] + args.layers * (c["layer_s"] + top_k * c["expert_s"])
    cached = json.loads(args.measured.read_text()).get("all_cached", {}).get("stmoe")
    if cached:  # the benchmark's own compute-only run, against calibrate's
        speed = statistics.median(r["decode_tokens_per_s"] for r in cached)
        print(f"compute per token: calibrated {compute * 1e3:.1f} ms; the benchmark's "
              f"every-expert-cached run {1e3 / speed:.1f} ms")
    from stmoe.sim.host.check_plot import sim_vs_measured

    setup = args.setup
    title = (f"{setup.like}, layers {setup.cut}, {args.tokens} new tokens, {args.capacity} "
             f"cached, tier {args.tier}, "
             f"{'HELD-OUT' if setup.held_out else 'IN-SAMPLE'} tables\n{sim['hardware']}")
    sim_vs_measured({labels[k]: rows for k, rows in checks.items()}, title, args.figure,
                    TOLERANCE)
    print(f"wrote {args.figure}")
    if args.json:
        from stmoe.util.fileio import atomic_write_text

        out = {key: {"label": labels[key], "rows": checks[key], "simulation": sims[key],
                     **(read if key == "tier_from_runs" else {})} for key in sims}
        atomic_write_text(args.json, json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    try:
        main()
    except CheckError as exc:
        raise SystemExit(f"error: {exc}") from None
