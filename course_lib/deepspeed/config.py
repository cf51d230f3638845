"""The ds_config.json bridge: a DeepSpeed config read as Megatron-LM flags, with DeepSpeed's own verdict and bytes.

For: ``python -m course_lib ds-config FILE [--dp D] ...``, which prints the equivalent Megatron-LM flags
(and the key each comes from), every difference in semantics, the model-state bytes per GPU and host,
and the options with no Megatron equivalent. Main names: :data:`MEGATRON_FLAGS` and the translation
functions below; the verdict is :mod:`course_lib.deepspeed.schema`'s (DeepSpeed 0.19.8's parser).
Follows: ``megatron/training/arguments.py``; DeepSpeed's ``runtime/config.py``, ``zero/config.py``;
ZeRO (Rajbhandari et al. 2020).
Manual (how the ZeRO stages map, Megatron-FSDP, overlap_comm, batch sizes, bytes):
docs/internals/deepspeed_config.md.
"""

from __future__ import annotations

import difflib
from pathlib import Path

from course_lib import rules
from course_lib.deepspeed import memory as ds_memory, schema as ds_schema

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
    "--megatron-fsdp-main-grads-dtype": "megatron/training/arguments.py::_add_experimental_args",
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

DEEPSPEED_INITIAL_SCALE_POWER = ds_schema.DEFAULTS["fp16"]["initial_scale_power"]    # 2**16, Megatron's 2**32


def parse(config, dp: int | None = None, *, require_batch: bool = False) -> dict:
    """``config`` (a dict) when DeepSpeed 0.19.8 accepts it for ``dp`` ranks (:func:`ds_schema.check`),
    else a one-line ``ValueError`` naming the key. A config without batch keys passes unless
    ``require_batch`` (a file must have one: :func:`load`)."""
    ds_schema.check(config, dp, require_batch=require_batch)
    return config


def load(path, dp: int | None = None) -> dict:
    """The ds_config in ``path``, read with :func:`course_lib.safe_files.read_json` (a key given twice, NaN,
    bad JSON: one line) and accepted as DeepSpeed accepts a file (:func:`parse`, a batch size required)."""
    if not Path(path).is_file():
        raise rules.UsageError(f"ds_config file {str(path)!r} does not exist; give the path of a ds_config.json")
    return parse(ds_schema.read(path), dp, require_batch=True)


# ----------------------------------------------------------------------------------- translation


