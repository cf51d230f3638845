"""Checkers for Mixture of Experts (Lab 08): the expert groups, the all-to-all dispatch, the aux loss.

Each checker runs the student's function on many settings, compares with an
independent reference (:class:`course_lib.topology.RankGrid`'s expert grid, the single-process
:class:`course_lib.moe.layer.MoELayer`, :func:`course_lib.moe.router.switch_load_balancing_loss`),
prints one verdict line and, when wrong, the most specific hint it can find. A
function that still raises ``NotImplementedError`` gets a "not attempted yet" line;
every checker returns True/False and never raises.

The dispatch is checked on 4 real ranks (two EP layouts) with tokens each rank draws from
``os.urandom`` (no rank can rebuild another's rows): by result (the rows, their gate values and the
counts each rank receives, against the checker's own exchange run after the student's; then the
whole layer -- experts and combine -- against one process) and by what crossed the wire (a checked
process group records every op and what it carried): as in Megatron's ``MoEAlltoAllTokenDispatcher``,
every rank's whole ``[E]`` counts go by one all-gather, and this rank's rows and gates, cut per
destination, by all-to-all, ``tokens × top-k × (hidden + 1)`` elements per rank; no token is
all-gathered. An all-to-all whose ``output_split_sizes`` do not match what the peers send is stopped
before gloo aborts the rank, with a hint about the counts.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.classroom.checks import is_course_answer, not_attempted, raised_line
from course_lib.classroom.checks.exercise import exercise
from course_lib.classroom.checks.references import references_for
from course_lib.classroom.checks.student_process import student_on_rank
from course_lib.classroom.checks.tamper_guard import course_code_hint, run_student
from course_lib.classroom.checks.verdicts import (carried_by, describe_ops, drawn_rng, launch_checked, safe_repr,
                                                  same_payload, secret_generator, split_problem)
from course_lib.launch import LaunchTimeout, RankError
from course_lib.moe.layer import MoELayer, make_master_weights
from course_lib.moe.mappings import reorder_chunks
from course_lib.moe.router import route, switch_load_balancing_loss
from course_lib.rules import expert_data_parallel_size
from course_lib.topology import DEFAULT_ORDER, RankGrid, parse_order, rank_groups

__all__ = ["check_expert_groups_of", "check_dispatch", "check_aux_loss", "EXPERT_LAYOUTS", "layout_of",
           "dispatch_inputs"]

# (world, tp, pp, cp, ep, expert_tp): folded CP, expert TP != TP, PP > 1, EP = world. The first has CP 2 and
# expert TP = TP, so "EP inside the dense grid" fails there first, with its own hint.
EXPERT_LAYOUTS = ((8, 2, 1, 2, 2, 2), (8, 2, 2, 1, 2, 1), (8, 1, 1, 2, 4, 1), (16, 2, 2, 1, 4, 1),
                  (16, 2, 1, 2, 2, 2), (8, 1, 2, 1, 2, 1), (4, 1, 1, 1, 4, 1), (16, 4, 1, 1, 2, 1))
KEYS = ("ep", "expert_dp")


def drawn_expert_layouts(rng, count: int = 2) -> list:
    """``count`` layouts shaped like :data:`EXPERT_LAYOUTS` drawn for this run (EP > 1, a grid Megatron accepts)."""
    out = []
    while len(out) < count:
        tp, pp, cp, dp = rng.choice((1, 2, 4)), rng.choice((1, 2)), rng.choice((1, 2)), rng.choice((1, 2, 4))
        world, ep, etp = tp * pp * cp * dp, rng.choice((2, 4, 8)), rng.choice((1, 2, 4))
        try:   # the grid refuses a world that expert TP x EP x PP does not divide
            RankGrid(world, tp=tp, pp=pp, cp=cp, ep=ep, expert_tp=etp)
        except ValueError:
            continue
        out.append((world, tp, pp, cp, ep, etp))
    return out


def layout_of(world, tp, pp, cp, ep, expert_tp) -> dict:
    return dict(world_size=world, tp=tp, pp=pp, cp=cp, ep=ep, expert_tp=expert_tp)


def _int_list(value):
    """A list of Python ints (from a list/tuple/tensor/array of integers), or None."""
    try:
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        if hasattr(value, "tolist") and not isinstance(value, (list, tuple)):
            value = value.tolist()
        if not isinstance(value, (list, tuple, range)):
            return None
        out = []
        for v in value:
            if isinstance(v, bool) or int(v) != v:
                return None
            out.append(int(v))
        return out
    except Exception:  # noqa: BLE001 - an odd answer is a wrong answer
        return None


# ------------------------------------------------------------------ (1) expert groups


def _grid_dp(world, inner, ep, pp):
    """The DP size of an expert-style grid whose axes faster than EP multiply to ``inner`` (a picture of
    the expert grid, maybe a mistaken one: the dense TP, or a CP axis kept), or None where the sizes do
    not divide the world."""
    try:
        return expert_data_parallel_size(world, inner, ep, pp)
    except ValueError:
        return None


def _wrong_models(world, tp, pp, cp, ep, etp):
    """(hint, {"ep": groups, "expert_dp": groups}) for the typical wrong pictures of the expert grid."""
    order = parse_order(DEFAULT_ORDER, {"tp": 2, "cp": 2, "ep": 2, "dp": 2, "pp": 2})

    def grid(sizes):
        return {"ep": rank_groups(order, sizes, "ep"), "expert_dp": rank_groups(order, sizes, "dp")}

    dense_tp_dp = _grid_dp(world, tp, ep, pp)
    ep_in_dense_dp = _grid_dp(world, tp * cp, ep, pp)
    cp_kept_dp = _grid_dp(world, etp * cp, ep, pp)
    models = []
    if dense_tp_dp is not None and cp == 1:  # with cp = 1 the dense-grid picture differs only by its TP size
        models.append((
            "you used the dense TP size: the expert grid's fastest axis is layout['expert_tp'] "
            "(--expert-tensor-parallel-size), so EP members are expert_tp ranks apart",
            grid({"tp": tp, "cp": 1, "ep": ep, "dp": dense_tp_dp, "pp": pp})))
    if ep_in_dense_dp is not None:
        models.append((
            "you put EP into the dense grid and divided the dense DP by EP (tp·cp·ep·dp·pp): since MoE parallel "
            "folding the expert layers have a grid of their own -- expert_tp × ep × expert_dp × pp with cp = 1, "
            "expert_dp = world / (expert_tp·ep·pp) -- and the dense DP is left whole",
            grid({"tp": tp, "cp": cp, "ep": ep, "dp": ep_in_dense_dp, "pp": pp})))
    if cp_kept_dp is not None:
        models.append((
            "you kept a CP axis in the expert grid: the expert grid has cp = 1, the context-parallel ranks are "
            "folded into EP and expert DP (expert_dp = world / (expert_tp·ep·pp))",
            grid({"tp": etp, "cp": cp, "ep": ep, "dp": cp_kept_dp, "pp": pp})))
    if dense_tp_dp is not None:
        models.append((
            "you used the dense TP size: the expert grid's fastest axis is layout['expert_tp'] "
            "(--expert-tensor-parallel-size), so EP members are expert_tp ranks apart",
            grid({"tp": tp, "cp": 1, "ep": ep, "dp": dense_tp_dp, "pp": pp})))
    edp = expert_data_parallel_size(world, etp, ep, pp)  # the expert grid: expert_tp · ep · expert_dp · pp
    ep_first = parse_order("ep-tp-cp-dp-pp", {"tp": 2, "cp": 2, "ep": 2, "dp": 2, "pp": 2})
    sizes = {"tp": etp, "cp": 1, "ep": ep, "dp": edp, "pp": pp}
    models.append((
        "you numbered EP fastest: Megatron's order is tp-cp-ep-dp-pp, so expert TP varies fastest, then EP, "
        "then expert DP, then PP",
        {"ep": rank_groups(ep_first, sizes, "ep"), "expert_dp": rank_groups(ep_first, sizes, "dp")}))
    dense = RankGrid(world, tp=tp, pp=pp, cp=cp, ep=ep, expert_tp=etp)
    models.append((
        "that is a dense group: the dense DP group (with CP) keeps all world/(tp·pp) ranks; the expert layers "
        "carve it into EP (who shares the experts out) and expert DP (who holds the same experts)",
        {"ep": dense.groups("dp-cp"), "expert_dp": dense.groups("dp-cp")}))
    return models


def _group_hint(got, rank, key, layout) -> str:
    world, tp, pp, cp, ep, etp = layout
    for hint, model in _wrong_models(world, tp, pp, cp, ep, etp):
        wrong = next((g for g in model[key] if rank in g), None)
        if wrong is not None and got == wrong:
            return hint
    if got is not None and rank not in got:
        return f"a rank is a member of its own groups: {rank} is missing"
    return ("build the expert grid: sizes expert_tp, ep, expert_dp = world / (expert_tp·ep·pp), pp (cp = 1), "
            "numbered tp fastest, then ep, dp, pp; a rank's EP group varies only its ep coordinate")


@exercise("expert_groups_of")
def check_expert_groups_of(fn) -> bool:
    """``fn(rank, layout) -> {"ep": [...], "expert_dp": [...]}``: the expert-parallel and expert-data-parallel
    groups of ``rank`` (ascending global ranks) for ``layout = {"world_size", "tp", "pp", "cp", "ep",
    "expert_tp"}`` in Megatron's default order, checked on every rank of :data:`EXPERT_LAYOUTS`."""
    if is_course_answer(fn):
        return False
    layouts = EXPERT_LAYOUTS + tuple(drawn_expert_layouts(drawn_rng()))
    for layout in layouts:
        grid = RankGrid(*layout[:1], tp=layout[1], pp=layout[2], cp=layout[3], ep=layout[4], expert_tp=layout[5])
        for rank in range(layout[0]):
            call = f"expert_groups_of({rank}, {layout_of(*layout)})"
            run = run_student(fn, rank, layout_of(*layout), references=references_for("expert_groups_of"))
            if run.todo:
                return not_attempted("expert_groups_of")
            if run.problem():
                print(f"✗ {call}: {run.problem()}")
                return False
            got = run.value
            if not isinstance(got, dict) or set(got) != set(KEYS):
                print(f"✗ {call} returned {safe_repr(got)}")
                print("  hint: return a dict with exactly the keys 'ep' and 'expert_dp', each a list of global "
                      "ranks, e.g. {'ep': [0, 1], 'expert_dp': [1, 5]}")
                return False
            for key, token in (("ep", "ep"), ("expert_dp", "dp")):
                want = grid.expert_group_of(rank, token)
                answer = _int_list(got[key])
                if answer is not None and answer != want and sorted(answer) == want:
                    answer = sorted(answer)  # any order of the same ranks is the same group
                if answer != want:
                    print(f"✗ {call}[{key!r}] = {safe_repr(got[key])} is not rank {rank}'s {key} group")
                    print("  hint: " + _group_hint(answer, rank, key, layout))
                    return False
    print(f"✓ expert_groups_of gives Megatron's EP and expert-DP groups of every rank of {len(layouts)} layouts "
          f"({len(layouts) - len(EXPERT_LAYOUTS)} drawn for this run)")
    return True


