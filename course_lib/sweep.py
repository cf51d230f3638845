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
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from course_lib.megatron import SEED_SWEEP, parse_log, record_table, to_csv, to_markdown
from course_lib.megatron.report import STEP_TIME_NOTE
from course_lib.megatron.report import write_atomic

WORLD_SIZE = 8
# The seed's GPU model is 8 layers, hidden 512, 8 heads, sequence 1024: same depth and heads
# (so TP = 1/2/4/8 and PP = 1/2/4 divide), hidden and sequence cut for 2 CPU cores.
SWEEP_MODEL = {"num_layers": 8, "hidden_size": 64, "num_attention_heads": 8, "seq_length": 32}
# micro 1 x global 16: micro-batches = 16 / DP, the seed GPU batch's count (4 x 16 = 64, micro 4).
SWEEP_BATCH = {"micro_batch_size": 1, "global_batch_size": 16}
SWEEP_LR = 1e-3
DEFAULT_ITERS = 10
LOG_INTERVAL = 2
COMM_KINDS = ("tp", "cp", "pp", "dp", "dp-cp", "embedding", "tp-pp")   # display order
MB = 1024.0 * 1024.0
SUMMARY_NAME = "day22_sweep.json"


# ============================================================================ one config


def parse_configs(text: Optional[str]) -> list[str]:
    """``"A,C"`` -> ``["A", "C"]`` (seed order kept as given; ``None``/``"all"`` -> A-F)."""
    if text is None or text.strip().lower() in ("", "all"):
        return list(SEED_SWEEP)
    names = [n.strip().upper() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in SEED_SWEEP]
    if bad:
        raise ValueError(f"unknown config {', '.join(bad)}: the seed's sweep has {', '.join(SEED_SWEEP)} "
                         f"(e.g. --configs A,D)")
    if len(set(names)) != len(names):
        raise ValueError(f"--configs {text} names a config twice; give each once")
    return names


def config_argv(name: str, *, world_size: int = WORLD_SIZE, iters: int = DEFAULT_ITERS,
                log_interval: int = LOG_INTERVAL, **model) -> list[str]:
    """The ``course_lib.train`` (Megatron) flags of config ``name``, checked for ``world_size`` ranks.

    ``model`` overrides :data:`SWEEP_MODEL` / :data:`SWEEP_BATCH` entries (e.g. ``hidden_size=128``).
    A layout that cannot run raises the one-line ``ValueError`` of :func:`course_lib.train.validate_args`.
    """
    from course_lib.train import parse_args, validate_args

    if name not in SEED_SWEEP:
        raise ValueError(f"unknown config {name!r}: use one of {', '.join(SEED_SWEEP)}")
    unknown = set(model) - set(SWEEP_MODEL) - set(SWEEP_BATCH)
    if unknown:
        raise ValueError(f"unknown model setting {', '.join(sorted(unknown))}: use "
                         f"{', '.join(list(SWEEP_MODEL) + list(SWEEP_BATCH))}")
    tp, pp, cp = SEED_SWEEP[name]
    sizes = {**SWEEP_MODEL, **SWEEP_BATCH, **model}
    argv = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--context-parallel-size", str(cp)]
    for key, value in sizes.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    argv += ["--train-iters", str(iters), "--log-interval", str(min(log_interval, iters)), "--lr", f"{SWEEP_LR:g}"]
    try:
        validate_args(parse_args(argv), world_size)
    except ValueError as exc:
        raise ValueError(f"config {name} (TP {tp}, PP {pp}, CP {cp}) on {world_size} ranks: {exc}") from None
    return argv


# Collectives issued once while the model is built, not in every iteration (Megatron's
# setup_embeddings_and_output_layer copies the first stage's word embeddings to the last stage).
SETUP_SOURCES = ("sync_tied_embeddings",)