class Translation:
    """What :func:`translate` found: ``flags`` (ordered Megatron-LM flags, ``[flag, value-or-None]``),
    ``why`` (``(key, flags, reason)`` one per translated key), ``semantics`` (``(what, difference)``:
    where the same words mean different things in DeepSpeed and Megatron), ``unmapped``
    (``(key, reason)``), ``stage``, ``precision`` (``bf16``/``fp16``/``fp32``), ``offload_optimizer``
    (a device or None), ``offload_param`` (a device DeepSpeed acts on, or None), ``dp`` (given or
    implied, else None), ``checked`` (the config as DeepSpeed reads it, :class:`ds_schema.Checked`)."""

    def __init__(self, checked: ds_schema.Checked, dp: int | None):
        self.checked = checked
        self.flags: list[list] = []
        self.why: list[tuple[str, str, str]] = []
        self.semantics: list[tuple[str, str]] = []
        self.unmapped: list[tuple[str, str]] = list(checked.notes)
        self.stage, self.precision, self.dp = checked.stage, checked.precision, dp
        self.offload_optimizer = self.offload_param = None

    def given(self, key: str) -> bool:
        return key in self.checked.given

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
    "zero_optimization.stage3_model_persistence_threshold": "no equivalent: Megatron-FSDP shards every parameter",
    "zero_optimization.stage3_max_live_parameters": "no equivalent (Megatron-FSDP frees a unit's params after use)",
    "zero_optimization.stage3_max_reuse_distance": "no equivalent",
    "zero_optimization.sub_group_size": "no equivalent (DeepSpeed's optimizer-step grouping)",
    "zero_optimization.round_robin_gradients": "no equivalent",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "no flag: Megatron-FSDP saves sharded "
                                                                   "(--ckpt-format fsdp_dtensor)",
    "zero_optimization.elastic_checkpoint": "no flag: Megatron's dist checkpoints reshard on load",
    "zero_optimization.zero_hpz_partition_size": "no equivalent flag (ZeRO++ hierarchical partitioning)",
    "zero_optimization.zero_quantized_weights": "no equivalent (ZeRO++ quantized weights)",
    "zero_optimization.zero_quantized_gradients": "no equivalent (ZeRO++ quantized gradients)",
    "fp16.consecutive_hysteresis": "no equivalent: Megatron refills its hysteresis only when the scale grows",
    "fp16.auto_cast": "no equivalent: Megatron casts the model (Float16Module), not the inputs",
    "fp16.fp16_master_weights_and_grads": "no equivalent in the trainer (--main-params-dtype with the "
                                          "precision-aware optimizer is the nearest)",
    "bf16.immediate_grad_update": "no equivalent",
    "bf16.check_grad_overflow": "no equivalent: a bf16 run has no loss scaler in Megatron (a constant one with --loss-scale)",
    "scheduler": "no one-to-one flag: Megatron's schedule is --lr-decay-style/--lr-warmup-iters/--lr-decay-iters",
    "wall_clock_breakdown": "no equivalent flag (Megatron: --timing-log-level)",
    "zero_allow_untested_optimizer": "no equivalent",
    "zero_force_ds_cpu_optimizer": "no equivalent (DeepSpeed's choice of its own CPU Adam)",
    "activation_checkpointing": "not translated: Megatron's --recompute-granularity/--recompute-method differ",
    "flops_profiler": "no equivalent (Megatron logs throughput with --log-throughput)",
    "communication_data_type": "no one-to-one flag (Megatron: --grad-reduce-in-bf16 / fp32 accumulation)",
    "prescale_gradients": "no equivalent flag",
    "gradient_predivide_factor": "no equivalent flag",
}


def translate(config: dict, dp: int | None = None) -> Translation:
    """The Megatron-LM flags for ``config`` (DeepSpeed's verdict first: :func:`ds_schema.check`; a
    config without batch keys passes), ``dp`` for the global batch. One step per part of the
    config, in the order the flags are printed; the semantic differences last."""
    checked = ds_schema.check(config, dp, require_batch=False)
    t = Translation(checked, dp if dp is not None else ds_schema.implied_dp(config))
    _zero_stage(t)
    _offload(t)
    _buckets(t)
    _overlap(t)
    _precision(t)
    _batch_sizes(t)
    _optimizer(t, config.get("optimizer"))
    _clipping_and_logging(t, config)
    _left_over(t, config)
    _semantics(t)
    return t


def _zero_stage(t: Translation) -> None:
    """``zero_optimization.stage``: ZeRO-1 is the distributed optimizer, ZeRO-2/3 Megatron-FSDP."""
    stage = t.stage
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
    elif t.given("zero_optimization"):
        t.why.append(("zero_optimization.stage", "(none)", "ZeRO-0: plain data parallelism, Megatron's default"))


