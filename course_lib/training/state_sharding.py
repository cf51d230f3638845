"""The trainer on the state-sharding engine: ``--use-distributed-optimizer``, ``--use-megatron-fsdp``, overlap, offload.

With any of the sharding flags (``RunConfig.sharding.uses_engine``) the
trainer's model chunk is wrapped by :func:`course_lib.distributed.wrap` (Megatron's
``DistributedDataParallel`` + ``DistributedOptimizer``, or Megatron-FSDP's strategy): the engine's
post-accumulate-grad hooks take every gradient into its bucketed fp32 buffer, its ``step`` reduces
over the dp-cp group (all-reduce, or reduce-scatter for the sharded strategies), updates this rank's
shard and all-gathers the params. What Megatron's ``finalize_model_grads`` and optimizer do around
that reduction, the trainer does here, on the engine's buffers, in Megatron's order:

* ``engine.finish_grad_sync()`` -- the dp-cp reduction (Megatron's ``finish_grad_sync``);
* **after** it (pp > 1): the tied word-embedding gradient summed over the embedding group (first + last
  stage), on the *reduced* gradient (:func:`allreduce_embedding_grads_after_sync`;
  ``_allreduce_word_embedding_grads``, ``finalize_model_grads.py`` main ~640 then ~676). That works on
  shards because the embedding is marked ``shared_embedding`` on both stages and the engine gives it a
  bucket of its own, laid out and padded alike on both (Megatron's ``_does_param_require_new_bucket``):
  rank r of one stage's dp group holds the same elements of it as rank r of the other;
* **between** the reduction and the update, through the engine's loss-scaler protocol
  (:class:`ShardedGradFinalizer`, Megatron's ``DistributedOptimizer.step``): the
  sequence-parallel LayerNorm (and row-parallel bias) gradients summed over TP -- shard by shard,
  since the TP ranks of one DP position lay their buckets out alike; for fp16, unscaling and the
  found-inf flag (MAX over the model-parallel group, then the engine's over dp-cp: the whole
  world, as Megatron's grad-stats group with the distributed optimizer); the gradient norm of the
  whole model from the shards (each parameter once: TP duplicates on TP rank 0 only, the last
  stage's embedding copy not at all; squares summed over dp-cp when sharded, then over tp-pp,
  ``get_grad_norm_fp32``) and clipping of the shards to ``--clip-grad``. The norm is computed
  here and only here: ``engine.step(lr)`` without ``clip_grad`` or ``grad_norm=True`` computes none.

Micro-batches: Megatron's ``no_sync`` -- with ``--overlap-grad-reduce`` and pp = 1 under 1F1B a
bucket's reduction starts during the *last* micro-batch's backward; earlier ones only accumulate
(:func:`schedule_sync`). With ``--overlap-grad-reduce`` the buckets are Megatron's ``--ddp-bucket-size``
default or value on the first pipeline stage and one bucket on the others
(:func:`~course_lib.distributed.buffer.megatron_bucket_size`). ZeRO-3 with pp > 1: the engine gathers a unit for each forward call's
backward, so the 1F1B cool-down's back-to-back backward passes each find it gathered, and never
gathers again a unit whose backward is over (the last stage's root unit runs first in backward);
after ``engine.step`` no gathered unit is left, so the next forward gathers the updated shards.

Tensors: the engine's buckets (``engine.buckets``) hold flat ``[numel]`` buffers; this rank's
shard of a bucket is elements ``[lo, hi)`` (``[0, numel)`` for ``no_shard``); the grads handed to
:meth:`ShardedGradFinalizer.unscale_and_check` are fp32 ``[hi - lo]`` tensors, one per bucket.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from course_lib import comm
from course_lib.distributed import wrap
from course_lib.distributed.buffer import megatron_bucket_size
from course_lib.model import _shared_embedding_weight
from course_lib.optimizer import clip_grads
from course_lib.tensor_parallel import is_tensor_parallel
from course_lib.training.finalize_model_grads import dp_kind

__all__ = ["ShardedGradFinalizer", "build_engine", "schedule_sync", "allreduce_embedding_grads_after_sync",
           "state_bytes"]


def _pieces(b, grad: torch.Tensor) -> list:
    """``(param, view)`` for every parameter overlapping this rank's shard ``[lo, hi)`` of ``b``
    (``b.state``); ``view``: the piece of ``grad`` (``[hi - lo]``, the shard) that belongs to it."""
    lo, hi = b.state.lo, b.state.hi
    return [(pr.param, grad[pr.start - lo:pr.end - lo]) for pr in b.pieces(lo, hi)]


class ShardedGradFinalizer:
    """The engine's loss-scaler protocol, used for what Megatron's distributed optimizer does between
    the grad reduction and the update (see the module docstring): SP sums over TP, fp16 unscaling and
    found-inf, the grad norm, clipping. ``scaler``: fp16's loss scaler (or None); after each step
    :attr:`norm` holds the gradient norm before clipping."""

    def __init__(self, groups, config, clip_grad: float, scaler=None):
        self.groups, self.config, self.clip_grad, self.scaler = groups, config, clip_grad, scaler
        self.engine = None      # set by build_engine once the engine exists
        self.norm = float("nan")

    @property
    def scale(self) -> float:
        return 1.0 if self.scaler is None else self.scaler.value

    @torch.no_grad()
    def unscale_and_check(self, grads) -> bool:
        """``grads``: this rank's fp32 grad shard of every bucket (``engine.buckets`` order), modified in place."""
        engine, groups = self.engine, self.groups
        pieces = [pv for b, g in zip(engine.buckets, grads) for pv in _pieces(b, g)]
        if self.config.sequence_parallel:
            sp = [v for p, v in pieces if getattr(p, "sequence_parallel", False)]
            if sp and comm.group_size(groups.tp) > 1:
                flat = torch.cat(sp).to(engine.device)
                comm.all_reduce(flat, groups.tp, kind="tp", direction="bwd",
                                source="allreduce_sequence_parallel_grads")
                offset = 0
                for v in sp:
                    v.copy_(flat[offset:offset + v.numel()])
                    offset += v.numel()
        found_inf = False
        device = engine.device          # the flag and the norm live there (offloaded grads are on the host)
        if self.scaler is not None:     # local check, then MAX over tp-pp; the engine ORs over dp-cp
            flag = torch.tensor([float(self.scaler.unscale_and_check(list(grads)))], device=device)
            comm.all_reduce(flag, groups.model, op="max", kind="mp", source="unscale_and_check")
            found_inf = bool(flag.item() > 0)
        tp_rank = groups.coords["tp"]
        total = torch.zeros(1, dtype=torch.float64, device=device)
        for p, v in pieces:
            if not getattr(p, "shared", False) and (is_tensor_parallel(p) or tp_rank == 0):
                total += v.double().pow(2).sum().to(device)
        if engine.shard_optim:          # each dp-cp rank holds different elements
            comm.all_reduce(total, groups.dp_cp, kind=dp_kind(self.config), direction="bwd",
                            source="get_grad_norm_fp32")
        comm.all_reduce(total, groups.model, kind="tp-pp", direction="bwd", source="get_grad_norm_fp32")
        self.norm = float(total.sqrt())
        if not found_inf:
            clip_grads([SimpleNamespace(grad=g) for g in grads], self.norm, self.clip_grad)
        return found_inf

    def update(self, found_inf: bool) -> None:
        if self.scaler is not None:
            self.scaler.update(found_inf)


