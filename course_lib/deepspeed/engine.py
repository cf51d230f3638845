"""The course GPT trained by DeepSpeed itself, from a ds_config.json: Megatron's log lines, DeepSpeed's engine.

For: ``python -m course_lib train --deepspeed-config ds.json ...``: the dense
:class:`~course_lib.model.GPTModel` on every rank, wrapped by ``deepspeed.initialize`` as the file
says (ZeRO 0-3, offload, the bf16/fp16 blocks, optimizer and scheduler), one process per
data-parallel rank. Main names: :func:`apply_config` (the file folded into the flags, at the
trainer's entry point), :func:`pretrain`, :func:`held_bytes`.
Follows: DeepSpeed 0.19.8's ``deepspeed/runtime/engine.py``, ``zero/stage_1_and_2.py``, ``stage3.py``.
Manual (the file and the flags, the loss and the memory line, NVMe offload):
docs/internals/deepspeed_engine.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import warnings

import torch
import torch.distributed as dist

from course_lib import rules
from course_lib.data import get_batch
from course_lib.data.source import build_train_dataset
from course_lib.deepspeed import schema as ds_schema
from course_lib.deepspeed.schema import import_deepspeed
from course_lib.training.logs import arguments_lines, memory_line, parameters_line, print_line, world_size_line
from course_lib.training.training_log import TrainingLog
from course_lib.model import GPTModel
from course_lib.optimizer import LRScheduler, param_groups
from course_lib.training.run_config import OptimizerConfig, RunConfig
from course_lib.training.setup import build_lr_scheduler

MEMORY_SOURCE = "DeepSpeed's model states"
_ADAM_TYPES = ("adam", "adamw")
# the file's key -> the flag it sets (file wins; a flag given with another value is refused)
_BATCH = (("train_micro_batch_size_per_gpu", "micro_batch_size"), ("train_batch_size", "global_batch_size"))
_NOT_WITH_DEEPSPEED = ("use_distributed_optimizer", "use_megatron_fsdp", "overlap_grad_reduce", "overlap_param_gather",
                       "ddp_bucket_size", "optimizer_cpu_offload", "use_precision_aware_optimizer", "num_experts")
_ADAM_PARAMS = (("lr", "lr"), ("eps", "adam_eps"), ("weight_decay", "weight_decay"))


def preload() -> None:
    """Import in this process what ``deepspeed.initialize`` imports on first use -- its ZeRO optimizers, the
    Muon module its optimizer check loads (whose ``torch.compile`` decorators pull in inductor), and the CPU
    accelerator's shared-memory comm op -- so that ranks forked from here (``course_lib.launch``) start
    with them: about 3 s less per rank on 2 cores."""
    import_deepspeed()
    import deepspeed.module_inject.auto_ep_layer  # noqa: F401
    import deepspeed.runtime.superoffload  # noqa: F401
    import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    import deepspeed.runtime.zero.stage3  # noqa: F401
    import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and builder.is_compatible(verbose=False):
        builder.load(verbose=False)


def _take(a: argparse.Namespace, dest: str, value, key: str, defaults: argparse.Namespace) -> None:
    """The file's ``key`` sets ``--dest``; a flag given with another value is refused."""
    given = getattr(a, dest)
    if given != getattr(defaults, dest) and given != value:
        raise rules.UsageError(f"{dest}={given} disagrees with {key}={value} in the deepspeed-config; "
                               f"drop --{dest.replace('_', '-')} (the file sets it) or change the file")
    setattr(a, dest, value)


def _check_fp16(fp16: bool) -> None:
    """DeepSpeed's CPU accelerator runs fp16 only where oneDNN has fp16 kernels (``is_fp16_supported``);
    refuse before the ranks start instead of DeepSpeed's traceback in each."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    if fp16 and not accelerator.is_fp16_supported():
        raise rules.UsageError(f"fp16.enabled=true: DeepSpeed's {accelerator.device_name()} accelerator has no fp16 on this "
                               f"machine (is_fp16_supported() is False); use \"bf16\": {{\"enabled\": true}}")


def _check_nvme(zero: dict) -> None:
    """``"device": "nvme"`` needs DeepSpeed's async_io op; refuse in one line when it cannot build here."""
    nvme = [k for k in ("offload_optimizer", "offload_param") if (zero.get(k) or {}).get("device") == "nvme"]
    if not nvme:
        return
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if not AsyncIOBuilder().is_compatible(verbose=False):
        raise rules.UsageError(f"zero_optimization.{nvme[0]}.device=nvme needs DeepSpeed's async_io op, which cannot be "
                               f"built here (libaio's headers are missing: apt-get install libaio-dev); "
                               f"use \"device\": \"cpu\"")
    for k in nvme:
        path = zero[k].get("nvme_path")
        if not path or not os.path.isdir(path):
            raise rules.UsageError(f"zero_optimization.{k}.nvme_path={path} is not a folder; give an existing local folder")


