"""Which tokens each context-parallel rank holds: the zigzag (load-balanced) and contiguous splits.

Context parallelism (CP) cuts every sequence into pieces along the sequence
dimension; each rank of the CP group keeps the queries, keys and values of its
own tokens. Two ways to cut, for ``cp`` ranks and a sequence of ``s`` tokens:

* ``"contiguous"``: ``cp`` chunks of ``s/cp`` tokens, rank r takes chunk r.
  With a causal mask the last rank's queries see the whole prefix while rank
  0's see almost nothing: the work is unbalanced (see :mod:`.work`).
* ``"zigzag"`` (load-balanced): ``2·cp`` chunks of ``s/(2·cp)`` tokens, rank r
  takes chunks ``r`` and ``2·cp−1−r`` -- one early, one late -- so every rank
  gets the same number of unmasked causal scores. This is Megatron-LM's split:
  ``get_batch_on_this_cp_rank`` in ``megatron/core/utils.py`` ("chunk_0 and
  chunk_3 are assigned to GPU0, chunk_1 and chunk_2 are assigned to GPU1" for
  cp=2) and Transformer Engine's ring attention expects it.

Example, s = 16, cp = 4 (zigzag, chunks of 2 tokens)::

    chunk:  0   1   2   3   4   5   6   7
    rank:   0   1   2   3   3   2   1   0

A rank's local tensor is its chunks concatenated in ascending order along the
sequence dimension: ``[.., 2·c, ..]`` = ``[chunk r ; chunk 2cp−1−r]``.
"""

from __future__ import annotations

from typing import Sequence

import torch

from course_lib import rules

__all__ = [
    "LAYOUTS", "chunks_for_rank", "rank_chunk_ids", "num_chunks", "check_sequence_split",
    "token_positions", "shard_sequence", "unshard_sequence", "get_batch_on_this_cp_rank",
]

LAYOUTS = ("zigzag", "contiguous")


def _check_cp(cp_size) -> int:
    return rules.integer(rules.CP, cp_size)


def _check_rank(cp_rank, cp_size: int) -> int:
    return rules.rank_in("cp_rank", cp_rank, cp_size, rules.CP)


def _check_layout(layout) -> str:
    if layout not in LAYOUTS:
        raise rules.UsageError(f"layout={layout!r} is unknown: use 'zigzag' (load-balanced, Megatron's) "
                               f"or 'contiguous'")
    return layout


def chunks_for_rank(rank: int, cp: int) -> tuple[int, int]:
    """The two chunk ids rank ``rank`` holds in the zigzag split of ``2·cp`` chunks: ``(rank, 2·cp−1−rank)``.

    >>> chunks_for_rank(0, 2), chunks_for_rank(1, 2)
    ((0, 3), (1, 2))
    """
    cp = _check_cp(cp)
    rank = _check_rank(rank, cp)
    return rank, 2 * cp - 1 - rank


def num_chunks(cp_size: int, layout: str = "zigzag") -> int:
    """How many equal chunks the sequence is cut into: ``2·cp`` (zigzag) or ``cp`` (contiguous)."""
    return (2 if _check_layout(layout) == "zigzag" else 1) * _check_cp(cp_size)


def rank_chunk_ids(cp_rank: int, cp_size: int, layout: str = "zigzag") -> tuple[int, ...]:
    """Chunk ids held by ``cp_rank``, in the order they sit in its local tensor (ascending).

    zigzag: ``(r, 2cp−1−r)``; contiguous: ``(r,)``."""
    cp_size = _check_cp(cp_size)
    cp_rank = _check_rank(cp_rank, cp_size)
    if _check_layout(layout) == "zigzag":
        return chunks_for_rank(cp_rank, cp_size)
    return (cp_rank,)


def check_sequence_split(seq_length: int, cp_size: int, layout: str = "zigzag") -> int:
    """Validate that ``seq_length`` tokens split over ``cp_size`` ranks; return the chunk length.

    zigzag needs ``seq_length % (2·cp) == 0`` (Megatron: "sequence length must be
    divisible by 2 * context_parallel_size"); contiguous needs ``% cp == 0``."""
    return rules.sequence_split(seq_length, _check_cp(cp_size), _check_layout(layout))


