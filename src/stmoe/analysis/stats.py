"""The statistics behind ST-MoE's two observations (docs/method.md), pure numpy/scipy.

Spatial: is the expert set at layer l+1 independent of the set at layer l?
Temporal: do consecutive tokens share more experts than random routing would?
Plus the load skew and per-domain differences that colour both.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from scipy import stats
from scipy.spatial.distance import jensenshannon

from stmoe.trace.schema import RoutingTrace

ALPHA = 0.01  # significance level of the independence tests (docs/method.md: p < 0.01)
MIN_EXPECTED = 5.0  # every expected count of the pooled table at least this (Cochran, strict)


@dataclass(frozen=True)
class PairTest:
    """Chi-square test of independence for one adjacent layer pair (l, l+1)."""

    layer: int  # l; the pair is (l, l+1)
    statistic: float  # T x sum of squared canonical correlations (see ``spatial_test``)
    dof: int
    p_value: float
    cramers_v: float  # sqrt(statistic / (T * min(dof_rows, dof_cols))); Cramér's V when K = 1
    pearson_statistic: float  # plain Pearson X^2 of the pooled co-activation table, for reference
    tokens: int
    rows_kept: int  # experts of layer l tested as their own category
    cols_kept: int
    rows_pooled: int  # rarer experts of layer l pooled into one "other" category
    cols_pooled: int
    rows_empty: int  # experts never chosen at layer l (dropped)
    cols_empty: int

    @property
    def significant(self) -> bool:
        return self.p_value < ALPHA

    def to_dict(self) -> dict[str, float | int | bool]:
        return {**asdict(self), "significant": self.significant}


def spatial_test(experts: np.ndarray, layer: int, num_experts: int) -> PairTest:
    """Independence of the expert sets of layer ``layer`` and ``layer+1``, over tokens.

    Each token is one observation: its category counts x (layer l) and y (layer
    l+1). The statistic is T times the sum of squared canonical correlations
    between x and y, T * tr(Sxx^+ Sxy Syy^+ Syx), asymptotically chi-square with
    rank(Sxx) * rank(Syy) degrees of freedom under independence. With one expert
    per token (K = 1) it is exactly Pearson's X^2 of the co-activation table; for
    K > 1 it accounts for a token's K experts being distinct, which plain X^2 on
    the K^2 pair counts does not (that test is deflated and loses power).

    Sparse counts: experts are ranked by use and the rarest are pooled into one
    "other" category per side until every expected count of the co-activation
    table is at least 5 (Cochran's rule in its strict form: the 80% form left the
    test visibly liberal under skewed load); never-chosen experts are dropped.
    Tokens are treated as independent: strong temporal correlation makes p-values
    optimistic. Calibration on null traces: docs/analysis.md.
    """
    n = num_experts
    e, f = experts[:, layer].astype(np.int64), experts[:, layer + 1].astype(np.int64)
    row_use = np.bincount(e[e >= 0], minlength=n)
    col_use = np.bincount(f[f >= 0], minlength=n)
    if not row_use.any() or not col_use.any():  # a layer that routed no token: no test
        return PairTest(layer=layer, statistic=0.0, dof=0, p_value=1.0, cramers_v=0.0,
                        pearson_statistic=0.0, tokens=len(e), rows_kept=0, cols_kept=0,
                        rows_pooled=0, cols_pooled=0, rows_empty=int((row_use == 0).sum()),
                        cols_empty=int((col_use == 0).sum()))
    pairs = (e[:, :, None] >= 0) & (f[:, None, :] >= 0)
    table = np.bincount((e[:, :, None] * n + f[:, None, :])[pairs], minlength=n * n).reshape(n, n)
    row_map, kept_r, col_map, kept_c = _merge_categories(table, row_use, col_use)
    x, y = _category_counts(e, row_map, kept_r + 1), _category_counts(f, col_map, kept_c + 1)
    t = len(e)
    xc, yc = x - x.mean(axis=0), y - y.mean(axis=0)
    sxx, syy, sxy = xc.T @ xc / t, yc.T @ yc / t, xc.T @ yc / t
    (ix, rx), (iy, ry) = _pseudo_inverse(sxx), _pseudo_inverse(syy)
    statistic = float(t * np.trace(ix @ sxy @ iy @ sxy.T))
    dof = int(rx * ry)
    pooled = np.zeros((kept_r + 1, kept_c + 1))
    np.add.at(pooled, (row_map[:, None], col_map[None, :]), table)
    pooled = pooled[:, pooled.sum(axis=0) > 0][pooled.sum(axis=1) > 0]
    pearson = float(stats.chi2_contingency(pooled, correction=False)[0]) if dof else 0.0
    return PairTest(
        layer=layer, statistic=statistic, dof=dof,
        p_value=float(stats.chi2.sf(statistic, dof)) if dof else 1.0,
        cramers_v=float(np.sqrt(max(statistic, 0.0) / (t * min(rx, ry)))) if dof else 0.0,
        pearson_statistic=pearson, tokens=t, rows_kept=kept_r, cols_kept=kept_c,
        rows_pooled=int((row_use > 0).sum()) - kept_r,
        cols_pooled=int((col_use > 0).sum()) - kept_c,
        rows_empty=int((row_use == 0).sum()), cols_empty=int((col_use == 0).sum()),
    )


def _pseudo_inverse(cov: np.ndarray) -> tuple[np.ndarray, int]:
    """Moore-Penrose inverse of a covariance matrix and its rank.

    Category counts always sum to K, so the covariance is singular by design; the
    tolerance is far above rounding (numpy's default would invert a 1e-16 eigenvalue
    left by rounding and wreck the statistic).
    """
    values, vectors = np.linalg.eigh(cov)
    keep = values > 1e-10 * max(values.max(initial=0.0), 1e-300)
    inverse = (vectors[:, keep] / values[keep]) @ vectors[:, keep].T
    return inverse, int(keep.sum())


def _category_counts(side: np.ndarray, mapping: np.ndarray, n_cat: int) -> np.ndarray:
    """[T, C] float: how many of each token's experts fall in each category."""
    valid = side >= 0
    cats = mapping[np.where(valid, side, 0)]
    rows = np.broadcast_to(np.arange(len(side))[:, None], side.shape)
    counts = np.zeros((len(side), n_cat))
    np.add.at(counts, (rows[valid], cats[valid]), 1.0)
    return counts


