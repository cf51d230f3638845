"""The trainer's flags: Megatron's names, every value and layout rule checked before any work starts.

Like Megatron's ``megatron/training/arguments.py`` (``parse_args`` + ``validate_args``), for the
course's trainer (:mod:`course_lib.train`):

* :func:`add_megatron_arguments` / :func:`build_parser` / :func:`parse_args` -- the flags, with
  ``pretrain_gpt.py``'s names and meanings (there is no ``--data-parallel-size``: DP = world /
  (TP * PP * CP));
* :func:`validate_args` -- each flag's value on its own (:func:`_check_values`), then the layout
  (:class:`~course_lib.topology.ParallelConfig`) and the cross-flag rules, every one from
  :mod:`course_lib.rules`; returns the run's one frozen
  :class:`~course_lib.training.run_config.RunConfig`, which the run reads every value from;
* :func:`estimate_memory` -- a run's bytes per rank, so that a run that cannot fit this machine is
  refused by name (the flag whose halving saves most) instead of dying in an allocation;
* :func:`gpt_config_from_args` -- the model the flags describe; :func:`args_to_argv` -- the flags
  that reproduce a namespace (for the torchrun command line).

Adding a flag: define it in :func:`add_megatron_arguments` (its group), give its value rule in
:func:`_check_values` (a ``rules`` call, or a name in one of the tuples above it), and put any
cross-flag rule in :mod:`course_lib.rules`, called from :func:`validate_args`.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import fields
from typing import Optional, Sequence

from course_lib import rules, sizing
from course_lib.data.source import add_data_arguments, check_data_args, check_datasets
from course_lib.data.source import vocab_size as data_vocab_size
from course_lib.model import GPTConfig
from course_lib.moe.pattern import parse_moe_layer_freq
from course_lib.optimizer import LR_DECAY_STYLES, OPTIMIZERS
from course_lib.safe_files import check_output_dir
from course_lib.sizing.moe import moe_parameter_counts
from course_lib.topology import ParallelConfig
from course_lib.training.run_config import (CheckpointConfig, DataConfig, DistributedConfig, LoggingConfig,
                                            OptimizerConfig, PrecisionConfig, RunConfig, ScheduleConfig,
                                            ShardingConfig)

SCHEDULES = ("1f1b", "gpipe")
MOE_CONFIG_FLAGS = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_aux_loss_coeff", "moe_z_loss_coeff",
                    "moe_layer_freq", "moe_token_dispatcher_type")   # GPTConfig fields of the same names
DESCRIPTION = "Train the tiny GPT under any TP x PP x CP x DP (+SP, +interleaving) layout: Megatron's flags."


def _moe_layer_freq_flag(text: str):
    """``--moe-layer-freq`` for argparse: :func:`~course_lib.moe.pattern.parse_moe_layer_freq`, its
    refusal as argparse's error line (argparse would replace a ValueError's text by its own)."""
    try:
        return parse_moe_layer_freq(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_megatron_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's flags (same names, same meaning as ``megatron/training/arguments.py``)."""
    g = parser.add_argument_group("parallel layout (DP is derived: world / (TP*PP*CP))")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--context-parallel-size", type=int, default=1)
    g.add_argument("--sequence-parallel", action="store_true",
                   help="split LayerNorm/dropout activations along the sequence inside the TP group")
    g.add_argument("--virtual-pipeline-model-parallel-size", type=int, default=None,
                   help="model chunks per pipeline rank (interleaved 1F1B)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="newer Megatron spelling: layers per model chunk")
    g.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                   help="newer Megatron spelling: model chunks per pipeline rank")
    g.add_argument("--model-parallel-size", type=int, default=None,
                   help="removed from Megatron-LM: refused with Megatron's message (use --tensor-model-parallel-size)")
    g.add_argument("--pipeline-schedule", choices=SCHEDULES, default="1f1b",
                   help="course flag: 1f1b (Megatron's) or gpipe; virtual stages imply interleaved 1F1B")
    g = parser.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=8)
    g.add_argument("--hidden-size", type=int, default=128)
    g.add_argument("--num-attention-heads", type=int, default=8)
    g.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 * hidden")
    g.add_argument("--seq-length", type=int, default=64)
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default seq-length")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this times TP (Megatron's meaning)")
    g.add_argument("--uniform-vocab-padding", action="store_true",
                   help="course flag: pad as for TP = 1 on every layout (a multiple of "
                        "--make-vocab-size-divisible-by), so every TP size trains the same model")
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--disable-bias-linear", action="store_true",
                   help="no bias in any linear: attention, MLP, the MoE router and experts (Megatron's "
                        "add_bias_linear=False; expert TP > 1 needs it)")
    g.add_argument("--hidden-dropout", type=float, default=0.0, help="Megatron's default is 0.1")
    g.add_argument("--attention-dropout", type=float, default=0.0, help="Megatron's default is 0.1")
    g = parser.add_argument_group("mixture of experts (Megatron's _add_moe_args; course_lib.moe)")
    g.add_argument("--num-experts", type=int, default=None, help="experts per MoE layer (default: a dense model)")
    g.add_argument("--moe-layer-freq", type=_moe_layer_freq_flag, default=1,
                   help="an int k (layer i is MoE when i %% k == 0) or a 0/1 pattern such as '([1]*3+[0]*1)*2'")
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-ffn-hidden-size", type=int, default=None, help="default ffn-hidden-size")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0, help="Switch load-balancing loss; 1e-2 is a start")
    g.add_argument("--moe-z-loss-coeff", type=float, default=None, help="ST-MoE router z-loss; 1e-3 is a start")
    g.add_argument("--moe-token-dispatcher-type", choices=rules.MOE_DISPATCHERS, default="allgather")
    g.add_argument("--expert-model-parallel-size", type=int, default=1, help="ranks that split the experts")
    g.add_argument("--expert-tensor-parallel-size", type=int, default=None, help="default tensor-model-parallel-size")
    g = parser.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=2)
    g.add_argument("--global-batch-size", type=int, default=None, help="default micro * DP")
    g.add_argument("--train-iters", type=int, default=20)
    g.add_argument("--optimizer", choices=OPTIMIZERS, default="adam")
    g.add_argument("--lr", type=float, default=1e-3)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=LR_DECAY_STYLES, default="linear")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default train-iters")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad", action="store_false",
                   help="train on past a NaN or infinite loss or grad norm (Megatron stops there by default)")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=5)
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="default: nccl with one GPU per rank, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    add_data_arguments(parser)    # --data-path, --split, --tokenizer-type, --vocab-file, --merge-file
    g = parser.add_argument_group("mixed precision (Megatron's _add_mixed_precision_args; course_lib.mixed_precision)")
    g.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 main params and grads")
    g.add_argument("--fp16", action="store_true", help="fp16 compute with loss scaling, fp32 main params")
    g.add_argument("--loss-scale", type=float, default=None, help="constant loss scale (with --fp16, --bf16 or the distributed optimizer, as Megatron); default: dynamic with --fp16, none otherwise")
    g.add_argument("--initial-loss-scale", type=float, default=2 ** 32, help="dynamic loss scaling starts here")
    g.add_argument("--min-loss-scale", type=float, default=1.0, help="dynamic loss scaling never goes below")
    g.add_argument("--loss-scale-window", type=float, default=1000,
                   help="good iterations in a row before the loss scale doubles")
    g.add_argument("--hysteresis", type=int, default=2, help="overflowing iterations tolerated before backing off")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true",
                   help="accumulate and all-reduce grads in fp32 (on with --bf16, as Megatron's validate_args)")
    g = parser.add_argument_group("state sharding (Megatron's _add_distributed_args; course_lib.distributed)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="shard the fp32 main params and optimizer state over the DP (x CP) group (ZeRO-1)")
    g.add_argument("--overlap-grad-reduce", action="store_true",
                   help="a bucket's grad reduction starts in backward as soon as its grads are ready")
    g.add_argument("--overlap-param-gather", action="store_true",
                   help="the param all-gather after the step is waited for in the next forward")
    g.add_argument("--ddp-bucket-size", type=int, default=None,
                   help="elements per grad bucket with --overlap-grad-reduce (default: max(40M, 1M x DP), as "
                        "Megatron's DDP); without overlap, and on pipeline stages after the first, Megatron reduces "
                        "in one bucket whatever is given (the shared embedding keeps a bucket of its own)")
    g.add_argument("--use-megatron-fsdp", action="store_true",
                   help="Megatron-FSDP: shard by --data-parallel-sharding-strategy (turns on the distributed "
                        "optimizer, as Megatron-FSDP v1 does)")
    g.add_argument("--data-parallel-sharding-strategy", choices=rules.SHARDING_STRATEGIES, default="optim_grads_params",
                   help="with --use-megatron-fsdp: no_shard (DDP), optim (ZeRO-1), optim_grads (ZeRO-2), "
                        "optim_grads_params (ZeRO-3)")
    g.add_argument("--megatron-fsdp-main-grads-dtype", choices=("auto", "fp32"), default="auto",
                   help="Megatron-FSDP's grad buffer dtype (Megatron-LM main; default auto = the param dtype: bf16 "
                        "grads for a --bf16 model, 2 bytes per parameter over DP; fp32 asks for 4). The course "
                        "trainer keeps fp32 params under --bf16/--fp16 (autocast), so its grads are fp32 either way")
    g.add_argument("--optimizer-cpu-offload", action="store_true",
                   help="optimizer state and update on the host (needs --use-precision-aware-optimizer)")
    g.add_argument("--use-precision-aware-optimizer", action="store_true",
                   help="Megatron's precision-aware (hybrid device) optimizer path; Adam only")
    g = parser.add_argument_group("checkpointing (Megatron's _add_checkpointing_args; course_lib.training.checkpointing)")
    g.add_argument("--save", default=None, help="folder to save checkpoints into (also at the end of training)")
    g.add_argument("--load", default=None, help="folder to resume from (its latest_checkpointed_iteration.txt)")
    g.add_argument("--save-interval", type=int, default=None, help="save every N iterations")
    g.add_argument("--exit-interval", type=int, default=None, help="save (with --save) and stop at an iteration N divides")
    g.add_argument("--ckpt-format", choices=rules.CKPT_FORMATS, default="torch_dist",
                   help="torch_dist: sharded with global offsets (reshards on load); torch: one file per model-parallel rank "
                        "(Megatron also has torch_dcp and fsdp_dtensor: accepted, but the course saves only these two)")
    g.add_argument("--no-load-optim", action="store_true", help="do not load the optimizer (nor its scheduler)")
    g.add_argument("--no-load-rng", action="store_true", help="do not load the random number generators' states")
    g.add_argument("--finetune", action="store_true",
                   help="load the model only and start from iteration 0 (no optimizer, scheduler or RNG)")
    g = parser.add_argument_group("DeepSpeed (course_lib.deepspeed.engine; DP only)")
    g.add_argument("--deepspeed-config", default=None, metavar="FILE",
                   help="train under deepspeed.initialize from this ds_config.json (ZeRO, offload, precision, "
                        "batch, clipping, optimizer from the file; the model from the flags)")
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m course_lib.train`` (what torchrun runs on every rank)."""
    parser = argparse.ArgumentParser(prog="python -m course_lib.train", description=DESCRIPTION)
    return add_megatron_arguments(parser)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """The flags of ``argv`` (``sys.argv[1:]`` when None), not yet validated."""
    return build_parser().parse_args(argv)


# The value rule of every Megatron flag the trainer takes (layout sizes are named by their flag).
_SIZES = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "train_iters",
          "log_interval", "make_vocab_size_divisible_by")
_OPTIONAL_SIZES = ("ffn_hidden_size", "max_position_embeddings", "global_batch_size", "lr_decay_iters")
_PROBABILITIES = ("hidden_dropout", "attention_dropout")
_NON_NEGATIVE = ("init_method_std", "lr", "min_lr", "weight_decay", "clip_grad")
_FRACTIONS = ("adam_beta1", "adam_beta2", "sgd_momentum")          # in [0, 1): an average that forgets
MAX_SEED = 2 ** 32 - 1


def with_defaults(args: argparse.Namespace, parser: Optional[argparse.ArgumentParser] = None) -> argparse.Namespace:
    """A copy of ``args`` where each flag it lacks takes ``parser``'s default (:func:`build_parser`'s when
    None): a namespace another parser made (a notebook's, the sweep's) reads like the trainer's own."""
    return argparse.Namespace(**{**vars((parser or build_parser()).parse_args([])), **vars(args)})


