"""The student's call on a checked rank, in a process of its own: the wire is recorded where the student's code
cannot reach it.

On a rank of :func:`~course_lib.classroom.checks.wire.launch_checked` the checker's rank code, its recorders
(:func:`~course_lib.classroom.checks.wire.wire_recorder`), the refusal policy
(:func:`~course_lib.classroom.checks.wire.point_to_point_only`) and the real gloo connections live in the rank
process. :func:`run_on_rank` forks a *student process* from it for the student's function (kept for the rank's
next calls of it whose arguments are plain data, see :func:`run_on_rank`):

* the student process keeps stdin/stdout/stderr, two pipes to the rank and the judge's file rule (Landlock)
  and closes every other inherited descriptor: the gloo sockets, the store's, the launcher's pipe. It dies
  with the rank (``PR_SET_PDEATHSIG``, :func:`course_lib.launch.process_tree.die_with_parent`);
* there every checked process group (the default one, and any the checker handed over) becomes a
  :class:`_Forwarding` group: each op -- its name, its tensors as plain tensors, peer, reduce op, split sizes,
  options -- goes over the pipe to the rank, which runs it on the real
  :class:`~course_lib.classroom.checks.wire.CheckedProcessGroup` (recorded and refused there) and sends back
  what it received (the op's output tensors) when the student's ``Work.wait()`` asks for them. Groups the
  student makes with ``dist.new_group`` are made by the rank too (torch asks a Python default group's
  ``new_group``: ``_new_group_with_tag`` in torch/distributed/distributed_c10d.py), so checked as well;
* before its first call the judge's refusals are put in place for good
  (:meth:`~course_lib.classroom.checks.workers.StudentFunction.for_good`, as in the judge's workers: the
  references' and the checkers' code disarmed, the import hook always on; what the checker hands the call or
  runs after it, ``summarize``, spared); the function is called as before
  (:func:`~course_lib.classroom.checks.tamper_guard.run_student`: the references watched, patches undone and
  reported), and what comes back is plain data (:mod:`~course_lib.classroom.checks.plain`, never pickle): the
  value, the error (type name and message), what it patched or refused, and the tensors of its arguments (with
  a module's parameters and gradients), which the rank copies into its own arguments.

So a function that patches ``wire._RECORDERS``, ``wire._POLICY`` or ``CheckedProcessGroup._record`` patches
its own process: the record and the refusals the verdict reads are the rank's, made from what crossed the
pipe. A wire exception (a refused collective, mismatched all-to-all splits) raised in the rank is raised
there again after the call, even when the student's code caught it. The student process is bounded by half the
group's timeout while the rank waits for its next message (a loop that never ends is named as one, before the
launch's deadline would read it as a deadlock).

Code in the function that undoes a refusal there -- puts a reference back, removes the import hook, finds the
reference or a checker function through ``gc`` or a frame -- finds code that refuses
(``tests/classroom/checks/test_student_process.py::test_a_refusal_undone_in_the_student_process_still_refuses``).
Its other ways out are sealed before the student's code runs (:func:`seal`): it opens no socket and starts no
process (seccomp), writes no file and signals no process outside its own (Landlock), so it reaches another rank's
student process only through its rank, and what it computes is in its own memory. With ``peak`` the rank reads how
far that memory grew during the call (``VmHWM`` of ``/proc/<pid>/status``, reset through ``clear_refs`` before the
call, and the growth of ``Private_Dirty`` of ``smaps_rollup``: the pages it held before and wrote, counted
as its own because a twin forked at its start holds every one of them until it ends, :func:`_hold_pages`), out
of the student's reach. What remains in
the student's room: what a checker asks to be measured or read there (``measure``'s largest tensor,
``summarize``), and a refused library imported from disk after removing the import hook where Landlock is missing
(the hook is in the student's own process). The gloo groups it inherited are held, never
used: their sockets are closed there, so an op on one found through ``gc`` waits until the rank's timeout.

Cost: a fork costs about 10 ms of CPU on a rank that has torch loaded (the first touch of the inherited
module dicts -- the patch snapshot -- is most of it), hence the kept process; a forwarded op about 1 ms.

Megatron has no counterpart: this is the course's checker machinery (torch's Python ``ProcessGroup`` and
``Work`` subclasses, as :class:`~course_lib.classroom.checks.wire.CheckedProcessGroup` uses them).
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import errno
import gc
import inspect
import os
import re
import signal
import sys
import threading
import traceback

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d_classes
from torch.distributed import distributed_c10d as c10d
from torch.utils._python_dispatch import _disable_current_modes

from course_lib.classroom.checks import plain, wire
from course_lib.classroom.checks.refusals import Refused
from course_lib.classroom.checks.tamper_guard import LibraryPatched, StudentRun, on_rank_result, run_student
from course_lib.classroom.checks.wire import (CheckedProcessGroup, CollectiveRefused, SplitMismatch, largest_tensor,
                                             student_running, wire_recorder)
from course_lib.classroom.checks.workers import _Lines, _tensor_leaves, _travels, _write_all
from course_lib.classroom.grading import landlock, seccomp
from course_lib.launch.process_tree import die_with_parent, freeze_inherited_objects

__all__ = ["run_on_rank", "student_on_rank", "backward_on_rank", "OPS"]

OPS = ("send", "recv", "recv_anysource", "barrier", "monitored_barrier", "allreduce", "allreduce_coalesced",
       "allgather", "_allgather_base", "all_gather_single", "allgather_coalesced", "allgather_into_tensor_coalesced",
       "all_gather_single_coalesced", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
       "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced", "broadcast", "reduce", "gather",
       "scatter", "alltoall", "alltoall_base", "all_to_all_single")
"""The methods of :class:`~course_lib.classroom.checks.wire.CheckedProcessGroup` a student process forwards."""
_NO_OUTPUT = frozenset({"send", "barrier", "monitored_barrier"})
"""Ops that fill no tensor; every other op fills the tensors of its first argument."""
_OPTIONS = ("AllreduceOptions", "AllreduceCoalescedOptions", "AllgatherOptions", "BroadcastOptions", "ReduceOptions",
            "GatherOptions", "ScatterOptions", "ReduceScatterOptions", "AllToAllOptions", "BarrierOptions")
_OPTION_FIELDS = ("asyncOp", "reduceOp", "rootRank", "rootTensor", "timeout", "device_ids")
_WIRE_ERRORS = (CollectiveRefused, SplitMismatch)
_KNOWN_ERRORS = (CollectiveRefused, SplitMismatch, LibraryPatched, Refused)


class StudentProcessError(RuntimeError):
    """The student process ended, or stopped talking, before the function returned."""


# ------------------------------------------------------------------ plain messages


def _pack(value):
    """An op's argument as plain data: tensors, numbers, lists, and an options object as a tagged dict."""
    if isinstance(value, torch.Tensor) or value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_pack(v) for v in value]
    if isinstance(value, datetime.timedelta):
        return {"$seconds": value.total_seconds()}
    name = type(value).__name__
    if name in _OPTIONS and isinstance(value, getattr(_c10d_classes, name)):
        out = {"$options": name}
        for field in _OPTION_FIELDS:
            if hasattr(value, field):
                got = getattr(value, field)
                if field == "reduceOp":
                    got = str(getattr(got, "op", got)).split(".")[-1]
                out[field] = _pack(got)
        return out
    raise TypeError(f"a {name} cannot be passed to a process group op here: pass tensors, numbers and lists")


