"""The communication formulas of ``course_lib.sizing`` against what real ranks measure.

Every expected value comes from the sizing formula under test (``tp_comm_per_layer``,
``cp_comm_per_layer``, ``pp_send_elements`` / ``pp_comm_per_iteration``,
``dp_comm_per_iteration``, ``parameters_per_stage`` / ``parameter_breakdown``); every
measured value comes from real forked gloo ranks running the course's parallel code:

* TP: ``ParallelTransformerLayer`` forward + backward, t = 2 and 4, with and without
  sequence parallelism, with and without full recomputation (``torch.utils.checkpoint``,
  reentrant as Megatron's ``CheckpointFunction``, and torch's early-stopping default);
  the collectives recorded by ``course_lib.comm.CommRecorder``.
* CP: ``ring_attention`` forward + backward, cp = 2 and 4, MHA / GQA / MQA, with TP = 2 too;
  its K/V (and dK/dV) sends recorded with kind "cp".
* PP: the pipeline executor (``run_rank_schedule``) running 1F1B, interleaved, GPipe and
  ZB-H1; its sends are counted at the ``torch.distributed`` boundary (the executor does not
  report to ``CommRecorder``; see ``_count_p2p_sends``).
* DP: the course GPT (``course_lib.model``) on TP x DP = 2 x 2 and 1 x 4: its parameter count
  against Eq. 2's terms, and the gradient all-reduce (and ZeRO's reduce-scatter + all-gather)
  over the DP group.
* A real step: one iteration of the course trainer (``course_lib.train.pretrain``) on 8 ranks,
  TP2 PP2 CP2 and TP2 PP2 DP2 + SP, every kind of traffic per rank against its formula.

The formulas count elements one rank *sends* under the ring model; the recorder records the
full tensor of each collective. ``course_lib.sizing.measured`` converts; the ring model
itself is measured here with a ring all-reduce built from send/recv
(``course_lib.communication_patterns.ring_all_reduce``). Sizes are small (h = 16) so the whole file runs
in a few seconds on 2 cores; pass ``-s`` to see the measured figures.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from course_lib import sizing
from course_lib.communication_patterns import ring_all_reduce
from course_lib.comm import (CommEvent, CommRecorder, all_gather, all_reduce, reduce_scatter, ring_elements_sent,
                             summarize)
from course_lib.context_parallel import reference_attention, ring_attention, shard_sequence
from course_lib.launch import launch
from course_lib.model import GPTConfig, GPTModel, build_model, gpt_loss
from course_lib.pipeline.check import check_schedule
from course_lib.pipeline.executor import run_rank_schedule, warm_up_autograd
from course_lib.pipeline.schedules import build_schedule
from course_lib.pipeline.stages import StackConfig, build_stages, make_batch
from course_lib.process_groups import new_process_groups
from course_lib.sizing.measured import cp_layer_volume, dp_volume, pp_rank_volume, tp_layer_volume
from course_lib.tensor_parallel import (DenseTransformerLayer, ParallelTransformerLayer, TransformerConfig,
                                        allreduce_sequence_parallel_grads, sequence_parallel_params)
from course_lib.topology import RankGrid
from course_lib.train import parse_args, pretrain, validate_args

S, B, H, HEADS, LAYERS = 8, 2, 16, 4, 2
SEED = 4321
TOL = 1e-5
WORLD = 4


def _groups(sizes_of_blocks):
    """Create (on every rank, same order) the groups that cut the world into blocks of each size.

    Returns ``{size: this rank's group}``; blocks are consecutive ranks ([0,1],[2,3] for 2)."""
    rank, mine = dist.get_rank(), {}
    for size in sizes_of_blocks:
        for start in range(0, WORLD, size):
            ranks = list(range(start, start + size))
            g = dist.new_group(ranks)
            if rank in ranks:
                mine[size] = g
    return mine


def _strided_groups(stride):
    """Groups of ranks ``{r, r + stride, ...}`` (Megatron's DP/CP groups when TP is fastest)."""
    rank, mine = dist.get_rank(), None
    for start in range(stride):
        ranks = list(range(start, WORLD, stride))
        g = dist.new_group(ranks)
        if rank in ranks:
            mine = g
    return mine


def _event(op="all_reduce", kind="tp", numel=8, group_size=2, direction="fwd", tag=None):
    return CommEvent(op=op, kind=kind, group_size=group_size, numel=numel, bytes=4 * numel, direction=direction,
                     tag=tag)


def test_measured_helpers_convert_and_reject_mixed_input():
    """course_lib.sizing.measured on hand-made events: the units, and one-line ValueErrors."""
    bwd = [_event(direction="bwd"), _event("all_gather", direction="bwd", tag="recompute"), _event()]
    assert tp_layer_volume([_event()], bwd) == {"forward": 8.0, "backward": 8.0, "sp_backward_all_gather": 4.0,
                                                "recompute_forward": 8.0, "total": 28.0}
    with pytest.raises(ValueError, match="expects only kind 'tp'"):
        tp_layer_volume([_event(kind="dp")], [])
    with pytest.raises(ValueError, match="differ in size"):
        cp_layer_volume([_event("send", "cp", 4), _event("send", "cp", 6)], [])
    assert pp_rank_volume([("act", 5), ("grad", 5)]) == {"per_send": 5, "forward": 5, "backward": 5, "total": 10,
                                                         "count": {"act": 1, "grad": 1}}
    with pytest.raises(ValueError, match="unknown"):
        pp_rank_volume([("activation", 5)])
    with pytest.raises(ValueError, match="groups of sizes"):
        dp_volume([_event(kind="dp"), _event(kind="dp-cp", group_size=4)])
    assert dp_volume([_event(kind="dp-cp", numel=12, group_size=4)])["total"] == 18.0


def _report(capsys, lines):
    with capsys.disabled():
        print("\n" + "\n".join(lines))


# ============================================================================ TP


# "full": torch.utils.checkpoint(use_reentrant=True), which re-runs the whole forward in backward, as
# Megatron's full recompute does (megatron/core/tensor_parallel/random.py, CheckpointFunction);
# "full-early-stop": torch's default non-reentrant checkpoint, which stops recomputing once the last
# tensor saved for backward is rebuilt -- so the layer's last collective is not re-issued.
RECOMPUTE_MODES = ("none", "full", "full-early-stop")


def _tp_config(sp):
    return TransformerConfig(hidden_size=H, num_attention_heads=HEADS, num_layers=LAYERS, sequence_parallel=sp)


def _tp_inputs():
    g = torch.Generator().manual_seed(7)
    return torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)