def _offload(t: Translation) -> None:
    """``offload_optimizer`` / ``offload_param`` (the deprecated ``cpu_offload`` / ``cpu_offload_param``
    are read as them): only the optimizer's CPU offload has a Megatron flag."""
    zero = t.checked.zero
    for old, new in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param")):
        if t.given(f"zero_optimization.{old}"):
            t.why.append((f"zero_optimization.{old}", "(read as zero_optimization." + new + ")",
                          f"DeepSpeed's deprecated spelling of {new}.device=cpu"))
    for key in ("offload_optimizer", "offload_param"):
        full = f"zero_optimization.{key}"
        for sub in sorted(k for k in (zero[key] or {}) if k != "device" and t.given(f"{full}.{k}")):
            t.no_equivalent(f"{full}.{sub}", "no equivalent" if key == "offload_param" else
                            "no flag: Megatron's offload chooses its own host buffers")
        device = t.checked.offload(key[len("offload_"):])
        if device == "none":
            continue
        if key == "offload_optimizer" and device == "cpu":
            t.offload_optimizer = "cpu"
            t.add(f"{full}.device", [["--optimizer-cpu-offload", None], ["--use-precision-aware-optimizer", None]],
                  "optimizer state and step on the host (validate_args asserts --use-precision-aware-optimizer)")
        elif key == "offload_optimizer":
            t.offload_optimizer = device
            t.no_equivalent(f"{full}.device", "nvme: no equivalent (Megatron offloads to CPU memory only)")
        elif t.stage == 3:
            t.offload_param = device
            t.no_equivalent(f"{full}.device", f"{device}: no equivalent (Megatron-FSDP keeps its param shards "
                                              f"on the GPU)")
        else:
            t.no_equivalent(f"{full}.device", f"{device}: ignored by DeepSpeed at stage {t.stage} (see below)")


def _buckets(t: Translation) -> None:
    """Bucket sizes: Megatron has one, for the grad reduction and the param all-gather; ZeRO-3's
    prefetch size is Megatron-FSDP's communication unit."""
    zero = t.checked.zero
    rb_given, ab_given = (t.given(f"zero_optimization.{k}") for k in ("reduce_bucket_size", "allgather_bucket_size"))
    rb, ab = zero["reduce_bucket_size"], zero["allgather_bucket_size"]
    if rb_given:
        t.add("zero_optimization.reduce_bucket_size", [["--ddp-bucket-size", rb]],
              "elements per grad-reduction bucket (Megatron: max parameters per bucket)")
    if ab_given:
        if not rb_given:
            t.add("zero_optimization.allgather_bucket_size", [["--ddp-bucket-size", ab]],
                  "Megatron all-gathers params in the same buckets it reduces grads in")
        elif ab == rb:
            t.why.append(("zero_optimization.allgather_bucket_size", f"--ddp-bucket-size {ab}",
                          "same buckets for the all-gather"))
        else:
            t.no_equivalent("zero_optimization.allgather_bucket_size",
                            f"{ab} != reduce_bucket_size {rb}: Megatron uses one bucket size for both")
    if t.given("zero_optimization.stage3_prefetch_bucket_size"):
        if t.stage == 3:
            t.add("zero_optimization.stage3_prefetch_bucket_size",
                  [["--suggested-communication-unit-size", zero["stage3_prefetch_bucket_size"]]],
                  "elements Megatron-FSDP all-gathers at once, which sets how far it prefetches")
        else:
            t.no_equivalent("zero_optimization.stage3_prefetch_bucket_size", "only used by ZeRO-3")


def _overlap(t: Translation) -> None:
    """``overlap_comm`` as DeepSpeed resolves it (default: true at stage 3): the grad reduction on a side
    stream, and at stage 3 the parameter all-gathers too (see the module docstring)."""
    if not t.checked.zero["overlap_comm"]:
        return
    given = t.given("zero_optimization.overlap_comm")
    flags = [["--overlap-grad-reduce", None]] + ([["--overlap-param-gather", None]] if t.stage == 3 else [])
    t.add("zero_optimization.overlap_comm", flags,
          ("" if given else "DeepSpeed's default at stage 3 (absent from the file): ")
          + "grad reduction in backward as buckets fill"
          + (", param all-gathers (fetch and prefetch) on a side stream of their own" if t.stage == 3 else
             "; DeepSpeed's ZeRO-1/2 all-gathers params after the step, overlapped with nothing"))


