"""Lab 10's checkers (course_lib.classroom.checks.deepspeed) on real DeepSpeed runs: right answers written
differently from the notebook's pass, wrong ones fail with the hint that names the mistake and no expected value,
a lookup table of the lab's runs (the checkers' old fixed cases) fails on the drawn ones, the stub says "not
attempted yet" without a launch, the course's own functions are refused. Exercises 1 and 2 draw their cases once
per process and DeepSpeed trains them in one launch of 4 ranks that both checkers use; Exercise 3's checker
launches its own (a config that does not fit, and one that does)."""

from __future__ import annotations

import copy
import json
import re

import pytest

from course_lib.deepspeed import schema as ds_schema

pytestmark = pytest.mark.skipif(not ds_schema.deepspeed_installed(), reason="DeepSpeed 0.19.8 is not installed")

SEED4 = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
         "bf16": {"enabled": True}, "gradient_clipping": 1.0,
         "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
         "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
                               "overlap_comm": True, "reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7,
                               "stage3_param_persistence_threshold": 1e6}}
# the lab's two runs (thresholds 1e6 and 100, buckets 5e8 and 3000): the checkers' fixed cases until they drew theirs
OLD_WIRE = {10 ** 6: {"forward_all_gather": 0, "backward_all_gather": 0, "reduce_scatter": 38272,
                      "step_all_gather": 38272},
            100: {"forward_all_gather": 37632, "backward_all_gather": 0, "reduce_scatter": 38272, "step_all_gather": 640}}
OLD_BUCKETS = {500_000_000: [38272],
               3000: [64, 4096, 32, 4096, 1248, 3072, 160, 4096, 32, 4096, 1248, 3072, 672, 12288]}


@pytest.fixture(scope="module")
def lab():
    from course_lib.classroom.checks import deepspeed

    deepspeed._DRAWN.clear()           # this module's cases are drawn afresh
    return deepspeed


@pytest.fixture(scope="module")
def runs(lab):
    """The drawn cases' runs: the one launch both checkers use (``lab.drawn_wire_runs``)."""
    return lab.drawn_wire_runs()


def _verdict(capsys, fn) -> tuple[bool, str]:
    ok = fn()
    return ok, capsys.readouterr().out


def _failing(out: str) -> str:
    return out.split("✗", 1)[1]


# ------------------------------------------------------------------ exercise 1


def wire_by_loop(numels, world, persistence_threshold):
    """Right, written another way."""
    out = dict.fromkeys(("forward_all_gather", "backward_all_gather", "reduce_scatter", "step_all_gather"), 0)
    for n in numels.values():
        out["reduce_scatter"] += n
        out["step_all_gather" if n <= persistence_threshold else "forward_all_gather"] += n
    return out


def wire_counts_persistent(numels, world, persistence_threshold):
    total = sum(numels.values())
    return {"forward_all_gather": total, "backward_all_gather": 0, "reduce_scatter": total, "step_all_gather": 0}


def wire_regathers_in_backward(numels, world, persistence_threshold):
    out = wire_by_loop(numels, world, persistence_threshold)
    return dict(out, backward_all_gather=out["forward_all_gather"])


def wire_skips_persistent_grads(numels, world, persistence_threshold):
    out = wire_by_loop(numels, world, persistence_threshold)
    return dict(out, reduce_scatter=out["forward_all_gather"])


def stub(*args):
    raise NotImplementedError("write it")


def wire_looked_up(numels, world, persistence_threshold):
    """The lab's runs as a table, and the seed's row for any other threshold."""
    return dict(OLD_WIRE.get(persistence_threshold, OLD_WIRE[10 ** 6]))


def test_zero3_wire_stub_and_course_code_cost_no_launch(capsys, lab):
    launched = lab._DRAWN.pop("runs", None)
    ok, out = _verdict(capsys, lambda: lab.check_zero3_wire(stub))
    assert not ok and "not attempted yet: write zero3_wire" in out
    ok, out = _verdict(capsys, lambda: lab.check_zero3_wire(lab.measured_wire))
    assert not ok and "course" in out.lower()
    ok, out = _verdict(capsys, lambda: lab.check_zero3_wire(lambda numels, world, t: [1, 2]))
    assert not ok and "return a dict with the keys" in out
    assert "runs" not in lab._DRAWN
    if launched is not None:
        lab._DRAWN["runs"] = launched


