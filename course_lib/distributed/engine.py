"""One wrapper for Megatron's DDP, distributed optimizer and Megatron-FSDP's ZeRO-2/3 (see the package doc).

What each strategy keeps on a rank (``P`` parameters, ``d`` data-parallel ranks; Megatron-FSDP's
``--data-parallel-sharding-strategy``, ZeRO's stages, Rajbhandari et al. 2020 §5):

======================  ========  ===================  ======================  ================================
strategy                ZeRO      params (model dtype)  grads (grad dtype)      optimizer (fp32 main, Adam m, v)
======================  ========  ===================  ======================  ================================
``no_shard``            0 (DDP)   P                     P                       P
``optim``               1         P                     P (only 1/d reduced)    P/d  (``--use-distributed-optimizer``)
``optim_grads``         2         P                     P/d                     P/d
``optim_grads_params``  3         P/d (+ one unit)      P/d                     P/d
======================  ========  ===================  ======================  ================================

Communication per step over the group (Megatron's ``param_and_grad_buffer.py``, ZeRO §7.2), one
collective per bucket: ``no_shard``: an all-reduce of the grad buffer; ``optim`` / ``optim_grads``: a
reduce-scatter of the grad buffer, an all-gather of the updated param shards (the same volume);
``optim_grads_params``: an all-gather of each unit's params before its forward *and* before its
backward, a reduce-scatter of its grads -- 1.5x an all-reduce (ZeRO §7.2.2). The buckets are laid out
as Megatron lays them out (:mod:`course_lib.distributed.buffer`): no padding for ``no_shard``; the
distributed optimizer's 64-element param starts and ``lcm(d, 128)`` bucket ends for ``optim``;
Megatron-FSDP's multiple of ``d`` for ``optim_grads(_params)`` (and for ``optim`` with
``megatron_fsdp=True``); the collectives carry the padding.

Mixed precision (Megatron's ``Float16OptimizerWithFloat16Params``, ``megatron/core/optimizer/
optimizer.py``): 16-bit model params, fp32 main params in the optimizer, main grads accumulated and
reduced in fp32 (``grad_reduce_in_fp32``, Megatron's ``--accumulate-allreduce-grads-in-fp32``) or in
the model dtype with an fp32 main-grad copy per shard. With fp32 params the main params *are* the
model params (Megatron keeps no copy).
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

from course_lib import comm, rules
from course_lib.comm import CommRecorder, all_gather_into_tensor, reduce_scatter_tensor, record_event
from course_lib.distributed.buffer import Bucket, InFlight, size_buckets, unit_buckets
from course_lib.distributed.offload import HostPool
from course_lib.optimizer import Optimizer, no_weight_decay, clip_grads
from course_lib.tensor_parallel.sharding import is_tensor_parallel

__all__ = ["STRATEGIES", "ShardedDataParallel", "wrap"]

STRATEGIES = rules.SHARDING_STRATEGIES
"""Megatron-FSDP's ``--data-parallel-sharding-strategy`` values (ZeRO stage = index,
:func:`course_lib.rules.sharding_stage`)."""

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SOURCE = "course_lib.distributed"


def _dp_group(groups):
    """The data-parallel (x CP) group: a :class:`~course_lib.process_groups.ProcessGroups`' ``dp_cp``,
    or the group itself."""
    group = getattr(groups, "dp_cp", groups)
    if group is None:
        raise rules.UsageError("the data-parallel group is None: pass the dp_cp group (or a ProcessGroups) explicitly")
    return group


def _first_tensor(out):
    """The first tensor of a module's output that requires grad (tensor, tuple/list or dict), else None."""
    if isinstance(out, torch.Tensor):
        return out if out.requires_grad else None
    items = out.values() if isinstance(out, dict) else out if isinstance(out, (tuple, list)) else ()
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def _trainable(module: torch.nn.Module) -> list:
    """``[(name, param)]`` of the params that require grad, all of one float dtype (else ValueError)."""
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    if not named:
        raise rules.UsageError("the module has no parameter that requires grad: nothing to train")
    dtypes = {p.dtype for _, p in named}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _FLOAT_DTYPES:
        raise rules.UsageError(f"params have dtypes {sorted(map(str, dtypes))}: use one of fp32/bf16/fp16 for all "
                               f"(model.to(torch.bfloat16) for --bf16)")
    return named


class Unit(NamedTuple):
    """An FSDP unit (Megatron-FSDP's ``fsdp_unit_modules``): ``name`` (its module path, ``""`` for the
    root), ``module`` and ``params`` (``[(param name, param)]``), gathered and released together."""

    name: str
    module: torch.nn.Module
    params: list


def find_units(module: torch.nn.Module, named: list, unit_modules=None) -> list[Unit]:
    """FSDP units in module order.

    ``unit_modules`` (Megatron-FSDP's ``fsdp_unit_modules``): classes; each module of one of those
    classes is a unit holding every parameter below it. ``None``: every module that owns parameters
    directly is a unit (a ``Linear``, a ``LayerNorm``). Parameters left over go to the root."""
    wanted = {id(p) for _, p in named}
    claimed: set = set()
    units = []
    for mname, m in module.named_modules():
        if unit_modules is not None:
            if m is module or not isinstance(m, tuple(unit_modules)):
                continue
            params = [(f"{mname}.{n}", p) for n, p in m.named_parameters()]
        else:
            params = [(f"{mname}.{n}" if mname else n, p) for n, p in m.named_parameters(recurse=False)]
        params = [(n, p) for n, p in params if id(p) in wanted and id(p) not in claimed]
        if params:
            claimed.update(id(p) for _, p in params)
            units.append(Unit(mname, m, params))
    rest = [(n, p) for n, p in named if id(p) not in claimed]
    if rest:
        units.insert(0, Unit("", module, rest))
    return units


