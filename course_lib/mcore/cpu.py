"""A shim: megatron-core 0.16.1 on CPU gloo ranks, so that the course can run the real thing beside its own.

Used by :mod:`course_lib.mcore.reference` (Lab 05 trains megatron-core's GPT next to the
course trainer), by ``tests/mcore/test_megatron_core_live.py`` and ``tests/distributed/test_bucket_layout.py``.
Nothing of the parallelism library imports it; it imports megatron-core only when entered.

megatron-core is written for CUDA: it allocates with ``device=torch.cuda.current_device()`` or
``device="cuda"``, calls ``.cuda()``, synchronises streams, records events, keeps its dropout RNG in
the CUDA generator. None of it is arithmetic: inside :func:`megatron_core_on_cpu` those calls land
on the CPU and the numbers are megatron-core's own.

* a :class:`~torch.overrides.TorchFunctionMode` rewrites every ``device=`` that names CUDA (``"cuda"``,
  ``"cuda:0"``, ``torch.device("cuda")``, a bare GPU index) to ``"cpu"``, turns ``.cuda()`` into a
  no-op and ``.to("cuda")`` into ``.to("cpu")``, ``pin_memory()`` into the tensor itself, and
  ``tensor.type()`` names the CUDA type (``clip_grads.py`` asserts ``torch.cuda.FloatTensor``);
* ``torch.cuda.current_device`` returns ``"cpu"`` (so ``device=torch.cuda.current_device()`` is the
  CPU even outside the mode's reach); ``synchronize`` and streams (with their events) are no-ops;
* the CUDA RNG calls of ``megatron.core.tensor_parallel.random`` (its ``CudaRNGStatesTracker`` forks
  the dropout RNG around attention) use the CPU generator;
* the local spec's LayerNorm is what it is on a machine with Apex, ``FusedLayerNorm`` (which marks its
  parameters ``sequence_parallel``; the ``torch.nn.LayerNorm`` fallback refuses sequence parallelism),
  with Apex's ``FusedLayerNormAffineFunction`` computed by ``F.layer_norm``;
* the MoE utilities' Transformer Engine names, which 0.16.1 leaves undefined when TE is absent
  (``fused_permute`` & co. in ``moe_utils.py``), are ``None``, so its plain-PyTorch branches run;
* ``dist_checkpointing``'s torch_dist writer runs its per-bucket workers as threads (a forked rank may
  not start processes);
* the alltoall dispatcher's split sizes go to ``all_to_all_single`` as host numpy arrays, as on a GPU
  (``maybe_move_tensor_to_cpu`` converts only tensors that ``is_cuda``; a CPU tensor is no sequence);
* with expert TP > 1 that dispatcher all-gathers and reduce-scatters pieces of different lengths over expert
  TP (``tensor_parallel/mappings.py`` with ``output_split_sizes``), which NCCL takes and gloo refuses: the
  all-gather pads each piece to the longest, the reduce-scatter is an all-reduce of the whole, cut.

Use it inside a rank, after ``torch.distributed`` is initialised: ``with megatron_core_on_cpu(): ...``.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from unittest import mock

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["megatron_core_on_cpu", "CpuDeviceMode"]

TE_MOE_NAMES = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                "fused_permute_with_probs", "fused_sort_chunks_by_index", "fused_sort_chunks_by_index_with_probs",
                "fused_topk_with_score_function", "fused_unpermute", "te_general_gemm")
"""What ``megatron/core/transformer/moe/moe_utils.py`` imports from Transformer Engine inside a ``try``
(0.16.1): without TE the names stay undefined, and its ``if te_general_gemm is not None`` raises NameError."""


def _is_cuda(device) -> bool:
    if isinstance(device, int) and not isinstance(device, bool):
        return True                                  # a bare index is a GPU index to torch's factories
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _uneven_collectives():
    """``torch.distributed.all_gather`` and ``reduce_scatter`` that also take pieces of different lengths
    along dim 0 (NCCL does, gloo refuses): the all-gather pads each piece to the longest and cuts the
    results back; the reduce-scatter all-reduces the pieces whole and keeps this rank's. Even pieces go to
    torch's own. Patched as module attributes, so that autograd's backward (where no torch-function mode
    reaches) takes them too."""
    import torch.distributed as dist

    all_gather, reduce_scatter = dist.all_gather, dist.reduce_scatter

    def uneven(tensors) -> bool:
        return len({tuple(t.shape) for t in tensors}) > 1

    def gather(output_list, tensor, group=None, async_op=False):
        if not uneven(output_list):
            return all_gather(output_list, tensor, group=group, async_op=async_op)
        longest = max(t.shape[0] for t in output_list)
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[:tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in output_list]
        all_gather(parts, padded, group=group)
        for out, part in zip(output_list, parts):
            out.copy_(part[:out.shape[0]])

    def scatter(output, input_list, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if not uneven(input_list):
            return reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)
        whole = torch.cat(list(input_list))
        dist.all_reduce(whole, op=op, group=group)
        output.copy_(torch.split(whole, [t.shape[0] for t in input_list])[dist.get_rank(group)])

    return gather, scatter


class CpuDeviceMode(TorchFunctionMode):
    """Every tensor megatron-core asks to put on a GPU is put on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.pin_memory:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:     # asserted to be a CUDA type
            return func(*args).replace("torch.", "torch.cuda.", 1)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to:
            args = tuple("cpu" if _is_cuda(a) else a for a in args)
        kwargs.pop("pin_memory", None)
        return func(*args, **kwargs)


