"""Checkers for what tensor parallelism communicates (Lab 02): the f/g operators, a layer's collectives.

* ``check_f_g(f_cls, g_cls)``: the conjugate operators as ``torch.autograd.Function``\\ s -- f identity
  forward / all-reduce backward, g all-reduce forward / identity backward (Megatron's
  ``megatron/core/tensor_parallel/mappings.py``), on 2 ranks, each pass's traffic recorded apart, and a
  2-rank MLP built from them against the dense one.
* ``check_collective_prediction(predict_collectives, predict_elements_sent)``: the collectives one
  ``ParallelTransformerLayer`` runs forward and backward (with and without sequence parallelism),
  against those recorded on 2 ranks, and the elements each rank sends per layer.

Each prints one verdict line plus the most specific hint it can find; a function that still raises
``NotImplementedError`` gets a "not attempted yet" line, never an exception.

The checkers prove the *algorithm*, not only the numbers: ranks run on a process group that
records every operation and what it carried (:mod:`course_lib.classroom.checks.wire`), so an operator
that gathers every rank's tensor and adds them by hand is refused -- however the collective was called --
and so is one whose all-reduce carries anything but its own tensor; each rank's tensors are drawn from
``os.urandom``, so no rank can add up the others' without the wire. Student code runs
through :func:`~course_lib.classroom.checks.tamper_guard.run_student`: a monkeypatch (``F.linear``, ...) is
undone and named, and a function that runs the course's own implementation is told so.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.classroom.checks import is_course_answer, not_attempted, raised_line
from course_lib.classroom.checks.exercise import exercise
from course_lib.classroom.checks.references import references_for
from course_lib.classroom.checks.student_process import backward_on_rank, run_on_rank
from course_lib.classroom.checks.tamper_guard import call_problem, portable, run_student
from course_lib.classroom.checks.verdicts import (all_reduce_in_two_steps, as_real, describe_ops, drawn_rng,
                                                  launch_checked, safe_repr, same_number, same_payload,
                                                  secret_generator, tensors_close, wire_recorder)
from course_lib.comm import CommRecorder
from course_lib.launch import LaunchTimeout, RankError, launch
from course_lib.tensor_parallel import DenseMLP, ParallelTransformerLayer, TransformerConfig

__all__ = ["check_f_g", "check_collective_prediction"]



# ----------------------------------------------------------------------------- f/g


def _summed(t: torch.Tensor) -> torch.Tensor:
    """The checker's own all-reduce of ``t`` (run after the student's calls)."""
    t = t.clone()
    dist.all_reduce(t)
    return t


def _shared(t: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``t`` on every rank (the checker's broadcast): an input that is the same everywhere."""
    t = t.clone()
    dist.broadcast(t, 0)
    return t


def _rank_f_g(f_cls, g_cls):
    g, t, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    gen = lambda q: torch.Generator().manual_seed(50 + q)  # noqa: E731
    secret = secret_generator()                 # this rank's tensors: no other rank can rebuild them
    x_own, dy_own = torch.randn(3, 4, generator=secret), torch.randn(3, 4, generator=secret)
    x_same, dy_same = _shared(x_own), _shared(dy_own)
    refs = references_for("f_and_g")
    out = {}

    def phases(cls, x, dy):
        """What cls.apply(x, group) does in each pass: y, dx and the ops of each pass (and what they
        carried), recorded apart (the forward is one call in the student process, the backward another)."""
        x = x.clone().requires_grad_()
        with wire_recorder() as fwd:
            run = run_on_rank(cls.apply, x, g, references=refs)
        if run.error is not None:
            raise run.error
        y = run.value
        info = dict(patched=run.patched, course_code=run.course_code, events=list(fwd.events),
                    carried=list(fwd.carried), bwd_events=[], bwd_carried=[], dx=None, y=portable(y))
        if isinstance(y, torch.Tensor) and y.requires_grad:
            with wire_recorder() as bwd:
                back = backward_on_rank(y, dy.clone())
            if back.error is not None:
                raise back.error
            info.update(patched=run.patched + back.patched, course_code=run.course_code + back.course_code,
                        bwd_events=list(bwd.events), bwd_carried=list(bwd.carried), dx=x.grad)
        return info

    # f alone: forward identity, backward all-reduce (f's input is the same on every rank)
    out["f"] = dict(phases(f_cls, x_same, dy_own), x=x_same, dy=dy_own)
    out["f"]["dysum"] = _summed(dy_own)
    # g alone: forward all-reduce, backward identity (g's output, so its gradient, is the same on every rank)
    out["g"] = dict(phases(g_cls, x_own, dy_same), x=x_own, dy=dy_same)
    out["g"]["xsum"] = _summed(x_own)
    # a 2-layer MLP built from them, vs the dense one
    cfg = TransformerConfig(hidden_size=8, num_attention_heads=2, ffn_hidden_size=16)
    torch.manual_seed(3)
    dense = DenseMLP(cfg)
    w1 = dense.linear_fc1.weight.detach().chunk(t, 0)[r].clone().requires_grad_()
    w2 = dense.linear_fc2.weight.detach().chunk(t, 1)[r].clone().requires_grad_()
    xin = torch.randn(4, 2, 8, generator=gen(99))
    xd = xin.clone().requires_grad_()
    yd = F.linear(F.gelu(F.linear(xd, dense.linear_fc1.weight)), dense.linear_fc2.weight)
    yd.sum().backward()
    xp = xin.clone().requires_grad_()
    # f and g in their student processes, the layers between them the checker's own, here on the rank
    entered = run_on_rank(f_cls.apply, xp, g, references=refs)
    if entered.error is not None:
        raise entered.error
    left = run_on_rank(g_cls.apply, F.linear(F.gelu(F.linear(entered.value, w1)), w2), g, references=refs)
    if left.error is not None:
        raise left.error
    yp = left.value
    back = backward_on_rank(yp, torch.ones_like(yp))
    if back.error is not None:
        raise back.error
    out["mlp"] = dict(y=(yp - yd).abs().max().item(), dx=(xp.grad - xd.grad).abs().max().item(),
                      dw=max((w1.grad - dense.linear_fc1.weight.grad.chunk(t, 0)[r]).abs().max().item(),
                             (w2.grad - dense.linear_fc2.weight.grad.chunk(t, 1)[r]).abs().max().item()))
    return out


