"""Checkers for Lab 02 (tensor parallelism). Each runs the student's code on real ranks (or, for
the single-rank column split, in-process for every rank), compares it with the reference, and
prints one verdict line plus the most specific hint it can find. A function that still raises
``NotImplementedError`` gets a "not attempted yet" line, never an exception.

The checkers prove the *algorithm*, not only the numbers: ranks run on a process group that
records every operation (:mod:`course_lib.classroom.checks.wire`), so a row-parallel forward that gathers
its input and runs the dense GEMM, or a cross-entropy that gathers the logits, is refused with a
hint saying what the exercise asks for -- however the collective was called. Student code runs
through :func:`~course_lib.classroom.checks.verdicts.run_student`: a monkeypatch (``F.linear``, ...) is
undone and named, and a function that runs the course's own implementation is told so.

=========================================  ============================================================
checker                                    exercise
=========================================  ============================================================
check_column_parallel_forward(fn)          ``fn(x, weight, rank, world_size) -> Y_rank``
check_row_parallel_forward(fn)             ``fn(x_shard, weight, group) -> Y`` (exactly one all-reduce)
check_f_g(f_cls, g_cls)                    the conjugate operators as ``torch.autograd.Function``\\ s
check_tp_mlp_from_dense(fn)                ``fn(dense: DenseMLP, tp_group) -> ParallelMLP``
check_collective_prediction(fn, fe)        predicted collectives of a layer, and elements sent per rank
check_vocab_parallel_cross_entropy(fn)     ``fn(logits [s,b,V/t], target [s,b], group) -> loss [s,b]``
=========================================  ============================================================
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.classroom.checks import is_course_answer, not_attempted
from course_lib.classroom.checks.verdicts import (as_real, course_code_hint, describe_ops, launch_checked, portable,
                                        run_student, safe_repr, same_number, student_on_rank, wire_recorder)
from course_lib.comm import CommRecorder
from course_lib.launch import LaunchTimeout, RankError, launch
from course_lib.tensor_parallel import (ColumnParallelLinear, DenseMLP, ParallelMLP, ParallelTransformerLayer,
                                        RowParallelLinear, TransformerConfig, copy_dense_to_parallel,
                                        gather_full_grads, vocab_parallel_cross_entropy)
from course_lib.tensor_parallel import mappings
from course_lib.tensor_parallel.cross_entropy import _VocabParallelCrossEntropy

__all__ = ["check_column_parallel_forward", "check_row_parallel_forward", "check_f_g",
           "check_tp_mlp_from_dense", "check_collective_prediction", "check_vocab_parallel_cross_entropy"]

S, B, IN, OUT = 4, 2, 8, 12
# The course's own implementations of each exercise: running one inside the student's function is reported.
# (Methods, not classes: an autograd.Function class refers to itself through its backward class.)
COLUMN_REFS = (ColumnParallelLinear.forward,)
ROW_REFS = (RowParallelLinear.forward,)
F_G_REFS = (mappings._CopyToModelParallelRegion.forward, mappings._CopyToModelParallelRegion.backward,
            mappings._ReduceFromModelParallelRegion.forward, mappings._ReduceFromModelParallelRegion.backward,
            mappings.copy_to_tensor_model_parallel_region, mappings.reduce_from_tensor_model_parallel_region)
MLP_REFS = (copy_dense_to_parallel,)
CE_REFS = (vocab_parallel_cross_entropy, _VocabParallelCrossEntropy.forward, _VocabParallelCrossEntropy.backward)


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, B, IN, generator=g), torch.randn(OUT, IN, generator=g)


def _close(a, b, tol=1e-5) -> bool:
    """Same shape and values within ``tol`` (relative to the reference's scale), all finite; never raises."""
    try:
        if not isinstance(a, torch.Tensor) or tuple(a.shape) != tuple(b.shape) or a.is_complex():
            return False
        diff = (a.detach().double() - b.detach().double()).abs()
        return bool(torch.isfinite(diff).all()) and diff.max().item() <= tol * max(1.0, b.abs().max().item())
    except Exception:  # noqa: BLE001 - an odd answer is a wrong answer
        return False


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text


def _call_problem(result: dict) -> str | None:
    """The line for a call that patched the library or ran the course's own code, else None."""
    if result["patched"]:
        return (f"it replaced {', '.join(result['patched'][:3])} (undone by the checker): an exercise's function "
                f"must compute its answer, not change the library")
    if result["course_code"]:
        return course_code_hint(result["course_code"][0])
    return None


def _rank_failure(err: RankError, name: str, size_hint: str | None = None) -> bool:
    """Print the verdict for a rank that raised; ``not attempted`` for the stub. Returns False."""
    if err.exc_type == "NotImplementedError":
        return not_attempted(name)
    print(f"✗ rank {err.rank} raised {_last_line(err.traceback)}")
    if size_hint and ("shape" in err.traceback or "size" in err.traceback):
        print(f"  hint: {size_hint}")
    return False


# ------------------------------------------------------------------------- column


def diagnose_column(got, x, weight, rank, t) -> str | None:
    """The hint for one wrong column-parallel result, or None when right."""
    want = F.linear(x, weight.chunk(t, 0)[rank])
    if _close(got, want):
        return None
    if not isinstance(got, torch.Tensor):
        return f"return the output tensor Y_i (got {type(got).__name__})"
    if not bool(torch.isfinite(got).all()):
        return "the output holds NaN or inf: Y_i = F.linear(x, weight.chunk(t, dim=0)[rank]) is finite"
    full = F.linear(x, weight)
    if _close(got, full):
        return ("you returned the full output [s, b, out]: column-parallel rank i computes only its "
                "out/t features, Y_i = X A_i (take chunk `rank` of the weight's dim 0)")
    for other in range(t):
        if other != rank and _close(got, F.linear(x, weight.chunk(t, 0)[other])):
            return f"rank {rank} returned rank {other}'s shard: take chunk number `rank` (chunk(t, dim=0)[rank])"
    if got.shape[-1] == OUT // t and got.shape[:-1] == want.shape[:-1]:
        return "the shape is right but the values are not: Y_i = F.linear(x, weight.chunk(t, dim=0)[rank])"
    return (f"expected shape {tuple(want.shape)} = [s, b, out/t], got {tuple(got.shape)}: nn.Linear stores "
            f"A transposed as [out, in], so the column (output-feature) split is dim 0 of `weight`")


def check_column_parallel_forward(fn) -> bool:
    """``fn(x [s,b,in], weight [out,in], rank, world_size) -> [s, b, out/world_size]``; no communication."""
    if is_course_answer(fn):
        return False
    x, w = _data()
    for t in (2, 4):
        for rank in range(t):
            run = run_student(fn, x.clone(), w.clone(), rank, t, references=COLUMN_REFS)
            if run.todo:
                return not_attempted("column_parallel_forward")
            if run.error is not None:
                exc = run.error
                print(f"✗ rank {rank} of {t} raised {type(exc).__name__}: {exc}")
                if "shape" in str(exc) or "size" in str(exc):
                    print("  hint: split the weight's dim 0 (output features), not dim 1: "
                          "weight.chunk(world_size, dim=0)[rank] has shape [out/t, in]")
                return False
            if run.problem():
                print(f"✗ {run.problem()}")
                return False
            hint = diagnose_column(run.value, x, w, rank, t)
            if hint:
                print(f"✗ wrong on rank {rank} of {t}\n  hint: {hint}")
                return False
    print("✓ column_parallel_forward: every rank's Y_i equals its slice of X A for t = 2 and 4; "
          "concatenating the Y_i gives the dense output, and no rank communicated")
    return True


# ---------------------------------------------------------------------------- row

ROW_ALGORITHM = ("row-parallel rank i multiplies only its own slice x_shard by its rows of the weight "
                 "(weight.chunk(t, dim=1)[rank]) and the partial sums are added by exactly one all-reduce")


def _rank_row(fn):
    t, r = dist.get_world_size(), dist.get_rank()
    x, w = _data(1)
    x_shard = x.chunk(t, -1)[r].contiguous()
    result = student_on_rank(fn, x_shard.clone(), w.clone(), dist.group.WORLD, references=ROW_REFS)
    return dict(result, x=x, w=w, rank=r, t=t)


def diagnose_row(got, x, w, rank, t) -> str | None:
    """The hint for a wrong row-parallel output (values only), or None when the values are right."""
    want = F.linear(x, w)
    if _close(got, want):
        return None
    if not isinstance(got, torch.Tensor):
        return f"return the output tensor Y (got {got if isinstance(got, str) else type(got).__name__})"
    partial = F.linear(x.chunk(t, -1)[rank], w.chunk(t, 1)[rank])
    if _close(got, partial):
        return ("this is only rank's partial sum X_i A_i: all-reduce it over `group` "
                "(dist.all_reduce(y, group=group)) -- that all-reduce is the g operator")
    if _close(got, want / t):
        return ("the result is t times too small: op=ReduceOp.AVG divides the sum by t, but the partial sums "
                "X_i A_i must be added -- all-reduce with the default op, ReduceOp.SUM")
    if _close(got, want * t):
        return "the result is t times too large: all-reduce once, and do not also sum the ranks by hand"
    if got.shape != want.shape:
        return (f"expected the full output [s, b, out] = {tuple(want.shape)}, got {tuple(got.shape)}: row-parallel "
                f"splits the weight's dim 1 (input features), so each rank's X_i A_i is already full size")
    return ("wrong values: rank i must use chunk i of the weight's dim 1 (input features), matching its "
            "slice of x: weight.chunk(t, dim=1)[rank]")


def diagnose_row_traffic(events) -> str | None:
    """The hint when the row-parallel forward did not communicate as one all-reduce (sum), else None."""
    others = [e for e in events if e.op != "all_reduce"]
    if any(e.op == "all_gather" for e in others):
        return ("you all-gathered (ran " + describe_ops(events) + "): gathering x and running the dense GEMM "
                "gives the right numbers, but it is not tensor parallelism -- " + ROW_ALGORITHM)
    if others:
        return f"it ran {describe_ops(events)}: {ROW_ALGORITHM}"
    reduces = [e for e in events if e.op == "all_reduce"]
    if len(reduces) != 1:
        return f"it ran {describe_ops(events) if reduces else 'no collective'}: {ROW_ALGORITHM}"
    if reduces[0].reduce_op not in (None, "sum"):
        return (f"the all-reduce used op {reduces[0].reduce_op.upper()}: the partial sums are added, "
                f"ReduceOp.SUM (the default)")
    return None


def _row_hint(r: dict) -> str | None:
    """The one hint for a rank's row-parallel result: a patch or the course's code, then gathering
    (right numbers, wrong algorithm), then wrong values, then any other traffic; None when right."""
    problem = _call_problem(r)
    if problem:
        return problem
    traffic = diagnose_row_traffic(r["events"])
    if traffic and any(e.op == "all_gather" for e in r["events"]):
        return traffic
    return diagnose_row(r["value"], r["x"], r["w"], r["rank"], r["t"]) or traffic


def check_row_parallel_forward(fn) -> bool:
    """``fn(x_shard [s,b,in/t], weight [out,in], group) -> Y [s,b,out]`` on every rank, one all-reduce."""
    if is_course_answer(fn):
        return False
    for t in (2, 4):
        try:
            res = launch_checked(_rank_row, world_size=t, fn=fn)
        except RankError as err:
            return _rank_failure(err, "row_parallel_forward",
                                 "x_shard has in/t features: use weight.chunk(t, dim=1)[rank] ([out, in/t]), "
                                 "with t = dist.get_world_size(group) and rank = dist.get_rank(group)")
        except LaunchTimeout:
            print(f"✗ with {t} ranks the ranks waited for each other: every rank must call the same "
                  f"all-reduce on the same group")
            return False
        for r in res:
            hint = _row_hint(r)
            if hint:
                print(f"✗ rank {r['rank']} of {t}\n  hint: {hint}")
                return False
    print("✓ row_parallel_forward: every rank ends with the dense output X A for t = 2 and 4, "
          "after exactly one all-reduce of the partial sums and no other communication")
    return True


# ----------------------------------------------------------------------------- f/g


def _rank_f_g(f_cls, g_cls):
    g, t, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    gen = lambda q: torch.Generator().manual_seed(50 + q)  # noqa: E731
    xs = [torch.randn(3, 4, generator=gen(q)) for q in range(t)]
    dys = [torch.randn(3, 4, generator=gen(10 + q)) for q in range(t)]
    out = {}

    def phases(cls, x, dy):
        """What cls.apply(x, group) does in each pass: y, dx and the ops of each pass, recorded apart."""
        x = x.clone().requires_grad_()
        with wire_recorder() as fwd:
            run = run_student(cls.apply, x, g, references=F_G_REFS)
        if run.error is not None:
            raise run.error
        y = run.value
        info = dict(patched=run.patched, course_code=run.course_code, events=list(fwd.events), bwd_events=[],
                    dx=None, y=portable(y))
        if isinstance(y, torch.Tensor) and y.requires_grad:
            with wire_recorder() as bwd:
                back = run_student(y.backward, dy.clone(), references=F_G_REFS)
            if back.error is not None:
                raise back.error
            info.update(patched=run.patched + back.patched, course_code=run.course_code + back.course_code,
                        bwd_events=list(bwd.events), dx=x.grad)
        return info

    # f alone: forward identity, backward all-reduce (f's input is the same on every rank)
    out["f"] = dict(phases(f_cls, xs[0], dys[r]), x=xs[0], dy=dys[r], dysum=sum(dys))
    # g alone: forward all-reduce, backward identity (g's output, so its gradient, is the same on every rank)
    out["g"] = dict(phases(g_cls, xs[r], dys[0]), x=xs[r], xsum=sum(xs), dy=dys[0])
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

    def mlp():
        yp = g_cls.apply(F.linear(F.gelu(F.linear(f_cls.apply(xp, g), w1)), w2), g)
        yp.sum().backward()
        return yp

    yp = student_on_rank(mlp)["value"]
    out["mlp"] = dict(y=(yp - yd).abs().max().item(), dx=(xp.grad - xd.grad).abs().max().item(),
                      dw=max((w1.grad - dense.linear_fc1.weight.grad.chunk(t, 0)[r]).abs().max().item(),
                             (w2.grad - dense.linear_fc2.weight.grad.chunk(t, 1)[r]).abs().max().item()))
    return out


def diagnose_f(o, t) -> str | None:
    if not _close(o["y"], o["x"]):
        if _close(o["y"], o["x"] * t):
            return "f's forward must be the identity (return x): you all-reduced in the forward pass"
        return "f's forward must return its input unchanged"
    if o["dx"] is None:
        return "f's backward must return the gradient (and None for the group argument)"
    if _close(o["dx"], o["dy"]):
        return ("f's backward must all-reduce the gradient over the group: every rank used the whole input, "
                "so its gradient is the sum of the ranks' partial gradients")
    if _close(o["dx"], o["dysum"] / t):
        return ("f's backward is t times too small: op=ReduceOp.AVG divides by t, but the ranks' partial "
                "gradients are added (ReduceOp.SUM, the default)")
    if not _close(o["dx"], o["dysum"]):
        return "f's backward should return the all-reduced (summed over ranks) gradient"
    return None


def diagnose_g(o, t) -> str | None:
    if not _close(o["y"], o["xsum"]):
        if _close(o["y"], o["x"]):
            return "g's forward must all-reduce (sum) its input over the group: each rank holds a partial sum"
        if _close(o["y"], o["xsum"] / t):
            return ("g's forward is t times too small: op=ReduceOp.AVG divides by t, but the partial sums are "
                    "added (ReduceOp.SUM, the default)")
        return "g's forward must return the sum over ranks of its input (dist.all_reduce on a copy)"
    if o["dx"] is None:
        return "g's backward must return the gradient (and None for the group argument)"
    if _close(o["dx"], o["dy"] * t):
        return ("g's backward must be the identity: the gradient of g's output is already complete on every "
                "rank; all-reducing it again multiplies it by t")
    if not _close(o["dx"], o["dy"]):
        return "g's backward must return the incoming gradient unchanged"
    return None


def _f_g_traffic(name: str, o: dict) -> str | None:
    """The hint when f or g communicates other than one all-reduce in the one pass that needs it."""
    passes = {"f": (o["events"], o["bwd_events"]), "g": (o["bwd_events"], o["events"])}[name]
    quiet, busy = passes
    quiet_pass, busy_pass = ("forward", "backward") if name == "f" else ("backward", "forward")
    if quiet:
        return (f"{name}'s {quiet_pass} pass must not communicate; it ran {describe_ops(quiet)}")
    if [e.op for e in busy] != ["all_reduce"]:
        return (f"{name}'s {busy_pass} pass is exactly one all-reduce (a sum); it ran {describe_ops(busy)} -- "
                f"gathering every rank's tensor and adding them by hand moves t times the data")
    return None


def check_f_g(f_cls, g_cls) -> bool:
    """``f_cls.apply(x, group)``: identity / all-reduce; ``g_cls.apply(x, group)``: all-reduce / identity."""
    if is_course_answer(f_cls, g_cls):
        return False
    try:
        res = launch_checked(_rank_f_g, world_size=2, f_cls=f_cls, g_cls=g_cls)
    except RankError as err:
        if err.exc_type == "NotImplementedError":
            return not_attempted(f"{getattr(f_cls, '__name__', 'f')} and {getattr(g_cls, '__name__', 'g')}")
        print(f"✗ rank {err.rank} raised {_last_line(err.traceback)}")
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
            problem = _call_problem(o)
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


# ---------------------------------------------------------------------- TP MLP


def _rank_mlp_from_dense(fn):
    g, t, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    cfg = TransformerConfig(hidden_size=8, num_attention_heads=2, ffn_hidden_size=16)
    torch.manual_seed(11)
    dense = DenseMLP(cfg)
    with torch.no_grad():  # non-zero biases, so a wrongly split bias shows
        for p in (dense.linear_fc1.bias, dense.linear_fc2.bias):
            p.normal_()
    want = {"linear_fc1.weight": dense.linear_fc1.weight.detach().chunk(t, 0)[r].clone(),
            "linear_fc1.bias": dense.linear_fc1.bias.detach().chunk(t, 0)[r].clone(),
            "linear_fc2.weight": dense.linear_fc2.weight.detach().chunk(t, 1)[r].clone(),
            "linear_fc2.bias": dense.linear_fc2.bias.detach().clone()}
    run = run_student(fn, dense, g, references=MLP_REFS)
    if run.error is not None:
        raise run.error
    par = run.value
    info = dict(type=type(par).__name__, patched=run.patched, course_code=run.course_code)
    if not isinstance(par, ParallelMLP) or _call_problem(info):
        return info
    info["shapes"] = {n: tuple(p.shape) for n, p in par.named_parameters()}
    info["want_shapes"] = {n: tuple(v.shape) for n, v in want.items()}
    if info["shapes"] != info["want_shapes"]:
        return info
    info["wrong"] = [n for n, p in par.named_parameters() if not torch.equal(p.detach(), want[n])]
    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(5))
    xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    yd, yp = dense(xd), par(xp)
    yd.sum().backward()
    yp.sum().backward()
    grads = gather_full_grads(par, g)
    info["errors"] = dict(y=(yp - yd).abs().max().item(), dx=(xp.grad - xd.grad).abs().max().item(),
                          grads=max((grads[n] - p.grad).abs().max().item() for n, p in dense.named_parameters()))
    return info


