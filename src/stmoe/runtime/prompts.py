"""A prompt given as token ids, checked before it reaches the model (a bad id would index
past the embedding, or be silently wrapped), and the one greedy generation every
runner calls (``OffloadedModel.generate``, each request of the step batcher)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from stmoe.errors import OffloadError


def prompt_ids(prompt: Any, config: Any) -> torch.Tensor:
    """[1, S] token ids from a flat list of ints within the vocabulary (a 1-D tensor or
    array of integers too, or one row of them: [1, S])."""
    vocab = getattr(config, "vocab_size", None) or getattr(
        getattr(config, "text_config", None), "vocab_size", None)
    if isinstance(prompt, (torch.Tensor, np.ndarray)):
        array = prompt.detach().cpu().numpy() if isinstance(prompt, torch.Tensor) else prompt
        if array.ndim == 2 and array.shape[0] == 1:
            array = array[0]
        if array.ndim != 1 or array.dtype.kind not in "iu":
            raise OffloadError(f"prompt: a tensor of shape {list(array.shape)} and dtype "
                               f"{array.dtype}; expected one sequence of integer token ids")
        prompt = array.tolist()
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


def greedy_generate(model: Any, ids: torch.Tensor, max_new_tokens: int, ignore_eos: bool,
                    **extra: Any) -> torch.Tensor:
    """transformers' greedy ``generate`` on ``ids`` [1, S], no padding; ``ignore_eos``:
    exactly ``max_new_tokens`` (a measured run); ``extra``: a streamer, stopping criteria."""
    gen = model.generation_config
    pad = gen.pad_token_id if gen.pad_token_id is not None else gen.eos_token_id
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids),
                              max_new_tokens=max_new_tokens,
                              min_new_tokens=max_new_tokens if ignore_eos else None,
                              do_sample=False, pad_token_id=pad[0] if isinstance(pad, list)
                              else pad, **UNALTERED, **extra)


# A checkpoint's generation_config.json may ask for logits processors that change the
# greedy token (Qwen1.5-MoE-Chat: repetition_penalty 1.1), which transformers applies even
# with do_sample=False: the model's own argmax, as stmoe reports it and `serve` promises
# (no penalties), needs them off
UNALTERED: dict[str, Any] = {
    "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "bad_words_ids": None,
    "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None,
    "forced_bos_token_id": None, "forced_eos_token_id": None,
    "exponential_decay_length_penalty": None,
}