def _precision(t: Translation) -> None:
    """``bf16`` / ``fp16`` (with DeepSpeed's loss-scale keys as Megatron's)."""
    if t.precision == "bf16":
        key = "bf16" if t.given("bf16") else "bfloat16"
        t.add(f"{key}.enabled", [["--bf16", None]],
              "bf16 params/activations, fp32 main params; Megatron also accumulates and all-reduces grads in fp32")
    if t.precision == "fp16":
        t.add("fp16.enabled", [["--fp16", None]], "fp16 params/activations, fp32 main params, loss scaling")
        _loss_scale(t, t.checked.fp16)
    if t.precision != "fp32" and t.stage >= 2 and t.offload_optimizer:
        t.add("offload_optimizer.device", [["--megatron-fsdp-main-grads-dtype", "fp32"]],
              f"ZeRO-{t.stage} in {t.precision} with offload_optimizer: DeepSpeed keeps fp32 gradient partitions on "
              "the host for the CPU optimizer; Megatron-FSDP's default (auto) keeps the grads in the param dtype "
              "(param_and_grad_buffer.py _resolve_group_grad_dtype; main only, core_v0.16.1 reduces in fp32 via "
              "grad_reduce_in_fp32)")
    elif t.precision != "fp32" and t.stage >= 2:
        t.semantics.append((
            "gradient dtype", f"ZeRO-{t.stage} in {t.precision} keeps its gradient partitions in the model dtype "
            "(engine.py get_data_types: grad_accum_dtype defaults to the model's; stage3.py "
            "grad_partitions_flat_buffer), the fp32 copy exists only during the step: Megatron-FSDP's default "
            "--megatron-fsdp-main-grads-dtype auto (the param dtype) is the same, so nothing is printed"))


def _loss_scale(t: Translation, fp16: dict) -> None:
    """A constant ``loss_scale``, or (0) dynamic scaling from ``2**initial_scale_power``."""
    if fp16["loss_scale"] != 0:
        t.add("fp16.loss_scale", [["--loss-scale", fp16["loss_scale"]]], "a constant loss scale")
        return
    power = fp16["initial_scale_power"]
    t.add("fp16.initial_scale_power", [["--initial-loss-scale", 2 ** power]],
          f"dynamic scaling from 2**{power}" + ("" if t.given("fp16.initial_scale_power") else
                                              " (DeepSpeed's default 16; Megatron's own default is 2**32)"))
    for ds_key, flag in (("loss_scale_window", "--loss-scale-window"), ("hysteresis", "--hysteresis"),
                         ("min_loss_scale", "--min-loss-scale")):
        if t.given(f"fp16.{ds_key}"):
            t.add(f"fp16.{ds_key}", [[flag, fp16[ds_key]]], "the same knob of Megatron's DynamicGradScaler "
                                                            "(the rules differ: see below)")


def _batch_sizes(t: Translation) -> None:
    """DeepSpeed's batch, resolved for DP (:func:`ds_schema.deepspeed_batch`): ``--micro-batch-size`` and
    ``--global-batch-size``. Without DP (no ``--dp``, and the file implies none) only what the file says."""
    config = t.checked.config
    present = [k for k in ds_schema.BATCH_KEYS if config.get(k) is not None]
    if not present:
        return
    if t.dp is not None:
        tbs, micro, ga = t.checked.batch
        derived = [k for k in ds_schema.BATCH_KEYS if k not in present]
        t.add("train_micro_batch_size_per_gpu", [["--micro-batch-size", micro]],
              "samples per GPU per step" + (" (derived by DeepSpeed's rule from "
                                            + ", ".join(present) + f" on DP {t.dp})" if derived else ""))
        t.add("train_batch_size", [["--global-batch-size", tbs]],
              f"samples per optimizer step = {micro} x {ga} x {t.dp}; Megatron derives the {ga} accumulation "
              f"step(s) from it")
        return
    micro, tbs = config.get("train_micro_batch_size_per_gpu"), config.get("train_batch_size")
    if micro is not None:
        t.add("train_micro_batch_size_per_gpu", [["--micro-batch-size", micro]], "samples per GPU per step")
    if tbs is not None:
        t.add("train_batch_size", [["--global-batch-size", tbs]], "samples per optimizer step")
    if micro is None or tbs is None:
        t.no_equivalent("train_batch_size" if tbs is None else "train_micro_batch_size_per_gpu",
                        "DeepSpeed derives it from the others and DP: pass --dp to compute it")


