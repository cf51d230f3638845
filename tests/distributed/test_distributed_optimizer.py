"""Megatron's DDP and distributed optimizer (course_lib.distributed) against one process, on 4 real ranks.

One fork launch of 4 gloo ranks trains the MLP of tests/sharding_cases.py in every mode below and
returns losses, final params, bytes per rank, the last step's collectives and its timeline. Checked:

* every fp32 mode (DDP DP4 with bucketed overlapped all-reduce; distributed optimizer DP4 with
  ``overlap_grad_reduce`` + ``overlap_param_gather``, and without; TP2 x DP2 with the TP layers; a
  constant loss scale) gives the single-process loss within 1e-4 relative at every iteration and the
  same final params; bf16 params with fp32 main params/grads (and bf16 grads), and fp16 params with
  the course's ConstantLossScaler, equal a single-process 16-bit run within 1e-3;
* measured bytes per rank equal Megatron's distributed-optimizer table
  (``megatron_optimizer_bytes_per_param``) for fp32/fp32, bf16/fp32 and bf16/bf16, with and without
  the distributed optimizer, on what the rank holds: the distributed optimizer's buckets are padded as
  Megatron pads them (64-element param starts, ``lcm(d, 128)`` bucket ends; the layout itself is
  compared with megatron-core's in test_bucket_layout.py), so the buffers hold N + padding elements;
* measured communication per step (the CommRecorder's events) equals ``dp_comm_per_iteration`` on the
  padded buffers;
* ``finish_grad_sync`` then ``synced_main_grad``: the reduced grad each rank holds (ZeRO-2: its 1/d
  piece), the pieces of the ranks together the averaged grad of one process;
* gradient accumulation over 2 micro-batches (all but the last under ``no_sync``) equals one
  process and communicates once per step;
* the grad norm from the shards (and ``clip_grad``) equals one process's;
* the timeline: with ``overlap_grad_reduce`` the first bucket's reduce-scatter starts before backward
  ends; without it every collective starts after backward;
* breaking one piece moves the loss: skipping the param all-gather, skipping the grad reduce-scatter
  (while a missing 1/d is invisible to Adam, checked too); a loss scaler's overflow on one rank skips
  the step on every rank.
"""

import pytest
import torch

import sharding_cases as C
from course_lib.comm import summarize
from course_lib.distributed import overlap_seconds, plot_timeline
from course_lib.launch import launch
from course_lib.mixed_precision import ConstantLossScaler
from course_lib.sizing.comm import dp_comm_per_iteration
from course_lib.sizing.memory import megatron_optimizer_bytes_per_param

WORLD = 4
CLIP = 0.3  # below every iteration's grad norm, so clipping acts


class ConstantScaler:
    """The loss-scaler protocol (float scale) with an overflow injected on one rank."""

    def __init__(self, scale=1024.0, overflow_on_rank=None):
        self.scale, self.overflow_on_rank, self.updates = scale, overflow_on_rank, []

    def unscale_and_check(self, grads):
        import torch.distributed as dist
        for g in grads:
            g.div_(self.scale)
        return dist.get_rank() == self.overflow_on_rank or any(not torch.isfinite(g).all() for g in grads)

    def update(self, found_inf):
        self.updates.append(bool(found_inf))


def _skip_param_gather(ddp):
    ddp._launch_gather = lambda b, async_op: None


def _no_grad_scaling(ddp):
    ddp.gradient_scaling_factor = 1.0  # grads summed over the ranks instead of averaged


def _norm_events(ddp, model):
    """The last step's grad-norm all-reduces as the engine recorded them: ``[(op, kind, group size)]``."""
    return [(e.op, e.kind, e.group_size) for e in ddp.comm.events if e.source == "get_grad_norm_fp32"]


def _main_grads(ddp, model):
    """The last step's main grads (averaged over dp), or main_grad's refusal (ZeRO-2/3)."""
    try:
        return {n: ddp.main_grad(p).clone() for n, p in model.named_parameters()}
    except ValueError as e:
        return str(e)


