"""The course against its Day 22 seed: every seed question has a cell that answers it (docs/seed_map.md),
the labels agree, each lab's part times add up to the README's time, and the two bubble conventions give
the thresholds the docs quote. Reads files only (well under a second)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from course_lib.classroom.notebooks.stamp import read_notebook
from course_lib.pipeline.bubbles import bubble_fraction, bubble_share
from course_lib.classroom.site import readme

ROOT = Path(__file__).resolve().parents[2]
SEED_MAP = ROOT / "docs" / "seed_map.md"
REQUIRED = [f"R{n}" for n in range(1, 7)] + [f"F{n}" for n in range(1, 6)] + [f"C{n}" for n in range(1, 11)]
# "R5 · 复盘问题 5", "F3 · 常见疑问 3": the seed's review questions and FAQ as the notebooks label them
LABEL = re.compile(r"\b([RF])(\d+) · (复盘问题|常见疑问) (\d+)")
KIND = {"R": "复盘问题", "F": "常见疑问"}


def _text(cell: dict) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


def map_rows() -> list[dict]:
    """The rows of the seed map: label, the file a row points to, and the anchor text of its cell."""
    rows = []
    for line in SEED_MAP.read_text(encoding="utf-8").splitlines():
        cells = readme.split_row(line) if line.startswith("| ") else []
        if len(cells) == 5 and re.fullmatch(r"[RFCS]\d+", cells[0]):
            link = re.fullmatch(r"\[[^\]]+\]\(\.\./([^)]+)\)", cells[3])
            anchor = re.fullmatch(r"`([^`]+)`", cells[4])
            assert link and anchor, f"docs/seed_map.md: a row must link its notebook and quote its cell: {line}"
            rows.append(dict(label=cells[0], path=ROOT / link.group(1), anchor=anchor.group(1), seed=cells[1]))
    return rows


def _places(path: Path) -> list[str]:
    """The texts a row may point at: a notebook's markdown cells, or a markdown file's lines."""
    if path.suffix == ".ipynb":
        return [_text(c) for c in read_notebook(path)["cells"] if c["cell_type"] == "markdown"]
    return path.read_text(encoding="utf-8").splitlines()


def test_every_seed_item_has_a_row_and_every_row_names_a_cell_that_exists():
    rows = map_rows()
    labels = [row["label"] for row in rows]
    assert [label for label in REQUIRED if label not in labels] == [], "seed items with no answer in the map"
    for label in dict.fromkeys(labels):
        first = next(row for row in rows if row["label"] == label)
        assert first["seed"], f"{label}: its first row quotes the seed's question"
    for row in rows:
        assert row["path"].is_file(), f"{row['label']}: {row['path']} does not exist"
        found = [text for text in _places(row["path"]) if row["anchor"] in text]
        assert found, f"{row['label']}: no cell of {row['path'].name} contains {row['anchor']!r}"


def test_the_seed_labels_in_the_notebooks_agree_with_the_map():
    """R5 means 复盘问题 5 wherever it is written, and each labelled cell is one the map points to."""
    mapped = {(row["label"], row["path"].name) for row in map_rows()}
    seen = 0
    for notebook in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb")):
        for text in _places(notebook):
            for kind, number, word, seed_number in LABEL.findall(text):
                assert (word, seed_number) == (KIND[kind], number), f"{notebook.name}: {kind}{number} · {word} {seed_number}"
                assert (f"{kind}{number}", notebook.name) in mapped, f"{notebook.name}: {kind}{number} is not in the map"
                seen += 1
    assert seen >= 8


def _budget_minutes(notebook: Path) -> list[int]:
    """The part times of a lab's **Time budget** paragraph (the last number of each '·'-separated part,
    parenthesised asides removed)."""
    for cell in read_notebook(notebook)["cells"]:
        for paragraph in _text(cell).split("\n\n") if cell["cell_type"] == "markdown" else []:
            if paragraph.startswith("**Time budget"):
                text = paragraph.replace("\n", " ")
                while re.search(r"\([^()]*\)", text):
                    text = re.sub(r"\([^()]*\)", "", text)
                return [int(re.findall(r"\d+", part)[-1]) for part in text.split("·")]
    raise AssertionError(f"{notebook.name}: no paragraph starting '**Time budget'")


def _readme_times() -> dict[str, float]:
    course_map = readme.section_table((ROOT / "README.md").read_text(encoding="utf-8"), "Course map")
    notebook, time = course_map.column("notebook", "README"), course_map.column("time", "README")
    return {readme.notebook_stem(row[notebook]): readme.hours(row[time]) for row in course_map.rows}


@pytest.mark.parametrize("stem, hours", sorted(_readme_times().items()))
def test_each_labs_part_times_add_up_to_the_readmes_time(stem, hours):
    parts = _budget_minutes(ROOT / "solutions" / f"{stem}.ipynb")
    assert len(parts) >= 3 and sum(parts) == round(hours * 60), \
        f"{stem}: parts {parts} = {sum(parts)} min, the README says {hours:g} h"


def test_the_two_bubble_conventions_give_the_thresholds_the_docs_quote():
    """PP=4, bubble <= 10%: the seed's (p-1)/(m+p-1) needs m >= 27, the course's (p-1)/m m >= 30."""
    seed = next(m for m in range(1, 100) if bubble_share(4, m) <= 0.10)
    course = next(m for m in range(1, 100) if bubble_fraction(4, m) <= 0.10)
    assert (seed, course) == (27, 30)
    assert 3 / (seed + 3) <= 0.10 < 3 / (seed + 2) and 3 / course <= 0.10 < 3 / (course - 1)  # by hand
    assert f"`m >= {seed}` in the seed's convention, `m >= {course}` in the course's" in SEED_MAP.read_text("utf-8")
    lab03 = read_notebook(ROOT / "solutions/03_pipeline.ipynb")
    printed = "".join("".join(o.get("text", "")) for c in lab03["cells"] for o in c.get("outputs", []))
    assert f"m >= {course} with the course's" in printed and f"m >= {seed} with the seed's" in printed
    glossary = readme.section_table((ROOT / "README.md").read_text(encoding="utf-8"), "Glossary")
    bubble = next(row for row in glossary.rows if row[0] == "pipeline bubble")
    assert "`bubble_fraction`" in bubble[2] and "`bubble_share`" in bubble[2] and "seed" in bubble[2]
