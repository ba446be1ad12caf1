"""``AfterPrompt``: a completion's text as it reads after its prompt, decoded with the
prompt's last tokens and their own text cut off (as vLLM's detokenizer does)."""

from __future__ import annotations

import pytest

from metaspace_tokenizer import metaspace_tokenizer
from stmoe.hf.completion_text import CONTEXT_MAX, AfterPrompt

pytest.importorskip("tokenizers")


@pytest.mark.parametrize("llama", [False, True], ids=["metaspace", "llama2-chain"])
def test_a_sentencepiece_completion_keeps_its_first_space(llama):
    """Decoded alone, "▁w5 ▁w6" is "w5 w6": after the prompt "w2 w3" it would read
    "w2 w3w5 w6". After the prompt it is " w5 w6", the text it adds to the prompt's."""
    tok = metaspace_tokenizer(10, llama=llama)
    assert tok.decode([5, 6]) == "w5 w6"  # the loss, decoded alone
    for prompt in ([2], [2, 3], [1, 2, 3, 4, 2, 3, 4], [2] * 40):
        after = AfterPrompt(tok, prompt)
        assert after([5, 6]) == " w5 w6"
        assert tok.decode(prompt) + after([5, 6]) == tok.decode([*prompt, 5, 6])
        assert after([]) == ""
    assert len(AfterPrompt(tok, [2] * 40).context) == 4  # the fewest: vLLM's 4


def test_special_tokens_skipped_in_the_context_too():
    """A prompt of special tokens only (a bare BOS) gives no context text: the completion
    reads as decoded alone, as it begins the text."""
    tok = metaspace_tokenizer(10)
    assert AfterPrompt(tok, [1], skip_special_tokens=True)([5, 6]) == "w5 w6"
    assert AfterPrompt(tok, [1, 2], skip_special_tokens=True)([5]) == " w5"


def test_byte_level_reads_as_decoded_alone():
    """The shipped model's byte-level tokenizer: the same text either way, and a character
    split between prompt and completion (its context's text not a prefix) decoded alone."""
    from transformers import AutoTokenizer

    from stmoe.models import SHIPPED_MODEL

    tok = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    ids = tok("def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n").input_ids
    for cut in (1, 3, 8, len(ids) - 2):
        assert AfterPrompt(tok, ids[:cut])(ids[cut:]) == tok.decode(ids[cut:])
    split = tok("é中文").input_ids
    cuts = [c for c in range(1, len(split)) if "\ufffd" in tok.decode(split[:c])]
    assert cuts, split  # some cut falls inside a character
    for c in cuts:
        assert AfterPrompt(tok, split[:c])(split[c:]) == tok.decode(split[c:])


def test_the_context_passes_over_an_incomplete_character():
    """The prompt "x中 a b": its last 4 tokens begin inside 中 (3 byte tokens), so the
    context grows to the first count whose text is whole (5), as vLLM's does."""
    from transformers import AutoTokenizer

    from stmoe.models import SHIPPED_MODEL

    tok = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    ids = tok("x中 a b c").input_ids
    prompt, rest = ids[:-1], ids[-1:]
    assert "\ufffd" in tok.decode(prompt[-4:])  # (the tokenizer splits 中 as it did)
    after = AfterPrompt(tok, prompt)
    assert len(after.context) == 5 and after.head == "中 a b"
    assert after(rest) == " c"
    assert len(AfterPrompt(tok, tok("中中中中中中中中 a").input_ids).context) <= CONTEXT_MAX


def test_generate_text_keeps_its_first_space():
    """``OffloadedModel.generate`` (and so ``stmoe generate --prompt``) reads its text the
    same way: the shipped model run with a sentencepiece-style tokenizer in place of its
    own gives " w.. w..", the words its tokens are (decoded alone: "w.. w..")."""
    from stmoe.models import SHIPPED_MODEL
    from stmoe.runtime.api import offload

    with offload(SHIPPED_MODEL, capacity="50%") as om:
        om.tokenizer = metaspace_tokenizer(int(om.model.config.vocab_size))
        result = om.generate("w5 w6 w7", max_new_tokens=4)
    words = [t for t in result.tokens if t >= 2]
    assert len(words) == len(result.tokens), result.tokens  # (no unk or BOS came)
    assert result.text == "".join(f" w{t}" for t in words)