def token_positions(cp_rank: int, cp_size: int, seq_length: int, layout: str = "zigzag") -> list[int]:
    """Global token positions held by ``cp_rank``, in local order.

    >>> token_positions(0, 2, 8)
    [0, 1, 6, 7]
    """
    c = check_sequence_split(seq_length, cp_size, layout)
    return [k * c + i for k in rank_chunk_ids(cp_rank, cp_size, layout) for i in range(c)]


def shard_sequence(x: torch.Tensor, cp_rank: int, cp_size: int, *, seq_dim: int = 2,
                   layout: str = "zigzag") -> torch.Tensor:
    """This rank's tokens of a full-sequence tensor (no communication; every rank holds ``x``).

    ``x``: ``[.., s, ..]`` with the sequence at ``seq_dim`` (2 for attention's
    ``[b, heads, s, d]``, 1 for ``[b, s]`` token ids) -> ``[.., s/cp, ..]``:
    the rank's chunks concatenated in ascending order."""
    if not isinstance(x, torch.Tensor):
        raise rules.UsageError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if not -x.dim() <= seq_dim < x.dim():
        raise rules.UsageError(f"seq_dim={seq_dim} is out of range for a tensor of shape {tuple(x.shape)}")
    seq_dim %= x.dim()
    c = check_sequence_split(int(x.shape[seq_dim]), cp_size, layout)
    parts = [x.narrow(seq_dim, k * c, c) for k in rank_chunk_ids(cp_rank, cp_size, layout)]
    return torch.cat(parts, dim=seq_dim) if len(parts) > 1 else parts[0].clone()


def unshard_sequence(shards: Sequence[torch.Tensor], *, seq_dim: int = 2, layout: str = "zigzag") -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the full sequence from every rank's shard (rank order).

    ``shards``: cp tensors ``[.., s/cp, ..]`` -> ``[.., s, ..]``."""
    cp_size = len(shards)
    if cp_size == 0:
        raise rules.UsageError("shards is empty: pass one tensor per context-parallel rank, in rank order")
    seq_dim %= shards[0].dim()
    per_rank = len(rank_chunk_ids(0, cp_size, layout))
    local = int(shards[0].shape[seq_dim])
    if any(tuple(t.shape) != tuple(shards[0].shape) for t in shards):
        raise rules.UsageError(f"shards have different shapes {[tuple(t.shape) for t in shards]}: every rank "
                               f"holds the same number of tokens")
    if local % per_rank:
        raise rules.UsageError(f"a {layout} shard holds {per_rank} chunks, but its sequence length {local} is "
                               f"not divisible by {per_rank}")
    c = local // per_rank
    chunks: dict[int, torch.Tensor] = {}
    for r, t in enumerate(shards):
        for j, k in enumerate(rank_chunk_ids(r, cp_size, layout)):
            chunks[k] = t.narrow(seq_dim, j * c, c)
    return torch.cat([chunks[k] for k in range(num_chunks(cp_size, layout))], dim=seq_dim)


def get_batch_on_this_cp_rank(batch: dict, cp_rank: int, cp_size: int) -> dict:
    """Megatron's ``get_batch_on_this_cp_rank`` (``megatron/training/utils.py``, ``megatron/core/utils.py``)
    with the CP rank and size passed in: a new dict whose tensors hold this rank's two zigzag chunks.

    Every tensor is cut along dim 1 (``tokens``, ``labels``, ``loss_mask``, ``position_ids``:
    ``[b, s]``) except ``attention_mask`` (``[b, 1, s, s]``), which is cut along dim 2 -- its query
    rows; every key column stays, as in Megatron. ``None`` values pass through; the input is not
    modified; ``cp_size == 1`` returns the same tensors."""
    cp_size = _check_cp(cp_size)
    cp_rank = _check_rank(cp_rank, cp_size)
    if cp_size == 1:
        return dict(batch)
    return {key: value if value is None else
            shard_sequence(value, cp_rank, cp_size, seq_dim=2 if key == "attention_mask" else 1)
            for key, value in batch.items()}
