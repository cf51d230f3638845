"""Instrumented collectives: every collective the course issues is recorded.

The parallel layers never call ``torch.distributed`` directly; they call the
wrappers below (``all_reduce``, ``all_gather``, ``reduce_scatter``,
``broadcast``, ``all_to_all``, ``send``, ``recv``). Each wrapper issues the real
collective and, when a :class:`CommRecorder` is active in this process, appends
a :class:`CommEvent` to it: the op, the group's kind label ("tp", "pp", "dp",
"cp", ...), the group size, the element count, the bytes, and the direction
(forward or backward pass). A notebook can print it, a test assert it::

    with CommRecorder() as rec:
        out = layer(x)          # forward
        out.backward(dy)        # backward
    print(rec.table())
    assert rec.count(op="all_reduce", direction="fwd") == 2

Conventions
-----------
* Every wrapper takes the process group explicitly (no hidden global group).
* A collective over a group of one is a no-op: the input is returned unchanged
  and nothing is recorded (nothing was sent). ``send``/``recv`` need a peer.
* ``numel`` is the size of the *full* logical tensor of the collective, the
  convention of the NCCL performance notes (``nccl-tests/doc/PERFORMANCE.md``):
  all-reduce: the tensor; all-gather: the gathered output; reduce-scatter: the
  input before scattering; broadcast/send/recv/all-to-all: the tensor a rank
  holds. ``bytes = numel * element size``.
* ``sent`` is what leaves the rank when the op's splits fix it exactly: an uneven
  all-to-all (the MoE dispatch) sends every row but the chunk it keeps, so its
  ``sent`` is the rows addressed to *other* ranks x row size, where the even
  formula ``N (t-1)/t`` below would only estimate it. ``None``: use the formula.
* ``direction`` is ``"fwd"`` or ``"bwd"``. When not given it is inferred: a
  collective issued while autograd runs a backward pass is ``"bwd"``.
* The wrappers are not differentiable (like ``torch.distributed``); autograd-aware
  versions are the mappings in :mod:`course_lib.tensor_parallel.mappings`.
* ``kind`` defaults to the parallelism that uses an op most in this course
  ("tp" for the collectives, "cp" for all-to-all, "pp" for send/recv); pass it.

The ring cost model
-------------------
:func:`ring_elements_sent` (kept in :mod:`course_lib.ring_cost`, torch-free, re-exported here): the
elements one rank *sends* when the collective runs as a ring over ``t`` ranks -- ``N (t-1)/t`` for a
reduce-scatter or an all-gather, ``2 N (t-1)/t`` for an all-reduce (Patarasuk & Yuan 2009; Narayanan
et al. 2021 §3.2). Lab 00's six patterns, run bare on ``torch.distributed`` to be looked at, are
:mod:`course_lib.communication_patterns`, not these wrappers.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from course_lib import rules
from course_lib.ring_cost import COMM_OPS as OPS, comm_op, ring_elements_sent

__all__ = [
    "OPS", "CommEvent", "CommRecorder", "ring_elements_sent", "record_event",
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send", "recv",
    "group_size", "group_rank", "summarize", "all_gather_into_tensor", "reduce_scatter_tensor",
]

DIRECTIONS = ("fwd", "bwd")
# torch 2.13 renamed the tensor-in/tensor-out collectives (the old names warn); torch >= 2.4 has one or the other.
# torch's own (not recorded): for code that records its events itself (course_lib.distributed's engine).
all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
               "avg": dist.ReduceOp.AVG, "product": dist.ReduceOp.PRODUCT}


# --------------------------------------------------------------------------- events


@dataclass(frozen=True)
class CommEvent:
    """One collective (or point-to-point op) as issued by one rank.

    ``op``: one of :data:`OPS`; ``kind``: the group's label ("tp", "pp", ...);
    ``group_size``: ranks in the group; ``numel``/``bytes``: full logical tensor
    (see the module docstring); ``direction``: "fwd" or "bwd"; ``reduce_op``:
    "sum"/"max"/... for reductions; ``source``: the function that issued it (e.g.
    ``"reduce_from_tensor_model_parallel_region"``); ``tag``: a free note, e.g.
    ``"recompute"`` for Megatron's re-gather of a sequence-parallel input in the
    backward pass; ``peer``: the other global rank for send/recv; ``rank``: the
    global rank that recorded it; ``sent``: the elements that left this rank when
    known exactly (an uneven all-to-all's rows for other ranks), else None."""

    op: str
    kind: str
    group_size: int
    numel: int
    bytes: int
    direction: str
    dtype: str = "float32"
    reduce_op: Optional[str] = None
    source: Optional[str] = None
    tag: Optional[str] = None
    peer: Optional[int] = None
    rank: Optional[int] = None
    sent: Optional[int] = None

    @property
    def ring_elements_sent(self) -> float:
        """Elements this rank sends: ``sent`` where the op knows it exactly, else the ring cost
        model's (see :func:`ring_elements_sent`)."""
        if self.sent is not None:
            return float(self.sent)
        return ring_elements_sent(self.op, self.numel, self.group_size)

    def as_dict(self) -> dict:
        return asdict(self)


# ------------------------------------------------------------------------- recorder

_ACTIVE: list["CommRecorder"] = []


class CommRecorder:
    """Context manager that records every collective issued through this module.

    Recorders nest (every active recorder receives each event). Each process
    (rank) records its own events; return ``rec.events`` (picklable) from a
    rank function to inspect them in the parent.
    """

    def __init__(self):
        self.events: list[CommEvent] = []

    def __enter__(self) -> "CommRecorder":
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc) -> None:
        # Remove this recorder (not blindly the last one) so misuse cannot drop another's events.
        for i in range(len(_ACTIVE) - 1, -1, -1):
            if _ACTIVE[i] is self:
                del _ACTIVE[i]
                break

    def clear(self) -> None:
        self.events.clear()

    def filter(self, **match) -> list[CommEvent]:
        """Events whose fields equal every given value, e.g. ``filter(op="all_reduce", direction="fwd")``.
        A value may also be a tuple/list/set of accepted values."""
        fields = CommEvent.__dataclass_fields__
        for key in match:
            if key not in fields:
                raise rules.UsageError(f"{key!r} is not a CommEvent field: use one of {', '.join(fields)}")

        def ok(e):
            for k, v in match.items():
                got = getattr(e, k)
                if isinstance(v, (tuple, list, set, frozenset)):
                    if got not in v:
                        return False
                elif got != v:
                    return False
            return True

        return [e for e in self.events if ok(e)]

    def count(self, **match) -> int:
        return len(self.filter(**match))

    def numel(self, **match) -> int:
        return sum(e.numel for e in self.filter(**match))

    def bytes(self, **match) -> int:
        return sum(e.bytes for e in self.filter(**match))

    def ring_elements_sent(self, **match) -> float:
        """Elements this rank sends for the matching events under the ring cost model."""
        return sum(e.ring_elements_sent for e in self.filter(**match))

    def summary(self, **match) -> list[dict]:
        """Rows grouped by (direction, kind, op, reduce_op, numel, source, tag), in first-seen order,
        each with ``count`` and per-rank ``ring_elements_sent`` (all calls of the row together)."""
        rows: "OrderedDict[tuple, dict]" = OrderedDict()
        for e in self.filter(**match):
            key = (e.direction, e.kind, e.op, e.reduce_op, e.numel, e.bytes, e.source, e.tag)
            row = rows.get(key)
            if row is None:
                row = rows[key] = dict(direction=e.direction, kind=e.kind, op=e.op, reduce_op=e.reduce_op,
                                       group_size=e.group_size, numel=e.numel, bytes=e.bytes,
                                       source=e.source, tag=e.tag, count=0, ring_elements_sent=0.0)
            row["count"] += 1
            row["ring_elements_sent"] += e.ring_elements_sent
        return list(rows.values())

    def table(self, **match) -> str:
        """A plain-text table of :meth:`summary` (deterministic: safe for notebook outputs)."""
        rows = self.summary(**match)
        if not rows:
            return "(no collectives recorded)"
        head = ["dir", "group", "op", "count", "elements each", "bytes each", "sent/rank (ring)", "issued by"]
        body = []
        for r in rows:
            op = r["op"] + (f"({r['reduce_op']})" if r["reduce_op"] not in (None, "sum") else "")
            src = (r["source"] or "") + (f" [{r['tag']}]" if r["tag"] else "")
            body.append([r["direction"], f"{r['kind']}({r['group_size']})", op, str(r["count"]),
                         f"{r['numel']:,}", f"{r['bytes']:,}", f"{r['ring_elements_sent']:,.0f}", src])
        widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
        fmt = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
        lines = [fmt(head), fmt(["-" * w for w in widths])] + [fmt(b) for b in body]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"CommRecorder({len(self.events)} events)"


