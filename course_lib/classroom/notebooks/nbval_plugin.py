"""A pytest plugin: one ``pytest --nbval`` run checks ``solutions/`` strictly and ``labs/`` laxly.

``make test`` runs the unit tests, the solution notebooks (every stored output must match) and
the student notebooks (they must run top to bottom with the exercises unsolved; their outputs
are not stored, so only cells marked ``# NBVAL_CHECK_OUTPUT`` are compared, as
``--nbval-lax`` would) in a single pytest session, so that ``pytest-xdist`` keeps both cores
busy across all three instead of idling at the end of each. Load it with
``pytest -p course_lib.classroom.notebooks.nbval_plugin``; notebooks in a folder named ``labs`` get the lax treatment.

``pytest-xdist --dist loadfile`` hands out whole files, by default the files with the most tests first. Test
count is not time: a file of one long test (grading every lab) handed out last leaves the other core idle for
its length. So this plugin hands out the files of :data:`LONGEST_FIRST` (measured) first, longest first, and
the others after them in collection order; and a worker that dies fails its file instead of hanging the
session (:mod:`.xdist_crash`, whose scheduler this plugin installs). The session ends with its test time by
area (:func:`time_by_area`): which part of the suite its wall time pays for.

A heavy cell tagged ``labs-pass-skip`` that no exercise depends on (Lab 05's megatron-core
side-by-side) computes in a lab exactly what the strict pass has already run and compared in the solution:
it is skipped in the ``labs/`` pass when :mod:`.independent_cells` proves it independent of the exercises.
"""

from __future__ import annotations

import course_lib.classroom.notebooks.fast_start  # noqa: F401  -- first: before nbval's entry point imports nbformat
import os
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from course_lib.classroom.notebooks.independent_cells import SKIP_TAG, skip_problems
from course_lib.classroom.notebooks.xdist_crash import pytest_handlecrashitem, pytest_xdist_make_scheduler  # noqa: F401

LAX_FOLDER = "labs"


# The files that took 25 s or more in one `make test` session (junit times summed per file, -n 2 on 2 busy
# cores, 2026-12-04; DeepSpeed's op build and the labs/ cells now skipped left out), longest first. Only the
# order in which xdist hands out files depends on it: a stale list costs minutes, never a result.
LONGEST_FIRST = (
    "tests/test_train_moe.py",
    "tests/classroom/test_grade_class_every_lab.py",
    "tests/classroom/test_grade_every_lab.py",
    "tests/classroom/test_grade_every_lab_more.py",
    "solutions/05_3d_parallel_in_practice.ipynb",
    "tests/classroom/checks/test_lab00_checks.py",
    "tests/classroom/test_grade.py",
    "tests/test_train.py",
    "tests/sweep/test_sweep.py",
    "tests/launch/test_launch_cleanup.py",
    "solutions/00_collectives.ipynb",
    "labs/05_3d_parallel_in_practice.ipynb",
    "tests/launch/test_launch_deadline.py",
    "solutions/10_deepspeed.ipynb",
    "solutions/03_pipeline.ipynb",
    "tests/mcore/test_megatron_core_live.py",
    "labs/03_pipeline.ipynb",
    "labs/00_collectives.ipynb",
    "tests/sizing/test_projection.py",
    "tests/launch/test_launch.py",
    "tests/training/test_checkpointing.py",
    "tests/topology/test_topology.py",
    "tests/deepspeed/test_deepspeed_engine.py",
    "tests/classroom/test_gpu_check.py",
    "tests/classroom/checks/test_lab03_checks.py",
    "labs/11_data_pipeline.ipynb",
    "tests/classroom/test_site.py",
    "tests/classroom/checks/test_lab02_checks.py",
    "labs/09_checkpoints.ipynb",
    "solutions/09_checkpoints.ipynb",
    "solutions/02_tensor_parallel.ipynb",
    "labs/02_tensor_parallel.ipynb",
    "tests/moe/test_moe_model.py",
    "solutions/11_data_pipeline.ipynb",
)


def _is_lab_cell(item) -> bool:
    return hasattr(item, "cell") and isinstance(getattr(item, "options", None), dict) \
        and Path(str(item.fspath)).parent.name == LAX_FOLDER


def pytest_configure(config):
    _one_thread_per_process()
    if hasattr(config.option, "loadscopereorder"):      # xdist: keep the order pytest_collection_modifyitems gives
        config.option.loadscopereorder = False
    try:
        from nbval.plugin import IPyNbFile
    except ImportError:
        return
    if not getattr(IPyNbFile.teardown, "graceful", False):
        IPyNbFile.teardown = _graceful_teardown(IPyNbFile.teardown)
    import nbval.kernel
    if not issubclass(nbval.kernel.KernelManager, _SocketFileKernelManager):
        nbval.kernel.KernelManager = type("SocketFileKernelManager", (_SocketFileKernelManager,
                                                                     nbval.kernel.KernelManager), {})


