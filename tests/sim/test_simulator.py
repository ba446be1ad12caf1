"""Simulator: closed-form cases, the bounds, presets and the CLI."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stmoe
from stmoe.predictors import names_for, profile
from stmoe.sim.accelerator.simulate import simulate
from stmoe.sim.accelerator.systems import RunOptions, run_system
from stmoe.sim.specs import SpecError, hardware_preset, model_preset, preset_names

MODEL = dataclasses.replace(model_preset("olmoe-1b-7b"), layers=4, num_experts=16, top_k=2)
ASIC = hardware_preset("stmoe-asic")


def trace_for(model=MODEL, tokens=120, sequences=3, seed=0, **kw):
    return stmoe.synthesize(tokens=tokens, layers=model.layers, experts=model.num_experts,
                            top_k=model.top_k, sequences=sequences, seed=seed, **kw)


def per_token_compute(trace, model, hw, util):
    """Closed form: attention + gating + routed and shared experts + EMU, token by token."""
    pe, router = hw.pe_macs_per_cycle * hw.clock_hz, hw.router_macs_per_cycle * hw.clock_hz
    emu = hw.emu_stages_per_group * np.log2(hw.pe_groups) / hw.clock_hz
    pos = np.arange(trace.num_tokens) - np.repeat(trace.seq_starts, trace.seq_lengths)
    total = 0.0
    for t in np.flatnonzero(trace.is_decode):
        for _ in range(trace.num_layers):
            total += model.attention_macs(pos[t]) / (pe * util)
            total += model.router_macs / router
            total += model.top_k * model.expert_macs / (pe * util) + emu
            total += model.shared_macs / (pe * util)
    return total


def best_util(hw, n=1):
    return max(d.utilisation(n) for d in hw.dataflows.values())


def test_every_expert_resident_costs_compute_alone():
    trace = trace_for()
    hw = dataclasses.replace(ASIC, cache_experts_per_layer=MODEL.num_experts)
    for system in ("oracle", "ondemand", "stmoe"):
        r = run_system(system, trace, MODEL, hw, RunOptions(tables=profile(trace), warm=True))
        assert r.counters["stall"] == pytest.approx(0.0, abs=1e-15)
        assert r.counters["loaded"] == 0
        assert r.time == pytest.approx(per_token_compute(trace, MODEL, hw, best_util(hw)), rel=1e-9)


def test_batch_one_equals_the_single_token_model():
    # No cache, on demand: each layer waits for its K experts, one after another.
    trace = trace_for(temporal=0.5)
    r = run_system("gpu-baseline", trace, MODEL, ASIC)
    ws = ASIC.dataflows["weight_stationary"].utilisation(1)
    xfer = ASIC.link_latency_s + MODEL.expert_bytes / ASIC.link_bytes_per_s
    loads = int(trace.is_decode.sum()) * trace.num_layers * MODEL.top_k
    expected = per_token_compute(trace, MODEL, ASIC, ws) + loads * xfer
    assert r.time == pytest.approx(expected, rel=1e-9)
    assert r.counters["loaded"] == loads


def test_prediction_off_equals_on_demand():
    trace = trace_for()
    tables = profile(trace)
    silent = run_system("stmoe", trace, MODEL, ASIC, RunOptions(
        tables=tables, predictor_options={"threshold": 1e9, "layer0": "none"}))
    ondemand = run_system("ondemand", trace, MODEL, ASIC)
    assert silent.counters["prefetched"] == 0
    assert silent.time == ondemand.time


def test_doubling_bandwidth_halves_communication():
    trace = trace_for()
    hw = dataclasses.replace(ASIC, link_latency_s=0.0)
    fast = dataclasses.replace(hw, link_bytes_per_s=2 * hw.link_bytes_per_s)
    for system in ("gpu-baseline", "oracle"):
        a, b = run_system(system, trace, MODEL, hw), run_system(system, trace, MODEL, fast)
        assert b.counters["link"] == pytest.approx(a.counters["link"] / 2, rel=1e-12)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.floats(0.0, 1.0), st.floats(0.0, 0.6))
def test_the_oracle_is_never_slower_than_any_predictor(seed, spatial, temporal):
    trace = trace_for(tokens=60, seed=seed, spatial=spatial, temporal=temporal)
    tables = profile(trace)
    oracle = run_system("oracle", trace, MODEL, ASIC).time
    for name in names_for(trace):
        assert oracle <= run_system(name, trace, MODEL, ASIC,
                                     RunOptions(tables=tables, seed=seed)).time + 1e-12


def test_adaptive_gating_is_lossy_and_says_so():
    trace = trace_for()
    r = run_system("adap-gating", trace, MODEL, ASIC, RunOptions(adap_threshold=0.5))
    assert 1 <= r.quality["experts_per_token_layer"] <= MODEL.top_k
    assert 0 < r.quality["dropped_gate_mass"] < 1
    with pytest.raises(SpecError, match="needs gate weights"):
        run_system("adap-gating", dataclasses.replace(trace, weights=None), MODEL, ASIC)


def test_perfect_pregate_hits_everything_after_layer_zero():
    trace = trace_for()
    r = run_system("pregated", trace, MODEL, ASIC)
    decode = int(trace.is_decode.sum())
    assert r.counters["predicted_hits"] == decode * (MODEL.layers - 1) * MODEL.top_k


def test_batches_union_their_experts():
    trace = trace_for(tokens=400, sequences=4)
    one = run_system("gpu-baseline", trace, MODEL, ASIC, RunOptions(batch=1))
    four = run_system("gpu-baseline", trace, MODEL, ASIC, RunOptions(batch=4))
    assert four.counters["loaded"] < one.counters["loaded"]  # shared experts load once per step
    assert four.time < one.time


def test_presets_load_and_bad_specs_are_clear(tmp_path):
    assert {"stmoe-asic", "gpu-offload", "edge-ssd"} <= set(preset_names("hardware"))
    names = {"qwen1.5-moe-a2.7b", "qwen2-57b-a14b", "deepseek-v2-lite", "deepseek-moe-16b",
             "mixtral-8x7b", "olmoe-1b-7b", "qwen3-30b-a3b"}
    assert names <= set(preset_names("models"))
    for name in names:
        assert model_preset(name).expert_bytes > 0
    with pytest.raises(SpecError, match=r"unknown hardware 'tpu'.*stmoe-asic"):
        hardware_preset("tpu")
    bad = tmp_path / "m.toml"
    bad.write_text("layers = 'many'\n")
    with pytest.raises(SpecError, match="lacks"):
        model_preset(str(bad))
    with pytest.raises(SpecError, match=r"trace has L=4 MoE layers, N=16 experts, top-2"):
        simulate(trace_for(), model_preset("mixtral-8x7b"), ASIC)


def test_simulate_command_json_and_figures(cli, tmp_path):
    model = tmp_path / "tiny.toml"
    fields = {k: v for k, v in dataclasses.asdict(MODEL).items() if k != "name"}
    model.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items()))
    stmoe.save_trace(trace_for(tokens=300, sequences=4), tmp_path / "t.npz")
    result = cli("simulate", tmp_path / "t.npz", "--model", model, "--hardware", "stmoe-asic",
                 "--json", tmp_path / "s.json", "-o", tmp_path / "fig")
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["systems"]["gpu-baseline"]["normalized_time"] == 1.0
    for name in ("gpu-baseline", "adap-gating", "pregated", "stmoe", "oracle"):
        entry = data["systems"][name]
        assert {"time", "normalized_time", "energy", "edp", "breakdown"} <= set(entry)
    for png in ("normalized_time", "ablation", "sweep_link_bytes_per_s",
                "sweep_cache_experts_per_layer", "sweep_batch"):
        assert (tmp_path / "fig" / f"{png}.png").stat().st_size > 10_000
    bad = cli("simulate", tmp_path / "t.npz", "--model", "nope", "--hardware", "stmoe-asic")
    assert bad.exit_code == 1 and "unknown model 'nope'" in bad.output
    # the sweeps' points are the trace's: batches of its simulated (held-out) half's two
    # sequences at most, caches up to its experts
    sweeps = data["sweeps"]
    assert sweeps["batch"]["values"] == [1, 2]
    assert sweeps["cache_experts_per_layer"]["values"] == [0, 2, 4, 8, 16]
    big = cli("simulate", tmp_path / "t.npz", "--model", model, "--batch", "3")
    assert big.exit_code == 1 and "batch 3: the simulated routing holds 2 sequence(s)" in \
        big.output, big.output


def test_prefetches_that_arrive_too_late_cost_nothing():
    # A prediction unit so slow that every prefetch is issued after the layer it is for
    # has been verified: all are cancelled and the link is as free as on demand.
    trace = trace_for()
    slow = dataclasses.replace(ASIC, epu_fixed_cycles=1e12, verify_cycles=0)
    late = run_system("random", trace, MODEL, slow)
    assert late.counters["wasted"] == 0
    assert late.time == pytest.approx(run_system("ondemand", trace, MODEL, slow).time, rel=1e-12)


def test_a_pregate_that_is_always_wrong_never_hits():
    trace = trace_for()
    r = run_system("pregated", trace, MODEL, ASIC, RunOptions(pregate_accuracy=0.0))
    assert r.counters["predicted_hits"] == 0 and r.counters["wasted"] > 0


# ---- the runtime's host pipeline (sim/host.py; docs/simulator.md "Checked against the runtime")
HOST_TOML = """description = "a test host"
clock_hz = 1.0e9
pe_macs_per_cycle = {pe}
router_macs_per_cycle = 1.0
dataflow = "weight_stationary"
link_bytes_per_s = {bw}
link_latency_s = 0.0
cache_experts_per_layer = 8
epu_cycles_per_candidate = 0
epu_fixed_cycles = 0
verify_cycles = 0
emu_stages_per_group = 0
pe_groups = 1
mac_pj = 0.0
sram_pj_per_byte = 0.0
dram_pj_per_byte = 0.0
link_pj_per_byte = 0.0
static_w = 0.0
epu_bits_per_slot = 10
[dataflows]
weight_stationary = {{ peak = 1.0, half = 0.0 }}
[host]
tier = "{tier}"
workers = 2
read_parallel_bytes_per_s = {par}
layer_s = 0.002
token_s = 0.003
first_touch_s = {touch}
"""


def host_spec(tmp_path, pe=1.0, bw=1e9, par=1e9, tier="disk", touch=0.0):
    path = tmp_path / "host.toml"
    path.write_text(HOST_TOML.format(pe=pe, bw=bw, par=par, tier=tier, touch=touch))
    return hardware_preset(str(path))


def host_trace(tokens=40):
    return trace_for(MODEL, tokens=tokens, sequences=1, seed=3)


def test_the_host_pipeline_takes_the_runtimes_link_rule_per_tier(tmp_path):
    """Serial link and free waste from ``stmoe.admission.link_of``, as the runtime's engine
    takes them: a simulated gpu tier admits as the runtime's does."""
    from stmoe.sim.host.systems import host_costs

    for tier, serial, free in (("gpu", True, True), ("emulated", True, False),
                               ("disk", False, False), ("gpu-disk", False, False)):
        costs = host_costs(MODEL, host_spec(tmp_path, tier=tier))
        assert (costs.fifo, costs.free_waste) == (serial, free), tier


