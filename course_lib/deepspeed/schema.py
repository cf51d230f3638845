"""DeepSpeed 0.19.8's config parser, mirrored: the same verdict on a ds_config.json, in one line.

:func:`check` accepts exactly the files ``deepspeed.runtime.config.DeepSpeedConfig`` accepts for
the parts the bridge translates, and returns the values DeepSpeed reads from them (defaults filled
in, ``"3"`` read as ``3``, ``5e8`` as ``500000000``); what DeepSpeed refuses is a one-line
``ValueError`` naming the key. ``tests/deepspeed/test_ds_schema.py`` runs DeepSpeed's own parser on
a generated set of configs and compares the verdicts, and checks every table below against the
pydantic models it mirrors. Read in the 0.19.8 sources:

* the top level (``deepspeed/runtime/config.py``) is a plain dict reader: a key DeepSpeed does not
  read is **ignored**, silently (a typo such as ``"zero_optimisation"`` runs ZeRO-0); blocks removed
  after 0.19.5 (which still read ``amp``) are refused (``_REMOVED_TOP_LEVEL_CONFIG_KEYS``: ``elasticity``, ``amp``,
  ``sparse_gradients``, ...); the batch rule is :func:`deepspeed_batch`;
* each section is a pydantic model (``DeepSpeedConfigModel``: unknown keys refused, pydantic's lax
  coercion -- ``"yes"`` and ``1`` are true, ``"3"`` and ``3.0`` are 3 -- and a value ``"auto"``
  dropped, so DeepSpeed's default applies): ``zero_optimization`` (``runtime/zero/config.py``,
  :data:`ZERO`) with its ``offload_param`` / ``offload_optimizer`` blocks
  (``runtime/zero/offload_config.py``, :data:`OFFLOAD_PARAM`, :data:`OFFLOAD_OPTIMIZER`: each its own
  keys -- ``max_in_cpu`` is the param block's, ``ratio`` the optimizer's), ``fp16`` and ``bf16``
  (``runtime/precision_config.py``, :data:`FP16`, :data:`BF16`), with their validators;
* the ``optimizer`` and ``scheduler`` blocks are read as dicts (their ``params`` reach the optimizer
  only at ``deepspeed.initialize``).

The other keys DeepSpeed reads (:data:`DEEPSPEED_KEYS`: monitors, activation checkpointing, the
flops profiler, communication types, ...) are not translated and not mirrored: their verdict is
DeepSpeed's own, :func:`deepspeed_verdict` (``python -m course_lib ds-config`` runs it when DeepSpeed
is installed). Files are read with :func:`course_lib.safe_files.read_json`: a key given twice (which
DeepSpeed's loader refuses too) and ``NaN`` are refused.
"""

from __future__ import annotations

import difflib
import math
import re
import types
from dataclasses import dataclass, field

from course_lib import rules

VERSION = "0.19.8"
AUTO = "auto"
ISSUE = "deepspeedai/DeepSpeed#8489"     # where DeepSpeed 0.19 lists the features it removed

# ------------------------------------------------------------------------------------- the tables


@dataclass(frozen=True)
class Field:
    """One key of a pydantic section: ``kind`` (how DeepSpeed reads the value: a coercion of
    :data:`_COERCE`, ``bool?`` / ``int?`` for an ``Optional``, or the name of a nested section),
    pydantic's bounds (``ge``, ``gt``, ``le``, ``lt``) and the field ``name`` when the key is its alias."""

    kind: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    name: str | None = None


def _bools(*keys) -> dict:
    return {k: Field("bool") for k in keys}


OFFLOAD_PARAM = {"device": Field("device"), "nvme_path": Field("path?"), "buffer_count": Field("int", ge=0),
                 "buffer_size": Field("int", ge=0), "max_in_cpu": Field("int", ge=0), "pin_memory": Field("bool")}
OFFLOAD_OPTIMIZER = {"device": Field("device"), "nvme_path": Field("path?"), "buffer_count": Field("int", ge=0),
                     **_bools("pin_memory", "pipeline_read", "pipeline_write", "fast_init"),
                     "ratio": Field("float", ge=0.0, le=1.0), "super_offload": Field("bool"),
                     "cpuadam_cores_perc": Field("float", ge=0.0, le=1.0)}
