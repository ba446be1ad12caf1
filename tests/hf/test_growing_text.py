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


def _byte_fallback_chain():
    """Llama 2's decoder chain over one word and all 256 byte-fallback pieces."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "\u2581w": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_no_point_is_settled_where_its_context_begins_inside_a_character():
    """A real U+FFFD among the last tokens makes every context hold one, so the context
    taken is 24 tokens that begin inside 中: a point is settled only where the text ends
    in its context's own text (the helper's review found the text going wrong here)."""
    tok = _byte_fallback_chain()
    by = lambda s: [2 + b for b in s.encode()]  # noqa: E731
    _check_every_length(tok, [1], by("中" * 9 + "\ufffd" + "é") + by("中") + [1] + by("é" * 30),
                        skip=True)
    rng = random.Random(5)
    for _ in range(3):  # random bytes, real U+FFFDs among them
        tokens = [rng.choice([1, *by("\ufffd"), *by("中é"), rng.randrange(2, 258)])
                  for _ in range(200)]
        _check_every_length(tok, [1], tokens)


def test_a_decoder_rewriting_across_the_context_is_not_settled_there():
    """Fuse then Replace("aa", "b"): a context of an odd count of "a"s reads otherwise than
    the text does there."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "c": 2}, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Fuse(), decoders.Replace("aa", "b")])
    tok = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    _check_every_length(tok, [2], [2] + [1] * 32 + [2] * 40)


def test_a_tokenizer_cleaning_up_spaces_is_decoded_whole():
    """transformers' clean-up of spaces reads the whole text (" ' " -> "'", left to right:
    which space goes can hang on any apostrophe before), which no context bounds: no point
    is settled, every read is the whole decode (a local decoder would settle at 32 here)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "'": 2}, unk_token="[UNK]"))
    tok.decoder = decoders.WordPiece()
    tok = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]",
                                  clean_up_tokenization_spaces=True)
    tokens = [1] * 40 + [2, 2, 2, 0, 2, 2, 2]
    text = GrowingText(tok, [1], skip_special_tokens=True)
    whole = AfterPrompt(tok, [1], skip_special_tokens=True)
    for n in range(len(tokens) + 1):
        assert text(tokens, n) == whole(tokens[:n])
    assert text.fixed == 0


def test_a_context_of_skipped_tokens_moves_on():
    """Special tokens skipped at the first point: the point is tried again further on, so
    the reads after it stay bounded (else each would decode the whole completion)."""
    tok = _shipped()
    pad = tok.pad_token_id
    words = tok("one two three four five six seven eight nine ten " * 40).input_ids
    tokens = words[:28] + [pad] * 4 + words[28:400]
    sizes: list[int] = []
    decode = tok.decode

    class Counting:
        def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
            sizes.append(len(token_ids))
            return decode(token_ids, skip_special_tokens=skip_special_tokens)

    text = GrowingText(Counting(), words[:4], skip_special_tokens=True)
    whole = AfterPrompt(tok, words[:4], skip_special_tokens=True)
    for n in range(len(tokens) + 1):
        assert text(tokens, n) == whole(tokens[:n])
    assert text.fixed > 300 and max(sizes[-100:]) <= STRIDE + 2 * CONTEXT_MAX