def _tp_rank(x, dy):
    groups = _groups([2, 4])
    results = {}
    for t in (2, 4):
        group = groups[t]
        r = dist.get_rank(group)
        # The ring model, measured: a ring all-reduce made of send/recv over this group.
        sent = []
        ring_all_reduce(torch.ones(S * B * H), group, sent=sent)
        results[("ring", t)] = sent
        for sp in (False, True):
            for recompute in RECOMPUTE_MODES:
                torch.manual_seed(SEED)
                layer = ParallelTransformerLayer(_tp_config(sp), group)
                xi = (x.chunk(t)[r] if sp else x).clone().requires_grad_()     # [s/t or s, b, h]
                dyi = dy.chunk(t)[r] if sp else dy
                with CommRecorder() as fwd:
                    if recompute == "none":
                        y = layer(xi)
                    else:  # "full": reentrant, like Megatron's CheckpointFunction; "full-early-stop": torch's default
                        y = checkpoint(layer, xi, use_reentrant=recompute == "full")
                with CommRecorder() as bwd:
                    y.backward(dyi)
                with CommRecorder() as grads:   # Megatron's finalize_model_grads, not part of the layer
                    allreduce_sequence_parallel_grads(layer, group)
                sp_numel = sum(p.numel() for _, p in sequence_parallel_params(layer))
                results[(t, sp, recompute)] = dict(fwd=fwd.events, bwd=bwd.events, grads=grads.events,
                                                   y=y.detach(), tp_rank=r, sp_numel=sp_numel)
    return results


@pytest.fixture(scope="module")
def tp_runs():
    warm_up_autograd()   # torch's first non-scalar backward imports ~500 modules: once here, not in every rank
    one = torch.ones(2, requires_grad=True)  # so does the first checkpoint (torch._dynamo): import it before forking
    checkpoint(torch.sin, one, use_reentrant=False).sum().backward()
    x, dy = _tp_inputs()
    torch.manual_seed(SEED)
    dense = DenseTransformerLayer(_tp_config(False))
    with torch.no_grad():
        y_ref = dense(x)
    return launch(_tp_rank, world_size=WORLD, output="none", timeout=60, x=x, dy=dy), y_ref


def test_ring_model_is_what_a_send_recv_ring_sends(tp_runs):
    """The ring model (numel -> elements one rank sends) of the formulas and of measured.py,
    measured: a ring all-reduce of b*s*h elements built from send/recv, sends counted per rank."""
    ranks, _ = tp_runs
    n = S * B * H
    for t in (2, 4):
        for res in ranks:
            sent = res[("ring", t)]
            assert len(sent) == 2 * (t - 1)                                   # reduce-scatter + all-gather steps
            # one cost model for the formulas and the recorder (what measured.py uses): 2 N (t-1)/t,
            # each phase N (t-1)/t
            assert sizing.ring_elements_sent is ring_elements_sent
            assert sum(sent) == ring_elements_sent("all_reduce", n, t)
            assert sum(sent[: t - 1]) == ring_elements_sent("reduce_scatter", n, t)
            assert sum(sent[t - 1:]) == ring_elements_sent("all_gather", n, t)


