"""The course's training text: hand-written prose plus generated arithmetic facts.

No downloads. ``load_documents()`` returns a list of documents (strings):

* the paragraphs of ``prose.txt`` -- original notes on parallel training written
  for this course (one paragraph = one document);
* generated "facts" -- sentences computed here about parallel configurations
  (derived data-parallel sizes, Megatron rank coordinates and groups, pipeline
  bubbles, micro-batch counts, invalid splits). Regular, checkable text, so a
  tiny model's loss visibly falls within a few hundred steps.

Everything is deterministic (no randomness, fixed order), so the corpus -- and
every batch sampled from it -- is identical on every machine. About 120 KB in
total: small enough to read, large enough that a 8-layer model does not simply
memorise one batch.

``export_jsonl(path)`` writes the documents as JSON lines ``{"text": ...}``, the
input format of Megatron-LM's ``tools/preprocess_data.py`` (``--json-keys text``),
so GPU users can train Megatron on the same text. Without ``--data-path`` the trainer reads the
documents as byte tokens (eod after each) from :func:`corpus_indexed_dataset`, Megatron's indexed dataset
held in memory, through the same ``GPTDataset``/``--split`` path as a ``--data-path``;
``write_corpus_dataset(prefix)`` writes those bytes to ``PREFIX.bin/.idx``, and ``--data-path PREFIX
--tokenizer-type NullTokenizer --vocab-size 256`` then trains on exactly the default's batches.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from course_lib import rules
from course_lib.context_parallel.zigzag import chunks_for_rank, num_chunks
from course_lib.topology.grid import RankGrid

PROSE_PATH = Path(__file__).with_name("prose.txt")

_POW2 = (1, 2, 4, 8)


_SENTENCES_PER_DOC = 6  # many short documents: Megatron's --split works on whole documents


def _chunk(sentences: list[str], n: int = _SENTENCES_PER_DOC) -> list[str]:
    return [" ".join(sentences[i:i + n]) for i in range(0, len(sentences), n)]


def _ruled(rule, *args):
    """What ``rule(*args)`` (a :mod:`course_lib.rules` check) returns, or None when it refuses the
    values: the facts state the course's rules, so they are decided by them."""
    try:
        return rule(*args)
    except ValueError:
        return None


def _dp_facts() -> list[str]:
    """world = tp * pp * cp * dp for every power-of-two layout up to 64 ranks."""
    docs = []
    for world in (1, 2, 4, 8, 16, 32, 64):
        lines = []
        for tp in _POW2:
            for pp in _POW2:
                for cp in (1, 2, 4):
                    dp = _ruled(rules.data_parallel_size, world, tp, pp, cp)
                    if dp is None:
                        continue
                    lines.append(
                        f"With {world} ranks, tensor parallel {tp}, pipeline parallel {pp} and context parallel "
                        f"{cp}, the data-parallel size is {world} / ({tp} x {pp} x {cp}) = {dp}.")
        docs += _chunk(lines)
    return docs


def _rank_facts() -> list[str]:
    """Megatron's default order tp-cp-dp-pp (tp fastest): coordinates and groups, from the rank grid."""
    docs = []
    for world, tp, pp, cp in ((8, 2, 2, 1), (8, 2, 2, 2), (8, 4, 1, 1), (8, 1, 4, 1), (16, 2, 4, 1),
                              (16, 4, 2, 1), (16, 2, 2, 2), (32, 4, 4, 1)):
        grid = RankGrid(world, tp=tp, pp=pp, cp=cp)
        name = (f"{world} ranks with tensor parallel {tp}, pipeline parallel {pp}, context parallel {cp} and data "
                f"parallel {grid.dp}")
        lines = [f"Take {name}."]
        for rank in range(world):
            c = grid.coords(rank)
            lines.append(f"Rank {rank} has tensor rank {c['tp']}, context rank {c['cp']}, data rank {c['dp']} and "
                         f"pipeline stage {c['pp']}.")
        docs.append(" ".join(lines))
        lines = [f"Take {name}."]
        for axis, label in (("tp", "tensor"), ("cp", "context"), ("dp", "data"), ("pp", "pipeline")):
            gs = grid.groups(axis)
            if len(gs[0]) > 1:
                lines.append(f"The {label}-parallel groups are " +
                             " ".join("[" + ", ".join(map(str, g)) + "]" for g in gs) + ".")
        docs.append(" ".join(lines))
    return docs


def _bubble_facts() -> list[str]:
    docs = []
    for p in (2, 3, 4, 6, 8):
        lines = []
        for m in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
            lines.append(f"A pipeline of {p} stages with {m} micro-batches has a bubble of ({p} - 1) / {m} = "
                         f"{(p - 1) / m:.3f} of the useful time.")
            for v in (2, 4):
                lines.append(f"Interleaved with {v} chunks per rank it has ({p} - 1) / ({v} x {m}) = "
                             f"{(p - 1) / (v * m):.3f}.")
        docs += _chunk(lines)
    return docs


