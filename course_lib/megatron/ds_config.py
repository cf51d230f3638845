"""The ds_config.json bridge: a DeepSpeed config read as Megatron-LM flags.

``python -m course_lib ds-config FILE [--dp D] [--num-params N | --model NAME --tp T --pp P]`` reads a DeepSpeed config and
prints, one line each: the equivalent Megatron-LM flags (and the key each comes from), the model
state bytes per GPU from :mod:`course_lib.sizing` for DeepSpeed's ZeRO stage and for the Megatron
flags, and every option that has no Megatron equivalent. Bad JSON, unknown keys and wrong types
are one-line ``ValueError`` s naming the key.

How the ZeRO stages map (Megatron-LM main, ``megatron/training/arguments.py`` and the config
dataclasses it turns into flags; :data:`MEGATRON_FLAGS` names where each flag is defined):

====================  ===========================================================================
ZeRO stage            Megatron-LM
====================  ===========================================================================
0 (plain DDP)         nothing (DDP with a contiguous grad buffer, all-reduce)
1 (P_os)              ``--use-distributed-optimizer`` (optimizer state and fp32 main params sharded
                      over DP x CP; grads reduce-scattered, params all-gathered)
2 (P_os+g)            ``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads``
3 (P_os+g+p)          ``--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params``
====================  ===========================================================================

Megatron-FSDP (v1, the default ``--megatron-fsdp-version 1``) runs on the distributed optimizer:
``validate_args`` switches ``--use-distributed-optimizer`` on with a warning, so it is printed;
it also asserts ``--ckpt-format fsdp_dtensor`` and ``CUDA_DEVICE_MAX_CONNECTIONS`` unset or > 1.
``--optimizer-cpu-offload`` needs ``--use-precision-aware-optimizer`` (asserted by
``validate_args``). ``--overlap-param-gather`` needs ``--overlap-grad-reduce`` and the
distributed optimizer or Megatron-FSDP. ``--bf16`` makes Megatron accumulate and all-reduce
grads in fp32 (``--accumulate-allreduce-grads-in-fp32`` is switched on), hence its 18 bytes per
parameter against ZeRO's 16 (:func:`course_lib.sizing.megatron_optimizer_bytes_per_param`).

Batch sizes: DeepSpeed's ``train_batch_size = train_micro_batch_size_per_gpu x
gradient_accumulation_steps x DP``; Megatron takes ``--micro-batch-size`` and
``--global-batch-size`` and derives the accumulation steps (``--global-batch-size`` needs DP:
``--dp``, or ``train_batch_size`` in the file). Values ``"auto"`` (filled in by the Hugging Face
Trainer) have no number to translate and are listed as such.

Bytes: DeepSpeed's own estimators (``estimate_zero2_model_states_mem_needs`` /
``estimate_zero3_model_states_mem_needs`` in ``deepspeed/runtime/zero/``, read in the 0.19.8
sources, not run: DeepSpeed is not a dependency) count ``2 + 18/d`` bytes per parameter on the GPU
for ZeRO-2 -- an fp32 grad partition on top of the paper's ``2 + (2 + 12)/d`` -- and ``18/d`` plus
4 bytes per parameter of the largest layer for ZeRO-3. The report prints the paper's accounting
(:func:`course_lib.sizing.model_state_bytes`), which is what the course's formulas test.
"""

from __future__ import annotations

import difflib
import json
import math
from numbers import Integral, Real
from pathlib import Path

from course_lib import rules

# flag -> where Megatron-LM main (d98e8a64ddf3, 2026-08-22) defines it: arguments.py function, or the
# config dataclass field that ArgumentGroupFactory turns into the flag (field_name -> --field-name).
MEGATRON_FLAGS: dict[str, str] = {
    "--use-distributed-optimizer": "megatron/training/arguments.py::_add_distributed_args",
    "--use-megatron-fsdp": "megatron/training/config/common_config.py::DistributedInitConfig.use_megatron_fsdp",
    "--data-parallel-sharding-strategy": "megatron/training/arguments.py::_add_distributed_args",
    "--ckpt-format": "megatron/training/config/training_config.py::CheckpointConfig.ckpt_format",
    "--optimizer-cpu-offload": "megatron/training/arguments.py::_add_training_args",
    "--use-precision-aware-optimizer": "megatron/training/arguments.py::_add_experimental_args",
    "--overlap-grad-reduce": "megatron/training/arguments.py::_add_distributed_args",
    "--overlap-param-gather": "megatron/training/arguments.py::_add_distributed_args",
    "--ddp-bucket-size": "megatron/training/arguments.py::_add_distributed_args",
    "--suggested-communication-unit-size": "megatron/training/arguments.py::_add_distributed_args",
    "--bf16": "megatron/core/model_parallel_config.py::ModelParallelConfig.bf16",
    "--fp16": "megatron/core/model_parallel_config.py::ModelParallelConfig.fp16",
    "--loss-scale": "megatron/training/arguments.py::_add_mixed_precision_args",
    "--initial-loss-scale": "megatron/training/arguments.py::_add_mixed_precision_args",
    "--min-loss-scale": "megatron/training/arguments.py::_add_mixed_precision_args",
    "--loss-scale-window": "megatron/training/arguments.py::_add_mixed_precision_args",
    "--hysteresis": "megatron/training/arguments.py::_add_mixed_precision_args",
    "--micro-batch-size": "megatron/training/config/training_config.py::TrainingConfig.micro_batch_size",
    "--global-batch-size": "megatron/training/config/training_config.py::TrainingConfig.global_batch_size",
    "--lr": "megatron/training/arguments.py::_add_learning_rate_args",
    "--weight-decay": "megatron/training/arguments.py::_add_regularization_args",
    "--adam-beta1": "megatron/training/arguments.py::_add_regularization_args",
    "--adam-beta2": "megatron/training/arguments.py::_add_regularization_args",
    "--adam-eps": "megatron/training/arguments.py::_add_regularization_args",
    "--clip-grad": "megatron/training/arguments.py::_add_regularization_args",
    "--log-interval": "megatron/training/config/training_config.py::LoggerConfig.log_interval",
    "--optimizer": "megatron/training/arguments.py::_add_training_args",
}
VERIFIED_AT = ("main", "d98e8a64ddf34856e74b24714e3bedb2f5a39553")

