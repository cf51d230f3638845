"""``--eval-interval`` / ``--eval-iters``: the validation loss, as Megatron-LM's ``evaluate`` and
``evaluate_and_print_results`` (``megatron/training/training.py``) compute and print it.

Every ``--eval-interval`` iterations, and once after the last (Megatron's ``do_valid``), the model runs
``--eval-iters`` global batches of the valid split in eval mode (no dropout). Evaluation ``k`` takes
the valid samples ``[k * eval_iters * G, (k + 1) * eval_iters * G)`` (the valid iterator goes on; its
size is ``(train_iters // eval_interval + 1) * eval_iters * G``, ``course_lib.data.blend``). The loss is
the token-weighted mean over all of them (token-loss sums and counts summed over the iterations and
the dp-cp group), printed by the last rank between two dashed lines::

    ---------------------------------------------------------------------------------------
     validation loss at iteration 4 | lm loss value: 6.512345E+00 | lm loss PPL: 6.721234E+02 |
    ---------------------------------------------------------------------------------------

The course's pipeline executor has no forward-only schedule, so the schedule runs forward and
backward and the gradients are dropped (the next step starts from none); no optimizer step is taken.
Runs on the sharding engine, DeepSpeed and MoE do not evaluate (``validate_args`` says so).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.training.logs import print_line


def validation_line(prefix: str, lm_loss: float) -> str:
    """Megatron's three lines: ``' validation loss at {prefix} | lm loss value: ... | lm loss PPL: ... | '``
    between two rows of ``len + 1`` dashes."""
    text = f" validation loss at {prefix} | lm loss value: {lm_loss:.6E} | lm loss PPL: {math.exp(min(20, lm_loss)):.6E} | "
    return "\n".join(["-" * (len(text) + 1), text, "-" * (len(text) + 1)])


def evaluate(setup, dataset, eval_iters: int, evaluation: int, rank_batches, loss_fn_of, run_schedule,
             dp_kind: str) -> float | None:
    """The validation loss of evaluation number ``evaluation`` (0-based) on this rank's layout; the
    value on the last pipeline stage, None elsewhere. Collective. ``rank_batches``/``loss_fn_of``/
    ``run_schedule`` are the trainer's own (``course_lib.train``), so evaluation sees exactly the
    micro-batches, loss and schedule that training does."""
    s, config = setup, setup.config
    for chunk in s.chunks:
        chunk.eval()
    totals: list = []
    try:
        for j in range(eval_iters):
            tokens, labels = rank_batches(config, evaluation * eval_iters + j, s.groups.coords, s.seed, s.device,
                                          dataset)
            run_schedule(s, tokens, labels, loss_fn_of(s, totals))
    finally:
        for p in s.params:
            p.grad = None
        for chunk in s.chunks:
            chunk.train()
    if not s.groups.is_last_stage:
        return None
    both = torch.stack([sum(t for t, _ in totals), sum(n for _, n in totals)]).to(s.device)
    comm.all_reduce(both, s.groups.dp_cp, kind=dp_kind, direction="fwd", source="loss_reduction")
    return float(both[0] / both[1])


def evaluate_and_print(setup, dataset, eval_iters: int, evaluation: int, prefix: str, record: dict, **trainer) -> None:
    """:func:`evaluate`, then the last rank prints Megatron's lines and keeps ``{"prefix", "lm_loss"}``
    in ``record["validation"]``."""
    loss = evaluate(setup, dataset, eval_iters, evaluation, **trainer)
    if dist.get_rank() == dist.get_world_size() - 1:
        print_line(validation_line(prefix, loss))
        record.setdefault("validation", []).append({"prefix": prefix, "lm_loss": loss})
