r"""The field's prediction metrics over (token, layer) counts, named as in docs/method.md.

Per (token, layer) with actual set A and prefetch set P:
recall = sum |P ∩ A| / sum |A| (the paper's "prediction accuracy", also the
prefetch hit rate); precision = sum |P ∩ A| / sum |P|; set size = mean |P|;
waste = sum |P - A| (experts prefetched and not used at that step); read
amplification = (sum |P| + sum |A - P|) / sum |A|, the experts moved per expert
needed when nothing stays cached between steps (the cache replay measures it
with a cache).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from stmoe.trace.schema import RoutingTrace


@dataclass(frozen=True)
class PredictionScore:
    """Recall, precision and set size over one group of (token, layer) steps."""

    hits: int  # sum |P ∩ A|
    actual: int  # sum |A|
    predicted: int  # sum |P|
    steps: int  # (token, layer) steps in the group

    @property
    def recall(self) -> float:
        return self.hits / self.actual if self.actual else 0.0

    @property
    def precision(self) -> float:
        return self.hits / self.predicted if self.predicted else 0.0

    @property
    def set_size(self) -> float:
        return self.predicted / self.steps if self.steps else 0.0

    @property
    def waste(self) -> int:
        return self.predicted - self.hits

    @property
    def read_amplification(self) -> float:
        moved = self.predicted + self.actual - self.hits
        return moved / self.actual if self.actual else 0.0

    def to_dict(self) -> dict[str, float | int | None]:
        """The figures, a ratio whose denominator is 0 as None (JSON null: a layer that
        routed nothing, a predictor that names nothing, has no recall or precision, and a
        0 there would pull a mean of the groups down)."""
        return {
            "recall": self.recall if self.actual else None,
            "precision": self.precision if self.predicted else None,
            "set_size": self.set_size if self.steps else None,
            "waste": self.waste,
            "waste_per_step": self.waste / self.steps if self.steps else None,
            "read_amplification": self.read_amplification if self.actual else None,
            "hits": self.hits,
            "actual": self.actual,
            "predicted": self.predicted,
            "steps": self.steps,
        }


def score(
    hits: np.ndarray, sizes: np.ndarray, actual: np.ndarray, mask: np.ndarray
) -> PredictionScore:
    """Sum the [T, L] counts where ``mask`` ([T, L] bool) holds."""
    return PredictionScore(
        hits=int(hits[mask].sum()),
        actual=int(actual[mask].sum()),
        predicted=int(sizes[mask].sum()),
        steps=int(np.count_nonzero(mask)),
    )


def scope_tokens(trace: RoutingTrace) -> np.ndarray:
    """[T] bool: the tokens accuracy is reported over (decode tokens if the trace marks any)."""
    decode = np.asarray(trace.is_decode, dtype=bool)
    return decode if decode.any() else np.ones(trace.num_tokens, dtype=bool)


def scope_layers(trace: RoutingTrace) -> np.ndarray:
    """[L] bool: layers 1..L-1 (layer 0 has no earlier layer to predict from), docs/method.md."""
    layers = np.ones(trace.num_layers, dtype=bool)
    if trace.num_layers > 1:
        layers[0] = False
    return layers


def scope_mask(trace: RoutingTrace) -> np.ndarray:
    """[T, L] bool: the (token, layer) steps the headline recall covers."""
    return scope_tokens(trace)[:, None] & scope_layers(trace)[None, :]


def describe_scope(trace: RoutingTrace) -> str:
    tokens = "decode tokens" if np.asarray(trace.is_decode).any() else "all tokens"
    layers = f"layers 1..{trace.num_layers - 1}" if trace.num_layers > 1 else "layer 0"
    return f"{tokens}, {layers}"