DEEPSPEED_INITIAL_SCALE_POWER = 16    # DeepSpeed's default fp16.initial_scale_power (docs: config-json)
AUTO = "auto"

# ---------------------------------------------------------------------------------------- schema
# Each known key -> its type: "int", "number", "bool", "str", "dict", "list", or a tuple of allowed strings.
_OFFLOAD = {"device": ("cpu", "nvme", "none"), "pin_memory": "bool", "nvme_path": "str", "buffer_count": "int",
            "buffer_size": "int", "max_in_cpu": "int", "fast_init": "bool", "pipeline_read": "bool",
            "pipeline_write": "bool", "ratio": "number"}
_ZERO = {"stage": "int", "offload_optimizer": _OFFLOAD, "offload_param": _OFFLOAD, "reduce_bucket_size": "int",
         "allgather_bucket_size": "int", "stage3_prefetch_bucket_size": "int", "overlap_comm": "bool",
         "contiguous_gradients": "bool", "reduce_scatter": "bool", "allgather_partitions": "bool",
         "stage3_param_persistence_threshold": "int", "stage3_max_live_parameters": "int",
         "stage3_max_reuse_distance": "int", "sub_group_size": "int", "round_robin_gradients": "bool",
         "stage3_gather_16bit_weights_on_model_save": "bool", "stage3_gather_fp16_weights_on_model_save": "bool",
         "cpu_offload": "bool", "elastic_checkpoint": "bool", "ignore_unused_parameters": "bool",
         "zero_hpz_partition_size": "int", "zero_quantized_weights": "bool", "zero_quantized_gradients": "bool",
         "mics_shard_size": "int", "load_from_fp32_weights": "bool", "memory_efficient_linear": "bool"}
_FP16 = {"enabled": "bool", "auto_cast": "bool", "loss_scale": "number", "initial_scale_power": "int",
         "loss_scale_window": "int", "hysteresis": "int", "consecutive_hysteresis": "bool",
         "min_loss_scale": "number", "fp16_master_weights_and_grads": "bool"}
_BF16 = {"enabled": "bool", "immediate_grad_update": "bool", "check_grad_overflow": "bool"}
_ADAM = {"lr": "number", "betas": "list", "eps": "number", "weight_decay": "number", "torch_adam": "bool",
         "adam_w_mode": "bool", "bias_correction": "bool", "amsgrad": "bool"}
SCHEMA = {"train_batch_size": "int", "train_micro_batch_size_per_gpu": "int", "gradient_accumulation_steps": "int",
          "zero_optimization": _ZERO, "fp16": _FP16, "bf16": _BF16,
          "optimizer": {"type": "str", "params": _ADAM}, "scheduler": "dict", "gradient_clipping": "number",
          "steps_per_print": "int", "wall_clock_breakdown": "bool", "zero_allow_untested_optimizer": "bool",
          "activation_checkpointing": "dict", "flops_profiler": "dict", "tensorboard": "dict", "wandb": "dict",
          "csv_monitor": "dict", "comms_logger": "dict", "communication_data_type": "str",
          "prescale_gradients": "bool", "gradient_predivide_factor": "number", "sparse_gradients": "bool",
          "memory_breakdown": "bool", "dump_state": "bool", "aio": "dict", "data_types": "dict",
          "checkpoint": "dict", "elasticity": "dict", "amp": "dict", "seed": "int"}