def _merge_categories(table, row_use, col_use):  # type: ignore[no-untyped-def]
    """Category of every expert per side: its own index for the most used, last = "other".

    Shrinks the kept categories one at a time (the side with more first) until every
    expected count of the pooled table reaches ``MIN_EXPECTED``; suffix sums make
    each try O(rows x cols).
    """
    order_r, order_c = np.argsort(-row_use, kind="stable"), np.argsort(-col_use, kind="stable")
    ts = table[order_r][:, order_c].astype(np.float64)
    below = np.vstack([np.cumsum(ts[::-1], axis=0)[::-1], np.zeros((1, ts.shape[1]))])
    right = np.hstack([np.cumsum(ts[:, ::-1], axis=1)[:, ::-1], np.zeros((ts.shape[0], 1))])
    nr, nc = int((row_use > 0).sum()), int((col_use > 0).sum())
    while True:
        merged = np.zeros((nr + 1, nc + 1))
        merged[:nr, :nc] = ts[:nr, :nc]
        merged[nr, :nc] = below[nr, :nc]
        merged[:nr, nc] = right[:nr, nc]
        merged[nr, nc] = below[nr, nc:].sum()
        merged = merged[:, merged.sum(axis=0) > 0][merged.sum(axis=1) > 0]
        expected = np.outer(merged.sum(axis=1), merged.sum(axis=0)) / max(merged.sum(), 1)
        valid = expected.min() >= MIN_EXPECTED
        if valid or (nr <= 1 and nc <= 1):
            return _category_map(order_r, nr), nr, _category_map(order_c, nc), nc
        if nr >= nc:
            nr -= 1
        else:
            nc -= 1


