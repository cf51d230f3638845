"""Checkers for Lab 05's exercises (3D/4D parallelism in practice, Day 22).

Each checker calls the student's function on many settings, compares with the
course's tested code (``ParallelConfig``, the bubble formula, the Megatron log
parser, a single-process optimizer step), prints one verdict line and, when
wrong, the most specific hint it can find. A function that still raises
``NotImplementedError`` gets a "not attempted yet" line. Every checker returns
True/False and never raises; numbers of any real type are accepted, a
monkeypatch is undone, and an answer that runs the course's own code is told so.

The distributed-optimizer step runs on ranks whose process group records every
op (:mod:`course_lib.classroom.checks.wire`): plain DDP (an all-reduce and a full update)
gives the same weights and is refused by its traffic and its optimizer state.
The conclusions (review question 6, checklist item 10, the deliverable) are the
student's: :func:`check_conclusions` only checks that they are written and cite
numbers from this notebook's runs; :func:`print_course_reading` shows the
course's reading after them.
"""

from __future__ import annotations

import math
import re

import torch
import torch.distributed as dist

from course_lib.classroom.checks import checked_call, is_course_answer, not_attempted, raised_line
from course_lib.classroom.checks.verdicts import (as_real, course_code_hint, describe_ops, launch_checked,
                                        run_student, safe_repr, wire_recorder)
from course_lib.launch import LaunchTimeout, RankError
from course_lib.megatron import SEED_SWEEP, parse_log
from course_lib.topology import ParallelConfig

_todo = not_attempted
LAYOUT_REFS = (ParallelConfig.__init__,)
PARSE_REFS = (parse_log,)


def _whole(value) -> int | None:
    """``value`` as an int when it is a whole real number of any type (2, 2.0, numpy, 0-d tensor), else None."""
    number, reason = as_real(value)
    return None if reason or number != int(number) else int(number)

# (world, tp, pp, cp, micro, global): the seed's A-F with the CPU sweep's batch and the GPU batch,
# seed 000's 32-GPU layouts, seed 001's 128-GPU run.
LAYOUTS = ([(8, tp, pp, cp, 1, 16) for tp, pp, cp in SEED_SWEEP.values()]
           + [(8, tp, pp, cp, 4, 64) for tp, pp, cp in SEED_SWEEP.values()]
           + [(32, 16, 2, 1, 1, 32), (32, 4, 8, 1, 2, 64), (128, 4, 4, 1, 8, 256), (16, 2, 2, 2, 2, 16)])
# layouts Megatron refuses: (world, tp, pp, cp, micro, global, the rule)
BAD_LAYOUTS = [(8, 3, 1, 1, 1, 16, "world_size % (tp*pp*cp)"), (8, 2, 2, 4, 1, 16, "world_size % (tp*pp*cp)"),
               (8, 1, 1, 1, 1, 12, "global % (micro*dp)"), (8, 1, 4, 1, 4, 4, "global % (micro*dp)")]


def _want(world, tp, pp, cp, micro, gbs):
    cfg = ParallelConfig(world_size=world, tp=tp, pp=pp, cp=cp, micro_batch_size=micro, global_batch_size=gbs)
    return cfg.dp, cfg.num_microbatches