def test_tp_layer_comm_equals_tp_comm_per_layer(tp_runs, capsys):
    """Per rank, per layer: recorded TP traffic == sizing.tp_comm_per_layer, term by term.

    Without SP: 2 all-reduces of b*s*h forward, 2 backward (the f operators); with SP each becomes
    an all-gather + reduce-scatter pair and the backward re-gathers each GEMM block's input (tag
    "recompute": the formula's ``sp_backward_all_gather``); full recompute re-issues the forward
    collectives during backward (``recompute_forward``) -- exactly so with a reentrant checkpoint
    (Megatron's). Not in the formula, and checked here to be exactly these:

    * under SP, one all-reduce over TP of the LayerNorm and row-parallel-bias gradients (6h
      elements per layer; Megatron ``finalize_model_grads``), once per iteration after backward;
    * torch's default (non-reentrant, early-stopping) checkpoint re-issues one collective fewer
      than the formula's ``recompute_forward``: the layer's last all-reduce (reduce-scatter with
      SP) produces no tensor the backward needs, so it is not recomputed.
    """
    ranks, y_ref = tp_runs
    lines = [f"[sizing vs measured] TP, one layer, s={S} b={B} h={H}, elements sent per rank (ring):"]
    worst = 0.0
    for t in (2, 4):
        for sp in (False, True):
            for recompute in RECOMPUTE_MODES:
                formula = sizing.tp_comm_per_layer(S, B, H, t, sequence_parallel=sp,
                                                   recompute="none" if recompute == "none" else "full")
                expected = dict(formula)
                if recompute == "full-early-stop":   # minus the last g (all-reduce) / reduce-scatter
                    last = ring_elements_sent("all_gather" if sp else "all_reduce", S * B * H, t)
                    expected["recompute_forward"] -= last
                    expected["total"] -= last
                for res in ranks:
                    run = res[(t, sp, recompute)]
                    measured = tp_layer_volume(run["fwd"], run["bwd"])
                    assert measured == expected, (t, sp, recompute, measured, formula)
                    # what the ranks really exchanged: every collective is on a full [s, b, h] tensor
                    assert {e.numel for e in run["fwd"] + run["bwd"]} == {S * B * H}
                    per_pass = 4 if sp else 2       # 2 all-reduces, or 2 x (all-gather + reduce-scatter)
                    n_recompute = {"none": 0, "full": per_pass, "full-early-stop": per_pass - 1}[recompute]
                    assert len(run["fwd"]) == per_pass
                    assert len(run["bwd"]) == per_pass + (2 if sp else 0) + n_recompute
                    # the exclusion, exactly: SP's replicated-parameter gradient all-reduce
                    excluded = summarize(run["grads"])
                    if sp:
                        assert run["sp_numel"] == 6 * H
                        assert excluded.count() == 1
                        assert excluded.ring_elements_sent() == ring_elements_sent("all_reduce", 6 * H, t)
                    else:
                        assert excluded.count() == 0
                    # the measured run is the real layer: output == the dense layer's
                    ref = y_ref.chunk(t)[run["tp_rank"]] if sp else y_ref
                    worst = max(worst, (run["y"] - ref).abs().max().item())
                lines.append(f"  t={t} sp={sp!s:5} {recompute:15}: measured {measured['total']:5.0f}, formula "
                             f"{formula['total']:5.0f} (fwd {measured['forward']:.0f}, bwd {measured['backward']:.0f},"
                             f" sp re-gather {measured['sp_backward_all_gather']:.0f}, recompute "
                             f"{measured['recompute_forward']:.0f}/{formula['recompute_forward']:.0f})")
    assert worst <= TOL
    lines.append(f"  not in the formula (SP only): all-reduce of 6h={6 * H} LayerNorm/bias grads per layer; "
                 f"worst |y - dense y| {worst:.1e}")
    _report(capsys, lines)


def test_pp_send_with_tp_sp_is_the_layer_output_shard(tp_runs):
    """What a pipeline stage of TP layers would send: the layer output this rank holds,
    [s, b, h], or [s/t, b, h] with SP (Megatron's ``get_tensor_shapes``) == pp_send_elements."""
    ranks, _ = tp_runs
    for t in (2, 4):
        for sp in (False, True):
            for res in ranks:
                assert res[(t, sp, "none")]["y"].numel() == sizing.pp_send_elements(
                    S, B, H, tp=t, sequence_parallel=sp)


# ============================================================================ CP

CP_S = 16                                     # zigzag needs s % (2 cp) == 0
CP_CASES = [  # (cp, tp, num_query_groups, layout, causal, dtype)
    (2, 1, HEADS, "zigzag", True, torch.float32),
    (4, 1, HEADS, "zigzag", True, torch.float32),
    (4, 1, 2, "zigzag", True, torch.float32),                 # GQA
    (4, 1, HEADS, "contiguous", False, torch.float32),
    (2, 2, HEADS, "zigzag", True, torch.float32),             # TP x CP: TP [0,1][2,3], CP [0,2][1,3]
    (2, 2, 1, "zigzag", True, torch.float32),                 # MQA under TP: each TP rank keeps the K/V head
    (4, 1, HEADS, "zigzag", True, torch.bfloat16),            # bytes: dK/dV travel in float32
]


def _cp_inputs(groups):
    g = torch.Generator().manual_seed(11)
    hn = H // HEADS
    return (torch.randn(B, HEADS, CP_S, hn, generator=g), torch.randn(B, groups, CP_S, hn, generator=g),
            torch.randn(B, groups, CP_S, hn, generator=g), torch.randn(B, HEADS, CP_S, hn, generator=g))


