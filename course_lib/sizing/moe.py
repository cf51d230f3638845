"""Mixture-of-Experts sizing: parameters, active parameters per token, bytes per rank with EP and expert DP.

Pure Python (no torch). An MoE layer replaces the dense MLP by ``E`` expert MLPs and a router
``[E, h]``; a token runs through ``k`` of them (``--moe-router-topk``), so the parameters a token
*uses* -- the "active" parameters -- are the dense ones plus ``k`` experts per MoE layer, while the
model *holds* all ``E``.

Counted per layer (``h`` hidden, ``a`` heads of ``d = kv_channels``, ``g`` query groups, ``F`` the
expert FFN size, ``ffn`` the dense FFN size; ``gated_linear_unit`` (SwiGLU) doubles fc1):

* attention: ``linear_qkv`` ``h × (a + 2g) d`` (+ bias), ``linear_proj`` ``a d × h`` (+ bias ``h``);
* two norms: ``2h`` each for LayerNorm (weight, bias), ``h`` for RMSNorm;
* a dense MLP: ``h × ffn (×2 with GLU)`` (+ bias) and ``ffn × h`` (+ bias ``h``);
* an MoE MLP: router ``E × h`` (+ bias ``E``) and ``E`` experts of ``h F (×2 with GLU) + F h`` (+ biases
  ``F (×2 with GLU) + h``): Megatron's router and SequentialMLP experts have biases unless
  ``--disable-bias-linear`` (``add_bias_linear=False``), which expert TP > 1, Megatron's GroupedMLP and
  Mixtral need or have.

Outside the layers: word embeddings ``V × h``, learned positions ``max_position_embeddings × h``
(0 for RoPE), a final norm, and an output layer ``V × h`` only when untied.

Checked against (tests/test_sizing_moe.py): the course's own MoE GPT, parameter by parameter of its
real ``nn.Module``; and Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts", arXiv:2401.04088:
8 experts, top-2, 32 layers, h = 4096, 32 heads with 8 KV heads, expert FFN 14336, vocab 32000,
SwiGLU, RMSNorm, untied embeddings), whose announcement (Mistral AI, "Mixtral of experts",
2023-12-11, https://mistral.ai/news/mixtral-of-experts) gives "46.7B total parameters but only uses
12.9B parameters per token".

Bytes per rank (:func:`moe_bytes_per_rank`): the dense parameters are split over TP (the ones
Megatron splits) and PP; the experts over ``expert_tp × ep`` and PP -- Megatron's two grids
(:class:`course_lib.topology.RankGrid` with ``ep``). With ``--use-distributed-optimizer`` the dense optimizer state is
sharded over the dense dp·cp ranks and the experts' over the **expert** data-parallel ranks
``world / (expert_tp·ep·pp)`` (Megatron's expert-DP optimizer instance); bytes per parameter from
:func:`course_lib.sizing.memory.megatron_optimizer_bytes_per_param`.
"""

from __future__ import annotations

from course_lib.sizing import _checks
from course_lib.sizing.memory import ModelStateBytes, megatron_optimizer_bytes_per_param
from course_lib.rules import UsageError

__all__ = ["moe_parameter_counts", "moe_bytes_per_rank", "MIXTRAL_8X7B"]

MIXTRAL_8X7B = dict(num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8, vocab_size=32000,
                    num_experts=8, moe_router_topk=2, moe_ffn_hidden_size=14336, gated_linear_unit=True,
                    add_bias_linear=False, normalization="RMSNorm", max_position_embeddings=0,
                    untie_embeddings_and_output_weights=True)
"""Mixtral 8x7B's shape (Jiang et al. 2024, Table 1; its config.json), in Megatron's flag names."""

_NORM_VECTORS = {"LayerNorm": 2, "RMSNorm": 1}