def build_engine(run, chunks: list, groups, scaler=None):
    """Wrap this rank's one model chunk with ``run``'s strategy (a
    :class:`~course_lib.training.run_config.RunConfig`); returns ``(engine, finalizer)``.
    ZeRO-3 units are the transformer layers (the chunk itself holds the embeddings, the final
    LayerNorm and the output layer, which share the tied word embedding)."""
    (chunk,) = chunks
    config, sharding, opt = run.parallel, run.sharding, run.optimizer
    finalizer = ShardedGradFinalizer(groups, config, opt.clip_grad, scaler)
    layer_types = tuple({type(layer) for layer in chunk.decoder.layers.values()})
    bucket_size = megatron_bucket_size(sharding.ddp_bucket_size, sharding.overlap_grad_reduce, config.dp * config.cp,
                                       groups.coords["pp"])
    engine = wrap(chunk, groups, strategy=sharding.strategy, bucket_size=bucket_size,
                  megatron_fsdp=sharding.use_megatron_fsdp,
                  overlap_grad_reduce=sharding.overlap_grad_reduce, overlap_param_gather=sharding.overlap_param_gather,
                  cpu_offload=sharding.optimizer_cpu_offload, grad_reduce_in_fp32=True, optimizer=opt.optimizer,
                  weight_decay=opt.weight_decay, betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps,
                  momentum=opt.sgd_momentum, loss_scaler=finalizer, fsdp_unit_modules=layer_types or None)
    finalizer.engine = engine
    return engine, finalizer


def schedule_sync(engine, config, pipeline_schedule: str, stack: contextlib.ExitStack):
    """Megatron's ``no_sync`` over the micro-batches: enters ``engine.no_sync()`` on ``stack`` and returns
    ``on_last_forward()``, to call when the last micro-batch's forward runs its loss: with pp = 1 under
    1F1B that micro-batch's backward comes next, so the sync (and ``--overlap-grad-reduce``) is let
    through for it. With pp > 1 only the last stage runs the loss, so no stage learns here when its last
    backward starts (Megatron's schedule re-enables the sync before it on every stage), and under GPipe
    every backward follows every forward: then the reduction waits for ``engine.finish_grad_sync``."""
    stack.enter_context(engine.no_sync())
    overlap_last = config.pp == 1 and pipeline_schedule == "1f1b"
    return stack.close if overlap_last else (lambda: None)


@torch.no_grad()
def allreduce_embedding_grads_after_sync(engine, chunks: list, groups) -> int:
    """pp > 1, after ``engine.finish_grad_sync()``: sum the tied word-embedding gradient over the
    embedding group, on the dp-cp-reduced gradient this rank holds (``engine.synced_main_grad``: the
    whole ``[V/t, h]`` main grad under the distributed optimizer, as Megatron's
    ``_allreduce_word_embedding_grads`` sends it; the ``1/d`` local piece under ZeRO-2/3, as it sends
    Megatron-FSDP's ``_local_tensor``). Returns the elements reduced."""
    weight = _shared_embedding_weight(chunks, groups)
    if weight is None or comm.group_size(groups.embedding) == 1:
        return 0
    view = engine.synced_main_grad(weight)
    comm.all_reduce(view, groups.embedding, kind="embedding", direction="bwd", source="allreduce_embedding_grads")
    return view.numel()


def state_bytes(engine) -> dict:
    """This rank's measured ``{"params", "grads", "optimizer", "optimizer_host"}`` bytes (the engine's), with
    the element counts they are made of: ``padding_elements`` (the buckets' padding), ``shard_elements`` and
    ``shard_param_elements`` (this rank's shards, and the parameter elements in them its optimizer steps)."""
    b = engine.bytes_per_rank()
    return {k: b[k] for k in ("params", "grads", "optimizer", "optimizer_host", "padding_elements",
                              "shard_elements", "shard_param_elements")}
