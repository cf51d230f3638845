"""The rule book: every rule a parallel layout and a training run obey, each written once.

Each rule is a function that returns what it checked (or derived) and otherwise raises a
one-line :class:`UsageError` in one style::

    <name>=<value> <what is wrong>; <the fix>

Names: the parallel sizes by Megatron-LM's flag (``tensor-model-parallel-size``, ...), every other
value by Megatron's argument name (``num_attention_heads``, ``seq_length``, ``lr``), as Megatron's own
``validate_args`` writes them; so a rule reads the same whoever applies it. Pure Python (no torch, no
numpy): the ground floor every other module may import. ``tests/test_rules_are_called.py`` checks
that no module derives a rule again; ``tests/test_rules.py`` that each one is listed here.

The map
-------
* values -- :func:`integer`, :func:`number`, :func:`probability`, :func:`rank_in`, :func:`precision`,
  :func:`loss_scale`, :func:`removed_flag`;
* launch (processes on this machine) -- :func:`launch_ranks`, :func:`timeout_seconds`;
* layout (Megatron's ``validate_args``, ``initialize_model_parallel``, ``TransformerConfig``) --
  :func:`data_parallel_size`, :func:`order_ends_with_pp`, :func:`heads_divisible_by_tp`,
  :func:`query_groups`, :func:`heads_divisible_by_groups`, :func:`heads_divisible_by_cp`,
  :func:`hidden_divisible_by_heads`, :func:`tp_split`, :func:`ffn_divisible_by_tp`,
  :func:`vocab_size_with_padding`, :func:`vocab_divisible_by_tp`, :func:`pipeline_split`,
  :func:`pipeline_ranks`, :func:`virtual_pipeline_size`, :func:`virtual_pipeline`,
  :func:`interleaved_microbatch_group`, :func:`sequence_split`, :func:`sequence_parallel`,
  :func:`sequence_parallel_split`, :func:`num_microbatches`, :func:`cp_attention_dropout`;
* a run -- :func:`max_position_embeddings`, :func:`min_lr`, :func:`split_holds_a_sample`,
  :func:`fits_in_memory`, :func:`finite_loss_and_grad`;
* mixture of experts (Megatron's ``MoELayer``, the expert grid of ``topology.RankGrid``) --
  :func:`moe_experts`, :func:`expert_data_parallel_size`, :func:`expert_order`,
  :func:`moe_ffn_divisible_by_expert_tp`, :func:`moe_sequence_parallel`, :func:`moe_bias_with_expert_tp`,
  :func:`moe_context_parallel`, :func:`moe_dispatcher`, :func:`moe_state_sharding`;
* state sharding (distributed optimizer, Megatron-FSDP, DeepSpeed's ZeRO over DP) --
  :func:`sharding_stage`, :func:`sharding_flags`, :func:`sharding_layout`, :func:`deepspeed_layout`;
* checkpoints -- :func:`checkpoint_flags`, :func:`course_checkpoint`, :func:`megatron_fsdp_checkpoint`,
  :func:`checkpoint_layout`, :func:`checkpoint_model`.

The messages' helpers (:func:`divisors`, :func:`nearby_multiples`, :func:`format_bytes`) are here
because the rules' messages use them. Helpers that are not rules live with their domain: the ring
cost model in :mod:`course_lib.ring_cost`, DeepSpeed's batch arithmetic in
:mod:`course_lib.deepspeed.schema`, the machine's free memory in :mod:`course_lib.training.arguments`,
the ``grade`` command's inputs in :mod:`course_lib.classroom.grading.inputs`. Which code applies a
rule: ``git grep "rules.<name>"``.
"""

from __future__ import annotations

import math
import os
from numbers import Integral, Real


class UsageError(ValueError):
    """A person's input breaks a rule: one line naming the value, the rule and a fix.

    The command line (``python -m course_lib``, ``python -m course_lib.train``) prints it as
    ``error: <message>`` and exits 2; any other exception is a bug and keeps its traceback. A
    ``ValueError``, so code that catches ``ValueError`` catches it too."""


# Megatron's command-line flag for each parallel axis (dp has none: it is derived).
AXIS_FLAG = {
    "tp": "tensor-model-parallel-size",
    "pp": "pipeline-model-parallel-size",
    "cp": "context-parallel-size",
    "ep": "expert-model-parallel-size",
    "dp": "data-parallel-size",
}
TP, PP, CP, DP = (AXIS_FLAG[a] for a in ("tp", "pp", "cp", "dp"))

UNEVEN_FLAGS = "decoder_first_pipeline_num_layers / decoder_last_pipeline_num_layers"
VPP = "virtual_pipeline_model_parallel_size"

SP_WITHOUT_TP = ("sequence_parallel has no effect with tensor-model-parallel-size=1: turned off, as Megatron "
                 "does (Disabling sequence parallelism because tensor model parallelism is disabled)")
"""The one line every entry point prints when it turns sequence parallelism off (tp = 1)."""


# ============================================================================ values


def precision(bf16: bool, fp16: bool) -> str:
    """``"bf16"``, ``"fp16"`` or ``"fp32"``; both flags -> ValueError (Megatron's ``validate_args``
    asserts ``not args.fp16`` under ``args.bf16``)."""
    if bf16 and fp16:
        raise UsageError("--bf16 and --fp16 are mutually exclusive (Megatron's validate_args asserts "
                         "not args.fp16 under args.bf16): pass one of them")
    return "bf16" if bf16 else "fp16" if fp16 else "fp32"


def loss_scale(loss_scale_value, initial_loss_scale, min_loss_scale, loss_scale_window, hysteresis) -> tuple:
    """The fp16 loss-scale flags (Megatron's ``--loss-scale`` (None: dynamic), ``--initial-loss-scale``,
    ``--min-loss-scale``, ``--loss-scale-window``, ``--hysteresis``), returned as
    ``(loss_scale, initial, min, window: int, hysteresis: int)``."""
    if loss_scale_value is not None:
        loss_scale_value = number("loss_scale", loss_scale_value, 0.0, low_open=True)
    initial = number("initial_loss_scale", initial_loss_scale, 0.0, low_open=True)
    minimum = number("min_loss_scale", min_loss_scale, 0.0, low_open=True)
    if minimum > initial:
        raise UsageError(f"min_loss_scale={min_loss_scale!r} must be <= initial_loss_scale={initial_loss_scale!r}; "
                         "lower --min-loss-scale or raise --initial-loss-scale")
    window = number("loss_scale_window", loss_scale_window, 1.0)
    if window != int(window):
        raise UsageError(f"loss_scale_window={loss_scale_window!r} must be a whole number of iterations")
    return loss_scale_value, initial, minimum, int(window), integer("hysteresis", hysteresis)


