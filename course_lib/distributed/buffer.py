"""The contiguous grad (and param) buffer, split into buckets -- the layout only, no communication.

Megatron-LM's ``megatron/core/distributed/param_and_grad_buffer.py`` (``_ParamAndGradBuffer``):
parameters are laid out in **reverse** order of ``model.parameters()`` (roughly the order backward
produces their grads), packed into one flat buffer per dtype, and cut into buckets of at least
``bucket_size`` elements (``--ddp-bucket-size``) without splitting a parameter; with the distributed
optimizer each bucket is padded so that the data-parallel size ``d`` divides it, and rank ``r`` of the
group owns elements ``[r*n/d, (r+1)*n/d)`` of every bucket (``n`` = padded bucket size). A parameter
may straddle two ranks' shards: each rank updates only its piece (``distrib_optimizer.py``'s
``_build_model_gbuf_param_range_map``). Megatron pads buckets to a multiple of ``lcm(d, 128)`` for
alignment; the course pads to a multiple of ``d`` only, so that a model whose buckets ``d`` divides has
no padding and the measured bytes equal the formulas of :mod:`course_lib.sizing.memory` exactly.

Megatron-FSDP (``megatron/core/distributed/fsdp/``) buckets by *FSDP unit* (a module whose parameters
are gathered together) instead: :func:`unit_buckets`.

What a bucket holds at run time (its buffers, shards and collectives in flight) is a
:class:`BucketState`, filled in by :class:`course_lib.distributed.engine.ShardedDataParallel`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    """A bucket's layout: ``params`` (in buffer order), ``numel`` (padded to a multiple of ``dp``)
    and ``shard_numel = numel / dp`` (elements each data-parallel rank owns)."""

    index: int
    params: list  # [ParamRange]
    numel: int
    dp: int
    data_numel: int = 0  # elements that belong to parameters (numel - padding)
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


def _pad(n: int, dp: int) -> int:
    return -(-n // dp) * dp


def _bucket(index: int, named: list, dp: int, module=None) -> Bucket:
    ranges, offset = [], 0
    for name, p in named:
        ranges.append(ParamRange(name, p, offset, offset + p.numel()))
        offset += p.numel()
    return Bucket(index, ranges, _pad(offset, dp), dp, offset, module)


def megatron_bucket_size(bucket_size, overlap_grad_reduce: bool, dp: int):
    """The bucket size Megatron's ``DistributedDataParallel`` uses (``distributed_data_parallel.py``, main
    d98e8a6 ~131-137): ``--ddp-bucket-size`` or, when it is not given, ``max(40M, 1M * dp)`` elements; and
    one bucket (None) whatever was given when ``--overlap-grad-reduce`` is off -- without overlap
    there is nothing to gain from smaller reductions."""
    if not overlap_grad_reduce:
        return None
    return bucket_size if bucket_size is not None else max(40_000_000, 1_000_000 * dp)


def size_buckets(named_params: list, bucket_size, dp: int) -> list[Bucket]:
    """Buckets of ``>= bucket_size`` elements over ``named_params`` taken in reverse order
    (Megatron's layout); ``bucket_size=None`` gives one bucket. ``named_params``: ``[(name, param)]``."""
    if bucket_size is not None and (isinstance(bucket_size, bool) or not isinstance(bucket_size, int)
                                    or bucket_size < 1):
        raise ValueError(f"bucket_size={bucket_size!r} (--ddp-bucket-size) must be a positive number of "
                         f"elements or None for one bucket")
    buckets, current, count = [], [], 0
    for name, p in reversed(named_params):
        current.append((name, p))
        count += p.numel()
        if bucket_size is not None and count >= bucket_size:
            buckets.append(_bucket(len(buckets), current, dp))
            current, count = [], 0
    if current:
        buckets.append(_bucket(len(buckets), current, dp))
    return buckets


def unit_buckets(units: list, dp: int) -> list[Bucket]:
    """One bucket per FSDP unit (``[(module, [(name, param)])]``), in reverse order of ``units``
    (the order backward reaches them), each unit's parameters in reverse order."""
    return [_bucket(i, list(reversed(named)), dp, module)
            for i, (module, named) in enumerate(reversed(units))]
