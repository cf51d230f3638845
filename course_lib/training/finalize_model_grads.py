"""Gradients after the backward passes, before the optimizer step: synchronised, then measured.

The course's Megatron ``megatron/core/distributed/finalize_model_grads.py``, plus the gradient
norm of ``megatron/core/optimizer/clip_grads.py`` (``get_grad_norm_fp32``) that clipping reads:

* :func:`finalize_model_grads` -- what every rank's gradients need once the pipeline schedule
  has run all its backward passes: the dp-cp average, the sequence-parallel LayerNorm sums over
  TP, the tied word-embedding sum over the embedding group;
* :func:`allreduce_dp_grads` -- the dp-cp average, as one coalesced all-reduce;
* :func:`grad_norm` -- the L2 norm of the whole model's gradient, each parameter counted once;
* :func:`unique_named_params` -- a rank's parameters over its model chunks, each once.

Every reduction goes through :mod:`course_lib.comm`, so a run's bytes are counted by kind.
"""

from __future__ import annotations

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from course_lib import comm
from course_lib.model import allreduce_embedding_grads
from course_lib.tensor_parallel import allreduce_sequence_parallel_grads, is_tensor_parallel
from course_lib.topology import ParallelConfig


def unique_named_params(chunks) -> list:
    """``(name, parameter)`` over this rank's model chunks, each parameter object once (by
    identity), in chunk order: the list the optimizer, the clipping and the norm share."""
    seen, out = set(), []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
    return out


@torch.no_grad()
def allreduce_dp_grads(params, groups, dp_cp_size: int, kind: str) -> None:
    """Average every gradient over the dp-cp group (``groups.dp_cp``, ``dp_cp_size`` ranks): one
    all-reduce of all of them flattened into one buffer, then ``/ (dp*cp)`` (Megatron's
    ``finish_grad_sync`` on its contiguous grad buffer). A parameter without a gradient takes part
    with zeros, so every rank sends the same buffer. ``kind``: the comm kind it is counted under."""
    if dp_cp_size == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = _flatten_dense_tensors(grads)
    comm.all_reduce(flat, groups.dp_cp, kind=kind, direction="bwd", source="finish_grad_sync")
    flat.div_(dp_cp_size)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def finalize_model_grads(chunks, groups, config: ParallelConfig) -> None:
    """After the schedule's backward passes, before the optimizer (Megatron's ``finalize_model_grads``,
    ``megatron/core/distributed/finalize_model_grads.py``), in its order:

    1. average every gradient over the dp-cp group (``finish_grad_sync``; kind ``"dp"``, or
       ``"dp-cp"`` when cp > 1: CP ranks hold the same weights and saw different tokens);
    2. with sequence parallelism, sum the LayerNorm (and row-parallel bias) gradients over TP;
    3. sum the tied word-embedding gradient over the embedding group (first + last stage).

    ``config``: the run's validated layout (``groups`` were built from its grid).
    """
    params = [p for _, p in unique_named_params(chunks)]
    allreduce_dp_grads(params, groups, config.dp * config.cp, dp_kind(config))
    if config.sequence_parallel:
        allreduce_sequence_parallel_grads(torch.nn.ModuleList(chunks), groups.tp)
    allreduce_embedding_grads(chunks, groups)


def dp_kind(config: ParallelConfig) -> str:
    """The comm kind of the gradient and loss reductions: ``"dp"``, or ``"dp-cp"`` when cp > 1."""
    return "dp" if config.cp == 1 else "dp-cp"


@torch.no_grad()
def grad_norm(params, groups, tp_rank: int) -> float:
    """L2 norm of the whole model's gradient, each parameter counted once (Megatron's
    ``get_grad_norm_fp32``: skip TP duplicates on TP ranks > 0 and the ``shared`` embedding
    copy), squares summed over the model-parallel (tp-pp) group."""
    device = params[0].device
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for p in params:
        if p.grad is None or getattr(p, "shared", False):
            continue
        if is_tensor_parallel(p) or tp_rank == 0:
            total += p.grad.double().pow(2).sum()
    comm.all_reduce(total, groups.model, kind="tp-pp", direction="bwd", source="get_grad_norm_fp32")
    return float(total.sqrt())


