"""Checkers for Lab 11 (Day 22's set-up): the sample index and the blend's order built by hand.

``check_sample_index(fn)``: ``fn(sizes, document_index, seq_length, num_epochs, tokens_per_epoch)``
returns the ``[N + 1, 2]`` rows ``(position in document_index, offset)`` where each sample starts, as
megatron-core's ``helpers.build_sample_idx`` (``megatron/core/datasets/helpers.cpp``). The checker
draws random document sizes, epochs and sequence lengths (sizes of 1 token, samples longer than a
document, several epochs) and compares every row with megatron-core's own compiled helper (the
course's :func:`course_lib.data.gpt_dataset.build_sample_index` where megatron-core is not installed).
A wrong row is explained by the mistake it shows: no shared token between neighbours, a sample
that never crosses into the next document, the wrong number of rows; the hint shows the student's row and
the rule, never the expected row. Never raises.

``check_blending_indices(fn)``: ``fn(weights, size)`` returns ``(dataset_index, dataset_sample_index)``
of a ``--data-path`` blend, as megatron-core's ``helpers.build_blending_indices`` (``BlendedDataset``):
sample ``i`` comes from the dataset whose count lags furthest behind ``weight * max(i, 1)``, the first
on a tie, and is that dataset's next sample. Compared with megatron-core's compiled helper (the
course's :func:`course_lib.data.blend.blending_indices` without megatron-core) on drawn weights and
sizes; the hint names the mistake a wrong row shows. Never raises.
"""

from __future__ import annotations

import warnings

import numpy as np

from course_lib.classroom.checks import call_student, not_attempted, outcome, refused_call
from course_lib.classroom.checks.exercise import exercise
from course_lib.classroom.checks.references import references_for
from course_lib.classroom.checks.verdicts import drawn_rng, safe_repr

CASES = 40


def _reference():
    """megatron-core's compiled helper, else the course's (the same rows: tests/data/test_megatron_data.py)."""
    try:
        with warnings.catch_warnings():   # megatron-core's "Transformer Engine and Apex are not installed"
            warnings.simplefilter("ignore")
            from megatron.core.datasets.helpers import build_sample_idx
    except ImportError:
        from course_lib.data.gpt_dataset import build_sample_index

        return build_sample_index, "the course's build_sample_index (megatron-core is not installed)"
    return (lambda *a: build_sample_idx(*a, True, True)), "megatron-core's helpers.build_sample_idx"


def _cases(seed: int):
    rng = np.random.default_rng(seed)
    out = [(np.array([10, 7, 16], np.int32), np.array([0, 1, 2], np.int32), 8, 1, 33)]   # the lab's picture
    while len(out) < CASES:
        sizes = rng.integers(1, 30, size=int(rng.integers(1, 10))).astype(np.int32)
        epochs = int(rng.integers(1, 4))
        doc_index = np.tile(np.arange(len(sizes), dtype=np.int32), epochs)
        rng.shuffle(doc_index)
        tokens = int(sizes.sum())
        if epochs * tokens < 4:
            continue
        seq = int(rng.integers(2, max(3, min(epochs * tokens - 1, 40))))
        out.append((sizes, doc_index, seq, epochs, tokens))
    return out


def _mistake(got: np.ndarray, want: np.ndarray, bad: int, sizes, doc_index) -> str:
    """The likeliest mistake behind the first wrong row ``bad``."""
    if len(got) != len(want):
        return (f"{len(got)} rows: N = (num_epochs * tokens_per_epoch - 1) // seq_length samples, plus one row for "
                f"where the last one ends")
    (pos, off), (want_pos, want_off) = got[bad], want[bad]
    if pos == want_pos and off == want_off + 1:
        return ("one token too far: a sample is seq_length + 1 tokens and the next one starts on its last token "
                "(neighbours share it: tokens[1:] are the labels)")
    if 0 <= pos < len(doc_index) and off >= int(sizes[doc_index[pos]]):
        return (f"offset {off} is past the end of that document ({int(sizes[doc_index[pos]])} tokens): when a sample "
                f"needs more tokens than its document has left, go on in the next one at offset 0")
    return ("walk document_index with a budget of seq_length + 1 tokens per sample, starting each sample on the "
            "last token of the one before")


@exercise("build_sample_index")
def check_sample_index(fn, seed: int | None = None) -> bool:
    """``fn(sizes, document_index, seq_length, num_epochs, tokens_per_epoch) -> [N + 1, 2]`` array."""
    reference = source = None   # imported once the student's code has answered: a stub's check needs none (~2 s)
    seed = drawn_rng().randrange(2**31) if seed is None else seed
    for sizes, doc_index, seq, epochs, tokens in _cases(seed):
        args = (sizes.copy(), doc_index.copy(), seq, epochs, tokens)
        got, message = call_student(fn, *args, references=references_for("build_sample_index"))
        if message == "todo":
            return not_attempted("build_sample_index")
        if refused_call(message):
            return False
        if reference is None:
            reference, source = _reference()
        want = np.asarray(reference(sizes, doc_index, seq, epochs, tokens))
        case = (f"sizes={sizes.tolist()}, document_index={doc_index.tolist()}, seq_length={seq}, "
                f"num_epochs={epochs}, tokens_per_epoch={tokens}")
        if message:
            print(f"✗ build_sample_index({case}) {outcome(got, message)}")
            return False
        try:
            arr = np.asarray(got, dtype=np.int64).reshape(-1, 2)
        except (TypeError, ValueError):
            print(f"✗ build_sample_index({case}) returned {safe_repr(got)}: return an [N + 1, 2] array of "
                  f"(position, offset) rows")
            return False
        if arr.shape != want.shape or not np.array_equal(arr, want):
            rows = min(len(arr), len(want))
            bad = next((j for j in range(rows) if not np.array_equal(arr[j], want[j])), rows)
            print(f"✗ build_sample_index({case}): row {bad} is {arr[bad].tolist() if bad < len(arr) else 'missing'}, "
                  f"not what {source} gives\n"
                  f"  hint: {_mistake(arr, want, bad, sizes, doc_index)}")
            return False
    print(f"✓ build_sample_index: {CASES} random datasets (document sizes, epochs, seq_length) give "
          f"every row of {source}")
    return True


