"""The programs that ``launch(..., launcher="torchrun")`` runs: torchrun's agent, torchrun, each rank.

``python -m course_lib.launch.worker --agent-of PID TORCHRUN_ARGS...`` is the
agent of the launching process PID (:class:`course_lib.launch.TorchrunAgent`):
it makes the job folder and sends its path to the launcher over its stdin (a
socket), starts torchrun when the launcher says "go", and sends torchrun's exit
code back when it ends. torchrun's temporary files go to ``JOB/tmp``. When PID
dies, however it dies (a killed kernel), or lets go of the socket, torchrun gets
SIGTERM and stops its ranks (its whole tree is killed if it has not ended
``TORCHRUN_SIGTERM_S`` later). Whatever a rank starts stays in the agent's tree,
even once the rank has ended (:func:`~course_lib.launch.process_tree.adopt_orphans`),
for the launcher to stop. Once torchrun has ended and PID has let go (or died), the
agent kills what is left under it and removes the job folder: nothing is left,
however PID ended.

``python -m course_lib.launch.worker --torchrun-under PID TORCHRUN_ARGS...``
is torchrun itself (``torch.distributed.run``), which gets SIGTERM when its
agent PID dies.

``python -m course_lib.launch.worker``, under torchrun, is one rank of the job
in ``$COURSE_LIB_TORCHRUN_JOB``. It forks: the child is the rank -- it reads
``JOB/job.pkl`` (module, qualname, kwargs, backend, timeout), initialises the
process group from torchrun's environment, writes ``rank{r}.started`` when
``fn`` starts and then ``rank{r}.pkl`` (the return value) or ``rank{r}.err``
(exception name, traceback, time), with its output in ``rank{r}.out``; a rank
still running at the timeout writes ``rank{r}.timeout`` and exits. The parent
records both pids in ``rank{r}.pids`` (the launcher checks that they are gone)
and waits for the child. That is how the launcher learns how a rank died when it
could not say so itself (``os._exit``, a segfault, a kill): the parent writes
``rank{r}.err`` with the exit code or signal and the moment of death, so the
first rank to fail, by time, is the one named -- not a peer whose collective
broke a moment later ("Connection reset by peer"). Parent and child both die
with their own parent.
"""

import importlib
import os
import pickle
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from course_lib.launch.contract import JOB_ENV, RANK_ENV, failure_record, init_rank
from course_lib.launch.output import redirect_output
from course_lib.launch.process_tree import (POLL_S, adopt_orphans, death_report, die_with_parent,
                                            freeze_inherited_objects, kill_tree)
from course_lib.launch.torchrun import TORCHRUN_SIGTERM_S
from course_lib.safe_files import write_atomic

# Set by torchrun for its ranks, which check that it is still their parent.
TORCHRUN_PID_ENV = "COURSE_LIB_TORCHRUN_PID"
REPORTS = ("pkl", "err", "timeout")
# The agent's stdin: a socket to the launcher.
CHANNEL = 0


def _launcher_let_go() -> bool:
    """Whether the launcher closed the channel (it died, or is done with the job folder).
    It sends nothing after "go", so anything readable is the end."""
    return bool(select.select([CHANNEL], [], [], 0)[0])


def _write_channel(data: bytes) -> bool:
    """Send ``data`` to the launcher; whether it could (not once it has let go, or died)."""
    try:
        os.write(CHANNEL, data)
    except OSError:
        return False
    return True


def _read_channel(size: int) -> bytes:
    """Up to ``size`` bytes from the launcher; nothing once it has let go. A launcher that closes
    the channel before reading all the agent sent (torchrun's exit code, when Ctrl-C stopped it
    first) resets the connection: that, too, is letting go."""
    try:
        return os.read(CHANNEL, size)
    except ConnectionResetError:
        return b""


def _wait_for_torchrun(torchrun: subprocess.Popen, sigterm_at: list) -> int:
    """torchrun's exit code. Once the launcher is gone (this process got SIGTERM, or the
    channel closed), torchrun gets SIGTERM, on which it stops its ranks; if it has not
    ended ``TORCHRUN_SIGTERM_S`` later, its whole tree is killed."""
    terminated_at = None
    while True:
        try:
            return torchrun.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:  # still unreaped: its pid is still its own
            pass
        if terminated_at is None and (sigterm_at or _launcher_let_go()):
            torchrun.terminate()
            terminated_at = time.monotonic()
        elif terminated_at is not None and time.monotonic() > terminated_at + TORCHRUN_SIGTERM_S:
            kill_tree(torchrun.pid)


def _run_job(job: Path, torchrun_args: list, sigterm_at: list) -> int:
    """Hand the job folder to the launcher, run torchrun when it says go, report its exit code."""
    if not _write_channel(os.fsencode(job) + b"\n") or not _read_channel(1) or sigterm_at:
        return 1  # the launcher let go (or died) before saying go
    env = dict(os.environ, TMPDIR=str(job / "tmp"), **{JOB_ENV: str(job)})
    torchrun = subprocess.Popen([sys.executable, "-m", "course_lib.launch.worker", "--torchrun-under",
                                 str(os.getpid()), *torchrun_args], stdin=subprocess.DEVNULL, env=env)
    code = _wait_for_torchrun(torchrun, sigterm_at)
    _write_channel(f"{code}\n".encode())
    return code