def test_zero3_wire_right_wrong_lookup(capsys, lab, runs):
    ok, out = _verdict(capsys, lambda: lab.check_zero3_wire(wire_by_loop))
    assert ok and out.startswith("✓ ZeRO-3's traffic predicted on 3 models and persistence thresholds drawn for this "
                                 "run, each as DeepSpeed's wire on 4 ranks"), out
    assert re.findall(r"\d[\d,]*", out) == ["3", "3", "4"], out   # ZeRO-3, 3 models, 4 ranks: no drawn value
    wires = [lab.measured_wire(runs[0][f"case{i}"]) for i in range(lab.DRAWN_CASES)]
    for wrong, hint, key in ((wire_counts_persistent, "are persistent: every rank keeps them whole", "forward_all_gather"),
                             (wire_regathers_in_backward, "stage3_max_reuse_distance (1e9) spans the whole model",
                              "backward_all_gather"),
                             (wire_skips_persistent_grads, "Every gradient is reduced, the persistent parameters' too",
                              "reduce_scatter")):
        ok, out = _verdict(capsys, lambda: lab.check_zero3_wire(wrong))
        assert not ok and hint in out, (wrong.__name__, out)
        failing = _failing(out)   # the student's value and the rule, not the wire's
        assert "is not what the wire shows" in failing, out
        assert not any(f"= {w[key]:,}" in failing for w in wires if w[key]), out
    ok, out = _verdict(capsys, lambda: lab.check_zero3_wire(wire_looked_up))
    assert not ok and "is not what the wire shows" in out and "✓" not in out, out


# ------------------------------------------------------------------ exercise 2


def buckets_by_index(grad_numels, reduce_bucket_size):
    """Right, written another way: cut points."""
    cuts, total = [0], 0
    for i, n in enumerate(grad_numels):
        if total and total + n > reduce_bucket_size:
            cuts.append(i)
            total = 0
        total += n
    cuts.append(len(grad_numels))
    return [sum(grad_numels[a:b]) for a, b in zip(cuts, cuts[1:])]


def buckets_flush_after(grad_numels, reduce_bucket_size):
    out, held = [], 0
    for n in grad_numels:
        held += n
        if held >= reduce_bucket_size:
            out.append(held)
            held = 0
    return out + ([held] if held else [])


def buckets_looked_up(grad_numels, reduce_bucket_size):
    return list(OLD_BUCKETS.get(reduce_bucket_size, OLD_BUCKETS[500_000_000]))


def test_reduce_buckets_right_wrong_lookup_stub(capsys, lab, runs):
    ok, out = _verdict(capsys, lambda: lab.check_reduce_buckets(buckets_by_index))
    assert ok and out.startswith("✓ DeepSpeed's buckets, on 3 models and bucket sizes drawn for this run"), out
    assert re.findall(r"\d[\d,]*", out) == ["3"], out              # 3 models: no drawn value (nbval)
    ok, out = _verdict(capsys, lambda: lab.check_reduce_buckets(buckets_flush_after))
    assert not ok and ("the bucket is reduced *before* a gradient that would make it exceed the size" in out
                       or "a bucket is reduced only when the next gradient would not fit" in out), out
    wanted = [lab.measured_buckets(runs[0][f"case{i}"]) for i in range(lab.DRAWN_CASES)]
    assert not any(str(w)[:-1] in _failing(out) for w in wanted), out    # the wire's buckets (the answer) are not shown
    ok, out = _verdict(capsys, lambda: lab.check_reduce_buckets(lambda g, s: list(g)[:-1]))
    assert not ok and "every gradient is reduced exactly once" in out, out
    ok, out = _verdict(capsys, lambda: lab.check_reduce_buckets(buckets_looked_up))
    assert not ok and "not the wire's reduce-scatters" in out and "✓" not in out, out
    ok, out = _verdict(capsys, lambda: lab.check_reduce_buckets(stub))
    assert not ok and "not attempted yet: write reduce_buckets" in out