class _NoStream:
    """A CUDA stream (and the event it records) that is always done: the alltoall dispatcher's
    device-to-host side stream."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def wait_stream(self, *args):
        pass

    def record_event(self, *args):
        return self

    def synchronize(self):
        pass


def _none(*args, **kwargs):
    return None


def _device_to_host(tensor, as_numpy: bool = False, record_stream: bool = False):
    """``moe_utils.maybe_move_tensor_to_cpu`` for tensors that stand for GPU ones: a host copy (a numpy
    array with ``as_numpy``, the split sizes ``all_to_all_single`` takes as a sequence)."""
    if not torch.is_tensor(tensor):
        return tensor
    copy = tensor.detach().clone()
    return copy.numpy() if as_numpy else copy


class _ThreadsForProcesses:
    """``torch.multiprocessing`` as ``dist_checkpointing``'s file writer uses it (a spawned Manager's queue,
    a forked worker per write bucket), with threads and thread queues: a forked rank is a daemonic process,
    which may not start children. The writing itself stays megatron-core's (``write_preloaded_data``)."""

    Queue = JoinableQueue = SimpleQueue = queue.Queue
    Process = threading.Thread

    @classmethod
    def get_context(cls, method=None):
        return cls

    @classmethod
    def Manager(cls):
        return cls


class _LayerNormAffine:
    """Apex's ``FusedLayerNormAffineFunction`` (what megatron-core's ``FusedLayerNorm`` calls) as
    ``F.layer_norm``: [..., h] -> [..., h]."""

    @staticmethod
    def forward(input, weight, bias, normalized_shape, eps):
        return torch.nn.functional.layer_norm(input, normalized_shape, weight, bias, eps)

    apply = forward


@contextlib.contextmanager
def megatron_core_on_cpu():
    """megatron-core's CUDA calls rerouted to the CPU for the duration (see the module doc)."""
    import megatron.core.dist_checkpointing.strategies.filesystem_async as filesystem_async
    import megatron.core.fusions.fused_layer_norm as fused_layer_norm
    import megatron.core.models.backends as backends
    import megatron.core.tensor_parallel.random as mc_random
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher
    import megatron.core.transformer.transformer_block as transformer_block

    gather, scatter = _uneven_collectives()
    patches = [
        mock.patch("torch.distributed.all_gather", gather),
        mock.patch("torch.distributed.reduce_scatter", scatter),
        mock.patch("torch.cuda.current_device", lambda: "cpu"),
        mock.patch("torch.cuda.synchronize", _none),
        mock.patch("torch.cuda.current_stream", lambda *a, **k: _NoStream()),
        mock.patch("torch.cuda.stream", lambda *a, **k: _NoStream()),
        mock.patch("torch.cuda.Stream", _NoStream),
        mock.patch("torch.cuda.manual_seed", torch.manual_seed),
        mock.patch("torch.cuda.get_rng_state", lambda *a, **k: torch.get_rng_state()),
        mock.patch.object(mc_random, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state()),
        mock.patch.object(mc_random, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state)),
        mock.patch.object(fused_layer_norm, "HAVE_FUSED_LAYER_NORM", True),
        mock.patch.object(fused_layer_norm, "FusedLayerNormAffineFunction", _LayerNormAffine, create=True),
        mock.patch.object(backends, "LNImpl", fused_layer_norm.FusedLayerNorm),
        mock.patch.object(transformer_block, "LayerNormImpl", fused_layer_norm.FusedLayerNorm),
        mock.patch.object(token_dispatcher, "maybe_move_tensor_to_cpu", _device_to_host),
        mock.patch.object(filesystem_async, "mp", _ThreadsForProcesses),
        mock.patch.object(filesystem_async, "_results_queue", None),
    ]
    for name in TE_MOE_NAMES:
        if not hasattr(moe_utils, name):
            patches.append(mock.patch.object(moe_utils, name, None, create=True))
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        stack.enter_context(CpuDeviceMode())
        yield
