"""Train the tiny GPT under any TP x PP x CP x DP (+SP, +interleaving) layout: Megatron's flags, Megatron's log lines.

    python -m torch.distributed.run --standalone --nproc-per-node 8 -m course_lib.train \\
        --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 \\
        --num-layers 8 --hidden-size 128 --num-attention-heads 8 --seq-length 64 \\
        --micro-batch-size 2 --global-batch-size 16 --train-iters 20 --lr 1e-3 --log-interval 5

(``python -m course_lib train --nproc-per-node 8 ...`` checks the flags, then runs that command.)
Flag names are ``pretrain_gpt.py``'s (``megatron/training/arguments.py``); there is no
``--data-parallel-size``: DP = world / (TP * PP * CP). A bad layout fails with a one-line
error *before* any process group starts (:func:`validate_args`, built on
:class:`course_lib.topology.ParallelConfig`).

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
computes on the same global batch (:func:`train_single_process`); ``tests/test_train.py``
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
can be compared number for number; the vocabulary is padded once for every TP size (see
:mod:`course_lib.model`); the loss mask is all ones (no ``--eod-mask-loss``); no mixed
precision (loss scale is always 1.0); ``--pipeline-schedule`` is the course's (Megatron picks
1F1B, or interleaved 1F1B when virtual stages are given).
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

from course_lib import comm
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
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
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


def _positive(name: str, value, allow_zero: bool = False):
    flag = "--" + name.replace("_", "-")
    lo = 0 if allow_zero else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ValueError(f"{flag}={value!r} must be an integer >= {lo}")


def validate_args(args: argparse.Namespace, world_size: int) -> tuple[argparse.Namespace, ParallelConfig]:
    """Check a run's flags for ``world_size`` ranks, like Megatron's ``validate_args``.

    Returns ``(args, config)``: a copy of ``args`` with the derived values filled in
    (``data_parallel_size``, ``world_size``, ``global_batch_size``,
    ``virtual_pipeline_model_parallel_size``, ``padded_vocab_size``, ...) and the
    :class:`~course_lib.topology.ParallelConfig`. Raises a one-line ``ValueError``.
    Pure: no process group, no torch.distributed.
    """
    a = argparse.Namespace(**vars(args))
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size",
                 "train_iters", "log_interval", "make_vocab_size_divisible_by"):
        _positive(name, getattr(a, name))
    tp, pp, cp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.context_parallel_size

    # virtual pipeline: three spellings, one value
    given = [(f, getattr(a, f)) for f in ("virtual_pipeline_model_parallel_size",
                                         "num_layers_per_virtual_pipeline_stage",
                                         "num_virtual_stages_per_pipeline_rank") if getattr(a, f) is not None]
    if len(given) > 1:
        raise ValueError(f"give only one of --virtual-pipeline-model-parallel-size, "
                         f"--num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank "
                         f"(got {', '.join('--' + f.replace('_', '-') for f, _ in given)})")
    vp = None
    if given:
        name, value = given[0]
        _positive(name, value)
        if name == "num_layers_per_virtual_pipeline_stage":
            if pp == 1:
                raise ValueError("--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1")
            per_stage = a.num_layers // pp
            if a.num_layers % pp or per_stage % value:
                raise ValueError(f"--num-layers-per-virtual-pipeline-stage={value} must divide the layers per "
                                 f"pipeline stage (num_layers / pp = {a.num_layers} / {pp})")
            vp = per_stage // value
        else:
            vp = value
    if vp == 1:
        vp = None                      # Megatron: one chunk per rank is the plain schedule
    if a.sequence_parallel and tp == 1:
        a.sequence_parallel = False    # Megatron: "Disabling sequence parallelism because tensor model
        #                                 parallelism is disabled"

    cfg = ParallelConfig(world_size=world_size, tp=tp, pp=pp, cp=cp, num_layers=a.num_layers,
                         num_attention_heads=a.num_attention_heads, hidden_size=a.hidden_size,
                         seq_length=a.seq_length, micro_batch_size=a.micro_batch_size,
                         global_batch_size=a.global_batch_size, sequence_parallel=a.sequence_parallel,
                         virtual_pipeline_model_parallel_size=vp)
    a.world_size, a.data_parallel_size = world_size, cfg.dp
    a.global_batch_size = cfg.effective_global_batch_size
    a.virtual_pipeline_model_parallel_size = vp
    a.num_layers_per_virtual_pipeline_stage = a.num_virtual_stages_per_pipeline_rank = None

    gpt = gpt_config_from_args(a)                       # hidden % heads, max positions
    a.max_position_embeddings = gpt.max_position_embeddings
    a.ffn_hidden_size = gpt.ffn_hidden_size
    a.padded_vocab_size = gpt.padded_vocab_size
    if gpt.padded_vocab_size % tp:
        raise ValueError(f"the padded vocabulary ({gpt.padded_vocab_size} rows = 257 byte tokens padded to a "
                         f"multiple of --make-vocab-size-divisible-by={a.make_vocab_size_divisible_by}) is not "
                         f"divisible by --tensor-model-parallel-size={tp}; use a multiple of {tp}")
    if gpt.ffn_hidden_size % tp:
        raise ValueError(f"--ffn-hidden-size={gpt.ffn_hidden_size} is not divisible by "
                         f"--tensor-model-parallel-size={tp}")
    for name in ("hidden_dropout", "attention_dropout"):
        if not 0.0 <= getattr(a, name) < 1.0:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(a, name)} must be in [0, 1)")
    if cp > 1 and a.attention_dropout > 0:
        raise ValueError(f"--attention-dropout={a.attention_dropout} is not supported with "
                         f"--context-parallel-size={cp} (the course's ring attention has no dropout); "
                         f"use --attention-dropout 0")
    if vp is not None:
        if a.pipeline_schedule != "1f1b":
            raise ValueError(f"--pipeline-schedule {a.pipeline_schedule} runs one model chunk per rank; virtual "
                             f"pipeline stages need the interleaved 1F1B schedule (drop --pipeline-schedule)")
        from course_lib.pipeline.schedules import check_interleaved_config

        check_interleaved_config(pp, cfg.num_microbatches, vp)
    for name in ("lr", "min_lr", "weight_decay", "clip_grad", "adam_eps"):
        if getattr(a, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(a, name)} must be >= 0")
    a.lr_decay_iters = a.train_iters if a.lr_decay_iters is None else a.lr_decay_iters
    _positive("lr_decay_iters", a.lr_decay_iters)
    _positive("lr_warmup_iters", a.lr_warmup_iters, allow_zero=True)
    if a.lr_warmup_iters >= a.lr_decay_iters and a.lr_decay_style != "constant":
        raise ValueError(f"--lr-warmup-iters={a.lr_warmup_iters} must be < --lr-decay-iters={a.lr_decay_iters}")
    if a.distributed_timeout_minutes <= 0:
        raise ValueError(f"--distributed-timeout-minutes={a.distributed_timeout_minutes} must be > 0")
    _positive("seed", a.seed, allow_zero=True)
    return a, cfg


def gpt_config_from_args(args: argparse.Namespace):
    """The :class:`~course_lib.model.GPTConfig` of a run (byte vocabulary, 257 tokens)."""
    from course_lib.data import ByteTokenizer
    from course_lib.model import GPTConfig

    return GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads, seq_length=args.seq_length,
                     vocab_size=ByteTokenizer.vocab_size,
                     make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                     max_position_embeddings=args.max_position_embeddings, ffn_hidden_size=args.ffn_hidden_size,
                     hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                     init_method_std=args.init_method_std, seed=args.seed)


def _scheduler(args) -> LRScheduler:
    g = args.global_batch_size
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


def finalize_model_grads(chunks, groups) -> None:
    """After the schedule's backward passes, before the optimizer (Megatron's ``finalize_model_grads``,
    ``megatron/core/distributed/finalize_model_grads.py``), in its order:

    1. average every gradient over the dp-cp group (``finish_grad_sync``; kind ``"dp"``, or
       ``"dp-cp"`` when cp > 1: CP ranks hold the same weights and saw different tokens);
    2. sum the sequence-parallel LayerNorm (and row-parallel bias) gradients over TP;
    3. sum the tied word-embedding gradient over the embedding group (first + last stage).
    """
    from course_lib.model import allreduce_embedding_grads
    from course_lib.tensor_parallel import allreduce_sequence_parallel_grads

    params = [p for _, p in _unique_named_params(chunks)]
    kind = "dp" if groups.grid.cp == 1 else "dp-cp"
    _allreduce_dp_grads(params, groups, comm.group_size(groups.dp_cp), kind)
    allreduce_sequence_parallel_grads(torch.nn.ModuleList(chunks), groups.tp)
    allreduce_embedding_grads(chunks, groups)


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


def _rank_batches(args, iteration: int, dp_rank: int, cp_rank: int, device):
    """Tokens and labels of this rank's ``m`` micro-batches, stacked: ``[m * micro, s / cp]``."""
    from course_lib.data import get_batch, get_batch_on_this_cp_rank

    m = args.global_batch_size // (args.micro_batch_size * args.data_parallel_size)
    toks, labs = [], []
    for j in range(m):
        b = get_batch(iteration, j, dp_rank, args.data_parallel_size, args.micro_batch_size, args.seq_length,
                      args.seed, global_batch_size=args.global_batch_size)
        b = get_batch_on_this_cp_rank({"tokens": b["tokens"], "labels": b["labels"]}, cp_rank,
                                      args.context_parallel_size)
        toks.append(b["tokens"])
        labs.append(b["labels"])
    return torch.cat(toks).to(device), torch.cat(labs).to(device)


