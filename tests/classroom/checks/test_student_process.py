"""The student's call on a checked rank runs in a student process of its own
(course_lib/classroom/checks/student_process.py): what it does to the rank's recorders, the refusal policy or the
checked group's code stays in its own process, the verdict reads what crossed the pipe, and the student process
never outlives its rank.

The forgeries below pass the ring checker when the student's function runs in the rank's own interpreter (they
did before the student process: each gets the sum from one all-reduce and writes ring-shaped sends into the
rank's recorders); with the student process the all-reduce is refused by the rank and the forged record is the
student process's own.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

from course_lib.classroom.checks.collectives import check_ring_all_reduce
from course_lib.launch.process_tree import is_running


def _forge_ring_sends(n: int) -> None:
    """Append to every active wire recorder the sends a ring all-reduce of ``n`` elements makes on this rank."""
    from course_lib.classroom.checks import wire
    from course_lib.comm import CommEvent

    w, r = dist.get_world_size(), dist.get_rank()
    sizes = [c.numel() for c in torch.tensor_split(torch.empty(n), w)]
    for rec in wire._RECORDERS:
        for chunk in [(r - s) % w for s in range(w - 1)] + [(r + 1 - s) % w for s in range(w - 1)]:
            rec.events.append(CommEvent(op="send", kind="world", group_size=w, numel=sizes[chunk],
                                        bytes=4 * sizes[chunk], direction="fwd", source="process_group",
                                        peer=(r + 1) % w, rank=r))
            rec.carried.append(None)


def policy_off_and_record_patched(x):
    """The refusal policy switched off and CheckedProcessGroup._record made a no-op around one all_reduce, then
    ring-shaped sends written into the recorders."""
    from course_lib.classroom.checks import wire

    rule, wire._POLICY["p2p_only"] = wire._POLICY["p2p_only"], None
    record = wire.CheckedProcessGroup._record
    wire.CheckedProcessGroup._record = lambda *args, **kwargs: None
    try:
        y = x.clone()
        dist.all_reduce(y)
    finally:
        wire.CheckedProcessGroup._record = record
        wire._POLICY["p2p_only"] = rule
    _forge_ring_sends(x.numel())
    return y


def gloo_under_the_checked_group(x):
    """The all-reduce on the gloo group the checked group wraps (its ``_inner``), then ring-shaped sends written
    into the recorders."""
    y = x.clone()
    inner = dist.distributed_c10d._get_default_group()._inner
    inner.allreduce([y], dist.AllreduceOptions()).wait()
    _forge_ring_sends(x.numel())
    return y


def recorders_replaced(x):
    """The recorders taken away during an all-reduce (``wire._RECORDERS`` emptied, the policy off), then
    ring-shaped sends written into them."""
    from course_lib.classroom.checks import wire

    saved = list(wire._RECORDERS)
    wire._RECORDERS.clear()
    rule, wire._POLICY["p2p_only"] = wire._POLICY["p2p_only"], None
    try:
        y = x.clone()
        dist.all_reduce(y)
    finally:
        wire._RECORDERS.extend(saved)
        wire._POLICY["p2p_only"] = rule
    _forge_ring_sends(x.numel())
    return y


FORGERIES = [policy_off_and_record_patched, gloo_under_the_checked_group, recorders_replaced]


@pytest.mark.parametrize("forgery", FORGERIES, ids=[f.__name__ for f in FORGERIES])
def test_a_function_that_forges_the_rank_s_wire_record_is_judged_by_what_crossed(forgery, capsys):
    verdict = check_ring_all_reduce(forgery)
    out = capsys.readouterr().out
    assert not verdict.ok, out
    assert "✓" not in out and "✗ with 2 ranks, rank" in out, out


def _rank_sleeper(path):
    from course_lib.classroom.checks.student_process import run_on_rank

    return run_on_rank(_writes_its_pids_and_sleeps, path).value


def _writes_its_pids_and_sleeps(path):
    with open(path + ".tmp", "w") as f:
        f.write(f"{os.getpid()} {os.getppid()}")
    os.replace(path + ".tmp", path)
    time.sleep(120)


def _wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads process states from /proc")
def test_the_student_process_does_not_outlive_a_killed_rank(tmp_path):
    from course_lib.classroom.checks.wire import launch_checked
    from course_lib.launch import RankError

    path = str(tmp_path / "pids")
    failure: list = []

    def launch():
        try:
            launch_checked(_rank_sleeper, 1, timeout=60, path=path)
        except RankError as err:
            failure.append(err)

    thread = threading.Thread(target=launch, daemon=True)
    thread.start()
    assert _wait_for(lambda: os.path.exists(path), 60), "the student process never started"
    student, rank = map(int, open(path).read().split())
    assert student != rank and is_running(student) and is_running(rank)
    os.kill(rank, signal.SIGKILL)
    assert _wait_for(lambda: not is_running(student), 10), "the student process outlived its rank"
    thread.join(30)
    assert not thread.is_alive() and failure and "SIGKILL" in str(failure[0]), failure


FORGED_THROUGH_THE_JUDGE = '''
import torch
import torch.distributed as dist

def my_ring_all_reduce(x):
    group = dist.distributed_c10d._get_default_group()
    checked = next(c for c in type(group).__mro__ if c.__name__ == "CheckedProcessGroup")
    wire = checked._record.__globals__             # the recorder's module, reached without an import
    w, r = dist.get_world_size(), dist.get_rank()
    saved, rule = list(wire["_RECORDERS"]), wire["_POLICY"]["p2p_only"]
    wire["_RECORDERS"].clear()
    wire["_POLICY"]["p2p_only"] = None
    try:
        y = x.clone()
        dist.all_reduce(y)
    finally:
        wire["_RECORDERS"].extend(saved)
        wire["_POLICY"]["p2p_only"] = rule
    sizes = [c.numel() for c in torch.tensor_split(x, w)]
    for rec in wire["_RECORDERS"]:
        for chunk in [(r - s) % w for s in range(w - 1)] + [(r + 1 - s) % w for s in range(w - 1)]:
            rec.events.append(wire["CommEvent"](op="send", kind="world", group_size=w, numel=sizes[chunk],
                                                bytes=4 * sizes[chunk], direction="fwd", peer=(r + 1) % w, rank=r))
            rec.carried.append(None)
    return y
'''


def test_through_the_judge_a_forged_wire_record_fails_too(monkeypatch):
    """The same forgery from a notebook cell, checked by the judge (the student's refusals in place): the
    recorder's module reached through a method's ``__globals__`` is the student process's copy."""
    import linecache

    monkeypatch.setenv("COURSE_JUDGE", "1")  # as in a notebook's kernel
    filename = "/tmp/ipykernel_0/forged_wire.py"  # a cell's text is read from linecache, as in a kernel
    linecache.cache[filename] = (0, None, FORGED_THROUGH_THE_JUDGE.splitlines(True), filename)
    space = {"__name__": "__main__"}
    exec(compile(FORGED_THROUGH_THE_JUDGE, filename, "exec"), space)  # noqa: S102 - the test's own cell
    verdict = check_ring_all_reduce(space["my_ring_all_reduce"])
    assert not verdict.ok and "ran a collective" in verdict.hint, verdict


def _pair_group_and_ring_step(x):
    """A new group of ranks 0 and 1 (rank 2 is not in it), an all-reduce on it, then one isend/irecv step
    around the world ring: ops the student process forwards, each recorded by its rank."""
    w, r = dist.get_world_size(), dist.get_rank()
    pair = dist.new_group([0, 1])
    y = x.clone()
    if r in (0, 1):
        dist.all_reduce(y, group=pair)
    incoming = torch.empty_like(x)
    reqs = [dist.isend(x, (r + 1) % w), dist.irecv(incoming, (r - 1) % w)]
    for req in reqs:
        req.wait()
    return y, incoming


def _catches_the_refusal(x):
    try:
        dist.all_reduce(x)
    except Exception:  # noqa: BLE001 - a student who hides the refusal
        pass
    return x


def _raises(x):
    raise ValueError(f"my own message for {x.numel()} elements")


def _rank_mechanics():
    from course_lib.classroom.checks.student_process import run_on_rank
    from course_lib.classroom.checks.wire import point_to_point_only, wire_recorder

    r = dist.get_rank()
    x = torch.full((3,), float(2 * r + 1))  # 1, 3, 5
    with wire_recorder() as rec:
        run = run_on_rank(_pair_group_and_ring_step, x)
    ops = [(e.op, e.kind, e.peer) for e in rec.events]
    with point_to_point_only("send/recv only"):
        caught = run_on_rank(_catches_the_refusal, x.clone())
    raised = run_on_rank(_raises, x)
    return dict(value=run.value, error=run.error, ops=ops, caught=(type(caught.error).__name__, str(caught.error)),
                raised=(type(raised.error).__name__, str(raised.error)))


def test_the_rank_runs_what_the_student_process_asks_for():
    from course_lib.classroom.checks.wire import REFUSED_MARK, launch_checked

    for r, got in enumerate(launch_checked(_rank_mechanics, 3, timeout=30)):
        assert got["error"] is None, got["error"]
        summed, incoming = got["value"]
        assert torch.equal(summed, torch.full((3,), 4.0 if r < 2 else 5.0)), (r, summed)  # 1 + 3 on the pair
        assert torch.equal(incoming, torch.full((3,), float(2 * ((r - 1) % 3) + 1))), (r, incoming)
        expected = ([("all_reduce", "ranks 0,1", None)] if r < 2 else []) + [("send", "world", (r + 1) % 3),
                                                                               ("recv", "world", (r - 1) % 3)]
        assert got["ops"] == expected, (r, got["ops"])
        assert got["caught"][0] == "CollectiveRefused" and REFUSED_MARK in got["caught"][1], got["caught"]
        assert got["raised"] == ("ValueError", "my own message for 3 elements"), got["raised"]


def _pid_of(_arg):
    return os.getpid()


def _rank_pids():
    from course_lib.classroom.checks.student_process import run_on_rank

    x = torch.zeros(2)
    pids = [run_on_rank(_pid_of, x).value, run_on_rank(_pid_of, [x, 1.5, {"k": x}]).value]
    pids.append(run_on_rank(_pid_of, torch.nn.Linear(1, 1)).value)   # a module does not travel: a new fork
    dist.new_group([0, 1])                                            # a group the student process does not know
    pids.append(run_on_rank(_pid_of, x).value)
    return os.getpid(), pids


def test_the_student_process_is_kept_for_calls_whose_arguments_are_plain_data():
    from course_lib.classroom.checks.wire import launch_checked

    for rank_pid, (first, again, module, after_new_group) in launch_checked(_rank_pids, 2, timeout=30):
        assert rank_pid not in (first, again, module, after_new_group)
        assert first == again and len({first, module, after_new_group}) == 3, (first, again, module, after_new_group)


UNDONE_IN_ITS_OWN_PROCESS = {
    "the original found with gc, the profile off": ('''
import gc
import sys

def my_ring_all_reduce(x):
    sys.setprofile(None)                                  # the course-code watcher of its own process
    ring = next(o for o in gc.get_objects() if callable(o) and getattr(o, "__qualname__", "") == "ring_all_reduce"
                and getattr(o, "__module__", "") == "course_lib.communication_patterns")
    return ring(x)
''', "ring_all_reduce"),
    "the refusals undone: bindings put back, the import hook removed": ('''
import gc
import sys

def my_ring_all_reduce(x):
    sys.setprofile(None)
    refusals = next(o for o in gc.get_objects() if type(o).__name__ == "Refusals")
    sys.meta_path[:] = [f for f in sys.meta_path if type(f).__name__ != "_Finder"]
    for owner, attr, original, _ in refusals._stubs:
        setattr(owner, attr, original)
    from course_lib.communication_patterns import ring_all_reduce
    return ring_all_reduce(x)
''', "ring_all_reduce"),
}


@pytest.mark.parametrize("what", list(UNDONE_IN_ITS_OWN_PROCESS))
def test_a_refusal_undone_in_the_student_process_still_refuses(what, monkeypatch):
    """Through the judge, a function that undoes the refusals in its own process (the student process applies
    them for good, as the off-rank worker does: the references' code is disarmed there) gets no answer from the
    course's ring: it is refused, and the verdict names it."""
    import linecache

    monkeypatch.setenv("COURSE_JUDGE", "1")
    source, named = UNDONE_IN_ITS_OWN_PROCESS[what]
    filename = f"/tmp/ipykernel_0/undone_{list(UNDONE_IN_ITS_OWN_PROCESS).index(what)}.py"
    linecache.cache[filename] = (0, None, source.splitlines(True), filename)
    space = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), space)  # noqa: S102 - the test's own cell
    verdict = check_ring_all_reduce(space["my_ring_all_reduce"])
    assert not verdict.ok, (what, verdict.hint)
    assert named in verdict.hint and "[refused]" in verdict.hint, (what, verdict.hint)