def _check_values(a: argparse.Namespace) -> None:
    """Every flag's value on its own: integers in range, finite numbers in range (no NaN, no inf)."""
    rules.removed_flag("model-parallel-size", a.model_parallel_size, "tensor-model-parallel-size")
    for dest in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        rules.integer(dest.replace("_", "-"), getattr(a, dest))
    for dest in _SIZES + tuple(d for d in _OPTIONAL_SIZES if getattr(a, d) is not None):
        rules.integer(dest, getattr(a, dest))
    rules.integer("lr_warmup_iters", a.lr_warmup_iters, 0)
    rules.integer("seed", a.seed, 0, MAX_SEED)
    for dest in _PROBABILITIES:
        rules.probability(dest, getattr(a, dest))
    for dest in _NON_NEGATIVE:
        rules.number(dest, getattr(a, dest), 0.0)
    for dest in _FRACTIONS:
        rules.number(dest, getattr(a, dest), 0.0, 1.0, high_open=True)
    rules.number("adam_eps", a.adam_eps, 0.0, low_open=True)      # 0 divides 0 by 0 on never-used vocab rows
    rules.timeout_seconds("distributed_timeout_minutes", a.distributed_timeout_minutes, unit_s=60)
    _check_precision(a)
    _check_moe_values(a)
    for dest in ("ddp_bucket_size", "eval_interval", "eval_iters", "vocab_size"):
        if getattr(a, dest) is not None:
            rules.integer(dest, getattr(a, dest))


