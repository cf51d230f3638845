"""Checkers for Lab 10 (Day 23, DeepSpeed itself): ZeRO-3's traffic, its gradient buckets, a config that fits.

The lab trains the course GPT with DeepSpeed on real ranks whose process group records every op
(:func:`course_lib.classroom.checks.wire.launch_checked`); :func:`train_on_ranks` runs there and
returns, per ds_config, what each rank held (:func:`course_lib.deepspeed.engine.held_bytes`)
and what it put on the wire, each op placed in DeepSpeed's phase of the step (forward, backward,
``engine.step()``) by the time it was issued. The checkers judge the student by that record:

* :func:`check_zero3_wire` -- predict the elements ZeRO-3 all-gathers in forward and backward, the
  elements it reduce-scatters, and what it all-gathers again after the step, from the parameters'
  sizes and the persistence threshold;
* :func:`check_reduce_buckets` -- DeepSpeed's bucketing of the gradients: the sizes of the
  reduce-scatters one backward issues for a ``reduce_bucket_size``;

  both are judged on cases drawn for the run (:func:`drawn_wire_cases`: a GPT of drawn depth and width, a
  persistence threshold and a bucket size), which DeepSpeed trains in one launch of 4 ranks with the wire
  recorded (:func:`drawn_wire_runs`); the student's function is called on every case first, so a stub, a
  crash or a malformed answer costs no launch;
* :func:`check_fits` -- ``fitting_config(budget)``: a ds_config that changes only the seed's ``zero_optimization``
  and spends a per-rank device budget drawn for the run (:func:`drawn_fit_budget`) as a practitioner
  would (:func:`course_lib.deepspeed.memory.spend_device_budget`, judged by :func:`fit_problem`); the checker
  trains it on 4 ranks (one launch) and reads what each rank holds on the device and on the host, and what
  crossed the wire (it must still be ZeRO-3: parameters gathered);
* :func:`check_answers` -- the review questions, answered by the student, each citing a number measured here.

None of them raises; the stub prints "not attempted yet".
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import shutil
import tempfile
import time

from course_lib.classroom.checks import checked_call, is_course_answer, not_attempted, raised_line
from course_lib.classroom.checks.exercise import exercise
from course_lib.classroom.checks.references import references_for
from course_lib.classroom.checks.verdicts import drawn_rng, safe_repr, same_value

# the lab's model: the course GPT, tiny (the ds_config sets the batch, the precision and the optimizer)
MODEL_FLAGS = ["--uniform-vocab-padding", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
               "--seq-length", "16", "--train-iters", "2", "--lr-decay-style", "constant"]
_WIRE = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")


class _Stamped(list):
    """A recorder's event list that notes when each op was issued (``time.perf_counter()``)."""

    def append(self, event) -> None:
        super().append((time.perf_counter(), event))


def _phase(t: float, phases: list):
    for p in phases:
        if p["start"] <= t <= p["end"]:
            return p
    return None


def wire_in_phases(stamped, phases: list) -> list[dict]:
    """Each recorded op as ``{"op", "numel", "bytes", "dtype", "t", "phase", "iteration", "micro"}``,
    ``phase`` the DeepSpeed phase it was issued in (``"setup"`` before the first, ``"between"`` outside
    any: the course's logging), ``t`` in seconds since the first phase began."""
    t0 = phases[0]["start"] if phases else 0.0
    out = []
    for t, e in stamped:
        p = _phase(t, phases)
        kind = p["kind"] if p else ("setup" if t < t0 else "between")
        out.append({"op": e.op, "numel": e.numel, "bytes": e.bytes, "dtype": e.dtype, "t": t - t0, "phase": kind,
                    "iteration": p["iteration"] if p else None, "micro": p["micro"] if p else None})
    return out


def train_on_ranks(configs: dict, model: list, ours: dict | None = None, models: dict | None = None) -> dict:
    """On every rank of a checked world: for each ``name: ds_config path`` of ``configs``, the course GPT
    (``model`` flags, or ``models[name]``) trained by DeepSpeed (:func:`course_lib.deepspeed.engine.pretrain`) with the
    wire recorded; for each ``name: flags`` of ``ours``, the course's own engine (losses only). Returns
    ``{name: {"lm_loss", "state_bytes", "phases", "wire"}}`` (phases and wire on one clock, seconds)."""
    import io
    from contextlib import redirect_stdout

    import torch.distributed as dist

    from course_lib.classroom.checks.wire import wire_recorder
    from course_lib.train import parse_args, pretrain, validate_args
    from course_lib.deepspeed import engine as deepspeed_engine

    out = {}
    for name, path in configs.items():
        flags = (models or {}).get(name, model)
        run = validate_args(parse_args(flags + ["--deepspeed-config", path]), dist.get_world_size(),
                            check_memory=False)
        with wire_recorder() as rec, redirect_stdout(io.StringIO()):
            rec.events = _Stamped()
            record = deepspeed_engine.pretrain(run, print_args=False)
        phases = record["phases"]
        out[name] = {"lm_loss": record["lm_loss"], "state_bytes": record["state_bytes"],
                     "phases": [dict(p, start=p["start"] - phases[0]["start"], end=p["end"] - phases[0]["start"])
                                for p in phases],
                     "wire": wire_in_phases(rec.events, phases)}
    for name, flags in (ours or {}).items():
        with redirect_stdout(io.StringIO()):
            record = pretrain(parse_args(model + flags), print_args=False, record_comm=False)
        out[name] = {"lm_loss": record["lm_loss"]}
    return out


