"""Gradients after the backward passes, before the optimizer step: synchronised, then measured.

The course's Megatron ``megatron/core/distributed/finalize_model_grads.py``, plus the gradient
norm of ``megatron/core/optimizer/clip_grads.py`` (``get_grad_norm_fp32``) that clipping reads:

* :func:`finalize_model_grads` -- what every rank's gradients need once the pipeline schedule
  has run all its backward passes: the dp-cp average, the sequence-parallel LayerNorm sums over
  TP, the tied word-embedding sum over the embedding group;
* :func:`allreduce_dp_grads` -- the dp-cp average, as one coalesced all-reduce;
* :func:`allreduce_expert_dp_grads` -- MoE expert weights: the sum over expert DP, ``/ (dp*cp)``;
* :func:`grad_norm` -- the L2 norm of the whole model's gradient, each parameter counted once;
* :func:`unique_named_params` -- a rank's parameters over its model chunks, each once.

Every reduction goes through :mod:`course_lib.comm`, so a run's bytes are counted by kind.
"""

from __future__ import annotations

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from course_lib import comm
from course_lib.model import allreduce_embedding_grads
from course_lib.moe.layer import is_expert_param
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
    _coalesced_sum_then_divide(params, groups.dp_cp, dp_cp_size, kind)


def _coalesced_sum_then_divide(params, group, divide_by: int, kind: str) -> None:
    """Sum ``params``' gradients over ``group`` as one flattened buffer (no collective for a group of
    one), divide by ``divide_by``, copy back. A missing gradient takes part as zeros."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = _flatten_dense_tensors(grads)
    if comm.group_size(group) > 1:
        comm.all_reduce(flat, group, kind=kind, direction="bwd", source="finish_grad_sync")
    if divide_by != 1:
        flat.div_(divide_by)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def finalize_model_grads(chunks, groups, config: ParallelConfig, moe_groups=None) -> None:
    """After the schedule's backward passes, before the optimizer (Megatron's ``finalize_model_grads``,
    ``megatron/core/distributed/finalize_model_grads.py``), in its order:

    1. average every gradient over the dp-cp group (``finish_grad_sync``; kind ``"dp"``, or
       ``"dp-cp"`` when cp > 1: CP ranks hold the same weights and saw different tokens); with MoE
       (``moe_groups``), the expert weights (:func:`~course_lib.moe.layer.is_expert_param`) are
       left out of it and reduced by :func:`allreduce_expert_dp_grads` instead;
    2. with sequence parallelism, sum the LayerNorm (and row-parallel bias) gradients over TP;
    3. sum the tied word-embedding gradient over the embedding group (first + last stage).

    ``config``: the run's validated layout (``groups`` were built from its grid); ``moe_groups``: the
    run's :class:`~course_lib.process_groups.MoEGroups` (None: a dense model).
    """
    params = [p for _, p in unique_named_params(chunks)]
    if moe_groups is not None:
        experts = [p for p in params if is_expert_param(p)]
        params = [p for p in params if not is_expert_param(p)]
        allreduce_expert_dp_grads(experts, moe_groups, config.dp * config.cp)
    allreduce_dp_grads(params, groups, config.dp * config.cp, dp_kind(config))
    if config.sequence_parallel:
        allreduce_sequence_parallel_grads(torch.nn.ModuleList(chunks), groups.tp)
    allreduce_embedding_grads(chunks, groups)


@torch.no_grad()
def allreduce_expert_dp_grads(params, moe_groups, dp_cp_size: int) -> None:
    """The expert weights' gradients: one coalesced all-reduce (sum) over the **expert** data-parallel
    group (``moe_groups.expert_dp``: the ranks that hold the same experts), then ``/ (dp*cp)``, the
    *dense* dp-cp size -- Megatron's ``DistributedDataParallel`` scales its expert buffers by
    ``1 / data_parallel_world_size`` too (``megatron/core/distributed/distributed_data_parallel.py``):
    an expert's gradient already holds every token that its EP group sent it, so the expert-DP sum
    covers every dense DP replica's tokens once. Kind ``"expert_dp"``."""
    if params:
        _coalesced_sum_then_divide(params, moe_groups.expert_dp, dp_cp_size, "expert_dp")


def dp_kind(config: ParallelConfig) -> str:
    """The comm kind of the gradient and loss reductions: ``"dp"``, or ``"dp-cp"`` when cp > 1."""
    return "dp" if config.cp == 1 else "dp-cp"


@torch.no_grad()
def grad_norm(params, groups, tp_rank: int, moe_groups=None) -> float:
    """L2 norm of the whole model's gradient, each parameter counted once (Megatron's
    ``get_grad_norm_fp32``: skip TP duplicates on TP ranks > 0 and the ``shared`` embedding
    copy), squares summed over the model-parallel (tp-pp) group.

    With MoE (``moe_groups``), the expert weights are unique on every rank of the expert
    tp-ep-pp group (each holds its experts' expert-TP shard), so their squares are all counted
    and summed over that group (``moe_groups.tp_ep_pp``), the dense ones over tp-pp; the norm is
    the root of both sums (Megatron: the dense and the expert optimizer each take their norm over
    their own model-parallel group, and ``ChainedOptimizer`` combines them)."""
    device = params[0].device
    total = torch.zeros(1, dtype=torch.float64, device=device)
    experts = torch.zeros(1, dtype=torch.float64, device=device)
    for p in params:
        if p.grad is None or getattr(p, "shared", False):
            continue
        if moe_groups is not None and is_expert_param(p):
            experts += p.grad.double().pow(2).sum()
        elif is_tensor_parallel(p) or tp_rank == 0:
            total += p.grad.double().pow(2).sum()
    comm.all_reduce(total, groups.model, kind="tp-pp", direction="bwd", source="get_grad_norm_fp32")
    if moe_groups is not None:
        comm.all_reduce(experts, moe_groups.tp_ep_pp, kind="tp-ep-pp", direction="bwd", source="get_grad_norm_fp32")
        total += experts
    return float(total.sqrt())

