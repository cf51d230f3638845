"""The refusals applied for good (course_lib/classroom/checks/refusals.py, ``Refusals.apply``): in the process that
runs the student's code from then on, ``around()`` entered again changes nothing (its exit must not put the
originals back nor switch the import hook off), and what the checker hands over -- a function, the helpers its code
names, the class of an argument -- keeps its code while every other checker function is disarmed.

Each check runs in a forked child: applying the refusals for good poisons the process that does it."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import tempfile

import torch


def _in_a_child(body) -> dict:
    """``body()``'s dict, computed in a forked child (an exception comes back as ``{"error": ...}``; a child
    silent for 60 s is killed). The child's temp folder is made and removed here: the refusals' file fence gives
    a process without one a folder of its own (``refusals.private_tempdir``), removed at exit, which a child that
    ends by ``os._exit`` never reaches (each such test left one in /tmp)."""
    folder = tempfile.mkdtemp(prefix="test-refusals-")
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.environ["TMPDIR"] = os.environ["COURSE_JUDGE_TMPDIR"] = tempfile.tempdir = folder
            os.close(read_end)
            torch.set_num_threads(1)  # the parent's OpenMP pool does not survive a fork: one thread, no pool
            try:
                out = body()
            except BaseException as exc:  # noqa: BLE001 - reported to the test
                out = {"error": f"{type(exc).__name__}: {exc}"}
            os.write(write_end, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    ready, _, _ = select.select([read_end], [], [], 60)
    if not ready:
        os.kill(pid, signal.SIGKILL)
    with os.fdopen(read_end, "rb") as f:
        data = f.read() if ready else b'{"error": "the child hung for 60 s"}'
    os.waitpid(pid, 0)
    shutil.rmtree(folder, ignore_errors=True)
    return json.loads(data)


def _prepared(exercise: str):
    from course_lib.classroom.checks.refusals import prepare

    return prepare(exercise)


def _raises(fn, *args) -> str:
    try:
        fn(*args)
    except ImportError as exc:
        return str(exc)
    return ""


def _around_after_apply() -> dict:
    import sys

    import course_lib.communication_patterns as patterns
    refusals = _prepared("my_ring_all_reduce")
    original = patterns.ring_all_reduce
    refusals.apply()
    hooks_before = [type(f).__name__ for f in sys.meta_path]
    with refusals.around():
        pass
    with refusals.as_student():
        pass
    refusals.apply()  # again: nothing
    return dict(bound=repr(patterns.ring_all_reduce), active=refusals.active and refusals.applied,
                always=refusals.always,
                hooks=[type(f).__name__ for f in sys.meta_path], hooks_before=hooks_before,
                original=_raises(original, torch.ones(2)),
                checker_module=_raises(__import__, "course_lib.classroom.checks.collectives"))


def test_around_after_apply_leaves_the_refusals_in_place():
    got = _in_a_child(_around_after_apply)
    assert "error" not in got, got
    assert got["bound"] == "<refused: course_lib.communication_patterns.ring_all_reduce>", got
    assert got["active"] and got["always"], got
    assert got["hooks"] == got["hooks_before"] and got["hooks"].count("_Finder") == 1, got
    assert "[refused] course_lib.communication_patterns.ring_all_reduce" in got["original"], got
    assert "[refused]" in got["checker_module"], got


def _handed_over(spare: bool) -> dict:
    import functools

    from course_lib.classroom.checks import distributed_optimizer

    refusals = _prepared("distributed_optimizer_step")
    make = distributed_optimizer.OPTIMIZERS["Adam"][0]
    summarize = functools.partial(distributed_optimizer._returned_pair)
    one_step = distributed_optimizer._one_step
    refusals.apply(handed_over=(torch.zeros(2), make, [summarize]) if spare else ())
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    optimizer = (make if spare else (lambda params: torch.optim.Adam(params, lr=0.01)))([p])  # unspared: forgotten
    optimizer.step()
    out = dict(one_step=_raises(one_step, make, torch.ones(2), torch.ones(2)),
               summary=_raises(summarize, (p.detach(), optimizer)),
               forgotten=[name for name in ("OPTIMIZERS", "_one_step", "OPT_N") if hasattr(distributed_optimizer, name)],
               kept=[name for name in ("_optimizer_state_elements", "_tensors_in") if hasattr(distributed_optimizer, name)])
    if not out["summary"]:  # it calls _optimizer_state_elements and _tensors_in: spared with it
        summary = summarize((p.detach(), optimizer))
        out.update(state=summary["state"], tensors=len(summary["tensors"]))
    return out


def test_what_the_checker_hands_over_keeps_its_code_and_the_rest_is_disarmed():
    got = _in_a_child(lambda: _handed_over(spare=True))
    assert "error" not in got and got["summary"] == "", got
    assert got["state"] == 8 and got["tensors"] == 3, got  # Adam's two moments of 4 elements, and its step
    assert "[refused] course_lib.classroom.checks.distributed_optimizer._one_step" in got["one_step"], got
    # the module's data and unused helpers are forgotten (no answer key, no fixed case stays reachable); what the
    # spared hook names stays
    assert got["forgotten"] == [] and got["kept"] == ["_optimizer_state_elements", "_tensors_in"], got
    got = _in_a_child(lambda: _handed_over(spare=False))
    assert "[refused] course_lib.classroom.checks.distributed_optimizer._returned_pair" in got["summary"], got


def _copy_of_a_disarmed_reference() -> dict:
    import inspect

    from course_lib.classroom.checks import tamper_guard
    from course_lib.classroom.checks.references import references_for
    from course_lib.moe import router

    source = inspect.getsource(router.switch_load_balancing_loss)  # read before the file rule
    refs = references_for("aux_loss")
    refusals = _prepared("aux_loss")
    refusals.apply()
    space = {"torch": torch}
    exec(source, space)  # noqa: S102 - the course's own source, compiled again: a copy
    scores = torch.softmax(torch.randn(6, 4), -1)
    idx = torch.topk(scores, 2, -1).indices
    run = tamper_guard.run_student(space["switch_load_balancing_loss"], scores, idx, 4, 0.1, references=refs)
    return dict(course_code=run.course_code, original=_raises(router.switch_load_balancing_loss, scores, idx, 4, 0.1))


def test_a_copy_of_a_disarmed_reference_is_still_named():
    got = _in_a_child(_copy_of_a_disarmed_reference)
    assert "error" not in got, got
    assert "[refused] course_lib.moe.router.switch_load_balancing_loss" in got["original"], got
    assert got["course_code"] == ["course_lib.moe.router.switch_load_balancing_loss"], got
