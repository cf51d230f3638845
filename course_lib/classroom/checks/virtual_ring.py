"""A ring of many members played by one rank: the student's function runs as one member, the rank answers for the
others ("virtual peers").

Lab 04's ring is judged for memory on a ring much wider than the ranks a laptop runs, so that the whole sequence's
score matrix is many times one step's: :class:`VirtualRing` is a checked process group
(:class:`~course_lib.classroom.checks.wire.CheckedProcessGroup`) of ``len(blocks)`` members in which the student
process is member ``rank``; :func:`virtual_world` makes it the default group of the student process forked inside
it (``dist.get_world_size()``, ``dist.get_rank()``, ``dist.group.WORLD`` all say so). Every op the student process
forwards (:mod:`~course_lib.classroom.checks.student_process`) is recorded as on a real group (the sends and what
they carried) and answered by the rank:

* a send is recorded and completes at once (the peers are the rank's);
* a receive from a neighbour is filled, when the student waits for it, with what that neighbour sends at that
  step in a right ring -- the block of member ``rank − s`` (from ``rank − 1``) or ``rank + s`` (from ``rank + 1``),
  whichever direction the student's ring turns -- laid out as the student's own messages of the first step lay out
  its own block (K and V apart, packed into one tensor, any order): each element of a first-step send is found
  among its own block's values (drawn from ``os.urandom``: all distinct), and the peer's message takes the same
  elements of its block. A message the student received before sending one like it is read in K-then-V order (K
  and V side by side when its last dimension is twice theirs). A receive from a member that is not a neighbour
  gets that member's own block (what a direct exchange would send);
* collectives are refused as on a real group (:func:`~course_lib.classroom.checks.wire.point_to_point_only`),
  barriers pass; ``dist.new_group`` of every member is the ring itself, of only some of them an error that says so.

The rank computes the truth from the blocks it handed out, so a right ring's value is right and a wrong one's is
not; what the student's code cannot see is that its peers are one process.

Megatron has no counterpart: this is the course's checker machinery.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from course_lib.classroom.checks.wire import BACKEND, CheckedProcessGroup

__all__ = ["VirtualRing", "virtual_world"]


class _Done(dist.Work):
    """A work that is complete: a send to a virtual peer, a barrier; or a receive filled when waited for."""

    def __init__(self, fill=None, source: int = -1):
        super().__init__()
        self._fill, self._source = fill, source

    def wait(self, timeout=None):  # noqa: ARG002
        if self._fill is not None:
            fill, self._fill = self._fill, None
            fill()
        return True

    def is_completed(self):
        return self._fill is None

    def is_success(self):
        return self._fill is None

    def _source_rank(self):
        return self._source


class _NoWire:
    def __getattr__(self, attr):
        raise RuntimeError("this ring's other members are played by the checker: only send/recv reach them")


def _positions(payload: torch.Tensor, flat: torch.Tensor) -> torch.Tensor | None:
    """Where each element of ``payload`` is in ``flat`` (whose values are distinct), or None if one is not there."""
    if payload.dtype != flat.dtype or payload.numel() == 0:
        return None
    values, order = flat.sort()
    at = torch.searchsorted(values, payload).clamp_(max=values.numel() - 1)
    return order[at] if torch.equal(values[at], payload) else None


class VirtualRing(CheckedProcessGroup):
    """``len(blocks)`` members; the student process is member ``rank`` and holds ``blocks[rank]``; ``blocks`` is
    every member's ``(k, v)`` (see the module docstring)."""

    def __init__(self, rank: int, blocks: list):
        size = len(blocks)
        super().__init__(_NoWire(), rank, size, list(range(size)))
        self._label = "world"
        self._blocks = blocks
        self._flat = [torch.cat([k.reshape(-1), v.reshape(-1)]) for k, v in blocks]
        self._step = self._flat[0].numel()  # elements a ring passes per step: one K and one V block
        self._sent = 0
        self._received: dict = {}
        self._layout: dict = {}  # (offset in the step, elements) -> indices into a block's flat (k, v)

    def send(self, tensors, dst, tag):  # noqa: ARG002
        t = tensors[0]
        self._record("send", tensors, peer=int(dst), carried=t)
        if self._sent < self._step:  # the first step: the student's own block, which says how it lays it out
            where = _positions(t.detach().reshape(-1), self._flat[self.rank()])
            if where is not None:
                self._layout[(self._sent, t.numel())] = where
        self._sent += t.numel()
        return _Done()

    def recv(self, tensors, src, tag):  # noqa: ARG002
        t = tensors[0]
        self._record("recv", tensors, peer=int(src))
        before = self._received.get(int(src), 0)
        self._received[int(src)] = before + t.numel()
        return _Done(lambda: self._fill(t, int(src), before), source=int(src))

    def recv_anysource(self, tensors, tag):
        return self.recv(tensors, (self.rank() - 1) % self.size(), tag)

    def barrier(self, opts=None):  # noqa: ARG002
        return _Done()

    def monitored_barrier(self, *args):  # noqa: ARG002
        return _Done()

    def _fill(self, t: torch.Tensor, src: int, before: int) -> None:
        """``t`` filled with what member ``src`` sends as its elements ``before .. before + t.numel()``."""
        me, size = self.rank(), self.size()
        step, offset = before // self._step + 1, before % self._step
        if src == (me - 1) % size:
            block = (me - step) % size
        elif src == (me + 1) % size:
            block = (me + step) % size
        else:
            block = src
        flat, (k, v) = self._flat[block], self._blocks[block]
        where = self._layout.get((offset, t.numel()))
        if where is not None:
            got = flat[where]
        elif offset == 0 and t.numel() == flat.numel() and t.dim() and t.shape[-1] == 2 * k.shape[-1]:
            got = torch.cat([k, v], -1)  # K and V packed side by side
        elif offset + t.numel() <= flat.numel():
            got = flat[offset: offset + t.numel()]
        else:
            got = torch.zeros(t.numel(), dtype=flat.dtype)
        with torch.no_grad():
            t.copy_(got.reshape(t.shape).to(t.dtype))


