"""The optimizer and learning-rate schedule of :mod:`course_lib.train`, written out elementwise.

Written out (not ``torch.optim``) so that the same arithmetic runs on a tensor-parallel shard
and on the full tensor, which is what makes every layout's loss curve equal the
single-process one; tests compare them with ``torch.optim.AdamW`` / ``SGD`` (to 1e-6).
"""

from __future__ import annotations

import math

import torch
from course_lib.rules import UsageError

OPTIMIZERS = ("adam", "sgd")
LR_DECAY_STYLES = ("constant", "linear", "cosine")


def no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """Megatron's default ``no_weight_decay_cond``: biases and 1-D parameters (LayerNorm) are not decayed."""
    return name.endswith(".bias") or param.dim() == 1


def param_groups(named_params, weight_decay: float) -> list[dict]:
    """``torch.optim``-style groups of ``[(name, parameter)]`` with Megatron's weight-decay rule:
    ``[{"params": decayed, "weight_decay": weight_decay}, {"params": biases and 1-D, "weight_decay": 0.0}]``
    (what Megatron-DeepSpeed hands ``deepspeed.initialize``; an empty group is left out)."""
    decay = [p for n, p in named_params if not no_weight_decay(n, p)]
    no_decay = [p for n, p in named_params if no_weight_decay(n, p)]
    return [g for g in ({"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0})
            if g["params"]]


class Optimizer:
    """Adam(W) or SGD written out elementwise, identical on a shard and on the full tensor.

    ``params``: ``[(name, parameter)]`` (names decide weight decay, Megatron's rule).
    Adam is AdamW (decoupled decay, Megatron's ``FusedAdam(adam_w_mode=True)``), in the
    operation order of ``torch.optim.AdamW``; SGD is ``torch.optim.SGD`` with momentum and
    L2 weight decay. ``step(lr)`` uses ``p.grad``.
    """

    def __init__(self, params, kind: str = "adam", *, weight_decay: float = 0.01, betas=(0.9, 0.999),
                 eps: float = 1e-8, momentum: float = 0.9):
        if kind not in OPTIMIZERS:
            raise UsageError(f"optimizer={kind!r} is unknown: use one of {', '.join(OPTIMIZERS)}")
        self.kind, self.betas, self.eps, self.momentum = kind, betas, eps, momentum
        self.params = [(p, 0.0 if no_weight_decay(n, p) else weight_decay) for n, p in params]
        self.state: dict = {}
        self.step_count = 0

    @torch.no_grad()
    def step(self, lr: float) -> None:
        self.step_count += 1
        t = self.step_count
        for p, wd in self.params:
            g = p.grad
            if g is None:
                continue
            st = self.state.setdefault(id(p), {})
            if self.kind == "adam":
                b1, b2 = self.betas
                if not st:
                    st["exp_avg"], st["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                p.mul_(1 - lr * wd)
                st["exp_avg"].lerp_(g, 1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(g, g, value=1 - b2)
                step_size = lr / (1 - b1 ** t)
                denom = (st["exp_avg_sq"].sqrt() / math.sqrt(1 - b2 ** t)).add_(self.eps)
                p.addcdiv_(st["exp_avg"], denom, value=-step_size)
            else:
                d = g.add(p, alpha=wd) if wd else g
                if self.momentum:
                    if "momentum_buffer" not in st:
                        st["momentum_buffer"] = d.clone()
                    else:
                        st["momentum_buffer"].mul_(self.momentum).add_(d)
                    d = st["momentum_buffer"]
                p.add_(d, alpha=-lr)

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for st in self.state.values() for t in st.values())

    @property
    def state_keys(self) -> tuple:
        """The names of a parameter's state tensors: Adam's two moments, SGD's momentum buffer (none
        without momentum) -- torch.optim's names, which megatron-core's checkpoints use too."""
        if self.kind == "adam":
            return ("exp_avg", "exp_avg_sq")
        return ("momentum_buffer",) if self.momentum else ()

    def param_state(self, param: torch.Tensor) -> dict:
        """``{state name: tensor}`` of ``param`` (one of :attr:`params`), zeros of its shape for a state
        no step has made yet."""
        st = self.state.get(id(param), {})
        return {k: st[k].detach() if k in st else torch.zeros_like(param) for k in self.state_keys}

    def load_param_state(self, param: torch.Tensor, values: dict) -> None:
        """Set ``param``'s state tensors to a copy of ``values`` (``{state name: tensor}``, any shape of
        ``param``'s size), in ``param``'s device and dtype."""
        self.state[id(param)] = {k: v.to(param.device, param.dtype).clone() for k, v in values.items()}

    def state_dict(self) -> dict:
        """What a step depends on besides the tensors: ``{"kind", "step_count"}`` (Adam's bias correction)."""
        return {"kind": self.kind, "step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = state["step_count"]


class LRScheduler:
    """Megatron's ``OptimizerParamScheduler.get_lr`` (``megatron/core/optimizer_param_scheduler.py``),
    counted in samples: linear warm-up from 0, then constant / linear / cosine decay to ``min_lr``."""

    def __init__(self, max_lr: float, min_lr: float, style: str, warmup_steps: int, decay_steps: int):
        if style not in LR_DECAY_STYLES:
            raise UsageError(f"lr_decay_style={style!r} is unknown: use one of {', '.join(LR_DECAY_STYLES)}")
        self.max_lr, self.min_lr, self.style = max_lr, min_lr, style
        self.warmup_steps, self.decay_steps = warmup_steps, decay_steps
        self.num_steps = 0

    def get_lr(self) -> float:
        n = self.num_steps
        if self.warmup_steps > 0 and n <= self.warmup_steps:
            return self.max_lr * n / self.warmup_steps
        if self.style == "constant":
            return self.max_lr
        if n > self.decay_steps:
            return self.min_lr
        ratio = (n - self.warmup_steps) / (self.decay_steps - self.warmup_steps)
        coeff = 1.0 - ratio if self.style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: int) -> float:
        self.num_steps += increment
        return self.get_lr()

    def state_dict(self) -> dict:
        """megatron-core's ``OptimizerParamScheduler.state_dict()`` learning-rate keys (steps in samples)."""
        return {"max_lr": self.max_lr, "lr_warmup_steps": self.warmup_steps, "num_steps": self.num_steps,
                "lr_decay_style": self.style, "lr_decay_steps": self.decay_steps, "min_lr": self.min_lr}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``'s step count (the schedule itself comes from this run's flags, as
        Megatron's ``--override-opt-param-scheduler`` keeps it)."""
        self.num_steps = state["num_steps"]


@torch.no_grad()
def clip_grads(params, total_norm: float, clip_grad: float) -> None:
    """Scale gradients by ``clip_grad / (norm + 1e-6)`` when that is < 1 (``clip_grad_by_total_norm_fp32``)."""
    if clip_grad <= 0:
        return
    coeff = clip_grad / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coeff)
