"""Tensor parallelism (张量并行) the Megatron-LM way, on real ranks.

Modules, one idea each:

==================  ==========================================================
:mod:`.mappings`    f, g and the scatter/gather operators (autograd functions)
:mod:`.init`        split one dense master weight like Megatron's CPU init
:mod:`.layers`      ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
:mod:`.cross_entropy`  vocab_parallel_cross_entropy (no full logits gathered)
:mod:`.transformer` TransformerConfig, ParallelMLP, ParallelSelfAttention,
                    ParallelTransformerLayer
:mod:`.dense`       the single-process reference with the same structure
:mod:`.sharding`    dense <-> shards, gradient re-assembly, SP gradient all-reduce
:mod:`.memory`      per-rank parameter bytes vs TP size (table and bar chart)
:mod:`.plots`       column/row split drawings
==================  ==========================================================

Every function and layer takes the TP process group explicitly; a group of one
gives the dense computation with no communication. Communication goes through
:mod:`course_lib.comm`, so ``with CommRecorder() as rec:`` sees all of it.

Example (on each of t ranks, inside :func:`course_lib.launch.launch`)::

    torch.manual_seed(0)
    cfg = TransformerConfig(hidden_size=64, num_attention_heads=4)
    layer = ParallelTransformerLayer(cfg, tp_group)   # this rank's shards
    y = layer(x)                                      # x, y: [s, b, h]
"""

from .cross_entropy import vocab_parallel_cross_entropy
from .dense import DenseMLP, DenseSelfAttention, DenseTransformerLayer
from .init import init_method_normal, initialize_affine_weight_cpu, scaled_init_method_normal
from .layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                     linear_with_sequence_parallel, vocab_range)
from .mappings import (copy_to_tensor_model_parallel_region, gather_from_sequence_parallel_region,
                       gather_from_tensor_model_parallel_region, reduce_from_tensor_model_parallel_region,
                       reduce_scatter_to_sequence_parallel_region, scatter_to_sequence_parallel_region,
                       scatter_to_tensor_model_parallel_region, split_along_first_dim, split_along_last_dim)
from .sharding import (allreduce_sequence_parallel_grads, copy_dense_to_parallel, gather_full_grads,
                       gather_full_params, is_tensor_parallel, sequence_parallel_params)
from .transformer import (ParallelMLP, ParallelSelfAttention, ParallelTransformerLayer, TransformerConfig,
                          tp_layer_comm_elements)

__all__ = [
    # mappings
    "copy_to_tensor_model_parallel_region", "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region", "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region", "split_along_first_dim", "split_along_last_dim",
    # layers
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "linear_with_sequence_parallel",
    "vocab_range", "vocab_parallel_cross_entropy",
    # transformer
    "TransformerConfig", "ParallelMLP", "ParallelSelfAttention", "ParallelTransformerLayer",
    "DenseMLP", "DenseSelfAttention", "DenseTransformerLayer", "tp_layer_comm_elements",
    # init and sharding
    "init_method_normal", "scaled_init_method_normal", "initialize_affine_weight_cpu",
    "copy_dense_to_parallel", "gather_full_params", "gather_full_grads", "allreduce_sequence_parallel_grads",
    "is_tensor_parallel", "sequence_parallel_params",
]