def _blending_reference():
    """megatron-core's compiled helper, else the course's (equal: tests/data/test_megatron_data.py's blends)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets.helpers import build_blending_indices
    except ImportError:
        from course_lib.data.blend import blending_indices

        return blending_indices, "the course's blending_indices (megatron-core is not installed)"

    def reference(weights, size):
        dataset_index, sample_index = np.zeros(size, np.int16), np.zeros(size, np.int64)
        build_blending_indices(dataset_index, sample_index, np.asarray(weights, np.float64), len(weights), size, False)
        return dataset_index, sample_index
    return reference, "megatron-core's helpers.build_blending_indices"


def _blend_cases(seed: int):
    rng = np.random.default_rng(seed)
    out = [([0.7, 0.3], 10), ([0.5, 0.5], 6), ([0.2, 0.3, 0.5], 12)]     # the lab's blend, a tie, 3 datasets
    while len(out) < CASES:
        raw = rng.integers(1, 20, size=int(rng.integers(1, 6))).astype(np.float64)
        out.append(((raw / raw.sum()).tolist(), int(rng.integers(1, 200))))
    return out


def _blend_mistake(weights, got_d, got_s, want_d, want_s, bad: int) -> str:
    """The likeliest mistake behind the first wrong blended sample ``bad``."""
    if got_d[bad] == want_d[bad]:
        return (f"the dataset is right but sample {got_s[bad]} is not its next one: a dataset's samples are taken in "
                f"order, so dataset_sample_index[i] is how many it gave before i")
    errors = [w * max(bad, 1) - int(np.sum(np.asarray(want_d[:bad]) == k)) for k, w in enumerate(weights)]
    if errors[int(got_d[bad])] == errors[int(want_d[bad])]:
        return "a tie: the first dataset with the largest error wins (compare with >, not >=)"
    if bad == 0:
        return ("sample 0: count the samples so far as max(i, 1), so the first sample goes to the largest weight "
                "(with i = 0 every error is 0)")
    return ("pick the dataset whose count lags furthest behind its share: the largest weight * max(i, 1) - "
            "samples it gave so far")


@exercise("build_blending_indices")
def check_blending_indices(fn, seed: int | None = None) -> bool:
    """``fn(weights, size) -> (dataset_index [size], dataset_sample_index [size])``."""
    reference = source = None   # imported once the student's code has answered (see check_sample_index)
    seed = drawn_rng().randrange(2**31) if seed is None else seed
    for weights, size in _blend_cases(seed):
        got, message = call_student(fn, list(weights), size, references=references_for("build_blending_indices"))
        if message == "todo":
            return not_attempted("build_blending_indices")
        if refused_call(message):
            return False
        if reference is None:
            reference, source = _blending_reference()
        case = f"weights={[round(w, 4) for w in weights]}, size={size}"
        if message:
            print(f"✗ build_blending_indices({case}) {outcome(got, message)}")
            return False
        try:
            got_d, got_s = (np.asarray(a, dtype=np.int64).reshape(-1) for a in got)
        except (TypeError, ValueError):
            print(f"✗ build_blending_indices({case}) returned {safe_repr(got)}: return two arrays of {size} "
                  f"integers, (dataset_index, dataset_sample_index)")
            return False
        want_d, want_s = (np.asarray(a, dtype=np.int64) for a in reference(weights, size))
        if len(got_d) != size or len(got_s) != size:
            print(f"✗ build_blending_indices({case}): {len(got_d)} and {len(got_s)} entries, not {size}: one "
                  f"(dataset, sample) pair per blended sample")
            return False
        if not (np.array_equal(got_d, want_d) and np.array_equal(got_s, want_s)):
            bad = int(np.flatnonzero((got_d != want_d) | (got_s != want_s))[0])
            print(f"✗ build_blending_indices({case}): blended sample {bad} is (dataset {got_d[bad]}, sample "
                  f"{got_s[bad]}), not what {source} gives\n"
                  f"  hint: {_blend_mistake(weights, got_d, got_s, want_d, want_s, bad)}")
            return False
    print(f"✓ build_blending_indices: {CASES} drawn blends (1 to 5 datasets, weights, sizes, a tie) give every "
          f"(dataset, sample) pair of {source}")
    return True
