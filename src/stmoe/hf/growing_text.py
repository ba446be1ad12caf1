"""A completion's text as its tokens come, each read costing the tokens since a recent point
rather than all of them (``GrowingText``).

Why: a server reads a completion's text after every token (for its stop strings and what to
stream), so decoding it whole each time costs a token O(n) and a completion O(n^2), on the
event loop every client shares. Decoders read tokens locally (bytes joined, a word's
leading space), so the text is fixed at a point where it ends in a whole character, every
``STRIDE`` tokens, and the tokens after it are decoded after the few before it, that
context's own text cut off (``AfterPrompt``, as a completion after its prompt). The text is
always what decoding the completion whole gives (``AfterPrompt(prompt)(tokens)``): where a
context's text does not begin the whole (a decoder that reads further back there), that
read decodes the completion whole, as before.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from stmoe.hf.completion_text import CONTEXT_MAX, REPLACEMENT, AfterPrompt, Decodes

STRIDE = 32  # tokens read after the fixed point before it moves on (and is decoded again)


class GrowingText:
    """``self(tokens, n)``: the text of a growing completion's first ``n`` ``tokens`` (all,
    without ``n``) as it reads after ``prompt`` (each call's ``tokens`` the same completion's
    so far; a length before the settled point is decoded whole); ``hidden`` tokens
    (end-of-sequence ids) are not shown. A call reads only the tokens it decodes."""

    def __init__(self, tokenizer: Decodes, prompt: Sequence[int],
                 skip_special_tokens: bool = False, hidden: Collection[int] = ()) -> None:
        self.tokenizer, self.skip, self.hidden = tokenizer, skip_special_tokens, hidden
        self.prompt = [int(t) for t in prompt][-CONTEXT_MAX:]
        self.whole = AfterPrompt(tokenizer, self.prompt, skip_special_tokens)
        self.fixed, self.fixed_text = 0, ""  # the tokens whose text is settled, and it
        self.context = self.whole  # what the tokens after ``fixed`` are decoded after

    def __call__(self, tokens: Sequence[int], n: int | None = None) -> str:
        n = len(tokens) if n is None else n
        if n < self.fixed or self.fixed == 0:  # (before it: a log-probability's offset)
            text = self.whole(self._shown(tokens[:n]))
        else:
            added = self.context.after(self._shown(tokens[self.fixed:n]))
            if added is None:  # this decoder reads further back here
                return self.whole(self._shown(tokens[:n]))
            text = self.fixed_text + added
        if n - self.fixed >= STRIDE and not text.endswith(REPLACEMENT):
            self._fix(tokens, n, text)
        return text

    def _fix(self, tokens: Sequence[int], n: int, text: str) -> None:
        """Settle the first ``n`` tokens' ``text``; the next are decoded after the last few
        of them (the prompt's before them, for a short completion)."""
        before = [*self.prompt, *self._shown(tokens[max(0, n - CONTEXT_MAX):n])]
        self.fixed, self.fixed_text = n, text
        self.context = AfterPrompt(self.tokenizer, before[-CONTEXT_MAX:], self.skip)

    def _shown(self, tokens: Sequence[int]) -> list[int]:
        return [int(t) for t in tokens if t not in self.hidden]
