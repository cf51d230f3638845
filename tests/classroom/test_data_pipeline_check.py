"""Lab 11's checker: the right sample index passes; the usual mistakes fail with the hint that names them."""

from __future__ import annotations

import numpy as np
import pytest

from course_lib.classroom.checks.data_pipeline import check_blending_indices, check_sample_index


def _index(sizes, document_index, seq_length, num_epochs, tokens_per_epoch, share=True, cross=True):
    """A hand-written sample index with two switchable mistakes (not the course's function: the checker
    refuses that one)."""
    rows, position, offset = [(0, 0)], 0, 0
    for _ in range((num_epochs * tokens_per_epoch - 1) // seq_length):
        budget = seq_length + 1
        while True:
            left = int(sizes[document_index[position]]) - offset
            if left >= budget or not cross:
                offset += budget - (1 if share else 0)
                break
            budget -= left
            if position == len(document_index) - 1:
                offset = int(sizes[document_index[position]]) - 1
                break
            position, offset = position + 1, 0
        rows.append((position, offset))
    return np.array(rows)


def test_right_answer_passes(capsys):
    pytest.importorskip("megatron.core.datasets.helpers")
    assert check_sample_index(_index, seed=3)
    assert "megatron-core's helpers.build_sample_idx" in capsys.readouterr().out


@pytest.mark.parametrize("mistake, hint", [
    (dict(share=False), "neighbours share it"),
    (dict(cross=False), "go on in the next one"),
])
def test_mistakes_are_named(mistake, hint, capsys):
    assert not check_sample_index(lambda *a: _index(*a, **mistake), seed=3)
    out = capsys.readouterr().out
    assert out.startswith("✗ build_sample_index(sizes=[10, 7, 16]") and hint in out, out
    assert "gives [" not in out and ", not what " in out, out   # the student's row, not the expected one


def test_stub_is_not_attempted(capsys):
    def stub(*args):
        raise NotImplementedError

    assert not check_sample_index(stub)
    assert "not attempted yet" in capsys.readouterr().out


def _blend(weights, size, first_sample_at_zero=False, ties_to_last=False, shared_counter=False):
    """A hand-written blend order with switchable mistakes (not the course's function: the checker refuses it)."""
    taken, total, pairs = [0] * len(weights), 0, []
    for i in range(size):
        x = i if first_sample_at_zero else max(i, 1)
        errors = [w * x - t for w, t in zip(weights, taken)]
        k = 0
        for d in range(1, len(weights)):
            if errors[d] > errors[k] or (ties_to_last and errors[d] == errors[k]):
                k = d
        pairs.append((k, total if shared_counter else taken[k]))
        taken[k] += 1
        total += 1
    return [p[0] for p in pairs], [p[1] for p in pairs]


def test_blending_right_answer_passes(capsys):
    pytest.importorskip("megatron.core.datasets.helpers")
    assert check_blending_indices(_blend, seed=5)
    assert "megatron-core's helpers.build_blending_indices" in capsys.readouterr().out


@pytest.mark.parametrize("mistake, hint", [
    (dict(first_sample_at_zero=True), "max(i, 1)"),
    (dict(ties_to_last=True), "a tie"),
    (dict(shared_counter=True), "how many it gave before i"),
])
def test_blending_mistakes_are_named(mistake, hint, capsys):
    assert not check_blending_indices(lambda w, n: _blend(w, n, **mistake), seed=5)
    out = capsys.readouterr().out
    assert out.startswith("✗ build_blending_indices(") and hint in out, out
    assert "gives (dataset" not in out and ", not what " in out, out   # the student's pair, not the expected one


def test_blending_reference_is_refused_and_stub_not_attempted(capsys):
    from course_lib.data.blend import blending_indices

    assert not check_blending_indices(blending_indices)
    assert not check_blending_indices(lambda w, n: (_ for _ in ()).throw(NotImplementedError))
    out = capsys.readouterr().out
    assert "not attempted yet" in out, out
