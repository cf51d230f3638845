"""State sharding on real ranks: Megatron's DDP, distributed optimizer and Megatron-FSDP (ZeRO-1/2/3).

For: wrapping any ``torch.nn.Module`` with an explicit data-parallel group (Megatron's ``dp x cp``
group) so that its grads are reduced, its optimizer state (and grads, params) sharded, as Megatron does.
Main names: :func:`wrap` (``strategy`` ``no_shard`` / ``optim`` / ``optim_grads`` / ``optim_grads_params``,
Megatron-FSDP's ``--data-parallel-sharding-strategy``), its ``ShardedDataParallel`` (``step``, ``no_sync``,
``main_grad``, ``bytes_per_rank``, ``full_optimizer_state`` / ``load_full_state``), ``overlap_seconds``,
``plot_timeline``.
Follows: ``megatron/core/distributed/`` (``param_and_grad_buffer.py``, ``distributed_data_parallel.py``,
``fsdp/``), ``megatron/core/optimizer/distrib_optimizer.py``; ZeRO (Rajbhandari et al. 2020, Sec. 5).
Manual (the API walk-through, the loss scaler protocol, what to compare with): docs/internals/distributed.md.
"""

from course_lib.distributed.engine import STRATEGIES, ShardedDataParallel, wrap  # noqa: F401
from course_lib.distributed.timeline import overlap_seconds, plot_timeline  # noqa: F401

__all__ = ["wrap", "ShardedDataParallel", "STRATEGIES", "overlap_seconds", "plot_timeline"]