def _synced_main_grads(ddp, model):
    """One more backward (iteration 1's batch, this rank's rows), ``finish_grad_sync`` (twice: the second
    must send nothing), then each parameter's part of the reduced grad on this rank: ``{name: (start,
    values)}``, start the piece's offset in the flattened parameter."""
    rows = C.GLOBAL_BATCH // ddp.dp
    x, y = C.batch(1)
    ddp.zero_grad()
    C.loss_fn(ddp(x[ddp.dp_rank * rows:(ddp.dp_rank + 1) * rows]), y[ddp.dp_rank * rows:(ddp.dp_rank + 1) * rows]).backward()
    ddp.finish_grad_sync()
    sent = len(ddp.comm.events)
    ddp.finish_grad_sync()
    out = {}
    for name, p in model.named_parameters():
        b, pr = ddp._where[id(p)]
        out[name] = (max(b.state.lo - pr.start, 0), ddp.synced_main_grad(p).clone())
    return {"pieces": out, "second_call_sent": len(ddp.comm.events) - sent}


BAD_INPUTS = [  # (kwargs of wrap, the flag the message must name)
    (dict(strategy="zero3"), "--data-parallel-sharding-strategy"),
    (dict(strategy="no_shard", overlap_param_gather=True, overlap_grad_reduce=True), "--use-distributed-optimizer"),
    (dict(strategy="optim", overlap_param_gather=True), "--overlap-grad-reduce"),
    (dict(bucket_size=0), "--ddp-bucket-size"),
    (dict(bucket_size=1.5), "--ddp-bucket-size"),
    (dict(use_distributed_optimizer=True, strategy="no_shard"), "--use-distributed-optimizer"),
]


def _bad_inputs(group) -> list:
    from course_lib.distributed import wrap
    messages = []
    for kwargs, _ in BAD_INPUTS:
        try:
            wrap(C.make_model(), group, **kwargs)
            messages.append(None)
        except ValueError as e:
            messages.append(str(e))
    mixed = C.make_model()
    mixed.fc3.to(torch.bfloat16)
    try:
        wrap(mixed, group)
        messages.append(None)
    except ValueError as e:
        messages.append(str(e))
    return messages


def _run_on_ranks():
    import torch.distributed as dist
    from helpers import rank_groups

    from course_lib.process_groups import new_process_groups
    from course_lib.topology import RankGrid
    dp4 = rank_groups("dp")["dp"]
    r = dist.get_rank(dp4)
    common = dict(bucket_size=600)
    runs = {
        "ddp": dict(strategy="no_shard", overlap_grad_reduce=True, probe=_main_grads, **common),
        "distopt": dict(strategy="optim", overlap_grad_reduce=True, overlap_param_gather=True, **common),
        "distopt_sync": dict(use_distributed_optimizer=True, **common),  # = strategy "optim"
        "zero2_main_grad": dict(strategy="optim_grads", iters=1, probe=_main_grads),
        "zero2_synced": dict(strategy="optim_grads", iters=1, probe=_synced_main_grads),
        "accumulated": dict(strategy="optim", overlap_grad_reduce=True, overlap_param_gather=True, micro_batches=2,
                            **common),
        "clipped": dict(strategy="optim", optimizer="sgd", clip_grad=CLIP, probe=_norm_events,
                        grad_norm=False, **common),  # SGD: Adam hides a scale; clipping alone asks for the norm
        "no_norm": dict(strategy="optim", grad_norm=False, probe=_norm_events, **common),
        "scaled": dict(strategy="optim", loss_scaler=ConstantScaler(), **common),
        # SGD, not Adam: Adam would not notice grads left scaled by 4096 (m / sqrt(v) cancels it)
        "scaled_course": dict(strategy="optim", optimizer="sgd", loss_scaler=ConstantLossScaler(2.0 ** 12), **common),
        "bf16": dict(strategy="optim", dtype=torch.bfloat16, overlap_grad_reduce=True, **common),
        "fp16": dict(strategy="optim", dtype=torch.float16, loss_scaler=ConstantLossScaler(2.0 ** 10), **common),
        "bf16_ddp": dict(strategy="no_shard", dtype=torch.bfloat16, **common),
        "bf16_grads16": dict(strategy="optim", dtype=torch.bfloat16, grad_reduce_in_fp32=False, **common),
        "broken_gather": dict(strategy="optim", break_with=_skip_param_gather, **common),
        "broken_scaling": dict(strategy="optim", break_with=_no_grad_scaling, **common),
        "broken_reduce": dict(strategy="optim", break_with=C.skip_grad_reduce, **common),
    }
    out = {name: C.run(dp4, r, WORLD, **kw) for name, kw in runs.items()}
    scaler = ConstantScaler(overflow_on_rank=2)
    out["overflow"] = C.run(dp4, r, WORLD, iters=1, strategy="optim", loss_scaler=scaler, **common)
    out["overflow"]["updates"] = scaler.updates
    out["errors"] = _bad_inputs(dp4)
    # TP2 x DP2 with the course's ProcessGroups: grads over dp_cp, the grad norm over dp_cp then tp-pp
    pg = new_process_groups(RankGrid(WORLD, tp=2), timeout=60)
    out["tp2dp2"] = C.run(pg, dist.get_rank(pg.dp_cp), 2, model=C.make_tp_model(pg.tp), tp_group=pg.tp,
                          strategy="optim", overlap_grad_reduce=True, overlap_param_gather=True, bucket_size=300,
                          probe=_norm_events)
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs():
    return launch(_run_on_ranks, world_size=WORLD, backend="gloo", timeout=120, output="none")


