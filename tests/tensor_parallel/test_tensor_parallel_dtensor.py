"""Our ParallelMLP == PyTorch's own tensor parallelism (DTensor) on a CPU DeviceMesh over gloo.

PyTorch's ``ColwiseParallel`` / ``RowwiseParallel`` (torch.distributed.tensor.parallel)
shard the same dense MLP; outputs, input gradients and the full weight gradients
must agree with our explicit layers built from the same seed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# DTensor's first use imports torch._dynamo (~3 s); import it once here so forked ranks inherit it.
import torch._dynamo  # noqa: F401
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from course_lib.launch import launch
from course_lib.tensor_parallel import DenseMLP, ParallelMLP, TransformerConfig, gather_full_grads

CFG = TransformerConfig(hidden_size=16, num_attention_heads=4, ffn_hidden_size=64)


def _rank_compare():
    t = dist.get_world_size()
    x0 = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(5))
    dy = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(6))

    torch.manual_seed(0)
    ours = ParallelMLP(CFG, dist.group.WORLD)
    x1 = x0.clone().requires_grad_()
    y1 = ours(x1)
    y1.backward(dy)
    g1 = gather_full_grads(ours, dist.group.WORLD)

    torch.manual_seed(0)
    theirs = DenseMLP(CFG)                      # the same dense weights, then sharded by PyTorch
    mesh = init_device_mesh("cpu", (t,))
    parallelize_module(theirs, mesh, {"linear_fc1": ColwiseParallel(), "linear_fc2": RowwiseParallel()})
    x2 = x0.clone().requires_grad_()
    y2 = theirs(x2)
    y2.backward(dy)
    g2 = {n: p.grad.full_tensor() for n, p in theirs.named_parameters()}
    local = {n: tuple(p.to_local().shape) for n, p in theirs.named_parameters()}
    mine = {n: tuple(p.shape) for n, p in ours.named_parameters()}
    err = lambda a, b: (a - b).abs().max().item()  # noqa: E731
    return dict(y=err(y1, y2), dx=err(x1.grad, x2.grad), grads=max(err(g1[n], g2[n]) for n in g1),
                same_shards=local == mine)


def test_parallel_mlp_equals_pytorch_dtensor_tp():
    for t in (2, 4):
        for rank, r in enumerate(launch(_rank_compare, world_size=t, output="none", timeout=90)):
            assert r["same_shards"], f"tp={t} rank {rank}: per-rank shapes differ from PyTorch's shards"
            for what in ("y", "dx", "grads"):
                assert r[what] <= 1e-5, f"tp={t} rank {rank}: {what} differs from DTensor TP by {r[what]:.3g}"