def agent(launcher_pid: int, torchrun_args: list) -> int:
    """Run torchrun for the launcher ``launcher_pid``; leave nothing behind; torchrun's exit code."""
    sigterm_at = []
    signal.signal(signal.SIGTERM, lambda signum, frame: sigterm_at.append(time.monotonic()))
    die_with_parent(launcher_pid, signal.SIGTERM)
    adopt_orphans()
    job = Path(tempfile.mkdtemp(prefix="course_torchrun_"))
    try:
        (job / "tmp").mkdir()
        code = _run_job(job, torchrun_args, sigterm_at)
        while _read_channel(4096):  # until the launcher lets go of the folder (or dies)
            pass
        return code
    finally:
        kill_tree(os.getpid(), keep_root=True)  # a launcher that died could not stop what the ranks started
        shutil.rmtree(job, ignore_errors=True)


def torchrun_under(agent_pid: int, torchrun_args: list) -> None:
    """Run torchrun in this process; SIGTERM when ``agent_pid`` (the parent) dies."""
    die_with_parent(agent_pid, signal.SIGTERM)  # torchrun stops its ranks on SIGTERM
    os.environ[TORCHRUN_PID_ENV] = str(os.getpid())
    from torch.distributed.run import main as torchrun_main

    torchrun_main(torchrun_args)


def _hung(job_path: Path, rank: int) -> None:
    (job_path / f"rank{rank}.timeout").touch()
    sys.stdout.flush()
    os._exit(124)


def _redirect_output_to(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    redirect_output(fd)
    os.close(fd)


def run_rank(job_path: Path, rank: int) -> int:
    """Be rank ``rank``: run the job's function; leave a report in ``job_path``; the exit code."""
    os.environ[RANK_ENV] = str(rank)
    _redirect_output_to(job_path / f"rank{rank}.out")
    job = pickle.loads((job_path / "job.pkl").read_bytes())
    try:
        import torch

        if job["backend"] == "gloo":
            torch.set_num_threads(1)
        init_rank(rank, int(os.environ["WORLD_SIZE"]), job["backend"], job["timeout"])
        fn = importlib.import_module(job["module"])
        for part in job["qualname"].split("."):
            fn = getattr(fn, part)
        # torchrun waits for a rank forever: one that runs past the timeout
        # (counted, like the group's, once the group is up) ends itself, so
        # torchrun tears the others down and the launcher reports it.
        watchdog = threading.Timer(job["timeout"], _hung, args=(job_path, rank))
        watchdog.daemon = True
        watchdog.start()
        (job_path / f"rank{rank}.started").touch()
        value = fn(**job["kwargs"])
        watchdog.cancel()
        write_atomic(job_path / f"rank{rank}.pkl", pickle.dumps(value))
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher
        write_atomic(job_path / f"rank{rank}.err", pickle.dumps(failure_record(exc)))
        return 1
    finally:
        sys.stdout.flush()
    try:
        # Leave together: a rank that exits early breaks peers still talking
        # to it. Failing here (a peer failed or hung) changes nothing: this
        # rank's result is saved and the peer's problem is reported.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return 0


def supervise_rank(job_dir: str) -> int:
    """Fork the rank, wait for it, and report its death if it could not; its exit code."""
    if TORCHRUN_PID_ENV in os.environ:
        die_with_parent(int(os.environ[TORCHRUN_PID_ENV]))
    job_path, rank, supervisor = Path(job_dir), int(os.environ["RANK"]), os.getpid()
    child = os.fork()
    if child == 0:
        code = 1
        try:
            die_with_parent(supervisor)
            freeze_inherited_objects()
            code = run_rank(job_path, rank)
        finally:
            os._exit(code)
    write_atomic(job_path / f"rank{rank}.pids", f"{supervisor} {child}")  # for the launcher to check
    _, status = os.waitpid(child, 0)
    noticed_at, exitcode = time.time(), os.waitstatus_to_exitcode(status)
    if not any((job_path / f"rank{rank}.{ext}").exists() for ext in REPORTS):
        write_atomic(job_path / f"rank{rank}.err", pickle.dumps(death_report(rank, exitcode, noticed_at)))
    return exitcode if exitcode >= 0 else 128 - exitcode


def main(argv: list) -> int:
    if argv[:1] == ["--agent-of"]:
        code = agent(int(argv[1]), argv[2:])
        return code if code >= 0 else 128 - code
    if argv[:1] == ["--torchrun-under"]:
        torchrun_under(int(argv[1]), argv[2:])
        return 0
    return supervise_rank(os.environ[JOB_ENV])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