def _infer_direction() -> str:
    task = getattr(torch._C, "_current_graph_task_id", None)
    return "bwd" if task is not None and task() >= 0 else "fwd"


def record_event(op: str, numel: int, *, group_size: int, kind: str, dtype=torch.float32,
                 direction: Optional[str] = None, reduce_op: Optional[str] = None,
                 source: Optional[str] = None, tag: Optional[str] = None, peer: Optional[int] = None,
                 sent: Optional[int] = None) -> None:
    """Record an op issued some other way (e.g. inside ``dist.batch_isend_irecv``).

    The wrappers below call this; code that issues its own communication should
    call it too so that recorders see everything."""
    if not _ACTIVE:
        return
    comm_op(op)
    direction = direction or _infer_direction()
    if direction not in DIRECTIONS:
        raise rules.UsageError(f"direction={direction!r} must be 'fwd' or 'bwd'")
    itemsize = torch.empty((), dtype=dtype).element_size()
    event = CommEvent(op=op, kind=kind, group_size=int(group_size), numel=int(numel),
                      bytes=int(numel) * itemsize, direction=direction, dtype=str(dtype).replace("torch.", ""),
                      reduce_op=reduce_op, source=source, tag=tag, peer=peer,
                      rank=dist.get_rank() if dist.is_initialized() else None,
                      sent=None if sent is None else int(sent))
    for rec in _ACTIVE:
        rec.events.append(event)


