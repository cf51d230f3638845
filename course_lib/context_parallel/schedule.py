"""The ring as data: at each step, which K/V chunk a rank holds and which attention blocks it computes.

Ring attention (Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise
Transformers for Near-Infinite Context", https://arxiv.org/abs/2310.01889;
Megatron-LM's context parallelism = Transformer Engine's
``AttnFuncWithCPAndKVP2P``) runs ``cp`` steps on a ring of ``cp`` ranks:

* **forward**: at step ``i`` rank ``r`` holds the K/V of rank ``(r − i) mod cp``;
  after computing with it, it passes it on to rank ``r+1`` and receives the next
  one from rank ``r−1``. ``cp − 1`` transfers bring every K/V past every rank.
  After the last step rank r holds the K/V of rank ``r+1``; it keeps that one
  for the backward pass.
* **backward** (the reverse ring): at step ``i`` rank ``r`` holds the K/V of rank
  ``(r + 1 + i) mod cp`` -- it starts with the one it kept and ends with its own
  -- passing K/V *and the dK/dV accumulated so far* to rank ``r−1``. After
  ``cp − 1`` steps each dK/dV accumulator arrives home complete.

The blocks a step computes come from the chunk ids (see :mod:`.zigzag`): query
chunk ``a`` against key chunk ``b`` is ``"full"`` when ``b < a`` (or no causal
mask), ``"causal"`` (the diagonal, lower triangle kept) when ``b == a`` and
skipped when ``b > a``. With the zigzag split every rank computes, at every
step after the first, exactly two full chunk blocks -- the load balance that
Megatron's split buys (Transformer Engine's three cases: step 0 the diagonal;
K/V from a lower rank: all queries × the K/V's first chunk; from a higher rank:
the queries' second chunk × all K/V).
"""

from __future__ import annotations

from dataclasses import dataclass

from course_lib.context_parallel.zigzag import _check_cp, _check_layout, _check_rank, rank_chunk_ids
from course_lib.rules import UsageError

__all__ = ["FULL", "CAUSAL", "Block", "block_kind", "kv_source_rank", "step_blocks", "ring_schedule"]

FULL, CAUSAL, SKIP = "full", "causal", "skip"
DIRECTIONS = ("fwd", "bwd")


@dataclass(frozen=True)
class Block:
    """One block of the attention matrix a rank computes at one step.

    ``q_index``/``kv_index``: which of the rank's local chunks (0 or 1) -- the
    slice ``[q_index*c:(q_index+1)*c]`` of the local tensor; ``q_chunk``/``kv_chunk``:
    the global chunk ids; ``kind``: ``"full"`` or ``"causal"`` (diagonal)."""

    q_index: int
    kv_index: int
    q_chunk: int
    kv_chunk: int
    kind: str


def block_kind(q_chunk: int, kv_chunk: int, causal: bool) -> str:
    """``"full"``, ``"causal"`` (diagonal chunk: keep key ≤ query) or ``"skip"`` (above the diagonal)."""
    if not causal or kv_chunk < q_chunk:
        return FULL
    return CAUSAL if kv_chunk == q_chunk else SKIP


def _check_direction(direction: str) -> str:
    if direction not in DIRECTIONS:
        raise UsageError(f"direction={direction!r} must be 'fwd' or 'bwd'")
    return direction


def kv_source_rank(cp_rank: int, step: int, cp_size: int, direction: str = "fwd") -> int:
    """Whose K/V chunk ``cp_rank`` holds at ``step``: ``(r − i) mod cp`` forward, ``(r + 1 + i) mod cp`` backward."""
    cp_size = _check_cp(cp_size)
    cp_rank = _check_rank(cp_rank, cp_size)
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < cp_size:
        raise UsageError(f"step={step!r} must be an integer in 0..{cp_size - 1} (a ring of {cp_size} ranks "
                         f"has {cp_size} steps)")
    if _check_direction(direction) == "fwd":
        return (cp_rank - step) % cp_size
    return (cp_rank + 1 + step) % cp_size


def step_blocks(cp_rank: int, step: int, cp_size: int, layout: str = "zigzag", causal: bool = True,
                direction: str = "fwd") -> list[Block]:
    """The non-skipped blocks ``cp_rank`` computes at ``step`` (query chunks × the K/V chunks it holds)."""
    src = kv_source_rank(cp_rank, step, cp_size, direction)
    q_ids = rank_chunk_ids(cp_rank, cp_size, layout)
    kv_ids = rank_chunk_ids(src, cp_size, layout)
    out = []
    for qi, qc in enumerate(q_ids):
        for ki, kc in enumerate(kv_ids):
            kind = block_kind(qc, kc, causal)
            if kind != SKIP:
                out.append(Block(qi, ki, qc, kc, kind))
    return out


def ring_schedule(cp_size: int, layout: str = "zigzag", causal: bool = True,
                  direction: str = "fwd") -> list[list[dict]]:
    """The whole ring: ``schedule[step][rank]`` = ``{"kv_rank", "kv_chunks", "q_chunks", "blocks", "sends_to"}``.

    ``sends_to`` is the rank this rank passes its K/V to after the step (None on the
    last step: ``cp − 1`` transfers per pass)."""
    cp_size = _check_cp(cp_size)
    _check_layout(layout)
    _check_direction(direction)
    steps = []
    for i in range(cp_size):
        row = []
        for r in range(cp_size):
            src = kv_source_rank(r, i, cp_size, direction)
            nxt = (r + 1) % cp_size if direction == "fwd" else (r - 1) % cp_size
            row.append(dict(kv_rank=src, kv_chunks=rank_chunk_ids(src, cp_size, layout),
                            q_chunks=rank_chunk_ids(r, cp_size, layout),
                            blocks=step_blocks(r, i, cp_size, layout, causal, direction),
                            sends_to=nxt if i < cp_size - 1 else None))
        steps.append(row)
    return steps
