"""Weight initialisation that makes a TP model hold exactly the dense model's numbers.

Megatron's CPU initialisation (``_initialize_affine_weight_cpu`` in
``megatron/core/tensor_parallel/layers.py``) builds the *full* master weight on
every rank with the same seeded generator, splits it along the partition
dimension and keeps this rank's shard. Every rank therefore consumes the random
stream exactly as a single-process dense model would, and the shards
concatenated along the partition dim are the dense weight, bit for bit. (Its
GPU path instead draws each shard from a per-rank seed: cheaper, but the
numbers then differ from a dense model's.)

Parameter attributes (Megatron's names) tell later code how a tensor is split:
``tensor_model_parallel`` (True for a shard), ``partition_dim`` (0 or 1),
``partition_stride`` (always 1 here), and ``sequence_parallel`` (True for
replicated parameters whose gradient is partial under sequence parallelism).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from course_lib.rules import UsageError

__all__ = ["init_method_normal", "scaled_init_method_normal", "initialize_affine_weight_cpu",
           "set_tensor_model_parallel_attributes"]


def init_method_normal(sigma: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, sigma^2) in place, from the global torch generator (Megatron: ``init_method_normal``)."""
    def init_(tensor: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(tensor, mean=0.0, std=sigma)
    return init_


def scaled_init_method_normal(sigma: float, num_layers: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """N(0, (sigma / sqrt(2 num_layers))^2), for the output GEMMs of attention and MLP
    (Megatron: ``scaled_init_method_normal``; GPT-2's residual scaling)."""
    return init_method_normal(sigma / math.sqrt(2.0 * num_layers))


def set_tensor_model_parallel_attributes(tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int = 1):
    """Mark ``tensor`` as a TP shard split along ``dim`` (Megatron's attribute names)."""
    tensor.tensor_model_parallel = is_parallel
    tensor.partition_dim = dim
    tensor.partition_stride = stride
    return tensor


def initialize_affine_weight_cpu(weight: torch.Tensor, output_size: int, input_size: int,
                                 per_partition_size: int, partition_dim: int,
                                 init_method: Callable[[torch.Tensor], torch.Tensor], *,
                                 rank: int, world_size: int) -> torch.Tensor:
    """Fill ``weight`` (this rank's shard) from a full ``[output_size, input_size]`` master weight.

    The master weight is drawn with ``init_method`` (global generator, float32),
    split into chunks of ``per_partition_size`` along ``partition_dim`` (0: rows =
    output features, column-parallel; 1: columns = input features, row-parallel),
    and chunk ``rank`` is copied into ``weight``. Returns the master weight.
    """
    if partition_dim not in (0, 1):
        raise UsageError(f"partition_dim={partition_dim} must be 0 (column-parallel) or 1 (row-parallel)")
    full = (output_size, input_size)[partition_dim]
    if per_partition_size * world_size != full:
        raise UsageError(f"per_partition_size={per_partition_size} x world_size={world_size} != "
                         f"{full} (the full size of dimension {partition_dim})")
    set_tensor_model_parallel_attributes(weight, True, partition_dim, 1)
    master = torch.empty(output_size, input_size, dtype=torch.float32)
    init_method(master)
    shard = torch.split(master, per_partition_size, dim=partition_dim)[rank]
    with torch.no_grad():
        weight.copy_(shard.to(weight.dtype))
    return master
