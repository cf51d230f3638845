"""The shared verdict helpers: numbers of any real type, comparisons that never raise,
student calls whose patches are undone, the course's own code recognised, and the
checked process group that sees (and can refuse) every collective however it is called."""

from __future__ import annotations

import decimal
import fractions
import functools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import course_lib.communication_patterns as communication_patterns
import course_lib.topology as topology
from course_lib.classroom.checks import call_student, try_student
from course_lib.classroom.checks.tamper_guard import LibraryPatched, course_function, run_student
from course_lib.classroom.checks.verdicts import (collectives as collective_events, describe_ops, elements_sent,
                                                  expect_collectives, refused_collective, safe_repr, same_number,
                                                  same_value)

RIGHT_QUARTERS = [0.25, fractions.Fraction(1, 4), decimal.Decimal("0.25"), np.float32(0.25), np.float64(0.25),
                  np.int64(1) / 4, torch.tensor(0.25, dtype=torch.float64), torch.tensor([0.25]), np.array(0.25)]


@pytest.mark.parametrize("answer", RIGHT_QUARTERS, ids=lambda a: type(a).__name__)
def test_a_right_number_of_any_real_type_is_accepted(answer):
    assert same_number(answer, 0.25, rel=1e-6)


@pytest.mark.parametrize("answer, reason", [
    (float("nan"), "NaN"), (float("inf"), "infinite"), (-float("inf"), "infinite"), (True, "bool"),
    (np.bool_(False), "bool"), (0.25j, "complex"), ("0.25", "string"), (None, "None"), ([0.25], "list"),
    (torch.tensor([0.25, 1.0]), "shape"), (torch.tensor(True), "bool"), (fractions.Fraction(10 ** 400), "finite"),
    (torch.tensor(float("nan")), "NaN"), (0.3, "expected 0.25"),
], ids=lambda a: safe_repr(a, 20))
def test_a_wrong_or_odd_number_is_rejected_with_a_reason(answer, reason):
    verdict = same_number(answer, 0.25)
    assert not verdict and reason in verdict.reason


class _RaisingEq:
    def __eq__(self, other):
        raise RuntimeError("== raises")

    __ne__ = __eq__
    __hash__ = object.__hash__

    def __repr__(self):
        raise RuntimeError("repr raises")


@pytest.mark.parametrize("answer, expected, same", [
    (_RaisingEq(), 1, False), (_RaisingEq(), [1], False), (_RaisingEq(), {"a": 1}, False),
    (np.array([1, 2]), [1, 2], True), (np.array([1, 3]), np.array([1, 2]), False), (np.arange(3), 3, False),
    (np.array([1, 2]), "x", False), ({"tp": (4, 5)}, {"tp": [4, 5]}, True), (torch.tensor([4, 5]), [4, 5], True),
    (torch.tensor([4.0, 5.0]), torch.tensor([4, 5]), True), (torch.tensor([4, 5]), torch.tensor([[4, 5]]), False),
    (1, True, False), (True, 1, False), ("4", 4, False), ([4, 5], [4, 5, 6], False),
])
def test_same_value_never_raises(answer, expected, same):
    assert same_value(answer, expected) is same


def test_safe_repr_survives_a_raising_repr():
    assert safe_repr(_RaisingEq()) == "<_RaisingEq object>"
    assert len(safe_repr("x" * 500)) == 80


def test_a_students_patch_is_undone_and_reported():
    linear, groups_of = F.linear, topology.RankGrid.groups_of

    def patches(x):
        F.linear = lambda *a: 0
        topology.RankGrid.groups_of = lambda *a: {}
        torch.Tensor.course_test_extra = lambda self: 1
        return x

    value, exc = try_student(patches, 3)
    assert value is None and isinstance(exc, LibraryPatched)
    assert "torch.nn.functional.linear" in str(exc) and "RankGrid.groups_of" in str(exc)
    assert F.linear is linear and topology.RankGrid.groups_of is groups_of
    assert not hasattr(torch.Tensor, "course_test_extra")
    assert call_student(patches, 3)[1].startswith("LibraryPatched")


def test_a_clean_call_passes_through():
    assert try_student(lambda a, b: a + b, 2, 3) == (5, None)
    assert call_student(lambda: (_ for _ in ()).throw(NotImplementedError)) == (None, "todo")


def test_the_courses_own_code_is_recognised_however_it_is_reached():
    reach = getattr(communication_patterns, "ring_" + "all_reduce")

    def calls_it(x):
        try:
            reach(torch.ones(2))  # no process group: it raises, but it ran
        except Exception:  # noqa: BLE001
            pass

    run = run_student(calls_it, 1, references=[communication_patterns.ring_all_reduce])
    assert run.course_code == ["course_lib.communication_patterns.ring_all_reduce"]
    assert "write it yourself" in run.problem()
    assert run_student(lambda x: x, 1, references=[communication_patterns.ring_all_reduce]).course_code == []
    assert course_function(functools.partial(communication_patterns.ring_all_reduce, group=None)) == \
        "course_lib.communication_patterns.ring_all_reduce"
    assert course_function(lambda x: x) is None


