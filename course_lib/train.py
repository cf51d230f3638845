"""The course trainer: the tiny GPT under any TP x PP x CP x DP (+SP, +interleaving, +EP) layout, on real ranks,
with Megatron-LM's flags and Megatron's log lines.

    python -m course_lib train --nproc-per-node 8 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 ...

It follows ``pretrain_gpt.py`` and ``megatron/training/training.py`` (``pretrain``, ``train_step``,
``training_log``): :func:`validate_args` checks the flags before any work starts (a ``--deepspeed-config``
folded in first), :func:`pretrain` loops over :func:`train_step` on the ranks of the running process group,
:func:`train_single_process` is the single-process reference every layout is compared with, :func:`main`
and :func:`run` are the entry points (under torchrun, and the launcher that checks, then starts it):
they take flags and build the run's one :class:`~course_lib.training.run_config.RunConfig`, which
everything below reads. The trainer's parts live in :mod:`course_lib.training` (flags, the run
config, the setup, gradient finalisation, sharded steps, checkpoints, the training log and its lines);
with ``--deepspeed-config`` the run is DeepSpeed's engine (:mod:`course_lib.deepspeed.engine`).

One iteration step by step, mixed precision, state sharding, MoE, what the loss means, the log lines
and the deviations from Megatron on purpose: ``docs/trainer.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shlex
import sys
import time
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist

from course_lib import comm, rules
from course_lib.data import get_batch, get_batch_on_this_cp_rank, get_global_batch
from course_lib.data.source import build_train_dataset
from course_lib.launch import RendezvousError, init_rank, resolve_backend, run_torchrun, torchrun_command
from course_lib.launch.contract import report_error
from course_lib.training.logs import arguments_lines, memory_line, parameters_line, print_line, world_size_line
from course_lib.training.training_log import TrainingLog
from course_lib.mixed_precision import DTYPES
from course_lib.model import GPTModel, gpt_loss
from course_lib.moe.layer import is_expert_param
from course_lib.moe.transformer import set_aux_loss_scale, track_moe_metrics
from course_lib.optimizer import LRScheduler, Optimizer, clip_grads  # noqa: F401
from course_lib.pipeline.executor import run_rank_schedule
from course_lib.process_groups import new_process_groups
from course_lib.topology import ParallelConfig
# What the rest of the course imports from here (the flags, the gradient steps), re-exported:
from course_lib.training import arguments
from course_lib.training.arguments import (add_megatron_arguments, args_to_argv, build_parser,  # noqa: F401
                                           gpt_config_from_args, parse_args, vocab_padding_tp, with_defaults)
from course_lib.training.run_config import DistributedConfig, RunConfig
from course_lib.training.setup import (TrainingSetup, build_lr_scheduler, build_optimizer,  # noqa: F401
                                      setup_training)
from course_lib.deepspeed import engine as deepspeed_engine
from course_lib.training.evaluation import evaluate_and_print
from course_lib.training.finalize_model_grads import (allreduce_dp_grads, dp_kind,  # noqa: F401
                                                      finalize_model_grads, grad_norm, unique_named_params)
from course_lib.training.checkpointing import CheckpointError, checkpoint_and_decide_exit, load_checkpoint
from course_lib.training.rng_state import set_random_seed
from course_lib.training.state_sharding import (allreduce_embedding_grads_after_sync, schedule_sync,
                                          state_bytes)

MEMORY_SOURCE_CPU = "tracked tensor bytes"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``python -m course_lib train`` command: Megatron's flags plus torchrun's ``--nproc-per-node``."""
    add_megatron_arguments(parser)
    parser.add_argument("--nproc-per-node", type=int, default=1,
                        help="ranks to start on this machine (torchrun's flag)")
    parser.add_argument("--nodes", type=int, default=1,
                        help="nodes (torchrun's --nnodes): world = nodes x nproc-per-node; > 1 needs --print-launch")
    parser.add_argument("--print-launch", action="store_true",
                        help="print the multi-node launch (torchrun c10d/static, Slurm sbatch) instead of running")
    parser.add_argument("--run-timeout-minutes", type=float, default=60.0,
                        help="the launcher's deadline for the run once every rank has joined: past it, torchrun and "
                             "every rank are stopped and one line names the phase (course_lib.launch.run_torchrun)")
    return parser


# ============================================================================ one iteration


