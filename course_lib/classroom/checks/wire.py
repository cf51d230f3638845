"""What crossed the wire: a process group that records, or refuses, every operation.

The course's :class:`course_lib.comm.CommRecorder` sees what goes through the
course's wrappers. A checker must see *everything* a student's code sends,
however it was called: ``dist.all_reduce``, ``torch.distributed.distributed_c10d
.all_reduce``, a name bound before the checker ran (``from torch.distributed
import all_reduce as ar``), object collectives (``all_gather_object`` pickles
into an all-gather), ``gather`` + ``scatter``. Replacing ``dist.*`` attributes catches
none of those reliably.

So the checker replaces the *process group itself*. :func:`install_checked_world`
(called on each rank by :func:`launch_checked`) destroys the launcher's default
group and creates a new one with the backend ``"course_checked"``: a Python
``ProcessGroup`` (:class:`CheckedProcessGroup`) that wraps a real gloo group.
Every Python entry point of ``torch.distributed`` ends in a method of the
group object (the C++ dispatcher calls ``ProcessGroup::allreduce`` etc., which
a Python subclass overrides), so this is the one place nothing gets past
(functional collectives and DTensor, which dispatch to a C++ backend the checked
group does not have, fail on it instead of getting past):

* every op is recorded as a :class:`course_lib.comm.CommEvent` (``source=
  "process_group"``; ``kind`` = ``"world"`` or ``"ranks 0,2"``; ``peer`` the
  global rank of a send/recv) for every :func:`wire_recorder` active on the rank;
* inside :func:`point_to_point_only` every data-moving collective raises
  :class:`CollectiveRefused` (barriers pass: they move no data). Groups the
  student creates with ``dist.new_group()`` inherit the backend, so they are
  checked too; a group made with an explicit other backend (``backend="gloo"``)
  is found when the block ends (:func:`foreign_groups`) and refused then.

The limit: code that builds a raw ``ProcessGroupGloo`` from the private store
object, or edits this module's state, is not stopped. Nothing reachable through
public names is.
"""

from __future__ import annotations

import contextlib
import datetime

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from course_lib.comm import CommEvent, _infer_direction

BACKEND = "course_checked"
REFUSED_MARK = "[collective refused]"
"""Appears in the message of every refused collective: a checker finds it in a rank's traceback."""

_RECORDERS: list["WireRecorder"] = []
_POLICY = {"p2p_only": None}  # None, or the text that names the exercise's rule


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


class CollectiveRefused(RuntimeError):
    """A collective ran inside :func:`point_to_point_only`."""


class WireRecorder:
    """Collects the :class:`CommEvent` of every op on a checked group while active (see :func:`wire_recorder`)."""

    def __init__(self):
        self.events: list[CommEvent] = []


@contextlib.contextmanager
def wire_recorder():
    """``with wire_recorder() as rec:`` -> ``rec.events``, every op this rank issued on a checked group."""
    rec = WireRecorder()
    _RECORDERS.append(rec)
    try:
        yield rec
    finally:
        _RECORDERS.remove(rec)


