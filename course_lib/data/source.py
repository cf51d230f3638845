"""The trainer's data flags (Megatron's ``_add_data_args`` / ``_add_tokenizer_args``) and what they build.

``--data-path PREFIX`` (or a blend ``0.7 A 0.3 B``) ``--split 969,30,1 --tokenizer-type
GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt --seed``: the trainer draws its
samples with :func:`course_lib.data.blend.build_datasets` (megatron-core's ``GPTDataset`` order),
in Megatron's batch order (:func:`course_lib.data.microbatch_sample_indices`: iteration ``it`` takes
samples ``[it * G, (it + 1) * G)``), and the model's vocabulary is the tokenizer's.

Without ``--data-path`` the same path reads the built-in corpus: its documents as byte tokens (eod
after each) in Megatron's indexed dataset held in memory
(:func:`course_lib.data.corpus.corpus_indexed_dataset`, nothing written), cut by ``--split``, in
``GPTDataset``'s order for ``--seed``; so ``--eval-interval`` works there too. The batches are those of
``--data-path PREFIX --tokenizer-type NullTokenizer --vocab-size 256`` on the files
:func:`course_lib.data.corpus.write_corpus_dataset` writes (``tests/data/test_megatron_data.py``).
"""

from __future__ import annotations

import functools
from pathlib import Path

from course_lib.data.tokenizer import ByteTokenizer, NullTokenizer
from course_lib.rules import UsageError

TOKENIZER_TYPES = ("GPT2BPETokenizer", "NullTokenizer")
DEFAULT_SPLIT = "969,30,1"   # Megatron's --split default


def add_data_arguments(parser) -> None:
    g = parser.add_argument_group("data and tokenizer (Megatron's _add_data_args; course_lib.data)")
    g.add_argument("--data-path", nargs="+", default=None,
                   help="PREFIX of PREFIX.bin/.idx (python -m course_lib preprocess), or a blend '0.7 A 0.3 B'; "
                        "default: the built-in corpus, byte tokens")
    g.add_argument("--split", default=DEFAULT_SPLIT, help="train,valid,test shares of each prefix's documents")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None)
    g.add_argument("--vocab-file", default=None, help="GPT-2's vocab.json (python -m course_lib tokenizer)")
    g.add_argument("--merge-file", default=None, help="GPT-2's merges.txt")
    g.add_argument("--vocab-size", type=int, default=None,
                   help="NullTokenizer's vocabulary before eod (ids 0..N-1, eod N); 256 reads the built-in corpus "
                        "written by course_lib.data.corpus.write_corpus_dataset")
    g.add_argument("--data-cache-path", default=None,
                   help="folder of megatron-core's GPTDataset index files (HASH-GPTDataset-SPLIT-*.npy): loaded when "
                        "there, else built and written by rank 0; default: built in memory, nothing written")
    g.add_argument("--eval-interval", type=int, default=None,
                   help="validation loss every N iterations and after the last, on the --split's valid part "
                        "(Megatron's default 1000, the course's: no evaluation)")
    g.add_argument("--eval-iters", type=int, default=100, help="global batches per evaluation (Megatron's default 100)")


def load_tokenizer(data):
    """The run's tokenizer (``data``: a :class:`course_lib.training.run_config.DataConfig`): GPT-2 BPE from
    ``--vocab-file``/``--merge-file``, ``NullTokenizer`` of ``--vocab-size``, else the byte tokenizer."""
    if data.tokenizer_type is None:
        return ByteTokenizer()
    if data.tokenizer_type == "NullTokenizer":
        return NullTokenizer(data.vocab_size)
    from course_lib.data.bpe import BPETokenizer

    return BPETokenizer.from_files(data.vocab_file, data.merge_file)


