"""The tiers that feed a GPU, on the CPU: the pinned store (filled once, checked, shared in
the process, released by its last user) and the disk -> device tier's bounce buffers,
whose copies are made by a stand-in that completes them late, on another thread, reading
the source only then: a buffer overwritten before its copy's event completed shows up
as wrong bytes at the destination (and the test that removes the wait proves it would)."""

from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")

from stmoe.errors import OffloadError  # noqa: E402
from stmoe.runtime.store import ExpertStore, StoreError, device_ops, pack  # noqa: E402
from stmoe.runtime.store.bounce import BouncePool  # noqa: E402
from stmoe.runtime.store.in_place_index import make_in_place  # noqa: E402
from stmoe.runtime.store.index import ALIGN, slot_bytes  # noqa: E402
from stmoe.runtime.store.loader import Loader  # noqa: E402
from stmoe.runtime.store.pinned import PinnedHostTier, host_bytes, shared_stores  # noqa: E402
from stmoe.runtime.store.reading import open_disk_to_device  # noqa: E402
from stmoe.runtime.store.stand_in import HostThreadOps, NoPinning  # noqa: E402
from stmoe.runtime.store.tiers import aligned_buffer, buffer_bytes  # noqa: E402
from tiny_moe import tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    model, _ = tiny_model("mixtral")
    return ExpertStore(pack(model, tmp_path_factory.mktemp("gpu-tiers") / "store"))


def _want(store, block) -> bytes:
    raw = store.read(block.layer, block.expert)
    return b"".join(raw[t.name].tobytes() for t in block.tensors)


def _slot(block) -> list[torch.Tensor]:
    """A 'device' slot: one uint8 tensor per parameter, in block order, filled with 0xAA."""
    return [torch.full((slot_bytes(t),), 0xAA, dtype=torch.uint8) for t in block.tensors]


def _bytes(parts: list[torch.Tensor]) -> bytes:
    return b"".join(p.numpy().tobytes() for p in parts)