def _optimizer(t: Translation, opt: dict | None) -> None:
    """``optimizer.type`` (Adam/AdamW: Megatron's adam, SGD) and its ``params``."""
    if opt is None:
        return
    kind = str(opt.get("type") or "")
    if kind.lower() in ("adam", "adamw", "fusedadam"):
        t.add("optimizer.type", [["--optimizer", "adam"]],
              "Megatron's adam is AdamW (decoupled weight decay)" + (
                  "" if kind.lower() != "adam" else "; DeepSpeed's Adam decouples too unless adam_w_mode=false"))
    elif kind.lower() == "sgd":
        t.add("optimizer.type", [["--optimizer", "sgd"]], "SGD")
    else:
        t.no_equivalent("optimizer.type", f"{kind!r}: no Megatron optimizer of that name (adam, sgd, ...)")
    params = opt.get("params") if isinstance(opt.get("params"), dict) else {}
    flags = {"lr": ("--lr", "peak learning rate"), "weight_decay": ("--weight-decay", "decoupled weight decay"),
             "eps": ("--adam-eps", "Adam epsilon")}
    for key, value in params.items():
        full = f"optimizer.params.{key}"
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if key in flags and number:
            t.add(full, [[flags[key][0], value]], flags[key][1])
        elif key == "betas" and isinstance(value, list) and len(value) == 2 and all(
                isinstance(b, (int, float)) and not isinstance(b, bool) for b in value):
            t.add(full, [["--adam-beta1", value[0]], ["--adam-beta2", value[1]]], "Adam betas")
        elif key in flags or key == "betas":
            t.no_equivalent(full, f"{ds_schema._show(value)}: DeepSpeed's parser takes it, its optimizer refuses it "
                                  f"at deepspeed.initialize ({'two numbers' if key == 'betas' else 'a number'})")
        else:
            t.no_equivalent(full, "no equivalent flag")


def _clipping_and_logging(t: Translation, config: dict) -> None:
    for key, flag, reason in (("gradient_clipping", "--clip-grad", "global grad-norm clipping"),
                              ("steps_per_print", "--log-interval", "iterations between log lines")):
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            t.add(key, [[flag, int(value) if key == "steps_per_print" else value]], reason)
        else:
            t.no_equivalent(key, f"{ds_schema._show(value)}: not a number >= 0 (DeepSpeed's parser does not check it; "
                                 f"its engine fails on it)")


def _left_over(t: Translation, config: dict) -> None:
    """Every key present that no step translated: :data:`_NO_EQUIVALENT`'s reason, or not translated."""
    for key, reason in _NO_EQUIVALENT.items():
        if t.given(key):
            t.no_equivalent(key, reason)
    untranslated = sorted(k for k in config if k in ds_schema.DEEPSPEED_KEYS and k not in ds_schema.MIRRORED
                          and k not in _NO_EQUIVALENT)
    for key in untranslated:
        t.no_equivalent(key, "not translated (logging, I/O or a DeepSpeed-only feature; DeepSpeed's parser checks it)")