def sweep_rank(argv: Sequence[str]) -> dict:
    """One rank of a sweep run (importable, so torchrun can run it): :func:`course_lib.train.pretrain`
    inside a :class:`course_lib.comm.CommRecorder`. Returns pretrain's record plus

    * ``comm_per_iteration = {group kind: {"calls", "bytes", "sent_bytes"}}``: the training
      iterations' collectives divided by the number of iterations (receives are counted at
      the sender), checked against the last iteration's bytes that pretrain records itself;
    * ``comm_setup = {group kind: bytes}``: the one-time collectives of model set-up.
    """
    from course_lib.comm import CommRecorder
    from course_lib.train import parse_args, pretrain

    args = parse_args(list(argv))
    with CommRecorder() as rec:
        record = pretrain(args)
    per: dict = {}
    setup: dict = {}
    for e in rec.events:
        if e.op == "recv":
            continue
        if e.source in SETUP_SOURCES:
            setup[e.kind] = setup.get(e.kind, 0) + e.bytes
            continue
        d = per.setdefault(e.kind, {"calls": 0, "bytes": 0, "sent_bytes": 0.0})
        d["calls"] += 1
        d["bytes"] += e.bytes
        d["sent_bytes"] += e.ring_elements_sent * (e.bytes // e.numel if e.numel else 0)
    n = args.train_iters
    record["comm_per_iteration"] = {k: {key: v / n for key, v in d.items()} for k, d in per.items()}
    record["comm_setup"] = setup
    mine = {k: d["bytes"] for k, d in record["comm_per_iteration"].items()}
    if mine != record["comm"]:
        raise RuntimeError(f"communication bookkeeping: per-iteration bytes {mine} differ from the last "
                           f"iteration's {record['comm']}; a collective outside the iterations is missing "
                           f"from SETUP_SOURCES in course_lib/sweep.py")
    return record


def measured_timelines(records: Sequence[dict], pp: int, num_microbatches: int) -> list:
    """The last iteration of every pipeline as a measured :class:`course_lib.pipeline.Timeline`
    (one per (tp, cp, dp) position; ``[]`` when pp == 1)."""
    from course_lib.pipeline import Event, Timeline, build_schedule, live_activations, parse_action

    if pp == 1:
        return []
    schedule = build_schedule("1f1b", pp, num_microbatches)
    pipelines: dict = {}
    for rec in records:
        c = rec["coords"]
        pipelines.setdefault((c["tp"], c["cp"], c["dp"]), {})[c["pp"]] = rec["pipeline_events"]
    timelines = []
    for key in sorted(pipelines):
        by_stage = pipelines[key]
        t0 = min(ev[0][2] for ev in by_stage.values() if ev)
        events = [[Event(r, parse_action(a), s, start - t0, end - t0) for a, s, start, end in by_stage[r]]
                  for r in range(pp)]
        peaks = [max(live_activations(schedule.ranks[r])) for r in range(pp)]
        timelines.append(Timeline(schedule, events, peaks, "measured", {"pipeline": key}))
    return timelines


@dataclass
class ConfigRun:
    """One config's run: its log text, every rank's returned record, and what they give."""

    name: str
    tp: int
    pp: int
    cp: int
    dp: int
    world_size: int
    num_microbatches: int
    iters: int
    argv: list
    launcher: str
    log: str
    records: list
    wall_s: float

    @property
    def command(self) -> str:
        """The shell command that reproduces this log (``torchrun ... -m course_lib.train ...``)."""
        import shlex

        return shlex.join(["torchrun", "--standalone", f"--nproc-per-node={self.world_size}",
                           "-m", "course_lib.train", *self.argv])

    def parsed(self):
        return parse_log(self.log)

    @property
    def lm_loss(self) -> list:
        """Per-iteration global-batch loss (the last rank is on the last pipeline stage)."""
        return list(self.records[-1]["lm_loss"])

    def memory_mb(self) -> dict:
        """Per rank: ``allocated`` (model states) and ``max_allocated`` (+ peak saved activations), MB."""
        return {k: [r["memory"][k] / MB for r in self.records] for k in ("allocated", "max_allocated")}

    def comm(self) -> dict:
        """``{kind: {"calls", "bytes", "sent_bytes"}}`` per iteration, each the max over ranks."""
        out: dict = {}
        for rec in self.records:
            for kind, d in rec["comm_per_iteration"].items():
                o = out.setdefault(kind, {"calls": 0.0, "bytes": 0.0, "sent_bytes": 0.0})
                for key in o:
                    o[key] = max(o[key], d[key])
        return {k: out[k] for k in sorted(out, key=_kind_order)}

    def comm_setup(self) -> dict:
        """``{kind: bytes}`` of the one-time set-up collectives (max over ranks)."""
        out: dict = {}
        for rec in self.records:
            for kind, b in rec["comm_setup"].items():
                out[kind] = max(out.get(kind, 0), b)
        return out

    def bubble(self) -> dict:
        """``formula`` (p-1)/m (1F1B) and ``measured`` (mean over pipelines of the last iteration)."""
        from course_lib.pipeline import bubble_fraction

        if self.pp == 1:
            return {"formula": 0.0, "measured": None}
        tls = measured_timelines(self.records, self.pp, self.num_microbatches)
        return {"formula": bubble_fraction(self.pp, self.num_microbatches),
                "measured": sum(t.bubble_fraction for t in tls) / len(tls)}

    def timeline_events(self) -> Optional[list]:
        """The first pipeline's last iteration, ``[[action, stage, start, end], ...]`` per pipeline
        rank, seconds from its first start (``None`` when pp == 1); :func:`summary_timeline`
        turns it back into a Timeline."""
        tls = measured_timelines(self.records, self.pp, self.num_microbatches)
        if not tls:
            return None
        return [[[str(e.action), e.stage, round(e.start, 6), round(e.end, 6)] for e in ev] for ev in tls[0].events]

    def groups(self) -> dict:
        """The process groups as the ranks of this run saw themselves (from their coordinates):
        ``{"tp"|"cp"|"dp"|"pp": [[ranks], ...]}``, each group sorted, groups sorted."""
        out = {}
        coords = [r["coords"] for r in self.records]
        for axis in ("tp", "cp", "dp", "pp"):
            found: dict = {}
            for rank, c in enumerate(coords):
                key = tuple(c[a] for a in ("tp", "cp", "dp", "pp") if a != axis)
                found.setdefault(key, []).append(rank)
            out[axis] = sorted(sorted(g) for g in found.values())
        return out

    def summary(self) -> dict:
        """Everything the tables, plots and the deliverable need, JSON-able (no log text)."""
        row = self.row()
        mem = self.memory_mb()
        return {
            "name": self.name, "tp": self.tp, "pp": self.pp, "cp": self.cp, "dp": self.dp,
            "world_size": self.world_size, "micro_batches": self.num_microbatches, "iters": self.iters,
            "launcher": self.launcher, "wall_s": round(self.wall_s, 2), "command": self.command,
            "step_time_ms": row["step time (ms)"], "tokens_per_s": row["tokens/s"],
            "max_mem_mb": row["max mem/rank (MB)"],
            "memory_mb_per_rank": [round(v, 4) for v in mem["max_allocated"]],
            "model_states_mb_per_rank": [round(v, 4) for v in mem["allocated"]],
            "params_per_rank": [r["num_parameters"] for r in self.records],
            "comm_per_iteration": self.comm(),
            "comm_setup": self.comm_setup(),
            "bubble": self.bubble(),
            "timeline": self.timeline_events(),
            "lm_loss": self.lm_loss,
            "row": row,
        }

    def row(self) -> dict:
        """This config's row of the record table (read from the log)."""
        return record_table([self.parsed()], [self.name], notes={self.name: _bubble_note(self.bubble())})[0]


def _kind_order(kind: str) -> tuple:
    return (COMM_KINDS.index(kind) if kind in COMM_KINDS else len(COMM_KINDS), kind)


def _bubble_note(b: dict) -> Optional[str]:
    if b["measured"] is None:
        return None
    return f"bubble {b['measured']:.2f} measured, {b['formula']:.3f} = (p-1)/m"


def summary_timeline(config_summary: dict):
    """The measured :class:`course_lib.pipeline.Timeline` stored in a config summary (None if pp == 1)."""
    from course_lib.pipeline import Event, Timeline, build_schedule, live_activations, parse_action

    events = config_summary.get("timeline")
    if not events:
        return None
    schedule = build_schedule("1f1b", config_summary["pp"], config_summary["micro_batches"])
    evs = [[Event(r, parse_action(a), s, start, end) for a, s, start, end in ev] for r, ev in enumerate(events)]
    peaks = [max(live_activations(schedule.ranks[r])) for r in range(schedule.pp_size)]
    return Timeline(schedule, evs, peaks, "measured", {"config": config_summary["name"]})


def run_config(name: str, *, world_size: int = WORLD_SIZE, iters: int = DEFAULT_ITERS, launcher: str = "torchrun",
               timeout: float = 600, log_interval: int = LOG_INTERVAL, **model) -> ConfigRun:
    """Train config ``name`` on ``world_size`` real ranks; return its :class:`ConfigRun`."""
    from course_lib.launch import launch
    from course_lib.train import parse_args, validate_args

    argv = config_argv(name, world_size=world_size, iters=iters, log_interval=log_interval, **model)
    args, cfg = validate_args(parse_args(argv), world_size)
    if launcher == "fork":
        from course_lib.pipeline.executor import warm_up_autograd

        warm_up_autograd()   # import backward's lazy dependencies once, not in every forked rank
    start = time.perf_counter()
    res = launch(sweep_rank, world_size=world_size, launcher=launcher, output="none", timeout=timeout, argv=argv)
    wall = time.perf_counter() - start
    tp, pp, cp = SEED_SWEEP[name]
    run = ConfigRun(name=name, tp=tp, pp=pp, cp=cp, dp=cfg.dp, world_size=world_size,
                    num_microbatches=cfg.num_microbatches, iters=iters, argv=argv, launcher=launcher, log="",
                    records=list(res), wall_s=wall)
    header = (f"# course_lib sweep: config {name} (TP {tp}, PP {pp}, CP {cp}, DP {cfg.dp}) on {world_size} ranks, "
              f"launched with {launcher}; the same run from a shell:\n$ {run.command}\n")
    run.log = header + "".join(o if o.endswith("\n") or not o else o + "\n" for o in res.outputs)
    return run


def check_loss_parity(run: ConfigRun, tol: float = 1e-4) -> tuple[bool, float]:
    """``(ok, worst relative difference)`` of the run's per-iteration loss against
    :func:`course_lib.train.train_single_process` (the dense model, one process, same global batch)."""
    from course_lib.train import parse_args, train_single_process

    ref = train_single_process(parse_args(run.argv))["lm_loss"]
    got = run.lm_loss
    if len(got) != len(ref):
        raise ValueError(f"config {run.name} logged {len(got)} losses but the reference has {len(ref)}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    return worst <= tol, worst


# ============================================================================ tables


def comm_table(summaries: Sequence[dict], key: str = "sent_bytes") -> tuple[list[str], list[list]]:
    """Header and rows: per config, MB per iteration by process group (max over ranks)."""
    kinds = sorted({k for s in summaries for k in s["comm_per_iteration"]}, key=_kind_order)
    rows = []
    for s in summaries:
        c = s["comm_per_iteration"]
        rows.append([s["name"]] + [round(c[k][key] / MB, 3) if k in c else None for k in kinds])
    return ["config"] + kinds, rows


def comm_markdown(summaries: Sequence[dict], key: str = "sent_bytes") -> str:
    head, rows = comm_table(summaries, key)
    what = ("MB one rank sends per iteration (ring model), busiest rank" if key == "sent_bytes"
            else "MB of collective tensors per iteration (full-tensor convention), busiest rank")
    lines = [f"{what}, by process group:", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join("—" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
                                       for v in r) + " |")
    return "\n".join(lines) + "\n"


def comm_csv(summaries: Sequence[dict], key: str = "sent_bytes") -> str:
    head, rows = comm_table(summaries, key)
    lines = [",".join(head)] + [",".join("" if v is None else str(v) for v in r) for r in rows]
    return "\n".join(lines) + "\n"


def bubble_markdown(summaries: Sequence[dict]) -> str:
    lines = ["| config | PP | micro-batches | (p-1)/m | measured (last iteration) |", "|---|---|---|---|---|"]
    for s in summaries:
        b = s["bubble"]
        meas = "—" if b["measured"] is None else f"{b['measured']:.3f}"
        lines.append(f"| {s['name']} | {s['pp']} | {s['micro_batches']} | {b['formula']:.3f} | {meas} |")
    return "\n".join(lines) + "\n"


def summary_markdown(sweep: dict) -> str:
    """The record table, communication and bubble tables of a sweep summary, as Markdown."""
    rows = [s["row"] for s in sweep["configs"]]
    m = sweep["model"]
    parts = [
        f"Model: {m['num_layers']} layers, hidden {m['hidden_size']}, {m['num_attention_heads']} heads, "
        f"sequence {m['seq_length']}, micro-batch {m['micro_batch_size']}, global batch {m['global_batch_size']}; "
        f"{sweep['world_size']} ranks ({sweep['launcher']}), {sweep['iters']} iterations per config; "
        f"memory: tracked tensor bytes (parameters + gradients + Adam state + peak saved activations).",
        "", to_markdown(rows), STEP_TIME_NOTE, "", comm_markdown(sweep["configs"]),
        "Pipeline bubble (idle / useful time, 1F1B):", "", bubble_markdown(sweep["configs"]),
    ]
    if sweep.get("total_s") is not None:
        n = len(sweep["configs"])
        parts.append(f"Sweep wall time: {sweep['total_s']:.0f} s for {n} config{'s' if n > 1 else ''}.")
    return "\n".join(parts) + "\n"


# ============================================================================ plots


def plot_tokens_per_s(summaries: Sequence[dict], ax=None):
    """Bar chart of tokens/s (whole job) per config; returns the Figure."""
    import matplotlib.pyplot as plt

    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(7, 3.2))
    from matplotlib.patches import Patch

    names = [s["name"] for s in summaries]
    values = [s["tokens_per_s"] or 0 for s in summaries]
    kinds = {"DP only": "#4C72B0", "TP (+DP)": "#DD8452", "PP (+TP, CP, DP)": "#55A868"}
    colors = [kinds["PP (+TP, CP, DP)"] if s["pp"] > 1 else kinds["TP (+DP)"] if s["tp"] > 1 or s["cp"] > 1
              else kinds["DP only"] for s in summaries]
    bars = ax.bar(names, values, color=colors)
    for b, s in zip(bars, summaries):
        ax.annotate(f"TP{s['tp']} PP{s['pp']}\nCP{s['cp']} DP{s['dp']}",
                    (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=7)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in kinds.items()], fontsize=8, loc="upper center")
    ax.set_ylabel("tokens/s (all ranks)")
    ax.set_title("Throughput per config (CPU, gloo: shapes, not absolute numbers)")
    ax.margins(y=0.25)
    return fig or ax.figure


