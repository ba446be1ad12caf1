"""The GPU tiers' work reported to a happens-before check (``store.happens_before``).

``CheckedOps`` wraps a ``DeviceOps``: a copy is work on its stream (it writes its
destination, reads its source), a launched work's torch calls are work on its stream, an
event carries its stream's clock, a wait joins it, and the host's synchronizations and
drains are seen. ``watching`` reports the calling thread's torch calls (a dispatch mode) as
work queued on the compute stream, one per call: on the stand-in the compute thread's
kernels run as they are called, where a GPU's would only be queued.

A kernel that reads a few rows of a slab (an index, an embedding, a grouped matmul's
non-empty groups) is taken to read those rows, as the device does; any other reads (and,
where its schema says so, writes) its tensors' whole extents. Calls that read nothing (an
allocation like another tensor, a view) are not reported.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from stmoe.runtime.store.device_ops import CopyEvent, DeviceOps
from stmoe.runtime.store.happens_before import (
    COMPUTE,
    HOST,
    Clock,
    Extent,
    OrderingCheck,
    Stamp,
    extent,
)

NO_READ = frozenset({"empty_like", "zeros_like", "ones_like", "full_like", "new_empty",
                     "new_zeros", "new_ones", "new_full", "empty_strided", "detach",
                     "lift_fresh", "_local_scalar_dense"})  # (the last: a host tensor's)


_QUIET = threading.local()  # depth > 0: this thread is inside the device ops' own calls


@contextmanager
def watching(check: OrderingCheck) -> Iterator[None]:
    """The calling thread's torch calls, reported as work queued on the compute stream (but
    those the device ops make themselves: a copy's, a launched work's, reported as theirs)."""
    with _Watch(check, None):
        yield


@contextmanager
def _quiet() -> Iterator[None]:
    _QUIET.depth = getattr(_QUIET, "depth", 0) + 1
    try:
        yield
    finally:
        _QUIET.depth -= 1


def report_kernel(check: OrderingCheck, func: Any, args: tuple[Any, ...],
                  kwargs: dict[str, Any], stamp: Stamp | None) -> None:
    """A torch call (a dispatch mode's): its accesses of tracked rows, if any."""
    name = func.overloadpacket.__name__
    if func.is_view or name in NO_READ:
        return
    touching = [(w, e) for w, e in _accesses(func, name, args, kwargs, check.touches)
                if check.touches(e)]
    if not touching:
        return
    if stamp is None:
        stamp = check.queue(None)
    what = f"aten.{name} on {_stream_name(stamp[0])} ({threading.current_thread().name})"
    for write, e in touching:
        check.access(stamp, e, write, ("writing: " if write else "reading: ") + what)


def _stream_name(timeline: int) -> str:
    if timeline == HOST:
        return "the host"
    return "the compute stream" if timeline == COMPUTE else f"stream {timeline}"


def watch_bounce(check: OrderingCheck, tier: object) -> None:
    """A disk -> GPU tier's bounce buffers checked too (``store.bounce``): each tracked as
    one row, each read from disk into one reported as the host's write. A buffer rewritten
    while a copy out of it may still run (its event not yet seen complete) is then a race.
    Other tiers have no pool: nothing to do."""
    pool = getattr(tier, "pool", None)
    if pool is None:
        return
    buffers = {}
    for i, bounce in enumerate(pool.buffers):
        check.track(f"bounce buffer {i}", bounce.tensor.view(1, -1))
        buffers[id(bounce.buf)] = extent(bounce.tensor)
    tier.reader = _HostReads(check, tier.reader, buffers)  # type: ignore[attr-defined]


class _HostReads:
    """A tier's reader whose reads into a tracked bounce buffer are reported as the host's
    writes of the whole buffer (an O_DIRECT read may land past the block's bytes)."""

    def __init__(self, check: OrderingCheck, inner: Any, buffers: dict[int, Extent | None]
                 ) -> None:
        self.check, self.inner, self.buffers = check, inner, buffers

    def fetch(self, block: Any, buf: Any, between: Any = None) -> torch.Tensor:
        where = self.buffers.get(id(buf))
        stamp = self.check.host() if where is not None else None  # as the read starts
        with _quiet():  # (the reader's own torch calls: the host's, not the compute's)
            src = self.inner.fetch(block, buf, between)
        if stamp is not None and where is not None:
            self.check.access(stamp, where, True, "writing: a read from disk on the host "
                              f"({threading.current_thread().name})")
        return src

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _rows(index: torch.Tensor, size: int) -> list[int]:
    """The distinct rows an index tensor picks (a mask: its true rows)."""
    if index.dtype == torch.bool:
        index = index.nonzero().reshape(-1)
    return sorted({i % size for i in index.reshape(-1).tolist()})


def _row_extents(t: torch.Tensor, rows: list[int]) -> list[Extent]:
    return [e for r in rows if (e := extent(t, r)) is not None]


def _accesses(func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
              tracked: Callable[[Extent], bool]) -> Iterator[tuple[bool, Extent]]:
    """(writes?, bytes) of each tensor a torch call reads or writes; a gathering kernel's
    table read row by row where it is ``tracked`` (its indices read only then: on CUDA,
    reading them waits for the device)."""
    picked: dict[int, list[Extent]] = {}  # argument position -> the rows it reads

    def table(at: int) -> torch.Tensor | None:  # the gathered-from tensor, where tracked
        t = args[at]
        return t if (e := extent(t)) is not None and tracked(e) else None

    if name == "index" and isinstance(args[1], (list, tuple)) and args[1] and all(
            i is None for i in args[1][1:]) and isinstance(args[1][0], torch.Tensor):
        if (t := table(0)) is not None:
            picked[0] = _row_extents(t, _rows(args[1][0], t.shape[0]))
    elif name == "embedding" or (name == "index_select" and args[1] == 0):
        if (t := table(0)) is not None:  # (weight, indices) / (self, dim, index)
            index = args[1] if name == "embedding" else args[2]
            picked[0] = _row_extents(t, _rows(index, t.shape[0]))
    elif name == "_grouped_mm" and args[1].dim() == 3 and args[0].dim() == 2 and (
            offs := args[2] if len(args) > 2 else kwargs.get("offs")) is not None and (
            t := table(1)) is not None:  # (x, the experts' weights, the groups' ends)
        ends = [0, *offs.tolist()]
        picked[1] = _row_extents(t, [g for g in range(len(ends) - 1) if ends[g + 1] > ends[g]])
    for i, arg in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        write = arg.alias_info is not None and arg.alias_info.is_write
        if i in picked:
            yield from ((write, e) for e in picked[i])
            continue
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, torch.Tensor) and (e := extent(t)) is not None:
                yield write, e


