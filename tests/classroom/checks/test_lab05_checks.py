"""Lab 05's checkers: a table of wrong answers per exercise -- right-numbers-wrong-algorithm ones included --
each with its specific hint; right answers written differently (numpy, Fraction, float) accepted; stubs are
"not attempted"; the course's own code is recognised; the conclusions are the student's (a light check)."""

from fractions import Fraction

import numpy as np
import pytest
import torch
import torch.distributed as dist

from course_lib import sizing
from course_lib.classroom.checks import (conclusions, distributed_optimizer, gpu_projection, pipeline_bubbles,
                                         rank_grid, training_logs)
from course_lib.topology.seed import SEED_SWEEP
from course_lib.training.logs import parse_log
from course_lib.topology import ParallelConfig


def _todo(*args):
    raise NotImplementedError


# ---------------------------------------------------------------- exercise 1: DP and micro-batches

def layout(world, tp, pp, cp, micro, gbs):
    if world % (tp * pp * cp):
        raise ValueError("world_size % (tp*pp*cp) != 0")
    dp = world // (tp * pp * cp)
    if gbs % (micro * dp):
        raise ValueError("global % (micro*dp) != 0")
    return dp, gbs // (micro * dp)


def layout_no_cp(world, tp, pp, cp, micro, gbs):
    dp = world // (tp * pp)
    return dp, gbs // (micro * dp)


def layout_no_dp(world, tp, pp, cp, micro, gbs):
    return world // (tp * pp * cp), gbs // micro


def layout_floats(world, tp, pp, cp, micro, gbs):
    dp, m = layout(world, tp, pp, cp, micro, gbs)
    return float(dp), float(m)