def test_the_pinned_store_holds_exactly_the_stores_bytes_once_checked(store):
    pinning = NoPinning()
    tier = PinnedHostTier(store, pinning, HostThreadOps())
    try:
        size = store.data_path.stat().st_size
        assert host_bytes(store) == -(-size // ALIGN) * ALIGN == tier.host.numel()
        assert pinning.registered == {tier.host.data_ptr(): tier.host.numel()}  # one lock
        for block in store.blocks.values():
            assert tier.fetch(block).numpy().tobytes() == _want(store, block)
    finally:
        tier.close()
    assert pinning.registered == {} and shared_stores() == 0


def test_offloads_in_one_process_share_one_pinned_store(store, tmp_path):
    pinning = NoPinning()
    first = PinnedHostTier(store, pinning, HostThreadOps())
    second = PinnedHostTier(ExpertStore(store.path), NoPinning(), HostThreadOps())
    other_model, _ = tiny_model("mixtral", seed=1)
    other = PinnedHostTier(ExpertStore(pack(other_model, tmp_path / "other")), pinning,
                           HostThreadOps())
    try:
        assert second.pinned is first.pinned and first.pinned.users == 2
        assert other.pinned is not first.pinned and shared_stores() == 2
        assert len(pinning.registered) == 2  # one lock per store, not per offload
        first.close()
        assert second.pinned.users == 1 and len(pinning.registered) == 2
        second.close()
        assert len(pinning.registered) == 1 and shared_stores() == 1  # the other store's
    finally:
        for t in (first, second, other):
            t.close()
    assert pinning.registered == {} and shared_stores() == 0


def test_a_damaged_store_is_refused_and_nothing_stays_pinned(store, tmp_path):
    import shutil

    copy = tmp_path / "damaged"
    shutil.copytree(store.path, copy)
    data = copy / store.index.data
    block = sorted(store.blocks.values(), key=lambda b: b.offset)[-1]
    raw = bytearray(data.read_bytes())
    raw[block.offset + 7] ^= 0x10
    data.write_bytes(bytes(raw))
    pinning = NoPinning()
    with pytest.raises(StoreError, match=f"layer {block.layer}, expert {block.expert} fails"):
        PinnedHostTier(ExpertStore(copy), pinning, HostThreadOps())
    assert pinning.registered == {} and shared_stores() == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is present")
def test_the_real_pinned_path_is_refused_in_one_line_without_cuda(store):
    with pytest.raises(OffloadError, match=r"^--tier gpu needs CUDA, and torch sees no GPU") as e:
        PinnedHostTier(store)
    assert "\n" not in str(e.value)
    with pytest.raises(OffloadError, match="needs CUDA"):
        open_disk_to_device(store)


def test_the_pinned_tier_copies_a_block_into_a_slot_asynchronously(store):
    ops = HostThreadOps(delay=0.01)
    tier = PinnedHostTier(store, NoPinning(), ops)
    try:
        block = next(iter(store.blocks.values()))
        parts = _slot(block)
        event = tier.load(block, parts, stream=None)
        assert not event.query()  # the copy is queued, not made
        event.synchronize()
        assert _bytes(parts) == _want(store, block)
    finally:
        tier.close()
        ops.close()


def test_closing_the_pinned_tier_waits_for_the_copies_still_reading_it(store):
    """A run that ends on an error may leave a prefetch's copy queued out of the pinned
    store: the tier is closed (the pages unlocked and unmapped) only after it has landed,
    with the bytes it was asked for (a copy engine reading unmapped memory faults)."""
    ops = HostThreadOps(delay=0.2)
    tier = PinnedHostTier(store, NoPinning(), ops)
    block = next(iter(store.blocks.values()))
    parts = _slot(block)
    event = tier.load(block, parts, stream=ops.new_stream())
    try:
        assert not event.query()
    finally:
        tier.close()
    assert event.query() and _bytes(parts) == _want(store, block)
    ops.close()


def _load_all(tier, blocks, threads: int = 1):
    """Every block loaded into its own slot, back to back (no wait between loads), from
    ``threads`` readers on their own streams; then every copy waited for."""
    slots = {b: _slot(b) for b in blocks}
    events = []
    lock = threading.Lock()

    def run(mine):
        for b in mine:
            e = tier.load(b, slots[b], stream=threading.current_thread().name)
            with lock:
                events.append(e)

    workers = [threading.Thread(target=run, args=(blocks[i::threads],), name=f"s{i}")
               for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for e in events:
        e.synchronize()
    return slots


@pytest.mark.parametrize("threads", [1, 3])
def test_a_bounce_buffer_is_never_overwritten_before_its_copy_completed(store, threads):
    ops = HostThreadOps(delay=0.003)  # each copy lands well after the next read could
    tier = open_disk_to_device(store, ops, NoPinning(), buffers=2)
    try:
        blocks = list(store.blocks.values())
        slots = _load_all(tier, blocks, threads)
        for b in blocks:
            assert _bytes(slots[b]) == _want(store, b), (b.layer, b.expert)
        assert tier.pool.waited > 0  # the protocol was exercised, not idle
        assert ops.copies == sum(len(b.tensors) for b in blocks)
    finally:
        tier.close()
        ops.close()


def test_without_the_wait_the_stand_in_catches_the_race(store, monkeypatch):
    """The check above has teeth: with the wait for the copy's event removed, later reads
    overwrite buffers whose copies have not run yet, and slots get other experts' bytes."""
    monkeypatch.setattr(BouncePool, "_drain", lambda self, b: setattr(b, "pending", None))
    ops = HostThreadOps(delay=0.003)
    tier = open_disk_to_device(store, ops, NoPinning(), buffers=2)
    try:
        blocks = list(store.blocks.values())
        slots = _load_all(tier, blocks)
        wrong = [b for b in blocks if _bytes(slots[b]) != _want(store, b)]
        assert wrong
    finally:
        tier.close()
        ops.close()


def test_the_disk_to_device_tier_reads_an_in_place_store(tmp_path):
    from stmoe.models import SHIPPED_MODEL

    in_place = ExpertStore(make_in_place(SHIPPED_MODEL, tmp_path / "in-place"))
    in_place.check_source(SHIPPED_MODEL)
    ops = HostThreadOps(delay=0.001)
    tier = open_disk_to_device(in_place, ops, NoPinning(), buffers=2)
    try:
        blocks = list(in_place.blocks.values())[:12]
        slots = _load_all(tier, blocks)
        for b in blocks:
            assert _bytes(slots[b]) == _want(in_place, b)
        block = blocks[0]  # the gathered copy's way in: the thread's own buffer
        got = tier.fetch(block, aligned_buffer(buffer_bytes(block)))
        assert got.numpy().tobytes() == _want(in_place, block)
    finally:
        tier.close()
        ops.close()


class _DeviceCache:
    """A cache whose slots are 'device' tensors: with ``device_parts`` (the asynchronous
    path) or only ``write`` (today's cache: it copies and waits)."""

    def __init__(self, block, parts: bool) -> None:
        self.rows = [_slot(block) for _ in range(2)]
        if parts:
            self.device_parts = lambda slot: self.rows[slot]

    def slot_parts(self, slot):
        return None

    def write(self, slot, src, stream=None):
        pos = 0
        for p in self.rows[slot]:
            p.copy_(src[pos : pos + p.numel()])
            pos += p.numel()


@pytest.mark.parametrize("parts", [True, False], ids=["device_parts", "write"])
@pytest.mark.parametrize("kind", ["pinned", "disk"])
def test_the_loader_fills_a_device_slot_and_returns_its_event(store, kind, parts):
    ops = HostThreadOps(delay=0.005)
    tier = (PinnedHostTier(store, NoPinning(), ops) if kind == "pinned"
            else open_disk_to_device(store, ops, NoPinning(), buffers=1))
    try:
        loader = Loader(tier, store)
        block = list(store.blocks.values())[3]
        cache = _DeviceCache(block, parts)
        buf = aligned_buffer(buffer_bytes(block))
        event = loader.fill(cache, 1, block, buf, stream="s")  # waits, as the engine expects
        assert event.query() and _bytes(cache.rows[1]) == _want(store, block)
        event = loader.fill(cache, 0, block, buf, stream="s", wait=False)
        event.synchronize()
        assert _bytes(cache.rows[0]) == _want(store, block)
    finally:
        tier.close()
        ops.close()


def test_cuda_streams_belong_to_the_callers_device_not_each_threads(monkeypatch):
    """A loading thread starts on device 0 whatever device the caller set, so a stream
    made there for a cache on cuda:1 would be device 0's: the copy would run on cuda:1's
    current stream, outside the slot's ready event. Streams name their device."""
    from stmoe.runtime.store import device_ops

    made: list[dict] = []
    monkeypatch.setattr(device_ops, "_cudart", lambda: None)
    monkeypatch.setattr(device_ops.torch.cuda, "Stream", lambda **kw: made.append(kw))
    ops = device_ops.CudaOps(torch.device("cuda", 1))
    worker = threading.Thread(target=lambda: ops.new_stream(-1))  # a loading thread's
    worker.start()
    worker.join()
    ops.new_stream()
    assert sorted(made, key=lambda kw: kw["priority"]) == [
        {"device": torch.device("cuda", 1), "priority": -1},
        {"device": torch.device("cuda", 1), "priority": 0}]


def test_the_compute_stream_is_the_caches_devices_not_the_threads(monkeypatch):
    """The compute stream (None) of a cache on cuda:1, asked from a thread whose current
    device is 0 (a server's thread, a caller out of ``torch.cuda.device(1)``): its waits,
    events, launches and the drain are cuda:1's. On device 0's stream, the ids' copy event
    would complete before the copy and kernels would read slots before their copies land."""
    from stmoe.runtime.store import device_ops

    class Stream:
        def __init__(self, device):
            self.device, self.waited = device, []

        def wait_event(self, event):
            self.waited.append(event)

    class Event:
        def __init__(self, **kw):
            self.stream = None

        def record(self, stream=None):  # torch's: None is the CURRENT device's stream
            self.stream = stream if stream is not None else current_stream()

    def current_stream(device=None):
        return Stream(torch.device("cuda", 0) if device is None else torch.device(device))

    entered, synced = [], []
    monkeypatch.setattr(device_ops, "_cudart", lambda: None)
    monkeypatch.setattr(device_ops.torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(device_ops.torch.cuda, "Event", Event)
    monkeypatch.setattr(device_ops.torch.cuda, "stream", lambda s: entered.append(s) or (
        __import__("contextlib").nullcontext()))
    monkeypatch.setattr(device_ops.torch.cuda, "synchronize", lambda device=None: synced.append(
        device))
    ops = device_ops.CudaOps(torch.device("cuda", 1))
    one = torch.device("cuda", 1)
    assert ops.record(None).stream.device == one
    ops.launch(None, lambda: None)
    ops.copy_async(torch.zeros(2), torch.ones(2), None)
    assert [s.device for s in entered] == [one, one]
    waited = []
    monkeypatch.setattr(Stream, "wait_event", lambda self, e: waited.append(self.device))
    ops.wait(None, Event())
    ops.drain()
    assert waited == [one] and synced == [one]


def test_free_device_memory_counts_what_torchs_allocator_holds_unused(monkeypatch):
    """The driver counts blocks torch's caching allocator keeps (a closed offload's slots,
    a reference model's weights) as taken; the plan may use them."""
    from stmoe.runtime import memory

    monkeypatch.setattr(memory.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(memory.torch.cuda, "mem_get_info", lambda device=None: (10, 100))
    monkeypatch.setattr(memory.torch.cuda, "memory_reserved", lambda device=None: 7)
    monkeypatch.setattr(memory.torch.cuda, "memory_allocated", lambda device=None: 3)
    assert memory.device_free_bytes() == 10 + 4


def test_the_gpu_plan_splits_free_memory_and_refuses_too_little():
    from stmoe.runtime.memory import DEVICE_RESERVE, kv_cache_bytes, plan_device_memory

    mib, gib = 1 << 20, 1 << 30
    kv = kv_cache_bytes(layers=8, kv_heads=4, head_dim=128, tokens=4096)
    assert kv == 2 * 8 * 4 * 128 * 4096 * 2
    plan = plan_device_memory(free=12 * gib, resident=3 * gib, kv=kv, num_layers=8,
                              num_experts=256, top_k=8, expert_bytes=6 * mib)
    room = 12 * gib - 3 * gib - kv - DEVICE_RESERVE - 256 * 6 * mib
    assert plan.per_layer == room // (8 * 6 * mib) and plan.per_layer < 256
    assert plan.cache == 8 * plan.per_layer * 6 * mib
    assert plan.resident + plan.kv + plan.reserve + plan.cache <= plan.free
    assert f"{plan.per_layer} experts per layer" in plan.describe()
    every = plan_device_memory(141 * gib, 3 * gib, kv, 8, 256, 8, 6 * mib)
    assert every.per_layer == 256  # a ceiling, not a request
    with pytest.raises(OffloadError, match=r"too little .* top-8 experts per layer; it needs "
                                           r"at least \d+\.\d+ GiB"):
        plan_device_memory(5 * gib, 3 * gib, kv, 8, 256, 8, 6 * mib)


def test_unaligned_slots_are_refused_before_any_copy(store):
    ops = HostThreadOps()
    tier = PinnedHostTier(store, NoPinning(), ops)
    try:
        block = next(iter(store.blocks.values()))
        with pytest.raises(ValueError, match="a slot of"):
            tier.load(block, [torch.zeros(3, dtype=torch.uint8)], None)
        assert ops.copies == 0
    finally:
        tier.close()
        ops.close()


class _Runtime:
    """torch's cudart binding as a GPU with no lockable memory answers it."""

    def cudaHostRegister(self, ptr, nbytes, flags):
        return 2  # cudaErrorMemoryAllocation

    def cudaHostUnregister(self, ptr):
        return 1


def test_a_failed_page_lock_is_reported_and_the_runtimes_last_error_cleared(monkeypatch):
    # the binding leaves the error set, and torch's next kernel launch would raise it
    cleared = []

    class Lib:
        def cudaGetLastError(self):
            cleared.append(True)

    monkeypatch.setattr(device_ops, "loaded_library", lambda stem: Lib())
    pinning = object.__new__(device_ops.CudaHostPinning)
    pinning._rt = _Runtime()
    with pytest.raises(OffloadError, match=r"^page-locking 2\.00 GiB of host memory in place "
                       r"\(cudaHostRegister\) failed \(cudaError 2\)$"):
        pinning.register(4096, 2 << 30)
    assert cleared == [True]
    pinning.unregister(4096)
    assert cleared == [True, True]


def test_the_runtime_library_is_found_among_the_process_mappings(tmp_path):
    libc = device_ops.loaded_library("libc.so")  # mapped in every CPython on Linux
    assert libc is not None and libc.getpid() > 0
    assert device_ops.loaded_library("libstmoe-nothing.so") is None
    assert device_ops.loaded_library("libc.so", maps=tmp_path / "missing") is None
    device_ops.clear_last_error()  # no CUDA runtime mapped here (CI): nothing to do


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; CI has none")


@pytest.mark.cuda
@needs_cuda
def test_on_cuda_the_pinned_store_is_page_locked_and_its_copies_land(store):
    tier = PinnedHostTier(store)
    try:
        assert tier.host.is_pinned() and tier.host.numel() == host_bytes(store)
        stream = torch.cuda.Stream()
        for block in store.blocks.values():
            parts = [torch.empty(slot_bytes(t), dtype=torch.uint8, device="cuda")
                     for t in block.tensors]
            tier.load(block, parts, stream).synchronize()
            assert _bytes([p.cpu() for p in parts]) == _want(store, block)
    finally:
        tier.close()
    assert shared_stores() == 0


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("threads", [1, 3])
def test_on_cuda_the_disk_to_device_tier_lands_every_block(store, threads):
    tier = open_disk_to_device(store, buffers=2)
    try:
        assert all(b.tensor.is_pinned() for b in tier.pool.buffers)
        blocks = list(store.blocks.values())
        slots = {b: [torch.empty(slot_bytes(t), dtype=torch.uint8, device="cuda")
                     for t in b.tensors] for b in blocks}
        streams = [torch.cuda.Stream() for _ in range(threads)]
        events = []

        def run(i):
            for b in blocks[i::threads]:
                events.append(tier.load(b, slots[b], streams[i]))

        workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        for e in events:
            e.synchronize()
        for b in blocks:
            assert _bytes([p.cpu() for p in slots[b]]) == _want(store, b)
    finally:
        tier.close()


@pytest.mark.cuda
@needs_cuda
def test_on_cuda_a_failed_page_lock_leaves_no_error_for_the_next_kernel():
    import mmap

    m = mmap.mmap(-1, 1 << 16)
    host = torch.frombuffer(m, dtype=torch.uint8)
    try:
        with pytest.raises(OffloadError, match="page-locking"):  # past the mapping's end
            device_ops.CudaHostPinning().register(host.data_ptr(), 1 << 40)
        assert torch.ones(4, device="cuda").sum().item() == 4.0  # launches, checked
    finally:
        del host
        device_ops.unmap(m)
