"""A Mixture-of-Experts MLP with expert parallelism: router, all-to-all dispatch, experts, combine.

Megatron: ``megatron/core/transformer/moe/moe_layer.py`` (``MoELayer``: route -> dispatch ->
experts -> combine), ``token_dispatcher.py`` (``MoEAlltoAllTokenDispatcher``, selected by
``--moe-token-dispatcher-type alltoall``), ``experts.py`` (``SequentialMLP``: one MLP per local
expert, ``--moe-ffn-hidden-size``). Papers: GShard (Lepikhin et al. 2020), Switch Transformer
(Fedus et al. 2021).

Dropless dispatch on one rank of an expert-parallel group of ``ep`` ranks (T tokens, k = top-k,
E experts, L = E / ep local experts; rank j holds experts ``j·L .. j·L+L-1``), as Megatron's
``MoEAlltoAllTokenDispatcher`` does it:

1. permute: the T·k (token, expert) pairs sorted by expert -> rows [T·k, H] and their gate values
   (probs) [T·k]; rows for rank j are one contiguous chunk (``input_splits[j]`` rows);
2. all-gather every rank's counts (E numbers) over the group, so that every rank knows the whole
   distribution and reads its splits off it (:func:`course_lib.moe.alltoall_plan.plan_alltoall`);
   then the uneven all-to-all of the rows and, beside it, of the probs (``all_to_all_single`` with
   splits) -> rows for my L experts, grouped by source rank; regroup them by local expert;
3. each local expert runs its MLP on its rows, the gate value scaling the activation before fc2
   (Megatron's ``per_token_scale``): ``fc2(gelu(fc1(x)) · p)``;
4. combine = the mirror image: regroup by source, all-to-all back, add the k outputs of each token
   (unpermute) -> [T, H].

Each all-to-all takes T·k·H elements per rank (each way, forward and backward), of which the rows
for this rank's own experts (≈ 1/ep of them with balanced routing) never leave it: the traffic
grows with tokens × top-k, not with the number of experts. The recorder counts the all-to-all's
input as ``numel`` and the rows for the other ranks as ``sent``. With ``ep_group=None`` the same
class is the single-process MoE (all experts local, no communication) -- the reference the parity
tests use.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import comm, rules
from course_lib.moe.alltoall_plan import plan_alltoall
from course_lib.moe.mappings import all_to_all_uneven, reorder_chunks
from course_lib.moe.router import route

__all__ = ["MoELayer", "make_master_weights", "reduce_moe_grads", "is_expert_param"]


def make_master_weights(hidden_size: int, num_experts: int, moe_ffn_hidden_size: int, seed: int = 0) -> dict:
    """One set of weights for every layout: ``router`` [E, H], ``fc1`` [E, F, H], ``fc2`` [E, H, F]."""
    g = torch.Generator().manual_seed(seed)
    h, e, f = hidden_size, num_experts, moe_ffn_hidden_size
    return {"router": torch.randn(e, h, generator=g) * h ** -0.5,
            "fc1": torch.randn(e, f, h, generator=g) * h ** -0.5,
            "fc2": torch.randn(e, h, f, generator=g) * f ** -0.5}


class MoELayer(torch.nn.Module):
    """The MoE MLP of one rank: ``num_experts / ep`` local experts, a replicated router.

    Args:
        master: :func:`make_master_weights` -- every rank slices its own experts out of it.
        moe_router_topk, moe_aux_loss_coeff, moe_z_loss_coeff: Megatron's router flags.
        ep_group: this rank's expert-model-parallel group (``RankGrid.expert_groups("ep")``, the
            ``ep`` of :func:`course_lib.process_groups.new_moe_process_groups`); None: one process
            holds every expert.

    ``forward(x)``: x [..., H] -> (output [..., H], aux_loss []). Expert parameters carry
    ``allreduce = False`` (Megatron's mark: reduced over the expert-DP group, not DP).
    """

    def __init__(self, master: dict, moe_router_topk: int = 2, moe_aux_loss_coeff: float = 0.0,
                 moe_z_loss_coeff: float | None = None, ep_group=None):
        super().__init__()
        num_experts = master["router"].shape[0]
        self.ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        rules.moe_experts(num_experts, self.ep)
        self.num_experts, self.num_local_experts = num_experts, num_experts // self.ep
        self.local_expert_indices = list(range(ep_rank * self.num_local_experts,
                                               (ep_rank + 1) * self.num_local_experts))
        self.topk = rules.integer("moe-router-topk", moe_router_topk, maximum=num_experts)
        self.aux_loss_coeff, self.z_loss_coeff = moe_aux_loss_coeff, moe_z_loss_coeff
        self.ep_group = ep_group
        self.router_weight = torch.nn.Parameter(master["router"].clone())       # [E, H]
        local = slice(self.local_expert_indices[0], self.local_expert_indices[-1] + 1)
        self.fc1 = torch.nn.Parameter(master["fc1"][local].clone())               # [L, F, H]
        self.fc2 = torch.nn.Parameter(master["fc2"][local].clone())               # [L, H, F]
        for p in (self.fc1, self.fc2):
            p.allreduce = False

    def experts(self, rows: torch.Tensor, probs: torch.Tensor, rows_per_local_expert: list[int]) -> torch.Tensor:
        """SequentialMLP: local expert l runs fc2(gelu(fc1(x)) · p) on its rows.
        rows [N, H], probs [N] (each row's gate value) -> [N, H]."""
        outs = [(F.gelu(chunk @ self.fc1[i].t()) * p.unsqueeze(-1)) @ self.fc2[i].t()   # [n_l, F] -> [n_l, H]
                for i, (chunk, p) in enumerate(zip(torch.split(rows, rows_per_local_expert),
                                                   torch.split(probs, rows_per_local_expert)))]
        return torch.cat(outs) if outs else rows

    def forward(self, x: torch.Tensor):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])                                           # [T, H]
        probs, indices, aux = route(tokens, self.router_weight, self.topk, aux_loss_coeff=self.aux_loss_coeff,
                                    z_loss_coeff=self.z_loss_coeff)                 # [T, k] each
        flat_experts = indices.flatten()                                            # [T·k]
        perm = torch.argsort(flat_experts, stable=True)                             # pair order by expert
        permuted = tokens[perm // self.topk]                                        # [T·k, H]
        permuted_probs = probs.flatten()[perm]                                      # [T·k]
        tokens_per_expert = torch.bincount(flat_experts, minlength=self.num_experts)  # [E]
        if self.ep_group is None:
            expert_out = self.experts(permuted, permuted_probs, tokens_per_expert.tolist())
        else:
            expert_out = self._through_experts_of_the_group(permuted, permuted_probs, tokens_per_expert)
        out = torch.zeros_like(tokens).index_add(0, perm // self.topk, expert_out)  # unpermute: [T, H]
        return out.reshape(shape), aux

    def _through_experts_of_the_group(self, permuted: torch.Tensor, permuted_probs: torch.Tensor,
                                      tokens_per_expert: torch.Tensor):
        """Dispatch (all-to-all of rows and probs) -> local experts -> combine (all-to-all back).
        [T·k, H], [T·k] -> [T·k, H]."""
        ep, L = self.ep, self.num_local_experts
        plan = plan_alltoall(tokens_per_expert, self.ep_group, ep, 1, 0, self.local_expert_indices[0])
        received = all_to_all_uneven(permuted, self.ep_group, plan.output_splits, plan.input_splits, "moe_dispatch")
        received_probs = all_to_all_uneven(permuted_probs, self.ep_group, plan.output_splits, plan.input_splits,
                                           "moe_dispatch_probs")
        by_expert_order = [s * L + l for l in range(L) for s in range(ep)]
        rows = reorder_chunks(received, plan.chunk_sizes, by_expert_order)          # [N, H] by local expert
        row_probs = reorder_chunks(received_probs, plan.chunk_sizes, by_expert_order)
        y = self.experts(rows, row_probs, plan.tokens_per_local_expert)
        by_source_order = [l * ep + s for s in range(ep) for l in range(L)]
        counts_by_expert = [plan.chunk_sizes[i] for i in by_expert_order]
        y = reorder_chunks(y, counts_by_expert, by_source_order)                    # back to by source
        return all_to_all_uneven(y, self.ep_group, plan.input_splits, plan.output_splits, "moe_combine")


def is_expert_param(p: torch.Tensor) -> bool:
    """An expert weight (Megatron's ``allreduce = False``): reduced over expert DP, not DP."""
    return getattr(p, "allreduce", True) is False


def reduce_moe_grads(module: torch.nn.Module, dp_group, expert_dp_group, divide_by: int = 1) -> None:
    """Sum gradients like Megatron's DDP with MoE: parameters marked ``allreduce = False`` (experts)
    over the expert data-parallel group, every other one over the (dense) data-parallel group; then
    divide all of them by ``divide_by`` (Megatron: the dense dp·cp size for both kinds)."""
    for p in module.parameters():
        if p.grad is None:
            continue
        expert = is_expert_param(p)
        comm.all_reduce(p.grad, expert_dp_group if expert else dp_group, kind="expert_dp" if expert else "dp",
                        source="reduce_moe_grads")
        if divide_by != 1:
            p.grad.div_(divide_by)
