"""Memory per GPU: activations (Korthikanti et al. 2022) and model states (ZeRO; Megatron).

Conventions: all results are **bytes**; activations are 16-bit (2 bytes per element) except
dropout masks (1 byte), exactly as Korthikanti et al. §4 assume; s = sequence length,
b = micro-batch size, h = hidden size, a = attention heads, t = tensor-parallel size,
p = pipeline-parallel size, L = layers.

Sources:

* Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"
  (arXiv:2205.05198): §4.1 per-layer breakdown and Eq. 1; Eq. 2 (TP); Eq. 4 (TP + SP);
  Table 2 (all recompute variants); Eq. 5 and 6 (first pipeline stage, with the interleaving
  factor of §4.2.3); §4.3 (embeddings, final LayerNorm, output layer).
* Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
  Models" (arXiv:1910.02054): §3.1 (2 + 2 + K bytes per parameter, K = 12 for mixed-precision
  Adam) and §5 / Figure 1 (stages P_os, P_os+g, P_os+g+p over N_d data-parallel ranks).
* Megatron-LM, docs/user-guide/features/dist_optimizer.md: bytes per parameter of Megatron's
  (distributed) optimizer for each param/grad dtype; ``megatron/training/arguments.py`` (main d98e8a6)
  for the dtype gradients are reduced in (:func:`megatron_grad_dtype`), Megatron-FSDP's
  ``--megatron-fsdp-main-grads-dtype`` included (:func:`megatron_state_bytes`).
"""

from __future__ import annotations

from typing import NamedTuple

from course_lib import rules
from course_lib.sizing import _checks


def activation_breakdown_per_layer(seq_length: int, micro_batch_size: int, hidden_size: int,
                                   num_heads: int) -> dict:
    """Activation bytes of one transformer layer without parallelism, item by item (Korthikanti §4.1).

    Attention block ``11sbh + 5as^2b``: QKV input 2sbh, Q and K for QK^T 4sbh, softmax output
    2as^2b, softmax-dropout mask as^2b, dropout output 2as^2b and V 2sbh, projection input 2sbh,
    attention-dropout mask sbh. MLP ``19sbh``: h->4h input 2sbh, GeLU input 8sbh, 4h->h input
    8sbh, dropout mask sbh. LayerNorms ``4sbh`` (2sbh each). Returns a dict of the items plus
    ``attention``, ``mlp``, ``layernorm`` and ``total`` (= Eq. 1).
    """
    _checks.model_shape(1, hidden_size, num_heads)
    _checks.positive_int("seq_length", seq_length)
    _checks.positive_int("micro_batch_size", micro_batch_size)
    sbh = seq_length * micro_batch_size * hidden_size
    as2b = num_heads * seq_length * seq_length * micro_batch_size
    items = {
        "qkv_input": 2 * sbh,
        "q_and_k": 4 * sbh,
        "softmax_output": 2 * as2b,
        "softmax_dropout_mask": as2b,
        "attention_over_v": 2 * as2b + 2 * sbh,
        "projection_input": 2 * sbh,
        "attention_dropout_mask": sbh,
        "mlp_fc1_input": 2 * sbh,
        "gelu_input": 8 * sbh,
        "mlp_fc2_input": 8 * sbh,
        "mlp_dropout_mask": sbh,
        "layernorm_inputs": 4 * sbh,
    }
    attention = sum(v for k, v in items.items() if k in (
        "qkv_input", "q_and_k", "softmax_output", "softmax_dropout_mask", "attention_over_v",
        "projection_input", "attention_dropout_mask"))
    mlp = items["mlp_fc1_input"] + items["gelu_input"] + items["mlp_fc2_input"] + items["mlp_dropout_mask"]
    layernorm = items["layernorm_inputs"]
    return {**items, "attention": attention, "mlp": mlp, "layernorm": layernorm,
            "total": attention + mlp + layernorm}