def _check_precision(a: argparse.Namespace) -> None:
    """--bf16 / --fp16 exclusive; the loss-scale flags' values, whether or not --fp16 is on."""
    rules.precision(a.bf16, a.fp16)
    rules.loss_scale(a.loss_scale, a.initial_loss_scale, a.min_loss_scale, a.loss_scale_window, a.hysteresis)


def _check_moe_values(a: argparse.Namespace) -> None:
    """The MoE flags' values on their own (sizes >= 1, coefficients >= 0 and finite). Unlike Megatron,
    ``--num-experts 0`` is refused like every size (leave the flag out for a dense model)."""
    for dest in ("num_experts", "moe_ffn_hidden_size", "expert_tensor_parallel_size"):
        if getattr(a, dest) is not None:
            rules.integer(dest, getattr(a, dest))
    rules.integer("moe_router_topk", a.moe_router_topk)
    rules.integer("expert_model_parallel_size", a.expert_model_parallel_size)
    rules.number("moe_aux_loss_coeff", a.moe_aux_loss_coeff, 0.0)
    if a.moe_z_loss_coeff is not None:
        rules.number("moe_z_loss_coeff", a.moe_z_loss_coeff, 0.0)


def _expert_sizes(a: argparse.Namespace) -> dict:
    """``{ep, expert_tp}`` of an MoE run for its :class:`~course_lib.topology.ParallelConfig` (whose grid
    holds the expert grid beside the dense one and validates it); ``{}`` without experts."""
    if not a.num_experts:
        return {}
    return dict(ep=a.expert_model_parallel_size, expert_tp=a.expert_tensor_parallel_size)