_SAME_RING = """
def same_ring(ranks=None, *args, **kwargs):
    if ranks is None or sorted(int(r) for r in ranks) == list(range(group.size())):
        return group
    raise ValueError(f"this ring's {group.size()} members are played by the checker, which makes no group of "
                     f"some of them: pass K and V around the group your function is given")
"""
"""``dist.new_group`` inside :func:`virtual_world` (on the rank, and in the student process forked there)."""


@contextlib.contextmanager
def virtual_world(group: VirtualRing):
    """Inside the block ``group`` is this process's default (and only) process group, so a student process forked
    inside it sees a world of ``group.size()`` members, itself member ``group.rank()``; the rank's own world is
    back afterwards."""
    state = (c10d._pg_map, c10d._pg_names, c10d._pg_group_ranks, c10d._pg_backend_config, c10d._pg_to_tag,
             c10d._tags_to_pg)
    saved = [dict(d) for d in state]
    default, new_group = c10d._world.default_pg, dist.new_group

    scope = {"group": group}  # compiled outside the checker's files: the student process inherits it, and the
    exec(compile(_SAME_RING, "<virtual ring>", "exec"), scope)  # guard would read checker code as the course's
    same_ring = scope["same_ring"]

    try:
        dist.new_group = same_ring
        for d in state:
            d.clear()
        c10d._pg_map[group] = (BACKEND, None)
        c10d._pg_names[group] = "virtual_ring"
        c10d._pg_group_ranks[group] = {i: i for i in range(group.size())}
        c10d._pg_backend_config[group] = BACKEND
        c10d._world.default_pg = group
        yield group
    finally:
        dist.new_group = new_group
        c10d._world.default_pg = default
        for d, kept in zip(state, saved):
            d.clear()
            d.update(kept)
