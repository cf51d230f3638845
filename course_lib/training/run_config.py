"""One typed, frozen run config: what the trainer's flags mean once they are checked.

:func:`course_lib.training.arguments.validate_args` builds a :class:`RunConfig` once, at the entry
point, and the run reads every value from it (Megatron keeps an argparse namespace and a
``TransformerConfig``; torchtitan's ``JobConfig`` is one typed tree like this one). Sections:

* ``model`` -- :class:`~course_lib.model.GPTConfig` (sizes, vocabulary padded for the layout, MoE);
* ``parallel`` -- :class:`~course_lib.topology.ParallelConfig` (TP/PP/CP/DP/EP, batches, SP, VPP);
* ``schedule`` -- iterations, the pipeline schedule, the seed, evaluation, the NaN check;
* ``optimizer`` and ``precision`` -- the update and its number formats;
* ``sharding`` -- the state-sharding flags (:mod:`course_lib.distributed`);
* ``checkpointing``, ``data``, ``logging``, ``distributed``.

``deepspeed``/``deepspeed_notes``: a ``--deepspeed-config`` folded into the run
(:func:`course_lib.deepspeed.engine.apply_config`). ``arguments``: the validated flags as
``(name, value)`` pairs, for the edges that speak flags (Megatron's arguments block, the torchrun
command line, a checkpoint's ``args``); nothing below the entry point reads a flag from there.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Optional

from course_lib.model import GPTConfig
from course_lib.topology import ParallelConfig


@dataclass(frozen=True)
class ScheduleConfig:
    """How long and in which order: ``--train-iters``, ``--pipeline-schedule`` (``interleaved`` when
    the layout has virtual stages), ``--seed``, ``--eval-interval``/``--eval-iters`` and Megatron's
    ``--check-for-nan-in-loss-and-grad``."""

    train_iters: int
    pipeline_schedule: str
    seed: int
    eval_interval: Optional[int] = None
    eval_iters: int = 100
    check_for_nan_in_loss_and_grad: bool = True


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer and Megatron's learning-rate schedule (counted in iterations here, in samples by
    :class:`course_lib.optimizer.LRScheduler`)."""

    optimizer: str
    lr: float
    min_lr: float
    lr_decay_style: str
    lr_warmup_iters: int
    lr_decay_iters: int
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    sgd_momentum: float
    clip_grad: float


@dataclass(frozen=True)
class PrecisionConfig:
    """``--bf16``/``--fp16`` and the loss-scale flags (:mod:`course_lib.mixed_precision`)."""

    bf16: bool = False
    fp16: bool = False
    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: float = 1000
    hysteresis: int = 2
    accumulate_allreduce_grads_in_fp32: bool = False

    @property
    def name(self) -> str:
        """``"bf16"``, ``"fp16"`` or ``"fp32"``: the compute dtype's name."""
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"


@dataclass(frozen=True)
class ShardingConfig:
    """The state-sharding flags (Megatron's ``_add_distributed_args``), after validation
    (``--use-megatron-fsdp`` has turned the distributed optimizer on; ``notes``: Megatron's warning)."""

    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    ddp_bucket_size: Optional[int] = None
    use_megatron_fsdp: bool = False
    data_parallel_sharding_strategy: str = "optim_grads_params"
    optimizer_cpu_offload: bool = False
    use_precision_aware_optimizer: bool = False
    notes: tuple = ()

    @property
    def uses_engine(self) -> bool:
        """Whether the DP grad reduction and the optimizer step go through :mod:`course_lib.distributed`
        (any state-sharding, overlap, bucket or offload flag); otherwise the trainer's one coalesced
        all-reduce (:func:`course_lib.training.finalize_model_grads.allreduce_dp_grads`)."""
        return (self.use_distributed_optimizer or self.use_megatron_fsdp or self.overlap_grad_reduce
                or self.optimizer_cpu_offload or self.ddp_bucket_size is not None)

    @property
    def strategy(self) -> str:
        """Megatron-FSDP's strategy name: ``--data-parallel-sharding-strategy`` with ``--use-megatron-fsdp``;
        else ``optim`` with ``--use-distributed-optimizer`` (ZeRO-1), else ``no_shard`` (DDP)."""
        if self.use_megatron_fsdp:
            return self.data_parallel_sharding_strategy
        return "optim" if self.use_distributed_optimizer else "no_shard"


@dataclass(frozen=True)
class CheckpointConfig:
    """Megatron's ``_add_checkpointing_args`` (:mod:`course_lib.training.checkpointing`)."""

    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    exit_interval: Optional[int] = None
    ckpt_format: str = "torch_dist"
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False


@dataclass(frozen=True)
class DataConfig:
    """Megatron's ``_add_data_args``/``_add_tokenizer_args`` (:mod:`course_lib.data.source`);
    ``data_path`` None: the built-in corpus as byte tokens, through the same ``GPTDataset`` path."""

    data_path: Optional[tuple] = None
    split: str = "969,30,1"
    tokenizer_type: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    vocab_size: Optional[int] = None
    data_cache_path: Optional[str] = None


@dataclass(frozen=True)
class LoggingConfig:
    """``--log-interval``: the iteration line every N iterations (and the first)."""

    log_interval: int = 5


@dataclass(frozen=True)
class DistributedConfig:
    """``--distributed-backend`` (None: nccl with a GPU per rank, else gloo) and
    ``--distributed-timeout-minutes`` (every process group's timeout)."""

    backend: Optional[str] = None
    timeout_minutes: float = 10.0

    @property
    def timeout_s(self) -> float:
        return self.timeout_minutes * 60


@dataclass(frozen=True)
class RunConfig:
    """A validated run (see the module doc); build it with
    :func:`course_lib.training.arguments.validate_args`."""

    model: GPTConfig
    parallel: ParallelConfig
    schedule: ScheduleConfig
    optimizer: OptimizerConfig
    precision: PrecisionConfig
    sharding: ShardingConfig
    checkpointing: CheckpointConfig
    data: DataConfig
    logging: LoggingConfig
    distributed: DistributedConfig
    deepspeed_config: Optional[str] = None
    deepspeed: Optional[dict] = None      # --deepspeed-config folded in: {"config", "client_optimizer", ...}
    deepspeed_notes: tuple = ()           # what the fold added, one line each
    arguments: tuple = ()

    def namespace(self) -> argparse.Namespace:
        """The validated flags as a namespace: for the bridges that speak flags (``args_to_argv``, the
        DeepSpeed engine), never for the trainer's own modules."""
        return argparse.Namespace(**dict(self.arguments))
