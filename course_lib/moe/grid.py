"""The two rank grids of a Mixture-of-Experts run, exactly as Megatron-core builds them.

Since *MoE parallel folding* (Liu et al. 2025, "MoE Parallel Folding: Heterogeneous
Parallelism Mappings for Efficient Large-Scale MoE Model Training with Megatron Core"),
``initialize_model_parallel`` in ``megatron/core/parallel_state.py`` numbers the same
ranks twice, with two ``RankGenerator`` s over one ``order`` string (default
``tp-cp-ep-dp-pp``, first axis fastest):

* the **dense** (decoder) grid -- attention, embeddings, dense MLPs -- has ``ep = 1``:
  ``tp × cp × dp × pp`` with ``dp = world / (tp·pp·cp)``. Expert parallelism does not
  shrink the dense data-parallel size.
* the **expert** grid -- the MoE experts -- has ``cp = 1``:
  ``expert_tp × ep × expert_dp × pp`` with ``expert_tp`` = ``--expert-tensor-parallel-size``
  (default: ``tp``) and ``expert_dp = world / (expert_tp·ep·pp)``. The context-parallel
  ranks (and data-parallel ranks) are *folded* into EP and expert DP.

Both grids must give the same pipeline groups (a rank is on one stage for every layer).
Megatron's checks, each a one-line ``ValueError`` here:

* ``world % (tp·pp·cp) == 0`` (dense) and ``world % (expert_tp·ep·pp) == 0`` (expert);
* an axis of size > 1 must appear in ``order`` (RankGenerator);
* ``order`` ends with ``pp``, or ``pp == 1``, or ``expert_dp == dp``;
* the two grids' pipeline groups are identical.

Pure Python, no torch: instant to import (the rank-map CLI and widgets can use it).

>>> g = MoEGrid(8, tp=2, pp=2, ep=2, expert_tp=1)
>>> g.dp, g.expert_dp
(2, 2)
>>> g.dense_groups("dp")[:2], g.expert_groups("ep")[:2]
([[0, 2], [1, 3]], [[0, 1], [2, 3]])
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from course_lib import rules
from course_lib.rules import AXIS_FLAG
from course_lib.topology.grid import DEFAULT_ORDER, parse_order, rank_groups

__all__ = ["MoEGrid", "expert_groups", "rank_groups", "EXPERT_TOKENS", "EXPERT_TOKEN_GROUP",
           "EP_FLAG", "EXPERT_TP_FLAG"]

EP_FLAG = AXIS_FLAG["ep"]  # expert-model-parallel-size
EXPERT_TP_FLAG = "expert-tensor-parallel-size"

# The expert groups Megatron builds from the expert grid, with the global that holds them.
EXPERT_TOKEN_GROUP = {
    "ep": "_EXPERT_MODEL_PARALLEL_GROUP",                        # token all-to-all
    "tp": "_EXPERT_TENSOR_PARALLEL_GROUP",                       # expert MLP tensor parallel
    "dp": "_EXPERT_DATA_PARALLEL_GROUP",                         # expert gradient reduction
    "pp": "(pipeline groups: must equal the dense grid's)",
    "tp-ep": "_EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP",          # dispatch with expert TP
    "tp-ep-pp": "_EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP",  # expert grad-norm / model group
}
EXPERT_TOKENS = tuple(EXPERT_TOKEN_GROUP)


@functools.lru_cache(maxsize=4096)
def _cached_groups(order: tuple[str, ...], shape: tuple[int, ...], token: str) -> tuple[tuple[int, ...], ...]:
    """:func:`course_lib.topology.grid.rank_groups` (the one group algorithm, shared with ``RankGrid``)
    memoised on the grid's shape (a grid is rebuilt for many layouts)."""
    return tuple(map(tuple, rank_groups(order, dict(zip(order, shape)), token)))