def _autocast(device: torch.device, precision: str):
    """16-bit compute for ``--bf16``/``--fp16`` (a no-op context for fp32)."""
    return torch.autocast(device.type, dtype=DTYPES[precision], enabled=precision != "fp32")


def _rank_batches(config: ParallelConfig, iteration: int, coords: dict, seed: int, device, dataset=None):
    """Tokens and labels of this rank's ``m`` micro-batches, stacked: ``[m * micro, s / cp]``."""
    toks, labs = [], []
    for j in range(config.num_microbatches):
        b = get_batch(iteration, j, coords["dp"], config.dp, config.micro_batch_size, config.seq_length, seed,
                      global_batch_size=config.effective_global_batch_size, dataset=dataset)
        b = get_batch_on_this_cp_rank({"tokens": b["tokens"], "labels": b["labels"]}, coords["cp"], config.cp)
        toks.append(b["tokens"])
        labs.append(b["labels"])
    return torch.cat(toks).to(device), torch.cat(labs).to(device)


def _forward_backward(s: TrainingSetup, tokens, labels, loss_fn) -> dict:
    """This rank's part of the pipeline schedule on its micro-batches (16-bit compute with --bf16/--fp16)."""
    with _autocast(s.device, s.precision):
        return run_rank_schedule(s.schedule, s.groups.coords["pp"], dict(enumerate(s.chunks)), tokens, labels,
                                 activation_shape=s.activation_shape, pp_group=s.groups.pp, p2p=s.p2p,
                                 loss_fn=loss_fn)


def _token_loss_fn(s: TrainingSetup, stats: list):
    """The mean token loss of a micro-batch; its (sum, count) appended to ``stats`` (evaluation's loss)."""
    def loss_fn(logits, labels):
        total, count = gpt_loss(logits.float(), labels, s.groups.tp)
        stats.append((total.detach().double(), count.double()))
        return total / count
    return loss_fn


def _evaluate(setup: TrainingSetup, record: dict, evaluation: int, prefix: str) -> None:
    """Megatron's evaluate_and_print_results with the trainer's own batches, loss and schedule."""
    evaluate_and_print(setup, setup.valid_dataset, setup.run.schedule.eval_iters, evaluation, prefix, record,
                       rank_batches=_rank_batches, loss_fn_of=_token_loss_fn,
                       run_schedule=_forward_backward, dp_kind=dp_kind(setup.config))


def train_step(setup: TrainingSetup, iteration: int) -> dict:
    """One iteration (1-based) on this rank, as Megatron's ``train_step``
    (``megatron/training/training.py``): this rank's micro-batches, forward and backward through
    the pipeline schedule, ``finalize_model_grads``, the gradient norm and clipping, the optimizer
    step at the current learning rate, then the schedule's step. Collective: every rank calls it.

    Returns ``{"lm_loss": the global batch's mean token loss (last stage; None elsewhere),
    "grad_norm": the model's norm before clipping, "learning_rate": the rate after the step,
    "peak_bytes": activation bytes saved for backward at the peak, "events": the schedule's
    (action, stage, start, end)}``."""
    s, groups, config = setup, setup.groups, setup.config
    c = groups.coords
    for p in s.params:
        p.grad = None
    if s.engine is not None:
        s.engine.zero_grad()
    stats: list = []                 # (token-loss sum, token count) per micro-batch of the last stage
    sync = contextlib.ExitStack()    # the engine's no_sync over all but the last micro-batch
    on_last_forward = schedule_sync(s.engine, config, s.pipeline_schedule, sync) if s.engine else (lambda: None)

    def loss_fn(logits, labels):
        total, count = gpt_loss(logits.float(), labels, groups.tp)   # fp32 logits and loss (Float16Module)
        stats.append((total.detach().double(), count.double()))
        if len(stats) == config.num_microbatches:
            on_last_forward()
        return total / count if s.scaler is None else s.scaler.scale_loss(total / count).squeeze()

    tokens, labels = _rank_batches(config, iteration - 1, c, s.seed, s.device, s.dataset)
    if s.moe_groups is not None:     # the aux losses' gradient: the factor each micro-batch's LM loss gets
        set_aux_loss_scale(s.chunks, (1.0 if s.scaler is None else s.scaler.value) / config.num_microbatches)
    with sync, _autocast(s.device, s.precision):
        out = run_rank_schedule(s.schedule, c["pp"], dict(enumerate(s.chunks)), tokens, labels,
                                activation_shape=s.activation_shape, pp_group=groups.pp, p2p=s.p2p, loss_fn=loss_fn)
    if s.engine is not None:         # the engine reduces, the finalizer clips, the shard is updated
        return _engine_step(s, out, stats)
    moe = {} if s.moe_groups is None else {"moe_groups": s.moe_groups}
    s.finalize_model_grads_func(s.chunks, groups, config, **moe)   # DP(-CP) average (experts: expert DP),
    # SP LayerNorm grads, tied embeddings
    skipped = False
    if s.scaler is not None:         # Megatron: unscale, found_inf MAX over the model-parallel group, skip
        if s.moe_groups is None:
            skipped = s.scaler.unscale_and_check([p.grad for p in s.params], groups.model)
        else:                        # Megatron's ChainedOptimizer: the dense flag over tp-pp, the experts' over
            expert = [is_expert_param(p) for p in s.params]           # their tp-ep-pp group; either skips
            dense_inf = s.scaler.unscale_and_check([p.grad for p, e in zip(s.params, expert) if not e], groups.model)
            expert_inf = s.scaler.unscale_and_check([p.grad for p, e in zip(s.params, expert) if e],
                                                    s.moe_groups.tp_ep_pp)
            skipped = dense_inf or expert_inf
        s.scaler.update(skipped)
    norm = grad_norm(s.params, groups, c["tp"], s.moe_groups)
    if skipped:
        lr = s.scheduler.get_lr()    # Megatron: no optimizer step and no scheduler step
    else:
        clip_grads(s.params, norm, s.run.optimizer.clip_grad)
        s.optimizer.step(s.scheduler.get_lr())
        lr = s.scheduler.step(config.effective_global_batch_size)
    return _step_record(s, out, stats, norm, lr, skipped)


