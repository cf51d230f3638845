"""Prove that a set of per-rank schedules can run: complete, dependency-correct, deadlock-free.

:func:`check_schedule` raises a one-line ``ValueError`` naming the first problem:

1. **complete** -- every rank runs ``F`` and ``B`` of every (micro-batch, chunk)
   exactly once (and ``W`` of each, or of none), ``F`` before ``B`` before ``W``;
2. **dependencies** -- each ``F``/``B`` can get its input from the neighbouring
   stage: with asynchronous sends the schedule finishes (no cycle of waits);
3. **point-to-point** -- the messages each rank sends and receives, posted as the
   executor posts them (:func:`comm_plan`), match one to one and cannot deadlock
   even when a send blocks until its receive is posted (rendezvous: the safe
   assumption for NCCL and large gloo messages).

Three ways to post the messages (``p2p=``):

* ``"blocking"`` -- one blocking send or receive at a time, in program order.
  GPipe survives; 1F1B deadlocks (rank 0 sends its next activation while rank 1
  sends a gradient back: both wait for the other to receive).
* ``"batched"`` -- Megatron's ``p2p_communication`` for the non-interleaved
  schedule: the outputs of an action are sent *together with* the receive for
  the next action (``send_forward_recv_backward``, ``send_backward_recv_forward``:
  one ``batch_isend_irecv``). 1F1B and ZB-H1 run; interleaved and ZB-H2 still
  deadlock, because a rank receives activations for a *later* chunk.
* ``"prefetch"`` -- every rank keeps the next receive posted on each incoming
  link (the neighbour's send order is known: the schedule is data) and buffers
  what arrives until an action needs it: Megatron's interleaved schedule does
  this (``recv_tensor_from_previous_stage`` receives what the previous stage
  sends in the same step, for whichever chunk it belongs to). Sends then never
  wait for long, so any schedule whose dependencies have no cycle runs.

``choose_p2p`` picks ``"batched"`` when it is deadlock-free, else ``"prefetch"``.
Messages between two ranks are matched in the order they are posted (no tags),
as in Megatron.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import NamedTuple, Union

from course_lib.pipeline.schedules import Action, PipelineSchedule
from course_lib.rules import UsageError

P2P_MODES = ("blocking", "batched", "prefetch")


class Message(NamedTuple):
    """An activation (``"act"``, forward) or gradient (``"grad"``, backward) crossing a stage boundary."""

    kind: str
    microbatch: int
    src_stage: int
    dst_stage: int
    src: int  # pipeline rank
    dst: int

    def __str__(self) -> str:
        return f"{self.kind} of micro-batch {self.microbatch} (stage {self.src_stage}->{self.dst_stage})"


@dataclass(frozen=True)
class Step:
    """Point-to-point operations posted together and waited for together (one ``batch_isend_irecv``)."""

    sends: tuple
    recvs: tuple

    def __bool__(self) -> bool:
        return bool(self.sends or self.recvs)


PlanItem = Union[Action, Step]


def _rank_of(stage: int, pp: int) -> int:
    return stage % pp


def inputs_of(schedule: PipelineSchedule, rank: int, action: Action) -> list:
    """The messages ``action`` on ``rank`` must receive before it runs."""
    p, S = schedule.pp_size, schedule.num_stages
    s = schedule.stage(rank, action)
    mb = action.microbatch
    if action.kind == "F" and s > 0:
        return [Message("act", mb, s - 1, s, _rank_of(s - 1, p), rank)]
    if action.kind == "B" and s < S - 1:
        return [Message("grad", mb, s + 1, s, _rank_of(s + 1, p), rank)]
    return []


def outputs_of(schedule: PipelineSchedule, rank: int, action: Action) -> list:
    """The messages ``action`` on ``rank`` sends when it is done."""
    p, S = schedule.pp_size, schedule.num_stages
    s = schedule.stage(rank, action)
    mb = action.microbatch
    if action.kind == "F" and s < S - 1:
        return [Message("act", mb, s, s + 1, rank, _rank_of(s + 1, p))]
    if action.kind == "B" and s > 0:
        return [Message("grad", mb, s, s - 1, rank, _rank_of(s - 1, p))]
    return []


def comm_plan(schedule: PipelineSchedule, rank: int, p2p: str = "batched") -> list:
    """Rank ``rank``'s program: its actions with the point-to-point :class:`Step` s between them.

    ``"batched"``: before action ``i`` one step holds the sends of action ``i - 1``
    and the receives of action ``i`` (empty steps are left out); a last step sends
    the last action's outputs. ``"blocking"`` and ``"prefetch"``: one message per
    step, receives just before and sends just after their action (with
    ``"prefetch"`` the receive was posted long before and only *waits* here).
    """
    if p2p not in P2P_MODES:
        raise UsageError(f"p2p={p2p!r} is unknown: use one of {', '.join(P2P_MODES)}")
    plan: list = []
    pending_sends: list = []
    for a in schedule.ranks[rank]:
        recvs = inputs_of(schedule, rank, a)
        if p2p == "batched":
            step = Step(tuple(pending_sends), tuple(recvs))
            if step:
                plan.append(step)
        else:  # one operation per step
            plan += [Step((msg,), ()) for msg in pending_sends] + [Step((), (msg,)) for msg in recvs]
        plan.append(a)
        pending_sends = outputs_of(schedule, rank, a)
    if p2p == "batched" and pending_sends:
        plan.append(Step(tuple(pending_sends), ()))
    else:
        plan += [Step((msg,), ()) for msg in pending_sends]
    return plan


def _check_complete(schedule: PipelineSchedule) -> None:
    m, v = schedule.num_microbatches, schedule.vp_size
    want = {(mb, c) for mb in range(m) for c in range(v)}
    split = schedule.splits_backward
    for r, actions in enumerate(schedule.ranks):
        counts = Counter((a.kind, a.microbatch, a.chunk_id) for a in actions)
        for (kind, mb, c), n in counts.items():
            if (mb, c) not in want:
                raise UsageError(f"rank {r} runs {kind}{mb} on chunk {c}, outside m={m}, vp={v}")
            if n > 1:
                raise UsageError(f"rank {r} runs {kind}{mb}{f' on chunk {c}' if v > 1 else ''} {n} times: "
                                 f"each action must appear once")
        kinds = ("F", "B", "W") if split else ("F", "B")
        for kind in kinds:
            missing = sorted(want - {(mb, c) for (k, mb, c) in counts if k == kind})
            if missing:
                mb, c = missing[0]
                what = "W (the schedule splits the backward on some rank, so every rank needs every W)" \
                    if kind == "W" else kind
                raise UsageError(f"rank {r} never runs {what} of micro-batch {mb}"
                                 f"{f' on chunk {c}' if v > 1 else ''} ({len(missing)} missing)")
        seen: set = set()
        for a in actions:
            before = {"B": "F", "W": "B"}.get(a.kind)
            if before and (before, a.microbatch, a.chunk_id) not in seen:
                raise UsageError(f"rank {r} runs {a} before {before}{a.microbatch}"
                                 f"{f'.c{a.chunk}' if a.chunk is not None else ''}: "
                                 f"a micro-batch goes F, then B{', then W' if split else ''}")
            seen.add((a.kind, a.microbatch, a.chunk_id))


def _check_dependencies(schedule: PipelineSchedule) -> None:
    """With asynchronous sends, does every rank reach the end? (wait-for graph has no cycle)"""
    p = schedule.pp_size
    produced: set = set()
    ptr = [0] * p
    progress = True
    while progress:
        progress = False
        for r in range(p):
            actions = schedule.ranks[r]
            while ptr[r] < len(actions):
                a = actions[ptr[r]]
                needs = inputs_of(schedule, r, a)
                if any(msg not in produced for msg in needs):
                    break
                produced.update(outputs_of(schedule, r, a))
                ptr[r] += 1
                progress = True
    stuck = [r for r in range(p) if ptr[r] < len(schedule.ranks[r])]
    if stuck:
        waits = "; ".join(f"rank {r} waits at {schedule.ranks[r][ptr[r]]} for the "
                          f"{inputs_of(schedule, r, schedule.ranks[r][ptr[r]])[0]}" for r in stuck[:3])
        raise UsageError(f"the schedule cannot run, its ranks wait for each other in a cycle: {waits}")


def incoming_messages(schedule: PipelineSchedule, rank: int) -> dict:
    """``{src_rank: [messages src sends to rank, in src's program order]}`` -- what ``"prefetch"`` posts."""
    incoming: dict = {}
    for src, actions in enumerate(schedule.ranks):
        for a in actions:
            for msg in outputs_of(schedule, src, a):
                if msg.dst == rank:
                    incoming.setdefault(src, []).append(msg)
    return incoming


def simulate_p2p(schedule: PipelineSchedule, p2p: str = "batched") -> int:
    """Run every rank's :func:`comm_plan` with rendezvous sends; return the number of messages.

    Raises ``ValueError`` when messages are matched out of order (a rank receives
    a different tensor than the one sent) or when the ranks deadlock. With
    ``"prefetch"`` every receive is posted ahead in the sender's order, so sends
    complete at once and only the data dependencies can block.
    """
    p = schedule.pp_size
    if p2p == "prefetch":
        _check_dependencies(schedule)
        return sum(len(msgs) for r in range(p) for msgs in incoming_messages(schedule, r).values())
    plans = [comm_plan(schedule, r, p2p) for r in range(p)]
    ptr = [0] * p
    open_ops = [0] * p  # unmatched operations in the step a rank is blocked on
    sends: dict = {}    # (src, dst) -> deque of posted, unmatched messages (sender's view)
    recvs: dict = {}    # (src, dst) -> deque of posted, unmatched messages (receiver's view)
    matched = 0

    def advance(r: int) -> list:
        """Run rank r's actions up to its next non-empty step; post that step."""
        posted = []
        plan = plans[r]
        while ptr[r] < len(plan):
            item = plan[ptr[r]]
            if isinstance(item, Step):
                for msg in item.sends:
                    sends.setdefault((msg.src, msg.dst), deque()).append(msg)
                    posted.append((msg.src, msg.dst))
                for msg in item.recvs:
                    recvs.setdefault((msg.src, msg.dst), deque()).append(msg)
                    posted.append((msg.src, msg.dst))
                open_ops[r] = len(item.sends) + len(item.recvs)
                return posted
            ptr[r] += 1
        return posted

    work = deque()
    for r in range(p):
        work.extend(advance(r))
    while work:
        channel = work.popleft()
        sq, rq = sends.get(channel), recvs.get(channel)
        while sq and rq:
            sent, expected = sq.popleft(), rq.popleft()
            if sent != expected:
                raise UsageError(f"messages from rank {channel[0]} to rank {channel[1]} are matched out of "
                                 f"order: it sends the {sent} while rank {channel[1]} receives the "
                                 f"{expected}; reorder the actions so both ranks agree")
            matched += 1
            for r in channel:
                open_ops[r] -= 1
                if open_ops[r] == 0:
                    ptr[r] += 1
                    work.extend(advance(r))
    blocked = [r for r in range(p) if ptr[r] < len(plans[r])]
    if blocked:
        def describe(r):
            step = plans[r][ptr[r]]
            op = [f"send the {m} to rank {m.dst}" for m in step.sends if m in sends.get((m.src, m.dst), ())]
            op += [f"receive the {m} from rank {m.src}" for m in step.recvs if m in recvs.get((m.src, m.dst), ())]
            return f"rank {r} waits to {op[0] if op else 'finish a step'}"
        hint = (" (post each send together with the next receive, as Megatron's send_forward_recv_backward "
                "does: p2p='batched')" if p2p == "blocking" else "")
        raise UsageError(f"deadlock with {p2p} send/recv: " + "; ".join(describe(r) for r in blocked[:3]) + hint)
    return matched


def choose_p2p(schedule: PipelineSchedule) -> str:
    """``"batched"`` (Megatron's non-interleaved pattern) when it cannot deadlock, else ``"prefetch"``."""
    try:
        simulate_p2p(schedule, "batched")
        return "batched"
    except ValueError:
        return "prefetch"


def check_schedule(schedule: PipelineSchedule, p2p: str | None = None) -> str:
    """Raise a one-line ``ValueError`` unless ``schedule`` is complete, dependency-correct and deadlock-free.

    ``p2p``: the protocol to prove (see the module docstring); ``None`` proves the
    one :func:`choose_p2p` picks (what the executor runs). Returns that protocol.
    """
    if not isinstance(schedule, PipelineSchedule):
        raise UsageError(f"check_schedule needs a PipelineSchedule (build_schedule or from_orders), "
                         f"got {type(schedule).__name__}")
    if len(schedule.ranks) != schedule.pp_size:
        raise UsageError(f"the schedule has {len(schedule.ranks)} rank orders for pp_size={schedule.pp_size}")
    if schedule.vp_size > 1 and schedule.pp_size < 2:
        raise UsageError("virtual pipeline stages need pp_size >= 2 (a chunk cannot send to its own rank)")
    if p2p is not None and p2p not in P2P_MODES:
        raise UsageError(f"p2p={p2p!r} is unknown: use one of {', '.join(P2P_MODES)}")
    _check_complete(schedule)
    _check_dependencies(schedule)
    if p2p is None:
        return choose_p2p(schedule)
    simulate_p2p(schedule, p2p)
    return p2p
