"""Lab 04's checkers (the merge and zigzag tables live in test_context_parallel.py): the ring's table of
wrong answers -- collectives, a direct exchange, wrong steps -- each with its hint, right rings written
differently, and the robust verdicts of the merge and zigzag checkers (odd number types, the course's code)."""

from __future__ import annotations

import math
import platform
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

from course_lib.classroom.checks import context_parallel as cp_checks
from course_lib.classroom.grading import landlock
from course_lib.context_parallel import merge_partials, ring_attention
from course_lib.context_parallel.ring import attention_block, reference_attention
from course_lib.context_parallel.zigzag import chunks_for_rank


def not_yet(*args):
    raise NotImplementedError("write it")


def merge(o1, l1, o2, l2):
    lse = torch.logaddexp(l1, l2)
    return torch.exp(l1 - lse).unsqueeze(-1) * o1 + torch.exp(l2 - lse).unsqueeze(-1) * o2, lse


def _neighbours(group, step=1):
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    return cp, r, (r + step) % cp, (r - step) % cp


def _exchange(k, v, to, frm, group):
    k_in, v_in = torch.empty_like(k), torch.empty_like(v)
    ops = [dist.P2POp(dist.isend, k, to, group), dist.P2POp(dist.isend, v, to, group),
           dist.P2POp(dist.irecv, k_in, frm, group), dist.P2POp(dist.irecv, v_in, frm, group)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    return k_in, v_in


def ring_ok(q, k, v, group, step=1, steps=None, merge_fn=merge, forward_received=True):
    cp, r, to, frm = _neighbours(group, step)
    out, lse = attention_block(q, k, v)
    mine = (k, v)
    for _ in range(cp - 1 if steps is None else steps(cp)):
        k, v = _exchange(k, v, to, frm, group) if forward_received else _exchange(*mine, to, frm, group)
        o, l_ = attention_block(q, k, v)
        out, lse = merge_fn(out, lse, o, l_)
    return out


def ring_backwards(q, k, v, group):              # the other direction is a ring too: here with separate isend/irecv,
    group = dist.new_group(list(range(dist.get_world_size(group))))  # receives posted first, on a group of its own
    cp, r, to, frm = _neighbours(group, step=-1)
    out, lse = attention_block(q, k, v)
    for _ in range(cp - 1):
        k_in, v_in = torch.empty_like(k), torch.empty_like(v)
        works = [dist.irecv(k_in, frm, group=group), dist.irecv(v_in, frm, group=group),
                 dist.isend(k, to, group=group), dist.isend(v, to, group=group)]
        for work in works:
            work.wait()
        k, v = k_in, v_in
        out, lse = merge(out, lse, *attention_block(q, k, v))
    return out


def ring_blocking_even_odd(q, k, v, group):
    cp, r, to, frm = _neighbours(group)
    out, lse = attention_block(q, k, v)
    kv = torch.cat([k, v], -1).contiguous()       # K and V in one message
    for _ in range(cp - 1):
        incoming = torch.empty_like(kv)
        if r % 2 == 0:
            dist.send(kv, to, group=group)
            dist.recv(incoming, frm, group=group)
        else:
            dist.recv(incoming, frm, group=group)
            dist.send(kv, to, group=group)
        kv = incoming
        o, l_ = attention_block(q, *kv.split(k.shape[-1], -1))
        out, lse = merge(out, lse, o, l_)
    return out


def ring_default_group_odd_first(q, k, v, group):  # the default group, not the one passed; odd ranks send first
    cp, r = dist.get_world_size(), dist.get_rank()   # K and V side by side in one message
    out, lse = attention_block(q, k, v)
    kv = torch.cat([k, v], -1)
    for _ in range(cp - 1):
        incoming = torch.empty_like(kv)
        if r % 2:
            dist.send(kv, (r + 1) % cp)
            dist.recv(incoming, (r - 1) % cp)
        else:
            dist.recv(incoming, (r - 1) % cp)
            dist.send(kv, (r + 1) % cp)
        kv = incoming
        out, lse = merge(out, lse, *attention_block(q, *kv.split(k.shape[-1], -1)))
    return out


def ring_course_merge(q, k, v, group):           # the course's merge inside the student's own ring is fine
    return ring_ok(q, k, v, group, merge_fn=merge_partials)


def ring_all_gather(q, k, v, group):             # right numbers: Megatron's all_gather flavour, not a ring
    cp = dist.get_world_size(group)
    ks, vs = [torch.empty_like(k) for _ in range(cp)], [torch.empty_like(v) for _ in range(cp)]
    dist.all_gather(ks, k.contiguous(), group=group)
    dist.all_gather(vs, v.contiguous(), group=group)
    return attention_block(q, torch.cat(ks, 2), torch.cat(vs, 2))[0]


def ring_gather_objects(q, k, v, group):         # the same through object collectives
    cp = dist.get_world_size(group)
    blocks = [None] * cp
    dist.all_gather_object(blocks, (k, v), group=group)
    return attention_block(q, torch.cat([b[0] for b in blocks], 2), torch.cat([b[1] for b in blocks], 2))[0]


def ring_direct(q, k, v, group):                 # right numbers, right volume: every rank sends to every rank
    cp, r = dist.get_world_size(group), dist.get_rank(group)
    out, lse = attention_block(q, k, v)
    for step in range(1, cp):
        k_in, v_in = _exchange(k, v, (r + step) % cp, (r - step) % cp, group)
        o, l_ = attention_block(q, k_in, v_in)
        out, lse = merge(out, lse, o, l_)
    return out


def ring_own_block_only(q, k, v, group):
    return attention_block(q, k, v)[0]


def ring_resends_own(q, k, v, group):
    return ring_ok(q, k, v, group, forward_received=False)


def ring_one_step_too_many(q, k, v, group):
    return ring_ok(q, k, v, group, steps=lambda cp: cp)


def ring_appends(q, k, v, group):
    cp, r, to, frm = _neighbours(group)
    outs = [attention_block(q, k, v)[0]]
    for _ in range(cp - 1):
        k, v = _exchange(k, v, to, frm, group)
        outs.append(attention_block(q, k, v)[0])
    return torch.cat(outs, 2)


def ring_averages(q, k, v, group):
    cp, r, to, frm = _neighbours(group)
    outs = [attention_block(q, k, v)[0]]
    for _ in range(cp - 1):
        k, v = _exchange(k, v, to, frm, group)
        outs.append(attention_block(q, k, v)[0])
    return sum(outs) / cp


def _ring_with_unwritten_merge():
    def merge(*args):                            # the notebook's stub of Exercise 1
        raise NotImplementedError("write merge")

    def ring(q, k, v, group):
        return ring_ok(q, k, v, group, merge_fn=merge)
    return ring


ring_calls_unwritten_merge = _ring_with_unwritten_merge()


def _every_block(k, v, group):
    """Every K and V block, passed around the ring (the right sends), concatenated along the sequence."""
    cp, r, to, frm = _neighbours(group)
    ks, vs = [k], [v]
    for _ in range(cp - 1):
        k, v = _exchange(k, v, to, frm, group)
        ks.append(k)
        vs.append(v)
    return torch.cat(ks, 2), torch.cat(vs, 2)


def ring_gather_then_dense(q, k, v, group):      # right numbers, the ring's sends, then one dense attention
    return attention_block(q, *_every_block(k, v, group))[0]


def ring_then_course_reference(q, k, v, group):  # the course's dense reference on what the ring brought
    return reference_attention(q, *_every_block(k, v, group))


def ring_then_sdpa(q, k, v, group):            # right numbers, the ring's sends, torch's fused attention on all of it
    return torch.nn.functional.scaled_dot_product_attention(q, *_every_block(k, v, group))


def ring_then_fused_kernel_unmeasured(q, k, v, group):  # the kernel itself, through torch.ops, the modes off
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.inference_mode():
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, *_every_block(k, v, group))[0].clone()


