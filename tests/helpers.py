"""Helpers shared by the tests that run real ranks: their process groups, made the library's way.

Call them inside a rank function (under :func:`course_lib.launch.launch`). Every rank
creates every group of a token in the same order (``torch.distributed.new_group`` is
collective over the world) through :func:`course_lib.process_groups.new_groups`, and every
group gets a timeout, so a broken collective fails its test instead of hanging the suite.
"""

from __future__ import annotations

import torch.distributed as dist

from course_lib.process_groups import new_groups
from course_lib.topology import RankGrid

GROUP_TIMEOUT = 60.0
"""Seconds a test's collective may wait for its peers."""


def rank_groups(*tokens: str, timeout: float = GROUP_TIMEOUT, **sizes) -> dict:
    """``{token: this rank's group}`` for the running world laid out as ``RankGrid(world, **sizes)``.

    ``rank_groups("tp", "cp", tp=2, cp=2)`` on 4 ranks: TP [0,1][2,3], CP [0,2][1,3] (Megatron's order)."""
    return new_groups(RankGrid(dist.get_world_size(), **sizes), tokens, timeout=timeout)


def group_of_one(timeout: float = GROUP_TIMEOUT):
    """A group holding only this rank (every rank creates all of them: the TP groups when tp = 1)."""
    return rank_groups("tp", timeout=timeout)["tp"]
