"""The judge: a process the student's code never runs in, where every checker computes its verdict.

A checker cell in the notebook (the kernel) does not run the checker. :func:`ask` hands the judge the
checker's name and its arguments as plain data (:mod:`~course_lib.classroom.checks.plain`); the
student's function travels as its source and the notebook names it uses
(:mod:`~course_lib.classroom.checks.student_code`). The judge is started once per kernel, clean
(``python -I -c 'from ...judge import serve; serve(fd)'``: a fresh interpreter, not a fork of the kernel, so
nothing the kernel patched is there), with torch imported, and each checker's module and references imported
the first time it is asked for (:func:`_load`). For each check it
forks a *check process* that runs the checker as written; there the student's function is a
:class:`StudentFunction`, which runs the student's code only in a *worker*:

* called by the checker directly, each call forks a worker from the check process (the checker's
  arguments are there already, nothing is re-sent), which puts the exercise's refusals in place for
  good (:mod:`~course_lib.classroom.checks.refusals`), rebuilds the function from its text, calls it,
  and sends back the value as plain data (and the tensors it was given, which it may have filled);
* called on a rank of a checker's launch (:func:`~course_lib.classroom.checks.wire.launch_checked`),
  where the student's code must talk on that rank's process group, it runs on the rank, with the
  refusals in place around the call.

The checker computes the truth and the verdict in the check process, on inputs it draws there; its
printed text and the student's ``print`` output stream back to the notebook as they come; the verdict
comes back as JSON on a pipe of its own (:class:`~course_lib.classroom.checks.exercise.Verdict`), and the
judge writes the grading record (:func:`~course_lib.classroom.checks.exercise.write_record`). Nothing the
exercise cell does in the kernel (patching checker modules, ``sys.setprofile``, threads, frames,
``__code__``) reaches the judge, and the checker's frames and truth are not in any process the student's
code runs in -- except the rank processes of a launch, where the student's call runs beside the checker's
rank code: there the refusals hold, and the checker compares with truth it computes after the call.
"""

from __future__ import annotations

import atexit
import builtins
import codecs
import json
import os
import selectors
import signal
import subprocess
import sys
import time
import traceback

import torch

from course_lib.classroom.checks import plain
from course_lib.classroom.checks.refusals import prepare
from course_lib.classroom.checks.student_code import rebuild, resolve, values_of

CALL_TIMEOUT = 120.0
"""Seconds a worker may take for one call of the student's function."""
START_TIMEOUT = 120.0
"""Seconds the judge may take to start (import torch and the checkers)."""
_INSIDE = {"judge": False}
_IN_JUDGE = "COURSE_IN_JUDGE"


def inside() -> bool:
    """True in the judge and the processes it forks (where checkers run as written)."""
    return _INSIDE["judge"]


USE_ENV = "COURSE_JUDGE"


def wanted() -> bool:
    """Whether a checker called here asks the judge: in a notebook's kernel (and ``grade``'s), or where
    :data:`USE_ENV` is ``1``; a test of a checker's logic, in a plain Python process, runs it in-process."""
    return not inside() and (_in_a_kernel() or os.environ.get(USE_ENV) == "1")


def _in_a_kernel() -> bool:
    app = sys.modules.get("ipykernel.kernelapp")
    return app is not None and app.IPKernelApp.initialized()


# =============================================================================== in the judge


