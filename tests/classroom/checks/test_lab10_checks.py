"""Lab 10's checkers (course_lib.classroom.checks.deepspeed) on a real DeepSpeed run: right answers written
differently from the notebook's pass, wrong ones fail with the hint that names the mistake, the stub says
"not attempted yet", the course's own functions are refused. One launch of 4 ranks records the wire of the
lab's two configs; Exercise 3's checker launches its own (a config that does not fit, and one that does)."""

from __future__ import annotations

import copy
import json

import pytest

from course_lib.deepspeed import schema as ds_schema

pytestmark = pytest.mark.skipif(not ds_schema.deepspeed_installed(), reason="DeepSpeed 0.19.8 is not installed")

SEED4 = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
         "bf16": {"enabled": True}, "gradient_clipping": 1.0,
         "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
         "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
                               "overlap_comm": True, "reduce_bucket_size": 5e8, "stage3_prefetch_bucket_size": 5e7,
                               "stage3_param_persistence_threshold": 1e6}}
THRESHOLDS = {"seed": 10 ** 6, "small": 100}
BUCKETS = {"seed": 500_000_000, "small": 3000}


@pytest.fixture(scope="module")
def lab():
    from course_lib.classroom.checks import deepspeed

    return deepspeed


@pytest.fixture(scope="module")
def model(lab):
    from course_lib.model import GPTModel
    from course_lib.train import parse_args, validate_args

    return GPTModel(validate_args(parse_args(lab.MODEL_FLAGS), 4, check_memory=False).model)


@pytest.fixture(scope="module")
def runs(lab):
    from course_lib.classroom.checks.wire import launch_checked
    from course_lib.deepspeed.engine import preload

    small = copy.deepcopy(SEED4)
    small["zero_optimization"].update(reduce_bucket_size=3000, stage3_prefetch_bucket_size=2000,
                                      stage3_param_persistence_threshold=100)
    preload()
    return launch_checked(lab.train_on_ranks, 4, timeout=240, configs=lab.write_configs({"seed": SEED4, "small": small}),
                          model=lab.MODEL_FLAGS)


def _verdict(capsys, fn) -> tuple[bool, str]:
    ok = fn()
    return ok, capsys.readouterr().out


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


def test_zero3_wire_right_wrong_stub_and_course_code(capsys, lab, runs, model):
    numels = {n: p.numel() for n, p in model.named_parameters()}
    ok, out = _verdict(capsys, lambda: lab.check_zero3_wire(wire_by_loop, runs, numels, THRESHOLDS))
    assert ok and "run small: forward_all_gather 37,632, backward_all_gather 0, reduce_scatter 38,272, " \
                  "step_all_gather 640" in out and "run seed: forward_all_gather 0" in out
    for wrong, hint in ((wire_counts_persistent, "are persistent: every rank keeps them whole"),
                        (wire_regathers_in_backward, "stage3_max_reuse_distance (1e9) spans the whole model"),
                        (wire_skips_persistent_grads, "Every gradient is reduced, the persistent parameters' too")):
        ok, out = _verdict(capsys, lambda: lab.check_zero3_wire(wrong, runs, numels, THRESHOLDS))
        assert not ok and hint in out, (wrong.__name__, out)
        failing = out.split("✗", 1)[1]  # the failing line shows the student's value and the rule, not the wire's
        assert "is not what the wire shows" in failing and not any(f"{n:,}" in failing for n in (37632, 38272, 640)), out
    ok, out = _verdict(capsys, lambda: lab.check_zero3_wire(stub, runs, numels, THRESHOLDS))
    assert not ok and "not attempted yet: write zero3_wire" in out
    ok, out = _verdict(capsys, lambda: lab.check_zero3_wire(lab.measured_wire, runs, numels, THRESHOLDS))
    assert not ok and "course" in out.lower()


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


def test_reduce_buckets_right_wrong_stub(capsys, lab, runs, model):
    tied = model.embedding.word_embeddings.weight
    modules = [m for m in model.modules() if list(m.parameters(recurse=False))]
    order = [p.numel() for m in reversed(modules) for p in m.parameters(recurse=False) if p is not tied] + [tied.numel()]
    ok, out = _verdict(capsys, lambda: lab.check_reduce_buckets(buckets_by_index, runs, order, BUCKETS))
    assert ok and "reduce_bucket_size 3,000 -> 14 reduce-scatter(s)" in out and "1 reduce-scatter(s) of [38272]" in out
    ok, out = _verdict(capsys, lambda: lab.check_reduce_buckets(buckets_flush_after, runs, order, BUCKETS))
    assert not ok and "the bucket is reduced *before* a gradient that would make it exceed the size" in out, out
    assert "[64, 4096, 32" not in out  # the wire's buckets (the answer) are not printed
    ok, out = _verdict(capsys, lambda: lab.check_reduce_buckets(lambda g, s: list(g)[:-1], runs, order, BUCKETS))
    assert not ok and "every gradient is reduced exactly once" in out and "38,272" in out, out
    ok, out = _verdict(capsys, lambda: lab.check_reduce_buckets(stub, runs, order, BUCKETS))
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
    text = "The seed kept every tensor whole: 76,544 B of parameters on each rank and no gather at all."
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


def test_a_wrapped_registered_reference_is_refused(capsys, lab, runs):
    from course_lib.distributed.buffer import size_buckets

    def via_course_buckets(grad_numels, reduce_bucket_size):
        return [b.numel for b in size_buckets([(str(i), n) for i, n in enumerate(grad_numels)], reduce_bucket_size, 1)]

    ok, out = _verdict(capsys, lambda: lab.check_reduce_buckets(via_course_buckets, runs, [64, 32], BUCKETS))
    assert not ok and "the course's own" in out and "size_buckets" in out and "✓" not in out, out
