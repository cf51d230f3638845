"""What both launchers promise: the arguments :func:`course_lib.launch.launch` accepts, how a
rank joins the process group (and says so in one line when it cannot:
:class:`RendezvousError`), what a failing rank reports, the per-rank results, and the errors
raised when ranks fail (:class:`RankError`) or hang (:class:`LaunchTimeout`)."""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import socket
import sys
import time
import traceback

from course_lib import rules
from course_lib.safe_files import write_atomic
from course_lib.launch.output import tail
from course_lib.rules import MAX_TIMEOUT_S, UsageError  # noqa: F401  (launch's name since Lab 00)

LAUNCHERS = ("fork", "torchrun")
BACKENDS = ("auto", "gloo", "nccl")
OUTPUT_MODES = ("all", "rank0", "none")
# Set in every rank process (to its rank), so that launch() can refuse to nest.
RANK_ENV = "COURSE_LIB_LAUNCH_RANK"
# RankError.exc_type of a rank that died without reporting (no traceback), and
# of a result that the launching process cannot unpickle.
PROCESS_DIED = "ProcessDied"
RESULT_UNREADABLE = "ResultUnreadable"
# Where every rank of a one-machine run meets: the ranks never look up this machine's hostname,
# which need not resolve (containers, fresh roots); gloo then warns in every rank's output.
LOOPBACK_ADDR = "127.0.0.1"
# Set for torchrun and its ranks by its agent (course_lib.launch.worker): the job folder, where each
# rank's init_rank leaves ``rank{r}.joined`` once it has joined the process group.
JOB_ENV = "COURSE_LIB_TORCHRUN_JOB"


class LaunchError(RuntimeError):
    """Base class: something went wrong on the ranks."""


class RendezvousError(LaunchError):
    """A rank could not join the process group (the rendezvous failed or timed out); one line."""


# RankError.exc_type of the failures that the launcher words itself, in full, without a Python traceback.
_ACCOUNTS = (PROCESS_DIED, RESULT_UNREADABLE, RendezvousError.__name__)


class RankError(LaunchError):
    """A rank failed. ``rank`` is the first rank that failed, ``traceback`` its text
    (for a rank that died without one, how it died), ``exc_type`` the exception
    class name (``"ProcessDied"`` for such a death, ``"ResultUnreadable"`` for a
    result this process cannot unpickle, ``"RendezvousError"`` for a rank that could
    not join the process group: these three are one line), ``outputs`` every rank's
    captured output, ``other_failures`` the later failures by rank."""

    def __init__(self, rank: int, exc_type: str, tb: str, outputs: list[str],
                 other_failures: dict[int, str] | None = None):
        self.rank, self.exc_type, self.traceback = rank, exc_type, tb
        self.outputs = outputs
        self.other_failures = other_failures or {}
        last_line = tb.strip().splitlines()[-1] if tb.strip() else exc_type
        if exc_type in _ACCOUNTS:  # the launcher's account: it names the rank
            msg = tb.strip()
            if exc_type != RendezvousError.__name__ and rank < len(outputs) and outputs[rank].strip():
                # a crash's Python stack, if any, is in it
                msg += f"\n\n--- last output of rank {rank} ---\n{tail(outputs[rank], 40)}"
        else:
            msg = f"rank {rank} failed: {last_line}\n\n--- traceback of rank {rank} ---\n{tb}"
        if self.other_failures:
            msg += "\nother ranks that failed: " + ", ".join(
                f"{r} ({t.strip().splitlines()[-1]})" for r, t in sorted(self.other_failures.items()))
        super().__init__(msg)


def _rendezvous_advice() -> str:
    """torchrun --standalone's rendezvous store listens at ``localhost`` (torch/distributed/run.py sets
    ``rdzv_endpoint="localhost:0"``), whatever ``--local-addr`` says, so a machine where that name does not
    resolve (a bare container or chroot without /etc/hosts) never starts a rank."""
    try:
        socket.getaddrinfo("localhost", None)
    except OSError:
        return "torchrun --standalone meets at 'localhost', which does not resolve here: add '127.0.0.1 localhost' to /etc/hosts"
    return "torchrun --standalone meets at localhost: check that nothing blocks local TCP connections"


