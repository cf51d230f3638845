"""What crossed the wire and what it carried: a process group that records, or refuses, every operation.

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

Three more pieces make the proof of an algorithm out of that record:

* **what it carried**: next to each event, :class:`WireRecorder` keeps a copy of what this rank
  put on the wire (``rec.carried[i]``: the input of a collective, the tensor of a send, the
  per-destination chunks of an all-to-all), so a checker can ask whether the ZeRO-1 all-gather
  carried the *updated* shard, or a ring's sends carried K/V blocks;
* **inputs the student cannot predict**: :func:`secret_generator` seeds a generator on the
  rank from ``os.urandom`` after the fork, so no other rank (and no code reading the checker's
  source) can rebuild this rank's inputs; the checker computes the truth *after* the student's
  function returned, with its own collectives;
* **what it computed**: :func:`largest_tensor` records the largest tensor any torch op produced
  inside a block (a dispatch mode), so an answer that gathers every block and runs one dense
  computation is seen by the size of what it built.

What the student's code did, for the record a grader keeps (:mod:`course_lib.classroom.checks.exercise`):
:func:`traced` keeps a :class:`StudentTrace` -- how often the checker called the student's code
(:func:`student_running`, entered by every guarded call) and every op that code issued on a checked
group; each rank of :func:`launch_checked` traces its own and the launch adds them up.

An uneven ``all_to_all_single`` whose ``output_split_sizes`` do not match what the peers send
would make gloo abort the process (SIGABRT, no traceback): the checked group exchanges the
split sizes first and raises :class:`SplitMismatch` on every rank, naming the rows expected and
sent. The list form of ``all_to_all`` moves equal-sized tensors only on gloo; unequal ones raise
:class:`SplitMismatch` with that sentence instead of gloo's raw size error.

The limit: code that builds a raw ``ProcessGroupGloo`` from the private store
object, edits this module's state, reads the checker's frames, or computes outside torch (numpy)
is not stopped. Nothing reachable through public names is. Where a checker calls the student in a
student process (:mod:`~course_lib.classroom.checks.student_process`), that code runs in the student's
own process: the store's and gloo's sockets are closed there, this module's state there is a copy, and
the record and the refusals that count are the rank's.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from course_lib.comm import CommEvent, _infer_direction

BACKEND = "course_checked"
REFUSED_MARK = "[collective refused]"
"""Appears in the message of every refused collective: a checker finds it in a rank's traceback."""
SPLIT_MARK = "[all-to-all splits]"
"""Appears in the message of every :class:`SplitMismatch`."""
CARRY_LIMIT = 1 << 20
"""Elements per op above which :class:`WireRecorder` keeps no copy of what was carried (None)."""

_RECORDERS: list["WireRecorder"] = []
_TRACES: list["StudentTrace"] = []  # innermost last: one per checker running in this process
_POLICY = {"p2p_only": None}  # None, or the text that names the exercise's rule
_GROUP_TIMEOUT = {"s": 20.0}  # the checked world's timeout on this rank (install_checked_world)


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


class CollectiveRefused(RuntimeError):
    """A collective ran inside :func:`point_to_point_only`."""


class SplitMismatch(RuntimeError):
    """An all-to-all whose sizes cannot work: raised on the rank before gloo would abort it."""


class WireRecorder:
    """Collects the :class:`CommEvent` of every op on a checked group while active (see :func:`wire_recorder`),
    and in ``carried`` (one entry per event) a copy of what this rank sent: a tensor, or a list of tensors
    (one per destination for an all-to-all, one per input for list collectives); None for a receive, or
    above :data:`CARRY_LIMIT` elements."""

    def __init__(self):
        self.events: list[CommEvent] = []
        self.carried: list = []


@contextlib.contextmanager
def _active(stack: list, item):
    """``item`` on ``stack`` for the block: what the checked group and the guarded calls report to."""
    stack.append(item)
    try:
        yield item
    finally:
        stack.remove(item)


def wire_recorder():
    """``with wire_recorder() as rec:`` -> ``rec.events``, every op this rank issued on a checked group."""
    return _active(_RECORDERS, WireRecorder())


