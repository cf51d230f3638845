"""Pictures of DeepSpeed's ZeRO-3 with offload: where a rank's state lives, and one step on the wire.

* :func:`plot_zero3_step` -- the theory picture of Lab 10 (``figures/deepspeed_zero3_offload_step.png``,
  written by :func:`write_figures`): a rank's model states on the device and on the host under the
  seed's ds_config (ZeRO-3, optimizer and param offload to CPU, bf16), and the collectives of one step
  in the order DeepSpeed issues them -- the forward's all-gathers (a module's partitioned params,
  fetched ahead up to ``stage3_prefetch_bucket_size``), the backward's reduce-scatters (gradients in
  buckets of ``reduce_bucket_size``), the optimizer step on the host, and the all-gather of the
  parameters under ``stage3_param_persistence_threshold`` that every rank keeps whole.
* :func:`plot_wire_timeline` -- a measured per-rank timeline: DeepSpeed's phases (forward, backward,
  ``engine.step()``) and a tick for every collective at the moment it was issued.
"""

from __future__ import annotations

from pathlib import Path

COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "step": "#55a868", "all_gather": "#8172b3",
          "reduce_scatter": "#c44e52", "all_reduce": "#8c564b", "broadcast": "#937860"}


def plot_zero3_step(world: int = 4):
    """The theory picture (see the module docstring) for ``world`` ranks. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyArrowPatch, Rectangle

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1, 1.8]})
    boxes = [  # (x, y, w, h, label, colour)
        (0.05, 0.62, 0.9, 0.1, f"16-bit params: 1/{world} partition (offload_param: on the host)", "#c7d4ea"),
        (0.05, 0.50, 0.9, 0.1, "params <= persistence threshold: whole, every rank", "#9db3dc"),
        (0.05, 0.38, 0.9, 0.1, "reduce bucket: reduce_bucket_size elements", "#f0b5b6"),
        (0.05, 0.06, 0.9, 0.1, f"16-bit + fp32 grads: 1/{world} partition", "#f0b5b6"),
        (0.05, 0.18, 0.9, 0.1, f"fp32 master params + Adam's 2 moments: 1/{world}", "#b9dcc0"),
    ]
    for x, y, w, h, label, colour in boxes:
        left.add_patch(Rectangle((x, y), w, h, facecolor=colour, edgecolor="black", linewidth=0.6))
        left.text(x + w / 2, y + h / 2, label, ha="center", va="center", fontsize=7.5)
    left.text(0.5, 0.77, "device (GPU) of rank r", ha="center", fontsize=9, weight="bold")
    left.text(0.5, 0.31, "host (CPU memory) of rank r: offload_optimizer", ha="center", fontsize=9, weight="bold")
    left.axhline(0.345, color="grey", linestyle="--", linewidth=0.8)
    left.set_xlim(0, 1), left.set_ylim(0, 0.85), left.axis("off")
    left.set_title("where one rank's model states live (seed: ZeRO-3 + CPU offload)", fontsize=9)

    steps = [("forward", 0.0, 3.0), ("backward", 3.0, 6.2), ("step", 6.2, 8.0)]
    for kind, a, b in steps:
        right.add_patch(Rectangle((a, 2.1), b - a - 0.05, 0.5, facecolor=COLORS[kind], alpha=0.85))
        right.text((a + b) / 2, 2.35, kind if kind != "step" else "step: Adam on host",
                   ha="center", va="center", fontsize=8, color="white", weight="bold")
    for op, label, xs, text, centre in (
            ("all_gather", "all-gather\nmodule", (0.1, 0.8, 1.5, 2.2),
             "each module's partitioned params,\nfetched ahead up to\nstage3_prefetch_bucket_size", 1.5),
            ("reduce_scatter", "reduce-\nscatter", (3.3, 4.1, 4.9, 5.7),
             "gradients as they become ready,\none call per bucket of\nreduce_bucket_size elements", 4.6)):
        for i, x in enumerate(xs):
            right.add_patch(FancyArrowPatch((x, 1.6), (x + 0.42, 1.6), arrowstyle="-|>", color=COLORS[op],
                                            mutation_scale=8))
            right.text(x + 0.21, 1.3, f"{label} {i + 1}", ha="center", fontsize=6.5)
        right.text(centre, 0.8, text, ha="center", fontsize=6.5)
    right.add_patch(FancyArrowPatch((6.5, 1.6), (7.6, 1.6), arrowstyle="-|>", color=COLORS["all_gather"],
                                    mutation_scale=8))
    right.text(7.05, 1.3, "all-gather the\npersistent params", ha="center", fontsize=6.5)
    right.text(7.1, 0.8, "each rank updated only\nits partition of them", ha="center", fontsize=6.5)
    right.text(4.0, 3.0, f"one step of rank r on the wire ({world} ranks; times not to scale)", ha="center",
               fontsize=9)
    right.set_xlim(-0.1, 8.1), right.set_ylim(0.5, 3.2), right.axis("off")
    fig.tight_layout()
    return fig


def plot_wire_timeline(per_rank: list, ax=None, title: str | None = None, tick_ms: float | None = None):
    """One row per rank of ``per_rank`` (each ``{"phases": [...], "wire": [...]}`` as
    :func:`course_lib.classroom.checks.deepspeed.train_on_ranks` returns it, seconds): the phases as
    bars, every collective as a tick at its issue time (``tick_ms`` wide, default 1/400 of the span)."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.7 * len(per_rank) + 1.2))
    span = max((p["end"] for r in per_rank for p in r["phases"]), default=1.0) * 1e3
    width = tick_ms or span / 400
    lanes = {"all_gather": -0.3, "reduce_scatter": 0.0, "all_reduce": 0.3}
    for row, run in enumerate(per_rank):
        for p in run["phases"]:
            ax.barh(row, (p["end"] - p["start"]) * 1e3, left=p["start"] * 1e3, height=0.9, color=COLORS[p["kind"]],
                    alpha=0.35, edgecolor="none")
        for w in run["wire"]:
            if w["op"] in lanes and w["phase"] in ("forward", "backward", "step"):
                ax.barh(row + lanes[w["op"]], width, left=w["t"] * 1e3, height=0.25, color=COLORS[w["op"]])
    ax.set_yticks(range(len(per_rank)), [f"rank {r}" for r in range(len(per_rank))])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the first forward")
    ax.legend(handles=[Patch(color=COLORS[k], alpha=0.35 if k in ("forward", "backward", "step") else 1, label=k)
                       for k in ("forward", "backward", "step", "all_gather", "reduce_scatter", "all_reduce")],
              loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=6, fontsize=8, frameon=False)
    if title:
        ax.set_title(title, fontsize=9)
    return ax


def write_figures(out_dir) -> list[Path]:
    """``deepspeed_zero3_offload_step.png`` (:func:`plot_zero3_step`, 4 ranks), for Lab 10's theory."""
    import matplotlib

    matplotlib.use("Agg")
    from course_lib.safe_files import save_and_close_figure

    return [save_and_close_figure(plot_zero3_step(4), Path(out_dir) / "deepspeed_zero3_offload_step.png")]
