"""`stmoe calibrate`: this machine measured as a hardware preset `stmoe simulate` takes."""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import tomllib

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import stmoe
from stmoe.sim.specs import hardware_preset

FAST = ("--seconds", "0.2", "--tokens", "2")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer random checkpoint of the shipped model's shape and its store."""
    from stmoe.hf.checkpoints import make_checkpoint, plan_checkpoint
    from stmoe.hf.loading import load_causal_lm
    from stmoe.runtime.store import pack

    root = tmp_path_factory.mktemp("calibrate")
    model_dir = make_checkpoint(plan_checkpoint("stmoe-tiny", layers=2, dtype="float32"),
                                root / "m")
    pack(load_causal_lm(model_dir), root / "store", source=model_dir)
    return root, model_dir


def test_the_preset_loads_says_how_each_number_was_found_and_simulates(tiny, cli):
    root, model_dir = tiny
    out = root / "hw.toml"
    res = cli("calibrate", "--model", model_dir, "--store", root / "store", "-o", out, *FAST)
    assert res.exit_code == 0, res.output
    assert "GB/s alone" in res.output and "per decode token" in res.output
    spec = hardware_preset(str(out))
    host = spec.host
    assert host is not None and host.tier == "disk" and host.workers == 2
    assert spec.cache_experts_per_layer == 8  # 50% of 16 experts
    assert spec.link_bytes_per_s > 0 and host.read_parallel_bytes_per_s > 0
    assert spec.pe_macs_per_cycle > 0 and host.layer_s > 0
    text = out.read_text()
    keys = [line for line in text.splitlines() if "=" in line and not line.startswith("#")]
    table = tomllib.loads(text)
    assert len(keys) == len(table) - 2 + len(table["host"]) + len(table["dataflows"])
    for line in keys:  # every number says where it comes from
        assert "#" in line, line
    measured = [line for line in keys if "# measured" in line]
    assert len(measured) >= 7  # speed, latency, compute, parallel reads, layer, token, touch
    note = {line.split("=", 1)[0].strip(): line.split("#", 1)[1] for line in keys}
    for key in ("link_bytes_per_s", "link_latency_s", "read_parallel_bytes_per_s"):
        assert "faulted-in" in note[key] or "faulted in" in note[key], note[key]  # the tier's
    assert "never-touched" in note["first_touch_s"] and "spare row" in note["first_touch_s"]
    assert "ms an expert" in note["first_touch_s"]  # the cache's own faulting in, per slot
    from stmoe.runtime.store.tiers import CHUNK_BYTES

    assert host.chunk_bytes == CHUNK_BYTES  # the runtime's pieces, for the simulator
    assert "on " in table["source"] and "UTC" in table["source"]

    trace = stmoe.synthesize(tokens=30, layers=8, experts=16, top_k=4, sequences=1, seed=2)
    stmoe.save_trace(trace, root / "t.npz")
    for pipeline in ("runtime", "accelerator"):
        res = cli("simulate", root / "t.npz", "--model", "stmoe-tiny", "--layers", "2",
                  "--hardware", out, "--pipeline", pipeline, "--system", "oracle",
                  "--system", "stmoe", "--json", root / f"{pipeline}.json")
        assert res.exit_code == 0, res.output
    import json

    data = json.loads((root / "runtime.json").read_text())
    oracle = data["systems"]["oracle"]
    decode = int(np.count_nonzero(trace.is_decode))
    assert oracle["decode_tokens"] == decode and oracle["decode_s"] > 0
    assert data["capacity"] == 8 and "IN-SAMPLE" in data["tables"]


@pytest.mark.parametrize("tier", ["gpu", "gpu-disk"])
def test_a_gpu_tier_is_measured_into_device_slots(tiny, cli, tier):
    """On the CPU's stand-in for a GPU whose copies take their bytes' time at 200 MB/s:
    the tier's speed is the copies' (reads land in device slots, until their copy's event),
    no page faults (HBM has none), and the preset loads for the simulator."""
    from stmoe.runtime.accelerator import stand_in
    from stmoe.runtime.store.stand_in import HostThreadOps

    root, model_dir = tiny
    out = root / f"{tier}.toml"
    with stand_in(ops=HostThreadOps(bytes_per_s=200e6)):
        res = cli("calibrate", "--model", model_dir, "--store", root / "store", "-o", out,
                  "--tier", tier, *FAST)
    assert res.exit_code == 0, res.output
    spec = hardware_preset(str(out))
    assert spec.host is not None and spec.host.tier == tier
    assert spec.host.first_touch_s == 0.0
    # the copies' 200 MB/s, less the stand-in's hand-offs (and the disk's read, gpu-disk); the
    # latency subtracted from each read is measured apart, and under load it can take more
    # of a read's time than it did then, which raises the rate (a loaded CI run: 247 MB/s;
    # the suite runs two tests at a time, so the bound is 1 GB/s: the bug this guards
    # against, the host's issue timed for the copy, read 221 TB/s)
    assert 20e6 <= spec.link_bytes_per_s <= 1e9, spec.link_bytes_per_s
    assert spec.link_latency_s > 0 and spec.host.layer_s > 0


