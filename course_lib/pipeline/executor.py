"""Run a pipeline schedule on real ranks: real processes, real P2P messages, real gradients.

:func:`run_rank_schedule` is the worker (inside one rank): a :class:`RankRunner` walks
the rank's :func:`~course_lib.pipeline.check.comm_plan` -- actions and point-to-point
steps -- and for each action runs real autograd on its model chunk (one method each):

* ``F``: receive the ``[s, b, h]`` activation (stage 0: take the tokens), run the
  chunk, keep input and output for the backward, send the output on (the last
  stage computes the loss ``/ num_microbatches``, as Megatron's ``forward_step``);
* ``B``: receive the output gradient, backpropagate, send the input gradient back.
  Megatron's ``backward_step`` does ``torch.autograd.backward(output, grad)``;
* zero-bubble split (Qi et al. 2023, Sec. 2): ``B`` computes only the gradients
  w.r.t. the chunk input and w.r.t. the output of every layer that owns weights;
  ``W`` later turns those into weight gradients, one layer at a time
  (``autograd.grad(layer_output, layer_params, saved_grad)``), then frees the
  micro-batch's activations.

Messages go through ``torch.distributed`` point-to-point on the pipeline group
(passed in; gloo on CPU) in the protocol ``p2p`` (see
:mod:`course_lib.pipeline.check`, which proves it cannot deadlock):
``"batched"`` = Megatron's ``batch_isend_irecv`` of the previous action's sends
with the next action's receives; ``"prefetch"`` = every receive of the iteration
posted up front in the sender's order, sends blocking; ``"blocking"`` = plain
``send``/``recv`` (deadlocks for 1F1B -- try it with a short timeout).

Every action's real start/end (``time.perf_counter``, one clock for all processes
on a machine) is recorded. With ``compute_time=(t_f, t_b, t_w)`` each action is
padded by sleeping to a fixed duration (calibrated compute: on a 2-core laptop
the measured bubble then follows the schedule, not the CPU contention).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from course_lib import comm
from course_lib.pipeline.check import (Step, check_schedule, comm_plan, incoming_messages, inputs_of,
                                       outputs_of)
from course_lib.pipeline.schedules import Action, PipelineSchedule
from course_lib.pipeline.simulate import Event, Timeline, live_activations
from course_lib.pipeline.stages import (StackConfig, build_stages, layer_split, lm_loss, make_batch,
                                        reference_gradients)
from course_lib.saved_tensors import SavedTensorRecorder, activation_bytes
from course_lib.rules import UsageError

_WEIGHT_MODULES = (torch.nn.Linear, torch.nn.LayerNorm, torch.nn.Embedding)


@dataclass
class _Stored:
    """What a micro-batch keeps on one chunk between its F and its last backward piece."""

    x: Optional[torch.Tensor]          # the received activation (a leaf), None on stage 0
    y: torch.Tensor                    # chunk output, or the scaled loss on the last stage
    sites: list = field(default_factory=list)   # [(layer output, [its params])] for the B/W split
    site_grads: Optional[list] = None
    nbytes: int = 0                    # bytes of activations saved for backward


def _record_sites(module: torch.nn.Module, sites: list):
    """Forward hooks that append ``(output, params)`` of every layer owning weights to ``sites``."""
    handles = []
    for sub in module.modules():
        if isinstance(sub, _WEIGHT_MODULES):
            params = list(sub.parameters(recurse=False))
            handles.append(sub.register_forward_hook(
                lambda mod, inp, out, params=params: sites.append((out, params))))
    return handles


def _accumulate(params, grads):
    for p, g in zip(params, grads):
        if g is None:
            continue
        p.grad = g.clone() if p.grad is None else p.grad.add_(g)


class _Prefetcher:
    """Posts every receive this rank will get, per sender in the sender's order (``p2p="prefetch"``)."""

    def __init__(self, schedule, rank, shape, device, to_global, group):
        self.pending = []
        for src, msgs in incoming_messages(schedule, rank).items():
            for msg in msgs:
                buf = torch.empty(shape, device=device)
                self.pending.append((msg, buf, dist.irecv(buf, src=to_global(src), group=group)))
        self.index = {msg: i for i, (msg, _, _) in enumerate(self.pending)}

    def get(self, msg):
        _, buf, work = self.pending[self.index[msg]]
        work.wait()
        return buf


