"""The house rules of ``course_lib``: rooms by concern, imports only downward, no cycles.

Run it alone for the picture: ``python tests/test_layout.py`` prints every module's layer and
every import that breaks a rule. Imports inside functions count (a lazy import is still a
dependency). The layers, lowest first -- a module may import its own layer and the ones below:

1. ``foundation``  the rule book and safe file writing (no torch, no course_lib imports)
2. ``launch``      running ranks: the process tree, the fork and torchrun launchers, the worker
3. ``core``        instrumented collectives (and Lab 00's six patterns), the rank grid and its process groups,
                   saved tensors
4. ``parallel``    TP, CP, PP, MoE, the sharding engine, optimizer, mixed precision, data
5. ``model``       the tiny GPT assembled from the parallel layers
6. ``sizing``      the arithmetic before a run (FLOPs, memory, communication, projections to GPUs) and
                   activation memory measured against it
7. ``training``    the trainer's parts: its flags and their checks, its log lines (Megatron's format),
                   gradient finalisation, the sharded steps, checkpoints
8. ``bridges``     Megatron-LM's command line and record table; DeepSpeed's config and engine
9. ``trainer``     the course trainer's loop and entry point (``course_lib.train``: it picks DeepSpeed's
                   engine when a ``--deepspeed-config`` is given)
10. ``runs``       what runs the trainer: megatron-core beside it, the Day 22 sweep
11. ``classroom``  the course machinery: checkers, notebooks, widgets, site, figures
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "course_lib"

LAYERS = {
    "foundation": ["rules", "safe_files"],
    "launch": ["launch"],
    "core": ["comm", "ring_cost", "communication_patterns", "collectives", "topology", "process_groups", "saved_tensors"],
    "parallel": ["tensor_parallel", "context_parallel", "pipeline", "moe", "distributed", "optimizer",
                 "mixed_precision", "data"],
    "model": ["model"],
    "sizing": ["sizing", "activation_memory"],
    "training": ["training"],
    "bridges": ["megatron", "deepspeed"],
    "trainer": ["train"],
    "runs": ["mcore", "sweep"],
    "classroom": ["classroom", "__main__", "__init__"],
}
RANK = {room: i for i, room in enumerate(LAYERS)}


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (a package's ``__init__`` is the package)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def layer_of(module: str) -> str:
    """The layer a module lives in, by its first name under ``course_lib``."""
    head = module.split(".")[1] if "." in module else "__init__"
    for room, heads in LAYERS.items():
        if head in heads:
            return room
    raise AssertionError(f"{module} is in no layer: add course_lib.{head} to LAYERS in tests/test_layout.py")


def imports(known: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {imported course_lib module: first line}, relative imports resolved, inside functions too."""
    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for module, path in known.items():
        base = module if path.name == "__init__.py" else module.rpartition(".")[0]
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                head = node.module or ""
                if node.level:
                    anchor = base
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    head = f"{anchor}.{head}" if head else anchor
                targets = [f"{head}.{alias.name}" for alias in node.names] + [head]
            else:
                continue
            for target in targets:
                if target == "course_lib" or target.startswith("course_lib."):
                    found = resolve(target)
                    if found and found != module and not module.startswith(found + "."):
                        edges.setdefault(found, node.lineno)
        graph[module] = edges
    return graph


def upward_imports(graph) -> list[str]:
    """Every import from a lower layer to a higher one, as ``file:line a (layer) -> b (layer)``."""
    known = modules()
    bad = []
    for module, edges in sorted(graph.items()):
        for target, line in sorted(edges.items()):
            if target == "course_lib":  # the package itself (its __version__): not a room
                continue
            if RANK[layer_of(target)] > RANK[layer_of(module)]:
                bad.append(f"{known[module].relative_to(ROOT)}:{line} {module} ({layer_of(module)}) imports "
                           f"{target} ({layer_of(target)})")
    return bad


def cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_every_module_is_in_a_layer():
    for module in modules():
        layer_of(module)


def test_no_import_runs_from_a_lower_layer_up():
    bad = upward_imports(imports(modules()))
    assert not bad, "imports that run upward:\n" + "\n".join(bad)


def test_no_import_cycles():
    found = cycles(imports(modules()))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_top_level_holds_only_the_library():
    """Course machinery lives under classroom/, the launcher under launch/ (a package)."""
    top = sorted(p.stem for p in PACKAGE.glob("*.py"))
    machinery = {"labgen", "workspace", "notebook_stamp", "notebook_figures", "nbval_labs", "figures",
                 "gpu_check", "magics", "torchrun_worker", "launch"}
    assert not machinery & set(top), f"course machinery at the top level: {sorted(machinery & set(top))}"


def readme_layers() -> dict[str, list[str]]:
    """The README's "where the code lives" picture, read back: layer -> the rooms its module column names.

    A layer's line is ``  N name  rooms  description``; continuation lines are indented to the rooms column,
    and a column ends at its first run of two spaces.
    """
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    block = readme.split("```\ncourse_lib/\n", 1)[1].split("```", 1)[0]
    layers: dict[str, list[str]] = {}
    current = None
    for line in block.splitlines():
        head = line[:17].split()
        if len(head) == 2 and head[0].isdigit():
            current = layers.setdefault(head[1], [])
        rooms = line[17:].split("  ", 1)[0]
        for room in rooms.split(","):
            if room.strip():
                current.append(room.strip().removesuffix("/").removesuffix(".py"))
    return layers


def test_the_readme_draws_these_layers():
    """The README's layer picture names the layers in this order, each with exactly its rooms."""
    drawn = readme_layers()
    assert list(drawn) == list(LAYERS), f"README layers {list(drawn)} != {list(LAYERS)}"
    for room, heads in LAYERS.items():
        assert sorted(drawn[room]) == sorted(heads), f"README layer {room}: {drawn[room]} != {heads}"


if __name__ == "__main__":
    graph = imports(modules())
    for room in LAYERS:
        print(f"{room}:", " ".join(sorted(m.removeprefix("course_lib.") for m in graph if layer_of(m) == room
                                          and m.count(".") <= 1)))
    for line in upward_imports(graph):
        print("upward:", line)
    for component in cycles(graph):
        print("cycle:", " <-> ".join(component))
