"""What the ranks measured, in the units of the communication formulas of :mod:`.comm`.

The formulas (:func:`~course_lib.sizing.comm.tp_comm_per_layer` ...) count **elements one rank
sends**, under the ring model of Narayanan et al. 2021 §3.2. The instrumentation
(:class:`course_lib.comm.CommRecorder`) records what a rank *issued*: one
:class:`~course_lib.comm.CommEvent` per collective or point-to-point op, with the op, the
full logical tensor's ``numel``, the group size and the pass. This module turns those
records into the formulas' units and into dicts with the formulas' keys, so a test or a
notebook cell reads ``measured == formula``. Pure functions of event lists: no torch calls.

Conventions shared with :mod:`course_lib.comm`:

* a point-to-point ``send`` sends its ``numel``; a ``recv`` sends nothing;
* a collective is converted with the ring model (``CommEvent.ring_elements_sent``):
  all-reduce ``2 N (g-1)/g``, all-gather and reduce-scatter ``N (g-1)/g`` (``N`` = the full
  tensor). That model is itself checked by measurement in ``tests/sizing/test_sizing_measured.py``
  (a ring all-reduce built from send/recv, :func:`course_lib.communication_patterns.ring_all_reduce`,
  sends exactly that many elements).

Events are split by **phase**: what a rank issued while running the forward pass and while
running the backward pass (record them with two recorders). Inside the backward phase an
event labelled ``direction="fwd"`` is a forward collective re-run by activation
recomputation (``torch.utils.checkpoint``; Megatron ``--recompute-granularity full``), and an
all-gather tagged ``"recompute"`` is Megatron's re-gather of a sequence-parallel GEMM input
(Korthikanti et al. 2022 §4.2.2): the formulas list both as separate terms. (Megatron's full
recompute re-runs the whole forward, like ``checkpoint(..., use_reentrant=True)``; torch's
default non-reentrant checkpoint stops once the last saved tensor is rebuilt, so it skips a
layer's final all-reduce.) Inside a whole training step, where phases interleave, the
``direction`` labels the course's collectives carry serve as the phases.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Sequence
from course_lib.rules import UsageError

__all__ = ["elements_sent", "tp_layer_volume", "cp_layer_volume", "pp_rank_volume", "dp_volume"]


def elements_sent(events: Iterable) -> float:
    """Elements this rank sends for ``events`` (sends as issued, collectives by the ring model)."""
    return float(sum(e.ring_elements_sent for e in events))


def _only(events: Sequence, kinds: tuple, what: str) -> list:
    events = list(events)
    other = sorted({e.kind for e in events if e.kind not in kinds})
    if other:
        raise UsageError(f"{what} expects only kind {' or '.join(map(repr, kinds))} events, got kinds {other}; "
                         f"filter the recorder first, e.g. rec.filter(kind={kinds[0]!r})")
    return events


def tp_layer_volume(forward_events: Sequence, backward_events: Sequence) -> dict:
    """One transformer layer's tensor-parallel traffic, with :func:`~.comm.tp_comm_per_layer`'s keys.

    ``forward_events``: kind "tp" events recorded while the forward pass ran; ``backward_events``:
    those recorded while the backward pass ran. Returns elements sent by this rank:
    ``forward``; ``backward`` (backward phase, without the two terms that follow);
    ``sp_backward_all_gather`` (backward-phase all-gathers tagged "recompute");
    ``recompute_forward`` (backward-phase events labelled ``direction="fwd"``); ``total``.
    """
    fwd = _only(forward_events, ("tp",), "tp_layer_volume")
    bwd = _only(backward_events, ("tp",), "tp_layer_volume")
    recompute = [e for e in bwd if e.direction == "fwd"]
    regather = [e for e in bwd if e.direction == "bwd" and e.tag == "recompute"]
    rest = [e for e in bwd if e.direction == "bwd" and e.tag != "recompute"]
    out = {"forward": elements_sent(fwd), "backward": elements_sent(rest),
           "sp_backward_all_gather": elements_sent(regather), "recompute_forward": elements_sent(recompute)}
    out["total"] = sum(out.values())
    return out


def cp_layer_volume(forward_events: Sequence, backward_events: Sequence) -> dict:
    """Ring attention's point-to-point traffic for one layer, next to :func:`~.comm.cp_comm_per_layer`.

    Counts the kind "cp" ``send`` events of each phase. Returns ``chunk`` (the elements of one
    K or V chunk sent forward; ValueError if the forward sends differ in size), ``forward``,
    ``backward``, ``total`` and ``sends`` (``{"fwd": n, "bwd": n}``).
    """
    fwd = [e for e in _only(forward_events, ("cp",), "cp_layer_volume") if e.op == "send"]
    bwd = [e for e in _only(backward_events, ("cp",), "cp_layer_volume") if e.op == "send"]
    sizes = sorted({e.numel for e in fwd})
    if len(sizes) > 1:
        raise UsageError(f"forward ring sends differ in size {sizes}: K and V chunks should have one size "
                         f"(different K and V head dims are not covered by cp_comm_per_layer)")
    out = {"chunk": sizes[0] if sizes else 0, "forward": elements_sent(fwd), "backward": elements_sent(bwd)}
    out["total"] = out["forward"] + out["backward"]
    out["sends"] = {"fwd": len(fwd), "bwd": len(bwd)}
    return out


def pp_rank_volume(sends: Iterable[tuple]) -> dict:
    """One pipeline rank's sends in an iteration, next to :func:`~.comm.pp_comm_per_iteration`.

    ``sends``: ``(what, numel)`` pairs, ``what`` = ``"act"`` (an activation sent forward) or
    ``"grad"`` (an activation gradient sent backward). Returns ``per_send`` (the size of every
    send; ValueError if they differ), ``forward``, ``backward``, ``total`` (elements) and
    ``count`` (``{"act": n, "grad": n}``).
    """
    sends = list(sends)
    bad = sorted({w for w, _ in sends} - {"act", "grad"})
    if bad:
        raise UsageError(f"send kinds {bad} are unknown: use 'act' (forward) or 'grad' (backward)")
    sizes = sorted({n for _, n in sends})
    if len(sizes) > 1:
        raise UsageError(f"pipeline sends differ in size {sizes}: every boundary tensor should be [s, b, h]")
    forward = sum(n for w, n in sends if w == "act")
    backward = sum(n for w, n in sends if w == "grad")
    count = Counter(w for w, _ in sends)
    return {"per_send": sizes[0] if sizes else 0, "forward": forward, "backward": backward,
            "total": forward + backward, "count": {"act": count["act"], "grad": count["grad"]}}


def dp_volume(events: Sequence) -> dict:
    """Gradient synchronisation traffic of one iteration, next to :func:`~.comm.dp_comm_per_iteration`.

    ``events``: kind "dp" events, or "dp-cp" (the data-parallel group with context parallelism,
    as :mod:`course_lib.train` labels it): one all-reduce of the gradient buffer, or ZeRO's
    reduce-scatter + all-gather. Returns ``group_size`` (ValueError if the events use
    different groups), ``numel`` (per op, summed) and ``total`` (elements sent by this rank).
    """
    events = _only(events, ("dp", "dp-cp"), "dp_volume")
    sizes = sorted({e.group_size for e in events})
    if len(sizes) > 1:
        raise UsageError(f"data-parallel events use groups of sizes {sizes}: pass one group's events")
    numel = Counter()
    for e in events:
        numel[e.op] += e.numel
    return {"group_size": sizes[0] if sizes else 1, "numel": dict(numel), "total": elements_sent(events)}