def _unpack(value):
    """What :func:`_pack` described, built in the rank: only tensors, numbers, lists and the options classes."""
    if isinstance(value, list):
        return [_unpack(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "$seconds" in value:
        return datetime.timedelta(seconds=float(value["$seconds"]))
    name = value.get("$options")
    if name not in _OPTIONS:
        raise TypeError("an op's argument that is not a tensor, a number, a list or an options object")
    opts = getattr(_c10d_classes, name)()
    for field in _OPTION_FIELDS:
        if field not in value or not hasattr(opts, field):
            continue
        got = value[field]
        if field == "reduceOp":
            if got not in dist.ReduceOp.RedOpType.__members__:
                raise ValueError(f"unknown reduce op {str(got)[:40]!r}")
            got = dist.ReduceOp(getattr(dist.ReduceOp.RedOpType, got))
        elif field == "timeout":
            got = _unpack(got)
        elif field == "device_ids":
            got = [int(i) for i in got]
        elif field == "asyncOp":
            got = bool(got)
        else:
            got = int(got)
        setattr(opts, field, got)
    return opts


def _fill(mine, theirs) -> None:
    """Copy the received tensors ``theirs`` into the op's own output tensors ``mine`` (same order)."""
    with torch.no_grad():
        for t, got in zip(_tensor_leaves(mine), _tensor_leaves(theirs)):
            if got.shape == t.shape:
                t.copy_(got.to(t.dtype))


def _exception(error: dict) -> BaseException:
    """The error the rank or the student process sent (:func:`~course_lib.classroom.checks.plain.error_data`),
    raised again: the wire's, the guard's and the refusals' own classes are kept."""
    return plain.error_from_data(error, known=_KNOWN_ERRORS)


# ------------------------------------------------------------------ the student process's side

_CHANNEL: dict = {}
"""In a student process: ``requests`` (fd to the rank), ``replies`` (a binary reader), ``lock``, ``groups``."""


def _ask(message: dict) -> dict:
    """Send one request to the rank and return its reply (one line each way; one at a time across threads)."""
    with _CHANNEL["lock"]:
        _write_all(_CHANNEL["requests"], (plain.dumps(message) + "\n").encode("utf-8"))
        line = _CHANNEL["replies"].readline()
    if not line:
        os._exit(0)  # the rank has gone: nothing left to answer to
    return plain.loads(line.decode("utf-8"))


class _PipeWork(dist.Work):
    """The student process's handle of an op the rank runs: ``wait()`` asks the rank to finish it and copies
    what it received into the op's output tensors."""

    def __init__(self, work_id: int, outputs):
        super().__init__()
        self._id, self._outputs, self._done, self._source = work_id, outputs, False, -1

    def wait(self, timeout=None):  # noqa: ARG002 - the rank's group timeout bounds it
        with _disable_current_modes():  # the transfer is not the student's computation (largest_tensor)
            reply = _ask({"wait": self._id})
            if "error" in reply:
                raise _exception(reply["error"])
            if self._outputs is not None and reply.get("outputs") is not None:
                _fill(self._outputs, reply["outputs"])
        self._done, self._source = True, int(reply.get("source", -1))
        return True

    def is_completed(self):
        return self._done

    def is_success(self):
        return self._done

    def _source_rank(self):
        return self._source


def _forwarded(name: str):
    def op(self, *args):
        with _disable_current_modes():  # the transfer is not the student's computation (largest_tensor)
            reply = _ask({"op": name, "group": self._gid, "args": [_pack(a) for a in args]})
        if "error" in reply:
            raise _exception(reply["error"])
        return _PipeWork(int(reply["work"]), None if name in _NO_OUTPUT else args[0])

    op.__name__ = op.__qualname__ = name
    return op


class _RanksOnly:
    """What a forwarded group holds in place of its gloo group: the connections are the rank's."""

    def __getattr__(self, attr):
        raise RuntimeError("the gloo group under a checked group belongs to the rank: in your function's process "
                           "every op goes through torch.distributed (dist.send, dist.recv, ...)")


class _Forwarding(CheckedProcessGroup):
    """A checked group as seen from the student process: every op is run by the rank (see the module
    docstring). Inherited groups get this class in place; new groups are made by the rank."""

    _gid = -1

    def new_group(self, ranks, timeout=None, pg_options=None, group_name=None, group_desc=None):  # noqa: ARG002
        """Called by ``dist.new_group`` on a Python default group: the rank makes the group (checked)."""
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else None
        reply = _ask({"new_group": [int(r) for r in ranks] if ranks is not None else None, "timeout": seconds})
        if "error" in reply:
            raise _exception(reply["error"])
        if reply.get("group") is None:
            return None
        group = _Forwarding(_RanksOnly(), int(reply["rank"]), int(reply["size"]), [int(r) for r in reply["ranks"]])
        group._gid = int(reply["group"])
        _CHANNEL["groups"].append(group)  # held here: a group is never destroyed in the student process
        return group


for _name in OPS:
    setattr(_Forwarding, _name, _forwarded(_name))


def _with_groups(value, groups: list):
    """``value`` (decoded plain data) with each ``{"$group": gid}`` replaced by that process group, and each
    ``{"$kept": i}`` by this process's own ``i``-th argument of the first call (a ``state`` the function keeps)."""
    if isinstance(value, list):
        return [_with_groups(v, groups) for v in value]
    if isinstance(value, tuple):
        return tuple(_with_groups(v, groups) for v in value)
    if isinstance(value, dict):
        if set(value) == {"$group"}:
            return groups[int(value["$group"])]
        if set(value) == {"$kept"}:
            return _CHANNEL["first"][int(value["$kept"])]
        return {k: _with_groups(v, groups) for k, v in value.items()}
    return value


def _state(args) -> list:
    """What the function may have changed in its arguments, in order: each tensor, and each module's
    parameters (value and gradient) and buffers."""
    out: list = []
    for arg in args:
        if isinstance(arg, torch.nn.Module):
            out.append({"params": [[p.detach(), p.grad] for p in arg.parameters()],
                        "buffers": [b.detach() for b in arg.buffers()]})
        elif isinstance(arg, (torch.Tensor, list, tuple)):
            out.append([t.detach() for t in _tensor_leaves(arg)])
        else:
            out.append(None)
    return out


def _student_process(fn, args, kwargs, references, measure: bool, peak: bool, summarize, to_rank: int, from_rank: int,
                     keep: set, rank_pid: int) -> None:
    """The student process: its descriptors closed, the groups forwarding, the first call and its reply, then
    the rank's next calls of the same function (plain arguments) until the rank closes the pipe; never returns."""
    try:
        die_with_parent(rank_pid)
        keep = sorted({0, 1, 2, to_rank, from_rank} | {fd for fd in keep if fd >= 0})
        for low, high in zip(keep, keep[1:] + [os.sysconf("SC_OPEN_MAX")]):
            os.closerange(low + 1, high)
        if peak:
            _hold_pages()
        seal()
        groups = list(c10d._world.pg_map)
        _CHANNEL.update(requests=to_rank, replies=os.fdopen(from_rank, "rb"), lock=threading.Lock(), groups=groups)
        for gid, group in enumerate(groups):
            if isinstance(group, CheckedProcessGroup):
                _CHANNEL.setdefault("gloo", []).append(group._inner)  # held: never torn down in this process
                group.__class__ = _Forwarding
                group._gid, group._inner = gid, _RanksOnly()
        _CHANNEL["first"] = list(args) + list(kwargs.values())
        if callable(getattr(fn, "for_good", None)):  # the judge's StudentFunction: the refusals for good
            fn.for_good(handed_over=(*args, *kwargs.values(), summarize))
        if peak:  # the rank reads the memory before the call (_Session.fork), then says go
            _exact_frees()
            _warm(references, measure)
            gc.freeze()  # what the process inherited is left out of its collections: see _peak_end
            held = fn.values_nbytes() if callable(getattr(fn, "values_nbytes", None)) else 0
            _reply(to_rank, plain.dumps({"ready": True, "held": held}))
            with _CHANNEL["lock"]:
                if not _CHANNEL["replies"].readline():
                    return
        _one_call(fn, args, kwargs, references, measure, summarize, to_rank)
        while True:
            with _CHANNEL["lock"]:  # a thread the function left running waits for the next call
                line = _CHANNEL["replies"].readline()
            if not line:
                break
            request = plain.loads(line.decode("utf-8"))
            if "backward" in request:
                _one_backward(request, references, to_rank)
                continue
            args, kwargs = (_with_groups(v, _CHANNEL["groups"]) for v in plain.decode(request["call"]))
            _one_call(fn, args, kwargs, references, bool(request.get("measure")), summarize, to_rank)
    finally:
        os._exit(0)


_GRAPHS: dict = {}
"""In a student process: ``{id: (tensor returned, the argument tensors it has a gradient for)}``, kept for the
rank's backward through it (:class:`_RemoteGrad`)."""


def seal() -> list[str]:
    """In a student process, before the student's code: no new socket and no new process (seccomp; threads still
    start), no file written, no signal out (Landlock), so its only way to the other ranks is the pipe to its rank,
    whose ops are recorded, and what it computes is in its own memory, whose peak its rank reads
    (:func:`_peak_start`; a child's would not count, and ``/proc/self/clear_refs``, which would reset it, is a file
    it cannot write). What was sealed, in words (empty where the kernel has neither)."""
    sealed = ["no new socket"] if seccomp.deny_new_sockets() else []
    sealed += ["no new process"] if seccomp.deny_new_processes() else []
    try:
        sealed += landlock.deny_writes_and_signals()
    except OSError:  # Landlock there but refusing: the sockets are still sealed
        pass
    return sealed


def _one_call(fn, args, kwargs, references, measure: bool, summarize, to_rank: int) -> None:
    """One call of the student's function in the student process, and its reply to the rank."""
    with largest_tensor() if measure else contextlib.nullcontext() as seen:
        run = run_student(fn, *args, references=references, **kwargs)
    done = _report(run)
    if measure:
        done["largest"] = [int(seen.largest), seen.op]
    try:
        if run.error is None:
            done["value"] = plain.encode(run.value if summarize is None else summarize(run.value))
            leaves = _tensor_leaves(list(args) + list(kwargs.values()))
            inputs = [i for i, t in enumerate(leaves) if t.requires_grad]
            if summarize is None and inputs and getattr(run.value, "grad_fn", None) is not None:
                _GRAPHS[len(_GRAPHS)] = (run.value, [leaves[i] for i in inputs])
                done["graph"] = {"id": len(_GRAPHS) - 1, "inputs": inputs}
        done["state"] = plain.encode(_state(list(args) + list(kwargs.values())))
        data = plain.dumps({"done": done})
    except Exception as exc:  # noqa: BLE001 - a value that does not encode
        data = _unsendable(done, "what your function returned", exc)
    _reply(to_rank, data)


def _unsendable(done: dict, what: str, exc: Exception) -> str:
    return plain.dumps({"done": {**done, "error": plain.error_data(TypeError(f"{what} could not be sent back: {exc}"),
                                                                   with_traceback=False)}})


def _reply(to_rank: int, data: str) -> None:
    """The call's reply line to the rank, after what the student printed."""
    sys.stdout.flush()
    sys.stderr.flush()
    _write_all(to_rank, (data + "\n").encode("utf-8"))


_NEW_PROCESS = re.compile(r"\b(fork|forkpty|posix_spawnp?|spawn\w*|Popen|Process|Pool|system|popen|exec\w*)\b")


def _report(run: StudentRun) -> dict:
    """What the rank is told of a call (or a backward) besides its value: patches, course code, the error."""
    done = {"patched": [str(p) for p in run.patched], "course_code": [str(c) for c in run.course_code]}
    if run.error is not None:
        done["error"] = plain.error_data(_named(run.error))
    return done


def _named(error: BaseException) -> BaseException:
    """``error``, or -- for the seal's refusal of a new process (:func:`seal`), a bare ``EPERM`` raised where the
    code starts one -- the same error saying so."""
    if not (isinstance(error, PermissionError) and error.errno == errno.EPERM and error.filename is None):
        return error
    frames = traceback.extract_tb(error.__traceback__)
    if not any(_NEW_PROCESS.search(f"{frame.name} {frame.line or ''}") for frame in frames[-3:]):
        return error
    named = PermissionError(errno.EPERM, "a new process cannot be started where your function runs (its memory "
                                         "would not be your function's): compute in the function's own process")
    named.__traceback__ = error.__traceback__
    return named


def _gradients(value, inputs: list, grad) -> list:
    """The gradients of ``value`` with respect to ``inputs`` for the incoming ``grad`` (None where unused); the
    student's backward code runs here."""
    return list(torch.autograd.grad(value, inputs, grad, allow_unused=True, retain_graph=True))


def _one_backward(request: dict, references, to_rank: int) -> None:
    """The rank's backward through a value this process returned: the gradients for its inputs, as plain data."""
    graph = _GRAPHS.get(int(request["backward"]))
    if graph is None:
        run = StudentRun(error=RuntimeError("no value of this process has that gradient graph"))
    else:
        run = run_student(_gradients, graph[0], graph[1], plain.decode(request["grad"]), references=references)
    done = _report(run)
    try:
        if run.error is None:
            done["grads"] = plain.encode([None if g is None else g.detach() for g in run.value])
        data = plain.dumps({"done": done})
    except Exception as exc:  # noqa: BLE001 - a gradient that does not encode
        data = _unsendable(done, "your backward's gradients", exc)
    _reply(to_rank, data)


# ------------------------------------------------------------------ the rank's side


class _Rank:
    """The rank's side of one call: runs the student process's ops on the real groups and keeps their work."""

    def __init__(self, groups: list):
        self.groups = groups
        self.works: dict = {}
        self.wire_error: BaseException | None = None

    def answer(self, request: dict) -> dict:
        try:
            if "op" in request:
                return self._op(request)
            if "wait" in request:
                return self._wait(int(request["wait"]))
            if "new_group" in request:
                return self._new_group(request)
            raise ValueError("an unknown request")
        except Exception as exc:  # noqa: BLE001 - the op's error goes to the student's code
            if isinstance(exc, _WIRE_ERRORS) and self.wire_error is None:
                self.wire_error = exc
            return {"error": plain.error_data(exc, with_traceback=False)}

    def _group(self, gid) -> CheckedProcessGroup:
        group = self.groups[int(gid)] if 0 <= int(gid) < len(self.groups) else None
        if not isinstance(group, CheckedProcessGroup):
            raise RuntimeError("this process group cannot be used in your function (it is not a checked group)")
        return group

    def _op(self, request: dict) -> dict:
        name = request["op"]
        if name not in OPS:
            raise ValueError(f"an unknown process group op {str(name)[:40]!r}")
        args = _unpack(request["args"])
        work = getattr(self._group(request["group"]), name)(*args)
        self.works[len(self.works)] = (work, name, None if name in _NO_OUTPUT else args[0])
        return {"work": len(self.works) - 1}

    def _wait(self, work_id: int) -> dict:
        work, name, outputs = self.works[work_id]
        work.wait()
        reply: dict = {"outputs": [t.detach() for t in _tensor_leaves(outputs)] if outputs is not None else None}
        if name == "recv_anysource":
            reply["source"] = int(work._source_rank())
        return reply

    def _new_group(self, request: dict) -> dict:
        ranks, seconds = request["new_group"], request.get("timeout")
        kwargs = {"timeout": datetime.timedelta(seconds=float(seconds))} if seconds is not None else {}
        group = dist.new_group([int(r) for r in ranks] if ranks is not None else None, **kwargs)
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            return {"group": None}
        self.groups.append(group)
        return {"group": len(self.groups) - 1, "rank": group.rank(), "size": group.size(),
                "ranks": dist.get_process_group_ranks(group)}


def _apply_state(args, state) -> None:
    """Copy what the student process's arguments hold now into the rank's (see :func:`_state`)."""
    if not isinstance(state, list):
        return
    with torch.no_grad():
        for arg, theirs in zip(args, state):
            if isinstance(arg, torch.nn.Module) and isinstance(theirs, dict):
                for p, pair in zip(arg.parameters(), theirs.get("params", [])):
                    value, grad = (list(pair) + [None, None])[:2]
                    _copy_into(p, value)
                    if grad is None:
                        p.grad = None
                    elif isinstance(grad, torch.Tensor) and grad.shape == p.shape:
                        p.grad = grad.to(p.dtype)
                    else:
                        raise RuntimeError(f"your function left a gradient of shape {tuple(getattr(grad, 'shape', ()))} "
                                           f"on a parameter of shape {tuple(p.shape)}")
                for b, value in zip(arg.buffers(), theirs.get("buffers", [])):
                    _copy_into(b, value)
            elif isinstance(arg, (torch.Tensor, list, tuple)) and isinstance(theirs, list):
                for t, value in zip(_tensor_leaves(arg), theirs):
                    _copy_into(t, value)


def _copy_into(mine: torch.Tensor, theirs) -> None:
    if isinstance(theirs, torch.Tensor) and theirs.shape == mine.shape and theirs.dtype == mine.dtype:
        mine.copy_(theirs)


def _kept_fds(fn) -> set:
    """The judge's file rule (a Landlock ruleset) the student's function applies in its process, if any."""
    ruleset = getattr(getattr(fn, "refusals", None), "ruleset_fd", None)
    return {ruleset()} if callable(ruleset) else set()


def run_on_rank(fn, *args, references=(), measure: bool = False, summarize=None, peak: bool = False,
                **kwargs) -> StudentRun:
    """On a rank of :func:`~course_lib.classroom.checks.wire.launch_checked`: call ``fn(*args, **kwargs)`` in a
    student process of its own (see the module docstring) and return what the call did, as
    :func:`~course_lib.classroom.checks.tamper_guard.run_student` does (``value`` decoded from plain data,
    ``error`` rebuilt with its type name and message, ``patched``, ``course_code``). The tensors in ``args``
    (and a module's parameters, gradients and buffers) are updated with what the function left in them.
    Every op the function issued ran on this rank's groups, so this rank's recorders have it; a refused
    collective or a :class:`~course_lib.classroom.checks.wire.SplitMismatch` raised here comes back as the
    ``error``, even when the student's code caught it. With ``measure``, ``largest`` is
    ``(elements, op)`` of the largest tensor the call computed
    (:func:`~course_lib.classroom.checks.wire.largest_tensor`, measured in the student process). With ``peak``, the
    call runs in a student process forked for it (nothing an earlier call left there serves it), which runs the
    machinery's first-call costs (:func:`_warm`) before the rank reads its memory, and ``peak`` is the bytes that
    memory grew by during the call, read here from ``/proc`` (:func:`_peak_end`; None where ``/proc`` cannot be
    read). With
    ``summarize``, the value is ``summarize(what the function returned)``, computed in the student process after
    the call (its patches undone): for a check that needs some plain data of an object that does not travel
    (an optimizer's state).

    The student process stays for the rank's next call of the same function (same references, the same
    ``summarize``, the same process groups on the rank) whose arguments travel as plain data (tensors, numbers,
    lists, dicts, the rank's process groups, and any argument that is the very object of the first call: a
    ``state`` dict the function keeps is the student process's own, passed again): it runs there, without a new
    fork. Otherwise a new student process is forked (that function's kept one is stopped). A rank keeps up to
    :data:`KEPT_PROCESSES`, one per function, so that values of several (Lab 02's f and g) can still be
    differentiated: a returned tensor that has a gradient with respect to tensors of ``args`` is a
    :class:`_RemoteGrad` here, whose backward runs the student's backward in its process
    (:func:`backward_on_rank`)."""
    session = next((s for s in _KEPT if s.fits(fn, references, summarize)), None)
    request = None if session is None or peak else _call_request(args, kwargs, session, measure)
    if request is None:
        if session is not None:
            session.close()
        session = _Session.fork(fn, args, kwargs, references, measure, summarize, peak)
        _KEPT.append(session)
        while len(_KEPT) > KEPT_PROCESSES:
            _KEPT[0].close()
    done, rank = session.exchange(request)
    memory = _peak_end(session.pid, session.baseline) \
        if peak and session.baseline is not None and not session.closed else None
    session.pg_keys = [id(g) for g in c10d._world.pg_map]
    run = _result(done, rank, args, kwargs, session)
    if memory is not None:
        run.peak, run.written = memory
    return run


def _memory(pid: int, field: str, where: str = "status") -> int | None:
    """``field`` of process ``pid`` in bytes, from ``/proc/<pid>/<where>`` (``status``: ``VmHWM``, the peak resident
    memory; ``smaps_rollup``: ``Private_Dirty``, the pages written by it alone); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/{where}", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _warm(references, measure: bool) -> None:
    """Before the baseline of a ``peak`` call: what every call costs a fresh student process once -- the
    guard's first look at the inherited modules (copies of the pages it touches), the dispatch mode's import,
    the code of torch's common ops, an encoded reply -- so that the call's growth is the student's computation."""
    with largest_tensor() if measure else contextlib.nullcontext():
        run_student(_warm_ops, references=references)
    plain.dumps({"done": {"value": plain.encode(torch.zeros(4))}})


def _warm_ops() -> None:
    """Small versions of the ops an attention runs (matmul, cat, logsumexp, softmax, exp...): their code paged in."""
    a = torch.randn(2, 2, 8, 4, dtype=torch.float64)
    s = torch.matmul(a, torch.cat([a, a], 2).transpose(-1, -2)) * 0.5
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.unsqueeze(-1)) + torch.softmax(s, -1) / s.amax(-1, keepdim=True).clamp_min(1)
    torch.logaddexp(lse, lse).sum() + (torch.matmul(p, torch.cat([a, a], 2)) * 2 - 1).mean()


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _exact_frees() -> None:
    """In a student process whose peak is read: each allocation of a page or more that no free chunk of the heap
    can serve gets pages of its own (glibc's threshold fixed, no longer raised by every free), returned when freed,
    so that its resident memory follows the tensors alive rather than what glibc's heap keeps (the free chunks it
    inherited are served first: see :func:`_trim_free_memory`). The student's code may change it back: glibc
    keeping more only makes it look bigger."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, _PAGE)
        libc.mallopt(_M_TRIM_THRESHOLD, 256 * 1024)


def _trim_free_memory() -> None:
    """On a rank, before it forks a student process whose memory a ``peak`` call reads: give the pages its heap
    holds free back to the system (glibc's ``malloc_trim``). Inherited, they would serve the student's small
    allocations by writing pages it shares (counted as written, not as growth: a full ``make test`` run's pytest
    worker, whose heap the rank inherits, made right rings write 11-21 MiB); given back, those allocations take
    new pages, which count as what they are. Memory in use (a buffer the cell made) is not touched."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _hold_pages() -> None:
    """In a student process whose memory a ``peak`` call reads (before :func:`seal`, which forbids it): fork a
    twin that holds every page this process has, untouched, until this process ends (it is killed with it). A
    page counts in a process's ``Private_Dirty`` once no other process maps it: without the twin, a write by the
    rank (its own copy) or the end of another process that shared the page leaves this process alone with a page
    it never wrote (full ``make test`` runs read 15-26 MiB more than right rings wrote, and refused them). With it,
    a page becomes this process's own only when this process writes it (the write gives the writer a copy). Returns
    once the twin is set up, so that what it writes of its own is written before the baseline."""
    ready_read, ready_write = os.pipe()
    student = os.getpid()
    if os.fork() == 0:
        try:
            die_with_parent(student)
            os.closerange(0, ready_write)
            os.closerange(ready_write + 1, os.sysconf("SC_OPEN_MAX"))
            os.write(ready_write, b"1")
            os.close(ready_write)
            while True:
                signal.pause()
        finally:
            os._exit(0)
    os.close(ready_write)
    os.read(ready_read, 1)
    os.close(ready_read)


def _peak_start(pid: int) -> tuple | None:
    """Before a ``peak`` call of the student process ``pid`` (set up, waiting for the rank's go): reset its peak
    resident memory to what it holds now (``/proc/<pid>/clear_refs``, "5"); ``(that peak, its private dirty
    memory)`` in bytes. Where the reset is refused (the rank under the grader's Landlock) the peak since the fork
    stands in: its setup's, a little above what it holds. The kernel keeps the peak through ``munmap``,
    ``madvise(MADV_DONTNEED)`` and a heap trimmed by ``brk``, so memory the call freed still counts; a thread's
    memory is the process's."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as clear:
            clear.write("5")
    except OSError:
        pass
    peak = _memory(pid, "VmHWM")
    if peak is None:
        return None
    return peak, _memory(pid, "Private_Dirty", "smaps_rollup")


def _peak_end(pid: int, baseline: tuple) -> tuple[int, int] | None:
    """After the measured call: ``(grown, written)`` in bytes. ``grown``: how far the memory grew, the larger of
    the growth of the peak and ``written``, plus the bytes of the student's values the judge decoded there before
    the call (``baseline``: ``(peak, private dirty memory, values)``); ``written``: the memory the process held
    before the call and wrote during it, the growth of its private dirty memory (see :func:`_hold_pages`). The
    pages a fork shares with its rank (a buffer the cell allocated) are counted in the peak already, and a write
    copies them without raising it; the values, a buffer the cell hands over. The student process freezes what it
    holds before the baseline (``gc.freeze``: a collection writes to every object it walks, which would copy every
    inherited page; its code may unfreeze it, and only looks bigger)."""
    peak = _memory(pid, "VmHWM")
    if peak is None:
        return None
    dirty = _memory(pid, "Private_Dirty", "smaps_rollup")
    written = max(0, dirty - baseline[1]) if dirty is not None and baseline[1] is not None else 0
    return max(0, peak - baseline[0], written) + baseline[2], written


KEPT_PROCESSES = 4
"""Student processes a rank keeps at most (the oldest is stopped): one per function the checker calls in turn,
e.g. Lab 02's f and g, whose values the rank's backward still goes through."""
_KEPT: list = []
"""On a rank: the student processes kept for the next calls (:class:`_Session`), oldest first."""


def _call_request(args, kwargs, session: "_Session", measure: bool):
    """A call for the kept student process: the arguments as plain data, each of the rank's process groups as
    ``{"$group": gid}``, an argument that is the very object of the first call (a ``state`` dict the function
    keeps between calls) as ``{"$kept": i}``; None when an argument does not travel (a module, a callback)."""
    def marked(value):
        if isinstance(value, (list, tuple)):
            return type(value)(marked(v) for v in value) if type(value) in (list, tuple) else value
        if isinstance(value, dict):
            return {k: marked(v) for k, v in value.items()}
        for gid, group in enumerate(session.groups):
            if value is group:
                return {"$group": gid}
        return value

    def top(value):
        for i, first in enumerate(session.first):
            if value is first and not isinstance(value, (torch.Tensor, int, float, str, bool)):
                return {"$kept": i}
        return marked(value)

    encoded = plain.encode([[top(a) for a in args], {k: top(v) for k, v in kwargs.items()}])
    return {"call": encoded, "measure": measure} if _travels(encoded) else None


class _Session:
    """The rank's end of a student process: its pid, its pipes, the groups it knows, what it was forked for."""

    def __init__(self, pid: int, to_student: int, from_student: int, fn, references, groups: list, first: list,
                 summarize):
        self.pid, self.to_student, self.lines = pid, to_student, _Lines(from_student)
        self.fn, self.references, self.groups = fn, [id(r) for r in references], groups
        self.first, self.summarize = first, summarize  # the first call's arguments (held: their ids stay theirs)
        self.pg_keys = [id(g) for g in c10d._world.pg_map]
        self.closed = False
        self.baseline: tuple | None = None  # the memory before a peak call: _peak_start's and the values' bytes

    @classmethod
    def fork(cls, fn, args, kwargs, references, measure: bool, summarize, peak: bool = False) -> "_Session":
        """Fork a student process that makes the first call at once (its arguments inherited, not sent)."""
        groups = list(c10d._world.pg_map)
        keep = _kept_fds(fn)
        sys.stdout.flush()
        sys.stderr.flush()
        from_student, to_rank = os.pipe()
        from_rank, to_student = os.pipe()
        rank_pid = os.getpid()
        if peak:
            _trim_free_memory()
        pid = os.fork()
        if pid == 0:
            freeze_inherited_objects()
            os.close(from_student)
            os.close(to_student)
            _student_process(fn, args, kwargs, references, measure, peak, summarize, to_rank, from_rank, keep,
                             rank_pid)
        os.close(to_rank)
        os.close(from_rank)
        session = cls(pid, to_student, from_student, fn, references, groups, list(args) + list(kwargs.values()),
                      summarize)
        if peak:
            session.measure_first_call()
        return session

    def measure_first_call(self) -> None:
        """The forked student process has set itself up and waits: its memory now is the first call's baseline."""
        try:
            line = self.lines.next(max(2.0, wire.group_timeout() / 2))
            ready = plain.loads(line.decode("utf-8")) if line else None
            if not isinstance(ready, dict) or "ready" not in ready:
                raise StudentProcessError("the student process ended before its first call")
            start = _peak_start(self.pid)
            self.baseline = None if start is None else (*start, int(ready.get("held") or 0))
            _write_all(self.to_student, b"{}\n")
        except BaseException:
            self.close()
            raise

    def fits(self, fn, references, summarize) -> bool:
        """Whether a call of ``fn`` with ``references`` and ``summarize`` can run here (the rank's groups
        unchanged since). A bound method fits when it binds the same function to the same object
        (``cls.apply`` is a new bound method at each lookup)."""
        same = self.fn is fn or (inspect.ismethod(fn) and inspect.ismethod(self.fn) and self.fn == fn)
        return (not self.closed and same and self.summarize is summarize
                and self.references == [id(r) for r in references] and self.pg_keys == [id(g) for g in c10d._world.pg_map])

    def backward(self, graph: int, grad) -> list:
        """The gradients, for the inputs it recorded, of the value ``graph`` this student process returned
        (:class:`_RemoteGrad`): its backward runs there, its ops on this rank's groups (recorded here)."""
        if self.closed:
            raise StudentProcessError("the student process that computed this value has ended (the checker "
                                      "called other functions since)")
        done, rank = self.exchange({"backward": graph, "grad": grad})
        _BACKWARDS.append(done)
        if rank.wire_error is not None:
            raise rank.wire_error
        if isinstance(done.get("error"), dict):
            raise _exception(done["error"])
        return plain.decode(done.get("grads"))

    def exchange(self, request) -> tuple:
        """Send ``request`` (None: the forked call already runs), run the ops the student process asks for until
        it is done: ``(its reply, the _Rank that ran the ops)``. Any failure stops the student process."""
        try:
            if request is not None:
                _write_all(self.to_student, (plain.dumps(request) + "\n").encode("utf-8"))
            rank = _Rank(self.groups)
            with student_running():
                done = self.serve(rank)
        except BaseException:
            self.close()
            raise
        return (done if isinstance(done, dict) else {}), rank

    def serve(self, rank: "_Rank") -> dict:
        """Run the ops the student process asks for until its call is done; its reply."""
        # Half the group's timeout, so that a function that loops says so before the launch's deadline (which
        # counts from the start, and would be read as the ranks waiting for each other: a deadlock).
        timeout = max(2.0, wire.group_timeout() / 2)
        while True:
            line = self.lines.next(timeout)
            if line is None:
                raise TimeoutError(f"your function neither returned nor sent anything for {timeout:g} s: is there "
                                   f"a loop that never ends?")
            if not line:
                raise StudentProcessError("your function ended its process (os._exit, sys.exit, a crash or a "
                                          "signal) before it returned")
            request = plain.loads(line.decode("utf-8"))
            if not isinstance(request, dict):
                raise StudentProcessError("your function's process sent something unreadable")
            if "done" in request:
                return request["done"]
            _write_all(self.to_student, (plain.dumps(rank.answer(request)) + "\n").encode("utf-8"))

    def close(self) -> None:
        """Stop the student process and close the pipes (it is not kept)."""
        if self.closed:
            return
        self.closed = True
        _stop(self.pid)
        self.lines.selector.close()
        os.close(self.lines.fd)
        os.close(self.to_student)
        if self in _KEPT:
            _KEPT.remove(self)


class _RemoteGrad(torch.autograd.Function):
    """A value a student process returned, on the rank: its backward runs in that process
    (:meth:`_Session.backward`), so the rank's wire recorders see the ops of the student's backward apart from
    those of its forward. Inputs: the session, the graph's id, the value, then the rank's argument tensors it has
    a gradient for."""

    @staticmethod
    def forward(ctx, session, graph, value, *inputs):
        ctx.session, ctx.graph, ctx.shapes = session, graph, [(t.shape, t.dtype) for t in inputs]
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        grads = ctx.session.backward(ctx.graph, grad)
        if not isinstance(grads, list) or len(grads) != len(ctx.shapes):
            raise StudentProcessError("your backward did not return one gradient per input")
        out = []
        for got, (shape, dtype) in zip(grads, ctx.shapes):
            if got is not None and not (isinstance(got, torch.Tensor) and got.shape == shape):
                raise RuntimeError(f"your backward returned a gradient of shape {tuple(getattr(got, 'shape', ()))} "
                                   f"for an input of shape {tuple(shape)}")
            out.append(None if got is None else got.detach().to(dtype))
        return (None, None, None, *out)


_BACKWARDS: list = []
"""On a rank: what each student process reported of the backwards it ran (see :func:`backward_on_rank`)."""


def backward_on_rank(value: torch.Tensor, grad: torch.Tensor) -> StudentRun:
    """``value.backward(grad)`` on the rank, where ``value`` came (through the rank's own operations) from
    values of :func:`run_on_rank`: each student process runs its part of the backward, so the rank's recorders
    see those ops. Returns the :class:`~course_lib.classroom.checks.tamper_guard.StudentRun` of the backward:
    ``error`` (never raised), ``patched`` and ``course_code`` as the student processes reported them."""
    del _BACKWARDS[:]
    run = StudentRun()
    try:
        value.backward(grad)
    except Exception as exc:  # noqa: BLE001 - the student's backward raised: reported to the checker
        run.error = exc
    for done in _BACKWARDS:
        run.patched += [str(p) for p in done.get("patched", [])][:20]
        run.course_code += [str(c) for c in done.get("course_code", [])][:20]
    return run


def _result(done: dict, rank: _Rank, args, kwargs, session: _Session) -> StudentRun:
    run = StudentRun(patched=[str(p) for p in done.get("patched", [])][:20],
                     course_code=[str(c) for c in done.get("course_code", [])][:20])
    largest = done.get("largest")
    if isinstance(largest, list) and len(largest) == 2:
        run.largest = (int(largest[0]), None if largest[1] is None else str(largest[1]))
    if rank.wire_error is not None:
        run.error = rank.wire_error
    elif isinstance(done.get("error"), dict):
        run.error = _exception(done["error"])
    else:
        run.value = plain.decode(done.get("value"))
        graph = done.get("graph")
        if isinstance(graph, dict) and isinstance(run.value, torch.Tensor):
            leaves = _tensor_leaves(list(args) + list(kwargs.values()))
            inputs = [leaves[int(i)] for i in graph.get("inputs", []) if 0 <= int(i) < len(leaves)]
            run.value = _RemoteGrad.apply(session, int(graph["id"]), run.value.detach(), *inputs)
    try:
        _apply_state(list(args) + list(kwargs.values()), plain.decode(done.get("state")))
    except Exception as exc:  # noqa: BLE001 - what the function left in its arguments does not fit them
        if run.error is None:
            run.error = exc
    return run


def _stop(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def student_on_rank(fn, *args, references=(), measure: bool = False, raw: bool = False, peak: bool = False) -> dict:
    """``fn(*args)`` called in a student process of its own (:func:`run_on_rank`), the ops recorded here: the dict of
    :func:`course_lib.classroom.checks.tamper_guard.on_rank_result`; the tensors of ``args`` come back, ``raw``
    is the value as plain data, ``largest`` is measured in the student process; with ``peak``, ``peak`` is read
    by the rank (see :func:`run_on_rank`)."""
    with wire_recorder() as rec:
        run = run_on_rank(fn, *args, references=references, measure=measure, peak=peak)
    return on_rank_result(run, rec, measure, raw)