def _one_thread_per_process() -> None:
    """Every process of the session -- pytest's workers, the kernels, judges and ranks they start -- runs torch on
    one intra-op thread (``OMP_NUM_THREADS=1``, as torchrun gives each rank), whatever the environment says.

    Two reasons. Time: two workers on two cores each with a pool of two spinning OpenMP threads fight for the
    cores; a single-process training run of tests/test_train_moe.py took 0.6 s alone and 3.4 s (3.3 CPU-s) beside
    two busy loops with two threads, 0.8 s (0.5 CPU-s) with one; that file's fixture took 78 s in a make test, 6.7 s
    with one thread; nbval of solutions/ with four test files, run side by side with -n 1 each: 561 -> 503 CPU-s
    (2026-12-06, measured). Numbers: how a reduction is split over threads changes its last bits, so a printed loss
    can differ in its 4th decimal between thread counts (solutions/07's bf16 loss did); the stored outputs are made
    with one thread too (``make solutions``), so they do not depend on the machine's core count."""
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)


class _SocketFileKernelManager:
    """A notebook's kernel talks to pytest over Unix socket files (ZeroMQ's ``ipc`` transport), not TCP ports.

    jupyter_client picks a TCP kernel's five ports by binding port 0 and closing it, and the kernel binds them
    again a second later. Under ``make test`` the other worker is meanwhile launching ranks whose gloo and
    torchrun sockets take ephemeral ports too; a kernel that lost one of its ports died at start ("Kernel
    died before replying to kernel_info", every cell of solutions/09 in one CI run). Socket files named
    after a fresh UUID cannot be taken by anyone else, and jupyter_client removes them when the kernel is
    shut down (``cleanup_ipc_files``). A socket's path must fit in ``sockaddr_un`` (108 bytes on Linux,
    104 on macOS): where the temporary folder's path is too long for that, the kernel keeps TCP."""

    def __init__(self, **kwargs):
        prefix = str(Path(tempfile.gettempdir()) / f"nbk-{uuid.uuid4().hex[:16]}")
        if len(prefix.encode()) + len("-65535") < 100:
            kwargs.setdefault("transport", "ipc")
            kwargs.setdefault("ip", prefix)
        super().__init__(**kwargs)
        self.course_tmpdirs: list[str] = []

    def start_kernel(self, **kwargs):
        """The kernel, and every process it starts, get a temporary folder of their own (``TMPDIR``), removed with
        the notebook (:func:`_graceful_teardown`): what a lab keeps for its reader after the kernel ends -- Lab 09's
        checkpoints (~32 MB), Lab 05's runs and report -- would otherwise stay in /tmp after every test run. And
        the kernel's judge is forked from this pytest process's judge server
        (:mod:`course_lib.classroom.checks.judge_server`), not started afresh (measured here: nbval of 6
        notebooks, 51.5 -> 42.6 CPU-s)."""
        if "env" not in kwargs:
            from course_lib.classroom.checks import judge_server

            folder = tempfile.mkdtemp(prefix="nbk-tmp-")
            self.course_tmpdirs.append(folder)
            kwargs["env"] = {**os.environ, "TMPDIR": folder}
            server = judge_server.start()
            if server:
                kwargs["env"][judge_server.ADDRESS_ENV] = server
        return super().start_kernel(**kwargs)

    async def _async_launch_kernel(self, kernel_cmd, **kw):
        """The kernel forked from this pytest process's kernel zygote (:mod:`.kernel_zygote`: torch and ipykernel
        already imported), or started as jupyter_client starts it where the zygote cannot fork this one."""
        from course_lib.classroom.notebooks import kernel_zygote

        kernel = kernel_zygote.fork_kernel(kernel_cmd, kw)
        if kernel is None:
            return await super()._async_launch_kernel(kernel_cmd, **kw)
        provisioner = self.provisioner
        provisioner.process, provisioner.pid, provisioner.pgid = kernel, kernel.pid, kernel.pid
        provisioner.cwd = kw.get("cwd")
        self._reconcile_connection_info(provisioner.connection_info)


