"""The one proof mechanism of the checkers: the reference registry covers every exercise of every lab,
the course's own answer is refused however it is wrapped, and so is every function of a checker module;
the checked process group keeps what each op carried, draws secret inputs, measures the largest tensor
and names an all-to-all whose splits cannot work.

The per-lab files (tests/classroom/checks/test_lab0N_checks.py) hold, for each hardened
checker, a right-numbers-wrong-algorithm answer now refused and a right answer written differently.
"""

from __future__ import annotations

import functools
import inspect
import json
import re
from pathlib import Path

import pytest
import torch

from course_lib.classroom.checks import references, tamper_guard

ROOT = Path(__file__).resolve().parents[3]
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
# Exercise cells whose functions are not the registry's key.
ALIASES = {"CopyToTensorParallelRegion": "f_and_g", "ReduceFromTensorParallelRegion": "f_and_g",
           "predict_elements_sent": "predict_collectives"}


def _exercise_names(path: Path) -> list[tuple[str, list[str]]]:
    """(lab, [functions and classes defined]) of every exercise cell of one solution notebook."""
    cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
    lab = path.name[:2]
    out = []
    for cell in cells:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and "### BEGIN SOLUTION" in source:
            out.append((lab, re.findall(r"^(?:def|class) (\w+)", source, re.M)))
    return out


def test_every_exercise_of_every_lab_has_a_registry_entry_that_resolves():
    keys = set()
    for path in SOLUTIONS:
        for lab, names in _exercise_names(path):
            key = next((k for k in (ALIASES.get(n, n) for n in names) if k in references.REFERENCES),
                       f"my_answers_{lab}" if "my_answers" in names else None)
            assert key in references.REFERENCES, f"{path.name}: no registry entry for {names}"
            keys.add(key)
    assert len(keys) >= 34
    for key in references.REFERENCES:
        for obj in references.references_for(key):   # every "module:qualname" names real course code
            assert callable(obj) and (getattr(obj, "__module__", "") or "").startswith("course_lib")
    with pytest.raises(ValueError, match="no entry in the reference registry"):
        references.references_for("not_an_exercise")


# ------------------------------------------------------------------ the reference policy, however wrapped


def _caught(fn, *args, refs=()) -> list:
    return tamper_guard.run_student(fn, *args, references=refs).course_code


def test_a_reference_is_seen_through_a_wrapper_a_partial_a_copy_of_its_code_and_an_exec_of_its_source():
    from course_lib.moe import router

    ref = router.switch_load_balancing_loss
    refs = references.references_for("aux_loss")
    scores = torch.softmax(torch.randn(6, 4), -1)
    idx = torch.topk(scores, 2, -1).indices
    ns = {"torch": torch}
    exec(inspect.getsource(ref), ns)                                      # the source, compiled again
    copied = type(ref)(ref.__code__, ref.__globals__, None, ref.__defaults__)   # the same code object
    for fn in (lambda s, i, e, c: ref(s, i, e, c), functools.partial(ref), copied, ns[ref.__name__]):
        assert _caught(fn, scores, idx, 4, 0.1, refs=refs) == ["course_lib.moe.router.switch_load_balancing_loss"]
    mine = lambda s, i, e, c: c * e * (torch.bincount(i.flatten(), minlength=e) / i.numel() * s.mean(0)).sum()  # noqa: E731
    assert _caught(mine, scores, idx, 4, 0.1, refs=refs) == []


def test_a_checker_modules_own_functions_are_refused_but_what_it_hands_over_is_not():
    from course_lib.classroom.checks import distributed_optimizer, grad_sync, moe

    assert _caught(lambda: moe.dispatch_inputs(torch.Generator().manual_seed(0))) == [
        "course_lib.classroom.checks.moe.dispatch_inputs"]
    assert _caught(lambda: grad_sync.expected_buckets([3, 4], 5)) == [
        "course_lib.classroom.checks.grad_sync.expected_buckets"]
    make = distributed_optimizer.OPTIMIZERS["Adam"][0]                    # a checker's lambda, handed over
    assert _caught(lambda params, make_optimizer: make_optimizer(params), [torch.nn.Parameter(torch.ones(2))],
                   make) == []


def test_a_trivial_function_written_like_the_courses_is_no_copy():
    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, group):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad_output):
            return grad_output, None

    x = torch.ones(2, requires_grad=True)
    run = tamper_guard.run_student(lambda: Identity.apply(x, None).sum().backward(),
                               references=references.references_for("f_and_g"))
    assert run.error is None and run.course_code == []


def test_torchs_own_rewrap_of_manual_seed_is_no_patch_and_a_students_wrapper_is():
    """Importing torch._dynamo (a torch.optim step, megatron-core) from a student's function rewraps
    torch.manual_seed in torch._disable_dynamo: not the student's patch (a right answer that imported megatron-core's
    schedules failed with "it replaced torch.manual_seed"). A wrapper the student writes is still named and undone."""
    import functools

    raw, saved = torch.random.manual_seed, torch.manual_seed
    try:
        torch.manual_seed = raw                   # as before torch._dynamo is first imported
        with tamper_guard.undo_patches() as changed:
            torch.manual_seed = torch._disable_dynamo(torch.manual_seed)  # what importing torch._dynamo does
        assert changed == [] and torch.manual_seed is not raw
        for theirs in (functools.wraps(raw)(lambda *a, **k: None),      # looks like it, other code
                       functools.wraps(raw)(torch._disable_dynamo(lambda *a, **k: None))):  # torch's code, not raw
            torch.manual_seed = raw
            with tamper_guard.undo_patches() as changed:
                torch.manual_seed = theirs
            assert changed == ["torch.manual_seed"] and torch.manual_seed is raw
    finally:
        torch.manual_seed = saved