def _category_map(order: np.ndarray, kept: int) -> np.ndarray:
    mapping = np.full(len(order), kept, dtype=np.int64)
    mapping[order[:kept]] = np.arange(kept)
    return mapping


@dataclass(frozen=True)
class Overlap:
    """Mean |E_t ∩ E_t-1| at one layer over consecutive tokens of a sequence."""

    mean: float
    ci_low: float
    ci_high: float
    pairs: int  # consecutive-token pairs counted


def consecutive_overlap(trace: RoutingTrace) -> np.ndarray:
    """[P, L] int: overlap of each token's expert set with the previous token's, per layer,
    for the P token pairs inside a sequence."""
    ex = np.asarray(trace.experts)
    follows = np.ones(trace.num_tokens, dtype=bool)
    follows[np.asarray(trace.seq_starts)] = False
    cur, prev = ex[follows], ex[np.flatnonzero(follows) - 1]
    same = (cur[..., :, None] == prev[..., None, :]) & (cur[..., :, None] >= 0)
    return same.sum(axis=(-1, -2))


def batch_means_ci(series: np.ndarray, batches: int = 20, level: float = 0.95) -> Overlap:
    """Mean and confidence interval robust to autocorrelation (method of batch means)."""
    series = np.asarray(series, dtype=float)
    m = len(series)
    if m == 0:
        return Overlap(0.0, 0.0, 0.0, 0)
    b = max(2, min(batches, m // 5)) if m >= 10 else 0
    if b == 0:
        return Overlap(float(series.mean()), float("nan"), float("nan"), m)
    means = np.array([chunk.mean() for chunk in np.array_split(series, b)])
    half = stats.t.ppf(0.5 + level / 2, b - 1) * means.std(ddof=1) / np.sqrt(b)
    return Overlap(
        float(series.mean()), float(series.mean() - half), float(series.mean() + half), m
    )


def reuse_distances(trace: RoutingTrace, max_distance: int = 64) -> np.ndarray:
    """[max_distance + 1] counts: tokens until an expert returns at the same layer
    (1 = the next token), within a sequence; the last bin counts longer gaps."""
    hist = np.zeros(max_distance + 1, dtype=np.int64)
    n = trace.num_experts
    for _, sl in trace.sequences():
        ex = np.asarray(trace.experts[sl], dtype=np.int64)
        for layer in range(trace.num_layers):
            last = np.full(n, -1, dtype=np.int64)
            for t, row in enumerate(ex[:, layer]):
                row = row[row >= 0]
                seen = last[row]
                d = t - seen[seen >= 0]
                np.add.at(hist, np.minimum(d, max_distance), 1)
                last[row] = t
    return hist


def load_skew(load: np.ndarray) -> dict[str, list[float]]:
    """Per layer (rows of ``load`` [L, N]): max/mean use and the share of the top 10%."""
    total = load.sum(axis=1)
    mean = load.mean(axis=1)
    top = max(1, int(np.ceil(0.1 * load.shape[1])))
    top_share = np.sort(load, axis=1)[:, ::-1][:, :top].sum(axis=1) / np.maximum(total, 1)
    return {
        "max_over_mean": (load.max(axis=1) / np.maximum(mean, 1e-12)).tolist(),
        "top10_share": top_share.tolist(),
    }


def js_divergence(load_a: np.ndarray, load_b: np.ndarray) -> np.ndarray:
    """[L] Jensen-Shannon divergence (bits, 0..1) between two domains' expert use per layer."""
    return np.array([jensenshannon(a, b, base=2) ** 2 if a.sum() and b.sum() else 0.0
                     for a, b in zip(load_a, load_b, strict=True)])
