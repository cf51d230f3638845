"""Megatron-FSDP's sharding strategies (ZeRO-1/2/3), optimizer offload and PyTorch's FSDP2, on 4 real ranks.

One fork launch of 4 gloo ranks trains the MLP of tests/sharding_cases.py with
``--data-parallel-sharding-strategy`` no_shard / optim / optim_grads / optim_grads_params, with and
without ``--optimizer-cpu-offload``, in fp32 and bf16, and with ``torch.distributed.fsdp.fully_shard``
(FSDP2) on a CPU gloo DeviceMesh. Checked:

* every fp32 strategy (also with 2 accumulated micro-batches, and ZeRO-3 with both forwards before
  both backwards, a pipeline's order) gives the single-process loss within
  1e-4 relative at every iteration, its grad norm and the same final params; bf16 ZeRO-2/3 equal a
  single-process bf16 run within 1e-3;
* measured bytes per rank of params, grads and optimizer state equal ZeRO's ``model_state_bytes`` by
  stage (fp32: 4 + 4 + 8; bf16 with fp32 grads: 2 + 4 + 12; Megatron-FSDP pads a bucket to a multiple of
  d only, which this MLP needs not), offload's host bytes (16 per parameter over d: fp32 main params,
  moments and grads) and bytes moved equal ``optimizer_offload_bytes_per_param``;
* ZeRO-3's communication per step (CommRecorder) is ``dp_comm_per_iteration(zero_stage=3)``, 1.5x
  the all-reduce's: per unit an all-gather before forward, another before backward and a
  reduce-scatter of grads; the next unit's all-gather is issued before its forward starts (prefetch);
* FSDP2 trains to the same losses as our ZeRO-3 and holds the same param and optimizer bytes per rank;
* skipping ZeRO-3's grad reduce-scatter moves the loss;
* a root unit that runs first in backward (a pipeline's last stage) is never gathered again after its
  backward: the next step's forward sees updated params (= one process), one gather per unit per
  pass; after a ZeRO-3 forward autograd holds the activations only (released units are freed), and
  ``course_lib.saved_tensors`` counts the saved weights as parameters, not activations;
* the course GPT (tied embeddings) under ZeRO-3 equals one process, with the formula's bytes.
"""

import pytest
import torch

import sharding_cases as C
from course_lib.comm import summarize
from course_lib.launch import launch
from course_lib.sizing.comm import dp_comm_per_iteration
from course_lib.sizing.memory import model_state_bytes, optimizer_offload_bytes_per_param

WORLD = 4
STAGES = {"ddp": 0, "z1": 1, "z2": 2, "z3": 3}