# ------------------------------------------------------------------------- wrappers


def _check_group(group, fn: str):
    if group is None:
        raise rules.UsageError(f"{fn}: group is None; pass the process group explicitly "
                               f"(e.g. the tensor-parallel group; use dist.group.WORLD for all ranks)")
    return group


def group_size(group) -> int:
    """Ranks in ``group`` (explicit; ``dist.group.WORLD`` for all ranks)."""
    return dist.get_world_size(_check_group(group, "group_size"))


def group_rank(group) -> int:
    """This process's rank inside ``group``."""
    return dist.get_rank(_check_group(group, "group_rank"))


def _reduce_op(op: str):
    if op not in _REDUCE_OPS:
        raise rules.UsageError(f"op={op!r} is unknown: use one of {', '.join(_REDUCE_OPS)}")
    return _REDUCE_OPS[op]


def all_reduce(tensor: torch.Tensor, group, *, op: str = "sum", kind: str = "tp",
               direction: Optional[str] = None, source: Optional[str] = None,
               tag: Optional[str] = None) -> torch.Tensor:
    """All-reduce ``tensor`` in place over ``group`` and return it (no-op for a group of one)."""
    t = group_size(group)
    if t == 1:
        return tensor
    red = _reduce_op(op)
    if not tensor.is_contiguous():
        raise rules.UsageError("all_reduce: tensor must be contiguous (call .contiguous() first)")
    record_event("all_reduce", tensor.numel(), group_size=t, kind=kind, dtype=tensor.dtype,
                 direction=direction, reduce_op=op, source=source, tag=tag)
    dist.all_reduce(tensor, op=red, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, group, *, dim: int = 0, kind: str = "tp",
               direction: Optional[str] = None, source: Optional[str] = None,
               tag: Optional[str] = None) -> torch.Tensor:
    """Gather every rank's ``tensor`` and concatenate along ``dim`` in group-rank order.

    [.., n, ..] on each of t ranks -> [.., t*n, ..] (no-op for a group of one)."""
    t = group_size(group)
    if t == 1:
        return tensor
    if tensor.dim() == 0:
        tensor = tensor.reshape(1)
    dim = dim % tensor.dim()
    inp = tensor.contiguous()
    out = torch.empty((t * inp.shape[0],) + tuple(inp.shape[1:]), dtype=inp.dtype, device=inp.device)
    record_event("all_gather", out.numel(), group_size=t, kind=kind, dtype=inp.dtype,
                 direction=direction, source=source, tag=tag)
    all_gather_into_tensor(out, inp, group=group)
    if dim != 0:  # the gather stacks along dim 0; move the rank blocks to ``dim``
        out = torch.cat(out.chunk(t, dim=0), dim=dim)
    return out