def _type_ok(kind, value) -> bool:
    if isinstance(kind, tuple):
        return isinstance(value, str) and value in kind
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "int":   # JSON writes 5e8 for 500000000: a whole float is an integer
        return (isinstance(value, Integral) and not isinstance(value, bool)) or (
            isinstance(value, float) and math.isfinite(value) and value == int(value))
    if kind == "number":
        return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, {"str": str, "dict": dict, "list": list}[kind])


def _kind_text(kind) -> str:
    if isinstance(kind, tuple):
        return "one of " + ", ".join(repr(k) for k in kind)
    if isinstance(kind, dict):
        return "an object {...}"
    return {"int": "an integer", "number": "a number", "bool": "true or false", "str": "a string",
            "dict": "an object {...}", "list": "a list"}[kind]


def _validate(obj: dict, schema: dict, prefix: str = "") -> None:
    for key, value in obj.items():
        path = f"{prefix}{key}"
        if key not in schema:
            near = difflib.get_close_matches(key, list(schema), n=2, cutoff=0.75)
            hint = (f"did you mean {' or '.join(repr(prefix + k) for k in near)}?" if near else
                    f"known keys here: {', '.join(sorted(schema))}")
            raise ValueError(f"unknown key {path!r} in the DeepSpeed config: {hint}")
        kind = schema[key]
        if value == AUTO and kind not in ("dict", "str") and not isinstance(kind, (dict, tuple)):
            continue                      # "auto": the HF Trainer's placeholder, reported later
        if isinstance(kind, dict):
            if not isinstance(value, dict):
                raise ValueError(f"{path} must be an object {{...}}, got {json.dumps(value)}")
            _validate(value, kind, path + ".")
        elif not _type_ok(kind, value):
            raise ValueError(f"{path} must be {_kind_text(kind)}, got {json.dumps(value)}")


