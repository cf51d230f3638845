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
    # torchrun waits for every rank forever: a rank that hangs ends itself at
    # the timeout, so torchrun tears the others down and the launcher reports it.
    watchdog = threading.Timer(job["timeout"], _hung, args=(job_path, rank))
    watchdog.daemon = True
    watchdog.start()
    try:
        import torch

        if job["backend"] == "gloo":
            torch.set_num_threads(1)
        init_rank(rank, int(os.environ["WORLD_SIZE"]), job["backend"], job["timeout"])
        fn = importlib.import_module(job["module"])
        for part in job["qualname"].split("."):
            fn = getattr(fn, part)
        value = fn(**job["kwargs"])
        (job_path / f"rank{rank}.pkl").write_bytes(pickle.dumps(value))
        return 0
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, end="")
        (job_path / f"rank{rank}.err").write_bytes(pickle.dumps((type(exc).__name__, tb, time.time())))
        return 1
    finally:
        sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