def write_configs(configs: dict, folder: str | None = None) -> dict:
    """``{name: path}`` of each ``name: ds_config dict`` written as JSON into ``folder`` (by default a new temporary
    one, removed when this process exits)."""
    if folder is None:
        folder = tempfile.mkdtemp(prefix="ds_configs_")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
    paths = {}
    for name, config in configs.items():
        paths[name] = os.path.join(folder, f"{name}.json")
        with open(paths[name], "w") as f:
            json.dump(config, f, indent=1)
    return paths


def step_traffic(run: dict, iteration: int | None = None) -> dict:
    """One rank's wire in one iteration (the last one by default), by phase: ``{(phase, op): [numel, ...]}``."""
    wire = run["wire"]
    last = iteration or max(w["iteration"] for w in wire if w["iteration"] is not None)
    out: dict = {}
    for w in wire:
        if w["iteration"] == last and w["op"] in _WIRE:
            out.setdefault((w["phase"], w["op"]), []).append(w["numel"])
    return out


def traffic_table(runs: dict, names, iterations=(None,)) -> str:
    """Rank 0's traffic per run and iteration (None: the last): calls and elements of each op in each phase
    (deterministic text)."""
    order = {"forward": 0, "backward": 1, "step": 2}
    lines = [f"{'run':<7}{'iter':>5}  {'phase':<9}{'op':<15}{'calls':>6}{'elements':>10}  sizes"]
    for name in names:
        for iteration in iterations:
            traffic = step_traffic(runs[0][name], iteration)
            for (phase, op), sizes in sorted(traffic.items(), key=lambda kv: (order.get(kv[0][0], 9), kv[0][1])):
                shown = ", ".join(f"{n:,}" for n in sizes[:7]) + (", ..." if len(sizes) > 7 else "")
                lines.append(f"{name:<7}{iteration or 'last':>5}  {phase:<9}{op:<15}{len(sizes):>6}{sum(sizes):>10,}"
                             f"  {shown}")
    return "\n".join(lines)


# ------------------------------------------------------------------ the drawn cases of exercises 1 and 2

WIRE_KEYS = ("forward_all_gather", "backward_all_gather", "reduce_scatter", "step_all_gather")
DRAWN_CASES = 3
_DRAWN: dict = {}   # this process's drawn cases and their runs (under the judge: the judge's, see kept_for_the_run)
_KEPT = ("cases", "runs", "world")


def gradient_order(model) -> list[int]:
    """The gradients' element counts in the order backward makes them ready: modules in reverse order of use,
    each module's tensors in their order, the tied word embedding (input and output layer) last."""
    modules = [m for m in model.modules() if list(m.parameters(recurse=False))]
    tied = model.embedding.word_embeddings.weight
    order = [p for m in reversed(modules) for p in m.parameters(recurse=False) if p is not tied]
    return [p.numel() for p in order] + [tied.numel()]


def model_flags(num_layers: int, hidden_size: int) -> list:
    """:data:`MODEL_FLAGS` with another depth and width."""
    flags = list(MODEL_FLAGS)
    flags[flags.index("--num-layers") + 1], flags[flags.index("--hidden-size") + 1] = str(num_layers), str(hidden_size)
    return flags


def _drawn_threshold(rng, numels: list, at_a_size: bool) -> int:
    """A persistence threshold that splits the tensors somewhere: at one of their sizes (a tensor of exactly the
    threshold is persistent: ``<=``), or anywhere from there to just below the next size."""
    sizes = sorted(set(numels))
    k = rng.randrange(1, len(sizes))                  # tensors of sizes[:k] persistent, the rest gathered
    return sizes[k - 1] if at_a_size else rng.randint(sizes[k - 1], sizes[k] - 1)


def _drawn_bucket(rng, grads: list, at_a_boundary: bool) -> int:
    """A reduce bucket size between the smallest gradient and the whole gradient: exactly what the first gradients
    in backward's order add up to (the one that fills the bucket to the size still fits: a bucket is reduced when
    the next gradient would *exceed* it), or any size in that range."""
    if at_a_boundary:
        return sum(grads[:rng.randrange(1, len(grads))])
    return rng.randint(min(grads), sum(grads))


