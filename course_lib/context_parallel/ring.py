"""Ring attention over a context-parallel process group, forward and backward.

Each rank of the CP group holds the queries, keys and values of its own tokens
(see :mod:`.zigzag` for which tokens). Attention needs every query to meet every
key, so the K/V chunks travel around the ring by point-to-point send/recv while
each rank keeps its queries; the partial results of the ``cp`` steps are merged
with the log-sum-exp rule (online softmax) -- never appended: a query's output is
one softmax over *all* keys, so partial outputs are rescaled and summed.

References
----------
* Liu, Zaharia & Abbeel 2023, "Ring Attention with Blockwise Transformers for
  Near-Infinite Context" (https://arxiv.org/abs/2310.01889): K/V blocks rotate
  around a ring of hosts, overlapping the transfer with the blockwise compute.
* Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"
  (https://arxiv.org/abs/1805.02867) and Dao et al. 2022, FlashAttention
  (https://arxiv.org/abs/2205.14135): the log-sum-exp merge and the backward
  from the saved log-sum-exp (``P = exp(S − lse)``, ``D = rowsum(dO ∘ O)``).
* Megatron-LM context parallelism (``docs/user-guide/features/context_parallel.md``),
  implemented in Transformer Engine's ``AttnFuncWithCPAndKVP2P``
  (``transformer_engine/pytorch/attention/dot_product_attention/context_parallel.py``):
  the zigzag split for causal load balance; the forward keeps only the *last*
  K/V it received; the backward runs the ring in reverse, the dK/dV accumulators
  travelling with the K/V blocks.

Tensor layout
-------------
``q``: ``[b, np, s_local, hn]``, ``k``: ``[b, ng, s_local, hn]``,
``v``: ``[b, ng, s_local, hv]``, output ``[b, np, s_local, hv]`` -- batch,
attention heads (``np``) or query groups (``ng``, GQA: ``np % ng == 0``), the
rank's local tokens, head dim. This is ``torch.nn.functional.scaled_dot_product_attention``'s
layout; Megatron's attention receives ``[s, b, np, hn]`` ("sbhd"): permute with
``x.permute(1, 2, 0, 3)``. ``s_local = s / cp``; the local tokens are the rank's
chunks in ascending order (zigzag: ``[chunk r ; chunk 2cp−1−r]``).

Communication per call (one attention layer), ``cp`` ranks, recorded by
:mod:`course_lib.comm` with kind ``"cp"`` (a send and the matching recv each):

* forward: ``cp − 1`` ring steps, each sending K and V (``b·ng·s_local·(hn+hv)``
  elements): ``2(cp − 1)`` sends.
* backward: ``cp − 1`` steps sending K and V again (they were not kept) plus
  ``cp − 1`` steps sending the dK and dV accumulators: ``4(cp − 1)`` sends.

A group of one sends nothing and is plain attention.

Precision: partial outputs, log-sum-exps and the travelling dK/dV accumulators
are kept in float32 (or float64 for float64 inputs), as Transformer Engine
does; K/V travel in the input dtype; the output and gradients are cast back.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist

from course_lib import comm, rules
from course_lib.context_parallel.schedule import CAUSAL, FULL, step_blocks
from course_lib.context_parallel.zigzag import _check_layout

__all__ = ["attention_block", "merge_partials", "attention_block_backward", "ring_attention",
           "reference_attention", "kv_bytes_per_step", "ring_sends_per_layer"]

_TAGS = {"k": 1, "v": 2, "dk": 3, "dv": 4}


# ------------------------------------------------------------------- one block


def _scores(q: torch.Tensor, k: torch.Tensor, kind: str, scale: float) -> torch.Tensor:
    """``q k^T · scale`` [b, np, sq, sk]; above the diagonal set to −inf for a ``"causal"`` block."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if kind == CAUSAL:
        if q.shape[-2] != k.shape[-2]:
            raise rules.UsageError(f"a causal (diagonal) block must be square, got {q.shape[-2]} queries and "
                                   f"{k.shape[-2]} keys")
        above = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, float("-inf"))
    elif kind != FULL:
        raise rules.UsageError(f"kind={kind!r} must be 'full' or 'causal'")
    return s


def attention_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kind: str = FULL,
                    softmax_scale: Optional[float] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a query block over one key/value block, normalised over that block only.

    ``q`` [b, np, sq, hn], ``k`` [b, np, sk, hn], ``v`` [b, np, sk, hv] ->
    ``out`` [b, np, sq, hv] = softmax(q kᵀ·scale) v and ``lse`` [b, np, sq] =
    log Σ_keys exp(q kᵀ·scale), the log of the block's softmax denominator.
    ``kind="causal"``: a diagonal block (sq == sk), key j visible to query i iff j ≤ i."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    s = _scores(q, k, kind, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v)
    return out, lse