class RankRunner:
    """One rank's part of a schedule, run for real: the state lives here, one method per action.

    ``forward`` / ``backward`` / ``weight`` run the ``F`` / ``B`` / ``W`` actions on a model
    chunk (Megatron's ``forward_step`` / ``backward_step``; the B/W split of Qi et al. 2023);
    ``communicate`` runs one point-to-point :class:`~course_lib.pipeline.check.Step` in the
    chosen protocol; :meth:`run` walks the rank's ``comm_plan``. Arguments: see
    :func:`run_rank_schedule`, which builds one and runs it.

    State: ``inbox`` (received ``[s, b, h]`` tensors by message), ``outbox`` (tensors to send),
    ``stored`` (each live micro-batch's :class:`_Stored` by ``(microbatch, chunk)``),
    ``live_bytes`` (activation bytes held for backward now), and what :meth:`run` reports:
    ``events``, ``losses``, ``peak_live``, ``peak_bytes``.
    """

    def __init__(self, schedule: PipelineSchedule, rank: int, chunks: dict, tokens, labels, *,
                 activation_shape, pp_group, p2p: str = "batched", compute_time=None, loss_fn=None):
        if pp_group is None:
            raise UsageError("pp_group is None: pass this rank's pipeline process group explicitly (groups.pp, or "
                             "dist.group.WORLD when every rank is a stage of one pipeline)")
        self.schedule, self.rank, self.chunks = schedule, rank, chunks
        self.tokens, self.labels = tokens, labels
        self.pp_group, self.p2p = pp_group, p2p
        self.loss_fn = lm_loss if loss_fn is None else loss_fn
        self.num_microbatches = schedule.num_microbatches
        self.micro_batch_size = tokens.shape[0] // self.num_microbatches
        self.shape = tuple(activation_shape)  # [s, b, h], Megatron's tensor_shape
        self.device = tokens.device           # receive buffers live where the model runs (CPU with gloo)
        self.split = {(a.microbatch, a.chunk_id) for a in schedule.ranks[rank] if a.kind == "W"}
        self.durations = None
        if compute_time is not None:
            t_f, t_b, t_w = (float(t) / schedule.vp_size for t in compute_time)
            self.durations = {"F": t_f, "B": t_b, "W": t_w}
        self.inbox: dict = {}
        self.outbox: dict = {}
        self.stored: dict = {}
        self.events: list = []
        self.losses: list = []
        self.live_bytes = self.peak_bytes = self.peak_live = 0
        self.prefetcher = (_Prefetcher(schedule, rank, self.shape, self.device, self.to_global, pp_group)
                           if p2p == "prefetch" else None)

    # ---- point-to-point -------------------------------------------------------------------
    def to_global(self, r: int) -> int:
        """Global rank of pipeline rank ``r`` (the group's own numbering is the schedule's)."""
        return dist.get_global_rank(self.pp_group, r) if self.schedule.pp_size > 1 else r

    def outgoing(self, msg):
        """The tensor for ``msg``, recorded (kind "pp") for an active CommRecorder."""
        t = self.outbox.pop(msg)
        comm.record_event("send", t.numel(), group_size=self.schedule.pp_size, kind="pp",
                          direction="fwd" if msg.kind == "act" else "bwd", source="pipeline_executor",
                          tag=str(msg), peer=self.to_global(msg.dst), dtype=t.dtype)
        return t

    def communicate(self, step: Step) -> None:
        """Send ``step.sends`` and receive ``step.recvs`` (into ``inbox``) in the ``p2p`` protocol."""
        group = self.pp_group
        if self.p2p == "prefetch":
            for msg in step.recvs:
                self.inbox[msg] = self.prefetcher.get(msg)
            for msg in step.sends:
                dist.send(self.outgoing(msg), dst=self.to_global(msg.dst), group=group)
            return
        bufs = {msg: torch.empty(self.shape, device=self.device) for msg in step.recvs}
        if self.p2p == "blocking":
            for msg in step.sends:
                dist.send(self.outgoing(msg), dst=self.to_global(msg.dst), group=group)
            for msg, buf in bufs.items():
                dist.recv(buf, src=self.to_global(msg.src), group=group)
        else:  # batched: one batch_isend_irecv, like Megatron's _communicate
            ops = [dist.P2POp(dist.isend, self.outgoing(msg), self.to_global(msg.dst), group) for msg in step.sends]
            ops += [dist.P2POp(dist.irecv, buf, self.to_global(msg.src), group) for msg, buf in bufs.items()]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        self.inbox.update(bufs)

    # ---- the actions ----------------------------------------------------------------------
    def forward(self, a: Action, s: int) -> None:
        """F: run chunk ``a.chunk_id`` on micro-batch ``a.microbatch`` (virtual stage ``s``)."""
        chunk = self.chunks[a.chunk_id]
        rows = slice(a.microbatch * self.micro_batch_size, (a.microbatch + 1) * self.micro_batch_size)
        x = None
        if s == 0:
            inp = self.tokens[rows]
        else:
            x = inp = self.inbox.pop(inputs_of(self.schedule, self.rank, a)[0]).requires_grad_()
        entry = _Stored(x=x, y=None)
        hooks = _record_sites(chunk, entry.sites) if (a.microbatch, a.chunk_id) in self.split else []
        try:
            with SavedTensorRecorder(chunk) as saved:
                out = chunk(inp)
                if s == self.schedule.num_stages - 1:
                    loss = self.loss_fn(out, self.labels[rows]) / self.num_microbatches  # Megatron's forward_step
                    self.losses.append(loss.item())
                    out = loss
        finally:
            for h in hooks:
                h.remove()
        entry.y, entry.nbytes = out, activation_bytes(saved.records)
        self.stored[(a.microbatch, a.chunk_id)] = entry
        self.live_bytes += entry.nbytes
        for msg in outputs_of(self.schedule, self.rank, a):
            self.outbox[msg] = out.detach().contiguous()

    def backward(self, a: Action, s: int) -> None:
        """B: the input gradient (full backward, or the B half of a B/W split); queue it for sending."""
        key = (a.microbatch, a.chunk_id)
        entry = self.stored[key]
        last = s == self.schedule.num_stages - 1
        grad_in = None if last else self.inbox.pop(inputs_of(self.schedule, self.rank, a)[0])
        if key in self.split:  # B: input gradient (+ the layer-output gradients W will need)
            targets = ([entry.x] if entry.x is not None else []) + [out for out, _ in entry.sites]
            grads = torch.autograd.grad(entry.y, targets, grad_outputs=grad_in, retain_graph=True,
                                        allow_unused=True)
            x_grad = grads[0] if entry.x is not None else None
            entry.site_grads = list(grads[1:] if entry.x is not None else grads)
        else:                  # full backward: input and weight gradients at once
            torch.autograd.backward(entry.y, grad_tensors=grad_in)
            x_grad = entry.x.grad if entry.x is not None else None
            self.live_bytes -= self.stored.pop(key).nbytes
        for msg in outputs_of(self.schedule, self.rank, a):
            self.outbox[msg] = x_grad.contiguous()

    def weight(self, a: Action, s: int) -> None:
        """W: the weight gradients of a B/W-split micro-batch, layer by layer; frees its activations."""
        entry = self.stored.pop((a.microbatch, a.chunk_id))
        for (out, params), g in zip(entry.sites, entry.site_grads):
            if g is not None:
                _accumulate(params, torch.autograd.grad(out, params, g, retain_graph=True, allow_unused=True))
        self.live_bytes -= entry.nbytes

    def _pad(self, a: Action, start: float) -> None:
        """Sleep until the action has taken its calibrated duration (``compute_time``)."""
        wanted = self.durations[a.kind]
        if a.kind == "B" and (a.microbatch, a.chunk_id) not in self.split:
            wanted += self.durations["W"]
        rest = start + wanted - time.perf_counter()
        if rest > 0:
            time.sleep(rest)

    def run(self) -> dict:
        """Walk the rank's ``comm_plan``; return its events, losses and memory figures."""
        action = {"F": self.forward, "B": self.backward, "W": self.weight}
        if self.schedule.pp_size > 1:
            dist.barrier(group=self.pp_group)  # start together: times are comparable across ranks
        for item in comm_plan(self.schedule, self.rank, self.p2p):
            if isinstance(item, Step):
                self.communicate(item)
                continue
            s = self.schedule.stage(self.rank, item)
            start = time.perf_counter()
            action[item.kind](item, s)
            if self.durations is not None:
                self._pad(item, start)
            self.events.append((str(item), s, start, time.perf_counter()))
            self.peak_live = max(self.peak_live, len(self.stored))
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        return dict(events=self.events, losses=self.losses, peak_live=self.peak_live, peak_bytes=self.peak_bytes,
                    p2p=self.p2p)


