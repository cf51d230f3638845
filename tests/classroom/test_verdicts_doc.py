"""docs/verdicts.md accounts for every exercise: one table row per exercise of the reference registry, under the
lab whose solution notebook defines it, and every test it names exists (file and function, read with ast).
Fast: reads files only, launches nothing."""

from __future__ import annotations

import ast
import json
import re
from collections import Counter
from pathlib import Path

from course_lib.classroom.checks.references import REFERENCES

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "verdicts.md"
# Exercise cells whose functions are not the registry's key (as tests/classroom/checks/test_proofs.py).
ALIASES = {"CopyToTensorParallelRegion": "f_and_g", "ReduceFromTensorParallelRegion": "f_and_g",
           "predict_elements_sent": "predict_collectives"}
_ROW = re.compile(r"^\|\s*`(\w+)`\s*\|")
_TEST = re.compile(r"(tests/[\w/]+\.py)::(\w+)")


def _rows_by_lab() -> dict[str, list[str]]:
    """``{lab: [exercise of each row under "## Lab NN"]}``."""
    rows: dict[str, list[str]] = {}
    lab = None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        heading = re.match(r"^## Lab (\d\d)\b", line)
        if heading:
            lab = heading.group(1)
        elif line.startswith("## "):
            lab = None
        match = _ROW.match(line)
        if match:
            assert lab is not None, f"a row outside a lab's section: {line[:80]}"
            rows.setdefault(lab, []).append(match.group(1))
    return rows


def _exercises_of(path: Path) -> set[str]:
    found = set()
    for cell in json.loads(path.read_text(encoding="utf-8"))["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "code" and "### BEGIN SOLUTION" in source:
            names = [ALIASES.get(n, n) for n in re.findall(r"^(?:def|class) (\w+)", source, re.M)]
            found |= {n for n in names if n in REFERENCES} or {f"my_answers_{path.name[:2]}"} & set(REFERENCES)
    return found


def test_every_exercise_has_exactly_one_row_under_its_lab():
    rows = _rows_by_lab()
    counts = Counter(name for names in rows.values() for name in names)
    assert set(counts) == set(REFERENCES), (set(REFERENCES) - set(counts), set(counts) - set(REFERENCES))
    assert [name for name, n in counts.items() if n != 1] == []
    labs = {path.name[:2]: _exercises_of(path) for path in sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))}
    assert {lab: set(names) for lab, names in rows.items()} == labs


def test_every_test_it_names_exists():
    named = set(_TEST.findall(DOC.read_text(encoding="utf-8")))
    assert len(named) >= len(REFERENCES)
    missing = []
    for file, function in sorted(named):
        path = ROOT / file
        if not path.is_file():
            missing.append(f"{file} (no such file)")
            continue
        defined = {node.name for node in ast.parse(path.read_text(encoding="utf-8")).body
                   if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
        if function not in defined:
            missing.append(f"{file}::{function}")
    assert missing == []


def test_each_row_names_the_libraries_its_exercise_refuses():
    """Every module of ``LIBRARIES[exercise]`` is named in the exercise's row (its last dotted part, in backticks:
    `megatron`, `deepspeed`, `planner_helpers`, `torch.distributed.tensor.experimental`): a library refused in
    the code and not in the doc, or the other way round, fails here."""
    from course_lib.classroom.checks.references import LIBRARIES

    rows = {m.group(1): line for line in DOC.read_text(encoding="utf-8").splitlines() if (m := _ROW.match(line))}
    unnamed = [(exercise, module) for exercise, modules in LIBRARIES.items() for module in modules
               if not re.search(rf"`[\w.]*\b{re.escape(module.rsplit('.', 1)[-1])}`", rows[exercise])]
    assert unnamed == []
    said, refusing = {e for e, line in rows.items() if "libs:" in line}, {e for e, mods in LIBRARIES.items() if mods}
    assert said == refusing, said ^ refusing


def test_grading_md_links_it():
    assert "(verdicts.md)" in (ROOT / "docs" / "grading.md").read_text(encoding="utf-8")
