"""The contiguous grad (and param) buffer, split into buckets -- the layout only, no communication.

Megatron-LM's ``megatron/core/distributed/param_and_grad_buffer.py`` (``_ParamAndGradBuffer``):
parameters are laid out in **reverse** order of ``model.parameters()`` (roughly the order backward
produces their grads), packed into one flat buffer per dtype, and cut into buckets of at least
``bucket_size`` elements (``--ddp-bucket-size``) without splitting a parameter. Rank ``r`` of the
data-parallel group owns elements ``[r*n/d, (r+1)*n/d)`` of every bucket (``n`` = padded bucket size); a
parameter may straddle two ranks' shards: each rank updates only its piece (``distrib_optimizer.py``'s
``_build_model_gbuf_param_range_map``). How a bucket is padded depends on who shards it
(:data:`LAYOUTS`, :func:`layout_rules`):

* ``"ddp"`` -- Megatron's DDP without the distributed optimizer: no padding (main's
  ``_compute_default_per_buffer_param_layout``);
* ``"distributed_optimizer"`` -- ``--use-distributed-optimizer``: every parameter starts on a multiple of
  64 elements, every bucket ends on a multiple of ``lcm(d, 128)``, and a parameter marked
  ``shared_embedding`` (the tied word embedding of the first and last pipeline stage) is a bucket of
  its own, so both stages shard it alike and its sum over the two stages can follow the reduce-scatter
  (main: ``DistributedOptimizer._compute_per_buffer_param_layout`` with ``optimizer/param_layout.py``'s
  ``pad_param_start`` / ``pad_bucket_end``; core 0.16.1: the same rules inside ``_ParamAndGradBuffer``);
* ``"fsdp"`` -- Megatron-FSDP (``fsdp/src/megatron_fsdp/param_and_grad_buffer.py``): each sharded bucket
  padded to a multiple of ``d`` (``build_data_parallel_buffer_index``), the shared embedding in a
  bucket of its own (``_does_param_require_new_bucket``); ``no_shard`` pads nothing.

Megatron-FSDP's ZeRO-3 buckets by *FSDP unit* (a module whose parameters are gathered together):
:func:`unit_buckets`.

What a bucket holds at run time (its buffers, shards and collectives in flight) is a
:class:`BucketState`, filled in by :class:`course_lib.distributed.engine.ShardedDataParallel`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from course_lib.rules import UsageError


@dataclass
class ParamRange:
    """One parameter's place in its bucket: elements ``[start, end)`` of the flat bucket."""

    name: str
    param: torch.nn.Parameter
    start: int
    end: int

    @property
    def numel(self) -> int:
        return self.end - self.start


@dataclass
class InFlight:
    """A collective the engine started on a bucket: ``work`` its handle (``None``: already complete,
    issued synchronously or over one rank), ``out`` the tensor its result lands in (``None`` for the
    in-place all-reduce of the grad buffer)."""

    work: object
    out: torch.Tensor | None


@dataclass
class BucketState:
    """The tensors of one bucket on this rank (``n`` = the bucket's padded ``numel``; ``[lo, hi)`` the
    elements this rank's optimizer updates: its shard with a sharded optimizer, else ``[0, n)``).

    Params (model dtype): ``param_full`` ``[n]`` -- the param buffer the model's params are views of
    (ZeRO-3: only while the unit is gathered); ZeRO-3 also keeps ``param_shard`` ``[n/d]`` and
    ``gathered``, the ``[n]`` all-gather target whose storage is freed when the unit is released.
    Grads (grad dtype): ``grad_full`` ``[n]`` -- the grad buffer backward accumulates into (ZeRO-2/3:
    only until the reduce-scatter); ZeRO-2/3 also ``grad_shard`` ``[n/d]``. Optimizer (fp32,
    ``[hi - lo]``): ``main`` (the main params: the model's own shard for fp32 params, on the host with
    offload), ``main_grad`` (fp32 copy of 16-bit grads), ``host_grad`` (offload: the grads copied to
    the host), ``step_grad`` (the fp32 grads the update reads; set inside ``step`` only).
    ``pending``: ids of the params whose grad has not arrived in this backward; ``grad_reduce`` /
    ``gather``: the grad reduction / param all-gather in flight."""

    lo: int = 0
    hi: int = 0
    param_full: torch.Tensor | None = None
    param_shard: torch.Tensor | None = None
    gathered: torch.Tensor | None = None
    grad_full: torch.Tensor | None = None
    grad_shard: torch.Tensor | None = None
    main: torch.Tensor | None = None
    main_grad: torch.Tensor | None = None
    host_grad: torch.Tensor | None = None
    step_grad: torch.Tensor | None = None
    pending: set = field(default_factory=set)
    grad_reduce: InFlight | None = None
    gather: InFlight | None = None