class LaunchTimeout(LaunchError):
    """The launch passed its deadline. ``phase`` names where it hung: ``"rendezvous"`` (torchrun's own:
    it started no rank), ``"start-up"`` (ranks ``unfinished`` never joined the process group) or
    ``"run"`` (they joined but did not finish: a hang or a deadlock). ``stopped`` says what became of
    the rank processes (checked, not assumed)."""

    def __init__(self, timeout: float, unfinished: list[int], outputs: list[str],
                 stopped: str = "every rank process was stopped", phase: str = "run", waited: float | None = None):
        self.timeout, self.unfinished, self.outputs, self.stopped = timeout, unfinished, outputs, stopped
        self.phase = phase
        tails = "".join(
            f"\n--- last output of rank {r} ---\n{tail(outputs[r])}" for r in unfinished if outputs[r].strip())
        waited = f"{waited:.0f}s" if waited is not None else f"timeout={timeout:g}s and start-up"
        if phase == "rendezvous":
            what = f"torchrun's rendezvous did not complete within {waited}: it started no rank ({_rendezvous_advice()})"
        elif phase == "start-up":
            what = (f"ranks {unfinished} did not join the process group within {waited} (start-up: imports, "
                    f"then the rendezvous; a busy machine starts ranks slowly: give a longer timeout)")
        else:
            what = (f"ranks {unfinished} did not finish within timeout={timeout:g}s (a hang or deadlock: "
                    f"check that every rank calls the same collectives in the same order)")
        super().__init__(f"{what}; {stopped}{tails}")


class RankResults(list):
    """The per-rank return values (a plain list, rank order) plus ``outputs``
    (each rank's captured stdout+stderr), ``elapsed_s`` and ``command``
    (the torchrun command line, for ``launcher="torchrun"``)."""

    outputs: list[str]
    elapsed_s: float
    command: str | None = None


def resolve_backend(backend: str, world_size: int) -> str:
    """``"auto"`` -> ``"nccl"`` when there is one CUDA GPU per rank, else ``"gloo"``."""
    import torch

    if backend not in BACKENDS:
        raise UsageError(f"backend={backend!r} is unknown: use one of {', '.join(BACKENDS)}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise UsageError(f"backend='nccl' needs one GPU per rank: world_size={world_size} but "
                         f"{gpus} CUDA GPUs are visible; use backend='gloo' or fewer ranks")
    return backend


def check_args(world_size, launcher, output, timeout):
    rules.launch_ranks("world_size", world_size)
    if launcher not in LAUNCHERS:
        raise UsageError(f"launcher={launcher!r} is unknown: use 'fork' (fast, notebooks) or 'torchrun'")
    if output not in OUTPUT_MODES:
        raise UsageError(f"output={output!r} is unknown: use one of {', '.join(OUTPUT_MODES)}")
    rules.timeout_seconds("timeout", timeout)


def refuse_nested_launch() -> None:
    rank = os.environ.get(RANK_ENV)
    if rank is not None:
        raise LaunchError(f"launch() was called on rank {rank} of another launch: nested launches are not "
                          f"supported; call launch() once, from the notebook or script, and give each rank its "
                          f"part of the work")


@contextlib.contextmanager
def _joining(rank: int, timeout: float):
    """Turn a failed rendezvous of rank ``rank`` (torch's store or network error: a peer that
    never came, a store that cannot be reached in time, a port in use) into a one-line
    :class:`RendezvousError` that names the rank and the fix."""
    import torch.distributed as dist

    try:
        yield
    except (dist.DistNetworkError, dist.DistStoreError) as exc:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else "no detail"
        raise RendezvousError(
            f"rank {rank} could not join the process group within {timeout:g} s "
            f"({type(exc).__name__}: {detail}); every rank must reach the rendezvous in time: give a longer "
            f"timeout (a busy machine starts ranks slowly), check that every rank starts, and that nothing else "
            f"holds or blocks the rendezvous port") from None


