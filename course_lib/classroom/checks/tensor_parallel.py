"""Checkers for the tensor-parallel layers (Lab 02): column- and row-parallel linear, the TP MLP.

Each runs the student's code on real ranks (or, for the single-rank column split, in-process for
every rank), compares it with the dense reference (Megatron's ``megatron/core/tensor_parallel/layers.py``
semantics), and prints one verdict line plus the most specific hint it can find. A function that still
raises ``NotImplementedError`` gets a "not attempted yet" line, never an exception.

The checkers prove the *algorithm*, not only the numbers: ranks run on a process group that
records every operation and what it carried (:mod:`course_lib.classroom.checks.wire`), so a
row-parallel forward that gathers its input and runs the dense GEMM is refused with a hint saying what
the exercise asks for -- however the collective was called -- and so is one whose single all-reduce
carries anything but the rank's partial sum; each rank's input slice is drawn from ``os.urandom``, so
no rank can rebuild the others'. Student code runs through
:func:`~course_lib.classroom.checks.tamper_guard.run_student`: a monkeypatch (``F.linear``, ...) is undone
and named, and a function that runs the course's own implementation is told so.

=========================================  ============================================================
checker                                    exercise
=========================================  ============================================================
check_column_parallel_forward(fn)          ``fn(x, weight, rank, world_size) -> Y_rank``
check_row_parallel_forward(fn)             ``fn(x_shard, weight, group) -> Y`` (exactly one all-reduce)
check_tp_mlp_from_dense(fn)                ``fn(dense: DenseMLP, tp_group) -> ParallelMLP``
=========================================  ============================================================

The f/g operators and the layer's collectives are in :mod:`course_lib.classroom.checks.tp_communication`,
the vocab-parallel cross-entropy in :mod:`course_lib.classroom.checks.vocab_parallel`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.classroom.checks import is_course_answer, not_attempted, raised_line
from course_lib.classroom.checks.exercise import exercise
from course_lib.classroom.checks.references import references_for
from course_lib.classroom.checks.student_process import run_on_rank, student_on_rank
from course_lib.classroom.checks.tamper_guard import call_problem, run_student
from course_lib.classroom.checks.verdicts import (all_reduce_in_two_steps, carried_by, describe_ops, drawn_rng,
                                                  launch_checked, same_payload, secret_generator, tensors_close)
from course_lib.launch import LaunchTimeout, RankError
from course_lib.tensor_parallel import DenseMLP, ParallelMLP, TransformerConfig, gather_full_grads

__all__ = ["check_column_parallel_forward", "check_row_parallel_forward", "check_tp_mlp_from_dense"]

S, B, IN, OUT = 4, 2, 8, 12


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, B, IN, generator=g), torch.randn(OUT, IN, generator=g)


def _rank_failure(err: RankError, name: str, size_hint: str | None = None) -> bool:
    """Print the verdict for a rank that raised; ``not attempted`` for the stub. Returns False."""
    if err.exc_type == "NotImplementedError":
        return not_attempted(name)
    print(f"✗ rank {err.rank} raised {raised_line(err)}")
    if size_hint and ("shape" in err.traceback or "size" in err.traceback):
        print(f"  hint: {size_hint}")
    return False


# ------------------------------------------------------------------------- column


def diagnose_column(got, x, weight, rank, t) -> str | None:
    """The hint for one wrong column-parallel result, or None when right."""
    want = F.linear(x, weight.chunk(t, 0)[rank])
    if tensors_close(got, want):
        return None
    if not isinstance(got, torch.Tensor):
        return f"return the output tensor Y_i (got {type(got).__name__})"
    if not bool(torch.isfinite(got).all()):
        return "the output holds NaN or inf: Y_i = F.linear(x, weight.chunk(t, dim=0)[rank]) is finite"
    full = F.linear(x, weight)
    if tensors_close(got, full):
        return ("you returned the full output [s, b, out]: column-parallel rank i computes only its "
                "out/t features, Y_i = X A_i (take chunk `rank` of the weight's dim 0)")
    for other in range(t):
        if other != rank and tensors_close(got, F.linear(x, weight.chunk(t, 0)[other])):
            return f"rank {rank} returned rank {other}'s shard: take chunk number `rank` (chunk(t, dim=0)[rank])"
    if got.shape[-1] == OUT // t and got.shape[:-1] == want.shape[:-1]:
        return "the shape is right but the values are not: Y_i = F.linear(x, weight.chunk(t, dim=0)[rank])"
    return (f"expected shape {tuple(want.shape)} = [s, b, out/t], got {tuple(got.shape)}: nn.Linear stores "
            f"A transposed as [out, in], so the column (output-feature) split is dim 0 of `weight`")


@exercise("column_parallel_forward")
def check_column_parallel_forward(fn) -> bool:
    """``fn(x [s,b,in], weight [out,in], rank, world_size) -> [s, b, out/world_size]``; no communication."""
    if is_course_answer(fn):
        return False
    x, w = _data(drawn_rng().randrange(2**31))   # drawn for this run: no table of outputs answers
    for t in (2, 4):
        for rank in range(t):
            run = run_student(fn, x.clone(), w.clone(), rank, t, references=references_for("column_parallel_forward"))
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
    print("✓ column_parallel_forward: every rank's Y_i equals its slice of X A for t = 2 and 4 (inputs drawn for "
          "this run), computed with no process group: each rank needs only its own rows of the weight")
    return True


# ---------------------------------------------------------------------------- row

ROW_ALGORITHM = ("row-parallel rank i multiplies only its own slice x_shard by its rows of the weight "
                 "(weight.chunk(t, dim=1)[rank]) and the partial sums are added by exactly one all-reduce "
                 "(or the reduce-scatter and all-gather it is made of)")


def _rank_row(fn):
    t, r = dist.get_world_size(), dist.get_rank()
    _, w = _data(1)
    x_shard = torch.randn(S, B, IN // t, generator=secret_generator())   # no other rank can rebuild it
    result = student_on_rank(fn, x_shard.clone(), w.clone(), dist.group.WORLD,
                             references=references_for("row_parallel_forward"))
    shards = [torch.empty_like(x_shard) for _ in range(t)]
    dist.all_gather(shards, x_shard)                   # the truth, from what the ranks really hold
    return dict(result, x=torch.cat(shards, -1), w=w, rank=r, t=t)


def diagnose_row(got, x, w, rank, t) -> str | None:
    """The hint for a wrong row-parallel output (values only), or None when the values are right."""
    want = F.linear(x, w)
    if tensors_close(got, want):
        return None
    if not isinstance(got, torch.Tensor):
        return f"return the output tensor Y (got {got if isinstance(got, str) else type(got).__name__})"
    partial = F.linear(x.chunk(t, -1)[rank], w.chunk(t, 1)[rank])
    if tensors_close(got, partial):
        return ("this is only rank's partial sum X_i A_i: all-reduce it over `group` "
                "(dist.all_reduce(y, group=group)) -- that all-reduce is the g operator")
    if tensors_close(got, want / t):
        return ("the result is t times too small: op=ReduceOp.AVG divides the sum by t, but the partial sums "
                "X_i A_i must be added -- all-reduce with the default op, ReduceOp.SUM")
    if tensors_close(got, want * t):
        return "the result is t times too large: all-reduce once, and do not also sum the ranks by hand"
    if got.shape != want.shape:
        return (f"expected the full output [s, b, out] = {tuple(want.shape)}, got {tuple(got.shape)}: row-parallel "
                f"splits the weight's dim 1 (input features), so each rank's X_i A_i is already full size")
    return ("wrong values: rank i must use chunk i of the weight's dim 1 (input features), matching its "
            "slice of x: weight.chunk(t, dim=1)[rank]")


def diagnose_row_traffic(events) -> str | None:
    """The hint when the row-parallel forward did not communicate as one all-reduce (sum) or its two halves,
    else None."""
    if all_reduce_in_two_steps(events):
        return None
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
    (right numbers, wrong algorithm), then wrong values, then any other traffic, then what the all-reduce
    carried (this rank's partial sum X_i A_i, nothing else); None when right."""
    problem = call_problem(r)
    if problem:
        return problem
    traffic = diagnose_row_traffic(r["events"])
    if traffic and any(e.op == "all_gather" for e in r["events"]):
        return traffic
    hint = diagnose_row(r["value"], r["x"], r["w"], r["rank"], r["t"]) or traffic
    if hint:
        return hint
    partial = F.linear(r["x"].chunk(r["t"], -1)[r["rank"]], r["w"].chunk(r["t"], 1)[r["rank"]])
    if not all(same_payload(c, partial, tol=1e-5) for c in carried_by(r, "all_reduce") if c is not None):
        return ("your all-reduce did not carry your partial sum X_i A_i: the numbers are right, but the only thing "
                "row-parallel ranks exchange is each rank's partial product -- " + ROW_ALGORITHM)
    if not all(same_payload(c, partial, tol=1e-5, any_order=True) for c in carried_by(r, "reduce_scatter")
               if c is not None):
        return ("your reduce-scatter did not carry your partial sum X_i A_i: the numbers are right, but the only "
                "thing row-parallel ranks exchange is each rank's partial product -- " + ROW_ALGORITHM)
    return None


