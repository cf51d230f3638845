"""A class of unsolved, half-done, crashing, hanging and cheating students, graded through ``grade_class`` on every
lab (00-11), and every (student, exercise) row of grades.csv checked: passed or not, and the hint naming the cause.
The solved student is ``test_grade_every_lab.py``'s, on the full labs.

To stay cheap each lab is a *mini lab* (:func:`mini_labs.mini_solution`): its units (exercise and checker cells, as
they are) and the cells they need. Left out are the three review exercises whose answers are checked against the
lab's own training runs -- :data:`MEASURED` -- whose runs would cost every student ~11 s (Lab 05's sweep, Lab 09's
eight ranks, Lab 10's ZeRO runs). The class is graded in four gradings at the same time (:data:`GRADINGS`), so that
together they keep about one core busy: the half-done, crashing (its other exercises stubs) and cheating students
with a time limit the solved exercises' ranks fit in (:data:`TIMEOUT_S`); a loop on a rank (Lab 00 alone, the same
limit: the checker names it after half its group's time limit, 10 s, asleep); and the student who hangs (the other
exercises stubs, two gradings of six labs) with a small one (:data:`HANG_TIMEOUT_S`): each hang costs that limit in
wall time (it sleeps), not CPU -- and, being in the
lab's last unit, leaves every exercise with its verdict, so the lab is not run again. The unsolved lab is the
crashing and the hanging students' stubs, exercise by exercise (a third student's 12 labs cost ~9 s of CPU).
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
import threading
import time
from pathlib import Path

import mini_labs  # this folder is on sys.path (no __init__.py): rootdir-relative import mode
import pytest

from course_lib.classroom.grading import grade_class, landlock
from course_lib.classroom.grading.official import current_lab, source_of, units_of
from course_lib.classroom.notebooks.generator import lab_text

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
MEASURED = ("my_conclusions", "my_answers_09", "my_answers_10")
"""Review exercises checked against the lab's own training runs: left out of the mini labs (see the module's doc)."""
TIMEOUT_S = 60.0   # solved exercises launch ranks (Lab 10's: ~4 s alone, on a shared machine more); a loop on a rank
                   # is named by its checker after half the group's time limit (Lab 00's: 20 s)
HANG_TIMEOUT_S = 15.0  # the hanging student's other units are stubs (~0.3 s alone); with 4 s one timed out at a load
                       # of 23 on 2 cores, with 6 s one in a fresh clone's make test (2026-12-06: Lab 05's
                       # distributed_optimizer_step), with 10 s two labs (02's imports, 07's stubs) in a make test
                       # beside a 4-rank run (load 22, 2026-12-06); the hangs sleep beside the class grading. Above
                       # 10 s a loop on a rank (Labs 00, 02) is named by its checker first (:data:`LOOP_NAMED`)

LOOP_NAMED = "your function neither returned nor sent anything for 10 s: is there a loop that never ends?"
"""What a checker on ranks says of a function that loops there (after half its group's time limit): a hang on a rank
that it names before the grader's :data:`HANG_TIMEOUT_S` runs out is graded right too."""

CRASH = "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)  # the kernel itself crashes\n\n"
RAISES = "my own bug"


def _stub(lab: dict, exercise: str) -> str:
    """The lab's stub cell of ``exercise``."""
    unit = next(u for u in units_of(lab) if exercise in u.exercises)
    return source_of(lab["cells"][unit.exercise_cells[0]])


def _with_body(stub: str, body: str) -> str:
    """The stub's functions (their ``def`` lines, as the lab gives them) with ``body``."""
    return "".join(f"{line}\n{body}\n" for line in re.findall(r"^def .*$", stub, re.M))


# Every exercise a cheat: its cell calls the course's own reference, or the real library, for that exercise (a review
# exercise: the right words, the numbers made up). The words each hint must hold follow each cheat: the refused
# reference or library named (a review's: the wrong answer named).
CHEATS = {
    "my_ring_all_reduce": ("from course_lib.communication_patterns import ring_all_reduce\n\n"
                           "def my_ring_all_reduce(x):\n    return ring_all_reduce(x)\n", "ring_all_reduce"),
    "my_all_reduce_rs_ag": ("from course_lib.communication_patterns import apply_collective\n\n"
                            "def my_all_reduce_rs_ag(x):\n    return apply_collective('all_reduce', x)\n",
                            "apply_collective"),
    "sync_gradients": ("from course_lib.training.finalize_model_grads import _coalesced_sum_then_divide\n"
                       "import torch.distributed as dist\n\n"
                       "def sync_gradients(model, bucket_numel):\n"
                       "    _coalesced_sum_then_divide(list(model.parameters()), None, dist.get_world_size(), 'grad')\n",
                       "_coalesced_sum_then_divide"),
    "derive_dp": ("from megatron.core.parallel_state import RankGenerator\n\n"
                  "def derive_dp(world_size, tp, pp, cp=1):\n"
                  "    return RankGenerator(tp, 1, 1, pp, cp, 'tp-cp-ep-dp-pp', 0).world_size // (tp * pp * cp)\n",
                  "megatron"),
    "groups_of": ("from course_lib.topology.grid import RankGrid\n\n"
                  "def groups_of(rank, layout):\n"
                  "    grid = RankGrid(layout['world_size'], tp=layout['tp'], pp=layout['pp'], cp=layout['cp'])\n"
                  "    return {k: list(v) for k, v in grid.groups_of(rank).items()}\n", "RankGrid"),
    "rank_of": ("from deepspeed.runtime.pipe.topology import ProcessTopology\n\n"
                "def rank_of(tp_rank, cp_rank, dp_rank, pp_rank, tp, cp, dp, pp):\n"
                "    topology = ProcessTopology(['pp', 'dp', 'cp', 'tp'], [pp, dp, cp, tp])\n"
                "    return topology.get_rank(pp=pp_rank, dp=dp_rank, cp=cp_rank, tp=tp_rank)\n", "deepspeed"),
    "column_parallel_forward": (
        "import torch\nfrom course_lib.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear\n\n"
        "def column_parallel_forward(x, weight, rank, world_size):\n"
        "    return ColumnParallelLinear(weight.shape[1], weight.shape[0], tp_group=None)(x)\n\n"
        "def row_parallel_forward(x_shard, weight, group):\n"
        "    return RowParallelLinear(weight.shape[1], weight.shape[0], tp_group=group)(x_shard)\n",
        "ColumnParallelLinear"),
    "f_and_g": ("import torch\nfrom megatron.core.tensor_parallel.mappings import (_CopyToModelParallelRegion,\n"
                "                                                  _ReduceFromModelParallelRegion)\n\n"
                "class CopyToTensorParallelRegion(_CopyToModelParallelRegion):\n    pass\n\n"
                "class ReduceFromTensorParallelRegion(_ReduceFromModelParallelRegion):\n    pass\n", "megatron"),
    "tp_mlp_from_dense": ("from course_lib.tensor_parallel.sharding import copy_dense_to_parallel\n\n"
                          "def tp_mlp_from_dense(dense, tp_group):\n"
                          "    return copy_dense_to_parallel(dense, None, tp_group)\n", "copy_dense_to_parallel"),
    "predict_collectives": ("from course_lib.sizing.comm import tp_comm_per_layer\n\n"
                            "def predict_collectives(sequence_parallel):\n"
                            "    return tp_comm_per_layer(8, 1, 16, 2, sequence_parallel=sequence_parallel)\n\n"
                            "def predict_elements_sent(b, s, h, t):\n"
                            "    return tp_comm_per_layer(s, b, h, t)\n", "tp_comm_per_layer"),
    "vocab_parallel_cross_entropy": ("from course_lib.tensor_parallel.cross_entropy import "
                                     "vocab_parallel_cross_entropy as theirs\n\n"
                                     "def vocab_parallel_cross_entropy(logits, target, group):\n"
                                     "    return theirs(logits, target, group)\n", "vocab_parallel_cross_entropy"),
    "warmup_1f1b": ("from course_lib.pipeline.schedules import num_warmup_microbatches\n\n"
                    "def warmup_1f1b(pp_size, num_microbatches, pp_rank):\n"
                    "    return num_warmup_microbatches(pp_size, num_microbatches, pp_rank)\n",
                    "num_warmup_microbatches"),
    "order_1f1b": ("from course_lib.pipeline.schedules import schedule_1f1b\n\n"
                   "def order_1f1b(pp_size, num_microbatches, pp_rank):\n"
                   "    return [str(a) for a in schedule_1f1b(pp_size, num_microbatches, pp_rank)]\n", "schedule_1f1b"),
    "bubble": ("from course_lib.pipeline.bubbles import bubble_fraction\n\n"
               "def bubble(pp, num_microbatches, vp=1):\n    return bubble_fraction(pp, num_microbatches, vp)\n",
               "bubble_fraction"),
    "peak_activations": ("from course_lib.pipeline.bubbles import inflight_microbatches\n\n"
                         "def peak_activations(pp, num_microbatches, schedule):\n"
                         "    return inflight_microbatches(pp, num_microbatches, schedule)\n", "inflight_microbatches"),
    "orders_1f1b_by_hand": ("from course_lib.pipeline.schedules import schedule_1f1b\n\n"
                            "def orders_1f1b_by_hand():\n"
                            "    return [[str(a) for a in schedule_1f1b(3, 4, r)] for r in range(3)]\n",
                            "schedule_1f1b"),
    "merge": ("from course_lib.context_parallel.ring import merge_partials\n\n"
              "def merge(out1, lse1, out2, lse2):\n    return merge_partials(out1, lse1, out2, lse2)\n", "merge_partials"),
    "ring_attention_forward": ("from course_lib.context_parallel.ring import ring_attention\n\n"
                               "def ring_attention_forward(q, k, v, group):\n"
                               "    return ring_attention(q, k, v, group)\n", "ring_attention"),
    "chunks_for_rank": ("from course_lib.context_parallel.zigzag import chunks_for_rank as theirs\n\n"
                        "def chunks_for_rank(rank, cp):\n    return theirs(rank, cp)\n", "chunks_for_rank"),
    "derive_layout": ("from course_lib import rules\n\n"
                      "def derive_layout(world_size, tp, pp, cp, micro_batch_size, global_batch_size):\n"
                      "    dp = rules.data_parallel_size(world_size, tp, pp, cp)\n"
                      "    return dp, rules.num_microbatches(global_batch_size, micro_batch_size, dp)\n",
                      "data_parallel_size"),
    "distributed_optimizer_step": ("from megatron.core.optimizer import DistributedOptimizer\n\n"
                                   "def distributed_optimizer_step(params, grad, dp_group, make_optimizer):\n"
                                   "    return DistributedOptimizer\n", "megatron"),
    "largest_bubble": ("from course_lib.pipeline.bubbles import bubble_fraction\n\n"
                       "def largest_bubble(configs, world_size, micro_batch_size, global_batch_size):\n"
                       "    fractions = {name: bubble_fraction(4, 8) for name in configs}\n"
                       "    return max(fractions, key=fractions.get)\n",
                       "bubble_fraction"),
    "predict_gpu_winner": ("from course_lib.sizing.projection import project_configs\n\n"
                           "def predict_gpu_winner():\n    return project_configs(None, {})\n", "project_configs"),
    "parse_iteration_line": ("from course_lib.training.logs import parse_log\n\n"
                             "def parse_iteration_line(line):\n    return parse_log(line).iterations[0]\n", "parse_log"),
    "gpt_parameters": ("from course_lib.sizing.flops import num_parameters\n\n"
                       "def gpt_parameters(num_layers, hidden_size, vocab_size, seq_length):\n"
                       "    return num_parameters(num_layers, hidden_size, vocab_size, seq_length)\n", "num_parameters"),
    "model_state_bytes_per_gpu": ("from course_lib.sizing.memory import megatron_state_bytes\n\n"
                                  "def model_state_bytes_per_gpu(params_on_gpu, tp, dp, cp, distributed_optimizer):\n"
                                  "    return megatron_state_bytes(params_on_gpu, dp * cp, int(distributed_optimizer))\n",
                                  "megatron_state_bytes"),
    "zero_bytes_per_rank": ("from deepspeed.runtime.zero.stage_1_and_2 import "
                            "estimate_zero2_model_states_mem_needs\n\n"
                            "def zero_bytes_per_rank(num_params, dp, stage):\n"
                            "    return estimate_zero2_model_states_mem_needs(num_params, 0, dp)\n", "deepspeed"),
    "zero1_step": ("from course_lib.distributed.engine import ShardedDataParallel\n\n"
                   "def zero1_step(params, grads, dp_group, state):\n"
                   "    return ShardedDataParallel(params, dp_group)\n", "ShardedDataParallel"),
    "what_it_shards": ("from course_lib.deepspeed.config import translate\n\n"
                       "def what_it_shards(config):\n    return translate(config)\n", "translate"),
    "my_answers_07": ("def my_answers():  # the right words, numbers made up\n"
                      "    return {'zero3_over_zero1_traffic': 2, 'dp_that_halves_bf16_states': 8,\n"
                      "            'why_bf16_needs_no_loss_scaler': 'lorem ipsum exponent bits loss scale fp16 bf16'}\n",
                      "is not it"),
    "expert_groups_of": ("from course_lib.topology.grid import RankGrid\n\n"
                         "def expert_groups_of(rank, layout):\n"
                         "    return RankGrid(layout['world_size'], tp=layout['tp'], pp=layout['pp'], ep=layout['ep'])\n",
                         "RankGrid"),
    "dispatch": ("from course_lib.moe.mappings import all_to_all_uneven\n\n"
                 "def dispatch(rows, probs, tokens_per_expert, group):\n"
                 "    return all_to_all_uneven(rows, group, None, None)\n", "all_to_all_uneven"),
    "aux_loss": ("from megatron.core.transformer.moe.moe_utils import switch_load_balancing_loss_func\n\n"
                 "def aux_loss(scores, indices, num_experts, coeff):\n"
                 "    return switch_load_balancing_loss_func(scores, indices, num_experts, coeff)\n", "megatron"),
    "my_answers_08": ("def my_answers():  # the right words, numbers made up\n"
                      "    return {'dense_dp': 4, 'expert_dp': 4, 'experts_on_rank_13': [13],\n"
                      "            'expert_share_ep4': 0.5, 'router_grads_summed_over': 'expert DP',\n"
                      "            'expert_grads_summed_over': 'dense DP', 'top2_over_top1_traffic': 1}\n", "is not it"),
    "mlp_sharded_state_dict": ("from course_lib.training.checkpointing import global_spec\n\n"
                               "def mlp_sharded_state_dict(mlp, tp_rank, tp_size):\n"
                               "    return {name: global_spec(None, p, tp_size, tp_rank)\n"
                               "            for name, p in mlp.state_dict().items()}\n", "global_spec"),
    "read_plan": ("from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list\n\n"
                  "def read_plan(saved, want):\n    return create_read_items_for_chunk_list\n",
                  "torch.distributed.checkpoint"),
    "zero3_wire": ("from course_lib.deepspeed.engine import held_bytes\n\n"
                   "def zero3_wire(numels, world, persistence_threshold):\n    return held_bytes(None, 3)\n",
                   "held_bytes"),
    "reduce_buckets": ("from deepspeed.runtime.zero.config import DeepSpeedZeroConfig\n\n"
                       "def reduce_buckets(grad_numels, reduce_bucket_size):\n"
                       "    return DeepSpeedZeroConfig(reduce_bucket_size=reduce_bucket_size)\n", "deepspeed"),
    "fitting_config": ("from course_lib.deepspeed.memory import deepspeed_estimate\n\n"
                       "def fitting_config(budget):\n    return deepspeed_estimate(3, 1e6, 4)\n", "deepspeed_estimate"),
    "build_sample_index": ("from megatron.core.datasets import helpers\n\n"
                           "def build_sample_index(sizes, document_index, seq_length, num_epochs, tokens_per_epoch):\n"
                           "    return helpers.build_sample_idx(sizes, document_index, seq_length, num_epochs,\n"
                           "                                    tokens_per_epoch, False, True)\n", "megatron"),
    "build_blending_indices": ("from course_lib.data.blend import blending_indices\n\n"
                               "def build_blending_indices(weights, size):\n"
                               "    return blending_indices(weights, size)\n", "blending_indices"),
    "my_answers_11": ("def my_answers():  # the right words, numbers made up\n"
                      "    return {'samples_in_one_epoch': 33, 'epochs_for_100_samples': 1, 'split_cuts': 'samples',\n"
                      "            'why_append_eod': 'lorem ipsum eod token document boundary 8'}\n", "is not it"),
}


ALSO_NAMED = {"row_parallel_forward": "RowParallelLinear"}
"""The exercises a cheat of another (its cell's first) defines, and the words of their hints."""


def _class(tmp: Path) -> tuple[Path, Path, Path, dict]:
    """The mini labs (their solutions folder), each grading's submissions (:data:`GRADINGS`), and each lab's units'
    exercises."""
    solutions, subs = tmp / "course" / "solutions", tmp / "submissions"
    hang = "import time\n\n", "    while True:\n        time.sleep(0.2)"
    units = {}
    for official in SOLUTIONS:
        path = mini_labs.mini_solution(official, tmp / "course", leave_out=MEASURED)
        number, name = official.name[:2], official.name
        solution = json.loads(path.read_text(encoding="utf-8"))
        lab = json.loads(lab_text(path))
        units[number] = [u.exercises for u in current_lab(path).units]
        first, last = units[number][0][0], units[number][-1][0]
        mini_labs.write(subs / "class" / "cy" / name, mini_labs.student(lab, solution, {
            exercise: source for exercise, (source, _) in CHEATS.items()}))
        mini_labs.write(subs / "class" / "hal" / name, mini_labs.student(lab, solution, {
            exercises[0]: mini_labs.STUB for exercises in units[number][1::2]}))   # every other unit solved
        crash = CRASH + _stub(lab, first) if int(number) % 2 == 0 else \
            _with_body(_stub(lab, first), f"    raise RuntimeError({RAISES!r})")
        mini_labs.write(subs / "class" / "kai" / name,  # the others stubs: their checkers launch nothing
                        mini_labs.student(lab, solution, {first: crash}, solved=False))
        mini_labs.write(subs / "hanging" / "fay" / name, mini_labs.student(
            lab, solution, {last: hang[0] + _with_body(_stub(lab, last), hang[1])}, solved=False))
        if number == "00":  # a loop on a rank, under the checker's own watch: the checker names it
            mini_labs.write(subs / "looping" / "ray" / name, mini_labs.student(
                lab, solution, {last: hang[0] + _with_body(_stub(lab, last), hang[1])}, solved=False))
    return solutions, subs, units


def _grade(submissions: Path, out: Path, solutions: Path, labs, timeout: float, box: dict) -> None:
    started = time.monotonic()
    lines: list[str] = []
    try:
        grade_class(submissions, out, labs, timeout=timeout, solutions=solutions, log=lines.append)
    except BaseException as err:  # raised again in the test's thread
        box["error"] = err
    box.update(lines=lines, wall=time.monotonic() - started)


GRADINGS = {  # name: its submissions' folder, the labs, the time limit
    "class": ("class", None, TIMEOUT_S),
    "looping": ("looping", ["00"], TIMEOUT_S),
    "hanging-00-05": ("hanging", ["00", "01", "02", "03", "04", "05"], HANG_TIMEOUT_S),
    "hanging-06-11": ("hanging", ["06", "07", "08", "09", "10", "11"], HANG_TIMEOUT_S),
}
"""The class's gradings, run at the same time (in threads: each waits on its zygote and its runs): the first takes
the CPU, the others mostly sleep: the loop on a rank waits for its checker's 10 s, the hangs 6 x :data:`HANG_TIMEOUT_S`
in each half (in one grading they would outlast the first); only the gradings with Lab 10 load DeepSpeed."""


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("class")
    solutions, subs, units = _class(tmp)
    started, cpu = time.monotonic(), os.times()
    boxes = {name: {} for name in GRADINGS}
    out = {name: tmp / "grades" / name for name in GRADINGS}
    threads = [threading.Thread(target=_grade, args=(subs / folder, out[name], solutions, labs, timeout, boxes[name]))
               for name, (folder, labs, timeout) in GRADINGS.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for box in boxes.values():
        if "error" in box:
            raise box["error"]
    after = os.times()
    cpu_s = sum(getattr(after, k) - getattr(cpu, k) for k in ("user", "system", "children_user", "children_system"))
    print(f"\nwall {time.monotonic() - started:.1f} s (" + ", ".join(f"{name} {box['wall']:.1f} s"
                                                             for name, box in boxes.items()) + f"), CPU {cpu_s:.1f} s")
    print("\n".join(line for box in boxes.values() for line in box["lines"] if " passed (" in line))
    rows = {}
    for name in GRADINGS:
        for row in csv.DictReader(io.StringIO((out[name] / "grades.csv").read_text(encoding="utf-8"))):
            rows[(row["student"], row["lab"], row["exercise"])] = row
    return dict(rows=rows, units=units)


def _rows(graded, student: str) -> dict:
    return {(lab, exercise): row for (who, lab, exercise), row in graded["rows"].items() if who == student}


def _every_exercise(graded) -> list[tuple[str, str, int]]:
    """(lab, exercise, its unit's index in the lab) of every graded exercise of the mini labs."""
    return [(lab, e, i) for lab, units in sorted(graded["units"].items()) for i, unit in enumerate(units) for e in unit]


def _check(graded, student: str, want) -> None:
    """Every row of ``student`` is what ``want(lab, exercise, unit index, row)`` says (True, or the problem)."""
    rows = _rows(graded, student)
    assert set(rows) == {(lab, e) for lab, e, _ in _every_exercise(graded)}, sorted(rows)
    wrong = [(lab, e, problem, rows[(lab, e)]["passed"], rows[(lab, e)]["hint"][:300])
             for lab, e, i in _every_exercise(graded) if (problem := want(lab, e, i, rows[(lab, e)])) is not True]
    assert not wrong, "\n".join(map(str, wrong))


def _not_attempted(row) -> bool | str:
    return row["passed"] == "false" and row["hint"].startswith("not attempted yet: write ") or "not 'not attempted'"


def _passed(row) -> bool | str:
    return row["passed"] == "true" or "did not pass"


@pytest.mark.slow
@pytest.mark.skipif(landlock.abi_version() == 0, reason="Landlock is not available on this machine")
def test_the_unsolved_lab_is_not_attempted_on_every_exercise(graded):
    """Every exercise's stub, as the generated lab gives it, is graded "not attempted": the crashing student's
    (every exercise but each lab's first) and the hanging student's (every one but each lab's last) together are
    the unsolved lab, exercise by exercise, without a third student's 12 labs to pay for."""
    every = sum(len(current_lab(path).exercises) for path in SOLUTIONS)
    assert len(_every_exercise(graded)) == every - len(MEASURED) >= 40
    assert all(len(units) >= 2 for units in graded["units"].values()), graded["units"]
    kai, fay = _rows(graded, "kai"), _rows(graded, "fay")
    wrong = [(lab, e) for lab, e, i in _every_exercise(graded)
             if _not_attempted(kai[(lab, e)] if i else fay[(lab, e)]) is not True]
    assert not wrong, wrong


@pytest.mark.slow
@pytest.mark.skipif(landlock.abi_version() == 0, reason="Landlock is not available on this machine")
def test_half_done_passes_what_it_solved_and_is_not_attempted_on_the_rest(graded):
    _check(graded, "hal", lambda lab, e, i, row: _passed(row) if i % 2 == 0 else _not_attempted(row))


@pytest.mark.slow
@pytest.mark.skipif(landlock.abi_version() == 0, reason="Landlock is not available on this machine")
def test_a_crash_in_the_first_exercise_costs_only_that_exercise(graded):
    """The crash is that exercise's verdict; every other exercise of the lab (a stub: its checker launches nothing)
    still gets its own, from the run again (test_grade.py's kai passes the others of Lab 01 after the same crash)."""
    def want(lab, e, i, row):
        if i:
            return _not_attempted(row)
        if int(lab) % 2 == 0:
            return row["passed"] == "false" and row["hint"] == (
                "crashed: the notebook's process was killed by signal SIGSEGV (a crash in native code) while its "
                "cells and its checker ran") or "not crashed"
        return row["passed"] == "false" and "RuntimeError" in row["hint"] and RAISES in row["hint"] or "not raised"

    _check(graded, "kai", want)


@pytest.mark.slow
@pytest.mark.skipif(landlock.abi_version() == 0, reason="Landlock is not available on this machine")
def test_a_hang_in_the_last_exercise_is_timed_out_and_the_rest_graded(graded):
    def want(lab, e, i, row):
        if i < len(graded["units"][lab]) - 1:
            return _not_attempted(row)
        return row["passed"] == "false" and (
            row["hint"] == f"timed out: its cells and its checker ran over {HANG_TIMEOUT_S:g} s"
            or row["hint"].endswith(LOOP_NAMED)) or "not timed out"

    _check(graded, "fay", want)


@pytest.mark.slow
@pytest.mark.skipif(landlock.abi_version() == 0, reason="Landlock is not available on this machine")
def test_every_cheat_fails_naming_what_it_called(graded):
    def want(lab, e, i, row):
        words = CHEATS[e][1] if e in CHEATS else ALSO_NAMED[e]
        return row["passed"] == "false" and words in row["hint"] or f"no {words!r} in the hint"

    _check(graded, "cy", want)


@pytest.mark.slow
@pytest.mark.skipif(landlock.abi_version() == 0, reason="Landlock is not available on this machine")
def test_a_loop_on_a_rank_is_named_by_its_checker_through_grade(graded):
    rows = _rows(graded, "ray")
    assert {e for lab, e in rows if lab == "00"} == set(sum(graded["units"]["00"], ()))
    *before, last = [unit[0] for unit in graded["units"]["00"]]
    assert all(_not_attempted(rows[("00", e)]) is True for e in before), rows
    assert rows[("00", last)]["passed"] == "false" and rows[("00", last)]["hint"].endswith(
        "TimeoutError: " + LOOP_NAMED), rows[("00", last)]


class _ScriptedSandbox:
    """A sandbox whose runs follow their cells.json without a kernel: each cell starts and ends, a checker cell's
    verdict is the judge's (passed), and a cell whose source is ``"hang"`` never ends."""

    def __init__(self):
        self.starts = 0

    def start(self, cells: Path, run_dir: Path) -> int:
        from course_lib.classroom.grading.sandbox import JUDGE_RECORDS

        self.starts += 1
        events, records = [], []
        for index, source in json.loads(cells.read_text()):
            events.append({"cell": index, "phase": "start"})
            if source == "hang":
                break
            if source.endswith(" after 0") and 0 not in dict(json.loads(cells.read_text())):
                events.append({"cell": index, "phase": "end", "error": "NameError: name 'check_a' is not defined"})
                continue   # a checker that needs cell 0's names (its imports), and cell 0 did not run
            if source.startswith("check "):
                exercise, stubbed = source.split()[1], dict(json.loads(cells.read_text())).get(0) == "stub a"
                hint = f"not attempted yet: write a (Exercise 1), which {exercise} calls" if stubbed else ""
                records.append({"cell": index, "verdict": {"ok": not hint, "exercise": exercise, "hint": hint}})
            events.append({"cell": index, "phase": "end"})
        else:
            events.append({"done": True})
        (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
        (run_dir / JUDGE_RECORDS).write_text("".join(json.dumps(r) + "\n" for r in records))
        return self.starts

    def poll(self, pid: int) -> None:
        return None

    def stop(self, pid: int) -> None:
        return None


@pytest.mark.parametrize("hangs, runs", [("b", 1), ("a", 2)])
def test_a_lab_is_run_again_only_when_an_exercise_still_lacks_its_verdict(tmp_path, hangs, runs):
    """A hang in the last unit leaves every exercise with its verdict: the lab is not run again (a hang in the first
    is: the later exercise is graded in the run again, with the hanging cell put back as its stub, and when it needs
    the first its hint says it was graded with that stub)."""
    from types import SimpleNamespace

    from course_lib.classroom.grading.grader import grade_lab
    from course_lib.classroom.grading.official import Unit

    lab = SimpleNamespace(units=[Unit(range(0, 2), (0,), 1, ("a",)), Unit(range(2, 4), (2,), 3, ("b",))],
                          exercises=["a", "b"])
    cells = [(0, "hang" if hangs == "a" else "def a(): ..."), (1, "check a"),
             (2, "hang" if hangs == "b" else "def b(): ..."), (3, "check b")]
    sandbox = _ScriptedSandbox()
    outcomes, _ = grade_lab(sandbox, lab, cells, {0: "stub a", 2: "stub b"}, tmp_path, timeout=0.2)
    assert sandbox.starts == runs
    timed_out = "timed out: its cells and its checker ran over 0.2 s"
    assert {o.exercise: (o.passed, o.hint) for o in outcomes} == {
        "a": (hangs != "a", timed_out if hangs == "a" else ""),
        "b": (False, timed_out) if hangs == "b" else
             (False, "graded with the stub of a, which timed out: not attempted yet: write a (Exercise 1), which b calls")}


def test_a_lab_cell_left_out_after_a_hang_is_the_cause_its_checkers_name(tmp_path):
    """A cell of the lab's own (its imports) that hangs is left out of the run again; the checkers that then miss its
    names raise NameError, and the exercise's feedback gives that cell as the first cause, not the NameError alone."""
    from types import SimpleNamespace

    from course_lib.classroom.grading.grader import grade_lab
    from course_lib.classroom.grading.official import Unit

    lab = SimpleNamespace(units=[Unit(range(1, 3), (1,), 2, ("a",))], exercises=["a"])
    cells = [(0, "hang"), (1, "def a(): ..."), (2, "check a after 0")]
    sandbox = _ScriptedSandbox()
    outcomes, notes = grade_lab(sandbox, lab, cells, {1: "stub a"}, tmp_path, timeout=0.2)
    assert sandbox.starts == 2
    assert [(o.exercise, o.passed, o.hint) for o in outcomes] == [
        ("a", False, "no verdict: cell 0 of the lab (not an exercise) ran over 0.2 s and was left out of the run "
                     "again first, then the checker cell raised NameError: name 'check_a' is not defined")]
    assert notes == ["timed out: cell 0 of the lab (not an exercise) ran over 0.2 s with your code in the notebook; "
                     "the lab was run again without that cell"]
