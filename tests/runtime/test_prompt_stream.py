"""A prompt's next layer streamed while this layer computes (planning._stream_prompt).

During a prompt the next layer's loads come from its own router on this layer's MoE input,
the experts most tokens pick first, up to the capacity: a long prompt's layers then find
their experts loaded (hits), where the predictor, not yet taught the prompt, guesses for one
token. Outputs stay the resident model's (the family tests run prompts through it too).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stmoe.hf.capture_generate import capture_generation  # noqa: E402
from stmoe.predictors import profile, save_tables  # noqa: E402
from stmoe.runtime.api import offload  # noqa: E402
from stmoe.runtime.store import pack  # noqa: E402
from tiny_moe import tiny_model  # noqa: E402

PROMPT = list(range(3, 43))  # 40 tokens: every layer routes to most of its 8 experts


def _prefill(om, stream: bool):
    if not stream:
        om.engine.planner.prompt_routers = None
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        (_, stats) = om.measure(lambda: om.model(input_ids=ids).logits)
    return stats.phases["prefill"].summary(per_layer=True)


def test_a_long_prompt_finds_its_next_layers_loaded(tmp_path):
    model, _ = tiny_model("qwen3_moe")
    store = pack(model, tmp_path / "store")
    trace = capture_generation(tiny_model("qwen3_moe")[0], [[20, 21, 22, 23]], max_new_tokens=8)
    tables = save_tables(profile(trace), tmp_path / "tables.npz")
    with torch.no_grad():
        want = model(input_ids=torch.tensor([PROMPT])).logits
    # The streamed loads race the compute thread, so on a machine loaded past its cores a
    # worker may be scheduled only after the compute got there (0 prefetch reads, seen at
    # load 3.4): the figures are asked of one of three tries; the bits of every one.
    for _ in range(3):
        got = {}
        for stream in (True, False):
            with offload(tiny_model("qwen3_moe")[0], store, capacity=8, predictor="stmoe",
                         tables=tables, tier="emulated", bandwidth="20MB") as om:
                got[stream] = _prefill(om, stream)
                with torch.no_grad():  # the same bits either way
                    assert torch.equal(om.model(input_ids=torch.tensor([PROMPT])).logits, want)
        on, off = got[True], got[False]
        # layer 0 is never streamed (nothing runs before it); layers 1 and 2 are; at least
        # one streamed layer finds experts waiting (each one does on a quiet machine)
        if (on["prefetch_reads"] > off["prefetch_reads"] and on["hits"] > off["hits"]
                and on["demand_reads"] < off["demand_reads"]
                and any(layer["hits"] > 0 for layer in on["per_layer"][1:])):
            return
    pytest.fail(f"in 3 tries the streamed prompt found no more experts loaded: {on}, {off}")
