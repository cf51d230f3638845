"""The single-process reference: the same layers, unsplit, written with plain PyTorch.

``DenseMLP``, ``DenseSelfAttention`` and ``DenseTransformerLayer`` have the same
module structure and parameter names as their parallel twins in
:mod:`.transformer` (``linear_fc1.weight`` ...), hold full-size ``nn.Linear``
weights, and draw them from the global generator in the same order with the same
init methods. So after ``torch.manual_seed(s)`` a dense layer and a parallel
layer on any TP size hold the same numbers: the parallel layer's shards,
concatenated along their partition dims, are the dense weights.

The attention here is written out (scores, causal mask, softmax) rather than
calling ``F.scaled_dot_product_attention``, so the comparison also checks the
parallel layer's use of that kernel. Nothing here communicates.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .transformer import TransformerConfig

__all__ = ["DenseMLP", "DenseSelfAttention", "DenseTransformerLayer", "dense_linear"]


def dense_linear(in_features: int, out_features: int, init_method, bias: bool = True,
                 dtype: torch.dtype = torch.float32) -> nn.Linear:
    """An ``nn.Linear`` whose weight is drawn with ``init_method`` (bias zero), consuming the global
    generator exactly like :func:`~.init.initialize_affine_weight_cpu` does for the master weight."""
    with torch.random.fork_rng(devices=[]):  # nn.Linear's own init must not consume the global stream
        layer = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    master = torch.empty(out_features, in_features, dtype=torch.float32)
    init_method(master)
    with torch.no_grad():
        layer.weight.copy_(master.to(dtype))
        if bias:
            layer.bias.zero_()
    return layer


class DenseMLP(nn.Module):
    """``h -> ffn -> h`` with GeLU. Input/output ``[s, b, h]``."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.linear_fc1 = dense_linear(config.hidden_size, config.ffn_hidden_size, config.init_method,
                                       config.add_bias_linear, config.params_dtype)
        self.linear_fc2 = dense_linear(config.ffn_hidden_size, config.hidden_size,
                                       config.output_layer_init_method, config.add_bias_linear,
                                       config.params_dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(hidden_states)))


class DenseSelfAttention(nn.Module):
    """Causal multi-head self-attention. Input/output ``[s, b, h]``; ``linear_qkv`` rows are
    interleaved per head ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` (Megatron's layout)."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.linear_qkv = dense_linear(h, 3 * h, config.init_method, config.add_bias_linear, config.params_dtype)
        self.linear_proj = dense_linear(h, h, config.output_layer_init_method, config.add_bias_linear,
                                        config.params_dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        s, b, h = hidden_states.shape
        nh, hn = self.config.num_attention_heads, self.config.kv_channels
        qkv = self.linear_qkv(hidden_states).view(s, b, nh, 3 * hn)
        q, k, v = qkv.split(hn, dim=-1)                                   # [s, b, np, hn]
        scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(hn)    # [b, np, s, s]
        causal = torch.ones(s, s, dtype=torch.bool, device=scores.device).triu(1)
        probs = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
        if self.training and self.config.attention_dropout:
            probs = F.dropout(probs, p=self.config.attention_dropout)
        context = torch.einsum("bnst,tbnd->sbnd", probs, v).reshape(s, b, h)
        return self.linear_proj(context)


class DenseTransformerLayer(nn.Module):
    """Pre-LayerNorm GPT layer. Input/output ``[s, b, h]``."""

    def __init__(self, config: TransformerConfig, layer_number: int = 1):
        super().__init__()
        self.config, self.layer_number = config, layer_number
        h, eps = config.hidden_size, config.layernorm_epsilon
        self.input_layernorm = nn.LayerNorm(h, eps=eps, dtype=config.params_dtype)
        self.self_attention = DenseSelfAttention(config)
        self.pre_mlp_layernorm = nn.LayerNorm(h, eps=eps, dtype=config.params_dtype)
        self.mlp = DenseMLP(config)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        p = self.config.hidden_dropout if self.training else 0.0
        x = hidden_states + F.dropout(self.self_attention(self.input_layernorm(hidden_states)), p=p,
                                      training=self.training)
        return x + F.dropout(self.mlp(self.pre_mlp_layernorm(x)), p=p, training=self.training)
