"""The stamp a generated notebook carries, so that tools can prove it was never edited.

Every notebook the lab generator writes (``labs/NN_*.ipynb``) records, in its
notebook metadata, the SHA-256 of its own content::

    "metadata": {"course_lib": {"generated_sha256": "<hex>"}, ...}

The hash covers the whole notebook except that one entry, after joining cell
sources written as lists of lines (Jupyter's on-disk form) into strings, so
opening and saving a notebook without changing it keeps it provably untouched,
while any edit, run (outputs) or new cell breaks the proof. A stamped copy
keeps the stamp, so a copy in the student workspace is provably untouched too.

Tools replace a notebook only when :func:`is_untouched` proves it holds nothing
a person wrote; anything else (an edit, a notebook without a stamp, a file
that is not a notebook) is kept.
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Optional

from course_lib.safe_files import read_json
from course_lib.rules import UsageError

STAMP_KEY = "course_lib"
HASH_FIELD = "generated_sha256"


def dumps(notebook: dict) -> str:
    """Serialise like Jupyter does (1-space indent, sorted keys, trailing newline)."""
    return json.dumps(notebook, indent=1, sort_keys=True, ensure_ascii=False) + "\n"


def read_notebook(path: Path) -> dict:
    """The JSON object in ``path``; a one-line ``ValueError`` naming the file when it is not one
    (read by :func:`course_lib.safe_files.read_json`: bounded, no NaN, no duplicate keys)."""
    notebook = read_json(path)
    if not isinstance(notebook, dict):
        raise UsageError(f"{path}: a notebook is a JSON object with a 'cells' list, "
                         f"not a JSON {type(notebook).__name__}")
    return notebook


def content_hash(notebook: dict) -> str:
    """SHA-256 of the notebook's content, ignoring its stamp and how sources are split into lines."""
    canonical = copy.deepcopy(notebook)
    metadata = canonical.get("metadata")
    if isinstance(metadata, dict):
        metadata.pop(STAMP_KEY, None)
    for cell in canonical.get("cells", []) if isinstance(canonical.get("cells"), list) else []:
        if isinstance(cell, dict) and isinstance(cell.get("source"), list):
            cell["source"] = "".join(str(line) for line in cell["source"])
    text = json.dumps(canonical, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def stamped(notebook: dict) -> dict:
    """A copy of ``notebook`` carrying the hash of its own content."""
    out = copy.deepcopy(notebook)
    out.setdefault("metadata", {})[STAMP_KEY] = {HASH_FIELD: content_hash(notebook)}
    return out


def recorded_hash(notebook: dict) -> Optional[str]:
    """The hash the notebook's stamp records, or None when it has no stamp."""
    metadata = notebook.get("metadata")
    stamp = metadata.get(STAMP_KEY) if isinstance(metadata, dict) else None
    value = stamp.get(HASH_FIELD) if isinstance(stamp, dict) else None
    return value if isinstance(value, str) else None


def is_untouched(notebook: dict) -> bool:
    """True only when the notebook carries a stamp and its content still matches it."""
    recorded = recorded_hash(notebook)
    return recorded is not None and recorded == content_hash(notebook)


def version(notebook: dict) -> str:
    """Which generated notebook this is (or was copied from): its recorded hash, else its content hash."""
    return recorded_hash(notebook) or content_hash(notebook)


def read_if_notebook(path: Path) -> Optional[dict]:
    """The notebook in ``path``, or None when it cannot be read as one (such a file is never replaced)."""
    try:
        return read_notebook(path)
    except ValueError:
        return None