def drawn_wire_cases(rng, count: int = DRAWN_CASES) -> list[dict]:
    """``count`` cases for this run: ``{"flags", "numels", "grad_numels", "threshold", "bucket", "config"}`` -- the
    course GPT of a drawn depth and width (``numels``: name -> elements; ``grad_numels`` in backward's order), a
    persistence threshold that splits its tensors, and a reduce bucket between its smallest and its whole
    gradient; ``config`` the lab's ds_config on 4 ranks with those two set. The first case puts both on a boundary
    (a tensor of exactly the threshold, gradients that fill the bucket exactly), so that an answer off by one there
    (``<`` for ``<=``) fails every run; the others are on one with odds 1/2."""
    from course_lib.model import GPTModel
    from course_lib.train import parse_args, validate_args

    cases = []
    for i in range(count):
        flags = model_flags(rng.randint(1, 3), 4 * rng.randint(3, 12))
        model = GPTModel(validate_args(parse_args(flags), 4, check_memory=False).model)
        numels = {n: p.numel() for n, p in model.named_parameters()}
        grads = gradient_order(model)
        threshold = _drawn_threshold(rng, list(numels.values()), at_a_size=i == 0 or rng.random() < 0.5)
        bucket = _drawn_bucket(rng, grads, at_a_boundary=i == 0 or rng.random() < 0.5)
        config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                  "bf16": {"enabled": True}, "gradient_clipping": 1.0,
                  "optimizer": {"type": "AdamW", "params": {"lr": 3e-4}},
                  "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                        "offload_param": {"device": "cpu"}, "overlap_comm": True,
                                        "reduce_bucket_size": bucket, "stage3_prefetch_bucket_size": bucket,
                                        "stage3_param_persistence_threshold": threshold}}
        cases.append({"flags": flags, "numels": numels, "grad_numels": grads, "threshold": threshold,
                      "bucket": bucket, "config": config})
    return cases


def _drawn_cases() -> list[dict]:
    if "cases" not in _DRAWN:
        _DRAWN["cases"] = drawn_wire_cases(drawn_rng())
    return _DRAWN["cases"]


def drawn_wire_runs(world: int = 4, timeout: float = 240) -> list:
    """The drawn cases trained by DeepSpeed in one launch of ``world`` checked ranks (:func:`train_on_ranks`):
    ``runs[rank]["case<i>"]``; launched once per process, whichever exercise asks first (under the judge once per
    judge: :func:`keep_for_the_run`)."""
    from course_lib.classroom.checks.wire import launch_checked
    from course_lib.deepspeed.engine import preload

    # the world is the request's (the kernel writes it): runs launched on another world are no truth for this one
    if "runs" not in _DRAWN or _DRAWN.get("world") != world:
        cases = _drawn_cases()
        names = [f"case{i}" for i in range(len(cases))]
        preload()
        _DRAWN["runs"] = launch_checked(train_on_ranks, world, timeout=timeout, model=MODEL_FLAGS,
                                        configs=write_configs({n: c["config"] for n, c in zip(names, cases)}),
                                        models={n: c["flags"] for n, c in zip(names, cases)})
        _DRAWN["world"] = world
    return _DRAWN["runs"]


def kept_for_the_run() -> dict:
    """In a check process of the judge, after its checker: the drawn cases and their runs (plain data: dicts,
    lists, numbers, strings), which the judge keeps for the run's next checks (:func:`keep_for_the_run`)."""
    return {k: _DRAWN[k] for k in _KEPT if k in _DRAWN}


def keep_for_the_run(kept: dict) -> None:
    """In the judge: take what a check process drew and launched (:func:`kept_for_the_run`), so that the check
    processes it forks next find it -- one launch serves both exercises, as in a process without a judge. Only
    the checker's own data comes here: no student code runs in a check process, and none on these ranks."""
    if "cases" in kept and "cases" not in _DRAWN:
        _DRAWN["cases"] = kept["cases"]
    if "runs" in kept and "world" in kept:   # the latest launch: drawn_wire_runs relaunches for another world
        _DRAWN.update(runs=kept["runs"], world=kept["world"])


def _runs_or_problem(world: int):
    """The drawn runs, or ``None`` with the reason printed (a launch that failed is not the student's fault)."""
    from course_lib.launch import LaunchError, RankError

    try:
        return drawn_wire_runs(world)
    except (RankError, LaunchError) as err:
        print(f"✗ DeepSpeed's run of the drawn cases failed outside your function "
              f"({raised_line(err) if isinstance(err, RankError) else err}); re-run the cell")
        return None