def merge_partials(out1: torch.Tensor, lse1: torch.Tensor, out2: torch.Tensor,
                   lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions of the same queries over disjoint key sets (the log-sum-exp rule).

    ``out_i`` [b, np, sq, hv] and ``lse_i`` [b, np, sq] from :func:`attention_block`:
    ``lse = log(e^lse1 + e^lse2)`` and ``out = e^(lse1−lse)·out1 + e^(lse2−lse)·out2``
    -- each partial output is reweighted by its share of the total softmax
    denominator. Computed stably (``logaddexp``); a partial with ``lse = −inf``
    (no visible key) gets weight 0."""
    lse = torch.logaddexp(lse1, lse2)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w1 = torch.exp(lse1 - safe).unsqueeze(-1)
    w2 = torch.exp(lse2 - safe).unsqueeze(-1)
    return w1 * out1 + w2 * out2, lse


def attention_block_backward(q, k, v, out, dout, lse, kind: str = FULL, softmax_scale: Optional[float] = None,
                             delta: Optional[torch.Tensor] = None):
    """Gradients of one block given the *final* (merged) ``out`` and ``lse`` of its queries.

    With ``P = exp(q kᵀ·scale − lse)`` (the block's slice of the full softmax) and
    ``D = rowsum(dout ∘ out)`` (FlashAttention's backward, Dao et al. 2022, alg. 2):
    ``dv = Pᵀ dout``, ``dS = P ∘ (dout vᵀ − D)``, ``dq = dS k·scale``,
    ``dk = dSᵀ q·scale``. Summing the blocks' contributions gives the exact
    gradients of the full attention. Shapes as in :func:`attention_block`;
    returns ``(dq [b,np,sq,hn], dk [b,np,sk,hn], dv [b,np,sk,hv])``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    if delta is None:
        delta = (dout * out).sum(-1)
    p = torch.exp(_scores(q, k, kind, scale) - lse.unsqueeze(-1))     # [b, np, sq, sk]
    dv = torch.matmul(p.transpose(-1, -2), dout)                      # [b, np, sk, hv]
    ds = p * (torch.matmul(dout, v.transpose(-1, -2)) - delta.unsqueeze(-1))
    dq = torch.matmul(ds, k) * scale                                  # [b, np, sq, hn]
    dk = torch.matmul(ds.transpose(-1, -2), q) * scale                # [b, np, sk, hn]
    return dq, dk, dv


def reference_attention(q, k, v, causal: bool = False, softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Plain single-process attention on the full sequence (the reference ring attention must equal).

    ``q`` [b, np, s, hn], ``k``/``v`` [b, ng, s, hn|hv] -> [b, np, s, hv]; differentiable by autograd."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), v)


# ------------------------------------------------------------------- the ring


class _Pending:
    """Posted ``batch_isend_irecv`` ops; ``wait()`` returns the receive buffers."""

    def __init__(self, reqs, sent, received):
        self.reqs, self.sent, self.received = reqs, sent, received  # keep send buffers alive

    def wait(self) -> list[torch.Tensor]:
        for req in self.reqs:
            req.wait()
        return self.received


def _exchange(tensors, names, send_to: int, recv_from: int, group, cp_size: int, direction: str) -> _Pending:
    """Send each tensor to global rank ``send_to`` and receive same-shaped ones from ``recv_from``.

    Every send and receive is recorded with :func:`course_lib.comm.record_event` (kind "cp")."""
    ops, sent, received = [], [], []
    for t, name in zip(tensors, names):
        t = t.contiguous()
        buf = torch.empty_like(t)
        comm.record_event("send", t.numel(), group_size=cp_size, kind="cp", dtype=t.dtype, direction=direction,
                          source="ring_attention", tag=name, peer=send_to)
        comm.record_event("recv", buf.numel(), group_size=cp_size, kind="cp", dtype=buf.dtype,
                          direction=direction, source="ring_attention", tag=name, peer=recv_from)
        ops.append(dist.P2POp(dist.isend, t, send_to, group, tag=_TAGS[name]))
        ops.append(dist.P2POp(dist.irecv, buf, recv_from, group, tag=_TAGS[name]))
        sent.append(t)
        received.append(buf)
    return _Pending(dist.batch_isend_irecv(ops), sent, received)


def _chunk(x: torch.Tensor, index: int, c: int) -> torch.Tensor:
    return x.narrow(2, index * c, c)


def _expand(x: torch.Tensor, rep: int) -> torch.Tensor:
    """[b, ng, s, d] -> [b, ng*rep, s, d]: query head i uses K/V group i // rep (Megatron's GQA)."""
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def _reduce_groups(x: torch.Tensor, rep: int) -> torch.Tensor:
    """[b, ng*rep, s, d] -> [b, ng, s, d]: sum the gradients of the heads sharing a K/V group."""
    if rep == 1:
        return x
    b, np_, s, d = x.shape
    return x.view(b, np_ // rep, rep, s, d).sum(2)


class RingAttention(torch.autograd.Function):
    """``forward(ctx, q, k, v, cp_group, causal, layout, softmax_scale)``; use :func:`ring_attention`."""

    @staticmethod
    def forward(ctx, q, k, v, cp_group, causal, layout, softmax_scale):
        cp, r = dist.get_world_size(cp_group), dist.get_rank(cp_group)
        ranks = [dist.get_global_rank(cp_group, i) for i in range(cp)] if cp > 1 else [dist.get_rank()]
        nxt, prv = ranks[(r + 1) % cp], ranks[(r - 1) % cp]
        n_local = 2 if layout == "zigzag" else 1
        c = q.shape[2] // n_local
        rep = q.shape[1] // k.shape[1]
        acc = torch.promote_types(q.dtype, torch.float32)   # partial results are merged in >= float32
        qa = q.to(acc)
        outs: list = [None] * n_local
        lses: list = [None] * n_local

        k_cur, v_cur = k, v
        for step in range(cp):
            # Post the transfer of the K/V we hold to the next rank before computing with it (overlap).
            pending = (_exchange([k_cur, v_cur], ["k", "v"], nxt, prv, cp_group, cp, "fwd")
                       if step < cp - 1 else None)
            for blk in step_blocks(r, step, cp, layout, causal, "fwd"):
                o, lse = attention_block(_chunk(qa, blk.q_index, c),
                                         _expand(_chunk(k_cur, blk.kv_index, c).to(acc), rep),
                                         _expand(_chunk(v_cur, blk.kv_index, c).to(acc), rep),
                                         blk.kind, softmax_scale)
                i = blk.q_index
                if outs[i] is None:
                    outs[i], lses[i] = o, lse
                else:
                    outs[i], lses[i] = merge_partials(outs[i], lses[i], o, lse)
            if pending is not None:
                k_cur, v_cur = pending.wait()

        out = torch.cat(outs, dim=2)     # [b, np, s_local, hv]
        lse = torch.cat(lses, dim=2)     # [b, np, s_local]
        # Keep the last K/V received (rank r+1's); the reverse ring brings the others back.
        ctx.save_for_backward(q, k_cur, v_cur, out, lse)
        ctx.cfg = (cp_group, cp, r, nxt, prv, causal, layout, softmax_scale, c, rep, acc)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k_cur, v_cur, out, lse = ctx.saved_tensors
        cp_group, cp, r, nxt, prv, causal, layout, scale, c, rep, acc = ctx.cfg
        qa, douta = q.to(acc), dout.to(acc)
        delta = (douta * out).sum(-1)                      # D = rowsum(dO ∘ O) [b, np, s_local]
        dq = torch.zeros_like(qa)
        k_shape, v_shape = k_cur.shape, v_cur.shape
        dkv_pending = None
        for step in range(cp):
            # Reverse ring: pass the K/V we hold to rank r-1, receive the next from rank r+1.
            kv_pending = (_exchange([k_cur, v_cur], ["k", "v"], prv, nxt, cp_group, cp, "bwd")
                          if step < cp - 1 else None)
            dk = torch.zeros(k_shape, dtype=acc, device=q.device)
            dv = torch.zeros(v_shape, dtype=acc, device=q.device)
            for blk in step_blocks(r, step, cp, layout, causal, "bwd"):
                qs = slice(blk.q_index * c, (blk.q_index + 1) * c)
                ks = slice(blk.kv_index * c, (blk.kv_index + 1) * c)
                dq_b, dk_b, dv_b = attention_block_backward(
                    qa[:, :, qs], _expand(k_cur[:, :, ks].to(acc), rep), _expand(v_cur[:, :, ks].to(acc), rep),
                    out[:, :, qs], douta[:, :, qs], lse[:, :, qs], blk.kind, scale, delta[:, :, qs])
                dq[:, :, qs] += dq_b
                dk[:, :, ks] += _reduce_groups(dk_b, rep)
                dv[:, :, ks] += _reduce_groups(dv_b, rep)
            if dkv_pending is not None:                    # what the ranks after us added to this block
                dk_in, dv_in = dkv_pending.wait()
                dk += dk_in
                dv += dv_in
            if step < cp - 1:                              # the accumulators travel with their K/V
                dkv_pending = _exchange([dk, dv], ["dk", "dv"], prv, nxt, cp_group, cp, "bwd")
                k_cur, v_cur = kv_pending.wait()
        # After cp steps the block held is our own K/V and dk/dv hold every rank's contribution.
        return dq.to(q.dtype), dk.to(k_cur.dtype), dv.to(v_cur.dtype), None, None, None, None


# ------------------------------------------------------------------- public API


def _validate(q, k, v, cp_group, causal, layout, softmax_scale) -> None:
    if cp_group is None:
        raise rules.UsageError("cp_group is None: pass the context-parallel process group explicitly "
                               "(e.g. dist.new_group(cp_ranks)); a group of one gives plain attention")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise rules.UsageError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise rules.UsageError(f"{name} has shape {tuple(t.shape)}: expected 4 dims [b, heads, s_local, head_dim] "
                                   f"(Megatron's [s, b, heads, head_dim] -> x.permute(1, 2, 0, 3))")
        if not t.is_floating_point():
            raise rules.UsageError(f"{name} has dtype {t.dtype}: attention needs a floating-point dtype")
    if not (q.dtype == k.dtype == v.dtype):
        raise rules.UsageError(f"q, k, v have dtypes {q.dtype}, {k.dtype}, {v.dtype}: use one dtype")
    if k.shape[:3] != v.shape[:3]:
        raise rules.UsageError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree in [b, query groups, s_local]")
    if q.shape[0] != k.shape[0]:
        raise rules.UsageError(f"batch sizes differ: q has b={q.shape[0]}, k/v have b={k.shape[0]}")
    if q.shape[2] != k.shape[2]:
        raise rules.UsageError(f"local sequence lengths differ: q has {q.shape[2]} tokens, k/v have {k.shape[2]}; "
                               f"each rank passes the q, k, v of the same tokens")
    if q.shape[-1] != k.shape[-1]:
        raise rules.UsageError(f"head dims differ: q has {q.shape[-1]}, k has {k.shape[-1]} (q·k needs equal head dims)")
    rules.heads_divisible_by_groups(q.shape[1], k.shape[1])      # q: [b, np, ..], k: [b, ng, ..]
    _check_layout(layout)
    if not isinstance(causal, bool):
        raise rules.UsageError(f"causal={causal!r} must be True or False")
    if softmax_scale is not None and not (isinstance(softmax_scale, (int, float)) and softmax_scale > 0):
        raise rules.UsageError(f"softmax_scale={softmax_scale!r} must be a positive number or None (1/sqrt(head_dim))")
    cp = dist.get_world_size(cp_group)
    rules.sequence_split(q.shape[2] * cp, cp, layout)     # the whole sequence: 2·cp chunks when zigzag


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_group, *, causal: bool = False,
                   layout: str = "zigzag", softmax_scale: Optional[float] = None) -> torch.Tensor:
    """Attention of this rank's queries over the keys/values of the whole CP group, by ring exchange.

    Args:
        q: ``[b, np, s_local, hn]`` this rank's queries (its tokens as laid out by
           :func:`~course_lib.context_parallel.zigzag.shard_sequence` with ``layout``).
        k, v: ``[b, ng, s_local, hn]`` / ``[b, ng, s_local, hv]`` this rank's keys and
           values (``ng`` query groups; ``np % ng == 0``, GQA when ``ng < np``).
        cp_group: the context-parallel process group (explicit; every member calls this).
        causal: mask keys after each query (global positions) -- Megatron's ``AttnMaskType.causal``.
        layout: ``"zigzag"`` (rank r holds chunks r and 2cp−1−r, Megatron's split) or ``"contiguous"``.
        softmax_scale: defaults to ``1/sqrt(hn)``.

    Returns ``[b, np, s_local, hv]``: rows equal to full attention's rows for this
    rank's tokens. Differentiable: the backward runs the reverse ring (see module doc).
    """
    _validate(q, k, v, cp_group, causal, layout, softmax_scale)
    return RingAttention.apply(q, k, v, cp_group, causal, layout, softmax_scale)


def kv_bytes_per_step(b: int, num_query_groups: int, s_local: int, head_dim: int, element_size: int = 4,
                      v_head_dim: Optional[int] = None) -> int:
    """Bytes one rank sends in one forward ring step: its K and V chunk, ``b·ng·s_local·(hn + hv)`` elements."""
    hv = head_dim if v_head_dim is None else v_head_dim
    return b * num_query_groups * s_local * (head_dim + hv) * element_size


def ring_sends_per_layer(cp_size: int) -> dict:
    """Point-to-point sends per rank for one attention layer: ``{"fwd": 2(cp−1), "bwd": 4(cp−1)}``.

    Forward: K and V, ``cp−1`` steps each. Backward: K, V, dK, dV, ``cp−1`` steps each."""
    rules.integer(rules.CP, cp_size)
    return {"fwd": 2 * (cp_size - 1), "bwd": 4 * (cp_size - 1)}
