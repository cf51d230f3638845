"""The Day 22 sweep: the seed's configs A-F trained on 8 real ranks, read back into one record table.

    python -m course_lib sweep [--configs A,B,...] [--out logs/day22] [--iters N] [--run-name NAME]

Each config (seed 003: A 1/1/8, B 2/1/4, C 4/1/2, D 2/2/2, E 1/4/2, F 2/2/1 with CP=2 --
TP/PP/DP on 8 ranks, DP derived) trains the tiny GPT of :mod:`course_lib.train` with the
seed's shape ratios made small enough for a 2-core laptop (:data:`SWEEP_MODEL`: 8 layers,
8 heads as in the seed; hidden 64 and sequence 32 instead of 512 and 1024; micro-batch 1,
global batch 16, so every config gets the seed's GPU micro-batch count ``16 / DP``).

Config D also runs with its data-parallel state sharded (Lab 07, :data:`SHARDED_CONFIGS`):
``D-distopt`` (``--use-distributed-optimizer``, ZeRO-1) and ``D-zero3`` (``--use-megatron-fsdp
--data-parallel-sharding-strategy optim_grads_params``) -- same layout and losses, the memory
columns move (model states per rank: 16 bytes per fp32 parameter in D, 8 + 8/DP with the
distributed optimizer, 16/DP with ZeRO-3). They run by name only, so the default sweep stays the
seed's six: ``--configs all,D-distopt,D-zero3`` gives the whole Day 22 table.

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

Runs are never overwritten, and each says how it ended: a run goes to ``<out>/runs/<run-name>/``
(default name: the start time), whose ``day22_sweep.json`` says ``running`` from the start,
lists the configs done as each finishes, and ends ``finished`` or ``interrupted`` (Ctrl-C,
SIGTERM, a config's error; a run whose process was killed is found by the next sweep and
marked). Each config's ``.log``/``.json`` is written the moment it finishes, there and as
``<out>/<config>.log``/``.json`` (the newest result of each config, so ``python -m course_lib
report logs/day22/*.log`` reads the latest of every config); the tables at the top of ``<out>``
are over those latest results and say which run each row comes from. No temporary file is
left, however a sweep ends (:func:`course_lib.launch.launch` sees to it). A wrong ``--out`` is
refused before any training, and a file the sweep did not write (or that was edited since,
e.g. the deliverable's conclusions) is never replaced without ``--force``. ``--figures DIR``
also writes the committed summary (``day22_sweep.json``, the tables, the logs and the plots).

On a 2-core machine 8 ranks share 2 cores: step times measure CPU contention and gloo over
loopback as much as the model, which is why TP (many small all-reduces per layer) is so slow
there. The ordering and the reasons are the lesson, not the absolute numbers. The full sweep
(A-F, 8 ranks, torchrun, 10 iterations) takes about 3 minutes on 2 cores: about 15 s of
torchrun start-up per config plus 2-35 s of training.
"""

from __future__ import annotations

import datetime
import io
import json
import sys
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

from course_lib import rules
from course_lib.megatron import to_csv, to_markdown
from course_lib.topology.seed import SEED_SWEEP
from course_lib.megatron.report import STEP_TIME_NOTE
from course_lib.safe_files import OutputLedger, OutputPathError, check_output_dir, read_json, write_atomic
from course_lib.sweep.bookkeeping import (
    check_replaceable, now, read_run, settle_killed_runs, sigterm_raises, stop_reason, this_process)
# The parts, re-exported: ``course_lib.sweep.<name>`` is the public API (tests, Lab 05).
from course_lib.sweep.report import (  # noqa: F401
    bubble_markdown, comm_csv, comm_markdown, comm_table, conclusions, deliverable_markdown, labelled_rows,
    plot_memory_per_rank, plot_tokens_per_s, run_lines, runs_caption, summary_markdown)