def load(path) -> dict:
    """The config in ``path`` as a dict, validated (unknown key, wrong type, bad JSON: one-line ValueError)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"ds_config file {str(path)!r} does not exist")
    try:
        config = json.loads(p.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{p.name} is not valid JSON: {err.msg} at line {err.lineno} column {err.colno}") from None
    return parse(config)


def parse(config) -> dict:
    """Validate a config dict (as :func:`load`) and return it."""
    if not isinstance(config, dict):
        raise ValueError(f"a DeepSpeed config is a JSON object {{...}}, got {type(config).__name__}")
    _validate(config, SCHEMA)
    stage = config.get("zero_optimization", {}).get("stage", 0)
    if stage != AUTO and not 0 <= stage <= 3:
        raise ValueError(f"zero_optimization.stage={stage} must be 0, 1, 2 or 3")
    if _enabled(config, "bf16") and _enabled(config, "fp16"):
        raise ValueError("bf16.enabled and fp16.enabled are both true: DeepSpeed and Megatron (--bf16 / --fp16) "
                         "take one of them")
    betas = config.get("optimizer", {}).get("params", {}).get("betas")
    if betas not in (None, AUTO) and not (len(betas) == 2 and all(_type_ok("number", b) for b in betas)):
        raise ValueError(f"optimizer.params.betas must be a list of two numbers, got {json.dumps(betas)}")
    return config


def _enabled(config, key) -> bool:
    return config.get(key, {}).get("enabled", False) is True


def _int(value) -> int:
    return int(value)


# ----------------------------------------------------------------------------------- translation


class Translation:
    """What :func:`translate` found: ``flags`` (ordered Megatron-LM flags, ``[flag, value-or-None]``),
    ``why`` (``(key, flags, reason)`` one per translated key), ``unmapped`` (``(key, reason)``),
    ``stage``, ``precision`` (``bf16``/``fp16``/``fp32``), ``offload_optimizer`` (a device or None),
    ``offload_param``, ``dp`` (given or derived, else None); ``seen``: the keys a step has handled
    (the rest are listed at the end)."""

    def __init__(self):
        self.flags: list[list] = []
        self.why: list[tuple[str, str, str]] = []
        self.unmapped: list[tuple[str, str]] = []
        self.stage, self.precision, self.dp = 0, "fp32", None
        self.offload_optimizer = self.offload_param = None
        self.seen: set[str] = set()

    def auto(self, key: str, value) -> bool:
        """Mark ``key`` handled; True (and listed as unmapped) when its value is ``"auto"``."""
        self.seen.add(key)
        if value == AUTO:
            self.no_equivalent(key, '"auto" is filled in by the Hugging Face Trainer: put the value in the file')
            return True
        return False

    def add(self, key: str, flags: list, reason: str) -> None:
        for f in flags:
            if f[0] not in MEGATRON_FLAGS:
                raise AssertionError(f"{f[0]} is not a verified Megatron-LM flag")
            if all(g[0] != f[0] for g in self.flags):
                self.flags.append(list(f))
        self.why.append((key, " ".join(_render(f) for f in flags), reason))

    def no_equivalent(self, key: str, reason: str) -> None:
        self.unmapped.append((key, reason))

    def command_line(self) -> str:
        return " ".join(_render(f) for f in self.flags)


def _render(flag) -> str:
    name, value = flag
    if value is None:
        return name
    if isinstance(value, float):
        value = int(value) if value == int(value) and abs(value) < 2 ** 53 else value
    return f"{name} {value}"


_NO_EQUIVALENT = {
    "zero_optimization.contiguous_gradients": "always on in Megatron: grads live in one contiguous buffer "
                                              "(megatron/core/distributed/param_and_grad_buffer.py)",
    "zero_optimization.reduce_scatter": "implied: the distributed optimizer always reduce-scatters grads",
    "zero_optimization.allgather_partitions": "implied: the distributed optimizer always all-gathers params",
    "zero_optimization.stage3_param_persistence_threshold": "no equivalent: Megatron-FSDP shards every parameter",
    "zero_optimization.stage3_max_live_parameters": "no equivalent (Megatron-FSDP frees a unit's params after use)",
    "zero_optimization.stage3_max_reuse_distance": "no equivalent",
    "zero_optimization.sub_group_size": "no equivalent (DeepSpeed's optimizer-step grouping)",
    "zero_optimization.round_robin_gradients": "no equivalent",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "no flag: Megatron-FSDP saves sharded "
                                                                   "(--ckpt-format fsdp_dtensor)",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": "no flag: Megatron-FSDP saves sharded",
    "zero_optimization.elastic_checkpoint": "no flag: Megatron's dist checkpoints reshard on load",
    "zero_optimization.zero_hpz_partition_size": "no equivalent flag (ZeRO++ hierarchical partitioning)",
    "zero_optimization.zero_quantized_weights": "no equivalent (ZeRO++ quantized weights)",
    "zero_optimization.zero_quantized_gradients": "no equivalent (ZeRO++ quantized gradients)",
    "zero_optimization.mics_shard_size": "no equivalent (MiCS)",
    "fp16.consecutive_hysteresis": "no equivalent: Megatron refills its hysteresis only when the scale grows",
    "fp16.auto_cast": "no equivalent: Megatron casts the model (Float16Module), not the inputs",
    "fp16.fp16_master_weights_and_grads": "no equivalent in the trainer (--main-params-dtype with the "
                                          "precision-aware optimizer is the nearest)",
    "bf16.immediate_grad_update": "no equivalent",
    "bf16.check_grad_overflow": "no equivalent: bf16 runs have no loss scaler in Megatron",
    "scheduler": "no one-to-one flag: Megatron's schedule is --lr-decay-style/--lr-warmup-iters/--lr-decay-iters",
    "wall_clock_breakdown": "no equivalent flag (Megatron: --timing-log-level)",
    "zero_allow_untested_optimizer": "no equivalent",
    "activation_checkpointing": "not translated: Megatron's --recompute-granularity/--recompute-method differ",
    "flops_profiler": "no equivalent (Megatron logs throughput with --log-throughput)",
    "communication_data_type": "no one-to-one flag (Megatron: --grad-reduce-in-bf16 / fp32 accumulation)",
    "prescale_gradients": "no equivalent flag",
    "gradient_predivide_factor": "no equivalent flag",
}


def translate(config: dict, dp: int | None = None) -> Translation:
    """The Megatron-LM flags for a validated ``config`` (see :func:`parse`); ``dp`` for the global batch.
    One step per part of the config, in the order the flags are printed."""
    t = Translation()
    if dp is not None:
        t.dp = rules.integer("--dp", dp)
    zero = config.get("zero_optimization", {})
    _zero_stage(t, config, zero)
    _offload(t, zero)
    _buckets(t, zero)
    _overlap(t, zero)
    _precision(t, config)
    _batch_sizes(t, config)
    _optimizer(t, config.get("optimizer"))
    _clipping_and_logging(t, config)
    _left_over(t, config)
    return t


def _zero_stage(t: Translation, config: dict, zero: dict) -> None:
    """``zero_optimization.stage``: ZeRO-1 is the distributed optimizer, ZeRO-2/3 Megatron-FSDP."""
    stage = zero.get("stage", 0)
    if t.auto("zero_optimization.stage", stage):
        return
    t.stage = stage = _int(stage)
    if stage == 1:
        t.add("zero_optimization.stage", [["--use-distributed-optimizer", None]],
              "ZeRO-1: Megatron's distributed optimizer shards fp32 main params and Adam state over DP x CP "
              "(alternative: --use-megatron-fsdp --data-parallel-sharding-strategy optim)")
    elif stage in (2, 3):
        what = "grads and optimizer state" if stage == 2 else "params, grads and optimizer state"
        t.add("zero_optimization.stage",
              [["--use-megatron-fsdp", None], ["--data-parallel-sharding-strategy", rules.SHARDING_STRATEGIES[stage]],
               ["--use-distributed-optimizer", None], ["--ckpt-format", "fsdp_dtensor"]],
              f"ZeRO-{stage}: Megatron-FSDP shards {what} over DP (v1 runs on the distributed optimizer; "
              f"needs --ckpt-format fsdp_dtensor and CUDA_DEVICE_MAX_CONNECTIONS unset or > 1)")
    elif "zero_optimization" in config:
        t.why.append(("zero_optimization.stage", "(none)", "ZeRO-0: plain data parallelism, Megatron's default"))


def _offload(t: Translation, zero: dict) -> None:
    """``offload_optimizer`` / ``offload_param`` (and the old ``cpu_offload``): only the optimizer's
    CPU offload has a Megatron flag."""
    for key in ("offload_optimizer", "offload_param"):
        off = zero.get(key)
        if off is None:
            continue
        full = f"zero_optimization.{key}"
        t.seen.add(full)
        device = off.get("device", "none")
        for sub in off:
            if sub != "device":
                t.no_equivalent(f"{full}.{sub}", "no equivalent" if key == "offload_param" or device != "cpu"
                                else "no flag: Megatron's offload chooses its own host buffers")
        if device == "none":
            continue
        if key == "offload_optimizer" and device == "cpu":
            t.offload_optimizer = "cpu"
            t.add(f"{full}.device", [["--optimizer-cpu-offload", None], ["--use-precision-aware-optimizer", None]],
                  "optimizer state and step on the host (validate_args asserts --use-precision-aware-optimizer)")
        elif key == "offload_optimizer":
            t.no_equivalent(f"{full}.device", "nvme: no equivalent (Megatron offloads to CPU memory only)")
        else:
            t.offload_param = device
            t.no_equivalent(f"{full}.device", f"{device}: no equivalent (Megatron-FSDP keeps its param shards "
                                              f"on the GPU)")
    if zero.get("cpu_offload") is True:      # DeepSpeed's old spelling of offload_optimizer.device=cpu
        t.seen.add("zero_optimization.cpu_offload")
        t.offload_optimizer = "cpu"
        t.add("zero_optimization.cpu_offload",
              [["--optimizer-cpu-offload", None], ["--use-precision-aware-optimizer", None]],
              "the old spelling of offload_optimizer.device=cpu")


def _buckets(t: Translation, zero: dict) -> None:
    """Bucket sizes: Megatron has one, for the grad reduction and the param all-gather; ZeRO-3's
    prefetch size is Megatron-FSDP's communication unit."""
    rb, ab = zero.get("reduce_bucket_size"), zero.get("allgather_bucket_size")
    if rb is not None and not t.auto("zero_optimization.reduce_bucket_size", rb):
        t.add("zero_optimization.reduce_bucket_size", [["--ddp-bucket-size", _int(rb)]],
              "elements per grad-reduction bucket (Megatron: max parameters per bucket)")
    if ab is not None and not t.auto("zero_optimization.allgather_bucket_size", ab):
        if rb is None or rb == AUTO or _int(ab) == _int(rb):
            if rb is None or rb == AUTO:
                t.add("zero_optimization.allgather_bucket_size", [["--ddp-bucket-size", _int(ab)]],
                      "Megatron all-gathers params in the same buckets it reduces grads in")
            else:
                t.why.append(("zero_optimization.allgather_bucket_size", f"--ddp-bucket-size {_int(ab)}",
                              "same buckets for the all-gather"))
        else:
            t.no_equivalent("zero_optimization.allgather_bucket_size",
                            f"{_int(ab)} != reduce_bucket_size {_int(rb)}: Megatron uses one bucket size for both")
    pb = zero.get("stage3_prefetch_bucket_size")
    if pb is not None and not t.auto("zero_optimization.stage3_prefetch_bucket_size", pb):
        if t.stage == 3:
            t.add("zero_optimization.stage3_prefetch_bucket_size", [["--suggested-communication-unit-size", _int(pb)]],
                  "elements Megatron-FSDP all-gathers at once, which sets how far it prefetches")
        else:
            t.no_equivalent("zero_optimization.stage3_prefetch_bucket_size", "only used by ZeRO-3")


