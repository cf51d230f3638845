"""RankGrid against the real Megatron-LM: megatron-core's initialize_model_parallel
on 8 forked gloo ranks (CPU), several layouts, every group it builds.

Needs the optional extra: ``pip install .[megatron]`` (package megatron-core;
tested with 0.16.1 on torch 2.13 CPU). Skipped with a reason when it is missing.
"""

import warnings

import pytest

with warnings.catch_warnings():  # megatron-core warns that TE/Apex are absent on CPU
    warnings.simplefilter("ignore")
    parallel_state = pytest.importorskip(
        "megatron.core.parallel_state",
        reason="megatron-core is not installed (optional extra: pip install .[megatron])")

from course_lib.launch import launch  # noqa: E402
from course_lib.topology import ParallelConfig, RankGrid  # noqa: E402

# (tp, pp, cp, ep, order) on 8 ranks; ep > 1 exercises Megatron's separate expert grid.
LAYOUTS = [
    (2, 2, 1, 1, "tp-cp-ep-dp-pp"),  # the seed's 8 = 2 x 2 x 2
    (2, 2, 2, 1, "tp-cp-ep-dp-pp"),  # seed config F: TP2 x PP2 x CP2
    (2, 2, 1, 1, "tp-pp-dp"),        # Megatron's documented alternative order
    (1, 4, 1, 1, "tp-cp-ep-dp-pp"),  # config E
    (4, 1, 2, 1, "tp-cp-ep-dp-pp"),
    (1, 2, 1, 2, "tp-cp-ep-dp-pp"),  # MoE: expert-model-parallel 2
    (2, 2, 1, 2, "tp-cp-ep-dp-pp"),  # MoE on the seed's grid: dense DP stays 2 (EP does not shrink it)
    (2, 1, 2, 2, "tp-cp-ep-dp-pp"),  # CP and EP together: legal since MoE parallel folding
]


def _megatron_groups(layouts):
    """Runs on every rank: build Megatron's groups for each layout and report this
    rank's membership (global ranks in group order; None = not a member)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    def ranks(group):
        return None if group is None else dist.get_process_group_ranks(group)

    out = []
    for tp, pp, cp, ep, order in layouts:
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                     context_parallel_size=cp, expert_model_parallel_size=ep, order=order,
                                     create_gloo_process_groups=False)
        out.append({
            "tp": ranks(ps.get_tensor_model_parallel_group()),
            "pp": ranks(ps.get_pipeline_model_parallel_group()),
            "dp": ranks(ps.get_data_parallel_group()),
            "dp-cp": ranks(ps.get_data_parallel_group(with_context_parallel=True)),
            "cp": ranks(ps.get_context_parallel_group()),
            "tp-pp": ranks(ps.get_model_parallel_group()),
            "tp-cp": ranks(ps.get_tensor_and_context_parallel_group()),
            "tp-dp": ranks(ps.get_tensor_and_data_parallel_group()),
            "tp-dp-cp": ranks(ps.get_tensor_and_data_parallel_group(with_context_parallel=True)),
            # (not ps._EMBEDDING_GLOBAL_RANKS: destroy_model_parallel leaves it stale)
            "embedding": ranks(ps.get_embedding_group(check_initialized=False)),
            "position_embedding": ranks(ps.get_position_embedding_group(check_initialized=False)),
            "expert:ep": ranks(ps.get_expert_model_parallel_group()),
            "expert:tp": ranks(ps.get_expert_tensor_parallel_group()),
            "expert:dp": ranks(ps.get_expert_data_parallel_group()),
        })
        ps.destroy_model_parallel()
    # A rank that returned at once could close its sockets while a peer is still
    # connecting the last group: meet everyone first.
    dist.barrier()
    return out


def test_rank_grid_equals_megatron_initialize_model_parallel():
    per_rank = launch(_megatron_groups, world_size=8, backend="gloo", timeout=120, output="none",
                      layouts=LAYOUTS)
    for i, (tp, pp, cp, ep, order) in enumerate(LAYOUTS):
        grid = RankGrid(8, tp=tp, pp=pp, cp=cp, ep=ep, order=order)  # dense (ep folded away) + expert grid
        for rank in range(8):
            got = per_rank[rank][i]
            for token, theirs in got.items():
                if token.startswith("expert:"):
                    assert grid.expert_group_of(rank, token.split(":")[1]) == theirs, (LAYOUTS[i], rank, token)
                else:
                    assert grid.group_of(rank, token) == theirs, (LAYOUTS[i], rank, token)
    # the seed's groups, straight from Megatron
    first = [per_rank[r][0] for r in range(8)]
    assert sorted({tuple(g["tp"]) for g in first}) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert sorted({tuple(g["pp"]) for g in first}) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert sorted({tuple(g["dp"]) for g in first}) == [(0, 2), (1, 3), (4, 6), (5, 7)]


def test_megatron_rejects_what_parallel_config_rejects():
    """pp > 1 and cp > 1 with an order not ending in pp: Megatron asserts, we raise."""

    def try_bad_order():
        from megatron.core import parallel_state as ps
        try:
            ps.initialize_model_parallel(tensor_model_parallel_size=2, pipeline_model_parallel_size=2,
                                         context_parallel_size=2, order="tp-cp-pp-dp",
                                         create_gloo_process_groups=False)
        except AssertionError:
            return "rejected"
        ps.destroy_model_parallel()
        return "accepted"

    assert set(launch(try_bad_order, world_size=8, backend="gloo", timeout=60, output="none")) == {"rejected"}
    with pytest.raises(ValueError, match="must end with 'pp'"):
        ParallelConfig(8, tp=2, pp=2, cp=2, order="tp-cp-pp-dp")
