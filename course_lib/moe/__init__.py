"""Mixture of Experts and expert parallelism (Megatron's fifth axis).

* :mod:`course_lib.moe.grid` -- the dense and expert rank grids (MoE parallel folding), pure Python.
* :mod:`course_lib.moe.layer` -- router, all-to-all token dispatcher, experts and the MoE layer (torch).
"""

from course_lib.moe.grid import EXPERT_TOKENS, MoEGrid, expert_groups, rank_groups  # noqa: F401