def plot_memory_per_rank(summaries: Sequence[dict], ax=None):
    """Grouped bars: every rank's tracked memory per config, model states + peak activations (MB)."""
    import matplotlib.pyplot as plt

    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(9, 3.4))
    world = max(len(s["memory_mb_per_rank"]) for s in summaries)
    width = 0.8 / world
    for i, s in enumerate(summaries):
        states = s["model_states_mb_per_rank"]
        total = s["memory_mb_per_rank"]
        for r in range(len(total)):
            x = i + (r - (world - 1) / 2) * width
            ax.bar(x, states[r], width, color="#4C72B0", edgecolor="white", linewidth=0.5,
                   label="model states" if i == r == 0 else None)
            ax.bar(x, total[r] - states[r], width, bottom=states[r], color="#C44E52", edgecolor="white",
                   linewidth=0.5, label="peak saved activations" if i == r == 0 else None)
    ax.set_xticks(range(len(summaries)))
    ax.set_xticklabels([f"{s['name']}\nTP{s['tp']} PP{s['pp']} CP{s['cp']} DP{s['dp']}" for s in summaries],
                       fontsize=8)
    ax.set_ylabel("MB per rank (ranks 0..N-1)")
    ax.set_title("Memory of every rank (tracked tensor bytes, fp32 + Adam)")
    ax.legend(fontsize=8)
    return fig or ax.figure


