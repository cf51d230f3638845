"""What autograd keeps for backward: every saved tensor, and the activation bytes behind them.

The one counter of activation memory in the course: the activation-memory
measurements of Lab 04 (:mod:`course_lib.activation_memory`) and the pipeline
executor's live-bytes figures (:mod:`course_lib.pipeline.executor`) both use it.

:class:`SavedTensorRecorder` sees every tensor autograd saves while a module runs,
through ``torch.autograd.graph.saved_tensors_hooks`` (the pack hook receives each
tensor as an op saves it), notes which submodule was running, and identifies the
*storage* behind it: q, k and v are three views of one fused QKV output, so they
cost one storage, not three. :func:`activation_storages` keeps the distinct
storages that are not parameters (a GEMM also saves its weight, which is not an
activation) and :func:`activation_bytes` adds up their bytes. Whether a tensor is a
parameter is decided when it is saved, against the storages the parameters have at
that moment: under ZeRO-3 (:mod:`course_lib.distributed`) a unit's weights live in a
gathered buffer only while the unit runs, and are released by the time the block ends.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

__all__ = ["SavedTensor", "SavedTensorRecorder", "record_saved_tensors", "activation_storages", "activation_bytes"]


@dataclass(frozen=True)
class SavedTensor:
    """One tensor autograd saved during the forward pass.

    ``module``: the innermost module running when it was saved ("(layer)" for the
    layer's own code, e.g. dropout; "(outside)" for code outside the module, e.g. a
    loss); ``producer``: the op that made the tensor (its ``grad_fn``, "-" when it has
    none: the layer input, masks, statistics); ``storage``: index of the storage behind
    it, in first-seen order (views of one tensor share it); ``storage_bytes``: that
    storage's size; ``parameter``: it is (a view of) a parameter, i.e. not an activation."""

    module: str
    producer: str
    shape: tuple
    dtype: str
    storage: int
    storage_bytes: int
    parameter: bool

    def as_dict(self) -> dict:
        return asdict(self)


class SavedTensorRecorder:
    """``with SavedTensorRecorder(module) as rec:`` records what autograd saves inside the block.

    After the block, ``rec.records`` is a list of :class:`SavedTensor` in the order they
    were saved. The saved tensors stay referenced until the block ends and their storages
    are numbered, so two live tensors never share a storage address by accident."""

    def __init__(self, module: nn.Module):
        self.module = module
        self.records: list[SavedTensor] = []
        self._stack: list[str] = []
        self._raw: list[tuple[str, torch.Tensor, bool, int]] = []
        self._params: list[torch.Tensor] = []
        self._params_key: list | None = None
        self._param_ptrs: set = set()
        self._handles: list = []
        self._hooks = None

    def _enter_module(self, name: str):
        def hook(_module, _args):
            self._stack.append(name or "(layer)")   # a pre-hook returning None leaves the inputs alone
        return hook

    def _leave_module(self, _module, _args, _output):
        self._stack.pop()                            # a hook returning None leaves the output alone

    def _param_storages(self) -> set:
        """The storage addresses of the module's parameters now, recomputed only when a parameter's data moved
        (ZeRO-3 gathers a layer's weights when it runs and releases them after): a pack hook runs for every saved
        tensor, and reading each parameter's storage object is several times dearer than its data pointer."""
        key = [(p.data_ptr(), p.numel()) for p in self._params]
        if key != self._params_key:
            self._params_key = key
            self._param_ptrs = {p.untyped_storage().data_ptr() for p in self._params if p.numel() > 0}
        return self._param_ptrs

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        # a parameter now, not at the block's end: ZeRO-3 releases its gathered weights by then
        # (and frees their storage, so its size is taken now too)
        storage = t.untyped_storage()
        is_param = t.numel() > 0 and storage.data_ptr() in self._param_storages()
        self._raw.append((self._stack[-1] if self._stack else "(outside)", t, is_param, storage.nbytes()))
        return t

    def __enter__(self) -> "SavedTensorRecorder":
        self._params = list(self.module.parameters())
        self._params_key = None
        for name, sub in self.module.named_modules():
            self._handles.append(sub.register_forward_pre_hook(self._enter_module(name)))
            self._handles.append(sub.register_forward_hook(self._leave_module))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        index: dict[int, int] = {}
        for where, t, is_param, nbytes in self._raw:
            ptr = t.untyped_storage().data_ptr()
            self.records.append(SavedTensor(
                module=where, producer=t.grad_fn.name() if t.grad_fn is not None else "-", shape=tuple(t.shape),
                dtype=str(t.dtype).replace("torch.", ""), storage=index.setdefault(ptr, len(index)),
                storage_bytes=nbytes, parameter=is_param))
        self._raw.clear()
        self._params = []


def record_saved_tensors(module: nn.Module, *args, **kwargs):
    """Run ``module(*args, **kwargs)`` and record every tensor autograd saves for backward.

    Returns ``(output, records)`` with ``records`` a list of :class:`SavedTensor` in
    the order they were saved (see :class:`SavedTensorRecorder`)."""
    with SavedTensorRecorder(module) as recorder:
        output = module(*args, **kwargs)
    return output, recorder.records


def activation_storages(records: list[SavedTensor]) -> list[dict]:
    """The distinct non-parameter storages, first-seen order: ``{storage, bytes, module, producer, shapes}``
    (``shapes``: the shapes of every saved view of it)."""
    out: dict[int, dict] = {}
    for r in records:
        if r.parameter:
            continue
        row = out.setdefault(r.storage, dict(storage=r.storage, bytes=r.storage_bytes, module=r.module,
                                              producer=r.producer, shapes=[]))
        if r.shape not in row["shapes"]:
            row["shapes"].append(r.shape)
    return list(out.values())


def activation_bytes(records: list[SavedTensor]) -> int:
    """Bytes one rank keeps for backward: each distinct non-parameter storage counted once."""
    return sum(row["bytes"] for row in activation_storages(records))
