"""The alltoall dispatcher's bookkeeping: who sends how many rows to whom, from one all-gather of counts.

Megatron: ``MoEAlltoAllTokenDispatcher.preprocess`` (``megatron/core/transformer/moe/token_dispatcher.py``).
Every rank of the expert tp×ep group (``tp_ep``: expert TP fastest, then EP) all-gathers every
member's ``[E]`` tokens-per-expert, so each rank knows the whole distribution ``[ep, etp, E]``; from
it each rank reads, without any further message,

* ``input_splits`` ``[ep]``: the rows it sends to each EP rank (its own counts, summed per
  destination's ``L = E / ep`` experts);
* ``output_splits`` ``[ep]``: the rows it receives from each EP rank -- what the EP peers with the
  same expert-TP coordinate routed to this rank's experts;
* ``output_splits_tp`` ``[etp]``: the rows each expert-TP peer received (the block sizes of the
  all-gather over expert TP, which gives every TP shard of an expert all of its rows);
* ``chunk_sizes`` ``[etp · ep · L]``: the gathered rows as chunks (TP source, EP source, local
  expert) -- the order in which they arrive;
* ``tokens_per_local_expert`` ``[L]``: the rows each local expert processes.

One all-gather of ``E`` numbers per rank replaces the all-to-all of the counts an EP-only dispatcher
would need (and the second exchange over expert TP): the counts are tiny, and knowing all of them
is what lets every split above be computed locally.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from course_lib import comm

__all__ = ["AllToAllPlan", "plan_alltoall"]


@dataclass(frozen=True)
class AllToAllPlan:
    """The splits of one alltoall dispatch on one rank (see the module docstring for each field)."""

    input_splits: list[int]
    output_splits: list[int]
    output_splits_tp: list[int]
    chunk_sizes: list[int]
    tokens_per_local_expert: list[int]
    num_local_experts: int

    @property
    def chunk_experts(self) -> list[int]:
        """The local expert of each chunk of :attr:`chunk_sizes`."""
        return list(range(self.num_local_experts)) * (len(self.chunk_sizes) // self.num_local_experts)


def plan_alltoall(tokens_per_expert: torch.Tensor, tp_ep_group, ep: int, expert_tp: int,
                  expert_tp_rank: int, first_local_expert: int) -> AllToAllPlan:
    """All-gather ``tokens_per_expert`` ``[E]`` over ``tp_ep_group`` (``ep · expert_tp`` ranks, expert TP
    fastest; ``None`` for a group of one) and derive the splits. Collective over ``tp_ep_group``.

    Recorded as an all-gather, kind ``"ep"``, source ``"moe_token_counts"`` (forward only: counts
    carry no gradient)."""
    E = tokens_per_expert.numel()
    L = E // ep
    if tp_ep_group is None or ep * expert_tp == 1:
        every = tokens_per_expert.view(1, 1, E)
    else:
        every = comm.all_gather(tokens_per_expert.contiguous(), tp_ep_group, kind="ep",
                                source="moe_token_counts").view(ep, expert_tp, E)
    every = every.transpose(0, 1)                                                     # [etp, ep, E]
    mine = every[:, :, first_local_expert:first_local_expert + L]                     # [etp, ep, L]
    per_rank = mine.sum(2)                                                            # [etp, ep]
    return AllToAllPlan(
        input_splits=tokens_per_expert.view(ep, L).sum(1).tolist(),
        output_splits=per_rank[expert_tp_rank].tolist(),
        output_splits_tp=per_rank.sum(1).tolist(),
        chunk_sizes=mine.flatten().tolist(),
        tokens_per_local_expert=mine.sum((0, 1)).tolist(),
        num_local_experts=L)
