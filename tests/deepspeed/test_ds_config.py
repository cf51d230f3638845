"""The ds_config.json bridge (course_lib.deepspeed.config; ``python -m course_lib ds-config FILE``).

Expected flags are written from the mapping in the module docstring (ZeRO-1 = distributed optimizer,
ZeRO-2/3 = Megatron-FSDP optim_grads / optim_grads_params) and Megatron's validate_args rules; expected
bytes from ZeRO's 2 + 2 + K, DeepSpeed's estimator formulas and Megatron's dist_optimizer.md table,
written out here (tests/deepspeed/test_ds_schema.py and test_ds_memory.py check the verdicts and the
estimators against DeepSpeed itself). The flag table is
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
from course_lib.deepspeed import config as dsc
from course_lib.deepspeed import memory as ds_memory

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
    assert "--overlap-grad-reduce" in flags and "--overlap-param-gather" in flags    # stage 3: one stream for both
    assert flags["--ddp-bucket-size"] == 500_000_000 and flags["--suggested-communication-unit-size"] == 50_000_000
    assert "--bf16" in flags and "--fp16" not in flags
    assert flags["--micro-batch-size"] == 4 and flags["--global-batch-size"] == 256 and t.dp == 256 // (4 * 8)
    assert (flags["--adam-beta1"], flags["--adam-beta2"], flags["--lr"]) == (0.9, 0.95, 3e-4)
    unmapped = dict(t.unmapped)
    assert "no equivalent" in unmapped["zero_optimization.offload_param.device"]
    assert "zero_optimization.stage3_param_persistence_threshold" in unmapped
    assert "zero_optimization.contiguous_gradients" in unmapped and "wall_clock_breakdown" in unmapped
    assert set(flags) <= set(dsc.MEGATRON_FLAGS)
    semantics = dict(t.semantics)
    assert {"weight decay", "overlap_comm", "param persistence"} <= set(semantics)
    assert "offload_param" not in semantics and "fp16 loss scale" not in semantics    # stage 3, bf16
    # bytes per GPU, ZeRO-3 over d = 8: the paper's 16/d, all of it on the host with both offloads
    b = dsc.state_bytes(t, N, 8, largest_layer=4e8)
    gpu, host = b["paper"]
    assert gpu.total == 0 and host.total == pytest.approx(16 * N / 8)
    assert b["deepspeed"].gpu == 4 * 4e8 and b["deepspeed"].host == int(18 * N * 1.5)   # 4L; 18 x 1.5 per node
    assert flags["--megatron-fsdp-main-grads-dtype"] == "fp32"   # offload_optimizer: fp32 grad partitions on the host
    gpu, host = b["megatron_gpu"], b["megatron_host"]
    assert (gpu.weights, gpu.grads, gpu.optimizer) == pytest.approx((2 * N / 8, 4 * N / 8, 0))
    # HybridDeviceOptimizer: fp32 main params, Adam's moments and an fp32 grad copy on the host, 16 bytes over d
    assert (host.grads, host.optimizer) == pytest.approx((4 * N / 8, 12 * N / 8)) and host.total == pytest.approx(
        16 * N / 8)
    # without the flag Megatron-FSDP keeps bf16 grads (its default, auto = the param dtype): 2 bytes over d
    auto_gpu, _ = ds_memory.megatron_bytes(3, N, 8, "bf16", offload_optimizer=True)
    assert auto_gpu.grads == pytest.approx(2 * N / 8)


def test_zero1_fp16_becomes_the_distributed_optimizer_with_deepspeeds_loss_scale():
    t = dsc.translate(dsc.load(ZERO1, dp=8), dp=8)
    flags = _flags(t)
    assert "--use-distributed-optimizer" in flags and "--use-megatron-fsdp" not in flags
    assert flags["--initial-loss-scale"] == 2 ** 16            # DeepSpeed's default power 16, not Megatron's 2**32
    assert (flags["--loss-scale-window"], flags["--hysteresis"], flags["--min-loss-scale"]) == (500, 2, 1)
    assert "--loss-scale" not in flags                         # loss_scale 0 = dynamic
    assert flags["--global-batch-size"] == 2 * 4 * 8 and flags["--ddp-bucket-size"] == 200_000_000
    assert "--overlap-grad-reduce" in flags and "--overlap-param-gather" not in flags   # ZeRO-1 gathers after the step
    assert "window + 1" not in dict(t.semantics)["fp16 loss scale"] and "500 + 1 clean steps" in dict(
        t.semantics)["fp16 loss scale"]
    b = dsc.state_bytes(t, N, 8)
    assert b["paper"][0].total == pytest.approx((4 + 12 / 8) * N)       # ZeRO stage 1: 4 + K/d
    assert b["deepspeed"] is None                                      # no estimator for stage 1 in DeepSpeed
    assert b["megatron"].total == pytest.approx((4 + 16 / 8) * N)        # dist_optimizer.md: 16-bit grads 4 + 16/d


def test_hf_auto_batch_is_refused_as_deepspeed_does_and_other_autos_fall_back_to_defaults(tmp_path):
    with pytest.raises(ValueError, match='train_batch_size="auto" is the Hugging Face Trainer\'s placeholder'):
        dsc.load(AUTO)
    config = {**json.loads(AUTO.read_text()), "train_batch_size": 64, "train_micro_batch_size_per_gpu": 2,
              "gradient_accumulation_steps": 4}
    t = dsc.translate(dsc.parse(config))
    flags = _flags(t)
    assert flags["--data-parallel-sharding-strategy"] == "optim_grads" and "--overlap-grad-reduce" not in flags
    assert flags["--ddp-bucket-size"] == 200_000_000            # allgather bucket, reduce bucket is "auto"
    assert t.precision == "fp32" and t.dp == 8                  # bf16 "auto" dropped: DeepSpeed's default (off)
    unmapped = dict(t.unmapped)
    for key in ("bf16.enabled", "zero_optimization.reduce_bucket_size"):
        assert '"auto" is dropped by DeepSpeed' in unmapped[key], key
    assert "nvme" in unmapped["zero_optimization.offload_optimizer.device"]
    assert "zero_optimization.round_robin_gradients" in unmapped
    text = dsc.report(t)
    assert "model states per GPU: pass --num-params N" in text
    assert all("\n" not in reason for _, reason in t.unmapped)


def test_stage_0_overlap_only_reduces_and_stage_2_without_offload():
    t = dsc.translate(dsc.parse({"zero_optimization": {"stage": 0, "overlap_comm": True}}))
    assert _flags(t) == {"--overlap-grad-reduce": None}          # --overlap-param-gather needs a sharded optimizer
    t2 = dsc.translate(dsc.parse({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True, "loss_scale": 128}}))
    assert _flags(t2)["--loss-scale"] == 128 and "--initial-loss-scale" not in _flags(t2)
    b = dsc.state_bytes(t2, 1000, 4)
    assert b["paper"][0].total == pytest.approx(2 * 1000 + 14 * 1000 / 4)   # ZeRO-2: 2 + (2 + K)/d
    assert b["deepspeed"].gpu == 2 * 1000 + 18 * 1000 // 4                   # + the fp32 grad partition 4/d
    # no offload: DeepSpeed's grad partitions are fp16 (the model dtype), Megatron-FSDP's auto too: nothing printed;
    # fp16 grads 2 + main params and moments 12, / d
    assert "--megatron-fsdp-main-grads-dtype" not in _flags(t2) and "gradient dtype" in dict(t2.semantics)
    assert b["megatron"].total == pytest.approx(2 * 1000 + 14 * 1000 / 4)


def test_overlap_comm_is_on_by_default_at_stage_3_and_offload_param_is_ignored_below_it():
    three = dsc.translate(dsc.parse({"zero_optimization": {"stage": 3}}))
    assert {"--overlap-grad-reduce", "--overlap-param-gather"} <= set(_flags(three))
    assert "DeepSpeed's default at stage 3" in dict((k, r) for k, _, r in three.why)["zero_optimization.overlap_comm"]
    off = dsc.translate(dsc.parse({"zero_optimization": {"stage": 3, "overlap_comm": "false"}}))   # read as false
    assert "--overlap-grad-reduce" not in _flags(off)
    two = dsc.translate(dsc.parse({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}))
    assert two.offload_param is None and "ignores it below stage 3" in dict(two.semantics)["offload_param"]
    assert "--overlap-grad-reduce" not in _flags(two)
    old = dsc.translate(dsc.parse({"zero_optimization": {"stage": 2, "cpu_offload": True}}))
    assert "--optimizer-cpu-offload" in _flags(old) and old.offload_optimizer == "cpu"


def test_only_train_batch_size_gives_the_micro_batch_deepspeed_derives(tmp_path):
    t = dsc.translate(dsc.parse({"train_batch_size": 256}), dp=8)
    assert _flags(t)["--micro-batch-size"] == 32 and _flags(t)["--global-batch-size"] == 256     # 256 // 8, 1 step
    without_dp = dsc.translate(dsc.parse({"train_batch_size": 256}))
    assert "--micro-batch-size" not in _flags(without_dp)
    assert "pass --dp" in dict(without_dp.unmapped)["train_micro_batch_size_per_gpu"]


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


def test_cli_prints_flags_semantics_bytes_and_unmapped(capsys):
    assert main(["ds-config", str(ZERO3), "--num-params", "7.5e9", "--largest-layer", "4e8"]) == 0
    out = capsys.readouterr().out
    assert "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params" in out
    assert "ZeRO paper (2 + 2 + 12 per parameter): per GPU weights 0 kB" in out and "host 120 GB per node" in out
    assert "estimate_zero3_model_states_mem_needs: per GPU 1.6 GB, host 202 GB per node" in out
    assert "+ × 1.5, DeepSpeed's additional buffer factor" in out and "(4L): 1.6 GB per GPU" in out
    assert "not the same in DeepSpeed and Megatron:" in out and "without a Megatron-LM equivalent:" in out
    assert "python -m course_lib train --nproc-per-node 8 --use-megatron-fsdp" in out


BATCH = '"train_batch_size": 8, '


@pytest.mark.parametrize("text, match", [
    ('{"a": ', "not valid JSON"),
    ('[1, 2]', "not a JSON object"),
    ('{"train_batch_size": 8, "train_batch_size": 4}', "the key 'train_batch_size' appears twice"),
    ('{"train_batch_size": NaN}', "NaN is not a JSON number"),
    ('{' + BATCH + '"zero_optimization": {"stage": 3, "overlap_com": true}}',
     "zero_optimization.overlap_com is not a key .*did you mean zero_optimization.overlap_comm"),
    ('{' + BATCH + '"zero_optimization": {"stage": "three"}}', 'zero_optimization.stage="three" is not 0, 1, 2 or 3'),
    ('{' + BATCH + '"zero_optimization": {"stage": 5}}', "zero_optimization.stage=5"),
    ('{' + BATCH + '"zero_optimization": {"overlap_comm": 2}}', "zero_optimization.overlap_comm=2 is not true or false"),
    ('{' + BATCH + '"zero_optimization": {"offload_optimizer": {"device": "gpu"}}}',
     'offload_optimizer.device="gpu" is not "cpu", "nvme" or "none"'),
    ('{' + BATCH + '"zero_optimization": {"offload_optimizer": {"max_in_cpu": 5}}}',
     "offload_optimizer.max_in_cpu is not a key .* the other offload block, offload_param"),
    ('{' + BATCH + '"zero_optimization": {"offload_param": {"ratio": 0.5}}}',
     "offload_param.ratio is not a key .* the other offload block, offload_optimizer"),
    ('{' + BATCH + '"zero_optimization": {"reduce_bucket_size": 2.5}}', "reduce_bucket_size=2.5 is not a whole number"),
    ('{' + BATCH + '"zero_optimization": {"reduce_bucket_size": 0}}', "reduce_bucket_size=0 is not > 0"),
    ('{' + BATCH + '"bf16": {"enabled": true}, "fp16": {"enabled": true}}', "both true"),
    ('{' + BATCH + '"bf16": true}', "bf16=true is not an object"),
    ('{' + BATCH + '"elasticity": {}}', "elasticity is refused by DeepSpeed 0.19.8: elastic training was removed"),
    ('{' + BATCH + '"amp": {"enabled": true}}', "amp is refused by DeepSpeed 0.19.8"),
    ('{' + BATCH + '"sparse_gradients": true}', "sparse_gradients is refused"),
    ('{"train_batch_size": 8, "gradient_accumulation_steps": 0}', "DeepSpeed divides by zero"),
    ('{"train_batch_size": -8}', "train_batch_size=-8 .* is not > 0"),
    ('{"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": -1}', "is not > 0"),
    ('{"zero_optimization": {"stage": 3}}', "DeepSpeed needs train_batch_size or train_micro_batch_size_per_gpu"),
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


def test_what_deepspeed_accepts_the_bridge_reads_as_deepspeed_does(tmp_path, capsys):
    """A typo at the top level is ignored by DeepSpeed (the bridge says so); "3", "yes", 5e8 are read as
    DeepSpeed reads them; betas DeepSpeed's parser passes but no optimizer takes are listed, not translated."""
    f = tmp_path / "ds_config.json"
    f.write_text('{"train_batch_size": 8, "zero_optimisation": {"stage": 3}, "zero_optimization": {"stage": "2", '
                 '"overlap_comm": "yes", "reduce_bucket_size": 5e8}, "optimizer": {"type": "AdamW", '
                 '"params": {"betas": [0.9]}}}')
    assert main(["ds-config", str(f)]) == 0
    out = capsys.readouterr().out
    assert "ZeRO stage 2" in out and "--overlap-grad-reduce" in out and "--ddp-bucket-size 500000000" in out
    assert "zero_optimisation: ignored: DeepSpeed 0.19.8 does not read this key (silently); did you mean " \
           "zero_optimization?" in out
    assert "optimizer.params.betas: [0.9]: DeepSpeed's parser takes it, its optimizer refuses it" in out
    assert "--adam-beta1" not in out