def _microbatch_facts() -> list[str]:
    docs = []
    for gbs in (8, 16, 32, 64, 128, 256):
        lines = []
        for mbs in (1, 2, 4, 8):
            for dp in (1, 2, 4, 8):
                m = _ruled(rules.num_microbatches, gbs, mbs, dp)
                if m is None:
                    lines.append(f"A global batch of {gbs} cannot be cut into micro-batches of {mbs} over {dp} "
                                 f"data-parallel ranks, because {gbs} is not divisible by {mbs} x {dp} = {mbs * dp}.")
                else:
                    lines.append(f"A global batch of {gbs} with micro-batch size {mbs} and data-parallel size {dp} "
                                 f"gives {gbs} / ({mbs} x {dp}) = {m} micro-batches per step.")
        docs += _chunk(lines)
    return docs


def _divisibility_facts() -> list[str]:
    docs = []
    for heads in (4, 6, 8, 12, 16, 32):
        lines = []
        for tp in (1, 2, 3, 4, 5, 6, 8):
            per_rank = _ruled(rules.heads_divisible_by_tp, heads, tp)
            if per_rank is None:
                lines.append(f"{heads} attention heads cannot be split over {tp} tensor-parallel ranks, because "
                             f"{heads} is not divisible by {tp}.")
            else:
                lines.append(f"{heads} attention heads over {tp} tensor-parallel ranks give {per_rank} "
                             f"whole heads per rank.")
        docs.append(" ".join(lines))
    for layers in (8, 12, 24, 32, 72):
        lines = []
        for pp in (1, 2, 3, 4, 5, 8):
            stages = _ruled(rules.pipeline_split, layers, pp)
            if stages is None:
                lines.append(f"{layers} layers do not divide evenly over {pp} pipeline stages; an uneven split "
                             f"must be given explicitly.")
            else:
                lines.append(f"{layers} layers over {pp} pipeline stages give {stages[0]} layers per stage.")
        docs.append(" ".join(lines))
    return docs


def _cp_chunk_facts() -> list[str]:
    docs = []
    for cp in (2, 4):
        for seq in (16, 32, 64):
            size = rules.sequence_split(seq, cp)
            lines = [f"Load-balanced context parallelism with {cp} ranks cuts a sequence of {seq} tokens into "
                     f"{num_chunks(cp)} chunks of {size}."]
            for r in range(cp):
                a, b = chunks_for_rank(r, cp)
                lines.append(f"Rank {r} takes chunks {a} and {b}: tokens {a * size} to {a * size + size - 1} "
                             f"and {b * size} to {b * size + size - 1}.")
            docs.append(" ".join(lines))
    return docs


def prose_documents() -> list[str]:
    """The hand-written paragraphs of ``prose.txt`` (one per document)."""
    text = PROSE_PATH.read_text(encoding="utf-8")
    return [p.strip() for p in text.split("\n\n") if p.strip()]


def generated_documents() -> list[str]:
    """The generated fact documents (deterministic)."""
    return (_dp_facts() + _rank_facts() + _bubble_facts() + _microbatch_facts()
            + _divisibility_facts() + _cp_chunk_facts())


@functools.lru_cache(maxsize=1)
def _documents() -> tuple[str, ...]:
    return tuple(prose_documents() + generated_documents())


def load_documents() -> list[str]:
    """All documents of the corpus, in a fixed order (prose first)."""
    return list(_documents())


def corpus_text() -> str:
    """The whole corpus as one string, documents separated by a blank line."""
    return "\n\n".join(_documents()) + "\n"


def export_jsonl(path, key: str = "text") -> Path:
    """Write the corpus as JSON lines (``{"text": ...}`` per document) for Megatron-LM's
    ``tools/preprocess_data.py --input PATH --json-keys text``, atomically. Returns the path.
    Whether ``path`` may be replaced is the caller's check (``safe_files.check_output_file``)."""
    from course_lib.safe_files import write_atomic

    return write_atomic(path, "".join(json.dumps({key: doc}, ensure_ascii=False) + "\n" for doc in _documents()))


BUILTIN_CORPUS = "built-in corpus"   # what stands for a --data-path prefix when none is given


def corpus_token_documents() -> list[list[int]]:
    """The documents as byte tokens, eod after each (:class:`~course_lib.data.tokenizer.ByteTokenizer`,
    ``preprocess_data.py --append-eod``): what the trainer reads without ``--data-path``."""
    from course_lib.data.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    return [tok.encode(d, append_eod=True) for d in _documents()]


@functools.lru_cache(maxsize=1)
def corpus_indexed_dataset():
    """The trainer's default data: :func:`corpus_token_documents` as Megatron's indexed dataset, the bytes
    :func:`write_corpus_dataset` writes, held in memory (nothing written; uint16, one sequence per document)."""
    from course_lib.data.indexed import IndexedDataset
    from course_lib.data.tokenizer import ByteTokenizer

    return IndexedDataset.in_memory(BUILTIN_CORPUS, corpus_token_documents(), ByteTokenizer.vocab_size)


def write_corpus_dataset(prefix, force: bool = False):
    """:func:`corpus_indexed_dataset` written to ``prefix.bin``/``prefix.idx`` (atomic, never over a file
    without ``force``), for ``--data-path prefix --tokenizer-type NullTokenizer --vocab-size 256`` or
    Megatron-LM. Returns the two paths."""
    from course_lib.data.indexed import write_indexed_dataset
    from course_lib.data.tokenizer import ByteTokenizer

    return write_indexed_dataset(prefix, corpus_token_documents(), ByteTokenizer.vocab_size, force=force)
