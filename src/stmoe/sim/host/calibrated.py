"""A hardware spec from ``stmoe calibrate``'s figures (``stmoe.runtime.calibrate``).

Kept here, beside the specs it must load as, and free of torch: the keys of
``sim/data/hardware.toml`` plus ``[host]``, each number with a comment saying
how, when and on what it was measured (or that it does not apply).
"""

from __future__ import annotations

import json
from typing import Any

from stmoe.errors import OffloadError


def hardware_toml(f: dict[str, Any]) -> str:
    """``calibrate``'s figures as a hardware spec (``stmoe.sim.specs.hardware_preset``):
    the keys of ``sim/data/hardware.toml`` plus ``[host]``, each with how it was found."""
    on = f"measured {f['when']} on {f['machine']}"
    layers, k = f["num_layers"], f["top_k"]
    expert_call = f["experts_s"] / layers  # one layer's experts call, K experts, one token
    macs_per_s = f["expert_macs"] * k / expert_call if expert_call > 0 else 1.0
    layer_s = max(0.0, (f["layers_s"] - f["experts_s"]) / layers)
    token_s = max(0.0, f["token_s"] - f["layers_s"])
    tier = f"{f['tier']}{' (O_DIRECT)' if f['direct_io'] else ''}"
    if f["tier"] == "emulated":
        tier += f" (EMULATED link {f['emulated_link']})"
    na = "not measured: the host pipeline does not use it"

    def line(key: str, value: Any, note: str) -> str:
        text = json.dumps(value) if isinstance(value, str) else repr(value)  # TOML-escaped
        return f"{key} = {text:<24} # {note}"

    rows = [
        f"# stmoe calibrate: {on}",
        f"# store {f['store']} ({f['num_layers']} layers x {f['num_experts']} experts of "
        f"{f['expert_bytes']} bytes), tier {tier}, torch threads {f['threads']}",
        line("description", f"This machine's CPU reading experts from the {f['tier']} tier "
             "(stmoe calibrate)", "what this preset is"),
        line("source", on, "when and on what every figure below was measured"),
        line("clock_hz", 1.0e9, "nominal: the CPU's rate is measured whole, in pe_macs_per_cycle"),
        line("pe_macs_per_cycle", macs_per_s / 1e9, f"measured: one experts call ({k} experts, "
             f"1 token) took {expert_call * 1e3:.3f} ms in the runtime"),
        line("router_macs_per_cycle", macs_per_s / 1e9, "the router runs on the same CPU "
             "(its time is inside host.layer_s)"),
        line("dataflow", "weight_stationary", "one fixed kernel"),
        line("link_bytes_per_s", f["bytes_per_s"], _single_reader(f)),
        line("link_latency_s", f["latency_s"], _latency_note(f)),
        line("cache_experts_per_layer", f["capacity"], "calibrate's --capacity: the "
             "accelerator pipeline's buffer (the runtime pipeline takes simulate --capacity)"),
        line("epu_cycles_per_candidate", 0, "prediction runs on the host CPU: its time per "
             "layer call is [host.predictors]'s"),
        line("epu_fixed_cycles", 0, na), line("verify_cycles", 0, na),
        line("emu_stages_per_group", 0, na), line("pe_groups", 1, na),
        line("mac_pj", 0.0, "energy not measured"), line("sram_pj_per_byte", 0.0, na),
        line("dram_pj_per_byte", 0.0, na), line("link_pj_per_byte", 0.0, na),
        line("static_w", 0.0, na), line("epu_bits_per_slot", 10, na),
        "",
        "[dataflows]",
        "weight_stationary = { peak = 1.0, half = 0.0 }  # measured at one token (decode)",
        "",
        "[host]  # the runtime's host pipeline (stmoe simulate --pipeline runtime)",
        line("tier", f["tier"], f"the tier measured: {tier}"),
        line("measured_on", measured_on(f["num_layers"], f["num_experts"], f["expert_bytes"]),
             "the model measured: its layer and token times are that model's"),
        line("workers", f["workers"], "the runtime's prefetch threads on this tier"),
        line("chunk_bytes", f.get("chunk_bytes", 4 << 20), "the runtime's: a prefetch "
             "worker reads an expert in pieces of this size, a demand read goes between"),
        line("read_parallel_bytes_per_s", f["parallel_bytes_per_s"], f"measured: "
             f"{f['reads_n']['threads']} threads reading {f['reads_n']['blocks']} blocks at "
             "once, each into its own faulted-in slot memory (their throughput, at least "
             "one reader's)"),
        line("layer_s", layer_s, f"measured: decoder layer time less its experts call, "
             f"{f['tokens']} decode tokens, every expert a hit (the split's clocks' own cost "
             "scaled out)"),
        line("token_s", token_s, "measured: decode token time outside the decoder layers "
             f"(the token's {f['token_s'] * 1e3:.3f} ms from a run with no clocks in it; "
             f"{f.get('token_s_clocked', f['token_s']) * 1e3:.3f} ms with them)"),
        line("first_touch_s", f["first_touch_s"], f"measured: a read into never-touched "
             f"memory less one into a faulted-in slot (medians of {f['touch_reads']} each): "
             "paid per spare row past the capacity (a long prompt's extra experts), never by "
             "a read into a slot, faulted in when the cache is made (measured "
             f"{f['populate_s'] * 1e3:.2f} ms an expert, not timed by the simulator)"),
    ]
    return "\n".join(rows + _predictors(f)) + "\n"