def test_a_sizing_model_gives_the_parameters_per_gpu(capsys):
    from course_lib import sizing

    m = sizing.PRESETS["GPT-3 175B"]["model"]
    stages = sizing.parameters_per_stage(m.num_layers, m.hidden_size, m.vocab_size, m.seq_length, m.num_heads, 8, 8)
    assert dsc.params_per_gpu("GPT-3 175B", 8, 8) == max(stages)
    assert main(["ds-config", str(ZERO3), "--model", "GPT-3 175B", "--tp", "8", "--pp", "8"]) == 0
    assert f"({max(stages):.4g} parameters per GPU's model, DP 8 on 1 node(s) of 8 GPUs, largest layer " in \
        capsys.readouterr().out
    assert main(["ds-config", str(ZERO3), "--model", "GPT-4"]) == 2
    assert "not a sizing preset" in capsys.readouterr().err
    assert main(["ds-config", str(ZERO3), "--model", "GPT-3 175B", "--num-params", "1e9"]) == 2


def test_dp_given_and_implied_must_agree(tmp_path):
    with pytest.raises(ValueError, match=r"train_batch_size=256 != 4 x 8 x 4 .* DP \(4\)"):
        dsc.translate(dsc.load(ZERO3, dp=4), dp=4)
    with pytest.raises(ValueError, match="does not exist"):
        dsc.load(tmp_path / "missing.json")


def _megatron_source(root: Path, path: str) -> str:
    """``path`` in the checkout ``root``, or at the verified main revision of a bare mirror ``root``."""
    if (root / path).is_file():
        return (root / path).read_text()
    if (root / "megatron").is_dir():      # a checkout of another revision: the table names main's files
        pytest.skip(f"{path} is not in {root}: the table is verified at {dict([dsc.VERIFIED_AT])['main'][:8]} (main)")
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
        if f != AUTO:                                        # the HF template DeepSpeed refuses (see above)
            dsc.translate(dsc.load(f, dp=8), dp=8)
