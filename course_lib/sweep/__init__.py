"""The Day 22 sweep: the seed's configs A-F trained on 8 real ranks, read back into one record table.

    python -m course_lib sweep [--configs A,B,...] [--out logs/day22] [--iters N] [--run-name NAME]

Each config (seed 003: A 1/1/8, B 2/1/4, C 4/1/2, D 2/2/2, E 1/4/2, F 2/2/1 with CP=2 --
TP/PP/DP on 8 ranks, DP derived) trains the tiny GPT of :mod:`course_lib.train` with the
seed's shape ratios made small enough for a 2-core laptop (:data:`SWEEP_MODEL`: 8 layers,
8 heads as in the seed; hidden 64 and sequence 32 instead of 512 and 1024; micro-batch 1,
global batch 16, so every config gets the seed's GPU micro-batch count ``16 / DP``).

How a config runs, and where each number comes from
---------------------------------------------------
* **Launch**: ``launch(sweep_rank, launcher="torchrun")`` -- real ``torchrun --standalone
  --nproc-per-node 8`` processes (gloo on CPU, NCCL with a GPU per rank) -- each rank calls
  :func:`course_lib.train.pretrain`, the function ``python -m course_lib.train`` runs, so it
  prints the same Megatron log lines; the same run from a shell is the ``$ torchrun ...``
  command written at the top of each log. ``launcher="fork"`` (tests, the notebook) runs
  the same function on forked ranks. We launch ``pretrain`` rather than the ``course_lib.train``
  script because the per-rank numbers below only exist inside the processes.
* **Log** (``<config>.log``): the ranks' printed lines, rank 0 first (world line, arguments,
  parameters, memory), the last rank's iteration lines -- what ``torchrun ... | tee`` saves.
  The record table (:func:`course_lib.megatron.record_table`) is read *from these logs* with
  the parser that reads Megatron-LM's, so CPU and GPU runs land in the same table.
* **Returned by every rank** (``<config>.json``): communication per process group per
  iteration, recorded by :mod:`course_lib.comm` around ``pretrain`` -- calls, bytes of the
  full tensors (the NCCL-tests convention) and bytes this rank *sends* under the ring model
  (all-reduce ``2N(t-1)/t``, all-gather/reduce-scatter ``N(t-1)/t``, send ``N``); tracked memory
  per rank (parameters + gradients + Adam state, plus the peak bytes autograd saved for
  backward: ``source: tracked tensor bytes``, there is no CUDA allocator on CPU); the pipeline
  timeline of the last iteration, from which the **measured bubble** is
  ``(p * makespan - busy) / busy`` per pipeline (the idle-over-useful definition of
  ``(p-1)/m``; :class:`course_lib.pipeline.Timeline`), averaged over the pipelines.

Runs are never overwritten: each goes to ``<out>/runs/<run-name>/`` (default name: the start
time), and ``<out>/<config>.log`` / ``.json`` are replaced (temporary file + rename) by the
newest result of each config, so ``python -m course_lib report logs/day22/*.log`` reads the
latest of every config and an interrupted sweep keeps the configs it finished. ``--figures DIR``
also writes the committed summary (``day22_sweep.json``, the tables, the logs and the plots).

On a 2-core machine 8 ranks share 2 cores: step times measure CPU contention and gloo over
loopback as much as the model, which is why TP (many small all-reduces per layer) is so slow
there. The ordering and the reasons are the lesson, not the absolute numbers. The full sweep
(A-F, 8 ranks, torchrun, 10 iterations) takes about 3 minutes on 2 cores: about 15 s of
torchrun start-up per config plus 2-35 s of training.
"""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from course_lib.megatron import SEED_SWEEP, to_csv, to_markdown
from course_lib.megatron.report import STEP_TIME_NOTE, write_atomic
# The parts, re-exported: ``course_lib.sweep.<name>`` is the public API (tests, Lab 05).
from course_lib.sweep.report import (  # noqa: F401
    bubble_markdown, comm_csv, comm_markdown, comm_table, conclusions, deliverable_markdown,
    plot_memory_per_rank, plot_tokens_per_s, summary_markdown)