def _overlap(t: Translation, zero: dict) -> None:
    """``overlap_comm``: the grad reduction in backward, and with a sharded optimizer the param all-gather."""
    if zero.get("overlap_comm") is True:
        t.seen.add("zero_optimization.overlap_comm")
        flags = [["--overlap-grad-reduce", None]]
        if t.stage >= 1:
            flags.append(["--overlap-param-gather", None])
        t.add("zero_optimization.overlap_comm", flags,
              "grad reduction in backward as buckets fill" + (", param all-gather overlapped with the forward"
                                                               if t.stage >= 1 else
                                                               " (--overlap-param-gather needs a sharded optimizer)"))
    elif "overlap_comm" in zero:
        t.seen.add("zero_optimization.overlap_comm")


def _precision(t: Translation, config: dict) -> None:
    """``bf16`` / ``fp16`` (with DeepSpeed's loss-scale keys as Megatron's)."""
    for key in ("bf16", "fp16"):
        if key in config and config[key].get("enabled") == AUTO:
            t.auto(f"{key}.enabled", AUTO)
    if _enabled(config, "bf16"):
        t.precision = "bf16"
        t.add("bf16.enabled", [["--bf16", None]],
              "bf16 params/activations, fp32 main params; Megatron also accumulates and all-reduces grads in fp32")
    if _enabled(config, "fp16"):
        t.precision = "fp16"
        t.add("fp16.enabled", [["--fp16", None]], "fp16 params/activations, fp32 main params, loss scaling")
        _loss_scale(t, config["fp16"])


