"""A prompt given as token ids, checked before it reaches the model (a bad id would index
past the embedding, or be silently wrapped)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from stmoe.errors import OffloadError


def prompt_ids(prompt: Any, config: Any) -> torch.Tensor:
    """[1, S] token ids from a flat list of ints within the vocabulary."""
    vocab = getattr(config, "vocab_size", None) or getattr(
        getattr(config, "text_config", None), "vocab_size", None)
    ids = []
    for i, t in enumerate(prompt):
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise OffloadError(
                f"prompt token {i} is {t!r}; expected text or a flat list of token ids"
            )
        if t < 0 or (vocab is not None and t >= vocab):
            raise OffloadError(f"prompt token {i} is {t}, outside the vocabulary 0..{vocab - 1}"
                             if vocab else f"prompt token {i} is negative")
        ids.append(int(t))
    return torch.tensor([ids], dtype=torch.long)
