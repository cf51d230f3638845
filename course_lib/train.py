"""Train the tiny GPT under any TP x PP x CP x DP (+SP, +interleaving) layout: Megatron's flags, Megatron's log lines.

    python -m torch.distributed.run --standalone --nproc-per-node 8 -m course_lib.train \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --num-layers 8 --hidden-size 128 --num-attention-heads 8 --seq-length 64 \\
        --micro-batch-size 2 --global-batch-size 16 --train-iters 20 --lr 1e-3 --log-interval 5

(``python -m course_lib train --nproc-per-node 8 ...`` checks the flags, then runs that command.)
Flag names are ``pretrain_gpt.py``'s (``megatron/training/arguments.py``); there is no
``--data-parallel-size``: DP = world / (TP * PP * CP). A bad value or layout fails with a
one-line error *before* any work starts (:func:`validate_args`: the rules of
:mod:`course_lib.rules`, through :class:`course_lib.topology.ParallelConfig`), and the run
reads every layout fact from that validated config. ``--sequence-parallel`` with TP = 1 is
turned off with a one-line warning, as Megatron does.

One training iteration, as Megatron's ``train_step`` does it:

1. every rank takes its micro-batches of the global batch (``course_lib.data``: Megatron's
   sampler order, sharded by DP rank, cut along the sequence for CP) -- ``m = global /
   (micro * dp)`` micro-batches per pipeline;
2. the pipeline schedule (1F1B, GPipe, or interleaved 1F1B with virtual stages) runs on real
   ranks through :func:`course_lib.pipeline.executor.run_rank_schedule`; the last stage's
   loss per micro-batch is ``sum(token losses) / tokens / m`` (``forward_step``);
3. ``finalize_model_grads``: gradients averaged over the dp-cp group (one coalesced
   all-reduce, then ``/ (dp * cp)``), sequence-parallel LayerNorm gradients summed over TP,
   the tied word-embedding gradient summed over the embedding group (first + last stage);
4. the gradient norm over the model-parallel group (each parameter counted once: TP
   duplicates only on TP rank 0, the last stage's embedding copy not at all), clipping to
   ``--clip-grad``;
5. the optimizer step (Adam(W) or SGD, written out elementwise, so a shard takes exactly the
   step its slice of the full tensor would), then the learning-rate schedule
   (``OptimizerParamScheduler``: warm-up, then constant / linear / cosine decay, in samples).

The reported ``lm loss`` is the mean over every token of the global batch (sum and count
all-reduced over dp-cp), so with dropout off every layout prints the loss a single process
computes on the same global batch with the same padded vocabulary (:func:`train_single_process`;
with ``--uniform-vocab-padding`` that is one model for every layout); ``tests/test_train.py``
checks this to 1e-4 (measured: 1e-7 to 2e-6 over 20 iterations, 8 ranks). The layouts sum in
different orders, so their numbers differ by float32 rounding (~1e-7); stable training keeps
that small, but a loss spike amplifies it (Adam at lr 3e-3 with no warm-up on the 4-layer test
model spikes at iteration 11, and by iteration 20 two layouts differ by percents): use a
warm-up or a smaller lr before reading a loss difference as a bug.

Log lines (rank 0 prints the first two, the last rank the iteration line, every rank with
DP rank 0 its memory line; formats of Megatron core 0.16, read by
:func:`course_lib.megatron.parse_log`)::

    using world size: 8, data-parallel size: 2, context-parallel size: 1, hierarchical context-parallel sizes: None, tensor-model-parallel size: 2, pipeline-model-parallel size: 2
    ------------------------ arguments ------------------------ ... (sorted)
     > number of parameters on (tensor, pipeline) model parallel rank (0, 0): 104000
     [2026-01-01 12:00:00.000000] iteration        5/      20 | consumed samples:           80 | elapsed time per iteration (ms): 812.3 | learning rate: 8.000000E-04 | global batch size:    16 | lm loss: 4.123456E+00 | loss scale: 1.0 | grad norm: 1.234 | number of skipped iterations:   0 | number of nan iterations:   0 |
    [Rank 0] (after 5 iterations) memory (MB) | allocated: 1.23 | max allocated: 4.56 | reserved: 0.00 | max reserved: 0.00 | source: tracked tensor bytes

Like Megatron 0.16 the first iteration is always logged and its statistics stay in the
first interval's average (iteration 5 above averages iterations 1-5); memory is reported
after the first and the second logged iteration. On CPU there is no CUDA allocator: the memory
line reports **tracked tensor bytes** -- parameters + gradients + optimizer state
("allocated"), plus the peak bytes autograd saved for backward during the pipeline schedule
("max allocated") -- and says so in ``| source: ...``. With CUDA it prints
``torch.cuda.memory_allocated`` and friends, exactly like Megatron.

Deviations from Megatron, on purpose: dropout defaults to 0 (Megatron: 0.1) so that layouts
can be compared number for number; ``--uniform-vocab-padding`` (a course flag, which the
course's layouts pass) pads the vocabulary once for every TP size, where
``--make-vocab-size-divisible-by`` alone pads, as in Megatron, to a multiple of it times TP --
a different model for each TP size (see :mod:`course_lib.model`); the loss mask is all ones
(no ``--eod-mask-loss``); no mixed precision (loss scale is always 1.0); ``--pipeline-schedule``
is the course's (Megatron picks 1F1B, or interleaved 1F1B when virtual stages are given).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import shlex
import sys
import time
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from course_lib import comm, rules
from course_lib.data import corpus_tokens
from course_lib.optimizer import LR_DECAY_STYLES, OPTIMIZERS, LRScheduler, Optimizer, clip_grads
from course_lib.topology import ParallelConfig

SCHEDULES = ("1f1b", "gpipe")
MEMORY_SOURCE_CPU = "tracked tensor bytes"

# ============================================================================ arguments


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``python -m course_lib train`` command: Megatron's flags plus torchrun's ``--nproc-per-node``."""
    _add_megatron_arguments(parser)
    parser.add_argument("--nproc-per-node", type=int, default=1,
                        help="ranks to start on this machine (torchrun's flag)")
    return parser


