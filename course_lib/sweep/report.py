"""The Day 22 sweep's tables, plots and the seed's deliverable (``day22_megatron_3d4d.md``),
all from the JSON summaries that :mod:`course_lib.sweep` writes.

A sweep summary may carry ``sources``: the runs its rows come from, each with its status
(``finished``, ``interrupted``, ``running``). Then every table says which run each row comes
from (a ``run`` column, or ``run NAME`` in the record table's notes) and the Markdown starts
with one line per run, so rows of different runs, or of an interrupted one, never pass unnoticed.
"""

from __future__ import annotations

from typing import Sequence

from course_lib.megatron import to_markdown
from course_lib.megatron.report import STEP_TIME_NOTE
from course_lib.sweep.runs import MB, SHARDED_CONFIGS, kind_order, model_of


# ============================================================================ runs


def _has_runs(summaries: Sequence[dict]) -> bool:
    return any("run" in s for s in summaries)


def run_label(config_summary: dict, sources: Sequence[dict] = ()) -> str:
    """``run NAME``, plus the run's status when it did not finish (``run NAME (interrupted)``)."""
    run = config_summary.get("run") or "unknown"
    status = next((src["status"] for src in sources if src["run"] == run), None)
    return f"run {run}" if status in (None, "finished") else f"run {run} ({status})"


def run_lines(sweep: dict) -> list[str]:
    """One Markdown line per run the rows come from, saying whether it finished (``[]`` without ``sources``)."""
    sources = sweep.get("sources") or []
    lines = [f"Rows come from {len(sources)} runs (the latest result of each config):"] if len(sources) > 1 else []
    for src in sources:
        lines.append(("- " if len(sources) > 1 else "") + _run_sentence(src, len(sources) > 1))
    return lines


def _run_sentence(src: dict, name_rows: bool) -> str:
    done = ", ".join(src["done"]) or "no config"
    if src["status"] == "finished":
        text = f"Run `{src['run']}` finished: {done}"
    elif src["status"] == "running":
        text = f"Run `{src['run']}` was still running when this was written (done so far: {done})"
    elif src["status"] == "interrupted":
        missing = [n for n in src["planned"] if n not in src["done"]]
        text = (f"**Run `{src['run']}` was interrupted after configs {done}**: {src['stopped_by']}"
                + (f"; not run: {', '.join(missing)}" if missing else ""))
    else:
        text = f"Run `{src['run']}`: written before the sweep recorded its runs"
    if name_rows:
        text += f"; rows here: {', '.join(src['rows']) or 'none'}"
    return text + "."


def labelled_rows(sweep: dict) -> list[dict]:
    """The record table's rows, each noting the run it comes from when the summary records runs."""
    rows = []
    for s in sweep["configs"]:
        row = dict(s["row"])
        if "run" in s:
            label = run_label(s, sweep.get("sources") or ())
            row["notes"] = f"{row['notes']}; {label}" if row.get("notes") else label
        rows.append(row)
    return rows


def runs_caption(sweep: dict) -> str:
    """A plot's caption naming the runs its bars come from (``""`` without ``sources``)."""
    parts = []
    for src in sweep.get("sources") or ():
        state = "" if src["status"] == "finished" else f" ({src['status']})"
        parts.append(f"run {src['run']}{state}: {', '.join(src['rows'])}")
    return "; ".join(parts)


# ============================================================================ tables


def comm_table(summaries: Sequence[dict], key: str = "sent_bytes", sources: Sequence[dict] = ()
               ) -> tuple[list[str], list[list]]:
    """Header and rows: per config, MB per iteration by process group (max over ranks); a last
    ``run`` column when the summaries record their run."""
    kinds = sorted({k for s in summaries for k in s["comm_per_iteration"]}, key=kind_order)
    with_run = _has_runs(summaries)
    rows = []
    for s in summaries:
        c = s["comm_per_iteration"]
        rows.append([s["name"]] + [round(c[k][key] / MB, 3) if k in c else None for k in kinds]
                    + ([run_label(s, sources)] if with_run else []))
    return ["config"] + kinds + (["run"] if with_run else []), rows


def comm_markdown(summaries: Sequence[dict], key: str = "sent_bytes", sources: Sequence[dict] = ()) -> str:
    head, rows = comm_table(summaries, key, sources)
    what = ("MB one rank sends per iteration (ring model), busiest rank" if key == "sent_bytes"
            else "MB of collective tensors per iteration (full-tensor convention), busiest rank")
    lines = [f"{what}, by process group:", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join("—" if v is None else (f"{v:.3f}" if isinstance(v, float) else str(v))
                                       for v in r) + " |")
    return "\n".join(lines) + "\n"


def comm_csv(summaries: Sequence[dict], key: str = "sent_bytes", sources: Sequence[dict] = ()) -> str:
    head, rows = comm_table(summaries, key, sources)
    lines = [",".join(head)] + [",".join("" if v is None else str(v) for v in r) for r in rows]
    return "\n".join(lines) + "\n"