def measured_on(layers: int, experts: int, expert_bytes: int) -> str:
    """How a preset names the model it was calibrated on (``[host] measured_on``)."""
    return f"{layers} layers x {experts} experts of {expert_bytes} bytes"


def _predictors(f: dict[str, Any]) -> list[str]:
    """``[host.predictors]``: each timed predictor's learn_s and predict_s per decode layer
    call (``runtime.calibrate.predictor_time``); none timed: a comment saying so."""
    timed = f.get("predictors") or {}
    if not timed:
        return ["# [host.predictors] not measured (no tables: `stmoe calibrate --tables`): the "
                "simulator counts no predictor time"]
    rows = ["", "[host.predictors]  # a predicting system's own work on the compute thread "
            "per decode layer call: the planner's but the predictor's answer, the answer (per "
            "call asking it), admission's look at the last set"]
    for name, t in timed.items():
        how = t.get("how") or (f"measured: {t['calls']} decode layer calls ({t['asked']} "
                               "asking the predictor), every expert cached, tables "
                               f"{json.dumps(f.get('predictor_tables'))}")
        rows.append(f"{json.dumps(name)} = {{ learn_s = {t['learn_s']!r}, predict_s = "
                    f"{t['predict_s']!r}, admission_s = {t['admission_s']!r} }}  # "
                    + how.replace("\n", " "))
    return rows


MIN_TRANSFER_SHARE = 0.1  # the least share of an expert's mean read taken as transfer


def split_read(mean_s: float, latency_s: float) -> tuple[float, float]:
    """(transfer, latency) seconds of one expert's read whose mean is ``mean_s``, given the
    measured latency; they add up to the mean (the simulator's read is latency + bytes /
    bandwidth). Why a floor: where the measured latency (a one-page read) is near or above
    the mean (a tiny expert, a noisy machine), subtracting it leaves a transfer of next to
    nothing, an absurd bandwidth; the transfer is kept at MIN_TRANSFER_SHARE of the mean or
    more (the bandwidth at most ten times what the whole read gives) and the latency is
    what is left."""
    if not mean_s > 0:
        raise OffloadError(f"calibrate measured a mean read of {mean_s} s; expected more "
                           "than 0")
    if mean_s - latency_s >= MIN_TRANSFER_SHARE * mean_s:
        return mean_s - latency_s, latency_s
    transfer = MIN_TRANSFER_SHARE * mean_s
    return transfer, mean_s - transfer


def _latency_note(f: dict[str, Any]) -> str:
    """How ``link_latency_s`` was measured (and why it may be less: ``split_read``)."""
    measured = f.get("latency_measured_s", f["latency_s"])
    if f["latency_s"] == measured:
        return "measured: median one-page read into a faulted-in page"
    return (f"the measured latency ({measured * 1e6:.1f} us, a one-page read) was near or "
            "above an expert's mean read, so bandwidth and latency could not be told apart: "
            f"{MIN_TRANSFER_SHARE:.0%} of the mean is taken as transfer (link_bytes_per_s), "
            "the rest as latency (the two add up to the measured mean)")


def _single_reader(f: dict[str, Any]) -> str:
    """How ``link_bytes_per_s`` was measured: the runtime's own reads where a trace was
    given, else calibrate's loop."""
    loop = (f"{f['reads_1']['blocks']} expert blocks read one at a time into slot memory "
            "faulted in beforehand (as the runtime's slots: no page faults), CRC-32C checked "
            "(mean time, less the latency)")
    runtime = f.get("runtime_reads")
    if not runtime:
        return f"measured: {loop}"
    copy = runtime.get("copy_mean_s") or 0.0
    how = (f": the slower of the host's part, {runtime['host_mean_s'] * 1e3:.3f} ms, and the "
           f"copy, {copy * 1e3:.3f} ms, timed by the device's events" if copy else "")
    return (f"measured: the runtime's own reads of its decode misses, an LRU-only replay of "
            f"the trace ({runtime['reads']} reads over {runtime['tokens']} tokens, mean "
            f"{runtime['mean_s'] * 1e3:.2f} ms{how}, less the latency); calibrate's loop of "
            f"{loop} gave {f['loop_bytes_per_s'] / 1e9:.2f} GB/s")
