"""DeepSpeed itself (0.19.8, ``DS_ACCELERATOR=cpu``, gloo) trains the course GPT from a ds_config.json.

One fork launch of 2 ranks runs, for each config below, ``deepspeed.initialize`` through
:func:`course_lib.deepspeed.engine.pretrain` *and* the course's trainer
(:func:`course_lib.train.pretrain`) under the flags the ds_config bridge translates the same file
into (:func:`course_lib.deepspeed.config.translate` / ``course_flags``); the reference is one
process (:func:`course_lib.train.train_single_process`) with those flags. Same seed, same data:

* fp32 (ZeRO 0-3, buckets, prefetch, persistence threshold, max live params, overlap_comm,
  gradient accumulation, clipping, the optimizer block, CPU offload of the optimizer and of the
  params, NVMe offload where DeepSpeed's async_io op builds): DeepSpeed's losses equal ours and
  the single process's within 1e-6 relative, grad norms within 1e-5;
* bf16 (DeepSpeed's bf16 block: bf16 params, fp32 master) equals ours (autocast, fp32 params) within 1e-3;
* the memory line carries the bytes DeepSpeed holds per rank, equal to ZeRO's partitions (DeepSpeed
  keeps an fp32 master partition even in fp32 training: 4 + 8 bytes per parameter of optimizer
  state over d), with what the offload moved on the host.

One real ``python -m course_lib train --nproc-per-node 2 --deepspeed-config`` (torchrun) prints
Megatron's lines, which ``course_lib.training.logs.parse_log`` and the report's record table read.
"""

import argparse
import io
import json
import time
from contextlib import redirect_stdout

import pytest

from course_lib.launch import launch
from course_lib.deepspeed import config as ds_config
from course_lib.training.logs import parse_log
from course_lib.megatron.report import record_row
from course_lib.train import add_arguments, parse_args, pretrain, run, train_single_process, validate_args
from course_lib.deepspeed import engine as deepspeed_engine
from course_lib.training.arguments import gpt_config_from_args

WORLD = 2
MODEL = ["--uniform-vocab-padding", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--train-iters", "3", "--log-interval", "1", "--lr", "3e-3",
         "--lr-decay-style", "constant"]