def _graceful_teardown(teardown):
    """nbval ends a notebook's kernel with SIGKILL (``RunningKernel.stop``: ``shutdown_kernel(now=True)``), so
    the kernel's ``atexit`` handlers never run and what a lab made to last until its kernel ends (Lab 10's
    ``ds_configs_*``, Lab 11's ``lab11-*`` temporary folders, the checkers' judge) stays behind. So the kernel
    is asked to run its ``atexit`` handlers and leave: what a kernel's end does for the lab, without the
    seconds an interpreter holding torch spends tearing itself down (a ``shutdown_request`` took 1.5-2.6 s
    per notebook, x 24 notebooks). A kernel that left is then stopped here, which only removes its files;
    nbval's own teardown kills one still running after :data:`EXIT_WAIT_S`, as before."""
    def graceful(self):
        kernel = self.kernel
        folders = list(getattr(getattr(kernel, "km", None), "course_tmpdirs", ()))   # stop() deletes the manager
        if kernel is not None and kernel.is_alive() and not getattr(self.config.option, "cov_source", None):
            kernel.kc.execute(_RUN_EXIT_HANDLERS_AND_LEAVE, store_history=False, allow_stdin=False)
            deadline = time.monotonic() + EXIT_WAIT_S
            while kernel.km.is_alive() and time.monotonic() < deadline:
                time.sleep(0.02)
        if kernel is not None and hasattr(kernel, "km") and not kernel.is_alive():
            kernel.stop()       # nbval stops only a live kernel: this removes the connection and socket files
        teardown(self)
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)

    graceful.graceful = True
    return graceful


EXIT_WAIT_S = 10.0
# The handlers are bound as defaults: IPython's own exit handler empties the user namespace on its way.
_RUN_EXIT_HANDLERS_AND_LEAVE = """def _leave(run=__import__("atexit")._run_exitfuncs, leave=__import__("os")._exit):
    try:
        run()
    finally:
        leave(0)

_leave()"""


AREAS = (
    ("notebooks: solutions/ (strict)", ("solutions/",)),
    ("notebooks: labs/ (lax)", ("labs/",)),
    ("grade, in the sandbox", ("tests/classroom/test_grade",)),
    ("checkers' tables", ("tests/classroom/checks/",)),
    ("judge, sandbox, site, widgets", ("tests/classroom/",)),
    ("launch, torchrun, two nodes", ("tests/launch/", "tests/test_two_nodes.py")),
    ("training, MoE, DeepSpeed, megatron-core", ("tests/test_train", "tests/training/", "tests/moe/",
                                                 "tests/deepspeed/", "tests/mcore/", "tests/sweep/")),
)
"""Where ``make test``'s time goes, by the first of these whose path prefix a test's file has (the rest: "the other
tests"), printed at the end of the session (:func:`pytest_terminal_summary`): what the budget is spent on."""


def time_by_area(reports) -> list[tuple[str, float]]:
    """``[(area, seconds)]``, largest first: the setup, call and teardown durations of ``reports`` (pytest's test
    reports: ``nodeid``, ``duration``) summed per :data:`AREAS` entry."""
    totals: dict[str, float] = {}
    for report in reports:
        path = report.nodeid.split("::")[0]
        area = next((name for name, prefixes in AREAS if path.startswith(prefixes)), "the other tests")
        totals[area] = totals.get(area, 0.0) + report.duration
    return sorted(totals.items(), key=lambda item: -item[1])


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """The session's test time by area (:func:`time_by_area`), summed over the workers: with ``-n N`` the wall time
    is about the sum over N, so this says which part of the suite a time budget pays for."""
    if hasattr(config, "workerinput"):  # an xdist worker: the controller sums every worker's reports
        return
    reports = [r for kind in terminalreporter.stats.values() for r in kind
               if hasattr(r, "duration") and hasattr(r, "nodeid") and getattr(r, "when", None)]
    areas = time_by_area(reports)
    total = sum(seconds for _, seconds in areas)
    if total <= 0:
        return
    workers = getattr(config.option, "numprocesses", None)
    workers = workers if isinstance(workers, int) and workers > 0 else 1
    terminalreporter.write_sep("=", f"test time by area, summed over {workers} worker(s): {total:.1f} s")
    for name, seconds in areas:
        terminalreporter.write_line(f"{seconds:8.1f} s {100 * seconds / total:4.0f} %  {name}")


def _longest_first(items) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))     # stable: files stay whole


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    _longest_first(items)

    proofs = {}
    for item in items:
        if _is_lab_cell(item):
            item.options["check"] = "NBVAL_CHECK_OUTPUT" in "".join(item.cell.source)
            if SKIP_TAG in item.cell.get("metadata", {}).get("tags", []):
                path = str(item.fspath)
                if path not in proofs:
                    cells = item.parent.nb.cells
                    problems = skip_problems(cells)
                    proofs[path] = {id(c) for i, c in enumerate(cells) if i not in problems}
                item.options["skip"] = id(item.cell) in proofs[path]