def activation_bytes_per_layer(
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    num_heads: int,
    tp: int = 1,
    sequence_parallel: bool = False,
    recompute="none",
    cp: int = 1,
) -> int:
    """Activation bytes one TP rank stores for one transformer layer and one micro-batch.

    Korthikanti et al. 2022, Table 2 (s, b, h, a, t as in the module docstring):

    ==============================  ==========================  ===========================
    recompute                       no sequence parallel        sequence parallel
    ==============================  ==========================  ===========================
    "none"   (Eq. 1 at t=1, Eq. 2)  sbh(10 + 24/t + 5as/(ht))   sbh/t (34 + 5as/h)  (Eq. 4)
    "selective"                     sbh(10 + 24/t)              34 sbh/t
    "full"                          2sbh                        2sbh/t
    ==============================  ==========================  ===========================

    The ``10sbh`` not divided by t without SP are the LayerNorm inputs, the two dropout masks and
    the inputs of the QKV and h->4h GEMMs, replicated on every TP rank (§4.2.2). "full" stores
    only each layer's input; Table 2 gives 2sbh for TP without SP, and §5 notes it drops to
    2sbh/t when each TP rank keeps only its slice, which is what the sequence-parallel layout
    stores (the layer input is split along s). At t = 1 every row reduces to Eq. 1,
    ``sbh(34 + 5as/h)``, or its recompute variants.

    Context parallelism (``cp > 1``) is not in the paper. We apply the same items to the ``s/cp``
    tokens a rank holds, and the score term becomes ``5 a (s/cp) s b`` (its queries against all
    keys) -- an upper bound: Megatron's CP runs flash attention, which stores no score matrix at
    all, i.e. behaves like ``recompute="selective"`` for that term.
    """
    _checks.model_shape(1, hidden_size, num_heads)
    rules.sequence_split(seq_length, cp, "contiguous")
    _checks.positive_int("micro_batch_size", micro_batch_size)
    rules.heads_divisible_by_tp(num_heads, _checks.positive_int(rules.TP, tp))
    if sequence_parallel:
        rules.sequence_parallel_split(seq_length, cp, tp)
    mode = _checks.recompute_mode(recompute)
    sbh = seq_length // cp * micro_batch_size * hidden_size
    scores = 5 * num_heads * (seq_length // cp) * seq_length * micro_batch_size  # 5as^2b at cp=1
    t = tp
    if mode == "full":
        return 2 * sbh // t if sequence_parallel else 2 * sbh
    if sequence_parallel:
        return (34 * sbh + (scores if mode == "none" else 0)) // t
    return 10 * sbh + 24 * sbh // t + (scores // t if mode == "none" else 0)


def interleaving_factor(pp: int, vp: int) -> float:
    """``1 + (p - 1)/(p m)`` with m = interleaved model chunks per rank (Korthikanti §4.2.3, §5).

    The interleaved schedule makes the first stage hold this many times the activations of the
    plain 1F1B schedule. Korthikanti call the number of model chunks m; Megatron's flag is
    --virtual-pipeline-model-parallel-size (here ``vp``). ``vp = 1`` gives 1.
    """
    _checks.positive_int("pipeline-model-parallel-size", pp)
    _checks.positive_int("virtual-pipeline-model-parallel-size", vp)
    return 1.0 if vp == 1 else 1 + (pp - 1) / (pp * vp)


def activation_bytes_first_stage(
    num_layers: int,
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    num_heads: int,
    tp: int = 1,
    pp: int = 1,
    vp: int = 1,
    sequence_parallel: bool = False,
    recompute="none",
    num_microbatches: int | None = None,
    cp: int = 1,
) -> float:
    """Activation bytes stored by a rank of the first pipeline stage, transformer layers only.

    Korthikanti Eq. 5 (and Eq. 6 for selective recompute with SP): with 1F1B the first stage
    holds ``p`` micro-batches of ``L/p`` layers each, i.e. ``L`` layers' worth,
    ``L * activation_bytes_per_layer(...)``, whatever ``pp`` is; the interleaved schedule
    multiplies that by :func:`interleaving_factor`. If ``num_microbatches`` is given and smaller
    than ``pp``, only that many are ever in flight, so the total is ``(L/p) * m`` layers' worth.
    Embeddings and the output layer are separate: :func:`activation_bytes_outside_layers`.
    """
    _checks.model_shape(num_layers, hidden_size, num_heads)
    stages = rules.pipeline_split(num_layers, _checks.positive_int(rules.PP, pp))
    if _checks.positive_int(rules.VPP, vp) > 1:
        rules.virtual_pipeline(vp, pp, stages)
    per_layer = activation_bytes_per_layer(seq_length, micro_batch_size, hidden_size, num_heads, tp,
                                           sequence_parallel, recompute, cp)
    if num_microbatches is not None:
        _checks.positive_int("num_microbatches", num_microbatches)
        if vp > 1:
            rules.interleaved_microbatch_group(pp, num_microbatches, vp)
        elif num_microbatches < pp:
            return float(per_layer * (num_layers // pp) * num_microbatches)
    return per_layer * num_layers * interleaving_factor(pp, vp)


def output_activation_terms(
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    vocab_size: int,
    tp: int = 1,
    sequence_parallel: bool = True,
) -> dict:
    """Per-micro-batch activation bytes outside the transformer layers (Korthikanti §4.3).

    ``embedding``: the embedding-dropout mask, ``sbh/t`` (1 byte per element). ``output``: the
    final LayerNorm input ``2sbh/t``, the output-layer input ``2sbh/t`` and the fp32 logits
    ``4sbv/t``, i.e. ``4sbh/t (1 + v/h)``. Those are the sequence-parallel values of the paper;
    without SP only the vocab-parallel logits are split over t: ``sbh`` and ``4sbh + 4sbv/t``.
    """
    for name, value in (("seq_length", seq_length), ("micro_batch_size", micro_batch_size),
                        ("hidden_size", hidden_size), ("vocab_size", vocab_size),
                        ("tensor-model-parallel-size", tp)):
        _checks.positive_int(name, value)
    rules.vocab_divisible_by_tp(vocab_size, tp)
    if sequence_parallel:
        rules.sequence_parallel_split(seq_length, 1, tp)
    sb = seq_length * micro_batch_size
    sbh = sb * hidden_size
    logits = 4 * sb * vocab_size // tp
    if sequence_parallel:
        return {"embedding": sbh // tp, "output": 4 * sbh // tp + logits}
    return {"embedding": sbh, "output": 4 * sbh + logits}


def activation_bytes_outside_layers(
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    vocab_size: int,
    tp: int = 1,
    pp: int = 1,
    sequence_parallel: bool = True,
) -> int:
    """Activation bytes of the embeddings, final LayerNorm and output layer on the first stage.

    Korthikanti §4.3, with sequence parallelism: ``sbh/t * (p + delta_{p=1} * 4 (1 + v/h))``: the
    embedding-dropout mask for each of the ``p`` micro-batches in flight, and only when ``p = 1``
    (the first stage is also the last) the output terms of :func:`output_activation_terms`.
    The paper calls these terms negligible next to Eq. 5; for small models with a large
    vocabulary they are not (the fp32 logits dominate).
    """
    _checks.positive_int("pipeline-model-parallel-size", pp)
    terms = output_activation_terms(seq_length, micro_batch_size, hidden_size, vocab_size, tp,
                                    sequence_parallel)
    return terms["embedding"] * pp + (terms["output"] if pp == 1 else 0)


class ModelStateBytes(NamedTuple):
    """Bytes of the model states on one rank: 16-bit ``weights``, ``grads`` and ``optimizer`` states."""

    weights: float
    grads: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.optimizer


def model_state_bytes(num_params: float, dp: int = 1, zero_stage: int = 0, k: float = 12,
                      param_bytes: float = 2, grad_bytes: float = 2) -> ModelStateBytes:
    """Model-state bytes per data-parallel rank with ZeRO-DP (Rajbhandari et al. 2020, §3.1, §5).

    Mixed-precision Adam keeps fp16 weights (2 bytes/param), fp16 gradients (2) and K = 12 bytes of
    optimizer state (fp32 master weights, momentum, variance): ``(2 + 2 + K) Psi``. Over
    ``N_d = dp`` ranks, stage 1 (P_os) divides the K term, stage 2 (P_os+g) also the gradients,
    stage 3 (P_os+g+p) all three:

    * stage 0: ``(2 + 2 + K) Psi``
    * stage 1: ``4 Psi + K Psi / N_d``
    * stage 2: ``2 Psi + (2 + K) Psi / N_d``
    * stage 3: ``(2 + 2 + K) Psi / N_d``

    ZeRO Figure 1 / §5: Psi = 7.5B on N_d = 64 gives 120 GB, 31.4 GB, 16.6 GB and 1.9 GB.
    ``num_params`` is the count this rank is responsible for (after TP/PP, see
    :func:`~course_lib.sizing.flops.parameters_per_rank`).

    ``param_bytes`` / ``grad_bytes`` (default 2, the paper's fp16) generalise the paper's
    ``2 + 2``: fp32 training is ``param_bytes = grad_bytes = 4, k = 8`` (Adam's two moments; the
    params are the master copy), Megatron's bf16 default ``param_bytes = 2, grad_bytes = 4``
    (``--accumulate-allreduce-grads-in-fp32``), ``k = 12``. Checked byte for byte against
    :mod:`course_lib.distributed` on real ranks (tests/distributed/test_megatron_fsdp.py).
    """
    _checks.positive_number("num_params", num_params)
    _checks.positive_int("dp", dp)
    _checks.non_negative_int("zero_stage", zero_stage)
    if zero_stage > 3:
        raise rules.UsageError(f"zero_stage={zero_stage} is not one of 0, 1, 2, 3 (ZeRO-DP stages)")
    if isinstance(k, bool) or not (isinstance(k, (int, float)) and k >= 0):
        raise rules.UsageError(f"k={k!r} must be a non-negative number of optimizer bytes per parameter")
    for name, value in (("param_bytes", param_bytes), ("grad_bytes", grad_bytes)):
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and value > 0):
            raise rules.UsageError(f"{name}={value!r} must be a positive number of bytes per parameter (2 or 4)")
    n = dp
    weights, grads, optimizer = param_bytes * num_params, grad_bytes * num_params, k * num_params
    if zero_stage >= 1:
        optimizer /= n
    if zero_stage >= 2:
        grads /= n
    if zero_stage >= 3:
        weights /= n
    return ModelStateBytes(weights, grads, optimizer)


_DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4}


def megatron_optimizer_bytes_per_param(
    dp: int = 1,
    distributed_optimizer: bool = False,
    params_dtype: str = "bf16",
    grad_dtype: str = "fp32",
) -> ModelStateBytes:
    """Bytes per parameter of Megatron's Adam, with or without ``--use-distributed-optimizer``.

    Megatron-LM docs/user-guide/features/dist_optimizer.md (d = data-parallel size):

    ====================================  ===============  ===========
    param / grad dtype                    non-distributed  distributed
    ====================================  ===============  ===========
    16-bit param, 16-bit grads            20               4 + 16/d
    16-bit param, fp32 grads              18               6 + 12/d
    fp32 param, fp32 grads                16               8 + 8/d
    ====================================  ===============  ===========

    The split into weights/grads/optimizer is ours: the model keeps its param and grad buffers
    (never sharded: the distributed optimizer is ZeRO-1-like), the optimizer keeps fp32 main
    params (unless the params are already fp32), an fp32 main grad (only when grads are 16-bit)
    and Adam's two fp32 moments, all sharded over d. bf16 training in Megatron accumulates and
    reduces grads in fp32 by default, hence 18 rather than ZeRO's 16. d is the data-parallel
    size *including* context parallelism (Megatron shards over the dp x cp group).
    """
    _checks.positive_int("dp", dp)
    for name, value in (("params_dtype", params_dtype), ("grad_dtype", grad_dtype)):
        if value not in _DTYPE_BYTES:
            raise rules.UsageError(f"{name}={value!r} is not one of {', '.join(_DTYPE_BYTES)}")
    param, grad = _DTYPE_BYTES[params_dtype], _DTYPE_BYTES[grad_dtype]
    if param == 4 and grad == 2:
        raise rules.UsageError("fp32 params with 16-bit grads is not a Megatron configuration; "
                               "use grad_dtype='fp32'")
    optimizer = 8 + (4 if param == 2 else 0) + (4 if grad == 2 else 0)
    if distributed_optimizer:
        optimizer /= dp
    return ModelStateBytes(float(param), float(grad), float(optimizer))


PRECISIONS = ("fp32", "bf16", "fp16")
"""Megatron's training precisions: fp32, ``--bf16``, ``--fp16``."""

FSDP_MAIN_GRADS_DTYPES = ("auto", "fp32", "bf16", "fp16")
"""``--megatron-fsdp-main-grads-dtype``'s choices at Megatron-LM main (``arguments.py`` ~3691; default auto)."""


def megatron_grad_dtype(precision: str, zero_stage: int = 0, *, accumulate_allreduce_grads_in_fp32: bool = False,
                        grad_reduce_in_bf16: bool = False, fsdp_main_grads_dtype: str = "auto") -> str:
    """The dtype Megatron-LM main accumulates and data-parallel-reduces gradients in.

    DDP and the distributed optimizer (``zero_stage`` 0-1; ``arguments.py`` ~1204-1217): ``--bf16``
    switches ``--accumulate-allreduce-grads-in-fp32`` on, so fp32, unless ``--grad-reduce-in-bf16``;
    ``--fp16`` reduces in fp16 unless ``--accumulate-allreduce-grads-in-fp32``; fp32 training in fp32.
    Megatron-FSDP (ZeRO-2/3, ``zero_stage`` 2-3): ``--megatron-fsdp-main-grads-dtype``, whose default
    ``auto`` is the param dtype (``_resolve_group_grad_dtype``, ``megatron_fsdp/param_and_grad_buffer.py``;
    ``grad_reduce_in_fp32`` is not read under ``distributed/fsdp/``): bf16 grads for a bf16 model, unless
    ``fp32`` is asked. (megatron-core 0.16.1 had no such flag; its FSDP reduced in fp32 under bf16
    through ``grad_reduce_in_fp32``. The course follows main.)"""
    if precision not in PRECISIONS:
        raise rules.UsageError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}")
    if fsdp_main_grads_dtype not in FSDP_MAIN_GRADS_DTYPES:
        raise rules.UsageError(f"fsdp_main_grads_dtype={fsdp_main_grads_dtype!r} (--megatron-fsdp-main-grads-dtype) is "
                               f"not one of {', '.join(FSDP_MAIN_GRADS_DTYPES)}")
    if zero_stage >= 2:
        return precision if fsdp_main_grads_dtype == "auto" else fsdp_main_grads_dtype
    if precision == "bf16":
        return "bf16" if grad_reduce_in_bf16 else "fp32"
    if precision == "fp16":
        return "fp32" if accumulate_allreduce_grads_in_fp32 else "fp16"
    return "fp32"


def megatron_state_bytes(num_params: float, dp: int = 1, zero_stage: int = 0, precision: str = "bf16",
                         grad_dtype: str | None = None) -> ModelStateBytes:
    """Model-state bytes per rank under Megatron-LM's flags (``d = dp``: the dp x cp ranks it shards over).

    ``zero_stage`` 0 (DDP) and 1 (``--use-distributed-optimizer``): Megatron's table,
    :func:`megatron_optimizer_bytes_per_param` times ``num_params`` -- 16-bit params, grads in
    ``grad_dtype``, fp32 main params (and main grads when the grads are 16-bit) and Adam's moments over d.
    2 and 3 (Megatron-FSDP ``optim_grads`` / ``optim_grads_params``): grads in ``grad_dtype`` over d, at
    stage 3 the params too; the optimizer keeps fp32 main params and Adam's moments over d (12, fp32
    training 8) and reads its main grads from the grad buffer. ``grad_dtype`` defaults to
    :func:`megatron_grad_dtype` (bf16: fp32 grads at stages 0-1, bf16 at 2-3)."""
    _checks.positive_number("num_params", num_params)
    _checks.positive_int("dp", dp)
    if zero_stage not in (0, 1, 2, 3):
        raise rules.UsageError(f"zero_stage={zero_stage!r} is not one of 0, 1, 2, 3 (ZeRO-DP stages)")
    grad_dtype = megatron_grad_dtype(precision, zero_stage) if grad_dtype is None else grad_dtype
    if zero_stage <= 1:
        per = megatron_optimizer_bytes_per_param(dp, zero_stage == 1, precision, grad_dtype)
        return ModelStateBytes(per.weights * num_params, per.grads * num_params, per.optimizer * num_params)
    if grad_dtype not in _DTYPE_BYTES:
        raise rules.UsageError(f"grad_dtype={grad_dtype!r} is not one of {', '.join(_DTYPE_BYTES)}")
    param, grad = _DTYPE_BYTES[precision], _DTYPE_BYTES[grad_dtype]
    optimizer = 8 + (4 if param == 2 else 0)
    return ModelStateBytes(param * num_params / (dp if zero_stage == 3 else 1), grad * num_params / dp,
                           optimizer * num_params / dp)


def optimizer_offload_bytes_per_param(dp: int = 1, distributed_optimizer: bool = False,
                                      params_dtype: str = "bf16", grad_dtype: str = "fp32") -> dict:
    """Bytes per parameter with ``--optimizer-cpu-offload``: what stays on the host and what moves.

    ZeRO-Offload (Ren et al. 2021, arXiv:2101.06840, §4.1) and Megatron-LM's ``HybridDeviceOptimizer``
    (``megatron/core/optimizer/cpu_offloading/hybrid_optimizer.py``, main ~108-114): the fp32 main params
    (4 bytes) and Adam's two moments (8) live on the host, with a host copy of the grad shard that it
    allocates in its fp32 params' dtype (4, whatever the grad dtype): **16** bytes per parameter on the
    host. Each step the grad shard moves device -> host (in the grad dtype) and the updated params host
    -> device. The device keeps only the model's params and grads
    (:func:`megatron_optimizer_bytes_per_param`'s ``weights`` and ``grads``); its optimizer term is 0.
    All host terms are divided by ``d`` with the distributed optimizer (each rank offloads its shard).
    Returns ``{"device_optimizer", "host", "host_grads", "d2h", "h2d"}`` (``host_grads``: the fp32 grad
    copy's share of ``host``).
    """
    base = megatron_optimizer_bytes_per_param(dp, distributed_optimizer, params_dtype, grad_dtype)
    share = dp if distributed_optimizer else 1
    return {"device_optimizer": 0.0, "host": 16 / share, "host_grads": 4 / share, "d2h": base.grads / share,
            "h2d": base.weights / share}
