"""Where the student's code runs in the judge: :class:`StudentFunction`, the checker's stand-in for the
student's function, and the worker processes it runs the code in.

In a check process (:mod:`~course_lib.classroom.checks.judge`) the checker calls a :class:`StudentFunction`:

* off the ranks, the call goes to the check's *kept worker*, forked when the function arrived -- before the
  checker ran, so no frame of the checker (its truth, its cases) is on the stack it inherits; it keeps only
  its pipes and the file rule open, puts the exercise's refusals in place for good
  (:mod:`~course_lib.classroom.checks.refusals`), rebuilds the function from its text
  (:func:`~course_lib.classroom.checks.student_code.rebuild`), and answers one call per request: the
  arguments and the value travel as plain data (:mod:`~course_lib.classroom.checks.plain`), the tensors it
  was given come back (it may fill them), and a returned tensor with a gradient keeps its graph there: its
  backward in the checker asks the worker (:class:`_RemoteGrad`). Arguments that are not plain data
  (a module, a callback) go to a worker forked for that one call instead -- that worker inherits the
  check process's stack, the checker's frames included (the one place off the ranks where it does);
* on a rank of the checker's launch, where the code must talk on that rank's process group, it runs where the
  rank calls it -- in a student process forked from the rank
  (:mod:`~course_lib.classroom.checks.student_process`), which applies the refusals for good first
  (:meth:`StudentFunction.for_good`), or on the rank itself for the checkers that still call it there -- with
  the refusals in place around the call (and around each method of a student's class).

What the code refused is kept in ``refused``; :func:`~course_lib.classroom.checks.tamper_guard.run_student`
reports it even when the student's code caught the exception.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import sys
import time

import torch

from course_lib.classroom.checks import plain
from course_lib.classroom.checks.refusals import prepare
from course_lib.classroom.checks.student_code import rebuild, values_of
from course_lib.classroom.checks.tamper_guard import undo_patches
from course_lib.launch.process_tree import freeze_inherited_objects

CALL_TIMEOUT = 120.0
"""Seconds a worker may take for one call of the student's function."""