@pytest.fixture(scope="module")
def refs():
    return {"fp32": C.reference(), "bf16": C.reference(torch.bfloat16), "dense3": C.reference(factory=C.make_dense3),
            "fp32_sgd": C.reference(optimizer="sgd"), "fp32_clip": C.reference(optimizer="sgd", clip_grad=CLIP),
            "fp16": C.reference(torch.float16)}


def _losses_close(runs, name, ref_losses, rtol):
    got = C.global_losses([r[name] for r in runs])
    errs = [C.rel(a, b) for a, b in zip(got, ref_losses)]
    assert max(errs) < rtol, (name, got, ref_losses)
    return max(errs)


@pytest.mark.parametrize("name,ref", [("ddp", "fp32"), ("distopt", "fp32"), ("distopt_sync", "fp32"),
                                      ("accumulated", "fp32"),
                                      ("scaled", "fp32"), ("scaled_course", "fp32_sgd"), ("tp2dp2", "dense3"),
                                      ("clipped", "fp32_clip")])
def test_fp32_modes_equal_one_process(runs, refs, name, ref):
    ref_losses, ref_params, ref_norms, _ = refs[ref]
    _losses_close(runs, name, ref_losses, 1e-4)
    for r in runs:  # every rank sees the whole model's grad norm and ends with the single-process params
        assert max(C.rel(a, b) for a, b in zip(r[name]["grad_norms"], ref_norms)) < 1e-5
        assert r[name]["params"].keys() == ref_params.keys()
        for n, p in ref_params.items():
            torch.testing.assert_close(r[name]["params"][n], p, rtol=1e-5, atol=1e-6)


def test_clipping_acts(refs):
    """The clipped reference is not the unclipped one: the 'clipped' row above can fail."""
    assert min(refs["fp32_sgd"].grad_norms) > CLIP
    clip, plain = refs["fp32_clip"].params, refs["fp32_sgd"].params
    assert max((clip[n] - plain[n]).abs().max().item() for n in plain) > 1e-3


@pytest.mark.parametrize("name,ref", [("bf16", "bf16"), ("bf16_ddp", "bf16"), ("bf16_grads16", "bf16"),
                                      ("fp16", "fp16")])
def test_16_bit_modes_equal_one_process_16_bit(runs, refs, name, ref):
    ref_losses, ref_params, _, _ = refs[ref]
    _losses_close(runs, name, ref_losses, 1e-3)
    # bf16 params: 16-bit compute rounds differently on a quarter of the batch, and Adam turns a
    # near-zero grad's rounding into a step of up to lr; so: 99% of the elements within 2 bf16 ulps,
    # none further than lr per step.
    got = torch.cat([runs[0][name]["params"][n].float().flatten() for n in ref_params])
    want = torch.cat([p.flatten() for p in ref_params.values()])
    assert {p.dtype for p in runs[0][name]["params"].values()} == {refs[ref].dtype}
    diff = (got - want).abs()
    assert (diff > 2 ** -7 * want.abs() + 1e-3).float().mean() < 0.01
    assert diff.max() <= C.ITERS * C.LR


@pytest.mark.parametrize("name,distributed,params_dtype,grad_dtype", [
    ("ddp", False, "fp32", "fp32"), ("distopt", True, "fp32", "fp32"), ("bf16_ddp", False, "bf16", "fp32"),
    ("bf16", True, "bf16", "fp32"), ("bf16_grads16", True, "bf16", "bf16")])
