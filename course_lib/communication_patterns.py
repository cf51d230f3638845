"""Lab 00: the six communication patterns every parallelism in this course is built from.

Every function whose name starts with ``rank_`` runs *on a rank* (inside
:func:`course_lib.launch.launch`); the others run in the notebook and launch
ranks themselves. Tensors are small and integer-valued so the before/after
pictures can be read by eye: rank ``r`` starts with ``[10r, 10r+1, ..., 10r+W-1]``.

Where each pattern shows up later:

==============  =====================================================  ============
collective      used for                                               lab
==============  =====================================================  ============
all_reduce      TP layer outputs (g), DP gradients, vocab-parallel CE  02, 05
all_gather      SP before the column GEMM, gather_output=True          02, 04
reduce_scatter  SP after the row GEMM, ZeRO/distributed optimizer      02, 04
broadcast       the same initial weights / data on every rank          05
send_recv       pipeline stages (activations fwd, gradients bwd), CP    03, 04
all_to_all      expert parallel (MoE token routing), Ulysses-style SP  (04)
==============  =====================================================  ============
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from course_lib.rules import UsageError

# Recent torch (2.13 here) names the flat-tensor collectives *_single and warns on the old names.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv", "all_to_all")


def rank_input(rank: int, world_size: int) -> torch.Tensor:
    """This rank's starting tensor, shape ``[world_size]``: ``10*rank + arange(world_size)``."""
    return 10 * rank + torch.arange(world_size, dtype=torch.float32)


def apply_collective(op: str, x: torch.Tensor, group=None) -> torch.Tensor:
    """Run collective ``op`` on this rank's ``x`` (shape ``[W]``); return this rank's result.

    Shapes (W = group size, x of shape ``[N]``): all_reduce ``[N]`` -> ``[N]``
    (sum); all_gather ``[N]`` -> ``[W*N]`` (the shards, in rank order);
    reduce_scatter ``[N]`` -> ``[N/W]`` (chunk r, summed over ranks, lands on
    rank r); broadcast ``[N]`` from group rank 0; send_recv shifts ``x`` one rank
    along the ring; all_to_all ``[N]`` -> ``[N]`` (chunk j goes to rank j: a
    transpose across ranks). reduce_scatter and all_to_all need W | N.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if op == "all_reduce":
        out = x.clone()
        dist.all_reduce(out, group=group)
    elif op == "all_gather":
        out = torch.empty(world * x.numel(), dtype=x.dtype)
        _all_gather_tensor(out, x.contiguous(), group=group)
    elif op == "reduce_scatter":
        out = torch.empty(x.numel() // world, dtype=x.dtype)
        _reduce_scatter_tensor(out, x.contiguous(), group=group)
    elif op == "broadcast":
        out = x.clone()
        dist.broadcast(out, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    elif op == "send_recv":
        out = torch.empty_like(x)
        if world == 1:
            return x.clone()  # gloo cannot send to itself
        peers = dist.get_process_group_ranks(group) if group else list(range(world))
        ops = [dist.P2POp(dist.isend, x.contiguous(), peers[(rank + 1) % world], group),
               dist.P2POp(dist.irecv, out, peers[(rank - 1) % world], group)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    elif op == "all_to_all":
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x.contiguous(), group=group)
    else:
        raise UsageError(f"op={op!r} is unknown: use one of {', '.join(COLLECTIVES)}")
    return out


def rank_before_after(ops=COLLECTIVES) -> dict[str, tuple[list[float], list[float]]]:
    """On a rank: ``{op: (before, after)}`` for every op, starting each from :func:`rank_input`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    table = {}
    for op in ops:
        # all_gather collects shards: each rank starts with one element of its own.
        x = rank_input(rank, world)[:1] if op == "all_gather" else rank_input(rank, world)
        table[op] = (x.tolist(), apply_collective(op, x).tolist())
    return table


def before_after(world_size: int = 4, ops=COLLECTIVES, launcher: str = "fork") -> dict:
    """Launch ``world_size`` ranks; return ``{op: {"before": [per-rank list], "after": [...]}}``."""
    from course_lib.launch import launch

    per_rank = launch(rank_before_after, world_size=world_size, launcher=launcher, output="none", ops=tuple(ops))
    return {op: {"before": [r[op][0] for r in per_rank], "after": [r[op][1] for r in per_rank]} for op in ops}


def format_before_after(table: dict) -> str:
    """The before -> after table as text, one line per rank and collective."""
    lines = []
    for op, states in table.items():
        lines.append(op)
        for r, (b, a) in enumerate(zip(states["before"], states["after"])):
            fmt = lambda v: "[" + ", ".join(f"{x:g}" for x in v) + "]"  # noqa: E731
            lines.append(f"  rank {r}: {fmt(b):<22} -> {fmt(a)}")
    return "\n".join(lines)


