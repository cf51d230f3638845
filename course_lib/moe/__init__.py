"""Mixture of Experts and expert parallelism (Megatron's fifth axis).

* :mod:`course_lib.moe.grid` -- the dense and expert rank grids (MoE parallel folding), pure Python.
* :mod:`course_lib.moe.router` -- softmax top-k routing, Switch load-balancing loss, z-loss (torch).
* :mod:`course_lib.moe.layer` -- the MoE layer: all-to-all dispatch over the EP group, local experts,
  combine; ``reduce_moe_grads`` (experts over expert DP, the rest over DP) (torch).
* :mod:`course_lib.moe.transformer` -- MoE layers in the course GPT (``--moe-layer-freq``): the
  alltoall and allgather dispatchers, expert TP, sequence parallelism, the aux-loss log (torch).

Only the grid is imported here (no torch): ``from course_lib.moe.layer import MoELayer``.
"""

from course_lib.moe.grid import EXPERT_TOKENS, MoEGrid, expert_groups, rank_groups  # noqa: F401