def check_data_args(data, *, deepspeed: bool = False) -> None:
    """One line for data flags that do not go together (``data``: a ``DataConfig``; ``deepspeed``: a
    ``--deepspeed-config`` is given); opens the tokenizer and every ``--data-path`` prefix, so a bad one
    fails before any rank starts. The splits' sizes: :func:`check_datasets`, once the batch is derived."""
    if data.tokenizer_type is None and (data.vocab_file or data.merge_file):
        raise UsageError("--vocab-file/--merge-file need --tokenizer-type GPT2BPETokenizer")
    from course_lib.data.blend import parse_blend, parse_split
    from course_lib.data.indexed import IndexedDataset

    parse_split(data.split)
    cache = data.data_cache_path
    if cache is not None and Path(cache).exists() and not Path(cache).is_dir():
        raise UsageError(f"--data-cache-path {cache} is a file; give a folder (megatron-core keeps its index "
                         f"files there), e.g. --data-cache-path data/cache")
    if data.data_path is None:
        if data.tokenizer_type is not None:
            raise UsageError("--tokenizer-type without --data-path: the built-in corpus is byte tokens; give "
                             "--data-path PREFIX (python -m course_lib preprocess makes one)")
        return
    if data.tokenizer_type is None:
        raise UsageError("--data-path needs the tokenizer that made it: --tokenizer-type GPT2BPETokenizer "
                         "--vocab-file vocab.json --merge-file merges.txt")
    if deepspeed:
        raise UsageError("--data-path with --deepspeed-config: the DeepSpeed path reads the built-in corpus only; "
                         "drop one of them")
    load_tokenizer(data)
    for prefix in parse_blend(list(data.data_path))[0]:
        IndexedDataset(prefix)


def check_datasets(run) -> None:
    """Builds the splits ``run`` (a ``RunConfig``) reads (milliseconds for the course's data): a split too
    small for one sample fails in one line, here, before any rank starts."""
    build_train_dataset(run, run.parallel.effective_global_batch_size)
    build_valid_dataset(run, run.parallel.effective_global_batch_size)


def vocab_size(data) -> int:
    """The unpadded vocabulary of the run (the tokenizer's)."""
    return load_tokenizer(data).vocab_size


def build_valid_dataset(run, global_batch_size: int):
    """The valid split for every evaluation of ``run`` (a ``RunConfig``;
    :func:`course_lib.data.blend.num_samples_per_split`), or None without ``--eval-interval``."""
    schedule = run.schedule
    if schedule.eval_interval is None:
        return None
    from course_lib.data.blend import num_samples_per_split

    sizes = num_samples_per_split(schedule.train_iters, global_batch_size, schedule.eval_interval, schedule.eval_iters)
    return _build(run, sizes, "valid")


def build_train_dataset(run, global_batch_size: int):
    """The train split for ``--train-iters * global_batch_size`` samples (``--data-path``'s, else the
    built-in corpus's)."""
    return _build(run, [run.schedule.train_iters * global_batch_size, 0, 0], "train")


def corpus_dataset(seq_length: int, seed: int, num_samples: int | None = None, split: str = DEFAULT_SPLIT):
    """The built-in corpus's train split as the trainer draws it without ``--data-path`` for a run of
    ``num_samples`` samples (``--train-iters * --global-batch-size``; None: one epoch, the same samples in
    the same order whenever the run fits in one)."""
    from course_lib.data.blend import SPLITS

    return _build_builtin(str(split), (num_samples, 0, 0), int(seq_length), int(seed), None)[SPLITS.index("train")]


def _build(run, sizes, split_name: str):
    from course_lib.data.blend import SPLITS, build_datasets

    data = run.data
    if data.data_path is None:
        wanted = tuple(n if name == split_name else 0 for name, n in zip(SPLITS, sizes))
        build = _build_builtin if data.data_cache_path is None else _build_builtin.__wrapped__   # files may go
        return build(data.split, wanted, run.model.seq_length, run.schedule.seed,
                     data.data_cache_path)[SPLITS.index(split_name)]
    tok = load_tokenizer(data)
    return build_datasets(list(data.data_path), data.split, sizes, run.model.seq_length, run.schedule.seed, tok.eod,
                          wanted=(split_name,), cache_path=data.data_cache_path,
                          tokenizer_identifiers=tok.unique_identifiers)[SPLITS.index(split_name)]


@functools.lru_cache(maxsize=16)
def _build_builtin(split: str, sizes: tuple, seq_length: int, seed: int, cache_path):
    """The built-in corpus's splits of ``sizes`` samples each (a 0 size: not built), through the same
    :func:`course_lib.data.blend.build_datasets` as a ``--data-path``; kept, as every rank and check of a
    process asks for the same ones."""
    from course_lib.data.blend import SPLITS, build_datasets
    from course_lib.data.corpus import BUILTIN_CORPUS, corpus_indexed_dataset

    tok = ByteTokenizer()
    wanted = tuple(name for name, n in zip(SPLITS, sizes) if n != 0)
    return tuple(build_datasets([BUILTIN_CORPUS], split, list(sizes), seq_length, seed, tok.eod, wanted=wanted,
                                cache_path=cache_path, tokenizer_identifiers=tok.unique_identifiers,
                                indexed=[corpus_indexed_dataset()]))
