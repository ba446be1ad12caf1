"""``GrowingText``: a completion's text read after each token equals decoding it whole
(``AfterPrompt``) at every length, on byte-level and sentencepiece tokenizers and on random
ids (incomplete characters among them), while each read decodes a bounded number of tokens
rather than all of them."""

from __future__ import annotations

import random

import pytest

from stmoe.hf.completion_text import CONTEXT_MAX, AfterPrompt
from stmoe.hf.growing_text import STRIDE, GrowingText

pytest.importorskip("tokenizers")


def _shipped():
    from transformers import AutoTokenizer

    from stmoe.models import SHIPPED_MODEL

    return AutoTokenizer.from_pretrained(SHIPPED_MODEL)


def _llama_like():
    """Llama 2's decoder chain over words and byte-fallback pieces (中 is three of them)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = ["<unk>", "<s>", *(f"\u2581w{i}" for i in range(2, 12)), "\u2581.", "x",
              *(f"<0x{b:02X}>" for b in "中é".encode())]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>")


def _check_every_length(tok, prompt: list[int], tokens: list[int], skip: bool = False,
                        hidden: frozenset[int] = frozenset()) -> None:
    text = GrowingText(tok, prompt, skip_special_tokens=skip, hidden=hidden)
    whole = AfterPrompt(tok, prompt, skip_special_tokens=skip)
    for n in range(len(tokens) + 1):
        want = whole([t for t in tokens[:n] if t not in hidden])
        assert text(tokens, n) == want, (n, tokens[:n])  # (as the server reads it)
    assert text.fixed > 0  # it did move on (else this tested the whole decode against itself)
    for n in (0, 1, STRIDE, len(tokens) // 2):  # an earlier prefix: decoded whole
        assert text(tokens[:n]) == whole([t for t in tokens[:n] if t not in hidden])
    assert text(tokens) == whole([t for t in tokens if t not in hidden])


def test_byte_level_text_equals_the_whole_decode_at_every_length():
    tok = _shipped()
    ids = tok("def fib(n):\n    # é中文 🙂 naïve\n    return n if n < 2 else fib(n - 1)\n"
              * 8).input_ids
    _check_every_length(tok, ids[:7], ids[7:])
    rng = random.Random(0)  # random ids: characters split and broken anywhere
    vocab = len(tok)
    _check_every_length(tok, ids[:5], [rng.randrange(vocab) for _ in range(300)], skip=True)


@pytest.mark.parametrize("make", [_llama_like, None], ids=["llama2-chain", "metaspace"])
def test_sentencepiece_text_equals_the_whole_decode_at_every_length(make):
    from metaspace_tokenizer import metaspace_tokenizer

    tok = make() if make else metaspace_tokenizer(12)
    rng = random.Random(1)
    n = len(tok)
    for skip in (False, True):
        _check_every_length(tok, [1, 3, 4], [rng.randrange(1, n) for _ in range(250)], skip)


def test_end_of_sequence_ids_are_not_shown():
    tok = _shipped()
    ids = tok("one two three four five six seven eight nine ten " * 6).input_ids
    eos = frozenset({ids[3]})  # a word's id taken as the hidden one: it appears throughout
    _check_every_length(tok, ids[:4], ids[4:], hidden=eos)


class _Rewrites:
    """A decoder that reads further back than a few tokens: "a" then "b" read as "X"."""

    def __init__(self) -> None:
        self.read: list[int] = []

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        self.read.append(len(token_ids))
        return "".join("ab"[t] if t < 2 else "c" for t in token_ids).replace("ab", "X")


def test_a_decoder_reading_further_back_gets_the_whole_decode():
    tok = _Rewrites()
    tokens = [2] * (STRIDE - 1) + [0, 1] + [2] * 3  # the text fixed just after the "a"
    _check_every_length(tok, [2, 2], tokens)
    text = GrowingText(tok, [2, 2])
    for n in range(STRIDE + 1):
        text(tokens[:n])
    assert text.fixed == STRIDE and text.fixed_text.endswith("a")
    assert text(tokens) == "c" * (STRIDE - 1) + "Xccc"


def test_each_read_decodes_a_bounded_number_of_tokens():
    """2000 tokens read one more at a time: no decode takes more than a stride and two
    contexts of them (the whole decode took up to all 2000)."""
    class Counting(_Rewrites):
        def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
            self.read.append(len(token_ids))
            return "c" * len(token_ids)

    tok = Counting()
    tokens = [2] * 2000
    text = GrowingText(tok, [2] * 30)
    for n in range(len(tokens) + 1):
        assert text(tokens, n) == "c" * n
    assert max(tok.read) <= STRIDE + 2 * CONTEXT_MAX, max(tok.read)
    assert sum(tok.read) < 2000 * (STRIDE + 2 * CONTEXT_MAX)
