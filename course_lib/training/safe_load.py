"""Reading a checkpoint someone else wrote without running it: pickles restricted to an allow-list.

A ``.pt`` file is a pickle, and a pickle names the functions to call while it is read: a crafted
``common.pt`` runs any code on ``torch.load(..., weights_only=False)``. Every file the course did not just
write in this process is read here instead, as megatron-core reads its own checkpoints
(``megatron/core/safe_globals.py``: ``torch.load(..., weights_only=True)`` with ``SAFE_GLOBALS`` registered):

* :func:`torch_load` -- ``weights_only=True`` with :data:`SAFE_GLOBALS`: megatron-core's allow-list (its
  standard-library and numpy classes always; its own enums and ``OptimizerConfig`` when a file names one and
  megatron-core is installed -- a file that needs them cannot be read without it anyway) plus the course's own types (none
  beyond those: the course saves dicts, numbers, strings, tensors, ``argparse.Namespace``, numpy's RNG state);
* :func:`read_dcp_metadata` -- DCP's ``.metadata`` (a plain pickle, which torch 2.13 reads with
  ``pickle.load``) read by an unpickler that builds only DCP's metadata classes, ``torch.Size`` and torch's
  dtypes (DCP reads the tensors of ``.distcp`` files with ``weights_only=True``); the reader DCP loads with
  is :class:`course_lib.training.dcp_io.SafeFileSystemReader`, which reads its metadata so. This module does
  not import ``torch.distributed.checkpoint`` (over a second per process): a run that never touches a
  checkpoint does not pay for it.

A file that names anything else is refused in one line naming the class (:class:`UnsafeCheckpointError`).
"""

from __future__ import annotations

import argparse
import functools
import io
import pathlib
import pickle
import re
import signal
import types

import numpy as np
import torch

from course_lib.rules import UsageError

__all__ = ["SAFE_GLOBALS", "UnsafeCheckpointError", "torch_load", "read_dcp_metadata", "megatron_core_globals"]


# megatron-core 0.16.1's SAFE_GLOBALS, its standard-library and numpy part: the same classes, named here so the
# course reads checkpoints without importing megatron-core (seconds); its own classes (enums, OptimizerConfig)
# join from megatron.core.safe_globals the first time a file names one (:func:`megatron_core_globals`)
SAFE_GLOBALS = [types.SimpleNamespace, pathlib.PosixPath, np.core.multiarray._reconstruct, np.ndarray, np.dtype,
                np.dtypes.UInt32DType, argparse.Namespace, io.BytesIO, signal.Signals]


@functools.cache
def megatron_core_globals() -> tuple:
    """megatron-core's own classes of its ``SAFE_GLOBALS``; none when it is not installed."""
    try:
        from megatron.core.safe_globals import SAFE_GLOBALS as MCORE
    except Exception:  # noqa: BLE001 -- not installed, or an import it cannot make on this machine
        return ()
    return tuple(cls for cls in MCORE if cls.__module__.startswith("megatron."))

# torch's weights-only unpickler names the global it refused in one of two phrasings
_UNSUPPORTED = re.compile(r"[Uu]nsupported (?:global: )?GLOBAL ([\w.]+)")


class UnsafeCheckpointError(UsageError):
    """A file whose pickle names a class or function outside the allow-list: not read."""


def _refuse(path, name: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"{path} needs {name}, outside the allow-list of what a checkpoint may hold (megatron-core's "
        f"safe_globals and the course's types): reading it could run code, so it was refused; load only "
        f"checkpoints saved by the course or by Megatron from runs you trust")


def torch_load(source, where=None):
    """``torch.load(source, map_location="cpu", weights_only=True)`` with :data:`SAFE_GLOBALS` allowed for
    this call only; ``where`` names ``source`` in the error (default: ``source`` itself).
    Raises :class:`UnsafeCheckpointError` for a pickle that names any other global; other errors propagate."""
    allowed = list(SAFE_GLOBALS)
    while True:
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(source, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            match = _UNSUPPORTED.search(str(exc))
            if match is None:       # not a global: a damaged file ("Unsupported operand 110"), said short
                reason = str(exc).partition("WeightsUnpickler error:")[2].strip().split("\n\n")[0]
                raise pickle.UnpicklingError(reason or str(exc)) from None
            if match.group(1).startswith("megatron.") and len(allowed) == len(SAFE_GLOBALS) and megatron_core_globals():
                allowed += megatron_core_globals()          # a Megatron checkpoint: read again with its classes
                if hasattr(source, "seek"):
                    source.seek(0)
                continue
            raise _refuse(where if where is not None else source, match.group(1)) from None


_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# megatron-core's own saves keep the save plans in the metadata (SavePlan, WriteItem, ...: dataclasses and enums)
_DCP_MODULES = (_DCP_METADATA, "torch.distributed.checkpoint.planner")
_OTHER_METADATA_GLOBALS = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("pathlib", "PosixPath"),
                           (pathlib.PosixPath.__module__, "PosixPath"),  # Python 3.13 pickles it as pathlib._local
                           ("torch.serialization", "_get_layout")}      # _get_layout: a layout by its name
_TORCH_NAMES = {"Size", "strided", "contiguous_format", "preserve_format", "channels_last", "sparse_coo"}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata dataclasses (``Metadata``, ``TensorStorageMetadata``, ``ChunkStorageMetadata``,
    ``_StorageInfo`` ...), ``torch.Size``, dtypes, layouts and memory formats; nothing else."""

    def __init__(self, file, where):
        super().__init__(file)
        self.where = where

    def find_class(self, module, name):
        found = getattr(__import__(module, fromlist=["_"]), name, None) if module in _DCP_MODULES else None
        allowed = ((isinstance(found, type) and found.__module__ in _DCP_MODULES)       # their classes, not functions
                   or (module, name) in _OTHER_METADATA_GLOBALS
                   or (module == "torch" and (name in _TORCH_NAMES or isinstance(getattr(torch, name, None), torch.dtype)))
                   or (module == "collections" and name == "OrderedDict"))
        if not allowed:
            raise _refuse(self.where, f"{module}.{name}")
        return super().find_class(module, name)


def read_dcp_metadata(path):
    """DCP's ``.metadata`` file at ``path``, read by the restricted unpickler."""
    with open(path, "rb") as f:
        return _MetadataUnpickler(f, path).load()