from course_lib.sweep.runs import (  # noqa: F401
    COMM_KINDS, DEFAULT_ITERS, LOG_INTERVAL, MB, SETUP_SOURCES, SUMMARY_NAME, SWEEP_BATCH, SWEEP_LR,
    SHARDED_CONFIGS, SWEEP_CONFIGS, SWEEP_MODEL, WORLD_SIZE, ConfigRun, check_loss_parity, config_argv, kind_order,
    measured_timelines, model_of, parse_configs, run_config, summary_timeline, sweep_rank)

# What the sweep writes at the top of --out (besides <config>.log/.json), and beside them in each run folder.
TABLE_NAMES = ("record_table.md", "record_table.csv", "comm_by_group.md", "comm_by_group.csv", "summary.md",
               "day22_megatron_3d4d.md")
PLOT_NAMES = ("tokens_per_s.png", "memory_per_rank.png")


# ============================================================================ summaries


def summarize(runs: Sequence[ConfigRun], *, total_s: Optional[float] = None, run_name: Optional[str] = None) -> dict:
    """The JSON-able summary of a list of config runs (what ``day22_sweep.json`` holds, without the run's state)."""
    if not runs:
        raise rules.UsageError("no config was run: give at least one (e.g. --configs A)")
    first = runs[0]
    return {"run_name": run_name, "world_size": first.world_size, "iters": first.iters, "launcher": first.launcher,
            "model": dict(first.model), "total_s": None if total_s is None else round(total_s, 1),
            "configs": [r.summary() for r in runs]}


def _source(run: Optional[dict], name: Optional[str], rows: list) -> dict:
    """Where table rows come from: the run's name and state (``status`` ``unknown`` without a run summary)."""
    if run is None:
        return {"run": name or "unknown", "status": "unknown", "planned": [], "done": [], "stopped_by": None,
                "rows": rows}
    return {"run": run["run_name"], "status": run["status"], "planned": run["planned"], "done": run["done"],
            "stopped_by": run.get("stopped_by"), "rows": rows}


def _with_sources(run: dict) -> dict:
    """A run's summary, with itself as the source of its rows (what its tables are drawn from)."""
    return {**run, "sources": [_source(run, run["run_name"], list(run["done"]))]}


def latest_summary(out, current: Optional[dict] = None) -> dict:
    """The sweep summary of the newest result of every config in ``out`` (``<config>.json`` files),
    with ``sources``: the runs those results come from and how each ended (``current``: the state
    of a run in progress, newer than its file)."""
    out = Path(out)
    found = [read_json(out / f"{n}.json") for n in SWEEP_CONFIGS if (out / f"{n}.json").is_file()]
    if not found:
        raise rules.UsageError(f"no sweep results in {out}: run `python -m course_lib sweep --out {out}` first")
    rows_by_run: dict = {}
    for f in found:
        rows_by_run.setdefault(f.get("run"), []).append(f["name"])
    sources = []
    for name, rows in rows_by_run.items():
        if current is not None and name == current["run_name"]:
            run = current
        else:
            run = read_run(out / "runs" / name) if name and _valid_run_name(name) else None
        sources.append(_source(run, name, rows))
    f = found[0]
    return {"run_name": "latest of each config", "world_size": f["world_size"], "iters": f["iters"],
            "launcher": f["launcher"], "model": model_of(f), "total_s": None, "configs": found,
            "sources": sources}


# ============================================================================ files


def _table_files(sweep: dict) -> dict:
    """``{name: text}`` of a summary's tables and deliverable (:data:`TABLE_NAMES`)."""
    sources = sweep.get("sources") or ()
    rows = labelled_rows(sweep)
    files = [to_markdown(rows) + "\n" + STEP_TIME_NOTE + "\n", to_csv(rows),
             comm_markdown(sweep["configs"], sources=sources), comm_csv(sweep["configs"], sources=sources),
             summary_markdown(sweep), deliverable_markdown(sweep)]
    return dict(zip(TABLE_NAMES, files))


