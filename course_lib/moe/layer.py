"""A Mixture-of-Experts MLP with expert parallelism: router, all-to-all dispatch, experts, combine.

Megatron: ``megatron/core/transformer/moe/moe_layer.py`` (``MoELayer``: route -> dispatch ->
experts -> combine), ``token_dispatcher.py`` (``MoEAlltoAllTokenDispatcher``, selected by
``--moe-token-dispatcher-type alltoall``), ``experts.py`` (``SequentialMLP``: one MLP per local
expert, ``--moe-ffn-hidden-size``). Papers: GShard (Lepikhin et al. 2020), Switch Transformer
(Fedus et al. 2021).

Dropless dispatch on one rank of an expert-parallel group of ``ep`` ranks (T tokens, k = top-k,
E experts, L = E / ep local experts; rank j holds experts ``j·L .. j·L+L-1``):

1. permute: the T·k (token, expert) pairs sorted by expert -> [T·k, H]; rows for rank j are one
   contiguous chunk (``input_splits[j]`` rows);
2. all-to-all of the counts (E numbers) so that every rank knows what it will receive, then the
   uneven all-to-all of the rows (``all_to_all_single`` with splits) -> rows for my L experts,
   grouped by source rank; regroup them by local expert;
3. each local expert runs its MLP on its rows;
4. combine = the mirror image: regroup by source, all-to-all back, multiply by the gate values and
   add the k outputs of each token (unpermute) -> [T, H].

Each all-to-all moves T·k·H elements per rank (each way, forward and backward): the traffic grows
with tokens × top-k, not with the number of experts. With ``ep_group=None`` the same class is the
single-process MoE (all experts local, no communication) -- the reference the parity tests use.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib import comm, rules
from course_lib.moe.router import route

__all__ = ["MoELayer", "make_master_weights", "all_to_all_uneven", "reduce_moe_grads", "new_moe_groups"]


def new_moe_groups(grid, timeout: float | None = None) -> dict:
    """This rank's MoE process groups for a :class:`~course_lib.moe.grid.MoEGrid`: ``{"ep", "expert_dp",
    "dp"}`` (expert-model-parallel, expert data-parallel, dense data-parallel with cp). Every rank creates
    every group in the same order (``new_group`` is collective), each with a timeout."""
    import datetime

    from course_lib.process_groups import DEFAULT_TIMEOUT

    wait = datetime.timedelta(seconds=DEFAULT_TIMEOUT if timeout is None else timeout)
    me, mine = dist.get_rank(), {}
    for name, groups in (("ep", grid.expert_groups("ep")), ("expert_dp", grid.expert_groups("dp")),
                         ("dp", grid.dense_groups("dp-cp"))):
        for ranks in groups:
            group = dist.new_group(ranks, timeout=wait)
            if me in ranks:
                mine[name] = group
    return mine


def make_master_weights(hidden_size: int, num_experts: int, moe_ffn_hidden_size: int, seed: int = 0) -> dict:
    """One set of weights for every layout: ``router`` [E, H], ``fc1`` [E, F, H], ``fc2`` [E, H, F]."""
    g = torch.Generator().manual_seed(seed)
    h, e, f = hidden_size, num_experts, moe_ffn_hidden_size
    return {"router": torch.randn(e, h, generator=g) * h ** -0.5,
            "fc1": torch.randn(e, f, h, generator=g) * h ** -0.5,
            "fc2": torch.randn(e, h, f, generator=g) * f ** -0.5}


def _all_to_all(x: torch.Tensor, group, output_splits: list[int], input_splits: list[int], source: str):
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    comm.record_event("all_to_all", x.numel(), group_size=dist.get_world_size(group), kind="ep",
                      dtype=x.dtype, source=source)
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=output_splits,
                           input_split_sizes=input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """Uneven all-to-all whose backward is the all-to-all with the splits swapped."""

    @staticmethod
    def forward(ctx, x, group, output_splits, input_splits, source):
        ctx.group, ctx.splits, ctx.source = group, (output_splits, input_splits), source
        return _all_to_all(x, group, output_splits, input_splits, source)

    @staticmethod
    def backward(ctx, dy):
        output_splits, input_splits = ctx.splits
        return _all_to_all(dy, ctx.group, input_splits, output_splits, ctx.source), None, None, None, None


def all_to_all_uneven(x: torch.Tensor, group, output_splits: list[int], input_splits: list[int],
                      source: str = "moe_all_to_all") -> torch.Tensor:
    """Differentiable ``all_to_all_single``: the first ``input_splits[j]`` rows after the previous
    ones go to group rank j; ``output_splits[j]`` rows come from rank j. [sum(in), ...] -> [sum(out), ...].
    Recorded as op "all_to_all", kind "ep", numel = the rows this rank sends × row size."""
    return _AllToAll.apply(x, group, list(map(int, output_splits)), list(map(int, input_splits)), source)


def _reorder_chunks(x: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """Rows cut into chunks of ``sizes``, put back together in ``order`` (Megatron's sort_chunks_by_idxs)."""
    chunks = torch.split(x, [int(s) for s in sizes])
    return torch.cat([chunks[i] for i in order]) if chunks else x


class MoELayer(torch.nn.Module):
    """The MoE MLP of one rank: ``num_experts / ep`` local experts, a replicated router.

    Args:
        master: :func:`make_master_weights` -- every rank slices its own experts out of it.
        moe_router_topk, moe_aux_loss_coeff, moe_z_loss_coeff: Megatron's router flags.
        ep_group: this rank's expert-model-parallel group (``MoEGrid.expert_groups("ep")``); None:
            one process holds every expert.
        send_order: ``send_order[j]`` = the EP rank that receives the tokens routed to the experts
            of slice j. Always the identity in a real run; a test passes a wrong one to prove that
            misrouted tokens are caught by the parity check.

    ``forward(x)``: x [..., H] -> (output [..., H], aux_loss []). Expert parameters carry
    ``allreduce = False`` (Megatron's mark: reduced over the expert-DP group, not DP).
    """

    def __init__(self, master: dict, moe_router_topk: int = 2, moe_aux_loss_coeff: float = 0.0,
                 moe_z_loss_coeff: float | None = None, ep_group=None, send_order: list[int] | None = None):
        super().__init__()
        num_experts = master["router"].shape[0]
        self.ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        if num_experts % self.ep:
            raise ValueError(f"num-experts={num_experts} is not divisible by expert-model-parallel-size={self.ep}; "
                             f"use a multiple of {self.ep}")
        self.num_experts, self.num_local_experts = num_experts, num_experts // self.ep
        self.local_expert_indices = list(range(ep_rank * self.num_local_experts,
                                               (ep_rank + 1) * self.num_local_experts))
        self.topk = rules.integer("moe-router-topk", moe_router_topk, maximum=num_experts)
        self.aux_loss_coeff, self.z_loss_coeff = moe_aux_loss_coeff, moe_z_loss_coeff
        self.ep_group = ep_group
        self.send_order = list(range(self.ep)) if send_order is None else list(send_order)
        if sorted(self.send_order) != list(range(self.ep)):
            raise ValueError(f"send_order={send_order!r} must be a permutation of 0..{self.ep - 1}")
        self.router_weight = torch.nn.Parameter(master["router"].clone())       # [E, H]
        local = slice(self.local_expert_indices[0], self.local_expert_indices[-1] + 1)
        self.fc1 = torch.nn.Parameter(master["fc1"][local].clone())               # [L, F, H]
        self.fc2 = torch.nn.Parameter(master["fc2"][local].clone())               # [L, H, F]
        for p in (self.fc1, self.fc2):
            p.allreduce = False

    def experts(self, rows: torch.Tensor, rows_per_local_expert: list[int]) -> torch.Tensor:
        """SequentialMLP: local expert l runs fc2(gelu(fc1(x))) on its rows. [N, H] -> [N, H]."""
        outs = [F.gelu(chunk @ self.fc1[i].t()) @ self.fc2[i].t()          # [n_l, F] -> [n_l, H]
                for i, chunk in enumerate(torch.split(rows, rows_per_local_expert))]
        return torch.cat(outs) if outs else rows

    def forward(self, x: torch.Tensor):
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])                                           # [T, H]
        probs, indices, aux = route(tokens, self.router_weight, self.topk, aux_loss_coeff=self.aux_loss_coeff,
                                    z_loss_coeff=self.z_loss_coeff)                 # [T, k] each
        flat_experts = indices.flatten()                                            # [T·k]
        perm = torch.argsort(flat_experts, stable=True)                             # pair order by expert
        permuted = tokens[perm // self.topk]                                        # [T·k, H]
        tokens_per_expert = torch.bincount(flat_experts, minlength=self.num_experts)  # [E]
        if self.ep_group is None:
            expert_out = self.experts(permuted, tokens_per_expert.tolist())
        else:
            expert_out = self._through_experts_of_the_group(permuted, tokens_per_expert)
        weighted = expert_out * probs.flatten()[perm].unsqueeze(-1)                # [T·k, H]
        out = torch.zeros_like(tokens).index_add(0, perm // self.topk, weighted)   # unpermute: [T, H]
        return out.reshape(shape), aux

    def _through_experts_of_the_group(self, permuted: torch.Tensor, tokens_per_expert: torch.Tensor):
        """Dispatch (all-to-all) -> local experts -> combine (all-to-all back). [T·k, H] -> [T·k, H]."""
        ep, L = self.ep, self.num_local_experts
        per_slice = tokens_per_expert.view(ep, L)                                   # [ep, L] by expert slice
        dest_order = [self.send_order.index(d) for d in range(ep)]                  # slice sent to rank d
        send = _reorder_chunks(permuted, per_slice.sum(1).tolist(), dest_order)
        # every rank learns how many rows it receives for each of its local experts
        counts = comm.all_to_all(per_slice[dest_order].flatten().contiguous(), self.ep_group, kind="ep",
                                 source="moe_token_counts", tag="counts").view(ep, L)  # [source, L]
        input_splits = per_slice[dest_order].sum(1).tolist()
        output_splits = counts.sum(1).tolist()
        received = all_to_all_uneven(send, self.ep_group, output_splits, input_splits, "moe_dispatch")
        by_expert_order = [s * L + l for l in range(L) for s in range(ep)]
        rows = _reorder_chunks(received, counts.flatten().tolist(), by_expert_order)  # [N, H] by local expert
        y = self.experts(rows, counts.sum(0).tolist())
        by_source_order = [l * ep + s for s in range(ep) for l in range(L)]
        y = _reorder_chunks(y, counts.t().flatten().tolist(), by_source_order)        # back to by source
        back = all_to_all_uneven(y, self.ep_group, input_splits, output_splits, "moe_combine")
        return _reorder_chunks(back, input_splits, self.send_order)                   # back to slice order


def reduce_moe_grads(module: torch.nn.Module, dp_group, expert_dp_group, divide_by: int = 1) -> None:
    """Sum gradients like Megatron's DDP with MoE: parameters marked ``allreduce = False`` (experts)
    over the expert data-parallel group, every other one over the (dense) data-parallel group; then
    divide all of them by ``divide_by`` (Megatron: the dense dp·cp size for both kinds)."""
    for p in module.parameters():
        if p.grad is None:
            continue
        expert = getattr(p, "allreduce", True) is False
        comm.all_reduce(p.grad, expert_dp_group if expert else dp_group, kind="expert_dp" if expert else "dp",
                        source="reduce_moe_grads")
        if divide_by != 1:
            p.grad.div_(divide_by)