def removed_flag(flag: str, value, replacement: str) -> None:
    """Refuse a flag Megatron-LM removed, in the words of its ``validate_args``
    (``megatron/training/arguments.py``: "--model-parallel-size is no longer valid, use
    --tensor-model-parallel-size instead"). ``value`` None means the flag was not given."""
    if value is not None:
        raise UsageError(f"--{flag} is no longer valid, use --{replacement} instead")


def integer(name: str, value, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` as an int, or ValueError unless it is an integer (not a bool) in ``[minimum, maximum]``."""
    ok = isinstance(value, Integral) and not isinstance(value, bool)
    if ok and value >= minimum and (maximum is None or value <= maximum):
        return int(value)
    bound = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
    raise UsageError(f"{name}={value!r} must be an integer {bound}")


def number(name: str, value, low: float | None = None, high: float | None = None, *,
           low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a float, or ValueError unless it is a finite real number (not a bool) in the
    interval from ``low`` to ``high`` (closed ends unless ``low_open`` / ``high_open``)."""
    ok = isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = ((low is None or (value > low if low_open else value >= low))
              and (high is None or (value < high if high_open else value <= high)))
    if ok:
        return float(value)
    if low is not None and high is not None:
        bound = f"in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    elif low is not None:
        bound = f"a finite number {'>' if low_open else '>='} {low:g}"
    elif high is not None:
        bound = f"a finite number {'<' if high_open else '<='} {high:g}"
    else:
        bound = "a finite number"
    raise UsageError(f"{name}={value!r} must be {bound}")


def probability(name: str, value) -> float:
    """A dropout probability: a finite number in ``[0, 1)``."""
    return number(name, value, 0.0, 1.0, high_open=True)


MAX_LAUNCH_RANKS = 1024        # each rank is a process with its own torch (~300 MB): more is not a laptop's
MIN_TIMEOUT_S = 1.0            # below this the ranks' TCP rendezvous itself times out (a torch traceback)
MAX_TIMEOUT_S = 7 * 24 * 3600  # a week: longer is a typo, and some OS timers overflow


def launch_ranks(name: str, value) -> int:
    """The number of rank processes one launch starts on this machine: an integer in ``1..MAX_LAUNCH_RANKS``."""
    if isinstance(value, Integral) and not isinstance(value, bool) and value > MAX_LAUNCH_RANKS:
        raise UsageError(f"{name}={value} starts more processes than one machine runs ({MAX_LAUNCH_RANKS} at most); "
                         f"use several nodes, or fewer ranks")
    return integer(name, value)


def timeout_seconds(name: str, value, unit_s: float = 1.0) -> float:
    """A timeout of ``value`` units of ``unit_s`` seconds (60: Megatron's ``--distributed-timeout-minutes``),
    returned in seconds: finite, from :data:`MIN_TIMEOUT_S` to :data:`MAX_TIMEOUT_S`."""
    units = "second" if unit_s == 1 else "minute" if unit_s == 60 else f"x {unit_s:g} s"
    low, high = MIN_TIMEOUT_S / unit_s, MAX_TIMEOUT_S / unit_s
    if isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value) and 0 < value < low:
        raise UsageError(f"{name}={value!r} is shorter than a rendezvous takes; give at least {low:.3g} {units}"
                         f"{'' if low == 1 else 's'} (e.g. {name}={60 / unit_s:g})")
    return number(name, value, low, high) * unit_s


def rank_in(name: str, value, size: int, size_name: str) -> int:
    """A rank (or index) of a group of ``size``: an integer in ``0..size-1``."""
    if isinstance(value, Integral) and not isinstance(value, bool) and 0 <= value < size:
        return int(value)
    raise UsageError(f"{name}={value!r} must be an integer in 0..{size - 1} for {size_name}={size}")


# ============================================================================ helpers for the messages


def divisors(n: int) -> list[int]:
    """All positive divisors of ``n``, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


def _divisor_list(n: int, limit: int = 12) -> str:
    ds = divisors(n)
    return ", ".join(map(str, ds)) if len(ds) <= limit else ", ".join(map(str, ds[:limit])) + ", ..."


def nearby_multiples(value: int, step: int) -> str:
    """The multiples of ``step`` just below and above ``value`` (positive ones), e.g. ``"28 or 32"``."""
    low = (value // step) * step
    return " or ".join(str(c) for c in (low, low + step) if c > 0)


def format_bytes(num_bytes: float) -> str:
    """Bytes for a message, decimal units: ``"23.8 GB"``, ``"15,400 TB"``."""
    if num_bytes >= 1e15:
        return f"{num_bytes / 1e12:,.0f} TB"
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.3g} {unit}"
    return f"{num_bytes / 1e3:.3g} kB"


def _use_divisor(value: int, size_name: str) -> str:
    return f"use a {size_name} that divides {value} ({_divisor_list(value)})"


# ============================================================================ layout


def data_parallel_size(world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, *,
                       encoder_tp: int = 0, encoder_pp: int = 0) -> int:
    """``world_size / (tp·pp·cp)``: the derived (dense) data-parallel size, a whole number (never a flag).
    Expert parallelism does not divide it (the expert grid's: :func:`expert_data_parallel_size`).

    ``encoder_tp`` / ``encoder_pp``: Megatron-core 0.9-0.13's encoder ranks, which every replica
    holds on top of the decoder's (``initialize_model_parallel``: ``(tp·pp + encoder_tp·encoder_pp)·cp``
    ranks per replica); 0 when there is no encoder, as Megatron prints them."""
    world_size = integer("world_size", world_size)
    sizes = {a: integer(AXIS_FLAG[a], v) for a, v in (("tp", tp), ("pp", pp), ("cp", cp))}
    encoder = integer("encoder-tensor-model-parallel-size", encoder_tp, 0) * integer(
        "encoder-pipeline-model-parallel-size", encoder_pp, 0)
    model = (sizes["tp"] * sizes["pp"] + encoder) * sizes["cp"]
    if world_size % model:
        parts = " × ".join(f"{AXIS_FLAG[a]}={v}" for a, v in sizes.items() if v > 1 or a in ("tp", "pp"))
        if encoder:
            parts = (f"(tensor-model-parallel-size={tp} × pipeline-model-parallel-size={pp} + encoder-tensor-model-"
                     f"parallel-size={encoder_tp} × encoder-pipeline-model-parallel-size={encoder_pp})"
                     + (f" × {AXIS_FLAG['cp']}={sizes['cp']}" if sizes["cp"] > 1 else ""))
        raise UsageError(f"world_size={world_size} is not divisible by {parts} = {model}; choose sizes whose "
                         f"product divides {world_size} ({DP} = world_size / product is derived)")
    return world_size // model


def order_ends_with_pp(order: str, last_axis: str, pp: int, cp: int) -> None:
    """Megatron's ``initialize_model_parallel`` asserts that a rank order with pp > 1 and cp > 1 ends in pp."""
    if pp > 1 and cp > 1 and last_axis != "pp":
        raise UsageError(f"order='{order}' must end with 'pp' when {PP}={pp} and {CP}={cp} (Megatron's "
                         f"initialize_model_parallel asserts it); use e.g. order='tp-cp-ep-dp-pp'")


def heads_divisible_by_tp(num_attention_heads: int, tp: int) -> int:
    """Attention is split by whole heads: ``num_attention_heads % tp == 0``; returns heads per rank."""
    if num_attention_heads % tp:
        raise UsageError(f"num_attention_heads={num_attention_heads} is not divisible by {TP}={tp}; "
                         f"{_use_divisor(num_attention_heads, TP)}")
    return num_attention_heads // tp


def query_groups(num_query_groups: int, num_attention_heads: int | None, tp: int) -> None:
    """Grouped-query attention: the groups split over TP, and the heads split into the groups."""
    if num_query_groups % tp:
        raise UsageError(f"num_query_groups={num_query_groups} is not divisible by {TP}={tp}; "
                         f"{_use_divisor(num_query_groups, TP)}")
    if num_attention_heads is not None:
        heads_divisible_by_groups(num_attention_heads, num_query_groups)


def heads_divisible_by_groups(num_attention_heads: int, num_query_groups: int) -> int:
    """Grouped-query attention shares each K/V head among ``num_attention_heads / num_query_groups``
    query heads; returns that number."""
    if num_attention_heads % num_query_groups:
        raise UsageError(f"num_attention_heads={num_attention_heads} is not divisible by num_query_groups="
                         f"{num_query_groups}; use num_query_groups from {_divisor_list(num_attention_heads)}")
    return num_attention_heads // num_query_groups


def heads_divisible_by_cp(num_attention_heads: int, num_query_groups: int, cp: int) -> int:
    """All-to-all context parallelism (DeepSpeed-Ulysses, Megatron's ``--cp-comm-type a2a``) gives each
    CP rank whole heads for the whole sequence: the query heads and the K/V heads (query groups)
    split over CP. Returns the query heads per rank."""
    for name, value, what in (("num_attention_heads", num_attention_heads, "heads"),
                              ("num_query_groups", num_query_groups, "K/V heads")):
        if value % cp:
            raise UsageError(f"{name}={value} is not divisible by {CP}={cp}: all-to-all (Ulysses) attention "
                             f"splits the {what} over the CP group; use the ring (cp_comm_type='p2p') or a "
                             f"{CP} that divides {value} ({_divisor_list(value)})")
    return num_attention_heads // cp


def hidden_divisible_by_heads(hidden_size: int, num_attention_heads: int) -> int:
    """Every head gets ``hidden_size / num_attention_heads`` channels; returns that number."""
    if hidden_size % num_attention_heads:
        raise UsageError(f"hidden_size={hidden_size} is not divisible by num_attention_heads={num_attention_heads}; "
                         f"use a hidden_size that is a multiple of {num_attention_heads}, e.g. "
                         f"{nearby_multiples(hidden_size, num_attention_heads)}")
    return hidden_size // num_attention_heads


def tp_split(name: str, size: int, tp: int) -> int:
    """A dimension split evenly over TP -- a column-parallel layer's output features, a row-parallel
    layer's input features (Megatron's ``divide`` in ``core/utils.py``); returns the size per rank."""
    if size % tp:
        raise UsageError(f"{name}={size} is not divisible by {TP}={tp}; use a multiple of {tp}, e.g. "
                         f"{nearby_multiples(size, tp)}")
    return size // tp


def ffn_divisible_by_tp(ffn_hidden_size: int, tp: int) -> int:
    """The MLP's fc1 is column-parallel: ``ffn_hidden_size % tp == 0``; returns the columns per rank."""
    return tp_split("ffn_hidden_size", ffn_hidden_size, tp)


def vocab_size_with_padding(orig_vocab_size: int, tensor_model_parallel_size: int = 1,
                            make_vocab_size_divisible_by: int = 128) -> int:
    """Megatron's padded vocabulary (``_vocab_size_with_padding`` in ``megatron/training/tokenizer``):
    ``orig_vocab_size`` rounded up to a multiple of ``make_vocab_size_divisible_by ·
    tensor_model_parallel_size`` (``--make-vocab-size-divisible-by``, default 128), so that the
    vocab-parallel embedding splits evenly."""
    orig = integer("orig_vocab_size", orig_vocab_size)
    multiple = (integer("make_vocab_size_divisible_by", make_vocab_size_divisible_by)
                * integer(TP, tensor_model_parallel_size))
    return -(-orig // multiple) * multiple


def vocab_divisible_by_tp(padded_vocab_size: int, tp: int) -> int:
    """The vocab-parallel embedding splits its rows evenly over TP; returns the rows per rank."""
    if padded_vocab_size % tp:
        above = -(-padded_vocab_size // tp) * tp
        raise UsageError(f"vocab_size={padded_vocab_size} (padded) is not divisible by {TP}={tp}: the vocab-parallel "
                         f"embedding splits its rows evenly; pad the vocabulary to a multiple of {tp}, e.g. {above} "
                         f"(a make_vocab_size_divisible_by that is a multiple of {tp})")
    return padded_vocab_size // tp


def pipeline_split(num_layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[int]:
    """The transformer layers on each pipeline stage.

    Even (``num_layers % pp == 0``, an error otherwise, as in Megatron), or uneven when made
    explicit with Megatron's ``decoder_first_pipeline_num_layers`` / ``..._last_...`` (each
    ``>= 1``, needing pp > 1), the remaining layers dividing evenly over the middle stages."""
    for name, v in (("decoder_first_pipeline_num_layers", first), ("decoder_last_pipeline_num_layers", last)):
        if v is not None:
            integer(name, v)
            if pp == 1:
                raise UsageError(f"{name}={v} needs {PP} > 1; drop it or raise {PP}")
    if first is None and last is None:
        if num_layers % pp:
            raise UsageError(f"num_layers={num_layers} is not divisible by {PP}={pp}; "
                             f"{_use_divisor(num_layers, PP)} or make the uneven split explicit with {UNEVEN_FLAGS}")
        return [num_layers // pp] * pp
    rest = num_layers - (first or 0) - (last or 0)
    middle = pp - (first is not None) - (last is not None)
    if rest < 0 or (middle == 0 and rest != 0) or (middle > 0 and rest % middle):
        raise UsageError(f"num_layers={num_layers} minus decoder_first_pipeline_num_layers={first} and "
                         f"decoder_last_pipeline_num_layers={last} leaves {rest} layers for {middle} middle "
                         f"stage(s), not an even split; choose first/last so the rest divides by {max(middle, 1)}")
    stages = [rest // middle if middle else 0] * pp
    if first is not None:
        stages[0] = first
    if last is not None:
        stages[-1] = last
    return stages


def virtual_pipeline_size(num_layers: int, pp: int, *, virtual_pipeline_model_parallel_size: int | None = None,
                          num_layers_per_virtual_pipeline_stage: int | None = None,
                          num_virtual_stages_per_pipeline_rank: int | None = None,
                          uneven: bool = False) -> int | None:
    """Model chunks per pipeline rank from one of Megatron's three spellings (None: no interleaving).

    ``--num-layers-per-virtual-pipeline-stage`` counts layers per chunk and needs an even split
    (Megatron's validate_args: "please use --num-virtual-stages-per-pipeline-rank ... when enable
    uneven pipeline parallelism"); a size of 1 means the plain schedule, as in Megatron."""
    given = {name: v for name, v in (("virtual_pipeline_model_parallel_size", virtual_pipeline_model_parallel_size),
                                     ("num_layers_per_virtual_pipeline_stage", num_layers_per_virtual_pipeline_stage),
                                     ("num_virtual_stages_per_pipeline_rank", num_virtual_stages_per_pipeline_rank))
             if v is not None}
    if len(given) > 1:
        raise UsageError(f"{' and '.join(f'{n}={v}' for n, v in given.items())} are given together; give only one "
                         f"of --virtual-pipeline-model-parallel-size, --num-layers-per-virtual-pipeline-stage, "
                         f"--num-virtual-stages-per-pipeline-rank")
    if not given:
        return None
    (name, value), = given.items()
    integer(name, value)
    if name == "num_layers_per_virtual_pipeline_stage":
        if pp == 1:
            raise UsageError(f"{name}={value} needs {PP} > 1 (interleaved schedule); drop it or raise {PP}")
        if uneven:
            raise UsageError(f"{name}={value} cannot describe an uneven pipeline split ({UNEVEN_FLAGS}); use "
                             f"num_virtual_stages_per_pipeline_rank (--num-virtual-stages-per-pipeline-rank), as "
                             f"Megatron's validate_args asks")
        per_stage = pipeline_split(num_layers, pp)[0]
        if per_stage % value:
            raise UsageError(f"{name}={value} does not divide the {per_stage} layers per pipeline stage "
                             f"(num_layers={num_layers} / {PP}={pp}); use one of {_divisor_list(per_stage)}")
        value = per_stage // value
    return None if value == 1 else value


def virtual_pipeline(vpp: int, pp: int, layers_per_stage: list[int] | None) -> list[int]:
    """Interleaving needs pp > 1, and every stage's layers divide into ``vpp`` equal chunks;
    returns the layers of one model chunk of each stage."""
    integer(VPP, vpp)
    if pp == 1:
        raise UsageError(f"{VPP}={vpp} needs {PP} > 1 (interleaved schedule); drop it or raise {PP}")
    for stage, n in enumerate(layers_per_stage or []):
        if n % vpp:
            raise UsageError(f"stage {stage} has {n} layers, not divisible by {VPP}={vpp}; use a "
                             f"{VPP} that divides {n} ({_divisor_list(n)})")
    return [n // vpp for n in layers_per_stage or []]


def pipeline_ranks(num_stages: int, vp_size: int) -> int:
    """The pipeline ranks of ``num_stages`` virtual stages, ``vp_size`` model chunks each:
    ``num_stages / vp_size``, a whole number."""
    integer("num_stages", num_stages)
    if num_stages % integer("vp_size", vp_size):
        raise UsageError(f"num_stages={num_stages} is not divisible by vp_size={vp_size}; num_stages counts "
                         f"the virtual stages, pp_size * vp_size")
    return num_stages // vp_size


def interleaved_microbatch_group(pp_size: int, num_microbatches: int, vp_size: int,
                                 microbatch_group_size: int | None = None) -> int:
    """Megatron's rules for the interleaved schedule; returns the micro-batch group size used.

    ``microbatch_group_size`` is ``--microbatch-group-size-per-virtual-pipeline-stage``
    (default ``pp_size``): how many consecutive micro-batches run on one model chunk before
    switching. ``forward_backward_pipelining_with_interleaving`` requires
    ``pp_size <= group <= num_microbatches`` and ``num_microbatches % group`` 0 or ``>= pp_size``;
    with the default group that is ``num_microbatches % pp_size == 0``."""
    integer("pp_size", pp_size)
    integer("num_microbatches", num_microbatches)
    integer("vp_size", vp_size)
    if pp_size < 2:
        raise UsageError(f"the interleaved schedule needs {PP} >= 2, got pp_size={pp_size}: with one stage "
                         f"there is nothing to interleave")
    if vp_size < 2:
        raise UsageError(f"vp_size={vp_size}: the interleaved schedule needs >= 2 model chunks per rank; Megatron "
                         f"treats virtual-pipeline size 1 as no interleaving: use schedule_1f1b")
    group = pp_size if microbatch_group_size is None else integer("microbatch_group_size", microbatch_group_size)
    if group > num_microbatches or group < pp_size:
        raise UsageError(f"microbatch_group_size_per_vp_stage={group} must be in [pp_size={pp_size}, "
                         f"num_microbatches={num_microbatches}]: use more micro-batches or a group size between them")
    remainder = num_microbatches % group
    if 0 < remainder < pp_size:
        raise UsageError(f"num_microbatches={num_microbatches} % microbatch_group_size_per_vp_stage={group} = "
                         f"{remainder} must be 0 or >= pp_size={pp_size} (a smaller last group would stall the "
                         f"pipeline): change num_microbatches or the group size")
    return group


def sequence_split(seq_length: int, cp: int, layout: str = "zigzag") -> int:
    """Context parallelism cuts the sequence into equal chunks: ``2·cp`` for the load-balanced
    (zigzag) causal split, two per rank, as Megatron's ``validate_args`` asks; ``cp`` for the
    contiguous one. Returns the chunk length."""
    integer("seq_length", seq_length)
    integer(CP, cp)
    chunks = 2 * cp if layout == "zigzag" else cp
    if seq_length % chunks:
        if layout == "zigzag":
            rule = (f"2 × {CP}={cp} = {chunks} (load-balanced causal CP gives each rank 2 of 2·cp chunks)")
        else:
            rule = f"{CP}={cp} (each rank holds seq_length/cp consecutive tokens)"
        raise UsageError(f"seq_length={seq_length} is not divisible by {rule}; use a multiple of {chunks}, e.g. "
                         f"{nearby_multiples(seq_length, chunks)}")
    return seq_length // chunks


def sequence_parallel(sequence_parallel: bool, tp: int) -> tuple[bool, str | None]:
    """Megatron's policy for sequence parallelism with tp = 1: off, said in one line.

    Returns ``(sequence_parallel as it applies, note or None)``; the note is :data:`SP_WITHOUT_TP`."""
    if sequence_parallel and tp == 1:
        return False, SP_WITHOUT_TP
    return bool(sequence_parallel), None


def sequence_parallel_split(seq_length: int, cp: int, tp: int) -> int:
    """Sequence parallelism splits each CP rank's ``seq_length / cp`` tokens over TP; returns tokens per rank."""
    local = seq_length // cp
    if local % tp:
        step = math.lcm(2 * cp, cp * tp) if cp > 1 else tp
        raise UsageError(f"sequence_parallel: seq_length/{CP} = {local} is not divisible by {TP}={tp}; use a "
                         f"seq_length that is a multiple of {step}, e.g. {nearby_multiples(seq_length, step)}")
    return local // tp


def num_microbatches(global_batch_size: int, micro_batch_size: int, dp: int) -> int:
    """Micro-batches per step per pipeline: ``global_batch_size / (micro_batch_size · dp)``, a whole number."""
    per_step = micro_batch_size * dp
    if global_batch_size % per_step:
        raise UsageError(f"global_batch_size={global_batch_size} is not divisible by micro_batch_size="
                         f"{micro_batch_size} × {DP}={dp} = {per_step}; use a multiple of {per_step}, e.g. "
                         f"{nearby_multiples(global_batch_size, per_step)}")
    return global_batch_size // per_step


def cp_attention_dropout(attention_dropout: float, cp: int | None = None) -> None:
    """Ring attention (context parallelism) computes attention blockwise with no dropout.

    ``cp``: the context-parallel size (the rule applies when > 1); None for a layer that is
    context-parallel by construction."""
    if attention_dropout and (cp is None or cp > 1):
        where = "context parallelism" if cp is None else f"{CP}={cp}"
        raise UsageError(f"attention_dropout={attention_dropout} is not supported with {where}: ring attention "
                         f"has no dropout; use attention_dropout=0")


# ============================================================================ run


def max_position_embeddings(max_positions: int, seq_length: int) -> int:
    """A learned position table must cover every position of a sample."""
    if max_positions < seq_length:
        raise UsageError(f"max_position_embeddings={max_positions} is shorter than seq_length={seq_length}; "
                         f"use a max_position_embeddings >= {seq_length}")
    return max_positions


def min_lr(min_lr_value: float, lr: float) -> None:
    """The learning rate decays towards ``min_lr``, which may not exceed ``lr`` (Megatron asserts it)."""
    if min_lr_value > lr:
        raise UsageError(f"min_lr={min_lr_value:g} is larger than lr={lr:g} (Megatron's validate_args asserts "
                         f"min_lr <= lr); use a min_lr <= {lr:g}")


def split_holds_a_sample(split_name: str, num_documents: int, num_tokens: int, seq_length: int) -> None:
    """A sample is ``seq_length + 1`` consecutive tokens of one ``--split`` part of the data (tokens and
    shifted labels; megatron-core's ``GPTDataset`` draws none from a smaller split)."""
    if num_tokens <= seq_length:
        raise UsageError(f"the {split_name} split has {num_documents} documents, {num_tokens} tokens: not one "
                         f"sample of seq_length {seq_length} + 1; give it more of the data with --split (e.g. "
                         f"90,8,2) or a shorter --seq-length")


def fits_in_memory(flag: str, value, needed_bytes: float, available_bytes: float | None, detail: str) -> None:
    """Refuse a run whose estimated memory exceeds what this machine has, naming the flag that
    weighs most (``flag=value``) and what the bytes are (``detail``). ``available_bytes`` None: unknown."""
    if available_bytes is not None and needed_bytes > available_bytes:
        raise UsageError(f"{flag}={value} needs about {format_bytes(needed_bytes)} of memory ({detail}) but this "
                         f"machine has {format_bytes(available_bytes)} available; use a smaller {flag}")


def finite_loss_and_grad(iteration: int, lm_loss: float | None, grad_norm: float | None) -> None:
    """Megatron's ``--check-for-nan-in-loss-and-grad`` (on by default; ``rerun_state_machine`` in
    ``pretrain_gpt.loss_func`` and the DDP grad check): a loss or grad norm that is NaN or infinite
    ends training at that iteration. A skipped fp16 iteration (overflow) is not checked: the loss
    scaler handles it."""
    for name, value in (("lm_loss", lm_loss), ("grad_norm", grad_norm)):
        if value is not None and not math.isfinite(value):
            raise UsageError(f"{name}={value} at iteration {iteration} is not finite, so training stops there "
                             f"(Megatron's --check-for-nan-in-loss-and-grad); lower --lr or --init-method-std, "
                             f"or pass --no-check-for-nan-in-loss-and-grad to train on")


# ============================================================================ mixture of experts
# Megatron: megatron/training/arguments.py (validate_args, "Expert parallelism check", "MoE Spec check").

MOE_DISPATCHERS = ("alltoall", "allgather")


def moe_experts(num_experts, ep: int = 1) -> int | None:
    """``--num-experts`` (None or 0: no MoE, as Megatron) divisible by ``--expert-model-parallel-size``;
    ep > 1 needs experts. Returns num_experts or None."""
    if num_experts in (None, 0):
        if ep > 1:
            raise UsageError(f"{AXIS_FLAG['ep']}={ep} needs experts: set num-experts (a multiple of {ep}) or use "
                             f"{AXIS_FLAG['ep']}=1")
        return None
    n = integer("num-experts", num_experts)
    if n % ep:
        raise UsageError(f"num-experts={n} is not divisible by {AXIS_FLAG['ep']}={ep}; each expert-parallel rank "
                         f"holds num_experts / ep experts: use a multiple of {ep}, e.g. {nearby_multiples(n, ep)}")
    return n


def moe_ffn_divisible_by_expert_tp(moe_ffn_hidden_size: int, expert_tp: int) -> int:
    """Each expert's fc1 is column-parallel over the expert-TP group; returns the columns per rank."""
    if moe_ffn_hidden_size % expert_tp:
        raise UsageError(f"moe-ffn-hidden-size={moe_ffn_hidden_size} is not divisible by "
                         f"expert-tensor-parallel-size={expert_tp}; use a multiple of {expert_tp}, e.g. "
                         f"{nearby_multiples(moe_ffn_hidden_size, expert_tp)}")
    return moe_ffn_hidden_size // expert_tp


def moe_sequence_parallel(num_experts, tp: int, sequence_parallel: bool) -> None:
    """MoE with TP > 1 trains only with sequence parallelism, as in Megatron-LM: ``MoELayer.forward``
    raises in training when the attention TP group has more than one rank and SP is off
    (``megatron/core/transformer/moe/moe_layer.py``, main d98e8a6 ~636-640; core_v0.16.1 ~379-383).
    ``ModelParallelConfig.__post_init__`` only warns, and only with EP > 1 (``model_parallel_config.py``
    ~560-565); the assertion once in ``yaml_arguments.py`` is legacy. Without SP every TP rank would
    route the same tokens: the experts would see each token tp times."""
    if num_experts and tp > 1 and not sequence_parallel:
        raise UsageError(f"num-experts={num_experts} with {TP}={tp} needs sequence parallelism: Megatron's MoELayer "
                         f"refuses to train without it ('During training, performance may degrade if MoE and tensor "
                         f"parallelism are enabled without also enabling sequence parallelism.'); add "
                         f"--sequence-parallel")


def moe_bias_with_expert_tp(num_experts, add_bias_linear: bool, expert_tp: int) -> None:
    """Experts with biases only at expert TP 1, as megatron-core asserts (``TransformerConfig.__post_init__``,
    ``transformer_config.py`` ~1587 in 0.16.1): a row-parallel fc2 returns its bias beside the partial sums
    and the expert adds it, times the gate, on every expert-TP rank, so the reduce-scatter would count it
    ``expert_tp`` times."""
    if num_experts and add_bias_linear and expert_tp > 1:
        raise UsageError(f"num-experts={num_experts} with {EXPERT_TP}={expert_tp} and biased linears: megatron-core "
                         f"refuses it ('Bias in Moe is only supported when ETP==1'); add --disable-bias-linear, or "
                         f"use {EXPERT_TP}=1")


def moe_context_parallel(num_experts, cp: int) -> None:
    """The course's MoE model is proven against one process without context parallelism only (Megatron
    supports CP with MoE: the aux-loss statistics are summed over the tp-cp group); refuse until tested."""
    if num_experts and cp > 1:
        raise UsageError(f"num-experts={num_experts} with {CP}={cp}: the course's MoE model is not tested with "
                         f"context parallelism yet; use {CP}=1 (expert layers fold CP into EP and expert DP in "
                         f"Megatron)")


def moe_state_sharding(num_experts, sharding_flags) -> None:
    """``--num-experts`` with a flag that routes the gradients and the optimizer through the sharding
    engine (``--use-distributed-optimizer``, ``--use-megatron-fsdp``, ...: ``course_lib.distributed``)
    is refused: the engine reduces and shards over the dense dp-cp group, while expert gradients must be
    summed over the expert data-parallel group (Megatron's ``expert_data_parallel_group`` buffers).
    ``sharding_flags``: the names of the engine flags this run sets."""
    flags = [f"--{f.strip('-').replace('_', '-')}" for f in sharding_flags or ()]
    if num_experts and flags:
        raise UsageError(f"--num-experts={num_experts} with {' / '.join(flags)}: the course's sharding engine "
                         f"knows nothing of expert data parallelism yet (expert grads and optimizer state belong "
                         f"to the expert-DP group); drop {' and '.join(flags)} for MoE runs (the trainer's "
                         f"all-reduce reduces experts over expert DP)")


def moe_dispatcher(dispatcher: str) -> str:
    """``--moe-token-dispatcher-type``: one of :data:`MOE_DISPATCHERS`."""
    if dispatcher not in MOE_DISPATCHERS:
        raise UsageError(f"moe-token-dispatcher-type={dispatcher!r} is unknown; use one of "
                         f"{', '.join(MOE_DISPATCHERS)}")
    return dispatcher


EXPERT_TP = "expert-tensor-parallel-size"


def expert_data_parallel_size(world_size: int, expert_tp: int, ep: int, pp: int) -> int:
    """The expert grid's derived data-parallel size ``world_size / (expert_tp·ep·pp)``, a whole number
    (Megatron's second ``RankGenerator``, ``initialize_model_parallel``; cp = 1 there)."""
    model = expert_tp * ep * pp
    if world_size % model:
        raise UsageError(f"world_size={world_size} is not divisible by {EXPERT_TP}={expert_tp} × {AXIS_FLAG['ep']}="
                         f"{ep} × {PP}={pp} = {model}; choose expert sizes whose product divides {world_size} "
                         f"(expert data-parallel size = world_size / product is derived)")
    return world_size // model


def expert_order(order: str, last_axis: str, pp: int, dp: int, expert_dp: int) -> None:
    """Megatron asserts that an order not ending in ``pp`` (with pp > 1) gives the dense and the expert grid
    the same data-parallel size (``initialize_model_parallel``)."""
    if pp > 1 and last_axis != "pp" and expert_dp != dp:
        raise UsageError(f"order='{order}' does not end with 'pp', so dense data-parallel size {dp} and expert "
                         f"data-parallel size {expert_dp} must be equal (Megatron asserts it); use an order ending "
                         f"in 'pp', e.g. 'tp-cp-ep-dp-pp'")


# ============================================================================ state sharding
# Megatron: megatron/training/arguments.py (validate_args: --overlap-param-gather, Megatron-FSDP,
# --optimizer-cpu-offload) and megatron/core/optimizer/optimizer_config.py; the course's engine:
# course_lib.distributed.

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""Megatron-FSDP's ``--data-parallel-sharding-strategy`` values, by ZeRO stage (0: DDP, 1: optimizer
state, 2: + grads, 3: + params sharded over DP)."""


def sharding_stage(strategy: str) -> int:
    """The ZeRO stage of a ``--data-parallel-sharding-strategy`` value (its index in
    :data:`SHARDING_STRATEGIES`): what the sharding engine shards, and what ``ds-config`` maps
    DeepSpeed's stages to."""
    if strategy not in SHARDING_STRATEGIES:
        raise UsageError(f"--data-parallel-sharding-strategy={strategy!r} is unknown; use one of "
                         f"{', '.join(SHARDING_STRATEGIES)}")
    return SHARDING_STRATEGIES.index(strategy)


def sharding_flags(*, use_distributed_optimizer: bool, use_megatron_fsdp: bool, strategy: str,
                   overlap_grad_reduce: bool, overlap_param_gather: bool, optimizer_cpu_offload: bool = False,
                   use_precision_aware_optimizer: bool = False, optimizer: str = "adam") -> None:
    """The state-sharding flags together, as Megatron's ``validate_args`` (plus the course's
    no_shard + overlap-param-gather, where there is nothing to gather). The trainer passes every
    flag; the sharding engine (:mod:`course_lib.distributed`) its strategy and overlap flags (its
    ``cpu_offload`` is one switch, not Megatron's offload + precision-aware pair)."""
    sharding_stage(strategy)
    if overlap_param_gather and not (use_distributed_optimizer or use_megatron_fsdp):
        raise UsageError("--overlap-param-gather only supported with distributed optimizer or megatron fsdp "
                         "(Megatron's validate_args): add --use-distributed-optimizer or drop the flag")
    if overlap_param_gather and not overlap_grad_reduce:
        raise UsageError("--overlap-param-gather needs --overlap-grad-reduce (Megatron: 'Must use "
                         "--overlap-param-gather with --overlap-grad-reduce'): add --overlap-grad-reduce")
    if overlap_param_gather and use_megatron_fsdp and strategy == "no_shard":
        raise UsageError("--overlap-param-gather with --data-parallel-sharding-strategy no_shard: every rank "
                         "already holds the updated params, there is nothing to gather; use optim or above")
    if optimizer_cpu_offload and not use_precision_aware_optimizer:
        raise UsageError("--optimizer-cpu-offload must be used with --use-precision-aware-optimizer (Megatron's "
                         "validate_args: the hybrid device optimizer reuses its code path): add that flag")
    if use_precision_aware_optimizer and optimizer != "adam":
        raise UsageError(f"--use-precision-aware-optimizer only supported with adam (Megatron's OptimizerConfig), "
                         f"got optimizer={optimizer}: use --optimizer adam")
    if use_precision_aware_optimizer and not use_distributed_optimizer:
        raise UsageError("--use-precision-aware-optimizer only supported with distributed optimizer (megatron-core's "
                         "OptimizerConfig asserts it): add --use-distributed-optimizer")


def sharding_layout(strategy: str, *, vpp: int, pipeline_schedule: str, num_microbatches: int) -> None:
    """What the course's engine (:mod:`course_lib.distributed`) can run inside the trainer: one
    model chunk per rank (it wraps one module; Megatron wraps each virtual stage in its own DDP),
    and ZeRO-3 needs each micro-batch's backward to follow its own forward's gather (GPipe runs
    every forward first, so the engine would meet a released unit in backward)."""
    if vpp > 1:
        raise UsageError(f"virtual-pipeline-model-parallel-size={vpp} with the sharding flags: the course's "
                         f"engine wraps one model chunk per rank; drop the virtual pipeline stages")
    if strategy == "optim_grads_params" and pipeline_schedule == "gpipe" and num_microbatches > 1:
        raise UsageError(f"--data-parallel-sharding-strategy optim_grads_params with --pipeline-schedule gpipe and "
                         f"{num_microbatches} micro-batches: ZeRO-3 re-gathers a unit for the backward that "
                         f"follows its forward; use --pipeline-schedule 1f1b")


# ---------------------------------------------------------------------------- checkpoints

CKPT_FORMATS = ("torch_dist", "torch", "torch_dcp", "fsdp_dtensor")
"""Megatron's ``--ckpt-format`` values (``torch_dist`` is its default; Megatron-FSDP asks for ``fsdp_dtensor``)."""
CKPT_FORMATS_WRITTEN = ("torch_dist", "torch")
"""The formats the course's checkpoints are written in (``training.checkpointing``)."""


def checkpoint_flags(*, save, load, save_interval, exit_interval, ckpt_format: str, finetune: bool,
                     no_load_optim: bool, no_load_rng: bool) -> None:
    """The checkpoint flags on their own (Megatron's ``_add_checkpointing_args``): intervals >= 1,
    a known format, a folder for every flag that needs one."""
    if ckpt_format not in CKPT_FORMATS:
        raise UsageError(f"ckpt_format={ckpt_format!r} is not one of Megatron's; use one of {', '.join(CKPT_FORMATS)}")
    for name, value in (("save_interval", save_interval), ("exit_interval", exit_interval)):
        if value is not None:
            integer(name, value)
    if save_interval is not None and not save:
        raise UsageError(f"save_interval={save_interval} has no folder to save into; add --save DIR")
    if save and save_interval is None:       # validate_args: core_v0.16.1 arguments.py:838, main :1362
        raise UsageError(f"save={save} without --save-interval: Megatron's validate_args asserts a save interval "
                         f"whenever --save is given; add --save-interval N (a save every N iterations; the end "
                         f"of training and --exit-interval save too)")
    for name, value in (("finetune", finetune), ("no_load_optim", no_load_optim), ("no_load_rng", no_load_rng)):
        if value and not load:
            raise UsageError(f"{name}=True says what to load, but there is no --load; add --load DIR")


def course_checkpoint(*, save, load, ckpt_format: str, num_experts) -> None:
    """What the course's trainer writes and reads: ``torch_dist`` or ``torch``; an MoE model ``torch_dist``
    only (its experts are pieces of the ``[E, ...]`` tensors at their EP offsets; the legacy files are per
    TP x PP rank and would hold one EP rank's experts)."""
    if (save or load) and ckpt_format not in CKPT_FORMATS_WRITTEN:
        raise UsageError(f"ckpt_format={ckpt_format!r} with --save/--load: the course writes its checkpoints as "
                         f"{' or '.join(CKPT_FORMATS_WRITTEN)} only; use --ckpt-format torch_dist (DCP shards with "
                         f"global offsets, what {ckpt_format} is built on too)"
                         + (", and shard with --use-distributed-optimizer: Megatron-FSDP asks for fsdp_dtensor"
                            if ckpt_format == "fsdp_dtensor" else ""))
    if num_experts and (save or load) and ckpt_format != "torch_dist":
        raise UsageError(f"num_experts={num_experts} with --ckpt-format {ckpt_format}: the course saves an MoE "
                         f"model as torch_dist only (the experts sharded over EP with global offsets); use "
                         f"--ckpt-format torch_dist")


def megatron_fsdp_checkpoint(ckpt_format) -> None:
    """Megatron-FSDP runs only with ``--ckpt-format fsdp_dtensor`` (``validate_args`` asserts it whether or not
    the run saves, core_v0.16.1 and main; ``torch_dist``, the default, is refused). ``None``: not given, as in
    ``megatron-cmd``, whose FSDP variants print the flag themselves."""
    if ckpt_format is not None and ckpt_format != "fsdp_dtensor":
        raise UsageError(f"ckpt_format={ckpt_format!r} with --use-megatron-fsdp: Megatron's validate_args asserts "
                         f"'Megatron FSDP only supports fsdp_dtensor checkpoint format' (torch_dist is the default); "
                         f"add --ckpt-format fsdp_dtensor, or shard with --use-distributed-optimizer instead")


def checkpoint_layout(path, saved: dict, run: dict, ckpt_format: str) -> None:
    """A legacy (``torch``) checkpoint holds one file per model-parallel rank: it loads only under the
    TP x PP x VP it was saved with (DP may change: its files are DP rank 0's, the optimizer gathered)."""
    keys = ("tp", "pp", "vpp")
    if ckpt_format == "torch" and any(saved[k] != run[k] for k in keys):
        def fmt(d):
            return " x ".join(f"{k.upper()}{d[k]}" for k in keys)
        raise UsageError(f"checkpoint {path} is in the legacy torch format, saved under {fmt(saved)}; this run is "
                         f"{fmt(run)}: the legacy format cannot change the layout; save it with --ckpt-format "
                         f"torch_dist (which reshards on load) or run the saved layout")


def checkpoint_model(path, saved: dict, run: dict) -> None:
    """The model a checkpoint holds is the model this run builds: every size flag equal."""
    for name in saved:
        if saved[name] != run.get(name):
            raise UsageError(f"checkpoint {path} holds a model with {name}={saved[name]} but this run builds "
                             f"{name}={run.get(name)}: another model; pass --{name.replace('_', '-')} "
                             f"{saved[name]} or --load another checkpoint")


def deepspeed_layout(tp: int, pp: int, cp: int, vpp=None, other_flags=()) -> None:
    """``--deepspeed-config`` trains the dense model with one process per data-parallel rank (DeepSpeed's
    ZeRO over DP; the course does not hand DeepSpeed an mpu): TP = PP = CP = 1, and the state sharding
    is the file's, so Megatron's sharding flags and MoE are not given with it."""
    sizes = {"tensor-model-parallel-size": tp, "pipeline-model-parallel-size": pp, "context-parallel-size": cp}
    for flag, value in sizes.items():
        if value != 1:
            raise UsageError(f"{flag}={value} with --deepspeed-config: DeepSpeed runs one process per data-parallel "
                             f"rank here (TP = PP = CP = 1); drop --{flag}")
    if vpp not in (None, 1):
        raise UsageError(f"virtual-pipeline-model-parallel-size={vpp} with --deepspeed-config: there is no "
                         f"pipeline (PP = 1); drop the flag")
    if other_flags:
        raise UsageError(f"--{other_flags[0]} with --deepspeed-config: the ds_config sets the state sharding and "
                         f"the model is dense; drop --{other_flags[0]}")
