"""Generate the student notebooks in ``labs/`` from the instructor notebooks in ``solutions/``.

``solutions/NN_topic.ipynb`` is the single source. In a code cell, exercise code
sits between a line ``### BEGIN SOLUTION`` and a line ``### END SOLUTION``
(nbgrader's convention). The student version replaces each block by a stub that
raises ``NotImplementedError``; a line ``### HINT: text`` inside the block becomes
the stub's message. Outputs are cleared and exercise cells are tagged
``raises-exception`` so ``pytest --nbval-lax labs/`` accepts the stub's error.

    python -m course_lib labs           # write labs/
    python -m course_lib labs --check   # exit 1 if labs/ differs from what solutions/ give
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

BEGIN, END, HINT = "### BEGIN SOLUTION", "### END SOLUTION", "### HINT:"
EXERCISE_TAGS = ("exercise", "raises-exception")
_DEFAULT_HINT = "replace this line with your solution"


def stub_source(source: str) -> tuple[str, int]:
    """Replace every solution block in ``source``; return (new source, number of blocks)."""
    out, block, indent, blocks = [], None, "", 0
    for number, line in enumerate(source.splitlines(keepends=True), 1):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if block is not None:
                raise ValueError(f"line {number}: {BEGIN} inside another solution block; close it with {END}")
            block, indent = [], line[: len(line) - len(line.lstrip())]
        elif stripped.startswith(END):
            if block is None:
                raise ValueError(f"line {number}: {END} without a matching {BEGIN}")
            hints = [b.strip()[len(HINT):].strip() for b in block if b.strip().startswith(HINT)]
            message = " ".join(hints) or _DEFAULT_HINT
            out.append(f"{indent}# YOUR CODE HERE\n")
            out.append(f"{indent}raise NotImplementedError({message!r})\n")
            block, blocks = None, blocks + 1
        elif block is not None:
            block.append(line)
        else:
            out.append(line)
    if block is not None:
        raise ValueError(f"{BEGIN} without a matching {END}")
    return "".join(out), blocks


def make_lab(solution: dict) -> dict:
    """The student notebook (a notebook dict) for one solution notebook dict."""
    lab = copy.deepcopy(solution)
    for cell in lab["cells"]:
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        new_source, blocks = stub_source(source)
        cell["source"] = new_source
        cell["outputs"] = []
        cell["execution_count"] = None
        tags = [t for t in cell.get("metadata", {}).get("tags", []) if t not in EXERCISE_TAGS]
        if blocks:
            tags = [*tags, *EXERCISE_TAGS]
        cell.setdefault("metadata", {})
        if tags:
            cell["metadata"]["tags"] = tags
        else:
            cell["metadata"].pop("tags", None)
        cell["metadata"].pop("execution", None)
    return lab


def dumps(notebook: dict) -> str:
    """Serialise like Jupyter does (1-space indent, sorted keys, trailing newline)."""
    return json.dumps(notebook, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def render_all(solutions_dir: Path, labs_dir: Path) -> dict[Path, str]:
    """Map each lab path to the text it should have."""
    return {labs_dir / src.name: dumps(make_lab(json.loads(src.read_text(encoding="utf-8"))))
            for src in sorted(solutions_dir.glob("[0-9][0-9]_*.ipynb"))}


def stale_labs(solutions_dir: Path, labs_dir: Path) -> list[str]:
    """Names of labs that are missing, out of date, or have no solution any more."""
    wanted = render_all(solutions_dir, labs_dir)
    stale = [p.name for p, text in wanted.items() if not p.exists() or p.read_text(encoding="utf-8") != text]
    stale += [p.name for p in labs_dir.glob("*.ipynb") if p not in wanted]
    return sorted(stale)


def add_arguments(parser) -> None:
    parser.add_argument("--solutions", default="solutions", type=Path, help="source folder (default: solutions)")
    parser.add_argument("--labs", default="labs", type=Path, help="output folder (default: labs)")
    parser.add_argument("--check", action="store_true", help="do not write; exit 1 when labs/ is stale")


def run(args) -> int:
    if args.check:
        stale = stale_labs(args.solutions, args.labs)
        if stale:
            print(f"labs/ is stale ({', '.join(stale)}): run `make labs`", file=sys.stderr)
            return 1
        print("labs/ is up to date")
        return 0
    args.labs.mkdir(parents=True, exist_ok=True)
    wanted = render_all(args.solutions, args.labs)
    for path, text in wanted.items():
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    for path in args.labs.glob("*.ipynb"):
        if path not in wanted:
            path.unlink()
            print(f"removed {path} (no solution notebook)")
    return 0
