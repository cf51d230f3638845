"""Mixture of Experts and expert parallelism (Megatron's fifth axis).

* :mod:`course_lib.moe.router` -- softmax top-k routing, Switch load-balancing loss, z-loss (torch).
* :mod:`course_lib.moe.mappings` -- the dispatchers' autograd-aware collectives: the uneven
  all-to-all, the uneven all-gather / reduce-scatter over expert TP (torch).
* :mod:`course_lib.moe.layer` -- the MoE layer: all-to-all dispatch over the EP group, local experts,
  combine; ``reduce_moe_grads`` (experts over expert DP, the rest over DP) (torch).
* :mod:`course_lib.moe.transformer` -- MoE layers in the course GPT (``--moe-layer-freq``): the
  alltoall and allgather dispatchers, expert TP, sequence parallelism, the aux-loss log (torch).
* :mod:`course_lib.moe.pattern` -- which layers are MoE (``--moe-layer-freq``), pure Python.
* :mod:`course_lib.moe.plots` -- the two grids on one rank map, tokens per expert, the timeline.

The expert grid itself is the topology's: :class:`course_lib.topology.RankGrid` with ``ep`` /
``expert_tp`` (dense and expert sizes together); its process groups come from
:func:`course_lib.process_groups.new_moe_process_groups`. Nothing is imported here (no torch):
``from course_lib.moe.layer import MoELayer``.
"""