def ring_rebuilt_from_seed(q, k, v, group):      # every block rebuilt from the seed the checker once used
    cp, r, to, frm = _neighbours(group)
    gen = torch.Generator().manual_seed(21)
    _, k_all, v_all = (torch.randn(1, 2, 16, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    for _ in range(cp - 1):
        k, v = _exchange(k, v, to, frm, group)
    return attention_block(q, k_all, v_all)[0]


@pytest.mark.parametrize("answer, ok, text", [
    (ring_ok, True, "✓ ring_attention_forward"),
    (ring_backwards, True, "✓ ring_attention_forward"),
    (ring_blocking_even_odd, True, "✓ ring_attention_forward"),
    (ring_course_merge, True, "✓ ring_attention_forward"),
    (ring_default_group_odd_first, True, "✓ ring_attention_forward"),
    (not_yet, False, "not attempted yet: write ring_attention_forward"),
    (ring_calls_unwritten_merge, False, "not attempted yet: write merge (Exercise 1)"),
    (ring_all_gather, False, "--cp-comm-type all_gather, not a ring"),
    (ring_gather_objects, False, "--cp-comm-type all_gather, not a ring"),
    (ring_direct, False, "sends only to one neighbour"),
    (ring_own_block_only, False, "your own block only"),
    (ring_resends_own, False, "pass on the block you just *received*"),
    (ring_one_step_too_many, False, "one step too many"),
    (ring_appends, False, "you appended the per-step outputs"),
    (ring_averages, False, "you averaged the per-step outputs"),
    (ring_attention, False, "the course's own"),
    (ring_gather_then_dense, False, "ring attention never holds the whole sequence"),
    (ring_then_course_reference, False, "the course's own course_lib.context_parallel.ring.reference_attention"),
    (ring_rebuilt_from_seed, False, "the output differs from full attention"),
    (ring_then_sdpa, False, "[refused] torch's fused attention kernel (scaled_dot_product_attention)"),
    (ring_then_fused_kernel_unmeasured, False, "[refused] torch's fused attention kernel"),
])
def test_check_ring_attention(capsys, answer, ok, text):
    assert cp_checks.check_ring_attention(answer).ok is ok
    out = capsys.readouterr().out
    assert text in out, out


def _dense_over_every_block(q, k, v, group):
    """softmax(q Kᵀ/√d) V over K and V concatenated from what the ring brought: right numbers, the ring's sends."""
    keys, values = _every_block(k, v, group)
    return torch.softmax(q @ keys.transpose(-1, -2) / q.shape[-1] ** 0.5, -1) @ values


def ring_then_dense_in_a_thread(q, k, v, group):  # dispatch modes are per thread: a new one starts without them
    import threading

    got = []
    worker = threading.Thread(target=lambda: got.append(_dense_over_every_block(q, k, v, group)))
    worker.start()
    worker.join()
    return got[0]


def ring_then_dense_python_key_excluded(q, k, v, group):  # torch's Python dispatch key off: no mode sees an op
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Python)):
        return _dense_over_every_block(q, k, v, group)