class StudentFunction:
    """The student's function as the checker sees it in the judge (see the module docstring)."""

    def __init__(self, captured: dict, exercise: str):
        self.captured, self.exercise = captured, exercise
        self.__name__ = self.__qualname__ = captured.get("name", "your function")
        self.__module__ = "__main__"
        self.refused: list[str] = []
        self._local = None
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
        value = getattr(self._rebuilt(), attr)
        if not callable(value):
            return value

        def method(*args, **kwargs):
            try:
                with self.refusals.around():
                    return value(*args, **kwargs)
            finally:
                self.refused = list(self.refusals.refused)

        return method

    def _rebuilt(self):
        if self._local is None:
            values = values_of(self.captured)
            try:
                with self.refusals.around():
                    self._local = rebuild(self.captured, values)
            finally:
                self.refused = list(self.refusals.refused)
        return self._local

    def _on_rank(self, refusals, args, kwargs):
        fn = self._rebuilt()
        try:
            with refusals.around():
                return fn(*args, **kwargs)
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
        if pid == 0:
            os.close(to_worker)
            os.close(from_worker)
            _kept_worker(self.captured, self.refusals, from_judge, to_judge)
        os.close(from_judge)
        os.close(to_judge)
        self._kept = (pid, os.fdopen(to_worker, "w", encoding="utf-8"), from_worker)

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
        line = _read_line(replies, pid, CALL_TIMEOUT)
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
        self.refused = out.get("refused", [])
        _copy_back(args, plain.decode(out.get("args", [])))
        if "error" in out:
            raise _rebuilt_error(out["error"])
        value = plain.decode(out["value"])
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
        line = _read_line(replies, pid, CALL_TIMEOUT)
        if not line:
            self._kept = None
            raise RuntimeError("your function's backward did not finish")
        out = json.loads(line)
        if "error" in out:
            raise _rebuilt_error(out["error"])
        return plain.decode(out["grads"])

    def _in_forked_worker(self, refusals, args, kwargs):
        sys.stdout.flush()
        sys.stderr.flush()
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the worker
            os.close(read_end)
            _worker(self.captured, refusals, args, kwargs, write_end)
        os.close(write_end)
        data = _read_all(read_end, pid, CALL_TIMEOUT)
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
            value = fn(*args, **kwargs)
            out["value"] = plain.encode(value)
            leaves = _tensor_leaves(args)
            out["args"] = plain.encode([t.detach() for t in leaves])
            inputs = [i for i, t in enumerate(leaves) if t.requires_grad]
            if graphs is not None and inputs and getattr(value, "grad_fn", None) is not None:
                graphs[len(graphs)] = (value, [leaves[i] for i in inputs])
                out["graph"] = {"id": len(graphs) - 1, "inputs": inputs}
        except BaseException as exc:  # noqa: BLE001 - reported to the checker as the student's exception
            out = {"error": {"type": type(exc).__name__, "builtin": getattr(builtins, type(exc).__name__, None)
                             is type(exc), "message": str(exc)[:2000], "traceback": traceback.format_exc()[-4000:]}}
        out["refused"] = list(refusals.refused)
        data = json.dumps(out)
    except BaseException as exc:  # noqa: BLE001 - a value that does not encode
        data = json.dumps({"error": {"type": "TypeError", "builtin": True, "refused": [],
                                     "message": f"the judge could not read what your function returned: {exc}"}})
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
        refusals.apply()
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
        out = {"error": {"type": type(exc).__name__, "builtin": getattr(builtins, type(exc).__name__, None)
                         is type(exc), "message": str(exc)[:2000], "traceback": traceback.format_exc()[-4000:]}}
    return json.dumps(out).encode("utf-8")


