"""Checkpoints: save, resume exactly, reshard on load -- Megatron-LM's checkpoint flow for the course's trainer.

For: ``--save`` / ``--load`` / ``--ckpt-format torch_dist|torch``. Main names: :func:`save_checkpoint`,
:func:`load_checkpoint`, :func:`checkpoint_and_decide_exit`, :func:`sharded_state_dict` (a rank's
pieces as megatron-core's ``ShardedTensor`` keys, so megatron-core loads a course checkpoint),
:class:`CheckpointError`. It composes the owners' state: the optimizer's, the scheduler's, the
engine's, :class:`~course_lib.training.rng_state.RNGState` and :class:`~course_lib.data.DataPosition`.
Follows: ``megatron/training/checkpointing.py`` (``save_checkpoint``, ``load_checkpoint``,
``get_checkpoint_name``, ``read_metadata``), ``megatron/core/dist_checkpointing/``.
Manual (what one save writes, the sharded keys, faults): docs/internals/checkpointing.md.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import os
import re
import shutil
from datetime import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from course_lib import comm, rules
from course_lib.data.sampler import DataPosition
from course_lib.training.logs import print_line
from course_lib.model import master_name
from course_lib.safe_files import write_atomic
from course_lib.tensor_parallel import is_tensor_parallel
from course_lib.training.setup import TrainingSetup
from course_lib.training.finalize_model_grads import unique_named_params
from course_lib.training.rng_state import RNGState
from course_lib.training.safe_load import UnsafeCheckpointError, torch_load

__all__ = ["CheckpointError", "TRACKER", "get_checkpoint_tracker_filename", "checkpoint_dir", "get_checkpoint_name",
           "read_metadata", "stacked_layers", "sharded_key", "LAYER_AXIS_KEY", "global_spec", "expert_global_spec",
           "sharded_state_dict", "save_checkpoint", "load_checkpoint", "checkpoint_and_decide_exit",
           "checkpoint_format"]

TRACKER = "latest_checkpointed_iteration.txt"
CHECKPOINT_VERSION = 3.0                      # Megatron's checkpoint_version
LEGACY_FILE, DIST_OPTIM_FILE = "model_optim_rng.pt", "distrib_optim.pt"
COMMON_FILE, METADATA_FILE = "common.pt", "metadata.json"
DIST_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                 "common_backend": "torch", "common_backend_version": 1}
MODEL_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
               "padded_vocab_size")
DATA_FLAGS = ("global_batch_size", "seed")    # the data order a resume continues
LAYOUT_KEYS = ("tp", "pp", "cp", "dp", "vpp")
# megatron-core's local spec saves the LayerNorms under the names of the TE linears that fuse them
# (get_gpt_layer_local_spec's sharded_state_dict_keys_map, MoE layers too), the experts under SequentialMLP's
# keys (moe/experts.py: local_experts.<i>. -> experts., with an expert axis), and an _extra_state object (None)
# per linear (per layer, and per expert)
MCORE_LAYER_KEYS = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
                    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
                    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
                    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
                    "mlp.experts.linear_fc1.weight": "mlp.experts.experts.linear_fc1.weight",
                    "mlp.experts.linear_fc2.weight": "mlp.experts.experts.linear_fc2.weight",
                    "mlp.experts.linear_fc1.bias": "mlp.experts.experts.linear_fc1.bias",
                    "mlp.experts.linear_fc2.bias": "mlp.experts.experts.linear_fc2.bias"}
MCORE_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2",
                 "mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")
# a key stacked over the layers (dim 0: the layer axis), the model's or its optimizer state's
LAYER_AXIS_KEY = re.compile(r"(^|\.)decoder\.layers\.(?!\d)")
_LINEAR_WEIGHT = re.compile(r"decoder\.layers\.(?:\d+\.)?(.+)\.weight")


class CheckpointError(rules.UsageError):
    """A checkpoint that cannot be saved or loaded; the message is one line naming the file or the mismatch."""


# ---------------------------------------------------------------------------- names


def get_checkpoint_tracker_filename(checkpoints_path) -> Path:
    """``DIR/latest_checkpointed_iteration.txt`` (Megatron's tracker)."""
    return Path(checkpoints_path) / TRACKER


def checkpoint_dir(checkpoints_path, iteration: int) -> Path:
    """``DIR/iter_0000003``."""
    return Path(checkpoints_path) / f"iter_{iteration:07d}"


def get_checkpoint_name(checkpoints_path, iteration: int, tp_rank: int, pp_rank: int, pipeline_parallel: bool) -> Path:
    """The legacy file of a model-parallel rank: ``iter_0000003/mp_rank_TT_PPP/model_optim_rng.pt``
    (``mp_rank_TT`` without pipeline parallelism), as Megatron's ``get_checkpoint_name``."""
    folder = f"mp_rank_{tp_rank:02d}" + (f"_{pp_rank:03d}" if pipeline_parallel else "")
    return checkpoint_dir(checkpoints_path, iteration) / folder / LEGACY_FILE


def read_metadata(tracker_filename) -> int:
    """The iteration the tracker names (a positive integer), or a one-line :class:`CheckpointError`."""
    text = Path(tracker_filename).read_text(errors="replace").strip()
    if not text.isdigit() or int(text) < 1:
        raise CheckpointError(f"{tracker_filename} should hold an iteration number but holds {text[:40]!r}: the file "
                              f"is damaged; write the newest complete iter_XXXXXXX number into it, or --load another folder")
    return int(text)


def checkpoint_format(ckpt: Path) -> str:
    """``torch_dist`` (a ``metadata.json``) or ``torch`` (``mp_rank_*`` folders) -- what the folder holds."""
    if (ckpt / METADATA_FILE).is_file():
        return "torch_dist"
    if any(ckpt.glob(f"mp_rank_*/{LEGACY_FILE}")):
        return "torch"
    raise CheckpointError(f"{ckpt} holds neither {METADATA_FILE} (torch_dist) nor mp_rank_*/{LEGACY_FILE} (torch): "
                          f"not a complete checkpoint; --load another folder")


def _print0(line: str) -> None:
    if dist.get_rank() == 0:
        print_line(line)


# ---------------------------------------------------------------------------- the state, as global tensors


def _layout(setup) -> dict:
    c, moe = setup.config, setup.moe_groups
    experts = {} if moe is None else {"ep": moe.size("ep"), "expert_tp": moe.size("expert_tp")}
    return {"tp": c.tp, "pp": c.pp, "cp": c.cp, "dp": c.dp, "vpp": c.vpp, "world_size": c.world_size, **experts}


def _local_params(setup) -> dict:
    """``{chunk param name: this rank's tensor}`` (TP shards), each parameter once (the engine: its
    buffers, ZeRO-3 gathered). Collective with the engine."""
    if setup.engine is not None:
        return setup.engine.full_parameters()
    return {n: p.detach() for n, p in unique_named_params(setup.chunks)}


@torch.no_grad()
def _optimizer_state(setup: TrainingSetup) -> dict:
    """``{state name: {chunk param name: full local tensor}}``: the optimizer's, or the engine's (the
    distributed optimizer's DP shards gathered). Collective with the engine."""
    if setup.engine is not None:
        return setup.engine.full_optimizer_state()
    opt = setup.optimizer
    out = {k: {} for k in opt.state_keys}
    for name, p in unique_named_params(setup.chunks):
        for k, value in opt.param_state(p).items():
            out[k][name] = value
    return out


def stacked_layers(config) -> bool:
    """Whether megatron-core stacks the decoder's layers on a layer axis (``TransformerBlock.sharded_state_dict``):
    not when they differ, i.e. ``--moe-layer-freq`` is a list or an int above 1 (``non_homogeneous_layers``)."""
    freq = config.moe_layer_freq
    return not (isinstance(freq, (list, tuple)) or freq > 1)


def sharded_key(master: str, stacked: bool = True) -> tuple[str, int | None]:
    """megatron-core's sharded key of a master parameter and its offset on the layer axis (None outside the
    layers, or with ``stacked`` False: the layer index stays in the key):
    ``decoder.layers.3.input_layernorm.weight`` -> ``("decoder.layers.self_attention.linear_qkv.layer_norm_weight", 3)``
    (not stacked: ``("decoder.layers.3.self_attention.linear_qkv.layer_norm_weight", None)``)."""
    if not master.startswith("decoder.layers."):
        return master, None
    _, _, layer, rest = master.split(".", 3)
    rest = MCORE_LAYER_KEYS.get(rest, rest)
    return (f"decoder.layers.{rest}", int(layer)) if stacked else (f"decoder.layers.{layer}.{rest}", None)


def global_spec(p, local: torch.Tensor, tp: int, tp_rank: int) -> tuple[tuple, tuple]:
    """``(global shape, offsets)`` of a rank's tensor ``local`` of the parameter ``p`` (TP shards are contiguous
    chunks along ``partition_dim``: stride 1, as :func:`course_lib.tensor_parallel.copy_dense_to_parallel`)."""
    shape, offsets = list(local.shape), [0] * local.dim()
    if is_tensor_parallel(p) and tp > 1:
        dim = p.partition_dim
        offsets[dim], shape[dim] = tp_rank * shape[dim], shape[dim] * tp
    return tuple(shape), tuple(offsets)


def expert_global_spec(p, local: torch.Tensor, ep: int, ep_rank: int, etp: int, etp_rank: int) -> tuple[tuple, tuple]:
    """``(global shape, offsets)`` of a rank's stacked experts ``local`` ``[E/ep, ...]`` of the expert weight
    ``p``: experts ``ep_rank * E/ep`` on along dim 0, the expert-TP shard ``etp_rank`` along
    ``p.expert_partition_dim`` (None: not split, fc2's bias; :class:`course_lib.moe.transformer.MoEMLP`)."""
    shape, offsets = list(local.shape), [0] * local.dim()
    offsets[0], shape[0] = ep_rank * shape[0], shape[0] * ep
    dim = p.expert_partition_dim
    if dim is not None:
        offsets[dim], shape[dim] = etp_rank * shape[dim], shape[dim] * etp
    return tuple(shape), tuple(offsets)


def sharded_state_dict(setup, params: dict, optim: dict, *, for_load: bool = False) -> dict:
    """This rank's pieces, ``{name: (local tensor, sharded key, global shape, offsets)}``: ``name`` is the
    master name for the model, ``optimizer.state.<k>.<master name>`` for the optimizer (its key: the same
    prefix on the model's key), see the module doc; a decoder layer's tensor is one slice of the layer axis
    megatron-core prepends (``[L, *shape]`` at ``[layer, *offsets]``; :func:`stacked_layers`). The last
    stage's copy of the tied embedding (``shared``) is the first stage's tensor: saved once, and read
    (``for_load``) from the first stage's key."""
    tp, tp_rank = comm.group_size(setup.groups.tp), setup.groups.coords["tp"]
    config, moe = setup.chunks[0].config, setup.moe_groups
    stacked = stacked_layers(config)

    def spec(p, local, layer):
        if moe is not None and hasattr(p, "expert_partition_dim"):
            shape, offsets = expert_global_spec(p, local, moe.size("ep"), comm.group_rank(moe.ep),
                                                moe.size("expert_tp"), comm.group_rank(moe.expert_tp))
        else:
            shape, offsets = global_spec(p, local, tp, tp_rank)
        return (shape, offsets) if layer is None else ((config.num_layers, *shape), (layer, *offsets))

    out = {}
    for name, p in unique_named_params(setup.chunks):
        if getattr(p, "shared", False) and not for_load:
            continue
        master = master_name(name)
        key, layer = sharded_key(master, stacked)
        out[master] = (params[name], key, *spec(p, params[name], layer))
        for k, values in optim.items():
            out[f"optimizer.state.{k}.{master}"] = (values[name], f"optimizer.state.{k}.{key}",
                                                    *spec(p, values[name], layer))
    return out


def _extra_states(sharded: dict) -> dict:
    """megatron-core's ``_extra_state`` objects of this rank's decoder linears, one per ``ShardedObject``
    and named by its offsets on the axes before the weight's own two (the layer axis, an expert's axis):
    ``decoder.layers.<linear>._extra_state/shard_<l>_<L>``, an expert's ``shard_<l>.<e>_<L>.<E>``
    (not stacked: ``decoder.layers.<l>.<linear>._extra_state/shard_0_1``, an expert's ``shard_<e>_<E>``).
    Its local linears' are None, saved in a list, which DCP pickles."""
    out = {}
    for local, key, shape, offsets in sharded.values():
        match = _LINEAR_WEIGHT.fullmatch(key)
        if match is None or match.group(1) not in MCORE_LINEARS:
            continue
        axes = len(shape) - 2
        held = ((1,) * (len(shape) - local.dim()) + tuple(local.shape))[:axes]     # this piece's extent on them
        every, first = (shape[:axes], offsets[:axes]) if axes else ((1,), (0,))
        for at in itertools.product(*(range(o, o + n) for o, n in zip(first, held or (1,)))):
            out[f"{key.removesuffix('.weight')}._extra_state/shard_{'.'.join(map(str, at))}_"
                f"{'.'.join(map(str, every))}"] = [None]
    return out


def _scheduler_state(run, scheduler) -> dict:
    """megatron-core's ``OptimizerParamScheduler.state_dict()`` keys: the learning rate's (the scheduler's
    own), then the weight decay's (the course's is constant: ``start_wd = end_wd``, Megatron's
    ``wd_incr_steps = train_iters x global batch``, ``training.py`` ``get_optimizer_param_scheduler``),
    so its ``load_state_dict`` takes them."""
    return {**scheduler.state_dict(),
            "start_wd": run.optimizer.weight_decay, "end_wd": run.optimizer.weight_decay, "wd_incr_style": "constant",
            "wd_incr_steps": run.schedule.train_iters * run.parallel.effective_global_batch_size}


def _model_flags(run) -> dict:
    """The model sizes a checkpoint must match (``MODEL_FLAGS``, from the run's ``GPTConfig``)."""
    return {k: getattr(run.model, k) for k in MODEL_FLAGS}


def _data_flags(run) -> dict:
    """The data order a resume continues (``DATA_FLAGS``)."""
    return {"global_batch_size": run.parallel.effective_global_batch_size, "seed": run.schedule.seed}


def _data_position(setup: TrainingSetup, iteration: int = 0) -> DataPosition:
    """The sampler's position after ``iteration`` iterations (Megatron's ``consumed_train_samples``)."""
    g = setup.config.effective_global_batch_size
    return DataPosition(g, iteration * g)


def _common_state(setup: TrainingSetup, iteration: int) -> dict:
    """What every rank shares (Megatron's ``common.pt`` / the non-tensor part of ``model_optim_rng.pt``):
    ``args`` an ``argparse.Namespace`` of the run's flags as Megatron's (its ``load_checkpoint`` reads it
    with getattr, the consumed samples too), the scheduler's state as megatron-core's."""
    run, scaler = setup.run, setup.scaler
    data = _data_position(setup, iteration).state_dict()
    saved_args = {k: v for k, v in run.arguments if isinstance(v, (int, float, str, bool, type(None)))}
    return {"checkpoint_version": CHECKPOINT_VERSION, "iteration": iteration,
            "args": argparse.Namespace(**{**saved_args, **data, "consumed_valid_samples": 0}),
            "model_flags": _model_flags(run),
            "data_flags": _data_flags(run),
            **data,
            "layout": {**_layout(setup), "strategy": run.sharding.strategy if run.sharding.uses_engine else None},
            "opt_param_scheduler": _scheduler_state(run, setup.scheduler),
            "optimizer": {**setup.optimizer.state_dict(),
                          "grad_scaler": None if scaler is None else scaler.state_dict()}}


# ---------------------------------------------------------------------------- save


def _agree(failure) -> None:
    """Every rank raises when any rank failed (so no rank waits in a collective for a failed one)."""
    flag = torch.tensor([0.0 if failure is None else 1.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if failure is not None:
        raise failure
    if flag.item():
        raise CheckpointError("another rank failed (its error is above); nothing was changed")


def _rng_object(setup) -> tuple[str, int, bool]:
    """megatron-core's ``rng_state`` ``ShardedObject`` of this rank (Megatron-LM's ``get_rng_state`` for
    torch_dist): ``(key, index of this rank's state in its list, one object per rank)``. One object per
    (PP, TP) rank, ``rng_state/shard_<pp>.<tp>_<PP>.<TP>``, holding the list of its DP x CP replicas' states
    (Megatron's list: one state, or under ``--data-parallel-random-init`` one per DP replica, gathered over DP
    without CP; DP x CP replica 0 writes it); with EP > 1 one per rank,
    ``rng_state/shard_<pp>.<tp>.<dp>_<PP>.<TP>.<DP>`` (DP with CP)."""
    g, c = setup.groups, setup.config
    pp, tp, dp, n = g.coords["pp"], g.coords["tp"], comm.group_rank(g.dp_cp), comm.group_size(g.dp_cp)
    if setup.moe_groups is not None and setup.moe_groups.size("ep") > 1:
        return f"rng_state/shard_{pp}.{tp}.{dp}_{c.pp}.{c.tp}.{n}", 0, True
    return f"rng_state/shard_{pp}.{tp}_{c.pp}.{c.tp}", dp, False


def _save_dist(tmp: Path, sharded: dict, setup) -> None:
    """The pieces, the linears' ``_extra_state`` and the RNG ``ShardedObject`` (:func:`_rng_object`), each
    object as megatron-core's torch_dist strategy stores one: ``torch.save([data])`` in a ``BytesIO``."""
    from course_lib.training.dcp_io import save_pieces

    state = _extra_states(sharded)
    key, index, per_rank = _rng_object(setup)
    rngs = [RNGState().state_dict()]
    if not per_rank and comm.group_size(setup.groups.dp_cp) > 1:
        rngs = [None] * comm.group_size(setup.groups.dp_cp)
        dist.all_gather_object(rngs, RNGState().state_dict(), group=setup.groups.dp_cp)
    if per_rank or index == 0:                    # the main replica writes it
        buf = io.BytesIO()
        torch.save([rngs], buf)
        state[key] = buf
    save_pieces(state, sharded, tmp)


def _save_legacy(tmp: Path, setup: TrainingSetup, params: dict, optim: dict, common: dict) -> None:
    """Megatron's ``torch`` format: DP rank 0 (CP rank 0) of each model-parallel rank writes its file; the
    RNG states of its DP x CP replicas go in as a list (group-rank order)."""
    g = setup.groups
    rngs = [None] * comm.group_size(g.dp_cp)
    if len(rngs) > 1:
        dist.all_gather_object(rngs, RNGState().state_dict(), group=g.dp_cp)
    else:
        rngs = [RNGState().state_dict()]
    if g.coords["dp"] != 0 or g.coords["cp"] != 0:
        return
    name = get_checkpoint_name(tmp.parent, common["iteration"], g.coords["tp"], g.coords["pp"], setup.config.pp > 1)
    folder = tmp / name.parent.name
    folder.mkdir(parents=True, exist_ok=True)
    models = [{n: params[n].cpu() for n, _ in chunk.named_parameters() if n in params} for chunk in setup.chunks]
    state = {**common, "rng_state": rngs}
    state.update({"model": models[0]} if len(models) == 1 else {f"model{i}": m for i, m in enumerate(models)})
    opt_state = {k: {n: t.cpu() for n, t in v.items()} for k, v in optim.items()}
    if setup.engine is not None and setup.engine.shard_optim:      # Megatron's separate file for it
        torch.save({"state": opt_state}, folder / DIST_OPTIM_FILE)
    else:
        state["optimizer"] = {**common["optimizer"], "state": opt_state}
    torch.save(state, folder / LEGACY_FILE)


def _publish(tmp: Path, final: Path) -> None:
    """Rank 0: the finished folder takes its name (an existing one of that iteration is replaced, said so)."""
    if final.exists():
        print_line(f"WARNING: {final} already exists (an earlier run's save of this iteration); replacing it")
        old = final.with_name(f".{final.name}.replaced")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(setup: TrainingSetup, iteration: int) -> Path:
    """Save this run at ``iteration`` into ``--save`` in ``--ckpt-format`` (collective: every rank).

    Written into ``DIR/.iter_XXXXXXX.incomplete``; renamed to ``iter_XXXXXXX`` once every rank has
    written; then the tracker (atomic). A failed write (a full disk) removes the incomplete folder and
    raises a one-line :class:`CheckpointError` on every rank; the previous checkpoint stays."""
    flags = setup.run.checkpointing
    root, rank, g = Path(flags.save), dist.get_rank(), setup.groups
    final = checkpoint_dir(root, iteration)
    tmp = final.with_name(f".{final.name}.incomplete")
    _print0(f"[{datetime.now():%Y-%m-%d %H:%M:%S.%f}] saving checkpoint at iteration {iteration:7d} to {root} in "
            f"{flags.ckpt_format} format")
    params = _local_params(setup)
    optim = _optimizer_state(setup)
    common = _common_state(setup, iteration)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)      # a save killed earlier left it
        tmp.mkdir(parents=True)
    dist.barrier()
    failure = None
    from torch.distributed.checkpoint.api import CheckpointException    # what DCP raises for any rank's failure

    try:
        if flags.ckpt_format == "torch_dist":
            _save_dist(tmp, sharded_state_dict(setup, params, optim), setup)
            if rank == 0:
                torch.save(common, tmp / COMMON_FILE)
                write_atomic(tmp / METADATA_FILE, json.dumps(DIST_METADATA))
        else:
            _save_legacy(tmp, setup, params, optim, common)
    except (OSError, RuntimeError, CheckpointException) as exc:   # a full disk, a failed write on any rank
        reason = str(exc).strip().splitlines()
        failure = CheckpointError(f"saving checkpoint at iteration {iteration} to {root} failed "
                                  f"({reason[-1] if reason else type(exc).__name__}); the previous checkpoint "
                                  f"and {TRACKER} are unchanged")
    try:
        _agree(failure)
    except CheckpointError:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    dist.barrier()
    if rank == 0:
        _publish(tmp, final)
        write_atomic(get_checkpoint_tracker_filename(root), str(iteration))
    dist.barrier()
    _print0(f"  [{datetime.now():%Y-%m-%d %H:%M:%S.%f}] successfully saved checkpoint from iteration "     # Megatron's
            f"{iteration:7d} to {root} [ t {g.coords['tp'] + 1}/{setup.config.tp}, p {g.coords['pp'] + 1}/{setup.config.pp} ]")
    return final


def checkpoint_and_decide_exit(setup: TrainingSetup, iteration: int) -> bool:
    """After iteration ``iteration`` (Megatron's ``checkpoint_and_decide_exit``, plus ``pretrain``'s save
    at the end of training): save every ``--save-interval``; at an ``--exit-interval`` save (with
    ``--save``) and return True (stop); at the last iteration save unless that iteration was just saved."""
    flags, saved = setup.run.checkpointing, False
    if flags.save and flags.save_interval and iteration % flags.save_interval == 0:
        save_checkpoint(setup, iteration)
        saved = True
    if flags.exit_interval and iteration % flags.exit_interval == 0:
        if flags.save and not saved:
            save_checkpoint(setup, iteration)
        _print0(f"[exiting program at iteration {iteration}] datetime: "      # Megatron's print_datetime
                f"{datetime.now():%Y-%m-%d %H:%M:%S.%f} ")
        return True
    if flags.save and not saved and iteration == setup.run.schedule.train_iters:
        save_checkpoint(setup, iteration)
    return False


# ---------------------------------------------------------------------------- load


def _torch_load(path: Path):
    """A checkpoint file read with :func:`course_lib.training.safe_load.torch_load` (an allow-list of classes:
    a file naming any other is refused, not run), or a one-line :class:`CheckpointError`."""
    try:
        return torch_load(path)
    except UnsafeCheckpointError as exc:
        raise CheckpointError(str(exc)) from None
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete; --load another folder") from None
    except Exception as exc:  # noqa: BLE001 -- unpickling a damaged file raises anything
        first = (str(exc).strip().splitlines() or [""])[0]
        raise CheckpointError(f"{path} cannot be read ({type(exc).__name__}: {first}): the file is damaged or "
                              f"truncated; --load an earlier checkpoint") from None


def _dist_metadata(ckpt: Path):
    """DCP's ``.metadata`` of ``ckpt``, with every ``.distcp`` file checked to be as long as it says."""
    from course_lib.training.dcp_io import SafeFileSystemReader

    try:
        md = SafeFileSystemReader(str(ckpt)).read_metadata()
    except UnsafeCheckpointError as exc:
        raise CheckpointError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001
        raise CheckpointError(f"{ckpt / '.metadata'} cannot be read ({type(exc).__name__}): the file is damaged "
                              f"or missing; --load an earlier checkpoint") from None
    need: dict = {}
    for info in md.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for rel, n in sorted(need.items()):
        path = ckpt / rel
        size = path.stat().st_size if path.is_file() else -1
        if size < n:
            state = "missing" if size < 0 else f"truncated ({size} bytes; .metadata says >= {n})"
            raise CheckpointError(f"{path} is {state}: the checkpoint is damaged; --load an earlier checkpoint")
    return md


def _load_dist(ckpt: Path, wanted: dict, rng: tuple | None):
    """Read ``wanted`` (:func:`sharded_state_dict`) from a torch_dist checkpoint into new tensors of this
    rank's shapes, ``{name: tensor}``; DCP reads the overlapping saved chunks. ``rng``: this rank's
    :func:`_rng_object`, to read its generator states too (or None)."""
    from torch.distributed.checkpoint.api import CheckpointException

    from course_lib.training.dcp_io import load_pieces, piece_problem

    md = _dist_metadata(ckpt)
    problem = next(filter(None, (piece_problem(md, key, shape) for _, key, shape, _ in wanted.values())), None)
    _agree(None if problem is None else CheckpointError(   # every rank stops (a stage's keys are its own)
        f"checkpoint {ckpt} holds {problem}: it was saved from another model, layer pattern or optimizer; "
        f"--load another checkpoint"))
    pieces = {name: (torch.empty_like(like), *spec) for name, (like, *spec) in wanted.items()}
    state, rng_key = {}, rng[0] if rng else None
    if rng:
        state[rng_key] = io.BytesIO()
    try:
        load_pieces(state, pieces, ckpt)
    except (Exception, CheckpointException) as exc:  # noqa: BLE001 -- DCP gathers every rank's failure
        lines = [line for line in str(exc).splitlines() if line.strip()]
        raise CheckpointError(f"reading {ckpt} failed ({lines[-1][:120] if lines else type(exc).__name__}): a file "
                              f"is damaged; --load an earlier checkpoint") from None
    values = {name: piece[0] for name, piece in pieces.items()}
    if not rng:
        return values, None
    state[rng_key].seek(0)                # DCP hands back the saved BytesIO
    try:
        rngs = torch_load(state[rng_key], where=f"{ckpt} ({rng_key})")[0]
    except UnsafeCheckpointError as exc:
        raise CheckpointError(str(exc)) from None
    return values, rngs[rng[1]]


def _read_legacy(ckpt: Path, setup, load_optim: bool):
    """This rank's legacy file (and ``distrib_optim.pt``): ``(values by key, rng list, common)``."""
    g = setup.groups
    name = get_checkpoint_name(ckpt.parent, int(ckpt.name[len("iter_"):]), g.coords["tp"], g.coords["pp"],
                               setup.config.pp > 1)
    state = _torch_load(name)
    models = [state["model"]] if "model" in state else [state[f"model{i}"] for i in range(len(setup.chunks))]
    values = {}
    for model in models:
        for n, t in model.items():
            values[master_name(n)] = t
    if load_optim:
        opt = state["optimizer"].get("state") or _torch_load(name.parent / DIST_OPTIM_FILE)["state"]
        for k, per_name in opt.items():
            for n, t in per_name.items():
                values[f"optimizer.state.{k}.{master_name(n)}"] = t
    return values, state.get("rng_state"), state


@torch.no_grad()
def _set_state(setup: TrainingSetup, values: dict, load_optim: bool) -> None:
    """Copy ``values`` (keys of :func:`sharded_state_dict`) into this rank's params and optimizer; the
    tied embedding's last-stage copy takes the embedding's values (and state)."""
    named = unique_named_params(setup.chunks)
    keys = setup.optimizer.state_keys if load_optim else ()
    params = {n: values[master_name(n)].to(p.device, p.dtype) for n, p in named}
    state = {k: {n: values[f"optimizer.state.{k}.{master_name(n)}"] for n, _ in named} for k in keys}
    if setup.engine is not None:      # its buffers: model params (or the ZeRO-3 shard), fp32 main params, state
        setup.engine.load_full_state(params, state)
        return
    for n, p in named:
        p.data.copy_(params[n])
        if keys:
            setup.optimizer.load_param_state(p, {k: state[k][n] for k in keys})


def _set_common(setup: TrainingSetup, common: dict) -> None:
    """Scheduler, step count and loss scaler (Megatron loads them with the optimizer)."""
    setup.scheduler.load_state_dict(common["opt_param_scheduler"])
    setup.optimizer.load_state_dict(common["optimizer"])
    saved, scaler = common["optimizer"]["grad_scaler"], setup.scaler
    if scaler is not None and saved is not None:
        scaler.load_state_dict(saved)


def load_checkpoint(setup: TrainingSetup) -> int:
    """Load ``--load``'s newest checkpoint into this rank (collective); returns the iteration to
    continue after (0: from scratch, or ``--finetune``).

    No tracker: Megatron's warning, then 0. ``--finetune``: the model only, iteration 0;
    ``--no-load-optim``: no optimizer, scheduler or loss scaler; ``--no-load-rng``: no generator states
    (nor when the layout changed: they are per rank, and Megatron skips them then too). torch_dist
    loads under any layout; torch only under the TP x PP x VP it was saved with. A model that
    megatron-core's ``dist_checkpointing.save`` wrote (its ``GPTModel.sharded_state_dict``, no run state
    in ``common.pt``) loads with ``--finetune``."""
    flags = setup.run.checkpointing
    root = Path(flags.load)
    tracker = get_checkpoint_tracker_filename(root)
    if not tracker.is_file():
        _print0(f"WARNING: could not find the metadata file {tracker}")
        _print0("    will not load any checkpoints and will start from random")
        return 0
    iteration = read_metadata(tracker)
    ckpt = checkpoint_dir(root, iteration)
    if not ckpt.is_dir():
        raise CheckpointError(f"{tracker} names iteration {iteration} but {ckpt} does not exist; write the newest "
                              f"complete iteration into it, or --load another folder")
    fmt = checkpoint_format(ckpt)
    g, run = setup.groups, _layout(setup)
    load_optim = not (flags.finetune or flags.no_load_optim)
    common = _torch_load(ckpt / COMMON_FILE if fmt == "torch_dist" else min(ckpt.glob(f"mp_rank_*/{LEGACY_FILE}")))
    if "model_flags" not in common and not flags.finetune:     # tensors only: megatron-core saved it
        raise CheckpointError(f"{ckpt / COMMON_FILE} holds no run state (flags, layout, optimizer, scheduler): "
                              f"megatron-core's dist_checkpointing saved only a model; load it with --finetune")
    try:
        if "model_flags" in common:       # (a model megatron-core saved is checked by its global shapes)
            rules.checkpoint_model(ckpt, common["model_flags"], _model_flags(setup.run))
            rules.checkpoint_layout(ckpt, common["layout"], run, fmt)
        if not flags.finetune:            # the data order (and the optimizer) a resume continues
            saved = {**common["data_flags"], **({"optimizer": common["optimizer"]["kind"]} if load_optim else {})}
            rules.checkpoint_model(ckpt, saved, {**_data_flags(setup.run),
                                                 "optimizer": setup.optimizer.kind})
            data = _data_position(setup)
            data.load_state_dict(common)
            if data.iteration != iteration:
                raise CheckpointError(f"{ckpt / COMMON_FILE} says consumed_train_samples={data.consumed_train_samples}, "
                                      f"{data.iteration} iterations, but its folder is iteration {iteration}: "
                                      f"the checkpoint is damaged; --load an earlier checkpoint")
    except ValueError as exc:
        raise CheckpointError(str(exc)) from None
    load_rng = not (flags.finetune or flags.no_load_rng)
    if load_rng and not all(common["layout"][k] == run[k] for k in LAYOUT_KEYS):
        saved = " x ".join(f"{k.upper()}{common['layout'][k]}" for k in LAYOUT_KEYS)
        _print0(f"WARNING: checkpoint saved under {saved}; the random number generators are per rank: not loaded")
        load_rng = False
    _print0(f" loading {'distributed ' if fmt == 'torch_dist' else ''}checkpoint from {root} at iteration {iteration}")
    if fmt == "torch_dist":
        params = _local_params(setup)
        optim = _optimizer_state(setup) if load_optim else {}
        values, rng = _load_dist(ckpt, sharded_state_dict(setup, params, optim, for_load=True),
                                 _rng_object(setup) if load_rng else None)
    else:
        failure = values = rngs = None
        try:
            values, rngs, _ = _read_legacy(ckpt, setup, load_optim)
        except CheckpointError as exc:
            failure = exc
        _agree(failure)
        rng = rngs[comm.group_rank(g.dp_cp)] if load_rng else None
    _set_state(setup, values, load_optim)
    if load_optim:
        _set_common(setup, common)
    if rng is not None:
        RNGState().load_state_dict(rng)
    dist.barrier()
    start = 0 if flags.finetune else iteration
    _print0(f"  successfully loaded checkpoint from {root} [ t {g.coords['tp'] + 1}/{run['tp']}, "
            f"p {g.coords['pp'] + 1}/{run['pp']} ] at iteration {start}")
    return start