def _tp_slice(x, tp, tp_rank):
    """This TP rank's heads (dim 1); a single K/V head is replicated, as Megatron does when g < t."""
    return x if x.shape[1] < tp else x.chunk(tp, dim=1)[tp_rank]


def _cp_rank(cases):
    rank = dist.get_rank()
    blocks = _groups([2, 4])
    strided = _strided_groups(2)      # [0,2], [1,3]
    out = {}
    for case in cases:
        cp, tp, ng, layout, causal, dtype = case
        if tp == 1:
            group, tp_rank = blocks[cp], 0
        else:
            group, tp_rank = strided, dist.get_rank(blocks[2])
        r = dist.get_rank(group)
        q, k, v, do = _cp_inputs(ng)
        q, k, v, do = (_tp_slice(a, tp, tp_rank) for a in (q, k, v, do))
        local = [shard_sequence(a, r, cp, layout=layout).to(dtype).requires_grad_() for a in (q, k, v)]
        with CommRecorder() as fwd:
            o = ring_attention(*local, group, causal=causal, layout=layout)
        with CommRecorder() as bwd:
            o.backward(shard_sequence(do, r, cp, layout=layout).to(dtype))
        ref = reference_attention(q, k, v, causal=causal)
        out[case] = dict(fwd=fwd.events, bwd=bwd.events,
                         err=(o.detach().float() - shard_sequence(ref, r, cp, layout=layout)).abs().max().item())
    return out


def test_cp_ring_sends_equal_cp_comm_per_layer(capsys):
    """Per rank: K/V elements sent by ring attention == sizing.cp_comm_per_layer.

    Forward: cp - 1 steps of one K and one V chunk of (s/cp)*b*(h/a)*(g/t) elements (the formula's
    exact term). Backward: K, V and the travelling dK, dV accumulators, cp - 1 steps each -- the
    formula's ``backward_estimate`` (2 x forward) is exact for this (Transformer Engine style) ring.
    Units: the formula counts elements; in bytes, the backward's dK/dV half travels in float32
    even for 16-bit K/V (the accumulators are float32), so "elements x 2 bytes" undercounts it.
    """
    ranks = launch(_cp_rank, world_size=WORLD, output="none", timeout=60, cases=CP_CASES)
    lines = [f"[sizing vs measured] CP ring attention, s={CP_S} b={B} h={H} a={HEADS}, elements sent per rank:"]
    worst = 0.0
    for case in CP_CASES:
        cp, tp, ng, layout, causal, dtype = case
        formula = sizing.cp_comm_per_layer(CP_S, B, H, HEADS, cp, tp=tp, num_query_groups=ng)
        for res in ranks:
            run = res[case]
            m = cp_layer_volume(run["fwd"], run["bwd"])
            assert m["chunk"] == formula["chunk"], case
            assert m["forward"] == formula["forward"], case
            assert m["backward"] == formula["backward_estimate"], case
            assert m["total"] == formula["total_estimate"], case
            assert m["sends"] == {"fwd": 2 * (cp - 1), "bwd": 4 * (cp - 1)}
            size = torch.empty((), dtype=dtype).element_size()
            fwd_bytes = sum(e.bytes for e in run["fwd"] if e.op == "send")
            bwd_bytes = sum(e.bytes for e in run["bwd"] if e.op == "send")
            assert fwd_bytes == formula["forward"] * size
            assert bwd_bytes == formula["forward"] * size + formula["forward"] * 4   # K,V in dtype; dK,dV fp32
            if dtype == torch.float32:
                worst = max(worst, run["err"])
            else:
                assert run["err"] <= 5e-2                                           # bfloat16 inputs
        lines.append(f"  cp={cp} tp={tp} groups={ng} {layout:10} {str(dtype)[6:]:8}: chunk {m['chunk']}, fwd "
                     f"{m['forward']:.0f} (formula {formula['forward']}), bwd {m['backward']:.0f} (formula estimate "
                     f"{formula['backward_estimate']}); bytes fwd {fwd_bytes}, bwd {bwd_bytes}")
    assert worst <= TOL
    lines.append(f"  worst |ring attention - reference| (float32) {worst:.1e}")
    _report(capsys, lines)


# ============================================================================ PP

PP_CFG = StackConfig(num_layers=8, seq_length=S, micro_batch_size=B, hidden_size=H, ffn_hidden_size=4 * H)
PP_RUNS = [  # (name, pp, m, vp); pp=2 runs two pipelines side by side ([0,1] and [2,3])
    ("1f1b", 4, 4, 1),
    ("interleaved", 4, 4, 2),
    ("zb-h1", 4, 4, 1),
    ("interleaved", 2, 4, 2),
    ("gpipe", 2, 3, 1),
]


