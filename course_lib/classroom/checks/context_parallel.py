"""Checkers for context parallelism (Lab 04): the log-sum-exp merge, one ring, the zigzag split.

Each checker calls the student's function on many settings, compares with an
independent reference (full softmax attention computed in one piece; the
zigzag rule of Megatron's ``get_batch_on_this_cp_rank``), prints one verdict
line and, when wrong, the most specific hint it can find. A function that still
raises ``NotImplementedError`` gets a "not attempted yet" line. Every checker
returns True/False and never raises; a monkeypatch the student's code makes is
undone, and an answer that is (or runs) the course's own implementation is told so.

The ring is checked by what crossed the wire and what was computed: each rank draws its chunk
from ``os.urandom`` (no rank can rebuild another's), its ranks run on a process group that refuses
every collective (:func:`~course_lib.classroom.checks.verdicts.point_to_point_only`), each rank must
send exactly ``2(cp - 1)`` K or V blocks, to one neighbour, every send carrying a block (each block
but the receiver's own, once), and -- on 4 ranks -- no torch op may build a tensor larger than two
blocks: passing every block around, concatenating and running one dense attention gives the right
numbers with the same traffic, and is refused by what it computed. That count is made by a dispatch mode in
the student's own process, which its code can switch off (``_disable_current_modes``, a thread, the Python key
excluded); so the same function is called once more as one member of a ring of ``VIRTUAL_CP`` = 64 with
``MEMORY_ROWS`` = 512 rows each, whose other members rank 0 of the 4-rank launch plays itself
(:mod:`~course_lib.classroom.checks.virtual_ring`), in a student process forked for that call, and the rank reads,
from ``/proc``, how far that process's memory grew (:func:`_rank_ring_memory`): more than ``MEMORY_STEPS`` = 28 of
one step's score matrices is refused (right rings: 4-17; ``softmax(q Kᵀ) V`` over the gathered blocks, however
hidden, even with its softmax in place: 70 or more, measured). torch's fused attention kernel
(``F.scaled_dot_product_attention``: a blockwise softmax over every key it is given, the merge done for the
student) is refused where the student's function runs (:data:`FUSED_ATTENTION`). What no check here sees: the
blocks gathered first (they are small) and then merged one by one by the student's own code, after the last one
arrived -- the same arithmetic as a ring's, in another order.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import torch

import torch.distributed as dist

from course_lib.classroom.checks import checked_call, is_course_answer, not_attempted, raised_line
from course_lib.classroom.checks.exercise import exercise
from course_lib.classroom.checks.references import references_for
from course_lib.classroom.checks.refusals import Refused
from course_lib.classroom.checks.student_process import student_on_rank
from course_lib.classroom.checks.tamper_guard import course_code_hint
from course_lib.classroom.checks.virtual_ring import VirtualRing, virtual_world
from course_lib.classroom.checks.verdicts import (as_real, describe_ops, drawn_rng, launch_checked, largest_tensor,
                                                  point_to_point_only, refused_collective, safe_repr, secret_generator)
from course_lib.context_parallel.ring import attention_block, merge_partials
from course_lib.context_parallel.work import score_elements
from course_lib.launch import LaunchTimeout, RankError

__all__ = ["check_merge", "check_chunks_for_rank", "check_ring_attention"]

_todo = not_attempted


def _merge_cases():
    """(name, q, k1, v1, k2, v2) in float64: ordinary logits, unequal blocks, huge logits (overflow trap);
    the values are drawn for this run, so no table of fixed inputs answers."""
    g = torch.Generator().manual_seed(drawn_rng().getrandbits(63))
    b, h, sq, d = 2, 3, 5, 4            # sq != d so a missing unsqueeze(-1) cannot broadcast silently

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    cases = []
    for name, sk1, sk2, scale in (("ordinary logits", 6, 6, 1.0), ("blocks of 3 and 9 keys", 3, 9, 1.5),
                                  ("logits near 1000", 7, 4, 30.0)):
        q = rnd(b, h, sq, d, scale=scale)
        cases.append((name, q, rnd(b, h, sk1, d, scale=scale), rnd(b, h, sk1, d),
                      rnd(b, h, sk2, d, scale=scale), rnd(b, h, sk2, d)))
    return cases


def _close(a, b) -> bool:
    return (isinstance(a, torch.Tensor) and a.shape == b.shape and bool(torch.isfinite(a).all())
            and torch.allclose(a.to(b.dtype), b, rtol=1e-6, atol=1e-8))


def _merge_hint(out, o1, l1, o2, l2) -> str:
    """The most specific explanation of a wrong merged output."""
    w1, w2 = l1.unsqueeze(-1), l2.unsqueeze(-1)
    lse = torch.logaddexp(l1, l2).unsqueeze(-1)
    m = torch.maximum(w1, w2)
    guesses = [
        ((o1 + o2) / 2, "you averaged the outputs: each block's softmax was normalised over its own keys "
                        "only, so weight block i by its share of the total denominator, exp(lse_i - lse)"),
        (o1 + o2, "you forgot to rescale by exp(lse_i - lse): each partial output is normalised over its "
                  "own block, so out = exp(lse1 - lse)*out1 + exp(lse2 - lse)*out2"),
        (torch.exp(w1) * o1 + torch.exp(w2) * o2,
         "you weighted by exp(lse_i) but did not divide by the total exp(lse) = exp(lse1) + exp(lse2)"),
        (torch.exp(lse - w1) * o1 + torch.exp(lse - w2) * o2,
         "the weights are upside down: block i's weight is exp(lse_i - lse) (<= 1), not exp(lse - lse_i)"),
        (torch.exp(w1 - m) * o1 + torch.exp(w2 - m) * o2,
         "subtracting the max keeps exp() finite, but the weights must still sum to 1: divide by "
         "exp(lse1 - m) + exp(lse2 - m), i.e. use lse = logaddexp(lse1, lse2)"),
        (torch.where(w1 >= w2, o1, o2), "you kept the block with the larger lse: both blocks contribute; "
                                        "weight each by exp(lse_i - lse)"),
    ]
    for guess, hint in guesses:
        if out.shape == guess.shape and torch.allclose(out.to(guess.dtype), guess, rtol=1e-6, atol=1e-8):
            return hint
    return ("out is not the softmax over both blocks' keys: each partial output is normalised over its own block "
            "only, so weight it by its block's share of the total softmax denominator (lse_i is the log of that "
            "block's own denominator); remember lse has shape [b, h, s]: unsqueeze(-1) before scaling out "
            "[b, h, s, d]")


def _lse_hint(lse, l1, l2) -> str:
    for guess, hint in ((l1 + l2, "you added the log-sum-exps; it is the sums of exponentials that add: "
                                  "lse = log(exp(lse1) + exp(lse2)) = torch.logaddexp(lse1, lse2)"),
                        (torch.maximum(l1, l2), "max(lse1, lse2) is only the stabiliser; the merged lse is "
                                                "logaddexp(lse1, lse2) = max + log1p(exp(-|lse1 - lse2|))"),
                        ((l1 + l2) / 2, "you averaged the log-sum-exps; use lse = torch.logaddexp(lse1, lse2)")):
        if lse.shape == guess.shape and torch.allclose(lse.to(guess.dtype), guess, rtol=1e-6, atol=1e-8):
            return hint
    return ("the merged lse is the log of both blocks' denominators together (each lse_i is the log of one "
            "block's): combine them without leaving log space, or exp() overflows")


@exercise("merge")
def check_merge(fn) -> bool:
    """``fn(out1, lse1, out2, lse2) -> (out, lse)``: merge two partial attentions of the same queries.

    ``out_i`` [b, h, s, d] is softmax attention over key block i alone, ``lse_i`` [b, h, s]
    the log of its softmax denominator. The result must equal attention over both
    blocks at once (checked against one softmax over the concatenated keys)."""
    if is_course_answer(fn):
        return False
    worst = 0.0
    cases = _merge_cases()
    for name, q, k1, v1, k2, v2 in cases:
        scale = 1.0 / math.sqrt(q.shape[-1])
        o1, l1 = attention_block(q, k1, v1)
        o2, l2 = attention_block(q, k2, v2)
        scores = torch.matmul(q, torch.cat([k1, k2], 2).transpose(-1, -2)) * scale
        want_out = torch.matmul(torch.softmax(scores, -1), torch.cat([v1, v2], 2))
        want_lse = torch.logsumexp(scores, -1)
        got, err = checked_call(fn, o1.clone(), l1.clone(), o2.clone(), l2.clone(), references=references_for("merge"))
        if err == "todo":
            return _todo("merge")
        if err:
            print(f"✗ merge: {err} ({name})")
            if "size of tensor" in err or "must match" in err or "broadcast" in err:
                print("  hint: lse has shape [b, h, s] and out [b, h, s, d]: scale with "
                      "exp(lse_i - lse).unsqueeze(-1)")
            return False
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            print(f"✗ merge must return a pair (out, lse), got {type(got).__name__}")
            return False
        out, lse = got
        if not isinstance(out, torch.Tensor) or not isinstance(lse, torch.Tensor):
            print(f"✗ merge must return two tensors (out, lse), got ({type(out).__name__}, {type(lse).__name__})")
            return False
        if out.shape != want_out.shape:
            print(f"✗ out has shape {tuple(out.shape)}, expected {tuple(want_out.shape)} ({name})")
            if out.shape[2] == 2 * want_out.shape[2]:
                print("  hint: you appended the partial outputs: both blocks hold results for the *same* "
                      "queries (different keys), so they are combined, not concatenated")
            return False
        if lse.shape != want_lse.shape:
            print(f"✗ lse has shape {tuple(lse.shape)}, expected {tuple(want_lse.shape)} like lse1 ({name})")
            return False
        if not bool(torch.isfinite(out).all()) or not bool(torch.isfinite(lse).all()):
            print(f"✗ merge returned inf/nan with {name}")
            print("  hint: exp(lse) overflows for large logits: never exponentiate lse itself; use "
                  "torch.logaddexp(lse1, lse2) and weights exp(lse_i - lse), which are <= 1")
            return False
        if not _close(out, want_out):
            print(f"✗ out differs from full softmax attention by {(out.to(want_out.dtype) - want_out).abs().max():.3g} "
                  f"({name})")
            print("  hint: " + _merge_hint(out.to(want_out.dtype), o1, l1, o2, l2))
            return False
        if not _close(lse, want_lse):
            print(f"✗ out is right but lse differs by {(lse.to(want_lse.dtype) - want_lse).abs().max():.3g} ({name})")
            print("  hint: " + _lse_hint(lse.to(want_lse.dtype), l1, l2))
            return False
        worst = max(worst, float((out.to(want_out.dtype) - want_out).abs().max()),
                    float((lse.to(want_lse.dtype) - want_lse).abs().max()))
    print(f"✓ merge equals one softmax over both key blocks on {len(cases)} cases "
          f"(ordinary, unequal blocks, logits near 1000) drawn for this run; worst error "
          f"{'below 1e-10 (float64 throughout)' if worst < 1e-10 else 'within the tolerance, 1e-6 relative'}")
    return True



# ------------------------------------------------------------------ (b) one ring

RING_B, RING_H, RING_S, RING_D = 1, 2, 16, 4
VIRTUAL_CP, MEMORY_ROWS, MEMORY_D = 64, 512, 8
"""The memory case: a ring of ``VIRTUAL_CP`` members, one of them the student's function on a rank of the 4-rank
launch, the others played by that rank (:class:`~course_lib.classroom.checks.virtual_ring.VirtualRing`); each
member's q, k, v ``[1, 1, MEMORY_ROWS, MEMORY_D]`` float64. One step's score matrix is ``MEMORY_ROWS²`` x 8 bytes =
2 MiB; the whole sequence's, ``VIRTUAL_CP`` = 64 times that (K and V blocks are 32 KiB: the scores are what a dense
attention cannot help holding)."""
MEMORY_STEPS = 28
"""How many of one step's score matrices the student process may grow by, at its peak, in the memory case. A ring
holds about 4, and the process's small allocations add to it what the heap it inherited costs them: measured (the
rank reading ``/proc``, the right rings of the tests and one keeping the previous step's block and probabilities)
4-10 from a pytest process, 12-17 from one whose 2 GB heap was fragmented on purpose (a full ``make test``'s worker
is 0.5-1.1 GB), where the same rings on 32 members of 512 rows read up to 12.5 in a fresh clone's CI and were refused
at 12. A dense attention over the whole sequence holds at least one full score matrix, ``VIRTUAL_CP`` = 64 of them
(70 measured, with its softmax computed in place; 131-325 with two, or torch's math attention, or written into a
buffer the cell made). The limit sits between, about twice away from each extreme."""
MEMORY_ROWS_CHECKED = 64
"""Rows of the memory case's output compared with the truth: drawn for this run, so every row has to be right."""
RING_RULE = ("ring attention passes K/V blocks from rank to rank with send/recv; all-gathering K and V is "
             "Megatron's --cp-comm-type all_gather, not a ring")