def run_rank_schedule(schedule: PipelineSchedule, rank: int, chunks: dict, tokens, labels, *,
                      activation_shape, pp_group, p2p: str = "batched", compute_time=None,
                      loss_fn=None) -> dict:
    """Run rank ``rank``'s part of ``schedule`` (a :class:`RankRunner`); return its events, losses and memory.

    ``chunks``: ``{chunk id: module}`` (virtual stage ``chunk * pp + rank``);
    ``tokens``/``labels``: [m * micro_batch, s] (each rank gets the whole batch;
    only stage 0 reads tokens, only the last stage labels). ``activation_shape``:
    ``[s, b, h]`` of what crosses a stage boundary. Gradients accumulate in
    the modules' ``.grad``. ``pp_group``: the pipeline process group this rank belongs to
    (``groups.pp``; ``dist.group.WORLD`` only when the whole world is one pipeline), required
    and never defaulted: a wrong default would pair ranks of different pipelines.
    ``compute_time``: ``(t_f, t_b, t_w)`` seconds per micro-batch per rank-stage (a chunk
    takes ``1 / vp`` of it), or ``None`` for real speed. ``loss_fn(output, labels)``: the last
    stage's loss of one micro-batch (a scalar; default :func:`~course_lib.pipeline.stages.lm_loss`);
    the executor divides it by the number of micro-batches, as Megatron's ``forward_step`` does.

    Returns ``{"events": [(action, stage, start, end)], "losses": [...], "peak_live": micro-batches
    held at most, "peak_bytes": activation bytes held at most, "p2p": protocol}``.
    """
    return RankRunner(schedule, rank, chunks, tokens, labels, activation_shape=activation_shape,
                      pp_group=pp_group, p2p=p2p, compute_time=compute_time, loss_fn=loss_fn).run()


