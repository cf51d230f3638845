"""Linux seccomp, through ``ctypes``: a process that can open no new socket, and one that can start no new process.

:func:`deny_new_sockets` installs a seccomp filter (``prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)``, unprivileged
once ``PR_SET_NO_NEW_PRIVS`` is set) on this process and every process it starts afterwards: ``socket(2)`` and
``socketpair(2)`` fail with ``EPERM``; every other system call is allowed, and a call made through another
architecture's entry (a 32-bit ``int 0x80`` from a 64-bit process) fails with ``EPERM`` whatever it is. The
sockets already open keep working. A checked rank's student process uses it
(:mod:`course_lib.classroom.checks.student_process`): its ops reach the other ranks only through the rank,
which records them, so a connection of its own to another rank's student process would be a wire nobody records.

:func:`deny_new_processes` installs a second filter: ``fork(2)``, ``vfork(2)`` and ``clone(2)`` without
``CLONE_THREAD`` fail with ``EPERM``, ``clone3(2)`` with ``ENOSYS`` (its flags are in memory a filter cannot
read; glibc then falls back to ``clone``, so threads still start), and every x32 entry (a number with bit 30) with
``EPERM``. Threads share the process's memory; a new process would not: the student process's peak memory, which
its rank reads from ``/proc``, would miss what a child computed.

Only x86-64 and AArch64 Linux are known here; elsewhere nothing is installed and :func:`deny_new_sockets` says so
by returning False. The BPF program follows ``linux/seccomp.h`` and ``linux/filter.h``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_LD_W_ABS, _JEQ_K, _JSET_K, _RET_K = 0x20, 0x15, 0x45, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K,
#                                                             BPF_JMP|BPF_JSET|BPF_K, BPF_RET|BPF_K
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_NR_OFFSET, _ARCH_OFFSET, _ARG0_OFFSET = 0, 4, 16  # struct seccomp_data: int nr; __u32 arch; __u64 ip; __u64 args[6]
_CLONE_THREAD = 0x00010000
_X32 = 0x40000000  # x86-64's x32 entry: the same numbers with this bit set
_ARCHES = {  # machine: (AUDIT_ARCH_*, socket, socketpair)
    "x86_64": (0xC000003E, 41, 53),
    "aarch64": (0xC00000B7, 198, 199),
}
_PROCESS_CALLS = {  # machine: (clone, clone3, [fork, vfork]); clone's first argument is its flags on both
    "x86_64": (56, 435, [57, 58]),
    "aarch64": (220, 435, []),
}


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


def _program(arch: int, numbers: list[int]) -> list[tuple]:
    """The filter: another architecture's entry -> EPERM; one of ``numbers`` -> EPERM; anything else allowed."""
    deny = (_RET_K, 0, 0, _ERRNO | errno.EPERM)
    body = [(_LD_W_ABS, 0, 0, _ARCH_OFFSET),
            (_JEQ_K, 1, 0, arch),  # the native entry: go on to the number
            deny,
            (_LD_W_ABS, 0, 0, _NR_OFFSET)]
    for i, number in enumerate(numbers):
        left = len(numbers) - i - 1  # checks after this one
        body.append((_JEQ_K, left + 1, 0, number))  # -> the deny after the allow
    return body + [(_RET_K, 0, 0, _ALLOW), deny]


def deny_new_sockets() -> bool:
    """Install the filter on this process (see the module docstring); False where it is not known or refused."""
    known = _ARCHES.get(platform.machine())
    if known is None or os.uname().sysname != "Linux":
        return False
    arch, socket_nr, socketpair_nr = known
    numbers = [socket_nr, socketpair_nr] + ([socket_nr | _X32, socketpair_nr | _X32] if arch == 0xC000003E else [])
    return _install(_program(arch, numbers))


def _install(instructions: list[tuple]) -> bool:
    """Install the BPF ``instructions`` as a seccomp filter on this process (no new privileges first)."""
    array = (_Filter * len(instructions))(*[_Filter(*ins) for ins in instructions])
    program = _Program(len(instructions), array)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return False
    return libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0) == 0


def _process_program(arch: int, clone: int, clone3: int, forks: list[int]) -> list[tuple]:
    """The filter of :func:`deny_new_processes`: another architecture's entry, an x32 entry, ``fork``/``vfork``
    and ``clone`` without ``CLONE_THREAD`` -> EPERM; ``clone3`` -> ENOSYS; anything else allowed."""
    allow, deny = (_RET_K, 0, 0, _ALLOW), (_RET_K, 0, 0, _ERRNO | errno.EPERM)
    body = [(_LD_W_ABS, 0, 0, _ARCH_OFFSET),
            (_JEQ_K, 1, 0, arch),
            deny,
            (_LD_W_ABS, 0, 0, _NR_OFFSET),
            (_JSET_K, 0, 1, _X32),
            deny,
            (_JEQ_K, 0, 1, clone3),
            (_RET_K, 0, 0, _ERRNO | errno.ENOSYS)]
    for number in forks:
        body += [(_JEQ_K, 0, 1, number), deny]
    return body + [(_JEQ_K, 1, 0, clone),
                   allow,
                   (_LD_W_ABS, 0, 0, _ARG0_OFFSET),  # the flags' low 32 bits (little-endian): CLONE_THREAD is there
                   (_JSET_K, 1, 0, _CLONE_THREAD),
                   deny,
                   allow]


def deny_new_processes() -> bool:
    """Install the filter of :func:`_process_program` on this process (threads still start); False where it is
    not known or refused."""
    known = _PROCESS_CALLS.get(platform.machine())
    if known is None or os.uname().sysname != "Linux":
        return False
    return _install(_process_program(_ARCHES[platform.machine()][0], *known))
