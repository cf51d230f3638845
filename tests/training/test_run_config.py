"""One typed run config (issue 35, item 2): ``validate_args`` returns one frozen
:class:`~course_lib.training.run_config.RunConfig`, and below the entry point no module reads a flag
from an argparse namespace -- a flag such as ``--tensor-model-parallel-size`` reaches the layers
through the config only. Pure Python and ``ast``: no ranks."""

from __future__ import annotations

import ast
import dataclasses
import sys
from pathlib import Path

import pytest

from course_lib.train import parse_args, validate_args
from course_lib.training.run_config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
# the functions that take flags (a namespace) and turn them into the config: the trainer's entry points,
# and the DeepSpeed bridge's fold of a ds_config into the flags (called by validate_args)
ENTRY_POINTS = {"course_lib/train.py": {"validate_args", "pretrain", "train_single_process", "main", "run",
                                        "torchrun_argv", "add_arguments"},
                "course_lib/deepspeed/engine.py": {"apply_config", "_take"}}
# the modules of the loops below the entry point (their other functions included)
BELOW_ENTRY = ("course_lib/train.py", "course_lib/training/setup.py", "course_lib/training/checkpointing.py",
               "course_lib/training/state_sharding.py", "course_lib/training/evaluation.py",
               "course_lib/training/finalize_model_grads.py", "course_lib/data/source.py",
               "course_lib/deepspeed/engine.py")
FLAG_BAGS = {"args", "a"}          # the names a namespace of flags goes by in this code base


def _functions(tree: ast.Module):
    """Every top-level function and method of ``tree``, with its name."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node
        elif isinstance(node, ast.ClassDef):
            yield from (n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)))


def _flag_reads(path: str) -> list[str]:
    """``file:line  what`` for each flag read from a namespace outside an entry point: a parameter named
    ``args``/``a``, an attribute of one, or ``getattr(args, "x", default)``."""
    found = []
    tree = ast.parse((ROOT / path).read_text())
    for fn in _functions(tree):
        if fn.name in ENTRY_POINTS.get(path, ()):
            continue
        params = {a.arg for a in fn.args.args + fn.args.kwonlyargs + fn.args.posonlyargs}
        found += [f"{path}:{fn.lineno}  {fn.name}({name})" for name in sorted(params & FLAG_BAGS)]
        for node in ast.walk(fn):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in FLAG_BAGS:
                found.append(f"{path}:{node.lineno}  {node.value.id}.{node.attr}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                    and len(node.args) == 3 and isinstance(node.args[0], ast.Name) and node.args[0].id in FLAG_BAGS):
                found.append(f"{path}:{node.lineno}  getattr({node.args[0].id}, ..., default)")
    return found


def test_no_flag_is_read_from_a_namespace_below_the_entry_point():
    found = [line for path in BELOW_ENTRY for line in _flag_reads(path)]
    assert not found, "read the RunConfig instead:\n" + "\n".join(found)


def test_the_scan_sees_a_flag_read(tmp_path, monkeypatch):
    """The scan is not blind: a helper that reads ``args.x`` is reported (and an entry point is not)."""
    module = tmp_path / "course_lib" / "train.py"
    module.parent.mkdir()
    module.write_text("def helper(run, args):\n    return getattr(args, 'tp', 1) + args.seed\n\n"
                      "def main(args):\n    return args.seed\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert [line.split("  ")[1] for line in _flag_reads("course_lib/train.py")] == [
        "helper(args)", "getattr(args, ..., default)", "args.seed"]


def test_tensor_parallel_size_reaches_the_layout_and_the_vocabulary_through_the_config():
    run = validate_args(parse_args(["--tensor-model-parallel-size", "2", "--global-batch-size", "4"]), 4,
                        check_memory=False)
    assert isinstance(run, RunConfig)
    assert (run.parallel.tp, run.parallel.dp) == (2, 2)
    assert run.model.vocab_padding_tp == 2 and run.model.padded_vocab_size == 512   # 257 -> 128 x TP 2
    uniform = validate_args(parse_args(["--tensor-model-parallel-size", "2", "--uniform-vocab-padding"]), 4,
                            check_memory=False)
    assert uniform.model.vocab_padding_tp == 1 and uniform.model.padded_vocab_size == 384


def test_the_config_is_frozen_and_its_sections_too():
    run = validate_args(parse_args([]), 1, check_memory=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.parallel = None
    for field in dataclasses.fields(run):
        section = getattr(run, field.name)
        if dataclasses.is_dataclass(section):
            assert section.__dataclass_params__.frozen, field.name
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(section, dataclasses.fields(section)[0].name, None)


def test_the_bridges_get_the_flags_back():
    """The namespace at the edge (torchrun's command line, a DeepSpeed config) says what the config says."""
    from course_lib.train import args_to_argv

    run = validate_args(parse_args(["--tensor-model-parallel-size", "2", "--lr", "3e-3"]), 2, check_memory=False)
    again = validate_args(parse_args(args_to_argv(run.namespace())), 2, check_memory=False)
    same = [f.name for f in dataclasses.fields(run) if f.name not in ("parallel", "arguments")]
    assert [getattr(again, n) for n in same] == [getattr(run, n) for n in same]
    p, q = run.parallel, again.parallel      # --global-batch-size was derived, then given: the same layout
    assert ((q.tp, q.dp, q.effective_global_batch_size, q.num_microbatches)
            == (p.tp, p.dp, p.effective_global_batch_size, p.num_microbatches))