def test_bytes_per_rank_equal_megatron_table(runs, name, distributed, params_dtype, grad_dtype):
    """Megatron's bytes per parameter on what each rank holds: the param and grad buffers are the padded
    buckets (N + padding elements: the distributed optimizer's 64-element starts and lcm(d, 128) ends; DDP
    pads nothing); the optimizer keeps Adam's moments (8 B) for the elements it steps and its fp32 copies
    (main params of 16-bit params, main grads of 16-bit grads: the table's other optimizer bytes) over its
    contiguous shard. Every parameter element is stepped by one rank; without padding this is the table
    times N exactly."""
    per = megatron_optimizer_bytes_per_param(1, False, params_dtype, grad_dtype)
    copies = per.optimizer - 8
    pad = runs[0][name]["bytes"]["padding_elements"]
    assert (pad > 0) == distributed
    for r in runs:
        got = r[name]["bytes"]
        assert got["params"] == per.weights * (C.NUM_PARAMS + pad)
        assert got["grads"] == per.grads * (C.NUM_PARAMS + pad)
        assert got["shard_elements"] == (C.NUM_PARAMS + pad) // (WORLD if distributed else 1)
        assert got["optimizer"] == 8 * got["shard_param_elements"] + copies * got["shard_elements"]
    assert sum(r[name]["bytes"]["shard_param_elements"] for r in runs) == C.NUM_PARAMS * (1 if distributed else WORLD)
    if not distributed:
        assert runs[0][name]["bytes"]["optimizer"] == per.optimizer * C.NUM_PARAMS


@pytest.mark.parametrize("name,ops", [("ddp", {"all_reduce"}), ("distopt", {"reduce_scatter", "all_gather"}),
                                      ("bf16", {"reduce_scatter", "all_gather"}),
                                      ("accumulated", {"reduce_scatter", "all_gather"})])  # once per step
def test_comm_per_step_equals_formula(runs, name, ops):
    for r in runs:
        rec = summarize(r[name]["events"])
        assert {e.op for e in rec.events} == ops
        assert rec.count() == 2 * len(ops)  # two buckets of 600+ elements
        padded = C.NUM_PARAMS + r[name]["bytes"]["padding_elements"]   # the collectives carry the padding
        want = dp_comm_per_iteration(padded, WORLD, zero_stage=1 if "all_gather" in ops else 0)["total"]
        assert rec.ring_elements_sent() == pytest.approx(want, rel=1e-12)
    # bf16 params, fp32 grads: the grads cross the wire in fp32, the params in bf16
    if name == "bf16":
        rec = summarize(runs[0][name]["events"])
        assert rec.bytes(op="reduce_scatter") == 4 * padded
        assert rec.bytes(op="all_gather") == 2 * padded


def test_tp2dp2_reduces_over_dp_only(runs):
    rec = summarize(runs[0]["tp2dp2"]["events"])
    assert {e.group_size for e in rec.events} == {2}
    # this rank's params: fc1 (column) and fc2's weight (row) halved by TP, fc2's bias and fc3 whole
    local = (C.IN * C.HID + C.HID) // 2 + C.HID * C.HID // 2 + C.HID + C.HID * C.OUT + C.OUT
    padded = local + runs[0]["tp2dp2"]["bytes"]["padding_elements"]
    assert rec.ring_elements_sent() == pytest.approx(dp_comm_per_iteration(padded, 2, zero_stage=1)["total"])


def test_grad_norm_is_computed_once_when_asked_and_recorded(runs):
    """step() computes the norm only for clipping or when asked (a trainer computing its own norm
    pays no second one), through recorded all-reduces: over dp (sharded), then over the model group."""
    for r in runs:
        assert r["no_norm"]["grad_norms"] == [None] * C.ITERS and r["no_norm"]["probe"] == []
        assert r["clipped"]["probe"] == [("all_reduce", "dp", WORLD)]
        assert r["tp2dp2"]["probe"] == [("all_reduce", "dp", 2), ("all_reduce", "tp-pp", 2)]


def _spans(timeline, kind):
    return [e for e in timeline if e["kind"] == kind]


def test_overlap_grad_reduce_starts_in_backward(runs):
    for r in runs:
        tl = r["distopt"]["timeline"]
        backward_end = max(e["end"] for e in _spans(tl, "backward"))
        first = min(e["start"] for e in _spans(tl, "reduce_scatter"))
        assert first < backward_end  # the first bucket's reduce-scatter ran while backward went on
        assert all(e["end"] is not None and e["end"] >= e["start"] for e in tl)
        tl = r["distopt_sync"]["timeline"]
        backward_end = max(e["end"] for e in _spans(tl, "backward"))
        assert min(e["start"] for e in _spans(tl, "reduce_scatter")) >= backward_end
        ag = _spans(r["distopt"]["timeline"], "all_gather")
        opt = _spans(r["distopt"]["timeline"], "optimizer")[0]
        assert len(ag) == 2 and all(e["start"] >= opt["end"] for e in ag)


