"""The simulator against the bubble formulas and against an independent longest-path oracle."""

import random
from functools import lru_cache

import pytest

from course_lib.pipeline.schedules import build_schedule, from_orders
from course_lib.pipeline.simulate import live_activations, simulate


def oracle_finish_times(schedule, tf, tb, tw, lat):
    """Finish time of every action as a longest path (written without the simulator's code).

    ``tf/tb/tw``: one value per virtual stage (chunk times already divided by vp).
    """
    p, S = schedule.pp_size, schedule.num_stages
    where = {}
    for r, acts in enumerate(schedule.ranks):
        for i, a in enumerate(acts):
            where[(a.kind, a.chunk_id * p + r, a.microbatch)] = (r, i)
    has_w = {(k[1], k[2]) for k in where if k[0] == "W"}

    @lru_cache(maxsize=None)
    def finish(r, i):
        a = schedule.ranks[r][i]
        s = a.chunk_id * p + r
        ready = finish(r, i - 1) if i else 0.0
        if a.kind == "F":
            dur = tf[s]
            if s > 0:
                ready = max(ready, finish(*where[("F", s - 1, a.microbatch)]) + lat)
        elif a.kind == "B":
            dur = tb[s] + (0.0 if (s, a.microbatch) in has_w else tw[s])
            if s < S - 1:
                ready = max(ready, finish(*where[("B", s + 1, a.microbatch)]) + lat)
            else:
                ready = max(ready, finish(*where[("F", s, a.microbatch)]))
        else:
            dur = tw[s]
            ready = max(ready, finish(*where[("B", s, a.microbatch)]))
        return ready + dur

    return [[finish(r, i) for i in range(len(acts))] for r, acts in enumerate(schedule.ranks)]


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_equal_times_give_p_minus_1_over_m_exactly(name):
    for p in range(1, 9):
        for m in range(1, 17):
            for tf, tb in ((1, 2), (1, 1), (3, 5)):
                tl = simulate(build_schedule(name, p, m), tf, tb)
                assert tl.bubble_fraction == (p - 1) / m, (p, m)
                assert tl.makespan == (m + p - 1) * (tf + tb)
                assert tl.bubble_share == pytest.approx((p - 1) / (m + p - 1), abs=1e-15)
                assert all(tl.idle(r) == (p - 1) * (tf + tb) for r in range(p))


def test_interleaved_gives_p_minus_1_over_vm():
    checked = 0
    for p in (2, 3, 4, 8):
        for vp in (2, 3, 4):
            for m in range(p, 17):
                for group in range(p, m + 1):
                    try:
                        s = build_schedule("interleaved", p, m, vp, group)
                    except ValueError:
                        continue
                    tl = simulate(s, 1.0, 2.0)
                    assert tl.bubble_fraction == pytest.approx((p - 1) / (vp * m), abs=1e-12), (p, vp, m, group)
                    checked += 1
    assert checked > 500


def test_simulator_equals_longest_path_oracle_with_uneven_times_and_latency():
    rng = random.Random(0)
    cases = [("gpipe", 3, 5, 1), ("1f1b", 4, 7, 1), ("1f1b", 1, 4, 1), ("zb-h1", 4, 8, 1), ("zb-h2", 3, 6, 1),
             ("interleaved", 2, 4, 2), ("interleaved", 3, 6, 3), ("interleaved", 4, 10, 2)]
    for name, p, m, vp in cases:
        group = 5 if (name, m) == ("interleaved", 10) else None
        s = build_schedule(name, p, m, vp, group)
        S = p * vp
        tf = [rng.uniform(0.5, 2) for _ in range(S)]
        tb = [rng.uniform(0.5, 3) for _ in range(S)]
        tw = [rng.uniform(0, 1) for _ in range(S)]
        lat = rng.uniform(0, 0.5)
        tl = simulate(s, tf, tb, tw, p2p_latency=lat)
        want = oracle_finish_times(s, tf, tb, tw, lat)
        for r in range(p):
            assert [e.end for e in tl.events[r]] == pytest.approx(want[r], abs=1e-9), (name, r)
        assert tl.makespan == pytest.approx(max(max(w) for w in want), abs=1e-9)


def test_per_rank_times_are_divided_among_chunks():
    s = build_schedule("interleaved", 2, 4, 2)
    a = simulate(s, [1.0, 2.0], [2.0, 4.0])
    b = simulate(s, [0.5, 1.0, 0.5, 1.0], [1.0, 2.0, 1.0, 2.0])
    assert a.makespan == b.makespan and a.busy(1) == 4 * (2 + 4)


def test_a_slow_stage_sets_the_pace():
    """1F1B with one stage k times slower: the steady state runs at the slow stage's speed."""
    p, m = 4, 16
    tf = [1, 1, 3, 1]
    tb = [2, 2, 6, 2]
    tl = simulate(build_schedule("1f1b", p, m), tf, tb)
    assert tl.makespan >= m * (3 + 6)
    assert tl.makespan == pytest.approx(oracle_finish_times(build_schedule("1f1b", p, m), tf, tb, [0] * 4, 0)
                                        [0][-1], abs=1e-9)


def test_peak_live_activations():
    assert simulate(build_schedule("1f1b", 4, 8)).peak_activations == [4, 3, 2, 1]
    assert simulate(build_schedule("gpipe", 4, 8)).peak_activations == [8] * 4
    assert simulate(build_schedule("1f1b", 4, 2)).peak_activations == [2, 2, 2, 1]
    assert live_activations(build_schedule("zb-h1", 2, 2).ranks[1]) == [1, 1, 2, 2, 1, 0]


def test_large_pipeline_runs():
    tl = simulate(build_schedule("1f1b", 16, 256), 1, 2)
    assert tl.bubble_fraction == 15 / 256 and len(tl.events[15]) == 512


@pytest.mark.parametrize("kwargs, rule", [
    (dict(t_f=-1), "negative"), (dict(t_f=[1, 2, 3]), "one per pipeline rank"), (dict(t_b="x"), "must be a number"),
    (dict(p2p_latency=-0.1), "p2p_latency"),
])
def test_bad_times(kwargs, rule):
    with pytest.raises(ValueError, match=rule):
        simulate(build_schedule("1f1b", 2, 2), **kwargs)


def test_impossible_order_is_reported():
    with pytest.raises(ValueError, match="cannot finish"):
        simulate(from_orders([["F0", "B0", "F1", "B1"], ["F1", "B1", "F0", "B0"]]))
