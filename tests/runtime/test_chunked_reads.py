"""Demand first (runtime.store.tiers): reads in chunks with a hook between them, the same
bytes as one read, and a demand read on the emulated link waiting behind at most one
chunk of a prefetch in flight whose worker holds back while the compute thread stalls."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from refused_o_direct import refuse_o_direct_reads  # noqa: E402
from stmoe.runtime.store import ExpertStore, pack  # noqa: E402
from stmoe.runtime.store.tiers import (  # noqa: E402
    DiskTier,
    EmulatedLinkTier,
    _pieces,
    aligned_buffer,
    chunks,
    padded,
)
from tiny_moe import tiny_model  # noqa: E402


def test_chunks_cover_the_block_in_order():
    assert chunks(10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert chunks(8, 4) == [(0, 4), (4, 8)]
    assert chunks(3, 4) == [(0, 3)] and chunks(9, 0) == [(0, 9)]
    a, b = memoryview(bytearray(6)), memoryview(bytearray(5))
    pieces = _pieces([a, b], 4)  # 6 + 5 bytes end to end, in 4-byte reads
    assert [sum(map(len, p)) for p in pieces] == [4, 4, 3]
    assert [len(v) for v in pieces[1]] == [2, 2]  # the second read spans both views


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    model, _ = tiny_model("mixtral", intermediate_size=2048)  # 3 MiB experts (float32)
    return ExpertStore(pack(model, tmp_path_factory.mktemp("chunks") / "store"))


def test_a_chunked_disk_read_brings_the_same_checked_bytes(store):
    tier = DiskTier(store)
    tier.chunk_bytes = 1 << 18
    try:
        for block in list(store.blocks.values())[:3]:
            whole = tier.fetch(block, aligned_buffer(padded(block))).numpy().copy()
            calls: list[int] = []
            got = tier.fetch(block, aligned_buffer(padded(block)), lambda c=calls: c.append(1))
            assert np.array_equal(got.numpy(), whole)
            assert len(calls) == len(chunks(padded(block) if tier.direct else block.nbytes,
                                             tier.chunk_bytes)) - 1 > 0
    finally:
        tier.close()


def test_a_demand_read_waits_behind_one_chunk_of_a_prefetch_in_flight(store):
    """A 'worker' reads one block in 8 chunks and, like a prefetch worker, holds back
    between chunks while the compute thread stalls; the compute thread's read of another
    block then costs its own transfer plus at most the chunk in flight. Without chunks it
    waits for the worker's whole block."""
    block, other = list(store.blocks.values())[:2]
    per_block = 0.4  # seconds a block takes on the link
    tier = EmulatedLinkTier(store, bandwidth=block.nbytes / per_block)
    tier.chunk_bytes = block.nbytes // 8
    chunk_s = tier.chunk_bytes / tier.bandwidth
    try:
        waits = {}
        for chunked in (True, False):
            stalled = threading.Event()
            resumed = threading.Event()

            def between(stalled=stalled, resumed=resumed) -> None:
                if stalled.is_set():
                    resumed.wait(5.0)

            worker = threading.Thread(target=tier.fetch, args=(block, None,
                                                                between if chunked else None))
            worker.start()
            time.sleep(per_block / 4)  # the worker's read is a quarter through
            stalled.set()  # the compute thread stalls on a miss and reads it
            start = time.perf_counter()
            tier.fetch(other, None)
            waits[chunked] = time.perf_counter() - start
            resumed.set()
            worker.join(5.0)
        own = other.nbytes / tier.bandwidth
        assert waits[True] <= own + chunk_s + 0.05, waits  # behind one chunk at most
        assert waits[False] >= own + 0.6 * per_block, waits  # behind the rest of the block
    finally:
        tier.close()



@pytest.mark.skipif(not hasattr(__import__("os"), "O_DIRECT"), reason="no O_DIRECT here")
def test_o_direct_refused_at_the_first_read_falls_back_to_plain_reads(store, monkeypatch):
    tried = refuse_o_direct_reads(monkeypatch)
    tier = DiskTier(store)
    try:
        assert tried, "the tier did not try O_DIRECT"
        assert not tier.direct
        for block in list(store.blocks.values())[:2]:
            got = tier.fetch(block, aligned_buffer(padded(block))).numpy()
            want = b"".join(a.tobytes() for a in store.read(block.layer, block.expert).values())
            assert got.tobytes() == want
    finally:
        tier.close()
