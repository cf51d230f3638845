"""course_lib.train: Megatron's flags and log lines, and loss parity of every layout.

Loss parity: with dropout off, every layout's loss (and gradient norm) per iteration equals
the single-process dense model's on the same global batch within 1e-4 relative. The layouts
run on real forked ranks (fast); one run goes through real torchrun, read back with the
Megatron log parser. The settings (constant lr 3e-3, 4 iterations) make the check sharp:
dropping a gradient synchronisation moves the loss by > 1e-3 (test_parity_check_catches_...;
the embedding, SP-LayerNorm, DP and CP-position mistakes were each measured at 1e-3 to 1e-2).
They stop before the first loss spike of this lr (iteration 11), which would amplify the
float32 rounding differences between layouts past 1e-4.
"""

import argparse
import math

import pytest
import torch
import torch.distributed as dist

from course_lib.launch import launch
from course_lib.training.logs import parse_log
from course_lib.train import (LRScheduler, Optimizer, add_arguments, args_to_argv, build_parser, main, parse_args,
                              pretrain, run, torchrun_argv, train_single_process, validate_args)
from course_lib.training.finalize_model_grads import finalize_model_grads

BASE = ["--uniform-vocab-padding", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4",
        "--log-interval", "2", "--lr", "3e-3", "--lr-decay-style", "constant"]
TOL = 1e-4


def _rank(argv, finalize_model_grads_func=finalize_model_grads):
    return pretrain(parse_args(argv), finalize_model_grads_func=finalize_model_grads_func)


def _finalize_without_embedding_all_reduce(chunks, groups, config):
    """A broken trainer's gradient step: on PP2 x DP1 without SP the tied-embedding all-reduce is
    ``finalize_model_grads``'s only work, so skipping it all forgets exactly that one."""
    if config.dp * config.cp != 1 or config.sequence_parallel or config.pp == 1:
        raise ValueError(f"this sabotage is for PP > 1, DP = CP = 1, no SP; got {config}")


def _rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def _megatron_logged(values, interval):
    """What Megatron 0.16 prints: iteration 1, then every interval, averaged since the last reset
    (no reset after iteration 1)."""
    out, acc, n = {}, 0.0, 0
    for i, v in enumerate(values, 1):
        acc, n = acc + v, n + 1
        if i % interval == 0 or i == 1:
            out[i] = acc / n
            if i != 1:
                acc, n = 0.0, 0
    return out


