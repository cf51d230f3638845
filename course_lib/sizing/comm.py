"""Communication volume per step, one parallel dimension at a time.

Conventions, everywhere in this module:

* results count **elements** (multiply by the bytes per element, 2 for bf16 activations and
  16-bit grads, 4 for fp32 grads), and
* they count what **one rank sends** (bytes out of its link), assuming bandwidth-optimal ring
  collectives (:func:`ring_elements_sent`, the course's one ring cost model): an all-reduce of
  N elements over g ranks sends ``2 N (g-1)/g`` per rank, an all-gather or reduce-scatter whose
  full tensor has N elements sends ``N (g-1)/g`` per rank (so SP's all-gather + reduce-scatter
  pair moves exactly what TP's all-reduce moves).

Sources: Narayanan et al. 2021 §3.2 (TP: ``8bsh(t-1)/t`` per layer per micro-batch, forward +
backward; PP: ``bsh`` per send between consecutive stages, forward and backward) and §3.3.1
(DP ring all-reduce scales with ``(d-1)/d``); Korthikanti et al. 2022 §4.2.2 (SP: all-gather +
reduce-scatter, same bandwidth as TP, plus one all-gather of the layer input in backward);
Rajbhandari et al. 2020 §7 (ZeRO: stages 1-2 move 2 Psi per rank like DP, stage 3 moves 3 Psi).
Megatron facts: the pipeline tensor is ``[s/cp (/t with SP), b, h]`` (pipeline_parallel/
schedules.py ``get_tensor_shapes``); gradients are reduced over the data-parallel group
*with* context parallelism (distributed/distributed_data_parallel.py ``dp_cp_group``).
"""

from __future__ import annotations

from course_lib import rules
from course_lib.ring_cost import ring_elements_sent  # the one ring cost model (re-exported by course_lib.sizing)
from course_lib.sizing import _checks


