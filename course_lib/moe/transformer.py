"""MoE layers inside the course GPT: the router, the experts and the two token dispatchers.

A transformer layer whose MLP is a Mixture of Experts (Megatron: ``megatron/core/transformer/moe/
moe_layer.py`` ``MoELayer``, ``router.py`` ``TopKRouter``, ``experts.py``, ``token_dispatcher.py``).
:class:`MoEMLP` takes the place of the dense MLP of the layers that ``--moe-layer-freq`` selects
(:func:`moe_layer_pattern`); the same class with ``groups=None`` is the single-process MoE of the
reference model, so every layout starts from the same master numbers.

Parameters (``E`` experts, ``L = E / ep`` on this rank, ``F`` = ``--moe-ffn-hidden-size``):

* ``router.weight`` ``[E, H]`` and, unless ``--disable-bias-linear``, ``router.bias`` ``[E]`` -- replicated;
  under sequence parallelism they see only this rank's tokens, so they carry ``sequence_parallel = True``
  (their gradient is summed over TP, as Megatron's ``Router.reset_parameters`` marks them). Megatron draws
  the bias with the weights' ``init_method`` (``N(0, σ²)``, not zero), right after the weight;
* ``experts.linear_fc1.weight`` ``[L, F/etp, H]`` and ``experts.linear_fc2.weight`` ``[L, H, F/etp]``
  -- the rank's experts stacked (Megatron's GroupedMLP keeps them stacked too), split over the expert
  tensor-parallel group along F (fc1 column-parallel, fc2 row-parallel); unless ``--disable-bias-linear``,
  ``experts.linear_fc1.bias`` ``[L, F/etp]`` and ``experts.linear_fc2.bias`` ``[L, H]`` (zero at start, as
  Megatron's linears). An expert computes ``(gelu(x W1^T + b1) · p) W2^T + b2 · p`` (Megatron's ``MLP.forward``
  with ``per_token_scale``: the fc2 bias is scaled by the gate too). Biases need expert TP 1
  (:func:`course_lib.rules.moe_bias_with_expert_tp`, megatron-core's own assertion). Expert parameters carry
  ``allreduce = False`` (Megatron's mark): their gradients are reduced over the **expert** data-parallel
  group, not DP.

The route of a token (``T`` = this rank's tokens, ``k`` = top-k):

* ``--moe-token-dispatcher-type alltoall`` (``MoEAlltoAllTokenDispatcher``): every rank of the
  expert tp-ep group all-gathers everybody's ``[E]`` counts and reads its splits off them
  (:mod:`course_lib.moe.alltoall_plan`); the ``T·k`` rows sorted by expert, and their gate values
  beside them, go to the EP rank that holds their expert by uneven all-to-alls over the EP group;
  with expert TP > 1 the received rows and gates are all-gathered over the expert-TP group (every
  TP shard of an expert needs all its rows), each shard computes its part (the gate scaling the
  activation), a reduce-scatter sums the parts back, and the mirror all-to-all returns the outputs.
  Each all-to-all takes ``T·k·H`` elements per rank per pass; the rows for the rank's own experts
  (≈ 1/ep) stay on it, the recorder's ``sent``.
* ``--moe-token-dispatcher-type allgather`` (``MoEAllGatherTokenDispatcher``): every rank of the
  tp-ep group all-gathers everybody's tokens and gates, runs its experts on the rows routed to them,
  and a reduce-scatter over tp-ep sums the outputs back to their owners: ``(n-1)·T·H`` elements in,
  whatever ``k`` is -- the contrast the lab measures.

Sequence parallelism: the tokens of a layer are already split over TP (``[s/t, b, h]``), so the MoE
layer needs no gather of its own; the aux-loss statistics (tokens per expert) are summed over the
dense tp-cp group (Megatron's ``tp_cp_group``). Megatron trains MoE with TP > 1 only under sequence
parallelism (``MoELayer.forward`` raises in training otherwise, ``megatron/core/transformer/moe/moe_layer.py``;
the config merely warns, with EP > 1): :func:`course_lib.rules.moe_sequence_parallel`.

The auxiliary losses do not change the output: like Megatron's ``MoEAuxLossAutoScaler`` they are
attached to it, and backward adds ``aux_loss_scale`` (``1 / micro-batches``, set by the training
loop) times their gradient. Their values (coefficient divided out) are summed per layer in
``metrics`` for :func:`track_moe_metrics`, which logs them like Megatron's ``track_moe_metrics``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from course_lib import comm, rules
from course_lib.moe.alltoall_plan import plan_alltoall
from course_lib.moe.mappings import all_gather_uneven, all_to_all_uneven, reduce_scatter_uneven
from course_lib.moe.pattern import moe_layer_pattern
from course_lib.moe.router import route

__all__ = ["MoEMLP", "track_moe_metrics", "set_aux_loss_scale", "moe_modules"]


class _Stacked(nn.Module):
    """One stacked expert linear: ``.weight`` and, when given, ``.bias`` (names read
    ``experts.linear_fc1.weight``). ``partition_dim``: the weight's dim split over expert TP; the bias's
    is ``partition_dim`` too for fc1 (``[L, F/etp]``) and None for fc2 (``[L, H]``, whole)."""

    def __init__(self, weight: torch.Tensor, partition_dim: int, bias: torch.Tensor | None = None,
                 bias_partition_dim: int | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight)
        self.weight.expert_partition_dim = partition_dim
        self.bias = None if bias is None else nn.Parameter(bias)
        if self.bias is not None:
            self.bias.expert_partition_dim = bias_partition_dim
        for p in self.parameters():
            p.allreduce = False                        # Megatron: reduced over expert DP, not DP


class _Experts(nn.Module):
    def __init__(self, fc1: torch.Tensor, fc2: torch.Tensor, b1: torch.Tensor | None, b2: torch.Tensor | None):
        super().__init__()
        self.linear_fc1 = _Stacked(fc1, 1, b1, 1)      # [L, F/etp, H], [L, F/etp]  column-parallel over expert TP
        self.linear_fc2 = _Stacked(fc2, 2, b2, None)   # [L, H, F/etp], [L, H]      row-parallel over expert TP

    def forward(self, rows: torch.Tensor, probs: torch.Tensor, chunk_sizes: list[int],
                chunk_experts: list[int]) -> torch.Tensor:
        """Chunk ``c`` of ``rows`` ([N, H], chunks of ``chunk_sizes``) through local expert
        ``chunk_experts[c]``, each row's gate value ``probs`` [N] scaling the activation and the fc2 bias
        (Megatron's ``per_token_scale``, ``megatron/core/transformer/mlp.py``):
        ``(gelu(x W1^T + b1) · p) W2^T + b2 · p`` -> [N, H] (a partial sum when expert TP > 1, no biases then)."""
        w1, w2 = self.linear_fc1.weight, self.linear_fc2.weight
        b1, b2 = self.linear_fc1.bias, self.linear_fc2.bias
        sizes = [int(n) for n in chunk_sizes]
        outs = []
        for chunk, p, e in zip(torch.split(rows, sizes), torch.split(probs, sizes), chunk_experts):
            p = p.unsqueeze(-1)                                                      # [n, 1]
            y = (F.gelu(F.linear(chunk, w1[e], None if b1 is None else b1[e])) * p) @ w2[e].t()
            outs.append(y if b2 is None else y + b2[e] * p)
        return torch.cat(outs) if outs else rows[:0]


class _AttachAuxLoss(torch.autograd.Function):
    """Megatron's ``MoEAuxLossAutoScaler``: forward returns ``output``; backward also sends ``scale``
    as the gradient of ``aux`` (so the aux loss trains the router without entering the LM loss)."""

    @staticmethod
    def forward(ctx, output, aux, scale: float):
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (aux,) = ctx.saved_tensors
        return grad_output, torch.full_like(aux, ctx.scale), None


class MoEMLP(nn.Module):
    """The MoE MLP of one transformer layer on this rank. ``forward(x [s, b, h]) -> [s, b, h]``
    (``[s/t, b, h]`` under sequence parallelism; the aux losses ride along, see the module doc).

    Args:
        config: a :class:`course_lib.model.GPTConfig` with ``num_experts`` set.
        layer_number: 1-based (the metrics' row).
        groups: :class:`~course_lib.process_groups.MoEGroups`, or ``None`` for the single-process MoE
            (every expert local).
        init: draw the master weights from the global generator (the reference model), else the
            values are placeholders for :meth:`load_from_master`.
    """

    def __init__(self, config, layer_number: int, groups=None, init: bool = False):
        super().__init__()
        self.config, self.layer_number, self.groups = config, layer_number, groups
        E, H, Fh = config.num_experts, config.hidden_size, config.moe_ffn_hidden_size
        self.ep = 1 if groups is None else groups.size("ep")
        self.etp = 1 if groups is None else groups.size("expert_tp")
        rules.moe_experts(E, self.ep)
        rules.moe_ffn_divisible_by_expert_tp(Fh, self.etp)
        rules.moe_bias_with_expert_tp(E, config.add_bias_linear, self.etp)
        self.num_local_experts = E // self.ep
        ep_rank = 0 if groups is None else comm.group_rank(groups.ep)
        self.local_expert_indices = list(range(ep_rank * self.num_local_experts,
                                               (ep_rank + 1) * self.num_local_experts))
        self.topk = rules.integer("moe-router-topk", config.moe_router_topk, maximum=E)
        self.dispatcher = rules.moe_dispatcher(config.moe_token_dispatcher_type)
        self.aux_loss_scale = 1.0
        tcfg = config.transformer_config()
        bias = config.add_bias_linear
        router, router_bias = torch.empty(E, H), torch.empty(E) if bias else None
        fc1 = torch.empty(E, Fh, H)
        fc2 = torch.empty(E, H, Fh)
        if init:             # Megatron: router weight then bias with init_method, fc1 init_method, fc2 scaled
            tcfg.init_method(router)
            if bias:
                tcfg.init_method(router_bias)
            tcfg.init_method(fc1)
            tcfg.output_layer_init_method(fc2)
        self.router = nn.Module()
        self.router.weight = nn.Parameter(router)
        self.router.bias = None if router_bias is None else nn.Parameter(router_bias)
        L, local = self.num_local_experts, slice(self.local_expert_indices[0], self.local_expert_indices[-1] + 1)
        self.experts = _Experts(fc1[local].chunk(self.etp, 1)[0].clone(), fc2[local].chunk(self.etp, 2)[0].clone(),
                                torch.zeros(L, Fh // self.etp) if bias else None, torch.zeros(L, H) if bias else None)
        self.metrics: dict[str, torch.Tensor] = {}

    # -------------------------------------------------------------------------------------- weights
    def mark_sequence_parallel(self) -> None:
        """The router sees this rank's ``s/t`` tokens only: its gradients are partial sums over TP."""
        for p in self.router.parameters():
            p.sequence_parallel = True

    @torch.no_grad()
    def load_from_master(self, master: "MoEMLP") -> None:
        """Copy this rank's slice of the single-process MoE ``master``: the router whole, experts
        ``local_expert_indices``, expert-TP shard ``expert_tp_rank`` along each tensor's
        ``expert_partition_dim`` (None: whole)."""
        r = 0 if self.groups is None else comm.group_rank(self.groups.expert_tp)
        local = slice(self.local_expert_indices[0], self.local_expert_indices[-1] + 1)
        for mine, full in zip(self.router.parameters(), master.router.parameters()):
            mine.copy_(full)
        for mine, full in zip(self.experts.parameters(), master.experts.parameters()):
            dim = mine.expert_partition_dim
            mine.copy_(full[local] if dim is None else full[local].chunk(self.etp, dim)[r])

    def full_expert_tensor(self, value: torch.Tensor, partition_dim: int | None) -> torch.Tensor:
        """All experts, unsplit: gather ``value`` (an expert weight or grad of this rank) over expert TP
        along ``partition_dim`` (None: not split), then over EP along dim 0. Collective over both groups."""
        if self.groups is None:
            return value.detach().clone()
        value = value.detach().contiguous()
        if partition_dim is not None:
            value = comm.all_gather(value, self.groups.expert_tp, dim=partition_dim, kind="expert_tp",
                                    source="gather_full_parameters")
        return comm.all_gather(value, self.groups.ep, dim=0, kind="ep", source="gather_full_parameters").clone()

    # -------------------------------------------------------------------------------------- forward
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        tokens = hidden_states.reshape(-1, shape[-1])                                  # [T, H]
        parts: dict = {}
        partition = None if self.groups is None or self.groups.size("tp_cp") == 1 else self.groups.tp_cp
        probs, indices, aux = route(tokens, self.router.weight, self.topk, bias=self.router.bias,
                                    aux_loss_coeff=self.config.moe_aux_loss_coeff,
                                    z_loss_coeff=self.config.moe_z_loss_coeff,
                                    sequence_partition_group=partition, parts=parts)   # [T, k], [T, k], []
        self._record(parts)
        self.tokens_per_expert = torch.bincount(indices.flatten(), minlength=self.config.num_experts)  # [E], this rank
        if self.dispatcher == "allgather" and self.groups is not None and self.groups.size("tp_ep") > 1:
            out = self._allgather(tokens, probs, indices)
        else:
            out = self._alltoall(tokens, probs, indices)
        if aux.requires_grad:
            out = _AttachAuxLoss.apply(out, aux, self.aux_loss_scale)
        return out.reshape(shape)

    def _record(self, parts: dict) -> None:
        coeffs = {"load_balancing_loss": self.config.moe_aux_loss_coeff, "z_loss": self.config.moe_z_loss_coeff}
        for name, value in parts.items():   # this rank's share: the shares add up over tp-cp
            self.metrics[name] = self.metrics.get(name, 0.0) + value.detach() / coeffs[name]

    def _alltoall(self, tokens, probs, indices):
        """Megatron's alltoall dispatcher: permute -> all-gather of the counts over tp-ep -> all-to-all of
        rows and probs over EP -> (all-gather over expert TP) -> experts -> mirror -> unpermute."""
        E, ep, k = self.config.num_experts, self.ep, self.topk
        flat = indices.flatten()                                                       # [T·k]
        perm = torch.argsort(flat, stable=True)
        rows, row_probs = tokens[perm // k], probs.flatten()[perm]                     # [T·k, H], [T·k] by expert
        etp_rank = 0 if self.groups is None else comm.group_rank(self.groups.expert_tp)
        plan = plan_alltoall(torch.bincount(flat, minlength=E), None if self.groups is None else self.groups.tp_ep,
                             ep, self.etp, etp_rank, self.local_expert_indices[0])
        if ep > 1:                                                                     # slice j -> EP rank j
            rows = all_to_all_uneven(rows, self.groups.ep, plan.output_splits, plan.input_splits, "moe_dispatch")
            row_probs = all_to_all_uneven(row_probs, self.groups.ep, plan.output_splits, plan.input_splits,
                                          "moe_dispatch_probs")
        if self.etp > 1:             # every TP shard of an expert needs all its rows (Megatron: output_splits_tp)
            rows = all_gather_uneven(rows, self.groups.expert_tp, plan.output_splits_tp)
            row_probs = all_gather_uneven(row_probs, self.groups.expert_tp, plan.output_splits_tp)
        y = self.experts(rows, row_probs, plan.chunk_sizes, plan.chunk_experts)        # [N, H], partial over etp
        if self.etp > 1:
            y = reduce_scatter_uneven(y, self.groups.expert_tp, plan.output_splits_tp)
        if ep > 1:
            y = all_to_all_uneven(y, self.groups.ep, plan.input_splits, plan.output_splits, "moe_combine")
        # under autocast the expert GEMMs are 16-bit: unpermute in the residual stream's dtype
        return torch.zeros_like(tokens).index_add(0, perm // k, y.to(tokens.dtype))    # [T, H]

    def _allgather(self, tokens, probs, indices):
        """Megatron's allgather dispatcher: gather every token and gate of the tp-ep group, run the local
        experts on the rows routed to them, reduce-scatter the (partial) outputs back to their owners."""
        from course_lib.tensor_parallel import (gather_from_sequence_parallel_region,
                                                reduce_scatter_to_sequence_parallel_region)

        group, L, k = self.groups.tp_ep, self.num_local_experts, self.topk
        every_token = gather_from_sequence_parallel_region(tokens, group, kind="ep")   # [n·T, H]
        every_prob = gather_from_sequence_parallel_region(probs, group, kind="ep")     # [n·T, k]
        every_index = comm.all_gather(indices.contiguous(), group, kind="ep", source="moe_allgather_indices")
        local = every_index.flatten() - self.local_expert_indices[0]                   # [n·T·k]
        mine = ((local >= 0) & (local < L)).nonzero().flatten()
        order = mine[torch.argsort(local[mine], stable=True)]                           # my pairs by expert
        sizes = torch.bincount(local[order], minlength=L).tolist()
        y = self.experts(every_token[order // k], every_prob.flatten()[order], sizes, list(range(L)))  # [n_mine, H]
        out = torch.zeros_like(every_token).index_add(0, order // k, y.to(every_token.dtype))  # [n·T, H]
        return reduce_scatter_to_sequence_parallel_region(out, group, kind="ep")       # [T, H]


def moe_modules(chunks) -> list[MoEMLP]:
    """Every :class:`MoEMLP` of this rank's model chunks, in layer order."""
    return [m for chunk in chunks for m in chunk.modules() if isinstance(m, MoEMLP)]


def set_aux_loss_scale(chunks, scale: float) -> None:
    """The gradient the aux losses send back, per micro-batch (Megatron: ``MoEAuxLossAutoScaler.
    set_loss_scale(loss_scale / num_microbatches)`` in ``forward_step``)."""
    for m in moe_modules(chunks):
        m.aux_loss_scale = float(scale)


@torch.no_grad()
def track_moe_metrics(chunks, moe_groups=None, num_microbatches: int = 1) -> tuple[dict, str]:
    """Reduce and clear the per-layer aux-loss values like Megatron's ``track_moe_metrics``
    (``megatron/core/transformer/moe/moe_logging.py``, ``MoEMetricsTracker.report``): per layer, sum
    over the pipeline stages and over the tp-cp group (each rank's value is its share), average over
    data parallel, then the mean over the MoE layers, times ``1 / num_microbatches``. Collective over
    PP, tp-cp and dp-cp: every rank calls it. Returns ``({name: value}, " load_balancing_loss:
    1.000000E+00 |")`` -- the piece Megatron appends to the iteration line. ``moe_groups=None``: one
    process holds the whole model (the single-process reference), nothing to reduce."""
    config, device = chunks[0].config, next(chunks[0].parameters()).device
    pattern = moe_layer_pattern(config.num_layers, config.moe_layer_freq)
    names = ("load_balancing_loss",) * bool(config.moe_aux_loss_coeff) + ("z_loss",) * bool(config.moe_z_loss_coeff)
    out = {}
    for name in names:
        values = torch.zeros(config.num_layers, dtype=torch.float64, device=device)   # NCCL reduces on the GPU
        for m in moe_modules(chunks):
            values[m.layer_number - 1] += float(m.metrics.pop(name, 0.0))
        reductions = () if moe_groups is None else \
            ((moe_groups.pp, "sum"), (moe_groups.tp_cp, "sum"), (moe_groups.dp_cp, "avg"))
        for group, op in reductions:
            if comm.group_size(group) > 1:
                n = comm.group_size(group)
                comm.all_reduce(values, group, kind="dp" if op == "avg" else "tp", source="track_moe_metrics")
                if op == "avg":
                    values /= n
        out[name] = float(values.sum()) / sum(pattern) / num_microbatches
    return out, "".join(f" {name}: {value:.6E} |" for name, value in out.items())
