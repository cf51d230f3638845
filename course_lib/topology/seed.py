"""The Day 22 seed's sweep (``seeds/003``): the six layouts A-F of one model on 8 ranks.

One table for every room that uses it: the sweep that trains them (:mod:`course_lib.sweep`), the
Megatron-LM command generator's ``--config`` (:mod:`course_lib.megatron.command`), the projections
to GPUs and Lab 03/05's checkers. It lives with the rank grid because it is a list of layouts; DP is
derived, ``8 / (TP * PP * CP)``, as Megatron derives it.
"""

SEED_SWEEP = {"A": (1, 1, 1), "B": (2, 1, 1), "C": (4, 1, 1), "D": (2, 2, 1), "E": (1, 4, 1), "F": (2, 2, 2)}
"""Config name -> (TP, PP, CP) on 8 ranks (F: CP = 2, so DP = 1)."""
