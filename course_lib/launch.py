"""Run a function on N real ranks, from a notebook cell or a test.

``launch(fn, world_size=4)`` starts ``world_size`` processes, initialises
``torch.distributed`` in each (gloo on CPU, NCCL with one GPU per rank), runs
``fn(**kwargs)`` on every rank and returns the per-rank return values in rank
order. Two launchers, one contract:

* ``launcher="fork"`` forks the current process: ranks start in a fraction of a
  second and can run functions defined in a notebook. CPU labs and tests use it.
* ``launcher="torchrun"`` runs ``python -m torch.distributed.run --standalone
  --nproc-per-node N`` -- the command you type on a GPU box. ``fn`` must be
  importable from a module there (not defined in a notebook cell).

Failure is never silent and never hangs: every process group gets ``timeout``
seconds; a rank that raises is reported by rank with its traceback; a rank that
hangs is reported when ``timeout`` expires; either way every rank process is
killed before ``launch`` returns or raises. Each rank's stdout/stderr is
captured to its own buffer and printed grouped by rank, never interleaved.
"""

from __future__ import annotations

import datetime
import os
import pickle
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from multiprocessing import connection
from pathlib import Path
from typing import Any, Callable, Sequence

LAUNCHERS = ("fork", "torchrun")
BACKENDS = ("auto", "gloo", "nccl")
OUTPUT_MODES = ("all", "rank0", "none")
# After the first rank fails, the others get this long to report their own
# failure (often a broken collective) before they are killed.
_GRACE_AFTER_FAILURE_S = 0.3


class LaunchError(RuntimeError):
    """Base class: something went wrong on the ranks."""


class RankError(LaunchError):
    """A rank raised. ``rank`` is the first rank that failed, ``traceback`` its text,
    ``exc_type`` the exception class name, ``outputs`` every rank's captured output."""

    def __init__(self, rank: int, exc_type: str, tb: str, outputs: list[str],
                 other_failures: dict[int, str] | None = None):
        self.rank, self.exc_type, self.traceback = rank, exc_type, tb
        self.outputs = outputs
        self.other_failures = other_failures or {}
        last_line = tb.strip().splitlines()[-1] if tb.strip() else exc_type
        msg = f"rank {rank} failed: {last_line}\n\n--- traceback of rank {rank} ---\n{tb}"
        if self.other_failures:
            msg += "\nother ranks that failed: " + ", ".join(
                f"{r} ({t.strip().splitlines()[-1]})" for r, t in sorted(self.other_failures.items()))
        super().__init__(msg)


class LaunchTimeout(LaunchError):
    """Some ranks did not finish within the timeout (a hang or a deadlock)."""

    def __init__(self, timeout: float, unfinished: list[int], outputs: list[str]):
        self.timeout, self.unfinished, self.outputs = timeout, unfinished, outputs
        tails = "".join(
            f"\n--- last output of rank {r} ---\n{_tail(outputs[r])}" for r in unfinished if outputs[r].strip())
        super().__init__(
            f"ranks {unfinished} did not finish within timeout={timeout:g}s (a hang or deadlock: "
            f"check that every rank calls the same collectives in the same order); "
            f"all rank processes were killed{tails}")


class RankResults(list):
    """The per-rank return values (a plain list, rank order) plus ``outputs``
    (each rank's captured stdout+stderr), ``elapsed_s`` and ``command``
    (the torchrun command line, for ``launcher="torchrun"``)."""

    outputs: list[str]
    elapsed_s: float
    command: str | None = None


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def resolve_backend(backend: str, world_size: int) -> str:
    """``"auto"`` -> ``"nccl"`` when there is one CUDA GPU per rank, else ``"gloo"``."""
    import torch

    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown: use one of {', '.join(BACKENDS)}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size} but "
                         f"{gpus} CUDA GPUs are visible; use backend='gloo' or fewer ranks")
    return backend


def _check_args(world_size, launcher, output, timeout):
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an integer >= 1")
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher={launcher!r} is unknown: use 'fork' (fast, notebooks) or 'torchrun'")
    if output not in OUTPUT_MODES:
        raise ValueError(f"output={output!r} is unknown: use one of {', '.join(OUTPUT_MODES)}")
    if not timeout or timeout <= 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")


def init_rank(rank: int, world_size: int, backend: str, timeout: float, store=None) -> None:
    """Initialise ``torch.distributed`` in this process (one rank) with ``timeout``
    on the default group. Without ``store`` the rendezvous comes from torchrun's
    environment (``env://``).

    With NCCL the rank gets its own GPU and the group is ``"cpu:gloo,cuda:nccl"``:
    CUDA tensors travel over NCCL while the labs' CPU tensors still work (gloo).
    """
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        backend = "cpu:gloo,cuda:nccl"
    kwargs = dict(backend=backend, rank=rank, world_size=world_size,
                  timeout=datetime.timedelta(seconds=timeout))
    if store is not None:
        kwargs["store"] = store
    dist.init_process_group(**kwargs)


