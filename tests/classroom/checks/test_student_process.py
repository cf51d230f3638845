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
import platform
import signal
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from course_lib.classroom.checks.collectives import check_ring_all_reduce
from course_lib.classroom.checks.distributed_optimizer import ADAM as _ADAM
from course_lib.classroom.grading import landlock
from course_lib.launch.process_tree import is_running, wait_gone
from test_lab02_checks import F_ok  # this folder is on sys.path (no __init__.py): Lab 02's right f


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

    with open(path + ".tmp", "w") as f:  # the rank writes its pid: a student process writes no file
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    return run_on_rank(time.sleep, 120).value


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/status") as f:
                ppid = next(int(line.split()[1]) for line in f if line.startswith("PPid:"))
        except (OSError, ValueError, StopIteration):
            continue
        if ppid == pid:
            found.append(int(entry))
    return found


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
    assert _wait_for(lambda: os.path.exists(path), 60), "the rank never started"
    rank = int(open(path).read())
    assert _wait_for(lambda: _children(rank), 30), "the student process never started"
    student = _children(rank)[0]
    assert is_running(student) and is_running(rank)
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


class _GGathersAndForgesAnAllReduce(torch.autograd.Function):
    """Lab 02's g with the wrong wire (an all-gather and a sum by hand: t times the traffic), whose forward then
    rewrites the rank's recorders to show the one all-reduce of its input that g should have run."""

    @staticmethod
    def forward(ctx, x, group):
        from course_lib.classroom.checks import wire
        from course_lib.comm import CommEvent

        pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(pieces, x.contiguous(), group=group)
        w = dist.get_world_size(group)
        for rec in wire._RECORDERS:
            del rec.events[-1:], rec.carried[-1:]
            rec.events.append(CommEvent(op="all_reduce", kind="world", group_size=w, numel=x.numel(),
                                        bytes=4 * x.numel(), direction="fwd", reduce_op="sum",
                                        source="process_group", rank=dist.get_rank()))
            rec.carried.append(x.detach().clone())
        return sum(pieces)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def test_lab02_f_and_g_run_in_their_own_process_so_a_forged_forward_record_fails(capsys):
    """f and g's forward and backward run in student processes (the backward through the rank's
    ``backward_on_rank``): a g that all-gathers and then writes an all-reduce into the recorders passed when g
    ran in the rank's interpreter; now the rank records the all-gather it really forwarded."""
    from course_lib.classroom.checks.tp_communication import check_f_g

    verdict = check_f_g(F_ok, _GGathersAndForgesAnAllReduce)
    out = capsys.readouterr().out
    assert not verdict.ok and "g's forward pass is exactly one all-reduce" in out, out


def _zero1_all_reduce_then_forged(params, grads, dp_group, state):
    """Lab 07's zero1_step with plain data parallelism's wire (an all-reduce of the whole gradient, hidden from
    the rank's recorders), then Adam on this rank's shard only, a real all-gather of it, and a reduce-scatter
    of the padded gradients written into the recorders."""
    from course_lib.classroom.checks import wire
    from course_lib.comm import CommEvent

    d, r = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    flat_g = torch.cat([g.reshape(-1) for g in grads])
    n = flat_g.numel()
    size = -(-n // d)
    saved = list(wire._RECORDERS)
    wire._RECORDERS.clear()
    try:
        summed = flat_g.clone()
        dist.all_reduce(summed, group=dp_group)
    finally:
        wire._RECORDERS.extend(saved)
    padded_g = torch.nn.functional.pad(flat_g, (0, size * d - n))
    for rec in wire._RECORDERS:
        rec.events.append(CommEvent(op="reduce_scatter", kind="world", group_size=d, numel=size * d,
                                    bytes=8 * size * d, direction="fwd", dtype="float64", reduce_op="sum",
                                    source="process_group", rank=r))
        rec.carried.append(padded_g.clone())
    if "shard" not in state:
        flat_p = torch.nn.functional.pad(torch.cat([p.reshape(-1) for p in params]), (0, size * d - n))
        state["shard"] = flat_p[r * size:(r + 1) * size].clone().requires_grad_()
        state["adam"] = torch.optim.Adam([state["shard"]], **_ADAM)
    state["shard"].grad = torch.nn.functional.pad(summed / d, (0, size * d - n))[r * size:(r + 1) * size].clone()
    state["adam"].step()
    pieces = [torch.empty(size, dtype=flat_g.dtype) for _ in range(d)]
    dist.all_gather(pieces, state["shard"].detach().clone(), group=dp_group)
    flat = torch.cat(pieces)[:n]
    out, at = [], 0
    for p in params:
        out.append(flat[at:at + p.numel()].reshape(p.shape))
        at += p.numel()
    return out


def test_lab07_zero1_step_runs_in_its_own_process_so_a_hidden_all_reduce_is_seen(capsys):
    """zero1_step runs in a student process kept for its two calls (``state`` stays there): an all-reduce hidden
    by emptying the recorders, and a reduce-scatter written into them, passed when the function ran in the rank's
    interpreter; now the rank records the all-reduce it forwarded."""
    from course_lib.classroom.checks.distributed_optimizer import check_zero1_step

    verdict = check_zero1_step(_zero1_all_reduce_then_forged)
    out = capsys.readouterr().out
    assert not verdict.ok and "an all-reduce gives every rank the whole gradient" in out, out


def _ways_out(path):
    """In the student process: a socket of each kind, a file written, a signal to the rank; what each gave."""
    import socket

    tries = {"tcp": lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM),
             "udp": lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM),
             "unix pair": socket.socketpair,
             "file": lambda: open(path, "w"),
             "signal to the rank": lambda: os.kill(os.getppid(), 0)}
    got = {}
    for name, attempt in tries.items():
        try:
            attempt()
            got[name] = "allowed"
        except OSError as exc:
            got[name] = type(exc).__name__
    return got


