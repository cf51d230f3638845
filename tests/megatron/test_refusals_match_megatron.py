"""What Megatron refuses, the course's trainer refuses, for Megatron's reason (issue 37 item 4).

One table, each row a combination of the trainer's flags that Megatron refuses, run three ways:

* through the course's ``validate_args`` (always): one :class:`~course_lib.rules.UsageError` line that
  names the same rule;
* through megatron-core 0.16.1, live, where the rule lives there (``TransformerConfig``,
  ``OptimizerConfig``, the micro-batch calculator): it raises, and its message names the rule;
* through Megatron-LM's own ``parse_args`` + ``validate_args`` (``megatron_lm_validate.py``) when
  ``MEGATRON_LM_DIR`` names a checkout: it refuses, and its message (or a bare assert's source line) names
  the rule.

A second table holds combinations both accept (Megatron-LM's ``validate_args`` turns sequence parallelism
off with TP 1; so does the course), so the course is not simply refusing everything.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from course_lib.rules import UsageError
from course_lib.training.arguments import parse_args, validate_args

RUNNER = Path(__file__).with_name("megatron_lm_validate.py")
BASE = ("--num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
        "--micro-batch-size 1 --train-iters 2 --lr 1e-3")
OK = "ok"                                                           # Megatron-LM's validate_args lets it pass
SMALL = dict(num_layers=4, hidden_size=64, num_attention_heads=4)     # megatron-core's TransformerConfig


def _transformer_config(**changes):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(**{**SMALL, **changes})


def _optimizer_config(**changes):
    from megatron.core.optimizer import OptimizerConfig

    return OptimizerConfig(**changes)


def _microbatches(global_batch_size, micro_batch_size, data_parallel_size):
    from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator

    return ConstantNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size, False, 0)


@dataclass(frozen=True)
class Refusal:
    rule: str                # the rule, in a few words
    world: int
    flags: str               # on top of BASE
    course: str              # words of the course's line
    megatron_lm: tuple       # Megatron-LM's validate_args: the words of its refusal, or OK where it lets the
                             # combination pass (megatron-core refuses it later); versions may differ
    core: tuple | None = None   # (builder, kwargs, words): megatron-core refuses it live


REFUSALS = [
    Refusal("world divisible by the model-parallel sizes", 3, "--tensor-model-parallel-size 2",
            "world_size=3 is not divisible by tensor-model-parallel-size=2",
            ("world size (3) is not divisible by total_model_size",)),
    Refusal("attention heads divisible by TP", 4, "--tensor-model-parallel-size 4 --num-attention-heads 6 "
            "--hidden-size 72", "num_attention_heads=6 is not divisible by tensor-model-parallel-size=4", (OK,),
            (_transformer_config, dict(num_attention_heads=6, hidden_size=72, tensor_model_parallel_size=4),
             "num_attention_heads (6) must be a multiple of tensor_model_parallel_size (4)")),
    Refusal("hidden size divisible by the heads", 2, "--hidden-size 66",
            "hidden_size=66 is not divisible by num_attention_heads=4",
            ("args.hidden_size % args.num_attention_heads == 0",)),
    Refusal("layers divisible by PP", 4, "--pipeline-model-parallel-size 4 --num-layers 6",
            "num_layers=6 is not divisible by pipeline-model-parallel-size=4",
            ("Number of layers should be divisible by the pipeline-model-parallel size",)),
    Refusal("interleaving needs PP > 1", 2, "--num-layers-per-virtual-pipeline-stage 1",
            "needs pipeline-model-parallel-size > 1",
            ("When interleaved schedule is used, pipeline-model-parallel size should be greater than 1",)),
    Refusal("a stage's layers divisible by the virtual stage's", 4, "--pipeline-model-parallel-size 2 "
            "--num-layers-per-virtual-pipeline-stage 3 --num-layers 8",
            "num_layers_per_virtual_pipeline_stage=3 does not divide the 4 layers per pipeline stage",
            ("number of layers per pipeline stage must be divisible number of layers per virtual pipeline stage",)),
    # megatron-core's interleaved schedule raises this one at the first step (pipeline_parallel/schedules.py)
    Refusal("interleaving needs PP <= micro-batches", 4, "--pipeline-model-parallel-size 2 "
            "--num-layers-per-virtual-pipeline-stage 1 --num-layers 8",
            "microbatch_group_size_per_vp_stage=2 must be in [pp_size=2, num_microbatches=1]", (OK,)),
    Refusal("global batch divisible by micro batch x DP", 2, "--global-batch-size 3",
            "global_batch_size=3 is not divisible by micro_batch_size=1 × data-parallel-size=2",
            (OK, "eval_global_batch_size (3) must be divisible by eval_micro_batch_size (1) * data_parallel_size (2)"),
            (_microbatches, dict(global_batch_size=3, micro_batch_size=1, data_parallel_size=2),
             "global batch size (3) is not divisible by micro batch size (1) times data parallel size (2)")),
    Refusal("sequence divisible by 2 x CP", 2, "--context-parallel-size 2 --seq-length 6",
            "seq_length=6 is not divisible by 2 × context-parallel-size=2",
            ("seq-length should be a multiple of 2 * context-parallel-size",)),
    Refusal("positions cover the sequence", 2, "--seq-length 128",
            "max_position_embeddings=64 is shorter than seq_length=128",
            ("max_position_embeddings (64) must be greater than or equal to seq_length (128)",)),
    Refusal("min_lr <= lr", 2, "--min-lr 1 --lr 0.1", "min_lr=1 is larger than lr=0.1", ("args.min_lr <= args.lr",)),
    Refusal("--save needs --save-interval", 2, "--save ckpt", "without --save-interval",
            ("args.save_interval is not None",)),
    Refusal("--bf16 and --fp16 exclusive", 2, "--bf16 --fp16", "--bf16 and --fp16 are mutually exclusive",
            ("assert not args.bf16",), (_transformer_config, dict(bf16=True, fp16=True), "Only one of self.fp16")),
    Refusal("--overlap-param-gather needs the distributed optimizer", 2, "--overlap-param-gather --overlap-grad-reduce",
            "--overlap-param-gather only supported with distributed optimizer",
            ("--overlap-param-gather only supported with distributed optimizer",)),
    Refusal("--overlap-param-gather needs --overlap-grad-reduce", 2,
            "--overlap-param-gather --use-distributed-optimizer", "needs --overlap-grad-reduce",
            ("Must use --overlap-param-gather with --overlap-grad-reduce",)),
    Refusal("--use-precision-aware-optimizer needs the distributed optimizer", 2, "--use-precision-aware-optimizer",
            "--use-precision-aware-optimizer only supported with distributed optimizer", (OK,),
            (_optimizer_config, dict(use_precision_aware_optimizer=True), "only supported with distributed optimizer")),
    Refusal("--use-precision-aware-optimizer needs Adam", 2,
            "--use-precision-aware-optimizer --use-distributed-optimizer --optimizer sgd",
            "--use-precision-aware-optimizer only supported with adam", (OK,),
            (_optimizer_config, dict(use_precision_aware_optimizer=True, use_distributed_optimizer=True,
                                     optimizer="sgd"), "--use-precision-aware-optimizer only supported with adam")),
    Refusal("--optimizer-cpu-offload needs --use-precision-aware-optimizer", 2,
            "--optimizer-cpu-offload --use-distributed-optimizer",
            "--optimizer-cpu-offload must be used with --use-precision-aware-optimizer",
            ("The optimizer cpu offload must be used in conjunction with `--use-precision-aware-optimizer`",)),
    Refusal("one way to give the virtual stages", 4, "--pipeline-model-parallel-size 2 --num-layers 8 "
            "--num-layers-per-virtual-pipeline-stage 1 --num-virtual-stages-per-pipeline-rank 2 --global-batch-size 4",
            "are given together",
            ("No more than one of the following arguments can be set at the same time",)),
    Refusal("Megatron-FSDP needs the fsdp_dtensor format", 2, "--use-megatron-fsdp",
            "ckpt_format='torch_dist' with --use-megatron-fsdp",
            ("Megatron FSDP only supports fsdp_dtensor checkpoint format",          # core_v0.16.1
             "Megatron-FSDP requires the `fsdp_dtensor` checkpointing format")),    # main
    Refusal("expert parallelism needs experts", 2, "--expert-model-parallel-size 2",
            "expert-model-parallel-size=2 needs experts",
            ("num_experts must be non None to use expert model parallelism",),
            (_transformer_config, dict(expert_model_parallel_size=2), "num_moe_experts must be non None")),
    Refusal("experts divisible by EP", 4, "--num-experts 3 --expert-model-parallel-size 2",
            "num-experts=3 is not divisible by expert-model-parallel-size=2",
            ("Number of experts should be a multiple of expert model parallel_size",)),
    # expert TP defaults to TP (2 here); Megatron-LM's validate_args lets it pass, its TransformerConfig refuses it
    Refusal("biased experts need expert TP 1", 4, "--tensor-model-parallel-size 2 --sequence-parallel "
            "--num-experts 4 --expert-model-parallel-size 2",
            "expert-tensor-parallel-size=2 and biased linears: megatron-core refuses it", (OK,),
            (_transformer_config, dict(num_moe_experts=4, tensor_model_parallel_size=2, sequence_parallel=True,
                                       expert_model_parallel_size=2, expert_tensor_parallel_size=2),
             "Bias in Moe is only supported when ETP==1")),
]

# Combinations Megatron-LM's validate_args accepts (possibly after changing a flag, as it says) and the course too.
ACCEPTED = [
    (4, ""),
    (2, "--sequence-parallel"),                                   # TP 1: both turn sequence parallelism off
    (4, "--tensor-model-parallel-size 2 --sequence-parallel --num-experts 4 --expert-model-parallel-size 2 "
        "--disable-bias-linear"),
    (4, "--tensor-model-parallel-size 2 --sequence-parallel --num-experts 4 --expert-model-parallel-size 2 "
        "--expert-tensor-parallel-size 1"),                         # biased experts at expert TP 1
    (4, "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --num-layers 8 "
        "--global-batch-size 4"),
    (2, "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"),
    (2, "--save ckpt --save-interval 1"),
    (2, "--use-megatron-fsdp --ckpt-format fsdp_dtensor"),
]


def _course(world: int, flags: str):
    return validate_args(parse_args(shlex.split(f"{BASE} {flags}")), world, check_memory=False)


@pytest.mark.parametrize("case", REFUSALS, ids=[c.rule for c in REFUSALS])
def test_the_course_refuses_what_megatron_refuses_in_one_line(case):
    with pytest.raises(UsageError) as err:
        _course(case.world, case.flags)
    line = str(err.value)
    assert case.course in line and "\n" not in line, line


@pytest.mark.parametrize("world,flags", ACCEPTED)
def test_the_course_accepts_what_megatron_accepts(world, flags):
    _course(world, flags)


@pytest.mark.parametrize("case", [c for c in REFUSALS if c.core], ids=[c.rule for c in REFUSALS if c.core])
def test_megatron_core_refuses_the_same_combinations_live(case):
    pytest.importorskip("megatron.core")
    build, kwargs, words = case.core
    with pytest.raises((ValueError, AssertionError)) as err:
        build(**kwargs)
    assert words in str(err.value), str(err.value)


def _command(world: int, flags: str) -> str:
    tp_env = "CUDA_DEVICE_MAX_CONNECTIONS=1 " if "--tensor-model-parallel-size" in flags else ""
    return f"{tp_env}torchrun --nproc_per_node {world} pretrain_gpt.py {BASE} {flags}"


@pytest.mark.skipif(not os.environ.get("MEGATRON_LM_DIR"), reason="set MEGATRON_LM_DIR to a Megatron-LM checkout")
def test_megatron_lm_validate_args_refuses_and_accepts_the_same_combinations():
    refusals = {_command(c.world, c.flags): c for c in REFUSALS}
    accepted = [_command(w, f) for w, f in ACCEPTED]
    request = json.dumps({"commands": [*refusals, *accepted], "main_only": []})
    out = subprocess.run([sys.executable, str(RUNNER), os.environ["MEGATRON_LM_DIR"]], input=request,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    verdicts = json.loads(out.stdout.strip().splitlines()[-1])
    wrong = {c.rule: verdicts[cmd] for cmd, c in refusals.items()
             if not any(verdicts[cmd] == OK if words == OK else words in verdicts[cmd] for words in c.megatron_lm)}
    assert not wrong, wrong
    assert all(verdicts[cmd] == "ok" for cmd in accepted), {c: verdicts[c] for c in accepted}