def test_on_demand_on_the_host_is_compute_plus_every_read_in_turn(tmp_path):
    from stmoe.sim.host.systems import HostOptions, simulate_runtime

    hw = host_spec(tmp_path, pe=2.0, bw=4e8)
    trace = host_trace()
    data = simulate_runtime(trace, MODEL, hw, ["on-demand", "oracle"], HostOptions(capacity=8))
    r = data["systems"]["on-demand"]
    decode = int(np.count_nonzero(trace.is_decode))
    expert_s = MODEL.expert_macs / 2e9
    read_s = MODEL.expert_bytes / 4e8
    per_layer = 0.002 + MODEL.top_k * (expert_s + read_s)  # no reuse: every expert read
    want = decode * (0.003 + MODEL.layers * per_layer)
    assert r["decode_tokens"] == decode and r["hit_rate"] == 0.0
    assert r["decode_s"] == pytest.approx(want, rel=1e-9)
    assert r["stall_s"] == pytest.approx(decode * MODEL.layers * MODEL.top_k * read_s, rel=1e-9)
    assert data["systems"]["oracle"]["decode_s"] < r["decode_s"]


def test_with_a_free_tier_every_system_costs_compute_alone(tmp_path):
    from stmoe.sim.host.systems import RUNTIME_SYSTEMS, HostOptions, simulate_runtime

    hw = host_spec(tmp_path, bw=1e300, par=1e300)
    trace = host_trace()
    tables = profile(trace, fit_plus=False)
    data = simulate_runtime(trace, MODEL, hw, list(RUNTIME_SYSTEMS),
                            HostOptions(capacity=8, decode_tokens=5, tables=tables))
    compute = 5 * (0.003 + MODEL.layers * (0.002 + MODEL.top_k * MODEL.expert_macs / 1e9))
    for name, r in data["systems"].items():
        assert r["decode_s"] == pytest.approx(compute, rel=1e-9), name
        assert r["stall_s"] == pytest.approx(0.0, abs=1e-12), name