def _rank_ways_out(path):
    from course_lib.classroom.checks.student_process import run_on_rank

    return run_on_rank(_ways_out, path).value, _ways_out(path + ".rank")


@pytest.mark.skipif(not (sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")
                         and landlock.abi_version() >= 6), reason="seccomp and Landlock (ABI >= 6) on Linux")
def test_a_student_process_opens_no_socket_writes_no_file_and_signals_no_one(tmp_path):
    """Its only way to another rank's student process is the pipe to its rank: a socket, a file both could read or
    a signal would be a channel the rank never records. The rank itself keeps them all."""
    from course_lib.classroom.checks.wire import launch_checked

    [(student, rank)] = launch_checked(_rank_ways_out, 1, timeout=30, path=str(tmp_path / "channel"))
    assert student == {"tcp": "PermissionError", "udp": "PermissionError", "unix pair": "PermissionError",
                       "file": "PermissionError", "signal to the rank": "PermissionError"}, student
    assert set(rank.values()) == {"allowed"}, rank
    assert not (tmp_path / "channel").exists()


_CELL_BUFFER: list = []
"""Memory the 'cell' touched before the check (filled by the test): inherited by the rank and its student process."""
_KEPT_BUFFER: list = []
"""Memory a call keeps for the next call of the same function, where that call runs in the same process."""


def _hides_its_memory():
    """Allocates 64 MiB and frees it, then tries the ways a peak could leave the process's count."""
    big = torch.ones(8 << 20, dtype=torch.float64)
    del big
    got = {}
    for name, attempt in {"new process": os.fork, "peak reset": lambda: open("/proc/self/clear_refs", "w").write("5")
                          }.items():
        try:
            if attempt() == 0:
                os._exit(0)
            got[name] = "allowed"
        except OSError as exc:
            got[name] = type(exc).__name__
    ran = []
    worker = threading.Thread(target=lambda: ran.append(torch.zeros(4).sum()))
    worker.start()
    worker.join()
    got["thread"] = "allowed" if ran else "refused"
    return got


def _writes_what_it_inherited():
    _CELL_BUFFER[0].fill_(3.0)


def _writes_what_it_kept():
    if not _KEPT_BUFFER:
        _KEPT_BUFFER.append(torch.empty(8 << 20, dtype=torch.float64))
    _KEPT_BUFFER[0].fill_(4.0)


def _rank_measures_its_student():
    from course_lib.classroom.checks.student_process import run_on_rank

    freed = run_on_rank(_hides_its_memory, peak=True)
    inherited = run_on_rank(_writes_what_it_inherited, peak=True)
    run_on_rank(_writes_what_it_kept)
    kept = run_on_rank(_writes_what_it_kept, peak=True)  # a process of its own: the first call's buffer is not there
    return freed.value, freed.peak, inherited.peak, kept.peak


@pytest.mark.skipif(not (sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")
                         and landlock.abi_version() >= 6), reason="seccomp and Landlock (ABI >= 6) on Linux")
