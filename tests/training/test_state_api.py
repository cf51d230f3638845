"""State that saves itself (issue 35, item 3): checkpointing composes the optimizer's, the scheduler's
and the sharding engine's own ``state_dict``-style methods and never reaches inside them (nor do the set-up,
the trainer or DeepSpeed's engine reach a private attribute of another module); the engine imports no private
name of another module. Pure ``ast``: no ranks (the save/load round trips are
tests/training/test_checkpointing.py's)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# what checkpointing used to read inside the engine and the optimizer (buckets and their BucketState,
# the optimizer's id-keyed state): now the engine's full_optimizer_state/load_full_state and the
# optimizer's param_state/load_param_state/state_dict
ENGINE_INSIDES = {"buckets", "state", "param_shard", "param_full", "main", "lo", "hi"}
# the modules that build, save and load the run's state: none reaches a private attribute of another module's
# object; deepspeed/engine.py is held to that rule alone (it measures DeepSpeed's optimizer through its public fields,
# and its ``base.state`` is torch's Optimizer.state, not the course engine's)
STATE_MODULES = {
    "course_lib/training/checkpointing.py": ENGINE_INSIDES,
    "course_lib/training/setup.py": ENGINE_INSIDES,
    "course_lib/train.py": ENGINE_INSIDES,
    "course_lib/deepspeed/engine.py": frozenset(),
}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_reaches(path: str, insides=frozenset()) -> list[str]:
    """``line  what`` for each private name imported from another module, each private attribute of
    something other than ``self``/``cls`` (written ``x._y`` or ``getattr(x, "_y")``), and each attribute
    named in ``insides``."""
    found = []
    for node in ast.walk(ast.parse((ROOT / path).read_text())):
        if isinstance(node, ast.ImportFrom):
            found += [f"{node.lineno}  from {node.module} import {a.name}" for a in node.names if _private(a.name)]
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
              and (_private(node.args[1].value) or node.args[1].value in insides)
              and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))):
            found.append(f"{node.lineno}  {ast.unparse(node)}")
        elif isinstance(node, ast.Attribute):
            owner = node.value.id if isinstance(node.value, ast.Name) else None
            if owner in ("self", "cls"):
                continue
            if _private(node.attr) or node.attr in insides:
                found.append(f"{node.lineno}  {ast.unparse(node)}")
    return found


@pytest.mark.parametrize("path", STATE_MODULES)
def test_the_run_state_is_composed_and_never_reached_inside(path):
    """Checkpointing, the set-up that builds what it saves, the trainer and DeepSpeed's engine touch no
    private attribute of another module (and the first three none of the course engine's insides)."""
    found = private_reaches(path, STATE_MODULES[path])
    assert not found, f"{path}: use the owner's state methods:\n" + "\n".join(found)


def test_the_engine_imports_no_private_name():
    found = [line for line in private_reaches("course_lib/distributed/engine.py") if " import " in line]
    assert not found, "\n".join(found)


def test_the_scan_sees_a_reach(tmp_path, monkeypatch):
    import sys

    (tmp_path / "m.py").write_text("from course_lib.comm import _x\n"
                                   "def f(engine, self):\n    return engine.buckets, engine._pieces, self._ok\n"
                                   "def g(engine, self):\n    return getattr(engine, '_x'), getattr(self, '_ok'), "
                                   "getattr(engine, 'step')\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert sorted(line.split("  ")[1] for line in private_reaches("m.py", ENGINE_INSIDES)) == sorted([
        "from course_lib.comm import _x", "engine.buckets", "engine._pieces", "getattr(engine, '_x')"])


def test_checkpointing_sets_no_generator_itself():
    """The generators and the data position are their owners' state (RNGState, DataPosition):
    checkpointing calls neither ``random``/``np.random`` nor ``torch.set_rng_state`` itself."""
    tree = ast.parse((ROOT / "course_lib/training/checkpointing.py").read_text())
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    reached = sorted(c for c in calls if "rng_state" in c.lower() and not c.startswith("RNGState()")
                     or c.startswith(("random.", "np.random.", "torch.cuda.")))
    assert not reached, reached


def test_rng_state_round_trip():
    import random

    import numpy as np
    import torch

    from course_lib.training.rng_state import RNGState

    saved = RNGState().state_dict()
    assert {"random_rng_state", "np_rng_state", "torch_rng_state"} <= set(saved)   # Megatron's get_rng_state names
    first = (random.random(), float(np.random.rand()), torch.rand(3).tolist())
    RNGState().load_state_dict(saved)
    assert (random.random(), float(np.random.rand()), torch.rand(3).tolist()) == first


def test_data_position_round_trip_and_its_rule():
    import pytest

    from course_lib.data import DataPosition
    from course_lib.rules import UsageError

    at = DataPosition(16, 5 * 16)
    assert at.state_dict() == {"consumed_train_samples": 80} and at.iteration == 5
    resumed = DataPosition(16)
    resumed.load_state_dict({**at.state_dict(), "iteration": 5})     # common.pt holds more keys
    assert resumed.iteration == 5
    with pytest.raises(UsageError, match="--global-batch-size"):
        DataPosition(24).load_state_dict(at.state_dict())             # 80 is not a whole number of 24s


def test_the_seed_set_up_is_megatrons_offset_per_pipeline_stage():
    import torch

    from course_lib.training.rng_state import set_random_seed

    with torch.random.fork_rng(devices=[]):
        set_random_seed(1234, 2)
        drawn = torch.rand(4)
        torch.manual_seed(1234 + 100 * 2)              # Megatron's _set_random_seed: seed + 100 x PP rank
        assert torch.equal(drawn, torch.rand(4))
