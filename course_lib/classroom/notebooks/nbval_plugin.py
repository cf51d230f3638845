"""A pytest plugin: one ``pytest --nbval`` run checks ``solutions/`` strictly and ``labs/`` laxly.

``make test`` runs the unit tests, the solution notebooks (every stored output must match) and
the student notebooks (they must run top to bottom with the exercises unsolved; their outputs
are not stored, so only cells marked ``# NBVAL_CHECK_OUTPUT`` are compared, as
``--nbval-lax`` would) in a single pytest session, so that ``pytest-xdist`` keeps both cores
busy across all three instead of idling at the end of each. Load it with
``pytest -p course_lib.classroom.notebooks.nbval_plugin``; notebooks in a folder named ``labs`` get the lax treatment.

``pytest-xdist --dist loadfile`` hands out whole files, by default the files with the most tests first. Test
count is not time: a file of one long test (grading every lab) handed out last leaves the other core idle for
its length. So this plugin hands out the files of :data:`LONGEST_FIRST` (measured) first, longest first, and
the others after them in collection order; and a worker that dies fails its file instead of hanging the
session (:mod:`.xdist_crash`, whose scheduler this plugin installs).

A heavy cell that does not depend on any exercise (Lab 05's megatron-core side-by-side) computes in a lab
exactly what it computes in the solution, which the strict pass has already run and compared. Tagged
``labs-pass-skip`` in ``solutions/`` (the generator copies the tag), it is skipped in the ``labs/`` pass
when :func:`skip_problems` proves it independent of the exercises by its names: it reads no name that an
exercise cell, or a cell reading one, defines; and no later cell left to run reads a name it defines, so
the lab still runs top to bottom without it. What a cell changes without assigning a name (a file it
writes, an object a method call changes, a module it imports into the kernel) is not seen by names: tag only
cells of which no later cell uses such a thing. A tagged cell that fails the proof simply runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from course_lib.classroom.notebooks.xdist_crash import pytest_handlecrashitem, pytest_xdist_make_scheduler  # noqa: F401

LAX_FOLDER = "labs"
SKIP_TAG = "labs-pass-skip"
_EXERCISE_MARK = "### BEGIN SOLUTION"


# The files that took 25 s or more in one `make test` session (junit times summed per file, -n 2 on 2 busy
# cores, 2026-12-04; DeepSpeed's op build and the labs/ cells now skipped left out), longest first. Only the
# order in which xdist hands out files depends on it: a stale list costs minutes, never a result.
LONGEST_FIRST = (
    "tests/test_train_moe.py",
    "tests/classroom/test_grade_every_lab.py",
    "solutions/05_3d_parallel_in_practice.ipynb",
    "tests/classroom/checks/test_lab00_checks.py",
    "tests/classroom/test_grade.py",
    "tests/test_train.py",
    "tests/sweep/test_sweep.py",
    "tests/launch/test_launch_cleanup.py",
    "solutions/00_collectives.ipynb",
    "labs/05_3d_parallel_in_practice.ipynb",
    "tests/launch/test_launch_deadline.py",
    "solutions/10_deepspeed.ipynb",
    "solutions/03_pipeline.ipynb",
    "tests/mcore/test_megatron_core_live.py",
    "labs/03_pipeline.ipynb",
    "labs/00_collectives.ipynb",
    "tests/sizing/test_projection.py",
    "tests/launch/test_launch.py",
    "tests/training/test_checkpointing.py",
    "tests/topology/test_topology.py",
    "tests/deepspeed/test_deepspeed_engine.py",
    "tests/classroom/test_gpu_check.py",
    "tests/classroom/checks/test_lab03_checks.py",
    "labs/11_data_pipeline.ipynb",
    "tests/classroom/test_site.py",
    "tests/classroom/checks/test_lab02_checks.py",
    "labs/09_checkpoints.ipynb",
    "solutions/09_checkpoints.ipynb",
    "solutions/02_tensor_parallel.ipynb",
    "labs/02_tensor_parallel.ipynb",
    "tests/moe/test_moe_model.py",
    "solutions/11_data_pipeline.ipynb",
)


def _is_lab_cell(item) -> bool:
    return hasattr(item, "cell") and isinstance(getattr(item, "options", None), dict) \
        and Path(str(item.fspath)).parent.name == LAX_FOLDER


def _bound(node) -> set[str]:
    """Every name ``node`` binds or changes in place (the base of an item or attribute it assigns), nested
    scopes included: an over-approximation of what running it defines."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load):
            out.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.ExceptHandler)) and n.name:
            out.add(n.name)
        elif isinstance(n, ast.alias):
            out.add((n.asname or n.name).split(".")[0])
        elif isinstance(n, (ast.Subscript, ast.Attribute)) and not isinstance(n.ctx, ast.Load):
            base = n.value
            while isinstance(base, (ast.Subscript, ast.Attribute)):
                base = base.value
            if isinstance(base, ast.Name):
                out.add(base.id)
    return out


