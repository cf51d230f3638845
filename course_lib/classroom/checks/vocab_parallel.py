"""Checker for the vocab-parallel cross-entropy (Lab 02).

``check_vocab_parallel_cross_entropy(fn)``: ``fn(logits [s,b,V/t], target [s,b], group) -> loss [s,b]``
on 2 and 4 ranks, equal to ``F.cross_entropy`` on the full logits (logits near 1000 included), moving
only all-reduces of ``[s, b]`` per-token numbers, one of them a MAX (Megatron's
``megatron/core/tensor_parallel/cross_entropy.py``). It prints one verdict line plus the most specific
hint it can find; a function that still raises ``NotImplementedError`` gets a "not attempted yet" line.

The checker proves the *algorithm*, not only the numbers: ranks run on a process group that
records every operation (:mod:`course_lib.classroom.checks.wire`), so a cross-entropy that gathers the
logits gets the right numbers and is refused -- however the collective was called. Student code runs
through :func:`~course_lib.classroom.checks.tamper_guard.run_student`: a monkeypatch (``F.linear``, ...) is
undone and named, and a function that runs the course's own implementation is told so.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.classroom.checks import is_course_answer, not_attempted, raised_line
from course_lib.classroom.checks.exercise import exercise
from course_lib.classroom.checks.references import references_for
from course_lib.classroom.checks.student_process import student_on_rank
from course_lib.classroom.checks.tamper_guard import call_problem
from course_lib.classroom.checks.verdicts import describe_ops, launch_checked, secret_generator, tensors_close
from course_lib.launch import LaunchTimeout, RankError

__all__ = ["check_vocab_parallel_cross_entropy"]

CE_S, CE_B, CE_V = 4, 2, 16
CE_CASES = (("logits near 1000", 30.0, 1000.0), ("ordinary logits", 2.0, 0.0))
CE_ALGORITHM = ("only per-token numbers cross the wire: all-reduce the max logit (op=MAX), the target's logit "
                "and the sum of exp(logit - max), [s, b] each -- never the [s, b, V] logits")


def slice_edges(vocab: int, t: int) -> list:
    """Every rank's first and last vocabulary id (rank r holds ``r·V/t .. (r+1)·V/t - 1``): the targets where an
    ownership test off by one (``<=`` for ``<`` at the slice's end, ``>`` for ``>=`` at its start) gives a token to
    two ranks or to none."""
    part = vocab // t
    return sorted({i for r in range(t) for i in (r * part, (r + 1) * part - 1)})


def _targets(generator: torch.Generator, t: int, edges: bool) -> torch.Tensor:
    """Targets [s, b] drawn from ``generator``; with ``edges``, every slice's first and last id among them, at
    drawn places (drawn alone, a slice's end is missed by 1 run in 80)."""
    target = torch.randint(0, CE_V, (CE_S, CE_B), generator=generator)
    if edges:
        ids = torch.tensor(slice_edges(CE_V, t))
        target.view(-1)[torch.randperm(target.numel(), generator=generator)[:len(ids)]] = ids
    return target


def _rank_vocab_ce(fn):
    g, t, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    secret = secret_generator()                # this rank's slice of the logits: no other rank can rebuild it
    out = []
    for i, (name, scale, offset) in enumerate(CE_CASES):
        mine = torch.randn(CE_S, CE_B, CE_V // t, generator=secret) * scale + offset
        target = _targets(secret, t, edges=i == len(CE_CASES) - 1)   # the ordinary case: every slice's edges
        dist.broadcast(target, 0)                # the same targets on every rank
        result = student_on_rank(fn, mine.clone(), target.clone(), g,
                                 references=references_for("vocab_parallel_cross_entropy"))
        slices = [torch.empty_like(mine) for _ in range(t)]
        dist.all_gather(slices, mine)            # the truth, from what the ranks really hold
        out.append(dict(result, case=name, full=torch.cat(slices, -1), target=target, rank=r, t=t))
    return out


def _ce_wrong_formulas(full, target, rank, t) -> list:
    """(loss this rank would return, hint) for the usual mistakes, in float64."""
    z = full.double()
    lse = torch.logsumexp(z, -1)
    z_t = z.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    top = z.max(-1).values
    part = z.shape[-1] // t
    mine = (target >= rank * part) & (target < (rank + 1) * part)
    local = z.chunk(t, -1)[rank]
    return [
        (lse - z_t - math.log(t), "the loss is log(t) too small: op=ReduceOp.AVG made the sum of exp t times too "
                                  "small -- the slices' sums are added (ReduceOp.SUM)"),
        (torch.where(mine, lse - z_t, lse - top),
         "on ranks that do not hold the target's id the target logit is missing: mask it to 0 there and "
         "all-reduce (sum) it, so every rank gets the owner's value"),
        (torch.logsumexp(local, -1) - z_t,
         "the softmax denominator sums over the *whole* vocabulary: all-reduce (sum) the sum of exp(logit - max) "
         "of your slice"),
    ]


def _wrong_only_at_edges(value, want, target, part: int) -> bool:
    """Are the tokens whose loss is wrong (by :func:`tensors_close`'s scale) all tokens whose target is a slice's
    first or last id? Never raises."""
    try:
        wrong = (value.detach().double() - want).abs() > 1e-5 * max(1.0, want.abs().max().item())
        at_edges = (target % part == 0) | (target % part == part - 1)
        return bool(wrong.any()) and not bool((wrong & ~at_edges).any())
    except Exception:  # noqa: BLE001 - an odd answer is a wrong answer
        return False


def diagnose_vocab_ce(value, full, target, rank, t) -> str | None:
    """The hint for a wrong per-token loss (values only), or None when right."""
    want = F.cross_entropy(full.double().reshape(-1, full.shape[-1]), target.reshape(-1),
                           reduction="none").view(target.shape)
    if tensors_close(value, want, tol=1e-5):
        return None
    if not isinstance(value, torch.Tensor):
        return f"return the loss of every token as a tensor [s, b] (got {value})"
    if value.numel() == 1 or tuple(value.shape) != tuple(want.shape):
        return (f"expected the loss of every token, shape [s, b] = {tuple(want.shape)}, got {tuple(value.shape)} "
                f"(reduction='none': no mean, no sum)")
    if not bool(torch.isfinite(value).all()):
        return ("exp() overflowed (inf or nan) with logits near 1000: subtract the max logit -- all-reduced with "
                "op=ReduceOp.MAX so every rank subtracts the same number -- before exp")
    for guess, hint in _ce_wrong_formulas(full, target, rank, t):
        if tensors_close(value, guess, tol=1e-5):
            return hint
    if _wrong_only_at_edges(value, want, target, full.shape[-1] // t):
        return ("only tokens whose target is the first or last id of a slice are wrong: rank r holds ids "
                "r·V/t to (r+1)·V/t - 1 -- a target is yours when vocab_start <= target < vocab_end (the end "
                "excluded), so that exactly one rank owns each id")
    return ("loss = log(sum over the whole vocabulary of exp(z - max)) - (z_target - max), with max, the sum of "
            "exp and the target's logit all-reduced over the group")


def diagnose_vocab_ce_traffic(events, s: int, b: int) -> str | None:
    """The hint when the cross-entropy moved more than per-token numbers, or skipped the max; else None."""
    bulky = [e for e in events if e.op != "all_reduce" or e.numel > 2 * s * b]
    if bulky:
        return f"it ran {describe_ops(events)}: {CE_ALGORITHM}"
    if sum(e.numel for e in events) > 3 * s * b:
        return f"it ran {describe_ops(events)}, more than 3·s·b numbers: {CE_ALGORITHM}"
    if not any(e.reduce_op == "max" for e in events):
        return ("the max logit was not all-reduced (op=MAX): every rank must subtract the *same* max, the "
                "largest over the whole vocabulary")
    if not any(e.reduce_op in (None, "sum") for e in events):
        return "the target's logit and the sum of exp are added over the group: all-reduce them with ReduceOp.SUM"
    return None


def _vocab_ce_hint(r: dict) -> str | None:
    """The one hint for a rank's cross-entropy: a patch or the course's code, then logits on the wire
    (right numbers, wrong algorithm), then an overflow, then a missing MAX, then wrong values; None when right."""
    problem = call_problem(r)
    if problem:
        return problem
    traffic = diagnose_vocab_ce_traffic(r["events"], CE_S, CE_B)
    if traffic and any(e.op != "all_reduce" or e.numel > 2 * CE_S * CE_B for e in r["events"]):
        return traffic
    values = diagnose_vocab_ce(r["value"], r["full"], r["target"], r["rank"], r["t"])
    if values and "overflowed" in values:
        return values
    return traffic or values


@exercise("vocab_parallel_cross_entropy")
def check_vocab_parallel_cross_entropy(fn) -> bool:
    """``fn(logits [s,b,V/t], target [s,b], group) -> loss [s,b]`` equal to ``F.cross_entropy`` on the
    full logits, moving only all-reduces of ``[s, b]`` numbers (one of them a MAX) over the group."""
    if is_course_answer(fn):
        return False
    for t in (2, 4):
        try:
            res = launch_checked(_rank_vocab_ce, world_size=t, fn=fn)
        except RankError as err:
            if err.exc_type == "NotImplementedError":
                return not_attempted("vocab_parallel_cross_entropy")
            print(f"✗ with {t} ranks, rank {err.rank} raised {raised_line(err)}")
            if "out of bounds" in err.traceback or "index" in err.traceback.lower():
                print("  hint: target ids are in the full vocabulary: subtract your first id (rank·V/t), and "
                      "mask the tokens whose id is outside your slice")
            return False
        except LaunchTimeout:
            print(f"✗ with {t} ranks the ranks waited for each other: every rank must issue the same all-reduces "
                  f"in the same order")
            return False
        for per_rank in zip(*res):  # case by case, every rank
            for r in per_rank:
                hint = _vocab_ce_hint(r)
                if hint:
                    print(f"✗ {r['case']}, rank {r['rank']} of {t}\n  hint: {hint}")
                    return False
    print(f"✓ vocab_parallel_cross_entropy equals F.cross_entropy on the full logits for t = 2 and 4, logits near "
          f"1000 included, and each rank sent only all-reduces of [s, b] numbers (the max among them) -- "
          f"never the {CE_S}·{CE_B}·{CE_V} logits")
    return True
