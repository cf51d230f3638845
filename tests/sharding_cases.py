"""Shared by tests/distributed/test_distributed_optimizer.py and tests/distributed/test_megatron_fsdp.py: the model, the data,
the single-process reference and one data-parallel run of :func:`course_lib.distributed.wrap`.

The model is a small MLP whose every parameter has a multiple of 4 elements, so Megatron-FSDP's buckets
(a multiple of d) need no padding on 4 ranks and the measured bytes can equal ZeRO's formulas exactly; the
distributed optimizer's layout pads it (64-element param starts, lcm(4, 128) bucket ends: 1,928 elements
in 2,176), which its tests count. The reference trains the
same model in one process on the whole global batch with ``course_lib.optimizer.Optimizer``
(bf16: a bf16 model, fp32 master copies, grads cast to fp32 -- written out here, not the code under
test).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
from torch import nn

IN, HID, OUT = 16, 32, 8
GLOBAL_BATCH, ITERS, LR, SEED = 16, 3, 1e-2, 1234


class MLP(nn.Module):
    """``[n, 16] -> [n, 8]``: Linear 16->32, LayerNorm, GELU, Linear 32->32, GELU, Linear 32->8."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, HID)
        self.norm = nn.LayerNorm(HID)
        self.fc2 = nn.Linear(HID, HID)
        self.fc3 = nn.Linear(HID, OUT)

    def forward(self, x):
        return self.fc3(torch.nn.functional.gelu(self.fc2(torch.nn.functional.gelu(self.norm(self.fc1(x))))))


NUM_PARAMS = IN * HID + HID + 2 * HID + HID * HID + HID + HID * OUT + OUT  # 1928


def make_model(dtype=torch.float32) -> MLP:
    torch.manual_seed(SEED)
    return MLP().to(dtype)


class DenseMLP3(nn.Module):
    """``[n, 16] -> [n, 8]``: Linear 16->32, GELU, Linear 32->32, GELU, Linear 32->8 (the TP MLP's reference)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(IN, HID), nn.Linear(HID, HID), nn.Linear(HID, OUT)

    def forward(self, x):
        return self.fc3(torch.nn.functional.gelu(self.fc2(torch.nn.functional.gelu(self.fc1(x)))))


class TPMLP(nn.Module):
    """DenseMLP3 with Megatron's TP pair: fc1 column-parallel, fc2 row-parallel, fc3 replicated."""

    def __init__(self, tp_group):
        from course_lib.tensor_parallel import ColumnParallelLinear, RowParallelLinear
        super().__init__()
        self.fc1 = ColumnParallelLinear(IN, HID, tp_group=tp_group)
        self.fc2 = RowParallelLinear(HID, HID, tp_group=tp_group)
        self.fc3 = nn.Linear(HID, OUT)

    def forward(self, x):
        h, _ = self.fc1(x)
        h, _ = self.fc2(torch.nn.functional.gelu(h))
        return self.fc3(torch.nn.functional.gelu(h))


class Block(nn.Module):
    """``[n, i] -> [n, o]``: Linear then GELU (a ZeRO-3 unit of :class:`HeadLast`)."""

    def __init__(self, i, o):
        super().__init__()
        self.fc = nn.Linear(i, o)

    def forward(self, x):
        return torch.nn.functional.gelu(self.fc(x))


