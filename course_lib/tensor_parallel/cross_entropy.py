"""Cross-entropy on vocabulary-parallel logits, without ever gathering the full logits.

Megatron-LM ``megatron/core/tensor_parallel/cross_entropy.py``. Each rank holds
the logits of its vocabulary slice ``[s, b, V/t]``. For each token the loss
``log(sum_j exp(z_j)) - z_target`` needs three numbers from all ranks, so the
forward pass issues three all-reduces of ``s*b`` elements (not ``s*b*V``):

1. max over the vocabulary (MAX) -- for a numerically safe exp;
2. the target logit (SUM; only the rank whose slice holds the target contributes);
3. sum of exp (SUM).

The backward pass needs no communication: ``dz_j = softmax_j - [j == target]``
is local to the rank holding ``j``. (The all-reduce of the gradient w.r.t. the
hidden states is done by the f operator of the column-parallel output layer
that produced the logits.) Label smoothing is left out.
"""

from __future__ import annotations

import torch

from course_lib import comm
from course_lib.rules import UsageError

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, kind):
        t, rank = comm.group_size(group), comm.group_rank(group)
        ctx.dtype = logits.dtype
        logits = logits.float()                                                # softmax in fp32, like Megatron
        part = logits.shape[-1]
        start, end = rank * part, (rank + 1) * part

        logits_max = logits.max(dim=-1).values                                # [s, b]
        comm.all_reduce(logits_max, group, op="max", kind=kind, direction="fwd",
                        source="vocab_parallel_cross_entropy")
        shifted = logits - logits_max.unsqueeze(-1)                            # [s, b, V/t] (a new tensor)

        outside = (target < start) | (target >= end)                           # target not in my slice
        local_target = (target - start).masked_fill(outside, 0)
        predicted = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1)  # [s, b]
        predicted = predicted.masked_fill(outside, 0.0).contiguous()
        comm.all_reduce(predicted, group, op="sum", kind=kind, direction="fwd",
                        source="vocab_parallel_cross_entropy")

        exp_logits = shifted.exp_()
        sum_exp = exp_logits.sum(dim=-1)                                       # [s, b]
        comm.all_reduce(sum_exp, group, op="sum", kind=kind, direction="fwd",
                        source="vocab_parallel_cross_entropy")

        loss = torch.log(sum_exp) - predicted                                  # [s, b]
        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))                       # my slice of the softmax
        ctx.save_for_backward(softmax, outside, local_target)
        ctx.t = t
        return loss

    @staticmethod
    def backward(ctx, grad_loss):                                              # [s, b]
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax.clone()
        one_hot = torch.zeros_like(grad).scatter_(-1, local_target.unsqueeze(-1), 1.0)
        grad -= one_hot * (~outside).unsqueeze(-1).to(grad.dtype)
        grad *= grad_loss.unsqueeze(-1)
        return grad.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, tp_group,
                                 *, kind: str = "tp") -> torch.Tensor:
    """Per-token cross-entropy ``[s, b]`` from logits split over the vocabulary.

    ``vocab_parallel_logits``: ``[s, b, V/t]``, this rank's contiguous slice
    ``[rank*V/t, (rank+1)*V/t)`` of the vocabulary (what a column-parallel output
    layer with ``gather_output=False`` produces); ``target``: ``[s, b]`` global
    token ids. Equal to ``F.cross_entropy(full_logits.view(-1, V), target.view(-1),
    reduction="none")`` reshaped to ``[s, b]``, gradients included. The input is
    not modified (Megatron works in place on it to save memory).
    """
    if tp_group is None or isinstance(tp_group, (int, float)):
        raise UsageError(f"tp_group={tp_group!r}: pass the tensor-parallel process group explicitly (the third "
                         f"argument; label smoothing is not supported here)")
    if target.shape != vocab_parallel_logits.shape[:-1]:
        raise UsageError(f"target shape {tuple(target.shape)} must equal the logits' shape without the "
                         f"vocabulary dim {tuple(vocab_parallel_logits.shape[:-1])}")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp_group, kind)