def _engine_step(s: TrainingSetup, out: dict, stats: list) -> dict:
    """The rest of :func:`train_step` on the sharding engine (:mod:`course_lib.training.state_sharding`), in
    Megatron's order: the dp-cp reduction (``finish_grad_sync``), with pp > 1 the tied-embedding sum
    on the reduced grads, then ``engine.step`` -- the finalizer (SP sums, fp16 unscale/found-inf, norm,
    clipping), the shard's update and the param all-gather."""
    s.engine.finish_grad_sync()
    if s.config.pp > 1:
        allreduce_embedding_grads_after_sync(s.engine, s.chunks, s.groups)
    skipped = s.engine.step(s.scheduler.get_lr())["skipped"]
    lr = s.scheduler.get_lr() if skipped else s.scheduler.step(s.config.effective_global_batch_size)
    return _step_record(s, out, stats, s.finalizer.norm, lr, skipped)


def _step_record(s: TrainingSetup, out: dict, stats: list, norm: float, lr: float, skipped: bool) -> dict:
    loss = None
    if s.groups.is_last_stage:       # the loss of the global batch: token sums and counts over dp-cp
        both = torch.stack([sum(t for t, _ in stats), sum(n for _, n in stats)]).to(s.device)
        comm.all_reduce(both, s.groups.dp_cp, kind=dp_kind(s.config), direction="fwd", source="loss_reduction")
        loss = float(both[0] / both[1])
    moe_losses = {} if s.moe_groups is None else \
        track_moe_metrics(s.chunks, s.moe_groups, s.config.num_microbatches)[0]   # collective: every rank
    return {"lm_loss": loss, "grad_norm": norm, "learning_rate": lr, "peak_bytes": out["peak_bytes"],
            "events": out["events"], "skipped": skipped, "moe_losses": moe_losses,
            "loss_scale": 1.0 if s.scaler is None else s.scaler.value}


# ============================================================================ the run


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _memory_line(rank: int, iteration: int, tracked: dict, cuda: bool) -> str:
    """CUDA's allocator numbers, as Megatron reports them; on CPU the tracked tensor bytes, named."""
    if cuda:
        return memory_line(rank, iteration, allocated=torch.cuda.memory_allocated(),
                           max_allocated=torch.cuda.max_memory_allocated(),
                           reserved=torch.cuda.memory_reserved(), max_reserved=torch.cuda.max_memory_reserved())
    return memory_line(rank, iteration, allocated=tracked["allocated"], max_allocated=tracked["max_allocated"],
                       source=MEMORY_SOURCE_CPU)


