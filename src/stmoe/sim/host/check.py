"""The simulator's runtime pipeline checked against measured runs: the presets it starts
from, the tier's speed the runs met, and per-round medians (``bench_sim_check.py``).

Why in the package: this arithmetic decides whether the simulator is within its
tolerance of the runtime; it is tested here, and the benchmark script only runs it.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from stmoe.errors import StmoeError

CALIBRATED = Path("/tmp/stmoe-calibrated.toml")  # where the check's --calibrate writes


class CheckError(StmoeError):
    """The measured runs or presets cannot be checked (missing figures, no preset)."""


def base_preset(hardware: Path | None, calibrate: bool, presets: list[str]) -> tuple[Path, bool]:
    """The preset the check starts from, and whether it is one apart from the benchmark's
    per-round presets: ``--hardware``, else with ``--calibrate`` the default path it is
    written to, else the benchmark's first round's preset; a clear error with none."""
    if hardware is not None:
        return hardware, True
    if calibrate:
        return CALIBRATED, True
    if presets:
        return Path(presets[0]), False
    raise CheckError("no hardware preset: give --hardware FILE, --calibrate, or a benchmark "
                     "JSON from a run with --calibrate")


def run_read_s(runs: dict[str, list[dict[str, Any]]]) -> tuple[float, int]:
    """The mean time of one expert read by the compute thread alone (its misses, the
    workers idle) over the on-demand and LRU-only runs' decode, and how many reads."""
    rs = [r for name in ("on-demand", "lru-only") for r in runs.get(name, [])]
    if not rs or any("demand_reads" not in r for r in rs):
        raise CheckError("--tier-from-runs: the measured on-demand and lru-only runs carry no "
                         "read times (measured before the runtime timed its reads); run the "
                         "benchmark again")
    reads = sum(r["demand_reads"] for r in rs)
    if not reads:
        raise CheckError("--tier-from-runs: the on-demand and lru-only runs read no expert "
                         "during decode; nothing to time the tier by")
    return sum(r["demand_read_s"] for r in rs) / reads, reads


def with_read_s(hw: Any, model: Any, read_s: float) -> Any:
    """``hw`` with its single reader's speed set so one expert reads in ``read_s`` (its
    latency kept), the parallel readers' speed in the same proportion as before."""
    from stmoe.sim.host.systems import host_costs

    if read_s <= hw.link_latency_s:
        raise CheckError(f"--tier-from-runs: the runs read an expert in {read_s * 1e3:.3f} ms, "
                         f"no more than the preset's latency alone "
                         f"({hw.link_latency_s * 1e3:.3f} ms)")
    before = host_costs(model, hw)
    bandwidth = model.expert_bytes / (read_s - hw.link_latency_s)
    parallel_bps = before.parallel * model.expert_bytes / read_s
    host = dataclasses.replace(hw.host, read_parallel_bytes_per_s=parallel_bps)
    return dataclasses.replace(hw, link_bytes_per_s=bandwidth, host=host)


def per_round(simulate: Callable[[str], dict[str, Any]], presets: list[str],
              systems: Sequence[str]) -> dict[str, Any]:
    """Each round simulated with the preset calibrate measured in that round
    (``simulate(preset)``); per system the medians over the rounds, as one simulation's
    figures."""
    sims = [simulate(p) for p in presets]
    figures = ("decode_tokens_per_s", "hit_rate", "stall_share", "bytes_moved")
    merged = {name: {k: statistics.median(s["systems"][name][k] for s in sims) for k in figures}
              for name in systems}
    return {**sims[0], "systems": merged,
            "hardware": f"calibrate's preset of each of {len(presets)} rounds"}
