"""Seeded synthetic routing traces with known structure, for tests and benchmarks.

SYNTHETIC DATA: every trace made here has ``meta.synthetic = True`` and model
name ``"synthetic"``; never report figures from it as a real model's.

The generator has the two structures ST-MoE relies on, each with one knob:

- ``spatial`` in [0, 1], cross-layer concentration: the next layer's expert
  distribution is ``(1 - spatial) * prior + spatial * transition(chosen experts)``
  where each expert's transition row puts all its mass on ``fan_out`` favoured
  experts of the next layer. 0 makes layers independent; 1 makes them as peaked
  as ``fan_out`` allows.
- ``temporal`` in [0, 1], cross-token stickiness: each of the previous token's
  experts at the same layer is kept with this probability.

With ``skew = 0`` the prior is uniform, so ``spatial = temporal = 0`` gives
independent uniform top-K routing (the null model of docs/method.md: consecutive-token
overlap K^2/N).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from stmoe.errors import TraceError
from stmoe.trace.schema import RoutingTrace, TraceMeta, validate
from stmoe.util.progress import progress


@dataclass(frozen=True)
class SynthSpec:
    """Shape and structure of a synthetic trace."""

    tokens: int = 4096  # T, all sequences together
    layers: int = 16  # L MoE layers
    experts: int = 64  # N routed experts per layer
    top_k: int = 4  # K
    sequences: int = 4  # S, lengths as equal as T allows
    spatial: float = 0.8  # cross-layer concentration, 0..1 (see module doc)
    temporal: float = 0.3  # probability of reusing each previous-token expert, 0..1
    domains: int = 1  # sequences take domains round-robin; each has its own tables
    skew: float = 0.0  # Zipf exponent of the per-layer prior; 0 = uniform load
    fan_out: int = 0  # favoured next-layer experts per expert; 0 = 2*top_k
    prefill_fraction: float = 0.25  # leading share of each sequence marked prefill
    seed: int = 0

    def check(self) -> None:
        def need(ok: bool, what: str, expected: str) -> None:
            if not ok:
                raise TraceError(f"synthetic spec: {what}", expected=expected)

        need(self.tokens >= 1, f"tokens={self.tokens}", "tokens >= 1")
        need(self.layers >= 1, f"layers={self.layers}", "layers >= 1")
        need(
            1 <= self.top_k <= self.experts,
            f"top_k={self.top_k}, experts={self.experts}",
            "1 <= top_k <= experts",
        )
        need(self.experts <= np.iinfo(np.int16).max, f"experts={self.experts}", "at most 32767")
        need(
            1 <= self.sequences <= self.tokens,
            f"sequences={self.sequences}",
            "1 <= sequences <= tokens",
        )
        need(
            1 <= self.domains <= self.sequences,
            f"domains={self.domains}",
            "1 <= domains <= sequences",
        )
        for name in ("spatial", "temporal", "prefill_fraction"):
            value = getattr(self, name)
            need(0.0 <= value <= 1.0, f"{name}={value}", "a number in [0, 1]")
        need(0 <= self.skew <= 20, f"skew={self.skew}", "a Zipf exponent in 0..20")
        need(self.seed >= 0, f"seed={self.seed}", "a seed >= 0")
        need(0 <= self.fan_out <= self.experts, f"fan_out={self.fan_out}", "0..experts")


@dataclass(frozen=True)
class _DomainTables:
    prior: np.ndarray  # [L, N] float64, layer-wise expert prior
    fav_ids: np.ndarray  # [L, N, F] int64, favoured experts of layer l for expert e of l-1
    fav_probs: np.ndarray  # [L, N, F] float64, their probabilities (rows sum to 1)


def synthesize(spec: SynthSpec | None = None, **overrides: object) -> RoutingTrace:
    """A synthetic trace; ``synthesize(tokens=1000, spatial=0.9)`` overrides defaults."""
    spec = dataclasses.replace(spec or SynthSpec(), **overrides)
    spec.check()
    rng = np.random.default_rng(spec.seed)
    tables = [_domain_tables(spec, rng) for _ in range(spec.domains)]
    lengths = np.full(spec.sequences, spec.tokens // spec.sequences)
    lengths[: spec.tokens % spec.sequences] += 1
    starts = np.r_[0, np.cumsum(lengths)[:-1]].astype(np.int64)
    seq_domain = np.arange(spec.sequences) % spec.domains
    experts = np.empty((spec.tokens, spec.layers, spec.top_k), dtype=np.int16)

    steps = progress(range(int(lengths.max())), int(lengths.max()), "synthesizing")
    for j in steps:
        active = np.flatnonzero(lengths > j)
        rows = starts[active] + j
        for d in range(spec.domains):
            mine = seq_domain[active] == d
            if mine.any():
                _route_position(spec, tables[d], rng, experts, rows[mine], first=j == 0)

    weights = rng.dirichlet(np.ones(spec.top_k), size=(spec.tokens, spec.layers))
    weights = -np.sort(-weights, axis=-1).astype(np.float32)  # rank order: largest first
    n_prefill = np.round(lengths * spec.prefill_fraction).astype(np.int64)
    is_decode = np.arange(spec.tokens) - np.repeat(starts, lengths) >= np.repeat(n_prefill, lengths)
    meta = TraceMeta(
        num_experts=spec.experts,
        top_k=spec.top_k,
        num_layers=spec.layers,
        model="synthetic",
        source=f"stmoe synth (seed={spec.seed}, spatial={spec.spatial}, temporal={spec.temporal})",
        synthetic=True,
        extra={"synth_spec": dataclasses.asdict(spec)},
    )
    return validate(
        RoutingTrace(
            experts=experts,
            seq_starts=starts,
            is_decode=is_decode,
            weights=weights,
            domains=tuple(f"synth-{d}" for d in seq_domain) if spec.domains > 1 else (),
            meta=meta,
        )
    )


def _domain_tables(spec: SynthSpec, rng: np.random.Generator) -> _DomainTables:
    n, layers = spec.experts, spec.layers
    fan = spec.fan_out or min(n, 2 * spec.top_k)
    zipf = np.arange(1, n + 1, dtype=np.float64) ** -spec.skew
    prior = np.stack([rng.permutation(zipf) for _ in range(layers)])
    prior /= prior.sum(axis=1, keepdims=True)
    # Favoured successors: distinct ids per row, drawn by the prior so skew carries over.
    fav_ids = np.empty((layers, n, fan), dtype=np.int64)
    for layer in range(layers):
        keys = np.log(prior[layer]) + rng.gumbel(size=(n, n))
        fav_ids[layer] = np.argpartition(-keys, fan - 1, axis=1)[:, :fan]
    fav_probs = rng.dirichlet(np.ones(fan), size=(layers, n))
    return _DomainTables(prior=prior, fav_ids=fav_ids, fav_probs=fav_probs)


def _route_position(
    spec: SynthSpec,
    tables: _DomainTables,
    rng: np.random.Generator,
    experts: np.ndarray,
    rows: np.ndarray,
    *,
    first: bool,
) -> None:
    """Route one token of each sequence in ``rows`` through every layer, in place."""
    b, n, k = len(rows), spec.experts, spec.top_k
    for layer in range(spec.layers):
        p = np.broadcast_to(tables.prior[layer], (b, n))
        if layer > 0 and spec.spatial > 0:
            prev = experts[rows, layer - 1].astype(np.int64)  # [B, K]
            ids = tables.fav_ids[layer][prev]  # [B, K, F]
            mass = tables.fav_probs[layer][prev] / k  # each chosen expert adds 1/K
            flat = (np.arange(b)[:, None, None] * n + ids).ravel()
            trans = np.bincount(flat, weights=mass.ravel(), minlength=b * n).reshape(b, n)
            p = (1 - spec.spatial) * p + spec.spatial * trans
        score = np.log(p + 1e-12) + rng.gumbel(
            size=(b, n)
        )  # Gumbel top-k = sampling w/o replacement
        if not first and spec.temporal > 0:
            prev_tok = experts[rows - 1, layer].astype(np.int64)  # [B, K]
            keep = rng.random((b, k)) < spec.temporal
            r, c = np.nonzero(keep)
            score[r, prev_tok[r, c]] += 1e6  # kept experts outrank every fresh draw
        top = np.argpartition(-score, k - 1, axis=1)[:, :k]
        order = np.argsort(-np.take_along_axis(score, top, axis=1), axis=1)
        experts[rows, layer] = np.take_along_axis(top, order, axis=1)