def _state_fields(sharded) -> str:
    """The sharding engine's measured bytes of this rank, appended to the memory line as fields
    (``| params (bytes): N | grads (bytes): N | optimizer (bytes): N | optimizer on host (bytes): N``;
    :func:`course_lib.training.logs.parse_log` reads them as ``params_bytes`` ...); empty without the engine."""
    if sharded is None:
        return ""
    return "".join(f" | {label} (bytes): {sharded[key]}" for key, label in
                   (("params", "params"), ("grads", "grads"), ("optimizer", "optimizer"),
                    ("optimizer_host", "optimizer on host")))


def validate_args(args: argparse.Namespace, world_size: int, **checks) -> RunConfig:
    """The entry point's check of a run's flags for ``world_size`` ranks: a ``--deepspeed-config`` file
    is folded into the flags first (:func:`course_lib.deepspeed.engine.apply_config`: the file's batch,
    optimizer, clipping and precision become the flags'), then every rule is checked
    (:func:`course_lib.training.arguments.validate_args`, which ``checks`` go to). Returns its
    :class:`~course_lib.training.run_config.RunConfig`; ``args`` itself is not changed."""
    args = with_defaults(args)
    if args.deepspeed_config:
        args = deepspeed_engine.apply_config(args, world_size, build_parser().parse_args([]))
    return arguments.validate_args(args, world_size, **checks)


def pretrain(args: argparse.Namespace | RunConfig, *, print_args: bool = True,
             record_comm: bool = True, finalize_model_grads_func: Callable = finalize_model_grads) -> dict:
    """Train on the ranks of the running default process group (torchrun or ``launch``): a loop
    over :func:`train_step`, logging as Megatron's ``training_log`` does.

    ``args``: from :func:`parse_args`, validated here for this world size; or the
    :class:`~course_lib.training.run_config.RunConfig` :func:`validate_args` returned (not checked
    again). Every value -- sizes, DP, micro-batches, sequence parallelism, virtual stages, the
    optimizer, the checkpoint flags -- is read from that one config.
    ``finalize_model_grads_func``: the gradient step after backward (Megatron's
    ``config.finalize_model_grads_func``). Collective: every rank calls it. Returns this rank's record::

        {"lm_loss": [per-iteration global-batch loss] (last pipeline stage; None elsewhere),
         "logged": [{"iteration", "lm_loss", "elapsed_ms", "learning_rate", "grad_norm"}
                    (+ "load_balancing_loss"/"z_loss" with MoE, averaged over the interval)] (last rank),
         "moe_losses": [per-iteration {name: value} of track_moe_metrics] (every rank; {} for a dense model),
         "grad_norm": [...], "learning_rate": [...], "elapsed_ms": [per iteration],
         "comm": {group kind: bytes of the last iteration's collectives on this rank (full
                  tensors, course_lib.comm's convention) and of its pipeline sends},
         "pipeline_events": [(action, stage, start, end)] of the last iteration,
         "memory": {"allocated", "max_allocated"} bytes (tracked), "coords": {...}, "num_parameters": int}
    """
    world = dist.get_world_size()
    # the ranks are running: their memory is already in use, not to be counted again
    run = args if isinstance(args, RunConfig) else validate_args(args, world, check_memory=False)
    config = run.parallel
    if config.world_size != world:
        raise rules.UsageError(f"config was validated for world_size={config.world_size} but {world} ranks are running")
    groups = new_process_groups(config.grid, timeout=run.distributed.timeout_s)
    c = groups.coords
    cuda = torch.cuda.is_available() and "nccl" in dist.get_backend()  # the launcher's is "cpu:gloo,cuda:nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    _print_run_header(run, print_args)
    setup = setup_training(run, groups, device, finalize_model_grads_func=finalize_model_grads_func)
    if c["dp"] == 0 and c["cp"] == 0:
        print_line(parameters_line(c["tp"], c["pp"], setup.num_parameters))
    set_random_seed(run.schedule.seed, c["pp"])
    start_iteration = load_checkpoint(setup) if run.checkpointing.load else 0   # course_lib.training.checkpointing
    record = {"lm_loss": [], "logged": [], "grad_norm": [], "learning_rate": [], "elapsed_ms": [],
              "comm": {}, "pipeline_events": [], "coords": dict(c), "num_parameters": setup.num_parameters,
              "skipped": [], "loss_scale": [], "moe_losses": []}
    _training_loop(setup, record, record_comm, cuda, start_iteration)
    return record