def _fsdp2(rank: int) -> dict:
    """The MLP under FSDP2: each Linear / LayerNorm and the root ``fully_shard``-ed, AdamW with
    Megatron's no-decay rule for biases and 1-D params (what course_lib.optimizer.Optimizer does)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (WORLD,))
    model = C.make_model()
    for m in (model.fc1, model.norm, model.fc2, model.fc3):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    groups = [{"params": [p for p in model.parameters() if p.dim() > 1], "weight_decay": 0.01},
              {"params": [p for p in model.parameters() if p.dim() <= 1], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=C.LR, eps=1e-8)
    rows, losses = C.GLOBAL_BATCH // WORLD, []
    for it in range(C.ITERS):
        x, y = C.batch(it)
        opt.zero_grad()
        loss = C.loss_fn(model(x[rank * rows:(rank + 1) * rows]), y[rank * rows:(rank + 1) * rows])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    return dict(losses=losses,
                params=sum(local(p).numel() * p.element_size() for p in model.parameters()),
                optimizer=sum(local(t).numel() * t.element_size() for st in opt.state.values()
                              for t in st.values() if t.dim() > 0))


def _saved_bytes(model_call, model) -> dict:
    """One forward of 4 rows: ``activation_bytes`` autograd keeps (course_lib.saved_tensors) and
    ``held_bytes``, the bytes of every distinct storage it holds once the forward is over."""
    from course_lib.saved_tensors import SavedTensorRecorder, activation_bytes
    with SavedTensorRecorder(model) as rec:
        model_call(C.batch(0)[0][:4])
    kept = []   # the same forward again, keeping what autograd saves (hooks do not nest: not inside rec)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        model_call(C.batch(0)[0][:4])
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in kept}
    return dict(activation_bytes=activation_bytes(rec.records), held_bytes=sum(storages.values()))


def _run_on_ranks():
    import torch.distributed as dist
    from helpers import rank_groups
    dp4 = rank_groups("dp")["dp"]
    r = dist.get_rank(dp4)
    b = dict(bucket_size=600)
    runs = {
        "ddp": dict(strategy="no_shard", **b),
        # Megatron-FSDP's optim: its buffer layout (a multiple of d), not the distributed optimizer's
        "z1": dict(strategy="optim", overlap_grad_reduce=True, overlap_param_gather=True, megatron_fsdp=True, **b),
        "z2": dict(strategy="optim_grads", overlap_grad_reduce=True, **b),
        "z3": dict(strategy="optim_grads_params", overlap_grad_reduce=True),
        "z3_sync": dict(strategy="optim_grads_params", probe=_saved_bytes),
        "z3_accumulated": dict(strategy="optim_grads_params", overlap_grad_reduce=True, micro_batches=2),
        "z3_pipelined": dict(strategy="optim_grads_params", overlap_grad_reduce=True, micro_batches=2,
                             forwards_first=True),
        "z1_offload": dict(strategy="optim", cpu_offload=True, megatron_fsdp=True, **b),
        "z3_offload": dict(strategy="optim_grads_params", cpu_offload=True),
        "bf16_z2": dict(strategy="optim_grads", dtype=torch.bfloat16, overlap_grad_reduce=True, **b),
        "bf16_z3": dict(strategy="optim_grads_params", dtype=torch.bfloat16, overlap_grad_reduce=True),
        "z3_broken": dict(strategy="optim_grads_params", break_with=C.skip_grad_reduce),
        # the root unit (the head) runs first in backward, like a pipeline's last stage
        "z3_root_last": dict(strategy="optim_grads_params", overlap_grad_reduce=True, model=C.make_head_last(),
                             fsdp_unit_modules=(C.Block,)),
        "z3_root_last_pipelined": dict(strategy="optim_grads_params", overlap_grad_reduce=True, micro_batches=2,
                                       forwards_first=True, model=C.make_head_last(), fsdp_unit_modules=(C.Block,)),
    }
    out = {name: C.run(dp4, r, WORLD, **kw) for name, kw in runs.items()}
    out["gpt_z3"] = C.run_gpt(dp4, r, WORLD, strategy="optim_grads_params", overlap_grad_reduce=True)
    out["fsdp2"] = _fsdp2(dist.get_rank())
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def runs():
    # FSDP2 imports DTensor and dynamo on first use: pay that once here, not in each forked rank
    import torch._dynamo  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    return launch(_run_on_ranks, world_size=WORLD, backend="gloo", timeout=120, output="none")


@pytest.fixture(scope="module")
def refs():
    return {"fp32": C.reference(), "bf16": C.reference(torch.bfloat16),
            "head_last": C.reference(factory=C.make_head_last)}


@pytest.mark.parametrize("name", ["ddp", "z1", "z2", "z3", "z3_sync", "z1_offload", "z3_offload", "z3_accumulated",
                                  "z3_pipelined"])
def test_fp32_strategies_equal_one_process(runs, refs, name):
    ref_losses, ref_params, ref_norms, _ = refs["fp32"]
    got = C.global_losses([r[name] for r in runs])
    assert max(C.rel(a, b) for a, b in zip(got, ref_losses)) < 1e-4, (got, ref_losses)
    for r in runs:
        assert max(C.rel(a, b) for a, b in zip(r[name]["grad_norms"], ref_norms)) < 1e-5
        for n, p in ref_params.items():
            torch.testing.assert_close(r[name]["params"][n], p, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["bf16_z2", "bf16_z3"])
def test_bf16_strategies_equal_one_process_bf16(runs, refs, name):
    got = C.global_losses([r[name] for r in runs])
    assert max(C.rel(a, b) for a, b in zip(got, refs["bf16"][0])) < 1e-3
    assert {p.dtype for p in runs[0][name]["params"].values()} == {torch.bfloat16}


@pytest.mark.parametrize("name,stage,param_bytes,grad_bytes,k", [
    ("ddp", 0, 4, 4, 8), ("z1", 1, 4, 4, 8), ("z2", 2, 4, 4, 8), ("z3", 3, 4, 4, 8),
    ("bf16_z2", 2, 2, 4, 12), ("bf16_z3", 3, 2, 4, 12)])
def test_bytes_per_rank_equal_zero_formula(runs, name, stage, param_bytes, grad_bytes, k):
    want = model_state_bytes(C.NUM_PARAMS, WORLD, stage, k=k, param_bytes=param_bytes, grad_bytes=grad_bytes)
    for r in runs:
        got = r[name]["bytes"]
        assert (got["params"], got["grads"], got["optimizer"]) == (want.weights, want.grads, want.optimizer)
        assert got["padding_elements"] == 0 and got["optimizer_host"] == 0


@pytest.mark.parametrize("name,stage", [("z1_offload", 1), ("z3_offload", 3)])
def test_offload_keeps_optimizer_on_host(runs, name, stage):
    per_param = optimizer_offload_bytes_per_param(WORLD, True, "fp32", "fp32")
    device = model_state_bytes(C.NUM_PARAMS, WORLD, stage, k=8, param_bytes=4, grad_bytes=4)
    for r in runs:
        got = r[name]["bytes"]
        assert got["optimizer"] == per_param["device_optimizer"] == 0
        assert got["optimizer_host"] == per_param["host"] * C.NUM_PARAMS
        assert (got["moved_d2h"], got["moved_h2d"]) == (per_param["d2h"] * C.NUM_PARAMS,
                                                        per_param["h2d"] * C.NUM_PARAMS)
        assert (got["params"], got["grads"]) == (device.weights, device.grads)


def test_zero3_comm_is_one_and_a_half_all_reduces(runs):
    units = 4  # fc1, norm, fc2, fc3
    for name in ("z3", "z3_sync", "bf16_z3"):
        for r in runs:
            rec = summarize(r[name]["events"])
            assert rec.count(op="all_gather", direction="fwd") == units
            assert rec.count(op="all_gather", direction="bwd") == units
            # overlapped: issued in backward; otherwise when step() finishes the sync
            assert rec.count(op="reduce_scatter", direction="bwd" if name != "z3_sync" else "fwd") == units
            assert rec.count() == 3 * units
            want = dp_comm_per_iteration(C.NUM_PARAMS, WORLD, zero_stage=3)["total"]
            assert rec.ring_elements_sent() == pytest.approx(want, rel=1e-12)
            ddp = summarize(r["ddp"]["events"]).ring_elements_sent()
            assert rec.ring_elements_sent() == pytest.approx(1.5 * ddp, rel=1e-12)


def test_zero3_prefetches_the_next_unit(runs):
    for r in runs:
        tl = r["z3"]["timeline"]
        forwards = [e for e in tl if e["kind"] == "forward"]
        gathers = [e for e in tl if e["kind"] == "all_gather"]
        assert [e["name"] for e in forwards] == ["fc1", "norm", "fc2", "fc3"]
        # forward: unit i+1's gather is issued while unit i runs, before unit i+1's forward starts
        for nxt, fwd in zip(gathers[1:4], forwards[1:]):
            assert nxt["start"] < fwd["start"]
        reduces = [e for e in tl if e["kind"] == "reduce_scatter"]
        backward_end = max(e["end"] for e in tl if e["kind"] == "backward")
        assert min(e["start"] for e in reduces) < backward_end  # overlap_grad_reduce


@pytest.mark.parametrize("name,micro_batches", [("z3_root_last", 1), ("z3_root_last_pipelined", 2)])
def test_zero3_never_regathers_a_unit_whose_backward_is_over(runs, refs, name, micro_batches):
    """The root unit (the head) runs first in backward; a backward prefetch of it after that would
    be left gathered into step(), hold pre-update values and feed them to the next forward."""
    ref_losses, ref_params, ref_norms, _ = refs["head_last"]
    got = C.global_losses([r[name] for r in runs])
    assert max(C.rel(a, b) for a, b in zip(got, ref_losses)) < 1e-5, (got, ref_losses)
    units = 3  # root (head), blocks.0, blocks.1
    for r in runs:
        assert max(C.rel(a, b) for a, b in zip(r[name]["grad_norms"], ref_norms)) < 1e-5
        for n, p in ref_params.items():
            torch.testing.assert_close(r[name]["params"][n], p, rtol=1e-5, atol=1e-6)
        # per micro-batch one gather per unit for its forward and one for its backward, no more
        gathers = summarize(r[name]["events"]).count(op="all_gather")
        assert gathers == 2 * units * micro_batches, gathers


def test_zero3_frees_the_weights_saved_for_backward(runs):
    """A weight a GEMM saves is a parameter when it is saved, though ZeRO-3 releases it right after;
    and released means freed: after the forward autograd holds the activations and no gathered unit
    (one process holds its weights too, whose storages it saved)."""
    model = C.make_model()
    one = _saved_bytes(model, model)
    weights = sum(p.numel() * 4 for p in model.parameters())
    assert one["held_bytes"] > one["activation_bytes"] and one["held_bytes"] <= one["activation_bytes"] + weights
    for r in runs:
        assert r["z3_sync"]["probe"]["activation_bytes"] == one["activation_bytes"]
        assert r["z3_sync"]["probe"]["held_bytes"] == one["activation_bytes"]


def test_saved_tensors_decide_parameter_at_save_time():
    """One process: each Linear's weight is swapped for an empty tensor right after its forward (a
    ZeRO-3 release that does not free): the recorder still counts the saved weights as parameters."""
    from course_lib.saved_tensors import SavedTensorRecorder, activation_bytes

    def record(release: bool) -> int:
        model = C.make_model()
        handles = [m.register_forward_hook(lambda mod, args, out: setattr(mod.weight, "data", torch.empty(0)))
                   for m in (model.fc1, model.fc2, model.fc3)] if release else []
        with SavedTensorRecorder(model) as rec:
            model(C.batch(0)[0][:4])
        for h in handles:
            h.remove()
        return activation_bytes(rec.records)
    assert record(release=True) == record(release=False)


def test_fsdp2_matches_our_zero3(runs):
    ours = C.global_losses([r["z3"] for r in runs])
    theirs = C.global_losses([r["fsdp2"] for r in runs])
    assert max(C.rel(a, b) for a, b in zip(ours, theirs)) < 1e-5, (ours, theirs)
    for r in runs:
        assert r["fsdp2"]["params"] == r["z3"]["bytes"]["params"]
        assert r["fsdp2"]["optimizer"] == r["z3"]["bytes"]["optimizer"]


def test_skipping_zero3_grad_reduce_moves_the_loss(runs, refs):
    got = C.global_losses([r["z3_broken"] for r in runs])
    assert C.rel(got[0], refs["fp32"][0][0]) < 1e-6
    assert max(C.rel(a, b) for a, b in zip(got[1:], refs["fp32"][0][1:])) > 1e-3


def test_course_gpt_under_zero3(runs):
    """The course GPT (tied embeddings; units: its transformer layers + the root) trains like one process."""
    ref, num_params = C.gpt_reference()
    got = C.global_losses([r["gpt_z3"] for r in runs])
    assert max(C.rel(a, b) for a, b in zip(got, ref)) < 1e-4, (got, ref)
    r0 = runs[0]["gpt_z3"]
    assert r0["units"] == ["", "decoder.layers.0", "decoder.layers.1"]
    want = model_state_bytes(num_params, WORLD, 3, k=8, param_bytes=4, grad_bytes=4)
    got = r0["bytes"]
    assert (got["params"], got["grads"], got["optimizer"]) == (want.weights, want.grads, want.optimizer)


def test_formula_extensions_keep_the_paper_and_refuse_bad_bytes():
    """model_state_bytes' default is still ZeRO's 2 + 2 + K; param/grad bytes must be positive numbers."""
    assert model_state_bytes(7.5e9, 64, 0) == model_state_bytes(7.5e9, 64, 0, param_bytes=2, grad_bytes=2)
    assert model_state_bytes(1, 1, 0, k=8, param_bytes=4, grad_bytes=4).total == 16
    for bad in (0, -2, True, "4"):
        with pytest.raises(ValueError, match="param_bytes"):
            model_state_bytes(1, 1, 0, param_bytes=bad)
    off = optimizer_offload_bytes_per_param(8, False, "bf16", "bf16")
    # not sharded: d ignored; the host's grad copy is fp32 whatever crosses (HybridDeviceOptimizer)
    assert off == {"device_optimizer": 0.0, "host": 16.0, "host_grads": 4.0, "d2h": 2.0, "h2d": 2.0}
