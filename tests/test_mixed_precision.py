"""Mixed precision (course_lib.mixed_precision): Megatron's loss scalers, 16-bit compute with fp32 main
params, found-inf agreement across real ranks, and activation bytes of a 16-bit layer vs Korthikanti.

Expected values come from the rules (Megatron's grad_scaler.py behaviour, written out by hand below),
from the fp32 reference run, and from the papers' formulas -- never from the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch

from course_lib import activation_memory as am
from course_lib.launch import launch
from course_lib.mixed_precision import (ConstantLossScaler, DynamicLossScaler, Float16Module, MixedPrecisionOptimizer,
                                        make_loss_scaler, precision_dtype, skipped_iterations_text, to_float16,
                                        unscale_and_check)
from course_lib.model import GPTConfig, GPTModel
from course_lib.sizing import activation_bytes_per_layer, megatron_optimizer_bytes_per_param

TINY = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16)


def _batch(seed=0, b=2):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, TINY.vocab_size, (b, TINY.seq_length + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


# ----------------------------------------------------------------------------- loss scalers

# Hand-worked from Megatron's rules (initial 16, window 3, hysteresis 2, min 2, x2 / x0.5):
# (found_inf, scale after the update, growth counter, hysteresis counter)
HAND_WORKED = [
    (False, 16, 1, 2),
    (False, 16, 2, 2),
    (False, 32, 0, 2),   # 3 good in a row: double, refill hysteresis
    (True, 32, 0, 1),    # first bad one: hysteresis 2 -> 1, no backoff (skipped)
    (False, 32, 1, 1),   # good iterations do NOT refill hysteresis
    (False, 32, 2, 1),
    (True, 16, 0, 0),    # hysteresis reaches 0: back off (skipped)
    (True, 8, 0, -1),    # every further bad one backs off
    (True, 4, 0, -2),
    (False, 4, 1, -2),
    (False, 4, 2, -2),
    (False, 8, 0, 2),    # growth refills hysteresis
    (True, 8, 0, 1),
    (True, 4, 0, 0),
    (True, 2, 0, -1),
    (True, 2, 0, -2),    # min scale 2: 2 * 0.5 = 1 is clamped to 2
    (True, 2, 0, -3),
]


def test_dynamic_scaler_follows_megatrons_rules_step_by_step():
    s = DynamicLossScaler(initial_scale=16, min_scale=2, growth_interval=3, hysteresis=2)
    assert s.value == 16 and s.scale.dtype == torch.float32 and s.scale.shape == (1,)
    for i, (found_inf, scale, growth, hyst) in enumerate(HAND_WORKED):
        s.update(found_inf)
        assert (s.value, s.growth_tracker, s.hysteresis_tracker) == (scale, growth, hyst), f"iteration {i + 1}"
    assert s.skipped_iterations == sum(f for f, *_ in HAND_WORKED) == 9


def test_a_scaler_resumed_from_its_state_dict_continues_as_the_straight_one():
    """What a checkpoint restores (training.checkpointing): at every split of the hand-worked run, a fresh
    scaler loaded with the state so far then follows the same scale, trackers and skip count."""
    for split in range(len(HAND_WORKED) + 1):
        straight = DynamicLossScaler(initial_scale=16, min_scale=2, growth_interval=3, hysteresis=2)
        for found_inf, *_ in HAND_WORKED[:split]:
            straight.update(found_inf)
        resumed = DynamicLossScaler(initial_scale=16, min_scale=2, growth_interval=3, hysteresis=2)
        resumed.load_state_dict(straight.state_dict())
        for found_inf, *_ in HAND_WORKED[split:]:
            straight.update(found_inf)
            resumed.update(found_inf)
            assert resumed.state_dict() == straight.state_dict()
        assert torch.equal(resumed.scale, straight.scale)
    constant = ConstantLossScaler(1024)
    constant.update(True)
    again = ConstantLossScaler(1)
    again.load_state_dict(constant.state_dict())
    assert again.state_dict() == {"scale": 1024.0, "skipped_iterations": 1}


def test_megatron_defaults_and_which_scaler_is_built():
    # megatron/training/arguments.py::_add_mixed_precision_args: 2**32, 1.0, 1000, 2
    d = make_loss_scaler(fp16=True)
    assert isinstance(d, DynamicLossScaler)
    assert (d.value, d.min_scale, d.growth_interval, d.hysteresis) == (2.0 ** 32, 1.0, 1000, 2)
    assert (d.growth_factor, d.backoff_factor) == (2.0, 0.5)
    c = make_loss_scaler(fp16=True, loss_scale=1024)
    assert isinstance(c, ConstantLossScaler)
    for found in (True, True, True, False):
        c.update(found)
    assert c.value == 1024 and c.skipped_iterations == 3
    assert make_loss_scaler(fp16=False) is None            # bf16 / fp32: no scaler
    # Megatron (optimizer/__init__.py): --loss-scale with bf16 or the distributed optimizer is a constant scaler
    assert isinstance(make_loss_scaler(False, loss_scale=8, bf16=True), ConstantLossScaler)
    assert isinstance(make_loss_scaler(False, loss_scale=8, distributed_optimizer=True), ConstantLossScaler)
    assert make_loss_scaler(False, loss_scale=8) is None   # fp32 without the distributed optimizer: none
    assert make_loss_scaler(False, bf16=True) is None
    assert precision_dtype(bf16=True) is torch.bfloat16 and precision_dtype(fp16=True) is torch.float16
    assert skipped_iterations_text(3) == " number of skipped iterations:   3 |"


@pytest.mark.parametrize("call, match", [
    (lambda: precision_dtype(bf16=True, fp16=True), "mutually exclusive"),
    (lambda: make_loss_scaler(True, loss_scale=0), "loss_scale=0"),
    (lambda: make_loss_scaler(True, min_loss_scale=8, initial_loss_scale=4), "min_loss_scale=8"),
    (lambda: make_loss_scaler(True, loss_scale_window=2.5), "loss_scale_window=2.5"),
    (lambda: make_loss_scaler(True, hysteresis=0), "hysteresis=0"),
    (lambda: unscale_and_check([torch.ones(2, dtype=torch.bfloat16)], torch.ones(1)), "fp32 main grads"),
])
def test_bad_settings_are_one_line_errors(call, match):
    with pytest.raises(ValueError, match=match) as err:
        call()
    assert "\n" not in str(err.value)


def test_unscale_divides_and_finds_inf_and_nan():
    g = [torch.tensor([8.0, -4.0]), None, torch.tensor([[2.0]])]
    assert unscale_and_check(g, torch.tensor([4.0])) is False
    assert g[0].tolist() == [2.0, -1.0] and g[2].tolist() == [[0.5]]
    assert unscale_and_check([torch.tensor([1.0, float("nan")])], torch.tensor([2.0])) is True
    assert unscale_and_check([torch.tensor([float("inf")])], torch.tensor([2.0])) is True


# ----------------------------------------------------------------------------- on two real ranks


def _found_inf_ranks():
    import torch.distributed as dist

    from course_lib.comm import CommRecorder
    from tests.helpers import rank_groups

    world = rank_groups("dp")["dp"]   # dp = the whole world of 2 (stands in for the model-parallel group)
    r = dist.get_rank()
    out = {}
    grads = [torch.full((3,), 4.0), torch.full((2,), 8.0)]
    if r == 1:
        grads[1][0] = float("inf")
    with CommRecorder() as rec:
        out["found"] = unscale_and_check(grads, torch.tensor([4.0]), world)
    out["events"] = [(e.op, e.numel, e.reduce_op, e.kind, e.group_size) for e in rec.events]
    out["grad0"] = grads[0].tolist()
    out["clean"] = unscale_and_check([torch.ones(2)], torch.tensor([1.0]), world)
    # a whole fp16 step: rank 1's gradient overflows, both ranks skip and keep identical params
    torch.manual_seed(0)
    model = to_float16(torch.nn.Linear(4, 2), "fp16")
    opt = MixedPrecisionOptimizer(list(model.named_parameters()), scaler=make_loss_scaler(True, initial_loss_scale=64),
                                  grad_stats_group=world)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(3, 4) * (1e6 if r == 1 else 1.0)
    opt.backward(model(x).float().pow(2).mean())
    opt.reduce_grads(world)
    out["step"] = opt.step(lr=0.1)
    out["unchanged"] = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    out["skipped"], out["scale"] = opt.scaler.skipped_iterations, opt.scaler.value
    return out


def test_found_inf_is_agreed_by_every_rank():
    res = launch(_found_inf_ranks, world_size=2, backend="gloo", timeout=60, output="none")
    for r, o in enumerate(res):
        assert o["found"] is True, f"rank {r} must skip too"
        assert o["clean"] is False
        assert o["grad0"] == [1.0, 1.0, 1.0]
        assert o["events"][0] == ("all_reduce", 1, "max", "mp", 2)
        assert o["step"] == (False, True) and o["unchanged"]
        assert o["skipped"] == 1 and o["scale"] == 64       # hysteresis 2: the first overflow keeps the scale


# ----------------------------------------------------------------------------- 16-bit training


def _train(precision, steps=4, lr=1e-3, scaler=None):
    model = to_float16(GPTModel(TINY), precision)
    opt = MixedPrecisionOptimizer(list(model.named_parameters()), scaler=scaler,
                                  accumulate_allreduce_grads_in_fp32=precision == "bf16")
    losses, grads = [], None
    for i in range(steps):
        loss = model.loss(*_batch(0))
        opt.backward(loss)
        if i == 0:
            grads = [(p.main_grad if opt.fp32_accumulation else p.grad).float().clone() for _, p in opt.named_params]
        opt.step(lr)
        if i == 0:
            bytes_ = opt.state_bytes()
        opt.zero_grad()
        losses.append(loss)
    return model, opt, losses, grads, bytes_


def test_bf16_training_matches_fp32_within_tolerance():
    ref_model, _, ref_losses, ref_grads, ref_bytes = _train("fp32")
    model, opt, losses, grads, bytes_ = _train("bf16")
    assert isinstance(model, Float16Module)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(m.dtype == torch.float32 for _, m in opt.main_params)
    assert all(p.main_grad.dtype == torch.float32 for _, p in opt.named_params)
    assert all(loss.dtype == torch.float32 for loss in losses)                 # logits and loss in fp32
    # the 16-bit params are the fp32 main params rounded
    for (_, p), (_, m) in zip(opt.named_params, opt.main_params):
        assert torch.equal(p, m.to(torch.bfloat16))
    # stated tolerance: losses within 2e-3 relative over 4 Adam steps; gradients within 5% (norm)
    for a, b in zip(losses, ref_losses):
        assert abs(a.item() - b.item()) <= 2e-3 * abs(b.item())
    err = math.sqrt(sum(float((g - r).pow(2).sum()) for g, r in zip(grads, ref_grads)))
    norm = math.sqrt(sum(float(r.pow(2).sum()) for r in ref_grads))
    assert err <= 0.05 * norm
    assert losses[-1] < losses[0]
    # bytes per parameter: Megatron's dist_optimizer.md table (bf16 params, fp32 grads: 18; fp32: 16)
    n = sum(p.numel() for p in model.parameters())
    want = megatron_optimizer_bytes_per_param(1, False, "bf16", "fp32")
    assert bytes_["params"] == want.weights * n and bytes_["grads"] == want.grads * n
    assert bytes_["main_params"] + bytes_["main_grads"] + bytes_["optimizer_state"] == want.optimizer * n
    assert sum(bytes_.values()) == 18 * n
    assert sum(ref_bytes.values()) - ref_bytes["grads"] + 4 * n == 16 * n      # fp32: grads freed by zero_grad


def test_fp16_overflow_is_skipped_and_the_scale_backs_off():
    scaler = make_loss_scaler(True, initial_loss_scale=2.0 ** 21)      # 2**21 x the loss overflows fp16 (max 65504)
    model = to_float16(GPTModel(TINY), "fp16")
    opt = MixedPrecisionOptimizer(list(model.named_parameters()), scaler=scaler)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    scales, updated = [], False
    for _ in range(24):
        opt.backward(model.loss(*_batch(0)))
        updated, found = opt.step(lr=1e-3)
        opt.zero_grad()
        scales.append(scaler.value)
        if updated:
            break
        assert all(torch.equal(before[n], p) for n, p in model.named_parameters()), "a skipped step changed params"
    assert updated, "fp16 never recovered from the overflow"
    k = scaler.skipped_iterations
    # rules: the first overflow keeps the scale (hysteresis 2), every later one halves it
    want = [2.0 ** 21] + [2.0 ** (21 - i) for i in range(1, k)] + [2.0 ** (22 - k)]
    assert scales == want and k >= 3
    assert not all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert all(p.dtype == torch.float16 for p in model.parameters())


def test_constant_scale_that_always_overflows_never_updates():
    torch.manual_seed(0)
    model = to_float16(torch.nn.Linear(8, 4), "fp16")
    opt = MixedPrecisionOptimizer(list(model.named_parameters()), scaler=ConstantLossScaler(2.0 ** 30))
    w = model.module.weight.detach().clone()
    for _ in range(3):
        opt.backward(model(torch.randn(2, 8)).pow(2).mean())     # grads ~2**30 overflow fp16
        assert opt.step(1e-3) == (False, True)
        opt.zero_grad()
    assert torch.equal(w, model.module.weight) and opt.scaler.skipped_iterations == 3 and opt.scaler.value == 2 ** 30


def test_float16_module_casts_inputs_and_returns_fp32():
    lin = torch.nn.Linear(3, 2)
    m = Float16Module(lin, torch.bfloat16)
    out = m(torch.randn(4, 3))
    assert lin.weight.dtype == torch.bfloat16 and out.dtype == torch.float32
    middle = Float16Module(torch.nn.Linear(3, 2), torch.bfloat16, pre_process=False, post_process=False)
    assert middle(torch.randn(4, 3, dtype=torch.bfloat16)).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        Float16Module(lin, torch.float32)


# ----------------------------------------------------------------------------- activations in 16-bit

S, B, H, A, T = 16, 2, 32, 4, 2


def test_bf16_layer_activation_bytes_equal_korthikanti_up_to_named_terms():
    """Korthikanti Eq. 4 per rank (16-bit, SP): (34sbh + 5as^2b)/t. Our layer in bf16 keeps the same tensors
    at the same 2 bytes except: the flash kernel stores no scores (-5as^2b/t), at dropout 0 there are no
    masks (-2sbh/t; with dropout the masks are 2-byte tensors instead of 1-byte, +2sbh/t), LayerNorm mean
    and 1/std (2 LNs x 2 x s/t b x 2 bytes = +8sb/t) and the kernel's fp32 log-sum-exp (4 (a/t) s b)."""
    cases = [dict(seq_length=S, micro_batch_size=B, hidden_size=H, num_heads=A, sequence_parallel=True,
                  dtype=torch.bfloat16, hidden_dropout=p) for p in (0.0, 0.1)]
    measured = am.measure(cases, tp=T, timeout=60)
    paper = activation_bytes_per_layer(S, B, H, A, tp=T, sequence_parallel=True)
    sbh, sb, asb, as2b = S * B * H, S * B, A * S * B, A * S * S * B
    assert paper == (34 * sbh + 5 * as2b) // T
    for case, per_rank in zip(cases, measured):
        masks = +2 * sbh // T if case["hidden_dropout"] else -2 * sbh // T
        want = paper - 5 * as2b // T + masks + 8 * sb // T + 4 * asb // T
        expected = am.expected_saved_tensors(**{k: v for k, v in case.items()}, tp=T)
        for records in per_rank:
            assert am.activation_bytes(records) == want == sum(e.bytes for e in expected)
            storages = am.activation_storages(records)
            assert [s["bytes"] for s in storages] == [e.bytes for e in expected]
            dtypes = {(r.dtype, r.shape if r.dtype == "float32" else None) for r in records if not r.parameter}
            assert dtypes == {("bfloat16", None), ("float32", (B, A // T, S))}     # only the lse is fp32
    with pytest.raises(ValueError, match="attention_backend='flash' and cp=1"):
        am.expected_saved_tensors(S, B, H, A, attention_backend="unfused", dtype=torch.bfloat16)


# ----------------------------------------------------------------------------- the trainer's flags

TRAIN = ["--uniform-vocab-padding", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "3",
         "--log-interval", "1", "--lr", "3e-3", "--lr-decay-style", "constant"]


def _train_ranks(runs):
    from course_lib.train import parse_args, pretrain

    return [pretrain(parse_args(argv), print_args=False) for argv in runs]


def test_trainer_bf16_matches_one_process_and_fp16_skips_overflows():
    from course_lib.training.logs import parse_log
    from course_lib.train import parse_args, train_single_process

    bf16 = TRAIN + ["--bf16"]
    fp16 = TRAIN + ["--fp16", "--initial-loss-scale", str(2.0 ** 40), "--tensor-model-parallel-size", "2"]
    res = launch(_train_ranks, world_size=2, backend="gloo", timeout=120, output="none", runs=[bf16, fp16])
    ref16, ref32 = train_single_process(parse_args(bf16)), train_single_process(parse_args(TRAIN))
    got = res[-1][0]["lm_loss"]
    # bf16 on 2 DP ranks vs one bf16 process: 1e-3 relative (the tolerance; measured 3e-6)
    assert max(abs(a - b) / b for a, b in zip(got, ref16["lm_loss"])) < 1e-3
    # and --bf16 really computes in 16-bit: fp32 differs (measured 4e-5 relative on this model)
    assert max(abs(a - b) / b for a, b in zip(got, ref32["lm_loss"])) > 5e-6
    # fp16, TP2: 2**40 overflows; both TP ranks skip together (found_inf MAX over the model-parallel group)
    rec = [r[1] for r in res]
    assert rec[0]["skipped"] == rec[1]["skipped"] and rec[0]["skipped"][:2] == [True, True]
    k = rec[0]["skipped"].count(True)
    scales = rec[0]["loss_scale"]
    assert scales[0] == 2.0 ** 40 and scales[1] == 2.0 ** 39            # hysteresis 2: the second one backs off
    log = parse_log(res.outputs[1])
    sk = [int(x) for x in rec[0]["skipped"]]
    # one line per iteration (--log-interval 1); Megatron 0.16 keeps iteration 1 in the next interval
    assert [it["skipped_iterations"] for it in log.iterations[-3:]] == [sk[0], sk[0] + sk[1], sk[2]]
    assert [it["loss_scale"] for it in log.iterations[-3:]] == scales and k >= 2


def test_trainer_precision_flags_follow_megatrons_rules():
    from course_lib.train import args_to_argv, parse_args, validate_args

    a = validate_args(parse_args(TRAIN + ["--bf16"]), 1).namespace()
    assert a.accumulate_allreduce_grads_in_fp32 is True           # validate_args turns it on for bf16
    assert "--bf16" in args_to_argv(a)
    for extra, match in ((["--bf16", "--fp16"], "mutually exclusive"),
                         (["--fp16", "--hysteresis", "0"], "hysteresis=0"),
                         (["--fp16", "--loss-scale", "-1"], "loss_scale=-1")):
        with pytest.raises(ValueError, match=match):
            validate_args(parse_args(TRAIN + extra), 1)


def test_bf16_with_a_loss_scale_trains_under_a_constant_scaler():
    """Megatron builds a ConstantGradScaler for --bf16 --loss-scale (optimizer/__init__.py ~645-647): the
    log line shows the scale, and a power-of-two scale changes no loss (it is undone exactly)."""
    from course_lib.training.logs import parse_log

    bf16 = TRAIN + ["--bf16"]
    res = launch(_train_ranks, world_size=1, backend="gloo", timeout=120, output="none",
                 runs=[bf16, bf16 + ["--loss-scale", "1024"]])
    plain, scaled = res[0]
    assert scaled["loss_scale"] == [1024.0] * 3 and plain["loss_scale"] == [1.0] * 3
    assert scaled["lm_loss"] == plain["lm_loss"] and scaled["skipped"] == [False] * 3
    assert [it["loss_scale"] for it in parse_log(res.outputs[0]).iterations][-3:] == [1024.0] * 3
