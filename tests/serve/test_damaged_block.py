"""A block that does not read (damaged on disk: ``BlockError``) fails only what needs that
expert. Two requests share a server's steps; one routes to an expert whose block is
damaged, the other never does: the first fails naming the block, the second keeps its
solo bits, in bf16 (each request's own forward) and int8 (one batched forward per step).
Before, both failed: their step shared its reads."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_step_rows import FORMATS, native, quantized  # noqa: E402

from staggered_requests import PROMPTS, ForwardLog, solo  # noqa: E402
from stmoe.errors import BlockError  # noqa: E402
from stmoe.hf.capture_generate import capture_generation  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.runtime.batcher import Request, StepBatcher  # noqa: E402
from stmoe.runtime.store import ExpertStore, pack  # noqa: E402

NEW = 6  # tokens per request


def _one_only_needs(model: torch.nn.Module) -> tuple[int, int, list[int], list[int]]:
    """(layer, expert, a, b): an expert prompt ``a``'s decode steps need at ``layer`` (its
    prompt does not) and ``b`` never needs there; found in the model's own routing."""
    for a, b in itertools.permutations(PROMPTS, 2):
        ra = capture_generation(model, [a], max_new_tokens=NEW)
        rb = capture_generation(model, [b], max_new_tokens=NEW)
        for layer in range(ra.num_layers):
            # (the routing of the last token is captured, which generate never computes)
            ran = ra.is_decode.nonzero()[0][: NEW - 1]
            decode = set(ra.experts[ran, layer].ravel().tolist())
            mine = decode - set(ra.experts[~ra.is_decode, layer].ravel().tolist())
            left = sorted(mine - set(rb.experts[:, layer].ravel().tolist()))
            if left:
                return layer, left[0], a, b
    raise AssertionError("no expert one prompt needs and the other does not")


def _damage(store: ExpertStore, layer: int, expert: int) -> None:
    """One byte of the block flipped on disk: its checksum fails at every read."""
    block = store.blocks[(layer, expert)]
    with open(store.data_path, "r+b") as f:
        f.seek(block.offset + block.nbytes // 2)
        byte = f.read(1)
        f.seek(block.offset + block.nbytes // 2)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_a_damaged_block_fails_only_the_request_routed_to_it(fmt, tmp_path):
    name = "qwen3_moe"
    resident = native(name) if fmt == "bf16" else quantized(name, fmt)
    layer, expert, a, b = _one_only_needs(resident)
    log = ForwardLog(resident)
    want = solo(resident, b, NEW)
    want_logits = log.take()
    weights = {} if fmt == "bf16" else {"weights": FORMATS[fmt]}
    store = pack(native(name), tmp_path / "store", **weights)
    _damage(ExpertStore(store), layer, expert)
    extra = {} if fmt == "bf16" else {"quantize_resident": fmt}
    with offload(native(name), store, capacity=4, predictor="ondemand", **extra) as om:
        logs = ForwardLog(om.model)
        batcher = StepBatcher(om, max_batch=2)
        try:
            assert batcher.batched == (fmt != "bf16")
            routed, other = (batcher.submit(Request(torch.tensor([p]), NEW)) for p in (a, b))
            with pytest.raises(BlockError, match=f"layer {layer}, expert {expert} fails its "
                               "checksum") as caught:
                routed.wait(120)
            assert (caught.value.layer, caught.value.expert) == (layer, expert)
            assert other.wait(120) == want
            assert max(batcher.decode_sizes()) == 2  # they did share steps
        finally:
            batcher.close()
        om.engine.check()
    mine = logs.take(other.thread_name)
    assert len(mine) == len(want_logits)
    assert all(torch.equal(x, y) for x, y in zip(mine, want_logits, strict=True))


def test_when_every_request_of_a_step_needs_the_block_they_all_fail(tmp_path):
    """The same prompt twice: both need the damaged expert, both fail with its error."""
    name = "qwen3_moe"
    layer, expert, a, _ = _one_only_needs(native(name))
    store = pack(native(name), tmp_path / "store")
    _damage(ExpertStore(store), layer, expert)
    with offload(native(name), store, capacity=4, predictor="ondemand") as om:
        batcher = StepBatcher(om, max_batch=2)
        try:
            reqs = [batcher.submit(Request(torch.tensor([a]), NEW)) for _ in range(2)]
            for r in reqs:
                with pytest.raises(BlockError, match=f"layer {layer}, expert {expert}"):
                    r.wait(120)
            assert batcher.queue_depth() == (0, 0)
        finally:
            batcher.close()


def test_a_layer_tried_again_for_the_requests_left_teaches_the_predictor_once(tmp_path):
    """The layer call is made again without the failed request: the predictor learnt the
    step's routing at that layer from the first call, and is not taught it a second time
    (at the last layer, a second lesson began the slot's next token with this one's
    routing missing)."""
    from tiny_moe import packed_with_tables, tiny_model

    name = "qwen3_moe"
    layer, expert, a, b = _one_only_needs(tiny_model(name)[0])
    _, store, tables = packed_with_tables(name, tmp_path)
    _damage(ExpertStore(store), layer, expert)
    with offload(tiny_model(name)[0], store, capacity=4, predictor="stmoe",
                 tables=tables) as om:
        planner, taught = om.engine.planner, []
        update, started = planner.predictor.update, planner.forward_started
        planner.predictor.update = lambda lay, ids, slot=0: (taught.append((lay, slot)),
                                                              update(lay, ids, slot))[1]
        run = om.engine.state  # (a decode step's marker: its prompt's tokens teach each)
        planner.forward_started = lambda: (taught.append(run.run.phase), started())[1]
        batcher = StepBatcher(om, max_batch=2)
        try:
            routed, other = (batcher.submit(Request(torch.tensor([p]), NEW)) for p in (a, b))
            with pytest.raises(BlockError):
                routed.wait(120)
            other.wait(120)
        finally:
            batcher.close()
    decode_steps, current = [], None
    for entry in [*taught, "end"]:
        if isinstance(entry, str):
            if current is not None:
                decode_steps.append(current)
            current = [] if entry == "decode" else None
        elif current is not None:
            current.append(entry)
    assert len(decode_steps) >= NEW - 1 and any(len({s for _, s in d}) == 2 for d in decode_steps)
    assert all(len(d) == len(set(d)) for d in decode_steps), decode_steps