def check_layout(fn) -> bool:
    """``fn(world_size, tp, pp, cp, micro_batch_size, global_batch_size) -> (dp, num_microbatches)``;
    raises ValueError when the layout is impossible."""
    if is_course_answer(fn):
        return False
    for case in LAYOUTS:
        got, err = checked_call(fn, *case, references=LAYOUT_REFS)
        if err == "todo":
            return _todo("derive_layout")
        world, tp, pp, cp, micro, gbs = case
        want = _want(*case)
        args = f"derive_layout(world_size={world}, tp={tp}, pp={pp}, cp={cp}, micro={micro}, global={gbs})"
        if err:
            print(f"✗ {args}: {err}; expected {want}")
            return False
        try:
            dp, m = got
        except Exception:  # noqa: BLE001 - not a pair
            print(f"✗ {args} returned {safe_repr(got)}: return a pair (dp, num_microbatches)")
            return False
        if (_whole(dp), _whole(m)) == want:
            continue
        print(f"✗ {args} returned {safe_repr(got)}, expected {want}")
        wdp, wm = want
        dp_n, m_n = as_real(dp)[0], as_real(m)[0]
        if dp_n is None or m_n is None:
            print(f"  hint: return two numbers; {as_real(dp)[1] or as_real(m)[1]}")
        elif dp_n != wdp:
            if cp > 1 and dp_n == world // (tp * pp):
                print("  hint: CP ranks are not data-parallel replicas: DP = world / (TP * PP * CP)")
            elif dp_n in (world // tp, world // pp, world // (tp * cp), world // (pp * cp)):
                print("  hint: DP is what is left after *every* model-parallel split: world / (TP * PP * CP)")
            else:
                print("  hint: DP is derived, never given: DP = world / (TP * PP * CP)")
        elif m_n != wm:
            if m_n == gbs // micro:
                print("  hint: each DP replica takes global / DP samples: m = global / (micro * DP)")
            elif m_n == gbs // (micro * world):
                print("  hint: divide by DP, not by the world size: TP/PP/CP ranks of one replica share its "
                      "micro-batches")
            elif m_n in (gbs // (micro * dp_n * pp), gbs // (micro * dp_n * tp)):
                print("  hint: TP and PP ranks of one replica all see the same micro-batches: divide by DP only")
            else:
                print("  hint: micro-batches per step m = global / (micro * DP)")
        return False
    for world, tp, pp, cp, micro, gbs, rule in BAD_LAYOUTS:
        got, err = checked_call(fn, world, tp, pp, cp, micro, gbs, references=LAYOUT_REFS)
        if err == "todo":
            return _todo("derive_layout")
        if err and err.startswith("raised ValueError"):
            continue
        print(f"✗ derive_layout(world_size={world}, tp={tp}, pp={pp}, cp={cp}, micro={micro}, global={gbs}) "
              f"{err if err else 'returned ' + safe_repr(got)}; Megatron refuses it: raise ValueError")
        print(f"  hint: check {rule} == 0 before dividing"
              + (" (a DP of 8 / 12 ranks is not a whole number of replicas)" if "tp" in rule else
                 " (every replica must get a whole number of micro-batches)"))
        return False
    print(f"✓ derive_layout: DP and micro-batches right on {len(LAYOUTS)} layouts (A-F on CPU and GPU batches, "
          f"seeds 000/001), {len(BAD_LAYOUTS)} impossible ones refused")
    return True


# name -> (tp, pp, cp) sets and batch settings where depth alone does not decide, and where ignoring CP
# in DP picks a config that is *not* the deepest (the last one), so each mistake has its own answers.
BUBBLE_CASES = [
    (dict(SEED_SWEEP), 8, 1, 16),
    (dict(SEED_SWEEP), 8, 4, 64),
    ({"X": (1, 2, 1), "Y": (1, 4, 1)}, 8, 1, 8),
    ({"P": (2, 2, 2), "Q": (1, 2, 1)}, 8, 1, 8),
    ({"R": (1, 4, 2), "S": (1, 2, 1)}, 16, 2, 32),
    ({"T": (4, 2, 1), "U": (1, 1, 1), "V": (2, 4, 1)}, 16, 1, 32),
    ({"G": (1, 2, 4), "H": (2, 3, 1)}, 16, 1, 16),
]


def _bubbles(configs, world, micro, gbs, dp_of=lambda world, tp, pp, cp: world // (tp * pp * cp)):
    """``{name: (p-1)/m}`` with m = global / (micro * DP); ``dp_of`` may be a mistaken DP."""
    return {name: (pp - 1) / (gbs / (micro * dp_of(world, tp, pp, cp))) for name, (tp, pp, cp) in configs.items()}


def _largest(values: dict) -> set:
    top = max(values.values())
    return {n for n, v in values.items() if math.isclose(v, top, rel_tol=1e-12)}


# Each mistake as a rule giving the set of names it picks, and the hint it gets. Ignoring DP altogether
# (m = global / micro) makes m the same for every config, so it picks the deepest: it is "depth alone".
BUBBLE_MISTAKES = [
    (lambda c, w, mi, g: _largest(_bubbles(c, w, mi, g, lambda w_, t, p, cp: w_ // (t * p))),
     "CP ranks are not data-parallel replicas: DP = world / (TP * PP * CP) -- ignoring CP doubles a CP config's "
     "DP and halves its micro-batches"),
    (lambda c, w, mi, g: {n for n in c if c[n][1] == max(p for _, p, _ in c.values())},
     "depth alone does not decide: compute m = global / (micro * DP) for each config; (p-1)/m grows when a "
     "config has few micro-batches"),
    (lambda c, w, mi, g: {min((b := _bubbles(c, w, mi, g)), key=b.get)},
     "that is the *smallest* bubble: take the config with the largest (p-1)/m"),
]


def check_largest_bubble(fn) -> bool:
    """``fn(configs: {name: (tp, pp, cp)}, world_size, micro_batch_size, global_batch_size) -> name``
    of the config with the largest 1F1B bubble (p-1)/m."""
    if is_course_answer(fn):
        return False
    answers, first_wrong = [], None
    for i, (configs, world, micro, gbs) in enumerate(BUBBLE_CASES):
        got, err = checked_call(fn, dict(configs), world, micro, gbs)
        if err == "todo":
            return _todo("largest_bubble")
        shown = ", ".join(f"{n}: TP{t} PP{p} CP{c}" for n, (t, p, c) in configs.items())
        if err:
            print(f"✗ largest_bubble({{{shown}}}, world {world}, micro {micro}, global {gbs}): {err}")
            return False
        answers.append(got)
        want = _largest(_bubbles(configs, world, micro, gbs))
        if first_wrong is None and not (isinstance(got, str) and got in want):
            first_wrong = (i, shown, want)
    if first_wrong is None:
        print(f"✓ largest_bubble right on {len(BUBBLE_CASES)} sweeps (the seed's A-F: E, PP 4 with 8 "
              f"micro-batches; CP counted out of DP)")
        return True
    i, shown, want = first_wrong
    configs, world, micro, gbs = BUBBLE_CASES[i]
    print(f"✗ largest_bubble({{{shown}}}, world {world}, micro {micro}, global {gbs}) = {safe_repr(answers[i])}, "
          f"expected {sorted(want)[0]!r}")
    for rule, hint in BUBBLE_MISTAKES:  # the mistake that gives *every* one of the student's answers
        if all(isinstance(a, str) and a in rule(*case) for a, case in zip(answers, BUBBLE_CASES)):
            print(f"  hint: {hint}")
            break
    else:
        if not isinstance(answers[i], str) or answers[i] not in configs:
            print(f"  hint: return the *name* of a config, one of {', '.join(configs)}")
        else:
            print("  hint: bubble = (p-1)/m with m = global / (micro * DP) and DP = world / (TP * PP * CP)")
    print("  bubbles: " + ", ".join(f"{n} {v:.3f}" for n, v in _bubbles(configs, world, micro, gbs).items()))
    return False


# One iteration line per Megatron log era (format strings read in NVIDIA/Megatron-LM; see
# course_lib.megatron.logs), plus the course's own and a torchrun --tee prefixed one.
ITERATION_LINES = {
    "Megatron before core 0.6": " iteration       10/      50 | consumed samples:          640 | elapsed time per "
                                "iteration (ms): 1450.3 | learning rate: 3.000E-04 | global batch size:    64 | "
                                "lm loss: 1.051234E+01 | loss scale: 1.0 | grad norm: 12.345 | number of skipped "
                                "iterations:   0 | number of nan iterations:   0 |",
    "Megatron core 0.6-0.15": " [2025-10-04 17:56:47] iteration       20/      40 | consumed samples:         1280 | "
                              "elapsed time per iteration (ms): 640.2 | throughput per GPU (TFLOP/s/GPU): 32.6 | "
                              "learning rate: 2.200000E-04 | global batch size:    64 | lm loss: 8.250000E+00 | "
                              "loss scale: 1.0 | grad norm: 3.250 | number of skipped iterations:   0 | number of "
                              "nan iterations:   0 |",
    "Megatron core 0.16+": " [2026-02-26 04:05:51.004213] iteration        1/      30 | consumed samples:           64 "
                           "| elapsed time per iteration (ms): 5321.4 | learning rate: 3.000000E-05 | global batch "
                           "size:    64 | lm loss: 1.087000E+01 | loss scale: 1.0 | grad norm: 25.125 | number of "
                           "skipped iterations:   0 | number of nan iterations:   0 |",
    "the course's CPU log": " [2026-08-22 15:22:23.000000] iteration        5/      20 | consumed samples:  "
                            "         80 | elapsed time per iteration (ms): 95.5 | learning rate: 1.000000E-03 | "
                            "global batch size:    16 | lm loss: 4.900000E+00 | loss scale: 1.0 | grad norm: "
                            "1.000 | number of skipped iterations:   0 | number of nan iterations:   0 |",
    "torchrun --tee (prefix)": "[default7]: [2025-10-04 17:57:02] iteration       40/      40 | consumed samples:  "
                               "       2560 | elapsed time per iteration (ms): 655.9 | learning rate: 3.000000E-05 | "
                               "global batch size:    64 | lm loss: 7.125000E+00 | loss scale: 1.0 | grad norm: "
                               "2.125 | number of skipped iterations:   0 | number of nan iterations:   0 |",
}
KEYS = ("iteration", "elapsed_ms", "lm_loss")


def _parsed_ok(got, want) -> bool:
    """The three fields, numbers of any real type, equal to the reference (the iteration a whole number)."""
    if not isinstance(got, dict) or any(k not in got for k in KEYS):
        return False
    for key in KEYS:
        number, reason = as_real(got[key])
        if reason or not math.isclose(number, want[key], rel_tol=1e-9, abs_tol=1e-12):
            return False
    return _whole(got["iteration"]) is not None


def check_parse_line(fn) -> bool:
    """``fn(line) -> {"iteration": int, "elapsed_ms": float, "lm_loss": float}``."""
    if is_course_answer(fn):
        return False
    for era, line in ITERATION_LINES.items():
        got, err = checked_call(fn, line, references=PARSE_REFS)
        if err == "todo":
            return _todo("parse_iteration_line")
        ref = parse_log(line).iterations[0]
        want = {k: ref[k] for k in KEYS}
        if not err and _parsed_ok(got, want):
            continue
        print(f"✗ {era}: parse_iteration_line {err or 'returned ' + safe_repr(got, 200)}")
        print(f"  expected {want}")
        if err and err.startswith("raised") and "[" in line.split("iteration")[0]:
            print("  hint: " + ("torchrun --tee puts '[defaultN]:' in front of every line" if "default" in line else
                                "since core 0.6 the line starts with a '[date time]' stamp")
                  + ": find the 'iteration N/ M' field instead of assuming it comes first")
        elif err and err.startswith("raised"):
            print("  hint: split the line on '|'; each field is 'name: value' (rpartition(':') keeps names with "
                  "colons intact); the first field is 'iteration N/ M'")
        elif err:
            pass  # a patch or the course's parser: the line above says it
        elif not isinstance(got, dict) or any(k not in got for k in KEYS):
            print(f"  hint: return a dict with the keys {', '.join(KEYS)}")
        elif as_real(got["iteration"])[0] == ref["train_iters"]:
            print("  hint: 'iteration 10/ 50' is iteration 10 of 50: take the number before the '/'")
        elif _whole(got["iteration"]) is None:
            print("  hint: the iteration is a whole number: int(...)")
        else:
            print("  hint: 'elapsed time per iteration (ms)' and 'lm loss' are floats (1.05E+01 parses with float())")
        return False
    print(f"✓ parse_iteration_line reads {len(ITERATION_LINES)} formats: Megatron pre-0.6, 0.6-0.15, 0.16+, the "
          f"course's, and torchrun-prefixed lines")
    return True


# ------------------------------------------------------------------ the distributed optimizer

OPT_N = 24  # parameters: divisible by every DP size checked
# name -> (make_optimizer, optimizer-state elements per parameter the optimizer holds)
OPTIMIZERS = {
    "SGD with momentum": (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), 1),
    "Adam": (lambda params: torch.optim.Adam(params, lr=0.01), 2),
}
DIST_OPT_ALGORITHM = ("reduce-scatter the gradients over DP (each rank receives the sum of its N/d shard), "
                      "step an optimizer built for that shard only, all-gather the updated shards")


def _state_elements(optimizer) -> int | None:
    """Elements of tensor state (momenta; not the step counter) the optimizer keeps, or None if it has none."""
    try:
        return sum(v.numel() for st in optimizer.state.values() for v in st.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0)
    except Exception:  # noqa: BLE001 - not an optimizer
        return None


def _one_step(make, params, grad):
    """One single-process optimizer step of ``params`` with gradient ``grad`` (the reference)."""
    p = params.clone().requires_grad_()
    p.grad = grad.clone()
    make([p]).step()
    return p.detach()


def _rank_dist_opt(fn):
    g, d, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(17)
    params = torch.randn(OPT_N, generator=gen, dtype=torch.float64)
    grads = [torch.randn(OPT_N, generator=gen, dtype=torch.float64) for _ in range(d)]  # every replica's
    out = []
    for name, (make, per_element) in OPTIMIZERS.items():
        want, summed = _one_step(make, params, sum(grads) / d), _one_step(make, params, sum(grads))
        with wire_recorder() as rec:
            run = run_student(fn, params.clone(), grads[r].clone(), g, make)
        if run.error is not None:
            raise run.error
        info = dict(optimizer=name, events=list(rec.events), patched=run.patched, course_code=run.course_code,
                    want=want, summed=summed, rank=r, d=d, full_state=per_element * OPT_N,
                    want_state=per_element * OPT_N // d, new=None, state=None, returned=safe_repr(run.value))
        if isinstance(run.value, (tuple, list)) and len(run.value) == 2:
            new, optimizer = run.value
            info.update(new=new.detach().clone() if isinstance(new, torch.Tensor) else None,
                        state=_state_elements(optimizer))
        out.append(info)
    return out


def _dist_opt_hint(o: dict) -> str | None:
    """The one hint for a rank's step: patches or the course's code, what it returned, traffic that skips
    the algorithm (right numbers), wrong values, the optimizer's state, then the exact traffic."""
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
    if o["state"] is None:
        return "the optimizer you return has no .state: return the torch.optim optimizer you stepped"
    if o["state"] > o["want_state"]:
        return (f"your {o['optimizer']} keeps state for {o['state']} elements: built with make_optimizer([shard]) "
                f"for your 1/d shard only it keeps {o['want_state']}")
    if o["state"] < o["want_state"]:
        return "step the optimizer you return: build it with make_optimizer([shard]) and call its .step()"
    counts = {op: [e.numel for e in o["events"] if e.op == op] for op in ("reduce_scatter", "all_gather")}
    if counts != {"reduce_scatter": [OPT_N], "all_gather": [OPT_N]}:
        return f"it ran {describe_ops(o['events'])}: one reduce-scatter and one all-gather of the N = {OPT_N} elements"
    return None


def _tensor_close(a, b) -> bool:
    try:
        diff = (a.double() - b.double()).abs()
        return bool(torch.isfinite(diff).all()) and diff.max().item() <= 1e-9 * max(1.0, b.abs().max().item())
    except Exception:  # noqa: BLE001 - an odd answer is a wrong answer
        return False


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
                return _todo("distributed_optimizer_step")
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


# ------------------------------------------------------------------ the conclusions are the student's

CONCLUSIONS = {
    "tiny_gpt": "your choice from A-F for the seed's tiny GPT, and why",
    "gpt_13b": "your choice from A-F for the 13B GPT, and why",
    "rule": "your own rule for when to use TP, PP, DP and CP",
    "sweep": "the conclusions of your sweep (for the deliverable)",
}
LABELS = {"tiny_gpt": "My choice for the seed's tiny GPT", "gpt_13b": "My choice for the 13B GPT",
          "rule": "My rule for TP, PP, DP and CP", "sweep": "What my sweep shows"}
CHOICES = ("tiny_gpt", "gpt_13b")
CITING = ("tiny_gpt", "gpt_13b", "sweep")
_SETTINGS = {"name", "tp", "pp", "dp", "cp", "vp", "world_size", "iters", "micro_batches", "timeline", "command",
             "launcher", "run", "run_name", "model", "config", "notes", "num_microbatches", "global_batch_size",
             "micro_batch_size", "total_s", "wall_s"}
_NUMBER = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+)(?:\.(\d+))?")
_SCALES = (1.0, 2.0 ** 20, 1e9, 1e6)


def measured_numbers(*sources) -> list[float]:
    """Every number in the runs' summaries and the sizing plans (and its value in MB and GB), plus each
    config's step time relative to A: what a conclusion may cite. Settings (TP, PP, iterations...) are left out."""
    found: list[float] = []

    def walk(obj, key=None):
        if key in _SETTINGS:
            return
        if isinstance(obj, bool):
            return
        if isinstance(obj, (int, float)):
            found.extend(obj / scale for scale in _SCALES)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, k)
            configs = obj.get("configs")
            if isinstance(configs, list):
                base = next((c for c in configs if isinstance(c, dict) and c.get("name") == "A"), None)
                for c in configs:
                    if base and isinstance(c, dict) and c.get("step_time_ms") and base.get("step_time_ms"):
                        found.append(c["step_time_ms"] / base["step_time_ms"])
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, key)
        elif hasattr(obj, "__dataclass_fields__"):  # a sizing Plan
            for name in obj.__dataclass_fields__:
                walk(getattr(obj, name), name)
            comm = getattr(obj, "comm", None)
            if isinstance(comm, dict):
                walk(comm.get("tp", 0) + comm.get("cp", 0))

    for source in sources:
        walk(source)
    return found


def cited_numbers(text: str, numbers: list[float]) -> list[str]:
    """The numbers written in ``text`` that match a measured one at the precision written (or within 1%);
    whole numbers below 10 (TP 2, PP 4...) are not citations."""
    cited = []
    for match in _NUMBER.finditer(text):
        whole, decimals = match.group(1).replace(",", ""), match.group(2)
        value = float(whole + ("." + decimals if decimals else ""))
        if decimals is None and value < 10:
            continue
        places = len(decimals) if decimals else 0
        if any(round(n, places) == value or math.isclose(n, value, rel_tol=0.01) for n in numbers):
            cited.append(match.group(0))
    return cited


def _conclusion_problem(key: str, text, numbers) -> str | None:
    if not isinstance(text, str) or len(text.split()) < 8 or text.strip().strip(".…").upper() in ("", "TODO"):
        return f"{key!r}: write {CONCLUSIONS[key]} -- a few sentences (got {safe_repr(text, 40)})"
    if key in CHOICES and not re.search(r"\b[A-F]\b", text):
        return f"{key!r}: name the config you choose, one of A-F"
    if key == "rule" and len(set(re.findall(r"\b(TP|PP|DP|CP)\b", text.upper()))) < 2:
        return f"{key!r}: say when to use each of TP, PP, DP and CP (name at least two of them)"
    if key in CITING and not cited_numbers(text, numbers):
        return (f"{key!r}: cite at least one number from this notebook's runs or tables, as it was printed "
                f"(a step time, tokens/s, MB per rank, a count of all-reduces, GB per rank from the sizing table...)")
    return None


def check_conclusions(fn, *sources) -> bool:
    """``fn() -> {"tiny_gpt", "gpt_13b", "rule", "sweep": str}``: the student's own conclusions. A light
    check: each written, the choices name a config, and the answers cite a number measured or computed in
    ``sources`` (sweep summaries, sizing plans)."""
    run = run_student(fn)
    if run.todo:
        return _todo("my_conclusions")
    if run.problem():
        print(f"✗ my_conclusions: {run.problem()}")
        return False
    answers = run.value
    if not isinstance(answers, dict):
        print(f"✗ my_conclusions returned {safe_repr(answers)}: return a dict with the keys {', '.join(CONCLUSIONS)}")
        return False
    numbers = measured_numbers(*sources)
    problems = [_conclusion_problem(key, answers.get(key), numbers) for key in CONCLUSIONS]
    problems = [p for p in problems if p]
    if problems:
        print("✗ not yet: " + problems[0] + "".join(f"\n  also {p}" for p in problems[1:]))
        return False
    cites = "; ".join(f"{key}: {', '.join(cited_numbers(answers[key], numbers)[:3])}" for key in CITING)
    print(f"✓ your conclusions are written, and they cite numbers from the run ({cites}); now read the course's")
    return True


def _course_choice(plans: dict) -> str | None:
    """The course's rule: the simplest layout that fits -- least model parallelism (TP*PP*CP), then least traffic."""
    fits = [n for n, p in plans.items() if p.fits]
    return min(fits, key=lambda n: (plans[n].config["tp"] * plans[n].config["pp"] * plans[n].config["cp"],
                                    sum(plans[n].comm.values()))) if fits else None


def print_course_reading(sized: dict, unlocked: bool) -> None:
    """The course's reading of review question 6 (``sized``: {model name: {config: Plan}}), once the
    student's own conclusions are written (``unlocked``)."""
    if not unlocked:
        print("(the course's reading appears here once your conclusions above pass the check)")
        return
    for model, plans in sized.items():
        choice = _course_choice(plans)
        gpu = next(iter(plans.values())).gpu_memory_bytes / 1e9
        if choice is None:
            print(f"{model}: no layout of A-F fits in {gpu:.0f} GB: add recomputation, more GPUs or the "
                  f"distributed optimizer")
            continue
        p = plans[choice]
        mp = p.config["tp"] * p.config["pp"] * p.config["cp"]
        if mp == 1:
            print(f"{model}: {choice} -- {p.memory['total'] / 1e9:.2f} GB per rank of {gpu:.0f} GB: data "
                  f"parallelism alone fits, so no TP all-reduces, no bubble, the simplest command.")
            continue
        a = plans.get("A")
        start = f"A needs {a.memory['total'] / 1e9:.2f} GB per rank, more than {gpu:.0f} GB: " if a else ""
        print(f"{model}: {choice} -- {start}of the layouts that fit, {choice} has the least model parallelism "
              f"(TP*PP*CP = {mp}) and then the least traffic:")
        for name, q in plans.items():
            if q.fits:
                print(f"   {name}: {q.memory['total'] / 1e9:6.2f} GB/rank, TP+CP {(q.comm['tp'] + q.comm['cp']) / 1e9:7.2f} GB, "
                      f"PP {q.comm['pp'] / 1e9:5.2f} GB, DP {q.comm['dp'] / 1e9:5.2f} GB per rank per step, "
                      f"bubble {q.bubble:.3f}")
    print("Rule of thumb: TP inside a node (NVLink) until a layer fits; PP across nodes for depth, with m >= 4p; "
          "DP for the rest (with the distributed optimizer when the optimizer state does not fit); CP when the "
          "sequence is long. TP's traffic is fine over NVLink, painful across nodes.")


def with_your_conclusions(report: str, fn) -> str:
    """The deliverable ``report`` with its conclusions section rewritten: the student's conclusions
    (``fn()``, Exercise 5) first, the sentences the numbers support after them."""
    run = run_student(fn)
    answers = run.value if run.error is None and isinstance(run.value, dict) else None
    if answers:
        mine = [f"- **{LABELS[k]}:** {answers.get(k, '…')}" for k in CONCLUSIONS]
    else:
        mine = ["- (not written yet: write `my_conclusions` in §6 of the Lab 05 notebook)"]
    lines = report.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("## ") and "Conclusions" in line), None)
    if start is None:
        return "\n".join(lines + ["", "## Conclusions", "", *mine, ""])
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    generated = [line for line in lines[start + 1:end] if line.strip() and not line.startswith("- Your choice")]
    section = [lines[start], "", "### Mine", "", *mine, "", "### What the numbers say (generated from the run)", "",
               *generated, ""]
    return "\n".join(lines[:start] + section + lines[end:])