BATCH = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2}          # 2 accumulation steps on 2 ranks
ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}}
THRESHOLD = 100                                                              # stage3_param_persistence_threshold
CONFIGS = {  # name: (ds_config, ZeRO stage)
    "zero0": ({**BATCH, "gradient_clipping": 1.0, "zero_optimization": {"stage": 0}}, 0),
    "zero1": ({**BATCH, "optimizer": ADAMW, "zero_optimization": {"stage": 1}}, 1),
    "zero2": ({**BATCH, "zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                               "reduce_bucket_size": 3000, "allgather_bucket_size": 3000}}, 2),
    "zero3": ({**BATCH, "zero_optimization": {"stage": 3, "overlap_comm": True, "stage3_prefetch_bucket_size": 2000,
                                               "stage3_param_persistence_threshold": THRESHOLD,
                                               "stage3_max_live_parameters": 10000}}, 3),
    "zero2_offload": ({**BATCH, "optimizer": ADAMW,
                       "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}, 2),
    "zero3_offload": ({**BATCH, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": THRESHOLD,
                                                       "offload_optimizer": {"device": "cpu"},
                                                       "offload_param": {"device": "cpu"}}}, 3),
    "zero2_bf16": ({**BATCH, "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}, 2),
}


def _nvme_config(folder) -> dict:
    off = {"device": "nvme", "nvme_path": str(folder)}
    return {**BATCH, "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": THRESHOLD,
                                           "offload_optimizer": dict(off), "offload_param": dict(off)}}


def _async_io_builds() -> bool:
    deepspeed_engine.import_deepspeed()
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().is_compatible(verbose=False)


def _bridge_flags(config: dict) -> list[str]:
    """The course trainer's flags for ``config`` on WORLD ranks, as the ds_config bridge translates them."""
    argv, _ = ds_config.course_flags(ds_config.translate(ds_config.parse(config), dp=WORLD))
    return argv


def _on_ranks(paths: dict):
    out, ours_by_flags = {}, {}          # zero3_nvme translates to zero3's flags: our trainer runs them once
    for name, path in paths.items():
        run = validate_args(parse_args(MODEL + ["--deepspeed-config", path]), WORLD, check_memory=False)
        buf = io.StringIO()
        start = time.perf_counter()
        with redirect_stdout(buf):
            rec = deepspeed_engine.pretrain(run, print_args=False)
        seconds = time.perf_counter() - start
        out[name] = {"lm_loss": rec["lm_loss"], "grad_norm": rec["grad_norm"], "state_bytes": rec["state_bytes"],
                     "log": buf.getvalue(), "seconds": seconds}
        flags = tuple(_bridge_flags(json.load(open(path))))
        if flags not in ours_by_flags:
            with redirect_stdout(io.StringIO()):
                ours = pretrain(parse_args(MODEL + list(flags)), print_args=False, record_comm=False)
            ours_by_flags[flags] = {"lm_loss": ours["lm_loss"], "grad_norm": ours["grad_norm"]}
        out[name]["ours"] = ours_by_flags[flags]
    return out


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ds")
    cases = dict(CONFIGS)
    if _async_io_builds():
        (folder / "nvme").mkdir()
        cases["zero3_nvme"] = (_nvme_config(folder / "nvme"), 3)
    paths = {}
    for name, (config, _) in cases.items():
        paths[name] = str(folder / f"{name}.json")
        (folder / f"{name}.json").write_text(json.dumps(config))
    return cases, paths


@pytest.fixture(scope="module")
def runs(configs):
    deepspeed_engine.preload()                        # the ranks fork with DeepSpeed's lazy imports done
    start = time.perf_counter()
    res = launch(_on_ranks, world_size=WORLD, output="none", timeout=600, paths=configs[1])
    print(f"\n[deepspeed] one launch, {len(configs[1])} configs x (DeepSpeed + ours): {time.perf_counter() - start:.1f} s; "
          + ", ".join(f"{n} {r['seconds']:.1f} s" for n, r in res[0].items()))
    return res


@pytest.fixture(scope="module")
def references(configs):
    by_flags = {}                        # one single-process run per distinct flag set
    for name, (config, _) in configs[0].items():
        flags = tuple(_bridge_flags(config))
        if flags not in by_flags:
            by_flags[flags] = train_single_process(parse_args(MODEL + list(flags)))
    return {name: by_flags[tuple(_bridge_flags(config))] for name, (config, _) in configs[0].items()}


def _rel(got, want):
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def test_losses_equal_ours_and_one_process(configs, runs, references):
    table = []
    for name in configs[0]:
        ds, ours, one = runs[-1][name], runs[-1][name]["ours"], references[name]
        tol = 1e-3 if "bf16" in name else 1e-6
        table.append(f"{name}: DeepSpeed {ds['lm_loss']} ours {ours['lm_loss']} one process {one['lm_loss']}")
        assert _rel(ds["lm_loss"], ours["lm_loss"]) < tol, table[-1]
        assert _rel(ds["lm_loss"], one["lm_loss"]) < tol, table[-1]
        if "bf16" in name:
            assert _rel(ds["lm_loss"], references["zero0"]["lm_loss"]) > 1e-5      # it did compute in 16 bits
        else:
            for r in runs:
                assert r[name]["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-5), name
    print("\n" + "\n".join(table))


def test_weight_decay_follows_megatron_groups():
    """Biases and 1-D parameters are handed to DeepSpeed without weight decay (Megatron's rule)."""
    from course_lib.model import GPTModel
    from course_lib.optimizer import param_groups

    a = parse_args(MODEL)
    decay, no_decay = param_groups(list(GPTModel(gpt_config_from_args(a)).named_parameters()), 0.01)
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])


def _expected_bytes(num_params: int, persistent: int, largest: int, stage: int, offload: set, bucket: int) -> dict:
    """What DeepSpeed holds per rank in fp32 over d = WORLD after a step (the allocations
    ``held_bytes`` names): ZeRO-0 the params and Adam's two moments; ZeRO-1/2 also an fp32 master
    partition (4 + 8 bytes over d; grads freed after the step); ZeRO-3 the param partition, the grad
    partition, its reduce bucket (``bucket`` elements) and the small params whole on every rank.
    Optimizer offload keeps on the host the optimizer, the master's fp32 grad and (ZeRO-3) the grad
    partition itself; ZeRO-1/2 also a params-partition copy and two staging buffers of the largest param."""
    d = WORLD
    part = 4 * num_params // d
    optimizer = 8 * num_params if stage == 0 else 12 * num_params // d
    out = {"params": 4 * num_params if stage < 3 else part, "grads": 0, "optimizer": optimizer,
           "params_host": 0, "grads_host": 0, "optimizer_host": 0}
    if stage == 3:
        out["grads"] = 4 * bucket + part
    if "optimizer" in offload:
        out["optimizer"], out["optimizer_host"] = 0, optimizer
        if stage == 3:
            out["grads"], out["grads_host"] = 4 * bucket, 2 * part
        else:
            out["grads"], out["grads_host"], out["params_host"] = 4 * largest, part + 4 * largest, part
    if "param" in offload:
        out["params"], out["params_host"] = 0, part
    if stage == 3:
        out["params"] += 4 * persistent
    return out


def test_memory_line_shows_the_bytes_deepspeed_holds(configs, runs):
    from course_lib.model import GPTModel

    params = list(GPTModel(gpt_config_from_args(parse_args(MODEL))).parameters())
    n, largest = sum(p.numel() for p in params), max(p.numel() for p in params)
    persistent = sum(p.numel() for p in params if p.numel() <= THRESHOLD)
    for name, (config, stage) in configs[0].items():
        if "bf16" in name:
            continue
        zero = config["zero_optimization"]
        offload = {k for k in ("optimizer", "param") if f"offload_{k}" in zero}
        want = _expected_bytes(n, persistent, largest, stage, offload, zero.get("reduce_bucket_size", 500_000_000))
        where = "nvme" if "nvme" in name else "host"
        for rank, r in enumerate(runs):
            assert r[name]["state_bytes"] == want, (name, rank, r[name]["state_bytes"], want)
            (mem, *_) = parse_log(r[name]["log"]).memory
            assert mem["rank"] == rank and mem["source"] == deepspeed_engine.MEMORY_SOURCE
            assert mem["params_bytes"] == want["params"] and mem[f"optimizer_on_{where}_bytes"] == want["optimizer_host"]
            assert mem[f"grads_on_{where}_bytes"] == want["grads_host"]
            assert mem["allocated_mb"] == pytest.approx((want["params"] + want["grads"] + want["optimizer"]) / 2 ** 20,
                                                        abs=0.006)


def test_nvme_offload_runs_or_is_refused_in_one_line(configs, tmp_path):
    """With libaio's headers DeepSpeed's async_io op builds and ZeRO-3 swaps to files (the launch above
    ran it); without them the trainer refuses before any rank starts."""
    if "zero3_nvme" in configs[0]:
        missing = tmp_path / "missing.json"
        missing.write_text(json.dumps(_nvme_config(tmp_path / "no-such-folder")))
        with pytest.raises(ValueError, match=r"nvme_path=.*no-such-folder is not a folder") as e:
            validate_args(parse_args(MODEL + ["--deepspeed-config", str(missing)]), WORLD, check_memory=False)
    else:
        path = tmp_path / "nvme.json"
        path.write_text(json.dumps(_nvme_config(tmp_path)))
        with pytest.raises(ValueError, match="needs DeepSpeed's async_io op.*apt-get install libaio-dev") as e:
            validate_args(parse_args(MODEL + ["--deepspeed-config", str(path)]), WORLD, check_memory=False)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("config,extra,message", [
    (CONFIGS["zero1"][0], ["--tensor-model-parallel-size", "2"],
     "tensor-model-parallel-size=2 with --deepspeed-config: DeepSpeed runs one process per data-parallel rank"),
    (CONFIGS["zero1"][0], ["--use-distributed-optimizer"], "--use-distributed-optimizer with --deepspeed-config"),
    (CONFIGS["zero1"][0], ["--micro-batch-size", "4"],
     "micro_batch_size=4 disagrees with train_micro_batch_size_per_gpu=2"),
    ({**BATCH, "train_batch_size": 6}, [], r"train_batch_size=6 != 2 x 1 x 2 .* DP \(2\)"),
    ({**BATCH, "zero_optimization": {"stage": 3, "stage3_prefetch_bucket": 5}}, [],
     "zero_optimization.stage3_prefetch_bucket is not a key .* did you mean zero_optimization.stage3_prefetch_bucket_size"),
    ({**BATCH, "gradient_accumulation_steps": 0}, [], "gradient_accumulation_steps=0 .* is not > 0"),
    ({**BATCH, "tensorboard": {"enabled": "maybe"}}, [], "deepspeed-config rejected by DeepSpeed: ValidationError"),
])
def test_bad_configs_fail_in_one_line(tmp_path, config, extra, message):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message) as e:
        validate_args(parse_args(MODEL + extra + ["--deepspeed-config", str(path)]), WORLD, check_memory=False)
    assert "\n" not in str(e.value)


def test_fp16_runs_only_where_deepspeeds_accelerator_has_it(tmp_path):
    from deepspeed.accelerator import get_accelerator

    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**BATCH, "fp16": {"enabled": True}}))
    argv = parse_args(MODEL + ["--deepspeed-config", str(path)])
    if get_accelerator().is_fp16_supported():
        assert validate_args(argv, WORLD, check_memory=False).namespace().fp16
    else:
        with pytest.raises(ValueError, match=r"fp16.enabled=true: DeepSpeed's cpu accelerator has no fp16"):
            validate_args(argv, WORLD, check_memory=False)


