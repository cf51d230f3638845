"""Checker for the bucketed gradient all-reduce of data parallelism (Lab 00, exercise 3).

``check_grad_sync(fn)``: ``fn(model, bucket_numel)`` averages the data-parallel gradients with one
all-reduce per bucket (PyTorch DDP / CS336's bucketed DDP; Megatron's
``megatron/core/distributed/param_and_grad_buffer.py``): each rank trains on samples it draws from
``os.urandom`` (no rank can rebuild another's gradients); checked against the average of the ranks'
own gradients (the checker's all-reduce, after the student's) *and* by what crossed the wire: the
bucket count and sizes, and each all-reduce carrying this rank's gradients, on 2 and 4 checked ranks
(:func:`course_lib.classroom.checks.collectives.launch_trials`).

It prints one verdict line ("not attempted yet" while the stub raises NotImplementedError) and, when
wrong, the most specific hint it can find.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from course_lib.classroom.checks.collectives import course_code_used, launch_trials, student_trial
from course_lib.classroom.checks.exercise import exercise
from course_lib.classroom.checks.references import references_for
from course_lib.classroom.checks.verdicts import (collectives as collective_events, describe_ops, drawn_rng,
                                                  secret_generator)

GLOBAL_BATCH = 16
BUCKETS = (40, 1000, 8)  # elements per bucket: several buckets, one bucket, one tensor per bucket
FILLED = (35, 83)
"""``bucket_numel`` values the gradients fill exactly, in reverse order (3 + 24 + 8, then the whole model): a
bucket of exactly ``bucket_numel`` elements still takes its last gradient (``<=``). 27 = 3 + 24 is one too, but
there an answer off by one sends one tensor per bucket, which has a hint of its own."""


def drawn_buckets(rng) -> tuple:
    """This run's ``bucket_numel`` values, one of each kind of :data:`BUCKETS` for the 83-parameter model:
    several buckets, everything in one, one bucket per tensor (each gradient is larger than the bucket).
    One of the first two (each as likely) is a size the gradients fill exactly (:data:`FILLED`), the other
    with odds 1/2, so that an answer off by one there (a new bucket when the next gradient would *fill* the
    bucket, ``<`` for ``<=``) fails every run."""
    on = rng.randrange(2)
    several = FILLED[0] if on == 0 or rng.random() < 0.5 else rng.randint(27, 82)
    one = FILLED[1] if on == 1 or rng.random() < 0.5 else rng.randint(84, 5000)
    return several, one, rng.randint(1, 2)


def grad_sync_model() -> torch.nn.Module:
    """The small model of the exercise (same weights on every rank): 83 parameters in 4 tensors."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def grad_sync_batch():
    """The global batch ``(x [16, 6], y [16, 3])``; rank r of W trains on rows ``r*16/W ... (r+1)*16/W``."""
    g = torch.Generator().manual_seed(1)
    return torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def expected_buckets(sizes: list, bucket_numel: int) -> list:
    """Bucket sizes (elements) when the gradients of ``sizes`` (in ``model.parameters()`` order) are packed
    in *reverse* order, a new bucket starting whenever the next gradient would overflow ``bucket_numel``."""
    buckets: list = []
    for n in reversed(sizes):
        if buckets and buckets[-1] + n <= bucket_numel:
            buckets[-1] += n
        else:
            buckets.append(n)
    return buckets


def baseline_gradients() -> dict:
    """Gradients of the mean loss over the whole global batch in one process: what every rank must end with."""
    model = grad_sync_model()
    x, y = grad_sync_batch()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _rank_grad_sync_trial(fn, buckets):
    world = dist.get_world_size()
    secret = secret_generator()              # this rank's samples: no other rank can rebuild them
    x, y = torch.randn(GLOBAL_BATCH // world, 6, generator=secret), torch.randn(GLOBAL_BATCH // world, 3, generator=secret)
    results = []
    for bucket_numel in buckets:
        model = grad_sync_model()
        torch.nn.functional.mse_loss(model(x), y).backward()
        local = {n: p.grad.clone() for n, p in model.named_parameters()}
        trial = student_trial(fn, model, bucket_numel, references=references_for("sync_gradients"))
        grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in model.named_parameters()}
        reference = {n: g.clone() for n, g in local.items()}
        for g in reference.values():             # the truth: the checker's own all-reduce, after the student's
            dist.all_reduce(g)
            g /= world
        results.append(dict(trial, bucket_numel=bucket_numel, grads=grads, local=local, reference=reference))
    return results


def _carried_local_grads(t: dict, world: int) -> bool:
    """Did the all-reduces carry this rank's own gradients, every element once (or each divided by W)?
    Compared as the multiset of values sent, so any order inside a bucket counts."""
    sent = [c.reshape(-1) for e, c in zip(t["events"], t["carried"]) if e.op == "all_reduce" and c is not None]
    if len(sent) != sum(e.op == "all_reduce" for e in t["events"]):
        return True  # too large to keep a copy: judged by the sizes alone
    mine = torch.cat([g.reshape(-1) for g in t["local"].values()]).sort().values
    sent = torch.cat(sent).sort().values if sent else torch.empty(0)
    return sent.numel() == mine.numel() and any(torch.allclose(sent, mine * c, rtol=1e-6, atol=1e-9)
                                                for c in (1.0, 1.0 / world))


