"""The course trainer on the state-sharding engine (course_lib.distributed): Megatron's sharding flags on real ranks.

One fork launch of 4 gloo ranks runs :func:`course_lib.train.pretrain` in every mode below, each
against :func:`course_lib.train.train_single_process` (one process, the whole global batch, the
trainer's own optimizer -- not the engine). Checked:

* fp32 modes -- DP4 with ``--use-distributed-optimizer`` (+ ``--overlap-grad-reduce
  --overlap-param-gather``, buckets, 2 micro-batches), TP2 x DP2 with the distributed optimizer and
  overlap, TP2+SP x DP2 under ZeRO-2, DP4 ZeRO-2 and ZeRO-3 (``--use-megatron-fsdp
  --data-parallel-sharding-strategy``), ``--optimizer-cpu-offload``, PP2 x DP2 with the distributed
  optimizer and with ZeRO-3 (tied embeddings across stages), CP2 x DP2 (the state sharded over
  dp x cp) -- give the single-process loss within
  1e-4 relative and its grad norm at every iteration; ``--bf16`` with the distributed optimizer
  equals one bf16 process within 1e-3;
* the memory line each run prints carries the engine's measured bytes of params, grads and
  optimizer state per rank, equal to ``course_lib.sizing.memory``'s formulas (ZeRO's by stage for
  fp32, offload's host bytes) on the buffers as Megatron pads them: the distributed optimizer's
  buckets (64-element starts, lcm(d, 128) ends, the tied embedding alone with pp > 1) hold padding,
  Adam's moments only the parameter elements a rank steps; Megatron-FSDP's (a multiple of d) none here;
* ``--fp16`` with dynamic loss scaling through the engine (TP2 x DP2, distributed optimizer and ZeRO-3)
  skips the same overflowing iteration, with the same loss scales and losses, as the trainer without it;
* breaking a piece moves the loss: skipping the tied-embedding sum after the reduction (PP2);
* bad flag combinations fail in one line naming the flag (Megatron's validate_args rules).
"""

import pytest

from course_lib.launch import launch
from course_lib.training.logs import parse_log
from course_lib.sizing.memory import model_state_bytes, optimizer_offload_bytes_per_param
from course_lib.train import parse_args, pretrain, train_single_process, validate_args

WORLD = 4
BASE = ["--uniform-vocab-padding", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "16", "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "3",
        "--log-interval", "1", "--lr", "3e-3", "--lr-decay-style", "constant"]
FSDP = ["--ckpt-format", "fsdp_dtensor", "--use-megatron-fsdp", "--data-parallel-sharding-strategy"]
DISTOPT = ["--use-distributed-optimizer"]
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]
OFFLOAD = ["--optimizer-cpu-offload", "--use-precision-aware-optimizer"]
TP2, PP2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
MODES = {  # name: (extra flags, ZeRO stage, offloaded)
    "dp4_distopt_overlap": (DISTOPT + OVERLAP + ["--ddp-bucket-size", "3000"], 1, False),
    "dp4_distopt": (DISTOPT, 1, False),
    "tp2dp2_distopt_overlap": (TP2 + DISTOPT + OVERLAP + ["--ddp-bucket-size", "2000"], 1, False),
    "tp2sp_dp2_zero2": (TP2 + ["--sequence-parallel"] + FSDP + ["optim_grads", "--overlap-grad-reduce"], 2, False),
    "dp4_zero2": (FSDP + ["optim_grads", "--overlap-grad-reduce"], 2, False),
    "dp4_zero3": (FSDP + ["optim_grads_params", "--overlap-grad-reduce"], 3, False),
    "dp4_offload": (DISTOPT + OFFLOAD, 1, True),
    "cp2dp2_distopt_overlap": (["--context-parallel-size", "2"] + DISTOPT + OVERLAP, 1, False),
    "pp2dp2_distopt": (PP2 + DISTOPT + ["--overlap-grad-reduce"], 1, False),
    "pp2dp2_zero3": (PP2 + FSDP + ["optim_grads_params"], 3, False),
}
BF16 = ["--bf16"] + DISTOPT + ["--overlap-grad-reduce"]
# fp16 with dynamic loss scaling, TP2 x DP2: at 4e5 iterations 1-3 step and iteration 4 overflows (measured)
FP16 = TP2 + ["--fp16", "--initial-loss-scale", "4e5", "--hysteresis", "1", "--train-iters", "4"]


def _skip_embedding_sum(*args):
    return 0