FUSED_ATTENTION = ("_scaled_dot_product_flash_attention_for_cpu",)
"""torch's fused attention kernels on the CPU (what ``F.scaled_dot_product_attention`` runs there): a blockwise
softmax over all the keys it is given, that is the log-sum-exp merge this exercise asks for, done inside torch.
Refused where the student's function runs (:func:`_fused_attention_refused`); its math fallback
(``sdpa_kernel(SDPBackend.MATH)``) builds the whole score matrix, which the memory case refuses."""
_FUSED_REFUSAL = ("[refused] torch's fused attention kernel (scaled_dot_product_attention) computes the blockwise "
                  "softmax this exercise asks you to write: attend to each block with attention_block and merge the "
                  "steps with your log-sum-exp merge")


@contextlib.contextmanager
def _fused_attention_refused():
    """On a rank, around the forks of its student processes: :data:`FUSED_ATTENTION` raise (``Refused``) in every
    process forked inside the block -- a registration in torch's dispatcher, beneath the Python dispatch modes, so
    neither ``torch.ops.aten`` nor switching the modes off nor ``inference_mode`` gets past it. The function that
    raises is compiled outside the checker's files (the guard would read a call of checker code as the course's)."""
    scope = {"Refused": Refused}
    exec(compile(f"def refused(*args, **kwargs):\n    raise Refused({_FUSED_REFUSAL!r})\n", "<refused>", "exec"),
         scope)
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():  # torch warns that it overrides the CPU kernel: that is the point
        warnings.simplefilter("ignore")
        for op in FUSED_ATTENTION:
            lib.impl(op, scope["refused"], "CPU")
    try:
        yield
    finally:
        lib._destroy()


