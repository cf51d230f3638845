"""How long does RankGrid take to build every group of a very large grid?

Goal (issue 3): all groups of a 65,536-rank grid (tp 8, pp 16, cp 2 -> dp 256) in
about a second. Run: ``python benchmarks/topology_groups.py``.
"""

import time

from course_lib.topology import MEGATRON_GROUPS, RankGrid


def main(world_size=65536, tp=8, pp=16, cp=2, repeats=3):
    tokens = list(MEGATRON_GROUPS)  # every group initialize_model_parallel builds from the dense grid
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        grid = RankGrid(world_size, tp=tp, pp=pp, cp=cp)  # fresh grid: no cache
        groups = {t: grid.groups(t) for t in tokens}      # as Python lists, like Megatron's
        best = min(best, time.perf_counter() - t0)
    members = sum(len(g) for gs in groups.values() for g in gs)
    print(f"{grid!r}")
    print(f"{len(tokens)} group kinds ({', '.join(tokens)})")
    print(f"{sum(len(gs) for gs in groups.values())} groups, {members} memberships")
    print(f"best of {repeats}: {best:.3f} s  (goal: about 1 s)")
    t0 = time.perf_counter()
    for r in range(0, world_size, world_size // 64):
        grid.rank_of(**grid.coords(r))
    print(f"coords + rank_of: {(time.perf_counter() - t0) / 64 * 1e6:.1f} us per rank")
    return best


if __name__ == "__main__":
    main()
