"""Linux Landlock, through ``ctypes``: what a student's notebook may read, write and signal.

Landlock (Linux >= 5.13, unprivileged) restricts a process and every process it starts afterwards,
for good: :func:`restrict` allows reading (and executing) only beneath the given ``read`` paths,
writing only beneath ``write`` (and to the single files ``write_files``, such as ``/dev/null``), and,
where the kernel has it (Landlock ABI >= 6, Linux >= 6.12), no signal to any process outside the
restricted tree (the grader, other students' runs, the instructor's other programs). A path that
does not exist is skipped. Network access is not restricted (the ranks talk TCP on localhost).

Off Linux, or on a kernel without Landlock, nothing is restricted and :func:`restrict` says so by
returning 0: the grader prints that once, so an instructor knows the file system is not fenced.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Iterable

_CREATE_RULESET, _ADD_RULE, _RESTRICT_SELF = 444, 445, 446  # the same numbers on every architecture
_VERSION = 1 << 0
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
_SCOPE_SIGNAL = 1 << 1

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_MAKE_AND_REMOVE = sum(1 << bit for bit in range(4, 13))  # remove dir/file, make char/dir/reg/sock/fifo/block/sym
_REFER, _TRUNCATE = 1 << 13, 1 << 14
READ = EXECUTE | READ_FILE | READ_DIR


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def abi_version() -> int:
    """The kernel's Landlock ABI version, 0 when there is none."""
    libc = _libc()
    if libc is None or not os.uname().sysname == "Linux":
        return 0
    version = libc.syscall(_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_VERSION))
    return max(0, version)


def _handled(abi: int) -> int:
    rights = READ | WRITE_FILE | _MAKE_AND_REMOVE
    if abi >= 2:
        rights |= _REFER
    if abi >= 3:
        rights |= _TRUNCATE
    return rights


def restrict(read: Iterable[Path], write: Iterable[Path], write_files: Iterable[Path] = ()) -> int:
    """Restrict this process, and all it starts from now on, to reading beneath ``read`` and ``write``, writing
    beneath ``write`` and to ``write_files``, and (ABI >= 6) signalling only processes restricted with it.

    Returns the Landlock ABI version used; 0 when Landlock is unavailable (nothing was restricted). Raises
    ``OSError`` when Landlock is there but refuses the rules (the caller must then not run the notebook)."""
    abi = abi_version()
    if abi == 0:
        return 0
    libc = _libc()
    handled = _handled(abi)
    attr = _RulesetAttr(handled, 0, _SCOPE_SIGNAL if abi >= 6 else 0)
    ruleset = libc.syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)),
                           ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        file_rights = READ_FILE | WRITE_FILE | (_TRUNCATE if abi >= 3 else 0)
        rules = [(p, READ) for p in read] + [(p, handled) for p in write] + [(p, file_rights) for p in write_files]
        for path, rights in rules:
            _allow(libc, ruleset, Path(path), rights)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.syscall(_RESTRICT_SELF, ruleset, 0) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)
    _RESTRICTED["read"] = [*map(str, read), *map(str, write)]
    return abi


_RESTRICTED: dict = {"read": None}
"""What :func:`restrict` left this process able to read (None: not restricted): a ruleset built later
(:func:`reading_denied_ruleset`) allows only within it, since it cannot list folders outside it."""


def allowed_except(paths: Iterable, deny: Iterable) -> list[str]:
    """``paths`` (resolved) with every one that holds a denied path replaced by its other entries, down to the
    denied paths: a Landlock rule allows a whole tree, so a folder that holds ``solutions/`` is allowed entry
    by entry (links are left out: a rule would follow them)."""
    denied = [Path(d).resolve() for d in deny]
    out, todo = [], [Path(p).resolve() for p in paths]
    while todo:
        path = todo.pop()
        if not path.exists() or any(path == d or path.is_relative_to(d) for d in denied):
            continue
        if any(d.is_relative_to(path) for d in denied):
            todo += [child for child in path.iterdir() if not child.is_symlink()]
        else:
            out.append(str(path))
    return sorted(set(out))