def _on_ranks():
    import io
    from contextlib import redirect_stdout

    import course_lib.train as train

    out = {}
    extra_modes = {"bf16_distopt": BF16, "fp16_plain": FP16, "fp16_distopt": FP16 + DISTOPT + OVERLAP,
                   "fp16_zero3": FP16 + FSDP + ["optim_grads_params"]}
    for name, extra in {**{n: m[0] for n, m in MODES.items()}, **extra_modes}.items():
        buf = io.StringIO()
        with redirect_stdout(buf):
            rec = pretrain(parse_args(BASE + extra), print_args=False, record_comm=False)
        out[name] = {"lm_loss": rec["lm_loss"], "grad_norm": rec["grad_norm"], "log": buf.getvalue(),
                     "state_bytes": rec.get("state_bytes"), "num_parameters": rec["num_parameters"],
                     "skipped": rec["skipped"], "loss_scale": rec["loss_scale"]}
    real, train.allreduce_embedding_grads_after_sync = train.allreduce_embedding_grads_after_sync, _skip_embedding_sum
    try:
        out["broken_embedding"] = {"lm_loss": pretrain(parse_args(BASE + MODES["pp2dp2_distopt"][0]), print_args=False,
                                                       record_comm=False)["lm_loss"]}
    finally:
        train.allreduce_embedding_grads_after_sync = real
    return out


@pytest.fixture(scope="module")
def runs():
    return launch(_on_ranks, world_size=WORLD, output="none", timeout=180)


@pytest.fixture(scope="module")
def refs():
    return {"fp32": train_single_process(parse_args(BASE)), "bf16": train_single_process(parse_args(BASE + ["--bf16"]))}


def _losses(runs, name):
    """The global batch's loss per iteration, from the last rank (the last pipeline stage)."""
    return runs[-1][name]["lm_loss"]


def _rel(got, want):
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