def _loss_scale(t: Translation, fp16: dict) -> None:
    """A constant ``loss_scale``, or (0) dynamic scaling from ``2**initial_scale_power``."""
    ls = fp16.get("loss_scale", 0)
    if ls not in (0, AUTO):
        t.add("fp16.loss_scale", [["--loss-scale", ls]], "a constant loss scale")
    elif ls == 0:
        power = fp16.get("initial_scale_power", DEEPSPEED_INITIAL_SCALE_POWER)
        if power != AUTO:
            t.add("fp16.initial_scale_power", [["--initial-loss-scale", 2 ** _int(power)]],
                  f"dynamic scaling from 2**{_int(power)}" + ("" if "initial_scale_power" in fp16 else
                  " (DeepSpeed's default 16; Megatron's own default is 2**32)"))
        for ds_key, flag in (("loss_scale_window", "--loss-scale-window"), ("hysteresis", "--hysteresis"),
                             ("min_loss_scale", "--min-loss-scale")):
            if ds_key in fp16 and not t.auto(f"fp16.{ds_key}", fp16[ds_key]):
                t.add(f"fp16.{ds_key}", [[flag, fp16[ds_key]]], "same rule in Megatron's DynamicGradScaler")


def _batch_sizes(t: Translation, config: dict) -> None:
    """``train_micro_batch_size_per_gpu`` is ``--micro-batch-size``; ``train_batch_size`` (or micro x
    accumulation x DP) is ``--global-batch-size``, and with all three keys it implies DP."""
    micro = config.get("train_micro_batch_size_per_gpu")
    ga = config.get("gradient_accumulation_steps")
    tbs = config.get("train_batch_size")
    if micro is not None and not t.auto("train_micro_batch_size_per_gpu", micro):
        t.add("train_micro_batch_size_per_gpu", [["--micro-batch-size", _int(micro)]], "samples per GPU per step")
    if ga is not None:
        t.auto("gradient_accumulation_steps", ga)
    if tbs is not None:
        t.auto("train_batch_size", tbs)
    nums = {k: _int(v) for k, v in (("micro", micro), ("ga", ga), ("tbs", tbs)) if v not in (None, AUTO)}
    if {"micro", "ga", "tbs"} <= nums.keys():
        t.dp = _implied_dp(nums, t.dp)
    if "tbs" in nums:
        t.add("train_batch_size", [["--global-batch-size", nums["tbs"]]], "samples per optimizer step")
    elif "ga" in nums and "micro" in nums:
        if t.dp is not None:
            gbs = nums["micro"] * nums["ga"] * t.dp
            t.add("gradient_accumulation_steps", [["--global-batch-size", gbs]],
                  f"micro x accumulation x DP = {nums['micro']} x {nums['ga']} x {t.dp}; Megatron derives the "
                  f"accumulation steps from it")
        else:
            t.no_equivalent("gradient_accumulation_steps", "Megatron takes --global-batch-size = micro x "
                                                           "accumulation x DP: pass --dp to compute it")


def _implied_dp(nums: dict, dp: int | None) -> int:
    """DP from DeepSpeed's ``train_batch_size = micro x accumulation x DP`` (``nums``: ``tbs``, ``micro``,
    ``ga``); it must agree with ``--dp`` when that is given."""
    if nums["tbs"] % (nums["micro"] * nums["ga"]):
        raise ValueError(f"train_batch_size={nums['tbs']} is not train_micro_batch_size_per_gpu x "
                         f"gradient_accumulation_steps x DP = {nums['micro']} x {nums['ga']} x DP for any DP")
    implied = nums["tbs"] // (nums["micro"] * nums["ga"])
    if dp is not None and implied != dp:
        raise ValueError(f"train_batch_size={nums['tbs']} = {nums['micro']} x {nums['ga']} x DP gives "
                         f"DP={implied}, "
                         f"but --dp={dp}: fix one of them")
    return implied


