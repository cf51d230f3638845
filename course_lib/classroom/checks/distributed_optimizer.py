"""Checkers for sharding the optimizer over data-parallel ranks, run on real ranks (Labs 05 and 07).

* :func:`check_distributed_optimizer_step` (Lab 05) -- one step of Megatron's distributed optimizer
  (ZeRO-1 over DP, ``megatron/core/optimizer/distrib_optimizer.py``): reduce-scatter the gradients,
  step an optimizer built for the own shard, all-gather the shards; against single-process SGD with
  momentum and Adam on the averaged gradient, for 2 and 4 DP ranks.
* :func:`check_zero1_step` (Lab 07) -- the student's ZeRO-1 step (flatten, pad to a multiple of d,
  reduce-scatter the grads, Adam on the own shard, all-gather the params), called twice with the same
  ``state``: it must equal two steps of single-process ``torch.optim.Adam`` on the averaged gradient.

The proof is what crossed the wire and what it carried (:mod:`course_lib.classroom.checks.wire`):
each rank's gradients are drawn on that rank from ``os.urandom`` (no rank can rebuild another's), the
truth is computed after the student's function returned, from the gradients the checker gathers
itself; the student's step must send exactly one reduce-scatter, carrying this rank's gradients, and
one all-gather, carrying this rank's *updated* shard of the parameters, per step -- and the
optimizer's moments for that shard (and no more) must live where the exercise keeps them (the
optimizer returned in Lab 05, ``state`` in Lab 07), equal to the reference's. Plain data parallelism
(an all-reduce and a full update), or reduce-scattering and all-gathering the gradients and updating
every parameter on every rank, gives the same weights and is refused by what it carried. Every checker
prints one verdict line (and a hint when wrong), returns True/False and never raises; the stub's
``NotImplementedError`` gives "not attempted yet".
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from course_lib.classroom.checks import is_course_answer, not_attempted, raised_line
from course_lib.classroom.checks.exercise import exercise
from course_lib.classroom.checks.references import references_for
from course_lib.classroom.checks.student_process import run_on_rank
from course_lib.classroom.checks.tamper_guard import course_code_hint
from course_lib.classroom.checks.verdicts import (carried_by, describe_ops, launch_checked, safe_repr, same_payload,
                                                  secret_generator, tensors_close, wire_recorder)
from course_lib.launch import LaunchTimeout, RankError


def _tensor_close(a, b) -> bool:
    """Within 1e-9 of the float64 reference, relative to its scale."""
    return tensors_close(a, b, tol=1e-9)


def _gathered(t: torch.Tensor) -> list:
    """Every rank's ``t`` (the checker's own all-gather, run after the student's call)."""
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return out


def _all_agree(ok: bool) -> bool:
    """True on every rank when ``ok`` is True on every rank (the ranks stay in step)."""
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _tensors_in(obj, depth: int = 0) -> list:
    """Every tensor reachable from ``obj``: dicts, lists, an optimizer's ``state``, an object's attributes."""
    if depth > 6:
        return []
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors_in(v, depth + 1)]
    if isinstance(obj, (list, tuple, set)):
        return [t for v in obj for t in _tensors_in(v, depth + 1)]
    if isinstance(obj, torch.optim.Optimizer):
        return _tensors_in(list(obj.state.values()), depth + 1)
    if hasattr(obj, "__dict__") and not isinstance(obj, type) and not callable(obj):
        return _tensors_in(vars(obj), depth + 1)
    return []


def _holds(obj, want: torch.Tensor, real: int) -> bool:
    """Does ``obj`` hold a tensor equal to ``want`` (an optimizer moment of this rank's shard), whole or
    only its first ``real`` elements (the padding left out)? Relative tolerance 1e-6."""
    for t in _tensors_in(obj):
        flat = t.detach().reshape(-1).double()
        for ref in (want, want[:real]):
            if flat.numel() == ref.numel() and ref.numel():
                scale = float(ref.abs().max()) or 1.0
                if float((flat - ref).abs().max()) <= 1e-6 * scale:
                    return True
    return False