def plot_before_after(table: dict):
    """One row per collective: each rank's tensor before (left) and after (right), as coloured cells."""
    import matplotlib.pyplot as plt
    from matplotlib.colors import Normalize

    ops = list(table)
    world = len(table[ops[0]]["before"])
    fig, axes = plt.subplots(len(ops), 2, figsize=(7.5, 1.25 * len(ops) * max(1, world / 4)), squeeze=False)
    norm = Normalize(0, 10 * world)
    for row, op in enumerate(ops):
        for col, key in enumerate(("before", "after")):
            ax = axes[row][col]
            width = max(len(v) for v in table[op][key])
            for r, values in enumerate(table[op][key]):
                for j, v in enumerate(values):
                    ax.add_patch(plt.Rectangle((j, world - 1 - r), 0.95, 0.9,
                                               color=plt.cm.viridis(norm(min(v, 10 * world)))))
                    shade = norm(min(v, 10 * world))
                    ax.text(j + 0.47, world - 0.55 - r, f"{v:g}", ha="center", va="center", fontsize=8,
                            color="black" if shade > 0.6 else "white")
            ax.set_xlim(0, max(width, world))
            ax.set_ylim(0, world)
            ax.set_yticks([world - 0.55 - r for r in range(world)], [f"rank {r}" for r in range(world)],
                          fontsize=8)
            ax.set_xticks([])
            for side in ("top", "right", "bottom", "left"):
                ax.spines[side].set_visible(False)
            ax.set_title(f"{op}: {key}", fontsize=9, loc="left")
    fig.tight_layout()
    return fig


def rank_time_collectives(numels=(1024, 65536, 1048576), repeats: int = 5, ops=COLLECTIVES) -> dict:
    """On a rank: median seconds of each op for each float32 tensor size ``[numel]``."""
    world = dist.get_world_size()
    out = {}
    for numel in numels:
        numel = max(world, numel - numel % world)  # reduce_scatter/all_to_all need W | numel
        x = torch.randn(numel)
        for op in ops:
            src = x[: numel // world] if op == "all_gather" else x  # same output size for every op
            apply_collective(op, src)  # warm-up: connections, buffers
            times = []
            for _ in range(repeats):
                dist.barrier()
                t0 = time.perf_counter()
                apply_collective(op, src)
                times.append(time.perf_counter() - t0)
            out[(op, numel)] = statistics.median(times)
    return out


def measure_costs(world_sizes=(2, 4, 8), numels=(1024, 65536, 1048576), repeats: int = 5) -> list[dict]:
    """Launch each world size; rows ``{world_size, op, numel, bytes, ms}`` (rank 0's medians).

    The all_gather row moves the same *output* size as the others (each rank
    contributes ``numel / W``), so every row ends with ``numel`` floats per rank.
    """
    from course_lib.launch import launch

    rows = []
    for w in world_sizes:
        timings = launch(rank_time_collectives, world_size=w, output="none", timeout=120,
                         numels=tuple(numels), repeats=repeats)[0]
        for (op, numel), seconds in timings.items():
            rows.append(dict(world_size=w, op=op, numel=numel, bytes=4 * numel, ms=1e3 * seconds))
    return rows


def plot_costs(rows: list[dict]):
    """Time per collective vs world size, one panel per tensor size (log-scale time)."""
    import matplotlib.pyplot as plt

    numels = sorted({r["numel"] for r in rows})
    ops = list(dict.fromkeys(r["op"] for r in rows))
    fig, axes = plt.subplots(1, len(numels), figsize=(4 * len(numels), 3.2), squeeze=False)
    for ax, numel in zip(axes[0], numels):
        for op in ops:
            pts = sorted((r["world_size"], r["ms"]) for r in rows if r["op"] == op and r["numel"] == numel)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=op)
        ax.set_yscale("log")
        ax.set_xticks(sorted({r["world_size"] for r in rows}))
        ax.set_xlabel("ranks (world size)")
        ax.set_title(f"{numel * 4 / 1024:g} KiB per rank", fontsize=10)
    axes[0][0].set_ylabel("median time (ms)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    return fig


def ring_all_reduce(x: torch.Tensor, group=None, sent: list | None = None) -> torch.Tensor:
    """Sum ``x`` (any shape) over the group with a ring built from send/recv; return the sum.

    Reduce-scatter phase (W-1 steps: pass a chunk to the right, add what arrives
    from the left), then all-gather phase (W-1 steps: pass the finished chunks
    on). Each rank sends 2(W-1) chunks of ~N/W elements: 2(W-1)/W * N in all,
    independent of W -- why rings scale (Patarasuk & Yuan 2009; Narayanan et
    al. 2021 §3.2 use this volume). ``sent`` (a list) collects the element
    count of every send, for counting. This is the course's reference; Lab 00
    asks you to write your own.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return x.clone()
    peers = dist.get_process_group_ranks(group) if group else list(range(world))
    right, left = peers[(rank + 1) % world], peers[(rank - 1) % world]
    chunks = [c.clone() for c in torch.tensor_split(x.flatten(), world)]

    def exchange(send_idx, recv_idx):
        incoming = torch.empty_like(chunks[recv_idx])
        ops = [dist.P2POp(dist.isend, chunks[send_idx], right, group),
               dist.P2POp(dist.irecv, incoming, left, group)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        if sent is not None:
            sent.append(chunks[send_idx].numel())
        return incoming

    for step in range(world - 1):  # after this, chunk (rank+1) % W holds the full sum
        send_idx, recv_idx = (rank - step) % world, (rank - step - 1) % world
        chunks[recv_idx] += exchange(send_idx, recv_idx)
    for step in range(world - 1):
        send_idx, recv_idx = (rank + 1 - step) % world, (rank - step) % world
        chunks[recv_idx] = exchange(send_idx, recv_idx)
    return torch.cat(chunks).view_as(x)


def write_figures(out_dir) -> list:
    """Write Lab 00's before/after picture (4 ranks) for ``make figures``."""
    from pathlib import Path

    import matplotlib.pyplot as plt

    from course_lib.safe_files import save_figure_atomic

    fig = plot_before_after(before_after(world_size=4))
    path = save_figure_atomic(fig, Path(out_dir) / "00_collectives_before_after.png", dpi=110)
    plt.close(fig)
    return [path]
