"""One training log for every loop: Megatron's ``training_log`` cadence (``megatron/training/training.py``).

:class:`TrainingLog` owns what the course trainer (:mod:`course_lib.train`) and the DeepSpeed loop
(:func:`course_lib.deepspeed.engine.pretrain`) log alike: each iteration's values in the run's record
(``lm_loss``, ``grad_norm``, ``learning_rate``, ``elapsed_ms``, ``skipped``, ``loss_scale``), the
interval's averages (:class:`LogInterval`), the iteration line every ``--log-interval`` iterations and at
the first (printed by the last rank, kept in ``record["logged"]``; its time per iteration is the
throughput the line reports), and when the memory line is due (the first two logged iterations). What
differs stays in the loop: how a step runs and what the memory line measures.
(The megatron-core cross-check, :func:`course_lib.mcore.reference.train_megatron_core`, and the
single-process reference record losses and norms only; they print no log.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from course_lib.training.logs import iteration_line, print_line

SERIES = ("lm_loss", "grad_norm", "learning_rate", "elapsed_ms", "skipped", "loss_scale")
"""The record's per-iteration lists every loop fills (the course trainer adds ``moe_losses``)."""


@dataclass
class LogInterval:
    """Megatron's ``training_log`` accumulators over one logging interval (``training.py``): the LM
    and MoE losses of the advanced iterations, the iterations run and skipped, and when the interval
    began (``time.perf_counter()`` seconds)."""

    start: float
    total_loss: float = 0.0
    advanced: int = 0
    skipped: int = 0
    total_moe: dict = field(default_factory=dict)    # Megatron's total_loss_dict for the MoE losses

    def add(self, lm_loss, skipped: bool, moe_losses: dict | None = None) -> None:
        """One iteration: its LM loss (None on a pipeline stage that has none), whether the optimizer
        skipped it, its MoE losses by name."""
        self.skipped += bool(skipped)
        if not skipped:                               # Megatron averages the advanced iterations only
            if lm_loss is not None:
                self.total_loss += lm_loss
            for name, value in (moe_losses or {}).items():
                self.total_moe[name] = self.total_moe.get(name, 0.0) + value
        self.advanced += 1

    def averages(self) -> tuple[float, dict]:
        """The LM loss and each MoE loss averaged over the advanced iterations."""
        n = max(1, self.advanced - self.skipped)
        return self.total_loss / n, {name: value / n for name, value in self.total_moe.items()}

    def elapsed_ms(self, now: float) -> float:
        """Milliseconds per iteration since the interval began."""
        return (now - self.start) * 1000.0 / max(1, self.advanced)


class TrainingLog:
    """The log of one run on this rank (see the module doc). ``record``: the run's record, whose
    :data:`SERIES` lists (and ``"logged"``, ``"moe_losses"`` when present) it appends to; ``prints``:
    whether this rank prints the iteration line (Megatron's last rank). Start it when the ranks start
    iterating (after their barrier): the first interval's time begins then."""

    def __init__(self, record: dict, *, train_iters: int, log_interval: int, global_batch_size: int, prints: bool):
        self.record, self.prints = record, prints
        self.train_iters, self.log_interval, self.global_batch_size = train_iters, log_interval, global_batch_size
        self.interval = LogInterval(time.perf_counter())
        self._memory_due = True

    def step(self, *, lm_loss, grad_norm: float, learning_rate: float, elapsed_ms: float, skipped: bool,
             loss_scale: float, moe_losses: dict | None = None) -> None:
        """One iteration's values: into the record's lists and the interval's averages."""
        values = dict(lm_loss=lm_loss, grad_norm=grad_norm, learning_rate=learning_rate, elapsed_ms=elapsed_ms,
                      skipped=skipped, loss_scale=loss_scale)
        for key in SERIES:
            self.record[key].append(values[key])
        if "moe_losses" in self.record:
            self.record["moe_losses"].append(moe_losses or {})
        self.interval.add(lm_loss, skipped, moe_losses)

    def due(self, iteration: int) -> bool:
        """Whether ``iteration`` is logged: every ``--log-interval`` and the first."""
        return iteration % self.log_interval == 0 or iteration == 1

    def log(self, iteration: int, *, learning_rate: float, grad_norm: float, loss_scale: float) -> None:
        """The iteration line of the interval ending at ``iteration`` (time per iteration, averaged
        losses, this step's learning rate, norm and loss scale), then a new interval -- except after the
        first iteration, which Megatron 0.16 logs but keeps in the interval."""
        elapsed_ms = self.interval.elapsed_ms(time.perf_counter())
        if self.prints:
            avg, moe_avg = self.interval.averages()
            g = self.global_batch_size
            print_line(iteration_line(iteration, self.train_iters, consumed_samples=iteration * g,
                                      elapsed_ms=elapsed_ms, learning_rate=learning_rate, global_batch_size=g,
                                      lm_loss=avg, grad_norm=grad_norm, loss_scale=loss_scale,
                                      skipped_iterations=self.interval.skipped, extra_losses=moe_avg))
            self.record["logged"].append(dict(iteration=iteration, lm_loss=avg, elapsed_ms=elapsed_ms,
                                              learning_rate=learning_rate, grad_norm=grad_norm, **moe_avg))
        if iteration != 1:
            self.interval = LogInterval(time.perf_counter())

    def memory_due(self, iteration: int) -> bool:
        """Whether the memory line is due at this logged ``iteration``: the first logged iteration, and
        the next one too when the first was iteration 1 (Megatron's ``report_memory_flag`` reports once)."""
        due = self._memory_due
        if due:
            self._memory_due = iteration == 1
        return due
