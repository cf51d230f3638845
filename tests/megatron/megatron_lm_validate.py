"""Run Megatron-LM's own ``parse_args`` + ``validate_args`` (``megatron/training/arguments.py`` of a checkout)
on commands ``megatron-cmd`` prints; used by ``test_megatron_lm_validates_every_command.py`` in a subprocess:

    python megatron_lm_validate.py CHECKOUT < commands.json     ->  {"command": "ok" | "error: ..." | "main only"}

arguments.py is loaded without its package ``__init__`` (which imports the trainer, and triton): the package
is a stand-in that holds ``global_vars``; a Megatron module whose import fails for want of triton (a GPU
kernel file) becomes a stand-in; ``regex`` is ``re`` (only imported); Python 3.11 gets 3.12's
``typing.override``. On CPU ``validate_args`` reads the GPU: an H100's properties are handed to it.
"""

import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import re
import shlex
import sys
import traceback
import types
import typing
import warnings
from unittest import mock


class _Anything(types.ModuleType):
    """A stand-in module: every attribute is another stand-in; a decorator returns its function."""
    __path__ = []

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(f"{self.__name__}.{name}")

    def __call__(self, *a, **k):
        return a[0] if len(a) == 1 and callable(a[0]) and not k else self


class _TritonFree(importlib.abc.MetaPathFinder):
    """A ``megatron.*`` module whose import fails for want of triton becomes a stand-in."""

    def find_spec(self, name, path, target=None):
        if not name.startswith("megatron."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        real = spec.loader

        class Loader(importlib.abc.Loader):
            def create_module(self, s):
                return real.create_module(s)

            def exec_module(self, module):
                try:
                    real.exec_module(module)
                except ModuleNotFoundError as exc:
                    if not (exc.name or "").startswith("triton"):
                        raise
                    module.__class__ = _Anything

        spec.loader = Loader()
        return spec


def load_arguments(root: str):
    """Megatron-LM's ``megatron/training/arguments.py`` of the checkout ``root``, as a module."""
    sys.modules.setdefault("regex", re)
    if not hasattr(typing, "override"):
        typing.override = lambda f: f
    sys.meta_path.insert(0, _TritonFree())
    sys.path.insert(0, root)
    import megatron

    megatron.__path__ = [os.path.join(root, "megatron")]
    pkg = types.ModuleType("megatron.training")
    pkg.__path__ = [os.path.join(root, "megatron", "training")]
    sys.modules["megatron.training"] = pkg
    global_vars = importlib.import_module("megatron.training.global_vars")
    for name in dir(global_vars):
        if name.startswith(("get_", "set_")):
            setattr(pkg, name, getattr(global_vars, name))
    pkg.print_rank_0 = print
    path = os.path.join(root, "megatron", "training", "arguments.py")
    spec = importlib.util.spec_from_file_location("megatron.training.arguments", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


H100 = types.SimpleNamespace(name="NVIDIA H100 80GB HBM3", major=9, minor=0, total_memory=80 * 2**30,
                             multi_processor_count=132)


def validate(arguments, command: str) -> str:
    """``"ok"`` or ``"error: <Megatron's reason>"`` for one printed command (its environment, its torchrun
    world size, then ``pretrain_gpt.py``'s flags)."""
    tokens = shlex.split(command.replace("\\\n", " "))
    start = tokens.index("torchrun")
    nodes = int(tokens[tokens.index("--nnodes") + 1]) if "--nnodes" in tokens else 1
    nproc = next(i for i, t in enumerate(tokens) if t in ("--nproc_per_node", "--nproc-per-node"))
    world = nodes * int(tokens[nproc + 1])
    flags = tokens[tokens.index("pretrain_gpt.py") + 1:]
    env = {k: v for k, _, v in (t.partition("=") for t in tokens[:start])}
    env.update(WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0")
    keep = {k: os.environ.pop(k) for k in ("CUDA_DEVICE_MAX_CONNECTIONS",) if k in os.environ}
    try:
        with mock.patch.dict(os.environ, env), mock.patch.object(sys, "argv", ["pretrain_gpt.py", *flags]), \
                mock.patch("torch.cuda.get_device_properties", return_value=H100), \
                mock.patch("torch.cuda.is_available", return_value=True), \
                mock.patch("torch.cuda.device_count", return_value=8), \
                mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
            args = arguments.parse_args()
            arguments.validate_args(args, {})
        return "ok"
    except SystemExit as exc:             # argparse: an unknown flag or a bad value
        return f"error: argparse exit {exc.code}"
    except Exception as exc:  # noqa: BLE001 -- Megatron's asserts and ValueErrors, said in one line
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        if not said:                      # a bare assert: its own source line says the rule
            said = (traceback.extract_tb(exc.__traceback__)[-1].line or "").strip()
        return f"error: {type(exc).__name__}: {said}"
    finally:
        os.environ.update(keep)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    root, request = sys.argv[1], json.load(sys.stdin)
    source = open(os.path.join(root, "megatron", "training", "arguments.py")).read()
    arguments = load_arguments(root)
    verdicts = {}
    with open(os.devnull, "w") as quiet:
        for command in request["commands"]:
            if any(flag not in source for flag in request["main_only"] if flag in command):
                verdicts[command] = "main only"
                continue
            out, sys.stdout = sys.stdout, quiet         # validate_args prints the arguments
            try:
                verdicts[command] = validate(arguments, command)
            finally:
                sys.stdout = out
    print(json.dumps(verdicts))