# ------------------------------------------------------------------ exercise 3 and the review questions


def test_fits_reads_the_ranks(capsys, lab):
    def unchanged():
        return copy.deepcopy(SEED4)

    def fits():          # right, and not the notebook's numbers
        config = copy.deepcopy(SEED4)
        config["zero_optimization"].update(stage3_param_persistence_threshold=0, reduce_bucket_size=1000)
        return config

    def other_batch():
        return dict(copy.deepcopy(SEED4), train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=2)

    ok, out = _verdict(capsys, lambda: lab.check_fits(unchanged, SEED4, budget=20_000))
    assert not ok and "the largest part is grads (1,000,000,000 B)" in out and "reduce_bucket_size" in out
    ok, out = _verdict(capsys, lambda: lab.check_fits(fits, SEED4, budget=20_000))
    assert ok and "2,000 B per rank on the device" in out and "38,272 elements all-gathered in every forward" in out
    ok, out = _verdict(capsys, lambda: lab.check_fits(other_batch, SEED4, budget=20_000))
    assert not ok and "train_micro_batch_size_per_gpu differs from the seed's" in out
    ok, out = _verdict(capsys, lambda: lab.check_fits(stub, SEED4, budget=20_000))
    assert not ok and "not attempted yet: write fitting_config" in out


def test_answers_must_be_written_and_cite_a_measurement(capsys, lab, runs):
    held = runs[0]["case0"]["state_bytes"]["params_host"]
    text = f"The seed kept every tensor whole: {held:,} B of parameters on the host of each rank, no gather at all."
    good = dict.fromkeys(lab.QUESTIONS, text)
    ok, out = _verdict(capsys, lambda: lab.check_answers(lambda: good, runs))
    assert ok, out
    ok, out = _verdict(capsys, lambda: lab.check_answers(lambda: dict(good, buckets="Buckets change things on the "
                                                                           "wire and on the device, a lot."), runs))
    assert not ok and "answer 'buckets' cites no number" in out
    ok, out = _verdict(capsys, lambda: lab.check_answers(lambda: dict(good, offload="short"), runs))
    assert not ok and "answer 'offload'" in out
    ok, out = _verdict(capsys, lambda: lab.check_answers(stub, runs))
    assert not ok and "not attempted yet: write my_answers" in out
    assert json.loads(json.dumps(good)) == good


def test_a_wrapped_registered_reference_is_refused(capsys, lab):
    from course_lib.distributed.buffer import size_buckets

    def via_course_buckets(grad_numels, reduce_bucket_size):
        return [b.numel for b in size_buckets([(str(i), n) for i, n in enumerate(grad_numels)], reduce_bucket_size, 1)]

    ok, out = _verdict(capsys, lambda: lab.check_reduce_buckets(via_course_buckets))
    assert not ok and "the course's own" in out and "size_buckets" in out and "✓" not in out, out


def test_the_kept_runs_serve_only_their_own_world(lab, monkeypatch):
    """The judge keeps the latest launch of the drawn cases (``keep_for_the_run``); a request the kernel writes
    names its own ``world``, so runs launched on another world (a forged request's) are never the truth of a
    check on 4 ranks: it launches its own, once, and that is what the judge keeps next."""
    from course_lib.classroom.checks import wire
    from course_lib.deepspeed import engine

    launched = []
    monkeypatch.setattr(wire, "launch_checked", lambda fn, world, **kwargs: launched.append(world) or [world] * world)
    monkeypatch.setattr(engine, "preload", lambda: None)
    saved = dict(lab._DRAWN)
    try:
        lab._DRAWN.clear()
        lab.keep_for_the_run({"cases": [], "runs": ["forged on 1 rank"], "world": 1})
        assert lab.drawn_wire_runs(4) == [4, 4, 4, 4] and launched == [4]
        assert lab.drawn_wire_runs(4) == [4, 4, 4, 4] and launched == [4]   # kept: no second launch
        assert lab.kept_for_the_run() == {"cases": [], "runs": [4, 4, 4, 4], "world": 4}
    finally:
        lab._DRAWN.clear()
        lab._DRAWN.update(saved)
