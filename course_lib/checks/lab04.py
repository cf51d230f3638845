"""Checkers for Lab 04's exercises (context parallelism: the log-sum-exp merge and the zigzag split).

Each checker calls the student's function on many settings, compares with an
independent reference (full softmax attention computed in one piece; the
zigzag rule of Megatron's ``get_batch_on_this_cp_rank``), prints one verdict
line and, when wrong, the most specific hint it can find. A function that still
raises ``NotImplementedError`` gets a "not attempted yet" line. Every checker
returns True/False and never raises.
"""

from __future__ import annotations

import math

import torch

from course_lib.checks import call_student, not_attempted
from course_lib.context_parallel.ring import attention_block
from course_lib.context_parallel.work import score_elements

__all__ = ["check_merge", "check_chunks_for_rank"]


_call, _todo = call_student, not_attempted


# ------------------------------------------------------------------ (a) merge


def _merge_cases():
    """(name, q, k1, v1, k2, v2) in float64: ordinary logits, unequal blocks, huge logits (overflow trap)."""
    g = torch.Generator().manual_seed(4)
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
    return ("out should be exp(lse1 - lse)*out1 + exp(lse2 - lse)*out2 with lse = log(exp(lse1) + exp(lse2)); "
            "remember lse has shape [b, h, s]: unsqueeze(-1) before scaling out [b, h, s, d]")


def _lse_hint(lse, l1, l2) -> str:
    for guess, hint in ((l1 + l2, "you added the log-sum-exps; it is the sums of exponentials that add: "
                                  "lse = log(exp(lse1) + exp(lse2)) = torch.logaddexp(lse1, lse2)"),
                        (torch.maximum(l1, l2), "max(lse1, lse2) is only the stabiliser; the merged lse is "
                                                "logaddexp(lse1, lse2) = max + log1p(exp(-|lse1 - lse2|))"),
                        ((l1 + l2) / 2, "you averaged the log-sum-exps; use lse = torch.logaddexp(lse1, lse2)")):
        if lse.shape == guess.shape and torch.allclose(lse.to(guess.dtype), guess, rtol=1e-6, atol=1e-8):
            return hint
    return "the merged lse is log(exp(lse1) + exp(lse2)): use torch.logaddexp(lse1, lse2)"


def check_merge(fn) -> bool:
    """``fn(out1, lse1, out2, lse2) -> (out, lse)``: merge two partial attentions of the same queries.

    ``out_i`` [b, h, s, d] is softmax attention over key block i alone, ``lse_i`` [b, h, s]
    the log of its softmax denominator. The result must equal attention over both
    blocks at once (checked against one softmax over the concatenated keys)."""
    worst = 0.0
    cases = _merge_cases()
    for name, q, k1, v1, k2, v2 in cases:
        scale = 1.0 / math.sqrt(q.shape[-1])
        o1, l1 = attention_block(q, k1, v1)
        o2, l2 = attention_block(q, k2, v2)
        scores = torch.matmul(q, torch.cat([k1, k2], 2).transpose(-1, -2)) * scale
        want_out = torch.matmul(torch.softmax(scores, -1), torch.cat([v1, v2], 2))
        want_lse = torch.logsumexp(scores, -1)
        got, err = _call(fn, o1.clone(), l1.clone(), o2.clone(), l2.clone())
        if err == "todo":
            return _todo("merge")
        if err:
            print(f"✗ merge raised {err} ({name})")
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
          f"(ordinary, unequal blocks, logits near 1000); worst error {worst:.1e}")
    return True


# ------------------------------------------------------------------ (b) zigzag chunks


_CHUNK_MISTAKES = [
    (lambda r, cp: (2 * cp - 1 - r, r),
     lambda cp: "return the early chunk first (a < b): the local tensor holds the rank's chunks in sequence order"),
    (lambda r, cp: (r, cp - 1 - r),
     lambda cp: f"the sequence is cut into 2·cp = {2 * cp} chunks (ids 0..{2 * cp - 1}), not cp; rank r pairs "
                f"chunk r with its mirror from the end"),
    (lambda r, cp: (r, 2 * cp - r),
     lambda cp: "off by one: chunk ids run 0..2·cp−1, so the mirror of chunk r is 2·cp−1−r"),
    (lambda r, cp: (2 * r, 2 * r + 1),
     lambda cp: "that is a contiguous split in disguise: rank 0 gets the two cheapest chunks, the last rank "
                "the two most expensive; pair an early chunk with a late one"),
    (lambda r, cp: (r, r + cp),
     lambda cp: f"chunk r with chunk r+cp still grows with r (under a causal mask chunk k costs about k+1 "
                f"units: the ranks get {[(k + 1) + (k + cp + 1) for k in range(cp)]}); use the mirror chunk "
                f"2·cp−1−r so every pair costs the same"),
]


def check_chunks_for_rank(fn) -> bool:
    """``fn(rank, cp) -> (a, b)``: the two chunks (of 2·cp) rank ``rank`` holds in the load-balanced split."""
    n_cases = 0
    for cp in range(1, 9):
        table = []
        for r in range(cp):
            got, err = _call(fn, r, cp)
            if err == "todo":
                return _todo("chunks_for_rank")
            if err:
                print(f"✗ chunks_for_rank({r}, {cp}) raised {err}")
                return False
            try:
                pair = tuple(int(x) for x in got)
            except (TypeError, ValueError):
                pair = None
            if pair is None or len(pair) != 2:
                print(f"✗ chunks_for_rank({r}, {cp}) returned {got!r}: return a pair of chunk ids (a, b)")
                return False
            table.append(pair)
        want = [(r, 2 * cp - 1 - r) for r in range(cp)]
        n_cases += cp
        if table == want:
            continue
        r = next(i for i in range(cp) if table[i] != want[i])
        print(f"✗ chunks_for_rank({r}, {cp}) returned {table[r]}, expected {want[r]} "
              f"(all ranks for cp={cp}: {table})")
        for pattern, hint in _CHUNK_MISTAKES:
            if table == [pattern(i, cp) for i in range(cp)]:
                print("  hint: " + hint(cp))
                break
        else:
            print("  hint: rank r holds chunk r (from the front) and chunk 2·cp−1−r (the same distance from "
                  "the back), as in Megatron's get_batch_on_this_cp_rank")
        return False
    w = score_elements(64, 4, "zigzag")
    print(f"✓ chunks_for_rank matches Megatron's zigzag split on {n_cases} (rank, cp) cases; e.g. s=64, cp=4: "
          f"every rank computes {w[0]} causal scores (contiguous: {score_elements(64, 4, 'contiguous')})")
    return True