def _log(line: str) -> None:
    """Print one log line with a single write: several ranks share torchrun's stdout, and
    ``print`` writes the text and its newline separately when output is unbuffered, so
    another rank's line could land between them."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _print_world_line(args) -> None:
    _log(f"using world size: {args.world_size}, data-parallel size: {args.data_parallel_size}, "
         f"context-parallel size: {args.context_parallel_size}, hierarchical context-parallel sizes: None, "
         f"tensor-model-parallel size: {args.tensor_model_parallel_size}, "
         f"pipeline-model-parallel size: {args.pipeline_model_parallel_size}")


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


def pretrain(args: argparse.Namespace, *, print_args: bool = True, record_comm: bool = True) -> dict:
    """Train on the ranks of the running default process group (torchrun or ``launch``).

    ``args``: from :func:`parse_args` (validated here again for this world size). Collective:
    every rank calls it. Returns this rank's record::

        {"lm_loss": [per-iteration global-batch loss] (last pipeline stage; None elsewhere),
         "logged": [{"iteration", "lm_loss", "elapsed_ms", "learning_rate", "grad_norm"}] (last rank),
         "grad_norm": [...], "learning_rate": [...], "elapsed_ms": [per iteration],
         "comm": {group kind: bytes of the last iteration's collectives on this rank (full
                  tensors, course_lib.comm's convention) and of its pipeline sends},
         "pipeline_events": [(action, stage, start, end)] of the last iteration,
         "memory": {"allocated", "max_allocated"} bytes (tracked), "coords": {...}, "num_parameters": int}
    """
    from course_lib.model import build_model, gpt_loss, new_process_groups
    from course_lib.pipeline.check import check_schedule
    from course_lib.pipeline.executor import run_rank_schedule
    from course_lib.pipeline.schedules import build_schedule

    world, rank = dist.get_world_size(), dist.get_rank()
    args, pcfg = validate_args(args, world)
    groups = new_process_groups(pcfg.grid, timeout=args.distributed_timeout_minutes * 60)
    c = groups.coords
    tp, pp, cp = pcfg.tp, pcfg.pp, pcfg.cp
    vp = args.virtual_pipeline_model_parallel_size or 1
    m = pcfg.num_microbatches
    cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if rank == 0 and print_args:
        _print_world_line(args)
        _print_args(args)

    gpt = gpt_config_from_args(args)
    chunks = build_model(gpt, groups, vp=vp, sequence_parallel=args.sequence_parallel, device=device)
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
    seq_local = args.seq_length // cp
    shape = (seq_local // (tp if args.sequence_parallel else 1), args.micro_batch_size, args.hidden_size)
    dp_kind = "dp" if cp == 1 else "dp-cp"
    optimizer = _optimizer(args, named)
    scheduler = _scheduler(args)
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
        tokens, labels = _rank_batches(args, iteration - 1, c["dp"], c["cp"], device)
        with comm.CommRecorder() if record_comm else contextlib.nullcontext() as rec:
            out = run_rank_schedule(schedule, c["pp"], dict(enumerate(chunks)), tokens, labels,
                                    activation_shape=shape, pp_group=groups.pp, p2p=p2p, loss_fn=loss_fn)
            peak_activation = max(peak_activation, out["peak_bytes"])
            finalize_model_grads(chunks, groups)   # DP(-CP) average, SP LayerNorm grads, tied embedding grads
            norm = grad_norm(params, groups, c["tp"])
            clip_grads(params, norm, args.clip_grad)
            optimizer.step(lr)
            lr = scheduler.step(args.global_batch_size)
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
                     f" consumed samples: {iteration * args.global_batch_size:12d} |"
                     f" elapsed time per iteration (ms): {elapsed_ms:.1f} |"
                     f" learning rate: {lr:.6E} |"
                     f" global batch size: {args.global_batch_size:5d} |"
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
    one.tensor_model_parallel_size = one.pipeline_model_parallel_size = one.context_parallel_size = 1
    one.sequence_parallel = False
    one.virtual_pipeline_model_parallel_size = one.num_layers_per_virtual_pipeline_stage = None
    one.num_virtual_stages_per_pipeline_rank = None
    one.micro_batch_size = args.global_batch_size          # one step = the whole global batch at once
    args, _ = validate_args(one, world_size=1)
    model = GPTModel(gpt_config_from_args(args))
    model.train()
    named = list(model.named_parameters())
    params = [p for _, p in named]
    optimizer = _optimizer(args, named)
    scheduler = _scheduler(args)
    lr = scheduler.get_lr()
    out = {"lm_loss": [], "grad_norm": [], "learning_rate": []}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(args.seed)
        for iteration in range(args.train_iters):
            for p in params:
                p.grad = None
            batch = get_global_batch(iteration, args.global_batch_size, args.seq_length, args.seed)
            loss = model.loss(batch["tokens"], batch["labels"])
            loss.backward()
            norm = float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in params)))
            clip_grads(params, norm, args.clip_grad)
            optimizer.step(lr)
            lr = scheduler.step(args.global_batch_size)
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
        validate_args(args, world)                                       # before any process group
    except ValueError as exc:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    _init_distributed(args)
    try:
        pretrain(args)
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

    n = args.nproc_per_node
    _positive("nproc_per_node", n)
    validate_args(args, n)
    cmd = torchrun_argv(args, n)
    print("$ " + shlex.join(["torchrun", *cmd[3:]]), flush=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return run_torchrun(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
