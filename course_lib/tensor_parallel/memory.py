"""What each rank holds: parameter bytes of a transformer layer vs TP size.

Split weights (QKV, attention projection, fc1, fc2, and the column-parallel
biases) shrink to exactly 1/t per rank; the LayerNorms and the row-parallel
biases are replicated and do not shrink. :func:`layer_parameter_shapes` derives
the per-rank shapes from the splitting rules (a test checks them against real
:class:`~.transformer.ParallelTransformerLayer` modules on real ranks),
:func:`parameter_memory_table` tabulates bytes per rank, and
:func:`plot_parameter_memory` draws them.

Gradients and optimizer state follow the parameters: mixed-precision Adam keeps
16 bytes per parameter (fp16 weight and gradient, fp32 master weight, momentum
and variance: Rajbhandari et al. 2020, ZeRO, section 3.1), and TP divides all of
it for the split weights. (Pass ``bytes_per_param=16`` to see that.)
"""

from __future__ import annotations

from course_lib import rules

from .transformer import TransformerConfig

__all__ = ["layer_parameter_shapes", "parameter_memory_table", "format_parameter_memory_table",
           "measured_parameter_bytes", "plot_parameter_memory"]


def layer_parameter_shapes(config: TransformerConfig, tp: int) -> list[dict]:
    """Per-rank parameters of one :class:`ParallelTransformerLayer` on a TP group of size ``tp``.

    Rows ``{name, shape (per rank), full_shape, split (bool), partition_dim}`` in
    ``named_parameters()`` order. Raises ValueError when the config cannot be split."""
    h, ffn = config.hidden_size, config.ffn_hidden_size
    rules.heads_divisible_by_tp(config.num_attention_heads, tp)
    rules.ffn_divisible_by_tp(ffn, tp)
    rows = []

    def add(name, full, split_dim=None):
        shape = list(full)
        if split_dim is not None:
            shape[split_dim] = rules.tp_split(name, full[split_dim], tp)
        rows.append(dict(name=name, shape=tuple(shape), full_shape=tuple(full), split=split_dim is not None,
                         partition_dim=split_dim))

    bias = config.add_bias_linear
    add("input_layernorm.weight", (h,))
    add("input_layernorm.bias", (h,))
    add("self_attention.linear_qkv.weight", (3 * h, h), 0)
    if bias:
        add("self_attention.linear_qkv.bias", (3 * h,), 0)
    add("self_attention.linear_proj.weight", (h, h), 1)
    if bias:
        add("self_attention.linear_proj.bias", (h,))
    add("pre_mlp_layernorm.weight", (h,))
    add("pre_mlp_layernorm.bias", (h,))
    add("mlp.linear_fc1.weight", (ffn, h), 0)
    if bias:
        add("mlp.linear_fc1.bias", (ffn,), 0)
    add("mlp.linear_fc2.weight", (h, ffn), 1)
    if bias:
        add("mlp.linear_fc2.bias", (h,))
    return rows


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def parameter_memory_table(config: TransformerConfig, tp_sizes=(1, 2, 4, 8),
                           bytes_per_param: int = 4) -> list[dict]:
    """Rows ``{name, split, bytes: {tp: bytes per rank}}`` plus a final ``"total"`` row.

    ``bytes_per_param``: 4 for float32 weights, 2 for bf16, 16 for weights +
    gradients + Adam state in mixed precision (ZeRO, section 3.1)."""
    per_tp = {t: layer_parameter_shapes(config, t) for t in tp_sizes}
    rows = []
    for i, base in enumerate(per_tp[tp_sizes[0]]):
        rows.append(dict(name=base["name"], split=base["split"],
                         bytes={t: _numel(per_tp[t][i]["shape"]) * bytes_per_param for t in tp_sizes}))
    rows.append(dict(name="total", split=None,
                     bytes={t: sum(r["bytes"][t] for r in rows) for t in tp_sizes}))
    return rows


def format_parameter_memory_table(rows: list[dict]) -> str:
    """Plain-text table of :func:`parameter_memory_table` (bytes per rank, and the ratio to TP=1)."""
    tps = list(rows[0]["bytes"])
    head = ["parameter", "kind"] + [f"TP={t}" for t in tps] + [f"TP={tps[-1]} / TP={tps[0]}"]
    body = []
    for r in rows:
        kind = "" if r["split"] is None else ("split" if r["split"] else "replicated")
        ratio = r["bytes"][tps[-1]] / r["bytes"][tps[0]]
        body.append([r["name"], kind] + [f"{r['bytes'][t]:,}" for t in tps] + [f"{ratio:.4g}"])
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.rjust(w) if i >= 2 else c.ljust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])


def measured_parameter_bytes(module) -> dict[str, int]:
    """``{name: bytes}`` of the parameters this rank actually holds."""
    return {n: p.numel() * p.element_size() for n, p in module.named_parameters()}


def plot_parameter_memory(rows: list[dict], title: str | None = None):
    """Left: stacked per-rank parameter KiB for each TP size (split tensors solid, replicated
    hatched). Right: bytes per rank relative to TP=1 for split and replicated tensors (1/t vs 1).
    Returns the matplotlib Figure."""
    import matplotlib.pyplot as plt

    tps = list(rows[0]["bytes"])
    parts = [r for r in rows if r["split"] is not None]
    groups = [("attention (split)", lambda r: r["split"] and r["name"].startswith("self_attention")),
              ("MLP (split)", lambda r: r["split"] and r["name"].startswith("mlp")),
              ("replicated: LayerNorms, row-parallel biases", lambda r: not r["split"])]
    colors = ["#4C72B0", "#DD8452", "#BBBBBB"]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 3.6), gridspec_kw=dict(width_ratios=[3, 2]))
    bottom = [0.0] * len(tps)
    labels = [str(t) for t in tps]
    for (label, pick), color in zip(groups, colors):
        vals = [sum(r["bytes"][t] for r in parts if pick(r)) / 1024 for t in tps]
        ax.bar(labels, vals, bottom=bottom, color=color, label=label,
               hatch="//" if "replicated" in label else None, edgecolor="white")
        bottom = [b + v for b, v in zip(bottom, vals)]
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:,.1f} KiB", ha="center", va="bottom", fontsize=8)
    ax.set_xlabel("tensor-model-parallel size t")
    ax.set_ylabel("parameter KiB per rank")
    ax.set_title(title or "One transformer layer: parameters per rank", fontsize=10)
    ax.legend(fontsize=7)
    ax.set_ylim(0, max(bottom) * 1.18)

    width = 0.38
    for k, (label, split, color) in enumerate([("split tensors", True, "#4C72B0"),
                                               ("replicated tensors", False, "#BBBBBB")]):
        sel = [r for r in parts if r["split"] == split]
        base = sum(r["bytes"][tps[0]] for r in sel)
        ratios = [sum(r["bytes"][t] for r in sel) / base for t in tps]
        xs = [i + (k - 0.5) * width for i in range(len(tps))]
        ax2.bar(xs, ratios, width, color=color, label=label, hatch=None if split else "//", edgecolor="white")
        for x, v in zip(xs, ratios):
            ax2.text(x, v, f"{v:.3g}", ha="center", va="bottom", fontsize=7)
    ax2.set_xticks(range(len(tps)), labels)
    ax2.set_xlabel("tensor-model-parallel size t")
    ax2.set_ylabel(f"bytes per rank / bytes at TP={tps[0]}")
    ax2.set_title("split: exactly 1/t; replicated: 1", fontsize=10)
    ax2.set_ylim(0, 1.25)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig
