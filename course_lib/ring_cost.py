"""The ring cost model: the elements one rank sends for each collective the course issues.

One formula for the whole course: the recorder (:mod:`course_lib.comm`, every ``CommEvent``) and the
torch-free sizing formulas (:mod:`course_lib.sizing.comm`, the projection) both read it, so a measured
collective and a predicted one are priced the same way. Pure arithmetic, no torch: the sizing
formulas stay instant to import. The model is the ring's (Patarasuk & Yuan 2009): the ``(t-1)/t`` of
Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", sections 3.2 and 3.3.1.
"""

from __future__ import annotations

from course_lib import rules


COMM_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send", "recv", "broadcast", "all_to_all")


def comm_op(op: str) -> str:
    """A communication op the course records and prices: one of :data:`COMM_OPS`."""
    if op not in COMM_OPS:
        raise rules.UsageError(f"op={op!r} is unknown: use one of {', '.join(COMM_OPS)}")
    return op


def ring_elements_sent(op: str, numel: float, group_size: int) -> float:
    """The ring cost model: elements one rank sends for ``op`` on ``numel`` elements over ``group_size`` ranks.

    all_reduce ``2 N (t-1)/t`` (a reduce-scatter then an all-gather, ``t - 1`` steps each, one
    ``N/t`` chunk per step: the ``(d-1)/d`` of Narayanan et al. 2021 §3.3.1, the ``(t-1)/t`` of §3.2);
    all_gather and reduce_scatter ``N (t-1)/t`` (N = the full tensor; half an all-reduce,
    Korthikanti et al. 2022 §4.2.2); all_to_all ``N (t-1)/t`` (a rank keeps its own 1/t); broadcast
    ``N`` (pipelined chain: every rank but the last forwards the whole tensor); send ``N``; recv ``0``.
    A cost formula, not a collective: :func:`course_lib.communication_patterns.ring_all_reduce` is the ring
    itself (Patarasuk & Yuan 2009), whose measured sends this formula predicts.
    """
    comm_op(op)
    t = rules.integer("group_size", group_size)
    if op == "send":
        return float(numel)
    if op == "recv" or t == 1:
        return 0.0
    if op == "broadcast":
        return float(numel)
    factor = 2 if op == "all_reduce" else 1
    return factor * numel * (t - 1) / t
