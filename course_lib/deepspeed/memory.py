"""Model-state bytes of a ds_config, three ways: the ZeRO paper, DeepSpeed's own estimators, Megatron's flags.

DeepSpeed 0.19.8 ships two estimators (``deepspeed/runtime/zero/stage_1_and_2.py::
estimate_zero2_model_states_mem_needs`` and ``stage3.py::estimate_zero3_model_states_mem_needs``);
:func:`deepspeed_estimate` is their arithmetic (``tests/deepspeed/test_ds_memory.py`` calls them live
and compares byte for byte), written as items against the paper's ``2 + 2 + 12`` bytes per
parameter (Rajbhandari et al. 2020, §3.1; :func:`course_lib.sizing.model_state_bytes`) so that each
extra is a line of its own. Ψ = parameters per GPU's model (after TP/PP), d = data-parallel GPUs
(``gpus_per_node x nodes``), L = the largest layer's parameters (one module's own parameters: for
a GPT the word embedding, ``V x h``):

=======================  ===========================  ===============================================
ZeRO-2, no offload       GPU ``2Ψ + 18Ψ/d``            the paper's ``2Ψ + 14Ψ/d`` + an **fp32 grad
                                                      partition** ``4Ψ/d`` (DeepSpeed's own comment:
                                                      18 = 2 grads16 + 4 grads32 + 4 params32 + 8 Adam)
ZeRO-2, optimizer        GPU ``2Ψ``; host              grads, master params and Adam on the host:
offload                  ``Ψ·max(4d, 16)·1.5``         4 + 4 + 8 = 16 per parameter, × **1.5**
ZeRO-3, no offload       GPU ``4L + 18Ψ/d``            the paper's ``16Ψ/d`` + 2 over d (an fp32 grad
                                                      partition, 4, where the paper counts 2) + the
                                                      **largest layer** gathered whole, ``4L`` (its
                                                      16-bit params and grads)
ZeRO-3, optimizer        GPU ``4L + 2Ψ/d``; host        16 per parameter of the node's share, × 1.5
offload                  ``16Ψ/nodes·1.5``
ZeRO-3, optimizer +      GPU ``4L``; host               also the 16-bit params: 18, × 1.5
param offload            ``18Ψ/nodes·1.5``
=======================  ===========================  ===============================================

The host figures are per node and assume ``deepspeed.zero.Init`` (the model built partitioned);
without it (``zero_init=False``: every process builds the whole model first, as the course's
trainer does) each process also needs its fp32 copy, ``4Ψ`` per GPU of the node
(``max(4·gpus_per_node, ...)``). ZeRO-0 and ZeRO-1 have no estimator in DeepSpeed. DeepSpeed's
``offload_param`` only acts at stage 3 (it partitions parameters only there); the estimators model
CPU offload only (NVMe holds what the host would).

:func:`spend_device_budget` goes the other way: given a rank's device budget under ZeRO-3 with both offloads,
it spends it on what stays on the device at rest (:func:`zero3_device_at_rest`: the persistent parameters and
the reduce bucket) as a practitioner would (Lab 10's Exercise 3).
"""

from __future__ import annotations

from dataclasses import dataclass

from course_lib import rules

BUFFER_FACTOR = 1.5      # the estimators' additional_buffer_factor default


@dataclass(frozen=True)
class Item:
    """One line of an itemised count: ``label``, ``where`` (``"GPU"`` per GPU, ``"host"`` per node),
    ``bytes`` and ``extra`` (True: DeepSpeed counts it, the paper does not)."""

    label: str
    where: str
    bytes: float
    extra: bool = False


@dataclass(frozen=True)
class Estimate:
    """Bytes per GPU (``gpu``) and per node (``host``), with the ``items`` that add up to them."""

    gpu: float
    host: float
    items: tuple

    def lines(self, fmt=rules.format_bytes) -> list[str]:
        return [f"{'+ ' if it.extra else ''}{it.label}: {fmt(it.bytes)} per {'GPU' if it.where == 'GPU' else 'node'}"
                for it in self.items]


def largest_layer(model) -> int:
    """L of DeepSpeed's ZeRO-3 estimator: the most parameters one module owns itself (``model_to_params``
    in ``stage3.py``: ``sum(p.numel() for p in m.parameters(recurse=False))`` over ``model.modules()``)."""
    return max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)


