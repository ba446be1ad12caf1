"""Locked host memory where the driver refuses to lock memory it did not allocate (some
virtualised GPUs): the pinned store and the bounce buffers fall back to an allocation made
locked, filled in place, and the runs on them give the resident model's tokens. On the
CPU: a stand-in that refuses every registration and allocates ordinary memory."""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stmoe.errors import OffloadError  # noqa: E402
from stmoe.runtime import gpu_check  # noqa: E402
from stmoe.runtime.accelerator import stand_in  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.runtime.prompts import greedy_generate  # noqa: E402
from stmoe.runtime.store import ExpertStore, host_lock  # noqa: E402
from stmoe.runtime.store.index import ALIGN, slot_bytes  # noqa: E402
from stmoe.runtime.store.pinned import PinnedHostTier, shared_stores  # noqa: E402
from stmoe.runtime.store.reading import open_disk_to_device  # noqa: E402
from stmoe.runtime.store.stand_in import HostThreadOps  # noqa: E402
from tiny_moe import packed_with_tables, tiny_model  # noqa: E402

PROMPT = [5, 6, 7, 8, 9, 10, 11]


class RefusingPinning:
    """A driver that will not register memory it did not allocate; ``allocate`` works (an
    unaligned start, as a CPU allocator may give: the fallback must align it itself)."""

    kind = "refusing"

    def __init__(self, allocate_fails: bool = False) -> None:
        self.allocate_fails, self.allocated = allocate_fails, []

    def register(self, ptr: int, nbytes: int) -> None:
        raise OffloadError(f"page-locking {nbytes} bytes in place (cudaHostRegister) failed "
                           "(cudaError 801)")

    def unregister(self, ptr: int) -> None:
        raise AssertionError("nothing was registered")

    def allocate(self, nbytes: int) -> torch.Tensor:
        if self.allocate_fails:
            raise RuntimeError("CUDA error: out of memory")
        self.allocated.append(nbytes)
        return torch.empty(nbytes + 8, dtype=torch.uint8)[8:]  # never page-aligned


@pytest.fixture(autouse=True)
def _warn_again(monkeypatch):
    monkeypatch.setattr(host_lock, "_warned", False)


def test_a_refused_registration_allocates_locked_memory_aligned_and_warns_once():
    pinning = RefusingPinning()
    with pytest.warns(RuntimeWarning, match="cudaError 801.*torch's pinned allocation"):
        first = host_lock.LockedHost(3 * ALIGN, pinning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a second one says nothing more
        second = host_lock.LockedHost(ALIGN, pinning)
    try:
        assert not first.registered and first.how.startswith("allocated locked")
        assert "cudaError 801" in first.how
        assert first.tensor.numel() == 3 * ALIGN and first.tensor.data_ptr() % ALIGN == 0
        with first.view() as view:  # the view writes the tensor's own bytes
            view[ALIGN + 1] = 7
        assert first.tensor[ALIGN + 1].item() == 7
        assert pinning.allocated == [4 * ALIGN, 2 * ALIGN]  # a page more, to align within
    finally:
        first.close()
        second.close()  # nothing to unregister (the stand-in asserts it)


def test_when_allocating_fails_too_both_reasons_are_named():
    with pytest.raises(OffloadError, match=r"cudaError 801\); and allocating .* failed too: "
                                           "CUDA error: out of memory"):
        host_lock.LockedHost(ALIGN, RefusingPinning(allocate_fails=True))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    model, store, tables = packed_with_tables("qwen2_moe", tmp_path_factory.mktemp("lock"))
    want = greedy_generate(model, torch.tensor([PROMPT]), 5, ignore_eos=True)
    return store, tables, want[0, len(PROMPT):].tolist()


def _want(store, block) -> bytes:
    raw = store.read(block.layer, block.expert)
    return b"".join(raw[t.name].tobytes() for t in block.tensors)


def test_the_pinned_store_and_the_bounce_buffers_fall_back_and_hold_the_right_bytes(qwen):
    store = ExpertStore(qwen[0])
    ops = HostThreadOps(delay=0.002)
    with pytest.warns(RuntimeWarning):
        pinned = PinnedHostTier(store, RefusingPinning(), ops)
    bounced = open_disk_to_device(store, ops, RefusingPinning(), buffers=2)
    try:
        assert pinned.pinned.how.startswith("allocated locked")
        for block in store.blocks.values():
            assert pinned.fetch(block).numpy().tobytes() == _want(store, block)
            for tier in (pinned, bounced):
                slot = [torch.zeros(slot_bytes(t), dtype=torch.uint8) for t in block.tensors]
                tier.load(block, slot, stream="s").synchronize()
                assert b"".join(p.numpy().tobytes() for p in slot) == _want(store, block)
    finally:
        pinned.close()
        bounced.close()
        ops.close()
    assert shared_stores() == 0


@pytest.mark.parametrize("tier", ["gpu", "gpu-disk"])
def test_a_run_whose_registrations_are_refused_gives_the_resident_models_tokens(qwen, tier):
    store, tables, want = qwen
    pinning = RefusingPinning()
    with (pytest.warns(RuntimeWarning, match="pinned allocation") as caught,
          stand_in(delay=0.001, pinning=pinning),
          offload(tiny_model("qwen2_moe")[0], store, capacity=3, predictor="stmoe",
                  tables=tables, tier=tier) as om):
        assert om.generate(PROMPT, max_new_tokens=5).tokens == want
    assert pinning.allocated  # it ran on the fallback
    # the warning names the caller's line (this file), not a line inside stmoe
    assert {w.filename for w in caught if "pinned allocation" in str(w.message)} == {__file__}


def test_the_check_records_a_refused_registration_and_claims_nothing_of_it():
    from stmoe.runtime.gpu_check.record import Check
    from stmoe.runtime.gpu_check.targets import targets

    c = Check.__new__(Check)
    h2d = {"status": "ok", "sizes": [
        {"bytes": 1 << 30, "pageable_GBps": 20.0, "pinned_GBps": 50.0,
         "registered_error": "page-locking ... failed (cudaError 801)"}]}
    c.dry, c.cuda, c.doc = False, True, {"targets": [], "stages": {"h2d": h2d}}
    targets(c)
    row = next(t for t in c.doc["targets"] if "registered mapping" in t["name"])
    assert row["met"] is None and "cudaError 801" in row["value"]
    assert gpu_check  # (the package imports without a GPU)


class _RefusingCuda(RefusingPinning):
    """CUDA's own allocation behind a refused registration (the fallback on a real GPU)."""

    def allocate(self, nbytes: int) -> torch.Tensor:
        from stmoe.runtime.store.device_ops import CudaHostPinning

        self.allocated.append(nbytes)
        return CudaHostPinning.allocate(object.__new__(CudaHostPinning), nbytes)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA; CI has none")
def test_on_cuda_the_fallback_is_page_locked_and_its_copies_land(qwen):
    store = ExpertStore(qwen[0])
    with pytest.warns(RuntimeWarning):
        tier = PinnedHostTier(store, _RefusingCuda())
    try:
        assert tier.host.is_pinned() and tier.host.data_ptr() % ALIGN == 0
        stream = torch.cuda.Stream()
        for block in store.blocks.values():
            parts = [torch.empty(slot_bytes(t), dtype=torch.uint8, device="cuda")
                     for t in block.tensors]
            tier.load(block, parts, stream).synchronize()
            assert b"".join(p.cpu().numpy().tobytes() for p in parts) == _want(store, block)
    finally:
        tier.close()
    assert shared_stores() == 0
