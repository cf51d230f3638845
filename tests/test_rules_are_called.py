"""Every layout rule is called from ``course_lib/rules.py``, never derived again elsewhere.

A lint over ``ast``, run it alone for the list: ``python tests/test_rules_are_called.py``. It flags,
outside the rule book:

* a divisibility test ``a % b`` between a size or count (``num_attention_heads``, ``world_size``,
  ``num_layers``, ``global_batch_size``, ...; or a ``rank``, whose coordinates are the rank grid's)
  and a parallel size (``tp``, ``cp``, ``tensor_model_parallel_size``, ``micro_batch_size``, ...),
  or any ``world % ...`` -- ring arithmetic such as ``(rank + 1) % world`` is not a rule and passes;
* a derived size ``a // b``: the data-parallel size (``world // (tp * pp * cp)``) or the
  micro-batch count (``global_batch_size // (micro * dp)``);
* a helper of its own that checks divisibility (``def divide``, ``def _divides``, ``def divisible...``).

Each is a rule of :mod:`course_lib.rules` (``data_parallel_size``, ``heads_divisible_by_tp``,
``num_microbatches``, ``tp_split``, ...) or a fact of :class:`course_lib.topology.RankGrid`.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "course_lib"
RULE_BOOK = PACKAGE / "rules.py"

# A parallel size (the divisor of a layout rule).
SIZE = re.compile(r"^(t|tp|pp|cp|dp|ep|vp|vpp|mp|etp|expert_tp|expert_dp|world|world_size|micro|mbs|micro_batch_size"
                  r"|(tp|pp|cp|dp|ep|vp)_size|\w+_parallel_size)$")
# A size or count that a layout rule divides (the dividend), or a rank (its coordinates are the grid's).
COUNT = re.compile(r"^(world|world_size|rank|num_attention_heads|heads|np_|ng|num_query_groups|num_layers|layers"
                   r"|num_experts|E|vocab_size|padded_vocab_size|num_embeddings|\w*global_batch_size|gbs)$")
WORLD = re.compile(r"^(world|world_size)$")
HELPER = re.compile(r"^_?(divide|divides|divisible\w*)$")

def _names(node: ast.AST) -> set[str]:
    """The identifiers an expression reads: names, attributes, string keys and string arguments."""
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            out.add(n.id)
        elif isinstance(n, ast.Attribute):
            out.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.isidentifier():
            out.add(n.value)         # cfg["world_size"], value("global_batch_size")
    return out


def _any(pattern: re.Pattern, node: ast.AST) -> bool:
    return any(pattern.match(n) for n in _names(node))


def _is_ring_step(node: ast.AST) -> bool:
    """``(rank ± k) % size``: the neighbour on a ring, index arithmetic rather than a rule."""
    return isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub))


def findings(path: Path, source: str | None = None) -> list[str]:
    """Every re-derived rule in one file, as ``file:line what``."""
    tree = ast.parse(path.read_text(encoding="utf-8") if source is None else source)
    where = path.relative_to(ROOT) if path.is_absolute() else path
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and HELPER.match(node.name):
            out.append(f"{where}:{node.lineno} def {node.name}: a divisibility helper of its own (call a rule)")
        if not isinstance(node, ast.BinOp):
            continue
        left, right, text = node.left, node.right, ast.unparse(node)
        if isinstance(node.op, ast.Mod):
            if isinstance(left, (ast.Constant, ast.JoinedStr)) or _is_ring_step(left):
                continue             # "%s" % x, (rank + 1) % world
            if (_any(COUNT, left) and _any(SIZE, right)) or _any(WORLD, left):
                out.append(f"{where}:{node.lineno} {text}: a layout rule derived again")
        elif isinstance(node.op, ast.FloorDiv):
            dividend = {n for n in _names(left) if WORLD.match(n) or n.endswith("global_batch_size") or n == "gbs"}
            if dividend and _any(SIZE, right):
                out.append(f"{where}:{node.lineno} {text}: a derived size (data-parallel size or micro-batch count)")
    return out


def re_derived_rules() -> list[str]:
    """Every finding in ``course_lib`` outside the rule book."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path != RULE_BOOK:
            out += findings(path)
    return out


def test_no_layout_rule_is_derived_outside_the_rule_book():
    found = re_derived_rules()
    assert not found, "call course_lib.rules instead:\n" + "\n".join(found)


def test_the_lint_sees_each_kind_of_re_derivation():
    """The patterns this wave removed are still caught (so the lint cannot pass by seeing nothing)."""
    cases = {
        "if num_attention_heads % tp:\n    pass": True,
        "dp = world_size // (tp * pp * cp)": True,
        "m = value('global_batch_size') // (b * cfg.dp)": True,
        "t = rank % tp\nc = (rank // tp) % cp": True,
        "ok = cfg['world_size'] % (model * cp)": True,
        "def _divides(a, b):\n    return b % a == 0": True,
        "nxt = ranks[(r + 1) % cp]": False,                 # the ring's neighbour
        "line = 'x=%d' % tp": False,
        "if iteration % args.log_interval == 0:\n    pass": False,
    }
    for source, flagged in cases.items():
        assert bool(findings(Path("example.py"), source)) is flagged, source


if __name__ == "__main__":
    found = re_derived_rules()
    print("\n".join(found) or "no layout rule derived outside course_lib/rules.py")
    sys.exit(1 if found else 0)