def _numel(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel()
    return sum(_numel(t) for t in tensors)


def _dtype(tensors):
    if isinstance(tensors, torch.Tensor):
        return tensors.dtype
    for t in tensors:
        found = _dtype(t)
        if found is not None:
            return found
    return None


class CheckedProcessGroup(dist.ProcessGroup):
    """A process group that records every op and forwards it to a wrapped gloo group,
    or refuses collectives while :func:`point_to_point_only` is active."""

    def __init__(self, inner, rank: int, size: int, global_ranks: list[int]):
        super().__init__(rank, size)
        self._inner = inner
        self._global_ranks = list(global_ranks) or list(range(size))  # empty for the default group
        world = dist.get_world_size() if dist.is_initialized() else size  # the default group is being made
        self._label = ("world" if self._global_ranks == list(range(world))
                       else "ranks " + ",".join(map(str, self._global_ranks)))

    def getBackendName(self):  # noqa: N802 - torch's name
        return BACKEND

    # ---- bookkeeping
    def _record(self, op: str, tensors, *, peer=None, reduce_op=None, numel=None) -> None:
        if not _RECORDERS:
            return
        n = _numel(tensors) if numel is None else int(numel)
        dtype = _dtype(tensors) or torch.float32
        event = CommEvent(op=op, kind=self._label, group_size=self.size(), numel=n,
                          bytes=n * torch.empty((), dtype=dtype).element_size(), direction=_infer_direction(),
                          dtype=str(dtype).replace("torch.", ""), reduce_op=reduce_op, source="process_group",
                          peer=peer, rank=dist.get_rank())
        for rec in _RECORDERS:
            rec.events.append(event)

    def _collective(self, op: str, tensors, method: str, *args, numel=None, reduce_op=None):
        rule = _POLICY["p2p_only"]
        if rule is not None:
            self._record(op, tensors, numel=numel, reduce_op=reduce_op)
            raise CollectiveRefused(f"{REFUSED_MARK} {_article(op)} {op} ran on the process group ({self._label}): {rule}")
        self._record(op, tensors, numel=numel, reduce_op=reduce_op)
        return getattr(self._inner, method)(*args)

    # ---- point-to-point: always allowed
    def send(self, tensors, dst, tag):
        self._record("send", tensors, peer=self._global_ranks[dst])
        return self._inner.send(tensors, dst, tag)

    def recv(self, tensors, src, tag):
        self._record("recv", tensors, peer=self._global_ranks[src])
        return self._inner.recv(tensors, src, tag)

    def recv_anysource(self, tensors, tag):
        self._record("recv", tensors)
        return self._inner.recv_anysource(tensors, tag)

    # ---- no data: always allowed, not recorded
    def barrier(self, opts=None):
        return self._inner.barrier(opts) if opts is not None else self._inner.barrier()

    def monitored_barrier(self, *args):
        return self._inner.monitored_barrier(*args)

    # ---- collectives: recorded, refused inside point_to_point_only()
    def allreduce(self, tensors, opts):
        return self._collective("all_reduce", tensors, "allreduce", tensors, opts,
                                reduce_op=str(getattr(opts.reduceOp, "op", opts.reduceOp)).split(".")[-1].lower())

    def allreduce_coalesced(self, tensors, opts):
        return self._collective("all_reduce", tensors, "allreduce_coalesced", tensors, opts)

    def allgather(self, outputs, inputs, opts):
        return self._collective("all_gather", outputs, "allgather", outputs, inputs, opts)

    def _allgather_base(self, output, input, opts):  # noqa: A002 - torch's signature
        return self._collective("all_gather", output, "_allgather_base", output, input, opts)

    all_gather_single = _allgather_base

    def allgather_coalesced(self, outputs, inputs, opts):
        return self._collective("all_gather", outputs, "allgather_coalesced", outputs, inputs, opts)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts):
        return self._collective("all_gather", outputs, "allgather_into_tensor_coalesced", outputs, inputs, opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(self, outputs, inputs, opts):
        return self._collective("reduce_scatter", inputs, "reduce_scatter", outputs, inputs, opts)

    def _reduce_scatter_base(self, output, input, opts):  # noqa: A002
        return self._collective("reduce_scatter", input, "_reduce_scatter_base", output, input, opts)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        return self._collective("reduce_scatter", inputs, "reduce_scatter_tensor_coalesced", outputs, inputs, opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def broadcast(self, tensors, opts):
        return self._collective("broadcast", tensors, "broadcast", tensors, opts)

    def reduce(self, tensors, opts):
        return self._collective("reduce", tensors, "reduce", tensors, opts)

    def gather(self, outputs, inputs, opts):
        return self._collective("gather", inputs, "gather", outputs, inputs, opts)

    def scatter(self, outputs, inputs, opts):
        return self._collective("scatter", outputs, "scatter", outputs, inputs, opts)

    def alltoall(self, outputs, inputs, opts):
        return self._collective("all_to_all", inputs, "alltoall", outputs, inputs, opts)

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):  # noqa: A002
        return self._collective("all_to_all", input, "alltoall_base", output, input, output_split_sizes,
                                input_split_sizes, opts)

    all_to_all_single = alltoall_base


def _create_checked_group(opts, _backend_options):
    inner = dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, opts.timeout)
    return CheckedProcessGroup(inner, opts.group_rank, opts.group_size, opts.global_ranks_in_group)


if BACKEND.upper() not in dist.Backend._plugins:  # once per process
    dist.Backend.register_backend(BACKEND, _create_checked_group, extended_api=True, devices=["cpu"])


def install_checked_world(timeout: float = 20) -> None:
    """On a rank: replace the default process group with a checked one over the same ranks."""
    if isinstance(c10d._get_default_group(), CheckedProcessGroup):
        return
    store, rank, world = c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
    dist.barrier()  # every rank has finished connecting the old group before any rank closes it
    dist.destroy_process_group()
    dist.init_process_group(BACKEND, store=dist.PrefixStore(f"{BACKEND}/", store), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))


def foreign_groups() -> list:
    """Process groups on this rank that are not checked (made with an explicit other backend)."""
    return [pg for pg in c10d._world.pg_map if not isinstance(pg, CheckedProcessGroup)]


@contextlib.contextmanager
def point_to_point_only(rule: str = "this exercise is built from send/recv only"):
    """Inside the block every collective on a checked group raises :class:`CollectiveRefused` naming
    ``rule``; a process group with another backend created inside the block is refused at its end."""
    before = set(map(id, foreign_groups()))
    previous = _POLICY["p2p_only"]
    _POLICY["p2p_only"] = rule
    try:
        yield
    finally:
        _POLICY["p2p_only"] = previous
    if any(id(pg) not in before for pg in foreign_groups()):
        raise CollectiveRefused(f"{REFUSED_MARK} a process group with another backend was created: {rule}")


def _checked_rank(rank_fn, rank_kwargs, group_timeout):
    install_checked_world(group_timeout)
    return rank_fn(**rank_kwargs)


def launch_checked(rank_fn, world_size: int, *, timeout: float = 20, **kwargs):
    """:func:`course_lib.launch.launch` ``rank_fn(**kwargs)`` on ``world_size`` ranks whose default
    process group is checked (recorded with :func:`wire_recorder`, refusable with
    :func:`point_to_point_only`). Raises what ``launch`` raises."""
    from course_lib.launch import launch

    return launch(_checked_rank, world_size=world_size, output="none", timeout=timeout, rank_fn=rank_fn,
                  rank_kwargs=kwargs, group_timeout=timeout)
