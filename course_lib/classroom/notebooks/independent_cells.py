"""Which notebook cells no exercise depends on: the proof that lets a heavy cell be left out.

A heavy cell that does not depend on any exercise (Lab 05's megatron-core side-by-side) computes in a
lab exactly what it computes in the solution. Tagged ``labs-pass-skip`` in ``solutions/`` (the generator
copies the tag), it may be left out where only the exercises matter -- the ``labs/`` pass of ``make test``
(:mod:`.nbval_plugin`) and ``grade`` (:func:`course_lib.classroom.grading.official.graded_cells`) -- when
:func:`skip_problems` proves it independent of the exercises by its names: it reads no name that an
exercise cell, or a cell reading one, defines; and no later cell left to run reads a name it defines, so
the notebook still runs top to bottom without it. What a cell changes without assigning a name (a file it
writes, an object a method call changes, a module it imports into the kernel) is not seen by names: tag
only cells of which no later cell uses such a thing. A tagged cell that fails the proof simply runs.
"""

from __future__ import annotations

import ast

SKIP_TAG = "labs-pass-skip"
_EXERCISE_MARK = "### BEGIN SOLUTION"


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
    not be left out, the reason; an empty dict when every tagged cell may be. A code cell that does not parse
    (a student's half-written exercise) proves nothing: then every tagged cell runs."""
    code = [(i, c) for i, c in enumerate(cells) if c.get("cell_type") == "code"]
    skipped = {i for i, c in code if SKIP_TAG in c.get("metadata", {}).get("tags", [])}
    names = {}
    for i, c in code:
        try:
            names[i] = _names("".join(c["source"]) if isinstance(c["source"], list) else c["source"])
        except SyntaxError:
            return {j: f"cell {i} does not parse, so nothing it reads or defines is known" for j in skipped}
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