_SHAPE_HINTS = {
    "linear_fc1.weight": "linear_fc1 is column-parallel: keep chunk `rank` of the weight's dim 0 -> [ffn/t, h]",
    "linear_fc1.bias": "linear_fc1's bias is split like its output features: chunk `rank` of the bias -> [ffn/t]",
    "linear_fc2.weight": "linear_fc2 is row-parallel: keep chunk `rank` of the weight's dim 1 -> [h, ffn/t]",
    "linear_fc2.bias": ("linear_fc2's bias is NOT split: every rank keeps the full [h] vector, added once after "
                        "the all-reduce"),
}


def check_tp_mlp_from_dense(fn) -> bool:
    """``fn(dense: DenseMLP, tp_group) -> ParallelMLP`` holding this rank's slices of the dense weights."""
    if is_course_answer(fn):
        return False
    try:
        res = launch_checked(_rank_mlp_from_dense, world_size=2, fn=fn)
    except RankError as err:
        if err.exc_type == "NotImplementedError":
            return not_attempted("tp_mlp_from_dense")
        print(f"✗ rank {err.rank} raised {_last_line(err.traceback)}")
        tb = err.traceback
        for name, hint in _SHAPE_HINTS.items():
            if name.split(".")[0] in tb and name.split(".")[1] in tb and ("size" in tb or "shape" in tb):
                print(f"  hint: {hint}")
                break
        else:
            if "size" in tb or "shape" in tb:
                print("  hint: " + "; ".join(_SHAPE_HINTS.values()))
        return False
    except LaunchTimeout:
        print("✗ the ranks waited for each other: building the layer needs no communication")
        return False
    for rank, info in enumerate(res):
        problem = _call_problem(info)
        if problem:
            print(f"✗ {problem}")
            return False
        if info["type"] != "ParallelMLP":
            print(f"✗ rank {rank} returned a {info['type']}: build a ParallelMLP(dense.config, tp_group) and copy "
                  f"this rank's slices into it (under torch.no_grad())")
            return False
        for name, want in info["want_shapes"].items():
            if info["shapes"].get(name) != want:
                print(f"✗ {name} has shape {info['shapes'].get(name)} on rank {rank}, expected {want}\n"
                      f"  hint: {_SHAPE_HINTS[name]}")
                return False
        if info["wrong"]:
            name = info["wrong"][0]
            print(f"✗ rank {rank}: {name} does not hold this rank's slice of the dense tensor\n"
                  f"  hint: {_SHAPE_HINTS[name]}; copy it with .copy_() under torch.no_grad()")
            return False
        if max(info["errors"].values()) > 1e-5:
            print(f"✗ the weights look right but the output differs by {info['errors']['y']:.2g}")
            return False
    print("✓ tp_mlp_from_dense: on 2 ranks the TP MLP equals the dense MLP -- output, input gradient and every "
          "re-assembled weight gradient (max abs error <= 1e-5)")
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


