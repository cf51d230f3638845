"""Project one layout onto a named GPU cluster: step time, tokens/s, TFLOP/s per GPU, MFU, and why.

``python -m course_lib project`` prints it; :func:`project` is the tested function. It adds
**time** to :func:`course_lib.sizing.planner.plan` (which already validates the layout and
counts FLOPs, bytes and memory with the papers' formulas) and to nothing else:

1. **Compute per micro-batch and pipeline rank.** Every GEMM one layer runs on one rank, with its
   shape (:func:`.gemm.layer_gemms`: QKV, the attention core's batched ``QK^T`` and ``x V``, the
   projection, the two MLP GEMMs, the logits on the last stage; their FLOPs add up to Narayanan's
   Eq. 3 / Korthikanti's Eq. 7), timed by :func:`.gemm.gemm_seconds`: a roofline at a fitted
   fraction of the dense peak (a fixed cost per kernel can be added; the fit leaves it at 0), so a
   GEMM with few FLOPs per byte runs at HBM's pace. The backward runs each GEMM's two gradient GEMMs (twice the forward);
   full recomputation runs the layer's forward once more, selective recomputation the attention
   core's two GEMMs (Korthikanti §5). Plus the memory-bound element-wise work the papers do
   not count as FLOPs (LayerNorm, GeLU, softmax, dropout): the activation bytes of Korthikanti
   Table 2 (:func:`.memory.activation_bytes_per_layer`) moved through HBM ``elementwise_traffic``
   times forward (fitted with the GEMMs' fraction of the peak: 2.0) and twice that backward (read,
   and the gradient written), and once more for what is recomputed.
2. **Communication per group**, priced with the alpha-beta model on the link the group's
   ranks use: ranks are numbered in Megatron's order tp-cp-ep-dp-pp
   (:class:`course_lib.topology.RankGrid`) and placed ``gpus_per_node`` to a node (torchrun's
   ``--nproc-per-node``: rank r on node ``r // gpus_per_node``), so a group whose ranks sit on
   more than one node talks over the network, else over NVLink. A group with ``k`` of its GPUs on
   each node runs NCCL's rings over ``k`` NICs per node (one per GPU), so it reaches ``k`` times one
   NIC's bandwidth, at most NVLink's. NVLink is priced at the bus bandwidth NCCL measures, the
   network at its line rate (an assumption; :mod:`.hardware`). Bytes are :mod:`.comm`'s (the ring
   cost model). TP's all-reduces sit inside each micro-batch's forward
   and backward (Megatron 2021 blocks on them); a pipeline message delays the stage that waits for
   it (the simulator's ``p2p_latency``), so what PP costs is what it adds to the schedule; DP's
   gradient reduction follows the backward pass unless ``dp_overlap`` hides part of it.
3. **The pipeline** runs through the course's schedule simulator
   (:func:`course_lib.pipeline.simulate.simulate`: 1F1B, or interleaved with ``vp > 1``) with
   those per-rank times, so the bubble is the simulated one, not a formula.
4. **Step** = pipeline makespan + exposed DP reduction + tied-embedding all-reduce +
   optimizer step (memory-bound: Adam's fp32 state read and written through HBM).

Every assumption is a field of :class:`Assumptions` with its default and source. The two
calibrated constants are the GEMM model's (:mod:`.gemm`), fitted once to Narayanan et al. 2021
Table 1 and checked out of sample on Korthikanti et al. 2022's and Narayanan's Table 2 runs
(:mod:`.published`; tests/sizing/test_projection.py prints every row's error, the summary says them in
one line); everything else is a datasheet number, an NCCL measurement (:mod:`.hardware`) or a
paper's formula.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field, fields, replace

from course_lib import rules
from course_lib.sizing.comm import cp_comm_per_layer, pp_send_elements, ring_elements_sent, tp_comm_per_layer
from course_lib.sizing.gemm import (ATTENTION_CORE, ELEMENTWISE_TRAFFIC, FIT_SUMMARY, GEMM_HALF_FLOPS,
                                    GEMM_PEAK_EFFICIENCY, gemm_seconds, layer_gemms, logits_gemm)
from course_lib.sizing.hardware import HARDWARE, Hardware, get_hardware
from course_lib.sizing.memory import activation_bytes_per_layer, output_activation_terms
from course_lib.sizing.planner import PRESETS, ModelSpec, Plan, plan
from course_lib.sizing.published import SEQ, VOCAB, PublishedRun


@dataclass(frozen=True)
class Assumptions:
    """Every modelling choice of :func:`project`, by name (default; source)."""

    gemm_peak_efficiency: float = field(default=GEMM_PEAK_EFFICIENCY, metadata={"help": (
        "fraction of the dense peak a large GEMM sustains (the GEMM model's eta_max, fitted to Narayanan "
        'Table 1; course_lib/sizing/gemm.py).')})
    gemm_half_flops: float = field(default=GEMM_HALF_FLOPS, metadata={"help": (
        "FLOPs of the GEMM that runs at half of eta_max: every kernel's fixed cost is the time of this many "
        'FLOPs (0: Narayanan Table 1 does not determine it; course_lib/sizing/gemm.py).')})
    gemm_efficiency: float | None = field(default=None, metadata={"help": (
        'one fraction of peak for every GEMM instead of the GEMM model (none: the model).')})
    elementwise_traffic: float = field(default=ELEMENTWISE_TRAFFIC, metadata={"help": (
        "HBM passes over Korthikanti Table 2's activation bytes per forward (backward: twice that; full "
        "recompute: once more; selective: the attention core's 5as^2b once more). 1 = each stored byte written "
        'once and read once; the default is fitted to Narayanan Table 1 with eta_max (course_lib/sizing/gemm.py).')})
    flash_attention: bool = field(default=False, metadata={"help": (
        'the attention core fused (Dao 2022): no ``5as^2b`` score bytes through HBM. Off for the 2021 runs of '
        'Table 1; on for Megatron-core with Transformer Engine (--attention-backend).')})
    link_efficiency: float = field(default=1.0, metadata={"help": (
        "fraction of the profile's link bandwidths a collective reaches (1: NVLink at the bus bandwidth NCCL "
        "measures, the network at its line rate).")})
    tp_overlap: float = field(default=0.0, metadata={"help": (
        "fraction of TP communication hidden behind GEMMs (0 in Megatron 2021; Megatron-core's "
        '--tp-comm-overlap with Transformer Engine userbuffers hides much of it on Hopper).')})
    async_tensor_model_parallel_allreduce: bool = field(default=False, metadata={"help": (
        "the backward TP collective of each column-parallel linear (QKV, MLP up) runs beside one of its GEMMs and is "
        "hidden up to that GEMM's time: the input-gradient all-reduce beside the weight-gradient GEMM; with SP, the "
        "input all-gather beside the input-gradient GEMM and the reduce-scatter beside the weight-gradient GEMM. "
        "Off in the 2021 code of Narayanan Tables 1-2 (Megatron-LM 6985e58); on by default from 3f65246911 (merged "
        "2021-09-02), so in the 2022 code of Korthikanti (--no-async-tensor-model-parallel-allreduce), and always in "
        'megatron-core 0.16.1 (tensor_parallel/layers.py, allreduce_dgrad; the flag is deprecated there).')})
    cp_overlap: float = field(default=0.0, metadata={"help": (
        'fraction of the CP ring hidden behind attention blocks (Transformer Engine overlaps the next K/V '
        "exchange with the current block's attention; 0 = none hidden, an upper bound).")})
    pp_overlap: float = field(default=0.0, metadata={"help": (
        "fraction of pipeline send/recv hidden (0: Megatron's 1F1B waits on each p2p pair, "
        'pipeline_parallel/schedules.py; --overlap-p2p-comm overlaps them in the interleaved schedule).')})
    pp_scatter_gather: bool = field(default=True, metadata={"help": (
        "Narayanan §4.1's scatter/gather: across nodes each TP rank sends 1/t of the boundary tensor on its "
        'own HCA, then an all-gather over NVLink rebuilds it.')})
    dp_overlap: float = field(default=0.0, metadata={"help": (
        'fraction of the DP gradient reduction hidden behind the backward pass (0 in Megatron 2021, which '
        'reduced after backward; --overlap-grad-reduce in Megatron-core hides most).')})
    optimizer_bytes_per_param: float = field(default=28.0, metadata={"help": (
        "HBM bytes Adam moves per parameter it updates: fp32 weight, m and v read and written (ZeRO §3.1's 12 "
        'bytes, x2), the 2-byte gradient read and the 2-byte weight written.')})

    def __post_init__(self):
        for name in ("gemm_peak_efficiency", "link_efficiency") + (("gemm_efficiency",) if self.gemm_efficiency
                                                                  is not None else ()):
            rules.number(name, getattr(self, name), 0.0, 1.0, low_open=True)
        rules.number("gemm_half_flops", self.gemm_half_flops, 0.0)
        for name in ("tp_overlap", "cp_overlap", "pp_overlap", "dp_overlap"):
            rules.number(name, getattr(self, name), 0.0, 1.0)
        rules.number("elementwise_traffic", self.elementwise_traffic, 0.0)
        rules.number("optimizer_bytes_per_param", self.optimizer_bytes_per_param, 0.0)


ASSUMPTION_NAMES = tuple(f.name for f in fields(Assumptions))


@dataclass
class GroupComm:
    """One process group's communication in one step (the busiest rank's view)."""

    name: str
    group_size: int
    link: str            # "NVLink", "network" or "-" (size-1 group)
    bytes_sent: float    # per rank per step
    seconds: float       # transfer + start-up time per step, before any overlap
    _exposed: object     # seconds left on the step after overlap (or a function computing it, called once)
    overlap: str = ""
    nics: int = 0        # NICs per node its rings use across nodes (its GPUs per node); 0 inside a node

    @property
    def exposed(self) -> float:
        if callable(self._exposed):
            self._exposed = float(self._exposed())
        return self._exposed


@dataclass
class Projection:
    """What :func:`project` computed (seconds, bytes, FLOP/s); ``plan`` holds the sizing."""

    plan: Plan
    hardware: Hardware
    num_nodes: int
    assumptions: Assumptions
    t_forward: list          # seconds per micro-batch, per pipeline rank (compute + TP + CP)
    t_backward: list
    parts: dict              # seconds per micro-batch, per pipeline rank: gemm, elementwise, tp, cp
    after: dict              # seconds after the pipeline: dp, embedding, optimizer
    compute: dict            # per micro-batch on the busiest rank: gemm_forward, gemm_backward, elementwise
    layer: dict              # one transformer layer, one micro-batch: seconds forward / backward (gemm, elementwise,
                             # tp, cp), and its forward GEMM FLOPs
    groups: dict             # name -> GroupComm
    pipeline_time: float     # simulated makespan of the schedule
    bubble: float            # simulated bubble fraction (idle / busy), Narayanan's t_pb / t_id
    step_time: float
    timeline: object = None
    notes: list = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.plan.world_size

    def breakdown(self) -> dict:
        """Where the step goes, in seconds, on the pipeline rank with the most work: ``gemm``,
        ``elementwise``, ``tp``, ``cp`` (x micro-batches), ``bubble`` (its idle time in the simulated
        schedule, waits for pipeline messages included, as in a measured bubble), then ``dp``,
        ``embedding``, ``optimizer``. Sums to :attr:`step_time`."""
        m = self.plan.num_microbatches
        rank = max(range(len(self.t_forward)), key=lambda r: self.t_forward[r] + self.t_backward[r])
        out = {k: m * v[rank] for k, v in self.parts.items()}
        out["bubble"] = self.pipeline_time - sum(out.values())
        out.update(self.after)
        return out

    @property
    def tokens_per_s(self) -> float:
        return self.plan.config["global_batch_size"] * self.plan.model.seq_length / self.step_time

    @property
    def achieved_flops_per_gpu(self) -> float:
        """Narayanan's X: the FLOPs run (Eq. 3 with full recompute) per second per GPU."""
        return self.plan.hardware_flops / (self.step_time * self.world_size)

    @property
    def mfu(self) -> float:
        """Model FLOPs (Korthikanti Eq. 7) per second per GPU over the dense peak."""
        return self.plan.model_flops / (self.step_time * self.world_size * self.hardware.peak_flops)

    @property
    def hfu(self) -> float:
        return self.achieved_flops_per_gpu / self.hardware.peak_flops

    @property
    def layer_gemm_efficiency(self) -> float:
        """The fraction of the dense peak one layer's forward GEMMs reach under the GEMM model."""
        return self.layer["gemm_flops_forward"] / (self.layer["gemm_forward"] * self.hardware.peak_flops)

    def gemm_model_text(self) -> str:
        """Which GEMM timing this projection used: the fitted model with its errors, or the constant given."""
        a = self.assumptions
        if a.gemm_efficiency is not None:
            return f"GEMMs at a constant {a.gemm_efficiency:.0%} of peak (gemm_efficiency; the fitted model is off)"
        fit = (GEMM_PEAK_EFFICIENCY, GEMM_HALF_FLOPS, ELEMENTWISE_TRAFFIC)
        if (a.gemm_peak_efficiency, a.gemm_half_flops, a.elementwise_traffic) != fit:
            return (f"GEMM model with eta_max {a.gemm_peak_efficiency:g}, W_half {a.gemm_half_flops:.3g} FLOPs and "
                    f"{a.elementwise_traffic:g} element-wise HBM passes (given; the fit is {fit[0]:g}, {fit[1]:.3g}, "
                    f"{fit[2]:g})")
        return FIT_SUMMARY

    def summary(self) -> str:
        """A deterministic, rounded text report (what ``python -m course_lib project`` prints)."""
        p, c = self.plan, self.plan.config
        lines = [
            self.hardware.summary(),
            f"{p.model.name}: {p.num_parameters / 1e9:.1f}B parameters ({p.model.num_layers} layers, hidden "
            f"{p.model.hidden_size}, {p.model.num_heads} heads, seq {p.model.seq_length}, vocab {p.model.vocab_size}); "
            f"TP={c['tp']} PP={c['pp']} DP={c['dp']} "
            f"CP={c['cp']} VP={c['vp']} SP={c['sequence_parallel']} recompute={c['recompute']} on "
            f"{self.world_size} GPUs = {self.num_nodes} node(s) of {self.hardware.gpus_per_node}; "
            f"{p.num_microbatches} micro-batches of {c['micro_batch_size']} (global batch {c['global_batch_size']})",
            f"memory of the busiest rank {p.memory['total'] / 1e9:.1f} GB of {self.hardware.hbm_gb:.0f} GB: "
            f"{'fits' if p.fits else 'does NOT fit'}",
            f"step {seconds_text(self.step_time)} | {self.tokens_per_s:,.0f} tokens/s | "
            f"{self.achieved_flops_per_gpu / 1e12:.1f} TFLOP/s per GPU (HFU {self.hfu:.1%}) | MFU {self.mfu:.1%}",
            f"pipeline (simulated schedule) {seconds_text(self.pipeline_time)}, bubble {self.bubble:.3f} "
            f"(formula (p-1)/(v m) = {(c['pp'] - 1) / (c['vp'] * p.num_microbatches):.3f})",
            "per micro-batch on the busiest rank: " + ", ".join(
                f"{k.replace('_', ' ')} {seconds_text(v)}" for k, v in self.compute.items()),
            f"one layer, one micro-batch: forward {seconds_text(self.layer['forward'])}, backward "
            f"{seconds_text(self.layer['backward'])}; its GEMMs run at {self.layer_gemm_efficiency:.1%} of peak",
            self.gemm_model_text(),
            f"{'group':<10}{'size':>5}  {'link':<8}{'NICs':>5}{'sent/step':>13}{'time':>11}{'exposed':>11}  overlap",
        ]
        for g in self.groups.values():
            lines.append(f"{g.name:<10}{g.group_size:>5}  {g.link:<8}{g.nics or '-':>5}{g.bytes_sent / 1e9:>10.3f} GB"
                         f"{seconds_text(g.seconds):>11}{seconds_text(g.exposed):>11}  {g.overlap}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def seconds_text(seconds: float) -> str:
    """A duration with a readable unit, 3 significant digits."""
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale or unit == "us":
            return f"{seconds / scale:.3g} {unit}"


def _gpus_per_node_in_group(groups: list, gpus_per_node: int) -> tuple[int, int]:
    """``(nodes, k)``: the most nodes one group spans and the most of one group's GPUs on one node."""
    nodes, k = 1, 1
    for g in groups:
        count: dict[int, int] = {}
        for r in g:
            count[r // gpus_per_node] = count.get(r // gpus_per_node, 0) + 1
        nodes, k = max(nodes, len(count)), max(k, max(count.values()))
    return nodes, k


def _num_nodes(world: int, hw: Hardware, num_nodes) -> int:
    needed = math.ceil(world / hw.gpus_per_node)
    if num_nodes is None:
        return needed
    n = rules.integer("num_nodes", num_nodes)
    if n != needed:
        raise rules.UsageError(f"num_nodes={n} does not hold tp*pp*dp*cp = {world} GPUs at {hw.gpus_per_node} per node: "
                               f"use num_nodes={needed}, or change dp so the layout fills {n} node(s) "
                               f"(dp = {n * hw.gpus_per_node} / (tp*pp*cp))")
    return n


@dataclass(frozen=True)
class _Run:
    """What every step of :func:`project` reads: the model, its validated plan, the layout (as given), the
    cluster and the assumptions."""

    model: ModelSpec
    plan: Plan
    hw: Hardware
    assumptions: Assumptions
    grid: object         # the layout's RankGrid (Megatron's rank order tp-cp-ep-dp-pp)
    tp: int
    pp: int
    cp: int
    vp: int
    dp: int
    b: int               # micro-batch size
    zero_stage: int

    @property
    def sp(self) -> bool:
        return self.plan.config["sequence_parallel"]

    @property
    def mode(self) -> str:
        return self.plan.config["recompute"]

    @property
    def m(self) -> int:
        return self.plan.num_microbatches

    @property
    def layers(self) -> int:
        """Transformer layers per pipeline rank."""
        return self.model.num_layers // self.pp

    def link(self, token: str, size: int) -> tuple[str, float, float]:
        """``(link, bandwidth, latency)`` of the ``token`` groups of ``size`` ranks: "network" when a group's
        ranks sit on more than one node (``gpus_per_node`` to a node), else "NVLink"; "-" for one rank.

        Across nodes, a group with ``k`` GPUs on each node runs ``k`` of NCCL's rings side by side, each
        leaving the node through its own GPU's NIC (one NIC per GPU), and each ring carries ``1/k`` of the
        data: the group reaches ``k`` NICs' bandwidth, and no more than NVLink's, which its ranks inside a
        node still use."""
        if size == 1:
            return "-", math.inf, 0.0
        hw, eff = self.hw, self.assumptions.link_efficiency
        nodes, k = _gpus_per_node_in_group(self.grid.groups(token), hw.gpus_per_node)
        if nodes > 1:
            return "network", min(hw.nvlink_bus_bandwidth, k * hw.internode_bandwidth) * eff, hw.inter_latency_s
        return "NVLink", hw.nvlink_bus_bandwidth * eff, hw.intra_latency_s

    def nics(self, token: str) -> int:
        """NICs per node a ``token`` group sends on when it spans nodes: its GPUs per node (0 inside a node)."""
        nodes, k = _gpus_per_node_in_group(self.grid.groups(token), self.hw.gpus_per_node)
        return k if nodes > 1 else 0


def _assumptions(assumptions: Assumptions | None, overrides: dict) -> Assumptions:
    for name in overrides:
        if name not in ASSUMPTION_NAMES:
            raise rules.UsageError(f"{name}= is not an assumption of project(): use one of {', '.join(ASSUMPTION_NAMES)}")
    return replace(assumptions or Assumptions(), **overrides)


def _data_parallel_size(dp, num_nodes, hw: Hardware, tp, pp, cp):
    """``dp`` as given; left out, Megatron's ``num_nodes * gpus_per_node / (tp * pp * cp)`` (1 without nodes)."""
    if dp is not None:
        return dp
    if num_nodes is None:
        return 1
    world = rules.integer("num_nodes", num_nodes) * hw.gpus_per_node
    return rules.data_parallel_size(world, rules.integer(rules.TP, tp), rules.integer(rules.PP, pp),
                                    rules.integer(rules.CP, cp))


def _gemm_time(run: _Run, gemm) -> float:
    """Seconds of ``gemm``: the GEMM model of :mod:`.gemm`, or ``gemm_efficiency`` x peak when given."""
    a = run.assumptions
    if a.gemm_efficiency is not None:
        return gemm.flops / (run.hw.peak_flops * a.gemm_efficiency)
    return gemm_seconds(gemm, run.hw, a.gemm_peak_efficiency, a.gemm_half_flops)


def _compute(run: _Run) -> tuple[list, list, list, list, dict]:
    """Seconds per micro-batch and pipeline rank: GEMMs forward and backward, element-wise work forward
    and backward (the logits on the last rank); and one layer's GEMM / element-wise seconds and FLOPs."""
    model, hw, a, tp, pp, cp, b = run.model, run.hw, run.assumptions, run.tp, run.pp, run.cp, run.b
    s, h, layers, mode = model.seq_length, model.hidden_size, run.layers, run.mode
    gemms = layer_gemms(s, b, h, model.num_heads, tp, cp, a.flash_attention)
    times = {g.name: _gemm_time(run, g) for g in gemms}
    layer_f = sum(times.values())
    recomputed = {"full": layer_f, "selective": sum(times[n] for n in ATTENTION_CORE)}.get(mode, 0.0)
    layer_b = 2 * layer_f + recomputed          # input- and weight-gradient GEMMs, + the recomputed forward
    logits_f = _gemm_time(run, logits_gemm(s, b, h, model.vocab_size, tp, cp))

    def hbm_seconds(recompute_mode):
        return activation_bytes_per_layer(s, b, h, model.num_heads, tp, run.sp, recompute_mode, cp) \
            * a.elementwise_traffic / hw.hbm_bandwidth

    mem_layer = hbm_seconds("selective" if a.flash_attention else "none")
    # what is recomputed moves its element-wise bytes once more: the whole layer's (full), or the attention
    # core's 5as^2b/t score bytes (selective; none with flash attention, which never stores them)
    mem_again = {"full": mem_layer, "selective": mem_layer - hbm_seconds("selective")}.get(mode, 0.0)
    out_bytes = output_activation_terms(s // cp, b, h, model.vocab_size, tp, run.sp)["output"]
    mem_out = out_bytes * a.elementwise_traffic / hw.hbm_bandwidth
    last = [r == pp - 1 for r in range(pp)]
    gemm_f = [layers * layer_f + (logits_f if z else 0.0) for z in last]
    gemm_b = [layers * layer_b + (2 * logits_f if z else 0.0) for z in last]
    mem_f = [layers * mem_layer + (mem_out if z else 0.0) for z in last]
    mem_b = [2 * x + layers * mem_again for x in mem_f]
    layer = {"gemm_forward": layer_f, "gemm_backward": layer_b, "elementwise_forward": mem_layer,
             "elementwise_backward": 2 * mem_layer + mem_again,
             "gemm_flops_forward": sum(g.flops for g in gemms)}
    return gemm_f, gemm_b, mem_f, mem_b, layer


def _tp_comm(run: _Run, groups: dict) -> tuple[float, float]:
    """TP's exposed seconds per micro-batch (forward, backward); adds the ``tp`` group. 2 collectives per
    layer forward, 2 backward (x2 with SP), +2 SP all-gathers backward, + the recomputed forward's."""
    tp, sp, mode, layers, a = run.tp, run.sp, run.mode, run.layers, run.assumptions
    if tp == 1:
        return 0.0, 0.0
    name, bw, alpha = run.link("tp", tp)
    d = tp_comm_per_layer(run.model.seq_length, run.b, run.model.hidden_size, tp, sp, mode, run.cp)
    per = 2 if sp else 1
    n_f, n_b = 2 * per * layers, (2 * per + (2 if sp else 0) + (2 * per if mode == "full" else 0)) * layers
    bytes_f = 2.0 * d["forward"] * layers
    bytes_b = 2.0 * (d["backward"] + d["sp_backward_all_gather"] + d["recompute_forward"]) * layers
    tp_f, tp_b = bytes_f / bw + n_f * alpha, bytes_b / bw + n_b * alpha
    total = (tp_f + tp_b) * run.m
    hidden = _async_tp_hidden(run, d, bw, alpha) * layers if a.async_tensor_model_parallel_allreduce else 0.0
    exposed_b = (tp_b - hidden) * (1 - a.tp_overlap)
    overlap = f"{a.tp_overlap:.0%} hidden (tp_overlap)"
    if hidden:
        overlap = f"backward's column-parallel collectives beside their GEMMs (async), then {overlap}"
    groups["tp"] = GroupComm("tp", tp, name, (bytes_f + bytes_b) * run.m, total,
                             (tp_f * (1 - a.tp_overlap) + exposed_b) * run.m, overlap, run.nics("tp"))
    return tp_f * (1 - a.tp_overlap), exposed_b


def _async_tp_hidden(run: _Run, d: dict, bw: float, alpha: float) -> float:
    """Seconds of one layer's backward TP communication that Megatron's asynchronous column-parallel backward
    hides (``LinearWithGradAccumulationAndAsyncCommunication`` in ``tensor_parallel/layers.py``): for QKV and
    MLP up, the input-gradient all-reduce runs beside the weight-gradient GEMM; with SP, the input all-gather
    beside the input-gradient GEMM and the input-gradient reduce-scatter beside the weight-gradient GEMM. Each
    collective is hidden up to the time of the GEMM beside it (both gradient GEMMs have the forward GEMM's FLOPs).
    The row-parallel linears' backward collectives (SP's all-gather of the output gradient) and the recomputed
    forward's stay exposed. The GEMM is taken to run at its own speed beside NCCL (the SMs NCCL takes are not
    priced)."""
    model = run.model
    times = {g.name: _gemm_time(run, g) for g in layer_gemms(model.seq_length, run.b, model.hidden_size,
                                                              model.num_heads, run.tp, run.cp,
                                                              run.assumptions.flash_attention)}
    if run.sp:   # one all-gather or reduce-scatter of [s, b, h]: (t-1)/t bsh elements of 2 bytes
        one, per_linear = 2.0 * d["sp_backward_all_gather"] / 2 / bw + alpha, 2
    else:        # one all-reduce: 2 (t-1)/t bsh elements
        one, per_linear = 2.0 * d["backward"] / 2 / bw + alpha, 1
    return sum(per_linear * min(one, times[n]) for n in ("qkv", "mlp_up"))


def _cp_comm(run: _Run, groups: dict) -> tuple[float, float]:
    """CP's exposed seconds per micro-batch (forward, backward), the K/V ring in attention; adds the ``cp`` group."""
    cp, layers, a = run.cp, run.layers, run.assumptions
    if cp == 1:
        return 0.0, 0.0
    name, bw, alpha = run.link("cp", cp)
    d = cp_comm_per_layer(run.model.seq_length, run.b, run.model.hidden_size, run.model.num_heads, cp, run.tp)
    cp_f = 2.0 * d["forward"] * layers / bw + 2 * (cp - 1) * layers * alpha
    cp_b = 2.0 * d["backward_estimate"] * layers / bw + 4 * (cp - 1) * layers * alpha
    total = (cp_f + cp_b) * run.m
    groups["cp"] = GroupComm("cp", cp, name, 2.0 * d["total_estimate"] * layers * run.m, total,
                             total * (1 - a.cp_overlap), f"{a.cp_overlap:.0%} hidden (cp_overlap)", run.nics("cp"))
    return cp_f * (1 - a.cp_overlap), cp_b * (1 - a.cp_overlap)


def _pp_message(run: _Run, notes: list) -> tuple[str, float, float]:
    """One pipeline message, a boundary tensor each way per micro-batch and model chunk (blocking
    send/recv pairs): ``(link, bytes sent, seconds)``; zeros without PP."""
    tp, sp = run.tp, run.sp
    if run.pp == 1:
        return "-", 0.0, 0.0
    name, bw, alpha = run.link("pp", run.pp)
    x = 2.0 * pp_send_elements(run.model.seq_length, run.b, run.model.hidden_size, tp, run.cp, sp)  # bytes of one send
    gather = 0.0
    if name == "network" and run.assumptions.pp_scatter_gather and tp > 1 and not sp:
        x /= tp  # each TP rank sends its 1/t on its own HCA, then an NVLink all-gather
        tp_link = run.link("tp", tp)
        gather = ring_elements_sent("all_gather", x * tp, tp) / tp_link[1] + tp_link[2]
        notes.append("PP across nodes with Narayanan §4.1's scatter/gather: each TP rank sends 1/t "
                     "of the boundary tensor, an NVLink all-gather rebuilds it")
    return name, x, x / bw + alpha + gather


@functools.lru_cache(maxsize=32)
def _schedule(name: str, pp: int, m: int, vp: int):
    """:func:`course_lib.pipeline.schedules.build_schedule`, built once per layout (immutable: tuples of frozen
    actions), so projecting one layout under other assumptions simulates the same object again."""
    from course_lib.pipeline.schedules import build_schedule

    return build_schedule(name, pp, m, vp)


def _pipeline(run: _Run, t_f: list, t_b: list, message: tuple[str, float, float], groups: dict):
    """The simulated schedule (1F1B, or interleaved with ``vp > 1``) of the per-rank times; adds the ``pp``
    group, whose exposed time is what the messages add to the makespan (a second simulation, when asked)."""
    from course_lib.pipeline.cli import MAX_PASSES
    from course_lib.pipeline.simulate import simulate

    pp, vp, m, a = run.pp, run.vp, run.m, run.assumptions
    name, x, pp_raw = message
    if pp * vp * m > MAX_PASSES:
        raise rules.UsageError(f"pp {pp} x vp {vp} x {m} micro-batches = {pp * vp * m} passes; the schedule simulator "
                               f"handles at most {MAX_PASSES}: raise micro_batch_size or lower global_batch_size")
    schedule = _schedule("interleaved" if vp > 1 else "1f1b", pp, m, vp)
    # the messages sit on the dependency path of the schedule (a stage waits for its input), so their
    # cost is what they add to the simulated makespan: the bubble includes the waits, as a measured one does
    timeline = simulate(schedule, t_f, t_b, p2p_latency=pp_raw * (1 - a.pp_overlap))
    if pp > 1:
        sends = 2 * m * vp  # a middle rank: one activation and one gradient per micro-batch and chunk

        def added(schedule=schedule, t_f=t_f, t_b=t_b, with_messages=timeline.makespan):
            return with_messages - simulate(schedule, t_f, t_b).makespan

        groups["pp"] = GroupComm("pp", pp, name, x * sends, pp_raw * sends, added,
                                 f"{a.pp_overlap:.0%} hidden (pp_overlap); exposed = what the waits add to the "
                                 f"simulated schedule (in its bubble)", run.nics("pp"))
    return timeline


def _after_backward(run: _Run, groups: dict) -> dict:
    """Seconds after the pipeline: exposed DP gradient reduction, tied-embedding all-reduce, optimizer
    step; adds the ``dp`` and ``embedding`` groups."""
    p, a, tp, dp, cp = run.plan, run.assumptions, run.tp, run.dp, run.cp
    token = "dp-cp" if cp > 1 else "dp"
    name, bw, alpha = run.link(token, dp * cp)
    if dp * cp > 1:
        t_dp = p.comm["dp"] / bw + alpha
        groups["dp"] = GroupComm(token, dp * cp, name, p.comm["dp"], t_dp, t_dp * (1 - a.dp_overlap),
                                 f"{a.dp_overlap:.0%} hidden behind backward (dp_overlap)", run.nics(token))
    if run.pp > 1:
        name, bw, alpha = run.link("embedding", 2)
        emb = 2.0 * ring_elements_sent("all_reduce", run.model.vocab_size // tp * run.model.hidden_size, 2)
        groups["embedding"] = GroupComm("embedding", 2, name, emb, emb / bw + alpha, emb / bw + alpha,
                                        "none: tied word-embedding gradient, first + last stage",
                                        run.nics("embedding"))
    updated = max(p.params_per_stage) / (dp * cp if run.zero_stage >= 1 else 1)
    t_opt = updated * a.optimizer_bytes_per_param / run.hw.hbm_bandwidth
    return {"dp": groups["dp"].exposed if "dp" in groups else 0.0,
            "embedding": groups["embedding"].exposed if "embedding" in groups else 0.0, "optimizer": t_opt}


def project(model: ModelSpec, tp=1, pp=1, dp=None, cp=1, vp=1, sequence_parallel=False, recompute="none",
            zero_stage=0, micro_batch_size=1, global_batch_size=None, hardware="H100", num_nodes=None,
            assumptions: Assumptions | None = None, **overrides) -> Projection:
    """Project ``model`` under one layout on ``hardware`` (a name of :data:`.hardware.HARDWARE`).

    The layout arguments are :func:`.planner.plan`'s (validated there, one-line ValueErrors).
    ``dp`` may be left out when ``num_nodes`` is given: it is then derived as Megatron does,
    ``num_nodes * gpus_per_node / (tp * pp * cp)``. ``overrides`` set fields of
    :class:`Assumptions` by name (``gemm_peak_efficiency=0.7, dp_overlap=0.8``).
    """
    hw = get_hardware(hardware)
    a = _assumptions(assumptions, overrides)
    dp = _data_parallel_size(dp, num_nodes, hw, tp, pp, cp)
    p = plan(model, tp=tp, pp=pp, dp=dp, cp=cp, vp=vp, sequence_parallel=sequence_parallel, recompute=recompute,
             zero_stage=zero_stage, micro_batch_size=micro_batch_size, global_batch_size=global_batch_size,
             gpu_memory_gb=hw.hbm_gb)
    nodes = _num_nodes(p.world_size, hw, num_nodes)
    notes = list(p.notes)

    from course_lib.topology import RankGrid  # numpy; imported here so `sizing` stays light

    run = _Run(model, p, hw, a, RankGrid(p.world_size, tp=tp, pp=pp, cp=cp), tp=tp, pp=pp, cp=cp, vp=vp, dp=dp,
               b=micro_batch_size, zero_stage=zero_stage)
    gemm_f, gemm_b, mem_f, mem_b, layer = _compute(run)
    groups: dict[str, GroupComm] = {}
    tp_f, tp_b = _tp_comm(run, groups)
    cp_f, cp_b = _cp_comm(run, groups)
    message = _pp_message(run, notes)
    parts = {"gemm": [gemm_f[r] + gemm_b[r] for r in range(pp)],
             "elementwise": [mem_f[r] + mem_b[r] for r in range(pp)],
             "tp": [tp_f + tp_b] * pp, "cp": [cp_f + cp_b] * pp}
    t_f = [gemm_f[r] + mem_f[r] + tp_f + cp_f for r in range(pp)]
    t_b = [gemm_b[r] + mem_b[r] + tp_b + cp_b for r in range(pp)]
    layer["forward"] = layer["gemm_forward"] + layer["elementwise_forward"] + (tp_f + cp_f) / run.layers
    layer["backward"] = layer["gemm_backward"] + layer["elementwise_backward"] + (tp_b + cp_b) / run.layers
    timeline = _pipeline(run, t_f, t_b, message, groups)
    after = _after_backward(run, groups)
    compute = {"gemm_forward": gemm_f[0], "gemm_backward": gemm_b[0], "elementwise": mem_f[0] + mem_b[0],
               "optimizer_step": after["optimizer"]}
    if not p.fits:
        notes.append(f"the busiest rank needs {p.memory['total'] / 1e9:.1f} GB, more than the "
                     f"{hw.hbm_gb:.0f} GB of HBM: the projection is of a run that would not start")
    return Projection(plan=p, hardware=hw, num_nodes=nodes, assumptions=a, t_forward=t_f, t_backward=t_b,
                      parts=parts, after=after, compute=compute, layer=layer, groups=groups,
                      pipeline_time=timeline.makespan, bubble=timeline.bubble_fraction,
                      step_time=timeline.makespan + sum(after.values()), timeline=timeline, notes=notes)


def project_configs(model: ModelSpec, configs: dict, world_size: int = 8, hardware="H100", **kw) -> dict:
    """``{name: Projection}`` for named layouts ``{name: (tp, pp, cp)}`` on ``world_size`` GPUs
    (DP derived, as Megatron does); ``kw`` go to :func:`project` (batch sizes, SP, assumptions)."""
    out = {}
    for name, (tp, pp, cp) in configs.items():
        dp = rules.data_parallel_size(world_size, tp, pp, cp)
        out[name] = project(model, tp=tp, pp=pp, cp=cp, dp=dp, hardware=hardware, **kw)
    return out


def project_published(run: PublishedRun, **overrides) -> Projection:
    """:func:`project` of one published A100 run (:mod:`.published`) in its own layout; ``overrides`` set
    :class:`Assumptions` fields."""
    model = ModelSpec(run.name, run.layers, run.hidden, run.heads, VOCAB, SEQ)
    return project(model, tp=run.tp, pp=run.pp, dp=run.dp, vp=run.vp, sequence_parallel=run.sequence_parallel,
                   recompute=run.recompute, micro_batch_size=run.micro_batch, global_batch_size=run.batch,
                   hardware="A100", **{"async_tensor_model_parallel_allreduce":
                                       run.async_tensor_model_parallel_allreduce, **overrides})


def published_error(run: PublishedRun, proj: Projection) -> float:
    """Projected throughput over the published one, minus 1 (+: the projection is faster): TFLOP/s per GPU
    where the paper gives them (Narayanan's, Eq. 3), else iteration time (published / projected)."""
    if run.tflops is not None:
        return proj.achieved_flops_per_gpu / 1e12 / run.tflops - 1
    return run.seconds / proj.step_time - 1


# ============================================================================ command line

def _preset(name: str) -> dict:
    for key, value in PRESETS.items():
        if key.lower() == name.strip().lower() or key.split(" (")[0].lower() == name.strip().lower():
            return value
    raise rules.UsageError(f"--model {name!r} is not a preset: use one of {', '.join(repr(k) for k in PRESETS)}, "
                           f"or give --num-layers, --hidden-size and --num-attention-heads")


def add_arguments(parser) -> None:
    parser.description = ("Project a layout's step time, tokens/s, TFLOP/s per GPU, MFU and per-group communication "
                          "on a GPU cluster (a model, not a measurement: every assumption is a flag).")
    parser.add_argument("--hardware", default="H100", help=f"GPU profile: {', '.join(HARDWARE)} (default H100)")
    parser.add_argument("--num-nodes", type=int, default=1, help="nodes (DP = nodes x GPUs per node / (TP PP CP))")
    parser.add_argument("--model", default=None, help=f"a preset: {'; '.join(PRESETS)} (the shape flags below "
                        "change its shape)")
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--hidden-size", type=int, default=None)
    parser.add_argument("--num-attention-heads", type=int, default=None)
    parser.add_argument("--seq-length", type=int, default=None, help=f"default {DEFAULT_SHAPE['seq_length']}, or the "
                        "preset's")
    parser.add_argument("--vocab-size", type=int, default=None, help=f"padded vocabulary (default "
                        f"{DEFAULT_SHAPE['vocab_size']}, or the preset's)")
    parser.add_argument("--tensor-model-parallel-size", "--tp", dest="tp", type=int, default=None)
    parser.add_argument("--pipeline-model-parallel-size", "--pp", dest="pp", type=int, default=None)
    parser.add_argument("--context-parallel-size", "--cp", dest="cp", type=int, default=None)
    parser.add_argument("--virtual-pipeline-model-parallel-size", "--vp", dest="vp", type=int, default=None)
    parser.add_argument("--sequence-parallel", action="store_true", default=None)
    parser.add_argument("--recompute-granularity", choices=("full", "selective"), default=None,
                        help="activation recomputation (absent: none, unless the preset recomputes)")
    parser.add_argument("--use-distributed-optimizer", action="store_true", default=None,
                        help="shard the optimizer state over DP (ZeRO-1)")
    parser.add_argument("--micro-batch-size", type=int, default=None)
    parser.add_argument("--global-batch-size", type=int, default=None)
    for f in fields(Assumptions):
        flag = "--" + f.name.replace("_", "-")
        if f.type in (bool, "bool"):
            parser.add_argument(flag, action=argparse_bool(), default=None,
                                help=f"{f.metadata['help']} (default {f.default})")
        else:
            default = "none" if f.default is None else f"{f.default:g}"
            parser.add_argument(flag, type=float, default=None, help=f"{f.metadata['help']} (default {default})")


def argparse_bool():
    import argparse

    return argparse.BooleanOptionalAction


DEFAULT_SHAPE = {"seq_length": 2048, "vocab_size": 51200}   # Narayanan §5.1's, when no preset gives them
_SHAPE_FLAGS = {"num_layers": "num_layers", "hidden_size": "hidden_size", "num_heads": "num_attention_heads",
                "vocab_size": "vocab_size", "seq_length": "seq_length"}   # ModelSpec field: argparse dest


def _model(args):
    """The model of the command line: a preset with the shape flags given applied to it, or the shape flags
    alone (which then must give layers, hidden size and heads). :func:`.planner.plan` validates the shape."""
    given = {field_: getattr(args, flag) for field_, flag in _SHAPE_FLAGS.items() if getattr(args, flag) is not None}
    if args.model:
        preset = _preset(args.model)
        changed = ", ".join(f"{_SHAPE_FLAGS[k]}={v}" for k, v in given.items())
        model = preset["model"]
        if given:
            model = replace(model, name=f"{model.name} with {changed}", **given)
        config = dict(preset["config"])
        config.pop("dp", None)  # derived from --num-nodes, as Megatron derives it from the launch
        return model, config
    missing = [f"--{flag.replace('_', '-')}" for field_, flag in list(_SHAPE_FLAGS.items())[:3] if field_ not in given]
    if missing:
        raise rules.UsageError(f"{', '.join(missing)} missing: give the model's shape, or --model with a preset "
                               f"({'; '.join(PRESETS)})")
    model = ModelSpec("model", **{**DEFAULT_SHAPE, **given})
    return model, dict(tp=1, pp=1, cp=1, vp=1, sequence_parallel=False, recompute="none", zero_stage=0,
                       micro_batch_size=1, global_batch_size=None)


def run(args) -> int:
    model, config = _model(args)
    for key in ("tp", "pp", "cp", "vp", "micro_batch_size", "global_batch_size"):
        if getattr(args, key) is not None:
            config[key] = getattr(args, key)
    if args.sequence_parallel:
        config["sequence_parallel"] = True
    if args.recompute_granularity:
        config["recompute"] = args.recompute_granularity
    if args.use_distributed_optimizer:
        config["zero_stage"] = 1
    overrides = {f.name: getattr(args, f.name) for f in fields(Assumptions) if getattr(args, f.name) is not None}
    proj = project(model, hardware=args.hardware, num_nodes=args.num_nodes, **config, **overrides)
    print(proj.summary())
    return 0
