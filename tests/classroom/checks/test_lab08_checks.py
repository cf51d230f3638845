"""Lab 08's checkers: tables of wrong answers, each rejected with its hint, and right answers written
differently, accepted. The dispatch runs on 4 fork ranks (one launch per answer)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from course_lib.classroom.checks import moe as moe_checks
from course_lib.moe.router import switch_load_balancing_loss
from course_lib.topology import RankGrid, rank_groups


def not_yet(*args):
    raise NotImplementedError("write it")


# ------------------------------------------------------------------ (1) expert groups


def _coords_solution(rank, layout, *, etp_key="expert_tp", fold_cp=True, ep_first=False, as_type=list):
    world, ep, pp = layout["world_size"], layout["ep"], layout["pp"]
    etp = layout[etp_key]
    cp = 1 if fold_cp else layout["cp"]
    edp = world // (etp * cp * ep * pp)
    sizes = [("ep", ep), ("tp", etp)] if ep_first else [("tp", etp), ("ep", ep)]
    sizes += [("cp", cp), ("dp", edp), ("pp", pp)]
    coord, rest = {}, rank
    for axis, n in sizes:
        coord[axis], rest = rest % n, rest // n

    def number(**change):
        c, out, stride = dict(coord, **change), 0, 1
        for axis, n in sizes:
            out, stride = out + c[axis] * stride, stride * n
        return out

    return {"ep": as_type([number(ep=i) for i in range(ep)]),
            "expert_dp": as_type([number(dp=i) for i in range(edp)])}


def right_groups(rank, layout):
    return _coords_solution(rank, layout)


def right_groups_numpy_descending(rank, layout):   # any integer type, any order of the members
    out = _coords_solution(rank, layout)
    return {k: np.array(sorted(v, reverse=True), dtype=np.int64) for k, v in out.items()}


def right_groups_tuple_tensor(rank, layout):
    out = _coords_solution(rank, layout)
    return {"ep": tuple(out["ep"]), "expert_dp": torch.tensor(out["expert_dp"])}


def ep_in_dense_grid(rank, layout):                # the pre-folding picture: dense DP divided by EP
    world, tp, pp, cp, ep = (layout[k] for k in ("world_size", "tp", "pp", "cp", "ep"))
    sizes = [("tp", tp), ("cp", cp), ("ep", ep), ("dp", world // (tp * cp * ep * pp)), ("pp", pp)]
    coord, rest = {}, rank
    for axis, n in sizes:
        coord[axis], rest = rest % n, rest // n

    def number(**change):
        c, out, stride = dict(coord, **change), 0, 1
        for axis, n in sizes:
            out, stride = out + c[axis] * stride, stride * n
        return out

    return {"ep": [number(ep=i) for i in range(ep)], "expert_dp": [number(dp=i) for i in range(dict(sizes)["dp"])]}


def dense_dp_for_expert_dp(rank, layout):          # the dense DP (with CP): same tp and pp coordinate
    out = _coords_solution(rank, layout)
    tp, world, pp = layout["tp"], layout["world_size"], layout["pp"]
    per_stage = world // pp
    stage, t = rank // per_stage, rank % tp
    return {"ep": out["ep"], "expert_dp": [stage * per_stage + j for j in range(t, per_stage, tp)]}


def course_grid(rank, layout):
    g = RankGrid(layout["world_size"], tp=layout["tp"], pp=layout["pp"], cp=layout["cp"], ep=layout["ep"],
                 expert_tp=layout["expert_tp"])
    return {"ep": g.expert_group_of(rank, "ep"), "expert_dp": g.expert_group_of(rank, "dp")}


GROUP_WRONG = [
    (not_yet, "not attempted yet"),
    (ep_in_dense_grid, "divided the dense DP by EP"),
    (lambda r, lay: _coords_solution(r, lay, fold_cp=False), "with cp = 1"),  # = the dense-grid mistake when expert_tp = tp
    (lambda r, lay: _coords_solution(r, lay, etp_key="tp"), "used the dense TP size"),
    (lambda r, lay: _coords_solution(r, lay, ep_first=True), "numbered EP fastest"),
    (dense_dp_for_expert_dp, "that is a dense group"),
    (lambda r, lay: [0], "exactly the keys 'ep' and 'expert_dp'"),
    (lambda r, lay: {"ep": [], "expert_dp": []}, "is missing"),
    (course_grid, "the course's own"),
    (lambda r, lay: ep_in_dense_grid(r, lay) if rank_groups(("tp",), {"tp": 1}, "tp") else None,
     "the course's own course_lib.topology.grid.rank_groups"),
]


@pytest.mark.parametrize("fn, hint", GROUP_WRONG)
def test_expert_groups_wrong_answers_get_their_hint(fn, hint, capsys):
    assert moe_checks.check_expert_groups_of(fn).ok is False
    out = capsys.readouterr().out
    assert hint in out, out


@pytest.mark.parametrize("fn", [right_groups, right_groups_numpy_descending, right_groups_tuple_tensor])
def test_expert_groups_right_answers_pass(fn, capsys):
    assert moe_checks.check_expert_groups_of(fn).ok is True
    assert "✓" in capsys.readouterr().out


def test_expert_layouts_are_valid_and_cover_the_mistakes():
    grids = [RankGrid(w, tp=t, pp=p, cp=c, ep=e, expert_tp=x) for w, t, p, c, e, x in moe_checks.EXPERT_LAYOUTS]
    assert any(g.cp > 1 for g in grids) and any(g.expert_tp != g.tp for g in grids) and any(g.pp > 1 for g in grids)


# ------------------------------------------------------------------ (2) dispatch


def _splits(tokens_per_expert, ep):
    return tokens_per_expert.view(ep, -1).sum(1).tolist()


def _gather_counts(tokens_per_expert, group):
    """Every rank's [E] counts, [ep, E] (Megatron's all-gather), and this rank's columns [ep, L]."""
    ep, me = dist.get_world_size(group), dist.get_rank(group)
    every = torch.empty(ep * tokens_per_expert.numel(), dtype=tokens_per_expert.dtype)
    dist.all_gather_into_tensor(every, tokens_per_expert, group=group)
    L = tokens_per_expert.numel() // ep
    return every.view(ep, -1)[:, me * L:(me + 1) * L]