def diagnose_f(o, t) -> str | None:
    if not tensors_close(o["y"], o["x"]):
        if tensors_close(o["y"], o["x"] * t):
            return "f's forward must be the identity (return x): you all-reduced in the forward pass"
        return "f's forward must return its input unchanged"
    if o["dx"] is None:
        return "f's backward must return the gradient (and None for the group argument)"
    if tensors_close(o["dx"], o["dy"]):
        return ("f's backward must all-reduce the gradient over the group: every rank used the whole input, "
                "so its gradient is the sum of the ranks' partial gradients")
    if tensors_close(o["dx"], o["dysum"] / t):
        return ("f's backward is t times too small: op=ReduceOp.AVG divides by t, but the ranks' partial "
                "gradients are added (ReduceOp.SUM, the default)")
    if not tensors_close(o["dx"], o["dysum"]):
        return "f's backward should return the all-reduced (summed over ranks) gradient"
    return None


def diagnose_g(o, t) -> str | None:
    if not tensors_close(o["y"], o["xsum"]):
        if tensors_close(o["y"], o["x"]):
            return "g's forward must all-reduce (sum) its input over the group: each rank holds a partial sum"
        if tensors_close(o["y"], o["xsum"] / t):
            return ("g's forward is t times too small: op=ReduceOp.AVG divides by t, but the partial sums are "
                    "added (ReduceOp.SUM, the default)")
        return "g's forward must return the sum over ranks of its input (dist.all_reduce on a copy)"
    if o["dx"] is None:
        return "g's backward must return the gradient (and None for the group argument)"
    if tensors_close(o["dx"], o["dy"] * t):
        return ("g's backward must be the identity: the gradient of g's output is already complete on every "
                "rank; all-reducing it again multiplies it by t")
    if not tensors_close(o["dx"], o["dy"]):
        return "g's backward must return the incoming gradient unchanged"
    return None


def _carried_with_padding(carried, own) -> bool:
    """Did a reduce-scatter carry ``own`` (in any order, as the input may be cut along any dimension), padded with
    zeros to a multiple of the group's size or not?"""
    got = carried.reshape(-1).double() if isinstance(carried, torch.Tensor) else None
    if got is None or got.numel() < own.numel():
        return False
    padding = (got == 0).nonzero().flatten()[: got.numel() - own.numel()]
    if padding.numel() != got.numel() - own.numel():
        return False
    keep = torch.ones(got.numel(), dtype=torch.bool)
    keep[padding] = False
    return same_payload(got[keep], own, tol=1e-6, any_order=True)


