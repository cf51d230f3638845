"""Checker for Lab 00's exercise: a ring all-reduce built only from send/recv.

``check_ring_all_reduce(fn)`` runs ``fn(x)`` on real ranks (world sizes 2, 3
and 4; tensor sizes smaller than, equal to and not divisible by the world
size) and compares it with ``dist.all_reduce``. Collectives are switched off
inside the check, so a solution that calls ``dist.all_reduce`` is caught. It
prints one verdict line and, when wrong, the most specific hint it can find.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.checks import not_attempted
from course_lib.launch import LaunchTimeout, RankError, launch

WORLD_SIZES = (2, 3, 4)
NUMELS = (4, 12, 10, 1)  # multiples of W first, then not divisible, then fewer elements than ranks
_FORBIDDEN = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
              "reduce_scatter_tensor", "reduce_scatter_single", "broadcast", "reduce", "all_to_all",
              "all_to_all_single")


def _forbid_collectives():
    def refuse(name):
        def _refuse(*args, **kwargs):
            raise RuntimeError(f"dist.{name} is not allowed in this exercise: build the ring from "
                               f"dist.send/dist.recv (or isend/irecv, batch_isend_irecv)")
        return _refuse
    for name in _FORBIDDEN:
        setattr(dist, name, refuse(name))


def _rank_trial(fn, numels):
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs = []
    for numel in numels:
        g = torch.Generator().manual_seed(1000 * numel + rank)
        inputs.append(torch.randint(-9, 10, (numel,), generator=g).float())
    expected = []
    for x in inputs:
        y = x.clone()
        dist.all_reduce(y)
        expected.append(y)
    _forbid_collectives()  # from here on only point-to-point is allowed
    results = []
    for x, want in zip(inputs, expected):
        got = fn(x.clone())
        results.append(dict(numel=x.numel(), x=x, want=want, got=got, world=world))
    return results


def diagnose(x: torch.Tensor, want: torch.Tensor, got, world: int) -> str | None:
    """The hint for one rank's wrong result, or None when it is right."""
    if not isinstance(got, torch.Tensor):
        return f"return the reduced tensor (got {type(got).__name__}); e.g. `return torch.cat(chunks)`"
    if got.shape != want.shape:
        return (f"the result has shape {tuple(got.shape)} but the input had {tuple(want.shape)}: "
                f"join the W chunks back together (torch.cat) in chunk order")
    if torch.equal(got, want):
        return None
    if torch.equal(got, x):
        return "the result equals this rank's input: add the chunk you receive to your own chunk"
    if torch.allclose(got, x * world):
        return "the result is your own input times W: add the chunk you *received*, not the one you sent"
    if torch.allclose(got.sum(), want.sum() * 2) or torch.allclose(got, want * 2):
        return "values are doubled: in the all-gather phase replace your chunk with the incoming one, do not add"
    wrong = (got != want).nonzero().flatten().tolist()
    return (f"elements {wrong[:6]}{'...' if len(wrong) > 6 else ''} are wrong: in reduce-scatter step s "
            f"rank r sends chunk (r - s) % W and adds the incoming one to chunk (r - s - 1) % W")


def check_ring_all_reduce(fn, timeout: float = 20) -> bool:
    """Print a verdict on ``fn`` (``fn(x: Tensor[N]) -> Tensor[N]``, the sum over ranks)."""
    for world in WORLD_SIZES:
        try:
            per_rank = launch(_rank_trial, world_size=world, output="none", timeout=timeout, fn=fn,
                              numels=NUMELS)
        except RankError as err:
            if err.exc_type == "NotImplementedError":
                return not_attempted("my_ring_all_reduce")
            print(f"✗ with {world} ranks, rank {err.rank} raised {err.traceback.strip().splitlines()[-1]}")
            if "to itself" in err.traceback or "self" in err.traceback.lower() and "send" in err.traceback:
                print("  hint: the right neighbour is (rank + 1) % W, the left one (rank - 1) % W")
            elif "Connection closed" in err.traceback or "Timed out" in err.traceback:
                print("  hint: every send needs a matching recv on the neighbour in the same step")
            return False
        except LaunchTimeout:
            print(f"✗ with {world} ranks the ranks waited for each other until the timeout: a deadlock.\n"
                  f"  hint: if every rank first calls a blocking dist.send, nobody is receiving. Use "
                  f"dist.isend + dist.recv (then wait), batch_isend_irecv, or let even ranks send first.")
            return False
        for rank, trials in enumerate(per_rank):
            for t in trials:
                hint = diagnose(t["x"], t["want"], t["got"], world)
                if hint:
                    print(f"✗ wrong with {world} ranks on rank {rank} for a tensor of {t['numel']} elements "
                          f"(expected {t['want'].tolist()[:6]}, got "
                          f"{t['got'].tolist()[:6] if isinstance(t['got'], torch.Tensor) else t['got']})")
                    print(f"  hint: {hint}")
                    if t["numel"] < world or t["numel"] % world:
                        print("  (N is not a multiple of W here: torch.tensor_split gives chunks of unequal "
                              "size, some possibly empty)")
                    return False
    print(f"✓ ring_all_reduce equals dist.all_reduce for world sizes {list(WORLD_SIZES)} "
          f"and tensor sizes {list(NUMELS)}, using only point-to-point messages")
    return True