class _Watch(TorchDispatchMode):
    """Reports each torch call of the thread that entered it: as ``stamp``'s work (a
    launched work's), or (None) as work queued on the compute stream, one per call."""

    def __init__(self, check: OrderingCheck, stamp: Stamp | None) -> None:
        super().__init__()
        self.check, self.stamp = check, stamp

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if self.stamp is not None or not getattr(_QUIET, "depth", 0):
            report_kernel(self.check, func, args, kwargs, self.stamp)
        return func(*args, **kwargs)


class _Stamped:
    """An event of the wrapped ops, with the clock of the point it marks."""

    def __init__(self, check: OrderingCheck, inner: CopyEvent, clock: Clock) -> None:
        self.check, self.inner, self.clock = check, inner, clock

    def query(self) -> bool:
        done = self.inner.query()
        if done:
            self.check.seen(self.clock)
        return done

    def synchronize(self) -> None:
        self.inner.synchronize()
        self.check.seen(self.clock)

    def wait(self, stream: object = None) -> None:
        self.inner.wait(stream)


def clock_of(event: object) -> Clock:
    """The clock of an event these ops made (a ``CopySpan``: of its end)."""
    if isinstance(event, _Stamped):
        return event.clock
    end = getattr(event, "end", None)
    if end is None:
        raise TypeError(f"an event the ordering check did not make: {event!r}")
    return clock_of(end)


def _inner(event: object) -> object:
    return event.inner if isinstance(event, _Stamped) else event


class CheckedOps:
    """``DeviceOps`` that do what ``inner`` does and report it to ``check``."""

    def __init__(self, check: OrderingCheck, inner: DeviceOps) -> None:
        self.check, self.inner = check, inner

    def new_stream(self, priority: int = 0) -> object:
        return self.inner.new_stream(priority)

    def elapsed(self, start: CopyEvent, end: CopyEvent) -> float:
        return self.inner.elapsed(_inner(start), _inner(end))  # type: ignore[arg-type]

    def launch(self, stream: object, work: Callable[[], None]) -> None:
        stamp = self.check.queue(stream)

        def watched() -> None:  # (run here or on another thread: the inner ops' choice)
            with _quiet(), _Watch(self.check, stamp):
                work()

        self.inner.launch(stream, watched)

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: object) -> CopyEvent:
        stamp = self.check.queue(stream)
        what = f"a copy on {_stream_name(stamp[0])} ({threading.current_thread().name})"
        for t, write in ((dst, True), (src, False)):
            if (e := extent(t)) is not None and self.check.touches(e):
                self.check.access(stamp, e, write, ("writing: " if write else "reading: ")
                                  + what)
        with _quiet():  # (CUDA's is a torch call on this thread: the copy's, not the compute's)
            event = self.inner.copy_async(dst, src, stream)
        return _Stamped(self.check, event, stamp[1])

    def record(self, stream: object) -> CopyEvent:
        clock = self.check.mark(stream)
        return _Stamped(self.check, self.inner.record(stream), clock)

    def wait(self, stream: object, event: CopyEvent) -> None:
        self.check.waits(stream, clock_of(event))
        self.inner.wait(stream, event)

    def drain(self) -> None:
        self.inner.drain()
        self.check.drained()

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()