def test_lru_hits_on_the_host_equal_the_cache_replay_without_prefetch(tmp_path):
    """Without prefetches or overflow, the host's cache is the replay's (one step per layer)."""
    from stmoe.evaluate.cache_replay import replay_cache
    from stmoe.predictors import make
    from stmoe.sim.host.systems import HostOptions, simulate_runtime
    from stmoe.trace.select import decode_only

    trace = decode_only(host_trace(60))  # every token is its own step in both
    trace = dataclasses.replace(trace, is_decode=np.arange(trace.num_tokens) > 0)
    data = simulate_runtime(trace, MODEL, host_spec(tmp_path), ["lru-only"],
                            HostOptions(capacity=8))
    plan = make("ondemand", stmoe.predictors.ModelShape.of(trace)).plan(trace)
    want = replay_cache(trace, plan, 8, "lru", count_mask=np.asarray(trace.is_decode))
    assert data["systems"]["lru-only"]["hit_rate"] == pytest.approx(want.hit_rate, abs=1e-12)


def test_each_layers_capacity_on_the_host_is_the_replays_and_one_for_all_is_alike(tmp_path):
    """``capacity`` one count per MoE layer (`stmoe split-capacity`'s, as the runtime takes
    it): LRU hits without prefetch equal the cache replay's at the same per-layer sizes,
    differ from either uniform run, and a count repeated for every layer is the one count's
    run exactly (every system)."""
    from stmoe.evaluate.cache_replay import replay_cache
    from stmoe.predictors import make
    from stmoe.sim.host.systems import RUNTIME_SYSTEMS, HostOptions, simulate_runtime
    from stmoe.trace.select import decode_only

    trace = decode_only(host_trace(60))
    trace = dataclasses.replace(trace, is_decode=np.arange(trace.num_tokens) > 0)
    hw = host_spec(tmp_path)
    split = (16, 6, 8, 12)[: trace.num_layers]
    assert len(split) == trace.num_layers
    plan = make("ondemand", stmoe.predictors.ModelShape.of(trace)).plan(trace)
    rates = {}
    one_lru = simulate_runtime(trace, MODEL, hw, ["lru-only"], HostOptions(capacity=8))
    for caps in (split, 8, 12):
        got = simulate_runtime(trace, MODEL, hw, ["lru-only"], HostOptions(capacity=caps))
        want = replay_cache(trace, plan, caps, "lru", count_mask=np.asarray(trace.is_decode))
        rates[caps] = got["systems"]["lru-only"]["hit_rate"]
        assert rates[caps] == pytest.approx(want.hit_rate, abs=1e-12), caps
    assert rates[split] not in (rates[8], rates[12])
    tables = profile(trace, fit_plus=False)
    one, each = (simulate_runtime(trace, MODEL, hw, list(RUNTIME_SYSTEMS), HostOptions(
        capacity=c, decode_tokens=20, tables=tables)) for c in (8, (8,) * trace.num_layers))
    assert each["capacity"] == [8] * trace.num_layers and one["capacity"] == 8
    assert each["systems"] == one["systems"]
    with pytest.raises(stmoe.sim.specs.SpecError, match="3 counts for 4 MoE layers"):
        simulate_runtime(trace, MODEL, hw, ["lru-only"], HostOptions(capacity=(8, 8, 8)))
    with pytest.raises(stmoe.sim.specs.SpecError,
                       match=r"capacity of layer 1 1 .*expected 2 to 16"):
        simulate_runtime(trace, MODEL, hw, ["lru-only"], HostOptions(capacity=(8, 1, 8, 8)))
    # a string (even of a count) is refused, not read as one count per character
    for bad in ("16", "50%", 8.0):
        with pytest.raises(stmoe.sim.specs.SpecError, match="takes a count of experts"):
            simulate_runtime(trace, MODEL, hw, ["lru-only"], HostOptions(capacity=bad))
    assert simulate_runtime(trace, MODEL, hw, ["lru-only"], HostOptions(
        capacity=np.int64(8)))["systems"] == one_lru["systems"]