def bind_gloo_to_loopback() -> None:
    """Every rank is on this machine: gloo binds to the loopback interface (``GLOO_SOCKET_IFNAME``;
    unless already set) instead of the address this machine's hostname resolves to. Without it, a
    hostname that does not resolve makes gloo print "Unable to resolve hostname" in every rank's output
    (``ProcessGroupGloo::createDefaultDevice``), which torchrun --standalone does not prevent."""
    loopback = loopback_interface()
    if loopback and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = loopback


def loopback_interface() -> str | None:
    """This machine's loopback interface: ``lo`` (Linux), ``lo0`` (macOS), else None."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def init_rank(rank: int, world_size: int, backend: str, timeout: float, store=None,
              master: tuple[str, int] | None = None, join_timeout: float | None = None) -> None:
    """Initialise ``torch.distributed`` in this process (one rank) with ``timeout``
    on the default group. The rendezvous: ``store``, or the TCPStore served at
    ``master`` (host, port), else torchrun's environment (``env://``). A rendezvous
    that fails is a one-line :class:`RendezvousError`. ``join_timeout`` (default
    ``timeout``) bounds the rendezvous alone: a launcher that allows its ranks longer
    to start than to run passes its start-up allowance, and the group then gets ``timeout``.

    With NCCL the rank gets its own GPU and the group is ``"cpu:gloo,cuda:nccl"``:
    CUDA tensors travel over NCCL while the labs' CPU tensors still work (gloo).
    When every rank is on this machine, gloo binds to loopback (:func:`bind_gloo_to_loopback`).
    """
    import torch
    import torch.distributed as dist

    if master is not None or store is not None or os.environ.get("LOCAL_WORLD_SIZE") == str(world_size):
        bind_gloo_to_loopback()

    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        backend = "cpu:gloo,cuda:nccl"
    join = timeout if join_timeout is None else join_timeout
    kwargs = dict(backend=backend, rank=rank, world_size=world_size,
                  timeout=datetime.timedelta(seconds=join))
    with _joining(rank, join):
        if master is not None:
            store = dist.TCPStore(*master, world_size, is_master=False, timeout=kwargs["timeout"])
        if store is not None:
            kwargs["store"] = store
        dist.init_process_group(**kwargs)
    if join != timeout:  # gloo connects its mesh under the group's timeout: the run's own applies from here
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout))
    if JOB_ENV in os.environ:  # for the launcher: this rank is past start-up
        open(os.path.join(os.environ[JOB_ENV], f"rank{rank}.joined"), "w").close()


def report_error(rank: int, message: str) -> None:
    """A rank's error, for the person: ``error: message`` on stderr -- in a job run by
    :func:`course_lib.launch.run_torchrun`, the job's log -- and, in such a job, its first line and the
    time in ``JOB/rank{r}.error``, from which the launcher prints the first failing rank's line, once."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    if JOB_ENV in os.environ:
        line = message.strip().splitlines()[0] if message.strip() else "failed"
        write_atomic(os.path.join(os.environ[JOB_ENV], f"rank{rank}.error"), f"{time.time()!r}\n{line}".encode())


def failure_record(exc: BaseException) -> tuple[str, str, float]:
    """What a rank reports when it fails with ``exc`` (the exception being handled):
    (exception name, text, time), the text also written to the rank's output. The text is
    the traceback, or for a :class:`RendezvousError` its one line (the traceback would be torch's)."""
    text = f"{exc}\n" if isinstance(exc, RendezvousError) else traceback.format_exc()
    print(text, file=sys.stderr, end="")
    return type(exc).__name__, text, time.time()


def load_results(payloads: dict[int, bytes], outputs: list[str]) -> RankResults:
    """Unpickle every rank's return value here, in the launching process; a value that
    cannot be read here (e.g. an instance of a class this process cannot import) names its rank."""
    values = []
    for rank in range(len(outputs)):
        try:
            values.append(pickle.loads(payloads[rank]))
        except Exception as exc:  # noqa: BLE001 - any unpickling error: name the rank
            raise RankError(rank, RESULT_UNREADABLE, (
                f"rank {rank} returned a value that cannot be unpickled in the launching process: "
                f"{type(exc).__name__}: {exc}; return plain data (numbers, lists, dicts, tensors)\n"),
                outputs) from None
    results = RankResults(values)
    results.outputs = outputs
    return results