def print_outputs(outputs: Sequence[str], output: str = "all", file=None) -> None:
    """Print captured rank outputs, each under a ``[rank r]`` header."""
    file = file or sys.stdout
    if output == "none":
        return
    ranks = range(len(outputs)) if output == "all" else [0]
    for r in ranks:
        text = outputs[r]
        if not text:
            continue
        if output == "all" and len(outputs) > 1:
            print(f"[rank {r}]", file=file)
        print(text.rstrip("\n"), file=file)


def launch(fn: Callable[..., Any], /, world_size: int = 4, launcher: str = "fork", backend: str = "auto",
           timeout: float = 60, output: str = "all", **kwargs) -> RankResults:
    """Run ``fn(**kwargs)`` on ``world_size`` ranks; return their results in rank order.

    ``output``: print the ranks' captured output grouped by rank (``"all"``),
    only rank 0's (``"rank0"``) or nothing (``"none"``; it is still in ``.outputs``).
    Raises ``ValueError`` for bad arguments, ``RankError`` when a rank raises,
    ``LaunchTimeout`` when ranks do not finish within ``timeout`` seconds.
    """
    _check_args(world_size, launcher, output, timeout)
    backend = resolve_backend(backend, world_size)
    if launcher == "fork" and backend == "nccl":
        import torch

        if torch.cuda.is_initialized():
            raise ValueError("CUDA is already initialised in this process, and forked ranks cannot use it: "
                             "use launcher='torchrun', or restart the kernel and launch before touching the GPU")
    start = time.perf_counter()
    if launcher == "fork":
        results = _launch_fork(fn, world_size, backend, timeout, kwargs)
    else:
        results = _launch_torchrun(fn, world_size, backend, timeout, kwargs)
    results.elapsed_s = time.perf_counter() - start
    print_outputs(results.outputs, output)
    return results


def _first_failure(failures: dict[int, tuple[str, str, float]], outputs: list[str]) -> RankError:
    """The error to raise for ``{rank: (exception name, traceback, time)}``: the
    earliest failure is the cause; later ones are usually its consequence
    (peers of a dead rank see their collectives break)."""
    first = min(failures, key=lambda r: (failures[r][2], r))
    exc_type, tb, _ = failures[first]
    return RankError(first, exc_type, tb, outputs, {r: f[1] for r, f in failures.items() if r != first})


# --------------------------------------------------------------------------- fork


def _redirect_output(path: str) -> None:
    """Point this process's stdout/stderr (Python objects and C file descriptors) at ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # A forked Jupyter kernel's sys.stdout talks to threads that do not exist in
    # the child; replace it with a plain line-buffered file on fd 1.
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = sys.stdout


def _fork_child(rank, world_size, backend, timeout, host, port, fn, kwargs, conn, out_path):
    status, payload = "error", b""
    try:
        _redirect_output(out_path)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        import torch

        torch.set_num_threads(1)  # several ranks on 2 cores: OpenMP oversubscription hangs
        import torch.distributed as dist

        # What torchrun would set, so code reads the same under both launchers.
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size))

        store = dist.TCPStore(host, port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout))
        init_rank(rank, world_size, backend, timeout, store=store)
        value = fn(**kwargs)
        try:
            payload = pickle.dumps(value)
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            raise TypeError(f"the return value of fn on rank {rank} cannot be pickled: {exc}") from None
        status = "ok"
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the parent
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, end="")
        payload = pickle.dumps((type(exc).__name__, tb, time.time()))
    try:
        sys.stdout.flush()
        conn.send_bytes(pickle.dumps((status, payload)))
        # Stay alive until the launcher ends every rank: a rank that exits
        # early closes its sockets while slower peers may still be talking to
        # it (even inside init_process_group's connection set-up).
        conn.recv_bytes()
    except (EOFError, OSError):
        pass
    finally:
        os._exit(0)  # never run the parent's atexit handlers in a forked child


def _launch_fork(fn, world_size, backend, timeout, kwargs) -> RankResults:
    import multiprocessing as mp

    import torch.distributed as dist

    # backward(grad) imports sympy lazily (~2.5 s); import it once here so that
    # every forked rank inherits it instead of paying for it again.
    import torch.fx.experimental.symbolic_shapes  # noqa: F401

    ctx = mp.get_context("fork")
    # The rendezvous socket is bound (port chosen by the OS, so no race) before
    # any child exists, but the store's server thread starts only after the last
    # fork: forking while another thread holds a lock can deadlock the child.
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(world_size)
    port = listener.getsockname()[1]
    store = None
    tmp = tempfile.TemporaryDirectory(prefix="course_launch_")
    out_paths = [os.path.join(tmp.name, f"rank{r}.out") for r in range(world_size)]
    procs, conns, all_conns = [], {}, []
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        for rank in range(world_size):
            mine, theirs = ctx.Pipe()
            p = ctx.Process(target=_fork_child, daemon=True, args=(
                rank, world_size, backend, timeout, "127.0.0.1", port, fn, kwargs, theirs, out_paths[rank]))
            p.start()
            theirs.close()
            procs.append(p)
            conns[mine] = rank
            all_conns.append(mine)
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout),
                              master_listen_fd=listener.detach())  # the store owns the socket now
        values, failures, first_failure_at = {}, {}, None
        deadline = time.monotonic() + timeout
        while conns:
            now = time.monotonic()
            limit = deadline if first_failure_at is None else min(deadline, first_failure_at + _GRACE_AFTER_FAILURE_S)
            if now >= limit:
                break
            for c in connection.wait(list(conns), timeout=limit - now):
                rank = conns.pop(c)
                try:
                    status, payload = pickle.loads(c.recv_bytes())
                except EOFError:  # the process died without reporting (killed, segfault, os._exit)
                    status, payload = "error", pickle.dumps(
                        ("ProcessDied", f"rank {rank} exited without reporting a result "
                                        f"(exit code {procs[rank].exitcode}); see its output\n", time.time()))
                if status == "ok":
                    values[rank] = pickle.loads(payload)
                else:
                    failures[rank] = pickle.loads(payload)
                    if first_failure_at is None:
                        first_failure_at = time.monotonic()
    finally:
        # Reported ranks are parked (see _fork_child), the others failed to
        # report in time: either way, every rank process ends here.
        for p in procs:
            if p.is_alive():
                p.kill()
        for c in all_conns:
            c.close()
        for p in procs:
            p.join()
        outputs = [Path(p).read_text(errors="replace") if os.path.exists(p) else "" for p in out_paths]
        tmp.cleanup()
        del store
        listener.close()  # a no-op once detached
    if failures:
        raise _first_failure(failures, outputs)
    if len(values) < world_size:
        raise LaunchTimeout(timeout, sorted(set(range(world_size)) - set(values)), outputs)
    results = RankResults(values[r] for r in range(world_size))
    results.outputs = outputs
    return results


# ------------------------------------------------------------------------ torchrun


def torchrun_command(world_size: int, target: Sequence[str]) -> list[str]:
    """The torchrun command line for ``world_size`` ranks on one machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={world_size}", *target]