def tp_comm_per_layer(
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    tp: int,
    sequence_parallel: bool = False,
    recompute="none",
    cp: int = 1,
) -> dict:
    """Elements one TP rank sends for one transformer layer and one micro-batch.

    Narayanan §3.2: two all-reduces of ``bsh`` elements forward (after the attention projection
    and after MLP h->4h->h: the g operator), two backward (the f operator): ``8 bsh (t-1)/t``.
    With sequence parallelism each all-reduce becomes a reduce-scatter + all-gather pair
    (Korthikanti §4.2.2): the same ``8 bsh (t-1)/t``, plus (Korthikanti: "we store only the Y_i^s
    part ... and perform an extra all-gather in the backward pass") one all-gather of each GEMM
    block's input in backward: ``2 bsh (t-1)/t``. Full recompute re-runs the forward pass,
    collectives included: another ``4 bsh (t-1)/t``. Selective recompute re-runs no collective.
    ``s`` is the sequence a rank holds: ``seq_length / cp`` with context parallelism.

    Returns ``forward``, ``backward``, ``sp_backward_all_gather``, ``recompute_forward`` and
    ``total``; ``forward + backward`` is Narayanan's ``8bsh(t-1)/t``.
    """
    for name, value in (("seq_length", seq_length), ("micro_batch_size", micro_batch_size),
                        ("hidden_size", hidden_size), ("tensor-model-parallel-size", tp),
                        ("context-parallel-size", cp)):
        _checks.positive_int(name, value)
    rules.sequence_split(seq_length, cp, "contiguous")
    mode = _checks.recompute_mode(recompute)
    bsh = micro_batch_size * (seq_length // cp) * hidden_size
    # 2 all-reduces, or 2 x (all-gather + reduce-scatter): the same elements
    forward = 2 * ring_elements_sent("all_reduce", bsh, tp)
    backward = 2 * ring_elements_sent("all_reduce", bsh, tp)
    sp_extra = 2 * ring_elements_sent("all_gather", bsh, tp) if sequence_parallel else 0.0
    recompute_forward = forward if mode == "full" else 0.0
    return {
        "forward": forward,
        "backward": backward,
        "sp_backward_all_gather": sp_extra,
        "recompute_forward": recompute_forward,
        "total": forward + backward + sp_extra + recompute_forward,
    }


def pp_send_elements(
    seq_length: int, micro_batch_size: int, hidden_size: int, tp: int = 1, cp: int = 1,
    sequence_parallel: bool = False,
) -> int:
    """Elements of one pipeline send (one micro-batch, one stage boundary, one direction).

    Narayanan §3.2: ``bsh``. Megatron sends the tensor ``[s/cp, b, h]``, and ``[s/(cp t), b, h]``
    with sequence parallelism (each TP rank sends its own slice).
    """
    for name, value in (("seq_length", seq_length), ("micro_batch_size", micro_batch_size),
                        ("hidden_size", hidden_size), ("tensor-model-parallel-size", tp),
                        ("context-parallel-size", cp)):
        _checks.positive_int(name, value)
    s = rules.sequence_split(seq_length, cp, "contiguous")
    if sequence_parallel:
        s = rules.sequence_parallel_split(seq_length, cp, tp)
    return s * micro_batch_size * hidden_size


def pp_comm_per_iteration(
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    pp: int,
    num_microbatches: int,
    vp: int = 1,
    tp: int = 1,
    cp: int = 1,
    sequence_parallel: bool = False,
) -> dict:
    """Elements the busiest pipeline rank sends in one iteration.

    Every micro-batch crosses every stage boundary once forward (activation) and once backward
    (its gradient). A rank sends one activation per micro-batch per model chunk, except the
    chunk that holds the last layers, and one gradient per micro-batch per chunk, except the
    chunk that holds the first layers. So a middle rank sends ``2 m v`` tensors, the first and
    the last ``(2v - 1) m``; with ``pp = 1`` nothing. Returns ``per_send`` (elements),
    ``forward``, ``backward`` and ``total`` for the busiest rank.
    """
    _checks.positive_int("pipeline-model-parallel-size", pp)
    _checks.positive_int("num_microbatches", num_microbatches)
    _checks.positive_int("virtual-pipeline-model-parallel-size", vp)
    x = pp_send_elements(seq_length, micro_batch_size, hidden_size, tp, cp, sequence_parallel)
    m = num_microbatches
    if pp == 1:
        return {"per_send": x, "forward": 0, "backward": 0, "total": 0}
    if pp == 2:  # both ranks are an end of the pipeline
        forward, backward = (vp - 1) * m * x, vp * m * x
    else:
        forward = backward = vp * m * x
    return {"per_send": x, "forward": forward, "backward": backward, "total": forward + backward}


def dp_comm_per_iteration(num_params: float, dp: int, cp: int = 1, zero_stage: int = 0) -> dict:
    """Elements one rank sends to synchronise gradients (and ZeRO-3 params) in one iteration.

    Megatron reduces gradients over the data-parallel group including context parallelism,
    ``g = dp * cp`` ranks. A ring all-reduce of this rank's ``num_params`` gradients sends
    ``2 (g-1)/g N`` (Narayanan §3.3.1); ZeRO stages 1-2 and Megatron's distributed optimizer
    replace it by a reduce-scatter of gradients + an all-gather of updated params, the same
    volume (ZeRO §7.2.1: 2 Psi); stage 3 adds one more parameter all-gather, ``3 (g-1)/g N``
    (ZeRO §7.2.2: 1.5x). Returns ``group_size`` and ``total``.
    """
    _checks.positive_number("num_params", num_params)
    _checks.positive_int("dp", dp)
    _checks.positive_int("context-parallel-size", cp)
    _checks.non_negative_int("zero_stage", zero_stage)
    if zero_stage > 3:
        raise rules.UsageError(f"zero_stage={zero_stage} is not one of 0, 1, 2, 3 (ZeRO-DP stages)")
    g = dp * cp
    factor = 3 if zero_stage == 3 else 2
    return {"group_size": g, "total": factor * ring_elements_sent("all_gather", num_params, g)}


def dp_comm_bytes_per_iteration(num_params: float, dp: int, cp: int = 1, zero_stage: int = 0, *,
                                 grad_bytes: float = 2, param_bytes: float = 2) -> float:
    """Bytes one rank sends for :func:`dp_comm_per_iteration`'s collectives, each in its own dtype: the
    gradient reduction (all-reduce at stage 0, reduce-scatter from stage 1) in ``grad_bytes`` per element
    -- Megatron reduces in :func:`course_lib.sizing.memory.megatron_grad_dtype`, fp32 under bf16 --
    and the parameter all-gathers (one from stage 1, two at stage 3) in ``param_bytes``."""
    for name, value in (("grad_bytes", grad_bytes), ("param_bytes", param_bytes)):
        _checks.positive_number(name, value)
    elements = dp_comm_per_iteration(num_params, dp, cp, zero_stage)["total"]   # validates the arguments
    if zero_stage == 0:                                                          # one all-reduce of the grads
        return elements * grad_bytes
    gathers = 2 if zero_stage == 3 else 1
    one_pass = elements / (1 + gathers)                                          # (g-1)/g N per collective
    return one_pass * (grad_bytes + gathers * param_bytes)


def cp_comm_per_layer(
    seq_length: int,
    micro_batch_size: int,
    hidden_size: int,
    num_heads: int,
    cp: int,
    tp: int = 1,
    num_query_groups: int | None = None,
) -> dict:
    """Elements one rank sends in ring attention for one layer and one micro-batch.

    Each rank holds ``s/cp`` tokens; forward passes its K and V chunks around the ring: ``cp - 1``
    steps, each sending a K and a V chunk of ``(s/cp) * b * (h/a) * g/t`` elements (``g`` =
    query groups, ``g = a`` for full multi-head attention; with ``g < t`` each TP rank keeps one
    replicated K/V head). So ``forward = 2 (cp-1) * chunk``, exact.
    The backward pass circulates K, V again and returns their gradients dK, dV to their owners,
    about twice the forward volume; the exact step count depends on the implementation
    (Transformer Engine's p2p ring), so ``backward`` is flagged as an estimate.
    """
    for name, value in (("seq_length", seq_length), ("micro_batch_size", micro_batch_size),
                        ("context-parallel-size", cp), ("tensor-model-parallel-size", tp)):
        _checks.positive_int(name, value)
    _checks.model_shape(1, hidden_size, num_heads)
    g = num_heads if num_query_groups is None else _checks.positive_int("num_query_groups", num_query_groups)
    rules.query_groups(g, num_heads, 1)
    rules.heads_divisible_by_tp(num_heads, tp)
    rules.sequence_split(seq_length, cp, "contiguous")
    head_dim = hidden_size // num_heads
    kv_heads_per_rank = g // tp if g >= tp else 1  # Megatron replicates K/V heads when g < t
    chunk = (seq_length // cp) * micro_batch_size * head_dim * kv_heads_per_rank
    forward = 2 * (cp - 1) * chunk
    return {"chunk": chunk, "forward": forward, "backward_estimate": 2 * forward,
            "total_estimate": 3 * forward}
