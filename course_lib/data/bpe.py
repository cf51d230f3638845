"""A byte-level BPE tokenizer in GPT-2's scheme, trained here on the course corpus.

GPT-2's tokenizer (Radford et al. 2019, section 2.2; the files Megatron-LM's ``GPT2BPETokenizer``
reads with ``--vocab-file vocab.json --merge-file merges.txt``) works in three steps:

1. **pre-tokenisation**: the text is cut by :data:`GPT2_PATTERN` into words (letters with one leading
   space, digits, punctuation runs, white space); merges never cross a word's edge;
2. **bytes as symbols**: each word's UTF-8 bytes are written with :func:`bytes_to_unicode`, a
   printable character per byte, so every text is covered and nothing is ever unknown;
3. **merges by rank**: inside a word, the adjacent pair with the lowest rank in ``merges.txt`` is
   merged, everywhere in the word, until no pair of the word has a rank.

:func:`train_bpe` learns the merges (Sennrich et al. 2016): start from the 256 byte symbols,
repeatedly merge the pair that occurs most often in the corpus (ties: the smaller pair, so training
is deterministic), until the vocabulary has ``vocab_size`` entries; the last id is ``<|endoftext|>``,
Megatron's ``eod`` (``preprocess_data.py --append-eod`` writes it after every document).

:meth:`BPETokenizer.save` writes GPT-2's two files: ``vocab.json`` (symbol string -> id) and
``merges.txt`` (``#version: 0.2`` then one ``left right`` pair per line, in rank order). Megatron-LM's
``gpt2_tokenization.py`` and Hugging Face's byte-level BPE (megatron-core 0.16.1's
``GPT2BPETokenizer`` goes through it) load them and give the same ids (``tests/data/test_bpe.py``).
A literal ``<|endoftext|>`` inside a text is ordinary text here, as in ``gpt2_tokenization.py``.
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path
from typing import Iterable

import regex

from course_lib.rules import UsageError

EOD_TEXT = "<|endoftext|>"
MERGES_HEADER = "#version: 0.2"
# GPT-2's pre-tokenisation pattern (openai/gpt-2 src/encoder.py; Megatron-LM gpt2_tokenization.py)
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
_SPLIT = regex.compile(GPT2_PATTERN)


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character table: the 188 printable Latin-1 bytes stand for themselves, the
    other 68 (controls, space, soft hyphen...) take the characters 256, 257, ... in byte order, so a
    symbol string never holds white space or a control character. Dict order is the id order of the
    256 base symbols (GPT-2's ``encoder.json`` ids 0..255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def pretokenize(text: str) -> list[str]:
    """``text`` cut into GPT-2's words (merges never cross their edges)."""
    return _SPLIT.findall(text)


def _symbols(word: str) -> str:
    table = bytes_to_unicode()
    return "".join(table[b] for b in word.encode("utf-8"))


class TokenizerFileError(UsageError):
    """A vocab/merges pair that cannot be a GPT-2 tokenizer (one line: which file, which rule)."""


