"""The README's tables, read (never retyped) for the website's index: the course map and the glossary.

A table is GitHub markdown: a header row, a ``|---|`` separator row, then rows. A
section is found by its heading's text (``## Course map``); the first table after it
is the section's table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from course_lib.rules import UsageError

_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_SEPARATOR_CELL = re.compile(r"^:?-{3,}:?$")
_NOTEBOOK_LINK = re.compile(r"\[[^\]]*\]\((?:[^)]*/)?(\d\d_[\w.-]+)\.ipynb\)")
_HOURS = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(h|min)\s*$")


@dataclass(frozen=True)
class Table:
    """A markdown table: ``header`` cells and ``rows`` of cells (markdown text, stripped), and the
    ``heading`` it was found under."""

    header: list[str]
    rows: list[list[str]]
    heading: str = ""

    def column(self, name: str, where: str) -> int:
        """The index of the column named ``name``; a one-line ``ValueError`` naming ``where`` otherwise."""
        lowered = [cell.lower() for cell in self.header]
        if name not in lowered:
            raise UsageError(f"{where}: the table has no '{name}' column (columns: {', '.join(self.header)})")
        return lowered.index(name)

    def markdown(self) -> str:
        """The table as markdown again."""
        lines = [self.header, ["---"] * len(self.header), *self.rows]
        return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def split_row(line: str) -> list[str]:
    """The cells of one table row; ``\\|`` is a literal bar, and bars inside backticks do not split."""
    cells, current, in_code, i = [], "", False, 0
    body = line.strip()
    body = body[1:] if body.startswith("|") else body
    while i < len(body):
        char = body[i]
        if char == "\\" and body[i + 1:i + 2] == "|":
            current, i = current + "\\|", i + 2
            continue
        if char == "`":
            in_code = not in_code
        if char == "|" and not in_code:
            cells.append(current.strip())
            current = ""
        else:
            current += char
        i += 1
    if current.strip():
        cells.append(current.strip())
    return cells


def _is_separator(line: str) -> bool:
    cells = split_row(line)
    return bool(cells) and all(_SEPARATOR_CELL.match(cell) for cell in cells)


def section_table(readme: str, heading: str, where: str = "README.md") -> Table:
    """The first table under the heading whose text starts with ``heading``.

    A one-line ``ValueError`` naming ``where`` when the heading or its table is missing
    (before the next heading of the same or a higher level).
    """
    lines = readme.splitlines()
    start = level = found = None
    for number, line in enumerate(lines):
        match = _HEADING.match(line)
        if match and match.group(2).startswith(heading):
            start, level, found = number + 1, len(match.group(1)), match.group(2)
            break
    if start is None:
        raise UsageError(f"{where}: no heading '{heading}'; the site's index reads its table from there")
    for number in range(start, len(lines) - 1):
        match = _HEADING.match(lines[number])
        if match and len(match.group(1)) <= level:
            break
        if lines[number].lstrip().startswith("|") and _is_separator(lines[number + 1]):
            header, rows = split_row(lines[number]), []
            for line in lines[number + 2:]:
                if not line.lstrip().startswith("|"):
                    break
                rows.append(split_row(line))
            return Table(header, rows, found)
    raise UsageError(f"{where}: no table under the heading '{heading}'")


def title(readme: str, where: str = "README.md") -> str:
    """The text of the first level-1 heading."""
    for line in readme.splitlines():
        match = _HEADING.match(line)
        if match and len(match.group(1)) == 1:
            return match.group(2)
    raise UsageError(f"{where}: no '# title' line")


def notebook_stem(cell: str) -> str | None:
    """``00_collectives`` for a cell linking ``labs/00_collectives.ipynb``; None without such a link."""
    match = _NOTEBOOK_LINK.search(cell)
    return match.group(1) if match else None


def hours(cell: str) -> float | None:
    """``1 h`` -> 1.0, ``30 min`` -> 0.5; None for anything else."""
    match = _HOURS.match(cell)
    if not match:
        return None
    value = float(match.group(1))
    return value if match.group(2) == "h" else value / 60
