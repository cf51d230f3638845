"""A GPT transformer layer split over a tensor-parallel group: MLP, self-attention, the layer.

Structure and parameter names follow Megatron-core (``megatron/core/transformer/
mlp.py``, ``attention.py``, ``transformer_layer.py``): a pre-LayerNorm layer
``input_layernorm -> self_attention(linear_qkv, core attention, linear_proj) ->
residual -> pre_mlp_layernorm -> mlp(linear_fc1, gelu, linear_fc2) -> residual``.
Activations are ``[s, b, h]``. (Legacy Megatron called these ParallelMLP with
``dense_h_to_4h``/``dense_4h_to_h`` and ParallelAttention with
``query_key_value``/``dense``; the class names here are the legacy ones.)

How the split works (Shoeybi et al. 2019, section 3, figures 3a and 3b):

* MLP: ``linear_fc1`` is column-parallel (each rank gets ffn/t output features,
  GeLU is elementwise so it runs on the shard), ``linear_fc2`` is row-parallel
  (its input is already split the same way). Forward: f before fc1 (identity),
  g after fc2 (one all-reduce). Backward: the reverse (one all-reduce in f).
* Attention: ``linear_qkv`` is column-parallel with Megatron's interleaved
  layout (rows ordered head by head: ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``), so
  rank i's contiguous shard holds complete heads ``i*np/t .. (i+1)*np/t - 1``.
  Attention is computed per head, so **no communication** is needed between the
  QKV GEMM and ``linear_proj`` (row-parallel, one all-reduce after it).
  Hence ``num_attention_heads % t == 0``.
* A layer: 2 all-reduces of ``s*b*h`` elements forward, 2 backward
  (:func:`tp_layer_comm_elements` gives the volume). With sequence parallelism
  (Korthikanti et al. 2022) each all-reduce becomes an all-gather before the
  column GEMM and a reduce-scatter after the row GEMM, and LayerNorm, dropout
  and the residual work on ``[s/t, b, h]``. LayerNorm normalises each token over
  ``h``, so it needs no statistics from other ranks -- but its weight gradients
  are then partial sums over the ranks' tokens and must be all-reduced over TP
  (:func:`course_lib.tensor_parallel.allreduce_sequence_parallel_grads`).

Dropout defaults to 0. With dropout > 0 each rank draws its own masks (Megatron
coordinates them with its CUDA RNG tracker), so outputs no longer match a
dense model bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from course_lib import comm, rules

from .init import init_method_normal, scaled_init_method_normal
from .layers import ColumnParallelLinear, RowParallelLinear

__all__ = ["TransformerConfig", "ParallelMLP", "ParallelSelfAttention", "ParallelTransformerLayer",
           "tp_layer_comm_elements"]


@dataclass
class TransformerConfig:
    """The subset of Megatron's ``TransformerConfig`` (same field names) our layers use.

    ``ffn_hidden_size`` defaults to ``4 * hidden_size``; ``num_layers`` only
    scales the output-layer initialisation (``init_method_std / sqrt(2 L)``).
    """

    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int | None = None
    num_layers: int = 1
    sequence_parallel: bool = False
    add_bias_linear: bool = True
    layernorm_epsilon: float = 1e-5
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    params_dtype: torch.dtype = torch.float32

    def __post_init__(self):
        for name in ("hidden_size", "num_attention_heads", "num_layers"):
            rules.integer(name, getattr(self, name))
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        rules.integer("ffn_hidden_size", self.ffn_hidden_size)
        rules.hidden_divisible_by_heads(self.hidden_size, self.num_attention_heads)
        for name in ("hidden_dropout", "attention_dropout"):
            rules.probability(name, getattr(self, name))
        rules.number("init_method_std", self.init_method_std, 0.0)

    @property
    def kv_channels(self) -> int:
        """Hidden size per attention head."""
        return self.hidden_size // self.num_attention_heads

    @property
    def init_method(self):
        return init_method_normal(self.init_method_std)

    @property
    def output_layer_init_method(self):
        return scaled_init_method_normal(self.init_method_std, self.num_layers)


def _tp_size(tp_group) -> int:
    if tp_group is None:
        raise rules.UsageError("tp_group is None: pass the tensor-parallel process group explicitly")
    return comm.group_size(tp_group)


class ParallelMLP(nn.Module):
    """``h -> ffn -> h`` MLP split over ``tp_group``: fc1 column-parallel, fc2 row-parallel.

    Input/output ``[s, b, h]`` (``[s/t, b, h]`` under sequence parallelism). Per
    rank: ``linear_fc1.weight [ffn/t, h]``, ``linear_fc2.weight [h, ffn/t]``.
    Megatron's MLP returns ``(output, bias)`` to fuse bias+dropout+add; this one
    adds the bias and returns the output.
    """

    def __init__(self, config: TransformerConfig, tp_group):
        super().__init__()
        rules.ffn_divisible_by_tp(config.ffn_hidden_size, _tp_size(tp_group))
        self.config, self.tp_group = config, tp_group
        kw = dict(tp_group=tp_group, bias=config.add_bias_linear, sequence_parallel=config.sequence_parallel,
                  params_dtype=config.params_dtype)
        self.linear_fc1 = ColumnParallelLinear(config.hidden_size, config.ffn_hidden_size, gather_output=False,
                                               init_method=config.init_method, **kw)
        self.linear_fc2 = RowParallelLinear(config.ffn_hidden_size, config.hidden_size, input_is_parallel=True,
                                            init_method=config.output_layer_init_method, **kw)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        intermediate, _ = self.linear_fc1(hidden_states)     # [s, b, ffn/t]  (f inside: no comm forward)
        intermediate = F.gelu(intermediate)                  # elementwise: works on the shard
        output, _ = self.linear_fc2(intermediate)            # [s, b, h]      (g inside: 1 all-reduce)
        return output


class ParallelSelfAttention(nn.Module):
    """Causal multi-head self-attention with heads split over ``tp_group``.

    Input/output ``[s, b, h]`` (``[s/t, b, h]`` under sequence parallelism).
    Per rank: ``np/t`` heads; ``linear_qkv.weight [3h/t, h]`` (interleaved
    ``[q k v]`` per head), ``linear_proj.weight [h, h/t]``.
    """

    def __init__(self, config: TransformerConfig, tp_group):
        super().__init__()
        self.config, self.tp_group = config, tp_group
        self.num_attention_heads_per_partition = rules.heads_divisible_by_tp(config.num_attention_heads,
                                                                             _tp_size(tp_group))
        self.hidden_size_per_attention_head = config.kv_channels
        kw = dict(tp_group=tp_group, bias=config.add_bias_linear, sequence_parallel=config.sequence_parallel,
                  params_dtype=config.params_dtype)
        self.linear_qkv = ColumnParallelLinear(config.hidden_size, 3 * config.hidden_size, gather_output=False,
                                               init_method=config.init_method, **kw)
        self.linear_proj = RowParallelLinear(config.hidden_size, config.hidden_size, input_is_parallel=True,
                                             init_method=config.output_layer_init_method, **kw)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        mixed_qkv, _ = self.linear_qkv(hidden_states)                        # [s, b, np/t * 3 * hn]
        s, b = mixed_qkv.shape[:2]
        nh, hn = self.num_attention_heads_per_partition, self.hidden_size_per_attention_head
        mixed_qkv = mixed_qkv.view(s, b, nh, 3 * hn)                         # [s, b, np/t, 3*hn]
        q, k, v = mixed_qkv.split(hn, dim=-1)                                # each [s, b, np/t, hn]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (q, k, v))                 # [b, np/t, s, hn]
        context = self.core_attention(q, k, v)                               # [b, np/t, s, hn]
        context = context.permute(2, 0, 1, 3).reshape(s, b, nh * hn)         # [s, b, h/t]: local heads only
        output, _ = self.linear_proj(context)                                # [s, b, h] (1 all-reduce)
        return output

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal ``softmax(q k^T / sqrt(hn)) v`` for this rank's heads: ``[b, np/t, s, hn]`` in and out.

        Megatron's ``core_attention`` submodule (``DotProductAttention``, or Transformer Engine's,
        which also runs context parallelism): everything around it -- the QKV GEMM, the head
        split, the projection -- is the same whatever computes it, so a variant overrides only
        this (:class:`course_lib.context_parallel.ContextParallelSelfAttention`: a ring over CP)."""
        dropout = self.config.attention_dropout if self.training else 0.0
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)