def _answers(fn, name: str, args_of) -> list | None:
    """The student's answer to every drawn case (``args_of(case)``: the call's arguments), before any launch;
    ``None`` with the verdict printed for a stub or a call that went wrong."""
    answers = []
    for case in _drawn_cases():
        args = args_of(case)
        got, problem = checked_call(fn, *args, references=references_for(name))
        if problem == "todo":
            not_attempted(name)
            return None
        if problem:
            print(f"✗ {name}(..., {', '.join(map(str, args[1:]))}) {problem}")
            return None
        answers.append(got)
    return answers


# ------------------------------------------------------------------ exercise 1: ZeRO-3's wire, predicted


def measured_wire(run: dict) -> dict:
    """What a rank moved in its last iteration, per micro-batch (:data:`WIRE_KEYS`, elements): the
    parameters' all-gathers in forward and in backward, the gradients' reduce-scatters, and the
    all-gathers of ``engine.step()``."""
    last = max(w["iteration"] for w in run["wire"] if w["iteration"] is not None)
    micros = {w["micro"] for w in run["wire"] if w["iteration"] == last}
    micro = max(m for m in micros if m is not None)
    sent = {k: 0 for k in WIRE_KEYS}
    for w in run["wire"]:
        if w["iteration"] != last or w["micro"] != micro:
            continue
        key = {("forward", "all_gather"): "forward_all_gather", ("backward", "all_gather"): "backward_all_gather",
               ("backward", "reduce_scatter"): "reduce_scatter", ("step", "reduce_scatter"): "reduce_scatter",
               ("step", "all_gather"): "step_all_gather"}.get((w["phase"], w["op"]))
        if key:
            sent[key] += w["numel"]
    return sent


@exercise("zero3_wire")
def check_zero3_wire(fn, world: int = 4) -> bool:
    """``fn(numels, world, persistence_threshold)`` -> :data:`WIRE_KEYS` elements for one micro-batch of a
    steady-state iteration; compared, on every rank, with the wire DeepSpeed's ZeRO-3 put out on
    :data:`DRAWN_CASES` models and thresholds drawn for this run."""
    if is_course_answer(fn):
        return False
    answers = _answers(fn, "zero3_wire", lambda c: (dict(c["numels"]), world, c["threshold"]))
    if answers is None:
        return False
    for got in answers:
        if not isinstance(got, dict) or set(got) != set(WIRE_KEYS):
            print(f"✗ zero3_wire returned {safe_repr(got)}; return a dict with the keys {', '.join(WIRE_KEYS)}")
            return False
    runs = _runs_or_problem(world)
    if runs is None:
        return False
    for i, (case, got) in enumerate(zip(_drawn_cases(), answers)):
        want = [measured_wire(r[f"case{i}"]) for r in runs]
        if any(w != want[0] for w in want):
            print("✗ the ranks disagree on the wire of a drawn case; re-run the cell")
            return False
        wrong = [k for k in WIRE_KEYS if not same_value(got[k], want[0][k])]
        if wrong:
            k, sizes = wrong[0], sorted(case["numels"].values())
            print(f"✗ a GPT of {len(sizes)} tensors ({sizes[0]:,} to {sizes[-1]:,} elements), threshold "
                  f"{case['threshold']:,}: {k} = {safe_repr(got[k])} is not what the wire shows. "
                  + _wire_hint(k, case["threshold"]))
            return False
    print(f"✓ ZeRO-3's traffic predicted on {len(answers)} models and persistence thresholds drawn for this run, "
          f"each as DeepSpeed's wire on {world} ranks: each partitioned parameter is gathered once per forward (and "
          f"kept for backward), every gradient is reduce-scattered, the persistent ones are re-gathered after the "
          f"step")
    return True


def _wire_hint(key: str, threshold: int) -> str:
    """The rule behind ``key`` (never the measured value: the hint must not give the answer)."""
    return {
        "forward_all_gather": f"Parameters of <= {threshold:,} elements are persistent: every rank keeps them whole "
                              f"and never gathers them; the others are gathered once.",
        "backward_all_gather": "stage3_max_reuse_distance (1e9) spans the whole model: a parameter used again within "
                               "that many elements is not released (partitioned_param_coordinator.py "
                               "__params_to_release), so nothing gathered for the forward is released before "
                               "the backward, which gathers nothing.",
        "reduce_scatter": "Every gradient is reduced, the persistent parameters' too: the whole model, once per "
                          "micro-batch.",
        "step_all_gather": "After the optimizer updated each rank's partition, the persistent parameters are "
                           "all-gathered so that every rank has them whole again.",
    }[key]


# ------------------------------------------------------------------ exercise 2: the gradient buckets


