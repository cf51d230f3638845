"""The inner loop's lists of long files (tests/conftest.py, the nbval plugin's LONGEST_FIRST) name files that exist:
a file moved or renamed would silently come back into ``make test-fast``, or lose its place at the front."""

from pathlib import Path

from conftest import INNER_LOOP_LEAVES_OUT

from course_lib.classroom.notebooks.nbval_plugin import LONGEST_FIRST

ROOT = Path(__file__).resolve().parents[1]


def test_every_long_file_listed_exists():
    assert [f for f in (*LONGEST_FIRST, *INNER_LOOP_LEAVES_OUT) if not (ROOT / f).is_file()] == []
    assert len(set(LONGEST_FIRST) | set(INNER_LOOP_LEAVES_OUT)) == len(LONGEST_FIRST) + len(INNER_LOOP_LEAVES_OUT)