class ParallelTransformerLayer(nn.Module):
    """A pre-LayerNorm GPT layer split over ``tp_group``. Input/output ``[s, b, h]``
    (``[s/t, b, h]`` with ``config.sequence_parallel``).

    LayerNorms are replicated; under sequence parallelism their parameters carry
    ``sequence_parallel=True`` and their gradients must be all-reduced over TP
    after backward (:func:`~course_lib.tensor_parallel.allreduce_sequence_parallel_grads`).
    ``self_attention`` builds the attention as ``self_attention(config, tp_group)`` (Megatron's
    layer spec names the module the same way); context parallelism passes
    :class:`~course_lib.context_parallel.ContextParallelSelfAttention` through
    :func:`course_lib.context_parallel.build_layer`. It is built where the default would be, so
    the weights drawn from the generator are the same.
    """

    def __init__(self, config: TransformerConfig, tp_group, layer_number: int = 1,
                 self_attention: Callable[..., ParallelSelfAttention] = ParallelSelfAttention):
        super().__init__()
        self.config, self.tp_group, self.layer_number = config, tp_group, layer_number
        h, eps = config.hidden_size, config.layernorm_epsilon
        self.input_layernorm = nn.LayerNorm(h, eps=eps, dtype=config.params_dtype)
        self.self_attention = self_attention(config, tp_group)
        self.pre_mlp_layernorm = nn.LayerNorm(h, eps=eps, dtype=config.params_dtype)
        self.mlp = ParallelMLP(config, tp_group)
        if config.sequence_parallel:
            for norm in (self.input_layernorm, self.pre_mlp_layernorm):
                for p in norm.parameters():
                    p.sequence_parallel = True

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        p = self.config.hidden_dropout if self.training else 0.0
        residual = hidden_states
        attention = self.self_attention(self.input_layernorm(hidden_states))
        hidden_states = residual + F.dropout(attention, p=p, training=self.training)
        residual = hidden_states
        mlp = self.mlp(self.pre_mlp_layernorm(hidden_states))
        return residual + F.dropout(mlp, p=p, training=self.training)


def tp_layer_comm_elements(micro_batch_size: int, seq_length: int, hidden_size: int, tp: int,
                           passes: str = "fwd+bwd") -> float:
    """Elements one rank sends per transformer layer for TP's all-reduces (ring algorithm).

    Two all-reduces of ``b*s*h`` elements in each pass, each sending
    ``2 (t-1)/t * b*s*h`` per rank: ``4 b s h (t-1)/t`` per pass, ``8 b s h (t-1)/t``
    forward + backward (Narayanan et al. 2021, section 3.2). Sequence parallelism
    sends the same (all-gather + reduce-scatter = one all-reduce), not counting
    Megatron's extra all-gather of the stored input shard in backward.
    """
    if passes not in ("fwd", "bwd", "fwd+bwd"):
        raise rules.UsageError(f"passes={passes!r} must be 'fwd', 'bwd' or 'fwd+bwd'")
    per_pass = 2 * comm.ring_elements_sent("all_reduce", micro_batch_size * seq_length * hidden_size, tp)
    return per_pass * (2 if passes == "fwd+bwd" else 1)