def measured_buckets(run: dict) -> list[int]:
    """The reduce-scatter sizes one micro-batch of the last iteration issued (backward and step, in order)."""
    last = max(w["iteration"] for w in run["wire"] if w["iteration"] is not None)
    micro = max(w["micro"] for w in run["wire"] if w["iteration"] == last and w["micro"] is not None)
    return [w["numel"] for w in run["wire"] if w["iteration"] == last and w["micro"] == micro
            and w["op"] == "reduce_scatter"]


@exercise("reduce_buckets")
def check_reduce_buckets(fn, world: int = 4) -> bool:
    """``fn(grad_numels, reduce_bucket_size)`` -> the list of reduce-scatter sizes, for the gradients in the
    order they become ready; compared with the wire of :data:`DRAWN_CASES` models and bucket sizes drawn for
    this run."""
    if is_course_answer(fn):
        return False
    answers = _answers(fn, "reduce_buckets", lambda c: (list(c["grad_numels"]), c["bucket"]))
    if answers is None:
        return False
    runs = _runs_or_problem(world)
    if runs is None:
        return False
    for i, (case, got) in enumerate(zip(_drawn_cases(), answers)):
        want = measured_buckets(runs[0][f"case{i}"])
        if not same_value(list(got) if isinstance(got, (list, tuple)) else got, want):
            print(f"✗ reduce_bucket_size {case['bucket']:,} on {len(case['grad_numels'])} gradients: you return "
                  f"{safe_repr(got)}, not the wire's reduce-scatters. "
                  + _bucket_hint(got, want, case["grad_numels"], case["bucket"]))
            return False
    print(f"✓ DeepSpeed's buckets, on {len(answers)} models and bucket sizes drawn for this run, each as the wire "
          f"showed: a gradient that would overflow the bucket flushes it first; one larger than the bucket goes "
          f"alone; what is left is flushed when backward ends")
    return True


def _bucket_hint(got, want, grad_numels, size) -> str:
    """The rule the student's buckets break, at the first bucket that differs from the wire's (never the wire's
    sizes: the hint must not give the answer)."""
    if not isinstance(got, (list, tuple)) or not all(isinstance(n, int) for n in got):
        return "Return the list of bucket sizes (ints), in the order DeepSpeed reduces them."
    if sum(got) != sum(grad_numels):
        return (f"Your sizes add up to {sum(got):,}, the gradients to {sum(grad_numels):,}: every gradient is "
                f"reduced exactly once.")
    first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    if first < len(got) and got[first] > size and got[first] not in grad_numels:
        return (f"Your bucket {first} holds {got[first]:,} elements, more than {size:,}: the bucket is reduced "
                f"*before* a gradient that would make it exceed the size is added.")
    if first >= len(got):
        return "You stop early: what is left in the bucket is reduced when backward ends."
    ends = list(itertools.accumulate(grad_numels))     # where a bucket can end: after each gradient
    held = sum(got[:first + 1])
    after = ends.index(held) + 1 if held in ends else len(grad_numels)   # the gradient after your bucket
    if after < len(grad_numels) and got[first] + grad_numels[after] == size:
        return (f"Your bucket {first} ({got[first]:,} elements) is reduced before a gradient of "
                f"{grad_numels[after]:,} that fills it to exactly {size:,}: that gradient still fits -- a bucket "
                f"is reduced only when the next gradient would *exceed* reduce_bucket_size.")
    return (f"Your bucket {first} ({got[first]:,} elements) is where you part from the wire: a bucket is reduced "
            f"only when the next gradient would not fit, and a gradient larger than the bucket goes alone.")


# ------------------------------------------------------------------ exercise 3: a config that fits


def _returned_dict(fn, name: str, what: str, exercise: str) -> dict | None:
    """What the student's ``fn()`` returned when it is a dict; else None, with the verdict printed
    (``exercise``: its key in the reference registry)."""
    if is_course_answer(fn):
        return None
    value, problem = checked_call(fn, references=references_for(exercise))
    if problem == "todo":
        not_attempted(name)
        return None
    if problem or not isinstance(value, dict):
        print(f"✗ {name}() {problem or 'returned ' + safe_repr(value) + '; return ' + what}")
        return None
    return value


def _device_bytes(held: dict) -> int:
    return held["params"] + held["grads"] + held["optimizer"]


# what a fitting config keeps of the lab's seed: all of SEED4 (the seed's file with the batch scaled to 4 ranks) but
# zero_optimization -- the batch, the precision (2 bytes an element on the device), the optimizer, the logging
SEED_KEPT = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
             "bf16": {"enabled": True}, "gradient_clipping": 1.0,
             "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8,
                                                       "weight_decay": 0.1}},
             "steps_per_print": 10, "wall_clock_breakdown": False}