def test_a_shared_device_splits_its_speed_and_a_link_serialises():
    from stmoe.sim.host.link import FifoLink, SharedLink

    shared = SharedLink(parallel=1.0)
    shared.start(0, 0.0, 1.0)
    shared.start(1, 0.0, 1.0)
    assert shared.pop() == (2.0, 0) and shared.pop() == (2.0, 1)
    faster = SharedLink(parallel=2.0)
    faster.start(0, 0.0, 1.0)
    faster.start(1, 0.5, 1.0)  # alone for 0.5 s, then both at speed 1 each
    assert faster.pop() == (1.0, 0) and faster.pop() == (1.5, 1)
    fifo = FifoLink()
    fifo.start(0, 0.0, 1.0)
    fifo.start(1, 0.5, 1.0)
    assert fifo.pop() == (1.0, 0) and fifo.pop() == (2.0, 1)


def host_run(experts, sets, capacity=2, workers=2, expert_s=1.0, monkeypatch=None,
             first_touch_s=0.0, policy="lru", scores=None):
    """A hand-built run on one shared disk (parallel 1: two reads at once take twice as
    long), one-second reads, no other cost; ``sets``: {(token, layer): predicted ids}.
    With ``monkeypatch``, also every read's (layer, expert, by a worker, start)."""
    from stmoe.sim.host import pipeline as host

    experts = np.asarray(experts, dtype=np.int64)[..., None]  # [tokens, layers, K=1]
    cells = [sets.get((t, layer), []) for t in range(experts.shape[0])
             for layer in range(experts.shape[1])]
    ptr = np.cumsum([0] + [len(c) for c in cells]).astype(np.int64)
    ids = np.asarray([e for c in cells for e in c], dtype=np.int64)
    reads: list[tuple[int, int, bool, float]] = []
    if monkeypatch is not None:
        read = host._Sim._read

        def logged(self, layer, e, worker, t, spare):
            reads.append((layer, e, worker, t))
            return read(self, layer, e, worker, t, spare)

        monkeypatch.setattr(host._Sim, "_read", logged)
    costs = host.HostCosts(layer_s=0.0, token_s=0.0, expert_s=expert_s, read_s=1.0,
                           first_touch_s=first_touch_s, parallel=1.0, workers=workers,
                           fifo=False)
    run = host.HostRun(experts, 1, (ptr, ids), False, capacity, policy, scores=scores)
    return host.simulate_host(run, costs, 4), reads


