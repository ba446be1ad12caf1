"""Log-probabilities as the OpenAI API returns them: chat's ``logprobs.content`` (each
token's text, bytes, log-probability and most likely alternatives) and completions'
``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset``.

Why the bytes are worked out here: a byte-level BPE token can hold part of a character,
which ``decode`` shows as U+FFFD; its ``bytes`` must be the token's own, so that a
client joining them gets the text back. The values are the model's log-softmax
(``runtime.batcher.sampling.TokenLogprob``); -inf is sent as -9999.0, as vLLM's server
does (JSON has no infinity).
"""

from __future__ import annotations

import math
import re
from typing import Any

from stmoe.runtime.batcher import TokenLogprob

FLOOR = -9999.0
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # sentencepiece's byte fallback


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as, reversed."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
          *range(ord("®"), ord("ÿ") + 1)]
    cs, extra = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenPieces:
    """Each token id's bytes and text under a transformers tokenizer (cached)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self.table = _byte_level_table() if type(decoder).__name__ == "ByteLevel" else None
        self.cache: dict[int, bytes] = {}

    def bytes_of(self, token: int) -> bytes:
        if token not in self.cache:
            self.cache[token] = self._bytes(token)
        return self.cache[token]

    def text_of(self, token: int) -> str:
        return self.bytes_of(token).decode("utf-8", "replace")

    def _bytes(self, token: int) -> bytes:
        piece = self.tok.convert_ids_to_tokens(token)
        if isinstance(piece, str):
            if self.table is not None and all(c in self.table for c in piece):
                return bytes(self.table[c] for c in piece)
            byte = _BYTE_TOKEN.fullmatch(piece)
            if byte is not None:
                return bytes([int(byte.group(1), 16)])
            if piece.startswith("\u2581"):  # sentencepiece's word start: a space
                return (" " + piece[1:]).encode("utf-8")
        return self.tok.decode([token]).encode("utf-8")  # a special or added token


def _value(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR


def chat_logprobs(entries: list[TokenLogprob], pieces: TokenPieces) -> dict[str, Any]:
    """Chat's ``choice.logprobs``: one item per token, its ``top_logprobs`` the k most likely."""

    def item(token: int, logprob: float) -> dict[str, Any]:
        return {"token": pieces.text_of(token), "logprob": _value(logprob),
                "bytes": list(pieces.bytes_of(token))}

    return {"content": [{**item(e.token, e.logprob),
                         "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries],
            "refusal": None}


def completion_logprobs(entries: list[TokenLogprob], pieces: TokenPieces,
                        offsets: list[int]) -> dict[str, Any]:
    """Completions' ``choice.logprobs``: per token its text, log-probability, the k most
    likely and the chosen one (OpenAI: "up to logprobs+1 elements"), and where its text
    starts in the completion (``offsets``)."""
    top = []
    for e in entries:
        best = {pieces.text_of(t): _value(lp) for t, lp in e.top}
        best.setdefault(pieces.text_of(e.token), _value(e.logprob))
        top.append(best)
    return {"tokens": [pieces.text_of(e.token) for e in entries],
            "token_logprobs": [_value(e.logprob) for e in entries],
            "top_logprobs": top, "text_offset": offsets}
