"""The MoE layer with expert parallelism (course_lib.moe) against one process, on 4 real ranks.

One fork launch runs EP2 and EP4 (and a deliberately misrouted EP4) on 4 gloo ranks. Each rank
has its own tokens; the reference is the single-process MoE built from the same master weights,
run on every rank's tokens. Checked: outputs, input grads and, after ``reduce_moe_grads``, every
parameter's grad equal the reference (tight tolerance); the all-to-all traffic per rank is
tokens × top-k × hidden elements each way, forward and backward; a misrouted dispatch and a
skipped (or wrong-group) expert-DP reduction are caught.
"""

from unittest import mock

import pytest
import torch

import course_lib.moe.layer as moe_layer
from course_lib.comm import CommRecorder, summarize
from course_lib.launch import launch
from course_lib.moe.layer import MoELayer, make_master_weights, reduce_moe_grads
from course_lib.moe.router import route, switch_load_balancing_loss
from course_lib.process_groups import new_moe_process_groups
from course_lib.topology import RankGrid

WORLD, TOKENS, HIDDEN, FFN, EXPERTS, TOPK = 4, 12, 8, 16, 8, 2
COEFFS = dict(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)


def rank_tokens(rank):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(TOKENS, HIDDEN, generator=g), torch.randn(TOKENS, HIDDEN, generator=g)


def grads(layer):
    return {n: p.grad.clone() for n, p in layer.named_parameters()}


def misrouted(all_to_all_uneven):
    """A dispatch that delivers rows to the wrong experts: the received rows reversed (the combine
    returns each output to the row it came from, so every token gets another token's expert output)."""
    def dispatch(x, group, output_splits, input_splits, source):
        y = all_to_all_uneven(x, group, output_splits, input_splits, source)
        return y.flip(0) if source == "moe_dispatch" else y
    return dispatch


def _run_moe_on_ranks():
    import torch.distributed as dist
    rank, master, out = dist.get_rank(), make_master_weights(HIDDEN, EXPERTS, FFN), {}
    for name, ep, wrong_route in (("ep2", 2, False), ("ep4", 4, False), ("ep4-misrouted", 4, True)):
        groups = new_moe_process_groups(RankGrid(WORLD, ep=ep), timeout=60)
        layer = MoELayer(master, moe_router_topk=TOPK, ep_group=groups.ep, **COEFFS)
        x, dy = rank_tokens(rank)
        x.requires_grad_(True)
        route_with = misrouted(moe_layer.all_to_all_uneven) if wrong_route else moe_layer.all_to_all_uneven
        with CommRecorder() as rec, mock.patch.object(moe_layer, "all_to_all_uneven", route_with):
            y, aux = layer(x)
            ((y * dy).sum() + aux).backward()
        before = grads(layer)
        reduce_moe_grads(layer, groups.dp_cp, groups.expert_dp)
        after = grads(layer)
        for p, g in zip(layer.parameters(), before.values()):  # the wrong reduction: experts over dense DP
            p.grad = g.clone()
        reduce_moe_grads(layer, groups.dp_cp, groups.dp_cp)
        out[name] = dict(y=y.detach(), aux=aux.detach(), dx=x.grad, before=before, after=after,
                         wrong_group=grads(layer), experts=layer.local_expert_indices,
                         events=rec.events)
    dist.barrier()
    return out


def reference():
    """Single-process MoE on every rank's tokens: per-rank outputs, input grads, and the grads summed."""
    layer = MoELayer(make_master_weights(HIDDEN, EXPERTS, FFN), moe_router_topk=TOPK, **COEFFS)
    per_rank = []
    for rank in range(WORLD):
        x, dy = rank_tokens(rank)
        x.requires_grad_(True)
        y, aux = layer(x)
        ((y * dy).sum() + aux).backward()  # grads accumulate: the sum over all ranks' tokens
        per_rank.append(dict(y=y.detach(), aux=aux.detach(), dx=x.grad))
    return per_rank, grads(layer)


@pytest.fixture(scope="module")
def runs():
    return launch(_run_moe_on_ranks, world_size=WORLD, backend="gloo", timeout=120, output="none"), reference()


def close(a, b):
    return torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["ep2", "ep4"])