def _count_p2p_sends(chunks, last_stage_chunks):
    """Patch this rank's ``dist.send`` / ``dist.batch_isend_irecv`` to list every tensor sent.

    The executor calls torch.distributed directly (no ``course_lib.comm`` record), so its sends
    are observed here, at the boundary. A sent tensor is an activation ("act") when it shares
    storage with a chunk output (``out.detach()``), else an input gradient ("grad"). Returns
    ``(sends, undo)``; ``sends`` gets ``(what, numel, peer)`` tuples."""
    sends, act_ptrs, hooks = [], set(), []
    for cid, chunk in chunks.items():
        if cid not in last_stage_chunks:
            hooks.append(chunk.register_forward_hook(
                lambda mod, inp, out: act_ptrs.add(out.untyped_storage().data_ptr())))

    def note(tensor, peer):
        ptr = tensor.untyped_storage().data_ptr()
        what = "act" if ptr in act_ptrs else "grad"
        act_ptrs.discard(ptr)          # sent once; its memory may be reused later
        sends.append((what, tensor.numel(), peer))

    real_send, real_batch = dist.send, dist.batch_isend_irecv

    def send(tensor, dst=None, group=None, *args, **kwargs):
        note(tensor, dst)
        return real_send(tensor, dst, group, *args, **kwargs)

    def batch_isend_irecv(ops):
        for op in ops:
            if op.op is dist.isend:
                note(op.tensor, op.peer)
        return real_batch(ops)

    dist.send, dist.batch_isend_irecv = send, batch_isend_irecv

    def undo():
        dist.send, dist.batch_isend_irecv = real_send, real_batch
        for h in hooks:
            h.remove()

    return sends, undo


def _pp_rank(runs, cfg):
    rank = dist.get_rank()
    blocks = _groups([2])
    out = {}
    for name, pp, m, vp in runs:
        if pp == WORLD:
            group, pp_rank = dist.group.WORLD, rank
        else:
            group, pp_rank = blocks[pp], dist.get_rank(blocks[pp])
        schedule = build_schedule(name, pp, m, vp)
        p2p = check_schedule(schedule, None)
        _, chunks = build_stages(cfg, pp_rank, pp, vp)
        last = {c for c in chunks if c * pp + pp_rank == pp * vp - 1}
        tokens, labels = make_batch(cfg, m)
        sends, undo = _count_p2p_sends(chunks, last)
        try:
            with CommRecorder() as rec:
                res = run_rank_schedule(schedule, pp_rank, chunks, tokens, labels, pp_group=group, p2p=p2p,
                                        activation_shape=(cfg.seq_length, cfg.micro_batch_size, cfg.hidden_size))
        finally:
            undo()
        out[(name, pp, m, vp)] = dict(sends=sends, recorded=rec.filter(kind="pp", op="send"), pp_rank=pp_rank,
                                      p2p=p2p, losses=res["losses"])
    return out


def test_pp_sends_equal_pp_send_elements_and_pp_comm_per_iteration(capsys):
    """Per rank and iteration: the executor's sends == sizing.pp_send_elements (each send: b*s*h)
    and sizing.pp_comm_per_iteration (the busiest rank's activation and gradient elements)."""
    warm_up_autograd()
    ranks = launch(_pp_rank, world_size=WORLD, output="none", timeout=60, runs=PP_RUNS, cfg=PP_CFG)
    per_send = sizing.pp_send_elements(S, B, H)
    lines = [f"[sizing vs measured] PP executor, s={S} b={B} h={H}: per send {per_send} elements (b*s*h)"]
    for key in PP_RUNS:
        name, pp, m, vp = key
        formula = sizing.pp_comm_per_iteration(S, B, H, pp, m, vp=vp)
        assert formula["per_send"] == per_send
        for pipeline in ([[0, 1], [2, 3]] if pp == 2 else [[0, 1, 2, 3]]):
            runs = [ranks[r][key] for r in pipeline]
            vols = [pp_rank_volume((w, n) for w, n, _ in run["sends"]) for run in runs]
            for run, vol in zip(runs, vols):
                assert vol["per_send"] == per_send, (key, vol)
                # once the executor reports to CommRecorder, the records must agree with the wire
                if run["recorded"]:
                    assert sorted(e.numel for e in run["recorded"]) == sorted(n for _, n, _ in run["sends"])
            # the busiest rank sends what the formula says, split forward / backward
            assert max(v["total"] for v in vols) == formula["total"], (key, vols, formula)
            busiest = vols[1:-1] if pp > 2 else vols[-1:]   # middle ranks; with pp=2 the last rank
            for vol in busiest:
                assert (vol["forward"], vol["backward"]) == (formula["forward"], formula["backward"]), key
            # the docstring's premise: every micro-batch crosses each of the pp*vp-1 boundaries once each way
            assert sum(v["count"]["act"] for v in vols) == m * (pp * vp - 1)
            assert sum(v["count"]["grad"] for v in vols) == m * (pp * vp - 1)
        lines.append(f"  {name:11} pp={pp} m={m} vp={vp} ({runs[0]['p2p']}): elements sent per rank "
                     f"{[v['total'] for v in vols]}, busiest = formula {formula['total']} "
                     f"(fwd {formula['forward']}, bwd {formula['backward']})")
    recorded = any(ranks[r][k]["recorded"] for r in range(WORLD) for k in PP_RUNS)
    lines.append("  executor sends seen by CommRecorder: " + ("yes (checked equal)" if recorded else
                 "no (counted at torch.distributed; executor needs a comm.record_event hook)"))
    _report(capsys, lines)


