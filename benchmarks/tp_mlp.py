"""Forward+backward time of our ParallelMLP against the alternatives (prints figures, asserts nothing).

1. tp=1 (one rank): ParallelMLP vs the same MLP from ``nn.Linear`` (DenseMLP).
   Goal: ratio <= 1.05 -- at t=1 every mapping is a no-op, so the layer must
   cost what nn.Linear costs.
2. tp=2 (two ranks, gloo): ParallelMLP vs PyTorch's DTensor tensor parallelism
   (ColwiseParallel / RowwiseParallel on a CPU DeviceMesh) of the same MLP.
   Goal: ratio <= 1.0 -- explicit layers issue the same two all-reduces without
   DTensor's per-op dispatch.

Each timing is the median over ``--repeats`` steps after warm-up; the two
variants alternate step by step so that machine noise hits both alike. Each rank
uses one thread (``launch`` sets it), so tp=2 uses two cores.

    python benchmarks/tp_mlp.py [--hidden 1024] [--tokens 512] [--repeats 30]
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

import torch._dynamo  # noqa: E402,F401  (DTensor imports it on first use: pay that once, before forking)
from course_lib.launch import launch  # noqa: E402
from course_lib.tensor_parallel import DenseMLP, ParallelMLP, TransformerConfig  # noqa: E402


def _step(model, x, dy):
    y = model(x)
    y.backward(dy)


def _rank_bench(hidden: int, tokens: int, repeats: int, against: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    t, g = dist.get_world_size(), dist.group.WORLD
    cfg = TransformerConfig(hidden_size=hidden, num_attention_heads=8)
    torch.manual_seed(0)
    ours = ParallelMLP(cfg, g)
    torch.manual_seed(0)
    other = DenseMLP(cfg)
    if against == "dtensor":
        parallelize_module(other, init_device_mesh("cpu", (t,)),
                           {"linear_fc1": ColwiseParallel(), "linear_fc2": RowwiseParallel()})
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, 1, hidden, generator=gen).requires_grad_()   # [s, b, h]
    dy = torch.randn(tokens, 1, hidden, generator=gen)
    times = {"ours": [], "other": []}
    for i in range(repeats + 5):
        for name, model in (("ours", ours), ("other", other)) if i % 2 else (("other", other), ("ours", ours)):
            model.zero_grad(set_to_none=True)
            x.grad = None
            dist.barrier()
            start = time.perf_counter()
            _step(model, x, dy)
            dist.barrier()  # a step ends when the slowest rank is done
            if i >= 5:
                times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=512, help="s*b tokens per step")
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args(argv)
    print(f"MLP {a.hidden} -> {4 * a.hidden} -> {a.hidden}, {a.tokens} tokens, fp32, forward+backward, "
          f"median of {a.repeats} steps, torch {torch.__version__}")
    rows = []
    r1 = launch(_rank_bench, world_size=1, output="none", timeout=600, hidden=a.hidden, tokens=a.tokens,
                repeats=a.repeats, against="nn.Linear")[0]
    rows.append(("tp=1", "ParallelMLP", "nn.Linear MLP", r1["ours"], r1["other"], 1.05))
    r2 = launch(_rank_bench, world_size=2, output="none", timeout=600, hidden=a.hidden, tokens=a.tokens,
                repeats=a.repeats, against="dtensor")[0]
    rows.append(("tp=2 (gloo)", "ParallelMLP", "DTensor Colwise/Rowwise", r2["ours"], r2["other"], 1.0))
    print(f"{'setting':12} {'ours (ms)':>10} {'baseline':>24} {'(ms)':>8} {'ratio':>7} {'goal':>7}")
    for setting, _, base, ours, other, goal in rows:
        ratio = ours / other
        verdict = "met" if ratio <= goal else "MISSED"
        print(f"{setting:12} {ours * 1e3:10.2f} {base:>24} {other * 1e3:8.2f} {ratio:7.3f}  <= {goal:<4} {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
