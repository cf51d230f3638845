"""Launch cost of 2/4/8 ranks in each mode, and the time from a crash to the error.

    .venv/bin/python benchmarks/launch_cost.py [--skip-torchrun]

Prints figures; asserts nothing (speed goals are read, not tested).
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from course_lib.launch import RankError, launch  # noqa: E402
from launch_cost_ranks import crash_at, noop  # noqa: E402


def timed(call, repeats):
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def crash_to_error(launcher, world_size):
    """Seconds from rank 1's raise to the RankError in this process."""
    t0 = time.time()
    try:
        launch(crash_at, world_size=world_size, launcher=launcher, output="none", timeout=60, delay=0.5)
    except RankError as err:
        raised_at = float(err.traceback.strip().splitlines()[-1].split("raised at ")[1])
        return time.time() - raised_at
    raise AssertionError("rank 1 was expected to fail")


def main():
    modes = ["fork"] if "--skip-torchrun" in sys.argv else ["fork", "torchrun"]
    print(f"{'launcher':<9} {'ranks':>5} {'launch+run (s)':>15} {'crash->error (s)':>17}")
    for mode in modes:
        for world in (2, 4, 8):
            cost = timed(lambda: launch(noop, world_size=world, launcher=mode, output="none"),
                         repeats=5 if mode == "fork" else 1)
            lag = crash_to_error(mode, world)
            print(f"{mode:<9} {world:>5} {cost:>15.3f} {lag:>17.3f}")


if __name__ == "__main__":
    main()
