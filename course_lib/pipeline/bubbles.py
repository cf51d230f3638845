"""Pipeline bubble and in-flight micro-batch formulas (pure functions, no torch).

* :func:`bubble_fraction` -- Narayanan et al. 2021 ("Efficient Large-Scale Language
  Model Training on GPU Clusters Using Megatron-LM", Sec. 2.2): the bubble time
  over the ideal time, ``(p - 1) / m`` for GPipe and 1F1B and ``(p - 1) / (v m)``
  for the interleaved schedule with ``v`` model chunks per rank.
* :func:`pipeline_bubble_time` -- Qi et al. 2023 ("Zero Bubble Pipeline
  Parallelism", Table 2): the bubble per iteration for 1F1B, ZB-H1 and ZB-H2.
* :func:`inflight_microbatches` -- how many micro-batches' activations each stage
  holds at its peak (1F1B: ``min(p - s, m)``; GPipe: ``m``).

Every formula is checked against :func:`course_lib.pipeline.simulate.simulate`
in ``tests/pipeline/test_pipeline_bubbles.py``. Note the two common denominators: the
bubble over the *ideal* time is ``(p - 1) / m``; the bubble over the *whole*
iteration is ``(p - 1) / (m + p - 1)`` (:func:`bubble_share`). Both are right;
they answer different questions.
"""

from __future__ import annotations

from typing import Optional
from course_lib.rules import UsageError

ZB_SCHEDULES = ("gpipe", "1f1b", "zb-h1", "zb-h2")


def _check_int(name, value, minimum=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"{name}={value!r} must be an integer >= {minimum}")


def _check_time(name, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise UsageError(f"{name}={value!r} must be a number >= 0 (time of one micro-batch on one stage)")


def bubble_fraction(pp: int, num_microbatches: int, vp: int = 1) -> float:
    """Bubble time over ideal compute time: ``(pp - 1) / (vp * num_microbatches)``.

    ``pp`` pipeline stages, ``num_microbatches`` micro-batches per iteration
    (Megatron: global batch / (micro batch * DP)), ``vp`` model chunks per rank
    (1 = GPipe or 1F1B, which have the same bubble; 1F1B only needs less memory).
    """
    _check_int("pp", pp)
    _check_int("num_microbatches", num_microbatches)
    _check_int("vp", vp)
    return (pp - 1) / (vp * num_microbatches)


def bubble_share(pp: int, num_microbatches: int, vp: int = 1) -> float:
    """Bubble time over the whole iteration: ``(pp - 1) / (vp * m + pp - 1)``.

    The seed's "Day 20" formula ``(p - 1) / (m + p - 1)`` is this with ``vp = 1``.
    """
    f = bubble_fraction(pp, num_microbatches, vp)
    return f / (1 + f)


def pipeline_bubble_time(schedule: str, pp: int, t_f: float, t_b: float, t_w: float = 0.0) -> float:
    """Idle time per rank per iteration (Qi et al. 2023, Table 2).

    ``t_f``: forward, ``t_b``: backward for the stage *input* (B), ``t_w``: backward
    for the *weights* (W) -- one micro-batch on one stage. 1F1B and GPipe run B and W
    together, so their backward takes ``t_b + t_w``.

    ======== ============================== ================
    schedule bubble                         peak activations
    ======== ============================== ================
    1f1b     (p - 1) (t_f + t_b + t_w)      p micro-batches
    zb-h1    (p - 1) (t_f + t_b - t_w)      p
    zb-h2    (p - 1) (t_f + t_b - 2 t_w)    2p - 1
    ======== ============================== ================

    The ZB values need ``t_w <= t_f`` (each deferred W must fit the gap a forward
    leaves) and enough micro-batches (``m >= p`` for ZB-H1, ``m >= 2p - 1`` for
    ZB-H2); ZB-H2's bubble is the one inside each rank's own span, i.e. with the
    optimizer step no longer a barrier (the paper's post-validation). Outside
    those conditions simulate the schedule instead.
    """
    if schedule not in ZB_SCHEDULES:
        raise UsageError(f"schedule={schedule!r} is unknown: use one of {', '.join(ZB_SCHEDULES)} "
                         f"(for the interleaved schedule use bubble_fraction(pp, m, vp))")
    _check_int("pp", pp)
    for name, value in (("t_f", t_f), ("t_b", t_b), ("t_w", t_w)):
        _check_time(name, value)
    if schedule in ("gpipe", "1f1b"):
        return (pp - 1) * (t_f + t_b + t_w)
    if t_w > t_f:
        raise UsageError(f"t_w={t_w} > t_f={t_f}: Qi et al.'s {schedule} formula assumes a W pass fits "
                         f"in the gap of a forward (t_w <= t_f); simulate the schedule instead")
    if schedule == "zb-h1":
        return (pp - 1) * (t_f + t_b - t_w)
    return (pp - 1) * (t_f + t_b - 2 * t_w)


def inflight_microbatches(pp: int, num_microbatches: int, schedule: str, vp: int = 1,
                          microbatch_group_size: Optional[int] = None) -> list:
    """Peak number of micro-batches whose activations each pipeline stage holds.

    ``gpipe``: ``m`` everywhere; ``1f1b``: ``min(p - s, m)`` on stage ``s`` (the
    warm-up forwards plus the one in flight); ``zb-h1``: ``min(p, m)``; ``zb-h2``:
    ``min(2p - 1, m)``; ``interleaved`` (needs ``vp >= 2``): Megatron's warm-up
    ``2 (p - s - 1) + (vp - 1) * group`` plus one, capped at ``vp * m``, counted in
    *chunk*-micro-batches -- each holds ``1 / vp`` of the stage's layers, so divide
    by ``vp`` for units of a whole stage.
    """
    _check_int("pp", pp)
    _check_int("num_microbatches", num_microbatches)
    p, m = pp, num_microbatches
    if schedule == "gpipe":
        return [m] * p
    if schedule == "1f1b":
        return [min(p - s, m) for s in range(p)]
    if schedule == "zb-h1":
        return [min(p, m)] * p
    if schedule == "zb-h2":
        return [min(2 * p - 1, m)] * p
    if schedule == "interleaved":
        from course_lib.pipeline.schedules import check_interleaved_config

        group = check_interleaved_config(p, m, vp, microbatch_group_size)
        return [min(2 * (p - s - 1) + (vp - 1) * group + 1, vp * m) for s in range(p)]
    raise UsageError(f"schedule={schedule!r} is unknown: use one of gpipe, 1f1b, interleaved, zb-h1, zb-h2")
