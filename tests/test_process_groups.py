"""course_lib.process_groups: every group of a grid made once, each with a timeout, in Megatron's order."""

import datetime

import pytest
import torch.distributed as dist

from course_lib.launch import launch
from course_lib.process_groups import ProcessGroups, new_groups, new_process_groups
from course_lib.topology import RankGrid

FIELDS = {"tp": "tp", "cp": "cp", "pp": "pp", "dp_cp": "dp-cp", "model": "tp-pp", "embedding": "embedding"}


def _members(group):
    return None if group is None else dist.get_process_group_ranks(group)


def _rank_process_groups(made):
    grid = RankGrid(4, tp=2, cp=2)
    groups = new_process_groups(grid, timeout=42)
    try:
        new_groups(RankGrid(8, tp=2), ["tp"])
        wrong_world = "no error"
    except ValueError as exc:
        wrong_world = str(exc)
    return dict(made=made, is_groups=isinstance(groups, ProcessGroups), coords=groups.coords,
                members={name: _members(getattr(groups, name)) for name in FIELDS}, wrong_world=wrong_world)


def test_new_process_groups_makes_each_group_once_with_a_timeout(monkeypatch):
    made = []                      # filled in each forked rank (the patch is inherited by fork)
    real_new_group = dist.new_group

    def recording_new_group(ranks, timeout=None, **kwargs):
        made.append((list(ranks), timeout))
        return real_new_group(ranks, timeout=timeout, **kwargs)

    monkeypatch.setattr(dist, "new_group", recording_new_group)
    results = launch(_rank_process_groups, world_size=4, output="none", timeout=60, made=made)
    grid = RankGrid(4, tp=2, cp=2)
    every_list = {tuple(ranks) for token in FIELDS.values() for ranks in grid.groups(token)}
    for rank, res in enumerate(results):
        assert res["is_groups"] and res["coords"] == grid.coords(rank)
        assert res["members"] == {name: grid.group_of(rank, token) for name, token in FIELDS.items()}
        lists = [tuple(ranks) for ranks, _ in res["made"]]
        assert sorted(lists) == sorted(every_list)              # each distinct rank list once, on every rank
        assert {timeout for _, timeout in res["made"]} == {datetime.timedelta(seconds=42)}
        assert res["wrong_world"] == "the grid has world_size=8 but 4 ranks are running"


def test_groups_need_a_running_world():
    with pytest.raises(ValueError, match="torch.distributed is not initialised") as e:
        new_groups(RankGrid(2, tp=2), ["tp"])
    assert "\n" not in str(e.value)
