"""Mixed precision as Megatron-LM does it: 16-bit compute, fp32 main params, loss scaling for fp16.

For: the trainer's ``--bf16`` / ``--fp16``. Main names: :class:`ConstantLossScaler`,
:class:`DynamicLossScaler`, :func:`make_loss_scaler`, :func:`to_float16` (Float16Module semantics),
:class:`MixedPrecisionOptimizer` (fp32 main params).
Follows: ``megatron/core/optimizer/grad_scaler.py``, ``megatron/core/transformer/module.py``
``Float16Module``, ``megatron/core/optimizer/optimizer.py`` ``Float16OptimizerWithFloat16Params``;
Micikevicius et al. 2018 (loss scaling).
Manual (the scaler's rules, the protocol, bytes per parameter): docs/internals/mixed_precision.md.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
from torch import nn

from course_lib import comm, rules

__all__ = ["DTYPES", "ConstantLossScaler", "DynamicLossScaler", "unscale_and_check", "make_loss_scaler",
           "Float16Module", "to_float16", "MixedPrecisionOptimizer", "precision_dtype", "skipped_iterations_text"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# Megatron-LM's defaults (megatron/training/arguments.py::_add_mixed_precision_args)
INITIAL_LOSS_SCALE = 2.0 ** 32
MIN_LOSS_SCALE = 1.0
LOSS_SCALE_WINDOW = 1000
HYSTERESIS = 2
GROWTH_FACTOR = 2.0   # megatron/training/training.py passes growth_factor=2.0, backoff_factor=0.5
BACKOFF_FACTOR = 0.5


def precision_dtype(bf16: bool = False, fp16: bool = False) -> torch.dtype:
    """The compute dtype for Megatron's ``--bf16`` / ``--fp16`` (neither: fp32); both -> one-line ValueError."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[rules.precision(bf16, fp16)]


@torch.no_grad()
def unscale_and_check(grads: Iterable[Optional[torch.Tensor]], scale: torch.Tensor, group=None) -> bool:
    """Divide every fp32 grad in ``grads`` (any shapes; None skipped) by ``scale`` ``[1]`` in place and
    say whether any of them holds an inf or NaN on *any* rank of ``group``.

    The flag is a ``[1]`` fp32 tensor all-reduced with MAX over ``group`` (recorded by
    :mod:`course_lib.comm` as kind ``"mp"``); ``group=None`` or a group of one: this rank alone."""
    grads = [g for g in grads if g is not None]
    device = grads[0].device if grads else scale.device      # NCCL reduces CUDA tensors: the flag lives with them
    inv = scale.double().reciprocal().float()
    found = torch.zeros(1, dtype=torch.float32, device=device)
    for g in grads:
        if g.dtype != torch.float32:
            raise rules.UsageError(f"unscale_and_check: grads must be the fp32 main grads, got {g.dtype}")
        g.mul_(inv.to(g.device))
        if not torch.isfinite(g).all():
            found.fill_(1.0)
    if group is not None:
        comm.all_reduce(found, group, op="max", kind="mp", source="unscale_and_check")
    return bool(found.item() > 0)


