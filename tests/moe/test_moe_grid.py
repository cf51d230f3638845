"""The dense and expert grids of course_lib.topology.RankGrid against Megatron-core itself.

* every layout (tp, pp, cp, ep, expert_tp) of every world up to 16 ranks in 4 orders, and of
  24, 32, 48 and 64 ranks in Megatron's default order: the single-axis groups equal
  those of megatron-core's own ``RankGenerator`` built as ``initialize_model_parallel``
  builds them (dense: ep = 1; expert: cp = 1, expert dp = world / (expert_tp·ep·pp)), and a
  layout is refused exactly when Megatron refuses it (Megatron's generator takes ~1 ms a call
  at 64 ranks: every world to 64 in every order would take minutes);
* on small worlds, Megatron's real ``initialize_model_parallel`` (torch.distributed faked:
  ``create_group`` records the ranks it is given) builds exactly our groups and refuses
  exactly our refusals, every group it builds included (multi-axis ones too) -- which proves
  the acceptance rule the big sweep uses.

The megatron tests need the optional extra (``pip install .[megatron]``); skipped without it.
"""

import functools
import warnings
from unittest import mock

import pytest

from course_lib import rules
from course_lib.topology import EXPERT_TOKENS, MEGATRON_EXPERT_GROUPS, RankGrid
from course_lib.rules import divisors

# The dense test's orders (tests/topology/test_topology.py), with ep placed where Megatron's default has it.
ORDERS = ("tp-cp-ep-dp-pp", "tp-pp-ep-dp-cp", "tp-cp-pp-ep-dp", "pp-ep-dp-cp-tp")
BIG_WORLDS = (24, 32, 48, 64)
# Multi-axis groups come from the same function; Megatron's own function checks them below.
DENSE_TOKENS = ("tp", "cp", "dp", "pp")
SWEEP_EXPERT_TOKENS = ("tp", "ep", "dp", "pp")


@functools.lru_cache(maxsize=1)
def parallel_state():
    with warnings.catch_warnings():  # megatron-core warns that TE/Apex are absent on CPU
        warnings.simplefilter("ignore")
        return pytest.importorskip("megatron.core.parallel_state",
                                   reason="megatron-core is not installed (optional extra: pip install .[megatron])")


@functools.lru_cache(maxsize=None)
def megatron_ranks(tp, ep, dp, pp, cp, order, token):
    """megatron-core's RankGenerator(...).get_ranks(token), or the exception it raises."""
    try:
        return parallel_state().RankGenerator(tp=tp, ep=ep, dp=dp, pp=pp, cp=cp, order=order).get_ranks(token)
    except RuntimeError as e:  # an axis of size > 1 missing from order
        return e