def _plot_files(sweep: dict, prefix: str = "") -> dict:
    """``{name: PNG bytes}`` of a summary's plots (:data:`PLOT_NAMES`), captioned with the runs they show."""
    import matplotlib.pyplot as plt

    files = {}
    caption = runs_caption(sweep)
    for name, fn in zip(PLOT_NAMES, (plot_tokens_per_s, plot_memory_per_rank)):
        fig = fn(sweep["configs"])
        if caption:
            fig.text(0.005, 0.005, caption, fontsize=7, color="#555555", ha="left", va="bottom")
        fig.tight_layout(rect=(0, 0.04 if caption else 0, 1, 1))
        png = io.BytesIO()
        fig.savefig(png, dpi=110)
        plt.close(fig)
        files[prefix + name] = png.getvalue()
    return files


def _top_level_names(names: Sequence[str]) -> list[str]:
    return [f"{n}.{ext}" for n in names for ext in ("log", "json")] + list(TABLE_NAMES) + list(PLOT_NAMES)


def _save_state(run_dir: Path, run: dict) -> None:
    write_atomic(run_dir / SUMMARY_NAME, json.dumps(run, indent=1) + "\n")


def _record_config(result: ConfigRun, run: dict, out: Path, run_dir: Path, own: OutputLedger) -> None:
    """Write one finished config everywhere at once: its log and JSON (the run's and the latest),
    the run's state, and the text tables (the plots wait for the end of the run)."""
    summary = {**result.summary(), "run": run["run_name"]}
    files = {f"{result.name}.log": result.log, f"{result.name}.json": json.dumps(summary, indent=1) + "\n"}
    for name, data in files.items():
        write_atomic(run_dir / name, data)
    own.write(files)
    run["configs"].append(summary)
    run["done"].append(result.name)
    _save_state(run_dir, run)
    _write_tables(run, out, run_dir, own, plots=False)


def _write_run_tables(run: dict, run_dir: Path, plots: bool = True) -> None:
    """A run's own tables (and plots), in its folder; nothing before its first config."""
    if run["configs"]:
        sweep = _with_sources(run)
        for name, data in {**_table_files(sweep), **(_plot_files(sweep) if plots else {})}.items():
            write_atomic(run_dir / name, data)


def _write_tables(run: dict, out: Path, run_dir: Path, own: OutputLedger, plots: bool = True) -> None:
    """The run's tables in its folder, and the tables over the latest result of every config in ``out``."""
    _write_run_tables(run, run_dir, plots)
    if any((out / f"{n}.json").is_file() for n in SWEEP_CONFIGS):
        sweep = latest_summary(out, current=run)
        own.write({**_table_files(sweep), **(_plot_files(sweep) if plots else {})})


# ============================================================================ the sweep


def _progress(done: int, total: int, elapsed: float, width: int = 24) -> str:
    filled = round(width * done / total)
    eta = "" if done == 0 or done == total else f", ~{elapsed / done * (total - done):.0f} s left"
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total} configs, {elapsed:.0f} s{eta}"


MAX_RUN_NAME = 100   # a folder name (the file system allows 255 bytes; runs/<name>/<config>.log must fit too)


def _valid_run_name(name: str) -> bool:
    return (bool(name) and len(name) <= MAX_RUN_NAME and name.isascii()
            and name.replace("-", "").replace("_", "").replace(".", "").isalnum() and name[0] != ".")


def _make_run_dir(out: Path, run_name: Optional[str]) -> Path:
    """Create ``out/runs/<run_name>`` (default: the start time, made unique); refuse one that exists."""
    if run_name is None:
        base = run_name = datetime.datetime.now().strftime("run-%Y%m%d-%H%M%S")
        suffix = 2
        while (out / "runs" / run_name).exists():                # two runs in the same second
            run_name, suffix = f"{base}-{suffix}", suffix + 1
    run_dir = out / "runs" / run_name
    if run_dir.exists():
        raise rules.UsageError(f"run {run_name!r} already exists ({run_dir}); runs are never overwritten: "
                               f"choose another --run-name")
    try:
        run_dir.mkdir(parents=True)
    except OSError as exc:
        raise OutputPathError(f"--out {out}: cannot create the run folder {run_dir} ({exc.strerror or exc}); "
                              f"choose another --out") from None
    return run_dir


