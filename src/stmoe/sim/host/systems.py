"""The runtime's compared systems on the host pipeline (``stmoe simulate --pipeline runtime``).

The same systems ``stmoe.evaluate.systems`` (and benchmarks/bench_offload_real.py)
run for real, each a predictor and a cache policy: ``on-demand`` (no prefetch, no
reuse), ``lru-only``, ``stmoe``, ``stmoe-plus`` (1.5K experts per layer) and the
``oracle``; any other replay predictor name runs with an LRU cache. Each
system's prefetch sets are its predictor's ``plan`` over the sequence (the
protocol the runtime drives, in the same order); the oracle's are the routed
experts. ``host.simulate_host`` times them on a ``stmoe calibrate`` preset, with
the runtime's prefetch admission as the runtime has it by default; a system named
``NAME-all`` (``stmoe-all``, ``stmoe-plus-all``) is NAME with admission off, every
predicted load made (the runtime's ``admission=False``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from stmoe.admission import link_of
from stmoe.evaluate.systems import OFFLOAD_SYSTEMS, compared_predictor
from stmoe.predictors import REGISTRY, ModelShape, ProfiledTables, make
from stmoe.sim.host.inputs import host_capacities
from stmoe.sim.host.pipeline import HostCosts, HostRun, simulate_host
from stmoe.sim.specs import HardwareSpec, ModelSpec, SpecError
from stmoe.trace.schema import RoutingTrace
from stmoe.trace.select import select_sequences

# the runtime's compared systems but hybrid (its gate lookahead reads the model's routers)
RUNTIME_SYSTEMS = {k: v for k, v in OFFLOAD_SYSTEMS.items() if k != "hybrid"}


@dataclasses.dataclass(frozen=True)
class HostOptions:
    """What one replay of the runtime is: cache, sequence, tokens, tables."""

    capacity: int | tuple[int, ...]  # experts cached per layer: alike, or each layer's
    sequence: int = 0  # the trace's sequence replayed
    decode_tokens: int | None = None  # decode forward calls timed (None: all the sequence's)
    tables: ProfiledTables | None = None
    admission: bool = True  # the runtime's default (a system named NAME-all: off)


MAX_COST_S = 1e6  # one read, expert or layer of no real machine takes 11 days


def host_costs(model: ModelSpec, hw: HardwareSpec) -> HostCosts:
    """The host pipeline's seconds from a hardware spec with a ``[host]`` table."""
    host = hw.host
    if host is None:
        raise SpecError(f"hardware {hw.name!r} has no [host] table: the runtime pipeline needs "
                        "this machine measured; write one with `stmoe calibrate`")
    flows = hw.dataflows
    flow = (max(flows.values(), key=lambda d: d.utilisation(1)) if hw.dataflow not in flows
            else flows[hw.dataflow])
    rate = hw.pe_macs_per_cycle * hw.clock_hz * flow.utilisation(1)
    read_s = hw.link_latency_s + model.expert_bytes / hw.link_bytes_per_s
    serial, free_waste = link_of(host.tier)  # the runtime's own rule (stmoe.admission)
    parallel_s = model.expert_bytes / host.read_parallel_bytes_per_s  # with all readers
    parallel = read_s / parallel_s
    chunks = max(1, math.ceil(model.expert_bytes / host.chunk_bytes))
    expert_s = model.expert_macs / rate if rate > 0 else math.inf
    # finite figures whose quotients are out of any real range: the pipeline's sums overflow
    if not max(read_s, parallel_s, expert_s, host.layer_s, host.token_s,
               host.first_touch_s) < MAX_COST_S:
        raise SpecError(f"hardware {hw.name!r}: with model {model.name!r} an expert takes "
                        f"{read_s:g} s to read ({parallel_s:g} s at "
                        f"read_parallel_bytes_per_s), {expert_s:g} s to compute (layer_s "
                        f"{host.layer_s:g}, token_s {host.token_s:g}, first_touch_s "
                        f"{host.first_touch_s:g}); expected each under {MAX_COST_S:g} s")
    return HostCosts(layer_s=host.layer_s, token_s=host.token_s, expert_s=expert_s, read_s=read_s,
                     # paid by a read into a spare row only (slots are faulted in already)
                     first_touch_s=host.first_touch_s,
                     parallel=parallel, workers=host.workers,
                     # one serial link: the emulated one, or a GPU's one copy engine
                     fifo=serial, free_waste=free_waste, chunks=chunks,
                     # every piece pays the latency (a preadv, a link transfer, of its own)
                     chunk_s=hw.link_latency_s
                     + model.expert_bytes / chunks / hw.link_bytes_per_s)


def predictor_costs(costs: HostCosts, hw: HardwareSpec,
                    predictor: str) -> tuple[HostCosts, bool]:
    """``costs`` with ``predictor``'s own time on the compute thread where the preset
    measured it (``[host.predictors]``), and whether it did (ondemand and the oracle ask no
    predictor: nothing to count, True)."""
    if predictor in ("ondemand", "oracle"):
        return costs, True
    cost = hw.host.predictors.get(predictor) if hw.host is not None else None
    if cost is None:
        return costs, False
    return dataclasses.replace(costs, learn_s=cost.learn_s, predict_s=cost.predict_s,
                               admission_s=cost.admission_s), True


ALL_SUFFIX = "-all"  # a system with admission off: every predicted load made