def _semantics(t: Translation) -> None:
    """Where DeepSpeed and Megatron differ under the same words, one line each."""
    zero = t.checked.zero
    t.semantics.append((
        "weight decay", "DeepSpeed applies optimizer.params.weight_decay to every parameter it is handed -- "
        "model.parameters() includes the biases and the LayerNorm weights -- while Megatron exempts biases and "
        "1-D parameters (norms); hand DeepSpeed Megatron's two groups (python -m course_lib train "
        "--deepspeed-config does)"))
    if t.precision == "fp16" and t.checked.fp16["loss_scale"] == 0:
        w = t.checked.fp16["loss_scale_window"]
        t.semantics.append((
            "fp16 loss scale", f"DeepSpeed's DynamicLossScaler first grows the scale after {w} + 1 clean steps "
            f"(then every {w}), Megatron's after {w}; an overflow at min_loss_scale stops a DeepSpeed run with an "
            f"exception, Megatron stays at the minimum and skips the step"))
    t.semantics.append((
        "overlap_comm", f"{'true' if zero['overlap_comm'] else 'false'} here"
        + ("" if t.given("zero_optimization.overlap_comm") else " (DeepSpeed's default: true at stage 3 only)")
        + ": a side stream for the grad reduction (and at stage 3 another for the param all-gathers); Megatron's "
          "--overlap-grad-reduce / --overlap-param-gather are two flags; DeepSpeed's CPU accelerator has no "
          "side streams, so on CPU nothing overlaps"))
    if t.stage == 3:
        n = zero["stage3_param_persistence_threshold"]
        t.semantics.append((
            "param persistence", f"stage3_param_persistence_threshold {n}"
            + ("" if t.given("zero_optimization.stage3_param_persistence_threshold") else " (DeepSpeed's default)")
            + f": DeepSpeed keeps every parameter of <= {n} elements whole on every GPU (never gathered, "
              f"all-gathered again after each step), Megatron-FSDP shards every parameter"))
    if t.stage < 3 and t.checked.offload("param") != "none":
        t.semantics.append((
            "offload_param", f"device {t.checked.offload('param')} at stage {t.stage}: DeepSpeed ignores it below "
                             f"stage 3 (only ZeRO-3 partitions parameters), nothing is offloaded"))


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


def state_bytes(t: Translation, num_params: float, dp: int, largest_layer: float = 0, nodes: int = 1) -> dict:
    """Model-state bytes for ``num_params`` parameters per GPU's model (after TP/PP) over ``dp`` GPUs on
    ``nodes`` nodes (:mod:`course_lib.deepspeed.memory`):

    * ``"paper"``: ``(gpu, host)`` per GPU by ZeRO's accounting (16-bit 2 + 2 + 12; fp32 4 + 4 + 8),
      the offloaded part on the host;
    * ``"deepspeed"``: DeepSpeed's estimator (:class:`ds_memory.Estimate`, per GPU and per node,
      itemised), None where DeepSpeed has none (stages 0-1, fp32 training); ``largest_layer`` = L;
    * ``"megatron"``: the translated flags' :class:`~course_lib.sizing.ModelStateBytes` per GPU (all
      of it), ``"megatron_gpu"`` / ``"megatron_host"`` its split under ``--optimizer-cpu-offload``."""
    rules.number("--num-params", num_params, low=0.0, low_open=True)
    dp = rules.integer("--dp", dp)
    off_opt, off_param = t.offload_optimizer is not None, t.offload_param is not None
    paper = ds_memory.paper_bytes(t.stage, num_params, dp, t.precision, offload_optimizer=off_opt,
                                  offload_param=off_param)
    estimate = None if t.precision == "fp32" else ds_memory.deepspeed_estimate(
        t.stage, num_params, dp, largest_layer, offload_optimizer=off_opt, offload_param=off_param, nodes=nodes)
    gpu, host = ds_memory.megatron_bytes(t.stage, num_params, dp, t.precision,
                                         offload_optimizer=t.offload_optimizer == "cpu",
                                         fsdp_grads_dtype=dict(t.flags).get("--megatron-fsdp-main-grads-dtype", "auto"))
    from course_lib.sizing import ModelStateBytes

    whole = ModelStateBytes(*(a + b for a, b in zip(gpu, host)))
    return {"paper": paper, "deepspeed": estimate, "megatron": whole, "megatron_gpu": gpu, "megatron_host": host}