def _pipeline_rank(schedule: PipelineSchedule, cfg: StackConfig, p2p: str, compute_time) -> dict:
    """One rank of :func:`execute`: build this rank's chunks, run the schedule, return grads by name."""
    rank = dist.get_rank()
    model, chunks = build_stages(cfg, rank, schedule.pp_size, schedule.vp_size)
    tokens, labels = make_batch(cfg, schedule.num_microbatches)
    shape = (cfg.seq_length, cfg.micro_batch_size, cfg.hidden_size)
    out = run_rank_schedule(schedule, rank, chunks, tokens, labels, activation_shape=shape,
                            pp_group=dist.group.WORLD, p2p=p2p, compute_time=compute_time)
    mine = {id(p) for c in chunks.values() for p in c.parameters()}
    out["grads"] = {n: p.grad.clone() for n, p in model.named_parameters() if id(p) in mine and p.grad is not None}
    out["owned"] = sorted(n for n, p in model.named_parameters() if id(p) in mine)
    return out


@dataclass
class PipelineRun:
    """What :func:`execute` measured: the timeline, the gradients of every parameter, the loss."""

    timeline: Timeline
    grads: dict
    loss: float
    p2p: str
    peak_bytes: list
    owned: list

    def max_grad_error(self, reference: dict) -> float:
        """Largest ``|grad - reference grad|`` over all parameters (every one must be present)."""
        missing = sorted(set(reference) - set(self.grads))
        if missing:
            raise UsageError(f"no gradient for {missing[:3]}: a stage did not run its backward")
        return max(float((self.grads[n] - g).abs().max()) for n, g in reference.items())