class HeadLast(nn.Module):
    """``[n, 16] -> [n, 8]``: two :class:`Block` s, then a head Linear 32->8 owned by the model itself.

    With ``fsdp_unit_modules=(Block,)`` the head sits in the root unit, which runs *first* in
    backward -- a pipeline's last stage (output layer and final LayerNorm in the root)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(IN, HID), Block(HID, HID)])
        self.head = nn.Linear(HID, OUT)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_head_last() -> HeadLast:
    torch.manual_seed(SEED)
    return HeadLast()


def make_dense3() -> DenseMLP3:
    torch.manual_seed(SEED)
    return DenseMLP3()


def make_tp_model(tp_group) -> TPMLP:
    from course_lib.tensor_parallel import copy_dense_to_parallel
    with torch.no_grad():
        return copy_dense_to_parallel(make_dense3(), TPMLP(tp_group), tp_group)


def batch(it: int, dtype=torch.float32):
    """The global batch of iteration ``it``: ``x [16, 16]``, ``y [16, 8]``."""
    g = torch.Generator().manual_seed(100 + it)
    return torch.randn(GLOBAL_BATCH, IN, generator=g).to(dtype), torch.randn(GLOBAL_BATCH, OUT, generator=g).to(dtype)


def loss_fn(out, y):
    return torch.nn.functional.mse_loss(out.float(), y.float())


class Reference(NamedTuple):
    losses: list       # per iteration
    params: dict       # final fp32 master values
    grad_norms: list   # per iteration, before clipping
    dtype: torch.dtype  # the model's


def reference(dtype=torch.float32, iters: int = ITERS, factory=None, optimizer: str = "adam",
              clip_grad: float = 0.0) -> Reference:
    """One process, the whole batch, the course's optimizer and clipping written out here.
    ``factory()``: the model (default: :func:`make_model` in ``dtype``); ``optimizer``: "adam" or "sgd"."""
    from course_lib.optimizer import Optimizer, clip_grads
    model = factory() if factory is not None else make_model(dtype)
    named = list(model.named_parameters())
    master = [(n, p.detach().float().clone()) for n, p in named]
    opt = Optimizer(master, optimizer)
    losses, norms = [], []
    for it in range(iters):
        x, y = batch(it, dtype)
        for p in model.parameters():
            p.grad = None
        loss = loss_fn(model(x), y)
        loss.backward()
        for (_, m), (_, p) in zip(master, named):
            m.grad = p.grad.float()
        norms.append(float(torch.sqrt(sum(m.grad.double().square().sum() for _, m in master))))
        clip_grads([m for _, m in master], norms[-1], clip_grad)
        opt.step(LR)
        with torch.no_grad():
            for (_, m), (_, p) in zip(master, named):
                p.copy_(m)
        losses.append(loss.item())
    return Reference(losses, {n: m for n, m in master}, norms, dtype)


def run(dp_group, dp_rank: int, dp: int, *, dtype=torch.float32, model=None, iters: int = ITERS,
        break_with=None, tp_group=None, clip_grad: float = 0.0, micro_batches: int = 1, probe=None,
        forwards_first: bool = False, grad_norm: bool = True, **kwargs) -> dict:
    """Train ``model`` (default: the MLP) with ``wrap(model, dp_group, **kwargs)`` on this rank's rows of
    each global batch. Returns the local losses, the final full params, bytes per rank, the
    collectives of the last step and its timeline. ``break_with(ddp)`` may sabotage the wrapper;
    ``tp_group``: the model is tensor-parallel over it (params are gathered for the comparison);
    ``micro_batches``: the rank's rows in that many micro-batches, all but the last under ``no_sync``
    (``forwards_first``: all their forwards before any backward, as a pipeline's warm-up does);
    ``probe(ddp, model)``: anything picklable to return as ``"probe"`` after the last step;
    ``grad_norm``: ask ``step`` for the norm (without it and without clipping it computes none)."""
    from course_lib.distributed import wrap
    model = model if model is not None else make_model(dtype)
    ddp = wrap(model, dp_group, **kwargs)
    if break_with is not None:
        break_with(ddp)
    rows = GLOBAL_BATCH // dp
    losses, norms = [], []
    for it in range(iters):
        x, y = batch(it, dtype)
        x, y = x[dp_rank * rows:(dp_rank + 1) * rows], y[dp_rank * rows:(dp_rank + 1) * rows]
        ddp.zero_grad()
        ddp.comm.clear()
        loss = 0.0
        parts = list(zip(x.chunk(micro_batches), y.chunk(micro_batches)))
        if forwards_first:  # a pipeline's warm-up: every forward, then every backward
            parts = [loss_fn(ddp(xm), ym) / micro_batches for xm, ym in parts]
        for m, part in enumerate(parts):
            # gradient accumulation: only the last micro-batch's backward starts the collectives
            with ddp.no_sync() if m < micro_batches - 1 else contextlib.nullcontext():
                if not forwards_first:
                    part = loss_fn(ddp(part[0]), part[1]) / micro_batches
                ddp.scale_loss(part).backward()
            loss += part.item()
        result = ddp.step(LR, clip_grad=clip_grad, grad_norm=grad_norm)
        losses.append(loss)
        norms.append(result["grad_norm"])
    params = ddp.full_parameters()
    if tp_group is not None:  # this rank holds TP shards: the whole tensors from the TP group
        from course_lib.tensor_parallel import gather_full_params
        params = gather_full_params(model, tp_group)
    out = dict(losses=losses, grad_norms=norms, params=params, bytes=ddp.bytes_per_rank(),
               events=[e for e in ddp.comm.events if e.tag in ("grads", "params")],
               timeline=[dict(e) for e in ddp.timeline], skipped=result["skipped"])
    out["probe"] = probe(ddp, model) if probe else None  # last: a probe may run the model again
    return out


GPT = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)
"""The course GPT (course_lib.model.GPTModel, tied embeddings): 38,272 parameters, 4 divides every unit."""


def gpt_batch(it: int):
    """Tokens and labels ``[8, 16]`` of iteration ``it`` (byte vocabulary)."""
    t = torch.randint(0, 257, (8, GPT["seq_length"] + 1), generator=torch.Generator().manual_seed(it))
    return t[:, :-1], t[:, 1:]


def gpt_loss(logits, labels):
    """Mean cross-entropy of logits ``[s, b, V]`` against labels ``[b, s]``."""
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.t().reshape(-1))


def gpt_reference(iters: int = 3) -> tuple[list, int]:
    """One process on the whole batch: losses per iteration and the parameter count."""
    from course_lib.model import GPTConfig, GPTModel
    from course_lib.optimizer import Optimizer
    model = GPTModel(GPTConfig(**GPT))
    opt, losses = Optimizer(list(model.named_parameters())), []
    for it in range(iters):
        x, y = gpt_batch(it)
        for p in model.parameters():
            p.grad = None
        loss = gpt_loss(model(x), y)
        loss.backward()
        opt.step(LR)
        losses.append(loss.item())
    return losses, sum(p.numel() for p in model.parameters())


def run_gpt(dp_group, dp_rank: int, dp: int, iters: int = 3, **kwargs) -> dict:
    """The GPT wrapped with ``wrap(..., **kwargs)``; ZeRO-3 units are its transformer layers (the
    root unit keeps the tied embedding, used by the embedding and the output layer)."""
    from course_lib.distributed import wrap
    from course_lib.model import GPTConfig, GPTModel
    model = GPTModel(GPTConfig(**GPT))
    ddp = wrap(model, dp_group, fsdp_unit_modules=(type(model.decoder.layers["0"]),), **kwargs)
    rows, losses = 8 // dp, []
    for it in range(iters):
        x, y = gpt_batch(it)
        ddp.zero_grad()
        loss = gpt_loss(ddp(x[dp_rank * rows:(dp_rank + 1) * rows]), y[dp_rank * rows:(dp_rank + 1) * rows])
        loss.backward()
        ddp.step(LR)
        losses.append(loss.item())
    return dict(losses=losses, bytes=ddp.bytes_per_rank(), units=[name for name, _, _ in ddp.units])


def global_losses(per_rank: list) -> list:
    """The global batch's mean loss per iteration: the mean of the ranks' local means (equal rows)."""
    return [sum(r["losses"][i] for r in per_rank) / len(per_rank) for i in range(len(per_rank[0]["losses"]))]


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def skip_grad_reduce(ddp) -> None:
    """Sabotage: each rank keeps its own grads for its shard (the reduce-scatter becomes a local slice)."""
    real = ddp._collective

    def local(op, out, inp, name, tag, async_op):
        if op != "reduce_scatter":
            return real(op, out, inp, name, tag, async_op)
        out.copy_(inp[ddp.dp_rank * out.numel():(ddp.dp_rank + 1) * out.numel()])
        return None
    ddp._collective = local