# ------------------------------------------------------------------ exercise 6: which config wins on 8 x H100

GPU_MODELS = {"tiny_gpt": "the seed's tiny GPT", "gpt_13b": "the 13B GPT"}
GPU_REASONS = {
    "dp_fits": "the model fits on one GPU: DP alone has no per-layer communication and no bubble",
    "small_tp_short_pp": "it must be split: TP 2 inside the NVLink node costs a small share of the GEMM time and a "
                         "2-stage pipeline with many micro-batches idles little -- less than more TP's all-reduces, "
                         "a deeper pipeline's bubble or the CP ring",
    "tp_is_free": "all-reduces on NVLink are free, so the config with the most TP wins",
    "deep_pp": "PP sends one tensor per micro-batch, far less than TP, so the deepest pipeline wins",
    "as_on_cpu": "the GPU ranking is the CPU sweep's ranking",
    "least_memory": "the config with the least memory per GPU wins",
}
_REASON_HINTS = {
    "tp_is_free": "NVLink makes TP cheap, not free: every all-reduce still costs a start-up and bytes/450 GB/s, "
                  "and TP shrinks each GEMM -- compare the TP time of B and C in the projection",
    "deep_pp": "PP's traffic is small, but a deep pipeline idles: (p-1)/m with m = global / (micro * DP), and "
               "more here, because the last stage also runs the output layer",
    "as_on_cpu": "the CPU ranking comes from gloo on 2 shared cores, where one all-reduce costs about a hundred "
                 "GEMMs (review question 1); on NVLink an all-reduce costs about as much as a GEMM or less",
    "least_memory": "memory only decides whether a config fits; among those that fit, the step time decides",
}
GPU_BATCH = {"tiny_gpt": (4, 64), "gpt_13b": (1, 64)}   # (micro, global), as review question 6 sizes them