class StudentFunction:
    """The student's function as the checker sees it in the judge (see the module docstring)."""

    def __init__(self, captured: dict, exercise: str):
        self.captured, self.exercise = captured, exercise
        self.__name__ = self.__qualname__ = captured.get("name", "your function")
        self.__module__ = "__main__"
        self.refused: list[str] = []
        self.patched: list[str] = []  # what the last call in a worker replaced in the course or torch (undone)
        self.returned = None  # what the last call in a worker returned (a review's answers go to the instructor)
        self._local = self._values = None
        self._kept = None
        self.refusals = prepare(exercise)  # here, before the checker runs (and watches what runs in a call)
        self.refusals.prepare_files()
        self._start_kept_worker()

    def __repr__(self) -> str:
        return f"<your function {self.__name__}>"

    def __call__(self, *args, **kwargs):
        refusals = self.refusals
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            return self._on_rank(refusals, args, kwargs)
        return self._in_worker(refusals, args, kwargs)

    def __getattr__(self, attr):
        """An attribute of the student's class (``CopyToTensorParallelRegion.apply``), on a rank: the class is
        rebuilt there, and a method runs with the refusals in place."""
        if attr.startswith("__") or not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            raise AttributeError(attr)
        methods = self.__dict__.setdefault("_methods", {})
        if attr in methods:  # the same object at each lookup: a rank keeps one student process per function
            return methods[attr]
        value = getattr(self._rebuilt(), attr)
        if not callable(value):
            return value

        def method(*args, **kwargs):
            try:
                with self.refusals.around():
                    return value(*args, **kwargs)
            finally:
                self.refused = method.refused = list(self.refusals.refused)

        method.refusals, method.refused = self.refusals, []  # what run_student and a student process read
        method.for_good = self.for_good
        methods[attr] = method
        return method

    def for_good(self, handed_over: tuple = ()) -> None:
        """In a process that runs nothing but this function's calls from now on (the student process forked from a
        rank): the refusals applied for good (:meth:`~course_lib.classroom.checks.refusals.Refusals.apply`;
        ``handed_over``: what the checker gives the call or runs after it there), the plain values the function
        uses decoded before them, as in a worker; the first call rebuilds the function under them. Code in the
        function that undoes a refusal in its process finds the references' and the checkers' code disarmed."""
        if self._local is None and self._values is None:
            try:
                self._values = values_of(self.captured)
            except Exception:  # noqa: BLE001 - decoded again by the first call, which reports the error
                pass
        self.refusals.apply(handed_over=handed_over)

    def values_nbytes(self) -> int:
        """Bytes of the tensors and arrays among the plain values the function uses, as :meth:`for_good` decoded
        them here (0 before): memory the call holds from the start, which a rank reading the call's growth adds."""
        total, stack = 0, [self._values]
        while stack:
            value = stack.pop()
            if isinstance(value, torch.Tensor):
                total += value.untyped_storage().nbytes()
            elif isinstance(value, (bytes, bytearray, str)) or type(value).__name__ == "ndarray":
                total += getattr(value, "nbytes", len(value))
            elif isinstance(value, dict):
                stack += list(value.values())
            elif isinstance(value, (list, tuple)):
                stack += list(value)
        return total

    def _rebuilt(self):
        if self._local is None:
            values = values_of(self.captured) if self._values is None else self._values
            try:
                with self.refusals.as_student():
                    self._local = rebuild(self.captured, values)
            finally:
                self.refused = list(self.refusals.refused)
        return self._local

    def _on_rank(self, refusals, args, kwargs):
        fn = self._rebuilt()
        try:
            with refusals.around():
                return fn(*args, **kwargs)
        except BaseException as exc:
            refusals.note_denied(exc)
            raise
        finally:
            self.refused = list(refusals.refused)

    def _in_worker(self, refusals, args, kwargs):
        encoded = plain.encode([list(args), kwargs])
        if _travels(encoded):
            return self._in_kept_worker(encoded, args)
        return self._in_forked_worker(refusals, args, kwargs)

    def _start_kept_worker(self) -> None:
        """Fork the kept worker now, before the checker runs: no frame of the checker (its truth, its cases) is
        on the stack the worker inherits."""
        sys.stdout.flush()
        sys.stderr.flush()
        from_judge, to_worker = os.pipe()
        from_worker, to_judge = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker keeps stdin/out/err, its two pipes and the file rule, nothing else
            freeze_inherited_objects()
            keep = sorted({0, 1, 2, from_judge, to_judge, self.refusals.ruleset_fd()} - {-1})
            for low, high in zip(keep, keep[1:] + [os.sysconf("SC_OPEN_MAX")]):
                os.closerange(low + 1, high)
            _kept_worker(self.captured, self.refusals, from_judge, to_judge)
        os.close(from_judge)
        os.close(to_judge)
        self._kept = (pid, os.fdopen(to_worker, "w", encoding="utf-8"), _Lines(from_worker))

    def _in_kept_worker(self, encoded, args):
        """One call in the check's kept worker (its arguments sent as plain data)."""
        if self._kept is None:
            raise RuntimeError("your function ended its process (os._exit, a crash or a signal) in an earlier call")
        pid, requests, replies = self._kept
        try:
            requests.write(json.dumps(encoded) + "\n")
            requests.flush()
        except BrokenPipeError:
            self._kept = None
            raise RuntimeError("your function ended its process (os._exit, a crash or a signal)") from None
        line = _kept_reply(pid, replies)
        if line is None:
            self._kept = None
            raise TimeoutError(f"your function did not return within {CALL_TIMEOUT:.0f} s (is there a loop "
                               f"that never ends, or a receive nobody sends to?)")
        if not line:
            self._kept = None
            raise RuntimeError("your function ended its process (os._exit, a crash or a signal) before it "
                               "returned")
        return self._reply(json.loads(line), args)

    def _reply(self, out: dict, args):
        self.refused, self.patched = out.get("refused", []), out.get("patched", [])
        _copy_back(args, plain.decode(out.get("args", [])))
        if "error" in out:
            raise plain.error_from_data(out["error"])
        value = self.returned = plain.decode(out["value"])
        if "graph" in out:  # a tensor with a gradient: backward asks the worker, where its graph lives
            leaves = _tensor_leaves(args)
            inputs = [leaves[i] for i in out["graph"]["inputs"]]
            value = _RemoteGrad.apply(self, out["graph"]["id"], value.detach(), *inputs)
        return value

    def _remote_backward(self, graph: int, grad) -> list:
        if self._kept is None:
            raise RuntimeError("the worker that computed this value has ended")
        pid, requests, replies = self._kept
        requests.write(json.dumps({"backward": graph, "grad": plain.encode(grad)}) + "\n")
        requests.flush()
        line = _kept_reply(pid, replies)
        if not line:
            self._kept = None
            raise RuntimeError("your function's backward did not finish")
        out = json.loads(line)
        if "error" in out:
            raise plain.error_from_data(out["error"])
        return plain.decode(out["grads"])

    def _in_forked_worker(self, refusals, args, kwargs):
        sys.stdout.flush()
        sys.stderr.flush()
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker
            freeze_inherited_objects()
            os.close(read_end)
            _worker(self.captured, refusals, args, kwargs, write_end)
        os.close(write_end)
        data = _read_from(read_end, pid, CALL_TIMEOUT)
        if data is None:
            raise TimeoutError(f"your function did not return within {CALL_TIMEOUT:.0f} s (is there a loop "
                               f"that never ends, or a receive nobody sends to?)")
        try:
            out = json.loads(data.decode("utf-8"))
        except ValueError:
            raise RuntimeError("your function ended its process (os._exit, a crash or a signal) before it "
                               "returned") from None
        return self._reply(out, args)