def test_the_rank_reads_the_student_process_peak_memory_which_it_cannot_hide():
    """With ``peak`` the rank reads how far the student process's memory grew during the call (/proc/<pid>/status
    VmHWM, reset through clear_refs before the call, and the pages it wrote, smaps_rollup's Private_Dirty), in a
    process forked for the call: memory freed before returning counts, inherited memory it wrote counts (a buffer
    the cell touched: a write copies it without raising the peak), and a buffer an earlier call kept is not there.
    The process can start threads but no new process (whose memory would be its own) and cannot reset its own peak
    (clear_refs is a file it cannot write)."""
    from course_lib.classroom.checks.wire import launch_checked

    _CELL_BUFFER.append(torch.ones(8 << 20, dtype=torch.float64))  # 64 MiB, touched before the fork
    try:
        [(tried, freed, inherited, kept)] = launch_checked(_rank_measures_its_student, 1, timeout=30)
    finally:
        _CELL_BUFFER.clear()
    assert tried == {"new process": "PermissionError", "peak reset": "PermissionError", "thread": "allowed"}, tried
    for name, grew in {"freed": freed, "inherited": inherited, "kept": kept}.items():
        assert 62 << 20 <= grew < 70 << 20, (name, grew)  # 64 MiB each, give or take the call's own pages


UNDONE_IN_ITS_OWN_PROCESS = {
    "the original found with gc, the profile off": ('''
import gc
import sys

def is_the_ring(o):
    try:  # a refused name's stand-in raises on any attribute: a careful cheat steps over it
        return callable(o) and o.__qualname__ == "ring_all_reduce" and o.__module__ == "course_lib.communication_patterns"
    except Exception:
        return False

def my_ring_all_reduce(x):
    sys.setprofile(None)                                  # the course-code watcher of its own process
    ring = next(o for o in (gc.unfreeze() or gc.get_objects()) if is_the_ring(o))
    return ring(x)
''', "ring_all_reduce"),
    "the refusals undone: bindings put back, the import hook removed": ('''
import gc
import sys

def my_ring_all_reduce(x):
    sys.setprofile(None)
    refusals = next(o for o in (gc.unfreeze() or gc.get_objects()) if type(o).__name__ == "Refusals")
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


def _loops_forever(x):
    while True:
        time.sleep(0.5)


def test_a_function_that_loops_is_named_as_one_not_as_a_deadlock(capsys):
    """A student process silent for half the group's timeout: the rank says the function never returned, before
    the launch's deadline would call it the ranks waiting for each other."""
    verdict = check_ring_all_reduce(_loops_forever, timeout=8)
    out = capsys.readouterr().out
    assert not verdict.ok and "is there a loop that never ends?" in out, out


def test_written_memory_is_the_pages_the_process_itself_copied_not_those_another_process_wrote():
    """The memory case's count of held pages written, the growth of ``Private_Dirty``: a page the process shares
    with its parent, written by the parent, would be the child's alone afterwards and count (full ``make test``
    runs refused right rings that way), but the child's twin (``_hold_pages``) still maps it; shared pages the
    child writes (copies) count. The twin ends with the child."""
    import numpy as np

    from course_lib.classroom.checks.student_process import _hold_pages, _memory

    size = 32 << 20
    parents, childs = np.ones(size // 8), np.ones(size // 8)  # written before the fork: shared, not the child's
    go_read, go_write = os.pipe()
    done_read, done_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(go_write)
            os.close(done_read)
            _hold_pages()
            os.write(done_write, str(os.getpid()).encode() + b"\n")
            os.read(go_read, 1)
            childs[:] = 3.0                      # the child writes these pages: its own copies
            os.write(done_write, b"1")
            os.read(go_read, 1)
        finally:
            os._exit(0)
    os.close(go_read)
    os.close(done_write)
    try:
        os.read(done_read, 64)
        twins = [int(p) for p in open(f"/proc/{pid}/task/{pid}/children").read().split()]
        dirty = _memory(pid, "Private_Dirty", "smaps_rollup")
        parents[:] = 2.0                         # the parent writes: the twin still shares the originals
        assert _memory(pid, "Private_Dirty", "smaps_rollup") - dirty < 0.05 * size
        os.write(go_write, b"1")
        os.read(done_read, 1)
        assert 0.95 * size <= _memory(pid, "Private_Dirty", "smaps_rollup") - dirty < 1.1 * size
    finally:
        os.close(go_write)                       # the child's reads return: it ends
        os.waitpid(pid, 0)
        os.close(done_read)
    assert len(twins) == 1 and wait_gone(twins, timeout=5) == []
