"""Rank functions for launch_cost.py (in a module, so torchrun can import them)."""

import time

import torch
import torch.distributed as dist


def noop():
    return dist.get_rank()


def crash_at(delay=0.5):
    time.sleep(delay)
    if dist.get_rank() == 1:
        raise RuntimeError(f"raised at {time.time():.6f}")
    dist.all_reduce(torch.ones(1))
