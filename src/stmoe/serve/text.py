"""A completion's text as its tokens arrive: whole characters only, cut at a stop string.

Tokens decode to text only together (a character may span tokens), so the text is
decoded whole each time and the new part sent; a tail that could still begin a
stop string is held back until it cannot.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from stmoe.runtime.batcher import Request
    from stmoe.serve.service import Service


class TextStream:
    """The text of ``job``'s tokens so far; ``push`` returns what may be sent now.
    ``used``: how many of the tokens that text was decoded from (frozen at a stop string:
    the tokens after it are not the completion's)."""

    def __init__(self, service: Service, job: Request, stops: list[str]) -> None:
        self.service, self.job, self.stops = service, job, stops
        self.sent = ""
        self.text = ""
        self.stopped = False
        self.used = 0

    def push(self) -> str:
        """After a new token: the text that can be sent (maybe empty)."""
        if self.stopped:
            return ""
        tokens = list(self.job.output)
        full = self.service.text(tokens)
        if full.endswith("\ufffd"):  # a character still incomplete
            return ""
        return self._advance(full, len(tokens), last=False)

    def flush(self) -> str:
        """At the end: everything not sent yet, its stop strings applied as ``push``'s (the
        last token's text may have been held back as an incomplete character)."""
        if self.stopped:
            return self._send(self.text)
        tokens = list(self.job.output)
        return self._advance(self.service.text(tokens), len(tokens), last=True)

    def _advance(self, full: str, used: int, last: bool) -> str:
        """``full`` (of ``used`` tokens) cut at its first stop string; what may be sent now."""
        self.used = used
        found = [at for at in (full.find(stop) for stop in self.stops) if at >= 0]
        if found:
            full, self.stopped = full[: min(found)], True
        self.text = full
        if self.stopped:
            self.job.cancel()  # leaves the batch at the next step
            return self._send(full)
        return self._send(full if last else full[: len(full) - self._held(full)])

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