@pytest.mark.parametrize("name", list(MODES))
def test_fp32_modes_equal_one_process(runs, refs, name):
    ref = refs["fp32"]
    assert _rel(_losses(runs, name), ref["lm_loss"]) < 1e-4, (name, _losses(runs, name), ref["lm_loss"])
    for r in runs:  # every rank computes the same norm of the whole model's gradient
        assert r[name]["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-4)


def test_bf16_distributed_optimizer_equals_one_bf16_process(runs, refs):
    assert _rel(_losses(runs, "bf16_distopt"), refs["bf16"]["lm_loss"]) < 1e-3
    assert _rel(refs["bf16"]["lm_loss"], refs["fp32"]["lm_loss"]) > 1e-5  # bf16 did compute in 16 bits


@pytest.mark.parametrize("name", ["fp16_distopt", "fp16_zero3"])
def test_fp16_loss_scaling_skips_the_same_iterations_as_the_trainer_without_the_engine(runs, name):
    """The engine's step with the trainer's loss scaler: unscale, found-inf over the world, skip, back off --
    the same iterations, scales, losses and norms as the trainer's own fp16 path (no engine)."""
    plain = runs[-1]["fp16_plain"]
    assert any(plain["skipped"]) and not all(plain["skipped"])       # an overflow really happened, and steps ran
    for r in runs:
        got = r[name]
        assert got["skipped"] == plain["skipped"] and got["loss_scale"] == plain["loss_scale"]
        taken = [i for i, skipped in enumerate(plain["skipped"]) if not skipped]   # a skipped step's norm is inf
        assert [got["grad_norm"][i] for i in taken] == pytest.approx([plain["grad_norm"][i] for i in taken], rel=1e-6)
    assert runs[-1][name]["lm_loss"] == pytest.approx(plain["lm_loss"], rel=1e-6)


@pytest.mark.parametrize("name", list(MODES))
def test_memory_line_shows_the_sharded_bytes_of_the_formulas(runs, name):
    _, stage, offloaded = MODES[name]
    tp = 2 if "tp2" in name else 1
    d = WORLD // (tp * (2 if "pp2" in name else 1))      # the dp x cp group the state is sharded over
    cp = 2 if "cp2" in name else 1
    printed = 0
    for rank, r in enumerate(runs):
        lines = parse_log(r[name]["log"]).memory
        if not lines:  # only DP rank 0 of each model-parallel position prints
            continue
        printed += 1
        mem, held = lines[0], r[name]["state_bytes"]
        psi, pad = r[name]["num_parameters"], held["padding_elements"]
        assert (pad > 0) == (stage == 1) and held["shard_elements"] * d == psi + pad
        want = model_state_bytes(psi + pad, d, stage, k=8, param_bytes=4, grad_bytes=4)   # the padded buffers
        got = {k: mem[f"{k}_bytes"] for k in ("params", "grads", "optimizer")}
        assert got["params"] == want.weights and got["grads"] == want.grads, (name, rank, got, want)
        stepped = held["shard_param_elements"]     # Adam's moments: 8 bytes per element this rank steps
        assert stepped <= held["shard_elements"] and (pad > 0 or stepped * d == psi)
        if offloaded:                              # + the fp32 main shard and its fp32 grad copy on the host
            host = optimizer_offload_bytes_per_param(d, True, "fp32", "fp32")
            assert got["optimizer"] == 0 and mem["optimizer_on_host_bytes"] == 8 * stepped + 8 * held["shard_elements"]
            assert mem["optimizer_on_host_bytes"] <= host["host"] * (psi + pad)
        else:
            assert got["optimizer"] == 8 * stepped and mem["optimizer_on_host_bytes"] == 0
            assert got["optimizer"] <= want.optimizer
        assert mem["allocated_mb"] == pytest.approx(sum(got.values()) / 2 ** 20, abs=0.006)
        assert got == {k: r[name]["state_bytes"][k] for k in got}
    assert printed == WORLD // (d // cp)                 # ranks with DP rank 0 print


def test_memory_moves_with_the_stage(runs):
    """DP4 on one model: ZeRO-1 < DDP's 16 bytes/param, ZeRO-2 < ZeRO-1, ZeRO-3 < ZeRO-2, offload: 0 on device."""
    held = {n: sum(runs[0][n]["state_bytes"][k] for k in ("params", "grads", "optimizer"))
            for n in ("dp4_distopt", "dp4_zero2", "dp4_zero3", "dp4_offload")}
    psi = runs[0]["dp4_distopt"]["num_parameters"]
    assert 16 * psi > held["dp4_distopt"] > held["dp4_zero2"] > held["dp4_zero3"]
    assert held["dp4_offload"] == 8 * (psi + runs[0]["dp4_offload"]["state_bytes"]["padding_elements"])


def test_skipping_the_embedding_sum_moves_the_loss(runs, refs):
    got, want = _losses(runs, "broken_embedding"), refs["fp32"]["lm_loss"]
    assert abs(got[0] - want[0]) / want[0] < 1e-6  # the first forward is before any update
    assert _rel(got[1:], want[1:]) > 1e-4


@pytest.mark.parametrize("extra,flag", [
    (["--overlap-param-gather", "--overlap-grad-reduce"], "--use-distributed-optimizer"),
    (DISTOPT + ["--overlap-param-gather"], "--overlap-grad-reduce"),
    (DISTOPT + ["--optimizer-cpu-offload"], "--use-precision-aware-optimizer"),
    (DISTOPT + OFFLOAD + ["--optimizer", "sgd"], "--optimizer adam"),
    (FSDP + ["no_shard", "--overlap-grad-reduce", "--overlap-param-gather"], "no_shard"),
    (PP2 + ["--num-layers", "4", "--virtual-pipeline-model-parallel-size", "2"] + DISTOPT,
     "virtual-pipeline-model-parallel-size"),
    (FSDP + ["optim_grads_params", "--pipeline-schedule", "gpipe"], "--pipeline-schedule 1f1b"),
    (DISTOPT + ["--ddp-bucket-size", "0"], "ddp_bucket_size=0"),
])
def test_bad_sharding_flags_fail_in_one_line(extra, flag):
    with pytest.raises(ValueError) as e:
        validate_args(parse_args(BASE + extra), WORLD, check_memory=False)
    assert flag in str(e.value) and "\n" not in str(e.value)


def test_megatron_fsdp_turns_the_distributed_optimizer_on():
    args = validate_args(parse_args(BASE + FSDP + ["optim_grads"]), WORLD, check_memory=False).namespace()
    assert args.use_distributed_optimizer and "Using DistributedOptimizer" in args.sharding_notes[0]


@pytest.mark.parametrize("offload, precision_aware, distopt, optimizer", [
    (True, True, False, "adam"),      # issue 37: megatron-core asserts the distributed optimizer
    (True, True, True, "sgd"),
    (False, False, False, "adam"),
    (False, False, True, "sgd"),
])
def test_optimizer_flags_are_refused_as_megatron_core_refuses_them(offload, precision_aware, distopt, optimizer):
    """The course refuses exactly what megatron-core 0.16.1's own OptimizerConfig refuses, with its reason
    (the cases it judges on CPU: an accepted precision-aware config asks Transformer Engine's version first)."""
    config = pytest.importorskip("megatron.core.optimizer").OptimizerConfig
    try:
        config(optimizer=optimizer, optimizer_cpu_offload=offload, use_precision_aware_optimizer=precision_aware,
               use_distributed_optimizer=distopt)
        megatron = None
    except AssertionError as exc:
        megatron = str(exc)
    flags = (["--optimizer-cpu-offload"] * offload + ["--use-precision-aware-optimizer"] * precision_aware
             + ["--use-distributed-optimizer", "--micro-batch-size", "1"] * distopt + ["--optimizer", optimizer])
    try:
        validate_args(parse_args(BASE + flags), WORLD, check_memory=False)
        ours = None
    except ValueError as exc:
        ours = str(exc)
    assert (ours is None) == (megatron is None), (ours, megatron)
    assert megatron is None or megatron in ours