FIT_TOLERANCE = 0.0025
"""The share of the budget a fitting config may leave unused (the bucket takes the rest; it may be rounded to some
tens of elements). A config right for another budget of the same size class passes only where the budget is at most
this much above its bytes: ~0.7 % of the draws on average, ~2.3 % at most (narrow size classes)."""


def lab_numels(flags: list | None = None) -> list[int]:
    """The element count of each parameter of the course GPT of ``flags`` (:data:`MODEL_FLAGS`: the lab's)."""
    from course_lib.model import GPTModel
    from course_lib.train import parse_args, validate_args

    model = GPTModel(validate_args(parse_args(flags or MODEL_FLAGS), 4, check_memory=False).model)
    return [p.numel() for p in model.parameters()]


def drawn_fit_budget(rng, numels: list, level: int | None = None) -> int:
    """A device budget (bytes per rank at rest) for this run: a number of size classes kept whole (``level``,
    by default drawn: 1 to all but the largest, each as likely), then a budget from the least that keeps them whole
    beside a bucket of the largest gradient to one byte short of the next class -- every budget has a right answer
    (:func:`course_lib.deepspeed.memory.spend_device_budget`), and the bucket it leaves differs with the budget.
    Level 0 (nothing whole) is never drawn: there a bucket that forgets the whole tensors is right by chance."""
    k = rng.randrange(1, len(_fit_levels(numels)) - 1) if level is None else level
    return rng.randint(*fit_edges(numels, k))


def _fit_levels(numels: list) -> list:
    """Elements kept whole when every size class up to each is (0: none; the last: all of them)."""
    sizes = sorted(set(numels))
    return [0] + [sum(n for n in numels if n <= s) for s in sizes[:-1]] + [sum(numels)]


def fit_edges(numels: list, level: int) -> tuple[int, int]:
    """The least budget that keeps ``level`` size classes whole beside a bucket of the largest gradient (the class
    fills it exactly: it still fits, ``<=``), and the budget one byte short of the next class (which does not)."""
    levels, largest = _fit_levels(numels), max(numels)
    return 2 * (levels[level] + largest), 2 * (levels[level + 1] + largest) - 1


def _fit_budget() -> int:
    """The budget of this check: drawn in the checker's process (under the judge, the check process)."""
    return drawn_fit_budget(drawn_rng(), lab_numels())


def fit_edge_budgets(rng, numels: list) -> tuple[int, int]:
    """This run's two budgets on a boundary (:func:`fit_edges`): the least that keeps a drawn number of size classes
    whole (1 to all but the largest), and one byte short of a drawn class that could be kept (never the largest)
    -- drawn alone, the budget lands on one in fewer than 1 run in 1,000, so an answer off by one there passed."""
    top = len(_fit_levels(numels)) - 2                # the level that keeps all but the largest
    return fit_edges(numels, rng.randint(1, top))[0], fit_edges(numels, rng.randint(1, top - 1))[1]


def edge_problem(fn, budget: int, numels: list, measured: dict) -> str | None:
    """What is wrong with ``fn``'s config for a budget on a boundary (:func:`fit_edges`), judged without a launch by
    the rule the launches check (:func:`course_lib.deepspeed.memory.zero3_device_at_rest`, what DeepSpeed holds;
    :func:`fit_problem`; the host side and the optimizer as ``measured`` for the drawn budget's config), as one
    line naming the rule; None when right."""
    from course_lib.classroom.checks.verdicts import as_real
    from course_lib.deepspeed.memory import zero3_device_at_rest
    from course_lib.deepspeed.schema import DEFAULTS

    config, problem = checked_call(fn, budget, references=references_for("fitting_config"))
    if problem or not isinstance(config, dict):
        return problem or f"returned {safe_repr(config)}; return a ds_config dict"
    zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), dict) else {}
    threshold, bucket = (as_real(zero.get(k, DEFAULTS["zero_optimization"][k]))[0]
                         for k in ("stage3_param_persistence_threshold", "reduce_bucket_size"))
    if threshold is None or bucket is None:
        return "stage3_param_persistence_threshold and reduce_bucket_size are numbers (elements)"
    whole = zero3_device_at_rest(numels, threshold, 0) // 2
    held = dict(measured, params=2 * whole, grads=2 * int(bucket))
    problem = fit_problem(held, sum(numels) - whole, budget, numels, config)
    if problem is None:
        return None
    return (f"{problem}\n  hint: judged by DeepSpeed's rule (no launch) at a budget where a size of tensors fits "
            f"beside the bucket exactly or misses it by one byte: a size that fills the budget exactly still fits "
            f"(2·(elements whole + largest gradient) <= budget); one byte more than the budget does not")