def _add_megatron_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
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
    g.add_argument("--hidden-dropout", type=float, default=0.0, help="Megatron's default is 0.1")
    g.add_argument("--attention-dropout", type=float, default=0.0, help="Megatron's default is 0.1")
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
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--log-interval", type=int, default=5)
    g.add_argument("--distributed-backend", choices=("nccl", "gloo"), default=None,
                   help="default: nccl with one GPU per rank, else gloo")
    g.add_argument("--distributed-timeout-minutes", type=float, default=10.0)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m course_lib.train`` (what torchrun runs on every rank)."""
    parser = argparse.ArgumentParser(prog="python -m course_lib.train", description=__doc__.splitlines()[0])
    return _add_megatron_arguments(parser)


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
MAX_TIMEOUT_MINUTES = 7 * 24 * 60                                   # a week, as course_lib.launch
MAX_SEED = 2 ** 32 - 1


def _check_values(a: argparse.Namespace) -> None:
    """Every flag's value on its own: integers in range, finite numbers in range (no NaN, no inf)."""
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
    rules.number("distributed_timeout_minutes", a.distributed_timeout_minutes, 0.0, MAX_TIMEOUT_MINUTES,
                 low_open=True)


def validate_args(args: argparse.Namespace, world_size: int, *, check_memory: bool = True,
                  ranks_on_this_machine: Optional[int] = None) -> tuple[argparse.Namespace, ParallelConfig]:
    """Check a run's flags for ``world_size`` ranks, like Megatron's ``validate_args``: every
    rule of :mod:`course_lib.rules`, before any work starts.

    Returns ``(args, config)``: a copy of ``args`` with the derived values filled in
    (``data_parallel_size``, ``world_size``, ``global_batch_size``,
    ``virtual_pipeline_model_parallel_size``, ``padded_vocab_size``, ...) and the validated
    :class:`~course_lib.topology.ParallelConfig`, which the run reads its layout from. Raises a
    one-line ``ValueError``. With ``check_memory``, also refuses a run whose estimated bytes
    (:func:`estimate_memory`) exceed the memory this machine has available for
    ``ranks_on_this_machine`` ranks (default ``$LOCAL_WORLD_SIZE``, else ``world_size``).
    No process group, no torch.distributed.
    """
    a = argparse.Namespace(**vars(args))
    _check_values(a)
    tp, pp, cp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.context_parallel_size
    vp = rules.virtual_pipeline_size(
        a.num_layers, pp, virtual_pipeline_model_parallel_size=a.virtual_pipeline_model_parallel_size,
        num_layers_per_virtual_pipeline_stage=a.num_layers_per_virtual_pipeline_stage,
        num_virtual_stages_per_pipeline_rank=a.num_virtual_stages_per_pipeline_rank)
    if vp is not None and a.pipeline_schedule != "1f1b":
        raise ValueError(f"pipeline_schedule={a.pipeline_schedule} runs one model chunk per rank; virtual "
                         f"pipeline stages need the interleaved 1F1B schedule (drop --pipeline-schedule)")
    cfg = ParallelConfig(world_size=world_size, tp=tp, pp=pp, cp=cp, num_layers=a.num_layers,
                         num_attention_heads=a.num_attention_heads, hidden_size=a.hidden_size,
                         seq_length=a.seq_length, micro_batch_size=a.micro_batch_size,
                         global_batch_size=a.global_batch_size, sequence_parallel=a.sequence_parallel,
                         virtual_pipeline_model_parallel_size=vp)
    a.world_size, a.data_parallel_size = world_size, cfg.dp
    a.global_batch_size = cfg.effective_global_batch_size
    a.sequence_parallel = cfg.sequence_parallel                 # off with TP = 1 (cfg.notes says so)
    a.virtual_pipeline_model_parallel_size = cfg.virtual_pipeline_model_parallel_size
    a.num_layers_per_virtual_pipeline_stage = a.num_virtual_stages_per_pipeline_rank = None

    gpt = gpt_config_from_args(a)                               # max positions >= seq, hidden % heads
    a.max_position_embeddings = gpt.max_position_embeddings
    a.ffn_hidden_size = gpt.ffn_hidden_size
    a.padded_vocab_size = gpt.padded_vocab_size
    rules.vocab_divisible_by_tp(gpt.padded_vocab_size, tp)
    rules.ffn_divisible_by_tp(gpt.ffn_hidden_size, tp)
    rules.cp_attention_dropout(a.attention_dropout, cp)
    rules.min_lr(a.min_lr, a.lr)
    a.lr_decay_iters = a.train_iters if a.lr_decay_iters is None else a.lr_decay_iters
    if a.lr_warmup_iters >= a.lr_decay_iters and a.lr_decay_style != "constant":
        raise ValueError(f"lr_warmup_iters={a.lr_warmup_iters} is not below lr_decay_iters={a.lr_decay_iters}: "
                         f"the decay would never start; use fewer warm-up iterations or --lr-decay-style constant")
    rules.seq_length_fits_corpus(a.seq_length, len(corpus_tokens()))
    if check_memory:
        local = ranks_on_this_machine or int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        _check_memory(a, cfg, local)
    return a, cfg


