"""``%%torchrun``: run a notebook cell as a script on N real ranks.

    %load_ext course_lib
    %%torchrun --nproc-per-node 4
    import torch, torch.distributed as dist
    t = torch.tensor([dist.get_rank()])
    dist.all_reduce(t)
    print(t.item())

The cell is written to a script and run on every rank through
:func:`course_lib.launch.launch` with the process group already initialised
(gloo on CPU, NCCL with one GPU per rank; every group has ``--timeout``). The
cell runs in a fresh namespace, as a torchrun script would: it sees only what
it imports, never the notebook's variables, so the same cell runs unchanged
with ``--launcher torchrun`` or on a GPU box (``torchrun --standalone
--nproc-per-node 4 cell.py`` after an ``init_process_group()`` line). Each
rank's output is printed under its own header (or only rank 0's with
``--rank0-only``); if any rank fails, the cell fails with that rank's traceback.
``sys.exit(0)`` in the cell ends it successfully, as in a script.
"""

from __future__ import annotations

import argparse
import os
import runpy
import shlex
import tempfile

from course_lib.launch import LAUNCHERS, launch
from course_lib.rules import UsageError


def run_script(path: str) -> None:
    """Run a script file as ``__main__`` on this rank (the process group is already up).

    As for a script, ``sys.exit()``, ``sys.exit(0)`` or ``sys.exit(None)`` ends
    it successfully; any other exit status is this rank's failure.
    """
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or exc.code == 0:
            return
        raise RuntimeError(f"the cell called sys.exit({exc.code!r}): an exit status other than 0 is a failure") from None


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="%%torchrun", add_help=False)
    p.add_argument("--nproc-per-node", "--nproc_per_node", "-n", dest="nproc", type=int, default=4)
    p.add_argument("--launcher", choices=LAUNCHERS, default="fork")
    p.add_argument("--backend", default="auto")
    p.add_argument("--timeout", type=float, default=60)
    p.add_argument("--rank0-only", action="store_true")
    return p


def torchrun_cell(line: str, cell: str) -> None:
    """The body of the ``%%torchrun`` magic (usable without IPython, e.g. in tests)."""
    try:
        opts = _parser().parse_args(shlex.split(line))
    except SystemExit:
        raise UsageError(f"%%torchrun {line!r}: usage: %%torchrun [--nproc-per-node N] "
                         f"[--launcher fork|torchrun] [--backend auto|gloo|nccl] [--timeout S] "
                         f"[--rank0-only]") from None
    with tempfile.TemporaryDirectory(prefix="course_cell_") as tmp:
        path = os.path.join(tmp, "cell.py")
        with open(path, "w", encoding="utf-8") as f:
            f.write(cell)
        if opts.launcher == "torchrun":
            print(f"$ torchrun --standalone --nproc-per-node={opts.nproc} cell.py")
        launch(run_script, world_size=opts.nproc, launcher=opts.launcher, backend=opts.backend,
               timeout=opts.timeout, output="rank0" if opts.rank0_only else "all", path=path)


def load_ipython_extension(ipython) -> None:
    from IPython.core.magic import register_cell_magic

    @register_cell_magic("torchrun")
    def _torchrun(line, cell):
        torchrun_cell(line, cell)