def deepspeed_estimate(stage: int, num_params: float, dp: int, largest: float = 0, *, offload_optimizer: bool = False,
                       offload_param: bool = False, nodes: int = 1, zero_init: bool = True) -> Estimate | None:
    """DeepSpeed's estimate of the model states for ZeRO ``stage`` (None for 0 and 1: DeepSpeed has no
    estimator there) of ``num_params`` over ``dp`` GPUs on ``nodes`` nodes, ``largest`` = L; see the
    module docstring. ``offload_param`` counts at stage 3 only, and with ``offload_optimizer``
    (the estimator's ``cpu_offload_params`` lives inside its ``cpu_offload`` branch)."""
    psi, d = rules.number("num_params", num_params, low=0.0, low_open=True), rules.integer("dp", dp)
    nodes = rules.integer("nodes", nodes)
    per_node = d // nodes if d % nodes == 0 else None
    if per_node is None:
        raise rules.UsageError(f"dp={d} over nodes={nodes} is not a whole number of GPUs per node; use a divisor of {d}")
    f = BUFFER_FACTOR
    if stage == 2:
        if offload_optimizer:
            host = psi * max(4 * d, 16) * f
            return Estimate(2 * psi, int(host), (
                Item("16-bit params, whole on every GPU (2Ψ)", "GPU", 2 * psi),
                Item("fp32 grads + fp32 params + Adam's two moments on the host (16Ψ"
                     + (f", or 4Ψ for each of the {d} processes while they load: 4·d > 16)" if 4 * d > 16 else ")"),
                     "host", psi * max(4 * d, 16)),
                Item("× 1.5, DeepSpeed's additional buffer factor", "host", psi * max(4 * d, 16) * (f - 1), True)))
        return Estimate(2 * psi + int(18 * psi / d), int(psi * 4 * per_node * f), (
            Item("16-bit params, whole on every GPU (2Ψ)", "GPU", 2 * psi),
            Item("16-bit grads partition (2Ψ/d)", "GPU", 2 * psi / d),
            Item("fp32 params + Adam's two moments partition (12Ψ/d)", "GPU", 12 * psi / d),
            Item("fp32 grads partition (4Ψ/d)", "GPU", 4 * psi / d, True),
            Item(f"an fp32 copy of the model per process on the node while it loads (4Ψ × {per_node}) × 1.5",
                 "host", psi * 4 * per_node * f, True)))
    if stage != 3:
        return None
    layer = 4 * int(rules.number("largest_layer", largest, low=0.0))
    whole = Item("the largest layer gathered whole: its 16-bit params and grads (4L)", "GPU", layer, True)
    load = (f" (without deepspeed.zero.Init at least 4Ψ × {per_node} per node: every process builds the fp32 model)"
            if not zero_init else "")
    if offload_optimizer:
        per_param = 18 if offload_param else 16
        host = psi * (per_param / nodes if zero_init else max(4 * per_node, per_param / nodes)) * f
        gpu = layer if offload_param else layer + int(2 * psi / d)
        items = ([] if offload_param else [Item("16-bit params partition (2Ψ/d)", "GPU", 2 * psi / d)]) + [
            whole, Item(("16-bit params + " if offload_param else "") + "fp32 grads + fp32 params + Adam's two "
                        f"moments of the node's share on the host ({per_param}Ψ/nodes)" + load, "host",
                        host / f),
            Item("× 1.5, DeepSpeed's additional buffer factor", "host", host / f * (f - 1), True)]
        return Estimate(gpu, int(host), tuple(items))
    host = (largest if zero_init else psi) * 4 * per_node * f
    return Estimate(layer + int(18 * psi / d), int(host), (
        Item("16-bit params partition (2Ψ/d)", "GPU", 2 * psi / d),
        Item("16-bit grads partition (2Ψ/d)", "GPU", 2 * psi / d),
        Item("fp32 params + Adam's two moments partition (12Ψ/d)", "GPU", 12 * psi / d),
        Item("DeepSpeed counts 18 bytes per parameter over d where the paper counts 16: an fp32 grad partition "
             "(4) for the 16-bit one (2)", "GPU", 2 * psi / d, True),
        whole,
        Item(("the largest layer" if zero_init else "the model") + f" in fp32 per process on the node (4 × {per_node})"
             " × 1.5", "host", host, True)))


@dataclass(frozen=True)
class BudgetPlan:
    """How :func:`spend_device_budget` spends a rank's device budget under ZeRO-3 with both offloads:
    ``persistent`` elements kept whole on every rank (every tensor of at most ``threshold`` elements:
    any threshold from ``threshold`` up to the next tensor size keeps the same ones), a reduce bucket of
    ``bucket`` elements, ``largest`` the largest gradient (the bucket's floor), and ``device`` the bytes
    that leaves on the device at rest."""

    persistent: int
    threshold: int
    bucket: int
    largest: int
    device: int


def zero3_device_at_rest(numels, persistence_threshold: float, reduce_bucket_size: float,
                         element_bytes: int = 2) -> int:
    """A rank's device bytes between steps under ZeRO-3 with ``offload_optimizer`` and ``offload_param``
    (``contiguous_gradients``, DeepSpeed's default): the parameters of at most ``persistence_threshold``
    elements, whole (``parameter_offload.py`` ``mark_persistent_parameters``; the model threshold at its
    default), and the reduce bucket, ``reduce_bucket_size`` elements allocated whole (``stage3.py``:
    ``torch.empty(self.reduce_bucket_size)``), both 16-bit; every partition and the optimizer are on the host."""
    kept = sum(n for n in numels if n <= persistence_threshold)
    return element_bytes * (kept + int(reduce_bucket_size))