# ------------------------------------------------------------------ wrapped references, exercise by exercise


def _wrapped_cases():
    from course_lib import rules
    from course_lib.classroom.checks import (context_parallel, pipeline_bubbles, pipeline_schedules, rank_grid,
                                             sizing, training_logs, zero_stages)
    from course_lib.context_parallel import zigzag
    from course_lib.context_parallel.ring import merge_partials
    from course_lib.training.logs import parse_log
    from course_lib.pipeline.bubbles import bubble_fraction
    from course_lib.pipeline.schedules import num_warmup_microbatches, schedule_1f1b
    from course_lib.sizing import megatron_optimizer_bytes_per_param, model_state_bytes, moe
    from course_lib.topology import rank_groups

    def groups(rank, layout):
        sizes = {"tp": layout["tp"], "cp": layout["cp"], "dp": layout["world_size"] // (
            layout["tp"] * layout["pp"] * layout["cp"]), "pp": layout["pp"]}
        order = ("tp", "cp", "dp", "pp")
        return {a: next(g for g in rank_groups(order, sizes, a) if rank in g) for a in order}

    def gpt(layers, h, vocab, seq):
        counts = moe.moe_parameter_counts(num_layers=layers, hidden_size=h, num_attention_heads=1, vocab_size=vocab,
                                          num_experts=1, moe_router_topk=1, moe_ffn_hidden_size=4 * h,
                                          moe_layer_freq=[0] * layers, max_position_embeddings=seq)
        return counts["total"]

    return [
        (rank_grid.check_derive_dp, lambda w, t, p, c: rules.data_parallel_size(w, t, p, c), "data_parallel_size"),
        (rank_grid.check_groups_of, groups, "rank_groups"),
        (rank_grid.check_layout, lambda w, t, p, c, mi, g: (rules.data_parallel_size(w, t, p, c),
                                                            rules.num_microbatches(g, mi, w // (t * p * c))),
         "data_parallel_size"),
        (pipeline_schedules.check_warmup, lambda p, m, r: num_warmup_microbatches(p, m, r), "num_warmup_microbatches"),
        (pipeline_schedules.check_order, lambda p, m, r: [str(a) for a in schedule_1f1b(p, m, r)], "schedule_1f1b"),
        (pipeline_bubbles.check_bubble, lambda p, m, vp: bubble_fraction(p, m, vp), "bubble_fraction"),
        (context_parallel.check_merge, lambda *a: merge_partials(*a), "merge_partials"),
        (context_parallel.check_chunks_for_rank, lambda r, cp: zigzag.chunks_for_rank(r, cp), "chunks_for_rank"),
        (training_logs.check_parse_line, lambda line: parse_log(line).iterations[0], "parse_log"),
        (sizing.check_gpt_parameters, gpt, "moe_parameter_counts"),
        (sizing.check_model_state_bytes,
         lambda n, tp, dp, cp, d: n * megatron_optimizer_bytes_per_param(dp * cp, d, "bf16", "fp32").total,
         "megatron_optimizer_bytes_per_param"),
        (zero_stages.check_zero_bytes, lambda n, dp, s: dict(zip(("params", "grads", "optimizer"),
                                                                 model_state_bytes(n, dp, s))), "model_state_bytes"),
        (zero_stages.check_what_it_shards, lambda config: zero_stages.ds_truth(config), "zero_stages.ds_truth"),
    ]


@pytest.mark.parametrize("index", range(13))
def test_a_wrapped_reference_is_refused_by_every_single_process_checker(index, capsys):
    checker, wrapped, name = _wrapped_cases()[index]
    assert checker(wrapped).ok is False
    out = capsys.readouterr().out
    assert ("the course's own" in out or "reached into the checker" in out) and name in out and "✓" not in out, out


# ------------------------------------------------------------------ the checked process group


def _rank_wire():
    import torch.distributed as dist

    from course_lib.classroom.checks.wire import largest_tensor, secret_generator, wire_recorder

    r = dist.get_rank()
    x = torch.full((4,), float(r))
    with wire_recorder() as rec, largest_tensor() as seen:
        y = x.clone()
        dist.all_reduce(y)
        out = torch.empty(8)
        dist.all_gather_into_tensor(out, x)
        torch.cat([out, out, out])
    return dict(events=[e.op for e in rec.events], carried=rec.carried, largest=seen.largest, op=seen.op,
                seed=secret_generator().initial_seed())


def _rank_bad_splits():
    import torch.distributed as dist

    rows = torch.ones(3 + dist.get_rank(), 2)
    out = torch.empty(3 + dist.get_rank(), 2)                      # expects to get back what it sends: wrong
    dist.all_to_all_single(out, rows, output_split_sizes=[1, 2 + dist.get_rank()],
                           input_split_sizes=[1, 2 + dist.get_rank()])


def test_the_checked_group_keeps_what_was_carried_draws_secret_seeds_and_names_bad_splits():
    from course_lib.classroom.checks.verdicts import launch_checked, split_problem
    from course_lib.launch import RankError

    res = launch_checked(_rank_wire, world_size=2)
    assert [r["events"] for r in res] == [["all_reduce", "all_gather"]] * 2
    assert torch.equal(res[1]["carried"][0], torch.ones(4)) and torch.equal(res[1]["carried"][1], torch.ones(4))
    assert res[0]["largest"] == 24 and res[0]["op"] == "cat"
    assert res[0]["seed"] != res[1]["seed"]
    with pytest.raises(RankError) as err:                          # gloo would abort (SIGABRT); now a sentence
        launch_checked(_rank_bad_splits, world_size=2)
    line = split_problem(err.value.traceback)
    assert line and "exchange the counts first" in line, err.value.traceback[-400:]