def check_collective_prediction(predict_collectives, predict_elements_sent) -> bool:
    """``predict_collectives(sequence_parallel) -> {(direction, op): count}`` for one layer (t=2), and
    ``predict_elements_sent(b, s, h, t) -> float``: elements one rank sends per layer, fwd+bwd, no SP."""
    measured_events = {}
    for sp in (False, True):
        run = run_student(predict_collectives, sp)
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
            print(f"✗ sequence_parallel={sp}: you predicted {_fmt(guess)}; measured {_fmt(counts)}")
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
    for bb, ss, hh, tt, want in ((b, s, h, t, measured), (1, 2048, 12288, 8, None), (b, s, h, 4, None)):
        want = 8 * bb * ss * hh * (tt - 1) / tt if want is None else want
        run = run_student(predict_elements_sent, bb, ss, hh, tt)
        if run.todo:
            return not_attempted("predict_elements_sent")
        if run.error is not None or run.problem():
            print(f"✗ predict_elements_sent({bb}, {ss}, {hh}, {tt}): {run.problem()}")
            return False
        verdict = same_number(run.value, want, rel=1e-6)
        if not verdict:
            what = "measured" if (bb, ss, hh, tt) == (b, s, h, t) else "expected"
            print(f"✗ predict_elements_sent({bb}, {ss}, {hh}, {tt}): {verdict.reason.replace('expected', what)} "
                  f"elements sent per rank\n  hint: {hint}")
            return False
    print(f"✓ your predictions match the recorded collectives of a ParallelTransformerLayer on 2 ranks, "
          f"with and without sequence parallelism, and the {measured:,.0f} elements each rank sends per layer "
          f"and micro-batch (= 8·b·s·h·(t-1)/t, Narayanan et al. 2021)")
    return True