def _optimizer(t: Translation, opt: dict | None) -> None:
    """``optimizer.type`` (Adam/AdamW: Megatron's adam, SGD) and its ``params``."""
    if opt is None:
        return
    kind = opt.get("type", "")
    if kind.lower() in ("adam", "adamw", "fusedadam"):
        t.add("optimizer.type", [["--optimizer", "adam"]],
              "Megatron's adam is AdamW (decoupled weight decay)" + (
                  "" if kind.lower() != "adam" else "; DeepSpeed's Adam decouples too unless adam_w_mode=false"))
    elif kind.lower() == "sgd":
        t.add("optimizer.type", [["--optimizer", "sgd"]], "SGD")
    else:
        t.no_equivalent("optimizer.type", f"{kind!r}: no Megatron optimizer of that name (adam, sgd, ...)")
    for key, value in opt.get("params", {}).items():
        full = f"optimizer.params.{key}"
        if t.auto(full, value):
            continue
        if key == "lr":
            t.add(full, [["--lr", value]], "peak learning rate")
        elif key == "weight_decay":
            t.add(full, [["--weight-decay", value]], "decoupled weight decay")
        elif key == "eps":
            t.add(full, [["--adam-eps", value]], "Adam epsilon")
        elif key == "betas":
            t.add(full, [["--adam-beta1", value[0]], ["--adam-beta2", value[1]]], "Adam betas")
        else:
            t.no_equivalent(full, "no equivalent flag")


def _clipping_and_logging(t: Translation, config: dict) -> None:
    clip = config.get("gradient_clipping")
    if clip is not None and not t.auto("gradient_clipping", clip):
        t.add("gradient_clipping", [["--clip-grad", clip]], "global grad-norm clipping")
    steps = config.get("steps_per_print")
    if steps is not None and not t.auto("steps_per_print", steps):
        t.add("steps_per_print", [["--log-interval", _int(steps)]], "iterations between log lines")


def _left_over(t: Translation, config: dict) -> None:
    """Every key present that no step translated: :data:`_NO_EQUIVALENT`'s reason, or not translated."""
    for key in _NO_EQUIVALENT:
        head, _, sub = key.partition(".")
        present = (sub in config.get(head, {})) if sub else head in config
        if present and key not in t.seen:
            t.no_equivalent(key, _NO_EQUIVALENT[key])
    for key in ("tensorboard", "wandb", "csv_monitor", "comms_logger", "sparse_gradients", "memory_breakdown",
                "dump_state", "aio", "data_types", "checkpoint", "elasticity", "amp", "seed"):
        if key in config:
            t.no_equivalent(key, "not translated (logging, I/O or DeepSpeed-only feature)")


# ----------------------------------------------------------------------------------- the course trainer


def course_flags(t: Translation) -> tuple[list[str], list[str]]:
    """``(argv, left_out)``: the translated flags the course's trainer (``python -m course_lib train``,
    :mod:`course_lib.training.arguments`) takes -- same names, same meaning -- as an argv its parser
    accepts, and the Megatron flags it does not have."""
    from course_lib.training.arguments import build_parser

    parser = build_parser()
    known = {o for a in parser._actions for o in a.option_strings}
    argv, left_out = [], []
    for flag, value in t.flags:
        if flag not in known:
            left_out.append(flag)
            continue
        argv += [flag] if value is None else [flag, _render([flag, value]).split(" ", 1)[1]]
    parser.parse_args(argv)            # every value is one the trainer accepts (argparse exits otherwise)
    return argv, left_out


# ----------------------------------------------------------------------------------- bytes


def state_bytes(t: Translation, num_params: float, dp: int) -> dict:
    """Model-state bytes per GPU for ``num_params`` parameters (this GPU's share after TP/PP) over ``dp``.

    ``deepspeed``: ZeRO's accounting (Rajbhandari et al. 2020 §3.1/§5, 16-bit: 2 + 2 + 12 bytes per
    parameter, :func:`course_lib.sizing.model_state_bytes`; fp32 training: 4 + 4 + 8 by the same
    rules). ``megatron``: :func:`course_lib.sizing.megatron_optimizer_bytes_per_param` (grads fp32
    for bf16 -- Megatron's default -- and 16-bit for fp16) with, for Megatron-FSDP, the grads (stage >= 2) and params
    (stage 3) divided by DP as ZeRO does. ``host``: what optimizer CPU offload moves off the GPU.
    Each value is a ``ModelStateBytes`` (weights, grads, optimizer)."""
    from course_lib.sizing import ModelStateBytes, megatron_optimizer_bytes_per_param, model_state_bytes

    rules.number("--num-params", num_params, low=0.0, low_open=True)
    dp = rules.integer("--dp", dp)
    if t.precision == "fp32":
        ds = model_state_bytes(num_params, dp, t.stage, k=8)
        ds = ModelStateBytes(ds.weights * 2, ds.grads * 2, ds.optimizer)     # 4-byte weights and grads
    else:
        ds = model_state_bytes(num_params, dp, t.stage, k=12)
    per = megatron_optimizer_bytes_per_param(dp, distributed_optimizer=t.stage >= 1,
                                             params_dtype="fp32" if t.precision == "fp32" else t.precision,
                                             grad_dtype="fp16" if t.precision == "fp16" else "fp32")
    mg = ModelStateBytes(per.weights * num_params / (dp if t.stage == 3 else 1),
                         per.grads * num_params / (dp if t.stage >= 2 else 1), per.optimizer * num_params)
    out = {"deepspeed": ds, "megatron": mg}
    if t.offload_optimizer == "cpu":
        out["deepspeed_gpu"] = ModelStateBytes(ds.weights, ds.grads, 0.0)
        out["megatron_gpu"] = ModelStateBytes(mg.weights, mg.grads, 0.0)
    return out