# ============================================================================ deliverable


def deliverable_markdown(sweep: dict, log_dir: str = "logs/day22") -> str:
    """The seed's deliverable ``day22_megatron_3d4d.md``: group map, commands, logs, table, conclusions.

    Filled from a sweep summary (:func:`summarize`); the conclusions start from what the numbers
    say and leave room for your own."""
    from course_lib.megatron import gpu_config, megatron_command, sweep_script
    from course_lib.topology import RankGrid

    cfgs = sweep["configs"]
    world = sweep["world_size"]
    out = ["# Day 22 · 3D/4D parallelism in practice (day22_megatron_3d4d.md)", ""]
    out += ["## 1. TP × PP × DP (× CP) coordinates", "",
            f"`world_size = TP × PP × CP × DP` on {world} ranks; Megatron's rank order `tp-cp-ep-dp-pp` "
            "(TP fastest).", ""]
    for s in cfgs:
        grid = RankGrid(world, tp=s["tp"], pp=s["pp"], cp=s["cp"])
        axes = [a for a in ("tp", "cp", "dp", "pp") if s[a] > 1]
        groups = "; ".join(f"{a.upper()} {grid.groups(a)}" for a in axes) or "—"
        out.append(f"- **{s['name']}** TP {s['tp']} · PP {s['pp']} · CP {s['cp']} · DP {s['dp']}: {groups}")
    out += ["", "Pictures: `python -m course_lib rankmap --world-size 8 --tp 2 --pp 2 --num-layers 8 --out D.svg` "
            "(committed: `figures/rankmap_8_tp2_pp2_dp2.svg` for D, `figures/rankmap_8_tp2_pp2_cp2.svg` for F)."]
    out += ["", "## 2. Run commands", "", "CPU (this course; each log's first line repeats it):", "", "```bash"]
    out += [f"{s['command']}   # {s['name']}" for s in cfgs] + ["```", "",
                                                               "GPUs (Megatron-LM, the seed's model), e.g. config D:",
                                                               "", "```bash",
                                                               megatron_command(gpu_config(2, 2, 1, 8)), "```", "",
                                                               "The whole A–F loop:", "", "```bash", sweep_script(),
                                                               "```", ""]
    out += ["## 3. Logs", ""]
    for s in cfgs:
        r = s["row"]
        out.append(f"- `{log_dir}/{s['name']}.log` — {r['notes']}")
    out += ["", "## 4. Metrics", "", summary_markdown(sweep)]
    out += ["## 5. Conclusions (TP / PP / CP trade-offs)", ""] + [f"- {c}" for c in conclusions(cfgs)]
    out += ["- Your choice for this model and why (memory, throughput, communication, complexity): …", ""]
    return "\n".join(out)


