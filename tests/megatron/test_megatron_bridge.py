"""course_lib.megatron: real Megatron-LM commands, the log parser (every format era), the record table."""

import argparse
import csv
import io
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from course_lib.megatron import (COLUMNS, NOT_MEGATRON_FLAGS, PREPROCESS_FLAGS, PRETRAIN_FLAGS,
                                 MegatronRun, gpu_config, megatron_command, preprocess_command,
                                 pretrain_args, record_table, run_tiny_gpt_script, setup_commands, sweep_script,
                                 to_csv, to_markdown)
from course_lib.topology.seed import SEED_SWEEP
from course_lib.training.logs import parse_log
from course_lib.launch import cluster
from course_lib.megatron import command as command_mod
from course_lib.megatron.command import SHARDING, MoESpec, cluster_launch, sharding_variants
from course_lib.megatron.flags import CHECKPOINT_FLAGS, MCORE_FIELDS, MOE_FLAGS, SHARDING_FLAGS, TORCHRUN_FLAGS
from course_lib.megatron import report as report_mod
from course_lib.rules import SP_WITHOUT_TP

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "megatron_logs"

# The flags verified by reading NVIDIA/Megatron-LM (git show <rev>:<file>), with where each is defined:
# at core_v0.15.3 (309ffca6a405) as add_argument(...) in megatron/training/arguments.py, and at main
# d98e8a64ddf3 (2026-08-22) as a config-dataclass field turned into a flag by ArgumentGroupFactory
# (field_name -> --field-name) or still as add_argument in arguments.py. All but the three flags of an
# uneven pipeline split also exist in megatron/arguments.py of core_v0.5.0 (0acc240ebd28).
VERIFIED = {
    # flag:                                   (core_v0.15.3 arguments.py function, main: file::Class.field | function)
    "--tensor-model-parallel-size":           ("_add_distributed_args", "model_parallel_config.py::ModelParallelConfig"),
    "--pipeline-model-parallel-size":         ("_add_distributed_args", "model_parallel_config.py::ModelParallelConfig"),
    "--context-parallel-size":                ("_add_distributed_args", "model_parallel_config.py::ModelParallelConfig"),
    "--sequence-parallel":                    ("_add_training_args", "model_parallel_config.py::ModelParallelConfig"),
    "--num-layers-per-virtual-pipeline-stage": ("_add_distributed_args", "arguments.py::_add_distributed_args"),
    "--num-virtual-stages-per-pipeline-rank": ("_add_distributed_args", "arguments.py::_add_distributed_args"),
    "--decoder-first-pipeline-num-layers":    ("_add_distributed_args", "arguments.py::_add_distributed_args"),
    "--decoder-last-pipeline-num-layers":     ("_add_distributed_args", "arguments.py::_add_distributed_args"),
    "--use-distributed-optimizer":            ("_add_distributed_args", "arguments.py::_add_distributed_args"),
    "--num-layers":                           ("_add_network_size_args", "transformer_config.py::TransformerConfig"),
    "--hidden-size":                          ("_add_network_size_args", "transformer_config.py::TransformerConfig"),
    "--num-attention-heads":                  ("_add_network_size_args", "transformer_config.py::TransformerConfig"),
    "--group-query-attention":                ("_add_network_size_args", "arguments.py::_add_network_size_args"),
    "--num-query-groups":                     ("_add_network_size_args", "transformer_config.py::TransformerConfig"),
    "--seq-length":                           ("_add_data_args", "arguments.py::_add_data_args"),
    "--max-position-embeddings":              ("_add_network_size_args", "arguments.py::_add_network_size_args"),
    "--micro-batch-size":                     ("_add_training_args", "training_config.py::TrainingConfig"),
    "--global-batch-size":                    ("_add_training_args", "training_config.py::TrainingConfig"),
    "--train-iters":                          ("_add_training_args", "training_config.py::TrainingConfig"),
    "--lr":                                   ("_add_learning_rate_args", "arguments.py::_add_learning_rate_args"),
    "--min-lr":                               ("_add_learning_rate_args", "arguments.py::_add_learning_rate_args"),
    "--lr-decay-style":                       ("_add_learning_rate_args", "training_config.py::SchedulerConfig"),
    "--lr-warmup-iters":                      ("_add_learning_rate_args", "training_config.py::SchedulerConfig"),
    "--weight-decay":                         ("_add_regularization_args", "arguments.py::_add_regularization_args"),
    "--clip-grad":                            ("_add_regularization_args", "arguments.py::_add_regularization_args"),
    "--hidden-dropout":                       ("_add_regularization_args", "transformer_config.py::TransformerConfig"),
    "--attention-dropout":                    ("_add_regularization_args", "transformer_config.py::TransformerConfig"),
    "--seed":                                 ("_add_initialization_args", "common_config.py::RNGConfig"),
    "--bf16":                                 ("_add_mixed_precision_args", "model_parallel_config.py::ModelParallelConfig"),
    "--fp16":                                 ("_add_mixed_precision_args", "model_parallel_config.py::ModelParallelConfig"),
    "--data-path":                            ("_add_data_args", "arguments.py::_add_data_args"),
    "--split":                                ("_add_data_args", "arguments.py::_add_data_args"),
    "--vocab-file":                           ("_add_tokenizer_args", "training_config.py::TokenizerConfig"),
    "--merge-file":                           ("_add_tokenizer_args", "training_config.py::TokenizerConfig"),
    "--tokenizer-type":                       ("_add_tokenizer_args", "training_config.py::TokenizerConfig"),
    "--log-interval":                         ("_add_training_args", "training_config.py::LoggerConfig"),
    "--log-throughput":                       ("_add_logging_args", "training_config.py::LoggerConfig"),
    "--eval-interval":                        ("_add_validation_args", "training_config.py::ValidationConfig"),
    "--eval-iters":                           ("_add_validation_args", "training_config.py::ValidationConfig"),
    "--transformer-impl":                     ("_add_transformer_engine_args", "transformer_config.py::TransformerConfig"),
}
VERIFIED_PREPROCESS = {"--input", "--output-prefix", "--json-keys", "--append-eod", "--workers",
                       "--tokenizer-type", "--vocab-file", "--merge-file"}  # tools/preprocess_data.py::get_args


# An uneven pipeline split with interleaving: 2 + 6 layers over PP 2, 2 chunks per rank.
UNEVEN_VPP = gpu_config(1, 2, vpp=2, decoder_first_pipeline_num_layers=2)


def _flags(cmd: str) -> list[str]:
    return [t for t in shlex.split(cmd.replace("\\\n", " ")) if t.startswith("--")]


def _variants():
    runs = [MegatronRun(), MegatronRun(precision="fp16", use_distributed_optimizer=True, transformer_impl="local"),
            MegatronRun(precision="fp32", log_throughput=False)]
    cfgs = [gpu_config(*SEED_SWEEP[n]) for n in SEED_SWEEP]
    cfgs += [gpu_config(2, 2, 2, sequence_parallel=True), gpu_config(1, 4, vpp=2), gpu_config(2, 2, vpp=2),
             gpu_config(2, 1, num_query_groups=4), UNEVEN_VPP, gpu_config(1, 4, decoder_first_pipeline_num_layers=1,
                                                                         decoder_last_pipeline_num_layers=1)]
    return [(c, r) for c in cfgs for r in runs]


