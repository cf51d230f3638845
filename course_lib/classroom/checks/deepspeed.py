"""Checkers for Lab 10 (Day 23, DeepSpeed itself): ZeRO-3's traffic, its gradient buckets, a config that fits.

The lab trains the course GPT with DeepSpeed on real ranks whose process group records every op
(:func:`course_lib.classroom.checks.wire.launch_checked`); :func:`train_on_ranks` runs there and
returns, per ds_config, what each rank held (:func:`course_lib.deepspeed.engine.held_bytes`)
and what it put on the wire, each op placed in DeepSpeed's phase of the step (forward, backward,
``engine.step()``) by the time it was issued. The checkers judge the student by that record:

* :func:`check_zero3_wire` -- predict the elements ZeRO-3 all-gathers in forward and backward, the
  elements it reduce-scatters, and what it all-gathers again after the step, from the parameters'
  sizes and the persistence threshold; compared with the wire of every recorded run;
* :func:`check_reduce_buckets` -- DeepSpeed's bucketing of the gradients: the sizes of the
  reduce-scatters one backward issues for a ``reduce_bucket_size``; compared with the wire;
* :func:`check_fits` -- a ds_config that keeps the seed's batch, precision and optimizer and fits a
  per-rank device budget; the checker trains it on 4 ranks and reads what each rank holds on the device
  and on the host, and what crossed the wire (it must still be ZeRO-3: parameters gathered);
* :func:`check_answers` -- the review questions, answered by the student, each citing a number measured here.

None of them raises; the stub prints "not attempted yet".
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
import time

from course_lib.classroom.checks import checked_call, is_course_answer, not_attempted, raised_line
from course_lib.classroom.checks.exercise import exercise
from course_lib.classroom.checks.references import references_for
from course_lib.classroom.checks.verdicts import safe_repr, same_value

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


def train_on_ranks(configs: dict, model: list, ours: dict | None = None) -> dict:
    """On every rank of a checked world: for each ``name: ds_config path`` of ``configs``, the course GPT
    (``model`` flags) trained by DeepSpeed (:func:`course_lib.deepspeed.engine.pretrain`) with the
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
        run = validate_args(parse_args(model + ["--deepspeed-config", path]), dist.get_world_size(),
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


# ------------------------------------------------------------------ exercise 1: ZeRO-3's wire, predicted

WIRE_KEYS = ("forward_all_gather", "backward_all_gather", "reduce_scatter", "step_all_gather")


def measured_wire(run: dict) -> dict:
    """What a rank moved in its last iteration, per micro-batch (:data:`WIRE_KEYS`, elements): the
    parameters' all-gathers in forward and in backward, the gradients' reduce-scatters, and the
    all-gathers of ``engine.step()``; ``None`` when the ranks disagree is not possible (one rank's)."""
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
def check_zero3_wire(fn, runs, numels: dict, thresholds: dict) -> bool:
    """``fn(numels, world, persistence_threshold)`` -> :data:`WIRE_KEYS` elements for one micro-batch of a
    steady-state iteration; compared with every run's measured wire (``thresholds``: run name ->
    ``stage3_param_persistence_threshold``) on every rank."""
    if is_course_answer(fn):
        return False
    world = len(runs)
    for name, threshold in thresholds.items():
        got, problem = checked_call(fn, dict(numels), world, threshold, references=references_for("zero3_wire"))
        if problem == "todo":
            return not_attempted("zero3_wire")
        if problem:
            print(f"✗ zero3_wire(..., {world}, {threshold}) {problem}")
            return False
        want = [measured_wire(r[name]) for r in runs]
        if any(w != want[0] for w in want):
            print(f"✗ the ranks of run {name} disagree on the wire: {want}; re-run the launch")
            return False
        want = want[0]
        if not isinstance(got, dict) or set(got) != set(WIRE_KEYS):
            print(f"✗ zero3_wire returned {safe_repr(got)}; return a dict with the keys {', '.join(WIRE_KEYS)}")
            return False
        wrong = [k for k in WIRE_KEYS if not same_value(got[k], want[k])]
        if wrong:
            k = wrong[0]
            print(f"✗ run {name} (threshold {threshold:,}): {k} = {safe_repr(got[k])} is not what the wire shows. "
                  + _wire_hint(k, threshold))
            return False
        print(f"  run {name}: " + ", ".join(f"{k} {want[k]:,}" for k in WIRE_KEYS) + " elements = the wire")
    print("✓ ZeRO-3's traffic predicted: each partitioned parameter is gathered once per forward (and kept for "
          "backward), every gradient is reduce-scattered, the persistent ones are re-gathered after the step")
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
def check_reduce_buckets(fn, runs, grad_numels: list, bucket_sizes: dict) -> bool:
    """``fn(grad_numels, reduce_bucket_size)`` -> the list of reduce-scatter sizes, for the gradients in the
    order they become ready; compared with each run's wire (``bucket_sizes``: run -> its bucket size)."""
    if is_course_answer(fn):
        return False
    for name, size in bucket_sizes.items():
        got, problem = checked_call(fn, list(grad_numels), size, references=references_for("reduce_buckets"))
        if problem == "todo":
            return not_attempted("reduce_buckets")
        if problem:
            print(f"✗ reduce_buckets(..., {size}) {problem}")
            return False
        want = measured_buckets(runs[0][name])
        if not same_value(list(got) if isinstance(got, (list, tuple)) else got, want):
            print(f"✗ reduce_bucket_size {size:,} (run {name}): you return {safe_repr(got)}, not the wire's "
                  f"reduce-scatters. " + _bucket_hint(got, want, grad_numels, size))
            return False
        print(f"  run {name}: reduce_bucket_size {size:,} -> {len(want)} reduce-scatter(s) of {want} = the wire")
    print("✓ DeepSpeed's buckets: a gradient that would overflow the bucket flushes it first; one larger than "
          "the bucket goes alone; what is left is flushed when backward ends")
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
    return (f"Your bucket {first} ({got[first]:,} elements) is where you part from the wire: a bucket is reduced "
            f"only when the next gradient would not fit, and a gradient larger than the bucket goes alone."
            if first < len(got) else "You stop early: what is left in the bucket is reduced when backward ends.")


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


@exercise("fitting_config")
def check_fits(fn, seed: dict, budget: int, world: int = 4, timeout: float = 120) -> bool:
    """``fn()`` -> a ds_config that keeps ``seed``'s batch sizes, precision and optimizer and whose model states
    fit ``budget`` bytes per rank on the device; trained on ``world`` ranks (with the wire recorded) to read
    what each rank holds and what it sends."""
    from course_lib.classroom.checks.wire import launch_checked
    from course_lib.launch import LaunchError, RankError
    from course_lib.deepspeed.engine import preload

    config = _returned_dict(fn, "fitting_config", "a ds_config dict", "fitting_config")
    if config is None:
        return False
    kept = [k for k in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "bf16",
                        "optimizer", "gradient_clipping") if config.get(k) != seed.get(k)]
    if kept:
        print(f"✗ {kept[0]} differs from the seed's ({safe_repr(config.get(kept[0]))} vs "
              f"{safe_repr(seed.get(kept[0]))}): change only zero_optimization, the run must train the same model")
        return False
    paths = write_configs({"yours": config})
    preload()
    try:
        runs = launch_checked(train_on_ranks, world, timeout=timeout, configs=paths, model=MODEL_FLAGS)
    except (RankError, LaunchError) as err:
        line = raised_line(err) if isinstance(err, RankError) else str(err)
        print(f"✗ DeepSpeed did not train it: {line}")
        return False
    except ValueError as err:
        print(f"✗ DeepSpeed refuses it: {err}")
        return False
    held = [r["yours"]["state_bytes"] for r in runs]
    worst = max(range(world), key=lambda r: _device_bytes(held[r]))
    h = held[worst]
    gathered = measured_wire(runs[0]["yours"])["forward_all_gather"]
    print(f"  measured on {world} ranks, rank {worst}: device params {h['params']:,} + grads {h['grads']:,} + "
          f"optimizer {h['optimizer']:,} = {_device_bytes(h):,} B; host {h['params_host'] + h['grads_host'] + h['optimizer_host']:,} B; "
          f"forward all-gathers {gathered:,} elements per micro-batch")
    if _device_bytes(h) > budget:
        part = max(("params", "grads", "optimizer"), key=lambda k: h[k])
        print(f"✗ {_device_bytes(h):,} B on the device > the budget {budget:,} B; the largest part is {part} "
              f"({h[part]:,} B). " + _fit_hint(part, config))
        return False
    if gathered == 0:
        print("✗ it fits, but forward gathers no parameter: every rank holds every parameter whole, so this is not "
              "ZeRO-3's partitioning any more; keep stage 3 with a persistence threshold below the large weights")
        return False
    print(f"✓ {_device_bytes(h):,} B per rank on the device at rest (budget {budget:,}); the price is on the wire: "
          f"{gathered:,} elements all-gathered in every forward, and the host holds the rest")
    return True


def _fit_hint(part: str, config: dict) -> str:
    zero = config.get("zero_optimization") or {}
    if part == "params":
        return ("ZeRO-3 keeps every parameter of <= stage3_param_persistence_threshold elements whole on every rank "
                f"(yours: {safe_repr(zero.get('stage3_param_persistence_threshold', 100000))}); below stage 3 "
                "the whole 16-bit model is on every rank")
    if part == "grads":
        return ("ZeRO-3 reserves a reduce bucket of reduce_bucket_size elements on the device "
                f"(yours: {safe_repr(zero.get('reduce_bucket_size', 500000000))}); without optimizer offload the "
                "gradient partition stays there too")
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