def _check_moe(a: argparse.Namespace) -> None:
    """The MoE flags (Megatron's ``validate_args``): experts divisible by EP, expert TP defaults to TP,
    SP with TP > 1, ``--moe-ffn-hidden-size`` defaults to ``--ffn-hidden-size`` and splits over expert
    TP, biases only with expert TP 1. (The expert grid -- world divisible by expert_tp·ep·pp -- is the config's: :func:`_expert_sizes`.)"""
    ep = rules.integer("expert-model-parallel-size", a.expert_model_parallel_size)
    a.expert_model_parallel_size = ep
    a.num_experts = rules.moe_experts(a.num_experts, ep)
    etp = a.expert_tensor_parallel_size
    a.expert_tensor_parallel_size = (a.tensor_model_parallel_size if etp is None
                                     else rules.integer("expert-tensor-parallel-size", etp))
    if a.num_experts is None:
        return
    rules.moe_sequence_parallel(a.num_experts, a.tensor_model_parallel_size, a.sequence_parallel)
    rules.moe_context_parallel(a.num_experts, a.context_parallel_size)
    if a.moe_ffn_hidden_size is None:
        a.moe_ffn_hidden_size = a.ffn_hidden_size
    rules.moe_ffn_divisible_by_expert_tp(a.moe_ffn_hidden_size, a.expert_tensor_parallel_size)
    rules.moe_bias_with_expert_tp(a.num_experts, not a.disable_bias_linear,
                                  a.expert_tensor_parallel_size)