def conclusions(summaries: Sequence[dict]) -> list[str]:
    """Sentences the measured numbers support (the notebook's analysis, in words)."""
    by = {s["name"]: s for s in summaries}
    lines = []
    tps = {n: s["tokens_per_s"] for n, s in by.items() if s["tokens_per_s"]}
    if tps:
        best, worst = max(tps, key=tps.get), min(tps, key=tps.get)
        lines.append(f"Throughput: {best} is fastest ({tps[best]:,.0f} tokens/s), {worst} slowest "
                     f"({tps[worst]:,.0f}, {tps[best] / tps[worst]:.1f}× slower): on a model this small every "
                     f"split makes the GEMMs smaller and adds communication.")
    if "A" in by and len(by) > 1:
        ref = max(by["A"]["model_states_mb_per_rank"])
        ratios = ", ".join(f"{n} {max(s['model_states_mb_per_rank']) / ref:.2f}" for n, s in by.items() if n != "A")
        lines.append(f"Memory: model states on the busiest rank, relative to A: {ratios}. TP and PP split the "
                     f"weights; DP and CP replicate them.")
    for s in summaries:
        c = {k: v for k, v in s["comm_per_iteration"].items() if k != "tp-pp"}
        if c:
            parts = ", ".join(f"{k.upper()} {v['calls']:.0f} calls / {v['sent_bytes'] / MB:.2f} MB"
                              for k, v in sorted(c.items(), key=lambda kv: -kv[1]["calls"]))
            lines.append(f"Communication per rank per iteration in {s['name']}: {parts}.")
    over = []
    for s in summaries:
        b = s["bubble"]
        if b["measured"] is not None:
            lines.append(f"Bubble: {s['name']} (PP {s['pp']}, {s['micro_batches']} micro-batches) idles "
                         f"{b['measured']:.2f} of its useful time; 1F1B predicts (p-1)/m = {b['formula']:.3f}.")
            over.append(b["measured"] > 2 * b["formula"])
    if any(over):
        lines.append("The measured idle time exceeds (p-1)/m where a stage's compute is as short as a "
                     "point-to-point message: the formula assumes compute dominates.")
    return lines


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
    folder = Path(folder) if folder is not None else Path(__file__).resolve().parent.parent / "figures"
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