def test_score_eviction_in_the_host_pipeline_keeps_what_the_prediction_scores_high():
    """Capacity 2, one layer, nothing prefetched. Token 2 misses expert 2 with 0 and 1
    cached: LRU evicts 0 (the least recent), so token 3 misses it again. The prediction
    for token 3 (made as token 2's layer starts, before its demand: with one layer the
    next layer is the next token's) scores 0 highest, so score evicts 1 and token 3
    hits. Without scores (none given) score is LRU."""
    experts = [[0], [1], [2], [0]]
    scores = np.zeros((4, 4), dtype=np.float32)
    scores[3, 0] = 1.0
    lru, _ = host_run(experts, {})
    scored, _ = host_run(experts, {}, policy="score", scores=scores)
    unscored, _ = host_run(experts, {}, policy="score")
    assert (lru["hits"], scored["hits"], unscored["hits"]) == (0, 1, 0)


@pytest.mark.parametrize("wait", ["miss", "late"])
def test_while_the_compute_thread_stalls_no_new_prefetch_read_starts(monkeypatch, wait):
    """Decode token 1's layer 0 waits for expert 1 (a miss it reads itself, or a prefetch
    still in flight); the planner has already queued layer 1's expert 2, and a worker is
    idle. Paused, the worker starts it when the wait ends: alone, expert 1 takes 1 s, and
    expert 2 lands as layer 0's 1 s of compute ends. Started at once, the two would share
    the disk and both take 2 s (stall 2 s, decode 4 s)."""
    sets = {(1, 1): [2], **({(1, 0): [1]} if wait == "late" else {})}
    out, reads = host_run([[0, 0], [1, 2]], sets, monkeypatch=monkeypatch)
    assert out["stall"] == pytest.approx(1.0, abs=1e-12)
    assert out["time"] == pytest.approx(3.0, abs=1e-12)
    assert (out["misses"], out["late"]) == ((1, 0) if wait == "miss" else (0, 1))
    start = {(layer, e): (worker, t) for layer, e, worker, t in reads}
    assert start[(0, 1)][0] == (wait == "late")  # who reads expert 1
    assert start[(1, 2)] == (True, pytest.approx(start[(0, 1)][1] + 1.0, abs=1e-12))


def test_a_layer_without_stall_starts_the_next_layers_prefetch_at_its_begin():
    """Layer 0 of decode token 1 hits (expert 0, cached by the prompt), so the planner's
    load of layer 1's expert 2 starts as layer 0 begins: layer 1 then waits only what its
    1 s read has left after layer 0's 0.25 s of compute."""
    out, _ = host_run([[0, 0], [0, 2]], {(1, 1): [2]}, expert_s=0.25)
    assert out["stall"] == pytest.approx(0.75, abs=1e-12)
    assert out["time"] == pytest.approx(1.25, abs=1e-12)
    assert (out["hits"], out["late"], out["prefetch_loads"]) == (2, 1, 1)


