"""A layer call on a device cache (issue 43, item 1's last pieces), on the CPU's stand-in for
a GPU (copies landing late on threads of their own): the router's ids reach the host once per
layer call through one reused buffer, each call's own; an expert -> slot table on the device
renumbers the ids, updated only where a slot changed; the predictor runs after the layer's
compute is launched; a demand's copy overtakes a prefetch's queued copies (4 MiB pieces, at
most two queued). Outputs stay the resident model's bit for bit."""

from __future__ import annotations

import threading
import time

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stmoe.runtime.accelerator import stand_in  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.runtime.device_path import IdsToHost, SlotTable  # noqa: E402
from stmoe.runtime.prompts import greedy_generate  # noqa: E402
from stmoe.runtime.store import ExpertStore, pack  # noqa: E402
from stmoe.runtime.store.device_ops import COPY_DEPTH  # noqa: E402
from stmoe.runtime.store.index import slot_bytes  # noqa: E402
from stmoe.runtime.store.pinned import PinnedHostTier  # noqa: E402
from stmoe.runtime.store.stand_in import HostThreadOps, NoPinning  # noqa: E402
from tiny_moe import packed_with_tables, tiny_model  # noqa: E402

PROMPT = [5, 6, 7, 8, 9, 10, 11]
NEW = 6


def test_each_calls_ids_reach_the_host_after_their_late_copy():
    ops = HostThreadOps(delay=0.05)  # the copy lands well after it is queued
    up = IdsToHost(ops)
    try:
        first = torch.tensor([[3, 1], [2, 0]])
        a = up.rows(first)
        b = up.rows(torch.tensor([[7, 6], [5, 4]]))  # the same buffer, rewritten
        assert a.tolist() == [[3, 1], [2, 0]] and b.tolist() == [[7, 6], [5, 4]]
        assert up.transfers == 2 and ops.copies == 2
    finally:
        ops.close()


def test_the_slot_table_renumbers_on_the_device_and_sends_only_what_changed():
    table = SlotTable(8, torch.device("cpu"))
    ids = torch.tensor([[5, 2], [2, 7]])
    assert table.renumber({2: 0, 5: 3, 7: 1}, ids).tolist() == [[3, 0], [0, 1]]
    assert table.uploads == 1
    assert table.renumber({2: 0, 5: 3}, ids[:1]).tolist() == [[3, 0]]
    assert table.uploads == 1  # nothing changed: nothing sent
    assert table.renumber({2: 4, 7: 1}, ids[1:]).tolist() == [[4, 1]]
    assert table.uploads == 2 and table.known[[2, 5, 7]].tolist() == [4, 3, 1]


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    model, store, tables = packed_with_tables("qwen2_moe", tmp_path_factory.mktemp("dev"))
    want = greedy_generate(model, torch.tensor([PROMPT]), NEW, ignore_eos=True)
    return store, tables, want[0, len(PROMPT):].tolist()


def test_on_a_device_the_ids_go_up_once_per_layer_call_and_the_table_stays_put(qwen):
    store, tables, want = qwen
    calls = []
    with stand_in(delay=0.002), offload(tiny_model("qwen2_moe")[0], store, capacity=8,
                                        predictor="stmoe", tables=tables, tier="gpu") as om:
        path = om.engine.path
        base = path._compute
        path._compute = lambda *a: calls.append(a[0]) or base(*a)
        r = om.generate(PROMPT, max_new_tokens=NEW)
        dev = path._device
    assert r.tokens == want
    assert dev is not None and dev.ids.transfers == len(calls) > 0  # once per layer call
    # every expert has a slot of its own here (capacity = N: slot e holds expert e) and the
    # rest keep theirs: the tables went up at most once per expert, not once per call
    assert sum(t.uploads for t in dev.tables) < len(calls)


def _call_order(store, tables, tier: str) -> tuple[list[str], list[int]]:
    """Each layer call's compute launch and predictor run, in order; the tokens."""
    order: list[str] = []
    with stand_in(), offload(tiny_model("qwen2_moe")[0], store, capacity=4,
                             predictor="stmoe", tables=tables, tier=tier) as om:
        path, planner = om.engine.path, om.engine.planner
        compute, routed = path._compute, planner.after_routing
        path._compute = lambda *a: order.append("compute") or compute(*a)
        planner.after_routing = lambda *a: order.append("predict") or routed(*a)
        return order, om.generate(PROMPT, max_new_tokens=NEW).tokens


