"""All-to-all context parallelism (DeepSpeed-Ulysses; Megatron's ``--cp-comm-type a2a``), for comparison.

The ring keeps the heads and moves K/V; the all-to-all instead *re-shards*:
before attention one all-to-all turns "all heads, my tokens" into "my heads,
all tokens", each rank runs ordinary attention for ``np/cp`` heads over the
whole sequence, and a second all-to-all turns the output back. So the heads --
and the K/V heads (query groups) -- must divide by ``cp``: the rule the ring
does not have. Reference: Jacobs et al. 2023, "DeepSpeed Ulysses: System
Optimizations for Enabling Training of Extreme Long Sequence Transformer
Models" (https://arxiv.org/abs/2309.14509); Transformer Engine's
``AttnFuncWithCPAndQKVOA2A`` (Megatron-LM ``cp_comm_type="a2a"``).

Layout as in :mod:`.ring`: ``q`` ``[b, np, s_local, hn]``, ``k``/``v``
``[b, ng, s_local, hn]``; the local tokens follow ``layout`` (zigzag or
contiguous) and the causal mask is built from the true global positions.

Communication per call, recorded by :mod:`course_lib.comm` (kind ``"cp"``):
forward 4 all-to-alls (q, k, v, then the output), backward 4 (d_out, then dq,
dk, dv), each of the local tensor: a rank sends ``(cp−1)/cp`` of it.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from course_lib import comm, rules
from course_lib.context_parallel.ring import _validate
from course_lib.context_parallel.zigzag import token_positions

__all__ = ["ulysses_attention", "seq_to_head_all_to_all", "head_to_seq_all_to_all"]


def _seq_to_head(x: torch.Tensor, group, cp: int, source: str) -> torch.Tensor:
    """[b, h, s_l, d] (all heads, my tokens) -> [b, h/cp, cp*s_l, d] (my heads, every rank's tokens in rank order)."""
    b, h, s_l, d = x.shape
    send = x.reshape(b, cp, h // cp, s_l, d).permute(1, 0, 2, 3, 4).contiguous()   # [cp(dst), b, h/cp, s_l, d]
    recv = comm.all_to_all(send, group, kind="cp", source=source)                 # [cp(src), b, h/cp, s_l, d]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s_l, d)


def _head_to_seq(y: torch.Tensor, group, cp: int, source: str) -> torch.Tensor:
    """Inverse of :func:`_seq_to_head`: [b, h/cp, cp*s_l, d] -> [b, h, s_l, d]."""
    b, hl, s, d = y.shape
    send = y.reshape(b, hl, cp, s // cp, d).permute(2, 0, 1, 3, 4).contiguous()  # [cp(dst), b, h/cp, s_l, d]
    recv = comm.all_to_all(send, group, kind="cp", source=source)                # [cp(head group), b, h/cp, s_l, d]
    return recv.permute(1, 0, 2, 3, 4).reshape(b, cp * hl, s // cp, d)


class _SeqToHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, cp):
        ctx.group, ctx.cp = group, cp
        return _seq_to_head(x, group, cp, "seq_to_head_all_to_all")

    @staticmethod
    def backward(ctx, dy):   # an all-to-all is a permutation: its transpose is the inverse all-to-all
        return _head_to_seq(dy, ctx.group, ctx.cp, "seq_to_head_all_to_all"), None, None


class _HeadToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, group, cp):
        ctx.group, ctx.cp = group, cp
        return _head_to_seq(y, group, cp, "head_to_seq_all_to_all")

    @staticmethod
    def backward(ctx, dx):
        return _seq_to_head(dx, ctx.group, ctx.cp, "head_to_seq_all_to_all"), None, None


def seq_to_head_all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable ``[b, h, s_local, d] -> [b, h/cp, s, d]`` (tokens in rank order; no-op for cp=1)."""
    cp = comm.group_size(group)
    return x if cp == 1 else _SeqToHead.apply(x, group, cp)


def head_to_seq_all_to_all(y: torch.Tensor, group) -> torch.Tensor:
    """Differentiable ``[b, h/cp, s, d] -> [b, h, s_local, d]`` (no-op for cp=1)."""
    cp = comm.group_size(group)
    return y if cp == 1 else _HeadToSeq.apply(y, group, cp)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group, *, causal: bool = False,
                      layout: str = "zigzag", softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Attention of this rank's tokens over the whole CP group by two all-to-alls (heads split over CP).

    Same contract as :func:`~course_lib.context_parallel.ring.ring_attention`, plus
    ``np % cp == 0`` and ``ng % cp == 0``. Returns ``[b, np, s_local, hv]``."""
    _validate(q, k, v, cp_group, causal, layout, softmax_scale)
    cp = dist.get_world_size(cp_group)
    np_, ng = q.shape[1], k.shape[1]
    rules.heads_divisible_by_cp(np_, ng, cp)
    s_local = q.shape[2]
    qh, kh, vh = (seq_to_head_all_to_all(t, cp_group) for t in (q, k, v))      # [b, heads/cp, s, d]
    rep = rules.heads_divisible_by_groups(np_, ng)
    kh, vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale                      # [b, np/cp, s, s]
    if causal:
        # tokens arrive in rank order (each rank's chunks); mask by their true global positions
        pos = torch.tensor([p for rr in range(cp) for p in token_positions(rr, cp, s_local * cp, layout)],
                           device=q.device)
        scores = scores.masked_fill(pos[None, :] > pos[:, None], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), vh)                       # [b, np/cp, s, hv]
    return head_to_seq_all_to_all(out, cp_group)                                # [b, np, s_local, hv]