def _bytes_lines(t: Translation, num_params: float, dp: int, largest_layer: float, nodes: int) -> list[str]:
    b, fmt = state_bytes(t, num_params, dp, largest_layer, nodes), rules.format_bytes
    per_node = dp // nodes
    gpu, host = b["paper"]
    lines = [f"model states ({num_params:.4g} parameters per GPU's model, DP {dp} on {nodes} node(s) of {per_node} "
             f"GPUs" + (f", largest layer {largest_layer:.4g}" if t.stage == 3 else "") + "):",
             f"  ZeRO paper ({'4 + 4 + 8' if t.precision == 'fp32' else '2 + 2 + 12'} per parameter): per GPU "
             f"weights {fmt(gpu.weights)} + grads {fmt(gpu.grads)} + optimizer {fmt(gpu.optimizer)} = {fmt(gpu.total)}"
             + (f"; host {fmt(host.total * per_node)} per node" if host.total else "")]
    estimate = b["deepspeed"]
    if estimate is None:
        why = ("its estimators assume 16-bit mixed precision" if t.precision == "fp32" else
               f"it has estimators for ZeRO-2 and ZeRO-3 only")
        lines.append(f"  DeepSpeed {ds_schema.VERSION}: no estimate for ZeRO-{t.stage} in {t.precision} ({why})")
    else:
        lines.append(f"  DeepSpeed {ds_schema.VERSION}'s estimate_zero{t.stage}_model_states_mem_needs: per GPU "
                     f"{fmt(estimate.gpu)}, host {fmt(estimate.host)} per node")
        lines += [f"    {line}" for line in estimate.lines()]
        if t.stage == 3 and not largest_layer:
            lines.append("    (the largest layer is 0 here: pass --largest-layer L, or --model)")
    mg, gpu, host = b["megatron"], b["megatron_gpu"], b["megatron_host"]
    lines.append(f"  Megatron, these flags: weights {fmt(mg.weights)} + grads {fmt(mg.grads)} + optimizer "
                 f"{fmt(mg.optimizer)} = {fmt(mg.total)}"
                 + (f" (GPU {fmt(gpu.total)}, host {fmt(host.total)})" if host.total else ""))
    return lines


def report(t: Translation, num_params: float | None = None, dp: int | None = None, name: str = "ds_config",
           largest_layer: float = 0, nodes: int = 1) -> str:
    """The text the CLI prints: flags, one line per translated key, the differences in semantics, bytes,
    one line per unmapped option."""
    lines = [f"# {name}: ZeRO stage {t.stage}, {t.precision}"
             + (f", DP {t.dp}" if t.dp else "") + f" (DeepSpeed {ds_schema.VERSION}'s reading; flags verified "
             f"against Megatron-LM {VERIFIED_AT[0]} {VERIFIED_AT[1][:12]})", "Megatron-LM flags:",
             "  " + (t.command_line() or "(none: the defaults)")]
    argv, left_out = course_flags(t)
    nproc = f"--nproc-per-node {t.dp} " if t.dp else ""
    lines.append(f"course trainer (same flags, on CPU ranks): python -m course_lib train {nproc}{' '.join(argv)}"
                 + (f"  [not in the course trainer: {' '.join(left_out)}]" if left_out else ""))
    lines.append("from:")
    lines += [f"  {key} -> {flags}: {reason}" for key, flags, reason in t.why]
    lines.append("not the same in DeepSpeed and Megatron:")
    lines += [f"  {what}: {difference}" for what, difference in t.semantics]
    dp = dp or t.dp
    if num_params is not None and dp:
        lines += _bytes_lines(t, num_params, dp, largest_layer, nodes)
    else:
        lines.append("model states per GPU: pass --num-params N" + ("" if dp else " and --dp D (or all three batch keys "
                                                                           "in the file)"))
    if t.unmapped:
        lines.append("without a Megatron-LM equivalent:")
        lines += [f"  {key}: {reason}" for key, reason in t.unmapped]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- CLI