def _print_run_header(run: RunConfig, print_args: bool) -> None:
    """Rank 0: the layout's and the flags' warnings, then (``print_args``) Megatron's world-size
    line and arguments block."""
    if dist.get_rank() != 0:
        return
    config = run.parallel
    for note in (*config.notes, *run.sharding.notes):
        print_line(f"WARNING: {note}")
    if print_args:
        print_line(world_size_line(config.world_size, config.dp, config.cp, config.tp, config.pp))
        for line in arguments_lines(dict(run.arguments)):
            print_line(line)


def _training_loop(setup: TrainingSetup, record: dict, record_comm: bool, cuda: bool,
                   start_iteration: int = 0) -> None:
    """Iterations ``start_iteration + 1 .. --train-iters`` of :func:`train_step`, each recorded; every
    ``--log-interval`` (and the first) the iteration line, the memory line at the first two logged
    iterations; the checkpoint saves and the exit that ``--save-interval`` / ``--exit-interval`` ask for."""
    peak_activation, evaluations = 0, 0
    schedule = setup.run.schedule
    dist.barrier()
    log = TrainingLog(record, train_iters=schedule.train_iters, log_interval=setup.run.logging.log_interval,
                      global_batch_size=setup.config.effective_global_batch_size,
                      prints=dist.get_rank() == dist.get_world_size() - 1)
    for iteration in range(start_iteration + 1, schedule.train_iters + 1):
        it_start = time.perf_counter()
        with comm.CommRecorder() if record_comm else contextlib.nullcontext() as rec:
            step = train_step(setup, iteration)
        if schedule.check_for_nan_in_loss_and_grad and not step["skipped"]:
            try:
                rules.finite_loss_and_grad(iteration, step["lm_loss"], step["grad_norm"])
            except rules.UsageError as exc:
                raise TrainingStopped(str(exc), report=_reports_nonfinite(setup, step)) from None
        peak_activation = max(peak_activation, step["peak_bytes"])
        log.step(lm_loss=step["lm_loss"], grad_norm=step["grad_norm"], learning_rate=step["learning_rate"],
                 elapsed_ms=(time.perf_counter() - it_start) * 1000.0, skipped=step["skipped"],
                 loss_scale=step["loss_scale"], moe_losses=step["moe_losses"])
        _record_last_step(record, step, rec)
        if log.due(iteration):
            dist.barrier()
            log.log(iteration, learning_rate=step["learning_rate"], grad_norm=step["grad_norm"],
                    loss_scale=step["loss_scale"])
            if log.memory_due(iteration):
                _report_memory(setup, record, iteration, peak_activation, cuda)
        if setup.valid_dataset is not None and iteration % schedule.eval_interval == 0:
            _evaluate(setup, record, evaluations, f"iteration {iteration}")
            evaluations += 1
        if checkpoint_and_decide_exit(setup, iteration):   # --save-interval, --exit-interval, the last save
            break
    else:
        if setup.valid_dataset is not None:          # Megatron's do_valid after training
            _evaluate(setup, record, evaluations, f"iteration {schedule.train_iters} on validation set")
    record.setdefault("memory", {"allocated": _bytes(setup.params),
                                 "max_allocated": _bytes(setup.params) + peak_activation})
    record["peak_activation_bytes"] = peak_activation


def _reports_nonfinite(setup: TrainingSetup, step: dict) -> bool:
    """Whether this rank prints the stop: every rank sees the grad norm (it is reduced), so rank 0 says
    it; a loss only the last stage sees, so its first rank (tp = cp = dp = 0) says that."""
    if not math.isfinite(step["grad_norm"]):
        return dist.get_rank() == 0
    c = setup.groups.coords
    return setup.groups.is_last_stage and c["tp"] == c["cp"] == c["dp"] == 0


def _record_last_step(record: dict, step: dict, rec) -> None:
    """The last iteration's communication and pipeline events into the record; ``rec``: its
    :class:`course_lib.comm.CommRecorder` (None when not recording), whose bytes per group kind replace
    the record's ``comm``."""
    if rec is not None:
        kinds: dict = {}
        for e in rec.events:
            if e.op != "recv":
                kinds[e.kind] = kinds.get(e.kind, 0) + e.bytes
        record["comm"] = kinds
    record["pipeline_events"] = step["events"]