def test_the_next_calls_set_is_protected_before_this_layers_misses_claim_slots():
    """One MoE layer, two slots: the planner runs before ensure, so at token 2 the set
    predicted for token 3 (expert 0) is already protected and token 2's miss evicts
    expert 1, not the least recently used expert 0; token 3 then hits with no wait.
    (Planned after ensure, the miss evicted expert 0, read again by a worker, and token
    3 waited for it: stall 3 s, 4 reads.)"""
    out, _ = host_run([[0], [1], [2], [0]], {(3, 0): [0]}, workers=1, expert_s=0.0)
    assert out["stall"] == pytest.approx(2.0, abs=1e-12)  # tokens 1 and 2's misses
    assert (out["hits"], out["late"], out["misses"], out["moved"]) == (1, 0, 2, 3)


def test_decode_reads_into_slots_never_used_pay_no_first_touch():
    """The runtime faults its cache's slots in when it makes the cache, so a decode read
    into a slot never used before (here the 2nd and 3rd slots of each layer, by misses
    and by a worker's prefetch) costs the tier's time alone, whatever ``first_touch_s``."""
    experts, sets = [[0, 0], [1, 1], [2, 2]], {(2, 1): [2]}
    plain, _ = host_run(experts, sets, capacity=3, expert_s=0.25)
    touched, _ = host_run(experts, sets, capacity=3, expert_s=0.25, first_touch_s=5.0)
    assert touched == plain
    assert (plain["misses"], plain["prefetch_loads"], plain["spare"]) == (3, 1, 0)
    # token 1: two misses (1 s each) and two computes; token 2: a miss, then the paused
    # prefetch starts and layer 1 waits the 0.75 s left of it after layer 0's compute
    assert plain["stall"] == pytest.approx(3.75, abs=1e-12)
    assert plain["time"] == pytest.approx(4.75, abs=1e-12)


def test_a_read_into_a_spare_row_past_the_capacity_pays_first_touch():
    """One MoE layer, one slot: at token 1 the set predicted for token 2 (expert 0, the
    cached one) is protected, so no slot can take the miss of expert 1; the runtime reads
    it into a spare row, memory paged in for that call, whose page faults it pays."""
    out, _ = host_run([[0], [1], [0]], {(2, 0): [0]}, capacity=1, workers=1, expert_s=0.0,
                      first_touch_s=0.5)
    assert (out["misses"], out["spare"], out["hits"]) == (1, 1, 1)
    assert out["stall"] == pytest.approx(1.5, abs=1e-12)
    assert out["time"] == pytest.approx(1.5, abs=1e-12)


@pytest.mark.parametrize("capacity", [4, 12])
def test_a_presets_first_touch_cost_leaves_every_systems_decode_unchanged(tmp_path, capacity):
    """The preset's ``first_touch_s`` (what a spare row and making the cache pay) does not
    enter decode time: slots are faulted in, and a decode of several MoE layers reads
    into no spare row (each layer's protected set is the next layer's). The 10-token
    prompt routes to 7-10 experts a layer: past a capacity of 4 (spare rows, paid before
    decode starts), within 12 (decode then fills slots the prompt never used)."""
    from stmoe.sim.host.systems import RUNTIME_SYSTEMS, HostOptions, simulate_runtime

    trace = host_trace()
    o = HostOptions(capacity=capacity, decode_tokens=20, tables=profile(trace, fit_plus=False))
    runs = [simulate_runtime(trace, MODEL, host_spec(tmp_path, bw=4e8, touch=touch),
                             list(RUNTIME_SYSTEMS), o) for touch in (0.0, 0.5)]
    assert runs[1]["costs"]["first_touch_s"] == 0.5
    for name in RUNTIME_SYSTEMS:
        plain, touched = runs[0]["systems"][name], runs[1]["systems"][name]
        # decode starting later after a prompt's spare rows moves only the last bits
        assert touched["decode_s"] == pytest.approx(plain["decode_s"], rel=1e-12), name
        assert touched["stall_s"] == pytest.approx(plain["stall_s"], rel=1e-12), name
        assert plain["stall_s"] > 0 and touched["counters"] == pytest.approx(
            plain["counters"], rel=1e-12), name
        assert plain["counters"]["spare"] == 0, name


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.replace('tier = "disk"', 'tier = "tape"'), "host.tier is 'tape'"),
        (lambda t: t.replace("layer_s = 0.002", "layer_s = -1.0"), "host.layer_s is -1.0"),
        (lambda t: t.replace("token_s = 0.003\n", ""), "[host] lacks token_s"),
        (lambda t: t.replace("workers = 2", "workers = 2\nspeed = 1"), "unknown keys speed"),
        (lambda t: t.replace("workers = 2", 'workers = "two"'), "host.workers is 'two'"),
        (lambda t: t.replace("link_bytes_per_s = 1000000000.0", "link_bytes_per_s = nan"),
         "link_bytes_per_s is nan"),
    ],
)
def test_bad_host_tables_are_clear(tmp_path, edit, message):
    path = tmp_path / "bad.toml"
    path.write_text(edit(HOST_TOML.format(pe=1.0, bw=1e9, par=1e9, tier="disk", touch=0.0)))
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("(", r"\(")):
        hardware_preset(str(path))