# ------------------------------------------------------------------ (2) dispatch over all-to-all

DISPATCH_WORLD, DISPATCH_EPS = 4, (2, 4)
TOKENS, HIDDEN, EXPERTS, TOPK, FFN = 12, 8, 8, 2, 16
_MASTER_SEED = 8


def dispatch_inputs(generator: torch.Generator, hidden: int = HIDDEN, experts: int = EXPERTS, topk: int = TOPK,
                    tokens: int = TOKENS):
    """One rank's dispatch input, tokens drawn from ``generator`` (the checker's is
    :func:`~course_lib.classroom.checks.wire.secret_generator`: no other rank can rebuild them):
    ``(tokens [T, H], rows [T·k, H] sorted by expert, tokens_per_expert [E], probs, indices, perm)``."""
    master = make_master_weights(hidden, experts, FFN, seed=_MASTER_SEED)
    x = torch.randn(tokens, hidden, generator=generator)
    probs, indices, _ = route(x, master["router"], topk)
    flat = indices.flatten()
    perm = torch.argsort(flat, stable=True)
    return x, x[perm // topk], torch.bincount(flat, minlength=experts), probs, indices, perm


def _true_exchange(rows, probs, tpe, group, ep):
    """The checker's own dispatch, run after the student's: ``(received rows, received probs, counts
    [ep, L], rows per destination)`` -- the truth, from what the ranks really hold."""
    me, L = dist.get_rank(group), tpe.numel() // ep
    every = [torch.empty_like(tpe) for _ in range(ep)]
    dist.all_gather(every, tpe, group=group)
    counts = torch.stack(every)[:, me * L:(me + 1) * L]                          # [ep, L]: source s -> me
    sends = tpe.view(ep, -1).sum(1).tolist()
    received = rows.new_empty(int(counts.sum()), rows.shape[1])
    dist.all_to_all_single(received, rows, output_split_sizes=counts.sum(1).tolist(), input_split_sizes=sends,
                           group=group)
    received_probs = probs.new_empty(int(counts.sum()))
    dist.all_to_all_single(received_probs, probs, output_split_sizes=counts.sum(1).tolist(),
                           input_split_sizes=sends, group=group)
    return received, received_probs, counts, sends


_EXCHANGE_COUNTS_HINT = ("all-gather every rank's tokens_per_expert first, so that every rank knows output_split_sizes "
                         "(what each source sends to your experts), then all_to_all_single the rows with "
                         "input_split_sizes = rows per destination rank")


def _received_hint(got, want, every_row: int) -> str:
    if got.shape[0] == every_row:
        return ("you received every row of every rank: send each rank only the rows routed to *its* experts "
                "(input_split_sizes[j] = rows for experts j·L .. j·L+L-1)")
    if got.shape[0] == want.shape[0]:
        return ("the right number of rows in the wrong order or from the wrong rank: rows routed to experts "
                "j·L .. j·L+L-1 go to group rank j, and what arrives is grouped by source rank")
    return _EXCHANGE_COUNTS_HINT


def _flat_counts(counts):
    """``counts`` [ep, L] as one flat list of ints (from a tensor, nested lists or a flat list), or None."""
    try:
        if isinstance(counts, torch.Tensor):
            return _int_list(counts.flatten())
        if isinstance(counts, (list, tuple)) and counts and not isinstance(counts[0], (int, float)):
            return _int_list([c for row in counts for c in _int_list(row)])
    except Exception:  # noqa: BLE001 - an odd answer is a wrong answer
        return None
    return _int_list(counts)


def _carries(chunk, want) -> bool:
    """Did ``chunk`` (one destination's piece of an all-to-all) carry the rows ``want`` [n, H] -- alone, or
    with each row's gate value packed beside it (one more column, first or last)? Never raises."""
    if not isinstance(chunk, torch.Tensor):
        return False
    if want.shape[0] == 0:
        return chunk.numel() == 0
    if chunk.numel() not in (want.numel(), want.numel() + want.shape[0]):
        return False
    wide = chunk.reshape(want.shape[0], -1)
    return any(torch.equal(wide[:, cols].to(want.dtype), want)
               for cols in (slice(0, want.shape[1]), slice(wide.shape[1] - want.shape[1], None)))


def _rows_carried(result, rows, sends) -> bool:
    """Did one of the student's all-to-alls carry this rank's rows, each chunk to the rank of its experts?"""
    want = list(rows.split(sends))
    return any(isinstance(chunks, list) and len(chunks) == len(want) and all(map(_carries, chunks, want))
               for chunks in carried_by(result, "all_to_all"))


def _dispatch_rank(fn):
    rank = dist.get_rank()
    outcome = []
    for ep in DISPATCH_EPS:
        grid = RankGrid(DISPATCH_WORLD, ep=ep)
        group, members = None, None
        for ranks in grid.expert_groups("ep"):
            g = dist.new_group(ranks)
            if rank in ranks:
                group, members = g, ranks
        x, rows, tpe, probs, indices, perm = dispatch_inputs(secret_generator())
        row_probs = probs.flatten()[perm]                                            # [T·k], beside the rows
        result = student_on_rank(fn, rows.clone(), row_probs.clone(), tpe.clone(), group,
                                 references=references_for("dispatch"), raw=True)
        got = result.pop("raw")
        want, want_probs, counts_want, sends = _true_exchange(rows, row_probs, tpe, group, ep)
        my_index = members.index(rank)
        every_row = sum(int(n) for n in _gathered_sizes(rows.shape[0], group))
        problem = None
        if not (isinstance(got, (tuple, list)) and len(got) == 3):
            problem = f"dispatch must return (received, received_probs, counts), got {safe_repr(got)}"
        else:
            received, received_probs, counts = got
            counts = _flat_counts(counts)
            if not isinstance(received, torch.Tensor) or received.dim() != 2 or received.shape[1] != HIDDEN:
                problem = f"received must be a tensor [rows, {HIDDEN}], got {safe_repr(received)}"
            elif received.shape != want.shape or not torch.equal(received, want):
                problem = (f"group rank {my_index} of EP{ep} received {received.shape[0]} rows, not the rows "
                           f"routed to its experts from ranks {members}, in rank order\n  hint: "
                           + _received_hint(received, want, every_row))
            elif counts != counts_want.flatten().tolist():
                # no all-gather carried the counts: the rows matched only because the splits happened to agree
                unexchanged = not _counts_carried(result, tpe)
                problem = (f"counts on rank {rank} (EP{ep}) = {safe_repr(got[2])} are not what the sources sent to "
                           f"this rank's experts\n  hint: " + (_EXCHANGE_COUNTS_HINT if unexchanged else
                           "counts[s][l] = rows that source rank s sent for my local expert l: the columns of your "
                           "experts in every rank's gathered tokens_per_expert"))
            elif not (isinstance(received_probs, torch.Tensor) and received_probs.numel() == want_probs.numel()
                      and torch.equal(received_probs.reshape(-1).to(want_probs.dtype), want_probs)):
                problem = (f"the rows are right, but received_probs on rank {rank} (EP{ep}) = "
                           f"{safe_repr(received_probs)} are not the gate values of those rows\n  hint: Megatron "
                           f"sends each row's gate value with it: all_to_all_single the probs with the rows' splits")
        ok = torch.tensor([0 if problem else 1])
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank agrees before the combine (no half-run collective)
        error = None
        if ok.item():
            layer = MoELayer(make_master_weights(HIDDEN, EXPERTS, FFN, seed=_MASTER_SEED), moe_router_topk=TOPK,
                             ep_group=group)
            error = _combine_error(layer, received, received_probs.reshape(-1), counts_want, x, tpe, perm, group, ep)
        outcome.append(dict(ep=ep, problem=problem, error=error, events=result["events"],
                            counts_carried=_counts_carried(result, tpe), rows_carried=_rows_carried(result, rows, sends),
                            patched=result["patched"], course_code=result["course_code"], rank=rank))
        if not ok.item():
            break
    return outcome


def _counts_carried(result, tpe) -> bool:
    """Did an all-gather carry this rank's whole ``tokens_per_expert`` (Megatron's counts exchange)?"""
    return any(same_payload(c, tpe) for c in carried_by(result, "all_gather"))


def _gathered_sizes(n: int, group) -> list:
    """Every group member's row count (the checker's all-gather)."""
    out = [torch.zeros(1, dtype=torch.long) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, torch.tensor([n]), group=group)
    return [int(t) for t in out]


def _combine_error(layer, received, received_probs, counts, x, tpe, perm, group, ep) -> float:
    """Experts on the received rows (each scaled by its gate), all-to-all back, unpermute: max error
    against one process."""
    L = EXPERTS // ep
    sizes = counts.flatten().tolist()                                             # chunk (s, l) at s·L + l
    by_expert = [s * L + l for l in range(L) for s in range(ep)]
    y = layer.experts(reorder_chunks(received, sizes, by_expert), reorder_chunks(received_probs, sizes, by_expert),
                      counts.sum(0).tolist())
    by_source = reorder_chunks(y, [sizes[i] for i in by_expert], [l * ep + s for s in range(ep) for l in range(L)])
    back = torch.empty(int(tpe.sum()), HIDDEN)
    dist.all_to_all_single(back, by_source, output_split_sizes=tpe.view(ep, L).sum(1).tolist(),
                           input_split_sizes=counts.sum(1).tolist(), group=group)
    out = torch.zeros_like(x).index_add(0, perm // TOPK, back)
    want, _ = MoELayer(make_master_weights(HIDDEN, EXPERTS, FFN, seed=_MASTER_SEED), moe_router_topk=TOPK)(x)
    return float((out - want).abs().max())


def _traffic_problem(events, ep) -> str | None:
    """None when the counts went by one all-gather of E numbers and the rows and their gates crossed by
    all-to-all, T·k·(H + 1) elements in all."""
    rows, gates, counts = TOKENS * TOPK * HIDDEN, TOKENS * TOPK, ep * EXPERTS
    gathers = [e for e in events if e.op == "all_gather"]
    other = [e for e in events if e.op not in ("all_gather", "all_to_all")]
    if other or any(e.numel > counts for e in gathers):
        return (f"the dispatch ran {describe_ops(other or gathers)}: the alltoall dispatcher sends each row only to "
                f"the rank that holds its expert, with all_to_all_single (gathering the tokens is the allgather "
                f"dispatcher; only the counts are all-gathered)")
    if not gathers:
        return ("the rows arrived, but the counts did not go as Megatron's dispatcher sends them: it all-gathers "
                "every rank's whole tokens_per_expert [E] over the group (token_dispatcher.py, preprocess), so "
                "every rank knows the whole distribution and reads both its input and its output splits off it "
                "-- an all-to-all of the counts tells a rank only what it receives")
    sent = sum(e.numel for e in events if e.op == "all_to_all")
    if sent != rows + gates:
        return (f"each rank sent {sent} elements by all-to-all ({describe_ops(events)}); the dispatch sends each of "
                f"its T·k = {TOKENS * TOPK} (token, expert) rows once with its gate value: {rows} + {gates} = "
                f"{rows + gates} elements")
    return None


@exercise("dispatch")
def check_dispatch(fn, timeout: float = 30) -> bool:
    """``fn(rows, probs, tokens_per_expert, group) -> (received, received_probs, counts)``: the alltoall token
    dispatch of one rank, as Megatron's ``MoEAlltoAllTokenDispatcher`` does it.

    ``rows`` [T·k, H]: this rank's (token, expert) rows sorted by expert; ``probs`` [T·k]: their gate
    values; ``tokens_per_expert`` [E]; ``group``: the EP group, whose rank j holds experts
    ``j·L .. j·L+L-1`` (L = E / ep). Returns the rows for my experts and their gate values, grouped by
    source rank (group order), and ``counts`` [ep, L] (rows from source s for my local expert l). Run on 4
    ranks for EP2 and EP4; checked by result and by traffic (the counts all-gathered, the rows and gates
    all-to-all'd)."""
    if is_course_answer(fn):
        return False
    try:
        ranks = launch_checked(_dispatch_rank, world_size=DISPATCH_WORLD, timeout=timeout, fn=fn)
    except RankError as err:
        if err.exc_type == "NotImplementedError":
            return not_attempted("dispatch")
        mismatch = split_problem(err.traceback)
        if mismatch:
            print(f"✗ rank {err.rank}'s all-to-all could not run: {mismatch}")
            if "list form" not in mismatch:
                print("  hint: how many rows a peer sends you depends on its tokens, which only it knows: first "
                      "all-gather every rank's tokens_per_expert [E]; the columns of your experts give "
                      "output_split_sizes, your own counts per destination input_split_sizes (sum = T·k)")
            return False
        print(f"✗ rank {err.rank} raised {raised_line(err)}")
        if "split" in err.traceback.lower():
            print("  hint: input_split_sizes are the rows you send to each group rank (sum = T·k), "
                  "output_split_sizes the rows you receive from each (read them off the gathered counts)")
        return False
    except LaunchTimeout:
        print("✗ the ranks waited for each other (a deadlock)\n  hint: every rank of the EP group must join "
              "each collective, in the same order")
        return False
    for step in range(len(DISPATCH_EPS)):
        for res in (r[step] for r in ranks if len(r) > step):
            if res["patched"] or res["course_code"]:
                print("✗ " + (course_code_hint(res["course_code"][0]) if res["course_code"] else
                              f"it replaced {', '.join(res['patched'][:3])} (undone by the checker)"))
                return False
            if res["problem"]:
                print(f"✗ {res['problem']}")
                return False
            traffic = _traffic_problem(res["events"], res["ep"])
            if traffic:
                print(f"✗ EP{res['ep']}, rank {res['rank']}: {traffic}")
                return False
            if not res["counts_carried"]:
                print(f"✗ EP{res['ep']}, rank {res['rank']}: the all-gather did not carry this rank's "
                      f"tokens_per_expert\n  hint: all-gather the whole [E] vector: every rank needs every "
                      f"rank's counts")
                return False
            if not res["rows_carried"]:
                print(f"✗ EP{res['ep']}, rank {res['rank']}: the rows that arrived are right, but no all-to-all "
                      f"carried this rank's rows to the ranks of their experts\n  hint: send `rows` itself, cut by "
                      f"input_split_sizes = your rows per destination rank")
                return False
            if res["error"] is None or res["error"] > 1e-5:
                print(f"✗ EP{res['ep']}: the layer differs from one process by {res['error']}")
                return False
    print(f"✓ dispatch delivers every row and its gate value to its expert on 4 ranks (EP2 and EP4), tokens drawn "
          f"afresh on each rank: the rows, gates and counts equal the checker's own exchange, the layer equals one "
          f"process (max error <= 1e-5); on the wire, each rank's [E] = [{EXPERTS}] counts went by one all-gather "
          f"and its {TOKENS}×{TOPK}×{HIDDEN} = {TOKENS * TOPK * HIDDEN} row elements and {TOKENS * TOPK} gates by "
          f"all-to-all, each chunk to the rank of its experts")
    return True


# ------------------------------------------------------------------ (3) the aux loss


AUX_TOL = 1e-5  # relative: float32 or float64 answers


AUX_SETTINGS = ((32, 4, 1, 1e-2, 0.0, "middle"), (50, 8, 2, 1.0, 2.0, None), (7, 6, 3, 0.1, 0.5, "last"),
                (64, 16, 4, 1e-3, 3.0, None))
"""(tokens, experts, top-k, coeff, skew of expert 0, starved): a starved expert's logits are 30 lower, so it
receives no routing slot (f_i = 0) in every run -- the last expert, or one drawn between the first and the last.
Drawn alone an expert went unrouted in 6% of runs, so counts that leave such an expert out (``torch.unique``, a
``bincount`` without ``minlength``, the counts of the experts seen padded at the end) passed the rest."""


def _aux_cases():
    g = torch.Generator().manual_seed(drawn_rng().getrandbits(63))  # drawn for this run: no table of inputs
    cases = []
    for tokens, experts, topk, coeff, skew, starved in AUX_SETTINGS:
        logits = torch.randn(tokens, experts, generator=g, dtype=torch.float64)
        logits[:, 0] += skew
        if starved:
            logits[:, -1 if starved == "last" else int(torch.randint(1, experts - 1, (1,), generator=g))] -= 30.0
        scores = torch.softmax(logits, -1)
        cases.append((scores, torch.topk(logits, topk, -1).indices, experts, coeff))
    return cases


_UNROUTED_HINT = ("an expert that receives no routing slot still has its f_i (= 0): count every expert, "
                  "torch.bincount(indices.flatten(), minlength=num_experts) -- torch.unique and a bincount without "
                  "minlength leave it out, and f no longer lines up with P")


def _unrouted(indices, experts: int) -> bool:
    """Does an expert receive no routing slot in this case?"""
    return bool((torch.bincount(indices.flatten(), minlength=experts) == 0).any())


def _aux_hint(value, scores, indices, experts, coeff) -> str:
    tokens, topk = indices.shape
    f = torch.bincount(indices.flatten(), minlength=experts).double() / (tokens * topk)
    p = scores.mean(0)
    guesses = (
        (coeff * (f * p).sum(), "you forgot the factor E (num_experts): with it a perfectly balanced router "
                                "scores exactly coeff"),
        (coeff * experts * (p * p).sum(), "you used the mean probabilities P_i where the fractions f_i belong: "
                                          "f_i counts the routing slots expert i received (bincount of indices)"),
        (coeff * experts * (f * f).sum(), "you used f_i twice: the second factor is P_i, the mean router "
                                          "probability, which carries the gradient"),
        (coeff * experts * topk * (f * p).sum(), "f_i divides by T·k (all routing slots), not by T"),
        (coeff * experts * (f * p).sum() / topk, "f_i divides by T·k once; you divided by k again"),
        (experts * (f * p).sum(), "you forgot to multiply by coeff (--moe-aux-loss-coeff)"),
    )
    for guess, hint in guesses:
        if abs(value - float(guess)) <= AUX_TOL * max(1e-3, abs(float(guess))):
            return hint
    seen = f[f > 0]                       # the experts seen, their counts packed at the front
    packed = torch.cat([seen, torch.zeros(experts - len(seen), dtype=f.dtype)])
    guess = float(coeff * experts * (packed * p).sum())
    if len(seen) < experts and abs(value - guess) <= AUX_TOL * max(1e-3, abs(guess)):
        return _UNROUTED_HINT
    return "aux = coeff · E · Σ_i f_i · P_i with f_i = slots to expert i / (T·k) and P_i = mean score of expert i"


@exercise("aux_loss")
def check_aux_loss(fn) -> bool:
    """``fn(scores, indices, num_experts, coeff) -> loss``: the Switch load-balancing loss (value and gradient
    with respect to ``scores``), checked against :func:`course_lib.moe.router.switch_load_balancing_loss`."""
    if is_course_answer(fn):
        return False
    cases = _aux_cases()
    for scores, indices, experts, coeff in cases:
        what = f"T={scores.shape[0]}, E={experts}, k={indices.shape[1]}, coeff={coeff}"
        mine = scores.clone().requires_grad_()
        run = run_student(fn, mine, indices.clone(), experts, coeff, references=references_for("aux_loss"))
        if run.todo:
            return not_attempted("aux_loss")
        if run.problem():
            print(f"✗ aux_loss ({what}): {run.problem()}")
            if run.error is not None and not run.course_code and _unrouted(indices, experts):
                print(f"  hint: {_UNROUTED_HINT}")
            return False
        got = run.value
        ref = scores.clone().requires_grad_()
        want = switch_load_balancing_loss(ref, indices, experts, coeff)
        want.backward()
        if not isinstance(got, torch.Tensor) or got.numel() != 1:
            print(f"✗ aux_loss ({what}) returned {safe_repr(got)}: return a scalar tensor (it is added to the loss "
                  f"and back-propagated)")
            return False
        value, want = float(got.detach()), float(want.detach())
        if abs(value - want) > AUX_TOL * max(1e-3, abs(want)):
            print(f"✗ aux_loss ({what}) = {value:.6g}: not the Switch load-balancing loss of these scores")
            print("  hint: " + _aux_hint(value, scores, indices, experts, coeff))
            return False
        if not got.requires_grad:
            print(f"✗ aux_loss ({what}) has the right value but no gradient: P_i must be computed from scores "
                  f"with torch operations (no .item(), no detach) so that the router learns to balance")
            return False
        try:
            grad, = torch.autograd.grad(got, mine, allow_unused=True)
        except Exception as exc:  # noqa: BLE001 - reported
            grad, _ = None, exc
        if grad is None or not torch.allclose(grad.double(), ref.grad, rtol=1e-5, atol=1e-9):
            print(f"✗ aux_loss ({what}) has the right value but the wrong gradient: the gradient flows through "
                  f"P_i = scores.mean(0) only; f_i are counts, constants")
            return False
    print(f"✓ aux_loss equals the Switch / Megatron load-balancing loss on {len(cases)} cases (top-1 to top-4, "
          f"skewed routers), value and gradient")
    return True
