"""A completion's text as its tokens come, each read costing the tokens since a recent point
rather than all of them (``GrowingText``).

Why: a server reads a completion's text after every token (for its stop strings and what to
stream), so decoding it whole each time costs a token O(n) and a completion O(n^2), on the
event loop every client shares. Decoders read tokens locally (bytes joined, a word's
leading space), so the text is settled at a point every ``STRIDE`` tokens or so, and the
tokens after it are decoded after the few before it, that context's own text cut off
(``AfterPrompt``, as a completion after its prompt). A point is settled only where the text
so far ends in a whole character and in that context's own text (a context that begins
inside a character, or reads otherwise than the text does there, is no context). The text is
what decoding the completion whole gives (``AfterPrompt(prompt)(tokens)``): where the
context's text does not begin the whole (a decoder that reads further back there), that read
decodes the completion whole; and a tokenizer that cleans up spaces across the whole text
(transformers' ``clean_up_tokenization_spaces``: a space's fate can hang on any earlier
apostrophe) is decoded whole at every read, as before.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from stmoe.hf.completion_text import CONTEXT_MAX, REPLACEMENT, AfterPrompt, Decodes

STRIDE = 32  # tokens read after the settled point before it moves on
RETRY = 8  # tokens read before a point that could not be settled is tried again


class GrowingText:
    """``self(tokens, n)``: the text of a growing completion's first ``n`` ``tokens`` (all,
    without ``n``) as it reads after ``prompt``; each call's ``tokens`` are the same
    completion's so far. ``hidden`` tokens (end-of-sequence ids) are not shown. A call
    decodes the tokens since the settled point and a few before it; a length before that
    point is decoded whole."""

    def __init__(self, tokenizer: Decodes, prompt: Sequence[int],
                 skip_special_tokens: bool = False, hidden: Collection[int] = ()) -> None:
        self.tokenizer, self.skip, self.hidden = tokenizer, skip_special_tokens, hidden
        self.whole = AfterPrompt(tokenizer, [int(t) for t in prompt[-CONTEXT_MAX:]],
                                 skip_special_tokens)
        self.fixed, self.fixed_text = 0, ""  # the tokens whose text is settled, and it
        self.context: AfterPrompt | None = None  # what the tokens after ``fixed`` follow
        self.next_try = STRIDE  # the length at which a point is next tried
        self.local = not getattr(tokenizer, "clean_up_tokenization_spaces", False)

    def __call__(self, tokens: Sequence[int], n: int | None = None) -> str:
        n = len(tokens) if n is None else n
        added = None
        if self.context is not None and n >= self.fixed:
            added = self.context.after(self._shown(tokens[self.fixed:n]))
        # before the settled point (a log-probability's offset), or no context that reads
        # as the whole does here: the whole decode
        text = (self.fixed_text + added if added is not None
                else self.whole(self._shown(tokens[:n])))
        if self.local and n >= self.next_try:
            self._settle(tokens, n, text)
        return text

    def _settle(self, tokens: Sequence[int], n: int, text: str) -> None:
        """Settle the first ``n`` tokens' ``text`` where it ends in a whole character and in
        the text of the last few of them; else try again ``RETRY`` tokens on."""
        context = AfterPrompt(self.tokenizer, self._shown(tokens[max(0, n - CONTEXT_MAX):n]),
                              self.skip)
        if text.endswith(REPLACEMENT) or not context.head or not text.endswith(context.head):
            self.next_try = n + RETRY
            return
        self.fixed, self.fixed_text, self.context = n, text, context
        self.next_try = n + STRIDE

    def _shown(self, tokens: Sequence[int]) -> list[int]:
        return [int(t) for t in tokens if t not in self.hidden]
