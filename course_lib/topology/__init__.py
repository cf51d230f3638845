"""The rank grid (拓扑): which rank sits where, every process group, a run's validated layout, its pictures.

==================  ==========================================================
:mod:`.grid`        ``RankGrid`` (Megatron's ``RankGenerator`` numbering: the
                    dense grid and the MoE layers' expert grid), ``rank_groups``
                    (the one group algorithm), ``parse_order``
:mod:`.config`      ``ParallelConfig``: a whole run's layout, validated by
                    :mod:`course_lib.rules`, with its Megatron-LM flags
:mod:`.rankmap`     the rank map (Graphviz and matplotlib) and ``save``
:mod:`.boundaries`  the hand-drawn picture of where PP and TP cut a GPT
:mod:`.cli`         ``python -m course_lib rankmap``
:mod:`.figures`     writes the seed layouts' pictures into ``figures/``
==================  ==========================================================

The process groups built from a grid live in :mod:`course_lib.process_groups` (they need
torch). The grid and the config are pure Python + numpy: importing this package loads no
torch, matplotlib or Graphviz; the picture modules load on first use. The interactive rank map is course
machinery: :mod:`course_lib.classroom.widgets.topology`.
"""

from course_lib.rules import AXIS_FLAG, divisors  # noqa: F401  (topology's names since Lab 01)
from course_lib.topology.config import ParallelConfig
from course_lib.topology.grid import (AXES, DEFAULT_ORDER, EXPERT_TOKENS, MEGATRON_EXPERT_GROUPS, MEGATRON_GROUPS,
                                      SPECIAL_TOKENS, RankGrid, parse_order, rank_group_array, rank_groups)

# The public classes print as course_lib.topology.X (what a reader imports), not the file they live in.
RankGrid.__module__ = ParallelConfig.__module__ = __name__

_LAZY = {
    "rank_map": "rankmap", "rank_map_figure": "rankmap", "save": "rankmap",
    "boundary_sketch": "boundaries",
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"course_lib.topology.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'course_lib.topology' has no attribute {name!r}")


__all__ = ["RankGrid", "ParallelConfig", "rank_groups", "rank_group_array", "parse_order", "AXES", "AXIS_FLAG",
           "DEFAULT_ORDER", "MEGATRON_GROUPS", "MEGATRON_EXPERT_GROUPS", "EXPERT_TOKENS", "SPECIAL_TOKENS", "divisors"]
