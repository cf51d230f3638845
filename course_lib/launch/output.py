"""Each rank's captured output: pointed at a file when the rank starts, read back by the
launcher, printed grouped by rank (never interleaved)."""

from __future__ import annotations

import faulthandler
import os
import sys
from typing import Sequence


def tail(text: str, lines: int = 15) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


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


def redirect_output(fd: int) -> None:
    """Point this process's stdout/stderr (Python objects and C file descriptors) at the open file ``fd``."""
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    # A forked Jupyter kernel's sys.stdout talks to threads that do not exist in
    # the child; replace it with a plain line-buffered file on fd 1.
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = sys.stdout
    # A crash in native code (segfault, abort) leaves the rank's Python stack in
    # its own output, not in the launching process's.
    faulthandler.enable(file=sys.stderr)


def read_back(file) -> str:
    """All that was written to ``file`` (a temporary file that child processes wrote to
    through descriptors sharing its offset), read without moving that offset."""
    fd = file.fileno()
    return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")
