"""The MoE router: softmax top-k gating with the Switch load-balancing loss and the z-loss.

Megatron: ``megatron/core/transformer/moe/router.py`` (``TopKRouter``) and
``moe_utils.py`` (``topk_softmax_with_capacity``, ``switch_load_balancing_loss_func``,
``z_loss_func``). Flags: ``--num-experts``, ``--moe-router-topk``, ``--moe-aux-loss-coeff``,
``--moe-z-loss-coeff``, ``--moe-router-pre-softmax``.

Papers: Shazeer et al. 2017 (top-k gating), Lepikhin et al. 2020 "GShard" (top-2, aux loss),
Fedus et al. 2021 "Switch Transformer" (eq. 4: ``aux = α · E · Σ_i f_i · P_i``), Zoph et al.
2022 "ST-MoE" (router z-loss: ``mean(logsumexp(logits)²)``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from course_lib import comm, rules

__all__ = ["route", "switch_load_balancing_loss", "z_loss"]


def switch_load_balancing_loss(scores: torch.Tensor, indices: torch.Tensor, num_experts: int,
                               coeff: float, sequence_partition_group=None) -> torch.Tensor:
    """Switch Transformer's auxiliary loss, in Megatron's form (``switch_load_balancing_loss_func``).

    ``scores``: [T, E] softmax over all experts; ``indices``: [T, k] chosen experts.
    ``f_i`` = share of the T·k routing slots that went to expert i, ``P_i`` = mean score of
    expert i; ``aux = coeff · E · Σ_i f_i · P_i`` (= coeff when the load is perfectly uniform).
    Gradients flow through ``P`` only (the counts are not differentiable).

    ``sequence_partition_group``: the ranks that hold the other parts of the same sequences (the dense
    tp-cp group under sequence or context parallelism; Megatron's ``tp_cp_group``): the counts are
    summed over it and ``T`` is the whole sequence's, so this rank's value is its share of the loss of
    the whole sequence -- the shares add up to the one-process loss."""
    num_tokens, topk = indices.shape
    tokens_per_expert = torch.bincount(indices.flatten(), minlength=num_experts).to(scores.dtype)  # [E]
    if sequence_partition_group is not None and comm.group_size(sequence_partition_group) > 1:
        comm.all_reduce(tokens_per_expert, sequence_partition_group, kind="tp", source="moe_aux_loss_counts")
        num_tokens *= comm.group_size(sequence_partition_group)
    return (scores.sum(0) * tokens_per_expert).sum() * (num_experts * coeff / (num_tokens * num_tokens * topk))


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """ST-MoE's router z-loss: ``coeff · mean_t(logsumexp(logits_t)²)`` -- keeps logits small. [T, E] -> []."""
    return coeff * torch.logsumexp(logits, dim=-1).square().mean()


def route(x: torch.Tensor, weight: torch.Tensor, topk: int, *, bias: torch.Tensor | None = None,
          aux_loss_coeff: float = 0.0, z_loss_coeff: float | None = None, pre_softmax: bool = False,
          sequence_partition_group=None, parts: dict | None = None):
    """Route each token to ``topk`` experts.

    ``x``: [T, H] tokens; ``weight``: [E, H] (Megatron's ``router.weight``); ``bias``: [E] or None
    (``router.bias``: Megatron's router has one unless ``--disable-bias-linear``).
    Returns ``probs`` [T, k] (gate values), ``indices`` [T, k] (expert ids) and the auxiliary loss
    (a scalar: load balancing + z-loss). Megatron's default (``pre_softmax=False``): top-k on the
    logits, then softmax over the k chosen (the gates of one token sum to 1); ``pre_softmax=True``:
    softmax over all experts, then top-k. The aux loss always uses the softmax over all experts.

    ``sequence_partition_group``: see :func:`switch_load_balancing_loss`; the z-loss coefficient is
    divided by its size (Megatron's ``apply_z_loss``), so the ranks' shares add up to the mean over the
    whole sequence. ``parts``: a dict that receives ``"load_balancing_loss"`` and ``"z_loss"`` (the
    terms, coefficients included) for logging."""
    num_experts = weight.shape[0]
    topk = rules.integer("moe-router-topk", topk, maximum=num_experts)
    logits = F.linear(x, weight, bias)                        # [T, E]
    scores = torch.softmax(logits, dim=-1)                    # [T, E]
    if pre_softmax:
        probs, indices = torch.topk(scores, topk, dim=-1)     # [T, k]
    else:
        top_logits, indices = torch.topk(logits, topk, dim=-1)
        probs = torch.softmax(top_logits, dim=-1)             # [T, k]
    aux = x.new_zeros(())
    if aux_loss_coeff:
        term = switch_load_balancing_loss(scores, indices, num_experts, aux_loss_coeff, sequence_partition_group)
        aux = aux + term
        if parts is not None:
            parts["load_balancing_loss"] = term
    if z_loss_coeff:
        split = 1 if sequence_partition_group is None else comm.group_size(sequence_partition_group)
        term = z_loss(logits, z_loss_coeff / split)
        aux = aux + term
        if parts is not None:
            parts["z_loss"] = term
    return probs, indices, aux