def test_a_preset_without_host_cannot_run_the_runtime_pipeline(cli, tmp_path):
    from stmoe.trace import save_trace

    tiny = stmoe.synthesize(tokens=40, layers=8, experts=16, top_k=4, sequences=1, seed=0)
    save_trace(tiny, tmp_path / "t.npz")
    res = cli("simulate", tmp_path / "t.npz", "--model", "stmoe-tiny", "--layers", "4",
              "--hardware", "edge-ssd", "--pipeline", "runtime")
    assert res.exit_code == 1
    assert "no [host] table" in res.output and "stmoe calibrate" in res.output
    res = cli("simulate", tmp_path / "t.npz", "--model", "stmoe-tiny", "--pipeline", "gpu")
    assert res.exit_code == 1 and "expected accelerator or runtime" in res.output


def test_stmoe_plus_is_fitted_only_when_simulated():
    from stmoe.sim.accelerator.simulate import needs_plus_fit, prepare_tables

    trace = trace_for(MODEL)
    assert "plus" not in prepare_tables(trace, None, ["stmoe", "oracle"])[1].info
    assert "plus" in prepare_tables(trace, None, ["stmoe-plus"])[1].info
    assert needs_plus_fit(["hybrid"]) and not needs_plus_fit(["gpu-baseline", "pregated"])


def test_the_sim_check_takes_the_tiers_speed_its_runs_met(tmp_path):
    """benchmarks/bench_sim_check.py --tier-from-runs: one read takes the runs' mean time
    in the simulation (latency kept), the parallel readers keep their proportion; runs
    without read times are refused; the figure draws both checks."""
    from stmoe.errors import StmoeError
    from stmoe.evaluate.systems import HEADLINE_SYSTEMS
    from stmoe.sim.host import check
    from stmoe.sim.host.check_plot import sim_vs_measured
    from stmoe.sim.host.systems import host_costs
    from stmoe.sim.specs import HostSpec

    model = model_preset("qwen3.6-35b-a3b")
    host = HostSpec(tier="disk", workers=2, read_parallel_bytes_per_s=2e9, layer_s=1e-3,
                    token_s=1e-3, first_touch_s=0.0)
    hw = dataclasses.replace(hardware_preset("gpu-offload"), host=host, link_bytes_per_s=1e9)
    runs = {"on-demand": [{"demand_reads": 10, "demand_read_s": 0.05}],
            "lru-only": [{"demand_reads": 30, "demand_read_s": 0.11}],
            "oracle": [{"demand_reads": 1000, "demand_read_s": 9.0}]}
    read_s, reads = check.run_read_s(runs)  # the alone reads only: not the oracle's
    assert reads == 40 and read_s == pytest.approx(0.004)
    before, after = host_costs(model, hw), host_costs(model, check.with_read_s(hw, model, read_s))
    assert after.read_s == pytest.approx(0.004)
    assert after.parallel == pytest.approx(before.parallel) and before.read_s != after.read_s
    with pytest.raises(StmoeError, match="carry no read times"):
        check.run_read_s({"on-demand": [{"decode_tokens_per_s": 3.0}]})
    rows = [{"system": "oracle", "measured": 2.0, "simulated": 2.1, "range": [1.9, 2.2]}]
    path = sim_vs_measured({"preset": rows, "runs' tier": rows}, "t", tmp_path / "f.png")
    assert path.stat().st_size > 1000

    # which preset the check starts from: --hardware, --calibrate's file, the first round's
    from pathlib import Path as P

    assert check.base_preset(P("mine.toml"), False, ["r1.toml"]) == (P("mine.toml"), True)
    assert check.base_preset(None, True, ["r1.toml"]) == (check.CALIBRATED, True)
    assert check.base_preset(None, False, ["r1.toml", "r2.toml"]) == (P("r1.toml"), False)
    with pytest.raises(StmoeError, match="no hardware preset"):
        check.base_preset(None, False, [])

    # --calibrate's presets, one per round: each round simulated with its own, medians kept
    speeds = {"a.toml": 1.0, "b.toml": 4.0, "c.toml": 2.0}

    def fake(args, read_s=None, hardware=None):
        one = {"decode_tokens_per_s": speeds[hardware], "hit_rate": 0.5, "stall_share": 0.1,
               "bytes_moved": 7}
        return {"systems": {name: one for name in HEADLINE_SYSTEMS}, "costs": {},
                "hardware": "x"}

    merged = check.per_round(lambda p: fake(None, hardware=p), list(speeds), HEADLINE_SYSTEMS)
    assert merged["systems"]["oracle"]["decode_tokens_per_s"] == 2.0  # the median of 1, 4, 2
    assert "each of 3 rounds" in merged["hardware"]