def _check_before_training(names: Sequence[str], out, iters, timeout, run_name: Optional[str], world_size: int,
                           force: bool, model: dict) -> tuple[Path, OutputLedger, Path]:
    """Every check a sweep makes before its first launch (one-line ``ValueError`` s); returns
    ``out``, its own files, and the new run's folder (created last)."""
    rules.integer("--iters", iters)
    rules.timeout_seconds("--timeout", timeout)
    for n in names:
        config_argv(n, world_size=world_size, iters=iters, **model)
    if run_name is not None and not _valid_run_name(run_name):
        raise rules.UsageError(f"--run-name {run_name[:40]!r}{'...' if len(run_name) > 40 else ''} may only use letters, "
                               f"digits, '-', '_' and '.' (not first), at most {MAX_RUN_NAME} of them")
    out = check_output_dir(out, what="--out")
    own = OutputLedger(out)
    check_replaceable(own, _top_level_names(names), force=force, what="--out")
    return out, own, _make_run_dir(out, run_name)


def run_sweep(configs: Optional[Sequence[str]] = None, *, out="logs/day22", iters: int = DEFAULT_ITERS,
              run_name: Optional[str] = None, launcher: str = "torchrun", world_size: int = WORLD_SIZE,
              timeout: float = 600, progress: bool = True, stream=None, force: bool = False,
              runner: Callable[..., ConfigRun] = run_config, **model) -> dict:
    """Run ``configs`` (default A-F) one after the other; write logs, tables and plots; return the
    run's summary (its state, ``configs`` as in :func:`summarize`, ``sources``, plus ``run_dir``
    and ``runs``: the :class:`ConfigRun` objects).

    Layout under ``out``: ``runs/<run_name>/`` (this run: ``day22_sweep.json`` with its state,
    ``<config>.log``/``.json``, tables, plots), and ``<config>.log``/``.json`` plus tables over the
    latest result of every config. Everything is checked before the first launch: the configs,
    that ``out`` can be written, that the run name is new, and that no file the sweep would
    replace at the top of ``out`` is someone else's (``force=True`` replaces it anyway). However
    the run ends (Ctrl-C, SIGTERM, a config's error) its state says so before the exception goes
    on. ``runner`` trains one config (default :func:`run_config`; tests pass a stand-in).
    """
    names = list(configs) if configs is not None else list(SEED_SWEEP)
    out, own, run_dir = _check_before_training(names, out, iters, timeout, run_name, world_size, force, model)
    stream = stream or sys.stdout

    def say(text):
        if progress:
            print(text, file=stream, flush=True)

    for killed_dir, killed in settle_killed_runs(out):
        _write_run_tables(killed, killed_dir)
        say(f"run {killed['run_name']} was killed before it finished: marked interrupted in {killed_dir}")
    run = {"run_name": run_dir.name, "status": "running", "started": now(), "ended": None,
           "process": this_process(), "planned": names, "done": [], "stopped_by": None,
           "world_size": world_size, "iters": iters, "launcher": launcher,
           "model": {**SWEEP_MODEL, **SWEEP_BATCH, **model}, "total_s": None, "configs": []}
    _save_state(run_dir, run)
    results, start = [], time.perf_counter()
    say(f"sweep {run['run_name']}: {len(names)} configs on {world_size} ranks ({launcher}), {iters} iterations "
        f"each -> {run_dir}")
    try:
        with sigterm_raises():
            for i, n in enumerate(names):
                tp, pp, cp = SWEEP_CONFIGS[n]
                say(f"{_progress(i, len(names), time.perf_counter() - start)}  running {n}: TP {tp} x PP {pp} x "
                    f"CP {cp} x DP {rules.data_parallel_size(world_size, tp, pp, cp)}")
                result = runner(n, world_size=world_size, iters=iters, launcher=launcher, timeout=timeout, **model)
                _record_config(result, run, out, run_dir, own)
                results.append(result)
                say(f"{_progress(i + 1, len(names), time.perf_counter() - start)}  {n} took {result.wall_s:.1f} s")
            run.update(status="finished", ended=now(), total_s=round(time.perf_counter() - start, 1))
            _write_tables(run, out, run_dir, own)
            _save_state(run_dir, run)                   # the "finished" marker: written last
    except BaseException as exc:
        run.update(status="interrupted", stopped_by=stop_reason(exc), ended=now(),
                   total_s=round(time.perf_counter() - start, 1))
        _save_state(run_dir, run)
        try:
            _write_tables(run, out, run_dir, own)
        except Exception as err:                        # noqa: BLE001 - the original exception matters more
            say(f"could not rewrite the tables: {err}")
        say(f"sweep {run['run_name']} interrupted after {', '.join(run['done']) or 'no config'} "
            f"({run['stopped_by']}); marked in {run_dir / SUMMARY_NAME}, finished configs are in {out}")
        raise
    say(f"sweep done: {len(names)} config{'s' if len(names) > 1 else ''} in {run['total_s']:.1f} s")
    return {**_with_sources(run), "run_dir": str(run_dir), "runs": results}