def _report_memory(setup: TrainingSetup, record: dict, iteration: int, peak_activation: int, cuda: bool) -> None:
    """The bytes this rank holds (params, grads and optimizer state: the engine's measured shards
    with the sharding flags) and at its peak (plus the activations); the first DP rank of each
    model-parallel position prints Megatron's memory line."""
    sharded = state_bytes(setup.engine) if setup.engine is not None else None
    params = setup.params
    held = (_bytes(params) + _bytes(p.grad for p in params) + setup.optimizer.state_bytes()
            if sharded is None else sharded["params"] + sharded["grads"] + sharded["optimizer"])
    tracked = {"allocated": held, "max_allocated": held + peak_activation}
    record["memory"] = tracked
    if sharded is not None:
        record["state_bytes"] = sharded
    if setup.groups.coords["dp"] == 0:
        print_line(_memory_line(dist.get_rank(), iteration, tracked, cuda) + _state_fields(sharded))


# ============================================================================ single-process reference


def train_single_process(args: argparse.Namespace) -> dict:
    """The reference: the dense :class:`~course_lib.model.GPTModel` in this process, one step per
    global batch (no micro-batches, no torch.distributed), same data, optimizer and schedule.

    With ``--num-experts`` the global batch is taken in micro-batches of ``--micro-batch-size``
    (the order every layout's sampler shares, :func:`course_lib.data.microbatch_sample_indices`),
    each loss ``/ m``, gradients accumulated: the load-balancing loss is a function of a micro-batch's
    tokens (Megatron computes it per micro-batch, scaled by ``1 / m``), so the reference must see the
    same micro-batches. Returns ``{"lm_loss": [...], "grad_norm": [...], "learning_rate": [...],
    "moe_losses": [{name: value}]}`` per iteration (``{}`` for a dense model)."""
    args = with_defaults(args)
    if args.global_batch_size is None:
        raise rules.UsageError("train_single_process needs --global-batch-size (the batch every layout shares)")
    one = argparse.Namespace(**vars(args))
    padding_tp = vocab_padding_tp(args)                   # the layout's vocabulary, padded as it pads it
    one.tensor_model_parallel_size = one.pipeline_model_parallel_size = one.context_parallel_size = 1
    one.sequence_parallel = False
    one.virtual_pipeline_model_parallel_size = one.num_layers_per_virtual_pipeline_stage = None
    one.num_virtual_stages_per_pipeline_rank = None
    micro = args.micro_batch_size if args.num_experts else args.global_batch_size
    one.micro_batch_size = args.global_batch_size          # one step = the whole global batch at once
    one.expert_model_parallel_size, one.expert_tensor_parallel_size = 1, None
    run = validate_args(one, world_size=1)
    return _train_single_process(run, padding_tp, micro)


def _train_single_process(run: RunConfig, padding_tp: int, micro: int) -> dict:
    """:func:`train_single_process` on its validated one-rank ``run``: the model padded for
    ``padding_tp``, the global batch in micro-batches of ``micro``."""
    config, seed = run.parallel, run.schedule.seed
    m = rules.num_microbatches(config.effective_global_batch_size, micro, 1)   # 1 for a dense model
    model = GPTModel(run.model.with_(vocab_padding_tp=padding_tp))
    model.train()
    named = list(model.named_parameters())
    params = [p for _, p in named]
    opt = build_optimizer(run.optimizer, named)
    global_batch_size = config.effective_global_batch_size
    scheduler = build_lr_scheduler(run.optimizer, global_batch_size)
    dataset = build_train_dataset(run, global_batch_size)
    lr = scheduler.get_lr()
    out = {"lm_loss": [], "grad_norm": [], "learning_rate": [], "moe_losses": []}
    moe = bool(run.model.num_experts)
    if moe:
        set_aux_loss_scale([model], 1.0 / m)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for iteration in range(run.schedule.train_iters):
            for p in params:
                p.grad = None
            batch = get_global_batch(iteration, global_batch_size, config.seq_length, seed, dataset=dataset)
            loss = 0.0
            for tokens, labels in zip(batch["tokens"].split(micro), batch["labels"].split(micro)):
                with _autocast(torch.device("cpu"), run.precision.name):
                    logits = model(tokens)                                         # [s, micro, V]
                part = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                         labels.t().reshape(-1)) / m
                part.backward()
                loss = loss + part.detach()
            norm = float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in params)))
            clip_grads(params, norm, run.optimizer.clip_grad)
            opt.step(lr)
            lr = scheduler.step(global_batch_size)
            out["lm_loss"].append(float(loss))
            out["moe_losses"].append(track_moe_metrics([model], None, m)[0] if moe else {})
            out["grad_norm"].append(norm)
            out["learning_rate"].append(lr)
    return out