def _carried_hint(carried, shard_want, mean_grad_shard, d: int, what: str) -> str | None:
    """The hint when the all-gather did not carry this rank's updated shard ``shard_want`` (None when it did)."""
    if carried is None or same_payload(carried, shard_want, tol=1e-9):
        return None
    if any(same_payload(carried, mean_grad_shard * c, tol=1e-9) for c in (1, d)):
        return (f"your all-gather carried your *gradient* shard: all-gathering the gradients and updating every "
                f"parameter on every rank gives the same numbers, but it is data parallelism with extra steps -- "
                f"{what}")
    return f"your all-gather did not carry your updated shard of the parameters: {what}"


# ------------------------------------------------------------------ Lab 05: Megatron's distributed optimizer

OPT_N = 24  # parameters: divisible by every DP size checked
# name -> (make_optimizer, optimizer-state elements per parameter the optimizer holds)
OPTIMIZERS = {
    "SGD with momentum": (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), 1),
    "Adam": (lambda params: torch.optim.Adam(params, lr=0.01), 2),
}
DIST_OPT_ALGORITHM = ("reduce-scatter the gradients over DP (each rank receives the sum of its N/d shard), "
                      "step an optimizer built for that shard only, all-gather the updated shards")


def _optimizer_state_elements(optimizer) -> int | None:
    """Elements of tensor state (momenta; not the step counter) the optimizer keeps, or None if it has none."""
    try:
        return sum(v.numel() for st in optimizer.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)
    except Exception:  # noqa: BLE001 - not an optimizer
        return None


def _one_step(make, params, grad):
    """One single-process optimizer step of ``params`` with gradient ``grad`` (the reference):
    ``(new params, [its moments: tensors of the optimizer's state, e.g. exp_avg and exp_avg_sq])``."""
    p = params.clone().requires_grad_()
    p.grad = grad.clone()
    opt = make([p])
    opt.step()
    return p.detach(), [v for v in opt.state[p].values() if isinstance(v, torch.Tensor) and v.dim() > 0]


def _returned_pair(value) -> dict:
    """In the student process, after the call: what the check needs of the pair ``(new_params, optimizer)`` as
    plain data -- ``returned`` (its repr), and for a pair ``new`` (a tensor or None), ``state`` (the optimizer's
    state elements, :func:`_optimizer_state_elements`) and ``tensors`` (every tensor the optimizer holds)."""
    out = {"returned": safe_repr(value)}
    if isinstance(value, (tuple, list)) and len(value) == 2:
        new, optimizer = value
        out.update(new=new.detach().clone() if isinstance(new, torch.Tensor) else None,
                   state=_optimizer_state_elements(optimizer), tensors=[t.detach() for t in _tensors_in(optimizer)])
    return out