def gpu_models() -> dict:
    """``{key: ModelSpec}``: the seed's tiny GPT and the 13B GPT of review question 6."""
    from course_lib.sizing import PRESETS, ModelSpec

    return {"tiny_gpt": PRESETS["tiny GPT (seed)"]["model"],
            "gpt_13b": ModelSpec("13B GPT", num_layers=40, hidden_size=5120, num_heads=40, vocab_size=51200,
                                 seq_length=2048)}


def gpu_projections(hardware: str = "H100") -> dict:
    """``{key: {config: Projection}}``: A-F of the seed on one 8-GPU node, SP with TP (review question 6's plans)."""
    from course_lib.sizing.projection import project_configs

    return {key: project_configs(model, SEED_SWEEP, 8, hardware, micro_batch_size=GPU_BATCH[key][0],
                                 global_batch_size=GPU_BATCH[key][1], sequence_parallel=True)  # off where TP = 1
            for key, model in gpu_models().items()}


def gpu_winner(projections: dict) -> str:
    """The config with the shortest projected step among those whose busiest rank fits."""
    fits = [n for n, p in projections.items() if p.plan.fits]
    return min(fits, key=lambda n: projections[n].step_time)


def _reason_for(projection) -> str:
    c = projection.plan.config
    if c["tp"] * c["pp"] * c["cp"] == 1:
        return "dp_fits"
    return "small_tp_short_pp"