def estimate_memory(a: argparse.Namespace, cfg: ParallelConfig, **halved) -> dict:
    """Bytes one rank of this run needs at its peak, roughly (float32 everywhere):

    * ``weights``: the dense master every rank builds (:func:`course_lib.model.build_model`),
      plus this rank's parameters, gradients and Adam's two moments (4 x its share);
    * ``activations``: what the busiest (first) stage keeps for backward: per layer and
      micro-batch the ``[s/cp, b, h]``-sized tensors of a layer (~16 h + 3 ffn/t per token) and one
      ``[b, heads/t, s/cp, s]`` score matrix, times its layers and the micro-batches in flight
      (all ``m`` for GPipe, ``min(pp, m)`` for 1F1B), plus the logits ``[s/cp, b, V/t]`` (x3);
    * ``batches``: the step's tokens and labels (int64).

    ``halved``: flags whose value to halve first, to see which one weighs most."""
    def value(name):
        v = getattr(a, name)
        return max(1, v // 2) if name in halved else v

    h, L, s, b = value("hidden_size"), a.num_layers, value("seq_length"), value("micro_batch_size")
    ffn = a.ffn_hidden_size if "ffn_hidden_size" not in halved else value("ffn_hidden_size")
    if "hidden_size" in halved and a.ffn_hidden_size == 4 * a.hidden_size:
        ffn = 4 * h                                           # the default follows the hidden size
    V, positions, heads = a.padded_vocab_size, max(value("max_position_embeddings"), s), a.num_attention_heads
    tp, pp, cp = cfg.tp, cfg.pp, cfg.cp
    m = value("global_batch_size") // (b * cfg.dp) or 1
    layer = 4 * h * h + 2 * h * ffn + ffn + 9 * h
    master = V * h + positions * h + L * layer + 2 * h
    mine = V * h // tp + positions * h + (L // pp) * layer // tp + 2 * h
    tokens = (s // cp) * b
    inflight = m if a.pipeline_schedule == "gpipe" else min(pp, m)
    per_layer = tokens * (16 * h + 3 * ffn // tp) + b * max(1, heads // tp) * (s // cp) * s
    return {"weights": 4 * (master + 4 * mine),
            "activations": 4 * (per_layer * (L // pp) * inflight + 3 * tokens * V // tp),
            "batches": 2 * 8 * m * b * s}


_MEMORY_FLAGS = ("hidden_size", "seq_length", "micro_batch_size", "ffn_hidden_size", "global_batch_size",
                 "max_position_embeddings")


def _check_memory(a: argparse.Namespace, cfg: ParallelConfig, ranks: int) -> None:
    """Refuse a run that cannot fit this machine's memory, naming the flag whose halving saves most."""
    parts = estimate_memory(a, cfg)
    needed = ranks * sum(parts.values())
    available = rules.available_memory_bytes()
    if available is None or needed <= available:
        return
    saved = {flag: needed - ranks * sum(estimate_memory(a, cfg, **{flag: True}).values()) for flag in _MEMORY_FLAGS}
    flag = max(saved, key=saved.get)
    detail = (f"{ranks} rank(s) on this machine, each about {rules.format_bytes(parts['weights'])} of weights, "
              f"gradients and optimizer state and {rules.format_bytes(parts['activations'] + parts['batches'])} of "
              f"activations and batches")
    rules.fits_in_memory(flag, getattr(a, flag), needed, available, detail)


def vocab_padding_tp(args: argparse.Namespace) -> int:
    """The TP size the vocabulary is padded for: the run's own (Megatron), or 1 with
    ``--uniform-vocab-padding`` (every layout the same model: what the course's layouts choose)."""
    return 1 if args.uniform_vocab_padding else args.tensor_model_parallel_size


def gpt_config_from_args(args: argparse.Namespace):
    """The :class:`~course_lib.model.GPTConfig` of a run (byte vocabulary, 257 tokens)."""
    from course_lib.data import ByteTokenizer
    from course_lib.model import GPTConfig

    return GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                     vocab_size=ByteTokenizer.vocab_size,
                     make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                     vocab_padding_tp=vocab_padding_tp(args),
                     max_position_embeddings=args.max_position_embeddings, ffn_hidden_size=args.ffn_hidden_size,
                     hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                     init_method_std=args.init_method_std, seed=args.seed)


def _scheduler(args, global_batch_size: int) -> LRScheduler:
    """Megatron's schedule, counted in samples: ``global_batch_size`` per iteration."""
    g = global_batch_size
    return LRScheduler(args.lr, args.min_lr, args.lr_decay_style, args.lr_warmup_iters * g, args.lr_decay_iters * g)


def _optimizer(args, named_params) -> Optimizer:
    return Optimizer(named_params, args.optimizer, weight_decay=args.weight_decay,
                     betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps, momentum=args.sgd_momentum)


# ============================================================================ the parallel run


def _unique_named_params(chunks):
    seen, out = set(), []
    for c, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
    return out


@torch.no_grad()
def _allreduce_dp_grads(params, groups, dp_cp_size: int, kind: str) -> None:
    """Average every gradient over the dp-cp group: one flat all-reduce, then ``/ (dp*cp)``."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    if dp_cp_size == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    flat = _flatten_dense_tensors(grads)
    comm.all_reduce(flat, groups.dp_cp, kind=kind, direction="bwd", source="finish_grad_sync")
    flat.div_(dp_cp_size)
    for g, synced in zip(grads, _unflatten_dense_tensors(flat, grads)):
        g.copy_(synced)


def finalize_model_grads(chunks, groups, config: ParallelConfig) -> None:
    """After the schedule's backward passes, before the optimizer (Megatron's ``finalize_model_grads``,
    ``megatron/core/distributed/finalize_model_grads.py``), in its order:

    1. average every gradient over the dp-cp group (``finish_grad_sync``; kind ``"dp"``, or
       ``"dp-cp"`` when cp > 1: CP ranks hold the same weights and saw different tokens);
    2. with sequence parallelism, sum the LayerNorm (and row-parallel bias) gradients over TP;
    3. sum the tied word-embedding gradient over the embedding group (first + last stage).

    ``config``: the run's validated layout (``groups`` were built from its grid).
    """
    from course_lib.model import allreduce_embedding_grads
    from course_lib.tensor_parallel import allreduce_sequence_parallel_grads

    params = [p for _, p in _unique_named_params(chunks)]
    _allreduce_dp_grads(params, groups, config.dp * config.cp, _dp_kind(config))
    if config.sequence_parallel:
        allreduce_sequence_parallel_grads(torch.nn.ModuleList(chunks), groups.tp)
    allreduce_embedding_grads(chunks, groups)


def _dp_kind(config: ParallelConfig) -> str:
    """The comm kind of the gradient and loss reductions: ``"dp"``, or ``"dp-cp"`` when cp > 1."""
    return "dp" if config.cp == 1 else "dp-cp"


@torch.no_grad()
def grad_norm(params, groups, tp_rank: int) -> float:
    """L2 norm of the whole model's gradient, each parameter counted once (Megatron's
    ``get_grad_norm_fp32``: skip TP duplicates on TP ranks > 0 and the ``shared`` embedding
    copy), squares summed over the model-parallel (tp-pp) group."""
    from course_lib.tensor_parallel import is_tensor_parallel

    device = params[0].device
    total = torch.zeros(1, dtype=torch.float64, device=device)
    for p in params:
        if p.grad is None or getattr(p, "shared", False):
            continue
        if is_tensor_parallel(p) or tp_rank == 0:
            total += p.grad.double().pow(2).sum()
    comm.all_reduce(total, groups.model, kind="tp-pp", direction="bwd", source="get_grad_norm_fp32")
    return float(total.sqrt())


def _rank_batches(config: ParallelConfig, iteration: int, coords: dict, seed: int, device):
    """Tokens and labels of this rank's ``m`` micro-batches, stacked: ``[m * micro, s / cp]``."""
    from course_lib.data import get_batch, get_batch_on_this_cp_rank

    toks, labs = [], []
    for j in range(config.num_microbatches):
        b = get_batch(iteration, j, coords["dp"], config.dp, config.micro_batch_size, config.seq_length, seed,
                      global_batch_size=config.effective_global_batch_size)
        b = get_batch_on_this_cp_rank({"tokens": b["tokens"], "labels": b["labels"]}, coords["cp"], config.cp)
        toks.append(b["tokens"])
        labs.append(b["labels"])
    return torch.cat(toks).to(device), torch.cat(labs).to(device)


def _log(line: str) -> None:
    """Print one log line with a single write: several ranks share torchrun's stdout, and
    ``print`` writes the text and its newline separately when output is unbuffered, so
    another rank's line could land between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _print_world_line(config: ParallelConfig) -> None:
    _log(f"using world size: {config.world_size}, data-parallel size: {config.dp}, "
         f"context-parallel size: {config.cp}, hierarchical context-parallel sizes: None, "
         f"tensor-model-parallel size: {config.tp}, pipeline-model-parallel size: {config.pp}")


def _print_args(args, title: str = "arguments") -> None:
    """Megatron's ``_print_args``: ``'  {} {} {}'.format(name, '.' * (48 - len(name)), value)``, sorted."""
    lines = ["  {} {} {}".format(k, "." * (48 - len(k)), v) for k, v in vars(args).items()]
    _log(f"------------------------ {title} ------------------------")
    for line in sorted(lines, key=lambda x: x.lower()):
        _log(line)
    _log(f"-------------------- end of {title} ---------------------")


def _memory_line(rank: int, iteration: int, tracked: dict, cuda: bool) -> str:
    mb = 1024.0 * 1024.0
    s = f"(after {iteration} iterations) memory (MB)"
    if cuda:
        s += f" | allocated: {torch.cuda.memory_allocated() / mb:.2f}"
        s += f" | max allocated: {torch.cuda.max_memory_allocated() / mb:.2f}"
        s += f" | reserved: {torch.cuda.memory_reserved() / mb:.2f}"
        s += f" | max reserved: {torch.cuda.max_memory_reserved() / mb:.2f}"
    else:
        s += f" | allocated: {tracked['allocated'] / mb:.2f} | max allocated: {tracked['max_allocated'] / mb:.2f}"
        s += f" | reserved: 0.00 | max reserved: 0.00 | source: {MEMORY_SOURCE_CPU}"
    return f"[Rank {rank}] {s}"


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def pretrain(args: argparse.Namespace, *, config: Optional[ParallelConfig] = None, print_args: bool = True,
             record_comm: bool = True) -> dict:
    """Train on the ranks of the running default process group (torchrun or ``launch``).

    ``args``: from :func:`parse_args`, validated here for this world size; or, with ``config``,
    the pair :func:`validate_args` returned (not checked again). Every layout fact -- sizes, DP,
    micro-batches, sequence parallelism, virtual stages -- is read from the validated config.
    Collective: every rank calls it. Returns this rank's record::

        {"lm_loss": [per-iteration global-batch loss] (last pipeline stage; None elsewhere),
         "logged": [{"iteration", "lm_loss", "elapsed_ms", "learning_rate", "grad_norm"}] (last rank),
         "grad_norm": [...], "learning_rate": [...], "elapsed_ms": [per iteration],
         "comm": {group kind: bytes of the last iteration's collectives on this rank (full
                  tensors, course_lib.comm's convention) and of its pipeline sends},
         "pipeline_events": [(action, stage, start, end)] of the last iteration,
         "memory": {"allocated", "max_allocated"} bytes (tracked), "coords": {...}, "num_parameters": int}
    """
    from course_lib.model import build_model, gpt_loss
    from course_lib.pipeline.check import check_schedule
    from course_lib.pipeline.executor import run_rank_schedule
    from course_lib.pipeline.schedules import build_schedule
    from course_lib.process_groups import new_process_groups

    world, rank = dist.get_world_size(), dist.get_rank()
    if config is None:       # the ranks are running: their memory is already in use, not to be counted again
        args, config = validate_args(args, world, check_memory=False)
    elif config.world_size != world:
        raise ValueError(f"config was validated for world_size={config.world_size} but {world} ranks are running")
    groups = new_process_groups(config.grid, timeout=args.distributed_timeout_minutes * 60)
    c = groups.coords
    tp, pp, cp, vp, m = config.tp, config.pp, config.cp, config.vpp, config.num_microbatches
    global_batch_size = config.effective_global_batch_size
    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if rank == 0:
        for note in config.notes:
            _log(f"WARNING: {note}")
        if print_args:
            _print_world_line(config)
            _print_args(args)

    gpt = gpt_config_from_args(args)
    chunks = build_model(gpt, groups, vp=vp, sequence_parallel=config.sequence_parallel, device=device)
    for chunk in chunks:
        chunk.train()
    named = _unique_named_params(chunks)
    params = [p for _, p in named]
    num_parameters = sum(p.numel() for chunk in chunks for p in chunk.parameters())
    if c["dp"] == 0 and c["cp"] == 0:
        _log(f" > number of parameters on (tensor, pipeline) model parallel rank ({c['tp']}, {c['pp']}): "
             f"{num_parameters}")
    # Megatron's _set_random_seed: seed + 100 * pipeline rank (drives dropout only; weights came from the master)
    torch.manual_seed(args.seed + 100 * c["pp"])

    name = "interleaved" if vp > 1 else args.pipeline_schedule
    schedule = build_schedule(name, pp, m, vp)
    p2p = check_schedule(schedule)
    seq_local = config.seq_length // cp
    shape = (seq_local // (tp if config.sequence_parallel else 1), config.micro_batch_size, config.hidden_size)
    dp_kind = _dp_kind(config)
    optimizer = _optimizer(args, named)
    scheduler = _scheduler(args, global_batch_size)
    lr = scheduler.get_lr()
    last_stage = groups.is_last_stage

    stats: list = []

    def loss_fn(logits, labels):
        total, count = gpt_loss(logits, labels, groups.tp)
        stats.append((total.detach().double(), count.double()))
        return total / count

    record = {"lm_loss": [], "logged": [], "grad_norm": [], "learning_rate": [], "elapsed_ms": [],
              "comm": {}, "pipeline_events": [], "coords": dict(c), "num_parameters": num_parameters}
    total_loss, advanced = 0.0, 0
    report_memory = True
    peak_activation = 0
    dist.barrier()
    interval_start = time.perf_counter()
    for iteration in range(1, args.train_iters + 1):
        it_start = time.perf_counter()
        for p in params:
            p.grad = None
        stats.clear()
        tokens, labels = _rank_batches(config, iteration - 1, c, args.seed, device)
        with comm.CommRecorder() if record_comm else contextlib.nullcontext() as rec:
            out = run_rank_schedule(schedule, c["pp"], dict(enumerate(chunks)), tokens, labels,
                                    activation_shape=shape, pp_group=groups.pp, p2p=p2p, loss_fn=loss_fn)
            peak_activation = max(peak_activation, out["peak_bytes"])
            finalize_model_grads(chunks, groups, config)   # DP(-CP) average, SP LayerNorm grads, tied embeddings
            norm = grad_norm(params, groups, c["tp"])
            clip_grads(params, norm, args.clip_grad)
            optimizer.step(lr)
            lr = scheduler.step(global_batch_size)
            loss = None
            if last_stage:   # the loss of the global batch: token sums and counts over dp-cp
                both = torch.stack([sum(s for s, _ in stats), sum(n for _, n in stats)]).to(device)
                comm.all_reduce(both, groups.dp_cp, kind=dp_kind, direction="fwd", source="loss_reduction")
                loss = float(both[0] / both[1])
        record["lm_loss"].append(loss)
        record["grad_norm"].append(norm)
        record["learning_rate"].append(lr)
        record["elapsed_ms"].append((time.perf_counter() - it_start) * 1000.0)
        if rec is not None:
            kinds: dict = {}
            for e in rec.events:
                if e.op != "recv":
                    kinds[e.kind] = kinds.get(e.kind, 0) + e.bytes
            record["comm"] = kinds
        record["pipeline_events"] = out["events"]
        if loss is not None:
            total_loss += loss
        advanced += 1
        first = iteration == 1
        if iteration % args.log_interval == 0 or first:
            dist.barrier()
            elapsed_ms = (time.perf_counter() - interval_start) * 1000.0 / advanced
            if rank == world - 1:
                avg = total_loss / advanced
                _log(f" [{datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"
                     f" iteration {iteration:8d}/{args.train_iters:8d} |"
                     f" consumed samples: {iteration * global_batch_size:12d} |"
                     f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
                     f" learning rate: {lr:.6E} |"
                     f" global batch size: {global_batch_size:5d} |"
                     f" lm loss: {avg:.6E} |"
                     f" loss scale: 1.0 |"
                     f" grad norm: {norm:.3f} |"
                     f" number of skipped iterations: {0:3d} |"
                     f" number of nan iterations: {0:3d} |")
                record["logged"].append(dict(iteration=iteration, lm_loss=avg, elapsed_ms=elapsed_ms,
                                             learning_rate=lr, grad_norm=norm))
            if not first:   # Megatron 0.16: the first iteration is logged but stays in the interval
                total_loss, advanced = 0.0, 0
                interval_start = time.perf_counter()
            if report_memory:
                held = _bytes(params) + _bytes(p.grad for p in params) + optimizer.state_bytes()
                tracked = {"allocated": held, "max_allocated": held + peak_activation}
                record["memory"] = tracked
                if c["dp"] == 0:
                    _log(_memory_line(rank, iteration, tracked, cuda))
                if iteration > 1:
                    report_memory = False
    record.setdefault("memory", {"allocated": _bytes(params), "max_allocated": _bytes(params) + peak_activation})
    record["peak_activation_bytes"] = peak_activation
    return record


# ============================================================================ single-process reference


def train_single_process(args: argparse.Namespace) -> dict:
    """The reference: the dense :class:`~course_lib.model.GPTModel` in this process, one step per
    global batch (no micro-batches, no torch.distributed), same data, optimizer and schedule.

    Returns ``{"lm_loss": [...], "grad_norm": [...], "learning_rate": [...]}`` per iteration."""
    from course_lib.data import get_global_batch
    from course_lib.model import GPTModel

    if args.global_batch_size is None:
        raise ValueError("train_single_process needs --global-batch-size (the batch every layout shares)")
    one = argparse.Namespace(**vars(args))
    padding_tp = vocab_padding_tp(args)                   # the layout's vocabulary, padded as it pads it
    one.tensor_model_parallel_size = one.pipeline_model_parallel_size = one.context_parallel_size = 1
    one.sequence_parallel = False
    one.virtual_pipeline_model_parallel_size = one.num_layers_per_virtual_pipeline_stage = None
    one.num_virtual_stages_per_pipeline_rank = None
    one.micro_batch_size = args.global_batch_size          # one step = the whole global batch at once
    args, config = validate_args(one, world_size=1)
    model = GPTModel(gpt_config_from_args(args).with_(vocab_padding_tp=padding_tp))
    model.train()
    named = list(model.named_parameters())
    params = [p for _, p in named]
    optimizer = _optimizer(args, named)
    global_batch_size = config.effective_global_batch_size
    scheduler = _scheduler(args, global_batch_size)
    lr = scheduler.get_lr()
    out = {"lm_loss": [], "grad_norm": [], "learning_rate": []}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        for iteration in range(args.train_iters):
            for p in params:
                p.grad = None
            batch = get_global_batch(iteration, global_batch_size, config.seq_length, args.seed)
            loss = model.loss(batch["tokens"], batch["labels"])
            loss.backward()
            norm = float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in params)))
            clip_grads(params, norm, args.clip_grad)
            optimizer.step(lr)
            lr = scheduler.step(global_batch_size)
            out["lm_loss"].append(loss.item())
            out["grad_norm"].append(norm)
            out["learning_rate"].append(lr)
    return out


