"""The host pipeline models the runtime's admission and its demand-first chunked reads."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stmoe.sim.host import pipeline as host


def costs(chunks: int = 1, fifo: bool = True, workers: int = 2,
          read_s: float = 1.0) -> host.HostCosts:
    return host.HostCosts(layer_s=0.5, token_s=0.0, expert_s=0.0, read_s=read_s,
                          first_touch_s=0.0, parallel=1.0, workers=workers, fifo=fifo,
                          chunks=chunks)


def plan_of(sets: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    ptr = np.cumsum([0] + [len(c) for c in sets]).astype(np.int64)
    return ptr, np.asarray([e for c in sets for e in c], dtype=np.int64)


@pytest.mark.parametrize("chunks", [1, 4])
def test_a_demand_read_waits_at_most_one_chunk_behind_another_layers_prefetch(chunks):
    """A worker reads layer 1's expert (1 s alone on one FIFO link) when layer 0 stalls on
    a miss: whole, the miss waits the read's rest; in 4 pieces, at most one piece (0.25 s),
    then the parked read goes on once the stall ends."""
    run = host.HostRun(np.zeros((2, 2, 1), dtype=np.int64), 1, None, False, 2, "lru")
    sim = host._Sim(run, costs(chunks), 4)
    sim.queue_set(1, 1, np.asarray([3]))  # a worker starts reading (1, 3) at t = 0
    sim.t = 0.1  # the compute thread reaches layer 0 and misses expert 2
    sim.pos, sim.paused = (1, 0), True
    sim._advance(sim.t)
    rid = sim._read(0, 2, False, sim.t, spare=False)
    sim._wait(rid)
    waited = sim.t - 0.1
    if chunks == 1:  # behind the prefetch's whole remaining 0.9 s, then its own 1 s
        assert waited == pytest.approx(1.9)
    else:  # behind the piece in flight (done at 0.25), then its own 1 s
        assert waited == pytest.approx(0.15 + 1.0)
        assert waited - 1.0 <= 1.0 / chunks + 1e-12
        assert sim.tier.parked and sim.state[1, 3] == host.LOADING
    sim.paused = False
    sim.tier.resume(sim.t)
    while sim.state[1, 3] != host.READY:
        sim._wait()
    assert not sim.tier.chunks_left and sim.t == pytest.approx(1.25 + 0.75)


def test_the_stalled_layers_own_prefetch_is_never_parked():
    """A piece of a read for the layer the compute thread waits at goes straight on: it is
    what the layer waits for."""
    run = host.HostRun(np.zeros((2, 2, 1), dtype=np.int64), 1, None, False, 2, "lru")
    sim = host._Sim(run, costs(4), 4)
    sim.queue_set(1, 0, np.asarray([3]))
    sim.pos, sim.paused = (1, 0), True
    while sim.state[0, 3] != host.READY:
        sim._wait()
    assert not sim.tier.parked and sim.state[0, 3] == host.READY
    assert sim.t == pytest.approx(1.0)


def routing(rng: np.random.Generator, tokens: int, layers: int, experts: int,
            k: int) -> np.ndarray:
    return np.stack([[rng.choice(experts, k, replace=False) for _ in range(layers)]
                     for _ in range(tokens)])


def simulate(experts: np.ndarray, sets: list[list[int]], admission: bool,
             read_s: float = 1.0) -> dict[str, float]:
    run = host.HostRun(experts, 4, plan_of(sets), False, 6, "lru", admission=admission)
    return host.simulate_host(run, costs(fifo=False, read_s=read_s), 16)


def test_admission_turns_an_unpredictable_layers_prefetch_off_and_saves_its_reads():
    """Random routing, random predictions of 6 of 16 experts: prefetch evicts what LRU
    would hit and wastes most reads. Admission turns the layers off (probing now and
    then) and its ranks' measured precision (1/8 here) falls below the break-even of a
    busy tier, so almost nothing is loaded: fewer bytes and less time than every predicted
    load."""
    rng = np.random.default_rng(0)
    experts = routing(rng, 4 + 120, 2, 16, 2)
    sets = [rng.choice(16, 6, replace=False).tolist() for _ in range(experts.shape[0] * 2)]
    on, every = simulate(experts, sets, True), simulate(experts, sets, False)
    assert on["turned_off"] >= 1 and on["off_calls"] > 0 and on["probes"] >= 1
    assert on["prefetch_loads"] < 0.1 * every["prefetch_loads"]
    assert on["moved"] < 0.7 * every["moved"] and on["wasted"] < 0.3 * every["wasted"]
    assert on["time"] < every["time"]
    assert "turned_off" not in every  # admission off: nothing of it reported


def test_admission_keeps_a_predictable_layers_prefetch_on():
    """Predictions that are the routed experts (a perfect table), on a tier that delivers
    them within a layer's time (0.1 s a read, 0.5 s a layer: the bandwidth budget admits
    5), stay admitted: no layer turned off, every decode expert a hit, as with every load
    made."""
    rng = np.random.default_rng(1)
    experts = routing(rng, 4 + 60, 2, 16, 2)
    sets = [experts[t, layer].tolist() for t in range(experts.shape[0]) for layer in range(2)]
    on, every = simulate(experts, sets, True, 0.1), simulate(experts, sets, False, 0.1)
    assert on["turned_off"] == 0 and on["off_calls"] == 0
    assert on["hits"] == on["demanded"] == every["hits"]
    assert on["time"] == pytest.approx(every["time"])


def test_the_runtime_systems_name_their_admission():
    from stmoe.sim.host.systems import HostOptions, admitted, system_of

    assert system_of("stmoe-plus-all") == system_of("stmoe-plus")
    assert admitted("stmoe", HostOptions(capacity=4))
    assert not admitted("stmoe-all", HostOptions(capacity=4))
    assert not admitted("stmoe", HostOptions(capacity=4, admission=False))


def test_a_preset_says_the_chunk_size_or_gets_the_runtimes(tmp_path):
    import math

    from test_simulator import HOST_TOML, MODEL

    from stmoe.sim.host.systems import host_costs
    from stmoe.sim.specs import SpecError, hardware_preset

    text = HOST_TOML.format(pe=1.0, bw=1e9, par=1e9, tier="disk", touch=0.0)
    path = tmp_path / "hw.toml"
    path.write_text(text)  # written before the runtime chunked: no chunk_bytes
    c = host_costs(MODEL, hardware_preset(str(path)))
    assert c.chunks == max(1, math.ceil(MODEL.expert_bytes / (4 << 20)))
    path.write_text(text + "chunk_bytes = 4096\n")
    c = host_costs(MODEL, hardware_preset(str(path)))
    assert c.chunks == math.ceil(MODEL.expert_bytes / 4096)
    assert c.chunk_s == pytest.approx(MODEL.expert_bytes / c.chunks / 1e9)
    path.write_text(text + "chunk_bytes = 10\n")
    with pytest.raises(SpecError, match="chunk_bytes is 10, expected >= 4096"):
        hardware_preset(str(path))


def test_simulate_runtime_says_each_systems_admission(cli, tmp_path):
    from test_simulator import HOST_TOML

    import stmoe
    from stmoe.trace import save_trace

    tiny = stmoe.synthesize(tokens=40, layers=4, experts=16, top_k=4, sequences=1, seed=0)
    save_trace(tiny, tmp_path / "t.npz")
    (tmp_path / "hw.toml").write_text(HOST_TOML.format(pe=1e3, bw=1e9, par=1e9, tier="disk",
                                                       touch=0.0))
    res = cli("simulate", tmp_path / "t.npz", "--model", "stmoe-tiny", "--layers", "4",
              "--hardware", tmp_path / "hw.toml", "--pipeline", "runtime", "--capacity", "8",
              "--system", "stmoe", "--system", "stmoe-all", "--system", "oracle")
    assert res.exit_code == 0, res.output
    rows = {line.split()[1]: line for line in res.output.splitlines()
            if line.strip().startswith("│ ") and line.split()[1] in ("stmoe", "stmoe-all",
                                                                       "oracle")}
    assert "layers off at the end" in rows["stmoe"], res.output
    assert "off: every load" in rows["stmoe-all"] and "exempt" in rows["oracle"]


def test_simulate_runtime_takes_one_count_per_layer(cli, tmp_path):
    """`--capacity 8,8,8,8` (`stmoe split-capacity`'s form) is `--capacity 8`'s run; a split
    is run as given, named in the title and the JSON; a count per layer too few is refused
    naming both numbers."""
    from test_simulator import HOST_TOML

    import stmoe
    from stmoe.trace import save_trace

    tiny = stmoe.synthesize(tokens=40, layers=4, experts=16, top_k=4, sequences=1, seed=0)
    save_trace(tiny, tmp_path / "t.npz")
    (tmp_path / "hw.toml").write_text(HOST_TOML.format(pe=1e3, bw=1e9, par=1e9, tier="disk",
                                                       touch=0.0))
    base = ["simulate", tmp_path / "t.npz", "--model", "stmoe-tiny", "--layers", "4",
            "--hardware", tmp_path / "hw.toml", "--pipeline", "runtime", "--json", "-"]
    runs = {}
    for capacity in ("8", "8,8,8,8", "16,4,4,8"):
        res = cli(*base, "--capacity", capacity)
        assert res.exit_code == 0, res.output
        runs[capacity] = json.loads(res.stdout)
    assert runs["8"]["systems"] == runs["8,8,8,8"]["systems"]
    assert runs["16,4,4,8"]["capacity"] == [16, 4, 4, 8]
    assert runs["16,4,4,8"]["systems"] != runs["8"]["systems"]
    shown = cli(*base[:-2], "--capacity", "16,4,4,8", "--system", "lru-only")
    assert shown.exit_code == 0 and "16,4,4,8 experts cached (each MoE layer's)" in shown.output
    bad = cli(*base, "--capacity", "8,8")
    assert bad.exit_code != 0 and "--capacity '8,8': 2 counts for 4 MoE layers" in bad.output


def test_the_oracle_prefetches_the_first_decode_tokens_first_layer_as_the_runtimes_does():
    """The runtime's oracle plans the next call's layer 0 as the prompt's last layer ends;
    the simulated one waited for that expert on demand (every layer's expert here is new,
    each read 0.1 s against 0.5 s of compute: a prefetched one never stalls)."""
    experts = np.arange(5 * 2).reshape(5, 2, 1)  # 2 prompt + 3 decode tokens, 2 layers
    run = host.HostRun(experts, 2, None, True, 6, "lru")
    out = host.simulate_host(run, costs(fifo=False, read_s=0.1), 16)
    assert out["stall"] == 0.0, out