class _LossScaler:
    """Shared protocol: ``scale`` [1] fp32, ``unscale_and_check``, ``update``, ``skipped_iterations``."""

    def __init__(self, scale: float):
        value = rules.number("loss_scale", scale, low=0.0, low_open=True)
        self._scale = torch.tensor([float(value)], dtype=torch.float32)
        self.skipped_iterations = 0

    @property
    def scale(self) -> torch.Tensor:
        return self._scale

    @property
    def value(self) -> float:
        return float(self._scale.item())

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale`` (the fp32 loss the backward pass starts from)."""
        return loss * self._scale.to(loss.device)

    def unscale_and_check(self, grads, group=None) -> bool:
        return unscale_and_check(grads, self._scale, group)

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.skipped_iterations += 1
        self._update(bool(found_inf))

    def _update(self, found_inf: bool) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict:
        """What a checkpoint keeps (Megatron's ``grad_scaler.state_dict``); ``scale`` is exact (fp32 in a float)."""
        return {"scale": self.value, "skipped_iterations": self.skipped_iterations}

    def load_state_dict(self, state: dict) -> None:
        """Continue from :meth:`state_dict`'s values (a resumed run scales as the straight one would)."""
        self._scale = torch.tensor([float(state["scale"])], dtype=torch.float32)
        self.skipped_iterations = int(state["skipped_iterations"])


class ConstantLossScaler(_LossScaler):
    """``--loss-scale S``: ``S`` forever; an overflowing iteration is still skipped (and counted)."""

    def _update(self, found_inf: bool) -> None:
        pass


class DynamicLossScaler(_LossScaler):
    """Megatron's dynamic loss scale (rules in the module docstring; defaults are Megatron's flags').

    State: ``growth_tracker`` (good iterations in a row since the last growth or bad one) and
    ``hysteresis_tracker`` (bad iterations still tolerated before backing off)."""

    def __init__(self, initial_scale: float = INITIAL_LOSS_SCALE, min_scale: float = MIN_LOSS_SCALE,
                 growth_factor: float = GROWTH_FACTOR, backoff_factor: float = BACKOFF_FACTOR,
                 growth_interval: int = LOSS_SCALE_WINDOW, hysteresis: int = HYSTERESIS):
        super().__init__(initial_scale)
        _, _, self.min_scale, growth_interval, hysteresis = rules.loss_scale(
            None, initial_scale, min_scale, growth_interval, hysteresis)
        if rules.number("growth_factor", growth_factor) <= 1.0:
            raise rules.UsageError(f"growth_factor={growth_factor} must be > 1")
        if not 0.0 < rules.number("backoff_factor", backoff_factor) < 1.0:
            raise rules.UsageError(f"backoff_factor={backoff_factor} must be between 0 and 1")
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.growth_tracker = 0
        self.hysteresis_tracker = self.hysteresis

    def _update(self, found_inf: bool) -> None:
        if found_inf:
            self.growth_tracker = 0
            self.hysteresis_tracker -= 1
            if self.hysteresis_tracker <= 0:
                self._scale = torch.clamp(self._scale * self.backoff_factor, min=self.min_scale)
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.growth_tracker = 0
            self.hysteresis_tracker = self.hysteresis
            self._scale = self._scale * self.growth_factor

    def state_dict(self) -> dict:
        return {**super().state_dict(), "growth_tracker": self.growth_tracker,
                "hysteresis_tracker": self.hysteresis_tracker}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.growth_tracker, self.hysteresis_tracker = int(state["growth_tracker"]), int(state["hysteresis_tracker"])


def make_loss_scaler(fp16: bool, loss_scale: Optional[float] = None, initial_loss_scale: float = INITIAL_LOSS_SCALE,
                     min_loss_scale: float = MIN_LOSS_SCALE, loss_scale_window: float = LOSS_SCALE_WINDOW,
                     hysteresis: int = HYSTERESIS, *, bf16: bool = False, distributed_optimizer: bool = False):
    """The scaler Megatron builds (``megatron/core/optimizer/__init__.py``, main d98e8a6 ~644-656): with
    ``--fp16``, ``--bf16`` or the distributed optimizer, ``--loss-scale`` gives a constant scaler and fp16
    without it a dynamic one; otherwise none (returns None) -- bf16 without ``--loss-scale`` has none.

    ``--loss-scale-window`` is a float flag in Megatron; it must be a whole number here."""
    loss_scale, initial, minimum, window, hysteresis = rules.loss_scale(
        loss_scale, initial_loss_scale, min_loss_scale, loss_scale_window, hysteresis)
    if not (fp16 or bf16 or distributed_optimizer):
        return None
    if loss_scale is not None:
        return ConstantLossScaler(loss_scale)
    if not fp16:
        return None
    return DynamicLossScaler(initial, minimum, GROWTH_FACTOR, BACKOFF_FACTOR, window, hysteresis)


def skipped_iterations_text(count: int) -> str:
    """The field of Megatron's iteration log line (``training_log``): ``' number of skipped iterations:   N |'``."""
    return f" number of skipped iterations: {int(count):3d} |"


# ----------------------------------------------------------------------------- 16-bit model


class Float16Module(nn.Module):
    """``module`` with 16-bit params; floating inputs cast to ``dtype``, floating outputs back to fp32.

    Megatron's ``Float16Module``: the first pipeline stage converts its (floating) inputs, the last
    stage returns fp32 (``fp32_output=True``). Token ids ``[b, s]`` (integers) pass unchanged, so
    for :class:`course_lib.model.GPTModel` the forward is ``tokens [b, s] -> logits [s, b, V] fp32``.
    ``pre_process`` / ``post_process`` say whether this chunk is the first / last stage."""

    def __init__(self, module: nn.Module, dtype: torch.dtype, pre_process: bool = True, post_process: bool = True):
        super().__init__()
        if dtype not in (torch.bfloat16, torch.float16):
            raise rules.UsageError(f"Float16Module needs bfloat16 or float16, got {dtype}")
        self.module, self.dtype = module.to(dtype), dtype
        self.pre_process, self.post_process = pre_process, post_process

    def forward(self, *inputs, **kwargs):
        if self.pre_process:
            inputs = tuple(x.to(self.dtype) if torch.is_tensor(x) and x.is_floating_point() else x for x in inputs)
        out = self.module(*inputs, **kwargs)
        if self.post_process and torch.is_tensor(out) and out.is_floating_point():
            out = out.float()
        return out

    def loss(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy in fp32 on the fp32 logits (tokens, labels ``[b, s]``)."""
        logits = self(tokens)                                                       # [s, b, V] fp32
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.t().reshape(-1))


def to_float16(module: nn.Module, precision: str) -> nn.Module:
    """``precision`` ``"bf16"``/``"fp16"``: the module wrapped in :class:`Float16Module` (params cast in
    place); ``"fp32"``: the module itself."""
    if precision not in DTYPES:
        raise rules.UsageError(f"precision={precision!r} is unknown: use one of {', '.join(DTYPES)}")
    return module if precision == "fp32" else Float16Module(module, DTYPES[precision])


class MixedPrecisionOptimizer:
    """fp32 main params for 16-bit model params, stepped by the course's Adam/SGD, with an optional scaler.

    ``named_params``: ``[(name, param)]`` of the (16-bit or fp32) model. For each one an fp32 main
    param of the same shape is kept (fp32 model params are their own main params, as in Megatron's
    ``FP32Optimizer``). ``optimizer_kwargs`` go to :class:`course_lib.optimizer.Optimizer`.

    Per iteration: run forward/backward on ``scaler.scale_loss(loss)`` if there is a scaler (see
    :meth:`backward`), optionally :meth:`reduce_grads` over the data-parallel group, then
    :meth:`step` -> ``(updated, found_inf)``; :meth:`zero_grad` before the next one.

    ``accumulate_allreduce_grads_in_fp32``: every param gets ``main_grad`` (fp32, shape of the
    param) and a post-accumulate-grad hook that adds ``param.grad`` into it and frees
    ``param.grad``; otherwise grads stay in the param's dtype until :meth:`step` casts them."""

    def __init__(self, named_params: Sequence, *, scaler=None, accumulate_allreduce_grads_in_fp32: bool = False,
                 grad_stats_group=None, **optimizer_kwargs):
        from course_lib.optimizer import Optimizer

        self.named_params = list(named_params)
        self.scaler = scaler
        self.fp32_accumulation = bool(accumulate_allreduce_grads_in_fp32)
        self.grad_stats_group = grad_stats_group
        self.main_params = []
        for name, p in self.named_params:
            main = p if p.dtype == torch.float32 else nn.Parameter(p.detach().float().clone())
            self.main_params.append((name, main))
        self.optimizer = Optimizer(self.main_params, **optimizer_kwargs)
        self._hooks = []
        if self.fp32_accumulation:
            for _, p in self.named_params:
                p.main_grad = torch.zeros_like(p, dtype=torch.float32)
                self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulate))

    @staticmethod
    @torch.no_grad()
    def _accumulate(p: torch.Tensor) -> None:
        p.main_grad.add_(p.grad.float())
        p.grad = None

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` on the scaled loss (fp16 with a scaler) or the loss itself."""
        (self.scaler.scale_loss(loss) if self.scaler is not None else loss).backward()

    def model_grads(self) -> list:
        """The tensors the data-parallel all-reduce works on: ``main_grad`` (fp32) or ``.grad`` (16-bit)."""
        return [(p.main_grad if self.fp32_accumulation else p.grad) for _, p in self.named_params]

    @torch.no_grad()
    def reduce_grads(self, dp_group, average: bool = True) -> None:
        """All-reduce (then average) the model grads over ``dp_group`` in their own dtype (kind ``"dp"``)."""
        d = comm.group_size(dp_group)
        for g in self.model_grads():
            if g is None:
                continue
            comm.all_reduce(g, dp_group, kind="dp", source="MixedPrecisionOptimizer.reduce_grads")
            if average and d > 1:
                g.div_(d)

    @torch.no_grad()
    def step(self, lr: float) -> tuple[bool, bool]:
        """Copy model grads into fp32 main grads, unscale/check (scaler), step, copy main -> model params.

        Returns ``(updated, found_inf)``; on found_inf no parameter changes (Megatron skips the step)."""
        for (_, p), (_, main) in zip(self.named_params, self.main_params):
            g = p.main_grad if self.fp32_accumulation else p.grad
            if main is p:
                if self.fp32_accumulation:
                    p.grad = None if g is None else g.clone()
                continue
            # fp32 accumulation: the fp32 main_grad *is* the main grad (no copy); else an fp32 copy
            main.grad = None if g is None else (g if g.dtype == torch.float32 else g.float())
        found_inf = False
        if self.scaler is not None:
            found_inf = self.scaler.unscale_and_check([m.grad for _, m in self.main_params], self.grad_stats_group)
            self.scaler.update(found_inf)
        if found_inf:
            return False, True
        self.optimizer.step(lr)
        for (_, p), (_, main) in zip(self.named_params, self.main_params):
            if main is not p:
                p.data.copy_(main.data)           # rounds to the model's 16-bit dtype
        return True, False

    def zero_grad(self) -> None:
        for (_, p), (_, main) in zip(self.named_params, self.main_params):
            p.grad = None
            main.grad = None
            if self.fp32_accumulation:
                p.main_grad.zero_()

    def state_bytes(self) -> dict:
        """Bytes this rank holds (call after :meth:`step`, before :meth:`zero_grad`): model ``params``,
        model ``grads`` (``main_grad`` or ``.grad``), fp32 ``main_params`` (0 when the model is fp32),
        fp32 ``main_grads`` that are copies (0 when the model's grad is already fp32) and the
        optimizer's moments (``optimizer_state``)."""
        params = sum(p.numel() * p.element_size() for _, p in self.named_params)
        model_grads = [g for g in self.model_grads() if g is not None]
        grads = sum(g.numel() * g.element_size() for g in model_grads)
        pairs = list(zip(self.named_params, self.main_params))
        main = sum(m.numel() * 4 for (_, p), (_, m) in pairs if m is not p)
        main_grads = sum(m.grad.numel() * 4 for (_, p), (_, m) in pairs
                         if m is not p and m.grad is not None and not any(m.grad is g for g in model_grads))
        return {"params": params, "grads": grads, "main_params": main, "main_grads": main_grads,
                "optimizer_state": self.optimizer.state_bytes()}

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