# ============================================================================ publishing


def publish_names(config_names: Sequence[str]) -> list[str]:
    """The files :func:`publish` writes (relative to its folder) for these configs."""
    return ([SUMMARY_NAME, "day22_record_table.md", "day22_record_table.csv", "day22_comm_by_group.csv",
             "day22_megatron_3d4d.md"] + [f"day22_logs/{n}.log" for n in config_names]
            + [f"day22_{n}" for n in PLOT_NAMES])


def publish(sweep: dict, folder, log_dir, force: bool = False) -> list[Path]:
    """Write the committed summary into ``folder`` (e.g. ``figures/``): ``day22_sweep.json``, the
    tables, the deliverable ``day22_megatron_3d4d.md``, the plots and the logs (``day22_logs/<config>.log``).

    Files there are replaced only if the sweep wrote them (or ``force``); checked before anything is written.
    A config whose log is not in ``log_dir`` keeps the one committed in ``folder/day22_logs`` (rows
    carried over by :func:`add_to_committed`)."""
    folder = check_output_dir(folder, what="--figures")
    own = OutputLedger(folder)
    check_replaceable(own, publish_names([s["name"] for s in sweep["configs"]]), force=force, what="--figures")
    data = {k: v for k, v in sweep.items() if k not in ("run_dir", "runs", "process")}
    rows = labelled_rows(sweep)
    files = {SUMMARY_NAME: json.dumps(data, indent=1) + "\n",
             "day22_record_table.md": summary_markdown(sweep),
             "day22_record_table.csv": to_csv(rows),
             "day22_comm_by_group.csv": comm_csv(sweep["configs"], sources=sweep.get("sources") or ()),
             "day22_megatron_3d4d.md": deliverable_markdown(sweep, str(folder / "day22_logs"))}
    for s in sweep["configs"]:
        log = Path(log_dir) / f"{s['name']}.log"
        log = log if log.is_file() else Path(folder) / "day22_logs" / f"{s['name']}.log"
        files[f"day22_logs/{s['name']}.log"] = log.read_text()
    files.update(_plot_files(sweep, prefix="day22_"))
    return own.write(files)


def add_to_committed(sweep: dict, folder=None) -> dict:
    """The committed summary in ``folder`` (default ``figures/``) with ``sweep``'s configs added at the
    end (a committed row of the same name is replaced): what ``--figures DIR --add`` publishes, so new
    rows (e.g. ``D-distopt``, ``D-zero3``) join the Day 22 table without re-running A-F. Every row
    keeps the run it comes from, and the tables say so (their step times come from different runs)."""
    old = committed_summary(folder)
    names = [s["name"] for s in sweep["configs"]]
    kept = [{**s, "run": s.get("run") or old["run_name"]} for s in old["configs"] if s["name"] not in names]
    sources = [src for src in old.get("sources") or () if src["run"] != sweep["run_name"]]
    if not sources and kept:
        sources = [{"run": old["run_name"], "status": "finished", "planned": [s["name"] for s in old["configs"]],
                    "done": [s["name"] for s in old["configs"]], "stopped_by": None, "rows": []}]
    for src in sources:
        src["rows"] = [s["name"] for s in kept if s["run"] == src["run"]]
    new = [{**s, "run": s.get("run") or sweep["run_name"]} for s in sweep["configs"]]
    return {**sweep, "run_name": f"{old['run_name']} + {sweep['run_name']}", "total_s": None,
            "configs": kept + new,
            "sources": [src for src in sources if src["rows"]] + list(sweep.get("sources") or ())}


