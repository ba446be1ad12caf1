"""A completion's text as it reads after its prompt (``AfterPrompt``).

Decoded alone, a completion loses what its first token owes to the text before it: a
sentencepiece tokenizer (Llama's, Mixtral's, Gemma's) drops the leading space of the first
word it decodes, so the prompt "Say" and the completion "▁hello" read "Sayhello". So the
completion is decoded after the prompt's last few tokens and that context's own text is cut
off: the text it adds to the prompt's, as vLLM's detokenizer gives it (vLLM 0.30 primes its
incremental decoder with the whole prompt; earlier releases with 4 to 24 of its last tokens,
the fewest whose text holds no incomplete character, which is what is taken here: a few
tokens settle how the first one reads, and the cost stays small). Where the context's text does not
begin the whole (a character split between prompt and completion), the completion is
decoded alone, as before.

Byte-level tokenizers (GPT-2's, Llama 3's, Qwen's, the shipped model's) read the same
either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

# the prompt tokens decoded before a completion (the bounds earlier vLLM releases took)
CONTEXT_MIN, CONTEXT_MAX = 4, 24
REPLACEMENT = "\ufffd"  # what a decoder gives for bytes of an incomplete character


class Decodes(Protocol):
    """What is read of a tokenizer here (transformers' tokenizers have it)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class AfterPrompt:
    """``self(tokens)``: the text ``tokens`` add after ``prompt``, decoded by ``tokenizer``
    (``skip_special_tokens`` as transformers' ``decode`` takes it)."""

    def __init__(self, tokenizer: Decodes, prompt: Sequence[int],
                 skip_special_tokens: bool = False) -> None:
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.context = self._context([int(t) for t in prompt])
        self.head = self._decode(self.context)

    def __call__(self, tokens: Sequence[int]) -> str:
        added = self.after(tokens)
        return self._decode(list(tokens)) if added is None else added

    def after(self, tokens: Sequence[int]) -> str | None:
        """The text ``tokens`` add after the context, or None where the context's own text
        does not begin the whole (or there is none): ``__call__`` decodes them alone."""
        if not self.head:  # no context, or one of special tokens only
            return None
        whole = self._decode(self.context + list(tokens))
        return whole[len(self.head):] if whole.startswith(self.head) else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def _context(self, prompt: list[int]) -> list[int]:
        """The prompt's last CONTEXT_MIN tokens or more, up to the first count whose text
        holds no incomplete character (at most CONTEXT_MAX)."""
        if len(prompt) <= CONTEXT_MIN:
            return prompt
        for n in range(CONTEXT_MIN, min(len(prompt), CONTEXT_MAX) + 1):
            if REPLACEMENT not in self._decode(prompt[-n:]):
                return prompt[-n:]
        return prompt[-CONTEXT_MAX:]
