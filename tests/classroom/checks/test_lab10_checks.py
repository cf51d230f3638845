"""Lab 10's checkers (course_lib.classroom.checks.deepspeed) on real DeepSpeed runs: right answers written
differently from the notebook's pass, wrong ones fail with the hint that names the mistake and no expected value,
a lookup table of the lab's runs (the checkers' old fixed cases) fails on the drawn ones, the stub says "not
attempted yet" without a launch, the course's own functions are refused. Exercises 1 and 2 draw their cases once
per process and DeepSpeed trains them in one launch of 4 ranks that both checkers use; Exercise 3's checker
draws a device budget per run and launches once per check; here one launch of its configs serves every check of
it, and the rule it judges by (``memory.spend_device_budget``) is checked against those real runs."""

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
                               "stage3_param_persistence_threshold": 1e6},
         "steps_per_print": 10, "wall_clock_breakdown": False}
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
    _numels()
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


def wire_strict_threshold(numels, world, persistence_threshold):
    """Off by one: a tensor of exactly the threshold counted as gathered (``<``, not ``<=``)."""
    return wire_by_loop(numels, world, persistence_threshold - 1)


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
                              "reduce_scatter"),
                             (wire_strict_threshold, "are persistent: every rank keeps them whole", "forward_all_gather")):
        ok, out = _verdict(capsys, lambda: lab.check_zero3_wire(wrong))
        assert not ok and hint in out, (wrong.__name__, out)
        failing = _failing(out)   # the student's value and the rule, not the wire's
        assert "is not what the wire shows" in failing, out
        assert not any(f"= {w[key]:,}" in failing for w in wires if w[key]), out
    ok, out = _verdict(capsys, lambda: lab.check_zero3_wire(wire_looked_up))
    assert not ok and "is not what the wire shows" in out and "✓" not in out, out


def test_every_draw_has_a_threshold_and_a_bucket_on_a_boundary(lab):
    """Off-by-one answers (``<`` for ``<=``, ``>=`` for ``>``) differ from the wire only at a boundary: every run's
    cases hold a tensor of exactly the threshold and gradients that fill the bucket exactly."""
    import itertools
    import random

    for seed in range(6):
        cases = lab.drawn_wire_cases(random.Random(seed))
        assert any(c["threshold"] in c["numels"].values() for c in cases), seed
        assert any(c["bucket"] in itertools.accumulate(c["grad_numels"][:-1]) for c in cases), seed
        for c in cases:
            assert min(c["numels"].values()) <= c["threshold"] < max(c["numels"].values()), (seed, c["threshold"])
            assert min(c["grad_numels"]) <= c["bucket"] <= sum(c["grad_numels"]), (seed, c["bucket"])


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


def buckets_reduced_when_full(grad_numels, reduce_bucket_size):
    """Off by one: the bucket reduced before a gradient that would fill it exactly (``>=``, not ``>``)."""
    out, held = [], 0
    for n in grad_numels:
        if held and held + n >= reduce_bucket_size:
            out.append(held)
            held = 0
        held += n
    return out + [held]


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
    ok, out = _verdict(capsys, lambda: lab.check_reduce_buckets(buckets_reduced_when_full))
    assert not ok and "that gradient still fits" in out, out
    ok, out = _verdict(capsys, lambda: lab.check_reduce_buckets(lambda g, s: list(g)[:-1]))
    assert not ok and "every gradient is reduced exactly once" in out, out
    ok, out = _verdict(capsys, lambda: lab.check_reduce_buckets(buckets_looked_up))
    assert not ok and "not the wire's reduce-scatters" in out and "✓" not in out, out
    ok, out = _verdict(capsys, lambda: lab.check_reduce_buckets(stub))
    assert not ok and "not attempted yet: write reduce_buckets" in out


# ------------------------------------------------------------------ exercise 3 and the review questions


FIXED = copy.deepcopy(SEED4)          # the lab's old answer for its old fixed budget of 4,000 B
FIXED["zero_optimization"].update(stage3_param_persistence_threshold=100, reduce_bucket_size=1000)


_NUMELS: list = []


def _numels() -> list:
    """The lab GPT's parameter sizes, computed once outside any checked call (a student's function that called
    the checker's ``lab_numels`` would be refused)."""
    if not _NUMELS:
        from course_lib.classroom.checks.deepspeed import lab_numels

        _NUMELS.extend(lab_numels())
    return list(_NUMELS)


