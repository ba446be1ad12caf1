"""A sentencepiece-style tokenizer (Llama's, Mixtral's, Gemma's): every word piece begins
with ``▁`` for its space, and decoding drops the leading space of the first word, unlike the
shipped model's byte-level one. ``llama``: Llama 2's decoder chain (replace, byte fallback,
fuse, strip one space); else tokenizers' own Metaspace decoder. Word i is ``▁w{i}``."""

from __future__ import annotations


def metaspace_tokenizer(words: int, llama: bool = False):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, **{f"\u2581w{i}": i for i in range(2, words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = (decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                      decoders.Fuse(), decoders.Strip(" ", 1, 0)])
                   if llama else decoders.Metaspace(replacement="\u2581", prepend_scheme="always"))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>")