def test_on_a_device_the_predictor_runs_after_the_layers_compute_is_launched(qwen):
    store, tables, want = qwen
    for tier, first in (("gpu", ("compute", "predict")), ("disk", ("predict", "compute"))):
        order, tokens = _call_order(store, tables, tier)
        assert tokens == want
        pairs = list(zip(order[0::2], order[1::2], strict=True))
        assert pairs and all(p == first for p in pairs), (tier, pairs[:4])


def _early_lookahead(om, used: list, handed: list) -> None:
    """hybrid at the early point: the lookahead rows its predictor is taught (``used``), and
    whether each ``_lookahead`` call is handed its ids already on the host."""
    pred, planner = om.engine.predictor, om.engine.planner
    learn, look = pred.lookahead, planner._lookahead
    pred.lookahead = lambda layer, ids, slot: used.append(
        (layer, list(ids))) or learn(layer, ids, slot)
    planner._lookahead = lambda *a, early=None: handed.append(
        early is not None) or look(*a, early=early)


def _prompt_stream(om, used: list, handed: list) -> None:
    """stmoe streaming a prompt: the loads each streamed layer queues (``used``), and
    whether each ``_stream_prompt`` call is handed its counts already on the host."""
    planner = om.engine.planner
    assert planner.prompt_routers is not None  # it streams prompts
    stream, prefetch = planner._stream_prompt, planner._prefetch
    planner._stream_prompt = lambda layer, hidden, counts=None: handed.append(
        counts is not None) or stream(layer, hidden, counts)

    def queued(fwd, layer, experts, admit=True, **kw) -> None:
        if not admit:  # a streamed prompt's loads (they skip admission)
            used.append((layer, list(experts)))
        prefetch(fwd, layer, experts, admit, **kw)

    planner._prefetch = queued


@pytest.mark.parametrize("predictor, options, watch", [
    ("hybrid", {"lookahead": "early"}, _early_lookahead), ("stmoe", {}, _prompt_stream)])
def test_on_a_device_the_next_layers_host_work_goes_up_with_the_routers_ids(
        qwen, predictor, options, watch):
    """What the host needs of the next layer beside the router's ids (the early gate
    lookahead's ids; a prompt's counts for its next layer's loads): off a device it comes
    to the host by itself (.to("cpu")); on one that would wait for the layer's experts'
    kernels, so it is computed before them and rides the ids' one copy up. The same rows
    taught, or loads queued, in the same order, and the resident model's tokens."""
    store, tables, want = qwen
    seen = {}
    for tier in ("disk", "gpu"):
        used: list = []
        handed: list[bool] = []
        with stand_in(delay=0.002), offload(tiny_model("qwen2_moe")[0], store, capacity=4,
                                            predictor=predictor, tables=tables, tier=tier,
                                            **options) as om:
            watch(om, used, handed)
            seen[tier] = used, handed, om.generate(PROMPT, max_new_tokens=NEW).tokens
    (host_used, host_handed, host_tokens), (used, handed, tokens) = seen["disk"], seen["gpu"]
    assert host_tokens == tokens == want
    assert used == host_used and len(used) > 0
    assert not any(host_handed) and handed and all(handed)  # on the device: brought up


def _demand_wait(tier: PinnedHostTier, work, other, per_block: float) -> float:
    """Seconds the compute thread's copy of ``other`` takes once it stalls a quarter of a
    block's time into ``work(between)`` on a worker thread (a prefetch's copies, given the
    ``between`` that holds back while the compute thread stalls)."""
    stalled, resumed = threading.Event(), threading.Event()

    def between() -> None:
        if stalled.is_set():
            resumed.wait(10.0)

    worker = threading.Thread(target=lambda: work(between))
    worker.start()
    time.sleep(per_block / 4)  # a quarter through the worker's copy
    stalled.set()  # the compute thread stalls on a miss and copies it
    start = time.perf_counter()
    demand = [torch.empty(slot_bytes(t), dtype=torch.uint8) for t in other.tensors]
    tier.load(other, demand, tier.ops.new_stream(-1)).synchronize()
    waited = time.perf_counter() - start
    resumed.set()
    worker.join(10.0)
    return waited


def _slot(block) -> list:
    return [torch.empty(slot_bytes(t), dtype=torch.uint8) for t in block.tensors]