@dataclass
class StudentTrace:
    """What the student's code did while one checker ran: ``calls`` (how often it was called), and on
    checked ranks ``ops`` (``{"send on world": 12}``, summed over ranks), ``sent_bytes`` (what it put
    on the wire: sends and collective inputs, every rank) and ``worlds`` (the size of each launch)."""

    calls: int = 0
    ops: Counter = field(default_factory=Counter)
    sent_bytes: int = 0
    worlds: list = field(default_factory=list)
    depth: int = 0  # > 0 while the student's code runs

    def note(self, event: CommEvent) -> None:
        self.ops[f"{event.op} on {event.kind}"] += 1
        if event.op != "recv":
            self.sent_bytes += event.bytes

    def add_launch(self, world: int, ranks: list) -> None:
        """Add the traces of one launch's ranks."""
        self.worlds.append(world)
        for rank in ranks:
            self.calls += rank.calls
            self.ops.update(rank.ops)
            self.sent_bytes += rank.sent_bytes

    def evidence(self) -> dict:
        """The trace as plain JSON: ``calls``, and where ranks ran ``ranks`` (world size of each launch),
        ``ops`` (``{"send": 24}``), ``groups`` (the group labels used) and ``bytes``."""
        out: dict = {"calls": self.calls}
        if self.worlds:
            ops: Counter = Counter()
            for key, n in self.ops.items():
                ops[key.split(" on ", 1)[0]] += n
            out.update(ranks=list(self.worlds), ops=dict(sorted(ops.items())),
                       groups=sorted({key.split(" on ", 1)[1] for key in self.ops}), bytes=self.sent_bytes)
        return out


def traced():
    """``with traced() as trace:`` -> a :class:`StudentTrace` of the student's code run inside the block."""
    return _active(_TRACES, StudentTrace())


