"""How a request picks its tokens: greedily, or sampled with a generator of its own.

Why per request: the batcher gives each request's every logit bit for bit as its solo run
(whatever runs beside it, whatever the prefetcher did), so a token drawn from those logits
with the request's own ``torch.Generator``, seeded from the request alone, is its solo
run's token too. A generator shared by the batch (torch's global one, which transformers'
``do_sample`` draws from) would hand each request draws that depend on who else ran.

The ``Sampler`` is a transformers logits processor run last in the request's greedy
``generate``: it records the token's log-probabilities where asked, and when sampling,
draws the token itself and leaves it the only finite score, which greedy's argmax then
takes. Greedy requests without log-probabilities get no processor at all: their path is
the one of before, bit for bit.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import torch

# below this, a temperature is greedy (as vLLM's server has it: 1/T overflows the logits)
MIN_TEMPERATURE = 1e-5
SEED_SPACE = 2**64  # torch.Generator's seeds; a request's seed is taken modulo this
LOW_SEEDS = 2**32  # the part of a seed torch's CPU generator keeps (``generator_seed``)


@dataclass(frozen=True)
class Sampling:
    """A request's decoding: ``temperature`` 0 is greedy; ``top_k`` 0 keeps every token;
    ``seed`` None draws one from the OS (a random output); ``logprobs`` None records none,
    k >= 0 each token's log-probability and the k most likely tokens' (``TokenLogprob``)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def processor(self, record: list[TokenLogprob]) -> Sampler | None:
        """The logits processor that samples (and records into ``record``); None where the
        plain greedy path does it all."""
        if self.greedy and self.logprobs is None:
            return None
        return Sampler(self, record)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token: its id, its log-probability, and the ``k`` most likely tokens'
    (id, log-probability), most likely first. Log-probabilities are the model's own (a
    log-softmax of the logits), before temperature, top-k and top-p."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


class Sampler:
    """transformers' logits-processor protocol over a request's ``Sampling`` (the module
    docstring); ``record`` gets a ``TokenLogprob`` per token when asked for."""

    def __init__(self, sampling: Sampling, record: list[TokenLogprob]) -> None:
        self.sampling, self.record = sampling, record
        seed = sampling.seed if sampling.seed is not None else secrets.randbits(64)
        self.seed = seed % SEED_SPACE
        self.generator: torch.Generator | None = None  # made on the scores' device

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != 1:
            raise ValueError(f"a request samples one row, got {scores.shape[0]}")
        s = self.sampling
        token = int(torch.argmax(scores, dim=-1)) if s.greedy else self._draw(scores[0])
        if s.logprobs is not None:
            self.record.append(_logprobs(scores[0], token, s.logprobs))
        if s.greedy:
            return scores  # untouched: greedy's argmax picks ``token`` from these very bits
        only = torch.full_like(scores, float("-inf"))
        only[0, token] = 0.0
        return only

    def _draw(self, logits: torch.Tensor) -> int:
        if self.generator is None:
            self.generator = torch.Generator(device=logits.device)
            self.generator.manual_seed(generator_seed(self.seed))
        probs = torch.softmax(warp(logits, self.sampling), dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator))


def warp(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """``logits`` [V] divided by the temperature, then cut to the top k, then to the
    smallest set of most likely tokens whose probability reaches ``top_p`` (transformers'
    order and rules; the most likely token always stays)."""
    out = logits / s.temperature
    if 0 < s.top_k < out.shape[-1]:
        kth = torch.topk(out, s.top_k).values[-1]
        out = out.masked_fill(out < kth, float("-inf"))
    if s.top_p < 1.0:
        ordered, order = torch.sort(out, stable=True)
        cut = torch.softmax(ordered, dim=-1).cumsum(dim=-1) <= 1 - s.top_p
        cut[-1] = False
        out = out.masked_fill(torch.zeros_like(cut).scatter(0, order, cut), float("-inf"))
    return out


def _logprobs(scores: torch.Tensor, token: int, k: int) -> TokenLogprob:
    logp = torch.log_softmax(scores, dim=-1)
    top = torch.topk(logp, min(k, logp.shape[-1])) if k else None
    pairs = () if top is None else tuple(
        zip(top.indices.tolist(), top.values.tolist(), strict=True))
    return TokenLogprob(token, float(logp[token]), pairs)


def generator_seed(seed: int) -> int:
    """What ``seed`` (0..2^64-1) seeds a generator with. torch's CPU generator keeps only a
    seed's low 32 bits, so 0, 2^32 and 2^63 drew alike: a seed of 2^32 or more is mixed
    down (splitmix64's finalizer), so seeds that differ in their high bits draw apart; below
    2^32 it is itself (what it always drew). Two seeds may still meet, with odds 2^-32."""
    if seed < LOW_SEEDS:
        return seed
    z = (seed + 0x9E3779B97F4A7C15) % SEED_SPACE
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % SEED_SPACE
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % SEED_SPACE
    return (z ^ (z >> 31)) % LOW_SEEDS


def choice_seed(seed: int | None, index: int) -> int | None:
    """Choice ``index``'s seed of a request for several (``n``): ``seed + index`` (as vLLM
    seeds a request's choices), so choice i is the solo run with that seed; None stays
    None (each choice draws its own)."""
    return None if seed is None else seed + index
