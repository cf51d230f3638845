"""The communication operators of tensor (and sequence) parallelism, as autograd functions.

Names and semantics follow Megatron-LM ``megatron/core/tensor_parallel/mappings.py``;
the operators ``f`` and ``g`` are from Shoeybi et al. 2019, "Megatron-LM: Training
Multi-Billion Parameter Language Models Using Model Parallelism", section 3,
figure 3 (https://arxiv.org/abs/1909.08053), and the sequence-parallel pair from
Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
Models", section 4.2.2 (https://arxiv.org/abs/2205.05198).

=============================================  ==============  ==============  =====  ====
function                                       forward         backward        dim
=============================================  ==============  ==============  =====  ====
``copy_to_tensor_model_parallel_region``       identity        all-reduce      --     f
``reduce_from_tensor_model_parallel_region``   all-reduce      identity        --     g
``scatter_to_tensor_model_parallel_region``    keep my slice   all-gather      last
``gather_from_tensor_model_parallel_region``   all-gather      keep my slice   last
``scatter_to_sequence_parallel_region``        keep my slice   all-gather      first
``gather_from_sequence_parallel_region``       all-gather      reduce-scatter  first  [1]
``reduce_scatter_to_sequence_parallel_region`` reduce-scatter  all-gather      first
=============================================  ==============  ==============  =====  ====

[1] or a plain split when ``tensor_parallel_output_grad=False`` (the consumer of
the gathered tensor is replicated, so every rank already holds the full gradient).

Each pair is *conjugate*: the backward of one is the forward of the other,
because the transpose of "copy to t ranks" is "sum over t ranks" and the
transpose of "concatenate" is "split".

Differences from Megatron, on purpose: the process group is a required
argument (Megatron falls back to a global group), and every communication goes
through :mod:`course_lib.comm` so it is recorded. All of them are no-ops for a
group of one. Activations use Megatron's layout ``[s, b, h]``: "first dim" is
the sequence, "last dim" the hidden (or vocabulary) dimension.
"""

from __future__ import annotations

import torch

from course_lib import comm
from course_lib.rules import UsageError

__all__ = [
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "split_along_last_dim", "split_along_first_dim",
]


def _size(group) -> int:
    if group is None:
        raise UsageError("group is None: pass the tensor-parallel process group explicitly "
                         "(a group of one makes every mapping a no-op)")
    return comm.group_size(group)


def split_along_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's 1/t slice of ``x`` along the last dim: [..., h] -> [..., h/t] (no communication)."""
    t = _size(group)
    if t == 1:
        return x
    if x.shape[-1] % t:
        raise UsageError(f"last dimension {x.shape[-1]} is not divisible by tensor-model-parallel-size={t}")
    return x.chunk(t, dim=-1)[comm.group_rank(group)].contiguous()


def split_along_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's 1/t slice of ``x`` along the first (sequence) dim: [s, ...] -> [s/t, ...]."""
    t = _size(group)
    if t == 1:
        return x
    if x.shape[0] % t:
        raise UsageError(f"sequence length {x.shape[0]} (first dimension) is not divisible by "
                         f"tensor-model-parallel-size={t}: sequence parallelism splits the sequence "
                         f"evenly; pad the sequence or change the TP size")
    return x.chunk(t, dim=0)[comm.group_rank(group)].contiguous()


# ----------------------------------------------------------------- autograd functions
# Each Function stores the group and the recorder label ``kind`` in ctx.


