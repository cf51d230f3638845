"""One Day 22 config: its command line, the work each rank does, and the run's summary.

See :mod:`course_lib.sweep` for how the sweep uses it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

from course_lib.megatron import record_table
from course_lib.topology.seed import SEED_SWEEP
from course_lib.training.logs import parse_log
from course_lib.topology import ParallelConfig
from course_lib.rules import UsageError


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
# Config D (TP 2, PP 2, DP 2) again with its DP state sharded (Lab 07, course_lib.distributed through
# course_lib.train's Megatron flags): the distributed optimizer (ZeRO-1) and Megatron-FSDP's ZeRO-3.
# Not in the default sweep (A-F, the seed's); run them by name: --configs D,D-distopt,D-zero3.
SHARDED_CONFIGS = {
    "D-distopt": ("D", ("--use-distributed-optimizer",)),
    "D-zero3": ("D", ("--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
                      "--ckpt-format", "fsdp_dtensor")),
}
SWEEP_CONFIGS = {**SEED_SWEEP, **{name: SEED_SWEEP[base] for name, (base, _) in SHARDED_CONFIGS.items()}}
"""Every config the sweep can run: ``{name: (tp, pp, cp)}``, the seed's A-F then :data:`SHARDED_CONFIGS`."""


# ============================================================================ one config


def parse_configs(text: Optional[str]) -> list[str]:
    """``"A,C"`` -> ``["A", "C"]`` (order kept as given; ``None``/``"all"`` -> the seed's A-F; the
    sharded variants of :data:`SHARDED_CONFIGS` only by name: ``"D,D-zero3"``, or ``"all,D-distopt,D-zero3"``
    for the whole Day 22 table)."""
    if text is None or text.strip().lower() in ("", "all"):
        return list(SEED_SWEEP)
    canonical = {n.upper(): n for n in SWEEP_CONFIGS}
    names = []
    for item in (n.strip() for n in text.split(",") if n.strip()):
        names += list(SEED_SWEEP) if item.lower() == "all" else [canonical.get(item.upper(), item)]
    if not names:
        raise UsageError(f"--configs {text!r} names no config; give at least one (e.g. --configs A,D, or all)")
    bad = [n for n in names if n not in SWEEP_CONFIGS]
    if bad:
        raise UsageError(f"unknown config {', '.join(bad)}: the sweep has {', '.join(SWEEP_CONFIGS)} "
                         f"(e.g. --configs A,D)")
    if len(set(names)) != len(names):
        raise UsageError(f"--configs {text} names a config twice; give each once")
    return names


def sweep_config(name: str, *, world_size: int = WORLD_SIZE, iters: int = DEFAULT_ITERS,
                 log_interval: int = LOG_INTERVAL, **model) -> tuple[list[str], ParallelConfig]:
    """Config ``name``'s ``course_lib.train`` (Megatron) flags and its validated layout for ``world_size`` ranks.

    ``model`` overrides :data:`SWEEP_MODEL` / :data:`SWEEP_BATCH` entries (e.g. ``hidden_size=128``).
    Validated once, here (:func:`course_lib.train.validate_args`): a layout that cannot run raises
    its one-line ``ValueError``, prefixed with the config; the run reads its layout from the
    returned :class:`~course_lib.topology.ParallelConfig`.
    """
    from course_lib.train import parse_args, validate_args

    if name not in SWEEP_CONFIGS:
        raise UsageError(f"unknown config {name!r}: use one of {', '.join(SWEEP_CONFIGS)}")
    unknown = set(model) - set(SWEEP_MODEL) - set(SWEEP_BATCH)
    if unknown:
        raise UsageError(f"unknown model setting {', '.join(sorted(unknown))}: use "
                         f"{', '.join(list(SWEEP_MODEL) + list(SWEEP_BATCH))}")
    tp, pp, cp = SWEEP_CONFIGS[name]
    sizes = {**SWEEP_MODEL, **SWEEP_BATCH, **model}
    argv = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--context-parallel-size", str(cp)]
    for key, value in sizes.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    argv += ["--train-iters", str(iters), "--log-interval", str(min(log_interval, iters)), "--lr", f"{SWEEP_LR:g}",
             "--uniform-vocab-padding"]          # A-F train one model (384 vocabulary rows), compared row by row
    argv += list(SHARDED_CONFIGS.get(name, ("", ()))[1])
    try:
        config = validate_args(parse_args(argv), world_size).parallel
    except UsageError as exc:
        raise UsageError(f"config {name} (TP {tp}, PP {pp}, CP {cp}) on {world_size} ranks: {exc}") from None
    return argv, config


def config_argv(name: str, *, world_size: int = WORLD_SIZE, iters: int = DEFAULT_ITERS,
                log_interval: int = LOG_INTERVAL, **model) -> list[str]:
    """The flags of :func:`sweep_config` (checked the same way)."""
    return sweep_config(name, world_size=world_size, iters=iters, log_interval=log_interval, **model)[0]


def model_sizes(config: ParallelConfig) -> dict:
    """The model and batch sizes (:data:`SWEEP_MODEL`, :data:`SWEEP_BATCH` keys) of a validated config."""
    return {"num_layers": config.num_layers, "hidden_size": config.hidden_size,
            "num_attention_heads": config.num_attention_heads, "seq_length": config.seq_length,
            "micro_batch_size": config.micro_batch_size, "global_batch_size": config.effective_global_batch_size}


def model_of(source) -> dict:
    """The model and batch sizes of a config: a summary's ``model`` (written from its validated
    config); for a summary written before it had one, or a list of flags, read from the flags."""
    if isinstance(source, dict):
        if "model" in source:
            return dict(source["model"])
        source = source["command"].split()
    argv = list(source)
    return {k: int(argv[argv.index("--" + k.replace("_", "-")) + 1]) for k in list(SWEEP_MODEL) + list(SWEEP_BATCH)}


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
    model: dict          # the model and batch sizes of its validated config (model_sizes)

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
        return {k: out[k] for k in sorted(out, key=kind_order)}

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
            "model": dict(self.model),
            "row": row,
        }

    def row(self) -> dict:
        """This config's row of the record table (read from the log)."""
        return record_table([self.parsed()], [self.name], notes={self.name: _bubble_note(self.bubble())})[0]


def kind_order(kind: str) -> tuple:
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

    argv, cfg = sweep_config(name, world_size=world_size, iters=iters, log_interval=log_interval, **model)
    if launcher == "fork":
        from course_lib.pipeline.executor import warm_up_autograd

        warm_up_autograd()   # import backward's lazy dependencies once, not in every forked rank
    start = time.perf_counter()
    res = launch(sweep_rank, world_size=world_size, launcher=launcher, output="none", timeout=timeout, argv=argv)
    wall = time.perf_counter() - start
    tp, pp, cp = cfg.tp, cfg.pp, cfg.cp
    run = ConfigRun(name=name, tp=tp, pp=pp, cp=cp, dp=cfg.dp, world_size=world_size,
                    num_microbatches=cfg.num_microbatches, iters=iters, argv=argv, launcher=launcher, log="",
                    records=list(res), wall_s=wall, model=model_sizes(cfg))
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
        raise UsageError(f"config {run.name} logged {len(got)} losses but the reference has {len(ref)}")
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    return worst <= tol, worst