def _close(a, b) -> bool:
    return a is not None and a.shape == b.shape and torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def _grad_value_hint(trials: list, reference: dict, world: int) -> str:
    t = trials[0]
    names = list(reference)
    if all(_close(t["grads"][n], t["local"][n]) for n in names):
        return ("the gradients are still this rank's own (computed on its 16/W samples): all-reduce them over "
                "the data-parallel group")
    if all(_close(t["grads"][n], reference[n] * world) for n in names):
        return ("W times too large: all-reduce sums the ranks' gradients; each rank's loss is a mean over its own "
                "samples, so divide by W to get the gradient of the global batch's mean loss")
    wrong = [n for n in names if not _close(t["grads"][n], reference[n])]
    return (f"{', '.join(wrong)} differ from the single-process gradients: every gradient element must be "
            f"all-reduced exactly once (and divided by W), then copied back into its param.grad")


@exercise("sync_gradients")
def check_grad_sync(fn, timeout: float = 20) -> bool:
    """``fn(model, bucket_numel)`` must average every ``param.grad`` over the ranks with one all-reduce per
    bucket (buckets filled in reverse parameter order, at most ``bucket_numel`` elements unless one
    gradient alone is larger)."""
    sizes = [p.numel() for p in grad_sync_model().parameters()]
    buckets = drawn_buckets(drawn_rng())
    for world in (2, 4):
        per_rank, verdict = launch_trials(_rank_grad_sync_trial, world, timeout, "sync_gradients", fn=fn,
                                           buckets=buckets)
        if per_rank is None:
            return verdict
        if course_code_used(per_rank):
            return False
        for i, bucket_numel in enumerate(buckets):
            trials = [per_rank[r][i] for r in range(world)]
            for rank, t in enumerate(trials):
                reference = t["reference"]
                if not all(_close(t["grads"][n], g) for n, g in reference.items()):
                    print(f"✗ with {world} ranks and bucket_numel={bucket_numel}, rank {rank}'s gradients differ "
                          f"from the single-process baseline (the mean loss over all {GLOBAL_BATCH} samples)")
                    print(f"  hint: {_grad_value_hint([t], reference, world)}")
                    return False
            ops = collective_events(trials[0]["events"])
            got = [e.numel for e in ops if e.op == "all_reduce"]
            want = expected_buckets(sizes, bucket_numel)
            lying = next((r for r, t in enumerate(trials) if not _carried_local_grads(t, world)), None)
            if got == want and len(ops) == len(got) and lying is not None:
                print(f"✗ the gradients are right with {world} ranks and bucket_numel={bucket_numel}, but rank "
                      f"{lying}'s all-reduces did not carry its own gradients\n  hint: each bucket's all-reduce "
                      f"must carry this rank's gradients of that bucket (flattened into one buffer): the sum over "
                      f"the ranks is what turns {GLOBAL_BATCH}/W samples' gradients into the global batch's")
                return False
            if got == want and len(ops) == len(got):
                continue
            print(f"✗ the gradients are right with {world} ranks and bucket_numel={bucket_numel}, but it ran "
                  f"{describe_ops(ops)}: not one all-reduce per bucket")
            if len(ops) != len(got):
                hint = "use only all_reduce (one per bucket) on the data-parallel group"
            elif sum(got) != sum(sizes):
                hint = (f"{sum(got)} elements went through all-reduce but the model has {sum(sizes)}: every "
                        f"gradient element exactly once")
            elif got == sizes or got == sizes[::-1]:
                hint = (f"that is one all-reduce per parameter tensor ({len(sizes)} calls): pack the gradients into "
                        f"buckets (torch.cat of the flattened grads) of at most bucket_numel elements -- fewer, "
                        f"larger messages")
            elif got == [sum(sizes)]:
                hint = ("one all-reduce of everything ignores bucket_numel: start a new bucket when the next "
                        "gradient would overflow it (DDP does, to overlap communication with the backward)")
            elif got == expected_buckets(sizes[::-1], bucket_numel):
                hint = ("those are buckets in model.parameters() order: fill them in reverse, the order backward "
                        "produces the gradients, so the last layer's bucket can be sent first")
            elif got == expected_buckets(sizes, bucket_numel - 1):
                hint = ("you start a new bucket when the next gradient would fill the current one to exactly "
                        "bucket_numel: it still fits -- a bucket holds at most bucket_numel elements (<=), and a "
                        "new one starts only when the next gradient would *exceed* it")
            else:
                hint = ("go through the gradients in reverse parameter order; add each to the current bucket unless "
                        "it would exceed bucket_numel, else start a new bucket (a gradient larger than the bucket "
                        "gets one of its own)")
            print(f"  hint: {hint}")
            return False
    print("✓ sync_gradients gives every rank the single-process gradients on 2 and 4 ranks, with one all-reduce "
          "per bucket (buckets filled in reverse parameter order) for three bucket_numel values drawn for this run: "
          "several buckets, one bucket, one gradient per bucket")
    return True