def test_duplicate_keys_are_refused(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_batch_size": 8, "train_batch_size": 4}')
    with pytest.raises(ValueError, match="the key 'train_batch_size' appears twice"):
        validate_args(parse_args(MODEL + ["--deepspeed-config", str(path)]), WORLD, check_memory=False)


def test_real_torchrun_prints_megatron_lines_that_report_reads(tmp_path, capfd):
    """``python -m course_lib train --nproc-per-node 2 --deepspeed-config`` (torchrun): the seed's
    shape of config -- ZeRO-3, CPU offload, buckets, prefetch, clipping, the optimizer block -- with
    the losses of one process, the iteration lines, every rank's memory line and the record row."""
    config = {**BATCH, "gradient_clipping": 1.0, "optimizer": ADAMW,
              "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                                    "reduce_bucket_size": 3000, "stage3_prefetch_bucket_size": 2000,
                                    "stage3_max_live_parameters": 10000,
                                    "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    start = time.perf_counter()
    assert run(parser.parse_args(MODEL + ["--nproc-per-node", "2", "--deepspeed-config", str(path)])) == 0
    print(f"\n[deepspeed] torchrun run: {time.perf_counter() - start:.1f} s")
    log = parse_log(capfd.readouterr().out)
    one = train_single_process(parse_args(MODEL + _bridge_flags(config)))
    assert [it["iteration"] for it in log.iterations] == [1, 2, 3]
    l1, l2, l3 = one["lm_loss"]       # Megatron 0.16 logs iteration 1, then averages since the last reset
    assert _rel([it["lm_loss"] for it in log.iterations], [l1, (l1 + l2) / 2, l3]) < 2e-6     # :E prints 7 digits
    assert all(it["global_batch_size"] == 8 and it["consumed_samples"] == 8 * it["iteration"] for it in log.iterations)
    assert {(m["rank"], m["iteration"]) for m in log.memory} == {(0, 1), (0, 2), (1, 1), (1, 2)}
    assert all(m["optimizer_bytes"] == 0 and m["optimizer_on_host_bytes"] > 0 for m in log.memory)
    assert log.config["dp"] == 2 and log.config["num_microbatches"] == 2
    row = record_row(log, "DeepSpeed ZeRO-3 + offload")
    assert (row["TP"], row["PP"], row["DP"], row["micro-batches"]) == (1, 1, 2, 2) and row["step time (ms)"] > 0
