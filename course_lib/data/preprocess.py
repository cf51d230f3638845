"""``python -m course_lib preprocess``: Megatron-LM's ``tools/preprocess_data.py`` for the course.

    python -m course_lib preprocess --input data/tiny/corpus.jsonl --output-prefix data/tiny/gpt_text \\
        --tokenizer-type GPT2BPETokenizer --vocab-file data/tiny/gpt2-vocab.json \\
        --merge-file data/tiny/gpt2-merges.txt --append-eod --json-keys text --workers 1

The same flags and the same output: one indexed dataset per JSON key,
``{output_prefix}_{key}_document.bin/.idx`` (:mod:`course_lib.data.indexed`), each JSON line a
document; ``--append-eod`` adds the tokenizer's eod after each non-empty document (as
``preprocess_data.py``'s ``Encoder.encode``); the dtype is uint16 below 65500 token ids.
Differences, on purpose: the course reads in one process (``--workers`` is accepted, Megatron
requires it); ``--split-sentences`` (nltk) is not offered; every line is read and tokenized before
anything is written, so a bad line (not JSON, a key missing, a value that is not text) stops the run
with one line naming it and no file; existing outputs are replaced only with ``--force``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from course_lib.data.bpe import BPETokenizer
from course_lib.data.indexed import optimal_dtype, write_indexed_dataset
from course_lib.rules import UsageError

TOKENIZER_TYPES = ("GPT2BPETokenizer",)


def output_prefix(prefix, key: str) -> str:
    """``preprocess_data.py``'s output name: ``{prefix}_{key}_document`` (document level)."""
    return f"{prefix}_{key}_document"


def read_jsonl(path, json_keys) -> list[dict]:
    """The JSON lines of ``path``, each an object holding a string under every key of ``json_keys``
    (``preprocess_data.py`` also takes a list of strings). Bad input: ``UsageError``, one line with the
    line number."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--input {path}: no such file; write the course corpus with "
                         f"`python -m course_lib megatron-cmd --export-corpus {path}`")
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise UsageError(f"--input {path} line {n}: not JSON ({exc.msg} at column {exc.colno}); "
                                 f"each line must be one object like {{\"text\": \"...\"}}") from None
            if not isinstance(row, dict):
                raise UsageError(f"--input {path} line {n}: a JSON {type(row).__name__}, not an object with "
                                 f"the keys {list(json_keys)}")
            for key in json_keys:
                if key not in row:
                    raise UsageError(f"--input {path} line {n}: no key {key!r} (it has {sorted(row)[:5]}); "
                                     f"pick the keys with --json-keys")
                value = row[key]
                if not (isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str)
                                                                                   for v in value))):
                    raise UsageError(f"--input {path} line {n}: {key!r} holds a {type(value).__name__}, "
                                     f"not text (a string or a list of strings)")
            rows.append(row)
    return rows


def tokenize_documents(rows, key: str, tokenizer, append_eod: bool) -> list[list[int]]:
    """``preprocess_data.py``'s ``Encoder.encode`` for one key: a list of strings is concatenated
    (document level), eod after a non-empty document when ``append_eod``."""
    docs = []
    for row in rows:
        value = row[key]
        ids = [i for text in ([value] if isinstance(value, str) else value) for i in tokenizer.tokenize(text)]
        if ids and append_eod:
            ids.append(tokenizer.eod)
        docs.append(ids)
    return docs


def preprocess(input_path, prefix, tokenizer, json_keys=("text",), append_eod: bool = True,
               force: bool = False) -> dict:
    """Read, tokenize, then write every key's ``.bin/.idx``; returns ``{key: (bin, idx)}``.
    Every output is checked before reading (an existing one needs ``force``)."""
    from course_lib.safe_files import check_output_file

    outs = {key: output_prefix(prefix, key) for key in json_keys}
    for key, out in outs.items():
        for suffix in (".bin", ".idx"):
            check_output_file(f"{out}{suffix}", force=force, inputs=[input_path], what="--output-prefix")
    rows = read_jsonl(input_path, json_keys)
    docs = {key: tokenize_documents(rows, key, tokenizer, append_eod) for key in json_keys}
    return {key: write_indexed_dataset(outs[key], docs[key], tokenizer.vocab_size, force=force) for key in json_keys}


def add_arguments(parser) -> None:
    g = parser.add_argument_group("input data (preprocess_data.py's flags)")
    g.add_argument("--input", required=True, help="JSON lines, one document per line")
    g.add_argument("--json-keys", nargs="+", default=["text"], help="keys to extract (default: text)")
    g = parser.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--vocab-file", default=None, help="vocab.json (python -m course_lib tokenizer makes one)")
    g.add_argument("--merge-file", default=None, help="merges.txt")
    g.add_argument("--append-eod", action="store_true", help="append the eod token after each document")
    g = parser.add_argument_group("output data")
    g.add_argument("--output-prefix", required=True, help="writes PREFIX_{key}_document.bin/.idx")
    g.add_argument("--workers", type=int, default=1, help="accepted for Megatron's command line; the course "
                                                          "tokenizes in one process")
    g.add_argument("--force", action="store_true", help="replace existing .bin/.idx files")


def run(args) -> int:
    if isinstance(args.workers, bool) or args.workers < 1:
        raise UsageError(f"--workers {args.workers}: must be a positive integer")
    tokenizer = BPETokenizer.from_files(args.vocab_file, args.merge_file)
    start = time.perf_counter()
    written = preprocess(args.input, args.output_prefix, tokenizer, args.json_keys, args.append_eod, args.force)
    seconds = time.perf_counter() - start
    for key, (bin_path, idx_path) in written.items():
        print(f"{key}: {bin_path} ({bin_path.stat().st_size} bytes, {optimal_dtype(tokenizer.vocab_size).__name__}) "
              f"and {idx_path} ({idx_path.stat().st_size} bytes)")
    print(f"preprocessed {args.input} in {seconds:.2f} s")
    return 0
