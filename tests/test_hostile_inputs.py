"""Hostile input, by area: every case gets one line naming the rule or the file, exit code 2, and nothing
written or lost. Each case here was a traceback, a silent success or an overwritten file before.

The commands run in this process (``course_lib.__main__.main``), so the module stays fast.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest

from course_lib import rules, safe_files
from course_lib.__main__ import main
from course_lib.launch import launch

ROOT = Path(__file__).resolve().parents[1]


def one_line_error(capsys, argv, *needles):
    """Run ``python -m course_lib ARGV``: exit code 2 and one stderr line holding every needle, no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


# ---- one bounded JSON reader ----------------------------------------------------------------

@pytest.mark.parametrize("text, says", [
    ("[" * 100_000 + "]" * 100_000, "nested more than 100 levels"),   # RecursionError in json's C scanner
    ("[" * 150 + "]" * 150, "nested more than 100 levels"),           # parses, but too deep to handle later
    ('{"stage": 1, "stage": 3}', "the key 'stage' appears twice"),
    ('{"lr": NaN}', "NaN is not a JSON number"),
    ('{"lr": -Infinity}', "-Infinity is not a JSON number"),
    ('{"lr": ', "not valid JSON (line 1"),
])
def test_read_json_refuses_in_one_line_naming_the_file(tmp_path, text, says):
    path = tmp_path / "config.json"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        safe_files.read_json(path, what="--deepspeed-config")
    message = str(info.value)
    assert message.startswith(f"--deepspeed-config {path}: ") and says in message and "\n" not in message


def test_read_json_bounds_size_and_encoding(tmp_path, monkeypatch):
    path = tmp_path / "big.json"
    path.write_bytes(b'{"a": "' + b"x" * 2000 + b'"}')
    monkeypatch.setattr(safe_files, "MAX_JSON_BYTES", 1000)
    with pytest.raises(ValueError, match="more than the 1000 this course reads"):
        safe_files.read_json(path)
    path.write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ValueError, match="not UTF-8"):
        safe_files.read_json(path)


def test_read_json_reads_what_we_write(tmp_path):
    value = {"cells": [{"source": ["a", "b"], "outputs": []}], "nbformat": 4, "x": [[[1.5]]]}
    (tmp_path / "ok.json").write_text(json.dumps(value))
    assert safe_files.read_json(tmp_path / "ok.json") == value
    with pytest.raises(ValueError, match="cannot read it"):
        safe_files.read_json(tmp_path / "missing.json")


def test_a_solution_notebook_with_nan_or_deep_nesting_is_refused_not_published(tmp_path, capsys):
    solutions, labs = tmp_path / "solutions", tmp_path / "labs"
    solutions.mkdir()
    (solutions / "00_x.ipynb").write_text('{"cells": [], "metadata": {"v": NaN}, "nbformat": 4, "nbformat_minor": 5}')
    one_line_error(capsys, ["labs", "--solutions", str(solutions), "--labs", str(labs)], "00_x.ipynb", "NaN")
    assert not (labs / "00_x.ipynb").exists()
    (solutions / "00_x.ipynb").write_text('{"cells": ' + "[" * 5000 + "]" * 5000 + "}")
    one_line_error(capsys, ["labs", "--solutions", str(solutions), "--labs", str(labs)], "nested more than")
    assert not (labs / "00_x.ipynb").exists()


# ---- the output ledger only rewrites a file it created ---------------------------------------

@pytest.mark.parametrize("command", ["figures", "site"])
def test_a_foreign_course_outputs_json_is_never_overwritten(tmp_path, capsys, command):
    out = tmp_path / "out"
    out.mkdir()
    mine = out / ".course_outputs.json"
    for content in ("my notes, not JSON\n", '{"figure.png": "not a hash"}\n', "[1, 2]\n"):
        mine.write_text(content)
        one_line_error(capsys, [command, "--out", str(out)], str(mine), "not a course_lib output ledger")
        assert mine.read_text() == content and sorted(p.name for p in out.iterdir()) == [".course_outputs.json"]


def test_our_own_ledger_still_opens():
    ledger = safe_files.OutputLedger(ROOT / "figures")  # the committed one
    assert ledger.hashes and all(len(h) == 64 for h in ledger.hashes.values())


# ---- command-line values ---------------------------------------------------------------------

@pytest.mark.parametrize("value, says", [("", "name a lab"), ("²", "no such lab")])
def test_workspace_fresh_names_the_lab_problem(tmp_path, capsys, value, says):
    one_line_error(capsys, ["workspace", "--labs", str(ROOT / "labs"), "--dir", str(tmp_path / "ws"), "--fresh", value],
                   says)
    assert not (tmp_path / "ws").exists() or not any((tmp_path / "ws").iterdir())


def test_report_refuses_a_negative_sequence_length(capsys):
    log = sorted((ROOT / "tests" / "fixtures" / "megatron_logs").iterdir())[0]
    one_line_error(capsys, ["report", str(log), "--seq-length", "-5"], "--seq-length=-5 must be an integer >= 1")


@pytest.mark.parametrize("argv, says", [
    (["--configs", ",,,"], "names no config"),
    (["--configs", "A", "--timeout", "1e-9"], "shorter than a rendezvous takes"),
    (["--configs", "A", "--timeout", "nan"], "--timeout=nan must be"),
    (["--configs", "A", "--iters", "0"], "--iters=0 must be an integer >= 1"),
    (["--configs", "A", "--run-name", "a" * 300], "--run-name 'aaaa"),        # was blamed on --out
])
def test_sweep_refuses_before_making_a_run_folder(tmp_path, capsys, argv, says):
    out = tmp_path / "day22"
    one_line_error(capsys, ["sweep", *argv, "--out", str(out)], says)
    assert not out.exists()


def test_launch_sizes_and_timeouts_come_from_the_rule_book():
    assert rules.launch_ranks("world_size", 8) == 8
    for value, says in ((2**70, "more processes than one machine runs"), (10**5, "1024 at most"),
                        (0, "must be an integer >= 1"), (True, "must be an integer")):
        with pytest.raises(ValueError, match=says):
            rules.launch_ranks("world_size", value)
    assert rules.timeout_seconds("timeout", 60) == 60.0
    for value, says in ((0.001, "shorter than a rendezvous"), (0, "must be in"), (float("inf"), "must be in"),
                        (10**9, "must be in")):
        with pytest.raises(ValueError, match=says):
            rules.timeout_seconds("timeout", value)


# ---- a torchrun launch refuses an argument its ranks could not receive, before anything starts -----------

class _FromANotebook:
    pass


_FromANotebook.__module__ = "__main__"  # as if defined in a notebook cell: pickled by a name the ranks lack


@pytest.mark.parametrize("value, says", [
    (lambda: 0, "argument value=<lambda> is a lambda; "),
    ([1, {"f": lambda: 0}], "argument value (a list) holds <lambda>, which is a lambda; "),
    (threading.Lock(), "argument value (a lock) cannot be pickled (cannot pickle '_thread.lock' object); "),
    (_FromANotebook(), "argument value (a _FromANotebook) holds _FromANotebook, which is defined in a notebook cell"),
])
def test_torchrun_refuses_an_argument_that_cannot_travel_in_one_line(tmp_path, monkeypatch, value, says):
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # nothing started: no job folder made either
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    monkeypatch.setattr(sys.modules["__main__"], "_FromANotebook", _FromANotebook, raising=False)
    with pytest.raises(ValueError) as info:
        launch(print, world_size=2, launcher="torchrun", value=value)
    message = str(info.value)
    assert says in message and "\n" not in message, message
    assert "pass a function defined at the top of a module file, or another picklable value" in message
    assert not any(tmp_path.iterdir())


# ---- the trainer's command line ------------------------------------------------------------------

@pytest.mark.parametrize("argv, says", [
    (["--distributed-timeout-minutes", "1e-9"], "distributed_timeout_minutes=1e-09 is shorter than a rendezvous"),
    (["--num-experts", "1048576"], "1048576 experts per MoE layer"),
])
def test_train_refuses_before_any_rank_starts(capsys, argv, says):
    one_line_error(capsys, ["train", "--nproc-per-node", "2", *argv], says)


@pytest.mark.parametrize("pattern, says", [
    ("+".join(["[1]*1000000"] * 60), "expands past 10000 layers"),   # was 41 s and 1.6 GB before the refusal
    ("+".join(["[1]"] * 300), "at most 1000 characters"),           # a long + chain was a RecursionError
    ("+".join(["[1]"] * 240), None),                                  # long, but a real pattern: accepted
])
def test_moe_layer_freq_is_bounded(capsys, pattern, says):
    """argparse reports a bad --moe-layer-freq (its usage line, then our reason on the error line)."""
    from course_lib.moe.pattern import parse_moe_layer_freq

    if says is None:
        assert parse_moe_layer_freq(pattern) == [1] * 240
        return
    with pytest.raises(SystemExit) as info:
        main(["train", "--nproc-per-node", "2", "--num-experts", "4", "--moe-layer-freq", pattern])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert says in [line for line in err.splitlines() if "error:" in line][0]


def test_train_refuses_nccl_without_a_gpu_per_rank(capsys):
    import torch

    if torch.cuda.device_count() >= 2:
        pytest.skip("this machine has a GPU per rank")
    one_line_error(capsys, ["train", "--nproc-per-node", "2", "--distributed-backend", "nccl"],
                   "backend='nccl' needs one GPU per rank")
