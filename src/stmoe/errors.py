"""Errors raised at the project's boundaries.

Every error a user can cause carries where it happened (file, position) and what
was expected, so the CLI can print one line and exit non-zero instead of a
traceback (docs/architecture.md).
"""

from __future__ import annotations

from pathlib import Path


class StmoeError(Exception):
    """Base class of every error the CLI reports as a one-line message."""


class StmoeNote(UserWarning):
    """Something stmoe decided for the user (a guessed layout, a cached store packed
    again): worth one line, which the CLI prints as ``note: ...``, not worth refusing."""


class OffloadError(StmoeError):
    """The offloading runtime refused a request: an option, a prompt, a model it cannot
    serve, or a call it cannot take now (busy, closed)."""


class StoreError(OffloadError):
    """An expert store is missing, damaged, or belongs to another model."""


class BlockError(StoreError):
    """One expert's block did not read whole and intact (a failed or short read, a checksum
    that does not match): what needs that expert fails, the store's other experts serve on
    (a prefetch skips it; a server's step fails only the requests routed to it)."""

    def __init__(self, message: str, layer: int, expert: int) -> None:
        super().__init__(message)
        self.layer, self.expert = layer, expert

    def __reduce__(self) -> tuple[type, tuple[str, int, int]]:
        return type(self), (str(self), self.layer, self.expert)


class TraceError(StmoeError, ValueError):
    """A routing trace, or a file meant to hold one, is malformed.

    The message reads ``FILE: POSITION: PROBLEM (expected WHAT)`` with the parts
    that are known; ``hint`` says how to fix it when there is an obvious way.
    """

    def __init__(
        self,
        problem: str,
        *,
        file: str | Path | None = None,
        position: str | None = None,
        expected: str | None = None,
        hint: str | None = None,
    ) -> None:
        self.problem = problem
        self.file = str(file) if file is not None else None
        self.position = position
        self.expected = expected
        self.hint = hint
        super().__init__(self._format())

    def _format(self) -> str:
        parts = [p for p in (self.file, self.position) if p]
        text = (
            self.problem if self.expected is None else f"{self.problem} (expected {self.expected})"
        )
        msg = ": ".join([*parts, text])
        return f"{msg}; {self.hint}" if self.hint else msg

    def in_file(self, file: str | Path) -> TraceError:
        """The same error, attributed to ``file`` when it names none yet."""
        if self.file is not None:
            return self
        return TraceError(
            self.problem,
            file=file,
            position=self.position,
            expected=self.expected,
            hint=self.hint,
        )