def layout_never_raises(world, tp, pp, cp, micro, gbs):
    dp = max(1, world // (tp * pp * cp))
    return dp, gbs // (micro * dp)


def layout_numpy(world, tp, pp, cp, micro, gbs):
    dp, m = layout(world, tp, pp, cp, micro, gbs)
    return np.array([dp, m])


def layout_fractions(world, tp, pp, cp, micro, gbs):
    dp, m = layout(world, tp, pp, cp, micro, gbs)
    return Fraction(dp), torch.tensor(m)


def layout_true_division(world, tp, pp, cp, micro, gbs):    # 8 / 3 is not a number of replicas
    dp = world / (tp * pp * cp)
    if dp != int(dp) or gbs % (micro * dp):
        raise ValueError("no")
    return dp, gbs / (micro * dp)


def layout_course(world, tp, pp, cp, micro, gbs):
    cfg = ParallelConfig(world_size=world, tp=tp, pp=pp, cp=cp, micro_batch_size=micro, global_batch_size=gbs)
    return cfg.dp, cfg.num_microbatches


@pytest.mark.parametrize("fn, ok, text", [
    (layout, True, "✓ derive_layout"),
    (layout_floats, True, "✓ derive_layout"),
    (layout_numpy, True, "✓ derive_layout"),
    (layout_fractions, True, "✓ derive_layout"),
    (layout_true_division, True, "✓ derive_layout"),
    (layout_no_cp, False, "CP ranks are not data-parallel replicas"),
    (layout_no_dp, False, "m = global / (micro * DP)"),
    (lambda *a: (float("nan"), 2), False, "NaN"),
    (lambda *a: "2, 8", False, "return a pair (dp, num_microbatches)"),
    (lambda *a: (Weird(), Weird()), False, "return two numbers"),
    (layout_never_raises, False, "Megatron refuses it: raise ValueError"),
    (layout_course, False, "the course's own course_lib.topology.ParallelConfig"),
    (_todo, False, "not attempted yet: write derive_layout"),
])
def test_check_layout(fn, ok, text, capsys):
    assert rank_grid.check_layout(fn).ok is ok
    assert text in capsys.readouterr().out


def test_layout_cases_agree_with_the_seed():
    # the seed's own arithmetic: TP2 PP2 -> DP2; TP4 PP2 -> DP1; TP2 PP2 CP2 -> DP1 (8 GPUs)
    assert rank_grid._want(8, 2, 2, 1, 1, 16)[0] == 2 and rank_grid._want(8, 4, 2, 1, 1, 16)[0] == 1
    assert rank_grid._want(8, 2, 2, 2, 1, 16) == (1, 16)
    assert [rank_grid._want(8, *SEED_SWEEP[n], 4, 64)[1] for n in "ABCDEF"] == [2, 4, 8, 8, 8, 16]


# ---------------------------------------------------------------- exercise 2: the largest bubble

def _bubble_table(configs, world, micro, gbs, share=False):
    out = {}
    for n, (tp, pp, cp) in configs.items():
        m = gbs // (micro * (world // (tp * pp * cp)))
        out[n] = (pp - 1) / (m + pp - 1 if share else m)
    return out


def largest(configs, world, micro, gbs):
    b = _bubble_table(configs, world, micro, gbs)
    return max(b, key=b.get)


def largest_share(configs, world, micro, gbs):        # (p-1)/(m+p-1) ranks configs the same way
    b = _bubble_table(configs, world, micro, gbs, share=True)
    return max(b, key=b.get)


def deepest(configs, world, micro, gbs):
    return max(configs, key=lambda n: configs[n][1])


def smallest(configs, world, micro, gbs):
    b = _bubble_table(configs, world, micro, gbs)
    return min(b, key=b.get)


class Weird:
    """An answer whose comparisons and hash raise: a checker must still give a verdict."""

    def __eq__(self, other):
        raise RuntimeError("no comparing me")

    __ne__ = __lt__ = __eq__

    def __hash__(self):
        raise RuntimeError("no hashing me")


def largest_dp_ignores_cp(configs, world, micro, gbs):
    b = {n: (pp - 1) / (gbs / (micro * (world // (tp * pp)))) for n, (tp, pp, cp) in configs.items()}
    return max(b, key=b.get)


def largest_m_ignores_dp(configs, world, micro, gbs):       # the same m for everyone: depth decides
    return max(configs, key=lambda n: (configs[n][1] - 1) / (gbs / micro))


def largest_fractions(configs, world, micro, gbs):
    b = {n: Fraction(pp - 1, gbs // (micro * (world // (tp * pp * cp)))) for n, (tp, pp, cp) in configs.items()}
    return np.str_(max(b, key=b.get))


@pytest.mark.parametrize("fn, ok, text", [
    (largest, True, "✓ largest_bubble"),
    (largest_share, True, "✓ largest_bubble"),
    (largest_fractions, True, "✓ largest_bubble"),
    (deepest, False, "depth alone does not decide"),
    (largest_m_ignores_dp, False, "depth alone does not decide"),
    (largest_dp_ignores_cp, False, "CP ranks are not data-parallel replicas"),
    (smallest, False, "that is the *smallest* bubble"),
    (lambda configs, *a: 0.375, False, "return the *name* of a config"),
    (lambda configs, *a: Weird(), False, "return the *name* of a config"),
    (lambda configs, *a: ["E"], False, "return the *name* of a config"),
    (_todo, False, "not attempted yet: write largest_bubble"),
])
def test_check_largest_bubble(fn, ok, text, capsys):
    assert pipeline_bubbles.check_largest_bubble(fn).ok is ok
    out = capsys.readouterr().out
    assert text in out, out
    if fn is largest_dp_ignores_cp:
        assert "depth alone" not in out      # its answer on one sweep is the deepest config: not the diagnosis


def test_bubble_cases_tell_the_mistakes_apart():
    """Ignoring CP picks the deepest config on one sweep, and a config that is not the deepest on another."""
    picks = [(largest_dp_ignores_cp(*c), deepest(*c), largest(*c)) for c in pipeline_bubbles.BUBBLE_CASES]
    assert any(no_cp == deep != right for no_cp, deep, right in picks)
    assert any(no_cp != deep for no_cp, deep, _ in picks)


def test_bubble_cases_include_ones_where_the_deepest_pipeline_is_not_the_answer():
    answers = [largest(*case) for case in pipeline_bubbles.BUBBLE_CASES]
    deepest_answers = [deepest(*case) for case in pipeline_bubbles.BUBBLE_CASES]
    assert answers[0] == "E" and any(a != d for a, d in zip(answers, deepest_answers))


# ---------------------------------------------------------------- exercise 3: one log line

def parse(line):
    out = {}
    for field in line.split("|"):
        name, _, value = field.rpartition(":")
        if "iteration" in field and "/" in field and "elapsed" not in field:
            out["iteration"] = int(field.split("iteration")[-1].split("/")[0])
        elif name.strip() == "elapsed time per iteration (ms)":
            out["elapsed_ms"] = float(value)
        elif name.strip() == "lm loss":
            out["lm_loss"] = float(value)
    return out


def parse_assumes_first_field(line):
    f = line.split("|")
    return {"iteration": int(f[0].split()[1].split("/")[0]), "elapsed_ms": float(f[2].split(":")[1]),
            "lm_loss": float(f[5].split(":")[1])}


def parse_total_iterations(line):
    d = parse(line)
    d["iteration"] = int(line.split("iteration")[1].split("/")[1].split("|")[0])
    return d


def parse_missing_loss(line):
    d = parse(line)
    del d["lm_loss"]
    return d


def parse_numpy(line):
    d = parse(line)
    return {"iteration": np.int64(d["iteration"]), "elapsed_ms": np.float64(d["elapsed_ms"]),
            "lm_loss": torch.tensor(d["lm_loss"], dtype=torch.float64)}


def parse_positive_exponent(line):
    """A regex written from lines whose losses are all above 1: it expects 'E+', so a loss under 1 (E-01) is missed."""
    import re

    d = parse(line)
    d["lm_loss"] = float(re.search(r"lm loss: (\d\.\d+E\+\d+)", line)[1])
    return d


def parse_course(line):
    it = parse_log(line).iterations[0]
    return {"iteration": it["iteration"], "elapsed_ms": it["elapsed_ms"], "lm_loss": it["lm_loss"]}


@pytest.mark.parametrize("fn, ok, text", [
    (parse, True, "✓ parse_iteration_line reads 5 formats"),
    (parse_numpy, True, "✓ parse_iteration_line reads 5 formats"),
    (lambda line: {**parse(line), "lm_loss": float("nan")}, False, "lm_loss is not what the line says"),
    (lambda line: {**parse(line), "iteration": 10}, False, "iteration is not what the line says"),  # a table
    (parse_course, False, "the course's own"),
    (parse_assumes_first_field, False, "since core 0.6 the line starts with a '[date time]' stamp"),
    (parse_total_iterations, False, "take the number before the '/'"),
    (parse_positive_exponent, False, "a loss below 1 is written with a negative exponent"),
    (parse_missing_loss, False, "return a dict with the keys iteration, elapsed_ms, lm_loss"),
    (_todo, False, "not attempted yet: write parse_iteration_line"),
])
def test_check_parse_line(fn, ok, text, capsys):
    assert training_logs.check_parse_line(fn).ok is ok
    assert text in capsys.readouterr().out


def test_drawn_lines_keep_their_era_and_vary():
    """The numbers drawn into each line keep the era's format (the course's parser reads them as that era)."""
    import random

    from course_lib.training.logs import parse_log

    for name, line in training_logs.ITERATION_LINES.items():
        drawn = [training_logs.drawn_line(line, random.Random(seed)) for seed in range(20)]
        assert all(parse_log(d).era == parse_log(line).era and len(parse_log(d).iterations) == 1 for d in drawn)
        assert len({parse_log(d).iterations[0]["lm_loss"] for d in drawn}) == 20, name


def test_every_run_has_a_loss_below_one():
    """A parser that expects a positive exponent (E+01, as every fixed line shows) fails only on a loss under 1:
    every run's lines have one, in the era's format, and which era carries it is drawn."""
    import random

    from course_lib.training.logs import parse_log

    eras = set()
    for seed in range(8):
        lines = training_logs.drawn_lines(random.Random(seed))
        assert list(lines) == list(training_logs.ITERATION_LINES)
        low = [era for era, line in lines.items() if parse_log(line).iterations[0]["lm_loss"] < 1]
        assert low and all("lm loss: " in lines[era] and "E-0" in lines[era].split("lm loss: ")[1][:16]
                           for era in low), (seed, lines)
        assert all(parse_log(lines[era]).era == parse_log(training_logs.ITERATION_LINES[era]).era for era in low)
        eras.update(low)
    assert len(eras) > 1


def test_checker_lines_are_the_fixtures_formats():
    """Each sample line is read by the course parser exactly as the fixture logs of its era."""
    from course_lib.training.logs import parse_log

    eras = {name: parse_log(line).era for name, line in training_logs.ITERATION_LINES.items()}
    assert eras == {"Megatron before core 0.6": "pre-0.6", "Megatron core 0.6-0.15": "0.6-0.15",
                    "Megatron core 0.16+": "0.16+", "the course's CPU log": "0.16+",
                    "torchrun --tee (prefix)": "0.6-0.15"}


# ---------------------------------------------------------------- exercise 2: one distributed-optimizer step

def dist_opt_ok(params, grad, group, make_optimizer):
    d, r = dist.get_world_size(group), dist.get_rank(group)
    shard_grad = torch.empty(grad.numel() // d, dtype=grad.dtype)
    dist.reduce_scatter_tensor(shard_grad, grad, group=group)
    shard = params.chunk(d)[r].clone().requires_grad_()
    shard.grad = shard_grad / d
    opt = make_optimizer([shard])
    opt.step()
    out = torch.empty_like(params)
    dist.all_gather_into_tensor(out, shard.detach(), group=group)
    return out, opt


def dist_opt_lists(params, grad, group, make_optimizer):     # list collectives, AVG reduce-scatter by hand
    d, r = dist.get_world_size(group), dist.get_rank(group)
    shard_grad = torch.empty(grad.numel() // d, dtype=grad.dtype)
    dist.reduce_scatter(shard_grad, list((grad / d).chunk(d)), group=group)
    shard = torch.nn.Parameter(params.chunk(d)[r].clone())
    shard.grad = shard_grad
    opt = make_optimizer([shard])
    opt.step()
    pieces = [torch.empty_like(shard) for _ in range(d)]
    dist.all_gather(pieces, shard.detach(), group=group)
    return torch.cat(pieces), opt


def dist_opt_plain_ddp(params, grad, group, make_optimizer):   # right numbers: every rank holds all the state
    d = dist.get_world_size(group)
    g = grad.clone()
    dist.all_reduce(g, group=group)
    p = params.clone().requires_grad_()
    p.grad = g / d
    opt = make_optimizer([p])
    opt.step()
    return p.detach(), opt


def dist_opt_all_reduce_shard(params, grad, group, make_optimizer):  # right numbers and state, twice the traffic
    d, r = dist.get_world_size(group), dist.get_rank(group)
    g = grad.clone()
    dist.all_reduce(g, group=group)
    shard = params.chunk(d)[r].clone().requires_grad_()
    shard.grad = g.chunk(d)[r] / d
    opt = make_optimizer([shard])
    opt.step()
    out = torch.empty_like(params)
    dist.all_gather_into_tensor(out, shard.detach(), group=group)
    return out, opt


def dist_opt_sum(params, grad, group, make_optimizer):
    d, r = dist.get_world_size(group), dist.get_rank(group)
    shard_grad = torch.empty(grad.numel() // d, dtype=grad.dtype)
    dist.reduce_scatter_tensor(shard_grad, grad, group=group)
    shard = params.chunk(d)[r].clone().requires_grad_()
    shard.grad = shard_grad                                    # the sum, not the average
    opt = make_optimizer([shard])
    opt.step()
    out = torch.empty_like(params)
    dist.all_gather_into_tensor(out, shard.detach(), group=group)
    return out, opt


def dist_opt_shard_only(params, grad, group, make_optimizer):
    out, opt = dist_opt_ok(params, grad, group, make_optimizer)
    return out.chunk(dist.get_world_size(group))[dist.get_rank(group)], opt


def dist_opt_full_state(params, grad, group, make_optimizer):  # right numbers and traffic, optimizer for all N
    d, r = dist.get_world_size(group), dist.get_rank(group)
    shard_grad = torch.empty(grad.numel() // d, dtype=grad.dtype)
    dist.reduce_scatter_tensor(shard_grad, grad, group=group)
    full = params.clone().requires_grad_()
    full.grad = torch.zeros_like(params)
    full.grad.chunk(d)[r].copy_(shard_grad / d)
    opt = make_optimizer([full])
    opt.step()
    out = torch.empty_like(params)
    dist.all_gather_into_tensor(out, full.detach().chunk(d)[r].contiguous(), group=group)
    return out, opt


def dist_opt_broadcasts(params, grad, group, make_optimizer):
    d, r = dist.get_world_size(group), dist.get_rank(group)
    shard_grad = torch.empty(grad.numel() // d, dtype=grad.dtype)
    dist.reduce_scatter_tensor(shard_grad, grad, group=group)
    shard = params.chunk(d)[r].clone().requires_grad_()
    shard.grad = shard_grad / d
    opt = make_optimizer([shard])
    opt.step()
    pieces = [shard.detach().clone() if q == r else torch.empty_like(shard) for q in range(d)]
    for q in range(d):
        dist.broadcast(pieces[q], src=q, group=group)
    return torch.cat(pieces), opt


def dist_opt_decoy(params, grad, group, make_optimizer):   # right numbers and state: a decoy shard optimizer
    d, r = dist.get_world_size(group), dist.get_rank(group)
    shard_grad = torch.empty(grad.numel() // d, dtype=grad.dtype)
    dist.reduce_scatter_tensor(shard_grad, grad, group=group)
    full_grad = torch.empty_like(grad)
    dist.all_gather_into_tensor(full_grad, shard_grad / d, group=group)    # the *gradients* all-gathered
    decoy = params.chunk(d)[r].clone().requires_grad_()
    decoy.grad = shard_grad / d
    opt = make_optimizer([decoy])
    opt.step()                                    # the right moments, for show
    full = params.clone().requires_grad_()
    full.grad = full_grad
    make_optimizer([full]).step()                 # every parameter updated on every rank
    return full.detach(), opt


def dist_opt_rebuilt_from_seed(params, grad, group, make_optimizer):  # every replica's grad rebuilt, no exchange
    d, r = dist.get_world_size(group), dist.get_rank(group)
    gen = torch.Generator().manual_seed(17)
    torch.randn(params.numel(), generator=gen, dtype=torch.float64)
    mean = sum(torch.randn(params.numel(), generator=gen, dtype=torch.float64) for _ in range(d)) / d
    shard = params.chunk(d)[r].clone().requires_grad_()
    shard.grad = mean.chunk(d)[r]
    opt = make_optimizer([shard])
    opt.step()
    dist.reduce_scatter_tensor(torch.empty(grad.numel() // d, dtype=grad.dtype), grad, group=group)
    out = torch.empty_like(params)
    dist.all_gather_into_tensor(out, shard.detach(), group=group)
    return out, opt


def dist_opt_via_checker_reference(params, grad, group, make_optimizer):   # the checker's own reference step
    from course_lib.classroom.checks.distributed_optimizer import _one_step
    _one_step(make_optimizer, params, grad)
    return dist_opt_ok(params, grad, group, make_optimizer)


@pytest.mark.parametrize("fn, ok, text", [
    (dist_opt_decoy, False, "carried your *gradient* shard"),
    (dist_opt_rebuilt_from_seed, False, "differ from one single-process step"),
    (dist_opt_via_checker_reference, False, "reached into the checker (course_lib.classroom.checks.distributed_optimizer"),
    (dist_opt_ok, True, "✓ distributed_optimizer_step"),
    (dist_opt_lists, True, "✓ distributed_optimizer_step"),
    (_todo, False, "not attempted yet: write distributed_optimizer_step"),
    (dist_opt_plain_ddp, False, "that is plain data parallelism"),
    (dist_opt_all_reduce_shard, False, "sends half as much"),
    (dist_opt_sum, False, "divide your shard by d"),
    (dist_opt_shard_only, False, "you returned only your shard"),
    (dist_opt_full_state, False, "for your 1/d shard only"),
    (dist_opt_broadcasts, False, "reduce-scatter the gradients over DP"),
    (lambda params, grad, group, make: params, False, "return a pair (new_params, optimizer)"),
])
def test_check_distributed_optimizer_step(fn, ok, text, capsys):
    assert distributed_optimizer.check_distributed_optimizer_step(fn).ok is ok
    out = capsys.readouterr().out
    assert text in out, out


# ---------------------------------------------------------------- exercise 5: the student's conclusions

SWEEP = {"configs": [
    {"name": "A", "tp": 1, "pp": 1, "dp": 8, "step_time_ms": 207.5, "tokens_per_s": 2468.0,
     "model_states_mb_per_rank": [6.5098] * 8, "comm_per_iteration": {"dp": {"calls": 2.0, "sent_bytes": 2986000.0}}},
    {"name": "D", "tp": 2, "pp": 2, "dp": 2, "step_time_ms": 1021.9, "tokens_per_s": 501.0,
     "model_states_mb_per_rank": [1.7559] * 4 + [1.7266] * 4,
     "comm_per_iteration": {"tp": {"calls": 160.0, "sent_bytes": 1117184.0}}},
]}


def _plans():
    big = sizing.ModelSpec("13B GPT", num_layers=40, hidden_size=5120, num_heads=40, vocab_size=51200,
                           seq_length=2048)
    return {big.name: {name: sizing.plan(big, tp=tp, pp=pp, dp=8 // (tp * pp * cp), cp=cp, micro_batch_size=1,
                                         global_batch_size=64, sequence_parallel=tp > 1)
                       for name, (tp, pp, cp) in SEED_SWEEP.items()}}


GOOD = {
    "tiny_gpt": "A: on our CPU run A took 207.5 ms per step and D 1,021.9 ms, about 4.9 times slower, so no split.",
    "gpt_13b": "D, because A would need 254.02 GB per rank and D fits at 76.53 GB with a small bubble.",
    "rule": "TP inside a node until a layer fits, PP across nodes for depth, DP for the rest, CP for long sequences.",
    "sweep": "TP all-reduces dominate: D issued 160 TP calls per iteration while A's model states were 6.51 MB.",
}


@pytest.mark.parametrize("answers, ok, text", [
    (GOOD, True, "✓ your conclusions are written"),
    ({**GOOD, "sweep": "Model parallelism made things slower on the CPU, as I expected from the theory."}, False,
     "'sweep': cite at least one number"),
    ({**GOOD, "tiny_gpt": "I would take the simplest one, since it has 2468 tokens/s per second in total."}, False,
     "'tiny_gpt': name the config"),
    ({**GOOD, "rule": "use whatever makes the model fit on the machine you happen to have today"}, False,
     "'rule': say when to use each of TP, PP, DP and CP"),
    ({**GOOD, "gpt_13b": "..."}, False, "'gpt_13b': write your choice from A-F for the 13B GPT"),
    ({k: v for k, v in GOOD.items() if k != "rule"}, False, "'rule': write your own rule"),
    ("A is best", False, "return a dict"),
])
def test_check_conclusions(answers, ok, text, capsys):
    assert conclusions.check_conclusions(lambda: answers, SWEEP, _plans()).ok is ok
    out = capsys.readouterr().out
    assert text in out, out


def test_conclusions_not_attempted_and_course_reading_after_them(capsys):
    assert not conclusions.check_conclusions(_todo, SWEEP)
    conclusions.print_course_reading(_plans(), unlocked=False)
    out = capsys.readouterr().out
    assert "not attempted yet: write my_conclusions" in out and "appears here once" in out and "D --" not in out
    conclusions.print_course_reading(_plans(), unlocked=True)
    out = capsys.readouterr().out
    assert "13B GPT: D -- A needs 254.02 GB per rank" in out and "Rule of thumb" in out


def test_cited_numbers_match_at_the_precision_written():
    numbers = conclusions.measured_numbers(SWEEP)
    assert conclusions.cited_numbers("A 207.5 ms, D 1,021.9 ms, 1.73-1.76 MB, ratio 4.9", numbers) == [
        "207.5", "1,021.9", "1.73", "1.76", "4.9"]
    assert conclusions.cited_numbers("TP 2, PP 4, 8 ranks, 300 tokens, 200.0 ms", numbers) == []
    # what the clock measured counts as a citation, but the success line (clock=False) leaves it out
    steady = conclusions.measured_numbers(SWEEP, clock=False)
    assert conclusions.cited_numbers("A 207.5 ms, D 1,021.9 ms, 1.73-1.76 MB, ratio 4.9", steady) == ["1.73", "1.76"]


def test_deliverable_carries_the_students_conclusions_first():
    report = "# Day 22\n\n## 5. Conclusions (TP / PP / CP trade-offs)\n\n- Throughput: A is fastest.\n" \
             "- Your choice for this model and why (memory, throughput, communication, complexity): …\n"
    mine = conclusions.with_your_conclusions(report, lambda: GOOD)
    assert mine.index("### Mine") < mine.index(GOOD["sweep"]) < mine.index("### What the numbers say") \
        < mine.index("- Throughput: A is fastest.")
    assert "Your choice for this model" not in mine
    assert "not written yet" in conclusions.with_your_conclusions(report, _todo)


# ---------------------------------------------------------------- exercise 6: which config wins on 8 x H100

def gpu_right():
    return {"tiny_gpt": ("A", "dp_fits"), "gpt_13b": ("D", "small_tp_short_pp")}


def gpu_lists_numpy_lowercase():
    return {"tiny_gpt": [np.str_("a"), "dp_fits"], "gpt_13b": ["d ", np.str_("small_tp_short_pp")]}


def _gpu(tiny, big):
    return lambda: {"tiny_gpt": tiny, "gpt_13b": big}


@pytest.mark.parametrize("fn, ok, text", [
    (gpu_right, True, "✓ predict_gpu_winner: A for the tiny GPT"),
    (gpu_lists_numpy_lowercase, True, "✓ predict_gpu_winner"),
    (_gpu(("B", "tp_is_free"), ("D", "small_tp_short_pp")), False, "TP 2's all-reduces take"),
    (_gpu(("E", "deep_pp"), ("D", "small_tp_short_pp")), False, "PP 4 idles longer in the bubble"),
    (_gpu(("A", "dp_fits"), ("A", "dp_fits")), False, "A does not fit: its busiest rank needs 254.0 GB of 80 GB"),
    (_gpu(("A", "dp_fits"), ("E", "deep_pp")), False, "E does not fit"),
    (_gpu(("A", "dp_fits"), ("C", "tp_is_free")), False, "TP 4's all-reduces take"),
    (_gpu(("A", "dp_fits"), ("F", "least_memory")), False, "CP adds a K/V ring"),
    (_gpu(("A", "as_on_cpu"), ("D", "small_tp_short_pp")), False, "gloo on 2 shared cores"),
    (_gpu(("A", "dp_fits"), ("D", "least_memory")), False, "memory only decides whether a config fits"),
    (_gpu(("A", "dp_fits"), ("D", "dp_fits")), False, "D is right, but not because"),
    (_gpu(("A", "because it is simple"), ("D", "small_tp_short_pp")), False, "is not a key of GPU_REASONS"),
    (_gpu(("G", "dp_fits"), ("D", "small_tp_short_pp")), False, "is not one of the configs A, B, C, D, E, F"),
    (_gpu("A", ("D", "small_tp_short_pp")), False, "is not a pair (config, reason)"),
    (lambda: {"tiny_gpt": ("A", "dp_fits")}, False, "return a dict with the keys tiny_gpt, gpt_13b"),
    (lambda: None, False, "return a dict with the keys"),
    (_todo, False, "not attempted"),
])
def test_check_gpu_winner(fn, ok, text, capsys):
    assert gpu_projection.check_gpu_winner(fn).ok is ok
    assert text in capsys.readouterr().out


def test_gpu_winner_hint_never_names_the_winner(capsys):
    """The hint explains why the student's config loses from its own numbers; the winner stays unnamed."""
    assert gpu_projection.check_gpu_winner(_gpu(("B", "tp_is_free"), ("D", "small_tp_short_pp"))).ok is False
    out = capsys.readouterr().out
    assert "B: step" in out and "A: step" not in out and " A " not in out.split("hint")[1], out


def test_gpu_winner_cases_are_the_labs_story():
    # the checker's expected answers: DP alone for the model that fits, the least split that fits for 13B;
    # on the *CPU* sweep TP is several times slower than A, on NVLink only a fraction (the lesson's contrast)
    projected = gpu_projection.gpu_projections()
    assert gpu_projection.gpu_winner(projected["tiny_gpt"]) == "A"
    assert gpu_projection.gpu_winner(projected["gpt_13b"]) == "D"
    assert not any(projected["gpt_13b"][n].plan.fits for n in "ABE")
    assert all(projected["tiny_gpt"][n].plan.fits for n in SEED_SWEEP)
    tiny = projected["tiny_gpt"]
    assert tiny["B"].step_time < 2 * tiny["A"].step_time
    # every wrong config that fits is slower than the winner, and each wrong reason has its own hint
    assert set(gpu_projection.GPU_REASONS) == {"dp_fits", "small_tp_short_pp"} | set(gpu_projection._REASON_HINTS)