def _check_printed_log(log, reference, world, extra, memory_ranks):
    """A run's printed lines, parsed back: the layout of its ``extra`` flags on ``world`` ranks, the
    reference's losses as Megatron 0.16 logs them (BASE: 4 iterations, interval 2), its grad norm
    and learning rate at each logged iteration (to the printed digits), and a memory line from
    ``memory_ranks`` (DP rank 0 of each model-parallel position) after iterations 1 and 2."""
    world_line = {k: log.config[k] for k in ("world_size", "tp", "pp", "cp", "dp")}
    tp, pp, cp = (int(extra[extra.index(f) + 1]) if f in extra else 1 for f in
                  ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size"))
    assert world_line == dict(world_size=world, tp=tp, pp=pp, cp=cp, dp=world // (tp * pp * cp))
    assert log.config["num_microbatches"] == 8 // (2 * world_line["dp"])
    expected = _megatron_logged(reference["lm_loss"], 2)
    assert [it["iteration"] for it in log.iterations] == sorted(expected) == [1, 2, 4]
    for it in log.iterations:
        i = it["iteration"]
        assert abs(it["lm_loss"] - expected[i]) / expected[i] < TOL
        assert it["consumed_samples"] == 8 * i and it["global_batch_size"] == 8
        assert it["grad_norm"] == pytest.approx(reference["grad_norm"][i - 1], abs=5e-4)         # :.3f
        assert it["learning_rate"] == pytest.approx(reference["learning_rate"][i - 1], rel=1e-6)  # :.6E
    assert {m["rank"] for m in log.memory} == memory_ranks
    assert all(m["source"] == "tracked tensor bytes" and m["max_allocated_mb"] >= m["allocated_mb"] > 0
               for m in log.memory)
    assert [m["iteration"] for m in log.memory if m["rank"] == 0] == [1, 2]


@pytest.fixture(scope="module")
def reference():
    return train_single_process(parse_args(BASE))


LAYOUTS = {   # name: (world size, extra flags)
    "1 rank, 4 micro-batches": (1, []),
    "DP4": (4, []),
    "TP2 x DP2": (4, ["--tensor-model-parallel-size", "2"]),
    "PP2 x DP2": (4, ["--pipeline-model-parallel-size", "2"]),
    "PP2 x DP2, GPipe": (4, ["--pipeline-model-parallel-size", "2", "--pipeline-schedule", "gpipe"]),
    # TP2+SP x PP2 runs through real torchrun: test_real_torchrun_run_prints_megatron_lines_with_the_baseline_loss
    "PP2 interleaved vp2 x DP2": (4, ["--pipeline-model-parallel-size", "2",
                                      "--virtual-pipeline-model-parallel-size", "2"]),
    "TP2 x CP2 + SP": (4, ["--tensor-model-parallel-size", "2", "--context-parallel-size", "2",
                           "--sequence-parallel"]),
    # The Day 22 seed's 8-GPU layouts: D (3D) and F (4D).
    "TP2 x PP2 x DP2 (8 ranks, config D)": (8, ["--tensor-model-parallel-size", "2",
                                                "--pipeline-model-parallel-size", "2"]),
    "TP2 x PP2 x CP2 + SP (8 ranks, config F)": (8, ["--tensor-model-parallel-size", "2",
                                                     "--pipeline-model-parallel-size", "2",
                                                     "--context-parallel-size", "2", "--sequence-parallel"]),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_loss_curve_equals_single_process_baseline(layout, reference):
    world, extra = LAYOUTS[layout]
    res = launch(_rank, world_size=world, output="none", timeout=120, argv=BASE + extra)
    last = res[-1]                                       # the last rank prints, and is on the last stage
    assert len(last["lm_loss"]) == 4
    assert _rel(last["lm_loss"], reference["lm_loss"]) < TOL, (layout, last["lm_loss"], reference["lm_loss"])
    for r in res:                                        # every rank agrees on the (model-parallel) grad norm
        assert _rel(r["grad_norm"], reference["grad_norm"]) < TOL
    assert last["learning_rate"] == pytest.approx(reference["learning_rate"])
    # what it printed is what Megatron prints, and the course's parser reads it back
    _check_printed_log(parse_log("\n".join(res.outputs)), reference, world, extra,
                       memory_ranks={r for r in range(world) if res[r]["coords"]["dp"] == 0})


def test_pp4_interleaved_equals_single_process_baseline():
    """PP4 with two model chunks per rank (8 layers: virtual stage c*4 + r holds one layer),
    using Megatron-LM's own flag for it."""
    argv = list(BASE)
    argv[argv.index("--num-layers") + 1] = "8"
    reference = train_single_process(parse_args(argv))
    res = launch(_rank, world_size=4, output="none", timeout=120,
                 argv=argv + ["--pipeline-model-parallel-size", "4", "--num-virtual-stages-per-pipeline-rank", "2"])
    assert _rel(res[-1]["lm_loss"], reference["lm_loss"]) < TOL, (res[-1]["lm_loss"], reference["lm_loss"])
    assert all(_rel(r["grad_norm"], reference["grad_norm"]) < TOL for r in res)


def test_optimizer_paths_sgd_warmup_cosine_and_clipping(reference):
    argv = BASE + ["--optimizer", "sgd", "--lr", "0.3", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine",
                   "--clip-grad", "0.5", "--weight-decay", "0.1"]
    ref = train_single_process(parse_args(argv))
    assert min(ref["grad_norm"]) > 0.5                                  # clipping is active every step
    res = launch(_rank, world_size=4, output="none", timeout=120,
                 argv=argv + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])
    assert _rel(res[-1]["lm_loss"], ref["lm_loss"]) < TOL
    assert ref["lm_loss"] != pytest.approx(reference["lm_loss"], rel=1e-3)   # a different run indeed


def test_parity_check_catches_a_missing_embedding_all_reduce(reference):
    res = launch(_rank, world_size=2, output="none", timeout=120,
                 argv=BASE + ["--pipeline-model-parallel-size", "2"],
                 finalize_model_grads_func=_finalize_without_embedding_all_reduce)
    assert _rel(res[-1]["lm_loss"], reference["lm_loss"]) > 1e-3


def test_vocabulary_padding_is_megatrons_unless_the_layout_asks_for_one_model(reference):
    """--make-vocab-size-divisible-by pads to a multiple of it x TP (Megatron's meaning); the course's
    layouts pass --uniform-vocab-padding to train one model whatever the TP size (BASE does)."""
    megatron = BASE[1:] + ["--tensor-model-parallel-size", "2", "--train-iters", "2"]
    assert validate_args(parse_args(megatron), 2).model.padded_vocab_size == 512          # 257 -> 2 x 128 x 2
    assert validate_args(parse_args(BASE + ["--tensor-model-parallel-size", "2"]), 2).model.padded_vocab_size == 384
    res = launch(_rank, world_size=2, output="none", timeout=120, argv=megatron)
    own = train_single_process(parse_args(megatron))                   # the reference pads as the layout does
    assert _rel(res[-1]["lm_loss"], own["lm_loss"]) < TOL
    assert _rel(res[-1]["lm_loss"], reference["lm_loss"][:2]) > 10 * TOL   # 512 rows: another model


def test_returned_record_has_communication_and_pipeline_timeline():
    res = launch(_rank, world_size=4, output="none", timeout=120,
                 argv=BASE + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                              "--train-iters", "1"])
    first, last = res[0], res[-1]
    assert {"tp", "pp", "tp-pp", "embedding"} <= set(first["comm"])       # DP=1: no dp traffic
    assert "dp" not in first["comm"]
    # PP: 4 micro-batches x activation [32, 2, 64] fp32 sent forward by stage 0
    assert first["comm"]["pp"] == 4 * 32 * 2 * 64 * 4
    assert [e[0] for e in first["pipeline_events"]][:2] == ["F0", "F1"]     # 1F1B warm-up on stage 0
    assert last["memory"]["max_allocated"] > last["memory"]["allocated"] > 0
    assert first["num_parameters"] > last["num_parameters"]                 # stage 0 also holds positions


# ---------------------------------------------------------------------- flags and validation


@pytest.mark.parametrize("extra, world, message", [
    (["--tensor-model-parallel-size", "3"], 4, "world_size=4 is not divisible by"),
    (["--tensor-model-parallel-size", "8"], 8,
     "num_attention_heads=4 is not divisible by tensor-model-parallel-size=8"),
    (["--pipeline-model-parallel-size", "3"], 3, "num_layers=4 is not divisible by pipeline-model-parallel-size=3"),
    (["--context-parallel-size", "2", "--seq-length", "30"], 2, "seq_length=30 is not divisible by 2 × "),
    (["--global-batch-size", "6"], 4, "global_batch_size=6 is not divisible by micro_batch_size=2 × "),
    (["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
      "--global-batch-size", "6"], 2, "num_microbatches=3 % microbatch_group_size_per_vp_stage=2"),
    (["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
      "--pipeline-schedule", "gpipe"], 2, "virtual pipeline stages need the interleaved 1F1B schedule"),
    (["--virtual-pipeline-model-parallel-size", "2"], 1, "needs pipeline-model-parallel-size > 1"),
    (["--tensor-model-parallel-size", "4", "--make-vocab-size-divisible-by", "2"], 4,
     r"vocab_size=258 \(padded\) is not divisible by tensor-model-parallel-size=4"),
    (["--context-parallel-size", "2", "--attention-dropout", "0.1"], 2,
     "attention_dropout=0.1 is not supported with context-parallel-size=2"),
    (["--virtual-pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2"], 2,
     "give only one of"),
    (["--tensor-model-parallel-size", "0"], 1, "tensor-model-parallel-size=0 must be an integer >= 1"),
])
def test_bad_layouts_fail_in_one_line(extra, world, message):
    with pytest.raises(ValueError, match=message) as err:
        validate_args(parse_args(BASE + extra), world)
    assert "\n" not in str(err.value)


def test_validate_derives_dp_and_follows_megatron_defaults():
    run = validate_args(parse_args(BASE[:-6] + ["--tensor-model-parallel-size", "2"]), 8)  # no --global-batch
    a, cfg = run.namespace(), run.parallel
    assert (a.data_parallel_size, cfg.dp, a.global_batch_size, cfg.num_microbatches) == (4, 4, 8, 1)
    a = validate_args(parse_args(BASE + ["--sequence-parallel"]), 2).namespace()   # TP=1: SP off, like Megatron
    assert a.sequence_parallel is False
    a = validate_args(parse_args(BASE + ["--pipeline-model-parallel-size", "2",
                                            "--num-layers-per-virtual-pipeline-stage", "1"]), 2).namespace()
    assert a.virtual_pipeline_model_parallel_size == 2
    assert not hasattr(build_parser().parse_args([]), "data_parallel_size")   # DP is never a flag
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--data-parallel-size", "2"])


def test_main_rejects_a_bad_layout_before_any_process_group(monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "0")
    assert main(BASE + ["--tensor-model-parallel-size", "3"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: world_size=8 is not divisible by") and "\n" not in err
    assert not dist.is_initialized()


def test_args_round_trip_through_the_command_line():
    args = parse_args(BASE + ["--tensor-model-parallel-size", "2", "--sequence-parallel"])
    assert parse_args(args_to_argv(args)) == args
    cmd = torchrun_argv(args, 4)
    assert cmd[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4"]
    assert cmd[5:7] == ["-m", "course_lib.train"] and "--sequence-parallel" in cmd


def test_optimizer_equals_torch_adamw_and_sgd():
    torch.manual_seed(0)
    for kind in ("adam", "sgd"):
        w, b = torch.randn(5, 3), torch.randn(5)
        ours = [torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())]
        theirs = [torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())]
        opt = Optimizer([("linear.weight", ours[0]), ("linear.bias", ours[1])], kind, weight_decay=0.1,
                        betas=(0.9, 0.95), eps=1e-8, momentum=0.9)
        cls = torch.optim.AdamW if kind == "adam" else torch.optim.SGD
        extra = dict(betas=(0.9, 0.95), eps=1e-8) if kind == "adam" else dict(momentum=0.9)
        ref = cls([{"params": [theirs[0]], "weight_decay": 0.1}, {"params": [theirs[1]], "weight_decay": 0.0}],
                  lr=0.01, **extra)
        for step in range(4):
            g = [torch.randn(5, 3), torch.randn(5)]
            for p, q, gi in zip(ours, theirs, g):
                p.grad, q.grad = gi.clone(), gi.clone()
            opt.step(0.01)
            ref.step()
        for p, q in zip(ours, theirs):
            torch.testing.assert_close(p.data, q.data, rtol=1e-6, atol=1e-7)


def test_learning_rate_schedule_matches_megatron_formula():
    # 10 iterations of 4 samples, warm-up 2 iterations, decay over all 10 (OptimizerParamScheduler.get_lr)
    for style, at5 in (("linear", 1.0 - 3 / 8), ("cosine", 0.5 * (math.cos(math.pi * 3 / 8) + 1))):
        s = LRScheduler(1.0, 0.1, style, warmup_steps=8, decay_steps=40)
        lrs = [s.get_lr()] + [s.step(4) for _ in range(11)]
        assert lrs[0] == 0.0 and lrs[1] == pytest.approx(0.5) and lrs[2] == pytest.approx(1.0)
        assert lrs[5] == pytest.approx(0.1 + 0.9 * at5)
        assert lrs[10] == pytest.approx(0.1) and lrs[11] == 0.1            # past the decay: min_lr
    s = LRScheduler(2.0, 0.0, "constant", 0, 40)
    assert [s.step(4) for _ in range(3)] == [2.0, 2.0, 2.0]


# ---------------------------------------------------------------------- real torchrun


def test_real_torchrun_run_prints_megatron_lines_with_the_baseline_loss(reference, capfd):
    """``python -m course_lib train --nproc-per-node 4 ...`` = torchrun ... -m course_lib.train (slow: ~15 s).

    The one real torchrun launch of this file, so it carries a layout's whole parity check (TP2+SP x
    PP2, which LAYOUTS leaves to it): the printed losses, grad norms and learning rates against
    the single process, the world line, the arguments block, the parameter and memory lines."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    extra = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel"]
    assert run(parser.parse_args(BASE + ["--nproc-per-node", "4"] + extra)) == 0
    out = capfd.readouterr().out
    assert out.splitlines()[0].startswith("$ torchrun --standalone --nproc-per-node=4 -m course_lib.train")
    log = parse_log(out)
    _check_printed_log(log, reference, 4, extra, memory_ranks={0, 1, 2, 3})            # DP = 1: every rank
    assert log.args["sequence_parallel"] is True and log.args["seq_length"] == 32
    assert log.args["data_parallel_size"] == 1 and log.args["padded_vocab_size"] == 384
    assert log.era == "0.16+"
    assert sorted((p["tensor"], p["pipeline"]) for p in log.parameters) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_course_cli_rejects_a_bad_layout_without_starting_torchrun():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not divisible by tensor-model-parallel-size=8"):
        run(parser.parse_args(BASE + ["--nproc-per-node", "8", "--tensor-model-parallel-size", "8"]))


def test_a_nan_loss_stops_training_with_one_line_and_a_failed_exit_code():
    """Megatron's --check-for-nan-in-loss-and-grad (on by default): --lr 1e30 turns the loss into NaN at
    iteration 2; the run stops there, says so in one line and exits 1 instead of training on and
    exiting 0. --no-check-for-nan-in-loss-and-grad trains on (and survives the trip to torchrun's argv)."""
    import subprocess
    import sys

    argv = [a for a in BASE if a not in ("--lr", "3e-3")] + ["--lr", "1e30", "--log-interval", "1"]
    out = subprocess.run([sys.executable, "-m", "course_lib.train", *argv], capture_output=True, text=True,
                         timeout=120)
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode == 1, out.stderr[-2000:]
    assert len(errors) == 1 and "lm_loss=nan at iteration 2 is not finite" in errors[0], out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "iteration        3/" not in out.stdout
    lenient = parse_args(argv + ["--no-check-for-nan-in-loss-and-grad"])
    assert lenient.check_for_nan_in_loss_and_grad is False and parse_args(argv).check_for_nan_in_loss_and_grad
    assert "--no-check-for-nan-in-loss-and-grad" in args_to_argv(lenient)
    assert parse_args(args_to_argv(lenient)).check_for_nan_in_loss_and_grad is False