@exercise("row_parallel_forward")
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
          "after exactly one all-reduce of the partial sums (or its reduce-scatter and all-gather) and no other "
          "communication")
    return True


# ---------------------------------------------------------------------- TP MLP


def _mlp_parameters(value) -> dict:
    """In the student process, after the call: the returned layer's type name and, for a ParallelMLP, its
    parameters by name (plain tensors)."""
    out = {"type": type(value).__name__}
    if isinstance(value, ParallelMLP):
        out["parameters"] = {n: p.detach().clone() for n, p in value.named_parameters()}
    return out


def _rank_mlp_from_dense(fn, seed: int):
    g, t, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    cfg = TransformerConfig(hidden_size=8, num_attention_heads=2, ffn_hidden_size=16)
    torch.manual_seed(seed)  # the same dense MLP on every rank, drawn for this run
    dense = DenseMLP(cfg)
    with torch.no_grad():  # non-zero biases, so a wrongly split bias shows
        for p in (dense.linear_fc1.bias, dense.linear_fc2.bias):
            p.normal_()
    want = {"linear_fc1.weight": dense.linear_fc1.weight.detach().chunk(t, 0)[r].clone(),
            "linear_fc1.bias": dense.linear_fc1.bias.detach().chunk(t, 0)[r].clone(),
            "linear_fc2.weight": dense.linear_fc2.weight.detach().chunk(t, 1)[r].clone(),
            "linear_fc2.bias": dense.linear_fc2.bias.detach().clone()}
    run = run_on_rank(fn, dense, g, references=references_for("tp_mlp_from_dense"), summarize=_mlp_parameters)
    if run.error is not None:
        raise run.error
    info = dict(type=run.value["type"], patched=run.patched, course_code=run.course_code)
    if "parameters" not in run.value or call_problem(info):
        return info
    params = run.value["parameters"]
    info["shapes"] = {n: tuple(p.shape) for n, p in params.items()}
    info["want_shapes"] = {n: tuple(v.shape) for n, v in want.items()}
    if info["shapes"] != info["want_shapes"]:
        return info
    info["wrong"] = [n for n, p in params.items() if not torch.equal(p, want[n])]
    par = ParallelMLP(cfg, g)  # the course's layer with the student's slices: the exercise is what it holds
    with torch.no_grad():
        for n, p in par.named_parameters():
            p.copy_(params[n])
    x = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(seed + 1))
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


@exercise("tp_mlp_from_dense")
def check_tp_mlp_from_dense(fn) -> bool:
    """``fn(dense: DenseMLP, tp_group) -> ParallelMLP`` holding this rank's slices of the dense weights."""
    if is_course_answer(fn):
        return False
    try:
        res = launch_checked(_rank_mlp_from_dense, world_size=2, fn=fn, seed=drawn_rng().randrange(2**31))
    except RankError as err:
        if err.exc_type == "NotImplementedError":
            return not_attempted("tp_mlp_from_dense")
        print(f"✗ rank {err.rank} raised {raised_line(err)}")
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
        problem = call_problem(info)
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
    print("✓ tp_mlp_from_dense: on 2 ranks the TP MLP equals a dense MLP drawn for this run -- output, input "
          "gradient and every re-assembled weight gradient (max abs error <= 1e-5)")
    return True