# ============================================================================ DP

GPT = GPTConfig(num_layers=LAYERS, hidden_size=H, num_attention_heads=HEADS, seq_length=S)  # vocab 257 -> 384


def _breakdown_measured(model):
    """Parameter counts of the dense course GPT in the terms of sizing.parameter_breakdown."""
    n = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
    layer = model.decoder.layers["0"]
    return {"per_layer": {"qkv": n(layer.self_attention.linear_qkv),
                          "attention_proj": n(layer.self_attention.linear_proj),
                          "mlp_fc1": n(layer.mlp.linear_fc1), "mlp_fc2": n(layer.mlp.linear_fc2),
                          "layernorms": n(layer.input_layernorm) + n(layer.pre_mlp_layernorm)},
            "layers": n(model.decoder.layers), "word_embedding": n(model.embedding.word_embeddings),
            "position_embedding": n(model.embedding.position_embeddings),
            "final_layernorm_not_in_eq2": n(model.decoder.final_layernorm)}


def test_parameter_count_of_the_course_gpt_equals_eq2_terms():
    """sum(p.numel()) of course_lib.model.GPTModel == num_parameters (Narayanan Eq. 2), term by term,
    plus the final LayerNorm (2h) that Eq. 2 leaves out and parameter_breakdown lists apart."""
    V = GPT.padded_vocab_size
    model = GPTModel(GPT)
    breakdown = sizing.parameter_breakdown(LAYERS, H, V, S)
    assert _breakdown_measured(model) == {k: v for k, v in breakdown.items() if k != "total"}
    assert sum(p.numel() for p in model.parameters()) == sizing.num_parameters(LAYERS, H, V, S) + 2 * H


def _dp_rank():
    out = {}
    for tp, dp in ((2, 2), (1, 4)):
        groups = new_process_groups(RankGrid(WORLD, tp=tp))   # Megatron order: TP [0,1][2,3], DP [0,2][1,3]
        (chunk,) = build_model(GPT, groups)
        g = torch.Generator().manual_seed(100 + groups.coords["dp"])   # each DP replica its own micro-batch
        tokens = torch.randint(0, GPT.vocab_size, (B, S + 1), generator=g)
        with CommRecorder() as step:
            total, count = gpt_loss(chunk(tokens[:, :-1]), tokens[:, 1:], groups.tp)
            (total / count).backward()
        params = list(chunk.parameters())                            # the tied output weight counted once
        flat = torch.cat([p.grad.reshape(-1) for p in params])      # Megatron's contiguous grad buffer
        sent = []
        ring = ring_all_reduce(flat, groups.dp_cp, sent=sent)        # real sends, counted
        with CommRecorder() as allreduce:
            reduced = all_reduce(flat.clone(), groups.dp_cp, kind="dp", source="grad buffer")
        with CommRecorder() as zero:     # ZeRO-1/2, Megatron's distributed optimizer
            shard = reduce_scatter(flat.clone(), groups.dp_cp, kind="dp", source="grad buffer")
            gathered = all_gather(shard, groups.dp_cp, kind="dp", source="updated params")
        out[(tp, dp)] = dict(numel=sum(p.numel() for p in params), ring_sent=sent, allreduce=allreduce.events,
                             zero=zero.events, tp_step=step.filter(kind="tp"), reduced=reduced,
                             err=max((ring - reduced).abs().max().item(), (gathered - reduced).abs().max().item()))
    return out