def _f_g_traffic(name: str, o: dict) -> str | None:
    """The hint when f or g communicates other than one all-reduce in the one pass that needs it, or that
    all-reduce carries anything but the pass's own tensor (g: its input; f: the incoming gradient)."""
    passes = {"f": (o["events"], o["bwd_events"]), "g": (o["bwd_events"], o["events"])}[name]
    quiet, busy = passes
    quiet_pass, busy_pass = ("forward", "backward") if name == "f" else ("backward", "forward")
    if quiet:
        return (f"{name}'s {quiet_pass} pass must not communicate; it ran {describe_ops(quiet)}")
    ops = [e.op for e in busy]
    in_two_steps = all_reduce_in_two_steps(busy)
    if ops != ["all_reduce"] and not in_two_steps:
        gathered = "all_gather" in ops and "reduce_scatter" not in ops
        return (f"{name}'s {busy_pass} pass is exactly one all-reduce (a sum), or the reduce-scatter and all-gather "
                f"it is made of; it ran {describe_ops(busy)}"
                + (" -- gathering every rank's tensor and adding them by hand moves t times the data" if gathered
                   else ""))
    carried = (o["bwd_carried"] if name == "f" else o["carried"])[0]
    own = o["dy"] if name == "f" else o["x"]
    if in_two_steps:
        wrong = carried is not None and not _carried_with_padding(carried, own)
    else:
        wrong = carried is not None and not tensors_close(
            carried.reshape(own.shape) if carried.numel() == own.numel() else carried, own)
    if wrong:
        what = "the incoming gradient" if name == "f" else "its input"
        return (f"{name}'s all-reduce must carry {what} (a copy of it): the sum over the ranks of that tensor is "
                f"the result, whatever else gives the same numbers")
    return None


@exercise("f_and_g")
def check_f_g(f_cls, g_cls) -> bool:
    """``f_cls.apply(x, group)``: identity / all-reduce; ``g_cls.apply(x, group)``: all-reduce / identity."""
    if is_course_answer(f_cls, g_cls):
        return False
    try:
        res = launch_checked(_rank_f_g, world_size=2, f_cls=f_cls, g_cls=g_cls)
    except RankError as err:
        if err.exc_type == "NotImplementedError":
            return not_attempted(f"{getattr(f_cls, '__name__', 'f')} and {getattr(g_cls, '__name__', 'g')}")
        print(f"✗ rank {err.rank} raised {raised_line(err)}")
        if "modified by an inplace" in err.traceback or "leaf Variable" in err.traceback:
            print("  hint: all-reduce works in place: all-reduce a copy (x.clone()), not the input itself")
        elif "returned an incorrect number" in err.traceback or "incorrect number of gradients" in err.traceback:
            print("  hint: backward returns one value per forward input: (grad, None) -- None for the group")
        return False
    except LaunchTimeout:
        print("✗ the ranks waited for each other: f and g must issue the same collective on every rank")
        return False
    for r in res:
        for name, diag in (("f", diagnose_f), ("g", diagnose_g)):
            o = r[name]
            problem = call_problem(o)
            hint = problem or diag(o, 2) or _f_g_traffic(name, o)
            if hint:
                print(f"✗ operator {name} is wrong\n  hint: {hint}")
                return False
        m = r["mlp"]
        if max(m.values()) > 1e-5:
            print(f"✗ f and g pass alone but the MLP f -> fc1 -> gelu -> fc2 -> g differs from the dense one "
                  f"(output {m['y']:.2g}, dX {m['dx']:.2g}, dW {m['dw']:.2g})\n  hint: return the gradient "
                  f"as a new tensor, and keep no state between calls except ctx")
            return False
    print("✓ f and g are conjugate: f = identity forward / one all-reduce backward, g = one all-reduce forward / "
          "identity backward; the 2-rank MLP built from them equals the dense MLP (output, dX and dW)")
    return True


# ------------------------------------------------------------------ collectives


def _rank_measure_layer(sp: bool):
    g, t, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    cfg = TransformerConfig(hidden_size=16, num_attention_heads=4, sequence_parallel=sp)
    torch.manual_seed(0)
    layer = ParallelTransformerLayer(cfg, g)
    x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(1))
    x = (x.chunk(t)[r] if sp else x).clone().requires_grad_()
    with CommRecorder() as rec:
        layer(x).sum().backward()
    return rec.events


def measured_layer_collectives(tp: int = 2, sequence_parallel: bool = False) -> dict:
    """``{(direction, op): count}`` recorded for one ParallelTransformerLayer forward+backward."""
    events = launch(_rank_measure_layer, world_size=tp, output="none", timeout=30, sp=sequence_parallel)[0]
    counts: dict = {}
    for e in events:
        counts[(e.direction, e.op)] = counts.get((e.direction, e.op), 0) + 1
    return counts, events


def _fmt(counts: dict) -> str:
    return ", ".join(f"{d} {op} x{n}" for (d, op), n in sorted(counts.items())) or "nothing"


def _prediction_errors(guess: dict, counts: dict) -> str:
    """Which of the student's entries the recorded layer contradicts, and in which pass a collective they did not
    predict ran -- never the recorded counts themselves (a second try would copy them)."""
    wrong = [f"{d} {op} x{n}" for (d, op), n in sorted(guess.items()) if counts.get((d, op)) != n]
    unpredicted = sorted({d for (d, op) in counts if (d, op) not in guess})
    parts = [f"the recorded layer does not run {', '.join(wrong)}"] if wrong else []
    if unpredicted:
        parts.append(f"it runs a collective you did not predict in {' and '.join(unpredicted)}")
    return "; ".join(parts)