def bubble_markdown(summaries: Sequence[dict], sources: Sequence[dict] = ()) -> str:
    with_run = _has_runs(summaries)
    head = "| config | PP | micro-batches | (p-1)/m | measured (last iteration) |" + (" run |" if with_run else "")
    lines = [head, "|---|---|---|---|---|" + ("---|" if with_run else "")]
    for s in summaries:
        b = s["bubble"]
        meas = "—" if b["measured"] is None else f"{b['measured']:.3f}"
        run = f" {run_label(s, sources)} |" if with_run else ""
        lines.append(f"| {s['name']} | {s['pp']} | {s['micro_batches']} | {b['formula']:.3f} | {meas} |{run}")
    return "\n".join(lines) + "\n"


def _settings(world_size: int, launcher: str, iters: int, m: dict) -> str:
    return (f"{m['num_layers']} layers, hidden {m['hidden_size']}, {m['num_attention_heads']} heads, "
            f"sequence {m['seq_length']}, micro-batch {m['micro_batch_size']}, global batch {m['global_batch_size']}; "
            f"{world_size} ranks ({launcher}), {iters} iterations")


def settings_line(sweep: dict) -> str:
    """What the rows were run with: one line, or each config's own when the rows' runs differ."""
    each = {s["name"]: _settings(s["world_size"], s["launcher"], s["iters"], model_of(s))
            for s in sweep["configs"]}
    if len(set(each.values())) > 1:
        return ("**Settings differ between rows** (compare them with care): "
                + "; ".join(f"{n}: {text}" for n, text in each.items()) + ".")
    return f"Model: {_settings(sweep['world_size'], sweep['launcher'], sweep['iters'], sweep['model'])} per config;"


def summary_markdown(sweep: dict, with_runs: bool = True) -> str:
    """The record table, communication and bubble tables of a sweep summary, as Markdown; first
    (``with_runs``) the runs its rows come from and whether each finished."""
    rows = labelled_rows(sweep)
    sources = sweep.get("sources") or ()
    heading = run_lines(sweep) + [""] if with_runs and sources else []
    parts = heading + [
        settings_line(sweep) + " memory: tracked tensor bytes (parameters + gradients + Adam state + peak saved "
        "activations).",
        "", to_markdown(rows), STEP_TIME_NOTE, "", comm_markdown(sweep["configs"], sources=sources),
        "Pipeline bubble (idle / useful time, 1F1B):", "", bubble_markdown(sweep["configs"], sources),
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
    worlds = " / ".join(str(w) for w in sorted({s["world_size"] for s in cfgs}))
    out = ["# Day 22 · 3D/4D parallelism in practice (day22_megatron_3d4d.md)", ""]
    runs = run_lines(sweep)
    if runs:
        out += [f"> {line}" for line in runs] + [""]
    out += ["## 1. TP × PP × DP (× CP) coordinates", "",
            f"`world_size = TP × PP × CP × DP` on {worlds} ranks; Megatron's rank order `tp-cp-ep-dp-pp` "
            "(TP fastest).", ""]
    for s in cfgs:
        grid = RankGrid(s["world_size"], tp=s["tp"], pp=s["pp"], cp=s["cp"])
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
        run = f" ({run_label(s, sweep.get('sources') or ())})" if "run" in s else ""
        out.append(f"- `{log_dir}/{s['name']}.log`{run} — {r['notes']}")
    out += ["", "## 4. Metrics", "", summary_markdown(sweep, with_runs=False)]
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
    for name, (base, flags) in SHARDED_CONFIGS.items():
        if name in by and base in by:
            mine, theirs = max(by[name]["model_states_mb_per_rank"]), max(by[base]["model_states_mb_per_rank"])
            what = ("optimizer state, grads and params are" if "optim_grads_params" in flags
                    else "optimizer state is")
            lines.append(f"Sharding: {name} ({' '.join(flags)}) keeps {mine:.2f} MB of model states on its "
                         f"busiest rank, {mine / theirs:.2f}x {base}'s {theirs:.2f} MB, with the same layout: the "
                         f"DP replicas' {what} split over DP {by[name]['dp']} instead of copied.")
            dp_mb = [by[n]["comm_per_iteration"].get("dp", {}).get("sent_bytes", 0) / MB for n in (name, base)]
            if "optim_grads_params" in flags and dp_mb[1]:
                lines.append(f"Sharding's price: {name} sends {dp_mb[0]:.2f} MB per rank per iteration over DP, "
                             f"{dp_mb[0] / dp_mb[1]:.1f}x {base}'s {dp_mb[1]:.2f} MB: ZeRO-3 all-gathers every unit "
                             f"before its forward and again before its backward for each of the "
                             f"{by[name]['micro_batches']} micro-batches (1.5x an all-reduce only with one).")
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
