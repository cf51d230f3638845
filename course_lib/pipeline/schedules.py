"""Pipeline schedules as data: the order in which each pipeline rank runs its work.

A schedule is a list of :class:`Action` per pipeline rank -- ``F3`` (forward of
micro-batch 3), ``B3`` (its backward), ``W3`` (its weight-gradient half, only in
zero-bubble schedules) -- and nothing else. Being plain data, a schedule can be
printed, checked (:mod:`course_lib.pipeline.check`), timed by the simulator
(:mod:`course_lib.pipeline.simulate`) and executed on real ranks
(:mod:`course_lib.pipeline.executor`); the idea comes from ShallowSpeed's
``pipe.py`` (instructions as data, a separate worker executes them).

The orders are Megatron-LM's, from ``megatron/core/pipeline_parallel/schedules.py``:

* :func:`schedule_1f1b` -- ``forward_backward_pipelining_without_interleaving``:
  ``min(p - r - 1, m)`` warm-up forwards on pipeline rank ``r``, then one
  forward + one backward per step (steady 1F1B), then the cool-down backwards.
* :func:`schedule_interleaved_1f1b` -- ``forward_backward_pipelining_with_interleaving``
  (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU
  Clusters Using Megatron-LM", Sec. 2.2): each rank holds ``vp`` model chunks;
  chunk ``c`` on rank ``r`` is virtual stage ``c * p + r``. The order comes from
  Megatron's ``get_schedule_table`` with ``microbatch_group_size_per_vp_stage``.
* :func:`schedule_gpipe` -- all forwards, then all backwards (Huang et al. 2019).
* :func:`schedule_zero_bubble_h1` / :func:`schedule_zero_bubble_h2` -- Qi et al.
  2023, "Zero Bubble Pipeline Parallelism", Sec. 2: the backward is split into B
  (gradient w.r.t. the stage input, on the critical path) and W (gradient w.r.t.
  the weights, which can wait). Megatron's classic schedules do not have them.

Micro-batch ids count from 0, like Megatron's ``microbatch_id``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from course_lib import rules

KINDS = ("F", "B", "W")


@dataclass(frozen=True)
class Action:
    """One unit of work on one pipeline rank.

    ``kind``: ``"F"`` forward, ``"B"`` backward (w.r.t. the stage input only when
    the schedule also has ``"W"`` actions, else the whole backward), ``"W"``
    weight-gradient backward. ``microbatch``: 0-based id. ``chunk``: the model
    chunk (Megatron's ``model_chunk_id`` / ``vp_stage``) for interleaved
    schedules, ``None`` when the rank holds one chunk.
    """

    kind: str
    microbatch: int
    chunk: Optional[int] = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise rules.UsageError(f"Action kind={self.kind!r} is unknown: use one of {', '.join(KINDS)}")

    @property
    def chunk_id(self) -> int:
        """The model chunk as an int (0 when the rank holds one chunk)."""
        return 0 if self.chunk is None else self.chunk

    def __str__(self) -> str:
        text = f"{self.kind}{self.microbatch}"
        return text if self.chunk is None else f"{text}.c{self.chunk}"

    __repr__ = __str__


def parse_action(text: str) -> Action:
    """``"F3"`` -> ``Action("F", 3)``; ``"B2.c1"`` -> ``Action("B", 2, chunk=1)``."""
    if isinstance(text, Action):
        return text
    s = str(text).strip()
    head, _, chunk = s.partition(".c")
    if len(head) < 2 or head[0] not in KINDS or not head[1:].isdigit() or (chunk and not chunk.isdigit()):
        raise rules.UsageError(f"action {text!r} is not of the form F3, B3, W3 or F3.c1 (kind, micro-batch, "
                               f"optional .c<model chunk>)")
    return Action(head[0], int(head[1:]), int(chunk) if chunk else None)


def virtual_stage(pp_rank: int, chunk: int, pp_size: int) -> int:
    """Chunk ``c`` on pipeline rank ``r`` is virtual stage ``c * pp_size + r`` (Megatron's layer offset)."""
    return chunk * pp_size + pp_rank


# ----------------------------------------------------------------------------- validation


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise rules.UsageError(f"{name}={value!r} must be an integer >= {minimum}")


def _check_common(pp_size, num_microbatches, pp_rank) -> None:
    _check_int("pp_size", pp_size, 1)
    _check_int("num_microbatches", num_microbatches, 1)
    _check_int("pp_rank", pp_rank, 0)
    if pp_rank >= pp_size:
        raise rules.UsageError(f"pp_rank={pp_rank} is out of range for pp_size={pp_size}: use 0..{pp_size - 1}")


def check_interleaved_config(pp_size: int, num_microbatches: int, vp_size: int,
                             microbatch_group_size: Optional[int] = None) -> int:
    """Megatron's rules for the interleaved schedule; returns the group size used.

    ``microbatch_group_size`` is ``--microbatch-group-size-per-virtual-pipeline-stage``
    (``ModelParallelConfig.microbatch_group_size_per_vp_stage``, default ``pp_size``):
    how many consecutive micro-batches run on one model chunk before switching.
    Rules (``forward_backward_pipelining_with_interleaving``):
    ``pp_size <= group <= num_microbatches``, and ``num_microbatches % group`` is 0
    or ``>= pp_size``. With the default group this means ``num_microbatches % pp_size == 0``.
    """
    return rules.interleaved_microbatch_group(pp_size, num_microbatches, vp_size, microbatch_group_size)


# ----------------------------------------------------------------------------- schedules


def schedule_gpipe(pp_size: int, num_microbatches: int, pp_rank: int) -> list[Action]:
    """GPipe (all-forward-all-backward): ``F0 .. F(m-1)`` then ``B0 .. B(m-1)`` on every rank.

    Every rank keeps all ``m`` micro-batches' activations until its backwards start.
    """
    _check_common(pp_size, num_microbatches, pp_rank)
    m = num_microbatches
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def num_warmup_microbatches(pp_size: int, num_microbatches: int, pp_rank: int) -> int:
    """Warm-up forwards of non-interleaved 1F1B on ``pp_rank``: ``min(p - r - 1, m)``.

    Megatron: ``num_warmup_microbatches = total_stages - current_stage - 1``, then
    ``min(..., num_microbatches)``. The last rank starts 1F1B at once.
    """
    _check_common(pp_size, num_microbatches, pp_rank)
    return min(pp_size - pp_rank - 1, num_microbatches)


def schedule_1f1b(pp_size: int, num_microbatches: int, pp_rank: int) -> list[Action]:
    """Megatron's non-interleaved 1F1B order on one pipeline rank.

    ``w = min(p - r - 1, m)`` warm-up forwards ``F0..F(w-1)``; then ``m - w`` steady
    steps, each ``F(w + i)`` followed by ``B(i)``; then the cool-down ``B(m - w) ..
    B(m - 1)``. At most ``w + 1 = min(p - r, m)`` micro-batches are alive at once.
    """
    w = num_warmup_microbatches(pp_size, num_microbatches, pp_rank)
    m = num_microbatches
    forwards, backwards = _passes(m, 1, m)
    order = list(forwards[:w])
    for i in range(m - w):  # steady state: one forward, one backward
        order += [forwards[w + i], backwards[i]]
    return order + list(backwards[m - w:])


@functools.lru_cache(maxsize=8)
def _passes(num_microbatches: int, vp_size: int, group: int) -> tuple[tuple[Action, ...], tuple[Action, ...]]:
    """The forwards in :func:`get_schedule_table`'s order and their backwards (each on the mirrored chunk, ``None``
    without interleaving): the same on every rank, so made once per schedule (the simulator times schedules of
    thousands of micro-batches on up to 64 ranks, and an :class:`Action` costs microseconds to make)."""
    if vp_size == 1:
        return tuple(Action("F", i) for i in range(num_microbatches)), tuple(Action("B", i) for i in range(num_microbatches))
    table = get_schedule_table(num_microbatches, vp_size, group)
    return (tuple(Action("F", mb, chunk) for mb, chunk in table),
            tuple(Action("B", mb, vp_size - 1 - chunk) for mb, chunk in table))


def get_schedule_table(num_microbatches: int, vp_size: int, microbatch_group_size: int) -> list[tuple[int, int]]:
    """Megatron's ``get_schedule_table``: ``(microbatch_id, model_chunk_id)`` per virtual micro-batch.

    Micro-batches go in groups of ``microbatch_group_size``; within a group every
    chunk runs the whole group before the next chunk (the last group takes the
    remainder). Megatron's example, PP=2, group 3, m=5, VP=2::

        virtual_microbatch_id | 0 1 2 3 4 5 6 7 8 9
        microbatch_id         | 0 1 2 0 1 2 3 4 3 4
        model_chunk_id        | 0 0 0 1 1 1 0 0 1 1
    """
    table = []
    for start in range(0, num_microbatches, microbatch_group_size):
        group = range(start, min(start + microbatch_group_size, num_microbatches))
        table += [(mb, chunk) for chunk in range(vp_size) for mb in group]
    return table


def interleaved_num_warmup(pp_size: int, num_microbatches: int, pp_rank: int, vp_size: int,
                           microbatch_group_size: Optional[int] = None) -> int:
    """Warm-up forwards (of chunk-micro-batches) of the interleaved schedule on ``pp_rank``.

    Megatron's ``get_pp_rank_microbatches``: ``2 (p - r - 1) + (vp - 1) * group``,
    capped at the total ``m * vp`` (then every forward runs before any backward).
    """
    _check_common(pp_size, num_microbatches, pp_rank)
    group = check_interleaved_config(pp_size, num_microbatches, vp_size, microbatch_group_size)
    warmup = 2 * (pp_size - pp_rank - 1) + (vp_size - 1) * group
    return min(warmup, num_microbatches * vp_size)


def schedule_interleaved_1f1b(pp_size: int, num_microbatches: int, pp_rank: int, vp_size: int,
                              microbatch_group_size: Optional[int] = None) -> list[Action]:
    """Megatron's interleaved 1F1B order on one pipeline rank (``vp_size`` model chunks).

    Forward number ``k`` runs ``(microbatch, chunk) = table[k]`` of
    :func:`get_schedule_table`; backward number ``k`` runs the same micro-batch on
    the mirrored chunk ``vp - 1 - chunk`` (backwards walk the virtual stages in
    reverse). Warm-up :func:`interleaved_num_warmup` forwards, then steady steps
    ``F(w + k), B(k)``, then the remaining backwards.
    """
    group = check_interleaved_config(pp_size, num_microbatches, vp_size, microbatch_group_size)
    w = interleaved_num_warmup(pp_size, num_microbatches, pp_rank, vp_size, group)
    forwards, backwards = _passes(num_microbatches, vp_size, group)
    total = len(forwards)
    order = list(forwards[:w])
    for k in range(total - w):
        order += [forwards[w + k], backwards[k]]
    return order + list(backwards[total - w:])


def _zero_bubble(num_microbatches: int, warmup: int, w_lag: int) -> list[Action]:
    """1F1B with the backward split into B and W, W deferred by ``w_lag`` backwards.

    ``warmup`` forwards; then steady steps ``F, B``; the ``j``-th B (j from 0) is
    followed by the oldest pending W once ``j >= w_lag``; the rest of the Ws close
    the schedule. A micro-batch's activations live from its F to its W.
    """
    m = num_microbatches
    order = [Action("F", i) for i in range(warmup)]
    next_w = 0

    def after_backward(j):
        nonlocal next_w
        if j >= w_lag:
            order.append(Action("W", next_w))
            next_w += 1

    for j in range(m - warmup):
        order += [Action("F", warmup + j), Action("B", j)]
        after_backward(j)
    for j in range(m - warmup, m):
        order.append(Action("B", j))
        after_backward(j)
    order += [Action("W", i) for i in range(next_w, m)]
    return order


def schedule_zero_bubble_h1(pp_size: int, num_microbatches: int, pp_rank: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2023, Sec. 2.1, Fig. 3 top): 1F1B's memory, a third of its bubble.

    Same warm-up as 1F1B (``min(p - r - 1, m)`` forwards), steady ``F, B`` steps,
    and rank ``r`` defers each W by ``r`` backwards, so the B passes (the critical
    path) reach the first stage sooner and the Ws fill the tail. Every rank then
    holds at most ``min(p, m)`` micro-batches -- 1F1B's peak on rank 0.
    (torch.distributed.pipelining's ``ScheduleInterleavedZeroBubble`` with one
    stage per rank -- the paper's "ZB1P" -- gives the same order.)
    """
    w = num_warmup_microbatches(pp_size, num_microbatches, pp_rank)
    return _zero_bubble(num_microbatches, warmup=w, w_lag=pp_rank)


def schedule_zero_bubble_h2(pp_size: int, num_microbatches: int, pp_rank: int) -> list[Action]:
    """ZB-H2 (Qi et al. 2023, Sec. 2.2, Fig. 3 bottom): no bubble inside a rank's span, more memory.

    ``min(2 (p - r - 1), m)`` warm-up forwards (twice 1F1B's), steady ``F, B``
    steps, Ws deferred by ``2 r`` backwards: up to ``2p - 1`` micro-batches alive.
    The bubble only vanishes when the optimizer step stops being a barrier
    (the paper's post-validation, Sec. 4), so consecutive iterations overlap.
    """
    _check_common(pp_size, num_microbatches, pp_rank)
    w = min(2 * (pp_size - pp_rank - 1), num_microbatches)
    return _zero_bubble(num_microbatches, warmup=w, w_lag=2 * pp_rank)


# ----------------------------------------------------------------------------- whole pipelines

SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2")
_RANK_FUNCS: dict[str, Callable[..., list[Action]]] = {
    "gpipe": schedule_gpipe, "1f1b": schedule_1f1b, "zb-h1": schedule_zero_bubble_h1,
    "zb-h2": schedule_zero_bubble_h2,
}


@dataclass(frozen=True)
class PipelineSchedule:
    """Every pipeline rank's order: ``ranks[r]`` is rank ``r``'s list of actions.

    ``vp_size`` model chunks per rank; chunk ``c`` on rank ``r`` is virtual stage
    ``c * pp_size + r`` of ``num_stages = pp_size * vp_size``.
    """

    name: str
    pp_size: int
    num_microbatches: int
    ranks: tuple
    vp_size: int = 1
    microbatch_group_size: Optional[int] = None

    @property
    def num_stages(self) -> int:
        return self.pp_size * self.vp_size

    @property
    def splits_backward(self) -> bool:
        """True when the backward is split into B (input grad) and W (weight grad)."""
        return any(a.kind == "W" for actions in self.ranks for a in actions)

    def stage(self, pp_rank: int, action: Action) -> int:
        """The virtual stage ``action`` runs on (``chunk * pp_size + pp_rank``)."""
        return virtual_stage(pp_rank, action.chunk_id, self.pp_size)

    def table(self) -> str:
        """One line per rank, e.g. ``rank 0 | F0 F1 F2 F3 B0 F4 ...``."""
        return "\n".join(f"rank {r} | " + " ".join(map(str, actions)) for r, actions in enumerate(self.ranks))

    def __str__(self) -> str:
        return self.table()


def build_schedule(name: str, pp_size: int, num_microbatches: int, vp_size: int = 1,
                   microbatch_group_size: Optional[int] = None) -> PipelineSchedule:
    """All ranks' orders for schedule ``name`` (one of :data:`SCHEDULE_NAMES`)."""
    if name not in SCHEDULE_NAMES:
        raise rules.UsageError(f"schedule={name!r} is unknown: use one of {', '.join(SCHEDULE_NAMES)}")
    _check_int("pp_size", pp_size, 1)
    if name == "interleaved":
        group = check_interleaved_config(pp_size, num_microbatches, vp_size, microbatch_group_size)
        ranks = tuple(tuple(schedule_interleaved_1f1b(pp_size, num_microbatches, r, vp_size, group))
                      for r in range(pp_size))
        return PipelineSchedule(name, pp_size, num_microbatches, ranks, vp_size, group)
    if vp_size != 1:
        raise rules.UsageError(f"schedule={name!r} runs one model chunk per rank, got vp_size={vp_size}: use "
                               f"schedule='interleaved' for virtual pipeline stages")
    ranks = tuple(tuple(_RANK_FUNCS[name](pp_size, num_microbatches, r)) for r in range(pp_size))
    return PipelineSchedule(name, pp_size, num_microbatches, ranks)


def from_orders(orders: Sequence[Sequence], name: str = "custom", vp_size: int = 1) -> PipelineSchedule:
    """A :class:`PipelineSchedule` from per-rank lists of actions or strings like ``"F3"``/``"B2.c1"``.

    The number of micro-batches is taken from the largest micro-batch id. Nothing
    is checked here: use :func:`course_lib.pipeline.check.check_schedule`.
    """
    ranks = tuple(tuple(parse_action(a) for a in actions) for actions in orders)
    ids = [a.microbatch for actions in ranks for a in actions]
    if not ranks or not ids:
        raise rules.UsageError("from_orders needs at least one rank with at least one action")
    return PipelineSchedule(name, len(ranks), max(ids) + 1, ranks, vp_size)