@pytest.mark.parametrize("tier", ["gpu", "gpu-disk"])
def test_a_gpu_tiers_runtime_reads_are_its_copies_not_their_issue(tiny, cli, tier):
    """With --routing the single reader's speed is the runtime's own reads of its misses
    (what the GPU check calibrates with). On a gpu tier the host only queues a read's copy:
    timed by the host, a 200 MB/s link came out at 221 TB/s (the issue's microseconds, less
    the latency, clamped). The copies' own time, from the device's events, is the read's."""
    from stmoe.runtime.accelerator import stand_in
    from stmoe.runtime.store.stand_in import HostThreadOps

    root, model_dir = tiny
    trace = stmoe.synthesize(tokens=40, layers=2, experts=16, top_k=4, sequences=1, seed=2)
    stmoe.save_trace(trace, root / "routed.npz")
    out = root / f"{tier}-routed.toml"
    with stand_in(ops=HostThreadOps(bytes_per_s=200e6)):
        res = cli("calibrate", "--model", model_dir, "--store", root / "store", "-o", out,
                  "--tier", tier, "--routing", root / "routed.npz", "--capacity", "4", *FAST)
    assert res.exit_code == 0, res.output
    assert "the runtime's reads" in res.output
    spec = hardware_preset(str(out))
    assert 20e6 <= spec.link_bytes_per_s <= 1e9, spec.link_bytes_per_s  # (bound: above)
    assert "timed by the device's events" in out.read_text()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--tier", "nvme"), "calibrate measures --tier disk, emulated, gpu, gpu-disk"),
        pytest.param(("--tier", "gpu"), "--tier gpu needs CUDA",
                     marks=pytest.mark.skipif(__import__("torch").cuda.is_available(),
                                              reason="CUDA is present")),
        (("--tier", "emulated"), "needs a bandwidth"),
        (("--bandwidth", "1GB"), "--bandwidth applies to --tier emulated only"),
        (("--seconds", "0"), "--seconds 0.0: expected a number above 0 and at most 600"),
        (("--tokens", "0"), "--tokens 0: expected an integer from 1 to 1000"),
        (("--capacity", "2"), "below the router's top-4"),
    ],
)
def test_bad_requests_are_one_clear_line(tiny, cli, args, message):
    root, model_dir = tiny
    out = root / "bad.toml"
    res = cli("calibrate", "--model", model_dir, "--store", root / "store", "-o", out,
              *FAST, *args)
    assert res.exit_code == 1, res.output
    assert message in res.output and "Traceback" not in res.output
    assert not out.exists()