def fit_problem(held: dict, gathered: int, budget: int, numels: list, config: dict) -> str | None:
    """What is wrong with a config that DeepSpeed trained (``held``: the worst rank's
    :func:`~course_lib.deepspeed.engine.held_bytes`; ``gathered``: the elements forward all-gathered) for a device
    ``budget`` on the model of ``numels``, as one line (the rule it breaks, never the right config); None when it
    spends the budget as :func:`~course_lib.deepspeed.memory.spend_device_budget` does: within it, a bucket that
    holds the largest gradient, no fewer tensors whole than fit beside that bucket, the rest (all but
    :data:`FIT_TOLERANCE`) in the bucket."""
    from course_lib.deepspeed.memory import spend_device_budget

    plan, device = spend_device_budget(numels, budget), _device_bytes(held)
    zero = config.get("zero_optimization") if isinstance(config.get("zero_optimization"), dict) else {}
    if held["optimizer"]:
        return ("the optimizer state is on the device: keep the seed's offload_optimizer (the budget is for what "
                "ZeRO-3 keeps on the device at rest: the whole small tensors and the reduce bucket)")
    if held["params_host"] == 0:
        return ("the parameters' partitions are on the device: keep the seed's offload_param (the budget is for the "
                "whole small tensors and the reduce bucket)")
    if device > budget:
        part = max(("params", "grads", "optimizer"), key=lambda k: held[k])
        return (f"{device:,} B on the device > the budget {budget:,} B; the largest part is {part} "
                f"({held[part]:,} B). " + _fit_hint(part, config))
    if gathered == 0:
        return ("forward gathers no parameter: every rank holds every parameter whole, so this is not ZeRO-3's "
                "partitioning any more; keep stage 3 with a persistence threshold below the large weights")
    bucket, whole = held["grads"] // 2, held["params"] // 2
    if bucket < plan.largest:
        return (f"your reduce bucket holds {bucket:,} elements, fewer than the largest gradient ({plan.largest:,}): "
                "DeepSpeed copies a gradient into its contiguous bucket only when it fits (stage3.py "
                "__add_grad_to_ipg_bucket), so the bucket comes first, large enough for every gradient"
                + ("; keep contiguous_gradients on (its default): without it there is no bucket"
                   if zero.get("contiguous_gradients") is False else ""))
    if whole < plan.persistent:
        return (f"you keep {whole:,} elements whole on every rank; beside a bucket that holds the largest gradient "
                f"the budget has room for more: keep whole every size of tensor that still fits, smallest first "
                f"(stage3_param_persistence_threshold; each tensor kept whole is an all-gather fewer in every forward)")
    if device < budget * (1 - FIT_TOLERANCE):
        return (f"{device:,} B of the {budget:,} B budget used: once the tensors that fit are whole, what is left "
                f"belongs to the reduce bucket (a larger reduce_bucket_size: fewer reduce-scatters in backward); "
                f"leave at most {FIT_TOLERANCE:.2%} of the budget unused")
    return None


@exercise("fitting_config")
def check_fits(fn, world: int = 4, timeout: float = 120) -> bool:
    """``fn(budget)`` -> a ds_config that changes nothing of the lab's seed but ``zero_optimization``
    (:data:`SEED_KEPT`: batch, precision, optimizer, clipping, logging) and spends a device budget drawn for this run (bytes of model states per rank at rest,
    :func:`drawn_fit_budget`) as :func:`fit_problem` asks; trained on ``world`` ranks (with the wire recorded)
    to read what each rank holds and what it sends -- one launch."""
    from course_lib.classroom.checks.wire import launch_checked
    from course_lib.launch import LaunchError, RankError
    from course_lib.deepspeed.engine import preload

    if is_course_answer(fn):
        return False
    budget = _fit_budget()
    config, problem = checked_call(fn, budget, references=references_for("fitting_config"))
    if problem == "todo":
        not_attempted("fitting_config")
        return False
    if problem or not isinstance(config, dict):
        print(f"✗ fitting_config({budget:,}) {problem or 'returned ' + safe_repr(config) + '; return a ds_config dict'}")
        return False
    try:
        config = json.loads(json.dumps(config))            # what DeepSpeed reads: the file written below
    except (TypeError, ValueError) as err:
        print(f"✗ fitting_config({budget:,}) returned a dict that is not JSON ({err}); a ds_config is a JSON file: "
              f"use ints, floats, strings, lists and dicts")
        return False
    changed = [k for k in sorted(set(config) | set(SEED_KEPT)) if k != "zero_optimization"
               and config.get(k, "(none)") != SEED_KEPT.get(k, "(none)")]
    if changed:
        k = changed[0]
        print(f"✗ fitting_config({budget:,}): {k} differs from the seed's ({safe_repr(config.get(k, '(none)'))} vs "
              f"{safe_repr(SEED_KEPT.get(k, '(none)'))}): change only zero_optimization, the run must train the same "
              f"model in the same precision")
        return False
    paths = write_configs({"yours": config})
    preload()
    try:
        runs = launch_checked(train_on_ranks, world, timeout=timeout, configs=paths, model=MODEL_FLAGS)
    except (RankError, LaunchError) as err:
        line = raised_line(err) if isinstance(err, RankError) else str(err)
        print(f"✗ fitting_config({budget:,}): DeepSpeed did not train it: {line}")
        return False
    except ValueError as err:
        print(f"✗ fitting_config({budget:,}): DeepSpeed refuses it: {err}")
        return False
    held = [r["yours"]["state_bytes"] for r in runs]
    worst = max(range(world), key=lambda r: _device_bytes(held[r]))
    h = held[worst]
    gathered = measured_wire(runs[0]["yours"])["forward_all_gather"]
    problem = fit_problem(h, gathered, budget, lab_numels(), config)
    if problem:
        print(f"✗ fitting_config({budget:,}): {problem}")
        print(f"  measured on {world} ranks, rank {worst}: device params {h['params']:,} + grads {h['grads']:,} + "
              f"optimizer {h['optimizer']:,} = {_device_bytes(h):,} B; host "
              f"{h['params_host'] + h['grads_host'] + h['optimizer_host']:,} B; forward all-gathers {gathered:,} "
              f"elements per micro-batch")
        return False
    for edge in fit_edge_budgets(drawn_rng(), lab_numels()):   # by the rule the launch checked: no launch more
        problem = edge_problem(fn, edge, lab_numels(), h)
        if problem:
            print(f"✗ fitting_config({edge:,}): {problem}")
            return False
    print(f"✓ DeepSpeed trained your config on {world} ranks within the device budget drawn for this run, spent as a "
          f"practitioner would: a reduce bucket that holds the largest gradient, as many of the smallest tensors "
          f"whole as fit beside it, the rest in the bucket (at most {FIT_TOLERANCE:.2%} unused); the offloads kept, "
          f"the large weights still gathered in every forward")
    return True