def test_breaking_a_piece_moves_the_loss(runs, refs):
    ref_losses = refs["fp32"].losses
    for name in ("broken_gather", "broken_reduce"):
        got = C.global_losses([r[name] for r in runs])
        assert C.rel(got[0], ref_losses[0]) < 1e-6  # the first forward is before any update
        assert max(C.rel(a, b) for a, b in zip(got[1:], ref_losses[1:])) > 1e-3, name


def test_adam_does_not_see_a_missing_one_over_d(runs, refs):
    """Summing instead of averaging the grads scales them by d: Adam's m / sqrt(v) cancels the
    factor (up to eps), so the loss does not move -- SGD's would. A fact worth knowing, not a licence."""
    got = C.global_losses([r["broken_scaling"] for r in runs])
    assert max(C.rel(a, b) for a, b in zip(got, refs["fp32"][0])) < 1e-4


def test_overflow_on_one_rank_skips_the_step_everywhere(runs):
    import sharding_cases
    start = {n: p.detach() for n, p in sharding_cases.make_model().named_parameters()}
    for r in runs:
        assert r["overflow"]["skipped"] and r["overflow"]["updates"] == [True]
        for n, p in start.items():
            assert torch.equal(r["overflow"]["params"][n], p)
    assert all(not r["scaled"]["skipped"] for r in runs)


def test_bad_input_is_one_line_naming_the_flag(runs):
    messages = runs[0]["errors"]
    for (kwargs, flag), msg in zip(BAD_INPUTS, messages):
        assert msg is not None and "\n" not in msg and flag in msg, (kwargs, msg)
    assert messages[-1] is not None and "bf16" in messages[-1] and "\n" not in messages[-1]


def test_overlap_is_measured_and_drawn(runs):
    import matplotlib
    matplotlib.use("Agg")
    for r in runs:
        assert overlap_seconds(r["distopt"]["timeline"]) > 0
        assert overlap_seconds(r["distopt_sync"]["timeline"]) == 0
    ax = plot_timeline([r["distopt"]["timeline"] for r in runs])
    assert len(ax.get_yticks()) == 2 * WORLD
    assert len(ax.patches) == sum(len(r["distopt"]["timeline"]) for r in runs)  # one bar per span


def test_main_grad_is_the_averaged_grad(runs, refs):
    for r in runs:
        grads = r["ddp"]["probe"]
        norm = float(torch.sqrt(sum(g.double().square().sum() for g in grads.values())))
        assert C.rel(norm, refs["fp32"].grad_norms[-1]) < 1e-5
        assert grads["fc1.weight"].shape == (C.HID, C.IN)
        assert "1/d grad shard" in r["zero2_main_grad"]["probe"]


def test_synced_main_grad_is_this_ranks_part_of_the_averaged_grad(runs, refs):
    """ZeRO-2: after finish_grad_sync each rank holds a 1/d piece of every grad: the pieces of the ranks tile
    each parameter once, and together they are one process's averaged grad (its norm at the reference's
    second iteration: the probe's backward ran after one step); a second finish_grad_sync sends nothing."""
    square = 0.0
    for name, p in C.make_model().named_parameters():
        covered = torch.zeros(p.numel(), dtype=torch.int64)
        for r in runs:
            start, values = r["zero2_synced"]["probe"]["pieces"][name]
            covered[start:start + values.numel()] += 1
            square += float(values.double().square().sum())
        assert covered.eq(1).all(), name
    assert C.rel(square ** 0.5, refs["fp32"].grad_norms[1]) < 1e-5
    assert all(r["zero2_synced"]["probe"]["second_call_sent"] == 0 for r in runs)


def test_bucket_size_follows_megatrons_ddp_defaults():
    from course_lib.distributed.buffer import megatron_bucket_size

    # distributed_data_parallel.py: max(40M, 1M x dp) when not given; one bucket without --overlap-grad-reduce
    assert megatron_bucket_size(None, True, 8) == 40_000_000 and megatron_bucket_size(None, True, 64) == 64_000_000
    assert megatron_bucket_size(3000, True, 4) == 3000
    assert megatron_bucket_size(3000, False, 4) is None and megatron_bucket_size(None, False, 4) is None
    assert megatron_bucket_size(3000, True, 4, pp_rank=1) is None   # stages after the first: one bucket