def _costs(p) -> str:
    from course_lib.sizing.projection import seconds_text

    parts = p.breakdown()
    shown = [f"{k} {seconds_text(v)}" for k, v in parts.items() if v > 1e-4 * p.step_time]
    return f"step {seconds_text(p.step_time)} = " + " + ".join(shown)


def _config_hint(key: str, got: str, want: str, projections: dict) -> str:
    p, w = projections[got], projections[want]
    gpu = p.hardware.hbm_gb
    if not p.plan.fits:
        return (f"{got} does not fit: its busiest rank needs {p.plan.memory['total'] / 1e9:.1f} GB of {gpu:.0f} GB, "
                f"so it cannot run at all, whatever its projected step")
    c = p.plan.config
    if c["cp"] > 1:
        why = "CP adds a K/V ring in every attention on top of TP's all-reduces"
    elif c["tp"] > w.plan.config["tp"]:
        why = (f"TP {c['tp']}'s all-reduces take {p.breakdown()['tp'] * 1e3:.3g} ms per step against "
               f"{w.breakdown()['tp'] * 1e3:.3g} ms")
    elif c["pp"] > w.plan.config["pp"]:
        why = f"PP {c['pp']} idles longer in the bubble ({p.bubble:.3f} of the busy time against {w.bubble:.3f})"
    else:
        why = "its communication costs more than it saves"
    return f"{got}: {_costs(p)}; {want}: {_costs(w)} -- {why}"