def _a2a(x, output_splits, input_splits, group):
    out = x.new_empty((sum(output_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=output_splits, input_split_sizes=input_splits,
                           group=group)
    return out


def dispatch_right(rows, probs, tokens_per_expert, group):
    ep = dist.get_world_size(group)
    counts = _gather_counts(tokens_per_expert, group)
    outs, ins = counts.sum(1).tolist(), _splits(tokens_per_expert, ep)
    return _a2a(rows, outs, ins, group), _a2a(probs, outs, ins, group), counts


def dispatch_right_lists(rows, probs, tokens_per_expert, group):   # list all_gather, nested-list counts
    ep, me = dist.get_world_size(group), dist.get_rank(group)
    every = [torch.empty_like(tokens_per_expert) for _ in range(ep)]
    dist.all_gather(every, tokens_per_expert, group=group)
    L = tokens_per_expert.numel() // ep
    counts = [e[me * L:(me + 1) * L].tolist() for e in every]
    outs, ins = [sum(c) for c in counts], _splits(tokens_per_expert, ep)
    return _a2a(rows, outs, ins, group), _a2a(probs, outs, ins, group), counts


def dispatch_right_packed(rows, probs, tokens_per_expert, group):  # the gates as one more column: one all-to-all
    ep = dist.get_world_size(group)
    counts = _gather_counts(tokens_per_expert, group)
    both = _a2a(torch.cat([rows, probs.unsqueeze(1)], 1), counts.sum(1).tolist(), _splits(tokens_per_expert, ep), group)
    return both[:, :-1], both[:, -1], counts


def dispatch_counts_by_all_to_all(rows, probs, tokens_per_expert, group):   # right rows; not Megatron's counts
    ep = dist.get_world_size(group)
    counts = torch.empty_like(tokens_per_expert)
    dist.all_to_all_single(counts, tokens_per_expert, group=group)
    counts = counts.view(ep, -1)
    outs, ins = counts.sum(1).tolist(), _splits(tokens_per_expert, ep)
    return _a2a(rows, outs, ins, group), _a2a(probs, outs, ins, group), counts


def dispatch_gates_left_behind(rows, probs, tokens_per_expert, group):   # the rows go, the gates do not
    ep = dist.get_world_size(group)
    counts = _gather_counts(tokens_per_expert, group)
    received = _a2a(rows, counts.sum(1).tolist(), _splits(tokens_per_expert, ep), group)
    return received, torch.ones(received.shape[0]), counts


def dispatch_all_gather(rows, probs, tokens_per_expert, group):     # the allgather dispatcher: right rows, wrong wire
    ep, me = dist.get_world_size(group), dist.get_rank(group)
    every_count = [torch.empty_like(tokens_per_expert) for _ in range(ep)]
    dist.all_gather(every_count, tokens_per_expert, group=group)
    every_rows = [torch.empty_like(rows) for _ in range(ep)]  # every rank holds T·k rows here
    dist.all_gather(every_rows, rows, group=group)
    every_probs = [torch.empty_like(probs) for _ in range(ep)]
    dist.all_gather(every_probs, probs, group=group)
    L = tokens_per_expert.numel() // ep
    mine, gates, counts = [], [], []
    for c, r, p in zip(every_count, every_rows, every_probs):
        start, n = int(c[:me * L].sum()), int(c[me * L:(me + 1) * L].sum())
        mine.append(r[start:start + n])
        gates.append(p[start:start + n])
        counts.append(c[me * L:(me + 1) * L])
    return torch.cat(mine), torch.cat(gates), torch.stack(counts)


def dispatch_everything(rows, probs, tokens_per_expert, group):     # every rank sends all its rows to every rank
    ep = dist.get_world_size(group)
    _gather_counts(tokens_per_expert, group)
    received = rows.new_empty(ep * rows.shape[0], rows.shape[1])
    dist.all_to_all_single(received, rows.repeat(ep, 1), group=group)
    return received, probs.repeat(ep), torch.zeros(ep, tokens_per_expert.numel() // ep, dtype=torch.long)


def dispatch_wrong_counts(rows, probs, tokens_per_expert, group):   # right rows, my own counts returned
    received, gates, _ = dispatch_right(rows, probs, tokens_per_expert, group)
    ep = dist.get_world_size(group)
    return received, gates, tokens_per_expert.view(ep, -1)


def dispatch_no_counts_exchange(rows, probs, tokens_per_expert, group):   # expects back what it sends: aborts
    ep = dist.get_world_size(group)
    splits = _splits(tokens_per_expert, ep)
    received = rows.new_empty(rows.shape[0], rows.shape[1])
    dist.all_to_all_single(received, rows, output_split_sizes=splits, input_split_sizes=splits, group=group)
    return received, probs, tokens_per_expert.view(ep, -1)


def dispatch_list_form(rows, probs, tokens_per_expert, group):            # gloo's list form: equal sizes only
    ep = dist.get_world_size(group)
    counts = _gather_counts(tokens_per_expert, group)
    outs = [rows.new_empty(int(c), rows.shape[1]) for c in counts.sum(1)]
    dist.all_to_all(outs, list(rows.split(_splits(tokens_per_expert, ep))), group=group)
    return torch.cat(outs), probs, counts


def dispatch_rebuilt_from_seeds(rows, probs, tokens_per_expert, group):   # the peers' rows rebuilt, dummy traffic
    from course_lib.moe.layer import make_master_weights
    from course_lib.moe.router import route

    ep, me = dist.get_world_size(group), dist.get_rank(group)
    members = dist.get_process_group_ranks(group)
    L = tokens_per_expert.numel() // ep
    router = make_master_weights(8, 8, 16, seed=8)["router"]
    mine, gates, counts = [], [], []
    for src in members:
        x = torch.randn(12, 8, generator=torch.Generator().manual_seed(100 + src))
        p, idx, _ = route(x, router, 2)
        tpe = torch.bincount(idx.flatten(), minlength=8)
        perm = torch.argsort(idx.flatten(), stable=True)
        start, n = int(tpe[:me * L].sum()), int(tpe[me * L:(me + 1) * L].sum())
        mine.append(x[perm // 2][start:start + n])
        gates.append(p.flatten()[perm][start:start + n])
        counts.append(tpe[me * L:(me + 1) * L])
    _gather_counts(tokens_per_expert, group)
    dummy = torch.empty_like(rows)
    dist.all_to_all_single(dummy, torch.zeros_like(rows), group=group) if rows.shape[0] % ep == 0 else None
    return torch.cat(mine), torch.cat(gates), torch.stack(counts)


def dispatch_via_course_all_to_all(rows, probs, tokens_per_expert, group):
    from course_lib.moe.mappings import all_to_all_uneven

    ep = dist.get_world_size(group)
    counts = _gather_counts(tokens_per_expert, group)
    outs, ins = counts.sum(1).tolist(), _splits(tokens_per_expert, ep)
    return all_to_all_uneven(rows, group, outs, ins), all_to_all_uneven(probs, group, outs, ins), counts


def dispatch_via_course_plan(rows, probs, tokens_per_expert, group):     # the course's split bookkeeping
    from course_lib.moe.alltoall_plan import plan_alltoall

    ep, me = dist.get_world_size(group), dist.get_rank(group)
    L = tokens_per_expert.numel() // ep
    plan = plan_alltoall(tokens_per_expert, group, ep, 1, 0, me * L)
    return (_a2a(rows, plan.output_splits, plan.input_splits, group),
            _a2a(probs, plan.output_splits, plan.input_splits, group), torch.tensor(plan.chunk_sizes).view(ep, L))


DISPATCH_WRONG = [
    (dispatch_no_counts_exchange, "all-gather every rank's tokens_per_expert"),
    (dispatch_list_form, "equal-sized tensors only"),
    (dispatch_rebuilt_from_seeds, "received"),
    (dispatch_via_course_all_to_all, "the course's own course_lib.moe.mappings.all_to_all_uneven"),
    (dispatch_via_course_plan, "course_lib.moe.alltoall_plan.plan_alltoall"),
    (not_yet, "not attempted yet"),
    (dispatch_all_gather, "allgather dispatcher"),
    (dispatch_everything, "you received every row of every rank"),
    (dispatch_wrong_counts, "counts[s][l] = rows that source rank s sent"),
    (dispatch_counts_by_all_to_all, "all-gathers every rank's whole tokens_per_expert"),
    (dispatch_gates_left_behind, "sends each row's gate value with it"),
    (lambda rows, probs, tpe, group: (rows, tpe), "must return (received, received_probs, counts)"),
]


@pytest.mark.parametrize("fn, hint", DISPATCH_WRONG)
def test_dispatch_wrong_answers_get_their_hint(fn, hint, capsys):
    assert moe_checks.check_dispatch(fn).ok is False
    out = capsys.readouterr().out
    assert hint in out, out


@pytest.mark.parametrize("fn", [dispatch_right, dispatch_right_lists, dispatch_right_packed])
def test_dispatch_right_answers_pass(fn, capsys):
    assert moe_checks.check_dispatch(fn).ok is True
    out = capsys.readouterr().out
    assert "✓" in out and "192 row elements and 24 gates" in out, out


# ------------------------------------------------------------------ (3) aux loss


def _f_p(scores, indices, E):
    T, k = indices.shape
    return torch.bincount(indices.flatten(), minlength=E).to(scores.dtype) / (T * k), scores.mean(0)


def aux_right(scores, indices, E, coeff):
    f, p = _f_p(scores, indices, E)
    return coeff * E * (f * p).sum()


def aux_right_float32_loop(scores, indices, E, coeff):     # a loop, float32 counts: same value and gradient
    T, k = indices.shape
    total = 0
    for i in range(E):
        f_i = float((indices == i).sum()) / (T * k)
        total = total + f_i * scores[:, i].mean()
    return total * E * coeff


def aux_unique_counts(scores, indices, E, coeff):
    """Counts by torch.unique: an expert with no slot is left out, so f is shorter than P."""
    T, k = indices.shape
    f = torch.unique(indices.flatten(), return_counts=True)[1].to(scores.dtype) / (T * k)
    return coeff * E * (f * scores.mean(0)).sum()


def aux_bincount_no_minlength(scores, indices, E, coeff):
    """A bincount without minlength: short when the last expert has no slot."""
    T, k = indices.shape
    return coeff * E * (torch.bincount(indices.flatten()).to(scores.dtype) / (T * k) * scores.mean(0)).sum()


def aux_counts_packed(scores, indices, E, coeff):
    """The counts of the experts seen, padded with zeros at the end: right only when the unrouted expert is last."""
    T, k = indices.shape
    counts = torch.unique(indices.flatten(), return_counts=True)[1].to(scores.dtype)
    f = torch.zeros(E, dtype=scores.dtype)
    f[:len(counts)] = counts / (T * k)
    return coeff * E * (f * scores.mean(0)).sum()


UNROUTED = "an expert that receives no routing slot still has its f_i (= 0)"

AUX_WRONG = [
    (aux_unique_counts, UNROUTED),
    (aux_bincount_no_minlength, UNROUTED),
    (aux_counts_packed, UNROUTED),
    (not_yet, "not attempted yet"),
    (lambda s, i, E, c: c * (lambda f, p: (f * p).sum())(*_f_p(s, i, E)), "forgot the factor E"),
    (lambda s, i, E, c: c * E * (s.mean(0) ** 2).sum(), "mean probabilities P_i where the fractions f_i belong"),
    (lambda s, i, E, c: c * E * (_f_p(s, i, E)[0] ** 2).sum(), "you used f_i twice"),
    (lambda s, i, E, c: aux_right(s, i, E, c) * i.shape[1], "divides by T·k (all routing slots), not by T"),
    (lambda s, i, E, c: aux_right(s, i, E, c) / c, "forgot to multiply by coeff"),
    (lambda s, i, E, c: aux_right(s.detach(), i, E, c), "no gradient"),
    (lambda s, i, E, c: aux_right(s, i, E, c).item(), "return a scalar tensor"),
    (switch_load_balancing_loss, "the course's own"),
]


@pytest.mark.parametrize("fn, hint", AUX_WRONG)
def test_aux_loss_wrong_answers_get_their_hint(fn, hint, capsys):
    assert moe_checks.check_aux_loss(fn).ok is False
    out = capsys.readouterr().out
    assert hint in out, out


def test_every_run_has_an_unrouted_expert_last_and_between(monkeypatch):
    """Counts that leave out an expert with no slot differ from the rule only where one has none: every run's cases
    (8 seeds) have one case whose last expert and one whose expert between the first and the last get no slot."""
    import random

    for seed in range(8):
        monkeypatch.setattr(moe_checks, "drawn_rng", lambda seed=seed: random.Random(seed))
        unrouted = [torch.bincount(i.flatten(), minlength=E) == 0 for _, i, E, _ in moe_checks._aux_cases()]
        assert any(bool(z[-1]) for z in unrouted), seed
        assert any(bool(z[1:-1].any()) and not bool(z[-1]) for z in unrouted), seed
    first = [i for _, i, _, _ in moe_checks._aux_cases()]            # seed 7's
    monkeypatch.setattr(moe_checks, "drawn_rng", lambda: random.Random(8))
    assert all(not torch.equal(a, b) for a, (_, b, _, _) in zip(first, moe_checks._aux_cases()))   # drawn


@pytest.mark.parametrize("fn", [aux_right, aux_right_float32_loop])
def test_aux_loss_right_answers_pass(fn, capsys):
    assert moe_checks.check_aux_loss(fn).ok is True
    assert "✓" in capsys.readouterr().out


# ------------------------------------------------------------------ the lab's pictures (course_lib.moe.plots)


def test_rank_map_table_and_figures():
    import matplotlib
    matplotlib.use("Agg")
    from course_lib.moe.plots import group_index_table, plot_tokens_per_expert, plot_two_grids, tokens_per_expert

    grid = RankGrid(8, tp=2, pp=2, ep=2, expert_tp=1)
    table = dict(group_index_table(grid))
    assert table["dense DP (with CP)"] == [0, 1, 0, 1, 2, 3, 2, 3]    # dense DP [0, 2], [1, 3], ...
    assert table["EP (all-to-all)"] == [0, 0, 1, 1, 2, 2, 3, 3]       # EP [0, 1], [2, 3], ...
    assert table["PP"] == [0, 1, 2, 3, 0, 1, 2, 3]
    counts = tokens_per_expert([torch.tensor([[0, 1], [0, 3]]), torch.tensor([[2, 0]])], 4)
    assert counts == [[2, 1, 0, 1], [1, 0, 1, 0]]
    assert plot_two_grids(grid).axes and len(plot_tokens_per_expert({"a": counts, "b": counts}, ep=2).axes) == 2


def test_moe_timeline_phase_order_and_drawing():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from course_lib.moe.plots import MOE_PHASES, phase_order, plot_moe_timeline

    def span(rank, kind, start, end):
        return {"rank": rank, "name": kind, "kind": kind, "start": start, "end": end}

    # listed out of order, one span still open: the order is by start time, open spans skipped
    tl = [span(0, "combine", 0.004, 0.005), span(0, "route", 0.0, 0.001), span(0, "experts", 0.002, 0.004),
          span(0, "dispatch", 0.001, 0.002), span(0, "forward", 0.0, 0.005), span(0, "backward", 0.006, None)]
    assert [k for k in phase_order(tl) if k in MOE_PHASES] == ["route", "dispatch", "experts", "combine"]
    assert "backward" not in phase_order(tl)
    tl = [e for e in tl if e["kind"] != "forward"]  # a pass-wide span would hide the phases in its lane
    ax = plot_moe_timeline([tl, [dict(e, rank=1) for e in tl]], title="EP2")
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0 compute", "rank 0 comm", "rank 1 compute",
                                                           "rank 1 comm"]
    assert len(ax.patches) == 2 * 4  # four closed spans per rank
    # route, experts | combine, dispatch (ms, in the listed order)
    assert [round(p.get_width(), 6) for p in ax.patches[:4]] == [1.0, 2.0, 1.0, 1.0]
    assert [p.get_y() + p.get_height() / 2 for p in ax.patches[:4]] == [0, 0, 1, 1]
    plt.close(ax.figure)