def test_dp_gradient_comm_equals_dp_comm_per_iteration(capsys):
    """The course GPT (course_lib.model) on TP x DP = 2 x 2 and 1 x 4, one micro-batch per replica.

    Parameters per rank == parameters_per_stage (+ the final LayerNorm). Gradient synchronisation
    per rank == dp_comm_per_iteration of that count, measured three ways: the elements a send/recv
    ring all-reduce really sent, the recorded all-reduce of the flat gradient buffer, and ZeRO-1/2's
    recorded reduce-scatter + all-gather (zero_stage=1 and 2 give the same volume).
    """
    ranks = launch(_dp_rank, world_size=WORLD, output="none", timeout=60)
    V = GPT.padded_vocab_size
    lines = [f"[sizing vs measured] DP, course GPT l={LAYERS} h={H} V={V} (padded) s={S}:"]
    for tp, dp in ((2, 2), (1, 4)):
        n_formula = sizing.parameters_per_stage(LAYERS, H, V, S, HEADS, tp=tp, pp=1)[0] + 2 * H
        f = sizing.dp_comm_per_iteration(n_formula, dp)
        for res in ranks:
            run = res[(tp, dp)]
            assert run["numel"] == n_formula, (tp, run["numel"], n_formula)
            assert sum(run["ring_sent"]) == f["total"]               # elements really sent
            assert dp_volume(run["allreduce"]) == {"group_size": f["group_size"], "numel": {"all_reduce": n_formula},
                                                   "total": f["total"]}
            for stage in (1, 2):
                assert dp_volume(run["zero"])["total"] == sizing.dp_comm_per_iteration(
                    n_formula, dp, zero_stage=stage)["total"]
            assert run["err"] <= TOL
            if tp > 1:   # a whole step's TP traffic: the layers (formula) + the embedding's g (b*s*h, fwd),
                #          the tied output layer's f (b*s*h, bwd), the loss's three all-reduces of s*b (fwd)
                per_layer = sizing.tp_comm_per_layer(S, B, H, tp)["total"]
                extras = (2 * ring_elements_sent("all_reduce", B * S * H, tp)
                          + 3 * ring_elements_sent("all_reduce", S * B, tp))
                assert summarize(run["tp_step"]).ring_elements_sent() == LAYERS * per_layer + extras
        for dp_ranks in ([[0, 2], [1, 3]] if dp == 2 else [[0, 1, 2, 3]]):   # replicas agree after the all-reduce
            assert all(torch.equal(ranks[dp_ranks[0]][(tp, dp)]["reduced"], ranks[r][(tp, dp)]["reduced"])
                       for r in dp_ranks)
        run = ranks[0][(tp, dp)]
        lines.append(f"  tp={tp} dp={dp}: params/rank {n_formula} (= formula), grad sync sent/rank "
                     f"{f['total']:.0f} = ring send/recv {sum(run['ring_sent'])} = recorded all-reduce "
                     f"{dp_volume(run['allreduce'])['total']:.0f} = ZeRO RS+AG {dp_volume(run['zero'])['total']:.0f}")
    _report(capsys, lines)


# ============================================================================ a real training step

STEP_S, STEP_MBS = 16, 2
STEP_RUNS = {  # name: (flags, tp, pp, cp, sp); DP is derived (world 8)
    "F  TP2 PP2 CP2": (["--context-parallel-size", "2", "--global-batch-size", "4"], 2, 2, 2, False),
    "D  TP2 PP2 DP2 +SP": (["--sequence-parallel", "--global-batch-size", "8"], 2, 2, 1, True),
}
STEP_LAYERS = (2, 4)   # two depths: the per-layer terms are the difference, the rest is listed


def _step_argv(flags, layers):
    return ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", *flags,
            "--num-layers", str(layers), "--hidden-size", str(H), "--num-attention-heads", str(HEADS),
            "--seq-length", str(STEP_S), "--micro-batch-size", str(STEP_MBS), "--train-iters", "1",
            "--log-interval", "1", "--uniform-vocab-padding"]


def _step_ranks(argvs):
    """:func:`_step_rank` of each argv in turn, in one launch (a launch of 8 ranks costs more than a step)."""
    return [_step_rank(argv) for argv in argvs]


def _step_rank(argv):
    """One iteration of course_lib.train.pretrain, every collective recorded; pipeline sends counted on
    the wire (P2P ops on this rank's pipeline group, through torch.distributed)."""
    args = parse_args(argv)
    pcfg = validate_args(args, dist.get_world_size()).parallel
    pp_ranks = sorted(pcfg.grid.group_of(dist.get_rank(), "pp"))
    wire = []
    real_send, real_batch = dist.send, dist.batch_isend_irecv

    def on_pp(group):
        return group is not None and sorted(dist.get_process_group_ranks(group)) == pp_ranks

    def send(tensor, dst=None, group=None, *a, **k):
        if on_pp(group):
            wire.append(tensor.numel())
        return real_send(tensor, dst, group, *a, **k)

    def batch_isend_irecv(ops):
        wire.extend(op.tensor.numel() for op in ops if op.op is dist.isend and on_pp(op.group))
        return real_batch(ops)

    dist.send, dist.batch_isend_irecv = send, batch_isend_irecv
    try:
        with CommRecorder() as rec:
            record = pretrain(args, print_args=False)
    finally:
        dist.send, dist.batch_isend_irecv = real_send, real_batch
    return dict(events=rec.events, wire=wire, coords=record["coords"], num_parameters=record["num_parameters"],
                m=pcfg.num_microbatches, dp=pcfg.dp, loss=record["lm_loss"][-1])


def _tp_sent(res, direction):
    """TP elements a rank sent in one pass of the step (ring model), without SP's gradient all-reduce."""
    events = [e for e in res["events"] if e.kind == "tp" and e.direction == direction
              and e.source != "allreduce_sequence_parallel_grads"]
    return summarize(events).ring_elements_sent()