def report(t: Translation, num_params: float | None = None, dp: int | None = None, name: str = "ds_config") -> str:
    """The text the CLI prints: flags, one line per translated key, bytes, one line per unmapped option."""
    lines = [f"# {name}: ZeRO stage {t.stage}, {t.precision}"
             + (f", DP {t.dp}" if t.dp else "") + f" (flags verified against Megatron-LM {VERIFIED_AT[0]} "
             f"{VERIFIED_AT[1][:12]})", "Megatron-LM flags:", "  " + (t.command_line() or "(none: the defaults)")]
    argv, left_out = course_flags(t)
    nproc = f"--nproc-per-node {t.dp} " if t.dp else ""
    lines.append(f"course trainer (same flags, on CPU ranks): python -m course_lib train {nproc}{' '.join(argv)}"
                 + (f"  [not in the course trainer: {' '.join(left_out)}]" if left_out else ""))
    lines.append("from:")
    for key, flags, reason in t.why:
        lines.append(f"  {key} -> {flags}: {reason}")
    dp = dp or t.dp
    if num_params is not None and dp:
        b = state_bytes(t, num_params, dp)
        fmt = rules.format_bytes
        lines.append(f"model states per GPU ({num_params:.4g} parameters, DP {dp}):")
        for label, key in (("DeepSpeed ZeRO-%d" % t.stage, "deepspeed"), ("Megatron, these flags", "megatron")):
            s = b[key]
            lines.append(f"  {label}: weights {fmt(s.weights)} + grads {fmt(s.grads)} + optimizer "
                         f"{fmt(s.optimizer)} = {fmt(s.total)}"
                         + (f" (GPU {fmt(b[key + '_gpu'].total)}, host {fmt(s.optimizer)})"
                            if key + "_gpu" in b else ""))
    else:
        lines.append("model states per GPU: pass --num-params N and --dp D (or train_batch_size in the file)")
    if t.unmapped:
        lines.append("without a Megatron-LM equivalent:")
        lines += [f"  {key}: {reason}" for key, reason in t.unmapped]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- CLI


def add_arguments(parser) -> None:
    parser.description = ("Read a DeepSpeed ds_config.json and print the equivalent Megatron-LM flags, the model "
                          "state bytes per GPU and every option without an equivalent.")
    parser.add_argument("file", help="the DeepSpeed config (JSON)")
    parser.add_argument("--dp", type=int, default=None, help="data-parallel size (for --global-batch-size and bytes)")
    parser.add_argument("--num-params", type=float, default=None,
                        help="parameters per GPU after TP/PP (e.g. 7.5e9), for the bytes per GPU")
    parser.add_argument("--model", default=None,
                        help="instead of --num-params: a course_lib.sizing preset ('GPT-3 175B', 'Llama-like 70B', "
                             "'1T (Narayanan Table 1)', 'tiny GPT (seed)'); its busiest stage's parameters per GPU")
    parser.add_argument("--tp", type=int, default=1, help="with --model: tensor-model-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="with --model: pipeline-model-parallel size")


def params_per_gpu(model: str, tp: int = 1, pp: int = 1) -> int:
    """Parameters on the busiest GPU (the largest pipeline stage) of a :data:`course_lib.sizing.PRESETS` model
    under ``tp`` x ``pp`` (:func:`course_lib.sizing.parameters_per_stage`, Narayanan Eq. 2 split by TP/PP)."""
    from course_lib import sizing

    if model not in sizing.PRESETS:
        raise ValueError(f"--model {model!r} is not a sizing preset: use one of {', '.join(sizing.PRESETS)}")
    m = sizing.PRESETS[model]["model"]
    return max(sizing.parameters_per_stage(m.num_layers, m.hidden_size, m.vocab_size, m.seq_length, m.num_heads,
                                           rules.integer("--tp", tp), rules.integer("--pp", pp)))


def run(args) -> int:
    t = translate(load(args.file), dp=args.dp)
    num_params = args.num_params
    if args.model is not None:
        if num_params is not None:
            raise ValueError("--model and --num-params both give the parameters per GPU: pass one of them")
        num_params = params_per_gpu(args.model, args.tp, args.pp)
    print(report(t, num_params, args.dp, name=Path(args.file).name))
    return 0