ZENFLOW = {"topk_ratio": Field("float", gt=0.0, lt=1.0), "select_strategy": Field("strategy"),
           "select_interval": Field("auto_or_int"), "update_interval": Field("auto_or_int"),
           **_bools("overlap_step", "offload"), "auto_ratio": Field("float", ge=0.0, le=1.0),
           "full_warm_up_rounds": Field("int"), "pt_reserved_cores_perc": Field("float", ge=0.0, le=1.0),
           "steps_per_epoch": Field("int?")}
LEAF_MODULE = {"classes": Field("names"), "names": Field("names"), "name_suffixes": Field("names")}
ZERO = {
    "stage": Field("stage"), **_bools("contiguous_gradients", "reduce_scatter"),
    "reduce_bucket_size": Field("int", gt=0), "use_multi_rank_bucket_allreduce": Field("bool"),
    "allgather_partitions": Field("bool"), "allgather_bucket_size": Field("int", ge=0),
    "overlap_comm": Field("bool?"), **_bools("compute_grad_norm", "load_from_fp32_weights", "elastic_checkpoint"),
    "offload_param": Field("offload_param"), "offload_optimizer": Field("offload_optimizer"),
    "zenflow": Field("zenflow"), "sub_group_size": Field("int", ge=0),
    "cpu_offload_param": Field("bool?"), "cpu_offload_use_pin_memory": Field("bool?"), "cpu_offload": Field("bool?"),
    "stage3_prefetch_bucket_size": Field("int", ge=0, name="prefetch_bucket_size"),
    "stage3_param_persistence_threshold": Field("int", ge=0, name="param_persistence_threshold"),
    "stage3_model_persistence_threshold": Field("int", ge=0, name="model_persistence_threshold"),
    "stage3_max_live_parameters": Field("int", ge=0, name="max_live_parameters"),
    "stage3_max_reuse_distance": Field("int", ge=0, name="max_reuse_distance"),
    "stage3_gather_16bit_weights_on_model_save": Field("bool", name="gather_16bit_weights_on_model_save"),
    "stage3_module_granularity_threshold": Field("int", name="module_granularity_threshold"),
    "stage3_use_all_reduce_for_fetch_params": Field("bool", name="use_all_reduce_for_fetch_params"),
    "stage3_allgather_sequential": Field("bool", name="allgather_sequential"),
    "stage3_gather_fp16_weights_on_model_save": Field("bool"),
    **_bools("ignore_unused_parameters", "legacy_stage1", "round_robin_gradients", "parameter_alignment"),
    "zero_hpz_partition_size": Field("int", ge=0),
    **_bools("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
             "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply",
             "log_trace_cache_warnings", "enable_sanity_checks", "save_muon_momentum_buffer_in_memory"),
    "leaf_module": Field("leaf_module"),
}
FP16 = {"enabled": Field("bool"), "auto_cast": Field("bool"), "loss_scale": Field("loss_scale"),
        "initial_scale_power": Field("int"), "loss_scale_window": Field("scale_int"), "hysteresis": Field("int"),
        "consecutive_hysteresis": Field("bool"), "min_loss_scale": Field("scale_int"),
        "fp16_master_weights_and_grads": Field("bool")}
BF16 = _bools("enabled", "immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads",
              "bf16_optimizer_states")
SECTIONS = {"zero_optimization": ZERO, "offload_param": OFFLOAD_PARAM, "offload_optimizer": OFFLOAD_OPTIMIZER,
            "zenflow": ZENFLOW, "leaf_module": LEAF_MODULE, "fp16": FP16, "bf16": BF16}

# the deprecated ZeRO keys (``json_schema_extra={"deprecated": True, ...}``) -> the key they set
DEPRECATED = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param",
              "cpu_offload_use_pin_memory": None,
              "stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save"}
DEFAULTS = {
    "zero_optimization": {"stage": 0, "contiguous_gradients": True, "reduce_scatter": True,
                          "reduce_bucket_size": 500_000_000, "allgather_bucket_size": 500_000_000,
                          "overlap_comm": None, "offload_param": None, "offload_optimizer": None,
                          "stage3_prefetch_bucket_size": 50_000_000, "stage3_param_persistence_threshold": 100_000,
                          "stage3_max_live_parameters": 1_000_000_000, "stage3_max_reuse_distance": 1_000_000_000,
                          "sub_group_size": 1_000_000_000, "round_robin_gradients": False,
                          "compute_grad_norm": True},
    "offload_param": {"device": "none", "nvme_path": None, "buffer_count": 5, "buffer_size": 100_000_000,
                      "max_in_cpu": 1_000_000_000, "pin_memory": True},
    "zenflow": {"select_strategy": "auto", "select_interval": "auto", "update_interval": "auto"},
    "offload_optimizer": {"device": "none", "nvme_path": None, "buffer_count": 4, "pin_memory": True,
                          "pipeline_read": False, "pipeline_write": False, "fast_init": False, "ratio": 1.0,
                          "super_offload": False, "cpuadam_cores_perc": 0.8},
    "fp16": {"enabled": False, "auto_cast": False, "loss_scale": 0.0, "initial_scale_power": 16,
             "loss_scale_window": 1000, "hysteresis": 2, "consecutive_hysteresis": False, "min_loss_scale": 1,
             "fp16_master_weights_and_grads": False},
    "bf16": {"enabled": False, "immediate_grad_update": False, "check_grad_overflow": True,
             "bf16_master_weights_and_grads": False, "bf16_optimizer_states": False},
}