def resident(addr: int, nbytes: int) -> bool:
    """Whether every page of [addr, addr + nbytes) is in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    start = addr - addr % mmap.PAGESIZE
    pages = -(-(addr + nbytes - start) // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    rc = libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * mmap.PAGESIZE), vec)
    assert rc == 0, ctypes.get_errno()
    return all(v & 1 for v in vec)


@pytest.mark.skipif(sys.platform != "linux", reason="mincore residency: Linux")
def test_reads_land_in_faulted_in_memory_and_faults_are_measured_apart(tiny, monkeypatch):
    """Every read of the bandwidth and latency measurements goes into memory whose pages
    are resident before it starts (as the runtime's slots, faulted in when the cache is
    made), so they time the tier, not page faults; the first-touch measurement alone
    reads into never-touched memory, half its reads, the other half into a faulted slot."""
    from stmoe.runtime.calibrate import reads as cal
    from stmoe.runtime.store import open_store
    from stmoe.runtime.store.reading import open_tier

    root, model_dir = tiny
    store = open_store(model_dir, root / "store")
    tier = open_tier("disk", store, None, 0.0)
    seen: list[bool] = []
    fill, preadv = cal._fill, os.preadv

    def checked_fill(tier, store, block, parts, buf):
        seen.append(resident(parts[0].ctypes.data, sum(p.nbytes for p in parts)))
        return fill(tier, store, block, parts, buf)

    def checked_preadv(fd, buffers, offset):
        seen.append(all(resident(np.frombuffer(b, np.uint8).ctypes.data, len(b))
                        for b in buffers))
        return preadv(fd, buffers, offset)

    monkeypatch.setattr(cal, "_fill", checked_fill)
    try:
        with monkeypatch.context() as m:  # the latency's one-page reads (the tier's own too)
            m.setattr(os, "preadv", checked_preadv)  # the tiers' own module, os
            cal.measure_latency(store, tier, 0.05, 0)
        cal.measure_reads(store, tier, 1, 0.1, 0)
        cal.measure_reads(store, tier, 3, 0.1, 2)
        assert len(seen) > 3 and all(seen)
        seen.clear()
        faults = cal.measure_page_faults(store, tier, 4, 0)
    finally:
        tier.close()
    assert sorted(seen) == [False] * 4 + [True] * 4
    assert faults.reads == 4 and faults.first_touch_s >= 0 and faults.populate_s > 0


def test_the_shipped_model_is_the_default_as_for_generate(cli, tmp_path):
    """(--model was required, where generate and serve default to the shipped model.)"""
    out = tmp_path / "hw.toml"
    res = cli("calibrate", "-o", out, "--predictors", "none", *FAST)
    assert res.exit_code == 0, res.output
    assert hardware_preset(str(out)).cache_experts_per_layer == 8  # 50% of its 16 experts


def test_bad_paths_are_refused_before_measuring(tiny, cli):
    root, model_dir = tiny
    res = cli("calibrate", "--model", root / "nowhere", "--store", root / "store",
              "-o", root / "x.toml", *FAST)
    assert res.exit_code == 1 and "nowhere" in res.output
    res = cli("calibrate", "--model", model_dir, "--store", root / "store", "-o", root / "x.txt")
    assert res.exit_code == 1 and "expected a .toml file name" in res.output
    (root / "d.toml").mkdir()
    res = cli("calibrate", "--model", model_dir, "--store", root / "store", "-o", root / "d.toml")
    assert res.exit_code == 1 and "is a directory" in res.output


def test_reads_follow_a_traces_routing(tiny, tmp_path, cli):
    """--routing: the blocks read are those the runtime reads, the misses of an LRU cache
    of the capacity over the trace's decode tokens (the prompt warms it), token by token
    and layer by layer (each layer's experts sorted); another shape is one clear line."""
    from collections import OrderedDict

    from stmoe.errors import OffloadError
    from stmoe.runtime.calibrate import routed_blocks
    from stmoe.runtime.store import ExpertStore
    from stmoe.trace import save_trace
    from stmoe.trace.synth import synthesize

    root, model_dir = tiny
    store = ExpertStore(root / "store")
    trace = synthesize(tokens=12, layers=3, experts=16, top_k=4, sequences=1)
    save_trace(trace, tmp_path / "t.npz")
    for capacity in (4, 6, 16):
        order = routed_blocks(store, tmp_path / "t.npz", capacity)
        want, caches = [], [OrderedDict() for _ in range(2)]
        for t in range(12):
            for layer in range(2):
                for e in sorted(set(trace.experts[t, layer].tolist())):
                    if e in caches[layer]:
                        caches[layer].move_to_end(e)
                        continue
                    if trace.is_decode[t]:
                        want.append((layer, e))
                    caches[layer][e] = None
                    if len(caches[layer]) > capacity:
                        caches[layer].popitem(last=False)
        assert [(b.layer, b.expert) for b in order] == want, capacity
    every = [(b.layer, b.expert) for b in routed_blocks(store, tmp_path / "t.npz", 16)]
    assert len(every) == len(set(every))  # all 16 fit: only first uses miss
    assert len(routed_blocks(store, tmp_path / "t.npz", 4)) > len(every)
    other = synthesize(tokens=5, layers=3, experts=8, top_k=2, sequences=1)
    save_trace(other, tmp_path / "o.npz")
    with pytest.raises(OffloadError, match="routes 3 layers of 8 experts; the store has 2 of 16"):
        routed_blocks(store, tmp_path / "o.npz", 4)
    res = cli("calibrate", "--model", model_dir, "--store", root / "store", "--routing",
              tmp_path / "t.npz", "--capacity", "4", "-o", tmp_path / "hw.toml",
              *FAST)
    assert res.exit_code == 0, res.output
    # the single reader's speed is the runtime's own reads in an LRU-only replay
    said = " ".join(res.output.split())
    assert "the runtime's reads:" in said and "calibrate's loop:" in said
    text = (tmp_path / "hw.toml").read_text()
    note = next(line for line in text.splitlines() if line.startswith("link_bytes_per_s"))
    assert "the runtime's own reads of its decode misses" in note, note
    reads = int(note.split("(")[1].split(" reads")[0])
    # the decode misses of an LRU cache of 4, as routed_blocks counts them, up to how the
    # prompt (one call of several tokens) leaves the cache
    routed = len(routed_blocks(store, tmp_path / "t.npz", 4))
    assert reads >= 8 and abs(reads - routed) <= routed // 4, (reads, routed)
    spec = hardware_preset(str(tmp_path / "hw.toml"))
    assert spec.link_bytes_per_s > 0 and spec.host is not None


@pytest.mark.parametrize(("args", "message"), [
    (("--pipeline", "runtime", "--policy", "lfu"), "--policy: an option of --pipeline accelerator"),
    (("--pipeline", "runtime", "--batch", "4"), "--batch: an option of --pipeline accelerator"),
    (("--capacity", "25%"), "--capacity: an option of --pipeline runtime"),
    (("--pipeline", "runtime", "--capacity", "nan%"), "expected 4 to 16 experts per layer"),
    (("--pipeline", "runtime", "--capacity", "-5%"), "a share is from 0% to 100%"),
    (("--pipeline", "runtime", "--capacity", "2"), "below the router's top-4"),
    (("--pipeline", "runtime", "--capacity", "64MB"), "not a count or a share"),
])
def test_simulate_refuses_what_its_pipeline_would_ignore(tiny, tmp_path, cli, args, message):
    """An option of the other pipeline, or an absurd capacity, is one line, not ignored."""
    from stmoe.trace import save_trace
    from stmoe.trace.synth import synthesize

    root, model_dir = tiny
    hw = root / "hw-sim.toml"
    if not hw.exists():
        res = cli("calibrate", "--model", model_dir, "--store", root / "store", "-o", hw, *FAST)
        assert res.exit_code == 0, res.output
    save_trace(synthesize(tokens=40, layers=2, experts=16, top_k=4, sequences=1),
               tmp_path / "t.npz")
    res = cli("simulate", tmp_path / "t.npz", "--model", "stmoe-tiny", "--layers", "2",
              "--hardware", hw, *args)
    assert res.exit_code == 1 and message in res.output, res.output


def test_the_compute_totals_are_a_run_without_clocks_and_the_split_is_scaled_to_it(
        tiny, monkeypatch):
    """On a GPU each of the split's clocks synchronises the device, which a real run does not
    (four device waits a layer): a clock that costs 10 ms here stands for that (2 ms was
    within a loaded machine's noise between two runs: CI once saw 6 ms of the 16 a token).
    The token's time is a run with no clocks, and the layers' and experts' shares are scaled
    to it, so the clocks' cost reaches no figure the simulator reads."""
    import time

    from stmoe.runtime.calibrate import compute
    from stmoe.runtime.options import CalibrateOptions

    root, model_dir = tiny
    CLOCK_S = 0.01

    def slow_clock(device):
        def now():
            time.sleep(CLOCK_S)
            return time.perf_counter()
        return now

    monkeypatch.setattr(compute, "_clock", slow_clock)
    f = compute.measure_compute(model_dir, root / "store", CalibrateOptions(tokens=3), top_k=4)
    layers = f["num_layers"]
    # the clocked run paid at least 4 clocks a layer a token (two hooks, two around experts)
    # (half of the clocks' 80 ms a token: a loaded machine's noise between two runs is not)
    assert f["token_s_clocked"] - f["token_s"] >= 0.5 * 4 * layers * CLOCK_S, f
    assert 0 < f["experts_s"] < f["layers_s"] < f["token_s"], f


def test_a_latency_near_the_mean_read_gives_no_absurd_bandwidth(tiny, cli, monkeypatch):
    """Where the one-page latency measured is near or above an expert's mean read (a tiny
    expert, a noisy machine), subtracting it left a read of 1 ns (or 1e-11 s just below the
    mean), and the preset said the disk moved petabytes a second. Now a tenth of the mean at
    least is transfer, the rest latency: the two still add up to the measured mean."""
    from stmoe.runtime import calibrate
    from stmoe.runtime.calibrate import split_read

    assert split_read(3e-4, 1e-4) == (3e-4 - 1e-4, 1e-4)  # the latency as measured
    for latency in (3e-4, 1e-4, 1.0000001e-4 - 1e-18):  # above, equal, a hair below
        transfer, kept = split_read(1.0000001e-4, latency)
        assert transfer == pytest.approx(1.0000001e-5) and transfer + kept == pytest.approx(
            1.0000001e-4)
    with pytest.raises(stmoe.errors.OffloadError, match="mean read"):
        split_read(0.0, 1e-4)
    monkeypatch.setattr(calibrate, "measure_latency", lambda *a, **k: 5.0)  # 5 s a page
    root, model_dir = tiny
    out = root / "slow-latency.toml"
    res = cli("calibrate", "--model", model_dir, "--store", root / "store", "-o", out, *FAST,
              "--predictors", "none")
    assert res.exit_code == 0, res.output
    spec = hardware_preset(str(out))
    text = out.read_text()
    assert 1e6 < spec.link_bytes_per_s < 1e12, spec.link_bytes_per_s
    assert 0 < spec.link_latency_s < 5.0
    assert "could not be told apart" in text and "5000000.0 us" in text