def test_the_host_pipeline_ranks_by_lru_while_admission_skips_a_layers_prediction():
    """As the runtime's planner: a skipped prediction leaves the layer no scores."""
    from stmoe.sim.host import pipeline as host

    experts = np.zeros((3, 2, 1), dtype=np.int64)
    plan = (np.zeros(7, dtype=np.int64), np.zeros(0, dtype=np.int64))  # 3 tokens x 2 layers
    run = host.HostRun(experts, 1, plan, False, 2, "score", admission=True,
                       scores=np.ones((6, 4), dtype=np.float32))
    costs = host.HostCosts(layer_s=0.0, token_s=0.0, expert_s=1.0, read_s=1.0,
                           first_touch_s=0.0, parallel=1.0, workers=1, fifo=False)
    sim = host._Sim(run, costs, 4)
    sim.plan_set(1, 1)  # a fresh admission asks for the prediction: its scores
    assert len(sim.score[1]) == 4
    sim.adm.wants = lambda layer: False
    sim.plan_set(2, 1)
    assert len(sim.score[1]) == 0


def test_a_preset_calibrated_on_another_model_is_named_as_such(cli, tmp_path):
    """Its layer and token times are the calibrated model's (review item 5): a note naming
    both; none where the model matches or the preset predates the key."""
    trace = stmoe.synthesize(tokens=40, layers=4, experts=16, top_k=4, sequences=1, seed=0)
    stmoe.save_trace(trace, tmp_path / "t.npz")
    path = tmp_path / "host.toml"
    text = HOST_TOML.format(pe=1.0, bw=1e9, par=1e9, tier="disk", touch=0.0)
    path.write_text(text)
    args = ["simulate", tmp_path / "t.npz", "--model", "stmoe-tiny", "--layers", "4",
            "--hardware", path, "--pipeline", "runtime"]
    res = cli(*args)
    assert res.exit_code == 0 and "calibrated on a model" not in res.output, res.output
    path.write_text(text.replace("workers = 2", 'workers = 2\nmeasured_on = "40 layers x 256 '
                                 'experts of 6291456 bytes"'))
    res = cli(*args)
    said = " ".join(res.output.split())
    assert res.exit_code == 0, res.output
    assert "calibrated on a model of 40 layers x 256 experts of 6291456 bytes" in said, said
    tiny = model_preset("stmoe-tiny")
    same = f"{4} layers x {tiny.num_experts} experts of {tiny.expert_bytes} bytes"
    path.write_text(text.replace("workers = 2", f'workers = 2\nmeasured_on = "{same}"'))
    res = cli(*args)
    assert res.exit_code == 0 and "calibrated on a model" not in res.output, res.output


def test_a_trace_without_decode_tokens_is_simulated_as_decode_with_a_note(cli, tmp_path):
    model = tmp_path / "tiny.toml"
    fields = {k: v for k, v in dataclasses.asdict(MODEL).items() if k != "name"}
    model.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items()))
    trace = trace_for(tokens=300, sequences=4)
    prompts = stmoe.RoutingTrace(trace.experts, trace.seq_starts,
                                 np.zeros(trace.num_tokens, bool), trace.meta,
                                 domains=trace.domains)
    stmoe.save_trace(prompts, tmp_path / "t.npz")
    result = cli("simulate", tmp_path / "t.npz", "--model", model, "--hardware", "stmoe-asic",
                 "--system", "stmoe")
    assert result.exit_code == 0, result.output
    assert "marks no decode token, so every token is simulated" in " ".join(result.output.split())