def apply_config(a: argparse.Namespace, world: int, defaults: argparse.Namespace) -> argparse.Namespace:
    """Fold ``a.deepspeed_config`` (a path) into the flags for ``world`` ranks; see the module doc.
    ``a``: every trainer flag (``with_defaults``); ``defaults``: the parser's defaults (a flag that
    differs from its default was given).

    Sets ``a.deepspeed = {"config": the config DeepSpeed gets, "client_optimizer": bool,
    "megatron_schedule": bool}`` and ``a.deepspeed_notes`` (what was added, one line each).
    Refuses, in one line, a layout other than DP only, a flag that disagrees with the file, a file
    DeepSpeed's parser refuses, NVMe offload without the async_io op."""
    rules.deepspeed_layout(a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.context_parallel_size,
                           a.virtual_pipeline_model_parallel_size,
                           [dest.replace("_", "-") for dest in _NOT_WITH_DEEPSPEED if getattr(a, dest)])
    import_deepspeed()
    config = ds_schema.read(a.deepspeed_config, "--deepspeed-config")
    ds_schema.check(config, world, require_batch=False)          # DeepSpeed's verdict on what the bridge reads
    notes = []
    if not any(k in config for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                      "gradient_accumulation_steps")):
        global_batch = a.global_batch_size or a.micro_batch_size * world
        config["train_micro_batch_size_per_gpu"] = a.micro_batch_size
        config["train_batch_size"] = global_batch
        notes.append(f"deepspeed-config: train_micro_batch_size_per_gpu={a.micro_batch_size}, "
                     f"train_batch_size={global_batch} from --micro-batch-size / --global-batch-size")
    tbs, micro, ga = ds_schema.deepspeed_batch(*(config.get(k) for k in ds_schema.BATCH_KEYS), world)
    config.update(train_batch_size=tbs, train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=ga)
    for key, dest in _BATCH:
        _take(a, dest, config[key], key, defaults)
    if "gradient_clipping" in config:
        _take(a, "clip_grad", config["gradient_clipping"], "gradient_clipping", defaults)
    else:
        config["gradient_clipping"] = a.clip_grad
        notes.append(f"deepspeed-config: gradient_clipping={a.clip_grad} from --clip-grad "
                     f"(DeepSpeed's default: no clipping)")
    for key in ("bf16", "fp16"):
        if (config.get(key) or {}).get("enabled") is True:
            _take(a, key, True, f"{key}.enabled", defaults)
    _check_fp16(a.fp16)
    opt = config.get("optimizer")
    if opt is not None:
        kind = str(opt.get("type", "")).lower()
        if kind not in _ADAM_TYPES:
            raise rules.UsageError(f"optimizer.type={opt.get('type')} is not run by the course on CPU; use Adam or AdamW "
                                   f"(or drop the block: the flags' --optimizer runs as a client optimizer)")
        _take(a, "optimizer", "adam", "optimizer.type", defaults)
        params = opt.setdefault("params", {})
        for key, dest in _ADAM_PARAMS:
            if key in params:
                _take(a, dest, params[key], f"optimizer.params.{key}", defaults)
            else:
                params[key] = getattr(a, dest)
        if "betas" in params:
            _take(a, "adam_beta1", params["betas"][0], "optimizer.params.betas[0]", defaults)
            _take(a, "adam_beta2", params["betas"][1], "optimizer.params.betas[1]", defaults)
        else:
            params["betas"] = [a.adam_beta1, a.adam_beta2]
        if "torch_adam" not in params:
            params["torch_adam"] = True
            notes.append("deepspeed-config: optimizer.params.torch_adam=true added (torch.optim.AdamW; DeepSpeed's "
                         "FusedAdam / DeepSpeedCPUAdam are C++ ops built with g++ on first use)")
    zero = config.get("zero_optimization") or {}
    offloaded = any((zero.get(k) or {}).get("device") in ("cpu", "nvme") for k in ("offload_optimizer",))
    if offloaded and "zero_force_ds_cpu_optimizer" not in config and opt is None:
        config["zero_force_ds_cpu_optimizer"] = False     # engine.py _configure_optimizer checks client optimizers only
        notes.append("deepspeed-config: zero_force_ds_cpu_optimizer=false added (optimizer offload with the client "
                     "optimizer of the flags: DeepSpeed refuses any client optimizer but its CPU Adam/Lion otherwise)")
    _check_nvme(zero)
    refused = ds_schema.deepspeed_verdict(config, world)           # and on every key it does not read
    if refused:
        raise rules.UsageError(f"deepspeed-config rejected by DeepSpeed: {refused}")
    a.deepspeed = {"config": config, "client_optimizer": opt is None, "megatron_schedule": "scheduler" not in config}
    a.deepspeed_notes = tuple(notes)
    return a