def _committed_rows_not_in(folder, names: Sequence[str]) -> list[str]:
    """The configs of the summary committed in ``folder`` that ``names`` does not run ([] without one)."""
    try:
        return [s["name"] for s in committed_summary(folder)["configs"] if s["name"] not in names]
    except ValueError:
        return []


def committed_summary(folder=None) -> dict:
    """The committed full sweep (``figures/day22_sweep.json``, written by ``make sweep``)."""
    folder = Path(folder) if folder is not None else Path(__file__).resolve().parents[2] / "figures"
    path = folder / SUMMARY_NAME
    if not path.is_file():
        raise rules.UsageError(f"no committed sweep at {path}: run `make sweep` (python -m course_lib sweep --figures "
                               f"{folder})")
    return read_json(path)


def write_figures(out_dir, sweep: Optional[dict] = None) -> list[Path]:
    """The sweep's plots (``day22_tokens_per_s.png``, ``day22_memory_per_rank.png``) from the committed
    summary (no training: ``make sweep`` refreshes the numbers); nothing when none is committed."""
    if sweep is None:
        try:
            sweep = committed_summary()
        except ValueError:
            return []
    return [write_atomic(Path(out_dir) / name, png) for name, png in _plot_files(sweep, prefix="day22_").items()]


# ============================================================================ CLI


def add_arguments(parser) -> None:
    parser.description = ("Train the tiny GPT under the Day 22 configs A-F on real ranks; save each log, the "
                          "record table, communication by group, the bubble and plots.")
    parser.add_argument("--configs", default=None,
                        help=f"comma-separated subset of {','.join(SWEEP_CONFIGS)} (default: the seed's A-F)")
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
    parser.add_argument("--add", action="store_true",
                        help="with --figures: add this run's configs to the summary committed there (replacing "
                             "rows of the same name) instead of replacing it, e.g. --configs D-distopt,D-zero3")
    parser.add_argument("--force", action="store_true",
                        help="replace files at the sweep's output names even if the sweep did not write them, "
                             "or they were edited since (e.g. a filled-in day22_megatron_3d4d.md)")


def run(args) -> int:
    names = parse_configs(args.configs)
    add = args.add
    if add and args.figures is None:
        raise rules.UsageError("--add adds this run's configs to a committed summary: give --figures DIR too")
    if args.figures is not None:                        # refused before any training, like --out
        check_output_dir(args.figures, what="--figures")
        published = [s["name"] for s in committed_summary(args.figures)["configs"]] if add else []
        check_replaceable(OutputLedger(args.figures), publish_names(list(dict.fromkeys(published + names))),
                          force=args.force, what="--figures")
    try:
        sweep = run_sweep(names, out=args.out, iters=args.iters, run_name=args.run_name, launcher=args.launcher,
                          world_size=args.nproc_per_node, timeout=args.timeout, force=args.force)
    except KeyboardInterrupt:                           # run_sweep has said where the run stopped
        return 130
    print()
    print(summary_markdown(sweep))
    print(f"logs and tables: {sweep['run_dir']} (this run), {args.out} (latest of each config)")
    if args.figures is not None:
        dropped = [] if add else _committed_rows_not_in(args.figures, names)
        if dropped:
            print(f"note: {args.figures} also held the rows {', '.join(dropped)}; this run's summary replaces it "
                  f"without them (keep them with --add, or run them too: --configs all,{','.join(dropped)})")
        for p in publish(add_to_committed(sweep, args.figures) if add else sweep, args.figures, sweep["run_dir"],
                         force=args.force):
            print(f"wrote {p}")
    print(f"sweep time: {sweep['total_s']:.1f} s ({len(names)} config(s) x {args.nproc_per_node} ranks, "
          f"{args.launcher}, {args.iters} iterations each)")
    return 0
