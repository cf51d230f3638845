"""A byte-level tokenizer: one token per UTF-8 byte, plus an end-of-document token.

``ByteTokenizer`` needs no files and never meets an unknown word: token ``i < 256``
is the byte ``i``; token ``256`` is the end-of-document marker (``eod``) that
Megatron-LM's ``tools/preprocess_data.py --append-eod`` appends after every
document. ``vocab_size == 257``.

It follows the attribute names of Megatron's tokenizers (``vocab_size``, ``eod``,
``tokenize``, ``detokenize`` in ``megatron/training/tokenizer/tokenizer.py``) and
adds the common ``encode`` / ``decode`` names.

``vocab_size_with_padding`` is Megatron's ``_vocab_size_with_padding``
(same file; the rule lives in :mod:`course_lib.rules`, re-exported here): the embedding table is padded to a multiple of
``make_vocab_size_divisible_by * tensor_model_parallel_size`` so that the
vocab-parallel embedding splits evenly. The padded size therefore depends on
the TP size (257 -> 384 for TP 1, 512 for TP 2 and 4, 1024 for TP 8; GPT-2's
50257 -> 50304, 50432, 50688 for TP 1, 2, 4). A model that must give identical
numbers for every layout should instead pad once to a size every TP divides
(384 = 3 x 128 works for TP 1, 2, 4 and 8).
"""

from __future__ import annotations

from typing import Iterable

from course_lib.rules import UsageError, vocab_size_with_padding

__all__ = ["ByteTokenizer", "NullTokenizer", "EOD_TEXT", "vocab_size_with_padding"]

EOD_TEXT = "<|endoftext|>"  # how decode() shows the end-of-document token (GPT-2's spelling)


class ByteTokenizer:
    """Bytes in, bytes out. ``encode(text) -> list[int]``, ``decode(ids) -> str``.

    >>> tok = ByteTokenizer()
    >>> tok.encode("TP=2")
    [84, 80, 61, 50]
    >>> tok.decode(tok.encode("张量并行", append_eod=True))
    '张量并行<|endoftext|>'
    """

    vocab_size = 257
    eod = 256
    unique_identifiers = {"class": "ByteTokenizer", "vocab_size": "257"}   # described in --data-cache-path files

    def encode(self, text: str, append_eod: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise UsageError(f"encode() takes a str, got {type(text).__name__}; decode bytes first")
        ids = list(text.encode("utf-8"))
        if append_eod:
            ids.append(self.eod)
        return ids

    def decode(self, ids: Iterable[int], eod_text: str = EOD_TEXT) -> str:
        """Inverse of ``encode``; the eod token becomes ``eod_text``. Invalid UTF-8 (a
        sequence cut in the middle of a character) decodes to U+FFFD."""
        out, buf = [], bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                buf.append(i)
            elif i == self.eod:
                out.append(buf.decode("utf-8", errors="replace"))
                out.append(eod_text)
                buf = bytearray()
            else:
                raise UsageError(f"token id {i} is outside the byte vocabulary 0..{self.vocab_size - 1}")
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    # Megatron's names
    def tokenize(self, text: str) -> list[int]:
        return self.encode(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.decode(ids)


class NullTokenizer:
    """Megatron-LM's ``--tokenizer-type NullTokenizer --vocab-size V`` (``_NullTokenizer``,
    megatron/training/tokenizer/tokenizer.py): ids are given, not made from text; ``eod == V`` and
    ``vocab_size == V + 1``. With ``V = 256`` it is the byte tokenizer's vocabulary, so the built-in
    corpus written as bytes (:func:`course_lib.data.corpus.write_corpus_dataset`) trains through
    ``--data-path`` with it. ``unique_identifiers``: what Megatron-LM's ``_NullTokenizer`` records for
    ``--data-cache-path``."""

    def __init__(self, vocab_size: int):
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise UsageError(f"--tokenizer-type NullTokenizer needs --vocab-size N (ids 0..N-1, eod N), got "
                             f"{vocab_size!r}; for the built-in corpus as bytes: --vocab-size 256")
        self.eod = vocab_size
        self.vocab_size = vocab_size + 1
        self.unique_identifiers = {"class": "_NullTokenizer", "tokenizer_path": [None], "vocab_size": str(vocab_size)}

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split(" ")]

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)