# runtime/config.py: _REMOVED_TOP_LEVEL_CONFIG_KEYS / _REMOVED_ZERO_CONFIG_KEYS, in DeepSpeed's words (shortened)
REMOVED = {
    "nebula": "Nebula checkpointing was removed", "compression_training": "the compression library was removed",
    "amp": "NVIDIA Apex AMP was removed: use the bf16 or fp16 block (or torch_autocast)",
    "quantize_training": "Mixture-of-Quantization was removed",
    "sparse_gradients": "sparse compression of dense embedding gradients was removed",
    "eigenvalue": "eigenvalue-based MoQ was removed", "sparse_attention": "Sparse Attention was removed",
    "elasticity": "elastic training was removed: set train_batch_size / train_micro_batch_size_per_gpu / "
                  "gradient_accumulation_steps directly",
    "graph_harvesting": "graph harvesting was removed",
    "curriculum_learning": "the top-level curriculum_learning was removed: use "
                           "data_efficiency.data_sampling.curriculum_learning",
    "progressive_layer_drop": "Progressive Layer Dropping was removed",
}
REMOVED_ZERO = {"mics_shard_size": "MiCS sharding was removed", "mics_hierarchical_params_gather":
                "MiCS sharding was removed", "zeropp_loco_param": "LoCo-ZeRO++ was removed"}
BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
# the top-level keys the bridge reads and mirrors DeepSpeed's checks of
MIRRORED = BATCH_KEYS + ("zero_optimization", "fp16", "bf16", "bfloat16", "optimizer", "scheduler",
                         "gradient_clipping", "steps_per_print")
# every top-level key DeepSpeed 0.19.8's parser reads, the removed ones aside (recorded live in the tests)
DEEPSPEED_KEYS = frozenset(MIRRORED) | {
    "activation_checkpointing", "aio", "autotuning", "checkpoint", "comet", "comms_logger", "communication_data_type",
    "compile", "csv_monitor", "data_efficiency", "data_types", "dataloader_drop_last", "datastates_ckpt",
    "disable_allgather", "disable_python_gc", "dump_state", "expert_parallel", "flops_profiler",
    "gradient_allreduce_op", "gradient_predivide_factor", "hybrid_engine", "log_level",
    "managed_gradient_accumulation", "memory_breakdown", "pipeline", "prescale_gradients",
    "seq_parallel_communication_data_type", "sequence_parallel_size", "tensor_parallel", "tensorboard", "timers", "torch_autocast",
    "use_data_before_expert_parallelism", "vocabulary_size", "wall_clock_breakdown", "wandb", "weight_quantization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer"}

# ------------------------------------------------------------------------------ pydantic's lax coercion

_TRUE, _FALSE = {"1", "on", "t", "true", "y", "yes"}, {"0", "off", "f", "false", "n", "no"}
_DIGITS = r"[0-9](?:_?[0-9])*"
_INT_TEXT = re.compile(rf"[+-]?{_DIGITS}(?:\.0(?:_?0)*)?")
_FLOAT_TEXT = re.compile(rf"[+-]?(?:{_DIGITS}(?:\.(?:{_DIGITS})?)?|\.{_DIGITS})(?:[eE][+-]?{_DIGITS})?"
                         r"|[+-]?(?:inf|infinity|nan)", re.I)
_I64 = 2.0 ** 63
_WHITESPACE = " \t\n\r\f\v"


class _Refused(Exception):
    """A value DeepSpeed's model refuses: ``str(err)`` says what it takes."""


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _bool(v) -> bool:
    if isinstance(v, bool):
        return v
    if (_is_int(v) or isinstance(v, float)) and v in (0, 1):
        return bool(v)
    if isinstance(v, str) and v.lower() in _TRUE | _FALSE:
        return v.lower() in _TRUE
    raise _Refused('true or false (DeepSpeed also reads 0/1 and "yes"/"no", "on"/"off")')


