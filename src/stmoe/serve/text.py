"""A completion's text as its tokens arrive: whole characters only, cut at a stop string.

Tokens decode to text only together (a character may span tokens), so the text of all of
them is read each time (``Service.reader``: from a recent point, not decoded whole) and the
new part sent; a tail that could still begin a stop string is held back until it cannot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stmoe.runtime.batcher import Request


class TextStream:
    """The text of ``job``'s tokens so far (``decode(tokens, n)``: the text of the first n,
    as ``Service.reader`` makes it); ``push`` returns what may be sent now.
    ``used``: how many of the tokens that text was decoded from (frozen at a stop string:
    the tokens after it are not the completion's).

    The tokens are read as if pushed one at a time, however many arrived since the last
    push (the event loop may run late): the stop string ends the completion at the token
    that completed it, and the text, ``used`` (its log-probabilities, its usage) are the
    same whatever the timing, so another client's load cannot change them."""

    def __init__(self, decode: Callable[[Sequence[int], int], str], job: Request,
                 stops: list[str]) -> None:
        self.decode, self.job, self.stops = decode, job, stops
        self.tokens: list[int] = []  # the job's tokens read so far (grown, never copied)
        self.stop_free = ""  # the last text read that holds no stop string
        self.longest = max(map(len, stops), default=0)
        self.sent = ""
        self.text = ""
        self.stopped = False
        self.used = 0
        self.seen = 0  # tokens read for a stop string so far
        self.lengths: dict[int, int] = {0: 0}  # n -> the length of the first n tokens' text

    def push(self) -> str:
        """After a new token: the text that can be sent (maybe empty)."""
        if self.stopped:
            return ""
        return self._read(self._grow(), last=False)

    def flush(self) -> str:
        """At the end: everything not sent yet, its stop strings applied as ``push``'s (the
        last token's text may have been held back as an incomplete character)."""
        if self.stopped:
            return self._send(self.text)
        return self._read(self._grow(), last=True)

    def _grow(self) -> list[int]:
        """The job's tokens, those new since the last read added (the batcher's thread
        appends to its list; a slice of it is taken whole)."""
        self.tokens += self.job.output[len(self.tokens):]
        return self.tokens

    def _read(self, tokens: list[int], last: bool) -> str:
        """The tokens not read yet, one prefix at a time, as a push after each would read
        them: a prefix whose text ends in an incomplete character is passed over (but the
        last one at the end); the first whose text holds a stop string ends it there."""
        full = None
        for n in range(self.seen + 1, len(tokens) + 1):
            self.seen = n
            full = self.decode(tokens, n)
            self.lengths[n] = len(full)
            if full.endswith("\ufffd") and not (last and n == len(tokens)):
                full = None  # a character still incomplete
                continue
            if self.stops and self._stop(full, n):
                return self._send(self.text)
        if full is None:  # no new text of whole characters
            if not last:
                return ""
            full = self.decode(tokens, len(tokens))  # at the end, an incomplete one too
            if self.stops and self._stop(full, len(tokens)):
                return self._send(self.text)
        self.used, self.text = len(tokens), full
        return self._send(full if last else full[: len(full) - self._held(full)])

    def _stop(self, full: str, used: int) -> bool:
        """``full`` (of ``used`` tokens) cut at its first stop string, if it holds one:
        searched from where one could begin after the last text read without one, when
        ``full`` goes on from that text (else from its start)."""
        start = (max(0, len(self.stop_free) - self.longest + 1)
                 if full.startswith(self.stop_free) else 0)
        found = [at for at in (full.find(stop, start) for stop in self.stops) if at >= 0]
        if not found:
            self.stop_free = full
            return False
        self.text, self.used, self.stopped = full[: min(found)], used, True
        self.job.cancel()  # leaves the batch at the next step
        return True

    def length(self, n: int) -> int:
        """The length of the first ``n`` tokens' text (a log-probability's text offset):
        each prefix's text is decoded once, here or as it was read."""
        if n not in self.lengths:
            self.lengths[n] = len(self.decode(self._grow(), n))
        return self.lengths[n]

    def final(self) -> str:
        self.flush()
        return self.text

    def _send(self, upto: str) -> str:
        if len(upto) <= len(self.sent):
            return ""
        delta, self.sent = upto[len(self.sent):], upto
        return delta

    def _held(self, full: str) -> int:
        """How many trailing characters could begin a stop string."""
        held = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(full)), 0, -1):
                if full.endswith(stop[:n]):
                    held = max(held, n)
                    break
        return held