@dataclass
class Bucket:
    """A bucket's layout: ``params`` (in buffer order, at their padded offsets), ``numel`` (padded: see
    :func:`layout_rules`) and ``shard_numel = numel / dp`` (elements each data-parallel rank owns)."""

    index: int
    params: list  # [ParamRange]
    numel: int
    dp: int
    data_numel: int = 0  # elements that belong to parameters (numel - padding, alignment gaps included)
    module: object = None  # the FSDP unit of a unit bucket (None for size buckets)
    state: BucketState = field(default_factory=BucketState)

    @property
    def shard_numel(self) -> int:
        return self.numel // self.dp

    @property
    def padding(self) -> int:
        return self.numel - self.data_numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """Elements ``[lo, hi)`` of the bucket that data-parallel rank ``rank`` owns."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def pieces(self, lo: int, hi: int) -> list[ParamRange]:
        """Each parameter overlapping elements ``[lo, hi)`` of the bucket (a rank's
        :meth:`shard_range`, or ``[0, numel)``), clipped to them: ``start``/``end`` in bucket
        coordinates -- what the optimizer of the rank owning ``[lo, hi)`` updates."""
        return [ParamRange(pr.name, pr.param, max(pr.start, lo), min(pr.end, hi))
                for pr in self.params if max(pr.start, lo) < min(pr.end, hi)]


LAYOUTS = ("ddp", "distributed_optimizer", "fsdp")
"""Who lays the buffer out (see the module docstring): Megatron's DDP, its distributed optimizer, Megatron-FSDP."""

PARAM_START_ALIGNMENT = 64
"""Elements: a parameter's first element under the distributed optimizer (128-byte addresses for 16-bit
values; ``param_layout.py``'s ``pad_param_start``)."""

BUCKET_END_ALIGNMENT = 128
"""Elements: with ``d``, what a distributed-optimizer bucket's size is a multiple of, ``lcm(d, 128)``
(``pad_bucket_end``; 256-byte aligned bucket starts, a shard per rank)."""


def layout_rules(layout: str, dp: int) -> tuple[int, int, bool]:
    """``(param_start_alignment, bucket_size_divisor, shared_embedding_bucket)`` of ``layout`` (one of
    :data:`LAYOUTS`) over ``dp`` ranks: ``"ddp"`` (1, 1, False); ``"distributed_optimizer"``
    (64, lcm(dp, 128), True); ``"fsdp"`` (1, dp, True) -- ``"fsdp"`` with ``dp`` 1 (``no_shard``) is
    given ``"ddp"``'s rules by the caller."""
    if layout == "ddp":
        return 1, 1, False
    if layout == "distributed_optimizer":
        return PARAM_START_ALIGNMENT, math.lcm(dp, BUCKET_END_ALIGNMENT), True
    if layout == "fsdp":
        return 1, dp, True
    raise UsageError(f"layout={layout!r} is not one of {', '.join(LAYOUTS)}")


def _round_up(n: int, divisor: int) -> int:
    return -(-n // divisor) * divisor


def _layout(named: list, bucket_size, dp: int, layout: str, first_index: int = 0) -> list[Bucket]:
    """Buckets over ``named`` (``[(name, param)]``, in buffer order) under ``layout``'s rules: a param
    starts on its alignment, a bucket closes once it holds ``>= bucket_size`` elements (None: never)
    and around a ``shared_embedding`` param (when the layout says so), and is padded to its divisor."""
    align, divisor, split_shared = layout_rules(layout, dp)
    buckets, current, offset = [], [], 0

    def close():
        nonlocal current, offset
        data = sum(pr.numel for pr in current)
        buckets.append(Bucket(first_index + len(buckets), current, _round_up(offset, divisor), dp, data))
        current, offset = [], 0

    for name, p in named:
        shared = split_shared and getattr(p, "shared_embedding", False)
        if shared and current:
            close()
        start = _round_up(offset, align)
        current.append(ParamRange(name, p, start, start + p.numel()))
        offset = start + p.numel()
        if shared or (bucket_size is not None and offset >= bucket_size):
            close()
    if current:
        close()
    return buckets


def megatron_bucket_size(bucket_size, overlap_grad_reduce: bool, dp: int, pp_rank: int = 0):
    """The bucket size Megatron's ``DistributedDataParallel`` uses (``distributed_data_parallel.py``, main
    d98e8a6 ~131-137 and ~164-171; the same in core 0.16.1): ``--ddp-bucket-size`` or, when it is not
    given, ``max(40M, 1M * dp)`` elements; one bucket (None) whatever was given when
    ``--overlap-grad-reduce`` is off -- without overlap there is nothing to gain from smaller
    reductions -- and on every pipeline stage but the first (``pp_rank > 0``: its reduction is not on
    the critical path)."""
    if not overlap_grad_reduce or pp_rank > 0:
        return None
    return bucket_size if bucket_size is not None else max(40_000_000, 1_000_000 * dp)


def size_buckets(named_params: list, bucket_size, dp: int, layout: str = "ddp") -> list[Bucket]:
    """Buckets of ``>= bucket_size`` elements over ``named_params`` taken in reverse order (Megatron's
    layout, padded as ``layout`` says: :func:`layout_rules`); ``bucket_size=None`` gives one bucket
    (two or three around a shared embedding). ``named_params``: ``[(name, param)]``."""
    if bucket_size is not None and (isinstance(bucket_size, bool) or not isinstance(bucket_size, int)
                                    or bucket_size < 1):
        raise UsageError(f"bucket_size={bucket_size!r} (--ddp-bucket-size) must be a positive number of "
                         f"elements or None for one bucket")
    return _layout(list(reversed(named_params)), bucket_size, dp, layout)


def unit_buckets(units: list, dp: int) -> list[Bucket]:
    """Megatron-FSDP's buckets of the FSDP units (``[(module, [(name, param)])]``), in reverse order of
    ``units`` (the order backward reaches them), each unit's parameters in reverse order: one bucket
    per unit, padded to a multiple of ``dp``, the shared embedding split off into a bucket of its own.
    Each bucket's ``module`` is its unit's."""
    buckets = []
    for module, named in reversed(units):
        for b in _layout(list(reversed(named)), None, dp, "fsdp", len(buckets)):
            b.module = module
            buckets.append(b)
    return buckets