class _CopyToModelParallelRegion(torch.autograd.Function):
    """f: forward identity, backward all-reduce."""

    @staticmethod
    def forward(ctx, x, group, kind):
        ctx.group, ctx.kind = group, kind
        return x

    @staticmethod
    def backward(ctx, grad):
        # Reduce a copy: autograd may hand the same gradient tensor to other branches (or it is
        # the caller's own tensor passed to .backward()), so it must not be changed in place.
        grad = comm.all_reduce(grad.clone(memory_format=torch.contiguous_format), ctx.group, kind=ctx.kind,
                               direction="bwd", source="copy_to_tensor_model_parallel_region")
        return grad, None, None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    """g: forward all-reduce, backward identity."""

    @staticmethod
    def forward(ctx, x, group, kind):
        # all-reduce works in place: reduce a copy so the caller's tensor is untouched
        return comm.all_reduce(x.clone(memory_format=torch.contiguous_format), group, kind=kind,
                               direction="fwd", source="reduce_from_tensor_model_parallel_region")

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, kind):
        ctx.group, ctx.kind = group, kind
        return split_along_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.group, dim=-1, kind=ctx.kind, direction="bwd",
                               source="scatter_to_tensor_model_parallel_region"), None, None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, kind):
        ctx.group, ctx.kind = group, kind
        return comm.all_gather(x, group, dim=-1, kind=kind, direction="fwd",
                               source="gather_from_tensor_model_parallel_region")

    @staticmethod
    def backward(ctx, grad):
        return split_along_last_dim(grad, ctx.group), None, None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, kind):
        ctx.group, ctx.kind = group, kind
        return split_along_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.group, dim=0, kind=ctx.kind, direction="bwd",
                               source="scatter_to_sequence_parallel_region"), None, None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad, kind):
        ctx.group, ctx.kind, ctx.tp_grad = group, kind, tensor_parallel_output_grad
        return comm.all_gather(x, group, dim=0, kind=kind, direction="fwd",
                               source="gather_from_sequence_parallel_region")

    @staticmethod
    def backward(ctx, grad):
        if ctx.tp_grad:  # the consumer is tensor-parallel: each rank holds a partial gradient
            grad = comm.reduce_scatter(grad, ctx.group, dim=0, kind=ctx.kind, direction="bwd",
                                       source="gather_from_sequence_parallel_region")
        else:  # the consumer is replicated: every rank holds the full gradient already
            grad = split_along_first_dim(grad, ctx.group)
        return grad, None, None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, kind):
        ctx.group, ctx.kind = group, kind
        return comm.reduce_scatter(x, group, dim=0, kind=kind, direction="fwd",
                                   source="reduce_scatter_to_sequence_parallel_region")

    @staticmethod
    def backward(ctx, grad):
        return comm.all_gather(grad, ctx.group, dim=0, kind=ctx.kind, direction="bwd",
                               source="reduce_scatter_to_sequence_parallel_region"), None, None


# ----------------------------------------------------------------------- public API


def copy_to_tensor_model_parallel_region(input_: torch.Tensor, group, *, kind: str = "tp") -> torch.Tensor:
    """Operator f: forward identity, backward all-reduce of the gradient over ``group``.

    Placed before a column-parallel GEMM: every rank uses the whole input, so the
    input's gradient is the sum of the ranks' partial gradients."""
    if _size(group) == 1:
        return input_
    return _CopyToModelParallelRegion.apply(input_, group, kind)


def reduce_from_tensor_model_parallel_region(input_: torch.Tensor, group, *, kind: str = "tp") -> torch.Tensor:
    """Operator g: forward all-reduce (sum) over ``group``, backward identity.

    Placed after a row-parallel GEMM: each rank holds a partial sum ``X_i A_i``."""
    if _size(group) == 1:
        return input_
    return _ReduceFromModelParallelRegion.apply(input_, group, kind)


def scatter_to_tensor_model_parallel_region(input_: torch.Tensor, group, *, kind: str = "tp") -> torch.Tensor:
    """Forward: keep this rank's slice of the last dim [..., h] -> [..., h/t]; backward: all-gather it."""
    if _size(group) == 1:
        return input_
    return _ScatterToModelParallelRegion.apply(input_, group, kind)


def gather_from_tensor_model_parallel_region(input_: torch.Tensor, group, *, kind: str = "tp") -> torch.Tensor:
    """Forward: all-gather along the last dim [..., h/t] -> [..., h]; backward: keep this rank's slice."""
    if _size(group) == 1:
        return input_
    return _GatherFromModelParallelRegion.apply(input_, group, kind)


def scatter_to_sequence_parallel_region(input_: torch.Tensor, group, *, kind: str = "tp") -> torch.Tensor:
    """Forward: keep this rank's sequence slice [s, b, h] -> [s/t, b, h]; backward: all-gather it."""
    if _size(group) == 1:
        return input_
    return _ScatterToSequenceParallelRegion.apply(input_, group, kind)


def gather_from_sequence_parallel_region(input_: torch.Tensor, group, tensor_parallel_output_grad: bool = True,
                                         *, kind: str = "tp") -> torch.Tensor:
    """Forward: all-gather along the sequence [s/t, b, h] -> [s, b, h].

    Backward: reduce-scatter (``tensor_parallel_output_grad=True``, the gathered
    tensor feeds a tensor-parallel GEMM whose ranks each produce a partial
    gradient) or a plain split (``False``: the consumer is replicated).
    Megatron's argument order is ``(input_, tensor_parallel_output_grad, group)``;
    here the group comes second because it is required."""
    if _size(group) == 1:
        return input_
    return _GatherFromSequenceParallelRegion.apply(input_, group, tensor_parallel_output_grad, kind)


def reduce_scatter_to_sequence_parallel_region(input_: torch.Tensor, group, *, kind: str = "tp") -> torch.Tensor:
    """Forward: sum over ``group`` and keep this rank's sequence slice [s, b, h] -> [s/t, b, h];
    backward: all-gather. Replaces g after a row-parallel GEMM under sequence parallelism."""
    if _size(group) == 1:
        return input_
    return _ReduceScatterToSequenceParallelRegion.apply(input_, group, kind)