class BPETokenizer:
    """GPT-2's byte-level BPE from its vocabulary and ranked merges.

    ``encoder``: symbol string -> id (``vocab.json``); ``merges``: ``[(left, right), ...]`` in rank
    order (``merges.txt``). ``encode(text, append_eod=False) -> list[int]``, ``decode(ids) -> str``
    (``decode(encode(t)) == t`` for every ``str``); Megatron's names ``tokenize``, ``detokenize``,
    ``vocab_size``, ``eod``.
    """

    def __init__(self, encoder: dict[str, int], merges: list[tuple[str, str]]):
        self.encoder = dict(encoder)
        self.decoder = {i: s for s, i in self.encoder.items()}
        self.merges = [tuple(m) for m in merges]
        self.ranks = {m: r for r, m in enumerate(self.merges)}
        self._byte_of = {c: b for b, c in bytes_to_unicode().items()}
        self._cache: dict[str, list[int]] = {}
        # what --data-cache-path's description records of the tokenizer: Megatron-LM's _GPT2BPETokenizer
        # (megatron/training/tokenizer, MegatronLegacyTokenizer.__init__): its class and its two files. Megatron-LM
        # builds that one with --legacy-tokenizer; its default (megatron.core.tokenizers) records other fields.
        self.unique_identifiers = {"class": "_GPT2BPETokenizer", "tokenizer_path": []}
        _check_tokenizer(self)

    @property
    def vocab_size(self) -> int:
        return len(self.encoder)

    @property
    def eod(self) -> int:
        return self.encoder[EOD_TEXT]

    def _bpe(self, symbols: str) -> list[str]:
        parts = list(symbols)
        while len(parts) > 1:
            pairs = {(a, b) for a, b in zip(parts, parts[1:])}
            best = min(pairs, key=lambda p: self.ranks.get(p, float("inf")))
            if best not in self.ranks:
                break
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(parts[i] + parts[i + 1])
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts

    def encode(self, text: str, append_eod: bool = False) -> list[int]:
        if not isinstance(text, str):
            raise UsageError(f"encode() takes a str, got {type(text).__name__}; decode bytes first")
        ids: list[int] = []
        for word in pretokenize(text):
            if word not in self._cache:
                self._cache[word] = [self.encoder[s] for s in self._bpe(_symbols(word))]
            ids.extend(self._cache[word])
        if append_eod:
            ids.append(self.eod)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Inverse of :meth:`encode`; the eod id reads ``<|endoftext|>``; bytes that are not whole
        UTF-8 characters read U+FFFD (GPT-2's ``errors="replace"``)."""
        symbols = []
        for i in ids:
            i = int(i)
            if i not in self.decoder:
                raise UsageError(f"token id {i} is outside the vocabulary 0..{self.vocab_size - 1}")
            symbols.append(self.decoder[i])
        text = "".join(symbols)
        out, buf = [], bytearray()
        for piece in text.split(EOD_TEXT):
            buf.extend(self._byte_of[c] for c in piece)
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
        return EOD_TEXT.join(out)

    tokenize = encode

    def detokenize(self, ids: Iterable[int]) -> str:
        return self.decode(ids)

    # ------------------------------------------------------------------ GPT-2's files
    def files_text(self) -> tuple[str, str]:
        """The text of ``vocab.json`` (symbol -> id) and ``merges.txt`` (``#version: 0.2``, then
        ``left right`` per line in rank order, newline-terminated: Megatron-LM's reader drops the
        first and the last line)."""
        return (json.dumps(self.encoder, ensure_ascii=False) + "\n",
                MERGES_HEADER + "\n" + "".join(f"{a} {b}\n" for a, b in self.merges))

    def save(self, directory, force: bool = False) -> tuple[Path, Path]:
        """Write ``directory/vocab.json`` and ``directory/merges.txt`` (atomic each); an existing
        file is replaced only with ``force``. Returns the two paths."""
        from course_lib.safe_files import check_output_file, write_atomic

        directory = Path(directory)
        vocab, merges = directory / "vocab.json", directory / "merges.txt"
        for path in (vocab, merges):
            check_output_file(path, force=force, what="tokenizer file")
        vocab_text, merges_text = self.files_text()
        write_atomic(vocab, vocab_text)
        write_atomic(merges, merges_text)
        return vocab, merges

    @classmethod
    def from_files(cls, vocab_file, merge_file) -> "BPETokenizer":
        """Load GPT-2's ``vocab.json`` + ``merges.txt`` (the course's or GPT-2's own). Bad files:
        :class:`TokenizerFileError`, one line."""
        given = [str(vocab_file), str(merge_file)]
        if not vocab_file or not merge_file:
            raise TokenizerFileError("GPT2BPETokenizer needs both --vocab-file (vocab.json) and --merge-file "
                                     "(merges.txt); make them with `python -m course_lib tokenizer --vocab-file ... --merge-file ...`")
        vocab_file, merge_file = Path(vocab_file), Path(merge_file)
        for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
            if not path.is_file():
                raise TokenizerFileError(f"{flag} {path}: no such file; make it with "
                                         f"`python -m course_lib tokenizer {flag} {path} ...`")
        try:
            encoder = json.loads(vocab_file.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise TokenizerFileError(f"--vocab-file {vocab_file}: not a JSON vocabulary ({exc})") from None
        if not isinstance(encoder, dict) or not all(isinstance(k, str) and isinstance(v, int) and not
                                                    isinstance(v, bool) for k, v in encoder.items()):
            raise TokenizerFileError(f"--vocab-file {vocab_file}: must map each token string to an integer id")
        lines = merge_file.read_text(encoding="utf-8").split("\n")
        if lines and lines[0].startswith("#version"):
            lines = lines[1:]
        merges = []
        for n, line in enumerate(lines, start=2):
            if not line:
                continue
            pair = tuple(line.split(" "))
            if len(pair) != 2 or not all(pair):
                raise TokenizerFileError(f"--merge-file {merge_file} line {n}: {line!r} is not 'left right'")
            merges.append(pair)
        tok = cls(encoder, merges)
        tok.unique_identifiers["tokenizer_path"] = given
        return tok


def _check_tokenizer(tok: BPETokenizer) -> None:
    """One line for a vocabulary and merges that do not make a GPT-2 tokenizer."""
    ids = sorted(tok.encoder.values())
    if ids != list(range(len(ids))):
        raise TokenizerFileError("vocab.json: the ids must be 0..N-1, each once")
    missing = [s for s in bytes_to_unicode().values() if s not in tok.encoder]
    if missing:
        raise TokenizerFileError(f"vocab.json lacks {len(missing)} of the 256 byte symbols (first: {missing[0]!r}): "
                                 f"a byte-level BPE must cover every byte")
    if EOD_TEXT not in tok.encoder:
        raise TokenizerFileError(f"vocab.json has no {EOD_TEXT}: Megatron's GPT2BPETokenizer takes it as eod")
    for r, (a, b) in enumerate(tok.merges):
        if a not in tok.encoder or b not in tok.encoder or a + b not in tok.encoder:
            raise TokenizerFileError(f"merges.txt rank {r} ({a} {b}): its parts and their merge must be in "
                                     f"vocab.json -- are the two files from the same tokenizer?")


def train_bpe(documents: Iterable[str], vocab_size: int) -> BPETokenizer:
    """Learn GPT-2-style merges on ``documents`` until the vocabulary holds ``vocab_size`` entries
    (256 bytes + merges + ``<|endoftext|>``); stops early when no pair occurs twice.

    Pair counts are kept up to date incrementally (only the words that hold the merged pair are
    recounted), so the course corpus trains in about a second."""
    if not isinstance(vocab_size, int) or vocab_size < 257:
        raise UsageError(f"vocab_size={vocab_size!r}: a byte-level BPE needs at least 257 (256 bytes + "
                         f"{EOD_TEXT}); try 1024")
    freq = Counter(_symbols(w) for doc in documents for w in pretokenize(doc))
    words = [list(w) for w in freq]
    counts = list(freq.values())
    pair_count: Counter = Counter()
    where: dict[tuple[str, str], set[int]] = {}
    for wi, parts in enumerate(words):
        for pair in zip(parts, parts[1:]):
            pair_count[pair] += counts[wi]
            where.setdefault(pair, set()).add(wi)
    encoder = {s: i for i, s in enumerate(bytes_to_unicode().values())}
    merges: list[tuple[str, str]] = []
    while len(encoder) < vocab_size - 1:
        live = [(c, p) for p, c in pair_count.items() if c > 0]
        if not live:
            break
        top = max(c for c, _ in live)
        if top < 2:
            break
        best = min(p for c, p in live if c == top)
        merges.append(best)
        new = best[0] + best[1]
        encoder.setdefault(new, len(encoder))
        for wi in where.pop(best, ()):
            parts, c = words[wi], counts[wi]
            for pair in zip(parts, parts[1:]):
                pair_count[pair] -= c
            merged, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and (parts[i], parts[i + 1]) == best:
                    merged.append(new)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            words[wi] = merged
            for pair in zip(merged, merged[1:]):
                pair_count[pair] += c
                where.setdefault(pair, set()).add(wi)
        del pair_count[best]
    encoder[EOD_TEXT] = len(encoder)
    return BPETokenizer(encoder, merges)


__all__ = ["BPETokenizer", "EOD_TEXT", "GPT2_PATTERN", "TokenizerFileError", "bytes_to_unicode", "pretokenize",
           "train_bpe"]
