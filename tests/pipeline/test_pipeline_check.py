"""The schedule checker: accepts every built schedule, rejects broken ones with the reason."""

import pytest

from course_lib.pipeline.check import check_schedule, choose_p2p, comm_plan, simulate_p2p, Step
from course_lib.pipeline.schedules import build_schedule, from_orders


def all_built():
    for pp in (1, 2, 3, 4):
        for m in (1, 2, 3, 4, 5, 8):
            for name in ("gpipe", "1f1b", "zb-h1", "zb-h2"):
                yield build_schedule(name, pp, m)
            for vp in (2, 3):
                for group in range(pp, m + 1):
                    try:
                        yield build_schedule("interleaved", pp, m, vp, group)
                    except ValueError:
                        pass


def test_every_built_schedule_passes_and_picks_a_protocol():
    seen = {}
    for s in all_built():
        seen.setdefault((s.name, check_schedule(s)), 0)
        assert check_schedule(s, "prefetch") == "prefetch"
    assert ("1f1b", "batched") in seen and ("interleaved", "prefetch") in seen
    assert ("gpipe", "prefetch") not in seen and ("1f1b", "prefetch") not in seen


def test_megatron_pairing_is_needed_for_1f1b():
    """Plain blocking send/recv deadlocks 1F1B (gloo really does: see test_pipeline_executor)."""
    s = build_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError, match="deadlock with blocking send/recv: rank 0 waits to send the act "
                                         "of micro-batch 1"):
        check_schedule(s, "blocking")
    assert check_schedule(s, "batched") == "batched"
    assert check_schedule(build_schedule("gpipe", 4, 8), "blocking") == "blocking"


def test_interleaved_needs_receive_ahead():
    s = build_schedule("interleaved", 4, 8, 2)
    with pytest.raises(ValueError, match="deadlock with batched send/recv"):
        simulate_p2p(s, "batched")
    assert choose_p2p(s) == "prefetch"
    assert simulate_p2p(s, "prefetch") == 2 * 8 * (4 * 2 - 1)  # act + grad per boundary and micro-batch


def test_comm_plan_pairs_sends_with_next_receive():
    plan = comm_plan(build_schedule("1f1b", 2, 2), 0)
    text = [str(x) if not isinstance(x, Step) else
            "step(" + ",".join(f"send {m.kind}{m.microbatch}" for m in x.sends)
            + ";" + ",".join(f"recv {m.kind}{m.microbatch}" for m in x.recvs) + ")" for x in plan]
    assert text == ["F0", "step(send act0;)", "F1", "step(send act1;recv grad0)", "B0", "step(;recv grad1)", "B1"]


@pytest.mark.parametrize("orders, reason", [
    ([["F0", "B0"], ["F0"]], "rank 1 never runs B of micro-batch 0"),
    ([["F0", "F0", "B0"], ["F0", "B0"]], "runs F0 2 times"),
    ([["B0", "F0"], ["F0", "B0"]], "runs B0 before F0"),
    ([["F0", "B0", "W0"], ["F0", "B0"]], "never runs W"),
    ([["F0", "B0", "F1", "B1"], ["F1", "B1", "F0", "B0"]], "ranks wait for each other in a cycle"),
    ([["F0", "F1", "B1", "B0"], ["F0", "F1", "B0", "B1"]],
     "grad of micro-batch 0 .* receives the grad of micro-batch 1"),
    ([["F1", "F0", "B0", "B1"], ["F0", "F1", "B0", "B1"]], "matched out of order"),
    ([["F0", "B0", "F3"], ["F0", "B0"]], "never runs"),
])
def test_broken_schedules_are_rejected_with_the_reason(orders, reason):
    with pytest.raises(ValueError, match=reason) as err:
        check_schedule(from_orders(orders), "batched")
    assert "\n" not in str(err.value)


def test_bad_protocol_name():
    with pytest.raises(ValueError, match="p2p='mpi' is unknown"):
        check_schedule(build_schedule("1f1b", 2, 2), "mpi")
    with pytest.raises(ValueError, match="PipelineSchedule"):
        check_schedule([["F0", "B0"]])
