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
seconds; the first rank to fail is the one named -- with its traceback, or with
its exit code or signal when it died without one (``os._exit``, a segfault, a
kill), or in one line when it could not join the process group in time (a
:class:`RendezvousError`); a rank that hangs is reported when ``timeout``
expires (counted once every rank has joined). Each rank's
stdout/stderr is captured to its own buffer and printed grouped by rank, never
interleaved.

No process outlives its launch. However ``launch`` ends (results, a failure, a
timeout, Ctrl-C or a Jupyter interrupt, an exception) it kills the whole process
tree of its ranks -- torchrun starts its ranks in sessions of their own, so a
process group is not enough -- and checks that nothing is left before it returns
or raises. If the launching process is itself killed (a killed kernel), its
ranks die with it: each one asks Linux for a signal when its parent dies
(``prctl(PR_SET_PDEATHSIG)``; elsewhere a thread polls ``os.getppid()``).

Nor does any temporary file, even when the launching process is killed: forked
ranks write their output into files that are already deleted (only open
descriptors hold them), and torchrun's job folder -- the ranks' reports, and
torch elastic's own ``torchelastic_*`` files, which it never removes -- is made
and removed by the process that supervises torchrun (:class:`TorchrunAgent`).

The package, one idea a module:

* :mod:`~course_lib.launch.contract` -- what both launchers promise: the arguments, how a
  rank joins the process group, :class:`RankResults`, :class:`RankError`, :class:`LaunchTimeout`;
* :mod:`~course_lib.launch.output` -- each rank's captured output, printed grouped by rank;
* :mod:`~course_lib.launch.process_tree` -- ranks that die with their parent, whole trees
  killed and checked gone, and the blame: how a silent rank died, which rank failed first;
* :mod:`~course_lib.launch.fork` -- the fork launcher;
* :mod:`~course_lib.launch.torchrun` -- the torchrun launcher, :class:`TorchrunAgent`,
  :func:`run_torchrun` (``python -m course_lib train``);
* :mod:`~course_lib.launch.worker` -- the programs a torchrun launch runs (its agent, torchrun, each rank);
* :mod:`~course_lib.launch.magic` -- the ``%%torchrun`` cell magic.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from course_lib.launch.contract import (BACKENDS, LAUNCHERS, MAX_TIMEOUT_S, OUTPUT_MODES, PROCESS_DIED, RANK_ENV,
                                        RESULT_UNREADABLE, LaunchError, LaunchTimeout, RankError, RankResults,
                                        RendezvousError, check_args, init_rank, refuse_nested_launch,
                                        resolve_backend)
from course_lib.launch.fork import launch_fork
from course_lib.launch.output import print_outputs
from course_lib.launch.process_tree import describe_exit, die_with_parent, is_running, kill_tree, wait_gone
from course_lib.launch.torchrun import TorchrunAgent, launch_torchrun, run_torchrun, torchrun_command
from course_lib.rules import UsageError

__all__ = ["launch", "LaunchError", "RankError", "LaunchTimeout", "RendezvousError", "RankResults", "LAUNCHERS",
           "BACKENDS", "OUTPUT_MODES", "MAX_TIMEOUT_S", "RANK_ENV", "PROCESS_DIED", "RESULT_UNREADABLE",
           "resolve_backend", "init_rank", "print_outputs", "describe_exit", "die_with_parent", "is_running",
           "kill_tree", "wait_gone", "torchrun_command", "TorchrunAgent", "run_torchrun"]

# Tracebacks name an exception by its module: the errors keep the public path they are raised and caught by.
for _error in (LaunchError, RankError, LaunchTimeout, RendezvousError):
    _error.__module__ = __name__
del _error


def launch(fn: Callable[..., Any], /, world_size: int = 4, launcher: str = "fork", backend: str = "auto",
           timeout: float = 60, output: str = "all", **kwargs) -> RankResults:
    """Run ``fn(**kwargs)`` on ``world_size`` ranks; return their results in rank order.

    ``output``: print the ranks' captured output grouped by rank (``"all"``),
    only rank 0's (``"rank0"``) or nothing (``"none"``; it is still in ``.outputs``).
    Raises ``ValueError`` for bad arguments, ``RankError`` when a rank fails,
    ``LaunchTimeout`` when ranks do not finish within ``timeout`` seconds, and
    ``KeyboardInterrupt("interrupted: ...")`` on Ctrl-C once every rank is stopped.
    """
    refuse_nested_launch()
    check_args(world_size, launcher, output, timeout)
    world_size = int(world_size)
    backend = resolve_backend(backend, world_size)
    if launcher == "fork" and backend == "nccl":
        import torch

        if torch.cuda.is_initialized():
            raise UsageError("CUDA is already initialised in this process, and forked ranks cannot use it: "
                             "use launcher='torchrun', or restart the kernel and launch before touching the GPU")
    start = time.perf_counter()
    if launcher == "fork":
        results = launch_fork(fn, world_size, backend, timeout, kwargs)
    else:
        results = launch_torchrun(fn, world_size, backend, timeout, kwargs)
    results.elapsed_s = time.perf_counter() - start
    print_outputs(results.outputs, output)
    return results
