"""Resident-memory sampling, for the steadiness checks of long offloaded generations."""

from __future__ import annotations

import os
from typing import Any

import torch


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class MemoryProbe:
    """Samples RSS and the largest cache occupancy every ``every`` forward calls."""

    def __init__(self, model: torch.nn.Module, engine: Any, every: int = 50) -> None:
        self.engine, self.every = engine, every
        self.samples: list[tuple[int, int]] = []  # (forward call, rss bytes)
        self.peak_cached = 0  # most experts any layer's cache held at a sample
        self._calls = 0
        self._hook = model.register_forward_hook(self._sample)

    def _sample(self, *_: Any) -> None:
        self._calls += 1
        if self._calls % self.every == 0:
            self.samples.append((self._calls, rss_bytes()))
            with self.engine.cv:
                held = max(len(c.where) for c in self.engine.caches)
            self.peak_cached = max(self.peak_cached, held)

    def close(self) -> None:
        self._hook.remove()

    def growth_after(self, warmup: int) -> float:
        """Largest RSS after ``warmup`` forward calls relative to the first sample after it."""
        after = [rss for call, rss in self.samples if call >= warmup]
        if len(after) < 2 or after[0] == 0:
            return 0.0
        return max(after) / after[0] - 1.0