def _importable_name(fn) -> tuple[str, str]:
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    name = getattr(fn, "__name__", repr(fn))
    if module in (None, "__main__") or "<" in qualname:
        where = "a notebook cell or script (__main__)" if module == "__main__" else "a local scope"
        raise ValueError(
            f"fn {name!r} is defined in {where}; torchrun starts fresh Python processes that must "
            f"import it: move it into a module file, or use launcher='fork'")
    return module, qualname


def _import_root(module: str) -> str | None:
    """The sys.path entry from which ``module`` was imported (``/x`` for ``/x/a/b.py`` = ``a.b``)."""
    path = getattr(sys.modules.get(module), "__file__", None)
    if not path:
        return None
    root = Path(path).resolve().parent
    for _ in range(module.count(".")):
        root = root.parent
    return str(root)


def _launch_torchrun(fn, world_size, backend, timeout, kwargs) -> RankResults:
    module, qualname = _importable_name(fn)
    with tempfile.TemporaryDirectory(prefix="course_torchrun_") as tmp:
        job = Path(tmp)
        (job / "job.pkl").write_bytes(pickle.dumps(
            dict(module=module, qualname=qualname, kwargs=kwargs, backend=backend, timeout=timeout)))
        cmd = torchrun_command(world_size, ["-m", "course_lib.torchrun_worker", str(job)])
        env = dict(os.environ, OMP_NUM_THREADS="1")
        # Make fn's module (and whatever the caller could import) importable there.
        paths = [_import_root(module), *(p or os.getcwd() for p in sys.path)]
        env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(p for p in paths if p))
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        timed_out = False
        try:
            # Each rank enforces the timeout itself (torchrun_worker's watchdog);
            # this backstop also covers torchrun's own start-up.
            launcher_log, _ = proc.communicate(timeout=timeout + 60)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            _kill_session(proc)
        if timed_out:
            launcher_log = b""
        outputs = [(job / f"rank{r}.out").read_text(errors="replace") if (job / f"rank{r}.out").exists()
                   else "" for r in range(world_size)]
        failures = {}
        for r in range(world_size):
            err = job / f"rank{r}.err"
            if err.exists():
                failures[r] = pickle.loads(err.read_bytes())
        values = {r: pickle.loads((job / f"rank{r}.pkl").read_bytes())
                  for r in range(world_size) if (job / f"rank{r}.pkl").exists()}
        hung = [r for r in range(world_size) if (job / f"rank{r}.timeout").exists()]
    if hung:  # checked first: the others' errors are the consequence
        raise LaunchTimeout(timeout, hung, outputs)
    if failures:
        raise _first_failure(failures, outputs)
    if timed_out or len(values) < world_size:
        if not timed_out and proc.returncode:
            raise LaunchError(f"torchrun exited with code {proc.returncode} before all ranks reported:\n"
                              f"{_tail(launcher_log.decode(errors='replace'), 30)}")
        raise LaunchTimeout(timeout, sorted(set(range(world_size)) - set(values)), outputs)
    results = RankResults(values[r] for r in range(world_size))
    results.outputs = outputs
    results.command = shlex.join(["torchrun", *cmd[3:]])
    return results


def _kill_session(proc: subprocess.Popen) -> None:
    """Kill torchrun and every rank it started (they share its session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