def _rank_ring(fn):
    with _fused_attention_refused():
        return _rank_ring_calls(fn)


def _rank_ring_calls(fn):
    g, cp, r = dist.group.WORLD, dist.get_world_size(), dist.get_rank()
    secret = secret_generator()                      # this rank's chunk: no other rank can rebuild it
    q, k, v = (torch.randn(RING_B, RING_H, RING_S // cp, RING_D, generator=secret, dtype=torch.float64)
               for _ in range(3))
    with point_to_point_only(RING_RULE):
        result = student_on_rank(fn, q.clone(), k.clone(), v.clone(), g,
                                 references=references_for("ring_attention_forward"), measure=True)
    out = dict(result, q=q, blocks=_gathered(k, v), rank=r, cp=cp)
    if cp >= 4 and r == 0:
        out["memory"] = _rank_ring_memory(fn, secret)
    return out


def _gathered(k, v) -> list:
    """[(k, v)] of every rank, in rank order: the truth, from what the ranks really hold."""
    cp = dist.get_world_size()
    ks, vs = [torch.empty_like(k) for _ in range(cp)], [torch.empty_like(v) for _ in range(cp)]
    dist.all_gather(ks, k)
    dist.all_gather(vs, v)
    return list(zip(ks, vs))


def _rank_ring_memory(fn, secret) -> dict:
    """The memory case: the same function on a ring of ``VIRTUAL_CP`` members with ``MEMORY_ROWS`` rows each, where
    the score matrix of the whole sequence (``rows x cp·rows``) outweighs one step's (``rows x rows``) by cp. The
    student process is one member, drawn for this run; this rank plays the others
    (:class:`~course_lib.classroom.checks.virtual_ring.VirtualRing`: every K/V block is drawn here) and reads how far
    the student process's resident memory grew (``peak``, from ``/proc``, out of the student's reach). The value is
    compared on ``MEMORY_ROWS_CHECKED`` rows drawn for this run, whose truth the rank computes block by block.

    Measured: see :data:`MEMORY_STEPS`."""
    member = 2 * int(torch.randint(VIRTUAL_CP // 2, (1,), generator=secret))  # even: an even/odd ring sends first
    q = torch.randn(1, 1, MEMORY_ROWS, MEMORY_D, generator=secret, dtype=torch.float64)
    blocks = [tuple(torch.randn(1, 1, MEMORY_ROWS, MEMORY_D, generator=secret, dtype=torch.float64) for _ in range(2))
              for _ in range(VIRTUAL_CP)]
    ring = VirtualRing(member, blocks)
    with virtual_world(ring), point_to_point_only(RING_RULE):
        result = student_on_rank(fn, q.clone(), blocks[member][0].clone(), blocks[member][1].clone(), ring,
                                 references=references_for("ring_attention_forward"), measure=True, peak=True)
    rows = torch.randperm(MEMORY_ROWS, generator=secret)[:MEMORY_ROWS_CHECKED]
    want, lse = attention_block(q[:, :, rows], *blocks[0])
    for kb, vb in blocks[1:]:
        want, lse = merge_partials(want, lse, *attention_block(q[:, :, rows], kb, vb))
    value = result["value"]
    right = isinstance(value, torch.Tensor) and value.shape == q.shape and _close(value[:, :, rows], want)
    return dict(result, q=q, blocks=blocks, right=right, rank=member, step_bytes=MEMORY_ROWS * MEMORY_ROWS * 8)


def _attention_over(q, blocks):
    """Softmax attention of ``q`` over the concatenation of ``blocks`` ([(k, v)], duplicates allowed)."""
    k = torch.cat([b[0] for b in blocks], 2)
    v = torch.cat([b[1] for b in blocks], 2)
    return attention_block(q, k, v)[0]


def _ring_value_hint(out, q, blocks, rank, cp) -> str | None:
    """The hint for wrong ring outputs (values only), or None when right."""
    want = _attention_over(q, blocks)
    if _close(out, want):
        return None
    if not isinstance(out, torch.Tensor):
        return f"return this rank's attention rows as a tensor [b, h, s/cp, d] (got {out})"
    if out.shape != want.shape:
        if out.dim() == want.dim() and out.shape[2] == cp * want.shape[2]:
            return ("you appended the per-step outputs: every step's output is for the *same* queries, so merge "
                    "it into the running (out, lse) with your merge from Exercise 1")
        return f"expected this rank's rows [b, h, s/cp, d] = {tuple(want.shape)}, got {tuple(out.shape)}"
    prev = blocks[(rank - 1) % cp]
    guesses = [
        ([blocks[rank]], "this is attention over your own block only: pass K/V around the ring, cp − 1 times, "
                         "merging each block that arrives"),
        ([blocks[rank]] + [prev] * (cp - 1),
         "every step brought rank r−1's block again: pass on the block you just *received*, not your own, so that "
         "after cp − 1 steps every block has come by"),
        (blocks + [blocks[rank]], "one step too many: after cp − 1 transfers you would receive your own block "
                                  "back and count it twice"),
    ]
    for keys, hint in guesses:
        if _close(out, _attention_over(q, keys)):
            return hint
    parts = [attention_block(q, kb, vb)[0] for kb, vb in blocks]
    if _close(out, sum(parts) / cp):
        return ("you averaged the per-step outputs: weight each by its share of the softmax denominator -- merge "
                "them with the log-sum-exp rule (your merge from Exercise 1)")
    return ("the output differs from full attention: start from attention_block(q, k, v) on your own block, then "
            "cp − 1 times receive the next block, attention_block on it and merge")


def _ring_traffic_hint(events, rank, cp, kv_numel) -> str | None:
    """The hint when a rank's sends are not a ring's: 2(cp−1) blocks, all to one neighbour."""
    sent, want = sum(e.numel for e in events if e.op == "send"), 2 * (cp - 1) * kv_numel
    if sent != want:
        return (f"rank {rank} sent {sent} elements ({describe_ops(events)}); a ring sends one K and one V block per "
                f"step, cp − 1 steps: {want} elements")
    peers = sorted({e.peer for e in events if e.op == "send"})
    if len(peers) > 1:
        return (f"rank {rank} sent to ranks {peers}: in a ring each rank sends only to one neighbour (r+1) and "
                f"receives from the other (r−1), passing on what it received")
    return None


def _ring_carried_hint(r: dict) -> str | None:
    """The hint when the sends did not carry K/V blocks: every block but the receiver's own, once (compared as
    the multiset of values sent, so K and V packed into one message count too)."""
    sends = [(e.peer, c) for e, c in zip(r["events"], r["carried"]) if e.op == "send"]
    if not sends or any(c is None for _, c in sends):
        return None
    peer = sends[0][0]
    want = torch.cat([t.reshape(-1) for j, block in enumerate(r["blocks"]) if j != peer for t in block])
    sent = torch.cat([c.reshape(-1).to(want.dtype) for _, c in sends])
    if sent.numel() == want.numel() and torch.equal(sent.sort().values, want.sort().values):
        return None
    return ("the sends did not carry the K and V blocks: a ring passes the blocks themselves -- your own first, "
            "then each block you received -- so that every block but your neighbour's own reaches it once")


def _ring_memory_hint(r: dict) -> str | None:
    """The hint for the memory case (:func:`_rank_ring_memory`), or None when its call was a ring's: the call, its
    sends, its value, then its memory -- the largest tensor where the student process measured one, else the growth
    of its resident memory, which its rank reads (the student's code cannot switch that off)."""
    m = r["memory"]
    rank, cp = m["rank"], VIRTUAL_CP
    if m["patched"]:
        return f"it replaced {', '.join(m['patched'][:3])} (undone by the checker)"
    if m["course_code"]:
        return course_code_hint(m["course_code"][0])
    hint = _ring_traffic_hint(m["events"], rank, cp, m["blocks"][0][0].numel()) or _ring_carried_hint(m)
    if hint:
        return f"on a ring of {cp} members (the others played by the checker), {hint}"
    if not m["right"]:
        return (f"on a ring of {cp} members (the others played by the checker), {MEMORY_ROWS} rows each, the output "
                f"differs from full attention: a ring's steps depend on neither the number of members nor the length")
    hint = _ring_size_hint(dict(m, cp=cp))
    if hint or m["peak"] is None or m["peak"] <= MEMORY_STEPS * m["step_bytes"]:
        return hint
    written = (f", {m['written'] / 2**20:.0f} MiB of it written into memory it held before the call"
               if m.get("written") and m["written"] * 2 > m["peak"] else "")
    return (f"on a ring of {cp} members, {MEMORY_ROWS} rows each, rank {rank}'s function grew its memory by "
            f"{m['peak'] / 2**20:.0f} MiB{written}: {m['peak'] / m['step_bytes']:.1f}× one step's score matrix "
            f"({m['step_bytes'] / 2**20:.0f} MiB; a ring holds about 4 of them at once). Gathering the blocks and "
            f"running one dense attention gives the right numbers, but ring attention never holds the whole "
            f"sequence -- attend to each block as it arrives (attention_block) and merge it into the running "
            f"(out, lse) by log-sum-exp")


def _ring_size_hint(r: dict) -> str | None:
    """The hint when a rank computed on more than two blocks at once (e.g. every block concatenated, then one
    dense attention): a ring attends to one block per step and merges as blocks arrive."""
    q, (k, v) = r["q"], r["blocks"][0]
    block = max(q.numel(), k.numel(), v.numel(), q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2])
    if r["cp"] < 3 or r["largest"] <= 2 * block:
        return None
    return (f"rank {r['rank']} built a tensor of {r['largest']} elements (torch.{r['largest_op']}), {r['largest'] // block}× "
            f"one step's block: gathering the blocks and running one dense attention gives the right numbers, but "
            f"ring attention never holds the whole sequence -- attend to each block as it arrives "
            f"(attention_block) and merge it into the running (out, lse) by log-sum-exp")


@exercise("ring_attention_forward")
def check_ring_attention(fn, timeout: float = 15) -> bool:
    """``fn(q, k, v, group) -> out``: this rank's rows of (unmasked) attention over the whole sequence, each
    rank holding a contiguous chunk ``[b, h, s/cp, d]``; K/V travel by point-to-point messages only. A last
    call, as one member of a ring of ``VIRTUAL_CP`` whose others the rank plays, ``MEMORY_ROWS`` rows each, is judged
    by its sends, its value on drawn rows and how far its process's memory grew (read by the rank); torch's fused
    attention kernel is refused throughout."""
    if is_course_answer(fn):
        return False
    with largest_tensor():  # its one-time import happens here, not in every rank
        pass
    for cp in (2, 4):
        try:
            res = launch_checked(_rank_ring, world_size=cp, timeout=timeout, fn=fn)
        except RankError as err:
            if err.exc_type == "NotImplementedError":
                calls_merge = ", in merge" in err.traceback
                return _todo("merge (Exercise 1), which ring_attention_forward calls," if calls_merge
                             else "ring_attention_forward")
            refused = refused_collective(err.traceback)
            if refused:
                print(f"✗ with {cp} ranks: {refused}\n  hint: send your K and V to rank r+1 and receive the next "
                      f"block from rank r−1 (dist.batch_isend_irecv), cp − 1 times")
                return False
            print(f"✗ with {cp} ranks, rank {err.rank} raised {raised_line(err)}")
            return False
        except LaunchTimeout:
            print(f"✗ with {cp} ranks the ranks waited for each other (a deadlock)\n  hint: if every rank first "
                  f"sends and then receives, all can wait at once: post each send together with its receive "
                  f"(dist.batch_isend_irecv), or let even ranks send first and odd ranks receive first")
            return False
        for r in res:
            problem = (f"it replaced {', '.join(r['patched'][:3])} (undone by the checker)" if r["patched"]
                       else course_code_hint(r["course_code"][0]) if r["course_code"] else None)
            kv_numel = r["blocks"][0][0].numel()
            hint = (problem or _ring_value_hint(r["value"], r["q"], r["blocks"], r["rank"], cp)
                    or _ring_traffic_hint(r["events"], r["rank"], cp, kv_numel) or _ring_carried_hint(r)
                    or _ring_size_hint(r) or ("memory" in r and _ring_memory_hint(r)) or None)
            if hint:
                print(f"✗ with {cp} ranks, rank {r['rank']}\n  hint: {hint}")
                return False
    # Each claim is checked above: the values, the sends (2(cp − 1) K/V blocks to one neighbour, carrying the
    # blocks) and, on 4 ranks, no tensor larger than two blocks; on the ring of VIRTUAL_CP, the same sends and a memory
    # peak below MEMORY_STEPS score matrices of one step -- so what arrived was merged block by block.
    print("✓ ring_attention_forward equals full attention on 2 and 4 ranks, using only send/recv: each rank "
          "passed 2(cp − 1) K/V blocks to its neighbour and merged what arrived with log-sum-exp")
    return True


# ------------------------------------------------------------------ (c) zigzag chunks


def _chunk_pair(got) -> tuple | None:
    """The answer as a pair of ints (ints of any type: numpy, 0-d tensors, 3.0), or None."""
    try:
        items = list(got)
    except Exception:  # noqa: BLE001 - not a sequence
        return None
    if len(items) != 2:
        return None
    pair = []
    for item in items:
        number, reason = as_real(item)
        if reason or number != int(number):
            return None
        pair.append(int(number))
    return tuple(pair)


_CHUNK_MISTAKES = [
    (lambda r, cp: (2 * cp - 1 - r, r),
     lambda cp: "return the early chunk first (a < b): the local tensor holds the rank's chunks in sequence order"),
    (lambda r, cp: (r, cp - 1 - r),
     lambda cp: f"the sequence is cut into 2·cp = {2 * cp} chunks (ids 0..{2 * cp - 1}), not cp; rank r pairs "
                f"chunk r with its mirror from the end"),
    (lambda r, cp: (r, 2 * cp - r),
     lambda cp: f"off by one: chunk ids run 0..{2 * cp - 1}, and rank 0's second chunk, {2 * cp}, is past the end"),
    (lambda r, cp: (2 * r, 2 * r + 1),
     lambda cp: "that is a contiguous split in disguise: rank 0 gets the two cheapest chunks, the last rank "
                "the two most expensive; pair an early chunk with a late one"),
    (lambda r, cp: (r, r + cp),
     lambda cp: f"chunk r with chunk r+cp still grows with r (under a causal mask chunk k costs about k+1 "
                f"units: the ranks get {[(k + 1) + (k + cp + 1) for k in range(cp)]}); pair each early chunk with "
                f"a late one whose cost falls as r grows, so that every pair costs the same"),
]


@exercise("chunks_for_rank")
def check_chunks_for_rank(fn) -> bool:
    """``fn(rank, cp) -> (a, b)``: the two chunks (of 2·cp) rank ``rank`` holds in the load-balanced split."""
    if is_course_answer(fn):
        return False
    rng = drawn_rng()
    cps = [*range(1, 9), *rng.sample(range(9, 65), 2)]  # two drawn for this run: no table of cp <= 8 answers
    for cp in cps:
        table = []
        for r in range(cp):
            got, err = checked_call(fn, r, cp, references=references_for("chunks_for_rank"))
            if err == "todo":
                return _todo("chunks_for_rank")
            if err:
                print(f"✗ chunks_for_rank({r}, {cp}): {err}")
                return False
            pair = _chunk_pair(got)
            if pair is None:
                print(f"✗ chunks_for_rank({r}, {cp}) returned {safe_repr(got)}: return a pair of whole chunk ids "
                      f"(a, b)")
                return False
            table.append(pair)
        want = [(r, 2 * cp - 1 - r) for r in range(cp)]
        if table == want:
            continue
        r = next(i for i in range(cp) if table[i] != want[i])
        shown = f"all ranks for cp={cp}: {table}" if cp <= 8 else f"rank {r} of {cp}"
        print(f"✗ chunks_for_rank({r}, {cp}) returned {table[r]}: not the load-balanced pair ({shown})")
        for pattern, hint in _CHUNK_MISTAKES:
            if table == [pattern(i, cp) for i in range(cp)]:
                print("  hint: " + hint(cp))
                break
        else:
            print("  hint: under a causal mask chunk k costs about k+1 units: give every rank one early and one "
                  "late chunk so that each rank's two chunks cost the same, and no chunk goes to two ranks (see "
                  "Megatron's get_batch_on_this_cp_rank)")
        return False
    w = score_elements(64, 4, "zigzag")
    print(f"✓ chunks_for_rank matches Megatron's zigzag split on every rank for cp = 1..8 and 2 cp drawn for "
          f"this run; e.g. s=64, cp=4: "
          f"every rank computes {w[0]} causal scores (contiguous: {score_elements(64, 4, 'contiguous')})")
    return True
