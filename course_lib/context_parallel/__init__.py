"""Context parallelism (CP): split the sequence over a process group, attention by ring exchange.

Modules, one idea each:

* :mod:`.zigzag` -- which tokens a rank holds: Megatron's load-balanced split
  (2·cp chunks, rank r takes r and 2cp−1−r) or the contiguous one.
* :mod:`.schedule` -- the ring as data: whose K/V a rank holds at each step
  (forward and reverse ring) and which attention blocks it computes.
* :mod:`.ring` -- the log-sum-exp merge, the block forward/backward, and
  ``ring_attention`` (a custom autograd function; K/V by send/recv over the CP group).
* :mod:`.attention` -- the transformer layer under CP: the tensor-parallel attention
  whose ``core_attention`` is the ring (``ContextParallelSelfAttention``, ``build_layer``).
* :mod:`.ulysses` -- the all-to-all alternative (Megatron's ``--cp-comm-type a2a``),
  which needs heads % cp == 0.
* :mod:`.work` -- per-rank attention work, balanced vs contiguous, and its bar chart.
* :mod:`.plots` -- the ring step by step.

Tensor layout everywhere: ``[b, heads, s_local, head_dim]``.
"""

from course_lib.context_parallel.attention import ContextParallelSelfAttention, build_layer
from course_lib.context_parallel.plots import plot_ring_steps
from course_lib.context_parallel.ring import (attention_block, attention_block_backward, kv_bytes_per_step,
                                              merge_partials, reference_attention, ring_attention,
                                              ring_sends_per_layer)
from course_lib.context_parallel.schedule import Block, kv_source_rank, ring_schedule, step_blocks
from course_lib.context_parallel.ulysses import ulysses_attention
from course_lib.context_parallel.work import (critical_path, imbalance, plot_attention_work, ring_step_work,
                                              score_elements, score_elements_closed_form)
from course_lib.context_parallel.zigzag import (LAYOUTS, check_sequence_split, chunks_for_rank,
                                                get_batch_on_this_cp_rank, rank_chunk_ids, shard_sequence,
                                                token_positions, unshard_sequence)

__all__ = [
    "LAYOUTS", "chunks_for_rank", "rank_chunk_ids", "check_sequence_split", "token_positions", "shard_sequence",
    "unshard_sequence", "get_batch_on_this_cp_rank",
    "Block", "kv_source_rank", "step_blocks", "ring_schedule",
    "attention_block", "merge_partials", "attention_block_backward", "reference_attention", "ring_attention",
    "kv_bytes_per_step", "ring_sends_per_layer", "ulysses_attention", "ContextParallelSelfAttention", "build_layer",
    "score_elements", "score_elements_closed_form", "ring_step_work", "critical_path", "imbalance",
    "plot_attention_work", "plot_ring_steps",
]

