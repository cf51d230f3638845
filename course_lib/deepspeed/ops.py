"""DeepSpeed's C++ ops, built when a lab or test first needs them -- not during set-up.

DeepSpeed installs as pure Python (``DS_BUILD_OPS=0``) and JIT-compiles its CPU ops with g++ on
first use (``OpBuilder.load`` -> ``torch.utils.cpp_extension.load``): the CPU accelerator's
shared-memory comm op, the pinned-memory op (offload's host buffers) and ``async_io`` (NVMe offload,
where libaio's headers are installed). :func:`ensure_built` builds all three once, with a progress
line, so that ``make lab`` opens JupyterLab without waiting for g++ and no rank of a timed launch pays
the build. Concurrent first users (pytest-xdist workers, a notebook beside a test run) take turns
under an ``fcntl`` lock: the first builds, the others find the stamp. The lock is released by the
kernel when its holder dies, unlike torch's own ``lock`` file (``torch.utils.file_baton.FileBaton``,
one per op folder, taken by every load), which a process killed while building or loading leaves
behind: the next load then waits for it forever. :func:`clear_stale_locks` removes such a file, and
only when no process holds it open (torch keeps it open from creation to removal).

The ops and the stamp live in ``TORCH_EXTENSIONS_DIR`` (``<venv>/torch_extensions``, see
:func:`set_environment`); :func:`course_lib.deepspeed.schema.import_deepspeed` calls both.
"""

from __future__ import annotations

import copy
import functools
import glob
import json
import os
import shutil
import sys
import sysconfig
import time

# The C++ ops built, in order; DeepSpeed's builder class names (deepspeed/ops/op_builder/cpu/).
OPS = ("ShareMemCommBuilder", "PinMemoryBuilder", "AsyncIOBuilder")
_STAMP = ".course_ops_built"
_LOCK = ".course_ops.lock"
_CPU_INFO = ".course_cpuinfo.json"


def set_environment() -> None:
    """Before ``import deepspeed``: its CPU accelerator unless CUDA is here (``DS_ACCELERATOR``, read at
    import), and its JIT-built ops cached per Python environment (``TORCH_EXTENSIONS_DIR`` =
    ``<venv>/torch_extensions`` unless set: torch keys the cache by op name only, so two clones'
    environments sharing ``~/.cache`` would rebuild each other's ops), built and loaded by this environment's own
    ``ninja`` where it has one (:func:`_own_ninja_first`)."""
    if "DS_ACCELERATOR" not in os.environ:
        import torch

        if not torch.cuda.is_available():
            os.environ["DS_ACCELERATOR"] = "cpu"
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", _default_extensions_dir())
    _own_ninja_first()
    _remember_cpu_info()