def test_real_training_step_comm_equals_the_formulas(capsys):
    """One iteration of the course trainer (course_lib.train.pretrain) on 8 ranks, configs F (TP2 PP2
    CP2) and D (TP2 PP2 DP2) with SP, at two depths; per rank:

    * parameters == parameters_per_stage[pp rank] (+ the final LayerNorm on the last stage);
    * the dp-cp gradient all-reduce == dp_comm_per_iteration(parameters, dp, cp);
    * ring attention's sends == layers on the rank x micro-batches x cp_comm_per_layer;
    * pipeline sends on the wire: each == pp_send_elements(s, b, h, tp, cp, sp), the rank's total ==
      pp_comm_per_iteration (pp = 2: every rank is an end of the pipeline);
    * TP: the traffic added by the extra layers == extra layers x micro-batches x tp_comm_per_layer
      (forward and backward each). Not in any formula, and checked to be exactly this: the SP
      LayerNorm/bias gradient all-reduce (6h per layer + 2h final LayerNorm) and the tied
      word-embedding gradient all-reduce between first and last stage (V h / t elements per rank).
    """
    V = GPT.padded_vocab_size
    lines = [f"[sizing vs measured] course_lib.train, 1 iteration, 8 ranks, h={H} s={STEP_S} b={STEP_MBS} V={V}:"]
    argvs = [_step_argv(flags, L) for flags, *_ in STEP_RUNS.values() for L in STEP_LAYERS]
    launched = launch(_step_ranks, world_size=8, output="none", timeout=240, argvs=argvs)
    for i, (name, (flags, tp, pp, cp, sp)) in enumerate(STEP_RUNS.items()):
        runs = {L: [ranks[i * len(STEP_LAYERS) + j] for ranks in launched] for j, L in enumerate(STEP_LAYERS)}
        per_layer = sizing.tp_comm_per_layer(STEP_S, STEP_MBS, H, tp, sequence_parallel=sp, cp=cp)
        cp_layer = sizing.cp_comm_per_layer(STEP_S, STEP_MBS, H, HEADS, cp, tp=tp)
        x = sizing.pp_send_elements(STEP_S, STEP_MBS, H, tp=tp, cp=cp, sequence_parallel=sp)
        for L, ranks in runs.items():
            for res in ranks:
                c, m, dp = res["coords"], res["m"], res["dp"]
                last = c["pp"] == pp - 1
                rec = summarize(res["events"])
                n = sizing.parameters_per_stage(L, H, V, STEP_S, HEADS, tp=tp, pp=pp)[c["pp"]] + 2 * H * last
                assert res["num_parameters"] == n, (name, L, c)
                assert dp_volume(rec.filter(source="finish_grad_sync"))["total"] == \
                    sizing.dp_comm_per_iteration(n, dp, cp=cp)["total"]
                layers_here = L // pp
                if cp > 1:
                    vol = cp_layer_volume(rec.filter(kind="cp", direction="fwd"),
                                          rec.filter(kind="cp", direction="bwd"))
                    assert vol["forward"] == layers_here * m * cp_layer["forward"]
                    assert vol["backward"] == layers_here * m * cp_layer["backward_estimate"]
                f = sizing.pp_comm_per_iteration(STEP_S, STEP_MBS, H, pp, m, tp=tp, cp=cp, sequence_parallel=sp)
                assert set(res["wire"]) == {x} and sum(res["wire"]) == f["total"], (name, L, c, res["wire"])
                if last:
                    assert sum(res["wire"]) == f["backward"] and f["forward"] == 0
                assert sum(e.numel for e in rec.filter(kind="pp", op="send")) == sum(res["wire"])  # trainer's record
                # not in the formulas, exactly:
                sp_grads = rec.filter(source="allreduce_sequence_parallel_grads")
                assert summarize(sp_grads).ring_elements_sent() == (
                    ring_elements_sent("all_reduce", 6 * H * layers_here + 2 * H * last, tp) if sp else 0)
                emb = rec.filter(source="allreduce_embedding_grads")
                assert summarize(emb).ring_elements_sent() == ring_elements_sent("all_reduce", V * H // tp, 2)
        # TP, per rank: what two more layers per stage add
        extra_layers = (STEP_LAYERS[1] - STEP_LAYERS[0]) // pp
        for small, big in zip(runs[STEP_LAYERS[0]], runs[STEP_LAYERS[1]]):
            m = big["m"]
            assert _tp_sent(big, "fwd") - _tp_sent(small, "fwd") == extra_layers * m * per_layer["forward"]
            assert _tp_sent(big, "bwd") - _tp_sent(small, "bwd") == extra_layers * m * (
                per_layer["backward"] + per_layer["sp_backward_all_gather"])
        deep = runs[STEP_LAYERS[1]]
        layers_part = STEP_LAYERS[1] // pp * deep[0]["m"] * per_layer["total"]
        outside = [_tp_sent(r, "fwd") + _tp_sent(r, "bwd") - layers_part for r in (deep[0], deep[-1])]
        grad_sync = dp_volume(summarize(deep[0]["events"]).filter(source="finish_grad_sync"))["total"]
        lines.append(f"  {name}: m={deep[0]['m']}, per rank: TP {per_layer['total']:.0f}/layer/micro-batch (+ "
                     f"{outside[0]:.0f} first / {outside[1]:.0f} last stage outside the layers), CP "
                     f"{cp_layer['total_estimate'] if cp > 1 else 0}/layer/micro-batch, PP {x}/send, DP grads "
                     f"{grad_sync:.0f} (first stage, l={STEP_LAYERS[1]}), tied-embedding grads {V * H // tp}; "
                     f"lm loss {deep[-1]['loss']:.4f}")
    _report(capsys, lines)