# ============================================================================ the run


class MegatronSchedule:
    """Megatron's learning-rate schedule (:class:`course_lib.optimizer.LRScheduler`, in samples) as the
    ``lr_scheduler`` DeepSpeed steps after each applied optimizer step."""

    def __init__(self, optimizer, schedule: LRScheduler, global_batch_size: int):
        self.optimizer, self.schedule, self.global_batch_size = optimizer, schedule, global_batch_size
        self._set(schedule.get_lr())

    def _set(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self, *args, **kwargs) -> None:
        self._set(self.schedule.step(self.global_batch_size))

    def get_last_lr(self) -> list:
        return [self.schedule.get_lr()]

    def state_dict(self) -> dict:
        return {"num_steps": self.schedule.num_steps}

    def load_state_dict(self, state: dict) -> None:
        self.schedule.num_steps = state["num_steps"]


def _client_optimizer(opt: OptimizerConfig, groups):
    if opt.optimizer == "adam":
        return torch.optim.AdamW(groups, lr=opt.lr, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps)
    return torch.optim.SGD(groups, lr=opt.lr, momentum=opt.sgd_momentum)


def _grad_norm(params) -> float:
    """The 2-norm of the (already averaged, unsharded) gradients."""
    return float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in params if p.grad is not None)))


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _tensors(obj, depth: int = 2):
    """The tensors in ``obj`` (a tensor, or lists / tuples / dicts of them, ``depth`` levels deep)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth > 0 and isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x, depth - 1)
    elif depth > 0 and isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x, depth - 1)


def _unique(tensors) -> list:
    """Each storage once (flat buffers and their views count once)."""
    seen, out = set(), []
    for t in tensors:
        if t is None or t.numel() == 0:
            continue
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def held_bytes(engine, stage: int) -> dict:
    """This rank's model-state bytes as DeepSpeed holds them after a step, where it holds them:
    ``{"params", "grads", "optimizer", "params_host", "grads_host", "optimizer_host"}``.

    ``params``: the module's parameters (ZeRO-3: this rank's partitions ``p.ds_tensor``, plus the
    parameters under ``stage3_param_persistence_threshold``, which every rank also keeps whole on the
    device); ``grads``: the gradient buffers still allocated (``p.grad``; ZeRO-1/2's
    ``averaged_gradients``, ipg buffer and the device staging buffer of offload; ZeRO-3's flat
    16-bit grad partition and its reduce bucket, ``reduce_bucket_size`` elements); ``optimizer``: the
    fp32 master copy (ZeRO: this rank's flat partition) and the optimizer state (Adam's two moments).
    ``*_host``: what ``offload_optimizer`` / ``offload_param`` keep in CPU memory: under optimizer
    offload DeepSpeed allocates the gradient partition itself on the host (ZeRO-3: ``self.device`` is
    the CPU), an fp32 gradient for the host optimizer's master partition (ZeRO-1/2 also a 16-bit copy
    of the params partition and a host staging buffer); under param offload (ZeRO-3) the param partition."""
    opt = engine.optimizer
    base = getattr(opt, "optimizer", opt)
    state = _unique(t for st in base.state.values() for t in _tensors(st) if t.dim() > 0)
    params = list(engine.module.parameters())
    whole, params_host = [], []      # whole: what every rank holds whole (ZeRO-3: the persistent parameters)
    if stage == 3:
        held = _unique(p.ds_tensor for p in params)
        whole = _unique(p.data for p in params if getattr(p, "ds_persist", False))
        master = _unique(_tensors(getattr(opt, "fp32_partitioned_groups_flat", [])))
        partition = _unique(_tensors(getattr(opt, "grad_partitions_flat_buffer", None)))
        bucket = _unique(getattr(b, "buffer", None) for b in getattr(opt, "ipg_buckets", {}).values()
                         if isinstance(getattr(b, "buffer", None), torch.Tensor))
        off_opt = bool(getattr(opt, "offload_optimizer", False))
        off_param = bool(getattr(opt, "offload_param", False))
        grads, grads_host = (bucket, partition) if off_opt else (bucket + partition, [])
    else:
        held = _unique(p.data for p in params)
        master = _unique(_tensors(getattr(opt, "single_partition_of_fp32_groups", [])))
        if not master and hasattr(opt, "fp32_groups_flat_partition"):       # bf16 at stage 0 (BF16_Optimizer)
            master = _unique(_tensors(opt.fp32_groups_flat_partition))
        grads = _unique([p.grad for p in params] + list(_tensors(getattr(opt, "averaged_gradients", {}), 3))
                        + list(_tensors(getattr(opt, "ipg_buffer", None)))
                        + list(_tensors(getattr(opt, "temp_grad_buffer_for_gpu_offload", None))))
        off_opt = bool(getattr(opt, "cpu_offload", False))
        off_param = False
        grads_host = _unique(_tensors(getattr(opt, "temp_grad_buffer_for_cpu_offload", None)))
        params_host = _unique(_tensors(getattr(opt, "param_buffer_of_bit16_for_cpu_offload_groups", None)))
    master_grads = _unique(m.grad for m in master)
    if off_opt:
        grads_host = _unique(grads_host + master_grads)
    else:
        grads = _unique(grads + master_grads)
    optimizer = _nbytes(master) + _nbytes(state)
    return {"params": _nbytes(whole) + (0 if off_param else _nbytes(held)), "grads": _nbytes(grads),
            "optimizer": 0 if off_opt else optimizer,
            "params_host": _nbytes(params_host) + (_nbytes(held) if off_param else 0),
            "grads_host": _nbytes(grads_host), "optimizer_host": optimizer if off_opt else 0}


def offload_devices(config: dict) -> dict:
    """``{"params": device, "optimizer": device}`` the config offloads to (``"host"`` for cpu, ``"nvme"``)."""
    zero = config.get("zero_optimization") or {}
    device = {k: (zero.get(k) or {}).get("device", "none") for k in ("offload_param", "offload_optimizer")}
    return {what: {"cpu": "host", "nvme": "nvme"}.get(device[key], "host")
            for what, key in (("params", "offload_param"), ("optimizer", "offload_optimizer"))}


def _state_fields(held: dict, devices: dict) -> str:
    """The memory line's fields; offloaded bytes are labelled ``on host`` (cpu) or ``on nvme`` (swapped
    to files under ``nvme_path``)."""
    return "".join(f" | {label} (bytes): {held[key]}" for key, label in
                   (("params", "params"), ("grads", "grads"), ("optimizer", "optimizer"),
                    ("params_host", f"params on {devices['params']}"),
                    ("grads_host", f"grads on {devices['optimizer']}"),
                    ("optimizer_host", f"optimizer on {devices['optimizer']}")))


def pretrain(run: RunConfig, *, print_args: bool = True) -> dict:
    """Train on the running default process group (every rank one DP rank) with DeepSpeed's engine
    built from ``run.deepspeed`` (:func:`apply_config`, through ``validate_args``), on ``run.model``;
    the rest of the run (optimizer, schedule, seed, log) as the course trainer reads it. Collective.

    Returns this rank's record, as :func:`course_lib.train.pretrain`'s: ``lm_loss`` (every rank),
    ``grad_norm``, ``learning_rate``, ``elapsed_ms``, ``skipped``, ``loss_scale`` per iteration,
    ``logged`` (last rank), ``memory`` and ``state_bytes`` (:func:`held_bytes`), ``num_parameters``,
    ``zero_stage``, and ``phases``: this rank's ``{"kind", "iteration", "micro", "start", "end"}`` spans
    (``time.perf_counter()`` seconds; kind ``forward``, ``backward`` or ``step``: DeepSpeed's
    ``engine.step()``, the optimizer at the accumulation boundary), the clock a recorder of the
    process group's collectives can place them on."""
    deepspeed = import_deepspeed()
    # what this process holds before the run (torch's and DeepSpeed's modules: ~400,000 objects in a rank forked
    # from a launcher that preloaded them) goes to the permanent generation, so the collections of the run
    # (DeepSpeed's own and the one at the end) walk only the run's objects. A full collection took ~1 s of CPU in
    # each forked rank here: each config a launch of 4 ranks trains costs 0.93 s of CPU instead of 1.68 (Lab 10's
    # tiny GPT, 2 cores)
    gc.freeze()
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed", category=FutureWarning)
    world, rank = dist.get_world_size(), dist.get_rank()
    ds, opt, seed = run.deepspeed, run.optimizer, run.schedule.seed
    config = ds["config"]
    ga, micro = config["gradient_accumulation_steps"], config["train_micro_batch_size_per_gpu"]
    global_batch_size = config["train_batch_size"]
    stage = int((config.get("zero_optimization") or {}).get("stage", 0))
    if rank == 0:
        for note in run.deepspeed_notes:
            print_line(f"WARNING: {note}")
        if print_args:
            print_line(world_size_line(world, world, 1, 1, 1))
            for line in arguments_lines({k: v for k, v in run.arguments if k != "deepspeed"}):
                print_line(line)
    model = GPTModel(run.model)
    model.train()
    num_parameters = sum(p.numel() for p in model.parameters())
    groups = param_groups(list(model.named_parameters()), opt.weight_decay)
    client = _client_optimizer(opt, groups) if ds["client_optimizer"] else None
    schedule = build_lr_scheduler(opt, global_batch_size)
    lr_scheduler = (lambda opt: MegatronSchedule(opt, schedule, global_batch_size)) if ds["megatron_schedule"] else None
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups if client is None else None,
                                           optimizer=client, lr_scheduler=lr_scheduler, config=json.loads(
                                               json.dumps(config)), dist_init_required=False)
    if rank == 0:
        print_line(parameters_line(0, 0, num_parameters))
    torch.manual_seed(seed)
    record = {"lm_loss": [], "grad_norm": [], "learning_rate": [], "elapsed_ms": [], "skipped": [], "loss_scale": [],
              "logged": [], "num_parameters": num_parameters, "zero_stage": stage, "coords": {"dp": rank},
              "phases": []}
    dist.barrier()
    log = TrainingLog(record, train_iters=run.schedule.train_iters, log_interval=run.logging.log_interval,
                      global_batch_size=global_batch_size, prints=rank == world - 1)
    dataset = build_train_dataset(run, global_batch_size)       # the trainer's samples, in its order
    for iteration in range(1, run.schedule.train_iters + 1):
        it_start = time.perf_counter()
        skipped_before, own_norm = engine.skipped_steps, float("nan")
        loss_sum = torch.zeros((), dtype=torch.float64)
        for j in range(ga):
            b = get_batch(iteration - 1, j, rank, world, micro, run.model.seq_length, seed,
                          global_batch_size=global_batch_size, dataset=dataset)
            marks = [time.perf_counter()]
            logits = engine(b["tokens"].to(engine.device))                               # [s, micro, V]
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                                     b["labels"].t().reshape(-1).to(engine.device))
            marks.append(time.perf_counter())
            engine.backward(loss)
            if j == ga - 1 and stage == 0:       # the averaged grads (ZeRO-0 reports no norm in fp32)
                own_norm = _grad_norm(engine.module.parameters())
            marks.append(time.perf_counter())
            engine.step()
            marks.append(time.perf_counter())
            record["phases"] += [{"kind": kind, "iteration": iteration, "micro": j, "start": t0, "end": t1}
                                 for kind, t0, t1 in zip(("forward", "backward", "step"), marks, marks[1:])]
            loss_sum += loss.detach().double().cpu()
        dist.all_reduce(loss_sum)                      # equal token counts: the mean of the micro-batch means
        lm_loss = float(loss_sum) / (ga * world)
        skipped = engine.skipped_steps > skipped_before
        norm = engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else own_norm
        lr = engine.get_lr()[0]
        scale = float(getattr(engine.optimizer, "cur_scale", 1.0)) if run.precision.fp16 else 1.0
        log.step(lm_loss=lm_loss, grad_norm=norm, learning_rate=lr,
                 elapsed_ms=(time.perf_counter() - it_start) * 1000.0, skipped=skipped, loss_scale=scale)
        if log.due(iteration):
            dist.barrier()
            log.log(iteration, learning_rate=lr, grad_norm=norm, loss_scale=scale)
            if log.memory_due(iteration):
                held = held_bytes(engine, stage)
                device = held["params"] + held["grads"] + held["optimizer"]
                record["state_bytes"], record["memory"] = held, {"allocated": device, "max_allocated": device}
                print_line(memory_line(rank, iteration, allocated=device, max_allocated=device,
                                       source=MEMORY_SOURCE) + _state_fields(held, offload_devices(config)))
    engine.destroy()
    # DeepSpeed's ZeRO-3 objects hold collectives in reference cycles; freed at interpreter exit, after the
    # process group is gone, a gloo work's thread can end the rank with "terminate called without an active
    # exception" (SIGABRT; seen under load). Free them while the group is alive, then meet the other ranks.
    del engine
    gc.collect()
    gc.unfreeze()                                # the process's objects as they were before the run
    dist.barrier()
    return record
