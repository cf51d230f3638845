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
* :func:`new_moe_process_groups` -- the groups of the MoE layers, as a :class:`MoEGroups`:
  Megatron's expert groups (``_EXPERT_MODEL_PARALLEL_GROUP``, ...) from the grid's expert
  grid, and the dense groups the MoE layer also talks over.

This is the one module that creates process groups (``torch.distributed.new_group``).

Every group carries a timeout (gloo's and NCCL's default is 30 minutes), so a
rank that stops answering fails the collective instead of hanging it.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Iterable

import torch.distributed as dist

from course_lib import comm
from course_lib.topology import RankGrid
from course_lib.rules import UsageError

__all__ = ["ProcessGroups", "MoEGroups", "new_groups", "new_process_groups", "new_moe_process_groups",
           "DEFAULT_TIMEOUT"]

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
        raise UsageError("torch.distributed is not initialised: run under torchrun or course_lib.launch.launch")
    if dist.get_world_size() != grid.world_size:
        raise UsageError(f"the grid has world_size={grid.world_size} but {dist.get_world_size()} ranks are running")
    return dist.get_rank()


def _create(rank: int, rank_lists: dict[str, list[list[int]]], timeout: float) -> dict:
    """``{name: this rank's group (None: in none)}``: every rank creates every group of every name, in
    order (``new_group`` is collective over the world), each distinct rank list once, with ``timeout``."""
    wait = datetime.timedelta(seconds=timeout)
    made: dict = {}
    mine: dict = {}
    for name, lists in rank_lists.items():
        mine[name] = None
        for ranks in lists:
            key = tuple(ranks)
            if key not in made:
                made[key] = dist.new_group(list(ranks), timeout=wait)
            if rank in ranks:
                mine[name] = made[key]
    return mine


def new_groups(grid: RankGrid, tokens: Iterable[str], timeout: float = DEFAULT_TIMEOUT) -> dict:
    """``{token: this rank's group}`` for each token of ``grid`` (``None`` where it is in none of them).

    Collective: every rank calls it with the same arguments. Groups are created token by token,
    each distinct rank list once (``dp-cp`` equals ``dp`` when cp=1; ``embedding`` equals ``pp``
    when pp=2), all with ``timeout`` seconds -- the walk of Megatron's ``initialize_model_parallel``.
    """
    rank = _check_world(grid)
    return _create(rank, {token: grid.groups(token) for token in tokens}, timeout)


def new_process_groups(grid: RankGrid, timeout: float = DEFAULT_TIMEOUT) -> ProcessGroups:
    """Create every group a training run of ``grid`` needs (collective) and return this rank's.

    The tokens of :class:`ProcessGroups`' fields, in Megatron's order, through :func:`new_groups`."""
    rank = _check_world(grid)
    by_token = new_groups(grid, _FIELD_TOKENS.values(), timeout)
    mine = {name: by_token[token] for name, token in _FIELD_TOKENS.items()}
    return ProcessGroups(grid=grid, rank=rank, coords=grid.coords(rank), pp_ranks=grid.group_of(rank, "pp"),
                         **mine)


@dataclass
class MoEGroups:
    """This rank's MoE process groups (every one with a timeout), from :func:`new_moe_process_groups`.

    From the expert grid: ``ep`` (expert-model-parallel: the all-to-all), ``expert_tp`` (the experts'
    tensor parallelism), ``tp_ep`` (the allgather dispatcher's group), ``expert_dp`` (expert gradients),
    ``tp_ep_pp`` (the expert model-parallel group, Megatron's ``_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP``:
    the experts' share of the grad norm). From the dense grid: ``dp_cp`` (dense gradients, Megatron's
    data-parallel group with CP), ``tp_cp`` (the aux-loss statistics), ``pp`` (the metrics' sum over
    stages). ``grid``: the :class:`~course_lib.topology.RankGrid` (with ``ep`` / ``expert_tp``)."""

    grid: RankGrid
    ep: object
    expert_tp: object
    tp_ep: object
    expert_dp: object
    dp_cp: object
    tp_cp: object
    pp: object
    tp_ep_pp: object

    def size(self, name: str) -> int:
        """Ranks in the group ``name`` (a field)."""
        return comm.group_size(getattr(self, name))


# MoEGroups field -> (which grid, token), in creation order.
_MOE_FIELD_TOKENS = {"ep": ("expert", "ep"), "expert_tp": ("expert", "tp"), "tp_ep": ("expert", "tp-ep"),
                     "expert_dp": ("expert", "dp"), "dp_cp": ("dense", "dp-cp"), "tp_cp": ("dense", "tp-cp"),
                     "pp": ("dense", "pp"), "tp_ep_pp": ("expert", "tp-ep-pp")}


def new_moe_process_groups(grid: RankGrid, timeout: float = DEFAULT_TIMEOUT) -> MoEGroups:
    """Create every MoE group of ``grid`` (collective) and return this rank's, as a :class:`MoEGroups`:
    the expert grid's groups (``grid.expert_groups``) and the dense ones the MoE layer needs."""
    rank = _check_world(grid)
    lists = {name: grid.expert_groups(token) if which == "expert" else grid.groups(token)
             for name, (which, token) in _MOE_FIELD_TOKENS.items()}
    return MoEGroups(grid, **_create(rank, lists, timeout))
