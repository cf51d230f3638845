"""Time a pipeline schedule without running it: a discrete-event simulation in one process.

This is a **simulation** (pure Python, no torch, no ranks): each rank runs its
actions in order; an action starts when the rank is free and its input has
arrived:

* ``F`` of micro-batch ``i`` on virtual stage ``s > 0`` waits for ``F`` of ``i``
  on stage ``s - 1`` (+ ``p2p_latency``: the activation crosses a rank boundary);
* ``B`` on stage ``s`` waits for ``B`` on stage ``s + 1`` (+ latency; the last
  stage waits for its own ``F``: the loss is part of its forward);
* ``W`` waits for ``B`` of the same micro-batch on the same stage.

Sends never block here (asynchronous sends: what the bubble formulas assume).
Durations: ``t_f`` per forward, ``t_b`` per backward and ``t_w`` per weight-grad
pass of one micro-batch through one pipeline rank's share of the layers. A
schedule without ``W`` actions runs the whole backward in ``B``: it costs
``t_b + t_w`` (Qi et al. 2023's T_B + T_W). With ``vp`` model chunks per rank
each chunk holds ``1/vp`` of the rank's layers, so its actions take ``t / vp``.
Each time may be one number or a sequence: per pipeline rank (length ``pp``) or
per virtual stage (length ``pp * vp``).

The result is a :class:`Timeline` -- the same type the real executor returns with
measured times -- with the makespan, bubble and peak live activations per rank.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence, Union

from course_lib.pipeline.schedules import Action, PipelineSchedule
from course_lib.rules import UsageError

Times = Union[float, int, Sequence[float]]


class Event(NamedTuple):
    """One action as it ran: on ``rank``, virtual ``stage``, from ``start`` to ``end`` (seconds or units)."""

    rank: int
    action: Action
    stage: int
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


def live_activations(actions: Sequence[Action]) -> list[int]:
    """How many (micro-batch, chunk) activation sets are held after each action, in program order.

    A forward stores its activations; they are freed by the micro-batch's last
    backward piece on this rank: its ``W`` when the rank runs one, else its ``B``.
    """
    has_w = {(a.microbatch, a.chunk) for a in actions if a.kind == "W"}
    live, series = 0, []
    for a in actions:
        kind = a.kind
        if kind == "F":
            live += 1
        elif kind == "W" or (a.microbatch, a.chunk) not in has_w:
            live -= 1
        series.append(live)
    return series


@dataclass
class Timeline:
    """Start/end of every action on every rank, simulated or measured.

    ``events[r]`` lists rank ``r``'s events in program order. ``peak_activations[r]``
    is the most (micro-batch, chunk) activation sets rank ``r`` held at once;
    multiply by ``1 / vp_size`` for units of one micro-batch's activations of a
    whole pipeline stage.
    """

    schedule: PipelineSchedule
    events: list
    peak_activations: list
    source: str = "simulated"
    info: dict = field(default_factory=dict)

    @property
    def pp_size(self) -> int:
        return self.schedule.pp_size

    @property
    def start(self) -> float:
        return min(ev[0].start for ev in self.events if ev)

    @property
    def makespan(self) -> float:
        """From the first action's start to the last action's end (the flush: all ranks finished)."""
        return max(ev[-1].end for ev in self.events if ev) - self.start

    def busy(self, rank: int) -> float:
        return sum([e.end - e.start for e in self.events[rank]])

    def idle(self, rank: int) -> float:
        """Time rank ``rank`` waits within the makespan (its share of the bubble)."""
        return self.makespan - self.busy(rank)

    @property
    def bubble_time(self) -> float:
        """The largest per-rank idle time within the makespan."""
        return max(self.idle(r) for r in range(self.pp_size))

    @property
    def bubble_fraction(self) -> float:
        """Idle time over useful time, summed over ranks: ``(p * makespan - busy) / busy``.

        With equal stage times this is Narayanan et al.'s bubble time fraction
        ``t_pb / t_id``, ``(p - 1) / m`` for GPipe and 1F1B, ``(p - 1) / (v m)`` interleaved.
        """
        busy = sum(self.busy(r) for r in range(self.pp_size))
        return (self.pp_size * self.makespan - busy) / busy

    @property
    def bubble_share(self) -> float:
        """Idle time over the whole makespan: ``(p - 1) / (m + p - 1)`` for 1F1B with equal times."""
        busy = sum(self.busy(r) for r in range(self.pp_size))
        return (self.pp_size * self.makespan - busy) / (self.pp_size * self.makespan)

    def span_bubble(self, rank: int) -> float:
        """Idle time between rank ``rank``'s own first start and last end.

        This is the bubble Qi et al. 2023 count (Table 2) when the optimizer step is
        not a barrier and iterations overlap: 0 for ZB-H2.
        """
        ev = self.events[rank]
        return (ev[-1].end - ev[0].start) - self.busy(rank) if ev else 0.0

    def summary(self) -> str:
        s = self.schedule
        head = (f"{self.source} {s.name}: pp={s.pp_size} m={s.num_microbatches}"
                + (f" vp={s.vp_size}" if s.vp_size > 1 else ""))
        return (f"{head}  makespan={self.makespan:.4g}  bubble fraction={self.bubble_fraction:.4f}  "
                f"peak live activations per rank={list(self.peak_activations)}")


def _per_stage(name: str, value: Times, pp: int, vp: int) -> list[float]:
    """Expand a time to one value per virtual stage (chunk times are rank times / vp)."""
    stages = pp * vp
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        values = [float(value) / vp] * stages
    else:
        try:
            if isinstance(value, str):
                raise TypeError
            seq = [float(v) for v in value]
        except (TypeError, ValueError):
            raise UsageError(f"{name}={value!r} must be a number or a sequence of numbers") from None
        if len(seq) == pp:
            values = [seq[s % pp] / vp for s in range(stages)]
        elif len(seq) == stages:
            values = seq
        else:
            raise UsageError(f"{name} has {len(seq)} values: give one number, one per pipeline rank "
                             f"({pp}) or one per virtual stage ({stages})")
    if any(v < 0 for v in values):
        raise UsageError(f"{name}={value!r} has a negative time: times must be >= 0")
    return values


def simulate(schedule: PipelineSchedule, t_f: Times = 1.0, t_b: Times = 2.0, t_w: Times = 0.0,
             p2p_latency: float = 0.0) -> Timeline:
    """Simulate ``schedule``; return its :class:`Timeline` (a simulation, labelled ``source="simulated"``).

    Raises ``ValueError`` when some rank waits forever (the order contradicts the
    data dependencies): use :func:`course_lib.pipeline.check.check_schedule` for the
    full diagnosis.
    """
    p, v, m = schedule.pp_size, schedule.vp_size, schedule.num_microbatches
    S = p * v
    tf, tb, tw = (_per_stage(n, t, p, v) for n, t in (("t_f", t_f), ("t_b", t_b), ("t_w", t_w)))
    if p2p_latency < 0:
        raise UsageError(f"p2p_latency={p2p_latency} must be >= 0")
    # Each action has a key (kind, stage, micro-batch) -> a flat index; per rank, the
    # key, the key it waits for (-1: none), its duration and the latency added to the wait.
    programs, stages = [], []
    for r, actions in enumerate(schedule.ranks):
        split = {(a.microbatch, a.chunk) for a in actions if a.kind == "W"}
        keys, deps, durs, lats, where = [], [], [], [], []
        for a in actions:
            mb, c = a.microbatch, a.chunk
            s = (c or 0) * p + r
            where.append(s)
            if not (0 <= mb < m and 0 <= s < S):
                raise UsageError(f"rank {r} has action {a} outside the schedule (m={m}, stages={S})")
            lat = p2p_latency
            if a.kind == "F":
                k, dur, dep = s * m + mb, tf[s], ((s - 1) * m + mb if s > 0 else -1)
            elif a.kind == "B":
                k = (S + s) * m + mb
                dur = tb[s] + (0.0 if (mb, a.chunk) in split else tw[s])
                if s < S - 1:
                    dep = (S + s + 1) * m + mb
                else:
                    dep, lat = s * m + mb, 0.0  # the loss is part of the last stage's forward
            else:
                k, dur, dep, lat = (2 * S + s) * m + mb, tw[s], (S + s) * m + mb, 0.0
            keys.append(k)
            deps.append(dep)
            durs.append(dur)
            lats.append(lat)
        programs.append((keys, deps, durs, lats))
        stages.append(where)

    done: list = [None] * (3 * S * m)  # end time of each finished action, by key
    waiting: dict[int, list[int]] = {}
    ptr, free = [0] * p, [0.0] * p
    starts: list[list[float]] = [[] for _ in range(p)]
    ready = deque(range(p))
    while ready:
        r = ready.popleft()
        keys, deps, durs, lats = programs[r]
        out = starts[r]
        i, t, n = ptr[r], free[r], len(keys)
        while i < n:
            dep = deps[i]
            if dep >= 0:
                arrived = done[dep]
                if arrived is None:
                    waiting.setdefault(dep, []).append(r)
                    break
                arrived += lats[i]
                if arrived > t:
                    t = arrived
            out.append(t)
            t += durs[i]
            k = keys[i]
            done[k] = t
            i += 1
            if k in waiting:
                ready.extend(waiting.pop(k))
        ptr[r], free[r] = i, t
    stuck = [r for r in range(p) if ptr[r] < len(programs[r][0])]
    if stuck:
        what = ", ".join(f"rank {r} at {schedule.ranks[r][ptr[r]]}" for r in stuck[:4])
        raise UsageError(f"schedule {schedule.name!r} cannot finish: {what} wait for inputs that are "
                         f"never produced (check_schedule explains why)")
    new = tuple.__new__      # Event(...) with its argument parsing skipped: hundreds of thousands per projection
    events = [[new(Event, (r, a, s, t0, t0 + d))
               for a, s, t0, d in zip(schedule.ranks[r], stages[r], starts[r], programs[r][2])] for r in range(p)]
    peaks = [max(live_activations(actions), default=0) for actions in schedule.ranks]
    info = dict(t_f=t_f, t_b=t_b, t_w=t_w, p2p_latency=p2p_latency)
    return Timeline(schedule, events, peaks, "simulated", info)