@dataclass(frozen=True)
class MoEGrid:
    """The dense and expert grids of one MoE layout (Megatron's two ``RankGenerator`` s).

    Args:
        world_size: ranks.
        tp, pp, cp: ``--tensor-model-parallel-size``, ``--pipeline-model-parallel-size``,
            ``--context-parallel-size`` (dense layers).
        ep: ``--expert-model-parallel-size``: ranks that split the experts (all-to-all group).
        expert_tp: ``--expert-tensor-parallel-size``; ``None`` means ``tp`` (Megatron's default).
        order: Megatron's ``--rank-order`` style string, first axis fastest.

    Derived: ``dp = world / (tp·pp·cp)`` (dense) and ``expert_dp = world / (expert_tp·ep·pp)``.
    """

    world_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    expert_tp: int | None = None
    order: str = DEFAULT_ORDER
    dp: int = field(init=False)
    expert_dp: int = field(init=False)
    dense_order: tuple = field(init=False, repr=False)
    expert_order: tuple = field(init=False, repr=False)

    def __post_init__(self):
        world = rules.integer("world_size", self.world_size)
        tp, pp, cp, ep = (rules.integer(AXIS_FLAG[a], getattr(self, a)) for a in ("tp", "pp", "cp", "ep"))
        etp = tp if self.expert_tp is None else rules.integer(EXPERT_TP_FLAG, self.expert_tp)
        dp = rules.data_parallel_size(world, tp, pp, cp)
        expert_model = etp * ep * pp
        if world % expert_model:
            raise ValueError(
                f"world_size={world} is not divisible by {EXPERT_TP_FLAG}={etp} × {EP_FLAG}={ep} × "
                f"{AXIS_FLAG['pp']}={pp} = {expert_model}; choose expert sizes whose product divides {world} "
                f"(expert data-parallel size = world_size / product is derived)")
        expert_dp = world // expert_model
        dense_order = parse_order(self.order, {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp})
        expert_order = parse_order(self.order, {"tp": etp, "cp": 1, "ep": ep, "dp": expert_dp, "pp": pp})
        for name, value in (("world_size", world), ("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep),
                            ("expert_tp", etp), ("dp", dp), ("expert_dp", expert_dp),
                            ("dense_order", dense_order), ("expert_order", expert_order)):
            object.__setattr__(self, name, value)
        if pp > 1 and dense_order[-1] != "pp" and expert_dp != dp:
            raise ValueError(
                f"order='{self.order}' does not end with 'pp', so dense data-parallel size {dp} and expert "
                f"data-parallel size {expert_dp} must be equal (Megatron asserts it); use an order ending in "
                f"'pp', e.g. '{DEFAULT_ORDER}'")
        if self.dense_groups("pp") != self.expert_groups("pp"):
            raise ValueError(
                f"order='{self.order}' gives the dense and the expert layers different pipeline groups with "
                f"{AXIS_FLAG['cp']}={cp}, {EP_FLAG}={ep}, {EXPERT_TP_FLAG}={etp} (Megatron asserts they are "
                f"equal); use an order ending in 'pp', e.g. '{DEFAULT_ORDER}'")

    @property
    def dense_sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "ep": 1, "dp": self.dp, "pp": self.pp}

    @property
    def expert_sizes(self) -> dict[str, int]:
        return {"tp": self.expert_tp, "cp": 1, "ep": self.ep, "dp": self.expert_dp, "pp": self.pp}

    def dense_groups(self, token: str) -> list[list[int]]:
        """Dense (decoder) groups of ``token`` (``"tp"``, ``"dp"``, ``"dp-cp"``, ...): the ep = 1 grid."""
        return self._groups(self.dense_order, self.dense_sizes, token)

    def expert_groups(self, token: str) -> list[list[int]]:
        """Expert groups of ``token``: ``"ep"``, ``"tp"`` (expert TP), ``"dp"`` (expert DP), ``"pp"``,
        ``"tp-ep"``, ``"tp-ep-pp"`` (any axes of the cp = 1 grid)."""
        return self._groups(self.expert_order, self.expert_sizes, token)

    @staticmethod
    def _groups(order: tuple[str, ...], sizes: dict[str, int], token: str) -> list[list[int]]:
        token = "-".join(sorted(t.strip() for t in token.lower().split("-")))  # axis order is irrelevant
        return [list(g) for g in _cached_groups(order, tuple(sizes[a] for a in order), token)]

    @staticmethod
    def _group_of(groups: list[list[int]], rank: int) -> list[int]:
        return next(g for g in groups if rank in g)

    def dense_group_of(self, rank: int, token: str) -> list[int]:
        rules.rank_in("rank", rank, self.world_size, "world_size")
        return self._group_of(self.dense_groups(token), rank)

    def expert_group_of(self, rank: int, token: str) -> list[int]:
        rules.rank_in("rank", rank, self.world_size, "world_size")
        return self._group_of(self.expert_groups(token), rank)

    def ep_rank(self, rank: int) -> int:
        """This rank's index in its expert-parallel group (which slice of the experts it holds)."""
        return self.expert_group_of(rank, "ep").index(rank)

    def local_experts(self, rank: int, num_experts: int) -> list[int]:
        """Global indices of the experts ``rank`` holds: ``num_experts / ep`` consecutive ones
        (Megatron's ``local_expert_indices``). ``--num-experts`` must be divisible by ``ep``."""
        n = rules.moe_experts(rules.integer("num-experts", num_experts), self.ep)
        per = n // self.ep
        first = self.ep_rank(rank) * per
        return list(range(first, first + per))


def expert_groups(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                  expert_tp: int | None = None, order: str = DEFAULT_ORDER) -> dict[str, list[list[int]]]:
    """Every expert group Megatron builds: ``{"ep", "tp" (expert TP), "dp" (expert DP), "pp",
    "tp-ep", "tp-ep-pp"}`` -> list of groups (global ranks). Validated like Megatron (see the module)."""
    grid = MoEGrid(world_size, tp=tp, pp=pp, cp=cp, ep=ep, expert_tp=expert_tp, order=order)
    return {token: grid.expert_groups(token) for token in EXPERT_TOKENS}