def layouts(worlds):
    """Every (world, tp, pp, cp, ep, expert_tp) whose dense and expert products divide the world."""
    for world in worlds:
        for tp in divisors(world):
            for pp in divisors(world // tp):
                for cp in divisors(world // (tp * pp)):
                    for ep in divisors(world // pp):
                        for etp in divisors(world // (pp * ep)):
                            yield world, tp, pp, cp, ep, etp


def megatron_accepts(world, tp, pp, cp, ep, etp, order):
    """initialize_model_parallel's checks once both products divide the world (parallel_state.py:
    the two RankGenerators, 'order ends with pp or pp == 1 or equal dp', equal pp groups)."""
    dp, edp = world // (tp * pp * cp), world // (etp * ep * pp)
    dense_pp = megatron_ranks(tp, 1, dp, pp, cp, order, "pp")
    expert_pp = megatron_ranks(etp, ep, edp, pp, 1, order, "pp")
    if isinstance(dense_pp, Exception) or isinstance(expert_pp, Exception):
        return False
    return (order.endswith("pp") or pp == 1 or edp == dp) and dense_pp == expert_pp


@pytest.mark.parametrize("order, worlds", [(order, range(1, 17)) for order in ORDERS]
                         + [(ORDERS[0], BIG_WORLDS)])
def test_every_layout_equals_megatron_rank_generator(order, worlds):
    parallel_state()
    seen_dense, seen_expert, accepted = set(), set(), 0
    for world, tp, pp, cp, ep, etp in layouts(worlds):
        ok = megatron_accepts(world, tp, pp, cp, ep, etp, order)
        try:
            grid = RankGrid(world, tp=tp, pp=pp, cp=cp, ep=ep, expert_tp=etp, order=order)
        except ValueError:
            assert not ok, ("we refuse what Megatron accepts", world, tp, pp, cp, ep, etp, order)
            continue
        assert ok, ("we accept what Megatron refuses", world, tp, pp, cp, ep, etp, order)
        accepted += 1
        assert grid.dp == world // (tp * pp * cp)  # EP never shrinks the dense DP
        if (world, tp, pp, cp) not in seen_dense:
            seen_dense.add((world, tp, pp, cp))
            for token in DENSE_TOKENS:
                assert grid.groups(token) == megatron_ranks(tp, 1, grid.dp, pp, cp, order, token), \
                    (world, tp, pp, cp, order, token)
        if (world, etp, ep, pp) not in seen_expert:
            seen_expert.add((world, etp, ep, pp))
            for token in SWEEP_EXPERT_TOKENS:
                assert grid.expert_groups(token) == megatron_ranks(etp, ep, grid.expert_dp, pp, 1, order, token), \
                    (world, etp, ep, pp, order, token)
    assert accepted > 300 and len(seen_expert) > 100


def megatron_initialize(world, tp, pp, cp, ep, etp, order):
    """Megatron's real initialize_model_parallel for a world of ``world`` ranks, without
    torch.distributed: every group it creates is recorded by its description."""
    ps = parallel_state()
    made = {}

    def create_group(ranks=None, group_desc=None, **_):
        made.setdefault(group_desc, []).append(list(ranks))
        return object()

    dist = ps.torch.distributed
    with mock.patch.object(ps, "create_group", create_group), \
            mock.patch.object(dist, "is_initialized", lambda: True), \
            mock.patch.object(dist, "get_world_size", lambda group=None: world), \
            mock.patch.object(dist, "get_rank", lambda group=None: 0):
        try:
            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                expert_model_parallel_size=ep, expert_tensor_parallel_size=etp, order=order,
                create_gloo_process_groups=False)
        except (RuntimeError, AssertionError) as e:
            return e
        finally:
            ps.destroy_model_parallel()
    return made


MEGATRON_GROUP_OF = {  # group_desc -> (grid, token)
    "TENSOR_MODEL_PARALLEL_GROUP": ("dense", "tp"), "DATA_PARALLEL_GROUP": ("dense", "dp"),
    "DATA_PARALLEL_GROUP_WITH_CP": ("dense", "dp-cp"), "CONTEXT_PARALLEL_GROUP": ("dense", "cp"),
    "PIPELINE_MODEL_PARALLEL_GROUP": ("dense", "pp"), "MODEL_PARALLEL_GROUP": ("dense", "tp-pp"),
    "EXPERT_MODEL_PARALLEL_GROUP": ("expert", "ep"), "EXPERT_TENSOR_PARALLEL_GROUP": ("expert", "tp"),
    "EXPERT_DATA_PARALLEL_GROUP": ("expert", "dp"), "EXPERT_TENSOR_AND_MODEL_PARALLEL_GROUP": ("expert", "tp-ep"),
    "EXPERT_TENSOR_MODEL_PIPELINE_PARALLEL_GROUP": ("expert", "tp-ep-pp"),
}


def test_megatron_initialize_model_parallel_builds_our_groups_and_refuses_our_refusals():
    """The real function, on every layout of 8 ranks (divisible or not) in every order, and
    a few larger ones: same groups, same refusals -- the acceptance rule above is Megatron's."""
    cases = [(8, tp, pp, cp, ep, etp, order) for order in ORDERS
             for tp in (1, 2) for pp in (1, 2) for cp in (1, 2) for ep in (1, 2, 4) for etp in (1, 2)]
    cases += [(16, 2, 2, 2, 4, 1, "tp-cp-ep-dp-pp"), (32, 4, 2, 1, 8, 1, "tp-cp-ep-dp-pp"),
              (24, 2, 3, 2, 4, 2, "tp-cp-ep-dp-pp"), (16, 2, 2, 1, 2, 2, "tp-cp-pp-ep-dp")]
    refused = 0
    for world, tp, pp, cp, ep, etp, order in cases:
        made = megatron_initialize(world, tp, pp, cp, ep, etp, order)
        try:
            grid = RankGrid(world, tp=tp, pp=pp, cp=cp, ep=ep, expert_tp=etp, order=order)
        except ValueError as e:
            assert isinstance(made, Exception), (world, tp, pp, cp, ep, etp, order, str(e))
            refused += 1
            continue
        assert not isinstance(made, Exception), (world, tp, pp, cp, ep, etp, order, made)
        for desc, (which, token) in MEGATRON_GROUP_OF.items():
            ours = grid.groups(token) if which == "dense" else grid.expert_groups(token)
            assert made[desc] == ours, (world, tp, pp, cp, ep, etp, order, desc)
    assert 0 < refused < len(cases)


# --- pure checks (no megatron) ---------------------------------------------------------


def test_ep_does_not_shrink_dense_dp_and_cp_folds_into_expert_groups():
    g = RankGrid(8, tp=2, pp=2, ep=2, expert_tp=1)
    assert (g.dp, g.expert_dp) == (2, 2)
    assert g.groups("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]  # as if ep were 1
    assert g.expert_groups("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.local_experts(3, num_experts=8) == [4, 5, 6, 7]
    # TP2 × CP2 × EP2 on 8 ranks: expert TP = 2, EP over the CP ranks, expert DP 1
    g = RankGrid(8, tp=2, pp=2, cp=2, ep=2)
    out = {token: g.expert_groups(token) for token in EXPERT_TOKENS}
    assert out["ep"] == [[0, 2], [1, 3], [4, 6], [5, 7]] and out["dp"] == [[r] for r in range(8)]
    assert out["tp-ep-pp"] == [list(range(8))]
    # every expert group Megatron builds is one of ours, under the name of Megatron's global
    for desc, (which, token) in MEGATRON_GROUP_OF.items():
        if which == "expert":
            assert MEGATRON_EXPERT_GROUPS[token][0] == "_" + desc
    # EP4 with 4 ranks of dense DP: every rank is its own expert-DP group
    g = RankGrid(4, ep=4)
    assert g.dp == 4 and g.expert_dp == 1 and g.groups("dp") == [[0, 1, 2, 3]]


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=8, tp=2, pp=2, ep=4), r"expert-tensor-parallel-size=2 × expert-model-parallel-size=4 × "
                                           r"pipeline-model-parallel-size=2 = 16"),
    (dict(world_size=8, ep=3), r"expert-model-parallel-size=3 .* = 3; choose expert sizes"),
    (dict(world_size=8, expert_tp=0), r"expert-tensor-parallel-size=0 must be an integer >= 1"),
    (dict(world_size=8, tp=3), r"not divisible by tensor-model-parallel-size=3"),
    (dict(world_size=8, ep=2, order="tp-dp-pp"), r"'ep' is missing from order='tp-dp-pp'; add it"),
    (dict(world_size=8, tp=2, pp=2, cp=2, expert_tp=2, order="tp-cp-pp-ep-dp"), r"must be equal \(Megatron asserts it\)"),
    (dict(world_size=16, tp=2, pp=2, cp=2, ep=2, expert_tp=2, order="tp-cp-pp-ep-dp"),
     r"different pipeline groups"),
])
def test_refusals_are_one_line_and_name_the_flags(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        RankGrid(**kwargs)
    assert "\n" not in str(info.value)


def test_local_experts_refuses_experts_not_divisible_by_ep():
    with pytest.raises(ValueError, match=r"num-experts=6 is not divisible by expert-model-parallel-size=4") as e:
        RankGrid(4, ep=4).local_experts(0, 6)
    with pytest.raises(ValueError) as rule:
        rules.moe_experts(6, 4)
    assert str(e.value) == str(rule.value)  # the rule book's rule, one message


def test_expert_placement_says_who_holds_which_experts_and_where_the_all_to_all_runs():
    from course_lib.moe.plots import expert_placement, expert_placement_html

    # order tp-cp-ep-dp-pp, first axis fastest. expert TP 1: EP is the fastest axis, neighbours swap tokens.
    rows = expert_placement(RankGrid(8, tp=2, ep=2, expert_tp=1), num_experts=4)
    assert [r["ranks"] for r in rows] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(r["experts"] == [[0, 1], [2, 3]] for r in rows)
    # expert TP 2 (= tp): the TP pair 0,1 shares experts 0,1 (each a shard); EP strides over the TP pairs.
    rows = expert_placement(RankGrid(8, tp=2, ep=2), num_experts=4)
    assert [r["ranks"] for r in rows] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert rows[0]["experts"] == rows[1]["experts"] == [[0, 1], [2, 3]]
    html = expert_placement_html(RankGrid(8, tp=2, ep=2), 4)
    assert "<td>[0, 2]</td>" in html and "0: [0, 1] 2: [2, 3]" in html and "expert TP 2" in html
    with pytest.raises(ValueError, match="num-experts"):
        expert_placement(RankGrid(8, ep=4), num_experts=6)