@dataclass
class OptimizerPiece:
    """One parameter's piece of a bucket's shard, as the optimizer updates it: ``main``, the fp32
    main-param view ``[end - start]``; ``start``/``end`` in shard coordinates (``[0, hi - lo)`` of
    the bucket's :class:`~course_lib.distributed.buffer.BucketState`); ``counted``: whether the grad
    norm counts it (Megatron's ``param_is_not_shared`` and ``param_is_not_tensor_parallel_duplicate``)."""

    main: torch.Tensor
    weight_decay: float
    bucket: Bucket
    start: int
    end: int
    counted: bool

    @property
    def grad(self) -> torch.Tensor:
        """The piece of the fp32 grads the step reads (``[end - start]``; only inside :meth:`~ShardedDataParallel.step`)."""
        return self.bucket.state.step_grad[self.start:self.end]


class ShardedDataParallel:
    """``module`` trained data-parallel over ``dp_group`` with one of :data:`STRATEGIES`.

    Call it like the module; then ``backward``; then :meth:`step`. See the package docstring for
    every argument; ``fsdp_unit_modules``: classes whose instances are ZeRO-3 units (see
    :func:`find_units`). Tensors: every bucket ``b`` holds a flat ``[b.numel]`` param buffer in the
    model dtype (``[b.numel / d]`` under ZeRO-3) and a flat grad buffer ``[b.numel]`` in the grad
    dtype (``[b.numel / d]`` under ZeRO-2/3); the optimizer holds fp32 ``[b.numel / d]`` slices
    (``[b.numel]`` for ``no_shard``), all in ``b.state`` (a
    :class:`~course_lib.distributed.buffer.BucketState`). Model parameters become views of the param
    buffer (Megatron's ``param.data = buffer view``); under ZeRO-3 they are empty except while their
    unit is gathered.
    """

    def __init__(self, module: torch.nn.Module, dp_group, *, strategy: str = "no_shard", bucket_size=None,
                 overlap_grad_reduce: bool = False, overlap_param_gather: bool = False,
                 cpu_offload: bool = False, grad_reduce_in_fp32: bool = True, optimizer: str = "adam",
                 weight_decay: float = 0.01, loss_scaler=None, fsdp_unit_modules=None, megatron_fsdp: bool = False,
                 **optimizer_kwargs):
        stage = rules.sharding_stage(strategy)
        self.module, self.strategy = module, strategy
        self._init_groups(dp_group)
        self.shard_optim, self.shard_grads, self.shard_params = stage >= 1, stage >= 2, stage >= 3
        # ZeRO-1 is Megatron's distributed optimizer; ZeRO-2/3 exist only in Megatron-FSDP
        rules.sharding_flags(use_distributed_optimizer=self.shard_optim, use_megatron_fsdp=self.shard_grads,
                             strategy=strategy, overlap_grad_reduce=overlap_grad_reduce,
                             overlap_param_gather=overlap_param_gather)
        named = _trainable(module)
        self.param_dtype = named[0][1].dtype
        self.grad_dtype = torch.float32 if grad_reduce_in_fp32 else self.param_dtype
        self.device = named[0][1].device
        self.overlap_grad_reduce, self.overlap_param_gather = overlap_grad_reduce, overlap_param_gather
        self.loss_scaler = loss_scaler
        self.comm = CommRecorder()
        self.timeline: list[dict] = []
        self._t0 = time.perf_counter()
        self._sync = True
        self._grads_synced = False  # finish_grad_sync ran and no grad arrived since
        self._decay = {id(p): not no_weight_decay(n, p) for n, p in named}
        self._shapes = {id(p): p.shape for _, p in named}
        self._init_layout(named, bucket_size, fsdp_unit_modules, megatron_fsdp)
        self._init_buffers()
        self._init_optimizer(optimizer, weight_decay, cpu_offload, optimizer_kwargs)
        self._hooks = self._register_hooks()

    def _init_groups(self, dp_group) -> None:
        """The groups: ``dp_group`` (or a ProcessGroups' ``dp_cp``) reduces grads; a ProcessGroups' model
        group also ORs found-inf and sums the grad norm; its TP rank decides what the norm counts."""
        self.group = _dp_group(dp_group)
        self.model_group = getattr(dp_group, "model", None)
        tp_group = getattr(dp_group, "tp", None)
        self._tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        self.dp, self.dp_rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.rank = dist.get_rank()
        self.gradient_scaling_factor = 1.0 / self.dp  # Megatron's: grads scaled by 1/d, then summed

    def _init_layout(self, named: list, bucket_size, fsdp_unit_modules, megatron_fsdp: bool) -> None:
        """Units and buckets (ZeRO-3: one bucket per unit, the shared embedding's split off), laid out
        as Megatron lays them out for this strategy (``self.layout``, one of
        :data:`~course_lib.distributed.buffer.LAYOUTS`), and the maps from a param to its place."""
        self.units = find_units(self.module, named, fsdp_unit_modules)
        self.layout = ("ddp" if not self.shard_optim else "fsdp" if self.shard_grads or megatron_fsdp
                       else "distributed_optimizer")
        self.buckets = (unit_buckets([(unit.module, unit.params) for unit in self.units], self.dp)
                        if self.shard_params else size_buckets(named, bucket_size, self.dp, self.layout))
        self._where = {id(pr.param): (b, pr) for b in self.buckets for pr in b.params}
        self._unit_of = {id(p): u for u, unit in enumerate(self.units) for _, p in unit.params}
        self._unit_bucket = {u: sorted({self._where[id(p)][0].index for _, p in unit.params})
                             for u, unit in enumerate(self.units)}
        self._unit_pending = [set() for _ in self.units]
        # forward calls of unit u whose backward has not started yet: a backward prefetch gathers a
        # unit only while it is > 0 (never a unit whose backward is over for this micro-batch)
        self._bwd_todo = [0] * len(self.units)
        self._fwd_span: dict = {}  # unit -> its open forward span (units nest: the root holds the others)
        self._bwd_span: dict = {}
        self._open_spans: dict = {}  # id(async work) -> the stamp that ends its timeline span

    # ------------------------------------------------------------------ storage

    def _init_buffers(self) -> None:
        src = dist.get_global_rank(self.group, 0)
        for b in self.buckets:
            self._init_bucket_params(b, src)
            self._init_bucket_grads(b)

    def _init_bucket_params(self, b: Bucket, src: int) -> None:
        """Copy the params into ``b``'s ``[numel]`` buffer, broadcast it from group rank 0 (Megatron's
        ``broadcast_params``: every replica starts from the same values) and make the params views of
        it; ZeRO-3 keeps only this rank's ``[numel / d]`` shard and releases the unit."""
        st = b.state
        full = torch.zeros(b.numel, dtype=self.param_dtype, device=self.device)
        for pr in b.params:
            full[pr.start:pr.end].copy_(pr.param.data.reshape(-1))
        if self.dp > 1:
            dist.broadcast(full, src=src, group=self.group)
        st.lo, st.hi = b.shard_range(self.dp_rank) if self.shard_optim else (0, b.numel)
        if self.shard_params:
            st.param_shard, st.param_full, st.gathered = full[st.lo:st.hi].clone(), None, full
            self._release(b)
        else:
            st.param_full = full
            self._point_params(b, full)

    def _init_bucket_grads(self, b: Bucket) -> None:
        """The grad buffer ``[numel]`` (ZeRO-2/3: a ``[numel / d]`` shard, the buffer made in backward)."""
        st = b.state
        st.grad_full = None if self.shard_grads else torch.zeros(b.numel, dtype=self.grad_dtype, device=self.device)
        st.grad_shard = (torch.zeros(b.shard_numel, dtype=self.grad_dtype, device=self.device)
                         if self.shard_grads else None)
        st.pending = {id(pr.param) for pr in b.params}

    def _point_params(self, b: Bucket, full: torch.Tensor) -> None:
        for pr in b.params:
            pr.param.data = full[pr.start:pr.end].view(self._shapes[id(pr.param)])

    def _release(self, b: Bucket) -> None:
        """ZeRO-3: drop the gathered params of bucket ``b`` (each param becomes an empty tensor) and
        free the gathered buffer's storage (``resize_(0)``, as FSDP2 and Megatron-FSDP do): autograd
        still holds views of it saved for backward (a GEMM saves ``weight.t()``), so merely dropping
        the references would keep every unit's full weights alive until backward. The unit's next
        gather refills the same storage, which those saved views then read."""
        st = b.state
        if st.gather is not None:   # never free a buffer a collective is writing into
            self._wait_gather(b)
        st.param_full = None
        for pr in b.params:
            pr.param.data = torch.empty(0, dtype=self.param_dtype, device=self.device)
        st.gathered.untyped_storage().resize_(0)

    def _model_shard(self, b: Bucket) -> torch.Tensor:
        """This rank's slice of ``b``'s params in the model dtype ``[hi - lo]`` (a view: writes land in the model)."""
        st = b.state
        return st.param_shard if self.shard_params else st.param_full[st.lo:st.hi]

    def _grad_shard(self, b: Bucket) -> torch.Tensor:
        st = b.state
        return st.grad_shard if self.shard_grads else st.grad_full[st.lo:st.hi]

    def _init_optimizer(self, kind, weight_decay, cpu_offload, kwargs) -> None:
        self.pool = HostPool(self.device) if cpu_offload else None
        self._pieces: list[OptimizerPiece] = []
        for b in self.buckets:
            self._init_main(b)
            self._pieces += self._optimizer_pieces(b, weight_decay)
        self.optimizer = Optimizer([], kind, weight_decay=weight_decay, **kwargs)
        self.optimizer.params = [(piece.main, piece.weight_decay) for piece in self._pieces]

    def _init_main(self, b: Bucket) -> None:
        """``b``'s fp32 main params ``[hi - lo]`` (the model shard itself for fp32 params: Megatron keeps
        no copy; on the host with offload, beside an fp32 host grad buffer: ``HybridDeviceOptimizer``
        copies the grads into host tensors of its fp32 params' dtype, ``cpu_offloading/hybrid_optimizer.py``
        ``_set_sub_optimizer_grads``) and, for 16-bit grads without offload, an fp32 main-grad buffer.
        The shard is one contiguous tensor: padding that falls into it is held too."""
        st, shard = b.state, self._model_shard(b)
        if self.pool is not None:
            st.main = self.pool.empty(st.hi - st.lo)
            st.main.copy_(shard)
            st.host_grad = self.pool.empty(st.hi - st.lo)   # fp32, as HybridDeviceOptimizer's host grads
        elif self.param_dtype == torch.float32:
            st.main = shard
        else:
            st.main = shard.float()
        st.main_grad = (torch.zeros(st.hi - st.lo, device=self.device)
                        if self.pool is None and self.grad_dtype != torch.float32 else None)

    def _optimizer_pieces(self, b: Bucket, weight_decay: float) -> list[OptimizerPiece]:
        """One :class:`OptimizerPiece` per parameter overlapping this rank's ``[lo, hi)`` of ``b``."""
        st, out = b.state, []
        for pr in b.pieces(st.lo, st.hi):
            a, z = pr.start - st.lo, pr.end - st.lo
            # the grad norm counts a param once: not the last stage's copy of a tied embedding
            # (``shared``), TP shards everywhere, TP-replicated params on TP rank 0
            counted = not getattr(pr.param, "shared", False) and (self._tp_rank == 0 or is_tensor_parallel(pr.param))
            out.append(OptimizerPiece(st.main[a:z], weight_decay if self._decay[id(pr.param)] else 0.0, b, a, z,
                                      counted))
        return out

    # ------------------------------------------------------------------ timeline and collectives

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def _span(self, name: str, kind: str) -> dict:
        ev = {"rank": self.rank, "name": name, "kind": kind, "start": self._now(), "end": None}
        self.timeline.append(ev)
        return ev

    def _collective(self, op: str, out: torch.Tensor, inp: torch.Tensor, name: str, tag: str, async_op: bool):
        """Issue ``op`` over the group (recorded in :attr:`comm` and any active CommRecorder, and on the
        timeline); returns the work handle (``None`` when done or when the group has one rank)."""
        if self.dp == 1:
            if op != "all_reduce":
                out.copy_(inp)
            return None
        numel = inp.numel() if op != "all_gather" else out.numel()
        with self.comm:
            record_event(op, numel, group_size=self.dp, kind="dp", dtype=inp.dtype, source=_SOURCE, tag=tag)
        ev = self._span(name, op)
        if op == "all_reduce":
            work = dist.all_reduce(inp, group=self.group, async_op=async_op)
        elif op == "reduce_scatter":
            work = reduce_scatter_tensor(out, inp, group=self.group, async_op=async_op)
        else:
            work = all_gather_into_tensor(out, inp, group=self.group, async_op=async_op)
        if not async_op:
            ev["end"] = self._now()
            return None
        self._on_done(work, ev)
        return work

    def _on_done(self, work, ev: dict) -> None:
        """Stamp ``ev['end']`` when ``work`` completes (its future; gloo's reduce-scatter has none: a thread)."""
        def stamp(*_):
            if ev["end"] is None:
                ev["end"] = self._now()
        self._open_spans[id(work)] = stamp
        try:
            work.get_future().then(stamp)
        except RuntimeError:
            threading.Thread(target=lambda: (work.wait(), stamp()), daemon=True).start()

    def _wait(self, work) -> None:
        """Wait for ``work``; its span ends now unless its completion was already stamped."""
        work.wait()
        stamp = self._open_spans.pop(id(work), None)
        if stamp is not None:
            stamp()

    # ------------------------------------------------------------------ grads

    def _launch_grad_reduce(self, b: Bucket, async_op: bool) -> None:
        """Scale ``b``'s grad buffer by 1/d and start its all-reduce (``no_shard``) or reduce-scatter
        into a new ``[numel / d]`` tensor (sharded optimizer)."""
        st = b.state
        if st.grad_full is None or st.grad_reduce is not None:
            return
        st.grad_full.mul_(self.gradient_scaling_factor)
        if not self.shard_optim:
            work = self._collective("all_reduce", st.grad_full, st.grad_full, f"bucket {b.index}", "grads", async_op)
            st.grad_reduce = InFlight(work, None)
        else:
            out = torch.empty(b.shard_numel, dtype=self.grad_dtype, device=self.device)
            work = self._collective("reduce_scatter", out, st.grad_full, f"bucket {b.index}", "grads", async_op)
            st.grad_reduce = InFlight(work, out)

    def _finish_grad_reduce(self, b: Bucket) -> None:
        st = b.state
        if st.grad_reduce is None:
            return
        if st.grad_reduce.work is not None:
            self._wait(st.grad_reduce.work)
        out = st.grad_reduce.out
        if out is not None:
            if self.shard_grads:
                st.grad_shard.add_(out)  # accumulate: several backward passes may feed one step
                st.grad_full = None      # ZeRO-2/3 keep only the shard
            else:
                st.grad_full[st.lo:st.hi].copy_(out)
        st.grad_reduce = None

    def _on_grad(self, p: torch.Tensor) -> None:
        """Post-accumulate-grad hook: add ``p.grad`` into its bucket's main grad (fp32 when
        ``grad_reduce_in_fp32``), drop ``p.grad``; a complete bucket starts its collective."""
        b, pr = self._where[id(p)]
        st = b.state
        if st.grad_full is None:
            st.grad_full = torch.zeros(b.numel, dtype=self.grad_dtype, device=self.device)
        st.grad_full[pr.start:pr.end].add_(p.grad.reshape(-1))
        p.grad = None
        self._grads_synced = False
        st.pending.discard(id(p))
        u = self._unit_of[id(p)]
        self._unit_pending[u].discard(id(p))
        if not self._unit_pending[u]:
            self._unit_backward_done(u)
        if not st.pending:
            st.pending = {id(q.param) for q in b.params}
            if self.shard_params:
                self._release(b)
            if self.overlap_grad_reduce and self._sync:
                self._launch_grad_reduce(b, async_op=True)

    def finish_grad_sync(self) -> None:
        """Reduce every bucket not yet reduced (all of them without ``overlap_grad_reduce``) and wait.
        Once per iteration: called again before a new grad arrives it does nothing, so a trainer can
        call it, work on the reduced grads (:meth:`synced_main_grad`) and then :meth:`step`, as
        Megatron's ``finalize_model_grads`` calls ``finish_grad_sync`` before the optimizer steps."""
        if self._grads_synced:
            return
        for b in self.buckets:
            if b.state.grad_reduce is None:
                self._launch_grad_reduce(b, async_op=False)
        for b in self.buckets:
            self._finish_grad_reduce(b)
            b.state.pending = {id(pr.param) for pr in b.params}
            if self.shard_params and b.state.param_full is not None:
                self._release(b)
        self._grads_synced = True

    @contextlib.contextmanager
    def no_sync(self):
        """Grad accumulation over micro-batches: no collective starts inside (Megatron's ``no_sync``)."""
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    # ------------------------------------------------------------------ params

    def _launch_gather(self, b: Bucket, async_op: bool) -> None:
        st = b.state
        if st.gather is not None or (self.shard_params and st.param_full is not None):
            return
        if self.shard_params:       # refill the unit's own storage (freed by _release)
            full = st.gathered
            full.untyped_storage().resize_(b.numel * full.element_size())
            inp = st.param_shard
        else:
            full, inp = st.param_full, self._model_shard(b).clone()
        work = self._collective("all_gather", full, inp, f"bucket {b.index}", "params", async_op)
        st.gather = InFlight(work, full)
        if work is None:
            self._wait_gather(b)

    def _wait_gather(self, b: Bucket) -> None:
        st = b.state
        if st.gather is None:
            return
        if st.gather.work is not None:
            self._wait(st.gather.work)
        full = st.gather.out
        st.gather = None
        if self.shard_params:
            st.param_full = full
            self._point_params(b, full)

    def _wait_param_gathers(self, release: bool = False) -> None:
        """Wait for every gather in flight; ``release`` (ZeRO-3): then drop every gathered unit, so
        the next forward gathers the updated shards (a gathered copy is stale after an update)."""
        for b in self.buckets:
            self._wait_gather(b)
            if release and self.shard_params and b.state.param_full is not None:
                self._release(b)

    def _ensure_unit(self, u: int) -> None:
        for i in self._unit_bucket[u]:
            b = self.buckets[i]
            if self.shard_params and b.state.param_full is None and b.state.gather is None:
                self._launch_gather(b, async_op=False)
            self._wait_gather(b)

    def _prefetch_unit(self, u: int, backward: bool = False) -> None:
        """Start gathering unit ``u`` (forward: the next unit; ``backward``: the previous one, only if
        a forward call of it still waits for its backward -- on a pipeline's last stage the root unit
        (output layer, final LayerNorm) runs *first* in backward, and gathering it again after that
        would leave a copy nobody releases, stale once the step updates the shard)."""
        if backward and not (0 <= u < len(self.units) and self._bwd_todo[u] > 0):
            return
        if 0 <= u < len(self.units):
            for i in self._unit_bucket[u]:
                self._launch_gather(self.buckets[i], async_op=True)

    # ------------------------------------------------------------------ hooks

    def _register_hooks(self) -> list:
        handles = []
        for b in self.buckets:
            for pr in b.params:
                handles.append(pr.param.register_post_accumulate_grad_hook(self._on_grad))
        for u, unit in enumerate(self.units):
            handles.append(unit.module.register_forward_pre_hook(lambda mod, args, u=u: self._before_forward(u)))
            handles.append(unit.module.register_forward_hook(lambda mod, args, out, u=u: self._after_forward(u, out)))
        return handles

    def _before_forward(self, u: int) -> None:
        self._fwd_span[u] = self._span(self.units[u].name or "root", "forward")
        if self.shard_params:
            self._ensure_unit(u)
            self._prefetch_unit(u + 1)
        elif self.overlap_param_gather:
            for i in self._unit_bucket[u]:
                self._wait_gather(self.buckets[i])

    def _after_forward(self, u: int, out) -> None:
        self._fwd_span.pop(u)["end"] = self._now()
        if self.shard_params:
            for i in self._unit_bucket[u]:
                self._release(self.buckets[i])
        t = _first_tensor(out) if torch.is_grad_enabled() else None
        if t is not None:
            self._unit_pending[u] = {id(p) for _, p in self.units[u].params}
            self._bwd_todo[u] += 1
            fired = [False]  # per forward call: each micro-batch's backward gathers the unit again

            def before_backward(grad, u=u, fired=fired):
                if not fired[0]:
                    fired[0] = True
                    self._before_backward(u)
            t.register_hook(before_backward)

    def _before_backward(self, u: int) -> None:
        """A unit's backward is about to run (the grad of its output exists): open its span; ZeRO-3:
        gather it (if released) and prefetch the unit before it. Called once per forward call, so
        pipelined micro-batches (forward, forward, backward, backward) each gather the unit."""
        self._bwd_todo[u] -= 1
        self._bwd_span[u] = self._span(self.units[u].name or "root", "backward")
        if self.shard_params:
            self._ensure_unit(u)
            self._prefetch_unit(u - 1, backward=True)

    def _unit_backward_done(self, u: int) -> None:
        ev = self._bwd_span.pop(u, None)
        if ev is not None:
            ev["end"] = self._now()

    # ------------------------------------------------------------------ the public API

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * loss_scaler.scale`` (the loss itself without a scaler): call backward on this."""
        if self.loss_scaler is None:
            return loss
        scale = self.loss_scaler.scale
        return loss * (scale.to(loss.device) if isinstance(scale, torch.Tensor) else scale)

    def zero_grad(self) -> None:
        """Start an iteration: grads to zero, the timeline restarted (its times count from here)."""
        self.timeline = []
        self._t0 = time.perf_counter()
        self._grads_synced = False
        self._bwd_todo = [0] * len(self.units)
        if self.pool is not None:
            self.pool.reset_moved()
        for b in self.buckets:
            for grad in (b.state.grad_full, b.state.grad_shard):
                if grad is not None:
                    grad.zero_()
            for pr in b.params:
                pr.param.grad = None

    @torch.no_grad()
    def grad_norm(self) -> float:
        """L2 norm of the whole model's (unscaled, reduced) grad, from this rank's shards: squares
        summed over the shard, then over the dp group (sharded strategies) and the model group
        (Megatron's ``get_grad_norm_fp32`` over the distributed optimizer's grad-stats group), through
        :func:`course_lib.comm.all_reduce` (recorded in :attr:`comm` and any active recorder, source
        ``"get_grad_norm_fp32"``). Only valid inside :meth:`step` (it reads the fp32 main grads,
        after the loss scaler's ``unscale_and_check`` -- where a trainer sums sequence-parallel
        grads over TP first)."""
        sq = torch.zeros(1, dtype=torch.float64, device=self.device)
        for piece in self._pieces:
            if piece.counted:
                sq += piece.grad.double().square().sum().to(self.device)
        groups = ([(self.group, "dp")] if self.shard_optim else []) + [(self.model_group, "tp-pp")]
        with self.comm:
            for group, kind in groups:
                if group is not None:
                    comm.all_reduce(sq, group, kind=kind, direction="bwd", source="get_grad_norm_fp32")
        return float(sq.sqrt())

    def step(self, lr: float, clip_grad: float = 0.0, grad_norm: bool = False) -> dict:
        """Finish the grad reduction, update this rank's shard (fp32), all-gather the params.

        ``clip_grad`` (Megatron's ``--clip-grad``; 0: off): grads scaled by ``clip_grad / (norm + 1e-6)``
        when that is < 1. The norm (:meth:`grad_norm`, one or two all-reduces) is computed only when
        clipping needs it or ``grad_norm=True`` asks for it: a trainer that takes the norm itself
        in its loss scaler's ``unscale_and_check`` (:class:`course_lib.training.state_sharding.ShardedGradFinalizer`)
        leaves both off, so the norm is computed once. Returns ``{"skipped": bool, "found_inf": bool,
        "grad_norm": float or None}`` (None when not computed; a loss scaler's overflow skips the
        update, and the norm is None then too)."""
        self.finish_grad_sync()
        self._wait_param_gathers(release=True)
        ev = self._span("optimizer", "optimizer")
        self._stage_step_grads()
        found_inf = self._found_inf()
        norm = None if found_inf else self._update(lr, clip_grad, grad_norm)
        for b in self.buckets:
            b.state.step_grad = None
        if self.loss_scaler is not None:
            self.loss_scaler.update(found_inf)
        ev["end"] = self._now()
        if self.shard_optim and not self.shard_params and not found_inf:
            for b in reversed(self.buckets):  # forward order: the last bucket holds the first layers
                self._launch_gather(b, async_op=self.overlap_param_gather)
        return {"skipped": found_inf, "found_inf": found_inf, "grad_norm": norm}

    def _stage_step_grads(self) -> None:
        """Each bucket's ``step_grad``: this rank's reduced grad shard in fp32 (copied to the host with
        offload, into the fp32 main-grad buffer for 16-bit grads, else the grad shard itself)."""
        for b in self.buckets:
            st, g = b.state, self._grad_shard(b)
            if self.pool is not None:
                self.pool.to_host(st.host_grad, g)
                st.step_grad = st.host_grad.float()
            elif st.main_grad is not None:
                st.step_grad = st.main_grad.copy_(g)
            else:
                st.step_grad = g

    def _found_inf(self) -> bool:
        """The loss scaler unscales the grads and checks them; the flag is OR-ed over the group of
        Megatron's ``get_grad_stats_parallel_group``: with a sharded optimizer every rank of the
        distributed-optimizer instance, dp *and* the model group (each rank saw only its shard;
        ``distrib_optimizer.py`` main ~796-802), without one the model group only (the dp replicas
        hold the same reduced grads). False without a scaler."""
        if self.loss_scaler is None:
            return False
        found = bool(self.loss_scaler.unscale_and_check([b.state.step_grad for b in self.buckets]))
        flag = torch.tensor([float(found)], device=self.device)
        for group in ((self.group,) if self.shard_optim else ()) + (self.model_group,):
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def _update(self, lr: float, clip_grad: float, grad_norm: bool):
        """The optimizer step on this rank's fp32 main params (clipped first when asked), then the
        updated values written back into the model-dtype shard. Returns the grad norm, or None when
        neither clipping nor ``grad_norm`` asked for it."""
        norm = None
        for piece in self._pieces:
            piece.main.grad = piece.grad
        if clip_grad > 0 or grad_norm:
            norm = self.grad_norm()
            clip_grads([piece.main for piece in self._pieces], norm, clip_grad)
        self.optimizer.step(lr)
        for piece in self._pieces:
            piece.main.grad = None
        for b in self.buckets:
            shard = self._model_shard(b)
            if self.pool is not None:
                self.pool.to_device(shard, b.state.main)
            elif b.state.main is not shard:
                shard.copy_(b.state.main)
        return norm

    def bytes_per_rank(self) -> dict:
        """Bytes this rank holds, measured from the tensors' storages (each storage counted once).

        ``params``: model-dtype params (the param buffer, or the ZeRO-3 shard plus any gathered unit);
        ``grads``: the grad buffer or shard; ``optimizer``: optimizer tensors on the compute device (fp32
        main params when they are a copy, fp32 main grads when grads are 16-bit, Adam's moments);
        ``optimizer_host``: the same on the host (``cpu_offload``); ``moved_d2h`` / ``moved_h2d``: bytes
        the offload copied since :meth:`zero_grad`; ``padding_elements``: the buckets' padding (elements
        of the full buffers that belong to no parameter); ``shard_elements``: the elements of this rank's
        shards (``hi - lo`` summed over the buckets; the whole buffer without a sharded optimizer) and
        ``shard_param_elements`` those of them that belong to parameters, the elements this rank's
        optimizer steps (each parameter element is stepped by exactly one rank of the group)."""
        self._wait_param_gathers()
        seen: set = set()

        def nbytes(tensors) -> int:
            total = 0
            for t in tensors:
                if t is None or t.numel() == 0:
                    continue
                s = t.untyped_storage()
                if s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    total += s.nbytes()
            return total

        states = [b.state for b in self.buckets]
        params = nbytes([pr.param.data for b in self.buckets for pr in b.params] + [st.param_shard for st in states])
        grads = nbytes([st.grad_shard if self.shard_grads else st.grad_full for st in states]
                       + [pr.param.grad for b in self.buckets for pr in b.params])
        opt = nbytes([st.main for st in states] + [st.main_grad for st in states] + [st.host_grad for st in states]
                     + [t for st in self.optimizer.state.values() for t in st.values()])
        host = self.pool is not None
        out = {"params": params, "grads": grads, "optimizer": 0 if host else opt,
               "optimizer_host": opt if host else 0, "padding_elements": sum(b.padding for b in self.buckets),
               "shard_elements": sum(st.hi - st.lo for st in states),
               "shard_param_elements": sum(piece.end - piece.start for piece in self._pieces)}
        moved = self.pool.moved if host else {"d2h": 0, "h2d": 0}
        out.update(moved_d2h=moved["d2h"], moved_h2d=moved["h2d"])
        return out

    def main_grad(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s accumulated grad in the grad buffer (grad dtype, ``param``'s shape): Megatron's
        ``param.main_grad``, a view -- writes land in the buffer the reduction reads.

        Before the reduction (after backward, before :meth:`finish_grad_sync` / :meth:`step`) it is
        this rank's local, unreduced sum over its micro-batches, under every strategy. After the
        reduction it is the dp average under ``no_shard``; under ``optim`` only this rank's shard of it
        is averaged. ZeRO-2/3 keep no full buffer past the reduce-scatter (only a 1/d grad shard):
        ValueError then -- :meth:`synced_main_grad` gives the part this rank holds."""
        b, pr = self._where[id(param)]
        full = b.state.grad_full
        if full is None or b.state.grad_reduce is not None:
            raise rules.UsageError(f"main_grad: strategy={self.strategy!r} keeps only a 1/d grad shard once the "
                                   f"reduce-scatter started (or no backward ran yet); read main_grad after backward, "
                                   f"before step, or use strategy 'no_shard' / 'optim' for full main grads")
        return full[pr.start:pr.end].view(self._shapes[id(param)])

    def synced_main_grad(self, param: torch.Tensor) -> torch.Tensor:
        """After :meth:`finish_grad_sync`, before :meth:`step`: the part of ``param``'s reduced grad this
        rank holds, a view (writes land where the step reads). ``no_shard`` and ``optim``: the whole
        :meth:`main_grad` (Megatron's ``param.main_grad``; under ``optim`` only the elements of this
        rank's shard are reduced, the step reads no other); ZeRO-2/3: the 1-D piece ``[k]`` of the grad
        shard that belongs to ``param`` (Megatron-FSDP's ``main_grad._local_tensor``; may be empty).

        What a trainer sums over the embedding group after the reduction (Megatron's
        ``_allreduce_word_embedding_grads``, ``finalize_model_grads.py`` main ~640 then ~676): the tied
        embedding is a bucket of its own, laid out alike on the first and the last stage, so the two
        ranks of a pair hold the same elements of it."""
        if not self._grads_synced:
            raise rules.UsageError("synced_main_grad: call finish_grad_sync() after backward first (the reduced "
                                   "grad does not exist yet); before it, main_grad() is the local one")
        b, pr = self._where[id(param)]
        if not self.shard_grads:
            return self.main_grad(param)
        lo, hi = b.state.lo, b.state.hi
        start, end = max(pr.start, lo), max(min(pr.end, hi), max(pr.start, lo))
        return b.state.grad_shard[start - lo:end - lo]

    def full_parameters(self) -> dict:
        """``{name: full parameter}`` (ZeRO-3: all-gathered, then released; recorded with tag
        ``"inspect"``) -- for checks against a single-process run."""
        self._wait_param_gathers()
        out = {}
        for b in self.buckets:
            if self.shard_params:
                full = torch.empty(b.numel, dtype=self.param_dtype, device=self.device)
                self._collective("all_gather", full, b.state.param_shard, f"bucket {b.index}", "inspect", False)
            else:
                full = b.state.param_full
            for pr in b.params:
                out[pr.name] = full[pr.start:pr.end].view(self._shapes[id(pr.param)]).clone()
        return out

    def _piece_ranges(self) -> list:
        """``(optimizer piece, its parameter's ParamRange, lo, hi)``: each piece of :attr:`optimizer`'s
        params with its elements ``[lo, hi)`` in bucket coordinates."""
        ranges = []
        for b in self.buckets:
            whole = {pr.name: pr for pr in b.params}
            ranges += [(whole[pr.name], pr.start, pr.end) for pr in b.pieces(b.state.lo, b.state.hi)]
        return [(piece, *r) for piece, r in zip(self._pieces, ranges, strict=True)]

    @torch.no_grad()
    def full_optimizer_state(self) -> dict:
        """``{state name: {name: full state tensor}}`` of every parameter (its shape) -- beside
        :meth:`full_parameters`, what a checkpoint saves. The distributed optimizer's shards are summed
        over DP into whole tensors (every other rank contributes zeros; recorded with source
        ``checkpoint_gather_optimizer_state``). Collective."""
        keys = self.optimizer.state_keys
        flats = {k: {b.index: torch.zeros(b.numel, device=self.device) for b in self.buckets} for k in keys}
        for piece, _, lo, hi in self._piece_ranges():
            for k, value in self.optimizer.param_state(piece.main).items():
                flats[k][piece.bucket.index][lo:hi] = value.to(self.device)
        out = {k: {} for k in keys}
        for k in keys:
            for b in self.buckets:
                flat = flats[k][b.index]
                if self.shard_optim:
                    comm.all_reduce(flat, self.group, kind="dp", source="checkpoint_gather_optimizer_state")
                for pr in b.params:
                    out[k][pr.name] = flat[pr.start:pr.end].view(self._shapes[id(pr.param)])
        return out

    @torch.no_grad()
    def load_full_state(self, params: dict, optimizer_state: dict | None = None) -> None:
        """The inverse of :meth:`full_parameters` and :meth:`full_optimizer_state`: ``params``
        (``{name: full tensor}``) into the param buffers (ZeRO-3: this rank's shard) and the fp32 main
        params; ``optimizer_state`` (``{state name: {name: full tensor}}``; None or empty: left as it is)
        sliced to this rank's pieces. Not collective: every rank holds what it needs."""
        for b in self.buckets:
            flat = torch.zeros(b.numel, dtype=self.param_dtype, device=self.device)
            for pr in b.params:
                flat[pr.start:pr.end] = params[pr.name].reshape(-1)
            st = b.state
            (st.param_shard if self.shard_params else st.param_full).copy_(
                flat[st.lo:st.hi] if self.shard_params else flat)
            st.main.copy_(flat[st.lo:st.hi])
        if optimizer_state:
            for piece, pr, lo, hi in self._piece_ranges():
                self.optimizer.load_param_state(piece.main, {
                    k: v[pr.name].reshape(-1)[lo - pr.start:hi - pr.start] for k, v in optimizer_state.items()})

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def wrap(model: torch.nn.Module, groups, *, use_distributed_optimizer: bool = False,
         **kwargs) -> ShardedDataParallel:
    """``ShardedDataParallel(model, groups, **kwargs)``: the Lab 07 entry point (see the package docstring).

    ``groups``: the data-parallel group, or a :class:`~course_lib.process_groups.ProcessGroups`
    (its ``dp_cp`` group is used, as Megatron reduces grads over data x context parallel ranks).
    ``use_distributed_optimizer=True`` (Megatron's ``--use-distributed-optimizer``) is
    ``strategy="optim"``."""
    if use_distributed_optimizer:
        strategy = kwargs.setdefault("strategy", "optim")
        if strategy == "no_shard":
            raise rules.UsageError("use_distributed_optimizer=True (--use-distributed-optimizer) shards the optimizer "
                                   "but strategy='no_shard' shards nothing: drop one of them")
    return ShardedDataParallel(model, groups, **kwargs)