@contextlib.contextmanager
def student_running():
    """Around one call of the student's code: counted, and its ops recorded, by the active :func:`traced`."""
    trace = _TRACES[-1] if _TRACES else None
    if trace is None:
        yield
        return
    trace.calls += 1
    trace.depth += 1
    try:
        yield
    finally:
        trace.depth -= 1


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
    def _record(self, op: str, tensors, *, peer=None, reduce_op=None, numel=None, carried=None) -> None:
        """Record one op for every active recorder; ``carried``: what this rank sends (copied here)."""
        trace = _TRACES[-1] if _TRACES and _TRACES[-1].depth else None
        if not _RECORDERS and trace is None:
            return
        n = _numel(tensors) if numel is None else int(numel)
        dtype = _dtype(tensors) or torch.float32
        event = CommEvent(op=op, kind=self._label, group_size=self.size(), numel=n,
                          bytes=n * torch.empty((), dtype=dtype).element_size(), direction=_infer_direction(),
                          dtype=str(dtype).replace("torch.", ""), reduce_op=reduce_op, source="process_group",
                          peer=peer, rank=dist.get_rank())
        if trace is not None:
            trace.note(event)
        if not _RECORDERS:
            return
        copy = _copy(carried) if carried is not None and _numel(carried) <= CARRY_LIMIT else None
        for rec in _RECORDERS:
            rec.events.append(event)
            rec.carried.append(copy)

    def _collective(self, op: str, tensors, method: str, *args, numel=None, reduce_op=None, carried=None):
        rule = _POLICY["p2p_only"]
        self._record(op, tensors, numel=numel, reduce_op=reduce_op, carried=carried)
        if rule is not None:
            raise CollectiveRefused(f"{REFUSED_MARK} {_article(op)} {op} ran on the process group ({self._label}): {rule}")
        return getattr(self._inner, method)(*args)

    # ---- point-to-point: always allowed
    def send(self, tensors, dst, tag):
        self._record("send", tensors, peer=self._global_ranks[dst], carried=tensors[0])
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
        return self._collective("all_reduce", tensors, "allreduce", tensors, opts, carried=tensors[0],
                                reduce_op=str(getattr(opts.reduceOp, "op", opts.reduceOp)).split(".")[-1].lower())

    def allreduce_coalesced(self, tensors, opts):
        return self._collective("all_reduce", tensors, "allreduce_coalesced", tensors, opts, carried=list(tensors))

    def allgather(self, outputs, inputs, opts):
        return self._collective("all_gather", outputs, "allgather", outputs, inputs, opts, carried=inputs[0])

    def _allgather_base(self, output, input, opts):  # noqa: A002 - torch's signature
        return self._collective("all_gather", output, "_allgather_base", output, input, opts, carried=input)

    all_gather_single = _allgather_base

    def allgather_coalesced(self, outputs, inputs, opts):
        return self._collective("all_gather", outputs, "allgather_coalesced", outputs, inputs, opts,
                                carried=list(inputs))

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts):
        return self._collective("all_gather", outputs, "allgather_into_tensor_coalesced", outputs, inputs, opts,
                                carried=list(inputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(self, outputs, inputs, opts):
        return self._collective("reduce_scatter", inputs, "reduce_scatter", outputs, inputs, opts,
                                carried=_flat_cat(inputs[0]))

    def _reduce_scatter_base(self, output, input, opts):  # noqa: A002
        return self._collective("reduce_scatter", input, "_reduce_scatter_base", output, input, opts, carried=input)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts):
        return self._collective("reduce_scatter", inputs, "reduce_scatter_tensor_coalesced", outputs, inputs, opts,
                                carried=list(inputs))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def broadcast(self, tensors, opts):
        return self._collective("broadcast", tensors, "broadcast", tensors, opts, carried=tensors[0])

    def reduce(self, tensors, opts):
        return self._collective("reduce", tensors, "reduce", tensors, opts, carried=tensors[0])

    def gather(self, outputs, inputs, opts):
        return self._collective("gather", inputs, "gather", outputs, inputs, opts, carried=inputs[0])

    def scatter(self, outputs, inputs, opts):
        return self._collective("scatter", outputs, "scatter", outputs, inputs, opts,
                                carried=list(inputs[0]) if inputs else None)

    def alltoall(self, outputs, inputs, opts):
        if _POLICY["p2p_only"] is None:
            shapes = {tuple(t.shape) for t in list(outputs) + list(inputs)}
            if len(shapes) > 1:
                raise SplitMismatch(
                    f"{SPLIT_MARK} all_to_all (the list form) got tensors of the shapes "
                    f"{sorted(shapes)}: on gloo it moves equal-sized tensors only -- for uneven splits use "
                    f"all_to_all_single(output, input, output_split_sizes=..., input_split_sizes=...)")
        return self._collective("all_to_all", inputs, "alltoall", outputs, inputs, opts, carried=list(inputs))

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts):  # noqa: A002
        sends = self._check_splits(output, input, list(output_split_sizes), list(input_split_sizes))
        return self._collective("all_to_all", input, "alltoall_base", output, input, output_split_sizes,
                                input_split_sizes, opts, carried=sends)

    all_to_all_single = alltoall_base

    def _check_splits(self, output, input, out_splits, in_splits):  # noqa: A002
        """The input cut into its per-destination chunks, after every rank of the group has checked that
        what it expects from each peer (``out_splits``) is what that peer sends it (its ``in_splits``).

        Unchecked, a mismatch makes gloo abort the receiving process (SIGABRT, no traceback): here every
        rank raises :class:`SplitMismatch` together, and the ranks that expected the wrong sizes say so."""
        n = self.size()
        if _POLICY["p2p_only"] is not None:  # refused anyway, by _collective
            return None
        problems = []
        rows_in, rows_out = (int(t.shape[0]) if t.dim() else int(t.numel()) for t in (input, output))
        ins = in_splits or ([rows_in // n] * n if rows_in % n == 0 else None)
        outs = out_splits or ([rows_out // n] * n if rows_out % n == 0 else None)
        if ins is None or outs is None:
            which, rows = ("input", rows_in) if ins is None else ("output", rows_out)
            problems.append(f"the {which} has {rows} rows, which do not split evenly over {n} ranks: pass "
                            f"{which}_split_sizes")
            ins, outs = ins or [0] * n, outs or [0] * n
        if len(ins) != n or len(outs) != n:
            problems.append(f"input_split_sizes and output_split_sizes need one entry per rank of the group ({n}); "
                            f"got {len(ins)} and {len(outs)}")
            ins, outs = (ins + [0] * n)[:n], (outs + [0] * n)[:n]
        if not problems and sum(ins) != rows_in:
            problems.append(f"input_split_sizes add up to {sum(ins)} rows but the input has {rows_in}")
        if not problems and sum(outs) != rows_out:
            problems.append(f"output_split_sizes add up to {sum(outs)} rows but the output has {rows_out}")
        theirs = torch.empty(n, dtype=torch.int64)
        self._inner.alltoall_base(theirs, torch.tensor(ins, dtype=torch.int64), [], [],
                                  dist.AllToAllOptions()).wait()
        if not problems:
            wrong = [(s, outs[s], int(theirs[s])) for s in range(n) if outs[s] != int(theirs[s])]
            if wrong:
                s, expected, sent = wrong[0]
                problems.append(f"group rank {self.rank()} expected {expected} rows from group rank {s} "
                                f"(its output_split_sizes[{s}]), which sends it {sent} (that rank's "
                                f"input_split_sizes[{self.rank()}]): output_split_sizes must be what the others "
                                f"send you, which only they know -- exchange the counts first")
        flag = torch.tensor([1 if problems else 0])
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self._inner.allreduce([flag], opts).wait()
        if flag.item():
            raise SplitMismatch(f"{SPLIT_MARK} " + (problems[0] if problems else
                                "another rank of the group passed split sizes that do not match"))
        flat = input.reshape(rows_in, -1) if input.dim() else input.reshape(1, 1)
        return list(flat.split(ins))


def _flat_cat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors]) if len(tensors) else torch.empty(0)


def _copy(carried):
    """A detached copy of a tensor or of a list of tensors."""
    if isinstance(carried, torch.Tensor):
        return carried.detach().clone()
    return [_copy(t) for t in carried]


def _create_checked_group(opts, _backend_options):
    inner = dist.ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, opts.timeout)
    return CheckedProcessGroup(inner, opts.group_rank, opts.group_size, opts.global_ranks_in_group)


if BACKEND.upper() not in dist.Backend._plugins:  # once per process
    dist.Backend.register_backend(BACKEND, _create_checked_group, extended_api=True, devices=["cpu"])


def install_checked_world(timeout: float = 20) -> None:
    """On a rank: replace the default process group with a checked one over the same ranks."""
    _GROUP_TIMEOUT["s"] = float(timeout)
    if isinstance(c10d._get_default_group(), CheckedProcessGroup):
        return
    store, rank, world = c10d._get_default_store(), dist.get_rank(), dist.get_world_size()
    dist.barrier()  # every rank has finished connecting the old group before any rank closes it
    dist.destroy_process_group()
    dist.init_process_group(BACKEND, store=dist.PrefixStore(f"{BACKEND}/", store), rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))