def fits_as_the_notebook(budget):
    """The notebook's solution, as written there."""
    numels = dict(enumerate(_numels()))
    config = json.loads(json.dumps(SEED4))
    largest = max(numels.values())
    whole, threshold = 0, 0
    for size in sorted(set(numels.values()))[:-1]:
        kept = sum(n for n in numels.values() if n <= size)
        if 2 * (kept + largest) > budget:
            break
        whole, threshold = kept, size
    config["zero_optimization"].update(stage3_param_persistence_threshold=threshold,
                                       reduce_bucket_size=budget // 2 - whole)
    return config


def fits_another_way(budget):
    """Right, written another way: tensor by tensor, a threshold just below the first size left out, a float bucket
    rounded down to 20 elements, other prefetch and contiguous_gradients said out loud."""
    sizes = sorted(_numels())
    room, whole, i = budget // 2 - sizes[-1], 0, 0      # elements left beside a bucket of the largest gradient
    while i < len(sizes) and sizes[i] < sizes[-1]:
        group = [n for n in sizes if n == sizes[i]]
        if whole + sum(group) > room:
            break
        whole, i = whole + sum(group), i + len(group)
    config = copy.deepcopy(SEED4)
    config["zero_optimization"].update(stage3_param_persistence_threshold=sizes[i] - 1, contiguous_gradients=True,
                                       reduce_bucket_size=float(max(sizes[-1], (budget // 2 - whole) // 20 * 20)),
                                       stage3_prefetch_bucket_size=777)
    return config


def _classes_of(budget, test_budget):
    """The notebook's answer for ``budget`` with the size classes it keeps whole for ``test_budget``."""
    config = fits_as_the_notebook(test_budget)
    zero = config["zero_optimization"]
    whole = sum(n for n in _numels() if n <= zero["stage3_param_persistence_threshold"])
    zero["reduce_bucket_size"] = budget // 2 - whole
    return config


def fits_strictly(budget):
    """Off by one: a size class kept whole only when it leaves room to spare (``<`` for ``<=``)."""
    return _classes_of(budget, budget - 1)


def fits_rounding_up(budget):
    """Off by one: the room counted in elements rounded up (a class one byte over the budget still kept)."""
    return _classes_of(budget, budget + budget % 2)


@pytest.fixture(scope="module")
def fit_cases(lab):
    """Budgets of four different size classes, the first three in increasing order (drawn as the checker draws
    them); the configs of the notebook's answer for the first three and of another right answer for the fourth; and
    DeepSpeed's runs of the four in ONE launch of 4 ranks -- the launch ``check_fits`` makes, with more configs --
    which serves the checks below (:func:`_serve`)."""
    from course_lib.classroom.checks.wire import launch_checked
    from course_lib.deepspeed.engine import preload

    rng, numels = lab.drawn_rng(), _numels()
    levels = rng.sample(range(len(set(numels)) - 1), 4)
    budgets = [lab.drawn_fit_budget(rng, numels, level=k) for k in sorted(levels[:3]) + levels[3:]]
    configs = {f"notebook{i}": fits_as_the_notebook(b) for i, b in enumerate(budgets[:3])}
    configs["another"] = fits_another_way(budgets[3])
    preload()
    runs = launch_checked(lab.train_on_ranks, 4, timeout=240, configs=lab.write_configs(configs),
                          model=lab.MODEL_FLAGS)
    return {"budgets": budgets, "configs": configs, "runs": runs}


def _serve(monkeypatch, lab, fit_cases, budget) -> list:
    """``check_fits`` draws ``budget``, and its launch is answered from ``fit_cases``'s runs (the config it wrote
    must be one of them); returns the list of the configs it launched."""
    from course_lib.classroom.checks import wire

    launched = []

    def launch(fn, world, *, configs, **kwargs):
        assert fn is lab.train_on_ranks and world == 4 and kwargs["model"] == lab.MODEL_FLAGS
        with open(configs["yours"]) as f:
            mine = json.load(f)
        names = [n for n, c in fit_cases["configs"].items() if json.loads(json.dumps(c)) == mine]
        assert names, mine
        launched.append(names[0])
        return [{"yours": r[names[0]]} for r in fit_cases["runs"]]

    monkeypatch.setattr(wire, "launch_checked", launch)
    monkeypatch.setattr(lab, "_fit_budget", lambda: budget)
    return launched


def _predicted(numels, config) -> tuple[dict, int]:
    """What a rank holds (as ``held_bytes``) and forward gathers under ``config``, by DeepSpeed's rules
    (``memory.zero3_device_at_rest``; the test below checks them against the real runs)."""
    zero = config["zero_optimization"]
    whole = sum(n for n in numels if n <= zero["stage3_param_persistence_threshold"])
    return ({"params": 2 * whole, "grads": 2 * int(zero["reduce_bucket_size"]), "optimizer": 0,
             "params_host": 2 * sum(numels) // 4, "grads_host": 6 * sum(numels) // 4,
             "optimizer_host": 12 * sum(numels) // 4}, sum(numels) - whole)


def test_the_budget_is_drawn_so_that_every_budget_has_its_own_answer(lab):
    """No launch: each size class's budgets are spent by ``spend_device_budget`` as the rule says, every drawn budget
    has a right answer, and one config (the lab's old answer, or the right one for another budget) is refused for
    nearly every budget drawn."""
    from course_lib.deepspeed import memory
    from course_lib.rules import UsageError

    numels, rng = _numels(), lab.drawn_rng()
    largest, sizes = max(numels), sorted(set(numels))
    levels = [0] + [sum(n for n in numels if n <= s) for s in sizes[:-1]]
    lows = [lab.drawn_fit_budget(_Ends(low=True), numels, level=k) for k in range(len(levels))]
    highs = [lab.drawn_fit_budget(_Ends(low=False), numels, level=k) for k in range(len(levels))]
    assert (lows[0], highs[-1]) == (24_576, 101_119)            # the notebook's words: 24,576 B to about 100 KB
    for k, (low, high) in enumerate(zip(lows, highs)):
        for budget in (low, high):
            plan = memory.spend_device_budget(numels, budget)
            assert plan.persistent == levels[k] and plan.bucket >= largest and budget - 1 <= plan.device <= budget
            assert memory.zero3_device_at_rest(numels, plan.threshold, plan.bucket) == plan.device
            assert fits_as_the_notebook(budget)["zero_optimization"]["reduce_bucket_size"] == plan.bucket
            if k + 1 < len(levels):   # one size class more, beside a bucket of the largest gradient, does not fit
                over = {"zero_optimization": {"stage3_param_persistence_threshold": sizes[k],
                                              "reduce_bucket_size": largest}}
                assert memory.zero3_device_at_rest(numels, sizes[k], largest) > budget
                assert "on the device > the budget" in lab.fit_problem(*_predicted(numels, over), budget, numels, over)
    copied = fits_as_the_notebook(lab.drawn_fit_budget(rng, numels))
    passed = {"fixed": 0, "copied": 0}
    for _ in range(200):
        budget = lab.drawn_fit_budget(rng, numels)
        assert lab.fit_problem(*_predicted(numels, fits_as_the_notebook(budget)), budget, numels, {}) is None
        assert lab.fit_problem(*_predicted(numels, fits_another_way(budget)), budget, numels, {}) is None
        forgetful = fits_as_the_notebook(budget)     # its bucket forgets the tensors kept whole: never right
        forgetful["zero_optimization"]["reduce_bucket_size"] = budget // 2
        problem = lab.fit_problem(*_predicted(numels, forgetful), budget, numels, forgetful)
        assert problem is not None and "shares the budget with the tensors kept whole" in problem, (budget, problem)
        for name, config in (("fixed", FIXED), ("copied", copied)):
            passed[name] += lab.fit_problem(*_predicted(numels, config), budget, numels, config) is None
    assert passed["fixed"] == 0 and passed["copied"] <= 16, passed   # a copied config: at most ~2.3 % of the draws
    with pytest.raises(UsageError, match="cannot hold a reduce bucket of the largest gradient"):
        memory.spend_device_budget(numels, 2 * largest - 1)
    held, gathered = _predicted(numels, FIXED)
    assert "fewer than the largest gradient (12,288)" in lab.fit_problem(held, gathered, 50_000, numels, FIXED)
    assert "keep the seed's offload_optimizer" in lab.fit_problem(dict(held, optimizer=8), gathered, 50_000, numels, {})
    assert "keep the seed's offload_param" in lab.fit_problem(dict(held, params_host=0), gathered, 50_000, numels, {})
    assert "not ZeRO-3" in lab.fit_problem(held, 0, 50_000, numels, {})
    assert "keep contiguous_gradients on" in lab.fit_problem(
        dict(held, grads=0), gathered, 50_000, numels, {"zero_optimization": {"contiguous_gradients": False}})


class _Ends:
    """A stand-in for the checker's random draw: the least or the largest budget of a size class."""

    def __init__(self, low: bool):
        self.low = low

    def randint(self, a, b):
        return a if self.low else b


def test_fits_on_ranks(capsys, lab, fit_cases, monkeypatch):
    from course_lib.deepspeed.memory import spend_device_budget, zero3_device_at_rest

    numels, budgets, runs = _numels(), fit_cases["budgets"], fit_cases["runs"]
    for name, config in fit_cases["configs"].items():     # DeepSpeed's rules, as the checker counts them, on real runs
        zero = config["zero_optimization"]
        want = zero3_device_at_rest(numels, zero["stage3_param_persistence_threshold"], zero["reduce_bucket_size"])
        for r in runs:
            assert r[name]["state_bytes"]["params"] + r[name]["state_bytes"]["grads"] == want, name
            assert r[name]["state_bytes"]["optimizer"] == 0, name

    for i in range(3):     # the solution, for budgets of three different size classes
        launched = _serve(monkeypatch, lab, fit_cases, budgets[i])
        ok, out = _verdict(capsys, lambda: lab.check_fits(fits_as_the_notebook))
        assert ok and launched == [f"notebook{i}"], out
        assert out.startswith("✓ DeepSpeed trained your config on 4 ranks within the device budget drawn for this "
                              "run") and re.findall(r"\d[\d,]*", out) == ["4", "0", "25"], out   # no drawn value (nbval)
    _serve(monkeypatch, lab, fit_cases, budgets[3])
    ok, out = _verdict(capsys, lambda: lab.check_fits(fits_another_way))
    assert ok, out

    # a config that was right for a classmate's budget (another size class), copied: one larger does not fit, one
    # smaller leaves out tensors that fit
    for mine, theirs, hint in ((0, 2, "on the device > the budget"), (2, 0, "the budget has room for more")):
        plan = spend_device_budget(numels, budgets[mine])
        launched = _serve(monkeypatch, lab, fit_cases, budgets[mine])
        ok, out = _verdict(capsys, lambda: lab.check_fits(lambda budget: fits_as_the_notebook(budgets[theirs])))
        assert not ok and launched == [f"notebook{theirs}"] and hint in out and "✓" not in out, out
        assert f"fitting_config({budgets[mine]:,})" in out and "measured on 4 ranks" in out, out
        assert f"{plan.bucket:,}" not in _failing(out), out            # the right bucket is never shown

    launched = _serve(monkeypatch, lab, fit_cases, budgets[0])
    for answer, said in ((lambda budget: dict(copy.deepcopy(SEED4), train_micro_batch_size_per_gpu=1,
                                              gradient_accumulation_steps=2),
                          "gradient_accumulation_steps differs from the seed's (2 vs 1)"),
                         (stub, "not attempted yet: write fitting_config"),
                         (lambda budget: dict(copy.deepcopy(SEED4), communication_data_type="fp32"),
                          "communication_data_type differs from the seed's ('fp32' vs '(none)')"),
                         (lambda budget: dict(copy.deepcopy(SEED4), steps_per_print=range(3)),
                          "is not JSON"),
                         (lambda: FIXED, "fitting_config(" + f"{budgets[0]:,}" + ") raised TypeError"),
                         (lambda budget: [FIXED], "return a ds_config dict")):
        ok, out = _verdict(capsys, lambda: lab.check_fits(answer))
        assert not ok and said in out, out
    assert launched == []                                              # none of them cost a launch


def test_fits_off_by_one_at_a_boundary_fails(capsys, lab, fit_cases, monkeypatch):
    """Answers off by one where a size class fills the budget exactly (or misses it by a byte) give the drawn
    budget's config (so its launch passes) and fail at this run's budgets on the boundaries, judged by the rule."""
    numels, budgets = _numels(), fit_cases["budgets"]
    edges = {b for k in range(1, len(set(numels))) for b in lab.fit_edges(numels, k)}
    i = next(i for i in range(3) if budgets[i] not in edges)    # a drawn budget off the boundaries (nearly always)
    for answer, said in ((fits_strictly, "the budget has room for more"),
                         (fits_rounding_up, "fewer than the largest gradient")):
        launched = _serve(monkeypatch, lab, fit_cases, budgets[i])
        ok, out = _verdict(capsys, lambda: lab.check_fits(answer))
        assert not ok and launched == [f"notebook{i}"] and said in out and "✓" not in out, (answer.__name__, out)
        assert "a size that fills the budget exactly still fits" in out, out


def test_every_run_judges_a_budget_on_each_boundary(lab):
    """No launch: every draw of 6 seeds has a budget where a size class fills it exactly and one a byte short of a
    class; there each off-by-one answer differs from the rule and fails by it, and the right answers pass."""
    import random

    numels = _numels()
    measured = {"params": 0, "grads": 0, "optimizer": 0, "params_host": 1, "grads_host": 1, "optimizer_host": 1}
    for seed in range(6):
        low, high = lab.fit_edge_budgets(random.Random(seed), numels)
        for right in (fits_as_the_notebook, fits_another_way):
            assert lab.edge_problem(right, low, numels, measured) is None, (seed, low)
            assert lab.edge_problem(right, high, numels, measured) is None, (seed, high)
        assert fits_strictly(low) != fits_as_the_notebook(low), (seed, low)
        assert "room for more" in lab.edge_problem(fits_strictly, low, numels, measured), (seed, low)
        assert fits_rounding_up(high) != fits_as_the_notebook(high), (seed, high)
        assert "fewer than the largest gradient" in lab.edge_problem(fits_rounding_up, high, numels, measured)


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