def spend_device_budget(numels, budget: int, element_bytes: int = 2) -> BudgetPlan:
    """A device budget (bytes per rank at rest) spent on what ZeRO-3 with both offloads keeps there
    (:func:`zero3_device_at_rest`), as a practitioner would: (1) a reduce bucket that holds the largest
    gradient -- DeepSpeed copies a gradient into its contiguous bucket only when it fits
    (``stage3.py`` ``__add_grad_to_ipg_bucket``); (2) then as many tensors kept whole as fit, by size,
    smallest first -- each one kept is a forward all-gather fewer (DeepSpeed's reason for the threshold:
    small gathers are latency-bound) -- but never the largest size, or forward gathers nothing and it is
    no longer ZeRO-3; (3) the rest to the bucket: fewer reduce-scatters in backward. ``numels``: the
    parameters' element counts (each gradient has its parameter's)."""
    sizes = [rules.integer("a parameter's elements", n) for n in numels]
    if len(set(sizes)) < 2:
        raise rules.UsageError("spend_device_budget needs tensors of at least two sizes (the largest stay "
                               "partitioned); pass every parameter's element count")
    largest = max(sizes)
    budget = rules.integer("budget", budget, minimum=0)
    if budget < element_bytes * largest:
        raise rules.UsageError(f"a device budget of {budget:,} B cannot hold a reduce bucket of the largest gradient "
                               f"({largest:,} elements, {element_bytes * largest:,} B): give at least that")
    persistent, threshold = 0, 0
    for size in sorted(set(sizes))[:-1]:
        kept = sum(n for n in sizes if n <= size)
        if element_bytes * (kept + largest) > budget:
            break
        persistent, threshold = kept, size
    bucket = budget // element_bytes - persistent
    return BudgetPlan(persistent, threshold, bucket, largest, element_bytes * (persistent + bucket))


def paper_bytes(stage: int, num_params: float, dp: int, precision: str, *, offload_optimizer: bool = False,
                offload_param: bool = False):
    """``(gpu, host)``: :class:`course_lib.sizing.ModelStateBytes` per GPU by the ZeRO paper's accounting
    (16-bit: 2 + 2 + 12 per parameter; fp32 training: 4 + 4 + 8), over ``dp`` with ZeRO ``stage``; with
    optimizer offload the grads and the optimizer state live on the host (ZeRO-Offload, Ren et al.
    2021: the GPU keeps the 16-bit params), with param offload at stage 3 the params too (ZeRO-Infinity).
    ``host`` is per GPU (multiply by the GPUs of a node)."""
    from course_lib.sizing import ModelStateBytes, model_state_bytes

    if precision == "fp32":
        b = model_state_bytes(num_params, dp, stage, k=8, param_bytes=4, grad_bytes=4)
    else:
        b = model_state_bytes(num_params, dp, stage, k=12)
    params_off = offload_param and stage == 3
    gpu = ModelStateBytes(0.0 if params_off else b.weights, 0.0 if offload_optimizer else b.grads,
                          0.0 if offload_optimizer else b.optimizer)
    host = ModelStateBytes(b.weights - gpu.weights, b.grads - gpu.grads, b.optimizer - gpu.optimizer)
    return gpu, host


def megatron_bytes(stage: int, num_params: float, dp: int, precision: str, *, offload_optimizer: bool = False,
                   fsdp_grads_dtype: str = "auto"):
    """``(gpu, host)`` :class:`~course_lib.sizing.ModelStateBytes` per GPU under the translated Megatron flags:
    :func:`course_lib.sizing.memory.megatron_state_bytes` with the grads in
    :func:`~course_lib.sizing.memory.megatron_grad_dtype` -- stages 0-1 (DDP, the distributed optimizer):
    fp32 under bf16, 16-bit under fp16; stages 2-3 (Megatron-FSDP): ``--megatron-fsdp-main-grads-dtype``
    (``fsdp_grads_dtype``; default ``auto``, the param dtype: 2 bytes over d under bf16, 4 with ``fp32``).
    ``--optimizer-cpu-offload`` moves the optimizer state to the host, where ``HybridDeviceOptimizer`` keeps
    fp32 main params, Adam's moments and an fp32 copy of the grad shard
    (:func:`~course_lib.sizing.memory.optimizer_offload_bytes_per_param`: 16 bytes per parameter, over d
    with a sharded optimizer); the device keeps the params and grads."""
    from course_lib.sizing import ModelStateBytes
    from course_lib.sizing.memory import megatron_grad_dtype, megatron_state_bytes, optimizer_offload_bytes_per_param

    grad_dtype = megatron_grad_dtype(precision, stage, fsdp_main_grads_dtype=fsdp_grads_dtype)
    b = megatron_state_bytes(num_params, dp, stage, precision, grad_dtype)
    if offload_optimizer:
        off = optimizer_offload_bytes_per_param(dp, stage >= 1, precision, grad_dtype)
        return ModelStateBytes(b.weights, b.grads, 0.0), ModelStateBytes(
            0.0, off["host_grads"] * num_params, (off["host"] - off["host_grads"]) * num_params)
    return b, ModelStateBytes(0.0, 0.0, 0.0)