def _fit_hint(part: str, config: dict) -> str:
    from course_lib.deepspeed.schema import DEFAULTS

    zero = config.get("zero_optimization") or {}
    default = DEFAULTS["zero_optimization"]       # what DeepSpeed takes for a key the config leaves out
    if part == "params":
        threshold = zero.get("stage3_param_persistence_threshold", default["stage3_param_persistence_threshold"])
        return ("ZeRO-3 keeps every parameter of <= stage3_param_persistence_threshold elements whole on every rank "
                f"(yours: {safe_repr(threshold)}); below stage 3 the whole 16-bit model is on every rank")
    if part == "grads":
        bucket = ("ZeRO-3 reserves a reduce bucket of reduce_bucket_size elements on the device "
                  f"(yours: {safe_repr(zero.get('reduce_bucket_size', default['reduce_bucket_size']))})")
        offload = zero.get("offload_optimizer") if isinstance(zero.get("offload_optimizer"), dict) else {}
        if offload.get("device") in ("cpu", "nvme"):
            return bucket + "; it shares the budget with the tensors kept whole: the bucket gets what they leave"
        return bucket + "; without optimizer offload the gradient partition stays there too"
    return "the fp32 master params and Adam's moments: offload_optimizer moves them to the host"


# ------------------------------------------------------------------ review questions

QUESTIONS = {
    "persistence": "why the seed's config all-gathers no parameter in forward on this model, and what that costs",
    "buckets": "what reduce_bucket_size and stage3_prefetch_bucket_size changed on the wire, and on the device",
    "offload": "where the bytes of a rank went under the seed's offload, measured, against DeepSpeed's estimator",
    "megatron": "the Megatron flags of the same run, and what of the ds_config has no Megatron equivalent",
}


@exercise("my_answers_10")
def check_answers(fn, *sources) -> bool:
    """The student's answers to :data:`QUESTIONS` (``fn()`` -> a dict of strings): each written, and each
    citing at least one number measured or computed in this lab (``sources``: the runs, tables...)."""
    from course_lib.classroom.checks.conclusions import cited_numbers, measured_numbers

    answers = _returned_dict(fn, "my_answers", "a dict of strings", "my_answers_10")
    if answers is None:
        return False
    numbers = measured_numbers(*sources)
    for key, question in QUESTIONS.items():
        text = answers.get(key)
        if not isinstance(text, str) or len(text.split()) < 12:
            print(f"✗ answer {key!r} ({question}): write a few sentences (got {safe_repr(text)})")
            return False
        if not cited_numbers(text, numbers):
            print(f"✗ answer {key!r} cites no number measured above: quote one as printed (bytes, elements, calls)")
            return False
    print("✓ four answers, each citing a measurement, recorded for your instructor (what they say is not graded "
          "here); compare them with the course's reading below")
    return True