from course_lib.sweep.runs import (  # noqa: F401
    COMM_KINDS, DEFAULT_ITERS, LOG_INTERVAL, MB, SETUP_SOURCES, SUMMARY_NAME, SWEEP_BATCH, SWEEP_LR,
    SWEEP_MODEL, WORLD_SIZE, ConfigRun, check_loss_parity, config_argv, kind_order, measured_timelines,
    parse_configs, run_config, summary_timeline, sweep_rank)


# ============================================================================ the sweep


def summarize(runs: Sequence[ConfigRun], *, total_s: Optional[float] = None, run_name: Optional[str] = None) -> dict:
    """The JSON-able summary of a sweep (what ``day22_sweep.json`` holds)."""
    if not runs:
        raise ValueError("no config was run: give at least one (e.g. --configs A)")
    first = runs[0]
    model = {**SWEEP_MODEL, **SWEEP_BATCH}
    argv = first.argv
    for key in model:
        flag = "--" + key.replace("_", "-")
        model[key] = int(argv[argv.index(flag) + 1])
    return {"run_name": run_name, "world_size": first.world_size, "iters": first.iters, "launcher": first.launcher,
            "model": model, "total_s": None if total_s is None else round(total_s, 1),
            "configs": [r.summary() for r in runs]}


def _progress(done: int, total: int, elapsed: float, width: int = 24) -> str:
    filled = round(width * done / total)
    eta = "" if done == 0 or done == total else f", ~{elapsed / done * (total - done):.0f} s left"
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} configs, {elapsed:.0f} s{eta}"


def _write_run(run: ConfigRun, out: Path, run_dir: Path) -> list[Path]:
    data = json.dumps(run.summary(), indent=1) + "\n"
    written = []
    for folder in (run_dir, out):                       # the run, then the latest copy (atomic replace)
        written.append(write_atomic(folder / f"{run.name}.log", run.log))
        written.append(write_atomic(folder / f"{run.name}.json", data))
    return written


def _write_tables(sweep: dict, folder: Path, prefix: str = "") -> list[Path]:
    rows = [s["row"] for s in sweep["configs"]]
    paths = [write_atomic(folder / f"{prefix}record_table.md", to_markdown(rows) + "\n" + STEP_TIME_NOTE + "\n"),
             write_atomic(folder / f"{prefix}record_table.csv", to_csv(rows)),
             write_atomic(folder / f"{prefix}comm_by_group.md", comm_markdown(sweep["configs"])),
             write_atomic(folder / f"{prefix}comm_by_group.csv", comm_csv(sweep["configs"])),
             write_atomic(folder / f"{prefix}summary.md", summary_markdown(sweep)),
             write_atomic(folder / "day22_megatron_3d4d.md", deliverable_markdown(sweep))]
    paths += _save_plots(sweep["configs"], folder, prefix)
    return paths


def _save_plots(summaries, folder: Path, prefix: str = "") -> list[Path]:
    import matplotlib.pyplot as plt

    paths = []
    for name, fn in (("tokens_per_s", plot_tokens_per_s), ("memory_per_rank", plot_memory_per_rank)):
        fig = fn(summaries)
        fig.tight_layout()
        path = folder / f"{prefix}{name}.png"
        tmp = folder / f".{prefix}{name}.tmp.png"
        fig.savefig(tmp, dpi=110)
        tmp.replace(path)
        plt.close(fig)
        paths.append(path)
    return paths


def latest_summary(out) -> dict:
    """The sweep summary of the newest result of every config in ``out`` (``<config>.json`` files)."""
    out = Path(out)
    found = [json.loads((out / f"{n}.json").read_text()) for n in SEED_SWEEP if (out / f"{n}.json").is_file()]
    if not found:
        raise ValueError(f"no sweep results in {out}: run `python -m course_lib sweep --out {out}` first")
    f = found[0]
    return {"run_name": "latest of each config", "world_size": f["world_size"], "iters": f["iters"],
            "launcher": f["launcher"], "model": _model_of(f), "total_s": None, "configs": found}