def moe_parameter_counts(*, num_layers: int, hidden_size: int, num_attention_heads: int, vocab_size: int,
                         num_experts: int, moe_ffn_hidden_size: int, moe_router_topk: int = 2, moe_layer_freq=1,
                         ffn_hidden_size: int | None = None, num_query_groups: int | None = None,
                         kv_channels: int | None = None, gated_linear_unit: bool = False,
                         add_bias_linear: bool = True, normalization: str = "LayerNorm",
                         max_position_embeddings: int = 0,
                         untie_embeddings_and_output_weights: bool = False) -> dict:
    """Parameters of a GPT with MoE layers (Megatron's flag names; ``vocab_size`` as the model holds it,
    i.e. padded). Returns a dict of counts: ``embedding``, ``output_layer``, ``attention``, ``norms``,
    ``dense_mlp``, ``router``, ``experts``, ``per_expert``, ``moe_layers``, ``dense`` (everything but the
    experts), ``total``, ``active`` (per token: dense + k experts per MoE layer), and the dense split
    ``tp_split`` / ``replicated`` (what Megatron's TP splits, what it replicates)."""
    from course_lib.moe.pattern import moe_layer_pattern

    _checks.model_shape(num_layers, hidden_size, num_attention_heads, vocab_size)
    for name, value in (("num_experts", num_experts), ("moe_ffn_hidden_size", moe_ffn_hidden_size),
                        ("moe_router_topk", moe_router_topk)):
        _checks.positive_int(name, value)
    if moe_router_topk > num_experts:
        raise UsageError(f"moe_router_topk={moe_router_topk} is more than num_experts={num_experts}; use 1..{num_experts}")
    if normalization not in _NORM_VECTORS:
        raise UsageError(f"normalization={normalization!r} is not one of {', '.join(_NORM_VECTORS)}")
    _checks.non_negative_int("max_position_embeddings", max_position_embeddings)
    h, E, Fe, glu = hidden_size, num_experts, moe_ffn_hidden_size, 2 if gated_linear_unit else 1
    ffn = 4 * h if ffn_hidden_size is None else _checks.positive_int("ffn_hidden_size", ffn_hidden_size)
    d = h // num_attention_heads if kv_channels is None else _checks.positive_int("kv_channels", kv_channels)
    g = num_attention_heads if num_query_groups is None else _checks.positive_int("num_query_groups", num_query_groups)
    bias = 1 if add_bias_linear else 0
    moe_layers = sum(moe_layer_pattern(num_layers, moe_layer_freq))
    dense_layers = num_layers - moe_layers
    qkv = (num_attention_heads + 2 * g) * d
    attention_split = h * qkv + bias * qkv + num_attention_heads * d * h       # qkv w+b, proj w: split by TP
    attention_replicated = bias * h                                             # proj bias
    norm = _NORM_VECTORS[normalization] * h
    mlp_split = h * ffn * glu + bias * ffn * glu + ffn * h                      # fc1 w+b, fc2 w
    mlp_replicated = bias * h                                                   # fc2 bias
    per_expert = h * Fe * glu + Fe * h + bias * (Fe * glu + h)                 # fc1 w+b, fc2 w+b (expert TP 1)
    embedding = vocab_size * h + max_position_embeddings * h
    output_layer = vocab_size * h if untie_embeddings_and_output_weights else 0
    counts = dict(
        embedding=embedding, output_layer=output_layer,
        attention=num_layers * (attention_split + attention_replicated),
        norms=num_layers * 2 * norm + norm,
        dense_mlp=dense_layers * (mlp_split + mlp_replicated),
        router=moe_layers * (E * h + bias * E), experts=moe_layers * E * per_expert, per_expert=per_expert,
        moe_layers=moe_layers)
    counts["dense"] = sum(counts[k] for k in ("embedding", "output_layer", "attention", "norms", "dense_mlp", "router"))
    counts["total"] = counts["dense"] + counts["experts"]
    counts["active"] = counts["dense"] + moe_layers * moe_router_topk * per_expert
    counts["tp_split"] = (vocab_size * h + output_layer + num_layers * attention_split + dense_layers * mlp_split)
    counts["replicated"] = counts["dense"] - counts["tp_split"]
    return counts


def moe_bytes_per_rank(counts: dict, *, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
                       expert_tp: int | None = None, distributed_optimizer: bool = False,
                       params_dtype: str = "bf16", grad_dtype: str = "fp32") -> dict:
    """Parameters and model-state bytes of one rank (an average pipeline stage) for ``counts`` from
    :func:`moe_parameter_counts`, in Megatron's two grids. Returns ``dense_params`` (``tp_split/(tp·pp) +
    replicated/pp``), ``expert_params`` (``experts / (expert_tp·ep·pp)``), ``dense`` / ``expert``
    (:class:`~course_lib.sizing.memory.ModelStateBytes` per rank), ``total_bytes``, ``dp``, ``expert_dp``.
    Exact for pp = 1; for pp > 1, stages differ by their embedding and their share of MoE layers."""
    from course_lib.topology import RankGrid

    grid = RankGrid(world_size, tp=tp, pp=pp, cp=cp, ep=ep, expert_tp=expert_tp)
    dense_params = counts["tp_split"] / (grid.tp * grid.pp) + counts["replicated"] / grid.pp
    expert_params = counts["experts"] / (grid.expert_tp * grid.ep * grid.pp)
    per_param = {name: megatron_optimizer_bytes_per_param(shards, distributed_optimizer, params_dtype, grad_dtype)
                 for name, shards in (("dense", grid.dp * grid.cp), ("expert", grid.expert_dp))}
    dense = ModelStateBytes(*(b * dense_params for b in per_param["dense"]))
    expert = ModelStateBytes(*(b * expert_params for b in per_param["expert"]))
    return dict(dense_params=dense_params, expert_params=expert_params, dense=dense, expert=expert,
                total_bytes=dense.total + expert.total, dp=grid.dp, expert_dp=grid.expert_dp)
