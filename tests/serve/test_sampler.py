"""A request's own sampler (``runtime.batcher.sampling``): greedy stays the untouched path,
a seed decides every draw, the draws follow the distribution temperature, top-k and top-p
make (checked against an independent numpy reference), the log-probabilities are the
model's; and through the step batcher, a seeded request's tokens are its solo run's
whatever the cache's capacity and predictor, alone or beside others, in bf16 and in one
batched int4 forward."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from stmoe.runtime.batcher import Request, Sampling, StepBatcher, choice_seed  # noqa: E402
from stmoe.runtime.batcher.sampling import Sampler, warp  # noqa: E402

LOGITS = torch.tensor([[2.0, 1.5, 0.3, -0.4, 1.1, -2.0, 0.0, 0.9]])


def _draws(sampling: Sampling, count: int, logits: torch.Tensor = LOGITS) -> list[int]:
    sampler = Sampler(sampling, [])
    return [int(torch.argmax(sampler(torch.zeros(1, 1), logits.clone()))) for _ in range(count)]


def _reference(logits: np.ndarray, t: float, k: int, p: float) -> np.ndarray:
    """The probabilities sampling must follow, written apart from ``warp``: softmax of
    logits / t over the k most likely, then the most likely tokens whose mass first
    reaches p (ties never occur in LOGITS)."""
    z = logits / t
    keep = np.argsort(-z)[:k] if k else np.argsort(-z)
    probs = np.exp(z[keep] - z[keep].max())
    probs /= probs.sum()
    mass, chosen = 0.0, []
    for token, q in zip(keep, probs, strict=True):
        chosen.append(token)
        mass += q
        if mass >= p:
            break
    out = np.zeros_like(logits)
    out[chosen] = np.exp(z[chosen] - z[chosen].max())
    return out / out.sum()


def test_greedy_is_the_untouched_path():
    assert Sampling().processor([]) is None  # no processor: generate as before, bit for bit
    record: list = []
    scores = LOGITS.clone()
    assert Sampling(logprobs=2).processor(record)(torch.zeros(1, 1), scores) is scores
    assert record[0].token == 0
    assert Sampling(temperature=1e-6).greedy  # below vLLM's epsilon


def test_a_seed_decides_every_draw():
    a = _draws(Sampling(temperature=1.0, seed=7), 50)
    assert a == _draws(Sampling(temperature=1.0, seed=7), 50)
    assert a != _draws(Sampling(temperature=1.0, seed=8), 50)
    assert len(set(a)) > 3  # it samples
    unseeded = [_draws(Sampling(temperature=1.0), 30) for _ in range(3)]
    assert len({tuple(u) for u in unseeded}) > 1  # each draws its own seed from the OS
    assert choice_seed(7, 0) == 7 and choice_seed(7, 2) == 9 and choice_seed(None, 3) is None
    # a seed outside torch's range is taken modulo 2^64
    assert _draws(Sampling(temperature=1.0, seed=-1), 20) == _draws(
        Sampling(temperature=1.0, seed=2**64 - 1), 20)


def test_seeds_that_differ_in_their_high_bits_draw_apart():
    """torch's CPU generator keeps a seed's low 32 bits: 0, 2^32 and 2^63 drew alike (found
    by a hostile client). Every seed's 64 bits now count; a seed below 2^32 draws as it
    always did."""
    from stmoe.runtime.batcher.sampling import generator_seed

    seeds = [0, 1, 2**32, 2**32 + 1, 2**63, 2**64 - 1, 5 << 40]
    draws = {s: tuple(_draws(Sampling(temperature=1.0, seed=s), 40)) for s in seeds}
    assert len(set(draws.values())) == len(seeds), draws
    assert [generator_seed(s) for s in (0, 1, 2**32 - 1)] == [0, 1, 2**32 - 1]
    assert all(0 <= generator_seed(s) < 2**32 for s in seeds)


@pytest.mark.parametrize(("t", "k", "p"), [(1.0, 0, 1.0), (0.7, 4, 1.0), (1.3, 0, 0.8),
                                           (0.9, 5, 0.7)])
def test_the_draws_follow_the_warped_distribution(t, k, p):
    want = _reference(LOGITS[0].numpy().astype(np.float64), t, k, p)
    assert np.allclose(torch.softmax(warp(LOGITS[0], Sampling(t, p, k)), -1).numpy(), want,
                       atol=1e-6)
    n = 4000
    counts = np.bincount(_draws(Sampling(t, p, k, seed=1), n), minlength=want.size)
    assert all(counts[want == 0] == 0)  # cut tokens are never drawn
    # within 5 standard deviations of the expected count (deterministic: seeded)
    spread = 5 * np.sqrt(n * want * (1 - want)) + 1
    assert np.all(np.abs(counts - n * want) <= spread), (counts, n * want)


def test_top_k_1_and_a_tiny_top_p_are_the_argmax():
    assert set(_draws(Sampling(temperature=1.5, top_k=1, seed=3), 20)) == {0}
    assert set(_draws(Sampling(temperature=1.5, top_p=1e-6, seed=3), 20)) == {0}


def test_log_probabilities_are_the_models_own():
    record: list = []
    Sampler(Sampling(temperature=2.0, seed=4, logprobs=3), record)(torch.zeros(1, 1),
                                                                  LOGITS.clone())
    (entry,) = record
    logp = torch.log_softmax(LOGITS[0], -1)  # before the temperature
    assert entry.logprob == float(logp[entry.token])
    assert [t for t, _ in entry.top] == [0, 1, 4]
    assert [v for _, v in entry.top] == [float(logp[t]) for t in (0, 1, 4)]
    assert math.isclose(sum(math.exp(v) for v in logp.tolist()), 1.0, rel_tol=1e-6)


def _drawn(batcher: StepBatcher, prompts: list[list[int]], samplings: list[Sampling],
           n: int) -> list[tuple[list[int], list]]:
    """Each request's tokens and log-probabilities, all submitted at once (the batcher then
    closed)."""
    try:
        reqs = [Request(torch.tensor([p]), n, sampling=s)
                for p, s in zip(prompts, samplings, strict=True)]
        batcher.submit_all(reqs)
        return [(r.wait(300), r.logprobs) for r in reqs]
    finally:
        batcher.close()


@pytest.mark.parametrize(("capacity", "predictor"), [("25%", "ondemand"), ("50%", "stmoe-plus")])
def test_seeded_requests_in_the_batcher_draw_their_solo_tokens(capacity, predictor, solo):
    """Prefetching changes no output: at either capacity and predictor, two seeded requests
    sharing steps and a third alone each draw the tokens of their solo run."""
    from stmoe.models import SHIPPED_MODEL
    from stmoe.runtime.api import offload

    prompts = [solo.ids(p) for p in ("def fib(n):", "The capital of France is", "Once upon a")]
    samplings = [Sampling(temperature=1.0, seed=11), Sampling(0.8, 0.9, 20, seed=12),
                 Sampling(1.2, seed=13, logprobs=2)]
    want = [solo.sampled(p, 10, s) for p, s in zip(prompts, samplings, strict=True)]
    with offload(SHIPPED_MODEL, capacity=capacity, predictor=predictor) as om:
        batcher = StepBatcher(om, max_batch=2)
        assert _drawn(batcher, prompts, samplings, 10) == want
    assert max(batcher.decode_sizes()) == 2  # they shared steps


def test_seeded_requests_in_one_batched_int4_forward_draw_their_solo_tokens(tmp_path,
                                                                            monkeypatch):
    """int4 with its resident linears quantized: a decode step is one batched forward, whose
    rows are still each request's solo logits; so are its seeded draws (on the resident
    int4 model, alone)."""
    from serve_live import PROMPTS, Solo
    from transformers import AutoModelForCausalLM

    from stmoe.models import SHIPPED_MODEL
    from stmoe.quant import parse_format
    from stmoe.quant.experts import quantize_model
    from stmoe.quant.linears import quantize_linears
    from stmoe.runtime.api import offload

    resident = quantize_model(AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL).eval(),
                              parse_format("int4"))
    quantize_linears(resident, parse_format("int4"))
    alone = Solo(resident)
    prompts = [alone.ids(p) for p in PROMPTS[:3]]
    samplings = [Sampling(1.0, seed=21, logprobs=1), Sampling(0.8, 0.95, 30, seed=22),
                 Sampling(1.1, seed=23)]
    want = [alone.sampled(p, 8, s) for p, s in zip(prompts, samplings, strict=True)]
    monkeypatch.setenv("STMOE_CACHE", str(tmp_path))  # its int4 store packed there
    with offload(SHIPPED_MODEL, capacity="50%", predictor="stmoe-plus", format="int4",
                 quantize_resident="int4") as om:
        batcher = StepBatcher(om, max_batch=3)
        assert batcher.batched
        assert _drawn(batcher, prompts, samplings, 8) == want
    assert batcher.step_forward.steps > 0 and max(batcher.decode_sizes()) >= 2