def group_timeout() -> float:
    """Seconds an op of the checked world may wait on this rank (what :func:`install_checked_world` was given)."""
    return _GROUP_TIMEOUT["s"]


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


def secret_generator() -> torch.Generator:
    """A generator seeded from ``os.urandom`` on this rank: inputs that neither another rank nor the
    student's code can rebuild (call it on the rank, after the fork; the checker computes the truth from
    what the ranks really hold, after the student's function returned)."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)


def drawn_rng() -> random.Random:
    """A ``random.Random`` seeded from ``os.urandom``: the cases a checker draws for this run (sizes, layouts,
    configs, budgets), so no table of fixed cases answers them. The verdict line names what was verified,
    never the drawn values (nbval compares it); a hint may show the case that failed."""
    return random.Random(os.urandom(8))


class _LargestTensor(TorchDispatchMode):
    """Keeps the element count (``largest``) and the op (``op``) of the largest tensor any torch op produced."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), str(getattr(func, "__name__", func)).split(".")[0]
        return out


@contextlib.contextmanager
def largest_tensor():
    """``with largest_tensor() as seen:`` -> ``seen.largest`` (elements) and ``seen.op`` (e.g. ``"cat"``):
    the largest tensor a torch op produced inside the block -- what the code held at its peak, op by op.

    The first dispatch mode of a process imports ``torch._dynamo``, which rewraps ``torch.manual_seed``: an
    op run here, before the block, keeps that import out of the student's call (where it would read as a
    patch). Enter it once in the launching process, before the fork, and no rank pays for the import."""
    mode = _LargestTensor()
    with mode:
        torch.zeros(1).add_(1)
        mode.largest, mode.op = 0, None
        yield mode


def _checked_rank(rank_fn, rank_kwargs, group_timeout):
    install_checked_world(group_timeout)
    _TRACES.clear()  # the launching process's, copied by the fork
    with traced() as trace:
        value = rank_fn(**rank_kwargs)
    return value, trace


def launch_checked(rank_fn, world_size: int, *, timeout: float = 20, **kwargs):
    """:func:`course_lib.launch.launch` ``rank_fn(**kwargs)`` on ``world_size`` ranks whose default
    process group is checked (recorded with :func:`wire_recorder`, refusable with
    :func:`point_to_point_only`). Raises what ``launch`` raises. Each rank's :class:`StudentTrace` is added to
    the active :func:`traced`, if any."""
    from course_lib.launch import launch

    results = launch(_checked_rank, world_size=world_size, output="none", timeout=timeout, rank_fn=rank_fn,
                     rank_kwargs=kwargs, group_timeout=timeout)
    if _TRACES:
        _TRACES[-1].add_launch(world_size, [trace for _, trace in results])
    results[:] = [value for value, _ in results]
    return results