class _RemoteGrad(torch.autograd.Function):
    """The student's tensor in the check process; its backward runs in the worker that made it."""

    @staticmethod
    def forward(ctx, fn, graph, value, *inputs):
        ctx.fn, ctx.graph = fn, graph
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return (None, None, None, *ctx.fn._remote_backward(ctx.graph, grad))


def _travels(encoded) -> bool:
    """True when nothing in ``encoded`` is an :class:`~course_lib.classroom.checks.plain.Opaque` stand-in."""
    if isinstance(encoded, list):
        return all(_travels(v) for v in encoded)
    if isinstance(encoded, dict):
        if encoded.get("$") in ("opaque", "dataclass"):
            return False
        return all(_travels(v) for v in encoded.values())
    return True


class _Rebuild:
    """The student's function still to be rebuilt (in the worker, after the refusals)."""

    def __init__(self, captured: dict, values: dict):
        self.captured, self.values = captured, values

    def __call__(self):
        return rebuild(self.captured, self.values)


def _one_call(fn_or_captured, refusals, args, kwargs, graphs=None) -> tuple:
    """Call the student's function (rebuilt first when given its description); the reply as bytes. With
    ``graphs`` (a dict), a returned tensor that has a gradient with respect to the arguments is kept there,
    for :func:`_kept_worker` to run its backward."""
    fn = None
    out: dict = {}
    try:
        try:
            fn = fn_or_captured() if isinstance(fn_or_captured, _Rebuild) else fn_or_captured
            with undo_patches() as patched:  # said to the checker as in its own process (run_student)
                value = fn(*args, **kwargs)
            out["patched"] = patched
            out["value"] = plain.encode(value)
            leaves = _tensor_leaves(args)
            out["args"] = plain.encode([t.detach() for t in leaves])
            inputs = [i for i, t in enumerate(leaves) if t.requires_grad]
            if graphs is not None and inputs and getattr(value, "grad_fn", None) is not None:
                graphs[len(graphs)] = (value, [leaves[i] for i in inputs])
                out["graph"] = {"id": len(graphs) - 1, "inputs": inputs}
        except BaseException as exc:  # noqa: BLE001 - reported to the checker as the student's exception
            refusals.note_denied(exc)
            out = {"error": plain.error_data(exc)}
        out["refused"] = list(refusals.refused)
        data = json.dumps(out)
    except BaseException as exc:  # noqa: BLE001 - a value that does not encode
        data = json.dumps({"error": plain.error_data(TypeError(f"the judge could not read what your function "
                                                               f"returned: {exc}"), with_traceback=False)})
    sys.stdout.flush()
    sys.stderr.flush()
    return fn, data.encode("utf-8")


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _worker(captured, refusals, args, kwargs, write_end) -> None:
    """A worker for one call: refusals, the function rebuilt, the call, the reply; never returns."""
    try:
        values = values_of(captured)
        refusals.apply(handed_over=(*args, *kwargs.values()))
        _write_all(write_end, _one_call(_Rebuild(captured, values), refusals, args, kwargs)[1])
    finally:
        os._exit(0)


