"""Expert rows in the order of the experts' ids, by moving rows rather than copying them all.

A call of several tokens gives the resident model's bits only when its experts are
numbered in the order of their ids (the implementation groups tokens by number;
``experts_path``). The slots a cache gave them follow no order, and a prompt may need more
experts than the cache holds. Rather than a compact copy of every needed expert
(a prompt's can be the size of the cache), ``plan_id_order`` assigns the needed
experts, in id order, to the rows they already occupy, then to spare rows past
the capacity, and lists the row copies that put them there: each row is copied at
most once, plus one copy per cycle through a one-expert buffer (``TEMP``). The
experts not cached yet are read straight into their rows afterwards. Where a call's
implementation cannot compute in place, ``gather`` makes the compact copy instead.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from stmoe.runtime.cache import TEMP, LayerCache
from stmoe.runtime.state import EngineState


def plan_id_order(needed: list[int], slots: dict[int, int], extra: int,
                  capacity: int) -> tuple[dict[int, int], list[tuple[int, int]]]:
    """(expert -> row, the ordered (src, dst) row copies) for ``needed`` (sorted ids):
    ``slots`` maps the cached ones to their slots, ``extra`` more go to spare rows
    ``capacity, capacity + 1, ...``; rows then increase with the experts' ids."""
    rows = sorted(slots.values()) + list(range(capacity, capacity + extra))
    if len(rows) != len(needed):
        raise ValueError(f"{len(needed)} experts for {len(rows)} rows")
    target = dict(zip(needed, rows, strict=True))
    pending = {target[e]: s for e, s in slots.items() if target[e] != s}  # dst -> src
    readers = {s: d for d, s in pending.items()}  # src -> the move that still reads it
    moves: list[tuple[int, int]] = []
    while pending:
        dst = next((d for d in pending if d not in readers), None)
        if dst is None:  # only cycles are left: park one row in the buffer
            row = next(iter(pending))
            reader = readers.pop(row)
            moves.append((row, TEMP))
            pending[reader], readers[TEMP] = TEMP, reader
            continue
        src = pending.pop(dst)
        del readers[src]
        moves.append((src, dst))
    return target, moves


def gather(cache: LayerCache, needed: list[int], slots: dict[int, int],
           overflow: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The needed experts' weights as compact [U, ...] tensors, in expert-id order."""
    if not overflow:
        order = torch.tensor([slots[e] for e in needed], device=cache.device)
        return {p.name: cache.slabs[p.name].index_select(0, order) for p in cache.params}
    return {p.name: torch.stack([cache.slabs[p.name][slots[e]] if e in slots
                                 else overflow[e][p.name] for e in needed])
            for p in cache.params}


def read_extras(state: EngineState, cache: LayerCache, rows: dict[int, int], buf: Any,
                stream: Any) -> None:
    """Read the experts the cache had no slot for into their ``rows`` (expert -> row).
    Where copies run asynchronously (a device cache), ``stream`` first waits for what the
    compute stream has queued: the row moves just made read the rows these copies
    overwrite, and the compute stream waited for the copies that filled them."""
    ops = state.device_ops() if rows else None
    if ops is not None:
        ops.wait(stream, ops.record(None))
    for expert, row in rows.items():
        read_extra(state, cache, row, expert, buf, stream)


def read_extra(state: EngineState, cache: LayerCache, row: int, expert: int, buf: Any,
               stream: Any) -> None:
    """Read an expert the cache had no slot for into ``row`` (a slot ``place`` gave it,
    LOADING by this thread, or a spare row); a failure is the caller's to clean up."""
    block = state.store.blocks[(cache.layer, expert)]
    start = time.perf_counter()
    state.loader.fill(cache, row, block, buf, stream)
    took = time.perf_counter() - start
    with state.cv:
        if row < cache.capacity:
            cache.filled(row)
        state.run.stats.loaded(state.run.phase, "demand", block.nbytes, took, overflow=True)


def load_transient(state: EngineState, cache: LayerCache, expert: int,
                   buf: Any) -> dict[str, torch.Tensor]:
    """An expert beyond the capacity where no spare row can take it (the copy's path):
    read outside the cache, used once."""
    block = state.store.blocks[(cache.layer, expert)]
    start = time.perf_counter()
    src = state.loader.fetch(block, buf)
    out = {}
    for p in cache.params:
        t = torch.empty(p.shape, dtype=p.dtype, device=cache.device)
        t.view(-1).view(torch.uint8).copy_(src[p.offset : p.offset + p.nbytes])
        lay = cache.layouts.get(p.name)  # as the slots hold it (gathered beside them)
        out[p.name] = lay.convert(t) if lay is not None else t
    took = time.perf_counter() - start
    with state.cv:
        state.run.stats.loaded(state.run.phase, "demand", block.nbytes, took, overflow=True)
    return out