def test_a_demands_copy_overtakes_a_prefetchs_queued_copies(tmp_path):
    """One copy engine serving every stream in the order copies were queued (the stand-in's
    worst case): a 'worker' copies one block in 8 pieces and, like a prefetch worker, holds
    back between pieces while the compute thread stalls; the compute thread's copy of another
    block then waits behind at most COPY_DEPTH pieces. Given whole, the worker's block is
    queued ahead of it and the demand waits for most of it."""
    model, _ = tiny_model("mixtral", intermediate_size=2048)  # 3 MiB experts (float32)
    store = ExpertStore(pack(model, tmp_path / "store"))
    block, other = store.blocks[(0, 0)], store.blocks[(0, 1)]
    per_block = 0.4  # seconds a block takes on the engine
    ops = HostThreadOps(bytes_per_s=block.nbytes / per_block, one_engine=True)
    tier = PinnedHostTier(store, NoPinning(), ops)
    tier.chunk_bytes = block.nbytes // 8
    piece_s = per_block / 8
    try:
        waits = {chunked: _demand_wait(tier, lambda between, chunked=chunked: tier.load(
            block, _slot(block), ops.new_stream(), between if chunked else None
        ).synchronize(), other, per_block) for chunked in (True, False)}
        own = per_block * other.nbytes / block.nbytes
        assert waits[True] <= own + COPY_DEPTH * piece_s + 0.1, waits
        assert waits[False] >= own + 0.6 * per_block, waits
    finally:
        tier.close()
        ops.close()


def test_a_workers_copies_in_flight_are_bounded_across_its_experts(tmp_path):
    """A worker prefetching several experts of two pieces each (a fused gate-up and a down
    matrix, under the 4 MiB piece: Qwen3.6's 6 MiB experts are 4 + 2 MiB) used to queue
    every one of them on the copy stream at once: it never had COPY_DEPTH pieces of one
    expert to wait for. A demand's copy then waited behind all of them on one engine. The
    thread's CopyWindow holds a worker to COPY_DEPTH pieces across its experts, and the
    worker chooses its next expert only when there is room (as ``Prefetcher`` does)."""
    from stmoe.runtime.store.device_ops import thread_window

    model, _ = tiny_model("mixtral", intermediate_size=2048)  # 3 MiB experts (float32)
    store = ExpertStore(pack(model, tmp_path / "store"))
    blocks = [store.blocks[(0, e)] for e in range(6)]
    other = store.blocks[(1, 0)]
    per_block = 0.2  # seconds a block takes on the engine
    ops = HostThreadOps(bytes_per_s=blocks[0].nbytes / per_block, one_engine=True)
    tier = PinnedHostTier(store, NoPinning(), ops)
    assert all(len(b.tensors) == 2 and max(slot_bytes(t) for t in b.tensors) <= tier.chunk_bytes
               for b in blocks)

    def worker(between) -> None:
        stream, window = ops.new_stream(), thread_window()
        for block in blocks:
            window.make_room()
            tier.load(block, _slot(block), stream, between)
        window.make_room()

    try:
        waited = _demand_wait(tier, worker, other, per_block)
        largest = max(slot_bytes(x) for x in blocks[0].tensors) / blocks[0].nbytes
        # its own copy, and at most COPY_DEPTH of the worker's pieces ahead of it
        assert waited <= per_block + COPY_DEPTH * largest * per_block + 0.1, waited
    finally:
        tier.close()
        ops.close()


def test_a_gpu_tiers_copies_and_waits_are_timed_by_the_device(qwen):
    """On-demand on a link of 1 MB/s (the stand-in's copies take their bytes' time): the
    run's copy bandwidth, from the device's events, is the link's, and the compute stream's
    waits for the copies are counted as the device's stall."""
    store, _, want = qwen
    ops = HostThreadOps(bytes_per_s=1e6)
    with stand_in(ops=ops), offload(tiny_model("qwen2_moe")[0], store, capacity=2,
                                    predictor="ondemand", policy="none", tier="gpu") as om:
        r = om.generate(PROMPT, max_new_tokens=NEW)
    assert r.tokens == want
    for phase in ("prefill", "decode"):
        dev = r.stats["phases"][phase]["device"]
        assert dev["copies"] > 0 and dev["copy_bytes"] > 0
        # the link's 1 MB/s (a thread's hand-off per copy is the rest)
        assert 0.6 * 1e-3 <= dev["copy_GBps"] <= 1.05 * 1e-3, dev
        # every byte the compute thread loaded came through a timed copy
        assert 0.5 * dev["copy_busy_s"] <= dev["device_stall_s"], dev
    decode = r.stats["phases"]["decode"]
    assert decode["device"]["copies"] == decode["demand_reads"]
    assert decode["device"]["device_stall_s"] < r.decode_s