# ---- flags ----------------------------------------------------------------------------------

def test_flag_table_is_the_verified_list():
    assert set(PRETRAIN_FLAGS) == set(VERIFIED)
    for flag, (v015, main) in PRETRAIN_FLAGS.items():
        assert v015 == f"megatron/training/arguments.py::{VERIFIED[flag][0]}", flag
        assert main.endswith(VERIFIED[flag][1]) or VERIFIED[flag][1] in main, flag
        if "Config." in main:  # dataclass era: the flag is the field name with '-' for '_'
            assert main.rsplit(".", 1)[1] == flag[2:].replace("-", "_"), flag
    assert set(PREPROCESS_FLAGS) == VERIFIED_PREPROCESS


def test_commands_use_only_verified_flags_and_every_verified_flag_is_used():
    used = set()
    for cfg, run in _variants():
        flags = _flags(megatron_command(cfg, run))
        assert len(flags) == len(set(flags)), "a flag printed twice"
        used |= set(flags)
        assert set(flags) - {"--nproc_per_node"} <= set(PRETRAIN_FLAGS)
        assert not set(flags) & set(NOT_MEGATRON_FLAGS)
    assert used - {"--nproc_per_node"} == set(PRETRAIN_FLAGS) - {"--hidden-dropout", "--attention-dropout"}
    pre = set(_flags(preprocess_command()))
    assert pre == set(PREPROCESS_FLAGS)
    assert "--workers" in pre      # required=True in tools/preprocess_data.py; the seed's command omits it


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_DIR"), reason="set MEGATRON_LM_DIR to a Megatron-LM checkout")
def test_flags_exist_in_a_megatron_checkout():
    """Re-check the table against a real checkout (either layout: add_argument or config dataclasses)."""
    root = Path(os.environ["MEGATRON_LM_DIR"])
    args_file = next(f for f in (root / "megatron/training/arguments.py", root / "megatron/arguments.py") if f.exists())
    args_py = args_file.read_text()
    dataclass_text = "\n".join(p.read_text() for p in [
        root / "megatron/core/model_parallel_config.py", root / "megatron/core/transformer/transformer_config.py",
        *sorted((root / "megatron/training/config").glob("*.py")), *sorted((root / "megatron/training").glob("*_config.py"))]
        if p.exists())
    excluded = " ".join(re.findall(r"exclude\s*=\s*\[(.*?)\]", args_py, re.S))
    newer = [*SHARDING_FLAGS, *MOE_FLAGS, *CHECKPOINT_FLAGS] if (root / "megatron/core/transformer/moe").exists() else []
    for flag in [*PRETRAIN_FLAGS, *newer]:
        field = flag[2:].replace("-", "_")
        literal = (re.search(rf"""['"]{re.escape(flag)}['"]""", args_py)
                   or re.search(rf"""arg_names["']:\s*\[["']{re.escape(flag)}["']""", dataclass_text))
        generated = ("ArgumentGroupFactory(" in args_py and re.search(rf"^    {field}\s*:", dataclass_text, re.M)
                     and not re.search(rf"""['"]{field}['"]""", excluded))
        assert literal or generated, flag
    pre = (root / "tools/preprocess_data.py").read_text()
    for flag in ("--input", "--output-prefix", "--json-keys", "--append-eod", "--workers"):
        assert f"'{flag}'" in pre, flag
    for flag in ("--tokenizer-type", "--vocab-file", "--merge-file"):   # written out, or via _add_tokenizer_args
        assert f"'{flag}'" in pre or "_add_tokenizer_args" in pre
    assert "'--virtual-pipeline-model-parallel-size'" not in args_py


# ---- commands -------------------------------------------------------------------------------

def _arg_dict(cmd):
    toks = shlex.split(cmd.replace("\\\n", " "))
    out, i = {}, 0
    while i < len(toks):
        if toks[i].startswith("--"):
            val = toks[i + 1] if i + 1 < len(toks) and not toks[i + 1].startswith("--") else None
            out[toks[i]] = val
            i += 2 if val is not None else 1
        else:
            i += 1
    return out


def test_megatron_command_for_seed_configs():
    d = _arg_dict(megatron_command(gpu_config(*SEED_SWEEP["D"])))
    assert megatron_command(gpu_config(2, 2)).startswith(
        "CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun --nproc_per_node 8 pretrain_gpt.py")
    assert d["--tensor-model-parallel-size"] == "2" and d["--pipeline-model-parallel-size"] == "2"
    assert "--context-parallel-size" not in d             # only printed when CP > 1
    assert (d["--num-layers"], d["--hidden-size"], d["--num-attention-heads"]) == ("8", "512", "8")  # seed model
    assert d["--seq-length"] == d["--max-position-embeddings"] == "1024"
    assert (d["--micro-batch-size"], d["--global-batch-size"]) == ("4", "64")
    assert d["--tokenizer-type"] == "GPT2BPETokenizer" and d["--split"] == "949,50,1"
    assert d["--data-path"] == "data/tiny/gpt_text_text_document"   # preprocess_data.py names it prefix_key_document
    assert "--bf16" in d
    f = _arg_dict(megatron_command(gpu_config(*SEED_SWEEP["F"], sequence_parallel=True)))
    assert f["--context-parallel-size"] == "2" and "--sequence-parallel" in f
    v = _arg_dict(megatron_command(gpu_config(1, 4, vpp=2)))
    assert v["--num-layers-per-virtual-pipeline-stage"] == "1"   # 8 layers / (4 stages x 2 chunks)
    assert _arg_dict(megatron_command(gpu_config(2, 2, vpp=2)))["--num-layers-per-virtual-pipeline-stage"] == "2"
    # an uneven split with interleaving: Megatron's validate_args refuses --num-layers-per-virtual-pipeline-stage
    u = _arg_dict(megatron_command(UNEVEN_VPP))
    assert u["--num-virtual-stages-per-pipeline-rank"] == "2" and u["--decoder-first-pipeline-num-layers"] == "2"
    assert "--num-layers-per-virtual-pipeline-stage" not in u
    r = _arg_dict(megatron_command(gpu_config(), MegatronRun(precision="fp32", use_distributed_optimizer=True)))
    assert "--bf16" not in r and "--fp16" not in r and "--use-distributed-optimizer" in r
    assert "--nproc_per_node 4" in megatron_command(gpu_config(2, 1, 1, 4, global_batch_size=16))


def test_one_renderer_of_the_layout_flags():
    """ParallelConfig.megatron_args is the layout's part of every pretrain_gpt.py command."""
    for cfg, run in _variants():
        layout = cfg.megatron_args()
        assert pretrain_args(cfg, run)[:len(layout)] == layout
        assert cfg.megatron_flags() == [x for f, v in layout for x in ([f] if v is None else [f, v])]


@pytest.mark.parametrize("kwargs,msg", [
    (dict(tp=3), "not divisible"),                                        # world 8 % (3*1*1)
    (dict(tp=16, nproc=16), "num_attention_heads=8 is not divisible by tensor-model-parallel-size=16"),
    (dict(pp=3, nproc=6), "num_layers=8 is not divisible by pipeline-model-parallel-size=3"),
    (dict(tp=2, micro_batch_size=3), "global_batch_size=64 is not divisible by micro_batch_size=3"),
    (dict(cp=2, seq_length=1022), "not divisible by 2"),
    (dict(vpp=2), "needs pipeline-model-parallel-size > 1"),
])
def test_bad_configs_are_one_line_value_errors(kwargs, msg):
    with pytest.raises(ValueError, match=re.escape(msg)) as e:
        megatron_command(gpu_config(**kwargs))
    assert "\n" not in str(e.value)