def _cpu_identity() -> str:
    """The lines of ``/proc/cpuinfo`` that name the CPU and its instruction sets (not its clock); "" off Linux."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            return "\n".join(sorted({line.strip() for line in info
                                     if line.startswith(("vendor_id", "cpu family", "model", "flags"))}))
    except OSError:
        return ""


def _remember_cpu_info() -> None:
    """Make py-cpuinfo's ``get_cpu_info`` answer from memory. DeepSpeed asks it when it loads an op (its builders'
    ``-march`` and SIMD flags: twice per process that loads the ops) and in ``DeepSpeedCPUAdam``; each answer runs
    a Python subprocess, 1.2 s of CPU here (2026-12-06). The answer is kept in this process (and the processes it
    forks) and in ``TORCH_EXTENSIONS_DIR`` beside the ops, read back while ``/proc/cpuinfo`` names the same CPU
    (:func:`_cpu_identity`), so a copied environment on another CPU asks again. A file that cannot be written (a
    grading sandbox) only leaves the answer in memory."""
    try:
        import cpuinfo
    except ImportError:
        return
    if hasattr(cpuinfo.get_cpu_info, "__wrapped__"):
        return
    ask, memo = cpuinfo.get_cpu_info, {}

    @functools.wraps(ask)
    def get_cpu_info():
        if "answer" not in memo:
            identity = _cpu_identity()
            path = os.path.join(_extensions_dir(), _CPU_INFO)
            try:
                with open(path, encoding="utf-8") as kept:
                    saved = json.load(kept)
                if identity and saved.get("cpu") == identity:
                    memo["answer"] = saved["answer"]
            except (OSError, ValueError, KeyError, AttributeError):
                pass
            if "answer" not in memo:
                memo["answer"] = ask()
                if identity:
                    try:
                        from course_lib.safe_files import write_atomic

                        write_atomic(path, json.dumps({"cpu": identity, "answer": memo["answer"]}))
                    except OSError:
                        pass
        return copy.deepcopy(memo["answer"])  # a caller may change what it gets

    cpuinfo.get_cpu_info = get_cpu_info


def _own_ninja_first() -> None:
    """Put this environment's scripts folder first on ``PATH`` when pip put a ``ninja`` there: torch runs the
    ``ninja`` it finds on ``PATH`` to build an op and again at every load, and a ninja of another version does
    not accept the build log the other wrote, so it rebuilds every op (minutes on 2 cores). Debian 13 has
    /usr/bin/ninja 1.11 beside pip's 1.13: ``make`` puts the venv's first, a pytest run without ``make`` did not,
    and each switch rebuilt all three ops."""
    scripts = sysconfig.get_path("scripts")
    path = os.environ.get("PATH", "").split(os.pathsep)
    if os.access(os.path.join(scripts, "ninja"), os.X_OK) and path[:1] != [scripts]:
        os.environ["PATH"] = os.pathsep.join([scripts, *(p for p in path if p != scripts)])


def _default_extensions_dir() -> str:
    return os.path.join(sys.prefix, "torch_extensions")


def _extensions_dir() -> str:
    return os.environ.get("TORCH_EXTENSIONS_DIR", _default_extensions_dir())


def built() -> bool:
    """Whether :func:`ensure_built` has run to the end in this environment."""
    return os.path.exists(os.path.join(_extensions_dir(), _STAMP))


def _held(path: str) -> bool | None:
    """Whether some process has ``path`` open (Linux: ``/proc/<pid>/fd``); None where that cannot be seen."""
    if not os.path.isdir("/proc/self/fd"):
        return None
    target = os.stat(path)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:                      # gone, or another user's (who cannot build in this venv)
            continue
        for fd in fds:
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                return True
    return False


def clear_stale_locks(settle: float = 1.0) -> list[str]:
    """Remove torch's build locks (``<TORCH_EXTENSIONS_DIR>/<op>/lock``) that no process holds open -- left by
    a build or load that was killed -- saying so in one line each; the paths removed. A lock seen unheld is
    looked at again after ``settle`` seconds (torch's ``FileBaton.release`` closes the file, then removes
    it: a live release is done by then). Where holders cannot be seen (no ``/proc``), the line says how to
    remove it by hand."""
    removed = []
    for lock in glob.glob(os.path.join(_extensions_dir(), "*", "lock")):
        try:
            if _held(lock) is None:
                print(f"note: if no DeepSpeed op is building, remove {lock} (a killed build leaves it; the next "
                      "build waits for it forever)", file=sys.stderr, flush=True)
                continue
            first = os.stat(lock).st_ino
            if _held(lock):
                continue
            time.sleep(settle)
            if os.stat(lock).st_ino != first or _held(lock):
                continue
            os.remove(lock)
        except FileNotFoundError:            # released meanwhile
            continue
        removed.append(lock)
        print(f"note: removed {lock}, torch's build lock left by a DeepSpeed op build or load that was killed "
              "(no process holds it)", file=sys.stderr, flush=True)
    return removed


def build_ops() -> list[str]:
    """Build (or find, in the cache) every op of :data:`OPS` that can be built here; their names."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        raise RuntimeError("DeepSpeed compiles its CPU ops with g++, which is missing: run "
                           "'sudo apt-get install g++ libaio-dev' (macOS: xcode-select --install)")
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        raise RuntimeError(f"DeepSpeed's ops compile against Python's headers (Python.h), which are missing for "
                           f"Python {sysconfig.get_python_version()}: run 'sudo apt-get install python3-dev'")
    from deepspeed.accelerator import get_accelerator

    names = []
    for name in OPS:
        builder = get_accelerator().create_op_builder(name)
        if builder is not None and builder.is_compatible(verbose=False):
            builder.load(verbose=False)
            names.append(builder.NAME)
    return names


def ensure_built() -> None:
    """Build DeepSpeed's ops once per environment (say so on stderr while it runs); a no-op once built.

    Called with ``deepspeed`` imported and ``TORCH_EXTENSIONS_DIR`` set. On CUDA, DeepSpeed builds
    its GPU ops itself, on first use: nothing is built here. Every call first clears torch's stale build
    locks (:func:`clear_stale_locks`), since DeepSpeed loads the ops through them later, built or not."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != "cpu":
        return
    clear_stale_locks()
    if built():
        return
    import fcntl

    os.makedirs(_extensions_dir(), exist_ok=True)
    with open(os.path.join(_extensions_dir(), _LOCK), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)    # a second process waits here while the first builds
        if built():
            return
        clear_stale_locks()                 # a build that held this lock was killed while we waited
        print("building DeepSpeed's C++ ops with g++ (once for this environment; minutes on 2 cores) ...",
              file=sys.stderr, flush=True)
        start = time.perf_counter()
        names = build_ops()
        with open(os.path.join(_extensions_dir(), _STAMP), "w") as stamp:
            stamp.write(" ".join(names) + "\n")
        print(f"DeepSpeed's ops are ready ({', '.join(names)}; {time.perf_counter() - start:.0f} s)",
              file=sys.stderr, flush=True)


if __name__ == "__main__":      # make test: build them before the notebooks run
    set_environment()
    import deepspeed  # noqa: F401

    try:
        ensure_built()
    except RuntimeError as exc:
        sys.exit(f"error: {str(exc).splitlines()[0]}")
    with open(os.path.join(_extensions_dir(), _STAMP)) as f:
        print(f"DeepSpeed's ops are built: {f.read().strip()}")