def validate_args(args: argparse.Namespace, world_size: int, *, check_memory: bool = True,
                  ranks_on_this_machine: Optional[int] = None) -> RunConfig:
    """Check a run's flags for ``world_size`` ranks, like Megatron's ``validate_args``: every
    rule of :mod:`course_lib.rules`, before any work starts.

    Returns the run's one frozen :class:`~course_lib.training.run_config.RunConfig` (the model, the
    validated :class:`~course_lib.topology.ParallelConfig`, the schedule, the optimizer, ...), which
    the run reads every value from; its ``arguments`` are the flags with the derived values filled in
    (``data_parallel_size``, ``world_size``, ``global_batch_size``,
    ``virtual_pipeline_model_parallel_size``, ``padded_vocab_size``, ...). A flag ``args`` lacks
    takes the parser's default; ``args`` itself is not changed. Raises a one-line ``UsageError``.
    With ``check_memory``, also refuses a run whose estimated bytes
    (:func:`estimate_memory`) exceed the memory this machine has available for
    ``ranks_on_this_machine`` ranks (default ``$LOCAL_WORLD_SIZE``, else ``world_size``).
    No process group, no torch.distributed. A ``--deepspeed-config`` is folded into the flags before
    (by the entry point, :func:`course_lib.train.validate_args`).
    """
    a = with_defaults(args)
    _check_values(a)
    if a.bf16:       # Megatron's validate_args: bf16 accumulates and all-reduces in fp32
        a.accumulate_allreduce_grads_in_fp32 = True
    tp, pp, cp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.context_parallel_size
    vp = rules.virtual_pipeline_size(
        a.num_layers, pp, virtual_pipeline_model_parallel_size=a.virtual_pipeline_model_parallel_size,
        num_layers_per_virtual_pipeline_stage=a.num_layers_per_virtual_pipeline_stage,
        num_virtual_stages_per_pipeline_rank=a.num_virtual_stages_per_pipeline_rank)
    if vp is not None and a.pipeline_schedule != "1f1b":
        raise rules.UsageError(f"pipeline_schedule={a.pipeline_schedule} runs one model chunk per rank; virtual "
                               f"pipeline stages need the interleaved 1F1B schedule (drop --pipeline-schedule)")
    cfg = ParallelConfig(world_size=world_size, tp=tp, pp=pp, cp=cp, num_layers=a.num_layers,
                         num_attention_heads=a.num_attention_heads, hidden_size=a.hidden_size,
                         seq_length=a.seq_length, micro_batch_size=a.micro_batch_size,
                         global_batch_size=a.global_batch_size, sequence_parallel=a.sequence_parallel,
                         virtual_pipeline_model_parallel_size=vp, **_expert_sizes(a))
    a.world_size, a.data_parallel_size = world_size, cfg.dp
    a.global_batch_size = cfg.effective_global_batch_size
    a.sequence_parallel = cfg.sequence_parallel                 # off with TP = 1 (cfg.notes says so)
    a.virtual_pipeline_model_parallel_size = cfg.virtual_pipeline_model_parallel_size
    a.num_layers_per_virtual_pipeline_stage = a.num_virtual_stages_per_pipeline_rank = None

    data = _data(a)
    check_data_args(data, deepspeed=bool(a.deepspeed_config))   # files, tokenizer
    if a.eval_interval and (_sharding(a).uses_engine or a.deepspeed_config or a.num_experts):
        raise rules.UsageError("--eval-interval runs on the plain trainer only (not with the sharding flags, DeepSpeed or "
                               "--num-experts); drop it or them")
    padding_tp = vocab_padding_tp(a, cfg.tp)                   # the config's TP (Megatron), or 1
    gpt = gpt_config_from_args(a, padding_tp)                   # max positions >= seq, hidden % heads
    a.max_position_embeddings = gpt.max_position_embeddings
    a.ffn_hidden_size = gpt.ffn_hidden_size
    a.padded_vocab_size = gpt.padded_vocab_size
    rules.vocab_divisible_by_tp(gpt.padded_vocab_size, tp)
    rules.ffn_divisible_by_tp(gpt.ffn_hidden_size, tp)
    rules.cp_attention_dropout(a.attention_dropout, cp)
    _check_moe(a)
    rules.min_lr(a.min_lr, a.lr)
    a.lr_decay_iters = a.train_iters if a.lr_decay_iters is None else a.lr_decay_iters
    if a.lr_warmup_iters >= a.lr_decay_iters and a.lr_decay_style != "constant":
        raise rules.UsageError(f"lr_warmup_iters={a.lr_warmup_iters} is not below lr_decay_iters={a.lr_decay_iters}: "
                               f"the decay would never start; use fewer warm-up iterations or --lr-decay-style constant")
    _check_sharding(a, cfg)
    _check_checkpointing(a)
    run = _run_config(a, cfg, gpt_config_from_args(a, padding_tp), data)
    check_datasets(run)                                         # a split too small for one sample
    if check_memory:
        local = ranks_on_this_machine or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        _check_memory(a, cfg, local)
    return run