def reduce_scatter(tensor: torch.Tensor, group, *, dim: int = 0, op: str = "sum", kind: str = "tp",
                   direction: Optional[str] = None, source: Optional[str] = None,
                   tag: Optional[str] = None) -> torch.Tensor:
    """Sum ``tensor`` over ``group`` and keep this rank's 1/t slice along ``dim``.

    [.., t*n, ..] on each rank -> [.., n, ..] (no-op for a group of one)."""
    t = group_size(group)
    if t == 1:
        return tensor
    dim = dim % tensor.dim()
    if tensor.shape[dim] % t:
        raise rules.UsageError(f"reduce_scatter: dimension {dim} of size {tensor.shape[dim]} is not divisible "
                               f"by the group size {t}")
    red = _reduce_op(op)
    inp = tensor if dim == 0 else torch.cat(tensor.chunk(t, dim=dim), dim=0)
    inp = inp.contiguous()
    out = torch.empty((inp.shape[0] // t,) + tuple(inp.shape[1:]), dtype=inp.dtype, device=inp.device)
    record_event("reduce_scatter", inp.numel(), group_size=t, kind=kind, dtype=inp.dtype,
                 direction=direction, reduce_op=op, source=source, tag=tag)
    reduce_scatter_tensor(out, inp, op=red, group=group)
    # For dim != 0 the t chunks were stacked along dim 0 above, so this rank's
    # slice of the stack already has the chunk's shape [.., n, ..].
    return out


def broadcast(tensor: torch.Tensor, src: int, group, *, kind: str = "tp", direction: Optional[str] = None,
              source: Optional[str] = None, tag: Optional[str] = None) -> torch.Tensor:
    """Broadcast ``tensor`` in place from global rank ``src`` to ``group`` (no-op for a group of one)."""
    t = group_size(group)
    if t == 1:
        return tensor
    record_event("broadcast", tensor.numel(), group_size=t, kind=kind, dtype=tensor.dtype,
                 direction=direction, source=source, tag=tag, peer=src)
    dist.broadcast(tensor, src=src, group=group)
    return tensor


def all_to_all(tensor: torch.Tensor, group, *, kind: str = "cp", direction: Optional[str] = None,
               source: Optional[str] = None, tag: Optional[str] = None) -> torch.Tensor:
    """Equal-split all-to-all along dim 0: chunk i of this rank goes to group rank i
    (``all_to_all_single``). [t*n, ...] -> [t*n, ...] (no-op for a group of one)."""
    t = group_size(group)
    if t == 1:
        return tensor
    if tensor.shape[0] % t:
        raise rules.UsageError(f"all_to_all: dimension 0 of size {tensor.shape[0]} is not divisible by the "
                               f"group size {t}")
    inp = tensor.contiguous()
    out = torch.empty_like(inp)
    record_event("all_to_all", inp.numel(), group_size=t, kind=kind, dtype=inp.dtype,
                 direction=direction, source=source, tag=tag)
    dist.all_to_all_single(out, inp, group=group)
    return out


def _check_peer(peer: int, fn: str) -> None:
    if peer == dist.get_rank():
        raise rules.UsageError(f"{fn}: peer={peer} is this rank; a rank cannot send to itself "
                               f"(gloo refuses; skip the transfer for a group of one)")


def send(tensor: torch.Tensor, dst: int, group=None, *, kind: str = "pp", direction: Optional[str] = None,
         source: Optional[str] = None, tag: Optional[str] = None) -> None:
    """Blocking send of ``tensor`` to global rank ``dst`` (``group`` only sizes the record)."""
    _check_peer(dst, "send")
    t = dist.get_world_size(group) if group is not None else 2
    record_event("send", tensor.numel(), group_size=t, kind=kind, dtype=tensor.dtype,
                 direction=direction, source=source, tag=tag, peer=dst)
    dist.send(tensor.contiguous(), dst=dst, group=group)


def recv(tensor: torch.Tensor, src: int, group=None, *, kind: str = "pp", direction: Optional[str] = None,
         source: Optional[str] = None, tag: Optional[str] = None) -> torch.Tensor:
    """Blocking receive into ``tensor`` from global rank ``src``; returns ``tensor``."""
    _check_peer(src, "recv")
    t = dist.get_world_size(group) if group is not None else 2
    record_event("recv", tensor.numel(), group_size=t, kind=kind, dtype=tensor.dtype,
                 direction=direction, source=source, tag=tag, peer=src)
    dist.recv(tensor, src=src, group=group)
    return tensor


def summarize(events: Iterable[CommEvent]) -> CommRecorder:
    """Wrap a list of events (e.g. returned from a rank) in a recorder to query/print them."""
    rec = CommRecorder()
    rec.events = list(events)
    return rec