def _model_of(config_summary: dict) -> dict:
    argv = config_summary["command"].split()
    return {k: int(argv[argv.index("--" + k.replace("_", "-")) + 1]) for k in list(SWEEP_MODEL) + list(SWEEP_BATCH)}


def run_sweep(configs: Optional[Sequence[str]] = None, *, out="logs/day22", iters: int = DEFAULT_ITERS,
              run_name: Optional[str] = None, launcher: str = "torchrun", world_size: int = WORLD_SIZE,
              timeout: float = 600, progress: bool = True, stream=None, **model) -> dict:
    """Run ``configs`` (default A-F) one after the other; write logs, tables and plots; return the summary
    (:func:`summarize`, plus ``run_dir`` and ``runs``: the :class:`ConfigRun` objects).

    Layout under ``out``: ``runs/<run_name>/`` (this run: ``<config>.log``/``.json``, tables, plots,
    ``day22_sweep.json``), and ``<config>.log``/``.json`` plus tables over the latest result of
    every config. A run name that already holds one of these configs is refused (nothing is
    overwritten). Bad configs fail before anything starts, all of them checked first.
    """
    names = list(configs) if configs is not None else list(SEED_SWEEP)
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"--iters={iters!r} must be an integer >= 1")
    for n in names:                                     # every config checked before the first launch
        config_argv(n, world_size=world_size, iters=iters, **model)
    out = Path(out)
    run_name = run_name or datetime.datetime.now().strftime("run-%Y%m%d-%H%M%S")
    if not run_name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        raise ValueError(f"--run-name {run_name!r} may only use letters, digits, '-', '_' and '.'")
    run_dir = out / "runs" / run_name
    taken = [n for n in names if (run_dir / f"{n}.log").exists()]
    if taken:
        raise ValueError(f"run {run_name!r} already has {', '.join(taken)} in {run_dir}; runs are never "
                         f"overwritten: choose another --run-name")
    stream = stream or sys.stdout

    def say(text):
        if progress:
            print(text, file=stream, flush=True)

    runs, start = [], time.perf_counter()
    say(f"sweep {run_name}: {len(names)} configs on {world_size} ranks ({launcher}), {iters} iterations each "
        f"-> {run_dir}")
    try:
        for i, n in enumerate(names):
            tp, pp, cp = SEED_SWEEP[n]
            say(f"{_progress(i, len(names), time.perf_counter() - start)}  running {n}: TP {tp} x PP {pp} x CP {cp} "
                f"x DP {world_size // (tp * pp * cp)}")
            run = run_config(n, world_size=world_size, iters=iters, launcher=launcher, timeout=timeout, **model)
            _write_run(run, out, run_dir)
            runs.append(run)
            say(f"{_progress(i + 1, len(names), time.perf_counter() - start)}  {n} took {run.wall_s:.1f} s")
    except BaseException:
        if runs:                                        # a config failed or was interrupted: keep the finished
            _write_tables(latest_summary(out), out)
            say(f"sweep stopped after {', '.join(r.name for r in runs)}; their logs and tables are in {out}")
        raise
    total = time.perf_counter() - start
    sweep = summarize(runs, total_s=total, run_name=run_name)
    write_atomic(run_dir / SUMMARY_NAME, json.dumps(sweep, indent=1) + "\n")
    _write_tables(sweep, run_dir)
    _write_tables(latest_summary(out), out)
    sweep["run_dir"] = str(run_dir)
    sweep["runs"] = runs                                # the ConfigRun objects (not written to JSON)
    say(f"sweep done: {len(names)} config{'s' if len(names) > 1 else ''} in {total:.1f} s")
    return sweep


