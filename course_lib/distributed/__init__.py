"""State sharding on real ranks: Megatron's DDP, distributed optimizer and Megatron-FSDP (ZeRO-1/2/3).

Named like Megatron-LM's ``megatron/core/distributed/`` (``param_and_grad_buffer.py``,
``distributed_data_parallel.py``, ``fsdp/``) and ``megatron/core/optimizer/distrib_optimizer.py``;
the behaviour follows those files, the code is the course's own. Works on any ``torch.nn.Module``
(the course GPT, a tensor-parallel MLP, a small MLP in a test) with an explicit data-parallel
process group (Megatron's ``dp x cp`` group, :attr:`course_lib.process_groups.ProcessGroups.dp_cp`);
gloo on CPU, and the same code on NCCL/CUDA (tensors stay on the params' device; offload uses
pinned host memory when CUDA is present).

API (what Lab 07 calls)
-----------------------
::

    from course_lib.distributed import wrap

    ddp = wrap(model, dp_group,                       # a ProcessGroups works too (its .dp_cp is used)
               strategy="optim",                      # Megatron-FSDP's --data-parallel-sharding-strategy:
                                                      #   "no_shard" (DDP), "optim" (ZeRO-1, Megatron's
                                                      #   --use-distributed-optimizer),
                                                      #   "optim_grads" (ZeRO-2), "optim_grads_params" (ZeRO-3)
               bucket_size=40_000,                    # --ddp-bucket-size, elements per bucket (None: one bucket;
                                                      #   the trainer resolves Megatron's default:
                                                      #   buffer.megatron_bucket_size)
               overlap_grad_reduce=True,              # --overlap-grad-reduce: a bucket's collective starts in backward
               overlap_param_gather=True,             # --overlap-param-gather: the next step's all-gather,
                                                      #   waited for in forward
               cpu_offload=False,                     # --optimizer-cpu-offload: Adam state + update on the host
               grad_reduce_in_fp32=True,              # --accumulate-allreduce-grads-in-fp32 (16-bit params only)
               optimizer="adam", weight_decay=0.01,   # course_lib.optimizer.Optimizer's elementwise AdamW/SGD
               loss_scaler=None,                      # optional, see "Loss scaler protocol" below
               megatron_fsdp=False)                   # optim: Megatron-FSDP's bucket padding, not the
                                                      #   distributed optimizer's (buffer.layout_rules)

    for it in range(steps):
        ddp.zero_grad()
        loss = loss_fn(ddp(x_my_slice), y_my_slice)   # ddp(...) == model(...); the local mean loss
        loss.backward()                                # (x loss_scaler.scale when a scaler is given: ddp.scale_loss)
        result = ddp.step(lr, clip_grad=0.0,           # finish grad sync, shard update, param all-gather
                          grad_norm=True)              # -> {"skipped", "found_inf", "grad_norm"}; the norm
                                                       #   only when clipping or grad_norm=True asks for it
    with ddp.no_sync(): ...                            # micro-batches before the last: no collective
    ddp.main_grad(param)   # Megatron's param.main_grad: after backward and before the reduction, this
                           #   rank's local grad (every strategy); after it, the reduced one (no_shard / optim)
    ddp.finish_grad_sync()          # the reduction alone (step() runs it if not done yet)
    ddp.synced_main_grad(param)     # then: the part of the reduced grad this rank holds (ZeRO-2/3: its 1/d
                                    #   piece) -- e.g. the tied-embedding sum over the first and last stage
    ddp.bytes_per_rank()   # {"params", "grads", "optimizer", ...} bytes measured from the tensors held
    ddp.timeline           # [{"rank", "name", "kind", "start", "end"}] seconds since the step's start
    ddp.comm               # a course_lib.comm.CommRecorder holding every collective this wrapper issued
    overlap_seconds(ddp.timeline)           # seconds a collective ran under compute (0 without overlap)
    plot_timeline([tl_rank0, tl_rank1, ...])  # compute and comm lanes per rank (timelines returned by ranks)
    ddp.full_parameters()  # {name: full tensor} (ZeRO-3: gathered for inspection, tag "inspect")
    ddp.full_optimizer_state()              # {state name: {name: full tensor}} (DP shards summed): a checkpoint's
    ddp.load_full_state(params, state)      # both back into the buffers, main params and this rank's optimizer pieces

``use_distributed_optimizer=True`` is ``strategy="optim"``. Under ZeRO-3 (``optim_grads_params``)
the buckets are the FSDP units -- by default every module that owns parameters directly, or the
instances of ``fsdp_unit_modules=(SomeLayerClass,)`` with the rest in a root unit (Megatron-FSDP's
``fsdp_unit_modules``) -- so ``bucket_size`` is not used, and the next unit is always prefetched
(forward: the next one, backward: the previous one, unless its backward for this micro-batch is
already over: on a pipeline's last stage the root unit runs first in backward). Releasing a unit
frees its gathered storage (``resize_(0)``, as FSDP2 does; autograd's saved weight views point into
it and read it again once the unit is re-gathered for backward), and ``step`` leaves no unit
gathered (a gathered copy is stale once the shard is updated). A weight shared by two units (tied embeddings)
must sit in a unit that spans both uses: for the course GPT, ``fsdp_unit_modules=(type of its
layer,)`` keeps the embedding in the root unit, live for the whole forward and backward.

Gradient averaging follows Megatron: each rank's local mean loss, grads scaled by 1/d and summed over
the d ranks of the group (= the gradient of the global batch's mean loss, what one process computes).

Loss scaler protocol (``course_lib.mixed_precision`` implements it; any object with these works)
----------------------------------------------------------------------------------------------
* ``scale`` -- float or ``[1]`` fp32 tensor, the factor the loss is multiplied by before ``backward``
  (:meth:`ShardedDataParallel.scale_loss`);
* ``unscale_and_check(grads) -> found_inf`` -- ``grads``: list of this rank's fp32 main-grad
  tensors (its shard); divides them by ``scale`` in place, returns True if any is inf/NaN;
* ``update(found_inf)`` -- grows/backs off the scale (Megatron's ``DynamicGradScaler``).
``found_inf`` is OR-ed over the data-parallel group when the optimizer is sharded (each rank sees only its
shard) and over the model-parallel group when ``wrap`` was given a ProcessGroups, before ``update`` --
Megatron's grad-stats group: with the distributed optimizer every rank of its instance
(``distrib_optimizer.py``'s ``get_grad_stats_parallel_group``), else the model-parallel ranks; a step
with ``found_inf`` is skipped (params untouched), as Megatron counts "skipped iterations".

What to compare the measurements with (``course_lib.sizing``)
-------------------------------------------------------------
* ``bytes_per_rank()`` (on the padded buffers: ``padding_elements``, and per rank ``shard_elements`` /
  ``shard_param_elements``; a model whose layout needs no padding matches exactly) --
  ``sizing.memory.model_state_bytes(P, d, stage, k, param_bytes, grad_bytes)``
  (ZeRO's ``(2 + 2 + K) P`` by stage; fp32: ``4, 4, k=8``; bf16 with fp32 grads: ``2, 4, k=12``),
  ``sizing.memory.megatron_optimizer_bytes_per_param(d, distributed, params_dtype, grad_dtype)``
  (Megatron's table: 16 / 8 + 8/d, 18 / 6 + 12/d, 20 / 4 + 16/d), and with ``cpu_offload``
  ``sizing.memory.optimizer_offload_bytes_per_param`` (host bytes, bytes moved each way);
* ``comm`` -- ``sizing.comm.dp_comm_per_iteration(P', d, zero_stage=...)["total"]`` equals
  ``ddp.comm.ring_elements_sent()`` of one step, ``P'`` the padded buffer (``P + padding_elements``;
  ZeRO-3: 1.5x the all-reduce).
Each equality is asserted on 4 real ranks in tests/distributed/test_distributed_optimizer.py and
tests/distributed/test_megatron_fsdp.py.
"""

from course_lib.distributed.engine import STRATEGIES, ShardedDataParallel, wrap  # noqa: F401
from course_lib.distributed.timeline import overlap_seconds, plot_timeline  # noqa: F401

__all__ = ["wrap", "ShardedDataParallel", "STRATEGIES", "overlap_seconds", "plot_timeline"]