def _read_line(fd: int, pid: int, timeout: float) -> bytes | None:
    """One line from a kept worker; b"" when it ended, None (it is killed) past ``timeout``."""
    chunks, deadline = [], time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(fd, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                os.waitpid(pid, 0)
                return b""
            chunks.append(chunk)
            if chunk.endswith(b"\n"):
                return b"".join(chunks)


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


def _rebuilt_error(error: dict) -> BaseException:
    """The student's exception, as an exception of the same name (a builtin type when it was one)."""
    name, message = error.get("type", "Exception"), error.get("message", "")
    cls = getattr(builtins, name, None) if error.get("builtin") else None
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = type(name, (RuntimeError,), {"__module__": "student"})
    try:
        exc = cls(message)
    except Exception:  # noqa: BLE001 - a builtin that wants other arguments
        exc = type(name, (RuntimeError,), {"__module__": "student"})(message)
    exc.student_traceback = error.get("traceback", "")
    return exc


def _read_all(fd: int, pid: int, timeout: float) -> bytes | None:
    """Everything a child writes to ``fd`` until it closes it; None (the child killed) past ``timeout``."""
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


def _decode_arg(data, exercise: str):
    if isinstance(data, dict) and data.get("$") == "student":
        if "error" in data:
            return _Uncapturable(data["error"])
        captured = data["captured"]
        if "ref" in captured and captured["ref"].startswith("course_lib"):
            return resolve(captured["ref"])  # the course's own function: the checker names it
        return StudentFunction(captured, exercise)
    return plain.decode(data)


class _Uncapturable:
    """A function the kernel could not send: every call raises why."""

    def __init__(self, reason: str):
        self.reason = reason
        self.__name__ = "your function"

    def __call__(self, *_args, **_kwargs):
        raise TypeError(self.reason)


def _run_check(request: dict) -> dict:
    """In a check process: run the checker the request names, on its arguments; the verdict as JSON."""
    checker = resolve(request["checker"])
    exercise = request["exercise"]
    args = [_decode_arg(a, exercise) for a in request["args"]]
    kwargs = {k: _decode_arg(v, exercise) for k, v in request["kwargs"].items()}
    return checker(*args, **kwargs).as_json()


def _preload() -> None:
    """Import what every check needs once, before any fork: torch and the checked process group."""
    import torch.distributed  # noqa: F401

    import course_lib.classroom.checks.wire  # noqa: F401


_MEASURED = ("course_lib.classroom.checks.context_parallel",)
"""Checker modules whose ranks measure the largest tensor (:func:`~course_lib.classroom.checks.wire.largest_tensor`)."""


def _load(request: dict) -> None:
    """Import the checker a request names and its exercise's references in the judge itself, before the
    fork: the next check of the notebook finds them imported."""
    from course_lib.classroom.checks.references import REFERENCES, references_for
    from course_lib.classroom.checks.wire import largest_tensor

    checker = resolve(request["checker"])
    if request["exercise"] in REFERENCES:
        references_for(request["exercise"])
    if getattr(checker, "__module__", "") in _MEASURED:
        with largest_tensor():  # its first use imports torch._dynamo: here, once, not on every rank
            pass


def serve(reply_fd: int) -> None:
    """The judge's loop: one JSON request a line on stdin, one verdict a line on ``reply_fd``."""
    _INSIDE["judge"] = True
    _preload()
    reply = os.fdopen(reply_fd, "w", buffering=1, encoding="utf-8")
    reply.write(json.dumps({"ready": os.getpid()}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        try:
            _load(request)
        except Exception:  # noqa: BLE001 - the check process reports it
            pass
        sys.stdout.flush()
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the check process
            os.close(read_end)
            try:
                result = {"verdict": _run_check(request)}
            except BaseException:  # noqa: BLE001 - a checker that raised: said, never a hang
                result = {"crash": traceback.format_exc()[-3000:]}
            sys.stdout.flush()
            sys.stderr.flush()
            os.write(write_end, json.dumps(result).encode("utf-8"))
            os._exit(0)
        os.close(write_end)
        data = _read_all(read_end, pid, request.get("timeout", 1800))
        try:
            result = json.loads(data.decode("utf-8")) if data else {"crash": "the check process ended without a verdict"}
        except ValueError:
            result = {"crash": "the check process wrote an unreadable verdict"}
        sys.stdout.flush()
        reply.write(json.dumps({"id": request["id"], **result}) + "\n")


# =============================================================================== in the kernel


class _Client:
    """The kernel's judge: started on first use, restarted if it died."""

    def __init__(self):
        self.proc = None
        self.reply = None
        self.count = 0

    def start(self) -> None:
        if os.environ.get(_IN_JUDGE):
            raise RuntimeError("a judge does not start judges: this process already runs in one")
        read_end, write_end = os.pipe()
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
        env["PYTHONUNBUFFERED"] = "1"
        env[_IN_JUDGE] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-c", f"from course_lib.classroom.checks.judge import serve; serve({write_end})"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=(write_end,),
            env=env, cwd=os.getcwd(), start_new_session=True)
        os.close(write_end)
        self.reply = read_end
        self.buffer = b""
        atexit.register(self.stop)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:
                pass
            self.proc.wait()
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def ask(self, request: dict, timeout: float) -> dict:
        if not self.alive():
            self.start()
        self.count += 1
        request["id"] = self.count
        self.proc.stdin.write((json.dumps(request) + "\n").encode("utf-8"))
        self.proc.stdin.flush()
        return self._wait(request["id"], timeout)

    def _wait(self, wanted: int, timeout: float) -> dict:
        """Stream the judge's output to this kernel's stdout/stderr until the reply ``wanted`` arrives."""
        streams = {self.proc.stdout.fileno(): (sys.stdout, codecs.getincrementaldecoder("utf-8")("replace")),
                   self.proc.stderr.fileno(): (sys.stderr, codecs.getincrementaldecoder("utf-8")("replace"))}
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            for fd in (*streams, self.reply):
                sel.register(fd, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                events = sel.select(max(0.0, left)) if left > 0 else []
                if not events:
                    self.stop()
                    return {"crash": f"the judge gave no verdict within {timeout:.0f} s"}
                for key, _ in events:
                    chunk = os.read(key.fd, 1 << 16)
                    if key.fd in streams:
                        stream, decoder = streams[key.fd]
                        if chunk:
                            stream.write(decoder.decode(chunk))
                        continue
                    if not chunk:
                        self.stop()
                        return {"crash": "the judge stopped"}
                    self.buffer += chunk
                while b"\n" in self.buffer:
                    line, self.buffer = self.buffer.split(b"\n", 1)
                    message = json.loads(line)
                    if message.get("id") == wanted:
                        self._drain(streams)
                        return message

    @staticmethod
    def _drain(streams) -> None:
        with selectors.DefaultSelector() as sel:
            for fd in streams:
                sel.register(fd, selectors.EVENT_READ)
            while events := sel.select(0):
                for key, _ in events:
                    chunk = os.read(key.fd, 1 << 16)
                    if chunk:
                        stream, decoder = streams[key.fd]
                        stream.write(decoder.decode(chunk))
                    else:
                        sel.unregister(key.fd)
        sys.stdout.flush()


_CLIENT = _Client()


def warm_up() -> None:
    """Start the judge now, in a notebook's kernel (in the background: the notebook goes on while the judge
    imports torch); nothing elsewhere (a test, the judge itself)."""
    if wanted() and not os.environ.get(_IN_JUDGE) and not _CLIENT.alive():
        _CLIENT.start()


def _encode_arg(value):
    import types

    from course_lib.classroom.checks.student_code import CaptureError, capture

    if isinstance(value, (types.FunctionType, type)) and getattr(value, "__module__", None) == "__main__":
        try:
            return {"$": "student", "captured": capture(value)}
        except (CaptureError, SyntaxError, OSError) as exc:
            return {"$": "student", "error": str(exc)}
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, type)):
        try:
            return {"$": "student", "captured": capture(value)}
        except CaptureError:
            pass
    return plain.encode(value)


def ask(checker, exercise: str, args: tuple, kwargs: dict, timeout: float = 1800):
    """Run ``checker(*args, **kwargs)`` in the judge; its output appears here; returns its verdict (a dict:
    ``verdict`` as :meth:`Verdict.as_json`, or ``crash`` with what went wrong)."""
    request = {"checker": f"{checker.__module__}:{checker.__qualname__}", "exercise": exercise,
               "args": [_encode_arg(a) for a in args], "kwargs": {k: _encode_arg(v) for k, v in kwargs.items()},
               "timeout": timeout}
    return _CLIENT.ask(request, timeout + 60)