# ============================================================================ entry points


def _init_distributed(args) -> None:
    from course_lib.launch import init_rank, resolve_backend

    timeout = args.distributed_timeout_minutes * 60
    world = int(os.environ.get("WORLD_SIZE", "1"))
    backend = args.distributed_backend or resolve_backend("auto", world)
    if "MASTER_ADDR" in os.environ and "RANK" in os.environ:
        init_rank(int(os.environ["RANK"]), world, backend, timeout)        # torchrun: env:// rendezvous
    else:                                                                  # plain python: a world of one
        init_rank(0, 1, backend if backend == "gloo" else "gloo", timeout, store=dist.HashStore())


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m course_lib.train`` (under torchrun, or alone as a world of one)."""
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        args, config = validate_args(args, world)                        # before any process group
    except ValueError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    _init_distributed(args)
    try:
        pretrain(args, config=config)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return 0


def args_to_argv(args: argparse.Namespace) -> list[str]:
    """The ``course_lib.train`` flags that reproduce ``args`` (only values that differ from the defaults)."""
    argv = []
    for action in build_parser()._actions:
        if not action.option_strings or action.dest == "help" or not hasattr(args, action.dest):
            continue
        value, flag = getattr(args, action.dest), action.option_strings[0]
        if value == action.default:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            argv.append(flag)
        else:
            argv += [flag, str(value)]
    return argv


def torchrun_argv(args: argparse.Namespace, nproc_per_node: int) -> list[str]:
    """The torchrun command line for ``args`` on ``nproc_per_node`` ranks of this machine."""
    from course_lib.launch import torchrun_command

    return torchrun_command(nproc_per_node, ["-m", "course_lib.train", *args_to_argv(args)])


def run(args: argparse.Namespace) -> int:
    """``python -m course_lib train --nproc-per-node N [Megatron flags]``: check the layout for N
    ranks (a one-line error when it is wrong), print the torchrun command, run it. Ctrl-C, SIGTERM
    or this process's death stop torchrun and every rank (:func:`course_lib.launch.run_torchrun`)."""
    from course_lib.launch import run_torchrun

    n = rules.integer("nproc_per_node", args.nproc_per_node)
    validate_args(args, n)
    cmd = torchrun_argv(args, n)
    print("$ " + shlex.join(["torchrun", *cmd[3:]]), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return run_torchrun(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