def test_outputs_input_grads_and_every_param_grad_equal_one_process(runs, name):
    per_rank, (ref, ref_grads) = runs
    for rank in range(WORLD):
        got = per_rank[rank][name]
        assert close(got["y"], ref[rank]["y"]) and close(got["aux"], ref[rank]["aux"]), (name, rank)
        assert close(got["dx"], ref[rank]["dx"]), (name, rank)
        mine = got["experts"]
        assert close(got["after"]["router_weight"], ref_grads["router_weight"]), (name, rank)
        assert close(got["after"]["fc1"], ref_grads["fc1"][mine]), (name, rank)
        assert close(got["after"]["fc2"], ref_grads["fc2"][mine]), (name, rank)


def test_all_to_all_traffic_is_tokens_times_topk_times_hidden_each_way(runs):
    """A rank hands its own T·k rows (and their gates) to the dispatch forward and the combine backward;
    what it sends back (combine forward, dispatch backward) is what its experts got, T·k·H on average
    over the ranks. The rows for its own experts stay on it: ``sent`` counts exactly the others. The
    counts go as Megatron sends them: one all-gather of every rank's [E] counts, forward only."""
    per_rank, _ = runs
    router = make_master_weights(HIDDEN, EXPERTS, FFN)["router"]
    each_way = TOKENS * TOPK * HIDDEN
    for name, ep in (("ep2", 2), ("ep4", 4)):
        recs = [summarize(per_rank[rank][name]["events"]) for rank in range(WORLD)]
        for rank, rec in enumerate(recs):
            _, indices, _ = route(rank_tokens(rank)[0], router, TOPK)
            kept = int(torch.bincount(indices.flatten(), minlength=EXPERTS)[per_rank[rank][name]["experts"]].sum())
            assert 0 < kept < TOKENS * TOPK, (name, rank, kept)      # the check below can tell the conventions apart
            for direction, source, numel, sent in (("fwd", "moe_dispatch", each_way, each_way - kept * HIDDEN),
                                                   ("bwd", "moe_combine", each_way, each_way - kept * HIDDEN),
                                                   ("fwd", "moe_dispatch_probs", TOKENS * TOPK, TOKENS * TOPK - kept)):
                assert rec.numel(direction=direction, source=source) == numel, (name, rank, source)
                assert rec.ring_elements_sent(direction=direction, source=source) == sent, (name, rank, source)
            assert [(e.op, e.direction, e.numel) for e in rec.filter(source="moe_token_counts")] == \
                [("all_gather", "fwd", ep * EXPERTS)]
            assert rec.count(op="all_to_all") == 6                     # rows, probs, combine; each way
        for direction, source in (("fwd", "moe_combine"), ("bwd", "moe_dispatch")):
            assert sum(rec.numel(direction=direction, source=source) for rec in recs) == WORLD * each_way


def test_misrouted_tokens_and_skipped_or_misgrouped_expert_dp_reduction_are_caught(runs):
    per_rank, (ref, ref_grads) = runs
    assert not all(close(per_rank[r]["ep4-misrouted"]["y"], ref[r]["y"]) for r in range(WORLD))
    for rank in range(WORLD):  # EP2 on 4 ranks: expert DP = 2, dense DP = 4
        got = per_rank[rank]["ep2"]
        mine = got["experts"]
        assert not close(got["before"]["fc1"], ref_grads["fc1"][mine])       # reduction skipped
        assert not close(got["wrong_group"]["fc1"], ref_grads["fc1"][mine])  # experts reduced over dense DP


def test_switch_aux_loss_is_the_coefficient_when_the_load_is_uniform():
    scores = torch.full((8, 4), 0.25)
    indices = torch.tensor([[0, 1], [2, 3]] * 4)
    assert torch.isclose(switch_load_balancing_loss(scores, indices, 4, 0.01), torch.tensor(0.01))
    # all slots on expert 0, with all the score there: E times worse
    skewed = torch.zeros(8, 4)
    skewed[:, 0] = 1.0
    assert torch.isclose(switch_load_balancing_loss(skewed, torch.zeros(8, 1, dtype=torch.long), 4, 0.01),
                         torch.tensor(0.04))


def test_router_gates_sum_to_one_and_bad_topk_is_one_line():
    probs, indices, aux = route(torch.randn(5, 8), torch.randn(4, 8), 2)
    assert probs.shape == indices.shape == (5, 2) and torch.allclose(probs.sum(-1), torch.ones(5))
    assert aux.item() == 0.0
    with pytest.raises(ValueError, match=r"moe-router-topk=5 must be an integer in 1..4"):
        route(torch.randn(5, 8), torch.randn(4, 8), 5)