def test_command_level_rules(capsys):
    # Megatron's policy for SP with TP = 1 (the trainer's and the planner's too): off, said in one line
    assert "--sequence-parallel" not in megatron_command(gpu_config(sequence_parallel=True))
    assert _cli(command_mod, ["--sp"]) == 0
    out = capsys.readouterr().out
    assert f"# {SP_WITHOUT_TP}\n" in out and "--sequence-parallel" not in out
    with pytest.raises(ValueError, match="needs num_layers"):
        megatron_command({"world_size": 8, "tp": 2})
    with pytest.raises(ValueError, match="precision='fp8'"):
        MegatronRun(precision="fp8")
    with pytest.raises(ValueError, match="min_lr <= lr"):
        MegatronRun(lr=1e-4, min_lr=1e-3)
    assert megatron_command({"world_size": 8, "tp": 2, "num_layers": 8, "hidden_size": 512,
                             "num_attention_heads": 8, "seq_length": 256}).count("--") > 20


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_run_tiny_gpt_script_passes_the_same_flags(tmp_path):
    """Run the generated run_tiny_gpt.sh with a stub torchrun and compare its argv with megatron_command."""
    script = tmp_path / "run_tiny_gpt.sh"
    script.write_text(run_tiny_gpt_script())
    script.chmod(0o755)
    stub = tmp_path / "bin" / "torchrun"
    stub.parent.mkdir()
    stub.write_text('#!/usr/bin/env bash\necho "CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS"\n'
                    'for a in "$@"; do printf "%s\\n" "$a"; done\n')
    stub.chmod(0o755)
    env_base = {"PATH": f"{stub.parent}:{os.environ['PATH']}"}
    cases = [(dict(TP=tp, PP=pp, CP=cp), gpu_config(tp, pp, cp)) for tp, pp, cp in SEED_SWEEP.values()]
    cases += [(dict(TP=2, PP=2, CP=2, SP=1), gpu_config(2, 2, 2, sequence_parallel=True)),
              (dict(TP=1, PP=4, VPP=2), gpu_config(1, 4, vpp=2)),
              (dict(TP=1, SP=1), gpu_config(1, sequence_parallel=True))]     # SP off at TP 1, as in Megatron
    for env, cfg in cases:
        env = {**env_base, "GPUS": "8", **{k: str(v) for k, v in env.items()}}
        out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert ("has no effect with TP=1" in out.stderr) == (env.get("SP") == "1" and env["TP"] == "1")
        lines = out.stdout.splitlines()
        assert lines[0].startswith(f"world 8 = TP {cfg.tp} x PP {cfg.pp} x CP {cfg.cp} x DP {cfg.dp};")
        assert lines[1] == "CUDA_DEVICE_MAX_CONNECTIONS=1"
        argv = lines[2:]
        expected = ["--nproc_per_node", "8", "pretrain_gpt.py"]
        expected += [x for f, v in pretrain_args(cfg) for x in ([f] if v is None else [f, v])]
        assert argv == expected, env
    bad = subprocess.run(["bash", str(script)], env={**env_base, "GPUS": "8", "TP": "3"},
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip() == "run_tiny_gpt.sh: GPUS=8 is not divisible by TP*PP*CP=3; DP must be a whole number"
    bad = subprocess.run(["bash", str(script)], env={**env_base, "GPUS": "8", "PP": "8", "TP": "1"},
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 0  # 8 layers over 8 stages is legal
    bad = subprocess.run(["bash", str(script)], env={**env_base, "GPUS": "6", "PP": "3"},
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and "num-layers=8 is not divisible by PP=3" in bad.stderr


def test_sweep_and_setup_text():
    sweep = sweep_script()
    for name, (tp, pp, cp) in SEED_SWEEP.items():
        assert f'"{name} {tp} {pp} {cp}"' in sweep
    assert 'tee "logs/day22/${NAME}.log"' in sweep and "python -m course_lib report logs/day22/*.log" in sweep
    setup = setup_commands()
    assert "python -m course_lib megatron-cmd --export-corpus data/tiny/corpus.jsonl" in setup
    assert preprocess_command() in setup


def _cli(module, argv):
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return module.run(p.parse_args(argv))


def test_megatron_cmd_cli(capsys, tmp_path):
    assert _cli(command_mod, ["--tp", "2", "--pp", "2", "--cp", "1", "--nproc", "8"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# world 8 = TP 2 x PP 2 x CP 1 x DP 2 (DP derived); 8 micro-batches of 4 per step")
    assert megatron_command(gpu_config(2, 2)) in out
    assert _cli(command_mod, ["--config", "F", "--sp"]) == 0
    assert "--context-parallel-size 2" in capsys.readouterr().out
    assert _cli(command_mod, ["--show", "all", "--config", "E", "--vpp", "2"]) == 0
    out = capsys.readouterr().out
    assert "#!/usr/bin/env bash" in out and "tools/preprocess_data.py" in out and "for cfg in" in out
    with pytest.raises(ValueError, match="num_attention_heads=8 is not divisible"):
        _cli(command_mod, ["--tp", "16", "--nproc", "16"])
    assert _cli(command_mod, ["--export-corpus", str(tmp_path / "c.jsonl")]) == 0
    assert (tmp_path / "c.jsonl").read_text().count("\n") > 100


# ---- parse_log: fixtures of every era ---------------------------------------------------------

def test_fixture_headers_cite_their_megatron_revision():
    for path in FIXTURES.glob("*.log"):
        head = path.read_text().splitlines()[0]
        assert head.startswith("# Fixture:"), path.name
        if not path.name.startswith("course"):
            assert re.search(r"NVIDIA/Megatron-LM \S+ \(commit [0-9a-f]{12}\)", head), path.name


def test_parse_pre_0_6_log():
    p = parse_log((FIXTURES / "core_v0.5.0_tp2_pp2_dp2.log").read_text())
    assert p.era == "pre-0.6"
    assert {k: p.config[k] for k in ("world_size", "dp", "cp", "tp", "pp")} == \
        {"world_size": 8, "dp": 2, "cp": 1, "tp": 2, "pp": 2}
    assert (p.config["seq_length"], p.config["micro_batch_size"], p.config["global_batch_size"]) == (1024, 4, 64)
    assert p.config["num_microbatches"] == 8
    assert [it["iteration"] for it in p.iterations] == [10, 20, 30, 40, 50]
    first = p.iterations[0]
    assert first["timestamp"] is None and first["train_iters"] == 50 and first["consumed_samples"] == 640
    assert first["elapsed_ms"] == 1450.3 and first["learning_rate"] == 3.0e-4 and first["global_batch_size"] == 64
    assert first["lm_loss"] == 10.51234 and first["loss_scale"] == 1.0 and first["grad_norm"] == 12.345
    assert first["skipped_iterations"] == 0 and first["nan_iterations"] == 0 and "throughput" not in first
    assert p.loss_curve()[-1] == (50, 6.2001)
    assert [m["rank"] for m in p.memory] == [0, 1, 4, 5]   # DP-rank-0 ranks of TP2 x PP2 x DP2
    m0 = p.memory[0]
    assert m0["iteration"] == 10 and m0["allocated_mb"] == 1229312000 / 2**20
    assert m0["max_allocated_mb"] == 3071557632 / 2**20 == 2929.265625   # raw float, not rounded
    assert p.max_memory_by_rank() == {0: 2929.265625, 1: 2929.265625, 4: 2784493568 / 2**20, 5: 2784493568 / 2**20}
    assert p.theoretical_memory == {"weight_and_optimizer_mb": 716.53, "activation_mb": 1536.0, "total_mb": 2252.53}
    assert p.parameters[0] == {"tensor": 0, "pipeline": 0, "num_parameters": 19531264}
    assert p.step_time_ms() == pytest.approx((811.0 + 812.4) / 2)   # median of 812.4, 809.9, 815.2, 811.0


def test_parse_0_6_to_0_15_log():
    p = parse_log((FIXTURES / "core_v0.15.3_tp4_pp1_dp2.log").read_text())
    assert p.era == "0.6-0.15"
    assert (p.config["tp"], p.config["pp"], p.config["cp"], p.config["dp"]) == (4, 1, 1, 2)
    assert p.config["hierarchical_cp_sizes"] is None
    it = p.iterations[1]
    assert it["timestamp"] == "2025-10-04 17:56:47" and it["iteration"] == 20 and it["throughput"] == 32.6
    assert it["learning_rate"] == 2.2e-4 and it["lm_loss"] == 8.25
    assert [m["rank"] for m in p.memory] == [0, 1, 2, 3] and p.memory[3]["max_allocated_mb"] == 2113 + 1536 / 2**20
    assert p.validation == [{"iteration": 40, "label": "iteration 40", "lm_loss_value": 6.75,
                             "lm_loss_ppl": 854.0588}]
    assert p.step_time_ms() == 641.0


def test_parse_0_16_log():
    p = parse_log((FIXTURES / "core_v0.16.0_tp2_pp2_cp2.log").read_text())
    assert p.era == "0.16+"
    assert (p.config["tp"], p.config["pp"], p.config["cp"], p.config["dp"]) == (2, 2, 2, 1)
    assert p.config["sequence_parallel"] is True and p.config["num_microbatches"] == 16
    assert [it["iteration"] for it in p.iterations] == [1, 10, 20, 30]
    assert p.iterations[0]["timestamp"] == "2026-02-26 04:05:51.004213" and p.iterations[0]["elapsed_ms"] == 5321.4
    assert len(p.memory) == 16 and {m["iteration"] for m in p.memory} == {1, 10}
    assert p.memory[0]["max_allocated_mb"] == 1406.25 and p.memory[8]["max_allocated_mb"] == 1728.0
    assert p.max_memory_by_rank()[1] == 1728.0 and p.max_memory_by_rank()[7] == 1688.0
    assert p.step_time_ms() == 901.7     # iteration 1 (init overhead) excluded: median of 902.5, 897.1, 901.7


def test_parse_v2_log_and_course_log():
    p = parse_log((FIXTURES / "v2.6_tp2_pp2_dp2.log").read_text())
    assert (p.config["world_size"], p.config["dp"], p.config["tp"], p.config["pp"], p.config["cp"]) == (8, 2, 2, 2, 1)
    assert p.iterations[0]["skipped_iterations"] == 2 and p.iterations[0]["loss_scale"] == 4096.0
    assert p.max_memory_by_rank() == {0: 2900.25, 1: 2900.25, 4: 2700.75, 5: 2700.75}
    c = parse_log((FIXTURES / "course_cpu_tp2_pp2_dp2.log").read_text())
    assert c.era == "0.16+" and c.config["num_microbatches"] == 16 // (2 * 2)
    assert {m["source"] for m in c.memory} == {"tracked tensor bytes"}
    assert c.max_memory_by_rank() == {0: 3.75, 1: 3.75, 4: 4.25, 5: 4.25}
    assert c.step_time_ms() == pytest.approx(95.9)   # median of 95.5, 96.3, 94.7, 97.0


@pytest.mark.parametrize("line,expected", [
    # v1.0 megatron/arguments.py
    ("using world size: 8 and model-parallel size: 2 ", dict(world_size=8, tp=2, pp=1, cp=1, dp=4)),
    # v2.6 megatron/arguments.py::parse_args
    ("using world size: 16, data-parallel-size: 2, tensor-model-parallel size: 4, pipeline-model-parallel size: 2 ",
     dict(world_size=16, dp=2, tp=4, pp=2, cp=1)),
    # core_v0.4.0 .. core_v0.8.0: no comma after the CP size
    ("using world size: 8, data-parallel size: 1, context-parallel size: 2 tensor-model-parallel size: 2, "
     "pipeline-model-parallel size: 2 ", dict(world_size=8, dp=1, cp=2, tp=2, pp=2)),
    # core_v0.9.0 .. core_v0.13.x: encoder sizes must not be read as TP/PP
    ("using world size: 8, data-parallel size: 2, context-parallel size: 1, tensor-model-parallel size: 2, "
     "encoder-tensor-model-parallel size: 0, pipeline-model-parallel size: 2, encoder-pipeline-model-parallel size: 0",
     dict(world_size=8, dp=2, cp=1, tp=2, pp=2)),
    # the same with an encoder and no DP field: DP derived over (TP x PP + encoder TP x encoder PP) x CP ranks
    ("using world size: 12, tensor-model-parallel size: 2, encoder-tensor-model-parallel size: 1, "
     "pipeline-model-parallel size: 2, encoder-pipeline-model-parallel size: 2", dict(world_size=12, dp=2, tp=2, pp=2)),
    # core_v0.10.0 .. core_v0.12.x: 'hierarchical context-parallel sizes: {}' without a comma before the TP field
    ("using world size: 32, data-parallel size: 4, context-parallel size: 2, hierarchical context-parallel sizes: "
     "Nonetensor-model-parallel size: 2, encoder-tensor-model-parallel size: 0, pipeline-model-parallel size: 2, "
     "encoder-pipeline-model-parallel size: 0", dict(world_size=32, dp=4, cp=2, tp=2, pp=2)),
    # core_v0.15 / 0.16 / main; with a torchrun --tee prefix and an srun -l prefix
    ("[default0]:using world size: 8, data-parallel size: 2, context-parallel size: 1, hierarchical context-parallel "
     "sizes: None, tensor-model-parallel size: 2, pipeline-model-parallel size: 2",
     dict(world_size=8, dp=2, cp=1, tp=2, pp=2)),
    ("0: using world size: 8, data-parallel size: 1, context-parallel size: 4, hierarchical context-parallel sizes: "
     "[2, 2], tensor-model-parallel size: 2, pipeline-model-parallel size: 1",
     dict(world_size=8, dp=1, cp=4, tp=2, pp=1)),
])
def test_world_size_line_across_versions(line, expected):
    cfg = parse_log(line + "\n").config
    assert {k: cfg[k] for k in expected} == expected


def test_parser_tolerates_prefixes_and_noise():
    text = "\n".join([
        "[default7]: [2024-05-01 12:00:00] iteration       10/     100 | consumed samples:          640 | "
        "elapsed time per iteration (ms): 812.3 | learning rate: 1.500000E-04 | global batch size:    64 | "
        "lm loss: 1.040000E+01 | mtp_1 loss: 1.100000E+01 | loss scale: 1.0 | grad norm: 3.456 | "
        "number of skipped iterations:   0 | number of nan iterations:   0 |",
        "3: [Rank 3] (after 10 iterations) memory (MB) | allocated: 12.5 | max allocated: 99.5 | reserved: 128.0 "
        "| max reserved: 128.0 | total device memory used: 4000.25",
        "(min, max) time across ranks (ms):",
        "    forward-backward ...............................: (790.12, 790.50)",
        " validation loss at iteration 100 | lm loss value: 5.400000E+00 | lm loss PPL: 2.214064E+02 | ",
        "some unrelated line | with: pipes |",
    ])
    p = parse_log(text)
    assert len(p.iterations) == 1 and p.iterations[0]["mtp_1_loss"] == 11.0 and p.iterations[0]["lm_loss"] == 10.4
    assert p.memory == [{"rank": 3, "iteration": 10, "label": "after 10 iterations", "allocated_mb": 12.5,
                         "max_allocated_mb": 99.5, "reserved_mb": 128.0, "max_reserved_mb": 128.0,
                         "total_device_memory_used_mb": 4000.25}]
    assert p.validation[0]["lm_loss_value"] == 5.4
    assert p.config == {"global_batch_size": 64}
    empty = parse_log("")
    assert empty.iterations == [] and empty.step_time_ms() is None and empty.era == "unknown"
    with pytest.raises(ValueError, match="takes the log text"):
        parse_log(FIXTURES / "v2.6_tp2_pp2_dp2.log")


# ---- record table -----------------------------------------------------------------------------

def _fixture_logs():
    paths = sorted(FIXTURES.glob("*.log"))
    return [parse_log(p.read_text()) for p in paths], [p.stem for p in paths]


def test_record_table_numbers():
    logs, names = _fixture_logs()
    rows = {r["config"]: r for r in record_table(logs, names, notes={"core_v0.5.0_tp2_pp2_dp2": "baseline"})}
    d = rows["core_v0.5.0_tp2_pp2_dp2"]
    assert list(d) == list(COLUMNS)
    assert (d["TP"], d["PP"], d["CP"], d["DP"], d["micro-batches"]) == (2, 2, 1, 2, 64 // (4 * 2))
    assert d["max mem/rank (MB)"] == round(3071557632 / 2**20, 2)
    assert d["step time (ms)"] == round((811.0 + 812.4) / 2, 2)
    assert d["tokens/s"] == pytest.approx(64 * 1024 / (811.7 / 1000), abs=0.05)
    assert d["notes"] == "lm loss 10.512 -> 6.200; baseline"
    f = rows["core_v0.16.0_tp2_pp2_cp2"]
    assert (f["CP"], f["DP"], f["micro-batches"]) == (2, 1, 16)
    assert f["tokens/s"] == pytest.approx(64 * 1024 / 0.9017, abs=0.05)
    assert "TFLOP/s/GPU" in rows["core_v0.15.3_tp4_pp1_dp2"]["notes"]
    v = rows["v2.6_tp2_pp2_dp2"]
    assert v["micro-batches"] is None and v["tokens/s"] is None and "2 skipped iterations" in v["notes"]
    # seq_length given by hand when the log has no arguments block
    assert record_table([logs[names.index("v2.6_tp2_pp2_dp2")]], ["v"], seq_length=1024)[0]["tokens/s"] == \
        pytest.approx(64 * 1024 / 0.850, abs=0.05)
    assert record_table([""], ["crashed"])[0]["notes"] == "no iteration lines (crashed, OOM or still running?)"
    with pytest.raises(ValueError, match="2 logs but 1 names"):
        record_table(logs[:2], ["x"])


def test_markdown_and_csv():
    logs, names = _fixture_logs()
    rows = record_table(logs, names)
    md = to_markdown(rows).splitlines()
    assert md[0] == ("| config | TP | PP | CP | DP | micro-batches | max mem/rank (MB) | step time (ms) | tokens/s "
                     "| notes |")
    assert len(md) == 2 + len(rows)
    assert "| core_v0.5.0_tp2_pp2_dp2 | 2 | 2 | 1 | 2 | 8 | 2929.3 | 811.7 | 80,739 |" in to_markdown(rows)
    assert "| — |" in to_markdown(rows)
    back = list(csv.DictReader(io.StringIO(to_csv(rows))))
    assert [r["config"] for r in back] == names
    assert float(back[names.index("core_v0.5.0_tp2_pp2_dp2")]["step time (ms)"]) == 811.7


def test_report_cli(capsys, tmp_path):
    paths = [str(p) for p in sorted(FIXTURES.glob("*.log"))]
    assert _cli(report_mod, [*paths, "--markdown", str(tmp_path / "t.md"), "--csv", str(tmp_path / "t.csv")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| config | TP |") and "warm-up excluded" in out
    assert (tmp_path / "t.md").read_text().startswith("| config |")
    assert (tmp_path / "t.csv").read_text().startswith("config,TP,PP,CP,DP")
    assert not list(tmp_path.glob(".*.tmp"))       # written atomically, no temporary left behind
    assert _cli(report_mod, [paths[0], "--format", "csv"]) == 0
    assert capsys.readouterr().out.startswith("config,TP,PP")
    with pytest.raises(ValueError, match="no such log file: nope.log"):
        _cli(report_mod, ["nope.log"])


def test_through_the_course_cli(monkeypatch, capsys):
    """The two commands as the lead registers them in course_lib/__main__.py's COMMANDS."""
    import course_lib.__main__ as cli
    monkeypatch.setitem(cli.COMMANDS, "megatron-cmd", ("course_lib.megatron.command", "Megatron-LM commands"))
    monkeypatch.setitem(cli.COMMANDS, "report", ("course_lib.megatron.report", "record table from logs"))
    assert cli.main(["megatron-cmd", "--tp", "2", "--pp", "2", "--cp", "1", "--nproc", "8"]) == 0
    assert "pretrain_gpt.py" in capsys.readouterr().out
    assert cli.main(["megatron-cmd", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: world_size=8") or err.startswith("error: ")
    assert err.count("\n") == 1 and "divisible" in err
    assert cli.main(["report", *map(str, sorted(FIXTURES.glob("*.log")))]) == 0
    assert capsys.readouterr().out.startswith("| config |")


# ---- issue 14: the distributed-optimizer / Megatron-FSDP variants; issue 15: MoE -----------------

# Verified at core_v0.16.1 (55ac708) and main (d98e8a6) by building Megatron's own parser
# (megatron/training/arguments.py::add_megatron_arguments) from each revision's source: all of these
# are option strings of both (see course_lib/megatron/flags.py).
VERIFIED_SHARDING = {"--overlap-grad-reduce", "--overlap-param-gather", "--use-megatron-fsdp",
                     "--data-parallel-sharding-strategy", "--ckpt-format", "--optimizer-cpu-offload",
                     "--optimizer-offload-fraction", "--use-precision-aware-optimizer"}
VERIFIED_MOE = {"--num-experts", "--expert-model-parallel-size", "--expert-tensor-parallel-size", "--moe-router-topk",
                "--moe-router-load-balancing-type", "--moe-aux-loss-coeff", "--moe-token-dispatcher-type",
                "--moe-ffn-hidden-size", "--moe-grouped-gemm", "--swiglu", "--normalization",
                "--position-embedding-type", "--disable-bias-linear", "--untie-embeddings-and-output-weights"}
D = gpu_config(*SEED_SWEEP["D"])
MOE_D = MoESpec(8, expert_model_parallel_size=2)


def _mcore_dataclass_fields() -> dict[str, set[str]]:
    """Field names of the installed megatron-core's config dataclasses, read from its source with ast
    (importing megatron.core costs seconds; a base class's fields count for its subclasses)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("megatron.core")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("megatron-core is not installed (optional extra: pip install .[megatron])")
    root = Path(list(spec.submodule_search_locations)[0])
    classes, bases = {}, {}
    for rel in ("distributed/distributed_data_parallel_config.py", "optimizer/optimizer_config.py",
                "transformer/transformer_config.py", "model_parallel_config.py"):
        for node in ast.walk(ast.parse((root / rel).read_text())):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = {n.target.id for n in node.body
                                      if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
                bases[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]
    for name in classes:
        for base in bases[name]:
            classes[name] |= classes.get(base, set())
    return classes


def test_sharding_and_moe_flag_tables_are_the_verified_lists():
    assert set(SHARDING_FLAGS) == VERIFIED_SHARDING and set(MOE_FLAGS) == VERIFIED_MOE
    for table in (SHARDING_FLAGS, MOE_FLAGS):
        for flag, (v016, main) in table.items():
            for where in (v016, main):
                assert where.startswith("megatron/"), flag
                if "Config." in where and "argparse_meta" not in where:   # generated: field name = flag
                    assert where.rsplit(".", 1)[1] == flag[2:].replace("-", "_"), flag
    assert not (set(SHARDING_FLAGS) | set(MOE_FLAGS)) & set(NOT_MEGATRON_FLAGS)


def test_installed_megatron_core_has_the_fields_these_flags_set():
    fields = _mcore_dataclass_fields()
    for flag, where in MCORE_FIELDS.items():
        cls, field = where.split(".")
        assert field in fields[cls], (flag, where)
    assert set(MCORE_FIELDS) >= set(SHARDING_FLAGS) - {"--ckpt-format"}     # a checkpoint option, not mcore
    assert "num_experts" not in fields["TransformerConfig"]      # --num-experts sets num_moe_experts


def test_sharding_variants_follow_megatrons_rules():
    """validate_args (main d98e8a6): --overlap-param-gather needs the distributed optimizer or
    Megatron-FSDP and --overlap-grad-reduce; Megatron-FSDP needs --ckpt-format fsdp_dtensor and
    CUDA_DEVICE_MAX_CONNECTIONS unset or > 1; --optimizer-cpu-offload needs --use-precision-aware-optimizer."""
    text = sharding_variants(D)
    blocks = text.split("\n\n")
    assert len(blocks) == len(SHARDING) == 4
    used = set()
    for name, block in zip(SHARDING, blocks):
        assert block.startswith(f"# {name} = {SHARDING[name].zero}: each of the DP x CP = 2 ranks keeps 1/2")
        cmd = block[block.index("torchrun") - (0 if SHARDING[name].fsdp else len("CUDA_DEVICE_MAX_CONNECTIONS=1 ")):]
        d = _arg_dict(cmd)
        flags = _flags(cmd)
        assert len(flags) == len(set(flags)), name
        assert set(flags) - {"--nproc_per_node"} <= set(PRETRAIN_FLAGS) | set(SHARDING_FLAGS), name
        used |= set(flags)
        assert "--overlap-grad-reduce" in d and "--overlap-param-gather" in d
        assert ("--use-distributed-optimizer" in d) != ("--use-megatron-fsdp" in d)
        if SHARDING[name].fsdp:
            assert d["--ckpt-format"] == "fsdp_dtensor" and "CUDA_DEVICE_MAX_CONNECTIONS" not in cmd
            assert d["--data-parallel-sharding-strategy"] == {"fsdp": "optim_grads_params",
                                                              "fsdp-optim-grads": "optim_grads"}[name]
            assert "validate_args warns" in block                 # TP 2 with FSDP: said in one line
        else:
            assert cmd.startswith("CUDA_DEVICE_MAX_CONNECTIONS=1 torchrun") and "--ckpt-format" not in d
        assert ("--optimizer-cpu-offload" in d) == ("--use-precision-aware-optimizer" in d) == (name == "offload")
        assert "--bf16" in d and d["--tensor-model-parallel-size"] == "2" and d["--pipeline-model-parallel-size"] == "2"
    assert used >= VERIFIED_SHARDING
    # --distributed-optimizer with dist-opt is printed once; an unknown variant is one line
    once = _flags(megatron_command(D, MegatronRun(sharding="dist-opt", use_distributed_optimizer=True)))
    assert once.count("--use-distributed-optimizer") == 1
    with pytest.raises(ValueError, match="sharding='zero3' is unknown; use one of dist-opt"):
        MegatronRun(sharding="zero3")


def test_moe_command_is_mixtral_style_and_checked():
    cmd = megatron_command(gpu_config(2, 2, sequence_parallel=True), moe=MOE_D)
    d = _arg_dict(cmd)
    flags = _flags(cmd)
    assert len(flags) == len(set(flags)) and set(flags) - {"--nproc_per_node"} <= set(PRETRAIN_FLAGS) | set(MOE_FLAGS)
    assert (d["--num-experts"], d["--expert-model-parallel-size"], d["--moe-router-topk"]) == ("8", "2", "2")
    assert d["--moe-token-dispatcher-type"] == "alltoall" and d["--moe-router-load-balancing-type"] == "aux_loss"
    assert d["--moe-aux-loss-coeff"] == "0.01" and d["--moe-ffn-hidden-size"] == str(512 * 14336 // 4096)
    assert d["--normalization"] == "RMSNorm" and d["--position-embedding-type"] == "rope"
    assert "--expert-tensor-parallel-size" not in d             # Megatron's default: TP
    assert "--moe-grouped-gemm" in d                            # Transformer Engine (the default impl)
    local = _arg_dict(megatron_command(D, MegatronRun(transformer_impl="local"),
                                       MoESpec(8, 4, expert_tensor_parallel_size=1, moe_router_topk=1)))
    assert "--moe-grouped-gemm" not in local and local["--expert-tensor-parallel-size"] == "1"
    used = set(flags) | set(local)
    assert used >= VERIFIED_MOE
    notes = MOE_D.notes(D, None)
    assert notes[0] == ("MoE: 8 experts, top-2; expert grid expert-TP 2 x EP 2 x expert-DP 1 x PP 2 "
                        "(4 experts per rank); dense DP stays 2")
    assert any("MoELayer.forward raises in training unless --sequence-parallel" in n for n in notes)  # TP 2, no SP


@pytest.mark.parametrize("kwargs, cfg, message", [
    (dict(num_experts=6, expert_model_parallel_size=4), D, "num-experts=6 is not divisible by "
                                                           "expert-model-parallel-size=4"),
    (dict(num_experts=8, expert_model_parallel_size=8), D, "world_size=8 is not divisible by "
                                                           "expert-tensor-parallel-size=2 × expert-model-parallel-size=8"),
    (dict(num_experts=4, moe_router_topk=5), D, "moe-router-topk=5"),
    (dict(num_experts=8, moe_token_dispatcher_type="flex"), D, "moe-token-dispatcher-type='flex' is unknown"),
    (dict(num_experts=8, moe_aux_loss_coeff=float("nan")), D, "moe-aux-loss-coeff=nan"),
])
def test_bad_moe_layouts_are_one_line_value_errors(kwargs, cfg, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        megatron_command(cfg, moe=MoESpec(**kwargs))
    assert "\n" not in str(err.value)


def test_torchrun_flags_exist_in_the_installed_torch():
    from torch.distributed.run import get_args_parser

    options = set(get_args_parser()._option_string_actions)
    assert set(TORCHRUN_FLAGS) <= options


def _torchrun_options(cmd: str) -> tuple[argparse.Namespace, list[str]]:
    """The launcher's part of a printed torchrun line, parsed by torch's own parser ($VARs filled in)."""
    from torch.distributed.run import get_args_parser

    env = {"MASTER_ADDR": "node0", "MASTER_PORT": "29500", "JOB_ID": "j1", "NODE_RANK": "1",
           "SLURM_NNODES": "2", "SLURM_JOB_ID": "77"}
    words = shlex.split(re.sub(r"\$(\w+)", lambda m: env[m.group(1)], cmd.replace("\\\n", " ")))
    start = words.index("torchrun") + 1
    return get_args_parser().parse_args(words[start:]), words


def test_cluster_launch_parses_with_torchruns_own_parser():
    text = cluster_launch(D, nodes=2, gpus_per_node=4)
    assert text.startswith("# 2 nodes x 4 GPUs = world 8; global rank = node_rank x 4 + local_rank")
    c10d_cmd, static_cmd = [b for b in text.split("\n\n") if b.lstrip("#").startswith(" ----") and "torchrun" in b][:2]
    c10d_cmd = c10d_cmd[c10d_cmd.index("torchrun"):]
    a, words = _torchrun_options(c10d_cmd)
    assert (a.nnodes, a.nproc_per_node, a.rdzv_backend, a.rdzv_endpoint, a.rdzv_id) == ("2", "4", "c10d",
                                                                                      "node0:29500", "j1")
    assert a.training_script == "pretrain_gpt.py"
    assert shlex.join(a.training_script_args) == shlex.join(_flags_and_values(megatron_command(D)))
    s, _ = _torchrun_options(static_cmd[static_cmd.index("torchrun"):])
    assert (s.nnodes, s.node_rank, s.master_addr, s.master_port, s.rdzv_backend) == ("2", 1, "node0", 29500, "static")
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in text and "# export NCCL_DEBUG=INFO" in text
    assert "export NCCL_DEBUG=INFO" in cluster_launch(D, nodes=2, gpus_per_node=4, debug=True).replace(
        "# export NCCL_DEBUG=INFO", "")
    fsdp = cluster_launch(D, MegatronRun(sharding="fsdp"), nodes=4, gpus_per_node=2)
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" not in fsdp and "# export CUDA_DEVICE_MAX_CONNECTIONS=32" in fsdp
    with pytest.raises(ValueError, match=r"nodes=3 × gpus_per_node=4 = 12 is not the world size 8"):
        cluster_launch(D, nodes=3, gpus_per_node=4)
    with pytest.raises(ValueError, match="rendezvous='etcd' is unknown"):
        cluster.torchrun_command(["x.py"], 2, 2, rendezvous="etcd")


def _flags_and_values(cmd: str) -> list[str]:
    words = shlex.split(cmd.replace("\\\n", " "))
    return words[words.index("pretrain_gpt.py") + 1:]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_sbatch_script_runs_one_torchrun_per_node_at_the_first_host(tmp_path):
    """Run the script with stub scontrol/srun (Slurm's names): MASTER_ADDR is the allocation's first host,
    srun starts one task per node, and each task's torchrun line parses with torch's parser."""
    script = cluster.sbatch_script(["pretrain_gpt.py", "--data-path", "my data/$x"], 2, 8,
                                   env=cluster.environment(tp=2))
    assert "#SBATCH --nodes=2" in script and "#SBATCH --gpus-per-node=8" in script
    assert "#SBATCH --ntasks-per-node=1" in script
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\n[ "$1 $2 $3" = "show hostnames gpu[07-08]" ] && '
                                      'printf "gpu07\\ngpu08\\n"\n')
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\necho "CDMC=$CUDA_DEVICE_MAX_CONNECTIONS"\n'
                                  'for a in "$@"; do printf "%s\\n" "$a"; done\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_NNODES": "2",
           "SLURM_JOB_ID": "4242"}
    out = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "CDMC=1"
    assert lines[1:4] == ["--ntasks-per-node=1", "--kill-on-bad-exit=1", "torchrun"]
    from torch.distributed.run import get_args_parser

    a = get_args_parser().parse_args(lines[4:])
    assert (a.nnodes, a.nproc_per_node, a.rdzv_backend, a.rdzv_endpoint, a.rdzv_id) == ("2", "8", "c10d",
                                                                                      "gpu07:29500", "4242")
    assert a.training_script == "pretrain_gpt.py" and a.training_script_args == ["--data-path", "my data/$x"]


def test_megatron_cmd_cli_cluster_sharding_and_moe(capsys):
    assert _cli(command_mod, ["--config", "D", "--nodes", "2", "--gpus-per-node", "4", "--sharding", "fsdp"]) == 0
    out = capsys.readouterr().out
    assert "# fsdp = ZeRO-3" in out and "srun --ntasks-per-node=1" in out and "--use-megatron-fsdp" in out
    assert _cli(command_mod, ["--config", "D", "--show", "sharding"]) == 0
    assert capsys.readouterr().out.count("torchrun --nproc_per_node 8 pretrain_gpt.py") == 4
    assert _cli(command_mod, ["--config", "D", "--sp", "--num-experts", "8", "--ep", "2"]) == 0
    out = capsys.readouterr().out
    assert "# MoE: 8 experts, top-2" in out and "--expert-model-parallel-size 2" in out
    with pytest.raises(ValueError, match="--nodes and --gpus-per-node go together"):
        _cli(command_mod, ["--nodes", "2"])
    with pytest.raises(ValueError, match="nproc=8 is not nodes=2 × gpus_per_node=8 = 16"):
        _cli(command_mod, ["--nodes", "2", "--gpus-per-node", "8", "--nproc", "8"])
    with pytest.raises(ValueError, match="need --num-experts"):
        _cli(command_mod, ["--ep", "2"])


def test_fsdp_main_grads_dtype_is_printed_when_asked_and_only_for_megatron_fsdp(capsys):
    """Megatron-FSDP's grads are in the param dtype at main (--megatron-fsdp-main-grads-dtype auto, not printed);
    fp32 grads need the flag (main only: MAIN_ONLY_FLAGS), which makes no sense without Megatron-FSDP."""
    from course_lib.megatron.flags import MAIN_ONLY_FLAGS

    assert set(MAIN_ONLY_FLAGS) == {"--megatron-fsdp-main-grads-dtype"} and not set(MAIN_ONLY_FLAGS) & (
        set(SHARDING_FLAGS) | set(PRETRAIN_FLAGS))
    default = _arg_dict(megatron_command(D, MegatronRun(sharding="fsdp")))
    assert "--megatron-fsdp-main-grads-dtype" not in default and "--bf16" in default
    wide = _arg_dict(megatron_command(D, MegatronRun(sharding="fsdp-optim-grads", megatron_fsdp_main_grads_dtype="fp32")))
    assert wide["--megatron-fsdp-main-grads-dtype"] == "fp32"
    for bad, match in ((dict(sharding="dist-opt", megatron_fsdp_main_grads_dtype="fp32"), "is not Megatron-FSDP"),
                       (dict(sharding="fsdp", megatron_fsdp_main_grads_dtype="fp64"), "fp64' is not one of auto")):
        with pytest.raises(ValueError, match=match) as err:
            MegatronRun(**bad)
        assert "\n" not in str(err.value)
    assert _cli(command_mod, ["--config", "D", "--sharding", "fsdp", "--megatron-fsdp-main-grads-dtype", "fp32",
                              "--show", "sharding"]) == 0
    blocks = capsys.readouterr().out.split("\n\n")
    assert [("--megatron-fsdp-main-grads-dtype fp32" in b) for b in blocks[-4:]] == [SHARDING[n].fsdp for n in SHARDING]


# Builds Megatron-LM's own argument parser from a checkout (in a subprocess: imports it cannot satisfy
# here -- triton, regex, pydantic, Python 3.12's typing.override -- are stubbed) and prints its options.
_MEGATRON_PARSER = r"""
import argparse, json, sys, types, typing, warnings
warnings.filterwarnings("ignore")
sys.path.insert(0, sys.argv[1])
if not hasattr(typing, "override"):
    typing.override = lambda f: f

class _Base:
    def __init_subclass__(cls, **kw): pass
    def __init__(self, *a, **k): pass

class _Any:
    def __init__(self, *a, **k): pass
    def __call__(self, *a, **k): return _Any()
    def __getattr__(self, n): return _Any()
    def __mro_entries__(self, bases): return (_Base,)
    def __iter__(self): return iter(())
    def __bool__(self): return False

class _Stub(types.ModuleType):
    __path__ = []
    def __getattr__(self, n):
        if n == "__version__": return "0.0.0"
        if n.startswith("__"): raise AttributeError(n)
        return _Any()

for _ in range(60):
    for m in [k for k in sys.modules if k.startswith("megatron")]:
        del sys.modules[m]
    try:
        from megatron.training.arguments import add_megatron_arguments
        break
    except ModuleNotFoundError as e:
        if e.name.startswith("megatron"): raise
        parts = e.name.split(".")
        for i in range(1, len(parts) + 1):
            sys.modules.setdefault(".".join(parts[:i]), _Stub(".".join(parts[:i])))
parser = argparse.ArgumentParser(allow_abbrev=False)
add_megatron_arguments(parser)
print(json.dumps(sorted(k for k in parser._option_string_actions if k.startswith("--"))))
"""


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_DIR"), reason="set MEGATRON_LM_DIR to a Megatron-LM checkout")
def test_every_flag_is_an_option_of_megatrons_own_parser():
    """The strongest check: the flags the course prints are option strings of the parser Megatron-LM
    itself builds (``add_megatron_arguments``), at core_v0.16.1 and main alike."""
    import json
    import sys

    out = subprocess.run([sys.executable, "-c", _MEGATRON_PARSER, os.environ["MEGATRON_LM_DIR"]],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    options = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert len(options) > 500
    for table in (PRETRAIN_FLAGS, SHARDING_FLAGS, MOE_FLAGS, CHECKPOINT_FLAGS):
        assert set(table) <= options, sorted(set(table) - options)
    assert not {"--data-parallel-size", "--virtual-pipeline-model-parallel-size"} & options


VERIFIED_CHECKPOINT = {"--save", "--save-interval", "--load", "--exit-interval", "--no-load-optim", "--no-load-rng",
                       "--finetune"}


def test_checkpoint_flags_are_the_verified_list_and_the_course_trainers():
    """Megatron-LM's checkpoint flags (--ckpt-format is in SHARDING_FLAGS) print as the course trainer parses them."""
    from course_lib.train import parse_args

    assert set(CHECKPOINT_FLAGS) == VERIFIED_CHECKPOINT and not set(CHECKPOINT_FLAGS) & set(SHARDING_FLAGS)
    for flag, (v016, main) in CHECKPOINT_FLAGS.items():
        for where in (v016, main):
            assert where.startswith("megatron/training/"), flag
            if "Config." in where:
                assert where.split(" ")[0].rsplit(".", 1)[1] == flag[2:].replace("-", "_"), flag
    run = MegatronRun(save="ckpt dir/$x", load="ckpt dir/$x", save_interval=50, exit_interval=200,
                      ckpt_format="torch", no_load_optim=True, no_load_rng=True, finetune=True)
    cmd = megatron_command(gpu_config(*SEED_SWEEP["D"]), run)
    flags = _flags(cmd)
    assert set(flags) - {"--nproc_per_node"} <= set(PRETRAIN_FLAGS) | set(CHECKPOINT_FLAGS) | {"--ckpt-format"}
    assert set(flags) >= VERIFIED_CHECKPOINT | {"--ckpt-format"} and len(flags) == len(set(flags))
    given = _arg_dict(cmd)
    ckpt = [a for flag in [*CHECKPOINT_FLAGS, "--ckpt-format"] for a in (flag, given[flag]) if a is not None]
    a = parse_args(["--uniform-vocab-padding"] + ckpt)          # the course trainer takes the same flags
    assert (a.save, a.load, a.save_interval, a.exit_interval, a.ckpt_format) == ("ckpt dir/$x", "ckpt dir/$x", 50,
                                                                                  200, "torch")
    assert a.no_load_optim and a.no_load_rng and a.finetune
    plain = _flags(megatron_command(gpu_config(*SEED_SWEEP["D"]), MegatronRun(save="c", save_interval=10, load="c")))
    assert "--ckpt-format" not in plain                       # Megatron's default torch_dist: not printed


def test_checkpoint_flags_follow_megatrons_rules(capsys):
    fsdp = MegatronRun(sharding="fsdp", save="c", save_interval=10)
    assert _flags(megatron_command(gpu_config(2, 2), fsdp)).count("--ckpt-format") == 1     # fsdp_dtensor, once
    with pytest.raises(ValueError, match="Megatron FSDP only supports fsdp_dtensor checkpoint format") as err:
        MegatronRun(sharding="fsdp", ckpt_format="torch_dist")
    assert "\n" not in str(err.value)
    for kwargs, message in ((dict(save_interval=10), "save_interval=10 has no folder to save into"),
                            (dict(finetune=True), "finetune=True says what to load"),
                            (dict(save="c", save_interval=10, exit_interval=0), "exit_interval"),
                            (dict(save="c"), "save=c without --save-interval: Megatron's validate_args asserts"),
                            (dict(save="-c"), "save='-c' starts with '-'"),
                            (dict(load="a\nb"), "control character")):
        with pytest.raises(ValueError, match=re.escape(message)):
            MegatronRun(**kwargs)
    assert _cli(command_mod, ["--config", "D", "--show", "sharding", "--save", "c", "--save-interval", "50",
                                   "--ckpt-format", "torch_dist"]) == 0
    out = capsys.readouterr().out
    assert out.count("--ckpt-format torch_dist") == 2 and out.count("--ckpt-format fsdp_dtensor") == 2
    assert _cli(command_mod, ["--config", "D", "--save", "c", "--load", "c", "--save-interval", "50"]) == 0
    assert "--save c \\\n    --save-interval 50 \\\n    --load c" in capsys.readouterr().out
