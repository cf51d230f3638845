"""This rank's process groups, created once from a :class:`~course_lib.topology.RankGrid` and passed in.

The explicit counterpart of Megatron-LM's ``megatron/core/parallel_state.py``
(``initialize_model_parallel`` fills module-level globals such as
``_TENSOR_MODEL_PARALLEL_GROUP``), picotron's ``ProcessGroupManager`` and
nanotron's ``ParallelContext``: the same groups, built in the same order, but
returned as a value that every layer, loss and schedule receives as an argument
-- no hidden global state, so several layouts can live in one process (a test,
a notebook) and every function says which group it talks over.

* :func:`new_groups` -- any set of tokens of a grid (``"tp"``, ``"cp"``,
  ``"dp-cp"``, ...): every rank creates every group of each token, in the same
  order (``torch.distributed.new_group`` is collective over the whole world),
  and keeps the ones it belongs to. Lab 01's ``make_groups`` exercise, with a
  timeout on every group.
* :func:`new_process_groups` -- the full set a training run needs, as a
  :class:`ProcessGroups` (tp, cp, pp, dp-cp, model, embedding, and this rank's
  coordinates).

Every group carries a timeout (gloo's and NCCL's default is 30 minutes), so a
rank that stops answering fails the collective instead of hanging it.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Iterable

import torch.distributed as dist

from course_lib.topology import RankGrid

__all__ = ["ProcessGroups", "new_groups", "new_process_groups", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 300.0
"""Seconds a collective may wait for the other ranks of its group before it fails."""


@dataclass
class ProcessGroups:
    """This rank's process groups and coordinates in the Megatron grid (every field explicit).

    ``tp``, ``cp``, ``pp``, ``dp_cp`` (Megatron's ``_DATA_PARALLEL_GROUP_WITH_CP``: gradient
    averaging), ``model`` (``tp-pp``, Megatron's ``_MODEL_PARALLEL_GROUP``: the gradient norm)
    and ``embedding`` (first and last pipeline stage; ``None`` on middle stages).
    ``coords``: ``{'tp', 'cp', 'dp', 'pp'}`` ranks; ``pp_ranks``: global ranks of my pipeline.
    """

    grid: RankGrid
    rank: int
    coords: dict
    tp: object
    cp: object
    pp: object
    dp_cp: object
    model: object
    embedding: object
    pp_ranks: list

    @property
    def is_first_stage(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.grid.pp - 1


# ProcessGroups field -> the grid token of its groups, in Megatron's creation order.
_FIELD_TOKENS = {"tp": "tp", "cp": "cp", "pp": "pp", "dp_cp": "dp-cp", "model": "tp-pp", "embedding": "embedding"}


def _check_world(grid: RankGrid) -> int:
    """This rank's global rank, after checking that the running world is the grid's."""
    if not dist.is_initialized():
        raise ValueError("torch.distributed is not initialised: run under torchrun or course_lib.launch.launch")
    if dist.get_world_size() != grid.world_size:
        raise ValueError(f"the grid has world_size={grid.world_size} but {dist.get_world_size()} ranks are running")
    return dist.get_rank()


def new_groups(grid: RankGrid, tokens: Iterable[str], timeout: float = DEFAULT_TIMEOUT) -> dict:
    """``{token: this rank's group}`` for each token of ``grid`` (``None`` where it is in none of them).

    Collective: every rank calls it with the same arguments. Groups are created token by token,
    each distinct rank list once (``dp-cp`` equals ``dp`` when cp=1; ``embedding`` equals ``pp``
    when pp=2), all with ``timeout`` seconds -- the walk of Megatron's ``initialize_model_parallel``.
    """
    rank = _check_world(grid)
    tokens = list(tokens)
    wait = datetime.timedelta(seconds=timeout)
    made: dict = {}
    mine: dict = {}
    for token in tokens:
        mine[token] = None
        for ranks in grid.groups(token):
            key = tuple(ranks)
            if key not in made:
                made[key] = dist.new_group(list(ranks), timeout=wait)
            if rank in ranks:
                mine[token] = made[key]
    return mine


def new_process_groups(grid: RankGrid, timeout: float = DEFAULT_TIMEOUT) -> ProcessGroups:
    """Create every group a training run of ``grid`` needs (collective) and return this rank's.

    The tokens of :class:`ProcessGroups`' fields, in Megatron's order, through :func:`new_groups`."""
    rank = _check_world(grid)
    by_token = new_groups(grid, _FIELD_TOKENS.values(), timeout)
    mine = {name: by_token[token] for name, token in _FIELD_TOKENS.items()}
    return ProcessGroups(grid=grid, rank=rank, coords=grid.coords(rank), pp_ranks=grid.group_of(rank, "pp"),
                         **mine)