def _kept_worker(captured, refusals, read_fd: int, write_fd: int) -> None:
    """The check's kept worker: refusals once, then one call per request line (plain arguments); never returns."""
    try:
        values = values_of(captured)
        refusals.apply()
        rebuilt = _Rebuild(captured, values)
        fn, graphs = rebuilt, {}
        with os.fdopen(read_fd, "r", encoding="utf-8") as requests:
            for line in requests:
                request = json.loads(line)
                if isinstance(request, dict) and "backward" in request:
                    data = _backward(graphs, request)
                else:
                    args, kwargs = plain.decode(request)
                    fn, data = _one_call(fn, refusals, args, kwargs, graphs)
                    fn = rebuilt if fn is None else fn
                _write_all(write_fd, data + b"\n")
    finally:
        os._exit(0)


def _backward(graphs: dict, request: dict) -> bytes:
    """The gradients of a kept value with respect to the arguments that required them (None where unused)."""
    try:
        value, inputs = graphs[request["backward"]]
        grads = torch.autograd.grad(value, inputs, plain.decode(request["grad"]), allow_unused=True,
                                    retain_graph=True)
        out = {"grads": plain.encode(list(grads))}
    except BaseException as exc:  # noqa: BLE001 - the student's backward raised
        out = {"error": plain.error_data(exc)}
    return json.dumps(out).encode("utf-8")


def _tensor_leaves(value, found=None) -> list:
    """The tensors in ``value`` (nested lists, tuples, dicts), in order: a worker sends them back, since
    an exercise may fill the tensors it was given."""
    found = [] if found is None else found
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensor_leaves(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _tensor_leaves(v, found)
    return found


def _copy_back(args, returned: list) -> None:
    for mine, theirs in zip(_tensor_leaves(args), returned):
        if isinstance(theirs, torch.Tensor) and theirs.shape == mine.shape and theirs.dtype == mine.dtype:
            with torch.no_grad():
                mine.copy_(theirs)


def _read_from(fd: int, pid: int, timeout: float) -> bytes | None:
    """What child ``pid`` writes to ``fd`` until it closes it (then ``fd`` is closed and the child reaped); None
    -- the child killed -- past ``timeout``."""
    chunks, deadline = [], time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                os.close(fd)
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
    os.close(fd)
    os.waitpid(pid, 0)
    return b"".join(chunks)


class _Lines:
    """Lines from a child's pipe (the kept worker's replies, a student process's requests), each waited for at
    most ``timeout`` seconds."""

    def __init__(self, fd: int):
        self.fd, self.buffer = fd, b""
        self.selector = selectors.DefaultSelector()
        self.selector.register(fd, selectors.EVENT_READ)

    def next(self, timeout: float):
        """The next line; b"" when the pipe closed first; None past ``timeout``."""
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not self.selector.select(left):
                return None
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                return b""
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line

    def close(self) -> None:
        self.selector.close()
        os.close(self.fd)


def _kept_reply(pid: int, replies: _Lines):
    """The kept worker's next reply line; None past :data:`CALL_TIMEOUT` (the worker killed), b"" when it ended
    first (reaped, its pipe closed)."""
    line = replies.next(CALL_TIMEOUT)
    if line is None:
        os.kill(pid, signal.SIGKILL)
    if not line:
        os.waitpid(pid, 0)
        replies.close()
    return line
