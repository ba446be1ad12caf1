"""``--prepare`` sizes stmoe-plus-split's caches where the shared sample is, and the GPU
check reads them from the carried routing's file rather than compiling numba's replay
kernels on the GPU machine's time (about 20 s cold); only a split sized for the very head
it replays is taken."""

from __future__ import annotations

import dataclasses

from conftest import SHARED_TRACES, needs_shared
from stmoe.runtime.gpu_check.setup import (
    LAYERS,
    PREPARED,
    SPLIT_AT,
    SPLIT_PROMPT,
    _prepared_split,
    _size_split,
    _split_key,
    prepare_routing,
)
from stmoe.trace import load_trace
from stmoe.trace.select import held_out_tail, select_layers


def _head(path, layers: int, at: int = SPLIT_AT):
    return held_out_tail(select_layers(load_trace(path), str(layers)), at, SPLIT_PROMPT)[0]


@needs_shared
def test_the_prepared_split_is_the_one_sized_here_and_taken_only_where_it_fits(tmp_path):
    out = prepare_routing(SHARED_TRACES, tmp_path / "routing.npz")
    head = _head(out, LAYERS)
    caps = _prepared_split(head)
    assert caps is not None and caps == _size_split(head)  # what the GPU machine would size
    assert len(caps) == LAYERS and sum(caps) == _split_key(head)["experts_cached"] * LAYERS
    # another head (a rehearsal's one layer, another split point): sized again, not taken
    assert _prepared_split(_head(out, 1)) is None
    assert _prepared_split(_head(out, LAYERS, SPLIT_AT + 1)) is None
    # other routing with the same file's extra (a tool that kept it): not taken
    other = dataclasses.replace(head, experts=head.experts[:, ::-1].copy())
    assert _prepared_split(other) is None
    # a split sized by other code (the file prepared before a change to stmoe): not taken
    moved = {**head.meta.extra[PREPARED], "code": head.meta.extra[PREPARED]["code"] ^ 1}
    assert _prepared_split(dataclasses.replace(head, meta=dataclasses.replace(
        head.meta, extra={**head.meta.extra, PREPARED: moved}))) is None
    # a file whose split is not what prepare writes: not taken either
    for bad in ([*caps[:-1], caps[-1] + 1], [*caps[:-1], "x"], caps[:-1], None):
        extra = {**head.meta.extra, PREPARED: {**head.meta.extra[PREPARED], "capacities": bad}}
        tampered = dataclasses.replace(head, meta=dataclasses.replace(head.meta, extra=extra))
        assert _prepared_split(tampered) is None, bad
