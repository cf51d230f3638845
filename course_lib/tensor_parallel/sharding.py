"""Move between a tensor-parallel module's shards and the dense tensors.

A parameter created by a parallel layer carries Megatron's attributes
``tensor_model_parallel`` / ``partition_dim`` (see :mod:`.init`); everything
else (LayerNorm, the row-parallel bias) is replicated on every rank. Using those
attributes:

* :func:`copy_dense_to_parallel` loads a dense module's weights into a parallel
  module of the same structure (each rank keeps its slice);
* :func:`gather_full_params` / :func:`gather_full_grads` re-assemble the full
  tensors from the shards (all-gather along the partition dim), so a test can
  compare them with the dense model's;
* :func:`allreduce_sequence_parallel_grads` sums, over TP, the gradients of the
  replicated parameters that are partial under sequence parallelism (Megatron:
  ``_allreduce_non_tensor_model_parallel_grads`` in
  ``megatron/core/distributed/finalize_model_grads.py``, run after backward).
"""

from __future__ import annotations

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from course_lib import comm
from course_lib.rules import UsageError

__all__ = ["is_tensor_parallel", "copy_dense_to_parallel", "gather_full_params", "gather_full_grads",
           "allreduce_sequence_parallel_grads", "sequence_parallel_params"]


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """True for a TP shard (Megatron attribute ``tensor_model_parallel``)."""
    return bool(getattr(param, "tensor_model_parallel", False))


def _check_same_structure(dense: nn.Module, parallel: nn.Module) -> dict:
    dense_params = dict(dense.named_parameters())
    names = [n for n, _ in parallel.named_parameters()]
    if sorted(dense_params) != sorted(names):
        missing = sorted(set(names) - set(dense_params))
        extra = sorted(set(dense_params) - set(names))
        raise UsageError(f"dense and parallel modules differ in parameters: missing in dense {missing}, "
                         f"extra in dense {extra}")
    return dense_params


@torch.no_grad()
def copy_dense_to_parallel(dense: nn.Module, parallel: nn.Module, tp_group) -> nn.Module:
    """Copy ``dense``'s parameters into ``parallel`` (same names), each rank taking its slice.

    A shard gets chunk ``rank`` of the dense tensor along its ``partition_dim``;
    a replicated parameter gets the whole tensor. Returns ``parallel``."""
    t, rank = comm.group_size(tp_group), comm.group_rank(tp_group)
    dense_params = _check_same_structure(dense, parallel)
    for name, p in parallel.named_parameters():
        full = dense_params[name]
        if is_tensor_parallel(p):
            piece = full.chunk(t, dim=p.partition_dim)[rank]
        else:
            piece = full
        if piece.shape != p.shape:
            raise UsageError(f"{name}: this rank's slice has shape {tuple(piece.shape)} but the parallel "
                             f"parameter has {tuple(p.shape)}")
        p.copy_(piece)
    return parallel


def _gather(module: nn.Module, tp_group, grads: bool) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in module.named_parameters():
        value = p.grad if grads else p.data
        if value is None:
            raise UsageError(f"{name} has no gradient: run backward first")
        value = value.detach()
        if is_tensor_parallel(p):
            value = comm.all_gather(value, tp_group, dim=p.partition_dim, kind="tp",
                                    source="gather_full_grads" if grads else "gather_full_params")
        out[name] = value.clone()
    return out


def gather_full_params(module: nn.Module, tp_group) -> dict[str, torch.Tensor]:
    """``{name: full tensor}``: shards all-gathered along their partition dim, replicated ones as is.
    Collective: every rank of ``tp_group`` must call it."""
    return _gather(module, tp_group, grads=False)


def gather_full_grads(module: nn.Module, tp_group) -> dict[str, torch.Tensor]:
    """``{name: full gradient}`` re-assembled like :func:`gather_full_params` (call it after
    :func:`allreduce_sequence_parallel_grads` under sequence parallelism). Collective."""
    return _gather(module, tp_group, grads=True)


def sequence_parallel_params(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """Parameters marked ``sequence_parallel=True`` (LayerNorms and row-parallel biases under SP)."""
    return [(n, p) for n, p in module.named_parameters() if getattr(p, "sequence_parallel", False)]


@torch.no_grad()
def allreduce_sequence_parallel_grads(module: nn.Module, tp_group) -> int:
    """Sum the gradients of ``sequence_parallel`` parameters over ``tp_group``, in one all-reduce.

    Under sequence parallelism a replicated parameter (LayerNorm weight/bias,
    row-parallel bias) is applied to this rank's ``s/t`` tokens only, so its
    gradient is a partial sum over tokens; the true gradient is the sum over
    ranks. Megatron does this in ``finalize_model_grads`` (coalesced into one
    flat buffer, like here). Returns the number of elements reduced (0 when
    there is nothing to do or the group has one rank)."""
    params = [p for _, p in sequence_parallel_params(module) if p.grad is not None]
    if not params or comm.group_size(tp_group) == 1:
        return 0
    grads = [p.grad for p in params]
    flat = _flatten_dense_tensors(grads)
    comm.all_reduce(flat, tp_group, kind="tp", direction="bwd", source="allreduce_sequence_parallel_grads")
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)
    return flat.numel()