def check_gpu_winner(fn, hardware: str = "H100") -> bool:
    """``fn() -> {"tiny_gpt": (config, reason), "gpt_13b": (config, reason)}``: the config of A-F with
    the shortest projected step on one 8-GPU node among those that fit, and the key of
    :data:`GPU_REASONS` that says why. Compared with :func:`course_lib.sizing.projection.project`."""
    if is_course_answer(fn):
        return False
    answers, err = checked_call(fn)
    if err == "todo":
        return _todo("predict_gpu_winner")
    shape = (None if isinstance(answers, dict) and set(answers) == set(GPU_MODELS) else
             f"returned {safe_repr(answers)}: return a dict with the keys {', '.join(GPU_MODELS)}, "
             "each (config, reason)")
    if err or shape:
        print(f"✗ predict_gpu_winner: {err or shape}")
        return False
    projected = gpu_projections(hardware)
    for key, label in GPU_MODELS.items():
        answer = answers[key]
        if not isinstance(answer, (tuple, list)) or len(answer) != 2 or not all(isinstance(x, str) for x in answer):
            print(f"✗ {key}: {safe_repr(answer)} is not a pair (config, reason) of two strings, "
                  "e.g. ('A', 'dp_fits')")
            return False
        got, reason = answer[0].strip().upper(), answer[1].strip()
        if got not in SEED_SWEEP:
            print(f"✗ {key}: {safe_repr(answer[0])} is not one of the configs {', '.join(SEED_SWEEP)}")
            return False
        if reason not in GPU_REASONS:
            print(f"✗ {key}: reason {safe_repr(answer[1])} is not a key of lab05.GPU_REASONS: "
                  f"{', '.join(GPU_REASONS)}")
            return False
        plans = projected[key]
        want = gpu_winner(plans)
        if got != want:
            print(f"✗ {label}: {got} is not the fastest config that fits on 8 x {hardware}")
            print(f"  hint: {_config_hint(key, got, want, plans)}")
            return False
        if reason != _reason_for(plans[want]):
            print(f"✗ {label}: {want} is right, but not because {GPU_REASONS[reason]!r}")
            hint = _REASON_HINTS.get(reason) or "look at which configs fit, then at what each adds to the step"
            print(f"  hint: {hint}")
            return False
    tiny, big = (projected[k] for k in GPU_MODELS)
    tw, bw = gpu_winner(tiny), gpu_winner(big)
    print(f"✓ predict_gpu_winner: {tw} for the tiny GPT ({_costs(tiny[tw])}) and {bw} for the 13B GPT "
          f"({_costs(big[bw])}) on 8 x {hardware}, projected")
    return True
