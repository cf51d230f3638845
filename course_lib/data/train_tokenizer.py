"""``python -m course_lib tokenizer``: train the course's byte-level BPE on the corpus and write
GPT-2's two files, the ``--vocab-file``/``--merge-file`` of Megatron's ``GPT2BPETokenizer``.

    python -m course_lib tokenizer --vocab-file data/tiny/gpt2-vocab.json --merge-file data/tiny/gpt2-merges.txt

``--input corpus.jsonl --json-keys text`` trains on JSON lines instead of the built-in corpus (the
same reader as ``preprocess``). Nothing is replaced without ``--force``; both files are checked
before training and written atomically.
"""

from __future__ import annotations

import time

from course_lib.data.bpe import train_bpe
from course_lib.rules import UsageError

DEFAULT_VOCAB_SIZE = 1024   # 256 bytes + 767 merges + <|endoftext|>: ~3.6 bytes per token on the corpus


def add_arguments(parser) -> None:
    parser.add_argument("--vocab-file", required=True, help="vocab.json to write (GPT-2's format)")
    parser.add_argument("--merge-file", required=True, help="merges.txt to write (GPT-2's format)")
    parser.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE,
                        help=f"entries, <|endoftext|> included (default {DEFAULT_VOCAB_SIZE})")
    parser.add_argument("--input", default=None, help="JSON lines to train on (default: the built-in corpus)")
    parser.add_argument("--json-keys", nargs="+", default=["text"])
    parser.add_argument("--force", action="store_true", help="replace existing files")


def run(args) -> int:
    from pathlib import Path

    from course_lib.data.corpus import load_documents
    from course_lib.data.preprocess import read_jsonl
    from course_lib.safe_files import check_output_file, write_atomic

    vocab, merges = Path(args.vocab_file), Path(args.merge_file)
    if vocab.resolve() == merges.resolve():
        raise UsageError("--vocab-file and --merge-file name the same file; give two names")
    inputs = [args.input] if args.input else []
    check_output_file(vocab, force=args.force, inputs=inputs, what="--vocab-file")
    check_output_file(merges, force=args.force, inputs=inputs, what="--merge-file")
    docs = ([row[k] for row in read_jsonl(args.input, args.json_keys) for k in args.json_keys]
            if args.input else load_documents())
    start = time.perf_counter()
    tok = train_bpe(docs, args.vocab_size)
    seconds = time.perf_counter() - start
    vocab_text, merges_text = tok.files_text()
    write_atomic(vocab, vocab_text)
    write_atomic(merges, merges_text)
    print(f"trained a byte-level BPE on {len(docs)} documents in {seconds:.1f} s: vocab size {tok.vocab_size} "
          f"({len(tok.merges)} merges, eod id {tok.eod})")
    print(f"wrote {vocab} and {merges}")
    return 0
