"""The judge: a process the student's code never runs in, where every checker computes its verdict.

A checker cell in the notebook (the kernel) does not run the checker: the kernel's side
(:mod:`~course_lib.classroom.checks.judge_client`) hands the judge the checker's name and its arguments as
plain data (:mod:`~course_lib.classroom.checks.plain`), the student's function as its source and the
notebook names it uses (:mod:`~course_lib.classroom.checks.student_code`). The judge is started once per
kernel, clean (``python -I -c 'from ...judge import serve; serve(fd)'``: a fresh interpreter, not a fork of
the kernel, so nothing the kernel patched is there), with torch imported; a checker's module and its
exercise's references are imported the first time it is asked for (:func:`_load`). For each check it forks
a *check process* that runs the checker as written. There the student's function is a
:class:`~course_lib.classroom.checks.workers.StudentFunction`: its code runs only in worker processes, or
on the checker's ranks, with the exercise's answer refused (:mod:`~course_lib.classroom.checks.refusals`).

The checker computes the truth and the verdict in the check process, on inputs it draws there; its printed
text and the student's ``print`` output stream back to the notebook as they come; the verdict comes back as
JSON on a pipe of its own, and the judge itself writes the grading record
(:mod:`~course_lib.classroom.checks.records`; no check process holds the record file), with the answers in
prose of a review exercise for the instructor (:func:`_prose`). What a check process of Lab 10 drew and launched
comes back with it and stays in the judge for the next checks (:data:`_KEEPS`), never sent to the kernel. A request comes from the kernel, where the
student's code runs: it can name only a checker, and the judge works out the exercise -- and so what the
student's function is refused -- from the checker's own arguments. Under ``grade`` the judge is not started
by the kernel but forked by the sandbox (:mod:`course_lib.classroom.grading.sandbox`). Nothing the exercise cell does in the kernel (patching
checker modules, ``sys.setprofile``, threads, frames, ``__code__``) reaches the judge, and the checker's
frames and truth are in no process the student's code runs in. On the ranks of a launch the checkers call the
student in a student process forked from the rank (:mod:`~course_lib.classroom.checks.student_process`: its ops
are run and recorded by the rank, the refusals hold there for good), and compare with truth they compute after
the call.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

from course_lib.classroom.checks import plain, records
from course_lib.classroom.checks.judge_client import _INSIDE
from course_lib.classroom.checks.refusals import private_tempdir
from course_lib.classroom.checks.student_code import resolve
from course_lib.classroom.checks.workers import StudentFunction, _read_from, _write_all
from course_lib.launch.process_tree import freeze_inherited_objects, take_std_streams


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
        self.__module__ = "__main__"  # the student's, not the course's (a course function's verdict names it)

    def __call__(self, *_args, **_kwargs):
        raise TypeError(self.reason)


_CHECKS = "course_lib.classroom.checks."


def _checker(name: str):
    """The checker ``"module:qualname"`` names: an ``@exercise`` checker of the checks package, nothing else (a
    request is written by the kernel, where the student's code runs: it names no other function to call)."""
    if not name.startswith(_CHECKS) or ":" not in name:
        raise ValueError(f"the judge runs only the course's checkers, not {name[:100]!r}")
    checker = resolve(name)
    if not callable(getattr(checker, "exercise_of", None)):
        raise ValueError(f"{name[:100]!r} is not a checker")
    return checker


def _exercise(checker, request: dict) -> str:
    """The exercise the request's checker grades, from its own arguments (never from the request's word: the
    exercise decides what the student's function is refused)."""
    def plain_only(data):
        return None if isinstance(data, dict) and data.get("$") == "student" else plain.decode(data)

    return checker.exercise_of(*[plain_only(a) for a in request["args"]],
                               **{k: plain_only(v) for k, v in request["kwargs"].items()})


def _run_check(request: dict) -> dict:
    """In a check process: run the checker the request names, on its arguments; the verdict as JSON."""
    checker = _checker(request["checker"])
    exercise = _exercise(checker, request)
    args = [_decode_arg(a, exercise) for a in request["args"]]
    kwargs = {k: _decode_arg(v, exercise) for k, v in request["kwargs"].items()}
    verdict = checker(*args, **kwargs).as_json()
    returned = [getattr(a, "returned", None) for a in (*args, *kwargs.values()) if isinstance(a, StudentFunction)]
    prose = _prose(exercise, returned[0] if returned else None)
    return {**verdict, "prose": prose} if prose else verdict


PROSE_LIMIT = 4000
"""Characters of one prose answer a verdict carries to the instructor."""


def _prose(exercise: str, answers) -> dict:
    """The answers in free prose of a review exercise (``my_answers_NN``, ``my_conclusions``), as the student's
    function returned them: no checker passes or fails them, ``grade`` hands them to the instructor. Which
    answers are prose is read from the questions: :class:`~course_lib.classroom.checks.review.Prose` where a
    lab's questions are typed (:data:`~course_lib.classroom.checks.review.QUESTIONS`), else every answer in
    words (Labs 05, 09 and 10 ask only for prose)."""
    from course_lib.classroom.checks import review

    if not isinstance(answers, dict) or not (exercise.startswith("my_answers_") or exercise == "my_conclusions"):
        return {}
    typed = review.QUESTIONS.get(exercise.removeprefix("my_answers_"))
    keys = [k for k, spec in typed.items() if isinstance(spec, review.Prose)] if typed else list(answers)
    return {str(k): answers[k][:PROSE_LIMIT] for k in keys if isinstance(answers.get(k), str)}


def _preload() -> None:
    """Import what every check needs once, before any fork: torch, the checked process group, and what a launch
    of ranks imports first (:data:`course_lib.launch.fork.IMPORTED_BEFORE_THE_FORKS`: 0.3 s of CPU that every
    check process launching ranks, a fresh fork of the judge, paid again)."""
    import torch.distributed  # noqa: F401

    import course_lib.classroom.checks.wire  # noqa: F401
    from course_lib.launch.fork import import_before_the_forks

    import_before_the_forks()


_MEASURED = ("course_lib.classroom.checks.context_parallel",)
"""Checker modules whose ranks measure the largest tensor (:func:`~course_lib.classroom.checks.wire.largest_tensor`)."""


def _load(request: dict) -> None:
    """Import the checker a request names and its exercise's references in the judge itself, before the
    fork: the next check of the notebook finds them imported."""
    from course_lib.classroom.checks.references import REFERENCES, references_for
    from course_lib.classroom.checks.wire import largest_tensor

    checker = _checker(request["checker"])
    exercise = _exercise(checker, request)
    if exercise in REFERENCES:
        references_for(exercise)
    if getattr(checker, "__module__", "") in _MEASURED:
        with largest_tensor():  # its first use imports torch._dynamo: here, once, not on every rank
            pass


_KEEPS = ("course_lib.classroom.checks.deepspeed",)
"""Checker modules whose check processes hand the judge what they drew and launched (``kept_for_the_run``), for the
run's next checks (``keep_for_the_run``): Lab 10's two wire exercises are judged on one launch."""


def _kept(request: dict) -> dict:
    """In a check process, after its checker: ``{module: data}`` its module keeps for the judge (plain data)."""
    module = sys.modules.get(getattr(_checker(request["checker"]), "__module__", ""))
    if module is None or module.__name__ not in _KEEPS:
        return {}
    return {module.__name__: module.kept_for_the_run()}


def _keep(kept) -> None:
    """In the judge: hand each module of :data:`_KEEPS` what its check process kept (never sent to the kernel)."""
    for name, data in (kept.items() if isinstance(kept, dict) else ()):
        if name in _KEEPS and name in sys.modules and isinstance(data, dict):
            sys.modules[name].keep_for_the_run(data)


def _record(request: dict, result: dict) -> None:
    """The grading record of one check, written by the judge itself, with the cell the kernel said it ran in."""
    if "verdict" in result:
        verdict = result["verdict"]
    else:
        try:
            exercise = _exercise(_checker(request["checker"]), request)
        except Exception:  # noqa: BLE001 - a request that names no checker has no exercise to record
            return
        verdict = {"ok": False, "exercise": exercise, "evidence": {},
                   "hint": f"the checker could not finish: {str(result.get('crash', '')).strip()[-900:]}"}
    records.write_record({"verdict": verdict, "cell": request.get("cell")})


def serve(reply_fd: int, requests=None) -> None:
    """The judge's loop: one JSON request a line on ``requests`` (default stdin), one reply a line on
    ``reply_fd``. The grading record of each check is written here (:func:`_record`): a check process, where
    the student's code runs (on ranks, in the student processes of the checker's ranks), holds no record file."""
    _INSIDE["judge"] = True
    _preload()
    records.verdict_file()  # opened here, before any check process (each drops it)
    private_tempdir()   # made once here, removed when stdin closes: the forked check processes end by os._exit
    reply = os.fdopen(reply_fd, "w", buffering=1, encoding="utf-8")
    for line in requests if requests is not None else sys.stdin:
        try:
            request = json.loads(line)
            request_id = request["id"]
        except (ValueError, TypeError, KeyError):
            continue
        try:
            _load(request)
        except Exception:  # noqa: BLE001 - the check process reports it
            pass
        freeze_inherited_objects()  # the check process, and the ranks it forks, never walk what the judge holds
        sys.stdout.flush()
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the check process: the kernel's channels and the record file closed
            os.close(read_end)
            reply.close()
            records.forget()
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            try:
                result = {"verdict": _run_check(request), "keep": _kept(request)}
            except BaseException:  # noqa: BLE001 - a checker that raised: said, never a hang
                result = {"crash": traceback.format_exc()[-3000:]}
            sys.stdout.flush()
            sys.stderr.flush()
            _write_all(write_end, json.dumps(result).encode("utf-8"))
            os._exit(0)
        os.close(write_end)
        timeout = request.get("timeout", 1800)
        data = _read_from(read_end, pid, timeout if isinstance(timeout, (int, float)) else 1800)
        try:
            result = json.loads(data.decode("utf-8")) if data else {"crash": "the check process ended without a verdict"}
        except ValueError:
            result = {"crash": "the check process wrote an unreadable verdict"}
        if not isinstance(result, dict) or not isinstance(result.get("verdict", {}), dict):
            result = {"crash": "the check process wrote an unreadable verdict"}
        _keep(result.pop("keep", None))  # the checker's data: kept here, never sent to the kernel
        _record(request, result)
        sys.stdout.flush()
        reply.write(json.dumps({"id": request_id, **result}) + "\n")
    if requests is None:    # the kernel closed our input (it ends): clean up and leave at once -- tearing down an
        _leave()            # interpreter that holds torch takes a second, which every kernel's exit would wait for


def serve_forks(listener_fd: int, parent: int) -> None:
    """The loop of a test session's judge server (:mod:`.judge_server`; its own interpreter, started clean by
    pytest): import what a judge imports, then fork a judge per request, which serves a kernel as :func:`serve`."""
    import shutil
    import signal
    import socket

    from course_lib.launch.process_tree import die_with_parent

    listener = socket.socket(fileno=listener_fd)
    folder = os.path.dirname(listener.getsockname())

    def leave(*_) -> None:  # the parent ended without stopping us (killed): remove what it made for us
        shutil.rmtree(folder, ignore_errors=True)
        os._exit(0)

    signal.signal(signal.SIGTERM, leave)
    die_with_parent(parent, signal.SIGTERM)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the judges are reaped by no one: none stays a zombie here
    _preload()
    freeze_inherited_objects()
    while True:
        conn, _ = listener.accept()
        with conn:
            try:
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 4)
                request = json.loads(message)
            except (OSError, ValueError):
                continue
            if len(fds) != 4:
                for fd in fds:
                    os.close(fd)
                continue
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                _be_the_judge(request, fds)
            for fd in fds:
                os.close(fd)
            try:
                conn.send(json.dumps({"pid": pid}).encode())
            except OSError:
                pass


def _be_the_judge(request: dict, fds: list[int]) -> None:
    """In a child the server forked: take the kernel's pipes, directory and environment, and serve as its judge."""
    import signal
    import tempfile

    try:
        os.setsid()  # as Popen(start_new_session=True): the kernel's killpg reaches the judge and its checks
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        requests, out, err, reply = fds
        take_std_streams(requests, out, err, write_through=True)  # as PYTHONUNBUFFERED=1 makes a Popen'd judge's
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # the kernel's TMPDIR, not the server's
        serve(reply)
    except BaseException:  # noqa: BLE001 - said on the kernel's stderr; its checkers then say the judge ended
        traceback.print_exc()
    finally:
        os._exit(0)


def _leave() -> None:
    """Run this process's exit handlers (its temp folder's removal) and end, without the interpreter's teardown."""
    import atexit

    sys.stdout.flush()
    sys.stderr.flush()
    try:
        atexit._run_exitfuncs()
    finally:
        os._exit(0)
