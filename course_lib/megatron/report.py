"""The Day 22 record table from training logs (Megatron-LM's or the course's).

``record_table(parsed_logs, names)`` gives one row per run with the seed's
columns -- config, TP, PP, CP, DP, micro-batches, max mem/rank, step time,
tokens/s, notes -- and ``to_markdown`` / ``to_csv`` render it.

How each number is made (so two runs are compared the same way):

* **TP, PP, CP, DP** -- from the ``using world size`` line.
* **micro-batches** -- ``global_batch_size / (micro_batch_size * DP)``; the micro-batch
  size comes from the printed arguments block (``—`` when the log has none).
* **max mem/rank (MB)** -- the largest ``max allocated`` over every memory line and
  rank: the rank closest to running out. Megatron prints memory only on
  data-parallel rank 0 of each (TP, PP) position, which covers every distinct
  model shard.
* **step time (ms)** -- the median ``elapsed time per iteration`` over the logged
  iterations **after the first**: the first logged interval pays for warm-up
  (allocator pools, kernel selection, data loading; since core 0.16 Megatron even
  logs iteration 1 alone to show it). With one logged interval, that one is used
  and the notes say so.
* **tokens/s** -- ``global_batch_size * seq_length / step time`` (every token of the
  global batch, whole cluster; ``seq_length`` from the arguments block or the
  ``seq_length=`` argument).
* **notes** -- first -> last ``lm loss``, skipped/nan iterations when non-zero,
  Megatron's own TFLOP/s/GPU when printed, lines too long to be Megatron's (skipped), then
  your note.

CLI: ``python -m course_lib report logs/day22/*.log [--csv out.csv] [--markdown out.md] [--force]``.
The tables are never written over a log being read, nor over any other existing file
without ``--force``; every check is made before a log is parsed (``course_lib.safe_files``).
A log that is not UTF-8 text, or whose ``using world size`` line is impossible, is a one-line
error naming the file.
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from course_lib import rules
from course_lib.training.logs import ParsedLog, parse_log, parse_log_file
from course_lib.safe_files import check_output_file, write_atomic  # noqa: F401  (write_atomic: re-exported)

COLUMNS = ("config", "TP", "PP", "CP", "DP", "micro-batches", "max mem/rank (MB)", "step time (ms)", "tokens/s",
           "notes")
STEP_TIME_NOTE = ("step time: median of the logged iterations after the first (warm-up excluded); "
                  "tokens/s = global batch x seq length / step time")


def _auto_notes(p: ParsedLog, n_logged: int) -> list[str]:
    notes = []
    curve = p.loss_curve()
    if curve:
        notes.append(f"lm loss {curve[0][1]:.3f} -> {curve[-1][1]:.3f}")
    skipped = sum(it.get("skipped_iterations", 0) or 0 for it in p.iterations)
    nans = sum(it.get("nan_iterations", 0) or 0 for it in p.iterations)
    if skipped:
        notes.append(f"{skipped} skipped iterations")
    if nans:
        notes.append(f"{nans} nan iterations")
    tflops = [it["throughput"] for it in p.iterations[1:] if isinstance(it.get("throughput"), (int, float))]
    if tflops:
        notes.append(f"{sorted(tflops)[len(tflops) // 2]:.1f} TFLOP/s/GPU")
    if p.long_lines_skipped:
        notes.append(f"{p.long_lines_skipped} over-long lines skipped (newlines lost?)")
    if n_logged == 0:
        notes.append("no iteration lines (crashed, OOM or still running?)")
    elif n_logged == 1:
        notes.append("only 1 logged iteration: step time includes warm-up")
    return notes


def record_row(p: ParsedLog, name: str, *, seq_length: int | None = None, note: str | None = None) -> dict:
    """One row of the record table (see the module docstring for each column)."""
    cfg = p.config
    seq = seq_length if seq_length is not None else cfg.get("seq_length")
    step = p.step_time_ms()
    gbs = cfg.get("global_batch_size")
    tokens_s = None
    if step and isinstance(gbs, int) and isinstance(seq, int):
        tokens_s = round(gbs * seq / (step / 1000.0), 1)
    mem = p.max_memory_by_rank()
    notes = _auto_notes(p, len(p.iterations)) + ([note] if note else [])
    return {
        "config": name,
        "TP": cfg.get("tp"), "PP": cfg.get("pp"), "CP": cfg.get("cp"), "DP": cfg.get("dp"),
        "micro-batches": cfg.get("num_microbatches"),
        "max mem/rank (MB)": round(max(mem.values()), 2) if mem else None,
        "step time (ms)": round(step, 2) if step is not None else None,
        "tokens/s": tokens_s,
        "notes": "; ".join(notes),
    }


def record_table(parsed_logs, names=None, *, seq_length: int | None = None, notes=None) -> list[dict]:
    """Rows (dicts keyed by ``COLUMNS``) for a list of ``ParsedLog`` (or log texts).

    ``names``: one per log (default ``"1"``, ``"2"``, ...); ``notes``: optional dict
    name -> your observation (the seed's 观察 column)."""
    logs = [p if isinstance(p, ParsedLog) else parse_log(p) for p in parsed_logs]
    names = [str(i + 1) for i in range(len(logs))] if names is None else list(names)
    if len(names) != len(logs):
        raise rules.UsageError(f"record_table got {len(logs)} logs but {len(names)} names; give one name per log")
    notes = notes or {}
    return [record_row(p, n, seq_length=seq_length, note=notes.get(n)) for p, n in zip(logs, names)]


def _fmt(col: str, v) -> str:
    if v is None:
        return "—"
    if col in ("max mem/rank (MB)", "step time (ms)") and isinstance(v, float):
        return f"{v:.1f}"
    if col == "tokens/s" and isinstance(v, (int, float)):
        return f"{v:,.0f}"
    return str(v).replace("|", "/")


def to_markdown(rows: list[dict]) -> str:
    """A Markdown table with the seed's columns (``—`` for unknown values)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(_fmt(c, r.get(c)) for c in COLUMNS) + " |")
    return "\n".join(lines) + "\n"


def to_csv(rows: list[dict]) -> str:
    """CSV with the same columns (empty cells for unknown values)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n", extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({c: ("" if r.get(c) is None else r.get(c)) for c in COLUMNS})
    return buf.getvalue()


# ---- CLI: python -m course_lib report LOG... ------------------------------------------------

def add_arguments(parser) -> None:
    parser.description = "Read training logs (Megatron-LM or course) into the Day 22 record table."
    parser.add_argument("logs", nargs="+", metavar="LOG", help="log files; the config name is the file stem")
    parser.add_argument("--format", choices=("markdown", "csv"), default="markdown", help="what to print")
    parser.add_argument("--markdown", metavar="PATH", help="also write the Markdown table here")
    parser.add_argument("--csv", metavar="PATH", help="also write the CSV table here")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing --markdown/--csv file (never one of the LOGs)")
    parser.add_argument("--seq-length", type=int, default=None,
                        help="sequence length when the logs do not print Megatron's arguments block")


def _check_outputs(args, logs: list[Path]) -> dict[str, Path]:
    """``{flag: path}`` of the tables to write, each checked before any log is parsed."""
    outputs = {}
    for flag, value in (("--markdown", args.markdown), ("--csv", args.csv)):
        if value is not None:
            outputs[flag] = check_output_file(value, force=args.force, inputs=logs, what=flag)
    if len(outputs) == 2 and outputs["--markdown"].resolve() == outputs["--csv"].resolve():
        raise rules.UsageError(f"--markdown and --csv are the same file ({args.csv}); give each table its own name")
    return outputs


def run(args) -> int:
    paths = [Path(p) for p in args.logs]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise rules.UsageError(f"no such log file: {', '.join(missing)}")
    if args.seq_length is not None:
        rules.integer("--seq-length", args.seq_length)
    outputs = _check_outputs(args, paths)
    rows = record_table([parse_log_file(p) for p in paths], [p.stem for p in paths], seq_length=args.seq_length)
    md, table_csv = to_markdown(rows), to_csv(rows)
    if "--markdown" in outputs:
        write_atomic(outputs["--markdown"], md + "\n" + STEP_TIME_NOTE + "\n")
    if "--csv" in outputs:
        write_atomic(outputs["--csv"], table_csv)
    if args.format == "csv":
        print(table_csv, end="")
    else:
        print(md + "\n" + STEP_TIME_NOTE)
    return 0