def _int(v) -> int:
    if isinstance(v, bool):
        return int(v)
    if _is_int(v):
        return v
    if isinstance(v, float) and math.isfinite(v) and v == int(v) and -_I64 <= v < _I64:
        return int(v)
    if isinstance(v, str) and _INT_TEXT.fullmatch(v.strip(_WHITESPACE)):
        return int(v.strip(_WHITESPACE).split(".")[0].replace("_", ""))
    raise _Refused("a whole number")


def _float(v) -> float:
    if isinstance(v, bool) or _is_int(v) or isinstance(v, float):
        return float(v)
    if isinstance(v, str) and _FLOAT_TEXT.fullmatch(v.strip(_WHITESPACE)):
        return float(v.strip(_WHITESPACE).replace("_", ""))
    raise _Refused("a number")


def _loss_scale(v) -> float:
    """``fp16.loss_scale``'s own validator: Python's ``float()``, finite, ``>= 0``, not a bool."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise _Refused("a number >= 0 (0: dynamic loss scaling)")
    try:
        value = float(v)
    except ValueError:
        raise _Refused("a number >= 0 (0: dynamic loss scaling)") from None
    if not math.isfinite(value) or value < 0:
        raise _Refused("a finite number >= 0 (0: dynamic loss scaling)")
    return value


def _scale_int(v) -> int:
    """``loss_scale_window`` / ``min_loss_scale``: their validator (``int(v)`` works, no bool) and an int."""
    if isinstance(v, bool) or (isinstance(v, float) and not math.isfinite(v)):
        raise _Refused("a whole number")
    try:
        int(v)
    except (TypeError, ValueError):
        raise _Refused("a whole number") from None
    return _int(v)


def _stage(v) -> int:
    try:
        stage = _int(v)
    except _Refused:
        stage = None
    if stage not in (0, 1, 2, 3):
        raise _Refused("0, 1, 2 or 3")
    return stage


def _device(v) -> str:
    if not isinstance(v, str) or v not in ("none", "cpu", "nvme"):
        raise _Refused('"cpu", "nvme" or "none" (lower case)')
    return v


def _strategy(v) -> str:
    if not isinstance(v, str) or v not in ("auto", "step", "epoch"):
        raise _Refused('"auto", "step" or "epoch"')
    return v


def _auto_or_int(v):
    if isinstance(v, str):
        raise _Refused('"auto" or a whole number')
    return _int(v)


def _names(v) -> list:
    """A list of strings (``leaf_module``'s validator turns one string into a list of it)."""
    if isinstance(v, str):
        return [v]
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise _Refused("a list of strings")
    return v


def _path(v):
    if v is not None and not isinstance(v, str):
        raise _Refused("a folder path (a string) or null")
    return v


_COERCE = {"bool": _bool, "int": _int, "float": _float, "loss_scale": _loss_scale, "scale_int": _scale_int,
           "stage": _stage, "device": _device, "path": _path, "strategy": _strategy, "auto_or_int": _auto_or_int,
           "names": _names}


def _show(value) -> str:
    import json

    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _refuse(path: str, value, what: str, fix: str = "fix the value") -> rules.UsageError:
    return rules.UsageError(f"{path}={_show(value)} is not {what} for DeepSpeed {VERSION}; {fix}")


# ------------------------------------------------------------------------------------ the sections


class _Reader:
    """What reading one config collects: ``notes`` (``(key, reason)``) and ``given`` (the dotted keys the
    file sets, a key given by its field name under its JSON name)."""

    def __init__(self):
        self.notes: list = []
        self.given: set = set()

    def model(self, block, section: str, path: str) -> dict:
        """A pydantic section (``section`` names its table in :data:`SECTIONS`) as DeepSpeed reads it:
        ``{key: value}`` with DeepSpeed's defaults for what is absent."""
        table = SECTIONS[section]
        if not isinstance(block, dict):
            raise _refuse(path, block, "an object {...}", "write the block as a JSON object")
        by_name = {f.name: key for key, f in table.items() if f.name}
        out, given = dict(DEFAULTS.get(section, {})), set()
        for key, value in block.items():
            known = by_name.get(key, key)
            if known not in table:
                near = difflib.get_close_matches(key, list(table) + list(by_name), n=1, cutoff=0.75)
                other = {"offload_param": "offload_optimizer", "offload_optimizer": "offload_param"}.get(section)
                hint = (f"it is a key of the other offload block, {other}" if key in SECTIONS.get(other, ()) else
                        f"did you mean {path}.{near[0]}?" if near else
                        f"{section}'s keys are {', '.join(sorted(table))}")
                raise rules.UsageError(f"{path}.{key} is not a key of DeepSpeed {VERSION}'s {section} block (pydantic "
                                       f"refuses unknown keys); {hint}")
            if known in given:
                raise rules.UsageError(f"{path} has both {known} and its field name {table[known].name}: DeepSpeed "
                                       f"refuses the pair; keep one")
            if value == AUTO:
                default = out.get(known)
                self.notes.append((f"{path}.{known}", '"auto" is dropped by DeepSpeed, so its default'
                                   + (f" {_show(default)}" if default is not None else "") + " applies (the "
                                   "Hugging Face Trainer fills the value in before DeepSpeed reads the file)"))
                continue
            given.add(known)
            self.given.add(f"{path}.{known}")
            out[known] = self.value(table[known], value, f"{path}.{known}")
        _deprecated(out, given, path)
        if section == "zenflow" and isinstance(out.get("update_interval"), int) and out["update_interval"] < 1:
            raise _refuse(f"{path}.update_interval", out["update_interval"], '"auto" or a whole number >= 1')
        return out

    def value(self, f: Field, value, path: str):
        kind = f.kind
        if kind in ("offload_param", "offload_optimizer", "zenflow"):        # Optional[a section]
            return None if value is None else self.model(value, kind, path)
        if kind == "leaf_module":                                            # its validator: null is {}
            return self.model({} if value is None else value, kind, path)
        if kind.endswith("?"):
            if value is None:
                return None
            kind = kind[:-1]
        try:
            out = _COERCE[kind](value)
        except _Refused as err:
            raise _refuse(path, value, str(err)) from None
        for bound, text, ok in ((f.ge, ">=", lambda b: out >= b), (f.gt, ">", lambda b: out > b),
                                (f.le, "<=", lambda b: out <= b), (f.lt, "<", lambda b: out < b)):
            if bound is not None and not ok(bound):
                raise _refuse(path, value, f"{text} {bound:g}")
        return out


def _deprecated(out: dict, given: set, path: str) -> None:
    """DeepSpeed's deprecated ZeRO keys set their replacement, and refuse to be given with it."""
    for old, new in DEPRECATED.items():
        if old not in given or old not in out:
            continue
        value = out.pop(old)
        if new is None:
            continue
        if new in given:
            raise rules.UsageError(f"{path}.{old} is deprecated and {path}.{new} is given too: DeepSpeed {VERSION} "
                                   f"refuses both together; keep {new}")
        if new.startswith("offload_"):
            device = {"device": "cpu"} if value else None
            out[new] = None if device is None else dict(DEFAULTS[new], **device)
        else:
            out[new] = value


def _zero(config: dict, reader: _Reader) -> dict:
    """``zero_optimization`` as DeepSpeed reads it (``get_zero_config``), with its validators."""
    block = config.get("zero_optimization", {})
    if isinstance(block, bool):                          # the deprecated format: true = stage 1
        reader.notes.append(("zero_optimization", f"{_show(block)} is DeepSpeed's deprecated form of "
                                                  f'{{"stage": {int(block)}}}'))
        zero = dict(DEFAULTS["zero_optimization"], stage=int(block))
        size = config.get("allgather_size", AUTO)
        if block and size != AUTO:
            zero["allgather_bucket_size"] = reader.value(ZERO["allgather_bucket_size"], size, "allgather_size")
    else:
        if isinstance(block, dict):
            for key, why in REMOVED_ZERO.items():
                if key in block:
                    raise rules.UsageError(f"zero_optimization.{key} is refused by DeepSpeed {VERSION}: {why} "
                                           f"({ISSUE}); drop it")
        zero = reader.model(block, "zero_optimization", "zero_optimization")
    if zero["overlap_comm"] is None:                     # overlap_comm_valid: on by default at stage 3 only
        zero["overlap_comm"] = zero["stage"] == 3
    if not zero["compute_grad_norm"] and zero["stage"] not in (1, 2):
        raise rules.UsageError(f"zero_optimization.compute_grad_norm=false with stage {zero['stage']}: DeepSpeed allows "
                               f"it at stages 1 and 2 only; drop it")
    ratio = (zero["offload_optimizer"] or {}).get("ratio", 1.0)
    if ratio < 1.0 and zero["stage"] != 3:
        raise rules.UsageError(f"zero_optimization.offload_optimizer.ratio={ratio:g} with stage {zero['stage']}: partial "
                               f"offload is ZeRO-3 only in DeepSpeed; set stage 3 or drop ratio")
    return zero


def _precision(config: dict, zero: dict, reader: _Reader) -> tuple[dict, dict]:
    """``fp16`` and ``bf16`` (or the old ``bfloat16``) as DeepSpeed reads them, with their checks."""
    fp16 = reader.model(config.get("fp16", {}), "fp16", "fp16")
    bf16_key = "bf16" if config.get("bf16") is not None else "bfloat16"
    bf16 = reader.model(config.get(bf16_key, {}), "bf16", bf16_key)
    if fp16["enabled"] and fp16["loss_scale"] == 0:
        for key in ("loss_scale_window", "min_loss_scale"):
            if fp16[key] <= 0:
                raise rules.UsageError(f"fp16.{key}={fp16[key]} must be > 0 with dynamic loss scaling (loss_scale 0) "
                                       f"in DeepSpeed; set it >= 1")
    if fp16["enabled"] and bf16["enabled"]:
        raise rules.UsageError("fp16.enabled and bf16.enabled are both true: DeepSpeed (and Megatron's --bf16 / --fp16) "
                               "takes one of them; disable one")
    needs_zero = [f"fp16.{k}" for k in ("fp16_master_weights_and_grads",) if fp16[k]] + [
        f"{bf16_key}.{k}" for k in ("bf16_master_weights_and_grads", "bf16_optimizer_states") if bf16[k]]
    if needs_zero and zero["stage"] == 0:
        raise rules.UsageError(f"{needs_zero[0]}=true needs ZeRO stage 1, 2 or 3 in DeepSpeed; set zero_optimization.stage")
    if bf16["bf16_optimizer_states"] and not bf16["bf16_master_weights_and_grads"]:
        raise rules.UsageError(f"{bf16_key}.bf16_optimizer_states=true needs bf16_master_weights_and_grads=true in "
                               f"DeepSpeed; set it or drop bf16_optimizer_states")
    return fp16, bf16


def _blocks(config: dict) -> None:
    """``optimizer`` and ``scheduler``: DeepSpeed reads them as dicts (``.keys()``), the optimizer's type
    with ``.lower()``, and compares its ``params.max_grad_norm`` with 0."""
    for key in ("optimizer", "scheduler"):
        if key in config and not isinstance(config[key], dict):
            raise _refuse(key, config[key], "an object {...}", f'write {{"type": ..., "params": {{...}}}}')
    opt = config.get("optimizer")
    if not opt or opt.get("type") is None:
        return
    if not isinstance(opt["type"], str):
        raise _refuse("optimizer.type", opt["type"], "a string", 'name the optimizer, e.g. "AdamW"')
    params = opt.get("params")
    if params is None:
        return
    if not isinstance(params, dict):
        raise _refuse("optimizer.params", params, "an object {...}")
    if "max_grad_norm" in params:
        try:
            params["max_grad_norm"] > 0
        except TypeError:
            raise _refuse("optimizer.params.max_grad_norm", params["max_grad_norm"], "a number",
                          "use the top-level gradient_clipping instead") from None


# ------------------------------------------------------------------------------------ the verdict


@dataclass
class Checked:
    """A config as DeepSpeed reads it: ``zero`` / ``fp16`` / ``bf16`` (every key of the section, defaults
    filled in; ``zero["offload_param"]`` / ``["offload_optimizer"]`` a dict or None), ``batch``
    ``(train_batch_size, micro, accumulation)`` (None when the file has no batch key and none was
    required), ``dp`` (the data-parallel size the batch was checked for), ``notes`` (``(key, reason)``:
    values dropped, keys ignored), ``given`` (the dotted keys the file sets, under their JSON names)
    and the file's ``config``."""

    config: dict
    zero: dict
    fp16: dict
    bf16: dict
    batch: tuple | None
    dp: int
    notes: list = field(default_factory=list)
    given: set = field(default_factory=set)

    @property
    def stage(self) -> int:
        return self.zero["stage"]

    @property
    def precision(self) -> str:
        return "bf16" if self.bf16["enabled"] else "fp16" if self.fp16["enabled"] else "fp32"

    def offload(self, what: str) -> str:
        """The device ``offload_optimizer`` / ``offload_param`` (``what``) moves to: none, cpu or nvme."""
        return (self.zero[f"offload_{what}"] or {}).get("device", "none")


def implied_dp(config: dict) -> int | None:
    """The DP a file with all three batch keys implies (``train_batch_size / (micro x accumulation)``),
    None when it does not say (a key missing, or values that are not positive whole numbers)."""
    tbs, micro, ga = (config.get(k) for k in BATCH_KEYS)
    try:
        dp = tbs / (micro * ga)
    except (TypeError, ZeroDivisionError):
        return None
    return int(dp) if isinstance(dp, float) and dp >= 1 and dp == int(dp) else None


def deepspeed_batch(train_batch_size, micro_batch_size, gradient_accumulation_steps, world_size: int) -> tuple:
    """DeepSpeed 0.19.8's batch rule for ``world_size`` data-parallel ranks, as its config parser applies it
    (``deepspeed/runtime/config.py``: ``_set_batch_related_parameters``, ``_batch_assertion``,
    ``_do_error_check``), on the file's values as read (``None`` for a key the file does not have).

    The missing values are derived with Python's ``//`` exactly as DeepSpeed does (only
    ``train_batch_size``: one accumulation step, ``micro = train_batch_size // DP``), then
    ``train_batch_size = micro x accumulation x DP`` with all three ``> 0`` is required. Returns
    ``(train_batch_size, micro, accumulation)``; what DeepSpeed refuses (an assertion, or a
    ``TypeError`` / ``ZeroDivisionError`` from a value it cannot compute with: ``"auto"``, ``"8"``,
    ``0`` accumulation steps) is a one-line ``ValueError``."""
    tbs, micro, ga = train_batch_size, micro_batch_size, gradient_accumulation_steps
    given = ", ".join(f"{k}={v!r}" for k, v in (("train_batch_size", tbs), ("train_micro_batch_size_per_gpu", micro),
                                                ("gradient_accumulation_steps", ga)) if v is not None)
    rule = (f"; DeepSpeed needs train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps "
            f"x DP ({world_size}), all three > 0")
    try:
        if tbs is not None and micro is not None and ga is not None:
            pass
        elif tbs is not None and micro is not None:
            ga = tbs // micro // world_size
        elif tbs is not None and ga is not None:
            micro = tbs // world_size // ga
        elif micro is not None and ga is not None:
            tbs = micro * ga * world_size
        elif tbs is not None:
            ga, micro = 1, tbs // world_size
        elif micro is not None:
            tbs, ga = micro * world_size, 1
        else:
            raise rules.UsageError(f"{given or 'no batch size'} on {world_size} rank(s): DeepSpeed needs "
                                   f"train_batch_size or train_micro_batch_size_per_gpu; add one")
        for name, value in (("train_batch_size", tbs), ("train_micro_batch_size_per_gpu", micro),
                            ("gradient_accumulation_steps", ga)):
            if not value > 0:
                raise rules.UsageError(f"{name}={value!r} (from {given}) on {world_size} rank(s) is not > 0" + rule)
        if tbs != micro * ga * world_size:
            raise rules.UsageError(f"train_batch_size={tbs!r} != {micro!r} x {ga!r} x {world_size} (from {given})" + rule)
    except ZeroDivisionError:
        raise rules.UsageError(f"{given} on {world_size} rank(s): DeepSpeed divides by zero deriving the missing batch "
                               f"size (ZeroDivisionError){rule}") from None
    except TypeError as err:
        raise rules.UsageError(f"{given} on {world_size} rank(s): DeepSpeed cannot compute with these "
                               f"(TypeError: {err}){rule}; put whole numbers in the file") from None
    return tbs, micro, ga


def check(config, dp: int | None = None, *, require_batch: bool = True) -> Checked:
    """DeepSpeed's verdict on ``config`` (a dict read from a ds_config.json) for ``dp`` data-parallel
    ranks -- the DP the file implies when ``dp`` is None (see :func:`implied_dp`; 1 when it implies
    none). Returns what DeepSpeed reads (:class:`Checked`); raises a one-line ``ValueError`` for
    what DeepSpeed 0.19.8 refuses. ``require_batch=False``: a config without any batch key passes
    (the trainer's flags give the batch) instead of DeepSpeed's "needs train_batch_size"."""
    if not isinstance(config, dict):
        raise rules.UsageError(f"a ds_config is a JSON object {{...}}, not a {type(config).__name__}; write one")
    for key, why in REMOVED.items():
        if key in config:
            raise rules.UsageError(f"{key} is refused by DeepSpeed {VERSION}: {why} ({ISSUE}); drop the {key} block")
    reader = _Reader()
    zero = _zero(config, reader)
    fp16, bf16 = _precision(config, zero, reader)
    _blocks(config)
    world = rules.integer("--dp", dp) if dp is not None else implied_dp(config) or 1
    batch = None
    if require_batch or any(config.get(k) is not None for k in BATCH_KEYS):
        values = [config.get(k) for k in BATCH_KEYS]
        if AUTO in values:
            key = BATCH_KEYS[values.index(AUTO)]
            raise rules.UsageError(f'{key}="auto" is the Hugging Face Trainer\'s placeholder, which it replaces before '
                                   f"DeepSpeed reads the file; DeepSpeed {VERSION} itself refuses it: put the number in "
                                   f"the file")
        batch = deepspeed_batch(*values, world)
    read_too = {"allgather_size"} if isinstance(config.get("zero_optimization"), bool) else set()
    for key in config:
        if key not in DEEPSPEED_KEYS | read_too:
            near = difflib.get_close_matches(key, sorted(DEEPSPEED_KEYS), n=1, cutoff=0.75)
            reader.notes.append((key, f"ignored: DeepSpeed {VERSION} does not read this key (silently)"
                                      + (f"; did you mean {near[0]}?" if near else "")))
    reader.given |= {k for k in config if k in DEEPSPEED_KEYS}
    return Checked(config, zero, fp16, bf16, batch, world, reader.notes, reader.given)


def read(path, what: str = "ds_config") -> dict:
    """The ds_config in ``path``: :func:`course_lib.safe_files.read_json` (a key given twice, ``NaN``, bad
    JSON: one line naming the file, prefixed ``what``), a JSON object."""
    from course_lib.safe_files import read_json

    config = read_json(path, what)
    if not isinstance(config, dict):
        raise rules.UsageError(f"{what} {path}: a {type(config).__name__}, not a JSON object {{...}}; "
                               f"a ds_config is an object")
    return config


def deepspeed_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def import_deepspeed():
    """``deepspeed``, on its CPU accelerator unless CUDA is here (``DS_ACCELERATOR``, read at import;
    without oneCCL DeepSpeed's CPU accelerator talks gloo). ``ImportError`` (one line) without it.
    Its JIT-built ops are cached per Python environment (``TORCH_EXTENSIONS_DIR`` =
    ``<venv>/torch_extensions`` unless set): torch keys the cache by op name only, so two clones'
    environments sharing ``~/.cache`` would rebuild each other's ops. The first import in an
    environment builds them (:func:`course_lib.deepspeed.ops.ensure_built`, minutes on 2 cores)."""
    from course_lib.deepspeed.ops import ensure_built, set_environment

    if not deepspeed_installed():
        raise ImportError(f"DeepSpeed is not installed: pip install 'deepspeed=={VERSION}' (DS_BUILD_OPS=0)")
    set_environment()
    import deepspeed

    ensure_built()
    return deepspeed


def deepspeed_verdict(config: dict, dp: int = 1) -> str | None:
    """DeepSpeed's own parser (``DeepSpeedConfig``, every section and every key it reads) on ``config`` for
    ``dp`` ranks: None when it accepts the file, else its error as one line. The batch rule is
    DeepSpeed's for ``dp`` ranks (its ``_set_batch_related_parameters`` / ``_batch_assertion`` on the
    file's values); the parser then sees the batch resolved for the world it runs in (one process, or
    the ranks of an initialised ``deepspeed.comm``). Raises ``ImportError`` without DeepSpeed."""
    import_deepspeed()
    from deepspeed import comm
    from deepspeed.runtime.config import DeepSpeedConfig

    try:
        seen = comm.get_world_size()
    except (AssertionError, RuntimeError, AttributeError):
        seen = 1
    ns = types.SimpleNamespace(**{k: config.get(k) for k in BATCH_KEYS}, world_size=dp)
    try:
        DeepSpeedConfig._set_batch_related_parameters(ns)
        DeepSpeedConfig._batch_assertion(ns)
        micro, ga = ns.train_micro_batch_size_per_gpu, ns.gradient_accumulation_steps
        DeepSpeedConfig(dict(config, train_batch_size=micro * ga * seen, train_micro_batch_size_per_gpu=micro,
                             gradient_accumulation_steps=ga))
    except Exception as err:                   # noqa: BLE001 - every refusal of DeepSpeed's is a verdict
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        return f"{type(err).__name__}: " + (" / ".join(lines[:3]) if lines else "(no message)")
    return None
