"""The second group of labs of ``test_grade_every_lab.py`` (its :data:`GROUPS`), in a file of its own so that
``make test``'s other worker grades it at the same time."""

from __future__ import annotations

import re

import pytest
import test_grade_every_lab as every  # this folder is on sys.path (no __init__.py): rootdir-relative import mode

from course_lib.classroom.grading import landlock


@pytest.mark.slow
@pytest.mark.skipif(landlock.abi_version() == 0, reason="Landlock is not available on this machine")
def test_the_solutions_of_the_other_labs_pass_every_exercise_in_the_sandbox(tmp_path):
    evidence, _ = every.grade_solutions(tmp_path, every.GROUPS[1])
    # a rank exercise's evidence is what ran on its ranks, not "0 calls"
    calls = re.match(r"(\d+) calls; ranks 4:", evidence["mlp_sharded_state_dict"])  # 8 per case the checker draws
    assert calls and int(calls.group(1)) % 8 == 0 < int(calls.group(1)), evidence["mlp_sharded_state_dict"]
    assert "ranks 2,3,4" in evidence["my_ring_all_reduce"]
