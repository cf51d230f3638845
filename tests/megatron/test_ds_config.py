"""The ds_config.json bridge (course_lib.megatron.ds_config; ``python -m course_lib ds-config FILE``).

Expected flags are written from the mapping in the module docstring (ZeRO-1 = distributed optimizer,
ZeRO-2/3 = Megatron-FSDP optim_grads / optim_grads_params) and Megatron's validate_args rules; expected
bytes from ZeRO's 2 + 2 + K and Megatron's dist_optimizer.md table, written out here. The flag table is
re-checked against a Megatron-LM checkout (or bare mirror) when MEGATRON_LM_DIR points to one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from course_lib.__main__ import main
from course_lib.megatron import ds_config as dsc

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
ZERO3 = FIXTURES / "ds_config_zero3_offload.json"
ZERO1 = FIXTURES / "ds_config_zero1_fp16.json"
AUTO = FIXTURES / "ds_config_zero2_hf_auto.json"
N = 7.5e9


def _flags(t) -> dict:
    return {f: v for f, v in t.flags}


def test_zero3_with_offload_becomes_megatron_fsdp():
    t = dsc.translate(dsc.load(ZERO3))
    flags = _flags(t)
    assert flags["--use-megatron-fsdp"] is None and flags["--data-parallel-sharding-strategy"] == "optim_grads_params"
    assert "--use-distributed-optimizer" in flags and flags["--ckpt-format"] == "fsdp_dtensor"   # FSDP v1's rules
    assert "--optimizer-cpu-offload" in flags and "--use-precision-aware-optimizer" in flags    # asserted together
    assert "--overlap-grad-reduce" in flags and "--overlap-param-gather" in flags
    assert flags["--ddp-bucket-size"] == 500_000_000 and flags["--suggested-communication-unit-size"] == 50_000_000
    assert "--bf16" in flags and "--fp16" not in flags
    assert flags["--micro-batch-size"] == 4 and flags["--global-batch-size"] == 256 and t.dp == 256 // (4 * 8)
    assert (flags["--adam-beta1"], flags["--adam-beta2"], flags["--lr"]) == (0.9, 0.95, 3e-4)
    unmapped = dict(t.unmapped)
    assert "no equivalent" in unmapped["zero_optimization.offload_param.device"]
    assert "zero_optimization.stage3_param_persistence_threshold" in unmapped
    assert "zero_optimization.contiguous_gradients" in unmapped and "wall_clock_breakdown" in unmapped
    assert set(flags) <= set(dsc.MEGATRON_FLAGS)
    # bytes per GPU, ZeRO-3 over d = 8: DeepSpeed (paper) 16/d; Megatron bf16 with fp32 grads 18/d
    b = dsc.state_bytes(t, N, 8)
    assert b["deepspeed"].total == pytest.approx(16 * N / 8)
    assert (b["megatron"].weights, b["megatron"].grads, b["megatron"].optimizer) == pytest.approx(
        (2 * N / 8, 4 * N / 8, 12 * N / 8))
    assert b["megatron_gpu"].total == pytest.approx(6 * N / 8)          # optimizer state on the host


def test_zero1_fp16_becomes_the_distributed_optimizer_with_deepspeeds_loss_scale():
    t = dsc.translate(dsc.load(ZERO1), dp=8)
    flags = _flags(t)
    assert "--use-distributed-optimizer" in flags and "--use-megatron-fsdp" not in flags
    assert flags["--initial-loss-scale"] == 2 ** 16            # DeepSpeed's default power 16, not Megatron's 2**32
    assert (flags["--loss-scale-window"], flags["--hysteresis"], flags["--min-loss-scale"]) == (500, 2, 1)
    assert "--loss-scale" not in flags                         # loss_scale 0 = dynamic
    assert flags["--global-batch-size"] == 2 * 4 * 8 and flags["--ddp-bucket-size"] == 200_000_000
    assert "--overlap-param-gather" in flags                   # allowed: the distributed optimizer is on
    b = dsc.state_bytes(t, N, 8)
    assert b["deepspeed"].total == pytest.approx((4 + 12 / 8) * N)       # ZeRO stage 1: 4 + K/d
    assert b["megatron"].total == pytest.approx((4 + 16 / 8) * N)        # dist_optimizer.md: 16-bit grads 4 + 16/d


def test_hf_auto_values_and_nvme_are_listed_one_line_each():
    t = dsc.translate(dsc.load(AUTO))
    flags = _flags(t)
    assert flags["--data-parallel-sharding-strategy"] == "optim_grads" and "--overlap-grad-reduce" not in flags
    assert flags["--ddp-bucket-size"] == 200_000_000            # allgather bucket, reduce bucket is "auto"
    unmapped = dict(t.unmapped)
    for key in ("bf16.enabled", "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                "zero_optimization.reduce_bucket_size"):
        assert '"auto"' in unmapped[key], key
    assert "nvme" in unmapped["zero_optimization.offload_optimizer.device"]
    assert "zero_optimization.round_robin_gradients" in unmapped
    text = dsc.report(t)
    assert "pass --num-params N and --dp D" in text
    assert all("\n" not in reason for _, reason in t.unmapped)


def test_stage_0_overlap_only_reduces_and_stage_2_without_offload():
    t = dsc.translate(dsc.parse({"zero_optimization": {"stage": 0, "overlap_comm": True}}))
    assert _flags(t) == {"--overlap-grad-reduce": None}          # --overlap-param-gather needs a sharded optimizer
    t2 = dsc.translate(dsc.parse({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "loss_scale": 128}}))
    assert _flags(t2)["--loss-scale"] == 128 and "--initial-loss-scale" not in _flags(t2)
    b = dsc.state_bytes(t2, 1000, 4)
    assert b["deepspeed"].total == pytest.approx(2 * 1000 + 14 * 1000 / 4)   # ZeRO-2: 2 + (2 + K)/d
    assert b["megatron"].total == pytest.approx(2 * 1000 + 18 * 1000 / 4)    # fp16 grads 2 + optimizer 16, / d


def test_course_trainer_takes_the_same_flags():
    from course_lib.training.arguments import parse_args

    t = dsc.translate(dsc.load(ZERO3))
    argv, left_out = dsc.course_flags(t)
    a = parse_args(argv)
    assert a.use_megatron_fsdp and a.data_parallel_sharding_strategy == "optim_grads_params" and a.bf16
    assert a.optimizer_cpu_offload and a.micro_batch_size == 4 and a.global_batch_size == 256
    assert a.ckpt_format == "fsdp_dtensor"   # what Megatron-FSDP asks for; the trainer accepts Megatron's formats
    assert set(left_out) == {"--suggested-communication-unit-size"}
    assert set(left_out) | {f for f in argv if f.startswith("--")} == set(_flags(t))


def test_cli_prints_flags_bytes_and_unmapped(capsys):
    assert main(["ds-config", str(ZERO3), "--num-params", "7.5e9"]) == 0
    out = capsys.readouterr().out
    assert "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params" in out
    assert "DeepSpeed ZeRO-3: " in out and "= 15 GB" in out and "host 11.2 GB" in out
    assert "without a Megatron-LM equivalent:" in out
    assert "python -m course_lib train --nproc-per-node 8 --use-megatron-fsdp" in out


@pytest.mark.parametrize("text, match", [
    ('{"a": ', "not valid JSON"),
    ('[1, 2]', "JSON object"),
    ('{"zero_optimisation": {}}', "unknown key 'zero_optimisation'.*did you mean 'zero_optimization'"),
    ('{"zero_optimization": {"stage": 3, "overlap_com": true}}', "'zero_optimization.overlap_com'"),
    ('{"zero_optimization": {"stage": "3"}}', "zero_optimization.stage must be an integer"),
    ('{"zero_optimization": {"stage": 5}}', "zero_optimization.stage=5"),
    ('{"zero_optimization": {"overlap_comm": "yes"}}', "zero_optimization.overlap_comm must be true or false"),
    ('{"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}', "offload_optimizer.device must be one of"),
    ('{"zero_optimization": {"reduce_bucket_size": 2.5}}', "reduce_bucket_size must be an integer"),
    ('{"bf16": {"enabled": true}, "fp16": {"enabled": true}}', "both true"),
    ('{"bf16": true}', "bf16 must be an object"),
    ('{"optimizer": {"params": {"betas": [0.9]}}}', "betas must be a list of two numbers"),
    ('{"train_batch_size": 100, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8}',
     "train_batch_size=100"),
])
def test_bad_configs_are_one_line_errors_naming_the_key(tmp_path, capsys, text, match):
    f = tmp_path / "ds_config.json"
    f.write_text(text)
    with pytest.raises(ValueError, match=match) as err:
        dsc.translate(dsc.load(f))
    assert "\n" not in str(err.value)
    assert main(["ds-config", str(f)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_sizing_model_gives_the_parameters_per_gpu(capsys):
    from course_lib import sizing

    m = sizing.PRESETS["GPT-3 175B"]["model"]
    stages = sizing.parameters_per_stage(m.num_layers, m.hidden_size, m.vocab_size, m.seq_length, m.num_heads, 8, 8)
    assert dsc.params_per_gpu("GPT-3 175B", 8, 8) == max(stages)
    assert main(["ds-config", str(ZERO3), "--model", "GPT-3 175B", "--tp", "8", "--pp", "8"]) == 0
    assert f"({max(stages):.4g} parameters, DP 8)" in capsys.readouterr().out
    assert main(["ds-config", str(ZERO3), "--model", "GPT-4"]) == 2
    assert "not a sizing preset" in capsys.readouterr().err
    assert main(["ds-config", str(ZERO3), "--model", "GPT-3 175B", "--num-params", "1e9"]) == 2


def test_dp_given_and_implied_must_agree(tmp_path):
    with pytest.raises(ValueError, match="--dp=4"):
        dsc.translate(dsc.load(ZERO3), dp=4)
    with pytest.raises(ValueError, match="does not exist"):
        dsc.load(tmp_path / "missing.json")


def _megatron_source(root: Path, path: str) -> str:
    if (root / path).is_file():
        return (root / path).read_text()
    rev = dict([dsc.VERIFIED_AT])["main"]
    return subprocess.run(["git", "--git-dir", str(root), "show", f"{rev}:{path}"], check=True,
                          capture_output=True, text=True).stdout


def test_every_printed_flag_has_a_verified_home():
    for flag, where in dsc.MEGATRON_FLAGS.items():
        path, _, owner = where.partition("::")
        assert path.startswith("megatron/") and owner, flag
        if "." in owner:        # a dataclass field turned into the flag by ArgumentGroupFactory
            assert owner.rsplit(".", 1)[1] == flag[2:].replace("-", "_"), flag
    root = os.environ.get("MEGATRON_LM_DIR")
    if not root:
        pytest.skip("set MEGATRON_LM_DIR to a Megatron-LM checkout (or bare mirror) to re-check the table")
    for flag, where in dsc.MEGATRON_FLAGS.items():
        path, _, owner = where.partition("::")
        text = _megatron_source(Path(root), path)
        if "." in owner:
            cls, field = owner.split(".")
            body = text.split(f"class {cls}", 1)[1]
            assert re.search(rf"^    {field}\s*:", body, re.M), flag
        else:
            body = text.split(f"def {owner}(", 1)[1].split("\ndef ", 1)[0]
            assert f"'{flag}'" in body, flag


def test_fixture_files_are_json_the_course_can_read():
    for f in sorted(FIXTURES.glob("ds_config*.json")):
        assert isinstance(json.loads(f.read_text()), dict)
        dsc.translate(dsc.load(f))