def _rank_dist_opt(fn):
    g, d, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    params = torch.randn(OPT_N, generator=torch.Generator().manual_seed(17), dtype=torch.float64)
    mine = torch.randn(OPT_N, generator=secret_generator(), dtype=torch.float64)  # no other rank can rebuild it
    out = []
    for name, (make, per_element) in OPTIMIZERS.items():
        with wire_recorder() as rec:
            run = run_on_rank(fn, params.clone(), mine.clone(), g, make,
                              references=references_for("distributed_optimizer_step"), summarize=_returned_pair)
        if run.error is not None:
            raise run.error
        grads = _gathered(mine)                              # the truth, from what the ranks really hold
        want, moments = _one_step(make, params, sum(grads) / d)
        shard = slice(r * OPT_N // d, (r + 1) * OPT_N // d)
        info = dict(optimizer=name, events=list(rec.events), carried=list(rec.carried), patched=run.patched,
                    course_code=run.course_code, want=want, summed=_one_step(make, params, sum(grads))[0], rank=r,
                    d=d, full_state=per_element * OPT_N, want_state=per_element * OPT_N // d, new=None, state=None,
                    returned=str(run.value.get("returned")), grad=mine, mean_shard=(sum(grads) / d)[shard],
                    moments=[m[shard] for m in moments], held_moments=None)
        if "tensors" in run.value:
            new = run.value["new"]
            info.update(new=new if isinstance(new, torch.Tensor) else None, state=run.value["state"],
                        held_moments=[_holds(run.value["tensors"], m, OPT_N // d) for m in info["moments"]])
        out.append(info)
    return out


def _dist_opt_hint(o: dict) -> str | None:
    """The one hint for a rank's step: patches or the course's code, what it returned, traffic that skips
    the algorithm (right numbers), wrong values, what the wire carried, the optimizer's state, then the
    exact traffic."""
    if o["patched"]:
        return f"it replaced {', '.join(o['patched'][:3])} (undone by the checker)"
    if o["course_code"]:
        return course_code_hint(o["course_code"][0])
    if "new" not in o or o["new"] is None:
        return f"return a pair (new_params, optimizer); got {o['returned']}"
    ops = [e.op for e in o["events"]]
    if "all_reduce" in ops:
        if o["state"] is not None and o["state"] >= o["full_state"]:
            return (f"that is plain data parallelism: an all-reduce and a full update give the same weights, but "
                    f"every rank keeps {o['optimizer']} state for all {OPT_N} parameters -- the distributed "
                    f"optimizer's point is 1/d of it: {DIST_OPT_ALGORITHM}")
        return ("an all-reduce gives every rank the whole averaged gradient, yet each rank updates only its shard: "
                "a reduce-scatter delivers just that shard and sends half as much (N(d-1)/d per rank instead of "
                "2N(d-1)/d)")
    if set(ops) - {"reduce_scatter", "all_gather"}:
        return f"it ran {describe_ops(o['events'])}: {DIST_OPT_ALGORITHM}"
    new, want, d = o["new"], o["want"], o["d"]
    if tuple(new.shape) != tuple(want.shape):
        if new.numel() == OPT_N // d:
            return "you returned only your shard: all-gather the updated shards, every rank needs all N weights"
        return f"new_params must have the shape of params, {tuple(want.shape)}; got {tuple(new.shape)}"
    if not _tensor_close(new, want):
        if _tensor_close(new, o["summed"]):
            return ("the step used the *sum* of the replicas' gradients: the reduce-scatter adds d gradients, "
                    "divide your shard by d for their average")
        return ("the new weights differ from one single-process step on the averaged gradient: update chunk "
                "`rank` of params with your reduced gradient shard, then all-gather the shards in rank order")
    shard = want.chunk(d)[o["rank"]]
    for carried in carried_by(o, "all_gather"):
        hint = _carried_hint(carried, shard, o["mean_shard"], d, DIST_OPT_ALGORITHM)
        if hint:
            return hint
    for carried in carried_by(o, "reduce_scatter"):
        if carried is not None and not any(same_payload(carried, o["grad"] * c) for c in (1.0, 1 / d)):
            return "your reduce-scatter did not carry your gradient: reduce-scatter `grad` (or grad / d) itself"
    if o["state"] is None:
        return "the optimizer you return has no .state: return the torch.optim optimizer you stepped"
    if o["state"] > o["want_state"]:
        return (f"your {o['optimizer']} keeps state for {o['state']} elements: built with make_optimizer([shard]) "
                f"for your 1/d shard only it keeps {o['want_state']}")
    if o["state"] < o["want_state"] or not all(o["held_moments"]):
        return ("the optimizer you return is not the one that updated your shard: its state must be the "
                "momenta of your N/d elements after this step -- build it with make_optimizer([shard]), set "
                "shard.grad and call its .step()")
    counts = {op: [e.numel for e in o["events"] if e.op == op] for op in ("reduce_scatter", "all_gather")}
    if counts != {"reduce_scatter": [OPT_N], "all_gather": [OPT_N]}:
        return f"it ran {describe_ops(o['events'])}: one reduce-scatter and one all-gather of the N = {OPT_N} elements"
    return None


@exercise("distributed_optimizer_step")
def check_distributed_optimizer_step(fn, timeout: float = 20) -> bool:
    """``fn(params [N], grad [N], dp_group, make_optimizer) -> (new_params [N], optimizer)``: one step of
    Megatron's distributed optimizer (ZeRO-1 over DP), against single-process SGD with momentum and Adam."""
    if is_course_answer(fn):
        return False
    # Building the first torch.optim optimizer imports torch._dynamo (~2.5 s): once here, not in every rank.
    _one_step(OPTIMIZERS["Adam"][0], torch.zeros(2), torch.zeros(2))
    for d in (2, 4):
        try:
            res = launch_checked(_rank_dist_opt, world_size=d, timeout=timeout, fn=fn)
        except RankError as err:
            if err.exc_type == "NotImplementedError":
                return not_attempted("distributed_optimizer_step")
            print(f"✗ with {d} DP ranks, rank {err.rank} raised {raised_line(err)}")
            if "shape" in err.traceback or "size" in err.traceback:
                print("  hint: the reduce-scatter's output holds N/d elements (grad.numel() // d); the all-gather's "
                      "output all N")
            return False
        except LaunchTimeout:
            print(f"✗ with {d} DP ranks the ranks waited for each other: every rank must run the same collectives "
                  f"in the same order")
            return False
        for per_rank in zip(*res):
            for o in per_rank:
                hint = _dist_opt_hint(o)
                if hint:
                    print(f"✗ {o['optimizer']}, {d} DP ranks, rank {o['rank']}\n  hint: {hint}")
                    return False
    print("✓ distributed_optimizer_step equals one single-process step (SGD with momentum, Adam) on the averaged "
          "gradient, for 2 and 4 DP ranks, with one reduce-scatter and one all-gather and 1/d of the optimizer "
          "state on each rank")
    return True


# ------------------------------------------------------------------ Lab 07: the ZeRO-1 step

SHAPES = ((3, 5), (6,), (4, 2))        # 29 elements: the flat buffer needs padding for d = 2 and d = 4
NUMEL = sum(torch.Size(s).numel() for s in SHAPES)
ADAM = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-3)   # eps ~ |grad|: Adam sees the gradient's scale
STEPS = 2
ALGORITHM = ("flatten params and grads into one buffer padded to a multiple of d, reduce-scatter the grads "
             "(each rank receives the sum of its shard) and divide by d, step Adam on your shard only, "
             "all-gather the updated shards in rank order, cut the buffer back into the params' shapes")


def padded(n: int, d: int) -> int:
    """``n`` rounded up to a multiple of ``d`` (the buffer every rank reduce-scatters and all-gathers)."""
    return -(-n // d) * d


def _adam_steps(params, grads_per_step, *, fresh: bool = False):
    """Single-process torch.optim.Adam on the flat params, one step per gradient (the reference):
    ``[(flat params, exp_avg, exp_avg_sq) after each step]``. ``fresh``: a new optimizer every step
    (the mistake of not keeping the state)."""
    p = torch.cat([t.reshape(-1) for t in params]).clone().requires_grad_()
    opt = torch.optim.Adam([p], **ADAM)
    after = []
    for g in grads_per_step:
        if fresh:
            opt = torch.optim.Adam([p], **ADAM)
        p.grad = torch.cat([t.reshape(-1) for t in g]).clone()
        opt.step()
        after.append((p.detach().clone(), opt.state[p]["exp_avg"].clone(), opt.state[p]["exp_avg_sq"].clone()))
    return after


def _state_elements(obj, seen=None) -> int:
    """Elements of every non-scalar tensor reachable from the student's ``state`` (dicts, lists,
    optimizers' ``.state`` and their parameters), each storage once."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0 or obj.untyped_storage().data_ptr() in seen:
            return 0
        seen.add(obj.untyped_storage().data_ptr())
        return obj.numel()
    if isinstance(obj, dict):
        return sum(_state_elements(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple, set)):
        return sum(_state_elements(v, seen) for v in obj)
    if isinstance(obj, torch.optim.Optimizer):
        return _state_elements(list(obj.state.values()), seen) + _state_elements(
            [p for g in obj.param_groups for p in g["params"]], seen)
    return 0


def _state_summary(state: dict, value) -> dict:
    """In the student process, after a call: what the check needs as plain data -- the returned ``value`` (its
    tensors travel), ``returned`` (its repr), ``elements`` (:func:`_state_elements` of ``state``) and ``held``
    (every tensor ``state`` holds, for :func:`_holds`)."""
    return {"value": value, "returned": safe_repr(value), "elements": _state_elements(state),
            "held": [t.detach() for t in _tensors_in(state)]}


def _flat_padded(tensors, d: int) -> torch.Tensor:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    return torch.nn.functional.pad(flat, (0, padded(flat.numel(), d) - flat.numel()))


def _rank_zero1(fn):
    d, r = dist.get_world_size(), dist.get_rank()
    params = [torch.randn(s, generator=torch.Generator().manual_seed(23), dtype=torch.float64) for s in SHAPES]
    secret = secret_generator()                          # this rank's gradients: no other rank can rebuild them
    mine = [[1e-3 * torch.randn(s, generator=secret, dtype=torch.float64) for s in SHAPES] for _ in range(STEPS)]
    info = dict(rank=r, d=d, events=[], carried=[], new=None, returned=None, state=None, patched=[],
                course_code=[], mine=[_flat_padded(g, d) for g in mine])
    # ``state`` is the student process's own between the calls (passed again as the same object); after each
    # call that process reports what it holds (_state_summary)
    state, current, ok = {}, [p.clone() for p in params], True
    summary = functools.partial(_state_summary, state)
    for step in range(STEPS):
        with wire_recorder() as rec:
            run = run_on_rank(fn, [p.clone() for p in current], [g.clone() for g in mine[step]],
                              dist.group.WORLD, state, references=references_for("zero1_step"), summarize=summary)
        if run.error is not None:
            raise run.error
        info["events"].append(list(rec.events))
        info["carried"].append(list(rec.carried))
        info["patched"] += list(run.patched)
        info["course_code"] += list(run.course_code)
        value, held = run.value["value"], run.value["held"]
        info["returned"] = str(run.value["returned"])
        ok = (isinstance(value, (list, tuple)) and len(value) == len(SHAPES)
              and all(isinstance(v, torch.Tensor) and tuple(v.shape) == s for v, s in zip(value, SHAPES)))
        if not _all_agree(ok):
            info["flat_returned"] = isinstance(value, torch.Tensor)
            return info
        current = [v.detach().clone() for v in value]
    # The truth, from the gradients every rank really holds (gathered by the checker, after the student's calls).
    flat = [sum(_gathered(torch.cat([t.reshape(-1) for t in g]))) for g in mine]   # per step, summed over ranks
    mean = [[f / d] for f in flat]
    summed = [[f] for f in flat]
    info.update(new=torch.cat([t.reshape(-1).double() for t in current]), state=run.value["elements"],
                want=_adam_steps(params, mean), summed=_adam_steps(params, summed)[-1][0],
                fresh=_adam_steps(params, mean, fresh=True)[-1][0])
    size = padded(NUMEL, d) // d
    shard = slice(r * size, (r + 1) * size)
    real = max(0, min(size, NUMEL - r * size))
    pad = padded(NUMEL, d) - NUMEL
    info["shards"] = [torch.nn.functional.pad(p, (0, pad))[shard] for p, _, _ in info["want"]]
    info["mean_shards"] = [torch.nn.functional.pad(m[0], (0, pad))[shard] for m in mean]
    info["moments_held"] = [_holds(held, torch.nn.functional.pad(m, (0, pad))[shard], real)
                            for m in info["want"][-1][1:]]
    info["want"] = info["want"][-1][0]
    return info


def _zero1_hint(o: dict) -> str | None:
    """The one hint for a rank: patches or course code, the return value, the traffic that skips the
    algorithm, the numbers (averaged? Adam state kept?), what the wire carried (the gradients in, the
    updated shard out), where Adam's moments live and how big ``state`` is, then the exact traffic."""
    d = o["d"]
    n_pad = padded(NUMEL, d)
    if o["patched"]:
        return f"it replaced {', '.join(o['patched'][:3])} (undone by the checker)"
    if o["course_code"]:
        return course_code_hint(o["course_code"][0])
    if o["new"] is None:
        if o.get("flat_returned"):
            return "you returned the flat buffer: cut it back into tensors shaped like params (drop the padding)"
        return f"return a list of {len(SHAPES)} tensors shaped like params {list(SHAPES)}; got {o['returned']}"
    ops = {e.op for step in o["events"] for e in step}
    if "all_reduce" in ops:
        return ("an all-reduce gives every rank the whole gradient: that is plain data parallelism. ZeRO-1 "
                "reduce-scatters, so each rank receives only the N/d it updates (half the traffic of an "
                "all-reduce per rank), and all-gathers the updated shards")
    if ops - {"reduce_scatter", "all_gather"}:
        return f"it ran {describe_ops([e for step in o['events'] for e in step])}: {ALGORITHM}"
    if not _tensor_close(o["new"], o["want"]):
        if _tensor_close(o["new"], o["summed"]):
            return ("the step used the *sum* of the d gradients: the reduce-scatter adds them; divide your shard "
                    "by d (with eps ~ |grad| Adam sees the difference)")
        if _tensor_close(o["new"], o["fresh"]):
            return ("the second step forgot the first one's Adam moments: keep your shard's optimizer (or its "
                    "exp_avg / exp_avg_sq) in `state` between calls")
        return ("the params differ from two single-process Adam steps on the averaged gradient: rank r owns "
                "elements [r·N/d, (r+1)·N/d) of the padded flat buffer, updates exactly those, and the "
                "all-gather puts the shards back in rank order")
    for step, (events, carried) in enumerate(zip(o["events"], o["carried"])):
        sent = dict(o, events=events, carried=carried)
        for payload in carried_by(sent, "all_gather"):
            hint = _carried_hint(payload, o["shards"][step], o["mean_shards"][step], d, ALGORITHM)
            if hint:
                return hint
        for payload in carried_by(sent, "reduce_scatter"):
            if payload is not None and not any(same_payload(payload, o["mine"][step] * c) for c in (1.0, 1 / d)):
                return ("your reduce-scatter did not carry your gradients: reduce-scatter this rank's flat, "
                        "zero-padded grads (or grads / d), so that each rank receives the sum of its shard")
    limit = 3 * n_pad // d + 8          # fp32 main shard + two moments (+ a few scalars)
    if o["state"] is not None and o["state"] > limit:
        return (f"your `state` holds {o['state']} elements; ZeRO-1's point is Adam state for your shard only: "
                f"at most the shard ({n_pad // d}) and its two moments, {3 * n_pad // d} elements")
    if not all(o["moments_held"]):
        return (f"`state` does not hold Adam's two moments of your shard (exp_avg and exp_avg_sq of your "
                f"{n_pad // d} elements, as after these steps): ZeRO-1 keeps the optimizer state sharded -- each "
                f"rank's moments for its N/d elements, in `state`, and nowhere else")
    for step in o["events"]:
        counts = {op: [e.numel for e in step if e.op == op] for op in ("reduce_scatter", "all_gather")}
        if counts != {"reduce_scatter": [n_pad], "all_gather": [n_pad]}:
            return (f"per step it ran {describe_ops(step)}: one reduce-scatter and one all-gather of the padded "
                    f"buffer ({NUMEL} elements padded to {n_pad} for d = {d})")
        if any(e.kind != "world" or e.group_size != d for e in step):
            return "run both collectives on dp_group (here the whole world)"
    return None


@exercise("zero1_step")
def check_zero1_step(fn, world_sizes=(2, 4), timeout: float = 30) -> bool:
    """``fn(params, grads, dp_group, state) -> new params``: one ZeRO-1 step (Adam, ``ADAM``), called twice
    with the same ``state`` dict, on 2 and 4 real ranks; against two single-process Adam steps."""
    if is_course_answer(fn):
        return False
    _adam_steps([torch.zeros(2)], [[torch.zeros(2)]])   # import torch.optim's machinery once, not per rank
    for d in world_sizes:
        try:
            res = launch_checked(_rank_zero1, world_size=d, timeout=timeout, fn=fn)
        except RankError as err:
            if err.exc_type == "NotImplementedError":
                return not_attempted("zero1_step")
            print(f"✗ with {d} DP ranks, rank {err.rank} raised {raised_line(err)}")
            if any(w in err.traceback.lower() for w in ("size", "shape", "divisible", "numel")):
                print(f"  hint: {NUMEL} elements do not split into {d} equal shards: pad the flat buffers with "
                      f"zeros to {padded(NUMEL, d)} (a multiple of d) before the reduce-scatter")
            return False
        except LaunchTimeout:
            print(f"✗ with {d} DP ranks the ranks waited for each other: every rank must run the same "
                  f"collectives in the same order")
            return False
        for o in res:
            hint = _zero1_hint(o)
            if hint:
                print(f"✗ {d} DP ranks, rank {o['rank']}\n  hint: {hint}")
                return False
    sent = {d: padded(NUMEL, d) * (d - 1) // d for d in world_sizes}
    print(f"✓ zero1_step equals two single-process Adam steps on the averaged gradient for "
          f"{' and '.join(map(str, world_sizes))} DP ranks: per step one reduce-scatter carrying each rank's "
          f"padded gradients and one all-gather carrying its updated shard (each sends N(d-1)/d = "
          f"{', '.join(f'{v} (d={k})' for k, v in sent.items())} elements per rank), and `state` holds Adam's "
          f"moments for that 1/d shard only")
    return True