def system_of(name: str) -> tuple[str, str]:
    """(predictor, cache policy) of a runtime system or a replay predictor's name (with
    ``-all``: the same with admission off, ``admitted``)."""
    if name.endswith(ALL_SUFFIX) and name != ALL_SUFFIX:
        return system_of(name[: -len(ALL_SUFFIX)])
    if name in RUNTIME_SYSTEMS:
        return RUNTIME_SYSTEMS[name]
    if name in REGISTRY:
        return name, "lru"
    valid = ", ".join([*RUNTIME_SYSTEMS, *(n for n in REGISTRY if n not in RUNTIME_SYSTEMS)])
    raise SpecError(f"unknown runtime system {name!r}; choose from {valid} (each with "
                    f"{ALL_SUFFIX}: admission off)")


def admitted(name: str, options: HostOptions) -> bool:
    """Whether system ``name`` runs with the runtime's prefetch admission."""
    return options.admission and not name.endswith(ALL_SUFFIX)


def sequence_run(trace: RoutingTrace, o: HostOptions) -> tuple[RoutingTrace, int]:
    """The sequence replayed, cut to its prompt and ``decode_tokens``; (it, prompt tokens)."""
    if not 0 <= o.sequence < trace.num_sequences:
        raise SpecError(f"sequence {o.sequence} is outside 0..{trace.num_sequences - 1}")
    seq = select_sequences(trace, [o.sequence])
    decode = np.asarray(seq.is_decode, dtype=bool)
    prefill = int(np.argmax(decode)) if decode.any() else 0
    if prefill == 0 or not decode[prefill:].all():
        raise SpecError(f"sequence {o.sequence} is not a prompt followed by decode tokens; the "
                        "runtime pipeline replays one prompt and its decode tokens")
    have = len(decode) - prefill
    want = have if o.decode_tokens is None else o.decode_tokens
    if not 1 <= want <= have:
        raise SpecError(f"{want} decode tokens asked for; sequence {o.sequence} has 1..{have}")
    if want < have:
        from stmoe.trace.select import split

        seq = split(seq, (prefill + want) / seq.num_tokens, by="token")[0]
        if seq.num_tokens != prefill + want:  # split rounds: never a wrong length silently
            raise SpecError(f"cannot cut sequence {o.sequence} at {prefill + want} tokens")
    return seq, prefill


def run_host_system(name: str, seq: RoutingTrace, prefill: int, model: ModelSpec,
                    hw: HardwareSpec, o: HostOptions) -> dict[str, Any]:
    """One system's simulated decode of ``seq`` (from ``sequence_run``)."""
    predictor, policy = system_of(name)
    plan, horizon, scores = None, 1, None
    if predictor not in ("ondemand", "oracle"):
        p = compared_predictor(predictor, o.tables)  # stmoe-plus and hybrid at 1.5K
        if isinstance(p, str):
            p = make(p, ModelShape.of(seq), o.tables)
        made, scores = p.scored_plan(seq) if policy == "score" else (p.plan(seq), None)
        plan, horizon = (made.ptr, made.ids), p.horizon
    run = HostRun(np.asarray(seq.experts, dtype=np.int64), prefill, plan,
                  predictor == "oracle", o.capacity, policy, admitted(name, o), horizon, scores)
    costs, timed = predictor_costs(host_costs(model, hw), hw, predictor)
    c = simulate_host(run, costs, model.num_experts)
    t, tokens = c["time"], c["tokens"]
    return {
        "predictor": predictor, "policy": policy, "decode_s": t,
        "decode_tokens": int(tokens), "decode_tokens_per_s": tokens / t if t > 0 else 0.0,
        "stall_s": c["stall"], "stall_share": c["stall"] / t if t > 0 else 0.0,
        "hit_rate": c["hits"] / c["demanded"] if c["demanded"] else 0.0,
        "bytes_moved": int(c["moved"]) * model.expert_bytes,
        "bytes_wasted": int(c["wasted"]) * model.expert_bytes,
        "admission": run.admission and not run.oracle,
        # the predictor's own time counted (False: a predicting system whose preset has no
        # [host.predictors] entry for it, so none was)
        "predictor_time": timed,
        "counters": c,
    }


def simulate_runtime(trace: RoutingTrace, model: ModelSpec, hw: HardwareSpec,
                     systems: Sequence[str], options: HostOptions) -> dict[str, Any]:
    """Every system of ``systems`` replaying one sequence through the runtime's pipeline."""
    seq, prefill = sequence_run(trace, options)
    needs = any(system_of(s)[0] not in ("ondemand", "oracle") for s in systems)
    if needs and options.tables is None:
        raise SpecError("the runtime pipeline's predictors need tables (--tables)")
    if options.tables is not None:
        options.tables.check_trace(seq)
    caps = host_capacities(options.capacity, model.num_experts, model.top_k, seq.num_layers)
    costs = host_costs(model, hw)
    return {
        "pipeline": "runtime", "model": model.name, "hardware": hw.name,
        "trace": {"model": seq.meta.model, "synthetic": seq.meta.synthetic,
                  "sequence": options.sequence, "prompt_tokens": prefill,
                  "decode_tokens": seq.num_tokens - prefill},
        # one count, or each layer's (as given)
        "capacity": list(caps) if isinstance(options.capacity, (tuple, list)) else caps[0],
        "costs": dataclasses.asdict(costs),
        "systems": {s: run_host_system(s, seq, prefill, model, hw, options) for s in systems},
    }
