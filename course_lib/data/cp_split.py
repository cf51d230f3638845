"""Cut a batch along the sequence for context parallelism, load-balanced like Megatron-LM.

With causal attention, the last tokens attend to everything before them and the
first tokens to almost nothing, so giving CP rank ``r`` the ``r``-th contiguous
``1/cp`` of the sequence would give the last rank most of the work. Megatron's
``get_batch_on_this_cp_rank`` (``megatron/core/utils.py``) instead cuts the
sequence into ``2 * cp`` equal chunks and gives rank ``r`` chunks ``r`` and
``2*cp - 1 - r`` -- one early, one late -- so every rank does the same causal work:

    cp=2, s=8:   chunks [0 1][2 3][4 5][6 7]
                 rank 0 -> chunks 0, 3 -> positions 0 1 6 7
                 rank 1 -> chunks 1, 2 -> positions 2 3 4 5

Here the CP rank and size are arguments (no global state), and the input dict is
not modified. The split itself and ``get_batch_on_this_cp_rank`` (every tensor cut
along dim 1, ``[b, s, ...]``, except ``attention_mask``, ``[b, 1, s, s]``, cut along
dim 2 -- the query rows -- as in Megatron) are :mod:`course_lib.context_parallel.zigzag`'s;
this module re-exports the latter and adds per-tensor helpers. Keep ``position_ids``
with the tokens: the positions a rank holds are not contiguous, and learned position
embeddings must use the true ones.
"""

from __future__ import annotations

import torch

from course_lib import rules
from course_lib.context_parallel.zigzag import (chunks_for_rank, get_batch_on_this_cp_rank, shard_sequence,
                                                token_positions, unshard_sequence)

__all__ = ["cp_chunk_ids", "cp_token_positions", "split_for_cp_rank", "get_batch_on_this_cp_rank",
           "gather_from_cp_ranks"]


def _check(cp_rank: int, cp_size: int, seq_length: int | None = None) -> None:
    rules.rank_in("cp_rank", cp_rank, rules.integer(rules.CP, cp_size), rules.CP)
    if seq_length is not None:
        rules.sequence_split(seq_length, cp_size)


def cp_chunk_ids(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """The two chunks (of ``2*cp_size``) held by ``cp_rank``: ``(r, 2*cp - 1 - r)``."""
    _check(cp_rank, cp_size)
    return chunks_for_rank(cp_rank, cp_size)


def cp_token_positions(seq_length: int, cp_rank: int, cp_size: int) -> torch.Tensor:
    """Sequence positions held by ``cp_rank``, in the order they appear on the rank: int64 ``[s / cp]``."""
    _check(cp_rank, cp_size, seq_length)
    if cp_size == 1:
        return torch.arange(seq_length)
    return torch.tensor(token_positions(cp_rank, cp_size, seq_length))


def split_for_cp_rank(t: torch.Tensor, cp_rank: int, cp_size: int, seq_dim: int = 1) -> torch.Tensor:
    """The part of ``t`` that ``cp_rank`` holds: ``t`` with dim ``seq_dim`` cut from ``s`` to ``s / cp``."""
    if cp_size == 1:
        _check(cp_rank, cp_size)
        return t
    _check(cp_rank, cp_size, t.shape[seq_dim])
    return shard_sequence(t, cp_rank, cp_size, seq_dim=seq_dim)


def gather_from_cp_ranks(parts: list[torch.Tensor], seq_dim: int = 1) -> torch.Tensor:
    """Inverse of ``split_for_cp_rank``: ``parts[r]`` is rank ``r``'s part; returns the full sequence."""
    cp_size = len(parts)
    if cp_size == 0:
        raise rules.UsageError("gather_from_cp_ranks needs at least one part")
    if cp_size == 1:
        return parts[0]
    local = parts[0].shape[seq_dim]
    if local % 2 or any(p.shape[seq_dim] != local for p in parts):
        raise rules.UsageError(f"every part must hold the same even number of positions along dim {seq_dim}, got "
                               f"{[p.shape[seq_dim] for p in parts]}")
    return unshard_sequence(parts, seq_dim=seq_dim)
