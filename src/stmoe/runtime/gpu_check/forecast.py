"""A FORECAST of the GPU check's decode table from the simulator's host pipeline
(docs/simulator.md, the runtime pipeline): no GPU, nothing measured
(``benchmarks/gpu_forecast.py`` is its CLI).

Why: the check runs only where a GPU is lent (15 minutes a session, by chance), so what
can be known before it runs is worth knowing: whether a target can be met at all on the
routing it replays, whatever the GPU's speed. The routing's held-out split, the model's
shape and the systems are the check's own (``setup``); the costs are either a grid of
ASSUMED ones (public link figures: 25 GB/s pinned over PCIe Gen4 x16, 50 over Gen5, 7 us a
copy; a GUESSED compute time per MoE layer, x0.5 to x3) or a preset ``stmoe calibrate
--tier gpu`` wrote (the check writes one beside its JSON: gpu_check.calibrated-gpu.toml).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from pathlib import Path

from stmoe.evaluate.compare import closed
from stmoe.predictors import ProfiledTables
from stmoe.runtime.gpu_check.decode import CAPACITIES, SPLIT, SYSTEMS
from stmoe.sim.host.calibrated import hardware_toml
from stmoe.sim.host.systems import HostOptions, simulate_runtime
from stmoe.sim.specs import HardwareSpec, ModelSpec, PredictorCost, SpecError, hardware_preset
from stmoe.trace.schema import RoutingTrace

# of the experts in HBM: the decode table's capacities
SHARES = tuple(float(share.rstrip("%")) / 100 for share in CAPACITIES)
LINKS = (25e9, 50e9)  # pinned host-to-device, PCIe Gen4 x16 and Gen5 (public figures)
COPY_S = 7e-6  # one cudaMemcpyAsync (public figure: 5-7 us)
# GUESSED: one layer's experts call, the rest of a decoder layer, a token outside its
# layers (transformers' eager forward, batch 1), then scaled by SCALES
EXPERTS_S, REST_S, TOKEN_S = 0.4e-3, 0.7e-3, 0.3e-3
SCALES = (0.5, 1.0, 3.0)


def assumed(model: ModelSpec, bw: float, scale: float, share: float, root: Path,
            predictors: dict[str, PredictorCost] | None = None,
            source: str = "") -> HardwareSpec:
    """A preset of ASSUMED GPU costs (a calibrate preset's keys; its source line says
    assumed), written under ``root``; ``predictors``: a predicting system's own host time
    (another preset's ``[host.predictors]``, from ``source``), else none counted."""
    layers = model.layers
    figures = {
        "when": "ASSUMED (stmoe.runtime.gpu_check.forecast)", "machine": "no GPU",
        "num_layers": layers, "top_k": model.top_k, "experts_s": EXPERTS_S * scale * layers,
        "expert_macs": model.expert_macs, "layers_s": (EXPERTS_S + REST_S) * scale * layers,
        "token_s": ((EXPERTS_S + REST_S) * layers + TOKEN_S) * scale, "tier": "gpu",
        "direct_io": False, "store": "none", "num_experts": model.num_experts,
        "expert_bytes": model.expert_bytes, "threads": 1, "bytes_per_s": bw,
        "latency_s": COPY_S, "capacity": round(share * model.num_experts), "workers": 1,
        "chunk_bytes": 4 << 20, "parallel_bytes_per_s": bw,
        "reads_n": {"threads": 2, "blocks": 0}, "tokens": 0, "first_touch_s": 0.0,
        "touch_reads": 0, "populate_s": 0.0, "reads_1": {"blocks": 0},
        "predictors": {name: {**dataclasses.asdict(cost), "how": f"ASSUMED: {source}'s"}
                       for name, cost in (predictors or {}).items()}}
    path = root / f"assumed-{bw:.0e}-{scale}-{share}.toml"
    path.write_text(hardware_toml(figures))
    return hardware_preset(str(path))


def assumed_grid(model: ModelSpec, share: float, root: Path,
                 predictors_from: Path | None = None) -> Iterator[tuple[str, HardwareSpec]]:
    """(label, preset) of every assumed point (with ``predictors_from``, a preset whose
    ``[host.predictors]`` stands for the GPU host's predictor time)."""
    costs = hardware_preset(str(predictors_from)).host if predictors_from else None
    predictors = costs.predictors if costs is not None else {}
    note = f", predictors as {predictors_from.name}" if predictors else ", no predictor time"
    for bw, scale in itertools.product(LINKS, SCALES):
        yield (f"ASSUMED {bw / 1e9:.0f} GB/s, compute x{scale}{note}",
               assumed(model, bw, scale, share, root, predictors, str(predictors_from)))


def forecast(hw: HardwareSpec, model: ModelSpec, tail: RoutingTrace, tables: ProfiledTables,
             share: float, split: tuple[int, ...] | None = None) -> dict[str, float]:
    """Each system's simulated decode tokens/s replaying ``tail``, and ``resident``: the
    GPU-resident model's (the preset's compute with every expert in HBM, no copy); with
    ``split`` (each layer's cache, adding up to ``share``), SPLIT's: stmoe-plus on it."""
    if hw.host is not None and hw.host.tier != "gpu":  # the check's: a pinned host store
        raise SpecError(f"hardware {hw.name!r}: a preset of the {hw.host.tier} tier; the GPU "
                        "check's forecast takes one `stmoe calibrate --tier gpu` wrote")
    sim = simulate_runtime(tail, model, hw, list(SYSTEMS),
                           HostOptions(capacity=round(share * model.num_experts),
                                       tables=tables))
    rates = {s: float(sim["systems"][s]["decode_tokens_per_s"]) for s in SYSTEMS}
    if split is not None:
        on_split = simulate_runtime(tail, model, hw, ["stmoe-plus"],
                                    HostOptions(capacity=split, tables=tables))
        rates[SPLIT] = float(on_split["systems"]["stmoe-plus"]["decode_tokens_per_s"])
    host = hw.host
    assert host is not None  # simulate_runtime refuses a preset without [host]
    expert_s = model.expert_macs / (hw.pe_macs_per_cycle * hw.clock_hz)
    per_token = host.token_s + model.layers * (host.layer_s + model.top_k * expert_s)
    rates["resident"] = 1.0 / per_token
    return rates


def verdicts(rates: dict[str, float]) -> list[tuple[str, float, float]]:
    """The issue's decode targets read off a forecast: (name, value, goal)."""
    def gap(system: str) -> float:
        return closed(1 / rates["lru-only"], 1 / rates[system], 1 / rates["oracle"])

    return [("stmoe-plus / lru-only", rates["stmoe-plus"] / rates["lru-only"], 1.0),
            ("lru-only -> oracle gap closed", gap("stmoe-plus"), 0.5),
            ("the same by stmoe-plus-score", gap("stmoe-plus-score"), 0.5),
            *([("the same by stmoe-plus-split", gap(SPLIT), 0.5)] if SPLIT in rates else []),
            ("stmoe-plus / resident", rates["stmoe-plus"] / rates["resident"], 0.6)]
