"""The programs that ``launch(..., launcher="torchrun")`` runs under torchrun.

``python -m course_lib.torchrun_worker --agent-of PID TORCHRUN_ARGS...`` is
torchrun itself (``torch.distributed.run``) tied to the launching process PID:
when PID dies, however it dies (a killed kernel), torchrun receives SIGTERM and
stops its ranks, as it does on Ctrl-C in a terminal.

``python -m course_lib.torchrun_worker JOB_DIR`` is one rank. It forks: the
child is the rank -- it reads ``JOB_DIR/job.pkl`` (module, qualname, kwargs,
backend, timeout), initialises the process group from torchrun's environment,
writes ``rank{r}.started`` when ``fn`` starts and then ``rank{r}.pkl`` (the
return value) or ``rank{r}.err`` (exception name, traceback, time), with its
output in ``rank{r}.out``; a rank still running at the timeout writes
``rank{r}.timeout`` and exits. The parent records both pids in ``rank{r}.pids``
(the launcher checks that they are gone) and waits for the child. That is how
the launcher learns how a rank died when it could not say so itself
(``os._exit``, a segfault, a kill): the parent writes ``rank{r}.err`` with the
exit code or signal and the moment of death, so the first rank to fail, by
time, is the one named -- not a peer whose collective broke a moment later
("Connection reset by peer"). Parent and child both die with their own parent.
"""

import importlib
import os
import pickle
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from course_lib.launch import RANK_ENV, _death_report, _redirect_output, die_with_parent, init_rank
from course_lib.safe_files import write_atomic

# Set by the agent for its ranks, which check that it is still their parent.
AGENT_PID_ENV = "COURSE_LIB_TORCHRUN_AGENT_PID"
REPORTS = ("pkl", "err", "timeout")


def agent(launcher_pid: int, torchrun_args: list) -> None:
    """Run torchrun in this process; SIGTERM when ``launcher_pid`` (the parent) dies."""
    die_with_parent(launcher_pid, signal.SIGTERM)  # torchrun stops its ranks on SIGTERM
    os.environ[AGENT_PID_ENV] = str(os.getpid())
    from torch.distributed.run import main as torchrun_main

    torchrun_main(torchrun_args)


def _hung(job_path: Path, rank: int) -> None:
    (job_path / f"rank{rank}.timeout").touch()
    sys.stdout.flush()
    os._exit(124)


def run_rank(job_path: Path, rank: int) -> int:
    """Be rank ``rank``: run the job's function; leave a report in ``job_path``; the exit code."""
    os.environ[RANK_ENV] = str(rank)
    _redirect_output(str(job_path / f"rank{rank}.out"))
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
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, end="")
        write_atomic(job_path / f"rank{rank}.err", pickle.dumps((type(exc).__name__, tb, time.time())))
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
    if AGENT_PID_ENV in os.environ:
        die_with_parent(int(os.environ[AGENT_PID_ENV]))
    job_path, rank, supervisor = Path(job_dir), int(os.environ["RANK"]), os.getpid()
    child = os.fork()
    if child == 0:
        code = 1
        try:
            die_with_parent(supervisor)
            code = run_rank(job_path, rank)
        finally:
            os._exit(code)
    write_atomic(job_path / f"rank{rank}.pids", f"{supervisor} {child}")  # for the launcher to check
    _, status = os.waitpid(child, 0)
    noticed_at, exitcode = time.time(), os.waitstatus_to_exitcode(status)
    if not any((job_path / f"rank{rank}.{ext}").exists() for ext in REPORTS):
        write_atomic(job_path / f"rank{rank}.err", pickle.dumps(_death_report(rank, exitcode, noticed_at)))
    return exitcode if exitcode >= 0 else 128 - exitcode


def main(argv: list) -> int:
    if argv[:1] == ["--agent-of"]:
        agent(int(argv[1]), argv[2:])
        return 0
    return supervise_rank(argv[0])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