# ------------------------------------------------------------- vocab-parallel cross-entropy

CE_S, CE_B, CE_V = 4, 2, 16
CE_CASES = (("logits near 1000", 30.0, 1000.0), ("ordinary logits", 2.0, 0.0))
CE_ALGORITHM = ("only per-token numbers cross the wire: all-reduce the max logit (op=MAX), the target's logit "
                "and the sum of exp(logit - max), [s, b] each -- never the [s, b, V] logits")


def _rank_vocab_ce(fn):
    g, t, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(7)
    out = []
    for name, scale, offset in CE_CASES:
        full = torch.randn(CE_S, CE_B, CE_V, generator=gen) * scale + offset
        target = torch.randint(0, CE_V, (CE_S, CE_B), generator=gen)
        result = student_on_rank(fn, full.chunk(t, -1)[r].contiguous(), target.clone(), g, references=CE_REFS)
        out.append(dict(result, case=name, full=full, target=target, rank=r, t=t))
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


def diagnose_vocab_ce(value, full, target, rank, t) -> str | None:
    """The hint for a wrong per-token loss (values only), or None when right."""
    want = F.cross_entropy(full.double().reshape(-1, full.shape[-1]), target.reshape(-1),
                           reduction="none").view(target.shape)
    if _close(value, want, tol=1e-5):
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
        if _close(value, guess, tol=1e-5):
            return hint
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
    problem = _call_problem(r)
    if problem:
        return problem
    traffic = diagnose_vocab_ce_traffic(r["events"], CE_S, CE_B)
    if traffic and any(e.op != "all_reduce" or e.numel > 2 * CE_S * CE_B for e in r["events"]):
        return traffic
    values = diagnose_vocab_ce(r["value"], r["full"], r["target"], r["rank"], r["t"])
    if values and "overflowed" in values:
        return values
    return traffic or values


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
            print(f"✗ with {t} ranks, rank {err.rank} raised {_last_line(err.traceback)}")
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
