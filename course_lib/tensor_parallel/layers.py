"""Tensor-parallel layers: column- and row-parallel linear, vocabulary-parallel embedding.

Names, arguments and semantics follow Megatron-LM
``megatron/core/tensor_parallel/layers.py`` (read there, written here):

* :class:`ColumnParallelLinear` ``Y = X A + b`` with ``A = [A_1 ... A_t]`` split by
  *columns* (output features). Rank i holds ``A_i`` (``weight`` of shape
  ``[out/t, in]``, nn.Linear's ``[out, in]`` layout) and computes ``Y_i = X A_i``.
  The output **stays sharded** ``[s, b, out/t]``: no communication in the forward
  pass unless ``gather_output=True``. Backward: the f operator all-reduces dX.
* :class:`RowParallelLinear` ``Y = X A + b`` with ``A`` split by *rows* (input
  features) and X split along its last dim. Rank i holds ``A_i`` (``[out, in/t]``)
  and computes the partial sum ``X_i A_i``; g all-reduces it (one all-reduce
  per forward). ``input_is_parallel=True`` (the usual case, after a column-
  parallel layer) means X is already split: nothing is gathered or scattered.
* :class:`VocabParallelEmbedding`: the table is split by vocabulary rows; each
  rank looks up the ids in its range, zeros the others, and g sums the ranks.

Under sequence parallelism (``sequence_parallel=True``, Korthikanti et al. 2022,
section 4.2.2) the input of a column-parallel layer is a sequence shard
``[s/t, b, h]``: it is all-gathered before the GEMM and, as in Megatron, only
the shard is kept for the backward pass, which gathers it again ("recompute",
recorded with that tag) and reduce-scatters dX. A row-parallel layer
reduce-scatters its output to ``[s/t, b, h]`` instead of all-reducing it.

Forward returns ``(output, output_bias)`` like Megatron: ``output_bias`` is the
bias when ``skip_bias_add=True`` (the caller adds it, e.g. fused with dropout),
else ``None``. Every layer takes its TP process group explicitly.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from course_lib import comm, rules

from .init import init_method_normal, initialize_affine_weight_cpu, set_tensor_model_parallel_attributes
from .mappings import (copy_to_tensor_model_parallel_region, gather_from_tensor_model_parallel_region,
                       reduce_from_tensor_model_parallel_region, reduce_scatter_to_sequence_parallel_region,
                       scatter_to_tensor_model_parallel_region)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding",
           "linear_with_sequence_parallel", "vocab_range"]


def _tp(group) -> tuple[int, int]:
    if group is None:
        raise rules.UsageError("tp_group is None: pass the tensor-parallel process group explicitly "
                               "(a group of one gives the dense layer)")
    return comm.group_size(group), comm.group_rank(group)


class _LinearWithSequenceParallel(torch.autograd.Function):
    """All-gather the sequence shard, then ``Y = X W^T + b``; keep only the shard for backward.

    Megatron: ``LinearWithGradAccumulationAndAsyncCommunication`` with
    ``sequence_parallel=True`` (without its fusions and asynchronous overlap)."""

    @staticmethod
    def forward(ctx, x_shard, weight, bias, group, kind):
        ctx.group, ctx.kind, ctx.has_bias = group, kind, bias is not None
        ctx.save_for_backward(x_shard, weight)
        x = comm.all_gather(x_shard, group, dim=0, kind=kind, direction="fwd",
                            source="linear_with_sequence_parallel")          # [s, b, in]
        return F.linear(x, weight, bias)                                       # [s, b, out/t]

    @staticmethod
    def backward(ctx, grad_out):                                               # [s, b, out/t]
        x_shard, weight = ctx.saved_tensors
        # Megatron stores only the 1/t shard and gathers it again here (memory for communication).
        x = comm.all_gather(x_shard, ctx.group, dim=0, kind=ctx.kind, direction="bwd",
                            source="linear_with_sequence_parallel", tag="recompute")   # [s, b, in]
        grad_x = grad_out.matmul(weight)                                       # [s, b, in] partial sums
        grad_x_shard = comm.reduce_scatter(grad_x, ctx.group, dim=0, kind=ctx.kind, direction="bwd",
                                           source="linear_with_sequence_parallel")     # [s/t, b, in]
        g2 = grad_out.reshape(-1, grad_out.shape[-1])                          # [s*b, out/t]
        grad_w = g2.t().matmul(x.reshape(-1, x.shape[-1]))                     # [out/t, in]
        grad_b = g2.sum(dim=0) if ctx.has_bias else None
        return grad_x_shard, grad_w, grad_b, None, None


def linear_with_sequence_parallel(input_: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                                  tp_group, *, kind: str = "tp") -> torch.Tensor:
    """Column-parallel GEMM on a sequence-parallel input: [s/t, b, in] -> [s, b, out/t].

    Forward: all-gather + GEMM. Backward: all-gather again (tag ``recompute``),
    dX GEMM + reduce-scatter, dW GEMM."""
    if comm.group_size(tp_group) == 1:
        return F.linear(input_, weight, bias)
    return _LinearWithSequenceParallel.apply(input_, weight, bias, tp_group, kind)


class ColumnParallelLinear(nn.Module):
    """``Y = X A + b`` with A split by columns (output features) over ``tp_group``.

    Shapes: input ``[s, b, input_size]`` (``[s/t, b, input_size]`` with
    ``sequence_parallel``); output ``[s, b, output_size/t]``, or
    ``[s, b, output_size]`` with ``gather_output=True``. ``weight``:
    ``[output_size/t, input_size]`` (rank i holds rows ``i*out/t:(i+1)*out/t`` of
    the dense weight), ``bias``: ``[output_size/t]`` (zero-initialised).
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group,
                 init_method: Optional[Callable] = None, bias: bool = True, gather_output: bool = False,
                 skip_bias_add: bool = False, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32):
        super().__init__()
        t, rank = _tp(tp_group)
        self.tp_group, self.tp_size, self.tp_rank = tp_group, t, rank
        self.input_size, self.output_size = input_size, output_size
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel
        self.output_size_per_partition = rules.tp_split("output_size", output_size, t)
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size, dtype=params_dtype))
        initialize_affine_weight_cpu(self.weight, output_size, input_size, self.output_size_per_partition, 0,
                                     init_method or init_method_normal(0.02), rank=rank, world_size=t)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=params_dtype))
            set_tensor_model_parallel_attributes(self.bias, True, 0, 1)
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor):
        bias = self.bias if not self.skip_bias_add else None
        if self.sequence_parallel:
            output_parallel = linear_with_sequence_parallel(input_, self.weight, bias, self.tp_group)
        else:
            input_parallel = copy_to_tensor_model_parallel_region(input_, self.tp_group)   # f
            output_parallel = F.linear(input_parallel, self.weight, bias)                # [s, b, out/t]
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output_parallel, self.tp_group)  # [s, b, out]
        else:
            output = output_parallel
        return output, (self.bias if self.skip_bias_add else None)

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, out_features={self.output_size}, TP={self.tp_size}, "
                f"per_rank_weight={tuple(self.weight.shape)}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``Y = X A + b`` with A split by rows (input features) over ``tp_group``.

    Shapes: input ``[s, b, input_size/t]`` when ``input_is_parallel`` (else the
    full ``[s, b, input_size]``, split here); output ``[s, b, output_size]``
    (``[s/t, b, output_size]`` with ``sequence_parallel``). ``weight``:
    ``[output_size, input_size/t]``; ``bias``: ``[output_size]``, replicated on
    every rank and added once, after the reduction.
    """

    def __init__(self, input_size: int, output_size: int, *, tp_group,
                 init_method: Optional[Callable] = None, bias: bool = True, input_is_parallel: bool = True,
                 skip_bias_add: bool = False, sequence_parallel: bool = False,
                 params_dtype: torch.dtype = torch.float32):
        super().__init__()
        t, rank = _tp(tp_group)
        if sequence_parallel and not input_is_parallel:
            raise rules.UsageError("sequence_parallel=True needs input_is_parallel=True in RowParallelLinear "
                                   "(the input comes from a column-parallel layer)")
        self.tp_group, self.tp_size, self.tp_rank = tp_group, t, rank
        self.input_size, self.output_size = input_size, output_size
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_parallel = sequence_parallel
        self.input_size_per_partition = rules.tp_split("input_size", input_size, t)
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition, dtype=params_dtype))
        initialize_affine_weight_cpu(self.weight, output_size, input_size, self.input_size_per_partition, 1,
                                     init_method or init_method_normal(0.02), rank=rank, world_size=t)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype))
            # Under SP the bias is added to a sequence shard: its gradient is partial (see
            # allreduce_sequence_parallel_grads); Megatron marks it the same way.
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.register_parameter("bias", None)

    def forward(self, input_: torch.Tensor):
        if self.input_is_parallel:
            input_parallel = input_                                                       # [s, b, in/t]
        else:
            input_parallel = scatter_to_tensor_model_parallel_region(input_, self.tp_group)
        output_parallel = F.linear(input_parallel, self.weight)                          # partial [s, b, out]
        if self.sequence_parallel:
            output_ = reduce_scatter_to_sequence_parallel_region(output_parallel, self.tp_group)  # [s/t, b, out]
        else:
            output_ = reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)    # g
        if self.skip_bias_add or self.bias is None:
            return output_, (self.bias if self.skip_bias_add else None)
        return output_ + self.bias, None

    def extra_repr(self) -> str:
        return (f"in_features={self.input_size}, out_features={self.output_size}, TP={self.tp_size}, "
                f"per_rank_weight={tuple(self.weight.shape)}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, end)`` of the vocabulary rows rank ``rank`` holds (Megatron's ``VocabUtility``)."""
    per = rules.vocab_divisible_by_tp(vocab_size, world_size)
    return rank * per, (rank + 1) * per


