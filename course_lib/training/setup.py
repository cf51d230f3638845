"""What every iteration of a run uses, built once: Megatron's ``setup_model_and_optimizer`` plus
``get_forward_backward_func`` (``megatron/training/training.py``), from the run's
:class:`~course_lib.training.run_config.RunConfig`.

:class:`TrainingSetup` is what the loop (:mod:`course_lib.train`), evaluation and checkpointing
(:mod:`course_lib.training.checkpointing`) read; :func:`setup_training` builds it on this rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from course_lib.data.source import build_train_dataset, build_valid_dataset
from course_lib.mixed_precision import make_loss_scaler
from course_lib.model import build_model
from course_lib.optimizer import LRScheduler, Optimizer
from course_lib.pipeline.check import check_schedule
from course_lib.pipeline.schedules import PipelineSchedule, build_schedule
from course_lib.process_groups import MoEGroups, ProcessGroups, new_moe_process_groups
from course_lib.topology import ParallelConfig
from course_lib.training.finalize_model_grads import finalize_model_grads, unique_named_params
from course_lib.training.run_config import OptimizerConfig, PrecisionConfig, RunConfig
from course_lib.training.state_sharding import ShardedGradFinalizer, build_engine


@dataclass
class TrainingSetup:
    """What every iteration of a run uses, built once by :func:`setup_training`.

    ``chunks``: this rank's model chunks (one per virtual stage); ``params``: their parameters,
    each once; ``schedule``/``p2p``: the pipeline schedule and its checked sends;
    ``activation_shape``: ``[s/cp (/tp with SP), micro, hidden]``, what a stage sends;
    ``finalize_model_grads_func``: the gradient step after backward (Megatron's
    ``config.finalize_model_grads_func``; a test passes a broken one to see the parity check fail),
    called as ``f(chunks, groups, config)``, plus ``moe_groups=`` in an MoE run.
    """

    run: RunConfig
    groups: ProcessGroups
    chunks: list
    params: list
    optimizer: Optimizer
    scheduler: LRScheduler
    schedule: PipelineSchedule
    p2p: str
    activation_shape: tuple
    device: torch.device
    finalize_model_grads_func: Callable = finalize_model_grads
    scaler: object = None                               # fp16's loss scaler (course_lib.mixed_precision), else None
    engine: object = None                               # course_lib.distributed's wrapper with the sharding flags
    finalizer: Optional[ShardedGradFinalizer] = None    # the engine's gradient finaliser, else None
    num_parameters: int = 0                             # this rank's parameters (counted before any ZeRO-3 sharding)
    moe_groups: Optional[MoEGroups] = None              # --num-experts: the expert grid's groups, else None
    dataset: object = None              # the train split: --data-path's or the built-in corpus's (data.source)
    valid_dataset: object = None        # --eval-interval: the valid split, else None

    @property
    def config(self) -> ParallelConfig:
        """The run's validated layout (``run.parallel``)."""
        return self.run.parallel

    @property
    def seed(self) -> int:
        return self.run.schedule.seed

    @property
    def precision(self) -> str:
        """``"bf16"`` / ``"fp16"``: autocast compute (course_lib.mixed_precision); ``"fp32"``."""
        return self.run.precision.name

    @property
    def pipeline_schedule(self) -> str:
        return self.run.schedule.pipeline_schedule


def build_lr_scheduler(opt: OptimizerConfig, global_batch_size: int) -> LRScheduler:
    """Megatron's schedule, counted in samples: ``global_batch_size`` per iteration."""
    g = global_batch_size
    return LRScheduler(opt.lr, opt.min_lr, opt.lr_decay_style, opt.lr_warmup_iters * g, opt.lr_decay_iters * g)


def build_optimizer(opt: OptimizerConfig, named_params) -> Optimizer:
    return Optimizer(named_params, opt.optimizer, weight_decay=opt.weight_decay,
                     betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps, momentum=opt.sgd_momentum)


def loss_scaler(precision: PrecisionConfig, distributed_optimizer: bool):
    return make_loss_scaler(precision.fp16, precision.loss_scale, precision.initial_loss_scale,
                            precision.min_loss_scale, precision.loss_scale_window, precision.hysteresis,
                            bf16=precision.bf16, distributed_optimizer=distributed_optimizer)


def setup_training(run: RunConfig, groups: ProcessGroups, device: torch.device, *,
                   finalize_model_grads_func: Callable = finalize_model_grads) -> TrainingSetup:
    """Build this rank's model chunks (from the dense master, :func:`course_lib.model.build_model`),
    optimizer, learning-rate schedule and pipeline schedule for the validated ``run``.

    With ``--num-experts`` the MoE groups come first (collective, with the run's timeout): Megatron's
    expert grid, held by the config's grid beside the dense one (``--expert-model-parallel-size``,
    ``--expert-tensor-parallel-size``, the dense grid's order), and each MoE layer keeps its experts."""
    config = run.parallel
    moe_groups = None
    if run.model.num_experts:
        moe_groups = new_moe_process_groups(groups.grid, timeout=run.distributed.timeout_s)
    chunks = build_model(run.model, groups, vp=config.vpp, sequence_parallel=config.sequence_parallel, device=device,
                         moe_groups=moe_groups)
    for chunk in chunks:
        chunk.train()
    named = unique_named_params(chunks)
    schedule = build_schedule(run.schedule.pipeline_schedule, config.pp, config.num_microbatches, config.vpp)
    seq_local = config.seq_length // config.cp
    shape = (seq_local // (config.tp if config.sequence_parallel else 1), config.micro_batch_size, config.hidden_size)
    num_parameters = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    scaler = loss_scaler(run.precision, run.sharding.use_distributed_optimizer)
    engine = finalizer = None
    if run.sharding.uses_engine:     # DP reduction + optimizer through course_lib.distributed
        engine, finalizer = build_engine(run, chunks, groups, scaler)
    gbs = config.effective_global_batch_size
    return TrainingSetup(run=run, groups=groups, chunks=chunks, params=[p for _, p in named],
                         optimizer=build_optimizer(run.optimizer, named) if engine is None else engine.optimizer,
                         scheduler=build_lr_scheduler(run.optimizer, gbs), schedule=schedule,
                         p2p=check_schedule(schedule), activation_shape=shape, device=device, finalize_model_grads_func=finalize_model_grads_func,
                         scaler=scaler, engine=engine, finalizer=finalizer, num_parameters=num_parameters,
                         moe_groups=moe_groups, dataset=build_train_dataset(run, gbs),
                         valid_dataset=build_valid_dataset(run, gbs))
