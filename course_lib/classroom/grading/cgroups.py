"""A run's control group (Linux, as root): a cap on its processes and on the memory of all of them together,
and a kill that reaches every process in it, however it forked or re-parented.

``RLIMIT_NPROC`` does not apply to root and ``RLIMIT_AS`` is per process, so a grader running as root gives
each run a group of its own in the ``pids`` and ``memory`` controllers (cgroup v2's unified hierarchy, else
v1's per-controller ones), beneath the grader's own groups: ``pids.max`` stops a fork bomb at
``tasks`` tasks (:data:`PIDS_MAX` by default; a test lowers it); ``memory.max`` (v1: ``memory.limit_in_bytes``) bounds the sum, and the kernel's OOM
killer acts inside the group only. :meth:`RunGroup.kill` sends SIGKILL to every member until the group is
empty, then removes it; :func:`remove_groups_of_ended` removes the groups a grader that was killed (SIGKILL
leaves it no time to) left behind. Where the hierarchy is not writable (not root, a read-only cgroup mount), nothing is
created and :attr:`RunGroup.controllers` is empty: the caller says so.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

PIDS_MAX = 2048
"""Tasks (processes and threads: pids.max counts both) one run may have at once, by default. Lab 09's solution peaks
at 788 (measured, 4 ranks of torch and gloo threads); 512 failed it with EAGAIN. A fork bomb fills the cap: on 2 cores
2048 tasks are a load of ~1000 for seconds, which is why a test of containment lowers it."""
_ROOT = Path("/sys/fs/cgroup")


def _own_groups() -> dict[str, Path]:
    """``{controller: this process's group folder}`` for ``pids`` and ``memory`` where they are mounted."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return {}
    found = {}
    for line in lines:
        _, names, path = line.split(":", 2)
        if names == "" and (_ROOT / "cgroup.controllers").is_file():  # v2, the unified hierarchy at the root
            try:
                enabled = (_ROOT / path.lstrip("/") / "cgroup.controllers").read_text().split()
            except OSError:
                enabled = []
            found.update({c: _ROOT / path.lstrip("/") for c in ("pids", "memory") if c in enabled})
        for controller in ("pids", "memory"):
            if controller in names.split(",") and (_ROOT / controller).is_dir():
                found.setdefault(controller, _ROOT / controller / path.lstrip("/"))
    return found


class RunGroup:
    """The group ``name`` of one run, made now (an existing one of that name is emptied first): at most ``tasks``
    tasks, ``memory_bytes`` of memory for all of them together."""

    def __init__(self, name: str, memory_bytes: int, tasks: int = PIDS_MAX):
        self.folders: dict[str, Path] = {}
        if os.geteuid() != 0:
            return
        for controller, parent in _own_groups().items():
            folder = parent / name
            try:
                folder.mkdir(exist_ok=True)
                if controller == "pids":
                    (folder / "pids.max").write_text(str(tasks))
                elif (folder / "memory.max").exists():
                    (folder / "memory.max").write_text(str(memory_bytes))
                    if (folder / "memory.swap.max").exists():
                        (folder / "memory.swap.max").write_text("0")
                else:
                    (folder / "memory.limit_in_bytes").write_text(str(memory_bytes))
            except OSError:
                continue
            self.folders[controller] = folder

    @property
    def controllers(self) -> list[str]:
        return sorted(self.folders)

    def enter(self) -> None:
        """Put the calling process (and so all it starts from now on) into the group; a controller that refuses
        it is said on the run's output (its cap then does not hold for this run)."""
        for controller, folder in self.folders.items():
            try:
                (folder / "cgroup.procs").write_text("0")
            except OSError as err:
                print(f"the run is not in its {controller} group: {err}")

    def members(self) -> set[int]:
        return _members(self.folders.values())

    def kill(self, timeout: float = 10.0) -> None:
        """SIGKILL every member until none is left (a process forking as it is killed lands in the group too),
        then remove the group."""
        _kill_and_remove(list(self.folders.values()), timeout)


def _members(folders) -> set[int]:
    pids = set()
    for folder in folders:
        try:
            pids |= {int(p) for p in (folder / "cgroup.procs").read_text().split()}
        except OSError:
            pass
    return pids


def _kill_and_remove(folders: list[Path], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _members(folders) and time.monotonic() < deadline:
        for pid in _members(folders):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)
    for folder in folders:
        for _ in range(50):  # the last members may take a moment to leave after they died
            try:
                folder.rmdir()
                break
            except OSError:
                time.sleep(0.02)


def remove_groups_of_ended(prefix: str) -> None:
    """Kill and remove the groups ``<prefix><pid>-<n>`` beneath this process's own whose ``<pid>`` (the process that
    made them) has ended: a grader killed with SIGKILL could not remove its runs' groups."""
    if os.geteuid() != 0:
        return
    for controller, parent in _own_groups().items():
        for folder in parent.glob(f"{prefix}*-*"):
            owner = folder.name[len(prefix):].split("-", 1)[0]
            if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                _kill_and_remove([folder])