def _free_reads(node, bound: frozenset = frozenset()) -> set[str]:
    """The names ``node`` reads that it has not bound first: a function's, lambda's or comprehension's own
    names, and a ``for`` target inside its loop, are its own; anything else loaded counts as read."""
    if isinstance(node, ast.Name):
        return {node.id} - bound if isinstance(node.ctx, ast.Load) else set()
    if isinstance(node, ast.Module):
        return _block(node.body, bound)
    if isinstance(node, ast.ExceptHandler) and node.name:
        bound = bound | {node.name}
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        inner = bound | {a.arg for a in ast.walk(node.args) if isinstance(a, ast.arg)}
        inner |= {n.id for b in (node.body if isinstance(node.body, list) else [node.body])
                  for n in ast.walk(b) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        outside = [*node.args.defaults, *node.args.kw_defaults, *getattr(node, "decorator_list", [])]
        body = node.body if isinstance(node.body, list) else [node.body]
        return set().union(*(_free_reads(d, bound) for d in outside if d is not None),
                           *(_free_reads(b, frozenset(inner)) for b in body))
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
        inner = bound | {n.id for g in node.generators for n in ast.walk(g.target) if isinstance(n, ast.Name)}
        return set().union(*(_free_reads(child, frozenset(inner)) for child in ast.iter_child_nodes(node)))
    if isinstance(node, (ast.For, ast.AsyncFor)):
        return _free_reads(node.iter, bound) | _block(node.body, bound | _bound(node.target)) \
            | _block(node.orelse, bound)
    blocks = [getattr(node, field) for field in ("body", "orelse", "finalbody")
              if isinstance(getattr(node, field, None), list)]
    rest = [child for child in ast.iter_child_nodes(node) if not any(child in b for b in blocks)]
    return set().union(*(_free_reads(child, bound) for child in rest), *(_block(b, bound) for b in blocks))


def _block(statements: list, bound) -> set[str]:
    """The free reads of a sequence of statements: a name an earlier statement surely bound (not one bound
    only inside an ``if``, loop or ``try``) is the block's own."""
    reads, seen = set(), set(bound)
    for statement in statements:
        reads |= _free_reads(statement, frozenset(seen))
        if not isinstance(statement, (ast.If, ast.For, ast.AsyncFor, ast.While, ast.Try, ast.Match)):
            seen |= _bound(statement)
    return reads


def _names(source: str) -> tuple[set[str], set[str]]:
    """(names the cell reads before binding them, names it binds or changes)."""
    from IPython.core.inputtransformer2 import TransformerManager

    tree = ast.parse(TransformerManager().transform_cell(source))
    return _free_reads(tree), _bound(tree)


def skip_problems(cells: list) -> dict[int, str]:
    """For each code cell tagged ``labs-pass-skip`` (index among ``cells``, a notebook's cell dicts) that may
    not be skipped in the labs pass, the reason; an empty dict when every tagged cell may be."""
    code = [(i, c) for i, c in enumerate(cells) if c.get("cell_type") == "code"]
    names = {i: _names("".join(c["source"]) if isinstance(c["source"], list) else c["source"]) for i, c in code}
    skipped = {i for i, c in code if SKIP_TAG in c.get("metadata", {}).get("tags", [])}
    problems = {}
    while True:                            # a tagged cell that must run is a later cell that runs
        found = _problems(code, names, skipped)
        if not found:
            return problems
        problems |= found
        skipped -= set(found)


def _problems(code: list, names: dict, tagged: set) -> dict[int, str]:
    problems, depends = {}, set()          # depends: names an exercise's result may reach
    for i, c in code:
        source = "".join(c["source"])
        reads, writes = names[i]
        exercise = _EXERCISE_MARK in source or "exercise" in c.get("metadata", {}).get("tags", [])
        if i in tagged:
            if exercise:
                problems[i] = "it is an exercise cell"
            elif reads & depends:
                problems[i] = f"it reads {sorted(reads & depends)}, which depend on an exercise"
            else:
                later = {n for j, _ in code if j > i and j not in tagged for n in names[j][0]}
                if writes & later:
                    problems[i] = f"it defines {sorted(writes & later)}, which a later cell that runs reads"
        if exercise or reads & depends:
            depends |= writes
    return problems


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):      # xdist: keep the order pytest_collection_modifyitems gives
        config.option.loadscopereorder = False
    try:
        from nbval.plugin import IPyNbFile
    except ImportError:
        return
    if not getattr(IPyNbFile.teardown, "graceful", False):
        IPyNbFile.teardown = _graceful_teardown(IPyNbFile.teardown)


def _graceful_teardown(teardown):
    """nbval ends a notebook's kernel with SIGKILL (``RunningKernel.stop``: ``shutdown_kernel(now=True)``), so
    the kernel's ``atexit`` handlers never run and what a lab made to last until its kernel ends (Lab 10's
    ``ds_configs_*``, Lab 11's ``lab11-*`` temporary folders) stays behind. Ask it to shut down first, as
    JupyterLab does (``shutdown_request``; jupyter_client sends SIGTERM, then SIGKILL, after
    ``shutdown_wait_time``); nbval's own teardown then finds it ended."""
    def graceful(self):
        kernel = self.kernel
        if kernel is not None and kernel.is_alive() and not getattr(self.config.option, "cov_source", None):
            kernel.kc.stop_channels()
            kernel.km.shutdown_kernel(now=False)
        teardown(self)

    graceful.graceful = True
    return graceful


def _longest_first(items) -> None:
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))     # stable: files stay whole


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    _longest_first(items)

    proofs = {}
    for item in items:
        if _is_lab_cell(item):
            item.options["check"] = "NBVAL_CHECK_OUTPUT" in "".join(item.cell.source)
            if SKIP_TAG in item.cell.get("metadata", {}).get("tags", []):
                path = str(item.fspath)
                if path not in proofs:
                    cells = item.parent.nb.cells
                    problems = skip_problems(cells)
                    proofs[path] = {id(c) for i, c in enumerate(cells) if i not in problems}
                item.options["skip"] = id(item.cell) in proofs[path]