def add_arguments(parser) -> None:
    parser.description = ("Read a DeepSpeed ds_config.json and print the equivalent Megatron-LM flags, the "
                          "differences in semantics, the model-state bytes per GPU and host (the ZeRO paper's, "
                          "DeepSpeed's estimator's, Megatron's) and every option without an equivalent.")
    parser.add_argument("file", help="the DeepSpeed config (JSON)")
    parser.add_argument("--dp", type=int, default=None, help="data-parallel size (for the batch sizes and bytes)")
    parser.add_argument("--num-params", type=float, default=None,
                        help="parameters per GPU after TP/PP (e.g. 7.5e9), for the bytes per GPU")
    parser.add_argument("--largest-layer", type=float, default=0,
                        help="with --num-params: the most parameters one module owns (ZeRO-3's estimator gathers "
                             "it whole; a GPT's word embedding, vocab x hidden)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes the DP GPUs are on (host bytes are per node)")
    parser.add_argument("--model", default=None,
                        help="instead of --num-params: a course_lib.sizing preset ('GPT-3 175B', 'Llama-like 70B', "
                             "'1T (Narayanan Table 1)', 'tiny GPT (seed)'); its busiest stage's parameters per GPU")
    parser.add_argument("--tp", type=int, default=1, help="with --model: tensor-model-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="with --model: pipeline-model-parallel size")


def _preset(model: str):
    from course_lib import sizing

    if model not in sizing.PRESETS:
        raise rules.UsageError(f"--model {model!r} is not a sizing preset: use one of {', '.join(sizing.PRESETS)}")
    return sizing.PRESETS[model]["model"]


def params_per_gpu(model: str, tp: int = 1, pp: int = 1) -> int:
    """Parameters on the busiest GPU (the largest pipeline stage) of a :data:`course_lib.sizing.PRESETS` model
    under ``tp`` x ``pp`` (:func:`course_lib.sizing.parameters_per_stage`, Narayanan Eq. 2 split by TP/PP)."""
    from course_lib import sizing

    m = _preset(model)
    return max(sizing.parameters_per_stage(m.num_layers, m.hidden_size, m.vocab_size, m.seq_length, m.num_heads,
                                           rules.integer("--tp", tp), rules.integer("--pp", pp)))


def largest_layer_per_gpu(model: str, tp: int = 1) -> int:
    """L of a preset under ``tp``: the larger of the word embedding's TP shard (``V/t x h``) and an MLP
    layer's (``4h/t x h`` + its bias), the modules DeepSpeed's ZeRO-3 estimator gathers whole."""
    m, t = _preset(model), rules.integer("--tp", tp)
    h = m.hidden_size
    return max(m.vocab_size * h // t, 4 * h * h // t + 4 * h // t)


def run(args) -> int:
    config = load(args.file, args.dp)
    t = translate(config, dp=args.dp)
    num_params, largest = args.num_params, args.largest_layer
    if args.model is not None:
        if num_params is not None:
            raise rules.UsageError("--model and --num-params both give the parameters per GPU: pass one of them")
        num_params, largest = params_per_gpu(args.model, args.tp, args.pp), largest_layer_per_gpu(args.model, args.tp)
    if ds_schema.deepspeed_installed():                          # the keys the bridge does not translate
        refused = ds_schema.deepspeed_verdict(config, t.dp or 1)
        if refused:
            raise rules.UsageError(f"{args.file}: DeepSpeed {ds_schema.VERSION}'s own parser refuses it: {refused}")
    print(report(t, num_params, args.dp, name=Path(args.file).name, largest_layer=largest, nodes=args.nodes))
    return 0
