"""Step time of our ZeRO-3 (course_lib.distributed, ``optim_grads_params``) against PyTorch's FSDP2
(``torch.distributed.fsdp.fully_shard``) on a CPU gloo mesh (prints figures, asserts nothing).

The same MLP (``--layers`` Linear ``--hidden`` x ``--hidden`` with GELU, each Linear one FSDP unit,
fp32, Adam(W)) on ``--ranks`` ranks, each with ``--rows`` rows per step. A step is forward, backward,
grad reduce-scatter, optimizer, both sides sharding params, grads and optimizer state over all
ranks. Goal: ratio <= 1.0 (ours / FSDP2) at 4 ranks. Each timing is the median over ``--repeats``
steps after warm-up; the two alternate step by step so that machine noise hits both alike. Each
rank uses one thread (``launch`` sets it). Also printed: the loss after the timed steps on both
sides (same data, same init: they agree to ~1e-6) and the param/optimizer bytes per rank.

    python benchmarks/fsdp2_vs_zero3.py [--ranks 4] [--hidden 512] [--layers 8] [--rows 32] [--repeats 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

import torch._dynamo  # noqa: E402,F401  (FSDP2 imports it on first use: pay that once, before forking)
import torch.distributed.fsdp  # noqa: E402,F401
from course_lib.launch import launch  # noqa: E402

LR = 1e-3


def _model(hidden: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(hidden, hidden), nn.GELU()]
    return nn.Sequential(*mods)


def _groups(model: nn.Module) -> list[dict]:
    """AdamW's groups: weight decay 0.01 on the matrices, none on the biases."""
    return [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.01},
            {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}]


def build_steps(hidden: int, layers: int, rows: int) -> tuple[dict, dict]:
    """On a running gloo world: ``({"ours": step, "fsdp2": step}, {"ours": wrapper, "fsdp2": (model, optimizer)})``,
    each ``step()`` one training step on this rank's ``rows`` rows returning its loss."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from course_lib.distributed import wrap

    world, rank = dist.get_world_size(), dist.get_rank()
    ours = wrap(_model(hidden, layers), dist.group.WORLD, strategy="optim_grads_params", overlap_grad_reduce=True)
    theirs = _model(hidden, layers)
    mesh = init_device_mesh("cpu", (world,))
    for m in theirs:
        if isinstance(m, nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    opt = torch.optim.AdamW(_groups(theirs), lr=LR, eps=1e-8)
    x, y = batch(hidden, rows)

    def step_ours():
        ours.zero_grad()
        loss = nn.functional.mse_loss(ours(x), y)
        loss.backward()
        ours.step(LR)
        return loss.item()

    def step_theirs():
        opt.zero_grad()
        loss = nn.functional.mse_loss(theirs(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    return {"ours": step_ours, "fsdp2": step_theirs}, {"ours": ours, "fsdp2": (theirs, opt)}


def batch(hidden: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's inputs and targets ``[rows, hidden]`` (seeded by rank)."""
    g = torch.Generator().manual_seed(dist.get_rank())
    return torch.randn(rows, hidden, generator=g), torch.randn(rows, hidden, generator=g)


def time_steps(steps: dict, repeats: int, warmup: int) -> tuple[dict, dict]:
    """``({name: median seconds}, {name: last loss})``: the steps alternate, a barrier before each."""
    times = {name: [] for name in steps}
    losses = {}
    for i in range(warmup + repeats):
        for name, fn in steps.items():
            dist.barrier()
            t0 = time.perf_counter()
            losses[name] = fn()
            dt = time.perf_counter() - t0
            if i >= warmup:
                times[name].append(dt)
    return {name: statistics.median(t) for name, t in times.items()}, losses


def _rank_bench(hidden: int, layers: int, rows: int, repeats: int, warmup: int):
    steps, sides = build_steps(hidden, layers, rows)
    medians, losses = time_steps(steps, repeats, warmup)
    theirs, opt = sides["fsdp2"]
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    fsdp2_bytes = {"params": sum(local(p).numel() * p.element_size() for p in theirs.parameters()),
                   "optimizer": sum(local(t).numel() * t.element_size() for st in opt.state.values()
                                    for t in st.values() if t.dim() > 0)}
    return {"ours": medians["ours"], "fsdp2": medians["fsdp2"],
            "losses": losses, "ours_bytes": sides["ours"].bytes_per_rank(), "fsdp2_bytes": fsdp2_bytes}


def run_bench(rank_bench, description: str, argv=None):
    """Parse the benchmark's flags, run ``rank_bench(hidden, layers, rows, repeats, warmup)`` on ``--ranks``
    gloo ranks; return ``(args, per-rank results)``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args(argv)
    return args, launch(rank_bench, world_size=args.ranks, backend="gloo", timeout=600, output="none",
                        hidden=args.hidden, layers=args.layers, rows=args.rows, repeats=args.repeats,
                        warmup=args.warmup)


def main(argv=None) -> None:
    args, res = run_bench(_rank_bench, __doc__.splitlines()[0], argv)
    ours = max(r["ours"] for r in res)  # a step ends when the slowest rank ends
    theirs = max(r["fsdp2"] for r in res)
    r0 = res[0]
    print(f"MLP {args.layers} x Linear({args.hidden}, {args.hidden}), {args.rows} rows/rank, {args.ranks} ranks, "
          f"fp32, median of {args.repeats} steps")
    print(f"  ours ZeRO-3 (optim_grads_params, overlap_grad_reduce): {ours * 1e3:8.2f} ms/step")
    print(f"  FSDP2 fully_shard + AdamW:                            {theirs * 1e3:8.2f} ms/step")
    print(f"  ratio ours / FSDP2: {ours / theirs:.2f}x (goal <= 1.0x)")
    print(f"  loss after the timed steps: ours {r0['losses']['ours']:.6f}, FSDP2 {r0['losses']['fsdp2']:.6f}")
    print(f"  bytes per rank: ours params {r0['ours_bytes']['params']:,} optimizer {r0['ours_bytes']['optimizer']:,}; "
          f"FSDP2 params {r0['fsdp2_bytes']['params']:,} optimizer {r0['fsdp2_bytes']['optimizer']:,}")


if __name__ == "__main__":
    main()