def publish(sweep: dict, folder, log_dir) -> list[Path]:
    """Write the committed summary into ``folder`` (e.g. ``figures/``): ``day22_sweep.json``, the
    tables, the deliverable ``day22_megatron_3d4d.md``, the plots and the logs (``day22_logs/<config>.log``)."""
    folder = Path(folder)
    data = {k: v for k, v in sweep.items() if k not in ("run_dir", "runs")}
    paths = [write_atomic(folder / SUMMARY_NAME, json.dumps(data, indent=1) + "\n")]
    rows = [s["row"] for s in sweep["configs"]]
    paths += [write_atomic(folder / "day22_record_table.md", summary_markdown(sweep)),
              write_atomic(folder / "day22_record_table.csv", to_csv(rows)),
              write_atomic(folder / "day22_comm_by_group.csv", comm_csv(sweep["configs"])),
              write_atomic(folder / "day22_megatron_3d4d.md", deliverable_markdown(sweep, str(folder / "day22_logs")))]
    for s in sweep["configs"]:
        src = Path(log_dir) / f"{s['name']}.log"
        paths.append(write_atomic(folder / "day22_logs" / f"{s['name']}.log", src.read_text()))
    paths += write_figures(folder, sweep)
    return paths


def committed_summary(folder=None) -> dict:
    """The committed full sweep (``figures/day22_sweep.json``, written by ``make sweep``)."""
    folder = Path(folder) if folder is not None else Path(__file__).resolve().parents[2] / "figures"
    path = folder / SUMMARY_NAME
    if not path.is_file():
        raise ValueError(f"no committed sweep at {path}: run `make sweep` (python -m course_lib sweep --figures "
                         f"{folder})")
    return json.loads(path.read_text())


def write_figures(out_dir, sweep: Optional[dict] = None) -> list[Path]:
    """The sweep's plots (``day22_tokens_per_s.png``, ``day22_memory_per_rank.png``) from the committed
    summary (no training: ``make sweep`` refreshes the numbers); nothing when none is committed."""
    out_dir = Path(out_dir)
    if sweep is None:
        try:
            sweep = committed_summary()
        except ValueError:
            return []
    out_dir.mkdir(parents=True, exist_ok=True)
    return _save_plots(sweep["configs"], out_dir, prefix="day22_")


# ============================================================================ CLI


def add_arguments(parser) -> None:
    parser.description = ("Train the tiny GPT under the Day 22 configs A-F on real ranks; save each log, the "
                          "record table, communication by group, the bubble and plots.")
    parser.add_argument("--configs", default=None, help="comma-separated subset of A,B,C,D,E,F (default: all)")
    parser.add_argument("--out", default="logs/day22", type=Path, help="output folder (default logs/day22)")
    parser.add_argument("--iters", type=int, default=DEFAULT_ITERS, help=f"--train-iters per config "
                                                                       f"(default {DEFAULT_ITERS})")
    parser.add_argument("--run-name", default=None, help="name of this run (default: its start time); runs "
                                                         "are kept under OUT/runs/NAME")
    parser.add_argument("--nproc-per-node", type=int, default=WORLD_SIZE, help="ranks (default 8, the seed's)")
    parser.add_argument("--launcher", choices=("torchrun", "fork"), default="torchrun",
                        help="torchrun (default: real torchrun processes) or fork (faster start)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per config before it is declared hung")
    parser.add_argument("--figures", type=Path, default=None,
                        help="also write the committed summary (json, tables, logs, plots) into this folder")


def run(args) -> int:
    names = parse_configs(args.configs)
    sweep = run_sweep(names, out=args.out, iters=args.iters, run_name=args.run_name, launcher=args.launcher,
                      world_size=args.nproc_per_node, timeout=args.timeout)
    print()
    print(summary_markdown(sweep))
    print(f"logs and tables: {sweep['run_dir']} (this run), {args.out} (latest of each config)")
    if args.figures is not None:
        for p in publish(sweep, args.figures, sweep["run_dir"]):
            print(f"wrote {p}")
    print(f"sweep time: {sweep['total_s']:.1f} s ({len(names)} config(s) x {args.nproc_per_node} ranks, "
          f"{args.launcher}, {args.iters} iterations each)")
    return 0