def test_the_old_module_name_reaches_code_that_is_still_refused():
    """A Lab 00 notebook copied before the rename imports ``course_lib.collectives``: the same functions come back,
    and the guard names them by their home, whatever name the student used."""
    import course_lib.collectives as old_name
    from course_lib.classroom.checks.references import references_for

    def via_old_name(x):
        try:
            old_name.ring_all_reduce(x)  # no process group: it raises, but it ran
        except Exception:  # noqa: BLE001
            pass

    run = run_student(via_old_name, torch.ones(2), references=references_for("my_ring_all_reduce"))
    assert run.course_code == ["course_lib.communication_patterns.ring_all_reduce"]
    assert "write it yourself" in run.problem()
    assert course_function(old_name.apply_collective) == "course_lib.communication_patterns.apply_collective"


# ----------------------------------------------------------------- the checked process group

def _rank_every_way_to_a_collective():
    """On a rank: try every route to a collective inside point_to_point_only; record what ran outside."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed import all_reduce as bound_all_reduce

    from course_lib.classroom.checks.verdicts import point_to_point_only, wire_recorder

    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.ones(4) * rank
    with wire_recorder() as rec:
        total = x.clone()
        dist.all_reduce(total)
        for request in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, (rank + 1) % world),
                                               dist.P2POp(dist.irecv, torch.empty(4), (rank - 1) % world)]):
            request.wait()
    routes = {
        "dist.all_reduce": lambda: dist.all_reduce(x),
        "distributed_c10d.all_reduce": lambda: c10d.all_reduce(x),
        "a name bound earlier": lambda: bound_all_reduce(x),
        "all_gather_object": lambda: dist.all_gather_object([None] * world, rank),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(torch.empty(4 * world), x),
        "gather": lambda: dist.gather(x, [torch.empty(4) for _ in range(world)] if rank == 0 else None, dst=0),
        "scatter": lambda: dist.scatter(x, [torch.empty(4) for _ in range(world)] if rank == 0 else None, src=0),
        "broadcast_object_list": lambda: dist.broadcast_object_list([1], 0),
        "all_to_all_single": lambda: dist.all_to_all_single(torch.empty(world), torch.ones(world)),
        "a new group": lambda: dist.all_reduce(x, group=dist.new_group(list(range(world)))),
        "a new gloo group": lambda: dist.new_group(backend="gloo"),
    }
    verdicts = {}
    for name, route in routes.items():
        try:
            with point_to_point_only("use send/recv"):
                route()
            verdicts[name] = "ran"
        except Exception as exc:  # noqa: BLE001
            verdicts[name] = refused_collective(str(exc)) or repr(exc)
    with point_to_point_only("use send/recv"):
        dist.barrier()  # no data: allowed
    return total.tolist(), rec.events, verdicts, _student_on_rank_results(rank)


def _student_on_rank_results(rank):
    """On a rank: student_on_rank's value, wire, patches and course code for three student functions."""
    import torch.distributed as dist

    from course_lib.classroom.checks.student_process import student_on_rank

    def summed(t):
        dist.all_reduce(t)
        return t

    def patching(t):
        F.linear = lambda *a, **k: None  # a monkeypatch the checker must undo
        return [t.sum().item()]

    tensor_run = student_on_rank(summed, torch.ones(2) * rank)
    list_run = student_on_rank(patching, torch.ones(2))
    try:
        student_on_rank(lambda: 1 / 0)
        raised = None
    except ZeroDivisionError as exc:
        raised = type(exc).__name__
    ring = communication_patterns.ring_all_reduce
    course_run = student_on_rank(ring, torch.ones(3), references=(ring,))
    return dict(value=tensor_run["value"].tolist(), ops=describe_ops(tensor_run["events"]),
                listed=list_run["value"], patched=list_run["patched"], restored=F.linear is torch._C._nn.linear,
                raised=raised, course_code=course_run["course_code"])


