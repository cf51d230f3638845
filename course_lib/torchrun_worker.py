"""The per-rank program that ``launch(..., launcher="torchrun")`` runs under torchrun.

``python -m course_lib.torchrun_worker JOB_DIR``: reads ``JOB_DIR/job.pkl``
(module, qualname, kwargs, backend, timeout), initialises the process group from
torchrun's environment, runs the function and writes ``rank{r}.pkl`` (the return
value) or ``rank{r}.err`` (exception name, traceback, time), with the rank's
output in ``rank{r}.out``; a rank still running at the timeout writes
``rank{r}.timeout`` and exits.
"""

import importlib
import os
import pickle
import sys
import threading
import time
import traceback
from pathlib import Path

from course_lib.launch import _redirect_output, init_rank


def _hung(job_path: Path, rank: int) -> None:
    (job_path / f"rank{rank}.timeout").touch()
    sys.stdout.flush()
    os._exit(124)


def main(job_dir: str) -> int:
    job_path = Path(job_dir)
    rank = int(os.environ["RANK"])
    _redirect_output(str(job_path / f"rank{rank}.out"))
    job = pickle.loads((job_path / "job.pkl").read_bytes())
    try:
        import torch

        if job["backend"] == "gloo":
            torch.set_num_threads(1)
        init_rank(rank, int(os.environ["WORLD_SIZE"]), job["backend"], job["timeout"])
        fn = importlib.import_module(job["module"])
        for part in job["qualname"].split("."):
            fn = getattr(fn, part)
        # torchrun waits for a rank forever: one that runs past the timeout
        # (counted, like the group's, once the group is up) ends itself, so
        # torchrun tears the others down and the launcher reports it.
        watchdog = threading.Timer(job["timeout"], _hung, args=(job_path, rank))
        watchdog.daemon = True
        watchdog.start()
        value = fn(**job["kwargs"])
        watchdog.cancel()
        (job_path / f"rank{rank}.pkl").write_bytes(pickle.dumps(value))
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, end="")
        (job_path / f"rank{rank}.err").write_bytes(pickle.dumps((type(exc).__name__, tb, time.time())))
        return 1
    finally:
        sys.stdout.flush()
    try:
        # Leave together: a rank that exits early breaks peers still talking
        # to it. Failing here (a peer failed or hung) changes nothing: this
        # rank's result is saved and the peer's problem is reported.
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