def _data(a: argparse.Namespace) -> DataConfig:
    return DataConfig(data_path=None if a.data_path is None else tuple(a.data_path), split=a.split,
                      tokenizer_type=a.tokenizer_type, vocab_file=a.vocab_file, merge_file=a.merge_file,
                      vocab_size=a.vocab_size, data_cache_path=a.data_cache_path)


def _section(cls, a: argparse.Namespace, **given):
    """A run-config section from the flags of the same names (``given``: the fields named otherwise)."""
    return cls(**{f.name: getattr(a, f.name) for f in fields(cls) if f.name not in given}, **given)


def _run_config(a: argparse.Namespace, cfg: ParallelConfig, model: GPTConfig, data: DataConfig) -> RunConfig:
    """The checked flags ``a`` as the typed config the run reads (built once, by :func:`validate_args`)."""
    schedule = "interleaved" if cfg.vpp > 1 else a.pipeline_schedule
    return RunConfig(model=model, parallel=cfg, schedule=_section(ScheduleConfig, a, pipeline_schedule=schedule),
                     optimizer=_section(OptimizerConfig, a), precision=_section(PrecisionConfig, a),
                     sharding=_sharding(a, a.sharding_notes), checkpointing=_section(CheckpointConfig, a),
                     data=data, logging=_section(LoggingConfig, a),
                     distributed=DistributedConfig(backend=a.distributed_backend,
                                                   timeout_minutes=a.distributed_timeout_minutes),
                     deepspeed_config=a.deepspeed_config, deepspeed=vars(a).get("deepspeed"),
                     deepspeed_notes=tuple(vars(a).get("deepspeed_notes", ())), arguments=tuple(vars(a).items()))


def _check_sharding(a: argparse.Namespace, cfg: ParallelConfig) -> None:
    """The state-sharding flags (Megatron's validate_args, and what the course's engine runs):
    ``--use-megatron-fsdp`` turns the distributed optimizer on (Megatron-FSDP v1, with Megatron's
    warning in ``a.sharding_notes``); every rule is :func:`course_lib.rules.sharding_flags` /
    :func:`course_lib.rules.sharding_layout`; with ``--num-experts``, :func:`course_lib.rules.moe_state_sharding`."""
    for dest in ("use_distributed_optimizer", "overlap_grad_reduce", "overlap_param_gather", "use_megatron_fsdp",
                 "optimizer_cpu_offload", "use_precision_aware_optimizer"):
        setattr(a, dest, bool(getattr(a, dest)))
    given = [f for f in ("use_distributed_optimizer", "use_megatron_fsdp", "overlap_grad_reduce",
                         "optimizer_cpu_offload") if getattr(a, f)] or ["ddp_bucket_size"]   # as the user wrote them
    a.sharding_notes = ()
    if a.use_megatron_fsdp and not a.use_distributed_optimizer:
        a.use_distributed_optimizer = True
        a.sharding_notes = ("Megatron-FSDP v1 is only compatible with --use-distributed-optimizer. "
                            "Using DistributedOptimizer...",)
    rules.sharding_flags(use_distributed_optimizer=a.use_distributed_optimizer,
                         use_megatron_fsdp=a.use_megatron_fsdp, strategy=a.data_parallel_sharding_strategy,
                         overlap_grad_reduce=a.overlap_grad_reduce, overlap_param_gather=a.overlap_param_gather,
                         optimizer_cpu_offload=a.optimizer_cpu_offload,
                         use_precision_aware_optimizer=a.use_precision_aware_optimizer, optimizer=a.optimizer)
    sharding = _sharding(a)
    if sharding.uses_engine:
        rules.sharding_layout(sharding.strategy, vpp=cfg.vpp, pipeline_schedule=a.pipeline_schedule,
                              num_microbatches=cfg.num_microbatches)
        if a.num_experts:  # the engine reduces over dense DP only
            rules.moe_state_sharding(a.num_experts, given)