def ring_then_dense_in_a_child(q, k, v, group):  # the dense part in a forked process, whose memory is its own
    import os

    keys, values = _every_block(k, v, group)
    read, write = os.pipe()
    if os.fork() == 0:
        out = torch.softmax(q @ keys.transpose(-1, -2), -1) @ values
        os.write(write, out.numpy().tobytes())
        os._exit(0)
    data = b""
    while len(data) < q.numel() * 8:
        data += os.read(read, 1 << 20)
    return torch.frombuffer(bytearray(data), dtype=torch.float64).reshape(q.shape)


_SPARE: list = []
"""Memory touched before the ring runs: by the 'cell' (the test fills it before the check: every fork inherits it)
or by the function's first call (kept for its later calls)."""
_SCORES = cp_checks.VIRTUAL_CP * cp_checks.MEMORY_ROWS ** 2
"""Elements of the memory case's whole score matrix: the spare buffers hold two (scores and probabilities)."""


def _dense_into(spare, q, k, v, group):
    """softmax(q Kᵀ/√d) V written into ``spare`` (out= and in place), the dispatch modes switched off throughout."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        keys, values = _every_block(k, v, group)
        shape = (*q.shape[:3], keys.shape[2])
        scores = spare[: math.prod(shape)].view(shape)
        probs = spare[math.prod(shape): 2 * math.prod(shape)].view(shape)
        torch.matmul(q / q.shape[-1] ** 0.5, keys.transpose(-1, -2), out=scores)
        torch._softmax(scores, -1, False, out=probs)
        return probs @ values


def ring_then_dense_in_the_cells_buffer(q, k, v, group):
    return _dense_into(_SPARE[0], q, k, v, group)


def ring_then_dense_in_its_first_calls_buffer(q, k, v, group):
    if not _SPARE:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            _SPARE.append(torch.zeros(2 * _SCORES, dtype=torch.float64))
    return _dense_into(_SPARE[0], q, k, v, group)


def ring_then_dense_softmax_in_place(q, k, v, group):  # one score matrix of the whole sequence, nothing more
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        keys, values = _every_block(k, v, group)
        scores = q @ keys.transpose(-1, -2)
        scores.div_(q.shape[-1] ** 0.5)
        scores.sub_(scores.amax(-1, keepdim=True)).exp_()
        scores.div_(scores.sum(-1, keepdim=True))
        return scores @ values


def ring_then_sdpa_math(q, k, v, group):          # the fused kernel refused, torch's math fallback: the whole scores
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), sdpa_kernel(SDPBackend.MATH):
        return torch.nn.functional.scaled_dot_product_attention(q, *_every_block(k, v, group))


def ring_keeping_the_previous_step(q, k, v, group):  # wasteful, still a ring: last step's block and probabilities kept
    cp, r, to, frm = _neighbours(group)
    out, lse = attention_block(q, k, v)
    kept = None
    for _ in range(cp - 1):
        incoming = _exchange(k, v, to, frm, group)
        kept = (k, v, torch.softmax(q @ k.transpose(-1, -2), -1))
        k, v = incoming
        o, l_ = attention_block(q, k, v)
        out, lse = merge(out, lse, o, l_)
    assert kept is not None or cp == 1
    return out


def ring_collecting_garbage(q, k, v, group):  # a right ring that runs the garbage collector in the memory case
    import gc

    if dist.get_world_size(group) > 4:
        gc.collect()
    return ring_keeping_the_previous_step(q, k, v, group)


@pytest.mark.skipif(not (sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64")
                         and landlock.abi_version() >= 6), reason="/proc, seccomp and Landlock (ABI >= 6) on Linux")
@pytest.mark.parametrize("answer, ok, text", [
    (ring_keeping_the_previous_step, True, "✓ ring_attention_forward"),
    (ring_collecting_garbage, True, "✓ ring_attention_forward"),
    (ring_then_dense_in_the_cells_buffer, False, "ring attention never holds the whole sequence"),
    (ring_then_dense_in_its_first_calls_buffer, False, "ring attention never holds the whole sequence"),
    (ring_then_dense_in_a_thread, False, "ring attention never holds the whole sequence"),
    (ring_then_dense_python_key_excluded, False, "ring attention never holds the whole sequence"),
    (ring_then_dense_in_a_child, False, "a new process cannot be started where your function runs"),
    (ring_then_dense_softmax_in_place, False, "ring attention never holds the whole sequence"),
    (ring_then_sdpa_math, False, "ring attention never holds the whole sequence"),
])
def test_a_dense_attention_hidden_from_the_student_process_is_refused_by_its_memory(capsys, answer, ok, text):
    """The largest tensor is counted in the student's own process (a dispatch mode): switched off there, the dense
    attention still shows in how far that process's memory grew, which its rank reads from /proc with the function
    as one member of a ring of 64 (``VIRTUAL_CP``) whose other members the rank plays, 512 rows each
    (``MEMORY_ROWS``), in a process forked for that call; memory the cell touched before (which a write copies
    without raising the peak) or the first call kept does not hide it, nor does a softmax computed in place (one
    score matrix of the whole sequence: 64 of one step's) or torch's math attention. A ring that keeps more than it
    needs still passes; a new process, whose memory would not count, cannot be started (the student process is
    sealed)."""
    _SPARE.clear()
    if answer is ring_then_dense_in_the_cells_buffer:
        _SPARE.append(torch.zeros(2 * _SCORES, dtype=torch.float64))  # the cell touched it: inherited by the forks
    try:
        verdict = cp_checks.check_ring_attention(answer)
    finally:
        _SPARE.clear()
    out = capsys.readouterr().out
    assert verdict.ok is ok, out
    assert text in out, out
    if not ok and "new process" not in text:
        assert "grew its memory" in out and "with 4 ranks" in out, out


@pytest.mark.parametrize("fn, ok, expect", [
    (lambda r, cp: (np.int64(r), torch.tensor(2 * cp - 1 - r)), True, "✓ chunks_for_rank matches"),
    (lambda r, cp: [float(r), 2.0 * cp - 1 - r], True, "✓ chunks_for_rank matches"),
    (lambda r, cp: (r + 0.5, 2 * cp - 1 - r), False, "return a pair of whole chunk ids"),
    (lambda r, cp: (float("nan"), 2 * cp - 1 - r), False, "return a pair of whole chunk ids"),
    (lambda r, cp: np.array([r, 2 * cp - 1 - r, 0]), False, "return a pair of whole chunk ids"),
    (chunks_for_rank, False, "the course's own"),
])
def test_check_chunks_for_rank_robust(capsys, fn, ok, expect):
    assert cp_checks.check_chunks_for_rank(fn).ok is ok
    assert expect in capsys.readouterr().out


def test_chunks_for_rank_a_table_of_small_cp_fails_on_the_drawn_ones(capsys):
    """A table of the fixed cases (cp <= 8) fails on the cp drawn for this run; the hint shows no answer."""
    table = {(r, cp): (r, 2 * cp - 1 - r) for cp in range(1, 9) for r in range(cp)}
    assert cp_checks.check_chunks_for_rank(lambda r, cp: table.get((r, cp), (r, cp))).ok is False
    out = capsys.readouterr().out
    assert "not the load-balanced pair" in out and "expected" not in out, out
    assert cp_checks.check_chunks_for_rank(lambda r, cp: (r, r + cp)).ok is False  # a named mistake keeps its hint
    assert "still grows with r" in capsys.readouterr().out


def _merge_float32(o1, l1, o2, l2):
    out, lse = merge(o1.float(), l1.float(), o2.float(), l2.float())
    return out, lse


def _merge_patches_logaddexp(o1, l1, o2, l2):
    torch.logaddexp = lambda a, b: a            # a patch that would leak into later cells
    return merge(o1, l1, o2, l2)


@pytest.mark.parametrize("fn, ok, expect", [
    (merge, True, "✓ merge equals one softmax"),
    (lambda o1, l1, o2, l2: merge(o1, l1, o2, l2)[::-1], False, "out has shape"),
    (lambda o1, l1, o2, l2: (o1.numpy(), l1), False, "must return two tensors"),
    (_merge_patches_logaddexp, False, "replaced torch.logaddexp"),
    (merge_partials, False, "the course's own"),
])
def test_check_merge_robust(capsys, fn, ok, expect):
    logaddexp = torch.logaddexp
    assert cp_checks.check_merge(fn).ok is ok
    assert expect in capsys.readouterr().out
    assert torch.logaddexp is logaddexp


@pytest.mark.parametrize("layout", ["apart", "side by side", "side by side, received first", "stacked"])
@pytest.mark.parametrize("direction", [1, -1])
def test_a_virtual_ring_answers_each_receive_with_the_block_a_right_ring_brings(layout, direction):
    """The members the rank plays in the memory case: the block a neighbour holds at each step, laid out as the
    student's own sends of the first step lay out its own block (or K-then-V / side by side when it receives first)."""
    from course_lib.classroom.checks.virtual_ring import VirtualRing

    size, me = 6, 2
    blocks = [(torch.randn(1, 1, 3, 2, dtype=torch.float64), torch.randn(1, 1, 3, 2, dtype=torch.float64))
              for _ in range(size)]
    ring = VirtualRing(me, blocks)
    to, frm = (me + direction) % size, (me - direction) % size
    pack = {"apart": lambda k, v: [k, v], "side by side": lambda k, v: [torch.cat([k, v], -1)],
            "side by side, received first": lambda k, v: [torch.cat([k, v], -1)],
            "stacked": lambda k, v: [torch.stack([v, k])]}[layout]
    held = blocks[me]
    for step in range(1, size):
        sent = pack(*held)
        incoming = [torch.empty_like(t) for t in sent]
        works = [ring.recv([t], frm, 0) for t in incoming]
        if layout.endswith("received first") and step == 1:
            for work in works:
                work.wait()
        for t in sent:
            ring.send([t], to, 0).wait()
        for work in works:
            work.wait()
        assert all(torch.equal(got, want) for got, want in zip(incoming, pack(*blocks[(me - direction * step) % size])))
        held = blocks[(me - direction * step) % size]