def _allow(libc, ruleset: int, path: Path, rights: int) -> None:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return  # a path this machine does not have
    try:
        if not os.path.isdir(path):
            rights &= READ_FILE | WRITE_FILE | EXECUTE | _TRUNCATE  # what a rule on a file may allow
        beneath = _PathBeneathAttr(rights, fd)
        if libc.syscall(_ADD_RULE, ruleset, _RULE_PATH_BENEATH, ctypes.byref(beneath), 0) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for {path}")
    finally:
        os.close(fd)


def reading_denied_ruleset(denied: Iterable[Path]) -> int:
    """A Landlock ruleset (its file descriptor; -1 without Landlock) that lets a process read every file
    except those beneath ``denied``: Landlock only allows, so the rules allow reading beneath every entry
    of each denied path's ancestors that leads to no denied path. Only reading files is handled (listing
    directories, writing and running stay as they were). Files created later directly inside such an
    ancestor are not readable either; -1 where an ancestor cannot be listed. In a process :func:`restrict`
    already fenced (the judge inside ``grade``'s sandbox, which may not list ``/``), the rules allow what the
    fence allows, less the denied paths (:func:`allowed_except`). Apply it with :func:`restrict_self` (in a
    forked child, say)."""
    abi = abi_version()
    if abi == 0:
        return -1
    if _RESTRICTED["read"] is not None:
        return _ruleset_reading(allowed_except(_RESTRICTED["read"], denied))
    denied = {Path(os.path.realpath(p)) for p in denied if os.path.exists(p)}
    keep = set()  # the denied paths and their ancestors: no rule beneath them
    for path in denied:
        keep.add(path)
        keep.update(path.parents)
    allowed = []
    for folder in sorted(p for p in keep if p not in denied):
        try:
            entries = os.listdir(folder)
        except OSError:  # a folder this process may not list: rules that cannot name its other entries would
            return -1    # deny them all; no ruleset instead
        for entry in entries:
            path = folder / entry
            if path in keep:
                continue
            if path.is_symlink():  # a rule follows the link: none for one that leads to a denied file
                real = Path(os.path.realpath(path))
                if real in keep or any(d in real.parents for d in denied):
                    continue
            allowed.append(path)
    return _ruleset_reading(allowed)


def _ruleset_reading(paths: list) -> int:
    """A ruleset that handles only reading files and allows it beneath ``paths``."""
    libc = _libc()
    attr = _RulesetAttr(READ_FILE, 0, 0)
    ruleset = libc.syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)),
                           ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    for path in paths:
        _allow(libc, ruleset, Path(path), READ_FILE)
    return ruleset


_SCOPE_ABSTRACT_UNIX = 1 << 0


def deny_writes_and_signals() -> list[str]:
    """Restrict this process (and what it starts from now on) to writing no file anywhere (files already open
    stay writable: stdout, pipes) and, with ABI >= 6, to signalling and reaching abstract unix sockets only
    inside its own new domain. What was denied, in words (empty without Landlock). A checked rank's student
    process uses it: a file shared with another rank's student process would be a channel off the recorded wire."""
    abi = abi_version()
    if abi == 0:
        return []
    libc = _libc()
    writes = _handled(abi) & ~READ
    scoped = _SCOPE_SIGNAL | _SCOPE_ABSTRACT_UNIX if abi >= 6 else 0
    attr = _RulesetAttr(writes, 0, scoped)
    ruleset = libc.syscall(_CREATE_RULESET, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)),
                           ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        restrict_self(ruleset)
    finally:
        os.close(ruleset)
    return ["no file written"] + (["no signal or abstract unix socket outside it"] if scoped else [])


def restrict_self(ruleset: int) -> bool:
    """Restrict this process (and what it starts from now on) by ``ruleset``; False without Landlock."""
    if ruleset < 0:
        return False
    libc = _libc()
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or libc.syscall(_RESTRICT_SELF, ruleset, 0) != 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    return True