class VocabParallelEmbedding(nn.Module):
    """Embedding table ``[num_embeddings, embedding_dim]`` split by vocabulary rows over ``tp_group``.

    Input: token ids of any shape, e.g. ``[b, s]``. Output: ``input.shape +
    [embedding_dim]`` (all ranks equal, one all-reduce), or with
    ``reduce_scatter_embeddings=True`` a sequence shard ``[s/t, b, h]``
    (``[b, s, h]`` transposed to Megatron's ``[s, b, h]``, then reduce-scattered).
    ``num_embeddings`` must be divisible by t; Megatron pads the vocabulary to a
    multiple of ``make-vocab-size-divisible-by * t`` for this.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp_group,
                 init_method: Optional[Callable] = None, reduce_scatter_embeddings: bool = False,
                 params_dtype: torch.dtype = torch.float32):
        super().__init__()
        t, rank = _tp(tp_group)
        self.tp_group, self.tp_size, self.tp_rank = tp_group, t, rank
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.reduce_scatter_embeddings = reduce_scatter_embeddings
        self.vocab_start_index, self.vocab_end_index = vocab_range(num_embeddings, rank, t)
        self.num_embeddings_per_partition = self.vocab_end_index - self.vocab_start_index
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=params_dtype))
        initialize_affine_weight_cpu(self.weight, num_embeddings, embedding_dim, self.num_embeddings_per_partition,
                                     0, init_method or init_method_normal(0.02), rank=rank, world_size=t)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
            local = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        else:
            local = input_
        output_parallel = F.embedding(local, self.weight)                  # [..., h]
        if self.tp_size > 1:
            output_parallel = output_parallel.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            output_parallel = output_parallel.transpose(0, 1).contiguous()  # [b, s, h] -> [s, b, h]
            return reduce_scatter_to_sequence_parallel_region(output_parallel, self.tp_group)
        return reduce_from_tensor_model_parallel_region(output_parallel, self.tp_group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, TP={self.tp_size}, "
                f"vocab_range=[{self.vocab_start_index}, {self.vocab_end_index})")
