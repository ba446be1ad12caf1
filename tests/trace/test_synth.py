"""The synthetic generator: seeded, marked synthetic, and its knobs do what they say."""

from __future__ import annotations

import numpy as np
import pytest

from stmoe import TraceError, synthesize


def overlap_ratio(trace) -> float:
    """Mean |E_t ∩ E_t-1| at the same layer over consecutive tokens, / (K^2/N)."""
    ex, k, n = trace.experts, trace.top_k, trace.num_experts
    same_seq = np.ones(trace.num_tokens, dtype=bool)
    same_seq[trace.seq_starts] = False
    a, b = ex[1:][same_seq[1:]], ex[:-1][same_seq[1:]]
    hits = (a[..., :, None] == b[..., None, :]).sum(axis=(-1, -2))
    return float(hits.mean() / (k * k / n))


def next_layer_concentration(trace) -> float:
    """Share of layer-(l+1) picks that fall on the 2K most frequent successors of l's top expert."""
    ex, k = trace.experts.astype(np.int64), trace.top_k
    shares = []
    for layer in range(trace.num_layers - 1):
        src, dst = ex[:, layer, 0], ex[:, layer + 1]
        for e in np.unique(src):
            counts = np.bincount(dst[src == e].ravel(), minlength=trace.num_experts)
            shares.append(np.sort(counts)[::-1][: 2 * k].sum() / counts.sum())
    return float(np.mean(shares))


def test_same_seed_same_trace_and_marked_synthetic():
    a, b = synthesize(tokens=200, seed=3), synthesize(tokens=200, seed=3)
    assert np.array_equal(a.experts, b.experts) and np.array_equal(a.weights, b.weights)
    assert not np.array_equal(a.experts, synthesize(tokens=200, seed=4).experts)
    assert a.meta.synthetic and a.meta.model == "synthetic" and "synth" in a.meta.source


def test_weights_are_in_rank_order_and_sum_to_one():
    t = synthesize(tokens=100)
    assert np.all(np.diff(t.weights, axis=-1) <= 0)
    assert np.allclose(t.weights.sum(axis=-1), 1.0, atol=1e-5)


def test_null_model_has_random_overlap_and_stickiness_raises_it():
    null = synthesize(
        tokens=6000, layers=4, experts=32, top_k=4, sequences=4, spatial=0, temporal=0
    )
    sticky = synthesize(
        tokens=6000, layers=4, experts=32, top_k=4, sequences=4, spatial=0, temporal=0.5
    )
    assert 0.9 < overlap_ratio(null) < 1.1
    # Expected ~ (0.5*K + 0.5*K*K/N... ) / (K^2/N): far above 1.
    assert overlap_ratio(sticky) > 3


def test_spatial_knob_concentrates_next_layer_choices():
    loose = synthesize(tokens=4000, layers=3, experts=32, top_k=2, spatial=0.0, temporal=0)
    tight = synthesize(tokens=4000, layers=3, experts=32, top_k=2, spatial=0.95, temporal=0)
    assert next_layer_concentration(tight) > next_layer_concentration(loose) + 0.3


def test_domains_label_sequences_round_robin():
    t = synthesize(tokens=90, sequences=6, domains=3)
    assert t.domains == ("synth-0", "synth-1", "synth-2") * 2


@pytest.mark.parametrize(
    "bad",
    [
        dict(top_k=0),
        dict(top_k=70, experts=64),
        dict(spatial=1.5),
        dict(sequences=0),
        dict(domains=5, sequences=4),
        dict(tokens=0),
    ],
)
def test_bad_specs_are_clear_errors(bad):
    with pytest.raises(TraceError, match="synthetic spec"):
        synthesize(**bad)