def test_collectives_are_refused_at_the_process_group_level_however_they_are_reached():
    from course_lib.classroom.checks.verdicts import launch_checked

    for total, events, verdicts, on_rank in launch_checked(_rank_every_way_to_a_collective, 3, timeout=30):
        # student_on_rank: the value comes back (a tensor as is, anything else described), with the wire seen,
        # a patch undone and named, the student's exception raised again and the course's own code named
        assert on_rank["value"] == [3.0, 3.0] and on_rank["ops"] == "1 all_reduce on world (2 elements)"
        assert on_rank["listed"] == "a list ([2.0])" and on_rank["restored"]
        assert any("linear" in name for name in on_rank["patched"]), on_rank["patched"]
        assert on_rank["raised"] == "ZeroDivisionError"
        assert on_rank["course_code"] == ["course_lib.communication_patterns.ring_all_reduce"], on_rank["course_code"]
        assert total == [3.0] * 4
        assert all("use send/recv" in v for v in verdicts.values()), verdicts
        assert expect_collectives(events, {("all_reduce", "world"): 1}) is None
        assert "needs exactly 2 all_reduce on world; it ran 1 all_reduce on world (4 elements)" in \
            expect_collectives(events, {("all_reduce", "world"): 2})
        assert elements_sent(events) == 4 and elements_sent(events, "recv") == 4
        assert len(collective_events(events)) == 1
        assert describe_ops(events).startswith("1 all_reduce on world (4 elements), 1 send on world")


# ------------------------------------------------------------------ structured verdicts


def test_every_checker_is_declared_with_an_exercise_of_the_registry():
    import ast
    from pathlib import Path

    from course_lib.classroom.checks import exercise, references

    folder = Path(exercise.__file__).parent
    public = {node.name for path in folder.glob("*.py") for node in ast.parse(path.read_text()).body
              if isinstance(node, ast.FunctionDef) and node.name.startswith("check_")}
    declared = exercise.checkers_in(folder)
    assert set(declared) == public and len(public) >= 39
    names = {info.name.format(lab=lab) for info in declared.values() for lab in ("07", "08")}
    assert names <= set(references.REFERENCES), names - set(references.REFERENCES)


def test_checkers_in_reads_each_module_once_per_version_and_refuses_two_of_one_name(tmp_path):
    import os

    import pytest

    from course_lib.classroom.checks.exercise import checkers_in

    module = tmp_path / "mine.py"
    module.write_text('@exercise("a")\ndef check_a(fn):\n    pass\n')
    assert set(checkers_in(tmp_path)) == {"check_a"}
    module.write_text('@exercise("b")\ndef check_b(fn, n):\n    pass\n')  # edited: its new checker is seen
    os.utime(module, ns=(1, 1))
    assert {k: (v.name, v.params) for k, v in checkers_in(tmp_path).items()} == {"check_b": ("b", ("fn", "n"))}
    (tmp_path / "other.py").write_text('@exercise("c")\ndef check_b(fn):\n    pass\n')
    with pytest.raises(ValueError, match="two checkers are named check_b"):
        checkers_in(tmp_path)


def test_a_checker_prints_as_before_returns_a_verdict_and_writes_it_only_when_asked(tmp_path, monkeypatch, capsys):
    import json

    from course_lib.classroom.checks import records
    from course_lib.classroom.checks.exercise import VERDICTS_ENV, one_line
    from course_lib.classroom.checks.rank_grid import check_derive_dp

    monkeypatch.delenv(VERDICTS_ENV, raising=False)
    monkeypatch.setattr(records, "_SINK", {})  # the record file it opens is this test's only, not the worker's for good
    wrong = check_derive_dp(lambda w, tp, pp, cp=1: w // (tp * pp))
    printed = capsys.readouterr().out
    assert printed.startswith("✗ ") and "context parallelism is a factor" in printed
    assert not wrong and wrong.exercise == "derive_dp" and wrong.hint == one_line(printed)
    assert "✗" not in wrong.hint and "\n" not in wrong.hint and wrong.evidence["calls"] >= 1
    assert list(tmp_path.iterdir()) == []

    sink = tmp_path / "verdicts.jsonl"
    monkeypatch.setenv(VERDICTS_ENV, str(sink))

    def right(world, tp, pp, cp=1):
        if world % (tp * pp * cp):
            raise ValueError("not divisible")
        return world // (tp * pp * cp)

    ok = check_derive_dp(right)
    assert ok and ok.hint == "" and capsys.readouterr().out.startswith("✓ derive_dp")
    assert [json.loads(line) for line in sink.read_text().splitlines()] == [{"verdict": ok.as_json()}]


def test_the_evidence_of_a_checker_on_ranks_is_what_the_students_code_put_on_the_wire(capsys):
    import json

    from course_lib.classroom.checks.collectives import check_all_reduce_from_halves
    import lab00_answers as answers

    verdict = check_all_reduce_from_halves(answers.rs_ag)
    assert verdict, capsys.readouterr().out
    evidence = verdict.evidence
    assert json.loads(json.dumps(evidence)) == evidence
    assert set(evidence["ops"]) == {"reduce_scatter", "all_gather"} and evidence["groups"] == ["world"]
    assert evidence["ops"]["reduce_scatter"] == evidence["ops"]["all_gather"] == evidence["calls"]
    assert evidence["bytes"] > 0 and len(evidence["ranks"]) >= 2