def _as_counts(guess) -> dict | None:
    """The prediction as ``{(direction, op): int}`` without zero entries, or None when it is not one."""
    if not isinstance(guess, dict):
        return None
    counts = {}
    for key, value in guess.items():
        number, reason = as_real(value)
        if reason or number != int(number) or not (isinstance(key, tuple) and len(key) == 2):
            return None
        if number:
            counts[tuple(key)] = int(number)
    return counts


@exercise("predict_collectives")
def check_collective_prediction(predict_collectives, predict_elements_sent) -> bool:
    """``predict_collectives(sequence_parallel) -> {(direction, op): count}`` for one layer (t=2), and
    ``predict_elements_sent(b, s, h, t) -> float``: elements one rank sends per layer, fwd+bwd, no SP."""
    measured_events = {}
    for sp in (False, True):
        run = run_student(predict_collectives, sp, references=references_for("predict_collectives"))
        if run.todo:
            return not_attempted("predict_collectives")
        if run.problem():
            print(f"✗ predict_collectives({sp}): {run.problem()}")
            return False
        counts, measured_events[sp] = measured_layer_collectives(2, sp)
        guess = _as_counts({} if run.value is None else run.value)
        if guess is None:
            print(f"✗ predict_collectives({sp}) returned {safe_repr(run.value)}: return a dict "
                  f"{{(direction, op): count}}, e.g. {{('fwd', 'all_reduce'): 2}}")
            return False
        if guess != counts:
            print(f"✗ sequence_parallel={sp}: you predicted {_fmt(guess)}; {_prediction_errors(guess, counts)}")
            if not any(d == "bwd" for d, _ in guess):
                print("  hint: the backward pass runs the conjugate of every forward collective (f's all-reduce "
                      "for each column-parallel GEMM)")
            elif not sp and guess.get(("fwd", "all_reduce")) != 2:
                print("  hint: one all-reduce after each row-parallel GEMM (attention's linear_proj, the MLP's "
                      "linear_fc2); the column-parallel GEMMs and the attention heads need none")
            elif sp and ("fwd", "all_reduce") in guess:
                print("  hint: with sequence parallelism each all-reduce becomes an all-gather before the "
                      "column-parallel GEMM and a reduce-scatter after the row-parallel GEMM")
            elif sp and guess.get(("bwd", "all_gather")) == 2:
                print("  hint: Megatron stores only the s/t input shard of each column-parallel GEMM and "
                      "all-gathers it again in backward for the weight gradient (tagged 'recompute')")
            else:
                print("  hint: count per GEMM: which of the four GEMMs has a collective before it, which after, "
                      "in each pass?")
            return False
    b, s, h, t = 2, 8, 16, 2
    measured = sum(e.ring_elements_sent for e in measured_events[False])
    hint = ("a ring all-reduce of N elements sends 2N(t-1)/t per rank; a layer all-reduces b*s*h elements twice "
            "forward and twice backward (per micro-batch)")
    rng = drawn_rng()  # two more shapes drawn for this run: no table of fixed shapes answers
    drawn = [(rng.randint(1, 16), 128 * rng.randint(1, 64), 256 * rng.randint(1, 64), rng.choice((2, 4, 8)), None)
             for _ in range(2)]
    for bb, ss, hh, tt, want in ((b, s, h, t, measured), *drawn):
        want = 8 * bb * ss * hh * (tt - 1) / tt if want is None else want
        run = run_student(predict_elements_sent, bb, ss, hh, tt, references=references_for("predict_collectives"))
        if run.todo:
            return not_attempted("predict_elements_sent")
        if run.error is not None or run.problem():
            print(f"✗ predict_elements_sent({bb}, {ss}, {hh}, {tt}): {run.problem()}")
            return False
        verdict = same_number(run.value, want, rel=1e-6)
        if not verdict:
            what = "the recorded wire" if (bb, ss, hh, tt) == (b, s, h, t) else "the ring's count for this layer"
            shown = f"returned {verdict.value:.6g}" if verdict.value is not None else verdict.reason
            print(f"✗ predict_elements_sent({bb}, {ss}, {hh}, {tt}): {shown} elements sent per rank, not {what}"
                  f"\n  hint: {hint}")
            return False
    print(f"✓ your predictions match the recorded collectives of a ParallelTransformerLayer on 2 ranks, "
          f"with and without sequence parallelism, and the {measured:,.0f} elements each rank sends per layer "
          f"and micro-batch (= 8·b·s·h·(t-1)/t, Narayanan et al. 2021)")
    return True
