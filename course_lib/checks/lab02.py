"""Checkers for Lab 02 (tensor parallelism). Each runs the student's code on real ranks (or, for
the single-rank column split, in-process for every rank), compares it with the reference, and
prints one verdict line plus the most specific hint it can find. A function that still raises
``NotImplementedError`` gets a "not attempted yet" line, never an exception.

===================================  ============================================================
checker                              exercise
===================================  ============================================================
check_column_parallel_forward(fn)    ``fn(x, weight, rank, world_size) -> Y_rank``
check_row_parallel_forward(fn)       ``fn(x_shard, weight, group) -> Y`` (one all-reduce)
check_f_g(f_cls, g_cls)              the conjugate operators as ``torch.autograd.Function``\\ s
check_tp_mlp_from_dense(fn)          ``fn(dense: DenseMLP, tp_group) -> ParallelMLP``
check_collective_prediction(fn, fe)  predicted collectives of a layer, and elements sent per rank
===================================  ============================================================
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_lib.checks import not_attempted
from course_lib.comm import CommRecorder
from course_lib.launch import LaunchTimeout, RankError, launch
from course_lib.tensor_parallel import (DenseMLP, ParallelMLP, ParallelTransformerLayer, TransformerConfig,
                                        gather_full_grads)

__all__ = ["check_column_parallel_forward", "check_row_parallel_forward", "check_f_g",
           "check_tp_mlp_from_dense", "check_collective_prediction"]

S, B, IN, OUT = 4, 2, 8, 12


def _data(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, B, IN, generator=g), torch.randn(OUT, IN, generator=g)


def _close(a, b, tol=1e-5) -> bool:
    return isinstance(a, torch.Tensor) and a.shape == b.shape and (a - b).abs().max().item() <= tol


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text


# ------------------------------------------------------------------------- column


def diagnose_column(got, x, weight, rank, t) -> str | None:
    """The hint for one wrong column-parallel result, or None when right."""
    want = F.linear(x, weight.chunk(t, 0)[rank])
    if _close(got, want):
        return None
    if not isinstance(got, torch.Tensor):
        return f"return the output tensor Y_i (got {type(got).__name__})"
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
    x, w = _data()
    for t in (2, 4):
        for rank in range(t):
            try:
                got = fn(x.clone(), w.clone(), rank, t)
            except NotImplementedError:
                return not_attempted("column_parallel_forward")
            except Exception as exc:  # noqa: BLE001 - shown to the student
                print(f"✗ rank {rank} of {t} raised {type(exc).__name__}: {exc}")
                if "shape" in str(exc) or "size" in str(exc):
                    print("  hint: split the weight's dim 0 (output features), not dim 1: "
                          "weight.chunk(world_size, dim=0)[rank] has shape [out/t, in]")
                return False
            hint = diagnose_column(got, x, w, rank, t)
            if hint:
                print(f"✗ wrong on rank {rank} of {t}\n  hint: {hint}")
                return False
    print("✓ column_parallel_forward: every rank's Y_i equals its slice of X A for t = 2 and 4; "
          "concatenating the Y_i gives the dense output, and no rank communicated")
    return True


# ---------------------------------------------------------------------------- row


def _rank_row(fn):
    t, r = dist.get_world_size(), dist.get_rank()
    x, w = _data(1)
    got = fn(x.chunk(t, -1)[r].contiguous().clone(), w.clone(), dist.group.WORLD)
    return dict(got=got, x=x, w=w, rank=r, t=t)


def diagnose_row(got, x, w, rank, t) -> str | None:
    want = F.linear(x, w)
    if _close(got, want):
        return None
    if not isinstance(got, torch.Tensor):
        return f"return the output tensor Y (got {type(got).__name__})"
    partial = F.linear(x.chunk(t, -1)[rank], w.chunk(t, 1)[rank])
    if _close(got, partial):
        return ("this is only rank's partial sum X_i A_i: all-reduce it over `group` "
                "(dist.all_reduce(y, group=group)) -- that all-reduce is the g operator")
    if _close(got, want * t):
        return "the result is t times too large: all-reduce once, and do not also sum the ranks by hand"
    if got.shape != want.shape:
        return (f"expected the full output [s, b, out] = {tuple(want.shape)}, got {tuple(got.shape)}: row-parallel "
                f"splits the weight's dim 1 (input features), so each rank's X_i A_i is already full size")
    return ("wrong values: rank i must use chunk i of the weight's dim 1 (input features), matching its "
            "slice of x: weight.chunk(t, dim=1)[rank]")


def check_row_parallel_forward(fn) -> bool:
    """``fn(x_shard [s,b,in/t], weight [out,in], group) -> Y [s,b,out]`` on every rank."""
    for t in (2, 4):
        try:
            res = launch(_rank_row, world_size=t, output="none", timeout=30, fn=fn)
        except RankError as err:
            if err.exc_type == "NotImplementedError":
                return not_attempted("row_parallel_forward")
            print(f"✗ with {t} ranks, rank {err.rank} raised {_last_line(err.traceback)}")
            if "shape" in err.traceback or "size" in err.traceback:
                print("  hint: x_shard has in/t features: use weight.chunk(t, dim=1)[rank] ([out, in/t]), "
                      "with t = dist.get_world_size(group) and rank = dist.get_rank(group)")
            return False
        except LaunchTimeout:
            print(f"✗ with {t} ranks the ranks waited for each other: every rank must call the same "
                  f"all-reduce on the same group")
            return False
        for r in res:
            hint = diagnose_row(r["got"], r["x"], r["w"], r["rank"], r["t"])
            if hint:
                print(f"✗ wrong on rank {r['rank']} of {t}\n  hint: {hint}")
                return False
    print("✓ row_parallel_forward: every rank ends with the dense output X A for t = 2 and 4, "
          "after one all-reduce of the partial sums")
    return True


# ----------------------------------------------------------------------------- f/g


def _rank_f_g(f_cls, g_cls):
    g, t, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    gen = lambda q: torch.Generator().manual_seed(50 + q)  # noqa: E731
    xs = [torch.randn(3, 4, generator=gen(q)) for q in range(t)]
    dys = [torch.randn(3, 4, generator=gen(10 + q)) for q in range(t)]
    out = {}
    # f alone: forward identity, backward all-reduce
    x = xs[0].clone().requires_grad_()  # f's input is the same on every rank
    y = f_cls.apply(x, g)
    y.backward(dys[r].clone())
    out["f"] = dict(y=y.detach(), dx=x.grad, x=xs[0], dy=dys[r], dysum=sum(dys))
    # g alone: forward all-reduce, backward identity
    x = xs[r].clone().requires_grad_()
    y = g_cls.apply(x, g)
    y.backward(dys[0].clone())  # g's output is the same on every rank, so is its gradient
    out["g"] = dict(y=y.detach(), dx=x.grad, x=xs[r], xsum=sum(xs), dy=dys[0])
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
    yp = g_cls.apply(F.linear(F.gelu(F.linear(f_cls.apply(xp, g), w1)), w2), g)
    yp.sum().backward()
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
    if not _close(o["dx"], o["dysum"]):
        return "f's backward should return the all-reduced (summed over ranks) gradient"
    return None


def diagnose_g(o, t) -> str | None:
    if not _close(o["y"], o["xsum"]):
        if _close(o["y"], o["x"]):
            return "g's forward must all-reduce (sum) its input over the group: each rank holds a partial sum"
        return "g's forward must return the sum over ranks of its input (dist.all_reduce on a copy)"
    if o["dx"] is None:
        return "g's backward must return the gradient (and None for the group argument)"
    if _close(o["dx"], o["dy"] * t):
        return ("g's backward must be the identity: the gradient of g's output is already complete on every "
                "rank; all-reducing it again multiplies it by t")
    if not _close(o["dx"], o["dy"]):
        return "g's backward must return the incoming gradient unchanged"
    return None


def check_f_g(f_cls, g_cls) -> bool:
    """``f_cls.apply(x, group)``: identity / all-reduce; ``g_cls.apply(x, group)``: all-reduce / identity."""
    try:
        res = launch(_rank_f_g, world_size=2, output="none", timeout=30, f_cls=f_cls, g_cls=g_cls)
    except RankError as err:
        if err.exc_type == "NotImplementedError":
            return not_attempted(f"{f_cls.__name__} and {g_cls.__name__}")
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
            hint = diag(r[name], 2)
            if hint:
                print(f"✗ operator {name} is wrong\n  hint: {hint}")
                return False
        m = r["mlp"]
        if max(m.values()) > 1e-5:
            print(f"✗ f and g pass alone but the MLP f -> fc1 -> gelu -> fc2 -> g differs from the dense one "
                  f"(output {m['y']:.2g}, dX {m['dx']:.2g}, dW {m['dw']:.2g})\n  hint: return the gradient "
                  f"as a new tensor, and keep no state between calls except ctx")
            return False
    print("✓ f and g are conjugate: f = identity forward / all-reduce backward, g = all-reduce forward / "
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
    par = fn(dense, g)
    info = dict(type=type(par).__name__)
    if not isinstance(par, ParallelMLP):
        return info
    info["shapes"] = {n: tuple(p.shape) for n, p in par.named_parameters()}
    info["want_shapes"] = {"linear_fc1.weight": (16 // t, 8), "linear_fc1.bias": (16 // t,),
                           "linear_fc2.weight": (8, 16 // t), "linear_fc2.bias": (8,)}
    if info["shapes"] != info["want_shapes"]:
        return info
    want = {"linear_fc1.weight": dense.linear_fc1.weight.chunk(t, 0)[r],
            "linear_fc1.bias": dense.linear_fc1.bias.chunk(t, 0)[r],
            "linear_fc2.weight": dense.linear_fc2.weight.chunk(t, 1)[r], "linear_fc2.bias": dense.linear_fc2.bias}
    info["wrong"] = [n for n, p in par.named_parameters() if not torch.equal(p.detach(), want[n].detach())]
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
    try:
        res = launch(_rank_mlp_from_dense, world_size=2, output="none", timeout=30, fn=fn)
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
    for rank, info in enumerate(res):
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


def check_collective_prediction(predict_collectives, predict_elements_sent) -> bool:
    """``predict_collectives(sequence_parallel) -> {(direction, op): count}`` for one layer (t=2), and
    ``predict_elements_sent(b, s, h, t) -> float``: elements one rank sends per layer, fwd+bwd, no SP."""
    measured_events = {}
    for sp in (False, True):
        try:
            guess = predict_collectives(sp)
        except NotImplementedError:
            return not_attempted("predict_collectives")
        counts, measured_events[sp] = measured_layer_collectives(2, sp)
        guess = {k: v for k, v in (guess or {}).items() if v}
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
    try:
        guess = predict_elements_sent(b, s, h, t)
    except NotImplementedError:
        return not_attempted("predict_elements_sent")
    measured = sum(e.ring_elements_sent for e in measured_events[False])
    for bb, ss, hh, tt in ((1, 2048, 12288, 8), (b, s, h, 4)):
        want = 8 * bb * ss * hh * (tt - 1) / tt
        try:
            other = predict_elements_sent(bb, ss, hh, tt)
        except Exception:  # noqa: BLE001
            other = None
        if other is None or abs(other - want) > 1e-6 * want:
            print(f"✗ predict_elements_sent({bb}, {ss}, {hh}, {tt}) = {other}, expected {want:,.0f}\n"
                  f"  hint: a ring all-reduce of N elements sends 2N(t-1)/t per rank; a layer all-reduces "
                  f"b*s*h elements twice forward and twice backward")
            return False
    if guess is None or abs(guess - measured) > 1e-6 * measured:
        print(f"✗ predict_elements_sent({b}, {s}, {h}, {t}) = {guess}, measured {measured:,.0f} elements sent "
              f"per rank\n  hint: a ring all-reduce of N elements sends 2N(t-1)/t per rank; a layer all-reduces "
              f"b*s*h elements twice forward and twice backward")
        return False
    print(f"✓ your predictions match the recorded collectives of a ParallelTransformerLayer on 2 ranks, "
          f"with and without sequence parallelism, and the {measured:,.0f} elements each rank sends per layer "
          f"(= 8·b·s·h·(t-1)/t, Narayanan et al. 2021)")
    return True
