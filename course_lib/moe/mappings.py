"""The MoE layers' autograd-aware collectives: rows of uneven sizes moved between ranks.

The counterpart of :mod:`course_lib.tensor_parallel.mappings` for the token dispatchers
(Megatron: ``all_to_all`` in ``megatron/core/tensor_parallel/mappings.py``, used by
``MoEAlltoAllTokenDispatcher`` in ``megatron/core/transformer/moe/token_dispatcher.py``;
``sort_chunks_by_idxs`` in ``megatron/core/transformer/moe/moe_utils.py``). Each op's backward is
its mirror, and every one is recorded through :mod:`course_lib.comm`:

* :func:`all_to_all_uneven` -- ``all_to_all_single`` with splits; backward: the splits swapped.
  Kind ``"ep"``, numel = the rows this rank hands to the all-to-all × row size (its own chunk
  included), ``sent`` = the rows for the *other* ranks × row size: what crosses the wire.
* :func:`all_gather_uneven` / :func:`reduce_scatter_uneven` -- row blocks of different sizes over
  the expert-TP group; each one's backward is the other. Kind ``"expert_tp"``, numel = the gathered
  rows × row size (the course's convention). Written with ``all_to_all_single``, which gloo and
  NCCL both run with uneven splits.
* :func:`reorder_chunks` -- rows cut into chunks, put back together in another order (no
  communication: the regrouping around the all-to-all).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from course_lib import comm

__all__ = ["all_to_all_uneven", "all_gather_uneven", "reduce_scatter_uneven", "reorder_chunks"]


def _all_to_all(x: torch.Tensor, group, output_splits: list[int], input_splits: list[int], source: str):
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    row = math.prod(x.shape[1:])
    kept = input_splits[dist.get_rank(group)] * row                  # my own chunk never leaves me
    comm.record_event("all_to_all", x.numel(), group_size=dist.get_world_size(group), kind="ep",
                      dtype=x.dtype, source=source, sent=x.numel() - kept)
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=output_splits,
                           input_split_sizes=input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Uneven all-to-all whose backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits, source):
        ctx.group, ctx.splits, ctx.source = group, (output_splits, input_splits), source
        return _all_to_all(x, group, output_splits, input_splits, source)

    @staticmethod
    def backward(ctx, dy):
        output_splits, input_splits = ctx.splits
        return _all_to_all(dy, ctx.group, input_splits, output_splits, ctx.source), None, None, None, None


def all_to_all_uneven(x: torch.Tensor, group, output_splits: list[int], input_splits: list[int],
                      source: str = "moe_all_to_all") -> torch.Tensor:
    """Differentiable ``all_to_all_single``: the first ``input_splits[j]`` rows after the previous
    ones go to group rank j; ``output_splits[j]`` rows come from rank j. [sum(in), ...] -> [sum(out), ...].
    Recorded as op "all_to_all", kind "ep", numel = every row handed in × row size, ``sent`` = the
    rows for other ranks × row size."""
    return _AllToAll.apply(x, group, list(map(int, output_splits)), list(map(int, input_splits)), source)


def _uneven(x: torch.Tensor, group, sizes: list[int], gather: bool) -> torch.Tensor:
    """Uneven all-gather (``gather``: this rank's ``sizes[me]`` rows sent to every member) or
    reduce-scatter (block j of ``x``, ``sizes[j]`` rows, sent to member j; the t copies summed)."""
    t, me = comm.group_size(group), comm.group_rank(group)
    row = math.prod(x.shape[1:])
    comm.record_event("all_gather" if gather else "reduce_scatter", sum(sizes) * row, group_size=t,
                      kind="expert_tp", dtype=x.dtype, reduce_op=None if gather else "sum",
                      source="moe_expert_tp_gather" if gather else "moe_expert_tp_reduce_scatter")
    out = x.new_empty(((sum(sizes) if gather else t * sizes[me]),) + tuple(x.shape[1:]))
    inp = torch.cat([x] * t) if gather else x
    dist.all_to_all_single(out, inp.contiguous(), output_split_sizes=list(sizes) if gather else [sizes[me]] * t,
                           input_split_sizes=[sizes[me]] * t if gather else list(sizes), group=group)
    return out if gather else out.view((t, sizes[me]) + tuple(x.shape[1:])).sum(0)


class _Uneven(torch.autograd.Function):
    """All-gather (``gather=True``) or reduce-scatter of row blocks of different sizes; each one's
    backward is the other."""

    @staticmethod
    def forward(ctx, x, group, sizes, gather):
        ctx.group, ctx.sizes, ctx.gather = group, sizes, gather
        return _uneven(x, group, sizes, gather)

    @staticmethod
    def backward(ctx, grad):
        return _uneven(grad, ctx.group, ctx.sizes, not ctx.gather), None, None, None


def all_gather_uneven(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """Every member's rows, member m contributing ``sizes[m]``: [sizes[me], ...] -> [sum(sizes), ...]."""
    return _Uneven.apply(x, group, sizes, True)


def reduce_scatter_uneven(x: torch.Tensor, group, sizes: list[int]) -> torch.Tensor:
    """Block m of ``x`` (``sizes[m]`` rows) summed over the members, to member m:
    [sum(sizes), ...] -> [sizes[me], ...]."""
    return _Uneven.apply(x, group, sizes, False)


def reorder_chunks(x: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """Rows cut into chunks of ``sizes``, put back together in ``order`` (Megatron's sort_chunks_by_idxs)."""
    chunks = torch.split(x, [int(s) for s in sizes])
    return torch.cat([chunks[i] for i in order]) if chunks else x