_AUTOGRAD_WARM = False


def warm_up_autograd() -> None:
    """Run one tiny backward in this (parent) process before forking ranks.

    In torch 2.13 the first ``autograd.backward(y, grad_tensors=g)`` with a
    non-scalar ``y`` in a process imports ~500 modules (sympy, mpmath): ~1 s, and
    2-5 s when every forked rank does it at once on 2 cores. Forked ranks inherit
    the imports, so doing it once here keeps measured timelines clean.
    """
    global _AUTOGRAD_WARM
    if not _AUTOGRAD_WARM:
        x = torch.ones(2, requires_grad=True)
        torch.autograd.backward(x * 2, grad_tensors=torch.ones(2))
        _AUTOGRAD_WARM = True


def execute(schedule: PipelineSchedule, cfg: StackConfig = StackConfig(), *, p2p: Optional[str] = None,
            compute_time=None, timeout: float = 60, check: bool = True) -> PipelineRun:
    """Run ``schedule`` on ``pp_size`` real ranks (forked, gloo, CPU) over the toy model ``cfg``.

    (On a GPU box call :func:`run_rank_schedule` from your own launch with the
    model and tokens on the rank's GPU: buffers follow ``tokens.device``.)

    ``p2p``: ``None`` = the protocol :func:`~course_lib.pipeline.check.check_schedule`
    proves deadlock-free (``"batched"`` when possible); ``"blocking"`` shows the
    deadlock (raises ``LaunchTimeout`` after ``timeout`` s; pass ``check=False``,
    otherwise the checker refuses it first). Returns a :class:`PipelineRun` whose
    timeline is labelled ``source="measured"``.
    """
    from course_lib.launch import launch

    layer_split(cfg.num_layers, schedule.num_stages, cfg.layers_per_stage,  # bad splits fail here, in one line
                vp_size=schedule.vp_size)
    if check:
        chosen = check_schedule(schedule, p2p)
    elif p2p in ("blocking", "batched", "prefetch"):
        chosen = p2p
    else:
        raise UsageError(f"check=False needs an explicit p2p ('blocking', 'batched' or 'prefetch'), got {p2p!r}")
    warm_up_autograd()
    results = launch(_pipeline_rank, world_size=schedule.pp_size, backend="gloo", output="none", timeout=timeout,
                     schedule=schedule, cfg=cfg, p2p=chosen, compute_time=compute_time)
    t0 = min(r["events"][0][2] for r in results if r["events"])
    events = []
    for rank, res in enumerate(results):
        acts = schedule.ranks[rank]
        events.append([Event(rank, a, s, start - t0, end - t0)
                       for a, (_, s, start, end) in zip(acts, res["events"])])
    peaks = [res["peak_live"] for res in results]
    info = dict(compute_time=compute_time, p2p=chosen, cfg=cfg)
    timeline = Timeline(schedule, events, peaks, "measured", info)
    grads = {n: g for res in results for n, g in res["grads"].items()}
    loss = sum(sum(res["losses"]) for res in results)
    return PipelineRun(timeline, grads, loss, chosen, [res["peak_bytes"] for res in results],
                       [res["owned"] for res in results])


__all__ = ["run_rank_schedule", "RankRunner", "execute", "PipelineRun", "reference_gradients", "live_activations"]