# ============================================================================ entry points


class TrainingStopped(RuntimeError):
    """A run stopped on purpose by a check (a NaN loss or grad norm); ``report``: this rank prints it."""

    def __init__(self, message: str, report: bool = True):
        super().__init__(message)
        self.report = report


def _init_distributed(distributed: DistributedConfig) -> None:
    timeout = distributed.timeout_s
    world = int(os.environ.get("WORLD_SIZE", "1"))
    backend = distributed.backend or resolve_backend("auto", world)
    if "MASTER_ADDR" in os.environ and "RANK" in os.environ:
        init_rank(int(os.environ["RANK"]), world, backend, timeout)        # torchrun: env:// rendezvous
    else:                                                                  # plain python: a world of one
        init_rank(0, 1, backend if backend == "gloo" else "gloo", timeout, store=dist.HashStore())


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m course_lib.train`` (under torchrun, or alone as a world of one)."""
    args = parse_args(argv)
    world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    try:
        run_config = validate_args(args, world)                          # before any process group
    except rules.UsageError as exc:
        if rank == 0:
            report_error(rank, str(exc))
        return 2
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    try:
        _init_distributed(run_config.distributed)
    except RendezvousError as exc:                                       # one line: which rank, the fix
        report_error(rank, str(exc))
        return 2
    try:
        if run_config.deepspeed_config:   # DeepSpeed's engine from the ds_config (course_lib.deepspeed.engine)
            deepspeed_engine.pretrain(run_config)
        else:
            pretrain(run_config)
        dist.barrier()
    except CheckpointError as exc:                                       # one line, on the rank that saw it
        report_error(rank, str(exc))
        return 2
    except TrainingStopped as exc:                                       # one line, and a failed run's exit code
        if exc.report:
            report_error(rank, str(exc))
        return 1
    finally:
        dist.destroy_process_group()
    return 0


def torchrun_argv(args: argparse.Namespace, nproc_per_node: int) -> list[str]:
    """The torchrun command line for ``args`` on ``nproc_per_node`` ranks of this machine."""
    return torchrun_command(nproc_per_node, ["-m", "course_lib.train", *args_to_argv(args)])


def run(args: argparse.Namespace) -> int:
    """``python -m course_lib train --nproc-per-node N [Megatron flags]``: check the layout for N
    ranks (a one-line error when it is wrong), print the torchrun command, run it. Ctrl-C, SIGTERM
    or this process's death stop torchrun and every rank (:func:`course_lib.launch.run_torchrun`)."""
    args = with_defaults(args, add_arguments(argparse.ArgumentParser()))
    n = rules.integer("nproc_per_node", args.nproc_per_node)
    nodes = rules.integer("nodes", args.nodes)
    if nodes > 1 or args.print_launch:
        from course_lib.launch.cluster import environment, launch_text

        validate_args(args, nodes * n)
        if not args.print_launch:
            raise rules.UsageError(f"nodes={nodes} runs on other machines: add --print-launch for their commands")
        print(launch_text(["-m", "course_lib.train", *args_to_argv(args)], nodes, n, env=environment(gpus=False),
                          job_name="course-train", gpus=False))
        return 0
    validate_args(args, n)
    if args.distributed_backend is not None:   # nccl needs a GPU per rank here: refused before torchrun starts
        resolve_backend(args.distributed_backend, n)
    run_timeout = rules.timeout_seconds("run_timeout_minutes", args.run_timeout_minutes, unit_s=60)
    cmd = torchrun_argv(args, n)
    print("$ " + shlex.join(["torchrun", *cmd[3:]]), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return run_torchrun(cmd, env=env, timeout=args.distributed_timeout_minutes * 60,
                        run_timeout=run_timeout)


if __name__ == "__main__":
    sys.exit(main())
