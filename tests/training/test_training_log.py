"""One training log (issue 35, item 4): :class:`~course_lib.training.training_log.TrainingLog` owns the
cadence, the record's series, the iteration line and the memory cadence of every loop that logs (the
course trainer, the DeepSpeed loop); the log lines themselves are checked against Megatron's parser
in tests/training/test_megatron_log_writers.py and by the trainers' own tests."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from course_lib.training.logs import parse_log
from course_lib.training.training_log import SERIES, TrainingLog

ROOT = Path(__file__).resolve().parents[2]
LOOPS = ("course_lib/train.py", "course_lib/deepspeed/engine.py")


def _run(prints: bool, capsys, iters=7, interval=3, start=0):
    record = {key: [] for key in SERIES} | {"logged": [], "moe_losses": []}
    log = TrainingLog(record, train_iters=iters, log_interval=interval, global_batch_size=4, prints=prints)
    memory = []
    for it in range(start + 1, iters + 1):
        skipped = it == 5
        log.step(lm_loss=float(it), grad_norm=0.5, learning_rate=1e-3, elapsed_ms=1.0, skipped=skipped,
                 loss_scale=1.0, moe_losses={"load_balancing_loss": 0.1 * it})
        if log.due(it):
            log.log(it, learning_rate=1e-3, grad_norm=0.5, loss_scale=1.0)
            if log.memory_due(it):
                memory.append(it)
    return record, memory, capsys.readouterr().out


def test_cadence_averages_and_the_record(capsys):
    record, memory, out = _run(True, capsys)
    assert [d["iteration"] for d in record["logged"]] == [1, 3, 6] and memory == [1, 3]
    # Megatron 0.16: iteration 1 stays in the next interval (1..3); 5 is skipped: 4 and 6 average
    assert [d["lm_loss"] for d in record["logged"]] == [1.0, 2.0, 5.0]
    assert record["logged"][1]["load_balancing_loss"] == pytest.approx(0.2)
    assert record["lm_loss"] == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0] and record["skipped"][4] is True
    assert len(record["moe_losses"]) == 7
    parsed = parse_log(out)
    assert [row["iteration"] for row in parsed.iterations] == [1, 3, 6]
    assert [row["skipped_iterations"] for row in parsed.iterations] == [0, 0, 1]
    assert parsed.iterations[1]["consumed_samples"] == 12


def test_only_the_printing_rank_prints_and_a_resume_reports_memory_once(capsys):
    record, memory, out = _run(False, capsys, start=2)
    assert out == "" and record["logged"] == [] and memory == [3]


def test_the_loops_log_through_it():
    """Neither loop writes the iteration line or keeps an interval of its own."""
    for path in LOOPS:
        tree = ast.parse((ROOT / path).read_text())
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        assert "TrainingLog" in names and not names & {"iteration_line", "LogInterval"}, path
