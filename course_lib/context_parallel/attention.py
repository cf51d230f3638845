"""The transformer layer under context parallelism: the TP attention with a ring as its core.

Context parallelism changes one thing in a layer: the core attention. The QKV
GEMM, the head split, the output projection, the LayerNorms and the MLP work
token by token, so they run unchanged on the rank's ``s/cp`` tokens (its two
zigzag chunks, :mod:`.zigzag`). Only ``softmax(q k^T) v`` needs the keys and
values of the other ranks: :class:`ContextParallelSelfAttention` overrides
:meth:`~course_lib.tensor_parallel.ParallelSelfAttention.core_attention` with
:func:`~course_lib.context_parallel.ring_attention` over the CP group -- what
Megatron does by handing the CP group to its core attention
(``TEDotProductAttention``). Same weights, parameter names and shapes as the TP
attention: ``[s/cp, b, h]`` in and out (``[s/(cp t), b, h]`` under sequence
parallelism).

:func:`build_layer` is the one way the course builds a layer on a TP group and,
optionally, a CP group (the model, the activation-memory measurements and Lab 04
all call it).
"""

from __future__ import annotations

import functools

import torch

from course_lib import comm, rules
from course_lib.context_parallel.ring import ring_attention
from course_lib.tensor_parallel import ParallelSelfAttention, ParallelTransformerLayer, TransformerConfig

__all__ = ["ContextParallelSelfAttention", "build_layer"]


class ContextParallelSelfAttention(ParallelSelfAttention):
    """:class:`~course_lib.tensor_parallel.ParallelSelfAttention` whose core attention is causal ring
    attention (zigzag layout) over ``cp_group``, on this rank's ``np/t`` heads and ``s/cp`` tokens."""

    def __init__(self, config: TransformerConfig, tp_group, cp_group):
        if cp_group is None:
            raise rules.UsageError("cp_group is None: pass the context-parallel process group explicitly")
        rules.cp_attention_dropout(config.attention_dropout)
        super().__init__(config, tp_group)
        self.cp_group = cp_group

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Ring attention over the CP group: ``[b, np/t, s/cp, hn]`` in and out."""
        return ring_attention(q, k, v, self.cp_group, causal=True, layout="zigzag")


def build_layer(config: TransformerConfig, tp_group, cp_group=None, layer_number: int = 1) -> ParallelTransformerLayer:
    """A :class:`~course_lib.tensor_parallel.ParallelTransformerLayer` on ``tp_group``; with a CP group of
    more than one rank its attention is :class:`ContextParallelSelfAttention`. Weights come from the
    global generator exactly as in the dense layer (seed first), whatever the CP size."""
    if cp_group is None or comm.group_size(cp_group) == 1:
        return ParallelTransformerLayer(config, tp_group, layer_number)
    attention = functools.partial(ContextParallelSelfAttention, cp_group=cp_group)
    return ParallelTransformerLayer(config, tp_group, layer_number, self_attention=attention)