def _check_checkpointing(a: argparse.Namespace) -> None:
    """The checkpoint flags (:func:`course_lib.rules.checkpoint_flags`, :func:`course_lib.rules.course_checkpoint`);
    the ``--save`` folder must be writable."""
    if a.use_megatron_fsdp:
        rules.megatron_fsdp_checkpoint(a.ckpt_format)
    rules.checkpoint_flags(save=a.save, load=a.load, save_interval=a.save_interval, exit_interval=a.exit_interval,
                           ckpt_format=a.ckpt_format, finetune=a.finetune, no_load_optim=a.no_load_optim,
                           no_load_rng=a.no_load_rng)
    rules.course_checkpoint(save=a.save, load=a.load, ckpt_format=a.ckpt_format,
                            num_experts=a.num_experts)
    if a.save:
        check_output_dir(a.save, what="--save")


def _sharding(a: argparse.Namespace, notes: Sequence[str] = ()) -> ShardingConfig:
    return _section(ShardingConfig, a, notes=tuple(notes))


def estimate_memory(a: argparse.Namespace, cfg: ParallelConfig, **halved) -> dict:
    """Bytes one rank of this run needs at its peak, roughly, from the sizing formulas
    (:mod:`course_lib.sizing`; float32 everywhere):

    * ``weights``: the dense master every rank builds (:func:`course_lib.model.build_model`;
      :func:`~course_lib.sizing.num_parameters`, Narayanan Eq. 2), plus the model states of this
      rank's parameters (:func:`~course_lib.sizing.parameters_per_rank`, the first stage's): weights,
      gradients and Adam's two moments, 16 bytes each (:func:`~course_lib.sizing.model_state_bytes`);
    * ``activations``: what the busiest (first) stage keeps for backward: Korthikanti's bytes per
      layer and micro-batch (:func:`~course_lib.sizing.activation_bytes_per_layer`, counted in 16 bits
      by the paper, doubled here), times its layers and the micro-batches in flight
      (:func:`~course_lib.sizing.inflight_microbatches`: all ``m`` for GPipe, ``min(pp, m)`` for 1F1B),
      plus the embedding and output terms (:func:`~course_lib.sizing.activation_bytes_outside_layers`);
    * ``batches``: the step's tokens and labels (int64).

    With ``--num-experts`` the weights add every expert and router (:func:`~course_lib.sizing.moe.moe_parameter_counts`)
    to the master, and this rank's share (``experts / (expert_tp·ep·pp)``) to its model states.

    ``halved``: flags whose value to halve first, to see which one weighs most; a halving that breaks
    a rule (a micro-batch count that is no longer whole, a hidden size the heads do not divide)
    raises that rule's ValueError."""
    def value(name):
        v = getattr(a, name)
        return max(1, v // 2) if name in halved else v

    h, L, s, b = value("hidden_size"), a.num_layers, value("seq_length"), value("micro_batch_size")
    ffn = value("ffn_hidden_size")
    if "hidden_size" in halved and a.ffn_hidden_size == 4 * a.hidden_size:
        ffn = 4 * h                                           # the default follows the hidden size
    V, positions, heads = a.padded_vocab_size, max(value("max_position_embeddings"), s), a.num_attention_heads
    tp, pp, cp, vp, sp = cfg.tp, cfg.pp, cfg.cp, cfg.vpp, cfg.sequence_parallel
    m = rules.num_microbatches(value("global_batch_size"), b, cfg.dp)
    master = sizing.num_parameters(L, h, V, positions, ffn)
    mine = sizing.parameters_per_rank(L, h, V, positions, heads, tp, pp, ffn)
    if a.num_experts:   # the master holds every expert; this rank its EP x expert-TP share
        experts = rules.moe_experts(value("num_experts"), cfg.grid.ep)
        counts = moe_parameter_counts(
            num_layers=L, hidden_size=h, num_attention_heads=heads, vocab_size=V, num_experts=experts,
            moe_ffn_hidden_size=a.moe_ffn_hidden_size or ffn, moe_router_topk=min(a.moe_router_topk, experts),
            moe_layer_freq=a.moe_layer_freq, ffn_hidden_size=ffn, max_position_embeddings=positions,
            add_bias_linear=not a.disable_bias_linear)
        master += counts["experts"] + counts["router"]
        mine += counts["experts"] / (cfg.grid.expert_tp * cfg.grid.ep * pp) + counts["router"] / pp
    states = sizing.model_state_bytes(mine, param_bytes=4, grad_bytes=4, k=8).total
    schedule = "interleaved" if vp > 1 else a.pipeline_schedule
    inflight = sizing.inflight_microbatches(pp, m, schedule, vp)[0] / vp    # in whole stages' layers
    per_layer = sizing.activation_bytes_per_layer(s, b, h, heads, tp, sp, "none", cp)
    outside = sizing.activation_bytes_outside_layers(s // cp, b, h, V, tp, pp, sp)
    return {"weights": 4 * master + states,
            "activations": FLOAT32_PER_16_BIT * (per_layer * rules.pipeline_split(L, pp)[0] * inflight + outside),
            "batches": 2 * 8 * m * b * s}


FLOAT32_PER_16_BIT = 2              # the paper counts 16-bit activations; the trainer keeps float32
_MEMORY_FLAGS = ("hidden_size", "seq_length", "micro_batch_size", "ffn_hidden_size", "global_batch_size",
                 "max_position_embeddings", "num_experts")


def available_memory_bytes() -> int | None:
    """Memory this machine can still give (Linux ``MemAvailable``; else free pages; None if unknown)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _check_memory(a: argparse.Namespace, cfg: ParallelConfig, ranks: int) -> None:
    """Refuse a run that cannot fit this machine's memory, naming the flag whose halving saves most
    (among the halvings that keep the layout valid)."""
    parts = estimate_memory(a, cfg)
    needed = ranks * sum(parts.values())
    available = available_memory_bytes()
    if available is None or needed <= available:
        return
    saved = {}
    for flag in _MEMORY_FLAGS:
        try:
            saved[flag] = needed - ranks * sum(estimate_memory(a, cfg, **{flag: True}).values())
        except ValueError:            # this halving breaks a layout rule: not a way out
            continue
    flag = max(saved, key=saved.get)
    detail = (f"{ranks} rank(s) on this machine, each about {rules.format_bytes(parts['weights'])} of weights, "
              f"gradients and optimizer state and {rules.format_bytes(parts['activations'] + parts['batches'])} of "
              f"activations and batches" + (f", {a.num_experts} experts per MoE layer in its master weights"
                                           if a.num_experts else ""))
    rules.fits_in_memory(flag, getattr(a, flag), needed, available, detail)


def vocab_padding_tp(args: argparse.Namespace, tp: Optional[int] = None) -> int:
    """The TP size the vocabulary is padded for: the run's own (Megatron; ``tp``, the validated
    layout's, else the flag's), or 1 with ``--uniform-vocab-padding`` (every layout the same model:
    what the course's layouts choose)."""
    return 1 if args.uniform_vocab_padding else args.tensor_model_parallel_size if tp is None else tp


def gpt_config_from_args(args: argparse.Namespace, padding_tp: Optional[int] = None) -> GPTConfig:
    """The :class:`~course_lib.model.GPTConfig` of a run's flags (the tokenizer's vocabulary: 257 byte
    tokens without ``--tokenizer-type``), the vocabulary padded for ``padding_tp`` (default
    :func:`vocab_padding_tp`). For the bridges that hold flags; the trainer reads ``RunConfig.model``."""
    return GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                     vocab_size=data_vocab_size(_data(args)),
                     make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                     vocab_padding_tp=vocab_padding_tp(args) if padding_tp is None else padding_tp,
                     max_position_embeddings=args.max_position_embeddings, ffn_hidden_size=args.ffn_hidden_size,
                     hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                     init_method_std=args.init_method_std, seed=args.seed,
                     add_bias_linear=not args.disable_bias_linear,
                     **{k: getattr(args, k) for k in MOE_CONFIG_FLAGS})


def args_to_argv(args: argparse.Namespace) -> list[str]:
    """The ``course_lib.train`` flags that reproduce ``args`` (only values that differ from the defaults)."""
    argv = []
    for action in build_parser()._actions:
        if not action.option_strings or action.dest == "help" or not hasattr(args, action.dest):
            continue
        value, flag = getattr(args, action.dest), action.option_strings[0]
        if value == action.default:
            continue
        if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
            argv.append(flag)
        elif action.nargs in ("+", "*") and isinstance(value, (list, tuple)):   # --data-path 0.7 A 0.3 B
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv

