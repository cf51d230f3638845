"""Schedules as data equal Megatron-LM's orders (checked against an independent transcription).

The oracle below transcribes the *control flow* of Megatron-LM's
``megatron/core/pipeline_parallel/schedules.py`` (NVIDIA/Megatron-LM, read at
commit d98e8a64): the warm-up / steady / cool-down loops of
``forward_backward_pipelining_without_interleaving`` and
``forward_backward_pipelining_with_interleaving``, ``get_pp_rank_microbatches``,
``get_schedule_table``, the nested ``get_model_chunk_id`` and the per-chunk FIFO
``input_tensors[model_chunk_id].pop(0)`` that decides which micro-batch a
backward works on. It shares no code with ``course_lib.pipeline.schedules``.
"""

import pytest

from course_lib.pipeline.schedules import (Action, build_schedule, from_orders, get_schedule_table,
                                           interleaved_num_warmup, num_warmup_microbatches, parse_action,
                                           schedule_1f1b, schedule_gpipe, schedule_interleaved_1f1b,
                                           schedule_zero_bubble_h1, schedule_zero_bubble_h2)


class MegatronRuleError(Exception):
    """Megatron raises ValueError (group size) or RuntimeError (last group) here."""


def megatron_without_interleaving(pp, rank, m):
    """Transcription of forward_backward_pipelining_without_interleaving's loops."""
    num_warmup_microbatches = pp - rank - 1
    num_warmup_microbatches = min(num_warmup_microbatches, m)
    num_microbatches_remaining = m - num_warmup_microbatches
    order, output_tensors = [], []
    for i in range(num_warmup_microbatches):          # warm-up forwards
        order.append(f"F{i}")
        output_tensors.append(i)
    for i in range(num_microbatches_remaining):       # 1F1B steady state
        current = i + num_warmup_microbatches
        order.append(f"F{current}")
        output_tensors.append(current)
        order.append(f"B{output_tensors.pop(0)}")
    for i in range(num_warmup_microbatches):          # cool-down backwards
        order.append(f"B{output_tensors.pop(0)}")
    return order


def megatron_with_interleaving(pp, rank, m, vp, group=None):
    """Transcription of forward_backward_pipelining_with_interleaving's loops."""
    group = pp if group is None else group  # ModelParallelConfig.__post_init__ default
    if group > m or group < pp:
        raise MegatronRuleError("group size must be in [PP, M]")
    final_microbatch_group_size = m % group
    if 0 < final_microbatch_group_size < pp:
        raise MegatronRuleError("remainder must be 0 or >= PP")
    total_num_microbatches = m * vp
    # get_pp_rank_microbatches
    num_warmup_microbatches = (pp - rank - 1) * 2
    num_warmup_microbatches += (vp - 1) * group
    if num_warmup_microbatches >= total_num_microbatches:
        num_warmup_microbatches = total_num_microbatches
    num_microbatches_remaining = total_num_microbatches - num_warmup_microbatches
    # get_schedule_table
    schedule_table = []
    for min_id in range(0, m, group):
        if min_id + group >= m:
            schedule_table.extend([(mb, c) for c in range(vp) for mb in range(min_id, m)])
        else:
            schedule_table.extend([(mb, c) for c in range(vp) for mb in range(min_id, min_id + group)])
    microbatch_id_table, model_chunk_id_table = zip(*schedule_table)

    def get_model_chunk_id(virtual_microbatch_id, forward):
        model_chunk_id = model_chunk_id_table[virtual_microbatch_id % total_num_microbatches]
        if not forward:
            model_chunk_id = vp - model_chunk_id - 1
        return model_chunk_id

    output_tensors = [[] for _ in range(vp)]
    order = []

    def forward_step_helper(k):
        c = get_model_chunk_id(k, forward=True)
        mb = microbatch_id_table[k]
        output_tensors[c].append(mb)
        order.append(f"F{mb}.c{c}")

    def backward_step_helper(k):
        c = get_model_chunk_id(k, forward=False)
        order.append(f"B{output_tensors[c].pop(0)}.c{c}")

    for k in range(num_warmup_microbatches):
        forward_step_helper(k)
    for k in range(num_microbatches_remaining):
        forward_step_helper(k + num_warmup_microbatches)
        backward_step_helper(k)
    for k in range(num_microbatches_remaining, total_num_microbatches):
        backward_step_helper(k)
    return order


def strs(actions):
    return [str(a) for a in actions]


@pytest.mark.parametrize("pp", [1, 2, 3, 4, 8])
def test_1f1b_equals_megatron(pp):
    for m in range(1, 13):
        for rank in range(pp):
            assert strs(schedule_1f1b(pp, m, rank)) == megatron_without_interleaving(pp, rank, m), (pp, m, rank)


@pytest.mark.parametrize("pp", [2, 3, 4, 8])
@pytest.mark.parametrize("vp", [2, 3])
def test_interleaved_equals_megatron_or_both_refuse(pp, vp):
    compared = refused = 0
    for m in range(1, 13):
        for group in [None, *range(1, 14)]:
            try:
                want = [megatron_with_interleaving(pp, r, m, vp, group) for r in range(pp)]
            except MegatronRuleError:
                with pytest.raises(ValueError, match="microbatch_group_size_per_vp_stage"):
                    schedule_interleaved_1f1b(pp, m, 0, vp, group)
                refused += 1
                continue
            got = [strs(schedule_interleaved_1f1b(pp, m, r, vp, group)) for r in range(pp)]
            assert got == want, (pp, m, vp, group)
            assert strs(build_schedule("interleaved", pp, m, vp, group).ranks[0]) == want[0]
            compared += 1
    assert compared > 0 and refused > 0


def test_interleaved_grid_counts():
    """The grid really covers valid and invalid combinations (default group: m % pp == 0 only)."""
    valid_default = [(pp, m) for pp in (2, 3, 4, 8) for m in range(1, 13)
                     if m >= pp and m % pp == 0]
    for pp, m in valid_default:
        schedule_interleaved_1f1b(pp, m, 0, 2)
    for pp in (2, 3, 4, 8):
        for m in range(1, 13):
            if (pp, m) not in valid_default:
                with pytest.raises(ValueError):
                    schedule_interleaved_1f1b(pp, m, 0, 2)
    assert len(valid_default) == 6 + 4 + 3 + 1


def test_megatron_docstring_example():
    """ModelParallelConfig's own example: PP=2 VP=2, group 3, m=5: 0 1 2 0 1 2 3 4 3 4."""
    table = get_schedule_table(5, 2, 3)
    assert [mb for mb, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert [mb for mb, _ in get_schedule_table(4, 2, 2)] == [0, 1, 0, 1, 2, 3, 2, 3]


def test_warmup_counts():
    assert [num_warmup_microbatches(4, 8, r) for r in range(4)] == [3, 2, 1, 0]
    assert [num_warmup_microbatches(4, 2, r) for r in range(4)] == [2, 2, 1, 0]
    # interleaved: 2 (p - r - 1) + (vp - 1) * group, capped at m * vp
    assert [interleaved_num_warmup(4, 8, r, 2) for r in range(4)] == [10, 8, 6, 4]
    assert interleaved_num_warmup(2, 2, 0, 3) == 6


@pytest.mark.parametrize("bad, rule", [
    (dict(pp_size=4, num_microbatches=3, vp_size=2), "must be in \\[pp_size=4"),
    (dict(pp_size=4, num_microbatches=10, vp_size=2), "must be 0 or >= pp_size"),
    (dict(pp_size=4, num_microbatches=8, vp_size=1), "use schedule_1f1b"),
    (dict(pp_size=1, num_microbatches=8, vp_size=2), "pipeline-model-parallel-size >= 2"),
    (dict(pp_size=4, num_microbatches=8, vp_size=2, microbatch_group_size=3), "must be in"),
])
def test_interleaved_rules_are_one_line_value_errors(bad, rule):
    with pytest.raises(ValueError, match=rule) as err:
        schedule_interleaved_1f1b(pp_rank=0, **bad)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("call", [
    lambda: schedule_1f1b(0, 4, 0), lambda: schedule_1f1b(4, 0, 0), lambda: schedule_1f1b(4, 4, 4),
    lambda: schedule_gpipe(2, 2.0, 0), lambda: build_schedule("pipedream", 2, 2),
    lambda: build_schedule("1f1b", 2, 2, vp_size=2), lambda: parse_action("X3"), lambda: Action("Q", 1),
])
def test_bad_arguments_raise_value_error(call):
    with pytest.raises(ValueError):
        call()


def test_action_text():
    assert str(Action("F", 3)) == "F3" and str(Action("B", 3)) == "B3"
    assert str(Action("F", 3, 1)) == "F3.c1" and repr(Action("W", 0)) == "W0"
    assert parse_action("B12.c2") == Action("B", 12, 2) and parse_action(" F0 ") == Action("F", 0)
    assert from_orders([["F0", "B0"], ["F0", "B0"]]).ranks[1][1] == Action("B", 0)


def test_gpipe_and_1f1b_shapes():
    assert strs(schedule_gpipe(2, 3, 1)) == ["F0", "F1", "F2", "B0", "B1", "B2"]
    assert " ".join(strs(schedule_1f1b(4, 8, 0))) == "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert " ".join(strs(schedule_1f1b(4, 8, 3))) == "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"


def test_zero_bubble_h1_matches_the_paper_figure():
    """Qi et al. 2023, Fig. 3 top (p=4, m=8; the figure counts from 1)."""
    first = " ".join(strs(schedule_zero_bubble_h1(4, 8, 0)))
    assert first == ("F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7")
    last = " ".join(strs(schedule_zero_bubble_h1(4, 8, 3)))
    assert last == ("F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7")


def test_zero_bubble_h2_matches_the_paper_figure():
    """Qi et al. 2023, Fig. 3 bottom: device 1 runs 7 forwards before B1; device 4 defers W1 past B7."""
    first = strs(schedule_zero_bubble_h2(4, 8, 0))
    assert first[:10] == ["F0", "F1", "F2", "F3", "F4", "F5", "F6", "B0", "W0", "F7"]
    last = " ".join(strs(schedule_zero_bubble_h2(4, 8, 3)))
    assert last.startswith("F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 W0 F7 B7 W1")


def _torch_pipeline_order(cls, pp, m, vp):
    """torch.distributed.pipelining's order, computed without processes (private API: may move)."""
    sched = object.__new__(cls)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = pp, vp, m
    sched.number_of_rounds = max(1, m // pp)
    sched.microbatches_per_round = m // sched.number_of_rounds
    orders = []
    for rank in range(pp):
        ops = [a for a in sched._calculate_single_rank_operations(rank) if a is not None]
        kind = {"F": "F", "B": "B", "I": "B", "W": "W"}
        orders.append([f"{kind[a.computation_type.value]}{a.microbatch_index}"
                       + (f".c{a.stage_index // pp}" if vp > 1 else "") for a in ops])
    return orders


def test_cross_check_with_torch_pipelining():
    """torch's ScheduleInterleaved1F1B (m % pp == 0) and ZB1P (= ZB-H1) give the same orders."""
    try:
        from torch.distributed.pipelining.schedules import (ScheduleInterleaved1F1B,
                                                            ScheduleInterleavedZeroBubble)
        _torch_pipeline_order(ScheduleInterleaved1F1B, 2, 4, 2)
    except Exception as exc:  # noqa: BLE001 - private API of another project
        pytest.skip(f"torch's private schedule API changed: {exc}")
    for pp in (2, 4):
        for m in (pp, 2 * pp, 3 * pp):
            for vp in (2, 3):
                ours = [strs(a) for a in build_schedule("interleaved", pp, m, vp).ranks]
                assert ours == _torch_pipeline_order(ScheduleInterleaved1F1B, pp, m, vp), (pp, m, vp)
            ours = [strs(a) for a in build_schedule("zb-h1", pp, m).ranks]
            assert ours == _torch_pipeline_order(ScheduleInterleavedZeroBubble, pp, m, 1), (pp, m)
