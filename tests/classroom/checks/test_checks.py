"""Every checker module reports an exercise that still raises NotImplementedError the same way."""

from course_lib.classroom.checks import call_student, not_attempted, rank_grid, try_student


def _todo(*args):
    raise NotImplementedError("write me")


def test_rank_grid_uses_the_shared_not_attempted_line(capsys):
    assert not rank_grid.check_derive_dp(_todo)
    assert not rank_grid.check_groups_of(_todo)
    assert not rank_grid.check_rank_of(_todo)
    names = ["derive_dp", "groups_of", "rank_of"]
    assert capsys.readouterr().out.splitlines() == [
        f"not attempted yet: write {name} above, then re-run this cell" for name in names]


def test_student_calls():
    assert call_student(len, [1, 2]) == (2, None) == try_student(len, [1, 2])
    assert call_student(_todo) == (None, "todo")
    assert call_student(int, "x")[1].startswith("ValueError: invalid literal")
    value, exc = try_student(_todo)
    assert value is None and isinstance(exc, NotImplementedError)
    assert not_attempted("f") is False
