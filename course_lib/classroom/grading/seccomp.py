"""Linux seccomp, through ``ctypes``: a process that can open no new socket.

:func:`deny_new_sockets` installs a seccomp filter (``prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)``, unprivileged
once ``PR_SET_NO_NEW_PRIVS`` is set) on this process and every process it starts afterwards: ``socket(2)`` and
``socketpair(2)`` fail with ``EPERM``; every other system call is allowed, and a call made through another
architecture's entry (a 32-bit ``int 0x80`` from a 64-bit process) fails with ``EPERM`` whatever it is. The
sockets already open keep working. A checked rank's student process uses it
(:mod:`course_lib.classroom.checks.student_process`): its ops reach the other ranks only through the rank,
which records them, so a connection of its own to another rank's student process would be a wire nobody records.

Only x86-64 and AArch64 Linux are known here; elsewhere nothing is installed and :func:`deny_new_sockets` says so
by returning False. The BPF program follows ``linux/seccomp.h`` and ``linux/filter.h``.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform

_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2
_LD_W_ABS, _JEQ_K, _RET_K = 0x20, 0x15, 0x06  # BPF_LD|BPF_W|BPF_ABS, BPF_JMP|BPF_JEQ|BPF_K, BPF_RET|BPF_K
_ALLOW, _ERRNO = 0x7FFF0000, 0x00050000
_NR_OFFSET, _ARCH_OFFSET = 0, 4  # struct seccomp_data: int nr; __u32 arch; ...
_X32 = 0x40000000  # x86-64's x32 entry: the same numbers with this bit set
_ARCHES = {  # machine: (AUDIT_ARCH_*, socket, socketpair)
    "x86_64": (0xC000003E, 41, 53),
    "aarch64": (0xC00000B7, 198, 199),
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
    instructions = _program(arch, numbers)
    array = (_Filter * len(instructions))(*[_Filter(*ins) for ins in instructions])
    program = _Program(len(instructions), array)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        return False
    return libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0) == 0
